/* NEON steps of the ternary tile16 bodies (gemv_ternary.c, gemm_ternary.c, gemv_tg.c). A 64-byte block is 4
 * vectors of 4 rows x 4 bytes; 2-bit plane c of a byte holds columns 4c..4c+3, so plane c meets activation
 * dword c of the block's 16 activations. */
#ifndef BITNET_TERNARY_NEON_H
#define BITNET_TERNARY_NEON_H
#include <arm_neon.h>

/* sdot (dotprod path): acc (4 rows) += the 4 planes of one vector . the block's activations xv; the codes
 * {0,1,2} are valid s8 operands. */
__attribute__((target("arch=armv8.2-a+dotprod")))
static inline int32x4_t ternary_sdot_neon(int32x4_t acc, uint8x16_t v, int8x16_t xv, uint8x16_t m3) {
    acc = vdotq_laneq_s32(acc, vreinterpretq_s8_u8(vandq_u8(v, m3)), xv, 0);
    acc = vdotq_laneq_s32(acc, vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 2), m3)), xv, 1);
    acc = vdotq_laneq_s32(acc, vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 4), m3)), xv, 2);
    return vdotq_laneq_s32(acc, vreinterpretq_s8_u8(vshrq_n_u8(v, 6)), xv, 3);
}

/* Plain NEON (no sdot): the block's activation dword c repeated over 8 lanes (2 rows x 4 bytes) in x[c]. */
static inline void ternary_dwords_neon(const int8_t *xb, int8x8_t x[4]) {
    const int32x4_t xw = vreinterpretq_s32_s8(vld1q_s8(xb));
    x[0] = vreinterpret_s8_s32(vdup_laneq_s32(xw, 0)), x[1] = vreinterpret_s8_s32(vdup_laneq_s32(xw, 1));
    x[2] = vreinterpret_s8_s32(vdup_laneq_s32(xw, 2)), x[3] = vreinterpret_s8_s32(vdup_laneq_s32(xw, 3));
}

/* Plain NEON: *lo (rows 0, 1 of the vector, one int16 lane per row and byte) and *hi (rows 2, 3) += plane c of
 * v times x[c], by widening multiply-accumulate (smlal): a lane gains at most 4 * 2 * 128 per block. */
static inline void ternary_smlal_neon(int16x8_t *lo, int16x8_t *hi, uint8x16_t v, const int8x8_t x[4],
                                      uint8x16_t m3) {
    int8x16_t c0 = vreinterpretq_s8_u8(vandq_u8(v, m3)), c1 = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 2), m3));
    int8x16_t c2 = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 4), m3)), c3 = vreinterpretq_s8_u8(vshrq_n_u8(v, 6));
    int16x8_t l = *lo, h = *hi;
    l = vmlal_s8(l, vget_low_s8(c0), x[0]), h = vmlal_s8(h, vget_high_s8(c0), x[0]);
    l = vmlal_s8(l, vget_low_s8(c1), x[1]), h = vmlal_s8(h, vget_high_s8(c1), x[1]);
    l = vmlal_s8(l, vget_low_s8(c2), x[2]), h = vmlal_s8(h, vget_high_s8(c2), x[2]);
    l = vmlal_s8(l, vget_low_s8(c3), x[3]), h = vmlal_s8(h, vget_high_s8(c3), x[3]);
    *lo = l, *hi = h;
}

#endif
