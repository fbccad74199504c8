"""engine.synth: synthetic models are what every format test and benchmark builds on, so check that each
writer produces what the format's own reader (gguf, safetensors, transformers) sees as the same weights."""
import json
import os

import numpy as np
import pytest

from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_i2s, write_gguf_tq, write_hf_dir
from bitnet_cpu.engine.synth.writers import hf_pack, tq2_pack

LIN = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def model():
    return SynthModel(seed=7)


def test_ternary_deterministic_and_mixed(model):
    w = model.ternary(LIN)
    assert w.shape == (256, 512) and w.dtype == np.int8
    assert np.array_equal(w, SynthModel(seed=7).ternary(LIN))
    assert not np.array_equal(w, SynthModel(seed=8).ternary(LIN))
    shares = [(w == v).mean() for v in (-1, 0, 1)]
    assert all(0.2 < s < 0.5 for s in shares), shares
    s = model.weight_scale(LIN)
    assert np.float32(s) == np.float16(s) and s > 0


def test_embed_slices_match_whole(model):
    e = model.embed()
    assert e.shape == (512, 256)
    assert np.array_equal(model.embed(slice(100, 300)), e[100:300])
    assert np.array_equal(e.astype(np.float16).astype(np.float32), e)  # f16-exact


def test_tokenizer_llama3_like(model):
    from tokenizers import Tokenizer

    t = model.tokenizer_info()
    tok = Tokenizer.from_str(t["json"])
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id("<|begin_of_text|>") == t["bos"]
    assert tok.token_to_id("<|end_of_text|>") == t["eos"] == t["bos"] + 1
    assert tok.token_to_id("<|eot_id|>") == t["eot"] == t["bos"] + 9
    text = "Café 日本語 🙂 Lily went to the sea, 12345!\n\n  x"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert tok.encode(text).ids[0] == t["bos"]


def test_hf_packed_layout(tmp_path, model):
    w = model.ternary(LIN)
    p = hf_pack(w)
    P = w.shape[0] // 4
    for i in range(4):  # FORMATS.md §1 formula
        assert np.array_equal(((p >> (2 * i)) & 3).astype(np.int8) - 1, w[i * P:(i + 1) * P])
    write_hf_dir(model, str(tmp_path), shards=3)
    idx = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(idx["weight_map"].values())) == 3
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["quantization_config"]["linear_class"] == "autobitlinear"
    assert cfg["quantization_config"]["quantization_mode"] == "offline"
    from safetensors import safe_open

    fn = idx["weight_map"][LIN + ".weight"]
    with safe_open(str(tmp_path / fn), "np") as f:
        assert np.array_equal(f.get_tensor(LIN + ".weight"), p)


@pytest.mark.parametrize("qtype", ["TQ1_0", "TQ2_0"])
def test_gguf_tq_dequantizes_to_source(tmp_path, model, qtype):
    gguf = pytest.importorskip("gguf")
    path = write_gguf_tq(model, str(tmp_path / "m.gguf"), qtype)
    r = gguf.GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    x = t["blk.1.ffn_down.weight"]
    deq = gguf.quants.dequantize(x.data, x.tensor_type)
    assert np.array_equal(deq, model.ternary(LIN) * np.float32(model.weight_scale(LIN)))
    assert str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8") == "bitnet"


def test_fast_tq2_equals_gguf_quantizer(model):
    gguf = pytest.importorskip("gguf")
    w, s = model.ternary(LIN), model.weight_scale(LIN)
    ref = gguf.quants.quantize(w.astype(np.float32) * np.float32(s), gguf.GGMLQuantizationType.TQ2_0)
    assert np.array_equal(tq2_pack(w, s), ref)


def test_i2s_layout(tmp_path, model):
    path = write_gguf_i2s(model, str(tmp_path / "m.gguf"))
    w = model.ternary(LIN)
    from bitnet_cpu.engine.synth.writers import i2s_pack

    b = np.frombuffer(i2s_pack(w, 0.5), np.uint8)
    n = w.size
    assert b.size == n // 4 + 32
    assert np.frombuffer(b[n // 4: n // 4 + 4].tobytes(), "<f4")[0] == 0.5
    flat = w.reshape(-1)
    blocks = b[: n // 4].reshape(-1, 32)
    for k, shift in enumerate((6, 4, 2, 0)):  # FORMATS.md §3, independent decode
        got = ((blocks >> shift) & 3).astype(np.int8) - 1
        assert np.array_equal(got, flat.reshape(-1, 128)[:, 32 * k: 32 * k + 32])
    assert os.path.getsize(path) > n // 4


def test_transformers_loads_hf_dir(tmp_path):
    try:
        import accelerate  # noqa: F401  (the bitnet quantizer of transformers requires it)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        pytest.skip(f"reference stack not installed (pip install '.[reference]'): {e}")
    m = SynthModel(small_config(num_hidden_layers=1), seed=3)
    write_hf_dir(m, str(tmp_path))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    sd = ref.state_dict()
    for prefix, _, _ in m.linears():
        assert np.array_equal(sd[prefix + ".weight"].float().numpy(), m.ternary(prefix).astype(np.float32)), prefix
        assert float(sd[prefix + ".weight_scale"].float()[0]) == m.weight_scale(prefix)
    assert np.array_equal(sd["model.embed_tokens.weight"].float().numpy(), m.embed())
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<|begin_of_text|>System: Be brief.<|eot_id|>User: Hi?<|eot_id|>Assistant: "


def test_transformers_online_ternarization_matches_converter(tmp_path):
    """The bf16 "online" checkpoint: transformers' own WeightQuant and our converter's ternarize_online give
    the same ternary codes for every linear, and the same scale up to one f32 ulp (torch sums mean|W| in its
    own f32 reduction order; we take the correctly rounded mean)."""
    try:
        import accelerate  # noqa: F401
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.integrations.bitnet import WeightQuant
    except ImportError as e:
        pytest.skip(f"reference stack not installed (pip install '.[reference]'): {e}")
    from bitnet_cpu.engine.formats.sources import ternarize_online

    m = SynthModel(small_config(num_hidden_layers=1), seed=4)
    write_hf_dir(m, str(tmp_path), form="online")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    mods = dict(ref.named_modules())
    for prefix, _, _ in m.linears():
        w = mods[prefix].weight.data.float()
        want = WeightQuant.apply(w).numpy()
        w_t, scale = ternarize_online(w.numpy())
        assert np.array_equal(np.sign(want), w_t), prefix
        ref_scale = np.abs(want).max()
        assert abs(np.float32(scale) - ref_scale) <= np.spacing(ref_scale), prefix
