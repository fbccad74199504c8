"""The OpenAI endpoints' request fields, checked alike on /v1/chat/completions, /v1/completions and their siblings
against a real `bitnet serve` subprocess (bundled model, raw HTTP): a field one endpoint honours or checks is
honoured or checked the same way on the other, a field that belongs to a sibling endpoint is a 400 saying where it
belongs (an unknown top-level field stays ignored: llama-server's and vLLM's clients send their own), an unknown
key inside OpenAI's own nested objects is a 400 naming its path, and the limits are counted as the values were sent."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

SERVER_ARGS = ("--parallel", "2")
Q = [{"role": "user", "content": "What is 12+7?"}]
CHAT = {"messages": Q, "max_tokens": 2}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 2}
# every token counted: no early end of sequence, so a limit is what ends the answer
LONG = {"temperature": 0, "ignore_eos": True}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _err(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and e["message"] and "Traceback" not in e["message"], e
    return e


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(server, path: str, body: dict) -> int:
    return _ok(_post(server, path, body))["usage"]["completion_tokens"]


# -- max_completion_tokens: honoured on both endpoints, winning over max_tokens on both ----------------------------
def test_completions_honour_max_completion_tokens_as_chat_does(server):
    """/v1/completions dropped max_completion_tokens (OpenAI's default of 16 ran instead), and where both names
    came, max_tokens won there while max_completion_tokens won on chat."""
    prompt = {"prompt": "Once upon a time", **LONG}
    chat = {"messages": Q, **LONG}
    assert _tokens(server, "/v1/completions", {**prompt, "max_completion_tokens": 3}) == 3
    for path, body in (("/v1/completions", prompt), ("/v1/chat/completions", chat)):
        assert _tokens(server, path, {**body, "max_tokens": 3, "max_completion_tokens": 5}) == 5, path
        assert _tokens(server, path, {**body, "max_tokens": 5, "max_completion_tokens": 3}) == 3, path
        assert _tokens(server, path, {**body, "max_tokens": 3, "max_completion_tokens": None}) == 3, path
    assert _err(_post(server, "/v1/completions", {**prompt, "max_completion_tokens": -2}))["param"] == \
        "max_completion_tokens"


# -- metadata and service_tier: checked on completions as on chat ----------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"service_tier": "bogus"}, "service_tier"),
    ({"metadata": {"a": 1}}, "metadata.a"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_metadata_and_service_tier_are_checked_on_both(server, path, body, extra, param):
    assert _err(_post(server, path, {**body, **extra}))["param"] == param


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_good_metadata_and_service_tier_are_taken_on_both(server, path, body):
    _ok(_post(server, path, {**body, "metadata": {"a": "b"}, "service_tier": "auto"}))


