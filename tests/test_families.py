"""The other ternary model families (engine/families.py): small random checkpoints in each family's file layout
(config keys, tensor names, packing, dtypes) converted to our store, against transformers' float32
LlamaForCausalLM with its BitLinear (quant_method bitnet), with the near-tie rule of test_parity_hf.py.

Families and their layout here:
- Falcon3-1.58bit: LlamaForCausalLM, quantization_config without linear_class (transformers' default
  `bitlinear`, which DIVIDES by a bf16 weight_scale), explicit head_dim, untied bf16 lm_head, no sub-norms,
  rope_theta 1000042, eps 1e-6, Falcon3 chat template.
- Llama3-8B-1.58: the same layout with the LLaMA-3 template / eos 128009-style <|eot_id|>.
- Falcon-E: packed `autobitlinear` (multiplies), and the bf16 masters (ternarized at conversion; config says
  quantization_mode online).
- TriLM: unpacked fp16 ternary x scale, no quantization_config. Its reference is transformers' BitLinear on the
  same ternary weights and scales (the engine quantizes activations to int8 per token like every BitNet
  model; TriLM's own float-activation Llama is also compared, loosely, and the gap is printed).
- GGUF `llama` arch (llama.cpp TQ1_0 / TQ2_0 with q/k rows permuted as its converter does, bitnet.cpp I2_S):
  bit-identical logits to the HF directory.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.api import load_model
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.errors import FormatError, UnsupportedError
from bitnet_cpu.engine.runtime.model import Model
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.synth import (FALCON3_CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE, TRAIN_TEXT, SynthModel, write_gguf_i2s,
                          write_gguf_tq, write_hf_dir)
from helpers import assert_conversion_refused, bitnet_inspect
from test_model_fixtures import load_reference, our_greedy, reference_greedy, reference_logits, reference_or_skip, assert_same_or_near_tie
from test_parity_hf import TOL, _check_close

pytestmark = pytest.mark.reference

# name: (SynthModel config overrides, write_hf_dir form, linear_class, chat template, expected family)
FAMILIES = {  # keys: the directory names a download would have (the family guess also reads them)
    "Falcon3-1B-Instruct-1.58bit": ({"head_dim": 96}, "packed", "bitlinear", FALCON3_CHAT_TEMPLATE,
                                    "falcon3-1.58bit"),
    "Llama3-8B-1.58-100B-tokens": ({"head_dim": 64, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                                    "num_key_value_heads": 1}, "packed", "bitlinear", LLAMA3_CHAT_TEMPLATE,
                                   "llama3-1.58"),
    "Falcon-E-1B-Instruct": ({"head_dim": 64, "num_hidden_layers": 3}, "packed", "autobitlinear",
                             FALCON3_CHAT_TEMPLATE, "falcon-e"),
    "Falcon-E-1B-Base-bfloat16": ({"head_dim": 64}, "online", "autobitlinear", None, "falcon-e"),
    "TriLM_99M_Unpacked": ({"head_dim": 64}, "unpacked", "autobitlinear", None, "trilm"),
    "ternary-llama": ({"head_dim": 64, "vocab_size": 640}, "packed", "autobitlinear", None, "llama-ternary"),
}


def _synth(name, seed):
    cfg, form, lc, tmpl, _ = FAMILIES[name]
    m = SynthModel(cfg, seed=seed, style="llama")
    if tmpl:
        m.chat_template = tmpl
    return m, form, lc


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    reference_or_skip()
    root = tmp_path_factory.mktemp("families")
    out = {}
    for k, name in enumerate(FAMILIES):
        m, form, lc = _synth(name, 10 + k)
        d = str(root / name)
        write_hf_dir(m, d, form=form, linear_class=lc)
        store = convert(d, d + ".bnstore", lm_head="f16", progress=False)
        ref_dir = d
        if form == "unpacked":  # the BitLinear reference of the same ternary weights and scales
            ref_dir = write_hf_dir(m, d + "-bitlinear-ref", form="packed", linear_class="autobitlinear")
        out[name] = (m, d, store, load_reference(ref_dir))
    return out


def _ids(m, seed, n):
    return np.random.default_rng(seed).integers(0, m.V - 16, n).tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(families, name):
    m, _, store, ref = families[name]
    ids = _ids(m, 1, 70)
    ours = Model(Store(store), n_ctx=96, kv_dtype="f32", chunk=32).forward(ids)
    _check_close(ours, reference_logits(ref, ids), "f32")


def test_untied_int8_head_and_f16_cache(families):
    """The int8 LM head built from the untied bf16 lm_head, and the f16 KV cache."""
    m, d, _, ref = families["Falcon3-1B-Instruct-1.58bit"]
    store = convert(d, d + ".i8.bnstore", lm_head="i8", progress=False)
    ids = _ids(m, 4, 50)
    _check_close(Model(Store(store), n_ctx=64).forward(ids), reference_logits(ref, ids), "i8")


def test_untied_default_q4_head(families):
    """The default store of an untied family: the q4 head plus the lm_head's own f16 rows (output.rows), which
    its best candidates are rescored from; greedy tokens as transformers' up to near ties."""
    m, d, _, ref = families["Falcon3-1B-Instruct-1.58bit"]
    st = Store(convert(d, d + ".default.bnstore", progress=False))
    assert st.meta["lm_head"] == "q4" and "output.rows" in st.tensor_names
    ids = _ids(m, 2, 9)
    ref_ids, ref_steps = reference_greedy(ref, ids, 24)
    ours = our_greedy(Model(st, n_ctx=64, kv_dtype="f32"), ids, 24)
    assert_same_or_near_tie(ours, ref_ids, ref_steps, TOL["f32"][0])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(families, name):
    m, _, store, ref = families[name]
    ids = _ids(m, 2, 9)
    ref_ids, ref_steps = reference_greedy(ref, ids, 24)
    ours = our_greedy(Model(Store(store), n_ctx=64, kv_dtype="f32"), ids, 24)
    assert_same_or_near_tie(ours, ref_ids, ref_steps, TOL["f32"][0])


