"""Many models behind one port (`bitnet serve --models-dir DIR`, serve/router.py): real router processes on
127.0.0.1 over a directory of two models that answer differently (the bundled one and a synthetic one) and a
damaged file, driven by the official openai, anthropic and ollama clients. Every answer through the router is
checked against a single-model `bitnet serve -m FILE` given the same request, never against stored text."""
from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from helpers import slowness  # noqa: E402
from serve_proc import ROOT, Server  # noqa: E402

CHAT = [{"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    d = tmp_path_factory.mktemp("models")
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), d / "tiny.bnstore")
    synth = SynthModel(small_config(max_position_embeddings=4096), seed=11)
    src = write_hf_dir(synth, str(tmp_path_factory.mktemp("hf") / "synth"))
    convert(src, str(d / "synth.bnstore"), progress=False)
    (d / "broken.bnstore").write_bytes(b"BNSTORE\x00" + b"\x17" * 4096)   # not a store: its load fails
    (d / "notes.txt").write_text("not a model")                           # not listed
    return d


@pytest.fixture(scope="module")
def router(models_dir):
    s = Server("--models-dir", str(models_dir), "--models-max", "2", "-c", "1024", threads=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def singles(models_dir):
    """A single-model server per model: the answers the router must give."""
    out = {name: Server("-m", str(models_dir / f"{name}.bnstore"), "-c", "1024", "--alias", name, threads=1)
           for name in ("tiny", "synth")}
    yield out
    for s in out.values():
        s.stop()


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60 * slowness(), **kw)


def chat_text(url, model, **extra):
    r = post(url, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 12, "temperature": 0,
                                           **extra})
    assert r.status_code == 200, r.text
    return r.json()


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond, timeout: float = 20.0):
    deadline = time.monotonic() + timeout * slowness()
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def loaded(url) -> set:
    """The loaded models' names as the catalog spells them (/api/ps lists each as ollama does, NAME:latest)."""
    return {m["name"].removesuffix(":latest") for m in httpx.get(url + "/api/ps", timeout=30).json()["models"]}


# ---- what it serves -----------------------------------------------------------------------------------------
def test_lists_every_model_of_the_directory(router):
    import ollama
    import openai

    ids = {m.id for m in openai.OpenAI(base_url=router.url + "/v1", api_key="x").models.list()}
    assert ids == {"tiny", "synth", "broken"}
    # as ollama lists a name without a tag of its own (its clients match a model against the list with the tag)
    assert {m.model for m in ollama.Client(host=router.url).list().models} == {f"{i}:latest" for i in ids}
    data = httpx.get(router.url + "/models", timeout=30).json()["data"]
    assert {d["id"]: d["path"] for d in data}["tiny"].endswith("tiny.bnstore")
    assert all(d["status"]["value"] in ("loaded", "loading", "unloaded") for d in data)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x")
    assert client.models.retrieve("synth").id == "synth"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_each_model_answers_as_its_own_server(router, singles):
    """Greedy chat (whole and streamed), ollama's generate and Anthropic's Messages through the router equal a
    single-model server's answers to the same requests: the request reached the model it named."""
    import anthropic
    import ollama
    import openai

    answers = {}
    for name, single in singles.items():
        got, want = chat_text(router.url, name), chat_text(single.url, name)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")   # (cached tokens: each server's own cache)
        assert [got["usage"][k] for k in counts] == [want["usage"][k] for k in counts] and got["model"] == name
        answers[name] = got["choices"][0]["message"]["content"]
        stream = openai.OpenAI(base_url=router.url + "/v1", api_key="x").chat.completions.create(
            model=name, messages=CHAT, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answers[name]
        opts = {"temperature": 0, "num_predict": 10}
        g = ollama.Client(host=router.url).generate(model=f"{name}:latest", prompt="Once upon", options=opts)
        assert g.response == ollama.Client(host=single.url).generate(model=name, prompt="Once upon",
                                                                     options=opts).response
        msg = dict(model=name, max_tokens=10, messages=CHAT, extra_body={"temperature": 0})
        a = anthropic.Anthropic(base_url=router.url, api_key="x").messages.create(**msg)
        assert a.content[0].text == anthropic.Anthropic(base_url=single.url, api_key="x").messages.create(
            **msg).content[0].text
    assert answers["tiny"] != answers["synth"]   # the two models tell apart
    assert {"tiny", "synth"} <= loaded(router.url)


def test_unknown_and_missing_model_in_each_apis_shape(router):
    import anthropic
    import ollama
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        openai.OpenAI(base_url=router.url + "/v1", api_key="x").chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.body["code"] == "model_not_found" and "tiny" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic.Anthropic(base_url=router.url, api_key="x").messages.create(model="claude", max_tokens=4,
                                                                               messages=CHAT)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=router.url).chat(model="llama3", messages=CHAT)
    # ollama's words: its CLI (ollama stop / rm, /load inside ollama run) branches on "model 'x' not found"
    assert e.value.status_code == 404 and "model 'llama3' not found" in e.value.error
    r = post(router.url, "/v1/chat/completions", {"messages": CHAT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    with pytest.raises(ollama.ResponseError) as e:   # the model exists, but it is pulled with `bitnet pull`
        ollama.Client(host=router.url).pull("tiny")
    assert e.value.status_code == 501 and "bitnet pull" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:   # without --models-cache nothing is deleted
        ollama.Client(host=router.url).delete("tiny")
    assert e.value.status_code == 501 and "bitnet rm" in e.value.error
    assert post(router.url, "/v1/chat/completions", {"model": 7, "messages": CHAT}).status_code == 400
    big = httpx.post(router.url + "/v1/chat/completions", content=b"x" * (5 << 20), timeout=30)
    assert big.status_code == 413   # the router's own --max-body-mb, before any model is touched
    r = httpx.post(router.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    show = post(router.url, "/api/show", {"name": "tiny"})   # ollama's older clients send `name`
    assert show.status_code == 200 and "tiny.bnstore" in show.json()["modelfile"]


def test_names_as_ollama_matches_them_and_its_heartbeat(router):
    """ollama matches model names case-insensitively, with or without ":latest" in any case; its CLI's heartbeat is
    HEAD / (and it answers HEAD on /api/version and /api/tags): every ollama command failed on a 400 first."""
    for name in ("tiny", "Tiny", "TINY:latest", "tiny:Latest"):
        r = post(router.url, "/api/generate", {"model": name, "prompt": "Hi", "stream": False,
                                               "options": {"num_predict": 2}})
        assert r.status_code == 200 and r.json()["model"] == "tiny", (name, r.text)
    assert post(router.url, "/api/generate", {"model": "tiny:v2", "prompt": "Hi"}).status_code == 404
    for path in ("/", "/api/version", "/api/tags"):
        assert httpx.head(router.url + path, timeout=30).status_code == 200, path


def test_a_name_of_several_models_is_one_answer_and_latest_is_no_part_of_a_file_name(tmp_path):
    """"ALPHA" beside alpha and Alpha was a 404 with neither loaded and whichever was loaded otherwise: always the
    404 now, naming both. A file named solo:latest.bnstore is `solo` too (ollama's NAME:latest is NAME)."""
    for name in ("alpha", "Alpha", "solo:latest"):
        shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / f"{name}.bnstore")
    s = Server("--models-dir", str(tmp_path), "-c", "1024", threads=1)
    try:
        def generate(name):
            return post(s.url, "/api/generate", {"model": name, "prompt": "Hi", "stream": False,
                                                 "options": {"num_predict": 1}})
        for name in ("solo", "Solo", "solo:latest"):
            r = generate(name)
            assert r.status_code == 200 and r.json()["model"] == "solo:latest", (name, r.text)
        for loaded_now in (None, "Alpha", "alpha"):
            if loaded_now is not None:
                assert generate(loaded_now).json()["model"] == loaded_now
                assert loaded_now in loaded(s.url)
            r = generate("ALPHA")
            assert r.status_code == 404, (loaded_now, r.text)
            assert "Alpha, alpha" in r.json()["error"], r.text
    finally:
        s.stop()


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/embed"])
def test_ollamas_load_duration_is_the_wait_for_the_load(router, path):
    """ollama's load_duration (in total_duration too) is the time a request waited for its model to load: it was
    0 through the router, also on the request that loaded the model. Once loaded it is 0, and a client cannot
    set it by sending the router's header to the model's process."""
    body = {"model": "synth", "stream": False, "options": {"num_predict": 2}}
    body.update({"/api/chat": {"messages": CHAT}, "/api/generate": {"prompt": "Hi"},
                 "/api/embed": {"input": "Hi"}}[path])
    post(router.url, "/models/unload", {"model": "synth"})
    assert wait_for(lambda: "synth" not in loaded(router.url))
    t0 = time.monotonic()
    cold = post(router.url, path, body)
    wall = (time.monotonic() - t0) * 1e9
    assert cold.status_code == 200, cold.text
    cold = cold.json()
    assert 0 < cold["load_duration"] < cold["total_duration"] <= wall, cold
    warm = post(router.url, path, body, headers={"x-bitnet-load-wait-ns": "123456789000"}).json()
    assert warm["load_duration"] == 0 and warm["total_duration"] > 0, warm


def test_request_timeout_never_counts_the_wait_for_a_load(models_dir):
    """--request-timeout times the request in its model's process, from when the model has it: the first request
    of a model whose load outlasts the limit is answered (it was a 504 "ran past the server's limit" while the load
    went on, which capped --models-load-timeout at --request-timeout), and a generation longer than the limit is
    still cut. The limit is a third of a first load's time on a server without one (a fixed 1 s was longer than
    the whole load on a fast machine: nothing was tested)."""
    def first_load(*flags: str) -> httpx.Response:
        s = Server("--models-dir", str(models_dir), "-c", "4096", *flags, threads=1)
        try:
            return post(s.url, "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False,
                                                 "options": {"num_predict": 2}})
        finally:
            s.stop()
    limit = first_load().json()["load_duration"] / 3e9
    s = Server("--models-dir", str(models_dir), "-c", "4096", "--request-timeout", f"{limit:.3f}", threads=1)
    try:
        r = post(s.url, "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False,
                                          "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        assert r.json()["load_duration"] > limit * 1e9, "the load was quicker than the limit: nothing was tested"
        long = post(s.url, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 100_000,
                                                    "ignore_eos": True})
        assert long.status_code == 504 and "--request-timeout" in long.text, long.text
    finally:
        s.stop()


def test_show_loads_a_model_once_at_most(router):
    """ollama's /api/show is metadata, asked of every listed model by clients: once answered, asking again never
    loads the model (nor unloads one in use to make room), and the answer is the model's own."""
    import ollama
    client = ollama.Client(host=router.url)
    first = client.show("synth")
    post(router.url, "/models/unload", {"model": "synth"})
    assert wait_for(lambda: "synth" not in loaded(router.url))
    again = client.show("synth")
    assert again.model_dump() == first.model_dump() and "synth" not in loaded(router.url)
    assert post(router.url, "/api/show", {"model": "nope"}).status_code == 404


def _metadata_router(tmp_path, models_dir):
    """A --models-max 1 router over tiny, synth, broken and synth-hf (the HF directory synth.bnstore was converted
    from, not converted here: its own cache)."""
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    d, cache = tmp_path / "models", tmp_path / "cache"
    d.mkdir()
    cache.mkdir()
    for name in ("tiny", "synth", "broken"):
        shutil.copy(models_dir / f"{name}.bnstore", d / f"{name}.bnstore")
    write_hf_dir(SynthModel(small_config(max_position_embeddings=4096), seed=11), str(d / "synth-hf"))
    return Server("--models-dir", str(d), "--models-max", "1", "-c", "1024", threads=1,
                  env={"BITNET_CACHE": str(cache)}), cache


def test_tags_give_family_and_size_of_models_never_loaded(tmp_path, models_dir, singles):
    """/api/tags had no family, families nor parameter_size for a model not loaded yet (Open WebUI's and Msty's
    model pickers show them): now read from each file, equal to a single-model server's; a file that cannot be
    read is listed all the same."""
    s, cache = _metadata_router(tmp_path, models_dir)
    try:
        tags = {m["name"].removesuffix(":latest"): m["details"]   # listed NAME:latest, as ollama lists them
                for m in httpx.get(s.url + "/api/tags", timeout=30).json()["models"]}
        for name, single in singles.items():
            assert tags[name] == httpx.get(single.url + "/api/tags", timeout=30).json()["models"][0]["details"]
        assert tags["synth-hf"] == {**tags["synth"], "format": "safetensors"}
        assert tags["broken"]["family"] == "" and tags["broken"]["parameter_size"] == ""
        assert loaded(s.url) == set() and not os.listdir(cache)
    finally:
        s.stop()


def test_tags_give_every_model_s_details_with_more_than_256_models(tmp_path):
    """The router kept 256 answers read from the files: with 300 models the first /api/tags listed 44 without
    family and parameter_size, and each later one read those again, evicting 44 others, which it then listed
    without. Every listing now gives every model's details, the same each time (hard links: one file's bytes)."""
    d = tmp_path / "many"
    d.mkdir()
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), d / "m000.bnstore")
    for i in range(1, 300):
        os.link(d / "m000.bnstore", d / f"m{i:03d}.bnstore")
    s = Server("--models-dir", str(d), "-c", "1024", threads=1)
    try:
        listings = []
        for _ in range(3):
            models = httpx.get(s.url + "/api/tags", timeout=120).json()["models"]
            listings.append({m["name"]: m["details"] for m in models})
        assert len(listings[0]) == 300
        assert [n for n, det in listings[0].items() if not det["family"] or not det["parameter_size"]] == []
        assert listings[1] == listings[0] and listings[2] == listings[0]
    finally:
        s.stop()


