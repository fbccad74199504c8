"""The BitNet b1.58 transformer over a weight store (the math of transformers' BitNetForCausalLM), with a preallocated KV cache.

Per layer (D hidden, q_dim = heads * head_dim, I intermediate):
    h  = rmsnorm(x) -> int8            ops.add_rmsnorm_quant (adds the previous layer's residual first)
    qkv = BL_qkv(h)                    one fused ternary GEMV/GEMM: rows q | k | v
    a  = attention(rope(q), rope(k), v) over the cache      ops.attention (also writes k, v to the cache)
    a  = rmsnorm(a, attn_sub_norm) -> int8                  ops.add_rmsnorm_quant (no sub-norms: quantize_act)
    x += BL_o(a)                       (the add happens inside the next add_rmsnorm_quant)
    h  = rmsnorm(x, ffn_norm) -> int8
    gu = BL_gate_up(h)                 one fused ternary GEMV/GEMM: rows gate | up
    f  = rmsnorm(relu(g)^2 * u, ffn_sub_norm) -> int8       ops.glu_rmsnorm_quant (silu(g) * u for "silu";
                                                            no rmsnorm when config.sub_norms is False)
    x += BL_down(f)
logits = lm_head(rmsnorm(x, output_norm))   f16 GEMV, or int8 / q4g GEMV on the quantized normed x (q4g: its
                                            RESCORE_K best recomputed exactly from f16 rows)

Nine C calls per layer in a decode step, each on buffers allocated once in __init__ (`out=` style): nothing
is allocated per token. Prefill runs the prompt in chunks of `chunk` rows through gemm_ternary; decode
uses gemv_ternary. The residual stream and the MLP intermediate stay f32; the KV cache is f16 by default.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

import numpy as np

from ...simd import _kernels as K
from ...simd import _ops as ops

from ..config import ModelConfig
from ..errors import BitNetError, ContextOverflowError, FormatError
from ..memory import available_memory
from .thread_tuner import ThreadTuner
from ...simd.layout import K_ALIGN, Q4G_GROUP, Q4G_MAX_K, TG_GROUP, head_kind, pad_to, tg128_bytes, tile16b3_bytes

DEFAULT_CHUNK = 128  # prefill rows per GEMM call (measured: 32..256 within 4%, 128 best)
# Chunks of at most this many rows use the multi-row GEMV (one sequential weight stream) instead of the GEMM,
# per kernel path. Time per call / one 1-row GEMV, out-of-cache 13824x2560, multi-row vs GEMM, same run
# (python bench/bench_rows.py):
#   avx512 (16-core Xeon, 2 and 16 threads): M=2 1.28-1.38 vs 1.41-1.56, M=3 1.43-1.61 vs 2.33-2.84,
#          M=4 1.54-1.70 vs 1.66-1.95, M=8 2.43-2.61 vs 2.36-2.91 (mixed: not used)
#   avx2 (2-core EPYC, and the Xeon forced to avx2; 2 threads): M=2 1.57-1.93 vs 1.19-1.50, M=4 2.75-4.79 vs
#          2.36-3.11: the GEMM wins at every M, so never. avxvnni (AVX2-width) unmeasured: as avx2.
#   avx512 (2-core Zen 5, 2 threads, after the GEMM began to warm its weight chunks; 2026-11-28): M=2 1.34-1.44
#          vs 1.95-2.09, 4 1.83-1.98 vs 2.18-2.32, 5 2.20-2.31 vs 3.33-3.57, 6 2.65-2.76 vs 3.35-3.47, 7 3.83-3.96
#          vs 4.51-4.60, 8 4.51-4.87 vs 3.26-3.33: the multi-row GEMV up to 7 rows.
#   avx512 (the same machine, later that day: the GEMM reads its weights a pair of tiles ahead and takes the last
#          1-7 rows in one group): M=2 1.40-1.49 vs 1.48-1.58, 3 1.54-1.63 vs 1.73-1.86, 4 1.64-1.74 vs
#          2.00-2.17, 5 1.91-2.01 vs 2.43-2.61, 6 2.09-2.27 vs 2.81-3.26, 7 2.60-2.78 vs 3.85-4.12: the GEMM from 2
#          rows. (The 16-core Xeon figures above predate both GEMM changes.)
ROWS_GEMV_MAX = {"avx512": 1, "amx": 1}   # amx: below the tiles' 16 rows, the avx512 bodies
VERIFY_MAX = K.ROWS_MAX  # most rows of one Model.verify pass (the multi-row head kernel's limit)
# The q4 head ranks every token with half the int8 head's bytes; its RESCORE_K best get the f16 head's exact
# logits (ops.head_rescore). Greedy agreement with the f16 head over 10,000 positions each, same run
# (python bench/head_quality.py; bundled model / two random models): the q4 head alone 96.4 / 86.1 / 84.4%,
# 4 rescored 99.89 / 99.69 / 99.44%, 16 or 64 rescored 100% everywhere (int8 head: 99.66 / 98.28 / 97.82%).
# The tail keeps the q4 values: mean KL(f16 || head) on the bundled model 1.2e-4 at 16, 4.5e-5 at 64 (int8
# 1.2e-5). Cost: a top-k pass over the logits and RESCORE_K f16 rows (~0.3 MB) per token.
RESCORE_K = 64


# The int8 LM head over 2..ROWS_MAX rows: the multi-row GEMV (one pass over the head) or the GEMM, per kernel path.
# 128256x2560, time / one GEMV, multi-row vs GEMM: avx512 16 threads (16-core Xeon) M=2 1.06-1.09 vs 1.12-1.15,
# M=4 1.25 vs 1.32-1.37; avx2 2 threads M=2 1.08-1.28 vs 1.16-1.31, M=8 2.49-2.66 vs 2.55-2.84; avx512 2 threads
# (2-core Zen 5, 2026-11-28, after the GEMM began to read its weights a tile ahead: bench/bench_rows.py) M=2 1.03 vs
# 1.01, 4 1.21 vs 1.05, 8 1.54-1.58 vs 1.09: the GEMM there (the Xeon's figures predate that change).
I8_HEAD_GEMM = ("avx512", "amx")   # amx: its tile head from 16 rows, the avx512 GEMM below


def i8_head_rows(m: int):
    """The int8-head kernel for an m-row pass on the kernel path in use: the multi-row GEMV takes at most ROWS_MAX
    rows, the GEMM any count."""
    return K.gemm_i8 if m > K.ROWS_MAX or K.active() in I8_HEAD_GEMM else K.gemv_rows_i8


def ternary_matmul(m: int, b3: bool = False):
    """The ternary kernel for an m-row pass (m >= 2) on the kernel path in use; b3: weights in the base-3
    tile16b3 layout (--weights t1.6)."""
    if m <= ROWS_GEMV_MAX.get(K.active(), 0):
        return K.gemv_rows_ternary_b3 if b3 else K.gemv_rows_ternary
    return K.gemm_ternary_b3 if b3 else K.gemm_ternary


KV_DTYPES = ("f16", "f32", "q8")   # KV cache element types (--kv); q8: int8 with a scale per position per KV head


def check_kv_dtype(kv_dtype: str):
    if kv_dtype not in KV_DTYPES:
        raise BitNetError(f"kv_dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """Bytes of K and V one position holds over all layers (q8: int8 values + a 4-byte scale per KV head)."""
    per_head = {"f16": 2 * cfg.head_dim, "f32": 4 * cfg.head_dim, "q8": cfg.head_dim + 4}[kv_dtype]
    return 2 * cfg.n_layers * cfg.n_kv_heads * per_head


def session_bytes(cfg: ModelConfig, n_ctx: int, kv_dtype: str, chunk: int = DEFAULT_CHUNK) -> int:
    """Bytes Model() allocates for a session: the KV cache, attention scratch, RoPE tables, per-chunk buffers."""
    blocks = -(-n_ctx // ops.KEY_BLOCK) * ops.KEY_BLOCK
    if kv_dtype == "q8":   # keys and values in int8 blocks, a 4-byte scale per position per KV head
        kv = 2 * cfg.n_layers * cfg.n_kv_heads * (blocks // ops.KEY_BLOCK) * ops.q8_block_bytes(cfg.head_dim)
    else:
        kv = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (blocks + n_ctx) * (2 if kv_dtype == "f16" else 4)
    scratch = cfg.n_heads * ops.ATTENTION_SCRATCH_ROWS * n_ctx * 4
    rope = 2 * n_ctx * (cfg.head_dim // 2) * 4 + n_ctx * 4 * 2
    rows = chunk * ((4 * cfg.hidden_size + 2 * cfg.q_dim + 2 * cfg.kv_dim + 2 * cfg.intermediate_size) * 4
                    + 8 * RESCORE_K)
    return kv + scratch + rope + rows + cfg.vocab_size * 4


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _expect(store, name: str, dtype, size: int) -> np.ndarray:
    """The flat view of tensor `name`, which must have `dtype` (or one of a tuple) and exactly `size` values."""
    a = store.tensor(name)
    ok = a.dtype in (dtype if isinstance(dtype, tuple) else (dtype,))
    if not ok or a.size != size or not a.flags.c_contiguous:
        raise FormatError(f"{store.path}: tensor {name} has dtype {a.dtype} / {a.size} values (expected "
                          f"{np.dtype(dtype[0] if isinstance(dtype, tuple) else dtype)} / {size})")
    return a.reshape(-1)


_PRECISION_LOCK = threading.Lock()


@contextlib.contextmanager
def decode_rows_attention():
    """Attention with f32 products for a pass of several rows that decodes (a verify pass: the last sampled token
    and a draft, prompt lookup's or a grammar's forced tokens) while bf16 prefill attention is on: bf16 is for
    prompt rows, and a draft's rows must give decode()'s bits or drafting would change the output. The setting is
    process-wide: it is switched back after the pass."""
    if ops.attention_precision() != "bf16":
        yield
        return
    with _PRECISION_LOCK:
        ops.set_attention_precision("f32")
        try:
            yield
        finally:
            ops.set_attention_precision("bf16")


class _Layer:
    """Read-only views of one block's weights in the store."""

    __slots__ = ("attn_norm", "qkv", "qkv_scale", "attn_sub_norm", "o", "o_scale", "ffn_norm", "gate_up",
                 "gate_up_scale", "ffn_sub_norm", "down", "down_scale", "q_norm", "k_norm", "b3")

    def __init__(self, store, i: int, cfg: ModelConfig):
        def t(name, dtype, size=None):
            full = f"blk.{i}.{name}"
            a = store.tensor(full)
            if a.dtype != dtype or (size is not None and a.size != size) or not a.flags.c_contiguous:
                raise FormatError(f"{store.path}: tensor {full} has dtype {a.dtype} / {a.size} values "
                                  f"(expected {np.dtype(dtype)}{'' if size is None else f' / {size}'})")
            return a.reshape(-1)

        def ternary(name, rows, cols):
            info = store.info(f"blk.{i}.{name}")
            if cfg.weight_groups:   # tg128: the group scales live inside the packed tensor
                if info.get("layout") != "tg128" or info.get("rows", rows) != rows or info.get("cols", cols) != cols:
                    raise FormatError(f"{store.path}: blk.{i}.{name} is {info.get('rows')}x{info.get('cols')} "
                                      f"{info.get('layout')} (expected {rows}x{cols} tg128)")
                return t(name, np.uint8, tg128_bytes(rows, cols)), None
            lay = info.get("layout", "tile16")
            if lay not in ("tile16", "tile16b3") or info.get("rows", rows) != rows or info.get("cols", cols) != cols:
                raise FormatError(f"{store.path}: blk.{i}.{name} is {info.get('rows')}x{info.get('cols')} "
                                  f"{info.get('layout')} (expected {rows}x{cols} tile16 or tile16b3)")
            layouts.add(lay)
            w = t(name, np.uint8, tile16b3_bytes(rows, cols) if lay == "tile16b3"
                  else pad_to(rows, 16) * pad_to(cols, K_ALIGN) // 4)
            s = t(name + ".scale", np.float32)
            if s.size < rows:
                raise FormatError(f"{store.path}: blk.{i}.{name}.scale has {s.size} values for {rows} rows")
            return w, s

        layouts: set[str] = set()
        D, Q, KV, I = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
        self.attn_norm = t("attn_norm", np.float32, D)
        self.qkv, self.qkv_scale = ternary("attn_qkv", Q + 2 * KV, D)
        # Llama-architecture models have no sub-norms: None makes the op sequence quantize without a norm
        self.attn_sub_norm = t("attn_sub_norm", np.float32, Q) if cfg.sub_norms else None
        self.o, self.o_scale = ternary("attn_output", D, Q)
        self.ffn_norm = t("ffn_norm", np.float32, D)
        self.gate_up, self.gate_up_scale = ternary("ffn_gate_up", 2 * I, D)
        self.ffn_sub_norm = t("ffn_sub_norm", np.float32, I) if cfg.sub_norms else None
        self.down, self.down_scale = ternary("ffn_down", D, I)
        self.q_norm = t("attn_q_norm", np.float32, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = t("attn_k_norm", np.float32, cfg.head_dim) if cfg.qk_norm else None
        if len(layouts) > 1:
            raise FormatError(f"{store.path}: layer {i} mixes the ternary layouts {sorted(layouts)}")
        self.b3 = layouts == {"tile16b3"}


def rope_tables(cfg: ModelConfig, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n_ctx, head_dim/2] f32, computed as transformers does (f32 inv_freq, f32 position * inv_freq).
    LongRoPE (config.rope_factors, MiniCPM's modeling order): position * (1 / factor) first, then * inv_freq;
    both tables multiplied by config.rope_attn_factor. Plain RoPE models get exactly the tables they always had."""
    hd = cfg.head_dim
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))).astype(np.float32)
    pos = np.arange(n_ctx, dtype=np.float32)[:, None]
    if cfg.rope_factors:
        freqs = (pos * (np.float32(1.0) / np.asarray(cfg.rope_factors, np.float32))[None, :]) * inv_freq[None, :]
    else:
        freqs = pos * inv_freq[None, :]
    cos, sin = np.cos(freqs), np.sin(freqs)
    if cfg.rope_attn_factor != 1.0:
        cos, sin = cos * np.float32(cfg.rope_attn_factor), sin * np.float32(cfg.rope_attn_factor)
    return np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32)


class Weights:
    """Every weight of the model as read-only views into the store (shared by Model and the batching engine)."""

    def __init__(self, store):
        cfg: ModelConfig = store.config
        D, V = cfg.hidden_size, cfg.vocab_size
        if cfg.head_dim % 2:
            raise FormatError(f"{store.path}: head_dim {cfg.head_dim} is odd (RoPE needs pairs)")
        self.act = ops.ACT_RELU2 if cfg.hidden_act == "relu2" else ops.ACT_SILU
        self.eps = float(cfg.rms_norm_eps)
        self.groups = cfg.weight_groups       # 128: tg128 weights, activations quantized per group (run_layers_tg)
        self.heads = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)

        # ---- weights (zero-copy views) ----
        emb = store.tensor("token_embd")
        if emb.dtype != np.float16 or emb.shape != (V, D):
            raise FormatError(f"{store.path}: token_embd is {emb.dtype} {emb.shape} (expected float16 {(V, D)})")
        self.embd = emb.view(np.uint16)
        self.out_norm = _expect(store, "output_norm", np.float32, D)
        info = store.info("output")
        self.lm_head = head_kind(info.get("layout"))
        self.out_w = store.tensor("output").reshape(-1)
        v_pad = pad_to(V, 16)
        self.rescore = None   # f16 rows [V, D] the q4 head's best RESCORE_K candidates are recomputed from
        if self.lm_head == "q4":   # sizes as the kernel needs them: a damaged file is refused here, not in it
            k_pad = pad_to(D, K_ALIGN)
            if k_pad > Q4G_MAX_K:
                raise FormatError(f"{store.path}: the q4 lm head of hidden size {D} is beyond the q4 kernel's "
                                  f"{Q4G_MAX_K} columns (not written by `bitnet convert`)")
            self.out_w = _expect(store, "output", np.uint8, v_pad * k_pad // 2)
            self.out_gscale = _expect(store, "output.gscale", np.uint8, v_pad * k_pad // Q4G_GROUP)
            self.out_scale = _expect(store, "output.scale", np.float32, v_pad)
            if "output.rows" in store.tensor_names:
                self.rescore = _expect(store, "output.rows", (np.float16, np.uint16), V * D).view(np.uint16).reshape(V, D)
            elif cfg.tie_word_embeddings:
                self.rescore = self.embd
        elif self.lm_head == "i8":   # the kernels' preconditions, checked here so a bad file is not an engine bug
            self.out_w = _expect(store, "output", np.int8, v_pad * pad_to(D, K_ALIGN))
            self.out_scale = _expect(store, "output.scale", np.float32, v_pad)
            self.out_rowsum = _expect(store, "output.rowsum", np.int32, v_pad)
        elif info.get("layout", "f16_tile16") != "f16_tile16":
            raise FormatError(f"{store.path}: lm head layout {info.get('layout')!r} is not supported")
        else:
            self.out_w = _expect(store, "output", (np.float16, np.uint16), v_pad * D).view(np.uint16)
        self.layers = [_Layer(store, i, cfg) for i in range(cfg.n_layers)]
        # base-3 ternary weights (--weights t1.6): the same results through the b3 kernels; one layout per model
        self.b3 = bool(self.layers) and self.layers[0].b3
        if any(L.b3 != self.b3 for L in self.layers):
            raise FormatError(f"{store.path}: the layers mix the ternary layouts tile16 and tile16b3")

    def q4_logits(self, xq, act_scale, h, out, heap, idx):
        """The q4 head for the rows of xq (one call: the kernel runs them in one pass on the matrix tiles, or up
        to 64 per pass of the vector bodies), then its RESCORE_K best per row recomputed from the f16 rows with h
        (the normed rows before quantization); heap / idx: [>= m, RESCORE_K] scratch, idx left holding each row's
        candidates."""
        m = xq.shape[0]
        K.gemv_q4g(self.out_w, self.out_gscale, self.out_scale, xq, act_scale[:m], out[:m])
        if self.rescore is not None:
            ops.head_rescore(self.rescore, h, out, heap[:m], idx[:m])


def alloc_run_state(b, cfg: ModelConfig, M: int):
    """The per-step buffers of M rows (set as attributes of b; _Views cuts them to m rows)."""
    D, Q, KV, I = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    b._kp_d, b._kp_q, b._kp_i = pad_to(D, K_ALIGN), pad_to(Q, K_ALIGN), pad_to(I, K_ALIGN)
    b._x = np.zeros((M, D), np.float32)         # residual stream
    b._delta = np.zeros((M, D), np.float32)     # output of o_proj / down_proj, added lazily to x
    b._h_d = np.zeros((M, D), np.float32)       # normed x (f32 copy of what gets quantized)
    b._h_q = np.zeros((M, Q), np.float32)       # normed attention output
    b._qkv = np.zeros((M, Q + 2 * KV), np.float32)  # q | k | v
    b._att = np.zeros((M, Q), np.float32)       # attention output (before attn_sub_norm)
    b._gu = np.zeros((M, 2 * I), np.float32)    # gate | up; gate half becomes the normed MLP act
    b._xq_buf = np.zeros(M * max(b._kp_d, b._kp_q, b._kp_i), np.int8)  # quantized activations
    b._act_scale = np.zeros(M, np.float32)
    b._act_sum = np.zeros(M, np.int32)
    b._ids = np.zeros(M, np.int32)
    # per-group activation scales / sums (weight_groups models)
    g = max(b._kp_d, b._kp_q, b._kp_i) // TG_GROUP if cfg.weight_groups else 0
    b._xd = np.zeros(M * g, np.float32)
    b._xsum = np.zeros(M * g, np.int32)


class _Views:
    """The session buffers cut to `m` rows (2-D views; the kernels take the row count from them)."""

    def __init__(self, b: "Model", m: int):
        self.m = m
        self.x, self.delta, self.h_d = b._x[:m], b._delta[:m], b._h_d[:m]
        self.h_q, self.qkv, self.att, self.gu = b._h_q[:m], b._qkv[:m], b._att[:m], b._gu[:m]
        self.xq_d = b._xq_buf[: m * b._kp_d].reshape(m, b._kp_d)
        self.xq_q = b._xq_buf[: m * b._kp_q].reshape(m, b._kp_q)
        self.xq_i = b._xq_buf[: m * b._kp_i].reshape(m, b._kp_i)
        self.act_scale, self.act_sum = b._act_scale[:m], b._act_sum[:m]
        self.ids = b._ids[:m]
        if b._xd.size:
            self.gd = tuple((b._xd[: m * kp // TG_GROUP].reshape(m, -1), b._xsum[: m * kp // TG_GROUP].reshape(m, -1))
                            for kp in (b._kp_d, b._kp_q, b._kp_i))
        # 1-row forms for the GEMV path
        self.xq_d1, self.xq_q1, self.xq_i1 = self.xq_d[0], self.xq_q[0], self.xq_i[0]
        self.qkv1, self.delta1, self.gu1 = self.qkv[0], self.delta[0], self.gu[0]


def run_layers(w: Weights, v: _Views, attend, gemm=K.gemm_ternary):
    """All layers for the v.m rows of v (ids already embedded into v.x): the model's one per-layer op sequence,
    shared by Model (contiguous KV cache) and the batching engine (paged KV cache), which differ only in
    attend(li, qkv, att): RoPE + KV write + attention of layer li. One row runs through gemv_ternary on the
    1-row operands, more rows through `gemm` (gemm_ternary, or gemv_rows_ternary for a few rows).
    Models without sub-norms (Llama architecture) quantize the attention output directly."""
    if w.groups:
        return run_layers_tg(w, v, attend)
    eps, act = w.eps, w.act
    x, delta, h_d, h_q, qkv, att, gu = v.x, v.delta, v.h_d, v.h_q, v.qkv, v.att, v.gu
    xq_d, xq_q, xq_i, s, sm = v.xq_d, v.xq_q, v.xq_i, v.act_scale, v.act_sum
    add_norm_q, glu, quant = ops.add_rmsnorm_quant, ops.glu_rmsnorm_quant, K.quantize_act
    one = v.m == 1  # one row: gemv_ternary on the 1-row operands, with act scale / sum as scalars
    mm = (K.gemv_ternary_b3 if w.b3 else K.gemv_ternary) if one else gemm
    a_d, a_q, a_i, o_qkv, o_delta, o_gu = ((v.xq_d1, v.xq_q1, v.xq_i1, v.qkv1, v.delta1, v.gu1) if one
                                           else (xq_d, xq_q, xq_i, qkv, delta, gu))
    residual = None  # layer 0: x is the embedding, nothing to add yet
    for li, L in enumerate(w.layers):
        add_norm_q(x, residual, L.attn_norm, eps, h_d, xq_d, s, sm)
        mm(L.qkv, L.qkv_scale, a_d, s[0] if one else s, sm[0] if one else sm, o_qkv)
        attend(li, qkv, att)
        if L.attn_sub_norm is not None:
            add_norm_q(att, None, L.attn_sub_norm, eps, h_q, xq_q, s, sm)
        else:
            quant(att, xq_q, s, sm)
        mm(L.o, L.o_scale, a_q, s[0] if one else s, sm[0] if one else sm, o_delta)
        add_norm_q(x, delta, L.ffn_norm, eps, h_d, xq_d, s, sm)
        mm(L.gate_up, L.gate_up_scale, a_d, s[0] if one else s, sm[0] if one else sm, o_gu)
        glu(gu, act, L.ffn_sub_norm, eps, xq_i, s, sm)
        mm(L.down, L.down_scale, a_i, s[0] if one else s, sm[0] if one else sm, o_delta)
        residual = delta


def _qk_norm(w: Weights, v: _Views, L):
    """Qwen3's per-head RMSNorm of q and k (before RoPE), in place in v.qkv."""
    nh, nkv, hd = w.heads
    ops.head_rmsnorm(v.qkv, 0, nh, L.q_norm, w.eps)
    ops.head_rmsnorm(v.qkv, nh * hd, nkv, L.k_norm, w.eps)


def run_layers_tg(w: Weights, v: _Views, attend):
    """run_layers for group-scaled (tg128) weights: every matrix product quantizes its input per group of 128
    columns (K.quantize_act_g128) and runs K.gemv_tg on any number of rows; q/k norms where the model has them.
    The fused norm ops still write the f32 rows (h_d, h_q, the gate half of gu) that get quantized here."""
    eps, act = w.eps, w.act
    x, delta, h_d, h_q, qkv, att, gu = v.x, v.delta, v.h_d, v.h_q, v.qkv, v.att, v.gu
    xq_d, xq_q, xq_i = v.xq_d, v.xq_q, v.xq_i
    (gd_d, gs_d), (gd_q, gs_q), (gd_i, gs_i) = v.gd
    qg, mm, inter = K.quantize_act_g128, K.gemv_tg, gu.shape[1] // 2
    residual = None
    for li, L in enumerate(w.layers):
        ops.add_rmsnorm(x, residual, L.attn_norm, eps, h_d)
        qg(h_d, xq_d, gd_d, gs_d)
        mm(L.qkv, xq_d, gd_d, gs_d, qkv)
        if L.q_norm is not None:
            _qk_norm(w, v, L)
        attend(li, qkv, att)
        if L.attn_sub_norm is not None:
            ops.add_rmsnorm(att, None, L.attn_sub_norm, eps, h_q)
            qg(h_q, xq_q, gd_q, gs_q)
        else:
            qg(att, xq_q, gd_q, gs_q)
        mm(L.o, xq_q, gd_q, gs_q, delta)
        ops.add_rmsnorm(x, delta, L.ffn_norm, eps, h_d)
        qg(h_d, xq_d, gd_d, gs_d)
        mm(L.gate_up, xq_d, gd_d, gs_d, gu)
        ops.glu_rmsnorm(gu, act, L.ffn_sub_norm, eps)    # gate half := the MLP product
        qg(gu, xq_i, gd_i, gs_i, inter)
        mm(L.down, xq_i, gd_i, gs_i, delta)
        residual = delta


def tune_env() -> bool:
    """BITNET_TUNE_THREADS: 0 turns decode's thread tuning off, 1 (or unset) leaves it on; anything else is one
    line naming the variable, as every other BITNET_* switch (`off` / `false` left it on, silently)."""
    v = os.environ.get("BITNET_TUNE_THREADS", "").strip()
    if v not in ("", "0", "1"):
        raise BitNetError(f"BITNET_TUNE_THREADS={v}: 0 or 1")
    return v != "0"


_LIVE: "weakref.WeakSet[Model]" = weakref.WeakSet()


def _after_fork_in_child():
    """A fork()ed child gets each model's lock as the parent's threads held it: one held by a generate() of
    another thread would be held for ever there (the thread does not exist in the child). Each gets a new one;
    the cache is consistent at any moment (n_past moves only after its KV rows are written). The same for the
    attention-precision lock: a verify pass of the parent's cut off by the fork left f32 set, switched back."""
    global _PRECISION_LOCK
    for m in list(_LIVE):
        m.lock = threading.RLock()
    if _PRECISION_LOCK.locked():
        ops.set_attention_precision("bf16")
    _PRECISION_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Model:
    """One inference session: weights (views into the store), run-state buffers and the KV cache.

    `cache_ids` lists the tokens whose keys/values are in the cache (positions 0 .. n_past-1); they are
    kept in a preallocated array so a decode step allocates nothing."""

    def __init__(self, store, *, n_ctx: int | None = None, kv_dtype: str = "f16", chunk: int = DEFAULT_CHUNK,
                 threads: int | None = None, tune_threads: bool = False):
        cfg: ModelConfig = store.config
        self.store, self.config = store, cfg
        # the kernels' thread count is this session's own: applied at the start of every pass, so two sessions
        # in one process never run with each other's count (None / 0: the kernels' default)
        self.threads = int(threads or 0)
        # tune_threads (the caller chose the count, not the user): decode's count is measured against one thread
        # fewer (engine/runtime/thread_tuner.py); BITNET_TUNE_THREADS=0 turns that off
        n = self.threads or K.get_num_threads()
        self.tuner = ThreadTuner(n) if tune_env() and tune_threads and n >= 2 else None
        check_kv_dtype(kv_dtype)
        if kv_dtype == "q8" and (cfg.head_dim % 4 or cfg.head_dim > ops.Q8_MAX_HEAD_DIM):
            raise BitNetError(f"--kv q8: this model's head_dim {cfg.head_dim} is not a multiple of 4 up to "
                              f"{ops.Q8_MAX_HEAD_DIM}", hint="use --kv f16")
        n_ctx = int(n_ctx or min(cfg.context_length, 4096))
        if n_ctx < 1:
            raise BitNetError(f"-c/--ctx {n_ctx}: the context must hold at least one token")
        self.n_ctx, self.kv_dtype, self.chunk = n_ctx, kv_dtype, max(1, int(chunk))
        self.warnings: list[str] = []   # for the CLI to print (one line each)
        if n_ctx > cfg.context_length:
            self.warnings.append(f"-c/--ctx {n_ctx} is larger than the {cfg.context_length} tokens the model was "
                                 "trained on: output past that may be garbage")
        need = session_bytes(cfg, n_ctx, kv_dtype, self.chunk)
        avail = available_memory()
        if avail is not None and need > avail:
            raise BitNetError(f"-c/--ctx {n_ctx}: the KV cache and buffers would need {_gib(need)}, more than the "
                              f"{_gib(avail)} of memory available", hint=f"use a smaller -c/--ctx (the model was "
                              f"trained for {cfg.context_length}; about {max(1, n_ctx * avail // need // 2)} fits)")
        D, V, hd, L = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.n_layers
        w = Weights(store)
        self.weights = w
        self._act, self._eps, self._embd, self._out_norm = w.act, w.eps, w.embd, w.out_norm
        self.lm_head, self._out_w, self.layers = w.lm_head, w.out_w, w.layers
        if w.lm_head == "i8":
            self._out_scale, self._out_rowsum = w.out_scale, w.out_rowsum

        # ---- run state, allocated once: M = chunk rows ----
        M = self.chunk
        alloc_run_state(self, cfg, M)
        self._head_x = np.zeros((1, D), np.float32)        # normed last row for the f16 head
        self._logits = np.zeros(V, np.float32)
        self._logits_row = self._logits.reshape(1, V)       # the same buffer as one row (q4 head kernel)
        self._rows_logits = np.zeros((VERIFY_MAX, V), np.float32)  # logits of every row of a verify pass
        # head_rescore scratch / candidates for every row of a verify pass or of a chunk (prefill with all logits)
        self._resc_heap = np.zeros((max(VERIFY_MAX, M), RESCORE_K), np.float32)
        self._resc_idx = np.zeros((max(VERIFY_MAX, M), RESCORE_K), np.int32)
        kv_np = {"f16": np.uint16, "f32": np.float32, "q8": np.int8}[kv_dtype]   # f16 stored as its bits
        try:
            if kv_dtype == "q8":   # int8 blocks of 32 positions + their scales (simd/ops/attention_q8.h)
                self._k_cache = np.zeros((L,) + ops.q8_cache_shape(cfg.n_kv_heads, n_ctx, hd), kv_np)
                self._v_cache = np.zeros((L,) + ops.q8_cache_shape(cfg.n_kv_heads, n_ctx, hd), kv_np)
            else:
                self._k_cache = np.zeros((L,) + ops.key_cache_shape(cfg.n_kv_heads, n_ctx, hd), kv_np)  # transposed
                self._v_cache = np.zeros((L, cfg.n_kv_heads, n_ctx, hd), kv_np)
            self._scratch = np.zeros((cfg.n_heads * ops.ATTENTION_SCRATCH_ROWS, n_ctx), np.float32)  # attention scores
        except MemoryError:
            raise BitNetError(f"-c/--ctx {n_ctx}: cannot allocate the KV cache ({_gib(need)} with the buffers)",
                              hint="use a smaller -c/--ctx") from None
        self._cos, self._sin = rope_tables(cfg, n_ctx)
        self.verify_max = min(VERIFY_MAX, M)               # rows of one verify() pass
        self._views: dict[int, _Views] = {m: _Views(self, m) for m in range(1, self.verify_max + 1)}
        self._views[M] = _Views(self, M)
        self.n_past = 0
        self._cache_ids = np.zeros(n_ctx, np.int32)        # token at every cached position
        self.generation = 0                                 # bumped by each generate() (engine/generate.py)
        # held by each step of a generate() and by anything else that runs the cache (LLM.embed, perplexity,
        # forward): one LLM used from two threads gets "superseded", never two writers in one cache (re-entrant: a
        # generator finalized by the garbage collector inside a step of this thread takes it again)
        self.lock = threading.RLock()
        self.closed = False   # LLM.close(): a generator made before it and started after refuses to run
        _LIVE.add(self)
        self.taken_by = "a newer generate() call"   # what took the cache last (a superseded generator says it)

    # ---- state ----------------------------------------------------------------------------------
    def reset(self):
        self.truncate(0)

    def truncate(self, n: int):
        """Forget cached positions >= n (their cache slots are simply overwritten later)."""
        self.n_past = max(0, min(n, self.n_past))

    @property
    def cache_ids(self) -> list[int]:
        return self._cache_ids[: self.n_past].tolist()

    def _use_threads(self):
        if self.tuner is not None:
            K.set_num_threads(self.tuner.n)
        elif self.threads:
            K.set_num_threads(self.threads)

    # ---- the forward pass ---------------------------------------------------------------------------
    def _view(self, m: int) -> _Views:
        v = self._views.get(m)
        if v is None:
            v = _Views(self, m)
        return v

    def _blocks(self, v: _Views, pos0: int):
        """All layers for v.m tokens (ids already embedded into v.x) at positions pos0 .. (contiguous cache)."""
        cfg = self.config
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kc, vc, cos, sin, scr = self._k_cache, self._v_cache, self._cos, self._sin, self._scratch
        if self.kv_dtype == "q8":
            attention_q8, n_ctx = ops.attention_q8, self.n_ctx

            def attend(li, qkv, att):
                attention_q8(qkv, nh, nkv, hd, cos, sin, pos0, n_ctx, kc[li], vc[li], att, scr)
        else:
            attention = ops.attention

            def attend(li, qkv, att):
                attention(qkv, nh, nkv, hd, cos, sin, pos0, kc[li], vc[li], att, scr)

        run_layers(self.weights, v, attend, ternary_matmul(v.m, self.weights.b3))

    def _head(self, v: _Views, row: int, out: np.ndarray):
        """Logits of one row of the last chunk (its residual still lacks the last down_proj output)."""
        x, delta = v.x[row: row + 1], v.delta[row: row + 1]
        if self.lm_head == "f16":
            ops.add_rmsnorm(x, delta, self._out_norm, self._eps, self._head_x)
            K.gemv_f16(self._out_w, self._head_x[0], out)
        elif self.lm_head == "q4":
            v1 = self._views[1]
            ops.add_rmsnorm_quant(x, delta, self._out_norm, self._eps, self._head_x, v1.xq_d, v1.act_scale, v1.act_sum)
            out2 = self._logits_row if out is self._logits else out.reshape(1, -1)
            self.weights.q4_logits(v1.xq_d, v1.act_scale, self._head_x, out2, self._resc_heap, self._resc_idx)
        else:
            v1 = self._views[1]
            ops.add_rmsnorm_quant(x, delta, self._out_norm, self._eps, self._head_x, v1.xq_d, v1.act_scale, v1.act_sum)
            K.gemv_i8(self._out_w, self._out_scale, self._out_rowsum, v1.xq_d1, v1.act_scale[0], out)

    cli_hints = False   # context hints in the CLI's words (-c/--ctx): set by bitnet run / bitchat

    def context_hint(self, n_prompt: int | None = None) -> str:
        """What the user can do when the context is full. n_prompt: the prompt alone is over it, so asking for fewer
        tokens cannot help. The CLI says raise -c only while it is below the model's own; the Python API says load
        with a context that holds the prompt, as the Engine's hint does (load_model warns past the trained length)."""
        trained = self.config.context_length
        if n_prompt is not None and not self.cli_hints:
            # a prompt as long as the context fits it (one token of answer): ctx=n_prompt takes it
            past = f"; past the {trained} tokens the model was trained for it warns" if n_prompt > trained else ""
            return f"load with a context of at least {n_prompt} tokens (load_model(ctx=N){past}) or shorten the prompt"
        less = "" if n_prompt is not None else " or ask for less"
        if self.n_ctx < trained:
            return f"raise -c/--ctx (the model was trained for up to {trained} tokens) or shorten the prompt"
        if self.n_ctx > trained:
            return (f"the context ({self.n_ctx}) is already past the {trained} tokens the model was trained for: "
                    f"shorten the prompt{less}")
        return f"the context is already the model's full {trained} tokens: shorten the prompt{less}"

    def _head_rows(self, v: _Views, out: np.ndarray):
        """Logits of all v.m rows of the last chunk into out[:v.m]: one pass over a q4 or f16 head (their kernels
        take any row count; row r equals _head's for that row bit for bit), one per VERIFY_MAX rows over an int8
        head."""
        m = v.m
        if self.lm_head == "f16":
            ops.add_rmsnorm(v.x, v.delta, self._out_norm, self._eps, v.h_d)   # the chunk's h_d is free now
            if m == 1:
                K.gemv_f16(self._out_w, v.h_d[0], out[0])
            else:
                K.gemm_f16(self._out_w, v.h_d, out[:m])
            return
        # the chunk's h_d / xq_d / act buffers are free once the blocks are done
        ops.add_rmsnorm_quant(v.x, v.delta, self._out_norm, self._eps, v.h_d, v.xq_d, v.act_scale, v.act_sum)
        if self.lm_head == "q4":
            self.weights.q4_logits(v.xq_d, v.act_scale, v.h_d, out[:m], self._resc_heap, self._resc_idx)
            return
        step = m if K.active() in I8_HEAD_GEMM else VERIFY_MAX   # the GEMM in one call (the tiles from 16 rows)
        for r in range(0, m, step):
            e = min(m, r + step)
            i8_head_rows(e - r)(self._out_w, self._out_scale, self._out_rowsum, v.xq_d[r:e], v.act_scale[r:e], out[r:e])

    def verify(self, ids) -> np.ndarray:
        with decode_rows_attention():   # decoding rows: never bf16 prefill products, whatever the setting
            return self._verify(ids)

    def _verify(self, ids) -> np.ndarray:
        """Run 1..VERIFY_MAX tokens at positions n_past.. in one pass (speculative decoding: the last sampled
        token followed by the draft). Returns logits [len(ids), V] (a session buffer, overwritten next call);
        row i equals what decode() would give for ids[i] after ids[:i]. Drop rejected positions with truncate()."""
        m = len(ids)
        if not 1 <= m <= self.verify_max:
            raise BitNetError(f"verify: {m} tokens; 1..{self.verify_max} per pass")
        self._check_room(m)
        self._use_threads()
        self._check_ids(ids)
        v = self._view(m)
        v.ids[:] = ids
        ops.embed_f16(self._embd, v.ids, v.x)
        self._blocks(v, self.n_past)
        out = self._rows_logits
        if m == 1:
            self._head(v, 0, out[0])
        else:
            self._head_rows(v, out)
        self._cache_ids[self.n_past: self.n_past + m] = ids
        self.n_past += m
        return out[:m]

    def _check_ids(self, ids):
        """A token id outside the vocabulary is the caller's error, named before any row runs."""
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BitNetError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def _check_room(self, n_new: int):
        if self.n_past + n_new > self.n_ctx:
            raise ContextOverflowError(
                f"context window full: {self.n_past} cached + {n_new} new tokens > n_ctx {self.n_ctx}",
                hint=self.context_hint())

    def decode(self, token: int) -> np.ndarray:
        """Run one token at position n_past; returns the session's logits buffer (overwritten next call)."""
        self._check_room(1)
        tuner = self.tuner
        if tuner is not None:
            K.set_num_threads(tuner.threads())
            t0 = time.perf_counter()
        else:
            self._use_threads()
        v = self._views[1]
        v.ids[0] = token
        ops.embed_f16(self._embd, v.ids, v.x)
        self._blocks(v, self.n_past)
        self._head(v, 0, self._logits)
        self._cache_ids[self.n_past] = token
        self.n_past += 1
        if tuner is not None:
            tuner.record(time.perf_counter() - t0)
        return self._logits

    def prefill(self, ids, all_logits: bool = False, rows=None, cancel=None) -> np.ndarray | None:
        """Run tokens at positions n_past.. in chunks. Returns the last token's logits (the session buffer),
        or a new [len(ids), V] array when all_logits. The cache advances chunk by chunk, so an interrupt
        leaves it consistent with `cache_ids`. rows(x, delta): called with each chunk's residual rows instead of
        any logits (embeddings: engine/runtime/embed.py); the session buffer is then not updated. cancel: a
        callable asked before each chunk after the first; when it returns true the prefill stops there (the
        chunks done stay cached) and returns None (bitchat's Ctrl-C during a long prompt)."""
        ids = [int(t) for t in ids]
        if not ids:
            raise BitNetError("prefill: no tokens to process")
        self._check_room(len(ids))
        self._use_threads()
        self._check_ids(ids)
        result = np.empty((len(ids), self.config.vocab_size), np.float32) if all_logits else None
        for start in range(0, len(ids), self.chunk):
            if start and cancel is not None and cancel():
                return None
            part = ids[start: start + self.chunk]
            m = len(part)
            v = self._view(m)
            v.ids[:] = part
            ops.embed_f16(self._embd, v.ids, v.x)
            self._blocks(v, self.n_past)
            if rows is not None:
                rows(v.x, v.delta)
            elif all_logits:
                if m == 1:
                    self._head(v, 0, result[start])
                else:
                    self._head_rows(v, result[start: start + m])
            elif start + m == len(ids):
                self._head(v, m - 1, self._logits)
            self._cache_ids[self.n_past: self.n_past + m] = part
            self.n_past += m
        return result if all_logits else self._logits

    def forward(self, ids) -> np.ndarray:
        """Logits [len(ids), V] for ids from position 0 (fresh cache)."""
        self.reset()
        return self.prefill(ids, all_logits=True)
