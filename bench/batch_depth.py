"""Many long conversations at once: batched decode steps of N sequences that each already hold D positions in the
paged KV pool (the serving engine's BatchModel over KVPool pages), with f16 and q8 (int8) pages.

    python bench/batch_depth.py [--seqs 16] [--depth 2048] [--steps 4] [--rounds 3] [--threads 2]

The synthetic 2B-4T-shaped store (bench/make_models.py; q4 head). Every sequence gets its own pages for D + steps
positions, filled with non-zero bytes (every page real memory, as after a prefill; prefilling 16 x 2048 tokens
would take minutes on a small machine and is not what this measures). A step decodes one token of each of the N
sequences (one GEMM per weight matrix, attention per row over its own pages). f16 and q8 pools alternate over
the rounds (the same machine load for both); reported: tokens per second over all sequences (min / median /
max of the rounds) and the KV bytes each sequence holds at its depth. Takes well under a minute at the defaults.

    python bench/batch_depth.py --parts [--seqs 16] [--depth 96] [--kv f16] [--json F]

--parts: where a batched step's time goes instead, kernel by kernel (prefill_parts.py's timers around every kernel
entry point; ms per step, the best round of each mode), with the AMX tiles on and off alternating where the CPU and
Linux grant them (avx512 / amx; elsewhere the one path there is): the share of a step that is not the GEMM is
what caps the tiles' gain at 16 sequences.
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

from decode_rows import ensure_q4_store  # noqa: E402
from make_models import DEFAULT_CACHE  # noqa: E402
from prefill_parts import Timers, parts_table  # noqa: E402


def setup(store, kv: str, a):
    """A pool holding every sequence's pages, a BatchModel over it, and the step's row / page tables."""
    from bitnet_cpu.engine.batching.batch_model import BatchModel
    from bitnet_cpu.engine.batching.kv_pool import PAGE_TOKENS, KVPool

    cfg = store.config
    n_ctx = a.depth + a.steps * a.rounds + 1
    per_seq = -(-n_ctx // PAGE_TOKENS)
    pool = KVPool(cfg.n_layers, a.seqs * per_seq, cfg.n_kv_heads, cfg.head_dim, kv)
    fill = {"f16": 0x2000, "q8": 1, "f32": 1e-3}[kv]
    pool.k.fill(fill), pool.v.fill(fill)
    bm = BatchModel(store, pool, max_rows=a.seqs, n_ctx=n_ctx, max_logit_rows=a.seqs, threads=a.threads)
    table = np.arange(a.seqs * per_seq, dtype=np.int32).reshape(a.seqs, per_seq)
    return {"bm": bm, "pool": pool, "table": table, "pos": a.depth,
            "seq_bytes": a.depth * KVPool.bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv)}


def step(s, a, rng) -> None:
    ids = rng.integers(100, 1000, a.seqs).astype(np.int32)
    rows = np.arange(a.seqs + 1, dtype=np.int32)
    pos0 = np.full(a.seqs, s["pos"], np.int32)
    s["bm"].step(ids, rows, pos0, s["table"], list(range(a.seqs)))
    s["pos"] += 1


def parts(states, a, rng, K) -> int:
    """--parts: per kv type, the best round of each mode (avx512, amx) kernel by kernel, modes alternating."""
    from bitnet_cpu.simd import _ops as ops

    isas = K.supported_isas()
    modes = [m for m in ("avx512", "amx") if m in isas] or [K.active()]
    timers = Timers([K, ops])
    out = {"seqs": a.seqs, "depth": a.depth, "threads": a.threads, "steps": a.steps, "cpu": K.features(), "tables": {}}
    try:
        for kv, s in states.items():
            best: dict[str, tuple[float, dict]] = {}
            for r in range(a.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    K.set_isa(mode if mode in isas else None)
                    step(s, a, rng)               # this mode's first touch (the tiles' buffers), untimed
                    timers.take()
                    t0 = time.perf_counter()
                    for _ in range(a.steps):
                        step(s, a, rng)
                    wall = time.perf_counter() - t0
                    got = timers.take()
                    if mode not in best or wall < best[mode][0]:
                        best[mode] = (wall, got)
            print(f"{a.seqs} sequences at depth {a.depth}, batched decode, {a.threads} threads, kv {kv}, load "
                  f"{os.getloadavg()[0]:.1f}; best of {a.rounds} rounds of {a.steps} steps; ms per step (share)")
            rows = parts_table(best, per=a.steps)
            for m in best:
                print(f"{m}: {a.seqs * a.steps / best[m][0]:.1f} tok/s")
            out["tables"][kv] = {"modes": list(best), "rows": rows,
                                 "tok_s": {m: a.seqs * a.steps / best[m][0] for m in best}}
    finally:
        timers.restore()
        K.set_isa(None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--depth", type=int, default=2048, help="positions each sequence holds")
    ap.add_argument("--steps", type=int, default=4, help="batched decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", default="f16,q8")
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--store", default=None, help="a store (default: the synthetic 2B-4T q4-head store in --cache)")
    ap.add_argument("--parts", action="store_true", help="time each kernel of a step, tiles on and off (see above)")
    ap.add_argument("--json", default=None, help="--parts: write the figures here")
    a = ap.parse_args(argv)
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.simd import _kernels as K

    store = Store(a.store or ensure_q4_store(a.cache))
    K.set_num_threads(a.threads)
    kvs = a.kv.split(",")
    rng = np.random.default_rng(0)
    states = {kv: setup(store, kv, a) for kv in kvs}
    if a.parts:
        return parts(states, a, rng, K)
    for s in states.values():
        step(s, a, rng)                   # warm: first touch of the run state, thread pool up
        s["pos"] -= 1
    tps = {kv: [] for kv in kvs}
    for r in range(a.rounds):
        for kv in (kvs if r % 2 == 0 else kvs[::-1]):
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(states[kv], a, rng)
            tps[kv].append(a.seqs * a.steps / (time.perf_counter() - t0))
    print(f"{a.seqs} sequences at depth {a.depth}, batched decode, {a.threads} threads, path {K.active()}, "
          f"load {os.getloadavg()[0]:.1f}; {a.rounds} alternating rounds of {a.steps} steps")
    print("| KV pages | tok/s over all sequences min / median / max | KV per sequence | pool |")
    print("|---|---|---|---|")
    for kv in kvs:
        v, s = sorted(tps[kv]), states[kv]
        print(f"| {kv} | {v[0]:.1f} / {v[len(v) // 2]:.1f} / {v[-1]:.1f} | {s['seq_bytes'] / 2**20:.0f} MiB | "
              f"{s['pool'].nbytes / 2**20:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
