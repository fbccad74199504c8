/* exp in NEON registers, operation for operation attn_common.h's exp_poly (Cephes' expf polynomial, its
 * constants; fused where exp_poly calls fmaf, nowhere else), so a NEON body gives the bits of a scalar body that
 * calls exp_poly. Arguments must be <= 0, as there: below EXP_LO they give exp(EXP_LO), and 2^n stays a normal
 * float built from its exponent bits. Used by the SiLU gate's NEON body (norm.c) and softmax (attention_neon.c). */
#ifndef BITNET_EXP_NEON_H
#define BITNET_EXP_NEON_H

#if defined(__aarch64__)
#include <arm_neon.h>

#include "attn_common.h"

/* exp_poly without its clamp: exact for EXP_LO <= x <= 0; a lane below EXP_LO, -inf or NaN gives garbage, so only
 * for a caller that throws such lanes away (the SiLU gate zeroes them), one fmaxnm fewer. */
static inline __attribute__((always_inline)) float32x4_t ops_exp_neon_in_range(float32x4_t x) {
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(EXP_LOG2E)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(EXP_LN2_HI)); /* fmaf(-n, hi, x) */
    r = vfmsq_f32(r, n, vdupq_n_f32(EXP_LN2_LO));
    float32x4_t p = vdupq_n_f32(EXP_C0);
    p = vfmaq_f32(vdupq_n_f32(EXP_C1), p, r); /* fmla overwrites its addend: one register copy per coefficient */
    p = vfmaq_f32(vdupq_n_f32(EXP_C2), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_C3), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_C4), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_C5), p, r);
    const float32x4_t y = vaddq_f32(vfmaq_f32(r, vmulq_f32(p, r), r), vdupq_n_f32(1.0f));
    /* 2^n's bits, (n + 127) << 23, as one fixed-point conversion of n + 127 with 23 fraction bits (fcvtzs #23):
     * n is an integer in [-126, 0] here, so both are exact and equal; one instruction fewer than convert, add,
     * shift */
    const int32x4_t e = vcvtq_n_s32_f32(vaddq_f32(n, vdupq_n_f32(127.0f)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(e));
}

static inline __attribute__((always_inline)) float32x4_t ops_exp_neon(float32x4_t x) {
    /* `x > LO ? x : LO`: a NaN gives LO */
    return ops_exp_neon_in_range(vmaxnmq_f32(x, vdupq_n_f32(EXP_LO)));
}
#endif

#endif
