"""Output: streamed answer text to stdout, notices and the dim stats line, plain when not a terminal.

stdout carries the answers; hints, notices and stats go to stderr when stdout is not a terminal
(so `bitchat < questions.txt > answers.txt` gives only the answers), and to the terminal otherwise.
Colour only on a terminal and never when NO_COLOR is set. On a terminal a streamed answer wraps at word
boundaries at the terminal's width (measured as each piece is written, so a resize is followed, mid-answer too): the
word being written is held back until it is complete, then goes on this line or the next. A thinking model's
thought (its <think> block) is shown as llama-cli shows it, between [Start thinking] and [End thinking], dim on a
terminal, and beside the answers (stderr) when stdout is not one.
"""
from __future__ import annotations

import io
import os
import sys

from ..engine.fileio import is_terminal

# Model output is untrusted text: on a terminal, control characters (an ESC could move the cursor,
# recolour or clear the screen) are shown as their visible Unicode "control pictures" instead.
_VISIBLE_CONTROLS = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"}
_VISIBLE_CONTROLS.update({0x7F: 0x2421, **{c: 0xFFFD for c in range(0x80, 0xA0)}})

DIM = "\x1b[2m"
YELLOW = "\x1b[33m"
RESET = "\x1b[0m"


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def format_stats(stats, n_shown: int | None = None) -> str:
    """The one-line summary after an answer: tokens, time to first token, decode speed."""
    if stats is None:
        return f"[{_tokens(n_shown or 0)}]"
    n = getattr(stats, "n_generated", n_shown) or 0
    ttft = getattr(stats, "ttft_s", None)
    tps = getattr(stats, "decode_tps", None)
    n_prompt = getattr(stats, "n_prompt", None)
    n_cached = getattr(stats, "n_cached", None)
    parts = [_tokens(n)]
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




def _cell_width(text: str) -> int:
    """Terminal columns `text` takes (wide East Asian characters take two)."""
    try:
        from prompt_toolkit.utils import get_cwidth
    except ImportError:  # pragma: no cover - prompt_toolkit is a dependency
        return len(text)
    return sum(get_cwidth(c) for c in text)


class WordWrapper:
    """Streaming word wrap: feed(text) -> text to write now, with newlines put where words would cross
    `width`; the last, possibly unfinished word is held until flush(). A word longer than a line is cut."""

    def __init__(self, width: int):
        self.width = max(8, width)
        self.column = 0
        self.word = ""

    def _word_out(self) -> str:
        out, w = "", _cell_width(self.word)
        if self.column and self.column + w > self.width:
            out, self.column = "\n", 0
        for ch in self.word:   # only a word longer than the whole line needs cutting
            cw = _cell_width(ch)
            if self.column + cw > self.width:
                out, self.column = out + "\n", 0
            out += ch
            self.column += cw
        self.word = ""
        return out

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if ch == "\n":
                out.append(self._word_out() + "\n")
                self.column = 0
            elif ch in " \t":
                out.append(self._word_out())
                step = 8 - self.column % 8 if ch == "\t" else 1
                if self.column + step > self.width:   # the break replaces the space
                    out.append("\n")
                    self.column = 0
                else:
                    out.append(ch)
                    self.column += step
            else:
                self.word += ch
        return "".join(out)

    def flush(self) -> str:
        return self._word_out()


class Output:
    """Where each kind of text goes, and whether it is decorated. `width`: wrap answers at this many
    columns (default on a terminal: its width; never when not interactive)."""

    def __init__(self, out=None, err=None, interactive: bool | None = None, width: int | None = None):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.interactive = is_terminal(self.out) if interactive is None else interactive
        self.color = self.interactive and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
        # a terminal gets control pictures for model output also when stdin is piped (echo hi | bitchat)
        self.visible_controls = self.interactive or is_terminal(self.out)
        self.at_line_start = True
        self.width = width
        self._wrap: WordWrapper | None = None
        self.thinking = False        # inside a thought's markers
        self._err_at_line_start = True

    def _terminal_width(self) -> int | None:
        if self.width:
            return self.width
        if not self.interactive:
            return None
        try:
            return os.get_terminal_size(self.out.fileno()).columns or None
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return None

    # the answer, piece by piece
    def stream(self, text: str, style: str | None = None) -> None:
        if not text:
            return
        if self.visible_controls:
            text = text.translate(_VISIBLE_CONTROLS)
        if self._wrap is None and self.at_line_start:   # a new answer: measure the terminal now
            width = self._terminal_width()
            self._wrap = WordWrapper(width) if width else None
        elif self._wrap is not None and not self.width:   # and at every piece: a resize mid-answer is followed (an
            width = self._terminal_width()                # ioctl, next to a token's milliseconds); it kept the width
            if width:                                     # it began with, and a narrower terminal broke each line
                self._wrap.width = max(8, width)          # mid-word
        if self._wrap is not None:
            text = self._wrap.feed(text)
            pending = bool(self._wrap.word)
        else:
            pending = False
        if text:
            self.out.write(f"{style}{text}{RESET}" if style and self.color else text)
            self.out.flush()
        if text:
            self.at_line_start = text.endswith("\n") and not pending
        elif pending:
            self.at_line_start = False

    def thought(self, text: str) -> None:
        """A piece of a thinking model's thought: after a [Start thinking] line, dim on a terminal (word-wrapped as
        answers are); on stderr when stdout is not a terminal, so stdout keeps only the answers."""
        if not text:
            return
        if not self.thinking:
            self.thinking = True
            self._emit("[Start thinking]", DIM)
        if self.interactive:
            self.stream(text, DIM)
            return
        if is_terminal(self.err):   # model output: shown, never obeyed (as stream() treats answers)
            text = text.translate(_VISIBLE_CONTROLS)
        self.err.write(text)
        self.err.flush()
        self._err_at_line_start = text.endswith("\n")

    def end_thought(self) -> None:
        """The thought is over (the answer starts, or the turn ends): an [End thinking] line, once."""
        if not self.thinking:
            return
        self.thinking = False
        if self._wrap is not None:   # the word held back for wrapping is the thought's: dim too
            rest, self._wrap = self._wrap.flush(), None
            if rest:
                self.out.write(f"{DIM}{rest}{RESET}" if self.color else rest)
                self.at_line_start = False
        if not self.interactive and not self._err_at_line_start:
            self.err.write("\n")
            self._err_at_line_start = True
        self._emit("[End thinking]", DIM)

    def end_answer(self) -> None:
        if self._wrap is not None:
            rest = self._wrap.flush()
            self._wrap = None
            if rest:
                self.out.write(rest)
                self.at_line_start = False
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
