"""Choosing the next token from logits: greedy at temperature 0, else llama.cpp's default chain
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Seeded (same seed, same output).

Work stays on the few candidates that survive top-k (or the min-p threshold when top-k is off), so a
128k-vocabulary step costs one pass of a C top-k selection over the logits, not a full sort or softmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...simd import _ops as ops

from ..errors import BitNetError


@dataclass
class SamplingParams:
    temperature: float = 0.8     # 0 -> greedy
    top_k: int = 40              # 0 -> off
    top_p: float = 0.95          # 1 -> off
    min_p: float = 0.05          # 0 -> off
    repeat_penalty: float = 1.0  # 1 -> off
    repeat_last_n: int = 64      # how many recent tokens the penalty looks at
    seed: int | None = None      # None -> a fresh random seed

    def check(self):
        if not (self.temperature >= 0):
            raise BitNetError(f"--temp {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise BitNetError(f"--top-k {self.top_k}: must be >= 0 (0 disables)")
        if not (0.0 < self.top_p <= 1.0):
            raise BitNetError(f"--top-p {self.top_p}: must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise BitNetError(f"--min-p {self.min_p}: must be in [0, 1]")
        if not (self.repeat_penalty > 0):
            raise BitNetError(f"--repeat-penalty {self.repeat_penalty}: must be > 0")
        if self.repeat_last_n < 0:
            raise BitNetError(f"repeat_last_n {self.repeat_last_n}: must be >= 0")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise BitNetError(f"--seed {self.seed}: must be in 0 .. 2^64-1 (or None/-1 on the command line: random)")
        return self


GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    """sample(logits, history) -> token id. The logits array is modified in place (it is the model's
    per-step buffer); `history` is the list of ids seen so far (prompt + generated)."""

    def __init__(self, params: SamplingParams | None, vocab_size: int):
        self.p = (params or SamplingParams()).check()
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(self.p.seed)
        k = self.p.top_k if 0 < self.p.top_k < vocab_size else 0
        self._top_idx = np.zeros(k, np.int32)        # top-k candidates (reused every step)
        self._top_heap = np.zeros(k, np.float32)     # scratch of the C top-k selection

    def _penalize(self, logits: np.ndarray, history):
        p, n = self.p.repeat_penalty, self.p.repeat_last_n
        if p == 1.0 or n == 0 or not history:
            return
        recent = np.fromiter((t for t in history[-n:] if 0 <= t < self.vocab_size), dtype=np.int64)
        if recent.size == 0:
            return
        ids = np.unique(recent)
        vals = logits[ids]
        # CTRL / llama.cpp rule: shrink positive logits, push negative ones further down
        logits[ids] = np.where(vals > 0, vals / np.float32(p), vals * np.float32(p))

    def sample(self, logits: np.ndarray, history=()) -> int:
        p = self.p
        top = logits.max()   # NaN if any logit is NaN (one pass, ~1% of a decode step on a 128k vocabulary)
        if not np.isfinite(top):
            raise BitNetError("the model produced NaN or infinite logits: its weights are corrupt",
                              hint="re-convert the model from its source")
        self._penalize(logits, history)
        if p.temperature <= 0.0:
            return int(np.argmax(logits))
        v = logits.shape[0]
        k = p.top_k if 0 < p.top_k < v else v
        if k < v:
            got = ops.topk(np.ascontiguousarray(logits, dtype=np.float32), self._top_heap, self._top_idx)
            cand = self._top_idx[:got]
        elif p.min_p > 0.0:
            # min-p keeps prob >= min_p * max_prob, i.e. logit >= max + log(min_p): prefilter on that
            cand = np.flatnonzero(logits >= logits.max() + np.float32(np.log(p.min_p)))
        else:
            cand = np.arange(v)
        vals = logits[cand].astype(np.float64)
        order = np.argsort(-vals, kind="stable")
        cand, vals = cand[order], vals[order]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        keep = len(cand)
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        cand, vals = cand[:keep], vals[:keep]
        w = np.exp((vals - vals[0]) / p.temperature)
        c = np.cumsum(w)
        i = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return int(cand[min(i, keep - 1)])
