"""A chat session: the conversation, the sampling settings and one loaded model, one turn at a time.

Used by both front ends (the prompt_toolkit REPL and the plain piped loop). Talks to the engine only
through its public API (engine/api.py): `chat_prompt` renders the window with the model's own
template, `generate` streams the answer and reuses the KV cache for the common prefix, and
chat/splice.py builds each new prompt on the exact tokens already cached, so a new turn only
prefills its new tokens.

Ctrl-C during an answer: a SIGINT handler sets a flag that is checked between chunks, so the
engine is never interrupted in the middle of a step; the answer stops, what was shown is kept
(marked interrupted) and the session goes on. During a long prompt the engine asks the flag between prefill
chunks (generate's cancel), so the first Ctrl-C stops it there. A second Ctrl-C while the first is pending
raises KeyboardInterrupt the usual way.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

from ..engine.errors import ENDING_SIGNALS, ModelChangedError, Terminated
from ..engine.fileio import SETTINGS_FILE_MAX, read_settings_file
from .commands import (OLLAMA_SET_WORDS, SETTING_ALIASES, SETTING_NAMES, THINK_WORDS, UNTIL_END, Command, CommandError,
                       CommandInterrupted, Settings, help_text, max_tokens_over_context, parse_setting,
                       shown_max_tokens, split_set, strip_block)
from .render import Output, format_stats
from .recovery import this_process
from .splice import CachedTurn, spliced_prompt
from .transcript import (Conversation, TranscriptError, file_identity, lone_surrogate, other_conversation,
                         private_dir, refuse_directory_name, same_file_key)


EXACT_COUNT_CHARS = 1 << 20   # a refused message up to this long is counted whole to say what it needs
LAST_TURN_TOO_LONG = ("[the loaded conversation's last turn alone does not fit the context window with room for an "
                      "answer: it is left out of the model's view, and the next question starts without it; /save "
                      "still has it]")


class ExitChat(Exception):
    """/bye: leave the session."""


class _FitStopped(Exception):
    """A Ctrl-C (or SIGTERM) came while the window was fitted to a question: it is answered empty, interrupted."""


class _InterruptFlag:
    def __init__(self):
        self.hit = False
        self.terminated = 0   # SIGTERM / SIGHUP came: the signal's number


@contextmanager
def sigint_as_flag():
    """While active, the first Ctrl-C only sets `flag.hit`; a second one raises KeyboardInterrupt. SIGTERM /
    SIGHUP set `flag.hit` and `flag.terminated` (the answer stops as on Ctrl-C and is kept; the caller then
    leaves, raising Terminated), never an exception in the middle of the answer's bookkeeping."""
    flag = _InterruptFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.hit and not flag.terminated:
            raise KeyboardInterrupt
        flag.hit = True

    def ending(signum, frame):
        flag.hit = True
        flag.terminated = flag.terminated or signum

    previous = signal.signal(signal.SIGINT, handler)
    before = {s: signal.signal(s, ending) for s in ENDING_SIGNALS}
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
        for s, h in before.items():
            signal.signal(s, h)


@contextmanager
def quiet_terminal(enabled: bool):
    """While an answer streams, keys typed on the terminal are not echoed (no stray "^C" inside the
    answer); they stay buffered and appear at the next prompt, as typed: the line discipline's canonical mode is off
    too, or it would take a Ctrl-D typed meanwhile as its own end-of-file and the prompt would never see it.
    Restored whatever happens. Stopped (Ctrl-Z) and resumed (fg), the shell has put its own modes back: they are
    set again on SIGCONT (keys typed after fg were echoed into the answer)."""
    fd = None
    resumed = installed = None
    if enabled:
        try:
            import sys
            import termios

            fd = sys.stdin.fileno()
            saved = termios.tcgetattr(fd)
            quiet = list(saved)
            quiet[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0) | termios.ICANON)
            termios.tcsetattr(fd, termios.TCSANOW, quiet)
        except Exception:   # noqa: BLE001  (no terminal, or it is gone: termios.error is no OSError)
            fd = None
    if fd is not None and hasattr(signal, "SIGCONT") and threading.current_thread() is threading.main_thread():
        def again(signum, frame):
            with contextlib.suppress(Exception):
                termios.tcsetattr(fd, termios.TCSANOW, quiet)
        resumed, installed = signal.signal(signal.SIGCONT, again), True
    try:
        yield
    finally:
        if installed:   # (None: the handler was not Python's; SIGCONT's default is to do nothing more)
            signal.signal(signal.SIGCONT, resumed if resumed is not None else signal.SIG_DFL)
        if fd is not None:
            try:
                termios.tcsetattr(fd, termios.TCSANOW, saved)
            except Exception:   # noqa: BLE001  (the terminal closed meanwhile: termios.error)
                pass


def terminal_gone(e: BaseException) -> bool:
    """A write or read that failed because the terminal closed (its window, an ssh session): EIO on a pty whose
    other end is gone (SIGHUP may come after it)."""
    import errno
    return isinstance(e, OSError) and e.errno in (errno.EIO, errno.ENXIO)


