"""`bitchat`: the interactive terminal chat (console script entry point `main`).

    bitchat [-m MODEL] [--system TEXT] [--temp T] [--top-k K] [--top-p P] [--min-p P]
            [--repeat-penalty R] [--seed S] [-n N] [-c CTX] [-t THREADS]

No -m opens the bundled default model. On a terminal it is a prompt_toolkit REPL; when stdin or
stdout is not a terminal, input lines become turns and the output is plain text.
Exit codes: 0 normal end, 1 a piped command/turn failed, 2 bad flag or model (also: the model file was
truncated or rewritten while in use), 70 an internal error (a bug: please report it), 130 Ctrl-C while loading.

The conversation is kept in a recovery file while the session runs ($BITCHAT_RECOVERY, empty: none; else
$XDG_STATE_HOME/bitchat/recovery-PID.json), removed on a normal exit: when the process is ended by a fatal
fault, the one-line message says where it is (/load it).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from chat.commands import CommandError, Settings, parse_setting
from chat.render import Output


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(
        prog="bitchat",
        description="Chat with a BitNet b1.58 model in the terminal. Type /help inside for commands.",
        epilog="Input history: $BITCHAT_HISTORY or $XDG_STATE_HOME/bitchat/history. "
               "Piped stdin: each line is a turn, answers go to stdout.",
    )
    p.add_argument("-m", "--model", metavar="MODEL", default=None,
                   help="a converted store, a GGUF file or an HF directory (default: the bundled model)")
    p.add_argument("--system", metavar="TEXT", default=None, help="system prompt (default: none)")
    p.add_argument("--temp", metavar="T", default=None, help=f"sampling temperature, 0 = greedy (default: {d.temp})")
    p.add_argument("--top-k", metavar="K", default=None, help=f"top-k sampling, 0 = off (default: {d.top_k})")
    p.add_argument("--top-p", metavar="P", default=None, help=f"nucleus sampling, 1 = off (default: {d.top_p})")
    p.add_argument("--min-p", metavar="P", default=None, help=f"min-p sampling, 0 = off (default: {d.min_p})")
    p.add_argument("--repeat-penalty", metavar="R", default=None,
                   help=f"repetition penalty, 1 = off (default: {d.repeat_penalty})")
    p.add_argument("--seed", metavar="S", default=None, help="random seed; -1: random (default: random)")
    p.add_argument("-n", "--max-tokens", metavar="N", default=None,
                   help=f"max tokens per answer (default: {d.max_tokens})")
    p.add_argument("-c", "--ctx-size", metavar="CTX", type=int, default=None,
                   help="context window in tokens (default: the model's)")
    p.add_argument("-t", "--threads", metavar="N", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--version", action="version", version="bitchat (bitnet-cpu)")
    return p


def settings_from_args(args, parser) -> Settings:
    s = Settings()
    for flag, key in (("temp", "temp"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                      ("repeat_penalty", "repeat_penalty"), ("seed", "seed"), ("max_tokens", "max_tokens")):
        value = getattr(args, flag)
        if value is None:
            continue
        try:
            name, typed = parse_setting(key, str(value))
        except CommandError as e:
            # say it with the flag's own name, not the /set name
            parser.error(f"--{flag.replace('_', '-')}: " + str(e).split(": ", 1)[-1])
        setattr(s, name, typed)
    if args.ctx_size is not None and args.ctx_size < 16:
        parser.error(f"-c/--ctx-size: {args.ctx_size} is too small (at least 16)")
    if args.threads is not None and args.threads < 1:
        parser.error(f"-t/--threads: {args.threads} must be >= 1")
    return s


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = settings_from_args(args, parser)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    out = Output(interactive=interactive)
    try:
        return _run(args, settings, out, interactive)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:  # stdout went away (e.g. `| head`): nothing more to say
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except Exception as e:  # a bug: one line (BITCHAT_DEBUG=1 shows the traceback), never a raw dump
        from engine.errors import BUG_REPORT_HINT, EXIT_BUG

        if os.environ.get("BITCHAT_DEBUG"):
            raise
        print(f"bitchat: internal error: {type(e).__name__}: {' '.join(str(e).split())} ({BUG_REPORT_HINT};"
              " set BITCHAT_DEBUG=1 for details)", file=sys.stderr)
        return EXIT_BUG


def recovery_path() -> str | None:
    """$BITCHAT_RECOVERY (empty: no recovery copy), else recovery-PID.json in the XDG state dir."""
    env = os.environ.get("BITCHAT_RECOVERY")
    if env is not None:
        return os.path.expanduser(env) if env.strip() else None
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "bitchat", f"recovery-{os.getpid()}.json")


def _run(args, settings: Settings, out: Output, interactive: bool) -> int:
    from engine.errors import EXIT_BUG, BitNetError

    from engine import faults

    faults.install("bitchat")
    label = args.model or "the bundled default model"
    print(f"bitchat: loading {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        from engine.api import load_model

        llm = load_model(args.model, ctx=args.ctx_size, threads=args.threads, progress=True)
    except BitNetError as e:
        if e.exit_code == EXIT_BUG:
            from engine.cli import report_bug

            return report_bug("bitchat", e)
        print(f"bitchat: error: {e}", file=sys.stderr)
        return e.exit_code
    except (ImportError, OSError, MemoryError) as e:
        print(f"bitchat: error: cannot load {label}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    for w in getattr(llm, "warnings", ()):
        print(f"bitchat: warning: {w}", file=sys.stderr)
    if settings.max_tokens > llm.n_ctx:
        settings.max_tokens = llm.n_ctx

    from chat.repl import run_plain, run_repl
    from chat.session import ChatSession

    session = ChatSession(llm, settings, out, system=args.system, threads=args.threads, model_label=args.model)
    path = recovery_path()
    if path:
        session.enable_recovery(path)
    ready = f"bitchat: {llm.name} ready in {load_s:.1f} s ({llm.n_ctx}-token context)."
    if interactive:
        print(ready + " Type /help for commands, /bye or Ctrl-D to exit.", file=sys.stderr, flush=True)
        rc = run_repl(session)
    else:
        print(ready, file=sys.stderr, flush=True)
        rc = run_plain(session)
    session.discard_recovery()   # only on a normal end: after a crash the copy is the user's transcript
    return rc


if __name__ == "__main__":
    sys.exit(main())
