"""Embeddings over HTTP (serve/embeddings.py) against a real `bitnet serve` subprocess on 127.0.0.1 with the bundled
model: the official `openai` client's embeddings.create (base64, its default, and float) and the `ollama` client's
embed / embeddings give the engine's own vectors (load_model(...).embed, the same bits); a text alone and in a
batch gives the same vector; token ids work; a text over the context, empty input, `dimensions` other than the
model's width and an unknown encoding are 400s in each API's shape; /metrics counts the texts."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install .[test])")
ollama = pytest.importorskip("ollama", reason="the ollama tests need the ollama client (pip install .[test])")
pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

SERVER_ARGS = ("--parallel", "4")   # conftest's server fixture
TEXTS = ["The capital of France is Paris.", "Ternary weights: -1, 0 and +1.", "hi"]


@pytest.fixture(scope="module")
def llm():
    from bitnet_cpu.engine.api import load_model
    m = load_model(None, threads=1, progress=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def oclient(server):
    return ollama.Client(host=server.url, timeout=60)


def f32(rows):
    return np.asarray(rows, np.float64).astype(np.float32)


def test_openai_client_base64_and_float_give_the_engine_vectors(client, llm, model_id):
    want = llm.embed(TEXTS)
    r = client.embeddings.create(model="text-embedding-3-small", input=TEXTS)   # the client asks for base64
    assert r.model == model_id and [d.index for d in r.data] == [0, 1, 2]
    assert np.array_equal(f32([d.embedding for d in r.data]), want)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(t) for t in llm.embed_tokens(TEXTS))
    r = client.embeddings.create(model=model_id, input=TEXTS, encoding_format="float")
    assert np.array_equal(f32([d.embedding for d in r.data]), want)
    alone = [client.embeddings.create(model=model_id, input=t, encoding_format="float").data[0].embedding
             for t in TEXTS]
    assert np.array_equal(f32(alone), want)
    ids = llm.embed_tokens(TEXTS)
    r = client.embeddings.create(model=model_id, input=ids, encoding_format="float")   # token ids, used as given
    assert np.array_equal(f32([d.embedding for d in r.data]), want)
    r = client.embeddings.create(model=model_id, input=ids[0], encoding_format="float")   # one list of ids
    assert np.array_equal(f32(r.data[0].embedding), want[0])
    r = client.embeddings.create(model=model_id, input=TEXTS[0], dimensions=llm.config.hidden_size)
    assert np.array_equal(f32(r.data[0].embedding), want[0])


def test_ollama_client_embed_and_embeddings(oclient, llm, model_id):
    want = llm.embed(TEXTS)
    r = oclient.embed(model=model_id, input=TEXTS)
    assert r.model == model_id and np.array_equal(f32(r.embeddings), want)
    assert r.prompt_eval_count == sum(len(t) for t in llm.embed_tokens(TEXTS)) and r.total_duration > 0
    assert np.array_equal(f32(oclient.embed(model=model_id, input=TEXTS[1]).embeddings), want[1:2])
    assert np.array_equal(f32(oclient.embeddings(model=model_id, prompt=TEXTS[2]).embedding), want[2])
    assert oclient.embed(model=model_id, input=[]).embeddings == []   # ollama: nothing to embed, a load
    assert oclient.embeddings(model=model_id, prompt="").embedding == []
    assert "embedding" in oclient.show(model_id).capabilities


def test_over_the_context_and_empty_inputs_are_400s(client, oclient, server, llm, model_id):
    n_ctx = client.models.list().data[0].model_extra["meta"]["n_ctx"]
    long_text = "word " * (n_ctx + 10)
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=model_id, input=["fine", long_text])
    assert ei.value.body["code"] == "context_length_exceeded" and "input.1" in ei.value.body["message"]
    assert ei.value.body["message"].startswith(f"This model's maximum context length is {n_ctx} tokens")
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=model_id, input=[[5] * (n_ctx + 1)])
    assert ei.value.body["code"] == "context_length_exceeded"
    for bad, param in (("", "input"), ([], "input"), (["a", ""], "input"), ([[]], "input")):
        with pytest.raises(openai.BadRequestError) as ei:
            client.embeddings.create(model=model_id, input=bad)
        assert ei.value.body["param"] == param, bad
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=model_id, input="x", dimensions=8)
    assert ei.value.body["param"] == "dimensions" and "dimensions 8" in ei.value.body["message"]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "encoding_format": "f16"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [1, "a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    with pytest.raises(ollama.ResponseError) as ei:   # truncate false: too long is a 400, as ollama's
        oclient.embed(model=model_id, input=["fine", long_text], truncate=False)
    assert ei.value.status_code == 400 and "input.1" in ei.value.error
    with pytest.raises(ollama.ResponseError) as ei:
        oclient.embeddings(model=model_id, prompt=long_text)
    assert ei.value.status_code == 400 and "However, prompt has" in ei.value.error   # one text: not "prompt.0"
    r = httpx.post(server.url + "/api/embed", json={"model": model_id, "input": "a", "dimensions": "256"})
    assert r.status_code == 400 and "expected an integer" in r.json()["error"]
    r = httpx.post(server.url + "/api/embed", json={"model": model_id, "input": ["a", ""]})
    assert r.status_code == 400 and r.json() == {"error": "input.1: an empty string has nothing to embed"}
    r = httpx.post(server.url + "/api/embed", json={"model": model_id, "input": "a", "dimensions": 3})
    assert r.status_code == 400 and "dimensions 3" in r.json()["error"]
    width = float(len(oclient.embed(model=model_id, input="a")["embeddings"][0]))   # JSON's 256.0 is 256, as on
    for path in ("/api/embed", "/v1/embeddings"):                                   # /v1/embeddings (ollama's: 400)
        r = httpx.post(server.url + path, json={"model": model_id, "input": "a", "dimensions": width})
        assert r.status_code == 200, (path, r.text)
    # truncate: true keeps the first n_ctx tokens, as ollama does
    cut = llm.tokenize(long_text, add_bos=True)[:n_ctx]
    r = httpx.post(server.url + "/api/embed", json={"model": model_id, "input": long_text, "truncate": True},
                   timeout=60)
    want = client.embeddings.create(model=model_id, input=[cut], encoding_format="float").data[0].embedding
    assert r.status_code == 200 and np.array_equal(f32(r.json()["embeddings"][0]), f32(want))
    # truncate left out is true, ollama's default (the ollama client sends nothing unless asked: a plain
    # ollama.embed() of a long chunk was a 400 here)
    plain = oclient.embed(model=model_id, input=["fine", long_text])
    assert np.array_equal(f32(plain.embeddings[1]), f32(want))
    # a text of megabytes is cut to what n_ctx tokens can cover before it is tokenized (the whole of it held the
    # interpreter for seconds, stalling every stream): the same first n_ctx tokens, the same vector
    huge = long_text * (2_000_000 // len(long_text))
    r = httpx.post(server.url + "/api/embed", json={"model": model_id, "input": huge, "truncate": True}, timeout=60)
    assert r.status_code == 200 and np.array_equal(f32(r.json()["embeddings"][0]), f32(want))
    r = httpx.post(server.url + "/api/embed", json={"model": model_id, "input": ["a"] * 2049})
    assert r.status_code == 400 and "at most 2048" in r.json()["error"]   # as /v1/embeddings


def test_token_ids_past_the_vocabulary_say_whose_ids_they_must_be(client, server, llm, model_id):
    """LangChain's OpenAIEmbeddings (check_embedding_ctx_length left at True) posts OpenAI's tiktoken ids, not
    text; ids past this model's vocabulary were a bare "token ids must be in 0..V-1", with nothing saying why a
    client sent them. The 400 now says the ids are this model's and how LangChain sends text instead."""
    past = llm.config.vocab_size + 7
    for path, body in (("/v1/embeddings", {"model": model_id, "input": [[3, past]], "encoding_format": "base64"}),
                       ("/embedding", {"content": [3, past]})):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        msg = r.json()["error"]["message"]
        assert f"0..{llm.config.vocab_size - 1}" in msg and "this model's own" in msg, msg
        assert "check_embedding_ctx_length=False" in msg and "\n" not in msg, msg
    with pytest.raises(openai.BadRequestError) as ei:   # the openai client sends token-id lists as they are
        client.embeddings.create(model=model_id, input=[[past]])
    assert ei.value.body["param"] == "input" and "tiktoken" in ei.value.body["message"]


