/* Base-3 ternary weights ("tile16b3", gemv_b3.c; layout: simd/layout.py). Same arguments and results as the
 * tile16 drivers (bit-identical), with w in the tile16b3 layout; -1 when the decode scratch cannot be had. */
#ifndef BITNET_B3_H
#define BITNET_B3_H

#include <stddef.h>
#include <stdint.h>

#define B3_SUPER_BLOCKS 5  /* tile16 blocks (16 columns) per superblock */
#define B3_SUPER_BYTES 256 /* bytes of a superblock: 4 planes x 64 */

size_t bk_b3_tile_bytes(int k_pad);
int bk_gemv_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
               int32_t act_sum, float *out, int32_t *out_i32, int n);
int bk_gemm_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad, const float *act_scale,
               const int32_t *act_sum, float *out, int32_t *out_i32, int n);
int bk_gemv_rows_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                    const float *act_scale, const int32_t *act_sum, float *out, int n);
/* the whole matrix decoded into tile16 (dst: N_pad * K_pad / 4 bytes), single-threaded (tests, tools) */
void bk_b3_to_tile16(const uint8_t *w, int n, int k_pad, uint8_t *dst);

#endif
