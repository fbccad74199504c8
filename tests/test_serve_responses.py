"""OpenAI's Responses API on `bitnet serve` (POST /v1/responses, serve/responses.py), driven by the official openai
client against a real subprocess on 127.0.0.1 with the bundled model. The endpoint is a translation over the chat
pipeline, so each answer is checked against /v1/chat/completions given the same conversation (greedy: the same
text, tokens, calls and logprobs), the stream through the client's own event accumulator
(`client.responses.stream`, which checks item identities and order), and every field a local server cannot honour
comes back as a 400 naming it."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install .[test])")
jsonschema = pytest.importorskip("jsonschema", reason="the structured-output checks need jsonschema (pip install .[test])")
pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
from serve_proc import sse_events  # noqa: E402

SERVER_ARGS = ("--parallel", "4")   # conftest's server fixture
Q = "What is 12+7?"
ADD_PARAMS = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ADD = {"type": "function", "name": "add", "description": "add two integers", "parameters": ADD_PARAMS}
ADD_CHAT = {"type": "function", "function": {"name": "add", "description": "add two integers",
                                             "parameters": ADD_PARAMS}}


def events_of(server, body):
    return sse_events(server.url, "/v1/responses", body)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="any", messages=messages, temperature=0, **kw)


def test_text_answer_is_the_chat_answer(client):
    r = client.responses.create(model="any", input=Q, temperature=0, max_output_tokens=40)
    c = chat(client, [{"role": "user", "content": Q}], max_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed" and r.store is False
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "completed"
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.tool_choice == "auto" and r.text.format.type == "text"


def test_instructions_and_roles_are_chat_messages(client):
    r = client.responses.create(model="any", instructions="Be brief.", temperature=0, max_output_tokens=30,
                                input=[{"role": "developer", "content": "Answer in words."},
                                       {"role": "user", "content": [{"type": "input_text", "text": "What is"},
                                                                    {"type": "input_text", "text": "2+2?"}]}])
    c = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in words."},
                      {"role": "user", "content": "What is\n2+2?"}], max_tokens=30)   # parts: a newline between
    assert r.output_text == c.choices[0].message.content and r.instructions == "Be brief."


def test_earlier_output_items_go_back_as_input(client):
    """The client's way of a conversation without stored state: the last output items appended to the input."""
    first = client.responses.create(model="any", input=Q, temperature=0, max_output_tokens=20)
    items = [{"role": "user", "content": Q}] + [o.model_dump(exclude_none=True) for o in first.output] + \
            [{"role": "user", "content": "And 3+4?"}]
    r = client.responses.create(model="any", input=items, temperature=0, max_output_tokens=20)
    c = chat(client, [{"role": "user", "content": Q}, {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And 3+4?"}], max_tokens=20)
    assert r.output_text == c.choices[0].message.content


def test_stream_through_the_clients_accumulator(client, server):
    whole = client.responses.create(model="any", input=Q, temperature=0, max_output_tokens=40)
    with client.responses.stream(model="any", input=Q, temperature=0, max_output_tokens=40) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") >= 2 and final.usage.output_tokens == whole.usage.output_tokens
    raw = events_of(server, {"input": Q, "temperature": 0, "max_output_tokens": 40})
    assert [d["sequence_number"] for _, d in raw] == list(range(len(raw)))
    assert all(kind == d["type"] for kind, d in raw)
    assert "".join(d["delta"] for k, d in raw if k == "response.output_text.delta") == whole.output_text
    done = [d for k, d in raw if k == "response.output_text.done"]
    assert [d["text"] for d in done] == [whole.output_text]


def test_cut_at_max_output_tokens_is_incomplete(client, server):
    r = client.responses.create(model="any", input="Tell me a long story.", temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"
    raw = events_of(server, {"input": "Tell me a long story.", "temperature": 0, "max_output_tokens": 5})
    assert raw[-1][0] == "response.incomplete" and raw[-1][1]["response"]["output"][0]["content"][0]["text"] == \
        r.output_text


def test_function_calls_and_their_results(client):
    r = client.responses.create(model="any", input=Q, tools=[ADD], tool_choice="required", temperature=0)
    c = chat(client, [{"role": "user", "content": Q}], tools=[ADD_CHAT], tool_choice="required")
    calls = [o for o in r.output if o.type == "function_call"]
    want = c.choices[0].message.tool_calls
    assert calls and [(x.name, x.arguments) for x in calls] == [(w.function.name, w.function.arguments) for w in want]
    for x in calls:
        jsonschema.validate(json.loads(x.arguments), ADD_PARAMS)
        assert x.call_id.startswith("call_") and x.id.startswith("fc_") and x.status == "completed"
    assert r.status == "completed" and r.tool_choice == "required"
    with client.responses.stream(model="any", input=Q, tools=[ADD], tool_choice={"type": "function", "name": "add"},
                                 temperature=0) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    # a named choice is one call: the first of "required"'s (the same grammar up to its end, so the same tokens)
    assert [(o.name, o.arguments) for o in streamed.output if o.type == "function_call"] == \
        [(x.name, x.arguments) for x in calls[:1]]
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    # the result goes back as a function_call_output item: the chat answer to the same history
    back = [{"role": "user", "content": Q}] + [x.model_dump(exclude_none=True) for x in calls] + \
           [{"type": "function_call_output", "call_id": x.call_id, "output": "19"} for x in calls]
    r2 = client.responses.create(model="any", input=back, tools=[ADD], temperature=0, max_output_tokens=30)
    history = [{"role": "user", "content": Q},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": x.call_id, "type": "function",
                                "function": {"name": x.name, "arguments": x.arguments}} for x in calls]}] + \
              [{"role": "tool", "tool_call_id": x.call_id, "name": x.name, "content": "19"} for x in calls]
    c2 = chat(client, history, tools=[ADD_CHAT], max_tokens=30)
    assert r2.output_text == (c2.choices[0].message.content or "")
    # an item whose name is "" (what an older server returned for a call cut before its name) is history as on
    # the chat endpoint, not a 400
    nameless = [{"role": "user", "content": Q}, {"type": "function_call", "call_id": "c9", "name": "",
                                                   "arguments": ""},
                {"type": "function_call_output", "call_id": "c9", "output": "?"}]
    assert client.responses.create(model="any", input=nameless, tools=[ADD], max_output_tokens=2).output is not None


@pytest.mark.parametrize("stop", ['"b"', ', "'])   # inside the arguments; before they began (arguments "")
def test_a_call_cut_by_a_stop_string_is_incomplete(client, server, stop):
    """A stop string inside a call cuts it as max_output_tokens does: the response is incomplete and its stream
    ends with response.incomplete, as the chat endpoint says length for it (it said completed: an agent loop that
    checks the status ran a call with arguments "" or '{"a": 12, ')."""
    kw = dict(input=Q, tools=[ADD], tool_choice="required", temperature=0, max_output_tokens=100)
    c = chat(client, [{"role": "user", "content": Q}], tools=[ADD_CHAT], tool_choice="required", max_tokens=100,
             stop=[stop])
    assert c.choices[0].finish_reason == "length" and c.choices[0].message.tool_calls
    r = client.responses.create(model="any", extra_body={"stop": [stop]}, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert calls and calls[-1].status == "incomplete"
    assert calls[-1].arguments == c.choices[0].message.tool_calls[-1].function.arguments
    raw = events_of(server, {**kw, "stop": [stop]})
    assert raw[-1][0] == "response.incomplete" and raw[-1][1]["response"]["status"] == "incomplete"
    assert "response.completed" not in [k for k, _ in raw]

def test_structured_output_by_text_format(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["apples", "pears"]}},
              "required": ["answer", "unit"], "additionalProperties": False}
    r = client.responses.create(model="any", input=Q, temperature=0, max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    c = chat(client, [{"role": "user", "content": Q}], max_tokens=80,
             response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert r.output_text == c.choices[0].message.content
    from pydantic import BaseModel

    class Sum(BaseModel):
        total: int
    parsed = client.responses.parse(model="any", input=Q, text_format=Sum, temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Sum)
    obj = client.responses.create(model="any", input="Reply in JSON.", temperature=0, max_output_tokens=60,
                                  text={"format": {"type": "json_object"}})
    c = chat(client, [{"role": "user", "content": "Reply in JSON."}], max_tokens=60,
             response_format={"type": "json_object"})
    assert obj.output_text == c.choices[0].message.content and obj.output_text.startswith("{")
    if obj.status == "completed":   # a string of the small model may run to max_output_tokens
        assert isinstance(json.loads(obj.output_text), dict)


def test_logprobs_are_the_chat_logprobs(client, server):
    kw = dict(temperature=0, max_output_tokens=8)
    r = client.responses.create(model="any", input="Hi", include=["message.output_text.logprobs"], top_logprobs=3, **kw)
    c = chat(client, [{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=3, max_tokens=8)
    got = r.output[0].content[0].logprobs
    want = c.choices[0].logprobs.content
    assert [(x.token, x.logprob, x.bytes) for x in got] == [(w.token, w.logprob, w.bytes) for w in want]
    assert [[t.token for t in x.top_logprobs] for x in got] == [[t.token for t in w.top_logprobs] for w in want]
    assert all(len(x.top_logprobs) == 3 for x in got)
    raw = events_of(server, {"input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3,
                             "temperature": 0, "max_output_tokens": 8})
    streamed = [e for k, d in raw if k == "response.output_text.delta" for e in d["logprobs"]]
    assert [(e["token"], e["logprob"]) for e in streamed] == [(x.token, x.logprob) for x in got]
    plain = client.responses.create(model="any", input="Hi", **kw)
    assert not plain.output[0].content[0].logprobs


def test_text_before_a_call_keeps_its_own_tokens_logprobs():
    """The builder of the Responses output (serve/responses.py) with the Hermes call parser: text then a call, fed
    one token at a time (a stream) or several tokens at once (drafts, a whole answer): the message's logprobs are
    the tokens of its text, never the call's (a whole answer gave the text every token of the call)."""
    from types import SimpleNamespace

    from bitnet_cpu.engine.runtime.sampling import SamplingParams
    from bitnet_cpu.engine.runtime.tools import HermesParser
    from bitnet_cpu.serve.responses import ResponseBuilder, ResponsesRequest

    tokens = ["Let", " me", " add", ".", " ", "<tool_call>", '\n{"name": "add", ', '"arguments": {"a": 1, "b": 2}}',
              "\n</tool_call>"]
    entry = lambda t, lp: {"token": t, "bytes": list(t.encode()), "logprob": lp}   # noqa: E731

    def built(pieces):
        b = ResponseBuilder(ResponsesRequest(input="hi"), "m", SamplingParams(), parser=HermesParser(), entry=entry)
        b.start()
        for piece in pieces:
            b.feed("".join(piece), [(t, -1.0) for t in piece], len(piece))
        b.finish(SimpleNamespace(finish_reason="stop", stats=None),
                 {"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": 1 + len(tokens)})
        out = b.result()["output"]
        assert [o["type"] for o in out] == ["message", "function_call"], out
        return out[0]["content"][0]

    for pieces in ([[t] for t in tokens], [tokens], [tokens[:3], tokens[3:]], [tokens[:6], tokens[6:]]):
        part = built(pieces)
        assert part["text"].strip() == "Let me add.", part
        assert "".join(x["token"] for x in part["logprobs"]) == part["text"], (pieces, part)


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    # an agent loop's second turn: the output answers a call of the stored response, so the cause is that
    ({"previous_response_id": "resp_1", "input": [{"type": "function_call_output", "call_id": "call_1",
                                                   "output": "sunny"}]}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"include": ["no.such.thing"]}, "include[0]"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [ADD], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    # an allowed list naming tools that are not there, with no tools at all (mode auto was answered 200)
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]}},
     "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "1"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"n": 2}, "n"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning"),
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, "input[0].call_id"),
    ({"temperature": 3}, "temperature"),
    # named as the client wrote them (Responses tools are flat: tools[1].name, not the chat shape's path)
    ({"tools": [ADD, ADD]}, "tools[1].name"),
    # a field this API does not have (a misspelt one, a chat-only one): OpenAI's "Unknown parameter", never silence
    ({"logprobs": True}, "logprobs"),
    ({"stop_sequences": ["x"]}, "stop_sequences"),
    ({"max_completion_tokens": 3}, "max_completion_tokens"),
    ({"max_tokens": 3}, "max_tokens"),   # the chat endpoint's: it was taken, and max_output_tokens won in silence
    # at least 1 (OpenAI's own minimum is 16): 0 gave an empty incomplete response, output [] (clients read output[0])
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": -2}, "max_output_tokens"),   # (-1 is llama-server's "to the context's end")
    ({"image": {"size": "auto"}}, "image"),
    # keys nested in OpenAI's objects are checked as the top level's are (they were ignored; text.format's echoed)
    ({"reasoning": {"foo": "bar"}}, "reasoning.foo"),
    ({"text": {"foo": 1}}, "text.foo"),
    ({"text": {"format": {"type": "json_object", "foo": 1}}}, "text.format.foo"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"service_tier": "bogus"}, "service_tier"),
    ({"metadata": {"a": {"b": 1}}}, "metadata.a"),   # OpenAI's metadata: string values, 16 keys, 64 / 512 chars
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"a": "v" * 513}}, "metadata"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, extra, param):
    body = {"model": "any", "input": "Hi", "max_output_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    if "previous_response_id" in extra:   # the token count says the same
        r = httpx.post(server.url + "/v1/responses/input_tokens", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("choice, param, words", [
    ({"type": "allowed_tools", "mode": "never", "tools": [{"type": "function", "name": "add"}]}, "tool_choice.mode",
     'tool_choice.mode "never": expected auto or required'),
    ({"type": "allowed_tools", "tools": [{"type": "function", "name": "add"}]}, "tool_choice.mode",
     "tool_choice.mode null: expected auto or required"),
    ({"type": "function"}, "tool_choice.name", "tool_choice.name: required"),
    ({"type": "web_search_preview", "search_context_size": "high" * 30}, "tool_choice",
     'tool_choice.type "web_search_preview": expected'),
])
def test_a_bad_tool_choice_names_its_field(server, choice, param, words):
    """The 400 for a tool_choice object names the key that is wrong (a bad allowed_tools mode said the whole
    object, cut mid-JSON, and listed allowed_tools, what was sent, as accepted)."""
    body = {"input": "Hi", "max_output_tokens": 4, "tools": [ADD], "tool_choice": choice}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == param and words in e["message"], r.text
    assert "high" not in e["message"], e

def test_names_follow_openais_pattern(server):
    """A tool's name and a format's name are OpenAI's ^[a-zA-Z0-9_-]{1,64}$ on its endpoints, a 400 naming the
    field (OpenAI refuses "a b" or "x</tool_call>y"; they were taken here), and any such name is taken."""
    obj = {"type": "object"}
    fmt = {"type": "json_schema", "schema": obj}
    hi = [{"role": "user", "content": "Hi"}]
    for bad in ("a b", "x</tool_call>y", "x" * 65, "", "n\u00e4me"):
        chat_tool = {"type": "function", "function": {"name": bad, "parameters": obj}}
        for path, body, param in (
                ("/v1/responses", {"tools": [{**ADD, "name": bad}]}, "tools[0].name"),
                ("/v1/responses", {"tools": [ADD_CHAT, chat_tool]}, "tools[1].function.name"),
                ("/v1/responses", {"text": {"format": {**fmt, "name": bad}}}, "text.format.name"),
                ("/v1/chat/completions", {"tools": [chat_tool]}, "tools[0].function.name"),
                ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
                    "name": bad, "schema": obj}}}, "response_format.json_schema.name")):
            body = {**body, **({"messages": hi, "max_tokens": 1} if "chat" in path else
                               {"input": "Hi", "max_output_tokens": 1})}
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, bad, r.text)
            assert "^[a-zA-Z0-9_-]{1,64}$" in r.json()["error"]["message"], r.text
    good = "Get_weather-2" + "x" * 51
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "Hi", "max_output_tokens": 1, "tools": [{**ADD, "name": good}],
        "text": {"format": {**fmt, "name": good}}})
    assert r.status_code == 200, r.text

