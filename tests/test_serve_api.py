"""The rest of the OpenAI request surface against a real `bitnet serve` subprocess (bundled model), with the
official `openai` client: logprobs equal a direct log-softmax of the engine's own logits (load_model(...).forward)
for the same tokens, streamed and not; n choices (greedy: identical; seeded: the same every run) with one
prompt prefill counted in /metrics; presence / frequency penalties and logit_bias give what the engine gives
for the same SamplingParams; any model name answers with the served id, --alias renames it and
--strict-model-name keeps the 404."""
from __future__ import annotations

import itertools
import json
import math
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install .[test])")
pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from serve_proc import Server  # noqa: E402

Q = [{"role": "user", "content": "What is 12+7?"}]
ALIAS = "my-bitnet"


@pytest.fixture(scope="module")
def server():
    """This module's server (served under an alias); `client` comes from conftest.py."""
    s = Server("--parallel", "8", "--alias", ALIAS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    from bitnet_cpu.engine.api import load_model
    m = load_model(None, threads=1, progress=False)
    yield m
    m.close()


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _prefilled(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    return fams["bitnet_prefill_tokens"].samples[0].value


def test_alias_and_any_model_name(client, server):
    assert [m.id for m in client.models.list().data] == [ALIAS]
    for name in ("gpt-4o-mini", ALIAS):
        r = client.chat.completions.create(model=name, messages=Q, max_tokens=2)
        assert r.model == ALIAS
        # models.retrieve: the model a request naming it gets
        assert client.models.retrieve(name).model_dump() == client.models.list().data[0].model_dump()
    s = Server("--strict-model-name")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        mid = c.models.list().data[0].id
        with pytest.raises(openai.NotFoundError) as ei:
            c.chat.completions.create(model="gpt-17", messages=Q, max_tokens=2)
        assert ei.value.body["param"] == "model" and mid in ei.value.body["message"]
        assert c.chat.completions.create(model=mid, messages=Q, max_tokens=2).model == mid
        assert c.models.retrieve(mid).id == mid
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("gpt-17")
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_log_softmax_of_engine_logits(client, llm, stream):
    from bitnet_cpu.engine.api import SamplingParams
    ids = llm.chat_prompt(Q)
    want = [c.token for c in llm.generate(ids, SamplingParams(temperature=0), max_tokens=12) if c.token is not None]
    ref = _log_softmax(llm.forward(ids + want[:-1])[len(ids) - 1:])
    kw = dict(model=ALIAS, messages=Q, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    if stream:
        entries = [e for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                   for e in ch.choices[0].logprobs.content]
    else:
        entries = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(entries) == len(want)
    for j, (e, t) in enumerate(zip(entries, want)):
        assert bytes(e.bytes) == llm.tokenizer.token_bytes(t) or llm.tokenizer.token_bytes(t) is None
        assert abs(e.logprob - ref[j, t]) < 1e-4
        top = np.argsort(-ref[j], kind="stable")[:3]
        assert [round(x.logprob, 4) for x in e.top_logprobs] == [round(float(ref[j, i]), 4) for i in top]
        assert e.top_logprobs[0].logprob == e.logprob   # greedy: the chosen token is the most likely


def test_completion_logprobs_shape(client, llm):
    r = client.completions.create(model=ALIAS, prompt="Once upon a time", temperature=0, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(t) == 2 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=ALIAS, prompt="x", logprobs=6)
    assert ei.value.body["param"] == "logprobs"


def _stops_cutting(tokens, text, mid):
    """Two stop strings for a greedy answer (its logprobs tokens and text): the second starts at a token k
    (mid: one character into it) and ends with token k + 1, seen nowhere before; the first is token k - 1 and a
    character the text never has, so token k - 1 is held back until token k comes. Returns (stops, k, cut)."""
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens) + 1)]
    for k in range(2, len(tokens) - 2):
        cut = starts[k] + mid
        stop = text[cut:starts[k + 2]]
        if len(tokens[k]) > 1 and tokens[k - 1] and stop and text.find(stop) == cut and "\x01" not in text:
            return [tokens[k - 1] + "\x01", stop], k, cut
    pytest.fail(f"no token to cut at in {tokens!r}")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mid", [0, 1], ids=["at-a-token", "mid-token"])
