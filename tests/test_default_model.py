"""Golden behaviour of the bundled default model (models/), through the real CLI: no training, no torch.

- `bitnet run -p "2+3=" --temp 0` answers 5 (bare form);
- addition in chat form (`bitnet run --chat`) on random pairs (fixed seed): 9 of 10 within 2 of the sum,
  at least 9 exact (the shipped model: 98.25% exact in chat form, 99.35% bare; see models/README.md);
- a story prompt continues with dictionary words (>= 90% of the words are in the corpus grammar's words);
- `bitchat` (piped) answers a greeting and "who are you" in a friendly, on-topic way;
- the shipped store is what converting the shipped HF directory gives, and it is <= 25 MB.
"""
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.models import DEFAULT_MODEL_DIR, DEFAULT_STORE
from bitnet_cpu.models.corpus import WORDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(name: str) -> list[str]:
    exe = shutil.which(name)
    if exe:
        return [exe]
    return [sys.executable, "-m", "bitnet_cpu"] if name == "bitnet" else [sys.executable, "-m", "bitnet_cpu.cli.chat"]


def bitnet_run(*args: str, stdin: str | None = None) -> str:
    r = subprocess.run(_cli("bitnet") + ["run", "-t", "2", *args], capture_output=True, text=True, input=stdin,
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
    r = subprocess.run(_cli("bitchat") + ["--temp", "0", "-n", "60", "-t", "2"], input="Hello!\nWho are you?\n",
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"\b(Hello|Hi)\b", out), out
    assert "BitNet" in out, out
