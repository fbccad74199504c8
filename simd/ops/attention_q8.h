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

#include "attn_common.h" /* kv_blocks, BLK, the att_q8_kernels table */

/* scalar / AVX2 / AVX-512; the NEON table (attention_neon.c) is chosen by attention.c's dispatcher */
att_q8_kernels att_q8_kernels_for(int isa);
/* a query head as the scores take it: q = round(x * 127 / max|x|); returns (max|x| / 127) * scale. Once per row and
 * head (attention.c, after RoPE), not once per scores call: a prefill row's pieces and a decode row's piece items
 * would each quantize it again (libm's lrintf is a call per value). */
float att_q8_quantize_query(const float *x, int hd, float scale, int8_t *q);
/* quantize hd floats (a key or a value of one KV head) into position `at` of its block */
void att_q8_store_key(const float *x, int hd, int8_t *block, int at);
void att_q8_store_value(const float *x, int hd, int8_t *block, int at);

#endif