def test_a_gguf_or_hf_model_s_format_is_the_file_s_on_a_single_server_as_on_a_router(tmp_path):
    """details.format is of the file the user gave: a single server started with -m x.gguf listed "bnstore" (the
    format of the conversion it loads from the cache) while a router listing the same file said "gguf"; an HF
    directory the same ("safetensors"). Both now say what the file is, and the single server's details equal the
    router's, in /api/tags, /api/show and /api/ps."""
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_tq, write_hf_dir

    d, cache = tmp_path / "models", tmp_path / "cache"
    d.mkdir()
    cache.mkdir()
    m = SynthModel(small_config(), seed=3)
    write_gguf_tq(m, str(d / "g.gguf"), "TQ2_0")
    write_hf_dir(m, str(d / "h"))
    env = {"BITNET_CACHE": str(cache)}
    r = Server("--models-dir", str(d), "-c", "1024", threads=1, env=env)
    try:
        tags = {x["name"].removesuffix(":latest"): x["details"]
                for x in httpx.get(r.url + "/api/tags", timeout=60).json()["models"]}
        for name, path, fmt in (("g", d / "g.gguf", "gguf"), ("h", d / "h", "safetensors")):
            assert tags[name]["format"] == fmt, tags
            s = Server("-m", str(path), "-c", "1024", "--alias", name, threads=1, env=env)
            try:
                single = httpx.get(s.url + "/api/tags", timeout=60).json()["models"][0]["details"]
                assert single == tags[name], (name, single, tags[name])
                assert post(s.url, "/api/show", {"model": name}).json()["details"] == single
                assert httpx.get(s.url + "/api/ps", timeout=60).json()["models"][0]["details"] == single
                assert post(r.url, "/api/show", {"model": name}).json()["details"] == single
            finally:
                s.stop()
    finally:
        r.stop()


def test_show_reads_the_file_and_never_loads_a_model(tmp_path, models_dir, singles):
    """ollama answers /api/show from the model's file and loads nothing. The router loaded the model for the first
    show of it: it waited for a busy model to go idle, unloaded it to make room (--models-max 1, within its
    keep_alive), and each new request body ({"model"}, {"name"}, verbose false: what `ollama show` sends) loaded it
    again. Now the answer comes from the file, the loaded model stays, and it equals a single-model server's; an
    HF directory not converted yet answers from its own config."""
    def same(answer: dict) -> dict:   # a single server's answer of the same file but for where it lies
        return {k: v for k, v in answer.items() if k not in ("modelfile", "modified_at")}
    want = {name: same(post(single.url, "/api/show", {"model": name}).json()) for name, single in singles.items()}
    s, cache = _metadata_router(tmp_path, models_dir)
    try:
        chat_text(s.url, "tiny")   # loaded, idle within its keep_alive, in the one slot (--models-max 1)
        for body in ({"model": "tiny", "verbose": True}, {"model": "synth"}, {"name": "synth"},
                     {"model": "synth", "verbose": False}):
            got = post(s.url, "/api/show", body)
            assert got.status_code == 200 and same(got.json()) == want[body.get("model") or body["name"]], got.text
        assert loaded(s.url) == {"tiny"}   # it was synth: tiny unloaded for room, synth loaded for a show
        assert post(s.url, "/api/show", {"model": "synth"}).json()["modelfile"].endswith(
            f"FROM {tmp_path / 'models' / 'synth.bnstore'}\n")
        hf = post(s.url, "/api/show", {"model": "synth-hf"}).json()
        assert hf["details"] == {**want["synth"]["details"], "format": "safetensors"}
        assert {k: v for k, v in hf["model_info"].items() if k != "general.name"} == \
            {k: v for k, v in want["synth"]["model_info"].items() if k != "general.name"}
        assert [hf[k] for k in ("template", "parameters", "capabilities")] == \
            [want["synth"][k] for k in ("template", "parameters", "capabilities")]
        assert loaded(s.url) == {"tiny"}
        bad = post(s.url, "/api/show", {"model": "broken"})
        assert bad.status_code == 500 and "broken" in bad.json()["error"] and "\n" not in bad.json()["error"]
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert re.findall(r'bitnet_router_loads_total\{model="(.*?)"\}', metrics) == ["tiny"], metrics
        assert "bitnet_router_unloads_total{" not in metrics, metrics
        assert not os.listdir(cache)   # nothing converted for a show
    finally:
        s.stop()


def test_a_model_that_fails_to_load_is_one_error_and_the_rest_serve_on(router):
    r = post(router.url, "/v1/chat/completions", {"model": "broken", "messages": CHAT})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "load_failed" and "broken" in err["message"] and "\n" not in err["message"]
    assert "broken" not in loaded(router.url)
    assert chat_text(router.url, "tiny")["model"] == "tiny"
    metrics = httpx.get(router.url + "/metrics", timeout=30).text
    assert 'bitnet_router_load_failures_total{model="broken"}' in metrics


def test_a_file_that_fails_to_load_never_unloads_a_working_model_again(models_dir):
    """--models-max 1: a request for a model whose file fails to load unloaded the working model for room, and
    every retry (a client's, a model picker's) did it again, each time loading the broken file anew. The failure is
    remembered while the file is unchanged: the same 500, and the working model stays."""
    s = Server("--models-dir", str(models_dir), "--models-max", "1", "-c", "1024", threads=1)
    try:
        assert chat_text(s.url, "tiny")["model"] == "tiny"
        first = post(s.url, "/v1/chat/completions", {"model": "broken", "messages": CHAT})
        assert first.status_code == 500 and first.json()["error"]["code"] == "load_failed", first.text
        assert chat_text(s.url, "tiny")["model"] == "tiny"   # loaded again: the one unload for the first try
        for _ in range(2):
            again = post(s.url, "/v1/chat/completions", {"model": "broken", "messages": CHAT})
            assert again.status_code == 500 and again.json()["error"] == first.json()["error"], again.text
            assert loaded(s.url) == {"tiny"}
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert re.search(r'bitnet_router_loads_total\{model="broken"\} 1(\.0)?$', metrics, re.M), metrics
    finally:
        s.stop()


@pytest.mark.parametrize("body,words", [(b"{bad", "request body is not valid JSON"),
                                        (b"\xff{}", "request body is not valid JSON: it is not UTF-8 text"),
                                        (b"[1]", "request body must be a JSON object")])
