"""ollama's API on `bitnet serve` (serve/ollama.py), driven by the official `ollama` Python client against a real
subprocess on 127.0.0.1 with the bundled model: /api/chat streams NDJSON the client reads (same text as not
streaming, and as the OpenAI endpoint), /api/generate with options, context and raw prompts, `format` gives valid
JSON (and schema-valid JSON), logprobs, /api/tags lists the model, show/ps/version answer, and every refusal comes
back in ollama's error shape."""
from __future__ import annotations

import json

import httpx
import pytest

ollama = pytest.importorskip("ollama", reason="the ollama tests need the ollama client (pip install .[test])")
pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from serve_proc import Server  # noqa: E402

SERVER_ARGS = ("--parallel", "4")   # conftest's server fixture
Q = [{"role": "user", "content": "What is 12+7?"}]
GREEDY = {"temperature": 0}
ADD = {"type": "function", "function": {"name": "add", "description": "add two integers", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture(scope="module")
def model_id(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_tags_show_ps_version(client, model_id):
    tags = client.list()
    assert [m.model for m in tags.models] == [f"{model_id}:latest"]   # as ollama lists a name without a tag
    m = tags.models[0]
    assert m.size > 0 and len(m.digest) == 64 and m.details.family and m.details.parameter_size
    show = client.show(model_id)
    assert show.modelinfo["general.architecture"] == m.details.family and "completion" in show.capabilities
    assert show.template   # the model's own chat template
    older = httpx.post(client._client.base_url.join("/api/show"), json={"name": model_id}).json()   # older clients
    assert older["template"] == show.template and older["model_info"] == show.modelinfo
    ps = client.ps()
    assert ps.models[0].model == f"{model_id}:latest" and ps.models[0].context_length > 0
    assert httpx.get(client._client.base_url.join("/api/version")).json()["version"].count(".") == 2


def test_listed_names_carry_latest_and_both_spellings_are_served(client, model_id, server):
    """ollama lists NAME:latest (name and model), and its clients check a model against that list with the tag
    (LangChain's validate_model: the name itself, or one that starts with it and ":"): a bare NAME listed made
    "NAME:latest" "not found" there. Both spellings pass that check against the list, and every route takes both."""
    for route in ("/api/tags", "/api/ps"):
        listed = httpx.get(server.url + route, timeout=60).json()["models"]
        assert [(m["name"], m["model"]) for m in listed] == [(f"{model_id}:latest",) * 2], route
        for asked in (model_id, f"{model_id}:latest"):
            assert any(asked == m["model"] or m["model"].startswith(asked + ":") for m in listed), (route, asked)
    for asked in (model_id, f"{model_id}:latest"):
        assert client.chat(model=asked, messages=Q, options={"num_predict": 2}).done, asked
        assert client.show(asked).template, asked
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": asked, "messages": Q, "max_tokens": 1})
        assert r.status_code == 200, (asked, r.text)
    assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=60).json()["data"]] == [model_id]


def test_chat_streams_ndjson_the_client_reads(client, model_id, server):
    parts = list(client.chat(model=model_id, messages=Q, stream=True, options=GREEDY))
    assert len(parts) > 2 and all(not p.done for p in parts[:-1]) and parts[-1].done
    text = "".join(p.message.content for p in parts)
    last = parts[-1]
    # every token made counts, the end-of-text one included (one text piece per token here)
    assert last.done_reason == "stop" and last.eval_count == len(parts) - 1 + 1 > 1
    assert last.prompt_eval_count > 0 and last.total_duration >= last.eval_duration > 0
    assert last.total_duration < 60e9   # nanoseconds, not seconds or milliseconds
    whole = client.chat(model=model_id, messages=Q, options=GREEDY)
    assert whole.done and whole.message.role == "assistant" and whole.message.content == text
    openai_text = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                             json={"messages": Q, "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert openai_text == text
    # the raw wire format: one JSON object per line
    with httpx.stream("POST", server.url + "/api/chat", json={"model": model_id, "messages": Q, "options": GREEDY},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert "".join(x["message"]["content"] for x in lines) == text and lines[-1]["done"] is True


def test_generate_options_context_and_raw(client, model_id):
    r = client.generate(model=model_id, prompt="Once upon", raw=True,
                        options={"num_predict": 6, "temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                 "seed": 5, "repeat_penalty": 1.1, "repeat_last_n": 16})
    assert r.done_reason == "length" and r.eval_count == 6 and r.response
    again = client.generate(model=model_id, prompt="Once upon", raw=True,
                            options={"num_predict": 6, "temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                     "seed": 5, "repeat_penalty": 1.1, "repeat_last_n": 16})
    assert again.response == r.response   # seeded
    assert len(r.context) == r.prompt_eval_count + r.eval_count
    # context continues where the last answer left off, as ollama's does
    cont = client.generate(model=model_id, prompt=" and then", raw=True, context=r.context, options={"num_predict": 3})
    assert cont.context[:len(r.context)] == list(r.context) and cont.prompt_eval_count > len(r.context)
    stopped = client.generate(model=model_id, prompt="Once upon", raw=True, options={**GREEDY, "stop": [","]})
    assert stopped.done_reason == "stop" and "," not in stopped.response
    # its context holds what was shown, never the stop string's tokens (ollama: Tokenize(prompt + response))
    from bitnet_cpu.engine.api import load_model
    llm = load_model(None, progress=False)
    assert list(stopped.context[stopped.prompt_eval_count:]) == llm.tokenize(stopped.response)
    assert "," not in llm.detokenize(stopped.context[stopped.prompt_eval_count:])
    for stream in (False, True):   # the stream's final object says the same
        parts = list(client.generate(model=model_id, prompt="Once upon", raw=True, stream=True,
                                     options={**GREEDY, "stop": [","]})) if stream else [stopped]
        assert list(parts[-1].context) == list(stopped.context)
    # the greedy story says "was" again after 20-odd tokens: a presence penalty makes it say something else
    pen = client.generate(model=model_id, prompt="Once upon a time", raw=True,
                          options={**GREEDY, "num_predict": 32, "presence_penalty": 2})
    plain = client.generate(model=model_id, prompt="Once upon a time", raw=True, options={**GREEDY, "num_predict": 32})
    assert pen.response != plain.response and pen.response[:40] == plain.response[:40]
    templated = client.generate(model=model_id, prompt="What is 12+7?", options=GREEDY)
    assert templated.response == client.chat(model=model_id, messages=Q, options=GREEDY).message.content


def test_format_json_and_schema(client, model_id):
    r = client.chat(model=model_id, messages=[{"role": "user", "content": "Describe a cat as JSON"}], format="json",
                    options={"temperature": 1.0, "seed": 3, "num_predict": 200})
    assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 30}}}
    for part_stream in (False, True):
        if part_stream:
            text = "".join(p.response for p in client.generate(model=model_id, prompt="A cat", format=schema, stream=True,
                                                                 options={"temperature": 0.8, "seed": 1}))
        else:
            text = client.generate(model=model_id, prompt="A cat", format=schema, options={"temperature": 0.8, "seed": 1}).response
        obj = json.loads(text)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and 0 <= obj["age"] <= 30


def test_tools_reach_the_prompt_and_a_tool_round_trip_renders(client, model_id):
    """ollama has no tool_choice: the model chooses (the bundled one answers in text). The tool list reaches
    the prompt through the engine's tool layer, and a history with the assistant's call and the tool's result
    (ollama's shapes: arguments as an object, tool_name) renders and is answered."""
    ask = [{"role": "user", "content": "What is 12+7? Use the add tool."}]
    plain = client.chat(model=model_id, messages=ask, options={**GREEDY, "num_predict": 8})
    with_tools = client.chat(model=model_id, messages=ask, tools=[ADD], options={**GREEDY, "num_predict": 8})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count + 20   # the tool block is in the prompt
    history = ask + [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 12, "b": 7}}}]},
                     {"role": "tool", "content": "19", "tool_name": "add"}]
    after = client.chat(model=model_id, messages=history, tools=[ADD], options={**GREEDY, "num_predict": 16})
    assert after.done and after.prompt_eval_count > with_tools.prompt_eval_count
    streamed = "".join(p.message.content for p in client.chat(model=model_id, messages=history, tools=[ADD], stream=True,
                                                              options={**GREEDY, "num_predict": 16}))
    assert streamed == after.message.content
    assert "tools" in client.show(model_id).capabilities


