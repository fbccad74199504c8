"""What refused bodies leave in `bitnet serve`'s memory: a fresh server per case (the bundled model, default
flags), its RSS after start, then three 10 MB bodies refused (413 over --max-body-mb, or 400 over what a prompt
that fits the context can take), sent one after another or all three at once, with a Content-Length or chunked,
then its RSS again. Also how much of each body the client got to send before the answer came (the server reads
none of a body refused from its Content-Length, and at most the cap of a chunked one).

    python bench/refusal_rss.py [--port-base 18960] [--rounds 1]

Results: docs/serving-limits.md.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_serve import wait_healthy  # noqa: E402
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "7 + 8 = 15. " * (10 * (1 << 20) // 12)}]}
                  ).encode()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


def send(port: int, path: str, chunked: bool, out: list):
    """One body in 64 KiB pieces until the server answers; (status, MiB sent)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(BODY)}"
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode())
        sent = 0
        for i in range(0, len(BODY), 1 << 16):
            if select.select([s], [], [], 0)[0]:
                break
            piece = BODY[i:i + (1 << 16)]
            try:
                s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece)
            except OSError:
                break
            sent += len(piece)
        s.settimeout(30)
        head = b""
        try:
            while b"\r\n" not in head:
                got = s.recv(4096)
                if not got:
                    break
                head += got
        except OSError:
            pass
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
        out.append((status, sent / (1 << 20)))


def case(port: int, path: str, chunked: bool, parallel: bool) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=120)
        time.sleep(1)
        before, out = rss_mib(proc.pid), []
        threads = [threading.Thread(target=send, args=(port, path, chunked, out)) for _ in range(3)]
        for t in threads:
            t.start()
            if not parallel:
                t.join()
        for t in threads:
            t.join()
        time.sleep(1)
        after = rss_mib(proc.pid)
        return {"path": path, "framing": "chunked" if chunked else "Content-Length",
                "sent": "parallel" if parallel else "one by one", "status": sorted(s for s, _ in out),
                "MiB sent before the answer": [round(m, 1) for _, m in out],
                "RSS before": round(before), "RSS after": round(after), "ratio": round(after / before, 2)}
    finally:
        proc.terminate()
        proc.wait(30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port-base", type=int, default=18960)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    port = a.port_base
    for _ in range(a.rounds):
        for path in ("/v1/chat/completions", "/api/pull"):
            for chunked in (False, True):
                for parallel in (False, True):
                    print(json.dumps(case(port, path, chunked, parallel)), flush=True)
                    port += 1


if __name__ == "__main__":
    main()
