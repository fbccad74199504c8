"""The engine's packed weight layouts: the single definition shared by the converter, the kernels' tests
and the kernels themselves (simd/kernels/*.c implement exactly what is written here).

Ternary weights W_t[N, K] in {-1, 0, +1} are stored as 2-bit codes u = W_t + 1 in {0, 1, 2}
("tile16" layout). Rows are grouped in tiles of 16, columns in blocks of 16:

    N_pad = ceil(N / 16) * 16,   K_pad = ceil(K / 64) * 64
    tile t (rows 16t .. 16t+15), block b (cols 16b .. 16b+15) -> 64 bytes at ((t * K_pad/16) + b) * 64
    inside: byte r*4 + j (r = row in tile 0..15, j = 0..3), bits 2i..2i+1 (i = 0..3)
            hold u[16t + r, 16b + 4i + j]

Why: one 64-byte load, shifted right by 2i and masked with 3, gives 16 rows x 4 consecutive columns,
i.e. exactly the operand of one AVX-512 VNNI `vpdpbusd` against the 4 activation bytes
x[16b+4i .. 16b+4i+3] broadcast to every dword lane. Each lane accumulates one output row, so no
horizontal reduction is ever needed; AVX2 uses the two 32-byte halves (rows 0-7, 8-15) the same way.
A tile's blocks are contiguous, so a GEMV streams memory linearly. Padding codes are 1 (weight 0) and
padded activations are 0, so padding never changes a result.

The int8 LM head ("i8_tile16"): W_q[N, K] int8 in [-127, 127] with one f32 scale per row:
    tile t, group g (cols 4g .. 4g+3) -> 64 bytes at (t * K_pad/4 + g) * 64, byte r*4 + j = W_q[16t+r, 4g+j]

The f16 LM head ("f16_tile16"): tile t, column k -> 16 halves at (t * K + k) * 16, half r = W[16t+r, k].
Each row's dot product is accumulated strictly in order k = 0, 1, ..., K-1 with a fused multiply-add,
in every ISA path, so all paths give identical floats.

Kernel output for ternary and int8 (all paths, bit-identical):
    dot[n]  = sum_k W[n, k] * x_q[k]            (exact int32; ternary: sum u*x_q - sum x_q)
    out[n]  = ((float)dot[n] / act_scale) * row_scale[n]
where act_scale = 127 / max(max|x|, 1e-5) is the per-token activation scale (FORMATS.md §1) and
row_scale is the weight scale (mean|W| for autobitlinear; 1/scale for the legacy dividing class).
"""
from __future__ import annotations

import numpy as np

TILE_ROWS = 16
K_ALIGN = 64


def head_kind(layout: str | None) -> str:
    """The LM head a store's `output` layout holds: "i8", "q4", else "f16" (the --lm-head names)."""
    return {"i8_tile16": "i8", "q4g_tile16": "q4"}.get(layout or "", "f16")


