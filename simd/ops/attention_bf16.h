/* Prefill attention in bf16 products (attention_bf16.c), an opt-in of attention.c (ops_set_attention_bf16).
 *
 * A prefill pass's keys and values are converted once per piece of positions (<= ATT_BF16_PIECE) into bf16 pairs,
 * the operand layout of vdpbf16ps and of AMX-BF16's B tiles, and every query row of the chunk (all query heads of
 * the KV head) reuses them: the multiply-adds are then 2 per lane per instruction instead of 1 (vfmadd231ps), with
 * no conversion in the inner loops. Products of two bf16 values are exact in f32 and summed in f32; what changes
 * against the f32 attention is the rounding of q, k, the softmax weights and v to 8 mantissa bits (stated tolerance:
 * tests/test_attention_bf16.py). Decode rows (one row of a sequence) never take it.
 *
 *   kp: [n16 blocks of 16 positions][hd / 2][16 lanes][2]   pair (k[2i][t], k[2i+1][t]) for lane t
 *   vp: [hd / 16 column blocks][ATT_BF16_PIECE / 2][16][2]  pair (v[2u][c], v[2u+1][c]) for lane c
 */
#ifndef BITNET_ATTENTION_BF16_H
#define BITNET_ATTENTION_BF16_H

#include "attn_common.h" /* kv_blocks */

#define ATT_BF16_PIECE 256 /* positions per piece: attention.c's PIECE */

/* whether the bf16 bodies run on vector units here (AVX-512 path and AVX512_BF16); else the scalar ones */
int att_bf16_vector(void);
/* bytes of one thread's workspace (kp, vp, 4 query rows, 4 weight rows) for head_dim hd */
size_t att_bf16_ws_bytes(int hd);
/* the n <= ATT_BF16_PIECE positions of one piece (kb / vb and their blocks already at its first position) ->
 * the workspace's kp and vp; f16: the cache holds f16 bits, else f32 */
void att_bf16_piece(void *ws, const void *kb, kv_blocks kbl, const void *vb, kv_blocks vbl, int f16, int n, int hd);
/* sc[j][t] = scale * sum_i bf16(q[j][i]) * k[i][t], j < R <= 4, t < n (the piece's first n positions, n >= every
 * live[j]); mx[j]: the largest of sc[j][0 .. live[j]) that is not NaN (-inf if none). sc and out (below) have 4 rows
 * of at least n (resp. hd) floats whatever R is: the vector bodies fill rows past R too */
void att_bf16_scores(void *ws, const float *const *q, int R, const int *live, int n, int hd, float scale,
                     float *const *sc, float *mx);
/* softmax's exp for the weighted sums: e = exp(s[j][t] * scale - mx[j]) for t < live[j], j < R (scale 1: rows
 * already scaled; the product is then exact), into the workspace's bf16
 * weight rows (nr of them: 4 for the vector passes, 16 for the tile passes; rows past R and positions past live[j]
 * zero), sum[j] = the f32 sum of row j's e. Its exp is a degree-3 polynomial (relative error at most 1.1e-4, under
 * bf16's rounding), the same floats on every path; not the f32 attention's exp (attn_common.h), which costs more. */
void att_bf16_softmax(void *ws, int hd, float *const *s, float scale, int nr, int R, const int *live, const float *mx,
                      float *sum);
/* out[j][c] = inv[j] * sum_t w_j[t] * v[t][c], j < R <= 4, t < live[j], w_j: weight row j (att_bf16_softmax) */
void att_bf16_wsum(void *ws, int R, const int *live, int hd, const float *inv, float *const *out);

/* 16-row passes on the matrix tiles (tdpbf16ps), where the tile mode is amx on a CPU with AMX-BF16, or emu; a
 * thread's run of att_bf16_scores16 / att_bf16_wsum16 calls goes between att_bf16_tiles_begin (ldtilecfg) and
 * att_bf16_tiles_end (tilerelease) */
int att_bf16_tiles(void);
void att_bf16_tiles_begin(void);
void att_bf16_tiles_end(void);
/* the workspace's 16 score rows (ATT_BF16_PIECE floats apart) and 16 fold temporaries (hd floats apart) */
float *att_bf16_score_rows(void *ws, int hd);
float *att_bf16_temp_rows(void *ws, int hd);
/* score row j (j < 16) = bf16(q[j]) . k over the piece's first n positions, unscaled (att_bf16_softmax takes the
 * scale); rows past R: zero queries; mx[j] (j < R): the largest of row j's first live[j] scores times scale that is
 * not NaN (-inf if none) */
void att_bf16_scores16(void *ws, const float *const *q, int R, const int *live, int n, int hd, float scale,
                       float *mx);
/* out[j][c] = inv[j] * sum_t w_j[t] * v[t][c], j < R <= 16, t < live[j], w_j: weight row j (att_bf16_softmax) */
void att_bf16_wsum16(void *ws, int R, const int *live, int hd, const float *inv, float *const *out);

#endif
