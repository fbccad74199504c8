"""Where a prefill's time goes, kernel by kernel, with the AMX tiles on and off (not a test; no profiler needed).

    python bench/prefill_parts.py [--store bench/cache/2b4t.q4.bnstore] [--threads 2] [--prompt 512] [--rounds 2]
                                  [--chunks 128,512] [--attention f32,bf16]

Every kernel entry point the model calls (simd._kernels and simd._ops: the ternary GEMMs, the fused norm +
quantize ops, attention, the head) is wrapped in a wall-clock timer for the run; each prefill uses a fresh random
prompt on an emptied cache (Model.prefill, the engine's prompt pass). The GEMMs are split by shape (N x K_pad).
"python and the rest" is the prefill's wall time minus the kernels' own. Modes alternate in one process: avx512
(BITNET_ISA=avx512's choice) and, where the CPU and Linux grant AMX, amx; elsewhere the one path there is. The
best of --rounds per mode. --chunks: prefill rows per GEMM call to compare (the engine's is
engine.runtime.model.DEFAULT_CHUNK, chosen on AVX-512; the tiles gain more at more rows), one session each.

Made for short leases on an AMX machine (the share of a tile prefill that is not the GEMM, which caps what the
tiles can gain, measured without perf or py-spy there), and it runs anywhere. The timers cost ~1 us a call
(a few thousand calls a prefill).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bitnet_cpu.simd import _kernels as K  # noqa: E402
from bitnet_cpu.simd import _ops as ops  # noqa: E402

GEMMS = ("gemm_ternary", "gemm_ternary_b3", "gemv_rows_ternary", "gemv_rows_ternary_b3")
# settings and queries of the kernel modules, not kernels: left unwrapped
SETTINGS = {"active", "features", "supported_isas", "tiles", "tiles_reason", "tile_min_rows", "tile_kblock",
            "tile_stream", "gemv_prefetch"}


class Timers:
    """Wraps the public callables of the kernel modules; `acc` holds seconds per label while `on`."""

    def __init__(self, modules):
        self.acc: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.saved = []
        for mod in modules:
            for name in dir(mod):
                fn = getattr(mod, name)
                kernel = callable(fn) and not isinstance(fn, type)
                if not kernel or name.startswith(("_", "set_", "get_")) or name in SETTINGS:
                    continue
                self.saved.append((mod, name, fn))
                setattr(mod, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        acc, calls = self.acc, self.calls
        gemm = name in GEMMS

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                label = f"{name} {args[-1].shape[1]}x{args[2].shape[1]}" if gemm else name
                acc[label] += time.perf_counter() - t0
                calls[label] += 1
        return timed

    def restore(self):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        self.calls.clear()
        return out


def parts_table(best: dict[str, tuple[float, dict]], per: int = 1) -> list[dict]:
    """Print best {mode: (wall seconds, {part: seconds})} as ms per unit (wall and parts divided by per) and shares of
    the wall, a column per mode (two modes: their ratio too), parts largest first, then "python and the rest" (wall
    minus the parts) and the wall; returns the rows ({"part": label, mode: seconds per unit, ...})."""
    modes = list(best)
    labels = sorted({k for _, p in best.values() for k in p}, key=lambda k: -max(p.get(k, 0) for _, p in best.values()))
    pair = tuple(modes) if len(modes) == 2 else None   # two modes (avx512 / amx, or f32 / bf16): their ratio
    print(f"{'part':40s}" + "".join(f"{m:>22s}" for m in modes) + (f"   {pair[0]} / {pair[1]}" if pair else ""))
    rows = []
    for lab in labels + ["python and the rest", "wall"]:
        vals = {}
        for m in modes:
            wall, parts = best[m]
            vals[m] = (wall if lab == "wall" else (wall - sum(parts.values()) if lab == "python and the rest"
                                                   else parts.get(lab, 0.0))) / per
        cells = "".join(f"{1e3 * vals[m]:12.2f} ({100 * vals[m] * per / best[m][0]:4.1f}%)  " for m in modes)
        ratio = f"   {vals[pair[0]] / vals[pair[1]]:.2f}x" if pair and vals[pair[1]] > 0 else ""
        print(f"{lab:40s}{cells}{ratio}")
        rows.append({"part": lab, **{m: vals[m] for m in modes}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=os.path.join(HERE, "cache", "2b4t.q4.bnstore"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=2, help="prefills per mode (the best is kept)")
    ap.add_argument("--chunks", default="", help="prefill rows per GEMM call to compare (default: the engine's)")
    ap.add_argument("--attention", default="f32",
                    help="prefill attention precisions to compare, alternating (f32, bf16: simd set_attention_precision)")
    ap.add_argument("--kv", default="f16", choices=("f16", "f32", "q8"), help="KV cache type (as bitnet --kv)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)
    if not os.path.exists(a.store):
        print(f"prefill_parts: no store {a.store}: run python bench/make_models.py first", file=sys.stderr)
        return 2
    from bitnet_cpu.engine.api import open_store
    from bitnet_cpu.engine.runtime.model import DEFAULT_CHUNK, Model

    isas = K.supported_isas()
    modes = [m for m in ("avx512", "amx") if m in isas] or [K.active()]
    chunks = [int(c) for c in a.chunks.split(",")] if a.chunks else [DEFAULT_CHUNK]
    attns = a.attention.split(",")
    if not set(attns) <= set(ops.ATTENTION_PRECISIONS):
        print(f"prefill_parts: --attention takes {','.join(ops.ATTENTION_PRECISIONS)}", file=sys.stderr)
        return 2
    store = open_store(a.store, progress=False)
    vocab = min(store.config.vocab_size, 30000)
    rng = np.random.default_rng(0)
    timers = Timers([K, ops])
    best: dict[str, tuple[float, dict]] = {}
    try:
        for chunk in chunks:
            model = Model(store, n_ctx=a.prompt + 64, chunk=chunk, threads=a.threads, kv_dtype=a.kv)
            for _ in range(a.rounds):
                for mode in modes:
                    for att in attns:
                        K.set_isa(mode if mode in isas else None)
                        ops.set_attention_precision(att)
                        prompt = rng.integers(3, vocab, size=a.prompt).tolist()
                        model.reset()
                        timers.take()
                        t0 = time.perf_counter()
                        model.prefill(prompt)
                        wall = time.perf_counter() - t0
                        parts = timers.take()
                        key = mode + (f" {att}" if len(attns) > 1 else "") + (f" chunk {chunk}" if len(chunks) > 1 else "")
                        if key not in best or wall < best[key][0]:
                            best[key] = (wall, parts)
            del model
    finally:
        timers.restore()
        K.set_isa(None)
        ops.set_attention_precision("f32")
    print(f"prefill of {a.prompt} tokens, {a.threads} threads, {os.path.basename(a.store)}, kv {a.kv}; best of {a.rounds}; "
          f"ms per prefill (share of its wall time)")
    modes = list(best)
    rows = parts_table(best)
    for m in modes:
        print(f"{m}: {a.prompt / best[m][0]:.1f} tok/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prompt": a.prompt, "threads": a.threads, "store": a.store, "kv": a.kv, "chunks": chunks,
                       "attention": attns, "modes": modes,
                       "rows": rows,
                       "cpu": K.features()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
