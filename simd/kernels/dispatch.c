/* Run-time choice of the kernel bodies (one build holds every x86 path).
 *
 * x86: cpuid says what the core implements, xgetbv says whether the OS saves the wide registers
 * (XCR0: SSE+AVX state for ymm, plus opmask/zmm state for AVX-512); a feature counts only if both agree.
 * aarch64: NEON is baseline; dot-product (sdot) from HWCAP (Linux) or sysctl (macOS).
 * The choice is made once (bk_init, at import) and cached in bk_table; bk_set_isa changes it explicitly.
 * The runtime helpers of simd/ops/ read the same choice (ops_isa() in ops.h), so one set_isa / BITNET_ISA
 * governs every C path of the extension; one thread count (bk_get_num_threads) does too.
 */
#define _GNU_SOURCE /* sched_getaffinity, syscall */
#include "kernels.h"
#include "tiles.h"

#include <errno.h>
#include <stdio.h>

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define BK_X86 1
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

bk_table_t bk_table = {.gemv_prefetch = BK_GEMV_PREFETCH_DEFAULT, .tile_warm = 1, .tile_stream = 1, .tile_overlap = 1};
static bk_features_t features;
static int features_ready = 0;
static int current_isa = BK_ISA_SCALAR;
static int num_threads = 0;                 /* the process default (0: not read yet) */
/* set_num_threads applies to the calling thread: two sessions, each driving the kernels from its own
 * thread (a chat in the main thread, a batching engine's scheduler thread), never run with each other's
 * count. 0: the process default. */
static _Thread_local int thread_threads = 0;

#ifdef BK_X86
static uint64_t read_xcr0(void) {
    uint32_t eax, edx;
    /* xgetbv with ecx = 0 (encoded as bytes so old assemblers accept it) */
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}
#endif

/* cpuid's vendor string is GenuineIntel (a tuning choice, not a feature: bk_set_gemv_one_block) */
static int cpu_intel;

static void detect(void) {
    memset(&features, 0, sizeof features);
#ifdef BK_X86
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d)) /* "Genu" "ineI" "ntel" in ebx, edx, ecx */
        cpu_intel = b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    int osxsave = (c >> 27) & 1;
    features.sse41 = (c >> 19) & 1;
    int fma = (c >> 12) & 1, f16c = (c >> 29) & 1, avx = (c >> 28) & 1;
    uint64_t xcr0 = osxsave ? read_xcr0() : 0;
    int os_ymm = (xcr0 & 0x6) == 0x6;            /* SSE + AVX state */
    int os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0; /* opmask + ZMM_Hi256 + Hi16_ZMM */
    unsigned max_leaf = __get_cpuid_max(0, NULL);
    unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b7, c7, d7);
        unsigned b1, c1, d1;
        __cpuid_count(7, 1, a71, b1, c1, d1);
    }
    if (os_ymm && avx) {
        features.avx2 = (b7 >> 5) & 1;
        features.fma = fma;
        features.f16c = f16c;
        features.avxvnni = (a71 >> 4) & 1;
    }
    if (os_zmm) {
        features.avx512f = (b7 >> 16) & 1;
        features.avx512bw = (b7 >> 30) & 1;
        features.avx512vl = (b7 >> 31) & 1;
        features.avx512vnni = (c7 >> 11) & 1;
        features.avx512bf16 = (a71 >> 5) & 1;
    }
    if (os_zmm && (xcr0 & (3u << 17)) == (3u << 17)) { /* XTILECFG + XTILEDATA state enabled by the OS */
        features.amx_tile = (d7 >> 24) & 1;
        features.amx_int8 = (d7 >> 25) & 1;
        features.amx_bf16 = (d7 >> 22) & 1;
    }
#elif defined(__aarch64__)
    features.neon = 1;
#if defined(__linux__)
    features.dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    features.i8mm = (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#elif defined(__APPLE__)
    /* every Apple M-series core has dotprod, M2 and later i8mm; asked anyway (untested: no macOS machine here) */
    int v = 0;
    size_t len = sizeof v;
    features.dotprod = sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &len, NULL, 0) == 0 && v;
    v = 0, len = sizeof v;
    features.i8mm = sysctlbyname("hw.optional.arm.FEAT_I8MM", &v, &len, NULL, 0) == 0 && v;
#endif
#endif
}

const bk_features_t *bk_get_features(void) {
    if (!features_ready) {
        detect();
        features_ready = 1;
    }
    return &features;
}

int bk_isa_supported(int isa) {
    const bk_features_t *f = bk_get_features();
    switch (isa) {
    case BK_ISA_SCALAR: return 1;
    case BK_ISA_AVX2: return f->avx2 && f->fma && f->f16c;
    case BK_ISA_AVX512: return f->avx512f && f->avx512bw && f->avx512vl && f->avx512vnni && f->f16c && f->fma;
    case BK_ISA_NEON: return f->neon;
    case BK_ISA_DOTPROD: return f->neon && f->dotprod;
    case BK_ISA_I8MM: return f->neon && f->dotprod && f->i8mm;
    case BK_ISA_AVXVNNI: /* the VEX encoding, or its AVX512-VL twin (same algorithm) */
        return f->avx2 && f->fma && f->f16c && (f->avxvnni || (f->avx512vnni && f->avx512vl));
    default: return 0;
    }
}

