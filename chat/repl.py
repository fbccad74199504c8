'''The two front ends of a ChatSession: the prompt_toolkit REPL (a terminal) and the plain line loop
(stdin is a pipe or a file, so scripts can drive bitchat).

REPL keys: Enter sends, except inside an open """ block where it adds a line; Esc-Enter always adds
a line; Tab completes commands and /set names; Ctrl-C clears the line (twice at an empty prompt:
a hint how to leave); Ctrl-D at an empty prompt exits. Input history persists in a file.
'''
from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import sys
import tempfile
import threading
import traceback
from contextlib import contextmanager

from ..engine.errors import ENDING_SIGNALS, ModelChangedError, Terminated, write_failed
from .commands import (COMMANDS, CommandError, CommandInterrupted, closes_block, completions, is_command, open_block,
                       parse_command, strip_block)
from .session import ChatSession, ExitChat, terminal_gone
from .transcript import private_dir, state_dir

PROMPT = ">>> "
CONTINUATION = "... "


def history_path() -> str | None:
    """$BITCHAT_HISTORY (empty or /dev/null: no history file, said nowhere, as $BITCHAT_RECOVERY; /dev/null was
    refused as "not a regular file" at every start), else the XDG state dir."""
    env = os.environ.get("BITCHAT_HISTORY")
    if env is not None:
        path = os.path.expanduser(env)
        return path if env.strip() and os.path.realpath(path) != os.devnull else None
    return os.path.join(state_dir(), "history")


HISTORY_KEEP = 1000            # entries of the input history kept (ollama keeps 100)
HISTORY_MAX_BYTES = 1 << 20    # ... and at most this much of them (a pasted page is one entry)


@contextmanager
def history_locked(path: str, flags: int = os.O_WRONLY):
    """An fd on the history file as it is now, held under an exclusive flock: a bitchat starting up (the trim reads
    the file and replaces it) and another one storing a line (an append) take turns; an entry appended between the
    trim's read and its replace was lost. The trim replaces the file's inode, so a lock won on one that has since
    been replaced is dropped and taken again on the new one. Where flock is missing (not POSIX, some network
    filesystems) the fd comes unlocked, as before."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    while True:
        fd = os.open(path, flags | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:   # ENOLCK (NFS without a lock daemon): go on unlocked
                    fcntl = None
            if fcntl is None or os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)   # replaced by a trim while we waited: lock the file that is there now
    try:
        yield fd
    finally:
        os.close(fd)   # (the lock goes with it)


def trim_history(text: str, keep: int, max_bytes: int) -> str | None:
    """The newest entries of a FileHistory text, at most `keep` of them and `max_bytes` in all; None when nothing
    is dropped. An entry that alone takes over a quarter of `max_bytes` (a pasted file) is dropped by itself: it
    pushed every older entry out, and one over `max_bytes` emptied the whole history."""
    starts = [m.start() for m in re.finditer(r"(?m)^# ", text)]
    entries = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    kept: list[str] = []
    size = 0
    for entry in reversed(entries):
        n = len(entry.encode("utf-8"))
        if n > max_bytes // 4:
            continue
        if len(kept) >= keep or size + n > max_bytes:
            break
        kept.append(entry)
        size += n
    if len(kept) == len(entries) and (entries or len(text.encode("utf-8")) <= max_bytes):   # (no entry: not ours)
        return None
    return "\n" + "".join(reversed(kept))


def private_history(path: str, keep: int = HISTORY_KEEP, max_bytes: int = HISTORY_MAX_BYTES) -> None:
    """The input history file, made private (0600 in a 0700 directory, as ollama's; what was typed may be a
    secret) and cut to its last `keep` entries and `max_bytes` (it grew without bound, all of it read at start).
    prompt_toolkit's FileHistory format: each entry a "# time" line, then its lines each after a "+"."""
    d = os.path.dirname(path) or "."
    private_dir(d)
    if os.path.exists(path) and not os.path.isfile(path):   # /dev/null (history off), a FIFO, a device: never
        raise OSError(errno.EINVAL, "not a regular file")     # chmod it, nor read an endless one
    os.close(os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)   # made by an earlier bitchat with the umask's bits
    size = os.path.getsize(path)
    if size < 16384 and size <= max_bytes:   # under 1,000 entries for sure (each has a ~30-byte time line)
        return
    # written through a link (a dotfiles repo's, stow's): replacing the link itself left a copy here and the
    # user's file behind, no longer written; the copy goes beside the file it replaces (one filesystem)
    real = os.path.realpath(path)
    with history_locked(real, os.O_RDWR) as fd:
        with open(fd, encoding="utf-8", errors="replace", closefd=False) as f:
            text = f.read()
        trimmed = trim_history(text, keep, max_bytes)
        if trimmed is None:
            return
        fd, tmp = tempfile.mkstemp(prefix=".history-", suffix=".tmp", dir=os.path.dirname(real))   # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(trimmed)
            os.replace(tmp, real)
        except BaseException:   # a full disk: no partial copy left taking the space
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def history_entry(string: str) -> bytes:
    """One entry of prompt_toolkit's FileHistory format, as its store_string writes it: a "# time" line, then each
    line of `string` after a "+"."""
    import datetime

    return (f"\n# {datetime.datetime.now()}\n" + "".join(f"+{line}\n" for line in string.split("\n"))).encode("utf-8")


