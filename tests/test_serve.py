"""`bitnet serve` driven by the official `openai` client (and httpx for raw HTTP) against a real subprocess
on 127.0.0.1 with the bundled model: shapes, streaming == non-streaming, batching == alone, every error
status, hang-up frees the slot, Prometheus text parses, SIGINT drains and exits 0."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install .[test])")
pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from serve_proc import Server, pythonpath  # noqa: E402

Q = [{"role": "user", "content": "What is 12+7?"}]
# sampling that avoids an early eos: random tokens at high temperature, nothing cut off
WILD = dict(temperature=2.0, top_p=1.0, extra_body={"top_k": 0, "min_p": 0.0}, seed=7)


def _concurrently(one, n: int, timeout: float = 60.0) -> None:
    """one(0) .. one(n - 1) at the same time, each on its own thread; each join bounded by timeout."""
    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)


def test_models_list(client):
    ms = client.models.list().data
    assert len(ms) == 1 and ms[0].object == "model" and ms[0].id


def test_top_p_0_keeps_only_the_most_likely_token(client, model_id):
    """top_p 0 (OpenAI's range is [0, 1]; llama.cpp keeps the first token, whose mass already reaches 0): the
    greedy answer at any temperature and seed, where it was a 400."""
    greedy = client.chat.completions.create(model=model_id, messages=Q, max_tokens=12, temperature=0)
    for seed in (1, 2):
        r = client.chat.completions.create(model=model_id, messages=Q, max_tokens=12, temperature=1.8, top_p=0,
                                           seed=seed, extra_body={"top_k": 0})
        assert r.choices[0].message.content == greedy.choices[0].message.content


def test_llama_server_s_negative_extras(client, model_id):
    """top_k -1 is off and repeat_last_n -1 the whole context on the OpenAI endpoints too, as llama-server reads
    them there (they were 400s)."""
    def text(**extra):
        return client.chat.completions.create(model=model_id, messages=Q, max_tokens=16, temperature=1.5, seed=5,
                                              extra_body=extra).choices[0].message.content
    assert text(top_k=-1) == text(top_k=0)
    assert text(repeat_penalty=1.5, repeat_last_n=-1) == text(repeat_penalty=1.5, repeat_last_n=100000)
    from bitnet_cpu.serve.schemas import ChatCompletionRequest   # what they mean, past any prompt's length
    p = ChatCompletionRequest.model_validate({"messages": Q, "top_k": -1, "repeat_last_n": -1}).sampling_params()
    assert p.top_k == 0 and p.repeat_last_n >= 1 << 20


def test_chat_non_stream_and_stream_same_text(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=Q, temperature=0, max_tokens=24)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model_id, messages=Q, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [c.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_and_max_tokens(client, model_id):
    r = client.completions.create(model=model_id, prompt="1+1=", max_tokens=5, **WILD)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    r2 = client.chat.completions.create(model=model_id, messages=Q, max_completion_tokens=3, **WILD)
    assert r2.choices[0].finish_reason == "length" and r2.usage.completion_tokens == 3


def test_ignore_eos(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=Q, temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40  # the model ends by itself
    r = client.chat.completions.create(model=model_id, messages=Q, temperature=0, max_tokens=40,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40


def test_stop_and_seed(client, model_id):
    a = client.chat.completions.create(model=model_id, messages=Q, max_tokens=20, **WILD)
    b = client.chat.completions.create(model=model_id, messages=Q, max_tokens=20, **WILD)
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same text
    text = a.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        s = client.chat.completions.create(model=model_id, messages=Q, max_tokens=20, stop=[stop], **WILD)
        assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].message.content


def test_sixteen_concurrent_greedy_equal_alone(client, model_id):
    prompts = [[{"role": "user", "content": f"What is {i}+{i + 3}?"}] for i in range(16)]
    alone = [client.chat.completions.create(model=model_id, messages=p, temperature=0, max_tokens=16)
             .choices[0].message.content for p in prompts]
    together = [None] * 16

    def one(i):
        together[i] = client.chat.completions.create(model=model_id, messages=prompts[i], temperature=0,
                                                     max_tokens=16).choices[0].message.content
    ts = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert together == alone


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


@pytest.mark.parametrize("body,param", [
    ({"messages": Q, "temperature": 5}, "temperature"),
    ({"messages": Q, "top_p": -0.1}, "top_p"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": Q, "n": 0}, "n"),
    ({"messages": Q, "n": 17}, "n"),                 # more than --parallel 16
    ({"messages": Q, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": Q, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": Q, "logit_bias": {"12": 101}}, "logit_bias"),
    ({"messages": Q, "logit_bias": {"cat": 1}}, "logit_bias"),
    ({"messages": Q, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": Q, "logit_bias": {"12": "1"}}, "logit_bias"),      # a number as a string, as OpenAI refuses
    ({"messages": Q, "logit_bias": {"12": True}}, "logit_bias"),
    ({"messages": Q, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": Q, "top_logprobs": 2}, "top_logprobs"),   # without logprobs: true
    ({"messages": Q, "audio": {"voice": "alloy"}}, "audio"),
    ({"messages": Q, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": Q, "stream_options": {"include_usage": True}}, "stream_options"),   # OpenAI's: only with stream
    ({"messages": Q, "verbosity": "low"}, "verbosity"),
    ({"messages": Q, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"messages": Q, "function_call": "auto"}, "function_call"),
    ({"messages": Q, "truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),   # vLLM's cut: never done here
    # taken and unused, but checked as OpenAI checks them (as on /v1/responses)
    ({"messages": Q, "service_tier": "bogus"}, "service_tier"),
    ({"messages": Q, "metadata": {"a": {"b": 1}}}, "metadata.a"),
    ({"messages": Q, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.1"),
    ({"messages": Q, "stop": [f"s{i}" for i in range(65)]}, "stop"),   # over 64 (OpenAI's 4 is too few for FIM)
    ({"messages": Q, "max_tokens": -2}, "max_tokens"),   # (-1 is llama-server's "to the end")
    ({"messages": Q, "max_tokens": 1e30}, "max_tokens"),   # "an integer within range", not pydantic's string words
    # JSON's own types, as OpenAI's API checks them (pydantic alone would read "0.5" as 0.5 and "yes" as true)
    ({"messages": Q, "temperature": "0.5"}, "temperature"),
    ({"messages": Q, "n": "2"}, "n"),
    ({"messages": Q, "max_tokens": True}, "max_tokens"),
    ({"messages": Q, "stream": "yes"}, "stream"),
    ({"messages": Q, "stream": 1}, "stream"),
    ({"messages": Q, "logprobs": "yes"}, "logprobs"),
    ({"messages": Q, "stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ({"messages": Q, "seed": "7"}, "seed"),
    ({"messages": [{"role": "user"}]}, "messages.0"),                                  # OpenAI: content required
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0"),
])
def test_bad_values_400(server, body, param):
    e = _err(httpx.post(server.url + "/v1/chat/completions", json=body), 400)
    assert e["param"] == param and e["type"] == "invalid_request_error"


@pytest.mark.parametrize("value", [0, 3])
def test_completions_top_logprobs_points_to_logprobs(server, value):
    """/v1/completions asks for alternatives with `logprobs` (0..5): the chat endpoint's `top_logprobs` there was
    dropped in silence (200, "logprobs": null); it is a 400 saying what to send, as `n_probs` is. null is taken."""
    body = {"prompt": "x", "max_tokens": 1}
    e = _err(httpx.post(server.url + "/v1/completions", json={**body, "top_logprobs": value}, timeout=30), 400)
    assert e["param"] == "top_logprobs" and "ask for logprobs (0..5)" in e["message"], e
    assert httpx.post(server.url + "/v1/completions", json={**body, "top_logprobs": None}, timeout=30).status_code \
        == 200


def test_top_logprobs_without_logprobs_is_one_rule_on_chat_and_api_chat(server, model_id):
    """`top_logprobs` above 0 without `logprobs: true` is a 400 on /v1/chat/completions and /api/chat alike; the
    harmless 0 is taken on both with `logprobs` left out, null or false (the chat route refused it, /api/chat took
    it, and docs/api.md said the two matched)."""
    for lp in ({}, {"logprobs": None}, {"logprobs": False}):
        chat = {"messages": Q, "max_tokens": 1, **lp}
        r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "top_logprobs": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, (lp, r.text)
        e = _err(httpx.post(server.url + "/v1/chat/completions", json={**chat, "top_logprobs": 2}, timeout=60), 400)
        assert e["param"] == "top_logprobs" and "needs logprobs: true" in e["message"], (lp, e)
        ollama = {"model": model_id, "messages": Q, "stream": False, "options": {"num_predict": 1}, **lp}
        r = httpx.post(server.url + "/api/chat", json={**ollama, "top_logprobs": 0}, timeout=60)
        assert r.status_code == 200 and not r.json().get("logprobs"), (lp, r.text)
        r = httpx.post(server.url + "/api/chat", json={**ollama, "top_logprobs": 2}, timeout=60)
        assert r.status_code == 400 and "needs logprobs: true" in r.json()["error"], (lp, r.text)


@pytest.mark.parametrize("n", [0, 17, 1000])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": Q}),
                                        ("/v1/completions", {"prompt": "x"})])
def test_n_out_of_range_names_the_server_s_limit(server, path, body, n):
    """n's limit is --parallel (16 here) whatever n is: 1000 said "less than or equal to 128", a bound that was
    not the server's, while 17 named the real one."""
    e = _err(httpx.post(server.url + path, json=dict(body, n=n, max_tokens=1), timeout=30), 400)
    assert e["param"] == "n" and f"n {n}: must be in 1..16" in e["message"] and "128" not in e["message"], e


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "echo": "true"}, "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ("/v1/messages", {"model": "m", "messages": Q, "max_tokens": "4"}, "max_tokens"),
    ("/v1/responses", {"input": "x", "temperature": "1"}, "temperature"),
    ("/completion", {"prompt": "x", "n_predict": "4"}, "n_predict"),
    ("/tokenize", {"content": "x", "add_special": 1}, "add_special"),
    ("/v1/embeddings", {"input": "x", "dimensions": "8"}, "dimensions"),
])
def test_other_endpoints_take_json_types_only(server, path, body, param):
    r = httpx.post(server.url + path, json=body, headers={"anthropic-version": "2023-06-01"}, timeout=30)
    assert r.status_code == 400 and param in r.text and "expected" in r.text, r.text
    ollama = httpx.post(server.url + "/api/chat", json={"model": "m", "messages": Q, "stream": "false"}, timeout=30)
    assert ollama.status_code == 400 and ollama.json() == {"error": 'stream: expected true or false, got "false"'}


