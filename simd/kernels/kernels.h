/* Shared declarations of the ternary / int8 / f16 kernels (layouts: simd/layout.py).
 *
 * Every job lives in its own C file with a scalar reference body (always compiled) and per-ISA bodies
 * (AVX2, AVX-512 VNNI with per-function target attributes; NEON under __aarch64__). dispatch.c picks one
 * body per job once (cpuid + xgetbv, or BITNET_ISA / bk_set_isa) and caches it in bk_table; a job whose
 * ISA body is missing keeps the scalar one, so a kernel is never absent.
 *
 * Bodies work on a contiguous range of 16-row tiles [tile_begin, tile_end); the public bk_* drivers hand
 * contiguous chunks of tiles to the worker pool of threadpool.c (the calling thread works too). The runtime
 * helpers of simd/ops/ are built into the same extension and use the same ISA choice and the same pool.
 * Pointers need no particular alignment (all vector loads are unaligned loads).
 * Matrix tiles (Intel AMX, and their portable emulation for tests) are one more body of the multi-row jobs,
 * put in front of the path's own GEMM body when enabled: tiles.h, gemm_tiles.c.
 */
#ifndef BITNET_KERNELS_H
#define BITNET_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define BK_TILE_ROWS 16

/* aarch64: NEON is the baseline (Cortex-A72 of the Raspberry Pi 4 has nothing more); DOTPROD adds sdot
 * (Armv8.2 dot product: every Apple M-series, Graviton 2+, Cortex-A76+ of the Raspberry Pi 5). I8MM adds the
 * int8 matrix multiply (smmla: Graviton 3+, Apple M2+, Cortex-A510/A710+) to dotprod. A job with no body for a
 * path runs the next one down: i8mm -> dotprod -> neon -> scalar. */
enum bk_isa {
    BK_ISA_SCALAR = 0, BK_ISA_AVX2 = 1, BK_ISA_AVX512 = 2, BK_ISA_NEON = 3, BK_ISA_AVXVNNI = 4, BK_ISA_DOTPROD = 5,
    BK_ISA_I8MM = 6
};
#define BK_N_ISA 7
/* the aarch64 paths that have sdot (dotprod, and i8mm which implies it): the bodies chosen inside a job ask this */
static inline int bk_isa_has_sdot(int isa) { return isa == BK_ISA_DOTPROD || isa == BK_ISA_I8MM; }

/* CPU features seen by the dispatcher (cpuid bits AND the OS saving the matching register state). */
typedef struct {
    int sse41, avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512vnni, avx512bf16, avxvnni, neon, dotprod, i8mm;
    int amx_tile, amx_int8; /* cpuid AND XCR0's tile state; Linux's per-process grant: bk_tiles_supported */
    int amx_bf16;           /* the same for tdpbf16ps (bf16 prefill attention on the tiles, attention_bf16.c) */
} bk_features_t;

/* Raw int32 results of the integer kernels go to out_i32 when it is non-NULL (tests); otherwise the f32
 * formula of layout.py goes to out: ((float)dot / act_scale) * row_scale[n]. */
typedef void (*bk_quantize_fn)(const float *x, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum);
/* The second half of quantize_act, shared with the fused norms of simd/ops/norm.c: xq[0..k) =
 * clamp(round_half_even(x * scale)), returns sum(xq); no padding written. */
typedef int32_t (*bk_quantize_scaled_fn)(const float *x, int k, float scale, int8_t *xq);
typedef void (*bk_gemv_ternary_fn)(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad,
                                   float act_scale, int32_t act_sum, float *out, int32_t *out_i32, int n,
                                   int tile_begin, int tile_end);
typedef void (*bk_gemm_ternary_fn)(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                                   const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32,
                                   int n, int tile_begin, int tile_end);
typedef void (*bk_gemv_i8_fn)(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq,
                              const uint8_t *xq_aux, int k_pad, float act_scale, float *out, int32_t *out_i32, int n,
                              int tile_begin, int tile_end);
typedef void (*bk_gemv_f16_fn)(const uint16_t *w, const float *x, int k, float *out, int n, int tile_begin,
                               int tile_end);
typedef void (*bk_gemm_f16_fn)(const uint16_t *w, const float *x, int m, int k, float *out, int n, int tile_begin,
                               int tile_end);

