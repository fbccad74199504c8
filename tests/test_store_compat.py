"""Stores written by another bitnet-cpu than this one.

Older: a store converted before a change of the converter runs as a conversion today would where the store holds
what that takes (a missing add_bos is read from its own tokenizer.json), and says in one line at load what still
differs and the command that converts it again (an untied q4 head without its f16 rows, a chat template's
eos_token of a converter-1 store, a stale entry of the conversion cache). Newer: a store of a later format, a
converter above this one's, tensors, config keys or dtypes this engine does not know are said as that, with
"upgrade", never read silently nor called corrupt.

The old stores are made here from stores converted today, by rewriting their index (with a fresh checksum) the
way an older converter wrote it: no old build is needed."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.api import load_model
from bitnet_cpu.engine.errors import FormatError
from bitnet_cpu.engine.formats import convert as C
from bitnet_cpu.engine.formats.store import _HEADER, STORE_VERSION, Store
from bitnet_cpu.engine.synth import SynthModel, write_bonsai_dir, write_hf_dir
from bitnet_cpu.models import DEFAULT_STORE
from helpers import ROOT

TEXT = "Once upon a time"


def rewrite(src: str, out: str, edit=None, version: int | None = None) -> str:
    """A copy of store `src` at `out` with its index JSON changed by edit(index) (and its header's format
    version), the checksum recomputed: a store as another writer left it."""
    b = bytearray(open(src, "rb").read())
    magic, ver, res, ioff, isize, doff, _ = _HEADER.unpack_from(b, 0)
    index = json.loads(b[ioff:ioff + isize])
    if edit is not None:
        edit(index)
    raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    nb = b[:ioff] + raw
    _HEADER.pack_into(nb, 0, magic, ver if version is None else version, res, ioff, len(raw), doff,
                      hashlib.sha256(raw).digest())
    with open(out, "wb") as f:
        f.write(nb)
    return out


def with_tensor(src: str, out: str, name: str, array) -> str:
    """A copy of store `src` through the store writer, with one more tensor."""
    from bitnet_cpu.engine.formats.store import TensorSpec, write_store
    with Store(src) as s:
        specs = [TensorSpec(n, np.array(s.tensor(n)), {k: v for k, v in s.info(n).items()
                                                       if k not in ("dtype", "shape", "offset", "nbytes")})
                 for n in s.tensor_names if n != s.tokenizer_tensor] + [TensorSpec(name, array)]
        kind, blob = s.tokenizer_spec
        return write_store(out, s.config, specs, meta=dict(s.meta), chat_template=s.chat_template,
                           tokenizer_kind=kind, tokenizer_blob=blob)


def _as_converter(n: str, *drop: str):
    def edit(index):
        index["meta"]["converter_version"] = n
        for k in drop:
            index["meta"].pop(k, None)
    return edit


def _bitnet(*args, env=None):
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})})


def _greedy(llm, n=6):
    from bitnet_cpu.engine.api import SamplingParams
    return [c.token for c in llm.generate(TEXT, SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
            if c.token is not None]


@pytest.fixture(scope="module")
def qwen_store(tmp_path_factory):
    """A Qwen3-style model (its tokenizer.json's post-processor adds no BOS, though config.json names one),
    converted today."""
    d = tmp_path_factory.mktemp("qwen")
    m = SynthModel({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64,
                    "hidden_act": "silu"}, seed=1, style="llama")
    src = write_bonsai_dir(m, str(d / "qwen"))
    tj = json.load(open(f"{src}/tokenizer.json"))
    tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                            "use_regex": False}
    json.dump(tj, open(f"{src}/tokenizer.json", "w"))
    return C.convert(src, str(d / "qwen.bnstore"), progress=False)


@pytest.fixture(scope="module")
def untied_src(tmp_path_factory):
    m = SynthModel({"vocab_size": 1024}, seed=5, style="llama")
    return write_hf_dir(m, str(tmp_path_factory.mktemp("untied") / "llama_untied"), form="online")


# ---- older stores -------------------------------------------------------------------------------------------
def test_a_store_without_add_bos_tokenizes_as_a_conversion_today(qwen_store, tmp_path):
    """Converter 2 recorded no add_bos: a Qwen3 / Ternary Bonsai store of it got a BOS its tokenizer does not add,
    for ever. Its tokenizer.json (in the store) says what today's converter would record: the same tokens, the
    same greedy text, and a BOS still where the tokenizer adds one (the bundled Llama-3 tokenizer)."""
    old = rewrite(qwen_store, str(tmp_path / "old.bnstore"), _as_converter("2", "add_bos"))
    assert "add_bos" not in Store(old).meta
    new_llm, old_llm = load_model(qwen_store, ctx=64, progress=False), load_model(old, ctx=64, progress=False)
    assert old_llm.tokenize(TEXT, add_bos=True) == new_llm.tokenize(TEXT, add_bos=True)
    assert old_llm.tokenizer.text_bos is None and old_llm.tokenizer.add_bos is False
    assert _greedy(old_llm) == _greedy(new_llm)
    assert old_llm.warnings == new_llm.warnings == []

    llama = rewrite(DEFAULT_STORE, str(tmp_path / "llama3.bnstore"), _as_converter("2", "add_bos"))
    shipped, llm = load_model(DEFAULT_STORE, ctx=64, progress=False), load_model(llama, ctx=64, progress=False)
    ids = llm.tokenize(TEXT, add_bos=True)
    assert ids == shipped.tokenize(TEXT, add_bos=True) and ids[0] == llm.tokenizer.bos_id