def test_token_ids_are_json_integers(server):
    """A token id is a JSON integer, as /completion and /detokenize take it: true is not token 1 (it was, on
    /v1/completions' prompt and ollama's context) and 5.0 not token 5; a 400 names the item."""
    cases = [("/v1/completions", {"prompt": [True, 5], "max_tokens": 1}, "prompt[0]"),
             ("/v1/completions", {"prompt": [[5, False]], "max_tokens": 1}, "prompt[0][1]"),
             ("/v1/completions", {"prompt": [5, 6.0], "max_tokens": 1}, "prompt[1]"),
             ("/api/generate", {"model": "m", "prompt": "x", "context": [True, 5], "stream": False}, "context[0]"),
             ("/detokenize", {"tokens": [5, True]}, "tokens[1]")]
    for path, body, item in cases:
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400 and f"{item}: expected a token id" in r.text, (path, body, r.text)
    for path, body in [("/v1/completions", {"prompt": [5, 6], "max_tokens": 1}),
                       ("/v1/completions", {"prompt": [[5, 6]], "max_tokens": 1}),
                       ("/v1/completions", {"prompt": ["x"], "max_tokens": 1}),
                       ("/api/generate", {"model": "m", "prompt": "x", "context": [5], "stream": False,
                                          "options": {"num_predict": 1}})]:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, body, r.text)


def test_an_empty_prompt_list_400(server):
    """prompt [] is no prompt (OpenAI: 400, "too short"); it was run from BOS alone. "" stays a prompt of BOS."""
    e = _err(httpx.post(server.url + "/v1/completions", json={"prompt": [], "max_tokens": 1}, timeout=30), 400)
    assert e["param"] == "prompt" and "an empty list" in e["message"]
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "", "max_tokens": 1}, timeout=30).status_code == 200


def test_stream_options_without_stream_400(server):
    """OpenAI's answer (and vLLM's): stream_options on a request that does not stream is refused, not dropped."""
    for path, body in [("/v1/chat/completions", {"messages": Q}), ("/v1/completions", {"prompt": "x"})]:
        e = _err(httpx.post(server.url + path, json={**body, "stream": False, "stream_options": {}}, timeout=30), 400)
        assert e["param"] == "stream_options" and "stream is true" in e["message"]
        r = httpx.post(server.url + path, json={**body, "max_tokens": 1, "stream_options": None}, timeout=30)
        assert r.status_code == 200, r.text


def test_malformed_json_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert _err(r, 400)["code"] == "invalid_json"


