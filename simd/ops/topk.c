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

int ops_topk(const float *x, int n, int k, float *heap_vals, int32_t *idx) {
    if (k > n) k = n;
    if (k <= 0) return 0;
    int filled = 0;
    for (int i = 0; i < n; i++) {
        float v = x[i];
        if (v != v) continue; /* NaN */
        if (filled < k) {
            heap_vals[filled] = v, idx[filled] = i;
            if (++filled == k)
                for (int j = k / 2 - 1; j >= 0; j--) sift_down(heap_vals, idx, k, j);
        } else if (v > heap_vals[0]) {
            heap_vals[0] = v, idx[0] = i;
            sift_down(heap_vals, idx, k, 0);
        }
    }
    return filled;
}
