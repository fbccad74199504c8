"""Decode attention when the softmax is peaked: most positions' weights far below the largest.

    python bench/attention_peaked.py [--depth 4096] [--threads 2] [--reps 40] [--zero-top]

One 2B-4T layer's decode attention (20 heads, 5 KV heads x 128, f16 K/V) at `--depth` positions, RoPE off, keys
built so that two positions share the top score and every other one scores `gap` below it: a weight of
exp(-gap) / 2. Gap 80 gives weights near 9e-36 (normal floats); gap 87 gives 8e-39, under FLT_MIN (subnormal), which
Intel cores handle with a microcode assist on each FMA it enters unless the kernel makes it 0 first. Both gaps do
the same work otherwise, so their time ratio is the cost of subnormal weights (1.0: none). Prints the median,
min and max microseconds per call of each and the ratio; calls go round enough caches (64 MB) that each finds
its cache in memory, as a decode step does. Compare the two rows of one run, not runs. Values are 2^-7 everywhere
(an output near 2^-7: every partial sum is normal), or with --zero-top 0 at the two top positions (at gap 87 every
output is a sum of subnormal products only, subnormal itself until enough of them add past FLT_MIN).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

NH, NKV, HD = 20, 5, 128


def layer(depth: int, gap: float, threads: int, n_caches: int, zero_top: bool):
    """The call and its caches: keys' first dimension +1 at positions 0 and 1, -1 after (f16), the rest 2^-7; the
    query's first dimension scaled so the scores are +-gap / 2; values 2^-7 (0 at positions 0 and 1: zero_top)."""
    from bitnet_cpu.simd import _ops as ops

    n_ctx = depth + 1
    cos, sin = np.ones((n_ctx, HD // 2), np.float32), np.zeros((n_ctx, HD // 2), np.float32)
    scr = np.zeros((threads * ops.ATTENTION_SCRATCH_ROWS, n_ctx), np.float32)
    out = np.zeros((1, NH * HD), np.float32)
    caches = []
    for _ in range(n_caches):
        kc = np.full(ops.key_cache_shape(NKV, n_ctx, HD), 0x2000, np.uint16)   # [kv, block, dim, position]
        kc[:, :, 0, :] = np.float16(-1).view(np.uint16)        # a view: every position's first dimension
        kc[:, 0, 0, :2] = np.float16(1).view(np.uint16)        # positions 0 and 1 (block 0)
        vc = np.full((NKV, n_ctx, HD), 0x2000, np.uint16)
        if zero_top:
            vc[:, :2] = 0
        caches.append((kc, vc))
    qkv = np.zeros((1, (NH + 2 * NKV) * HD), np.float32)
    qkv[0, : NH * HD].reshape(NH, HD)[:, 0] = gap / 2 * np.sqrt(HD)
    qkv[0, NH * HD: (NH + NKV) * HD].reshape(NKV, HD)[:, 0] = -1   # the new position's key: low too

    def call(kc, vc):
        ops.attention(qkv.copy(), NH, NKV, HD, cos, sin, depth, kc, vc, out, scr)

    return call, caches, out


def time_gap(depth: int, gap: float, threads: int, reps: int, zero_top: bool) -> dict:
    nbytes = 2 * NKV * depth * HD * 2
    n_caches = max(2, min(reps, -(-(64 << 20) // nbytes)))
    call, caches, _ = layer(depth, gap, threads, n_caches, zero_top)
    call(*caches[0])   # warm: the thread pool up, pages touched
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        call(*caches[i % n_caches])
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"gap": gap, "us": times[reps // 2] * 1e6, "us_min": times[0] * 1e6, "us_max": times[-1] * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--zero-top", action="store_true", help="values 0 at the two top positions (outputs: sums of the small weights' products only)")
    a = ap.parse_args(argv)
    if a.depth < 2 or a.threads < 1 or a.reps < 1:
        ap.error("--depth must be at least 2, --threads and --reps at least 1")
    from bitnet_cpu.simd import _kernels as K

    K.set_num_threads(a.threads)
    rows = [time_gap(a.depth, g, a.threads, a.reps, a.zero_top) for g in (80.0, 87.0)]
    print(f"path {K.active()}, {a.threads} threads, depth {a.depth}, f16 K/V, {a.reps} calls each, "
          f"values {'0 at the top positions' if a.zero_top else '2^-7'}")
    print("| gap | weights | us per call median (min / max) |")
    print("|---|---|---|")
    for r, kind in zip(rows, ("normal (9e-36)", "subnormal (8e-39)")):
        print(f"| {r['gap']:.0f} | {kind} | {r['us']:.0f} ({r['us_min']:.0f} / {r['us_max']:.0f}) |")
    print(f"subnormal / normal: {rows[1]['us'] / rows[0]['us']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
