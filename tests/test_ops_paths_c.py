"""The norms and gates (norm.c: RMSNorm with the residual add and the quantization, per-head RMSNorm, relu^2 and
SiLU), RoPE and the f16 KV-cache write (rope_kv.c) on every path against the scalar body, byte for byte: one C
harness, built for this machine (the AVX2 / AVX-512 paths it has) and for aarch64 under qemu-user (neon, dotprod,
i8mm). RoPE and the cache write are called directly: their vector bodies must be exact in their own right,
whatever calls them.

Inputs reach the edges each body handles apart: sizes below, at and past a vector's width (the scalar tails),
NaN gates and keys (with payloads the vector conversions would keep), infinities, the f16 overflow threshold,
f16 subnormals and their rounding ties, gates far past exp's range (|g| > 88). The key's column must leave the
other 31 positions of its block untouched. Under qemu the NEON exp (the SiLU gate's and softmax's) is also compared
with the scalar exp_poly directly, on every 509th float of its range and past it.
"""
from cross_c import needs_aarch64, needs_host_cc, run_harness

HARNESS = r"""
static float frnd(float range) { return ((int)(rnd() % 200001) - 100000) / 100000.0f * range; }
static float bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* values the bodies treat apart; a NaN never meets another NaN in one operation (which payload survives would
 * then depend on operand order, which C does not fix for a commutative `*` or `+`) */
static const uint32_t EDGES[] = {
    0x7fc00000u, 0xffffffffu, 0x7f800001u, 0x7fbfffffu, /* NaNs: quiet, payloads, signalling */
    0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u, /* +-inf, +-0 */
    0x477fe000u, 0x477fefffu, 0x477ff000u, 0xc77ff000u, /* 65504, just below / at f16's overflow to inf */
    0x33800000u, 0x33000000u, 0x33400000u, 0xb3c00000u, /* f16 subnormals: the smallest, a tie to 0, 0.75 of it, a tie to -2 */
    0x387fc000u, 0x38800000u, 0x00000001u, 0x807fffffu, /* the largest f16 subnormal, the smallest normal, f32 subnormals */
    0x42b20000u, 0xc2b20000u, 0x42c80000u, 0xc2c80000u, /* +-89, +-100: exp's argument past its range */
    0x7f7fffffu, 0xff7fffffu, 0x3f800000u, 0xbf800000u, /* +-FLT_MAX, +-1 */
};
enum { N_EDGES = sizeof EDGES / sizeof EDGES[0] };

static int n_paths;
static int paths[8];

/* the norms and the relu^2 gate of simd/ops (fused with quantization): every output array compared */
static void check_norms(int m, int d) {
    int k_pad = (d + 63) / 64 * 64, rows = m / 2 > 0 ? m / 2 : 1;
    size_t md = (size_t)m * d, gd = (size_t)rows * 2 * d;
    float *x0 = malloc(4 * md), *g0 = malloc(4 * gd), *delta = malloc(4 * md), *w = malloc(4 * (size_t)d);
    for (size_t i = 0; i < md; i++) x0[i] = ((int)(rnd() % 20001) - 10000) / 1234.0f;
    for (size_t i = 0; i < gd; i++) g0[i] = ((int)(rnd() % 20001) - 10000) / 2345.0f;
    for (size_t i = 0; i < md; i++) delta[i] = ((int)(rnd() % 2001) - 1000) / 777.0f;
    for (int i = 0; i < d; i++) w[i] = 0.25f + (rnd() % 1000) / 500.0f;
    g0[1] = NAN; /* relu^2 of a NaN gate is 0 on every path (`g > 0 ? g : 0`) */
    float *x[8], *h[8], *gu[8], sc[8][32]; int8_t *q[8], *qg[8]; int32_t sm[8][32];
    for (int v = 0; v < n_paths; v++) {
        x[v] = malloc(4 * md), h[v] = malloc(4 * md * 2), gu[v] = malloc(4 * gd);
        q[v] = malloc((size_t)m * k_pad), qg[v] = malloc((size_t)rows * k_pad);
        bk_set_isa(paths[v]);
        memcpy(x[v], x0, 4 * md);
        memcpy(gu[v], g0, 4 * gd);
        ops_add_rmsnorm_quant(x[v], delta, w, m, d, 1e-5f, h[v], q[v], k_pad, sc[v], sm[v]);
        x[v][1] = NAN; /* a NaN must not change amax, nor the other lanes (the scalar `a > amax` skips it) */
        ops_add_rmsnorm(x[v], delta, w, m, d, 1e-6f, h[v] + md);
        ops_head_rmsnorm(x[v], m, d, 0, d / 8, 8, w, 1e-6f);
        ops_glu_rmsnorm_quant(gu[v], rows, d, OPS_ACT_RELU2, w, 1e-5f, qg[v], k_pad, sc[v] + 16, sm[v] + 16);
    }
    for (int v = 1; v < n_paths; v++) {
        CHECK(!memcmp(x[0], x[v], 4 * md) && !memcmp(h[0], h[v], 4 * md * 2), "norms (x, h) path %d m %d d %d", paths[v], m, d);
        CHECK(!memcmp(q[0], q[v], (size_t)m * k_pad) && !memcmp(sc[0], sc[v], 4 * m) && !memcmp(sm[0], sm[v], 4 * m),
              "norm quantization path %d m %d d %d", paths[v], m, d);
        CHECK(!memcmp(gu[0], gu[v], 4 * gd) && !memcmp(qg[0], qg[v], (size_t)rows * k_pad) &&
              !memcmp(sc[0] + 16, sc[v] + 16, 4 * rows) && !memcmp(sm[0] + 16, sm[v] + 16, 4 * rows),
              "glu_rmsnorm_quant path %d m %d d %d", paths[v], m, d);
    }
    bk_set_isa(-1);
    for (int v = 0; v < n_paths; v++) free(x[v]), free(h[v]), free(gu[v]), free(q[v]), free(qg[v]);
    free(x0), free(g0), free(delta), free(w);
}


/* the rows of a norm split over the pool (run_rows: from 14 rows of 2,560 on 16 threads, 26 on 2) give the bytes
 * the caller alone gives; the machine's own vector path */
static void check_norm_threads(int m, int d) {
    const int k_pad = (d + 63) / 64 * 64, nts[] = {1, 2, 16};
    const size_t md = (size_t)m * d;
    float *x0 = malloc(4 * md), *delta = malloc(4 * md), *w = malloc(4 * (size_t)d), *x[3], *h[3], sc[3][64];
    int8_t *q[3];
    int32_t sm[3][64];
    for (size_t i = 0; i < md; i++) x0[i] = frnd(9.0f), delta[i] = frnd(1.5f);
    for (int i = 0; i < d; i++) w[i] = 0.25f + (rnd() % 1000) / 500.0f;
    for (int t = 0; t < 3; t++) {
        x[t] = malloc(4 * md), h[t] = malloc(4 * md), q[t] = malloc((size_t)m * k_pad);
        memcpy(x[t], x0, 4 * md);
        bk_set_num_threads(nts[t]);
        ops_add_rmsnorm_quant(x[t], delta, w, m, d, 1e-5f, h[t], q[t], k_pad, sc[t], sm[t]);
        ops_add_rmsnorm(x[t], delta, w, m, d, 1e-6f, h[t]);
        CHECK(t == 0 || (!memcmp(x[0], x[t], 4 * md) && !memcmp(h[0], h[t], 4 * md) &&
                         !memcmp(q[0], q[t], (size_t)m * k_pad) && !memcmp(sc[0], sc[t], 4 * (size_t)m) &&
                         !memcmp(sm[0], sm[t], 4 * (size_t)m)),
              "norms on %d threads differ from one, m %d d %d", nts[t], m, d);
    }
    bk_set_num_threads(0);
    for (int t = 0; t < 3; t++) free(x[t]), free(h[t]), free(q[t]);
    free(x0), free(delta), free(w);
}

/* silu(g) * u: the gate alone (no norm, no quantization), then fused with the norm and the quantization */
static void check_silu(int m, int inter, int edges) {
    const size_t n = (size_t)m * 2 * inter;
    float *g0 = malloc(4 * n), *g[8], *w = malloc(4 * (size_t)inter);
    for (size_t i = 0; i < n; i++) g0[i] = frnd(i % 7 ? 8.0f : 120.0f);
    for (int i = 0; i < inter; i++) w[i] = 0.25f + (rnd() % 1000) / 500.0f;
    if (edges) /* in the gate half of row 0; the up half stays finite */
        for (int i = 0; i < inter && i < N_EDGES; i++) g0[i] = bits(EDGES[i]);
    const int k_pad = (inter + 63) / 64 * 64;
    int8_t *q[8];
    float sc[8][8];
    int32_t sm[8][8];
    for (int v = 0; v < n_paths; v++) {
        g[v] = malloc(4 * n), q[v] = malloc((size_t)m * k_pad);
        bk_set_isa(paths[v]);
        memcpy(g[v], g0, 4 * n);
        ops_glu_rmsnorm_quant(g[v], m, inter, OPS_ACT_SILU, NULL, 1e-5f, NULL, k_pad, NULL, NULL);
        CHECK(v == 0 || !memcmp(g[0], g[v], 4 * n), "silu gate path %d m %d inter %d edges %d", paths[v], m, inter, edges);
    }
    if (!edges) /* the fused job, on finite rows (a NaN or inf row gives NaN scales: nothing more to compare) */
        for (int v = 0; v < n_paths; v++) {
            bk_set_isa(paths[v]);
            memcpy(g[v], g0, 4 * n);
            ops_glu_rmsnorm_quant(g[v], m, inter, OPS_ACT_SILU, w, 1e-5f, q[v], k_pad, sc[v], sm[v]);
            CHECK(v == 0 || (!memcmp(g[0], g[v], 4 * n) && !memcmp(q[0], q[v], (size_t)m * k_pad) &&
                             !memcmp(sc[0], sc[v], 4 * (size_t)m) && !memcmp(sm[0], sm[v], 4 * (size_t)m)),
                  "silu glu_rmsnorm_quant path %d m %d inter %d", paths[v], m, inter);
        }
    for (int v = 0; v < n_paths; v++) free(g[v]), free(q[v]);
    free(g0), free(w);
}

/* RoPE of n_heads heads at one position; a NaN and an infinity meet finite partners only */
static void check_rope(int n_heads, int hd) {
    const int half = hd / 2, n = n_heads * hd;
    float *x0 = malloc(4 * (size_t)n), *x[8], *cs = malloc(4 * (size_t)half), *sn = malloc(4 * (size_t)half);
    for (int i = 0; i < n; i++) x0[i] = frnd(30.0f);
    for (int i = 0; i < half; i++) cs[i] = frnd(1.0f), sn[i] = frnd(1.0f);
    x0[0] = bits(0x7fc01234u);
    if (n > 3) x0[n - 2] = INFINITY; /* the last head's second half: inf * sin (and * 0 when sin is 0) */
    for (int v = 0; v < n_paths; v++) {
        x[v] = malloc(4 * (size_t)n);
        memcpy(x[v], x0, 4 * (size_t)n);
        bk_set_isa(paths[v]);
        ops_rope_heads(x[v], n_heads, hd, cs, sn);
        CHECK(v == 0 || !memcmp(x[0], x[v], 4 * (size_t)n), "rope path %d heads %d hd %d", paths[v], n_heads, hd);
    }
    for (int v = 0; v < n_paths; v++) free(x[v]);
    free(x0), free(cs), free(sn);
}

/* one position's key (a column of a transposed block) and value (a row) into an f16 cache */
static void check_kv_f16(int hd) {
    float *k = malloc(4 * (size_t)hd), *val = malloc(4 * (size_t)hd);
    for (int i = 0; i < hd; i++) k[i] = frnd(i % 5 ? 4.0f : 70000.0f), val[i] = frnd(i % 3 ? 1e-4f : 2.0f);
    for (int i = 0; i < hd; i++) {
        if (i % 3 == 0) k[i] = bits(EDGES[(i / 3) % N_EDGES]);
        if (i % 3 == 1) val[i] = bits(EDGES[(i / 3 + 5) % N_EDGES]);
    }
    const size_t kn = (size_t)hd * OPS_KT_BLOCK;
    uint16_t *kc[8], *vc[8];
    for (int v = 0; v < n_paths; v++) {
        kc[v] = malloc(2 * kn), vc[v] = malloc(2 * (size_t)hd + 2);
        for (size_t i = 0; i < kn; i++) kc[v][i] = 0xabcd; /* the other positions of the block */
        vc[v][hd] = 0xabcd;                                 /* past the row */
        bk_set_isa(paths[v]);
        ops_kv_store_f16(k, val, hd, kc[v] + 7, vc[v]); /* position 7 of its block */
        CHECK(vc[v][hd] == 0xabcd, "kv f16 wrote past the value row: path %d hd %d", paths[v], hd);
        CHECK(v == 0 || (!memcmp(kc[0], kc[v], 2 * kn) && !memcmp(vc[0], vc[v], 2 * (size_t)hd)),
              "kv f16 path %d hd %d", paths[v], hd);
    }
    int untouched = 1;
    for (size_t i = 0; i < kn; i++) untouched &= (i % OPS_KT_BLOCK == 7) || kc[0][i] == 0xabcd;
    CHECK(untouched, "kv f16 key wrote outside its column: hd %d", hd);
    /* the scalar conversion itself, on values whose halves are known */
    const uint32_t in[] = {0x3f800000u, 0x477ff000u, 0x477fefffu, 0x33000000u, 0x33400000u, 0xb3c00000u, 0xffffffffu, 0x7f800001u, 0x80000000u};
    const uint16_t want[] = {0x3c00, 0x7c00, 0x7bff, 0x0000, 0x0001, 0x8002, 0xfe00, 0x7e00, 0x8000};
    for (int i = 0; i < 9; i++) CHECK(bk_float_to_half(bits(in[i])) == want[i], "half(0x%08x) = 0x%04x", in[i], bk_float_to_half(bits(in[i])));
    for (int v = 0; v < n_paths; v++) free(kc[v]), free(vc[v]);
    free(k), free(val);
}

#if defined(__aarch64__)
#include "exp_neon.h"
/* exp_neon.h's exp, and its unclamped form on the range it takes, against the scalar exp_poly lane by lane: every
 * 509th float from -0 down to EXP_LO (subnormals, the range's end, 2^n's every exponent), then past it (-inf, NaN) */
static void check_exp_neon(void) {
    const uint32_t lo = 0xc2ae999au; /* EXP_LO = -87.3f */
    CHECK(bits(lo) == EXP_LO, "EXP_LO is not 0x%08x", lo);
    int bad = 0, bad_in_range = 0;
    float x[4], y[4], z[4];
    int k = 0;
    for (uint64_t b = 0x80000000u; b <= lo + 4 * 509u; b += 509) {
        x[k++] = bits((uint32_t)(b < lo ? b : lo));
        if (k < 4) continue;
        k = 0;
        vst1q_f32(y, ops_exp_neon(vld1q_f32(x)));
        vst1q_f32(z, ops_exp_neon_in_range(vld1q_f32(x)));
        for (int l = 0; l < 4; l++) bad += memcmp(&y[l], &(float){exp_poly(x[l])}, 4) != 0, bad_in_range += memcmp(&z[l], &y[l], 4) != 0;
    }
    /* ties: x * log2(e) exactly -(k + 1/2), where round-to-nearest-even and a cheaper rounding (away from zero,
     * vrndaq / fcvtas) part ways; the sampled floats above miss them */
    int ties = 0;
    for (int t = 0; t < 126; t++) {
        const float x0 = -(t + 0.5f) / EXP_LOG2E;
        uint32_t b0;
        memcpy(&b0, &x0, 4);
        for (uint32_t b = b0 - 256; b < b0 + 256; b++) {
            const float xt = bits(b);
            if (xt * EXP_LOG2E != -(t + 0.5f) || xt < EXP_LO) continue;
            ties++;
            const float32x4_t v = vdupq_n_f32(xt);
            vst1q_f32(y, ops_exp_neon(v)), vst1q_f32(z, ops_exp_neon_in_range(v));
            bad += memcmp(&y[0], &(float){exp_poly(xt)}, 4) != 0, bad_in_range += memcmp(&z[0], &y[0], 4) != 0;
        }
    }
    CHECK(ties > 100, "only %d rounding ties found", ties);
    const float past[4] = {-INFINITY, NAN, -88.0f, bits(lo + 1)};
    vst1q_f32(y, ops_exp_neon(vld1q_f32(past)));
    for (int l = 0; l < 4; l++) bad += memcmp(&y[l], &(float){exp_poly(past[l])}, 4) != 0;
    CHECK(!bad && !bad_in_range, "exp_neon differs from exp_poly at %d floats (unclamped, in range: %d)", bad, bad_in_range);
}
#endif

int main(void) {
    bk_init();
#if defined(__aarch64__)
    check_exp_neon();
#endif
    for (int isa = 0; isa <= BK_ISA_I8MM; isa++)
        if (isa == BK_ISA_SCALAR || bk_isa_supported(isa)) paths[n_paths++] = isa;
    printf("paths:");
    for (int v = 0; v < n_paths; v++) printf(" %d", paths[v]);
    printf("\n");
    CHECK(n_paths >= 2, "no vector path to compare with scalar");
    static const int norm_shapes[][2] = {{1, 64}, {3, 2560}, {5, 37}, {16, 200}, {2, 8}, {1, 15}};
    for (unsigned s = 0; s < sizeof norm_shapes / sizeof norm_shapes[0]; s++) check_norms(norm_shapes[s][0], norm_shapes[s][1]);
    static const int thread_shapes[][2] = {{8, 2560}, {14, 2560}, {16, 2560}, {26, 2560}, {64, 2560}, {40, 300}};
    for (unsigned s = 0; s < sizeof thread_shapes / sizeof thread_shapes[0]; s++)
        check_norm_threads(thread_shapes[s][0], thread_shapes[s][1]);
    static const int silu_shapes[][2] = {{1, 1}, {1, 3}, {2, 4}, {1, 7}, {3, 8}, {2, 9}, {1, 31}, {2, 37}, {3, 300}, {1, 6912}};
    for (unsigned s = 0; s < sizeof silu_shapes / sizeof silu_shapes[0]; s++)
        for (int edges = 0; edges < 2; edges++) check_silu(silu_shapes[s][0], silu_shapes[s][1], edges);
    static const int rope_shapes[][2] = {{1, 2}, {3, 6}, {1, 8}, {2, 14}, {1, 16}, {5, 18}, {2, 30}, {4, 64}, {25, 128}, {1, 130}};
    for (unsigned s = 0; s < sizeof rope_shapes / sizeof rope_shapes[0]; s++) check_rope(rope_shapes[s][0], rope_shapes[s][1]);
    static const int kv_sizes[] = {1, 3, 4, 7, 8, 9, 15, 16, 17, 20, 64, 100, 128, 256, 600};
    for (unsigned s = 0; s < sizeof kv_sizes / sizeof kv_sizes[0]; s++) check_kv_f16(kv_sizes[s]);
    bk_set_isa(-1);
    return REPORT();
}
"""


@needs_host_cc
def test_gate_rope_kv_bodies_match_scalar_on_this_machine(tmp_path):
    run_harness(tmp_path, HARNESS, target="host", name="ops_paths")  # fails when the CPU has no vector path


@needs_aarch64
def test_gate_rope_kv_bodies_match_scalar_under_qemu(tmp_path):
    out = run_harness(tmp_path, HARNESS, target="aarch64", name="ops_paths")
    assert out.splitlines()[0] == "paths: 0 3 5 6", out  # scalar, neon, dotprod, i8mm: qemu's default CPU has all
