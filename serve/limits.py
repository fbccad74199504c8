"""What a client may cost the server: body and header size, connections, time to send a request, time a request
may run. Each limit is refused with its own status and an OpenAI-shaped body ({"error": {message, type, param,
code}}), before the request reaches the handlers or the engine.

Two layers, because some limits must act before there is a request at all:
- `guarded_protocol(limits)`: a uvicorn HTTP protocol class (httptools or h11) that counts connections (one over
  --max-connections gets a 503 + Retry-After for its request, or at once and closed if it has sent no request
  within QUIET_GRACE; a newcomer at the cap closes the connection silent the longest
  first, as nginx reuses its idle ones), times the headers of every request from its first
  byte (or the connection's start) and answers 408 and closes when they take longer than --header-timeout
  (slowloris), and (httptools) refuses a request's header block over --max-header-kb with 431 while it arrives.
  It ignores Upgrade (the body stays with its request), refuses Content-Length beside Transfer-Encoding, and
  answers what the parser refuses in JSON (400 invalid_http, saying why) and closes.
- `AcceptGuard`: the event loop's handler for an accept() that fails for want of descriptors: one log line, and
  the connections waiting get a 503 out_of_resources through a descriptor held in reserve for that.
- `LimitsMiddleware`: a pure ASGI middleware that refuses too many headers (431), a Content-Length over
  --max-body-mb (413, nothing read), reads the body itself under the cap (413 as soon as a chunked body passes
  it, never buffering more) and within --body-timeout (408), then runs the handler within --request-timeout
  (cancelled: the engine stream's `finally` cancels its sequence, so its pages go back; the client gets a 504
  or, mid-stream, an error event). After a request with a large body it hands freed heap back to the OS.
  Given `prompt_bound(path)` (the app's: the most bytes a request to a generating endpoint can have and still
  fit the context, serve/offload.py), a body over it is a 400 context_length_exceeded from its Content-Length
  alone, or as soon as a chunked one passes it: a 10 MB prompt to a 512-token model costs neither the read
  (~55-90 ms here, up to 350 ms beside other large bodies) nor the JSON parse (~45-55 ms).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

from .offload import within

MiB = 1 << 20
STOP_GRACE = 0.5   # after the drain's deadline, what a client may go without taking a byte (uvicorn cancels at +2 s)
RAW_HEADER_SLACK = 4 << 10   # what a header block's bytes on the wire may have beyond what --max-header-kb counts of
                             # it (the method, "HTTP/1.1", the colons, spaces and line ends)
QUIET_GRACE = 1.0   # a connection over --max-connections has this long to send its request's headers (a real
                    # client's come at once; a silent one held a descriptor for the whole --header-timeout); one
                    # silent this long is the first to go when the cap is full


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 * MiB         # a 4096-token prompt is well under 100 KiB of text (x6 if all JSON-escaped)
    max_header_bytes: int = 32 << 10      # request line + headers; nginx's default buffers hold 32 KiB
    max_headers: int = 100
    max_connections: int = 512
    header_timeout: float = 10.0          # first byte of a request -> end of its headers
    body_timeout: float = 30.0            # end of headers -> end of body
    send_timeout: float = 60.0            # a client that reads nothing of what is sent to it (nginx's send_timeout)
    request_timeout: float = 600.0        # handler wall time, 0 = none
    retry_after: int = 1


# Anthropic's error types by HTTP status (its API's table); anything else 5xx is api_error
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
              504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPE.get(status, "api_error" if status >= 500 else
                                                              "invalid_request_error"), "message": message}}


def anthropic_shaped(scope) -> bool:
    """Whether a request's errors take Anthropic's shape: on its routes (/v1/messages...), and on /v1/models when
    Anthropic's client asks (it sends anthropic-version on every request; OpenAI's clients never do), which
    otherwise read a 401 or 404 in OpenAI's shape. The one rule for the handlers' errors and the middlewares'."""
    path = scope.get("path", "")
    if path.startswith("/v1/messages"):
        return True
    return path.startswith("/v1/models") and any(k.lower() == b"anthropic-version"
                                                 for k, _ in scope.get("headers") or ())


def anthropic_status(status: int) -> int:
    """Anthropic's status for one of ours: its overloaded_error is a 529 (the anthropic SDK raises OverloadedError
    for 529 only; a 503 was a bare InternalServerError), every other the same."""
    return 529 if status == 503 else status


# llama-server's own generating endpoint: a context overflow there is answered in its words (llama_overflow)
LLAMA_SERVER_COMPLETION = ("/completion", "/completions")


def llama_overflow(path: str, error: dict) -> dict:
    """`error` (an OpenAI-shaped error object) as llama-server words a context overflow, on its /completion:
    type "exceed_context_size_error" and "request (N tokens) exceeds the available context size (C tokens), try
    increasing it", with its n_prompt_tokens / n_ctx where known (its clients trim and retry on the type or that
    phrase; OpenAI's sentence and type were a generic 400 to them). Any other error, or path, as it is."""
    if path not in LLAMA_SERVER_COMPLETION or error.get("code") != "context_length_exceeded":
        return error
    n, ctx = error.get("n_prompt_tokens"), error.get("n_ctx")
    if n is not None and ctx is not None:
        message = (f"request ({n} tokens) exceeds the available context size ({ctx} tokens), try increasing it "
                   "(bitnet serve -c) or shorten the prompt")
    else:   # counted from the body's size alone: the bound's own words follow
        message = f"request exceeds the available context size: {error.get('message')}"
    return {**error, "message": message, "type": "exceed_context_size_error"}


