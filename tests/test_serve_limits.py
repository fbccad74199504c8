"""What a hostile or broken client may cost `bitnet serve` (serve/limits.py, serve/auth.py, serve/offload.py),
against a real subprocess on 127.0.0.1: huge prompts refused while a small request is still served, RSS back
after them, slowloris connections cut with 408 while a normal client is served, the connection cap's 503, a slow
body's 408, the request timeout cancelling the sequence, API keys from a file on every endpoint but /health.
Timings are printed, never asserted."""
from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
from serve_proc import Server, pythonpath, slow_model  # noqa: E402

Q = [{"role": "user", "content": "What is 12+7?"}]
WILD = {"temperature": 2.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 3}


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    return e


def settle(url, headers=None, timeout=10.0) -> dict:
    """/slots once nothing runs or waits (or the last answer when the time is up)."""
    deadline = time.monotonic() + timeout
    while True:
        st = httpx.get(url + "/slots", headers=headers).json()
        if (not st["slots"] and st["metrics"]["running"] == 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def _get_until(url, status, timeout=30.0) -> httpx.Response:
    """GET url until it answers `status`, or the last answer when the time is up. The server counts a connection
    opened or closed when its event loop gets to it: on a busy machine that can take longer than any fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url, timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


# ---- big prompts ------------------------------------------------------------------------------------------
def test_huge_prompts_refused_while_small_request_streams():
    """10 MB prompts (under --max-body-mb, over what the context could hold: refused from their Content-Length, or
    a chunked one as soon as it passes that bound, on both APIs) and a 50 MB one (over --max-body-mb: 413 unread)
    while a small streaming request gets its tokens. Bodies under the bound still cannot slip through: 1 MB of
    tiny messages or token ids is refused from its structure while parsing, a 1 MB prompt by its length in
    characters before it is rendered or tokenized (OpenAI's endpoints and ollama's alike)."""
    s = Server("--parallel", "4", "--max-body-mb", "16")
    try:
        httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 8}, timeout=60)
        rss_before = s.rss_kb()
        times: dict = {}

        def prompt(mb):
            return "7 + 8 = 15. " * (int(mb * (1 << 20)) // 12)
        # (path, body, chunked), built before the clock starts
        bodies = {f"{mb} MB prompt": ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(mb)}],
                                                               "max_tokens": 4}, False) for mb in (10, 50)}
        bodies["10 MB prompt, chunked"] = ("/v1/completions", {"prompt": prompt(10)}, True)
        bodies["ollama chat 10 MB"] = ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": prompt(10)}]}, False)
        bodies["ollama generate 10 MB"] = ("/api/generate", {"model": "m", "prompt": prompt(10)}, False)
        bodies["responses 10 MB"] = ("/v1/responses", {"input": prompt(10)}, False)
        bodies["completion 10 MB"] = ("/completion", {"prompt": prompt(10)}, False)
        for mb in (10, 50):
            bodies[f"anthropic {mb} MB"] = ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [
                {"role": "user", "content": prompt(mb)}]}, False)
        # under the bound: tiny messages and token ids (cheap to send, dear to parse and validate: GIL-bound, so a
        # thread does not help), and prompts too long in characters for the context
        bodies["many messages"] = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 30_000}, False)
        bodies["many token ids"] = ("/v1/completions", {"prompt": [5] * 300_000}, False)
        bodies["1 MB prompt"] = ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(1)}]}, False)
        bodies["ollama chat 1 MB"] = ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": prompt(1)}]}, False)
        bodies["ollama generate 1 MB"] = ("/api/generate", {"model": "m", "prompt": prompt(1), "system": "x"}, False)
        bodies = {k: (path, json.dumps(b).encode(), chunked) for k, (path, b, chunked) in bodies.items()}

        def chunked_post(path, body):
            """Send body in 64 KiB chunks until the server answers (it does, then closes, mid-body: an HTTP client
            would report its failed write instead of the answer); (status, json)."""
            with socket.create_connection(("127.0.0.1", s.port)) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             "Transfer-Encoding: chunked\r\n\r\n".encode())
                for i in range(0, len(body), 1 << 16):
                    if select.select([sock], [], [], 0)[0]:
                        break
                    piece = body[i: i + (1 << 16)]
                    try:
                        sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
                    except OSError:   # answered and closed while this chunk was on its way: the answer waits
                        break
                return _raw_status(sock)

        async def big(label):
            path, body, chunked = bodies[label]
            t0 = time.perf_counter()
            if chunked:
                r = await asyncio.to_thread(chunked_post, path, body)
                r = httpx.Response(r[0], json=r[1])
            else:
                async with httpx.AsyncClient(timeout=120) as c:
                    r = await c.post(s.url + path, content=body, headers={"content-type": "application/json"})
            times[f"{label} refused"] = time.perf_counter() - t0
            return r

        async def small():
            async with httpx.AsyncClient(timeout=120) as c:
                await asyncio.sleep(0.05)   # sent while the big ones are in flight
                t0, first, text = time.perf_counter(), None, []
                async with c.stream("POST", s.url + "/v1/chat/completions",
                                    json={"messages": Q, "max_tokens": 16, "stream": True, **WILD}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            d = json.loads(line[6:])["choices"][0]["delta"].get("content")
                            if d:
                                first = first or time.perf_counter() - t0
                                text.append(d)
                        if line == "data: [DONE]":
                            break
                times["small request: first token"] = first
                times["small request: whole answer"] = time.perf_counter() - t0
                return "".join(text)

        async def main():
            return await asyncio.gather(small(), *(big(label) for label in bodies))
        text, *answers = asyncio.run(main())
        got = dict(zip(bodies, answers))
        assert openai_error(got.pop("50 MB prompt"), 413)["code"] == "body_too_large"
        r = got.pop("anthropic 50 MB")   # Anthropic's error shape on its path, from the limits middleware too
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text[:300]
        for label, r in got.items():
            if label.startswith("anthropic"):
                assert r.status_code == 400 and r.json()["type"] == "error", (label, r.text[:300])
                assert r.json()["error"]["type"] == "invalid_request_error" and "context" in r.json()["error"]["message"]
            elif label.startswith("ollama"):
                assert r.status_code == 400 and set(r.json()) == {"error"}, (label, r.text[:300])
                assert "context" in r.json()["error"], (label, r.text[:300])
            else:
                e = openai_error(r, 400)
                assert e["code"] == "context_length_exceeded" and e["param"] in ("messages", "prompt", "input", None), \
                    (label, e)
        assert text
        time.sleep(0.5)
        rss_after = s.rss_kb()
        print("\n" + ", ".join(f"{k} {v:.3f} s" for k, v in times.items() if v is not None))
        print(f"RSS before {rss_before / 1024:.0f} MiB, after the big prompts {rss_after / 1024:.0f} MiB")
        assert rss_after < rss_before * 1.10 + 10 * 1024, (rss_before, rss_after)   # within 10% (+10 MiB noise)
        st = settle(s.url)
        assert st["metrics"]["kv_pages_reserved"] == 0
        # refusals are counted like any answer
        from prometheus_client.parser import text_string_to_metric_families
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(s.url + "/metrics").text)}
        codes = {smp.labels["status"] for smp in fams["bitnet_http_requests"].samples}
        assert {"413", "400", "200"} <= codes, codes
    finally:
        assert s.stop()[0] == 0


def test_a_schema_s_objects_and_numbers_are_bounded_apart_from_the_context():
    """A response format's schema never enters the context: an enum of 10,000 integers or 3,000 bounded properties
    (60-110 KiB, under the 256 KiB spec limit) was refused as not fitting a 2048-token context. What does enter it
    is still bounded by the context, and a schema by the spec limit's worth."""
    from bitnet_cpu.serve.offload import BodyRefused, parse_bounded

    def body(**kw):
        return json.dumps({"messages": Q, **kw}).encode()
    props = {f"p{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(3000)}
    for schema in ({"enum": list(range(10000))}, {"type": "object", "properties": props}):
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        assert parse_bounded(body(response_format=fmt), 2048)["response_format"] == fmt
    assert parse_bounded(body(json_schema={"enum": list(range(10000))}), 2048)["json_schema"]
    for big in ({"messages": [{"role": "user", "content": "hi", "x": list(range(10000))}]},
                {"messages": Q, "logit_bias": {str(i): 1 for i in range(10000)}},
                {"messages": Q, "json_schema": {"enum": list(range(200_000))}}):   # past a 256 KiB schema's worth
        with pytest.raises(BodyRefused) as e:
            parse_bounded(json.dumps(big).encode(), 2048)
        assert e.value.code == "context_length_exceeded" and "schemas" in e.value.detail


def test_a_prompt_of_token_ids_past_the_bodys_bound_is_a_context_overflow():
    """A prompt of more token ids than a body's bound (4 x context + 256) is refused as the prompt that does not fit
    the context, with llama-server's counts, as one of fewer ids is: it got the bound's words about JSON objects
    and numbers outside schemas and /detokenize, naming no field."""
    from bitnet_cpu.serve.offload import BodyRefused, parse_bounded

    for n in (5000, 9000):
        with pytest.raises(BodyRefused) as e:
            parse_bounded(json.dumps({"prompt": [5] * n, "n_predict": 1}).encode(), 2048)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt", e.value.detail
        assert e.value.extra == {"n_prompt_tokens": n, "n_ctx": 2048}
        assert f"maximum context length is 2048 tokens. However, your prompt resulted in {n} tokens" in e.value.detail
    with pytest.raises(BodyRefused) as e:   # other numbers past the bound keep the bound's words
        parse_bounded(json.dumps({"prompt": [5] * 100, "x": list(range(9000))}).encode(), 2048)
    assert "JSON objects and numbers" in e.value.detail and e.value.param is None


def _send_until_answered(port: int, path: str, body: bytes, chunked: bool) -> tuple[int, int]:
    """POST body in 64 KiB pieces (Content-Length or chunked) until the server answers; (status, bytes sent)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode())
        sent = 0
        for i in range(0, len(body), 1 << 16):
            if select.select([sock], [], [], 0)[0]:
                break
            piece = body[i: i + (1 << 16)]
            try:
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece)
            except OSError:   # answered and closed while this piece was on its way
                break
            sent += len(piece)
        return _raw_status(sock)[0], sent


def test_refused_bodies_are_not_read():
    """A 64 MiB body to a 1 MiB cap, on a generating route and another: refused from its Content-Length before
    any of it is read, a chunked one as soon as it passes the cap, so the answer comes while most of the body is
    still unsent (the rest of what the client got out sat in socket buffers, a few MiB). Three at once, on each
    framing, leave the server's RSS where it was (within 10% + 10 MiB)."""
    s = Server("--max-body-mb", "1", "--parallel", "2")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "7 + 8 = 15. " * ((64 << 20) // 12)}]})
    body = body.encode()
    try:
        for path in ("/v1/chat/completions", "/api/show"):
            for chunked in (False, True):
                rss_before = s.rss_kb()
                out: list = []
                ts = [threading.Thread(target=lambda: out.append(_send_until_answered(s.port, path, body, chunked)))
                      for _ in range(3)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(120)
                time.sleep(0.5)
                rss_after = s.rss_kb()
                print(f"\n{path} {'chunked' if chunked else 'Content-Length'}: sent before the answer "
                      f"{[round(n / (1 << 20), 1) for _, n in out]} MiB of {len(body) >> 20}; "
                      f"RSS {rss_before >> 10} -> {rss_after >> 10} MiB")
                assert [st for st, _ in out] == [413] * 3, out
                assert all(n < len(body) // 2 for _, n in out), out
                assert rss_after < rss_before * 1.10 + 10 * 1024, (rss_before, rss_after)
        assert httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 4},
                          timeout=60).status_code == 200   # still serving
    finally:
        assert s.stop()[0] == 0


# ---- slow and many clients --------------------------------------------------------------------------------
def _raw_status(sock) -> tuple[int, dict]:
    data = b""
    sock.settimeout(15)
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, json.loads(body) if body else {}


def test_slowloris_cut_with_408_while_a_normal_client_is_served():
    s = Server("--parallel", "2", "--header-timeout", "2")
    socks = []
    try:
        for i in range(200):   # each sends part of its headers, then nothing
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow-" + str(i).encode())
            socks.append(c)
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 8}, timeout=30)
        print(f"\nnormal request beside 200 slowloris connections: {r.status_code} in {time.perf_counter() - t0:.3f} s")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        status, body = _raw_status(socks[0])
        assert status == 408 and body["error"]["code"] == "request_timeout"
    finally:
        for c in socks:
            c.close()
        assert s.stop()[0] == 0


def test_slow_body_408_and_connection_cap_503():
    s = Server("--parallel", "2", "--max-connections", "4", "--body-timeout", "1")
    socks = []
    try:
        c = socket.create_connection(("127.0.0.1", s.port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        status, body = _raw_status(c)
        c.close()
        assert status == 408 and body["error"]["code"] == "request_timeout"
        for i in range(4):   # the cap's worth of connections sending their headers slowly (a silent one would go)
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow-" + str(i).encode())
            socks.append(c)
        r = _get_until(s.url + "/v1/models", 503)
        e = openai_error(r, 503)
        assert e["code"] == "too_many_connections" and int(r.headers["retry-after"]) >= 1
        for c in socks:
            c.close()
        socks = []
        assert _get_until(s.url + "/v1/models", 200).status_code == 200   # room again
    finally:
        for c in socks:
            c.close()
        assert s.stop()[0] == 0


def _serve_at_nofile(limit: int, *flags: str):
    """`bitnet serve -t 1 FLAGS` on a free port under an open-files limit (`ulimit -n LIMIT`), its stderr piped:
    (the process, its URL, its port)."""
    import os
    import resource
    import subprocess
    import sys

    from serve_proc import ROOT, free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "-t", "1", "--port", str(port), *flags],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()), stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    return proc, f"http://127.0.0.1:{port}", port


def _close(socks: list, proc) -> None:
    """A test's end: its sockets closed, and its server killed if it is still running."""
    for c in socks:
        c.close()
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _answers(socks: list, until_open: int, timeout: float) -> tuple[dict, list]:
    """What each silent socket was sent before its connection ended ({index: bytes}; b"" for a reset or an end
    with nothing said), read until at most `until_open` of them are still open or `timeout` s have passed; and
    the ones still open."""
    got, ended, deadline = {i: b"" for i in range(len(socks))}, {}, time.monotonic() + timeout
    while len(socks) - len(ended) > until_open and time.monotonic() < deadline:
        ready, _, _ = select.select([c for i, c in enumerate(socks) if i not in ended], [], [], 1.0)
        for c in ready:
            i = socks.index(c)
            try:
                piece = c.recv(65536)
            except OSError:   # a reset: whatever came before it is lost to the client
                ended[i], got[i] = True, b""
                continue
            if not piece:
                ended[i] = True
            got[i] += piece
    return {i: got[i] for i in ended}, [i for i in range(len(socks)) if i not in ended]


def _refusal(raw: bytes) -> str:
    """The error code of a raw 503 answer that carries Retry-After and a JSON error, or what was wrong with it."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 503") or b"retry-after:" not in head.lower():
        return f"not a 503 with Retry-After: {raw[:120]!r}"
    return json.loads(body)["error"]["code"]


def test_silent_connections_do_not_hold_the_cap():
    """Connections that send nothing held their place for the whole --header-timeout: those over the cap kept a
    descriptor each, those within it locked every real client out with 503s. A connection over the cap that says
    nothing gets the cap's 503 + Retry-After and is closed, and at the cap a newcomer takes the place of the
    connection silent the longest, which gets the same 503."""
    from helpers import slowness
    s = Server("--parallel", "2", "--max-connections", "4", "--header-timeout", "600")
    socks = []
    try:
        for _ in range(8):
            socks.append(socket.create_connection(("127.0.0.1", s.port)))
        answered, still = _answers(socks, 4, 60 * slowness())   # the 4 over the cap (whichever they are)
        assert len(answered) >= 4, answered
        assert all(_refusal(a) == "too_many_connections" for a in answered.values()), answered
        r = _get_until(s.url + "/v1/models", 200, timeout=60 * slowness())
        assert r.status_code == 200, (r.status_code, r.text[:300])   # it took a silent one's place
        more, _ = _answers([socks[i] for i in still], len(still) - 1, 60 * slowness())
        assert more and all(_refusal(a) == "too_many_connections" for a in more.values()), more
    finally:
        for c in socks:
            c.close()
        assert s.stop()[0] == 0


def test_a_flood_of_silent_connections_at_the_open_files_limit_is_answered_not_reset():
    """`ulimit -n 40` (the cap lowered to 8) and 200 connections that send nothing: those past the cap held their
    descriptors for the whole --header-timeout, the process reached its limit, and every new client was reset
    without an answer or a log line until they timed out. Now each is answered in JSON with Retry-After: the
    cap's 503 too_many_connections, or, where the process is out of descriptors, 503 out_of_resources through a
    descriptor kept in reserve, with a line in the log; a real client gets in meanwhile."""

    from bitnet_cpu.cli.serve import FILES_RESERVE
    from helpers import slowness
    from serve_proc import wait_healthy
    proc, url, port = _serve_at_nofile(40, "-c", "256", "--header-timeout", "600")
    socks = []
    try:
        assert wait_healthy(url, 60 * slowness(), proc)
        for _ in range(200):
            socks.append(socket.create_connection(("127.0.0.1", port)))
        answered, still = _answers(socks, 40 - FILES_RESERVE, 90 * slowness())
        assert len(still) <= 40 - FILES_RESERVE, (len(still), len(answered))
        codes = [_refusal(a) for a in answered.values()]
        assert set(codes) <= {"too_many_connections", "out_of_resources"}, sorted(set(codes))[:3]
        assert "out_of_resources" in codes, codes
        r = _get_until(url + "/health", 200, timeout=60 * slowness())
        assert r.status_code == 200, (r.status_code, r.text[:300])
    finally:
        for c in socks:
            c.close()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.splitlines() if "out of file descriptors" in ln]
    assert lines and all("503 out_of_resources" in ln and "ulimit -n 40" in ln for ln in lines), err
    assert "Traceback" not in err and "socket.send() raised" not in err, err


_FLOODED_LISTENER = r"""
import asyncio, resource, socket, sys
from bitnet_cpu.serve.limits import guard_loop
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

async def main():
    loop = asyncio.get_running_loop()
    guard_loop(loop)
    held = []

    async def hold(reader, writer):   # every connection taken is kept: the descriptors run out
        held.append(writer)
    srv = await asyncio.start_server(hold, "127.0.0.1", 0, backlog=2048)   # uvicorn's backlog
    fd = srv.sockets[0].fileno()
    print(srv.sockets[0].getsockname()[1], flush=True)
    most = 0
    flooded = loop.run_in_executor(None, sys.stdin.readline)   # the test's line: its flood is over
    for _ in range(2400):   # the flood (at most 2 minutes): how many retries of the listener are waiting at once
        if flooded.done():
            break
        await asyncio.sleep(0.05)
        most = max(most, sum(1 for h in loop._scheduled if not h.cancelled() and any(
            isinstance(a, socket.socket) and a.fileno() == fd for a in h._args or ())))
    srv.close()   # the listener closes, the loop runs on (a server draining its requests)
    await asyncio.sleep(2.5)
    print(most, flush=True)
    for w in held:
        w.close()

asyncio.run(main())
"""


def test_an_accept_that_runs_out_of_descriptors_retries_once_and_not_after_the_listener_closed():
    """Out of descriptors, asyncio's accept loop went on for its whole backlog (2048) after the first EMFILE: the
    guard ran ~2048 times a tick (the server's streams stalled 0.3-0.4 s each second) and as many retries of the
    listener were scheduled; once it had closed (SIGTERM), each of them logged a traceback ("Invalid file
    descriptor: -1"), thousands of them. The listener now pauses until one retry a second later, which does
    nothing once it is closed."""
    import os
    import subprocess
    import sys

    from serve_proc import ROOT
    proc = subprocess.Popen([sys.executable, "-c", _FLOODED_LISTENER], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=pythonpath()))
    socks = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(300):   # ~3 s of them, as a flood comes; the listener stays open until the line below
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            time.sleep(0.01)
        out, err = proc.communicate("flooded\n", timeout=180)
    finally:
        _close(socks, proc)
    assert proc.returncode == 0, err[-2000:]
    assert int(out.split()[-1]) <= 1, out   # one retry at a time, not one per accept tried
    assert "Traceback" not in err and "Invalid file descriptor" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if "out of file descriptors" in ln]
    assert lines and all("answered" in ln or "no descriptor left" in ln for ln in lines), err[-2000:]


def test_sigterm_after_a_flood_at_the_open_files_limit_exits_0_without_tracebacks(tmp_path_factory):
    """`ulimit -n 64`, a stream in flight and a flood of silent connections, then SIGTERM: the drain kept the loop
    running while asyncio's thousands of accept retries fired on the closed listener, each logged with its
    traceback. The process now exits 0 with a quiet log, the stream whole."""
    import re
    import signal

    from helpers import slowness
    from serve_proc import wait_healthy
    proc, url, port = _serve_at_nofile(64, "-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2",
                                       "--header-timeout", "600")
    socks, got = [], {}

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "ignore_eos": True,
                "temperature": 0}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                got["last"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")][-1:]
        except httpx.HTTPError as e:
            got["last"] = repr(e)
    t = threading.Thread(target=stream)
    try:
        assert wait_healthy(url, 60 * slowness(), proc)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not httpx.get(url + "/slots").json()["slots"]:
            time.sleep(0.05)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:   # silent connections, a few hundred a second
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                pass
            time.sleep(0.004)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        t.join(60)
    finally:
        _close(socks, proc)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "Invalid file descriptor" not in err, err[-3000:]
    assert got.get("last") == ["data: [DONE]"], got
    assert re.search(r"out of file descriptors .* answered \d+ with 503 out_of_resources", err), err[-2000:]


def test_the_out_of_descriptors_log_counts_every_connection_it_answered():
    """The log's "answered K with 503 out_of_resources" left out what was answered less than a second after its
    last line when no later burst came: 245 refused, the log said 192. What is left is said a second after, or
    when the server stops, so the lines add up to what the clients got."""
    import re

    from helpers import slowness
    from serve_proc import wait_healthy
    proc, url, port = _serve_at_nofile(64, "-c", "256", "--header-timeout", "600")
    socks = []
    try:
        assert wait_healthy(url, 60 * slowness(), proc)
        for _ in range(300):
            socks.append(socket.create_connection(("127.0.0.1", port)))
        answered, _ = _answers(socks, 64 - 32, 60 * slowness())
        time.sleep(1.5)   # past the second the log waits for
    finally:
        for c in socks:
            c.close()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    refused = [_refusal(a) for a in answered.values()].count("out_of_resources")
    said = sum(int(n) for n in re.findall(r"answered (\d+) with 503 out_of_resources", err))
    assert refused and said == refused, (said, refused, err[-2000:])
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]


def test_the_cap_s_503_says_connection_for_one():
    from bitnet_cpu.serve.limits import Limits, _over_cap_message
    assert "has 1 connection open" in _over_cap_message(Limits(max_connections=1))
    assert "has 2 connections open" in _over_cap_message(Limits(max_connections=2))


def test_an_open_files_limit_too_low_to_serve_is_said_in_one_line():
    """`ulimit -n 17`: the server warned "taking at most 1 connections" and then failed on the first file an import
    opened, as an "internal error ... a bug in bitnet-cpu". It is one line naming the limit and what is needed,
    exit 2; a limit with room for one connection serves, its warning in good English."""
    import os
    import resource
    import subprocess
    import sys

    from helpers import slowness
    from serve_proc import ROOT, free_port, wait_healthy

    def serve(limit: int, port: int):
        return subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "-t", "1", "-c", "256", "--port",
                                 str(port)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    proc = serve(17, free_port())
    _, err = proc.communicate(timeout=120 * slowness())
    assert proc.returncode == 2, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "ulimit -n" in lines[0] and "17" in lines[0] and "33" in lines[0], err
    assert "internal error" not in err and "bug" not in err, err
    port = free_port()
    proc = serve(33, port)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", 60 * slowness(), proc), proc.stderr.read()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "taking at most 1 connection (503 beyond)" in err, err


def test_clients_that_read_nothing_are_cut_off_and_free_their_connections(tmp_path_factory):
    """Clients that ask for long answers and then read nothing (their socket buffers full) were kept for ever, each
    with its answer's megabytes, and counted against --max-connections: that many locked everyone out (503 to all,
    /health too). --send-timeout cuts each (nginx's send_timeout); the cap then has room again."""
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2", "--max-connections", "3",
               "--send-timeout", "2")
    socks = []
    try:
        body = json.dumps({"prompt": "a", "max_tokens": 2500, "temperature": 0, "logprobs": 5}).encode()
        for _ in range(3):
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            c.connect(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(c)   # and never read
        assert _get_until(s.url + "/health", 503).status_code == 503   # the cap is full of them
        assert _get_until(s.url + "/health", 200, timeout=120).status_code == 200   # they were cut off
        for c in socks:   # what each got before it was cut: the start of its answer, then the end of the connection
            c.settimeout(30)
            got = b""
            while True:
                try:
                    piece = c.recv(65536)
                except (ConnectionResetError, socket.timeout):
                    break
                if not piece:
                    break
                got += piece
            assert got.startswith(b"HTTP/1.1 200") and b'"finish_reason"' not in got[-200:]
    finally:
        for c in socks:
            c.close()
        assert s.stop()[0] == 0


def test_a_slow_reader_that_keeps_reading_is_not_cut_off():
    """--send-timeout is nginx's send_timeout: the time between two reads the client takes, not the whole transfer.
    A client taking an answer of megabytes slowly but steadily gets all of it (the first timer measured the whole
    transfer: it was cut at the timeout)."""
    s = Server("--parallel", "2", "--send-timeout", "6")   # 6 s, not 3: a client starved that long on a loaded
    c = socket.socket()                                      # machine was cut for its pause, not for the transfer
    try:
        body = json.dumps({"input": [f"text number {i}" for i in range(2048)]}).encode()   # ~11 MB of answer
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        c.connect(("127.0.0.1", s.port))
        c.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        c.settimeout(60)
        got, t0 = b"", None
        while True:
            piece = c.recv(8192)
            if not piece:
                break
            got += piece
            t0 = t0 or time.perf_counter()
            time.sleep(0.01)   # at most ~0.8 MB/s: the megabytes take longer than the timeout
        head, _, data = got.partition(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        print(f"\n{len(data)} bytes read in {time.perf_counter() - t0:.1f} s with --send-timeout 6")
        assert head.startswith(b"HTTP/1.1 200") and len(data) == length > 1_000_000
    finally:
        c.close()
        assert s.stop()[0] == 0


def test_request_timeout_cancels_the_sequence(tmp_path_factory):
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2", "--request-timeout", "1.5")
    cut = []   # the tokens each request generated: none ran to its max_tokens (each one's own count: a faster machine
               # makes more of them within the timeout, which a bound on their sum took for one run to its end)

    def counted(request):
        before = settle(s.url)["metrics"]["tokens_generated_total"]
        out = request()
        cut.append(settle(s.url)["metrics"]["tokens_generated_total"] - before)
        return out
    try:
        body = {"prompt": "a", "max_tokens": 3000, "temperature": 0}
        t0 = time.perf_counter()
        e = openai_error(counted(lambda: httpx.post(s.url + "/v1/completions", json=body, timeout=60)), 504)
        assert e["code"] == "request_timeout"
        # Anthropic's type for a 504 is timeout_error (it was api_error)
        r = counted(lambda: httpx.post(s.url + "/v1/messages", timeout=60, json={
            "model": "m", "max_tokens": 3000, "temperature": 0, "messages": [{"role": "user", "content": "a"}]}))
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error", r.text
        print(f"\nnon-streaming request timed out after {time.perf_counter() - t0:.2f} s")

        def stream_lines(path, payload):
            with httpx.stream("POST", s.url + path, json=payload, timeout=60) as r:
                assert r.status_code == 200
                return [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        lines = counted(lambda: stream_lines("/v1/completions", dict(body, stream=True)))
        assert len(lines) > 1 and json.loads(lines[-1][6:])["error"]["code"] == "request_timeout"
        # a Responses stream ends with that API's own error event, numbered after the last one sent
        events = [json.loads(ln[6:]) for ln in counted(lambda: stream_lines("/v1/responses", {
            "input": "a", "max_output_tokens": 3000, "temperature": 0, "stream": True}))]
        last = events[-1]
        assert last["type"] == "error" and last["code"] == "request_timeout", last
        assert last["sequence_number"] == events[-2]["sequence_number"] + 1, events[-2:]
        st = settle(s.url)
        assert st["slots"] == [] and st["metrics"]["kv_pages_reserved"] == 0
        assert len(cut) == 4 and all(0 < n < 3000 for n in cut), cut   # each cut by the timeout, none ran to its end
    finally:
        assert s.stop()[0] == 0


def test_request_timeout_ends_the_sequence_of_a_client_that_stopped_reading(tmp_path_factory):
    """A streaming client that reads nothing (its socket full, the server's send waiting): its sequence ends at
    --request-timeout too. It ran on to max_tokens in most tries: the stream's generator, paused in that send,
    was never closed, and its `finally` (which cancels the sequence) waited for the garbage collector. The slow
    model on one thread takes seconds for the 4,000 tokens, so only a cut ends it at the 1 s limit (the tiny
    model made all 4,000 inside a 2 s limit on a fast machine)."""
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "1", "--request-timeout", "1",
               threads=1)
    try:
        for _ in range(3):
            before = settle(s.url)["metrics"]["tokens_generated_total"]
            payload = json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 4000,
                                  "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            c.connect(("127.0.0.1", s.port))
            try:
                c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
                deadline = time.monotonic() + 30
                while httpx.get(s.url + "/slots").json()["metrics"]["tokens_generated_total"] == before \
                        and time.monotonic() < deadline:
                    time.sleep(0.02)
                st = settle(s.url, timeout=60)
            finally:
                c.close()
            assert st["slots"] == [] and st["metrics"]["kv_pages_reserved"] == 0
            assert 0 < st["metrics"]["tokens_generated_total"] - before < 4000, st["metrics"]
    finally:
        assert s.stop()[0] == 0


# ---- keys -------------------------------------------------------------------------------------------------
def test_api_key_file_covers_everything_but_health(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one per user\nkey-alice-0123456789\n\nkey-bob-9876543210\n")
    s = Server("--api-key-file", str(keys), "--parallel", "2")
    try:
        for path in ("/v1/models", "/slots", "/metrics", "/openapi.json"):
            wrong = "key-alice-01234567XX"
            r = httpx.get(s.url + path, headers={"Authorization": f"Bearer {wrong}"})
            e = openai_error(r, 401)
            assert e["type"] == "authentication_error" and wrong not in r.text
            assert openai_error(httpx.get(s.url + path), 401)["code"] == "invalid_api_key"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q}, headers={"Authorization": "Bearer nope"})
        assert openai_error(r, 401) and "nope" not in r.text
        for k in ("key-alice-0123456789", "key-bob-9876543210"):
            h = {"Authorization": f"Bearer {k}"}
            assert httpx.get(s.url + "/metrics", headers=h).status_code == 200
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 4}, headers=h, timeout=60)
            assert r.status_code == 200, r.text
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/").status_code == 200   # the page asks for the key itself
    finally:
        assert s.stop()[0] == 0
    s = Server("--api-key", "k1", "--metrics-public")
    try:
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert httpx.get(s.url + "/slots").status_code == 401
    finally:
        assert s.stop()[0] == 0


def test_api_key_file_errors(tmp_path):
    import subprocess
    import sys

    from serve_proc import ROOT
    import os
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    for path, want in ((empty, "no keys in it"), (tmp_path / "missing", "No such file")):
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--api-key-file", str(path)], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=pythonpath()), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_flags_checked():
    import os
    import subprocess
    import sys

    from serve_proc import ROOT
    for flags, want in ((("--max-body-mb", "0"), "--max-body-mb 0.0: must be a finite number > 0"),
                        # inf is a number: the message says what is wanted instead ("a number > 0" did not)
                        (("--send-timeout", "inf"), "--send-timeout inf: must be a finite number of seconds > 0"),
                        (("--request-timeout", "inf"), "--request-timeout inf: must be a finite number of seconds")):
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", *flags], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=pythonpath()), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_under_load_drains_and_exits_0(tmp_path_factory, signals):
    """SIGTERM with 8 long streams and 4 long non-streaming requests in flight: by --drain-timeout every client
    has a whole answer (cut short) and none hangs; the process exits 0. A second SIGTERM (an operator's second
    Ctrl-C, a supervisor's repeat) brings the deadline to now, here under a drain timeout longer than the
    answers: each is still a whole answer, cut short (it used to force uvicorn's exit: 500s, tracebacks)."""
    import signal
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "16", "--drain-timeout",
               "2" if signals == 1 else "600")
    ends: list = []
    made: list = []   # completion tokens of each non-streaming answer
    body = {"prompt": "a", "max_tokens": 3000, "temperature": 0}

    def stream():
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
                last = [ln for ln in r.iter_lines() if ln.startswith("data: ")][-1:]
            ends.append(("stream", r.status_code if last == ["data: [DONE]"] else "no [DONE]", time.monotonic()))
        except httpx.HTTPError as e:   # a stream cut at the drain deadline is a closed connection, not a hang
            ends.append(("stream", type(e).__name__, time.monotonic()))

    def plain():
        try:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            ends.append(("plain", r.status_code, time.monotonic()))
            if r.status_code == 200:
                made.append(r.json()["usage"]["completion_tokens"])
        except httpx.HTTPError as e:
            ends.append(("plain", type(e).__name__, time.monotonic()))
    ts = [threading.Thread(target=stream) for _ in range(8)] + [threading.Thread(target=plain) for _ in range(4)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(httpx.get(s.url + "/slots").json()["slots"]) < 12:
        time.sleep(0.05)
    t_sig = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    if signals == 2:
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
    for t in ts:
        t.join(30)
    rc, err = s.stop(sig=None, timeout=30)
    print(f"\nafter SIGTERM: {sorted((k, str(st)) for k, st, _ in ends)}; last client done "
          f"{max(t for *_, t in ends) - t_sig:.2f} s, exit {rc}")
    assert len(ends) == 12 and not any(t.is_alive() for t in ts)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    # the drain deadline cancels the sequences in the engine, so each handler ends its own answer: a partial
    # answer, a stream with its last event and [DONE] (uvicorn cancelling them instead gave 500s and tracebacks)
    assert [st for _, st, _ in ends] == [200] * 12, ends
    assert len(made) == 4 and max(made) < 3000, made   # cut short by the drain, not run to the end


@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_signal_after_stopped_still_exits_0(tmp_path, second):
    """A second SIGTERM / Ctrl-C just after "bitnet serve: stopped" (a supervisor's repeat, a user's second Ctrl-C)
    came while the interpreter was ending (0.3-0.8 s here) with Python's default handlers back: the process was
    killed by the signal (143 / 130) after saying it had stopped. It now exits 0 at once."""
    import os
    import signal
    import subprocess
    import sys

    from helpers import slowness
    from serve_proc import ROOT, free_port, wait_healthy
    port = free_port()
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "-t", "1", "-c", "256", "--port",
                                 str(port)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()), stderr=err)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", 60 * slowness(), proc)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and "bitnet serve: stopped" not in log.read_text():
            time.sleep(0.005)
        proc.send_signal(getattr(signal, second))
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "bitnet serve: stopped" in log.read_text()
    assert rc == 0, (rc, log.read_text()[-2000:])