int bk_best_isa(void) {
    if (bk_isa_supported(BK_ISA_AVX512)) return BK_ISA_AVX512;
    if (bk_get_features()->avxvnni && bk_isa_supported(BK_ISA_AVXVNNI)) return BK_ISA_AVXVNNI;
    if (bk_isa_supported(BK_ISA_AVX2)) return BK_ISA_AVX2;
    if (bk_isa_supported(BK_ISA_I8MM)) return BK_ISA_I8MM;
    if (bk_isa_supported(BK_ISA_DOTPROD)) return BK_ISA_DOTPROD;
    if (bk_isa_supported(BK_ISA_NEON)) return BK_ISA_NEON;
    return BK_ISA_SCALAR;
}

/* The path whose body stands in for a missing one of isa, before the scalar reference: avxvnni and avx512 ->
 * avx2, i8mm -> dotprod -> neon. */
int bk_isa_down(int isa) {
    switch (isa) {
    case BK_ISA_AVXVNNI:
    case BK_ISA_AVX512: return BK_ISA_AVX2;
    case BK_ISA_I8MM: return BK_ISA_DOTPROD;
    case BK_ISA_DOTPROD: return BK_ISA_NEON;
    default: return BK_ISA_SCALAR;
    }
}

/* Per job: BK_PICK (bodies.h), the body of isa, else of the first path down that has one, else the scalar one:
 * never NULL. */
void bk_fill_table(bk_table_t *t, int isa) {
    t->quantize_act = BK_PICK(bk_quantize_bodies, isa);
    t->quantize_scaled = BK_PICK(bk_quantize_scaled_bodies, isa);
    t->gemv_ternary = BK_PICK(bk_gemv_ternary_bodies, isa);
    t->gemm_ternary = BK_PICK(bk_gemm_ternary_bodies, isa);
    t->gemv_i8 = BK_PICK(bk_gemv_i8_bodies, isa);
    t->gemv_f16 = BK_PICK(bk_gemv_f16_bodies, isa);
    t->gemm_f16 = BK_PICK(bk_gemm_f16_bodies, isa);
    if (isa == BK_ISA_AVXVNNI) bk_fill_avxvnni(t, bk_get_features()->avxvnni);
}

/* ---- matrix tiles (tiles.h): what the CPU and Linux allow, asked once per process ---- */
static int tiles_state = -1; /* -1 not asked yet, 0 unusable, 1 usable */
static char tiles_why[160];
static int tile_min_rows = 0; /* 0: the mode's default */

int bk_tiles_supported(void) {
    if (tiles_state >= 0) return tiles_state;
    const bk_features_t *f = bk_get_features();
    tiles_state = 0;
    if (!BK_HAVE_AMX) {
        snprintf(tiles_why, sizeof tiles_why, "no AMX code in this build (x86-64 with GCC 11+ or clang 12+ only)");
    } else if (!f->amx_tile || !f->amx_int8) {
        snprintf(tiles_why, sizeof tiles_why, "the CPU has no AMX int8 tiles (or the OS does not enable their state)");
    } else if (!bk_isa_supported(BK_ISA_AVX512)) {
        snprintf(tiles_why, sizeof tiles_why, "AMX without the AVX-512 path (the tile kernels unpack with AVX-512)");
    } else {
#if defined(__linux__) && defined(__x86_64__)
        /* Linux 5.16+ hands the 8 KB tile data state to a process only on request (once; threads inherit it) */
        unsigned long perm = 0;
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
            snprintf(tiles_why, sizeof tiles_why, "Linux refused the tile data (arch_prctl ARCH_REQ_XCOMP_PERM: %s)",
                     strerror(errno));
        else if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm) != 0 || !(perm & (1ul << XFEATURE_XTILEDATA)))
            snprintf(tiles_why, sizeof tiles_why, "Linux did not grant the tile data (arch_prctl ARCH_GET_XCOMP_PERM)");
        else {
            snprintf(tiles_why, sizeof tiles_why, "amx-tile + amx-int8, tile data granted by Linux");
            tiles_state = 1;
        }
#else
        snprintf(tiles_why, sizeof tiles_why, "the tile data permission is requested on Linux only");
#endif
    }
    return tiles_state;
}

const char *bk_tiles_reason(void) {
    bk_tiles_supported();
    return tiles_why;
}

