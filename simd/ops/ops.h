/* Runtime helper kernels of the transformer: everything around the ternary GEMV/GEMM that
 * simd/kernels does not cover. RMSNorm fused with the residual add and the per-token int8 activation
 * quantization, the gated MLP activation, RoPE + KV-cache write + causal attention, embedding lookup.
 * Fusing keeps the number of Python-level calls per layer small (see engine/model.py).
 *
 * All arrays are C-contiguous f32 unless stated; shapes are checked by the Cython wrapper (simd/_ops.pxi).
 * Compiled into the kernels' extension: the ISA choice (set_isa / BITNET_ISA) and the worker pool are
 * simd/kernels' (dispatch.c, threadpool.c), one for every C path.
 */
#ifndef BITNET_OPS_H
#define BITNET_OPS_H

#include <stdint.h>
#include <string.h>

#include "half.h"
#include "kernels.h"

/* f16 -> f32, scalar (exact; subnormals renormalized): shared by the attention and embedding code; the one
 * conversion of simd/kernels/half.h */
static inline float ops_half_to_float(uint16_t h) { return bk_half_to_float(h); }

/* Vector width the helpers use, from the kernels' path: avx512 (which implies AVX512 F+BW+VL, what the
 * attention bodies need) -> 512-bit bodies; avxvnni and avx2 -> 256-bit; scalar and the aarch64 paths -> scalar
 * here (the NEON bodies of norm.c, rescore.c, topk.c and attention_neon.c ask ops_neon() below). */
enum { OPS_ISA_SCALAR = 0, OPS_ISA_AVX2 = 1, OPS_ISA_AVX512 = 2 };
enum { OPS_ACT_RELU2 = 0, OPS_ACT_SILU = 1 };

static inline int ops_isa(void) {
    switch (bk_get_isa()) {
    case BK_ISA_AVX512: return OPS_ISA_AVX512;
    case BK_ISA_AVX2:
    case BK_ISA_AVXVNNI: return OPS_ISA_AVX2;
    default: return OPS_ISA_SCALAR;
    }
}

/* The aarch64 paths (neon, dotprod, i8mm): the helpers with a NEON body take it (norm.c, attention_neon.c). */
static inline int ops_neon(void) {
    const int isa = bk_get_isa();
    return isa == BK_ISA_NEON || bk_isa_has_sdot(isa);
}

/* norm.c */
/* x[m, d] += delta (if delta != NULL); h = rmsnorm(x) * w; then h quantized per row into xq[m, k_pad]
 * (act_scale = 127 / max(max|h|, 1e-5), xq = clamp(round_half_even(h * act_scale)), 0 in padding). */
void ops_add_rmsnorm_quant(float *x, const float *delta, const float *w, int m, int d, float eps, float *h,
                           int8_t *xq, int k_pad, float *act_scale, int32_t *act_sum);
/* x += delta (if not NULL); out = rmsnorm(x) * w */
void ops_add_rmsnorm(float *x, const float *delta, const float *w, int m, int d, float eps, float *out);
/* in place: each of `heads` runs of hd floats from column col0 of every row (row stride ld) := rmsnorm(run) * w */
void ops_head_rmsnorm(float *x, int m, int ld, int col0, int heads, int hd, const float *w, float eps);
/* gu[m, 2*inter] = [gate | up]: f = act(gate) * up, then rmsnorm(f) * w written over the gate half, then
 * quantized into xq[m, k_pad]. w NULL: no norm (models without an FFN sub-norm), f itself is quantized.
 * xq NULL: no quantization (act_scale / act_sum unused; the group-scaled path quantizes per group itself). */
void ops_glu_rmsnorm_quant(float *gu, int m, int inter, int act, const float *w, float eps, int8_t *xq,
                           int k_pad, float *act_scale, int32_t *act_sum);
/* out[i, :] = (float)table[ids[i], :] (f16 table [vocab, d]); returns the index of the first bad id or -1 */
int ops_embed_f16(const uint16_t *table, int64_t vocab, int d, const int32_t *ids, int m, float *out);

/* attention.c */
/* qkv[m, q_dim + 2*kv_dim] (q heads, then k heads, then v heads), rows at positions pos0 .. pos0+m-1:
 * rotates q and k (half-split RoPE, tables cos/sin [n_ctx, head_dim/2]), writes k and v into this layer's
 * cache: k_cache [n_kv, ceil(n_ctx/32), head_dim, 32] (blocks of 32 positions, transposed), v_cache
 * [n_kv, n_ctx, head_dim] (f16 bits for OPS_KV_F16, f32 for OPS_KV_F32; OPS_KV_Q8 below), then causal GQA attention of every row over positions 0 .. its own into
 * out[m, q_dim]. scratch: f32 [scratch_rows >= OPS_ATT_SCRATCH_ROWS, n_ctx] (OPS_ATT_SCRATCH_ROWS rows per thread).
 * Returns 0, or -1 when its workspace (partials of long contexts' pieces) cannot be allocated. */
