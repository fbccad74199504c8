"""Ternary Bonsai (PrismML; Qwen3 architecture with q/k norms, one f16 scale per 128 weights of a row): small random
checkpoints in the `-unpacked` HF layout (Qwen3ForCausalLM, f16 ternary x group scale) and as `qwen3` GGUFs (Q2_0
blocks, and the F16 form), converted to our store (layout tg128) and run against transformers' float32 Qwen3.

Our engine quantizes every matrix product's input to int8 per group of 128 (K.quantize_act_g128), as llama.cpp
quantizes Q2_0's activations to Q8_0. So the tight reference is transformers' Qwen3 with the same fake
quantization on the inputs of its linear layers (forward pre-hooks): logits within the parity tests' tolerance and
greedy runs identical or parting at a near tie. Against the plain float model the gap is that quantization's; it
is printed and bounded loosely."""
import numpy as np
import pytest

from bitnet_cpu.engine.errors import FormatError
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.formats.describe import describe
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.runtime.model import Model
from bitnet_cpu.engine.synth import SynthModel, write_bonsai_dir, write_bonsai_gguf
from test_model_fixtures import (assert_same_or_near_tie, load_reference, our_greedy, reference_greedy,
                                 reference_logits, reference_or_skip)
from test_parity_hf import TOL, _check_close

pytestmark = pytest.mark.reference

CONFIGS = {  # Qwen3-1.7B / 4B tie their head, 8B does not; head_dim 64 (128 in the real models), GQA 2:1
    "tied": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 640, "rope_theta": 1000000.0,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "untied": {"hidden_size": 384, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 128, "num_hidden_layers": 3, "vocab_size": 700, "rope_theta": 1000000.0,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}


def _fake_quant_groups(model):
    """Quantize the input of every linear layer inside the blocks per group of 128, as the engine does."""
    import torch

    def hook(mod, args):
        x = args[0]
        g = x.reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
        amax = g.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                          torch.zeros_like(amax))
        q = torch.clamp(torch.round(g * inv), -127, 127)
        return (q * (amax / 127.0)).reshape(x.shape)

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers."):
            mod.register_forward_pre_hook(hook)
    return model


@pytest.fixture(scope="module")
def bonsai(tmp_path_factory):
    reference_or_skip()
    root = tmp_path_factory.mktemp("bonsai")
    out = {}
    for k, (key, cfg) in enumerate(CONFIGS.items()):
        m = SynthModel(cfg, seed=40 + k, style="llama")
        d = write_bonsai_dir(m, str(root / f"Ternary-Bonsai-{key}-unpacked"))
        q2 = write_bonsai_gguf(m, str(root / f"{key}-Q2_0.gguf"))                     # PrismML's 128-blocks
        q64 = write_bonsai_gguf(m, str(root / f"{key}-ggml-Q2_0.gguf"), linear_type="Q2_0")   # ggml's 64-blocks
        f16 = write_bonsai_gguf(m, str(root / f"{key}-F16.gguf"), linear_type="F16")
        stores = {"dir": convert(d, d + ".bnstore", lm_head="f16", progress=False),
                  "q2_0": convert(q2, q2 + ".bnstore", lm_head="f16", progress=False),
                  "q2_0_64": convert(q64, q64 + ".bnstore", lm_head="f16", progress=False),
                  "f16": convert(f16, f16 + ".bnstore", lm_head="f16", progress=False),
                  "default": convert(d, d + ".default.bnstore", progress=False)}
        out[key] = (m, d, stores, _fake_quant_groups(load_reference(d)), load_reference(d))
    return out


def _ids(m, seed, n):
    return np.random.default_rng(seed).integers(0, m.V - 16, n).tolist()


@pytest.mark.parametrize("key", CONFIGS)
def test_logits_match_transformers_with_group_quantized_inputs(bonsai, key):
    m, _, stores, ref_q, ref_f = bonsai[key]
    for seed in (1, 2):
        ids = _ids(m, seed, 24)
        ref = reference_logits(ref_q, ids)
        # f32 cache: the same math as the reference up to float rounding, which now and then flips one int8
        # rounding (that token moves by up to ~0.2, and later positions a little through attention): far closer
        # than the float model (which does not quantize activations at all)
        ours = Model(Store(stores["dir"]), kv_dtype="f32").forward(ids)
        _check_close(ours, ref, "f32")
        d = np.abs(ours - ref)
        assert np.median(d) < 0.5 * np.median(np.abs(ours - reference_logits(ref_f, ids)))
        _check_close(Model(Store(stores["dir"])).forward(ids), ref, "f16")   # the default f16 cache


@pytest.mark.parametrize("key", CONFIGS)
def test_greedy_matches_transformers(bonsai, key):
    m, _, stores, ref_q, _ = bonsai[key]
    ids = _ids(m, 3, 10)
    ref_ids, steps = reference_greedy(ref_q, ids, 16)
    for kv in ("f32", "f16"):
        ours = our_greedy(Model(Store(stores["dir"]), kv_dtype=kv), ids, 16)
        assert_same_or_near_tie(ours, ref_ids, steps, TOL[kv][0])


