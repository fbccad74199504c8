/* The NEON bodies of attention (attention_neon.c; aarch64 only), chosen by attention.c's per-ISA dispatcher (f16 / f32
 * cache and int8 cache) on the neon and dotprod paths. Signatures: those of
 * attention.c's att_kernels and of att_q8_kernels (attn_common.h). Only attention.c's dispatcher
 * names them. */
#ifndef BITNET_ATTENTION_NEON_H
#define BITNET_ATTENTION_NEON_H

#include "attn_common.h" /* kv_blocks, the att_q8_kernels table */

#if defined(__aarch64__)
void att_scores_neon(const float *const *q, int R, const void *kt, kv_blocks bl, int f16, int n, int hd, float scale,
                     float *const *sc);
void att_wsum_neon(const float *p, const void *vc, kv_blocks bl, int f16, int n, int hd, float *out);
void att_wsum4_f16_neon(const float *const *p, const void *vc, kv_blocks bl, int n, int hd, float *const *out,
                        att_pf *pf);
float att_row_max_neon(const float *x, int n);
/* dotprod: scores by sdot (the CPU has it), else by smull/smlal */
att_q8_kernels att_q8_neon_kernels(int dotprod);
#endif

#endif
