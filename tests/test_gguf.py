"""engine.gguf: our GGUF reader against the `gguf` package (reference writer and dequantizer) on synthetic
files, bitnet.cpp's I2_S layout, and every kind of bad header (truncated, corrupt, lying sizes)."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.errors import FormatError, UnsupportedError
from bitnet_cpu.engine.formats.gguf import GGUFFile, decode_blocks
from bitnet_cpu.engine.synth import SynthModel, write_gguf_i2s, write_gguf_tq
from bitnet_cpu.engine.synth.writers import RawGGUFWriter
from helpers import gguf_fields

gguf = pytest.importorskip("gguf", reason="the gguf package is the reference writer (pip install '.[test]')")


@pytest.fixture(scope="module")
def model():
    return SynthModel(seed=21)


@pytest.mark.parametrize("qtype,embed", [("TQ2_0", "F16"), ("TQ1_0", "Q8_0"), ("TQ2_0", "F32"), ("TQ1_0", "BF16")])
def test_every_tensor_matches_gguf_dequantizer(tmp_path, model, qtype, embed):
    path = write_gguf_tq(model, str(tmp_path / "m.gguf"), qtype, embed_type=embed)
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.arch == "bitnet" and ours.version == 3
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        mine = ours.info(t.name)
        assert mine.type_id == int(t.tensor_type) and mine.nbytes == t.n_bytes
        assert mine.shape == tuple(int(x) for x in reversed(t.shape))
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        assert np.array_equal(ours.dequantize(t.name).reshape(-1), want), t.name
    # metadata round trip
    assert ours.kv["bitnet.embedding_length"] == model.D
    assert ours.kv["tokenizer.ggml.tokens"] == model.tokenizer_info()["tokens"]
    assert list(ours.kv["tokenizer.ggml.token_type"]) == model.tokenizer_info()["types"]
    assert ours.kv["bitnet.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)
    w, d = ours.ternary("blk.0.ffn_up.weight")
    assert np.array_equal(w, model.ternary("model.layers.0.mlp.up_proj"))
    assert np.all(d == np.float32(model.weight_scale("model.layers.0.mlp.up_proj")))
    # row slices of the embedding decode the same values as the whole
    assert np.array_equal(ours.dequantize("token_embd.weight", slice(37, 200)),
                          ours.dequantize("token_embd.weight")[37:200])


@pytest.mark.parametrize("qtype,bs,ts", [("Q4_K", 256, 144), ("Q6_K", 256, 210), ("Q8_0", 32, 34)])
def test_k_quants_match_gguf(tmp_path, qtype, bs, ts):
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (48, ts), dtype=np.uint8)
    # keep the f16 super-scales finite and small so every value is comparable
    if qtype == "Q4_K":
        raw[:, 0:4] = np.frombuffer(np.float16([0.01, 0.003]).tobytes(), np.uint8)
    elif qtype == "Q6_K":
        raw[:, 208:210] = np.frombuffer(np.float16([0.02]).tobytes(), np.uint8)
    else:
        raw[:, 0:2] = np.frombuffer(np.float16([0.05]).tobytes(), np.uint8)
    qt = gguf.GGMLQuantizationType[qtype]
    want = gguf.quants.dequantize(raw, qt).reshape(-1)
    assert np.array_equal(decode_blocks(raw.reshape(-1), qtype), want)
    # and through a file: a [12, 4*bs] tensor
    w = RawGGUFWriter(str(tmp_path / "k.gguf"))
    w.add("general.architecture", "str", "bitnet")
    w.add_tensor_info("x", [12, 48 * bs // 12], int(qt), raw.nbytes)
    w.write([lambda: raw.tobytes()])
    g = GGUFFile(str(tmp_path / "k.gguf"))
    assert np.array_equal(g.dequantize("x").reshape(-1), want)


def test_i2s_round_trip(tmp_path, model):
    path = write_gguf_i2s(model, str(tmp_path / "i.gguf"))
    g = GGUFFile(path)
    assert g.arch == "bitnet-b1.58" and "tokenizer.ggml.pre" not in g.kv
    for prefix, out, inp in model.linears():
        i, kind = prefix.split(".")[2], prefix.split(".")[-1]
        short = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                 "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[kind]
        t = g.info(f"blk.{i}.{short}.weight")
        assert t.type_name == "I2_S" and t.nbytes == out * inp // 4 + 32 and t.shape == (out, inp)
        w, s = g.ternary(t.name)
        assert np.array_equal(w, model.ternary(prefix))
        assert s[0] == np.float32(model.weight_scale(prefix))
        assert np.array_equal(g.dequantize(t.name), w * s[0])


def test_type36_outside_bitnet_is_unsupported(tmp_path):
    w = RawGGUFWriter(str(tmp_path / "x.gguf"))
    w.add("general.architecture", "str", "llama")
    w.add_tensor_info("blk.0.attn_q.weight", [128, 128], 36, 128 * 128 // 4 + 32)
    w.write([lambda: b"\0" * (128 * 128 // 4 + 32)])
    g = GGUFFile(str(tmp_path / "x.gguf"))
    with pytest.raises(UnsupportedError, match="blk.0.attn_q.weight"):
        g.dequantize("blk.0.attn_q.weight")


def test_unknown_and_undecodable_types_name_the_tensor(tmp_path):
    w = RawGGUFWriter(str(tmp_path / "x.gguf"))
    w.add("general.architecture", "str", "bitnet")
    w.add_tensor_info("weird", [4, 32], 26, 4 * 32 * 4)  # I32: known size, no dequantizer anywhere
    w.add_tensor_info("alien", [4, 32], 77, 16)        # a type nobody knows
    w.add_tensor_info("q40", [4, 32], 2, 4 * 18)       # Q4_0: decoded by the gguf package
    w.add_tensor_info("ik", [4, 32], 135, 16)          # ik_llama.cpp's IQ2_BN: named as such
    w.write([lambda: b"\0" * 512, lambda: b"\0" * 16, lambda: bytes(range(72)), lambda: b"\0" * 16])
    g = GGUFFile(str(tmp_path / "x.gguf"))
    with pytest.raises(UnsupportedError, match="'weird'.*I32"):
        g.dequantize("weird")
    with pytest.raises(UnsupportedError, match="'alien'.*type 77"):
        g.raw("alien")
    with pytest.raises(UnsupportedError, match="'ik'.*IQ2_BN .type 135, ik_llama.cpp's"):
        g.dequantize("ik")
    want = gguf.quants.dequantize(np.arange(72, dtype=np.uint8).reshape(4, 18), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(g.dequantize("q40"), want)


# ---- bad headers ------------------------------------------------------------------------------------------
def _header(n_tensors=0, n_kv=0, version=3, magic=b"GGUF"):
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv_str(key, val):
    k, v = key.encode(), val.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v


def _tinfo(name, dims, typ, off):
    n = name.encode()
    return struct.pack("<Q", len(n)) + n + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", typ, off)


def _write(tmp_path, data: bytes):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    return str(p)


def _pad(b: bytes, a=32):
    return b + b"\0" * (-len(b) % a)


@pytest.mark.parametrize("data,err,msg", [
    (b"GGU", FormatError, "only 3 bytes"),
    (b"GGML" + b"\0" * 40, FormatError, "bad magic"),
    (_header(version=1) + b"\0" * 8, UnsupportedError, "version 1"),
    (_header(version=99) + b"\0" * 8, UnsupportedError, "version 99"),
    (_header(version=3 << 24) + b"\0" * 8, UnsupportedError, "big-endian"),
    # sizes no file this long could hold are "corrupt", not "truncated"
    (_header(n_tensors=1 << 60), FormatError, "^(?!.*truncated).*corrupt GGUF"),
    (_header(n_kv=1 << 50) + b"\0" * 16, FormatError, "^(?!.*truncated).*corrupt GGUF"),
    (_header(n_kv=1) + struct.pack("<Q", 1 << 62) + b"abc" * 8, FormatError, "^(?!.*truncated).*corrupt GGUF"),
    (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 6, 1 << 61) + b"\0" * 16, FormatError,
     "^(?!.*truncated).*corrupt GGUF"),
    (_header(n_kv=1) + struct.pack("<Q", 40) + b"abc" * 8, FormatError, "truncated or corrupt"),
    # more than this file holds but what a whole download could (a vocabulary cut short): "truncated or corrupt"
    (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 300) + b"\0" * 16, FormatError,
     "truncated or corrupt GGUF file .* needs at least"),
    (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 42) + b"\0" * 16, FormatError,
     "unknown GGUF value type"),
    (_header(n_tensors=1) + _tinfo("t", [4, 4, 4, 4, 4], 0, 0) + b"\0" * 64, FormatError, "5 dimensions"),
    (_pad(_header(n_tensors=1) + _tinfo("t", [32, 0], 0, 0)) + b"\0" * 64, FormatError, "bad dimension"),
    (_pad(_header(n_tensors=1) + _tinfo("t", [1 << 30, 1 << 30], 0, 0)) + b"\0" * 64, FormatError, "absurdly large"),
    (_pad(_header(n_tensors=1) + _tinfo("t", [1000, 1000], 0, 0)) + b"\0" * 64, FormatError, "past the end"),
    (_pad(_header(n_tensors=1) + _tinfo("t", [8], 0, 1 << 62)) + b"\0" * 64, FormatError, "past the end"),
    (_pad(_header(n_tensors=1) + _tinfo("t", [8], 0, 4)) + b"\0" * 64, FormatError, "aligned"),
    (_pad(_header(n_tensors=1) + _tinfo("t", [100], 8, 0)) + b"\0" * 256, FormatError, "block size"),
    (_pad(_header(n_tensors=2) + _tinfo("t", [8], 0, 0) + _tinfo("t", [8], 0, 32)) + b"\0" * 64, FormatError,
     "duplicate"),
    (_header(n_kv=1) + _kv_str("general.architecture", "bitnet")[:-3], FormatError, "truncated"),
])
def test_bad_headers(tmp_path, data, err, msg):
    path = _write(tmp_path, data)
    with pytest.raises(err, match=msg) as e:
        GGUFFile(path)
    assert path in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("align,msg", [(24, "must be a power of two"), (0, "must be a power of two"),
                                       (1 << 31, "at most 1048576")])   # a power of two, over the limit: said so
def test_bad_alignment_key(tmp_path, align, msg):
    k = b"general.alignment"
    data = _header(n_kv=1) + struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, align) + b"\0" * 32
    with pytest.raises(FormatError, match=f"bad general.alignment {align} .*{msg}"):
        GGUFFile(_write(tmp_path, data))


def test_unreadable_path(tmp_path):
    with pytest.raises(FormatError, match="cannot open"):
        GGUFFile(str(tmp_path / "missing.gguf"))


def _with(src: str, dst: str, kv=(), tensor=None, shapes=None, change=None) -> str:
    """A copy of the GGUF file `src` with more metadata (key, type, value), optionally one more F32 tensor
    (name, values), tensors given other shapes of the same size ({name: dims}) and metadata values changed
    ({key: function of the old value})."""
    from test_fuzz import _ARR, _VT
    g = GGUFFile(src)
    w = RawGGUFWriter(dst, alignment=g.alignment)
    for k, v in g.kv.items():
        t = g.kv_types[k]
        v = (change or {}).get(k, lambda v: v)(v)
        w.add(k, ("arr_str" if isinstance(v, list) else _ARR[v.dtype.name]) if t == 9 else _VT[t], v)
    for k, typ, v in kv:
        w.add(k, typ, v)
    infos = list(g.tensors.values())
    for t in infos:
        w.add_tensor_info(t.name, list((shapes or {}).get(t.name, t.shape)), t.type_id, t.nbytes)
    producers = [lambda t=t: g.raw(t.name).tobytes() for t in infos]
    if tensor is not None:
        w.add_tensor_info(tensor[0], [len(tensor[1])], 0, 4 * len(tensor[1]))
        producers.append(lambda: np.asarray(tensor[1], np.float32).tobytes())
    w.write(producers)
    g.close()
    return dst


def test_rope_scaling_is_refused_as_the_hf_path_refuses_it(tmp_path, model):
    """llama.cpp's RoPE scaling keys (linear / yarn, Llama 3.1's rope_freqs tensor) are read and refused in one
    line; ignored, the model would run unscaled and answer silently worse. 'none' and a factor of 1 are no
    scaling and convert."""
    from bitnet_cpu.engine.formats.convert import convert

    src = write_gguf_tq(model, str(tmp_path / "plain.gguf"), "TQ2_0")
    arch = GGUFFile(src).arch
    bad = [("linear", [(f"{arch}.rope.scaling.type", "str", "linear"), (f"{arch}.rope.scaling.factor", "f32", 4.0)],
            None),
           ("yarn", [(f"{arch}.rope.scaling.type", "str", "yarn"), (f"{arch}.rope.scaling.factor", "f32", 8.0)],
            None),
           ("x2", [(f"{arch}.rope.scale_linear", "f32", 2.0)], None),
           ("llama3", [], ("rope_freqs.weight", [1.0] * (model.head_dim // 2)))]
    for name, kv, tensor in bad:
        with pytest.raises(UnsupportedError, match="RoPE scaling"):
            convert(_with(src, str(tmp_path / f"{name}.gguf"), kv, tensor), str(tmp_path / f"{name}.bnstore"),
                    progress=False)
    for kind in ("none", "linear"):   # factor 1: no scaling (bitnet.cpp's TL files say linear x1)
        fine = _with(src, str(tmp_path / f"{kind}1.gguf"), [(f"{arch}.rope.scaling.type", "str", kind),
                                                           (f"{arch}.rope.scaling.factor", "f32", 1.0)])
        convert(fine, str(tmp_path / f"{kind}1.bnstore"), progress=False)


def test_layers_past_block_count_and_matrix_norms_are_refused(tmp_path, model):
    """A GGUF whose tensors disagree with its own header is refused in one line naming what disagrees, as llama.cpp
    refuses it ("wrong number of tensors" / a norm that is not a vector), instead of converting what the count
    says and dropping the rest."""
    from bitnet_cpu.engine.formats.convert import convert

    src = write_gguf_tq(model, str(tmp_path / "plain.gguf"), "TQ2_0")
    g = GGUFFile(src)
    arch, n_layers = g.arch, g.get(f"{g.arch}.block_count", int)
    d = g.get(f"{arch}.embedding_length", int)
    g.close()
    extra = _with(src, str(tmp_path / "extra.gguf"), tensor=(f"blk.{n_layers}.attn_norm.weight", [1.0] * d))
    with pytest.raises(FormatError, match=rf"blk\.{n_layers} but block_count is {n_layers}$"):
        convert(extra, str(tmp_path / "extra.bnstore"), progress=False)
    flat = _with(src, str(tmp_path / "flat.gguf"), shapes={"blk.0.ffn_norm.weight": [d, 1]})
    with pytest.raises(FormatError, match=rf"'blk\.0\.ffn_norm\.weight' has shape .*expected \({d},\)"):
        convert(flat, str(tmp_path / "flat.bnstore"), progress=False)
    assert not (tmp_path / "extra.bnstore").exists() and not (tmp_path / "flat.bnstore").exists()
    convert(src, str(tmp_path / "plain.bnstore"), progress=False)   # the file itself converts


def test_a_tensor_the_model_does_not_use_is_refused_and_inspect_flags_it(tmp_path, model):
    """A bias of a linear or a tensor of no architecture's was left out in silence (a q bias of 0.5 gave the same
    output as none): refused in one line naming it, a bias in the HF path's words, as llama.cpp refuses the file
    ("wrong number of tensors"); `bitnet inspect` still shows the file and flags the tensor."""
    import subprocess
    import sys

    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.formats.describe import describe

    src = write_gguf_tq(model, str(tmp_path / "plain.gguf"), "TQ2_0")
    qdim = GGUFFile(src).info("blk.0.attn_q.weight").shape[0]
    bias = _with(src, str(tmp_path / "bias.gguf"), tensor=("blk.0.attn_q.bias", [0.5] * qdim))
    junk = _with(src, str(tmp_path / "junk.gguf"), tensor=("foo.weight", [1.0] * 4))
    for path, err, msg in ((bias, UnsupportedError, r"linear biases \(blk\.0\.attn_q\.bias \.\.\.\) are not supported"),
                           (junk, FormatError, r"tensor 'foo\.weight' is not one a bitnet model has")):
        with pytest.raises(err, match=msg):
            convert(path, str(tmp_path / "x.bnstore"), progress=False)
        assert not (tmp_path / "x.bnstore").exists()
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", path, "-o", str(tmp_path / "y.bnstore")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        lines = list(describe(path))
        name = "blk.0.attn_q.bias" if path == bias else "foo.weight"
        assert any(line.startswith("UNUSED TENSORS: 1 tensors (first " + name) for line in lines), lines
    convert(src, str(tmp_path / "plain.bnstore"), progress=False)   # the file itself converts
    assert not any(line.startswith("UNUSED") for line in describe(src))


def test_pre_tokenizer_names_as_llama_cpp_takes_them(tmp_path, model):
    """tokenizer.ggml.pre: a name llama.cpp does not know was split with GPT-2's regex in silence (llama.cpp refuses
    it): refused in one line naming it; a name llama.cpp splits its own way gets our closest regex and one warning
    line (convert, inspect, every load); a name llama.cpp gives exactly our LLaMA-3 regex gets it, without one."""
    import subprocess
    import sys

    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.formats.describe import describe
    from bitnet_cpu.engine.formats.sources import GGUFSource
    from bitnet_cpu.engine.formats.store import Store

    unknown = write_gguf_tq(model, str(tmp_path / "unknown.gguf"), "TQ2_0", pre="frobnicate")
    with pytest.raises(FormatError, match=r"unknown tokenizer\.ggml\.pre 'frobnicate' .*llama-bpe"):
        convert(unknown, str(tmp_path / "x.bnstore"), progress=False)
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", unknown, "-o", str(tmp_path / "y.bnstore")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'frobnicate'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

    exact = GGUFSource(write_gguf_tq(model, str(tmp_path / "h1.gguf"), "TQ2_0", pre="falcon-h1"))
    assert exact.meta["tokenizer_pre"] == "falcon-h1 -> llama3 regex" and "warnings" not in exact.meta
    exact.close()

    close = write_gguf_tq(model, str(tmp_path / "tekken.gguf"), "TQ2_0", pre="tekken")
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", close, "-o", str(tmp_path / "t.bnstore")],
                       capture_output=True, text=True, timeout=120)
    warn = [line for line in r.stderr.splitlines() if line.startswith("bitnet: warning: ")]
    assert r.returncode == 0 and len(warn) == 1 and "'tekken'" in warn[0] and "llama.cpp" in warn[0], r.stderr
    with Store(str(tmp_path / "t.bnstore")) as st:
        assert st.meta["tokenizer_pre"].startswith("tekken -> qwen2 regex")
    assert [line for line in describe(str(tmp_path / "t.bnstore")) if line.startswith("warning:")] == \
        ["warning: " + warn[0].removeprefix("bitnet: warning: ")]
    assert any("'tekken'" in line for line in describe(close) if line.startswith("warning:"))
    with load_model(str(tmp_path / "t.bnstore"), progress=False) as llm:
        assert [w for w in llm.warnings if "'tekken'" in w] == [warn[0].removeprefix("bitnet: warning: ")]


@pytest.mark.parametrize("style,name", [("bitnet", "<|begin_of_text|>"), ("1bitllm", "<s>")])
def test_a_bos_asked_for_but_not_named(tmp_path, style, name):
    """add_bos_token true without tokenizer.ggml.bos_token_id dropped the BOS in silence: the vocabulary family's
    BOS token (LLaMA-3's <|begin_of_text|>, SentencePiece's <s>) is used; a vocabulary without it: one warning."""
    from test_fuzz import _rewrite_gguf

    from bitnet_cpu.engine.formats.sources import GGUFSource
    from bitnet_cpu.engine.formats.tokenizer import Tokenizer

    m = SynthModel(seed=21, style=style)
    src = write_gguf_tq(m, str(tmp_path / "plain.gguf"), "TQ2_0")
    want = GGUFFile(src).kv["tokenizer.ggml.tokens"].index(name)
    nobos = str(tmp_path / "nobos.gguf")
    _rewrite_gguf(src, nobos, "tokenizer.ggml.bos_token_id", None)
    s = GGUFSource(nobos)
    assert s.config.bos_token_id == want and "warnings" not in s.meta, s.meta
    kind, blob = s.tokenizer
    tok = Tokenizer(kind, blob, bos_id=s.config.bos_token_id, eos_ids=s.config.eos_token_ids)
    assert tok.encode("hello", add_bos=True)[0] == want
    s.close()
    renamed = _with(nobos, str(tmp_path / "renamed.gguf"),
                    change={"tokenizer.ggml.tokens": lambda v: [t if t != name else "<bos-renamed>" for t in v]})
    s = GGUFSource(renamed)
    assert s.config.bos_token_id is None
    assert len(s.meta["warnings"]) == 1 and "tokenizer.ggml.bos_token_id" in s.meta["warnings"][0], s.meta
    s.close()


@pytest.mark.parametrize("style", ["bitnet", "1bitllm"])
@pytest.mark.parametrize("how", ["typed normal", "no token_type"])
def test_named_specials_typed_normal_are_control(tmp_path, style, how):
    """A GGUF whose BOS / EOS / EOT tokens are typed NORMAL (or that has no tokenizer.ggml.token_type): a chat
    template's bos_token and end-of-turn texts were cut into literal pieces, so prompts had no BOS id and no
    end-of-turn id, in silence. They are control tokens now, with one warning, as llama.cpp overrides them."""
    from test_fuzz import _rewrite_gguf

    from bitnet_cpu.engine.formats.sources import GGUFSource
    from bitnet_cpu.engine.formats.tokenizer import Tokenizer

    m = SynthModel(seed=21, style=style)
    src = write_gguf_tq(m, str(tmp_path / "plain.gguf"), "TQ2_0")
    g = GGUFFile(src)
    tokens = list(g.kv["tokenizer.ggml.tokens"])
    named = [int(g.kv[k]) for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id") if k in g.kv]
    bad = str(tmp_path / "bad.gguf")
    if how == "typed normal":
        _with(src, bad, change={"tokenizer.ggml.token_type": lambda v: np.ones_like(v)})
    else:
        _rewrite_gguf(src, bad, "tokenizer.ggml.token_type", None)
    for path, warned in ((src, False), (bad, True)):
        s = GGUFSource(path)
        kind, blob = s.tokenizer
        tok = Tokenizer(kind, blob, bos_id=s.config.bos_token_id, eos_ids=s.config.eos_token_ids)
        text = "".join(f"x{tokens[i]}" for i in named) + "x"
        ids = tok.encode(text, special=True)
        assert all(ids.count(i) == 1 for i in named), (path, ids, named)
        assert any("not typed control" in w for w in s.meta.get("warnings", [])) == warned, s.meta
        s.close()


@pytest.mark.parametrize("style,act,family", [("bitnet", "relu2", "bitnet-b1.58"), ("bitnet", None, "bitnet-b1.58"),
                                              ("1bitllm", "silu", "1bitllm"), ("1bitllm", None, "1bitllm")])
def test_bitnet_arch_family_by_activation_and_vocabulary(tmp_path, style, act, family):
    """llama.cpp's `bitnet` architecture holds 2B-4T (relu^2, LLaMA-3 BPE vocab) and 1bitLLM (SiLU, SentencePiece):
    a small 2B-4T-style file was named 1bitLLM by its vocabulary's size alone; activation and tokenizer decide."""
    from bitnet_cpu.engine.formats.families import family_label
    from bitnet_cpu.engine.formats.sources import GGUFSource

    m = SynthModel(seed=21, style=style)
    assert m.V < 100000
    s = GGUFSource(write_gguf_tq(m, str(tmp_path / "m.gguf"), "TQ2_0", hidden_activation=act))
    assert s.g.arch == "bitnet" and s.config.hidden_act == ("relu2" if style == "bitnet" else "silu")
    assert s.meta["family"] == family, family_label(s.meta["family"])
    s.close()