def test_stop_string_tokens_have_no_logprobs(client, stream, mid):
    """The tokens of a stop string, cut from the text, are not in the logprobs either: a token is there when
    its text has begun in the answer (mid: the token the stop string starts inside stays), text_offset never
    points past the text, and a stream carries each record with its text (a token held back as a possible
    stop string used to go out with the text released beside it, before the stop string was known)."""
    kw = dict(model=ALIAS, prompt="Once upon a time", temperature=0, max_tokens=24, logprobs=1)
    full = client.completions.create(**kw).choices[0]
    toks = full.logprobs.tokens
    assert "".join(toks) == full.text
    stops, k, cut = _stops_cutting(toks, full.text, mid)
    if stream:
        text, got, offsets, finish = "", [], [], None
        for ch in client.completions.create(stream=True, stop=stops, **kw):
            c = ch.choices[0]
            text += c.text
            if c.logprobs is not None:
                got += c.logprobs.tokens
                offsets += c.logprobs.text_offset
                assert len(text) > max(c.logprobs.text_offset)   # a record goes out with its text
            finish = c.finish_reason or finish
    else:
        c = client.completions.create(stop=stops, **kw).choices[0]
        text, got, offsets, finish = c.text, c.logprobs.tokens, c.logprobs.text_offset, c.finish_reason
    assert finish == "stop" and text == full.text[:cut]
    assert got == toks[:k + mid]
    assert offsets == [sum(len(t) for t in toks[:i]) for i in range(k + mid)]
    assert all(o < len(text) for o in offsets)


