"""The server's own OpenAPI description (/openapi.json) drives a property-based API fuzzer (schemathesis, from
PyPI) against a real `bitnet serve` subprocess: requests that fit the schema and requests that do not, over every
operation. No 5xx; every 4xx in its API's error shape (OpenAI's on /v1, Anthropic's on /v1/messages, ollama's
on /api); afterwards the server answers and its pool is whole
(nothing running, waiting or reserved). Bounded: BITNET_FUZZ_EXAMPLES per operation and mode (default 100:
about a minute here on 2 cores)."""
from __future__ import annotations

import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the API fuzz test needs schemathesis (pip install .[test])")
pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from helpers import slowness  # noqa: E402
from serve_proc import Server  # noqa: E402

EXAMPLES = int(os.environ.get("BITNET_FUZZ_EXAMPLES", "100"))


@pytest.fixture(scope="module")
def fuzz_server():
    # a fuzzed request may ask for the whole context: bounded, the bound scaled for a slow (emulated) CPU
    s = Server("--parallel", "4", "--max-queue", "64", "--request-timeout", f"{60 * slowness():.0f}")
    yield s
    rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err[-3000:]


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_every_operation(case):
    r = case.call(timeout=120 * slowness())
    if r.status_code == 501 and case.path == "/infill":   # this model has no FIM tokens: llama-server's refusal
        assert r.json()["error"]["type"] == "not_supported_error", r.text[:500]
        return
    assert r.status_code < 500, (r.status_code, r.text[:500], case.body)
    if r.status_code >= 400:
        e = r.json().get("error")
        if case.path.startswith("/api/"):   # ollama's routes: its own shape
            assert isinstance(e, str) and e, r.text[:500]
        elif case.path.startswith("/v1/messages"):   # Anthropic's: {"type": "error", "error": {type, message}}
            assert r.json()["type"] == "error" and set(e) == {"type", "message"} and e["message"], r.text[:500]
        else:
            assert isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and e["message"], r.text[:500]


def test_alive_and_pool_whole_after_fuzzing(fuzz_server):
    import time
    deadline = time.monotonic() + 30 * slowness()
    while True:
        st = httpx.get(fuzz_server.url + "/slots").json()
        if not st["slots"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    m = st["metrics"]
    assert st["slots"] == [] and m["running"] == 0 and m["waiting"] == 0 and m["kv_pages_reserved"] == 0
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(fuzz_server.url + "/metrics").text)}
    by_status: dict = {}
    for smp in fams["bitnet_http_requests"].samples:
        if smp.name.endswith("_total"):
            by_status[smp.labels["status"]] = by_status.get(smp.labels["status"], 0) + int(smp.value)
    print(f"\nfuzzed requests by status: {dict(sorted(by_status.items()))}")
    assert sum(by_status.values()) > 5 * EXAMPLES   # the fuzzer really ran