def test_store_records_the_description(families):
    for name, (m, _, store, _) in families.items():
        c = Store(store).config
        assert (c.sub_norms, c.tie_word_embeddings, c.hidden_act, c.head_dim) == (False, False, "silu", m.head_dim)
        assert Store(store).meta["family"] == FAMILIES[name][4] and c.rms_norm_eps == m.config["rms_norm_eps"]
        assert c.rope_theta == m.config["rope_theta"]
        assert not any("sub_norm" in t for t in Store(store).tensor_names)


def test_trilm_versus_float_activations(families, capsys):
    """TriLM's own model keeps activations in float; ours quantizes them to int8 per token: close, not equal."""
    import torch  # noqa: F401  (reference_or_skip ran in the fixture)

    m, d, store, _ = families["TriLM_99M_Unpacked"]
    float_ref = load_reference(d)  # plain LlamaForCausalLM on the fp16 ternary x scale weights
    ids = _ids(m, 3, 60)
    ours = Model(Store(store), n_ctx=64, kv_dtype="f32").forward(ids)
    ref = reference_logits(float_ref, ids)
    diff = np.abs(ours - ref)
    top1 = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    with capsys.disabled():
        print(f"\nTriLM synth: int8 activations vs float activations: max |diff| {diff.max():.3f}, "
              f"median {np.median(diff):.4f}, top-1 agreement {top1:.0%}")
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.99 and top1 >= 0.8