def test_a_body_with_no_model_to_route_by_is_said_as_a_models_server_says_it(router, body, words):
    """Not JSON, not UTF-8, not an object: each said in a model's server's own words (docs/api.md's UTF-8 line
    holds on every endpoint); the router said "not a JSON object" to all three."""
    for path in ("/v1/chat/completions", "/api/chat"):
        r = httpx.post(router.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and (err if isinstance(err, str) else err["message"]) == words, (path, r.text)


def test_gets_reach_a_loaded_model_and_never_load_one(router):
    post(router.url, "/models/unload", {"model": "synth"})
    assert wait_for(lambda: "synth" not in loaded(router.url))
    r = httpx.get(router.url + "/slots", params={"model": "synth"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loaded"
    assert "synth" not in loaded(router.url)
    assert post(router.url, "/models/load", {"model": "synth"}).json() == {"success": True}
    slots = httpx.get(router.url + "/slots", params={"model": "synth"}, timeout=30).json()
    assert slots["model"] == "synth" and slots["n_ctx"] == 1024   # -c reached the model's process
    metrics = httpx.get(router.url + "/metrics", params={"model": "synth"}, timeout=30).text
    assert "bitnet_requests_total" in metrics or "bitnet_" in metrics
    assert post(router.url, "/models/unload", {"model": "synth"}).json() == {"success": True}
    assert post(router.url, "/models/unload", {"model": "synth"}).status_code == 400


def test_a_client_that_hangs_up_cancels_its_sequence_in_the_models_process(router):
    """Hang-ups at once from several clients: every sequence is cancelled in the model's process, and the router
    counts every request as ended (an unload waits for the model's last request: it goes)."""
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    assert post(router.url, "/models/load", {"model": "tiny"}).json() == {"success": True}
    before = httpx.get(router.url + "/slots", params={"model": "tiny"}, timeout=30).json()["metrics"]

    def hang_up(i):
        with httpx.stream("POST", router.url + ("/v1/completions" if i % 2 else "/completion"),
                          json={**body, "n_predict": 1000}, timeout=60 * slowness()) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data:")
                if events >= 3:
                    break
    threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60 * slowness())

    def idle():
        st = httpx.get(router.url + "/slots", params={"model": "tiny"}, timeout=30).json()
        return not st["slots"] and st["metrics"]["running"] == 0
    assert wait_for(idle)
    done = httpx.get(router.url + "/slots", params={"model": "tiny"}, timeout=30).json()["metrics"]
    assert done["tokens_generated_total"] - before["tokens_generated_total"] < 6 * 1000
    assert post(router.url, "/models/unload", {"model": "tiny"}).json() == {"success": True}
    assert wait_for(lambda: "tiny" not in loaded(router.url))


def test_a_client_that_hangs_up_before_a_whole_answer_cancels_it_in_the_models_process(router):
    """A non-streamed answer's headers come only when its work is done, and the router waited for them without
    watching its client: a hang-up left 1,000 texts being embedded for nobody in the model's process (a plain
    server cancels them). Counted, not timed: once idle, far fewer texts were embedded than were sent."""
    assert post(router.url, "/models/load", {"model": "tiny"}).json() == {"success": True}

    def metrics():
        return httpx.get(router.url + "/slots", params={"model": "tiny"}, timeout=30).json()["metrics"]
    before = metrics()
    texts = [f"text {i} " * 20 for i in range(1000)]
    with pytest.raises(httpx.ReadTimeout):   # the client gives up after a second: a hang-up
        httpx.post(router.url + "/v1/embeddings", json={"model": "tiny", "input": texts},
                   timeout=httpx.Timeout(60, read=1.0))
    assert wait_for(lambda: metrics()["running"] + metrics()["waiting"] == 0, 120 * slowness())
    assert metrics()["embed_inputs_total"] - before["embed_inputs_total"] < len(texts)


def test_a_load_failure_is_said_by_its_error_line_never_a_warning(tmp_path):
    """The reason a model failed to load: the process's last error line, else (killed while loading, nothing but
    a warning written) its exit code; the context warning it printed first was given as the reason."""
    from types import SimpleNamespace

    from bitnet_cpu.serve.router import Child
    log = tmp_path / "child.log"
    log.write_text("bitnet serve: warning: context 2048 is past the 512 tokens the model was trained on\n")
    assert Child.log_tail(SimpleNamespace(log_path=str(log))) == ""
    log.write_text("bitnet serve: warning: context 2048 ...\nbitnet: error: m.bnstore: truncated or corrupt store\n"
                   "bitnet serve: warning: a later one\n")
    assert Child.log_tail(SimpleNamespace(log_path=str(log))) == "m.bnstore: truncated or corrupt store"
    # its prefix is not nested in the router's "'m' failed to load: ..." line
    log.write_text("bitnet serve: error: m.gguf: part 2 of 3 of this split GGUF is missing\n")
    assert Child.log_tail(SimpleNamespace(log_path=str(log))) == "m.gguf: part 2 of 3 of this split GGUF is missing"


def test_two_loads_at_once_each_say_their_own_models_error(tmp_path):
    """Each model process has its own log: "x y" and "x_y" (one name once made safe for a file) shared one, each
    start truncated the other's, and two that failed at once each gave the other's reason (or both one). Two
    processes that say their own error and exit, started at once (the router's command is the CLI's to give)."""
    import asyncio

    from bitnet_cpu.serve.router import ModelSpec, Router, RouterError
    specs = {name: ModelSpec(name, str(tmp_path / f"{name}.bnstore")) for name in ("x y", "x_y")}
    for spec in specs.values():   # there (a file gone by the end of a load is said so instead)
        open(spec.path, "wb").close()
    script = "import sys, time; time.sleep(0.5); print('bitnet: error: ' + sys.argv[1] + ' is broken'); sys.exit(1)"

    def command(spec, port, key_file):
        return [sys.executable, "-c", script, spec.name]

    async def both():
        router = Router(lambda: dict(specs), command, log=lambda line: None)
        await router.start()
        try:
            return await asyncio.gather(*(router.acquire(spec) for spec in specs.values()), return_exceptions=True)
        finally:
            await router.close()
    for name, e in zip(specs, asyncio.run(both())):
        assert isinstance(e, RouterError) and e.status == 500, (name, e)
        assert e.message == f"model '{name}' failed to load: {name} is broken", e.message


def test_keep_alive_unloads_as_ollama_does(router, models_dir):
    import ollama

    client = ollama.Client(host=router.url)
    client.generate(model="tiny", prompt="Hi", options={"num_predict": 2})
    assert "tiny" in loaded(router.url)
    client.generate(model="tiny", prompt="Hi", options={"num_predict": 2}, keep_alive=0)
    assert wait_for(lambda: "tiny" not in loaded(router.url))
    client.generate(model="tiny", prompt="", keep_alive="10m")   # ollama's load request
    ps = {m.model: m for m in client.ps().models}
    assert "tiny:latest" in ps and ps["tiny:latest"].expires_at.year < 2100   # idle with 10 minutes to go
    # the process's memory, not the file's
    assert ps["tiny:latest"].size > (models_dir / "tiny.bnstore").stat().st_size
    # a request naming no keep_alive sets the default again (--models-keep-alive: for ever), as ollama's: a
    # keep_alive one request gave stayed in force for every later one (a 0 unloaded the model after each)
    client.generate(model="tiny", prompt="Hi", options={"num_predict": 2})
    assert {m.model: m for m in client.ps().models}["tiny:latest"].expires_at.year >= 2100
    r = client.generate(model="tiny", prompt="", keep_alive=0)  # ollama's unload request
    assert r.done_reason == "unload" and "tiny" not in loaded(router.url)
    bad = post(router.url, "/api/generate", {"model": "tiny", "prompt": "x", "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def model_process(router, path) -> int:
    """The pid of the router's process serving the model file `path`."""
    for pid in children_of(router.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if str(path).encode() in f.read():
                return pid
    raise AssertionError(f"no process serves {path}")


def test_unloading_one_model_never_holds_up_another(models_dir):
    """An unload waits for its process to exit away from the router's lock: here that process is frozen (SIGSTOP)
    so it cannot exit until the router kills it, and meanwhile the other model answers (it waited for the kill).
    The router kills it --drain-timeout + 5 s after asking it to stop: 600 here, so the checks below never race
    that kill on a loaded machine."""
    s = Server("--models-dir", str(models_dir), "--models-max", "2", "-c", "1024", "--drain-timeout", "600",
               threads=1)
    try:
        chat_text(s.url, "tiny")
        chat_text(s.url, "synth")
        frozen = model_process(s, models_dir / "synth.bnstore")
        os.kill(frozen, signal.SIGSTOP)
        unloading = threading.Thread(target=post, args=(s.url, "/models/unload", {"model": "synth"}))
        unloading.start()
        assert wait_for(lambda: "synth" not in loaded(s.url))   # forgotten at once, its process still there
        assert chat_text(s.url, "tiny")["choices"][0]["message"]["content"]
        assert alive(frozen) and unloading.is_alive()   # the unload is still waiting for it
        os.kill(frozen, signal.SIGCONT)
        unloading.join(60 * slowness())
        assert not unloading.is_alive() and wait_for(lambda: not alive(frozen))
    finally:
        s.stop()


def test_an_unload_asked_while_the_model_serves_is_counted_as_the_requests(models_dir):
    """/models/unload while a request runs on the model unloads it once that request ends: that unload was logged
    and counted as keep_alive's (the deferral is a keep_alive of 0), not as the request's that asked for it. The
    model's process is frozen (SIGSTOP) so the request is surely in flight when the unload comes."""
    s = Server("--models-dir", str(models_dir), "-c", "1024", threads=1)
    try:
        chat_text(s.url, "tiny")
        proc = model_process(s, models_dir / "tiny.bnstore")
        os.kill(proc, signal.SIGSTOP)
        asking = threading.Thread(target=chat_text, args=(s.url, "tiny"))
        asking.start()
        try:
            assert wait_for(lambda: 'bitnet_router_requests_total{model="tiny"} 2' in
                            httpx.get(s.url + "/metrics", timeout=30).text)
            assert post(s.url, "/models/unload", {"model": "tiny"}).json() == {"success": True}
            assert "tiny" in loaded(s.url)   # it still serves that request
        finally:
            os.kill(proc, signal.SIGCONT)
        asking.join(60 * slowness())
        assert wait_for(lambda: "tiny" not in loaded(s.url))
        text = httpx.get(s.url + "/metrics", timeout=30).text
        assert 'bitnet_router_unloads_total{model="tiny",reason="request"} 1' in text, text
        assert 'reason="keep_alive"' not in text, text
    finally:
        s.stop()


def test_a_replaced_or_removed_file_is_not_served_from_its_old_process(tmp_path, models_dir):
    """Loaded models were known by name alone: a file replaced (bitnet pull / convert again) kept being served by
    the old process, and a removed one stayed loaded, its memory held, until room eviction chose it."""
    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(models_dir / "tiny.bnstore", d / "a.bnstore")
    shutil.copy(models_dir / "tiny.bnstore", d / "b.bnstore")
    s = Server("--models-dir", str(d), "--models-max", "2", "-c", "1024", threads=1)
    try:
        chat_text(s.url, "a")
        chat_text(s.url, "b")
        old_a, old_b = model_process(s, d / "a.bnstore"), model_process(s, d / "b.bnstore")
        shutil.copy(models_dir / "synth.bnstore", d / "a.new")
        os.replace(d / "a.new", d / "a.bnstore")
        os.remove(d / "b.bnstore")
        # a listing looks at the files at most once a second: the one after the removal may come within it
        assert wait_for(lambda: {m["name"] for m in httpx.get(s.url + "/api/tags", timeout=30).json()["models"]}
                        == {"a:latest"})
        assert wait_for(lambda: "b" not in loaded(s.url) and not alive(old_b))   # idle, and gone from the disk
        chat_text(s.url, "a")
        assert wait_for(lambda: not alive(old_a)) and model_process(s, d / "a.bnstore") != old_a
    finally:
        s.stop()


def test_a_replaced_file_is_served_anew_without_a_listing(tmp_path, models_dir, singles):
    """A model's file replaced (bitnet pull / convert again) while loaded: its next request gets the new weights.
    Only a listing (/v1/models, /api/tags) looked at the files again, so the old process answered until one came
    (a corrupt replacement too)."""
    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(models_dir / "tiny.bnstore", d / "a.bnstore")
    want = {name: chat_text(s.url, name)["choices"][0]["message"]["content"] for name, s in singles.items()}
    assert want["tiny"] != want["synth"]
    s = Server("--models-dir", str(d), "--models-max", "2", "-c", "1024", threads=1)
    try:
        assert chat_text(s.url, "a")["choices"][0]["message"]["content"] == want["tiny"]
        shutil.copy(models_dir / "synth.bnstore", d / "a.new")
        os.replace(d / "a.new", d / "a.bnstore")
        time.sleep(1.1)   # the catalog is looked at again at most once a second
        assert chat_text(s.url, "a")["choices"][0]["message"]["content"] == want["synth"]
    finally:
        s.stop()


def test_a_name_clash_added_while_it_runs_leaves_the_rest_served(tmp_path, models_dir):
    """A file added under a name already served (a.gguf beside a.bnstore) while the router runs: the first keeps
    the name, it is said once, and every other change is still seen (a model added beside it is served). The scan
    used to fail as a whole, so the catalog froze and the new model got a 404."""
    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(models_dir / "tiny.bnstore", d / "a.bnstore")
    s = Server("--models-dir", str(d), "--models-max", "2", "-c", "1024", threads=1)
    try:
        chat_text(s.url, "a")
        shutil.copy(models_dir / "tiny.bnstore", d / "a.gguf")   # not read: the clash is by name
        shutil.copy(models_dir / "tiny.bnstore", d / "b.bnstore")
        time.sleep(1.1)   # a listing looks at the catalog again at most once a second (the chat above may have)
        names = {m["name"] for m in httpx.get(s.url + "/api/tags", timeout=30).json()["models"]}
        assert names == {"a:latest", "b:latest"}, names
        assert chat_text(s.url, "b")["model"] == "b"
        assert chat_text(s.url, "a")["model"] == "a"
        httpx.get(s.url + "/v1/models", timeout=30)
    finally:
        code, err = s.stop()
    assert err.count("two models named 'a'") == 1, err


def test_a_stray_request_loads_no_model(router):
    """A POST to a path no model serves, or ollama's delete as a POST, named a model and loaded it (pushing
    another out under --models-max); now the router answers it without a model."""
    post(router.url, "/models/unload", {"model": "synth"})   # loaded by an earlier test, perhaps
    assert wait_for(lambda: "synth" not in loaded(router.url))
    before = loaded(router.url)
    r = post(router.url, "/no/such/path", {"model": "synth"})
    assert r.status_code == 404 and "no such endpoint" in r.text, r.text
    r = post(router.url, "/api/delete", {"model": "synth"})
    assert r.status_code == 501 and "bitnet rm" in r.text, r.text
    # a method no model's server takes there: its 405, in the API's shape (it was a 400 "model: required")
    for path, shape in (("/v1/messages", "type"), ("/v1/chat/completions", "error")):
        r = httpx.get(router.url + path, params={"model": "synth"}, timeout=30)
        assert r.status_code == 405 and r.headers["allow"] == "POST" and shape in r.json(), r.text
    assert loaded(router.url) <= before   # nothing loaded for them


def test_head_is_answered_wherever_get_is_and_a_405_names_every_method(router):
    """RFC 9110 9.1: HEAD wherever GET (uptime monitors probe HEAD /v1/models): the router's GET-only routes were a
    405 (its forwarder, last, takes HEAD and won over them), /openapi.json a 400 "model: required". A 405's Allow
    names every method of the path, and /health's is in OpenAI's shape as a model's server says it (it was
    ollama's)."""
    before = loaded(router.url)
    for path in ("/v1/models", "/models", "/v1/models/tiny", "/api/ps", "/props", "/openapi.json", "/api/tags",
                 "/health", "/"):
        get, head = httpx.get(router.url + path, timeout=60), httpx.head(router.url + path, timeout=60)
        assert get.status_code == head.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers.get("content-length") == get.headers.get("content-length"), path
    for method, path in (("DELETE", "/health"), ("PUT", "/v1/health"), ("PUT", "/metrics"), ("PUT", "/props"),
                         ("OPTIONS", "/v1/models"), ("PUT", "/v1/models"), ("PATCH", "/slots")):
        r = httpx.request(method, router.url + path, timeout=60)
        assert r.status_code == 405 and r.headers.get("allow") == "GET, HEAD", (method, path, r.headers, r.text)
        assert r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert loaded(router.url) <= before   # nothing loaded for them


def test_room_is_made_by_unloading_one_model(tmp_path, models_dir):
    """--models-max 2, two idle models loaded, a third asked for: the least recently used one goes, the other stays
    (every idle one went while the first was still exiting)."""
    d = tmp_path / "models"
    d.mkdir()
    for name in "abc":
        shutil.copy(models_dir / "tiny.bnstore", d / f"{name}.bnstore")
    s = Server("--models-dir", str(d), "--models-max", "2", "-c", "1024", threads=1)
    try:
        chat_text(s.url, "a")
        chat_text(s.url, "b")
        chat_text(s.url, "c")
        assert loaded(s.url) == {"b", "c"}
        text = httpx.get(s.url + "/metrics", timeout=30).text
        assert re.findall(r'unloads_total\{model="(\w)",reason="room"\} 1', text) == ["a"], text
    finally:
        s.stop()


def test_an_idle_model_goes_after_models_keep_alive(models_dir):
    s = Server("--models-dir", str(models_dir), "--models-keep-alive", "1s", threads=1)
    try:
        chat_text(s.url, "tiny")
        assert wait_for(lambda: not loaded(s.url))
        assert 'bitnet_router_unloads_total{model="tiny",reason="keep_alive"} 1' in \
            httpx.get(s.url + "/metrics", timeout=30).text
        assert not children_of(s.proc.pid) or wait_for(lambda: not children_of(s.proc.pid))
    finally:
        s.stop()


# ---- room for one model -------------------------------------------------------------------------------------
def test_one_model_at_a_time_under_concurrent_requests(models_dir, singles):
    """--models-max 1 with requests for both models at once from several threads: each gets its own model's
    answer (the router unloads the idle one and waits while the loaded one is busy), and the unloaded model's
    process is gone."""
    want = {name: chat_text(s.url, name)["choices"][0]["message"]["content"] for name, s in singles.items()}
    s = Server("--models-dir", str(models_dir), "--models-max", "1", "-c", "1024", threads=1)
    try:
        got, errors = [], []

        def worker(names):
            for name in names:
                try:
                    got.append((name, chat_text(s.url, name)["choices"][0]["message"]["content"]))
                except Exception as e:   # noqa: BLE001  (reported below)
                    errors.append(repr(e))
        threads = [threading.Thread(target=worker, args=(["tiny", "synth"] if i % 2 else ["synth", "tiny"],))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120 * slowness())
        assert not errors and len(got) == 8
        assert all(text == want[name] for name, text in got)
        assert len(loaded(s.url)) == 1
        assert wait_for(lambda: len(children_of(s.proc.pid)) == 1)
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert 'reason="room"' in metrics
    finally:
        s.stop()


def test_a_request_for_another_model_is_not_starved_by_a_busy_one(models_dir):
    """--models-max 1, twelve clients keeping one model busy back to back, then one request for the other model:
    from then on the busy model takes no new requests (they wait, as in ollama's queue), so it goes idle and the
    other model is loaded. New requests used to be admitted to the busy model, which went idle only when every
    client happened to be between requests: the other request waited (seconds to its whole load timeout, then a
    503) while hundreds of the busy model's requests were served past it. Now a request for the busy model sent
    once the other one is waiting (a grace second after it was sent, for the router to see it) is served after
    it."""
    s = Server("--models-dir", str(models_dir), "--models-max", "1", "-c", "1024", "--parallel", "2",
               threads=1)   # 2 slots: the clients' requests queue in the model's process
    try:
        chat_text(s.url, "tiny")
        stop, done = threading.Event(), []   # (status, when sent, when ended) of each request for the busy model
        end = time.monotonic() + 120 * slowness()   # bounded

        def hammer():
            while not stop.is_set() and time.monotonic() < end:
                began = time.monotonic()
                code = post(s.url, "/v1/chat/completions", {"model": "tiny", "messages": CHAT,
                                                            "max_tokens": 48}).status_code
                done.append((code, began, time.monotonic()))
        threads = [threading.Thread(target=hammer) for _ in range(12)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        try:
            sent = time.monotonic()
            r = post(s.url, "/v1/chat/completions", {"model": "synth", "messages": CHAT, "max_tokens": 4})
            answered = time.monotonic()
        finally:
            stop.set()
            for t in threads:
                t.join(120 * slowness())
        assert r.status_code == 200 and r.json()["model"] == "synth", r.text
        grace = 1.0 * slowness()
        past = [1 for _, began, ended in done if sent + grace < began and ended < answered]
        assert not past, f"{len(past)} requests for the busy model sent after it were served before it"
        assert done and {code for code, _, _ in done} == {200}   # the ones that waited were served too
    finally:
        s.stop()


def test_a_client_gone_while_its_model_waits_for_room_takes_its_place_with_it(models_dir):
    """--models-max 1, one model busy with an open stream: a request for the other model whose client hangs up
    while it waits for room leaves the queue. It stayed: the busy model took nothing new for a client that was gone
    (a new request for it waited for the stream's end), then the router unloaded it and loaded the other model for
    nobody."""
    s = Server("--models-dir", str(models_dir), "--models-max", "1", "-c", "4096", threads=1)   # a long stream
    try:
        chat_text(s.url, "tiny")
        body = {"model": "tiny", "stream": True, "messages": CHAT, "max_tokens": 100_000, "ignore_eos": True}
        stop, began = threading.Event(), threading.Event()

        def read():   # the stream runs, read as it comes, till the test is done with it (bounded)
            end = time.monotonic() + 120 * slowness()
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60 * slowness()) as r:
                for _ in r.iter_lines():
                    began.set()
                    if stop.is_set() or time.monotonic() > end:
                        break
        reader = threading.Thread(target=read)
        reader.start()
        try:
            assert began.wait(60 * slowness())
            with pytest.raises(httpx.ReadTimeout):   # its client gives up while "synth" waits for room
                httpx.post(s.url + "/v1/chat/completions", timeout=1.0,
                           json={"model": "synth", "messages": CHAT, "max_tokens": 4})
            r2 = httpx.post(s.url + "/v1/chat/completions", timeout=30 * slowness(),
                            json={"model": "tiny", "messages": CHAT, "max_tokens": 4})
            assert r2.status_code == 200, r2.text
        finally:
            stop.set()
            reader.join(120 * slowness())
        chat_text(s.url, "tiny")   # after the stream: "tiny" idle, nobody waiting for "synth"
        assert loaded(s.url) == {"tiny"}
        assert 'model="synth"' not in httpx.get(s.url + "/metrics", timeout=30).text   # never loaded
    finally:
        s.stop()


def test_switching_models_under_hang_ups_leaves_nothing_counted(models_dir):
    """--models-max 1, six clients switching between the two models, streams hung up mid-answer and ollama's
    unload requests among them (a bounded count of each): every request is answered, and at the end each model
    counts as idle (an unload takes it out at once). A request whose end was not counted would keep its model
    loaded and make every request for the other wait for ever."""
    import random

    s = Server("--models-dir", str(models_dir), "--models-max", "1", "-c", "1024", threads=1)
    try:
        statuses, errors = [], []

        def client(i):
            rnd = random.Random(i)
            with httpx.Client(base_url=s.url, timeout=60 * slowness()) as c:
                for _ in range(12):
                    name, kind = rnd.choice(["tiny", "synth"]), rnd.random()
                    try:
                        if kind < 0.7:
                            body = {"model": name, "prompt": "Once", "options": {"num_predict": 40}}
                            with c.stream("POST", "/api/generate", json=body) as r:
                                statuses.append(r.status_code)
                                for k, _ in enumerate(r.iter_lines()):
                                    if k == rnd.randint(1, 12):
                                        break   # hang up
                        elif kind < 0.85:
                            statuses.append(c.post("/api/generate", json={"model": name, "keep_alive": 0}).status_code)
                        else:
                            statuses.append(c.post("/v1/chat/completions", json={
                                "model": name, "messages": CHAT, "max_tokens": 4}).status_code)
                    except httpx.HTTPError as e:
                        errors.append(repr(e))
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300 * slowness())
        assert not errors and len(statuses) == 6 * 12 and set(statuses) == {200}
        for name in ("tiny", "synth"):
            chat_text(s.url, name)
            assert post(s.url, "/models/unload", {"model": name}).json() == {"success": True}
            assert wait_for(lambda: not loaded(s.url))
    finally:
        s.stop()


def test_a_model_process_that_dies_is_started_again(models_dir):
    """A model process killed in the middle of a streamed answer: the client gets an error event and a cut body,
    never an answer that looks whole (the router ended it as if complete: no [DONE], no error, and the openai
    client stopped iterating without raising); the next request starts the model again. The router's log says
    the kill as a signal."""
    import json
    s = Server("--models-dir", str(models_dir), threads=1)
    try:
        first = chat_text(s.url, "tiny")["choices"][0]["message"]["content"]
        (child,) = children_of(s.proc.pid)
        lines, cut = [], None
        body = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "a story"}],
                "max_tokens": 100_000, "ignore_eos": True}
        try:
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60 * slowness()) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and not lines:
                        os.kill(child, signal.SIGKILL)   # the answer has begun: its process dies
                    lines.append(line)
        except httpx.HTTPError as e:
            cut = e
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "data: [DONE]" not in lines and events[-1]["error"]["code"] == "model_died", lines[-3:]
        assert isinstance(cut, httpx.RemoteProtocolError), cut   # HTTP's end of body never came
        assert wait_for(lambda: not alive(child))
        assert chat_text(s.url, "tiny")["choices"][0]["message"]["content"] == first
        assert wait_for(lambda: 'reason="exited"' in httpx.get(s.url + "/metrics", timeout=30).text)
    finally:
        _, err = s.stop()
    # the kill is said as one (the out-of-memory killer's signal), not as "exit code -9"; uvicorn's ERROR for the
    # body cut on purpose read as the router's bug
    assert "'tiny': its process was killed by signal 9 (SIGKILL: out of memory?)" in err, err[-3000:]
    assert "code -9" not in err and "ASGI callable returned without completing" not in err, err[-3000:]


