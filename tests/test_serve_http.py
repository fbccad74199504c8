"""HTTP/1.1 framing at `bitnet serve`'s door (serve/limits.py guarded_protocol and LimitsMiddleware), on both of
uvicorn's parsers: httptools (a dependency, what every install runs) and h11 (what uvicorn falls back to where
httptools is missing: the server runs here with httptools hidden from it). Raw bytes on a socket, since HTTP
clients never send these shapes: a request asking to upgrade (curl --http2, Java's HttpClient) is served as
itself and its body never runs as a request of its own, Content-Length beside Transfer-Encoding is refused and
the connection closed, the header limit counts each pipelined request alone, a 405 names every method its path
takes, and what the parser refuses is answered in JSON."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
from serve_proc import Server  # noqa: E402

CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}).encode()
HIDE_HTTPTOOLS = "import sys\nsys.modules['httptools'] = None   # uvicorn without httptools: its h11 protocol\n"


def _has_httptools() -> bool:
    import importlib.util
    return importlib.util.find_spec("httptools") is not None


@pytest.fixture(scope="module", params=["httptools", "h11"])
def parser(request, tmp_path_factory):
    """(server, parser name): one `bitnet serve` per parser."""
    env = {}
    if request.param == "httptools" and not _has_httptools():
        pytest.skip("httptools is not installed here (pip install httptools): the httptools parser's cases "
                    "did not run, only h11's")
    if request.param == "h11":
        d = tmp_path_factory.mktemp("no-httptools")
        (d / "sitecustomize.py").write_text(HIDE_HTTPTOOLS)
        env["PYTHONPATH"] = str(d)
    s = Server("--parallel", "2", env=env)
    yield s, request.param
    assert s.stop()[0] == 0


def _running_parser(s: Server) -> str:
    """Which parser the server's protocol class is built on, from /proc: the modules its process has loaded."""
    with open(f"/proc/{s.proc.pid}/maps") as f:
        return "httptools" if "httptools" in f.read() else "h11"


def exchange(port: int, *parts: bytes, pause: float = 0.2, timeout: float = 60.0) -> bytes:
    """Send `parts` (each its own write, `pause` s apart: separate TCP segments), then read until the server
    closes the connection (bounded by `timeout`); what came back."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause)
            sock.sendall(part)
        sock.settimeout(timeout)
        out = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    return out
                out += chunk
        except ConnectionResetError:
            return out


def responses(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """The HTTP/1.1 responses in `raw`, in order: (status, headers lowercased, body), each body framed by its
    Content-Length, chunked coding, or the end of the connection."""
    out = []
    while raw:
        head, sep, raw = raw.partition(b"\r\n\r\n")
        assert sep, head[:300]
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, raw = raw[:n], raw[n:]
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size, _, raw = raw.partition(b"\r\n")
                n = int(size.split(b";")[0], 16)
                body, raw = body + raw[:n], raw[n + 2:]
                if n == 0:
                    break
        else:
            body, raw = raw, b""
        out.append((status, headers, body))
    return out


def post_head(path: str, n: int, *extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n"
            + "".join(f"{h}\r\n" for h in extra) + "\r\n").encode()


H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
       "HTTP2-Settings: AAEAAEAAAAIAAAABAAMAAABkAAQBAAAAAAUAAEAA")   # what Java's HttpClient sends on http://
CLOSE = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def test_the_parser_is_the_one_asked_for(parser):
    s, name = parser
    assert _running_parser(s) == name


def test_a_request_asking_to_upgrade_is_served_as_itself(parser):
    """RFC 9110 7.8: a server may ignore an Upgrade it does not support, and then answers the request as it came.
    Java's HttpClient (HTTP_2 its default) and curl --http2 ask for h2c on every http:// request: httptools took
    the body as another protocol's bytes, so the request ran with none (a 400), and a body in a later segment was
    parsed as a request of its own."""
    s, _ = parser
    # the body in the same segment as the headers, a request pipelined after it
    got = responses(exchange(s.port, post_head("/v1/chat/completions", len(CHAT), *H2C) + CHAT + CLOSE))
    assert [g[0] for g in got] == [200, 200], got
    assert json.loads(got[0][2])["object"] == "chat.completion", got[0]
    # the body in a segment of its own
    got = responses(exchange(s.port, post_head("/v1/chat/completions", len(CHAT), *H2C), CHAT, CLOSE))
    assert [g[0] for g in got] == [200, 200], got
    assert json.loads(got[0][2])["object"] == "chat.completion", got[0]
    # chunked, and on ollama's API
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
                       "options": {"num_predict": 3}}).encode()
    head = (b"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            + "".join(f"{h}\r\n" for h in H2C).encode() + b"\r\n")
    got = responses(exchange(s.port, head, b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n", CLOSE))
    assert [g[0] for g in got] == [200, 200], got
    assert json.loads(got[0][2])["done"] is True, got[0]
    # a websocket upgrade (this server has no websocket routes): a GET answered as a GET, at once
    got = responses(exchange(s.port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
                                     b"Upgrade: websocket\r\n\r\n" + CLOSE))
    assert [g[0] for g in got] == [200, 200] and json.loads(got[0][2])["object"] == "list", got
    got = responses(exchange(s.port, post_head("/v1/chat/completions", len(CHAT), "Connection: Upgrade",
                                               "Upgrade: websocket") + CHAT + CLOSE))
    assert [g[0] for g in got] == [200, 200], got


def test_the_body_of_an_upgrade_request_never_runs_as_a_request(parser):
    """A body that is itself an HTTP request, sent after headers that ask to upgrade (a proxy forwarding
    websocket headers passes them on): it is that request's body (here not JSON: a 400), never a second request
    run past the proxy's rules."""
    s, _ = parser
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for parts in ((post_head("/v1/chat/completions", len(smuggled), "Connection: Upgrade", "Upgrade: foo"),
                   smuggled),
                  (post_head("/v1/chat/completions", len(smuggled), "Connection: Upgrade", "Upgrade: foo")
                   + smuggled,)):
        got = responses(exchange(s.port, *parts, CLOSE))
        assert [g[0] for g in got] == [400, 200], got
        assert json.loads(got[0][2])["error"]["code"] == "invalid_json", got[0]
        assert all(b'"object":"list"' not in g[2].replace(b" ", b"") for g in got), got


