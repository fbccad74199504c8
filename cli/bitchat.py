"""`bitchat`'s console entry point: cli/chat.py's main, imported inside the Ctrl-C handler (cli.interruptible), so
a Ctrl-C while it loads (numpy, the engine: ~0.1 s) ends as one does later: exit 130, no traceback."""
from __future__ import annotations

from . import interruptible, signals_restored


def main(argv: list[str] | None = None) -> int:
    def run():
        from .chat import main as chat
        return chat(argv)
    with signals_restored():
        return interruptible(run)
