"""Parity with Hugging Face transformers' BitNetForCausalLM (float32) on random checkpoints in the 2B-4T
HF layout (engine/synth.py), converted to our store.

Logit tolerance, and why it is not ~1e-6: our f32 reductions (RMSNorm's mean of squares, attention dot
products and softmax) round differently from torch's in the last bit. Usually that changes nothing and
the logits come out bit-identical, but when a value lands on a .5 boundary of the per-token int8
activation quantization, one code flips by 1; that moves the BitLinear's output by ~scale/127 and the
squared ReLU and later layers amplify it. On these random models (logits ~ +-8) we measured max |diff|
0.20 with an f32 KV cache and 0.32 with the default f16 cache or the int8 LM head (median 0.01-0.04).
Hence: max |diff| <= 0.35 (f32 KV) / 0.45 (f16 KV, int8 head), median <= 0.03 / 0.06, and wherever the
top-1 token differs the reference's own margin between the two tokens must be below that tolerance
(a near tie), never a clear disagreement. Greedy continuations must be identical, or diverge only at such
a near tie.
"""
import numpy as np
import pytest

from bitnet_cpu.engine.api import load_model
from bitnet_cpu.engine.runtime.model import Model
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.synth import TRAIN_TEXT
from test_model_fixtures import load_reference, make_synth, our_greedy, reference_greedy, reference_logits, reference_or_skip, assert_same_or_near_tie

pytestmark = pytest.mark.reference

SEEDS = [0, 1, 2, 3]
TOL = {"f32": (0.35, 0.03), "f16": (0.45, 0.06), "i8": (0.45, 0.06)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    reference_or_skip()
    root = tmp_path_factory.mktemp("parity")
    out = {}
    for seed in SEEDS:
        m, hf_dir, stores = make_synth(root, seed, lm_heads=("f16", "i8", "q4"), num_hidden_layers=2 + seed % 2)
        out[seed] = (m, hf_dir, stores, load_reference(hf_dir))
    return out


def _prompt(m, seed, n):
    """n prompt ids: real text through our tokenizer for the first part, random ids after."""
    llm_ids = load_model_ids(m, seed)
    rnd = np.random.default_rng(seed * 100 + n).integers(0, m.V - 16, n).tolist()
    return (llm_ids + rnd)[:n]


_TEXT_IDS = {}


def load_model_ids(m, seed):
    if seed not in _TEXT_IDS:
        from bitnet_cpu.engine.formats.tokenizer import Tokenizer

        info = m.tokenizer_info()
        tok = Tokenizer("hf_json", m.tokenizer_json().encode(), bos_id=info["bos"])
        _TEXT_IDS[seed] = tok.encode(TRAIN_TEXT[seed * 40:], add_bos=True)
    return _TEXT_IDS[seed]


def _check_close(ours, ref, kind):
    tol_max, tol_med = TOL[kind]
    d = np.abs(ours - ref)
    assert np.isfinite(ours).all()
    assert d.max() <= tol_max and np.median(d) <= tol_med, f"max {d.max():.4f} median {np.median(d):.5f} ({kind})"
    for r in np.nonzero(ours.argmax(-1) != ref.argmax(-1))[0]:
        a, b = ref[r].argmax(), ours[r].argmax()
        assert ref[r, a] - ref[r, b] <= tol_max, f"row {r}: top-1 differs with reference margin {ref[r, a] - ref[r, b]:.3f}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kv,head", [("f32", "f16"), ("f16", "f16"), ("f32", "i8")])
def test_logits_close(models, seed, kv, head):
    m, _, stores, ref_model = models[seed]
    ids = _prompt(m, seed, 90)
    ref = reference_logits(ref_model, ids)
    ours = Model(Store(stores[head]), n_ctx=128, kv_dtype=kv, chunk=32).forward(ids)  # 90 = 32 + 32 + 26
    _check_close(ours, ref, "i8" if head == "i8" else kv)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n_prompt", [1, 7, 40])
