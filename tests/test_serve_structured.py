"""Structured output through `bitnet serve` (a real subprocess on 127.0.0.1, the bundled model), driven by the
official `openai` client: response_format json_object / json_schema, llama-server's `json_schema` and `grammar`
fields, streaming == non-streaming, 16 at once, the client's own pydantic `parse` helper, and 400s naming the
field for what cannot be enforced (the pool is left as it was)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install .[test])")
pydantic = pytest.importorskip("pydantic")


ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "qty", "unit"],
        "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                       "unit": {"enum": ["kg", "g", "pcs"]}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "items"],
         "$defs": {"item": ITEM},
         "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/item"}}}}
Q = [{"role": "user", "content": "Give me an order as JSON."}]
HOT = dict(temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "min_p": 0.0})


def _fmt(schema, name="order"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_stream_and_not(client, model_id, stream):
    kw = dict(model=model_id, messages=Q, response_format=_fmt(ORDER), max_tokens=300, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
        alone = client.chat.completions.create(**kw).choices[0].message.content
        assert text == alone
    else:
        r = client.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), ORDER)


def test_sixteen_at_once_sampled(client, model_id):
    def one(i):
        r = client.chat.completions.create(model=model_id, messages=Q, response_format=_fmt(ORDER), max_tokens=300,
                                           seed=i, **HOT)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), ORDER)


def test_json_object_and_completions_endpoint(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=Q, response_format={"type": "json_object"},
                                       max_tokens=200, seed=1, **HOT)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=model_id, prompt="Order:", max_tokens=300, temperature=0,
                                  extra_body={"response_format": _fmt(ORDER)})
    jsonschema.validate(json.loads(r.choices[0].text), ORDER)


def test_llama_server_fields(server):
    body = {"messages": Q, "max_tokens": 300, "temperature": 0, "json_schema": ITEM}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), ITEM)
    body = {"messages": Q, "max_tokens": 40, "temperature": 1.0, "seed": 3, "grammar": 'root ::= ("yes" | "no") "." '}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"(yes|no)\.", r.json()["choices"][0]["message"]["content"])
    body = {"messages": Q, "max_tokens": 300, "temperature": 0, "response_format": {"type": "json_object", "schema": ITEM}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), ITEM)


def test_openai_parse_helper_with_pydantic(client, model_id):
    from typing import Literal

    class Item(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        qty: int = pydantic.Field(ge=1, le=99)
        unit: Literal["kg", "g", "pcs"]

    class Order(pydantic.BaseModel):
        id: str = pydantic.Field(pattern="^[A-Z]{2}[0-9]{3}$")
        items: list[Item] = pydantic.Field(min_length=1, max_length=3)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=model_id, messages=Q, response_format=Order, max_tokens=300, temperature=0)
    order = r.choices[0].message.parsed
    assert isinstance(order, Order) and 1 <= len(order.items) <= 3


@pytest.mark.parametrize("body, param", [
    ({"response_format": _fmt({"type": "strin"})}, "response_format.json_schema.schema"),
    ({"response_format": _fmt({"type": "array", "uniqueItems": True})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"grammar": 'root ::= "a'}, "grammar"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}}, "json_schema"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
])
def test_unenforceable_is_400_naming_the_field(server, body, param):
    before = httpx.get(server.url + "/slots", timeout=30).json()["metrics"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    after = httpx.get(server.url + "/slots", timeout=30).json()["metrics"]
    assert after["requests_total"] == before["requests_total"] and after["running"] == 0 and after["waiting"] == 0


def test_the_boolean_schema_true_is_any_value_on_every_route(server):
    """JSON Schema's `true` (any value) is a schema wherever one is given; it was a 400 "Input should be a valid
    dictionary" on each. `false` matches nothing: a 400 that says so. "yes" or 1 are no schema."""
    url = server.url
    routes = [("/v1/chat/completions", lambda s: {"messages": Q, "max_tokens": 12, "temperature": 0,
                                                  "response_format": _fmt(s)}),
              ("/v1/chat/completions", lambda s: {"messages": Q, "max_tokens": 12, "temperature": 0, "json_schema": s}),
              ("/completion", lambda s: {"prompt": "JSON:", "n_predict": 12, "temperature": 0, "json_schema": s}),
              ("/api/chat", lambda s: {"model": "m", "messages": Q, "stream": False, "format": s,
                                       "options": {"temperature": 0, "num_predict": 12}}),
              ("/v1/responses", lambda s: {"input": "JSON?", "max_output_tokens": 16, "temperature": 0,
                                           "text": {"format": {"type": "json_schema", "name": "a", "schema": s}}})]
    for path, body in routes:
        r = httpx.post(url + path, json=body(True), timeout=120)
        assert r.status_code == 200, (path, r.text)
        r = httpx.post(url + path, json=body(False), timeout=60)
        assert r.status_code == 400 and "false" in r.text, (path, r.text)
        for odd in ("yes", 1):
            assert httpx.post(url + path, json=body(odd), timeout=60).status_code == 400, (path, odd)


