"""Faults the server must survive, with the engine in this process (uvicorn on a thread, the same app and
protocol as `bitnet serve`) so the pool can be recounted (check_consistency) afterwards: a sampling fault in one
sequence ends only that one (an error event / a 500) while another runs on; a client that hangs up while its
request is queued or being prefilled gives its pages back at once."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn", reason="bitnet serve needs the serve extra (pip install .[serve])")
from helpers import slowness  # noqa: E402
from serve_proc import free_port, slow_model, wait_healthy  # noqa: E402

SLOW = slowness()   # every bound below waits SLOW times longer on a slow CPU (qemu-user: ~16); 1.0 on x86 here


class InProcessServer:
    def __init__(self, store, parallel):
        from bitnet_cpu.engine.api import load_engine
        from bitnet_cpu.serve.app import create_app
        from bitnet_cpu.serve.limits import Limits, guarded_protocol

        self.app = create_app(lambda: load_engine(store, ctx=4096, threads=2, parallel=parallel, progress=False))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="on", http=guarded_protocol(Limits())))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not wait_healthy(self.url, 60 * SLOW, poll=0.1):
            raise RuntimeError(f"the in-process server did not become healthy within {60 * SLOW:.0f} s")
        self.engine = self.app.state.bitnet.engine

    def wait_slots(self, pred, timeout=15.0 * SLOW):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            slots = self.engine.slots()
            if pred(slots):
                return slots
            time.sleep(0.02)
        raise AssertionError(f"slots never got there: {self.engine.slots()}")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30 * SLOW)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return slow_model(tmp_path_factory)


class BrokenSampler:
    """Stands in for a sequence's sampler whose step fails (a kernel or constraint error surfacing there)."""

    def sample(self, logits, tokens):
        raise FloatingPointError("injected sampler fault")


def _break(engine, sid):
    engine.run_in_scheduler(lambda: setattr(engine._by_id[sid], "sampler", BrokenSampler()))


def test_sampling_fault_ends_only_that_sequence(store):
    s = InProcessServer(store, parallel=4)
    try:
        healthy = {}

        def other():
            healthy["r"] = httpx.post(s.url + "/v1/completions", timeout=120 * SLOW,
                                      json={"prompt": "a", "max_tokens": 600, "temperature": 0})
        t = threading.Thread(target=other)
        t.start()
        s.wait_slots(lambda sl: any(x["n_generated"] > 0 for x in sl))
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60 * SLOW,
                          json={"prompt": "b b b b", "max_tokens": 3000, "temperature": 0, "stream": True}) as r:
            it = r.iter_lines()
            for line in it:
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        victim = [x for x in s.engine.slots() if x["n_prompt"] > 2]
                        _break(s.engine, victim[0]["id"])
            assert r.status_code == 200
        err = json.loads(lines[-1][6:])["error"]
        assert err["code"] == "engine_error" and err["type"] == "server_error"
        # non-streaming: the fault is a 500 in OpenAI's shape
        box = {}
        t2 = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
            s.url + "/v1/completions", timeout=60 * SLOW, json={"prompt": "c c c c c c", "max_tokens": 3000,
                                                         "temperature": 0})))
        t2.start()
        victim = s.wait_slots(lambda sl: any(x["n_prompt"] > 5 and x["n_generated"] > 0 for x in sl))
        _break(s.engine, [x for x in victim if x["n_prompt"] > 5][0]["id"])
        t2.join(60 * SLOW)
        assert box["r"].status_code == 500 and box["r"].json()["error"]["code"] == "engine_error"
        t.join(120 * SLOW)
        assert healthy["r"].status_code == 200
        ch = healthy["r"].json()["choices"][0]
        assert ch["finish_reason"] == "length" and healthy["r"].json()["usage"]["completion_tokens"] == 600
        s.wait_slots(lambda sl: sl == [])
        s.engine.check_consistency()
        assert s.engine.metrics()["kv_pages_reserved"] == 0
    finally:
        s.stop()


