"""HTTP framing at the door of `bitnet serve --ray-replicas`, on raw sockets: the front of serve/ray_front.py holds
the connections and forwards to Ray Serve's proxy on a private port, so the plain server's guarantees hold there
too (Ray's proxy, reached directly, lost the body of an Upgrade request, buffered one header without bound, timed
nothing, answered "100 Continue" before a 413, refused bad HTTP in plain text and counted the x-request-id it adds
against --max-headers). One Ray server for the module (1 replica, its own RAY_TMPDIR, only its own processes
stopped). Skipped when ray[serve] is not installed or Ray cannot start here."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve not installed (pip install .[cluster])")
from helpers import slowness  # noqa: E402
from serve_proc import ROOT, free_port, wait_healthy  # noqa: E402
from test_serve_http import CHAT, H2C, CLOSE, exchange, post_head, responses  # noqa: E402

pytestmark = pytest.mark.slow
MAX_HEADERS, HEADER_TIMEOUT = 20, 2


def _kill_under(own: str, bound: float = 30.0) -> None:
    """SIGKILL the processes whose command line names `own` (this module's Ray: raylet, GCS, agents), bounded."""
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{d}/cmdline", "rb") as f:
                if own.encode() in f.read():
                    pids.add(int(d))
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + bound
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if os.path.exists(f"/proc/{p}")}
        time.sleep(0.1)


OWN: list[str] = []   # the module's RAY_TMPDIR


@pytest.fixture(scope="module")
def port():
    own = tempfile.mkdtemp(prefix="rt", dir="/tmp")   # short: Ray's socket paths have a length limit
    OWN.append(own)
    p = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=own)
    env.pop("RAY_ADDRESS", None)
    # the connection flags were refused under --ray-replicas: now the front applies them
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--ray-replicas", "1", "-t", "1",
                             "--host", "127.0.0.1", "--port", str(p), "--max-headers", str(MAX_HEADERS),
                             "--header-timeout", str(HEADER_TIMEOUT), "--max-connections", "64",
                             "--keep-alive-timeout", "5"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        bound = 400 * slowness()
        up = wait_healthy(f"http://127.0.0.1:{p}", bound, proc, poll=1)
        if proc.poll() is not None:
            err = proc.stderr.read().strip().splitlines()
            if "Ray did not start" in "".join(err[-1:]):
                pytest.skip(f"Ray could not start here: {err[-1:]}")
            pytest.fail(f"bitnet serve --ray-replicas exited {proc.returncode}: {err[-5:]}")
        assert up, f"not healthy within {bound:.0f} s"
        yield p
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60 * slowness())
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _kill_under(own)
        shutil.rmtree(own, ignore_errors=True)


def _read_all(sock: socket.socket, bound: float) -> bytes:
    sock.settimeout(bound)
    out = b""
    with contextlib.suppress(ConnectionResetError, socket.timeout):
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


def test_an_upgrade_request_keeps_its_body(port):
    """curl --http2 / Java's HttpClient ask for h2c: the POST is answered as itself (Ray's proxy dropped the body:
    a 400 "request body must be a JSON object"), its body in the same segment or its own."""
    got = responses(exchange(port, post_head("/v1/chat/completions", len(CHAT), *H2C) + CHAT + CLOSE))
    assert [g[0] for g in got] == [200, 200], got
    assert json.loads(got[0][2])["object"] == "chat.completion", got[0]
    got = responses(exchange(port, post_head("/v1/chat/completions", len(CHAT), *H2C), CHAT, CLOSE))
    assert [g[0] for g in got] == [200, 200], got


def test_a_huge_header_is_refused_while_it_arrives(port):
    """1 MiB of one header value that never ends: the 431 as soon as --max-header-kb is passed (Ray's proxy read
    193 MiB of it, then the replica answered)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        with contextlib.suppress(OSError):
            for _ in range(16):
                sock.sendall(b"b" * (64 << 10))
        got = responses(_read_all(sock, 60 * slowness()))
    assert [g[0] for g in got] == [431], got
    assert json.loads(got[0][2])["error"]["code"] == "headers_too_large", got[0]


def test_headers_that_stop_coming_get_408(port):
    """Slowloris: part of the headers, then silence: 408 after --header-timeout (Ray's proxy held it open for
    good). The bound only ends a test of a server that never answers; the status is what is checked."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: b\r\n")
        got = responses(_read_all(sock, HEADER_TIMEOUT + 60 * slowness()))
    assert [g[0] for g in got] == [408], got
    assert json.loads(got[0][2])["error"]["code"] == "request_timeout", got[0]