def test_an_answer_cut_by_the_drain_says_so(tmp_path_factory):
    """A stream cut short by a stopping server's drain: its last chunk keeps finish_reason "stop" (as documented)
    and says "cut_by": "shutdown", so a client (the chat page) can tell it from an answer the model finished; it
    looked whole. An answer that ends on its own carries no such field."""
    import signal
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2", "--drain-timeout", "1")
    events: list = []
    try:
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "temperature": 0,
                "stream": True}) as r:
            whole = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert not any("cut_by" in e for e in whole), whole[-1]
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "a"}], "max_tokens": 3000, "temperature": 0,
                "stream": True}) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: {"):
                    events.append(json.loads(ln[6:]))
                    if len(events) == 5:
                        s.proc.send_signal(signal.SIGINT)
    finally:
        rc, err = s.stop(timeout=30)
    assert rc == 0, err[-2000:]
    last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last.get("cut_by") == "shutdown", last


def test_sigterm_with_a_client_that_reads_nothing_ends_without_a_traceback(tmp_path_factory):
    """SIGTERM while a stream's client reads nothing (its socket buffer full): the handler's last send waited on
    the paused connection (--send-timeout is longer than the drain) until uvicorn's graceful-shutdown timeout
    cancelled it ("Exception in ASGI application", a CancelledError traceback). At the drain's deadline such a
    client is now cut: one line names it, the process exits 0, and the client sees its connection close."""
    import signal
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "8", "--drain-timeout", "1")
    # ~1.5 KB an event (20 logprobs): 8 x 500 of them are more than the socket buffers hold (4 MiB at most here)
    body = json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 3000, "temperature": 0,
                       "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20, "n": 8}).encode()
    c = socket.socket()
    try:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        c.connect(("127.0.0.1", s.port))
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)   # and never read
        deadline = time.monotonic() + 60   # until far more was made than the socket buffers hold
        while time.monotonic() < deadline:
            slots = httpx.get(s.url + "/slots").json()["slots"]
            if len(slots) == 8 and min(x["n_generated"] for x in slots) >= 500:
                break
            time.sleep(0.1)
        s.proc.send_signal(signal.SIGTERM)
        rc, err = s.stop(sig=None, timeout=60)
    finally:
        c.close()
    assert rc == 0, err[-2000:]
    assert "Traceback" not in err and "Exception in ASGI" not in err and "graceful shutdown exceeded" not in err, \
        err[-3000:]
    assert err.count("took nothing of its answer") == 1, err[-2000:]