def test_hangup_while_queued_or_prefilling_frees_pages(store):
    s = InProcessServer(store, parallel=1)
    try:
        long_body = {"prompt": "a", "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=long_body, timeout=60 * SLOW) as running:
            lines = running.iter_lines()   # kept: a dropped iterator closes the response
            next(lines)
            s.wait_slots(lambda sl: len(sl) == 1 and sl[0]["state"] == "running")
            # queued behind it, then gone
            with httpx.stream("POST", s.url + "/v1/completions", json=dict(long_body, prompt="b"), timeout=60 * SLOW) as q:
                assert q.status_code == 200   # headers sent; it waits in the queue
                s.wait_slots(lambda sl: any(x["state"] == "waiting" for x in sl))
            s.wait_slots(lambda sl: len(sl) == 1)
            s.engine.check_consistency()
        s.wait_slots(lambda sl: sl == [])
        before = s.engine.metrics()
        # a long prompt, hung up on while its prefill runs
        prompt = [5] * 3500
        t0 = time.perf_counter()
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60 * SLOW,
                          json={"prompt": prompt, "max_tokens": 10, "stream": True}) as r:
            assert r.status_code == 200
            s.wait_slots(lambda sl: len(sl) == 1 and sl[0]["state"] == "running")
            mid = s.engine.slots()
        s.wait_slots(lambda sl: sl == [])
        print(f"\nprefill hang-up: slot gone {time.perf_counter() - t0:.2f} s after the request, slot then {mid}")
        after = s.engine.metrics()
        assert after["tokens_generated_total"] == before["tokens_generated_total"]   # it never got to decode
        assert after["kv_pages_reserved"] == 0
        s.engine.check_consistency()
    finally:
        s.stop()


# ---- a fault inside the forward pass ----------------------------------------------------------------------
FAULT_TOKEN = 3   # BITNET_FAULT_TOKEN: a prompt holding it makes the attention kernel's boundary check fail


