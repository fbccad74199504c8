"""Fuzz the GGUF and safetensors readers and the converter with mutated fixture files (hypothesis): whatever
the bytes, the only failure allowed is a BitNetError (FormatError / UnsupportedError) whose one-line message
names the file; never a crash, a numpy traceback or a huge allocation (the test process has an address-space
limit while it runs)."""
import os
import resource
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.convert import convert
from engine.errors import BitNetError
from engine.gguf import GGUFFile
from engine.safetensors_io import SafetensorsDir
from engine.synth import SynthModel, small_config, write_gguf_i2s, write_gguf_tq, write_hf_dir

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
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm = 0
    try:  # whatever this process already maps (torch from other tests, thread stacks) plus 3 GiB of headroom
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        pass
    cap = vm + (3 << 30)
    if hard != resource.RLIM_INFINITY and hard < cap:
        cap = hard
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


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
