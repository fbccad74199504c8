"""Fill-in-the-middle (serve/fim.py) on the server's routes, in process (fastapi's TestClient over create_app): a
small random model whose vocabulary has Qwen's FIM tokens (a synthetic model's tokenizer with six reserved specials
renamed) answers llama-server's /infill, /v1/completions' `suffix` and /api/generate's `suffix`; the bundled model,
which has none, refuses every FIM field with one message saying why. Each answer is checked against the same
server's answer to the prompt it says it ran (token ids sent to /completion), not against stored text."""
from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from fastapi.testclient import TestClient  # noqa: E402

from test_model_fixtures import make_synth  # noqa: E402

# six reserved specials of the synthetic LLaMA-3-like tokenizer, given Qwen2.5's FIM names
FIM_NAMES = {"<|reserved_special_token_2|>": "<|fim_prefix|>", "<|reserved_special_token_3|>": "<|fim_middle|>",
             "<|reserved_special_token_4|>": "<|fim_suffix|>", "<|reserved_special_token_5|>": "<|fim_pad|>",
             "<|reserved_special_token_6|>": "<|repo_name|>", "<|reserved_special_token_7|>": "<|file_sep|>"}
NO_FIM = "vocabulary has no fill-in-the-middle tokens"
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


def _rename_tokens(path: str):
    with open(path) as f:
        text = f.read()
    for old, new in FIM_NAMES.items():
        text = text.replace(json.dumps(old), json.dumps(new))
    with open(path, "w") as f:
        f.write(text)


def _client(load):
    from bitnet_cpu.serve.app import create_app
    return TestClient(create_app(load))


def _loaded(tc):
    """Wait (bounded) until the model has loaded: /health answers 200."""
    import time

    from helpers import slowness
    deadline = time.monotonic() + 120 * slowness()
    while tc.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.05)
    return tc


@pytest.fixture(scope="module")
def fim_store(tmp_path_factory) -> str:
    """A synthetic model's store whose vocabulary has Qwen's FIM tokens."""
    from bitnet_cpu.engine.formats.convert import convert

    root = tmp_path_factory.mktemp("fim")
    _, hf, _ = make_synth(root, seed=3, lm_heads=())
    fim_dir = str(root / "hf-fim")
    shutil.copytree(hf, fim_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(fim_dir, name)):
            _rename_tokens(os.path.join(fim_dir, name))
    return convert(fim_dir, fim_dir + ".bnstore", progress=False)


@pytest.fixture(scope="module")
def fim(fim_store):
    """A TestClient on a synthetic model with FIM tokens; its token ids by name."""
    from bitnet_cpu.engine.api import load_engine

    store = fim_store
    with _client(lambda: load_engine(store, threads=1, parallel=2, progress=False)) as tc:
        _loaded(tc)
        ids = {name: tc.post("/tokenize", json={"content": name}).json()["tokens"] for name in FIM_NAMES.values()}
        assert all(len(v) == 1 for v in ids.values()), ids
        yield tc, {k: v[0] for k, v in ids.items()}


@pytest.fixture(scope="module")
def plain():
    """A TestClient on the bundled model (no FIM tokens in its vocabulary)."""
    from bitnet_cpu.engine.api import load_engine
    with _client(lambda: load_engine(None, threads=1, parallel=2, progress=False)) as tc:
        yield _loaded(tc)


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def _greedy_ids(tc, ids, n=6):
    """What the server answers to the prompt `ids` (token ids as they are), greedy."""
    return _ok(tc.post("/completion", json={"prompt": ids, "n_predict": n, "temperature": 0,
                                            "return_tokens": True}))