def test_a_model_process_killed_while_idle_is_started_again_by_the_very_next_request(models_dir):
    """kill -9 of an idle model process, the next request sent at once: its socket closes a moment before the
    router can see the exit, and that request got a 502 "did not answer: ReadError / ConnectError" (most rounds).
    Nothing of the answer was sent: the router starts the model again for it."""
    s = Server("--models-dir", str(models_dir), "-c", "1024", threads=1)
    try:
        body = {"model": "tiny", "prompt": "Once", "max_tokens": 2}
        with httpx.Client(base_url=s.url, timeout=60 * slowness()) as client:   # kept alive: sent at once
            for _ in range(3):
                assert client.post("/v1/completions", json=body).status_code == 200
                (child,) = children_of(s.proc.pid)
                os.kill(child, signal.SIGKILL)
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert children_of(s.proc.pid) != [child]
    finally:
        s.stop()


def test_a_model_that_dies_mid_stream_is_said_in_each_streams_own_error_event(models_dir):
    """Anthropic's stream gets its named `event: error` (the anthropic client skips an SSE message without a name:
    the error was lost and the user saw only a cut connection), the Responses API's a typed error event numbered
    after the last one, as --request-timeout's tails are."""
    import json
    anthropic = pytest.importorskip("anthropic")
    s = Server("--models-dir", str(models_dir), threads=1)
    try:
        client = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60 * slowness())
        with pytest.raises(anthropic.APIStatusError) as e:
            with client.messages.stream(model="tiny", max_tokens=100_000, messages=CHAT,
                                        extra_body={"ignore_eos": True}) as stream:
                for i, _ in enumerate(stream):
                    if i == 3:
                        (child,) = children_of(s.proc.pid)
                        os.kill(child, signal.SIGKILL)
        assert "stopped in the middle of this answer" in str(e.value), e.value
        assert wait_for(lambda: not alive(child))
        lines = []
        body = {"model": "tiny", "stream": True, "input": "a story", "max_output_tokens": 100_000,
                "ignore_eos": True}
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", s.url + "/v1/responses", json=body, timeout=60 * slowness()) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 12:
                        (child,) = children_of(s.proc.pid)
                        os.kill(child, signal.SIGKILL)
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
        assert lines[-3] == "event: error" and events[-1]["type"] == "error", lines[-4:]
        assert events[-1]["sequence_number"] == events[-2]["sequence_number"] + 1, events[-2:]
    finally:
        s.stop()


