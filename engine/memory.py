"""Memory the engine allocates itself: how much is available, and weights read into anonymous memory backed
by transparent huge pages.

Why read the weights instead of mapping the file: decode streams every weight once per token, and with the
file's 4 KB pages the streaming GEMV read 18.1 GB/s on one Zen 3 core and 25.0 GB/s on two; the same matrices
copied into 2 MB pages read 21.1 and 28.7 GB/s (+15%; one process, calls alternating between the copies;
anonymous 4 KB pages: 19.2 / 26.7). Fewer TLB misses and page walks on the stream, and the hardware prefetchers
are not stopped at a 4 KB boundary every 64 lines. Linux has no huge pages for an ext4 file mapping
(MADV_COLLAPSE on it: EINVAL here), so the data is read into an anonymous mapping advised MADV_HUGEPAGE.

    available_memory()                         MemAvailable + free swap (or less under ulimit -v)
    thp_mode()                                 "always" | "madvise" | "never" | None (no THP)
    read_into_memory(path, offset, length)     the file's bytes in an anonymous (huge-page) mapping
    huge_page_bytes(addr, length)              how much of a mapping the kernel backs with huge pages
"""
from __future__ import annotations

import mmap
from typing import Callable

from .errors import BitNetError, FormatError

HUGE = 2 << 20                       # x86-64 / arm64 (4 KB granule) PMD size
CHUNK = 64 << 20                     # read granularity: progress and Ctrl-C between chunks
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def available_memory() -> int | None:
    """Bytes that can still be allocated: MemAvailable + free swap on Linux, or less under an address-space
    limit (ulimit -v); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        avail = info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        return None
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            avail = min(avail, max(0, soft - vm))
    except (ImportError, OSError, StopIteration, ValueError):
        pass
    return avail


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page setting ("always", "madvise" or "never"); None where there is none."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def read_into_memory(path: str, offset: int, length: int, *, huge: bool = True,
                     progress: Callable[[int, int], None] | None = None, fh=None) -> tuple[mmap.mmap, int]:
    """Read `length` bytes of `path` from `offset` into a new private anonymous mapping, advised MADV_HUGEPAGE
    when `huge` (and the platform has it). Returns (mapping, start): the bytes are mapping[start:start+length],
    start chosen so they begin on a 2 MB boundary. progress(done, total) is called after every 64 MB chunk.
    fh: the file already open (read from it, not from `path` opened again: a file renamed over the path meanwhile
    is another file; `path` then only names it in messages).
    Raises FormatError when the file is shorter than offset + length, BitNetError when memory runs out;
    KeyboardInterrupt between chunks leaves nothing behind (the mapping is released)."""
    try:
        mm = mmap.mmap(-1, length + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, OverflowError) as e:
        raise BitNetError(f"{path}: cannot allocate {length / (1 << 30):.1f} GiB for the weights: {e}",
                          hint="use --mmap to map the file instead of reading it into memory") from None
    try:
        base = _address(mm)
        start = (-base) % HUGE
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE, start, length // HUGE * HUGE or HUGE)
            except (OSError, ValueError):
                pass  # a kernel without THP: plain pages, still correct
        view = memoryview(mm)[start:start + length]
        try:
            with open(path if fh is None else fh.fileno(), "rb", buffering=0, closefd=fh is None) as f:
                f.seek(offset)
                done = 0
                while done < length:
                    n = f.readinto(view[done:done + min(CHUNK, length - done)])
                    if not n:
                        raise FormatError(f"{path}: truncated (the file ends {length - done} bytes before the end "
                                          "of its weights)", hint="an interrupted download or copy? fetch it again")
                    done += n
                    if progress is not None:
                        progress(done, length)
        finally:
            view.release()
    except OSError as e:
        mm.close()
        raise FormatError(f"{path}: cannot read the weights: {e.strerror or e}") from None
    except BaseException:
        mm.close()
        raise
    return mm, start


def _address(mm: mmap.mmap) -> int:
    """Virtual address of a mapping's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def huge_page_bytes(addr: int, length: int) -> int | None:
    """Bytes of [addr, addr + length) that the kernel backs with huge pages (AnonHugePages of the mapping
    holding addr, from /proc/self/smaps); None where unknown."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "AnonHugePages:":
                    return min(length, int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        return None
    return None