def error_json(message: str, type_: str, code: str, param: str | None = None, scope=None, status: int = 400) -> bytes:
    """OpenAI's error body, or ollama's ({"error": "..."}) for its /api/ routes, or Anthropic's (anthropic_shaped),
    or, for a context overflow on llama-server's /completion, llama-server's words (llama_overflow)."""
    if scope is not None and scope.get("path", "").startswith("/api/"):
        return json.dumps({"error": message}).encode()
    if scope is not None and anthropic_shaped(scope):
        return json.dumps(anthropic_error_body(anthropic_status(status), message)).encode()
    error = {"message": message, "type": type_, "param": param, "code": code}
    return json.dumps({"error": llama_overflow(scope.get("path", "") if scope is not None else "", error)}).encode()


async def send_error(send, scope, status: int, message: str, type_: str, code: str, *, close: bool = False,
                     headers: tuple = (), param: str | None = None):
    body = error_json(message, type_, code, param, scope=scope, status=status)
    if scope is not None and anthropic_shaped(scope):
        status = anthropic_status(status)
    h = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:
        h.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---- memory -----------------------------------------------------------------------------------------------
def _malloc_trim():
    """glibc keeps freed heap in its arenas (a 50 MB prompt's JSON, text and token lists left RSS at 1.67 GB);
    malloc_trim(0) returns the free pages of every arena. Other C libraries: nothing to do."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()
TRIM_AFTER_BYTES = 1 * MiB   # bodies below this leave nothing worth trimming (measured: trim itself ~1 ms)


def release_memory():
    if _TRIM is not None:
        _TRIM(0)


# ---- ASGI middleware --------------------------------------------------------------------------------------
def as_json(scope):
    """The request with its body read as JSON whatever Content-Type it names, as llama-server and ollama read
    theirs: `curl -d` sends application/x-www-form-urlencoded, a browser's fetch() of a string text/plain, and
    some clients none, where the handlers (FastAPI's strict content type) would see bytes and refuse them.
    Multipart too: no route here takes a form, and FastAPI parsed one into something that is not JSON (a JSON body
    sent so was "request body must be a JSON object" on some routes, taken on others). The scope is changed in
    place: the routing writes the route it matched
    into the scope it is given, which the metrics (CountingMiddleware, outside) read back (a copy here counted
    every such request under endpoint "other")."""
    headers = scope.get("headers") or []
    for i, (k, v) in enumerate(headers):
        if k == b"content-type":
            t = v.split(b";")[0].strip().lower()
            if t == b"application/json" or t.endswith(b"+json"):
                return scope
            scope["headers"] = headers[:i] + [(k, b"application/json")] + headers[i + 1:]
            return scope
    scope["headers"] = list(headers) + [(b"content-type", b"application/json")]   # none named
    return scope


class RouteNorms:
    """HTTP's rules FastAPI's routing leaves out. HEAD on a path with a GET route is run as that GET (RFC 9110
    9.1: servers MUST answer it; FastAPI's GET routes took GET alone, a 405 to monitors and proxies): the
    server's own copy of the request still says HEAD, so uvicorn sends the headers without the body. A path
    ending in "/" is the path without it (Starlette redirected it to an absolute URL built from Host, which a
    proxy that sends `Host: localhost` turned into the client's own localhost)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            if len(path) > 1 and path.endswith("/"):
                scope = dict(scope, path=path.rstrip("/") or "/")
            if scope["method"] == "HEAD":
                routes = scope["app"].router.routes
                get = _first_route(routes, dict(scope, method="GET"))
                if get is not None and get < _first_route(routes, scope, len(routes)):
                    # a GET route before any that takes HEAD (the router's catch-all forwarder, last, takes every
                    # method: HEAD /v1/models went there and was a 405)
                    scope = dict(scope, method="GET")
        await self.app(scope, receive, send)


def _first_route(routes, scope, default=None):
    """The index of the first route that takes this request (path and method), as the router picks it."""
    from starlette.routing import Match
    return next((i for i, r in enumerate(routes) if r.matches(scope)[0] == Match.FULL), default)


_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def refuses_method(endpoint):
    """Mark a route that is there only to refuse its method with a reason (POST /props: a 405 saying why): it is
    left out of a 405's Allow."""
    endpoint.refuses_method = True
    return endpoint


def allow_header(methods) -> str:
    """A 405's Allow: the methods, HEAD wherever GET is (RouteNorms runs HEAD as GET), in a fixed order."""
    methods = set(methods)
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods, key=lambda m: (_METHOD_ORDER.index(m) if m in _METHOD_ORDER else 99, m)))


def allowed_methods(routes, scope, skip=()) -> set:
    """The methods the request's path takes (RFC 9110 15.5.6: a 405's Allow lists them all): those of every route
    whose path matches, less routes that only refuse theirs (refuses_method) and the endpoints in `skip`. Starlette
    named the first route that matched the path alone: /health's HEAD twin (Allow: HEAD), /props' refusal of POST
    (Allow: POST)."""
    from starlette.routing import Match
    out: set = set()
    for r in routes:
        endpoint = getattr(r, "endpoint", None)
        if not getattr(r, "methods", None) or getattr(endpoint, "refuses_method", False) or endpoint in skip:
            continue
        if r.matches(scope)[0] != Match.NONE:
            out |= set(r.methods)
    return out


class LimitsMiddleware:
    def __init__(self, app, limits: Limits = Limits(), prompt_bound=None):
        self.app, self.limits = app, limits
        self.prompt_bound = prompt_bound   # path -> (bytes, param) a body there may have, or None: no bound

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lim = self.limits
        headers = scope.get("headers") or []
        if len(headers) > lim.max_headers:
            return await send_error(send, scope, 431, f"{len(headers)} request headers: at most {lim.max_headers}",
                                    "invalid_request_error", "headers_too_large", close=True)
        # the request target counts too, as the protocol counts it while it arrives (httptools; h11 left it out)
        target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 1
        if target + sum(len(k) + len(v) + 4 for k, v in headers) > lim.max_header_bytes:
            return await send_error(send, scope, 431, f"request headers over {lim.max_header_bytes} bytes",
                                    "invalid_request_error", "headers_too_large", close=True)
        length = None
        for k, v in headers:
            if k == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
                # llama-server's answer (415) to a compressed body: read as it came, it was a vague JSON error
                return await send_error(send, scope, 415, f"Content-Encoding {v.decode('latin-1')}: request bodies "
                                        "are taken uncompressed", "invalid_request_error",
                                        "unsupported_content_encoding", close=True)
            if k == b"transfer-encoding" and v.strip().lower() != b"chunked":
                return await send_error(send, scope, 501, f"Transfer-Encoding {v.decode('latin-1')}: only chunked is "
                                        "understood", "invalid_request_error", "unsupported_transfer_encoding",
                                        close=True)
            if k == b"content-length":
                try:
                    length = int(v)
                except ValueError:
                    return await send_error(send, scope, 400, "Content-Length is not a number", "invalid_request_error",
                                            "invalid_header", close=True)
        if length is not None and length > lim.max_body_bytes:
            # answered without reading: the server discards the rest, and the connection stays usable
            return await send_error(send, scope, 413, self._too_big(length), "invalid_request_error", "body_too_large")
        bound = self.prompt_bound(scope.get("path", "")) if self.prompt_bound is not None else None
        if bound is not None and length is not None and length > bound[0]:
            return await send_error(send, scope, 400, self._too_long(length, bound[0]), "invalid_request_error",
                                    "context_length_exceeded", param=bound[1])
        body, status, n_read = b"", None, 0
        try:
            if scope.get("method") in ("POST", "PUT", "PATCH", "DELETE"):   # DELETE: ollama's /api/delete has a body
                scope = as_json(scope)
                body, status, n_read = await self._read_body(receive, bound[0] if bound is not None else None)
                if status == "disconnect":
                    return
                if status == "too_long":
                    return await send_error(send, scope, 400, self._too_long(None, bound[0]), "invalid_request_error",
                                            "context_length_exceeded", param=bound[1], close=True)
                if status == 413:
                    return await send_error(send, scope, 413, self._too_big(None), "invalid_request_error",
                                            "body_too_large", close=True)
                if status == 408:
                    return await send_error(send, scope, 408, f"the request body did not arrive within "
                                            f"{lim.body_timeout:g} s", "invalid_request_error", "request_timeout",
                                            close=True)
            await self._run(scope, self._replay(body, receive), send)
        finally:
            # a refused body too: up to the cap of it was read (a chunked one), and three refused at once left
            # 9 MiB of freed heap in RSS
            if max(len(body), n_read, length or 0) >= TRIM_AFTER_BYTES:
                del body
                await asyncio.to_thread(release_memory)

    def _too_big(self, length):
        cap = self.limits.max_body_bytes
        got = f"{length} bytes" if length is not None else "the request body"
        return f"{got}: over the server's limit of {cap / MiB:g} MiB (bitnet serve --max-body-mb)"

    @staticmethod
    def _too_long(length, bound):
        got = f"{length} bytes" if length is not None else "the request body"
        return (f"{got}: over the {bound} bytes that a request whose prompt fits the model's context can have "
                "(raise the context with -c, or send a shorter prompt)")

    async def _read_body(self, receive, bound: int | None = None):
        """The whole body, read under the size cap, the prompt bound and the time limit: (bytes, None, bytes read)
        or (b"", 413 | "too_long" | 408 | "disconnect", bytes read): reading stops at the first byte over."""
        lim = self.limits
        deadline = time.monotonic() + lim.body_timeout
        parts, n = [], 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", 408, n
            got, msg = await within(receive(), left)
            if not got:
                return b"", 408, n
            if msg["type"] == "http.disconnect":
                return b"", "disconnect", n
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > lim.max_body_bytes:
                return b"", 413, n
            if bound is not None and n > bound:
                return b"", "too_long", n
            if chunk:
                parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts), None, n

    @staticmethod
    def _replay(body: bytes, receive):
        """A receive that gives the handler the body already read, then waits on the real one (disconnects)."""
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return replay

    async def _run(self, scope, receive, send):
        timeout = self.limits.request_timeout
        if not timeout or scope.get("path") in ("/health", "/v1/health", "/metrics"):
            return await self.app(scope, receive, send)
        state = {"started": False, "done": False, "stream": None, "events": 0}
        path = scope.get("path", "")
        numbered = path.rstrip("/") in ("/v1/responses", "/responses")

        async def tracked_send(msg):
            if msg["type"] == "http.response.start":
                state["started"] = True
                ctype = next((v for k, v in msg.get("headers", ()) if k.lower() == b"content-type"), b"")
                state["stream"] = ("sse" if ctype.startswith(b"text/event-stream") else
                                   "ndjson" if ctype.startswith(b"application/x-ndjson") else None)
            elif msg["type"] == "http.response.body":
                if not msg.get("more_body", False):
                    state["done"] = True
                if state["stream"] == "sse" and numbered:   # events sent (the Responses API numbers them)
                    body = msg.get("body", b"")
                    state["events"] += body.count(b"\nevent: ") + body.startswith(b"event: ")
            await send(msg)

        task = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        try:
            done, _ = await asyncio.wait((task,), timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            return task.result()
        # past the wall time: cancel the handler (its stream's `finally` cancels the engine sequence); again until
        # it ends, should code under it (a library's own wait) swallow one cancellation
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)
        if not task.cancelled():
            task.exception()   # retrieved, so asyncio does not log it
        msg = f"the request ran past the server's limit of {timeout:g} s (bitnet serve --request-timeout)"
        if not state["started"]:
            await send_error(send, scope, 504, msg, "server_error", "request_timeout")
        elif not state["done"]:
            tail = b""
            if state["stream"] == "sse" and numbered:
                # the Responses API's own error event (typed clients read `type`), numbered after the last one
                tail = b"event: error\ndata: " + json.dumps({
                    "type": "error", "code": "request_timeout", "message": msg, "param": None,
                    "sequence_number": state["events"]}).encode() + b"\n\n"
            elif state["stream"] == "sse":   # Anthropic's streams name their error event
                event = b"event: error\n" if path.startswith("/v1/messages") else b""
                tail = event + b"data: " + error_json(msg, "server_error", "request_timeout", scope=scope,
                                                      status=504) + b"\n\n"
            elif state["stream"] == "ndjson":
                tail = error_json(msg, "server_error", "request_timeout", scope=scope) + b"\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})


