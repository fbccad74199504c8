/* Multi-row products on matrix tiles (tiles.h): the ternary GEMM (prefill chunks, batched steps, verify
 * rows: every caller of bk_gemm_ternary / bk_gemm_b3), the int8 head at M > 1 (bk_gemm_i8) and the q4 head at
 * M > 1 (bk_gemv_q4g; its scales go into the B tiles: gemm_tiles_q4_body.h).
 *
 *   out[m, n] = ((float)(C[m, n] - act_sum[m]) / act_scale[m]) * row_scale[n],   C = A . B  (int32, exact)
 *
 * A is the int8 activation rows the vector bodies read (xq, M x K_pad), loaded 16 rows x 64 k at a time
 * straight from memory, except the last partial group of 16 rows, which is copied once per call into a
 * zero-padded 16 x K_pad buffer (the zero rows add 0 and their results are never stored); the ternary GEMM at
 * 17-128 rows packs all of A in tile order once per product instead (tiles_pack_a). B is the i8_tile16
 * order of the weights: the int8 head is in it already; ternary tile16 codes are unpacked into it (shift +
 * and per 64 bytes, nothing else: see tiles.h) one pair of weight tiles at a time. tdpbssd computes the
 * same integer sums as vpdpbusd, and the epilogue is bk_store_tile's formula, so every result is the same
 * float as on the vector paths (tests/test_tiles.py demands equality).
 *
 * Threads: each pool worker runs whole tile ranges (bk_run_tiles: 4-tile grains, so pairs), configures the
 * tiles at the start of its range and releases them at the end: a thread holding tile state makes every
 * context switch save 8 KB more, and the configuration (one ldtilecfg) is noise against a range's work.
 * Scratch is per thread (thread-local, grown on demand, kept for the thread's life): the A tail, two
 * unpacked tiles (one k-block of each; four with tile_overlap; the ring of the streamed bodies instead) and the
 * C blocks of every row-group pair.
 */
#include "kernels.h"
#include "tiles.h"

#include <stdlib.h>

#if defined(__x86_64__)
#include "x86_common.h"
#endif

/* the arguments of one product, shared by the panel and the epilogue */
typedef struct {
    const int8_t *xq;
    int m, k_pad;
    const float *act_scale;
    const int32_t *act_sum; /* NULL: nothing to subtract (int8 head) */
    const float *row_scale;
    float *out;
    int32_t *out_i32;
    int n;
    const int8_t *apack; /* A packed in tile order (tiles_pack_a), or NULL: A read from xq and the tail copy */
} tiles_args;


/* every tile 16 rows x 64 bytes: A and B tiles full, C 16 x 16 int32 */
static const bk_tilecfg_t tiles_cfg_full = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* products (calls of a tile body on a tile range) that ran on the tiles: tests check the tiles were taken */
static uint64_t tiles_products = 0;
uint64_t bk_tiles_products(void) { return __atomic_load_n(&tiles_products, __ATOMIC_RELAXED); }
static void tiles_count(void) { __atomic_fetch_add(&tiles_products, 1, __ATOMIC_RELAXED); }

static _Thread_local uint8_t *scratch_buf;
static _Thread_local size_t scratch_cap;

/* the calling thread's scratch of at least `bytes` (64-byte aligned), or NULL when it cannot be had */
static uint8_t *tiles_scratch(size_t bytes) {
    if (bytes > scratch_cap) {
        free(scratch_buf);
        size_t cap = (bytes + 63) & ~(size_t)63;
        scratch_buf = aligned_alloc(64, cap);
        scratch_cap = scratch_buf ? cap : 0;
    }
    return scratch_buf;
}

/* The k-block of the tile bodies (bk_table.tile_kblock, a multiple of 64; 0: the whole of K_pad, one block). */
static int tiles_kblock(int k_pad) {
    const int kb = bk_table.tile_kblock;
    return kb <= 0 || kb >= k_pad ? k_pad : kb;
}

/* bytes of the C blocks kept between k-blocks: 32 x 32 int32 per pair of 16-row activation groups */
static size_t tiles_cacc_bytes(int m) { return (size_t)((m + 31) / 32) * 32 * 32 * 4; }

