/* Shared by attention.c and attention_q8.c: how a KV head's positions are addressed, and the int8 cache's kernels.
 *
 * int8 cache (kv q8): keys and values of one KV head in blocks of OPS_KT_BLOCK (32) positions, each block
 * OPS_Q8_BLOCK_BYTES(head_dim) bytes: the int8 values, then 32 f32 scales (one per position):
 *   key block   [head_dim/4][32][4] int8 (a position's values 4i..4i+3 in one 32-bit lane) + scale[32]
 *   value block [32][head_dim] int8                                                        + scale[32]
 * x ~= scale * q, scale = max|x| / 127 over the head's head_dim values at that position; head_dim a multiple
 * of 4, at most OPS_Q8_MAX_HD. */
#ifndef BITNET_ATTENTION_Q8_H
#define BITNET_ATTENTION_Q8_H

#include <stdint.h>

/* Positions live in blocks of OPS_KT_BLOCK: block b of one KV head starts at element (pages ? pages[b] : b) * stride
 * of that head's base (a contiguous cache: pages NULL; the paged pool: the sequence's page table). Elements are
 * bytes for the int8 cache. */
typedef struct {
    const int32_t *pages;
    int64_t stride;
} kv_blocks;
#define BLK(bl, b) ((int64_t)((bl).pages ? (bl).pages[(b)] : (b)) * (bl).stride)

/* The int8 cache's kernels for one ISA. Every ISA's body gives the same bits as the scalar one: f32 FMAs in the
 * same order per output element (fmaf in the scalar code), exp on one polynomial, sums over 16 fixed lanes. */
typedef struct {
    /* sc[j][t] = (sum_i q8[j][i] * k[i][t]) * kscale[t] * c[j], q8[j] / c[j]: query j quantized like the cache by
     * att_q8_quantize_query (c[j] = its scale * the softmax scale); j < R <= 4, t < n */
    void (*scores)(const int8_t *const *q8, const float *c, int R, const int8_t *kt, kv_blocks bl, int n, int hd,
                   float *const *sc);
    /* out[j][c] = sum_t (p[j][t] * vscale[t]) * v[t][c], j < R <= 4, t < n (in order) */
    void (*wsum)(const float *const *p, int R, const int8_t *vc, kv_blocks bl, int n, int hd, float *const *out);
    float (*exp_sum)(float *x, int n, float mx); /* x[i] = exp(x[i] - mx); returns the sum */
} att_q8_kernels;

att_q8_kernels att_q8_kernels_for(int isa);
/* a query head as the scores take it: q = round(x * 127 / max|x|); returns (max|x| / 127) * scale. Once per row and
 * head (attention.c, after RoPE), not once per scores call: a prefill row's pieces and a decode row's piece items
 * would each quantize it again (libm's lrintf is a call per value). */
float att_q8_quantize_query(const float *x, int hd, float scale, int8_t *q);
/* quantize hd floats (a key or a value of one KV head) into position `at` of its block */
void att_q8_store_key(const float *x, int hd, int8_t *block, int at);
void att_q8_store_value(const float *x, int hd, int8_t *block, int at);

#endif
