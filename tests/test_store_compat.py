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

from bitnet_cpu.engine.api import load_engine, load_model
from bitnet_cpu.engine.errors import BitNetError, FormatError
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


def test_an_untied_q4_store_without_rescoring_rows_says_so_at_load(untied_src, tmp_path):
    """A q4 store of an untied head from before output.rows ran with approximate logits, silently. Now one line
    at load names what is missing and the command that converts it again (run, serve's engine, the API)."""
    fresh = C.convert(untied_src, str(tmp_path / "new.bnstore"), lm_head="q4", progress=False)
    old = rewrite(fresh, str(tmp_path / "old.bnstore"), lambda ix: (ix["tensors"].pop("output.rows"),
                                                                  _as_converter("1", "add_bos")(ix)))
    assert load_model(fresh, ctx=64, progress=False).warnings == []
    llm = load_model(old, ctx=64, progress=False)
    said = [w for w in llm.warnings if "output.rows" in w]
    assert len(said) == 1 and "approximate" in said[0]
    assert f"bitnet convert llama_untied -o {old}" in said[0]
    eng = load_engine(old, ctx=64, parallel=1, progress=False)
    try:
        assert said[0] in eng.warnings
    finally:
        eng.close()
    r = _bitnet("run", "-m", old, "-p", TEXT, "-n", "2", "--temp", "0")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "output.rows" in x]
    assert len(lines) == 1 and lines[0].startswith("bitnet: warning:") and "Traceback" not in r.stderr


def test_a_converter_1_store_says_its_template_eos_token_may_differ(tmp_path):
    """Converter 1 did not record tokenizer_config's eos_token: a template writing {{ eos_token }} gets the
    config's first EOS (Llama 3: <|end_of_text|>, where transformers renders <|eot_id|>). Said once at load,
    with the command (a --chat-template-file may use it too, so it is said whatever the store's template)."""
    tmpl = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}assistant:"

    def v1(index):
        _as_converter("1", "bos_token", "eos_token", "add_bos")(index)
        index["chat_template"] = tmpl
    old = rewrite(DEFAULT_STORE, str(tmp_path / "v1.bnstore"), v1)
    llm = load_model(old, ctx=64, progress=False)
    said = [w for w in llm.warnings if "eos_token" in w]
    assert len(said) == 1, llm.warnings
    assert "<|end_of_text|>" in said[0] and f"bitnet convert bitnet-b1.58-tiny --lm-head f16 -o {old}" in said[0]
    assert llm.template_tokens()[1] == "<|end_of_text|>"   # what it says is what it renders
    assert load_model(DEFAULT_STORE, ctx=64, progress=False).warnings == []