def test_prompt_over_context_400(client, server, model_id):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "7 + 8 = 15. " * 400}])
    assert ei.value.status_code == 400 and ei.value.body["code"] == "context_length_exceeded"
    # llama-server's fields beside OpenAI's (its web UI shows them): the prompt's tokens, and the context
    n_ctx = client.models.list().data[0].model_extra["meta"]["n_ctx"]
    content = "7 + 8 = 15. " * 400
    n = len(httpx.post(server.url + "/tokenize", json={"content": content}).json()["tokens"])
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}),
                       ("/v1/completions", {"prompt": content})):
        e = httpx.post(server.url + path, json=body, timeout=60).json()["error"]
        assert e["n_ctx"] == n_ctx and n <= e["n_prompt_tokens"] <= n + 40, (path, e)
        # OpenAI's sentence first: what clients classify a context overflow by (LiteLLM's ContextWindowExceeded
        # error and its routers' fallbacks did not fire on our own wording); then what was sent (a completion's
        # prompt was called "your messages")
        sent = "messages" if "messages" in body else "prompt"
        assert e["message"].startswith(f"This model's maximum context length is {n_ctx} tokens. However, your "
                                       f"{sent} resulted in {e['n_prompt_tokens']} tokens"), e["message"]
    r = httpx.post(server.url + "/api/chat", timeout=60, json={"model": "m", "stream": False,
                                                               "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["error"].startswith("This model's maximum context length is"), r.text
    assert "your messages resulted in" in r.json()["error"], r.text
    r = httpx.post(server.url + "/api/generate", timeout=60, json={"model": "m", "stream": False, "prompt": content})
    assert r.status_code == 400 and r.json()["error"].startswith("This model's maximum context length is"), r.text
    assert "your prompt resulted in" in r.json()["error"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_context_on_completion_is_llama_server_s_error(server, stream):
    """llama-server's clients recognise a context overflow on its /completion by the error's type
    "exceed_context_size_error" or its words "exceeds the available context size" (then trim and retry): they got
    OpenAI's sentence and type, a generic 400 to them. /completion answers in llama-server's words, with its
    n_prompt_tokens and n_ctx and its status 400; the OpenAI routes keep OpenAI's (test_prompt_over_context_400)."""
    n_ctx = httpx.get(server.url + "/v1/models").json()["data"][0]["meta"]["n_ctx"]
    content = "7 + 8 = 15. " * 400
    n = len(httpx.post(server.url + "/tokenize", json={"content": content, "add_special": True}).json()["tokens"])
    for path in ("/completion", "/completions"):
        r = httpx.post(server.url + path, json={"prompt": content, "stream": stream}, timeout=60)
        e = r.json()["error"]
        assert r.status_code == 400 and e["type"] == "exceed_context_size_error", (path, r.text)
        assert (e["n_ctx"], e["n_prompt_tokens"]) == (n_ctx, n), e
        assert e["message"].startswith(f"request ({n} tokens) exceeds the available context size ({n_ctx} tokens), "
                                       "try increasing it"), e["message"]
    e = httpx.post(server.url + "/v1/completions", json={"prompt": content}, timeout=60).json()["error"]
    assert e["type"] == "invalid_request_error" and "exceed" not in e["message"], e
    # a body too large for the context is refused from its size alone (no count): still llama-server's type and words
    r = httpx.post(server.url + "/completion", json={"prompt": "x" * 2_000_000, "stream": stream}, timeout=60)
    e = r.json()["error"]
    assert r.status_code == 400 and e["type"] == "exceed_context_size_error", r.text[:500]
    assert e["message"].startswith("request exceeds the available context size: "), e


def test_prompt_lists_against_the_context(server):
    """A list of token ids is one prompt: one id over the context gets the same 400 as text would (OpenAI's
    sentence, llama-server's exact counts). A list of strings is a batch, each prompt run alone: more prompts than
    the context has tokens are refused by --max-queue's rule, never as a context overflow."""
    n_ctx = httpx.get(server.url + "/v1/models").json()["data"][0]["meta"]["n_ctx"]
    tok = httpx.post(server.url + "/tokenize", json={"content": " x"}).json()["tokens"][-1]
    for path in ("/v1/completions", "/completion"):
        r = httpx.post(server.url + path, json={"prompt": [tok] * (n_ctx + 1), "max_tokens": 1}, timeout=30)
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["code"] == "context_length_exceeded" and (e["n_prompt_tokens"], e["n_ctx"]) == (n_ctx + 1, n_ctx)
        assert e["message"].startswith(f"This model's maximum context length is {n_ctx} tokens. However, your "
                                       f"prompt resulted in {n_ctx + 1} tokens" if path == "/v1/completions" else
                                       f"request ({n_ctx + 1} tokens) exceeds the available context size"), e
        e = _err(httpx.post(server.url + path, json={"prompt": ["x"] * (n_ctx + 1), "max_tokens": 1}, timeout=30), 400)
        assert e["code"] == "invalid_value" and ("--max-queue" if path == "/v1/completions" else "one prompt per "
                                                 "request") in e["message"], e
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [tok] * (n_ctx - 1), "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    e = _err(httpx.post(server.url + "/v1/chat/completions", timeout=30,
                        json={"messages": [{"role": "user", "content": "x"}] * (n_ctx + 1)}), 400)
    assert e["code"] == "context_length_exceeded" and e["message"].startswith(
        f"This model's maximum context length is {n_ctx} tokens. However, your messages resulted in at least"), e


def test_any_model_name_is_answered_by_the_loaded_one(client, model_id):
    r = client.chat.completions.create(model="gpt-17", messages=Q, max_tokens=2)
    assert r.model == model_id and r.choices[0].message.content is not None


def test_hangup_frees_slot(tmp_path_factory):
    """A small random model with ignore_eos, so a whole answer is 1500 tokens (seconds here, minutes under qemu):
    hanging up after the first event must cancel the sequence (slot gone, far fewer tokens made than 1500). The
    wait for the slot is bounded by about how long the whole answer could take, so a cancel that never comes
    fails on the token count, and a slow CPU only waits longer."""
    from helpers import slowness
    from serve_proc import slow_model
    from prometheus_client.parser import text_string_to_metric_families
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2", threads=1)

    def counted():
        fams = text_string_to_metric_families(httpx.get(s.url + "/metrics").text)
        return next(f for f in fams if f.name == "bitnet_generated_tokens").samples[0].value
    try:
        body = {"prompt": "a", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
        before, gen0 = httpx.get(s.url + "/slots").json()["metrics"]["tokens_generated_total"], counted()
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30 * slowness()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            while got < 3:   # three tokens' events received, then hang up
                got += next(lines).startswith("data: ")
        t_hangup = time.monotonic()
        st = s.slots_when_idle(timeout=60 * slowness())
        made = st["metrics"]["tokens_generated_total"] - before
        print(f"\nhung up: slot free {time.monotonic() - t_hangup:.2f} s later, {made} tokens made")
        assert st["slots"] == [] and st["metrics"]["running"] == 0
        assert made < 750  # cut short, not run to the end
        # the tokens the answer gave out before the hang-up are in bitnet_generated_tokens (they were counted only
        # when an answer ended), and no more than the engine made
        assert 1 <= counted() - gen0 <= made, (counted() - gen0, made)
    finally:
        assert s.stop()[0] == 0


def test_generated_tokens_and_latency_metrics_agree_with_the_answers(server, model_id):
    """bitnet_generated_tokens grows by what each answer's usage counts (an end-of-text token too: it used to
    count chunks, one fewer), and every generation, ollama's too, adds one time-to-first-token observation."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
        gen = fams["bitnet_generated_tokens"].samples[0].value
        ttft = [x.value for x in fams["bitnet_time_to_first_token_seconds"].samples if x.name.endswith("_count")][0]
        return gen, ttft
    q = [{"role": "user", "content": "What is 12+7?"}]
    for path, body, count in (
            ("/v1/chat/completions", {"messages": q, "max_tokens": 60, "temperature": 0},
             lambda r: (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"] == "stop")),
            ("/api/chat", {"model": model_id, "messages": q, "stream": False, "options": {"temperature": 0,
                                                                                         "num_predict": 60}},
             lambda r: (r["eval_count"], r["done_reason"] == "stop"))):
        gen0, ttft0 = scrape()
        r = httpx.post(server.url + path, json=body, timeout=120).json()
        n, ended = count(r)
        gen1, ttft1 = scrape()
        assert ended, r   # the bundled model answers this within 60 tokens, ending with its end-of-text token
        assert gen1 - gen0 == n and ttft1 - ttft0 == 1, (path, gen1 - gen0, n, ttft1 - ttft0)
    # llama-server's names for the engine's numbers (dashboards keyed to them), idle now
    fams = {f.name: f.samples[0].value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    m = httpx.get(server.url + "/slots").json()["metrics"]
    assert fams["llamacpp:tokens_predicted"] == m["tokens_generated_total"] > 0
    assert fams["llamacpp:prompt_tokens"] == m["prefill_tokens_total"] > 0
    assert fams["llamacpp:n_decode"] == m["steps_total"] > 0
    assert fams["llamacpp:requests_processing"] == fams["llamacpp:requests_deferred"] == 0


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed", "/api/embeddings", "/api/chat", "/api/generate",
                                  "/v1/chat/completions", "/v1/completions", "/completion", "/tokenize"])
def test_json_nested_too_deeply_is_a_400(server, path):
    """A body nested thousands of levels deep (Python's json recursion runs out) is a 400 on every route: the
    embeddings and ollama routes, which parse their own bodies, answered a plain-text 500 with a traceback."""
    for body in ("[" * 100000 + "]" * 100000, '{"model": "m", "input": ' + "[" * 5000 + "]" * 5000 + "}"):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "error" in r.json(), (path, r.status_code, r.text[:200])


def test_metrics_parse(server, client, model_id):
    from prometheus_client.parser import text_string_to_metric_families
    client.chat.completions.create(model=model_id, messages=Q, temperature=0, max_tokens=4)
    long = [{"role": "user", "content": "a question long enough to fill KV pages " * 40}]
    client.chat.completions.create(model=model_id, messages=long, temperature=0, max_tokens=4)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("bitnet_http_requests", "bitnet_generated_tokens", "bitnet_requests_waiting", "bitnet_requests_running",
                 "bitnet_kv_pages_used", "bitnet_kv_pages_total", "bitnet_time_to_first_token_seconds",
                 "bitnet_time_per_output_token_seconds"):
        assert name in fams, name
    ttft_count = [s.value for s in fams["bitnet_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count and ttft_count[0] >= 1
    assert [s.value for s in fams["bitnet_kv_pages_total"].samples][0] > 0
    # the answer is over: its pages stay in the prefix cache, free to take, so the pool reads as unloaded (it read
    # the cached share, ~1.0 on a server that had answered enough, and a balancer sent it nothing)
    value = {f: [s.value for s in fams[f].samples][0] for f in
             ("bitnet_kv_pages_used", "bitnet_kv_pages_evictable", "bitnet_kv_pool_usage_ratio")}
    assert value["bitnet_kv_pages_used"] > 0 and value["bitnet_kv_pages_evictable"] == value["bitnet_kv_pages_used"]
    assert value["bitnet_kv_pool_usage_ratio"] == 0.0, value
    slots = httpx.get(server.url + "/slots", timeout=30)   # the same counts as JSON (numpy's ints were a 500)
    assert slots.status_code == 200, slots.text


def test_prompt_lookup_same_greedy_text(client, model_id):
    """`bitnet serve --draft-max 4`: the same greedy text as the server without it, concurrent requests
    included, with drafted / accepted tokens in /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    story = "Once upon a time, there was a kind fox named Leo. It was a nice day and the sky was blue. "
    # the bundled story model repeats itself on these: drafts get accepted
    prompts = [story * 3 + "Once upon", "Leo loved the big city because it was full of things to see. Leo loved the"
               " big city because", "What is 2+2?"]
    want = [client.completions.create(model=model_id, prompt=p, temperature=0, max_tokens=48).choices[0].text
            for p in prompts]
    s = Server("--parallel", "4", "--draft-max", "4")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = [None] * len(prompts)

        def one(i):
            got[i] = c.completions.create(model=model_id, prompt=prompts[i], temperature=0, max_tokens=48).choices[0].text
        _concurrently(one, len(prompts))
        assert got == want
        assert [one(i) or got[i] for i in range(len(prompts))] == want   # one at a time too
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(s.url + "/metrics").text)}
        drafted = fams["bitnet_lookup_drafted_tokens"].samples[0].value
        accepted = fams["bitnet_lookup_accepted_tokens"].samples[0].value
        assert 0 < accepted <= drafted
        # llama-server's timings carry the drafts when they ran
        t = httpx.post(s.url + "/completion", json={"prompt": prompts[0], "n_predict": 48, "temperature": 0},
                       timeout=60).json()["timings"]
        assert 0 < t["draft_n"] and 0 <= t["draft_n_accepted"] <= t["draft_n"], t
    finally:
        s.stop()


def test_forced_tokens_are_not_counted_as_prompt_lookup(client, model_id, server):
    """A grammar's forced tokens run as drafts (jump-forward); they are counted as forced, never as prompt
    lookup's, which this server has off (its counters read 88 drafted with --draft-max 0)."""
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.post(server.url + "/completion", json={"prompt": "Say it:", "grammar": 'root ::= "the same fixed answer"',
                                                     "n_predict": 40, "temperature": 0}, timeout=60).json()
    assert r["content"] == "the same fixed answer"
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    assert fams["bitnet_lookup_drafted_tokens"].samples[0].value == 0
    assert fams["bitnet_forced_drafted_tokens"].samples[0].value > 0


def test_batch_size_flag_chunks_prompts_with_the_same_text(client, model_id, server):
    """`bitnet serve -b 8`: steps of at most 8 rows (a decoding sequence's token, then prompt tokens), so a
    40-token prompt is read over several steps beside the other stream; the greedy text equals the default
    server's (128 rows a step, 256 on AMX tiles), /slots reports the batch size, and -b outside 1..8192 is one
    line, exit 2."""
    import subprocess
    import sys
    from serve_proc import ROOT, free_port
    import os
    prompts = ["Once upon a time, there was a little cat named Tom. Tom liked to play in the garden with his ball. "
               "One day", "What is 2+2?"]
    want = [client.completions.create(model=model_id, prompt=p, temperature=0, max_tokens=24).choices[0].text
            for p in prompts]
    import bitnet_cpu.simd._kernels as K
    from bitnet_cpu.engine.cpu import BATCH_TOKENS_DEFAULT, BATCH_TOKENS_TILES
    default = BATCH_TOKENS_TILES if K.tiles() == "amx" else BATCH_TOKENS_DEFAULT
    assert httpx.get(server.url + "/slots").json()["metrics"]["n_batch"] == default
    s = Server("--parallel", "2", "-b", "8")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = [None] * len(prompts)
        usage = [None] * len(prompts)

        def one(i):
            r = c.completions.create(model=model_id, prompt=prompts[i], temperature=0, max_tokens=24)
            got[i], usage[i] = r.choices[0].text, r.usage
        _concurrently(one, len(prompts))
        assert got == want
        m = httpx.get(s.url + "/slots").json()["metrics"]
        assert m["n_batch"] == 8
        assert usage[0].prompt_tokens > 16   # read over more than two steps of 8 rows
        assert m["steps_total"] >= -(-usage[0].prompt_tokens // 8)
    finally:
        s.stop()
    env = dict(os.environ, PYTHONPATH=pythonpath())
    for bad in ("0", "8193"):
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--port", str(free_port()), "-b", bad],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"--batch-size {bad}: must be in 1..8192" in r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_health_and_page(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"] and "/v1/chat/completions" in r.text


def test_api_key_and_queue_full():
    s = Server("--api-key", "sekret", "--parallel", "1", "--max-queue", "1")
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.models.list()
        assert ei.value.status_code == 401 and ei.value.body["type"] == "authentication_error"
        assert httpx.get(s.url + "/health").status_code == 200  # health stays open for load balancers
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        mid = good.models.list().data[0].id
        statuses, retry_after = [], []

        def one():
            r = httpx.post(s.url + "/v1/completions", headers={"Authorization": "Bearer sekret"}, timeout=60,
                           json={"model": mid, "prompt": "Once", "max_tokens": 200, "temperature": 2.0,
                                 "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 3})
            statuses.append(r.status_code)
            if r.status_code == 503:
                retry_after.append(r.headers.get("retry-after"))
                assert r.json()["error"]["code"] == "queue_full"
        ts = [threading.Thread(target=one) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert 503 in statuses and 200 in statuses and set(statuses) <= {200, 503}, statuses
        assert all(ra and int(ra) >= 1 for ra in retry_after)
    finally:
        rc, _ = s.stop()
    assert rc == 0


def test_queue_full_has_retry_after_on_every_api(tmp_path_factory):
    """--max-queue 0: nothing waits for a slot. With the one slot streaming, a request on each API is a 503
    queue_full with Retry-After (ollama's routes used to leave the header out); Anthropic's, its 529."""
    from helpers import slowness
    from serve_proc import slow_model
    anthropic = pytest.importorskip("anthropic")   # imported before the slot is taken: it takes seconds
    # one thread and 4,000 tokens: the stream outlasts the eight requests on a fast machine too (1,500 tokens on
    # two threads took about a second there)
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "1", "--max-queue", "0", threads=1)
    claude = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=30 * slowness())
    try:
        body = {"prompt": "a", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30 * slowness()) as r:
            lines = r.iter_lines()   # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: ")
            # llama-server's load-balancer check: no free slot is a 503 when asked (and the listing otherwise)
            busy = httpx.get(s.url + "/slots", params={"fail_on_no_slot": 1}, timeout=30)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "no_slot_available"
            assert httpx.get(s.url + "/slots", timeout=30).json()["metrics"]["running"] == 1
            # the anthropic client reads a full queue as its OverloadedError (it was a 503 InternalServerError)
            with pytest.raises(anthropic.OverloadedError) as e:
                claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "a"}])
            assert e.value.body["error"]["type"] == "overloaded_error", e.value.body
            for path, req in (("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                              ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user",
                                                                                              "content": "a"}]}),
                              ("/api/generate", {"model": "m", "prompt": "a", "stream": False}),
                              ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "a"}],
                                             "stream": False}),
                              ("/v1/embeddings", {"input": "a"}), ("/api/embed", {"model": "m", "input": "a"}),
                              ("/api/embeddings", {"model": "m", "prompt": "a"})):
                got = httpx.post(s.url + path, json=req, timeout=30 * slowness())
                # Anthropic's overloaded_error is its 529 (the anthropic SDK's OverloadedError)
                want = 529 if path == "/v1/messages" else 503
                assert got.status_code == want and int(got.headers["retry-after"]) >= 1, (path, got.text)
        s.slots_when_idle()
        assert httpx.get(s.url + "/slots", params={"fail_on_no_slot": 1}, timeout=30).status_code == 200
    finally:
        assert s.stop()[0] == 0


