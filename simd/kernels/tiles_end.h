/* The end of one implementation's tile bodies (gemm_tiles.c includes it after gemm_tiles_body.h and
 * gemm_tiles_q4_body.h): the TB_ macros they were written against, undefined for the next implementation. */
#undef TB_FN
#undef TB_CAT
#undef TB_CAT2
#undef TB_SUFFIX
#undef TB_CONFIG
#undef TB_RELEASE
#undef TB_ZERO
#undef TB_LOAD
#undef TB_STORE
#undef TB_DPBSSD
