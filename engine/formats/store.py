"""The weight store: the engine's own self-contained model file, mapped read-only and viewed zero-copy, or
(load="memory", and "auto" for large stores where the kernel has transparent huge pages) its tensor data read
into anonymous memory backed by 2 MB pages, which decode streams ~15% faster (engine/memory.py).

File layout (little-endian):
    0   8s   magic b"BNSTORE\\0"
    8   u32  format version (STORE_VERSION)
    12  u32  reserved (0)
    16  u64  index offset      24  u64  index size (bytes of UTF-8 JSON)
    32  u64  data offset (64-aligned; tensor offsets are relative to it)
    40  32s  sha256 of the index bytes
    72  ...  tensors, each 64-byte aligned, then the JSON index at the end

Index JSON: {"config": ModelConfig dict, "meta": {...}, "chat_template": str | null,
             "tokenizer": {"kind": "hf_json" | "sentencepiece", "tensor": name-of-uint8-blob} | null,
             "tensors": {name: {"dtype", "shape", "offset", "nbytes", ...extra layout keys}},
             "requires": [what a reader must know] (optional; a reader refuses any it does not know)}

Tensor names and layouts are listed in engine/INTERFACES.md. Writing goes to a temporary file that is
renamed into place, so a crash never leaves a half-written store under the final name.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .. import faults
from ..config import ModelConfig
from ..fileio import close_map, current_umask, map_fd, no_overlap, open_regular, read_at, starts_with
from ..errors import BitNetError, FormatError, ModelChangedError, json_why
from ..memory import available_memory, huge_page_bytes, read_into_memory, thp_mode

MAGIC = b"BNSTORE\0"
STORE_VERSION = 1
# recorded in every store (engine/formats/compat.py reads it) and part of the cache's source_stamp
# (engine/formats/convert.py: a cached conversion of another version is converted again): bump it with every change
# of what a conversion writes. 2 records tokenizer_config's bos_token / eos_token, 3 add_bos, 4 the tokenizer rules
# of more GGUF pre-tokenizers, the tool-use chat template, bos_note, tie_word_embeddings deciding the head
CONVERTER_VERSION = "4"
# index "requires": what a reader must know to read the store right (a later writer lists what it adds that an
# older reader would silently ignore); this engine knows none yet, and refuses a store that names any
REQUIRES_KNOWN: frozenset[str] = frozenset()
ALIGN = 64
_HEADER = struct.Struct("<8sIIQQQ32s")  # 72 bytes
_DTYPES = {"uint8", "int8", "uint16", "int16", "int32", "uint32", "float16", "float32", "int64"}
_MAX_INDEX = 1 << 30
LOADS = ("auto", "memory", "mmap")
AUTO_MIN_BYTES = 64 << 20      # "auto" reads stores with more tensor data than this into huge pages
MEMORY_HEADROOM = 512 << 20    # ... when this much memory would still be left
STALE_TMP_S = 3600             # a .bnstore-* temporary untouched this long was left by a killed writer

_writing: set[str] = set()     # this process's stores being written (their temporary files)
_writing_dirs: set[str] = set()   # where this process made them (named .bnstore-PID-*), recorded before each is made
_writing_lock = threading.Lock()


@atexit.register
def _remove_unfinished():
    """At exit, the temporary files of stores still being written: a conversion in a thread the interpreter does
    not wait for (`bitnet serve` loads its model in one; a SIGTERM drains the server and exits) was left as a
    hidden partial store of hundreds of MB."""
    with _writing_lock:
        mine = [os.path.join(d, n) for d in _writing_dirs for n in _listing(d) if n.startswith(_tmp_prefix())]
        for tmp in {*_writing, *mine}:   # also one made just before a signal, not yet in _writing
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _tmp_prefix() -> str:
    return f".bnstore-{os.getpid()}-"


def _listing(d: str) -> list:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _remove_stale(d: str):
    """Temporary stores in `d` that nobody has written for STALE_TMP_S (a writer killed by SIGKILL, the OOM
    killer, a power cut): removed before a new one is written there, so they do not pile up unseen."""
    now = time.time()
    try:
        names = [n for n in os.listdir(d) if n.startswith(".bnstore-")]
    except OSError:
        return
    for n in names:
        p = os.path.join(d, n)
        try:
            if now - os.stat(p).st_mtime > STALE_TMP_S:
                os.unlink(p)
        except OSError:
            pass


@dataclass
class TensorSpec:
    """One tensor to write: the array plus extra index keys (layout, rows, cols, ...)."""

    name: str
    array: np.ndarray
    extra: dict[str, Any] | None = None


def write_store(
    path: str | os.PathLike,
    config: ModelConfig,
    tensors: Iterable[TensorSpec],
    *,
    meta: dict | None = None,
    chat_template: str | None = None,
    tokenizer_kind: str | None = None,
    tokenizer_blob: bytes | None = None,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Write a store atomically. `tensors` may be a generator (converted one at a time, low memory).
    `progress(nbytes)` is called after each tensor with the bytes just written."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    _remove_stale(d)
    with _writing_lock:   # the directory first: a signal right after mkstemp still finds the file at exit
        _writing_dirs.add(d)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), dir=d)
    with _writing_lock:
        _writing.add(tmp)
    index: dict[str, Any] = {
        "config": config.to_dict(),
        "meta": meta or {},
        "chat_template": chat_template,
        "tokenizer": None,
        "tensors": {},
    }
    try:
        with faults.removed_on_fault(tmp), os.fdopen(fd, "wb") as f:  # a SIGBUS reading the source unlinks tmp
            f.write(b"\0" * _HEADER.size)
            data_offset = _align(_HEADER.size)
            f.write(b"\0" * (data_offset - _HEADER.size))

            def put(name: str, arr: np.ndarray, extra: dict | None):
                if name in index["tensors"]:
                    raise ValueError(f"write_store: duplicate tensor {name!r}")
                arr = np.ascontiguousarray(arr)
                if arr.dtype.name not in _DTYPES:
                    raise ValueError(f"write_store: tensor {name!r} has unsupported dtype {arr.dtype}")
                pos = f.tell()
                pad = _align(pos) - pos
                f.write(b"\0" * pad)
                off = f.tell() - data_offset
                f.write(arr.view(np.uint8).reshape(-1).data if arr.size else b"")
                entry = {"dtype": arr.dtype.name, "shape": list(arr.shape), "offset": off, "nbytes": int(arr.nbytes)}
                if extra:
                    entry.update(extra)
                index["tensors"][name] = entry
                if progress:
                    progress(int(arr.nbytes))

            for spec in tensors:
                put(spec.name, spec.array, spec.extra)
            if tokenizer_blob is not None:
                put("tokenizer.blob", np.frombuffer(tokenizer_blob, dtype=np.uint8), None)
                index["tokenizer"] = {"kind": tokenizer_kind, "tensor": "tokenizer.blob"}
            raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode("utf-8")
            index_offset = f.tell()
            f.write(raw)
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, STORE_VERSION, 0, index_offset, len(raw), data_offset, hashlib.sha256(raw).digest()))
        os.chmod(tmp, 0o666 & ~current_umask())   # as open() would make it (mkstemp's 0600: only its owner reads)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        with _writing_lock:
            _writing.discard(tmp)
    return path


def converter_of(meta: dict) -> int | None:
    """The converter version a store records, as a number (None: not recorded, or not a number)."""
    v = meta.get("converter_version")
    return int(v) if _is_version(v) else None


def _is_version(v) -> bool:
    """ASCII digits, a few of them: str.isdigit() also takes a superscript 2 or digits past int()'s limit."""
    return isinstance(v, str) and re.fullmatch(r"[0-9]{1,9}", v) is not None


