"""Start a real `bitnet serve` subprocess on 127.0.0.1 (a free port) for the serve tests; bounded waits."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc=None, poll: float = 0.2) -> bool:
    """GET url/health until it answers 200 (True), or until timeout s have passed or proc has exited (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            if httpx.get(url + "/health", timeout=3).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    return False


def sse_events(url: str, path: str, body: dict, timeout: float = 120) -> list[tuple[str, dict]]:
    """The raw SSE events of a streamed POST to url + path (body with "stream": true): [(event line, data object)],
    after checking the answer is a 200 event stream."""
    import json
    out, kind = [], None
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                out.append((kind, json.loads(line[6:])))
    return out


def pythonpath() -> str:
    """PYTHONPATH for a subprocess of the tests: this checkout first, then what the suite runs with (a worktree's
    link folder: ROOT alone let `import bitnet_cpu` find the installed checkout instead)."""
    return ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")


class Server:
    def __init__(self, *extra: str, threads: int | None = 2, timeout: float | None = None, env: dict | None = None):
        """threads None: no -t (the server's own default); env: variables set for the server beside ours (a
        PYTHONPATH there comes before ours)."""
        from helpers import slowness
        if timeout is None:   # loading the model: seconds here, minutes under qemu
            timeout = 60.0 * slowness()
        own = env or {}
        env = dict(os.environ, **own)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (own.get("PYTHONPATH"), pythonpath()) if p)
        for attempt in range(3):
            # free_port() gives the port back before the server binds it: another process (the suite starts
            # hundreds of servers) may take it meanwhile; the server then says so and exits 2 -- try another
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bitnet_cpu", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 *(["-t", str(threads)] if threads else []), *extra],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if wait_healthy(self.url, timeout, self.proc):
                return
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()
                if self.proc.returncode == 2 and "in use" in err and attempt < 2:
                    continue
                raise RuntimeError(f"bitnet serve exited {self.proc.returncode}: {err}")
            self.stop()
            raise RuntimeError("bitnet serve did not become healthy in time")

    def stop(self, sig=signal.SIGINT, timeout: float = 15.0) -> tuple[int, str]:
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err

    def slots_when_idle(self, timeout: float = 10.0) -> dict:
        """GET /slots until no sequence is in flight, or until `timeout` s have passed (the caller's assertions
        then fail on what was seen last)."""
        deadline = time.monotonic() + timeout
        while True:
            st = httpx.get(self.url + "/slots").json()
            if not st["slots"] or time.monotonic() >= deadline:
                return st
            time.sleep(0.05)

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0


def slow_model(tmp_path_factory) -> str:
    """A small random model (seed chosen so greedy decoding never says eos within 3000 tokens) that makes
    ~300-500 tok/s here: long answers take seconds, so hang-ups and Stop can be seen cutting them short."""
    from test_model_fixtures import make_synth
    _, _, stores = make_synth(tmp_path_factory.getbasetemp() / "serve-slow", seed=2, max_position_embeddings=4096,
                              hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=4)
    return stores["f16"]
