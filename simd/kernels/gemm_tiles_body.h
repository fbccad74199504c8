/* The tile kernels, written once against the tile API and compiled once per implementation (gemm_tiles.c
 * includes this file with TB_SUFFIX = amx, then emu, after defining TB_CONFIG / TB_RELEASE / TB_ZERO /
 * TB_LOAD / TB_STORE / TB_DPBSSD for it; then gemm_tiles_q4_body.h, which uses its tiles_block, and
 * tiles_end.h, which undefines the TB_ macros). Everything but those six instructions (the blocking, the A tail,
 * the unpacking, the epilogue) is the same code on the hardware and on the emulation.
 *
 * Registers: tmm0..3 hold C for 2 A tiles x 2 B tiles (32 activation rows x 32 weight rows), tmm4..5 A (16
 * activation rows x 64 k each), tmm6..7 B (16 weight rows x 64 k each, VNNI order = i8_tile16 order).
 * Per 64-k step: 4 loads, 4 tdpbssd (16 x 16 x 64 multiply-adds each). Loops, outside in: weight tile pairs
 * (the thread's range), k-blocks (tiles_kblock), pairs of 16-row activation groups, 64-k steps.
 */
#define TB_CAT2(a, b) a##_##b
#define TB_CAT(a, b) TB_CAT2(a, b)
#define TB_FN(name) TB_CAT(name, TB_SUFFIX)

/* C[32 x 32] (cbuf, stride 128 bytes) = (acc ? C : 0) + A (NA tiles: rows of a0, a1, stride a_stride) . B (NB
 * tiles at b and b + b_tile, 1 KB per 64-k step) over kc steps. NA, NB are constants after inlining. ring
 * non-NULL (the streamed small-M bodies): b is the ring (TILES_RING_BYTES) and b_tile 1024; each step's B is
 * unpacked there (ring->step) into slot i % 4 two steps before the loads that read it (the first two before the
 * loop), so those loads find stores retired long before, not ones still waiting behind the previous step's
 * tdpbssd, and a slot is rewritten two steps after its loads. ahead non-NULL: the next weights' bytes of each
 * step prefetched into L2 beside it (tiles_ahead). next non-NULL (tile_overlap): the next weights' step i
 * unpacked into their own buffer (next->dst) beside step i. */
__attribute__((always_inline)) static inline void TB_FN(tiles_block)(const int8_t *a0, const int8_t *a1,
                                                                    size_t a_stride, const int8_t *b,
                                                                    size_t b_tile, int kc, const int NA,
                                                                    const int NB, int32_t *cbuf, int acc,
                                                                    const tiles_steps *ring,
                                                                    const tiles_ahead *ahead,
                                                                    const tiles_steps *next) {
    if (acc) {
        TB_LOAD(0, cbuf, 128);
        if (NB == 2) TB_LOAD(1, cbuf + 16, 128);
        if (NA == 2) {
            TB_LOAD(2, cbuf + 16 * 32, 128);
            if (NB == 2) TB_LOAD(3, cbuf + 16 * 32 + 16, 128);
        }
    } else {
        TB_ZERO(0);
        TB_ZERO(1);
        TB_ZERO(2);
        TB_ZERO(3);
    }
    /* A's step i: 64 bytes on in rows a_stride apart (xq, the tail copy), or the next 1 KB of A packed in tile
     * order (tiles_pack_a: rows 64 bytes apart); the two agree where K = 64, the one step */
    const size_t a_step = a_stride == 64 ? 1024 : 64;
    if (ring)
        for (int i = 0; i < 2 && i < kc; i++) {
            int8_t *slot = (int8_t *)b + (size_t)i * TILES_RING_SLOT;
            ring->step(ring, i, slot, slot + b_tile);
        }
    for (int i = 0; i < kc; i++) {
        if (ahead) tiles_prefetch_step(ahead, i);
        if (next) next->step(next, i, next->dst[0] + (size_t)1024 * i, next->dst[1] + (size_t)1024 * i);
        const int8_t *bi = b + (size_t)1024 * i;
        if (ring) {
            bi = b + (size_t)(i & 3) * TILES_RING_SLOT;
            if (i + 2 < kc) {
                int8_t *slot = (int8_t *)b + (size_t)((i + 2) & 3) * TILES_RING_SLOT;
                ring->step(ring, i + 2, slot, slot + b_tile);
            }
        }
        TB_LOAD(4, a0 + a_step * i, a_stride);
        if (NA == 2) TB_LOAD(5, a1 + a_step * i, a_stride);
        TB_LOAD(6, bi, 64);
        if (NB == 2) TB_LOAD(7, bi + b_tile, 64);
        TB_DPBSSD(0, 4, 6);
        if (NB == 2) TB_DPBSSD(1, 4, 7);
        if (NA == 2) {
            TB_DPBSSD(2, 5, 6);
            if (NB == 2) TB_DPBSSD(3, 5, 7);
        }
    }
    TB_STORE(0, cbuf, 128);
    if (NB == 2) TB_STORE(1, cbuf + 16, 128);
    if (NA == 2) {
        TB_STORE(2, cbuf + 16 * 32, 128);
        if (NB == 2) TB_STORE(3, cbuf + 16 * 32 + 16, 128);
    }
}