# ---- uvicorn protocol -------------------------------------------------------------------------------------
def _raw_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = error_json(message, "invalid_request_error" if status < 500 else "server_error", code)
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode() + body


def _over_cap_message(limits: Limits) -> str:
    n = limits.max_connections
    return (f"the server has {n} connection{'s' if n != 1 else ''} open (bitnet serve --max-connections); "
            "retry later")


def _overloaded_app(limits: Limits):
    async def app(scope, receive, send):
        await send_error(send, scope, 503, _over_cap_message(limits), "server_error", "too_many_connections",
                         close=True, headers=((b"retry-after", str(limits.retry_after).encode()),))
    return app


def _reserve_fd():
    try:
        return os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


class AcceptGuard:
    """The event loop's exception handler for an accept() that fails with EMFILE/ENFILE (the process, or the
    system, out of file descriptors: silent connections, a flood): uvloop reset every connection waiting, asyncio
    leaves them waiting, and neither says a word in the server's log. Here the descriptor held in reserve is
    given up for a moment to accept each connection waiting, answer it 503 out_of_resources + Retry-After (what
    it had sent is read first, so the close sends no reset over the answer) and close it; then it is taken again.
    One log line per second at most, with the count answered since the last; what is left is said a second later
    (or by flush(), when the server stops). Anything else goes to the loop's default handler.
    Installed by guard_loop() on the asyncio loop (not uvloop: libuv resets such connections itself, with no
    callback), which also makes the listener wait a second after such a failure: one call here a second."""

    MAX_PER_CALL = 2048   # connections answered per failed accept, one a second: uvicorn's listen backlog

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self.reserve = _reserve_fd()
        self.said_at = None   # loop time of the last log line
        self.unsaid = 0       # connections answered since it
        self.later = None     # the timer that says them, when they came within a second of the last line
        self.errno = errno.EMFILE

    def __call__(self, loop, context):
        exc, sock = context.get("exception"), context.get("socket")
        if not (isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE) and sock is not None
                and str(context.get("message", "")).startswith("socket.accept()")):
            return loop.default_exception_handler(context)
        self.errno = exc.errno
        # Linux takes the descriptor before it looks for a connection: EMFILE with none waiting is nobody's loss
        self.unsaid += self._answer_waiting(sock.fileno())
        if not self.unsaid and self.reserve is not None:
            return
        now = loop.time()
        if self.said_at is None or now - self.said_at >= 1.0:
            self._say(now)
        elif self.later is None and self.unsaid:   # said within the second: the rest once it is over
            self.later = loop.call_later(self.said_at + 1.0 - now, lambda: self._said_later(loop))

    def _said_later(self, loop):
        self.later = None
        if self.unsaid:
            self._say(loop.time())

    def flush(self) -> None:
        """Say what was answered since the last line (the server stops: no timer will)."""
        if self.later is not None:
            self.later.cancel()
            self.later = None
        if self.unsaid:
            self._say(None)

    def _say(self, now) -> None:
        self.said_at = now
        what = (f"answered {self.unsaid} with 503 out_of_resources" if self.unsaid or self.reserve is not None else
                "no descriptor left even to refuse them: they wait")
        print(f"bitnet serve: out of file descriptors ({os.strerror(self.errno)}; {nofile()}) accepting "
              f"connections: {what}; raise ulimit -n or lower --max-connections", file=sys.stderr, flush=True)
        self.unsaid = 0

    def _answer_waiting(self, listen_fd: int) -> int:
        if self.reserve is None:
            self.reserve = _reserve_fd()   # a descriptor freed since: held for next time
            return 0
        os.close(self.reserve)
        self.reserve = None
        msg = "the server is out of resources (too many open files); retry later"
        raw = _raw_response(503, "Service Unavailable", msg, "out_of_resources",
                            f"retry-after: {self.limits.retry_after}\r\n")
        answered, listener = 0, None
        try:
            listener = socket.socket(fileno=listen_fd)   # the loop's own socket, not a copy: detached below
            while answered < self.MAX_PER_CALL:
                try:
                    conn, _ = listener.accept()
                except OSError:   # none waiting (EAGAIN), or the freed descriptor already taken
                    break
                with conn:
                    _answer_and_close(conn, raw)
                answered += 1
        except OSError:
            pass
        finally:
            if listener is not None:
                listener.detach()
            self.reserve = _reserve_fd()
        return answered


