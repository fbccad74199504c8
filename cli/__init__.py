# PYTHON_ARGCOMPLETE_OK
"""`bitnet`: the command line. Subcommands live in cli/<name>.py; `bitchat` is cli/chat.py.

Exit codes (engine/errors.py; docs/usage.md "Errors"): 0 ok; 2 bad input — errors the user can act on
(engine.errors.BitNetError) print one line to stderr, and so does a model file truncated or rewritten while
mapped (the C SIGBUS guard, engine/faults.py); 70 an engine bug (KernelError or any unexpected exception:
one line asking for a report, BITNET_DEBUG=1 shows the traceback); 130 Ctrl-C, keeping what was printed;
a closed stdout (`| head`, `>&-`) ends quietly (exit 0); a closed stdin (`<&-`) is empty input.
An unknown flag gets that subcommand's usage and a "did you mean" suggestion.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import signal
import sys

TYPE_CHECKING = False   # (typing's own constant: importing typing here cost bitchat's start before its Ctrl-C guard)
if TYPE_CHECKING:   # the parser's type only: argparse itself is imported where the parser is built
    import argparse

COMMANDS = ["run", "convert", "inspect", "info", "pull", "list", "rm", "serve", "bench", "perplexity", "embed"]


def build_parser(subparsers: dict | None = None) -> argparse.ArgumentParser:
    """The `bitnet` parser; `subparsers` (if given) is filled with name -> subcommand parser."""
    import argparse   # here, not at the top: bitchat's entry point imports this package before its Ctrl-C guard

    from .flags import Parser

    p = Parser(
        prog="bitnet",
        description="Run BitNet b1.58 ternary language models on the CPU.",
        epilog="Chat in the terminal: bitchat -m MODEL (its own command; /help inside), or bitnet run -cnv.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from ..engine import __version__

    p.add_argument("--version", action="version", version=f"bitnet {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f".{name}", __name__)
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_main=mod.main)
        if subparsers is not None:
            subparsers[name] = sp
    return p


def report_bug(prog: str, e: BaseException) -> int:
    """One line for an engine bug (never blame the input), EXIT_BUG; $BITNET_DEBUG shows the traceback."""
    from ..engine.errors import BUG_REPORT_HINT, EXIT_BUG, BitNetError

    if os.environ.get("BITNET_DEBUG"):
        import traceback

        traceback.print_exception(e)   # e's own (print_exc shows "NoneType: None" outside an except block)
    what = str(e) if isinstance(e, BitNetError) else f"{type(e).__name__}: {e}"
    print(f"{prog}: internal error: {' '.join(what.split())} ({BUG_REPORT_HINT}; BITNET_DEBUG=1 shows the"
          " traceback)", file=sys.stderr)
    return EXIT_BUG


_UNENCODABLE = "bitnet.replace-and-warn"
_WARN = {"prog": "bitnet", "said": False}   # the running command's name; whether this run said it yet


def _replace_and_warn(e: UnicodeEncodeError):
    bytes_only = all("\udc80" <= ch <= "\udcff" for ch in e.object[e.start:e.end])   # a name's undecodable bytes
    if not _WARN["said"] and not bytes_only:   # (no fault of stdout's encoding: never blamed on it)
        _WARN["said"] = True
        with contextlib.suppress(Exception):   # never the output's failure (stderr closed, ...)
            print(f"{_WARN['prog']}: warning: stdout's encoding ({e.encoding}) cannot show some characters of the "
                  "output; they are written as '?' (set PYTHONIOENCODING=utf-8, or use a UTF-8 locale such as "
                  "LANG=C.UTF-8)", file=sys.stderr, flush=True)
    return "?" * (e.end - e.start), e.end


def replace_unencodable(prog: str = "bitnet") -> None:
    """stdout writes what its encoding cannot hold as '?' (an ASCII locale, PYTHONIOENCODING=ascii): every
    command's text may hold more than ASCII (bench's +-, a cached model's unicode name, an answer), and an
    encoding error there ended the command as an "internal error", after the work was done. The first '?' of a
    run is said on stderr (text lost silently, even inside a JSON answer, was taken for the model's). Once, for
    every command (bitnet and bitchat); stderr replaces already (Python's backslashreplace)."""
    import codecs

    _WARN.update(prog=prog, said=False)
    codecs.register_error(_UNENCODABLE, _replace_and_warn)
    try:
        sys.stdout.reconfigure(errors=_UNENCODABLE)
    except (AttributeError, ValueError):   # not a TextIOWrapper (a test's capture), or None (fd 1 closed)
        pass


def takes_any_text(stream) -> bool:
    """Whether `stream`'s encoding holds every character (UTF-8, UTF-16, ...): else JSON it is written escaped
    (\\u00e9), not turned into '?'."""
    import codecs
    try:
        return codecs.lookup(getattr(stream, "encoding", None) or "ascii").name.startswith("utf")
    except LookupError:
        return False


def main(argv: list[str] | None = None) -> int:
    with signals_restored(command_line=argv is None):
        ended_early()
        closed_std_streams()   # before anything writes: a closed stdout becomes /dev/null
        replace_unencodable()
        with lossy_stderr():   # `bitnet run -v 2>&-`: the timings lost, never the answer
            try:
                return interruptible(lambda: stdout_flushed(lambda: _main(argv)))
            except (ImportError, MemoryError) as e:   # the first imports (the kernels, numpy) short of memory
                if not out_of_memory(e):
                    raise
                print(f"bitnet: error: {OUT_OF_MEMORY}", file=sys.stderr)
                return 2   # EXIT_BAD_INPUT (its module may be what did not load)


@contextlib.contextmanager
def signals_restored(command_line: bool = False):
    """SIGINT / SIGTERM / SIGHUP handlers as they were before, when main() returns: a program that calls main()
    (a notebook) kept the command's handlers, and a later SIGTERM raised Terminated in whatever it ran next.
    The console script exits right after, so its 128 + signum stays. From the command line (main() without
    argv), after a command that has said it stopped (stopped_with: serve), they are ignored instead until the
    process ends: Python's default action killed it by the signal (143 / 130) in the 0.3-0.8 s the interpreter
    takes to end (engine threads, modules) after `bitnet serve: stopped`, where a supervisor's repeated SIGTERM
    or a second Ctrl-C asks for what is already happening. Ignored at the OS level (SIG_IGN): Python puts its own
    handlers back to the default early in its teardown, and the exit handlers still run (a store being written
    has its temporary file removed); SIGKILL still ends a teardown that hangs."""
    sigs = [s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP")) if s is not None]
    before = {s: signal.getsignal(s) for s in sigs}
    _STOPPED.clear()
    try:
        yield
    finally:
        if command_line and _STOPPED:
            before = {s: signal.SIG_IGN for s in sigs}
        for s, h in before.items():
            if h is not None and signal.getsignal(s) is not h:   # None: a handler not set from Python
                with contextlib.suppress(ValueError, OSError):   # (not the main thread: nothing was set either)
                    signal.signal(s, h)


_STOPPED: list = []   # not empty once a command has said it stopped (serve): see signals_restored


def stopped_with(code: int) -> int:
    """`code`, the status of a command that has just said it stopped (`bitnet serve: stopped`): a SIGTERM or
    Ctrl-C in what is left of the process's life then leaves it to end with that status (signals_restored)."""
    _STOPPED.append(code)
    return code


def _ended_early(signum, frame):
    with contextlib.suppress(OSError):   # the terminal may be gone (SIGHUP)
        print(f"bitnet: terminated ({signal.Signals(signum).name})", file=sys.stderr)
    raise SystemExit(128 + signum)


def ended_early():
    """SIGTERM / SIGHUP before _main puts its handler in place (the imports of the engine and the subcommands:
    ~1.5 s for `serve`) end with its line and 128 + signum, as later: Python's default action killed the
    process without one. Nothing is written yet then, so there is nothing to unwind. A signal ignored (nohup's
    SIGHUP) stays ignored until _main's own handler."""
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _ended_early)


def interruptible(body) -> int:
    """Ctrl-C before a command's own handler is in place (while Python imports the subcommands, builds the
    parser, ...): a newline and exit 130, as later, never a traceback."""
    try:
        return body()
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


OUT_OF_MEMORY = "out of memory (hint: use a smaller -c/--ctx, or close other programs)"


def out_of_memory(e: BaseException) -> bool:
    """MemoryError, or a library that could not be mapped into memory (ulimit -v: "failed to map segment from
    shared object", "cannot allocate memory"): the machine's state, not a bug to report."""
    if isinstance(e, MemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, ImportError) and ("failed to map segment" in text or "cannot allocate memory" in text)


def _main(argv: list[str] | None) -> int:
    from ..engine.errors import (EXIT_BAD_INPUT, EXIT_BUG, EXIT_INTERRUPTED, BitNetError, Terminated,
                                 write_error_line, write_failed)

    try:   # the parser's imports (every subcommand's module) included
        return _command(argv)
    except Terminated as e:
        with contextlib.suppress(OSError):   # the terminal may be gone (SIGHUP)
            print(f"bitnet: terminated ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum
    except BitNetError as e:
        if e.exit_code == EXIT_BUG:
            return report_bug("bitnet", e)
        print(f"bitnet: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return quiet_broken_pipe()
    except OSError as e:   # stdout or a file on a full disk: one line, not a bug
        if not write_failed(e):
            return report_bug("bitnet", e)
        with contextlib.suppress(OSError):
            print(write_error_line("bitnet", e), file=sys.stderr)
        stdout_to_devnull()   # (stdout_flushed's flush next: not a second line)
        return EXIT_BAD_INPUT
    except Exception as e:  # a bug: one line asking for a report, never a raw traceback
        if out_of_memory(e):   # MemoryError, a library that could not be mapped
            print(f"bitnet: error: {OUT_OF_MEMORY}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return report_bug("bitnet", e)


def _command(argv: list[str] | None) -> int:
    from ..engine import faults
    from ..engine.errors import ENDING_SIGNALS, EXIT_BAD_INPUT, raise_terminated

    from .flags import given_options, maybe_autocomplete, parse_args_suggesting

    subparsers: dict = {}
    parser = build_parser(subparsers)
    maybe_autocomplete(parser)
    argv = [*(sys.argv[1:] if argv is None else argv)]   # (`list` here is the list subcommand's module)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        # llama-cli's habit, `bitnet -p hi`: argparse said "invalid choice: 'hi'" for the command
        import shlex
        print(f"bitnet: error: {argv[0]}: a command comes first, as in `bitnet run {shlex.join(argv)}` (`bitnet "
              "--help` lists the commands)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if argv[:1] == ["chat"]:   # ollama's and llama.cpp users' guess: the chat is its own command
        print("bitnet: error: chat: there is no `bitnet chat`; chat with `bitchat` (the same model flags, /help "
              "inside) or `bitnet run -cnv`", file=sys.stderr)
        return EXIT_BAD_INPUT
    if argv[:1] == ["serve"] and "BITNET_ROUTER_PID" not in os.environ:   # (a router's model takes its flags)
        from .flags import llama_env_argv
        extra, notes, from_env = llama_env_argv(subparsers["serve"], argv[1:], os.environ)
        for note in notes:
            print(f"bitnet serve: warning: {note}", file=sys.stderr)
        argv = ["serve", *extra, *argv[1:]]
    else:
        from_env = {}
    args = parse_args_suggesting(parser, argv, subparsers)
    args.llama_env = from_env   # a bad value of these is said by its variable's name (flags.from_variable)
    args.given_flags = given_options(argv)   # a flag typed at its default value is still given (flags.given)
    if not getattr(args, "_main", None):
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    faults.install("bitnet")
    # SIGTERM (a service stopped) and SIGHUP (its terminal closed) unwind as Ctrl-C does, so what a command was
    # writing (a conversion's temporary store: hundreds of MB) is removed; `serve` and `chat` put their own in place
    for sig in ENDING_SIGNALS:
        signal.signal(sig, raise_terminated)
    return int(args._main(args) or 0)


class _LossyStream:
    """stderr that cannot be written (closed: `2>&-`, a full disk: `2>/dev/full`): its notices are lost, never an
    error; every print to it raised (EBADF, ENOSPC) and a command gave no answer (bitchat none at all). The
    answers are stdout's."""

    def __init__(self, stream):
        self._stream = stream
        self._lost = False

    def write(self, text):
        if not self._lost:
            try:
                return self._stream.write(text)
            except OSError:
                self._lost = True   # from now on written nowhere: what it holds can never go out
        return len(text)

    def flush(self):
        if not self._lost:
            try:
                self._stream.flush()
            except OSError:
                self._lost = True

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Nowhere(io.TextIOBase):
    """What sys.stderr is when fd 2 was closed before Python started (it is None: print sent the notices to
    stdout, amid the answers, and a write to it raised AttributeError)."""

    def write(self, text):
        return len(text)


def closed_std_streams() -> None:
    """stdin or stdout closed before Python started (`<&-`, `>&-`, a daemon's or cron's): Python makes them None,
    and the first read or write was an AttributeError ("internal error", or bitchat's raw traceback). They become
    /dev/null: a closed stdin is empty input, as `</dev/null` is; a closed stdout is one nobody reads, as a pipe
    closed by its reader is (the answer goes nowhere, exit 0)."""
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY)):
        if getattr(sys, name) is not None:
            continue
        try:
            null = os.open(os.devnull, flags)   # the lowest free descriptor: fd itself unless a lower one is free
            if null != fd and not _in_use(fd):
                os.dup2(null, fd)   # (a child process started later gets it too, never a file opened there)
                os.close(null)
                null = fd
            setattr(sys, name, open(null, "r" if fd == 0 else "w", encoding="utf-8", closefd=null != fd))
        except OSError:
            if fd == 1:
                setattr(sys, name, _Nowhere())


def _in_use(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@contextlib.contextmanager
def lossy_stderr():
    """stderr written through _LossyStream while the block runs (bitnet and bitchat: their answers are stdout's)."""
    before = sys.stderr
    if isinstance(before, _LossyStream):
        yield
        return
    sys.stderr = _LossyStream(_Nowhere() if before is None else before)
    try:
        yield
    finally:   # one that lost its text stays: the interpreter's last flush of the real one would fail (exit 120)
        if isinstance(sys.stderr, _LossyStream) and before is not None and not sys.stderr._lost:
            sys.stderr = before


def stdout_flushed(body, prog: str = "bitnet") -> int:
    """Run an entry point's body, then flush stdout while a closed pipe can still end quietly. With stdout a
    pipe, Python holds up to 8 KiB until the interpreter exits: a command that prints less (`bitnet info`,
    `--version`, `--help`) would otherwise meet its reader's hang-up only in that final flush, which prints
    "Exception ignored ... BrokenPipeError" and exits 120. argparse's own exits (--help, --version, usage
    errors) keep their status. A full disk met in that flush is one line and exit 2, as anywhere else."""
    from ..engine.errors import EXIT_BAD_INPUT, write_error_line, write_failed

    try:
        try:
            code = body()
        except SystemExit:
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return quiet_broken_pipe()
    except OSError as e:
        if not write_failed(e):
            raise
        with contextlib.suppress(OSError):
            print(write_error_line(prog, e), file=sys.stderr)
        stdout_to_devnull()
        return EXIT_BAD_INPUT


def write_stdout(text: str) -> None:
    """Write a large text (embeddings, a JSON report) to stdout in 64 KiB pieces, each flushed: Python's buffered
    stdout takes the short count of a write to a nearly full disk and drops the rest without an error (a
    1.8 MB rendering ended at 64 KiB, exit 0); a piece at a time, the write that cannot go through raises."""
    for i in range(0, len(text), 1 << 16):
        sys.stdout.write(text[i: i + (1 << 16)])
        sys.stdout.flush()


def quiet_broken_pipe() -> int:
    """stdout was closed by its reader (`bitnet run ... | head -c 10`): point fd 1 at /dev/null so the
    interpreter's final flush cannot print "Exception ignored ... BrokenPipeError", and exit 0."""
    stdout_to_devnull()
    return 0


def stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null: stdout cannot take more (closed by its reader, a full disk), and what Python still
    holds for it must not fail again in a later or the interpreter's final flush."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