/* tiles_block for na, nb (1 or 2) known only at run time: one of its four constant-folded forms */
static inline void TB_FN(tiles_block_any)(const int8_t *a0, const int8_t *a1, size_t a_stride, const int8_t *b,
                                          size_t b_tile, int kc, int na, int nb, int32_t *cbuf, int acc,
                                          const tiles_steps *ring, const tiles_ahead *ahead,
                                          const tiles_steps *next) {
    if (na == 2 && nb == 2) TB_FN(tiles_block)(a0, a1, a_stride, b, b_tile, kc, 2, 2, cbuf, acc, ring, ahead, next);
    else if (na == 2) TB_FN(tiles_block)(a0, a1, a_stride, b, b_tile, kc, 2, 1, cbuf, acc, ring, ahead, next);
    else if (nb == 2) TB_FN(tiles_block)(a0, a1, a_stride, b, b_tile, kc, 1, 2, cbuf, acc, ring, ahead, next);
    else TB_FN(tiles_block)(a0, a1, a_stride, b, b_tile, kc, 1, 1, cbuf, acc, ring, ahead, next);
}

/* One k-block [k0, k0 + 64 kc) of every activation row group (16 rows; the last, partial one from the
 * zero-padded tail copy) against NB weight tiles t, t+1 whose i8_tile16 codes of that block are at b (tile j at
 * b + j * b_tile). Each pair of row groups keeps its C block in cacc (4 KB each) between k-blocks: the first
 * block starts from zero, the last one runs the epilogue. ahead: the next weights of this k-block, prefetched
 * beside the first row-group pair; next (tile_overlap, one k-block): the next pair, unpacked beside it. */
static void TB_FN(tiles_panel)(const tiles_args *g, const int8_t *b, size_t b_tile, int nb, int t,
                               const int8_t *a_tail, int32_t *cacc, int k0, int kc, int first, int last,
                               const tiles_ahead *ahead, const tiles_steps *next) {
    const int full = g->m / 16, groups = (g->m + 15) / 16;
    const size_t stride = g->apack ? 64 : (size_t)g->k_pad, gstep = (size_t)g->k_pad * 16;
    for (int gr = 0; gr < groups; gr += 2) {
        const int na = groups - gr >= 2 ? 2 : 1;
        const int8_t *a0 = (gr < full ? g->xq + (size_t)gr * gstep : a_tail) + k0;
        const int8_t *a1 = (gr + 1 < full ? g->xq + (size_t)(gr + 1) * gstep : a_tail) + k0;
        if (g->apack) {   /* group gr's 64-k step k0 / 64 (tiles_pack_a) */
            a0 = g->apack + (size_t)gr * gstep + (size_t)k0 * 16;
            a1 = a0 + gstep;
        }
        int32_t *cbuf = cacc + (size_t)(gr / 2) * 32 * 32;
        TB_FN(tiles_block_any)(a0, a1, stride, b, b_tile, kc, na, nb, cbuf, !first, NULL, gr ? NULL : ahead,
                               gr ? NULL : next);
        if (last) tiles_finish(g, cbuf, gr * 16, na, nb, t);
    }
}

/* M <= 32 (one or two 16-row groups), streamed (bk_table.tile_stream): the weights ring names (a ternary pair
 * of nb tiles, t and t + 1; or one q4 tile, W_lo and W_hi as the pair), unpacked one 64-k step at a time into the
 * ring two steps before the tile loads that read it (tiles_block), with C in tmm0..3 over the whole of K, then
 * through cbuf (32 x 32 int32) to the epilogue, which the caller runs. */
