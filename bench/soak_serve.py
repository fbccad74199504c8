"""A bounded soak of `bitnet serve`: N clients (default 32) for --seconds (default 600) mixing full streams,
streams cancelled after two events, non-streaming requests, ollama /api/chat streams, OpenAI Responses and Anthropic
Messages streams (half of them hung up after two events), malformed requests and
oversized ones (a body over --max-body-mb, a body under it but over what a prompt that fits the context can take,
a prompt over the context), with the project's own async client (httpx).

Reports aggregate tok/s over time (the server's own token counter, sampled every second), p50 / p99 time to
first token of the full streams, the server's RSS over time, the 5xx count (goal 0) and lost requests (goal 0: no
answer at all, or a stream that ended without [DONE] or an error event), into a JSON file and a PNG plot:

    python bench/soak_serve.py --seconds 120            # starts its own server on the bundled model
    python bench/soak_serve.py --url http://host:8080   # an already running server (no RSS then)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = (("stream", 0.30), ("cancel", 0.15), ("plain", 0.15), ("ollama", 0.05), ("responses", 0.05),
         ("messages", 0.05), ("malformed", 0.15), ("oversized", 0.10))
# the last event of a streamed answer in OpenAI's Responses API and Anthropic's Messages API
LAST_EVENT = {"responses": ("response.completed", "response.incomplete", "response.failed"),
              "messages": ("message_stop", "error")}
MALFORMED = [(b'{"messages": [', "application/json"),
             (json.dumps({"messages": []}).encode(), "application/json"),
             (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(), "application/json"),
             (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), "application/json"),
             (b"\xff\xfe not utf-8", "application/json"),
             (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 0}).encode(), "application/json")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def start_server(a) -> tuple[subprocess.Popen, str]:
    import httpx
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "bitnet_cpu", "serve", "--port", str(port), "-t", str(a.threads),
           "--parallel", str(a.parallel), "--max-queue", str(a.max_queue), "--max-body-mb", str(a.max_body_mb)]
    if a.model:
        cmd += ["-m", a.model]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bitnet serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("bitnet serve did not become healthy within 300 s")


def pick(rng) -> str:
    x, acc = rng.random(), 0.0
    for kind, p in KINDS:
        acc += p
        if x < acc:
            return kind
    return KINDS[-1][0]


async def one(c, kind, rng, big_body, bound_body, n_ctx, max_tokens, rec):
    q = {"role": "user", "content": f"What is {rng.randint(0, 99)}+{rng.randint(0, 99)}?"}
    body = {"messages": [q], "max_tokens": rng.randint(min(8, max_tokens), max_tokens), "temperature": rng.choice([0, 0.8])}
    t0 = time.perf_counter()
    if kind in ("stream", "cancel"):
        async with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
            rec["status"] = r.status_code
            events, ended = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    ended = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    ended = True
                    break
                events += 1
                ch = ev["choices"][0] if ev.get("choices") else None
                if ch and ch["delta"].get("content") and "ttft" not in rec:
                    rec["ttft"] = time.perf_counter() - t0
                if kind == "cancel" and events >= 2:
                    ended = True
                    break
            rec["lost"] = r.status_code == 200 and not ended
    elif kind == "ollama":
        ask = {"model": "m", "messages": [q], "options": {"num_predict": body["max_tokens"],
                                                           "temperature": body["temperature"]}}
        async with c.stream("POST", "/api/chat", json=ask) as r:
            rec["status"] = r.status_code
            ended = False
            async for line in r.aiter_lines():
                if line:
                    ev = json.loads(line)
                    if "error" in ev or ev.get("done"):
                        ended = True
                        break
            rec["lost"] = r.status_code == 200 and not ended
    elif kind in LAST_EVENT:   # the other APIs' typed event streams; half of them hung up after two events
        path, ask = (("/v1/responses", {"input": q["content"], "max_output_tokens": body["max_tokens"]})
                     if kind == "responses" else
                     ("/v1/messages", {"model": "m", "messages": [q], "max_tokens": body["max_tokens"]}))
        hang = rng.random() < 0.5
        async with c.stream("POST", path, json=dict(ask, temperature=body["temperature"] / 2, stream=True)) as r:
            rec["status"] = r.status_code
            events, ended = 0, False
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if json.loads(line[6:]).get("type") in LAST_EVENT[kind] or (hang and events >= 2):
                        ended = True
                        break
            rec["lost"] = r.status_code == 200 and not ended
    elif kind == "plain":
        r = await c.post("/v1/chat/completions", json=body)
        rec["status"] = r.status_code
    elif kind == "malformed":
        content, ctype = rng.choice(MALFORMED)
        r = await c.post("/v1/chat/completions", content=content, headers={"content-type": ctype})
        rec["status"] = r.status_code
        rec["lost"] = not (400 <= r.status_code < 500 and "error" in r.json())
    else:   # oversized: a body over the cap, a body under it but over the prompt bound, or a prompt over the context
        x = rng.random()
        if x < 1 / 3:
            r = await c.post("/v1/chat/completions", content=big_body, headers={"content-type": "application/json"})
        elif x < 2 / 3:
            r = await c.post("/v1/chat/completions", content=bound_body, headers={"content-type": "application/json"})
        else:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "7 + 8 = 15. " * n_ctx}]})
        rec["status"] = r.status_code
        rec["lost"] = r.status_code not in (400, 413)
    rec["seconds"] = time.perf_counter() - t0


async def client_loop(url, seed, until, big_body, bound_body, n_ctx, max_tokens, records):
    import httpx
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        while time.monotonic() < until:
            kind = pick(rng)
            rec = {"kind": kind, "t": time.monotonic(), "lost": False}
            records.append(rec)
            try:
                await one(c, kind, rng, big_body, bound_body, n_ctx, max_tokens, rec)
            except Exception as e:   # no answer at all: a lost request
                rec["lost"], rec["error"] = True, f"{type(e).__name__}: {e}"


async def sampler(url, pid, t0, until, samples):
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        while time.monotonic() < until:
            try:
                m = (await c.get("/slots")).json()["metrics"]
                samples.append({"t": time.monotonic() - t0, "tokens": m["tokens_generated_total"],
                                "rss_kb": rss_kb(pid) if pid else 0, "running": m["running"], "waiting": m["waiting"]})
            except Exception as e:
                samples.append({"t": time.monotonic() - t0, "error": str(e)})
            await asyncio.sleep(1.0)


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarize(records, samples, seconds, clients, t0) -> dict:
    """records: one per request (t: its monotonic start); samples: one per second (t: seconds after t0)."""
    by_kind: dict = {}
    for r in records:
        k = by_kind.setdefault(r["kind"], {})
        k[str(r.get("status", "none"))] = k.get(str(r.get("status", "none")), 0) + 1
    ttft = [r["ttft"] for r in records if r["kind"] == "stream" and "ttft" in r]
    ok = [s for s in samples if "tokens" in s]
    window = []
    for a, b in zip(ok, ok[5:]):   # tok/s over 5-second windows
        window.append({"t": b["t"], "tok_s": (b["tokens"] - a["tokens"]) / (b["t"] - a["t"])})
    rss = [s["rss_kb"] for s in ok if s["rss_kb"]]
    third = [s["rss_kb"] for s in ok if s["rss_kb"] and s["t"] >= seconds / 3]
    # RSS when the 2,000th request started, against the end: flat means no growth beyond noise after warm-up
    starts = sorted(r["t"] for r in records)
    t2000 = starts[1999] - t0 if len(starts) >= 2000 else None
    rss2000 = next((s["rss_kb"] / 1024 for s in ok if t2000 is not None and s["t"] >= t2000 and s["rss_kb"]), None)
    return {"seconds": seconds, "clients": clients, "requests": len(records), "by_kind_status": by_kind,
            "rss_mib_at_request_2000": rss2000,
            "rss_mib_growth_2000_to_end": (rss[-1] / 1024 - rss2000) if rss and rss2000 is not None else None,
            "five_xx": sum(1 for r in records if r.get("status", 0) >= 500),
            "lost": sum(1 for r in records if r["lost"]),
            "lost_examples": [r.get("error") or r for r in records if r["lost"]][:5],
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "ttft_n": len(ttft),
            "tok_s_mean": (ok[-1]["tokens"] - ok[0]["tokens"]) / (ok[-1]["t"] - ok[0]["t"]) if len(ok) > 1 else None,
            "rss_mib_start": rss[0] / 1024 if rss else None, "rss_mib_max": max(rss) / 1024 if rss else None,
            "rss_mib_end": rss[-1] / 1024 if rss else None,
            "rss_mib_growth_after_first_third": (third[-1] - third[0]) / 1024 if len(third) > 1 else None,
            "tok_s_windows": window, "samples": ok}


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install .[bench])", file=sys.stderr)
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    w = res["tok_s_windows"]
    ax1.plot([x["t"] for x in w], [x["tok_s"] for x in w])
    ax1.set_ylabel("tok/s (5 s windows)")
    ax1.set_title(f"bitnet serve soak: {res['clients']} clients, {res['requests']} requests, "
                  f"{res['five_xx']} 5xx, {res['lost']} lost")
    s = [x for x in res["samples"] if x["rss_kb"]]
    ax2.plot([x["t"] for x in s], [x["rss_kb"] / 1024 for x in s])
    ax2.set_ylabel("server RSS (MiB)")
    ax2.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--url", default=None, help="soak a running server instead of starting one")
    ap.add_argument("-m", "--model", default=None, type=os.path.abspath,
                    help="model for the server it starts (default: the bundled one)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--max-body-mb", type=float, default=4)
    ap.add_argument("--max-tokens", type=int, default=96, help="each request asks for 8..N tokens (a busy machine: "
                    "fewer, for more requests in the same time)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "soak_results"), help="path prefix of .json/.png")
    a = ap.parse_args(argv)
    import httpx
    proc, url = (None, a.url) if a.url else start_server(a)
    try:
        n_ctx = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["meta"]["n_ctx"]
        big_body = json.dumps({"messages": [{"role": "user", "content": "x" * int((a.max_body_mb + 1) * (1 << 20))}]}).encode()
        # under --max-body-mb (its default), over what a prompt that fits the bundled model's context can take
        bound_body = json.dumps({"messages": [{"role": "user", "content": "x" * int(min(a.max_body_mb - 0.5, 3) * (1 << 20))}]}).encode()
        records, samples = [], []
        t0 = time.monotonic()
        until = t0 + a.seconds

        async def run():
            await asyncio.gather(sampler(url, proc.pid if proc else 0, t0, until, samples),
                                 *(client_loop(url, i, until, big_body, bound_body, n_ctx, a.max_tokens, records)
                                   for i in range(a.clients)))
        asyncio.run(run())
        time.sleep(1.0)
        after = httpx.get(url + "/slots", timeout=30).json()
        res = summarize(records, samples, a.seconds, a.clients, t0)
        res["slots_after"] = after["slots"]
        res["metrics_after"] = after["metrics"]
    finally:
        if proc is not None:
            proc.send_signal(2)
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
    if proc is not None:
        res["server_exit"] = proc.returncode
        res["server_traceback"] = "Traceback" in err
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    png = plot(res, a.out + ".png")
    brief = {k: v for k, v in res.items() if k not in ("tok_s_windows", "samples", "lost_examples")}
    print(json.dumps(brief, indent=1))
    print(f"results: {a.out}.json" + (f", plot: {png}" if png else ""))
    return 0 if res["five_xx"] == 0 and res["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
