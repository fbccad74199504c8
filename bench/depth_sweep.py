"""Decode and prefill at depth with the f16 and the int8 (--kv q8) KV cache, against the streaming-read limit.

    python bench/depth_sweep.py [--depths 0,1024,4096,16384] [--threads 2] [--tokens 16] [--prefill 256]

The synthetic 2B-4T-shaped store (bench/make_models.py; q4 head, as `bitnet run` uses). A row at depth d: the
cache holds d positions (filled with non-zero bytes, so every page is real memory: a never-written np.zeros page
would be the kernel's one zero page, always in cache), then
  decode  : `--tokens` decode steps at positions d.. (tok/s),
  prefill : one `--prefill`-token prompt chunk at positions d.. (tok/s; a long prompt's later chunks cost this),
and each decode row's limit: stream rate / (weight bytes + d x KV bytes per token) and the share of it reached.
The stream rate is bench/limits.py's, measured in the same process before and after the rows (the lower is
used). Each row is one short run on a shared machine: compare rows of one run, not runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(ROOT))

from decode_rows import ensure_q4_store, store_bytes_per_token  # noqa: E402
from limits import stream_bandwidth  # noqa: E402
from make_models import DEFAULT_CACHE, save_json  # noqa: E402


def fill_cache(model):
    """Every byte of the KV cache written (pages real; values harmless: small f16 / int8 with tiny scales)."""
    if model.kv_dtype == "f16":
        model._k_cache.fill(0x2000), model._v_cache.fill(0x2000)
    elif model.kv_dtype == "q8":
        model._k_cache.fill(1), model._v_cache.fill(1)
    else:
        model._k_cache.fill(1e-3), model._v_cache.fill(1e-3)


def row(store, kv: str, depth: int, a) -> dict:
    from bitnet_cpu.engine.runtime.model import Model, kv_bytes_per_token

    ids = np.random.default_rng(depth).integers(100, 1000, max(a.prefill, a.tokens) + 1).tolist()
    m = Model(store, n_ctx=depth + max(a.prefill, a.tokens) + 2, kv_dtype=kv, threads=a.threads)
    fill_cache(m)
    m.n_past = depth                      # positions 0..depth-1 count as cached
    m.decode(ids[0])                      # warm: first-touch of the run state, thread pool up
    t0 = time.perf_counter()
    for t in ids[1: a.tokens + 1]:
        m.decode(t)
    dec = a.tokens / (time.perf_counter() - t0)
    m.truncate(depth)
    t0 = time.perf_counter()
    m.prefill(ids[: a.prefill])
    pre = a.prefill / (time.perf_counter() - t0)
    return {"kv": kv, "depth": depth, "decode_tps": dec, "prefill_tps": pre,
            "kv_bytes_per_token_read": depth * kv_bytes_per_token(store.config, kv)}


def ab_decode(store, depth: int, a, rounds: int = 12, steps: int = 2) -> dict:
    """f16 and q8 decode at one depth, alternating short rounds (two sessions in memory), so both see the same
    machine load; median seconds per token of each."""
    from bitnet_cpu.engine.runtime.model import Model

    models = {}
    for kv in ("f16", "q8"):
        m = models[kv] = Model(store, n_ctx=depth + rounds * steps + 4, kv_dtype=kv, threads=a.threads)
        fill_cache(m)
        m.n_past = depth
        m.decode(7)
    times = {kv: [] for kv in models}
    for r in range(rounds):
        for kv in (("f16", "q8") if r % 2 == 0 else ("q8", "f16")):
            t0 = time.perf_counter()
            for _ in range(steps):
                models[kv].decode(7)
            times[kv].append((time.perf_counter() - t0) / steps)
    med = {kv: sorted(t)[len(t) // 2] for kv, t in times.items()}
    return {"depth": depth, "f16_tps": 1 / med["f16"], "q8_tps": 1 / med["q8"], "q8_over_f16": med["f16"] / med["q8"]}


def attention_layer(kv: str, depth: int, threads: int, reps: int = 20) -> dict:
    """One 2B-4T layer's decode attention alone (20 heads, 5 KV heads x 128) at `depth`: median time per call and
    the rate at which it reads the layer's K and V (a cache filled with non-zero bytes)."""
    from bitnet_cpu.simd import _ops as ops

    nh, nkv, hd, n_ctx = 20, 5, 128, depth + 1
    rng = np.random.default_rng(0)
    inv = 1.0 / (500000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    fr = np.arange(n_ctx, dtype=np.float32)[:, None] * inv[None]
    cos, sin = np.cos(fr).astype(np.float32), np.sin(fr).astype(np.float32)
    scr = np.zeros((threads * ops.ATTENTION_SCRATCH_ROWS, n_ctx), np.float32)
    out = np.zeros((1, nh * hd), np.float32)
    if kv == "q8":
        kc, vc = (np.full(ops.q8_cache_shape(nkv, n_ctx, hd), 1, np.int8) for _ in range(2))
        call = lambda q: ops.attention_q8(q, nh, nkv, hd, cos, sin, depth, n_ctx, kc, vc, out, scr)  # noqa: E731
        nbytes = 2 * nkv * depth * (hd + 4)
    else:
        kc = np.full(ops.key_cache_shape(nkv, n_ctx, hd), 0x2000, np.uint16)
        vc = np.full((nkv, n_ctx, hd), 0x2000, np.uint16)
        call = lambda q: ops.attention(q, nh, nkv, hd, cos, sin, depth, kc, vc, out, scr)  # noqa: E731
        nbytes = 2 * nkv * depth * hd * 2
    qkv = rng.standard_normal((1, (nh + 2 * nkv) * hd)).astype(np.float32)
    times = []
    for _ in range(reps):
        q = qkv.copy()
        t0 = time.perf_counter()
        call(q)
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    return {"kv": kv, "depth": depth, "us": t * 1e6, "GBps": nbytes / t / 1e9}


def _table(title: str, header, rows) -> None:
    """A titled markdown table on stdout."""
    print(f"\n{title}:")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="0,1024,4096,16384")
    ap.add_argument("--kv", default="f16,q8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed per row")
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens timed per row")
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--attention", default="1024,4096", help="depths of the one-layer attention rows ('' for none)")
    ap.add_argument("--ab", default="4096", help="depths of the alternating f16 / q8 decode rows ('' for none)")
    a = ap.parse_args(argv)
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.simd import _kernels as K

    path = ensure_q4_store(a.cache)
    weights = store_bytes_per_token(path)
    store = Store(path)
    K.set_num_threads(a.threads)
    bw0 = stream_bandwidth(a.threads, mib=512, passes=3)["bandwidth_Bps"]
    rows = [row(store, kv, int(d), a) for d in a.depths.split(",") for kv in a.kv.split(",")]
    ab = [ab_decode(store, int(d), a) for d in a.ab.split(",") if d]
    att = [attention_layer(kv, int(d), a.threads) for d in a.attention.split(",") if d for kv in a.kv.split(",")]
    bw1 = stream_bandwidth(a.threads, mib=512, passes=3)["bandwidth_Bps"]
    bw = min(bw0, bw1)
    print(f"{path}: {weights / 1e9:.3f} GB read per token (weights + q4 head), {a.threads} threads, path "
          f"{K.active()}; stream {bw0 / 1e9:.1f} / {bw1 / 1e9:.1f} GB/s (before / after)")
    print("| KV | depth | decode tok/s | limit tok/s | share | prefill tok/s (pp%d at depth) |" % a.prefill)
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["limit_tps"] = bw / (weights + r["kv_bytes_per_token_read"])
        r["share"] = r["decode_tps"] / r["limit_tps"]
        print(f"| {r['kv']} | {r['depth']} | {r['decode_tps']:.1f} | {r['limit_tps']:.1f} | {r['share']:.0%} | "
              f"{r['prefill_tps']:.0f} |")
    if ab:
        _table("f16 and q8 decode alternating (12 rounds of 2 tokens each, median)",
               ("depth", "f16 tok/s", "q8 tok/s", "q8 / f16"),
               [(r["depth"], f"{r['f16_tps']:.1f}", f"{r['q8_tps']:.1f}", f"{r['q8_over_f16']:.2f}") for r in ab])
    if att:
        _table("one layer's decode attention (20 heads, 5 KV heads x 128), median of 20 calls",
               ("KV", "depth", "us per layer", "K+V read GB/s", "share of stream"),
               [(r["kv"], r["depth"], f"{r['us']:.0f}", f"{r['GBps']:.1f}", f"{r['GBps'] * 1e9 / bw:.0%}") for r in att])
    save_json(a.json, {"weights_bytes": weights, "stream_Bps": [bw0, bw1], "threads": a.threads, "rows": rows,
                       "attention": att, "ab": ab})
    return 0


if __name__ == "__main__":
    sys.exit(main())
