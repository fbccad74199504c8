"""Read-only file mapping shared by every reader (GGUF, safetensors, the weight store): one place that
turns open/map failures and too-short or empty files into a FormatError naming the file, and registers the
map with the SIGBUS guard (engine/faults.py) so a file truncated while in use is one line, not a crash.
Also the one decoder of the text files the user names (decode_text: UTF-8, a leading BOM dropped)."""
from __future__ import annotations

import mmap
import os
import stat

from . import faults
from .errors import BitNetError, FormatError


def starts_with(path: str | os.PathLike, magic: bytes) -> bool:
    """Whether the file begins with `magic` (False when it cannot be read, or is no regular file: opening a FIFO
    would wait for a writer): how each reader recognizes its files."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def is_terminal(f) -> bool:
    """Whether stream f is a terminal: False also for None (pythonw, a frozen app) or a stand-in without isatty (a
    notebook's stream, contextlib.redirect_stderr to a logger, where a host program calls us), as tqdm judges it;
    ValueError: a closed file."""
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def why_missing(path: str | os.PathLike) -> str:
    """Why a path os.path.exists() said False for is not there, in the OS's words ("not a directory" for a file
    given with a trailing /, "file name too long", "permission denied"): "no such file or directory" was said
    for each of them."""
    try:
        os.stat(path)
    except OSError as e:
        if e.strerror:
            return e.strerror[:1].lower() + e.strerror[1:]
    except ValueError:   # an embedded NUL byte
        return "not a valid path"
    return "no such file or directory"


def not_a_file(path: str) -> bool:
    """Whether path is there but neither a regular file nor a directory (a FIFO, a socket, a device: opening a FIFO
    waits for a writer); a missing path or a dangling link is not."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


UTF8_BOM = b"\xef\xbb\xbf"
NOT_UTF8_HINT = "convert it to UTF-8 first, e.g. `iconv -f latin1 -t utf-8`"
# byte-order marks of the encodings a UTF-8 reader must not take for Latin-1 (UTF-32's first: FF FE 00 00 is also
# UTF-16's FF FE); none of them can start UTF-8 text
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))


def decode_text(data: bytes, start: bool = True) -> str:
    """`data` (a text file's bytes, piped stdin's, or one line of it) as UTF-8 text, or ValueError with the reason
    and what to do, in words, for the caller's one line. One reader for every text file the user names (prompts,
    templates, schemas, grammars, key files, conversations). start: `data` begins a file or a stream, where a UTF-8
    byte-order mark (EF BB BF: Windows editors' "UTF-8 with BOM") is dropped, as Python's json tools, jq and editors
    drop it: it marks the encoding and is never text (it went into every prompt, made a key file's first key one no
    client sends, and a script's first command a chat message); and where a UTF-16 or UTF-32 mark is named with
    its `iconv` (the Latin-1 advice turned such a file into text full of NULs)."""
    skip = 0
    if start:
        for bom, name in _WIDE_BOMS:
            if data.startswith(bom):
                raise ValueError(f"{name} text, not UTF-8 (it starts with the byte-order mark {bom.hex(' ').upper()}):"
                                 f" convert it to UTF-8 first, e.g. `iconv -f {name} -t UTF-8`")
        if data.startswith(UTF8_BOM):
            skip = len(UTF8_BOM)
    try:
        return str(memoryview(data)[skip:], "utf-8")
    except UnicodeDecodeError as e:
        at = skip + e.start
        raise ValueError(f"not UTF-8 text: byte 0x{data[at]:02x} at position {at + 1} ({NOT_UTF8_HINT})") from None


SETTINGS_FILE_MAX = 4 << 20   # a JSON Schema or grammar file (the server takes a request of 4 MiB in all)


