"""Reasoning ("thinking") in an answer: the <think>...</think> block a thinking model writes before its answer
(Qwen3 and Ternary Bonsai, DeepSeek-R1 distills), split from the answer as llama-server's --reasoning-format
deepseek splits it (OpenAI-style `reasoning_content`; ollama's `message.thinking`).

    thinks(template)                   # does this chat template think (it knows <think> and </think>)?
    s = ThinkSplitter(opened=prompt_opens_thought(prompt_text))
    s.feed(text) -> (reasoning, content)   # as the answer streams; a half-written tag is held back
    s.finish() -> (reasoning, content)     # the rest

The block is the answer's start: <think> first (after whitespace), or already open when the template's generation
prompt ends with <think> (R1's templates, Qwen3's with the thought forced); text after </think> is the answer,
its leading whitespace dropped, and the reasoning has no leading or trailing whitespace. An answer that does not
start with <think> is all content; one whose </think> never comes (max_tokens) is all reasoning, as llama.cpp's.
"""
from __future__ import annotations

import numpy as np

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    return bool(template) and OPEN in template and CLOSE in template


def prompt_opens_thought(prompt_text: str) -> bool:
    """The generation prompt ends inside an open <think> block: the answer starts as reasoning."""
    return prompt_text.rstrip().endswith(OPEN)


