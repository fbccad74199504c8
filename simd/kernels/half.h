/* IEEE half -> float in C, shared by the scalar bodies of the f16 head (gemv_f16.c) and the group-scaled
 * ternary kernel (gemv_tg.c). */
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

#endif