@pytest.mark.parametrize("key", CONFIGS)
def test_float_reference_gap(bonsai, key, capsys):
    """The plain float32 Qwen3 (unquantized activations): the gap is the int8 group quantization's, bounded
    loosely; top-1 may only differ where the float model's own margin is small."""
    m, _, stores, _, ref_f = bonsai[key]
    ids = _ids(m, 4, 32)
    ours, ref = Model(Store(stores["dir"])).forward(ids), reference_logits(ref_f, ids)
    d = np.abs(ours - ref)
    agree = float((ours.argmax(1) == ref.argmax(1)).mean())
    with capsys.disabled():
        print(f"\n  bonsai {key}: vs float Qwen3 max |d| {d.max():.3f} median {np.median(d):.4f} "
              f"(logit range {np.abs(ref).max():.1f}), top-1 agreement {agree:.0%}")
    assert d.max() <= 1.0 and np.median(d) <= 0.1
    for r in np.nonzero(ours.argmax(1) != ref.argmax(1))[0]:
        a, b = ref[r].argmax(), ours[r].argmax()
        assert ref[r, a] - ref[r, b] <= 1.0


@pytest.mark.parametrize("key", CONFIGS)
def test_gguf_q2_0_both_block_sizes_and_f16_same_logits_as_the_directory(bonsai, key):
    m, _, stores, _, _ = bonsai[key]
    ids = _ids(m, 5, 20)
    want = Model(Store(stores["dir"])).forward(ids)
    for form in ("q2_0", "q2_0_64", "f16"):
        assert np.array_equal(Model(Store(stores[form])).forward(ids), want), form


@pytest.mark.parametrize("key", CONFIGS)
def test_default_head_prefill_decode_and_verify(bonsai, key):
    """The default store (q4 head + exact rescoring) picks the f16 head's greedy tokens; prefill, decode and
    verify rows agree (every pass goes through the group kernels with 1..n rows)."""
    m, _, stores, _, _ = bonsai[key]
    ids = _ids(m, 6, 12)
    assert our_greedy(Model(Store(stores["default"])), ids, 12) == our_greedy(Model(Store(stores["dir"])), ids, 12)
    model = Model(Store(stores["dir"]))
    full = model.forward(ids)
    model.reset()
    model.prefill(ids[:8])
    rows = model.verify(ids[8:])
    assert np.allclose(rows, full[8:], rtol=0, atol=1e-4)
    model.truncate(8)
    for i, t in enumerate(ids[8:]):
        assert np.allclose(model.decode(t), full[8 + i], rtol=0, atol=1e-4)


def test_store_and_inspect_describe_the_family(bonsai):
    m, d, stores, _, _ = bonsai["tied"]
    s = Store(stores["dir"])
    c = s.config
    assert c.weight_groups == 128 and c.qk_norm and c.tie_word_embeddings and c.arch == "qwen3"
    assert s.info("blk.0.attn_qkv")["layout"] == "tg128" and "blk.0.attn_qkv.scale" not in s.tensor_names
    text = "\n".join(describe(stores["q2_0"]))
    assert "Ternary Bonsai" in text and "one f16 scale per 128 weights" in text and "q and k head" in text


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_inf_group_scale_is_refused(tmp_path, bad):
    """A Q2_0 file with a NaN / inf scale on a live 128-group is refused as every other format's is (it ran,
    every row through that group NaN or inf)."""
    from bitnet_cpu.engine.formats.gguf import GGUFFile
    m = SynthModel(CONFIGS["tied"], seed=7, style="llama")
    path = write_bonsai_gguf(m, str(tmp_path / "m.gguf"))
    g = GGUFFile(path)
    off = g.tensors["blk.0.attn_q.weight"].offset
    g.close()
    data = bytearray(open(path, "rb").read())
    data[off:off + 2] = np.float16(bad).tobytes()   # the first block's scale
    open(path, "wb").write(bytes(data))
    with pytest.raises(FormatError, match="NaN/inf weight scale"):
        convert(path, str(tmp_path / "m.bnstore"), progress=False)


