/* The group-quantized q4 head (q4g_tile16, gemv_q4g.c) at M > 1 rows on the tiles, written against the tile API
 * like gemm_tiles_body.h and included by gemm_tiles.c once per implementation (amx, emu), just after that
 * file, whose tiles_block it runs (tiles_end.h then undefines the TB_ macros).
 *
 *   dot[n] = sum_g s[n,g] * sum_{k in g} q[n,k] * xq[k],   q = u - 8 in -8..7, s a byte per row and group of 32 k
 *
 * The per-group scale does not fit a 64-k tdp, but it can go into the weights, exactly, split in two nibbles:
 * s = 16 s_hi + s_lo (both 0..15), so s_lo * q and s_hi * q are in -120..105, valid s8 B operands, and
 *   dot = A . W_lo + 16 * (A . W_hi),   W_lo[n,k] = s_lo[n,g(k)] * q[n,k],   W_hi the same with s_hi.
 * Two B tiles per 16 weight rows x 64 k, each accumulated in its own C over all of K with full tdpbssd: no
 * per-group epilogue, and no act_sum correction (the -8 is in B). The sums are the mathematical integers
 * (|A . W_lo| <= 128 * 120 * 8192 < 2^27) and the vector paths' int32 dots are too (|dot| < 2^29 for s <= 63,
 * K_pad <= 8192, checked at the boundary), so every result is the same float. Base 16 rather than 8 keeps any
 * byte scale exact, not only 0..63: the combination is then equal modulo 2^32 whatever the scales hold.
 *
 * Why not K = 32 tiles per group with a vector epilogue per group: the TMUL's cost is per row of A (tdpbssd
 * 16 x 16 x 64: ~16 cycles on Sapphire Rapids), so a half-K tdp costs about a full one and two groups cost the
 * same 2 tdps per 64 k as the split above; but each group would add a tilestored of C and, per 16 x 16 block,
 * 16 vpmulld (2 uops each, port 0) + 16 vpaddd on the two 512-bit vector ports: ~2x the TMUL time, for every
 * 16-row group of A. The split's extra vector work is the unpack (per 16 weight rows x 64 k: 8 loads, 24
 * and/shift, 32 vpmullw + 32 vpsubb, 32 stores, ~35 cycles), done once per call and reused by all M/16 groups.
 *
 * Registers: tmm0..3 hold C for 2 A tiles x (W_lo, W_hi) of one 16-row weight tile, tmm4..5 A, tmm6..7 B
 * (W_lo, W_hi). Per 64-k step: 4 loads, 4 tdpbssd, as the ternary body's 2 x 2 block.
 */
#if !defined(TB_FN) || !defined(TB_DPBSSD)
#error "gemm_tiles_q4_body.h follows gemm_tiles_body.h (gemm_tiles.c)"
#endif

/* ---- once for both implementations: the unpack and the epilogue ---- */
#ifndef BITNET_GEMM_TILES_Q4_ONCE
#define BITNET_GEMM_TILES_Q4_ONCE

/* One q4g_tile16 tile (groups of 256 code bytes + 16 scale bytes) -> W_lo at lo, W_hi at hi, in VNNI B order:
 * row kk (64 bytes, 16 per 64-k step) holds k = 4kk .. 4kk+3 of the 16 weight rows (bytes 4r .. 4r+3). Group g's
 * quarter j has row r's k = 32g+8j+c in the low nibble of byte 4r+c and k + 4 in the high one: the low nibble
 * plane is B row 8g+2j as it stands, the high one row 8g+2j+1. */
