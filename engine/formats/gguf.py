"""Our own GGUF reader: maps the file, parses only the header (metadata + tensor infos) eagerly, and gives
zero-copy views of tensor bytes plus numpy decoders for the types BitNet files carry.

Why not the `gguf` package: it cannot read bitnet.cpp's I2_S (type 36, the official 2B-4T file), and it trusts
the header. Here every count, string length, dimension and offset is checked against the file size before
anything is allocated, so a lying header gives a FormatError naming the file, never a huge allocation.

    g = GGUFFile(path)            # FormatError / UnsupportedError on bad input
    g.kv["bitnet-b1.58.block_count"], g.arch, g.tensors["blk.0.attn_q.weight"] -> TensorInfo
    g.raw(name)                   # uint8 view of the tensor bytes (zero-copy)
    g.dequantize(name, rows=None) # f32 [rows, ne0]: F32 F16 BF16 Q8_0 TQ1_0 TQ2_0 Q2_0 I2_S TL1 TL2 here, every other
                                  # the `gguf` package decodes (Q4_0..Q8_1, K-quants, IQ*) via engine/gguf_dequant.py
    g.ternary(name)               # (W_t int8 [out, in], per-block scales f32) for TQ1_0 / TQ2_0 / I2_S;
                                  # TL1 / TL2 (bitnet.cpp's lookup-table layouts, engine/formats/tl_layouts.py);
                                  # Q2_0 / Q2_0_G128 (ternary Bonsai): its f16 scale per 64 / 128 weights

Layout facts: the GGUF spec (ggml's docs/gguf.md). dims[0] is the fastest axis; TensorInfo.shape is in numpy order (reversed).
"""
from __future__ import annotations

import bisect
import os
import re
import struct
from dataclasses import dataclass

import numpy as np

from ..fileio import close_map, map_readonly, no_overlap, starts_with
from ..errors import FormatError, UnsupportedError, quoted
from . import tl_layouts
from .gguf_dequant import OWN_DECODERS, decode_with_gguf, gguf_decodable

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 40
MAX_NESTING = 4
# GGUF's own limits (ggml's docs/gguf.md): tensor names at most 64 bytes (GGML_MAX_NAME; llama.cpp refuses longer
# ones), keys at most 65535. A longer length field is a corrupt header (a field before it misread), not a name to
# read whole: it could span the file. Names get 4x the spec's room; metadata values (chat templates,
# vocabularies) are not bounded.
GGUF_NAME_MAX, NAME_MAX = 64, 256
KEY_MAX = 65535

# type id -> (name, block size in elements, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 42: ("Q2_0", 64, 18),
}
# Type 42 exists in two block sizes: ggml's Q2_0 (64 weights: f16 d + 16 bytes of 2-bit codes) and PrismML's fork,
# which Ternary Bonsai's Q2_0 files were made with (128 weights, 34 bytes; "Q2_0_G128" here). A file says which
# by its tensor offsets (GGUFFile._q2_0_variant).
Q2_0 = 42
Q2_0_VARIANTS = {"Q2_0": (64, 18), "Q2_0_G128": (128, 34)}
IK_TYPES = {134: "IQ1_BN", 135: "IQ2_BN", 335: "IQ2_BN_R4"}   # ik_llama.cpp's ternary types (its ggml.h)
I2_S = 36                     # bitnet.cpp: n/4 bytes of 2-bit codes + 32-byte tail holding the f32 scale
BITNET_CPP_TYPES = {36: "I2_S", 37: "I8_S", 38: "TL1", 39: "TL2"}
BITNET_CPP_FTYPE_I2_S = 40    # general.file_type of bitnet.cpp's I2_S files (LLAMA_FTYPE_MOSTLY_I2_S)
TL_TYPES = ("TL1", "TL2")     # bitnet.cpp's lookup-table layouts (engine/formats/tl_layouts.py)
DECODABLE = OWN_DECODERS  # decoded here; gguf_decodable() adds what the `gguf` package decodes

