"""Golden behaviour of the bundled default model (models/), through the real CLI: no training, no torch.

- `bitnet run -p "2+3=" --temp 0` answers 5 (bare form);
- addition in chat form (`bitnet run --chat`) on random pairs (fixed seed): 9 of 10 within 2 of the sum,
  at least 9 exact (the shipped model: 98.25% exact in chat form, 99.35% bare; see models/README.md);
- a story prompt continues with dictionary words (>= 90% of the words are in the corpus grammar's words);
- `bitchat` (piped) answers a greeting and "who are you" in a friendly, on-topic way;
- models/README.md's greedy samples are what `bitnet run --kv f32` prints, and the default cache's one flip is shown;
- the shipped store is what converting the shipped HF directory gives (tensors and metadata: a converter that
  records more must regenerate it), and it is <= 25 MB.
"""
import os
import random
import re
import subprocess

import numpy as np

from bitnet_cpu.models import DEFAULT_MODEL_DIR, DEFAULT_STORE
from bitnet_cpu.models.corpus import WORDS
from helpers import ROOT, console_script


def bitnet_run(*args: str, stdin: str | None = None) -> str:
    r = subprocess.run(console_script("bitnet") + ["run", "-t", "2", *args], capture_output=True, text=True, input=stdin,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_shipped_files_and_size():
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, f)), f
    assert os.path.getsize(DEFAULT_STORE) <= 25 * 2 ** 20


def test_store_is_the_conversion_of_the_hf_dir(tmp_path):
    from bitnet_cpu.engine.formats.convert import bundled_model, convert
    from bitnet_cpu.engine.formats.store import Store

    assert os.path.realpath(bundled_model()) == os.path.realpath(DEFAULT_STORE)
    fresh = convert(DEFAULT_MODEL_DIR, str(tmp_path / "fresh.bnstore"), lm_head="f16", progress=False)
    a, b = Store(DEFAULT_STORE), Store(fresh)
    assert a.config == b.config
    assert a.tokenizer_spec == b.tokenizer_spec
    # what a newer converter records (bos/eos tokens a template renders, add_bos) must be in the shipped store too
    assert a.meta == b.meta and a.chat_template == b.chat_template
    names = sorted(a.tensor_names)
    assert names == sorted(b.tensor_names)
    for n in names:
        assert np.array_equal(a.tensor(n), b.tensor(n)), n


def test_bare_addition_cli():
    out = bitnet_run("-p", "2+3=", "--temp", "0", "-n", "8")
    assert re.match(r"\s*5(\D|$)", out), out


def test_chat_addition_cli():
    # The shipped model is 98.25% exact in chat form over all 10,000 pairs (99.35% bare; models/README.md);
    # its misses are nearly always within 2 of the truth (mostly a zero or one-digit operand), so this
    # guards that plus a floor of exact answers that a model at the 95% target passes on 10 pairs.
    rng = random.Random(2024)
    exact, close, seen = 0, 0, []
    for _ in range(10):
        a, b = rng.randrange(100), rng.randrange(100)
        out = bitnet_run("--chat", "-p", f"What is {a}+{b}?", "--temp", "0", "-n", "16")
        m = re.search(r"=\s*(\d+)", out)
        exact += bool(m and int(m.group(1)) == a + b)
        close += bool(m and abs(int(m.group(1)) - (a + b)) <= 2)
        seen.append((a, b, out))
    assert close >= 9 and exact >= 9, seen


def test_story_continues_with_dictionary_words():
    out = bitnet_run("-p", "Once upon a time, there was a little fox named Pip.", "--temp", "0", "-n", "80")
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", out)]
    assert len(words) >= 20, out
    known = sum(w in WORDS for w in words)
    assert known >= 0.9 * len(words), (out, [w for w in words if w not in WORDS])


def test_friendly_exchange_bitchat():
    r = subprocess.run(console_script("bitchat") + ["--temp", "0", "-n", "60", "-t", "2"], input="Hello!\nWho are you?\n",
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"\b(Hello|Hi)\b", out), out
    assert "BitNet" in out, out