def test_echo_scores_every_prompt_token_as_the_engines_logits(client, llm):
    """echo + logprobs: each prompt token's logprob given the ones before it, to the last digit of a direct
    log-softmax of load_model(...).forward over the same ids; the first token of a token-id prompt has none
    (null), a text prompt's BOS is not echoed; the completion's own tokens follow."""
    text = "Once upon a time, a fox met three owls."
    ids = llm.tokenize(text, add_bos=True)
    ref = _log_softmax(llm.forward(ids))
    want = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
    r = client.completions.create(model=ALIAS, prompt=text, temperature=0, max_tokens=3, logprobs=2, echo=True)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(text) and len(lp.tokens) == len(ids) - 1 + 3
    # the engine's exp runs in f32 (summed in f64), the reference all in f64
    np.testing.assert_allclose(lp.token_logprobs[: len(ids) - 1], want, rtol=0, atol=1e-6)
    assert [max(t, key=t.get) for t in lp.top_logprobs[: len(ids) - 1]] == \
        [llm.tokenizer.decode([int(np.argmax(ref[j - 1]))]) for j in range(1, len(ids))]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = client.completions.create(model=ALIAS, prompt=text, temperature=0, max_tokens=3, logprobs=2)
    assert c.text == text + plain.choices[0].text
    assert lp.token_logprobs[len(ids) - 1:] == plain.choices[0].logprobs.token_logprobs
    # token ids as lm-evaluation-harness sends them ([[ids]]); scoring alone (max_tokens 0)
    raw = httpx.post(str(client.base_url) + "completions", timeout=60, json={
        "model": ALIAS, "prompt": [ids[1:]], "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}).json()
    got = raw["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids) - 1
    tail = _log_softmax(llm.forward(ids[1:]))
    np.testing.assert_allclose(got[1:], [tail[j - 1, ids[1:][j]] for j in range(1, len(ids) - 1)], rtol=0, atol=1e-6)
    assert raw["choices"][0]["text"] == llm.tokenizer.decode(ids[1:])


def test_echo_as_lm_evaluation_harness_reads_it(client, llm):
    """lm-evaluation-harness's local-completions loglikelihood request (context + continuation as token ids,
    max_tokens 1, logprobs 1, echo) and its own reading of the answer: sum(token_logprobs[ctxlen:-1]) and
    is_greedy (each continuation token is the top one) equal the reference's."""
    ctx = llm.tokenize("The capital of France is", add_bos=True)
    for cont_text in (" Paris", " a big city by the river"):
        cont = llm.tokenize(cont_text)
        ids = ctx + cont
        body = {"model": ALIAS, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                "echo": True}
        choice = httpx.post(str(client.base_url) + "completions", json=body, timeout=60).json()["choices"][0]
        token_lps = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(token_lps, tops))
        ref = _log_softmax(llm.forward(ids))
        want = [ref[len(ctx) + j - 1, cont[j]] for j in range(len(cont))]
        assert sum(token_lps) == pytest.approx(sum(want), abs=1e-5)
        assert is_greedy == all(int(np.argmax(ref[len(ctx) + j - 1])) == cont[j] for j in range(len(cont)))


def test_echo_streams_the_prompt_first_and_every_choice_echoes(client):
    kw = dict(model=ALIAS, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True)
    whole = client.completions.create(**kw, n=2)
    assert all(c.text.startswith("Once upon a time") and c.logprobs is None for c in whole.choices)
    chunks = list(client.completions.create(**kw, stream=True, logprobs=1))
    assert chunks[0].choices[0].text == "Once upon a time" and chunks[0].choices[0].logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_several_prompts_in_one_request(client, llm):
    """OpenAI's prompt arrays: texts or token lists, choice p * n + j of prompt p, each as that prompt alone gives
    it (greedy), echoed and scored per prompt; usage counts every prompt; streamed alike."""
    texts = ["Once upon a time", "The little fox", "In the morning the sea was"]
    alone = [client.completions.create(model=ALIAS, prompt=t, temperature=0, max_tokens=5).choices[0].text
             for t in texts]
    r = client.completions.create(model=ALIAS, prompt=texts, temperature=0, max_tokens=5, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(llm.tokenize(t, add_bos=True)) for t in texts)
    ids = [llm.tokenize(t, add_bos=True) for t in texts]
    raw = httpx.post(str(client.base_url) + "completions", timeout=60, json={
        "model": ALIAS, "prompt": ids, "max_tokens": 0, "logprobs": 1, "echo": True}).json()["choices"]
    for c, t, i in zip(raw, texts, ids):
        ref = _log_softmax(llm.forward(i))
        assert c["text"] == llm.tokenizer.decode(i) and c["logprobs"]["token_logprobs"][0] is None
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:], [ref[j - 1, i[j]] for j in range(1, len(i))],
                                   rtol=0, atol=1e-6)
    got = ["", "", ""]
    for ch in client.completions.create(model=ALIAS, prompt=texts, temperature=0, max_tokens=5, stream=True):
        for c in ch.choices:
            got[c.index] += c.text
    assert got == alone