def test_ollama_options_are_checked_and_num_ctx_bounds_the_input(oclient, client, server, llm, model_id):
    """ollama's `options` on /api/embed and /api/embeddings: checked as /api/generate checks them (an unknown one
    is the same 400; they were taken in silence), and num_ctx bounds each text at min(num_ctx, the context), as
    ollama's EmbedHandler does: truncate true (or left out, on /api/embed) keeps the first num_ctx tokens, false
    is a 400 (a text of 300 tokens was embedded whole under num_ctx 8)."""
    text = "hello world " * 100
    ids = llm.tokenize(text, add_bos=True)
    cut = client.embeddings.create(model=model_id, input=[ids[:8]], encoding_format="float").data[0].embedding
    whole = llm.embed(text)[0]

    def post(path, body):
        r = httpx.post(server.url + path, json={"model": model_id, **body}, timeout=60)
        return r.status_code, r.json()
    for extra in ({}, {"truncate": True}):
        code, got = post("/api/embed", {"input": ["hi", text], "options": {"num_ctx": 8}, **extra})
        assert code == 200 and np.array_equal(f32(got["embeddings"][1]), f32(cut)), extra
        assert got["prompt_eval_count"] == len(llm.tokenize("hi", add_bos=True)) + 8
    r = oclient.embed(model=model_id, input=text, options={"num_ctx": 8.0})   # JSON's 8.0 is 8, as ollama's
    assert np.array_equal(f32(r.embeddings[0]), f32(cut))
    code, got = post("/api/embed", {"input": ["hi", text], "options": {"num_ctx": 8}, "truncate": False})
    assert code == 400 and got["error"].startswith(f"input.1 has {len(ids)} tokens, over options.num_ctx 8"), got
    # num_ctx past the server's context is capped by it; 0 or less is the server's context (as on /api/generate)
    for num_ctx in (10 ** 6, 0, -1):
        code, got = post("/api/embed", {"input": text, "options": {"num_ctx": num_ctx}, "truncate": False})
        assert code == 200 and np.array_equal(f32(got["embeddings"][0]), whole), num_ctx
    # the older route: the same options and num_ctx (its truncate: see the next test)
    code, got = post("/api/embeddings", {"prompt": text, "options": {"num_ctx": 8}, "truncate": True})
    assert code == 200 and np.array_equal(f32(got["embedding"]), f32(cut))
    code, got = post("/api/embeddings", {"prompt": text, "options": {"num_ctx": 8}})
    assert code == 400 and got["error"].startswith(f"prompt has {len(ids)} tokens, over options.num_ctx 8"), got
    # an option that is not one, or a bad value, is /api/generate's own 400 on every route
    for options in ({"bogus_opt": 8}, {"num_ctx": "8"}, {"num_ctx": 8.5}, {"temperature": "hot"}, {"top_k": 1.5},
                    {"num_thread": "2"}, {"stop": 5}, {"tfs_z": 0.5}):
        code, want = post("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 1, **options}})
        assert code == 400 and want["error"].startswith("options."), (options, want)
        for path, field in (("/api/embed", "input"), ("/api/embeddings", "prompt")):
            code, got = post(path, {field: "hi", "options": options})
            assert code == 400 and got == want, (path, options, got)
        code, got = post("/api/embed", {"input": [], "options": options})   # a load request too, as /api/generate
        assert code == 400 and got == want, options
    # sampling options are accepted and ignored, as ollama ignores them for embeddings (nothing samples)
    sampled = {"temperature": 0.7, "seed": 3, "top_k": 5, "num_predict": 4, "stop": ["x"], "num_thread": 2}
    code, got = post("/api/embed", {"input": text, "options": sampled})
    assert code == 200 and np.array_equal(f32(got["embeddings"][0]), whole)
    code, got = post("/api/embeddings", {"prompt": text, "options": sampled})
    assert code == 200 and np.array_equal(f32(got["embedding"]), whole)


def test_older_api_embeddings_honours_dimensions_and_truncate(oclient, client, server, llm, model_id):
    """/api/embeddings took `dimensions` and `truncate` and ignored them (a 64 asked for, 256 answered; truncate
    true still refused a long prompt): they are /api/embed's, checked and honoured the same way. Left out,
    truncate is false here, as before (ollama's older endpoint has no such field): a long prompt is a 400."""
    n_ctx = client.models.list().data[0].model_extra["meta"]["n_ctx"]
    width = llm.config.hidden_size
    long_text = "word " * (n_ctx + 10)
    cut = llm.tokenize(long_text, add_bos=True)[:n_ctx]
    want = client.embeddings.create(model=model_id, input=[cut], encoding_format="float").data[0].embedding

    def post(body):
        r = httpx.post(server.url + "/api/embeddings", json={"model": model_id, **body}, timeout=60)
        return r.status_code, r.json()
    code, got = post({"prompt": "x", "dimensions": 64})
    assert code == 400 and got["error"].startswith(f"dimensions 64: this model's embeddings have {width}"), got
    code, got = post({"prompt": "x", "dimensions": "64"})
    assert code == 400 and "expected an integer" in got["error"]
    for dims in (width, float(width)):
        code, got = post({"prompt": "x", "dimensions": dims})
        assert code == 200 and np.array_equal(f32(got["embedding"]), llm.embed("x")[0]), dims
    code, got = post({"prompt": long_text, "truncate": True})
    assert code == 200 and np.array_equal(f32(got["embedding"]), f32(want))
    for truncate in (False, None):
        code, got = post({"prompt": long_text, "truncate": truncate})
        assert code == 400 and "However, prompt has" in got["error"], truncate
    code, got = post({"prompt": "x", "truncate": "yes"})
    assert code == 400 and got == {"error": "truncate: expected true or false"}


def test_many_contexts_of_token_ids_in_one_request(client, server, model_id, llm):
    """A request may carry many contexts' worth of token ids (the generating endpoints' body bound is one context);
    more than 2048 inputs is OpenAI's own 400."""
    n_ctx = client.models.list().data[0].model_extra["meta"]["n_ctx"]
    rng = np.random.default_rng(3)
    ids = [rng.integers(3, llm.config.vocab_size, n_ctx).tolist() for _ in range(6)]
    r = client.embeddings.create(model=model_id, input=ids, encoding_format="float")
    assert len(r.data) == 6 and r.usage.prompt_tokens == 6 * n_ctx
    assert np.array_equal(f32(r.data[5].embedding), f32(client.embeddings.create(
        model=model_id, input=[ids[5]], encoding_format="float").data[0].embedding))
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=model_id, input=["a"] * 2049)
    assert "at most 2048" in ei.value.body["message"]
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "input" in spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "required"]