def _not_a_lost_write(record) -> bool:
    """asyncio's "socket.send() raised exception." (its 5th and later write to a connection already lost): a
    stream's client that hung up between two tokens, which uvicorn learns of a moment later and the handler then
    stops for. uvloop said nothing of it; a line of noise per hang-up in the server's log."""
    return record.getMessage() != "socket.send() raised exception."


def guard_loop(loop, limits: Limits = Limits()) -> AcceptGuard:
    """What `bitnet serve` sets on its (asyncio) event loop: AcceptGuard, listeners that wait a second after an
    accept out of descriptors (_accept_paused), and asyncio's log without the noise of clients that hang up
    mid-stream. The guard, for its flush() when the server stops."""
    import logging
    guard = AcceptGuard(limits)
    loop.set_exception_handler(guard)
    _accept_paused(loop)
    log = logging.getLogger("asyncio")
    if _not_a_lost_write not in log.filters:
        log.addFilter(_not_a_lost_write)
    return guard


ACCEPT_RETRY = 1.0   # s a listener waits after an accept out of descriptors (asyncio's own delay)
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _accept_paused(loop) -> None:
    """asyncio's accept loop (BaseSelectorEventLoop._accept_connection, 3.8-3.13) as on this loop: after an accept
    that fails for want of descriptors it stops, where asyncio's went on for its whole backlog (uvicorn's 2048).
    That called the guard ~2048 times a tick (each a reserve dance and a syscall or four: running streams stalled
    0.3-0.4 s a second) and scheduled as many retries of the listener; once it had closed (SIGTERM), each retry
    logged a traceback ("Invalid file descriptor: -1"), thousands in all. Here the listener's reader is removed
    and one retry comes a second later, which does nothing if the listener has closed meanwhile. A loop without
    these internals (uvloop, a later asyncio whose signatures differ) is left as it is."""
    import inspect
    from asyncio import trsock

    cls = type(loop)
    try:
        names = list(inspect.signature(cls._accept_connection).parameters)
        names2 = list(inspect.signature(cls._accept_connection2).parameters)
    except (AttributeError, TypeError, ValueError):
        return
    if names[:6] != ["self", "protocol_factory", "sock", "sslcontext", "server", "backlog"] or \
            names2[:6] != ["self", "protocol_factory", "conn", "extra", "sslcontext", "server"] or \
            names[6:] != names2[6:] or not hasattr(loop, "_start_serving") or not hasattr(loop, "_remove_reader"):
        return
    start_serving = loop._start_serving

    def resume(protocol_factory, sock, *rest):
        if sock.fileno() >= 0:   # -1: closed since (the server stopped): nothing to resume
            start_serving(protocol_factory, sock, *rest)

    def accept_connection(protocol_factory, sock, sslcontext=None, server=None, backlog=100, *timeouts):
        for _ in range(backlog):
            try:
                conn, addr = sock.accept()
                conn.setblocking(False)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return   # none waiting
            except OSError as exc:
                if exc.errno not in _OUT_OF:
                    raise   # the loop logs it and goes on, as asyncio's
                loop.call_exception_handler({"message": "socket.accept() out of system resource", "exception": exc,
                                             "socket": trsock.TransportSocket(sock)})
                loop._remove_reader(sock.fileno())
                loop.call_later(ACCEPT_RETRY, resume, protocol_factory, sock, sslcontext, server, backlog, *timeouts)
                return
            loop.create_task(loop._accept_connection2(protocol_factory, conn, {"peername": addr}, sslcontext,
                                                      server, *timeouts))
    loop._accept_connection = accept_connection   # _start_serving adds the reader with self._accept_connection


