"""Read-only file mapping shared by every reader (GGUF, safetensors, the weight store): one place that
turns open/map failures and too-short or empty files into a FormatError naming the file, and registers the
map with the SIGBUS guard (engine/faults.py) so a file truncated while in use is one line, not a crash."""
from __future__ import annotations

import mmap
import os

from . import faults
from .errors import FormatError


def starts_with(path: str | os.PathLike, magic: bytes) -> bool:
    """Whether the file begins with `magic` (False when it cannot be read): how each reader recognizes its files."""
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def map_readonly(path: str, min_size: int, kind: str) -> tuple[mmap.mmap, int]:
    """Map `path` read-only; raise FormatError if it cannot be opened or mapped, or is under `min_size` bytes."""
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise FormatError(f"{path}: cannot open {kind}: {e.strerror}") from None
    with fh:
        st = os.fstat(fh.fileno())
        size = st.st_size
        if size == 0:
            raise FormatError(f"{path}: the file is empty (0 bytes), not a {kind}",
                              hint="an interrupted download or copy? fetch the file again")
        if size < min_size:
            raise FormatError(f"{path}: not a {kind} (only {size} bytes, too short for a header)")
        try:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise FormatError(f"{path}: cannot map {kind}: {e}") from None
    faults.watch_mapping(mm, path, kind)
    return mm, size


def close_map(mm) -> None:
    """Close a map made by map_readonly (kept open while numpy views of it are alive)."""
    faults.close_map(mm)