def test_a_merge_of_tokens_not_in_the_vocabulary_is_named_in_the_files_terms(tmp_path, model):
    """A gpt2 vocabulary whose merges name a token the file lacks: one line naming the merge and the key, not the
    tokenizers library's complaint about a tokenizer.json (and a line and column) the user never had."""
    from bitnet_cpu.engine.formats.convert import convert

    src = write_gguf_tq(model, str(tmp_path / "plain.gguf"), "TQ2_0")
    for name, fix, part in (("unknown", lambda v: ["zzzq qqqz"] + list(v[1:]), "zzzq"),
                            ("no-token-0", None, None)):
        if fix is None:   # token 0 renamed: the merges that use it now name a token the vocabulary lacks
            toks = list(GGUFFile(src).kv["tokenizer.ggml.tokens"])
            part = toks[0]
            fix = {"tokenizer.ggml.tokens": lambda v: ["\u2603\u2603"] + list(v[1:])}
            bad = _with(src, str(tmp_path / f"{name}.gguf"), change=fix)
        else:
            bad = _with(src, str(tmp_path / f"{name}.gguf"), change={"tokenizer.ggml.merges": fix})
        with pytest.raises(FormatError) as e:
            convert(bad, str(tmp_path / f"{name}.bnstore"), progress=False)
        msg = str(e.value)
        assert f"but {part!r} is not in tokenizer.ggml.tokens" in msg and "tokenizer.json" not in msg, msg


