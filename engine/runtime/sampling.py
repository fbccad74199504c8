"""Choosing the next token from logits: greedy at temperature 0, else llama.cpp's default chain
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Seeded (same seed, same output).

Work stays on the few candidates that survive top-k (or the min-p threshold when top-k is off), so a
128k-vocabulary step costs one pass of a C top-k selection over the logits, not a full sort or softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from ..errors import BitNetError


@dataclass
class SamplingParams:
    """The one source of the sampling defaults (llama.cpp's) and of their checks: `bitnet run`'s flags, bitchat's
    /set and the server's request fields take their defaults from here and validate through setting_problem()."""
    temperature: float = 0.8     # 0 -> greedy
    top_k: int = 40              # 0 -> off
    top_p: float = 0.95          # 1 -> off
    min_p: float = 0.05          # 0 -> off
    repeat_penalty: float = 1.0  # 1 -> off
    repeat_last_n: int = 64      # how many recent tokens the penalty looks at
    seed: int | None = None      # None -> a fresh random seed

    def check(self, names: dict[str, str] | None = None):
        """Raise BitNetError for the first bad field, named as `names[field]` (default: the field's own name)."""
        for f in fields(self):
            problem = setting_problem(f.name, getattr(self, f.name), (names or {}).get(f.name))
            if problem:
                raise BitNetError(problem)
        return self


# field -> (is the value valid, what it must be). A float must also be finite; NaN fails every comparison.
_RULES = {
    "temperature": (lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1 = off)"),
    "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)"),
    "repeat_penalty": (lambda v: 0 < v < math.inf, "must be > 0 and finite (1 = off)"),
    "repeat_last_n": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "seed": (lambda v: v is None or 0 <= v < 1 << 64, "must be >= 0 and < 2^64 (-1 or 'random': a fresh one)"),
}


def setting_problem(field: str, value, name: str | None = None) -> str | None:
    """The one message for a bad value of SamplingParams.`field`, or None when it is valid. `name` is how the
    caller's user spells the setting (`--temp`, `/set temp`, `temperature`; default: the field name), so every
    front end says the same thing: "--top-p 1.5: must be in (0, 1] (1 = off)"."""
    ok, rule = _RULES[field]
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, bool) or not ok(value):
        return f"{name or field} {shown}: {rule}"
    return None


class Sampler:
    """sample(logits, history) -> token id. The logits array is modified in place (it is the model's
    per-step buffer); `history` is the list of ids seen so far (prompt + generated)."""

    def __init__(self, params: SamplingParams | None, vocab_size: int):
        # imported here, not at the top: SamplingParams and setting_problem need no kernels, and the command line
        # imports them before its error handling (a bad BITNET_ISA must be one line, not a traceback)
        from ...simd import _ops

        self.p = (params or SamplingParams()).check()
        self._topk = _ops.topk
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
            got = self._topk(np.ascontiguousarray(logits, dtype=np.float32), self._top_heap, self._top_idx)
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
