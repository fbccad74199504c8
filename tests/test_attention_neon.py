"""Attention's NEON bodies (simd/ops/attention_neon.c), cross-compiled for aarch64 and run under qemu-user: the
whole of ops_attention and ops_attention_paged, on the f32, f16 and int8 caches, gives the same bytes (outputs and
cache contents) on the neon and dotprod paths as on the scalar path. Shapes cover each query-group size the
bodies specialise (R = 1..4), head sizes that are not multiples of 16 or 32, prefill chunks, decode steps, long
contexts split in pieces (past 256 positions), two threads, and several sequences over shuffled pages. Caches
start as NaN (f16 0x7e00, f32 NaN, int8 bytes 0x7f under NaN scales), so a body that lets a position past the
current one reach a score, a sum or an output shows as a difference.

Softmax's exp is one NEON polynomial with 16 fixed lane sums on every cache type, so an f16 / f32 output also
differs when that exp is fused where the scalar exp_poly is not (or the reverse), or when its lanes are summed in
another order (both tried: every f16 shape failed). One shape has large queries and keys, so that most exp
arguments fall below the polynomial's range (the clamp) and a few positions carry the whole softmax.

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user); skips with that reason
when they are missing. On an aarch64 host the ordinary attention tests run these bodies natively.
"""
from cross_c import needs_aarch64, run_harness

pytestmark = needs_aarch64