def test_typical_p_and_mirostat_options_are_honoured(client, model_id):
    """ollama's typical_p, mirostat, mirostat_tau and mirostat_eta options take effect (they used to be refused):
    each changes a seeded, sampled answer."""
    base = {"temperature": 1.5, "seed": 5, "num_predict": 24, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    plain = client.generate(model=model_id, prompt="Once upon a time", options=base).response
    for extra in ({"typical_p": 0.2}, {"mirostat": 2, "mirostat_tau": 1.0}, {"mirostat": 1, "mirostat_tau": 1.0,
                                                                              "mirostat_eta": 0.5}):
        got = client.generate(model=model_id, prompt="Once upon a time", options={**base, **extra}).response
        assert got != plain, extra


def test_logprobs(client, model_id):
    r = client.chat(model=model_id, messages=Q, options=GREEDY, logprobs=True, top_logprobs=2)
    assert r.done_reason == "stop" and len(r.logprobs) == r.eval_count - 1   # the end-of-text token has none
    assert "".join(x.token for x in r.logprobs) == r.message.content
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == x.logprob <= 0 for x in r.logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_leave_out_a_stop_strings_tokens(server, model_id, stream):
    """/api/generate with a stop string: the logprobs are those of the text given, not of the stop string's
    tokens after it (streamed: each line's records come with their text)."""
    body = {"model": model_id, "prompt": "Once upon a time", "options": {**GREEDY, "num_predict": 20},
            "logprobs": True, "stream": False}
    full = httpx.post(server.url + "/api/generate", json=body, timeout=120).json()
    toks = [x["token"] for x in full["logprobs"]]
    assert "".join(toks) == full["response"]
    k = next(k for k in range(2, len(toks) - 2) if full["response"].find(toks[k] + toks[k + 1]) == len("".join(toks[:k])))
    body["options"]["stop"] = [toks[k] + toks[k + 1]]
    if stream:
        with httpx.stream("POST", server.url + "/api/generate", json={**body, "stream": True}, timeout=120) as r:
            lines = [json.loads(x) for x in r.iter_lines() if x]
        text = "".join(x["response"] for x in lines)
        got = [e["token"] for x in lines for e in (x.get("logprobs") or [])]
    else:
        r = httpx.post(server.url + "/api/generate", json=body, timeout=120).json()
        text, got = r["response"], [e["token"] for e in r["logprobs"]]
    assert text == "".join(toks[:k]) and got == toks[:k]


def test_engine_samplers_and_retired_options_are_taken(server, model_id):
    """xtc / DRY / top-n-sigma / dynamic temperature as options change the answer (they were dropped in silence);
    the options ollama itself retired (penalize_newline, ...) and the load-time ones are taken and ignored, as there."""
    def answer(options):
        r = httpx.post(server.url + "/api/generate", json={"model": model_id, "prompt": "Once upon a time",
                                                           "stream": False, "options": options}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["response"]
    base = {"temperature": 0, "num_predict": 12, "seed": 1}
    plain = answer(base)
    assert answer({**base, "penalize_newline": True, "num_gqa": 8, "num_thread": 2, "use_mmap": False}) == plain
    hot = {**base, "temperature": 1.5}
    assert answer({**hot, "xtc_probability": 1, "xtc_threshold": 0.001}) != answer(hot)   # the top choices cut


def test_presence_and_frequency_count_the_prompt(server, model_id):
    """ollama's penalties (its llama.cpp runner's) count the last repeat_last_n tokens, prompt included (they saw only
    generated tokens here): the first step's logprob of a token the prompt holds n times moves by
    -(n * frequency + presence) against one it lacks."""
    text = "Once upon a time, there was a cat. Once upon a time, there was a dog. Once upon a time"

    def tokenize(content):
        return httpx.post(server.url + "/tokenize", json={"content": content}).json()["tokens"]

    def step0(options):
        r = httpx.post(server.url + "/api/generate", json={
            "model": model_id, "prompt": text, "raw": True, "stream": False, "logprobs": True, "top_logprobs": 20,
            "options": {"temperature": 0, "num_predict": 1, **options}}, timeout=120)
        assert r.status_code == 200, r.text
        return {t["token"]: t["logprob"] for t in r.json()["logprobs"][0]["top_logprobs"]}
    ids = tokenize(text)
    pen = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    base, got = step0({}), step0(pen)
    one = {t: tokenize(t) for t in base if t in got}
    held = [t for t, i in one.items() if len(i) == 1 and i[0] in ids]
    others = [t for t, i in one.items() if not set(i) & set(ids)]
    assert held and others, (base, got)
    t, o = held[0], others[0]
    n = ids.count(one[t][0])
    assert abs((got[t] - got[o]) - (base[t] - base[o]) + (n * 0.5 + 1.5)) < 1e-3


@pytest.mark.parametrize("path,body,words", [
    ("/api/chat", {"messages": Q}, "model is required"),
    ("/api/embed", {"model": 5, "input": "hi"}, "model: Input should be a valid string"),   # was "required"
    ("/api/embeddings", {"model": ["m"], "prompt": "hi"}, "model: Input should be a valid string"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"temperature": -1}}, "options.temperature -1"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"top_p": 2}}, "options.top_p 2"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"mirostat": 3}}, "options.mirostat 3"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"typical_p": 1.5}}, "options.typical_p 1.5"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"tfs_z": 0.5}}, "options.tfs_z 0.5"),
    ("/api/chat", {"model": "m", "messages": Q, "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name"),
    ("/api/generate", {"model": "m", "prompt": "x", "tools": [ADD]}, "only /api/chat takes tools"),
    ("/api/chat", {"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"x": 1}]}]},
     "messages.0.tool_calls.0"),
    ("/api/chat", {"model": "m", "messages": Q, "think": True}, "does not support thinking"),
    ("/api/chat", {"model": "m", "messages": Q, "format": {"type": "nonsense-type"}}, "format"),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "text only"),
    ("/api/generate", {"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    # ollama's context switches were dropped in silence: true (cut the history, slide the context) is not done here
    ("/api/chat", {"model": "m", "messages": Q, "truncate": True}, "truncate: true is not supported"),
    ("/api/generate", {"model": "m", "prompt": "x", "shift": True}, "shift: true is not supported"),
    ("/api/chat", {"model": "m", "messages": Q, "shift": "yes"}, "shift: Input should be a valid boolean"),
    ("/api/generate", {"model": "m", "prompt": "x", "width": 512}, "width: image generation"),
    ("/api/pull", {"model": "llama3"}, "does not download models"),
    ("/api/create", {"model": "x"}, "bitnet convert"),
    ("/api/push", {"model": "x"}, "does not push"),
    ("/api/embed", {"model": "x", "input": ["hi", ""]}, "input.1: an empty string"),   # embeddings: served
    # ollama's Go server: stop is a list of strings, an integer option a number with no fraction
    ("/api/chat", {"model": "m", "messages": Q, "options": {"stop": 5}}, "options.stop 5: must be an array of strings"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"stop": True}}, "options.stop true"),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"stop": [5]}}, "options.stop [5]"),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"stop": {"a": 1}}}, 'options.stop {"a": 1}'),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"num_predict": 2.5}}, "options.num_predict 2.5"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"num_ctx": "big"}}, 'options.num_ctx "big"'),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"top_k": "4"}}, 'options.top_k "4"'),
    ("/api/chat", {"model": "m", "messages": Q, "format": 5}, "format: "),   # no union branch tag in the name
    # an option no one has (a typo) changed nothing in silence; the engine's own samplers are checked as options
    ("/api/chat", {"model": "m", "messages": Q, "options": {"temprature": 0}}, "options.temprature: not an option"),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"xtc_probability": 2}}, "options.xtc_probability 2"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"dry_allowed_length": 1.5}}, "dry_allowed_length 1.5"),
    # load-time options are ignored but typed as ollama types them (a wrong type was a 200)
    ("/api/chat", {"model": "m", "messages": Q, "options": {"num_thread": "x"}}, 'options.num_thread "x"'),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"num_batch": [1]}}, "options.num_batch [1]"),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"use_mmap": 5}}, "options.use_mmap 5: must be a bool"),
    ("/api/chat", {"model": "m", "messages": Q, "options": {"numa": "yes"}}, 'options.numa "yes"'),
    # asked-for alternatives without logprobs were dropped in silence
    ("/api/chat", {"model": "m", "messages": Q, "top_logprobs": 3}, "top_logprobs 3 needs logprobs: true"),
    ("/api/generate", {"model": "m", "prompt": "x", "top_logprobs": 2}, "top_logprobs 2 needs logprobs: true"),
    # a history call's arguments are an object: 5 and "not json" reached the template as if they were arguments
    ("/api/chat", {"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "add", "arguments": 5}}]}, *Q]}, "messages.0.tool_calls.0.function.arguments"),
    ("/api/chat", {"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "add", "arguments": "not json"}}]}, *Q]}, "expected an object"),
])
def test_refusals_in_ollama_error_shape(server, path, body, words):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code in (400, 501), r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"]


def test_go_clients_numbers_nulls_and_the_server_check(server, model_id):
    """What ollama's own Go server takes, this one does: HEAD / answers (the ollama CLI's check before every
    command), an integer option sent as 3.0 is 3, a negative seed other than -1 is a seed, num_predict 0 is no
    limit, and a null field is one left out ("stream": null streams)."""
    url = server.url
    assert httpx.head(url + "/", timeout=30).status_code == 200

    def gen(**options):
        r = httpx.post(url + "/api/generate", json={"model": model_id, "prompt": "Once upon", "raw": True,
                                                    "stream": False, "options": options}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    three = gen(num_predict=3.0, temperature=0)
    assert three["eval_count"] == 3 and three["done_reason"] == "length"
    wild = dict(num_predict=8, temperature=2.0, top_k=0.0, top_p=1.0, min_p=0.0)
    a, b, c = gen(seed=-2, **wild), gen(seed=-2, **wild), gen(seed=-3, **wild)
    assert a["response"] == b["response"] and a["response"] != c["response"]
    short_ctx = gen(num_predict=3, temperature=0, num_ctx=2)   # a prompt over num_ctx: answered, not cut to ""
    assert short_ctx["eval_count"] == 3 and short_ctx["response"] == three["response"]
    unlimited = gen(num_predict=0, temperature=0)
    limited = gen(num_predict=40, temperature=0)
    assert unlimited["eval_count"] > 3 and unlimited["response"].startswith(limited["response"][:20])
    with httpx.stream("POST", url + "/api/chat", json={"model": model_id, "messages": Q, "stream": None,
                                                       "options": {"temperature": 0, "num_predict": 4}},
                      timeout=60) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert r.status_code == 200 and len(lines) > 1 and lines[-1]["done"] and not lines[0]["done"]
    r = httpx.post(url + "/api/chat", json={"model": model_id, "messages": Q, "stream": False, "truncate": False,
                                            "shift": False, "options": {"num_predict": 2}}, timeout=60)
    assert r.status_code == 200, r.text   # false is what this server does anyway


def test_num_ctx_as_long_as_the_prompt_caps_the_answer(server, model_id):
    """options.num_ctx equal to the prompt's length lifted the cap (the answer ran to EOS, 100 tokens) while one token
    more gave 2 tokens: a prompt as long as num_ctx fits it, as one as long as the server's -c fits that (one token,
    finish "length"); only a longer prompt runs in the server's context (docs/api.md)."""
    def gen(**options):
        r = httpx.post(server.url + "/api/generate", json={"model": model_id, "prompt": "Once upon", "raw": True,
                                                           "stream": False, "options": {"temperature": 0, **options}},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    n_prompt = gen(num_predict=1)["prompt_eval_count"]
    for extra in (0, 1, 2):
        got = gen(num_ctx=n_prompt + extra)
        assert got["eval_count"] <= extra + 1, (extra, got["eval_count"], got["done_reason"])


def test_show_gives_the_trained_context_as_ollama_does(server, model_id):
    """/api/show's model_info["<arch>.context_length"] is the model file's (ollama reads it from the GGUF: the trained
    context); it was the server's -c. The server's context is the parameters' num_ctx and /api/ps' context_length."""
    from bitnet_cpu.engine.api import load_model

    with load_model(None, progress=False) as llm:
        trained, arch = llm.config.context_length, llm.config.arch
    n_ctx = httpx.get(server.url + "/v1/models").json()["data"][0]["meta"]["n_ctx"]
    assert n_ctx != trained   # the server's default context is not the bundled model's trained one
    show = httpx.post(server.url + "/api/show", json={"model": model_id}, timeout=30).json()
    assert show["model_info"][f"{arch}.context_length"] == trained, show["model_info"]
    assert f"num_ctx        {n_ctx}" in show["parameters"].splitlines(), show["parameters"]
    assert httpx.get(server.url + "/api/ps").json()["models"][0]["context_length"] == n_ctx


def test_chat_continues_a_final_assistant_message(server, model_id):
    """A conversation ending in an assistant message is continued, as ollama's templates leave that message open:
    the answer is the greedy continuation of the template's text with the message's start appended (the
    llama-server endpoint runs that text as a raw prompt), not a new turn."""
    url = server.url
    start = "Once upon a"
    convo = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": start}]
    r = httpx.post(url + "/api/chat", json={"model": model_id, "messages": convo, "stream": False,
                                            "options": {"temperature": 0, "num_predict": 8}}, timeout=60).json()
    text = httpx.post(url + "/apply-template", json={"messages": convo[:1]}, timeout=30).json()["prompt"] + start
    raw = httpx.post(url + "/completion", json={"prompt": text, "n_predict": 8, "temperature": 0},
                     timeout=60).json()
    assert r["message"]["content"] == raw["content"] and r["message"]["content"]
    turn = httpx.post(url + "/api/chat", json={"model": model_id, "messages": convo[:1], "stream": False,
                                               "options": {"temperature": 0, "num_predict": 8}}, timeout=60).json()
    assert turn["message"]["content"] != r["message"]["content"]


def test_generate_context_keeps_one_bos(server, model_id):
    """/api/generate with a context (and the template): the conversation's BOS stays the first token only."""
    url = server.url
    bos = httpx.post(url + "/tokenize", json={"content": "", "add_special": True}, timeout=30).json()["tokens"]
    first = httpx.post(url + "/api/generate", json={"model": model_id, "prompt": "Hi", "stream": False,
                                                    "options": {"temperature": 0, "num_predict": 4}}, timeout=60).json()
    assert bos and first["context"][:1] == bos
    second = httpx.post(url + "/api/generate", json={"model": model_id, "prompt": "And then?", "stream": False,
                                                     "context": first["context"],
                                                     "options": {"temperature": 0, "num_predict": 4}},
                        timeout=60).json()
    assert second["context"][:len(first["context"])] == first["context"]
    assert second["context"].count(bos[0]) == 1


def test_client_raises_response_error(client):
    with pytest.raises(ollama.ResponseError) as ei:
        client.pull("llama3")
    assert ei.value.status_code == 501 and "does not download" in ei.value.error
    with pytest.raises(ollama.ResponseError) as ei:
        client.chat(model="m", messages=Q, options={"top_p": 1.5})
    assert ei.value.status_code == 400 and "options.top_p 1.5" in ei.value.error


def test_strict_model_name_404_in_ollama_shape():
    s = Server("--strict-model-name", "--alias", "bitnet-small", "--mirostat", "2", "--typical", "0.5")
    try:
        c = ollama.Client(host=s.url, timeout=60)
        # the server's sampling flags show among its parameters, in ollama's names (others only when set)
        params = dict(line.split(None, 1) for line in c.show("bitnet-small").parameters.splitlines())
        assert params["mirostat"] == "2" and params["typical_p"] == "0.5" and "mirostat_eta" not in params
        with pytest.raises(ollama.ResponseError) as ei:
            c.chat(model="llama3", messages=Q)
        assert ei.value.status_code == 404 and "bitnet-small" in ei.value.error
        assert c.chat(model="bitnet-small:latest", messages=Q, options={"num_predict": 2}).done
        assert [m.model for m in c.list().models] == ["bitnet-small:latest"]
        # every route agrees on a name: NAME and NAME:latest are served, another tag is not (as ollama: 404)
        chat = {"messages": Q, "max_tokens": 1}
        for name, code in (("bitnet-small", 200), ("bitnet-small:latest", 200), ("bitnet-small:70b", 404)):
            got = [httpx.get(f"{s.url}/v1/models/{name}", timeout=60).status_code]
            for path, body in (("/v1/chat/completions", chat), ("/api/chat", {**chat, "stream": False}),
                               ("/api/embed", {"input": "hi"}), ("/v1/embeddings", {"input": "hi"})):
                got.append(httpx.post(s.url + path, json={**body, "model": name}, timeout=60).status_code)
            assert got == [code] * 5, (name, got)
    finally:
        s.stop()


def test_strict_model_name_matches_names_as_the_router_does():
    """--alias NAME:latest: NAME is the same model to ollama (and to the router, which also ignores case); under
    --strict-model-name a request naming `m` was a 404 while `m:latest` answered."""
    s = Server("--strict-model-name", "--alias", "m:latest")
    try:
        chat = {"messages": Q, "max_tokens": 1}
        for name, code in (("m", 200), ("M", 200), ("m:latest", 200), ("M:Latest", 200), ("m:7b", 404),
                           ("mm", 404)):
            got = [httpx.get(f"{s.url}/v1/models/{name}", timeout=60).status_code]
            for path, body in (("/v1/chat/completions", chat), ("/api/chat", {**chat, "stream": False}),
                               ("/api/show", {})):
                got.append(httpx.post(s.url + path, json={**body, "model": name}, timeout=60).status_code)
            assert got == [code] * 4, (name, got)
    finally:
        s.stop()


def test_a_model_file_named_with_bytes_not_utf8_is_described(tmp_path):
    """-m with a file name that is not UTF-8: /api/tags, /api/ps, /api/show and /props were a bare 500 (its path
    could not be hashed nor sent as JSON); the path is shown with U+FFFD for each bad byte."""
    import os
    import shutil

    from serve_proc import ROOT
    path = str(tmp_path / os.fsdecode(b"bad\xff.bnstore"))
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), path)
    shown = os.fsencode(path).decode("utf-8", "replace")
    s = Server("-m", path)
    try:
        for route in ("/api/tags", "/api/ps"):
            r = httpx.get(s.url + route, timeout=60)
            assert r.status_code == 200 and len(r.json()["models"][0]["digest"]) == 64, (route, r.text)
        r = httpx.post(s.url + "/api/show", json={"model": "x"}, timeout=60)
        assert r.status_code == 200 and f"FROM {shown}\n" in r.json()["modelfile"], r.text
        r = httpx.get(s.url + "/props", timeout=60)
        assert r.status_code == 200 and r.json()["model_path"] == shown, r.text
    finally:
        s.stop()


def test_refused_operations_answer_but_are_not_advertised(server):
    """pull, push, create, copy, delete always answer 501 (ollama's shape, with the reason): /openapi.json does not
    list them as operations (a schema fuzzer called them server errors)."""
    paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    assert "/api/chat" in paths and "/v1/chat/completions" in paths
    for name in ("pull", "push", "create", "copy", "delete"):
        assert f"/api/{name}" not in paths, name
        r = httpx.post(server.url + f"/api/{name}", json={"model": "m"}, timeout=30)
        assert r.status_code == 501 and isinstance(r.json()["error"], str) and r.json()["error"], r.text
    r = httpx.request("DELETE", server.url + "/api/delete", json={"model": "m"}, timeout=30)
    assert r.status_code == 501 and "delete" in r.json()["error"]
    # `ollama create` uploads its blob first: that answered a bare 404 "Not Found", hiding create's reason
    digest = "sha256:" + "0" * 64
    r = httpx.post(server.url + f"/api/blobs/{digest}", content=b"GGUF", timeout=30)
    assert r.status_code == 501 and "bitnet convert" in r.json()["error"], r.text
    assert httpx.head(server.url + f"/api/blobs/{digest}", timeout=30).status_code == 501


def test_every_operation_has_its_own_id_and_head_still_answers(server):
    """OpenAPI: an operationId is unique among all operations (client generators fail on a duplicate); one route of
    GET and HEAD gave both one id (/health, /v1/health, /metrics, /), and FastAPI warned of it in the server's log.
    HEAD (load balancers', the ollama CLI's heartbeat) still answers on each."""
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values() if isinstance(op, dict)]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for path in ("/", "/health", "/v1/health", "/metrics"):
        assert httpx.head(server.url + path, timeout=30).status_code == 200, path
        assert "get" in spec["paths"][path], path


def test_keep_alive_must_be_a_duration(server, model_id):
    """A single-model server keeps its model loaded whatever keep_alive says, but a value that is no duration is a
    400, as ollama's Go server answers it (time: invalid duration), on the generating and embedding routes."""
    for path, body in (("/api/generate", {"prompt": "Hi", "options": {"num_predict": 1}}),
                       ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 1}}),
                       ("/api/embed", {"input": "Hi"})):
        ok = httpx.post(server.url + path, json={"model": model_id, "stream": False, "keep_alive": "5m", **body},
                        timeout=60)
        assert ok.status_code == 200, (path, ok.text)
        for bad in ("forever", "5 minutes", True):
            r = httpx.post(server.url + path, json={"model": model_id, "stream": False, "keep_alive": bad, **body})
            assert r.status_code == 400 and "keep_alive" in r.json()["error"], (path, bad, r.text)
