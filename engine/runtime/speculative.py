"""Prompt-lookup speculative decoding: drafts come from the context itself, no draft model.

PromptLookup keeps an index of every n-gram (n = ngram_min .. ngram_max) of the tokens seen so far (prompt +
generated), mapped to the position right after its latest occurrence. propose() looks up the last n tokens,
longest n first, and returns what followed them last time (at most `k` tokens). The generator
(engine/generate.py) then runs the last sampled token plus the draft through Model.verify (one weight pass),
samples row by row exactly as plain decoding would, keeps the draft while it matches and truncates the cache
at the first mismatch. Since every emitted token is sampled from bit-identical logits with the same sampler
state, the output is identical with and without speculation, for greedy and seeded sampling alike.

Draft length adapts (DraftLength): a verify pass of M rows costs more than one decode once the int8 dot
products stop hiding under the weight reads (measured on the 2-core machine: M=2 ~1.2x a decode, M=4 ~2x),
so a draft shrinks after a rejection and grows again after full acceptance.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..errors import BitNetError

DRAFT_MAX_DEFAULT = 4        # when enabled (--draft-max / --lookup-ngram-min); off by default: default_lookup
NGRAM_MIN_DEFAULT = 2
NGRAM_MAX_DEFAULT = 4


@dataclass(frozen=True)
class LookupParams:
    draft_max: int = DRAFT_MAX_DEFAULT    # 0 disables speculation (llama.cpp: --draft-max)
    ngram_min: int = NGRAM_MIN_DEFAULT    # shortest match that may propose (llama.cpp: --lookup-ngram-min)
    ngram_max: int = NGRAM_MAX_DEFAULT    # longest match tried first

    def check(self, flags: bool = False) -> "LookupParams":
        """Self, or one BitNetError naming the field (flags: by its command-line flag): whole numbers only (a
        float or a str failed deep inside the scheduler, stopping an Engine for good)."""
        names = {"draft_max": "--draft-max", "ngram_min": "--lookup-ngram-min"} if flags else {}
        for field, minimum, why in (("draft_max", 0, " (0 disables prompt lookup)"), ("ngram_min", 1, ""),
                                    ("ngram_max", 1, "")):
            value = getattr(self, field)
            said = f"{names.get(field, 'LookupParams.' + field)} {value!r}"
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise BitNetError(f"{said}: must be a whole number (int), not {type(value).__name__}")
            if value < minimum:
                raise BitNetError(f"{said}: must be >= {minimum}{why}")
        if self.ngram_max < self.ngram_min:
            raise BitNetError(f"LookupParams.ngram_max {self.ngram_max} < ngram_min {self.ngram_min}")
        return self


OFF = LookupParams(draft_max=0)


def checked_lookup(lookup) -> LookupParams:
    """`lookup` as the Python API takes it: a LookupParams (checked), else one BitNetError."""
    if not isinstance(lookup, LookupParams):
        raise BitNetError(f"lookup: a LookupParams (engine.api.LookupParams(draft_max=...)), not {type(lookup).__name__}")
    return lookup.check()


class PromptLookup:
    """Index of the n-grams of a growing token list; propose(tokens, k) -> up to k continuation tokens."""

    def __init__(self, params: LookupParams):
        self.p = params
        self._index: dict[tuple[int, ...], int] = {}
        self._done = 0  # positions whose preceding n-grams are indexed

    def _update(self, tokens) -> None:
        lo, hi = self.p.ngram_min, self.p.ngram_max
        idx = self._index
        for pos in range(max(self._done, 1), len(tokens)):  # n-grams ending just before tokens[pos]
            for n in range(lo, min(hi, pos) + 1):
                idx[tuple(tokens[pos - n: pos])] = pos
        self._done = max(self._done, len(tokens))

    def propose(self, tokens, k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix of tokens (<= k)."""
        if k <= 0:
            return []
        self._update(tokens)
        end = len(tokens)
        for n in range(min(self.p.ngram_max, end - 1), self.p.ngram_min - 1, -1):
            start = self._index.get(tuple(tokens[end - n:]))
            if start is not None:
                return list(tokens[start: min(start + k, end)])
        return []


class DraftLength:
    """Adaptive draft length: halve after a rejection at the first draft token, cut to accepted+1 after a
    later rejection, grow by one after full acceptance (bounded by draft_max). After a pass that accepted
    nothing, drafting pauses for `backoff` tokens, doubling (up to 32) on each further miss, so text that does
    not repeat pays for a failed verify pass rarely (a 2-row pass costs ~1.1-1.3 decodes here)."""

    BACKOFF_MAX = 32

    def __init__(self, draft_max: int):
        self.max = draft_max
        self.k = draft_max
        self.backoff = 1
        self.cooldown = 0

    def ready(self) -> bool:
        """Whether to look for a draft at this token (call once per token that would be decoded)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return False
        return True

    def update(self, proposed: int, accepted: int) -> None:
        if accepted >= proposed:
            self.k = min(self.max, self.k + 1)
        else:
            self.k = max(1, accepted + 1 if accepted else self.k // 2)
        if accepted == 0:
            self.cooldown = self.backoff
            self.backoff = min(self.BACKOFF_MAX, self.backoff * 2)
        else:
            self.backoff, self.cooldown = 1, 0


def choose_draft(cm, n_forced: int, finder: PromptLookup | None, tokens, k: int) -> tuple[list[int], bool]:
    """The draft of one decode step and whether prompt lookup made it (its length adapts; forced ones do not).
    The grammar's forced tokens come first (up to n_forced: where only one continuation is allowed, every one
    is accepted); otherwise up to k tokens that finder proposes from tokens (finder None: no lookup), cut at
    the first one the grammar (cm, or None) forbids. Shared by the generator and the batching scheduler."""
    draft = cm.forced(n_forced) if cm is not None and n_forced > 0 else []
    if draft or finder is None:
        return draft, False
    draft = finder.propose(tokens, k)
    return (cm.valid_prefix(draft) if cm is not None else draft), True


def default_lookup(model) -> LookupParams:
    """Off unless asked for (--draft-max K): the rule is "on by default only where never slower", and on the
    2-core machine a verify pass is compute-bound from M = 3 rows (1.6x a decode; 2 rows 1.06-1.19x), so on
    the synthetic 2B model (random weights, 32% of drafts accepted on repetitive code) decode measured 0.74x
    with lookup in one run (bench/decode_rows.py, docs/speculative.md). The bundled
    model has an f16 head, whose verify reads the head once per row."""
    return OFF


def lookup_from_flags(draft_max: int | None, ngram_min: int | None) -> LookupParams | None:
    """--draft-max / --lookup-ngram-min -> LookupParams (None when neither is given: the default policy)."""
    if draft_max is None and ngram_min is None:
        return None
    if draft_max is None:
        draft_max = DRAFT_MAX_DEFAULT
    n = NGRAM_MIN_DEFAULT if ngram_min is None else ngram_min
    return LookupParams(draft_max=draft_max, ngram_min=n, ngram_max=max(n, NGRAM_MAX_DEFAULT)).check(flags=True)