def append_whole(fd: int, data: bytes) -> None:
    """Append `data` to the file open at `fd` (O_APPEND, under history_locked) whole or not at all: a write that
    fails partway (a full disk) is cut back off, or the part that fitted came back at the next start as an entry."""
    before = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            n = os.write(fd, view)
            if n <= 0:   # (a file takes a byte or says why not: never a loop on nothing written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[n:]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, before)
        raise


def guarded_file_history(path: str):
    """prompt_toolkit's FileHistory whose writes may fail (a full disk, the file removed): the first failure is
    kept in .problem (the REPL says it once) and the history goes on in memory; prompt_toolkit printed its own
    traceback and "Press ENTER to continue" at every line. Each append holds the history's lock (history_locked),
    so a bitchat trimming the shared file at its start cannot lose it."""
    from prompt_toolkit.history import FileHistory

    class GuardedFileHistory(FileHistory):
        problem: str | None = None
        said = False

        def store_string(self, string: str) -> None:
            if self.problem is not None:
                return
            try:   # a line typed in another encoding (its bytes kept as surrogates) is not sent, nor stored: the
                string.encode("utf-8")   # write raised from prompt_toolkit's loop (a traceback, "Press ENTER")
            except UnicodeError:
                return
            try:
                with history_locked(os.path.realpath(path)) as fd:
                    append_whole(fd, history_entry(string))
            except OSError as e:
                self.problem = f"[history file {path}: {e.strerror or e}; history kept in memory only]"

    return GuardedFileHistory(path)


def handle_line(session: ChatSession, text: str) -> bool:
    """Run one complete input (a command or a message). False when the user asked to leave;
    errors become one line and the session goes on. Returns True otherwise."""
    try:
        if text.lstrip().startswith("//"):   # "//etc is a path" sends "/etc is a path"
            session.ask(text.lstrip()[1:])
        elif is_command(text):
            session.run_command(parse_command(text))
        else:
            message = strip_block(text)
            if message:
                session.ask(message)
    except ExitChat:
        return False
    except CommandError as e:
        session.out.notice(str(e))
        session.had_errors = True
        if isinstance(e, CommandInterrupted) and session.ctrl_c_ends:   # a piped run: Ctrl-C ends it (exit 130)
            raise KeyboardInterrupt from None
    except (BrokenPipeError, ModelChangedError):   # stdout was closed (`| head`): not a bug; bitchat ends quietly;
        raise   # the model file rewritten under it: bitchat ends with one line naming its recovery copy (cli/chat.py)
    except Exception as e:  # a bug must not take the transcript with it
        if write_failed(e) and not terminal_gone(e):   # stdout on a full disk: bitchat leaves, saying so (cli/chat.py)
            raise
        session.out.end_answer()
        session.out.notice(f"[internal error: {type(e).__name__}: {e}; the session goes on — /save keeps your work]")
        if os.environ.get("BITNET_DEBUG") or os.environ.get("BITCHAT_DEBUG"):
            traceback.print_exc()
        session.had_errors = True
    return True