def test_sigint_with_stream_in_flight_exits_0():
    s = Server()
    body = {"prompt": "Once", "max_tokens": 500, "stream": True, "temperature": 2.0, "top_p": 1.0, "top_k": 0,
            "min_p": 0.0}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        next(it)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        rest = list(it)
    rc, err = s.stop(sig=None)
    assert rc == 0, err
    assert time.monotonic() - t0 < 10
    assert "Traceback" not in err
    assert rest == [] or rest[-1] in ("data: [DONE]", "") or rest[-1].startswith("data: ")


def test_sigterm_exits_0():
    s = Server()
    rc, err = s.stop(signal.SIGTERM)
    assert rc == 0 and "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads a process's caught signals in /proc")
def test_sigterm_while_it_starts_ends_with_its_line():
    """SIGTERM while `bitnet serve` still imports the engine (before it listens) ends as any command does: exit 143
    with "bitnet: terminated (SIGTERM)" (the handler was put in place after the imports, ~1.5 s, before which
    Python's default action ended it without a line). The child sends itself the signal the moment the engine's
    kernels are first imported (an import hook of the test's own), so the moment is the same on any machine."""
    import subprocess
    import sys
    from serve_proc import ROOT, free_port
    child = (
        "import os, signal, sys\n"
        "class AtKernels:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.endswith('simd._kernels'):\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.meta_path.insert(0, AtKernels())\n"
        f"sys.argv = ['bitnet', 'serve', '--port', '{free_port()}']\n"
        "from bitnet_cpu.cli import main\n"
        "sys.exit(main())\n")
    r = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 143 and r.stderr.strip().endswith("bitnet: terminated (SIGTERM)") \
        and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])


