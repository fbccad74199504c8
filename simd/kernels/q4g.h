/* Group-quantized LM head kernel (gemv_q4g.c; layout "q4g_tile16" in simd/layout.py). */
#ifndef BITNET_Q4G_H
#define BITNET_Q4G_H

#include <stdint.h>

#define BK_Q4G_MAX_K 8192 /* keeps |dot| < 2^29 */

/* m >= 1 rows xq [m, k_pad] -> out [m, n] (or raw int32 dots into out_i32 when non-NULL): on the matrix tiles
 * from their crossover up, else up to 64 rows per pass over the head; -1 on allocation failure. */
int bk_gemv_q4g(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, int m, int k_pad,
                const float *act_scale, float *out, int32_t *out_i32, int n);

#endif
