"""Fuzz the GGUF and safetensors readers and the converter with mutated fixture files (hypothesis): whatever
the bytes, the only failure allowed is a BitNetError (FormatError / UnsupportedError) whose one-line message
names the file; never a crash, a numpy traceback or a huge allocation (the test process has an address-space
limit while it runs)."""
import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.formats.gguf import GGUFFile
from bitnet_cpu.engine.formats.safetensors_io import SafetensorsDir
from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_i2s, write_gguf_tq, write_hf_dir
from helpers import address_space_cap

FUZZ = settings(max_examples=int(os.environ.get("BITNET_FUZZ_EXAMPLES", "800")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    m = SynthModel(small_config(num_hidden_layers=1, vocab_size=300), seed=9)
    gg = {"i2s": open(write_gguf_i2s(m, str(d / "i2s.gguf")), "rb").read(),
          "tq2": open(write_gguf_tq(m, str(d / "tq2.gguf"), "TQ2_0"), "rb").read(),
          "tq1": open(write_gguf_tq(m, str(d / "tq1.gguf"), "TQ1_0", embed_type="Q8_0"), "rb").read()}
    hf = write_hf_dir(m, str(d / "hf"))
    st_bytes = open(os.path.join(hf, "model.safetensors"), "rb").read()
    hdr = {}
    for k in gg:
        with GGUFFile(str(d / f"{k}.gguf")) as g:
            hdr[k] = g.data_offset
    return _Fixtures(dir=d, gguf=gg, hf=hf, st=st_bytes, hdr=hdr)


class _Fixtures(dict):
    def __repr__(self):  # keep hypothesis' failure reports short
        return "<fuzz fixtures>"


@pytest.fixture(autouse=True)
def _memory_cap():
    """A lying header must never make us allocate gigabytes: cap the address space while fuzzing."""
    with address_space_cap(3 << 30):
        yield


def _mutate(data: bytes, draw_ops, header_end: int = 0) -> bytes:
    """Apply (kind, pos, value) edits; a negative pos counts back from header_end (the tensor infos)."""
    b = bytearray(data)
    for kind, pos, val in draw_ops:
        if not b:
            break
        if pos < 0:
            pos = max(0, header_end + pos)
        pos %= len(b)
        if kind == "byte":
            b[pos] = val & 0xFF
        elif kind == "u64":
            b[pos: pos + 8] = struct.pack("<Q", val)[: len(b) - pos]
        elif kind == "u32":
            b[pos: pos + 4] = struct.pack("<I", val & 0xFFFFFFFF)[: len(b) - pos]
        elif kind == "truncate":
            del b[pos:]
    return bytes(b)


def _header_biased_pos(size_hint=4096):
    # most interesting bytes (counts, lengths, types, dims, offsets) are in the first few KB
    return st.one_of(st.integers(0, 64), st.integers(0, size_hint), st.integers(0, 1 << 22), st.integers(-1500, -1))


OPS = st.lists(st.tuples(st.sampled_from(["byte", "byte", "u64", "u32", "truncate"]), _header_biased_pos(),
                         st.one_of(st.integers(0, 255), st.integers(0, 1 << 64 - 1),
                                   st.sampled_from([0, 1, 2, 8, 9, 35, 36, 99, 1 << 31, 1 << 40, (1 << 64) - 1]))),
               min_size=1, max_size=4)


def _exercise_gguf(path):
    g = GGUFFile(path)
    try:
        for name, t in list(g.tensors.items()):
            try:
                if t.type_name in ("I2_S", "TQ1_0", "TQ2_0") and len(t.shape) == 2:
                    g.ternary(name)
                else:
                    g.dequantize(name, slice(0, 4))
            except BitNetError:
                pass
    finally:
        g.close()


def _check_error(e: BitNetError, path: str):
    msg = str(e)
    assert "\n" not in msg and path in msg, msg


@FUZZ
@given(which=st.sampled_from(["i2s", "tq2", "tq1"]), ops=OPS)
def test_fuzz_gguf(fixtures, which, ops):
    path = str(fixtures["dir"] / f"mut_{which}.gguf")
    with open(path, "wb") as f:
        f.write(_mutate(fixtures["gguf"][which], ops, fixtures["hdr"][which]))
    try:
        _exercise_gguf(path)
    except BitNetError as e:
        _check_error(e, path)
    out = str(fixtures["dir"] / "mut.bnstore")
    try:
        convert(path, out, progress=False)
    except BitNetError as e:
        _check_error(e, path)


@FUZZ
@given(ops=st.lists(st.tuples(st.sampled_from(["byte", "byte", "u64", "truncate"]),
                              st.one_of(st.integers(0, 16), st.integers(0, 6000), st.integers(0, 1 << 20)),
                              st.one_of(st.integers(0, 255), st.integers(0, (1 << 64) - 1),
                                        st.sampled_from([ord('"'), ord(","), ord("]"), ord("9"), ord("-")]))),
                    min_size=1, max_size=4))
def test_fuzz_safetensors(fixtures, ops):
    d = str(fixtures["dir"] / "mut_hf")
    if not os.path.isdir(d):
        shutil.copytree(fixtures["hf"], d)
    path = os.path.join(d, "model.safetensors")
    with open(path, "wb") as f:
        f.write(_mutate(fixtures["st"], ops))
    try:
        s = SafetensorsDir(d)
        for n in s.names():
            try:
                np.asarray(s.get(n)).sum()
            except BitNetError:
                pass
        s.close()
    except BitNetError as e:
        _check_error(e, d)
    try:
        convert(d, str(fixtures["dir"] / "mut_hf.bnstore"), progress=False)
    except BitNetError as e:
        _check_error(e, d)


@FUZZ
@given(field=st.sampled_from(["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim",
                              "rope_theta", "rms_norm_eps", "hidden_act", "quantization_config", "bos_token_id"]),
       value=st.one_of(st.integers(-2, 1 << 62), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
                       st.lists(st.integers(0, 10), max_size=2), st.sampled_from([{}, {"linear_class": "x"}])))
def test_fuzz_hf_config(fixtures, field, value):
    """A lying config.json (sizes that do not match the tensors, wrong types) is a one-line error, and never
    an allocation sized from the config."""
    import json

    d = str(fixtures["dir"] / "cfg_hf")
    if not os.path.isdir(d):
        shutil.copytree(fixtures["hf"], d)
    cfg = json.load(open(os.path.join(fixtures["hf"], "config.json")))
    cfg[field] = value
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    try:
        convert(d, str(fixtures["dir"] / "cfg.bnstore"), progress=False)
    except BitNetError as e:
        _check_error(e, d)


_VT = {8: "str", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 10: "u64", 11: "i64", 12: "f64", 0: "u8", 1: "i8"}
_ARR = {"int32": "arr_i32", "uint32": "arr_u32", "float32": "arr_f32", "uint8": "arr_u8", "int64": "arr_i64"}


def _rewrite_gguf(src: str, dst: str, key: str, new):
    """Copy a GGUF file with metadata `key` replaced by new = (type, value), or removed when new is None."""
    from bitnet_cpu.engine.synth.writers import RawGGUFWriter

    g = GGUFFile(src)
    w = RawGGUFWriter(dst, alignment=g.alignment)
    for k, v in g.kv.items():
        if k == key:
            if new is not None:
                w.add(k, *new)
            continue
        t = g.kv_types[k]
        w.add(k, ("arr_str" if isinstance(v, list) else _ARR[v.dtype.name]) if t == 9 else _VT[t], v)
    if key not in g.kv and new is not None:
        w.add(key, *new)
    infos = list(g.tensors.values())
    for t in infos:
        w.add_tensor_info(t.name, list(t.shape), t.type_id, t.nbytes)
    w.write([lambda t=t: g.raw(t.name).tobytes() for t in infos])
    g.close()


@FUZZ
@given(which=st.sampled_from(["i2s", "tq2"]),
       key=st.sampled_from(["embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                            "attention.head_count_kv", "vocab_size", "context_length", "rope.freq_base",
                            "attention.layer_norm_rms_epsilon", "rope.dimension_count", "hidden_activation",
                            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model",
                            "tokenizer.ggml.pre", "tokenizer.chat_template", "general.architecture",
                            "general.alignment"]),
       new=st.one_of(st.none(), st.tuples(st.just("u32"), st.integers(0, (1 << 32) - 1)),
                     st.tuples(st.just("i32"), st.integers(-(1 << 31), (1 << 31) - 1)),
                     st.tuples(st.just("u64"), st.integers(0, (1 << 64) - 1)),
                     st.tuples(st.just("f32"), st.floats(width=32)), st.tuples(st.just("str"), st.text(max_size=8)),
                     st.tuples(st.just("bool"), st.booleans())))
def test_fuzz_gguf_metadata(fixtures, which, key, new):
    """Lying or missing hyperparameters / tokenizer keys in a well-formed GGUF: a one-line error or a store."""
    src = str(fixtures["dir"] / f"{which}.gguf")
    if not key.startswith(("tokenizer.", "general.")):
        key = ("bitnet-b1.58." if which == "i2s" else "bitnet.") + key
    dst = str(fixtures["dir"] / f"meta_{which}.gguf")
    _rewrite_gguf(src, dst, key, new)
    try:
        convert(dst, str(fixtures["dir"] / "meta.bnstore"), progress=False)
    except BitNetError as e:
        _check_error(e, dst)


def test_a_head_count_of_zero_says_so(fixtures):
    """attention.head_count 0 said "embedding_length 256 is not a multiple of head_count 0"; the HF path says the
    count must be positive: the GGUF path now says it too."""
    src, dst = str(fixtures["dir"] / "tq2.gguf"), str(fixtures["dir"] / "heads0.gguf")
    _rewrite_gguf(src, dst, "bitnet.attention.head_count", ("u32", 0))
    with pytest.raises(BitNetError, match="attention.head_count 0: must be a positive integer"):
        convert(dst, str(fixtures["dir"] / "heads0.bnstore"), progress=False)
