"""Decode and prefill at depth with the f16 and the int8 (--kv q8) KV cache, against the streaming-read limit.

    python bench/depth_sweep.py [--depths 0,1024,4096,16384] [--threads 2] [--tokens 16] [--prefill 256]
    python bench/depth_sweep.py --long 512,4096 [--rounds 2]      # whole prompts from an empty cache only
    python bench/depth_sweep.py --prefill-attention 0,3968 [--chunk 128]   # one layer's prompt-chunk attention,
                                                                            # f16 also against the f32 FMA peak

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

N_HEADS, N_KV, HEAD_DIM = 20, 5, 128   # the 2B-4T layer the one-layer attention rows run


def fill_cache(model):
    """Every byte of the KV cache written (pages real), with values as small as real ones and no smaller: f16
    2^-7; int8 1 with the scale 1/127 in each block's 32 scales (bytes of 1 there were scales of 2.4e-38, which
    made every softmax weight x scale subnormal: Intel cores slowed 8x on them, not what a real cache does)."""
    if model.kv_dtype == "f16":
        model._k_cache.fill(0x2000), model._v_cache.fill(0x2000)
    elif model.kv_dtype == "q8":
        from bitnet_cpu.simd import _ops as ops

        nb = 4 * ops.KEY_BLOCK    # a block: KEY_BLOCK x head_dim int8 values, then KEY_BLOCK f32 scales
        for c in (model._k_cache, model._v_cache):
            c[..., :-nb] = 1
            c[..., -nb:].view(np.float32)[...] = np.float32(1 / 127)
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


def long_prompts(store, a) -> list[dict]:
    """Whole prompts of each `--long` length from an empty cache (the first length, pp512, is the reference), f16
    and q8 sessions alternating over `--rounds` rounds so both see the same load; tok/s min / median / max."""
    from bitnet_cpu.engine.runtime.model import Model

    lens = [int(x) for x in a.long.split(",") if x]
    kvs = a.kv.split(",")
    ids = np.random.default_rng(1).integers(100, 1000, max(lens)).tolist()
    models = {kv: Model(store, n_ctx=max(lens) + 2, kv_dtype=kv, threads=a.threads) for kv in kvs}
    for m in models.values():
        m.prefill(ids[:8])                # warm: first-touch of the run state, thread pool up
    tps = {(kv, n): [] for kv in kvs for n in lens}
    for r in range(a.rounds):
        for n in lens:
            for kv in (kvs if r % 2 == 0 else kvs[::-1]):
                m = models[kv]
                m.reset()
                t0 = time.perf_counter()
                m.prefill(ids[:n])
                tps[kv, n].append(n / (time.perf_counter() - t0))
    rows = []
    for (kv, n), v in tps.items():
        v = sorted(v)
        ref = sorted(tps[kv, lens[0]])[len(v) // 2]
        rows.append({"kv": kv, "prompt": n, "min": v[0], "median": v[len(v) // 2], "max": v[-1],
                     "over_first": v[len(v) // 2] / ref})
    return rows


def _layer_attention(kv: str, depth: int, rows: int, threads: int, n_caches: int):
    """One 2B-4T layer's attention (20 heads, 5 KV heads x 128) for `rows` query rows at positions depth..:
    the call, `n_caches` (K, V) caches to go round (filled with non-zero bytes) and the QKV rows to copy into
    each call (the call ropes them in place)."""
    from bitnet_cpu.simd import _ops as ops

    nh, nkv, hd, n_ctx = N_HEADS, N_KV, HEAD_DIM, depth + rows
    rng = np.random.default_rng(0)
    inv = 1.0 / (500000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    fr = np.arange(n_ctx, dtype=np.float32)[:, None] * inv[None]
    cos, sin = np.cos(fr).astype(np.float32), np.sin(fr).astype(np.float32)
    scr = np.zeros((threads * ops.ATTENTION_SCRATCH_ROWS, n_ctx), np.float32)
    out = np.zeros((rows, nh * hd), np.float32)
    if kv == "q8":
        caches = [[np.full(ops.q8_cache_shape(nkv, n_ctx, hd), 1, np.int8) for _ in range(2)] for _ in range(n_caches)]
        call = lambda q, kc, vc: ops.attention_q8(q, nh, nkv, hd, cos, sin, depth, n_ctx, kc, vc, out, scr)  # noqa: E731
    else:
        caches = [[np.full(ops.key_cache_shape(nkv, n_ctx, hd), 0x2000, np.uint16),
                   np.full((nkv, n_ctx, hd), 0x2000, np.uint16)] for _ in range(n_caches)]
        call = lambda q, kc, vc: ops.attention(q, nh, nkv, hd, cos, sin, depth, kc, vc, out, scr)  # noqa: E731
    qkv = rng.standard_normal((rows, (nh + 2 * nkv) * hd)).astype(np.float32)
    return call, caches, qkv


def attention_layer(kv: str, depth: int, threads: int, reps: int = 20) -> dict:
    """One 2B-4T layer's decode attention alone (20 heads, 5 KV heads x 128) at `depth`: min / median / max time
    per call and the rate at which it reads the layer's K and V (a cache filled with non-zero bytes). Calls go round
    enough layers' caches (at least 64 MB in all, as many as `reps` allows) that a call finds its cache in memory
    rather than in L3, as a decode step does (30 layers of it)."""
    nkv, hd = N_KV, HEAD_DIM
    nbytes = 2 * nkv * depth * (hd + 4) if kv == "q8" else 2 * nkv * depth * hd * 2
    n_caches = max(2, min(reps, -(-(64 << 20) // max(nbytes, 1))))
    call, caches, qkv = _layer_attention(kv, depth, 1, threads, n_caches)
    times = []
    for i in range(reps):
        q = qkv.copy()
        t0 = time.perf_counter()
        call(q, *caches[i % n_caches])
        times.append(time.perf_counter() - t0)
    times.sort()
    t = times[len(times) // 2]
    return {"kv": kv, "depth": depth, "us": t * 1e6, "us_min": times[0] * 1e6, "us_max": times[-1] * 1e6,
            "GBps": nbytes / t / 1e9, "GBps_best": nbytes / times[0] / 1e9}


def prefill_attention_layer(kv: str, depth: int, rows: int, threads: int, reps: int = 6) -> dict:
    """One 2B-4T layer's attention for a `rows`-row prompt chunk at positions depth.. (the last chunk of a
    depth + rows prompt): median wall and CPU seconds per call (CPU time: less swayed by a busy machine). Each
    call gets its own layer's cache, as in the model (six layers at 4k positions: 60 MB of f16 K/V, more than L3
    holds), so a call starts with its keys and values in memory, not in cache."""
    call, caches, qkv = _layer_attention(kv, depth, rows, threads, reps)
    wall, cpu = [], []
    for kc, vc in caches:
        q = qkv.copy()
        t0, c0 = time.perf_counter(), time.process_time()
        call(q, kc, vc)
        wall.append(time.perf_counter() - t0), cpu.append(time.process_time() - c0)
    wall.sort(), cpu.sort()
    # the f32 multiply-adds of the f16 cache's scores and weighted sums (causal: row r sees depth + r + 1)
    fmas = 2 * N_HEADS * HEAD_DIM * sum(depth + r + 1 for r in range(rows))
    return {"kv": kv, "depth": depth, "rows": rows, "ms": wall[reps // 2] * 1e3, "cpu_ms": cpu[reps // 2] * 1e3,
            "ms_min": wall[0] * 1e3, "ms_max": wall[-1] * 1e3, "fma_per_s": fmas / wall[reps // 2]}


def fma_peak(threads: int) -> float:
    """f32 multiply-adds per second of the active path's register-only FMA loop on `threads` threads at once
    (simd._probes.peak_fma; 0 where the path has none)."""
    from bitnet_cpu.simd import _kernels as K
    from bitnet_cpu.simd import _probes

    K.set_num_threads(threads)
    _probes.peak_fma(1_000_000)
    t0 = time.perf_counter()
    n = _probes.peak_fma(40_000_000)
    return n / (time.perf_counter() - t0)


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
    ap.add_argument("--long", default="", help="whole-prompt lengths, the first the reference (e.g. 512,4096); "
                                               "alone: only these rows")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the --long rows")
    ap.add_argument("--prefill-attention", default="", help="depths of one layer's prompt-chunk attention alone "
                                                            "(e.g. 0,3968); alone: only these rows")
    ap.add_argument("--chunk", type=int, default=128, help="rows of the --prefill-attention chunk (the model's)")
    a = ap.parse_args(argv)
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.simd import _kernels as K

    if a.prefill_attention:   # needs no model
        peak = fma_peak(a.threads)
        K.set_num_threads(a.threads)
        print(f"one layer's attention of a {a.chunk}-row prompt chunk at depth (20 heads, 5 KV heads x 128), "
              f"{a.threads} threads, path {K.active()}, median of 6 calls (a layer's cache each); f32 FMA peak "
              f"of the same threads {peak / 1e9:.1f} G/s (register-only loop):")
        print("| KV | depth | ms per layer (min / median / max) | CPU ms | G f32 FMA/s (f16) | of the peak |")
        print("|---|---|---|---|---|---|")
        for d in a.prefill_attention.split(","):
            for kv in a.kv.split(","):
                r = prefill_attention_layer(kv, int(d), a.chunk, a.threads)
                rate, share = (f"{r['fma_per_s'] / 1e9:.1f}", f"{r['fma_per_s'] / peak:.0%}" if peak else "-") \
                    if kv == "f16" else ("-", "-")
                print(f"| {kv} | {d} | {r['ms_min']:.1f} / {r['ms']:.1f} / {r['ms_max']:.1f} | {r['cpu_ms']:.1f} | "
                      f"{rate} | {share} |", flush=True)
        return 0
    path = ensure_q4_store(a.cache)
    weights = store_bytes_per_token(path)
    store = Store(path)
    K.set_num_threads(a.threads)
    if a.long:
        rows = long_prompts(store, a)
        print(f"{path}: whole prompts from an empty cache, {a.threads} threads, path {K.active()}, "
              f"{a.rounds} alternating rounds")
        print("| KV | prompt tokens | prefill tok/s min / median / max | median / pp%s |" % a.long.split(",")[0])
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['kv']} | {r['prompt']} | {r['min']:.0f} / {r['median']:.0f} / {r['max']:.0f} | "
                  f"{r['over_first']:.2f} |")
        save_json(a.json, {"threads": a.threads, "long": rows})
        return 0
    bw0 = stream_bandwidth(a.threads, mib=512, passes=3)["bandwidth_Bps"]
    rows = [row(store, kv, int(d), a) for d in a.depths.split(",") if d for kv in a.kv.split(",")]
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
        print("\nf16 and q8 decode alternating (12 rounds of 2 tokens each, median):")
        print("| depth | f16 tok/s | q8 tok/s | q8 / f16 |")
        print("|---|---|---|---|")
        for r in ab:
            print(f"| {r['depth']} | {r['f16_tps']:.1f} | {r['q8_tps']:.1f} | {r['q8_over_f16']:.2f} |")
    if att:
        print("\none layer's decode attention (20 heads, 5 KV heads x 128), 20 calls going round layers' caches:")
        print("| KV | depth | us per layer min / median / max | K+V read GB/s median (best) | median's share of stream |")
        print("|---|---|---|---|---|")
        for r in att:
            print(f"| {r['kv']} | {r['depth']} | {r['us_min']:.0f} / {r['us']:.0f} / {r['us_max']:.0f} | "
                  f"{r['GBps']:.1f} ({r['GBps_best']:.1f}) | {r['GBps'] * 1e9 / bw:.0%} |")
    save_json(a.json, {"weights_bytes": weights, "stream_Bps": [bw0, bw1], "threads": a.threads, "rows": rows,
                       "attention": att, "ab": ab})
    return 0


if __name__ == "__main__":
    sys.exit(main())
