"""Static throughput of the decode GEMV bodies' inner loops on CPUs this machine is not (not a test): each
kernel file is compiled to assembly with setup.py's flags, the innermost loops of the named bodies that do
dot products are cut out, and llvm-mca's scheduling models of those cores say how many cycles one iteration
needs when nothing waits for memory. Bytes per iteration are the loop's full-width vector loads (the weight
stream; broadcasts of activations are not counted), so bytes/cycle x clock is the body's compute ceiling, to
hold against one core's DRAM rate: where it is far above, the body waits on memory, not on its unpack.

    python bench/mca_bodies.py                          # Sapphire Rapids, Ice Lake server, Zen 4
    python bench/mca_bodies.py --cpus sapphirerapids,znver4 --ghz 2.5 --ports

Needs llvm-mca with those models (LLVM 17+: `apt-get install llvm-19`); gcc as the build uses.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KDIR = os.path.join(ROOT, "simd", "kernels")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-I", KDIR]   # setup.py's, without warnings
BODIES = [  # (file, function)
    ("gemv_ternary.c", "gemv_ternary_avx512"),
    ("gemv_ternary.c", "gemv_ternary_avx2"),
    ("gemv_b3.c", "gemv_b3_avx512"),
    ("gemv_q4g.c", "q4g_avx512"),
    ("gemv_rows.c", "ternary_rows_avx512"),
]
DOT = re.compile(r"\b(vpdpbusds?|vpmaddubsw)\b")
MEM = re.compile(r"(-?\d*\(%\w+(?:,%\w+)?(?:,\d)?\))(?!\{1to)")   # a memory operand, not a broadcast
DEST = re.compile(r"%([xyz])mm\d+\s*$")
WIDTH = {"x": 16, "y": 32, "z": 64}


def stream_bytes(body: list[str]) -> int:
    """Bytes of the loop's full-width vector loads (each address once: a line both masked and shifted from
    memory is read once); broadcasts, prefetches and stores are not the weight stream."""
    seen = {}
    for ln in body:
        op = ln.split()[0] if ln.split() else ""
        if op.startswith(("vpbroadcast", "vbroadcast", "prefetch")) or op in ("vmovd", "vmovq") or "{1to" in ln:
            continue
        m, d = MEM.search(ln), DEST.search(ln)
        if m and d:   # AT&T: a memory source and a vector register written last (a store ends in memory)
            seen[m.group(1)] = WIDTH[d.group(1)]
    return sum(seen.values())


def find_mca() -> str | None:
    for name in ("llvm-mca-19", "llvm-mca-20", "llvm-mca-21", "llvm-mca-22", "llvm-mca-18", "llvm-mca-17", "llvm-mca"):
        if shutil.which(name):
            return name
    return None


def function_lines(asm: str, fn: str) -> list[str]:
    m = re.search(rf"^{re.escape(fn)}:\n(.*?)^\s*\.size\s+{re.escape(fn)},", asm, re.S | re.M)
    if not m:
        return []
    keep = []
    for ln in m.group(1).splitlines():
        s = ln.strip()
        if not s or s.startswith("#") or (s.startswith(".") and not s.endswith(":")):
            continue   # comments, #APP markers and directives; labels stay
        keep.append(ln)
    return keep


def innermost_dot_loops(lines: list[str]) -> list[list[str]]:
    """Loops as [label .. backward jump to it] ranges with no other loop inside that do a dot product."""
    labels = {ln.strip()[:-1]: i for i, ln in enumerate(lines) if ln.strip().endswith(":")}
    loops = []
    for j, ln in enumerate(lines):
        m = re.match(r"\s*j\w+\s+(\.L\w+)\s*$", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            loops.append((labels[m.group(1)], j))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    out = []
    for a, b in inner:
        body = [ln for ln in lines[a + 1:b + 1] if not ln.strip().endswith(":")]
        if any(DOT.search(ln) for ln in body):
            out.append(body)
    return out


def mca(tool: str, body: list[str], cpu: str, ports: bool) -> tuple[float, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(body) + "\n")
        path = f.name
    try:
        r = subprocess.run([tool, f"-mcpu={cpu}", "-iterations=400", path], capture_output=True, text=True,
                           timeout=120)
    finally:
        os.unlink(path)
    if r.returncode != 0:
        return float("nan"), r.stderr.strip().splitlines()[0] if r.stderr.strip() else "llvm-mca failed"
    it = int(re.search(r"Iterations:\s+(\d+)", r.stdout).group(1))
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", r.stdout).group(1))
    pressure = ""
    if ports:
        m = re.search(r"Resource pressure per iteration:\n(.*?)\n(.*?)\n", r.stdout, re.S)
        if m:
            pressure = "ports " + " ".join(f"{h}={v}" for h, v in zip(m.group(1).split(), m.group(2).split())
                                           if v not in ("-", "0.00"))
    return cycles / it, pressure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", default="sapphirerapids,icelake-server,znver4")
    ap.add_argument("--ghz", type=float, default=2.5, help="clock for the GB/s column (default 2.5)")
    ap.add_argument("--ports", action="store_true", help="also the resource pressure per iteration")
    a = ap.parse_args(argv)
    tool = find_mca()
    if tool is None:
        print("mca_bodies: llvm-mca not found (apt-get install llvm-19: models of Sapphire Rapids and Zen 4)",
              file=sys.stderr)
        return 2
    cpus = a.cpus.split(",")
    print(f"{tool}; gcc {subprocess.run(['gcc', '-dumpfullversion'], capture_output=True, text=True).stdout.strip()}"
          f" {' '.join(FLAGS[:3])}; GB/s at {a.ghz} GHz, no memory stalls")
    print(f"{'body':26s} {'loop':>4s} {'instr':>5s} {'bytes':>5s}  " + "  ".join(f"{c:>22s}" for c in cpus))
    with tempfile.TemporaryDirectory() as tmp:
        asm_of = {}
        for fname, fn in BODIES:
            if fname not in asm_of:
                out = os.path.join(tmp, fname + ".s")
                subprocess.run(["gcc", *FLAGS, "-S", "-o", out, os.path.join(KDIR, fname)], check=True)
                asm_of[fname] = open(out).read()
            loops = innermost_dot_loops(function_lines(asm_of[fname], fn))
            if not loops:
                print(f"{fn:26s} (no dot-product loop found: not compiled for this target?)")
            for i, body in enumerate(loops):
                nbytes = stream_bytes(body)
                cells, notes = [], []
                for cpu in cpus:
                    cyc, pressure = mca(tool, body, cpu, a.ports)
                    gbs = nbytes / cyc * a.ghz if cyc == cyc and nbytes else float("nan")
                    cells.append(f"{cyc:6.1f} cyc {gbs:6.1f} GB/s")
                    if pressure:
                        notes.append(f"    {cpu}: {pressure}")
                print(f"{fn:26s} {i:>4d} {len(body):>5d} {nbytes:>5d}  " + "  ".join(f"{c:>22s}" for c in cells))
                for n in notes:
                    print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
