"""BitCPM4 (OpenBMB; MiniCPM architecture): small random checkpoints in its file layout (MiniCPMForCausalLM
config with scale_emb / scale_depth / dim_model_base and a LongRoPE rope_scaling, bf16 fake-quantized ternary
weights, Llama tensor names, tokenizer files) converted to our store, against a float32 torch MiniCPM written
here from the public math (transformers has no MiniCPM class; the hub's modeling_minicpm.py is remote code):

    x0     = embed(ids) * scale_emb
    x     += attn(rmsnorm(x)) * scale_depth / sqrt(num_hidden_layers)      (and the same for the MLP)
    logits = lm_head(rmsnorm(x) / (hidden_size / dim_model_base))
    RoPE (half split): frequencies inv_freq / factor, factor = long_factor when max_position_embeddings >
    original_max_position_embeddings else short_factor; cos and sin x sqrt(1 + ln(max/orig) / ln(orig))

The strict reference quantizes every linear input to int8 per token as the engine does (transformers' BitLinear
ActQuant); BitCPM4's own model keeps activations in float, which is compared loosely (as TriLM in
test_families.py). Near-tie rule as test_parity_hf.py.
"""
import json
import math
import os

import numpy as np
import pytest

from bitnet_cpu.engine.errors import FormatError, UnsupportedError
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.runtime.model import Model
from bitnet_cpu.engine.synth import SynthModel, bf16_round, write_hf_dir
from bitnet_cpu.engine.synth.writers import bf16_bits, write_safetensors
from helpers import assert_conversion_refused, bitnet_inspect
from test_model_fixtures import our_greedy, assert_same_or_near_tie
from test_parity_hf import TOL, _check_close

torch = pytest.importorskip("torch", reason="the float32 MiniCPM reference needs torch")
pytestmark = pytest.mark.reference

HD = 64
# name: (config overrides, per-row weight scales, untied lm_head); "groups": one scale per 128 weights of a row
VARIANTS = {
    # BitCPM4-0.5B-like: tied embeddings, LongRoPE with max_position_embeddings > original (long factors, scaled cos/sin)
    "BitCPM4-0.5B": ({"max_position_embeddings": 256, "original": 128}, False, False),
    # untied head, per-row scales, original == max (short factors, cos/sin unscaled)
    "BitCPM4-1B": ({"max_position_embeddings": 128, "original": 128, "num_hidden_layers": 2,
                    "dim_model_base": 64}, True, True),
    # BitCPM-CANN ("ternary ... with group-wise scaling"): one bf16 scale per 128 weights of a row, run with the
    # group-scaled kernels (activations quantized per group of 128: so is the reference's input here)
    "BitCPM-CANN-1B": ({"max_position_embeddings": 256, "original": 128, "num_hidden_layers": 2}, "groups", False),
}


def _factors(n, top, seed):
    r = np.random.default_rng(seed).uniform(0.9, 1.1, n)
    return [float(x) for x in np.geomspace(1.0, top, n) * r]