def run_plain(session: ChatSession, stream=None, prompt=None) -> int:
    """Lines of `stream` (stdin's bytes by default; text or bytes) become turns; a line that is a command runs
    it; \"\"\" blocks span lines (input that ends inside one sends it, saying so). A line that is not UTF-8 is
    skipped with one line naming the byte. Exit 0 at end of input, 1 if a command or turn failed on the way.
    `prompt(text)`: lines typed at a terminal whose output is not one (`bitchat | tee log`): it shows the prompt
    before each line (on stderr, so the answers' pipe stays clean), a Ctrl-C while a line is typed clears it (and
    an open block), a byte that is not UTF-8 names the locale, and the exit is 0, as in the REPL."""
    from .session import _locale_note
    from ..engine.formats.tokenizer import decode_utf8

    stream = stream or getattr(sys.stdin, "buffer", sys.stdin)
    block: list[str] | None = None
    number = opened = 0   # the line read last; the line the open block began on

    def status() -> int:   # typed: a mistyped command was said and the user went on, as in the REPL (exit 0)
        return 1 if session.had_errors and prompt is None else 0

    def run(text: str) -> bool:
        if prompt is None:
            return handle_line(session, text)
        try:
            return handle_line(session, text)
        except KeyboardInterrupt:   # typed: a Ctrl-C outside an answer ends nothing, as in the REPL
            session.out.end_answer()
            session.out.notice("[interrupted]")
            return True
    while True:   # until the end of input or /bye: each pass reads a line
        if prompt is not None:
            prompt(CONTINUATION if block is not None else PROMPT)
        try:
            raw = stream.readline()
        except KeyboardInterrupt:
            if prompt is None:   # (piped input: Ctrl-C ends the run, cli/chat.py says where the turns are)
                raise
            prompt("\n")   # the terminal dropped the line typed so far; the block goes with it
            block = None
            continue
        if not raw:
            break
        number += 1
        where = f"stdin line {number}" if prompt is None else "typed line"   # (typed: no file to convert)
        try:
            # start: the stream's UTF-8 BOM (a script saved by a Windows editor) is dropped, never a later line's;
            # it made the first line's command a chat message
            line = decode_utf8(raw, where, start=number == 1).rstrip("\r\n") \
                if isinstance(raw, bytes) else decode_utf8(raw.rstrip("\n"), where, start=number == 1)
        except ValueError as e:
            session.out.notice(f"[{e}; the line was skipped{'' if prompt is None else _locale_note()}]")
            session.had_errors = True
            continue
        if block is not None:
            block.append(line)
            if closes_block(line):
                text, block = "\n".join(block), None
                if not run(text):
                    return status()
            continue
        if not line.strip():
            continue
        if open_block(line):
            block, opened = [line], number
            continue
        if not run(line):
            return status()
    if block is not None:  # unterminated block at end of input: send what there is, saying so (commands after the
        # opening line went into it: a script's /save never ran)
        session.out.notice(f'[input ended inside the """ block opened at line {opened}: sent as one message]')
        session.had_errors = True
        run("\n".join(block) + '\n"""')
    return status()


