"""Where the time of refusing an oversized prompt goes in `bitnet serve`: the server runs in this process (uvicorn,
the same app and protocol as `bitnet serve`) with its body read, JSON parse and character bound timed; a client
in a subprocess sends each body over a raw socket, one at a time, and times the answer.

    python bench/refusal_profile.py [--runs 5] [--max-body-mb 16] [-m MODEL]

A body over what a prompt that fits the context can take is refused from its Content-Length (no phase runs);
one under that bound is read, parsed and refused by its length in characters (serve/offload.py).
Measured on the loaded 2-core machine, bundled model (512-token context; bound 1.2 MiB), 10 MB chat prompt:
before the Content-Length bound, answered in 116-200 ms (read 53-87 ms, parse 44-57 ms, bound 0-4 ms); after,
20-40 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CLIENT = r"""
import json, socket, sys, time
port, runs = int(sys.argv[1]), int(sys.argv[2])
def prompt(mb):
    return "7 + 8 = 15. " * (int(mb * (1 << 20)) // 12)
cases = [("10 MB chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(10)}]}),
         ("10 MB ollama chat", "/api/chat", {"model": "m", "messages": [{"role": "user", "content": prompt(10)}]}),
         ("10 MB ollama generate", "/api/generate", {"model": "m", "prompt": prompt(10)}),
         ("1 MB chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(1)}]}),
         ("1 MB ollama generate", "/api/generate", {"model": "m", "prompt": prompt(1)})]
for label, path, body in cases:
    body = json.dumps(body).encode()
    for _ in range(runs):
        sock = socket.create_connection(("127.0.0.1", port))
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        dt = time.perf_counter() - t0
        sock.close()
        print(json.dumps({"case": label, "status": int(data.split(b" ", 2)[1]), "answered_s": dt}), flush=True)
        time.sleep(0.3)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-body-mb", type=float, default=16)
    ap.add_argument("-m", "--model", default=None)
    a = ap.parse_args(argv)
    import httpx
    import uvicorn

    from bitnet_cpu.engine.api import load_engine
    from bitnet_cpu.serve import app as app_mod
    from bitnet_cpu.serve import limits as limits_mod
    from bitnet_cpu.serve import offload
    from bitnet_cpu.serve import ollama as ollama_mod
    from bitnet_cpu.serve.limits import Limits, guarded_protocol

    phases: dict = {}

    def timed(name, fn, is_async):   # wraps one phase of the server with a timer (this benchmark only)
        if is_async:
            async def run(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kw)
                finally:
                    phases[name] = time.perf_counter() - t0
        else:
            def run(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    phases[name] = time.perf_counter() - t0
        return run
    limits_mod.LimitsMiddleware._read_body = timed("read", limits_mod.LimitsMiddleware._read_body, True)
    offload.parse_bounded = timed("parse", offload.parse_bounded, False)
    app_mod.too_long_for_context = timed("bound", app_mod.too_long_for_context, True)
    ollama_mod.too_long_for_context = timed("bound", ollama_mod.too_long_for_context, True)

    lim = Limits(max_body_bytes=int(a.max_body_mb * (1 << 20)))
    app = app_mod.create_app(lambda: load_engine(a.model, threads=2, parallel=4, progress=False), limits=lim)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           http=guarded_protocol(lim)))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    eng = app.state.bitnet.engine
    print(f"n_ctx {eng.n_ctx}, body bound {offload.prompt_body_bound(eng)} bytes, --max-body-mb {a.max_body_mb:g}")
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(a.runs)], stdout=subprocess.PIPE, text=True)
    for line in client.stdout:
        r = json.loads(line)
        got = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items())
        print(f"{r['case']:<24} {r['status']} answered in {r['answered_s'] * 1000:5.0f} ms   {got or 'nothing read'}")
        phases.clear()
    client.wait()
    server.should_exit = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
