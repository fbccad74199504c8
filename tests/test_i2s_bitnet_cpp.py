"""I2_S GGUFs written by bitnet.cpp's own llama-quantize read back to the weights they were made from.

tests/data/i2s holds files quantized by real bitnet.cpp builds (README.md there: the builds and the commands) from
an F32 GGUF of engine.synth's SynthModel(make_i2s_files.CONFIG, seed=make_i2s_files.SEED); every test regenerates
that model and compares with it, so a reader that orders, scales or names anything wrongly fails here.
"""
import os
import shutil
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.api import load_model
from bitnet_cpu.engine.errors import UnsupportedError
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.formats.gguf import GGUFFile
from bitnet_cpu.engine.synth import write_gguf_tq
from bitnet_cpu.engine.synth.writers import HF_NAMES
from helpers import assert_conversion_refused, xz_files
from test_model_fixtures import our_greedy

DATA = os.path.join(os.path.dirname(__file__), "data", "i2s")
sys.path.insert(0, DATA)
import make_i2s_files as M  # noqa: E402

SHORT = {hf: short for short, hf in HF_NAMES.items()}
# file -> its architecture: the 2026-01 x86 build as shipped (gemm-config.h defines ACT_PARALLEL), the 2024-11 release
BUILDS = {"bitnet_cpp_2601_i2_s": "bitnet-b1.58", "bitnet_cpp_2411_i2_s": "bitnet"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return xz_files(tmp_path_factory.mktemp("i2s"), DATA)


@pytest.fixture(scope="module")
def model():
    return M.model()


def _gguf_name(prefix: str) -> str:
    layer, rest = prefix.split(".layers.")[1].split(".", 1)
    return f"blk.{layer}.{SHORT[rest]}.weight"


def _assert_source_weights(g: GGUFFile, model):
    for prefix, out, inp in model.linears():
        name = _gguf_name(prefix)
        assert g.info(name).type_name == "I2_S" and g.info(name).shape == (out, inp), name
        w, scale = g.ternary(name)
        np.testing.assert_array_equal(w, model.ternary(prefix), err_msg=name)
        assert scale.tolist() == [model.weight_scale(prefix)], name


@pytest.mark.parametrize("stem", BUILDS)
def test_bitnet_cpp_i2s_reads_to_the_source_weights(files, model, stem):
    with GGUFFile(files(stem)) as g:
        assert g.arch == BUILDS[stem] and g.kv["general.file_type"] == 40   # LLAMA_FTYPE_MOSTLY_I2_S
        _assert_source_weights(g, model)
        # llama-quantize keeps token_embd as F16 for I2_S and the norms as F32
        assert g.info("token_embd.weight").type_name == "F16"
        np.testing.assert_array_equal(g.dequantize("token_embd.weight"), model.embed())
        np.testing.assert_array_equal(g.dequantize("blk.0.ffn_sub_norm.weight")[0],
                                      model.norm(model.norm_names(0)["ffn_sub_norm"]))


@pytest.mark.parametrize("stem", BUILDS)
def test_bitnet_cpp_i2s_gives_the_tq2_0_files_logits_and_greedy_tokens(files, model, stem):
    root = files.root
    tq = str(root / f"{stem}_ref_tq2_0.gguf")   # the same weights, same architecture and keys, as TQ2_0
    write_gguf_tq(model, tq, "TQ2_0", arch=BUILDS[stem], hidden_activation=None)
    runs = {}
    for kind, path in (("TQ2_0", tq), ("I2_S", files(stem))):
        m = load_model(convert(path, str(root / f"{stem}_{kind}.bnstore"), lm_head="f16", progress=False),
                       ctx=64, progress=False)
        ids = m.tokenize("Once upon a time, in a small village", add_bos=True)
        runs[kind] = (m.forward(ids), our_greedy(m.model, ids, 24))
        assert m.model.config.hidden_act == "relu2"   # (`bitnet` without the key: from its gpt2 tokenizer)
    (ref_logits, ref_tokens), (logits, tokens) = runs["TQ2_0"], runs["I2_S"]
    np.testing.assert_array_equal(logits, ref_logits)   # all 16 prompt positions, bit for bit
    assert tokens == ref_tokens


def test_1x4_layout_of_a_build_without_act_parallel_reads_only_with_the_setting(files, model, monkeypatch):
    """An x86 2026-01 build whose gemm-config.h lacks ACT_PARALLEL (utils/tune_gemm_config.py can write that)
    quantizes to the 1x4 layout (byte [r/4, c] = rows r..r+3 of column c). All codes are valid either way, so
    the default reading is silently wrong (bitnet.cpp's own kernels in that build read it as 128-blocks too);
    BITNET_I2S_BLOCK=1x4 reads it as its quantizer meant."""
    path = files("bitnet_cpp_2601_1x4_i2_s")
    with GGUFFile(path) as g:
        w, scale = g.ternary("blk.0.ffn_down.weight")
        assert not np.array_equal(w, model.ternary("model.layers.0.mlp.down_proj"))
        assert scale.tolist() == [model.weight_scale("model.layers.0.mlp.down_proj")]   # same tail either way
    monkeypatch.setenv("BITNET_I2S_BLOCK", "1x4")
    with GGUFFile(path) as g:
        _assert_source_weights(g, model)
    with GGUFFile(files("bitnet_cpp_2601_i2_s")) as g:  # and the setting does change how a 128-block file reads
        assert not np.array_equal(g.ternary("blk.0.ffn_down.weight")[0],
                                  model.ternary("model.layers.0.mlp.down_proj"))


def test_unknown_i2s_layout_setting_is_refused(files, monkeypatch):
    monkeypatch.setenv("BITNET_I2S_BLOCK", "256")
    with GGUFFile(files("bitnet_cpp_2601_i2_s")) as g, pytest.raises(UnsupportedError, match="BITNET_I2S_BLOCK='256'"):
        g.ternary("blk.0.attn_q.weight")


def test_multithreaded_llama_quantize_output_is_refused(files, model, tmp_path):
    """bitnet.cpp's llama-quantize with nthreads > 1 (setup_env.py passes 1) splits a tensor into chunks of
    16384 weights, writes chunk k at 4x its offset (I2_S's row size counts a byte per weight) and puts each
    chunk's f32 scale right after its codes: the tensor then holds chunk 0, its scale, and leftovers of the work
    buffer (seen with `llama-quantize f32.gguf out.gguf I2_S 2` on the 2026-01 build). Here the leftovers are
    zeros (valid codes: the worst case); the scale's bytes still hold code 3, so the file is refused in a line."""
    src = files("bitnet_cpp_2601_i2_s")
    path = str(tmp_path / "threads2.gguf")
    shutil.copyfile(src, path)
    with GGUFFile(path) as g:
        t = g.info("blk.0.attn_q.weight")
        off, n = t.offset, t.n_elements
    assert n > 16384
    scale = np.float32(model.weight_scale("model.layers.0.self_attn.q_proj"))
    with open(path, "r+b") as f:
        f.seek(off + 16384 // 4)
        f.write(scale.tobytes() + bytes(n // 4 - 16384 // 4 - 4))
    err = assert_conversion_refused(path, tmp_path, "holds invalid code 3")
    assert "nthreads 1" in err