/* the last partial group of 16 rows of A, zero-padded to 16 rows (nothing when M is a multiple of 16) */
static void tiles_copy_tail(const tiles_args *g, int8_t *a_tail) {
    const int rem = g->m % 16;
    if (!rem) return;
    const size_t row = (size_t)g->k_pad;
    memcpy(a_tail, g->xq + (size_t)(g->m - rem) * row, rem * row);
    memset(a_tail + rem * row, 0, (16 - rem) * row);
}

/* A packed in tile order: row group g (16 rows, the last zero-padded) of 64-k step i is the 1 KB at
 * dst + (g * K_pad / 64 + i) * 1024, its rows 64 bytes apart, so that each A tile load reads 1 KB in a row instead
 * of 16 lines K_pad apart (16 streams, each line on its own page at K_pad >= 4096). bk_gemm_ternary_tiles packs
 * once per product, before the tile ranges run; dst holds tiles_pack_bytes(m, k_pad); this call packs the row
 * groups [group_begin, group_end). */
static size_t tiles_pack_bytes(int m, int k_pad) { return (size_t)((m + 15) / 16) * 16 * k_pad; }
static void tiles_pack_a(const int8_t *xq, int m, int k_pad, int8_t *dst, int group_begin, int group_end) {
    const int kc = k_pad / 64;
    for (int gr = group_begin; gr < group_end; gr++)
        for (int r = 0; r < 16; r++) {
            const int row = gr * 16 + r;
            int8_t *d = dst + (size_t)gr * kc * 1024 + (size_t)r * 64;
            if (row < m) {
                const int8_t *src = xq + (size_t)row * k_pad;
                for (int i = 0; i < kc; i++) memcpy(d + (size_t)i * 1024, src + (size_t)i * 64, 64);
            } else {
                for (int i = 0; i < kc; i++) memset(d + (size_t)i * 1024, 0, 64);
            }
        }
}

/* C block (cbuf: 32 x 32 int32) of activation rows row0.. (na groups of 16) x weight tiles t.. (nb) -> out.
 * Portable C: one float division per result (the vector paths' formula, bk_store_tile). */
static void tiles_finish_scalar(const tiles_args *g, const int32_t *cbuf, int row0, int na, int nb, int t) {
    int32_t dots[16];
    for (int i = 0; i < 16 * na && row0 + i < g->m; i++) {
        const int r = row0 + i;
        const int32_t sub = g->act_sum ? g->act_sum[r] : 0;
        const float scale = g->act_scale ? g->act_scale[r] : 1.0f;
        for (int j = 0; j < nb; j++) {
            for (int c = 0; c < 16; c++) dots[c] = cbuf[i * 32 + 16 * j + c] - sub;
            bk_store_tile(dots, (t + j) * 16, g->n, g->row_scale, scale, g->out ? g->out + (size_t)r * g->n : NULL,
                          g->out_i32 ? g->out_i32 + (size_t)r * g->n : NULL);
        }
    }
}

#if defined(__x86_64__)
/* The same block on AVX-512: 16 results per vdivps, the AVX-512 GEMM's own epilogue (finish_tile_avx512), so the
 * same floats. The scalar form was one divss per result: ~1,000 per 32 x 32 block, as long as the block's
 * 160 tdpbssd at K = 2560 on a core that issues a divss every ~3 cycles; on this project's Zen 5 core the
 * block took 195-200 ns scalar, 106-113 ns so (2560 and 13824 columns, 128 rows). */
AVX512_TARGET static void tiles_finish_avx512(const tiles_args *g, const int32_t *cbuf, int row0, int na, int nb,
                                              int t) {
    for (int i = 0; i < 16 * na && row0 + i < g->m; i++) {
        const int r = row0 + i;
        const int32_t sub = g->act_sum ? g->act_sum[r] : 0;
        const float scale = g->act_scale ? g->act_scale[r] : 1.0f;
        for (int j = 0; j < nb; j++)
            finish_tile_avx512(_mm512_loadu_si512(cbuf + i * 32 + 16 * j), sub, (t + j) * 16, g->n, g->row_scale,
                               scale, g->out ? g->out + (size_t)r * g->n : NULL,
                               g->out_i32 ? g->out_i32 + (size_t)r * g->n : NULL);
    }
}
#endif