static void q4_unpack_scalar(const uint8_t *codes, const uint8_t *gscale, int groups, int8_t *lo, int8_t *hi) {
    for (int g = 0; g < groups; g++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 64; i++) {
                const unsigned b = codes[(size_t)g * 256 + 64 * j + i], s = gscale[(size_t)g * 16 + i / 4];
                const size_t row = (size_t)(8 * g + 2 * j) * 64 + i;
                lo[row] = (int8_t)((int)(s & 15) * ((int)(b & 15) - 8));
                lo[row + 64] = (int8_t)((int)(s & 15) * ((int)(b >> 4) - 8));
                hi[row] = (int8_t)((int)(s >> 4) * ((int)(b & 15) - 8));
                hi[row + 64] = (int8_t)((int)(s >> 4) * ((int)(b >> 4) - 8));
            }
}

#if defined(__x86_64__)
/* The bytes u s - 8 s with one vpmullw per 64 bytes: a word holds 2 bytes of the same weight row, so of the
 * same nibble s; u0 s + 256 u1 s <= 225 * 257 has no carry between them. 8 s per byte is 0x0808 * s. */
AVX512_TARGET static void q4_unpack_avx512(const uint8_t *codes, const uint8_t *gscale, int groups, int8_t *lo,
                                           int8_t *hi) {
    const __m512i m15 = _mm512_set1_epi8(15), w15 = _mm512_set1_epi16(15), eight = _mm512_set1_epi16(0x0808);
    for (int g = 0; g < groups; g++) {
        __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gscale + (size_t)g * 16)));
        s = _mm512_or_si512(s, _mm512_slli_epi32(s, 16)); /* both words of dword r: s[r] */
        const __m512i slo = _mm512_and_si512(s, w15), shi = _mm512_srli_epi16(s, 4);
        const __m512i elo = _mm512_mullo_epi16(slo, eight), ehi = _mm512_mullo_epi16(shi, eight);
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512(codes + (size_t)g * 256 + 64 * j);
            const __m512i u0 = _mm512_and_si512(v, m15), u1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
            const size_t row = (size_t)(8 * g + 2 * j) * 64;
            _mm512_storeu_si512(lo + row, _mm512_sub_epi8(_mm512_mullo_epi16(u0, slo), elo));
            _mm512_storeu_si512(lo + row + 64, _mm512_sub_epi8(_mm512_mullo_epi16(u1, slo), elo));
            _mm512_storeu_si512(hi + row, _mm512_sub_epi8(_mm512_mullo_epi16(u0, shi), ehi));
            _mm512_storeu_si512(hi + row + 64, _mm512_sub_epi8(_mm512_mullo_epi16(u1, shi), ehi));
        }
    }
}
#endif

/* the unpack of the path in use, as tiles_unpack: AVX-512's on that path (the hardware tiles run only there) */
static void q4_tiles_unpack(const uint8_t *codes, const uint8_t *gscale, int groups, int8_t *lo, int8_t *hi) {
#if defined(__x86_64__)
    if (bk_get_isa() == BK_ISA_AVX512) {
        q4_unpack_avx512(codes, gscale, groups, lo, hi);
        return;
    }
#endif
    q4_unpack_scalar(codes, gscale, groups, lo, hi);
}

/* C block (cbuf: 32 x 32 int32; columns 0..15 A . W_lo, 16..31 A . W_hi) of rows row0.. (na groups of 16),
 * weight tile t -> out. The combination wraps like the vector paths' int32 arithmetic (unsigned: defined). */
static void q4_tiles_finish_scalar(const tiles_args *g, const int32_t *cbuf, int row0, int na, int t) {
    int32_t dots[16];
    for (int i = 0; i < 16 * na && row0 + i < g->m; i++) {
        const int r = row0 + i;
        for (int c = 0; c < 16; c++)
            dots[c] = (int32_t)((uint32_t)cbuf[i * 32 + c] + 16u * (uint32_t)cbuf[i * 32 + 16 + c]);
        bk_store_tile(dots, t * 16, g->n, g->row_scale, g->act_scale ? g->act_scale[r] : 1.0f,
                      g->out ? g->out + (size_t)r * g->n : NULL, g->out_i32 ? g->out_i32 + (size_t)r * g->n : NULL);
    }
}

