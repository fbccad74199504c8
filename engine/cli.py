"""`bitnet`: the command line. Subcommands live in engine/commands/<name>.py.

Errors the user can act on (engine.errors.BitNetError) print one line to stderr and exit 2;
Ctrl-C exits 130 with whatever was already printed kept.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ["run", "convert", "inspect", "info", "serve"]


def build_parser() -> argparse.ArgumentParser:
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
    return p


def main(argv: list[str] | None = None) -> int:
    from .errors import BitNetError

    parser = build_parser()
    args = parser.parse_args(argv)
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
        return 0


if __name__ == "__main__":
    sys.exit(main())