def newer_converter(meta: dict) -> int | None:
    """The store's converter version where it is above this bitnet-cpu's, else None."""
    n = converter_of(meta)
    return n if n is not None and n > int(CONVERTER_VERSION) else None


def made_by(meta: dict) -> str:
    """"made by a newer bitnet-cpu (converter N; this one writes M)" where the store says so, else what may be."""
    n = newer_converter(meta)
    if n is not None:
        return f"made by a newer bitnet-cpu (converter {n}; this one writes {CONVERTER_VERSION})"
    return "a newer bitnet-cpu may have written it"


def _converter_in(fh, ioff: int, isize: int, size: int) -> str | None:
    """The converter version a store of another format records, where its index is JSON we can find."""
    if isize > _MAX_INDEX or ioff + isize > size:
        return None
    try:
        v = json.loads(read_at(fh, ioff, isize))["meta"]["converter_version"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return v if _is_version(v) else None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry_ok(e, doff: int, ioff: int) -> bool:
    """An index entry whose dtype, shape, offset and size agree and lie inside the data area."""
    if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in _DTYPES \
            or not isinstance(e.get("shape"), list):
        return False
    shape, off, nbytes = e["shape"], e.get("offset"), e.get("nbytes")
    if not (all(_is_int(d) and 0 <= d <= 1 << 40 for d in shape) and _is_int(off) and _is_int(nbytes)):
        return False
    n = np.dtype(e["dtype"]).itemsize
    for d in shape:
        n *= d
    return n == nbytes and off >= 0 and off % ALIGN == 0 and doff + off + n <= ioff   # write_store aligns each


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Store:
    """An open store: `config`, `meta`, `chat_template`, `tensor(name)` (read-only views).

    load: "mmap" views the mapped file (no copy; pages shared with other processes and the page cache);
    "memory" reads the tensor data into anonymous memory advised to use huge pages (faster decode, a copy);
    "auto" is "memory" for stores with over AUTO_MIN_BYTES of tensors when the kernel has transparent huge
    pages and enough memory is available, else "mmap". `load_mode` says which one happened.
    "index" reads the header and the index only (config, meta, chat template: a listing's; no tensor is readable).
    progress(done, total) reports the read (memory only). check(store), where given, runs on the index before the
    weights are read (a refusal then costs no read; the store is closed when it raises).
    The file stays open while its weights are mapped: changed() / check_unchanged() tell whether it was rewritten in
    place since (one fstat; the engine asks before each request)."""

    def __init__(self, path: str | os.PathLike, load: str = "auto",
                 progress: Callable[[int, int], None] | None = None,
                 check: Callable[["Store"], None] | None = None):
        if load not in LOADS + ("index",):
            raise BitNetError(f"load {load!r}: expected one of {', '.join(LOADS)}")
        self.path = os.fspath(path)
        self._mm = self._mem = self._data = None
        self._views: dict[str, np.ndarray] = {}
        # the header and the index are read with plain reads from the file held open: a file cut short meanwhile is
        # a FormatError here, never a SIGBUS; the weights come from the same open file (mapped, or read), never from
        # the path opened again (a store renamed over it in between mixed two files)
        self._fh, st = open_regular(self.path, _HEADER.size, "BitNet store")
        # the identity of the file opened: a file rewritten in place under a mapping is seen (changed())
        self._ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        self.opened = (st.st_size, st.st_mtime)   # (bytes, mtime) of the file loaded, whatever the path holds later
        try:
            self._read_index(st.st_size)
            self.load_mode = "index"
            if load == "index":   # what a listing reads of a store: config, meta, template; no tensor is readable
                self._close_file()
                return
            self._open_weights(load, progress, check)
        except BaseException:
            self.close()
            raise

    def _read_index(self, size: int):
        head = read_at(self._fh, 0, _HEADER.size)
        if len(head) < _HEADER.size:
            raise FormatError(f"{self.path}: truncated or corrupt store (header of {len(head)} bytes)")
        self._head = head
        magic, version, _, ioff, isize, doff, digest = _HEADER.unpack_from(head, 0)
        if magic != MAGIC:
            raise FormatError(f"{self.path}: not a BitNet store (bad magic {magic!r})", hint="convert the model with `bitnet convert`")
        if version > STORE_VERSION:   # a later format: this engine cannot know what it means
            conv = _converter_in(self._fh, ioff, isize, size)
            raise FormatError(f"{self.path}: made by a newer bitnet-cpu (store format {version}"
                              f"{f', converter {conv}' if conv else ''}; this one reads format {STORE_VERSION})",
                              hint="upgrade bitnet-cpu")
        if version != STORE_VERSION:
            raise FormatError(f"{self.path}: store format version {version} is not supported (this engine reads {STORE_VERSION})",
                              hint="re-convert the source model with `bitnet convert`")
        if isize > _MAX_INDEX or ioff + isize > size or doff > size or doff % ALIGN:
            raise FormatError(f"{self.path}: truncated or corrupt store (index at {ioff}+{isize}, file {size} bytes)")
        raw = read_at(self._fh, ioff, isize)
        if len(raw) < isize:   # cut short since its size was taken
            raise FormatError(f"{self.path}: truncated or corrupt store (index at {ioff}+{isize}, file "
                              f"{ioff + len(raw)} bytes)")
        if hashlib.sha256(raw).digest() != digest:
            raise FormatError(f"{self.path}: store index checksum mismatch (file corrupt)", hint="re-convert the model")
        try:
            index = json.loads(raw)
            if not isinstance(index, dict):
                raise TypeError("not a JSON object")
            if not isinstance(index["config"], dict):
                raise TypeError("config is not an object")
            self.config = ModelConfig.from_dict(index["config"])
            self.meta: dict = index.get("meta") or {}
            self.chat_template: str | None = index.get("chat_template")
            self._tok = index.get("tokenizer")
            self.config_keys: list[str] = list(index["config"])   # engine/formats/compat.py: any it does not know
            requires = index.get("requires", [])
            if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
                raise TypeError("requires must be a list of strings")
            self._index: dict[str, dict] = index["tensors"]
            if not isinstance(self.meta, dict) or not isinstance(self._index, dict):
                raise TypeError("meta and tensors must be objects")
            if self.chat_template is not None and not isinstance(self.chat_template, str):
                raise TypeError("chat_template must be a string or null")
            if self._tok is not None and not (isinstance(self._tok, dict) and isinstance(self._tok.get("kind"), str)
                                              and self._tok.get("tensor") in self._index):
                raise TypeError("tokenizer must name its kind and a tensor of the store")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise FormatError(f"{self.path}: corrupt store index: {json_why(e)}") from None
        unknown = [r for r in requires if r not in REQUIRES_KNOWN]
        if unknown:   # what a later writer says a reader must know to read the store right
            raise FormatError(f"{self.path}: requires {', '.join(map(repr, unknown))}, which this bitnet-cpu does not "
                              f"know ({made_by(self.meta)})", hint="upgrade bitnet-cpu")
        self._data_offset = doff
        self._size = size
        for name, e in self._index.items():
            if isinstance(e, dict) and isinstance(e.get("dtype"), str) and e["dtype"] not in _DTYPES:   # not damage
                raise FormatError(f"{self.path}: tensor {name!r} has dtype {e['dtype']!r}, which this bitnet-cpu does "
                                  f"not read ({made_by(self.meta)})", hint="upgrade bitnet-cpu")
            if not _entry_ok(e, doff, ioff):
                raise FormatError(f"{self.path}: tensor {name!r} has a corrupt index entry")
        # write_store places each after the last: an overlap is an edited index
        no_overlap(self.path, [(e["offset"], e["offset"] + e["nbytes"], name) for name, e in self._index.items()])
        # the tensor data: [doff, doff + data_bytes) of the file
        self.data_bytes = max((e["offset"] + e["nbytes"] for e in self._index.values()), default=0)

    def _open_weights(self, load: str, progress, check):
        self._mm = map_fd(self._fh, self.path, "BitNet store")
        self._data: Any = self._mm      # what tensor views are made from, at offset _base + entry offset
        self._base = self._data_offset
        self.load_mode = "mmap"
        if check is not None:
            check(self)
        if self._wants_memory(load):
            self._mem, start = read_into_memory(self.path, self._data_offset, self.data_bytes,
                                                huge=thp_mode() != "never", progress=progress, fh=self._fh)
            why = self.changed()
            if why is not None:   # rewritten while it was read: part old file, part new
                raise FormatError(f"{self.path}: the file {why} while its weights were read",
                                  hint="load it again once the copy or download is complete")
            self._views.clear()   # the check's views were of the mapping
            self._data, self._base, self.load_mode = self._mem, start, "memory"
            close_map(self._mm)   # the tensor data is all in memory: neither the mapping nor the file is read again,
            self._mm = None       # and a change to the file changes nothing loaded
            self._close_file()
        self._check_finite()

    def changed(self) -> str | None:
        """How the file the weights are mapped from has changed in place since it was opened ("was rewritten in
        place", "was truncated"...), or None: unchanged, or nothing is read from it any more (weights in memory,
        closed, or only the index read). One fstat of the file held open: a rename or removal of the path is no
        change (the mapping still reads the old file), a `cp` or `rsync --inplace` over it is. Cheap: once per
        request, never per token."""
        fh = self._fh
        if fh is None:
            return None
        try:
            st = os.fstat(fh.fileno())
        except (OSError, ValueError):   # closed meanwhile (close() in another thread)
            return None
        dev, ino, size, mtime, ctime = self._ident
        if st.st_size < size:
            return f"was truncated ({size} bytes when loaded, {st.st_size} now)"
        if st.st_size > size:
            return f"was rewritten in place ({size} bytes when loaded, {st.st_size} now)"
        if st.st_mtime_ns != mtime:
            return "was rewritten in place (same size, modified since it was loaded)"
        if st.st_ctime_ns != ctime:
            # a rename, removal, link or chmod changes only ctime; so does a copy that also set the old mtime
            # (cp -p, rsync -t): the header and index read again tell those apart
            try:
                head = read_at(fh, 0, _HEADER.size)
                _, _, _, ioff, isize, _, digest = _HEADER.unpack_from(head, 0)
                same = head == self._head and hashlib.sha256(read_at(fh, ioff, isize)).digest() == digest
            except (OSError, struct.error):
                same = False
            if not same:
                return "was rewritten in place (same size and time, other contents)"
            self._ident = (dev, ino, size, mtime, st.st_ctime_ns)
        return None

    def check_unchanged(self) -> None:
        """ModelChangedError (one line naming the file, what happened and what to do) when changed() says the file
        the weights are mapped from was rewritten in place. Called before each request, never per token; a request
        already running when the file changes may still read the new bytes."""
        why = self.changed()
        if why is not None:
            raise ModelChangedError(f"{self.path}: the BitNet store changed or was truncated while in use (it {why})",
                                    hint="load the model again (restart) to use the file as it is now; to replace a "
                                    "model in use, write the new file beside it and rename it over (mv), which leaves "
                                    "the loaded one intact")

    def _close_file(self):
        fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()

    def _check_finite(self):
        """The f32 tensors (norms, per-row and head scales: small) hold finite values. No checksum covers tensor
        data, and a NaN or inf there (a disk error, an edit) gives garbage text with exit 0; a GGUF or HF source
        with them is refused at conversion, a store is here."""
        for name, e in self._index.items():
            if e["dtype"] == "float32" and not np.isfinite(self.tensor(name)).all():
                self.close()
                raise FormatError(f"{self.path}: tensor {name!r} holds NaN/inf values (file damaged)",
                                  hint="re-convert the model")

    def _wants_memory(self, load: str) -> bool:
        if load == "mmap" or self.data_bytes == 0:
            return False
        if load == "memory":
            avail = available_memory()
            if avail is not None and avail < self.data_bytes:
                raise BitNetError(f"{self.path}: reading the weights needs {_size(self.data_bytes)}, more than the "
                                  f"{_size(avail)} of memory available", hint="use --mmap to map the file instead")
            return True
        if self.data_bytes < AUTO_MIN_BYTES or thp_mode() not in ("always", "madvise"):
            return False
        avail = available_memory()
        return avail is None or avail >= self.data_bytes + MEMORY_HEADROOM

    def load_summary(self) -> str:
        """How the weights are held, for -v lines: "mapped from the file" or "in memory, X of Y in 2 MB pages"."""
        if self._mem is None:
            return "mapped from the file"
        huge = self.huge_page_bytes()
        if huge is None:
            return f"in memory ({_size(self.data_bytes)})"
        return f"in memory ({_size(huge)} of {_size(self.data_bytes)} in huge pages)"

    def huge_page_bytes(self) -> int | None:
        """Bytes of the tensor data that sit in huge pages (0 when mapped from the file; None: unknown)."""
        if self._mem is None:
            return 0
        return huge_page_bytes(int(np.frombuffer(self._mem, np.uint8, count=1, offset=self._base).ctypes.data),
                               self.data_bytes)
    @property
    def tensor_names(self) -> list[str]:
        return list(self._index)

    def info(self, name: str) -> dict:
        if name not in self._index:
            raise FormatError(f"{self.path}: tensor {name!r} is missing from the store")
        return self._index[name]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def tensor(self, name: str) -> np.ndarray:
        """Zero-copy read-only view into the mapped file (or the store's memory copy)."""
        v = self._views.get(name)
        if v is None:
            if self._data is None:
                raise FormatError(f"{self.path}: this store is closed")
            e = self.info(name)
            dt = np.dtype(e["dtype"])
            count = int(np.prod(e["shape"], dtype=np.int64))
            v = np.frombuffer(self._data, dtype=dt, count=count, offset=self._base + e["offset"]).reshape(e["shape"])
            v.flags.writeable = False
            self._views[name] = v
        return v

    @property
    def tokenizer_kind(self) -> str | None:
        return self._tok["kind"] if self._tok else None

    @property
    def tokenizer_tensor(self) -> str | None:
        return self._tok["tensor"] if self._tok else None

    @property
    def tokenizer_spec(self) -> tuple[str, bytes] | None:
        """(kind, blob): kind "hf_json" (tokenizer.json text) or "sentencepiece" (model proto bytes)."""
        if not self._tok:
            return None
        return self._tok["kind"], self.tensor(self._tok["tensor"]).tobytes()

    def close(self):
        """Unmap / free the weights now where no view of them is left (a Model's are dropped with it), else as
        soon as the last one goes: the store keeps no reference."""
        self._views.clear()
        if self._mm is not None:
            close_map(self._mm)
        self._mm = None   # a view still alive (a suspended generator's) unmaps it when it goes, not when the Store does
        if self._mem is not None:
            try:
                self._mem.close()
            except BufferError:   # numpy views still hold it: it goes when they do
                pass
        self._data = self._mem = None
        self._close_file()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def is_store(path: str | os.PathLike) -> bool:
    return starts_with(path, MAGIC)


def store_warnings(store: Store) -> list[str]:
    """What conversion could only guess from the source file (meta "warnings": a GGUF's pre-tokenizer split another
    way, a BOS it asks for but does not name), one line each: said on every load, as llama.cpp says it on every
    load of the file. (A store another bitnet-cpu made: engine/formats/compat.py's load_warnings.)"""
    ws = store.meta.get("warnings")
    return [w.splitlines()[0][:300] for w in ws if isinstance(w, str) and w.strip()] if isinstance(ws, list) else []
