"""`bitchat`'s console entry point: cli/chat.py's main, imported under a Ctrl-C guard, so a Ctrl-C while it loads
(numpy, the engine: ~0.1 s) ends as one does later: exit 130, one line, no traceback. Python turns a Ctrl-C
inside a C extension's import into another error (numpy's "PyCapsule_Import could not import module
"datetime"", exit 1): the guard hears the signal itself, so such an error is known for the Ctrl-C it is.
Everything before the guard is this module and its package's (cli/__init__.py imports little beyond what Python
has loaded already, signal; argparse and typing wait), so the moment a Ctrl-C could still give a traceback is short."""
from __future__ import annotations

import sys

from . import interruptible, signals_restored


def main(argv: list[str] | None = None) -> int:
    with signals_restored():
        chat = _import_chat()
        if chat is None:
            return 130
        return interruptible(lambda: chat(argv))


def _import_chat():
    """cli/chat.py's main, or None after one line when a Ctrl-C came while it was imported."""
    import signal
    import threading

    heard = []

    def interrupt(signum, frame):
        heard.append(signum)
        raise KeyboardInterrupt

    guard = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler   # (SIG_IGN, nohup's: stays ignored)
    previous = signal.signal(signal.SIGINT, interrupt) if guard else None
    try:
        from .chat import main as chat
    except BaseException:   # noqa: BLE001  (what a Ctrl-C became inside an extension's import: ImportError, ...)
        if not heard:
            raise
        chat = None
    finally:
        if guard:
            signal.signal(signal.SIGINT, previous)
    if heard:
        print("bitchat: interrupted", file=sys.stderr)
        return None
    return chat
