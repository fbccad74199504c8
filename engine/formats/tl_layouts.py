"""bitnet.cpp's TL1 (ARM) and TL2 (x86) lookup-table layouts, read back into ternary weights + scale.

The specification is bitnet.cpp's Python converter, utils/convert-hf-to-gguf-bitnet.py (microsoft/BitNet; the
functions process_tl1 / preprocess_weights_tl1 / preprocess_three_weights_tl2 / preprocess_two_weights_tl2 /
preprocess_weights_tl2 / transform_to_tl1 / transform_to_tl2, unchanged from the 2024-11 release 7c57a5a to
2026's 16da220), and the GGUF writer of its llama.cpp fork (gguf-py, Eddie-Wang1120/llama.cpp merge-dev), which
hides the `<name>_scale` tensors from the header and writes each scale in a 32-byte tail after the codes.

A matrix W [M, K] (M = outputs, K = inputs) with ternary entries and one scale s (the converter's
max|weight_quant(W)| = mean|W|, it multiplies) is stored as:

TL1 (M*K/4 bytes, then a 32-byte tail holding the f32 scale): pairs of weights along K, (w[2j], w[2j+1]) ->
    4-bit code 3*w[2j] + w[2j+1] + 4 (0..8); the [M, K/2] code matrix is permuted by tiles (BM rows x BK
    inputs, then bm x by sub-tiles, by = 256/bm, then 16-row groups) and two codes go in a byte, first in the
    high nibble.
TL2 (pad32(T) bytes with T = (K-256)*M/3*5/8 + 64*M, then the 32-byte scale tail): K splits at
    K3 = K - K % BK. The first K3 inputs go in triples, v = 9a + 3b + c: |v| (0..13) as 4-bit codes tiled like
    TL1 (bm = 32, by = 192/bm = 6), rows of 32 bytes whose 8-byte groups 1 and 2 are swapped, followed by the
    sign bits (1 where v < 0), 16 to a little-endian uint16 (first bit highest) in their own tile order;
    the last K % BK inputs go in pairs as in TL1, tiled with (BM, 32, 32). Zero bytes pad the codes up to T.

The tiling (BM, BK, bm) comes from include/kernel_config.ini, which bitnet.cpp's codegen scripts write per
matrix shape; it is not in the GGUF. We take it from what bitnet.cpp ships for its three TL models: the codegen
commands of setup_env.py (what `setup_env.py -q tl1|tl2` writes, tried first) and preset_kernels/*/
kernel_config_tl*.ini. BITNET_TL_KERNEL_CONFIG=<a kernel_config.ini> puts that file's tilings first (one the
converter could not have used for the shape is refused, not skipped).

The file's own invariants (checked for every tensor, and used to tell tilings apart):
  TL1: every code <= 8. A permutation keeps that, so TL1 codes cannot tell tilings apart: a TL1 shape needs
       a known tiling (setup_env.py's first; the override for anything else).
  TL2: every triple code <= 13, every pair code <= 8, the padding up to T is zero, and no sign bit is set on a
       zero triple (v = 0 has sign 0). These catch a tiling that splits K elsewhere (K % BK differs: the code,
       sign and pair regions then overlap wrongly) and corrupt bytes, but not a tiling with the same split:
       tried on the converter's output, every tiling codegen_tl2.py accepts for the shape with the same K % BK
       kept all four (the signs move with their triples), while decoding to a different matrix. So TL2 too
       takes only tilings bitnet.cpp ships (or the override) and refuses a file none of them fits. The code and
       padding checks need only the split, not the tiling (a permutation moves nibbles, it does not change them):
       when only a split no tiling tried has fits the bytes, the tiling is blamed; otherwise the bytes are.
"""
from __future__ import annotations

import configparser
import os
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, UnsupportedError

ENV_CONFIG = "BITNET_TL_KERNEL_CONFIG"
TAIL = 32   # the scale's slot after the codes


@dataclass(frozen=True)
class Tiling:
    BM: int
    BK: int
    bm: int
    source: str = ""

    def label(self) -> str:
        return f"BM={self.BM} BK={self.BK} bm={self.bm}" + (f" ({self.source})" if self.source else "")