def test_infill_runs_llama_servers_fim_prompt(fim):
    """input_extra's files, then <|fim_prefix|> prefix prompt <|fim_suffix|> suffix <|fim_middle|>, as llama-server
    builds it (the repo-level form where the vocabulary has <|repo_name|> and <|file_sep|>); the middle is the
    answer to those tokens."""
    tc, tok = fim
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX,
            "input_extra": [{"filename": "x.py", "text": "import os\n"}], "prompt": "ret", "n_predict": 6,
            "temperature": 0, "return_tokens": True}
    got = _ok(tc.post("/infill", json=body))
    bos = tc.post("/tokenize", json={"content": "", "add_special": True}).json()["tokens"]
    bos_text = tc.post("/detokenize", json={"tokens": bos}).json()["content"]
    assert got["prompt"] == (bos_text + "<|repo_name|>myproject\n<|file_sep|>x.py\nimport os\n<|file_sep|>filename\n"
                             "<|fim_prefix|>" + PREFIX + "ret<|fim_suffix|>" + SUFFIX + "<|fim_middle|>")
    # each piece tokenized alone, the FIM tokens as ids (tokenize_mixed)
    ran = bos + tc.post("/tokenize", json={"content": [
        tok["<|repo_name|>"], "myproject\n", tok["<|file_sep|>"], "x.py\n", "import os\n", tok["<|file_sep|>"],
        "filename\n", tok["<|fim_prefix|>"], PREFIX, "ret", tok["<|fim_suffix|>"], SUFFIX,
        tok["<|fim_middle|>"]]}).json()["tokens"]
    assert got["tokens_evaluated"] == len(ran)
    same = _greedy_ids(tc, ran)
    assert got["content"] == same["content"] and got["tokens"] == same["tokens"]
    streamed = tc.post("/infill", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events if not e["stop"]) == got["content"] and events[-1]["stop"]


def test_infill_reads_control_tokens_in_the_code_as_text(fim):
    """A file that holds the text "<|fim_middle|>" does not end the prefix early (llama-server tokenizes the
    prefix and suffix without parsing special tokens)."""
    tc, tok = fim
    got = _ok(tc.post("/infill", json={"input_prefix": "x = '<|fim_middle|>'", "input_suffix": "", "n_predict": 1,
                                       "return_tokens": True}))
    plain = _ok(tc.post("/infill", json={"input_prefix": "x = ''", "input_suffix": "", "n_predict": 1}))
    assert got["tokens_evaluated"] > plain["tokens_evaluated"] + 1


def test_a_fim_end_token_ends_the_middle(fim):
    """<|fim_pad|> (and the repo / file separators) end the middle, as llama.cpp counts them end of generation."""
    tc, tok = fim
    got = _ok(tc.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8,
                                       "logit_bias": [[tok["<|fim_pad|>"], 100]]}))
    assert got["content"] == "" and got["stop_type"] == "eos" and got["tokens_predicted"] == 1, got
    for name in ("<|repo_name|>", "<|file_sep|>"):
        got = _ok(tc.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8,
                                                    "logit_bias": {str(tok[name]): 100}}))
        assert got["choices"][0]["finish_reason"] == "stop" and got["usage"]["completion_tokens"] == 1, got


def test_infill_checks_its_fields(fim):
    tc, _ = fim
    for body, param in (({"input_suffix": "x"}, "input_prefix"), ({"input_prefix": "x"}, "input_suffix"),
                        ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": 5}]}, "input_extra"),
                        ({"input_prefix": "a", "input_suffix": "b", "input_extra": "x"}, "input_extra"),
                        ({"input_prefix": "a", "input_suffix": "b", "suffix": "c"}, "suffix")):
        r = tc.post("/infill", json=body)
        assert r.status_code == 400 and param in r.json()["error"]["message"], (body, r.text)


def test_v1_completions_suffix_fills_in_the_middle(fim):
    """OpenAI's suffix: the prompt is the text before the gap; the answer is the middle, as /infill's."""
    tc, _ = fim
    got = _ok(tc.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 6,
                                                "temperature": 0}))
    same = _ok(tc.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6,
                                        "temperature": 0}))
    # no repo-level lines here (no input_extra): the prompt is BOS, <|repo_name|>..., prefix, suffix, middle
    assert got["choices"][0]["text"] == same["content"]
    assert got["usage"]["prompt_tokens"] == same["tokens_evaluated"]
    for body, param in (({"prompt": [[1, 2]], "suffix": "x"}, "suffix"), ({"prompt": "a", "suffix": "x", "echo": True},
                                                                           "suffix"),
                        ({"prompt": "a", "input_suffix": "x"}, "input_suffix")):
        r = tc.post("/v1/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_ollama_generate_suffix_fills_in_the_middle(fim):
    tc, _ = fim
    got = _ok(tc.post("/api/generate", json={"model": "m", "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
                                             "options": {"num_predict": 6, "temperature": 0}}))
    same = _ok(tc.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6,
                                        "temperature": 0}))
    assert got["response"] == same["content"] and got["prompt_eval_count"] == same["tokens_evaluated"]


