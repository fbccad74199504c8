/* Matrix tiles (Intel AMX): the small tile API the multi-row kernels are written against, its portable C
 * emulation, and the switch that puts the tile bodies in front of the vector ones.
 *
 * AMX (Sapphire Rapids and later Xeons) has eight tile registers of up to 16 rows x 64 bytes and
 * tdpbssd / tdpbusd: C[16 x 16 int32] += A[16 x 64 int8] . B[16 x 64 int8 in VNNI order], where B's row kk
 * holds, for each of the 16 output columns n, the 4 bytes k = 4kk .. 4kk+3 (bytes 4n .. 4n+3). That is the
 * tile16 ternary layout after its usual shift+and: the 64 bytes of one shifted plane of a 16-k block are one
 * B row (lane n = weight row n, byte q = k 4s+q), the i8_tile16 head is B tiles as stored, and each nibble
 * plane of a q4g_tile16 quarter is a B row too, multiplied by its group scale's two nibbles into two B tiles
 * (gemm_tiles_q4_body.h). So the tiles multiply the same codes and the same int8 activations as vpdpbusd,
 * and the int32 sums are the same integers: every path stays bit-identical (gemm_tiles.c).
 *
 * Two implementations of the API, one kernel source (gemm_tiles_body.h and gemm_tiles_q4_body.h are compiled once
 * per implementation):
 *   - hardware: the _tile_* intrinsics, run only where cpuid reports amx-tile + amx-int8, XCR0 enables the
 *     tile state and Linux grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once);
 *   - emulation (tiles_emu.c): the same instructions in portable C on a thread-local register file, with
 *     the hardware's shape rules checked (a violation aborts naming it, as the CPU would fault). Any machine
 *     (x86 or aarch64) runs the real blocking, unpacking and edge handling through it: BITNET_TILES=emu.
 *
 * Mode (one per process, like the ISA choice): BK_TILES_OFF (the vector bodies only), BK_TILES_AMX (the
 * hardware tiles for products of at least bk_tile_min_rows rows; the auto choice where they are granted),
 * BK_TILES_EMU (the emulation, for tests). BITNET_ISA=avx512 (any explicit ISA) turns the tiles off.
 */
#ifndef BITNET_TILES_H
#define BITNET_TILES_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

enum bk_tiles_mode { BK_TILES_OFF = 0, BK_TILES_AMX = 1, BK_TILES_EMU = 2, BK_TILES_NULL = 3 };
/* BK_TILES_NULL is for timing only, never for results: the tile bodies with their six tile instructions compiled
 * out (gemm_tiles.c), so that a machine without AMX can time everything else they do (the unpack, the A tail,
 * the epilogue, the prefetch, the loops): the vector side that AMX runs beside or between its tdpbssd.
 * Set only through bk_set_tiles_timing_only (simd._kernels._set_tiles_timing_only, bench_tiles.py
 * --vector-side); the results it writes are wrong. */
int bk_set_tiles_timing_only(int on);

/* The hardware's 64-byte tile configuration (palette 1), as ldtilecfg reads it. */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile i (only 0..7 exist) */
    uint8_t rows[16];
} bk_tilecfg_t;

/* dispatch.c: what the CPU and the OS allow, and the mode in force */
int bk_tiles_supported(void);      /* 1: hardware tiles usable in this process (CPU + XCR0 + Linux's grant) */
const char *bk_tiles_reason(void); /* why (not): one line for `bitnet info` */
int bk_set_tiles(int mode);        /* 0 ok; -1 the hardware tiles were asked for and are not usable */
int bk_get_tiles(void);
void bk_set_tile_min_rows(int m);  /* products of fewer rows keep the vector bodies (m <= 0: the default) */
int bk_get_tile_min_rows(void);
/* K-blocking of the tile bodies: k per block (rounded down to a multiple of 64; <= 0: the whole K in one block,
 * the default: on Emerald Rapids (bench_tiles.py --kblocks, docs/performance.md) one block was best or within
 * noise of the best at M = 512 on every 2B-4T shape, 2 and 16 threads; blocks of 1-2K won only at M = 128). */
void bk_set_tile_kblock(int k);
int bk_get_tile_kblock(void);
/* The tile bodies at M <= 32 (one or two 16-row groups: batched decode, verify rows, the head of a batched
 * step), on = 1: each pair of ternary weight tiles (the q4 head: each tile's W_lo and W_hi) is unpacked one 64-k
 * step (2 KB) at a time into a 4-slot ring in L1, two steps before the tile loads that read it, with C in the tile
 * registers over the whole of K, so the unpack's stores can overlap the tdpbssd chain and never leave L1 (the
 * default). Off (0): the whole K is unpacked first (80 KB at K = 2560: through L2), then multiplied; at these M it
 * is read by one row-group pair only. The results are the same either way. Measured on Emerald Rapids
 * (2026-11-30, bench_tiles.py --stream-ms, weights from memory): streamed 1.19-1.81x the whole-K body at 16-32
 * rows on 2 threads, 1.16-1.60x on 16, and ahead of 512-k blocks (the next best) on every shape but one tie. */