def _partial(buf: str, tag: str) -> int:
    """The length of the longest end of buf that starts tag (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    def __init__(self, opened: bool = False):
        self.mode = "think" if opened else "start"   # start -> think -> after -> content, or start -> content
        self.buf = ""
        self.said = False   # some reasoning has been given out (its leading whitespace is dropped before)
        self.opened = opened   # the answer starts inside the thought (the prompt opened it)

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.mode == "start":
                s = self.buf.lstrip()
                if not s or (OPEN.startswith(s) and s != OPEN):
                    return reasoning, content   # whitespace, or the start of <think>: not known yet
                if s.startswith(OPEN):
                    self.buf, self.mode = s[len(OPEN):], "think"
                    continue
                self.mode = "content"
                continue
            if self.mode == "think":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    reasoning += self._reason(self.buf[:i].rstrip())
                    self.buf, self.mode = self.buf[i + len(CLOSE):], "after"
                    continue
                body = self.buf[: len(self.buf) - _partial(self.buf, CLOSE)]
                kept = body.rstrip()   # trailing whitespace waits: it may be the last before </think>
                reasoning += self._reason(kept)
                self.buf = self.buf[len(kept):]
                return reasoning, content
            if self.mode == "after":
                s = self.buf.lstrip()
                if not s:
                    self.buf = ""
                    return reasoning, content
                self.buf, self.mode = s, "content"
                continue
            content += self.buf
            self.buf = ""
            return reasoning, content

    def _reason(self, text: str) -> str:
        if not self.said:
            text = text.lstrip()
            self.said = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """The rest: text held back as a possible tag is what it was (reasoning inside the block, content before)."""
        rest, self.buf = self.buf, ""
        if self.mode == "think":   # a closing tag cut part-way (max_tokens, a stop string) is markup, not thought
            n = _partial(rest, CLOSE)
            return self._reason(rest[: len(rest) - n].rstrip() if n > 1 else rest.rstrip()), ""
        if self.mode == "start":
            return "", rest.strip() and rest
        return "", rest if self.mode == "content" else ""


# ---- the reasoning budget (llama.cpp's --reasoning-budget) ----------------------------------------------------
# After `budget` tokens inside the answer's <think> block, the next tokens are forced to the budget message and
# the closing tag, and the answer goes on from there; a thought that closes in time is left alone. It is applied
# as a token mask around the sequence's grammar matcher (engine/runtime/constraints.py), so the single-stream
# generator and the batching scheduler run it the same way, drafts included (each row is masked as it is sampled).
BUDGET_END = "\n" + CLOSE + "\n\n"


def writes_close(spec) -> bool:
    """A grammar (GBNF, Lark, a regex) whose text holds </think>: the one kind that may continue a thought."""
    return spec is not None and spec.kind in ("gbnf", "lark", "regex") and CLOSE in spec.source


def continues_thought(spec, matcher, tokenizer) -> bool:
    """A grammar that writes </think> but cannot open a thought itself: it continues the one the prompt opened
    (R1's templates, Qwen3's forced one), so its output up to </think> is that thought."""
    if not writes_close(spec):
        return False
    ids = tokenizer.encode(OPEN, add_bos=False, special=True)
    return matcher.valid_prefix(ids) != ids


def budget_matcher(inner, tokenizer, prompt_ids, budget: int, message: str = ""):
    """`inner` (a grammar's TokenMatcher, or None) wrapped in a ThoughtBudget of `budget` tokens (-1: none, inner
    as it is). The answer starts inside the thought where the prompt ends with an open <think>, unless a grammar
    decides how it starts (the think splitter's rule, engine.api think_splitter: its output is the answer)."""
    if budget is None or budget < 0:
        return inner
    free = inner is None or getattr(inner.spec, "free_start", False) or continues_thought(inner.spec, inner, tokenizer)
    opened = free and prompt_opens_thought(tokenizer.decode(list(prompt_ids[-8:])))
    forced = tokenizer.encode(message + BUDGET_END, add_bos=False, special=True)
    return ThoughtBudget(inner, tokenizer, budget, forced, opened)


class ThoughtBudget:
    """A TokenMatcher's interface (apply / advance / done / forced / valid_prefix / start_mask) over an optional
    inner one. States: start (before the answer's first text: a <think> there opens the count), count, force (the
    forced tokens, one a step), off (the thought closed, or never opened: the inner matcher alone)."""

    def __init__(self, inner, tokenizer, budget: int, forced: list[int], opened: bool):
        self.inner, self.left, self.forced_ids = inner, int(budget), list(forced)
        self.jump_forward = inner.jump_forward if inner is not None else False
        self.detok = tokenizer.stream(skip_special=False)   # the tags, even where a tokenizer calls them special
        self.text = ""          # the text of the thought so far that may still hold (part of) a tag
        self.i = 0              # the next forced token
        self.state = "start"
        if opened:
            self._open()

    def _open(self):
        self.state, self.text = "count", ""
        if self.left <= 0:
            self._force()

    def _force(self):
        """Force the end, if the grammar lets all of it come here (else a piece of it would be written, and the
        thought go on after all: the output is then the grammar's own, as without a budget)."""
        ok = self.forced_ids and (self.inner is None or self.inner.valid_prefix(self.forced_ids) == self.forced_ids)
        # a grammar that forbids the end only here (inside a phrase it writes): tried again after the next token
        self.state = "force" if ok else "count" if self.inner is not None else "off"

    # -- the matcher interface ------------------------------------------------------------------------------
    def start_mask(self):
        if self.inner is not None:
            self.inner.start_mask()

    def apply(self, logits):
        if self.inner is not None:
            self.inner.apply(logits)
        if self.state == "force":
            t = self.forced_ids[self.i]
            v = logits[t]
            if v == -np.inf:   # the grammar forbids the end of the thought here: it goes on as the grammar says,
                self.state = "count" if self.i == 0 else "off"   # the end tried again after the next token
                return
            logits[:] = -np.inf
            logits[t] = v

    def advance(self, token: int):
        if self.inner is not None:
            self.inner.advance(token)
        state = self.state
        if state == "off":
            return
        if state == "force":
            self.i += 1
            if self.i >= len(self.forced_ids) or token != self.forced_ids[self.i - 1]:
                self.state = "off"
            return
        self.text += self.detok.push(token)
        if state == "start":
            s = self.text.lstrip()
            if s.startswith(OPEN):
                self.text = s[len(OPEN):]
                self._open()
                state = self.state
                if state != "count":
                    return
            elif s and not OPEN.startswith(s):
                self.state = "off"   # the answer does not start with a thought
                return
            else:
                return
        else:
            self.left -= 1
        if CLOSE in self.text:
            self.state = "off"
            return
        self.text = self.text[-(len(CLOSE) - 1):]
        if self.left <= 0 and not self.detok.pending:   # not inside a character: it would be cut in two
            self._force()

    @property
    def done(self) -> bool:
        return self.inner.done if self.inner is not None else False

    @property
    def accepting(self) -> bool:
        return self.inner.accepting if self.inner is not None else True

    def forced(self, limit: int) -> list[int]:
        if self.state == "force" or self.inner is None:
            return []
        return self.inner.forced(limit)

    def valid_prefix(self, tokens) -> list[int]:
        return self.inner.valid_prefix(tokens) if self.inner is not None else list(tokens)
