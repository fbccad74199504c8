"""Serving benchmark: the same HTTP load against `bitnet serve` and llama.cpp's `llama-server` (-np 16 -cb) on
the same synthetic 2B-4T-shaped TQ2_0 file (bench/make_models.py; ours serves the store converted from it),
2 threads each, same machine, same run. Writes bench/SERVE_RESULTS.md, bench/serve_results.png/.json.

    python bench/bench_serve.py [--levels 1,16] [--gen 128] [--prompt 32] [--threads 2] [--requests 2]
                                [--llama-server PATH] [--engines ours,llama]

At each concurrency C, C clients each send --requests streaming /v1/completions requests back to back
(distinct random 32-token prompts as token ids, greedy, max_tokens=128, ignore_eos). Measured per level:
  aggregate tok/s   all completion tokens / wall time from the first request to the last token
  TTFT p50 / p99    request sent -> first streamed token, over all requests of the level
llama-server is looked for at --llama-server, $LLAMA_SERVER, bench/cache/llama-server-bin/llama-server, PATH;
if absent the benchmark says so and runs ours only. The machine may be shared: ratios from the same run are
what mean something; the report records the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from make_models import bench_parser, model_paths  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_llama_server(arg: str | None, cache: str) -> str | None:
    for p in (arg, os.environ.get("LLAMA_SERVER"), os.path.join(cache, "llama-server-bin", "llama-server"),
              shutil.which("llama-server")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30000, length).tolist() for _ in range(n)]


def start(engine: str, a, paths, port: int, llama_bin: str | None) -> subprocess.Popen:
    ctx = a.prompt + a.gen + 32
    if engine == "ours":
        cmd = [sys.executable, "-m", "bitnet_cpu", "serve", "-m", paths["store_q4"], "-t", str(a.threads),
               "--parallel", "16", "-c", str(ctx), "--port", str(port), "--max-queue", "256",
               *(["-b", str(a.batch_size)] if a.batch_size else [])]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    else:
        cmd = [llama_bin, "-m", paths["tq2_0"], "-t", str(a.threads), "-tb", str(a.threads), "-np", "16", "-cb",
               "-c", str(16 * ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
        env = dict(os.environ)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server not healthy in time")


async def one_request(client, ids, gen) -> dict:
    t0 = time.perf_counter()
    first, n, usage = None, 0, None
    body = {"prompt": ids, "max_tokens": gen, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            ch = ev.get("choices") or []
            if ch and ch[0].get("text"):
                if first is None:
                    first = time.perf_counter()
                n += 1
    t1 = time.perf_counter()
    toks = usage["completion_tokens"] if usage and usage.get("completion_tokens") else n
    return {"ttft": (first or t1) - t0, "tokens": toks, "end": t1}


async def level(url: str, conc: int, reqs: int, a, seed: int) -> dict:
    import httpx
    ps = prompts(conc * reqs, a.prompt, seed)
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=conc + 4)) as c:
        async def client(i):
            for k in range(reqs):
                results.append(await one_request(c, ps[i * reqs + k], a.gen))
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(conc)))
        wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in results)
    pct = lambda q: ttft[min(len(ttft) - 1, int(round(q * (len(ttft) - 1))))]  # noqa: E731
    toks = sum(r["tokens"] for r in results)
    return {"concurrency": conc, "requests": len(results), "tokens": toks, "wall_s": wall, "agg_tps": toks / wall,
            "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99)}


def run_engine(engine, a, paths, llama_bin, levels) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(engine, a, paths, port, llama_bin)
    try:
        t0 = time.perf_counter()
        wait_healthy(url, proc)
        load_s = time.perf_counter() - t0
        asyncio.run(level(url, 1, 1, argparse.Namespace(prompt=a.prompt, gen=8), seed=99))  # warm-up
        out = {"load_s": load_s, "levels": []}
        for conc in levels:
            reqs = a.requests if conc == 1 else max(1, a.requests // 2)
            r = asyncio.run(level(url, conc, reqs, a, seed=conc))
            print(f"  {engine:5s} C={conc:<3d} {r['agg_tps']:7.2f} tok/s  TTFT p50 {r['ttft_p50_s']:.2f}s "
                  f"p99 {r['ttft_p99_s']:.2f}s  ({r['requests']} req, {r['tokens']} tok, {r['wall_s']:.0f}s)", flush=True)
            out["levels"].append(r)
        return out
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (both servers drain and exit on it), SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def report(res: dict, out_dir: str):
    lines = ["# Serving benchmark (bench/bench_serve.py)", "",
             f"{res['note']}", "",
             "| engine | concurrency | aggregate tok/s | TTFT p50 (s) | TTFT p99 (s) | requests |",
             "|---|---:|---:|---:|---:|---:|"]
    for eng, r in res["engines"].items():
        for lv in r["levels"]:
            lines.append(f"| {eng} | {lv['concurrency']} | {lv['agg_tps']:.2f} | {lv['ttft_p50_s']:.2f} | "
                         f"{lv['ttft_p99_s']:.2f} | {lv['requests']} |")
    if "ratios" in res:
        lines += ["", "| concurrency | tok/s ours / llama-server | TTFT p50 llama-server / ours |", "|---:|---:|---:|"]
        for c, (rt, rf) in res["ratios"].items():
            lines.append(f"| {c} | {rt:.2f}x | {rf:.2f}x |")
    os.makedirs(out_dir, exist_ok=True)   # --out-dir may name a folder not made yet
    with open(os.path.join(out_dir, "SERVE_RESULTS.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "serve_results.json"), "w") as f:
        json.dump(res, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install .[bench])")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for (eng, r), color in zip(res["engines"].items(), ("tab:blue", "tab:orange")):
        cs = [lv["concurrency"] for lv in r["levels"]]
        ax1.plot(cs, [lv["agg_tps"] for lv in r["levels"]], "o-", color=color, label=eng)
        ax2.plot(cs, [lv["ttft_p50_s"] for lv in r["levels"]], "o-", color=color, label=f"{eng} p50")
        ax2.plot(cs, [lv["ttft_p99_s"] for lv in r["levels"]], "x--", color=color, label=f"{eng} p99")
    ax1.set(xlabel="concurrent clients", ylabel="aggregate tok/s", title="Throughput over HTTP", xscale="log", xticks=cs)
    ax2.set(xlabel="concurrent clients", ylabel="seconds", title="Time to first token", xscale="log", xticks=cs)
    for ax in (ax1, ax2):
        ax.set_xticklabels([str(c) for c in cs])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{' vs '.join(res['engines'])}, 2B-4T TQ2_0 (synthetic), {res['threads']} threads, {res['gen']} tok/request",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "serve_results.png"), dpi=110)


def main(argv=None) -> int:
    ap = bench_parser(__doc__, levels="1,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client at concurrency 1 (half that above)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="bitnet serve -b: tokens one step computes (default: the server's)")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--replot", action="store_true", help="rewrite the table and PNG from serve_results.json")
    ap.add_argument("--add", action="store_true",
                    help="keep the other engine's numbers from an earlier serve_results.json (say so in the note)")
    a = ap.parse_args(argv)
    if a.replot:
        with open(os.path.join(a.out_dir, "serve_results.json")) as f:
            report(json.load(f), a.out_dir)
        return 0
    paths = model_paths(a.cache)
    if not (os.path.exists(paths["manifest"]) and os.path.exists(paths["store_q4"])):
        print(f"no benchmark models in {a.cache}: run python bench/make_models.py first", file=sys.stderr)
        return 2
    levels = [int(x) for x in a.levels.split(",")]
    engines = a.engines.split(",")
    llama_bin = find_llama_server(a.llama_server, a.cache)
    if "llama" in engines and not llama_bin:
        print("llama-server not found (build it from llama.cpp with -DLLAMA_BUILD_SERVER=ON; --llama-server PATH): "
              "running ours only")
        engines = [e for e in engines if e != "llama"]
        missing = " llama-server was not available for this run (not built): ours only, no ratios."
    else:
        missing = ""
    load = os.getloadavg()
    res = {"threads": a.threads, "gen": a.gen, "prompt": a.prompt, "engines": {},
           "note": f"Machine: {os.cpu_count()} cores, load average at start {load[0]:.1f} (shared: other jobs ran "
                   f"at the same time; compare the ratios). {a.threads} threads each, greedy, {a.prompt}-token "
                   f"prompts, {a.gen} tokens/request." + missing}
    old = os.path.join(a.out_dir, "serve_results.json")
    if a.add and os.path.exists(old):
        with open(old) as f:
            prev = json.load(f)
        res["engines"].update(prev["engines"])
        res["note"] += " (The other engine's rows come from the previous run, minutes earlier.)"
    for eng in engines:
        name = "bitnet serve" if eng == "ours" else "llama-server"
        print(f"{name}:", flush=True)
        res["engines"][name] = run_engine(eng, a, paths, llama_bin, levels)
    res["engines"] = dict(sorted(res["engines"].items()))  # bitnet serve first
    if len(res["engines"]) == 2:
        o, l = res["engines"]["bitnet serve"]["levels"], res["engines"]["llama-server"]["levels"]
        res["ratios"] = {lo["concurrency"]: (lo["agg_tps"] / ll["agg_tps"], ll["ttft_p50_s"] / lo["ttft_p50_s"])
                         for lo, ll in zip(o, l)}
        for c, (rt, rf) in res["ratios"].items():
            print(f"C={c}: throughput ours/llama-server {rt:.2f}x, TTFT p50 llama-server/ours {rf:.2f}x")
    res["note"] += f" Load average at end {os.getloadavg()[0]:.1f}."
    report(res, a.out_dir)
    print(f"wrote {os.path.join(a.out_dir, 'SERVE_RESULTS.md')} and serve_results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