typedef struct {
    bk_quantize_fn quantize_act;
    bk_quantize_scaled_fn quantize_scaled;
    bk_gemv_ternary_fn gemv_ternary;
    bk_gemm_ternary_fn gemm_ternary;
    bk_gemv_i8_fn gemv_i8;
    bk_gemv_f16_fn gemv_f16;
    bk_gemm_f16_fn gemm_f16;
    /* matrix tiles (tiles.h): the mode in force, the row count from which a product goes to them, and the
     * path's own GEMM body, which gemm_ternary becomes a tile body in front of */
    int tiles_mode, tile_min_rows;
    bk_gemm_ternary_fn gemm_ternary_vector;
    int tile_kblock; /* k per block of the tile bodies, a multiple of 64 (0: all of K in one block) */
    int tile_stream; /* ternary tile GEMM at M <= 32: unpack one 64-k step at a time beside the tdpbssd (tiles.h) */
    int tile_warm;   /* tile bodies: weights read two tiles ahead of their use (tiles.h) */
    int tile_overlap; /* ternary tile GEMM: the next pair unpacked beside the first row pair's tdpbssd (tiles.h) */
    /* software prefetch distance of the AVX-512 GEMV bodies, bytes ahead of the block being read (0: none) */
    int gemv_prefetch;
    /* the AVX-512 tile16 GEMV reads one 64-byte block per loop step instead of two (BK_GEMV_ONE_BLOCK) */
    int gemv_one_block;
} bk_table_t;

/* The default of bk_table.gemv_prefetch, the software prefetch distance of the x86 GEMV bodies (AVX-512: tile16,
 * base-3, multi-row, q4 head; AVX2 and AVX-VNNI: tile16). They read one sequential stream and, with the
 * hardware prefetchers alone, stall on DRAM latency between bursts: one Zen 5 core read 84% of a 42 GB/s stream
 * rate through the AVX-512 body, 96% with a prefetch 4 KB ahead of each 64-byte block (8 KB 97%, 2 KB 87%);
 * 2 threads 95% -> 108% (part of the set stays in L3); AVX2 71% -> 82% (8 KB 87%), AVX-VNNI 71% -> 79% (8 KB
 * 81%), one thread (bench_kernels.py --prefetch, 2026-11-28). Intel's cores hold fewer misses in flight per
 * core: the same sweep is to measure the distance there. BITNET_PREFETCH / simd.set_gemv_prefetch change it. */
#define BK_GEMV_PREFETCH_DEFAULT 4096
/* The 256-bit bodies (AVX2, AVX-VNNI) spend more instructions per byte, so the same distance is fewer
 * iterations ahead: 8 KB read 87% of the stream rate through AVX2 where 4 KB read 82% (one thread), 75% vs 72%
 * at 2 threads of an 80 GB/s rate; AVX-VNNI 81% vs 79% (one thread). */
#define BK_GEMV_PREFETCH_DEFAULT_256 8192
#define BK_GEMV_PREFETCH_MAX (1 << 20)
/* The AVX-512 tile16 GEMV's loop on Intel cores: one 64-byte block per step (4 accumulators) instead of two
 * (8 accumulators, the loop Zen was tuned on, kept there). On a 2-core Intel Xeon with AMX, 13824 x 2560 out of
 * cache, 2 threads, the two-block loop read ~73% of a plain read of the same bytes and the one-block loop ~100%
 * (per-call samples in one run); from L2 the one-block loop is slower (40 vs 48 GB/s a core: its 4 vpdpbusd
 * chains), which decode never is. Default: on where cpuid's vendor is GenuineIntel (dispatch.c);
 * simd.set_gemv_one_block switches it (None: that default). Results are the same bits either way. */

extern bk_table_t bk_table;

/* dispatch.c */
void bk_set_gemv_prefetch(int nbytes); /* 0 .. BK_GEMV_PREFETCH_MAX bytes; 0: none; < 0: the path's default */
int bk_get_gemv_prefetch(void);
void bk_set_gemv_one_block(int on); /* 0 / 1; < 0: the CPU's default (BK_GEMV_ONE_BLOCK note above) */
int bk_get_gemv_one_block(void);
const bk_features_t *bk_get_features(void);
int bk_isa_supported(int isa);
int bk_set_isa(int isa);            /* 0 ok, -1 the CPU cannot run it */
int bk_get_isa(void);
int bk_best_isa(void);
void bk_set_num_threads(int n);
int bk_get_num_threads(void);
void bk_init(void);
/* The scalar body of every job (the reference) and the per-ISA bodies (NULL when not compiled in). */
void bk_fill_table(bk_table_t *t, int isa);
/* ternary_avxvnni.c: the 256-bit VNNI ternary bodies (vex: AVX-VNNI encoding, else the AVX512-VL twin) */
void bk_fill_avxvnni(bk_table_t *t, int vex);