def test_non_loopback_warning_and_bad_flags(tmp_path):
    import subprocess
    import sys
    from serve_proc import ROOT
    import os
    env = dict(os.environ, PYTHONPATH=pythonpath())
    # an invalid port makes it exit before binding: the warning is printed first, then one error line
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--host", "0.0.0.0", "--port", "70000"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "warning: listening on 0.0.0.0 without --api-key" in r.stderr
    assert "--port 70000" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--host", "0.0.0.0", "--api-key", "k", "--port", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "warning" not in r.stderr and r.returncode == 2
    # an empty address (LLAMA_ARG_HOST=${HOST} with HOST unset) bound every interface with no guard: one line
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--port", "1"], cwd=ROOT, capture_output=True,
                       env=dict(env, LLAMA_ARG_HOST=""), text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "LLAMA_ARG_HOST='': --host: an empty address" in r.stderr, r.stderr   # the variable the user set


@pytest.mark.parametrize("extra", [(), ("--ray-replicas", "1")])
def test_port_in_use_is_one_line_exit_2(extra):
    """A port another process listens on: one line naming it, exit 2, before the model (or Ray) is loaded;
    uvicorn's own bind came after 'listening on ...' was printed and exited 3 with its log line."""
    import socket
    import subprocess
    import sys
    from serve_proc import ROOT
    import os
    env = dict(os.environ, PYTHONPATH=pythonpath())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--host", "127.0.0.1", "--port", str(port),
                            *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "listening on" not in r.stderr and "Traceback" not in r.stderr and "ERROR" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) <= 2   # the error and its hint


