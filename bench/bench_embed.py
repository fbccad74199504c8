"""Embeddings benchmark: embeddings per second for --texts texts of --tokens tokens (default 64 x 100), `bitnet serve`
vs llama.cpp's `llama-server --embeddings --pooling mean` on the same synthetic 2B-4T-shaped TQ2_0 file
(bench/make_models.py; ours serves the store converted from it), --threads 2 each, same machine, same run.
Writes bench/EMBED_RESULTS.md and bench/embed_results.json.

    python bench/bench_embed.py [--texts 64] [--tokens 100] [--batch 16] [--threads 2] [--repeats 3]
                                [--shape 2b4t|small] [--llama-server PATH] [--engines ours,llama]

The texts are random token ids (the same ids to both servers, as /v1/embeddings `input` token lists, so no tokenizer
is timed), sent as ceil(texts / batch) requests of --batch texts, all at once (a RAG indexer's shape: LangChain and
LlamaIndex send lists). Both servers run at once (idle while the other is timed): one warm-up request each, then the
repeats in turns, the order alternating, so both see the same machine load; a repeat times the first request sent to
the last answer; embeddings/s = texts / that time (best and median of the repeats). Both servers mean-pool the
final-norm states and L2-normalise (engine/runtime/embed.py): the report also gives the cosine of each text's two
vectors, which says the two compute the same thing (different kernels' rounding: close to 1, not equal).
llama-server is looked for at --llama-server, $LLAMA_SERVER, bench/cache/llama-server (bench/setup_llama_server.sh
builds it), bench/cache/llama-server-bin/llama-server, PATH; if absent the benchmark says so and runs ours only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_serve import free_port, stop_server, wait_healthy  # noqa: E402
from make_models import DEFAULT_CACHE, model_paths  # noqa: E402


def find_llama_server(arg: str | None, cache: str) -> str | None:
    for p in (arg, os.environ.get("LLAMA_SERVER"), os.path.join(cache, "llama-server"),
              os.path.join(cache, "llama-server-bin", "llama-server"), shutil.which("llama-server")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def texts(n: int, length: int, seed: int = 0, vocab: int = 30000) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(min(100, vocab // 4), min(30000, vocab), length).tolist() for _ in range(n)]


def vocab_size(store_path: str) -> int:
    from bitnet_cpu.engine.formats.store import Store
    st = Store(store_path, load="mmap")
    try:
        return st.config.vocab_size
    finally:
        st.close()


def batches(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


def server_cmd(engine: str, a, paths, port: int, llama_bin: str | None) -> list[str]:
    ctx = a.tokens + 32
    if engine == "ours":
        return [sys.executable, "-m", "bitnet_cpu", "serve", "-m", paths["store_q4"], "-t", str(a.threads),
                "--parallel", "16", "-c", str(ctx), "--port", str(port), "--max-queue", "256"]
    return [llama_bin, "-m", paths["tq2_0"], "-t", str(a.threads), "-tb", str(a.threads), "-np", "16",
            "-c", str(16 * ctx), "--embeddings", "--pooling", "mean", "--host", "127.0.0.1", "--port", str(port),
            "--no-webui"]


async def embed_all(url: str, groups: list[list[list[int]]]) -> tuple[float, list[list[float]]]:
    """Send every group as one /v1/embeddings request, all at once; (seconds to the last answer, vectors in order)."""
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=len(groups) + 4)) as c:
        async def one(group):
            r = await c.post("/v1/embeddings", json={"input": group, "encoding_format": "float", "model": "m"})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            data = sorted(r.json()["data"], key=lambda d: d["index"])
            if len(data) != len(group):
                raise RuntimeError(f"{len(group)} inputs, {len(data)} vectors")
            return [d["embedding"] for d in data]
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(g) for g in groups))
        return time.perf_counter() - t0, [v for vs in out for v in vs]


def run_engines(engines: list[str], a, paths, llama_bin) -> dict:
    """Start every engine's server (idle ones cost nothing), warm each up, then time them in turns, the order
    alternating each repeat, so the engines see the same machine load (other jobs may share it)."""
    procs, urls = {}, {}
    try:
        for eng in engines:
            port = free_port()
            urls[eng] = f"http://127.0.0.1:{port}"
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")) \
                if eng == "ours" else None
            procs[eng] = subprocess.Popen(server_cmd(eng, a, paths, port, llama_bin), cwd=ROOT, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        vocab = vocab_size(paths["store_q4"])
        groups = batches(texts(a.texts, a.tokens, a.seed, vocab), a.batch)
        for eng in engines:
            wait_healthy(urls[eng], procs[eng])
            asyncio.run(embed_all(urls[eng], batches(texts(2, a.tokens, a.seed + 1, vocab), 2)))   # warm-up
        walls = {eng: [] for eng in engines}
        vectors = {}
        for rep in range(a.repeats):
            for eng in (engines if rep % 2 == 0 else engines[::-1]):
                wall, vecs = asyncio.run(embed_all(urls[eng], groups))
                walls[eng].append(wall)
                vectors.setdefault(eng, vecs)
                print(f"  {eng:5s} {a.texts / wall:7.2f} embeddings/s ({a.texts} x {a.tokens} tokens in {wall:.2f} s, "
                      f"load {os.getloadavg()[0]:.1f})", flush=True)
        return {eng: {"walls_s": walls[eng], "eps_best": a.texts / min(walls[eng]),
                      "eps_median": a.texts / statistics.median(walls[eng]), "dim": len(vectors[eng][0]),
                      "vectors": vectors[eng]} for eng in engines}
    finally:
        for proc in procs.values():
            stop_server(proc)


def cosines(u: list[list[float]], v: list[list[float]]) -> list[float]:
    import numpy as np
    a, b = np.asarray(u, np.float64), np.asarray(v, np.float64)
    return (np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).tolist()


def report(res: dict, out_dir: str) -> str:
    lines = ["# Embeddings benchmark (bench/bench_embed.py)", "", res["note"], "",
             "| engine | embeddings/s (best) | embeddings/s (median) | runs (s) |", "|---|---:|---:|---|"]
    for eng, r in res["engines"].items():
        lines.append(f"| {eng} | {r['eps_best']:.2f} | {r['eps_median']:.2f} | "
                     f"{', '.join(f'{w:.2f}' for w in r['walls_s'])} |")
    if "ratio" in res:
        lines += ["", f"ours / llama-server (best): **{res['ratio']:.2f}x**; cosine of the two servers' vectors per "
                      f"text: min {res['cos_min']:.6f}, median {res['cos_median']:.6f}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "EMBED_RESULTS.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "embed_results.json"), "w") as f:
        json.dump({**res, "engines": {k: {x: y for x, y in r.items() if x != "vectors"}
                                      for k, r in res["engines"].items()}}, f, indent=1)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per text")
    ap.add_argument("--batch", type=int, default=16, help="texts per request (all requests are sent at once)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", default="2b4t", help="bench/make_models.py's shape: 2b4t (the benchmark) or small")
    ap.add_argument("--engines", default="ours,llama")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--cache", default=DEFAULT_CACHE, type=os.path.abspath)
    ap.add_argument("--out-dir", default=HERE)
    a = ap.parse_args(argv)
    paths = model_paths(a.cache, a.shape)
    if not (os.path.exists(paths["tq2_0"]) and os.path.exists(paths["store_q4"])):
        print(f"no benchmark models in {a.cache}: run python bench/make_models.py --shape {a.shape} --heads q4 first",
              file=sys.stderr)
        return 2
    engines = a.engines.split(",")
    llama_bin = find_llama_server(a.llama_server, a.cache) if "llama" in engines else None
    missing = ""
    if "llama" in engines and not llama_bin:
        print("llama-server not found (bash bench/setup_llama_server.sh builds it; --llama-server PATH): ours only")
        engines = [e for e in engines if e != "llama"]
        missing = " llama-server was not available for this run: ours only, no ratio."
    load = os.getloadavg()
    res = {"texts": a.texts, "tokens": a.tokens, "batch": a.batch, "threads": a.threads, "shape": a.shape,
           "engines": {},
           "note": f"Machine: {os.cpu_count()} cores, load average at start {load[0]:.1f} (shared: other jobs may run "
                   f"at the same time; the ratio is what means something). {a.texts} texts of {a.tokens} random "
                   f"token ids, {a.batch} per request, all requests at once; {a.threads} threads each, engines "
                   f"timed in alternating turns; model "
                   f"{os.path.basename(paths['tq2_0'])} (ours: its q4 store); llama-server --embeddings --pooling "
                   f"mean -np 16." + missing}
    for eng, r in run_engines(engines, a, paths, llama_bin).items():
        res["engines"]["bitnet serve" if eng == "ours" else "llama-server"] = r
    if len(res["engines"]) == 2:
        o, ll = res["engines"]["bitnet serve"], res["engines"]["llama-server"]
        res["ratio"] = o["eps_best"] / ll["eps_best"]
        cs = cosines(o["vectors"], ll["vectors"])
        res["cos_min"], res["cos_median"] = min(cs), statistics.median(cs)
    res["note"] += f" Load average at end {os.getloadavg()[0]:.1f}."
    print(report(res, a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