def _healthy(url):
    """Three greedy requests (two non-streaming, one streaming) run at once; their texts."""
    out = {}

    def plain(i, prompt):
        r = httpx.post(url + "/v1/completions", timeout=120 * SLOW, json={"prompt": prompt, "max_tokens": 600, "temperature": 0})
        assert r.status_code == 200, r.text
        out[i] = r.json()["choices"][0]["text"]

    def streamed():
        text = []
        with httpx.stream("POST", url + "/v1/completions", timeout=120 * SLOW,
                          json={"prompt": "c d", "max_tokens": 600, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        out[2] = "".join(text)
    ts = [threading.Thread(target=plain, args=(0, "a")), threading.Thread(target=plain, args=(1, "b b")),
          threading.Thread(target=streamed)]
    for t in ts:
        t.start()
    return ts, out


def test_forward_fault_ends_only_its_request(store, monkeypatch):
    """Requests whose prompt holds the fault token, sent while three others decode, fail alone, each in its own
    API's shape (OpenAI: a 500 or a stream's error event; ollama: a 500 or an {"error"} line); the others'
    answers are those of a run without them, and every page comes back."""
    monkeypatch.setenv("BITNET_FAULT_TOKEN", str(FAULT_TOKEN))
    s = InProcessServer(store, parallel=8)
    try:
        ts, alone = _healthy(s.url)
        for t in ts:
            t.join(120 * SLOW)
        assert s.engine.metrics()["sequence_errors_total"] == 0   # the healthy requests never meet the token
        s.engine.clear_prefix_cache()
        ts, together = _healthy(s.url)
        s.wait_slots(lambda sl: len(sl) == 3 and all(x["n_generated"] > 0 for x in sl))
        bad = [7, FAULT_TOKEN, 9]
        r = httpx.post(s.url + "/v1/completions", timeout=60 * SLOW, json={"prompt": bad, "max_tokens": 20})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60 * SLOW,
                          json={"prompt": bad, "max_tokens": 20, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and json.loads(lines[-1][6:])["error"]["code"] == "engine_error", lines
        r = httpx.post(s.url + "/api/generate", timeout=60 * SLOW,
                       json={"model": "m", "context": bad, "prompt": "x", "raw": True, "stream": False})
        assert r.status_code == 500 and set(r.json()) == {"error"}, r.text
        with httpx.stream("POST", s.url + "/api/generate", timeout=60 * SLOW,
                          json={"model": "m", "context": bad, "prompt": "x", "raw": True}) as r:
            objs = [json.loads(line) for line in r.iter_lines() if line]
        assert r.status_code == 200 and set(objs[-1]) == {"error"}, objs
        for t in ts:
            t.join(120 * SLOW)
        assert together == alone
        met = s.engine.metrics()
        assert met["sequence_errors_total"] == 4
        assert met["steps_split_total"] >= 4   # every fault came from a step shared with the healthy requests
        assert "bitnet_sequence_errors_total 4.0" in httpx.get(s.url + "/metrics").text
        s.wait_slots(lambda sl: sl == [])
        s.engine.check_consistency()
        s.engine.clear_prefix_cache()
        assert s.engine.metrics()["kv_pages_used"] == 0 and s.engine.metrics()["kv_pages_reserved"] == 0
    finally:
        s.stop()


def test_an_engine_fault_names_the_request_in_the_log(store, monkeypatch, capfd):
    """A 500 engine_error says "see its log": its message names the request (the answer's id, cmpl-...; req-...
    where the API's answers have none), and the server's log has one line naming that id and the path (the
    engine's own line names only its sequence number, which no client sees)."""
    monkeypatch.setenv("BITNET_FAULT_TOKEN", str(FAULT_TOKEN))
    s = InProcessServer(store, parallel=2)
    bad = [7, FAULT_TOKEN, 9]
    try:
        capfd.readouterr()
        said = []   # (path, the error's message)
        r = httpx.post(s.url + "/v1/completions", timeout=60 * SLOW, json={"prompt": bad, "max_tokens": 5})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        said.append(("/v1/completions", r.json()["error"]["message"]))
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60 * SLOW,
                          json={"prompt": bad, "max_tokens": 5, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        said.append(("/v1/completions", json.loads(lines[-1][6:])["error"]["message"]))
        r = httpx.post(s.url + "/api/generate", timeout=60 * SLOW,
                       json={"model": "m", "context": bad, "prompt": "x", "raw": True, "stream": False})
        assert r.status_code == 500, r.text
        said.append(("/api/generate", r.json()["error"]))
        r = httpx.post(s.url + "/completion", timeout=60 * SLOW, json={"prompt": bad, "n_predict": 5})
        assert r.status_code == 500, r.text
        said.append(("/completion", r.json()["error"]["message"]))
    finally:
        s.stop()
    ids = _logged_ids(said, capfd.readouterr().err, r"(?:cmpl|req)-\w+")
    assert ids[0].startswith("cmpl-") and ids[2].startswith("req-") and len(set(ids)) == 4, ids


def test_an_engine_fault_on_the_embedding_routes_names_the_request_in_the_log(store, monkeypatch, capfd):
    """The embedding routes as the generating ones: a fault is a 500 engine_error whose message names a request id
    (req-...: their answers have none) and a log line names that id and the path (they said only "see its log",
    and the log had no line a client's error could be matched to)."""
    monkeypatch.setenv("BITNET_FAULT_TOKEN", str(FAULT_TOKEN))
    s = InProcessServer(store, parallel=2)
    try:
        text = s.engine.detokenize([FAULT_TOKEN])
        assert FAULT_TOKEN in s.engine.tokenize(text, add_bos=True), repr(text)   # a text holding the token
        capfd.readouterr()
        said = []   # (path, the error's message)
        for path, body, message in (("/v1/embeddings", {"input": [7, FAULT_TOKEN, 9]}, lambda j: j["error"]["message"]),
                                    ("/embedding", {"content": [7, FAULT_TOKEN, 9]}, lambda j: j["error"]["message"]),
                                    ("/api/embed", {"model": "m", "input": text}, lambda j: j["error"])):
            r = httpx.post(s.url + path, timeout=60 * SLOW, json=body)
            assert r.status_code == 500, (path, r.text)
            if path != "/api/embed":
                assert r.json()["error"]["code"] == "engine_error", r.text
            said.append((path, message(r.json())))
    finally:
        s.stop()
    ids = _logged_ids(said, capfd.readouterr().err, r"req-\w+")
    assert len(set(ids)) == 3, ids


def _logged_ids(said, err: str, id_pattern: str) -> list[str]:
    """The request id each (path, error message) names, each checked to be on a line of the server's log `err`
    with its path."""
    import re
    ids = []
    for path, message in said:
        m = re.search(rf"see its log, request ({id_pattern})\)", message)
        assert m, message
        ids.append(m.group(1))
        assert any(m.group(1) in line and path in line for line in err.splitlines()), (m.group(1), path, err)
    return ids