def test_n_choices_one_prefill(client, server):
    q = [{"role": "user", "content": "Tell me about a purple walrus named Quintus."}]
    before = _prefilled(server)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": q, "n": 4, "temperature": 0, "max_tokens": 16}).json()
    t = r["timings"]
    assert _prefilled(server) - before == t["prompt_n"] > 0   # one prefill, not four (prompt_n: the part run)
    assert t["cache_n"] == t["cached_n"] and set(t) >= {"prompt_ms", "predicted_ms", "predicted_per_token_ms"}
    texts = [c["message"]["content"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and len(set(texts)) == 1 and texts[0]
    assert r["usage"]["prompt_tokens"] == t["prompt_n"] + t["cache_n"]
    one = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                     json={"messages": q, "temperature": 0, "max_tokens": 16}).json()
    assert r["usage"]["completion_tokens"] == 4 * one["usage"]["completion_tokens"]   # prompt once, answers 4x
    assert one["choices"][0]["message"]["content"] == texts[0]
    # the same prompt again: OpenAI's usage says how much of it the prefix cache held (llama-server's cache_n)
    held = one["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert held == one["timings"]["cache_n"] > 0 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
    hot = dict(model=ALIAS, messages=Q, n=4, temperature=1.0, top_p=1.0, seed=11, max_tokens=16,
               extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True})
    a = client.chat.completions.create(**hot)
    b = client.chat.completions.create(**hot)
    ta, tb = [c.message.content for c in a.choices], [c.message.content for c in b.choices]
    assert ta == tb and len(set(ta)) > 1
    assert a.usage.completion_tokens == 4 * 16 and a.usage.prompt_tokens == b.usage.prompt_tokens
    # streamed: every chunk names its choice; the pieces of each choice make the same texts
    pieces = {i: "" for i in range(4)}
    finished = []
    for ch in client.chat.completions.create(stream=True, **hot):
        for c in ch.choices:
            pieces[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.append(c.index)
    assert [pieces[i] for i in range(4)] == ta and sorted(finished) == [0, 1, 2, 3]
    comp = client.completions.create(model=ALIAS, prompt="Once", n=3, temperature=0, max_tokens=5)
    assert len({c.text for c in comp.choices}) == 1 and comp.usage.completion_tokens == 15


def test_penalties_and_bias_as_the_engine_does(client, llm):
    """On this prompt the greedy answer repeats its own tokens ("=", "+", digits); penalties change it exactly as
    the engine's sampler does for the same SamplingParams, and a -100 bias on its first greedy token too."""
    from bitnet_cpu.engine.api import SamplingParams
    prompt = "1, 2, 3, 4, 5, 6,"
    ids = llm.tokenize(prompt, add_bos=True)

    def local(**kw):
        return "".join(c.text for c in llm.generate(ids, SamplingParams(temperature=0, **kw), max_tokens=32,
                                                     ignore_eos=True))

    def served(**kw):
        extra = {"ignore_eos": True}
        if "logit_bias" in kw:
            extra["logit_bias"] = {str(k): v for k, v in kw.pop("logit_bias").items()}
        return client.completions.create(model=ALIAS, prompt=prompt, temperature=0, max_tokens=32, **kw,
                                         extra_body=extra).choices[0].text

    plain = local()
    assert served() == plain
    for pen in (dict(presence_penalty=1.5), dict(frequency_penalty=1.0), dict(presence_penalty=0.5, frequency_penalty=2.0)):
        assert served(**pen) == local(**pen) != plain, pen
    first = next(c.token for c in llm.generate(ids, SamplingParams(temperature=0), max_tokens=1))
    bias = {first: -100.0}
    assert served(logit_bias=dict(bias)) == local(logit_bias=dict(bias)) != plain


def test_hangup_cancels_every_choice(tmp_path_factory):
    """A streamed n=4 request on a slow model (ignore_eos: four answers of 1500 tokens, seconds here, minutes
    under qemu): hanging up after the first event cancels all four sequences (slots empty, far fewer tokens than
    four full answers). Waited for up to about the time four whole answers take, so only the count decides."""
    import time

    from helpers import slowness
    from serve_proc import slow_model
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "4", threads=1)
    try:
        body = {"prompt": "a", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "n": 4, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30 * slowness()) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
        t_hangup = time.monotonic()
        st = s.slots_when_idle(timeout=120 * slowness())
        made = st["metrics"]["tokens_generated_total"]
        print(f"\nhung up: slots free {time.monotonic() - t_hangup:.2f} s later, {made} tokens made")
        assert st["slots"] == [] and st["metrics"]["running"] == 0
        assert made < 4 * 750
        assert st["metrics"]["kv_pages_reserved"] == 0
    finally:
        assert s.stop()[0] == 0


def test_hangup_cancels_through_every_adapter(tmp_path_factory):
    """The Responses, Messages and llama-server /completion streams run through their own adapters' loops
    (serve/app.py builder_events, serve/llama_api.py): hanging up after the first event cancels the sequence there
    too (slots empty, far fewer tokens made than the whole answer), one API after another on one server."""
    from helpers import slowness
    from serve_proc import slow_model
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2", threads=1)
    q = [{"role": "user", "content": "a"}]
    try:
        made = 0
        for path, body in (("/v1/responses", {"input": "a", "max_output_tokens": 1500}),
                           ("/v1/messages", {"model": "m", "messages": q, "max_tokens": 1500}),
                           ("/completion", {"prompt": "a", "n_predict": 1500})):
            body = {**body, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.url + path, json=body, timeout=30 * slowness()) as r:
                assert r.status_code == 200, path
                assert any(x.startswith("data: ") for x in itertools.islice(r.iter_lines(), 4)), path
            st = s.slots_when_idle(timeout=120 * slowness())
            assert st["slots"] == [] and st["metrics"]["running"] == 0, path
            assert st["metrics"]["kv_pages_reserved"] == 0, path
            made, before = st["metrics"]["tokens_generated_total"], made
            assert made - before < 750, (path, made - before)
    finally:
        assert s.stop()[0] == 0


def test_non_streaming_hangup_cancels_decoding_and_queued_requests(tmp_path_factory):
    """A non-streaming client that hangs up (an SDK's timeout) cancels its sequence, whether it is decoding or
    still queued behind another: each answer would be 4,000 tokens (seconds on one thread), and only a cancel
    keeps the count far below that. They used to run to the end for nobody (request.is_disconnected() never saw
    the hang-up behind an @app.middleware, and was only asked while no token came). The client waits 0.25 s
    before it hangs up: the answers are long enough that a fast machine (1,500 tok/s on two threads made 800
    tokens in the 0.5 s this waited before) still stops far short of the end."""
    from helpers import slowness
    from serve_proc import slow_model
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "1", threads=1)
    q = [{"role": "user", "content": "a"}]
    gone = httpx.Timeout(30 * slowness(), read=0.25)   # no byte comes before the whole answer: a hang-up
    try:
        made = 0
        for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 4000}),
                           ("/v1/chat/completions", {"messages": q, "max_tokens": 4000}),
                           ("/v1/messages", {"model": "m", "messages": q, "max_tokens": 4000}),
                           ("/completion", {"prompt": "a", "n_predict": 4000}),
                           ("/api/generate", {"model": "m", "prompt": "a", "stream": False,
                                              "options": {"num_predict": 4000, "temperature": 0}})):
            body = {"temperature": 0, "ignore_eos": True, **body}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + path, json=body, timeout=gone)
            st = s.slots_when_idle(timeout=120 * slowness())
            assert st["slots"] == [] and st["metrics"]["kv_pages_reserved"] == 0, path
            made, before = st["metrics"]["tokens_generated_total"], made
            assert made - before < 2000, (path, made - before)   # cut in its first half: not run to the end
        # queued: the one slot holds a stream; the request behind it hangs up before it is admitted
        stream = {"prompt": "a", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=stream, timeout=30 * slowness()) as r:
            lines = r.iter_lines()   # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: ")
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + "/v1/completions", json={**stream, "stream": False}, timeout=gone)
            time.sleep(1.0)   # the hang-up is seen within a poll (0.5 s) of the queue's wait
            assert [x["state"] for x in httpx.get(s.url + "/slots").json()["slots"]] == ["running"]
        st = s.slots_when_idle(timeout=120 * slowness())   # the stream's tokens alone: the queued one made none
        assert st["slots"] == [] and st["metrics"]["tokens_generated_total"] - made <= 4000
        # echo + logprobs: the prompt's scoring pass, queued too, goes with its client (it was awaited before
        # anything watched the client, and ran over the whole prompt once the slot was free)
        with httpx.stream("POST", s.url + "/v1/completions", json=stream, timeout=30 * slowness()) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            echo = {"prompt": "a " * 300, "max_tokens": 5, "echo": True, "logprobs": 1}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + "/v1/completions", json=echo, timeout=gone)
            states, deadline = None, time.monotonic() + 30 * slowness()
            while states != ["running"] and time.monotonic() < deadline:
                time.sleep(0.1)
                states = [x["state"] for x in httpx.get(s.url + "/slots").json()["slots"]]
            assert states == ["running"]
        assert s.slots_when_idle(timeout=120 * slowness())["metrics"]["scored_tokens_total"] == 0
    finally:
        assert s.stop()[0] == 0


