/* bf16 prefill attention: the piece conversion, the scores and the weighted sum (attention_bf16.h), in scalar C and
 * on AVX-512 with AVX512_BF16 (vcvtne2ps2bf16, vdpbf16ps), 4 rows a pass; and 16 rows a pass on the AMX-BF16 tiles
 * (tdpbf16ps) or their emulation (at the end). Every lane's sum is taken pair by pair in the order of vdpbf16ps'
 * definition, (acc + hi * hi) + lo * lo, and the products are exact in f32, so the scalar body is that
 * instruction's arithmetic; the two may still differ in a last bit where a CPU's denormal handling does (the tests
 * compare each with the f32 attention, not bytes with each other). */
#include "attention_bf16.h"

#include "ops.h"
#include "tiles.h" /* the tile API: hardware AMX or its emulation */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PIECE ATT_BF16_PIECE
#define KT_BLOCK OPS_KT_BLOCK

/* f32 -> bf16 bits, round to nearest even; a NaN stays a (quiet) NaN, a denormal becomes a signed zero (as the
 * instructions treat denormal inputs) */
static inline uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float f32_of(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* One thread's workspace: the piece (kp, vp), up to 16 query rows and weight rows in bf16 (qb, pb), and for the
 * 16-row tile passes their f32 score rows (sc), fold temporaries (ot) and one C tile (ct). Every part starts on a
 * 64-byte boundary when ws does (hd a multiple of 16). */
typedef struct {
    uint16_t *kp, *vp, *qb, *pb;
    float *sc, *ot, *ct;
} bf16_ws;
static bf16_ws ws_parts(void *ws, int hd) {
    uint16_t *w = (uint16_t *)ws;
    uint16_t *kp = w, *vp = kp + (size_t)PIECE * hd, *qb = vp + (size_t)PIECE * hd, *pb = qb + (size_t)16 * hd;
    float *sc = (float *)(pb + (size_t)16 * PIECE), *ot = sc + (size_t)16 * PIECE, *ct = ot + (size_t)16 * hd;
    return (bf16_ws){kp, vp, qb, pb, sc, ot, ct};
}
size_t att_bf16_ws_bytes(int hd) {
    return sizeof(uint16_t) * ((size_t)2 * PIECE * hd + (size_t)16 * hd + (size_t)16 * PIECE) +
           sizeof(float) * ((size_t)16 * PIECE + (size_t)16 * hd + 1024);
}
float *att_bf16_score_rows(void *ws, int hd) { return ws_parts(ws, hd).sc; }
float *att_bf16_temp_rows(void *ws, int hd) { return ws_parts(ws, hd).ot; }

static inline float kv_at(const void *base, int f16, int64_t at) {
    return f16 ? ops_half_to_float(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}
/* element offsets: key (dim i, position t) and value (position t, column c) of a piece */
static inline int64_t k_off(kv_blocks bl, int i, int t) { return BLK(bl, t / KT_BLOCK) + (int64_t)i * KT_BLOCK + t % KT_BLOCK; }
static inline int64_t v_off(kv_blocks bl, int t, int c, int hd) {
    return BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c;
}
static inline int n16_of(int n) { return (n + 63) / 64 * 4; } /* key blocks converted: whole 64-position passes */
static inline int v_pairs(int n) { return (n + 31) / 32 * 16; } /* value pair rows: whole 32-position tile steps */

/* the value pairs past the piece's n positions, up to the tile passes' 32-position steps: zeros */
static void zero_v_tail(const bf16_ws *w, int n, int hd) {
    for (int c = 0; c < hd / 16; c++)
        for (int u = (n + 1) / 2; u < v_pairs(n); u++) memset(w->vp + ((size_t)c * (PIECE / 2) + u) * 32, 0, 64);
}

static void piece_scalar(const bf16_ws *w, const void *kb, kv_blocks kbl, const void *vb, kv_blocks vbl, int f16, int n,
                         int hd) {
    for (int b = 0; b < n16_of(n); b++)
        for (int i2 = 0; i2 < hd / 2; i2++)
            for (int l = 0; l < 16; l++) {
                const int t = 16 * b + l;
                uint16_t *d = w->kp + ((size_t)b * hd / 2 + i2) * 32 + 2 * l;
                d[0] = t < n ? bf16_of(kv_at(kb, f16, k_off(kbl, 2 * i2, t))) : 0;
                d[1] = t < n ? bf16_of(kv_at(kb, f16, k_off(kbl, 2 * i2 + 1, t))) : 0;
            }
    zero_v_tail(w, n, hd);
    for (int c = 0; c < hd / 16; c++)
        for (int u = 0; u < (n + 1) / 2; u++)
            for (int l = 0; l < 16; l++) {
                uint16_t *d = w->vp + ((size_t)c * (PIECE / 2) + u) * 32 + 2 * l;
                d[0] = bf16_of(kv_at(vb, f16, v_off(vbl, 2 * u, 16 * c + l, hd)));
                d[1] = 2 * u + 1 < n ? bf16_of(kv_at(vb, f16, v_off(vbl, 2 * u + 1, 16 * c + l, hd))) : 0;
            }
}

/* One lane of vdpbf16ps per pair: acc + a.hi * b.hi, then + a.lo * b.lo, i.e. one add per element e in the order
 * hi, lo of each pair (e ^ 1). Written as one add per iteration on purpose: GCC 12.2 at -O3 vectorized the two-add
 * form (acc = (acc + x1) + x0 per iteration) into wrong sums (not a rounding difference; off by >10%). */
static void scores_scalar(const bf16_ws *w, int R, const int *live, int n, int hd, float scale, float *const *sc,
                          float *mx) {
    for (int j = 0; j < R; j++) {
        mx[j] = -INFINITY;
        for (int t = 0; t < n; t++) {
            const uint16_t *k = w->kp + (size_t)(t / 16) * hd * 16 + 2 * (t % 16), *q = w->qb + (size_t)j * hd;
            float d = 0.0f;
            for (int e = 0; e < hd; e++) d += f32_of(q[e ^ 1]) * f32_of(k[(size_t)(e / 2) * 32 + (e ^ 1) % 2]);
            sc[j][t] = d * scale;
            if (t < live[j]) mx[j] = sc[j][t] > mx[j] ? sc[j][t] : mx[j];
        }
    }
}
static void wsum_scalar(const bf16_ws *w, int R, int n, int hd, const float *inv, float *const *out) {
    const int n2 = (n + 1) / 2 * 2;
    for (int j = 0; j < R; j++)
        for (int c = 0; c < hd; c++) {
            const uint16_t *v = w->vp + (size_t)(c / 16) * (PIECE / 2) * 32 + 2 * (c % 16), *p = w->pb + (size_t)j * PIECE;
            float d = 0.0f;
            for (int e = 0; e < n2; e++) d += f32_of(p[e ^ 1]) * f32_of(v[(size_t)(e / 2) * 32 + (e ^ 1) % 2]);
            out[j][c] = d * inv[j];
        }
}

#if defined(__x86_64__)
#define BF16_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))

/* 16 keys or values (f16 bits or f32) -> f32, lanes past `valid` zero */
BF16_FN static inline __m512 load16f(const void *base, int f16, int64_t off, int valid) {
    const __mmask16 k = valid >= 16 ? (__mmask16)0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
    return f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)base + off))
               : _mm512_maskz_loadu_ps(k, (const float *)base + off);
}
/* (lo[l], hi[l]) pairs for the 16 lanes: 32 bf16 words, lo in the even words */
BF16_FN static inline __m512i pairs(__m512 lo, __m512 hi) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                         20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

