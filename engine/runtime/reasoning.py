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
        if self.mode == "think":
            return self._reason(rest.rstrip()), ""
        if self.mode == "start":
            return "", rest.strip() and rest
        return "", rest if self.mode == "content" else ""
