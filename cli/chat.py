# PYTHON_ARGCOMPLETE_OK
"""`bitchat`: the interactive terminal chat (console script entry point `main`).

    bitchat [-m MODEL] [-sys TEXT] [--temp T] [--top-k K] [--top-p P] [--min-p P]
            [--repeat-penalty R] [--seed S] [-n N] [-c CTX] [-t THREADS]

The flags are `bitnet run`'s (cli/flags.py); `bitnet run -cnv` lands here too
(run_chat). No -m opens the bundled default model. On a terminal it is a prompt_toolkit REPL; when
stdin or stdout is not a terminal, input lines become turns and the output is plain text (typed at a terminal with
stdout piped, `bitchat | tee log`: line mode, said at start, with its prompt on stderr).
Exit codes: 0 normal end, 1 a piped command/turn failed, 2 bad flag or model (also: the model file was
truncated or rewritten while in use), 70 an internal error (a bug: please report it), 130 Ctrl-C while loading,
or at any moment of a run whose stdin is not a terminal (the answer so far is kept, as in the REPL, then it ends).

The conversation is kept in a recovery file while the session runs ($BITCHAT_RECOVERY, empty or /dev/null: none; else
$XDG_STATE_HOME/bitchat/recovery-PID.json, or -PID-2.json beside an earlier session's; a $BITCHAT_RECOVERY that
holds an earlier session's copy is kept too, this session's going to X-2.json beside it, and one another bitchat
writes there while this one runs is never written over: this session's goes to X-PID.json), removed on a normal exit
while it is still the copy this session wrote:
when the process is ended by a fatal fault or Ctrl-C outside a turn (a piped session waiting for input), the one-line
message says where it is (/load it). A path holding a file that is not a recovery copy, or ending in "/", is refused
at start.

Copies left by sessions that no longer run (killed by SIGKILL or the OOM killer, crashed: no line said where) are
named at the next start: one line before the first prompt (how many, the newest one's path, turns and last write,
/load PATH), on stderr also when stdin or stdout is not a terminal (stderr already carries the loading and ready
lines; stdout holds answers only, so a script reading it is never disturbed). Only this session's place counts (the
state dir's recovery-PID*.json, or $BITCHAT_RECOVERY and its X-N.json siblings; none when that is empty or
/dev/null); a copy of a bitchat still running is never named (chat/recovery.py). `bitchat --recovered` lists them
(tab-separated, stdout) and exits. None is ever deleted by bitchat: they are the user's conversations.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from ..chat.commands import FIELD_OF_SETTING, Settings, max_tokens_over_context
from ..chat.render import Output
from ..engine.fileio import is_terminal
from . import lossy_stderr, replace_unencodable
from .flags import (Parser, add_engine_args, add_lm_head_arg, add_system_args, apply_chat_template,
                    check_engine_args, maybe_autocomplete, parse_args_suggesting, sampling_params_from_args,
                    thinking_warnings)

def build_parser() -> argparse.ArgumentParser:
    from ..engine import __version__

    p = Parser(
        prog="bitchat",
        description="Chat with a BitNet b1.58 model in the terminal. Type /help inside for commands.",
        epilog="Input history: $BITCHAT_HISTORY or $XDG_STATE_HOME/bitchat/history. "
               "Piped stdin: each line is a turn, answers go to stdout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(p, n_predict_default=Settings().max_tokens)
    add_lm_head_arg(p)   # the model flags are `bitnet run`'s
    add_system_args(p)
    p.add_argument("--recovered", action="store_true",
                   help="list the recovery copies that bitchat sessions which did not end normally left behind "
                        "(path, last written, turns, first question; tab-separated) and exit%(default).0s")
    p.add_argument("--version", action="version", version=f"bitchat {__version__}")
    return p


def settings_from_args(args, error) -> Settings:
    """Settings from the parsed flags (cli/flags.py); `error(message)` reports a bad value (parser.error or a
    raise) in the words every front end uses."""
    problem = check_engine_args(args)
    if problem:
        error(problem)
    from ..engine.errors import BitNetError

    try:   # the flags as `bitnet run` and `bitnet serve` read them: -e escapes, --dry-sequence-breaker none
        params = sampling_params_from_args(args)
    except BitNetError as e:
        error(str(e))
    s = Settings()
    for name, field in FIELD_OF_SETTING.items():
        setattr(s, name, getattr(params, field))
    if args.n_predict == 0:   # as /set max_tokens 0: a chat turn is an answer (bitnet run -n 0 only prefills)
        error("-n/--n-predict 0: a chat answer has at least one token (-1: until the end of text)")
    s.max_tokens = args.n_predict   # -1 (UNTIL_END, -2 too): kept as such, shown and saved as "until the end"
    return s


def main(argv: list[str] | None = None) -> int:
    from . import closed_std_streams, stdout_flushed

    closed_std_streams()   # `bitchat <&-`, `bitchat >&-`: empty input, output nowhere
    replace_unencodable("bitchat")

    def body():
        parser = build_parser()
        maybe_autocomplete(parser)
        args = parse_args_suggesting(parser, argv)
        if args.recovered:
            return _list_recovered()
        try:
            settings = settings_from_args(args, _refuse)
        except ValueError as e:   # a value out of range: one line, as `bitnet run` says it
            print(f"bitchat: error: {e}", file=sys.stderr)
            return 2
        return _guarded(args, settings)
    with lossy_stderr():   # also for a flag's error line (argparse's, settings_from_args')
        return stdout_flushed(body, "bitchat")


def _refuse(message: str):
    raise ValueError(message)


def run_chat(args, first_message: str | None = None) -> int:
    """`bitnet run -cnv`: the chat with `bitnet run`'s parsed flags; `first_message` (its -p) is the first turn."""
    from ..engine.errors import BitNetError

    def error(message):
        raise BitNetError(message)

    return _guarded(args, settings_from_args(args, error), first_message)