def _answer_and_close(conn: socket.socket, raw: bytes) -> None:
    """Without blocking: read what the client has sent (closing over unread bytes sends a reset, which can
    destroy the answer before the client reads it), send the answer, end our side."""
    try:
        conn.setblocking(False)
        for _ in range(16):
            if not conn.recv(65536):
                break
    except OSError:
        pass
    try:
        conn.send(raw)
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def nofile() -> str:
    try:
        import resource
        return f"ulimit -n {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    except (ImportError, OSError, ValueError):
        return "the open-files limit"


def _close_delimited(cycle, send):
    """uvicorn's httptools cycle's send for an HTTP/1.0 request: an answer of unknown length (a stream) is sent
    as it comes and ended by closing the connection (RFC 9112 6.3), as HTTP/1.0 has no chunked coding; uvicorn
    sent it chunked, which a 1.0 client (ab, an old proxy) shows as hex lengths in the text. h11's cycle does this
    itself."""
    async def send10(msg):
        if msg["type"] == "http.response.start" and cycle.scope["method"] != "HEAD" \
                and msg["status"] not in (204, 304) and not any(
                    k.lower() in (b"content-length", b"transfer-encoding") for k, _ in msg.get("headers", ())):
            cycle.chunked_encoding, cycle.keep_alive, cycle.expected_content_length = False, False, 1 << 62
            cycle.close_delimited = True
        elif msg["type"] == "http.response.body" and getattr(cycle, "close_delimited", False) \
                and not msg.get("more_body", False):
            cycle.expected_content_length = len(msg.get("body", b""))   # it ends here: uvicorn's count comes to 0
        await send(msg)
    return send10


