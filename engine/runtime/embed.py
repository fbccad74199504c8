"""Sentence embeddings from a decoder model: the pooling both the single-session LLM and the batching engine use.

What a text's vector is (llama.cpp's server with `--embeddings --pooling mean`, which we match):
- every token of the text (BOS first, as llama-server tokenizes an input with add_special) runs through the
  model; its hidden state after the final norm -- rmsnorm(residual) * output_norm, before the LM head, what
  llama.cpp calls `result_norm` / t_embd -- is one row;
- the rows are averaged (LLAMA_POOLING_TYPE_MEAN), then L2-normalised (llama-server's `embd_normalize` default 2,
  Euclidean: common_embd_normalize divides by the square root of the sum of squares).

Why mean: a GGUF of a decoder model carries no `pooling_type` (llama.cpp reads that key only for its embedding
architectures: BERT, Qwen2/3, ...; BitNet's loader does not), so llama.cpp's context gets LLAMA_POOLING_TYPE_NONE,
and llama-server `--embeddings` then refuses `/v1/embeddings` ("Pooling type 'none' is not OAI compatible. Please
use a different pooling type"; tools/server, handle_embeddings_impl). The pooling users are told to add for a chat
model is `--pooling mean`; mean over every token is also what bench/bench_embed.py runs llama-server with, so the
two servers compute the same thing. (Sources read: llama.cpp tools/server/server-context.cpp send_embedding, which
normalises only pooled vectors with common_embd_normalize(..., embd_normalize); src/llama-model.cpp, where
LLM_KV_POOLING_TYPE is read per architecture.)

Exactness: a row's numbers do not depend on the rows beside it (activations are quantized per row), and the mean
is summed row by row in token order in f64, whatever the chunks a step gave the text: the same text gives the same
bits alone, in a batch, through LLM.embed or through the engine.
"""
from __future__ import annotations

import numpy as np

from ...simd import _ops as ops

POOLING = "mean"          # the one pooling served (docs/api.md)
NORMALIZE = "l2"


def final_norm_rows(x: np.ndarray, delta: np.ndarray, out_norm: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(x + delta) * out_norm of each row (x's rows are updated in place to x + delta: the residual is
    complete afterwards, as the LM head's own add_rmsnorm leaves it)."""
    out = np.empty(x.shape, np.float32)
    ops.add_rmsnorm(x, delta, out_norm, eps, out)
    return out


class MeanPool:
    """The running sum of one text's final-norm rows, added one row at a time in token order (f64), so the
    result does not depend on how the text was cut into chunks."""

    def __init__(self, dim: int):
        self.sum = np.zeros(dim, np.float64)
        self.n = 0

    def add(self, rows: np.ndarray):
        for row in rows:
            np.add(self.sum, row, out=self.sum)
        self.n += len(rows)

    def result(self) -> np.ndarray:
        """The mean, L2-normalised, as float32 (a zero vector stays zero, as common_embd_normalize leaves it)."""
        mean = self.sum / max(self.n, 1)
        norm = float(np.sqrt(np.dot(mean, mean)))
        return (mean * (1.0 / norm if norm > 0 else 0.0)).astype(np.float32)


def embed_ids(model, ids) -> np.ndarray:
    """The pooled vector of one token list through a single-session Model (engine/runtime/model.py): the cache is
    reset first and holds the text afterwards. Raises ContextOverflowError if it does not fit."""
    pool = MeanPool(model.config.hidden_size)
    w = model.weights
    model.reset()
    model.prefill(ids, rows=lambda x, delta: pool.add(final_norm_rows(x, delta, w.out_norm, w.eps)))
    return pool.result()