_SETUP = "setup_env.py codegen"
_INI = "preset_kernels/{}/kernel_config_{}.ini"
# (M, K) -> [(BM, BK, bm, source)] per layout, setup_env.py's first (its codegen rewrites include/kernel_config.ini
# after copying a preset, so a file made by setup_env.py has these).
_LARGE, _3B, _L3 = "bitnet_b1_58-large", "bitnet_b1_58-3B", "Llama3-8B-1.58-100B-tokens"
_PRESETS_RAW = {
    "TL1": [
        (_LARGE, [(1536, 4096, 256, 128, 32), (1536, 1536, 128, 64, 64), (4096, 1536, 256, 128, 32)], None),
        (_3B, [(3200, 8640, 160, 64, 32), (3200, 3200, 320, 128, 64), (8640, 3200, 320, 64, 32)], None),
        (_L3, [(14336, 4096, 256, 128, 32), (4096, 14336, 128, 64, 64), (1024, 4096, 256, 128, 32),
               (4096, 4096, 128, 64, 64)],
         [(14336, 4096, 256, 128, 64), (4096, 14336, 256, 128, 32), (1024, 4096, 128, 64, 64),
          (4096, 4096, 128, 64, 32)]),
    ],
    "TL2": [
        # the large preset ini's (4096, 1536) bm=64 is left out: the converter cannot write it (bm must be 32)
        (_LARGE, [(1536, 4096, 256, 96, 32), (1536, 1536, 128, 192, 32), (4096, 1536, 256, 96, 32)], None),
        (_3B, [(3200, 8640, 160, 96, 32), (3200, 3200, 320, 96, 32), (8640, 3200, 320, 96, 32)], None),
        (_L3, [(14336, 4096, 256, 96, 32), (4096, 14336, 128, 96, 32), (1024, 4096, 256, 96, 32),
               (4096, 4096, 128, 96, 32)], None),
    ],
}


def _build_presets() -> dict[str, dict[tuple[int, int], list[Tiling]]]:
    out: dict[str, dict[tuple[int, int], list[Tiling]]] = {"TL1": {}, "TL2": {}}
    for kind, models in _PRESETS_RAW.items():
        for model, setup, ini in models:
            for rows, src in ((setup, f"{_SETUP} {model}"), (ini or setup, _INI.format(model, kind.lower()))):
                for M, K, BM, BK, bm in rows:
                    lst = out[kind].setdefault((M, K), [])
                    if not any((t.BM, t.BK, t.bm) == (BM, BK, bm) for t in lst):
                        lst.append(Tiling(BM, BK, bm, src))
    return out


PRESETS = _build_presets()


def preset_shapes(kind: str) -> str:
    return ", ".join(f"{m}x{k}" for m, k in PRESETS[kind])


def env_tilings(M: int, K: int) -> list[Tiling]:
    """Tilings for (M, K) from the kernel_config.ini named by BITNET_TL_KERNEL_CONFIG (none when unset)."""
    path = os.environ.get(ENV_CONFIG)
    if not path:
        return []
    cp = configparser.ConfigParser()
    try:
        with open(path, encoding="utf-8") as f:
            cp.read_file(f)
        found = [Tiling(int(cp.get(s, "bm")), int(cp.get(s, "bk")), int(cp.get(s, "bmm")), f"{ENV_CONFIG}={path}")
                 for s in cp.sections() if int(cp.get(s, "m")) == M and int(cp.get(s, "k")) == K]
        for t in found:   # a tile size of 0 or less divided by zero below (an internal error)
            if min(t.BM, t.BK, t.bm) <= 0:
                raise ValueError(f"the tile sizes of {M}x{K} must be positive, not {t.label()}")
        return found
    except (OSError, ValueError, configparser.Error) as e:
        raise UnsupportedError(f"{ENV_CONFIG}={path}: not a readable kernel_config.ini ({e})") from None


# ---- sizes --------------------------------------------------------------------------------------------------
def tl1_code_bytes(M: int, K: int) -> int:
    return M * K // 4


def tl2_code_bytes(M: int, K: int) -> int:
    """T: the converter pads the TL2 codes of every tiling to this (its np.pad target; ggml_nbytes agrees)."""
    return (K - 256) * M // 3 * 5 // 8 + 256 * M // 2 * 4 // 8


