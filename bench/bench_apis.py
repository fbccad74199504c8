"""What each HTTP API of `bitnet serve` costs over the same engine: the same streaming load through OpenAI's chat
completions, OpenAI's Responses API, Anthropic's Messages API and llama-server's /completion, on one server.

    python bench/bench_apis.py [--store bench/cache/2b4t.q4.bnstore | --store bundled] [--threads 2] [--clients 16]
                               [--requests 2] [--gen 64] [--rounds 3] [--apis chat,responses,messages,completion]
                               [--json F] [--router]

Each round runs every API once, in a rotated order: `--clients` threads each send `--requests` streaming greedy
requests of `--gen` tokens back to back (a short user question that differs per client, end of text ignored, so
every API makes the same tokens). Reported per API: aggregate tokens/s (min / median / max over the rounds), the
median time to the first text, and the ratio of its median rate to chat's. The adapters (serve/responses.py,
serve/anthropic.py, serve/llama_api.py) translate each request and build one SSE event per token; on the bundled
model (a step takes well under a millisecond) that translation is the largest share it can ever be, on the
2B-4T shape the smallest. `--router` adds a row "router": chat's requests through `bitnet serve --models-dir`
(serve/router.py) with the same model in its directory, started beside the plain server: what forwarding every
byte through a second process costs. Loopback only; every request and wait is bounded in time; the server is stopped at the
end. Not a test: compare the APIs of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_serve import free_port, stop_server, wait_healthy  # noqa: E402
from make_models import DEFAULT_CACHE  # noqa: E402

TIMEOUT = 600.0   # seconds any one request, the server's start or a round may take


def question(i: int) -> str:
    return f"Tell me about the number {17 + 31 * i}."


def request_of(api: str, i: int, gen: int) -> tuple[str, dict]:
    """(path, body) of client i's streaming request through `api`: greedy, `gen` tokens, end of text ignored."""
    q = [{"role": "user", "content": question(i)}]
    common = {"temperature": 0, "ignore_eos": True, "stream": True}
    if api in ("chat", "router"):
        return "/v1/chat/completions", {"messages": q, "max_tokens": gen, **common,
                                        "stream_options": {"include_usage": True}}
    if api == "responses":
        return "/v1/responses", {"input": question(i), "max_output_tokens": gen, **common}
    if api == "messages":
        return "/v1/messages", {"model": "m", "messages": q, "max_tokens": gen, **common}   # Anthropic's: required
    if api == "completion":
        return "/completion", {"prompt": question(i), "n_predict": gen, **common}
    raise SystemExit(f"--apis: unknown API {api!r} (chat, responses, messages, completion)")


def text_and_count(api: str, data: dict) -> tuple[bool, int | None]:
    """(this event carries answer text, the answer's token count if this event reports it)."""
    if api in ("chat", "router"):
        if data.get("usage"):
            return False, data["usage"]["completion_tokens"]
        ch = data.get("choices") or [{}]
        return bool((ch[0].get("delta") or {}).get("content")), None
    if api == "responses":
        kind = data.get("type")
        if kind in ("response.completed", "response.incomplete"):
            return False, data["response"]["usage"]["output_tokens"]
        return kind == "response.output_text.delta", None
    if api == "messages":
        kind = data.get("type")
        if kind == "message_delta":
            return False, data["usage"]["output_tokens"]
        return kind == "content_block_delta", None
    if data.get("stop"):
        return bool(data.get("content")), data["tokens_predicted"]
    return bool(data.get("content")), None


def run_api(url: str, api: str, clients: int, requests: int, gen: int) -> dict:
    import httpx
    ttfts: list[float] = []
    counts: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int):
        try:
            with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
                for _ in range(requests):
                    path, body = request_of(api, i, gen)
                    t0, first, n = time.perf_counter(), None, None
                    with c.stream("POST", path, json=body) as r:
                        if r.status_code != 200:
                            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.read()[:200]!r}")
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            has_text, count = text_and_count(api, json.loads(line[6:]))
                            if has_text and first is None:
                                first = time.perf_counter() - t0
                            n = count if count is not None else n
                    with lock:
                        ttfts.append(first if first is not None else float("nan"))
                        counts.append(n or 0)
        except Exception as e:   # a broken client says so in the row instead of hanging the others
            errors.append(f"client {i}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    wall = time.perf_counter() - t0
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"{api}: " + "; ".join(errors[:3] or ["a client did not finish in time"]))
    return {"tok_s": sum(counts) / wall, "ttft_ms": float(np.nanmedian(ttfts)) * 1000, "tokens": sum(counts),
            "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=os.path.join(DEFAULT_CACHE, "2b4t.q4.bnstore"),
                    help="a weight store, or 'bundled' for the bundled model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--apis", default="chat,responses,messages,completion")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--router", action="store_true", help="add chat through `bitnet serve --models-dir` (a row 'router')")
    a = ap.parse_args(argv)
    apis = [x for x in a.apis.split(",") if x]
    for api in apis:
        request_of(api, 0, 1)   # an unknown name stops here, before a server starts
    if a.store != "bundled" and not os.path.exists(a.store):
        raise SystemExit(f"--store {a.store}: no such file (python bench/make_models.py --heads q4 --no-f16)")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    store = os.path.join(ROOT, "models", "default.bnstore") if a.store == "bundled" else os.path.abspath(a.store)
    flags = ["-t", str(a.threads), "--parallel", str(max(a.clients, 1)), "--host", "127.0.0.1"]

    def start(model_args: list) -> tuple[subprocess.Popen, str]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", *model_args, *flags, "--port", str(port)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return proc, f"http://127.0.0.1:{port}"

    procs, urls = [], {}
    tmp = tempfile.mkdtemp(prefix="bench-apis-")
    res: dict[str, list[dict]] = {api: [] for api in apis + (["router"] if a.router else [])}
    try:
        proc, url = start(["-m", store])
        procs.append(proc)
        urls = {api: url for api in apis}
        if a.router:
            os.symlink(store, os.path.join(tmp, os.path.basename(store)))
            rproc, urls["router"] = start(["--models-dir", tmp])
            procs.append(rproc)
            wait_healthy(urls["router"], rproc, TIMEOUT)
        wait_healthy(url, proc, TIMEOUT)
        for api in res:   # warm: first requests compile nothing, but page in (and load the router's model)
            run_api(urls[api], api, min(a.clients, 4), 1, 8)
        names = list(res)
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for api in order:
                res[api].append(run_api(urls[api], api, a.clients, a.requests, a.gen))
                print(f"round {r + 1} {api:<11} {res[api][-1]['tok_s']:8.1f} tok/s  ttft "
                      f"{res[api][-1]['ttft_ms']:7.1f} ms", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    base = float(np.median([x["tok_s"] for x in res.get("chat", [])])) if "chat" in res else None
    print(f"\n{a.clients} clients x {a.requests} streaming requests of {a.gen} tokens, {a.threads} threads, "
          f"{os.path.basename(a.store)}, {a.rounds} rounds (alternating order)\n")
    print("| API | tok/s min / median / max | time to first text, median | vs chat |")
    print("|---|---|---|---|")
    for api in res:
        rates = [x["tok_s"] for x in res[api]]
        med = float(np.median(rates))
        ratio = f"{med / base:.3f}x" if base else "-"
        print(f"| {api} | {min(rates):.1f} / {med:.1f} / {max(rates):.1f} | "
              f"{np.median([x['ttft_ms'] for x in res[api]]):.0f} ms | {ratio} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