BF16_FN static void piece_avx512(const bf16_ws *w, const void *kb, kv_blocks kbl, const void *vb, kv_blocks vbl, int f16,
                                 int n, int hd) {
    for (int b = 0; b < n16_of(n); b++) {
        uint16_t *d = w->kp + (size_t)b * hd * 16;
        const int valid = n - 16 * b;
        if (valid <= 0) {
            memset(d, 0, sizeof(uint16_t) * (size_t)hd * 16);
            continue;
        }
        const int64_t base = BLK(kbl, b / 2) + (b % 2) * 16; /* a block of 16 lies in one cache block of 32 */
        for (int i2 = 0; i2 < hd / 2; i2++) {
            const __m512 lo = load16f(kb, f16, base + (int64_t)(2 * i2) * KT_BLOCK, valid);
            const __m512 hi = load16f(kb, f16, base + (int64_t)(2 * i2 + 1) * KT_BLOCK, valid);
            _mm512_storeu_si512(d + (size_t)i2 * 32, pairs(lo, hi));
        }
    }
    zero_v_tail(w, n, hd);
    for (int u = 0; u < (n + 1) / 2; u++) {
        const int t = 2 * u;
        const int64_t r0 = v_off(vbl, t, 0, hd), r1 = t + 1 < n ? v_off(vbl, t + 1, 0, hd) : r0;
        for (int c = 0; c < hd / 16; c++) {
            const __m512 lo = load16f(vb, f16, r0 + 16 * c, 16), hi = load16f(vb, f16, r1 + 16 * c, t + 1 < n ? 16 : 0);
            _mm512_storeu_si512(w->vp + ((size_t)c * (PIECE / 2) + u) * 32, pairs(lo, hi));
        }
    }
}

