"""Fatal faults on memory-mapped files: a model file truncated while it is mapped (a download still being
written, `cp` of a smaller file over it, a full disk) makes the next load from a page past its new end raise
SIGBUS inside C code, where Python cannot catch anything. simd._faultguard (a C handler) turns that into one line
on stderr and an exit with EXIT_BAD_INPUT, after unlinking the temporary files registered here. A file rewritten in
place at the same size or larger raises no signal (every page is valid again): the store sees that with an fstat
before each request (engine/formats/store.py Store.changed), not here.

    install("bitnet")                  the CLIs call this once; load_model / load_engine do where none is
    watch_mapping(mm, path, kind)      fileio.map_readonly registers every map it makes
    close_map(mm)                      close a map and forget its region
    with removed_on_fault(tmp): ...    a temporary output (the converter's store) unlinked on such a fault
    unlink_on_fault(path)              a file unlinked on such a fault, for the rest of the process
    set_note(text)                     appended to the fatal line (bitchat: where the transcript is saved)
"""
from __future__ import annotations

import importlib
import os
import weakref
from contextlib import contextmanager

from .errors import EXIT_BAD_INPUT

try:  # the submodule itself: `from simd import` would go through simd's lazy error for a bad BITNET_ISA
    _fg = importlib.import_module("..simd._faultguard", __package__)
except ImportError:  # pragma: no cover - an old build without the guard: faults stay plain signals
    _fg = None

_finalizers: dict[int, weakref.finalize] = {}


def install(prog: str) -> bool:
    """Install the SIGBUS handler (idempotent); messages start with "<prog>: error: "."""
    if _fg is None:
        return False
    _fg.install(f"{prog}: error: ", EXIT_BAD_INPUT)
    return True


def installed() -> bool:
    return _fg is not None and _fg.installed()


def watch_mapping(mm, path: str, kind: str) -> None:
    """Register the mapped range of `mm` so a fault in it names `path`. Unregistered when the map is
    closed through close_map() or freed."""
    if _fg is None:
        return
    msg = (f"{path}: the {kind} changed or was truncated while in use (hint: do not overwrite or truncate a"
           " model file while it is loaded; if it is still being downloaded or copied, wait until it is complete)")
    slot = _fg.add_region(mm, msg)
    if slot < 0:
        return
    key = id(mm)

    def forget(slot=slot, key=key):
        _fg.remove_region(slot)
        _finalizers.pop(key, None)

    _finalizers[key] = weakref.finalize(mm, forget)


def close_map(mm) -> None:
    """Close `mm` and forget its region; if numpy views still hold it, it stays mapped (and watched)
    until they are gone."""
    try:
        mm.close()
    except BufferError:
        return
    f = _finalizers.get(id(mm))
    if f is not None:
        f()


@contextmanager
def removed_on_fault(path: str):
    """While the block runs, a fatal fault unlinks `path` (a temporary file) before the process exits."""
    slot = _fg.add_cleanup(os.path.abspath(path)) if _fg is not None else -1
    try:
        yield
    finally:
        if slot >= 0:
            _fg.remove_cleanup(slot)


def unlink_on_fault(path: str) -> int:
    """`path` is unlinked if a fatal fault ends the process (for as long as it runs: the router's key file);
    -1 where it cannot be registered."""
    return _fg.add_cleanup(os.path.abspath(path)) if _fg is not None else -1


def forget_cleanup(slot: int) -> None:
    """Give back a slot unlink_on_fault returned (the file is gone or kept now: a fault leaves it be)."""
    if slot >= 0 and _fg is not None:
        _fg.remove_cleanup(slot)


def set_note(text: str) -> None:
    """Text appended to the fatal line, e.g. "; the conversation is saved in X"."""
    if _fg is not None:
        _fg.set_note(text)