def _retype(src: str, dst: str, name: str, tid: int) -> str:
    """A copy of `src` with tensor `name`'s type field set to `tid` (one header word: its data is unchanged)."""
    b = bytearray(open(src, "rb").read())
    at = b.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (nd,) = struct.unpack_from("<I", b, at)
    struct.pack_into("<I", b, at + 4 + 8 * nd, tid)
    with open(dst, "wb") as f:
        f.write(b)
    return dst


@pytest.mark.parametrize("name,tid", [("blk.0.attn_norm.weight", 1), ("output_norm.weight", 8),
                                      ("token_embd.weight", 2), ("token_embd.weight", 34),
                                      ("blk.1.ffn_norm.weight", 2)])
def test_a_tensor_whose_type_does_not_fill_its_space_is_refused(model, tmp_path, name, tid):
    """A type changed in the header (F32 -> F16 is one bit) read part of the tensor's bytes and ran with exit 0;
    ggml's reader refuses it (each tensor must end where the next begins, padding aside): so do we."""
    src = write_gguf_tq(model, str(tmp_path / "m.gguf"), "TQ2_0")
    GGUFFile(src).close()
    bad = _retype(src, str(tmp_path / "bad.gguf"), name, tid)
    with pytest.raises(FormatError, match=f"tensor '{name}' .* does not match its data") as e:
        GGUFFile(bad)
    assert bad in str(e.value) and "\n" not in str(e.value)