def test_metrics_count_embedded_texts(client, server, model_id):
    from prometheus_client.parser import text_string_to_metric_families

    def count():
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
        return fams["bitnet_embedding_inputs"].samples[0].value
    before = count()
    client.embeddings.create(model=model_id, input=TEXTS)
    assert count() == before + len(TEXTS)


def test_llama_server_embedding_route(client, server, llm, model_id):
    """llama-server's /embedding (and its alias /embeddings): `content` or `input`; a string, token ids, ids and
    strings mixed (one prompt, BOS first when it starts with a string), or a list of prompts; the answer a list of
    {"index", "embedding": [vector]}, the engine's vectors; `embd_normalize` as llama.cpp's norms, on
    /v1/embeddings too."""
    want = llm.embed(TEXTS)

    def post(path, body):
        r = httpx.post(server.url + path, json=body, timeout=60)
        return r.status_code, r.json()
    code, got = post("/embedding", {"content": TEXTS[0]})
    assert code == 200 and [x["index"] for x in got] == [0] and len(got[0]["embedding"]) == 1
    assert np.array_equal(f32(got[0]["embedding"][0]), want[0])
    for path, field in (("/embedding", "input"), ("/embeddings", "content"), ("/embeddings", "input")):
        code, got = post(path, {field: TEXTS})
        assert code == 200 and [x["index"] for x in got] == [0, 1, 2], (path, field)
        assert np.array_equal(f32([x["embedding"][0] for x in got]), want), (path, field)
    ids = llm.tokenize(TEXTS[1], add_bos=False)
    for prompt, tokens in (([*ids[:3], llm.detokenize(ids[3:])], ids[:3] + llm.tokenize(llm.detokenize(ids[3:]))),
                           ([TEXTS[1], 5, 6], llm.tokenize(TEXTS[1], add_bos=True) + [5, 6]),
                           (ids, ids)):
        code, got = post("/embedding", {"content": prompt})
        ref = client.embeddings.create(model=model_id, input=[tokens], encoding_format="float").data[0].embedding
        assert code == 200 and len(got) == 1 and np.array_equal(f32(got[0]["embedding"][0]), f32(ref)), prompt
    code, got = post("/embedding", {"content": [TEXTS[0], ids]})   # a list of prompts
    assert code == 200 and np.array_equal(f32(got[0]["embedding"][0]), want[0])
    raw = llm.embed(TEXTS[0], normalize=-1)[0]
    code, got = post("/embedding", {"content": TEXTS[0], "embd_normalize": -1})
    assert code == 200 and np.array_equal(f32(got[0]["embedding"][0]), raw)
    code, got = post("/embedding", {"content": TEXTS[0], "embd_normalize": 2.0, "encoding_format": None})
    assert code == 200 and np.array_equal(f32(got[0]["embedding"][0]), want[0])   # as /v1/embeddings reads them
    r = client.embeddings.create(model=model_id, input=TEXTS[0], encoding_format="float",
                                 extra_body={"embd_normalize": 1})
    assert np.array_equal(f32(r.data[0].embedding), llm.embed(TEXTS[0], normalize=1)[0])
    for body, param, words in (({}, None, '"input" or "content" must be provided'),
                               ({"content": ""}, "content", "empty string"),
                               ({"content": []}, "content", "empty list"),
                               ({"input": ["a", [[1]]]}, "input", "input.1: expected a string"),
                               ({"content": [{"type": "text", "text": "a"}]}, "content", "not supported"),
                               ({"content": "a", "encoding_format": "base64"}, "encoding_format", "answers floats"),
                               ({"content": "a", "embd_normalize": -2}, "embd_normalize", "integer >= -1"),
                               ({"content": [10 ** 6]}, "content", "token ids must be in"),
                               ({"content": "word " * 5000}, "content", "context"),
                               # were taken: "" as floats, a width it cannot give, a norm past llama.cpp's int32
                               # (10**400 overflowed in the engine: a 500)
                               ({"content": "a", "encoding_format": ""}, "encoding_format", "answers floats"),
                               ({"content": "a", "dimensions": 64}, "dimensions", "64"),
                               ({"content": "a", "embd_normalize": 10 ** 400}, "embd_normalize", "integer >= -1")):
        code, got = post("/embedding", body)
        assert code == 400 and got["error"]["param"] == param and words in got["error"]["message"], body
    # an integer of 5,000 digits is valid JSON that Python will not read: a 400 naming its field, on OpenAI's and
    # ollama's routes (a plain-text 500 and a traceback in the log; then Python's own words)
    big = b'{"input": [' + b"1" * 5001 + b"]}"
    for path in ("/v1/embeddings", "/embedding", "/api/embed", "/api/chat"):
        r = httpx.post(server.url + path, content=big, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "input[0]: an integer of 5001 digits" in r.text, (path, r.text[:200])
        assert "set_int_max_str_digits" not in r.text, r.text
    r = client.embeddings.create(model=model_id, input="a", encoding_format="float")
    assert r.data[0].embedding   # and the server serves on


def test_pooling_none_gives_every_token_s_row_at_embedding_only(llm, model_id):
    """`bitnet serve --pooling none`: /embedding answers each prompt's rows, one per token, as they are (llama-
    server's shape); the routes that answer one vector a text (OpenAI's, ollama's) are 400s in their shapes, and
    so is an embd_normalize (such rows are never normalised) or more tokens than one context in a request."""
    from serve_proc import Server
    s = Server("--parallel", "2", "--pooling", "none", threads=1)
    try:
        r = httpx.post(s.url + "/embedding", json={"content": TEXTS[:2]}, timeout=60)
        assert r.status_code == 200
        for got, want in zip(r.json(), llm.embed(TEXTS[:2], pooling="none")):
            assert np.array_equal(f32(got["embedding"]), want)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "a"})
        assert r.status_code == 400 and "Pooling type 'none' is not OAI compatible" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/api/embed", json={"model": model_id, "input": "a"})
        assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]
        r = httpx.post(s.url + "/embedding", json={"content": "a", "embd_normalize": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "embd_normalize"
        n_ctx = httpx.get(s.url + "/props").json()["default_generation_settings"]["n_ctx"]
        r = httpx.post(s.url + "/embedding", json={"content": [[5] * (n_ctx // 2 + 1)] * 2})
        assert r.status_code == 400 and "every token is a vector" in r.json()["error"]["message"]
    finally:
        s.stop()