def _serve_args(*argv):
    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.flags import given_options
    args = build_parser().parse_args(["serve", *argv])
    args.llama_env, args.given_flags = {}, given_options(["serve", *argv])
    return args


def test_ray_replicas_times_threads_against_the_cores():
    """--ray-replicas N checked N against the cores but never N x -t: 4 replicas x 2 threads started 8 busy threads
    on a 4-core machine without a word, where plain `serve -t 8` warns and caps. Now the same: one warning naming
    both flags and the count used, -t capped to the cores' share of a replica. Checked before Ray starts (a model
    that does not exist stops it there)."""
    import subprocess
    import sys

    from bitnet_cpu.cli.serve import _check
    from bitnet_cpu.engine.cpu import available_cores
    from serve_proc import ROOT, free_port
    cores = available_cores()
    args = _serve_args("--ray-replicas", str(cores), "-t", "2")
    (w,) = _check(args)
    assert f"--ray-replicas {cores}" in w and "-t 2" in w and f"{cores} CPU cores" in w and "\n" not in w, w
    assert args.threads == 1
    for argv in (("--ray-replicas", str(cores)), ("--ray-replicas", "1", "-t", str(cores)), ()):
        args = _serve_args(*argv)
        assert _check(args) == [] and args.threads in (None, cores), argv   # within the cores: nothing said
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
                        "--ray-replicas", str(cores), "-t", "2", "-m", "/nonexistent/m.bnstore"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=pythonpath()), capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("bitnet serve: warning: --ray-replicas") and "error:" in lines[-1], r.stderr
    help_text = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--help"], cwd=ROOT, capture_output=True,
                               env=dict(os.environ, PYTHONPATH=pythonpath()), text=True, timeout=120).stdout
    ray_help = " ".join(help_text.split("\n  --ray-replicas", 1)[1].split("\n  -", 1)[0].split())
    assert "1 thread" in ray_help and "replica" in ray_help, ray_help


@pytest.mark.parametrize("mode", ["model", "models-dir"])
def test_the_port_takes_connections_once_listening_is_said(tmp_path, mode):
    """'listening on ...' is the line scripts and supervisors wait for: a connection made the moment it is printed
    waits for its answer; it was refused (ECONNREFUSED) while uvicorn started, and for seconds while a router
    scanned its models, because the socket was bound but not yet listening."""
    import shutil
    import socket
    import subprocess
    import sys
    from serve_proc import ROOT, free_port
    model = os.path.join(ROOT, "models", "default.bnstore")
    if mode == "model":
        where = ["-m", model]
    else:
        shutil.copy(model, tmp_path / "a.bnstore")
        shutil.copy(model, tmp_path / "b.bnstore")
        where = ["--models-dir", str(tmp_path)]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "-t", "1", *where], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:   # bounded: the server prints the line or exits (then the loop ends)
            seen.append(line)
            if "listening on" in line:
                break
        assert "listening on" in "".join(seen), "".join(seen)
        with socket.create_connection(("127.0.0.1", port), timeout=5):   # refused on the old code
            pass
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=120).status_code in (200, 503)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_no_webui_serves_no_chat_page():
    """--no-webui (llama-server's) was accepted and the chat page still served at /: a server its operator wanted
    without a UI showed one. / answers ollama's plain "is running" line instead (HEAD / still answers)."""
    s = Server("--no-webui", threads=1)
    try:
        r = httpx.get(s.url + "/", timeout=30)
        assert r.status_code == 200 and r.text == "bitnet serve is running" and "<html" not in r.text.lower()
        assert httpx.head(s.url + "/", timeout=30).status_code == 200
    finally:
        s.stop()
    s = Server(threads=1)
    try:
        assert "<html" in httpx.get(s.url + "/", timeout=30).text.lower()   # the page, without the flag
    finally:
        s.stop()


def test_server_sampling_flags_are_request_defaults():
    """In-process: the server's sampling settings (bitnet serve --temp/--top-k/.../--seed) fill the fields a
    request leaves out, so a bare request samples exactly as one that sends those values; a request's own
    values still win."""
    from starlette.testclient import TestClient

    from bitnet_cpu.engine.api import SamplingParams, load_engine
    from bitnet_cpu.serve.app import create_app

    wild = dict(temperature=2.0, top_p=1.0, top_k=0, min_p=0.0, seed=7)
    app = create_app(lambda: load_engine(None, threads=1, parallel=2, progress=False),
                     sampling=SamplingParams(**wild))
    with TestClient(app) as tc:
        deadline = time.monotonic() + 60
        while tc.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)

        def text(**body):
            r = tc.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 24, "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        bare, explicit, greedy = text(), text(**wild), text(temperature=0)
        assert bare == explicit
        assert greedy != explicit   # the request's temperature 0 overrides the server's 2.0
        # null is "not sent" (OpenAI's API takes null for these; LangChain and LiteLLM send it): the server's values
        nulls = dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "seed", "n", "stream", "presence_penalty",
                               "frequency_penalty", "stop", "logprobs", "response_format", "tools", "user"))
        assert text(**nulls) == bare
        r = tc.post("/v1/responses", json={"input": Q[0]["content"], "max_output_tokens": 24, "ignore_eos": True,
                                           **dict.fromkeys(("temperature", "top_p", "seed", "stream", "tools",
                                                            "tool_choice", "text", "include"))})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == bare
        assert tc.post("/v1/chat/completions", json={"messages": None}).status_code == 400   # a required one is not


def test_dry_breaker_tables_are_built_off_the_event_loop(monkeypatch):
    """In-process: a DRY breaker list scans the vocabulary once (the first ~0.3 s for 128k tokens), which on the
    event loop would stall every stream the server runs: the server's default list is built as the model loads,
    and a request's new list in a worker thread, on the OpenAI, llama-server and ollama endpoints alike (a spy
    on the scan notes its thread; the scan itself runs unchanged)."""
    import asyncio

    from starlette.testclient import TestClient

    from bitnet_cpu.engine.api import SamplingParams, load_engine
    from bitnet_cpu.engine.runtime import dry
    from bitnet_cpu.serve.app import create_app

    scans = []

    class Spy(dry._Vocab):
        def __init__(self, words):
            try:
                asyncio.get_running_loop()
                scans.append("on an event loop")
            except RuntimeError:
                scans.append(threading.current_thread().name)
            super().__init__(words)
    monkeypatch.setattr(dry, "_Vocab", Spy)
    defaults = SamplingParams(dry_multiplier=0.8, dry_sequence_breakers=("\n", "@@ server"))
    app = create_app(lambda: load_engine(None, threads=1, parallel=2, progress=False), sampling=defaults)
    with TestClient(app) as tc:
        deadline = time.monotonic() + 60
        while tc.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        eng = app.state.bitnet.engine
        assert scans == ["bitnet-load"] and eng.sampling_ready(defaults)
        chat = {"messages": Q, "max_tokens": 4}
        for path, body in [("/v1/chat/completions", dict(chat, dry_sequence_breakers=["@@ chat"])),
                           ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "dry_sequence_breakers": ["@@ c"]}),
                           ("/completion", {"prompt": "Once", "n_predict": 4, "dry_sequence_breakers": ["@@ native"]}),
                           ("/api/chat", dict(chat, model="m", stream=False, options={"num_predict": 4}))]:
            if path == "/api/chat":   # ollama's requests take the server's list: forget it, to be built again
                dry._TABLES.clear()
            n = len(scans)
            r = tc.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            assert len(scans) == n + 1 and scans[-1] != "on an event loop", (path, scans)