def tensor_bytes(kind: str, M: int, K: int) -> int:
    """Bytes of a TL tensor in the file, its scale tail included (ggml_nbytes of the fork)."""
    if kind == "TL1":
        return tl1_code_bytes(M, K) + TAIL
    t = tl2_code_bytes(M, K)
    return -(-t // 32) * 32 + TAIL


def shape_ok(kind: str, M: int, K: int) -> bool:
    if kind == "TL1":
        return M % 16 == 0 and K % 8 == 0
    return K >= 256 and M % 32 == 0 and K % 32 == 0


# ---- the converter's permutations, undone --------------------------------------------------------------------
def _undo(y: np.ndarray, steps, final_shape) -> np.ndarray:
    """steps: the converter's (reshape shape, transpose axes) in the order it applies them; y: its result
    reshaped to the last step's shape. Returns the array it started from, as final_shape."""
    for shape, perm in reversed(steps):
        y = y.reshape([shape[p] for p in perm]).transpose(np.argsort(perm))
    return np.ascontiguousarray(y).reshape(final_shape)


def _tile_steps(M, K, BM, BY, bm, by, g):
    """The first four reshape/transposes shared by process_tl1 and both TL2 functions; g = weights per code."""
    return [((M // BM, BM, K // g), (0, 2, 1)),
            ((M // BM, K // BY, BY // g, BM), (0, 1, 3, 2)),
            ((M // BM, K // BY, BM // bm, bm, BY // g), (0, 1, 2, 4, 3)),
            ((M // BM, K // BY, BM // bm, BY // by, by // g, bm), (0, 1, 2, 3, 5, 4))]


def _nibbles(raw: np.ndarray) -> np.ndarray:
    return np.stack([raw >> 4, raw & 15], axis=-1)


def _unswap(raw: np.ndarray, bm: int) -> np.ndarray:
    """Undo `weight[:, [0, 1, 2, 3], :] = weight[:, [0, 2, 1, 3], :]` over rows of bm bytes (its own inverse)."""
    r = raw.reshape(-1, bm // 8, 8).copy()
    r[:, [1, 2]] = r[:, [2, 1]]
    return r.reshape(-1)


def _pairs_to_weights(codes: np.ndarray, M: int, K: int) -> np.ndarray:
    w = np.empty((M, K), np.int8)
    w[:, 0::2] = codes // 3
    w[:, 1::2] = codes % 3
    return w - np.int8(1)


def tl1_codes(raw: np.ndarray, M: int, K: int, t: Tiling) -> np.ndarray:
    """TL1 code bytes -> pair codes uint8 [M, K/2] (process_tl1 undone)."""
    BM, BY, bm = t.BM, t.BK, t.bm
    by = 256 // bm
    steps = _tile_steps(M, K, BM, BY, bm, by, 2) + [
        ((M // BM, K // BY, BM // bm, BY // by, bm // 16, 16, by // 2), (0, 1, 2, 3, 4, 6, 5)),
        ((M // BM, K // BY, BM // bm, BY // by, bm // 16, by // 4, 2, 16), (0, 1, 2, 3, 4, 5, 7, 6))]
    return _undo(_nibbles(raw[: M * K // 4]), steps, (M, K // 2))


def _tl2_parts(M: int, K: int, t: Tiling):
    """(K3, K2, bytes of triple codes, bytes of signs, bytes of pair codes), or None if the converter could not
    have written this tiling."""
    BM, BY, bm = t.BM, t.BK, t.bm
    if bm != 32 or BY <= 0 or BY % 24 or M % BM or BM % bm:
        return None
    K2 = K % BY
    K3 = K - K2
    if K3 == 0 or K2 % 32:
        return None
    parts = (K3, K2, M * K3 // 6, M * K3 // 24, M * K2 // 4)
    return parts if sum(parts[2:]) <= tl2_code_bytes(M, K) else None


def unusable(kind: str, M: int, K: int, t: Tiling) -> str | None:
    """Why bitnet.cpp's converter could not have tiled an M x K matrix of `kind` with t (None: it could)."""
    BM, BK, bm = t.BM, t.BK, t.bm
    if kind == "TL1":
        reasons = [(bm not in (32, 64), "bm is 32 or 64"), (M % BM, f"BM must divide M = {M}"),
                   (K % BK, f"BK must divide K = {K}"), (BM % bm, "bm must divide BM"),
                   (bm in (32, 64) and BK % (256 // max(bm, 1)), f"BK must be a multiple of {256 // max(bm, 1)}")]
    else:
        reasons = [(bm != 32, "bm is 32"), (BK % 24, "BK must be a multiple of 24"),
                   (M % BM, f"BM must divide M = {M}"), (BM % bm, "bm must divide BM"),
                   (BK > K, f"BK must be at most K = {K}"),
                   (BK <= K and K % BK % 32, f"K % BK must be a multiple of 32 (it is {K % BK})")]
    why = [text for bad, text in reasons if bad]
    if why:
        return "; ".join(why)
    if kind == "TL2" and _tl2_parts(M, K, t) is None:
        return "its parts would not fit the tensor's size"
    return None


def _tl2_split_fits(raw: np.ndarray, M: int, K: int, K2: int) -> bool:
    """Whether the bytes read as TL2 codes split at K - K2 keep the invariants no tiling changes (a permutation only
    moves nibbles): triple codes <= 13, pair codes <= 8, zero padding (the signs' check needs the tiling)."""
    K3 = K - K2
    n_idx, n_sign, n_two = M * K3 // 6, M * K3 // 24, M * K2 // 4
    end = n_idx + n_sign
    if K3 <= 0 or K3 % 24 or K2 % 32 or end + n_two > tl2_code_bytes(M, K):
        return False
    idx, two = raw[:n_idx], raw[end: end + n_two]
    return not (((idx >> 4) > 13).any() or ((idx & 15) > 13).any() or ((two >> 4) > 8).any()
                or ((two & 15) > 8).any() or raw[end + n_two: tl2_code_bytes(M, K)].any())


def _tl2_three(idx_raw, sign_raw, M, K3, BM, BY, bm=32):
    """Triple codes and signs of a [M, K3] block -> (|v| uint8 [M, K3/3], negative bool [M, K3/3])."""
    by = 192 // bm
    steps = _tile_steps(M, K3, BM, BY, bm, by, 3)
    mag = _undo(_nibbles(_unswap(idx_raw, bm)), steps, (M, K3 // 3))
    v = np.ascontiguousarray(sign_raw).view("<u2").reshape(-1, 1, bm // 2)
    bits = ((v >> np.arange(15, -1, -1, dtype=np.uint16).reshape(1, 16, 1)) & 1).astype(np.uint8)
    sign_steps = steps[:3] + [
        ((M // BM, K3 // BY, BM // bm, BY // (by * 4), by // 3 * 4, bm), (0, 1, 2, 3, 5, 4)),
        ((M // BM, K3 // BY, BM // bm, BY // (by * 4), bm, by // 3 * 4), (0, 1, 2, 3, 5, 4))]
    neg = _undo(bits, sign_steps, (M, K3 // 3)).astype(bool)
    return mag, neg


def _tl2_decode(raw: np.ndarray, M: int, K: int, t: Tiling):
    """-> (W int8 [M, K], number of broken invariants) for one tiling, or None when it cannot apply."""
    parts = _tl2_parts(M, K, t)
    if parts is None:
        return None
    K3, K2, n_idx, n_sign, n_two = parts
    mag, neg = _tl2_three(raw[:n_idx], raw[n_idx: n_idx + n_sign], M, K3, t.BM, t.BK)
    bad = int(np.count_nonzero(mag > 13)) + int(np.count_nonzero(neg & (mag == 0)))
    v = np.where(neg, -mag.astype(np.int8), mag.astype(np.int8)) + np.int8(13)
    w = np.empty((M, K), np.int8)
    w[:, :K3] = np.stack([v // 9, v // 3 % 3, v % 3], axis=-1).reshape(M, K3)
    end = n_idx + n_sign
    if K2:
        two = raw[end: end + n_two]
        steps = _tile_steps(M, K2, t.BM, 32, 32, 4, 2)
        codes = _undo(_nibbles(_unswap(two, 32)), steps, (M, K2 // 2))
        bad += int(np.count_nonzero(codes > 8))
        w[:, K3:] = _pairs_to_weights(np.minimum(codes, 8), M, K2) + np.int8(1)
    bad += int(np.count_nonzero(raw[end + n_two: tl2_code_bytes(M, K)]))
    return w - np.int8(1), bad


# ---- the entry point -------------------------------------------------------------------------------------------
def decode(kind: str, raw: np.ndarray, M: int, K: int, where: str, known: Tiling | None = None):
    """raw: the tensor's bytes (codes + tail). -> (W int8 [M, K] in {-1, 0, 1}, scale f32 [1], Tiling).
    known: the tiling already used for this shape in the same file (tried first)."""
    if not shape_ok(kind, M, K):
        raise UnsupportedError(f"{where}: {kind} tensor of shape {M}x{K} cannot come from bitnet.cpp's converter")
    ncode = tl1_code_bytes(M, K) if kind == "TL1" else tl2_code_bytes(M, K)
    scale_at = ncode if kind == "TL1" else -(-ncode // 32) * 32
    scale = np.frombuffer(raw[scale_at: scale_at + 4].tobytes(), "<f4").astype(np.float32)
    env = env_tilings(M, K)
    for t in env:   # the user's ini, for this shape: a tiling that cannot apply is its error, not a silent preset
        why = unusable(kind, M, K, t)
        if why:
            raise UnsupportedError(f"{where}: {t.source} tiles {M}x{K} as BM={t.BM} BK={t.BK} bm={t.bm}, which"
                                   f" bitnet.cpp's {kind} converter cannot use ({why})",
                                   hint=f"set {ENV_CONFIG} to the kernel_config.ini the file was converted with, or"
                                        " unset it for bitnet.cpp's presets")
    first = env or ([known] if known else [])
    presets = PRESETS[kind].get((M, K), [])
    tried = ", ".join(t.label() for t in presets) or "none"
    if kind == "TL1":
        cands = [t for t in first + presets if M % t.BM == 0 and K % t.BK == 0 and t.BM % t.bm == 0
                 and t.bm in (32, 64) and t.BK % (256 // t.bm) == 0]
        if not cands:
            raise UnsupportedError(
                f"{where}: TL1 tiling of a {M}x{K} matrix unknown (bitnet.cpp presets are for {preset_shapes('TL1')};"
                f" TL1 codes cannot tell tilings apart)", hint=f"set {ENV_CONFIG} to the kernel_config.ini the"
                " file was converted with")
        t = cands[0]
        codes = tl1_codes(raw, M, K, t)
        bad = int(np.count_nonzero(codes > 8))
        if bad:
            raise FormatError(f"{where}: TL1 tensor holds {bad} invalid codes (> 8): corrupt file?",
                              hint="if the file was downloaded, fetch it again")
        return _pairs_to_weights(codes, M, K), scale, t
    # TL2: the first candidate that keeps every invariant
    seen, best, splits = set(), None, set()
    for t in first + presets:
        if (t.BM, t.BK, t.bm) in seen:
            continue
        seen.add((t.BM, t.BK, t.bm))
        r = _tl2_decode(raw, M, K, t)
        if r is None:
            continue
        if r[1] == 0:
            return r[0], scale, t
        splits.add(K % t.BK)
        if best is None or r[1] < best[0]:
            best = (r[1], t)
    hint = f"set {ENV_CONFIG} to the kernel_config.ini the file was converted with"
    if best is None:
        raise UnsupportedError(f"{where}: no TL2 tiling fits a {M}x{K} matrix (presets tried: {tried})", hint=hint)
    # Which: a tiling that splits K elsewhere (its code, sign and pair regions overlap the file's), or bytes that
    # are broken. The regions of each split can be checked without the tiling: if only a split none of the
    # tilings tried has fits the bytes, the tiling is the cause; if a tried one fits (the breaks are in its signs)
    # or none does (broken bytes every split reads), the file is.
    others = [K2 for K2 in range(0, K, 32) if K2 not in splits and _tl2_split_fits(raw, M, K, K2)]
    if others and not any(_tl2_split_fits(raw, M, K, K2) for K2 in splits):
        raise UnsupportedError(f"{where}: no TL2 tiling fits a {M}x{K} matrix (presets tried: {tried}); its bytes"
                               f" read as a split at K % BK = {others[0]}, which none of them has", hint=hint)
    raise FormatError(f"{where}: TL2 tensor breaks its layout's invariants in {best[0]} places with tiling"
                      f" {best[1].label()}: corrupt file?",
                      hint="if the file was downloaded, fetch it again; if you made it, convert it again")