def _assert_short_one_line(bad: str, tmp_path, *words):
    """GGUFFile and `bitnet convert` refuse `bad` with one short line (no file bytes quoted at length), exit 2."""
    with pytest.raises(FormatError) as e:
        GGUFFile(bad)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300 + len(bad) and all(w in msg for w in words), msg[:1000]
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", bad, "-o", str(tmp_path / "x.bnstore")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[:1000]
    assert len(r.stderr.strip().splitlines()) <= 2 and len(r.stderr) < 600 + 2 * len(bad), r.stderr[:1000]
    return msg


def test_a_shifted_tensor_info_block_quotes_no_file_bytes(model, tmp_path):
    """One tensor's n_dims 2 -> 1 shifts the parse: the next "name length" is read from that tensor's offset
    field. The name was read whole (up to the file's size: GBs on a real model) and quoted in full in the
    "one-line" error; a name longer than any GGUF writer can give is now said to be a corrupt header."""
    src = write_gguf_tq(model, str(tmp_path / "m.gguf"), "TQ2_0")
    _, ndims, end = gguf_fields(src)
    size = os.path.getsize(src)
    with GGUFFile(src) as g:   # a tensor whose offset, read as the next name's length, fits in the file (as a
        # long garbage name) but is over any real name's length
        names = [t.name for t in g.tensors.values() if len(t.shape) == 2 and 4096 < t.offset - g.data_offset
                 < size - end - 4096]
        order = list(g.tensors)
    assert names
    name = names[0]
    b = bytearray(open(src, "rb").read())
    struct.pack_into("<I", b, ndims[name], 1)
    bad = str(tmp_path / "bad.gguf")
    open(bad, "wb").write(bytes(b))
    msg = _assert_short_one_line(bad, tmp_path, "corrupt")
    assert f"tensor #{order.index(name) + 1}'s name is " in msg and "bytes long" in msg, msg


