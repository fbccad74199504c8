"""The batched forward: rows of several sequences, each at its own positions, through one step.

A step's rows are grouped by sequence (sequence i owns rows seq_rows[i] .. seq_rows[i+1]-1, at positions
seq_pos0[i] ..): a decoding sequence has one row, a prefilling one a chunk. Every weight matrix is one
ternary GEMM over all rows (GEMV when the step has one row, as engine/model.py decodes); activations are
quantized per row, so a row's numbers do not depend on the other rows. Attention runs per sequence over its
own pages of the shared pool (simd.ops.attention_paged). Logits are computed only for the rows asked for.
The weights are the store's read-only views (engine.model.Weights), shared with nothing mutable.

A test hook (docs/serving-limits.md), never set in production: with BITNET_FAULT_TOKEN=<token id> in the
environment, a step whose rows of one sequence hold that token gives that sequence an out-of-range page in the
last layer's attention, so the kernel's own boundary check raises there, after every earlier layer has written
its K/V, as a real kernel fault would. The tests use it to show that such a fault ends only that sequence.
"""
from __future__ import annotations

import os

import numpy as np

from ...simd import _kernels as K
from ...simd import _ops as ops

from ..config import ModelConfig
from ..errors import BitNetError
from ..runtime.embed import final_norm_rows
from ..runtime.model import (RESCORE_K, Weights, _Views, alloc_run_state, i8_head_rows, rope_tables, run_layers,
                             ternary_matmul)
from .kv_pool import PAGE_TOKENS, KVPool