def test_sigterm_refuses_what_never_started_with_503(tmp_path_factory):
    """SIGTERM with one request running and others queued behind it (--parallel 1): the running one gets its
    answer cut short (200), each queued one a 503 to retry, in its API's shape (they got an empty 200 "stop",
    indistinguishable from a model that said nothing, so nobody retried them)."""
    import signal
    # one thread: the running answer's 3,000 tokens take seconds, past the 1 s drain (two threads of a fast machine
    # make about 1,500 a second)
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "1", "--drain-timeout", "1",
               threads=1)
    got: dict = {}
    long = {"prompt": "a", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}

    def post(name, path, body):
        try:
            r = httpx.post(s.url + path, json=body, timeout=60)
            got[name] = r
        except httpx.HTTPError as e:
            got[name] = e

    def stream():
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=dict(long, stream=True), timeout=60) as r:
                got["stream"] = (r.status_code, [ln for ln in r.iter_lines() if ln.startswith("data: ")])
        except httpx.HTTPError as e:
            got["stream"] = e

    def waiting(n):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = httpx.get(s.url + "/slots").json()["metrics"]
            if m["running"] == 1 and m["waiting"] == n:
                return True
            time.sleep(0.05)
        return False
    ts = [threading.Thread(target=post, args=("running", "/v1/completions", long))]
    ts[0].start()
    assert waiting(0)
    ts += [threading.Thread(target=post, args=("openai", "/v1/completions", long)),
           threading.Thread(target=post, args=("ollama", "/api/generate",
                                               {"model": "m", "prompt": "a", "stream": False, "raw": True})),
           threading.Thread(target=stream)]
    for t in ts[1:]:
        t.start()
    assert waiting(3)
    s.proc.send_signal(signal.SIGTERM)
    for t in ts:
        t.join(30)
    rc, err = s.stop(sig=None, timeout=30)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    run = got["running"]
    assert run.status_code == 200 and 0 < run.json()["usage"]["completion_tokens"] < 3000, run
    never = "the server is shutting down: this request never started; retry it"
    r = got["openai"]
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["message"] == never and r.json()["error"]["code"] == "shutting_down"
    r = got["ollama"]
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1 and r.json() == {"error": never}, r.text
    status, events = got["stream"]
    assert status == 200 and never in events[-1] and "shutting_down" in events[-1], events


