# PYTHON_ARGCOMPLETE_OK
"""`bitnet`: the command line. Subcommands live in engine/commands/<name>.py.

Errors the user can act on (engine.errors.BitNetError) print one line to stderr and exit 2;
Ctrl-C exits 130 with whatever was already printed kept; a closed stdout (`| head`) ends quietly (exit 0).
An unknown flag gets that subcommand's usage and a "did you mean" suggestion.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ["run", "convert", "inspect", "info", "pull", "list", "rm"]


def build_parser(subparsers: dict | None = None) -> argparse.ArgumentParser:
    """The `bitnet` parser; `subparsers` (if given) is filled with name -> subcommand parser."""
    p = argparse.ArgumentParser(
        prog="bitnet",
        description="Run BitNet b1.58 ternary language models on the CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"bitnet {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"engine.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"engine.commands.{name}":
                raise
            continue
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_main=mod.main)
        if subparsers is not None:
            subparsers[name] = sp
    return p


def main(argv: list[str] | None = None) -> int:
    from .errors import BitNetError

    from .commands.common_args import maybe_autocomplete, parse_args_suggesting

    subparsers: dict = {}
    parser = build_parser(subparsers)
    maybe_autocomplete(parser)
    args = parse_args_suggesting(parser, argv, subparsers)
    if not getattr(args, "_main", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args._main(args) or 0)
    except BitNetError as e:
        print(f"bitnet: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return quiet_broken_pipe()


def quiet_broken_pipe() -> int:
    """stdout was closed by its reader (`bitnet run ... | head -c 10`): point fd 1 at /dev/null so the
    interpreter's final flush cannot print "Exception ignored ... BrokenPipeError", and exit 0."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