def test_a_model_process_holds_its_port_from_its_first_instruction(models_dir):
    """The router hands each model's process a socket it has bound and made listen (BITNET_LISTEN_FD): from the
    moment the process exists nothing else can take its port (it was once only picked, and bound by the process
    after its start-up, leaving a second in which another program could take it) and it answers there."""
    import errno
    import socket

    s = Server("--models-dir", str(models_dir), threads=1)
    try:
        asked = threading.Thread(target=chat_text, args=(s.url, "tiny"))
        asked.start()
        assert wait_for(lambda: children_of(s.proc.pid), timeout=30)
        (child,) = children_of(s.proc.pid)
        with open(f"/proc/{child}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        port = int(argv[argv.index("--port") + 1])
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as taken:
                probe.bind(("127.0.0.1", port))
            assert taken.value.errno == errno.EADDRINUSE
        with open(f"/proc/{child}/environ", "rb") as f:
            assert b"BITNET_LISTEN_FD=" in f.read()   # what it was started with (popped once it runs)
        asked.join(timeout=120 * slowness())
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        s.stop()


def test_the_cache_hf_directories_and_models_added_while_it_runs(tmp_path, models_dir):
    """--models-cache serves the cache under `bitnet list`'s names; an HF directory in --models-dir is converted
    by its process on first use (into the cache, where the next listing finds it too); a store copied into the
    cache while the server runs is served, and one removed is no longer offered."""
    import json

    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    cache, hf = tmp_path / "cache", tmp_path / "hf"
    cache.mkdir()
    hf.mkdir()
    shutil.copy(models_dir / "tiny.bnstore", cache / "cached-tiny.bnstore")
    write_hf_dir(SynthModel(small_config(max_position_embeddings=4096), seed=5), str(hf / "synth-hf"))
    env = {"BITNET_CACHE": str(cache)}

    def listed() -> set:
        run_env = dict(os.environ, PYTHONPATH=ROOT, **env)
        out = subprocess.run([sys.executable, "-m", "bitnet_cpu", "list", "--json"], cwd=ROOT, env=run_env,
                             capture_output=True, text=True, timeout=120 * slowness()).stdout
        return {json.loads(line)["name"] for line in out.splitlines() if line.strip()}

    def served() -> set:
        return {m["id"] for m in httpx.get(s.url + "/v1/models", timeout=30).json()["data"]}
    s = Server("--models-cache", "--models-dir", str(hf), "-c", "1024", threads=1, env=env)
    try:
        assert served() == listed() | {"synth-hf"} and len(listed()) == 1
        assert chat_text(s.url, "synth-hf")["model"] == "synth-hf"   # converted on first use
        assert len(listed()) == 2 and wait_for(lambda: served() == listed() | {"synth-hf"})
        shutil.copy(models_dir / "tiny.bnstore", cache / "late.bnstore")
        assert chat_text(s.url, "late")["model"] == "late"
        os.remove(cache / "late.bnstore")
        assert wait_for(lambda: "late" not in served())
    finally:
        s.stop()


def test_ollama_pull_and_delete_on_a_cache_server(tmp_path, models_dir):
    """--models-cache starts with an empty cache; ollama's client pulls a hub model (offline here: from a hub cache
    built on disk, as tests/test_hub_cli.py does) with its progress stream; the model is then served under the
    name pulled and under `bitnet list`'s, answering as a single-model server of `bitnet run -m REPO` does; a
    pull that cannot happen is the pull's own one-line reason; delete removes the conversion (a second delete:
    404), and a --models-dir file is never deleted."""
    import json

    import ollama
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir
    from test_hub_cli import COMMIT_A, add_snapshot, hf_files, quant_files

    src = write_hf_dir(SynthModel(small_config(max_position_embeddings=4096), seed=23), str(tmp_path / "src"))
    add_snapshot(str(tmp_path / "hub"), "o/pulled", COMMIT_A, hf_files(src))
    add_snapshot(str(tmp_path / "hub"), "o/quants", COMMIT_A, quant_files(tmp_path))
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "BITNET_CACHE": str(tmp_path / "stores"), "HF_HUB_OFFLINE": "1"}
    s = Server("--models-cache", "--models-dir", str(models_dir), "-c", "1024", threads=1, env=env)
    try:
        client = ollama.Client(host=s.url, timeout=300 * slowness())
        names = lambda: {m.model for m in client.list().models}   # noqa: E731
        before = names()
        assert before == {"tiny:latest", "synth:latest", "broken:latest"}
        updates = list(client.pull("hf.co/o/pulled", stream=True))
        assert updates[0].status == "pulling manifest" and updates[-1].status == "success"
        added = names() - before
        assert len(added) == 1
        (cache_name,) = added
        rows = [json.loads(x) for x in subprocess.run(
            [sys.executable, "-m", "bitnet_cpu", "list", "--json"], cwd=ROOT, capture_output=True, text=True,
            env=dict(os.environ, PYTHONPATH=ROOT, **env), timeout=120 * slowness()).stdout.splitlines()]
        assert [r["name"] for r in rows] == [cache_name.removesuffix(":latest")]
        assert rows[0]["source"].startswith("o/pulled@")
        single = Server("-m", "o/pulled", "-c", "1024", "--alias", "single", threads=1, env=env)
        try:
            want = chat_text(single.url, "single")["choices"][0]["message"]["content"]
        finally:
            single.stop()
        for name in ("hf.co/o/pulled", "hf.co/o/pulled:latest", "o/pulled", cache_name):
            assert chat_text(s.url, name)["choices"][0]["message"]["content"] == want, name
        # pulled again (already here): success, nothing new; also by the name /api/tags lists (ollama pulls any
        # listed name: Open WebUI's "update all models" does; it was a 400 "invalid model name")
        assert client.pull("hf.co/o/pulled").status == "success" and names() == before | {cache_name}
        assert client.pull(cache_name).status == "success" and names() == before | {cache_name}
        # a quant tag (ollama's hf.co/OWNER/REPO:TAG): that GGUF file, served under the tag in any case; no tag
        # where the repository holds several: the pull's reason names the tags
        with pytest.raises(ollama.ResponseError) as e:
            client.pull("hf.co/o/quants")
        assert "TQ2_0" in e.value.error and "i2_s" in e.value.error
        assert client.pull("hf.co/o/quants:TQ2_0").status == "success" and len(names() - before) == 2
        single = Server("-m", "o/quants:TQ2_0", "-c", "1024", "--alias", "single", threads=1, env=env)
        try:
            want_tq = chat_text(single.url, "single")["choices"][0]["message"]["content"]
        finally:
            single.stop()
        for name in ("hf.co/o/quants:TQ2_0", "hf.co/o/quants:tq2_0", "o/quants:m-1.58bit-TQ2_0.gguf"):
            assert chat_text(s.url, name)["choices"][0]["message"]["content"] == want_tq, name
        client.delete("hf.co/o/quants:TQ2_0")
        assert names() == before | {cache_name}
        # offline and not downloaded: the pull's own reason, in the stream and as a plain answer
        with pytest.raises(ollama.ResponseError) as e:
            list(client.pull("hf.co/o/absent", stream=True))
        assert "o/absent" in e.value.error and "offline" in e.value.error
        r = httpx.post(s.url + "/api/pull", json={"model": "hf.co/o/absent", "stream": False}, timeout=120)
        assert r.status_code == 500 and "offline" in r.json()["error"]
        assert httpx.post(s.url + "/api/pull", json={"model": ""}, timeout=30).status_code == 400
        # checked before a process starts (ollama's "invalid model name"): `--help` was run as `bitnet pull --help`
        # (status success), and a newline forged lines of the log
        for bad in ("--help", "-h", "hf.co/--help", "o/x\nbitnet serve: deleted 'tiny'", "/etc/passwd",
                    "https://evil.example/a/b", "o/../x", "o/r:/etc/passwd", "hf.co/o/r:/etc/passwd",
                    "o/r:sub\\x.gguf", "o/r:C:x.gguf"):   # (a FILE huggingface_hub refuses: a 500 "bug" before)
            r = httpx.post(s.url + "/api/pull", json={"model": bad, "stream": False}, timeout=30)
            assert r.status_code == 400 and "invalid model name" in r.json()["error"], (bad, r.text)
        # delete: the conversion goes (it was loaded: unloaded first); the user's own files stay
        client.delete("hf.co/o/pulled")
        assert names() == before and not os.path.exists(rows[0]["path"])
        with pytest.raises(ollama.ResponseError) as e:
            client.delete("hf.co/o/pulled")
        assert e.value.status_code == 404
        with pytest.raises(ollama.ResponseError) as e:
            client.delete("tiny")
        assert e.value.status_code == 400 and "--models-dir" in e.value.error
        assert (models_dir / "tiny.bnstore").exists()
    finally:
        s.stop()


def test_a_pull_by_revision_is_served_under_that_name_and_delete_takes_every_conversion(tmp_path):
    """`/api/pull` of OWNER/REPO@REV said success, and the name pulled was then a 404 (the recorded source keeps the
    commit alone, cut to 12 characters): a branch and a full commit name the conversion of that commit. A delete by
    hub id removed only the newest of its conversions, and the model was still served under that name."""
    import json

    from test_hub_cli import COMMIT_A, add_snapshot, quant_files

    one = {k: v for k, v in quant_files(tmp_path).items() if "TQ2_0" in k}
    add_snapshot(str(tmp_path / "hub"), "o/rev", COMMIT_A, one)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "BITNET_CACHE": str(tmp_path / "stores"), "HF_HUB_OFFLINE": "1"}
    s = Server("--models-cache", "-c", "1024", threads=1, env=env)
    try:
        for name in ("o/rev@main", f"o/rev@{COMMIT_A}", f"hf.co/o/rev@{COMMIT_A}"):
            r = httpx.post(s.url + "/api/pull", json={"model": name, "stream": False}, timeout=300 * slowness())
            assert r.status_code == 200 and r.json() == {"status": "success"}, (name, r.text)
            assert "m-1.58bit-TQ2_0.gguf" in chat_text(s.url, name)["model"], name
        assert httpx.post(s.url + "/api/show", json={"model": "o/rev@nobranch"}, timeout=60).status_code == 404
        # a second conversion of the same download (another head): `bitnet rm o/rev` removes both, and so must
        # ollama's delete of the same name
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "pull", "o/rev", "--lm-head", "f16"], cwd=ROOT,
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT, **env),
                           timeout=300 * slowness())
        assert r.returncode == 0, r.stderr
        assert len(os.listdir(tmp_path / "stores")) == 2
        tags = lambda: [m["name"] for m in httpx.get(s.url + "/api/tags", timeout=30).json()["models"]]  # noqa: E731
        r = httpx.request("DELETE", s.url + "/api/delete", content=json.dumps({"model": "o/rev"}), timeout=60)
        assert r.status_code == 200, r.text
        assert tags() == [] and not os.listdir(tmp_path / "stores"), tags()
        r = httpx.request("DELETE", s.url + "/api/delete", content=json.dumps({"model": "o/rev"}), timeout=60)
        assert r.status_code == 404, r.text
    finally:
        err = s.stop()[1]
    # started on an empty cache: the count says so, and no empty list follows (it read "at most 3 at once: )")
    assert "(0 models, each loaded on first use, at most 3 at once)" in err, err[-2000:]



def test_ollamas_model_routes_say_a_body_that_is_not_json_is_not_json(tmp_path):
    """`/api/pull -d notjson` answered "model: required" (the body was read as one without a name). A body that is
    not JSON, or not an object, is the 400 a model's server gives it, at /api/show and /api/delete too."""
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "BITNET_CACHE": str(tmp_path / "stores"), "HF_HUB_OFFLINE": "1"}
    s = Server("--models-cache", "-c", "1024", threads=1, env=env)
    try:
        for path in ("/api/pull", "/api/show", "/api/delete"):
            for body, said in ((b"notjson", "request body is not valid JSON"), (b"{\"model\": ", "not valid JSON"),
                               (b"[1]", "request body must be a JSON object")):
                r = httpx.post(s.url + path, content=body, timeout=30)
                assert r.status_code == 400 and said in r.json()["error"], (path, body, r.text)
                assert "required" not in r.json()["error"], (path, body, r.text)
        assert "model: required" in httpx.post(s.url + "/api/pull", content=b"", timeout=30).json()["error"]
    finally:
        s.stop()


def test_ollama_pull_refuses_a_name_with_a_control_character(tmp_path):
    """{"model": "o/r\\n"} was pulled as o/r: the newline was stripped as a typed space is. A control character in
    a name that no model has is ollama's "invalid model name", before any pull runs; plain spaces around a name
    are still stripped, as every route of the router strips them."""
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "BITNET_CACHE": str(tmp_path / "stores"), "HF_HUB_OFFLINE": "1"}
    s = Server("--models-cache", "-c", "1024", threads=1, env=env)
    try:
        for bad in ("o/r\n", "hf.co/o/r\r\n", "\to/r", "o/r\x1b[2J", "o/r\x00"):
            r = httpx.post(s.url + "/api/pull", json={"model": bad, "stream": False}, timeout=30)
            assert r.status_code == 400 and "invalid model name" in r.json()["error"], (bad, r.text)
            assert "control character" in r.json()["error"] and "\n" not in r.json()["error"], (bad, r.text)
        # the pull runs, and fails offline on the name without the spaces
        r = httpx.post(s.url + "/api/pull", json={"model": " o/absent ", "stream": False}, timeout=120 * slowness())
        assert r.status_code == 500 and "pull o/absent: offline" in r.json()["error"], r.text
    finally:
        s.stop()

# ---- keys, shutdown, flags ----------------------------------------------------------------------------------
def test_ollama_pull_reports_the_bytes_of_a_real_download(tmp_path):
    """Against a hub on 127.0.0.1 (tests/test_hub_cli.py's FakeHub): ollama's client sees the download as its
    layers, a digest (the file's sha256) with completed and total bytes, then success; the model of that tag
    then answers under the name pulled."""
    import hashlib

    import ollama
    from test_hub_cli import FakeHub, quant_files

    files = {name: open(p, "rb").read() for name, p in quant_files(tmp_path).items()}
    fake = FakeHub("o/remote", files, "f" * 40)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "BITNET_CACHE": str(tmp_path / "stores"), "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": fake.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    s = Server("--models-cache", "-c", "1024", threads=1, env=env)
    try:
        client = ollama.Client(host=s.url, timeout=300 * slowness())
        updates = list(client.pull("hf.co/o/remote:TQ2_0", stream=True))
        data = files["m-1.58bit-TQ2_0.gguf"]
        layers = [u for u in updates if u.digest]
        assert layers and {u.digest for u in layers} == {"sha256:" + hashlib.sha256(data).hexdigest()}, updates
        assert all(0 <= u.completed <= u.total == len(data) for u in layers) and layers[-1].completed == len(data)
        assert updates[0].status == "pulling manifest" and updates[-1].status == "success", updates
        steps = [re.fullmatch(r"converting o/remote:TQ2_0 \((\d+)/(\d+)\)", u.status) for u in updates]
        steps = [(int(m.group(1)), int(m.group(2))) for m in steps if m]
        assert steps and steps[-1][0] == steps[-1][1] and [d for d, _ in steps] == list(range(1, steps[-1][1] + 1))
        assert "m-1.58bit-TQ2_0.gguf" in chat_text(s.url, "hf.co/o/remote:tq2_0")["model"]   # that file, not i2_s
    finally:
        s.stop()
        fake.close()