def test_completion_refuses_infill_fields_pointing_to_infill(fim):
    """/completion completes its prompt alone: /infill's fields were dropped in silence (a plain completion of
    `prompt`); now a 400 naming the field and where it is taken."""
    tc, _ = fim
    for name, value in (("input_prefix", "def f("), ("input_suffix", "):"), ("input_extra", [{"text": "a"}]),
                        ("suffix", "x")):
        r = tc.post("/completion", json={"prompt": "a", "n_predict": 1, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name and "/infill" in r.text, r.text
        # suffix is /v1/completions' field (/infill refuses it): it was called "an /infill field"
        assert ("an /infill field" in r.text) == (name != "suffix") and ("suffix" != name or "/v1/completions' "
                                                                         "field" in r.text), r.text
    for off in ("", None, []):   # what clients send at a file's end: asks for nothing
        _ok(tc.post("/completion", json={"prompt": "a", "n_predict": 1, "input_suffix": off, "input_extra": off}))


# ---- the bundled model: no FIM tokens ------------------------------------------------------------------------
def test_every_fim_field_is_refused_with_the_vocabularys_reason(plain):
    """One message everywhere, computed from the model's vocabulary (it said "the ternary models served here have
    no FIM tokens", "suffix is not supported", and on chat pointed to /v1/completions, which refused it too)."""
    r = plain.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):"})
    assert r.status_code == 501 and NO_FIM in r.json()["error"]["message"], r.text
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    for path, body, param in (("/completion", {"prompt": "a", "input_prefix": "b"}, "input_prefix"),
                              ("/completion", {"prompt": "a", "input_suffix": "b"}, "input_suffix"),
                              ("/completion", {"prompt": "a", "input_extra": [{"text": "b"}]}, "input_extra"),
                              ("/completion", {"prompt": "a", "suffix": "b"}, "suffix"),
                              ("/v1/completions", {"prompt": "a", "input_suffix": "b"}, "input_suffix"),
                              ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
                              ("/v1/chat/completions", {**chat, "suffix": "b"}, "suffix"),
                              ("/v1/chat/completions/input_tokens", {**chat, "suffix": "b"}, "suffix")):
        r = plain.post(path, json={**body, "max_tokens": 1})
        e = r.json()["error"]
        assert r.status_code == 400 and e["param"] == param and NO_FIM in e["message"], (path, r.text)
        assert e["message"].startswith(param + ": "), e
    r = plain.post("/api/generate", json={"model": "m", "prompt": "a", "suffix": "b", "stream": False})
    assert r.status_code == 400 and r.json()["error"].startswith("suffix: ") and NO_FIM in r.json()["error"], r.text


def test_other_fim_apis_are_explained(plain):
    """Mistral's and DeepSeek's FIM routes were a bare 404 "Not Found"."""
    for path in ("/v1/fim/completions", "/beta/completions"):
        r = plain.post(path, json={"model": "x", "prompt": "def f():", "suffix": "\n", "max_tokens": 4})
        assert r.status_code == 501 and "/v1/completions" in r.json()["error"]["message"], (path, r.text)


# ---- stop strings: FIM clients send their model's control tokens ------------------------------------------
QWEN_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
              "<|file_sep|>", "<|im_start|>", "<|im_end|>", "\n\n"]


