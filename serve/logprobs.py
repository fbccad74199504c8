"""The engine's per-token log-probabilities (Chunk.logprob, a TokenLogprob) in OpenAI's two shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`: a token that is no
whole UTF-8 text on its own (a byte of a character split over tokens) is written "bytes:\\xNN...", as OpenAI's
legacy completions write it, so different tokens never share a name; text_offset is where the token's first byte
lies in the returned text, in characters (the bytes of one character share its offset, as OpenAI's do).
Both shared by the ollama adapter (serve/ollama.py), which uses the chat shape's entries.
A token that can never be sampled (logit -inf: ignore_eos, a -100 bias pushed to nothing) has logprob -inf,
which JSON cannot carry; OpenAI reports such tokens as -9999.0, and so do we.
"""
from __future__ import annotations

import codecs
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


def legacy_name(b: bytes) -> str:
    """A token's name in the completions (legacy) logprobs: its text, or "bytes:" and each byte as \\xNN where its
    bytes are no whole UTF-8 text (part of a character), as OpenAI's legacy completions name such a token."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


class TextOffsets:
    """text_offset of a completion's tokens, in characters of its returned text: each token's bytes go through an
    incremental UTF-8 decoder, as the engine's text does (engine/formats/tokenizer.py StreamDecoder), so a token
    is at the character its first byte lies in, the bytes of a character split over tokens share that
    character's offset, and no offset runs past the text. skip_special: special tokens add no text (a generated
    answer's text leaves them out; an echoed prompt's keeps them)."""

    def __init__(self, tokenizer, start: int = 0, skip_special: bool = True):
        self.tok, self.at, self.skip = tokenizer, start, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token: int) -> int:
        """The offset of this token, the next of the text."""
        here = self.at
        if not (self.skip and self.tok.is_special(token)):
            self.at += len(self._utf8.decode(self.tok.token_bytes(token)))
        return here

    def close(self) -> int:
        """The offset past the text's end (bytes of a character left incomplete decode to U+FFFD, as the text's)."""
        self.at += len(self._utf8.decode(b"", final=True))
        return self.at


def _legacy_top(text_of: TokenText, lp, n_top: int) -> dict[str, float]:
    top: dict[str, float] = {}
    for i, v in lp.top[:n_top]:
        top.setdefault(legacy_name(text_of(i)[1]), _finite(v))
    return top


def completion_logprobs(text_of: TokenText, items: list[tuple[int, object]], n_top: int,
                        offsets: TextOffsets) -> dict:
    """The completions `logprobs` object for (token, TokenLogprob) items, the next of a completion whose text
    offsets `offsets` counts (one per choice, kept across a stream's chunks)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in items:
        out["tokens"].append(legacy_name(text_of(token)[1]))
        out["token_logprobs"].append(_finite(lp.logprob))
        out["top_logprobs"].append(_legacy_top(text_of, lp, n_top))
        out["text_offset"].append(offsets.take(token))
    return out


def echo_logprobs(text_of: TokenText, ids: list[int], scores: list, first: int, n_top: int,
                  echoed: str) -> tuple[dict, int]:
    """The completions `logprobs` of an echoed prompt, tokens ids[first:] (first 1: a BOS the server added is not
    echoed), scores[j - 1] being token j's TokenLogprob (engine/batching/score.py); token 0 has none (null, as
    OpenAI's). echoed: the prompt's text as the answer shows it. Returns the object and the text offset where the
    completion's own tokens start (the echoed text's length)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offsets = TextOffsets(text_of.tok, skip_special=False)
    for j in range(first, len(ids)):
        out["tokens"].append(legacy_name(text_of(ids[j])[1]))
        out["text_offset"].append(min(offsets.take(ids[j]), len(echoed)))
        if j == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp = scores[j - 1]
        out["token_logprobs"].append(_finite(lp.logprob))
        out["top_logprobs"].append(_legacy_top(text_of, lp, n_top))
    return out, len(echoed)


class ShownRecords:
    """The (token, TokenLogprob) items of a chat answer whose text a tool-call parser reads: an item goes out once
    its token's text has begun in the text shown (content, or a thought's reasoning before it), and the items of
    the text the parser turned into tool calls (the <tool_call> markup and the call in it) never do, so
    `logprobs.content` covers the text the message shows. The answer's text is counted in bytes (a token by its
    bytes, a special token by none: the text leaves it out); each step says how many bytes of it were released
    (shown or turned into calls) and how many of those, at their end, went into calls. A stream's steps and a whole
    answer's one step give the same items where the text after a call is whitespace (what a call's grammar lets
    come after it); text after a call in the same step as it is counted as the call's."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._pending: deque = deque()   # (byte where the token starts, item)
        self._end = 0      # bytes of the tokens taken in
        self._done = 0     # bytes released so far

    def _size(self, token: int) -> int:
        return 0 if self.tok.is_special(token) else len(self.tok.token_bytes(token))

    def step(self, items, released: int, called: int, last: bool = False) -> list:
        """The items to give out now, given the new items, `released` new bytes of text (the last `called` of them
        turned into calls); last: the answer's end (an item of no text after the last shown one goes out with it,
        unless a call ended the answer)."""
        for it in items:
            self._pending.append((self._end, it))
            self._end += self._size(it[0])
        upto = self._done + released
        shown_to = upto - called
        out = []
        while self._pending and (self._pending[0][0] < upto or (last and not called)):
            at, it = self._pending.popleft()
            if at < shown_to or (last and not called and at >= upto):
                out.append(it)
        self._done = upto
        return out