def test_a_schema_no_finite_value_matches_is_a_400_on_every_route(server):
    """A schema whose every value must hold another ({"a": {"$ref": "#"}} required) was a 500 mid-generation (the
    grammar engine's item limit), or an answer to max_tokens where a key came first; a 400 naming the field on
    every API, streamed or not, before anything is generated."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    chained = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
               "required": ["v", "next"]}
    routes = [("/v1/chat/completions", lambda s: {"messages": Q, "max_tokens": 60, "response_format": _fmt(s)},
               "response_format.json_schema.schema"),
              ("/v1/chat/completions", lambda s: {"messages": Q, "max_tokens": 60, "stream": True,
                                                  "response_format": _fmt(s)}, "response_format.json_schema.schema"),
              ("/completion", lambda s: {"prompt": "JSON:", "n_predict": 60, "json_schema": s}, "json_schema"),
              ("/api/chat", lambda s: {"model": "m", "messages": Q, "stream": False, "format": s}, "format"),
              ("/v1/messages", lambda s: {"model": "m", "max_tokens": 60, "messages": Q,
                                          "output_config": {"format": {"type": "json_schema", "schema": s}}},
               "output_config.format"),
              ("/v1/chat/completions", lambda s: {"messages": Q, "max_tokens": 60, "tool_choice": "required",
                                                  "tools": [{"type": "function", "function": {
                                                      "name": "f", "parameters": s}}]}, "tools")]
    for schema in (endless, chained):
        for path, body, field in routes:
            r = httpx.post(server.url + path, json=body(schema), timeout=60)
            assert r.status_code == 400 and "no finite JSON value" in r.text and field in r.text, (path, r.text)


def test_strict_is_a_boolean_and_an_overlapping_one_of_says_what_to_write(server):
    """json_schema.strict "yes" or 1 is OpenAI's 400 (lax validation took them as true). A oneOf whose branches
    overlap is refused saying what the client can write, not naming the grammar engine's own option."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for odd in ("yes", 1):
        rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": odd}}
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 4,
                                                                  "response_format": rf}, timeout=60)
        assert r.status_code == 400 and "strict" in r.text, r.text
        r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 16, "text": {
            "format": {"type": "json_schema", "name": "a", "schema": schema, "strict": odd}}}, timeout=60)
        assert r.status_code == 400 and "strict" in r.text, r.text
    overlap = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "integer", "minimum": 5}]}
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 4,
                                                              "response_format": _fmt(overlap)}, timeout=60)
    assert r.status_code == 400 and "anyOf" in r.text and "coerce_one_of" not in r.text, r.text


def test_a_tools_strict_is_a_boolean_on_every_route(server):
    """A tool's `strict` "yes" or 1 is the APIs' 400 naming it, as response_format's strict is (it was taken in
    silence on chat and Responses, and dropped on /v1/messages); true and false are taken."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    routes = [("/v1/chat/completions", "tools[0].function.strict",
               lambda v: {"messages": Q, "max_tokens": 1, "tools": [
                   {"type": "function", "function": {"name": "f", "parameters": params, "strict": v}}]}),
              ("/v1/responses", "tools[0].strict",
               lambda v: {"input": "hi", "max_output_tokens": 16, "tools": [
                   {"type": "function", "name": "f", "parameters": params, "strict": v}]}),
              ("/v1/messages", "tools.0.strict",
               lambda v: {"model": "m", "max_tokens": 1, "messages": Q, "tools": [
                   {"name": "f", "input_schema": params, "strict": v}]})]
    for path, param, body in routes:
        for odd in ("yes", 1):
            r = httpx.post(server.url + path, json=body(odd), timeout=60)
            assert r.status_code == 400 and param in r.text, (path, r.text)
            if path != "/v1/messages":
                assert r.json()["error"]["param"] == param, r.text
        for fine in (True, False):
            r = httpx.post(server.url + path, json=body(fine), timeout=120)
            assert r.status_code == 200, (path, r.text)


def test_a_large_schema_is_not_counted_against_the_context(server):
    """An enum of 10,000 integers (48 KiB, under the 256 KiB spec limit) was a 400 context_length_exceeded: the body's
    parser counted the schema's numbers against the context, which a schema never enters."""
    schema = {"enum": list(range(10000))}
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 8, "temperature": 0,
                                                              "response_format": _fmt(schema)}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert json.loads(r.json()["choices"][0]["message"]["content"]) in schema["enum"]


TWO = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                      "b": {"type": "integer", "minimum": 0, "maximum": 9}}}