def batch_model_bytes(cfg: ModelConfig, *, max_rows: int, n_ctx: int, max_logit_rows: int, max_threads: int) -> int:
    """Bytes BatchModel() allocates beside the KV pool: RoPE tables, attention scratch, per-step rows, logit rows
    (as engine.runtime.model.session_bytes counts a session's: the engine's memory check adds the pool)."""
    ctx = -(-int(n_ctx) // PAGE_TOKENS) * PAGE_TOKENS
    rope = 2 * ctx * (cfg.head_dim // 2) * 4 + ctx * 4 * 2
    scratch = max_threads * ops.ATTENTION_SCRATCH_ROWS * ctx * 4
    rows = max_rows * ((4 * cfg.hidden_size + 2 * cfg.q_dim + 2 * cfg.kv_dim + 2 * cfg.intermediate_size) * 4)
    logits = max_logit_rows * ((3 * cfg.hidden_size + cfg.vocab_size) * 4 + 8 * RESCORE_K)
    return rope + scratch + rows + logits


class BatchModel:
    def __init__(self, store, pool: KVPool, *, max_rows: int, n_ctx: int, max_logit_rows: int,
                 weights: Weights | None = None, max_threads: int = 64, threads: int | None = None):
        cfg: ModelConfig = store.config
        self.config, self.pool = cfg, pool
        self.threads = int(threads or 0)   # this engine's kernel thread count, set at every step (0: default)
        self.w = weights or Weights(store)
        self.max_rows, self.n_ctx = int(max_rows), int(n_ctx)
        self.max_pages = (self.n_ctx + PAGE_TOKENS - 1) // PAGE_TOKENS
        alloc_run_state(self, cfg, self.max_rows)
        self._views: dict[int, _Views] = {}
        self._cos, self._sin = rope_tables(cfg, self.max_pages * PAGE_TOKENS)
        # attention scores: ATTENTION_SCRATCH_ROWS rows per thread (fewer rows would just use fewer threads)
        self._scratch = np.zeros((max_threads * ops.ATTENTION_SCRATCH_ROWS, self.max_pages * PAGE_TOKENS), np.float32)
        D, V = cfg.hidden_size, cfg.vocab_size
        self.max_logit_rows = int(max_logit_rows)
        self._head_x = np.zeros((self.max_logit_rows, D), np.float32)
        self._head_d = np.zeros((self.max_logit_rows, D), np.float32)
        self._head_h = np.zeros((self.max_logit_rows, D), np.float32)
        self._logits = np.zeros((self.max_logit_rows, V), np.float32)
        self._resc_heap = np.zeros((self.max_logit_rows, RESCORE_K), np.float32)  # head_rescore scratch
        self._resc_idx = np.zeros((self.max_logit_rows, RESCORE_K), np.int32)
        hook = os.environ.get("BITNET_FAULT_TOKEN", "").strip()
        self.fault_token = int(hook) if hook.lstrip("-").isdigit() else None   # the test hook above

    def _view(self, m: int) -> _Views:
        v = self._views.get(m)
        if v is None:
            v = self._views[m] = _Views(self, m)
        return v

    def step(self, ids: np.ndarray, seq_rows: np.ndarray, seq_pos0: np.ndarray, page_table: np.ndarray,
             logit_rows) -> np.ndarray:
        """Run one step; returns logits [len(logit_rows), V] (a view of a buffer reused next step).
        ids int32 [m]; seq_rows int32 [n+1]; seq_pos0 int32 [n]; page_table int32 [n, max_pages] (only the
        pages of positions < seq_pos0 + rows are read; the pages written must be held by that sequence alone)."""
        m = int(ids.shape[0])
        if not 1 <= m <= self.max_rows:
            raise BitNetError(f"batched step of {m} rows (1..{self.max_rows})")
        if len(logit_rows) > self.max_logit_rows:
            raise BitNetError(f"{len(logit_rows)} logit rows > {self.max_logit_rows}")
        w = self.w
        if self.threads:
            K.set_num_threads(self.threads)
        v = self._last = self._view(m)
        v.ids[:] = ids
        ops.embed_f16(w.embd, v.ids, v.x)
        self._blocks(v, seq_rows, seq_pos0, page_table, self._faulty_table(ids, seq_rows, page_table))
        return self._head(v, logit_rows)

    def final_norm(self, row0: int, row1: int) -> np.ndarray:
        """The last step's rows row0 .. row1-1 after the final norm (before the LM head): a new [rows, D] array,
        what an embedding pools (engine/runtime/embed.py). Read before the next step overwrites them."""
        v = self._last
        return final_norm_rows(v.x[row0:row1], v.delta[row0:row1], self.w.out_norm, self.w.eps)

    def head_rows(self, rows) -> np.ndarray:
        """Logits [len(rows), V] of rows of the last step (at most max_logit_rows), in the buffer step() returns
        its logits in: call once the step's own logits are no longer needed."""
        if len(rows) > self.max_logit_rows:
            raise BitNetError(f"{len(rows)} logit rows > {self.max_logit_rows}")
        return self._head(self._last, rows)

    def _faulty_table(self, ids, seq_rows, page_table):
        """The test hook's page table (None unless BITNET_FAULT_TOKEN is set and in the step's rows): the rows of
        the sequences holding the token point past the pool."""
        if self.fault_token is None:
            return None
        hit = [i for i in range(len(seq_rows) - 1) if (ids[seq_rows[i]: seq_rows[i + 1]] == self.fault_token).any()]
        if not hit:
            return None
        table = page_table.copy()
        table[hit, 0] = self.pool.n_pages
        return table

    def _blocks(self, v: _Views, seq_rows, seq_pos0, page_table, faulty_table=None):
        """All layers of one step: engine.model.run_layers with attention over each sequence's own pages."""
        cfg = self.config
        attention = ops.attention_paged_q8 if self.pool.kv_dtype == "q8" else ops.attention_paged
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kp, vp, cos, sin, scr = self.pool.k, self.pool.v, self._cos, self._sin, self._scratch

        last = cfg.n_layers - 1

        def attend(li, qkv, att):
            pt = faulty_table if faulty_table is not None and li == last else page_table
            attention(qkv, nh, nkv, hd, cos, sin, seq_rows, seq_pos0, pt, kp[li], vp[li], att, scr)

        # a few rows (decode of 2-4 sequences, small draft steps) take the multi-row GEMV where the kernel path
        # makes it cheaper than the GEMM, as Model does (bit-identical either way)
        run_layers(self.w, v, attend, ternary_matmul(v.m, self.w.b3))

    def _head(self, v: _Views, rows) -> np.ndarray:
        """Logits of the given rows (their residual still lacks the last down_proj output)."""
        w, k = self.w, len(rows)
        out = self._logits[:k]
        if k == 0:
            return out
        hx, hd, hh = self._head_x[:k], self._head_d[:k], self._head_h[:k]
        np.take(v.x, rows, axis=0, out=hx)
        np.take(v.delta, rows, axis=0, out=hd)
        if w.lm_head == "f16":
            ops.add_rmsnorm(hx, hd, w.out_norm, w.eps, hh)
            if k > 1:
                K.gemm_f16(w.out_w, hh, out)
            else:
                K.gemv_f16(w.out_w, hh[0], out[0])
        else:
            kp = self._kp_d
            xq = self._xq_buf[: k * kp].reshape(k, kp)
            s, sm = self._act_scale[:k], self._act_sum[:k]
            ops.add_rmsnorm_quant(hx, hd, w.out_norm, w.eps, hh, xq, s, sm)
            if w.lm_head == "q4":
                w.q4_logits(xq, s, hh, out, self._resc_heap, self._resc_idx)
            elif k > 1:   # the multi-row GEMV or the GEMM, per path and row count, as Model.verify
                i8_head_rows(k)(w.out_w, w.out_scale, w.out_rowsum, xq, s, out)
            else:
                for r in range(k):
                    K.gemv_i8(w.out_w, w.out_scale, w.out_rowsum, xq[r], s[r], out[r])
        return out
