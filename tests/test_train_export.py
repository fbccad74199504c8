"""train.py's export, converted by engine.convert and run by our engine, reproduces train.py's own forward.

A tiny model of train.py's class is trained for a few steps (so weights are not just the init), exported
to the HF packed layout, converted to a store (f16 LM head: exact), loaded with engine.api.load_model;
greedy tokens must be identical and logits close. No full training in CI. Needs torch (the training-only
dependency): skipped with a reason when torch is not installed.
"""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the training-only dependency (pip install torch)")

from bitnet_cpu.models import corpus  # noqa: E402
from bitnet_cpu.models.bitnet_torch import TinyBitNet, TinyConfig  # noqa: E402
from bitnet_cpu.models.export import export_hf_dir, pack_quarters, unpack_quarters  # noqa: E402
from bitnet_cpu.models.train import CHAT_TEMPLATE, RowStream, build_tokenizer, loss_of  # noqa: E402


def test_pack_quarters_layout():
    rng = np.random.default_rng(0)
    w = rng.integers(-1, 2, size=(8, 5)).astype(np.int8)
    p = pack_quarters(w)
    assert p.shape == (2, 5) and p.dtype == np.uint8
    # FORMATS.md §1: W_t[i*P + p, c] = ((packed[p, c] >> 2i) & 3) - 1, P = out/4
    for i in range(4):
        for r in range(2):
            assert np.array_equal(((p[r] >> (2 * i)) & 3).astype(np.int8) - 1, w[i * 2 + r])
    assert np.array_equal(unpack_quarters(p), w)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    tok = build_tokenizer(seed=3, vocab_size=600, n_docs=1500)
    vocab = (tok.get_vocab_size() + 63) // 64 * 64
    cfg = TinyConfig(vocab_size=vocab, hidden_size=128, intermediate_size=192, n_layers=2, n_heads=2,
                     n_kv_heads=1, max_position_embeddings=128)
    model = TinyBitNet(cfg)
    pairs, _ = corpus.split_pairs(3)
    stream = RowStream(tok, 5, 64, pairs)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(8):   # a few real QAT steps so that scales, norms and embeddings are not the init
        ids, mask = stream.batch(4)
        loss = loss_of(model, ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.round_to_export_precision()
    model.eval()
    d = tmp_path_factory.mktemp("tiny") / "hf"
    export_hf_dir(model, tok, str(d), chat_template=CHAT_TEMPLATE)
    return model, tok, str(d)


def test_export_files(exported):
    model, tok, d = exported
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["quantization_config"] == {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                          "quantization_mode": "offline"}
    assert cfg["architectures"] == ["BitNetForCausalLM"] and cfg["hidden_act"] == "relu2"
    from safetensors import safe_open
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
        e = f.get_tensor("model.embed_tokens.weight")
    assert q.dtype == torch.uint8 and tuple(q.shape) == (model.cfg.hidden_size // 4, model.cfg.hidden_size)
    assert s.dtype == torch.bfloat16 and tuple(s.shape) == (1,)
    assert e.dtype == torch.bfloat16 and torch.equal(e.float(), model.embed_tokens.weight)
    w = model.layers[0].self_attn.q_proj.weight.detach()
    assert float(s) == pytest.approx(float(w.abs().mean()), rel=1e-2)
    tc = json.load(open(os.path.join(d, "tokenizer_config.json")))
    assert tc["chat_template"] == CHAT_TEMPLATE


def test_engine_matches_training_forward(exported, tmp_path):
    model, tok, d = exported
    from bitnet_cpu.engine.api import SamplingParams, load_model
    from bitnet_cpu.engine.formats.convert import convert

    store = convert(d, str(tmp_path / "tiny.bnstore"), lm_head="f16", progress=False)
    llm = load_model(store, progress=False)
    prompts = ["Once upon a time, there was a", "12+34=", "<|begin_of_text|>User: Hi!<|eot_id|>Assistant: "]
    for text in prompts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert llm.tokenize(text, add_bos=False) == ids
        want = model.greedy(ids, 24)
        got = [c.token for c in llm.generate(ids, SamplingParams(temperature=0.0), max_tokens=24)
               if c.token is not None]
        # the engine stops at an end token; compare up to there
        assert got == want[:len(got)], text
        assert len(got) == 24 or want[len(got) - 1] in llm.config.eos_token_ids
        with torch.no_grad():
            ref = model(torch.tensor([ids]))[0].numpy()
        out = llm.forward(ids)
        np.testing.assert_allclose(out, ref, atol=2e-3 * max(1.0, float(np.abs(ref).max())))


def test_init_from_export_reproduces_the_shipped_export():
    """Training can start from an export (train.py --init-from, phase 8): the latent weights made from
    W_t and scale give back exactly the exported tensors, and doing it again changes nothing."""
    from safetensors.torch import load_file

    from bitnet_cpu.models import DEFAULT_MODEL_DIR
    from bitnet_cpu.models.export import config_from_hf_dir, init_from_export, relatent_from_ternary, state_tensors

    model = init_from_export(TinyBitNet(config_from_hf_dir(DEFAULT_MODEL_DIR)), DEFAULT_MODEL_DIR)
    stored = load_file(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = state_tensors(model)
    assert sorted(got) == sorted(stored)
    for k in stored:
        assert torch.equal(got[k], stored[k]), k
    relatent_from_ternary(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
