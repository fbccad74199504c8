/* The "avxvnni" path: AVX2 plus 256-bit vpdpbusd for the ternary GEMV and GEMM (other jobs use the AVX2
 * bodies). Cores with AVX-VNNI but no AVX-512 (Intel Alder Lake and later) run the VEX-encoded bodies.
 * The same template compiled with the EVEX (AVX512-VNNI + VL) encoding runs the identical algorithm on
 * AVX-512 cores, so the path is tested on this machine too (set_isa("avxvnni")); only the encoding of
 * one instruction differs between the two.
 */
#include "kernels.h"

#if defined(__x86_64__)
#include "x86_common.h"

#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define VNNI_DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define VNNI_NAME(stem) stem##_avxvnni
#include "ternary_vnni256.h"
#undef VNNI_TARGET
#undef VNNI_DPBUSD
#undef VNNI_NAME

#define VNNI_TARGET AVX512_TARGET
#define VNNI_DPBUSD(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#define VNNI_NAME(stem) stem##_avxvnni_evex
#include "ternary_vnni256.h"
#undef VNNI_TARGET
#undef VNNI_DPBUSD
#undef VNNI_NAME

void bk_fill_avxvnni(bk_table_t *t, int vex) {
    t->gemv_ternary = vex ? gemv_ternary_avxvnni : gemv_ternary_avxvnni_evex;
    t->gemm_ternary = vex ? gemm_ternary_avxvnni : gemm_ternary_avxvnni_evex;
}
#else
void bk_fill_avxvnni(bk_table_t *t, int vex) {
    (void)t;
    (void)vex;
}
#endif