/* 4 rows x 64 lanes a pass, 16 accumulators: a[j][v] += pair(j, s) . x[v] for each pair step s. The rows' pairs
 * are 32-bit words at rows + j * row_words (broadcast); x[v] at xs + v * vstride + s * 32 words. */
#define DP4X4(a, rows, row_words, xs, vstride, nv, steps)                                                    \
    for (int s_ = 0; s_ < (steps); s_++) {                                                                   \
        __m512i x_[4];                                                                                       \
        for (int v_ = 0; v_ < 4; v_++)                                                                       \
            x_[v_] = v_ < (nv) ? _mm512_loadu_si512((xs) + (size_t)v_ * (vstride) + (size_t)s_ * 32)         \
                               : _mm512_setzero_si512();                                                     \
        for (int j_ = 0; j_ < 4; j_++) {                                                                     \
            uint32_t p_;                                                                                     \
            memcpy(&p_, (rows) + (size_t)j_ * (row_words) + 2 * (size_t)s_, 4);                             \
            const __m512bh b_ = (__m512bh)_mm512_set1_epi32((int)p_);                                        \
            for (int v_ = 0; v_ < 4; v_++) a[j_][v_] = _mm512_dpbf16_ps(a[j_][v_], b_, (__m512bh)x_[v_]);     \
        }                                                                                                    \
    }

/* rows[j][0 .. cnt[j]) -> bf16 at dst + j * ld for j < nr, zeros past cnt[j] up to n_pad (a multiple of 2) */
BF16_FN static void rows_to_bf16(const float *const *rows, const int *cnt, int nr, int n_pad, uint16_t *dst, size_t ld) {
    for (int j = 0; j < nr; j++)
        for (int t = 0; t < n_pad; t += 16) {
            const int valid = cnt[j] - t;
            const __mmask16 k = valid >= 16 ? (__mmask16)0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
            const int room = n_pad - t;
            const __mmask16 st = room >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << room) - 1);
            const __m512 x = k ? _mm512_maskz_loadu_ps(k, rows[j] + t) : _mm512_setzero_ps();
            _mm256_mask_storeu_epi16(dst + (size_t)j * ld + t, st, (__m256i)_mm512_cvtneps_pbh(x));
        }
}

