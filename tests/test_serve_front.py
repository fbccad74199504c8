"""The front of `bitnet serve --ray-replicas` (serve/ray_front.py's Front and Forwarder) without Ray: the front
runs in this process before a small uvicorn app on a loopback port that stands in for Ray Serve's proxy (a
request that waits for ever, a stream that sends one event and then nothing, a cookie set). What is checked is
the front's own behaviour: the drain's end (each request ends its own answer in JSON, no uvicorn plain-text 500
or traceback), targets httpx cannot forward (OPTIONS *, an over-long URL: a JSON 400), the front's thread
ending on its own (the caller told, one line), and no cookie carried from one client to another."""
from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
import uvicorn  # noqa: E402
from test_serve_http import exchange, responses  # noqa: E402

from bitnet_cpu.serve.limits import Limits  # noqa: E402
from bitnet_cpu.serve.ray_front import Front, listen  # noqa: E402

BOUND = 60.0   # only ends a test of a front that never answers; never a measure of speed


class Upstream:
    """Ray's proxy's stand-in: /slow answers nothing until its client goes, /stream sends one SSE event then
    nothing more (until its client goes), /cookie sets a cookie, /echo answers the Cookie header it got."""

    PATHS = ("/slow", "/stream", "/cookie", "/echo", "/health")

    def __init__(self):
        self.arrived = {p: threading.Event() for p in self.PATHS}
        sock = listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off", loop="asyncio",
                                                     interface="asgi3"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()

    async def app(self, scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in self.arrived:
            self.arrived[path].set()
        if path in ("/slow", "/stream"):
            if path == "/stream":
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
                await send({"type": "http.response.body", "body": b'data: {"n": 1}\n\n', "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        headers = [(b"content-type", b"application/json")]
        body = {"ok": True}
        if path == "/cookie":
            headers.append((b"set-cookie", b"sid=abc; Path=/"))
        if path == "/echo":
            body = {"cookie": dict(scope["headers"]).get(b"cookie", b"").decode() or None}
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    def stop(self):
        self.server.should_exit = True
        self.thread.join(BOUND)


@pytest.fixture(scope="module")
def upstream():
    u = Upstream()
    deadline = time.monotonic() + BOUND
    while not u.server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert u.server.started
    yield u
    u.stop()


class Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def start_front(upstream, limits: Limits | None = None, **kw) -> tuple[Front, str, Logged]:
    front = Front(listen("127.0.0.1", 0), f"http://127.0.0.1:{upstream.port}", limits or Limits(), **kw)
    logged = Logged()
    logging.getLogger("uvicorn.error").addHandler(logged)
    url = f"http://127.0.0.1:{front.sock.getsockname()[1]}"
    front.start()
    front.ready.set()
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:   # 503 until its lifespan has made the client
        try:
            if httpx.get(url + "/health", timeout=BOUND).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    return front, url, logged


def stop_front(front: Front, logged: Logged):
    front.stop()
    logging.getLogger("uvicorn.error").removeHandler(logged)


def test_the_drain_ends_each_answer_itself(upstream):
    """At --drain-timeout's end a request still waiting for Ray's first byte gets a JSON 503 shutting_down to
    retry, and a stream its last event saying why; uvicorn's cancellation gave a plain-text 500 and a traceback."""
    front, url, logged = start_front(upstream, drain_s=0.5)
    got: dict = {}
    first = threading.Event()

    def slow():
        got["slow"] = httpx.post(url + "/slow", json={}, timeout=BOUND)

    def stream():
        out = b""
        try:
            with httpx.stream("GET", url + "/stream", timeout=BOUND) as r:
                for chunk in r.iter_raw():
                    out += chunk
                    first.set()
        except httpx.HTTPError:   # the answer is left unended, as when a replica dies: the connection closes
            pass
        got["stream"] = out
        first.set()

    threads = [threading.Thread(target=slow), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    assert upstream.arrived["/slow"].wait(BOUND) and first.wait(BOUND)
    stop_front(front, logged)
    for t in threads:
        t.join(BOUND)
    r = got["slow"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["code"] == "shutting_down" and r.headers.get("retry-after"), r.text
    events = [e for e in got["stream"].decode().split("\n\n") if e]
    assert events[0] == 'data: {"n": 1}', events
    assert len(events) == 2 and "--drain-timeout" in json.loads(events[1][len("data: "):])["error"]["message"], \
        events
    assert not [line for line in logged.lines if line.startswith(("ERROR", "CRITICAL"))], logged.lines


@pytest.mark.parametrize("raw", [
    b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    b"GET /" + b"a" * (70 << 10) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
], ids=["options-asterisk", "url-over-64k"])
def test_a_target_that_cannot_be_forwarded_is_a_json_400(upstream, raw):
    """OPTIONS * (asterisk-form, sent by some proxies and health checkers) and a URL over httpx's 64 KiB (with
    --max-header-kb above it): a JSON 400 invalid_http, never uvicorn's plain-text 500 and a traceback."""
    front, url, logged = start_front(upstream, Limits(max_header_bytes=128 << 10))
    try:
        got = responses(exchange(int(url.rsplit(":", 1)[1]), raw))
    finally:
        stop_front(front, logged)
    assert [g[0] for g in got] == [400], got
    assert got[0][1]["content-type"] == "application/json", got[0]
    assert json.loads(got[0][2])["error"]["code"] == "invalid_http", got[0]
    assert not [line for line in logged.lines if line.startswith(("ERROR", "CRITICAL"))], logged.lines


def test_no_cookie_goes_from_one_client_to_another(upstream):
    """A Set-Cookie from upstream is passed to its client and kept nowhere: the next client's request does not
    carry it (httpx's client kept every cookie for all)."""
    front, url, logged = start_front(upstream)
    try:
        r = httpx.get(url + "/cookie", timeout=BOUND)
        assert r.status_code == 200 and "sid=abc" in r.headers.get("set-cookie", ""), r.headers
        r = httpx.get(url + "/echo", timeout=BOUND)
    finally:
        stop_front(front, logged)
    assert r.status_code == 200 and r.json() == {"cookie": None}, r.text


def test_a_front_whose_server_ends_tells_its_caller(upstream, capsys):
    """The front's server failing (here: its socket closed before it starts) calls on_exit and says so in one
    line: the process had kept running with Ray up and no listener, until someone sent a signal."""
    ended = threading.Event()
    sock = listen("127.0.0.1", 0)
    front = Front(sock, f"http://127.0.0.1:{upstream.port}", Limits(), on_exit=ended.set)
    sock.close()
    front.start()
    assert ended.wait(BOUND)
    front.thread.join(BOUND)
    assert front.failed
    err = [line for line in capsys.readouterr().err.splitlines() if "bitnet serve" in line]
    assert len(err) == 1 and err[0].startswith("bitnet serve: error: the HTTP front stopped"), err


def test_a_stopped_front_does_not_call_on_exit(upstream):
    ended = threading.Event()
    front, url, logged = start_front(upstream, on_exit=ended.set)
    stop_front(front, logged)
    assert not front.thread.is_alive() and not front.failed and not ended.is_set()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=BOUND)


def test_an_unhandled_error_in_the_app_is_a_json_500():
    """A bug in a handler (an exception nothing maps): a JSON 500 server_error in the API's shape. Starlette's
    plain-text "Internal Server Error" was what Ray's own failures look like, so the front turned the app's bug
    into a 503 "the replica stopped" with Retry-After, and clients retried it at once."""
    from fastapi.testclient import TestClient

    from bitnet_cpu.serve.app import create_app

    app = create_app(lambda: None)

    @app.get("/v1/boom")
    async def boom():   # a route whose handler has a bug: the app's handlers are what is tested
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as tc:
        r = tc.get("/v1/boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["code"] == "server_error", r.text


def test_a_request_ray_never_answers_is_a_504_after_the_request_timeout(upstream):
    """A request held inside Ray (its proxy's queue is unbounded, or the proxy hangs) never reaches the replica
    whose --request-timeout would end it: the front answers 504 request_timeout --request-timeout plus a margin
    after, where it held the client for ever."""
    front, url, logged = start_front(upstream, Limits(request_timeout=0.5))
    try:
        r = httpx.post(url + "/slow", json={}, timeout=BOUND)
    finally:
        stop_front(front, logged)
    assert r.status_code == 504 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["code"] == "request_timeout", r.text