class ChatSession:
    def __init__(self, llm, settings: Settings, output: Output, *, system: str | None = None,
                 threads: int | None = None, model_label: str | None = None):
        self.llm = llm
        self.settings = settings
        self.out = output
        self._shown: list[str] = []   # the text of the answer being shown
        self.conv = Conversation(system=system if system and system.strip() else None)   # -sys '  ': none
        self.threads = threads
        self.model_label = model_label
        self.last_stats = None
        self.n_answers = 0            # answers made
        # added to a fixed seed, one more per answer, so /retry differs; /set seed and /reset start it again at 0, so
        # the same seed and question give the answer a fresh bitchat --seed gives
        self.seed_offset = 0
        self.total_generated = 0      # sum of the stats lines' token counts
        self.total_decode_tokens = 0  # tokens after each answer's first (what decode tok/s counts)
        self.total_decode_s = 0.0
        self.tokens_in_cache = 0      # prompt + generated tokens of the last call (what the KV holds)
        self.n_dropped = 0            # turns that left the window for lack of room
        self.had_errors = False       # a command or turn failed (the plain loop's exit code)
        self.cached_turn: CachedTurn | None = None   # the exact tokens of the last turn (chat/splice.py)
        self.last_prompt_ids: list[int] = []
        # the tokens of each turn's text alone, counted once: text -> (count, whole); of a text far beyond the context
        # only a prefix, its count already over twice the context (whole False). See _text_tokens
        self._counted: dict[str, tuple[int, bool]] = {}
        self.splice = True            # False: always re-render the whole window (for comparison)
        self.recovery_path: str | None = None   # see enable_recovery()
        self._recovery_written = None   # (path, its identity) of the copy this session last wrote
        self._recovery_turns = 0        # the turns that copy holds
        # why the last write of the copy failed (a full disk), else None: the copy there, if any, is an older one,
        # never named as the conversation; every turn tries again
        self._recovery_failed: str | None = None
        # conversation files this session saved or loaded, each with its identity then: /save replaces one only
        # while it is still that file (another bitchat's /save! since, or a copy over it, is someone else's)
        self.own_files: dict[str, tuple] = {}
        self.format = None            # compiled structured-output constraint of the answers (/set format), or None
        self.format_label = "off"
        self.format_spec = None       # the Constraint it was compiled from (/save keeps a schema itself)
        self.jump_forward = True      # a format's forced tokens run as a verified draft (bitnet run --no-jump-forward)
        # a Ctrl-C typed with or right after the Enter that sent the next line (the prompt saw it, not the turn):
        # that line's answer starts stopped, as if the Ctrl-C had come a moment later (it was lost: a whole answer)
        self.interrupt_pending = False
        self._retrying = False        # a /retry with an earlier answer is being made (see _keep_earlier)
        # while a new message is asked: the window's start, n_dropped and cached_turn before it (see
        # _drop_unanswered), else None
        self._before_ask: tuple[int, int, CachedTurn | None] | None = None
        # Ctrl-C ends the whole run (stdin is not a terminal: `bitchat < questions.txt`, nobody at a prompt): the
        # answer so far is kept as in the REPL, then KeyboardInterrupt (exit 130); it only cut the one answer
        self.ctrl_c_ends = False

    # ---- crash recovery ------------------------------------------------------------------------
    def enable_recovery(self, path: str) -> None:
        """Keep a copy of the conversation at `path`, rewritten before every answer and after it, so a fatal
        fault (a model file truncated while in use: a C handler ends the process, no Python runs) loses no
        turn the user has seen; the fatal line says where the copy is. discard_recovery() on a normal exit."""
        self.recovery_path = path

    def _save_recovery(self, quiet: bool = False) -> None:
        """Write the copy: around every turn, and after each command that changes the conversation (/system, /set
        system, /reset, /load: the copy a signal's line named was the one before it). Never over a copy another
        process wrote at that path since: this session's then goes to a free X-PID.json beside it (`quiet`: with
        no line about it, for a terminal that may be gone)."""
        if not self.recovery_path:
            return
        from ..engine import faults

        if not self.conv.turns:   # /reset: no turn to keep; the copy this session wrote told the old conversation
            self.discard_recovery()
            self._recovery_failed = None
            faults.set_note("")
            return

        try:
            private_dir(os.path.dirname(os.path.abspath(self.recovery_path)))
            if self.recovery_copy() is None and _holds_something(self.recovery_path):
                # another bitchat given the same $BITCHAT_RECOVERY wrote there since (or before our first turn):
                # its copy was written over, then ours named nowhere and removed at its exit; ours goes beside it
                taken, self.recovery_path = self.recovery_path, _free_beside(self.recovery_path)
                if not quiet:
                    self.out.notice(f"[{taken} holds another bitchat's recovery copy (kept); this session's copy "
                                    f"is now {self.recovery_path}]")
            # "process": who wrote it, so a later bitchat tells a copy left behind from a running session's
            written = self.conv.save(self.recovery_path, meta={"model": self.llm.name, "recovered": True,
                                                               "settings": self.saved_settings(),
                                                               "process": this_process()}, durable=False)
            self._recovery_written = (written, _identity(os.stat(written)))
            self._recovery_turns = len(self.conv.turns)
        except (TranscriptError, OSError) as e:
            why = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else \
                (e.strerror if isinstance(e, OSError) and e.strerror else str(e))   # not "[Errno 20] ..."
            # kept trying at every turn (it stopped for good: once the disk had room again no copy was written), said
            # once; the copy there is older than the conversation: never named as it (faults' line, a signal's)
            if self._recovery_failed is None and not quiet:
                self.out.notice(f"[cannot keep a recovery copy of the conversation: {why}; /save still works; "
                                "it is tried again at every turn]")
            self._recovery_failed = why
            faults.set_note("")
            return
        if self._recovery_failed is not None and not quiet:
            self.out.notice(f"[the recovery copy is kept again: {self.recovery_path}]")
        self._recovery_failed = None
        faults.set_note(f"; the conversation so far is saved in {self.recovery_path} (/load it in bitchat)")

    def recovery_copy(self) -> str | None:
        """The recovery file when it still holds the copy this session last wrote, else None: only that one is
        this session's to name or remove (a file it never wrote was removed at exit: the user's own, or the copy
        of another bitchat given the same path)."""
        if self._recovery_written is None:
            return None
        path, identity = self._recovery_written
        try:
            return path if _identity(os.stat(path)) == identity else None
        except OSError:
            return None

    def _own(self, path: str) -> None:
        """`path` was just written by this session: /save may replace it while it stays as written."""
        key = same_file_key(path)
        try:
            self.own_files[key] = _identity(os.stat(key))
        except OSError:
            self.own_files.pop(key, None)

    def _still_own(self, key: str) -> bool:
        """Whether the file at `key` is still the one this session saved or loaded there."""
        try:
            return key in self.own_files and _identity(os.stat(key)) == self.own_files[key]
        except OSError:
            return False

    def recovery_current(self) -> str | None:
        """recovery_copy() while it holds the conversation as it is: None once a later write of it failed."""
        return None if self._recovery_failed is not None else self.recovery_copy()

    def keep_recovery(self) -> str | None:
        """The recovery copy to name as bitchat leaves on a signal: the one this session wrote, or, when another
        bitchat has written over it since, a fresh one beside it (the line named nothing and the turns were lost),
        or, when the last write failed (a full disk), the copy written now; None when it cannot be (the older copy
        was named as "the conversation so far": see recovery_lost)."""
        if self.recovery_path and self.conv.turns and (self._recovery_failed is not None or (
                self.recovery_copy() is None and self._recovery_written is not None)):
            with contextlib.suppress(OSError):   # (a notice failing on a closed terminal)
                self._save_recovery(quiet=True)
        return self.recovery_current()

    def recovery_lost(self) -> str | None:
        """Why the conversation has no recovery copy as bitchat leaves, in words for its last line (with what an
        older copy there holds), or None when it has one or none was asked for."""
        if not self.recovery_path or not self.conv.turns or self._recovery_failed is None:
            return None
        line = f"the recovery copy could not be written ({self._recovery_failed})"
        older = self.recovery_copy()
        if older:
            line += f"; {older} holds an older copy ({self._recovery_turns} of {len(self.conv.turns)} turns)"
        return line

    def discard_recovery(self) -> None:
        path = self.recovery_copy()
        self._recovery_written = None
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass

    # ---- engine adapters -----------------------------------------------------------------------
    def sampling_params(self):
        return self.settings.sampling_params(seed_offset=self.seed_offset)

    def count_tokens(self, messages: list[dict], generation_prompt: bool = True) -> int:
        return len(self.llm.chat_prompt(messages, add_generation_prompt=generation_prompt,
                                        continue_final_message=False))   # an answered turn is closed, not continued

    # ---- context window ------------------------------------------------------------------------
    def _reserve(self) -> int:
        """Room kept free for the answer: its -n/max_tokens, at most half the window (a -n as large as
        the context, e.g. -n -1, would otherwise leave no room for any earlier turn)."""
        return max(1, min(self.settings.answer_limit(self.llm.n_ctx), self.llm.n_ctx // 2))

    def _text_tokens(self, text: str, heard=None) -> tuple[int, bool]:
        """The tokens of `text` alone (a message's content) and True; or, once a prefix of it alone has over twice the
        context's (the cut may split a word: a margin), that prefix's and False: a turn of megabytes is never
        tokenized whole. Counted once per text (self._counted), however many questions follow. `heard()` is called
        after each tokenizer call (a Ctrl-C acts there)."""
        if not text:
            return 0, True
        got = self._counted.get(text)
        if got is not None:
            return got
        room = self.llm.n_ctx
        n = 8 * (room + 64)   # characters: a token is rarely over 8 of them
        while True:
            whole = n >= len(text)
            count = len(self.llm.tokenize(text if whole else text[:n]))
            if heard is not None:
                heard()
            if whole or count > 2 * room + 64:
                break
            n *= 4
        self._counted[text] = got = (count, whole)
        return got

    def _forget_counts(self) -> None:
        """Keep the counts of this conversation's texts only (a /load or /reset left others: never a huge text held)."""
        if len(self._counted) > 2 * len(self.conv.turns) + 16:
            texts = {x for t in self.conv.turns for x in (t.user, t.assistant) if x}
            self._counted = {k: v for k, v in self._counted.items() if k in texts}

    def _least_start(self, budget: int, heard=None) -> tuple[int, int]:
        """The first window start worth counting whole, and the newest turn's own tokens: a start before a turn whose
        text alone has more than `budget` tokens cannot fit (the template adds to it), so it is not rendered and
        tokenized whole (a loaded turn of 12 MB took 10-30 s, twice, deaf to Ctrl-C). A text too short to hold that
        many tokens (a token is at least a byte, a character at most 4) is not tokenized here at all."""
        first, last = self.conv.window_start, len(self.conv.turns) - 1
        least, newest = first, 0
        for i in range(last, first - 1, -1):
            t = self.conv.turns[i]
            n = sum(self._text_tokens(x, heard)[0] for x in (t.user, t.assistant or "") if 4 * len(x) > budget)
            if i == last:
                newest = n
            if n > budget:
                least = min(i + 1, last)
                break
        return least, newest

    def _fit(self, generation_prompt: bool = True, known: list[int] | None = None,
             out_of_view: int = 0, flag=None) -> list[int] | None:
        """Trim the window so prompt + answer room fit n_ctx, dropping only as many of the oldest turns as
        needed (every turn that fits stays); the prompt ids, or None when even the newest message alone
        cannot fit (then that turn is removed and the user is told). `known`: the ids of the window as it stands,
        already made (/load tokenized the whole conversation: each time took a minute for 10,000 turns);
        `out_of_view`: turns /load already left out of the window (counted in the notice). `flag` (sigint_as_flag's):
        a Ctrl-C is heard after each tokenizer call that counts a huge turn (_FitStopped, the window as it was).
        The window is rendered and tokenized whole once: the count that found it fits gives the ids."""
        n_ctx = self.llm.n_ctx
        budget = n_ctx - self._reserve()
        start_before = self.conv.window_start
        whole = self.conv.messages() if known is not None else None
        made: dict[int, list[int]] = {}   # the ids of each window counted, by its number of messages

        def heard() -> None:
            if flag is not None and flag.hit:
                raise _FitStopped

        def count(m: list[dict]) -> int:
            if known is not None and m == whole:
                return len(known)
            made[len(m)] = ids = self.llm.chat_prompt(m, add_generation_prompt=generation_prompt,
                                                      continue_final_message=False)
            return len(ids)
        self._forget_counts()
        least, newest = self._least_start(budget, heard)
        if newest >= n_ctx:   # the newest turn's text alone fills the context: never rendered and tokenized whole
            return None
        # once trimming is needed, down to 3/4 of the room: each trim changes the prompt's start and re-reads the
        # whole window, which trimming one turn at a time did on every turn of a full context
        # (turns already out: trimming was needed, so down to the 3/4 as if /load had trimmed them itself)
        try:
            dropped = self.conv.fit_window(count, budget * 3 // 4 if out_of_view else budget, budget * 3 // 4,
                                           least_start=least) + out_of_view
        except BaseException:   # a second Ctrl-C mid-bisection: never a window left at one of its guesses
            self.conv.window_start = start_before
            raise
        messages = self.conv.messages()
        ids = known if known is not None and messages == whole else made[len(messages)] \
            if len(messages) in made else self.llm.chat_prompt(messages, add_generation_prompt=generation_prompt,
                                                               continue_final_message=False)
        if generation_prompt and self.splice:  # same text, but the last answer's own tokens: the cache covers them
            spliced = spliced_prompt(self.llm, self.cached_turn, messages)
            if spliced is not None and len(spliced) < n_ctx:
                ids = spliced
        if len(ids) >= n_ctx:
            self.conv.window_start = start_before   # refused message: the older turns stay in view
            return None
        # the room the answer has: the reserve when the window could be trimmed to it, less when the system prompt
        # and the newest message alone take more (the message is sent while any answer fits)
        room = min(n_ctx - len(ids) + 1, self.settings.answer_limit(n_ctx))   # the last token needs no place
        # (said when the window is down to the newest turn: only then is the prompt itself what leaves too little)
        short = generation_prompt and room < self._reserve() and self.conv.window_start >= len(self.conv.turns) - 1
        if dropped:
            self.n_dropped += dropped
            kept = f"only {room} left for the answer" if short else f"{room} kept for the answer"
            self.out.notice(f"[context full ({n_ctx} tokens, {kept}): dropped the "
                            f"{dropped} oldest turn{'s' if dropped > 1 else ''} from the model's view; "
                            "/save still has them]")
        elif short:
            self.out.notice(f"[only {room} tokens left for the answer: the prompt takes {len(ids)} of the "
                            f"{n_ctx}-token context; a shorter system prompt (/system) or a larger -c leaves more]")
        self.last_prompt_ids = ids
        return ids

    def _newest_needs(self) -> str:
        """The tokens the newest turn needs alone (with the system prompt), as the refusal says it: "over N" for a text
        of megabytes far beyond the context, which is never tokenized whole (a paste of 100 KB is counted: 0.1 s)."""
        t = self.conv.turns[-1]
        texts = [x for x in (t.user, t.assistant) if x]
        counts = [self._counted.get(x) for x in texts]
        if sum(map(len, texts)) > EXACT_COUNT_CHARS and any(c is not None and not c[1] for c in counts):
            return f"over {sum(c[0] for c in counts if c is not None)}"
        return str(self.count_tokens(self.conv.messages(start=len(self.conv.turns) - 1)))

    def _system_tokens(self, system: str | None = None) -> str:
        """The tokens the system prompt (`system`, else the conversation's) takes rendered alone, as a refusal says
        them ("over N" for a text far beyond the context: never tokenized whole), or "" for none."""
        system = self.conv.system if system is None else system
        if not system:
            return ""
        n, whole = self._text_tokens(system)
        if not whole:
            return f"over {n}"
        return str(self.count_tokens([{"role": "system", "content": system}]))

    def _system_overflow(self, system: str | None = None) -> str:
        """The system prompt's tokens (as _system_tokens says them) when it alone leaves no room for any message: a
        one-character question does not fit beside it with room for an answer's first token (what a message is
        sent with); else "". Then no question can be asked until it is shorter."""
        system = self.conv.system if system is None else system
        n = self._system_tokens(system)
        if not n or n.startswith("over"):
            return n
        least = self.count_tokens([{"role": "system", "content": system}, {"role": "user", "content": "?"}])
        return n if least >= self.llm.n_ctx else ""

    def _system_prompt_too_long(self, n: str) -> str:
        return (f"the system prompt alone needs {n} tokens of the {self.llm.n_ctx}-token context, leaving no room "
                "for a message and its answer; shorten it (/system) or start bitchat with a larger -c")

    # ---- one answer ----------------------------------------------------------------------------
    def ask(self, text: str) -> None:
        from ..engine.formats.tokenizer import decode_utf8

        try:   # lone surrogates (undecodable bytes smuggled in as text) cannot be tokenized
            text = decode_utf8(_typed_text(text), "message")
        except ValueError as e:
            raise CommandError(f"[{e}; not sent{_locale_note()}]") from None
        with sigint_as_flag() as flag:   # from the turn's first moment: a Ctrl-C never leaves it half made
            flag.hit, self.interrupt_pending = self.interrupt_pending, False
            # a Ctrl-C before the answer's first word takes the message back out (_drop_unanswered): the window as
            # it was before it, and the previous answer's exact tokens (the next prompt splices them), too
            self._before_ask = (self.conv.window_start, self.n_dropped, self.cached_turn)
            turn = self.conv.add_user(text)
            try:
                self._answer(turn, flag)
            finally:
                self._before_ask = None
        self._after_turn(turn, flag, ends=self.ctrl_c_ends)

    def retry(self) -> None:
        turn = self.conv.last_turn()
        if turn is None:
            raise CommandError("/retry: nothing to retry yet; ask something first")
        earlier = (turn.assistant, turn.interrupted, turn.finish_reason)
        self._retrying = bool(earlier[0])   # an earlier answer to put back if this one is stopped
        with sigint_as_flag() as flag:
            flag.hit, self.interrupt_pending = self.interrupt_pending, False
            turn.assistant = None
            turn.interrupted = False
            turn.finish_reason = None
            try:
                self._answer(turn, flag)
            finally:
                stopped, self._retrying = turn.interrupted, False
                self._keep_earlier(turn, earlier)
        self._after_turn(turn, flag, stopped, ends=self.ctrl_c_ends)

    def _keep_earlier(self, turn, earlier: tuple) -> None:
        """A retry that made nothing, or was stopped partway, keeps the turn and its earlier answer: the ways a new
        message fails (too long for the window, a template or engine error) dropped the user's turn, a Ctrl-C
        before the first token replaced a whole answer with an empty one, and one partway with its first words."""
        dropped = self.conv.last_turn() is not turn
        partial = bool(turn.assistant) and turn.interrupted   # shown, but not kept
        if not dropped and (not earlier[0] or (turn.assistant and not partial)):
            return
        if dropped:
            self.conv.turns.append(turn)
        turn.assistant, turn.interrupted, turn.finish_reason = earlier
        self.cached_turn = None   # the cache holds the retry's prompt, not this answer's tokens
        with contextlib.suppress(Exception):
            self._save_recovery()
        with contextlib.suppress(Exception):
            self.out.notice("[retry interrupted: the earlier answer is kept]" if partial and not dropped
                            else "[/retry made no new answer: the earlier one is kept]")

    @staticmethod
    def _after_turn(turn, flag, stopped: bool | None = None, ends: bool = False) -> None:
        """A signal that came while the turn was made and did not stop its answer (it came after the answer was
        whole, during the bookkeeping) acts now, as outside a turn: SIGTERM / SIGHUP leave, Ctrl-C is a
        KeyboardInterrupt (piped bitchat exits 130). `stopped`: whether the answer was stopped (a retry that
        stopped puts the earlier answer back). `ends`: a Ctrl-C that stopped the answer ends the run too
        (ChatSession.ctrl_c_ends), once the answer so far is kept."""
        if flag.terminated:   # the answer so far is kept and saved: now leave
            raise Terminated(flag.terminated)
        if flag.hit and (ends or not (turn.interrupted if stopped is None else stopped)):
            raise KeyboardInterrupt

    def _answer(self, turn, flag) -> None:
        """Answer `turn` (the conversation's last), under sigint_as_flag's `flag`: a Ctrl-C at any moment leaves
        it answered, with what was shown (maybe nothing) marked interrupted; never a question without an answer
        (the next turn would put two user messages in a row, which many templates refuse)."""
        self._shown = []   # nothing of this answer shown yet
        try:
            with quiet_terminal(self.out.interactive):   # from the start: keys typed while the window is fitted too
                self._answer_flagged(turn, flag)
        except KeyboardInterrupt:   # a second Ctrl-C before the answer began (while the prompt was fitted)
            if turn.assistant is None and self.conv.last_turn() is turn:
                with contextlib.suppress(KeyboardInterrupt):
                    self._not_begun(turn, flag)
                return
            self.out.end_answer()
            self.out.notice("[interrupted]")   # the turn was already answered, or dropped
        except ModelChangedError:   # bitchat ends (cli/chat.py): the turn stays unanswered in the recovery copy, as
            raise                   # after the fault guard's exit
        except Exception as e:   # a bug mid-answer (handle_line reports it): the question still gets an answer, empty
            if terminal_gone(e) and turn.assistant is None and self.conv.last_turn() is turn:
                # the terminal closed mid-answer (a write failed before its SIGHUP came): what was shown is kept,
                # and bitchat leaves as on that signal
                turn.assistant, turn.interrupted, turn.finish_reason = "".join(self._shown), True, "interrupted"
                self.cached_turn = None
                with contextlib.suppress(Exception):
                    self._save_recovery()
                raise Terminated(getattr(signal, "SIGHUP", signal.SIGTERM)) from None
            if turn.assistant is None and self.conv.last_turn() is turn:
                turn.assistant, turn.interrupted, turn.finish_reason = "", True, "error"
                self.cached_turn = None
                with contextlib.suppress(Exception):
                    self._save_recovery()
            raise

    def _not_begun(self, turn, flag) -> None:
        """A Ctrl-C before `turn`'s answer began: a new message is taken back out (_drop_unanswered); a /retry's turn
        gets an empty answer, interrupted, saved and said (its earlier answer comes back: _keep_earlier). SIGTERM /
        SIGHUP never take a message back: bitchat leaves, and the recovery copy it names must hold it."""
        turn.assistant, turn.interrupted, turn.finish_reason = "", True, "interrupted"
        self.cached_turn = None
        self.out.end_answer()
        if self._before_ask is not None and not flag.terminated:
            self._drop_unanswered(turn)
            return
        self.out.notice("[interrupted before the answer began]")
        self._save_recovery()

    def _drop_unanswered(self, turn) -> None:
        """A new message stopped (Ctrl-C) before any of its answer was shown leaves the conversation, its transcript,
        the recovery copy and the model's view, as if never sent, and the window comes back as it was: kept as a turn
        with an empty answer, the next question read it again (paying the prefill the user had just stopped) and a
        message too long for the context pushed the real conversation out of view. Said in one line."""
        if self.conv.last_turn() is turn:
            self.conv.drop_last_turn()
        self.cached_turn = None
        if self._before_ask is not None:   # the previous turn's tokens are data about it, whatever the cache holds
            start, dropped, self.cached_turn = self._before_ask
            self.conv.window_start, self.n_dropped = min(start, len(self.conv.turns)), dropped
        self.out.notice("[interrupted before the answer began: the message is dropped from the conversation]")
        self._save_recovery()


    def _answer_flagged(self, turn, flag) -> None:
        from ..engine.errors import BUG_REPORT_HINT, EXIT_BUG, BitNetError, ContextOverflowError

        try:
            ids = self._fit(flag=flag)
        except _FitStopped:   # Ctrl-C (or SIGTERM) while a huge turn was counted: the window stays as it was
            self._not_begun(turn, flag)
            return
        except BitNetError as e:   # the template cannot render this conversation (a role it refuses, ...)
            self.conv.drop_last_turn()
            self.had_errors = True
            self.out.notice(f"[message not sent: {e}]")
            return
        messages = self.conv.messages()
        self.cached_turn = None   # until this answer is complete, the cache holds something else
        if ids is None:
            n = self._newest_needs()
            self.conv.drop_last_turn()
            self.had_errors = True
            n_system = self._system_overflow()
            if n_system:   # the system prompt is what does not fit
                self.out.notice(f"[message not sent: {self._system_prompt_too_long(n_system)}]")
            else:
                of = self._system_tokens()
                of = f" ({of} of them the system prompt's)" if of else ""
                self.out.notice(f"[message not sent: it needs {n} tokens plus room for the answer, and the context "
                                f"window is {self.llm.n_ctx}{of}; shorten it or start bitchat with a larger -c]")
            return
        # the user's limit as set: the engine stops at the context's end itself, and says so ("context"), where
        # a limit cut to the room left made every full context read "stopped at max_tokens"
        max_tokens = self.settings.answer_limit(self.llm.n_ctx)
        params = self.sampling_params()
        pieces: list[str] = []
        self._shown = pieces   # what _answer keeps if the terminal closes mid-answer
        answer_ids: list[int] = []
        stats = None      # the engine's running Stats of the last chunk shown (every chunk carries them)
        n_tokens = 0
        interrupted = False
        gen = None
        # a thinking model's <think> block is shown apart (render.Output.thought); the transcript keeps the text as
        # written, which the template renders back (dropping earlier thoughts, as Qwen3's does)
        splitter = self.llm.think_splitter(ids, self.format is None)

        def show(text: str | None) -> None:
            if splitter is None:
                self.out.stream(text or "")
                return
            reasoning, content = splitter.feed(text) if text is not None else splitter.finish()
            self.out.thought(reasoning)
            if content:
                self.out.end_thought()
                self.out.stream(content)
        self._save_recovery()   # the question is on disk before the model reads its weights again
        if flag.hit:   # Ctrl-C before the answer began: an empty one, interrupted
            self._not_begun(turn, flag)
            return
        try:
            with quiet_terminal(self.out.interactive):
                # a Ctrl-C during a long prompt stops it at the next prefill chunk (the chunks done stay cached)
                gen = self.llm.generate(ids, params, max_tokens=max_tokens, constraint=self.format,
                                        cancel=lambda: flag.hit)
                try:
                    for chunk in gen:
                        if flag.hit:   # stop before showing more than the user saw when pressing Ctrl-C
                            interrupted = True
                            break
                        if chunk.token is not None:
                            answer_ids.append(chunk.token)
                            n_tokens += 1
                        if chunk.text:
                            pieces.append(chunk.text)
                            show(chunk.text)
                        stats = chunk.stats
                except KeyboardInterrupt:
                    interrupted = True
                finally:
                    gen.close()
                    show(None)
                    self.out.end_thought()
                if flag.hit:
                    interrupted = True
        except KeyboardInterrupt:   # a Ctrl-C that landed outside the loop (e.g. in close)
            interrupted = True
        except ModelChangedError:   # the model file was rewritten under it: no later turn can be answered either;
            self.out.end_answer()     # the turn is kept (unanswered) in the recovery copy the fatal line names
            if pieces:
                turn.assistant, turn.interrupted, turn.finish_reason = "".join(pieces), True, "error"
            self._save_recovery()
            raise
        except BitNetError as e:   # ContextOverflowError included: one line, the session goes on
            self.out.end_answer()
            if pieces:
                turn.assistant, turn.interrupted, turn.finish_reason = "".join(pieces), True, "error"
            else:
                self.conv.drop_last_turn()
            self.had_errors = True
            self._save_recovery()
            if e.exit_code == EXIT_BUG:
                self.out.notice(f"[internal error: {e}; {BUG_REPORT_HINT}; the session goes on]")
                return
            kind = "context overflow" if isinstance(e, ContextOverflowError) else "error"
            self.out.notice(f"[{kind}: {e}]")
            return
        self.out.end_answer()
        turn.assistant = "".join(pieces)
        # nothing of it shown, stopped by a Ctrl-C: never sent (a SIGTERM / SIGHUP keeps it, for the recovery copy)
        if interrupted and not pieces and self._before_ask is not None and not flag.terminated:
            turn.interrupted, turn.finish_reason = True, "interrupted"
            self._drop_unanswered(turn)
            return
        self.cached_turn = CachedTurn(messages, list(ids), answer_ids, turn.assistant)
        self.n_answers += 1
        self.seed_offset += 1
        if interrupted and stats is not None:
            stats = replace(stats, finish_reason="interrupted")
        turn.interrupted = interrupted
        turn.finish_reason = "interrupted" if interrupted else getattr(stats, "finish_reason", None)
        self._save_recovery()
        self.last_stats = stats   # None only when Ctrl-C came before the first token
        n_counted = stats.n_generated if stats else 0   # what the stats line shows (the engine counts an end token)
        self.total_generated += n_counted
        if stats and stats.decode_tps and n_counted > 1:
            self.total_decode_tokens += n_counted - 1
            self.total_decode_s += (n_counted - 1) / stats.decode_tps
        # an answer cut off during its prompt: only the prompt's chunks done are cached
        # (what the cache holds: the last token sampled is not fed to it, so prompt + answer was one over a full
        # context, "257 / 256")
        self.tokens_in_cache = len(self.llm.cached_tokens)
        if interrupted and not pieces and stats is None:   # stopped during its prompt: there is no answer to keep
            self.out.notice("[interrupted before the answer began]")
            return
        if interrupted and not self._retrying:   # a retry's: the earlier answer comes back (_keep_earlier says so)
            self.out.notice("[interrupted: the answer so far is kept]")
        elif turn.finish_reason == "context":
            self.out.notice("[the context window is full; the oldest turns will be dropped next turn]")
        self.out.dim(format_stats(stats, n_tokens))

    # ---- loading a saved conversation ----------------------------------------------------------
    def prefill_conversation(self, known: list[int] | None = None, out_of_view: int = 0) -> None:
        """Feed the whole window to the model now so the next turn starts fast (re-prefill); `known`: its ids
        without a generation prompt, when made already; `out_of_view`: the oldest turns already left out."""
        if not self.conv.turns and not self.conv.system:
            return
        from ..engine.errors import BitNetError

        ids = self._fit(generation_prompt=False, known=known, out_of_view=out_of_view)
        if ids is None:
            n_system = self._system_overflow()
            if n_system:   # no question can be asked until it is shorter: say so now, not "trimmed" and then refused
                self.out.notice(f"[{self._system_prompt_too_long(n_system)}]")
            else:   # the last turn with its answer fills the window (an answer that ran to the context's end)
                self.last_turn_out_of_view()
            return
        t0 = time.perf_counter()
        interrupted = False
        with sigint_as_flag() as flag, quiet_terminal(self.out.interactive):   # keys typed meanwhile: not echoed
            try:
                _prefill(self.llm, ids, self.sampling_params(), cancel=lambda: flag.hit)
            except KeyboardInterrupt:
                interrupted = True
            except ModelChangedError:   # no turn can be answered: bitchat ends (cli/chat.py), the conversation
                raise                   # loaded is in the recovery copy it names
            except BitNetError as e:
                self.out.notice(f"[prefill failed: {e}; the conversation is loaded, the next turn will retry]")
                return
            interrupted = interrupted or flag.hit
        if flag.terminated:   # SIGTERM / SIGHUP: leave (the conversation is loaded; nothing to keep of a prefill)
            raise Terminated(flag.terminated)
        dt = time.perf_counter() - t0
        self.tokens_in_cache = len(self.llm.cached_tokens) if interrupted else len(ids)
        if interrupted and self.ctrl_c_ends:   # the conversation is loaded (and in the recovery copy): end the run
            raise KeyboardInterrupt
        if interrupted:
            self.out.notice("[prefill interrupted; it will finish with the next question]")
        else:
            self.out.dim(f"[prefilled {len(ids)} tokens in {dt:.2f} s]")

    def last_turn_out_of_view(self) -> None:
        """A loaded conversation whose last turn alone does not fit the window with room for an answer: every turn
        leaves the model's view now (the next question would drop them), so /stats counts them out, and it is said."""
        before = self.conv.window_start
        self.conv.window_start = len(self.conv.turns)
        self.n_dropped += self.conv.window_start - before
        self.out.notice(LAST_TURN_TOO_LONG)

    # ---- slash commands ------------------------------------------------------------------------
    def run_command(self, cmd: Command) -> None:
        """Carry out a parsed command; raises CommandError (one-line hint) or ExitChat."""
        name, arg = cmd.name, cmd.arg
        if name == "/bye":
            raise ExitChat
        if name == "/help":
            self.out.info(help_text())
        elif name == "/reset":
            self.conv.reset()
            self.seed_offset = 0
            # what the conversation holds of the context: nothing now (/stats and /show info said the forgotten
            # turns' count, "34 / 512" with 0 turns); the cache's tokens are only reused where the next prompt agrees
            self.tokens_in_cache = 0
            self._save_recovery()
            self.out.info("[conversation cleared]")
        elif name == "/system":
            if not arg:
                self.out.info(f"system prompt: {self.conv.system!r}" if self.conv.system else "no system prompt")
            elif arg.split()[0] == "--clear" and arg != "--clear":   # as /reset now: never the text "--clear x"
                raise CommandError(f"/system --clear takes nothing after it (got {arg.split(None, 1)[1]!r})")
            elif arg == "--clear":
                self.conv.system = None
                self._save_recovery()
                self.out.info("[system prompt cleared]")
            else:
                self.set_system(strip_block(arg), "/system")
        elif name == "/set":
            pair = split_set(arg) if arg else None
            if pair is None:
                self.out.info(self.describe_settings())
            elif pair[0].lower() == "format":
                self.set_format(pair[1])
            elif pair[0] == "noformat":   # ollama's spelling of /set format off
                self.set_format("off")
            elif pair[0] in OLLAMA_SET_WORDS:
                done, line = OLLAMA_SET_WORDS[pair[0]]
                if not done:
                    raise CommandError(line)
                self.out.info(line)
            elif pair[0] == "system":
                self.set_system(pair[1], "/set system")
            elif pair[0] in THINK_WORDS:
                self.set_thinking(pair[0] == "think")
            else:   # (a value typed in a locale that is not UTF-8: the text its bytes spell, as a message's)
                key, value = parse_setting(pair[0], _typed_text(pair[1]), max_tokens_limit=self.llm.n_ctx)
                capped = key == "max_tokens" and value != UNTIL_END and value < int(pair[1])   # to the context
                setattr(self.settings, key, value)
                if key == "seed":   # even the same value: the next answer is that seed's own, not seed + answers
                    self.seed_offset = 0
                self._save_recovery()   # the copy carries the settings too
                shown = "random" if value is None else json.dumps([*value]) if isinstance(value, tuple) else \
                    shown_max_tokens(value) if key == "max_tokens" else value
                if capped:   # one line, which ends with the value taken (it was followed by "[max_tokens = 512]")
                    self.out.notice(f"[{max_tokens_over_context(int(pair[1]), self.llm.n_ctx)}]")
                elif key in ("reasoning_budget", "reasoning_budget_message") and not self.llm.thinks and \
                        value != getattr(Settings(), key):   # (back to the default asks for nothing, as the flag)
                    # as the flag's warning says it: kept (a /save loads into a model that thinks), but said
                    self.out.notice(f"[{key} = {shown}: {self.llm.name}'s chat template does not think; it changes "
                                    "nothing]")
                else:
                    self.out.info(f"[{key} = {shown}]")   # a breaker list as /show prints it (JSON)
        elif name == "/show":
            topic = arg.lower()
            if topic == "system":
                self.out.info(f"system prompt: {self.conv.system!r}" if self.conv.system else "no system prompt")
            elif topic == "parameters":
                self.out.info(self.describe_settings())
            else:
                self.out.info(self.describe_model())
        elif name == "/stats":
            self.out.info(self.describe_stats())
        elif name == "/save":
            try:   # "x.json/": before the checks below, which name the file x.json
                refuse_directory_name(arg)
            except TranscriptError as e:
                raise CommandError(f"/save: {e}") from None
            target = same_file_key(arg)
            # the file as judged here: the save replaces only that one, and creates a file where there was none (two
            # sessions saving to one new name both said "saved"; the file held only the second's conversation)
            before = _identity_at(target)
            owned = self._still_own(target)
            other = None if cmd.force or owned else other_conversation(target)
            if other:   # a fresh session's /save replaced a long conversation with an empty one, in silence
                raise CommandError(f"/save: {target} holds {other}: not replaced; /save! {arg} replaces "
                                   "it, or pick another name")
            try:   # (the file this session loaded or saved is its own, whatever its keys: a hand-written one too)
                path = self.conv.save(arg, meta={"model": self.llm.name, "settings": self.saved_settings()},
                                      expect=before, owned=owned)
            except TranscriptError as e:
                raise CommandError(f"/save: {e}") from None
            except KeyboardInterrupt:   # Ctrl-C mid-write: the save is atomic; say which file is (not) there
                now = _identity_at(target)
                if now == before or (before is None and now is not None and now[3] == 0):   # (an empty file: a
                    # name reserved where hard links fail, not a conversation written)
                    kept = " (the file there is kept as it was)" if before else \
                        " (an empty file is left at its name)" if now is not None else ""
                    raise CommandInterrupted(f"/save: interrupted; {target} was not written{kept}") from None
                path = target   # it came after the rename: written
            self._own(path)
            n = len(self.conv.turns)
            self.out.info(f"[saved {n} turn{'' if n == 1 else 's'} to {path}]")
        elif name == "/load":
            from ..engine.errors import BitNetError
            try:   # the file as it is before reading: one rewritten meanwhile is not taken as the one loaded
                loaded = _identity(os.stat(same_file_key(arg)))
            except OSError:
                loaded = None
            try:
                conv = Conversation.load(arg)
            except TranscriptError as e:
                raise CommandError(f"/load: {e}") from None
            kept_system = conv.system is None and self.conv.system is not None
            if kept_system:   # a file saved without one keeps this session's (-sys, /system): it was dropped unsaid
                conv.system = self.conv.system
            try:   # the template and tokenizer take it (a hand-edited file may hold what neither can): else the
                # current one stays; fitted to this session's context (a save from a smaller -c hid turns that fit).
                # Ctrl-C is heard after every tokenizer call (a second one at once), keys typed meanwhile not echoed
                with sigint_as_flag() as flag, quiet_terminal(self.out.interactive):
                    out_of_view, fits = self._first_in_view(conv, arg, flag)
                    conv.window_start = out_of_view
                    if fits:
                        ids = self.llm.chat_prompt(conv.messages(), add_generation_prompt=False)
                    else:   # the newest turn alone overflows the window: rendered (the template takes it), not
                        ids = None   # tokenized whole (15 MB: a minute)
                        self.llm.chat_text(conv.messages(), add_generation_prompt=False)
                # looked at once the handlers are back: a signal that came as they were put back set the flag and
                self._load_heard(flag, arg)   # nothing read it (a SIGTERM lost: the load went on, bitchat stayed)
            except KeyboardInterrupt:   # a second Ctrl-C
                raise CommandInterrupted(f"/load {arg}: interrupted; the current conversation is kept") from None
            except (BitNetError, ValueError, RecursionError) as e:
                raise CommandError(f"/load: {arg}: this model cannot take the conversation: {e}") from None
            self.conv = conv
            self.cached_turn = None
            restored = self.restore_settings(conv.meta.get("settings"), f"/load {arg}")
            self._save_recovery()
            if loaded is not None:
                self.own_files[same_file_key(arg)] = loaded
            n = len(conv.turns)
            system = "no system prompt" if conv.system is None else \
                f"system prompt {_short(conv.system)}" + (" kept (the file has none)" if kept_system else "")
            restored = f"; settings restored: {', '.join(restored)}" if restored else ""
            model = conv.meta.get("model")   # ollama's /load switches to it; here the loaded model stays: said
            restored += f"; saved with {model}" if isinstance(model, str) and model != self.llm.name else ""
            self.out.info(f"[loaded {n} turn{'' if n == 1 else 's'} from {arg}; {system}{restored}]")
            if fits:
                self.prefill_conversation(known=ids, out_of_view=out_of_view)
            elif self._system_overflow():
                self.out.notice(f"[{self._system_prompt_too_long(self._system_overflow())}]")
            else:
                self.last_turn_out_of_view()
        elif name == "/retry":
            self.retry()

    def _first_in_view(self, conv: Conversation, name: str, flag) -> tuple[int, bool]:
        """The oldest turn of `conv` that may fit this session's window, and whether the newest turn alone may: the
        turns' own tokens, counted from the newest back until they alone overflow it, so only about a context's
        worth of text is tokenized, a turn at a time with Ctrl-C (`flag`) heard after each call (a whole large file
        in one tokenizer call took minutes, deaf to it), and of a turn far beyond the window only enough to know."""
        budget = self.llm.n_ctx - self._reserve()
        total = 0
        for i in range(len(conv.turns) - 1, -1, -1):
            t = conv.turns[i]
            for text in (t.user, t.assistant or ""):   # (each counted once: the next question's fit reuses them)
                total += self._text_tokens(text, lambda: self._load_heard(flag, name))[0]
            total = max(total, 1)
            if total > budget:   # with the template's own tokens this turn and all older ones cannot fit
                return min(i + 1, len(conv.turns) - 1), i < len(conv.turns) - 1
        return 0, True

    @staticmethod
    def _load_heard(flag, name: str) -> None:
        """A signal that came while /load read the file: SIGTERM / SIGHUP leave, Ctrl-C stops the load (the current
        conversation is kept)."""
        if flag.terminated:
            raise Terminated(flag.terminated)
        if flag.hit:
            raise CommandInterrupted(f"/load {name}: interrupted; the current conversation is kept")

    def set_system(self, text: str, name: str) -> None:
        from ..engine.formats.tokenizer import decode_utf8

        if not text:   # /set system """ """: an empty block
            raise CommandError(f"{name} needs the text, e.g. {name} You are brief.")
        try:   # typed in a locale that is not UTF-8 (as a message): lone surrogates made every /save fail
            text = decode_utf8(_typed_text(text), name)
        except ValueError as e:
            raise CommandError(f"[{e}; the system prompt is unchanged{_locale_note()}]") from None
        problem = lone_surrogate(text, name)
        if problem:
            raise CommandError(f"{problem}; the system prompt is unchanged")
        self.conv.system = text
        self._save_recovery()
        self.out.info("[system prompt set]")
        self.system_notice()

    def system_notice(self) -> None:
        """One line when the system prompt leaves no room for a message, or less than the answer's reserve: said
        when it is set (-sys, /system), not only at the next message's refusal or cut answer."""
        n = self._system_overflow()
        if n:
            self.out.notice(f"[{self._system_prompt_too_long(n)}]")
            return
        n = self._system_tokens()
        if n and int(n) > self.llm.n_ctx - self._reserve():
            self.out.notice(f"[the system prompt takes {n} of the {self.llm.n_ctx}-token context: less than the "
                            f"{self._reserve()} kept for an answer remain beside a message, so answers will be cut "
                            "short; shorten it (/system) or start bitchat with a larger -c]")

    def describe_settings(self) -> str:
        return f"{self.settings.describe()} format={self.format_label}"

    def set_thinking(self, on: bool) -> None:
        """/set think | nothink: the template's enable_thinking for the next answers (-rea on | off)."""
        if not self.llm.thinks:
            raise CommandError(f"/set {'think' if on else 'nothink'}: {self.llm.name}'s chat template does not think")
        self.llm.set_template_kwargs({**self.llm.template_kwargs, "enable_thinking": on})
        self.out.info(f"[thinking {'on' if on else 'off'}]")
        self._save_recovery()

    def set_format(self, value: str) -> None:
        """ollama's words: /set format json (answers are a JSON object), /set format FILE (a JSON Schema file),
        /set format off. The schema is compiled now, so a bad one is refused here, not at the next answer."""
        from ..engine.errors import ConstraintError
        from ..engine.runtime.constraints import Constraint

        if value.lower() in ("off", "none", "text"):
            self.format, self.format_label, self.format_spec = None, "off", None
            self.out.info("[format off: plain text answers]")
            self._save_recovery()
            return
        try:
            if value.lower() == "json":
                spec = Constraint.json_object(where="/set format json", jump_forward=self.jump_forward)
            else:
                text = _read_schema_file(value)
                spec = Constraint.json_schema(text, where=f"/set format {value}", jump_forward=self.jump_forward)
        except ConstraintError as e:
            raise CommandError(str(e)) from None
        self.use_format(spec, value)
        self.out.info(f"[format = {value}: every answer matches it]")
        self._save_recovery()

    def use_format(self, spec, label: str) -> None:
        """Compile `spec` (a Constraint) as the answers' format, named `label`; CommandError when it cannot be."""
        from ..engine.errors import ConstraintError

        try:
            self.format = self.llm.compile_constraint(spec)
        except ConstraintError as e:
            raise CommandError(str(e)) from None
        self.format_label, self.format_spec = label, spec

    # ---- the settings /save keeps and /load restores -------------------------------------------
    def saved_settings(self) -> dict:
        """Every setting /set changes: the sampling settings, the format (json, or a schema's file name and the
        schema itself, so it loads where the file is gone) and, on a thinking template, whether it thinks."""
        d = vars(self.settings).copy()
        d["dry_sequence_breakers"] = list(self.settings.dry_sequence_breakers)
        spec = self.format_spec
        d["format"] = None if spec is None else "json" if spec.kind == "json_object" else \
            {"file": self.format_label, "schema": json.loads(spec.source)}
        if self.llm.thinks and "enable_thinking" in self.llm.template_kwargs:
            d["think"] = bool(self.llm.template_kwargs["enable_thinking"])
        return d

    def restore_settings(self, saved, where: str) -> list[str]:
        """Put back what saved_settings() wrote (a file of an older bitchat may hold only some); a value this
        model or session cannot take is skipped with one line naming it. Returns the changes ("temp 0")."""
        from ..engine.errors import ConstraintError
        from ..engine.runtime.constraints import Constraint

        if not isinstance(saved, dict):
            return []
        changed, current_format = [], self.saved_settings()["format"]

        def skip(name, why):
            self.out.notice(f"[{where}: setting {name} not restored: {why}]")
        for name, value in saved.items():
            if name == "format":
                if value == current_format:
                    continue
                try:
                    if value is None:
                        self.format, self.format_label, self.format_spec = None, "off", None
                    elif value == "json":
                        spec = Constraint.json_object(where=f"{where}: format", jump_forward=self.jump_forward)
                        self.use_format(spec, "json")
                    elif isinstance(value, dict) and isinstance(value.get("file"), str) and "schema" in value:
                        self.use_format(Constraint.json_schema(value["schema"], where=f"{where}: format",
                                                               jump_forward=self.jump_forward), value["file"])
                    else:
                        skip("format", f"{_short(json.dumps(value))} is not json, off or a schema")
                        continue
                except (CommandError, ConstraintError) as e:
                    skip("format", str(e))
                    continue
                changed.append(f"format {self.format_label}")
            elif name == "think":
                if not isinstance(value, bool):
                    skip("think", f"{_short(json.dumps(value))} is not true or false")
                elif not self.llm.thinks:
                    skip("think", f"{self.llm.name}'s chat template does not think")
                elif self.llm.template_kwargs.get("enable_thinking") != value:
                    self.llm.set_template_kwargs({**self.llm.template_kwargs, "enable_thinking": value})
                    changed.append("think" if value else "nothink")
            elif name not in SETTING_NAMES:   # ollama's spelling, or a later bitchat's setting: dropped unsaid
                alias = SETTING_ALIASES.get(name.lower(), name.lower())
                label = name if name.isascii() and name.isidentifier() else _short(name)   # escapes an ESC
                skip(label, f"not a setting of bitchat's files (bitchat's files name it {alias})"
                     if alias in SETTING_NAMES else "unknown to this bitchat")
            else:
                text = "random" if value is None and name == "seed" else \
                    json.dumps(value) if name == "dry_sequence_breakers" else \
                    value if isinstance(value, str) and name == "reasoning_budget_message" else \
                    str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
                try:
                    if text is None:
                        raise CommandError(f"{_short(json.dumps(value))} is not a value of it")
                    key, typed = parse_setting(name, text, max_tokens_limit=self.llm.n_ctx)
                except CommandError as e:
                    skip(name, str(e).removeprefix(f"/set {name}: "))
                    continue
                if typed != getattr(self.settings, key):
                    setattr(self.settings, key, typed)
                    if key == "seed":
                        self.seed_offset = 0
                    shown = "random" if typed is None else json.dumps([*typed]) if isinstance(typed, tuple) \
                        else f"{typed:g}" if isinstance(typed, float) else \
                        shown_max_tokens(typed) if key == "max_tokens" else typed
                    if key == "max_tokens" and typed != UNTIL_END and typed < int(text):   # capped to the context
                        shown = f"{shown} (saved {text}: more than this {self.llm.n_ctx}-token context)"
                    changed.append(f"{key} {shown}")
        return changed

    def describe_model(self) -> str:
        llm, c = self.llm, self.llm.config
        lines = [
            f"model:    {llm.name}" + (f"  ({self.model_label})" if self.model_label and self.model_label != llm.name else ""),
            f"source:   {getattr(llm, 'source', None) or '-'}",
            f"shape:    {c.n_layers} layers, hidden {c.hidden_size}, ffn {c.intermediate_size}, "
            f"{c.n_heads} heads ({c.n_kv_heads} kv, dim {c.head_dim}), vocab {c.vocab_size}, {c.hidden_act}",
            f"context:  {llm.n_ctx} tokens (model max {c.context_length}); in use {self.tokens_in_cache}",
            f"threads:  {self._threads_used()}",
            f"sampling: {self.settings.describe()}",
            f"system:   {self.conv.system!r}" if self.conv.system else "system:   (none)",
        ]
        return "\n".join(lines)

    def _threads_used(self) -> str:
        """The threads in use as /show info says it: -t as given, or as capped to the CPUs there are (it said 64
        where the warning said 2 were used), or 'auto'."""
        used = getattr(self.llm, "threads", None)
        if not self.threads:   # (decode's count may be tuned from there: not named)
            return "auto"
        if used is not None and used != self.threads:
            return f"{used} (-t {self.threads} is more than the {used} CPU cores available)"
        return str(self.threads)

    def describe_stats(self) -> str:
        s = self.last_stats
        lines = []
        if s is None:   # no answer yet, or the last one stopped before its first token
            last = self.conv.turns[-1] if self.conv.turns else None
            lines.append("last answer: interrupted before its first token" if last is not None and last.interrupted
                         and not last.assistant else "last answer: none yet")
        else:   # the very line shown after the answer, then what it does not say
            pre = f"prefill {s.prefill_tps:.1f} tok/s, " if s.prefill_tps else ""
            lines.append(f"last answer: {format_stats(s, s.n_generated)}  ({pre}stop: {s.finish_reason})")
            lookup = getattr(self.llm, "lookup", None)
            if s.n_drafted or (lookup is not None and lookup.draft_max):   # --draft-max: how much it took
                lines.append(f"drafts:      {s.n_accepted}/{s.n_drafted} draft tokens accepted (prompt lookup, "
                             "forced tokens)")
        mean = f"{self.total_decode_tokens / self.total_decode_s:.1f} tok/s" if self.total_decode_s > 0 else "-"
        n = len(self.conv.turns)
        lines.append(f"session:     {n} turn{'' if n == 1 else 's'} ({len(self.conv.window_turns())} in the window, "
                     f"{self.conv.window_start} dropped), {self.total_generated} tokens generated, mean decode {mean}")
        lines.append(f"context:     {self.tokens_in_cache} / {self.llm.n_ctx} tokens")
        return "\n".join(lines)


FORMAT_MAX_BYTES = SETTINGS_FILE_MAX   # /set format FILE reads at most this much


def _read_schema_file(value: str) -> str:
    """The text of /set format's FILE (~ expanded, as /save and /load take it), or CommandError in one line: only a
    regular file of at most FORMAT_MAX_BYTES (engine/fileio.py)."""
    try:
        return read_settings_file(value, "a JSON Schema", FORMAT_MAX_BYTES)
    except ValueError as e:
        raise CommandError(f"/set format {value}: {e} (give json, off, or a JSON Schema file)") from None


def _typed_text(text: str) -> str:
    """A line typed in a terminal whose locale is not UTF-8 (LANG=C) holds the UTF-8 it was sent as lone surrogates
    (Python's surrogateescape of each byte): the text they spell, when they are UTF-8 (it was refused as "not UTF-8,
    convert it with iconv"); else as it came (refused, naming the byte)."""
    if not any("\udc80" <= ch <= "\udcff" for ch in text):
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError:
        return text


def _locale_note() -> str:
    """Where the bytes were read with a locale that is not UTF-8: said, with the way to one. Python reads a C or
    POSIX locale (LANG=C, LC_ALL=C) in its UTF-8 mode, so its encoding says UTF-8 there: the locale as the user
    set it is named instead (the docs promised it; the line was the one of a UTF-8 locale)."""
    import locale

    encoding = locale.getpreferredencoding(False)
    if not _utf8_name(encoding):
        return f"; the locale's encoding is {encoding}, not UTF-8: set LANG/LC_ALL to a UTF-8 locale, e.g. C.UTF-8"
    setting = _locale_setting()
    if setting is None or _utf8_name(setting.partition("=")[2]):
        return ""
    return f"; the locale ({setting}) is not UTF-8: set LANG/LC_ALL to a UTF-8 locale, e.g. C.UTF-8"


def _utf8_name(name: str) -> bool:
    """Whether an encoding or a locale's name (C.UTF-8, en_US.utf8) says UTF-8."""
    name = name.lower().replace("-", "").replace("_", "")
    return name in ("utf8", "cp65001") or name.endswith(".utf8") or ".utf8@" in name


def _locale_setting() -> str | None:
    """The variable that chose the character locale, as the user set it ("LC_ALL=C"), or None where no C or
    POSIX locale made Python read in its UTF-8 mode. Python puts LC_CTYPE=C.UTF-8 in the environment itself when
    it coerces LANG=C (PEP 538): that one is not the user's."""
    import sys

    if not sys.flags.utf8_mode:   # (then the locale's own encoding is the one read, said by the caller)
        return None
    coerced = not os.environ.get("LC_ALL") and _utf8_name(os.environ.get("LC_CTYPE", "")) and sys.flags.utf8_mode
    for var in ("LC_ALL", "LC_CTYPE", "LANG"):
        value = os.environ.get(var)
        if value and not (var == "LC_CTYPE" and coerced):
            return f"{var}={value}"
    return "no LANG, LC_CTYPE or LC_ALL set: the C locale"


def _short(text: str, width: int = 60) -> str:
    """`text` quoted on one line, cut to about `width` characters."""
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def _holds_something(path: str) -> bool:
    """Whether there is a non-empty file (or anything but a regular file) at `path`."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.lexists(path)
    return st.st_size > 0 or not stat.S_ISREG(st.st_mode)


def _free_beside(path: str) -> str:
    """X-PID.json beside X.json (X-PID-2.json, ... when taken): a recovery copy of this process's own."""
    base, ext = os.path.splitext(path)
    base = f"{base}-{os.getpid()}"
    candidate, n = base + (ext or ".json"), 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{base}-{n}{ext or '.json'}"
    return candidate


def _identity_at(path: str) -> tuple | None:
    """The _identity of the file at `path`, or None where there is none."""
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


_identity = file_identity   # a file's identity and version (transcript.py: what Conversation.save compares)


def _prefill(llm, ids: list[int], params, cancel=None) -> None:
    """Put `ids` in the KV cache without generating (generate with max_tokens=0, see INTERFACES.md); `cancel`
    stops it between prefill chunks."""
    gen = llm.generate(ids, params, max_tokens=0, cancel=cancel)
    try:
        for _ in gen:
            pass
    finally:
        gen.close()