/* exp(x) for x <= 0 as 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-3 polynomial fitted for relative error (at most
 * 1.1e-4 over the exp, far under bf16's 2^-9); x below -87 counts as -87 (its exp a denormal, which bf16 flushes) */
BF16_FN static inline __m512 exp_bf16_avx512(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0550089292f), f, _mm512_set1_ps(0.242210984f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693282902f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* softmax's exp for the weighted sum: row j's e = exp(s - mx[j]) over its live[j] positions -> bf16 weight row
 * j (zeros after, up to n_pad), sum[j] their f32 sum; rows past R: zeros */
BF16_FN static void softmax_avx512(const bf16_ws *w, float *const *s, float scale, int nr, int R, const int *live,
                                   const float *mx, float *sum, int n_pad) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int j = 0; j < nr; j++) {
        const int n = j < R ? live[j] : 0;
        const __m512 m = _mm512_set1_ps(j < R ? mx[j] : 0.0f);
        __m512 acc = _mm512_setzero_ps();
        for (int t = 0; t < n_pad; t += 16) {
            const int valid = n - t;
            const __mmask16 k = valid >= 16 ? (__mmask16)0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s[j] + t), vs);
            const __m512 e = k ? _mm512_maskz_mov_ps(k, exp_bf16_avx512(_mm512_sub_ps(x, m))) : _mm512_setzero_ps();
            acc = _mm512_add_ps(acc, e);
            const int room = n_pad - t;
            const __mmask16 st = room >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << room) - 1);
            _mm256_mask_storeu_epi16(w->pb + (size_t)j * PIECE + t, st, (__m256i)_mm512_cvtneps_pbh(e));
        }
        if (j < R) sum[j] = _mm512_reduce_add_ps(acc);
    }
}

BF16_FN static void scores_avx512(const bf16_ws *w, const int *live, int n, int hd, float scale, float *const *sc,
                                  float *mx) {
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 m[4]; /* each row's running max over its live lanes: vmaxps(x, m) keeps m where x is NaN */
    for (int j = 0; j < 4; j++) m[j] = _mm512_set1_ps(-INFINITY);
    for (int t0 = 0; t0 < n; t0 += 64) {
        __m512 a[4][4];
        for (int j = 0; j < 4; j++)
            for (int v = 0; v < 4; v++) a[j][v] = _mm512_setzero_ps();
        DP4X4(a, w->qb, hd, w->kp + (size_t)(t0 / 16) * hd * 16, (size_t)hd * 16, 4, hd / 2);
        for (int j = 0; j < 4; j++)
            for (int v = 0; v < 4; v++) {
                const int valid = n - t0 - 16 * v;
                const __mmask16 k = valid >= 16 ? (__mmask16)0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
                const __m512 x = _mm512_mul_ps(a[j][v], vs);
                _mm512_mask_storeu_ps(sc[j] + t0 + 16 * v, k, x);
                const int lv = live[j] - t0 - 16 * v;
                const __mmask16 kl = lv >= 16 ? (__mmask16)0xffff : lv <= 0 ? 0 : (__mmask16)((1u << lv) - 1);
                m[j] = _mm512_mask_max_ps(m[j], kl, x, m[j]);
            }
    }
    for (int j = 0; j < 4; j++) mx[j] = _mm512_reduce_max_ps(m[j]);
}
BF16_FN static void wsum_avx512(const bf16_ws *w, int n, int hd, const float *inv, float *const *out) {
    for (int c0 = 0; c0 < hd / 16; c0 += 4) {
        const int nv = hd / 16 - c0 < 4 ? hd / 16 - c0 : 4;
        __m512 a[4][4];
        for (int j = 0; j < 4; j++)
            for (int v = 0; v < 4; v++) a[j][v] = _mm512_setzero_ps();
        DP4X4(a, w->pb, PIECE, w->vp + (size_t)c0 * (PIECE / 2) * 32, (size_t)(PIECE / 2) * 32, nv, (n + 1) / 2);
        for (int j = 0; j < 4; j++)
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(out[j] + 16 * (c0 + v), _mm512_mul_ps(a[j][v], _mm512_set1_ps(inv[j])));
    }
}
#endif