#if defined(__x86_64__)
/* the same on AVX-512 (tiles_finish_avx512: a vdivps per 16 results instead of 16 divss; vpaddd wraps as the
 * unsigned sum does) */
AVX512_TARGET static void q4_tiles_finish_avx512(const tiles_args *g, const int32_t *cbuf, int row0, int na, int t) {
    for (int i = 0; i < 16 * na && row0 + i < g->m; i++) {
        const int r = row0 + i;
        const __m512i lo = _mm512_loadu_si512(cbuf + i * 32), hi = _mm512_loadu_si512(cbuf + i * 32 + 16);
        finish_tile_avx512(_mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)), 0, t * 16, g->n, g->row_scale,
                           g->act_scale ? g->act_scale[r] : 1.0f, g->out ? g->out + (size_t)r * g->n : NULL,
                           g->out_i32 ? g->out_i32 + (size_t)r * g->n : NULL);
    }
}
#endif

static void q4_tiles_finish(const tiles_args *g, const int32_t *cbuf, int row0, int na, int t) {
#if defined(__x86_64__)
    if (bk_get_isa() == BK_ISA_AVX512) {
        q4_tiles_finish_avx512(g, cbuf, row0, na, t);
        return;
    }
#endif
    q4_tiles_finish_scalar(g, cbuf, row0, na, t);
}
/* step i of one tile's unpack (tiles_steps: two groups, 512 code bytes and 32 scale bytes -> 1 KB of W_lo at d0
 * and of W_hi at d1), for the streamed body's ring and for tile_overlap */
static void q4_tiles_step(const tiles_steps *u, int i, int8_t *d0, int8_t *d1) {
    q4_tiles_unpack(u->src[0] + (size_t)512 * i, u->src[1] + (size_t)32 * i, 2, d0, d1);
}
/* The streamed body's ring with the epilogue of the tile before beside it: step fin of this tile's unpack also
 * runs that tile's q4_tiles_finish (its C block stored by tilestored before this block began), so the epilogue's
 * divisions and its stores to out overlap this tile's tdpbssd instead of running between two blocks. */
typedef struct {
    tiles_steps s; /* first: the ring's step gets &s */
    const tiles_args *g;
    const int32_t *cbuf; /* the tile before's C block (NULL: none) */
    int na, t, fin;
} q4_ring_fin;
static void q4_tiles_step_fin(const tiles_steps *u, int i, int8_t *d0, int8_t *d1) {
    const q4_ring_fin *f = (const q4_ring_fin *)u;
    q4_tiles_step(u, i, d0, d1);
    if (i == f->fin && f->cbuf) q4_tiles_finish(f->g, f->cbuf, 0, f->na, f->t);
}
#endif /* BITNET_GEMM_TILES_Q4_ONCE */

/* ---- per implementation (TB_FN and tiles_block: gemm_tiles_body.h, included just before) ---- */

/* q4g_tile16 weights, tiles [tile_begin, tile_end): each tile is unpacked once into the thread's W_lo | W_hi
 * (2 x 16 x K_pad bytes: 80 KB at K = 2560) and reused by every row group of A (the last, partial one from the
 * zero-padded tail copy). With tile_overlap, a range's first tile is unpacked before its row groups and every
 * later one beside the first row-group pair of the tile before it, into a second W_lo | W_hi (the two swap).
 * With tile_stream at M <= 32 (one row-group pair), each tile is unpacked one 64-k step at a time into the ring
 * beside its multiply instead (tiles_stream): W_lo | W_hi never leave L1, and its epilogue runs beside the
 * next tile's multiply (q4_ring_fin). 0 when the thread's scratch could not be had (the caller then runs the
 * vector body). */