#define OPS_ATT_SCRATCH_ROWS 4
#define OPS_KT_BLOCK 32
/* kv_type: the cache's element type. OPS_KV_Q8: int8 blocks of 32 positions with one f32 scale per position per
 * KV head (attention_q8.h): k_cache and v_cache [n_kv, ceil(n_ctx/32), OPS_Q8_BLOCK_BYTES(head_dim)] bytes, the
 * paged pools [n_pages, n_kv, OPS_Q8_BLOCK_BYTES(head_dim)] each. */
enum { OPS_KV_F32 = 0, OPS_KV_F16 = 1, OPS_KV_Q8 = 2 };
#define OPS_Q8_BLOCK_BYTES(hd) ((int64_t)OPS_KT_BLOCK * (hd) + OPS_KT_BLOCK * 4)
#define OPS_Q8_MAX_HD 512 /* head_dim of an int8 cache: a multiple of 4, at most this */
int ops_attention(float *qkv, int m, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                  const float *rope_sin, int pos0, void *k_cache, void *v_cache, int kv_type, int n_ctx,
                  float *out, float *scratch, int scratch_rows);
/* The same for a batched step over the paged KV pool: sequence i owns rows seq_rows[i] .. seq_rows[i+1]-1 of
 * qkv / out, at positions seq_pos0[i] .., and its positions live in the pages page_table[i, 0..max_pages-1]
 * (page p holds positions 32p' .. 32p'+31 of block p' of the sequence). Pools of one layer:
 * k_pool [n_pages, n_kv, head_dim, 32] (transposed blocks), v_pool [n_pages, n_kv, 32, head_dim].
 * scratch: f32 [scratch_rows, scratch_len], OPS_ATT_SCRATCH_ROWS rows per thread (fewer rows: fewer
 * threads), scratch_len >= every sequence's last position + 1. Results per row are those of
 * ops_attention on the same sequence alone. */
int ops_attention_paged(float *qkv, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                         const float *rope_sin, int n_seqs, const int32_t *seq_rows, const int32_t *seq_pos0,
                         const int32_t *page_table, int max_pages, void *k_pool, void *v_pool, int kv_type,
                         float *out, float *scratch, int scratch_rows, int scratch_len);
/* How attention splits its work over `threads` threads (attention.c att_plan) for segments of ms[i] rows at positions
 * pos0s[i]..: out[3j .. 3j+2] = (first row, rows, first position) of the j-th run of rows the items go over, in the
 * order they are handed out, then out[3n] = query heads per item. Returns n, -2 when n > max_out (out holds
 * 3 * max_out + 1 ints), -1 without memory. */
int ops_attention_plan(const int32_t *ms, const int32_t *pos0s, int n_segs, int n_heads, int n_kv, int head_dim,
                       int threads, int32_t *out, int max_out);
/* Prefill rows (a segment of more than one row) in bf16 products (attention_bf16.h) when on (default off; f16 and
 * f32 caches, head_dim a multiple of 16 up to 512): process-wide, like the ISA. Decode rows are never affected.
 * ops_attention_bf16_vector: whether its vector bodies (AVX-512 with AVX512_BF16) run here, else scalar ones. */
void ops_set_attention_bf16(int on);
int ops_get_attention_bf16(void);
int ops_attention_bf16_vector(void);

/* rope_kv.c: the first step of attention, per position (attention.c calls them).
 * Half-split RoPE in place on n_heads heads of head_dim floats at x, with this position's cos / sin [head_dim/2]. */
void ops_rope_heads(float *x, int n_heads, int head_dim, const float *cos, const float *sin);
/* One position of one KV head into an f16 cache: v_row[i] = half(v[i]), k_col[i * OPS_KT_BLOCK] = half(k[i])
 * (the key's column of its transposed block), i < head_dim; round to nearest even, a NaN as 0x7e00 with its sign. */
void ops_kv_store_f16(const float *k, const float *v, int head_dim, uint16_t *k_col, uint16_t *v_row);

/* topk.c: indices of the k largest finite-or-inf values of x[n] (unordered) into idx[k]; heap_vals is
 * scratch of k floats. Returns how many were found (k, or fewer when x has NaNs / n < k). */
int ops_topk(const float *x, int n, int k, float *heap_vals, int32_t *idx);

/* rescore.c: for each row r < m of logits [m, vocab] (an approximate LM head's output), the k largest are
 * replaced by the exact f16-head logits fma-chain(table[i, :] (f16 [vocab, d]), x[r, :]) (simd/kernels/gemv_f16.c's
 * float, bit for bit); their indices go to idx [m, k] (unordered, -1 where a row had fewer than k non-NaN
 * logits). heap_vals [m, k] is scratch. */
void ops_head_rescore(const uint16_t *table, int d, const float *x, int m, float *logits, int vocab, int k,
                      float *heap_vals, int32_t *idx);

#endif
