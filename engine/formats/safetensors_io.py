"""Our own safetensors reader: maps each file, validates the JSON header against the file size, and returns
zero-copy numpy views (bf16 as raw uint16 plus a converter), for single files and sharded HF directories
(model.safetensors.index.json). No torch, no copy of the weights.

    st = SafetensorsDir(dir)        # or SafetensorsFile(path)
    st.names(); st.info(name) -> (dtype tag, shape); st.get(name) -> np view; st.get_f32(name) -> f32 array
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from ..fileio import close_map, map_readonly, no_overlap
from ..errors import FormatError, UnsupportedError, json_why

MAX_HEADER = 100 << 20
INDEX = "model.safetensors.index.json"
MAX_INDEX = 64 << 20   # a real index is well under 1 MB (a name per tensor)
# tag -> numpy dtype of the raw view (BF16 is read as uint16 bits)
DTYPES = {"U8": "u1", "I8": "i1", "BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "I16": "<i2",
          "U16": "<u2", "I32": "<i4", "U32": "<u4", "I64": "<i8", "U64": "<u8", "BOOL": "u1"}
READABLE = {"U8", "I8", "BF16", "F16", "F32"}
MAX_DIM = 1 << 40


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs):
    """A JSON object as a dict, refusing a key given twice (json.loads alone keeps the last)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return d


