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


# -- a sibling endpoint's fields: a 400 saying where they belong -------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"echo": True}, "echo"),
    ({"best_of": 5}, "best_of"),
])
def test_completions_fields_on_chat_say_where_they_belong(server, extra, param):
    for path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens"):
        e = _err(_post(server, path, {**CHAT, **extra}))
        assert e["param"] == param and "/v1/completions" in e["message"], (path, e)


def test_suffix_on_chat_says_why_as_every_endpoint_does(server):
    """It pointed to /v1/completions, which refused it too: now the one reason every endpoint gives (the bundled
    model's vocabulary has no fill-in-the-middle tokens)."""
    for path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens"):
        e = _err(_post(server, path, {**CHAT, "suffix": "x"}))
        assert e["param"] == "suffix" and "no fill-in-the-middle tokens" in e["message"], (path, e)


def test_completions_fields_at_their_off_values_are_taken_on_chat(server):
    """false, 1, "" and null ask for nothing: a client that sends its defaults everywhere keeps working."""
    _ok(_post(server, "/v1/chat/completions", {**CHAT, "echo": False, "best_of": 1, "suffix": ""}))
    _ok(_post(server, "/v1/chat/completions", {**CHAT, "echo": None, "best_of": None, "suffix": None}))


def test_an_integer_logprobs_on_chat_points_to_top_logprobs(server):
    e = _err(_post(server, "/v1/chat/completions", {**CHAT, "logprobs": 3}))
    assert e["param"] == "logprobs" and "top_logprobs" in e["message"] and "/v1/completions" in e["message"], e


def test_messages_on_completions_say_where_they_belong(server):
    """The messages were dropped and the prompt alone ran."""
    e = _err(_post(server, "/v1/completions", {**COMPLETION, "messages": Q}))
    assert e["param"] == "messages" and "/v1/chat/completions" in e["message"], e


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/input_tokens"])
def test_an_unknown_top_level_field_stays_ignored_on_chat(server, path):
    """The documented policy: llama-server's and vLLM's clients send their own extension fields."""
    _ok(_post(server, path, {**CHAT, "some_extension": {"x": 1}, "temprature": 0.1}))


def test_an_unknown_top_level_field_stays_ignored_on_completions(server):
    _ok(_post(server, "/v1/completions", {**COMPLETION, "some_extension": True}))


# -- OpenAI's nested objects: an unknown key is a 400 naming its path ------------------------------------------------
SCHEMA = {"type": "object"}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "bogus": 1}}},
     "response_format.json_schema.bogus"),
    ({"response_format": {"type": "json_object", "bogus": 1}}, "response_format.bogus"),
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus"),
    ({"stream": True, "stream_options": {"include_obfuscation": "yes"}}, "stream_options.include_obfuscation"),
    # vLLM's usage in every chunk: not given here (false is taken)
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
])
def test_an_unknown_key_inside_openais_objects_is_a_400_naming_its_path(server, extra, param):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                       ("/v1/chat/completions/input_tokens", CHAT)):
        e = _err(_post(server, path, {**body, **extra}))
        assert e["param"] == param, (path, e)


@pytest.mark.parametrize("obfuscation", [True, False])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_include_obfuscation_is_taken(server, path, body, obfuscation):
    """OpenAI's stream_options.include_obfuscation: taken either way (nothing is padded here), as the usage chunk
    the request also asks for shows."""
    options = {"include_usage": True, "include_obfuscation": obfuscation}
    with httpx.stream("POST", server.url + path, timeout=120, json={**body, "stream": True,
                                                                     "stream_options": options}) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and chunks[-1]["usage"]["completion_tokens"] == 2, chunks
    assert not any("obfuscation" in c for c in chunks), chunks


def test_vllms_continuous_usage_stats_false_is_taken(server):
    r = _post(server, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": False}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


# -- response_format.json_schema.name: required, as OpenAI and /v1/responses require it ------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/input_tokens"])
def test_a_chat_json_schema_needs_its_name(server, path):
    e = _err(_post(server, path, {**CHAT, "response_format": {"type": "json_schema",
                                                              "json_schema": {"schema": SCHEMA}}}))
    assert e["param"] == "response_format.json_schema.name", e
    assert e["message"] == "Missing required parameter: 'response_format.json_schema.name'.", e


# -- stop: counted as sent; an empty stop string is a 400 (llama-server's /completion drops it, as llama-server) ------
STOP_PATHS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
              ("/v1/responses", {"input": "Hi", "max_output_tokens": 2})]


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", ""], [""] * 6, "", [""], ["a", ""]])
@pytest.mark.parametrize("path, body", STOP_PATHS)
def test_stop_entries_are_counted_as_sent_and_none_is_empty(server, path, body, stop):
    e = _err(_post(server, path, {**body, "stop": stop}))
    assert e["param"] == "stop", e


