/* IEEE half <-> float in C: half -> float for the scalar bodies of the f16 head (gemv_f16.c), the group-scaled
 * ternary kernel (gemv_tg.c) and the f16 caches; float -> half for the scalar body of the f16 KV-cache write
 * (simd/ops/rope_kv.c), which its F16C and NEON bodies match bit for bit. */
#ifndef BITNET_HALF_H
#define BITNET_HALF_H

#include <stdint.h>
#include <string.h>

/* IEEE half -> float, exact (normals, subnormals, inf, nan). */
static inline float bk_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            mant <<= 1;
        } while (!(mant & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float -> IEEE half, round to nearest even (as F16C, NEON fcvtn and numpy); every NaN becomes the quiet NaN
 * 0x7e00 with its sign (the vector bodies, which would keep payload bits, are made to agree). */
static inline uint16_t bk_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0)); /* inf / nan */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);                                    /* overflow */
    if (ax < 0x38800000u) { /* subnormal half (or zero): add a magic number, let the FPU round */
        float a, magic = 0.5f;
        memcpy(&a, &ax, 4);
        a += magic;
        uint32_t r;
        memcpy(&r, &a, 4);
        return (uint16_t)(sign | (r - 0x3f000000u));
    }
    uint32_t mant_odd = (ax >> 13) & 1;
    ax += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round half to even */
    return (uint16_t)(sign | (ax >> 13));
}

#endif