class _UpgradesIgnored:
    """uvicorn's httptools parser, with every Upgrade ignored (RFC 9110 7.8: a server may, and then answers the
    request as it came): this server has no websocket or h2c routes. llhttp stops at the end of the headers of a
    request that asks to upgrade (curl --http2, Java's HttpClient, a proxy passing a websocket's headers on) and
    leaves the rest to the other protocol; uvicorn then ran the request with no body and parsed its body as the next
    request (a request hidden in it ran past a front proxy's rules). Here a fresh parser takes over, fed the
    request's framing (its Content-Length / Transfer-Encoding) with the protocol's callbacks muted, so the body
    goes to its request and what follows it is parsed as what it is. Every other attribute is the parser's."""

    def __init__(self, protocol, parser):
        self._protocol, self._parser = protocol, parser

    def __getattr__(self, name):
        return getattr(self._parser, name)

    def feed_data(self, data: bytes) -> None:
        import httptools
        p = self._protocol
        for _ in range(len(data) + 1):   # each pass takes a request's headers at least: bounded by the bytes
            try:
                return self._parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                offset = e.args[0] if e.args and isinstance(e.args[0], int) else len(data)
            except httptools.HttpParserError as e:   # uvicorn answers 400 with a fixed text: why, for ours
                p._why = _parser_why(e)
                raise
            version = self._parser.get_http_version() or "1.1"
            framing = "".join(f"{k.decode('latin-1')}: {v.decode('latin-1')}\r\n" for k, v in p.headers
                              if k in (b"content-length", b"transfer-encoding"))
            self._parser = httptools.HttpRequestParser(p)
            try:
                self._parser.set_dangerous_leniencies(lenient_data_after_close=True)   # as uvicorn sets its own
            except AttributeError:
                pass
            p._replaying = True
            try:
                self._parser.feed_data(f"POST / HTTP/{version}\r\n{framing}\r\n".encode("latin-1"))
            except httptools.HttpParserError as e:   # framing llhttp refuses (Content-Length beside chunked)
                p._why = _parser_why(e)
                raise
            finally:
                p._replaying = False
            data = data[offset:]


def _framing_checked(app):
    """The app behind a check of the request's framing, before anything else sees it: Content-Length beside
    Transfer-Encoding (RFC 9112 6.3: a sign of request smuggling, which a server must refuse or close the connection
    after) is a 400 and the connection closed. httptools refuses it itself; h11 took the chunked body and kept the
    connection, so the bytes the Content-Length covered past it ran as a request of their own (CL.TE)."""
    async def checked(scope, receive, send):
        if scope["type"] == "http":
            names = {k for k, _ in scope.get("headers") or () if k in (b"content-length", b"transfer-encoding")}
            if len(names) == 2:
                return await send_error(send, scope, 400, "not a valid HTTP/1.1 request (Content-Length beside "
                                        "Transfer-Encoding)", "invalid_request_error", "invalid_http", close=True)
        return await app(scope, receive, send)
    return checked


def _parser_why(e: BaseException) -> str:
    """Why httptools refused a request, in one line."""
    why = e.__context__ if type(e).__name__ == "HttpParserCallbackError" and e.__context__ is not None else e
    return " ".join(str(why).split())[:200] or type(why).__name__


def _not_http(why: str | None) -> bytes:
    text = f"not a valid HTTP/1.1 request ({why})" if why else "not a valid HTTP/1.1 request"
    return _raw_response(400, "Bad Request", text, "invalid_http")