@pytest.mark.parametrize("path, body", STOP_PATHS)
def test_four_stop_strings_and_none_are_taken(server, path, body):
    _ok(_post(server, path, {**body, "stop": ["a", "b", "c", "d"]}))
    _ok(_post(server, path, {**body, "stop": []}))


def test_llama_server_completion_still_drops_an_empty_stop(server):
    """llama-server skips an empty stop word on its /completion; this server's /completion keeps doing so."""
    r = _post(server, "/completion", {"prompt": "Once upon a time", "n_predict": 2, "stop": ["", "zzz"]})
    assert r.status_code == 200, r.text


# -- /v1/responses include: what is never in the output ----------------------------------------------------------------
RESPONSE = {"input": "Hi", "max_output_tokens": 2}


@pytest.mark.parametrize("value", ["file_search_call.results", "web_search_call.action.sources",
                                   "message.input_image.image_url", "code_interpreter_call.outputs",
                                   "computer_call_output.output.image_url", "message.output_text.logprobs",
                                   "reasoning.encrypted_content"])
def test_includes_with_nothing_to_include_are_taken(server, value):
    _ok(_post(server, "/v1/responses", {**RESPONSE, "include": [value]}))


# -- huge integers, empty content, a refusal part where none can be --------------------------------------------------
HUGE = 99999999999999999999999


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": Q}, "max_tokens"),
    ("/v1/chat/completions", {"messages": Q}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": Q}, "n_predict"),
    ("/v1/completions", {"prompt": "x"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x"}, "max_completion_tokens"),
    ("/v1/responses", {"input": "x"}, "max_output_tokens"),
    ("/completion", {"prompt": "x"}, "n_predict"),
])
def test_a_huge_integer_length_is_the_huge_floats_400(server, path, body, field):
    """1e20 was refused "too large" while the same size as a JSON integer ran to the context's end."""
    r_float = _post(server, path, {**body, field: 1e20})
    r_int = _post(server, path, {**body, field: HUGE})
    assert r_float.status_code == r_int.status_code == 400, (r_float.text, r_int.text)
    if path != "/completion":   # (llama-server's error shape has no param)
        assert r_float.json()["error"]["param"] == r_int.json()["error"]["param"] == field
    assert "too large" in r_float.text and "too large" in r_int.text, r_int.text


def test_a_seed_keeps_its_own_range(server):
    """A seed is taken up to 2^64 - 1 (the unsigned one): the bound of the other integers is not its."""
    _ok(_post(server, "/v1/chat/completions", {**CHAT, "seed": (1 << 64) - 1}))
    assert _err(_post(server, "/v1/chat/completions", {**CHAT, "seed": 1 << 64}))["param"] == "seed"


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_an_empty_content_array_is_a_400(server, role):
    msgs = [{"role": role, "content": []}] + ([] if role == "user" else Q)
    for path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens"):
        e = _err(_post(server, path, {"messages": msgs, "max_tokens": 2}))
        assert e["param"] == "messages.0.content" and "empty" in e["message"], (path, e)


def test_an_assistant_message_may_still_have_no_content_parts(server):
    msgs = [*Q, {"role": "assistant", "content": [], "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "19"}]
    _ok(_post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2}))


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_a_refusal_part_outside_an_assistant_message_is_a_400(server, role):
    msgs = [{"role": role, "content": [{"type": "refusal", "refusal": "no"}]}] + ([] if role == "user" else Q)
    for path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens"):
        e = _err(_post(server, path, {"messages": msgs, "max_tokens": 2}))
        assert e["param"] == "messages.0.content.0" and "assistant" in e["message"], (path, e)
    good = [*Q, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, *Q]
    _ok(_post(server, "/v1/chat/completions", {"messages": good, "max_tokens": 2}))
