"""Choosing the next token from logits: greedy at temperature 0, else llama.cpp's default chain
logit bias -> penalties (repetition; OpenAI's presence / frequency) -> top-k -> top-p -> min-p -> temperature ->
draw. Seeded (same seed, same output). On request (Sampler.logprobs) each step also records the exact
log-softmax of the logits it saw after bias and penalties: the sampled token's and the best few.

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
    presence_penalty: float = 0.0   # OpenAI's: logit -= presence for every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI's: logit -= frequency * (times generated)
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (-100 bans, +100 forces)
    record_logprobs: int | None = None  # None -> off; k -> each step records the token's logprob and the best k

    def check(self, names: dict[str, str] | None = None):
        """Raise BitNetError for the first bad field, named as `names[field]` (default: the field's own name)."""
        for f in fields(self):
            problem = setting_problem(f.name, getattr(self, f.name), (names or {}).get(f.name))
            if problem:
                raise BitNetError(problem)
        return self


# fields set per request (the server's API, the Python API), with no command-line flag or bitchat /set
REQUEST_ONLY_FIELDS = ("logit_bias", "record_logprobs")

# field -> (is the value valid, what it must be). A float must also be finite; NaN fails every comparison.
_RULES = {
    "temperature": (lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1 = off)"),
    "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)"),
    "repeat_penalty": (lambda v: 0 < v < math.inf, "must be > 0 and finite (1 = off)"),
    "repeat_last_n": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "seed": (lambda v: v is None or 0 <= v < 1 << 64, "must be >= 0 and < 2^64 (-1 or 'random': a fresh one)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2] (0 = off)"),
    "record_logprobs": (lambda v: v is None or 0 <= v <= 20, "must be in 0..20 (None = off)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2] (0 = off)"),
}
LOGIT_BIAS_MAX = 100.0


def _logit_bias_problem(value, name: str) -> str | None:
    """The first bad entry of a logit_bias map, named by its key (OpenAI's range: -100..100)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"{name}: must be a map of token id -> bias"
    for k, v in value.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            return f"{name} {k!r}: a key must be a token id (an integer >= 0)"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
            return f"{name} {k}: {v!r}: must be in [-100, 100]"
    return None


def setting_problem(field: str, value, name: str | None = None) -> str | None:
    """The one message for a bad value of SamplingParams.`field`, or None when it is valid. `name` is how the
    caller's user spells the setting (`--temp`, `/set temp`, `temperature`; default: the field name), so every
    front end says the same thing: "--top-p 1.5: must be in (0, 1] (1 = off)"."""
    if field == "logit_bias":
        return _logit_bias_problem(value, name or field)
    ok, rule = _RULES[field]
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, bool) or not ok(value):
        return f"{name or field} {shown}: {rule}"
    return None


@dataclass(slots=True)
class TokenLogprob:
    """One step's log-softmax of the logits the sampler saw (after logit bias and penalties, before top-k /
    top-p / min-p / temperature, which only choose among tokens): the sampled token's, and the best k."""
    logprob: float                  # of the sampled token
    top: list[tuple[int, float]]    # (token id, logprob), most likely first; k = SamplingParams.record_logprobs


def token_logprob(logits: np.ndarray, tok: int, k: int) -> TokenLogprob:
    """The exact log-softmax of one row of logits (exp in f32, summed in f64), for token `tok` and the best k (the
    C top-k selection, as sampling's: one pass, no sort of the vocabulary); ties by id, so stable across runs.
    What a sampled token records (Sampler), and what a scored prompt token gets (engine/batching/score.py)."""
    from ...simd import _ops

    m = float(logits.max())
    lse = m + float(np.log(np.exp(logits - np.float32(m), dtype=np.float32).sum(dtype=np.float64)))
    k = min(k, logits.shape[0])
    top = []
    if k > 0:
        idx_buf, heap = np.zeros(k, np.int32), np.zeros(k, np.float32)
        got = _ops.topk(np.ascontiguousarray(logits, dtype=np.float32), heap, idx_buf)
        idx = idx_buf[:got].astype(np.int64)
        idx = idx[np.lexsort((idx, -logits[idx]))]   # most likely first, ties by id (stable across runs)
        top = [(int(i), float(logits[i]) - lse) for i in idx]
    return TokenLogprob(float(logits[tok]) - lse, top)


class Sampler:
    """sample(logits, history) -> token id. The logits array is modified in place (it is the model's
    per-step buffer); `history` is the list of ids seen so far (prompt + generated): the history of the first
    call is taken as the prompt, so presence / frequency penalties count only what was generated after it.
    `record` is the last step's TokenLogprob when SamplingParams.record_logprobs is set, else None."""

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
        bias = self.p.logit_bias or {}
        bad = [t for t in bias if t >= vocab_size]
        if bad:
            raise BitNetError(f"logit_bias {bad[0]}: token id outside the vocabulary (0..{vocab_size - 1})")
        self._bias_ids = np.fromiter(bias.keys(), np.int64, len(bias))
        self._bias_vals = np.fromiter(bias.values(), np.float32, len(bias))
        self._n_prompt: int | None = None   # len(history) at the first call: what came before the generated tokens
        self._counts: dict[int, int] = {}   # generated token -> times (presence / frequency penalties)
        self._n_counted = 0
        self.record: TokenLogprob | None = None

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

    def _count_generated(self, history):
        """Fold the tokens generated since the last call into the counts (incrementally: one step's worth)."""
        if self._n_prompt is None:
            self._n_prompt = len(history)
        new = history[self._n_prompt + self._n_counted:]
        for t in new:
            self._counts[t] = self._counts.get(t, 0) + 1
        self._n_counted += len(new)

    def _presence_frequency(self, logits: np.ndarray, history):
        """OpenAI's rule over the generated tokens: logit[t] -= count[t] * frequency + (count[t] > 0) * presence."""
        self._count_generated(history)
        counts = {t: c for t, c in self._counts.items() if 0 <= t < self.vocab_size}
        if not counts:
            return
        ids = np.fromiter(counts.keys(), np.int64, len(counts))
        c = np.fromiter(counts.values(), np.float32, len(counts))
        logits[ids] -= c * np.float32(self.p.frequency_penalty) + np.float32(self.p.presence_penalty)

    def _record(self, logits: np.ndarray, tok: int):
        self.record = token_logprob(logits, tok, self.p.record_logprobs)

    def sample(self, logits: np.ndarray, history=()) -> int:
        p = self.p
        top = logits.max()   # NaN if any logit is NaN (one pass, ~1% of a decode step on a 128k vocabulary)
        if not np.isfinite(top):
            raise BitNetError("the model produced NaN or infinite logits: its weights are corrupt",
                              hint="re-convert the model from its source")
        if self._bias_ids.size:
            logits[self._bias_ids] += self._bias_vals
        self._penalize(logits, history)
        if p.presence_penalty or p.frequency_penalty:
            self._presence_frequency(logits, history)
        tok = self._choose(logits)
        if p.record_logprobs is not None:
            self._record(logits, tok)
        return tok

    def _choose(self, logits: np.ndarray) -> int:
        p = self.p
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
