"""What a long prompt costs the streams already decoding, per `bitnet serve -b` (tokens a batched step computes).

    python bench/serve_stall.py [--store bench/cache/2b4t.q4.bnstore] [--threads 2] [--streams 12] [--gen 160]
                                [--prompt 1500] [--batch 64,128,256] [--rounds 1] [--json F]

For each -b (alternating order over the rounds) a fresh `bitnet serve` on 127.0.0.1 gets `--streams` streaming
greedy completions of `--gen` tokens (short prompts, eos ignored); once every stream has its first token, one
request with a `--prompt`-token random prompt arrives (max_tokens 1). Reported: the streams' gaps between
tokens (median, p99, max: a step that reads prompt rows holds every stream), the long prompt's answer time (its
time to first token under that load), and, with no streams, the same prompt alone. Every server, client and wait
is bounded in time; the server is stopped after each run. Not a test: a noisy machine moves the figures, compare
the -b values of one run. engine/batching's default_batch_tokens() quotes its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_serve import free_port, stop_server, wait_healthy  # noqa: E402
from make_models import DEFAULT_CACHE  # noqa: E402

TIMEOUT = 600.0   # seconds any one request, server start or run may take


def start(store: str, threads: int, batch: int, ctx: int) -> tuple[subprocess.Popen, str]:
    """bitnet serve -b batch on a free loopback port, healthy (bench_serve's port and wait)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "-m", store, "-t", str(threads),
                             "--parallel", "16", "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port),
                             "-b", str(batch)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, TIMEOUT)
    except RuntimeError:
        proc.kill()
        raise
    return proc, f"http://127.0.0.1:{port}"


def run_one(url: str, streams: int, gen: int, prompt: list[int], vocab: int) -> dict:
    """The streams, then the long prompt once every stream has a token; gaps in seconds, the prompt's time."""
    import httpx
    gaps: list[float] = []
    lock = threading.Lock()
    started = threading.Barrier(streams + 1, timeout=TIMEOUT) if streams else None
    errors: list[str] = []

    def stream(i: int):
        body = {"prompt": [(100 + i) % vocab, 200 % vocab, 300 % vocab, 400 % vocab], "max_tokens": gen,
                "temperature": 0, "stream": True, "ignore_eos": True}
        last = None
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if last is None:   # the first token: wait for the others, count gaps from there
                        started.wait()
                    else:
                        with lock:
                            gaps.append(time.perf_counter() - last)
                    last = time.perf_counter()
        except Exception as e:   # a broken run says so in its row instead of hanging the others
            errors.append(f"stream {i}: {e}")
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    if started:
        started.wait()
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                   timeout=TIMEOUT)
    answer = time.perf_counter() - t0
    r.raise_for_status()
    for t in threads:
        t.join(TIMEOUT)
    if errors:
        raise RuntimeError("; ".join(errors))
    g = sorted(gaps)
    pick = (lambda q: g[min(len(g) - 1, int(q * len(g)))]) if g else (lambda q: float("nan"))
    return {"answer_s": answer, "gap_p50_s": pick(0.5), "gap_p99_s": pick(0.99), "gap_max_s": g[-1] if g else
            float("nan"), "gaps": len(g)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=os.path.join(DEFAULT_CACHE, "2b4t.q4.bnstore"), type=os.path.abspath)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=12, help="streams decoding when the long prompt arrives (<= 15)")
    ap.add_argument("--gen", type=int, default=160, help="tokens each stream generates")
    ap.add_argument("--prompt", type=int, default=1500, help="tokens of the long prompt")
    ap.add_argument("--batch", default="64,128,256", help="bitnet serve -b values to compare")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not os.path.exists(a.store):
        print(f"serve_stall: no store {a.store}: run python bench/make_models.py first", file=sys.stderr)
        return 2
    if not 1 <= a.streams <= 15:
        print("serve_stall: --streams takes 1..15 (16 sequences run at once, one is the long prompt)", file=sys.stderr)
        return 2
    batches = [int(b) for b in a.batch.split(",")]
    ctx = max(a.prompt + 8, a.gen + 16)
    from bitnet_cpu.engine.formats.store import Store
    with Store(a.store) as st:
        vocab = min(st.config.vocab_size, 30000)   # prompt ids the model has
    rng = np.random.default_rng(0)
    rows: dict[int, list[dict]] = {b: [] for b in batches}
    for r in range(a.rounds):
        for b in (batches if r % 2 == 0 else batches[::-1]):
            proc, url = start(a.store, a.threads, b, ctx)
            try:
                loaded = run_one(url, a.streams, a.gen, rng.integers(3, vocab, a.prompt).tolist(), vocab)
                alone = run_one(url, 0, a.gen, rng.integers(3, vocab, a.prompt).tolist(), vocab)
            finally:
                stop_server(proc)
            rows[b].append({**loaded, "alone_s": alone["answer_s"]})
            print(f"-b {b}: {a.streams} streams' gaps median {1e3 * loaded['gap_p50_s']:.0f} ms, p99 "
                  f"{1e3 * loaded['gap_p99_s']:.0f} ms, max {1e3 * loaded['gap_max_s']:.0f} ms; the {a.prompt}-token "
                  f"prompt answered in {loaded['answer_s']:.2f} s ({alone['answer_s']:.2f} s alone)", flush=True)
    print(f"\n{a.streams} streams of {a.gen} tokens, then a {a.prompt}-token prompt; {a.threads} threads, "
          f"{os.path.basename(a.store)}, load {os.getloadavg()[0]:.1f}; {a.rounds} round(s), medians")
    print("| -b | gap p50 (ms) | gap p99 (ms) | gap max (ms) | prompt under load (s) | prompt alone (s) |")
    print("|---|---|---|---|---|---|")
    for b in batches:
        med = {k: float(np.median([x[k] for x in rows[b]])) for k in rows[b][0] if k != "gaps"}
        print(f"| {b} | {1e3 * med['gap_p50_s']:.0f} | {1e3 * med['gap_p99_s']:.0f} | {1e3 * med['gap_max_s']:.0f} | "
              f"{med['answer_s']:.2f} | {med['alone_s']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"streams": a.streams, "gen": a.gen, "prompt": a.prompt, "threads": a.threads,
                       "store": a.store, "runs": {str(b): v for b, v in rows.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