def test_a_long_metadata_key_is_quoted_short(model, tmp_path):
    """A key length field grown to 3,000 bytes (the key then runs over the following values): the errors
    that quote the key quote its start only."""
    src = write_gguf_tq(model, str(tmp_path / "m.gguf"), "TQ2_0")
    keys, _, _ = gguf_fields(src)
    for i, (at, _) in enumerate(list(keys.values())[1:6]):
        b = bytearray(open(src, "rb").read())
        struct.pack_into("<Q", b, at, 3000)
        bad = str(tmp_path / f"bad{i}.gguf")
        open(bad, "wb").write(bytes(b))
        _assert_short_one_line(bad, tmp_path)


@pytest.mark.parametrize("n", [300, 100_000])
def test_a_tensor_name_over_the_bound_is_a_corrupt_header(tmp_path, n):
    data = _pad(_header(n_tensors=1) + _tinfo("t" * n, [8], 0, 0)) + b"\0" * 64
    path = _write(tmp_path, data)
    with pytest.raises(FormatError, match=f"corrupt GGUF header: tensor #0's name is {n} bytes long") as e:
        GGUFFile(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300 + len(path)
    data = _pad(_header(n_tensors=1) + _tinfo("t" * 200, [8], 0, 0)) + b"\0" * 32   # long, but under the bound:
    with GGUFFile(_write(tmp_path, data)) as g:                                     # read (and quoted short)
        assert list(g.tensors) == ["t" * 200]
