/* Group-scaled ternary weights ("tg128" in simd/layout.py; gemv_tg.c): one f16 scale per row and group of 128
 * columns, as in the Ternary Bonsai models (GGUF Q2_0), with activations quantized per group of 128 too. */
#ifndef BITNET_TG_H
#define BITNET_TG_H

#include <stdint.h>

#define BK_TG_GROUP 128
#define BK_TG_GROUP_BYTES 544 /* per tile and group: 16 f16 scales (32 bytes), then 8 tile16 blocks (512) */

/* x f32 [m, k] (row stride ldx >= k floats) -> xq int8 [m, k_pad] (0 in padding), xd f32 [m, k_pad/128], xsum int32 [m, k_pad/128]:
 * per group, amax = max|x|, xd = amax / 127, xq = clamp(round_half_even(x * (127 / amax)), -127, 127)
 * (xq = 0 and xd = 0 for an all-zero group), xsum = sum of the group's xq. k_pad % 128 == 0, k <= k_pad. */
void bk_quantize_act_g128(const float *x, int m, int k, int ldx, int k_pad, int8_t *xq, float *xd, int32_t *xsum);

/* out[i, n] for m rows: acc = 0; for g in order: acc = acc + (float)dot_g * (scale[n, g] * xd[i, g]), with
 * dot_g = sum_{k in g} t[n, k] * xq[i, k] exact in int32 (two f32 roundings per group, never fused: every
 * path gives the same bits). */
void bk_gemv_tg(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m, int k_pad,
                float *out, int n);

#endif
