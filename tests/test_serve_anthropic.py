"""Anthropic's Messages API on `bitnet serve` (POST /v1/messages and /v1/messages/count_tokens, serve/anthropic.py),
driven by the official `anthropic` client against a real subprocess on 127.0.0.1 with the bundled model. The
endpoint is a translation over the chat pipeline, so each answer is checked against /v1/chat/completions given
the same conversation (greedy: the same text, token counts and tool calls), the stream through the client's own
accumulator (`client.messages.stream`), a prefill against the raw prompt continued by /completion, and every
field that cannot be honoured comes back as a 400 in Anthropic's error shape. The client has no `temperature`
argument (Anthropic's newest models take none); the server takes it as an extra field, sent with extra_body."""
from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic", reason="the Anthropic API tests need its client (pip install .[test])")
jsonschema = pytest.importorskip("jsonschema", reason="the structured-output checks need jsonschema (pip install .[test])")
pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from serve_proc import Server, sse_events  # noqa: E402

SERVER_ARGS = ("--parallel", "4")   # conftest's server fixture
Q = "What is 12+7?"
GREEDY = {"extra_body": {"temperature": 0}}
ADD_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ADD = {"name": "add", "description": "add two integers", "input_schema": ADD_SCHEMA}
ADD_CHAT = {"type": "function", "function": {"name": "add", "description": "add two integers",
                                             "parameters": ADD_SCHEMA}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(server, messages, **kw):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "temperature": 0, **kw},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def test_text_answer_is_the_chat_answer(claude, server):
    m = claude.messages.create(model="any", max_tokens=40, system="Be brief.",
                               messages=[{"role": "user", "content": Q}], **GREEDY)
    c = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}], max_tokens=40)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert text_of(m) == c["choices"][0]["message"]["content"] and [b.type for b in m.content] == ["text"]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c["choices"][0]["finish_reason"]]
    assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.output_tokens) == \
        (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"])


def test_usage_counts_the_cached_prompt_once(claude, server):
    """Anthropic's input_tokens leaves out the cached prompt tokens (clients add input, cache read and cache
    creation for the prompt's size): a repeated request reads most of its prompt from the prefix cache, and the
    parts add up to the prompt count_tokens gives, streamed (the client's accumulator) or not."""
    kw = dict(model="any", max_tokens=4, messages=[{"role": "user", "content": "Count the cached tokens, " * 8}],
              **GREEDY)
    n = claude.messages.count_tokens(model="any", messages=kw["messages"]).input_tokens
    claude.messages.create(**kw)
    again = claude.messages.create(**kw).usage
    with claude.messages.stream(**kw) as st:
        streamed = st.get_final_message().usage
    for u in (again, streamed):
        assert u.cache_read_input_tokens > n // 2 and u.input_tokens + u.cache_read_input_tokens == n, u
        assert u.cache_creation_input_tokens == 0 and u.output_tokens == 4


def test_blocks_and_turns_are_chat_messages(claude, server):
    m = claude.messages.create(model="any", max_tokens=30, system=[{"type": "text", "text": "Be "},
                                                                  {"type": "text", "text": "brief."}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": Q}]},
                                         {"role": "assistant", "content": "19."},
                                         {"role": "user", "content": "And 3+4?"}], **GREEDY)
    c = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q},
                      {"role": "assistant", "content": "19."}, {"role": "user", "content": "And 3+4?"}], max_tokens=30)
    assert text_of(m) == c["choices"][0]["message"]["content"]


