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
import json
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
from make_models import DEFAULT_CACHE  # noqa: E402


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="0,1024,4096,16384")
    ap.add_argument("--kv", default="f16,q8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed per row")
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens timed per row")
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.simd import _kernels as K

    path = ensure_q4_store(a.cache)
    weights = store_bytes_per_token(path)
    store = Store(path)
    K.set_num_threads(a.threads)
    bw0 = stream_bandwidth(a.threads, mib=512, passes=3)["bandwidth_Bps"]
    rows = [row(store, kv, int(d), a) for d in a.depths.split(",") for kv in a.kv.split(",")]
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
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"weights_bytes": weights, "stream_Bps": [bw0, bw1], "threads": a.threads, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