def test_input_longer_than_the_context_is_a_400(server):
    r = httpx.post(server.url + "/v1/responses", json={"input": "word " * 20000, "max_output_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "input"
    # one that passes the body's bound and overflows once tokenized: OpenAI's sentence, naming the field sent
    r = httpx.post(server.url + "/v1/responses", json={"input": "7 + 8 = 15. " * 400, "max_output_tokens": 4},
                   timeout=60)
    e = r.json()["error"]
    assert r.status_code == 400 and e["code"] == "context_length_exceeded" and e["param"] == "input", r.text
    assert "However, your input resulted in" in e["message"], e


@pytest.mark.parametrize("extra, param, words", [
    # one message object, or a number, for input: it said "Input should be a valid string" (the union's first type)
    ({"input": {"role": "user", "content": "Hi"}}, "input", "a string or a list of input items"),
    ({"input": 5}, "input", "a string or a list of input items"),
    # pydantic said "Unable to parse input string as an integer, exceeded maximum size" of a number
    ({"max_output_tokens": 1e30}, "max_output_tokens", "an integer within range"),
])
def test_bad_values_are_said_as_the_field_takes_them(server, extra, param, words):
    r = httpx.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 4, **extra}, timeout=60)
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == param and words in e["message"], r.text


def test_stored_responses_are_a_404_saying_why(client, server):
    """Nothing is stored: retrieving, deleting or cancelling an earlier response says so (the client's own
    NotFoundError), instead of a bare 404 for an unknown path."""
    r = client.responses.create(model="any", input="Hi", temperature=0, max_output_tokens=2)
    r_id = r.id
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.cancel(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "not stored" in e.value.body["message"] and e.value.body["param"] == "response_id"
    # without the /v1 prefix too, as POST /responses is served (a client whose base URL has none got a bare 404)
    for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
        r = httpx.request(method, f"{server.url}/responses/{r_id}{suffix}", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_stored", (method, suffix, r.text)
    # compaction (codex-like clients): a 400 saying why, not a bare 405
    r = httpx.post(str(client.base_url).rstrip("/") + "/responses/compact", json={"model": "any", "input": "Hi"},
                   timeout=60)
    assert r.status_code == 400 and "compact" in r.json()["error"]["message"], r.text


def test_input_token_counts_are_the_prompts_that_run(client, server):
    """`client.responses.input_tokens.count(...)` (OpenAI's) and llama-server's /v1/chat/completions/input_tokens:
    the input tokens the same request reports in its usage once run (instructions, roles and tools included)."""
    for kw in ({"input": Q}, {"input": Q, "instructions": "Be brief.", "tools": [ADD]},
               {"input": [{"role": "developer", "content": "Answer in words."}, {"role": "user", "content": Q}]}):
        n = client.responses.input_tokens.count(model="any", **kw)
        assert n.object == "response.input_tokens"
        assert n.input_tokens == client.responses.create(model="any", temperature=0, max_output_tokens=1,
                                                         **kw).usage.input_tokens, kw
    for extra in ({}, {"tools": [ADD_CHAT]}):
        body = {"model": "any", "messages": [{"role": "user", "content": Q}], **extra}
        r = httpx.post(server.url + "/v1/chat/completions/input_tokens", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["object"] == "response.input_tokens", r.text
        assert r.json()["input_tokens"] == chat(client, body["messages"], max_tokens=1, **extra).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:   # what a stored-nothing server cannot honour: a 400 naming it
        client.responses.input_tokens.count(model="any", input=Q, previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "not stored" in e.value.message


def test_the_apis_hints_are_taken(server):
    """OpenAI's fields that mean nothing on one local server (caches, tiers, the account's ids) are taken, as
    OpenAI takes them, beside the refusal of unknown ones."""
    body = {"model": "any", "input": "Hi", "max_output_tokens": 4, "prompt_cache_key": "k", "safety_identifier": "s",
            "prompt_cache_retention": "24h", "service_tier": "auto", "store": False, "metadata": {"a": "b"},
            "user": "u", "top_k": 5, "seed": 3}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_the_answer_echoes_the_reasoning_asked_for(server):
    """reasoning.effort "none" is honoured (a thinking template does not think), and the answer says so, as
    OpenAI's echoes the request's reasoning (it said effort null whatever was sent)."""
    body = {"model": "any", "input": "Hi", "max_output_tokens": 2, "temperature": 0}
    for reasoning, echo in ((None, {"effort": None, "summary": None}), ({"effort": "none"},
                                                                        {"effort": "none", "summary": None})):
        r = httpx.post(server.url + "/v1/responses", json={**body, "reasoning": reasoning}, timeout=60)
        assert r.status_code == 200 and r.json()["reasoning"] == echo, r.text


def test_an_empty_answer_is_still_a_message(server):
    """A stop string at the answer's very start: the output is one message of empty text, streamed with its events
    (it was `output: []`, with no output item at all), as the chat endpoint gives content ""."""
    import json
    body = {"model": "any", "input": "Hi", "max_output_tokens": 8, "temperature": 0}
    first = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    text = first["output"][-1]["content"][0]["text"]
    assert text[:3].strip()
    r = httpx.post(server.url + "/v1/responses", json={**body, "stop": [text[:3]]}, timeout=60).json()
    assert [(o["type"], o["content"][0]["text"]) for o in r["output"]] == [("message", "")], r["output"]
    kinds = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stop": [text[:3]], "stream": True},
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                kinds.append(json.loads(line[6:])["type"])
    assert "response.output_item.added" in kinds and kinds.index("response.output_text.done") < len(kinds) - 1