def test_stream_through_the_clients_accumulator(claude, server):
    kw = dict(model="any", max_tokens=40, messages=[{"role": "user", "content": Q}], **GREEDY)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text_of(whole) == text_of(final) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    kinds = []
    with httpx.stream("POST", server.url + "/v1/messages", timeout=120,
                      json={"model": "any", "max_tokens": 40, "stream": True, "temperature": 0,
                            "messages": [{"role": "user", "content": Q}]}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert kinds.count("content_block_delta") >= 2


def test_tool_use_and_tool_results(claude, server):
    kw = dict(model="any", max_tokens=200, messages=[{"role": "user", "content": Q}], tools=[ADD], **GREEDY)
    m = claude.messages.create(tool_choice={"type": "any"}, **kw)
    c = chat(server, [{"role": "user", "content": Q}], tools=[ADD_CHAT], tool_choice="required", max_tokens=200)
    want = c["choices"][0]["message"]["tool_calls"]
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [(w["function"]["name"], json.loads(w["function"]["arguments"]))
                                                 for w in want]
    assert m.stop_reason == "tool_use" and all(u.id.startswith("toolu_") for u in uses)
    for u in uses:
        jsonschema.validate(u.input, ADD_SCHEMA)
    with claude.messages.stream(tool_choice={"type": "tool", "name": "add"}, **kw) as s:
        final = s.get_final_message()
    # a named tool is one call: the first of type any's (the same grammar up to its end, so the same tokens)
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses[:1]]
    # the results go back in a user message: the chat answer to the same history
    back = [{"role": "user", "content": Q}, {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "19"} for u in uses]}]
    m2 = claude.messages.create(model="any", max_tokens=30, messages=back, tools=[ADD], **GREEDY)
    history = [{"role": "user", "content": Q},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
                   for u in uses]}] + \
              [{"role": "tool", "tool_call_id": u.id, "name": u.name, "content": "19"} for u in uses]
    c2 = chat(server, history, tools=[ADD_CHAT], max_tokens=30)
    assert text_of(m2) == (c2["choices"][0]["message"]["content"] or "")


def test_a_cut_call_is_no_tool_use_with_made_up_input(claude):
    """A call cut mid-arguments (max_tokens) is no tool_use block: one came back with input {} (arguments the model
    never wrote, missing the schema's required fields), which a client would run. A schema without "type" gets an
    object's arguments, never an empty input in place of a number."""
    for n in range(8, 22, 2):
        m = claude.messages.create(model="any", max_tokens=n, messages=[{"role": "user", "content": Q}], tools=[ADD],
                                   tool_choice={"type": "tool", "name": "add"}, **GREEDY)
        for b in m.content:
            if b.type == "tool_use":
                jsonschema.validate(b.input, ADD_SCHEMA)
    # a stop sequence inside the arguments cuts the call the same way (and says max_tokens: see below)
    m = claude.messages.create(model="any", max_tokens=100, messages=[{"role": "user", "content": Q}], tools=[ADD],
                               tool_choice={"type": "tool", "name": "add"}, stop_sequences=['"b"'], **GREEDY)
    assert m.stop_reason == "max_tokens" and not [b for b in m.content if b.type == "tool_use"], m
    untyped = {"name": "f", "input_schema": {"properties": {"a": {"type": "boolean"}}, "required": ["a"]}}
    m = claude.messages.create(model="any", max_tokens=100, messages=[{"role": "user", "content": Q}],
                               tools=[untyped], tool_choice={"type": "any"}, **GREEDY)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses, m
    for b in uses:
        assert isinstance(b.input["a"], bool), m