def guarded_protocol(limits: Limits, base=None):
    """A subclass of uvicorn's HTTP protocol (`base`; default: httptools, a dependency; h11 where it is missing,
    which behaves the same here) that enforces the connection cap, the header timeout, (httptools) the header size
    and the send timeout, and HTTP's framing rules above (_UpgradesIgnored, _framing_checked); pass it as
    uvicorn.Config(http=...). The send timeout: a client that takes nothing of what is written to it for
    limits.send_timeout (the transport paused the whole time: its buffer full) is cut off (transport.abort()).
    Without it such a client held its connection for ever, a finished answer's megabytes with it, and counted
    against --max-connections: that many of them locked everyone else out.
    The class's `stopping()` (any thread; the drain's deadline calls it) cuts, from then on, each connection whose
    unsent bytes have not shrunk for STOP_GRACE s: a client reading nothing held its handler's last send (the send
    timeout is longer than the drain) until uvicorn's graceful-shutdown timeout cancelled the handler and logged
    a traceback."""
    if base is None:
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        except ImportError:
            from uvicorn.protocols.http.h11_impl import H11Protocol as base

    live: set = set()              # the open connections, for stopping()
    shared = {"loop": None}        # the server's event loop (stopping() may be called from another thread)

    httptools_base = hasattr(base, "on_message_begin")

    class GuardedProtocol(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # no websocket routes here: a request asking for one is answered as any other (uvicorn handed it to its
            # websocket protocol, which answered a POST 408 after --header-timeout, or a plain-text 400)
            self.ws_protocol_class = None
            self._why = None          # why the parser refused the request (its error), for the 400 that says so
            self._replaying = False   # feeding a fresh parser a request's framing (_UpgradesIgnored): callbacks muted
            if httptools_base:
                self.parser = _UpgradesIgnored(self, self.parser)
            else:
                self.conn.next_event = self._h11_next_event(self.conn.next_event)
            self.app = _framing_checked(self.app)

        def _h11_next_event(self, next_event):
            import h11

            def noted():
                try:
                    return next_event()
                except h11.RemoteProtocolError as e:
                    self._why = e
                    raise
            return noted

        def _unsupported_upgrade_warning(self):
            pass   # an Upgrade ignored is HTTP's rule (RFC 9110 7.8), not a warning per request

        def _should_upgrade(self):
            return False

        @staticmethod
        def stopping():
            loop = shared["loop"]
            if loop is None:
                return
            try:
                loop.call_soon_threadsafe(lambda: [p._watch_stop() for p in list(live) if p._stop_timer is None])
            except RuntimeError:   # the loop has already closed: nothing is left to cut
                pass

        def connection_made(self, transport):
            super().connection_made(transport)
            shared["loop"] = self.loop
            live.add(self)
            self._timer = None
            self._stop_timer = None
            self._send_timer = None
            self._send_left = 0
            self._rejected = False
            self._header_bytes = 0
            self._raw_header = 0     # bytes on the wire of the header block being read (httptools)
            self._in_body = False    # (httptools) between a request's end of headers and its end
            self._fed_body = False   # (httptools) the bytes being fed held some of a body
            self._turned = False     # a request's headers or message ended within the bytes being fed
            self._quiet_since = self.loop.time()   # nothing of a request heard since (opened, or last answered)
            self._heard = False
            self._over_cap = sum(not p._rejected for p in live) > limits.max_connections and not self._make_room()
            if self._over_cap:
                # its request, if it comes at once, is answered 503 in its API's shape (a response before the request
                # is read can be lost to a reset); a silent one is answered and closed after QUIET_GRACE, so that
                # such connections never hold the descriptors the cap keeps for those within it
                self.app = _overloaded_app(limits)
            self._arm()

        def _make_room(self) -> bool:
            """At the cap: close the connection that has sent nothing the longest (QUIET_GRACE at least), as nginx
            reuses its idle connections when it has none left: silent ones held the cap (at a low open-files limit,
            a handful) for the whole --header-timeout, a kept-alive idle one for --keep-alive-timeout, and every real
            client meanwhile got a 503. One that never sent a request gets the cap's 503 + Retry-After; an idle
            kept-alive one is closed, as its keep-alive timeout closes it. Whether one was closed."""
            now = self.loop.time()
            quiet = [p for p in live if p is not self and p._quiet_for(now) >= QUIET_GRACE]
            if not quiet:
                return False
            p = min(quiet, key=lambda p: p._quiet_since)
            if p.cycle is None:
                p._reject(_raw_response(503, "Service Unavailable", _over_cap_message(limits),
                                        "too_many_connections", f"retry-after: {limits.retry_after}\r\n"))
            else:
                p._rejected = True
                p._disarm()
                p.transport.close()
            return True

        def _quiet_for(self, now: float) -> float:
            """How long this connection has been silent, between requests (0: a request being read or answered)."""
            if self._rejected or self._heard or not self._in_headers() or self.transport.is_closing():
                return 0.0
            return now - self._quiet_since

        def on_response_complete(self):
            self._quiet_since, self._heard = self.loop.time(), False
            super().on_response_complete()

        def _in_headers(self):
            return self.cycle is None or self.cycle.response_complete

        def _arm(self):
            if self._timer is None and not self._rejected:
                wait = min(limits.header_timeout, QUIET_GRACE) if self._over_cap else limits.header_timeout
                self._timer = self.loop.call_later(wait, self._header_timeout)

        def _disarm(self):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _header_timeout(self):
            self._timer = None
            if not self._in_headers() or self.transport.is_closing():
                return
            if self._over_cap:
                self._reject(_raw_response(503, "Service Unavailable", _over_cap_message(limits),
                                           "too_many_connections", f"retry-after: {limits.retry_after}\r\n"))
                return
            self._reject(_raw_response(408, "Request Timeout", f"the request headers did not arrive within "
                                       f"{limits.header_timeout:g} s", "request_timeout"))

        def _reject(self, raw: bytes):
            self._rejected = True
            self._disarm()
            self.transport.write(raw)
            self.transport.close()

        def send_400_response(self, msg):   # after our own refusal the parser's error must not answer again
            c = self.cycle
            if c is not None and not c.response_complete and not getattr(c, "more_body", True):
                # bytes that do not parse after a request sent whole: that request is answered first (RFC 9112
                # 9.3.2: in order), then the connection closes (what followed it cannot be framed); it was lost
                c.keep_alive = False
                return
            if not self._rejected:
                self._reject(self._refusal())

        def _refusal(self) -> bytes:
            """The answer to bytes the parser refused, in JSON (uvicorn's was text/plain "Invalid HTTP request
            received."): h11's header block over its buffer (--max-header-kb) is the 431 httptools' gives."""
            why = self._why
            if getattr(why, "error_status_hint", 400) == 431:
                return _raw_response(431, "Request Header Fields Too Large", f"request headers over "
                                     f"{limits.max_header_bytes} bytes", "headers_too_large")
            if why is not None and not isinstance(why, str):   # h11's RemoteProtocolError
                why = " ".join(str(why).split())[:200] or None
            return _not_http(why)

        def on_headers_complete(self):   # httptools
            if self._replaying:
                return
            self._in_body, self._turned = True, True
            super().on_headers_complete()
            c = self.cycle
            if c is not None and c.scope.get("http_version") == "1.0" and hasattr(c, "chunked_encoding"):
                c.waiting_for_100_continue = False   # RFC 9110 10.1.1: a 1.0 client's Expect is ignored
                c.send = _close_delimited(c, c.send)

        def data_received(self, data):
            if self._rejected:
                return
            before = self.cycle
            self._heard = True
            if self._in_headers():
                self._arm()   # a new request on a kept-alive connection: its headers are timed from here
            self._turned, self._fed_body = False, False
            super().data_received(data)
            if self.cycle is not before and self.cycle is not None:
                self._disarm()
            if httptools_base and not self._rejected:
                if self._in_body and self._fed_body:
                    self._raw_header = 0   # a body's bytes came: what preceded them was a chunk's framing
                else:   # a header block, or (in a body) a chunked body's framing and trailer, which is header lines
                    self._count_raw(len(data))

        def _count_raw(self, n):
            """httptools hands a header over only once its value has ended: one that never ends was read on and
            held (64 MiB of it before the 431, 74 MiB before a 408). The bytes of a header block are counted here
            as they arrive (those after a request that ended within the same read are not: at most one read's
            worth more), and a block past the limit (with RAW_HEADER_SLACK for HTTP's own bytes) is a 431 at once.
            So are, within a chunked body, the reads that brought none of its bytes: a trailer (header lines after
            the last chunk, which llhttp parses as headers) or a chunk extension that never ended was read on and
            held until --body-timeout, its CPU growing with the square of its size, on the loop every stream shares."""
            self._raw_header = 0 if self._turned else self._raw_header + n
            if self._raw_header > limits.max_header_bytes + RAW_HEADER_SLACK:
                self._reject(_raw_response(431, "Request Header Fields Too Large", f"request headers over "
                                           f"{limits.max_header_bytes} bytes", "headers_too_large"))

        def on_message_begin(self):   # httptools: each request's header bytes counted alone (a pipelined burst
            if self._replaying:         # of small requests added up to one 431 for all)
                return
            self._header_bytes = 0
            super().on_message_begin()

        def on_url(self, url):
            if self._replaying:
                return
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name, value):
            if self._replaying:
                return
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_body(self, body):   # httptools
            self._fed_body = True
            super().on_body(body)

        def on_message_complete(self):
            if httptools_base and self.parser.should_upgrade():
                return   # llhttp ends a request asking to upgrade at its headers: its body follows (_UpgradesIgnored)
            self._in_body, self._turned = False, True
            super().on_message_complete()

        def _count(self, n):
            self._header_bytes += n
            if self._header_bytes > limits.max_header_bytes and not self._rejected:
                self._reject(_raw_response(431, "Request Header Fields Too Large", f"request headers over "
                                           f"{limits.max_header_bytes} bytes", "headers_too_large"))
                raise ValueError("headers too large")   # stops the parser; send_400_response stays quiet

        def pause_writing(self):   # the client's socket buffer is full: it has this long to take some of it
            super().pause_writing()
            if self._send_timer is None:
                self._arm_send()

        def _arm_send(self):
            self._send_left = self.transport.get_write_buffer_size()
            self._send_timer = self.loop.call_later(limits.send_timeout, self._send_timeout)

        def resume_writing(self):
            self._stop_send_timer()
            super().resume_writing()

        def _stop_send_timer(self):
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _send_timeout(self):
            """nginx's rule: the time between two successive writes the client takes, not the whole transfer (a
            large answer is one write to the transport: a slow but live reader took part of it, and goes on)."""
            self._send_timer = None
            if 0 < self.transport.get_write_buffer_size() < self._send_left:
                self._arm_send()   # it took some: another while
                return
            self.transport.abort()   # nothing taken for a whole send_timeout: connection_lost follows

        def _watch_stop(self, last=None):
            """While stopping: a connection whose unsent bytes have not shrunk since the last look is cut (its
            handler's send returns, the client sees the connection close), so the drain ends within its deadline."""
            self._stop_timer = None
            if self.transport.is_closing() and not self.transport.get_write_buffer_size():
                return   # closed, or closing with nothing left to send: connection_lost follows
            left = self.transport.get_write_buffer_size()
            if last and left >= last:   # bytes pending at the last look, and none taken since
                peer = self.transport.get_extra_info("peername")
                who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
                print(f"bitnet serve: stopping: closed the connection of {who}, which took nothing of its answer "
                      f"for {STOP_GRACE:g} s", file=sys.stderr, flush=True)
                self.transport.abort()
                return
            self._stop_timer = self.loop.call_later(STOP_GRACE, self._watch_stop, left)

        def connection_lost(self, exc):
            live.discard(self)
            if self._stop_timer is not None:
                self._stop_timer.cancel()
                self._stop_timer = None
            self._disarm()
            self._stop_send_timer()
            super().connection_lost(exc)

    return GuardedProtocol


def guarded_server(limits):
    """uvicorn's Server on asyncio's loop with this module's accept guard (guard_loop: out of descriptors, the
    connections waiting are answered 503 out_of_resources and logged in one line), and no signal handlers of its
    own: the caller's stop it (uvicorn re-raised a caught signal after shutdown, exit 130/143 for a drained
    server, and in a thread it cannot install them). The plain server's and Ray's front's."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

        async def startup(self, sockets=None):
            self.accept_guard = guard_loop(asyncio.get_running_loop(), limits)
            await super().startup(sockets=sockets)

        async def shutdown(self, sockets=None):
            try:
                await super().shutdown(sockets=sockets)
            finally:
                guard = getattr(self, "accept_guard", None)
                if guard is not None:
                    guard.flush()   # the connections refused since its last line are in the log too
    return Server