def test_not_group_ternary_is_refused(tmp_path):
    import json
    import os

    from bitnet_cpu.engine.formats.safetensors_io import SafetensorsDir
    from bitnet_cpu.engine.synth.writers import write_safetensors

    m = SynthModel(CONFIGS["tied"], seed=7, style="llama")
    d = write_bonsai_dir(m, str(tmp_path / "bad"))
    st = SafetensorsDir(d)
    names = list(st.names())
    tensors = {n: np.array(st.get(n)) for n in names}
    st.close()
    w = tensors["model.layers.1.mlp.up_proj.weight"].copy()
    w[3, 130] = w[3, 130] * np.float16(0.5) if w[3, 130] != 0 else np.float16(0.01)   # a second magnitude
    tensors["model.layers.1.mlp.up_proj.weight"] = w

    def rewrite():
        os.remove(os.path.join(d, "model.safetensors"))
        write_safetensors(os.path.join(d, "model.safetensors"),
                          [(n, "F16", list(a.shape), lambda a=a: a) for n, a in tensors.items()])

    rewrite()
    with pytest.raises(FormatError, match=r"up_proj.weight' is not ternary with one scale per 128 weights \(row 3, group 1"):
        convert(d, str(tmp_path / "bad.bnstore"), progress=False)
    assert json.load(open(os.path.join(d, "config.json")))["model_type"] == "qwen3"
    # an ordinary Qwen3 (float weights): refused when the source opens, before anything is written
    q0 = "model.layers.0.self_attn.q_proj.weight"
    tensors[q0] = np.random.default_rng(1).standard_normal(tensors[q0].shape).astype(np.float16)
    rewrite()
    with pytest.raises(FormatError, match=r"q_proj.weight' is not ternary with one scale per 128 weights"):
        convert(d, str(tmp_path / "plain.bnstore"), progress=False)
    assert not os.path.exists(tmp_path / "plain.bnstore")


def test_inspect_reports_group_ternary_gguf(bonsai, tmp_path):
    """`bitnet inspect` on a Q2_0 GGUF shows each matrix's split and its range of group scales, not a per-tensor
    ternary fit (which a group-scaled matrix fails)."""
    m, _, _, _, _ = bonsai["tied"]
    text = "\n".join(describe(write_bonsai_gguf(m, str(tmp_path / "x-Q2_0.gguf"))))
    assert "NOT TERNARY" not in text
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("blk.0.ffn_up ")]
    assert len(lines) == 1 and "scale" in lines[0] and "," in lines[0]


def test_q2_0_block_size_read_from_the_offsets(bonsai, tmp_path):
    """Type 42 in ggml's 64-weight blocks and in PrismML's 128-weight ones decode to the same weights; a 64-block
    file whose two halves of a 128-group carry different scales is refused, naming the row and columns."""
    from bitnet_cpu.engine.errors import UnsupportedError
    from bitnet_cpu.engine.formats.gguf import GGUFFile
    from bitnet_cpu.engine.synth import writers

    m, _, _, _, _ = bonsai["tied"]
    p64 = write_bonsai_gguf(m, str(tmp_path / "a.gguf"), linear_type="Q2_0")
    p128 = write_bonsai_gguf(m, str(tmp_path / "b.gguf"))
    with GGUFFile(p64) as g64, GGUFFile(p128) as g128:
        a, b = g64.info("blk.0.ffn_up.weight"), g128.info("blk.0.ffn_up.weight")
        assert (a.type_name, b.type_name) == ("Q2_0", "Q2_0_G128") and a.nbytes == b.nbytes * 18 * 2 // 34
        assert np.array_equal(g64.dequantize(a.name), g128.dequantize(b.name))
    real = writers.bonsai_weights

    def split(mm, prefix):   # different scales in the two 64-halves of one group
        t, sc = real(mm, prefix)
        return t, sc

    orig_pack = writers.q2_0_pack

    def pack(t, sc, block=128):
        out = orig_pack(t, sc, block).copy()
        if block == 64 and t.shape == (m.I, m.D):
            blk = out.reshape(-1, 18)
            blk[1, :2] = np.frombuffer(np.float16(0.125).tobytes(), np.uint8)   # row 0, columns 64..127
        return out

    writers.q2_0_pack = pack
    try:
        bad = write_bonsai_gguf(m, str(tmp_path / "c.gguf"), linear_type="Q2_0")
    finally:
        writers.q2_0_pack = orig_pack
    with pytest.raises(UnsupportedError, match=r"two different scales in the 128 weights at row 0, columns 0..127"):
        convert(bad, str(tmp_path / "c.bnstore"), progress=False)


def test_chat_template_matches_transformers(bonsai):
    """The directory's Qwen3-style template (namespace scan, string methods, reasoning split, tool calls as JSON)
    renders to the same prompt ids through our sandbox as through transformers' apply_chat_template."""
    from transformers import AutoTokenizer

    from bitnet_cpu.engine.api import load_model

    m, d, stores, _, _ = bonsai["tied"]
    tok = AutoTokenizer.from_pretrained(d)
    llm = load_model(stores["dir"], ctx=64, progress=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello.",
             "tool_calls": [{"name": "look", "arguments": {"q": "x", "n": 2}}]},
            {"role": "user", "content": "Tell me a story"}]
    for conv in (msgs, msgs[1:2]):
        want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        # transformers tokenizes without special tokens; llama-server (and chat_prompt) with them: the BOS
        # the tokenizer adds, where the template writes none
        bos = llm.tokenizer.text_bos
        want = [bos] + list(want) if bos is not None and list(want)[:1] != [bos] else want
        assert llm.chat_prompt(conv) == list(want)
    assert "<tool_call>" in tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    llm.close()