void bk_set_tile_stream(int on);
int bk_get_tile_stream(void);
/* The tile bodies' weight reads, on = 1 (the default): the weights arrive ahead of the unpack or the tile loads,
 * as in the AVX-512 GEMM and q4 head (gemm_ternary.c, gemv_q4g.c): two tiles ahead (a range's first two read at
 * streaming speed by bk_stream_warm, every later one prefetched into L2 beside the work two tiles before it: the
 * ternary codes, the int8 head's rows, the q4 head's codes and group scales). Off (0): the unpack (or the tile
 * loads) read them from memory as they go, one demand miss at a time: on the lent Xeon the tiles at M = 16 took
 * the codes at ~9.6 GB/s on 2 threads, what one core's demand-read unpack reaches (this AMD core: 8.4-9.2 GB/s
 * of codes; warmed first, 18.6-19.2 including the warm), not the stream rate. The same results either way;
 * bench_tiles.py --warm-ms times both on an AMX machine. */
void bk_set_tile_warm(int on);
int bk_get_tile_warm(void);
/* The tile bodies' unpack beside the multiply, on = 1: in the ternary GEMM (with the whole of K in one block and
 * the body not streamed) a range's first pair of weight tiles is unpacked before its row groups as before, and
 * every later pair during the first row-group pair of the one before it, one 64-k step per step, into a second
 * buffer (the two swap); in the q4 head the same a tile at a time (W_lo and W_hi). The unpack's vector work
 * and stores then run beside the tdpbssd chain instead of before it: per pair 80 KB of stores at K = 2560,
 * against 640 tdpbssd at M = 128 (the prefill chunk), 160 at M = 32. On by default; off (0): each pair unpacked
 * whole, then multiplied. The same results either way; the weights' read ahead (tile_warm) then prefetches the
 * pair after the one being unpacked. Measured on Emerald Rapids (2026-11-30, bench_tiles.py --overlap-ms, whole-K
 * bodies, weights from memory): at 128 and 512 rows 1.02-1.56x on 2 threads and 1.01-1.06x on 16, the q4 head
 * 1.22-1.33x; at 16 rows, where the streamed body runs instead, 0.97-1.15x. */
void bk_set_tile_overlap(int on);
int bk_get_tile_overlap(void);
/* The default crossover of the hardware tiles: below it the AVX-512 bodies run. Measured on Emerald Rapids
 * (bench/bench_tiles.py, docs/performance.md): every 2B-4T GEMM shape and both LM heads, at 2 and at 16 threads,
 * lose on the tiles at M = 8 (0.67-0.84x) and win from M = 16 (1.10-2.19x). The emulation's default is 1, so
 * that every multi-row product of a test goes through the tile code. */
#define BK_TILE_MIN_ROWS_AMX 16

/* tiles_emu.c: the emulated instructions (tile numbers 0..7; strides in bytes) */
void bk_emu_tile_config(const bk_tilecfg_t *cfg);
void bk_emu_tile_release(void);
void bk_emu_tile_zero(int t);
void bk_emu_tile_load(int t, const void *base, size_t stride);
void bk_emu_tile_store(int t, void *base, size_t stride);
void bk_emu_tile_dpbssd(int c, int a, int b); /* C += A (s8) . B (s8) */
void bk_emu_tile_dpbusd(int c, int a, int b); /* C += A (u8) . B (s8) */
void bk_emu_tile_dpbf16ps(int c, int a, int b); /* C (f32) += A (bf16 pairs) . B (bf16 pairs) */

/* gemm_tiles.c: the ternary tile body of each mode (NULL: none), which dispatch.c puts in front of the path's
 * own GEMM body (kept in bk_table.gemm_ternary_vector, run under bk_table.tile_min_rows rows). */
extern const bk_gemm_ternary_fn bk_gemm_ternary_tile_bodies[4];
/* ternary GEMM, M rows (gemm_ternary.c's bk_gemm_ternary asks first): 1 when it ran the product on the tiles with
 * A packed in tile order once for all threads; 0 when the tiles are off, M is under the crossover, bk_table's
 * body is not the tile body or the packed copy could not be had (bk_table.gemm_ternary then runs it). */
int bk_gemm_ternary_tiles(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                          const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n);
uint64_t bk_tiles_products(void); /* tile-body calls that ran on the tiles, since the process started */
/* int8 head, M rows (gemv_i8.c's bk_gemm_i8 asks first): 1 when it ran the product on the tiles, 0 when the
 * tiles are off, m is under the crossover or a thread had no scratch (the vector path then does it all). */
int bk_gemm_i8_tiles(const int8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                     const float *act_scale, float *out, int32_t *out_i32, int n);
/* q4 head (q4g_tile16), M rows (gemv_q4g.c's bk_gemv_q4g asks first): the same contract */
int bk_gemm_q4g_tiles(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, int m,
                      int k_pad, const float *act_scale, float *out, int32_t *out_i32, int n);

/* x86 hardware tiles need GCC 11+ / clang 12+ (the AMX intrinsics) */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define BK_HAVE_AMX 1
#else
#define BK_HAVE_AMX 0
#endif

#endif