def test_a_stop_sequence_says_max_tokens_in_a_call_and_stop_sequence_in_a_json_answer(claude, server):
    """A stop sequence that cuts a tool call is reported as max_tokens (the call may have been cut: do not run it),
    as the chat endpoint says length and the Responses API incomplete for the same cut; it said stop_sequence, and a
    forced call vanished behind a normal-looking stop. One that cuts an answer in output_config.format before its
    JSON is whole ends it as any stop sequence does: stop_sequence, naming it, as chat's stop and Responses'
    completed (OpenAI's and llama-server's rule: max_tokens would ask for a larger limit, which gives the same cut).
    Streamed (the raw events and the client's accumulator) and not; Anthropic names the stop sequence only with
    stop_reason stop_sequence."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    call = dict(tools=[ADD], tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
                stop_sequences=['"b"'])
    answer = dict(output_config={"format": {"type": "json_schema", "schema": schema}}, stop_sequences=['"answer"'])
    for extra, said in ((call, ("max_tokens", None)), (answer, ("stop_sequence", '"answer"'))):
        kw = dict(model="any", max_tokens=100, messages=[{"role": "user", "content": Q}], **extra)
        whole = claude.messages.create(**{k: v for k, v in kw.items() if k != "stop_sequences"}, **GREEDY)
        assert whole.stop_reason in ("tool_use", "end_turn"), whole   # uncut, the same request is whole
        m = claude.messages.create(**kw, **GREEDY)
        assert (m.stop_reason, m.stop_sequence) == said, m
        assert not [b for b in m.content if b.type == "tool_use"], m
        if "output_config" in extra:
            assert text_of(whole).startswith(text_of(m)) and text_of(m) != text_of(whole)
        with claude.messages.stream(**kw, **GREEDY) as s:
            final = s.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == said and text_of(final) == text_of(m)
        events = sse_events(server.url, "/v1/messages", {**kw, "temperature": 0})
        [delta] = [d for k, d in events if k == "message_delta"]
        assert delta["delta"] == {"stop_reason": said[0], "stop_sequence": said[1]}, delta
        assert [k for k, _ in events][-2:] == ["message_delta", "message_stop"]


def test_a_tool_without_a_description_costs_what_it_costs_on_the_chat_endpoint(server):
    """A tool sent without description reaches the template without one, as from /v1/chat/completions (it got
    "description": "", 13 more prompt tokens on the 2B template than the chat endpoint's same request)."""
    bare = {"name": "add", "input_schema": ADD_SCHEMA}
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "any", "messages": [
        {"role": "user", "content": Q}], "tools": [bare]}, timeout=60)
    c = httpx.post(server.url + "/v1/chat/completions/input_tokens", json={"messages": [{"role": "user", "content": Q}],
                   "tools": [{"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}}]}, timeout=60)
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    assert r.json()["input_tokens"] == c.json()["input_tokens"]


def test_a_final_assistant_message_is_continued(claude, server):
    convo = [{"role": "user", "content": "Tell me a story."}]
    m = claude.messages.create(model="any", max_tokens=10, messages=convo + [
        {"role": "assistant", "content": "Once upon a time"}], **GREEDY)
    prompt = httpx.post(server.url + "/apply-template", json={"messages": convo}, timeout=60).json()["prompt"]
    ids = httpx.post(server.url + "/tokenize", json={"content": prompt + "Once upon a time",
                                                                   "add_special": True}, timeout=60).json()
    r = httpx.post(server.url + "/completion", json={"prompt": ids["tokens"], "n_predict": 10, "temperature": 0},
                   timeout=60).json()
    assert text_of(m) == r["content"] and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids["tokens"])


def test_stop_sequences_and_count_tokens(claude, server):
    kw = dict(model="any", max_tokens=30, messages=[{"role": "user", "content": "Tell me a story."}], **GREEDY)
    whole = text_of(claude.messages.create(**kw))
    word = whole.split()[3]
    m = claude.messages.create(stop_sequences=["no such words", word], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word and whole.startswith(text_of(m))
    for extra in ({}, {"tools": [ADD]}):
        n = claude.messages.count_tokens(model="any", messages=kw["messages"], **extra).input_tokens
        u = claude.messages.create(max_tokens=1, model="any", messages=kw["messages"], **extra, **GREEDY).usage
        assert n == u.input_tokens + u.cache_read_input_tokens
    # a stop sequence that matches the call's own markup (the newline after <tool_call>) cuts the call before its
    # name: no tool_use block with an empty name (the client would send it back as a call to no tool), and the
    # forced call that never came is said to be cut (max_tokens), not a normal stop
    m = claude.messages.create(model="any", max_tokens=30, messages=[{"role": "user", "content": Q}], tools=[ADD],
                               tool_choice={"type": "any"}, stop_sequences=["\n"], **GREEDY)
    assert m.stop_reason == "max_tokens" and all(b.type != "tool_use" or b.name for b in m.content), m


def test_structured_output_by_output_config(claude, server):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    m = claude.messages.create(model="any", max_tokens=60, messages=[{"role": "user", "content": Q}],
                               output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(text_of(m)), schema)
    c = chat(server, [{"role": "user", "content": Q}], max_tokens=60,
             response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert text_of(m) == c["choices"][0]["message"]["content"]
    # the structured-outputs beta's name for it (it used to be ignored: free text)
    beta = httpx.post(server.url + "/v1/messages", timeout=60, headers={"anthropic-beta": "structured-outputs-2025-11-13"},
                      json={"model": "any", "max_tokens": 60, "messages": [{"role": "user", "content": Q}],
                            "output_format": {"type": "json_schema", "schema": schema}, "temperature": 0}).json()
    assert beta["content"][0]["text"] == text_of(m)


@pytest.mark.parametrize("extra", [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                                                                             "image/png", "data": "AAAA"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]},
    {"messages": [{"role": "system", "content": "hi"}]},
    # a tool_result answers a tool_use of the message just before it (Anthropic's 400; it was answered)
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]},
    {"messages": [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]},
                  {"role": "assistant", "content": "ok"},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},   # a text block without its text
    {"messages": []},
    {"thinking": {"type": "enabled"}},                               # enabled needs its budget
    {"thinking": {"type": "enabled", "budget_tokens": -1}},
    {"thinking": {"type": "enabled", "budget_tokens": "1024"}},
    {"thinking": {"type": "adaptive", "budget_tokens": 1024}},       # adaptive takes none (Anthropic's 400)
    {"thinking": {"type": "on"}},
    {"thinking": {"type": "adaptive", "display": "full"}},
    {"thinking": {"type": "adaptive"}, "tools": [ADD], "tool_choice": {"type": "any"}},   # as Anthropic refuses
    {"thinking": {"type": "adaptive"}, "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "Well"}]},   # with a prefill
    # a final assistant message of a thought alone is a prefill too (its thought was dropped, in silence)
    {"thinking": {"type": "adaptive"}, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                    "content": [{"type": "thinking", "thinking": "Hmm."}]}]},
    {"reasoning_effort": "none"},                                     # an OpenAI chat field, not this API's
    {"output_config": {"effort": "high"}},
    {"output_config": {"format": {"type": "json_object"}}},
    {"output_format": {"type": "json_object"}},
    {"output_format": {"type": "json_schema", "schema": {}}, "output_config": {"format": {"type": "json_schema",
                                                                                         "schema": {}}}},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tools": [ADD], "tool_choice": {"type": "tool"}},
    {"tools": [ADD], "tool_choice": {"type": "sometimes"}},
    {"tool_choice": {"type": "any"}},
    {"container": "c1"},
    {"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}]},
    {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
    {"temperature": 1.5},
    {"max_tokens": None},
    # a field this API does not have: Anthropic's "Extra inputs are not permitted" (a misspelt stop_sequence ran
    # on to max_tokens in silence; logprobs gave none)
    {"stop_sequence": ["x"]},
    {"max_completion_tokens": 3},
    {"logprobs": True, "top_logprobs": 2},
    {"speed": "fast"},
    # what Anthropic's API refuses (each was answered): empty or blank content, a tool_use its next message does
    # not answer, tool blocks without tools, unknown keys inside its objects, an unknown tier, a tool name it
    # cannot call, an empty stop sequence, no model, a prefill ending in whitespace
    {"messages": [{"role": "user", "content": ""}]},
    {"messages": [{"role": "user", "content": " \n"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "hi"}]},
    {"tools": [ADD], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "add", "input": {}}]}, {"role": "user", "content": "just text"}]},
    {"messages": [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]}]},
    {"output_config": {"foo": 1}},
    {"metadata": {"foo": "bar"}},
    {"tools": [ADD], "tool_choice": {"type": "auto", "foo": 1}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]},
    {"service_tier": "bogus"},
    {"tools": [{"name": "f f!", "input_schema": {"type": "object"}}]},
    {"stop_sequences": [""]},
    {"model": None},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well "}]},
])
def test_what_cannot_be_honoured_is_a_400_in_anthropics_shape(server, extra):
    body = {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert "'required'" not in err["error"]["message"]   # OpenAI's word for Anthropic's "any"


def test_x_api_key_is_a_key():
    s = Server("--api-key", "sekrit", "--parallel", "2")
    try:
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekrit", max_retries=0, timeout=60)
        assert ok.messages.create(model="any", max_tokens=2, messages=[{"role": "user", "content": "hi"}]).content
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="any", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(s.url + "/v1/chat/completions", headers={"x-api-key": "sekrit"}, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200   # the same key, sent as Anthropic's clients send it, on any endpoint
    finally:
        s.stop()


def test_models_list_reads_in_both_clients(claude, server):
    """/v1/models answers Anthropic's client (type, display_name, created_at, pages) and OpenAI's alike."""
    models = claude.models.list()
    (m,) = models.data
    openai_id = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    assert m.id == openai_id and m.type == "model" and m.display_name == openai_id and m.created_at.year >= 2026
    assert models.has_more is False
    assert claude.models.retrieve(m.id).display_name == m.display_name   # GET /v1/models/{id}


def test_errors_name_the_fields_as_anthropics_api_does(server):
    """A tool's schema that cannot be enforced is named tools.N.input_schema (the client's field), not the chat
    pipeline's tools[N].function.parameters. An input_schema that is not an object's is refused as Anthropic's
    API refuses it (a string's arguments came back as tool_use input {}, the arguments lost)."""
    unique = {"type": "object", "properties": {"u": {"type": "array", "uniqueItems": True}}}
    for schema in (unique, {"type": "string"}, {"type": "array", "items": {"type": "boolean"}},
                   {"anyOf": [{"type": "string"}, {"type": "integer"}]}):
        bad = {"name": "x", "input_schema": schema}
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "tools": [ADD, bad]}
            if path == "/v1/messages":
                body = {**body, "max_tokens": 4, "tool_choice": {"type": "any"}}
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "tools.1.input_schema" in err["message"] and "function.parameters" not in err["message"], err



@pytest.mark.parametrize("tool, field", [({"input_schema": ADD_SCHEMA}, "tools.0.name"),
                                         ({"name": 5, "input_schema": ADD_SCHEMA}, "tools.0.name"),
                                         ({"name": "add"}, "tools.0.input_schema"),
                                         ({"name": "add", "input_schema": None}, "tools.0.input_schema")])
def test_a_custom_tool_s_missing_field_is_named(server, tool, field):
    """A custom tool without its name (or input_schema) is a 400 naming that field, as Anthropic's API answers: a
    missing name was blamed on the tool's type ("only custom tools ... not 'custom'"), a missing input_schema taken."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
        r = httpx.post(server.url + path, json={**body, "max_tokens": 4} if path == "/v1/messages" else body,
                       timeout=60)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(field + ":") and "custom" not in message, message


def test_count_tokens_refuses_what_messages_refuses(server):
    """thinking with a forced tool use is Anthropic's 400 on both endpoints."""
    body = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "tools": [ADD],
            "tool_choice": {"type": "any"}, "thinking": {"type": "adaptive"}}
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(server.url + path, json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)