def test_an_answer_cut_by_a_stop_string_ends_stop_on_the_server_and_in_python(client, model_id, server):
    """A stop string inside a JSON answer (TWO's object always writes a comma) ends it "stop", as OpenAI's and
    llama-server's do, on chat (streamed or not) and Responses ("completed") alike, and the Python API gives the
    same text and finish (the server said length / incomplete, Python stop: a caller could not tell a stop string
    from max_tokens on one of them). The cut value is no whole JSON: openai's parse() raises its validation
    error, not LengthFinishReasonError (which would ask for a larger max_tokens)."""
    from bitnet_cpu.engine.api import SamplingParams, load_model

    kw = dict(model=model_id, messages=Q, response_format=_fmt(TWO), max_tokens=60, temperature=0, stop=[","])
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "stop" and re.fullmatch(r'\{ ?"a": ?[0-9]', c.message.content), c
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    llm = load_model(progress=False)
    got = list(llm.generate(llm.chat_prompt(Q), SamplingParams(temperature=0), max_tokens=60, constraint=TWO,
                            stop=[","]))
    llm.close()
    assert "".join(ch.text for ch in got) == c.message.content
    assert got[-1].finish_reason == "stop" and got[-1].stats.stop_word == ","

    class Two(pydantic.BaseModel):
        a: int = pydantic.Field(ge=0, le=9)
        b: int = pydantic.Field(ge=0, le=9)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    with pytest.raises(pydantic.ValidationError):
        parse(model=model_id, messages=Q, response_format=Two, max_tokens=60, temperature=0, stop=[","])

    body = {"input": "Give me two digits as JSON.", "max_output_tokens": 60, "temperature": 0, "stop": [","],
            "text": {"format": {"type": "json_schema", "name": "two", "schema": TWO, "strict": True}}}
    out = httpx.post(server.url + "/v1/responses", json=body, timeout=120).json()
    assert out["status"] == "completed" and out["incomplete_details"] is None, out
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        kinds = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[-1] == "response.completed", kinds


def test_a_pattern_of_nested_counts_is_a_400_naming_the_limit_on_every_route(server):
    """A 24-byte pattern ^(a{1000}){1000}$ (or GBNF ([a]{1000}){1000}) was served at ~0.5 s per token, slowing
    every other request 100-1000x and keeping ~400 MB: a 400 on every API that names the field, the pattern
    and the limit, before anything is compiled."""
    from bitnet_cpu.engine.runtime.grammar_cost import MAX_REPEAT_COST
    heavy = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
             "required": ["s"]}
    routes = [("/v1/chat/completions", lambda s: {"messages": Q, "max_tokens": 8, "response_format": _fmt(s)},
               "response_format.json_schema.schema"),
              ("/completion", lambda s: {"prompt": "JSON:", "n_predict": 8, "json_schema": s}, "json_schema"),
              ("/api/chat", lambda s: {"model": "m", "messages": Q, "stream": False, "format": s}, "format"),
              ("/v1/chat/completions", lambda s: {"messages": Q, "max_tokens": 8, "tool_choice": "required",
                                                  "tools": [{"type": "function", "function": {
                                                      "name": "f", "parameters": s}}]}, "tools"),
              ("/completion", lambda s: {"prompt": "x", "n_predict": 8,
                                         "grammar": 'root ::= s\ns ::= ([a]{1000}){1000}'}, "rule s")]
    for path, body, field in routes:
        r = httpx.post(server.url + path, json=body(heavy), timeout=60)
        assert r.status_code == 400 and f"{MAX_REPEAT_COST:,}" in r.text and field in r.text, (path, r.text)
        assert "/properties/s" in r.text or "rule s" in r.text, (path, r.text)


def test_a_costly_format_sent_with_tools_is_a_400_on_every_route(server):
    """A format beside tools (tool_choice auto) went into the tool grammar as %json {...} without its patterns
    being costed, and ^(a{1000}){1000}$ was compiled and served: a 400 naming the format's field, the pointer and
    the limit on every API that takes the pair."""
    from bitnet_cpu.engine.runtime.grammar_cost import MAX_REPEAT_COST
    heavy = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
             "required": ["s"]}
    tool = {"name": "f", "description": "a tool", "parameters": {"type": "object",
                                                                 "properties": {"a": {"type": "integer"}}}}
    routes = [("/v1/chat/completions", {"messages": Q, "max_tokens": 8, "tool_choice": "auto",
                                        "tools": [{"type": "function", "function": tool}],
                                        "response_format": _fmt(heavy)}, "response_format"),
              ("/v1/responses", {"input": "JSON?", "max_output_tokens": 16, "tool_choice": "auto",
                                 "tools": [{"type": "function", **tool}],
                                 "text": {"format": {"type": "json_schema", "name": "a", "schema": heavy}}}, "text"),
              ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": Q,
                                "tools": [{"name": "f", "description": "a tool", "input_schema": tool["parameters"]}],
                                "output_config": {"format": {"type": "json_schema", "schema": heavy}}},
               "output_config.format"),
              ("/api/chat", {"model": "m", "messages": Q, "stream": False, "format": heavy,
                             "tools": [{"type": "function", "function": tool}]}, "format")]
    for path, body, field in routes:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400 and f"{MAX_REPEAT_COST:,}" in r.text and field in r.text, (path, r.text)
        assert "/properties/s" in r.text, (path, r.text)