def _guarded(args, settings: Settings, first_message: str | None = None) -> int:
    with lossy_stderr():
        return _guarded_body(args, settings, first_message)


def _guarded_body(args, settings: Settings, first_message: str | None = None) -> int:
    import signal

    from ..engine.errors import EXIT_BAD_INPUT, ENDING_SIGNALS, ModelChangedError, Terminated, raise_terminated

    interactive = is_terminal(sys.stdin) and is_terminal(sys.stdout)
    out = Output(interactive=interactive)
    # SIGTERM, and SIGHUP (its terminal closed): unwind as Ctrl-C does, so the terminal's modes are restored and
    # the answer so far is saved, then leave
    for sig in ENDING_SIGNALS:
        signal.signal(sig, raise_terminated)
    live = []   # the session, once made: the recovery copy it wrote is the one to name
    try:
        try:
            return _run(args, settings, out, interactive, first_message, live)
        except OSError as e:
            from ..chat.session import terminal_gone
            if not terminal_gone(e):
                raise
            # the terminal closed at the prompt before its SIGHUP came: leave as on that signal
            raise Terminated(getattr(signal, "SIGHUP", signal.SIGTERM)) from None
    except (KeyboardInterrupt, Terminated) as e:
        # turns so far are kept (user data): say where, never leave a file unannounced; a copy another bitchat
        # wrote over (a shared $BITCHAT_RECOVERY) is written again beside it
        path = live[0].keep_recovery() if live else None
        lost = live[0].recovery_lost() if live and not path else None   # a full disk: never an older copy named
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"terminated ({signal.Signals(e.signum).name})"
        kept = f"bitchat: {why}; the conversation so far is saved in {path} (/load it in bitchat)" if path else \
            f"bitchat: {why}; the conversation so far is not saved: {lost}" if lost else f"bitchat: {why}"
        with contextlib.suppress(OSError):   # the terminal may be gone (SIGHUP)
            print(kept, file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 128 + e.signum
    except ModelChangedError as e:   # the model file was rewritten under the loaded model: no answer can be trusted
        path = live[0].keep_recovery() if live else None
        kept = f"; the conversation so far is saved in {path} (/load it in bitchat)" if path else ""
        with contextlib.suppress(OSError):
            print(f"bitchat: error: {e}{kept}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        from . import quiet_broken_pipe

        path = _written(live)   # never a file left unannounced: it was, one per `bitchat < script | head`
        if path:
            if is_terminal(sys.stdin):   # typed turns: kept, and said where (never an older copy: a write failed)
                if live[0].keep_recovery():
                    with contextlib.suppress(OSError):
                        print(f"bitchat: output closed; the conversation so far is saved in {path}", file=sys.stderr)
            else:                    # a script's turns: the script has them
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return quiet_broken_pipe()   # stdout went away (e.g. `| head`): nothing more to say
    except Exception as e:  # a bug: one line (BITNET_DEBUG=1 shows the traceback), never a raw dump
        from ..engine.errors import BUG_REPORT_HINT, EXIT_BAD_INPUT, EXIT_BUG, write_error_line, write_failed

        if write_failed(e):   # the answers cannot be written (stdout on a full disk): one line, the turns kept
            path = live[0].keep_recovery() if live else None   # (never an older copy, after a failed write)
            kept = f"; the conversation so far is saved in {path}" if path else ""
            with contextlib.suppress(OSError):
                print(write_error_line("bitchat", e) + kept, file=sys.stderr)
            from . import stdout_to_devnull

            stdout_to_devnull()
            return EXIT_BAD_INPUT

        if os.environ.get("BITNET_DEBUG") or os.environ.get("BITCHAT_DEBUG"):   # the latter: older name
            raise
        print(f"bitchat: internal error: {type(e).__name__}: {' '.join(str(e).split())} ({BUG_REPORT_HINT};"
              " set BITNET_DEBUG=1 for details)", file=sys.stderr)
        return EXIT_BUG


def _line_prompt():
    """The prompt of line mode (typed lines, stdout not a terminal): on stderr, where it is seen and never enters
    the answers' pipe; none when stderr is not a terminal either (a log file would fill with prompts)."""
    if not is_terminal(sys.stderr):
        return None

    def prompt(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):   # (stderr closed or gone: the lines still work)
            sys.stderr.write(text)
            sys.stderr.flush()
    return prompt


def recovery_path() -> str | None:
    """$BITCHAT_RECOVERY (empty: no recovery copy), else recovery-PID.json in the XDG state dir."""
    from ..chat.transcript import state_dir

    env = os.environ.get("BITCHAT_RECOVERY")
    if env is not None:   # /dev/null: none too, as BITCHAT_HISTORY=/dev/null (it was refused: not a regular file)
        return os.path.expanduser(env) if env.strip() and os.path.realpath(env) != os.devnull else None
    base = os.path.join(state_dir(), f"recovery-{os.getpid()}")
    path, n = base + ".json", 1
    while os.path.lexists(path):   # the copy of a session that died with this PID before: kept, never written over
        n += 1
        path = f"{base}-{n}.json"
    return path


def _recovery_place() -> tuple[bool, str | None]:
    """(whether recovery copies are kept, $BITCHAT_RECOVERY's path or None for the state dir's recovery-PID.json)."""
    if os.environ.get("BITCHAT_RECOVERY") is None:
        return True, None
    fixed = recovery_path()
    return fixed is not None, fixed


def _list_recovered() -> int:
    """`bitchat --recovered`: the copies left behind, one a line on stdout (none: one line on stderr), exit 0."""
    from ..chat.recovery import left_behind, listing

    on, fixed = _recovery_place()
    if not on:
        print("bitchat: no recovery copies are kept (BITCHAT_RECOVERY is empty or /dev/null)", file=sys.stderr)
        return 0
    lines = listing(left_behind(fixed))
    if not lines:
        from ..chat.transcript import state_dir

        where = fixed if fixed else os.path.join(state_dir(), "recovery-PID.json")
        print(f"bitchat: no recovery copies left behind (looked for {where} and the copies beside it)",
              file=sys.stderr)
    for line in lines:
        print(line)
    return 0


def _beside(path: str) -> str:
    """The first free X-N.json beside X.json ($BITCHAT_RECOVERY holding another session's copy, never written over
    nor removed: it was, and deleted at exit, even after the user /load-ed it as the crash line advised)."""
    base, ext = os.path.splitext(path)
    n = 2
    while os.path.lexists(f"{base}-{n}{ext}"):
        n += 1
    return f"{base}-{n}{ext}"


def _written(live: list) -> str | None:
    """The recovery copy the session wrote, while it is still that copy (never a file it did not write)."""
    return live[0].recovery_copy() if live else None


def _run(args, settings: Settings, out: Output, interactive: bool, first_message: str | None = None,
         live: list | None = None) -> int:
    from ..chat.transcript import recovery_problem
    from ..engine.errors import EXIT_BAD_INPUT, EXIT_BUG, BitNetError

    from ..engine import faults

    if args.model is not None and not args.model.strip():   # it said "loading the bundled default model", then
        print("bitchat: error: -m/--model '': an empty model name (leave -m out for the bundled default model)",
              file=sys.stderr)   # "model '': no such file"
        return EXIT_BAD_INPUT
    from ..chat.recovery import notice, recovery_copies

    path = recovery_path()
    problem = recovery_problem(path) if path else None
    if problem:   # it was removed at exit: a file of the user's, or a conversation /load-ed from there
        print(f"bitchat: error: the recovery copy's path {path} {problem}; set BITCHAT_RECOVERY to another file "
              "(empty: no recovery copy)", file=sys.stderr)
        return EXIT_BAD_INPUT
    # the copies of sessions that did not end normally (killed: they could not say where): named before the first
    # prompt, on stderr (a script's stdout gets answers only); a copy of a bitchat still running never is
    copies = recovery_copies(path if os.environ.get("BITCHAT_RECOVERY") is not None else None) if path else []
    if path and os.path.isfile(path) and os.path.getsize(path):   # another session's copy: the user's turns
        kept, path = path, _beside(path)
        running = any(c.running and c.path == os.path.abspath(kept) for c in copies)
        whose = "a bitchat still running" if running else "an earlier session"
        print(f"bitchat: {kept} holds the recovery copy of {whose} (kept); this session's recovery copy is {path}",
              file=sys.stderr)

    faults.install("bitchat")
    label = args.model or "the bundled default model"
    print(f"bitchat: loading {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        from ..engine.api import load_model

        from ..engine.runtime.speculative import lookup_from_flags

        llm = load_model(args.model, ctx=args.ctx, threads=args.threads, progress=True,   # -cnv: run's --kv/--lm-head
                         kv_dtype=getattr(args, "kv", "f16"), lm_head=getattr(args, "lm_head", None),
                         lookup=lookup_from_flags(args.draft_max, args.lookup_ngram_min),
                         mmap=getattr(args, "mmap", None))
        llm.model.cli_hints = True   # a context hint names -c/--ctx, not load_model(ctx=N)
        apply_chat_template(llm, args)
        llm.chat_text([{"role": "user", "content": "Hello"}])   # a template that cannot render: one line now
    except BitNetError as e:
        if e.exit_code == EXIT_BUG:
            from . import report_bug

            return report_bug("bitchat", e)
        print(f"bitchat: error: {e}", file=sys.stderr)
        return e.exit_code
    except (ImportError, OSError, MemoryError) as e:
        print(f"bitchat: error: cannot load {label}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    for w in [*getattr(llm, "warnings", ()), *thinking_warnings(llm, args)]:
        print(f"bitchat: warning: {w}", file=sys.stderr)
    if settings.max_tokens > llm.n_ctx:   # as /set max_tokens N takes it: the context's size, said
        print(f"bitchat: warning: -n {settings.max_tokens}: {max_tokens_over_context(settings.max_tokens, llm.n_ctx)}",
              file=sys.stderr)
        settings.max_tokens = llm.n_ctx

    from ..chat.repl import handle_line, run_plain, run_repl
    from ..chat.session import ChatSession

    session = ChatSession(llm, settings, out, system=args.system, threads=args.threads, model_label=args.model)
    if live is not None:
        live.append(session)
    session.ctrl_c_ends = not is_terminal(sys.stdin)   # `bitchat < questions.txt`: Ctrl-C ends the run (130)
    session.jump_forward = not getattr(args, "no_jump_forward", False)   # bitnet run -cnv --no-jump-forward
    if getattr(args, "chat_format", None) is not None:   # bitnet run -cnv -j: the starting /set format
        from ..chat.commands import CommandError
        try:
            session.use_format(args.chat_format, args.chat_format_label)
        except CommandError as e:
            print(f"bitchat: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if path:
        session.enable_recovery(path)
    ready = f"bitchat: {llm.name} ready in {load_s:.1f} s ({llm.n_ctx}-token context)."
    left = notice([c for c in copies if not c.running])
    # typed lines, output piped (`bitchat | tee log`): no REPL (its screen would go into the pipe), so say which mode
    # this is, and show a prompt on stderr (it looked like a hang: no prompt, no hint)
    typed = not interactive and is_terminal(sys.stdin)
    hint = " Type /help for commands, /bye or Ctrl-D to exit." if interactive else \
        (" stdout is not a terminal, so this is line mode: no line editing, history or completion; answers go to "
         "stdout, the prompt and notices to stderr. Type /help for commands, /bye or Ctrl-D to exit.") if typed else ""
    print(ready + hint, file=sys.stderr, flush=True)
    if left:
        print(left, file=sys.stderr, flush=True)
    if session.conv.system:   # -sys: a system prompt too long for the context is said now, as /system says it
        session.system_notice()
    if interactive:
        if first_message and not handle_line(session, first_message):
            session.discard_recovery()
            return 0
        rc = run_repl(session)
    else:
        if first_message and not handle_line(session, first_message):
            session.discard_recovery()
            return 1 if session.had_errors and not typed else 0   # (typed: as in the REPL)
        rc = run_plain(session, prompt=_line_prompt() if typed else None)
    session.discard_recovery()   # only on a normal end: after a crash the copy is the user's transcript
    return rc


if __name__ == "__main__":
    sys.exit(main())