/* the epilogue of the path in use (as tiles_unpacker: AVX-512's on that path, where the hardware tiles run) */
static void tiles_finish(const tiles_args *g, const int32_t *cbuf, int row0, int na, int nb, int t) {
#if defined(__x86_64__)
    if (bk_get_isa() == BK_ISA_AVX512) {
        tiles_finish_avx512(g, cbuf, row0, na, nb, t);
        return;
    }
#endif
    tiles_finish_scalar(g, cbuf, row0, na, nb, t);
}

/* One ternary tile16 tile (kb blocks of 64 bytes) -> its i8_tile16 codes: block b's plane s (codes >> 2s & 3)
 * is row 4b + s of 64 bytes. */
static void unpack_scalar(const uint8_t *p, int kb, int8_t *dst) {
    for (int b = 0; b < kb; b++)
        for (int s = 0; s < 4; s++)
            for (int i = 0; i < 64; i++) dst[(size_t)(4 * b + s) * 64 + i] = (int8_t)((p[(size_t)b * 64 + i] >> (2 * s)) & 3);
}

#if defined(__x86_64__)
AVX512_TARGET static void unpack_avx512(const uint8_t *p, int kb, int8_t *dst) {
    const __m512i m3 = _mm512_set1_epi8(3);
    for (int b = 0; b < kb; b++) {
        const __m512i v = _mm512_loadu_si512(p + (size_t)b * 64);
        int8_t *d = dst + (size_t)b * 256;
        _mm512_storeu_si512(d, _mm512_and_si512(v, m3));
        _mm512_storeu_si512(d + 64, _mm512_and_si512(_mm512_srli_epi16(v, 2), m3));
        _mm512_storeu_si512(d + 128, _mm512_and_si512(_mm512_srli_epi16(v, 4), m3));
        _mm512_storeu_si512(d + 192, _mm512_and_si512(_mm512_srli_epi16(v, 6), m3));
    }
}
#endif

/* the unpack of the path in use: AVX-512's where that is the path (the hardware tiles run only there), so the
 * emulated tiles test the same unpack; portable C elsewhere */
typedef void (*tiles_unpack_fn)(const uint8_t *p, int kb, int8_t *dst);
static tiles_unpack_fn tiles_unpacker(void) {
#if defined(__x86_64__)
    if (bk_get_isa() == BK_ISA_AVX512) return unpack_avx512;
#endif
    return unpack_scalar;
}
static void tiles_unpack(const uint8_t *p, int kb, int8_t *dst) { tiles_unpacker()(p, kb, dst); }

/* bk_table.tile_warm (tiles.h): the first two tiles (of tile_bytes each at base) of a range starting at
 * tile_begin read once at streaming speed, so the unpack or the tile loads after it find them in L2 (the tiles
 * after them are prefetched: tiles_ahead). Reads only: the results never depend on it. Portable C (the emulation
 * on aarch64) has nothing to warm with. */
static void tiles_warm(const uint8_t *base, size_t tile_bytes, int tile_begin, int tile_end) {
#if defined(__x86_64__)
    /* bk_stream_warm is AVX2 code: the emulation under BITNET_ISA=scalar runs on any x86 */
    if (!bk_table.tile_warm || tile_begin >= tile_end || bk_get_isa() == BK_ISA_SCALAR) return;
    bk_stream_warm(base + (size_t)tile_begin * tile_bytes, (size_t)(tile_end - tile_begin >= 2 ? 2 : 1) * tile_bytes);
#else
    (void)base, (void)tile_bytes, (void)tile_begin, (void)tile_end;
#endif
}

/* The tile bodies read their weights two tiles ahead, as the AVX-512 GEMM and q4 head do (gemm_ternary.c:
 * +17-34% at M = 8, +9-17% at 16 over warming each chunk first, on Zen 5): the range's first two tiles are warmed
 * (tiles_warm, before the loop), and the two after the ones in work are prefetched into L2 beside that work by
 * tiles_block, step[j] bytes of stream j per 64-k step (the ternary GEMM and the int8 head: the next pair's two
 * tiles from byte `off` of each, the k-block's start; the q4 head: the tile two ahead's codes and group scales).
 * tiles_next_pair fills *a for the first two and returns it, or NULL where there is nothing to prefetch (the last
 * pair, tile_warm off). */