static void TB_FN(tiles_stream)(const tiles_args *g, const tiles_steps *ring, int nb, const int8_t *a_tail,
                                int8_t *ring_buf, int32_t *cbuf, const tiles_ahead *ahead) {
    const int full = g->m / 16, na = (g->m + 15) / 16, kc = g->k_pad / 64;
    const size_t stride = g->apack ? 64 : (size_t)g->k_pad;
    const int8_t *a0 = g->apack ? g->apack : full >= 1 ? g->xq : a_tail;
    const int8_t *a1 = g->apack ? g->apack + (size_t)16 * g->k_pad : full >= 2 ? g->xq + 16 * stride : a_tail;
    TB_FN(tiles_block_any)(a0, a1, stride, ring_buf, 1024, kc, na, nb, cbuf, 0, ring, ahead, NULL);
}

/* Ternary tile16 weights, tiles [tile_begin, tile_end), a pair at a time, in k-blocks of kblk (tiles_kblock):
 * the pair's codes of one k-block are unpacked into the thread's i8_tile16 buffer (2 x 16 x kblk bytes) and
 * reused by every row group of A; the epilogue subtracts act_sum as the vector bodies do. With one k-block (the
 * default) that is the whole pair (80 KB at K = 2560, 216 KB at 6912); smaller blocks keep B in L1 and the
 * rows of A that one block reads in L2, at the price of a C load and store per block and row-group pair. */
static void TB_FN(gemm_ternary_tiles_a)(const uint8_t *w, const float *row_scale, const int8_t *xq, int m,
                                        int k_pad, const float *act_scale, const int32_t *act_sum, float *out,
                                        int32_t *out_i32, int n, int tile_begin, int tile_end, const int8_t *apack) {
    const int kblk = tiles_kblock(k_pad), stream = bk_table.tile_stream && m <= 32;
    const int overlap = bk_table.tile_overlap && !stream && kblk == k_pad;
    const size_t utile = (size_t)16 * k_pad, ublk = (size_t)16 * kblk, tile_bytes = (size_t)k_pad / 16 * 64;
    const size_t bbytes = stream ? TILES_RING_BYTES : (size_t)(overlap ? 4 : 2) * ublk; /* unpacked B (ring) */
    uint8_t *s = m >= bk_table.tile_min_rows ? tiles_scratch(utile + bbytes + tiles_cacc_bytes(m)) : NULL;
    if (!s) {
        bk_table.gemm_ternary_vector(w, row_scale, xq, m, k_pad, act_scale, act_sum, out, out_i32, n, tile_begin,
                               tile_end);
        return;
    }
    const tiles_args g = {xq, m, k_pad, act_scale, act_sum, row_scale, out, out_i32, n, apack};
    int8_t *a_tail = (int8_t *)s, *codes = (int8_t *)s + utile;
    int32_t *cacc = (int32_t *)(s + utile + bbytes);
    if (!apack) tiles_copy_tail(&g, a_tail);
    tiles_warm(w, tile_bytes, tile_begin, tile_end);
    tiles_count();
    TB_CONFIG(&tiles_cfg_full);
    if (stream) {
        for (int t = tile_begin; t < tile_end; t += 2) {
            const int nb = tile_end - t >= 2 ? 2 : 1;
            tiles_ahead ah;
            const tiles_ahead *next = tiles_next_pair(&ah, w, tile_bytes, t, tile_end, 256, 0);
            const uint8_t *c = w + (size_t)t * tile_bytes;
            const tiles_steps ring = {tiles_ternary_step, tiles_unpacker(), {c, c + (size_t)(nb - 1) * tile_bytes},
                                      {NULL, NULL}, nb};
            TB_FN(tiles_stream)(&g, &ring, nb, a_tail, codes, cacc, next);
            tiles_finish(&g, cacc, 0, (m + 15) / 16, nb, t);
        }
        TB_RELEASE();
        return;
    }
    if (overlap) {
        /* pair t's codes in cur, the next pair's unpacked into nxt beside its first row-group pair; the warm and
         * the prefetch run one pair further ahead, since the next pair's codes are read by that unpack */
        int8_t *cur = codes, *nxt = codes + 2 * ublk;
        tiles_warm(w, tile_bytes, tile_begin + 2, tile_end);
        for (int j = 0; j < 2 && tile_begin + j < tile_end; j++)
            tiles_unpack(w + (size_t)(tile_begin + j) * tile_bytes, k_pad / 16, cur + j * ublk);
        for (int t = tile_begin; t < tile_end; t += 2) {
            const int nb = tile_end - t >= 2 ? 2 : 1;
            const int nb_next = tile_end - (t + 2) >= 2 ? 2 : tile_end - (t + 2) == 1;
            const uint8_t *c2 = w + (size_t)(t + 2) * tile_bytes;   /* read only when nb_next > 0 */
            const tiles_steps un = {tiles_ternary_step, tiles_unpacker(), {c2, nb_next == 2 ? c2 + tile_bytes : c2},
                                    {nxt, nxt + ublk}, nb_next};
            tiles_ahead ah;
            const tiles_ahead *ahead = tiles_next_pair(&ah, w, tile_bytes, t + 2, tile_end, 256, 0);
            TB_FN(tiles_panel)(&g, cur, ublk, nb, t, a_tail, cacc, 0, k_pad / 64, 1, 1, ahead, nb_next ? &un : NULL);
            int8_t *swap = cur;
            cur = nxt;
            nxt = swap;
        }
        TB_RELEASE();
        return;
    }
    for (int t = tile_begin; t < tile_end; t += 2) {
        const int nb = tile_end - t >= 2 ? 2 : 1;
        for (int k0 = 0; k0 < k_pad; k0 += kblk) {
            const int kn = k_pad - k0 < kblk ? k_pad - k0 : kblk;
            tiles_ahead ah;   /* the next pair's codes of this k-block (256 bytes a 64-k step) */
            const tiles_ahead *next = tiles_next_pair(&ah, w, tile_bytes, t, tile_end, 256,
                                                      (size_t)k0 / 16 * 64);
            for (int j = 0; j < nb; j++)
                tiles_unpack(w + (size_t)(t + j) * tile_bytes + (size_t)k0 / 16 * 64, kn / 16, codes + j * ublk);
            TB_FN(tiles_panel)(&g, codes, ublk, nb, t, a_tail, cacc, k0, kn / 64, k0 == 0, k0 + kn == k_pad, next,
                               NULL);
        }
    }
    TB_RELEASE();
}

