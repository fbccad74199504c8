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

import threading
import weakref
from collections import OrderedDict

from .constraints import vocab_bytes

TABLES_KEPT = 16                     # breaker lists remembered per tokenizer (each costs a scan of the vocabulary)
MAX_BREAKER_BYTES = 40               # a longer breaker is cut to this (llama.cpp's MAX_CHAR_LEN)
MAX_TAIL_TOKENS = 20                 # a breaker's tail is cut to this (its MAX_SEQ_LEN)
FLOAT_MAX_LOG = 88.7228391           # log(FLT_MAX): the exponent is clamped so the penalty stays finite

_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _overlaps(tok, words: list[bytes], breaker: bytes, table: dict[int, list[tuple[int, ...]]]):
    """llama.cpp's get_overlapping_token_sequences: each token holding the breaker (an empty tail), or ending in
    its first bytes (the tail: the rest of the breaker, tokenized)."""
    first = breaker[:1]
    for tid, word in enumerate(words):
        if not word:
            continue
        if breaker in word:
            table.setdefault(tid, [])
            if () not in table[tid]:
                table[tid].append(())
            continue
        pos = word.find(first)
        while pos != -1:
            i = 1
            while i < len(breaker) and pos + i < len(word) and word[pos + i] == breaker[i]:
                i += 1
            if i == len(breaker) or pos + i == len(word):   # matched up to the word's end
                rest = breaker[i:].decode("utf-8", "ignore")
                tail = tuple(tok.encode(rest, add_bos=False, special=False)[:MAX_TAIL_TOKENS]) if rest else ()
                tails = table.setdefault(tid, [])
                if tail not in tails:
                    tails.append(tail)
            pos = word.find(first, pos + 1)


def breaker_table(tok, n_vocab: int, breakers) -> dict[int, list[tuple[int, ...]]]:
    """{head token id: [tails]} for the breakers (strings), cached per tokenizer (the TABLES_KEPT lists used last:
    requests that each send other breakers cannot grow it without bound)."""
    key = (n_vocab, tuple(breakers))
    with _LOCK:
        per_tok = _TABLES.setdefault(tok, OrderedDict())
        hit = per_tok.get(key)
        if hit is not None:
            per_tok.move_to_end(key)
    if hit is not None:
        return hit
    words = vocab_bytes(tok, n_vocab)
    table: dict[int, list[tuple[int, ...]]] = {}
    for b in breakers:
        raw = b.encode("utf-8")[:MAX_BREAKER_BYTES]
        if raw:
            _overlaps(tok, words, raw, table)
    with _LOCK:
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

    max_exp = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    with np.errstate(over="ignore"):   # multiplier * base^max_exp may pass FLT_MAX: -inf, as in llama.cpp's float
        for t, r in reps.items():
            if not 0 <= t < logits.shape[0] or () in table.get(t, ()):
                continue
            e = r - allowed_length
            if max_exp > 0 and e > max_exp:
                e = max_exp
            logits[t] -= multiplier * base ** e