def pad_to(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def padded_shape(n: int, k: int) -> tuple[int, int]:
    return pad_to(n, TILE_ROWS), pad_to(k, K_ALIGN)


def _ternary_matrix(w_t, who: str) -> np.ndarray:
    """w_t as an array, checked to be a 2-D matrix of values in {-1, 0, +1} (ValueError naming `who` if not)."""
    w_t = np.asarray(w_t)
    if w_t.ndim != 2:
        raise ValueError(f"{who}: expected a 2-D matrix, got shape {w_t.shape}")
    if w_t.size and (w_t.min() < -1 or w_t.max() > 1):
        raise ValueError(f"{who}: weights must be in {{-1, 0, +1}}")
    return w_t


def pack_ternary(w_t: np.ndarray) -> np.ndarray:
    """W_t int [N, K] in {-1,0,1} -> uint8 [N_pad * K_pad / 4] in the tile16 layout."""
    w_t = _ternary_matrix(w_t, "pack_ternary")
    return np.ascontiguousarray(_tile16_blocks(_codes(w_t))).reshape(-1)


def _codes(w_t: np.ndarray) -> np.ndarray:
    """u = W_t + 1 as uint8 [N_pad, K_pad], padding code 1 (weight 0)."""
    n, k = w_t.shape
    n_pad, k_pad = padded_shape(n, k)
    codes = np.ones((n_pad, k_pad), dtype=np.uint8)
    codes[:n, :k] = (w_t + 1).astype(np.uint8)
    return codes


def _tile16_blocks(codes: np.ndarray) -> np.ndarray:
    """Codes [N_pad, 16 * nb] -> the tile16 blocks [N_pad / 16, nb, 64] (byte r*4 + j, bits 2i: column 4i + j)."""
    n_pad, cols = codes.shape
    c = codes.reshape(n_pad // 16, 16, cols // 16, 4, 4).transpose(0, 2, 1, 4, 3)  # [t, b, r, j, i]
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).reshape(n_pad // 16, cols // 16, 64)


def unpack_ternary(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of pack_ternary: int8 [N, K] in {-1, 0, +1}."""
    n_pad, k_pad = padded_shape(n, k)
    p = np.asarray(packed, dtype=np.uint8).reshape(n_pad // 16, k_pad // 16, 16, 4)  # [t, b, r, j]
    c = np.stack([(p >> (2 * i)) & 3 for i in range(4)], axis=-1)  # [t, b, r, j, i]
    codes = c.transpose(0, 2, 1, 4, 3).reshape(n_pad, k_pad)
    return (codes[:n, :k].astype(np.int8) - 1)


def pack_i8(w_q: np.ndarray) -> np.ndarray:
    """int8 [N, K] -> int8 [N_pad * K_pad] in the i8_tile16 layout (padding 0)."""
    n, k = w_q.shape
    n_pad, k_pad = padded_shape(n, k)
    buf = np.zeros((n_pad, k_pad), dtype=np.int8)
    buf[:n, :k] = w_q
    c = buf.reshape(n_pad // 16, 16, k_pad // 4, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(c).reshape(-1)


def unpack_i8(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    n_pad, k_pad = padded_shape(n, k)
    c = np.asarray(packed, dtype=np.int8).reshape(n_pad // 16, k_pad // 4, 16, 4).transpose(0, 2, 1, 3)
    return c.reshape(n_pad, k_pad)[:n, :k]


def quantize_rows_i8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8 (range [-127, 127], round half to even): returns (W_q int8 [N, K], scale f32 [N])
    with W ~= W_q * scale[:, None]."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = (np.maximum(amax, np.float32(1e-10)) / np.float32(127)).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def pack_f16(w: np.ndarray) -> np.ndarray:
    """float [N, K] -> float16 [N_pad * K] in the f16_tile16 layout (padding rows 0)."""
    n, k = w.shape
    n_pad = pad_to(n, TILE_ROWS)
    buf = np.zeros((n_pad, k), dtype=np.float16)
    buf[:n] = w
    return np.ascontiguousarray(buf.reshape(n_pad // 16, 16, k).transpose(0, 2, 1)).reshape(-1)


def unpack_f16(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    n_pad = pad_to(n, TILE_ROWS)
    return np.asarray(packed, dtype=np.float16).reshape(n_pad // 16, k, 16).transpose(0, 2, 1).reshape(n_pad, k)[:n]


# ---- the group-quantized LM head ("q4g_tile16", simd/kernels/gemv_q4g.c) -----------------------------------
# W[N, K] ~= d[n] * s[n, g] * q[n, k]: q int4 in [-8, 7], s a 6-bit integer scale (0..63) per row and group of
# Q4G_GROUP = 32 columns, d one f32 per row (Q4_K's two-level scales, kept integer so every ISA path gives the
# same bits):  dot[n] = sum_g s[n,g] * sum_{k in g} q[n,k] * x_q[k]   (exact int32: |dot| < 2^29 for K <= 8192)
#              out[n] = ((float)dot[n] / act_scale) * d[n]
# Codes: tile t (rows 16t..16t+15), group g, quarter j (0..3) -> 64 bytes at ((t * G + g) * 4 + j) * 64,
#   byte r*4 + c: low nibble q[16t+r, 32g+8j+c] + 8, high nibble q[16t+r, 32g+8j+4+c] + 8  (G = K_pad / 32)
#   i.e. each nibble plane of a quarter is one vpdpbusd operand (16 rows x 4 columns), like i8_tile16.
# Group scales: u8, tile t, group g -> 16 bytes at (t * G + g) * 16, byte r = s[16t+r, g]. 0.53 bytes/weight
# in all (int8 head: 1.0, f16: 2.0).
Q4G_GROUP = 32
Q4G_MAX_K = 8192
Q4G_STEP_SEARCH = (1.0, 1.05, 1.1, 1.15, 1.2, 1.3)  # candidate amax / (7 f) steps per group


def quantize_rows_q4g(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float [N, K] -> (q int8 [N, K_pad] in [-8, 7], s uint8 [N, K_pad/32] in 0..63, d f32 [N]), round half
    to even; columns beyond K are 0."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    k_pad = pad_to(k, K_ALIGN)
    wp = np.zeros((n, k_pad), np.float32)
    wp[:, :k] = w
    g = wp.reshape(n, k_pad // Q4G_GROUP, Q4G_GROUP)
    amax = np.abs(g).max(axis=2)                                                  # [N, G]
    # per group, the step (among amax / (7 * f)) with the least squared error: clipping the few largest
    # weights buys finer steps for the rest (bench/head_quality.py, bundled model: top-1
    # agreement with f16 94.1% -> 95.1%, KL 1.1e-3 -> 7.4e-4)
    best_err = best = None
    for f in Q4G_STEP_SEARCH:
        st = (amax / np.float32(7 * f)).astype(np.float32)
        safe = np.where(st > 0, st, np.float32(1))[:, :, None]
        err = ((np.clip(np.rint(g / safe), -8, 7) * safe - g) ** 2).sum(axis=2)
        if best is None:
            best, best_err = st, err
        else:
            better = err < best_err
            best, best_err = np.where(better, st, best), np.where(better, err, best_err)
    step = best.astype(np.float32)
    d = (np.maximum(step.max(axis=1), np.float32(1e-10)) / np.float32(63)).astype(np.float32)
    s = np.clip(np.rint(step / d[:, None]), 0, 63)
    s = np.where(step > 0, np.maximum(s, 1), 0).astype(np.uint8)
    eff = (d[:, None] * s.astype(np.float32)).astype(np.float32)                # [N, G] actual step
    safe = np.where(eff > 0, eff, np.float32(1))
    q = np.clip(np.rint(g / safe[:, :, None]), -8, 7)
    q = np.where(eff[:, :, None] > 0, q, 0).astype(np.int8).reshape(n, k_pad)
    return q, s, d


def dequantize_q4g(q: np.ndarray, s: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The weights a q4g head stands for: float32 [N, K_pad]."""
    n, k_pad = q.shape
    g = q.reshape(n, k_pad // Q4G_GROUP, Q4G_GROUP).astype(np.float32)
    return (g * (d[:, None] * s.astype(np.float32))[:, :, None]).reshape(n, k_pad)


def pack_q4g(q: np.ndarray) -> np.ndarray:
    """int8 [N, K_pad] in [-8, 7] -> uint8 [N_pad * K_pad / 2] codes (padding rows: code 8 = weight 0)."""
    n, k_pad = q.shape
    n_pad = pad_to(n, TILE_ROWS)
    u = np.full((n_pad, k_pad), 8, np.uint8)
    u[:n] = (q.astype(np.int16) + 8).astype(np.uint8)
    # [t, r, g, j, half, c] -> [t, g, j, r, c, half]
    c = u.reshape(n_pad // 16, 16, k_pad // 32, 4, 2, 4).transpose(0, 2, 3, 1, 5, 4)
    return np.ascontiguousarray(c[..., 0] | (c[..., 1] << 4)).reshape(-1)


def unpack_q4g(packed: np.ndarray, n: int, k_pad: int) -> np.ndarray:
    n_pad = pad_to(n, TILE_ROWS)
    p = np.asarray(packed, np.uint8).reshape(n_pad // 16, k_pad // 32, 4, 16, 4)   # [t, g, j, r, c]
    u = np.stack([p & 15, p >> 4], axis=-1)                                          # [t, g, j, r, c, half]
    return (u.transpose(0, 3, 1, 2, 5, 4).reshape(n_pad, k_pad)[:n].astype(np.int8) - 8)


def pack_q4g_scales(s: np.ndarray) -> np.ndarray:
    """uint8 [N, G] -> uint8 [N_pad * G] (tile t, group g -> 16 bytes, one per row; padding rows 0)."""
    n, groups = s.shape
    n_pad = pad_to(n, TILE_ROWS)
    buf = np.zeros((n_pad, groups), np.uint8)
    buf[:n] = s
    return np.ascontiguousarray(buf.reshape(n_pad // 16, 16, groups).transpose(0, 2, 1)).reshape(-1)


# ---- group-scaled ternary weights ("tg128", simd/kernels/gemv_tg.c): the Ternary Bonsai models ---------------
# W[N, K] = scale[n, g] * t[n, k], t in {-1, 0, +1}, one f16 scale per row and group of TG_GROUP = 128 columns
# (GGUF Q2_0). K must be a multiple of 128 (every Qwen3 size is). Tile t (rows 16t..16t+15), group g ->
# TG_GROUP_BYTES = 544 bytes at (t * K/128 + g) * 544: first the 16 rows' scales (f16, row r at byte 2r), then
# 8 tile16 blocks (columns 128g + 16b .. +15, b = 0..7; the tile16 block format above). One sequential stream of
# 2.125 bits per weight. Activations are quantized per group of 128 too (quantize_act_g128):
#     dot_g[n] = sum_{k in g} t[n, k] * x_q[k]                      (exact int32)
#     acc = 0; for g in order: acc = acc + (float)dot_g[n] * (scale[n, g] * x_d[g])   (f32, never fused)
TG_GROUP = 128
TG_GROUP_BYTES = 544


def pack_tg128(w_t: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """W_t int [N, K] in {-1,0,1} and scales f16 [N, K/128] -> uint8 [N_pad/16 * K/128 * 544] (padding rows:
    weight 0, scale 0)."""
    w_t = np.asarray(w_t)
    n, k = w_t.shape
    if k % TG_GROUP:
        raise ValueError(f"pack_tg128: {k} columns is not a multiple of {TG_GROUP}")
    groups = k // TG_GROUP
    scales = np.asarray(scales, np.float16)
    if scales.shape != (n, groups):
        raise ValueError(f"pack_tg128: scales {scales.shape}, expected {(n, groups)}")
    n_pad = pad_to(n, TILE_ROWS)
    blocks = pack_ternary(w_t).reshape(n_pad // 16, groups, 8 * 64)               # tile16: [t, b(16 cols), 64]
    sc = np.zeros((n_pad, groups), np.float16)
    sc[:n] = scales
    sc = np.ascontiguousarray(sc.reshape(n_pad // 16, 16, groups).transpose(0, 2, 1)).view(np.uint8)  # [t, g, 32]
    return np.ascontiguousarray(np.concatenate([sc, blocks], axis=2)).reshape(-1)


def unpack_tg128(packed: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_tg128: (W_t int8 [N, K], scales f16 [N, K/128])."""
    n_pad, groups = pad_to(n, TILE_ROWS), k // TG_GROUP
    p = np.asarray(packed, np.uint8).reshape(n_pad // 16, groups, TG_GROUP_BYTES)
    sc = np.ascontiguousarray(p[:, :, :32]).view(np.float16).reshape(n_pad // 16, groups, 16)
    scales = sc.transpose(0, 2, 1).reshape(n_pad, groups)[:n]
    return unpack_ternary(np.ascontiguousarray(p[:, :, 32:]).reshape(-1), n, k), scales


def tg128_bytes(n: int, k: int) -> int:
    return pad_to(n, TILE_ROWS) // 16 * (k // TG_GROUP) * TG_GROUP_BYTES


# ---- base-3 ternary weights ("tile16b3", simd/kernels/gemv_b3.c): 1.6 bits per weight -------------------------
# The same matrix as tile16 (same N_pad, K_pad, codes u = W_t + 1, padding code 1), with every run of 5 tile16
# blocks of a tile (a "superblock": 80 columns) stored as 256 bytes of base-3 digits instead of 320 bytes of
# 2-bit codes. A tile's kb = K_pad/16 blocks are ns = kb // 5 superblocks followed by the kb % 5 remaining blocks
# in the tile16 format, so a tile is B3_SUPER_BYTES * ns + 64 * (kb % 5) bytes (tile16b3_tile_bytes).
# Superblock s, plane p (0..3) -> 64 bytes at s*256 + p*64; byte r*4 + j holds the codes of row 16t+r in the
# columns 16*(5s+i) + 4p + j, i = 0..4 (the plane-p operand of tile16 blocks 5s..5s+4):
#     v = sum_i u_i * 3^(4-i)  (0..242),   byte q = ceil(v * 256 / 243)   (TQ1_0's fixed-point form)
# Decoding without division: m_0 = q, m_{i+1} = 3 m_i mod 256, and u_i = (3 m_i - m_{i+1}) / 256 exactly, so a
# row's dot over a trit plane is (3 * (m_i . x) - (m_{i+1} . x)) / 256: two u8 x s8 dot products, no unpacking.
B3_SUPER_BLOCKS = 5
B3_SUPER_BYTES = 256


def tile16b3_tile_bytes(k_pad: int) -> int:
    kb = k_pad // 16
    return kb // B3_SUPER_BLOCKS * B3_SUPER_BYTES + kb % B3_SUPER_BLOCKS * 64


def tile16b3_bytes(n: int, k: int) -> int:
    n_pad, k_pad = padded_shape(n, k)
    return n_pad // 16 * tile16b3_tile_bytes(k_pad)


def pack_ternary_b3(w_t: np.ndarray) -> np.ndarray:
    """W_t int [N, K] in {-1,0,1} -> uint8 [tile16b3_bytes(N, K)] in the tile16b3 layout."""
    w_t = _ternary_matrix(w_t, "pack_ternary_b3")
    codes = _codes(w_t)
    n_pad, k_pad = codes.shape
    t, kb = n_pad // 16, k_pad // 16
    ns = kb // B3_SUPER_BLOCKS
    c = codes[:, :ns * 80].reshape(t, 16, ns, 5, 4, 4).transpose(0, 2, 4, 1, 5, 3)   # [t, s, p, r, j, i]
    v = np.zeros(c.shape[:-1], np.int32)
    for i in range(5):
        v = v * 3 + c[..., i]
    q = ((v * 256 + 242) // 243).astype(np.uint8).reshape(t, ns * B3_SUPER_BYTES)
    tail = _tile16_blocks(codes[:, ns * 80:]).reshape(t, -1)   # the last kb % 5 blocks stay tile16
    return np.ascontiguousarray(np.concatenate([q, tail], axis=1)).reshape(-1)


def unpack_ternary_b3(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of pack_ternary_b3: int8 [N, K] in {-1, 0, +1} (decoded the way the kernels do)."""
    n_pad, k_pad = padded_shape(n, k)
    t, kb = n_pad // 16, k_pad // 16
    ns = kb // B3_SUPER_BLOCKS
    p = np.asarray(packed, np.uint8).reshape(t, -1)
    m = p[:, :ns * B3_SUPER_BYTES].reshape(t, ns, 4, 16, 4).astype(np.int32)     # [t, s, p, r, j]
    trits = []
    for _ in range(5):
        m3 = 3 * m
        trits.append((m3 - (m3 & 255)) >> 8)
        m = m3 & 255
    c = np.stack(trits, axis=-1).transpose(0, 3, 1, 5, 2, 4).reshape(n_pad, ns * 80)   # [t, r, s, i, p, j]
    tb = p[:, ns * B3_SUPER_BYTES:].reshape(t, kb % B3_SUPER_BLOCKS, 16, 4)                    # tile16 [t, b, r, j]
    tail = np.stack([(tb >> (2 * i)) & 3 for i in range(4)], axis=-1).transpose(0, 2, 1, 4, 3).reshape(n_pad, -1)
    return (np.concatenate([c, tail], axis=1)[:n, :k].astype(np.int8) - 1)
