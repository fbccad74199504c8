"""llama-server's own endpoints on `bitnet serve` (serve/llama_api.py): /tokenize, /detokenize, /apply-template,
/props, against a real subprocess on 127.0.0.1 with the bundled model. Each answer is checked against what the
server does with the same text elsewhere (the prompt tokens the completion and chat endpoints count, the template
/api/show reports, the flags it was started with), not against stored values."""
from __future__ import annotations

import json

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


def test_tokenize_takes_the_prompt_forms_completion_takes(server):
    """llama-server's /tokenize reads `content` as its tokenize_mixed does: a string, a list of strings (tokenized
    one after another, BOS only before the first when add_special) or strings mixed with token ids (the ids as
    they are). Such a list was a 400 "Input should be a valid string", where /completion takes it as a prompt."""
    def tok(content, **kw):
        r = post(server, "/tokenize", {"content": content, **kw})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    hello, world = tok("Hello"), tok(" world")
    assert tok(["Hello", " world"]) == hello + world
    assert tok(["Hello", 1, " world"]) == hello + [1] + world
    assert tok([42, 546]) == [42, 546] and tok([]) == []
    bos = tok("Hello", add_special=True)[0]
    assert tok(["Hello", 1, " world"], add_special=True) == [bos] + hello + [1] + world
    assert tok([42, "Hello"], add_special=True) == [42] + hello   # no BOS when it starts with an id (/completion's)
    pieces = tok(["Hello", 42], with_pieces=True)
    assert [p["id"] for p in pieces] == hello + [42]
    assert pieces[:-1] == tok("Hello", with_pieces=True)
    assert pieces[-1]["piece"] == tok(post(server, "/detokenize", {"tokens": [42]}).json()["content"],
                                      with_pieces=True)[0]["piece"]
    # the count a client takes for a /completion prompt is the count /completion evaluates
    done = post(server, "/completion", {"prompt": ["Hello", 1, " world"], "n_predict": 1}).json()
    assert done["tokens_evaluated"] == len(tok(["Hello", 1, " world"], add_special=True))
    for content, says in (([[1, 2]], "content"), ([1, 10 ** 9], "content[1] 1000000000"), ([True], "content[0]"),
                          ([1.5], "content[0]"), ({"a": 1}, "content")):
        r = post(server, "/tokenize", {"content": content})
        assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text
        assert r.json()["error"]["message"].startswith(says), r.text


def test_tokenize_null_fields_are_the_defaults(server):
    """A field sent as null counts as not sent (docs/api.md): /tokenize's booleans answer as left out (a 400 "valid
    boolean" before); a required content stays required."""
    plain = post(server, "/tokenize", {"content": TEXT + "<|eot_id|>"}).json()
    nulls = {"add_special": None, "parse_special": None, "with_pieces": None}
    r = post(server, "/tokenize", {"content": TEXT + "<|eot_id|>", **nulls})
    assert r.status_code == 200 and r.json() == plain, r.text
    assert post(server, "/tokenize", {"content": None}).status_code == 400
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                              "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200, r.text   # the same rule in a nested object


def test_detokenize_refusal_says_the_limit_and_why(server):
    """/detokenize takes as many ids as any body holds numbers (4 x context + 256: parsing holds the interpreter's
    lock): one more is a 400 that says that bound and why, not that a context cannot hold them (detokenizing needs
    none)."""
    n_ctx = httpx.get(server.url + "/props", timeout=30).json()["default_generation_settings"]["n_ctx"]
    limit = 4 * n_ctx + 256
    assert post(server, "/detokenize", {"tokens": [5] * (limit - 1)}).status_code == 200   # and the body's object
    r = post(server, "/detokenize", {"tokens": [5] * (limit + 1)})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and f"over {limit} " in msg and "4 x context + 256" in msg, r.text
    assert "/detokenize" in msg and "cannot hold them" not in msg, msg


