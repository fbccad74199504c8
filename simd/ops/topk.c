/* Top-k selection for the sampler: one pass over the logits with a k-entry min-heap, so a 128k
 * vocabulary costs ~one read of the logits instead of numpy's argpartition (a full partition pass
 * with index shuffling, ~20x slower). Output indices are unordered; NaN never enters the heap. */
#include "ops.h"

static inline void sift_down(float *hv, int32_t *hi, int k, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && hv[l] < hv[m]) m = l;
        if (r < k && hv[r] < hv[m]) m = r;
        if (m == i) return;
        float tv = hv[i];
        hv[i] = hv[m], hv[m] = tv;
        int32_t ti = hi[i];
        hi[i] = hi[m], hi[m] = ti;
        i = m;
    }
}

/* One candidate after the heap is full: the scalar rule every path applies in index order. */
static inline void offer(float v, int i, int k, float *heap_vals, int32_t *idx) {
    if (v > heap_vals[0]) {
        heap_vals[0] = v, idx[0] = i;
        sift_down(heap_vals, idx, k, 0);
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
/* Eight logits per compare against the heap's minimum: almost every block of a 128k vocabulary has none
 * above it, so the scan runs at the speed of the loads (measured: ~10x the scalar loop). NaN compares false
 * (ordered compare), as in the scalar rule; the survivors go through offer() in index order, so the result
 * is the scalar one. */
__attribute__((target("avx2"))) static void scan_avx2(const float *x, int i, int n, int k, float *heap_vals,
                                                      int32_t *idx) {
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(heap_vals[0]), _CMP_GT_OQ));
        while (mask) {
            int j = __builtin_ctz(mask);
            mask &= mask - 1;
            offer(x[i + j], i + j, k, heap_vals, idx);
        }
    }
    for (; i < n; i++) offer(x[i], i, k, heap_vals, idx);
}
#endif

#if defined(__aarch64__)
#include <arm_neon.h>
/* The same scan four logits per compare (ordered compare: NaN false), survivors offered in index order. */
static void scan_neon(const float *x, int i, int n, int k, float *heap_vals, int32_t *idx) {
    for (; i + 4 <= n; i += 4) {
        uint32x4_t gt = vcgtq_f32(vld1q_f32(x + i), vdupq_n_f32(heap_vals[0]));
        if (!vmaxvq_u32(gt)) continue;
        for (int j = 0; j < 4; j++) offer(x[i + j], i + j, k, heap_vals, idx); /* offer re-checks each one */
    }
    for (; i < n; i++) offer(x[i], i, k, heap_vals, idx);
}
#endif

int ops_topk(const float *x, int n, int k, float *heap_vals, int32_t *idx) {
    if (k > n) k = n;
    if (k <= 0) return 0;
    int filled = 0, i = 0;
    for (; i < n && filled < k; i++) {
        float v = x[i];
        if (v != v) continue; /* NaN */
        heap_vals[filled] = v, idx[filled] = i;
        if (++filled == k)
            for (int j = k / 2 - 1; j >= 0; j--) sift_down(heap_vals, idx, k, j);
    }
    if (filled < k) return filled;
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX2) {
        scan_avx2(x, i, n, k, heap_vals, idx);
        return filled;
    }
#endif
#if defined(__aarch64__)
    if (ops_neon()) {
        scan_neon(x, i, n, k, heap_vals, idx);
        return filled;
    }
#endif
    for (; i < n; i++) offer(x[i], i, k, heap_vals, idx);  /* NaN: v > min is false */
    return filled;
}
