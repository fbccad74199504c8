"""Kernel benchmark (not a test): prints a table of time per call, weight GB/s, int8 GOP/s for the 2B-4T
layer shapes and the 128256 x 2560 LM head, with 1 and 2 threads, next to the machine's limits measured in
the same run:
  - read bandwidth: simd._probes.stream_read over a buffer far larger than the last-level cache;
    every GEMV's GB/s is printed as a % of it (decode is memory-bound);
  - int8 dot-product peak of the active path: simd._probes.peak_dot, a register-only loop of the path's
    dot-product instruction (vpdpbusd zmm for avx512, pmaddubsw+paddw for avx2); GEMM GOP/s is printed as
    a % of it (prefill is compute-bound).
Weight sets are larger than the LLC (several copies, cycled) so GEMV figures are DRAM figures.

    python bench/bench_kernels.py                 # default: ~2-3 minutes
    python bench/bench_kernels.py --quick         # fewer shapes and M values
    python bench/bench_kernels.py --groups        # also the group-scaled tg128 kernel (Ternary Bonsai), with its
                                                  # time per call relative to tile16 on the same shape, same run
    BITNET_ISA=avx2 python bench/bench_kernels.py # another path
    python bench/bench_kernels.py --prefetch 0,2048,4096,8192
                                                  # only the decode GEMVs (tile16 layers, the q4 head) at each
                                                  # software prefetch distance of the AVX-512 bodies, alternating
                                                  # in rounds, each as a share of the stream rate of the run
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bitnet_cpu.simd import layout  # noqa: E402
from bitnet_cpu.simd import _kernels as K  # noqa: E402
from bitnet_cpu.simd import _probes as P  # noqa: E402  (benchmark-only probes, not in the runtime module)

def llc_bytes(default=32 << 20) -> int:
    """The largest CPU cache Linux reports (sysfs), or default."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for idx in (os.listdir(base) if os.path.isdir(base) else []):
        try:
            size = open(os.path.join(base, idx, "size")).read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        if size.rstrip("KMG").isdigit():
            best = max(best, int(size.rstrip("KMG")) * mult)
    return best or default


LLC_BYTES = llc_bytes()
# every GEMV's weight copies together exceed the LLC 8 times (32 MB here); 3 times on a server part whose L3 is
# hundreds of MB (a Xeon's), so that generating them stays a few seconds
WORKING_SET = max(8 * (32 << 20), 3 * LLC_BYTES)
# (name, N, K): the 2B-4T BitLinear shapes (fused where the engine fuses them)
LAYERS = [
    ("attn_q/o 2560x2560", 2560, 2560),
    ("attn_k/v 640x2560", 640, 2560),
    ("attn_qkv 3840x2560", 3840, 2560),
    ("ffn_gate 6912x2560", 6912, 2560),
    ("ffn_gate_up 13824x2560", 13824, 2560),
    ("ffn_down 2560x6912", 2560, 6912),
]
VOCAB, HIDDEN = 128256, 2560


CLOCK = time.perf_counter  # --clock cpu: time.thread_time for 1-thread runs (immune to preemption)


def clock_for(threads):
    return CLOCK if threads == 1 else time.perf_counter


def timed(fn, min_time=0.25, max_calls=2000, clock=None):
    """Median seconds per call (first call is a warm-up)."""
    clock = clock or time.perf_counter
    fn()
    calls, t0 = 0, time.perf_counter()
    batch_times = []
    while True:
        b0 = clock()
        fn()
        batch_times.append(clock() - b0)
        calls += 1
        if time.perf_counter() - t0 > min_time or calls >= max_calls:
            break
    return float(np.median(batch_times))


def measure_bandwidth(threads, nbytes=1 << 30, huge_pages=True):
    """Best-of-6 streaming read over random bytes. numpy allocations this large get transparent huge pages
    (numpy madvises them), like the benchmark's weight sets; a Python bytes buffer stays on 4 KB pages, like
    a file mmap (measured here: ~25% slower on one Zen 4 core)."""
    K.set_num_threads(threads)
    rng = np.random.default_rng(1)
    if huge_pages:
        buf = np.empty(nbytes, np.uint8)
        for i in range(0, nbytes, 64 << 20):
            buf[i:i + (64 << 20)] = rng.integers(0, 256, min(64 << 20, nbytes - i), dtype=np.uint8)
    else:
        buf = np.frombuffer(rng.bytes(nbytes), np.uint8)
    P.stream_read(buf)
    t = min(_once(lambda: P.stream_read(buf), clock_for(threads)) for _ in range(6))
    del buf
    return nbytes / t / 1e9