def test_the_apis_hints_are_taken(server):
    """Anthropic's fields that mean nothing on one local server (the account's ids, tiers, regions, the automatic
    cache) are taken, as its API takes them, beside the refusal of unknown ones; count_tokens too."""
    hints = {"metadata": {"user_id": "u"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"},
             "inference_geo": "us", "speed": "standard"}
    body = {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **hints}
    assert httpx.post(server.url + "/v1/messages", json=body, timeout=60).status_code == 200
    count = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(server.url + "/v1/messages/count_tokens", json={**count, "cache_control": {"type": "ephemeral"}},
                      timeout=60).status_code == 200
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={**count, "stop_sequence": ["x"]}, timeout=60)
    assert r.status_code == 400 and "stop_sequence" in r.json()["error"]["message"], r.text


def test_consecutive_turns_of_one_role_are_one_turn(claude, server):
    """Consecutive user (or assistant) messages are one turn, their blocks in order, as Anthropic's API combines
    them: two user messages were two turns of the template, and two final assistant messages a finished answer
    and a prefill of the second's text only."""
    def count(messages):
        return claude.messages.count_tokens(model="any", messages=messages).input_tokens
    two = [{"role": "user", "content": "Tell me"}, {"role": "user", "content": [{"type": "text", "text": " a story."}]}]
    one = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " a story."}]}]
    assert count(two) == count(one)
    u = [{"role": "user", "content": "Hello there"}]
    split = u + [{"role": "assistant", "content": "Hello!"}, {"role": "assistant", "content": " I"}]
    whole = u + [{"role": "assistant", "content": "Hello! I"}]
    assert count(split) == count(whole)
    a, b = (claude.messages.create(model="any", max_tokens=8, messages=m, **GREEDY) for m in (split, whole))
    assert text_of(a) == text_of(b) and a.usage.input_tokens + a.usage.cache_read_input_tokens == count(whole)


