"""The machine's limits, measured in the same run as the end-to-end benchmark: streaming-read bandwidth
(what bounds decode) and the int8 multiply-accumulate rate of the kernel path (what bounds prefill).

Run as a script it prints one JSON line (bench_e2e.py runs it in a subprocess so the thread count is set
before any OpenMP / BLAS runtime starts):
    python bench/limits.py --threads 2 [--mib 1024] [--passes 5]

Bandwidth: our probes' `stream_read` (vector loads over a buffer far larger than the L3 cache, split over
the kernel thread count, simd._probes) when built; otherwise numpy's BLAS sgemv over a large f32 matrix (a
matrix-vector product reads the matrix exactly once, and OpenBLAS threads it), which is a slightly lower
bound. The best of several passes is the limit (slower passes are interference, not the machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _kernels():
    try:
        from bitnet_cpu.simd import _kernels  # type: ignore
        return _kernels
    except Exception:  # not built yet / other machine: fall back to numpy
        return None


def _probes():
    """The benchmark-only probes (stream_read, peak_dot): their own extension, out of the runtime module."""
    try:
        from bitnet_cpu.simd import _probes  # type: ignore
        return _probes
    except Exception:
        return None


def stream_bandwidth(threads: int, mib: int = 1024, passes: int = 5) -> dict:
    """Best-of-`passes` read bandwidth in bytes/s over a `mib` MiB buffer with `threads` threads."""
    import numpy as np

    nbytes = mib << 20
    kern, probes = _kernels(), _probes()
    if kern is not None and probes is not None:
        kern.set_num_threads(threads)
        buf = np.ones(nbytes, dtype=np.uint8)  # touched, so no page faults inside the timed loop
        probes.stream_read(buf)
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            probes.stream_read(buf)
            times.append(time.perf_counter() - t0)
        method = "simd._probes.stream_read"
    else:
        cols = 4096
        a = np.ones((nbytes // (4 * cols), cols), dtype=np.float32)
        x = np.ones(cols, dtype=np.float32)
        y = np.empty(a.shape[0], dtype=np.float32)
        np.dot(a, x, out=y)
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            np.dot(a, x, out=y)
            times.append(time.perf_counter() - t0)
        nbytes = a.nbytes
        method = "numpy BLAS sgemv (fallback: simd._probes.stream_read not available)"
    best = min(times)
    return {"bandwidth_Bps": nbytes / best, "bandwidth_median_Bps": nbytes / sorted(times)[len(times) // 2],
            "buffer_bytes": nbytes, "passes": passes, "method": method}


def int8_peak(threads: int, passes: int = 5, iters: int = 20_000_000) -> dict | None:
    """Peak int8 MAC/s of the kernel path: the register-only VNNI loop if exposed (64 MACs per 512-bit
    vpdpbusd), and the ternary GEMM on cache-resident weights (what the prefill path can reach at best).
    The register loop runs `passes` times and the fastest is the peak, as for the bandwidth: on a shared machine
    a single pass read a busy moment (348 G/s where a real multiply in the same call reached 636). Every pass is
    kept with its process CPU / wall (about `threads` when nothing else ran)."""
    import numpy as np

    kern = _kernels()
    if kern is None:
        return None
    if hasattr(kern, "set_num_threads"):
        kern.set_num_threads(threads)
    out: dict = {"isa": kern.active() if hasattr(kern, "active") else "?"}
    probes = _probes()
    if probes is not None:
        try:
            probes.peak_dot(max(iters // 10, 1))
            runs = []
            for _ in range(max(passes, 1)):
                c0, t0 = time.process_time(), time.perf_counter()
                res = probes.peak_dot(iters)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                # peak_dot returns the number of int8 multiply-accumulates it did (all threads)
                macs = res if isinstance(res, int) and res > iters else None
                runs.append({"s": dt, "cpu_per_wall": cpu / dt, "mac_per_s": macs / dt if macs else None})
            best = min(runs, key=lambda r: r["s"])
            if best["mac_per_s"]:
                out["register_peak_mac_per_s"] = best["mac_per_s"]
                out["register_peak_runs"] = runs
            out["peak_dot_s"], out["peak_dot_cpu_per_wall"] = best["s"], best["cpu_per_wall"]
        except Exception as e:  # signature differs: report, do not guess
            out["peak_dot_error"] = str(e)
    if hasattr(kern, "gemm_ternary"):
        try:
            from bitnet_cpu.simd.layout import pack_ternary, padded_shape

            n, k, m = 512, 2560, 64  # 320 KiB of codes: resident in the two 1 MiB L2 caches
            rng = np.random.default_rng(0)
            w = pack_ternary(rng.integers(-1, 2, size=(n, k), dtype=np.int8))
            n_pad, k_pad = padded_shape(n, k)
            scale = np.ones(n_pad, dtype=np.float32)
            xq = rng.integers(-127, 128, size=(m, k_pad), dtype=np.int8)
            act_scale = np.ones(m, dtype=np.float32)
            act_sum = xq.sum(axis=1, dtype=np.int32)
            res = np.empty((m, n), dtype=np.float32)
            kern.gemm_ternary(w, scale, xq, act_scale, act_sum, res)
            reps, best = 20, float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps):
                    kern.gemm_ternary(w, scale, xq, act_scale, act_sum, res)
                best = min(best, (time.perf_counter() - t0) / reps)
            out["gemm_ternary_l2_mac_per_s"] = m * n * k / best
            out["gemm_ternary_l2_shape"] = [m, n, k]
        except Exception as e:
            out["gemm_ternary_error"] = str(e)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1024, help="buffer size for the bandwidth test (MiB)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--peak-passes", type=int, default=5, help="passes of the int8 peak loop (the best counts)")
    a = ap.parse_args(argv)
    res = {"threads": a.threads}
    res.update(stream_bandwidth(a.threads, a.mib, a.passes))
    res["int8"] = int8_peak(a.threads, a.peak_passes)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    # threads must be fixed before numpy/OpenMP start their pools
    for i, arg in enumerate(sys.argv):
        if arg == "--threads" and i + 1 < len(sys.argv):
            for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                os.environ[var] = sys.argv[i + 1]
    sys.exit(main())
