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
import http.cookiejar
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
UPSTREAM_MARGIN_S = 10.0   # past --request-timeout, the front's own bound on Ray's answer


def replica_limits(limits: Limits) -> Limits:
    """The limits the replicas' middleware applies behind the front: the same, with room for the headers the
    forwarding adds (Ray's x-request-id made a client's 20th header of --max-headers 20 a 431)."""
    return dataclasses.replace(limits, max_headers=limits.max_headers + PROXY_HEADERS,
                               max_header_bytes=limits.max_header_bytes + PROXY_HEADER_BYTES)


class Forwarder:
    """The ASGI app that passes each request to Ray Serve's proxy at `upstream` (http://127.0.0.1:PORT, or a
    callable giving it: the port is chosen late)."""

    def __init__(self, upstream, limits: Limits):
        self.upstream, self.limits = upstream, limits
        self.ready = threading.Event()   # set once Serve's app is deployed: before, every request is a 503
        self.client: httpx.AsyncClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cut: asyncio.Event | None = None   # set at the drain's deadline: every relay ends its answer itself

    def cut(self):
        """The drain's deadline (any thread): each request still running ends its own answer, a JSON 503
        shutting_down before its first byte, a stream's last event after it (uvicorn's cancellation gave a
        plain-text 500 and a traceback each)."""
        loop, cut = self.loop, self._cut
        if loop is not None and cut is not None:
            with contextlib.suppress(RuntimeError):   # the loop has closed: nothing is left to cut
                loop.call_soon_threadsafe(cut.set)

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
        said = {"started": False, "ended": False, "ctype": "", "tail": b"", "events": 0}   # what the relay sent
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        relay = asyncio.ensure_future(self._relay(scope, body, send, said))
        cutter = asyncio.ensure_future(self._cut.wait())
        try:
            done, _ = await asyncio.wait({relay, watcher, cutter}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done and said["ended"]:   # its answer is sent (uvicorn then says disconnect): the relay
                await asyncio.wait({relay})            # only puts its upstream connection back, not cancelled
                done = {relay}
            if relay not in done:   # the client hung up, or the drain ended: the upstream request is closed
                relay.cancel()
                await asyncio.wait({relay})
                if watcher not in done:
                    await self._end_cut(send, scope, said)
                return
            relay.result()
        finally:
            watcher.cancel()
            cutter.cancel()
            if not relay.done():
                relay.cancel()
                await asyncio.wait({relay})

    async def _lifespan(self, receive, send):
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.loop, self._cut = asyncio.get_running_loop(), asyncio.Event()
                # no cookie kept: one client's Set-Cookie was sent on with every other client's requests
                jar = http.cookiejar.CookieJar(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
                # a backstop past --request-timeout (the replica's own): a request held in Ray's proxy or router
                # (its queue is unbounded), or a hung proxy, held its client for ever
                read = self.limits.request_timeout + UPSTREAM_MARGIN_S if self.limits.request_timeout else None
                self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0, read=read), cookies=jar,
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

    async def _end_cut(self, send, scope, said):
        """The drain's deadline came with this request running: a 503 to retry if nothing was sent, else the
        stream's last event (an error saying so), the answer then left unended as on a replica's death."""
        if not said["started"]:
            return await send_error(send, scope, 503, "server is shutting down; retry later", "server_error",
                                    "shutting_down",
                                    headers=((b"retry-after", str(self.limits.retry_after).encode()),))
        from .router import CUT_ANSWERS, cut_answer_event
        last = cut_answer_event(said["ctype"], "the server stopped in the middle of this answer (--drain-timeout)",
                                said["tail"], scope.get("path", ""), said["events"])
        with contextlib.suppress(Exception):   # the client may be gone too
            if last:
                await send({"type": "http.response.body", "body": last, "more_body": True})
        CUT_ANSWERS.pending += 1   # uvicorn's line on the answer left unended is expected here

    async def _relay(self, scope, body: bytes, send, said=None):
        said = {"started": False, "ended": False, "ctype": "", "tail": b"", "events": 0} if said is None else said
        headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() not in REQUEST_DROP]
        path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        if not path.startswith("/"):   # OPTIONS * (asterisk-form): nothing here serves it, Ray's proxy neither
            return await send_error(send, scope, 400, f"not a valid HTTP/1.1 request (target {path[:40]!r}: "
                                    "only a path starting with / is served)", "invalid_request_error",
                                    "invalid_http", close=True)
        url = (self.upstream() if callable(self.upstream) else self.upstream) + path
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        try:
            request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        except httpx.InvalidURL as e:   # a target httpx refuses (over 64 KiB: --max-header-kb above 64)
            why = " ".join(str(e).split())[:200]
            return await send_error(send, scope, 400, f"not a valid HTTP/1.1 request ({why})",
                                    "invalid_request_error", "invalid_http", close=True)
        sent = {k.lower() for k, _ in headers}
        for name in HTTPX_DEFAULTS:
            if name.encode() not in sent and name in request.headers:
                del request.headers[name]
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.ReadTimeout:
            return await send_error(send, scope, 504, f"no answer from Ray Serve within --request-timeout "
                                    f"({self.limits.request_timeout:g} s) and {UPSTREAM_MARGIN_S:g} s more",
                                    "server_error", "request_timeout")
        except (httpx.HTTPError, httpx.InvalidURL):
            return await self._unavailable(send, scope, "Ray Serve's proxy did not answer")
        try:
            ctype = upstream.headers.get("content-type", "")
            said["ctype"] = ctype
            if upstream.status_code >= 500 and "json" not in ctype:
                # Ray's own answer (a replica that died: "Internal Server Error" in plain text), never the app's
                return await self._unavailable(send, scope, "the replica serving this request stopped")
            out = [(k, v) for k, v in upstream.headers.raw if k.lower() not in RESPONSE_DROP]
            said["started"] = True
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": out})
            tail, events = b"", 0
            try:
                async for chunk in upstream.aiter_raw():
                    if chunk:
                        events += (tail[-1:] + chunk).count(b"\n\n")
                        tail = chunk[-2:]
                        said["tail"], said["events"] = tail, events
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError:   # the replica (or Ray's proxy) died mid-answer: say so in the stream, then cut
                from .router import CUT_ANSWERS, cut_answer_event
                last = cut_answer_event(ctype, "the replica serving this request stopped in the middle of this "
                                        "answer", tail, scope.get("path", ""), events)
                if last:
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                CUT_ANSWERS.pending += 1   # uvicorn's line on the answer left unended is expected here
                return
            said["ended"] = True
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
    start(), then stop() (stop accepting; requests in flight get drain_s, then each ends its own answer: a JSON
    503 or a stream's last event) when Ray stops. on_exit: called when the front's thread ends with no stop()
    asked for (its server failed): the process has no listener left, so the caller stops too."""

    def __init__(self, sock: socket.socket, upstream, limits: Limits, *, keep_alive: float = 5.0,
                 drain_s: float = 5.0, log_level: str = "warning", on_exit=None):
        import uvicorn
        self.forwarder = Forwarder(upstream, limits)
        front_limits = dataclasses.replace(limits, request_timeout=0)   # the replicas time their requests
        app = LimitsMiddleware(self.forwarder, limits=front_limits)
        self.protocol = guarded_protocol(limits)
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", http=self.protocol,
                                # uvicorn's own deadline after the front's (the relays end their answers at
                                # drain_s): its cancellation gave a plain-text 500 and a traceback per request
                                timeout_keep_alive=keep_alive, loop="asyncio", timeout_graceful_shutdown=drain_s + 2,
                                h11_max_incomplete_event_size=limits.max_header_bytes)
        self.server = guarded_server(limits)(config)   # no signal handlers: run_ray's stop it
        self.sock, self.drain_s = sock, drain_s
        self.thread: threading.Thread | None = None
        self.on_exit, self.stopping, self.failed = on_exit, False, False
        self._timer: threading.Timer | None = None
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
            why = "its server ended"
            try:
                self.server.run(sockets=[self.sock])
                if not self.server.started:   # uvicorn returns when its lifespan startup failed
                    why = "its server did not start"
            except BaseException as e:   # SystemExit too (uvicorn's sys.exit(1) on some startup errors)
                why = " ".join(str(e).split())[:300] or type(e).__name__
            finally:
                if not self.stopping:   # one line: the front's end is the server's, Ray is stopped after it
                    self.failed = True
                    print(f"bitnet serve: error: the HTTP front stopped: {why}", file=sys.stderr, flush=True)
                    if self.on_exit is not None:
                        self.on_exit()
        self.thread = threading.Thread(target=run, name="bitnet-front", daemon=True)
        self.thread.start()

    def _deadline(self):
        self.forwarder.cut()       # each request still running ends its answer itself
        self.protocol.stopping()   # then clients that read nothing of it are cut

    def hurry(self, force: bool = False):
        """A second signal while stopping: the drain's deadline now; a third (force): stop at once."""
        if force:
            self.server.force_exit = True
        elif self.stopping:
            self._deadline()

    def stop(self):
        self.stopping = True
        if self.thread is None:
            with contextlib.suppress(OSError):
                self.sock.close()
            return
        self.server.should_exit = True
        self._timer = threading.Timer(self.drain_s, self._deadline)
        self._timer.daemon = True
        self._timer.start()
        self.thread.join(self.drain_s + 12)
        self._timer.cancel()


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
