# Included by simd/_kernels.pyx: the wrappers of the runtime helper kernels of the transformer (C in
# simd/ops/, see ops.h): fused residual add + RMSNorm + int8 activation quantization, the gated MLP
# activation, RoPE + KV-cache write + causal GQA attention, f16 embedding lookup. Thin wrappers: shapes
# checked here, the GIL released in C. Compiled into the kernels' extension so that the helpers share the
# kernels' ISA choice and worker pool; Python sees them as simd._ops (simd/_ops.py re-exports them).

cdef extern from "ops.h":
    void ops_add_rmsnorm_quant(float *x, const float *delta, const float *w, int m, int d, float eps, float *h,
                               int8_t *xq, int k_pad, float *act_scale, int32_t *act_sum) nogil
    void ops_add_rmsnorm(float *x, const float *delta, const float *w, int m, int d, float eps, float *out) nogil
    void ops_head_rmsnorm(float *x, int m, int ld, int col0, int heads, int hd, const float *w, float eps) nogil
    void ops_glu_rmsnorm_quant(float *gu, int m, int inter, int act, const float *w, float eps, int8_t *xq,
                               int k_pad, float *act_scale, int32_t *act_sum) nogil
    int ops_embed_f16(const uint16_t *table, int64_t vocab, int d, const int32_t *ids, int m, float *out) nogil
    int ops_topk(const float *x, int n, int k, float *heap_vals, int32_t *idx) nogil
    void ops_head_rescore(const uint16_t *table, int d, const float *x, int m, float *logits, int vocab, int k,
                          float *heap_vals, int32_t *idx) nogil
    int ops_attention(float *qkv, int m, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                       const float *rope_sin, int pos0, void *k_cache, void *v_cache, int kv_type, int n_ctx,
                       float *out, float *scratch, int scratch_rows) nogil
    int ops_attention_paged(float *qkv, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                             const float *rope_sin, int n_seqs, const int32_t *seq_rows, const int32_t *seq_pos0,
                             const int32_t *page_table, int max_pages, void *k_pool, void *v_pool, int kv_type,
                             float *out, float *scratch, int scratch_rows, int scratch_len) nogil
    int ops_attention_plan(const int32_t *ms, const int32_t *pos0s, int n_segs, int n_heads, int n_kv, int head_dim,
                           int threads, int32_t *out, int max_out) nogil
    void ops_set_attention_bf16(int on)
    int ops_get_attention_bf16()
    int ops_attention_bf16_vector()

cdef extern from "ops.h":
    int OPS_ATT_SCRATCH_ROWS
    int OPS_KT_BLOCK
    int OPS_KV_Q8
    int OPS_Q8_MAX_HD

ACT_RELU2 = 0
ATTENTION_SCRATCH_ROWS = OPS_ATT_SCRATCH_ROWS  # scratch rows per query head
KEY_BLOCK = OPS_KT_BLOCK                       # positions per transposed key block