@contextmanager
def ending_signals_at_prompt(app):
    """SIGTERM / SIGHUP while the prompt reads a line end it through prompt_toolkit's own exit, and the prompt
    raises Terminated. Raised straight from the signal, the exception landed in whatever the event loop was
    running (a key's callback, a task), which hands it to prompt_toolkit's error handler: "Unhandled exception in
    event loop ... Press ENTER to continue", and bitchat went on. A signal after the line was taken (the prompt
    winding down) is raised once the prompt has returned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []

    def ending(signum, frame):
        came.append(signum)
        loop = getattr(app, "loop", None)
        if not app.is_running or loop is None:
            raise Terminated(signum)   # outside the event loop (it starts or has stopped): nothing to swallow it
        loop.call_soon_threadsafe(leave, signum)   # the loop's own way in from a signal (its wake-up pipe)

    def leave(signum):
        if app.is_running and app.future is not None and not app.future.done():
            app.exit(exception=Terminated(signum))

    before = {s: signal.signal(s, ending) for s in ENDING_SIGNALS}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    if came:
        raise Terminated(came[0])


def ctrl_c_typed_ahead(inp) -> bool:
    """Whether keys read with the Enter that took the line, and kept for the next prompt (prompt_toolkit's
    typeahead), hold a Ctrl-C: it is taken out (with what came before it) and True, the answer's to act on (it
    only cleared the next, empty prompt and the answer ran whole)."""
    from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
    from prompt_toolkit.keys import Keys

    ahead = get_typeahead(inp)
    hits = [i for i, k in enumerate(ahead) if k.key == Keys.ControlC]
    store_typeahead(inp, ahead[hits[-1] + 1:] if hits else ahead)
    return bool(hits)


def run_repl(session: ChatSession) -> int:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.application import run_in_terminal
    from prompt_toolkit.completion import Completer, Completion
    from prompt_toolkit.history import InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    class SlashCompleter(Completer):
        def get_completions(self, document, complete_event):
            before = document.text_before_cursor
            word = before.rsplit(" ", 1)[-1]
            for cand in completions(before):
                meta = COMMANDS[cand][1] if cand in COMMANDS else ""
                yield Completion(cand, start_position=-len(word), display_meta=meta)

    path = history_path()
    history = InMemoryHistory()
    if path:
        try:
            private_history(path)
            history = guarded_file_history(path)
        except OSError as e:
            session.out.notice(f"[history file {path}: {e.strerror}; history kept in memory only]")

    empty_interrupts = [0]
    accepted = [False]   # the line has been taken: a Ctrl-C from here on is for its answer
    keys = KeyBindings()

    @keys.add("enter")
    def _enter(event):
        buf = event.current_buffer
        if open_block(buf.text):
            buf.insert_text("\n")
        else:
            accepted[0] = True
            buf.validate_and_handle()

    @keys.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @keys.add("c-@")
    def _nul(event):
        # Ctrl-@ / Ctrl-Space is a NUL byte, taken as text as a paste or piped input takes it (shown ^@); it was
        # emacs' set-mark, and the keys typed after it never reached the line: "hello^@world" sent "hello"
        event.current_buffer.insert_text("\x00")

    @keys.add("c-c")
    def _interrupt(event):
        buf = event.current_buffer
        if buf.text:
            buf.reset()
            empty_interrupts[0] = 0
            return
        empty_interrupts[0] += 1
        if empty_interrupts[0] >= 2:
            run_in_terminal(lambda: session.out.dim("(use /bye or Ctrl-D to exit)"))

    # enable_suspend: Ctrl-Z stops bitchat as in bash, Python's REPL and llama-cli (it typed a \x1a into the line)
    prompt = PromptSession(history=history, completer=SlashCompleter(), complete_while_typing=False,
                           key_bindings=keys, multiline=True, enable_suspend=True,
                           prompt_continuation=lambda width, line_number, soft_wrap: CONTINUATION)
    def sigint_at_prompt(signum, frame):
        session.interrupt_pending = session.interrupt_pending or accepted[0]

    while True:
        # a Ctrl-C while the prompt sets itself up (a second one just after an answer was stopped) is nothing, and
        # one as it winds down after taking the line is for that line's answer: a KeyboardInterrupt there leaves
        # a half-built event loop printing tracebacks as it goes
        accepted[0] = session.interrupt_pending = False
        previous = signal.signal(signal.SIGINT, sigint_at_prompt) \
            if threading.current_thread() is threading.main_thread() else None
        try:
            with ending_signals_at_prompt(prompt.app):
                text = prompt.prompt(PROMPT)
            if ctrl_c_typed_ahead(prompt.app.input):
                session.interrupt_pending = True
        except KeyboardInterrupt:   # should not happen (Ctrl-C is bound), but never a traceback
            continue
        except EOFError:
            session.out.end_answer()
            break
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        empty_interrupts[0] = 0
        if getattr(history, "problem", None) and not history.said:   # said once; the history goes on in memory
            session.out.notice(history.problem)
            history.said = True
        if not text.strip():
            continue
        try:
            if not handle_line(session, text):
                break
        except KeyboardInterrupt:   # Ctrl-C outside an answer (e.g. while rendering the prompt)
            session.out.end_answer()
            session.out.notice("[interrupted]")
    return 0