def test_a_pull_whose_client_hangs_up_is_said_to_have_stopped(tmp_path):
    """A pull's client that hung up ended the pull's process, but the log said nothing after "pulling 'o/stuck'"
    (the line meant to say so was after an await that the cancelled request never got past). A hub that never
    answers (a socket that listens and accepts nothing) keeps the pull running until the client goes."""
    import socket

    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen(16)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "BITNET_CACHE": str(tmp_path / "stores"), "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}", "HF_HUB_DISABLE_TELEMETRY": "1"}
    s = Server("--models-cache", "-c", "1024", threads=1, env=env)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(s.proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        with httpx.stream("POST", s.url + "/api/pull", json={"model": "hf.co/o/stuck"}, timeout=60) as r:
            for line in r.iter_lines():
                if "downloading" in line:   # its process runs: the client hangs up
                    break
        assert wait_for(lambda: any("pulling 'o/stuck'" in ln for ln in lines))
        assert wait_for(lambda: any("pull of 'o/stuck' stopped: its client went away" in ln for ln in lines)), lines
        assert not any("Traceback" in ln for ln in lines), lines
        assert wait_for(lambda: not children_of(s.proc.pid))   # the pull's process is gone
    finally:
        s.stop()
        hub.close()


def test_the_routers_key_guards_every_model(models_dir):
    s = Server("--models-dir", str(models_dir), "--api-key", "sesame", threads=1)
    try:
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        assert post(s.url, "/v1/chat/completions", {"model": "tiny", "messages": CHAT}).status_code == 401
        assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 401
        ok = post(s.url, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2},
                  headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert post(s.url, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": CHAT},
                    headers={"x-api-key": "sesame"}).status_code == 200
        # the model's own process wants the router's key, not the user's, nor none
        (child,) = children_of(s.proc.pid)
        with open(f"/proc/{child}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        port = argv[argv.index(b"--port") + 1].decode()
        assert b"sesame" not in b" ".join(argv)
        for headers in ({}, {"Authorization": "Bearer sesame"}):
            assert httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=30).status_code == 401
    finally:
        s.stop()


def test_ctrl_c_finishes_the_streams_and_stops_every_model(models_dir):
    s = Server("--models-dir", str(models_dir), threads=1)
    chat_text(s.url, "tiny")
    chat_text(s.url, "synth")
    kids = children_of(s.proc.pid)
    assert len(kids) == 2
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60 * slowness()) as r:
        it = r.iter_lines()
        lines.append(next(it))
        s.proc.send_signal(signal.SIGINT)
        lines += list(it)
    code, err = s.stop(sig=None, timeout=60 * slowness())
    assert code == 0, err
    assert lines[-1] == "" or lines[-1].startswith("data:")
    assert any(line == "data: [DONE]" for line in lines)
    assert wait_for(lambda: not any(alive(k) for k in kids))
    assert "Traceback" not in err


def test_sigterm_answers_a_request_waiting_for_room_at_once(models_dir):
    """--models-max 1, a long stream holding the only room and a request for the other model waiting for it:
    SIGTERM answers the waiting one 503 "shutting down" while the stream goes on draining (it was told only when
    the stream ended, or its load timeout passed)."""
    s = Server("--models-dir", str(models_dir), "--models-max", "1", "-c", "4096", "--drain-timeout", "30",
               threads=1)
    try:
        chat_text(s.url, "tiny")
        body = {"model": "tiny", "stream": True, "messages": CHAT, "max_tokens": 100_000, "ignore_eos": True}
        began, lines, seen_at_answer, waiting = threading.Event(), [], [], []

        def read():
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60 * slowness()) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        began.set()

        def wait_for_room():
            r = post(s.url, "/v1/chat/completions", {"model": "synth", "messages": CHAT, "max_tokens": 4})
            seen_at_answer.append(len(lines))
            waiting.append(r)
        reader, other = threading.Thread(target=read), threading.Thread(target=wait_for_room)
        reader.start()
        try:
            assert began.wait(60 * slowness())
            other.start()
            time.sleep(1.0)   # a grace second for the router to queue it
            s.proc.send_signal(signal.SIGTERM)
            other.join(120 * slowness())
        finally:
            reader.join(120 * slowness())
        (r,) = waiting
        assert r.status_code == 503 and "shutting down" in r.text, r.text
        # the stream sent on after that answer (more than a last chunk read late)
        assert len(lines) - seen_at_answer[0] > 10, (len(lines), seen_at_answer)
        code, err = s.stop(sig=None, timeout=60 * slowness())
        assert code == 0 and "Traceback" not in err, err
    finally:
        s.stop()


def test_a_second_ctrl_c_ends_the_drain_without_a_traceback(tmp_path, models_dir):
    """Two Ctrl-C (or SIGTERM) while streams run: the second passes on to the models' processes, which end their
    drain at once, and the router exits 0 without a traceback (it forced uvicorn's exit, which skipped the shutdown
    and logged a cancelled lifespan). A model named with a leading dash loads (it was read as an option)."""
    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(models_dir / "tiny.bnstore", d / "-dash.bnstore")
    s = Server("--models-dir", str(d), threads=1)
    assert chat_text(s.url, "-dash")["model"] == "-dash"
    body = {"model": "-dash", "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60 * slowness()) as r:
        it = r.iter_lines()
        next(it)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        s.proc.send_signal(signal.SIGINT)
        for _ in it:
            pass
    code, err = s.stop(sig=None, timeout=60 * slowness())
    assert code == 0 and "Traceback" not in err, err


def test_models_die_with_a_killed_router(models_dir):
    s = Server("--models-dir", str(models_dir), threads=1)
    chat_text(s.url, "tiny")
    kids = children_of(s.proc.pid)
    s.proc.kill()
    s.stop(sig=None)
    assert kids and wait_for(lambda: not any(alive(k) for k in kids))


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--port", "1", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120 * slowness())


@pytest.mark.parametrize("args,words", [
    (("-m", "x.bnstore"), "-m cannot be combined"),
    (("--alias", "a"), "--alias cannot be combined"),
    (("--models-max", "0"), "--models-max 0"),
    (("--models-keep-alive", "soon"), "--models-keep-alive soon"),
    (("--models-load-timeout", "nan"), "--models-load-timeout nan"),
    (("--drain-timeout", "nan"), "--drain-timeout nan"),   # taken, then the shutdown it times broke
    (("--drain-timeout", "inf"), "--drain-timeout inf"),
    (("--max-body-mb", "inf"), "--max-body-mb inf"),       # an internal error (int of inf), exit 70
    (("--max-header-kb", "inf"), "--max-header-kb inf"),
    (("--models-dir",), ""),
])
def test_bad_router_flags_are_one_line(models_dir, args, words):
    if args == ("--models-dir",):   # the router's flags without a router: refused, not ignored
        for flag, value in (("--models-max", "0"), ("--models-keep-alive", "bogus"), ("--models-load-timeout", "9"),
                            ("--models-max", "3"), ("--models-load-timeout", "600")):   # typed at the default too
            r = run_cli("-m", "x.bnstore", flag, value)
            assert r.returncode == 2 and f"{flag} applies to --models-dir / --models-cache only" in r.stderr, r.stderr
        return
    r = run_cli("--models-dir", str(models_dir), *args)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("  hint")]) == 1


def test_empty_directories_and_clashing_names_are_one_line(tmp_path, models_dir):
    r = run_cli("--models-dir", str(tmp_path))
    assert r.returncode == 2 and "no models in" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("--models-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "not a directory" in r.stderr
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(models_dir / "tiny.bnstore", other / "tiny.bnstore")
    r = run_cli("--models-dir", str(models_dir), "--models-dir", str(other))
    assert r.returncode == 2 and "two models named 'tiny'" in r.stderr


def test_a_directory_given_twice_is_read_once(tmp_path):
    """--models-dir d --models-dir d/ (or a link to d): one directory, each model once; it was "two models named
    'tiny': d/tiny.bnstore and d/tiny.bnstore", exit 2."""
    import argparse

    from bitnet_cpu.cli.serve import model_catalog
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), d / "tiny.bnstore")
    os.symlink(d, tmp_path / "link")
    models = model_catalog(argparse.Namespace(models_dir=[str(d), str(d) + "/", str(tmp_path / "link")],
                                              models_cache=False))
    assert list(models) == ["tiny"] and models["tiny"].path == str(d / "tiny.bnstore")


def test_a_file_name_that_is_not_utf8_is_skipped_and_the_rest_listed(tmp_path):
    """A model file named with a byte that is not UTF-8 made every listing (/v1/models, /models, /api/tags) a
    bare 500, so no model could be seen: it is left out with one line naming it, and a directory whose own name
    is not UTF-8 is listed (its path shown with U+FFFD)."""
    d = tmp_path / os.fsdecode(b"dir\xff")
    d.mkdir()
    for name in ("ok.bnstore", os.fsdecode(b"bad\xff.bnstore")):
        shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), d / name)
    s = Server("--models-dir", str(d), "-c", "1024", threads=1)
    try:
        for path in ("/v1/models", "/models"):
            r = httpx.get(s.url + path, timeout=60)
            assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["ok"], r.text
            assert r.json()["data"][0]["path"] == os.fsencode(str(d / "ok.bnstore")).decode("utf-8", "replace")
        r = httpx.get(s.url + "/api/tags", timeout=60)
        assert r.status_code == 200 and [m["name"] for m in r.json()["models"]] == ["ok:latest"], r.text
        r = post(s.url, "/api/show", {"model": "ok"})
        assert r.status_code == 200, r.text
    finally:
        _, err = s.stop()
    said = [line for line in err.splitlines() if "not UTF-8" in line]
    assert len(said) == 1 and "bad\\xff.bnstore" in said[0] and "Traceback" not in err, err


def test_the_model_processes_get_the_routers_engine_flags():
    import argparse

    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.serve import passthrough_argv
    subs: dict = {}
    build_parser(subs)
    argv = ["--models-dir", "d", "--models-max", "2", "-t", "1", "-c", "1024", "--temp", "0.2", "--no-mmap",
            "--kv", "q8", "--parallel", "4", "--api-key", "k", "--port", "9000", "--max-body-mb", "2",
            "--reasoning-budget-message=-stop-", "--dry-sequence-breaker=-", "--reasoning-budget", "3"]
    args = subs["serve"].parse_args(argv)
    out = passthrough_argv(args)
    assert isinstance(args, argparse.Namespace)
    again = subs["serve"].parse_args(out)   # what the model's process parses
    for dest in ("threads", "ctx", "temperature", "mmap", "kv", "parallel", "max_body_mb", "reasoning_budget",
                 "reasoning_budget_message", "dry_sequence_breakers"):   # values starting with '-' too
        assert getattr(again, dest) == getattr(args, dest), dest
    for flag in ("--models-dir", "--models-max", "--api-key", "--port", "9000", "k"):
        assert flag not in out


@pytest.mark.parametrize("value,seconds", [
    (0, 0.0), (30, 30.0), ("90", 90.0), ("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), ("1.5h", 5400.0),
    (-1, math.inf), ("-1", math.inf), ("-5m", math.inf), (float("inf"), math.inf), ("2562047h", 2562047 * 3600.0)])
def test_keep_alive_durations(value, seconds):
    from bitnet_cpu.serve.router import parse_keep_alive
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", "m", True, None, [1], "5m3", float("nan"), "nan",
                                   "100000000h", 1e12, 1e300])   # past Go's longest duration (/api/ps: a 500)