def test_serve_sampling_flag_checked_at_start():
    import os
    import subprocess
    import sys

    from serve_proc import ROOT
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--top-p", "1.5"],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--top-p 1.5" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("model, words", [("README.md", "not a GGUF file"), ("missing.bnstore", "no such file"),
                                          ("README.md/", "not a directory"), ("m" * 260 + ".bnstore", "name too long")])
def test_a_model_that_does_not_load_is_one_line_and_exit_2(model, words, tmp_path):
    """`bitnet serve -m` with a typo or a wrong file says what is wrong and exits 2, as `bitnet run` and
    llama-server do; it used to listen and answer 503 for ever (to a script or systemd, a server still loading).
    A path that is not there for another reason says the OS's reason (a file given with a trailing "/", a name
    too long were "no such file or directory")."""
    import os
    import subprocess
    import sys

    from serve_proc import ROOT, free_port
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "-m", os.path.join(ROOT, model),
                        "--port", str(free_port())], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                       capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and len(errors) == 1 and words in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_context_past_memory_is_refused_before_it_is_allocated():
    """`bitnet serve -c 10000000` as `bitnet run` refuses it: one line naming what the KV pool and buffers need and
    what is available, exit 2, before anything that size is allocated (it built RoPE tables for minutes, memory
    climbing, /health saying 503 loading). The address-space limit makes "available" the same on any machine."""
    import resource
    import subprocess
    import sys

    from serve_proc import ROOT, free_port

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "-t", "1", "-c", "10000000", "--parallel", "1",
                        "--port", str(free_port())], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert errors[0].startswith("bitnet serve: error: -c/--ctx 10000000: the KV cache and buffers would need "), \
        r.stderr
    assert "of memory available" in errors[0] and "Traceback" not in r.stderr, r.stderr


def test_the_default_kv_pool_fits_in_the_memory_available():
    """The default pool (a context per --parallel slot, up to 4 GiB) is sized within the memory available: counted
    whole against it, a small machine's server with the default --parallel was refused at load, though its pool's
    pages cost nothing until used. Here 64 slots of 65,536 tokens (4 GiB capped) under a 2.5 GiB address space serve;
    one context of them fits."""
    import contextlib
    import resource
    import subprocess
    import sys

    from helpers import slowness
    from serve_proc import ROOT, free_port

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2560 << 20, resource.RLIM_INFINITY))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "-t", "1", "-c", "65536", "--parallel", "64",
                             "--port", str(port)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    try:
        deadline, up = time.monotonic() + 120 * slowness(), False
        while not up and proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                up = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            time.sleep(0.2)
        assert up, proc.stderr.read() if proc.poll() is not None else "not healthy in time"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "error" not in err, err


def test_health_503_while_loading():
    """In-process: the app answers /health 503 (+ Retry-After) until load() returns, then 200."""
    from starlette.testclient import TestClient

    from bitnet_cpu.engine.api import load_engine
    from bitnet_cpu.serve.app import create_app
    gate = threading.Event()

    def load():
        gate.wait(30)
        return load_engine(None, threads=1, parallel=2, progress=False)
    with TestClient(create_app(load)) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "loading"
        r = tc.post("/v1/chat/completions", json={"messages": Q})
        assert r.status_code == 503
        gate.set()
        deadline = time.monotonic() + 30
        while tc.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tc.get("/health").status_code == 200
        r = tc.post("/v1/chat/completions", json={"messages": Q, "temperature": 0, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_several_api_keys_in_one_flag_and_metrics_stay_behind_them():
    """llama-server's --api-key K1,K2 is two keys; its --metrics (accepted: /metrics is always served) is not our
    --metrics-public: /metrics still needs a key (argparse once read --metrics as --metrics-public). "k1, k2" is k1
    and k2 (the second was " k2", which no client could send); an x-api-key counts beside an Authorization header
    that holds no Bearer key (a proxy's Basic credentials: it was ignored, a 401 telling to send what was sent)."""
    s = Server("--api-key", "k1, k2", "--metrics", "--parallel", "1")
    try:
        for key, status in (("k1", 200), ("k2", 200), ("k1,k2", 401), ("k3", 401)):
            r = httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == status, (key, r.text)
        for key, status in (("k2", 200), ("k3", 401)):
            r = httpx.get(s.url + "/v1/models", headers={"Authorization": "Basic dXNlcjpwYXNz", "x-api-key": key})
            assert r.status_code == status, (key, r.text)
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer k2"}).status_code == 200
    finally:
        s.stop()


def test_minus_one_lengths_run_to_the_end(server):
    """llama-server reads max_tokens / max_completion_tokens / max_output_tokens -1 as n_predict -1 (to the
    context's end), and llama.cpp's web UI sends max_tokens -1 on every message (it was a 400); other negatives
    stay a 400."""
    msgs = [{"role": "user", "content": "Say hi."}]
    want = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "temperature": 0}, timeout=120)
    assert want.status_code == 200
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "temperature": 0, field: -1},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    r = httpx.post(server.url + "/v1/responses", json={"input": "Say hi.", "temperature": 0, "max_output_tokens": -1},
                   timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_final_assistant_message_is_continued(server):
    """As llama-server (its default, and its web UI's Continue: continue_final_message true, add_generation_prompt
    false): the answer continues a final assistant message, as ollama's /api/chat and Anthropic's /v1/messages
    continue it, and /apply-template shows that prompt; continue_final_message false starts a new turn; what
    llama-server refuses is a 400 (both flags true, two assistant messages at the end)."""
    m = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]

    def chat(**kw):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": m, "max_tokens": 8, "temperature": 0,
                                                                   **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    ollama_said = httpx.post(server.url + "/api/chat", timeout=60, json={
        "model": "m", "messages": m, "stream": False, "options": {"num_predict": 8, "temperature": 0}}).json()
    assert chat() == chat(continue_final_message=True, add_generation_prompt=False) == \
        ollama_said["message"]["content"]
    new_turn = chat(continue_final_message=False)
    assert new_turn != chat()
    prompt = httpx.post(server.url + "/apply-template", json={"messages": m}).json()["prompt"]
    assert prompt.endswith("Once upon a")
    closed = httpx.post(server.url + "/apply-template", json={"messages": m, "continue_final_message": False}).json()
    assert closed["prompt"].startswith(prompt) and len(closed["prompt"]) > len(prompt)
    # the Python API's chat_prompt follows the same rule (it closed the message and opened another turn)
    from bitnet_cpu.engine.api import SamplingParams, load_model
    with load_model(progress=False) as llm:
        bos = llm.bos_text()   # /apply-template leaves out the BOS the tokenizer adds
        assert llm.chat_text(m) == bos + prompt
        assert llm.chat_text(m, continue_final_message=False) == bos + closed["prompt"]
        said = llm.generate(llm.chat_prompt(m), SamplingParams(temperature=0), max_tokens=8)
        assert "".join(c.text for c in said) == chat()
    for bad in ({"continue_final_message": True, "add_generation_prompt": True},
                {"messages": m + [{"role": "assistant", "content": "x"}]},
                {"messages": m[:1], "continue_final_message": True},
                {"messages": m[:1], "add_generation_prompt": False}):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": m, **bad})
        assert r.status_code == 400, (bad, r.text)


