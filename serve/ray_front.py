"""The door of `bitnet serve --ray-replicas N`: the plain server's connection layer in front of Ray Serve.

Ray Serve's HTTP proxy is a uvicorn of its own, with none of serve/limits.py's protocol: through it the body of a
request asking to Upgrade (curl --http2, Java's HttpClient) was lost, one header was buffered without bound
(hundreds of MB) before the 431, nothing timed the headers or capped the connections, what the parser refused
was plain text, `Expect: 100-continue` was answered "100 Continue" before the 413, and a replica that died
turned its requests into a plain-text 500. So Ray's proxy listens on a private loopback port, and the user's
--host/--port is this uvicorn with `guarded_protocol(limits)` and LimitsMiddleware (the header count as the
client sent it, the body's size and time), which forwards each request to that proxy: the answer streamed back
as it comes, a client that hangs up closing the upstream request (the replica's stream then stops generating),
and Ray's own errors (a proxy not answering, a replica gone: a 5xx that is not ours, in plain text) a 503 in
the API's JSON shape with Retry-After, since such a request can be retried."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import sys
import threading

import httpx

from .limits import Limits, LimitsMiddleware, guarded_protocol, guarded_server, send_error

# what the front's forwarding and Ray's proxy add to a request (Ray: x-request-id), which the replicas' own
# count of a client's headers must not hold against it: the front has counted them as they came
PROXY_HEADERS, PROXY_HEADER_BYTES = 8, 1 << 10
REQUEST_DROP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade", b"te",
                b"proxy-connection", b"expect", b"http2-settings"}
RESPONSE_DROP = {b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"}
HTTPX_DEFAULTS = ("accept", "accept-encoding", "connection", "user-agent")   # httpx's own, never the client's
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def replica_limits(limits: Limits) -> Limits:
    """The limits the replicas' middleware applies behind the front: the same, with room for the headers the
    forwarding adds (Ray's x-request-id made a client's 20th header of --max-headers 20 a 431)."""
    return dataclasses.replace(limits, max_headers=limits.max_headers + PROXY_HEADERS,
                               max_header_bytes=limits.max_header_bytes + PROXY_HEADER_BYTES)


class Forwarder:
    """The ASGI app that passes each request to Ray Serve's proxy at `upstream` (http://127.0.0.1:PORT)."""

    def __init__(self, upstream: str, limits: Limits):
        self.upstream, self.limits = upstream, limits
        self.ready = threading.Event()   # set once Serve's app is deployed: before, every request is a 503
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        if not self.ready.is_set() or self.client is None:
            return await self._unavailable(send, scope, "Ray Serve is starting (the model loads on its replicas)")
        body = b""
        if scope["method"] in BODY_METHODS:   # read whole by LimitsMiddleware (its cap, its timeout): given at once
            msg = await receive()
            body = msg.get("body", b"") if msg["type"] == "http.request" else b""
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        relay = asyncio.ensure_future(self._relay(scope, body, send))
        try:
            done, _ = await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:   # the client hung up: the upstream request is closed with the relay
                relay.cancel()
                await asyncio.wait({relay})
                return
            relay.result()
        finally:
            watcher.cancel()
            if not relay.done():
                relay.cancel()
                await asyncio.wait({relay})

    async def _lifespan(self, receive, send):
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                                limits=httpx.Limits(max_connections=None,
                                                                    max_keepalive_connections=256))
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self.client is not None:
                    with contextlib.suppress(Exception):
                        await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _unavailable(self, send, scope, why: str):
        await send_error(send, scope, 503, f"{why}; retry later", "server_error", "unavailable",
                         headers=((b"retry-after", str(self.limits.retry_after).encode()),))

    async def _relay(self, scope, body: bytes, send):
        headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() not in REQUEST_DROP]
        path = scope.get("raw_path") or scope["path"].encode()
        url = self.upstream + path.decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        sent = {k.lower() for k, _ in headers}
        for name in HTTPX_DEFAULTS:
            if name.encode() not in sent and name in request.headers:
                del request.headers[name]
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError:
            return await self._unavailable(send, scope, "Ray Serve's proxy did not answer")
        try:
            ctype = upstream.headers.get("content-type", "")
            if upstream.status_code >= 500 and "json" not in ctype:
                # Ray's own answer (a replica that died: "Internal Server Error" in plain text), never the app's
                return await self._unavailable(send, scope, "the replica serving this request stopped")
            out = [(k, v) for k, v in upstream.headers.raw if k.lower() not in RESPONSE_DROP]
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": out})
            tail, events = b"", 0
            try:
                async for chunk in upstream.aiter_raw():
                    if chunk:
                        events += (tail[-1:] + chunk).count(b"\n\n")
                        tail = chunk[-2:]
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError:   # the replica (or Ray's proxy) died mid-answer: say so in the stream, then cut
                from .router import CUT_ANSWERS, cut_answer_event
                last = cut_answer_event(ctype, "the replica serving this request stopped in the middle of this "
                                        "answer", tail, scope.get("path", ""), events)
                if last:
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                CUT_ANSWERS.pending += 1   # uvicorn's line on the answer left unended is expected here
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await upstream.aclose()


async def _until_disconnect(receive):
    """Returns when the client has hung up (uvicorn's messages after the body: the disconnect)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class Front:
    """The front's uvicorn on `sock` (the user's --host/--port, bound by the caller), in a thread of its own:
    start(), then stop() (stop accepting; requests in flight get drain_s, then are cut) when Ray stops."""

    def __init__(self, sock: socket.socket, upstream: str, limits: Limits, *, keep_alive: float = 5.0,
                 drain_s: float = 5.0, log_level: str = "warning"):
        import uvicorn
        self.forwarder = Forwarder(upstream, limits)
        front_limits = dataclasses.replace(limits, request_timeout=0)   # the replicas time their requests
        app = LimitsMiddleware(self.forwarder, limits=front_limits)
        self.protocol = guarded_protocol(limits)
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", http=self.protocol,
                                timeout_keep_alive=keep_alive, loop="asyncio", timeout_graceful_shutdown=drain_s,
                                h11_max_incomplete_event_size=limits.max_header_bytes)
        self.server = guarded_server(limits)(config)   # no signal handlers: run_ray's stop it
        self.sock, self.drain_s = sock, drain_s
        self.thread: threading.Thread | None = None
        from .router import CUT_ANSWERS
        import logging
        log = logging.getLogger("uvicorn.error")
        if CUT_ANSWERS not in log.filters:
            log.addFilter(CUT_ANSWERS)

    @property
    def ready(self) -> threading.Event:
        return self.forwarder.ready

    def start(self):
        def run():
            try:
                self.server.run(sockets=[self.sock])
            except Exception as e:   # one line: the front's end is the server's, Ray is stopped after it
                print(f"bitnet serve: error: the HTTP front stopped: {e}", file=sys.stderr, flush=True)
        self.thread = threading.Thread(target=run, name="bitnet-front", daemon=True)
        self.thread.start()

    def stop(self):
        if self.thread is None:
            with contextlib.suppress(OSError):
                self.sock.close()
            return
        self.server.should_exit = True
        timer = threading.Timer(self.drain_s, self.protocol.stopping)   # then clients that read nothing are cut
        timer.daemon = True
        timer.start()
        self.thread.join(self.drain_s + 10)
        timer.cancel()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, as `bitnet serve` binds its own (IPv6 for a host with ':')."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def private_port() -> int:
    """A free loopback port for Ray Serve's proxy, which only the front reaches."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