/* per-job tables filled by each file: entry [isa] or NULL */
extern const bk_quantize_fn bk_quantize_bodies[BK_N_ISA];
extern const bk_quantize_scaled_fn bk_quantize_scaled_bodies[BK_N_ISA];
extern const bk_gemv_ternary_fn bk_gemv_ternary_bodies[BK_N_ISA];
extern const bk_gemm_ternary_fn bk_gemm_ternary_bodies[BK_N_ISA];
extern const bk_gemv_i8_fn bk_gemv_i8_bodies[BK_N_ISA];
extern const bk_gemv_f16_fn bk_gemv_f16_bodies[BK_N_ISA];
extern const bk_gemm_f16_fn bk_gemm_f16_bodies[BK_N_ISA];

/* Threaded drivers (GIL must already be released by the caller). */
void bk_quantize_act(const float *x, int m, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum);
void bk_gemv_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
                     int32_t act_sum, float *out, int32_t *out_i32, int n);
void bk_gemm_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                     const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n);
int bk_gemv_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int k_pad,
               float act_scale, float *out, int32_t *out_i32, int n);   /* -1 on allocation failure */
/* M rows at once: out[m, n] (or out_i32[m, n]) row r = bk_gemv_i8 of xq[r] with act_scale[r] */
int bk_gemm_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int m, int k_pad,
               const float *act_scale, float *out, int32_t *out_i32, int n);
void bk_gemv_f16(const uint16_t *w, const float *x, int k, float *out, int n);
void bk_gemm_f16(const uint16_t *w, const float *x, int m, int k, float *out, int n);   /* row r == bk_gemv_f16(x[r]) */

/* 4 activation bytes as one dword (the broadcast operand of the dot-product instructions). */
static inline int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Split tiles [0, n_tiles) into n_parts contiguous ranges; part p gets [*b, *e). */
static inline void bk_split(int n_tiles, int n_parts, int p, int *b, int *e) {
    int base = n_tiles / n_parts, rem = n_tiles % n_parts;
    *b = p * base + (p < rem ? p : rem);
    *e = *b + base + (p < rem ? 1 : 0);
}

/* act_scale of a row whose largest magnitude is amax (FORMATS.md §1): one f32 division, on every path. */
static inline float bk_act_scale(float amax) { return 127.0f / (amax > 1e-5f ? amax : 1e-5f); }

/* threadpool.c: the one worker pool of the extension (kernels and ops).
 * bk_parallel_for runs fn(ctx, b, e) over [0, n) in chunks whose bounds are multiples of grain, on up to nt
 * threads (the caller included; nt is per call, so two owners of different thread counts can share the
 * pool). Inside fn, bk_thread_slot() is 0 on the calling thread and 1 .. nt-1 on the workers that take
 * part: per-thread scratch indexes by it. One job at a time: a second caller (another Python thread, or
 * a nested call) runs its whole range itself, as slot 0 of its own thread. */
typedef void (*bk_range_fn)(void *ctx, int begin, int end);
void bk_parallel_for(int n, int grain, int nt, bk_range_fn fn, void *ctx);
int bk_thread_slot(void);
/* The drivers' common tail: fn over tiles [0, n_tiles) in units of 4 tiles on bk_get_num_threads()
 * threads, or on the caller alone when work < min_work (a hand-off costs more than it saves). */
void bk_run_tiles(int n_tiles, size_t work, size_t min_work, bk_range_fn fn, void *ctx);
void bk_pool_stats(uint64_t *jobs, uint64_t *worker_chunks, uint64_t *caller_sleeps);

/* Finish a 16-row tile whose int32 dots are in dots[16] (partial last tiles and scalar bodies). */
static inline void bk_store_tile(const int32_t *dots, int row0, int n, const float *row_scale, float act_scale,
                                 float *out, int32_t *out_i32) {
    int rows = n - row0 < BK_TILE_ROWS ? n - row0 : BK_TILE_ROWS;
    for (int r = 0; r < rows; r++) {
        if (out_i32)
            out_i32[row0 + r] = dots[r];
        else
            out[row0 + r] = ((float)dots[r] / act_scale) * row_scale[row0 + r];
    }
}

#include "bodies.h" /* the body tables and threaded-driver jobs of every kernel file */

#endif