def test_n_choices_with_required_tool_calls(client):
    """n=3 with tool_choice "required": every choice is its own valid call (own grammar matcher and parser),
    streamed as per-choice delta.tool_calls numbered from 0 in each choice, the same calls as not streamed."""
    import json

    add = {"type": "function", "function": {"name": "add", "description": "add two integers", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}   # bounded: the tiny model
    kw = dict(model=ALIAS, messages=Q, tools=[add], tool_choice="required", n=3, temperature=0.8, seed=4,
              max_tokens=200, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    whole = []
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 1
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
        assert all(n == "add" and set(a) == {"a", "b"} and all(isinstance(v, int) for v in a.values()) for n, a in calls)
        whole.append(calls)
    got = {i: {} for i in range(3)}
    finish = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            for t in c.delta.tool_calls or []:
                got[c.index][t.index] = (t.function.name, json.loads(t.function.arguments))
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [[got[i][k] for k in sorted(got[i])] for i in range(3)] == whole
    assert all(sorted(got[i]) == list(range(len(whole[i]))) for i in range(3))
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}


def test_a_bias_that_bans_every_allowed_token_is_a_400_everywhere(server, llm):
    """A -inf logit_bias (llama-server's `false`) on every token, or on every token a grammar allows, leaves nothing
    to draw: each API answers its 400 saying so (a stream: its error event), and the Python API raises that one line,
    where the banned token 0 came back (200, NaN logprobs) and a grammar's case was a 500."""
    from bitnet_cpu.engine.api import SamplingParams
    from bitnet_cpu.engine.errors import BitNetError
    vocab, keep = llm.config.vocab_size, llm.tokenize("Once")[0]
    every = {str(i): -math.inf for i in range(vocab)}            # sent as JSON's -Infinity
    but_keep = [[i, False] for i in range(vocab) if i != keep]   # a grammar for "yes" allows none of what is left
    says = "no token is allowed here"
    chat = {"messages": Q, "max_tokens": 3, "logit_bias": every}
    refusals = {"/v1/chat/completions": {**chat, "logprobs": True, "top_logprobs": 2},
                "/v1/chat/completions#n": {**chat, "n": 2, "temperature": 0.8},
                "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 3, "logit_bias": every, "logprobs": 1},
                "/completion": {"prompt": "Once upon a time", "n_predict": 5, "temperature": 0, "n_probs": 1,
                                "logit_bias": [[i, False] for i in range(vocab)]},
                "/completion#grammar": {"prompt": "Is it raining?", "n_predict": 5, "temperature": 0,
                                        "grammar": 'root ::= "yes"', "logit_bias": but_keep},
                "/v1/responses": {"input": "hi", "max_output_tokens": 3, "logit_bias": every},
                "/v1/messages": {"model": "m", **chat}}
    head = {"Content-Type": "application/json"}
    for path, body in refusals.items():
        url = server.url + path.partition("#")[0]
        r = httpx.post(url, content=json.dumps(body), headers=head, timeout=60)
        assert r.status_code == 400 and says in r.text, (path, r.status_code, r.text)
        shape = r.json()
        if path == "/v1/messages":
            assert shape["type"] == "error" and shape["error"]["type"] == "invalid_request_error", shape
        else:
            assert shape["error"]["type"] == "invalid_request_error" and says in shape["error"]["message"], shape
        with httpx.stream("POST", url, content=json.dumps({**body, "stream": True}), headers=head, timeout=60) as s:
            text = s.read().decode()
        assert says in text and "begin_of_text" not in text and "NaN" not in text, (path, text)
    # without the grammar the one token left is what comes
    r = httpx.post(server.url + "/completion", json={"prompt": "Is it raining?", "n_predict": 1, "temperature": 0,
                                                      "logit_bias": but_keep, "return_tokens": True}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == [keep], r.text
    with pytest.raises(BitNetError, match=says):
        list(llm.generate("Once upon a time", SamplingParams(temperature=0, logit_bias={i: -math.inf for i in
                                                                                          range(vocab)},
                                                             record_logprobs=1), max_tokens=3))


def test_a_bias_that_bans_a_grammar_s_forced_tokens_is_refused_in_the_draft_pass(server, llm):
    """The grammar's forced tokens run as a draft (jump-forward) and are sampled in its verify pass: a bias that
    bans what the grammar forces there gets the same 400 (the Python API: the same BitNetError), not a 500."""
    from bitnet_cpu.engine.api import Constraint, SamplingParams
    from bitnet_cpu.engine.errors import BitNetError
    text = " there was a little girl named Lily"
    ids = post_json(server, "/tokenize", {"content": text}).json()["tokens"]
    vocab = llm.config.vocab_size
    bias = {i: -math.inf for i in range(vocab) if i not in ids[:3]}   # its first 3 tokens, then nothing
    body = {"prompt": "Once upon a time", "n_predict": 20, "temperature": 0, "grammar": f'root ::= "{text}"',
            "logit_bias": [[i, False] for i in bias]}
    r = post_json(server, "/completion", body)
    assert r.status_code == 400 and "no token is allowed here" in r.text, r.text
    assert post_json(server, "/completion", {**body, "logit_bias": []}).json()["content"] == text
    chunks = []
    with pytest.raises(BitNetError, match="no token is allowed here"):
        for c in llm.generate("Once upon a time", SamplingParams(temperature=0, logit_bias=bias), max_tokens=20,
                              constraint=Constraint.regex(text)):
            chunks.append(c.token)
    assert chunks == ids[:3]


def post_json(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_a_lone_surrogate_is_a_400_naming_the_field_everywhere(server):
    """JSON's "\\ud800" with no pair is no text: every endpoint that takes text answers 400 naming where it is
    (tokenizers, templates and response writers failed on it: 500s, or a 400 blaming the model file)."""
    bodies = {"/tokenize": '{"content": "a\\ud800b"}',
              "/v1/completions": '{"prompt": "a\\ud800b", "max_tokens": 1}',
              "/completion": '{"prompt": "a\\udc00", "n_predict": 1}',
              "/v1/embeddings": '{"input": "\\ud800"}',
              "/apply-template": '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
              "/v1/chat/completions": '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 1}',
              "/api/generate": '{"model": "m", "prompt": "a\\ud800", "stream": false}',
              "/v1/messages": '{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "\\ud800"}]}'}
    for path, body in bodies.items():
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "lone UTF-16 surrogate" in r.text, (path, r.text)
    ok = httpx.post(server.url + "/tokenize", content='{"content": "\\ud83d\\ude00 \\\\ud800"}',
                    headers={"Content-Type": "application/json"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["tokens"]   # a pair is one character; an escaped backslash is text


def test_utf8_encoded_surrogates_are_a_400_not_utf8_everywhere(server):
    """Raw bytes ED A0..BF (a UTF-16 surrogate encoded as UTF-8: CESU-8, Java's modified UTF-8) are not UTF-8: every
    body parser answers the 400 a byte 0xff gets (json.loads(bytes) let them through as lone surrogates: 500s, a 400
    blaming the rendered template, a stream cut short)."""
    s = b"\xed\xa0\xbd\xed\xb8\x80"   # U+1F600 as two encoded surrogates
    msgs = b'"messages": [{"role": "user", "content": "hi ' + s + b'"}]'
    bodies = {"/tokenize": b'{"content": "hi ' + s + b'"}',
              "/v1/completions": b'{"prompt": "hi ' + s + b'", "max_tokens": 1}',
              "/completion": b'{"prompt": "hi ' + s + b'", "n_predict": 1}',
              "/completion#stop": b'{"prompt": "hi", "n_predict": 4, "stream": true, "stop": ["' + s + b'"]}',
              "/v1/embeddings": b'{"input": "hi ' + s + b'"}',
              "/embedding": b'{"content": "hi ' + s + b'"}',
              "/api/embed": b'{"model": "m", "input": "hi ' + s + b'"}',
              "/apply-template": b"{" + msgs + b"}",
              "/v1/chat/completions": b"{" + msgs + b', "max_tokens": 1}',
              "/api/chat": b'{"model": "m", "stream": false, ' + msgs + b"}",
              "/v1/messages": b'{"model": "m", "max_tokens": 1, ' + msgs + b"}"}
    for path, body in bodies.items():
        r = httpx.post(server.url + path.split("#")[0], content=body, headers={"Content-Type": "application/json"},
                       timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "request body is not valid JSON: it is not UTF-8 text" in r.text, (path, r.text)
    ok = httpx.post(server.url + "/tokenize", content='{"content": "hi \U0001f600"}'.encode(),
                    headers={"Content-Type": "application/json"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["tokens"]   # the same character as UTF-8 is text


def test_a_content_part_is_refused_for_what_it_is(server):
    """An image part is refused because this model takes text only; a part type that is no content part at all
    (a typo, the Responses API's input_text sent to chat) is called unknown, not an unsupported medium."""
    def chat(part):
        return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [part]}], "max_tokens": 1})
    img = chat({"type": "image_url", "image_url": {"url": "http://x/y.png"}})
    assert img.status_code == 400 and "takes text only" in img.json()["error"]["message"], img.text
    for kind in ("txt", "input_text"):
        r = chat({"type": kind, "text": "hi"})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "not a content part type" in msg and "takes text only" not in msg, r.text
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": [{"role": "user", "content": [{"type": "txt", "text": "hi"}]}], "max_output_tokens": 1})
    assert r.status_code == 400 and "not a content part type" in r.json()["error"]["message"], r.text


def test_request_counts_are_labelled_by_route_not_by_url(server):
    """bitnet_http_requests_total's endpoint label is the route a request took (/v1/models/{model_name:path}),
    a URL no route takes is "other": made-up URLs cannot add series (memory, scrape size) without bound."""
    def series():
        return {x.split(" ")[0] for x in httpx.get(server.url + "/metrics").text.splitlines()
                if x.startswith("bitnet_http_requests_total{")}
    httpx.get(server.url + "/v1/models/warm-up")
    httpx.get(server.url + "/v1/no-such-route")
    # every served route is counted, outside /v1/ and /api/ too (a list of paths left these out), and a URL
    # outside them that no route takes is "other"
    for path in ("/models", "/openapi.json", "/", "/slots/7", "/no-such-page"):
        httpx.get(server.url + path)
    httpx.post(server.url + "/slots/7", params={"action": "save"})
    series()   # /metrics itself counted
    before = series()
    for i in range(40):
        httpx.get(server.url + f"/v1/no-such-route-{i}")
        httpx.get(server.url + f"/v1/models/name-{i}")
        httpx.get(server.url + f"/no-such-page-{i}")
        httpx.post(server.url + f"/slots/{i}", params={"action": "erase"})
    assert series() == before
    assert 'bitnet_http_requests_total{endpoint="other",status="404"}' in before
    for endpoint, status in (("/models", 200), ("/openapi.json", 200), ("/", 200), ("/slots/{id_slot}", 405),
                             ("/slots/{id_slot}", 501)):
        assert f'bitnet_http_requests_total{{endpoint="{endpoint}",status="{status}"}}' in before, (endpoint, before)
    # a body sent as curl -d sends it (form content type, read as JSON): counted under its route, not "other"
    def count(endpoint):
        for x in httpx.get(server.url + "/metrics").text.splitlines():
            if x.startswith(f'bitnet_http_requests_total{{endpoint="{endpoint}",status="200"}}'):
                return float(x.split(" ")[1])
        return 0.0
    was = count("/tokenize")
    r = httpx.post(server.url + "/tokenize", content=b'{"content": "hi"}',
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and count("/tokenize") == was + 1
    # answered before routing (a body over --max-body-mb): counted under the route that takes it, not "other"
    r = httpx.post(server.url + "/v1/chat/completions", content=b"x" * (5 << 20),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert 'bitnet_http_requests_total{endpoint="/v1/chat/completions",status="413"}' in series()


def test_a_body_nested_too_deeply_is_the_same_400_everywhere(server):
    """JSON nested past Python's recursion limit: one message and code on every endpoint (the ones FastAPI parses
    said 'There was an error parsing the body', code null)."""
    body = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
    for path in ("/v1/chat/completions", "/tokenize", "/v1/embeddings", "/api/chat"):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "nested too deeply" in r.text, (path, r.text)