def test_expect_continue_with_a_body_over_the_cap_is_refused_before_it(port):
    """Expect: 100-continue with a Content-Length over --max-body-mb: the 413 without "100 Continue" (through Ray's
    proxy the client was invited to upload all of it first)."""
    raw = exchange(port, post_head("/v1/chat/completions", 100_000_000, "Expect: 100-continue",
                                   "Connection: close"))
    assert not raw.startswith(b"HTTP/1.1 100"), raw[:200]
    got = responses(raw)
    assert [g[0] for g in got] == [413], got
    assert json.loads(got[0][2])["error"]["code"] == "body_too_large", got[0]


@pytest.mark.parametrize("raw", [
    b"GARBAGE / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
], ids=["bad-method", "bad-content-length", "cl-and-te", "options-asterisk"])
def test_malformed_http_is_a_json_400(port, raw):
    """What the parser refuses: 400 invalid_http in JSON, connection closed (Ray's: text/plain)."""
    got = responses(exchange(port, raw))
    assert len(got) == 1 and got[0][0] == 400, got
    assert got[0][1]["content-type"] == "application/json" and got[0][1].get("connection") == "close", got[0]
    assert json.loads(got[0][2])["error"]["code"] == "invalid_http", got[0]


def test_max_headers_counts_the_clients_headers_only(port):
    """--max-headers N: N headers pass and N + 1 are a 431, as on the plain server (Ray's proxy added an
    x-request-id that made the Nth a 431)."""
    def ask(n: int) -> int:
        extra = "".join(f"X-{i}: a\r\n" for i in range(n - 2))   # plus Host and Connection
        got = responses(exchange(port, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Connection: close"
                                       "\r\n\r\n".encode()))
        return got[0][0]
    assert ask(MAX_HEADERS) == 200
    assert ask(MAX_HEADERS + 1) == 431


def test_a_chunked_trailer_that_never_ends_is_refused_while_it_arrives(port):
    """A chunked body's trailer that never ends: the 431 once --max-header-kb is passed, as a header's (it was
    read on and held until --body-timeout, its CPU growing with the square of its size)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\n2\r\n{}\r\n0\r\nX-T: ")
        with contextlib.suppress(OSError):
            for _ in range(16):
                sock.sendall(b"b" * (64 << 10))
        got = responses(_read_all(sock, 60 * slowness()))
    assert [g[0] for g in got] == [431], got
    assert json.loads(got[0][2])["error"]["code"] == "headers_too_large", got[0]


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on at 127.0.0.1 (its sockets' inodes matched in /proc/net/tcp): Ray's
    HTTP proxy's, not its gRPC servers' on the node's address."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in list(f)[1:]:
            cols = line.split()
            addr, _, hexport = cols[1].partition(":")
            if cols[3] == "0A" and cols[9] in inodes and addr == "0100007F":   # LISTEN on 127.0.0.1
                ports.add(int(hexport, 16))
    return ports


def test_rays_proxy_port_cannot_be_shared(port):
    """Ray's proxy bound its private port with SO_REUSEPORT: a second `bitnet serve --ray-replicas` that picked
    the same port listened there too, and the kernel spread one front's requests across both deployments. Now a
    second listener on that port is refused."""
    proxies = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if not f.read().startswith(b"ray::ProxyActor"):
                        continue
                with open(f"/proc/{d}/environ", "rb") as f:
                    if f"RAY_TMPDIR={OWN[0]}".encode() in f.read().split(b"\0"):
                        proxies.append(int(d))
    assert len(proxies) == 1, proxies
    ports = _listening_ports(proxies[0])
    assert ports, "the proxy listens on no port"
    for p in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError):
                s.bind(("127.0.0.1", p))
                s.listen(1)