int att_bf16_vector(void) {
#if defined(__x86_64__)
    return ops_isa() == OPS_ISA_AVX512 && bk_get_features()->avx512bf16;
#else
    return 0;
#endif
}

void att_bf16_piece(void *ws, const void *kb, kv_blocks kbl, const void *vb, kv_blocks vbl, int f16, int n, int hd) {
    const bf16_ws w = ws_parts(ws, hd);
#if defined(__x86_64__)
    if (att_bf16_vector()) {
        piece_avx512(&w, kb, kbl, vb, vbl, f16, n, hd);
        return;
    }
#endif
    piece_scalar(&w, kb, kbl, vb, vbl, f16, n, hd);
}

/* the rows' bf16 copies: row j's first cnt[j] values, then zeros up to n_pad */
static void rows_to_bf16_scalar(const float *const *rows, const int *cnt, int nr, int n_pad, uint16_t *dst, size_t ld) {
    for (int j = 0; j < nr; j++)
        for (int t = 0; t < n_pad; t++) dst[(size_t)j * ld + t] = t < cnt[j] ? bf16_of(rows[j][t]) : 0;
}
/* the same on whatever path runs: the query rows of the 4-row and the 16-row passes */
static void rows_bf16(const float *const *rows, const int *cnt, int nr, int n_pad, uint16_t *dst, size_t ld) {
#if defined(__x86_64__)
    if (att_bf16_vector()) {
        rows_to_bf16(rows, cnt, nr, n_pad, dst, ld);
        return;
    }
#endif
    rows_to_bf16_scalar(rows, cnt, nr, n_pad, dst, ld);
}

void att_bf16_scores(void *ws, const float *const *q, int R, const int *live, int n, int hd, float scale,
                     float *const *sc, float *mx) {
    const bf16_ws w = ws_parts(ws, hd);
    const int cnt[4] = {R > 0 ? hd : 0, R > 1 ? hd : 0, R > 2 ? hd : 0, R > 3 ? hd : 0}; /* rows past R: zero */
    rows_bf16(q, cnt, 4, hd, w.qb, (size_t)hd);
#if defined(__x86_64__)
    if (att_bf16_vector()) {
        float m4[4];
        const int live4[4] = {live[0], R > 1 ? live[1] : 0, R > 2 ? live[2] : 0, R > 3 ? live[3] : 0};
        scores_avx512(&w, live4, n, hd, scale, sc, m4);
        memcpy(mx, m4, sizeof(float) * (size_t)R);
        return;
    }
#endif
    scores_scalar(&w, R, live, n, hd, scale, sc, mx);
}

/* exp_bf16_avx512 in one lane, operation for operation (fmaf for each vfmadd, rint for the round to nearest even,
 * ldexpf for vscalefps): the same floats */
static float exp_bf16_scalar(float x) {
    const float t = (x > -87.0f ? x : -87.0f) * 1.44269504f, n = rintf(t), f = t - n;
    float p = fmaf(0.0550089292f, f, 0.242210984f);
    p = fmaf(p, f, 0.693282902f);
    p = fmaf(p, f, 1.0f);
    return ldexpf(p, (int)n);
}

static void softmax_scalar(const bf16_ws *w, float *const *s, float scale, int nr, int R, const int *live,
                           const float *mx, float *sum, int n_pad) {
    for (int j = 0; j < nr; j++) {
        const int n = j < R ? live[j] : 0;
        float acc = 0.0f;
        for (int t = 0; t < n_pad; t++) {
            const float e = t < n ? exp_bf16_scalar(s[j][t] * scale - mx[j]) : 0.0f;
            acc += e;
            w->pb[(size_t)j * PIECE + t] = bf16_of(e);
        }
        if (j < R) sum[j] = acc;
    }
}

