"""Run a llama-bench binary (llama.cpp's, or ik_llama.cpp's) once and read its JSON: the peers timed by their own
benchmark tool, for bench_threads.py and decode_rows.py (no llama-cpp-python needed)."""
from __future__ import annotations

import json
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def llama_bench(bench: str, model: str, threads: int, decode: int, extra: tuple[str, ...] = (),
                prompt: int = 512) -> dict:
    """pp<prompt> (0: none) and tg<decode> in one process, one repetition: {"prefill_tps": {"512": ...},
    "decode_tps": ..., "wall_s", "threads_used"}, or {"error": "exit N: last lines", "cmd"}. ik_llama.cpp gets
    extra=("-rtr", "1"): IQ2_BN repacked to IQ2_BN_R4 at load, what its author recommends."""
    cmd = [bench, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(decode), "-r", "1", "-o", "json",
           *extra]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s", "cmd": " ".join(cmd)}
    try:
        tests = json.loads(r.stdout[r.stdout.index("["):])
    except ValueError:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        return {"error": f"exit {r.returncode}: {tail}", "cmd": " ".join(cmd)}
    out: dict = {"prefill_tps": {}, "wall_s": time.perf_counter() - t0, "threads_used": threads}
    for t in tests:
        if t.get("n_gen", 0) == 0 and t.get("n_prompt"):
            out["prefill_tps"][str(t["n_prompt"])] = t["avg_ts"]
        elif t.get("n_prompt", 0) == 0 and t.get("n_gen"):
            out["decode_tps"] = t["avg_ts"]
    return out