def test_sigterm_refuses_embeddings_it_ended_as_never_started(tmp_path_factory):
    """Embedding requests a drain ends (their texts queued or in their prefill) get the same 503 as the generating
    routes' queued requests: NEVER_STARTED, unavailable_error, Retry-After, in each API's shape (they said "server
    is shutting down" as a server_error, which clients do not take for a request to retry)."""
    import signal
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "1", "--drain-timeout", "0",
               threads=1)
    texts = [f"sentence number {i} about cats and dogs " * 10 for i in range(400)]   # seconds of prefill each
    got: dict = {}

    def post(path, body):
        try:
            got[path] = httpx.post(s.url + path, json=body, timeout=120)
        except httpx.HTTPError as e:
            got[path] = e
    ts = [threading.Thread(target=post, args=a) for a in (("/v1/embeddings", {"input": texts}),
                                                          ("/embedding", {"content": texts}),
                                                          ("/api/embed", {"model": "m", "input": texts}))]
    for t in ts:
        t.start()

    def in_engine() -> int:
        """Texts the engine has had: each is a slot row, waiting or running, until it is embedded (counting only
        the rows waited for a 1,200 that never came once the first texts were done, on a fast machine: the first
        request had ended by the time the signal went)."""
        st = httpx.get(s.url + "/slots", timeout=60).json()
        return len(st["slots"]) + st["metrics"]["embed_inputs_total"]
    deadline = time.monotonic() + 60   # all three in the engine
    while time.monotonic() < deadline and in_engine() < 1200:
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    for t in ts:
        t.join(60)
    rc, err = s.stop(sig=None, timeout=30)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    never = "the server is shutting down: this request never started; retry it"
    for path in ("/v1/embeddings", "/embedding"):
        r = got[path]
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (path, r)
        assert r.json()["error"] == {"message": never, "type": "unavailable_error", "param": None,
                                     "code": "shutting_down"}, r.text
    r = got["/api/embed"]
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1 and r.json() == {"error": never}, r