def test_refusals_say_what_anthropics_api_says(server):
    """The 400s Anthropic's API answers, in its words, on /v1/messages and count_tokens alike."""
    hi = [{"role": "user", "content": "hi"}]
    cases = [({"messages": hi + [{"role": "assistant", "content": "Well "}]},
              "final assistant content cannot end with trailing whitespace"),
             ({"messages": hi + [{"role": "assistant", "content": "Well"}, {"role": "assistant", "content": " \n"}]},
              "final assistant content cannot end with trailing whitespace"),
             ({"messages": [{"role": "user", "content": "  "}]},
              "text content blocks must contain non-whitespace text"),
             ({"tools": [ADD], "messages": hi + [{"role": "assistant", "content": [
                 {"type": "tool_use", "id": "t1", "name": "add", "input": {}}]}, {"role": "user", "content": "x"}]},
              "messages.2: `tool_use` ids were found without `tool_result` blocks immediately after: t1"),
             ({"messages": hi + [{"role": "assistant", "content": [
                 {"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]}]},
              "Requests which include `tool_use` or `tool_result` blocks must define tools."),
             ({"output_config": {"foo": 1}}, "output_config.foo: Extra inputs are not permitted"),
             ({"metadata": {"user_id": "u", "foo": 1}}, "metadata.foo: Extra inputs are not permitted"),
             ({"tools": [ADD], "tool_choice": {"type": "auto", "foo": 1}},
              "tool_choice.foo: Extra inputs are not permitted"),
             ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]},
              "messages.0.content.0.foo: Extra inputs are not permitted"),
             ({"tools": [{"name": "f f!", "input_schema": {"type": "object"}}]}, "tools.0.name: String should match"),
             ({"model": None}, "model: Field required")]

    def loop(result, **tool):   # a tool use and the user's tool_result block for it
        use = {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}}
        return {"tools": [{**ADD, **tool}], "messages": hi + [{"role": "assistant", "content": [use]},
                                                             {"role": "user", "content": [
                                                                 {"type": "tool_result", "tool_use_id": "t1",
                                                                  **result}]}]}
    # booleans are JSON's own (a string or a number was read by its truthiness: "no" disabled parallel calls,
    # "false" marked a result as an error), and the keys inside a tool, a tool_result (and its text blocks),
    # output_config.format and each tool_choice type are Anthropic's (any other was ignored)
    cases += [({"tools": [ADD], "tool_choice": {"type": "any", "disable_parallel_tool_use": "no"}},
               "tool_choice.disable_parallel_tool_use: Input should be a valid boolean"),
              ({"tools": [ADD], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}},
               "tool_choice.disable_parallel_tool_use: Input should be a valid boolean"),
              (loop({"content": "3", "is_error": "false"}), "messages.2.content.0.is_error: Input should be a valid "
                                                             "boolean"),
              (loop({"content": "3", "foo": 1}), "messages.2.content.0.foo: Extra inputs are not permitted"),
              (loop({"content": [{"type": "text", "text": "3", "foo": 1}]}),
               "messages.2.content.0.content.0.foo: Extra inputs are not permitted"),
              (loop({"content": "3"}, foo=1), "tools.0.foo: Extra inputs are not permitted"),
              ({"output_config": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
               "output_config.format.name: Extra inputs are not permitted"),
              ({"output_format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
               "output_format.name: Extra inputs are not permitted"),
              ({"tools": [ADD], "tool_choice": {"type": "auto", "name": "add"}},
               "tool_choice.name: Extra inputs are not permitted"),
              ({"tools": [ADD], "tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
               "tool_choice.disable_parallel_tool_use: Extra inputs are not permitted")]
    for extra, said in cases:
        body = {k: v for k, v in {"model": "any", "messages": hi, **extra}.items() if v is not None}
        for path, more in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
            r = httpx.post(server.url + path, json={**body, **more}, timeout=60)
            assert r.status_code == 400 and said in r.json()["error"]["message"], (path, extra, r.text)
    # what it takes: a whitespace answer of the model's own in a history, a tool loop whose uses are all answered
    ok = hi + [{"role": "assistant", "content": "\n\n"}, {"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "any", "messages": ok}, timeout=60)
    assert r.status_code == 200, r.text
    # and Anthropic's own keys in those objects, booleans as booleans
    for extra in (loop({"content": [{"type": "text", "text": "3", "cache_control": {"type": "ephemeral"}}],
                        "is_error": False, "cache_control": {"type": "ephemeral"}},
                       input_examples=[{"a": 1, "b": 2}], cache_control={"type": "ephemeral"}, strict=True),
                  {"tools": [ADD], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
                  {"tools": [ADD], "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": False}},
                  {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}):
        r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "any", "messages": hi, **extra},
                       timeout=60)
        assert r.status_code == 200, (extra, r.text)


def test_models_errors_in_anthropics_shape_for_its_client():
    """/v1/models answers Anthropic's client (it sends anthropic-version) in Anthropic's error shape: a bad key
    and an unknown model (--strict-model-name) came in OpenAI's, which the client reads as a bare status."""
    s = Server("--api-key", "sekrit", "--strict-model-name", "--parallel", "1")
    try:
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": e.value.body["error"]["message"]}}
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekrit", max_retries=0, timeout=60)
        with pytest.raises(anthropic.NotFoundError) as e:
            ok.models.retrieve("no-such-model")
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error", e.value.body
        # OpenAI's clients send no anthropic-version: their shape stays
        r = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    finally:
        s.stop()
