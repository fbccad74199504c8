"""Choosing the next token from logits: greedy at temperature 0, else llama.cpp's default chain
logit bias -> penalties (repetition; OpenAI's presence / frequency) -> top-k -> top-p -> min-p -> temperature ->
draw. Seeded (same seed, same output). On request (Sampler.logprobs) each step also records the exact
log-softmax of the logits it saw after bias and penalties: the sampled token's and the best few.

Work stays on the few candidates that survive top-k (or the min-p threshold when top-k is off), so a
128k-vocabulary step costs one pass of a C top-k selection over the logits, not a full sort or softmax.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import numpy as np

from ..errors import BitNetError, shown_number, shown_value


def checked_params(params) -> "SamplingParams":
    """`params` as the Python API takes it: None (the defaults) or a SamplingParams, checked; else one BitNetError
    (a dict of settings failed deep inside)."""
    if params is None:
        return SamplingParams().check()
    if not isinstance(params, SamplingParams):
        raise BitNetError(f"params: a SamplingParams (engine.api.SamplingParams(temperature=...)), not "
                          f"{type(params).__name__}")
    return params.check()


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
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (-100 bans, +100 forces; -inf: never)
    # presence / frequency count the last repeat_last_n tokens, prompt included (llama.cpp's rule: its server's
    # /completion, ollama), not the generated ones (OpenAI's)
    penalize_prompt: bool = False
    # llama.cpp's other samplers, with its defaults (off) and its meaning, in its chain's order (Sampler.sample)
    dry_multiplier: float = 0.0     # DRY: a token extending a repeat loses multiplier * base^(length - allowed)
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64    # the tokens it looks back at (-1: all; 0 -> off)
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")   # repeats do not span these
    top_n_sigma: float = -1.0       # keep logits >= max - n * std (<= 0 -> off)
    typical_p: float = 1.0          # locally typical sampling (1 -> off)
    xtc_probability: float = 0.0    # exclude top choices: how often (0 -> off)
    xtc_threshold: float = 0.1      # ... every token but the last at or above this probability (> 0.5 -> off)
    dynatemp_range: float = 0.0     # dynamic temperature: temperature +- range by the entropy (0 -> off)
    dynatemp_exponent: float = 1.0
    mirostat: int = 0               # 1, 2: Mirostat v1 / v2 instead of top-k .. min-p (0 -> off)
    mirostat_tau: float = 5.0       # its target surprise (bits)
    mirostat_eta: float = 0.1       # its learning rate
    min_keep: int = 0               # typical, top-p, min-p and XTC keep at least this many tokens (llama.cpp's)
    # a thinking model's <think> block (engine/runtime/reasoning.py): after this many tokens its end is forced,
    # the message first (llama.cpp's --reasoning-budget / --reasoning-budget-message); -1: no limit, 0: none
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    record_logprobs: int | None = None  # None -> off; k -> each step records the token's logprob and the best k

    def check(self, names: dict[str, str] | None = None):
        """Raise BitNetError for the first bad field, named as `names[field]` (default: the field's own name)."""
        for f in fields(self):
            problem = setting_problem(f.name, getattr(self, f.name), (names or {}).get(f.name))
            if problem:
                raise BitNetError(problem)
        return self

    @property
    def dry_on(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def dry_breakers(self) -> tuple[str, ...]:
        """The sequence breakers a sampler with these settings matches against the vocabulary: none when DRY is
        off (engine/runtime/dry.py builds their table once per tokenizer)."""
        return tuple(self.dry_sequence_breakers) if self.dry_on else ()


# fields set per request (the server's API, the Python API), with no command-line flag or bitchat /set
REQUEST_ONLY_FIELDS = ("logit_bias", "record_logprobs", "penalize_prompt")

# field -> (is the value valid, what it must be). A float must also be finite; NaN fails every comparison.
# each breaker costs scans of the whole vocabulary (~19 ms on a 128k one) the first time a list is seen; a request
# with thousands held a server's CPU for minutes (llama.cpp keeps none of this per request)
MAX_DRY_BREAKERS = 64

_RULES = {
    "temperature": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite (0 = greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "top_p": (lambda v: 0 <= v <= 1, "must be in [0, 1] (1 = off; 0 keeps the most likely token)"),
    "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)"),
    "repeat_penalty": (lambda v: 0 < v < math.inf, "must be > 0 and finite (1 = off)"),
    "repeat_last_n": (lambda v: v >= -1, "must be >= 0 (0 = off), or -1 for the whole context"),
    "seed": (lambda v: v is None or 0 <= v < 1 << 64,
             "must be >= 0 and < 2^64 (a fresh one: -1 in flags, requests and /set, also 'random' in /set; "
             "None in Python)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2] (0 = off)"),
    "penalize_prompt": (lambda v: True, "must be true or false"),
    "record_logprobs": (lambda v: v is None or 0 <= v <= 20, "must be in 0..20 (None = off)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2] (0 = off)"),
    "dry_multiplier": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite (0 = off)"),
    "dry_base": (lambda v: 1 <= v < math.inf, "must be >= 1 and finite"),
    "dry_allowed_length": (lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0"),
    "dry_penalty_last_n": (lambda v: isinstance(v, int) and v >= -1, "must be >= 0, or -1 for the whole context"),
    "dry_sequence_breakers": (lambda v: isinstance(v, (list, tuple)) and len(v) <= MAX_DRY_BREAKERS and
                              all(isinstance(x, str) and x for x in v),
                              f"must be at most {MAX_DRY_BREAKERS} non-empty strings"),
    "top_n_sigma": (lambda v: -math.inf < v < math.inf, "must be finite (<= 0 = off)"),
    "typical_p": (lambda v: 0 <= v <= 1, "must be in [0, 1] (1 = off)"),
    "xtc_probability": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)"),
    "xtc_threshold": (lambda v: 0 <= v <= 1, "must be in [0, 1] (above 0.5 = off)"),
    "dynatemp_range": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite (0 = off)"),
    "dynatemp_exponent": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite"),
    "mirostat": (lambda v: isinstance(v, int) and v in (0, 1, 2), "must be 0, 1 or 2 (0 = off)"),
    "mirostat_tau": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite"),
    "mirostat_eta": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite"),
    "min_keep": (lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0 (0 = no minimum)"),
    "reasoning_budget": (lambda v: isinstance(v, int) and v >= -1,
                         "must be an integer >= -1 (-1 = no limit, 0 = end the thought at once)"),
    "reasoning_budget_message": (lambda v: isinstance(v, str) and "</think>" not in v,
                                 "must be text without </think> (the end the budget adds after it)"),
}
LOGIT_BIAS_MAX = 100.0
_F32_MAX = float(np.finfo(np.float32).max)
# each field's type (the rest: a number); None is valid for these
_KIND = {**dict.fromkeys(("top_k", "repeat_last_n", "seed", "record_logprobs", "dry_allowed_length",
                          "dry_penalty_last_n", "mirostat", "reasoning_budget", "min_keep"), numbers.Integral),
         "reasoning_budget_message": str, "dry_sequence_breakers": (list, tuple), "penalize_prompt": bool}
_MAY_BE_NONE = ("seed", "record_logprobs")


def _logit_bias_problem(value, name: str, json_terms: bool = False) -> str | None:
    """The first bad entry of a logit_bias map, named by its key (OpenAI's range: -100..100)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"{name}: must be {'an object' if json_terms else 'a map'} of token id -> bias"
    for k, v in value.items():
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            return f"{name} {shown_value(k, json_terms)}: a key must be a token id (an integer >= 0)"
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or \
                not (-LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX or v == -math.inf):
            return f"{name} {k}: {shown_value(v, json_terms)}: must be in [-100, 100], or -inf (never)"
    return None


# the type a field must have, in Python's words and (json_terms) in JSON's
_TYPE_WORDS = {numbers.Integral: ("an integer", "an integer"), numbers.Real: ("a number", "a number"),
               bool: ("true or false", "true or false"), str: ("text", "a string")}


def setting_problem(field: str, value, name: str | None = None, json_terms: bool = False) -> str | None:
    """The one message for a bad value of SamplingParams.`field`, or None when it is valid. `name` is how the
    caller's user spells the setting (`--temp`, `/set temp`, `temperature`; default: the field name), so every
    front end says the same thing: "--top-p 1.5: must be in [0, 1] (1 = off; 0 keeps the most likely token)".
    json_terms: the value and types as a JSON API's client wrote them (["", "x"], true, an array), else as
    Python's (('', 'x'), True, a list)."""
    if field == "logit_bias":
        return _logit_bias_problem(value, name or field, json_terms)
    ok, rule = _RULES[field]
    kind = _KIND.get(field, numbers.Real)
    if value is not None or field not in _MAY_BE_NONE:
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):   # "0.7", 40.0 for top_k
            what = _TYPE_WORDS.get(kind, ("a list of strings", "an array of strings"))[json_terms]
            return f"{name or field} {shown_value(value, json_terms)}: must be {what}"
        if kind is numbers.Integral:
            value = int(value)   # numpy's integers too
    shown = shown_number(value) if isinstance(value, float) else \
        shown_value(value, json_terms) if json_terms and isinstance(value, (tuple, list, str)) else str(value)
    if not ok(value):
        return f"{name or field} {shown}: {rule}"
    if field == "dry_sequence_breakers":   # matched as UTF-8 bytes: a lone surrogate was a raw UnicodeEncodeError
        for i, breaker in enumerate(value):
            bad = next((j for j, ch in enumerate(breaker) if "\ud800" <= ch <= "\udfff"), None)
            if bad is not None:
                return (f"{name or field}[{i}]: a lone UTF-16 surrogate (\\u{ord(breaker[bad]):04x} at character "
                        f"{bad + 1}) is not text")
    return None


# what a request whose grammar, logit_bias and ignore_eos leave no token to draw is told (every API: a 400), and the
# finish_reason of a batched sequence that ended so (engine/batching/scheduler.py; serve/schemas.py's unanswered)
NO_TOKEN_ALLOWED = ("no token is allowed here: the request's grammar, logit_bias and ignore_eos together exclude "
                    "every token")
EXCLUDED = "excluded"


class NoTokenAllowedError(BitNetError):
    """Every token is excluded at this step: masked (a grammar, ignore_eos) or banned (a -inf logit_bias). The
    request's own doing, not a fault of the engine or the weights."""


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

    def __init__(self, params: SamplingParams | None, vocab_size: int, tokenizer=None):
        # imported here, not at the top: SamplingParams and setting_problem need no kernels, and the command line
        # imports them before its error handling (a bad BITNET_ISA must be one line, not a traceback)
        from ...simd import _ops

        self.p = checked_params(params)
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
        self.mu: float | None = None   # Mirostat's running bound on the surprise (set at its first step)
        p = self.p
        self._dry = p.dry_on
        self._dry_table: dict = {}
        if self._dry:
            from .dry import apply_dry, breaker_table
            self._apply_dry = apply_dry   # imported once here, not at every step
            if tokenizer is not None and p.dry_breakers:
                self._dry_table = breaker_table(tokenizer, vocab_size, p.dry_breakers)

    def _penalize(self, logits: np.ndarray, history):
        p, n = self.p.repeat_penalty, self.p.repeat_last_n
        if p == 1.0 or n == 0 or not history:
            return
        recent = np.fromiter((t for t in (history if n < 0 else history[-n:]) if 0 <= t < self.vocab_size),
                             dtype=np.int64)
        if recent.size == 0:
            return
        ids = np.unique(recent)
        vals = logits[ids]
        # CTRL / llama.cpp rule: shrink positive logits, push negative ones further down
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            out = np.where(vals > 0, vals / np.float32(p), vals * np.float32(p))
            # a penalty float32 cannot hold (1e-38 dividing, 1e300 cast to inf: 0 * inf) made a finite logit
            # non-finite, which the draw took for corrupt weights: saturate those at float32's range instead. A
            # non-finite logit stays as it was (a mask's -inf times a penalty rounded to 0 was NaN; a model's NaN
            # or +inf is still told apart)
            finite = np.isfinite(vals)
            bad = finite & ~np.isfinite(out)
            if bad.any():
                v = vals[bad].astype(np.float64)
                out[bad] = np.clip(np.where(v > 0, v / p, v * p), -_F32_MAX, _F32_MAX)
            out[~finite] = vals[~finite]
        logits[ids] = out

    def _count_generated(self, history):
        """Fold the tokens generated since the last call into the counts (incrementally: one step's worth)."""
        if self._n_prompt is None:
            self._n_prompt = len(history)
        new = history[self._n_prompt + self._n_counted:]
        for t in new:
            self._counts[t] = self._counts.get(t, 0) + 1
        self._n_counted += len(new)

    def _presence_frequency(self, logits: np.ndarray, history):
        """OpenAI's rule over the generated tokens: logit[t] -= count[t] * frequency + (count[t] > 0) * presence;
        with penalize_prompt, llama.cpp's: the counts of the last repeat_last_n tokens, prompt included."""
        if self.p.penalize_prompt:
            n = self.p.repeat_last_n
            window = () if n == 0 else history if n < 0 else history[-n:]
            ids, c = np.unique(np.fromiter((t for t in window if 0 <= t < self.vocab_size), np.int64),
                               return_counts=True)
            c = c.astype(np.float32)
        else:
            self._count_generated(history)
            counts = {t: c for t, c in self._counts.items() if 0 <= t < self.vocab_size}
            ids = np.fromiter(counts.keys(), np.int64, len(counts))
            c = np.fromiter(counts.values(), np.float32, len(counts))
        if not ids.size:
            return
        logits[ids] -= c * np.float32(self.p.frequency_penalty) + np.float32(self.p.presence_penalty)

    def _record(self, logits: np.ndarray, tok: int):
        self.record = token_logprob(logits, tok, self.p.record_logprobs)

    def sample(self, logits: np.ndarray, history=()) -> int:
        p = self.p
        if self._bias_ids.size:
            logits[self._bias_ids] += self._bias_vals
        self._penalize(logits, history)
        if p.presence_penalty or p.frequency_penalty:
            self._presence_frequency(logits, history)
        if self._dry and history:
            n = len(history) if p.dry_penalty_last_n < 0 else p.dry_penalty_last_n
            self._apply_dry(logits, list(history[-n:]), self._dry_table, p.dry_multiplier, p.dry_base,
                            p.dry_allowed_length)
        # checked on what the draw sees, after the bias: a -inf bias on every token a mask leaves excludes them all
        # too (checked before it, argmax drew the banned token 0 with NaN logprobs). Bias and penalties keep a NaN
        # or +inf logit non-finite (+inf - inf is NaN), so the weights' fault is still told apart
        top = logits.max()   # NaN if any logit is NaN (one pass, ~1% of a decode step on a 128k vocabulary)
        if top == -np.inf:   # every token masked (a grammar) or banned (ignore_eos, a -inf bias): the request's doing
            raise NoTokenAllowedError(NO_TOKEN_ALLOWED)
        if not np.isfinite(top):
            raise BitNetError("the model produced NaN or infinite logits: its weights are corrupt",
                              hint="re-convert the model from its source")
        tok = self._choose(logits)
        if p.record_logprobs is not None:
            self._record(logits, tok)
        return tok

    def _choose(self, logits: np.ndarray) -> int:
        p = self.p
        if p.temperature <= 0.0:
            return int(np.argmax(logits))
        if p.mirostat:
            return self._mirostat(logits)
        cand, vals = self.candidates(logits)
        with np.errstate(over="ignore"):   # a tiny temperature sends all but the first to -inf: greedy
            w = np.exp((vals - vals[0]) / self.temperature_of(vals))
        c = np.cumsum(w)
        i = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return int(cand[min(i, len(cand) - 1)])

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their logits as float64), most likely first: what llama.cpp's chain keeps of the logits
        before the temperature -- top-n-sigma, top-k, typical, top-p, min-p, XTC (which draws from the rng when
        its probability is set). Each filter sees the probabilities of what the ones before it kept."""
        p = self.p
        v = logits.shape[0]
        k = p.top_k if 0 < p.top_k < v else v
        sigma_floor = -np.inf   # top-n-sigma: over every finite logit, before top-k (as llama.cpp's chain)
        lse = None   # set where top-p must see the probabilities of more tokens than `cand` keeps
        if p.top_n_sigma > 0.0:
            finite = logits[np.isfinite(logits)].astype(np.float64)
            if finite.size > 1:   # (below float32's range: every finite logit is kept, with no overflowing cast)
                sigma_floor = max(float(finite.max()) - p.top_n_sigma * float(finite.std()), -_F32_MAX)
        if k < v:
            got = self._topk(np.ascontiguousarray(logits, dtype=np.float32), self._top_heap, self._top_idx)
            cand = self._top_idx[:got]
            if sigma_floor > -np.inf:
                cand = cand[logits[cand] >= sigma_floor]
        elif p.min_p > 0.0 and p.typical_p >= 1.0 and p.min_keep <= 1:   # (a minimum may need tokens it drops)
            # min-p keeps prob >= min_p * max_prob, i.e. logit >= max + log(min_p): a prefilter, so the
            # vocabulary is sorted rarely (while the most likely token is there: typical sampling may drop it)
            cand = np.flatnonzero((logits >= logits.max() + np.float32(np.log(p.min_p))) & (logits >= sigma_floor))
            if p.top_p < 1.0:   # top-p runs first, on the probabilities of every token top-n-sigma left: the
                # prefilter's survivors are the most likely ones, so their running sum under the whole
                # normaliser is the start of top-p's own
                live = logits[logits >= sigma_floor].astype(np.float64)
                top = float(live.max())
                lse = top + float(np.log(np.sum(np.exp(live - top))))
        elif sigma_floor > -np.inf:
            cand = np.flatnonzero(logits >= sigma_floor)
        else:
            cand = np.arange(v)
        if cand.size == 0:   # top-n-sigma's floor above the rounding of the maximum: keep the maximum
            cand = np.array([int(np.argmax(logits))])
        vals = logits[cand].astype(np.float64)
        order = np.argsort(-vals, kind="stable")
        cand, vals = cand[order], vals[order]
        if vals[-1] == -np.inf and vals[0] > -np.inf:   # masked tokens (a grammar's, ignore_eos): never drawn
            live = int(np.count_nonzero(vals > -np.inf))
            cand, vals = cand[:live], vals[:live]
        probs = _softmax(vals)
        if p.typical_p < 1.0 and len(cand) > 1:
            shifted = np.abs(-np.log(probs) - float(-(probs * np.log(probs)).sum()))
            by_typical = np.argsort(shifted, kind="stable")
            over = np.flatnonzero(np.cumsum(probs[by_typical]) > p.typical_p)
            n = max(int(over[0]) + 1, p.min_keep) if over.size else len(by_typical)
            keep = np.sort(by_typical[:n])
            cand, vals = cand[keep], vals[keep]
            probs = _softmax(vals)
        keep = len(cand)
        if p.top_p < 1.0:
            running = np.cumsum(probs if lse is None else np.exp(vals - lse))
            keep = min(keep, max(int(np.searchsorted(running, p.top_p)) + 1, p.min_keep))
        if p.min_p > 0.0:   # relative to the most likely: the same on top-p's renormalized probabilities
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0])), p.min_keep))
        cand, vals = cand[:keep], vals[:keep]
        if p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5 and len(cand) > 1 \
                and self.rng.random() <= p.xtc_probability:
            above = int(np.count_nonzero(_softmax(vals) >= p.xtc_threshold))   # the most likely ones: a prefix
            if above > 1 and len(cand) - (above - 1) >= p.min_keep:   # all of them but the least likely goes
                cand, vals = cand[above - 1:], vals[above - 1:]
        return cand, vals

    def temperature_of(self, vals: np.ndarray) -> float:
        """The temperature for these candidates: the set one, or with dynatemp_range llama.cpp's entropy rule
        (from T - range, at least 0, when one token is all but certain, to T + range when all are alike)."""
        p = self.p
        if p.dynatemp_range <= 0.0 or len(vals) < 2:
            return p.temperature
        probs = _softmax(vals)
        nz = probs[probs > 0]
        entropy = float(-(nz * np.log(nz)).sum())
        lo, hi = max(0.0, p.temperature - p.dynatemp_range), p.temperature + p.dynatemp_range
        t = lo + (hi - lo) * (entropy / math.log(len(vals))) ** p.dynatemp_exponent
        return max(t, 1e-6)   # a temperature of 0 is the greedy choice: the first candidate

    def _mirostat(self, logits: np.ndarray) -> int:
        """Mirostat's draw among mirostat_candidates; mu then follows the token's surprise (bits, over the
        candidates) with learning rate eta, towards tau."""
        cand, probs = self.mirostat_candidates(logits)
        c = np.cumsum(probs)
        i = min(int(np.searchsorted(c, self.rng.random() * c[-1], side="right")), len(cand) - 1)
        self.mu -= self.p.mirostat_eta * (-math.log2(probs[i]) - self.p.mirostat_tau)
        return int(cand[i])

    def mirostat_candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their probabilities renormalized over them), most likely first, as llama.cpp's Mirostat
        keeps them after the temperature, over the whole vocabulary: v1, the top k with k from the Zipf exponent
        estimated on the 100 most likely tokens and 2^mu (every token once 2^mu overflows: any surprise is
        allowed); v2, every token of surprise <= mu bits (at least one). mu starts at 2 tau."""
        p = self.p
        if self.mu is None:
            self.mu = 2.0 * p.mirostat_tau
        # shifted so the most likely token is at 0 before the division: a temperature small enough that a logit /
        # temperature overflows (1e-308 on logits of a few units) sends the others to -inf, the greedy limit (the
        # unshifted +inf logits gave NaN probabilities and drew BOS, the first +inf); the same draws otherwise
        with np.errstate(over="ignore"):
            scaled = (logits.astype(np.float64) - float(logits.max())) / p.temperature
        v = scaled.shape[0]
        if p.mirostat == 1:
            m = max(1, min(100, int(np.count_nonzero(scaled > -np.inf))))   # masked tokens are no Zipf tail
            top = np.argpartition(-scaled, m - 1)[:m]
            top = top[np.argsort(-scaled[top], kind="stable")]
            lp = scaled[top] - _logsumexp(scaled)   # log-probabilities of the m most likely, over the vocabulary
            t = np.log(np.arange(2, m + 1) / np.arange(1, m))
            s_hat = float((t * (lp[:-1] - lp[1:])).sum() / (t * t).sum()) if m > 1 else 1.0
            eps = s_hat - 1.0
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                # in doubles, as llama.cpp in floats: one candidate left (a grammar's mask) makes eps 0 and 0 / 0,
                # tied logits s_hat 0; both give no finite k, so the top token alone (Python floats raised here)
                eps, s_hat = np.float64(eps), np.float64(s_hat)
                two_mu = np.float64(2.0) ** self.mu
                k = ((eps * two_mu) / (1.0 - np.float64(v) ** -eps)) ** (1.0 / s_hat)
            if two_mu == np.inf:   # mu past 1023 bits allows any surprise: every token, as v2 keeps (k of 1 made
                k = v              # a larger mu greedy: a cliff confident text reached after ~2,700 tokens)
            else:
                k = min(int(k), v) if np.isfinite(k) and k >= 1 else 1
            cand = np.argpartition(-scaled, k - 1)[:k] if k < v else np.arange(v)
        else:
            with np.errstate(over="ignore"):   # the surprise of a token far below the best: +inf bits
                cand = np.flatnonzero((_logsumexp(scaled) - scaled) / math.log(2.0) <= self.mu)
            if cand.size == 0:
                cand = np.array([int(np.argmax(scaled))])
        cand = cand[np.argsort(-scaled[cand], kind="stable")]
        return cand, _softmax(scaled[cand])


def _softmax(vals: np.ndarray) -> np.ndarray:
    e = np.exp(vals - vals.max())
    return e / e.sum()


def _logsumexp(vals: np.ndarray) -> float:
    m = float(vals.max())
    return m + float(np.log(np.exp(vals - m).sum()))