static int TB_FN(gemm_q4g_tiles)(const tiles_args *g, const uint8_t *codes, const uint8_t *gscale, int tile_begin,
                                   int tile_end) {
    const int groups = g->k_pad / 32, kc = g->k_pad / 64, full = g->m / 16, rgroups = (g->m + 15) / 16;
    const int stream = bk_table.tile_stream && g->m <= 32, overlap = bk_table.tile_overlap && !stream;
    const size_t utile = (size_t)16 * g->k_pad, stride = (size_t)g->k_pad;
    const size_t wbytes = stream ? TILES_RING_BYTES : (size_t)(overlap ? 4 : 2) * utile; /* W_lo | W_hi (ring) */
    uint8_t *s = tiles_scratch(utile + wbytes + 2 * 32 * 32 * 4);
    if (!s) return 0;
    int8_t *a_tail = (int8_t *)s, *w = (int8_t *)s + utile, *w_next = overlap ? w + 2 * utile : NULL;
    int32_t *cbuf = (int32_t *)(s + utile + wbytes);
    const size_t cbytes = (size_t)groups * 256, sbytes = (size_t)groups * 16; /* a tile's codes, its group scales */
    tiles_copy_tail(g, a_tail);
    tiles_count();
    TB_CONFIG(&tiles_cfg_full);
    tiles_warm(codes, cbytes, tile_begin, tile_end);
    tiles_warm(gscale, sbytes, tile_begin, tile_end);
    for (int t = tile_begin; t < tile_end; t++) {
        /* the tile two ahead: 2 groups of codes (512 bytes) and of scales (32) per 64-k step */
        const tiles_ahead ah = {{codes + (size_t)(t + 2) * cbytes, gscale + (size_t)(t + 2) * sbytes}, {512, 32}};
        const tiles_ahead *next = bk_table.tile_warm && t + 2 < tile_end ? &ah : NULL;
        if (stream) { /* C of tile t in cbuf half t & 1; tile t - 1's epilogue beside step 3 (q4_ring_fin) */
            int32_t *cb = cbuf + (size_t)(t & 1) * 32 * 32;
            const int32_t *before = t > tile_begin ? cbuf + (size_t)((t - 1) & 1) * 32 * 32 : NULL;
            const q4_ring_fin ring = {
                {q4_tiles_step_fin, NULL, {codes + (size_t)t * cbytes, gscale + (size_t)t * sbytes}, {NULL, NULL}, 2},
                g, before, rgroups, t - 1, kc - 1 < 3 ? kc - 1 : 3};
            TB_FN(tiles_stream)(g, &ring.s, 2, a_tail, w, cb, next);
            if (t + 1 == tile_end) q4_tiles_finish(g, cb, 0, rgroups, t);
            continue;
        }
        const tiles_steps un = {q4_tiles_step, NULL,
                                {codes + (size_t)(t + 1) * cbytes, gscale + (size_t)(t + 1) * sbytes},
                                {w_next, w_next + utile}, 2};
        const tiles_steps *unext = overlap && t + 1 < tile_end ? &un : NULL;
        if (!overlap || t == tile_begin)
            q4_tiles_unpack(codes + (size_t)t * cbytes, gscale + (size_t)t * sbytes, groups, w, w + utile);
        for (int gr = 0; gr < rgroups; gr += 2) {
            const int8_t *a0 = gr < full ? g->xq + (size_t)gr * 16 * stride : a_tail;
            const int8_t *a1 = gr + 1 < full ? g->xq + (size_t)(gr + 1) * 16 * stride : a_tail;
            /* B tile pair: W_lo at w, W_hi at w + utile -> C columns 0..15 and 16..31 */
            TB_FN(tiles_block_any)(a0, a1, stride, w, utile, kc, rgroups - gr >= 2 ? 2 : 1, 2, cbuf, 0, NULL,
                                   gr ? NULL : next, gr ? NULL : unext);
            q4_tiles_finish(g, cbuf, gr * 16, rgroups - gr >= 2 ? 2 : 1, t);
        }
        if (overlap) {
            int8_t *swap = w;
            w = w_next;
            w_next = swap;
        }
    }
    TB_RELEASE();
    return 1;
}