@pytest.mark.parametrize("name", ["Falcon3-1B-Instruct-1.58bit", "Llama3-8B-1.58-100B-tokens"])
def test_chat_template_matches_transformers(families, name):
    from transformers import AutoTokenizer

    m, d, store, _ = families[name]
    tok = AutoTokenizer.from_pretrained(d)
    llm = load_model(store, ctx=64, progress=False)
    msgs = [{"role": "system", "content": "You are a helpful AI assistant."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me a story"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    # transformers tokenizes without special tokens; llama-server (and chat_prompt) with them: the BOS
    # the tokenizer adds, where the template writes none
    bos = llm.tokenizer.text_bos
    want = [bos] + list(want) if bos is not None and list(want)[:1] != [bos] else want
    assert llm.chat_prompt(msgs) == list(want)
    assert llm.tokenizer.eos_ids[0] == tok.eos_token_id


def test_per_row_fakequant_scales():
    """A fake-quantized matrix with one magnitude per row block (e.g. per model-parallel shard) keeps every
    row's scale, through to the store's per-row scale vector; anything else is refused as not ternary."""
    from bitnet_cpu.engine.formats.convert import _fused
    from bitnet_cpu.engine.formats.sources import ternary_from_fakequant

    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, (8, 16)).astype(np.int8)
    t[3] = 0
    scales = np.repeat(np.array([0.5, 0.25], np.float32), 4)
    w, s = ternary_from_fakequant("x", "w", t * scales[:, None])
    np.testing.assert_array_equal(w, t)
    np.testing.assert_array_equal(s, np.where(np.arange(8) == 3, 1.0, scales))
    row_scales = s

    class Src:
        def linear(self, short, i):
            return t, (row_scales if short == "attn_q" else 2.0), [0]

    _, fused_scale, n, k = _fused(Src(), ("attn_q", "attn_k"), 0, {})
    assert (n, k) == (16, 16)
    np.testing.assert_array_equal(fused_scale[:16], np.concatenate([row_scales, np.full(8, 2.0, np.float32)]))
    w, s = ternary_from_fakequant("x", "w", t * np.float32(0.5))
    assert s == 0.5
    bad = t * scales[:, None]
    bad[0, 0] = 0.3
    with pytest.raises(FormatError, match="not ternary"):
        ternary_from_fakequant("x", "w", bad)


def test_non_ternary_checkpoint_is_refused(tmp_path):
    m = SynthModel({"head_dim": 64}, seed=3, style="llama")
    d = write_hf_dir(m, str(tmp_path / "plain-llama"), form="float")
    assert "--ternarize" in assert_conversion_refused(d, tmp_path, "not ternary")


def test_ternarize_latent_weights_without_quantization_config(tmp_path):
    """Falcon-E's bfloat16 revision (latent weights, plain Llama config): `bitnet convert --ternarize` gives
    the same store as the same weights declared quant_method bitnet / online (whose transformers parity the
    Falcon-E-1B-Base-bfloat16 case above checks)."""
    m = SynthModel({"head_dim": 64}, seed=5, style="llama")
    plain = write_hf_dir(m, str(tmp_path / "Falcon-E-1B-Base-plain"), form="float")
    online = write_hf_dir(m, str(tmp_path / "Falcon-E-1B-Base-online"), form="online")
    out = str(tmp_path / "t.bnstore")
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", "--ternarize", "--lm-head", "f16", "--no-progress",
                        plain, "-o", out], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    a, b = Store(out), Store(convert(online, str(tmp_path / "o.bnstore"), lm_head="f16", progress=False))
    assert sorted(a.tensor_names) == sorted(b.tensor_names)
    for n in a.tensor_names:
        assert np.array_equal(a.tensor(n), b.tensor(n)), n


def test_ternarize_where_it_does_nothing_is_refused(tmp_path):
    """--ternarize on a checkpoint that declares BitNet quantization (packed or online), or on a GGUF file, did
    nothing and said nothing: refused in one line."""
    from bitnet_cpu.engine.synth.writers import write_gguf_tq

    m = SynthModel({"head_dim": 64}, seed=5, style="llama")
    for form in ("packed", "online"):
        d = write_hf_dir(m, str(tmp_path / form), form=form)
        with pytest.raises(UnsupportedError, match="--ternarize is for latent float weights"):
            convert(d, str(tmp_path / f"{form}.bnstore"), ternarize=True, progress=False)
        convert(d, str(tmp_path / f"{form}.bnstore"), progress=False)   # without it: as before
    gguf = str(tmp_path / "m.gguf")
    write_gguf_tq(SynthModel(seed=5), gguf)
    with pytest.raises(UnsupportedError, match="not a single file"):
        convert(gguf, str(tmp_path / "g.bnstore"), ternarize=True, progress=False)


