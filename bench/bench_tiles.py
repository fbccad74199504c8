"""AMX tiles against the AVX-512 path (vpdpbusd), same build, same run, and beside the peers (not a test).

    python bench/bench_tiles.py                        # kernels: the int8 peaks of both instruction paths, the
                                                       # 2B-4T GEMMs and the int8 and q4 heads at M rows, tiles
                                                       # on / off, the crossover M per shape (~3 min)
    python bench/bench_tiles.py --e2e [--llama-bench PATH] [--ik-bench PATH]
                                                       # + pp512, a 4,096-token prompt, batched decode at
                                                       # 1/4/8/16/32 sequences, bitnet serve at 16 clients,
                                                       # tiles on / off, and the peers' pp512 / pp4096
    python bench/bench_tiles.py --kblocks 0,256,1024   # the tile GEMM's k-blocks to compare (default 0,512,1024,2048)
    python bench/bench_tiles.py --emu --quick          # harness check on any machine: the emulated tiles
                                                       # (slow: the figures say nothing about speed)

Tiles off is BITNET_ISA=avx512's choice (simd.set_isa("avx512")), tiles on is simd.set_isa("amx"): one process,
alternating, so both sides see the same machine state. The GEMMs' weights come from memory, as in the engine's
steps (copies cycled that together exceed the last-level cache). Each GEMM figure is GMAC/s and its share of the peak of
its own instruction path (simd._probes.peak_dot: vpdpbusd zmm; peak_tile: tdpbssd), both measured in this run.
The crossover of a shape is the smallest M from which the tiles win at every larger M measured: the value to put
in tiles.h (BK_TILE_MIN_ROWS_AMX) / BITNET_TILE_MIN_ROWS. Without AMX hardware (and without --emu) the script
says why and stops: the tiles are then only tested (tests/test_tiles.py), not timed.
Models for --e2e: bench/make_models.py (the synthetic 2B-4T store, TQ2_0 and IQ2_BN files in bench/cache).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bitnet_cpu.simd import _kernels as K  # noqa: E402
from bitnet_cpu.simd import _probes as P  # noqa: E402
from bitnet_cpu.simd import layout  # noqa: E402
from bench_kernels import WORKING_SET, random_ternary_packed, timed  # noqa: E402

# (name, N, K) of the 2B-4T layers; the int8 and q4 heads are 128256 x 2560
SHAPES = [("qkv", 3840, 2560), ("o", 2560, 2560), ("gate|up", 13824, 2560), ("down", 2560, 6912)]
QUICK_SHAPES = [("o", 2560, 2560), ("down", 2560, 6912)]
EMU_SHAPES = [("small", 256, 512)]


def peaks(threads: int, tiles: bool) -> dict:
    """GMAC/s of the register-only loops of both paths on `threads` threads at once (best of 3)."""
    def best_rate(probe, iters):
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            macs = probe(iters)
            best = max(best, macs / (time.perf_counter() - t0) / 1e9)
        return best

    K.set_num_threads(threads)
    K.set_isa("avx512")
    out = {"vpdpbusd": best_rate(P.peak_dot, 5_000_000)}
    if tiles:
        out["amx"] = best_rate(P.peak_tile, 200_000)
    return out


@contextlib.contextmanager
def bodies(**settings):
    """The tile bodies' settings named (stream, overlap, warm, kblock: simd.set_tile_<name>) set for the block,
    then put back as they were."""
    was = {name: getattr(K, f"tile_{name}")() for name in settings}
    try:
        for name, v in settings.items():
            getattr(K, f"set_tile_{name}")(v)
        yield
    finally:
        for name, v in was.items():
            getattr(K, f"set_tile_{name}")(v)


def _mode(on: bool, emu: bool, min_rows: int = 1):
    """Tiles on or off. The kernel tables force the tiles from one row (min_rows 1) to find the crossover; the
    end-to-end figures keep the build's crossover (min_rows 0), as a user's run would."""
    if not on:
        K.set_isa("avx512" if "avx512" in K.supported_isas() else None)
        if emu:
            K.set_tiles("off")
    elif emu:
        K.set_tiles("emu")
    else:
        K.set_isa("amx")
    K.set_tile_min_rows(min_rows)


_COPIES: dict = {}


def weight_copies(rng, n, k, emu):
    """A call that cycles through copies of a random n x k ternary matrix that together exceed the last-level
    cache (WORKING_SET, bench_kernels.py), so that every call reads its weights from memory as the engine's steps
    do (one copy stays in a Xeon's L3 of hundreds of MB between calls); the emulation: one copy. One random copy,
    replicated (speed does not depend on the values), kept for the run's other tables."""
    if (n, k, emu) not in _COPIES:
        w = random_ternary_packed(rng, n, k, 1)[0]
        copies = 1 if emu else max(2, -(-WORKING_SET // w.nbytes))
        big = np.empty(w.nbytes * copies, np.uint8)
        ws = [big[i * w.nbytes:(i + 1) * w.nbytes] for i in range(copies)]
        for c in ws:
            c[:] = w
        _COPIES[(n, k, emu)] = ws
    ws, it = _COPIES[(n, k, emu)], iter(range(1 << 62))
    return lambda: ws[next(it) % len(ws)]


def rows_for(rng, m, k_pad, n):
    """M activation rows as the GEMMs take them (int8, unit scales, their sums) and an output buffer."""
    xq = rng.integers(-127, 128, size=(m, k_pad), dtype=np.int8)
    return xq, np.ones(m, np.float32), xq.astype(np.int32).sum(axis=1).astype(np.int32), np.empty((m, n), np.float32)


def q4_head_weights(rng, n, k):
    """A random q4g head of n_pad x k: codes and group scales (0..63, as the converter writes)."""
    return (rng.integers(0, 256, size=n * k // 2, dtype=np.uint8),
            rng.integers(0, 64, size=n * k // 32, dtype=np.uint8))


def gemm_rows(shapes, ms, threads, emu, peak, min_time) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, n, k in shapes:
        w = weight_copies(rng, n, k, emu)
        rs = np.ones(n, np.float32)
        k_pad = layout.pad_to(k, 64)
        for m in ms:
            xq, s, sm, out = rows_for(rng, m, k_pad, n)
            sec = {}
            for on in (False, True, False, True):      # alternate: both sides see the same machine state
                _mode(on, emu)
                K.set_num_threads(threads)
                t = timed(lambda: K.gemm_ternary(w(), rs, xq, s, sm, out), min_time=min_time, max_calls=200)
                sec[on] = min(sec.get(on, t), t)
            macs = m * n * k
            r = {"shape": name, "n": n, "k": k, "m": m, "threads": threads, "us_off": sec[False] * 1e6,
                 "us_on": sec[True] * 1e6, "gmacs_off": macs / sec[False] / 1e9, "gmacs_on": macs / sec[True] / 1e9}
            r["speedup"] = sec[False] / sec[True]
            print(f"{name:8s} {n:>6d} x {k:<5d} M={m:<4d} {threads}t   avx512 {r['gmacs_off']:7.1f} GMAC/s "
                  f"({100 * r['gmacs_off'] / peak['vpdpbusd']:3.0f}% of vpdpbusd)   tiles {r['gmacs_on']:7.1f} GMAC/s"
                  + (f" ({100 * r['gmacs_on'] / peak['amx']:3.0f}% of AMX)" if "amx" in peak else "")
                  + f"   x{r['speedup']:.2f}", flush=True)
            rows.append(r)
    return rows


def head_rows(ms, threads, emu, min_time, n=128256, k=2560) -> list[dict]:
    """The LM heads at M rows, tiles on / off: int8 (i8_tile16, bk_gemm_i8) and q4 (q4g_tile16, bk_gemv_q4g:
    off, the vector bodies ROWS_MAX rows per pass over the head; on, all rows in one pass)."""
    rng = np.random.default_rng(1)
    n_pad = layout.pad_to(n, 16)
    w = rng.integers(-127, 128, size=n_pad * k, dtype=np.int8)
    rs, rowsum = np.ones(n, np.float32), np.zeros(n, np.int32)
    codes, gscale = q4_head_weights(rng, n_pad, k)
    heads = {"i8": lambda xq, s, out: K.gemm_i8(w, rs, rowsum, xq, s, out),
             "q4": lambda xq, s, out: K.gemv_q4g(codes, gscale, rs, xq, s, out)}
    rows = []
    for m in ms:
        xq = rng.integers(-127, 128, size=(m, k), dtype=np.int8)
        s, out = np.ones(m, np.float32), np.empty((m, n), np.float32)
        for name, head in heads.items():
            sec = {}
            for on in (False, True, False, True):
                _mode(on, emu)
                K.set_num_threads(threads)
                t = timed(lambda: head(xq, s, out), min_time=min_time, max_calls=50)
                sec[on] = min(sec.get(on, t), t)
            print(f"head {name:3s} {n:>6d} x {k:<5d} M={m:<4d} {threads}t   avx512 {sec[False] * 1e3:8.2f} ms   tiles "
                  f"{sec[True] * 1e3:8.2f} ms   x{sec[False] / sec[True]:.2f}", flush=True)
            rows.append({"shape": f"head_{name}", "n": n, "k": k, "m": m, "threads": threads,
                         "us_off": sec[False] * 1e6, "us_on": sec[True] * 1e6, "speedup": sec[False] / sec[True]})
    return rows


def variant_rows(shapes, ms, threads, emu, seed, variants, apply, min_time):
    """The ternary tile GEMM (tiles on) under each of `variants` (apply(v) sets one; apply(variants[0]) after),
    alternating in two rounds: yields (name, n, k, m, {variant: seconds}) per shape and row count."""
    rng = np.random.default_rng(seed)
    for name, n, k in shapes:
        w = weight_copies(rng, n, k, emu)
        rs, k_pad = np.ones(n, np.float32), layout.pad_to(k, 64)
        for m in ms:
            xq, s, sm, out = rows_for(rng, m, k_pad, n)
            _mode(True, emu)
            K.set_num_threads(threads)
            sec = {}
            try:
                for _ in range(2):
                    for v in variants:
                        apply(v)
                        t = timed(lambda: K.gemm_ternary(w(), rs, xq, s, sm, out), min_time=min_time, max_calls=400)
                        sec[v] = min(sec.get(v, t), t)
            finally:
                apply(variants[0])
            yield name, n, k, m, sec


def _share(peak):
    return (lambda g: f" ({100 * g / peak['amx']:3.0f}%)") if "amx" in peak else (lambda g: "")


def kblock_rows(shapes, kblocks, ms, threads, emu, peak, min_time) -> list[dict]:
    """The tile GEMM at each k-block (simd.set_tile_kblock; 0: all of K at once, the default): which blocking
    keeps A and B closest to the tile unit. The whole-K bodies (the streamed one, the default at M <= 32, has no
    k-blocks)."""
    rows, share = [], _share(peak)
    with bodies(stream=False):
        runs = list(variant_rows(shapes, ms, threads, emu, 2, [0] + [kb for kb in kblocks if kb], K.set_tile_kblock,
                                 min_time))
    for name, n, k, m, sec in runs:
        g = {kb: m * n * k / sec[kb] / 1e9 for kb in sec}
        best = min(sec, key=sec.get)
        cells = "   ".join(f"k-block {kb or 'all'}: {g[kb]:7.1f} GMAC/s{share(g[kb])}" for kb in sec)
        print(f"{name:8s} {n:>6d} x {k:<5d} M={m:<4d} {threads}t   {cells}   best {best or 'all'}", flush=True)
        rows.append({"shape": name, "n": n, "k": k, "m": m, "threads": threads, "best": best,
                     "gmacs": {str(kb): g[kb] for kb in sec}})
    return rows


def toggle_rows(shapes, ms, threads, emu, peak, min_time, seed, setter, default, names, keys) -> list[dict]:
    """The ternary tile GEMM with one on / off setting of its body (setter; default first, and back after):
    names / keys {False: ..., True: ...} label each side in the table and the JSON; speedup is on against off."""
    rows, share = [], _share(peak)
    for name, n, k, m, sec in variant_rows(shapes, ms, threads, emu, seed, [default, not default], setter, min_time):
        g = {on: m * n * k / sec[on] / 1e9 for on in sec}
        cells = "   ".join(f"{names[on]} {g[on]:7.1f} GMAC/s{share(g[on])}" for on in (False, True))
        print(f"{name:8s} {n:>6d} x {k:<5d} M={m:<4d} {threads}t   tiles, {cells}   x{sec[False] / sec[True]:.2f}",
              flush=True)
        rows.append({"shape": name, "n": n, "k": k, "m": m, "threads": threads, keys[False]: g[False],
                     keys[True]: g[True], "speedup": sec[False] / sec[True]})
    return rows


def stream_rows(shapes, ms, threads, emu, peak, min_time) -> list[dict]:
    """The ternary tile GEMM at M <= 32, whole-K unpack against the streamed body (simd.set_tile_stream, the
    default: one 64-k step unpacked at a time beside the multiply)."""
    return toggle_rows(shapes, ms, threads, emu, peak, min_time, 3, K.set_tile_stream, True,
                       {False: "whole-K unpack", True: "streamed"}, {False: "gmacs_whole", True: "gmacs_stream"})


def warm_rows(shapes, ms, threads, emu, peak, min_time) -> list[dict]:
    """The ternary tile GEMM with its weights read two tiles ahead (simd.set_tile_warm, the default) against the
    unpack reading them as it goes; weights from memory."""
    return toggle_rows(shapes, ms, threads, emu, peak, min_time, 4, K.set_tile_warm, True,
                       {False: "read as they go", True: "read ahead"}, {False: "gmacs_cold", True: "gmacs_warm"})


@bodies(stream=False)
def overlap_rows(shapes, ms, threads, emu, peak, min_time, head=True) -> list[dict]:
    """The ternary tile GEMM with each next pair of weight tiles unpacked beside the multiply of the one before
    (simd.set_tile_overlap, the default) against unpacked before its own multiply; weights from memory. Then the
    q4 head on the tiles the same two ways (its next tile unpacked beside the multiply or before). The whole-K
    bodies (stream off for the call): at M <= 32 the streamed one (the default there) runs instead of either."""
    rows = toggle_rows(shapes, ms, threads, emu, peak, min_time, 5, K.set_tile_overlap, True,
                       {False: "unpack first", True: "unpack beside"}, {False: "gmacs_serial", True: "gmacs_overlap"})
    if not head:
        return rows
    n, k = (4096, 256) if emu else (128256, 2560)
    rng = np.random.default_rng(6)
    codes, gscale = q4_head_weights(rng, n, k)
    rs = np.ones(n, np.float32)
    for m in ms:
        xq = rng.integers(-127, 128, size=(m, k), dtype=np.int8)
        s, out = np.ones(m, np.float32), np.empty((m, n), np.float32)
        _mode(True, emu)
        K.set_num_threads(threads)
        sec = {}
        for _ in range(2):
            for on in (False, True):
                with bodies(overlap=on):
                    t = timed(lambda: K.gemv_q4g(codes, gscale, rs, xq, s, out), min_time=min_time, max_calls=50)
                sec[on] = min(sec.get(on, t), t)
        print(f"head q4  {n:>6d} x {k:<5d} M={m:<4d} {threads}t   tiles, unpack first {sec[False] * 1e3:8.2f} ms   "
              f"unpack beside {sec[True] * 1e3:8.2f} ms   x{sec[False] / sec[True]:.2f}", flush=True)
        rows.append({"shape": "head_q4", "n": n, "k": k, "m": m, "threads": threads, "us_serial": sec[False] * 1e6,
                     "us_overlap": sec[True] * 1e6, "speedup": sec[False] / sec[True]})
    return rows


# the tile bodies' variants the vector side is timed under: (label, their settings (bodies()), rows it applies to)
VECTOR_SIDE_BODIES = [
    ("whole-K", {"stream": False}, lambda m: True),
    ("streamed", {"stream": True}, lambda m: m <= 32),
    ("k-block 1024", {"stream": False, "kblock": 1024}, lambda m: True),
]


def vector_side_rows(shapes, ms, threads, min_time, amx_peak_per_thread, head=True) -> list[dict]:
    """Any AVX-512 machine: the tile bodies with their tile instructions compiled out (simd._kernels.
    _set_tiles_timing_only; results wrong, time right) against the AVX-512 body, alternating, under each of
    VECTOR_SIDE_BODIES (the q4 head: whole-K and streamed). What is left is the vector side: the unpack, the A
    tail copy, the epilogue, the prefetch and the loops. Beside it, the tdpbssd time at the given AMX peak (GMAC/s
    a thread; lease 1 measured ~1,070 on Emerald Rapids, 2 threads; the q4 head does two tdpbssd per product),
    and the rate the tiles would reach with the two in series (no overlap) and fully overlapped. The vector side
    runs at this machine's speed, not the AMX machine's: a model to steer by, not a measurement of the tiles."""
    rng = np.random.default_rng(7)
    rows = []
    peak = amx_peak_per_thread * threads * 1e9
    cases = []   # (name, n, k, m, call(out-of-date weights ok), tdp work factor, bodies)
    for name, n, k in shapes:
        w = weight_copies(rng, n, k, False)
        rs, k_pad = np.ones(n, np.float32), layout.pad_to(k, 64)
        for m in ms:
            xq, s, sm, out = rows_for(rng, m, k_pad, n)
            cases.append((name, n, k_pad, m, lambda w=w, rs=rs, xq=xq, s=s, sm=sm, out=out:
                          K.gemm_ternary(w(), rs, xq, s, sm, out), 1, VECTOR_SIDE_BODIES))
    if head:
        n, k = 128256, 2560
        codes, gscale = q4_head_weights(rng, n, k)
        rs = np.ones(n, np.float32)
        for m in ms:
            xq = rng.integers(-127, 128, size=(m, k), dtype=np.int8)
            s, out = np.ones(m, np.float32), np.empty((m, n), np.float32)
            cases.append(("head q4", n, k, m, lambda xq=xq, s=s, out=out: K.gemv_q4g(codes, gscale, rs, xq, s, out),
                          2, VECTOR_SIDE_BODIES[:2]))
    for name, n, k_pad, m, call, factor, variants in cases:
        variants = [b for b in variants if b[2](m)]
        K.set_num_threads(threads)
        sec = {}
        try:
            for _ in range(2):
                for label, settings, _ok in [("avx512", None, None)] + variants:
                    K.set_isa("avx512")
                    if settings is not None:
                        K._set_tiles_timing_only(True)
                        K.set_tile_min_rows(1)
                    with bodies(**(settings or {})):
                        t = timed(call, min_time=min_time, max_calls=400)
                    sec[label] = min(sec.get(label, t), t)
        finally:
            K._set_tiles_timing_only(False)
            K.set_tile_min_rows(0)
            K.set_isa(None)
        macs = m * n * k_pad
        tdp = factor * ((m + 15) // 16 * 16) * ((n + 15) // 16 * 16) * k_pad / peak
        r = {"shape": name, "n": n, "k": k_pad, "m": m, "threads": threads, "us_avx512": sec["avx512"] * 1e6,
             "us_tdp_model": tdp * 1e6, "bodies": {}}
        cells = []
        for label, *_ in variants:
            side = sec[label]
            r["bodies"][label] = {"us_vector_side": side * 1e6, "gmacs_serial_model": macs / (side + tdp) / 1e9,
                                  "gmacs_overlap_model": macs / max(side, tdp) / 1e9}
            cells.append(f"{label} {side * 1e6:8.1f} us ({macs / (side + tdp) / 1e9:6.0f} / "
                         f"{macs / max(side, tdp) / 1e9:6.0f})")
        print(f"{name:8s} {n:>6d} x {k_pad:<5d} M={m:<4d} {threads}t   avx512 {sec['avx512'] * 1e6:8.1f} us "
              f"({macs / sec['avx512'] / 1e9:6.0f} GMAC/s)   tdpbssd at the peak {tdp * 1e6:8.1f} us   vector side: "
              + "   ".join(cells), flush=True)
        rows.append(r)
    return rows


def crossovers(rows) -> dict:
    """Per (shape, threads): the smallest measured M from which the tiles win at every larger measured M."""
    res = {}
    for key in sorted({(r["shape"], r["threads"]) for r in rows}):
        rs = sorted((r for r in rows if (r["shape"], r["threads"]) == key), key=lambda r: r["m"])
        cross = None
        for i, r in enumerate(rs):
            if all(x["speedup"] > 1.0 for x in rs[i:]):
                cross = r["m"]
                break
        res[f"{key[0]}@{key[1]}t"] = cross
    return res


def e2e(threads: int, llama_bench: str | None, ik_bench: str | None, store: str | None, emu: bool = False,
        prompts=(512, 4096), seqs=(1, 4, 8, 16, 32), peer_prompts=(512, 4096), serve: bool = True,
        serve_gen: int = 128, serve_batch: int | None = None, save=lambda res: None) -> dict:
    """Ours with tiles on / off (alternating, one process) and the peers' llama-bench, same models. `save(res)` is
    called after every figure, so a run stopped at a deadline keeps what it measured."""
    import tempfile

    import make_models
    from llama_bench import llama_bench as run_peer
    from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model

    paths = make_models.model_paths()
    store = store or paths["store_q4"]
    if not os.path.exists(store):
        print(f"bench_tiles: no store {store}: run python bench/make_models.py first", file=sys.stderr)
        return {"error": f"no store {store}"}
    res = {"ours": {"store": store}, "peers": {}}
    save(res)
    rng = np.random.default_rng(2)
    llm = load_model(store, threads=threads, ctx=4608, progress=False)
    vocab = min(llm.config.vocab_size, 30000)   # random prompt ids in the model's vocabulary
    for plen in prompts:
        for on in (False, True, False, True):
            _mode(on, emu, 0)
            # a fresh prompt every run: a repeated one would come from the prompt cache (1 token computed)
            prompt = rng.integers(3, vocab, size=plen).tolist()
            st = [c.stats for c in llm.generate(prompt, SamplingParams(temperature=0), max_tokens=1) if c.stats][0]
            assert st.n_cached == 0, f"pp{plen}: {st.n_cached} prompt tokens came from the cache"
            key = f"pp{plen}_{'amx' if on else 'avx512'}"
            res["ours"][key] = max(res["ours"].get(key, 0.0), st.prefill_tps)
        print(f"pp{plen}: avx512 {res['ours'][f'pp{plen}_avx512']:.1f} tok/s, tiles {res['ours'][f'pp{plen}_amx']:.1f} tok/s",
              flush=True)
        save(res)
    del llm
    for n_seqs in seqs:
        eng = load_engine(store, threads=threads, parallel=n_seqs, ctx=256, progress=False)
        for on in (False, True):
            _mode(on, emu, 0)
            batch = [rng.integers(3, vocab, size=32).tolist() for _ in range(n_seqs)]
            t0 = time.perf_counter()
            streams = [eng.submit(p, SamplingParams(temperature=0), max_tokens=64, ignore_eos=True) for p in batch]
            toks = sum(sum(1 for c in s if c.token is not None) for s in streams)
            res["ours"][f"batch{n_seqs}_{'amx' if on else 'avx512'}"] = toks / (time.perf_counter() - t0)
        eng.close()
        print(f"batched decode, {n_seqs} sequences of 32 + 64 tokens: avx512 "
              f"{res['ours'][f'batch{n_seqs}_avx512']:.1f} tok/s, tiles {res['ours'][f'batch{n_seqs}_amx']:.1f} tok/s",
              flush=True)
        save(res)
    on_env = {"BITNET_TILES": "emu"} if emu else {"BITNET_ISA": "amx"}
    for label, env in (("avx512", {"BITNET_ISA": "avx512"}), ("amx", on_env)) if serve else ():
        out = tempfile.mkdtemp(prefix=f"serve_tiles_{label}_")   # bench_serve writes its report files there
        subprocess.run([sys.executable, os.path.join(HERE, "bench_serve.py"), "--levels", "16", "--threads",
                        str(threads), "--gen", str(serve_gen), "--engines", "ours", "--out-dir", out,
                        *(["--batch-size", str(serve_batch)] if serve_batch else [])],
                       env=dict(os.environ, **env), check=False)
        got = os.path.join(out, "serve_results.json")
        if os.path.exists(got):
            lv = json.load(open(got))["engines"]["bitnet serve"]["levels"][-1]
            res["ours"][f"serve16_{label}"] = lv["agg_tps"]
            print(f"bitnet serve, 16 clients of {serve_gen} tokens, {label}: {lv['agg_tps']:.1f} tok/s", flush=True)
            save(res)
    for name, binary, model, extra in (("llama.cpp TQ2_0", llama_bench, paths["tq2_0"], ()),
                                       ("ik_llama.cpp IQ2_BN_R4", ik_bench, paths["iq2_bn"], ("-rtr", "1"))):
        if binary and os.path.exists(binary) and os.path.exists(model):
            for plen in peer_prompts:
                got = res["peers"][f"{name} pp{plen}"] = run_peer(binary, model, threads, 0, extra, prompt=plen)
                print(f"{name} pp{plen}: " + (f"{got['prefill_tps'].get(str(plen), float('nan')):.1f} tok/s"
                                              if "prefill_tps" in got else got.get("error", "?")), flush=True)
                save(res)
        else:
            print(f"{name}: left out (no llama-bench given or no {model})", file=sys.stderr)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="thread counts (kernels)")
    ap.add_argument("--ms", default="1,2,4,8,12,16,24,32,64,128,512", help="GEMM row counts")
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer M, shorter timings")
    ap.add_argument("--emu", action="store_true", help="the emulated tiles (harness check; any machine)")
    ap.add_argument("--no-head", action="store_true", help="skip the int8 and q4 heads")
    ap.add_argument("--e2e", action="store_true", help="also prefill, batched decode and serve, and the peers")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    ap.add_argument("--ik-bench", default=os.environ.get("IK_LLAMA_BENCH"))
    ap.add_argument("--store", default=None, help="--e2e: our store (default bench/cache/2b4t.q4.bnstore)")
    ap.add_argument("--prompts", default="512,4096", help="--e2e: prompt lengths timed (ours)")
    ap.add_argument("--seqs", default="1,4,8,16,32", help="--e2e: batched decode at these sequence counts")
    ap.add_argument("--peer-prompts", default=None,
                    help="--e2e: the peers' prompt lengths (default --prompts; '': none)")
    ap.add_argument("--serve-gen", type=int, default=128, help="--e2e: tokens per request of bitnet serve")
    ap.add_argument("--serve-batch", type=int, default=None,
                    help="--e2e: bitnet serve -b (tokens a step computes; default: the server's 256)")
    ap.add_argument("--no-serve", action="store_true", help="--e2e: leave out bitnet serve at 16 clients")
    ap.add_argument("--min-time", type=float, default=0.0, help="seconds per kernel timing (default 0.25; --quick 0.1)")
    ap.add_argument("--no-kernels", action="store_true", help="leave out the kernel tables (peaks still measured)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--kblocks", default="0,512,1024,2048",
                    help="k-blocks of the tile GEMM to compare at --kblock-ms (0: all of K; '': skip)")
    ap.add_argument("--stream-ms", default="8,16,24,32",
                    help="row counts (<= 32) at which to compare the streamed small-M tile body ('': skip)")
    ap.add_argument("--warm-ms", default="16,32,128",
                    help="row counts at which to compare the tiles with and without their weight warm ('': skip)")
    ap.add_argument("--overlap-ms", default="16,32,128,512",
                    help="row counts at which to compare the tile GEMM's unpack beside the multiply and before it "
                         "('': skip)")
    ap.add_argument("--kblock-ms", default="16,32,128,512",
                    help="row counts of the k-block comparison (small M: the unpacked pair of weight tiles is "
                         "read once per row group, so an L1-sized block may pay there and not at 512)")
    ap.add_argument("--vector-side", action="store_true",
                    help="any AVX-512 machine: time the tile bodies (whole-K, streamed, k-blocks; the q4 head) "
                         "without their tile instructions against the AVX-512 bodies (the unpack, epilogue and "
                         "loops the tiles run beside), and the tile rate that implies at --amx-peak, in series / "
                         "overlapped (GMAC/s in brackets); then stop")
    ap.add_argument("--amx-peak", type=float, default=1070.0,
                    help="--vector-side: AMX int8 GMAC/s a thread for the model (default: lease 1, Emerald Rapids)")
    a = ap.parse_args(argv)
    hw = "amx" in K.supported_isas()
    if a.vector_side:
        if "avx512" not in K.supported_isas():
            print("bench_tiles: --vector-side times the avx512 path, which this CPU lacks")
            return 0
        ms = [int(m) for m in a.ms.split(",")]
        out = {"cpu": K.features(), "load": os.getloadavg()[0], "amx_peak_per_thread": a.amx_peak, "rows": []}
        for t in (int(x) for x in a.threads.split(",")):
            out["rows"] += vector_side_rows(QUICK_SHAPES if a.quick else SHAPES, ms, t, a.min_time or 0.25,
                                            a.amx_peak, head=not a.no_head)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
        return 0
    if not hw and not a.emu:
        print(f"bench_tiles: no AMX tiles to time here: {K.tiles_reason()}.\n"
              "The tile kernels are tested on their emulation (tests/test_tiles.py); run this on an AMX machine "
              "(Sapphire Rapids or later, Linux 5.16+), or with --emu for a harness check.")
        return 0
    if "avx512" not in K.supported_isas() and not a.emu:
        print("bench_tiles: the tiles run beside the avx512 path, which this CPU lacks")
        return 0
    threads = [int(t) for t in a.threads.split(",")]
    ms = [int(m) for m in a.ms.split(",")]
    shapes = EMU_SHAPES if a.emu else (QUICK_SHAPES if a.quick else SHAPES)
    if a.emu or a.quick:
        ms = [m for m in ms if m in (1, 4, 8, 16, 32, 64)] or ms[:3]
    min_time = a.min_time or (0.02 if a.emu else (0.1 if a.quick else 0.25))
    res = {"cpu": K.features(), "tiles_reason": K.tiles_reason(), "emulated": a.emu, "load": os.getloadavg()[0],
           "peaks": {}, "gemm": [], "head": []}

    def save(e2e_part=None):   # after every section: a run stopped at a deadline keeps what it measured
        if e2e_part is not None:
            res["e2e"] = e2e_part
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)

    print(f"tiles: {'EMULATED (timings say nothing about speed)' if a.emu else K.tiles_reason()}; load {res['load']:.1f}")
    for t in threads:
        pk = peaks(t, hw and not a.emu) if "avx512" in K.supported_isas() else {"vpdpbusd": float("nan")}
        res["peaks"][t] = pk
        print(f"{t} thread(s): int8 peaks " + ", ".join(f"{k} {v:.0f} GMAC/s" for k, v in pk.items())
              + (f" (AMX / vpdpbusd = {pk['amx'] / pk['vpdpbusd']:.1f}x)" if "amx" in pk else ""), flush=True)
        if a.no_kernels:
            continue
        res["gemm"] += gemm_rows(shapes, ms, t, a.emu, pk, min_time)
        save()
        if not a.no_head:   # emulated: a small head (a harness check of both heads)
            res["head"] += head_rows([m for m in ms if m >= 8][:5] or [16], t, a.emu, min_time,
                                     *((2048, 256) if a.emu else ()))
            save()
        if a.kblocks:
            res.setdefault("kblocks", []).extend(
                kblock_rows(shapes, [int(x) for x in a.kblocks.split(",")],
                            [16, 64] if a.emu else [int(x) for x in a.kblock_ms.split(",")], t, a.emu, pk, min_time))
            save()
        if a.stream_ms:
            res.setdefault("stream", []).extend(
                stream_rows(shapes, [int(x) for x in a.stream_ms.split(",") if 0 < int(x) <= 32], t, a.emu, pk,
                            min_time))
            save()
        if a.warm_ms:
            res.setdefault("warm", []).extend(
                warm_rows(shapes, [int(x) for x in a.warm_ms.split(",")], t, a.emu, pk, min_time))
            save()
        if a.overlap_ms:
            res.setdefault("overlap", []).extend(
                overlap_rows(shapes, [int(x) for x in a.overlap_ms.split(",")], t, a.emu, pk, min_time,
                             head=not a.no_head))
            save()
    res["crossover"] = crossovers(res["gemm"] + res["head"])
    if res["crossover"]:
        print("crossover M (tiles win from here on):", ", ".join(f"{k} {v}" for k, v in res["crossover"].items()))
    save()
    if a.e2e:   # with --emu: a harness check on a small store (--store), no meaning for speed
        nums = lambda spec: tuple(int(x) for x in spec.split(",") if x)   # noqa: E731
        res["e2e"] = e2e(threads[-1], a.llama_bench, a.ik_bench, a.store, a.emu, prompts=nums(a.prompts),
                         seqs=nums(a.seqs), peer_prompts=nums(a.prompts if a.peer_prompts is None else a.peer_prompts),
                         serve=not a.no_serve, serve_gen=a.serve_gen,
                         serve_batch=a.serve_batch, save=save)
    K.set_isa(None)
    K.set_tile_min_rows(0)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