def test_many_stop_strings_are_taken_on_every_endpoint(plain):
    """Continue and Tabby send 5-10 stop strings to a local server (OpenAI's limit of 4 was a 400 on every
    autocompletion); the bound is 64 strings and 8192 characters, on every endpoint."""
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 1}), ("/v1/chat/completions", chat),
                       ("/completion", {"prompt": "a", "n_predict": 1}),
                       ("/v1/responses", {"input": "a", "max_output_tokens": 16})):
        _ok(plain.post(path, json={**body, "stop": QWEN_STOPS}))
        for stop in ([f"s{i}" for i in range(65)], ["x" * 5000, "y" * 5000]):
            r = plain.post(path, json={**body, "stop": stop})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop", (path, r.text)
    _ok(plain.post("/api/generate", json={"model": "m", "prompt": "a", "stream": False,
                                          "options": {"num_predict": 1, "stop": QWEN_STOPS}}))
    r = plain.post("/api/generate", json={"model": "m", "prompt": "a", "stream": False,
                                          "options": {"num_predict": 1, "stop": ["x" * 5000, "y" * 5000]}})
    assert r.status_code == 400 and "options.stop" in r.json()["error"], r.text
    r = plain.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "a"}],
                                         "stop_sequences": QWEN_STOPS[:-1]})
    assert r.status_code == 200, r.text


def test_engine_end_ids_end_a_request_as_end_of_text():
    """The engine's end_ids (a filled-in middle's FIM pad and separators): the token ends the answer as end of
    text does ("eos", not in the text), and ignore_eos bans it too."""
    from bitnet_cpu.engine.api import load_engine
    from bitnet_cpu.engine.errors import BitNetError
    from bitnet_cpu.engine.runtime.sampling import SamplingParams
    with load_engine(None, threads=1, parallel=1, progress=False) as eng:
        ids = eng.tokenize("Once upon a time", add_bos=True)
        x = eng.tokenize(" the")[0]
        forced = SamplingParams(temperature=0.0, logit_bias={x: 100.0})
        chunks = list(eng.submit(ids, forced, max_tokens=4, end_ids=[x]))
        assert chunks[-1].finish_reason == "eos" and "".join(c.text for c in chunks) == ""
        chunks = list(eng.submit(ids, forced, max_tokens=3, end_ids=[x], ignore_eos=True))
        assert chunks[-1].finish_reason == "length" and all(c.token != x for c in chunks)
        with pytest.raises(BitNetError, match="end_ids"):
            eng.submit(ids, forced, max_tokens=1, end_ids=[10 ** 9])


@pytest.mark.parametrize("ctx", [256, 512, 2048])
def test_a_long_prefix_and_suffix_are_cut_to_fit_the_context(fim_store, ctx):
    """At a context of 2048 or less the batch's bound alone (1536 prefix and 510 suffix tokens) made a prompt
    longer than the context: every large file was a 400 for the server's own cut. The prompt now leaves the
    answer's room, keeps the prefix's end and the suffix's start, 3:1, and the server answers it."""
    from bitnet_cpu.engine.api import load_engine
    from bitnet_cpu.serve.fim import fim_tokens, infill_ids

    prefix, suffix = "x = 1\n" * 3000, "y = 2\n" * 3000
    with load_engine(fim_store, ctx=ctx, threads=1, parallel=1, progress=False) as eng:
        fim = fim_tokens(eng.tokenizer)
        ids = infill_ids(eng, fim, prefix, suffix, answer_room=16)
        assert len(ids) + 16 <= eng.n_ctx and ids[-1] == fim.mid, (len(ids), eng.n_ctx)
        pre, suf = ids[ids.index(fim.pre) + 1:ids.index(fim.suf)], ids[ids.index(fim.suf) + 1:-1]
        assert len(pre) >= 2 * len(suf) > 0, (len(pre), len(suf))
        whole_pre = eng.tokenize(prefix, add_bos=False, special=False)
        whole_suf = eng.tokenize(suffix, add_bos=False, special=False)
        assert pre == whole_pre[len(whole_pre) - len(pre):] and suf == whole_suf[:len(suf)]
        assert len(ids) + 16 > eng.n_ctx - 8   # the context is used, not left empty
    with _client(lambda: load_engine(fim_store, ctx=ctx, threads=1, parallel=1, progress=False)) as tc:
        _loaded(tc)
        for path, body in (("/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4}),
                           ("/v1/completions", {"prompt": prefix, "suffix": suffix, "max_tokens": 4}),
                           ("/api/generate", {"model": "m", "prompt": prefix, "suffix": suffix, "stream": False,
                                              "options": {"num_predict": 4}})):
            r = tc.post(path, json={**body, "temperature": 0})   # (the characters were refused before the cut)
            assert r.status_code == 200, (path, r.text)
