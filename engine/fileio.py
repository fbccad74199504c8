"""Read-only file mapping shared by every reader (GGUF, safetensors, the weight store): one place that
turns open/map failures and too-short files into a FormatError naming the file."""
from __future__ import annotations

import mmap
import os

from .errors import FormatError


def map_readonly(path: str, min_size: int, kind: str) -> tuple[mmap.mmap, int]:
    """Map `path` read-only; raise FormatError if it cannot be opened or mapped, or is under `min_size` bytes."""
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise FormatError(f"{path}: cannot open {kind}: {e.strerror}") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size < min_size:
            raise FormatError(f"{path}: not a {kind} (only {size} bytes, too short for a header)")
        try:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), size
        except (OSError, ValueError) as e:
            raise FormatError(f"{path}: cannot map {kind}: {e}") from None