def test_kv_q8_answers_and_stays_near_f16_over_long_generations(capsys):
    """--kv q8 end to end (the CLI answers 2+3 with 5), and greedy agreement with the f16 cache over 400 tokens,
    reported (int8 K/V is not f16: a near tie between two tokens may flip and the texts part there). Measured
    when written: first divergence at tokens 400+ / 61 / 107 for these prompts; the bound asserted is loose (16),
    the perplexity of held-out text within 1% (measured 2.4714 f16 vs 2.4742 q8 at depth 512, bench/kv_quality.py)."""
    assert bitnet_run("-p", "2+3=", "--temp", "0", "-n", "4", "--kv", "q8").strip().startswith("5")
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.engine.formats.tokenizer import Tokenizer
    from bitnet_cpu.engine.runtime.model import Model

    st = Store(DEFAULT_STORE)
    tok = Tokenizer.from_store(st)
    n = 400

    def greedy(kv, ids):
        m = Model(st, n_ctx=len(ids) + n + 1, kv_dtype=kv)
        lg, out = m.prefill(ids), []
        for _ in range(n):
            out.append(int(np.argmax(lg)))
            lg = m.decode(out[-1])
        return out

    firsts = []
    for prompt in ("Once upon a time", "What is 37 + 45?", "The little robot"):
        ids = tok.encode(prompt)
        f, q = greedy("f16", ids), greedy("q8", ids)
        firsts.append(next((i for i, (x, y) in enumerate(zip(f, q)) if x != y), n))
    with capsys.disabled():
        print(f"\n[kv q8 vs f16] first greedy divergence over {n} tokens: {firsts}")
    assert min(firsts) >= 16
    from bitnet_cpu.models import corpus

    rng, text = random.Random(987654321), ""   # held-out procedural stories (bench/kv_quality.py's)
    while len(tok.encode(text)) < 512:
        text += corpus.story_doc(rng) + "\n"
    ids = tok.encode(text)[:512]
    ppl = {}
    for kv in ("f16", "q8"):
        lg = Model(st, n_ctx=512, kv_dtype=kv).forward(ids[:-1])[-256:].astype(np.float64)
        lp = lg - lg.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        ppl[kv] = float(np.exp(-lp[np.arange(256), ids[-256:]].mean()))
    assert abs(ppl["q8"] / ppl["f16"] - 1) < 0.01, ppl


def _readme_samples(text: str) -> tuple[str, list[tuple[str, str]]]:
    """models/README.md's samples: (the heading line, [(prompt, the text shown, whitespace folded)])."""
    head = next(line for line in text.splitlines() if line.startswith("Samples (greedy"))
    block = text.split(head, 1)[1].split("```", 2)[1]
    samples: list[list[str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if line.startswith("->"):
            samples[-1][1] += line[2:]
        elif line[0].isspace():
            samples[-1][1] += " " + line
        else:
            prompt, _, shown = line.partition(" -> ")
            samples.append([prompt.strip(), shown])
    return head, [(p, " ".join(s.split())) for p, s in samples]


def test_the_readme_samples_are_what_the_cli_prints():
    """models/README.md's greedy samples (models/evaluate.py's f32 reference) are what `bitnet run --temp 0 --kv f32`
    prints, and where the default f16 KV cache flips a near tie (the story after "Daisy."), the README shows what
    the default prints too: a user comparing `bitnet run` with the README thought something was wrong."""
    text = open(os.path.join(ROOT, "models", "README.md"), encoding="utf-8").read()
    head, samples = _readme_samples(text)
    assert "--kv f32" in head and len(samples) >= 9, (head, samples)
    folded = " ".join(text.split())
    for prompt, shown in samples:
        user = prompt.startswith("User: ")
        argv = ["--chat", "-p", prompt[len("User: "):]] if user else ["-p", prompt.replace("<|begin_of_text|>", "")]
        want = shown.removesuffix("...").strip()
        reference = " ".join(bitnet_run(*argv, "-n", "120", "--temp", "0", "--kv", "f32").split())
        assert reference.startswith(want), (prompt, reference, want)
        default = " ".join(bitnet_run(*argv, "-n", "120", "--temp", "0").split())
        if not default.startswith(want):   # the README must show the default's text up to a few words past the flip
            n = next(i for i, (a, b) in enumerate(zip(default, want)) if a != b)
            upto = " ".join(default[:n].split() + default[n:].split()[:6])
            assert upto in folded, (prompt, upto)