def test_token_counts_agree_with_the_generating_endpoints(server):
    ids = post(server, "/tokenize", {"content": TEXT, "add_special": True}).json()["tokens"]
    r = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)   # /v1/completions tokenizes with BOS
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    prompt = post(server, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert TEXT in prompt and "Be brief." in prompt
    n = len(post(server, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"])   # BOS as added
    chat = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == n
    no_gen = post(server, "/apply-template", {"messages": msgs, "add_generation_prompt": False}).json()["prompt"]
    assert prompt.startswith(no_gen) and len(no_gen) < len(prompt)
    # llama-server's flow: the rendered prompt, edited maybe, sent on to /completion runs with one BOS (the template
    # wrote one and /completion added another)
    done = post(server, "/completion", {"prompt": prompt, "n_predict": 1}).json()
    with_bos = post(server, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    assert done["tokens_evaluated"] == len(with_bos) == chat["usage"]["prompt_tokens"]
    assert with_bos.count(with_bos[0]) == 1   # BOS once


def test_openai_paths_without_v1_as_llama_server_has_them(server):
    """llama-server also serves /chat/completions and /responses at the root: an SDK given the bare server URL as
    its base_url works (it got 404)."""
    import openai
    client = openai.OpenAI(base_url=server.url, api_key="x")
    msgs = [{"role": "user", "content": TEXT}]
    a = client.chat.completions.create(model="x", messages=msgs, max_tokens=3, temperature=0)
    b = openai.OpenAI(base_url=server.url + "/v1", api_key="x").chat.completions.create(
        model="x", messages=msgs, max_tokens=3, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
    r = client.responses.create(model="x", input=TEXT, max_output_tokens=3, temperature=0)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 0


def test_timings_per_token_on_the_openai_streams(server):
    """llama-server's timings_per_token on /v1/chat/completions and /v1/completions streams: every chunk with text
    carries `timings` (its web UI's live tokens/s), the last one too; without it only the last one."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}]}),
                       ("/v1/completions", {"prompt": TEXT})):
        for per_token in (True, False):
            with httpx.stream("POST", server.url + path, json={**body, "stream": True, "max_tokens": 6,
                                                                "temperature": 0, "timings_per_token": per_token},
                              timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            texts = [c for c in chunks if c["choices"] and (c["choices"][0].get("delta", {}).get("content")
                                                            or c["choices"][0].get("text"))]
            assert texts and chunks[-1]["timings"]["predicted_n"] >= 1
            assert all("timings" in c for c in texts) == per_token and any("timings" in c for c in texts) == per_token


def test_props_say_what_the_server_runs(server):
    p = httpx.get(server.url + "/props", timeout=30).json()
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert p["default_generation_settings"]["n_ctx"] == models["meta"]["n_ctx"]
    assert p["total_slots"] == 3 and p["model_alias"] == models["id"]
    params = p["default_generation_settings"]["params"]
    assert params["temperature"] == 0.5 and params["top_k"] == 7
    show = post(server, "/api/show", {"model": models["id"]}).json()
    assert p["chat_template"] == show["template"] and p["modalities"] == {"vision": False, "audio": False}


def test_models_path_and_infill(server):
    """llama-server's GET /models is /v1/models; /infill, which these models cannot do, and the slot actions are
    501s saying so."""
    assert httpx.get(server.url + "/models", timeout=30).json() == httpx.get(server.url + "/v1/models",
                                                                            timeout=30).json()
    r = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": "):"})
    assert r.status_code == 501 and "fill-in-the-middle" in r.json()["error"]["message"]
    for action in ("save", "restore", "erase"):   # llama-server's slot actions: its 501 (they were a bare 404)
        r = httpx.post(server.url + f"/slots/0?action={action}", json={"filename": "x.bin"}, timeout=30)
        assert r.status_code == 501 and "slot actions" in r.json()["error"]["message"], r.text


def test_llama_servers_other_endpoints_say_what_is_not_served(server):
    """llama-server's reranking, LoRA and POST /props endpoints were a bare "Not Found" / "Method Not Allowed":
    reranking is a 501 and setting /props a 405 saying so; /lora-adapters lists no adapters, and setting a scale on one is
    a 501 (an empty list asks for nothing, as llama-server takes it)."""
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        r = post(server, path, {"query": "a", "documents": ["b", "c"]})
        assert r.status_code == 501 and "reranking is not supported" in r.json()["error"]["message"], (path, r.text)
    r = post(server, "/props", {"n_ctx": 5})   # a method the path does not take: HTTP's 405, with the reason
    assert r.status_code == 405 and "read-only" in r.json()["error"]["message"], r.text
    assert r.headers["allow"] == "GET, HEAD"
    assert httpx.get(server.url + "/props", timeout=30).status_code == 200   # GET is still /props
    r = httpx.get(server.url + "/lora-adapters", timeout=30)
    assert r.status_code == 200 and r.json() == [], r.text
    r = post(server, "/lora-adapters", [{"id": 0, "scale": 0.5}])
    assert r.status_code == 501 and "LoRA adapters are not supported" in r.json()["error"]["message"], r.text
    r = post(server, "/lora-adapters", [])
    assert r.status_code == 200 and r.json() == {"success": True}, r.text


def test_props_settings_post_back_and_llama_server_lengths(server):
    """A client may send /props' default settings back as a request (llama-server takes its own echo): its
    empty grammar is no grammar, its max_tokens -1 no limit. n_predict is honoured on the OpenAI endpoints as
    llama-server honours it there (their own length fields first)."""
    params = httpx.get(server.url + "/props", timeout=30).json()["default_generation_settings"]["params"]
    assert params["grammar"] == "" and params["max_tokens"] == -1
    r = post(server, "/completion", {**params, "prompt": P, "n_predict": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == complete(server, n_predict=6, ignore_eos=True)["content"]
    assert complete(server, grammar="", n_predict=6)["content"] == complete(server, n_predict=6)["content"]
    free = post(server, "/completion", {"prompt": P, "max_tokens": -1, "temperature": 0, "ignore_eos": True})
    assert free.status_code == 200 and free.json()["tokens_predicted"] > 12 and free.json()["stop_type"] == "limit"
    assert complete(server, max_tokens=5, n_predict=None, ignore_eos=True)["tokens_predicted"] == 5
    c = post(server, "/v1/completions", {"prompt": P, "n_predict": 5, "temperature": 0, "ignore_eos": True}).json()
    assert c["usage"]["completion_tokens"] == 5
    c = post(server, "/v1/completions", {"prompt": P, "n_predict": 5, "max_tokens": 3, "ignore_eos": True}).json()
    assert c["usage"]["completion_tokens"] == 3
    m = [{"role": "user", "content": "Tell me a story"}]
    c = post(server, "/v1/chat/completions", {"messages": m, "n_predict": 4, "ignore_eos": True}).json()
    assert c["usage"]["completion_tokens"] == 4 and c["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens[0]"),
    ("/detokenize", {"tokens": [5, True]}, "tokens"),   # was read as token 1
    ("/detokenize", {"tokens": [5.0]}, "tokens"),
    # tools are checked as the chat endpoint checks them (they were rendered into the prompt as they came)
    ("/apply-template", {"messages": [{"role": "user", "content": "x"}], "tools": [{"bogus": 1}]}, "tools[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"bogus": 1}]},
     "tools[0].type"),
    # and the messages that carry calls and results, as there (a result answering no call was rendered)
    *[(path, {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]},
       "messages[1].tool_call_id") for path in ("/apply-template", "/v1/chat/completions")],
    *[(path, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
       "messages[1].tool_calls[0].function.arguments") for path in ("/apply-template", "/v1/chat/completions")],
    *[(path, {"prompt": "a", "max_tokens": 1, "tfs_z": 0.5}, "tfs_z") for path in ("/v1/completions", "/completion")],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "tfs_z": 0.5}, "tfs_z"),
    ("/tokenize", {"content": "word " * 400000}, "content"),
    ("/tokenize", {"text": "the field is content"}, "content"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/apply-template", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content.0"),
])
def test_bad_requests_are_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


# ---- /completion: llama-server's native completion API -----------------------------------------------------
P = "Once upon a time"


def complete(server, **body):
    r = post(server, "/completion", {"prompt": P, "n_predict": 12, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_is_the_openai_completion(server):
    r = complete(server, return_tokens=True)
    o = post(server, "/v1/completions", {"prompt": P, "max_tokens": 12, "temperature": 0}).json()
    assert r["content"] == o["choices"][0]["text"] and r["stop"] is True
    assert r["tokens_predicted"] == len(r["tokens"]) == o["usage"]["completion_tokens"]
    assert r["tokens_evaluated"] == o["usage"]["prompt_tokens"]
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["content"] == r["content"]
    assert r["stop_type"] == "limit" and r["stopping_word"] == "" and r["truncated"] is False
    assert r["generation_settings"]["temperature"] == 0 and r["generation_settings"]["n_predict"] == 12
    assert P in r["prompt"] and r["timings"]["predicted_n"] == 12
    assert post(server, "/completions", {"prompt": P, "n_predict": 12, "temperature": 0}).json()["content"] == \
        r["content"]   # llama-server's alias


def test_completion_stream_and_stop_word(server):
    whole = complete(server)
    word = whole["content"].split()[2]   # a word the greedy text has: the stop ends it there
    with httpx.stream("POST", server.url + "/completion", timeout=60,
                      json={"prompt": P, "n_predict": 12, "temperature": 0, "stream": True}) as s:
        lines = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
    assert "".join(x["content"] for x in lines) == whole["content"]
    assert [x["stop"] for x in lines] == [False] * (len(lines) - 1) + [True] and lines[-1]["stop_type"] == "limit"
    stopped = complete(server, stop=[word])
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert whole["content"].startswith(stopped["content"]) and word not in stopped["content"]
    # the last object of a stream carries only what the partial ones did not (llama-server's: no token twice for
    # a client that joins them), and has_new_line is of the whole answer (it was of the last object's text)
    body = {"prompt": P, "n_predict": 16, "temperature": 0, "return_tokens": True,
            "grammar": 'root ::= "line one\\nline two"'}
    whole = post(server, "/completion", body).json()
    with httpx.stream("POST", server.url + "/completion", timeout=60, json={**body, "stream": True}) as s:
        lines = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
    assert "".join(x["content"] for x in lines) == whole["content"] == "line one\nline two"
    assert [t for x in lines for t in x["tokens"]] == whole["tokens"] and whole["tokens"]
    assert lines[-1]["has_new_line"] is whole["has_new_line"] is True


def test_completion_probs_are_the_openai_logprobs(server):
    r = complete(server, n_probs=2)
    o = post(server, "/v1/completions", {"prompt": P, "max_tokens": 12, "temperature": 0, "logprobs": 2}).json()
    lp = o["choices"][0]["logprobs"]
    got = r["completion_probabilities"]
    assert [x["logprob"] for x in got] == lp["token_logprobs"] and [x["token"] for x in got] == lp["tokens"]
    assert [{t["token"]: t["logprob"] for t in x["top_logprobs"]} for x in got] == lp["top_logprobs"]
    assert all(isinstance(t["id"], int) for x in got for t in x["top_logprobs"])


def test_completion_prompt_forms_samplers_and_bias(server):
    head = post(server, "/tokenize", {"content": "Once upon", "add_special": True}).json()["tokens"]
    tail = post(server, "/tokenize", {"content": " a time"}).json()["tokens"]
    mixed = complete(server, prompt=head + [" a time"])
    assert mixed["tokens_evaluated"] == len(head) + len(tail)
    assert complete(server, prompt=head + tail)["content"] == mixed["content"]   # the same ids, the same text
    assert complete(server, prompt=[P])["content"] == complete(server)["content"]   # a one-prompt list
    assert complete(server, temperature=-1)["content"] == complete(server)["content"]   # < 0: greedy
    # a sampler left out of `samplers` is off: the same draw as that sampler's "off" value
    kw = dict(temperature=1.0, seed=3, n_predict=16, top_p=1.0, min_p=0.0)
    assert complete(server, samplers=["top_p", "min_p", "temperature"], top_k=5, **kw)["content"] == \
        complete(server, top_k=0, **kw)["content"]
    # llama-server's string of letters names the same chain (p top_p, m min_p, t temperature)
    assert complete(server, samplers="pmt", top_k=5, **kw)["content"] == complete(server, top_k=0, **kw)["content"]
    r = post(server, "/completion", {"prompt": P, "samplers": "kq"})
    assert r.status_code == 400 and '"q"' in r.json()["error"]["message"]
    first = complete(server, return_tokens=True)["tokens"][0]
    banned = complete(server, return_tokens=True, logit_bias=[[first, False]])
    assert banned["tokens"][0] != first
    # false is "never" in the object form too (it was read as a bias of 0), as llama-server reads it
    assert complete(server, return_tokens=True, logit_bias={str(first): False})["tokens"] == banned["tokens"]
    # a token given twice: its biases add up, as llama-server's (the last one alone was kept)
    assert complete(server, return_tokens=True, logit_bias=[[first, 100], [first, -100]])["tokens"] == \
        complete(server, return_tokens=True)["tokens"]
    assert complete(server, return_tokens=True, logit_bias=[[first, False], [first, 100]])["tokens"] == \
        banned["tokens"]
    # a token id as JSON's 14.0 is the integer 14 (it was "a string as the key is not supported")
    assert complete(server, return_tokens=True, logit_bias=[[float(first), False]])["tokens"] == banned["tokens"]
    # the chain the request ran comes back, not the whole chain (posted back, it would turn samplers on)
    ran = complete(server, samplers="pmt", top_k=5, **kw)["generation_settings"]["samplers"]
    assert ran == ["top_p", "min_p", "temperature"]
    assert complete(server)["generation_settings"]["samplers"][-1] == "temperature"
    # llama.cpp's own web UI sends image_data, lora and multimodal_data as [] on every request: off, not a 400
    off = {"image_data": [], "lora": [], "multimodal_data": []}
    assert complete(server, **off)["content"] == complete(server)["content"]


def test_llama_cpps_other_samplers_take_effect(server):
    """DRY, typical_p, top_n_sigma, xtc, dynatemp and mirostat are honoured (they used to be refused): each changes
    the draw of a seeded, sampled completion, and its value comes back in generation_settings; left out of
    `samplers`, dry / typ_p / top_n_sigma / xtc are off (the same draw as their off value). The samplers'
    arithmetic is tests/test_sampling.py's."""
    kw = dict(temperature=1.5, seed=11, n_predict=24, top_k=0, top_p=1.0, min_p=0.0)
    plain = complete(server, **kw)["content"]
    # DRY on a prompt that repeats itself: the greedy continuation of its loop is penalized
    loop = dict(prompt="Once upon a time, there was a little cat named Tom. " * 2 + "Once upon a time,", temperature=0,
                n_predict=8)
    dry = {"dry_multiplier": 3.0, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"]}
    r = complete(server, **loop, **dry)
    assert r["content"] != complete(server, **loop)["content"]
    assert all(r["generation_settings"][k] == v for k, v in dry.items()), r["generation_settings"]
    chain = ["top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    assert complete(server, **loop, **dry, samplers=chain)["content"] == complete(server, **loop)["content"]
    for extra in ({"typical_p": 0.2}, {"top_n_sigma": 0.5}, {"xtc_probability": 1.0, "xtc_threshold": 0.02},
                  {"dynatemp_range": 1.5, "dynatemp_exponent": 0.5}, {"mirostat": 2, "mirostat_tau": 1.0},
                  {"mirostat": 1, "mirostat_tau": 1.0}):
        r = complete(server, **kw, **extra)
        assert r["content"] != plain, extra
        assert all(r["generation_settings"][k] == v for k, v in extra.items()), r["generation_settings"]
    for name, extra in (("typ_p", {"typical_p": 0.2}), ("top-n-sigma", {"top_n_sigma": 0.5}),
                        ("xtc", {"xtc_probability": 1.0, "xtc_threshold": 0.02})):
        chain = [x for x in ("dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
                 if x != name.replace("-", "_")]
        assert complete(server, **kw, **extra, samplers=chain)["content"] == plain, name
    r = post(server, "/completion", {"prompt": P, "n_predict": 2, "typical_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "typical_p", r.text
    # min_keep: top-p 0.01 alone keeps one token (greedy); with min_keep 5 it draws among five
    narrow = complete(server, **{**kw, "top_p": 0.01})
    wide = complete(server, **{**kw, "top_p": 0.01, "min_keep": 5})
    assert narrow["content"] != wide["content"] and wide["generation_settings"]["min_keep"] == 5
    assert narrow["content"] == complete(server, **{**kw, "top_p": 0.01, "temperature": 0})["content"]
    # llama-server's leniency: a dry_base below 1 is its default
    assert complete(server, n_predict=2, dry_multiplier=1.0, dry_base=0.5)["generation_settings"]["dry_base"] == 1.75


def test_a_false_bias_is_never_as_llama_server():
    """logit_bias false is llama-server's -inf (it was -100, which a token 100 logits ahead survives), in both
    forms; in process, no server."""
    import math

    from bitnet_cpu.serve.llama_api import NativeCompletionRequest

    for bias in ([[7, False]], {"7": False}, [[7, False], [7, 5]], [[7, 5], [7, False]]):
        assert NativeCompletionRequest(prompt="x", logit_bias=bias).sampling_params().logit_bias == {7: -math.inf}
    # a token given twice: the biases add up (llama-server's), where the last one alone was kept
    assert NativeCompletionRequest(prompt="x", logit_bias=[[273, -100], [273, 5], [9, 1]]).sampling_params() \
        .logit_bias == {273: -95, 9: 1}


def test_samplers_without_temperature_leave_out_dynamic_temperature(server):
    """A `samplers` list without temperature runs no temperature stage (llama.cpp drops temp_ext with it), so
    dynatemp_range changes nothing: the same seeded draw as without it (it still scaled the candidates)."""
    kw = dict(n_predict=30, temperature=0.8, seed=11, top_k=0, samplers=["top_k"])
    plain = complete(server, **kw)
    for extra in ({"dynatemp_range": 1.0}, {"dynatemp_range": 1.0, "dynatemp_exponent": 0.1}):
        r = complete(server, **kw, **extra)
        assert r["content"] == plain["content"] and r["generation_settings"]["dynatemp_range"] == 0, extra


def test_presence_and_frequency_count_the_prompt_as_llama_server(server):
    """/completion's presence / frequency penalties count the last repeat_last_n tokens, prompt included (as
    llama-server; they saw only generated tokens): the first step's logprob of a token the prompt holds n times
    moves by -(n * frequency + presence) against one it lacks. The OpenAI endpoints keep OpenAI's rule."""
    ids = post(server, "/tokenize", {"content": " dee dee dee dee dee dee"}).json()["tokens"]
    x = ids[-1]
    n = ids.count(x)

    def step0(path, extra):
        body = {"prompt": ids, "temperature": 0, "logit_bias": {str(x): 20}, **extra}
        if path == "/completion":
            r = complete(server, **body, n_predict=1, n_probs=20)["completion_probabilities"][0]["top_logprobs"]
            return {t["id"]: t["logprob"] for t in r}
        r = post(server, path, {**body, "max_tokens": 1, "logprobs": 5}).json()
        return r["choices"][0]["logprobs"]["top_logprobs"][0]
    pen = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    base, got = step0("/completion", {}), step0("/completion", pen)
    others = [t for t in base if t in got and t not in ids]
    assert x in base and x in got and others, (base, got)
    o = others[0]
    assert abs((got[x] - got[o]) - (base[x] - base[o]) + (n * 0.5 + 1.5)) < 1e-3
    # repeat_last_n 0: no window, no penalty (llama.cpp's penalties sampler is off)
    assert step0("/completion", {**pen, "repeat_last_n": 0}) == base
    assert step0("/v1/completions", pen) == step0("/v1/completions", {})   # nothing generated yet


@pytest.mark.parametrize("body, param", [
    ({"mirostat": 3}, "mirostat"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"post_sampling_probs": True}, "post_sampling_probs"),
    ({"grammar": 'root ::= "yes" | "no"', "grammar_lazy": True}, "grammar_lazy"),   # was applied at once
    ({"grammar": 'root ::= "yes"', "grammar_triggers": [{"type": 0, "value": "ZZ"}]}, "grammar_triggers"),
    ({"samplers": ["temperature", "top_k"]}, "samplers"),
    ({"samplers": ["top_k", "magic"]}, "samplers"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, 10 ** 9]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"logit_bias": [["Hello", -1.0]]}, "logit_bias"),
    ({"n_probs": 50}, "n_probs"),
    ({"n": 2}, "n"),   # was run as two sequences, both streamed into one answer, one left running on a disconnect
    ({"logit_bias": {"5": True}}, "logit_bias"),   # was read as +1
    ({"logit_bias": [[5, True]]}, "logit_bias"),
    ({"logit_bias": [[5.5, 1.0]]}, "logit_bias"),   # a token id is an integer (5.0 is one)
    ({"logit_bias": {"1_0": 1.0}}, "logit_bias"),   # int() read these as 10
    ({"logit_bias": {" 10": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-5": 1.0}}, "logit_bias"),
    ({"image_data": [{"data": "AAAA", "id": 1}]}, "image_data"),
    # fields of the OpenAI endpoints (and llama-server's) this endpoint cannot honour: they were dropped in silence
    ({"logprobs": 5}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 3}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"echo": True}, "echo"),
    ({"suffix": "world"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"max_completion_tokens": 1}, "max_completion_tokens"),   # ran to the end of the text
    ({"return_progress": True}, "return_progress"),
    ({"n_cmpl": 2}, "n_cmpl"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"json_schema": '{"type": "object"}'}, "json_schema"),   # a string: was "Input should be a valid boolean"
])
def test_completion_refusals_name_the_field(server, body, param):
    r = post(server, "/completion", {"prompt": P, "n_predict": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.parametrize("body, says", [
    ({"logprobs": 5}, "n_probs"),
    ({"top_logprobs": 3}, "n_probs"),
    ({"max_completion_tokens": 1}, "n_predict"),
    ({"post_sampling_probs": True}, "post_sampling_probs true: not supported (only false, off)"),
    ({"tfs_z": 0.5}, "tfs_z 0.5: not supported (only 1.0, off: llama.cpp removed tail-free sampling)"),
    ({"image_data": [{"data": "AAAA", "id": 1}]}, 'image_data [{"data": "AAAA", "id": 1}]: not supported (only null'),
    ({"json_schema": '{"type": "object"}'}, "json_schema: a JSON Schema is an object (or true / false), not a string"),
])
def test_completion_refusals_say_what_to_send_in_json(server, body, says):
    """A refusal names /completion's own field where there is one, and writes the value sent as JSON spells it
    (true, double quotes: not Python's True and single quotes)."""
    r = post(server, "/completion", {"prompt": P, "n_predict": 2, **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_completion_takes_those_fields_at_their_off_values(server):
    """What clients send by default (false, null, best_of 1, an empty suffix or kwargs) is not a refusal."""
    off = {"logprobs": False, "top_logprobs": None, "echo": False, "best_of": 1, "suffix": "",
           "return_progress": False, "n_cmpl": 1, "chat_template_kwargs": {}, "max_completion_tokens": None}
    assert complete(server, **off)["content"] == complete(server)["content"]


@pytest.mark.parametrize("body, param", [
    ({"post_sampling_probs": True}, "post_sampling_probs"),
    ({"t_max_predict_ms": 500}, "t_max_predict_ms"),
    ({"lora": [{"id": 0, "scale": 1.0}]}, "lora"),
    ({"grammar": 'root ::= "yes" | "no"', "grammar_lazy": True}, "grammar_lazy"),   # was applied at once
    ({"grammar": 'root ::= "yes"', "grammar_triggers": [{"type": 0, "value": "ZZ"}]}, "grammar_triggers"),
    ({"samplers": ["temperature", "top_k"]}, "samplers"),
    ({"samplers": "kq"}, "samplers"),
    ({"n_probs": 3}, "n_probs"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_llama_server_fields_are_read_on_the_openai_endpoints_too(server, path, body, param):
    """llama-server reads its extras on its OpenAI endpoints as on /completion (its web UI sends `samplers` to
    /v1/chat/completions): what /completion refuses is refused there too, where it used to be dropped in silence
    (a lazy grammar was applied from the first token)."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": P}
    r = post(server, path, {**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_samplers_take_effect_on_the_openai_endpoints(server):
    """A sampler left out of `samplers` is off on the OpenAI endpoints as on /completion: the same draw as that
    sampler's "off" value (top_k 5 left out of the chain is top_k 0), and not the draw with top_k 5."""
    kw = dict(temperature=1.0, seed=3, max_tokens=16, top_p=1.0, min_p=0.0)
    for path, base, text in (("/v1/completions", {"prompt": P}, lambda j: j["choices"][0]["text"]),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}]},
                              lambda j: j["choices"][0]["message"]["content"])):
        def draw(**extra):
            r = post(server, path, {**base, **kw, **extra})
            assert r.status_code == 200, r.text
            return text(r.json())
        off = draw(top_k=0)
        assert draw(samplers=["top_p", "min_p", "temperature"], top_k=5) == off == draw(samplers="pmt", top_k=5)
        assert draw(top_k=5) != off, path   # else the comparison says nothing


@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain;charset=UTF-8", None])
def test_a_json_body_is_read_whatever_its_content_type(server, ctype):
    """`curl -d` names its body application/x-www-form-urlencoded, a browser's fetch() of a string text/plain:
    llama-server and ollama read the JSON all the same, and so does every route here (it used to be a 400)."""
    headers = {"Content-Type": ctype} if ctype else {}
    for path, body, key in [("/completion", {"prompt": "Once", "n_predict": 2}, "content"),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2}, "choices"),
                            ("/api/generate", {"model": "m", "prompt": "Once", "stream": False,
                                               "options": {"num_predict": 2}}, "response"),
                            ("/tokenize", {"content": "Once"}, "tokens")]:
        r = httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=60)
        assert r.status_code == 200 and key in r.json(), (path, r.text)
    r = httpx.post(server.url + "/completion", content="prompt=Once", headers=headers, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]   # what it is, not its type


def test_no_limit_runs_to_the_context_s_end(server):
    """n_predict -1 (and max_tokens left out on /v1/completions) generate until the context is full: the last token
    needs no place in the cache, so a prompt 8 short of -c gets 9 tokens, and llama-server's `truncated` says the
    context ran out (one token fewer was made, as "limit", before)."""
    n_ctx = httpx.get(server.url + "/props").json()["default_generation_settings"]["n_ctx"]
    ids = [1] + [300] * (n_ctx - 9)
    r = post(server, "/completion", {"prompt": ids, "n_predict": -1, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] == 9 and r.json()["truncated"] is True
    o = post(server, "/v1/completions", {"prompt": ids, "temperature": 0, "ignore_eos": True}).json()
    assert o["usage"]["completion_tokens"] == 9 and o["choices"][0]["finish_reason"] == "length"


def test_stop_sequences_are_bounded_on_every_endpoint_that_takes_many(server):
    """Each stop string is matched at every token in the step all streams share: 20,000 of them made another
    client's stream 23x slower. llama-server's, Anthropic's and ollama's endpoints take up to 64 (OpenAI's 4)."""
    from bitnet_cpu.serve.schemas import MANY_STOPS
    ok = [f"zz{i}" for i in range(MANY_STOPS)]
    over = ok + ["zz-more"]
    for path, body, field in (("/completion", {"prompt": P, "n_predict": 2}, "stop"),
                              ("/v1/messages", {"model": "m", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": P}]}, "stop_sequences"),
                              ("/api/generate", {"model": "m", "prompt": P, "stream": False,
                                                 "options": {"num_predict": 2}}, "options.stop")):
        def with_stops(stops):
            if field == "options.stop":
                return {**body, "options": {**body["options"], "stop": stops}}
            return {**body, field: stops}
        assert post(server, path, with_stops(ok)).status_code == 200, path
        r = post(server, path, with_stops(over))
        assert r.status_code == 400 and f"at most {MANY_STOPS}" in r.text, (path, r.text)


def test_dry_sequence_breakers_are_bounded(server):
    """DRY's breakers each cost scans of the vocabulary (the first time a list is seen): thousands held the server
    for minutes, also after the client left. At most 64, as a 400 naming the field."""
    from bitnet_cpu.engine.runtime.sampling import MAX_DRY_BREAKERS
    body = {"prompt": P, "n_predict": 2, "dry_multiplier": 0.8}
    assert post(server, "/completion", {**body, "dry_sequence_breakers": ["x"] * MAX_DRY_BREAKERS}).status_code == 200
    r = post(server, "/completion", {**body, "dry_sequence_breakers": [f"b{i}" for i in range(MAX_DRY_BREAKERS + 1)]})
    assert r.status_code == 400 and "dry_sequence_breakers" in r.text and f"at most {MAX_DRY_BREAKERS}" in r.text


@pytest.mark.parametrize("path, body, says", [
    ("/completion", {"dry_sequence_breakers": "\n"}, 'dry_sequence_breakers: expected an array of strings, got "\\n"'),
    ("/completion", {"dry_multiplier": 1, "dry_sequence_breakers": ["", "x"]}, 'dry_sequence_breakers ["", "x"]: '),
    ("/completion", {"temperature": "0.5"}, 'temperature: expected a number, got "0.5"'),
    ("/completion", {"logit_bias": {"abc": 1}}, 'logit_bias "abc": '),
    ("/completion", {"samplers": ["top_k", 5]}, "samplers: expected an array of strings, got [\"top_k\", 5]"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, 'reasoning_effort "high": '),
    ("/embedding", {"content": "hi", "embd_normalize": True}, "embd_normalize true: "),
    ("/api/generate", {"options": {"temperature": "hot"}}, 'options.temperature "hot": must be a number'),
    ("/api/generate", {"options": {"mirostat": "2"}}, 'options.mirostat "2": must be an integer'),
])
def test_refusals_spell_types_and_values_as_json(server, path, body, says):
    """A refusal names JSON's types (an array, not Python's tuple or list) and echoes the value as JSON spells it
    (true, "x", ["", "x"]: not Python's True, 'x', ('', 'x')), as the client sent it."""
    base = {"/completion": {"prompt": P, "n_predict": 2}, "/embedding": {},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "/api/generate": {"model": "m", "prompt": P, "stream": False}}[path]
    r = post(server, path, {**base, **body})
    assert r.status_code == 400, r.text
    msg = r.json()["error"] if path.startswith("/api/") else r.json()["error"]["message"]
    assert says in msg, msg
    assert not any(w in msg for w in ("tuple", "True", " '", "('")), msg


def test_every_route_answers_the_loading_503_as_health_does():
    """While the model loads, every route that needs it answers /health's 503 (llama-server's
    "unavailable_error", Retry-After): /slots and the generating routes said "server_error", a server fault to
    the proxies and balancers that sort errors by type."""
    import threading

    from starlette.testclient import TestClient

    from bitnet_cpu.engine.api import load_engine
    from bitnet_cpu.serve.app import create_app
    gate = threading.Event()

    def load():
        gate.wait(60)
        return load_engine(None, threads=1, parallel=1, progress=False)
    try:
        with TestClient(create_app(load)) as tc:
            health = tc.get("/health")
            assert health.status_code == 503 and health.json()["error"]["type"] == "unavailable_error"
            for method, path, body in (("GET", "/slots", None), ("GET", "/props", None),
                                       ("POST", "/tokenize", {"content": "hi"}),
                                       ("POST", "/completion", {"prompt": "hi", "n_predict": 1}),
                                       ("POST", "/v1/chat/completions", {"messages": [{"role": "user",
                                                                                       "content": "hi"}]})):
                r = tc.request(method, path, json=body)
                assert r.status_code == 503 and r.json() == health.json(), (path, r.text)
                assert r.headers["retry-after"] == health.headers["retry-after"], path
            gate.set()
    finally:
        gate.set()


def test_a_load_that_ends_after_shutdown_closes_its_engine():
    """The app shut down while its model still loaded: the load finished later and kept the engine (its threads,
    the weights mapped) with nobody left to close it, in a process that embeds the app and lives on."""
    import threading

    from starlette.testclient import TestClient

    from bitnet_cpu.engine.api import load_engine
    from bitnet_cpu.engine.errors import BitNetError
    from bitnet_cpu.serve.app import create_app
    gate, made = threading.Event(), []

    def load():
        gate.wait(60)
        made.append(load_engine(None, threads=1, parallel=1, progress=False))
        return made[0]
    try:
        with TestClient(create_app(load)) as tc:
            assert tc.get("/health").status_code == 503
            loading = [t for t in threading.enumerate() if t.name == "bitnet-load"]
    finally:
        gate.set()   # the load goes on after the app's shutdown
    for t in loading:
        t.join(60)
    assert made, "the load did not run"
    with pytest.raises(BitNetError, match="closed"):
        made[0].submit("hi", max_tokens=1)