def test_keep_alive_nonsense(value):
    from bitnet_cpu.serve.router import parse_keep_alive
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_props_without_a_model_and_v1_health(router):
    """llama-server's router answers GET /props with no model itself (its web UI asks before it knows a model; it
    was a 400 missing_model here); ?model=NAME is that model's /props. /v1/health is /health, open as /health."""
    r = httpx.get(router.url + "/props", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["role"] == "router" and r.json()["default_generation_settings"]["params"] == {}
    assert post(router.url, "/models/load", {"model": "tiny"}).json() == {"success": True}   # GETs never load
    one = httpx.get(router.url + "/props", params={"model": "tiny"}, timeout=60).json()
    assert one["default_generation_settings"]["n_ctx"] == 1024 and one["model_alias"] == "tiny"
    assert httpx.get(router.url + "/v1/health").json()["status"] == "ok"


def test_llama_server_endpoints_not_served_are_answered_without_a_model(router):
    """Mistral's and DeepSeek's FIM routes, llama-server's slot actions, reranking, POST /props and LoRA endpoints
    are a model's server's 501s
    (and its empty adapter list), said by the router itself: no model to name, none loaded for a refusal (they were
    forwarded, a 400 "model: required" with two models, or a bare 404)."""
    for path, said in (("/v1/fim/completions", "fill-in-the-middle"), ("/beta/completions", "fill-in-the-middle"),
                       ("/slots/0?action=save", "slot actions"),
                       ("/rerank", "reranking is not supported"), ("/v1/rerank", "reranking is not supported"),
                       ("/props", "read-only"), ("/lora-adapters", "LoRA adapters are not supported")):
        r = post(router.url, path, [{"id": 0, "scale": 1.0}] if "lora" in path else {"query": "a"})
        status = 405 if path == "/props" else 501   # POST on a GET route: HTTP's 405
        assert r.status_code == status and said in r.json()["error"]["message"], (path, r.text)
        assert r.json()["error"]["code"] == "not_supported"
    r = httpx.get(router.url + "/lora-adapters", timeout=30)
    assert r.status_code == 200 and r.json() == [], r.text


def test_stored_response_routes_answer_as_a_models_server(router):
    """openai's responses.retrieve / delete / cancel / input_items.list carry no model: the router answers them as a
    model's server does (404 not_stored), where they were a 400 "model: required" nobody could satisfy; without
    the /v1 prefix too, as POST /responses is served (that was "no such endpoint")."""
    for prefix in ("/v1", ""):
        for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
            r = httpx.request(method, router.url + prefix + "/responses/resp_123" + suffix, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_stored", (method, suffix, r.text)
            assert "not stored here" in r.json()["error"]["message"]


def test_a_responses_request_that_needs_stored_state_loads_no_model(router, singles):
    """A Responses request with a field that needs state no server here has (previous_response_id, conversation,
    background, ...) is the model's server's own 400, said by the router before any load: it unloaded another
    model to make room, loaded the one named, then was refused there."""
    chat_text(router.url, "tiny")
    post(router.url, "/models/unload", {"model": "synth"})
    assert wait_for(lambda: "synth" not in loaded(router.url))
    for extra in ({"previous_response_id": "resp_abc"}, {"background": True}, {"conversation": "conv_1"}):
        body = {"model": "synth", "input": "Hi", **extra}
        for path in ("/v1/responses", "/v1/responses/input_tokens"):
            r, want = post(router.url, path, body), post(singles["synth"].url, path, body)
            assert want.status_code == 400, want.text   # what the model's server says of it
            assert r.status_code == 400 and r.json() == want.json(), (path, r.text)
    assert "synth" not in loaded(router.url) and "tiny" in loaded(router.url)


def test_openapi_schema_is_a_models(router):
    """GET /openapi.json is the API a model's server describes (clients and the schemathesis fuzzer read it): it
    was a 400 "model: required" from the router's forwarder."""
    r = httpx.get(router.url + "/openapi.json", timeout=60)
    assert r.status_code == 200, r.text
    paths = r.json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/api/chat", "/v1/messages"} <= set(paths)


def test_a_split_gguf_is_one_model_of_the_directory(tmp_path):
    """llama.cpp's gguf-split parts (PREFIX-0000N-of-0000M.gguf) in a --models-dir are one model, named by the
    prefix and loaded from its first part (each part was listed as a model of its own)."""
    import argparse

    from bitnet_cpu.cli.serve import model_catalog
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_tq
    m = SynthModel(small_config(), seed=3)
    first = write_gguf_tq(m, str(tmp_path / "tiny-split.gguf"), "TQ2_0", split_max_tensors=6)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("tiny-split-")]) >= 3
    models = model_catalog(argparse.Namespace(models_dir=[str(tmp_path)], models_cache=False))
    assert set(models) == {"tiny-split"} and models["tiny-split"].path == first


def test_every_file_of_a_model_of_several_is_in_its_digest_and_size(tmp_path):
    """A split GGUF's part 2 or an HF folder's shard replaced while the router serves it: the model's digest (what
    the router compares to load it anew) changes, as for part 1 or a single file; it was made of part 1's size
    and mtime (an HF folder's own mtime), so the old weights were served on. /api/tags' size is every part's."""
    import argparse

    from bitnet_cpu.cli.serve import model_catalog
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_tq, write_hf_dir
    m = SynthModel(small_config(), seed=3)
    write_gguf_tq(m, str(tmp_path / "tiny-split.gguf"), "TQ2_0", split_max_tensors=6)
    parts = sorted(p for p in tmp_path.iterdir() if p.name.startswith("tiny-split-"))
    hf = tmp_path / "hf"
    write_hf_dir(m, str(hf), shards=2)
    shard = hf / "model-00002-of-00002.safetensors"
    assert len(parts) >= 3 and shard.is_file()
    args = argparse.Namespace(models_dir=[str(tmp_path)], models_cache=False)
    before = model_catalog(args)
    assert set(before) == {"tiny-split", "hf"}
    assert before["tiny-split"].size == sum(p.stat().st_size for p in parts)
    assert before["hf"].size == sum(p.stat().st_size for p in hf.iterdir())
    for f in (parts[1], shard):   # the same bytes but one, at a later time: what a replacement looks like
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    after = model_catalog(args)
    for name in ("tiny-split", "hf"):
        assert after[name].size == before[name].size and after[name].digest() != before[name].digest(), name
    assert model_catalog(args)["hf"].digest() == after["hf"].digest()   # nothing changed: the same model


def test_a_split_gguf_without_a_prefix_is_named_by_its_file(tmp_path):
    """A first part named "-00001-of-00002.gguf" has no prefix to name the model by: it was a model named ""."""
    import argparse

    from bitnet_cpu.cli.serve import model_catalog
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_tq
    write_gguf_tq(SynthModel(small_config(), seed=3), str(tmp_path / "x.gguf"), "TQ2_0", split_max_tensors=6)
    for p in tmp_path.iterdir():
        p.rename(tmp_path / p.name[1:])   # x-00001-of-0000N.gguf -> -00001-of-0000N.gguf
    models = model_catalog(argparse.Namespace(models_dir=[str(tmp_path)], models_cache=False))
    assert "" not in models and len(models) == 1, list(models)


def test_a_load_failed_for_a_cause_outside_its_file_is_tried_again(tmp_path):
    """An HF directory whose conversion cannot write its cache (BITNET_CACHE is a file) failed, and that failure
    was answered again until a file of the model changed: fixing the cache, as the error's hint asks, did not help.
    The failure is kept only for a short while (so a model picker's retries do not load it again and again), an
    explicit POST /models/load tries again at once, and the listing says the last load failed (llama-server's
    router: status.failed and status.exit_code)."""
    d = tmp_path / "md"
    d.mkdir()
    shutil.copytree(os.path.join(ROOT, "models", "bitnet-b1.58-tiny"), d / "hfmodel")
    cache = tmp_path / "cache"
    cache.write_text("x")
    s = Server("--models-dir", str(d), "-c", "1024", threads=1, env={"BITNET_CACHE": str(cache)})
    try:
        first = post(s.url, "/v1/chat/completions", {"model": "hfmodel", "messages": CHAT, "max_tokens": 2})
        err = first.json()["error"]
        assert first.status_code == 500 and err["code"] == "load_failed" and "cache" in err["message"], first.text
        again = post(s.url, "/v1/chat/completions", {"model": "hfmodel", "messages": CHAT, "max_tokens": 2})
        assert again.status_code == 500 and again.json()["error"] == err   # at once: not loaded again
        entry = httpx.get(s.url + "/v1/models/hfmodel", timeout=30).json()
        assert entry["status"] == {"value": "unloaded", "failed": True, "exit_code": 2}, entry
        listed = {m["id"]: m["status"] for m in httpx.get(s.url + "/models", timeout=30).json()["data"]}
        assert listed["hfmodel"].get("failed") is True
        cache.unlink()
        cache.mkdir()
        r = post(s.url, "/models/load", {"model": "hfmodel"})
        assert r.status_code == 200 and r.json() == {"success": True}, r.text
        assert chat_text(s.url, "hfmodel")["model"] == "hfmodel"
        entry = httpx.get(s.url + "/v1/models/hfmodel", timeout=30).json()
        assert entry["status"] == {"value": "loaded"}, entry
    finally:
        s.stop()


def fake_model_command(script: str):
    """A model process's command for Router tests: `script` (python) gets the model's path as argv[1]."""
    def command(spec, port, key_file):
        return [sys.executable, "-c", script, spec.path]
    return command


# a model process that serves /health on the router's socket when its file's "cause" (FILE.ok) is there, and
# otherwise says why it cannot load and exits 2, as `bitnet serve` does
SERVES_IF_OK = """
import http.server, os, socket, sys
if not os.path.exists(sys.argv[1] + ".ok"):
    print("bitnet: error: " + sys.argv[1] + ": cannot create the cache directory", flush=True)
    sys.exit(2)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", 0), Health, bind_and_activate=False)
srv.socket = socket.socket(fileno=int(os.environ["BITNET_LISTEN_FD"]))
srv.serve_forever()
"""


def test_a_remembered_load_failure_is_tried_again_after_a_while(tmp_path):
    """A failed load is answered again at once for a short while only: the cause may lie outside the file (a cache,
    memory), and once it is fixed a later request loads the model, with no change to its file."""
    import asyncio

    from bitnet_cpu.serve.router import ModelSpec, Router, RouterError
    path = tmp_path / "m.bnstore"
    path.write_bytes(b"x")
    spec = ModelSpec("m", str(path), size=1, modified=path.stat().st_mtime)

    async def scenario():
        router = Router(lambda: {"m": spec}, fake_model_command(SERVES_IF_OK), log=lambda line: None,
                        failed_retry=0.3)
        await router.start()
        try:
            for _ in range(2):
                with pytest.raises(RouterError) as e:
                    await router.acquire(spec)
                assert e.value.status == 500 and "cannot create the cache directory" in e.value.message
            assert router.counts[("loads", "m")] == 1   # the second answer was the remembered one
            (tmp_path / "m.bnstore.ok").write_text("")   # the cause, fixed; the file itself unchanged
            deadline = time.monotonic() + 30 * slowness()
            while True:
                try:
                    c = await router.acquire(spec)
                    break
                except RouterError:
                    assert time.monotonic() < deadline, "never tried again"
                    await asyncio.sleep(0.05)
            await router.release(c)
            assert router.counts[("loads", "m")] == 2 and router.status("m") == "loaded"
            assert "m" not in router.failed
        finally:
            await router.close()
    asyncio.run(scenario())


# a model process whose file is removed while it loads: it waits for that, then says what the CLI says
LOSES_ITS_FILE = """
import os, sys, time
while os.path.exists(sys.argv[1]):
    time.sleep(0.02)
print("bitnet: error: model " + repr(sys.argv[1]) + " (-m/--model): no such file or directory (hint: give a model "
      "file, a directory, or a hub id such as microsoft/bitnet-b1.58-2B-4T)", flush=True)
sys.exit(2)
"""


def test_a_model_file_removed_while_it_loads_is_a_404_in_the_routers_words(tmp_path):
    """A model file deleted (ollama's /api/delete, rm) while its first request waits for its load: that request
    got the model process's command-line error (-m/--model, a hub id such as ...) as a 500 load_failed. It is a 404
    saying the file is gone, not counted as a failed load nor remembered."""
    import asyncio

    from bitnet_cpu.serve.router import ModelSpec, Router, RouterError
    path = tmp_path / "delme.bnstore"
    path.write_bytes(b"x")
    spec = ModelSpec("delme", str(path), size=1, modified=path.stat().st_mtime)

    async def scenario():
        router = Router(lambda: {"delme": spec}, fake_model_command(LOSES_ITS_FILE), log=lambda line: None)
        await router.start()
        try:
            waiting = asyncio.ensure_future(router.acquire(spec))
            while "delme" not in router.children:   # its process started
                await asyncio.sleep(0.01)
            path.unlink()
            with pytest.raises(RouterError) as e:
                await waiting
            return e.value, dict(router.counts), dict(router.failed)
        finally:
            await router.close()
    e, counts, failed = asyncio.run(scenario())
    assert e.status == 404 and e.code == "model_not_found", (e.status, e.message)
    assert "delme" in e.message and "removed" in e.message and "-m/--model" not in e.message, e.message
    assert ("load_failures", "delme") not in counts and "delme" not in failed


def test_names_match_in_any_unicode_normalisation(tmp_path):
    """A file named on macOS is NFD ("cafe" + U+0301); a name typed elsewhere is NFC ("caf" + U+00E9): they look
    the same, and the 404 listed "café" beside "model 'café' not found". Names match after NFC as after case."""
    import asyncio

    from bitnet_cpu.serve.router import ModelSpec, Router, RouterError
    nfd, nfc = "cafe\u0301", "caf\u00e9"
    specs = {name: ModelSpec(name, str(tmp_path / f"{name}.bnstore")) for name in (nfd, "alpha")}
    router = Router(lambda: dict(specs), fake_model_command(""), log=lambda line: None)
    try:
        for asked in (nfc, nfd, "CAF\u00c9", "CAFE\u0301:latest"):
            assert router.find(asked) is specs[nfd], asked
        both = {**specs, nfc: ModelSpec(nfc, str(tmp_path / "other.bnstore"))}   # two files, one name: one answer
        router.scan, router.models = (lambda: dict(both)), dict(both)
        assert router.find(nfc) is both[nfc] and router.find(nfd) is both[nfd]   # each exact name is its own
        with pytest.raises(RouterError) as e:
            asyncio.run(router.resolve("CAF\u00c9"))
        assert e.value.status == 404 and "normalisation" in e.value.message, e.value.message
    finally:
        asyncio.run(router.close())