def _once(fn, clock=time.perf_counter):
    t0 = clock()
    fn()
    return clock() - t0


def measure_peak(threads, iters=20_000_000):
    K.set_num_threads(threads)
    P.peak_dot(1000)
    clock = clock_for(threads)
    best = 0.0
    for _ in range(3):
        t0 = clock()
        macs = P.peak_dot(iters)
        best = max(best, 2 * macs / (clock() - t0) / 1e9)  # GOP/s (1 MAC = 2 ops)
    return best


def random_ternary_packed(rng, n, k, copies):
    """copies of a random packed matrix, as views of one big numpy array (huge pages, like the stream buffer)."""
    n_pad, k_pad = layout.padded_shape(n, k)
    nbytes = n_pad * k_pad // 4
    # & 0x55: every 2-bit code in {0, 1} (valid ternary codes); speed does not depend on the values
    big = rng.integers(0, 256, nbytes * copies, dtype=np.uint8) & np.uint8(0x55)
    return [big[i * nbytes:(i + 1) * nbytes] for i in range(copies)]


def row(name, m, threads, sec, wbytes, ops, limit, limit_kind):
    gbs = wbytes / sec / 1e9
    gops = ops / sec / 1e9
    pct = f"{(gbs if limit_kind == 'bw' else gops) / limit * 100:>6.0f}%" if limit > 0 else "    n/a"
    print(f"{name:26s} {m:>4d} {threads:>3d} {sec * 1e6:>10.1f} {gbs:>8.1f} {gops:>8.1f} {pct} {limit_kind}")