def test_content_length_beside_transfer_encoding_is_refused_and_the_connection_closed(parser):
    """RFC 9112 6.3: a message with both is a sign of request smuggling; the server must refuse it or close the
    connection after it. h11 read the chunked body and served what the Content-Length covered after it as a
    second request (CL.TE); httptools refused it in plain text."""
    s, _ = parser
    smuggled = b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % len(smuggled))
    got = responses(exchange(s.port, head + smuggled))
    assert len(got) == 1 and got[0][0] == 400, got
    assert got[0][1].get("connection") == "close" and got[0][1]["content-type"] == "application/json", got[0]
    assert json.loads(got[0][2])["error"]["message"], got[0]
    # a valid chunked body: refused all the same, and what follows it on the connection is not served
    body = b"%x\r\n" % len(CHAT) + CHAT + b"\r\n0\r\n\r\n"
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    got = responses(exchange(s.port, head + body + CLOSE))
    assert [g[0] for g in got] == [400], got


def test_the_header_limit_counts_each_pipelined_request_alone(parser):
    """--max-header-kb (32 KiB) is per request: 40 pipelined requests of 1 KiB of headers each are all answered
    (httptools' count ran on over the whole burst: one 431 for all, after the first had run unanswered)."""
    s, _ = parser
    one = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Token: " + b"a" * 1000 + b"\r\n\r\n"
    got = responses(exchange(s.port, one * 39 + CLOSE.replace(b"\r\n\r\n", b"\r\nX-Token: " + b"a" * 1000
                                                                + b"\r\n\r\n")))
    assert [g[0] for g in got] == [200] * 40, [g[0] for g in got]
    # one request over the limit is still refused, URL and headers counted together (h11 left the URL out)
    got = responses(exchange(s.port, b"GET /health?" + b"q" * (40 << 10) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
    assert [g[0] for g in got] == [431], got
    assert json.loads(got[0][2])["error"]["code"] == "headers_too_large", got[0]
    got = responses(exchange(s.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * (1 << 20)
                             + b"\r\n\r\n"))
    assert [g[0] for g in got] == [431], got
    assert got[0][1]["content-type"] == "application/json", got[0]


@pytest.mark.parametrize("raw, words", [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\x00b\r\n\r\n", "header"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "Content-Length"),
], ids=["nul-in-header", "bad-chunk-size", "two-content-lengths"])
def test_a_request_the_parser_refuses_is_answered_in_json(parser, raw, words):
    """Bytes that are not HTTP/1.1: a 400 in the API's JSON error shape saying why, and the connection closed
    (uvicorn's was a plain-text "Invalid HTTP request received.")."""
    s, _ = parser
    got = responses(exchange(s.port, raw))
    assert len(got) == 1 and got[0][0] == 400, got
    assert got[0][1]["content-type"] == "application/json" and got[0][1].get("connection") == "close", got[0]
    err = json.loads(got[0][2])["error"]
    assert err["code"] == "invalid_http" and err["message"].startswith("not a valid HTTP/1.1 request"), err
    assert words.lower() in err["message"].lower(), err   # the parser's reason


def test_a_405_names_every_method_its_path_takes(parser):
    """RFC 9110 15.5.6: a 405's Allow lists the methods the resource supports. /health's said HEAD (its HEAD route
    came first), /props's POST (a route that refuses POST), /v1/models's GET (HEAD is served too)."""
    s, _ = parser
    for method, path, allow in (("DELETE", "/health", "GET, HEAD"), ("OPTIONS", "/metrics", "GET, HEAD"),
                                ("PUT", "/", "GET, HEAD"), ("PUT", "/props", "GET, HEAD"),
                                ("PUT", "/v1/models", "GET, HEAD"), ("DELETE", "/v1/health", "GET, HEAD"),
                                ("PUT", "/v1/chat/completions", "POST")):
        r = httpx.request(method, s.url + path, timeout=60)
        assert r.status_code == 405 and r.headers.get("allow") == allow, (method, path, r.status_code, r.headers)
        assert r.json()["error"]["message"], r.text


def test_a_body_is_read_as_json_whatever_its_content_type_says(parser):
    """A JSON body sent as multipart/form-data: read as JSON as with every other Content-Type (llama-server and
    ollama read bodies so), where it was a 400 "request body must be a JSON object" on some routes and a 200 on
    /v1/embeddings."""
    s, _ = parser
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
                       ("/completion", {"prompt": "Hi", "n_predict": 2}), ("/tokenize", {"content": "Hi"}),
                       ("/v1/messages", {"model": "m", "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/embeddings", {"input": "Hi"})):
        r = httpx.post(s.url + path, content=json.dumps(body), timeout=60,
                       headers={"Content-Type": "multipart/form-data; boundary=x"})
        assert r.status_code == 200, (path, r.text)
    r = httpx.post(s.url + "/v1/chat/completions", files={"f": ("a.txt", b"hello")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": N}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": N}', "max_tokens"),
    ("/completion", '{"prompt": "hi", "n_predict": N}', "n_predict"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": N}}',
     "logit_bias.5"),
    ("/api/chat", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": -N}}',
     "options.num_predict"),
    ("/api/generate", '{"model": "m", "prompt": "hi", "options": {"seed": N}}', "options.seed"),
    ("/v1/embeddings", '{"input": [[1, 2, N]]}', "input[0][2]"),
    ("/v1/messages", '{"model": "m", "max_tokens": N, "messages": [{"role": "user", "content": "hi"}]}',
     "max_tokens"),
], ids=lambda x: x if isinstance(x, str) and x.startswith("/") else "")
def test_an_integer_too_long_to_read_names_its_field(parser, path, body, field):
    """An integer of 5,000 digits (past what Python converts): a 400 naming the field, in the API's shape, never
    Python's "use sys.set_int_max_str_digits()" nor FastAPI's "There was an error parsing the body"."""
    s, _ = parser
    r = httpx.post(s.url + path, content=body.replace("N", "9" * 5000), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    text = r.text
    assert "sys.set_int_max_str_digits" not in text and "error parsing the body" not in text, text
    assert f"{field}: an integer of 5000 digits" in text, text
    if not path.startswith("/api/") and path != "/v1/messages":
        assert r.json()["error"]["param"] == field and r.json()["error"]["code"] == "invalid_value", text


def test_an_unterminated_header_is_refused_while_it_arrives(parser):
    """One header value that never ends: refused with the 431 as soon as the bytes of the header block pass
    --max-header-kb (32 KiB here), not read on until it ends or the header timeout fires (httptools hands a value
    over only once it is complete: the server took 64 MiB of one before its 431, 74 MiB before a 408). Sent as
    1 MiB of a value, then nothing more: the answer can only be the size limit's, whatever the machine's speed."""
    s, _ = parser
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        try:
            for _ in range(16):
                sock.sendall(b"b" * (64 << 10))
        except OSError:   # refused and closed while we sent: what follows reads its answer
            pass
        sock.settimeout(60)
        out = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    got = responses(out)
    assert [g[0] for g in got] == [431], out[:300]
    assert json.loads(got[0][2])["error"]["code"] == "headers_too_large", got[0]


def test_a_chunked_trailer_that_never_ends_is_refused_while_it_arrives(parser):
    """A chunked body's trailer section is header lines too: one that never ends is refused (431) once its bytes
    pass --max-header-kb, as a header is (httptools read on and held it until --body-timeout, at a CPU cost that
    grew with the square of its size, on the loop every stream shares). Sent as 1 MiB, then nothing more: the
    answer can only be the size limit's, whatever the machine's speed."""
    s, _ = parser
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: ")
        try:
            for _ in range(16):
                sock.sendall(b"b" * (64 << 10))
        except OSError:   # refused and closed while we sent: what follows reads its answer
            pass
        sock.settimeout(60)
        out = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    got = responses(out)
    assert [g[0] for g in got] == [431], out[:300]
    assert json.loads(got[0][2])["error"]["code"] == "headers_too_large", got[0]
    # a body in many tiny chunks (framing bytes far past the header limit) is a body, not a trailer: served
    body = CHAT + b" " * (16 << 10)
    chunks = b"".join(b"1\r\n" + body[i:i + 1] + b"\r\n" for i in range(len(body))) + b"0\r\nX-T: 1\r\n\r\n"
    got = responses(exchange(s.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + CLOSE))
    assert [g[0] for g in got] == [200, 200], got
