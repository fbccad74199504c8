"""The NEON bodies, cross-compiled for aarch64 and run under qemu-user: each must give the same bytes as the
scalar reference body on random data (tails included), and the dispatcher must pick "i8mm" there (qemu's
default CPU, max, has sdot and smmla) with dotprod's bodies for every job but the GEMM. Kernels with a per-ISA
body table are compared body by body; the jobs that choose their body inside (the q4 head, the multi-row GEMVs,
top-k, rescoring, the embedding lookup) are run whole on each path (bk_set_isa: scalar, neon, dotprod, i8mm) and
compared. The norms, gates, RoPE and the f16 cache write: test_ops_paths_c.py (x86 and aarch64).

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user); skips with
that reason when they are missing. On an aarch64 host the regular test_kernels.py covers NEON natively.
"""
from cross_c import needs_aarch64, run_harness

pytestmark = needs_aarch64

HARNESS = r"""
#include "q4g.h"
#include "rows.h"
#include "tg.h"
#include "b3.h"

static const int PATHS[3] = {BK_ISA_NEON, BK_ISA_DOTPROD, BK_ISA_I8MM}; /* i8mm: smmla GEMM, else dotprod's */

/* the q4 head and the multi-row GEMVs: whole jobs on each path against the scalar path */
static void check_heads(int n, int k_pad, int m, const int8_t *xq, const float *act_scale, const int32_t *act_sum,
                        const uint8_t *wt, const int8_t *wi, const int32_t *rowsum, const float *row_scale) {
    int n_pad = (n + 15) / 16 * 16, groups = k_pad / 32;
    uint8_t *codes = malloc((size_t)n_pad * k_pad / 2), *gs = malloc((size_t)n_pad * groups);
    for (size_t i = 0; i < (size_t)n_pad * k_pad / 2; i++) codes[i] = (uint8_t)rnd();
    for (size_t i = 0; i < (size_t)n_pad * groups; i++) gs[i] = (uint8_t)(rnd() % 64);
    float *ref = malloc(4 * (size_t)m * n), *got = malloc(4 * (size_t)m * n);
    int32_t *refi = malloc(4 * (size_t)m * n), *goti = malloc(4 * (size_t)m * n);
    int mr = m < BK_ROWS_MAX ? m : BK_ROWS_MAX;
    for (int p = 0; p < 3; p++) {
        if (k_pad <= BK_Q4G_MAX_K) {
            bk_set_isa(BK_ISA_SCALAR);
            bk_gemv_q4g(codes, gs, row_scale, xq, mr, k_pad, act_scale, ref, NULL, n);
            bk_gemv_q4g(codes, gs, row_scale, xq, mr, k_pad, act_scale, NULL, refi, n);
            bk_set_isa(PATHS[p]);
            bk_gemv_q4g(codes, gs, row_scale, xq, mr, k_pad, act_scale, got, NULL, n);
            bk_gemv_q4g(codes, gs, row_scale, xq, mr, k_pad, act_scale, NULL, goti, n);
            CHECK(!memcmp(ref, got, 4 * (size_t)mr * n) && !memcmp(refi, goti, 4 * (size_t)mr * n),
                  "gemv_q4g path %d n %d k %d m %d", PATHS[p], n, k_pad, mr);
        }
        bk_set_isa(BK_ISA_SCALAR);
        bk_gemv_rows_ternary(wt, row_scale, xq, mr, k_pad, act_scale, act_sum, ref, n);
        bk_set_isa(PATHS[p]);
        bk_gemv_rows_ternary(wt, row_scale, xq, mr, k_pad, act_scale, act_sum, got, n);
        CHECK(!memcmp(ref, got, 4 * (size_t)mr * n), "gemv_rows_ternary path %d n %d k %d m %d", PATHS[p], n, k_pad, mr);
        bk_set_isa(BK_ISA_SCALAR);
        bk_gemv_rows_i8(wi, row_scale, rowsum, xq, mr, k_pad, act_scale, ref, n);
        bk_set_isa(PATHS[p]);
        bk_gemv_rows_i8(wi, row_scale, rowsum, xq, mr, k_pad, act_scale, got, n);
        CHECK(!memcmp(ref, got, 4 * (size_t)mr * n), "gemv_rows_i8 path %d n %d k %d m %d", PATHS[p], n, k_pad, mr);
    }
    bk_set_isa(-1);
    free(codes), free(gs), free(ref), free(got), free(refi), free(goti);
}

/* top-k over logits (NaNs included) and the exact f16 rescoring of the q4 head's candidates: same heaps, same
 * indices, same floats on every path */
static void check_select(int vocab, int d, int m, int k) {
    float *lg0 = malloc(4 * (size_t)m * vocab), *x = malloc(4 * (size_t)m * d);
    uint16_t *table = malloc(2 * (size_t)vocab * d);
    for (size_t i = 0; i < (size_t)m * vocab; i++) lg0[i] = ((int)(rnd() % 200001) - 100000) / 3333.0f;
    for (size_t i = 0; i < (size_t)m * vocab; i += 97) lg0[i] = NAN;
    for (size_t i = 0; i < (size_t)m * d; i++) x[i] = ((int)(rnd() % 20001) - 10000) / 999.0f;
    for (size_t i = 0; i < (size_t)vocab * d; i++) table[i] = (uint16_t)((rnd() % 0x7800) | ((rnd() & 1) << 15));
    const int paths[3] = {BK_ISA_SCALAR, BK_ISA_NEON, BK_ISA_DOTPROD};
    float *lg[3], *hv[3], tv[3][64]; int32_t *id[3], ti[3][64], got[3];
    for (int v = 0; v < 3; v++) {
        lg[v] = malloc(4 * (size_t)m * vocab), hv[v] = malloc(4 * (size_t)m * k), id[v] = malloc(4 * (size_t)m * k);
        bk_set_isa(paths[v]);
        got[v] = ops_topk(lg0, vocab, k, tv[v], ti[v]);
        CHECK(v == 0 || (got[v] == got[0] && !memcmp(ti[0], ti[v], 4 * (size_t)got[0]) && !memcmp(tv[0], tv[v], 4 * (size_t)got[0])),
              "topk path %d vocab %d k %d", paths[v], vocab, k);
        memcpy(lg[v], lg0, 4 * (size_t)m * vocab);
        ops_head_rescore(table, d, x, m, lg[v], vocab, k, hv[v], id[v]);
    }
    for (int v = 1; v < 3; v++)
        CHECK(!memcmp(lg[0], lg[v], 4 * (size_t)m * vocab) && !memcmp(id[0], id[v], 4 * (size_t)m * k),
              "head_rescore path %d vocab %d d %d m %d k %d", paths[v], vocab, d, m, k);
    /* the f16 embedding lookup (the same table; subnormal halves included) */
    int32_t ids[3] = {vocab - 1, 0, vocab / 2};
    table[1] = 0x0001, table[2] = 0x83ff; /* row 0: the smallest subnormal, a negative one */
    float *emb[3];
    for (int v = 0; v < 3; v++) {
        emb[v] = malloc(4 * 3 * (size_t)d);
        bk_set_isa(paths[v]);
        CHECK(ops_embed_f16(table, vocab, d, ids, 3, emb[v]) == -1, "embed_f16 rejected good ids");
    }
    for (int v = 1; v < 3; v++) CHECK(!memcmp(emb[0], emb[v], 4 * 3 * (size_t)d), "embed_f16 path %d d %d", paths[v], d);
    for (int v = 0; v < 3; v++) free(emb[v]);
    bk_set_isa(-1);
    for (int v = 0; v < 3; v++) free(lg[v]), free(hv[v]), free(id[v]);
    free(lg0), free(x), free(table);
}

/* the group-scaled (tg128) path: its per-group activation quantization and its GEMV, whole, on every path */
static void check_tg(int n, int k, int m) {
    int k_pad = (k + 127) / 128 * 128, groups = k_pad / 128, tiles = (n + 15) / 16;
    float *x = malloc(4 * (size_t)m * k);
    for (size_t i = 0; i < (size_t)m * k; i++) x[i] = ((int)(rnd() % 20001) - 10000) / 1357.0f;
    for (int c = 0; c < 128 && c < k; c++) x[c] = 0.0f; /* an all-zero group: xd = 0, xq = 0 */
    x[(size_t)(m - 1) * k + k / 2] = NAN; /* a NaN: never the group's amax, -127 on every path (vcvtnq made it 0) */
    uint8_t *w = malloc((size_t)tiles * groups * BK_TG_GROUP_BYTES);
    for (size_t i = 0; i < (size_t)tiles * groups * BK_TG_GROUP_BYTES; i++) w[i] = (uint8_t)rnd();
    for (size_t g = 0; g < (size_t)tiles * groups; g++) /* the 16 scales of each group: finite halves */
        for (int r = 0; r < 16; r++) {
            uint16_t h = (uint16_t)((rnd() % 0x7800) | ((rnd() & 1) << 15));
            w[g * BK_TG_GROUP_BYTES + 2 * r] = (uint8_t)h, w[g * BK_TG_GROUP_BYTES + 2 * r + 1] = (uint8_t)(h >> 8);
        }
    const int paths[3] = {BK_ISA_SCALAR, BK_ISA_NEON, BK_ISA_DOTPROD};
    int8_t *q[3]; float *xd[3], *o[3]; int32_t *xs[3];
    for (int v = 0; v < 3; v++) {
        q[v] = malloc((size_t)m * k_pad), xd[v] = malloc(4 * (size_t)m * groups), xs[v] = malloc(4 * (size_t)m * groups);
        o[v] = malloc(4 * (size_t)m * n);
        bk_set_isa(paths[v]);
        bk_quantize_act_g128(x, m, k, k, k_pad, q[v], xd[v], xs[v]);
        bk_gemv_tg(w, q[0], xd[0], xs[0], m, k_pad, o[v], n); /* the scalar path's activations: GEMV alone */
    }
    for (int v = 1; v < 3; v++) {
        CHECK(!memcmp(q[0], q[v], (size_t)m * k_pad) && !memcmp(xd[0], xd[v], 4 * (size_t)m * groups) &&
              !memcmp(xs[0], xs[v], 4 * (size_t)m * groups), "quantize_act_g128 path %d k %d m %d", paths[v], k, m);
        CHECK(!memcmp(o[0], o[v], 4 * (size_t)m * n), "gemv_tg path %d n %d k %d m %d", paths[v], n, k, m);
    }
    bk_set_isa(-1);
    for (int v = 0; v < 3; v++) free(q[v]), free(xd[v]), free(xs[v]), free(o[v]);
    free(x), free(w);
}

/* base-3 weights: decoded on each path (NEON decoder) and run through that path's tile16 bodies, whole */
static void check_b3(int n, int k_pad, int m, const int8_t *xq, const float *act_scale, const int32_t *act_sum,
                     const float *row_scale) {
    int tiles = (n + 15) / 16;
    size_t tb = bk_b3_tile_bytes(k_pad), bytes = (size_t)tiles * tb;
    uint8_t *w = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)rnd(); /* every byte decodes by the same rule */
    const int paths[3] = {BK_ISA_SCALAR, BK_ISA_NEON, BK_ISA_DOTPROD};
    uint8_t *dec[3]; float *o[3], *g[3]; int32_t *oi[3];
    for (int v = 0; v < 3; v++) {
        dec[v] = malloc((size_t)tiles * k_pad * 4), o[v] = malloc(4 * (size_t)n), oi[v] = malloc(4 * (size_t)n);
        g[v] = malloc(4 * (size_t)m * n);
        bk_set_isa(paths[v]);
        bk_b3_to_tile16(w, n, k_pad, dec[v]);
        bk_gemv_b3(w, row_scale, xq, k_pad, act_scale[0], act_sum[0], o[v], NULL, n);
        bk_gemv_b3(w, row_scale, xq, k_pad, act_scale[0], act_sum[0], NULL, oi[v], n);
        bk_gemm_b3(w, row_scale, xq, m, k_pad, act_scale, act_sum, g[v], NULL, n);
    }
    for (int v = 1; v < 3; v++) {
        CHECK(!memcmp(dec[0], dec[v], (size_t)tiles * k_pad / 4), "b3 decode path %d n %d k %d", paths[v], n, k_pad);
        CHECK(!memcmp(o[0], o[v], 4 * (size_t)n) && !memcmp(oi[0], oi[v], 4 * (size_t)n), "gemv_b3 path %d n %d k %d", paths[v], n, k_pad);
        CHECK(!memcmp(g[0], g[v], 4 * (size_t)m * n), "gemm_b3 path %d n %d k %d m %d", paths[v], n, k_pad, m);
    }
    bk_set_isa(-1);
    for (int v = 0; v < 3; v++) free(dec[v]), free(o[v]), free(oi[v]), free(g[v]);
    free(w);
}

int main(void) {
    bk_init();
    printf("active %d dotprod %d i8mm %d\n", bk_get_isa(), bk_get_features()->dotprod, bk_get_features()->i8mm);
    CHECK(bk_get_isa() == BK_ISA_I8MM, "dispatcher did not pick i8mm"); /* qemu's default CPU (max) has it */
    /* i8mm has its own GEMM body; every other job takes dotprod's (the next path down), never scalar */
    CHECK(bk_table.gemm_ternary == bk_gemm_ternary_bodies[BK_ISA_I8MM] && bk_table.gemv_ternary == bk_gemv_ternary_bodies[BK_ISA_DOTPROD] &&
          bk_table.gemv_i8 == bk_gemv_i8_bodies[BK_ISA_DOTPROD] && bk_table.quantize_act == bk_quantize_bodies[BK_ISA_NEON] && ops_neon(),
          "i8mm path's table");
    CHECK(bk_set_isa(BK_ISA_DOTPROD) == 0 && bk_table.gemm_ternary == bk_gemm_ternary_bodies[BK_ISA_DOTPROD], "dotprod selectable");
    CHECK(bk_isa_supported(BK_ISA_NEON) && bk_set_isa(BK_ISA_NEON) == 0 && bk_get_isa() == BK_ISA_NEON, "neon not selectable");
    bk_set_isa(-1);
    check_tg(16, 128, 1);
    check_tg(37, 300, 3);
    check_tg(250, 2560, 2);
    check_select(1000, 64, 1, 40);
    check_select(3001, 37, 3, 13);
    check_select(50, 130, 2, 64); /* k > vocab: every non-NaN logit */
    static const int shapes[][3] = {{16, 64, 1}, {37, 100, 3}, {100, 3200, 5}, {250, 68, 2}, {640, 2560, 9}, {17, 8640, 2}};
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int n = shapes[s][0], k = shapes[s][1], m = shapes[s][2];
        int n_pad = (n + 15) / 16 * 16, k_pad = (k + 63) / 64 * 64, tiles = n_pad / 16;
        float *x = malloc(sizeof(float) * m * k);
        for (int i = 0; i < m * k; i++) x[i] = ((int)(rnd() % 20001) - 10000) / 997.0f;
        x[0] = 2.5f * 127.0f / 127.0f;
        x[(size_t)(m - 1) * k + k / 3] = NAN; /* never the scale (vmaxq kept it), -128 (vcvtnq made it 0) */
        int8_t *xq[2]; float sc[2][16]; int32_t sm[2][16];
        for (int v = 0; v < 2; v++) {
            xq[v] = malloc((size_t)m * k_pad);
            for (int r = 0; r < m; r++)
                bk_quantize_bodies[v ? BK_ISA_NEON : BK_ISA_SCALAR](x + (size_t)r * k, k, k_pad, xq[v] + (size_t)r * k_pad, &sc[v][r], &sm[v][r]);
        }
        CHECK(!memcmp(xq[0], xq[1], (size_t)m * k_pad) && !memcmp(sc[0], sc[1], 4 * m) && !memcmp(sm[0], sm[1], 4 * m), "quantize %d %d", n, k);
        uint8_t *wt = malloc((size_t)n_pad * k_pad / 4);
        for (size_t i = 0; i < (size_t)n_pad * k_pad / 4; i++) { unsigned b = 0; for (int j = 0; j < 4; j++) b |= (rnd() % 3) << (2 * j); wt[i] = (uint8_t)b; }
        if (s == 5) /* the plain body's int16 lanes at their bound: codes 2, activations -128 */
            for (int r = 0; r < m; r++) { memset(xq[0] + (size_t)r * k_pad, 0x80, k_pad); memset(xq[1] + (size_t)r * k_pad, 0x80, k_pad); memset(wt, 0xaa, (size_t)n_pad * k_pad / 4); }
        int8_t *wi = malloc((size_t)n_pad * k_pad);
        int32_t *rowsum = calloc(n_pad, 4);
        for (size_t i = 0; i < (size_t)n_pad * k_pad; i++) wi[i] = (int8_t)((int)(rnd() % 255) - 127);
        uint16_t *wh = malloc(2 * (size_t)n_pad * k);
        for (size_t i = 0; i < (size_t)n_pad * k; i++) wh[i] = (uint16_t)((rnd() % 0x7800) | ((rnd() & 1) << 15)); /* finite halves */
        float *row_scale = malloc(4 * n_pad);
        for (int i = 0; i < n_pad; i++) row_scale[i] = 0.5f + (rnd() % 1000) / 1000.0f;
        float *o[2]; int32_t *oi[2];
        uint8_t *aux = malloc(2 * (size_t)k_pad);
        for (int i = 0; i < k_pad; i++) { aux[i] = (uint8_t)(xq[0][i] ^ 0x80); aux[k_pad + i] = (uint8_t)(xq[0][i] < 0 ? -xq[0][i] : xq[0][i]); }
        for (int v = 0; v < 2; v++) { o[v] = malloc(4 * (size_t)m * n); oi[v] = malloc(4 * (size_t)m * n); }
        for (int p = 0; p < 2; p++) { /* the plain-NEON and the sdot bodies */
            for (int v = 0; v < 2; v++) {
                int isa = v ? PATHS[p] : BK_ISA_SCALAR;
                bk_gemv_ternary_bodies[isa](wt, row_scale, xq[0], k_pad, sc[0][0], sm[0][0], o[v], NULL, n, 0, tiles);
                bk_gemv_ternary_bodies[isa](wt, row_scale, xq[0], k_pad, sc[0][0], sm[0][0], NULL, oi[v], n, 0, tiles);
            }
            CHECK(!memcmp(o[0], o[1], 4 * n) && !memcmp(oi[0], oi[1], 4 * n), "gemv_ternary path %d %d %d", PATHS[p], n, k);
            for (int v = 0; v < 2; v++)
                bk_gemm_ternary_bodies[v ? PATHS[p] : BK_ISA_SCALAR](wt, row_scale, xq[0], m, k_pad, sc[0], sm[0], o[v], NULL, n, 0, tiles);
            CHECK(!memcmp(o[0], o[1], 4 * (size_t)m * n), "gemm_ternary path %d %d %d %d", PATHS[p], n, k, m);
        }
        for (int mm = 1; mm <= m; mm++) /* the smmla body: tokens in fours, a pair, an odd last one (sdot) */
            for (int raw = 0; raw < 2; raw++) {
                for (int v = 0; v < 2; v++)
                    bk_gemm_ternary_bodies[v ? BK_ISA_I8MM : BK_ISA_SCALAR](wt, row_scale, xq[0], mm, k_pad, sc[0], sm[0], raw ? NULL : o[v],
                                                                            raw ? oi[v] : NULL, n, 0, tiles);
                CHECK(raw ? !memcmp(oi[0], oi[1], 4 * (size_t)mm * n) : !memcmp(o[0], o[1], 4 * (size_t)mm * n),
                      "gemm_ternary i8mm %d %d %d raw %d", n, k, mm, raw);
            }
        for (int p = 0; p < 2; p++) { /* smull/smlal (int16 pair sums at their bound when xq = -128, W = -127) and sdot */
            if (s == 5) memset(wi, 0x81, (size_t)n_pad * k_pad);
            for (int v = 0; v < 2; v++)
                bk_gemv_i8_bodies[v ? PATHS[p] : BK_ISA_SCALAR](wi, row_scale, rowsum, xq[0], aux, k_pad, sc[0][0], o[v], NULL, n, 0, tiles);
            CHECK(!memcmp(o[0], o[1], 4 * n), "gemv_i8 path %d %d %d", PATHS[p], n, k);
        }
        for (int v = 0; v < 2; v++)
            bk_gemv_f16_bodies[v ? BK_ISA_NEON : BK_ISA_SCALAR](wh, x, k, o[v], n, 0, tiles);
        CHECK(!memcmp(o[0], o[1], 4 * n), "gemv_f16 %d %d", n, k);
        /* the threaded drivers on the neon path */
        bk_set_num_threads(2);
        bk_gemm_ternary(wt, row_scale, xq[0], m, k_pad, sc[0], sm[0], o[1], NULL, n);
        bk_gemm_ternary_bodies[BK_ISA_SCALAR](wt, row_scale, xq[0], m, k_pad, sc[0], sm[0], o[0], NULL, n, 0, tiles);
        CHECK(!memcmp(o[0], o[1], 4 * (size_t)m * n), "threaded gemm %d %d %d", n, k, m);
        check_heads(n, k_pad, m, xq[0], sc[0], sm[0], wt, wi, rowsum, row_scale);
        check_b3(n, k_pad, m, xq[0], sc[0], sm[0], row_scale);
    }
    return REPORT();
}
"""


def test_neon_bodies_match_scalar_under_qemu(tmp_path):
    run_harness(tmp_path, HARNESS, name="neon_harness")