def key_cache_shape(int n_kv, int n_ctx, int head_dim):
    """Shape of one layer's key cache: [n_kv, ceil(n_ctx / KEY_BLOCK), head_dim, KEY_BLOCK]."""
    return (n_kv, (n_ctx + OPS_KT_BLOCK - 1) // OPS_KT_BLOCK, head_dim, OPS_KT_BLOCK)
ACT_SILU = 1

ctypedef fused kv_t:
    float
    uint16_t


cdef _fail(str msg):
    raise KernelError("simd._ops." + msg)


cdef inline int _check_quant(str fn, int m, int d, int8_t[:, ::1] xq, float[::1] act_scale, int32_t[::1] act_sum) except -1:
    if xq.shape[0] < m or xq.shape[1] < d or xq.shape[1] % 64:
        _fail(f"{fn}: xq shape ({xq.shape[0]}, {xq.shape[1]}) cannot hold {m} rows of {d} (last dim: multiple of 64)")
    if act_scale.shape[0] < m or act_sum.shape[0] < m:
        _fail(f"{fn}: act_scale/act_sum hold fewer than {m} rows")
    return 0


def add_rmsnorm_quant(float[:, ::1] x, float[:, ::1] delta, const float[::1] w, float eps, float[:, ::1] h,
                      int8_t[:, ::1] xq, float[::1] act_scale, int32_t[::1] act_sum):
    """x += delta (skipped if delta is None); h = rmsnorm(x) * w; xq, act_scale, act_sum = quantize(h)."""
    cdef int m = x.shape[0], d = x.shape[1]
    if w.shape[0] != d or h.shape[0] != m or h.shape[1] != d:
        _fail(f"add_rmsnorm_quant: x {m}x{d}, w {w.shape[0]}, h {h.shape[0]}x{h.shape[1]} do not match")
    if delta is not None and (delta.shape[0] != m or delta.shape[1] != d):
        _fail("add_rmsnorm_quant: delta shape differs from x")
    _check_quant("add_rmsnorm_quant", m, d, xq, act_scale, act_sum)
    cdef float *dp = &delta[0, 0] if delta is not None else NULL
    with nogil:
        ops_add_rmsnorm_quant(&x[0, 0], dp, &w[0], m, d, eps, &h[0, 0], &xq[0, 0], xq.shape[1], &act_scale[0], &act_sum[0])


def add_rmsnorm(float[:, ::1] x, float[:, ::1] delta, const float[::1] w, float eps, float[:, ::1] out):
    """x += delta (skipped if delta is None); out = rmsnorm(x) * w."""
    cdef int m = x.shape[0], d = x.shape[1]
    if w.shape[0] != d or out.shape[0] != m or out.shape[1] != d:
        _fail("add_rmsnorm: shapes of x, w, out do not match")
    if delta is not None and (delta.shape[0] != m or delta.shape[1] != d):
        _fail("add_rmsnorm: delta shape differs from x")
    cdef float *dp = &delta[0, 0] if delta is not None else NULL
    with nogil:
        ops_add_rmsnorm(&x[0, 0], dp, &w[0], m, d, eps, &out[0, 0])


def head_rmsnorm(float[:, ::1] x, int col0, int heads, const float[::1] w, float eps):
    """In place: x[:, col0 + h*hd : col0 + (h+1)*hd] := rmsnorm(that run) * w for h < heads, hd = len(w) (Qwen3's
    q_norm / k_norm over the q or k part of [q | k | v] rows); the same floats as add_rmsnorm on a copy."""
    cdef int m = x.shape[0], ld = x.shape[1], hd = w.shape[0]
    if hd <= 0 or heads <= 0 or col0 < 0 or col0 + heads * hd > ld:
        _fail(f"head_rmsnorm: {heads} heads of {hd} from column {col0} do not fit rows of {ld}")
    with nogil:
        ops_head_rmsnorm(&x[0, 0], m, ld, col0, heads, hd, &w[0], eps)


def glu_rmsnorm_quant(float[:, ::1] gu, int act, const float[::1] w, float eps, int8_t[:, ::1] xq,
                      float[::1] act_scale, int32_t[::1] act_sum):
    """gu [m, 2I] = [gate | up] -> gate half := rmsnorm(act(gate) * up) * w, quantized into xq.
    w None: no norm (models without ffn_sub_norm), the gate half := act(gate) * up, quantized."""
    cdef int m = gu.shape[0], inter = gu.shape[1] // 2
    if gu.shape[1] != 2 * inter or (w is not None and w.shape[0] != inter) or act not in (0, 1):
        _fail(f"glu_rmsnorm_quant: gu width {gu.shape[1]}, w {None if w is None else w.shape[0]}, act {act} do not fit")
    _check_quant("glu_rmsnorm_quant", m, inter, xq, act_scale, act_sum)
    cdef const float *wp = NULL
    if w is not None:
        wp = &w[0]
    with nogil:
        ops_glu_rmsnorm_quant(&gu[0, 0], m, inter, act, wp, eps, &xq[0, 0], xq.shape[1], &act_scale[0], &act_sum[0])


def glu_rmsnorm(float[:, ::1] gu, int act, const float[::1] w, float eps):
    """glu_rmsnorm_quant without the quantization: the gate half := rmsnorm(act(gate) * up) * w (w None: no norm),
    for callers that quantize it themselves (per group: K.quantize_act_g128)."""
    cdef int m = gu.shape[0], inter = gu.shape[1] // 2
    if gu.shape[1] != 2 * inter or (w is not None and w.shape[0] != inter) or act not in (0, 1):
        _fail(f"glu_rmsnorm: gu width {gu.shape[1]}, w {None if w is None else w.shape[0]}, act {act} do not fit")
    cdef const float *wp = NULL
    if w is not None:
        wp = &w[0]
    with nogil:
        ops_glu_rmsnorm_quant(&gu[0, 0], m, inter, act, wp, eps, NULL, 0, NULL, NULL)


def embed_f16(const uint16_t[:, ::1] table, const int32_t[::1] ids, float[:, ::1] out):
    """out[i] = f32(table[ids[i]]) for a row-major f16 table (viewed as uint16)."""
    cdef int m = ids.shape[0]
    if out.shape[0] < m or out.shape[1] != table.shape[1]:
        _fail("embed_f16: out does not fit the ids / table width")
    cdef int bad
    with nogil:
        bad = ops_embed_f16(&table[0, 0], table.shape[0], table.shape[1], &ids[0], m, &out[0, 0])
    if bad >= 0:
        _fail(f"embed_f16: token id {ids[bad]} is outside the vocabulary (0..{table.shape[0] - 1})")


ATTENTION_PRECISIONS = ("f32", "bf16")


def set_attention_precision(str precision):
    """The products of prefill attention, process-wide: "f32" (the default: every row's bytes the same however the
    prompt is chunked, batched or decoded) or "bf16" (opt-in: a prompt chunk's q, k, softmax weights and v rounded
    to bf16 and multiplied in pairs, f32 sums; about twice the multiply-adds per instruction where the CPU has
    AVX512_BF16, attention_bf16_vector(); scalar elsewhere). Decode rows and the int8 cache are not affected."""
    if precision not in ATTENTION_PRECISIONS:
        _fail(f"attention precision must be one of {', '.join(ATTENTION_PRECISIONS)}, got {precision!r}")
    ops_set_attention_bf16(1 if precision == "bf16" else 0)


def attention_precision():
    """The precision of prefill attention in force ("f32" or "bf16"; set_attention_precision)."""
    return "bf16" if ops_get_attention_bf16() else "f32"


def attention_bf16_vector():
    """Whether bf16 prefill attention runs on vector units here (the avx512 path on a CPU with AVX512_BF16)."""
    return bool(ops_attention_bf16_vector())


def attention(float[:, ::1] qkv, int n_heads, int n_kv, int head_dim, const float[:, ::1] rope_cos,
              const float[:, ::1] rope_sin, int pos0, kv_t[:, :, :, ::1] k_cache, kv_t[:, :, ::1] v_cache,
              float[:, ::1] out, float[:, ::1] scratch):
    """RoPE on q, k of rows at pos0.., write k into this layer's key cache (key_cache_shape(): blocks of
    KEY_BLOCK positions, transposed) and v into the value cache [n_kv, n_ctx, head_dim] (float32 or float16-as-uint16), causal
    GQA attention into out [m, n_heads*head_dim]. scratch: [n_heads * ATTENTION_SCRATCH_ROWS, n_ctx]."""
    cdef int m = qkv.shape[0]
    cdef int n_ctx = v_cache.shape[1]
    cdef int q_dim = n_heads * head_dim
    if (n_heads < 1 or n_kv < 1 or n_heads % n_kv or head_dim < 2 or head_dim % 2
            or qkv.shape[1] != q_dim + 2 * n_kv * head_dim):
        _fail(f"attention: qkv width {qkv.shape[1]} does not fit {n_heads} heads / {n_kv} kv heads x {head_dim}")
    if (k_cache.shape[0] != n_kv or k_cache.shape[1] != (n_ctx + OPS_KT_BLOCK - 1) // OPS_KT_BLOCK
            or k_cache.shape[2] != head_dim or k_cache.shape[3] != OPS_KT_BLOCK
            or v_cache.shape[0] != n_kv or v_cache.shape[2] != head_dim):
        _fail("attention: caches are not k key_cache_shape(n_kv, n_ctx, head_dim) and v [n_kv, n_ctx, head_dim]")
    if pos0 < 0 or pos0 + m > n_ctx or rope_cos.shape[0] < pos0 + m or rope_cos.shape[1] != head_dim // 2 \
            or rope_sin.shape[0] != rope_cos.shape[0] or rope_sin.shape[1] != rope_cos.shape[1]:
        _fail(f"attention: positions {pos0}..{pos0 + m - 1} do not fit the cache ({n_ctx}) / rope tables")
    if (out.shape[0] < m or out.shape[1] != q_dim or scratch.shape[0] < OPS_ATT_SCRATCH_ROWS
            or scratch.shape[1] < n_ctx):
        _fail("attention: out or scratch too small")
    cdef int kv_f16 = 1 if kv_t is uint16_t else 0, rc
    with nogil:
        rc = ops_attention(&qkv[0, 0], m, n_heads, n_kv, head_dim, &rope_cos[0, 0], &rope_sin[0, 0], pos0,
                      <void *>&k_cache[0, 0, 0, 0], <void *>&v_cache[0, 0, 0], kv_f16, n_ctx, &out[0, 0], &scratch[0, 0],
                      scratch.shape[0])
    if rc:
        raise MemoryError("attention: no memory for the workspace of a long context's pieces")


def attention_plan(rows, pos0s, int n_heads, int n_kv, int head_dim, int threads):
    """How attention / attention_paged split their work on `threads` threads, for sequences of rows[i] rows at
    positions pos0s[i]..: (query heads per item, [(first row, rows, first position), ...] the runs of rows the
    items go over, in the order they are handed out; a prefill chunk may go in blocks of its rows)."""
    cdef int32_t[::1] ms = np.ascontiguousarray(rows, dtype=np.int32)
    cdef int32_t[::1] ps = np.ascontiguousarray(pos0s, dtype=np.int32)
    cdef int n = ms.shape[0], got
    if n < 1 or ps.shape[0] != n or min(rows) < 1 or min(pos0s) < 0:
        _fail("attention_plan: one row count (>= 1) and one first position (>= 0) per sequence")
    if n_heads < 1 or n_kv < 1 or n_heads % n_kv or head_dim < 2 or threads < 1:
        _fail(f"attention_plan: {n_heads} heads / {n_kv} kv heads x {head_dim} on {threads} threads")
    cdef int max_out = n + sum(int(m) // 16 for m in rows)
    cdef int32_t[::1] out = np.zeros(3 * max_out + 1, np.int32)
    with nogil:
        got = ops_attention_plan(&ms[0], &ps[0], n, n_heads, n_kv, head_dim, threads, &out[0], max_out)
    if got < 0:
        raise MemoryError("attention_plan: no memory")
    return int(out[3 * got]), [(int(out[3 * j]), int(out[3 * j + 1]), int(out[3 * j + 2])) for j in range(got)]


def attention_paged(float[:, ::1] qkv, int n_heads, int n_kv, int head_dim, const float[:, ::1] rope_cos,
                    const float[:, ::1] rope_sin, const int32_t[::1] seq_rows, const int32_t[::1] seq_pos0,
                    const int32_t[:, ::1] page_table, kv_t[:, :, :, ::1] k_pool, kv_t[:, :, :, ::1] v_pool,
                    float[:, ::1] out, float[:, ::1] scratch):
    """attention() for a batched step over the paged KV pool of one layer: sequence i owns rows
    seq_rows[i]:seq_rows[i+1] of qkv / out at positions seq_pos0[i].., its 32-position blocks in pages
    page_table[i] (k_pool [n_pages, n_kv, head_dim, 32], v_pool [n_pages, n_kv, 32, head_dim]).
    scratch [>= ATTENTION_SCRATCH_ROWS (per thread), >= every sequence's last position + 1]."""
    cdef int n_pages = k_pool.shape[0]
    if (k_pool.shape[1] != n_kv or k_pool.shape[2] != head_dim or k_pool.shape[3] != OPS_KT_BLOCK
            or v_pool.shape[0] != n_pages or v_pool.shape[1] != n_kv or v_pool.shape[2] != OPS_KT_BLOCK
            or v_pool.shape[3] != head_dim or n_pages < 1):
        _fail("attention_paged: pools are not k [n_pages, n_kv, head_dim, 32] and v [n_pages, n_kv, 32, head_dim]")
    _check_paged("attention_paged", qkv, n_heads, n_kv, head_dim, rope_cos, rope_sin, seq_rows, seq_pos0,
                 page_table, n_pages, out, scratch)
    cdef int kv_f16 = 1 if kv_t is uint16_t else 0, rc
    with nogil:
        rc = ops_attention_paged(&qkv[0, 0], n_heads, n_kv, head_dim, &rope_cos[0, 0], &rope_sin[0, 0],
                            seq_pos0.shape[0], &seq_rows[0], &seq_pos0[0], &page_table[0, 0], page_table.shape[1],
                            <void *>&k_pool[0, 0, 0, 0], <void *>&v_pool[0, 0, 0, 0], kv_f16, &out[0, 0],
                            &scratch[0, 0], scratch.shape[0], scratch.shape[1])
    if rc:
        raise MemoryError("attention_paged: no memory for the sequence table or the pieces' workspace")


cdef int _check_paged(str fn, float[:, ::1] qkv, int n_heads, int n_kv, int head_dim, const float[:, ::1] rope_cos,
                      const float[:, ::1] rope_sin, const int32_t[::1] seq_rows, const int32_t[::1] seq_pos0,
                      const int32_t[:, ::1] page_table, int n_pages, float[:, ::1] out,
                      float[:, ::1] scratch) except -1:
    """The checks the paged attention wrappers share (everything but the pools' own shapes)."""
    cdef int m = qkv.shape[0], n = seq_pos0.shape[0], q_dim = n_heads * head_dim
    cdef int max_pages = page_table.shape[1], i, b, r0, r1, last
    if (n_heads < 1 or n_kv < 1 or n_heads % n_kv or head_dim < 2 or head_dim % 2
            or qkv.shape[1] != q_dim + 2 * n_kv * head_dim):
        _fail(f"{fn}: qkv width {qkv.shape[1]} does not fit {n_heads} heads / {n_kv} kv heads x {head_dim}")
    if seq_rows.shape[0] != n + 1 or page_table.shape[0] < n or n < 1:
        _fail(f"{fn}: seq_rows has {seq_rows.shape[0]} entries, page_table {page_table.shape[0]} rows "
              f"for {n} sequences")
    if (out.shape[0] < m or out.shape[1] != q_dim or scratch.shape[0] < OPS_ATT_SCRATCH_ROWS
            or rope_cos.shape[1] != head_dim // 2 or rope_sin.shape[0] != rope_cos.shape[0]
            or rope_sin.shape[1] != rope_cos.shape[1]):
        _fail(f"{fn}: out, scratch or rope tables do not fit")
    if seq_rows[0] < 0 or seq_rows[n] > m:
        _fail(f"{fn}: seq_rows span {seq_rows[0]}..{seq_rows[n]} outside the {m} rows of qkv")
    for i in range(n):
        r0, r1 = seq_rows[i], seq_rows[i + 1]
        if r1 < r0:
            _fail(f"{fn}: seq_rows is not non-decreasing at sequence {i}")
        if r1 == r0:
            continue
        last = seq_pos0[i] + (r1 - r0) - 1
        if (seq_pos0[i] < 0 or last >= max_pages * OPS_KT_BLOCK or last >= rope_cos.shape[0]
                or last >= scratch.shape[1]):
            _fail(f"{fn}: sequence {i} positions {seq_pos0[i]}..{last} do not fit its page table, "
                  "rope tables or scratch")
        for b in range(last // OPS_KT_BLOCK + 1):
            if page_table[i, b] < 0 or page_table[i, b] >= n_pages:
                _fail(f"{fn}: sequence {i} block {b} is page {page_table[i, b]} (pool has {n_pages})")
    return 0


Q8_MAX_HEAD_DIM = OPS_Q8_MAX_HD


cdef int _check_q8_head_dim(str fn, int head_dim) except -1:
    if head_dim <= 0 or head_dim % 4 or head_dim > OPS_Q8_MAX_HD:
        _fail(f"{fn}: head_dim {head_dim}: an int8 KV cache needs a multiple of 4 up to {OPS_Q8_MAX_HD}")
    return 0


def q8_block_bytes(int head_dim):
    """Bytes of one int8 block of KEY_BLOCK positions of one KV head: the values, then one f32 scale per position."""
    return OPS_KT_BLOCK * head_dim + OPS_KT_BLOCK * 4


def q8_cache_shape(int n_kv, int n_ctx, int head_dim):
    """Shape (int8) of one layer's key or value cache with int8 K/V: [n_kv, ceil(n_ctx / KEY_BLOCK), q8_block_bytes]."""
    return (n_kv, (n_ctx + OPS_KT_BLOCK - 1) // OPS_KT_BLOCK, q8_block_bytes(head_dim))


def paged_q8_pool_shape(int n_pages, int n_kv, int head_dim):
    """Shape (int8) of one layer's paged key or value pool with int8 K/V: [n_pages, n_kv, q8_block_bytes]."""
    return (n_pages, n_kv, q8_block_bytes(head_dim))


def attention_q8(float[:, ::1] qkv, int n_heads, int n_kv, int head_dim, const float[:, ::1] rope_cos,
                 const float[:, ::1] rope_sin, int pos0, int n_ctx, int8_t[:, :, ::1] k_cache,
                 int8_t[:, :, ::1] v_cache, float[:, ::1] out, float[:, ::1] scratch):
    """attention() over an int8 cache: k_cache and v_cache q8_cache_shape(n_kv, n_ctx, head_dim) (keys transposed
    in each block, values row by row, one f32 scale per position per KV head after each block's values)."""
    cdef int m = qkv.shape[0], q_dim = n_heads * head_dim
    if (n_heads < 1 or n_kv < 1 or n_heads % n_kv or head_dim < 2 or head_dim % 2
            or qkv.shape[1] != q_dim + 2 * n_kv * head_dim):
        _fail(f"attention_q8: qkv width {qkv.shape[1]} does not fit {n_heads} heads / {n_kv} kv heads x {head_dim}")
    _check_q8_head_dim("attention_q8", head_dim)
    shape = q8_cache_shape(n_kv, n_ctx, head_dim)
    if (n_ctx < 1 or (k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]) != shape
            or (v_cache.shape[0], v_cache.shape[1], v_cache.shape[2]) != shape):
        _fail(f"attention_q8: caches are not q8_cache_shape(n_kv, n_ctx, head_dim) = {shape}")
    if pos0 < 0 or pos0 + m > n_ctx or rope_cos.shape[0] < pos0 + m or rope_cos.shape[1] != head_dim // 2 \
            or rope_sin.shape[0] != rope_cos.shape[0] or rope_sin.shape[1] != rope_cos.shape[1]:
        _fail(f"attention_q8: positions {pos0}..{pos0 + m - 1} do not fit the cache ({n_ctx}) / rope tables")
    if (out.shape[0] < m or out.shape[1] != q_dim or scratch.shape[0] < OPS_ATT_SCRATCH_ROWS
            or scratch.shape[1] < n_ctx):
        _fail("attention_q8: out or scratch too small")
    cdef int rc
    with nogil:
        rc = ops_attention(&qkv[0, 0], m, n_heads, n_kv, head_dim, &rope_cos[0, 0], &rope_sin[0, 0], pos0,
                           <void *>&k_cache[0, 0, 0], <void *>&v_cache[0, 0, 0], OPS_KV_Q8, n_ctx, &out[0, 0],
                           &scratch[0, 0], scratch.shape[0])
    if rc:
        raise MemoryError("attention_q8: no memory for the workspace of a long context's pieces")


def attention_paged_q8(float[:, ::1] qkv, int n_heads, int n_kv, int head_dim, const float[:, ::1] rope_cos,
                       const float[:, ::1] rope_sin, const int32_t[::1] seq_rows, const int32_t[::1] seq_pos0,
                       const int32_t[:, ::1] page_table, int8_t[:, :, ::1] k_pool, int8_t[:, :, ::1] v_pool,
                       float[:, ::1] out, float[:, ::1] scratch):
    """attention_paged() over int8 pools: k_pool and v_pool paged_q8_pool_shape(n_pages, n_kv, head_dim)."""
    cdef int n_pages = k_pool.shape[0]
    _check_q8_head_dim("attention_paged_q8", head_dim)
    shape = paged_q8_pool_shape(n_pages, n_kv, head_dim)
    if (n_pages < 1 or (k_pool.shape[0], k_pool.shape[1], k_pool.shape[2]) != shape
            or (v_pool.shape[0], v_pool.shape[1], v_pool.shape[2]) != shape):
        _fail(f"attention_paged_q8: pools are not paged_q8_pool_shape(n_pages, n_kv, head_dim) = {shape}")
    _check_paged("attention_paged_q8", qkv, n_heads, n_kv, head_dim, rope_cos, rope_sin, seq_rows, seq_pos0,
                 page_table, n_pages, out, scratch)
    cdef int rc
    with nogil:
        rc = ops_attention_paged(&qkv[0, 0], n_heads, n_kv, head_dim, &rope_cos[0, 0], &rope_sin[0, 0],
                            seq_pos0.shape[0], &seq_rows[0], &seq_pos0[0], &page_table[0, 0], page_table.shape[1],
                            <void *>&k_pool[0, 0, 0], <void *>&v_pool[0, 0, 0], OPS_KV_Q8, &out[0, 0],
                            &scratch[0, 0], scratch.shape[0], scratch.shape[1])
    if rc:
        raise MemoryError("attention_paged_q8: no memory for the sequence table or the pieces' workspace")


def paged_key_pool_shape(int n_pages, int n_kv, int head_dim):
    """Shape of one layer's paged key pool: [n_pages, n_kv, head_dim, KEY_BLOCK] (a page = KEY_BLOCK positions)."""
    return (n_pages, n_kv, head_dim, OPS_KT_BLOCK)


def paged_value_pool_shape(int n_pages, int n_kv, int head_dim):
    return (n_pages, n_kv, OPS_KT_BLOCK, head_dim)


def head_rescore(const uint16_t[:, ::1] table, const float[:, ::1] x, float[:, ::1] logits,
                 float[:, ::1] heap_vals, int32_t[:, ::1] idx):
    """For each of the x.shape[0] rows: the idx.shape[1] largest logits of that row are replaced by the f16
    head's exact logits table[i] . x[row] (gemv_f16's float, bit for bit); their indices go to idx[row]
    (unordered, -1 past the number of non-NaN logits). table f16 [vocab, d] as uint16, logits [>= m, vocab],
    heap_vals [>= m, >= k] scratch."""
    cdef int m = x.shape[0], d = x.shape[1], vocab = logits.shape[1], k = idx.shape[1]
    if m < 1 or d < 1 or k < 1:
        _fail(f"head_rescore: empty x ({m} x {d}) or k {k}")
    if table.shape[1] != d:
        _fail(f"head_rescore: table rows have {table.shape[1]} values, x has {d}")
    if table.shape[0] < vocab:
        _fail(f"head_rescore: {vocab} logits per row but the table has {table.shape[0]} rows")
    if logits.shape[0] < m or idx.shape[0] < m or heap_vals.shape[0] < m or heap_vals.shape[1] < k:
        _fail(f"head_rescore: logits ({logits.shape[0]}, {logits.shape[1]}), idx ({idx.shape[0]}, {idx.shape[1]}) "
              f"or heap_vals ({heap_vals.shape[0]}, {heap_vals.shape[1]}) do not cover {m} rows of k = {k}")
    if heap_vals.shape[1] != k:
        _fail(f"head_rescore: heap_vals rows hold {heap_vals.shape[1]} values, idx rows {k}")
    with nogil:
        ops_head_rescore(&table[0, 0], d, &x[0, 0], m, &logits[0, 0], vocab, k, &heap_vals[0, 0], &idx[0, 0])


def topk(const float[::1] x, float[::1] heap_vals, int32_t[::1] idx):
    """Indices of the len(idx) largest values of x (unordered) into idx; returns how many were found."""
    cdef int k = idx.shape[0]
    if heap_vals.shape[0] < k or k < 1:
        _fail(f"topk: need 1 <= k ({k}) <= len(heap_vals) ({heap_vals.shape[0]})")
    cdef int got
    with nogil:
        got = ops_topk(&x[0], x.shape[0], k, &heap_vals[0], &idx[0])
    return got