typedef struct {
    const uint8_t *p[2]; /* the streams to prefetch at this k-block (NULL: none) */
    size_t step[2];      /* their bytes per 64-k step */
} tiles_ahead;
static const tiles_ahead *tiles_next_pair(tiles_ahead *a, const uint8_t *base, size_t tile_bytes, int t,
                                          int tile_end, size_t step, size_t off) {
    if (!bk_table.tile_warm || t + 2 >= tile_end) return NULL;
    a->p[0] = base + (size_t)(t + 2) * tile_bytes + off;
    a->p[1] = t + 3 < tile_end ? base + (size_t)(t + 3) * tile_bytes + off : NULL;
    a->step[0] = a->step[1] = step;
    return a;
}
static inline void tiles_prefetch_step(const tiles_ahead *a, int i) {
    for (int j = 0; j < 2; j++)
        if (a->p[j])
            for (size_t l = 0; l < a->step[j]; l += 64) __builtin_prefetch(a->p[j] + (size_t)i * a->step[j] + l, 0, 2);
}

/* Weights unpacked one 64-k step at a time, beside the tile multiply: by the streamed small-M bodies into their
 * ring (tile_stream: the step two ahead of the one multiplied) and, with tile_overlap, the next weights into the
 * buffer the next panel reads (one step per step of the first row-group pair). step(u, i, d0, d1) writes step i
 * of the weights u names at d0 (1 KB) and d1 (1 KB): the ternary GEMM's (tiles_ternary_step: 256 code bytes of
 * each of the nb tiles of a pair -> its B step) or the q4 head's (q4_tiles_step, gemm_tiles_q4_body.h: two
 * groups' codes and scales of one tile -> a step of W_lo at d0 and of W_hi at d1). dst: where step 0 goes
 * (step i at + 1024 i) for the overlap; the ring passes its slot instead. */
typedef struct tiles_steps {
    void (*step)(const struct tiles_steps *u, int i, int8_t *d0, int8_t *d1);
    tiles_unpack_fn fn;     /* the ternary unpack of the path (tiles_unpacker) */
    const uint8_t *src[2];  /* ternary: the pair's codes; q4: the tile's codes, its group scales */
    int8_t *dst[2];         /* tile_overlap: the buffers of the next panel */
    int nb;                 /* ternary: tiles in the pair */
} tiles_steps;
static void tiles_ternary_step(const tiles_steps *u, int i, int8_t *d0, int8_t *d1) {
    u->fn(u->src[0] + (size_t)256 * i, 4, d0);
    if (u->nb == 2) u->fn(u->src[1] + (size_t)256 * i, 4, d1);
}

/* the streamed small-M body's ring (tiles.h, bk_set_tile_stream): 4 slots of one 64-k step of a pair of tiles */
#define TILES_RING_SLOT 2048
#define TILES_RING_BYTES (4 * TILES_RING_SLOT)

/* ---------------- the hardware: AMX instructions as inline asm ----------------
 * Written out rather than GCC's _tile_* macros: those give tileloadd no memory operand and no clobber, so
 * nothing stops the compiler from sinking the unpack's stores past the load that reads them, and
 * _tile_loadconfig names only 8 of the configuration's 64 bytes. The asm needs binutils 2.36+, no -m flag. */
#if BK_HAVE_AMX
#define TB_SUFFIX amx
#define TB_CONFIG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(const bk_tilecfg_t *)(cfg)))
#define TB_RELEASE() __asm__ volatile("tilerelease" ::: "memory")
#define TB_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TB_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define TB_STORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(base)), "r"((long)(stride)) : "memory")
#define TB_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#include "gemm_tiles_body.h"    /* the ternary GEMM and the int8 head */
#include "gemm_tiles_q4_body.h" /* the q4 head, on the same tiles_block */
#include "tiles_end.h"          /* undefines the TB_ macros */
#endif