class SafetensorsFile:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._mm, size = map_readonly(self.path, 8, "safetensors file")
        (hlen,) = struct.unpack_from("<Q", self._mm, 0)
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise FormatError(f"{self.path}: corrupt safetensors header (length {hlen}, file {size} bytes)")
        try:
            header = json.loads(bytes(self._mm[8: 8 + hlen]).decode("utf-8"), object_pairs_hook=_no_duplicates)
        except _Duplicate as e:   # json.loads keeps the last: the first one's bytes would be an unchecked hole
            raise FormatError(f"{self.path}: safetensors header names {e.args[0]!r} twice") from None
        except (UnicodeDecodeError, ValueError, RecursionError) as e:   # RecursionError: nested past any depth a header has
            raise FormatError(f"{self.path}: safetensors header is not valid JSON: {json_why(e)}") from None
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: safetensors header is not a JSON object")
        self.metadata = header.pop("__metadata__", None)
        self.data_start = 8 + hlen
        data_size = size - self.data_start
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        spans: list[tuple[int, int, str]] = []
        for name, e in header.items():
            try:
                tag, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
                ok = (isinstance(tag, str) and isinstance(shape, list)
                      and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)
                      and isinstance(b, int) and isinstance(end, int) and 0 <= b <= end)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise FormatError(f"{self.path}: tensor {name!r} has a malformed header entry")
            if tag not in DTYPES:
                raise UnsupportedError(f"{self.path}: tensor {name!r} has unsupported dtype {tag}")
            n = 1
            for d in shape:
                n *= d
            if n * np.dtype(DTYPES[tag]).itemsize != end - b:
                raise FormatError(f"{self.path}: tensor {name!r}: shape {shape} of {tag} does not match its"
                                  f" {end - b} bytes")
            if end > data_size:
                raise FormatError(f"{self.path}: tensor {name!r} lies past the end of the file (truncated?)")
            self._entries[name] = (tag, tuple(shape), self.data_start + b, n)
            spans.append((b, end, name))
        no_overlap(self.path, spans)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        e = self._entries.get(name)
        if e is None:
            raise FormatError(f"{self.path}: tensor {name!r} is missing")
        return e[0], e[1]

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view (BF16 -> uint16 bits)."""
        tag, shape = self.info(name)
        if tag not in READABLE:
            raise UnsupportedError(f"{self.path}: tensor {name!r} has unsupported dtype {tag}",
                                   hint="expected one of " + ", ".join(sorted(READABLE)))
        _, _, off, n = self._entries[name]
        if n == 0:
            return np.zeros(shape, DTYPES[tag])
        return np.frombuffer(self._mm, dtype=DTYPES[tag], count=n, offset=off).reshape(shape)

    def get_f32(self, name: str) -> np.ndarray:
        tag, _ = self.info(name)
        v = self.get(name)
        if tag == "BF16":
            return bf16_to_f32(v)
        if tag in ("F16", "F32"):
            return v.astype(np.float32)
        raise FormatError(f"{self.path}: tensor {name!r} is {tag}, expected a float tensor")

    def close(self):
        close_map(self._mm)


def _shown(name: str) -> str:
    """A file name as written in a message: itself, or its repr where it holds control characters."""
    return name if name.isprintable() else repr(name)


def index_shards(path: str) -> list[str]:
    """The shard file names (sorted, each once) that model.safetensors.index.json of the HF directory `path` maps
    tensors to; FormatError, in words, for an index that is not that (too large, not JSON, nested too deeply, no
    "weight_map" object, a name that is not a plain file name beside it, no shard at all). Whether the shards are
    there is the caller's to say: the loader and the hub's check of a download share this one reading."""
    index = os.path.join(path, INDEX)
    try:
        with open(index, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_INDEX:   # json.load holds the whole text and its objects: refused before reading
                raise FormatError(f"{index}: shard index is {size} bytes (at most {MAX_INDEX} read)")
            doc = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise FormatError(f"{index}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{index}: shard index is not valid JSON: {json_why(e)}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{index}: shard index is not a JSON object")
    wm = doc.get("weight_map")
    if not isinstance(wm, dict):
        raise FormatError(f"{index}: shard index has no \"weight_map\" object")
    for tensor, fn in wm.items():
        if not isinstance(fn, str):
            raise FormatError(f"{index}: the shard name of tensor {tensor!r} is not a string ({fn!r})")
        if not fn or os.path.basename(fn) != fn or fn in (".", "..") or "\0" in fn:
            raise FormatError(f"{index}: shard name {fn!r} (of tensor {tensor!r}) must be a plain file name in "
                              "the model folder")
    if not wm:
        raise FormatError(f"{index}: shard index lists no shards (its weight_map is empty)")
    return sorted(set(wm.values()))


class SafetensorsDir:
    """All *.safetensors of an HF model directory (sharded via model.safetensors.index.json, or every file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX)
        files: list[str]
        if os.path.isfile(index):
            files = index_shards(self.path)
            for fn in files:
                shard = os.path.join(self.path, fn)
                if not os.path.isfile(shard):   # a folder or a FIFO is there, but not as a shard
                    raise FormatError(f"{index}: shard {_shown(fn)} " + (
                        "is not a regular file" if os.path.exists(shard) else f"is missing from {self.path}"))
        else:
            try:
                files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            except OSError as e:
                raise FormatError(f"{self.path}: cannot list directory: {e.strerror}") from None
        if not files:
            bins = [f for f in os.listdir(self.path) if f.endswith(".bin")] if os.path.isdir(self.path) else []
            raise FormatError(f"{self.path}: no *.safetensors files in this directory",
                              hint=("only PyTorch pickles (" + ", ".join(sorted(bins)[:2]) + ") here: re-save the model"
                                    " with safe_serialization=True (pickles are not loaded: they can run code)")
                              if bins else None)
        self.files = [SafetensorsFile(os.path.join(self.path, fn)) for fn in files]
        self._where: dict[str, SafetensorsFile] = {}
        for sf in self.files:
            for n in sf.names():
                if n in self._where:
                    raise FormatError(f"{sf.path}: tensor {n!r} also appears in {self._where[n].path}")
                self._where[n] = sf

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> SafetensorsFile:
        sf = self._where.get(name)
        if sf is None:
            raise FormatError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return sf

    def info(self, name: str):
        return self._file(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(name)

    def get_f32(self, name: str) -> np.ndarray:
        return self._file(name).get_f32(name)

    def close(self):
        for sf in self.files:
            sf.close()