/* the body of bk_table.gemm_ternary (A read from xq): the b3 GEMM calls it four tiles at a time */
static void TB_FN(gemm_ternary_tiles)(const uint8_t *w, const float *row_scale, const int8_t *xq, int m,
                                      int k_pad, const float *act_scale, const int32_t *act_sum, float *out,
                                      int32_t *out_i32, int n, int tile_begin, int tile_end) {
    TB_FN(gemm_ternary_tiles_a)(w, row_scale, xq, m, k_pad, act_scale, act_sum, out, out_i32, n, tile_begin,
                                tile_end, NULL);
}

/* int8 head (i8_tile16 is B tiles as stored, 1 KB per 64-k step): tiles [tile_begin, tile_end) straight from the
 * weights, in the same k-blocks. 0 when the thread's scratch could not be had (the caller then runs the vector
 * body). */
static int TB_FN(gemm_i8_tiles)(const tiles_args *g, const int8_t *w, int tile_begin, int tile_end) {
    const int kblk = tiles_kblock(g->k_pad);
    const size_t utile = (size_t)16 * g->k_pad;
    uint8_t *s = tiles_scratch(utile + tiles_cacc_bytes(g->m));
    if (!s) return 0;
    int8_t *a_tail = (int8_t *)s;
    int32_t *cacc = (int32_t *)(s + utile);
    tiles_copy_tail(g, a_tail);
    tiles_warm((const uint8_t *)w, utile, tile_begin, tile_end);
    tiles_count();
    TB_CONFIG(&tiles_cfg_full);
    for (int t = tile_begin; t < tile_end; t += 2) {
        const int nb = tile_end - t >= 2 ? 2 : 1;
        for (int k0 = 0; k0 < g->k_pad; k0 += kblk) {
            const int kn = g->k_pad - k0 < kblk ? g->k_pad - k0 : kblk;
            tiles_ahead ah;   /* the next pair's int8 rows of this k-block: the B tiles as stored, 1 KB a step */
            const tiles_ahead *next = tiles_next_pair(&ah, (const uint8_t *)w, utile, t, tile_end, 1024,
                                                      (size_t)k0 / 64 * 1024);
            TB_FN(tiles_panel)(g, w + (size_t)t * utile + (size_t)k0 / 64 * 1024, utile, nb, t, a_tail, cacc, k0,
                               kn / 64, k0 == 0, k0 + kn == g->k_pad, next, NULL);
        }
    }
    TB_RELEASE();
    return 1;
}