def read_settings_file(path: str, what: str, limit: int = SETTINGS_FILE_MAX) -> str:
    """The UTF-8 text of a small file the user names (`what`: "a JSON Schema", ...), `~` expanded, a leading BOM
    dropped (decode_text); ValueError with the reason in words for the caller's one line. Only a regular file is
    read (a FIFO is opened without waiting, then refused), never more than `limit` bytes whatever its size said
    (/dev/zero was read until memory ran out, deaf to Ctrl-C)."""
    try:
        fd = os.open(os.path.expanduser(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ValueError("is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        size = max(st.st_size, len(data))
        raise ValueError(f"{size / (1 << 20):.1f} MiB, over {limit >> 20} MiB: too large for {what}")
    return decode_text(data)


def open_regular(path: str, min_size: int, kind: str):
    """(open binary file object, its os.stat_result) of `path`; FormatError if it cannot be opened, is no regular
    file, is empty or is under `min_size` bytes. The caller closes it."""
    try:   # looked at before the open: opening a FIFO waits for a writer (for ever)
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise FormatError(f"{path}: not a regular file (a {kind} is read from a file)")
        fh = open(path, "rb")
    except OSError as e:
        raise FormatError(f"{path}: cannot open {kind}: {e.strerror}") from None
    try:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file (a {kind} is read from a file)")
        if st.st_size == 0:
            raise FormatError(f"{path}: the file is empty (0 bytes), not a {kind}",
                              hint="an interrupted download or copy? fetch the file again")
        if st.st_size < min_size:
            raise FormatError(f"{path}: not a {kind} (only {st.st_size} bytes, too short for a header)")
    except BaseException:
        fh.close()
        raise
    return fh, st


def map_fd(fh, path: str, kind: str) -> mmap.mmap:
    """Map the whole open file `fh` read-only, registered with the SIGBUS guard; FormatError if it cannot be."""
    try:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: cannot map {kind}: {e}") from None
    faults.watch_mapping(mm, path, kind)
    return mm


def read_at(fh, offset: int, n: int) -> bytes:
    """Up to n bytes of the open file `fh` at `offset`, with plain reads (no mapping: a file cut short meanwhile
    gives fewer bytes, never a SIGBUS)."""
    out = []
    while n > 0:
        b = os.pread(fh.fileno(), min(n, 1 << 26), offset)
        if not b:
            break
        out.append(b)
        offset += len(b)
        n -= len(b)
    return b"".join(out)


def map_readonly(path: str, min_size: int, kind: str) -> tuple[mmap.mmap, int]:
    """Map `path` read-only; raise FormatError if it cannot be opened or mapped, or is under `min_size` bytes."""
    fh, st = open_regular(path, min_size, kind)
    with fh:
        return map_fd(fh, path, kind), st.st_size


def check_output(path: str, flag: str, *, keep=None) -> None:
    """Refuse, before any work, an output path the final rename would misuse: a directory, a symbolic link (the
    link would be replaced, not its target), a device or FIFO, a missing directory, or an existing file that
    keep(path) says is no output of this kind (a model's own file, a text: never overwritten silently)."""
    if os.path.islink(path):
        raise BitNetError(f"{flag} {path}: a symbolic link (give the path of the file itself)")
    if os.path.isdir(path):
        raise BitNetError(f"{flag} {path}: a directory (give a file's path)")
    if os.path.exists(path) and not os.path.isfile(path):
        raise BitNetError(f"{flag} {path}: not a regular file")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        up = d   # the nearest part of it that exists: a file there is why (ENOTDIR), not a missing directory
        while not os.path.exists(up) and os.path.dirname(up) != up:
            up = os.path.dirname(up)
        if os.path.exists(up) and not os.path.isdir(up):
            raise BitNetError(f"{flag} {path}: {up} is not a directory")
        raise BitNetError(f"{flag} {path}: the directory {d} does not exist")
    if keep is not None and os.path.isfile(path) and keep(path):
        raise BitNetError(f"{flag} {path}: the file exists and is not one this command writes; refusing to "
                          "overwrite it", hint="remove it first, or pick another path")


def no_overlap(path: str, spans) -> None:
    """(start, end, name) byte ranges of tensors: two that share bytes are a corrupt (or hostile) file, as the
    safetensors format and llama.cpp's GGUF reader hold (2,000 layers pointing at one layer's bytes made a 1.6 MB
    file a 326 MB store)."""
    last_end, last = -1, None
    for b, end, name in sorted(spans):
        if b < last_end and end > b:
            raise FormatError(f"{path}: tensors {last!r} and {name!r} share bytes (overlapping offsets): a corrupt file")
        if end > last_end:
            last_end, last = end, name


def close_map(mm) -> None:
    """Close a map made by map_readonly (kept open while numpy views of it are alive)."""
    faults.close_map(mm)


def current_umask() -> int:
    """The process's umask, read without setting it (os.umask would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