int bk_get_tiles(void) { return bk_table.tiles_mode; }
int bk_get_tile_min_rows(void) { return tile_min_rows; }
void bk_set_tile_kblock(int k) { bk_table.tile_kblock = k < 64 ? 0 : k / 64 * 64; }
int bk_get_tile_kblock(void) { return bk_table.tile_kblock; }
void bk_set_tile_stream(int on) { bk_table.tile_stream = on ? 1 : 0; }
int bk_get_tile_stream(void) { return bk_table.tile_stream; }
void bk_set_tile_warm(int on) { bk_table.tile_warm = on ? 1 : 0; }
int bk_get_tile_warm(void) { return bk_table.tile_warm; }
void bk_set_tile_overlap(int on) { bk_table.tile_overlap = on ? 1 : 0; }
int bk_get_tile_overlap(void) { return bk_table.tile_overlap; }
/* the prefetch distance asked for (< 0: none asked, the path's default: kernels.h) */
static int gemv_prefetch_asked = -1;
static int gemv_prefetch_for(int isa) {
    if (gemv_prefetch_asked >= 0) return gemv_prefetch_asked;
    return isa == BK_ISA_AVX2 || isa == BK_ISA_AVXVNNI ? BK_GEMV_PREFETCH_DEFAULT_256 : BK_GEMV_PREFETCH_DEFAULT;
}
void bk_set_gemv_prefetch(int nbytes) {
    gemv_prefetch_asked = nbytes < 0 ? -1 : nbytes > BK_GEMV_PREFETCH_MAX ? BK_GEMV_PREFETCH_MAX : nbytes;
    bk_table.gemv_prefetch = gemv_prefetch_for(current_isa);
}
int bk_get_gemv_prefetch(void) { return bk_table.gemv_prefetch; }
/* the loop asked for (< 0: none asked, one block per step on Intel cores: kernels.h) */
static int gemv_one_block_asked = -1;
static int gemv_one_block_for(void) {
    if (gemv_one_block_asked >= 0) return gemv_one_block_asked;
    bk_get_features();
    return cpu_intel;
}
void bk_set_gemv_one_block(int on) {
    gemv_one_block_asked = on < 0 ? -1 : on ? 1 : 0;
    bk_table.gemv_one_block = gemv_one_block_for();
}
int bk_get_gemv_one_block(void) { return bk_table.gemv_one_block; }

static void apply(int isa, int mode) {
    bk_fill_table(&bk_table, isa);
    bk_table.gemm_ternary_vector = bk_table.gemm_ternary;
    bk_table.tiles_mode = mode;
    bk_table.gemv_prefetch = gemv_prefetch_for(isa);
    bk_table.gemv_one_block = gemv_one_block_for();
    bk_table.tile_min_rows = tile_min_rows > 0 ? tile_min_rows : (mode == BK_TILES_AMX ? BK_TILE_MIN_ROWS_AMX : 1);
    if (bk_gemm_ternary_tile_bodies[mode]) bk_table.gemm_ternary = bk_gemm_ternary_tile_bodies[mode];
    current_isa = isa;
}

int bk_set_tiles(int mode) {
    if (mode == BK_TILES_AMX && !(bk_tiles_supported() && current_isa == BK_ISA_AVX512)) return -1;
    if (mode != BK_TILES_OFF && mode != BK_TILES_AMX && mode != BK_TILES_EMU) return -1;
    apply(current_isa, mode);
    return 0;
}

int bk_set_tiles_timing_only(int on) {
    apply(current_isa, on ? BK_TILES_NULL : BK_TILES_OFF);
    return 0;
}

void bk_set_tile_min_rows(int m) {
    tile_min_rows = m > 0 ? m : 0;
    apply(current_isa, bk_table.tiles_mode);
}

/* isa < 0: the best path, with the hardware tiles where they are usable; an explicit path: no tiles
 * (BITNET_ISA=avx512 is how a user or an A/B run turns them off; simd.set_isa("amx") asks for them). */
int bk_set_isa(int isa) {
    int mode = BK_TILES_OFF;
    if (isa < 0) {
        isa = bk_best_isa();
        if (isa == BK_ISA_AVX512 && bk_tiles_supported()) mode = BK_TILES_AMX;
    }
    if (!bk_isa_supported(isa)) return -1;
    apply(isa, mode);
    return 0;
}

int bk_get_isa(void) { return current_isa; }

/* Logical CPUs this process may run on (what omp_get_num_procs reported before the pool replaced OpenMP). */
static int available_cpus(void) {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

void bk_set_num_threads(int n) { thread_threads = n > 0 ? n : 0; }

/* Default: OMP_NUM_THREADS when it names a positive count (scripts and benchmarks set it; engine/cpu.py
 * reads it the same way), else every available CPU. */
int bk_get_num_threads(void) {
    if (thread_threads > 0) return thread_threads;
    if (num_threads <= 0) {
        const char *env = getenv("OMP_NUM_THREADS");
        int n = env ? atoi(env) : 0;
        num_threads = n > 0 ? n : available_cpus();
    }
    return num_threads;
}

void bk_init(void) {
    bk_get_features();
    bk_set_isa(-1);
}