void att_bf16_softmax(void *ws, int hd, float *const *s, float scale, int nr, int R, const int *live, const float *mx,
                      float *sum) {
    const bf16_ws w = ws_parts(ws, hd);
    int n = 0;
    for (int j = 0; j < R; j++) n = live[j] > n ? live[j] : n;
    const int n_pad = (n + 31) / 32 * 32; /* whole 32-position steps of the tile passes (>= the vector ones' pairs) */
#if defined(__x86_64__)
    if (att_bf16_vector()) {
        softmax_avx512(&w, s, scale, nr, R, live, mx, sum, n_pad);
        return;
    }
#endif
    softmax_scalar(&w, s, scale, nr, R, live, mx, sum, n_pad);
}

void att_bf16_wsum(void *ws, int R, const int *live, int hd, const float *inv, float *const *out) {
    const bf16_ws w = ws_parts(ws, hd);
    int n = 0;
    float inv4[4] = {0, 0, 0, 0};
    for (int j = 0; j < R; j++) inv4[j] = inv[j], n = live[j] > n ? live[j] : n;
#if defined(__x86_64__)
    if (att_bf16_vector()) {
        wsum_avx512(&w, n, hd, inv4, out);
        return;
    }
#endif
    wsum_scalar(&w, R, n, hd, inv4, out);
}

/* ---------- 16-row passes on AMX-BF16 tiles (tdpbf16ps), and on their emulation ----------
 * Scores: C[16 rows x 16 positions] += Q[16 x 32 dims] . K pairs[16 dim pairs x 16 positions], four C tiles (64
 * positions) per pass over head_dim; a key block's 16 pair rows of 64 bytes are one B tile as converted (kp).
 * Weighted sum: C[16 rows x 16 columns] += E[16 x 32 positions] . V pairs[16 position pairs x 16 columns], four C
 * tiles (64 columns) per pass over the positions (vp as converted, zero-padded to 32 positions). Every tile is 16
 * rows x 64 bytes. The weight rows are exp(s - max) in bf16, and 1/sum multiplies the output, as on AVX-512. */
static const bk_tilecfg_t bf16_tile_cfg = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* TL_*: one tile instruction, on the hardware (inline asm, as gemm_tiles.c writes them: tile numbers are
 * immediates) or the emulation (tiles_emu.c) */
#if BK_HAVE_AMX
#define TL_CFG(hw, c) \
    do { if (hw) __asm__ volatile("ldtilecfg %0" ::"m"(*(const bk_tilecfg_t *)(c))); else bk_emu_tile_config(c); } while (0)
#define TL_REL(hw) do { if (hw) __asm__ volatile("tilerelease" ::: "memory"); else bk_emu_tile_release(); } while (0)
#define TL_ZERO(hw, t) do { if (hw) __asm__ volatile("tilezero %%tmm" #t ::); else bk_emu_tile_zero(t); } while (0)
#define TL_LOAD(hw, t, p, s)                                                                                        \
    do {                                                                                                         \
        if (hw) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(p)), "r"((long)(s)) : "memory"); \
        else bk_emu_tile_load(t, p, s);                                                                          \
    } while (0)
#define TL_STORE(hw, t, p, s)                                                                                       \
    do {                                                                                                         \
        if (hw) __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(p)), "r"((long)(s)) : "memory"); \
        else bk_emu_tile_store(t, p, s);                                                                         \
    } while (0)
#define TL_DP(hw, c, a, b) \
    do { if (hw) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::); else bk_emu_tile_dpbf16ps(c, a, b); } while (0)
