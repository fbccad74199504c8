/* Machine limits measured by bench/bench_kernels.py in the same run as the kernels:
 *   bk_stream_read: the streaming read bandwidth (the bound of a memory-bound GEMV), vector loads over a
 *     buffer split into contiguous per-thread ranges like the kernels split their tiles;
 *   bk_peak_dot: the int8 dot-product peak of the active path from a register-only loop (no loads): the
 *     bound of the compute-bound GEMM (MACs per iteration: bk_peak_dot_macs_per_iter);
 *   bk_peak_fma: the f32 FMA peak of the active path, the same way (the bound of attention over long prompts).
 * Both start their own threads so that all run at once (what a limit should measure).
 *
 * Benchmark-only: built as its own extension, simd._probes (simd/_probes.pyx), not into the runtime's
 * simd._kernels. It shares only headers with the kernels; the path, the VEX flag and the thread count come
 * from the caller (simd._kernels.active() / features() / get_num_threads()).
 */
#include "kernels.h"

#include <pthread.h>

#if defined(__x86_64__)
#include "x86_common.h"

AVX512_TARGET static uint64_t stream_range_avx512(const uint8_t *p, size_t nbytes) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= nbytes; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
    }
    uint64_t s = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
    for (; i < nbytes; i++) s += p[i];
    return s;
}

AVX2_TARGET static uint64_t stream_range_avx2(const uint8_t *p, size_t nbytes) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= nbytes; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, a);
    uint64_t s = t[0] + t[1] + t[2] + t[3];
    for (; i < nbytes; i++) s += p[i];
    return s;
}

/* Each peak probe is one asm loop (from C the compiler copies the accumulators around, which halves the
 * measured rate): SETUP sets register 12 to all ones and 13 to bytes of 1, CHAINS is one iteration of
 * independent dot-product chains, then `iters` counts down to 0. Clobbers: the chains' registers. */
#define PEAK_LOOP(SETUP, CHAINS, ...)                                                                          \
    __asm__ volatile(SETUP "1:\n\t" CHAINS "dec %0\n\t"                                                        \
                     "jnz 1b\n\t"                                                                             \
                     : "+r"(iters)                                                                           \
                     :                                                                                       \
                     : __VA_ARGS__, "xmm12", "xmm13", "cc")
#define SETUP_ZMM "vpternlogd $0xff, %%zmm12, %%zmm12, %%zmm12\n\t vpabsb %%zmm12, %%zmm13\n\t"
#define SETUP_YMM "vpcmpeqb %%ymm12, %%ymm12, %%ymm12\n\t vpabsb %%ymm12, %%ymm13\n\t"
/* one chain: acc += dot(13, 12) into zmm/ymm register N (PREFIX: "" or the VEX pseudo-prefix) */
#define DOT_ZMM(N) "vpdpbusd %%zmm12, %%zmm13, %%zmm" #N "\n\t"
#define DOT_YMM(PREFIX, N) PREFIX "vpdpbusd %%ymm12, %%ymm13, %%ymm" #N "\n\t"
/* the AVX2 ternary inner step: pmaddubsw into a temporary T, paddw into chain N */
#define MADD_YMM(T, N) "vpmaddubsw %%ymm12, %%ymm13, %%ymm" #T "\n\t vpaddw %%ymm" #T ", %%ymm" #N ", %%ymm" #N "\n\t"
#define CLOBBER_0_7 "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7"

AVX512_TARGET static int64_t peak_dot_avx512(long iters) {
    /* 12 independent vpdpbusd chains: more than latency x throughput on current cores */
    if (iters <= 0) return 0;
    PEAK_LOOP(SETUP_ZMM,
              DOT_ZMM(0) DOT_ZMM(1) DOT_ZMM(2) DOT_ZMM(3) DOT_ZMM(4) DOT_ZMM(5)
              DOT_ZMM(6) DOT_ZMM(7) DOT_ZMM(8) DOT_ZMM(9) DOT_ZMM(10) DOT_ZMM(11),
              CLOBBER_0_7, "xmm8", "xmm9", "xmm10", "xmm11");
    return iters;
}

/* 256-bit vpdpbusd ("avxvnni" path), 8 chains: VEX encoding on AVX-VNNI cores, EVEX (AVX512-VL) elsewhere. */
#define PEAK_VNNI256(P)                                                                                        \
    PEAK_LOOP(SETUP_YMM,                                                                                       \
              DOT_YMM(P, 0) DOT_YMM(P, 1) DOT_YMM(P, 2) DOT_YMM(P, 3)                                          \
              DOT_YMM(P, 4) DOT_YMM(P, 5) DOT_YMM(P, 6) DOT_YMM(P, 7),                                         \
              CLOBBER_0_7)