def minicpm_config(m: SynthModel, over: dict) -> dict:
    orig = over.get("original", 128)
    return {
        "architectures": ["MiniCPMForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMConfig",
                     "AutoModel": "modeling_minicpm.MiniCPMModel",
                     "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM"},
        "model_type": "minicpm", "hidden_act": "silu", "hidden_size": m.D, "intermediate_size": m.I,
        "num_hidden_layers": m.L, "num_attention_heads": m.H, "num_key_value_heads": m.KV, "vocab_size": m.V,
        "max_position_embeddings": over["max_position_embeddings"], "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "longrope", "long_factor": _factors(HD // 2, 40.0, 1),
                         "short_factor": _factors(HD // 2, 1.5, 2), "original_max_position_embeddings": orig},
        "rms_norm_eps": 1e-6, "scale_emb": 12, "dim_model_base": over.get("dim_model_base", 96), "scale_depth": 1.4,
        "tie_word_embeddings": m.config["tie_word_embeddings"], "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.1, "use_cache": True, "torch_dtype": "bfloat16", "transformers_version": "4.46.0",
    }


def write_minicpm_dir(d: str, seed: int, over: dict, per_row: bool, untied: bool, ternary: bool = True):
    """(params as f32 arrays exactly as stored, config) after writing the directory."""
    m = SynthModel({"head_dim": HD, "num_hidden_layers": over.get("num_hidden_layers", 3),
                    "tie_word_embeddings": not untied}, seed=seed, style="llama")
    write_hf_dir(m, d, form="unpacked")        # tokenizer.json, tokenizer_config.json, generation_config.json
    os.remove(os.path.join(d, "model.safetensors"))
    rng = np.random.default_rng(seed + 100)
    P = {"model.embed_tokens.weight": m.embed(), "model.norm.weight": m.norm("model.norm.weight")}
    for i in range(m.L):
        for hf in m.norm_names(i).values():
            P[hf] = m.norm(hf)
    for prefix, o, _ in m.linears():
        if not ternary:
            w = m.master(prefix)
        else:
            s = np.float32(m.weight_scale(prefix))
            if per_row == "groups":
                n_in = m.ternary(prefix).shape[1]
                s = np.repeat(bf16_round(s * rng.uniform(0.5, 1.5, (o, n_in // 128)).astype(np.float32)), 128, axis=1)
            elif per_row:
                s = bf16_round(s * rng.uniform(0.5, 1.5, (o, 1)).astype(np.float32))
            w = m.ternary(prefix).astype(np.float32) * s      # ternary x scale: exact in bf16
        P[prefix + ".weight"] = bf16_round(w)
    if untied:
        P["lm_head.weight"] = m.lm_head()
    for k, v in P.items():
        assert np.array_equal(bf16_round(v), v), k
    write_safetensors(os.path.join(d, "model.safetensors"),
                      [(k, "BF16", list(v.shape), lambda v=v: bf16_bits(v)) for k, v in P.items()])
    cfg = minicpm_config(m, over)
    old = json.load(open(os.path.join(d, "config.json")))
    cfg.update(bos_token_id=old["bos_token_id"], eos_token_id=old["eos_token_id"])
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
    return m, P, cfg


# ---- the reference: MiniCPM's forward pass in float32 torch -----------------------------------------------
def _act_quant(x):
    s = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * s).round().clamp(-128, 127) / s


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_tables(cfg, n):
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    t = torch.arange(n, dtype=torch.float32)
    rs = cfg["rope_scaling"]
    orig, mx = rs["original_max_position_embeddings"], cfg["max_position_embeddings"]
    ext = torch.tensor(rs["long_factor"] if mx > orig else rs["short_factor"], dtype=torch.float32)
    freqs = torch.outer(t, 1.0 / ext) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    f = math.sqrt(1 + math.log(mx / orig) / math.log(orig))
    return emb.cos() * f, emb.sin() * f


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _act_quant_groups(x):
    """Per group of 128 columns, as the engine quantizes inputs of group-scaled matrices."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    amax = g.abs().amax(-1, keepdim=True)
    q = (g * torch.where(amax > 0, 127.0 / amax.clamp(min=1e-30), torch.zeros_like(amax))).round().clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)


def reference_logits(P, cfg, ids, act_quant=True):
    T = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in P.items()}
    D, H, KV, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    hd, eps, n = D // H, cfg["rms_norm_eps"], len(ids)
    sr = cfg["scale_depth"] / math.sqrt(L)
    q_in = (_act_quant_groups if cfg.get("_groups") else _act_quant) if act_quant else (lambda x: x)

    def lin(x, name):
        return q_in(x) @ T[name + ".weight"].T

    cos, sin = _rope_tables(cfg, n)
    mask = torch.full((n, n), float("-inf")).triu(1)
    with torch.no_grad():
        x = T["model.embed_tokens.weight"][torch.tensor(ids)] * cfg["scale_emb"]
        for i in range(L):
            p = f"model.layers.{i}"
            h = _rms(x, T[f"{p}.input_layernorm.weight"], eps)
            q = lin(h, f"{p}.self_attn.q_proj").view(n, H, hd).transpose(0, 1)
            k = lin(h, f"{p}.self_attn.k_proj").view(n, KV, hd).transpose(0, 1)
            v = lin(h, f"{p}.self_attn.v_proj").view(n, KV, hd).transpose(0, 1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
            a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, dim=-1) @ v
            x = x + lin(a.transpose(0, 1).reshape(n, H * hd), f"{p}.self_attn.o_proj") * sr
            h = _rms(x, T[f"{p}.post_attention_layernorm.weight"], eps)
            g = torch.nn.functional.silu(lin(h, f"{p}.mlp.gate_proj")) * lin(h, f"{p}.mlp.up_proj")
            x = x + lin(g, f"{p}.mlp.down_proj") * sr
        h = _rms(x, T["model.norm.weight"], eps) / (D / cfg["dim_model_base"])
        head = T.get("lm_head.weight", T["model.embed_tokens.weight"])
        return (h @ head.T).numpy()


def reference_greedy(P, cfg, ids, n):
    ids, out, steps = list(ids), [], []
    for _ in range(n):
        lg = reference_logits(P, cfg, ids)[-1]
        steps.append(lg)
        out.append(int(lg.argmax()))
        ids.append(out[-1])
    return out, steps


# ---- tests -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("minicpm")
    out = {}
    for k, (name, (over, per_row, untied)) in enumerate(VARIANTS.items()):
        d = str(root / name)
        m, P, cfg = write_minicpm_dir(d, 40 + k, over, per_row, untied)
        cfg = dict(cfg, _groups=per_row == "groups")   # the reference's activation quantization (not in the file)
        out[name] = (m, P, cfg, d, convert(d, d + ".bnstore", lm_head="f16", progress=False))
    return out


def _ids(m, seed, n):
    return np.random.default_rng(seed).integers(0, m.V - 16, n).tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_reference(variants, name):
    m, P, cfg, _, store = variants[name]
    ids = _ids(m, 1, 70)
    ours = Model(Store(store), n_ctx=96, kv_dtype="f32", chunk=32).forward(ids)
    _check_close(ours, reference_logits(P, cfg, ids), "f32")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_reference(variants, name):
    m, P, cfg, _, store = variants[name]
    ids = _ids(m, 2, 9)
    ref_ids, ref_steps = reference_greedy(P, cfg, ids, 24)
    ours = our_greedy(Model(Store(store), n_ctx=64, kv_dtype="f32"), ids, 24)
    assert_same_or_near_tie(ours, ref_ids, ref_steps, TOL["f32"][0])


def test_int8_head_and_f16_cache(variants):
    m, P, cfg, d, _ = variants["BitCPM4-0.5B"]
    store = convert(d, d + ".i8.bnstore", lm_head="i8", progress=False)
    ids = _ids(m, 4, 50)
    _check_close(Model(Store(store), n_ctx=64).forward(ids), reference_logits(P, cfg, ids), "i8")


def test_batching_engine_same_greedy(variants):
    """The batching engine builds its RoPE tables from the same config: greedy output equals one sequence's."""
    from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model

    m, _, _, _, store = variants["BitCPM4-0.5B"]
    greedy = SamplingParams(temperature=0.0)
    prompts = [_ids(m, 10 + k, 5 + 7 * k) for k in range(3)]
    llm = load_model(store, ctx=96, progress=False)
    alone = [[c.token for c in llm.generate(p, greedy, max_tokens=10) if c.token is not None] for p in prompts]
    llm.close()
    eng = load_engine(store, ctx=96, parallel=3, progress=False)
    try:
        streams = [eng.submit(p, greedy, max_tokens=10) for p in prompts]
        assert [[c.token for c in s if c.token is not None] for s in streams] == alone
    finally:
        eng.close()


def test_scalings_matter(variants):
    """Each folded constant and LongRoPE changes the reference by more than the parity tolerance (guards
    against a test that cannot fail)."""
    m, P, cfg, _, _ = variants["BitCPM4-0.5B"]
    ids = _ids(m, 5, 40)
    base = reference_logits(P, cfg, ids)
    rs = dict(cfg["rope_scaling"], long_factor=[1.0] * (HD // 2))
    for edit in ({"scale_emb": 1}, {"scale_depth": 5.0}, {"dim_model_base": cfg["hidden_size"]}, {"rope_scaling": rs}):
        d = np.abs(reference_logits(P, {**cfg, **edit}, ids) - base)
        assert d.max() > 2 * TOL["f32"][0] or np.median(d) > 2 * TOL["f32"][1], edit   # _check_close would fail


def test_store_records_the_description(variants):
    for name, (m, _, cfg, _, store) in variants.items():
        s = Store(store)
        c = s.config
        rs = cfg["rope_scaling"]
        long_ = cfg["max_position_embeddings"] > rs["original_max_position_embeddings"]
        assert s.meta["family"] == "bitcpm4" and c.arch == "minicpm" and "scale_emb 12" in s.meta["folded"]
        assert (c.sub_norms, c.tie_word_embeddings, c.hidden_act, c.head_dim) == (False, False, "silu", HD)
        grouped = VARIANTS[name][1] == "groups"
        assert c.weight_groups == (128 if grouped else 0) and not c.qk_norm
        assert s.info("blk.0.ffn_down")["layout"] == ("tg128" if grouped else "tile16")
        assert list(c.rope_factors) == pytest.approx(rs["long_factor" if long_ else "short_factor"])
        want = math.sqrt(1 + math.log(2) / math.log(128)) if long_ else 1.0
        assert c.rope_attn_factor == pytest.approx(want)


def test_float_activations_close(variants, capsys):
    """BitCPM4's own model keeps activations in float; ours quantizes them to int8 per token: close, not equal."""
    m, P, cfg, _, store = variants["BitCPM4-0.5B"]
    ids = _ids(m, 3, 60)
    ours = Model(Store(store), n_ctx=64, kv_dtype="f32").forward(ids)
    ref = reference_logits(P, cfg, ids, act_quant=False)
    top1 = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    with capsys.disabled():
        print(f"\nBitCPM4 synth: int8 vs float activations: max |diff| {np.abs(ours - ref).max():.3f},"
              f" top-1 agreement {top1:.0%}")
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.99 and top1 >= 0.8


def test_inspect_names_family(variants):
    _, _, _, d, store = variants["BitCPM4-0.5B"]
    for target in (d, store):
        out, runtime = bitnet_inspect(target)
        assert "family: BitCPM4 / BitCPM-CANN (OpenBMB; MiniCPM architecture)" in out
        assert "LongRoPE (32 per-frequency factors" in runtime and "silu(gate) * up" in runtime
        assert "folded: scale_emb 12 into token_embd" in out


def test_non_ternary_minicpm_refused(tmp_path):
    d = str(tmp_path / "MiniCPM4-0.5B")
    write_minicpm_dir(d, 7, {"max_position_embeddings": 256}, False, False, ternary=False)
    assert_conversion_refused(d, tmp_path, "not ternary")


def test_unsupported_minicpm_variants_refused(tmp_path):
    d = str(tmp_path / "BitCPM4-x")
    write_minicpm_dir(d, 8, {"max_position_embeddings": 256}, False, False)
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    for edit, match in (({"num_experts": 8, "num_experts_per_tok": 2}, "mixture of experts"),
                        ({"sparse_config": {"kernel_size": 32}}, "sparse attention"),
                        ({"q_lora_rank": 768, "kv_lora_rank": 256}, "latent attention"),
                        ({"architectures": ["MiniCPM3ForCausalLM"], "model_type": "minicpm3"}, "MiniCPM3"),
                        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'")):
        json.dump({**cfg, **edit}, open(p, "w"))
        with pytest.raises(UnsupportedError, match=match):
            convert(d, str(tmp_path / "z.bnstore"), progress=False)
    json.dump({**cfg, "rope_scaling": {**cfg["rope_scaling"], "long_factor": [1.0] * 3}}, open(p, "w"))
    with pytest.raises(FormatError, match="long_factor must be a list of 32"):
        convert(d, str(tmp_path / "z.bnstore"), progress=False)