def test_unsupported_quantization_and_rope_refused(tmp_path):
    import json

    m = SynthModel({"head_dim": 64}, seed=3, style="llama")
    d = write_hf_dir(m, str(tmp_path / "q"), form="packed", linear_class="autobitlinear")
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    for edit, match in (({"quantization_config": {"quant_method": "gptq"}}, "not a ternary"),
                        ({"quantization_config": {"quant_method": "bitnet", "use_rms_norm": True}}, "use_rms_norm"),
                        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling")):
        json.dump({**cfg, **edit}, open(p, "w"))
        with pytest.raises(UnsupportedError, match=match):
            convert(d, str(tmp_path / "z.bnstore"), progress=False)


# ---- GGUF `llama` architecture --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """A Falcon3-shaped model whose ternary input dims are multiples of 256 (TQ blocks): HF dir (packed,
    autobitlinear: the f16-exact scale multiplies, like the GGUF block scale) and its store."""
    root = tmp_path_factory.mktemp("llama-gguf")
    m = SynthModel({"head_dim": 128}, seed=21, style="llama")
    m.chat_template = FALCON3_CHAT_TEMPLATE
    d = write_hf_dir(m, str(root / "hf"), form="packed", linear_class="autobitlinear")
    return root, m, convert(d, d + ".bnstore", lm_head="f16", progress=False)


@pytest.mark.parametrize("kind", ["TQ2_0", "TQ1_0", "I2_S"])
def test_llama_gguf_same_logits_as_hf_dir(llama_gguf, kind):
    root, m, hf_store = llama_gguf
    path = str(root / f"llama.{kind}.gguf")
    if kind == "I2_S":
        write_gguf_i2s(m, path, arch="llama", pre="llama-bpe", broken_template=False)
    else:
        write_gguf_tq(m, path, kind, arch="llama")
    store = convert(path, path + ".bnstore", lm_head="f16", progress=False)
    c = Store(store).config
    assert (c.arch, c.sub_norms, c.hidden_act, c.tie_word_embeddings) == ("llama", False, "silu", False)
    a, b = load_model(hf_store, ctx=64, progress=False), load_model(store, ctx=64, progress=False)
    ids = a.tokenize(TRAIN_TEXT[:160], add_bos=True)[:40]
    np.testing.assert_array_equal(a.forward(ids), b.forward(ids))
    assert our_greedy(a.model, ids, 16) == our_greedy(b.model, ids, 16)
    msgs = [{"role": "user", "content": "Hi"}]
    assert a.chat_prompt(msgs) == b.chat_prompt(msgs)


def test_llama_gguf_without_permutation_differs(llama_gguf):
    """The q/k un-permutation matters (guards against a no-op in both writer and reader)."""
    from bitnet_cpu.engine.synth.writers import llama_permute
    from bitnet_cpu.engine.formats.sources import _llama_unpermute

    w = np.arange(2 * 128 * 3).reshape(256, 3)
    p = llama_permute(w, 2)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(_llama_unpermute(p, 2), w)


def test_llama_cpp_agreement_llama_arch(llama_gguf, capsys):
    """Optional: llama.cpp itself on the TQ2_0 `llama` file (checks the q/k permutation convention against
    llama.cpp's interleaved RoPE). Tokenization must match; greedy agreement is reported."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional reference)")
    root, m, _ = llama_gguf
    path = str(root / "llama.TQ2_0.gguf")
    if not os.path.exists(path):
        write_gguf_tq(m, path, "TQ2_0", arch="llama")
    ours = load_model(convert(path, path + ".cpp.bnstore", lm_head="f16", progress=False), ctx=128, progress=False)
    try:
        ref = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=1, verbose=False, logits_all=True)
    except Exception as e:  # noqa: BLE001  a build without TQ types
        pytest.skip(f"llama.cpp cannot load the TQ2_0 file: {e}")
    ids = ours.tokenize(TRAIN_TEXT[:120], add_bos=True)
    assert ids == ref.tokenize(TRAIN_TEXT[:120].encode(), add_bos=True, special=True)
    ref.reset()
    ref.eval(ids)
    theirs = np.asarray(ref.scores[: len(ids)])
    top1 = float(np.mean(theirs.argmax(-1) == ours.forward(ids).argmax(-1)))
    with capsys.disabled():
        print(f"\nllama.cpp (llama arch, TQ2_0): teacher-forced top-1 agreement {top1:.0%} over {len(ids)} positions")
    assert top1 >= 0.8  # a wrong RoPE convention gives chance-level agreement


def test_inspect_names_family_and_runtime(families):
    m, d, store, _ = families["Falcon3-1B-Instruct-1.58bit"]
    for target in (d, store):
        out, runtime = bitnet_inspect(target)
        assert "family: Falcon3-{1,3,7,10}B(-Instruct)-1.58bit" in out
        assert "silu(gate) * up" in runtime and "no sub-norms" in runtime and "untied LM head" in runtime
        assert f"of {m.head_dim};" in runtime and "theta 1000042;" in runtime and "eps 1e-06" in runtime
