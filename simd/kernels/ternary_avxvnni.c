/* The "avxvnni" path: AVX2 plus 256-bit vpdpbusd for the ternary GEMV and GEMM (other jobs use the AVX2
 * bodies). Cores with AVX-VNNI but no AVX-512 (Intel Alder Lake and later) run the VEX-encoded bodies.
 * The same template compiled with the EVEX (AVX512-VNNI + VL) encoding runs the identical algorithm on
 * AVX-512 cores, so the path is tested on this machine too (set_isa("avxvnni")); only the encoding of
 * one instruction differs between the two.
 */
#include "kernels.h"

#if defined(__x86_64__)
#include "x86_common.h"

#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
/* acc += dot(u8 a, s8 b) in place: the intrinsics' form made GCC 12 copy the accumulator around each vpdpbusd
 * (x86_common.h: dpbusd512); {vex} / {evex} pin the encoding each twin is for. */
VNNI_TARGET static inline __m256i dpbusd256_vex(__m256i acc, __m256i a_u8, __m256i b_s8) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a_u8), "x"(b_s8));
    return acc;
}
#define VNNI_DPBUSD(acc, a, b) dpbusd256_vex(acc, a, b)
#define VNNI_NAME(stem) stem##_avxvnni
#include "ternary_vnni256.h"
#undef VNNI_TARGET
#undef VNNI_DPBUSD
#undef VNNI_NAME

#define VNNI_TARGET AVX512_TARGET
AVX512_TARGET static inline __m256i dpbusd256_evex(__m256i acc, __m256i a_u8, __m256i b_s8) {
    __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a_u8), "v"(b_s8));
    return acc;
}
#define VNNI_DPBUSD(acc, a, b) dpbusd256_evex(acc, a, b)
#define VNNI_NAME(stem) stem##_avxvnni_evex
#include "ternary_vnni256.h"
#undef VNNI_TARGET
#undef VNNI_DPBUSD
#undef VNNI_NAME

void bk_fill_avxvnni(bk_table_t *t, int vex) {
    t->gemv_ternary = vex ? gemv_ternary_avxvnni : gemv_ternary_avxvnni_evex;
    t->gemm_ternary = vex ? gemm_ternary_avxvnni : gemm_ternary_avxvnni_evex;
}
#else
void bk_fill_avxvnni(bk_table_t *t, int vex) {
    (void)t;
    (void)vex;
}
#endif