def group_rows(rng, name, n, k, copies, threads, ms, x, bw, peak, ws, rs, xq, s, sm):
    """gemv_tg (tg128: ternary codes + one f16 scale per 128 weights of a row, activations per group of 128) on
    the shape, and its time per call over tile16's (gemv_ternary for 1 row, gemm_ternary for M rows), timed
    alternately in this run. Bytes: 2.125 bits per weight vs 2."""
    tbytes = layout.tg128_bytes(n, k)
    big = rng.integers(0, 256, tbytes * copies, dtype=np.uint8) & np.uint8(0x55)
    for c in range(copies):   # valid (finite) f16 scales in front of every group
        big[c * tbytes:(c + 1) * tbytes].reshape(-1, layout.TG_GROUP_BYTES)[:, :32].view(np.float16)[:] = 0.01
    tws = [big[i * tbytes:(i + 1) * tbytes] for i in range(copies)]
    mmax = max(ms + [1])
    gq = np.empty((mmax, k), np.int8)
    gd, gs = np.empty((mmax, k // layout.TG_GROUP), np.float32), np.empty((mmax, k // layout.TG_GROUP), np.int32)
    K.quantize_act_g128(x[:mmax], gq, gd, gs)
    it = iter(range(1 << 62))
    for m in [1] + ms:
        out = np.empty((m, n), np.float32)

        def tg():
            K.gemv_tg(tws[next(it) % copies], gq[:m], gd[:m], gs[:m], out)

        def t16():
            w = ws[next(it) % copies]
            if m == 1:
                K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out[0])
            else:
                K.gemm_ternary(w, rs, xq[:m], s[:m], sm[:m], out)

        kw = dict(min_time=0.3, max_calls=50, clock=clock_for(threads))
        a, b = [], []
        for _ in range(3):   # alternate, so both see the same machine
            a.append(timed(tg, **kw))
            b.append(timed(t16, **kw))
        sec, ref = float(np.median(a)), float(np.median(b))
        row(f"gemv_tg {name}", m, threads, sec, tbytes, 2 * n * k * m, bw if m == 1 else peak, "bw" if m == 1 else "peak")
        print(f"{'':26s} {'':>4s} {'':>3s} time / tile16 {sec / ref:.2f} (bytes 1.06)")


def prefetch_sweep(distances, thread_list, rounds):
    """The decode GEMVs at each prefetch distance: every round times every distance once (so drifts of a noisy
    machine hit them alike); medians and bests per distance as a share of the best stream rate probed before
    and after. The shapes: the largest two 2B-4T layers (tile16) and the q4 head, out of cache."""
    rng = np.random.default_rng(0)
    print(f"simd path: {K.active()}; its default prefetch {K.gemv_prefetch()} bytes; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if K.active() not in ("avx512", "amx", "avx2", "avxvnni"):
        print("the prefetch distance applies to the x86 bodies only: nothing to sweep on this path")
        return 0
    cases = []
    for name, n, k in (LAYERS[4], LAYERS[5]):
        n_pad, k_pad = layout.padded_shape(n, k)
        wbytes = n_pad * k_pad // 4
        copies = max(2, -(-WORKING_SET // wbytes))
        ws = random_ternary_packed(rng, n, k, copies)
        x = rng.standard_normal((1, k)).astype(np.float32)
        xq, s, sm = np.empty((1, k_pad), np.int8), np.empty(1, np.float32), np.empty(1, np.int32)
        K.quantize_act(x, xq, s, sm)
        rs, out, it = np.ones(n_pad, np.float32), np.empty(n, np.float32), iter(range(1 << 62))
        cases.append((f"gemv {name}", wbytes, lambda ws=ws, rs=rs, xq=xq, s=s, sm=sm, out=out, it=it, c=copies:
                      K.gemv_ternary(ws[next(it) % c], rs, xq[0], float(s[0]), int(sm[0]), out)))
    k_pad, n_pad = layout.pad_to(HIDDEN, 64), layout.pad_to(VOCAB, 16)
    codes = rng.integers(0, 256, n_pad * k_pad // 2, dtype=np.uint8)
    gs = rng.integers(0, 64, n_pad * k_pad // 32, dtype=np.uint8)
    xh = rng.standard_normal((1, HIDDEN)).astype(np.float32)
    xqh, sh, smh = np.empty((1, k_pad), np.int8), np.empty(1, np.float32), np.empty(1, np.int32)
    K.quantize_act(xh, xqh, sh, smh)
    sc, outh = np.ones(n_pad, np.float32), np.empty((1, VOCAB), np.float32)
    cases.append(("gemv_q4g head 128256x2560", codes.nbytes + gs.nbytes,
                  lambda: K.gemv_q4g(codes, gs, sc, xqh, sh, outh)))
    default = K.gemv_prefetch()
    try:
        for threads in thread_list:
            bw0 = measure_bandwidth(threads)
            K.set_num_threads(threads)
            rates = {(c[0], d): [] for c in cases for d in distances}
            for _ in range(rounds):
                for d in distances:
                    K.set_gemv_prefetch(d)
                    for name, nbytes, fn in cases:
                        rates[name, d].append(nbytes / timed(fn, min_time=0.3, clock=clock_for(threads)) / 1e9)
            bw = max(bw0, measure_bandwidth(threads))
            print(f"\n{threads} thread(s): stream read {bw:.1f} GB/s (best of before {bw0:.1f} and after)")
            print(f"{'kernel / shape':26s} {'prefetch':>8s} {'median GB/s':>12s} {'best':>7s} {'of stream':>10s}")
            for name, _, _ in cases:
                for d in distances:
                    r = np.array(rates[name, d])
                    print(f"{name:26s} {d:>8d} {np.median(r):>12.1f} {r.max():>7.1f} "
                          f"{np.median(r) / bw * 100:>9.0f}%")
    finally:
        K.set_gemv_prefetch(default)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and M values")
    ap.add_argument("--threads", default="1,2", help="thread counts to run")
    ap.add_argument("--ms", default="8,32,128,512", help="GEMM token counts")
    ap.add_argument("--no-head", action="store_true", help="skip the LM head")
    ap.add_argument("--groups", action="store_true",
                    help="also time gemv_tg (one f16 scale per 128 weights, per-group activations) per shape")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: time 1-thread runs with the thread's CPU time (for a machine shared with other jobs)")
    ap.add_argument("--prefetch", default=None, metavar="BYTES,...",
                    help="sweep the AVX-512 GEMV prefetch distance (0: none) instead of the usual table")
    ap.add_argument("--rounds", type=int, default=5, help="--prefetch: rounds of all distances (medians)")
    a = ap.parse_args(argv)
    if a.prefetch:
        return prefetch_sweep([int(d) for d in a.prefetch.split(",")], [int(t) for t in a.threads.split(",")],
                              a.rounds)
    global CLOCK
    CLOCK = time.thread_time if a.clock == "cpu" else time.perf_counter
    thread_list = [int(t) for t in a.threads.split(",")]
    ms = [int(m) for m in a.ms.split(",")]
    layers = LAYERS
    if a.quick:
        layers, ms = [LAYERS[2], LAYERS[4], LAYERS[5]], [m for m in ms if m in (8, 128)]
    rng = np.random.default_rng(0)

    print(f"simd path: {K.active()}   features: {', '.join(k for k, v in K.features().items() if v)}")
    if a.clock == "cpu":
        print("clock: 1-thread rows and limits use the thread's CPU time; 2-thread rows use wall time")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(other processes share the cores and the memory bus; times are medians per call)")
    bw = {t: measure_bandwidth(t) for t in thread_list}
    bw_small_pages = {t: measure_bandwidth(t, huge_pages=False) for t in thread_list}
    peak = {t: measure_peak(t) for t in thread_list}
    for t in thread_list:
        print(f"limits, {t} thread(s): stream read {bw[t]:.1f} GB/s (1 GiB, huge pages; "
              f"{bw_small_pages[t]:.1f} GB/s on 4 KB pages); "
              f"int8 dot peak {peak[t]:.0f} GOP/s ({K.active()} register-only loop)")
    print()
    print(f"{'kernel / shape':26s} {'M':>4s} {'thr':>3s} {'us/call':>10s} {'w GB/s':>8s} {'GOP/s':>8s} {'of limit':>11s}")

    for name, n, k in layers:
        n_pad, k_pad = layout.padded_shape(n, k)
        wbytes = n_pad * k_pad // 4
        copies = max(2, -(-WORKING_SET // wbytes))
        ws = random_ternary_packed(rng, n, k, copies)
        rs = np.ones(n_pad, np.float32)
        for threads in thread_list:
            K.set_num_threads(threads)
            x = rng.standard_normal((max(ms + [1]), k)).astype(np.float32)
            xq = np.empty((x.shape[0], k_pad), np.int8)
            s = np.empty(x.shape[0], np.float32)
            sm = np.empty(x.shape[0], np.int32)
            K.quantize_act(x, xq, s, sm)
            out = np.empty(n, np.float32)
            it = iter(range(1 << 62))

            def gemv():
                w = ws[next(it) % copies]
                K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)

            row(f"gemv {name}", 1, threads, timed(gemv, clock=clock_for(threads)), wbytes, 2 * n * k, bw[threads], "bw")
            for m in ms:
                outm = np.empty((m, n), np.float32)

                def gemm():
                    w = ws[next(it) % copies]
                    K.gemm_ternary(w, rs, xq[:m], s[:m], sm[:m], outm)

                row(f"gemm {name}", m, threads, timed(gemm, min_time=0.3, max_calls=50, clock=clock_for(threads)), wbytes, 2 * n * k * m,
                    peak[threads], "peak")
            if a.groups and k % layout.TG_GROUP == 0:
                group_rows(rng, name, n, k, copies, threads, ms, x, bw[threads], peak[threads], ws, rs, xq, s, sm)
        del ws

    if not a.no_head:
        k_pad = layout.pad_to(HIDDEN, 64)
        n_pad = layout.pad_to(VOCAB, 16)
        x = rng.standard_normal(HIDDEN).astype(np.float32)
        xq = np.empty(k_pad, np.int8)
        s, sm = np.empty(1, np.float32), np.empty(1, np.int32)
        K.quantize_act(x, xq, s, sm)
        out = np.empty(VOCAB, np.float32)
        wi = rng.integers(-127, 128, n_pad * k_pad, dtype=np.int8)
        rsum = np.zeros(n_pad, np.int32)
        sc = np.ones(n_pad, np.float32)
        for threads in thread_list:
            K.set_num_threads(threads)
            sec = timed(lambda: K.gemv_i8(wi, sc, rsum, xq, float(s[0]), out), min_time=0.5, max_calls=20,
                        clock=clock_for(threads))
            row("gemv_i8 head 128256x2560", 1, threads, sec, wi.nbytes, 2 * VOCAB * HIDDEN, bw[threads], "bw")
        del wi
        # the default head: 4-bit codes + 6-bit group scales (random bytes: speed does not depend on the values),
        # then ops.head_rescore of its best RESCORE_K rows from an f16 table (the embedding)
        codes = rng.integers(0, 256, n_pad * k_pad // 2, dtype=np.uint8)
        gs = rng.integers(0, 64, n_pad * k_pad // 32, dtype=np.uint8)
        out1 = out.reshape(1, -1)
        for threads in thread_list:
            K.set_num_threads(threads)
            sec = timed(lambda: K.gemv_q4g(codes, gs, sc, xq.reshape(1, -1), s, out1), min_time=0.5, max_calls=20,
                        clock=clock_for(threads))
            row("gemv_q4g head 128256x2560", 1, threads, sec, codes.nbytes + gs.nbytes, 2 * VOCAB * HIDDEN,
                bw[threads], "bw")
        del codes, gs
        from bitnet_cpu.engine.runtime.model import RESCORE_K
        from bitnet_cpu.simd import _ops

        table = rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32).astype(np.float16).view(np.uint16)
        heap, idx = np.zeros((1, RESCORE_K), np.float32), np.zeros((1, RESCORE_K), np.int32)
        logits = rng.standard_normal((1, VOCAB)).astype(np.float32)
        sec = timed(lambda: _ops.head_rescore(table, x.reshape(1, -1), logits, heap, idx), min_time=0.3,
                    max_calls=2000)
        print(f"{'head_rescore top-' + str(RESCORE_K):26s} {1:>4d} {1:>3d} {sec * 1e6:>10.1f}   (top-k over "
              f"{VOCAB} logits + {RESCORE_K} f16 rows)")
        del table
        wf = rng.standard_normal(n_pad * HIDDEN, dtype=np.float32).astype(np.float16)
        for threads in thread_list:
            K.set_num_threads(threads)
            sec = timed(lambda: K.gemv_f16(wf, x, out), min_time=0.5, max_calls=20, clock=clock_for(threads))
            row("gemv_f16 head 128256x2560", 1, threads, sec, wf.nbytes, 2 * VOCAB * HIDDEN, bw[threads], "bw")
        del wf

    # the Python boundary: a tiny GEMV is all call overhead
    w16 = layout.pack_ternary(np.zeros((16, 64), np.int8))
    xq = np.zeros(64, np.int8)
    o16 = np.empty(16, np.float32)
    r16 = np.ones(16, np.float32)
    K.set_num_threads(1)
    sec = timed(lambda: K.gemv_ternary(w16, r16, xq, 1.0, 0, o16), min_time=0.2, max_calls=200000)
    print(f"\ncall overhead (16x64 gemv_ternary, 1 thread): {sec * 1e6:.2f} us")
    jobs, worker_chunks, caller_sleeps = K._pool_stats()
    if jobs:
        print(f"worker pool: {jobs} threaded calls, {worker_chunks} of their ~{jobs * 32} chunks ran on the worker "
              "(the rest on the calling thread: a busy core makes the caller do more); the caller slept "
              f"{caller_sleeps} times waiting for a chunk held by a worker that was not running")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    if K.active() == "avx512":
        print("peak: what the register-only loop above measures at the current clock (Zen 4 runs 1 vpdpbusd zmm a\n"
              "cycle per core, as 2 x 256 bit: 64 int8 MAC/cycle; Zen 5 and Xeons with two 512-bit units run 2).")
    K.set_num_threads(0)


if __name__ == "__main__":
    main()