# ---- HTTP's own rules ---------------------------------------------------------------------------------------
def _exchange(port: int, raw: bytes) -> bytes:
    """Send raw bytes, read until the server closes the connection (bounded); what came back."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw)
        sock.settimeout(60)
        out = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            out += chunk


def test_http_rules_clients_and_proxies_rely_on():
    """HEAD on every GET route answers as GET without the body (RFC 9110 9.1; FastAPI's routes gave 405); a 405
    says what is allowed (Allow: RFC 9110 15.5.6); a trailing slash is the path without it (it was a redirect to a
    URL built from Host); a compressed or non-UTF-8 body is refused saying so (a vague "error parsing the body");
    an HTTP/1.0 stream is close-delimited, never chunked (HTTP/1.0 has no chunked coding: a 1.0 client showed the
    hex lengths); a request followed by bytes that do not parse is answered before the connection closes (the
    parser's bare 400 came instead)."""
    s = Server("--parallel", "2")
    try:
        for path in ("/v1/models", "/slots", "/props", "/api/tags", "/api/version", "/api/ps"):
            get, head = httpx.get(s.url + path, timeout=60), httpx.head(s.url + path, timeout=60)
            assert get.status_code == head.status_code == 200 and head.content == b"", (path, head.status_code)
            assert head.headers.get("content-length") == get.headers.get("content-length"), path
        r = httpx.put(s.url + "/v1/chat/completions", json={}, timeout=60)
        assert r.status_code == 405 and r.headers.get("allow") == "POST", (r.status_code, r.headers)
        r = httpx.post(s.url + "/v1/chat/completions/", json={"messages": Q, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.status_code
        assert httpx.get(s.url + "/v1/models/", timeout=60).json()["object"] == "list"
        import gzip
        r = httpx.post(s.url + "/v1/chat/completions", content=gzip.compress(json.dumps({"messages": Q}).encode()),
                       headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 415 and "Content-Encoding gzip" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/v1/chat/completions", content='{"messages": [{"role": "user", "content": "café"}]}'
                       .encode("latin-1"), headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert "UTF-8" in r.json()["error"]["message"]
        body = json.dumps({"prompt": "a", "max_tokens": 8, "stream": True}).encode()
        got = _exchange(s.port, b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                        b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        head, _, text = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower(), head
        events = [ln for ln in text.split(b"\n") if ln]
        assert events[0].startswith(b"data: {") and events[-1] == b"data: [DONE]", events[:2]   # no hex lengths
        # a Content-Length one byte short of a body with "é" (characters counted, not bytes): a byte is left over
        text = '{"messages": [{"role": "user", "content": "café"}], "max_tokens": 2}'
        got = _exchange(s.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n" % len(text) + text.encode())
        assert got.startswith(b"HTTP/1.1 400") and b"invalid_json" in got, got[:300]
        got = _exchange(s.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nxyz\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
    finally:
        assert s.stop()[0] == 0


_NO_FDS_LEFT = r"""
import json, resource, time
from starlette.testclient import TestClient
from bitnet_cpu.engine.api import load_engine
from bitnet_cpu.serve.app import create_app

app = create_app(lambda: load_engine(None, ctx=256, threads=1, parallel=2, progress=False))
with TestClient(app, raise_server_exceptions=False) as tc:
    while tc.get("/health").status_code != 200:
        time.sleep(0.05)
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))  # none left
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0.8, "seed": 1}
    answers = [tc.post(path, json=body) for path in ("/v1/chat/completions", "/v1/chat/completions")]
    print(json.dumps([(r.status_code, r.headers.get("content-type", ""), r.text) for r in answers]))
"""


def test_a_server_out_of_file_descriptors_still_answers_in_json():
    """A process at its open-files limit (ulimit -n, many clients): a request imported numpy.random on first use,
    which failed with "Too many open files" and gave a plain-text 500 and a traceback. What requests import is
    imported once the model has loaded, so such a request is answered (here every descriptor is taken)."""
    import os
    import subprocess
    import sys

    from serve_proc import ROOT
    r = subprocess.run([sys.executable, "-c", _NO_FDS_LEFT], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    for status, ctype, text in json.loads(r.stdout.strip().splitlines()[-1]):
        assert ctype.startswith("application/json") and "Too many open files" not in text, (status, text)
        assert status in (200, 503), (status, text)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def _one_answer(c: socket.socket) -> bytes:
    """One HTTP response read whole (headers, then Content-Length bytes), or what came before the connection
    ended (b"" for a reset or an empty reply)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                (data.lower().partition(b"content-length:")[2].split(b"\r\n")[0] or b"0").strip()):
            more = c.recv(4096)
            if not more:
                break
            data += more
    except OSError:
        pass
    return data


def test_max_connections_is_capped_to_the_open_files_limit():
    """The default --max-connections (512) under `ulimit -n 64`: connections past the open-files limit were reset
    without a word and a new request got an empty reply. The server takes its hard limit and, where that is still
    short, caps the connections with one warning naming both numbers: every connection past the cap gets the
    documented 503 + Retry-After, none is reset (too_many_connections; out_of_resources, with its log line, for
    those that came in a burst past the descriptors left, before the cap's own count could refuse them)."""

    from serve_proc import wait_healthy
    from helpers import slowness
    # --keep-alive-timeout: the first connections stay while the rest come
    proc, url, port = _serve_at_nofile(64, "-c", "256", "--keep-alive-timeout", "600")
    answers = []
    try:
        assert wait_healthy(url, 60 * slowness(), proc)
        held = []
        for _ in range(80):
            c = socket.create_connection(("127.0.0.1", port), timeout=30 * slowness())
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            held.append(c)
        for c in held:   # all held open until every answer is in: a closed one would free its slot
            answers.append(_one_answer(c))
        for c in held:
            c.close()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert all(a.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")) for a in answers), [a[:60] for a in answers]
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    assert refused, err
    assert all(_refusal(a) in ("too_many_connections", "out_of_resources") for a in refused), refused[:1]
    assert any(_refusal(a) == "too_many_connections" for a in refused), refused[:1]
    if any(_refusal(a) == "out_of_resources" for a in refused):
        assert "out of file descriptors" in err, err
    assert "--max-connections 512 needs about 544 open files, more than the limit of 64" in err, err


def test_api_key_file_comment_after_a_key_and_a_key_with_a_space(tmp_path):
    """docs/serving-limits.md says "(# comments)": a line `k2  # bob` was the key "k2  # bob" (bob locked out, the
    comment in force as his key). A `#` after whitespace starts a comment now; a key that still holds whitespace is
    refused at start, one line naming its line (never the key: it is a secret)."""
    import os
    import subprocess
    import sys

    from serve_proc import ROOT
    from bitnet_cpu.engine.errors import BitNetError
    from bitnet_cpu.serve.auth import read_key_file
    keys = tmp_path / "keys"
    keys.write_text("# users\nk1\nk2  # bob\nk#3\n\tk4\t#\tcarol\n\n", encoding="utf-8")
    assert read_key_file(str(keys)) == ["k1", "k2", "k#3", "k4"]   # a # inside a key is part of it
    bad = tmp_path / "bad"
    bad.write_text("# users\nk1\nsecret part two # dave\n", encoding="utf-8")
    with pytest.raises(BitNetError, match="line 3") as e:
        read_key_file(str(bad))
    assert "secret" not in str(e.value) and "\n" not in str(e.value)
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--api-key-file", str(bad)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=pythonpath()), capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "line 3" in lines[0] and "secret" not in r.stderr, r.stderr


# each streaming API's request for a long answer: (path, body); the slow model on one thread takes seconds for it
DRAIN_CUT_STREAMS = {
    "ollama generate": ("/api/generate", {"prompt": "a", "raw": True,
                                          "options": {"num_predict": 4000, "temperature": 0}}),
    "ollama chat": ("/api/chat", {"messages": [{"role": "user", "content": "a"}],
                                  "options": {"num_predict": 4000, "temperature": 0}}),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4000,
                                   "ignore_eos": True, "stream": True}),
    "responses": ("/v1/responses", {"input": "a", "max_output_tokens": 4000, "ignore_eos": True, "stream": True}),
    "llama-server": ("/completion", {"prompt": "a", "n_predict": 4000, "ignore_eos": True, "stream": True}),
}


def test_every_apis_stream_cut_by_the_drain_says_so(tmp_path_factory):
    """Streams of every API cut short by a stopping server's drain: ollama's ended with {"done": true,
    "done_reason": "stop"} and nothing else, so a client took the cut answer for a finished one (OpenAI's stream
    said "cut_by": "shutdown", as documented). Each API's last event says it now: ollama's done line, Anthropic's
    message_stop, the Responses API's response.completed, llama-server's stop event."""
    import signal
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", str(len(DRAIN_CUT_STREAMS)),
               "--drain-timeout", "1", threads=1)
    events = {name: [] for name in DRAIN_CUT_STREAMS}
    started = {name: threading.Event() for name in DRAIN_CUT_STREAMS}

    def read(name):
        path, body = DRAIN_CUT_STREAMS[name]
        try:
            with httpx.stream("POST", s.url + path, timeout=120, json={"model": "slow", "temperature": 0, **body}) as r:
                for ln in r.iter_lines():
                    ln = ln.removeprefix("data: ")
                    if ln.startswith("{"):
                        events[name].append(json.loads(ln))
                        if len(events[name]) >= 5:
                            started[name].set()
        finally:
            started[name].set()
    readers = [threading.Thread(target=read, args=(name,)) for name in DRAIN_CUT_STREAMS]
    try:
        with httpx.stream("POST", s.url + "/api/generate", timeout=120, json={
                "model": "slow", "prompt": "a", "raw": True, "options": {"num_predict": 3, "temperature": 0}}) as r:
            whole = [json.loads(ln) for ln in r.iter_lines() if ln.strip()]
        assert whole[-1]["done"] is True and "cut_by" not in whole[-1], whole[-1]   # an end of its own: no cut
        for t in readers:
            t.start()
        for e in started.values():
            assert e.wait(120)
        s.proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(120)
    finally:
        rc, err = s.stop(timeout=60)
    assert rc == 0, err[-2000:]
    for name, got in events.items():
        last = got[-1]
        assert last.get("cut_by") == "shutdown", (name, last)
        assert not any("cut_by" in e for e in got[:-1]), name
    assert events["ollama generate"][-1]["done_reason"] == "stop"
    assert events["ollama chat"][-1]["done"] is True
    assert events["anthropic"][-1]["type"] == "message_stop"
    assert events["responses"][-1]["type"] == "response.completed"
    assert events["llama-server"][-1]["stop"] is True


def test_ray_replicas_keep_descriptors_for_the_ray_driver():
    """Under --ray-replicas this process is also Ray's driver (gRPC channels, core-worker pipes, plasma): the
    connection cap fitted to `ulimit -n 400` leaves it RAY_FILES_RESERVE more than the plain reserve (it was
    sized as if only 32 were taken, and past it accept and Ray's own calls failed with EMFILE)."""
    import re

    from bitnet_cpu.cli.serve import FILES_RESERVE, RAY_FILES_RESERVE
    from helpers import slowness
    proc, _, _ = _serve_at_nofile(400, "--ray-replicas", "1", "-m", "/nonexistent/m.bnstore",
                                  "--max-connections", "1000")
    try:
        _, err = proc.communicate(timeout=120 * slowness())
    finally:
        _close([], proc)
    m = re.search(r"taking at most (\d+) connection", err)
    assert m, err[-500:]
    assert int(m.group(1)) == (400 - FILES_RESERVE - RAY_FILES_RESERVE) // 2, err[-500:]