def test_describe_answers_are_kept_for_the_whole_catalog_and_go_with_its_files(tmp_path):
    """The answers read from the files for /api/show and /api/tags (and the files found unreadable) were bounded
    at a fixed count, below which a larger catalog evicted at every listing what the one before had read. They are
    kept for every model of the catalog however small shows_max (here 4, with 10 models): each file is read once
    over many listings; a model gone from the catalog loses its answer at the next scan."""
    import asyncio

    from bitnet_cpu.engine.api import model_card
    from bitnet_cpu.serve.ollama import model_details
    from bitnet_cpu.serve.router import ModelSpec, Router

    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / "m0.bnstore")
    for i in range(1, 9):
        os.link(tmp_path / "m0.bnstore", tmp_path / f"m{i}.bnstore")
    (tmp_path / "broken.bnstore").write_bytes(b"BNSTORE\x00" + b"\x17" * 4096)
    names = [f"m{i}" for i in range(9)] + ["broken"]
    listed, read = list(names), []

    def describe(spec):   # the files' own details, as the router's describe reads them; each read noted
        read.append(spec.name)
        return {"details": model_details(model_card(spec.path).config, spec.format)}

    async def run():
        router = Router(lambda: {n: ModelSpec(n, str(tmp_path / f"{n}.bnstore")) for n in listed},
                        fake_model_command(""), log=lambda line: None, describe=describe, shows_max=4)
        try:
            async def listing():
                await router.refresh(fresh=True)
                await router.describe_all(list(router.models.values()))
                return {spec.name: router.tag(spec)["details"] for spec in router.models.values()}
            first = await listing()
            assert sorted(read) == sorted(names)
            assert all(first[n]["family"] and first[n]["parameter_size"] for n in names[:-1]), first
            assert first["broken"]["family"] == ""
            for _ in range(3):
                assert await listing() == first
            assert sorted(read) == sorted(names)   # not one file read again
            del listed[:6]
            await listing()
            here = {spec.digest() for spec in router.models.values()}
            assert set(router.shows) | set(router.unreadable) == here and len(here) == 4
            assert sorted(read) == sorted(names)
        finally:
            await router.close()
    asyncio.run(run())


def test_odd_names_are_found_by_every_api(tmp_path):
    """A name with a space at either end, listed by /api/tags and served by /api/chat, was a 404 at ollama's
    /api/show (which Open WebUI asks of every listed model): the name was stripped there alone. A name in NFC finds
    its NFD file over HTTP too, and /v1/models/NAME with a newline in NAME is the API's 404 or entry, never
    FastAPI's {"detail": "Not Found"}."""
    model = os.path.join(ROOT, "models", "default.bnstore")
    for name in (" lead", "trail ", "cafe\u0301", "new\nline"):
        shutil.copy(model, tmp_path / f"{name}.bnstore")
    s = Server("--models-dir", str(tmp_path), "-c", "1024", threads=1)
    try:
        names = {m["name"] for m in httpx.get(s.url + "/api/tags", timeout=30).json()["models"]}
        assert {" lead:latest", "trail :latest"} <= names
        for name in (" lead", "trail "):
            r = post(s.url, "/api/show", {"model": name})
            assert r.status_code == 200 and "modelfile" in r.json(), (name, r.text)
        r = post(s.url, "/api/show", {"model": "lead"})   # the stripped name is no model's
        assert r.status_code == 404 and "model 'lead' not found" in r.json()["error"], r.text
        r = httpx.get(s.url + "/v1/models/caf%C3%A9", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == "cafe\u0301", r.text
        r = post(s.url, "/v1/chat/completions", {"model": "caf\u00e9", "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "cafe\u0301", r.text
        r = httpx.get(s.url + "/v1/models/new%0Aline", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == "new\nline", r.text
        r = httpx.get(s.url + "/v1/models/no%0Asuch", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        r = post(s.url, "/api/generate", {"model": " lead", "prompt": "Hi", "keep_alive": True})
        assert r.status_code == 400 and r.json()["error"].startswith("keep_alive: true is not"), r.text
    finally:
        s.stop()


@pytest.mark.parametrize("value", ["-5m", "-1h30m", "-1.5h", "-1"])
def test_a_negative_duration_flag_is_taken_as_its_value(models_dir, value):
    """`--models-keep-alive -5m` was argparse's "expected one argument" (only `=-5m` and plain numbers were
    taken): a negative duration is a value, as ollama's negative keep_alive is."""
    from bitnet_cpu.cli import build_parser
    subs: dict = {}
    build_parser(subs)
    args = subs["serve"].parse_args(["--models-dir", str(models_dir), "--models-keep-alive", value])
    assert args.models_keep_alive == value
    args = subs["serve"].parse_args(["--models-dir", str(models_dir), "--models-load-timeout", "-1e3"])
    assert args.models_load_timeout == -1000.0
    args = subs["serve"].parse_args(["-m", "x", "-c", "1024"])   # short flags stay flags
    assert args.ctx == 1024


def test_a_router_out_of_descriptors_says_so_and_never_blames_the_model(tmp_path):
    """The router under `ulimit -n 64` (its cap lowered to 16), 10 clients within the cap part-way through their
    headers, then a flood of silent connections that takes the descriptors left: the 10 could not connect to
    their (healthy) model's process and got 502 "model 'tiny' did not answer: ConnectError", which sent an
    operator to the wrong place. They get the plain server's 503 out_of_resources + Retry-After, and the log says
    why in one line."""
    import json
    import resource
    import socket

    from serve_proc import free_port, pythonpath, wait_healthy
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / "tiny.bnstore")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--models-dir", str(tmp_path), "-c", "1024",
                             "-t", "1", "--port", str(port), "--header-timeout", "600"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()), stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 3}).encode()
    pre, silent, answers = [], [], []
    try:
        assert wait_healthy(url, 60 * slowness(), proc)
        assert post(url, "/v1/completions", json.loads(body)).status_code == 200   # its model loaded
        for _ in range(10):
            c = socket.create_connection(("127.0.0.1", port), timeout=30 * slowness())
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            pre.append(c)
        time.sleep(0.3)
        for _ in range(250):
            try:
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(0.05)
        for c in pre:
            c.sendall(b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        for c in pre:
            data = b""
            try:
                while len(data) < 1 << 20:
                    more = c.recv(65536)
                    if not more:
                        break
                    data += more
            except OSError:
                pass
            answers.append(data)
    finally:
        for c in pre + silent:
            c.close()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    heads = [a.split(b"\r\n")[0] for a in answers]
    assert not any(b" 502 " in h for h in heads), (heads, answers[:2], err[-2000:])
    short = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    assert short, (heads, err[-2000:])   # the flood took what the 10 needed to reach their model
    for a in short:
        head, _, rest = a.partition(b"\r\n\r\n")
        assert b"retry-after:" in head.lower() and json.loads(rest)["error"]["code"] == "out_of_resources", a[:500]
    assert "too many open files connecting to model 'tiny'" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]


def test_a_model_that_cannot_be_started_for_want_of_descriptors_is_a_503_and_unloads_nothing(tmp_path):
    """The router near its open-files limit (lowered on the running process, as prlimit does), a request for a
    model not loaded: starting its process failed with EMFILE, a plain-text 500 with a traceback in the log; and
    with --models-max 1 the idle loaded model was unloaded for room first, so nothing was loaded after. Now it is
    the 503 out_of_resources + Retry-After in each API's shape, one log line, and the loaded model stays."""
    import resource

    for name in ("alpha", "beta"):
        shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / f"{name}.bnstore")
    s = Server("--models-dir", str(tmp_path), "--models-max", "1", "-c", "1024", threads=1)
    answers = []
    try:
        assert chat_text(s.url, "alpha")["model"] == "alpha"
        (kid,) = children_of(s.proc.pid)
        soft, hard = resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE)
        n = len(os.listdir(f"/proc/{s.proc.pid}/fd"))
        resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (n + 2, hard))   # the connection, and one more
        try:
            answers.append(post(s.url, "/api/generate", {"model": "beta", "prompt": "hi", "stream": False}))
            answers.append(post(s.url, "/v1/chat/completions", {"model": "beta", "messages": CHAT,
                                                                "max_tokens": 2}))
        finally:
            resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert alive(kid) and children_of(s.proc.pid) == [kid]   # alpha was not stopped for nothing
        assert loaded(s.url) == {"alpha"}
        assert 'reason="room"' not in httpx.get(s.url + "/metrics", timeout=30).text
        assert chat_text(s.url, "beta")["model"] == "beta"   # descriptors back: it loads
    finally:
        code, err = s.stop()
    ollama, openai = answers
    for r in answers:
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text, err[-2000:])
        assert r.headers["content-type"].startswith("application/json"), r.headers
    assert ollama.json() == {"error": ollama.json()["error"]} and "out of resources" in ollama.json()["error"]
    assert openai.json()["error"]["code"] == "out_of_resources", openai.text
    said = [ln for ln in err.splitlines() if "starting model 'beta'" in ln]
    assert len(said) == 2 and all("too many open files" in ln for ln in said), err[-2000:]
    assert "Traceback" not in err, err[-3000:]


# a model process whose load waits for its file's "FILE.ok" (the test says when it is loaded), then answers every
# POST with one ollama answer; its /health says 503 until then
LOADS_WHEN_OK = """
import http.server, json, os, socket, sys
class Model(http.server.BaseHTTPRequestHandler):
    def answer(self, status, body):
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.answer(200 if os.path.exists(sys.argv[1] + ".ok") else 503, b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.answer(200, json.dumps({"model": "m", "response": "x", "done": True}).encode())
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", 0), Model, bind_and_activate=False)
srv.socket = socket.socket(fileno=int(os.environ["BITNET_LISTEN_FD"]))
srv.serve_forever()
"""


@pytest.mark.parametrize("unload", ["ollama", "llama-server"])
def test_an_unload_asked_while_the_model_loads_for_an_earlier_request_wins(tmp_path, unload):
    """A request that loads a model, then an unload (ollama's empty request with keep_alive 0, or POST
    /models/unload) while that load goes on: the unload answered "unload" / success, then the first request, once
    its model had loaded, set its own keep_alive over it, and the model stayed loaded for ever. The latest request's
    keep_alive wins (ollama's rule): the model is unloaded once the first request has ended."""
    import asyncio

    from bitnet_cpu.serve.router import ModelSpec, Router, create_router_app
    path = tmp_path / "m.bnstore"
    path.write_bytes(b"x")
    spec = ModelSpec("m", str(path), size=1, modified=path.stat().st_mtime)
    lines: list[str] = []

    async def scenario():
        router = Router(lambda: {"m": spec}, fake_model_command(LOADS_WHEN_OK), log=lines.append)
        app = create_router_app(router)
        await router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=60 * slowness()) as client:
                first = asyncio.ensure_future(client.post("/api/generate", json={"model": "m", "prompt": "hi",
                                                                                 "stream": False}))
                deadline = time.monotonic() + 30 * slowness()
                while not ("m" in router.children and router.children["m"].active == 1):   # admitted, loading
                    assert time.monotonic() < deadline and not first.done(), "never admitted"
                    await asyncio.sleep(0.01)
                assert router.status("m") == "loading"
                if unload == "ollama":
                    u = await client.post("/api/generate", json={"model": "m", "keep_alive": 0})
                    assert u.status_code == 200 and u.json()["done_reason"] == "unload", u.text
                else:
                    u = await client.post("/models/unload", json={"model": "m"})
                    assert u.status_code == 200 and u.json() == {"success": True}, u.text
                (tmp_path / "m.bnstore.ok").write_text("")   # its load ends now
                r = await first
                assert r.status_code == 200 and r.json()["done"] is True, r.text
                deadline = time.monotonic() + 30 * slowness()
                while "m" in router.children and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                return router.status("m"), dict(router.counts)
        finally:
            await router.close()
    status, counts = asyncio.run(scenario())
    assert status == "unloaded", lines
    assert counts.get(("unloads", "m", "request")) == 1, counts


def test_a_model_that_drains_and_exits_while_the_router_stops_is_no_crash(tmp_path_factory):
    """SIGTERM with one model idle and another streaming: the idle one's process drains at once and exits 0 while
    the router waits for the stream, and the router said "'alpha': its process exited with code 0", its line for a
    crash, and counted an unload "exited". It is the drain's normal end: not said so. The stream, cut by the drain,
    ends in ollama's shape with "cut_by": "shutdown" through the router too."""
    import json

    from serve_proc import slow_model
    slow = slow_model(tmp_path_factory)
    d = tmp_path_factory.mktemp("drain-models")
    for name in ("alpha", "beta"):
        shutil.copy(slow, d / f"{name}.bnstore")
    s = Server("--models-dir", str(d), "--models-max", "2", "-c", "4096", "--drain-timeout", "3", threads=1)
    events = []
    try:
        r = post(s.url, "/api/generate", {"model": "alpha", "prompt": "a", "stream": False,
                                          "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        with httpx.stream("POST", s.url + "/api/generate", timeout=60 * slowness(), json={
                "model": "beta", "prompt": "a", "raw": True, "options": {"num_predict": 4000, "temperature": 0}}) as r:
            for ln in r.iter_lines():
                if ln.strip():
                    events.append(json.loads(ln))
                    if len(events) == 5:
                        s.proc.send_signal(signal.SIGTERM)
    finally:
        code, err = s.stop(sig=None, timeout=60 * slowness())
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert "exited with code" not in err, err[-2000:]
    last = events[-1]
    assert last["done"] is True and last["done_reason"] == "stop" and last.get("cut_by") == "shutdown", last
    assert len(events) < 4000, len(events)
