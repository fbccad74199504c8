"""Output: streamed answer text to stdout, notices and the dim stats line, plain when not a terminal.

stdout carries the answers; hints, notices and stats go to stderr when stdout is not a terminal
(so `bitchat < questions.txt > answers.txt` gives only the answers), and to the terminal otherwise.
Colour only on a terminal and never when NO_COLOR is set.
"""
from __future__ import annotations

import os
import sys

# Model output is untrusted text: on a terminal, control characters (an ESC could move the cursor,
# recolour or clear the screen) are shown as their visible Unicode "control pictures" instead.
_VISIBLE_CONTROLS = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"}
_VISIBLE_CONTROLS.update({0x7F: 0x2421, **{c: 0xFFFD for c in range(0x80, 0xA0)}})

DIM = "\x1b[2m"
YELLOW = "\x1b[33m"
RESET = "\x1b[0m"


def format_stats(stats, n_shown: int | None = None) -> str:
    """The one-line summary after an answer: tokens, time to first token, decode speed."""
    if stats is None:
        return f"[{n_shown or 0} tokens]"
    n = getattr(stats, "n_generated", n_shown) or 0
    ttft = getattr(stats, "ttft_s", None)
    tps = getattr(stats, "decode_tps", None)
    n_prompt = getattr(stats, "n_prompt", None)
    n_cached = getattr(stats, "n_cached", None)
    parts = [f"{n} tokens"]
    if ttft is not None:
        parts.append(f"first token {ttft * 1000:.0f} ms")
    if tps:
        parts.append(f"{tps:.1f} tok/s")
    if n_prompt is not None and n_cached is not None:
        parts.append(f"prefill {max(n_prompt - n_cached, 0)} new of {n_prompt}")
    reason = getattr(stats, "finish_reason", None)
    if reason in ("length", "context", "interrupted"):
        parts.append({"length": "stopped at max_tokens", "context": "context full",
                      "interrupted": "interrupted"}[reason])
    return "[" + ", ".join(parts) + "]"


class Output:
    """Where each kind of text goes, and whether it is decorated."""

    def __init__(self, out=None, err=None, interactive: bool | None = None):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.interactive = self.out.isatty() if interactive is None else interactive
        self.color = self.interactive and not os.environ.get("NO_COLOR")
        self.at_line_start = True

    # the answer, piece by piece
    def stream(self, text: str) -> None:
        if not text:
            return
        if self.interactive:
            text = text.translate(_VISIBLE_CONTROLS)
        self.out.write(text)
        self.out.flush()
        self.at_line_start = text.endswith("\n")

    def end_answer(self) -> None:
        if not self.at_line_start:
            self.out.write("\n")
            self.out.flush()
            self.at_line_start = True

    def _side(self):
        # on a terminal everything shares the screen; when piped, keep stdout for answers only
        return self.out if self.interactive else self.err

    def _emit(self, text: str, style: str | None) -> None:
        self.end_answer()
        stream = self._side()
        if self.color and style:
            text = "\n".join(f"{style}{line}{RESET}" for line in text.split("\n"))
        stream.write(text + "\n")
        stream.flush()

    def dim(self, text: str) -> None:
        """Stats and other quiet information."""
        self._emit(text, DIM)

    def notice(self, text: str) -> None:
        """Something the user should see: a dropped turn, an interrupted answer, a hint."""
        self._emit(text, YELLOW)

    def info(self, text: str) -> None:
        """Plain information asked for (/help, /show, /stats)."""
        self._emit(text, None)
