"""The engine's per-token log-probabilities (Chunk.logprob, a TokenLogprob) in OpenAI's two shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
Both shared by the ollama adapter (serve/ollama.py), which uses the chat shape's entries.
A token that can never be sampled (logit -inf: ignore_eos, a -100 bias pushed to nothing) has logprob -inf,
which JSON cannot carry; OpenAI reports such tokens as -9999.0, and so do we.
"""
from __future__ import annotations

import math
from collections import deque

NEVER = -9999.0   # OpenAI's stand-in for log(0)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NEVER


class Said:
    """One answer's (token, TokenLogprob) records as its text is released: a token's record is given out (appended
    to `items`) once the engine says its text has begun to be released (Chunk.said). The tokens of a stop string,
    which the answer leaves out, are never given out, and the records of tokens held back as a possible stop
    string go out with their text: a stream's chunks carry the same records as the whole answer."""

    def __init__(self):
        self.items: list[tuple[int, object]] = []
        self._held: deque = deque()   # (token, TokenLogprob or None) of the tokens not said yet
        self._n = 0   # tokens said

    def add(self, ch) -> None:
        if ch.token is not None:
            self._held.append((ch.token, ch.logprob))
        while self._n < ch.said and self._held:
            t, lp = self._held.popleft()
            self._n += 1
            if lp is not None:
                self.items.append((t, lp))


class TokenText:
    """token id -> (text, bytes) as a logprobs entry shows it, cached per id (a tokenizer lookup per token)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, i: int) -> tuple[str, bytes]:
        got = self._cache.get(i)
        if got is None:
            b = self.tok.token_bytes(i)
            got = (b.decode("utf-8", errors="replace"), b)
            self._cache[i] = got
        return got


def chat_entry(text_of: TokenText, token: int, lp, n_top: int) -> dict:
    """One chat logprobs `content` entry for a generated token (lp: its TokenLogprob)."""
    text, b = text_of(token)
    top = []
    for i, v in lp.top[:n_top]:
        t, tb = text_of(i)
        top.append({"token": t, "logprob": _finite(v), "bytes": list(tb)})
    return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(b), "top_logprobs": top}


def completion_logprobs(text_of: TokenText, items: list[tuple[int, object]], n_top: int, offset: int) -> dict:
    """The completions `logprobs` object for (token, TokenLogprob) items whose text starts at `offset` of the
    completion (text_offset counts characters of the tokens' own texts, as OpenAI's does)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in items:
        text, _ = text_of(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(lp.logprob))
        top: dict[str, float] = {}
        for i, v in lp.top[:n_top]:
            top.setdefault(text_of(i)[0], _finite(v))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def echo_logprobs(text_of: TokenText, ids: list[int], scores: list, first: int, n_top: int) -> tuple[dict, int]:
    """The completions `logprobs` of an echoed prompt, tokens ids[first:] (first 1: a BOS the server added is not
    echoed), scores[j - 1] being token j's TokenLogprob (engine/batching/score.py); token 0 has none (null, as
    OpenAI's). Returns the object and the text offset where the completion's own tokens start."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for j in range(first, len(ids)):
        text, _ = text_of(ids[j])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if j == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp = scores[j - 1]
        out["token_logprobs"].append(_finite(lp.logprob))
        top: dict[str, float] = {}
        for i, v in lp.top[:n_top]:
            top.setdefault(text_of(i)[0], _finite(v))
        out["top_logprobs"].append(top)
    return out, offset