/* ---------------- the emulation (tiles_emu.c) ---------------- */
#define TB_SUFFIX emu
#define TB_CONFIG(cfg) bk_emu_tile_config(cfg)
#define TB_RELEASE() bk_emu_tile_release()
#define TB_ZERO(t) bk_emu_tile_zero(t)
#define TB_LOAD(t, base, stride) bk_emu_tile_load(t, base, stride)
#define TB_STORE(t, base, stride) bk_emu_tile_store(t, base, stride)
#define TB_DPBSSD(c, a, b) bk_emu_tile_dpbssd(c, a, b)
#include "gemm_tiles_body.h"    /* the ternary GEMM and the int8 head */
#include "gemm_tiles_q4_body.h" /* the q4 head, on the same tiles_block */
#include "tiles_end.h"          /* undefines the TB_ macros */

/* ---------------- timing only: no tile instructions (BK_TILES_NULL, tiles.h) ----------------
 * Everything the bodies do beside the tile unit, nothing of it: the empty asm keeps each load and store's place
 * in the loop and its address computed, and tells the compiler memory may change there. Results are wrong. */
#define TB_SUFFIX null
#define TB_CONFIG(cfg) ((void)(cfg))
#define TB_RELEASE() ((void)0)
#define TB_ZERO(t) ((void)0)
#define TB_LOAD(t, base, stride) __asm__ volatile("" ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define TB_STORE(t, base, stride) __asm__ volatile("" ::"r"((void *)(base)), "r"((long)(stride)) : "memory")
#define TB_DPBSSD(c, a, b) ((void)0)
#include "gemm_tiles_body.h"
#include "gemm_tiles_q4_body.h"
#include "tiles_end.h"

/* The tile bodies by mode (tiles.h), which dispatch.c puts in front of the path's GEMM body. */
const bk_gemm_ternary_fn bk_gemm_ternary_tile_bodies[4] = {
#if BK_HAVE_AMX
    [BK_TILES_AMX] = gemm_ternary_tiles_amx,
#endif
    [BK_TILES_EMU] = gemm_ternary_tiles_emu,
    [BK_TILES_NULL] = gemm_ternary_tiles_null,
};

/* The ternary GEMM on the tiles with A packed once (tiles_pack_a) into the calling thread's buffer, then the tile
 * ranges on the pool as bk_gemm_ternary runs them, each reading that copy. */
typedef struct {
    const uint8_t *w;
    const float *row_scale;
    const int8_t *xq;
    int m, k_pad;
    const float *act_scale;
    const int32_t *act_sum;
    float *out;
    int32_t *out_i32;
    int n;
    const int8_t *apack;
} ternary_tiles_job;

static void ternary_tiles_range(void *ctx, int b, int e) {
    const ternary_tiles_job *j = ctx;
    void (*body)(const uint8_t *, const float *, const int8_t *, int, int, const float *, const int32_t *, float *,
                 int32_t *, int, int, int, const int8_t *) = gemm_ternary_tiles_a_emu;
#if BK_HAVE_AMX
    if (bk_table.tiles_mode == BK_TILES_AMX) body = gemm_ternary_tiles_a_amx;
#endif
    if (bk_table.tiles_mode == BK_TILES_NULL) body = gemm_ternary_tiles_a_null;
    body(j->w, j->row_scale, j->xq, j->m, j->k_pad, j->act_scale, j->act_sum, j->out, j->out_i32, j->n, b, e,
         j->apack);
}

/* The rows packed (TILES_PACK_MIN_ROWS < M <= TILES_PACK_MAX_ROWS); the rest read A from xq as before.
 * Measured on a 2-core AMX Xeon (1 thread, both builds in one process, alternated, thread CPU time): M = 32
 * 1.58-1.66x with the weights in cache, 1.29-1.38x from memory; M = 128 1.19-1.22x and 0.95-1.24x; M = 16 mixed
 * (0.86-1.17x: one row group, nothing gained); M = 512 on 2 threads, down 2560 x 6912: 0.90-0.92x, the caller's
 * 3.5 MB copy made alone before the pool runs. */
