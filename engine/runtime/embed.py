"""Sentence embeddings from a decoder model: the pooling both the single-session LLM and the batching engine use.

What a text's vector is (llama.cpp's server with `--embeddings --pooling mean`, which we match):
- every token of the text (BOS first, as llama-server tokenizes an input with add_special) runs through the
  model; its hidden state after the final norm -- rmsnorm(residual) * output_norm, before the LM head, what
  llama.cpp calls `result_norm` / t_embd -- is one row;
- the rows are averaged (LLAMA_POOLING_TYPE_MEAN), then L2-normalised (llama-server's `embd_normalize` default 2,
  Euclidean: common_embd_normalize divides by the square root of the sum of squares).

The other poolings (llama.cpp's `--pooling`, check_pooling): `last` takes the final token's row (it has read the
whole text; the pooling of embedding models trained from decoders), `none` every row as it is (llama-server's
/embedding). `embd_normalize` picks the norm of a pooled vector as llama.cpp's does (normalized()).

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

POOLINGS = ("mean", "last", "none")   # llama.cpp's names for the ones a decoder model can use (check_pooling)
POOLING = "mean"                       # the default (llama-server `--pooling mean`; see above)
NORMALIZE = 2                          # llama.cpp's embd_normalize default: Euclidean (L2)


def check_pooling(pooling, name: str = "pooling", json_terms: bool = False) -> str:
    """One of POOLINGS, or BitNetError saying why not: llama.cpp's `cls` pools the first token, which in a causal
    model is BOS before any text (one vector for every input); `rank` needs a reranker's classification head."""
    from ..errors import BitNetError, shown_value
    if pooling in POOLINGS:
        return pooling
    if pooling == "cls":
        raise BitNetError(f"{name} cls: it takes the first token's state, and in this causal (decoder) model the "
                          "first token sees only BOS, so every text would get the same vector",
                          hint="use mean (every token) or last (the final token, which has read the whole text)")
    if pooling == "rank":
        raise BitNetError(f"{name} rank: it needs a reranker's classification head, which this model does not have")
    raise BitNetError(f"{name} {shown_value(pooling, json_terms)}: expected one of {', '.join(POOLINGS)}")


def check_normalize(p, name: str = "embd_normalize", json_terms: bool = False) -> int:
    """llama.cpp's embd_normalize: -1 none, 0 max-absolute scaled to int16's range, 1 taxicab, 2 Euclidean,
    p > 2 the p-norm; BitNetError otherwise (json_terms: the value as JSON spells it, `true`, not `True`)."""
    from ..errors import BitNetError, shown_value
    if isinstance(p, bool) or not isinstance(p, int) or not -1 <= p < 1 << 31:   # llama.cpp's int32 (10**400
        # passed and overflowed in the norm: a 500)
        raise BitNetError(f"{name} {shown_value(p, json_terms)}: expected an integer >= -1 (-1 none, "
                          "0 max-absolute int16, 1 taxicab, 2 Euclidean, >2 p-norm)")
    return p


def check_unpooled_norm(pooling: str, normalize, name: str = "normalize") -> None:
    """Pooling none gives each token's row as the model computed it, never normalised (llama-server's /embedding
    under --pooling none; `bitnet serve` answers an embd_normalize there with a 400): a norm asked for with it
    (normalize not None) is refused in those words, not dropped without a word."""
    from ..errors import BitNetError
    if pooling == "none" and normalize is not None:
        raise BitNetError(f"{name}: pooling none's per-token vectors are never normalised",
                          hint=f"leave {name} out, or pool the text (mean, last)")


def normalized(v: np.ndarray, p: int) -> np.ndarray:
    """v (float64) scaled as llama.cpp's common_embd_normalize(v, p) scales it (the sum in double), as float32; a zero
    vector stays zero."""
    if p == -1:
        s = 1.0
    elif p == 0:
        s = float(np.max(np.abs(v))) / 32760.0 if v.size else 0.0
    elif p == 2:
        s = float(np.sqrt(np.dot(v, v)))
    else:
        with np.errstate(over="ignore", under="ignore"):
            t = float(np.sum(np.abs(v) ** p))
        if 0.0 < t < np.inf:
            s = t ** (1.0 / p)
        else:   # |v|^p overflowed (p of hundreds; llama.cpp's vector then comes out all zero) or underflowed:
            m = float(np.max(np.abs(v))) if v.size else 0.0   # the same norm, scaled by the largest |v| first
            s = m * float(np.sum((np.abs(v) / m) ** p)) ** (1.0 / p) if m > 0 else 0.0
    return (v * (1.0 / s if s > 0 else 0.0)).astype(np.float32)


def final_norm_rows(x: np.ndarray, delta: np.ndarray, out_norm: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(x + delta) * out_norm of each row (x's rows are updated in place to x + delta: the residual is
    complete afterwards, as the LM head's own add_rmsnorm leaves it)."""
    out = np.empty(x.shape, np.float32)
    ops.add_rmsnorm(x, delta, out_norm, eps, out)
    return out


class Pool:
    """One text's final-norm rows, taken one chunk at a time in token order, so the result does not depend on how
    the text was cut into chunks. mean: the running sum (f64, row by row); last: the last row; none: every row."""

    def __init__(self, dim: int, pooling: str = POOLING, normalize: int = NORMALIZE):
        self.pooling, self.normalize = pooling, normalize
        self.sum = np.zeros(dim, np.float64) if pooling == "mean" else None
        self.last: np.ndarray | None = None
        self.rows: list[np.ndarray] = []
        self.n = 0

    def add(self, rows: np.ndarray):
        if self.pooling == "mean":
            for row in rows:
                np.add(self.sum, row, out=self.sum)
        elif self.pooling == "last":
            if len(rows):
                self.last = np.array(rows[-1], np.float64)
        else:
            self.rows.append(np.array(rows, np.float32))
        self.n += len(rows)

    def result(self) -> np.ndarray:
        """mean / last: the pooled vector normalised (normalized()), float32 [dim]; none: the rows as they are,
        float32 [n, dim] (llama-server normalises only pooled vectors)."""
        if self.pooling == "none":
            return np.concatenate(self.rows) if self.rows else np.zeros((0, 0), np.float32)
        v = self.sum / max(self.n, 1) if self.pooling == "mean" else self.last
        return normalized(v if v is not None else np.zeros(0), self.normalize)


def embed_ids(model, ids, pooling: str = POOLING, normalize: int = NORMALIZE) -> np.ndarray:
    """The pooled vector of one token list through a single-session Model (engine/runtime/model.py), or its rows
    (pooling none): the cache is reset first and holds the text afterwards. Raises ContextOverflowError if it does
    not fit."""
    pool = Pool(model.config.hidden_size, pooling, normalize)
    w = model.weights
    model.reset()
    model.prefill(ids, rows=lambda x, delta: pool.add(final_norm_rows(x, delta, w.out_norm, w.eps)))
    return pool.result()
