"""llama-server's own endpoints on `bitnet serve` (serve/llama_api.py): /tokenize, /detokenize, /apply-template,
/props, against a real subprocess on 127.0.0.1 with the bundled model. Each answer is checked against what the
server does with the same text elsewhere (the prompt tokens the completion and chat endpoints count, the template
/api/show reports, the flags it was started with), not against stored values."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

SERVER_ARGS = ("--parallel", "3", "--temp", "0.5", "--top-k", "7")   # conftest's server fixture
TEXT = "Once upon a time, a fox met 3 owls: \u00e9t\u00e9 \u2014 \u6f22\u5b57 \U0001f98a."


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_round_trip_and_pieces(server):
    ids = post(server, "/tokenize", {"content": TEXT}).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert post(server, "/detokenize", {"tokens": ids}).json()["content"] == TEXT
    with_bos = post(server, "/tokenize", {"content": TEXT, "add_special": True}).json()["tokens"]
    assert with_bos[1:] == ids and with_bos[0] not in ids[:1]
    pieces = post(server, "/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(p["piece"].encode("utf-8") if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode("utf-8").replace("\u2581", " ").lstrip() == TEXT.lstrip()
    # a piece that is not whole UTF-8 (a byte of a character split over tokens) comes as its bytes
    assert all(isinstance(p["piece"], str) or all(0 <= b < 256 for b in p["piece"]) for p in pieces)


def test_token_counts_agree_with_the_generating_endpoints(server):
    ids = post(server, "/tokenize", {"content": TEXT, "add_special": True}).json()["tokens"]
    r = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)   # /v1/completions tokenizes with BOS
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    prompt = post(server, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert TEXT in prompt and "Be brief." in prompt
    n = len(post(server, "/tokenize", {"content": prompt}).json()["tokens"])
    chat = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == n
    no_gen = post(server, "/apply-template", {"messages": msgs, "add_generation_prompt": False}).json()["prompt"]
    assert prompt.startswith(no_gen) and len(no_gen) < len(prompt)


def test_props_say_what_the_server_runs(server):
    p = httpx.get(server.url + "/props", timeout=30).json()
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert p["default_generation_settings"]["n_ctx"] == models["meta"]["n_ctx"]
    assert p["total_slots"] == 3 and p["model_alias"] == models["id"]
    params = p["default_generation_settings"]["params"]
    assert params["temperature"] == 0.5 and params["top_k"] == 7
    show = post(server, "/api/show", {"model": models["id"]}).json()
    assert p["chat_template"] == show["template"] and p["modalities"] == {"vision": False, "audio": False}


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens[0]"),
    ("/tokenize", {"content": "word " * 400000}, "content"),
    ("/tokenize", {"text": "the field is content"}, "content"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
])
def test_bad_requests_are_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