__attribute__((target("avx2,avxvnni"))) static int64_t peak_dot_avxvnni(long iters) {
    if (iters <= 0) return 0;
    PEAK_VNNI256("%{vex%} "); /* braces escaped: asm dialect syntax */
    return iters;
}

AVX512_TARGET static int64_t peak_dot_vnni256_evex(long iters) {
    if (iters <= 0) return 0;
    PEAK_VNNI256("");
    return iters;
}

AVX2_TARGET static int64_t peak_dot_avx2(long iters) {
    /* the AVX2 ternary inner step: pmaddubsw + paddw per 32 MACs, 8 independent chains */
    if (iters <= 0) return 0;
    PEAK_LOOP(SETUP_YMM,
              MADD_YMM(8, 0) MADD_YMM(9, 1) MADD_YMM(10, 2) MADD_YMM(11, 3)
              MADD_YMM(8, 4) MADD_YMM(9, 5) MADD_YMM(10, 6) MADD_YMM(11, 7),
              CLOBBER_0_7, "xmm8", "xmm9", "xmm10", "xmm11");
    return iters;
}

/* the f32 FMA peak (attention's bound): 12 independent vfmadd231ps chains over zeroed operands */
#define SETUP_FZ "vpxord %%zmm12, %%zmm12, %%zmm12\n\t vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
#define SETUP_FY "vpxor %%ymm12, %%ymm12, %%ymm12\n\t vpxor %%ymm13, %%ymm13, %%ymm13\n\t"
#define FMA_ZMM(N) "vfmadd231ps %%zmm12, %%zmm13, %%zmm" #N "\n\t"
#define FMA_YMM(N) "vfmadd231ps %%ymm12, %%ymm13, %%ymm" #N "\n\t"

/* one f32 FMA probe per vector width: 12 chains of LANES lanes per iteration */
#define PEAK_FMA(TARGET, NAME, SETUP, FMA, LANES)                                                              \
    TARGET static int64_t NAME(long iters) {                                                                   \
        const int64_t n = iters; /* the loop counts iters down to 0 */                                         \
        if (iters <= 0) return 0;                                                                              \
        PEAK_LOOP(SETUP, FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5) FMA(6) FMA(7) FMA(8) FMA(9) FMA(10) FMA(11), \
                  CLOBBER_0_7, "xmm8", "xmm9", "xmm10", "xmm11");                                               \
        return n * 12 * (LANES);                                                                               \
    }
PEAK_FMA(AVX512_TARGET, peak_fma_avx512, SETUP_FZ, FMA_ZMM, 16)
PEAK_FMA(AVX2_TARGET, peak_fma_avx2, SETUP_FY, FMA_YMM, 8)
#endif

static uint64_t stream_range_scalar(const uint8_t *p, size_t nbytes) {
    uint64_t s = 0;
    size_t i = 0;
    for (; i + 8 <= nbytes; i += 8) s += load_i32(p + i) + (uint64_t)load_i32(p + i + 4);
    for (; i < nbytes; i++) s += p[i];
    return s;
}

/* Run body(arg_i) on nt threads at once (the caller is thread 0); each writes its own result slot. */
typedef struct {
    int isa, vex, me, parts;
    const uint8_t *buf;
    size_t nbytes;
    long iters;
    uint64_t result;
} probe_arg;

static void run_threads(void *(*body)(void *), probe_arg *args, int nt) {
    pthread_t th[64];
    int started = 0;
    for (int i = 1; i < nt; i++, started++)
        if (pthread_create(&th[i], NULL, body, &args[i]) != 0) break;
    body(&args[0]);
    for (int i = 1; i <= started; i++) pthread_join(th[i], NULL);
}

static void *stream_body(void *p) {
    probe_arg *a = p;
    size_t chunk = (a->nbytes / a->parts) & ~(size_t)255;
    size_t b = chunk * a->me, e = a->me == a->parts - 1 ? a->nbytes : b + chunk;
#if defined(__x86_64__)
    if (a->isa == BK_ISA_AVX512)
        a->result = stream_range_avx512(a->buf + b, e - b);
    else if (a->isa == BK_ISA_AVX2 || a->isa == BK_ISA_AVXVNNI)
        a->result = stream_range_avx2(a->buf + b, e - b);
    else
#endif
        a->result = stream_range_scalar(a->buf + b, e - b);
    return NULL;
}

uint64_t bk_stream_read(const uint8_t *buf, size_t nbytes, int isa, int nt) {
    probe_arg args[64];
    if (nt < 1) nt = 1;
    if (nt > 64) nt = 64;
    for (int i = 0; i < nt; i++) args[i] = (probe_arg){isa, 0, i, nt, buf, nbytes, 0, 0};
    run_threads(stream_body, args, nt);
    uint64_t total = 0;
    for (int i = 0; i < nt; i++) total += args[i].result;
    return total;
}