def test_llama_servers_environment_variables():
    """A llama-server set up by its variables (its Docker images) gets the same server: LLAMA_API_KEY closes it,
    LLAMA_ARG_CTX_SIZE sets -c (a flag on the command line wins, as there), and a LLAMA_ARG_* with no meaning here
    is named in a warning instead of being dropped without a word."""
    env = {"LLAMA_API_KEY": "envkey", "LLAMA_ARG_CTX_SIZE": "256", "LLAMA_ARG_N_GPU_LAYERS": "99",
           "LLAMA_ARG_JINJA": "true"}
    s = Server("--parallel", "1", env=env)
    try:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        props = httpx.get(s.url + "/props", headers={"Authorization": "Bearer envkey"}).json()
        assert props["default_generation_settings"]["n_ctx"] == 256
    finally:
        _, err = s.stop()
    assert "LLAMA_ARG_N_GPU_LAYERS" in err and "not used" in err
    s = Server("--parallel", "1", "-c", "512", env={"LLAMA_ARG_CTX_SIZE": "256"})
    try:
        assert httpx.get(s.url + "/props").json()["default_generation_settings"]["n_ctx"] == 512
    finally:
        s.stop()


@pytest.mark.parametrize("name, value, why", [("LLAMA_ARG_TEMPERATURE", "hot", "argument --temp: invalid float value"),
                                              ("LLAMA_ARG_THINK", "maybe", "argument --reasoning-format: invalid "
                                                                           "choice")])
def test_a_bad_llama_variable_is_named(name, value, why):
    """A LLAMA_ARG_* value its flag does not take: one line naming the variable, exit 2 (argparse's usage and
    "argument --temp/--temperature: invalid float value" named a flag the user never typed)."""
    import os
    import subprocess
    import sys
    from serve_proc import ROOT
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--port", "1"], cwd=ROOT, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                **{name: value}), text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"bitnet serve: error: {name}={value!r}: {why}"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "usage" not in r.stderr, r.stderr


def _serve_cli(*argv, env=None, timeout=60):
    """`bitnet serve ARGV` with the variables `env` besides ours, to its end (a bad flag or variable: it never
    listens)."""
    import subprocess
    import sys
    from serve_proc import ROOT
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", *argv], cwd=ROOT, capture_output=True,
                          env=dict(os.environ, PYTHONPATH=pythonpath(), **(env or {})), text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE"])
def test_a_tls_variable_is_refused_not_dropped(tmp_path, name):
    """llama-server's TLS variables were dropped with a warning and the server went on in plain HTTP (on 0.0.0.0
    if asked), to clients whose operator had set up TLS: one line, exit 2, as the --ssl-* flags. (--parallel 0
    stops a server that would start anyway.)"""
    r = _serve_cli("--host", "0.0.0.0", "--api-key", "k", "--parallel", "0", env={name: str(tmp_path / "k.pem")})
    assert r.returncode == 2 and r.stderr.strip() == f"bitnet serve: error: {name}: TLS is not supported here: put " \
        "a TLS-terminating proxy (nginx, Caddy) in front", r.stderr


def test_a_variable_gives_way_to_a_flag_it_cannot_go_with(tmp_path):
    """A LLAMA_ARG_* variable for a flag that excludes one typed on the command line stopped the server, naming a
    flag nobody typed: the command line wins over it as over the variable's own flag; a router-only variable with
    no router is a warning. (A bad value of a typed flag stops each server after the variables were read.)"""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")
    r = _serve_cli("--chat-template-file", str(template), "--parallel", "0", env={"LLAMA_ARG_CHAT_TEMPLATE": "chatml"})
    assert r.returncode == 2 and r.stderr.strip() == "bitnet: error: --parallel 0: must be >= 1", r.stderr
    r = _serve_cli("--models-dir", str(tmp_path), "--models-max", "0", env={"LLAMA_ARG_MODEL": "x.gguf"})
    assert r.returncode == 2 and r.stderr.strip() == "bitnet: error: --models-max 0: must be >= 1", r.stderr
    r = _serve_cli("-m", "x.gguf", "--parallel", "0", env={"LLAMA_ARG_MODELS_DIR": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.strip() == "bitnet: error: --parallel 0: must be >= 1", r.stderr
    r = _serve_cli("--parallel", "0", env={"LLAMA_ARG_MODELS_MAX": "2"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "bitnet serve: warning: LLAMA_ARG_MODELS_MAX applies to --models-dir / --models-cache only (llama-server's "
        "router); it is not used", "bitnet: error: --parallel 0: must be >= 1"], r.stderr


@pytest.mark.parametrize("name, value, said", [
    ("LLAMA_ARG_PORT", "99999", "--port must be in 1..65535"),
    ("LLAMA_ARG_N_PARALLEL", "-1", "--parallel must be >= 1"),
    ("LLAMA_ARG_CTX_SIZE", "-5", "-c/--ctx must be >= 0"),
    ("LLAMA_ARG_HOST", "/tmp/x.sock", "--host: unix sockets are not supported")])
def test_a_variable_s_value_out_of_range_is_named_by_the_variable(name, value, said):
    """A value from a variable that its flag's check refuses named the flag (`--port 99999: ...`), which the
    user never typed: the line names the variable."""
    r = _serve_cli(env={name: value})
    assert r.returncode == 2 and r.stderr.startswith(f"bitnet: error: {name}={value!r}: {said}"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("host, said", [("/tmp/x.sock", "unix sockets are not supported"),
                                        ("x.sock", "unix sockets are not supported"),
                                        ("unix:///tmp/x.sock", "unix sockets are not supported"),
                                        ("http://localhost", "--host takes an address or name, not a URL")])
def test_a_host_that_is_no_address_is_one_line_at_once(host, said):
    """llama-server listens on a unix socket when the host ends in .sock: here such a host (or a URL) was looked up
    as a name, after a warning that anyone who can reach its port can use the model, and failed seconds later."""
    r = _serve_cli("--host", host)
    assert r.returncode == 2 and r.stderr.startswith(f"bitnet: error: --host {host}: {said}"), r.stderr
    assert "warning" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_ipv6_host_in_brackets_and_its_url():
    """--host [::1] (a URL's spelling) failed as a name that does not resolve, and --host ::1 printed
    http://::1:PORT, which no client takes: brackets are dropped, and the URL printed has them."""
    import socket
    import subprocess
    import sys
    from serve_proc import ROOT, wait_healthy
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "-t", "2", "--host", "[::1]", "--port",
                             str(port)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_healthy(f"http://[::1]:{port}", 120, proc), proc.stderr.read() if proc.poll() is not None else ""
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert f"listening on http://[::1]:{port} " in err, err