#define TILES_PACK_MIN_ROWS 16
#define TILES_PACK_MAX_ROWS 128
static _Thread_local int8_t *pack_buf;
static _Thread_local size_t pack_cap;

int bk_gemm_ternary_tiles(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                          const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n) {
    const int mode = bk_table.tiles_mode;
    if (mode == BK_TILES_OFF || m < bk_table.tile_min_rows || m <= TILES_PACK_MIN_ROWS) return 0;
    if (m > TILES_PACK_MAX_ROWS) return 0;
    if (bk_table.gemm_ternary != bk_gemm_ternary_tile_bodies[mode]) return 0;
    const size_t bytes = tiles_pack_bytes(m, k_pad);
    if (bytes > pack_cap) {
        free(pack_buf);
        pack_buf = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        pack_cap = pack_buf ? bytes : 0;
        if (!pack_buf) return 0;
    }
    ternary_tiles_job job = {w, row_scale, xq, m, k_pad, act_scale, act_sum, out, out_i32, n, pack_buf};
    tiles_pack_a(xq, m, k_pad, pack_buf, 0, (m + 15) / 16);
    const int n_tiles = (n + 15) / 16;
    bk_run_tiles(n_tiles, (size_t)n_tiles * k_pad * m, 16 * 4096, ternary_tiles_range, &job);
    return 1;
}

typedef struct {
    tiles_args g;
    const int8_t *w;
    int failed;
} i8_tiles_job;

static void i8_tiles_range(void *ctx, int b, int e) {
    i8_tiles_job *j = ctx;
    int ok = 0;
#if BK_HAVE_AMX
    if (bk_table.tiles_mode == BK_TILES_AMX) ok = gemm_i8_tiles_amx(&j->g, j->w, b, e);
#endif
    if (bk_table.tiles_mode == BK_TILES_EMU) ok = gemm_i8_tiles_emu(&j->g, j->w, b, e);
    if (bk_table.tiles_mode == BK_TILES_NULL) ok = gemm_i8_tiles_null(&j->g, j->w, b, e);
    if (!ok) __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
}

int bk_gemm_i8_tiles(const int8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                     const float *act_scale, float *out, int32_t *out_i32, int n) {
    if (bk_table.tiles_mode == BK_TILES_OFF || m < bk_table.tile_min_rows) return 0;
    i8_tiles_job job = {{xq, m, k_pad, act_scale, NULL, row_scale, out, out_i32, n}, w, 0};
    const int n_tiles = (n + 15) / 16;
    bk_run_tiles(n_tiles, (size_t)n_tiles * k_pad * m, 16 * 4096, i8_tiles_range, &job);
    return job.failed ? 0 : 1; /* a thread without scratch: the vector path redoes the whole product */
}

typedef struct {
    tiles_args g;
    const uint8_t *codes, *gscale;
    int failed;
} q4g_tiles_job;

static void q4g_tiles_range(void *ctx, int b, int e) {
    q4g_tiles_job *j = ctx;
    int ok = 0;
#if BK_HAVE_AMX
    if (bk_table.tiles_mode == BK_TILES_AMX) ok = gemm_q4g_tiles_amx(&j->g, j->codes, j->gscale, b, e);
#endif
    if (bk_table.tiles_mode == BK_TILES_EMU) ok = gemm_q4g_tiles_emu(&j->g, j->codes, j->gscale, b, e);
    if (bk_table.tiles_mode == BK_TILES_NULL) ok = gemm_q4g_tiles_null(&j->g, j->codes, j->gscale, b, e);
    if (!ok) __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
}

int bk_gemm_q4g_tiles(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, int m,
                      int k_pad, const float *act_scale, float *out, int32_t *out_i32, int n) {
    if (bk_table.tiles_mode == BK_TILES_OFF || m < bk_table.tile_min_rows) return 0;
    q4g_tiles_job job = {{xq, m, k_pad, act_scale, NULL, d, out, out_i32, n}, codes, gscale, 0};
    const int n_tiles = (n + 15) / 16;
    bk_run_tiles(n_tiles, (size_t)n_tiles * k_pad * m, 16 * 4096, q4g_tiles_range, &job);
    return job.failed ? 0 : 1; /* a thread without scratch: the vector path redoes the whole product */
}
