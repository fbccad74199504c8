"""DRY ("Don't Repeat Yourself"), llama.cpp's repetition sampler (from koboldcpp): a token that would extend a
sequence already seen in the last N tokens loses multiplier * base ^ (its length - allowed_length) of its logit;
sequence breakers (SamplingParams' default: newline, colon, quote, asterisk) cut the sequences a repeat may span.

    table = breaker_table(tokenizer, n_vocab, breakers)   # once per tokenizer and breaker list (cached)
    dry_penalties(window, table, allowed_length) -> {token id: longest repeat it would extend}

Each breaker is matched against every token's text as llama.cpp does (a token holding the whole breaker is a
single-token breaker; a token ending in its first characters is the head of a sequence whose tail is the rest,
tokenized, at most 20 tokens), so the same ids break the same repeats.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

import numpy as np

from .constraints import vocab_bytes

TABLES_KEPT = 16                     # breaker lists remembered per tokenizer (each costs a scan of the vocabulary)
MAX_BREAKER_BYTES = 40               # a longer breaker is cut to this (llama.cpp's MAX_CHAR_LEN)
MAX_TAIL_TOKENS = 20                 # a breaker's tail is cut to this (its MAX_SEQ_LEN)
FLOAT_MAX_LOG = 88.7228391           # log(FLT_MAX): the exponent is clamped so the penalty stays finite

_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _after_fork_in_child():
    """A fork()ed child gets the lock as the parent's threads held it: a table stored by another thread at the
    fork would leave it held for ever there (the tables themselves are whole at any moment)."""
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Vocab:
    """Every token's text in one byte array, and where each ends: a breaker is searched once over the whole
    vocabulary (numpy), not token by token."""

    def __init__(self, words: list[bytes]):
        self.data = np.frombuffer(b"".join(words), np.uint8)
        self.ends = np.cumsum(np.fromiter(map(len, words), np.int64, len(words)))

    def hits(self, needle: bytes):
        """(token ids, bytes after the occurrence in that token's text) of every occurrence of needle lying inside
        one token's text."""
        n = len(needle)
        at = np.flatnonzero(self.data[:max(0, self.data.size - n + 1)] == needle[0])
        for j in range(1, n):
            at = at[self.data[at + j] == needle[j]]
        tid = np.searchsorted(self.ends, at, side="right")   # the token whose text holds the occurrence's start
        left = self.ends[tid] - at - n
        return tid[left >= 0], left[left >= 0]


def _overlaps(tok, vocab: _Vocab, breaker: bytes, table: dict[int, list[tuple[int, ...]]],
              seen: dict[int, set]):
    """llama.cpp's get_overlapping_token_sequences: each token holding the breaker (an empty tail), or ending in
    its first bytes (the tail: the rest of the breaker, tokenized; the longest such ending first). seen: each
    token's tails as a set (a list's `in` made many breakers sharing a token quadratic)."""
    def add(tid, tail):
        if tail not in seen.setdefault(tid, set()):
            seen[tid].add(tail)
            table.setdefault(tid, []).append(tail)
    holders = set(vocab.hits(breaker)[0].tolist())
    for tid in sorted(holders):
        add(tid, ())
    for i in range(len(breaker) - 1, 0, -1):   # the token's text ends in breaker[:i]
        tid, left = vocab.hits(breaker[:i])
        ends_in = sorted(set(tid[left == 0].tolist()) - holders)
        if not ends_in:
            continue
        rest = breaker[i:].decode("utf-8", "ignore")
        tail = tuple(tok.encode(rest, add_bos=False, special=False)[:MAX_TAIL_TOKENS]) if rest else ()
        for t in ends_in:
            add(t, tail)


def cached_table(tok, n_vocab: int, breakers) -> dict[int, list[tuple[int, ...]]] | None:
    """breaker_table's answer if it is cached (then kept as the list used last), else None: never scans."""
    key = (n_vocab, tuple(breakers))
    with _LOCK:
        per_tok = _TABLES.setdefault(tok, OrderedDict())
        hit = per_tok.get(key)
        if hit is not None:
            per_tok.move_to_end(key)
    return hit


def breaker_table(tok, n_vocab: int, breakers) -> dict[int, list[tuple[int, ...]]]:
    """{head token id: [tails]} for the breakers (strings), cached per tokenizer (the TABLES_KEPT lists used last:
    requests that each send other breakers cannot grow it without bound). The first table of a tokenizer reads
    every token's bytes (~0.3 s for 128k tokens), each new list then tens of ms: a server builds it off its event
    loop (engine.api's prepare_sampling)."""
    hit = cached_table(tok, n_vocab, breakers)
    if hit is not None:
        return hit
    key = (n_vocab, tuple(breakers))
    vocab = _Vocab(vocab_bytes(tok, n_vocab))
    table: dict[int, list[tuple[int, ...]]] = {}
    seen: dict[int, set] = {}
    for b in breakers:
        raw = b.encode("utf-8")[:MAX_BREAKER_BYTES]
        if raw:
            _overlaps(tok, vocab, raw, table, seen)
    with _LOCK:
        per_tok = _TABLES.setdefault(tok, OrderedDict())
        per_tok[key] = table
        while len(per_tok) > TABLES_KEPT:
            per_tok.popitem(last=False)
    return table


def dry_penalties(window, table: dict[int, list[tuple[int, ...]]], allowed_length: int) -> dict[int, int]:
    """{token: the longest repeat (in tokens, before it) that emitting it would extend} over `window` (the last N
    tokens, oldest first), as llama.cpp computes it: the repeats stop at the last sequence breaker, and only
    those of at least allowed_length count."""
    n = len(window)
    if n <= allowed_length:
        return {}
    rat = window[::-1]   # rat[i]: the token i places from the end
    # 1. the last breaker (its head, then its tail before it) bounds how long a repeat may be
    rep_limit = n
    for i in range(n):
        tails = table.get(rat[i])
        if tails is None:
            continue
        longest = -1
        for tail in tails:
            size = len(tail)
            if longest < size <= i and all(tail[o] == rat[i - o - 1] for o in range(size)):
                longest = size
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return {}
    # 2. for every earlier position, how many tokens before it equal the window's last ones (the Z-algorithm on
    #    the reversed window, each length capped at rep_limit)
    count = [0] * n
    last = n - 1
    lt = rt = 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat[m] == rat[m + k]:
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p = k - lt
            right = rt - k + 1
            if count[last - p] < right:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat[i] == rat[i - k]:
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    # 3. the token after each such repeat would extend it
    out: dict[int, int] = {}
    for i in range(n - 1):
        r = count[i]
        if r >= allowed_length:
            t = rat[n - 2 - i]
            if out.get(t, -1) < r:
                out[t] = r
    return out


def apply_dry(logits, window, table, multiplier: float, base: float, allowed_length: int) -> None:
    """Subtract DRY's penalty from the logits of the tokens that would extend a repeat (never from a
    single-token breaker)."""
    import math

    reps = dry_penalties(window, table, allowed_length)
    if not reps:
        return
    import numpy as np

    # whole (base^max_exp stays under FLT_MAX), but a fraction below 1, as llama.cpp's float, for a base over
    # e^88.7: an integer 0 there left the exponent unclamped and Python's float power raised OverflowError
    max_exp = FLOAT_MAX_LOG / math.log(base) if base > 1 else math.inf
    if 1 <= max_exp < math.inf:
        max_exp = math.floor(max_exp)
    with np.errstate(over="ignore"):   # multiplier * base^max_exp may pass FLT_MAX: -inf, as in llama.cpp's float
        for t, r in reps.items():
            if not 0 <= t < logits.shape[0] or () in table.get(t, ()):
                continue
            logits[t] -= multiplier * base ** min(r - allowed_length, max_exp)
