"""Where our engine's time goes in decode and in prefill: py-spy (sampling, with native C frames) on one
bench/e2e_worker.py session per phase, summarized by the innermost engine / simd frame of each sample.

    python bench/profile_ours.py --model bench/cache/2b4t.i8.bnstore [--threads 2] [--rate 100]

Prints (and bench_e2e.py --profile appends to RESULTS.md) one table per phase. py-spy samples the Python
(main) thread, so time spent there waiting at the end of an OpenMP region for the other kernel thread shows
up as libgomp inside the kernel that ran the region. Needs `pip install py-spy` (optional).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "e2e_worker.py")

# phase -> worker arguments that make that phase dominate the session
PHASES = {
    "warm load + 1-token prompt": ["--prefill", "1", "--decode", "1", "--turns", "0"],
    "decode (16-token prompt, 128 generated)": ["--prefill", "16", "--decode", "128", "--turns", "0"],
    "prefill (512-token prompt)": ["--prefill", "512", "--inner", "3", "--decode", "1", "--turns", "0"],
}
OURS = ("engine/", "simd/", "bk_", "gemv", "gemm", "quantize")


def attribute(frames: list[str]) -> str:
    """Innermost frame that belongs to our code (C kernel, Cython op or engine Python); else the leaf."""
    for f in reversed(frames):
        if any(k in f for k in OURS):
            return f.split(" (")[0] + (" (" + f.split(" (")[1].split(":")[0].split("/")[-1] + ")" if " (" in f else "")
    return frames[-1].split(" (")[0] if frames else "?"


def summarize(raw_path: str, top: int = 12) -> list[tuple[str, float]]:
    counts, total = Counter(), 0
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            total += int(n)
            counts[attribute(stack.split(";"))] += int(n)
    return [(name, 100.0 * n / total) for name, n in counts.most_common(top)] if total else []


def profile_phase(model: str, args: list[str], threads: int, rate: int) -> list[tuple[str, float]] | str:
    if not shutil.which("py-spy"):
        return "py-spy not installed (`pip install py-spy`)"
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "raw.txt")
        cmd = ["py-spy", "record", "--native", "-r", str(rate), "-f", "raw", "-o", raw, "--",
               sys.executable, WORKER, "--engine", "ours", "--model", model, "--threads", str(threads), *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
        if r.returncode != 0 or not os.path.exists(raw):
            return f"py-spy failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
        return summarize(raw)


def markdown(results: dict[str, list[tuple[str, float]] | str]) -> str:
    lines = ["## Profile of our engine (py-spy --native, share of main-thread samples)\n"]
    for phase, res in results.items():
        lines.append(f"**{phase}** (whole session incl. load)\n")
        if isinstance(res, str):
            lines.append(res + "\n")
            continue
        lines.append("| share | innermost engine/simd frame |")
        lines.append("|---|---|")
        lines += [f"| {pct:.1f}% | `{name}` |" for name, pct in res]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=os.path.abspath)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=int, default=100, help="samples per second")
    a = ap.parse_args(argv)
    print(markdown({ph: profile_phase(a.model, args, a.threads, a.rate) for ph, args in PHASES.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