# value type id -> (struct format, size); 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
               12: "<f8"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]   # numpy order: shape[-1] = dims[0] (the fastest axis)
    offset: int              # absolute offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def i2s_layout() -> str:
    """How I2_S codes are ordered, from BITNET_I2S_BLOCK: "128" (default: the 2024-11 release on every ISA and the
    shipped x86 builds since 2025-11, whose gemm-config.h defines ACT_PARALLEL: 128-weight blocks of 32 bytes),
    "64" (2025-11 and later ARM builds, QK_I2_S 64) or "1x4" (an x86 build whose gemm-config.h lacks ACT_PARALLEL,
    as utils/tune_gemm_config.py may write it: quantize_i2_s's 1x4 path, one byte per column holding 4 rows).
    The codes cannot tell these apart (the same values in another order), so it is the user's to say;
    docs/formats.md."""
    v = os.environ.get("BITNET_I2S_BLOCK", "128")
    if v not in ("64", "128", "1x4"):
        raise UnsupportedError(f"BITNET_I2S_BLOCK={v!r}: I2_S layouts are 128 (x86, 2024 builds), 64 (ARM 2025+)"
                               " or 1x4 (x86 2025+ built without ACT_PARALLEL)")
    return v


class _Cursor:
    """Bounds-checked little-endian reader over the mapped bytes."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str):
        if n < 0 or n > max(self.end, 1 << 40):   # a size no file could hold: a corrupt field, not a short file
            raise FormatError(f"{self.path}: corrupt GGUF file ({what} at byte {self.pos} claims {n} bytes; the"
                              f" whole file has {self.end})")
        if n > self.end:   # more than this file holds, not more than a whole download would: cut short, likely
            raise FormatError(f"{self.path}: truncated or corrupt GGUF file ({what} at byte {self.pos} needs at least"
                              f" {n} bytes; the whole file has {self.end})",
                              hint="if the file was downloaded, check its size and fetch it again")
        if self.pos + n > self.end:
            raise FormatError(f"{self.path}: truncated or corrupt GGUF file (reading {what} at byte {self.pos}"
                              f" needs {n} bytes, only {self.end - self.pos} are left)",
                              hint="if the file was downloaded, check its size and fetch it again")

    def scalar(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, limit: int | None = None, spec: str = "") -> str:
        """A GGUF string; one of more than `limit` bytes (the format's bound, `spec` says it) is a corrupt header."""
        n = self.u64(what + " length")
        if limit is not None and n > limit:
            raise FormatError(f"{self.path}: corrupt GGUF header: {what} is {n} bytes long ({spec})",
                              hint="if the file was downloaded, fetch it again")
        self.need(n, what)
        b = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b.decode("utf-8", errors="replace")

    def _strings(self, count: int, what: str) -> list[str]:
        """A string array (a vocabulary: 128k tokens, 280k merges) in one tight loop."""
        buf, pos, end = self.buf, self.pos, self.end
        unpack = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, what)
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos
                self.need(n, what)
            append(str(buf[pos: pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.scalar(fmt, size, what)
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            if depth >= MAX_NESTING:
                raise FormatError(f"{self.path}: GGUF array nested too deep in {what}")
            sub = self.u32(what + " element type")
            count = self.u64(what + " element count")
            if sub in _SCALARS:
                size = _SCALARS[sub][1]
                self.need(count * size, what)  # checked before allocating
                arr = np.frombuffer(self.buf, dtype=_NP_SCALARS[sub], count=count, offset=self.pos).copy()
                self.pos += count * size
                return arr.astype(bool) if sub == 7 else arr
            if sub == 8:
                self.need(count * 8, what)  # each string takes at least its 8-byte length
                return self._strings(count, what)
            if sub == 9:
                self.need(count * 12, what)
                return [self.value(sub, what, depth + 1) for _ in range(count)]
            raise FormatError(f"{self.path}: unknown GGUF array element type {sub} in {what}")
        raise FormatError(f"{self.path}: unknown GGUF value type {vtype} for {what}")


SPLIT_NAME = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf$")   # llama.cpp's llama_split_path: PREFIX-0000N-of-0000M.gguf


def split_part(first: str, i: int) -> str | None:
    """The path of part i (1-based) of the split set whose first part is `first` (None: not named as one)."""
    m = SPLIT_NAME.match(first)
    return None if m is None else f"{m.group(1)}-{i:05d}-of-{m.group(3)}.gguf"


class GGUFFile:
    """One GGUF file, or a model split into several (llama.cpp's gguf-split: the first part, PREFIX-00001-of-0000N.gguf,
    holds the metadata; every part holds some of the tensors): given the first part, the others are read beside it
    and their tensors join `tensors`."""

    def __init__(self, path: str | os.PathLike, first: "GGUFFile | None" = None):
        self.path = os.fspath(path)
        self._first = first        # for a later part of a split model: the first part (its architecture, file type)
        self._mm, size = map_readonly(self.path, 24, "GGUF file")
        self.size = size
        self.parts: list[GGUFFile] = []   # the split model's other parts
        self._part_of: dict[str, GGUFFile] = {}   # tensor name -> the part holding it (absent: this file)
        try:
            self._parse()
            if first is None:
                self._join_parts()
        except BaseException:
            self.close()
            raise

    def _join_parts(self):
        count, no = self.kv.get("split.count", 0), self.kv.get("split.no", 0)
        if count in (0, 1) and no == 0:
            return
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (count, no)) or not 0 <= no < count:
            raise FormatError(f"{self.path}: bad split keys (split.no {quoted(no)} of split.count {quoted(count)})")
        m = SPLIT_NAME.match(self.path)
        if m is None or int(m.group(3)) != count:
            raise FormatError(f"{self.path}: part {no + 1} of a GGUF split into {count} files, named otherwise than "
                              f"llama.cpp names the parts (PREFIX-00001-of-{count:05d}.gguf): the others cannot be found",
                              hint="rename the parts, or merge them: llama-gguf-split --merge FIRST-PART OUT.gguf")
        if no != 0:
            first = split_part(self.path, 1)
            if m.group(2) == "00001":   # named the first part, holding another: hinting this file again is a circle
                raise FormatError(f"{self.path}: named part 1 of {count} of a split GGUF, but holds part {no + 1} "
                                  "(its split.no): the parts are misnamed or swapped",
                                  hint="name each part by its split.no, or download the parts again")
            # the hint names the file, not a flag: -m is run's, convert and inspect take the file itself
            raise FormatError(f"{self.path}: part {no + 1} of {count} of a split GGUF: give the first part, which holds "
                              "the model's metadata", hint=f"give {first} instead")
        for i in range(1, count):
            path = split_part(self.path, i + 1)
            if not os.path.isfile(path):   # a folder or a FIFO there is not a part either, but not "missing"
                raise FormatError(f"{self.path}: part {i + 1} of {count} of this split GGUF " +
                                  ("is not a regular file" if os.path.exists(path) else "is missing") + f": {path}")
            part = GGUFFile(path, first=self)
            self.parts.append(part)
            if part.kv.get("split.no") != i or part.kv.get("split.count") != count:
                no_, count_ = (quoted(part.kv.get(k)) for k in ("split.no", "split.count"))
                raise FormatError(f"{path}: not part {i + 1} of {count} of {self.path} (its split.no {no_}, "
                                  f"split.count {count_})")
            for name, t in part.tensors.items():
                if name in self.tensors:
                    raise FormatError(f"{path}: tensor {quoted(name)} is also in another part of the split GGUF")
                self.tensors[name] = t
                self._part_of[name] = part
        want = self.kv.get("split.tensors.count")
        if isinstance(want, int) and want != len(self.tensors):
            raise FormatError(f"{self.path}: the split GGUF's {count} parts hold {len(self.tensors)} tensors, its "
                              f"header says {want}")

    def _parse(self):
        c = _Cursor(self._mm, self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise FormatError(f"{self.path}: not a GGUF file (bad magic {magic!r})")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in (2, 3):
            if self.version in (1,):
                raise UnsupportedError(f"{self.path}: GGUF version 1 is not supported", hint="re-convert with a current llama.cpp")
            if self.version & 0xFFFF == 0 and self.version >> 16:
                raise UnsupportedError(f"{self.path}: big-endian GGUF files are not supported")
            raise UnsupportedError(f"{self.path}: unknown GGUF version {self.version}")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # each KV needs >= 13 bytes (key length, type, 1-byte value); each tensor info >= 32 bytes
        if n_kv * 13 > self.size or n_tensors * 32 > self.size:
            what = "truncated or corrupt" if n_kv < 1 << 20 and n_tensors < 1 << 20 else "corrupt"
            raise FormatError(f"{self.path}: {what} GGUF file: the header declares {n_tensors} tensors and {n_kv}"
                              f" metadata keys, more than its {self.size} bytes can hold")
        self.kv: dict = {}
        self.kv_types: dict[str, int] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}", KEY_MAX, f"GGUF keys are at most {KEY_MAX} bytes")
            if key in self.kv:   # llama.cpp refuses it too: which value counts would be a guess
                raise FormatError(f"{self.path}: metadata key {quoted(key)} appears twice")
            vtype = c.u32(f"type of {quoted(key)}")
            self.kv[key] = c.value(vtype, quoted(key))
            self.kv_types[key] = vtype
        if self._first is not None:   # a later part of a split model: the model's metadata is the first part's
            for key in ("general.architecture", "general.file_type"):
                if key in self._first.kv:
                    self.kv.setdefault(key, self._first.kv[key])
        self.arch = str(self.kv.get("general.architecture", ""))
        align = self.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1) or align > 1 << 20:
            raise FormatError(f"{self.path}: bad general.alignment {quoted(align)} (must be a power of two, at most"
                              f" {1 << 20})")
        self.alignment = align
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor #{i}'s name", NAME_MAX, f"GGUF tensor names are at most {GGUF_NAME_MAX} bytes")
            nd = c.u32(f"dims of {quoted(name)}")
            if not 1 <= nd <= MAX_DIMS:
                raise FormatError(f"{self.path}: tensor {quoted(name)} has {nd} dimensions (1..{MAX_DIMS} allowed)")
            dims = [c.u64(f"dims of {quoted(name)}") for _ in range(nd)]
            tid = c.u32(f"type of {quoted(name)}")
            off = c.u64(f"offset of {quoted(name)}")
            infos.append((name, dims, tid, off))
        self.data_offset = -(-c.pos // align) * align
        self.types = dict(GGML_TYPES)   # this file's: the block size of Q2_0 depends on who wrote it
        ftype = self.kv.get("general.file_type")
        self.tl2_not_mxfp4 = (self.arch.startswith("bitnet") and (self.arch != "bitnet" or self._tl2_fits(infos, ftype))
                              or self.arch == "llama" and self._tl2_fits(infos, ftype))
        self.tl_tilings: dict[tuple[str, int, int], tl_layouts.Tiling] = {}   # what ternary() used, per shape
        if any(tid == Q2_0 for _, _, tid, _ in infos):
            name = self._q2_0_variant(infos)
            self.types[Q2_0] = (name, *Q2_0_VARIANTS[name])
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, tid, off in infos:
            self.tensors[name] = self._check_tensor(name, dims, tid, off)
        if len(self.tensors) != len(infos):
            raise FormatError(f"{self.path}: duplicate tensor names in GGUF")
        no_overlap(self.path, [(t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values()
                                if t.nbytes >= 0])   # a tensor of a type we do not know: its size neither
        self._check_gaps()

    def _check_gaps(self):
        """Each tensor of a known type fills the space up to the next one (or the end of the file), padding to
        general.alignment included, as ggml's reader requires ("tensor has offset N, expected M"): a type or
        shape changed in the header (one bit: F32 -> F16) would otherwise read part of the bytes, or others'.
        The file's end may or may not carry the last tensor's padding; order in the header is not required."""
        starts = sorted(t.offset for t in self.tensors.values())
        for t in self.tensors.values():
            if t.nbytes < 0:
                continue
            i = bisect.bisect_right(starts, t.offset)
            gap = (starts[i] if i < len(starts) else self.size) - t.offset
            if not 0 <= gap - t.nbytes < self.alignment:
                what = (f"runs {t.nbytes - gap} bytes into the next tensor" if gap < t.nbytes else
                        f"is followed by {gap - t.nbytes} unused bytes (padding is under {self.alignment})")
                raise FormatError(f"{self.path}: tensor {quoted(t.name)} ({t.type_name} {list(t.shape)}: {t.nbytes}"
                                  f" bytes) {what}: its type or shape does not match its data (corrupt file?)")

    def _q2_0_variant(self, infos) -> str:
        """ggml's 64-weight Q2_0 blocks or PrismML's 128-weight ones: the one whose sizes fit every Q2_0 tensor
        between its offset and the next tensor's (or the end of the data), padding included."""
        ends = sorted(off for _, _, _, off in infos) + [self.size - self.data_offset]
        fits = []
        for variant, (bs, ts) in Q2_0_VARIANTS.items():
            ok = True
            for _, dims, tid, off in infos:
                if tid != Q2_0:
                    continue
                n = 1
                for d in dims:
                    n *= d
                nxt = next((e for e in ends if e > off), None)
                if dims[0] % bs or nxt is None or not 0 <= (nxt - off) - n // bs * ts < max(self.alignment, 1):
                    ok = False
                    break
            if ok:
                fits.append(variant)
        if not fits:
            raise FormatError(f"{self.path}: Q2_0 tensors fit neither ggml's 64-weight blocks nor PrismML's"
                              " 128-weight ones (truncated or corrupt file?)")
        return fits[0]

    def _tl2_fits(self, infos, ftype) -> bool:
        """Type 39 in a `bitnet` or `llama` file: bitnet.cpp's TL2 (its 2024 converter writes these architecture
        names, and general.file_type 39) or llama.cpp's MXFP4. A tensor fits TL2 when it fills the space up to the
        next one (or the end) as a TL2 tensor (codes + 32-byte scale tail), MXFP4 when it fills it at 17 bytes per
        32 weights: never both for one shape. TL2 when more type-39 tensors fit TL2 than MXFP4, so one tensor whose
        header is corrupt is named, as TL2, instead of the whole file read as MXFP4 (an intact tensor then blamed
        as "truncated?"); with no tensor fitting either, file type 39 says TL2."""
        ends = sorted(off for _, _, _, off in infos) + [self.size - self.data_offset]
        tl2 = mxfp4 = 0
        for _, dims, tid, off in infos:
            if tid != 39:
                continue
            nxt = next((e for e in ends if e > off), None)
            if nxt is None:
                continue
            n = 1
            for d in dims:
                n *= d
            if len(dims) == 2 and tl_layouts.shape_ok("TL2", dims[1], dims[0]):
                tl2 += 0 <= (nxt - off) - tl_layouts.tensor_bytes("TL2", dims[1], dims[0]) < self.alignment
            mxfp4 += dims[0] % 32 == 0 and 0 <= (nxt - off) - n // 32 * 17 < self.alignment
        return tl2 > mxfp4 or tl2 == mxfp4 == 0 and ftype == 39

    def _type_name(self, tid: int) -> str:
        if tid in BITNET_CPP_TYPES and self.arch.startswith("bitnet") and (tid != 39 or self.tl2_not_mxfp4):
            return BITNET_CPP_TYPES[tid]
        if tid == I2_S and self.arch == "llama" and self.kv.get("general.file_type") == BITNET_CPP_FTYPE_I2_S:
            return "I2_S"  # bitnet.cpp's Falcon3 / Falcon-E files (upstream's 36 was IQ4_NL_4_4)
        if self.arch == "llama" and (tid == 38 and self.kv.get("general.file_type") == 38 or
                                     tid == 39 and self.tl2_not_mxfp4):
            return BITNET_CPP_TYPES[tid]   # bitnet.cpp's Llama3-8B-1.58 TL files: file type 38 (TL1), or TL2-sized
        if tid in self.types:
            return self.types[tid][0]
        if tid in IK_TYPES:   # ik_llama.cpp's own ternary types: named, so its files are recognised as such
            return f"{IK_TYPES[tid]} (type {tid}, ik_llama.cpp's; convert its F16 / bf16 source instead)"
        return f"type {tid}"

    def _check_tensor(self, name, dims, tid, off) -> TensorInfo:
        if any(d <= 0 or d > MAX_ELEMENTS for d in dims):
            raise FormatError(f"{self.path}: tensor {quoted(name)} has a bad dimension {dims}")
        n = 1
        for d in dims:
            n *= d
        if n > MAX_ELEMENTS:
            raise FormatError(f"{self.path}: tensor {quoted(name)} is absurdly large ({n} elements)")
        tname = self._type_name(tid)
        if tname == "I2_S":
            if n % 128:
                raise FormatError(f"{self.path}: I2_S tensor {quoted(name)} has {n} elements (not a multiple of 128)")
            nbytes = n // 4 + 32
        elif tname in TL_TYPES:
            if len(dims) != 2 or not tl_layouts.shape_ok(tname, dims[1], dims[0]):
                raise FormatError(f"{self.path}: {tname} tensor {quoted(name)} has shape {list(reversed(dims))}, which"
                                  " bitnet.cpp's converter cannot write")
            nbytes = tl_layouts.tensor_bytes(tname, dims[1], dims[0])
        elif tid in self.types and tname == self.types[tid][0]:
            _, bs, ts = self.types[tid]
            if dims[0] % bs:
                raise FormatError(f"{self.path}: tensor {quoted(name)} row length {dims[0]} is not a multiple of"
                                  f" the {tname} block size {bs}")
            nbytes = n // bs * ts
        else:
            nbytes = -1  # unknown type: it is an error only when someone reads it
        if off % self.alignment:
            raise FormatError(f"{self.path}: tensor {quoted(name)} offset {off} is not {self.alignment}-byte aligned")
        start = self.data_offset + off
        if nbytes >= 0 and start + nbytes > self.size:
            raise FormatError(f"{self.path}: tensor {quoted(name)} ({nbytes} bytes at {start}) lies past the end of the"
                              f" file ({self.size} bytes): truncated?")
        return TensorInfo(name, tid, tname, tuple(reversed(dims)), start, nbytes)

    # ---- typed metadata ----------------------------------------------------------------------------
    def get(self, key: str, kind: type, default=None):
        """Metadata value checked to be `kind` (str, int or float; ints are accepted as floats); a value of
        another type is a FormatError naming the key, a missing one gives `default`."""
        v = self.kv.get(key)
        if v is None:
            return default
        ok = isinstance(v, str) if kind is str else (
            isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
            isinstance(v, int) and not isinstance(v, bool) if kind is int else isinstance(v, kind))
        if not ok:
            raise FormatError(f"{self.path}: GGUF key {key} has a value of the wrong type ({type(v).__name__},"
                              f" expected {kind.__name__})")
        return float(v) if kind is float else v

    # ---- access ------------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise FormatError(f"{self.path}: tensor {quoted(name)} is missing")
        return t

    def raw(self, name: str) -> np.ndarray:
        part = self._part_of.get(name)
        if part is not None:
            return part.raw(name)
        t = self.info(name)
        if t.nbytes < 0:
            raise UnsupportedError(f"{self.path}: tensor {quoted(name)} has an unsupported type: {t.type_name}")
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def dequantize(self, name: str, rows: slice | None = None) -> np.ndarray:
        """f32 [rows, ne0] (2-D even for 1-D tensors: [1, n]); rows slices the outer dimension."""
        part = self._part_of.get(name)
        if part is not None:   # a split model's tensor: decoded by its own part (its own Q2_0 block size)
            return part.dequantize(name, rows)
        t = self.info(name)
        own = t.type_name in DECODABLE or t.type_name in TL_TYPES
        if not own and (t.nbytes < 0 or t.type_name not in gguf_decodable()):
            raise UnsupportedError(f"{self.path}: tensor {quoted(name)} has an unsupported type: {t.type_name}",
                                   hint="supported: " + ", ".join(sorted(DECODABLE | gguf_decodable())) + (
                                       "" if gguf_decodable() else "; pip install gguf for the other types"))
        ne0 = t.shape[-1]
        nrows = t.n_elements // ne0
        r0, r1, _ = (rows or slice(None)).indices(nrows)
        if t.type_name == "I2_S" or t.type_name in TL_TYPES:
            w, s = self.ternary(name)
            return (w.reshape(nrows, ne0)[r0:r1].astype(np.float32) * s[0])
        _, bs, ts = self.types[t.type_id]
        row_bytes = ne0 // bs * ts
        raw = self.raw(name)[r0 * row_bytes: r1 * row_bytes]
        if t.type_name not in DECODABLE:
            return decode_with_gguf(raw, t.type_name, r1 - r0).reshape(r1 - r0, ne0)
        return decode_blocks(raw, t.type_name).reshape(r1 - r0, ne0)

    def ternary(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(W_t int8 [out, in] in {-1,0,1}, block scales f32): per 256-block d for TQ*, one scale for I2_S."""
        part = self._part_of.get(name)
        if part is not None:
            out = part.ternary(name)
            self.tl_tilings.update(part.tl_tilings)
            return out
        t = self.info(name)
        if len(t.shape) != 2:
            raise FormatError(f"{self.path}: ternary tensor {quoted(name)} must be 2-D, has shape {t.shape}")
        out, inp = t.shape
        raw = self.raw(name)
        if t.type_name == "I2_S":
            n = out * inp
            layout = i2s_layout()
            if layout == "1x4":   # byte [r // 4, c] holds rows r..r+3 of column c at bits 7-6, 5-4, 3-2, 1-0
                if out % 4:
                    raise FormatError(f"{self.path}: I2_S tensor {quoted(name)} has {out} rows: the 1x4 layout"
                                      " (BITNET_I2S_BLOCK=1x4) needs a multiple of 4")
                codes = raw[: n // 4].reshape(out // 4, inp)
            else:                 # block b: byte [b, j] holds weights j, j + B/4, j + B/2, j + 3B/4 of the block
                codes = raw[: n // 4].reshape(-1, int(layout) // 4)
            w = np.empty((codes.shape[0], 4, codes.shape[1]), np.uint8)
            for k, shift in enumerate((6, 4, 2, 0)):
                np.bitwise_and(codes >> shift, 3, out=w[:, k])
            if (w == 3).any():
                # also what a multi-threaded bitnet.cpp llama-quantize leaves: each chunk lands at 4x its place
                # and writes its f32 scale into the codes (bytes 0x30-0x3f of a scale in [2^-31, 2) hold a 3)
                raise FormatError(f"{self.path}: I2_S tensor {quoted(name)} holds invalid code 3 (corrupt, or quantized"
                                  " by bitnet.cpp's llama-quantize with more than 1 thread: pass nthreads 1)")
            scale = np.frombuffer(raw[n // 4: n // 4 + 4].tobytes(), "<f4").astype(np.float32)
            return (w.view(np.int8) - np.int8(1)).reshape(out, inp), scale
        if t.type_name in TL_TYPES:
            key = (t.type_name, out, inp)
            w, scale, tiling = tl_layouts.decode(t.type_name, raw, out, inp, f"{self.path}: tensor {quoted(name)}",
                                                 self.tl_tilings.get(key))
            self.tl_tilings[key] = tiling
            return w, scale
        if t.type_name in Q2_0_VARIANTS:   # d per 64 / 128 weights of a row (weight_groups models keep them)
            blocks = raw.reshape(-1, self.types[t.type_id][2])
            codes = _q2_0_codes(blocks)
            if (codes == 3).any():
                raise FormatError(f"{self.path}: Q2_0 tensor {quoted(name)} holds code 3 (+2 x scale): not ternary")
            d = blocks[:, :2].copy().view("<f2").reshape(-1)
            return (codes.view(np.int8) - np.int8(1)).reshape(out, inp), d
        if t.type_name in ("TQ1_0", "TQ2_0"):
            _, bs, ts = self.types[t.type_id]
            blocks = raw.reshape(-1, ts)
            d = blocks[:, ts - 2:].copy().view("<f2").astype(np.float32).reshape(-1)
            codes = _tq2_codes(blocks) if t.type_name == "TQ2_0" else _tq1_codes(blocks)
            if t.type_name == "TQ2_0" and (codes == 3).any():
                raise FormatError(f"{self.path}: TQ2_0 tensor {quoted(name)} holds invalid code 3")
            return (codes.view(np.int8) - np.int8(1)).reshape(out, inp), d
        raise UnsupportedError(f"{self.path}: tensor {quoted(name)} of type {t.type_name} is not ternary"
                               " (expected I2_S, TL1, TL2, TQ1_0, TQ2_0 or Q2_0)")

    def close(self):
        for part in self.parts:
            part.close()
        close_map(self._mm)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- block decoders (bytes -> values), matching ggml's reference dequantizers -------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _tq2_codes(blocks: np.ndarray) -> np.ndarray:
    """TQ2_0 [nb, 66] -> codes uint8 [nb, 256]: half h, byte m, bits 2l -> element h*128 + l*32 + m."""
    qs = blocks[:, :64].reshape(-1, 2, 1, 32)
    return ((qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)


def _q2_0_codes(blocks: np.ndarray) -> np.ndarray:
    """Q2_0 [nb, 2 + B/4] -> codes uint8 [nb, B] (B = 64 or 128): element j in byte 2 + j/4, bits 2(j%4)
    (ggml's reference; the same in both block sizes)."""
    qs = blocks[:, 2:]
    return ((qs[:, :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(blocks.shape[0], -1)


def _tq1_codes(blocks: np.ndarray) -> np.ndarray:
    """TQ1_0 [nb, 54] -> codes uint8 [nb, 256] (base-3, most significant trit first)."""
    pow3 = np.array([1, 3, 9, 27, 81], np.uint8)

    def trits(b, n):  # b [nb, k] -> [nb, n, k]
        q = (b[:, None, :] * pow3[:n, None]).astype(np.uint8)  # wraps mod 256 like the C code
        return ((q.astype(np.uint16) * 3) >> 8).astype(np.uint8)

    a = trits(blocks[:, :32], 5).reshape(-1, 160)
    b = trits(blocks[:, 32:48], 5).reshape(-1, 80)
    c = trits(blocks[:, 48:52], 4).reshape(-1, 16)
    return np.concatenate([a, b, c], axis=1)


def decode_blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Raw bytes of whole blocks -> flat f32 values."""
    if type_name == "F32":
        return raw.view("<f4").astype(np.float32)
    if type_name == "F16":
        return raw.view("<f2").astype(np.float32)
    if type_name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if type_name == "Q8_0":
        b = raw.reshape(-1, 34)
        return (_f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    if type_name == "TQ2_0":
        b = raw.reshape(-1, 66)
        return (_f16(b[:, 64:]) * (_tq2_codes(b).astype(np.float32) - 1)).reshape(-1)
    if type_name in Q2_0_VARIANTS:
        b = raw.reshape(-1, Q2_0_VARIANTS[type_name][1])
        return (_f16(b[:, :2]) * (_q2_0_codes(b).astype(np.float32) - 1)).reshape(-1)
    if type_name == "TQ1_0":
        b = raw.reshape(-1, 54)
        return (_f16(b[:, 52:]) * (_tq1_codes(b).astype(np.float32) - 1)).reshape(-1)
    # everything else (Q4_K and Q6_K included: our hand-written copies were no faster) through the gguf package
    return decode_with_gguf(raw, type_name, 1)


def is_gguf(path: str | os.PathLike) -> bool:
    return starts_with(path, GGUF_MAGIC)
