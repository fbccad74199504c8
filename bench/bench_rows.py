"""Few-row passes: the GEMM against the multi-row GEMV, for the ternary 13824x2560 matrix (out of cache) and
the 128256x2560 int8 LM head; each as time per call / one 1-row GEMV, on the active kernel path. The numbers
behind engine/runtime/model.py's ROWS_GEMV_MAX (which kernel an M-row pass takes on each path).

    python bench/bench_rows.py [--threads 2] [--rounds 2]
    BITNET_ISA=avx2 python bench/bench_rows.py      # another path this CPU runs
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_kernels import random_ternary_packed, timed  # noqa: E402
from bitnet_cpu.simd import _kernels as K  # noqa: E402
from bitnet_cpu.simd import layout  # noqa: E402

N, KDIM, VOCAB = 13824, 2560, 128256


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/bench_rows.py", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"kernel path {K.active()}; time per call / one GEMV (lower is better)")
    n_pad, k_pad = layout.padded_shape(N, KDIM)
    copies = 6
    ws = random_ternary_packed(rng, N, KDIM, copies)
    rs = np.ones(n_pad, np.float32)
    x = rng.standard_normal((8, KDIM)).astype(np.float32)
    xq, s, sm = np.empty((8, k_pad), np.int8), np.empty(8, np.float32), np.empty(8, np.int32)
    K.quantize_act(x, xq, s, sm)
    hk, hn = layout.pad_to(KDIM, 64), layout.pad_to(VOCAB, 16)
    heads = [rng.integers(-127, 128, hn * hk, dtype=np.int8) for _ in range(2)]
    hsum, hsc = np.zeros(hn, np.int32), np.ones(hn, np.float32)
    it = iter(range(1 << 62))
    for t in (int(v) for v in a.threads.split(",")):
        K.set_num_threads(t)
        out = np.empty(N, np.float32)
        for _ in range(a.rounds):
            g1 = timed(lambda: K.gemv_ternary(ws[next(it) % copies], rs, xq[0], float(s[0]), int(sm[0]), out),
                       min_time=0.3)
            line = [f"{t} thr ternary {N}x{KDIM} GEMV {g1 * 1e6:.0f} us"]
            for m in (2, 3, 4, 5, 6, 7, 8):
                o = np.empty((m, N), np.float32)
                tg = timed(lambda: K.gemm_ternary(ws[next(it) % copies], rs, xq[:m], s[:m], sm[:m], o), min_time=0.3)
                tr = timed(lambda: K.gemv_rows_ternary(ws[next(it) % copies], rs, xq[:m], s[:m], sm[:m], o),
                           min_time=0.3)
                line.append(f"M={m} gemm {tg / g1:.2f} rows {tr / g1:.2f}")
            print(" | ".join(line), flush=True)
        ho = np.empty((8, VOCAB), np.float32)
        for _ in range(a.rounds):
            h1 = timed(lambda: K.gemv_i8(heads[next(it) % 2], hsc, hsum, xq[0], float(s[0]), ho[0]), min_time=0.3)
            line = [f"{t} thr int8 head {VOCAB}x{KDIM} GEMV {h1 * 1e3:.1f} ms"]
            for m in (2, 4, 8):
                tg = timed(lambda: K.gemm_i8(heads[next(it) % 2], hsc, hsum, xq[:m], s[:m], ho[:m]), min_time=0.3)
                tr = timed(lambda: K.gemv_rows_i8(heads[next(it) % 2], hsc, hsum, xq[:m], s[:m], ho[:m]), min_time=0.3)
                line.append(f"M={m} gemm {tg / h1:.2f} rows {tr / h1:.2f}")
            print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
