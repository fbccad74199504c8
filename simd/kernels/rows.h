/* Multi-row GEMV (gemv_rows.c): M <= BK_ROWS_MAX tokens against one weight pass, for the verification step of
 * speculative decoding. Bit-identical to M single-token GEMVs (same integer dots, same f32 epilogue). */
#ifndef BITNET_ROWS_H
#define BITNET_ROWS_H

#include <stdint.h>

#define BK_ROWS_MAX 8

/* out[m*n + r] for m < rows: ternary tile16 weights, as bk_gemm_ternary (same arguments). */
void bk_gemv_rows_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                          const float *act_scale, const int32_t *act_sum, float *out, int n);
/* the same on the calling thread, for tiles [tile_begin, tile_end) only */
void bk_gemv_rows_ternary_tiles(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                                const float *act_scale, const int32_t *act_sum, float *out, int n, int tile_begin,
                                int tile_end);
/* int8 head (i8_tile16) for m rows; -1 on allocation failure. */
int bk_gemv_rows_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int m,
                    int k_pad, const float *act_scale, float *out, int n);

#endif