#else
#define TL_CFG(hw, c) ((void)(hw), bk_emu_tile_config(c))
#define TL_REL(hw) ((void)(hw), bk_emu_tile_release())
#define TL_ZERO(hw, t) ((void)(hw), bk_emu_tile_zero(t))
#define TL_LOAD(hw, t, p, s) ((void)(hw), bk_emu_tile_load(t, p, s))
#define TL_STORE(hw, t, p, s) ((void)(hw), bk_emu_tile_store(t, p, s))
#define TL_DP(hw, c, a, b) ((void)(hw), bk_emu_tile_dpbf16ps(c, a, b))
#endif

int att_bf16_tiles(void) {
    const int mode = bk_get_tiles();
    return mode == BK_TILES_EMU || (mode == BK_TILES_AMX && bk_get_features()->amx_bf16);
}
static int tiles_hw(void) { return bk_get_tiles() == BK_TILES_AMX; }
/* the tile configuration of the 16-row passes, set once around a thread's run of them */
void att_bf16_tiles_begin(void) {
    const int hw = tiles_hw();
    TL_CFG(hw, &bf16_tile_cfg);
}
void att_bf16_tiles_end(void) {
    const int hw = tiles_hw();
    TL_REL(hw);
}

/* each score row's max over its live positions, not NaN (-inf if none), times the softmax scale: the max of the
 * scaled scores (rounding is monotonic and the scale positive), which att_bf16_softmax scales as it reads them; and
 * the tile passes' epilogue (the C tiles' rows times inv[j]). On AVX-512 where the bf16 bodies run there, else in
 * scalar C: the same floats. */
#if defined(__x86_64__)
BF16_FN static void max16_avx512(const bf16_ws *w, int R, const int *live, float scale, float *mx) {
    for (int j = 0; j < R; j++) {
        const float *s = w->sc + (size_t)j * PIECE;
        __m512 m = _mm512_set1_ps(-INFINITY); /* vmaxps(x, m) keeps m where x is NaN */
        for (int t = 0; t < live[j]; t += 16) {
            const int lv = live[j] - t;
            const __mmask16 kl = lv >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << lv) - 1);
            m = _mm512_mask_max_ps(m, kl, _mm512_maskz_loadu_ps(kl, s + t), m);
        }
        mx[j] = _mm512_reduce_max_ps(m) * scale;
    }
}
BF16_FN static void scale_rows16_avx512(const float *ct, int R, int nv, const float *inv, float *const *out, int col) {
    for (int j = 0; j < R; j++)
        for (int v = 0; v < nv; v++)
            _mm512_storeu_ps(out[j] + col + 16 * v,
                             _mm512_mul_ps(_mm512_loadu_ps(ct + 64 * j + 16 * v), _mm512_set1_ps(inv[j])));
}
#endif
static void max16(const bf16_ws *w, int R, const int *live, float scale, float *mx) {
#if defined(__x86_64__)
    if (att_bf16_vector()) {
        max16_avx512(w, R, live, scale, mx);
        return;
    }
#endif
    for (int j = 0; j < R; j++) {
        const float *s = w->sc + (size_t)j * PIECE;
        float m = -INFINITY;
        for (int t = 0; t < live[j]; t++) m = s[t] > m ? s[t] : m;
        mx[j] = m * scale;
    }
}
/* ct: C tiles 0 .. nv - 1 side by side (rows 64 floats apart) -> out[j][col ..] times inv[j] */
static void scale_rows16(const float *ct, int R, int nv, const float *inv, float *const *out, int col) {
#if defined(__x86_64__)
    if (att_bf16_vector()) {
        scale_rows16_avx512(ct, R, nv, inv, out, col);
        return;
    }
#endif
    for (int j = 0; j < R; j++)
        for (int l = 0; l < 16 * nv; l++) out[j][col + l] = ct[64 * j + l] * inv[j];
}