def test_a_stale_cache_entry_says_so_when_loaded_as_a_file(untied_src, tmp_path):
    """`bitnet serve --models-cache` (and `-m` of a cached file) loads the cache's store itself: one whose source
    changed since, or one an older bitnet-cpu made, says so in one line with the command that converts it again
    (`bitnet run -m SRC` converts a stale source again itself: no line there)."""
    cache = str(tmp_path / "cache")
    entry = C.resolve_model(untied_src, cache_dir=cache, progress=False)
    assert load_model(entry, ctx=64, progress=False).warnings == []
    st = os.stat(os.path.join(untied_src, "config.json"))
    os.utime(os.path.join(untied_src, "config.json"), ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    said = [w for w in load_model(entry, ctx=64, progress=False).warnings if "stale" in w]
    assert len(said) == 1 and f"bitnet run -m {os.path.realpath(untied_src)}" in said[0]
    # an older bitnet's entry (no record of its source): `bitnet rm --stale`
    old = rewrite(entry, os.path.join(cache, "llama_untied-0123456789abcdef0123.bnstore"),
                  lambda ix: ix["meta"].pop("cache"))
    said = [w for w in load_model(old, ctx=64, progress=False).warnings if "stale" in w]
    assert len(said) == 1 and "bitnet rm --stale" in said[0]
    eng = load_engine(old, ctx=64, parallel=1, progress=False)   # a server's model (a router's model process)
    try:
        assert said[0] in eng.warnings
    finally:
        eng.close()


def test_a_config_key_a_former_bitnet_cpu_wrote_still_loads(tmp_path):
    """ModelConfig had a `family` field for a while: a store converted then holds that config key, and was refused
    as holding a key "a newer bitnet-cpu may have written". It is an older writer's, dropped as it always was."""
    old = rewrite(DEFAULT_STORE, str(tmp_path / "family.bnstore"),
                  lambda ix: ix["config"].__setitem__("family", "bitnet"))
    llm = load_model(old, ctx=64, progress=False)
    assert llm.warnings == [] and len(_greedy(llm, 2)) == 2


def test_a_cached_conversion_of_converter_3_is_converted_again(untied_src, tmp_path, monkeypatch):
    """Conversions changed after converter 3 (tokenizer rules for more GGUF pre-tokenizers, the tool-use chat
    template, the head of a tied model): a cache entry converter 3 made is stale and converted again."""
    cache = str(tmp_path / "cache")
    entry = C.resolve_model(untied_src, cache_dir=cache, progress=False)
    assert Store(entry).meta["converter_version"] == C.CONVERTER_VERSION != "3"
    with monkeypatch.context() as m:   # the stamp converter 3 recorded for the same source files
        m.setattr(C, "CONVERTER_VERSION", "3")
        stamp3 = C.source_stamp(untied_src)

    def as3(index):
        index["meta"]["converter_version"] = "3"
        index["meta"]["cache"]["stamp"] = stamp3
    rewrite(entry, entry + ".tmp", as3)
    os.replace(entry + ".tmp", entry)
    assert C.cache_status(Store(entry).meta, entry)[1] == "stale"
    again = C.resolve_model(untied_src, cache_dir=cache, progress=False)
    assert again == entry and Store(again).meta["converter_version"] == C.CONVERTER_VERSION


# ---- newer stores -------------------------------------------------------------------------------------------
def test_a_newer_converter_is_named_with_upgrade(tmp_path):
    newer = rewrite(DEFAULT_STORE, str(tmp_path / "c99.bnstore"), _as_converter("99"))
    said = [w for w in load_model(newer, ctx=64, progress=False).warnings if "newer" in w]
    assert len(said) == 1 and "converter 99" in said[0] and "upgrade" in said[0]
    assert "re-convert" not in said[0]


@pytest.mark.parametrize("version", ["\u00b2", "\u0663", "9" * 5000],
                         ids=["superscript", "arabic-indic", "5000-digits"])
def test_a_converter_version_that_is_no_ascii_number_is_not_one(tmp_path, version):
    """str.isdigit() holds for a superscript 2, other scripts' digits and digit strings past int()'s limit: a
    store (damaged, or crafted) recording one made every load, `bitnet inspect` and a refusal raise int()'s
    ValueError, a traceback where a bad store gets one line. Such a version is read as no version at all."""
    from bitnet_cpu.engine.formats.store import converter_of

    assert converter_of({"converter_version": version}) is None
    odd = rewrite(DEFAULT_STORE, str(tmp_path / "odd.bnstore"), _as_converter(version))
    llm = load_model(odd, ctx=64, progress=False)
    assert not any("newer" in w for w in llm.warnings) and len(_greedy(llm, 2)) == 2
    r = _bitnet("inspect", odd)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    bad = rewrite(odd, str(tmp_path / "bad.bnstore"), lambda ix: ix["config"].__setitem__("sliding_window", 64))
    r = _bitnet("run", "-m", bad, "-p", "hi", "-n", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "sliding_window" in r.stderr, r.stderr


def test_a_newer_store_format_says_upgrade_not_reconvert(tmp_path):
    v = rewrite(DEFAULT_STORE, str(tmp_path / "v2.bnstore"), _as_converter("7"), version=STORE_VERSION + 1)
    with pytest.raises(FormatError) as e:
        Store(v)
    text = f"{e.value} {e.value.hint}"
    assert "newer bitnet-cpu" in text and "converter 7" in text and "upgrade" in text and "re-convert" not in text
    r = _bitnet("run", "-m", v, "-p", "hi", "-n", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "upgrade" in r.stderr


@pytest.mark.parametrize("edit, words", [
    (lambda ix: ix["config"].__setitem__("sliding_window", 4096), ["sliding_window"]),
    ("output.bias", ["output.bias"]),
    (lambda ix: ix["tensors"]["output_norm"].__setitem__("dtype", "bfloat16"), ["output_norm", "bfloat16"]),
    (lambda ix: ix["tensors"]["output"].__setitem__("layout", "q5g_tile16"), ["q5g_tile16", "upgrade"]),
    (lambda ix: ix["tensors"]["blk.0.attn_qkv"].__setitem__("layout", "tile32"), ["tile32", "upgrade"]),
    (lambda ix: ix["tokenizer"].__setitem__("kind", "tiktoken"), ["tiktoken", "upgrade"]),
    (lambda ix: ix.__setitem__("requires", ["sliding_window"]), ["sliding_window", "upgrade"]),
], ids=["config-key", "tensor", "dtype", "head-layout", "linear-layout", "tokenizer-kind", "requires"])
def test_what_this_engine_does_not_know_is_refused_in_one_line(tmp_path, edit, words):
    """A config key or tensor it would ignore (a sliding window, a bias: other numbers, exit 0), a dtype, a
    layout or a tokenizer kind it cannot read: refused in one line that says what, and that a newer bitnet-cpu
    may read it; never "corrupt"."""
    if isinstance(edit, str):   # a tensor more, through the store writer (index entries must not overlap)
        base = with_tensor(DEFAULT_STORE, str(tmp_path / "base.bnstore"), edit, np.zeros(64, np.float32))
        edit = None
    else:
        base = DEFAULT_STORE
    bad = rewrite(base, str(tmp_path / "x.bnstore"), edit)
    with pytest.raises(FormatError) as e:
        load_model(bad, ctx=64, progress=False).close()
    text = f"{e.value} {e.value.hint or ''}"
    assert all(w in text for w in words) and "corrupt" not in text, text
    assert "newer bitnet-cpu" in text
    r = _bitnet("run", "-m", bad, "-p", "hi", "-n", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    out = rewrite(bad, str(tmp_path / "newer.bnstore"), _as_converter("99"))
    with pytest.raises(FormatError, match=r"made by a newer bitnet-cpu \(converter 99"):
        load_model(out, ctx=64, progress=False).close()


def _read_chars() -> int:
    """Bytes this process has read through read(2) and its kin so far (/proc/self/io's rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + path) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/self/io (Linux)")
def test_a_store_it_cannot_run_is_refused_before_its_weights_are_read(tmp_path):
    """The refusal of a newer store came after open_store had read the weights into memory (GBs for a large model),
    and load_model's refused store stayed mapped while the traceback lived; resolve_store (serve --ray-replicas
    checks -m with it before starting replicas) did not refuse it at all, so every replica refused it instead."""
    from bitnet_cpu.engine.api import resolve_store

    bad = rewrite(DEFAULT_STORE, str(tmp_path / "x.bnstore"),
                  lambda ix: ix["config"].__setitem__("sliding_window", 4096))
    weights = Store(bad, load="mmap").data_bytes
    assert weights > 1 << 20
    before = _read_chars()
    with pytest.raises(FormatError, match="sliding_window") as e:
        load_model(bad, ctx=64, progress=False, mmap=False)
    assert _read_chars() - before < weights // 4   # the index, not the weights
    assert not _mapped(os.path.realpath(bad)), "a refused store is still mapped"
    del e
    with pytest.raises(FormatError, match="sliding_window"):
        resolve_store(bad, progress=False)
    good = str(tmp_path / "good.bnstore")
    with open(DEFAULT_STORE, "rb") as f, open(good, "wb") as g:
        g.write(f.read())
    with pytest.raises(BitNetError):   # refused by LLM itself (a bad argument): the store is closed all the same
        load_model(good, ctx=-1, progress=False)
    assert not _mapped(os.path.realpath(good)), "a refused store is still mapped"


def test_extra_meta_and_per_tensor_keys_still_load(tmp_path):
    """Meta is informational (a newer converter's notes), per-tensor keys beside the ones read are too."""
    ok = rewrite(DEFAULT_STORE, str(tmp_path / "ok.bnstore"),
                 lambda ix: (ix["meta"].__setitem__("future_note", {"x": 1}),
                             ix["tensors"]["blk.0.attn_qkv"].__setitem__("future_key", 2)))
    llm = load_model(ok, ctx=64, progress=False)
    assert llm.warnings == [] and len(_greedy(llm, 2)) == 2