def test_greedy_continuation(models, seed, n_prompt):
    """32 greedy tokens: prefill of the prompt (GEMM path) then 32 decode steps (GEMV path) on both sides."""
    m, _, stores, ref_model = models[seed]
    ids = _prompt(m, seed, n_prompt)
    ref_ids, ref_steps = reference_greedy(ref_model, ids, 32)
    ours = our_greedy(Model(Store(stores["f16"]), n_ctx=128, kv_dtype="f32"), ids, 32)
    assert_same_or_near_tie(ours, ref_ids, ref_steps, TOL["f32"][0])


@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_default_f16_cache(models, seed):
    """The default f16 KV cache rounds keys/values (transformers keeps f32), so a run may part from the
    reference earlier, but again only at a near tie."""
    m, _, stores, ref_model = models[seed]
    ids = _prompt(m, seed, 12)
    ref_ids, ref_steps = reference_greedy(ref_model, ids, 32)
    ours = our_greedy(Model(Store(stores["f16"]), n_ctx=128), ids, 32)
    assert_same_or_near_tie(ours, ref_ids, ref_steps, TOL["f16"][0])


@pytest.mark.parametrize("seed", SEEDS)
def test_default_q4_head_greedy_and_rescored_logits(models, seed):
    """The default head (q4, its best RESCORE_K candidates rescored from the f16 embedding): with the default
    f16 cache, greedy tokens as the reference's up to near ties; step by step with an f32 cache, the reference's
    top-1 is always a candidate and every candidate's logit is within the f32 tolerance of the reference's."""
    m, _, stores, ref_model = models[seed]
    ids = _prompt(m, seed, 12)
    ref_ids, ref_steps = reference_greedy(ref_model, ids, 32)
    ours = our_greedy(Model(Store(stores["q4"]), n_ctx=128), ids, 32)
    assert_same_or_near_tie(ours, ref_ids, ref_steps, TOL["f16"][0])
    ids = _prompt(m, seed, 40)
    ref = reference_logits(ref_model, ids)
    model = Model(Store(stores["q4"]), n_ctx=64, kv_dtype="f32")
    for i, t in enumerate(ids):
        lg = model.decode(t)
        cand = model._resc_idx[0]
        assert ref[i].argmax() in cand
        assert np.abs(lg[cand] - ref[i, cand]).max() <= TOL["f32"][0]


def test_tokenizer_and_chat_template_match(models):
    from transformers import AutoTokenizer

    m, hf_dir, stores, _ = models[0]
    ref = AutoTokenizer.from_pretrained(hf_dir)
    llm = load_model(stores["f16"], ctx=64, progress=False)
    texts = [TRAIN_TEXT, "Hello world", "  leading spaces and\ttabs\n\nnewlines", "Café 日本語 🙂 naïve",
             "<|eot_id|>User: hi<|end_of_text|>", "3.14159 + 2024 = x", ""]
    for t in texts:
        assert llm.tokenize(t, add_bos=True) == ref(t)["input_ids"], t
        assert llm.tokenize(t) == ref(t, add_special_tokens=False)["input_ids"], t
        assert llm.detokenize(llm.tokenize(t)) == t
    msgs = [{"role": "system", "content": "You are a helpful AI assistant."}, {"role": "user", "content": "How are you?"},
            {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Tell me a story"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert llm.chat_prompt(msgs) == list(want)
    assert set(llm.tokenizer.eos_ids) >= {m.tokenizer_info()["eos"], m.tokenizer_info()["eot"]}


@pytest.mark.parametrize("form,linear_class", [("online", "autobitlinear"), ("packed", "bitlinear")])
def test_other_checkpoint_forms(tmp_path, form, linear_class):
    """The 2B-4T-bf16 form (full-precision weights ternarized at load) and the legacy dividing BitLinear."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    m = SynthModel(small_config(num_hidden_layers=2), seed=4)
    d = str(tmp_path / f"{form}-{linear_class}")
    write_hf_dir(m, d, form=form, linear_class=linear_class)
    ref_model = load_reference(d)
    store = convert(d, d + ".bnstore", lm_head="f16", progress=False)
    ids = _prompt(m, 4, 60)
    _check_close(Model(Store(store), n_ctx=64, kv_dtype="f32").forward(ids), reference_logits(ref_model, ids), "f32")