void att_bf16_scores16(void *ws, const float *const *q, int R, const int *live, int n, int hd, float scale,
                       float *mx) {
    const bf16_ws w = ws_parts(ws, hd);
    const int hw = tiles_hw();
    int cnt[16];
    const float *rows[16];
    for (int j = 0; j < 16; j++) cnt[j] = j < R ? hd : 0, rows[j] = j < R ? q[j] : q[0];
    rows_bf16(rows, cnt, 16, hd, w.qb, (size_t)hd);
    const size_t ls = sizeof(float) * PIECE; /* score rows' stride in bytes */
    for (int t0 = 0; t0 < n; t0 += 64) {
        const uint16_t *kb = w.kp + (size_t)(t0 / 16) * hd * 16, *qa = w.qb;
        const size_t blk = (size_t)hd * 16; /* one 16-position block of kp */
        TL_ZERO(hw, 0);
        TL_ZERO(hw, 1);
        TL_ZERO(hw, 2);
        TL_ZERO(hw, 3);
        for (int s = 0; s < hd / 32; s++, qa += 32, kb += 16 * 32) { /* 32 dims: 16 pair rows */
            TL_LOAD(hw, 4, qa, (size_t)hd * 2);
            TL_LOAD(hw, 5, kb, 64);
            TL_DP(hw, 0, 4, 5);
            TL_LOAD(hw, 6, kb + blk, 64);
            TL_DP(hw, 1, 4, 6);
            TL_LOAD(hw, 7, kb + 2 * blk, 64);
            TL_DP(hw, 2, 4, 7);
            TL_LOAD(hw, 5, kb + 3 * blk, 64);
            TL_DP(hw, 3, 4, 5);
        }
        float *c = w.sc + t0;
        TL_STORE(hw, 0, c, ls);
        TL_STORE(hw, 1, c + 16, ls);
        TL_STORE(hw, 2, c + 32, ls);
        TL_STORE(hw, 3, c + 48, ls);
    }
    max16(&w, R, live, scale, mx);
}

void att_bf16_wsum16(void *ws, int R, const int *live, int hd, const float *inv, float *const *out) {
    const bf16_ws w = ws_parts(ws, hd);
    const int hw = tiles_hw();
    int n = 0;
    for (int j = 0; j < R; j++) n = live[j] > n ? live[j] : n;
    const int n32 = (n + 31) / 32 * 32; /* the weight rows: att_bf16_softmax, zero-padded to n32 */
    for (int c0 = 0; c0 < hd / 16; c0 += 4) {
        const int nv = hd / 16 - c0 < 4 ? hd / 16 - c0 : 4;
        const size_t cb = (size_t)(PIECE / 2) * 32; /* one 16-column block of vp */
        const uint16_t *vb = w.vp + (size_t)c0 * cb, *pa = w.pb;
        TL_ZERO(hw, 0);
        TL_ZERO(hw, 1);
        TL_ZERO(hw, 2);
        TL_ZERO(hw, 3);
        for (int u = 0; u < n32; u += 32, pa += 32, vb += 16 * 32) { /* 32 positions: 16 pair rows */
            TL_LOAD(hw, 4, pa, (size_t)PIECE * 2);
            TL_LOAD(hw, 5, vb, 64);
            TL_DP(hw, 0, 4, 5);
            if (nv > 1) {
                TL_LOAD(hw, 6, vb + cb, 64);
                TL_DP(hw, 1, 4, 6);
            }
            if (nv > 2) {
                TL_LOAD(hw, 7, vb + 2 * cb, 64);
                TL_DP(hw, 2, 4, 7);
            }
            if (nv > 3) {
                TL_LOAD(hw, 5, vb + 3 * cb, 64);
                TL_DP(hw, 3, 4, 5);
            }
        }
        /* the C tiles side by side in ct, then each row times its 1/sum */
        TL_STORE(hw, 0, w.ct, 256);
        if (nv > 1) TL_STORE(hw, 1, w.ct + 16, 256);
        if (nv > 2) TL_STORE(hw, 2, w.ct + 32, 256);
        if (nv > 3) TL_STORE(hw, 3, w.ct + 48, 256);
        scale_rows16(w.ct, R, nv, inv, out, 16 * c0);
    }
}