HARNESS = r"""
static float frnd(void) { return ((int)(rnd() % 20001) - 10000) / 4000.0f; }
static const int PATHS[3] = {BK_ISA_SCALAR, BK_ISA_NEON, BK_ISA_DOTPROD};
static const char *KV_NAMES[3] = {"f32", "f16", "q8"};

static size_t esize(int kv) { return kv == OPS_KV_Q8 ? 1 : kv == OPS_KV_F16 ? 2 : 4; }
static size_t block_elems(int kv, int hd) { return kv == OPS_KV_Q8 ? (size_t)OPS_Q8_BLOCK_BYTES(hd) : (size_t)OPS_KT_BLOCK * hd; }
static void fill_nan(void *p, size_t elems, int kv) {
    if (kv == OPS_KV_Q8) memset(p, 0x7f, elems); /* int8 127, scales 0x7f7f7f7f: NaN */
    else if (kv == OPS_KV_F16) for (size_t i = 0; i < elems; i++) ((uint16_t *)p)[i] = 0x7e00;
    else for (size_t i = 0; i < elems; i++) ((float *)p)[i] = NAN;
}
static void rope_tables(int n_ctx, int hd, float **cos_, float **sin_) {
    int half = hd / 2;
    *cos_ = malloc(sizeof(float) * n_ctx * half), *sin_ = malloc(sizeof(float) * n_ctx * half);
    for (int p = 0; p < n_ctx; p++)
        for (int i = 0; i < half; i++) {
            float f = p * powf(10000.0f, -2.0f * i / hd);
            (*cos_)[p * half + i] = cosf(f), (*sin_)[p * half + i] = sinf(f);
        }
}

/* one contiguous cache: prefill chunks [0, a) and [a, b), then decode steps b .. n-1; output and caches kept */
static void run_contiguous(int path, int kv, int nh, int nkv, int hd, int n, int a, int b, int threads,
                           const float *qkv0, float *out, void **kc, void **vc) {
    int n_ctx = n + 5, row = (nh + 2 * nkv) * hd, nblk = (n_ctx + OPS_KT_BLOCK - 1) / OPS_KT_BLOCK;
    size_t kel = (size_t)nkv * nblk * block_elems(kv, hd);
    size_t vel = kv == OPS_KV_Q8 ? kel : (size_t)nkv * n_ctx * hd;
    *kc = malloc(kel * esize(kv)), *vc = malloc(vel * esize(kv));
    fill_nan(*kc, kel, kv), fill_nan(*vc, vel, kv);
    float *cs, *sn, *qkv = malloc(sizeof(float) * n * row);
    rope_tables(n_ctx, hd, &cs, &sn);
    memcpy(qkv, qkv0, sizeof(float) * n * row);
    int srows = 4 * OPS_ATT_SCRATCH_ROWS;
    float *scratch = malloc(sizeof(float) * srows * n_ctx);
    for (int i = 0; i < srows * n_ctx; i++) scratch[i] = NAN;
    bk_set_isa(path);
    bk_set_num_threads(threads);
    int rc = 0;
    rc |= ops_attention(qkv, a, nh, nkv, hd, cs, sn, 0, *kc, *vc, kv, n_ctx, out, scratch, srows);
    rc |= ops_attention(qkv + (size_t)a * row, b - a, nh, nkv, hd, cs, sn, a, *kc, *vc, kv, n_ctx, out + (size_t)a * nh * hd, scratch, srows);
    for (int p = b; p < n; p++)
        rc |= ops_attention(qkv + (size_t)p * row, 1, nh, nkv, hd, cs, sn, p, *kc, *vc, kv, n_ctx, out + (size_t)p * nh * hd, scratch, srows);
    CHECK(rc == 0, "ops_attention returned an error");
    bk_set_num_threads(0);
    free(qkv), free(cs), free(sn), free(scratch);
}

static void check_contiguous(int kv, int nh, int nkv, int hd, int n, int a, int b, int threads, int amp) {
    int row = (nh + 2 * nkv) * hd, n_ctx = n + 5, nblk = (n_ctx + OPS_KT_BLOCK - 1) / OPS_KT_BLOCK;
    size_t kel = (size_t)nkv * nblk * block_elems(kv, hd), vel = kv == OPS_KV_Q8 ? kel : (size_t)nkv * n_ctx * hd;
    float *qkv = malloc(sizeof(float) * n * row);
    for (int i = 0; i < n * row; i++) qkv[i] = frnd() * amp;
    float *out[3];
    void *kc[3], *vc[3];
    for (int v = 0; v < 3; v++) {
        out[v] = calloc((size_t)n * nh * hd, sizeof(float));
        run_contiguous(PATHS[v], kv, nh, nkv, hd, n, a, b, threads, qkv, out[v], &kc[v], &vc[v]);
    }
    int finite = 1;
    for (size_t i = 0; i < (size_t)n * nh * hd; i++) finite &= isfinite(out[0][i]) != 0;
    CHECK(finite, "scalar output not finite: %s nh %d nkv %d hd %d n %d", KV_NAMES[kv], nh, nkv, hd, n);
    for (int v = 1; v < 3; v++) {
        CHECK(!memcmp(out[0], out[v], sizeof(float) * n * nh * hd), "attention out %s path %d nh %d nkv %d hd %d n %d chunks %d %d threads %d",
              KV_NAMES[kv], PATHS[v], nh, nkv, hd, n, a, b, threads);
        CHECK(!memcmp(kc[0], kc[v], kel * esize(kv)) && !memcmp(vc[0], vc[v], vel * esize(kv)), "attention cache %s path %d hd %d",
              KV_NAMES[kv], PATHS[v], hd);
    }
    for (int v = 0; v < 3; v++) free(out[v]), free(kc[v]), free(vc[v]);
    free(qkv);
}

/* two sequences over shuffled pages of one pool: a prefill step of both, then a decode step of both */
static void check_paged(int kv, int nh, int nkv, int hd, int la, int lb) {
    int row = (nh + 2 * nkv) * hd, n_ctx = (la > lb ? la : lb) + 1, max_pages = (n_ctx + 31) / 32, n_pages = 2 * max_pages + 1;
    size_t blk = block_elems(kv, hd), pool = (size_t)n_pages * nkv * blk;
    int32_t table[2 * 64];
    for (int i = 0; i < 2 * max_pages; i++) table[i] = i % 2 ? i / 2 : n_pages - 1 - i / 2; /* distinct, out of order */
    int m1 = la + lb;
    float *qkv = malloc(sizeof(float) * (m1 + 2) * row), *cs, *sn;
    for (int i = 0; i < (m1 + 2) * row; i++) qkv[i] = frnd();
    rope_tables(n_ctx, hd, &cs, &sn);
    float *out[3];
    void *kp[3], *vp[3];
    int srows = 4 * OPS_ATT_SCRATCH_ROWS;
    float *scratch = malloc(sizeof(float) * srows * n_ctx);
    for (int v = 0; v < 3; v++) {
        out[v] = calloc((size_t)(m1 + 2) * nh * hd, sizeof(float));
        kp[v] = malloc(pool * esize(kv)), vp[v] = malloc(pool * esize(kv));
        fill_nan(kp[v], pool, kv), fill_nan(vp[v], pool, kv);
        float *q = malloc(sizeof(float) * (m1 + 2) * row);
        memcpy(q, qkv, sizeof(float) * (m1 + 2) * row);
        bk_set_isa(PATHS[v]);
        int32_t rows1[3] = {0, la - 1, m1 - 2}, pos1[2] = {0, 0};
        int rc = ops_attention_paged(q, nh, nkv, hd, cs, sn, 2, rows1, pos1, table, max_pages, kp[v], vp[v], kv, out[v], scratch, srows, n_ctx);
        int32_t rows2[3] = {0, 1, 2}, pos2[2] = {la - 1, lb - 1};
        rc |= ops_attention_paged(q + (size_t)(m1 - 2) * row, nh, nkv, hd, cs, sn, 2, rows2, pos2, table, max_pages, kp[v], vp[v], kv,
                                  out[v] + (size_t)(m1 - 2) * nh * hd, scratch, srows, n_ctx);
        CHECK(rc == 0, "ops_attention_paged returned an error");
        free(q);
    }
    for (int v = 1; v < 3; v++)
        CHECK(!memcmp(out[0], out[v], sizeof(float) * m1 * nh * hd) && !memcmp(kp[0], kp[v], pool * esize(kv)) &&
              !memcmp(vp[0], vp[v], pool * esize(kv)), "paged %s path %d nh %d nkv %d hd %d", KV_NAMES[kv], PATHS[v], nh, nkv, hd);
    for (int v = 0; v < 3; v++) free(out[v]), free(kp[v]), free(vp[v]);
    free(qkv), free(cs), free(sn), free(scratch);
}

int main(void) {
    bk_init();
    CHECK(bk_get_isa() == BK_ISA_I8MM && ops_neon(), "dispatcher did not pick i8mm (qemu's default CPU has it)");
    /* nh, nkv, hd, n, prefill chunks [0, a) [a, b), threads, amplitude of q, k and v */
    static const int shapes[][8] = {
        {4, 1, 16, 11, 3, 7, 1, 1},    /* R = 4, the smallest head */
        {3, 3, 20, 13, 5, 6, 1, 1},    /* R = 1, hd not a multiple of 16 */
        {6, 2, 36, 50, 17, 40, 1, 1},  /* R = 3, hd % 32 = 4 */
        {4, 2, 100, 40, 1, 33, 2, 1},  /* R = 2, hd % 16 = 4, two threads */
        {8, 2, 64, 70, 31, 64, 1, 1},  /* R = 4, hd a multiple of 16 (the f16 four-query value pass) */
        {8, 2, 128, 300, 120, 270, 2, 1}, /* past 256 positions: pieces, in prefill and in decode */
        {4, 1, 64, 45, 20, 37, 1, 12}, /* scores of hundreds: exp's arguments mostly below its range */
    };
    for (int kv = 0; kv < 3; kv++)
        for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const int *S = shapes[s];
            check_contiguous(kv, S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7]);
        }
    for (int kv = 0; kv < 3; kv++) {
        check_paged(kv, 8, 2, 64, 40, 70);
        check_paged(kv, 3, 1, 20, 9, 33);
    }
    bk_set_isa(-1);
    return REPORT();
}
"""


def test_attention_neon_bodies_match_scalar_under_qemu(tmp_path):
    run_harness(tmp_path, HARNESS, name="attention_harness")