/* MACs per iteration of the register-only loop, per thread. */
int64_t bk_peak_dot_macs_per_iter(int isa) {
    switch (isa) {
    case BK_ISA_AVX512: return 12 * 64;
    case BK_ISA_AVX2: return 8 * 32;
    case BK_ISA_AVXVNNI: return 8 * 32;
    default: return 0;
    }
}

static void *peak_body(void *p) {
    probe_arg *a = p;
    a->result = 0;
#if defined(__x86_64__)
    if (a->isa == BK_ISA_AVX512)
        a->result = (uint64_t)peak_dot_avx512(a->iters);
    else if (a->isa == BK_ISA_AVX2)
        a->result = (uint64_t)peak_dot_avx2(a->iters);
    else if (a->isa == BK_ISA_AVXVNNI)
        a->result = (uint64_t)(a->vex ? peak_dot_avxvnni(a->iters) : peak_dot_vnni256_evex(a->iters));
#endif
    return NULL;
}

/* body(iters) on nt threads at once (1..64); the sum of their results */
static int64_t run_peak(void *(*body)(void *), int isa, int vex, long iters, int nt) {
    probe_arg args[64];
    if (nt < 1) nt = 1;
    if (nt > 64) nt = 64;
    for (int i = 0; i < nt; i++) args[i] = (probe_arg){isa, vex, i, nt, NULL, 0, iters, 0};
    run_threads(body, args, nt);
    int64_t total = 0;
    for (int i = 0; i < nt; i++) total += (int64_t)args[i].result;
    return total;
}

int64_t bk_peak_dot(long iters, int isa, int vex, int nt) { return run_peak(peak_body, isa, vex, iters, nt); }

/* bk_peak_fma: the f32 multiply-adds of nt threads running the active path's register-only FMA loop at once
 * (0 where the path has none: scalar, NEON) */
static void *peak_fma_body(void *p) {
    probe_arg *a = p;
    a->result = 0;
#if defined(__x86_64__)
    if (a->isa == BK_ISA_AVX512)
        a->result = (uint64_t)peak_fma_avx512(a->iters);
    else if (a->isa == BK_ISA_AVX2 || a->isa == BK_ISA_AVXVNNI)
        a->result = (uint64_t)peak_fma_avx2(a->iters);
#endif
    return NULL;
}

int64_t bk_peak_fma(long iters, int isa, int nt) { return run_peak(peak_fma_body, isa, 0, iters, nt); }

/* bk_peak_tile: the AMX int8 peak, a register-only loop of tdpbssd (4 independent C tiles, A and B tiles
 * loaded once: 4 x 16 x 16 x 64 multiply-adds per iteration) on nt threads at once. The caller makes sure
 * the tiles are usable (simd._kernels.tiles_reason(): Linux's grant is per process, asked by _kernels). */
#define TILE_PEAK_MACS_PER_ITER (4 * 16 * 16 * 64)
int64_t bk_peak_tile_macs_per_iter(void) { return TILE_PEAK_MACS_PER_ITER; }

#if defined(__x86_64__)
static void *peak_tile_body(void *p) {
    probe_arg *a = p;
    static const struct {
        uint8_t palette, start, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
    static const int8_t ones[16 * 64] = {1};
    long iters = a->iters;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm4\n\t tileloadd (%0,%1,1), %%tmm5\n\t"
                     "tileloadd (%0,%1,1), %%tmm6\n\t tileloadd (%0,%1,1), %%tmm7\n\t"
                     "tilezero %%tmm0\n\t tilezero %%tmm1\n\t tilezero %%tmm2\n\t tilezero %%tmm3" ::"r"(ones),
                     "r"(64L) : "memory");
    __asm__ volatile("1:\n\t tdpbssd %%tmm6, %%tmm4, %%tmm0\n\t tdpbssd %%tmm7, %%tmm4, %%tmm1\n\t"
                     "tdpbssd %%tmm6, %%tmm5, %%tmm2\n\t tdpbssd %%tmm7, %%tmm5, %%tmm3\n\t"
                     "dec %0\n\t jnz 1b" : "+r"(iters) : : "cc");
    __asm__ volatile("tilerelease" ::: "memory");
    a->result = (uint64_t)a->iters * TILE_PEAK_MACS_PER_ITER;
    return NULL;
}
#endif

int64_t bk_peak_tile(long iters, int nt) {
#if defined(__x86_64__)
    return run_peak(peak_tile_body, 0, 0, iters, nt);
#else
    (void)iters, (void)nt;
    return 0;
#endif
}
