"""Request-level sampling through every engine path (LLM.generate with and without prompt lookup, the batching
engine with and without it): a seed with penalties and logit_bias gives the same tokens everywhere; the
recorded logprobs are the log-softmax of the model's own logits (Model.forward) for the same tokens; n choices
of one prompt (Engine.submit_n) run one prefill, share its pages and equal n separate requests seeded seed + i."""
import numpy as np
import pytest

from bitnet_cpu.engine.api import SamplingParams, load_model
from bitnet_cpu.engine.batching.kv_pool import PAGE_TOKENS
from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.runtime.speculative import LookupParams
from test_model_fixtures import make_synth, running_engine


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("paths"), seed=11, lm_heads=("f16", "q4"))


def _tokens(chunks):
    return [c.token for c in chunks if c.token is not None]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


RICH = SamplingParams(temperature=1.1, top_k=0, top_p=1.0, min_p=0.0, seed=21, presence_penalty=0.7,
                      frequency_penalty=0.4, logit_bias={3: 2.0, 4: -100.0})


def test_seed_and_penalties_hold_on_every_path(synth):
    m, _, stores = synth
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]   # repetitive: lookup drafts get proposed
    llm = load_model(stores["f16"], ctx=256, progress=False)
    try:
        alone = _tokens(llm.generate(prompt, RICH, max_tokens=48, lookup=LookupParams(draft_max=0)))
        looked = _tokens(llm.generate(prompt, RICH, max_tokens=48, lookup=LookupParams(draft_max=4, ngram_min=1)))
        other = _tokens(llm.generate(prompt, SamplingParams(**{**RICH.__dict__, "seed": 22}), max_tokens=48,
                                     lookup=LookupParams(draft_max=0)))
    finally:
        llm.close()
    assert alone == looked and len(alone) == 48 and 4 not in alone
    assert other != alone
    for lookup in (None, LookupParams(draft_max=4, ngram_min=1)):
        with running_engine(stores["f16"], ctx=256, parallel=4, lookup=lookup) as eng:
            busy = [eng.submit([9, 10, 11], RICH, max_tokens=30) for _ in range(2)]   # others in the same steps
            assert _tokens(eng.submit(prompt, RICH, max_tokens=48)) == alone, lookup
            for b in busy:
                list(b)


@pytest.mark.parametrize("head", ["f16", "q4"])
def test_logprobs_are_log_softmax_of_forward_logits(synth, head):
    """What the sampler saw is what Model.forward computes for prompt + generated tokens (no bias or penalty
    here; ignore_eos masks the end-of-text tokens to -inf, so they take no share): every recorded logprob and
    top-5 list, through generate() and through the batching engine."""
    m, _, stores = synth
    prompt = [1, 17, 23, 99, 4]
    p = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=5, record_logprobs=5)
    llm = load_model(stores[head], ctx=128, progress=False)
    try:
        chunks = [c for c in llm.generate(prompt, p, max_tokens=12, ignore_eos=True) if c.token is not None]
        toks = [c.token for c in chunks]
        logits = llm.forward(prompt + toks[:-1])[len(prompt) - 1:].astype(np.float64)
        logits[:, llm.tokenizer.eos_ids] = -np.inf
        ref = _log_softmax(logits)
    finally:
        llm.close()
    with running_engine(stores[head], ctx=128, parallel=2) as eng:
        batched = [c for c in eng.submit(prompt, p, max_tokens=12, ignore_eos=True) if c.token is not None]
    assert [c.token for c in batched] == toks
    for run in (chunks, batched):
        for j, c in enumerate(run):
            assert abs(c.logprob.logprob - ref[j, c.token]) < 1e-4
            ids = [i for i, _ in c.logprob.top]
            assert ids == list(np.argsort(-ref[j], kind="stable")[:5])
            np.testing.assert_allclose([v for _, v in c.logprob.top], ref[j, ids], atol=1e-4)
    assert all(c.logprob is None for c in load_model(stores["f16"], ctx=64, progress=False).generate(prompt, max_tokens=3))


@pytest.mark.parametrize("prompt_len", [PAGE_TOKENS * 2 + 5, PAGE_TOKENS * 2])   # a shared partial page, or none
def test_n_choices_share_one_prefill(synth, prompt_len):
    m, _, stores = synth
    prompt = np.random.default_rng(prompt_len).integers(1, m.V, prompt_len).tolist()
    hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    with running_engine(stores["f16"], ctx=256, parallel=8) as eng:
        alone = [_tokens(eng.submit(prompt, SamplingParams(**{**hot.__dict__, "seed": 3 + i}), max_tokens=24,
                                    ignore_eos=True)) for i in range(4)]
        greedy_alone = _tokens(eng.submit(prompt, SamplingParams(temperature=0), max_tokens=24))
        eng.clear_prefix_cache()
        before = eng.metrics()["prefill_tokens_total"]
        streams = eng.submit_n(prompt, hot, 4, max_tokens=24, ignore_eos=True)
        outs = [list(s) for s in streams]
        assert eng.metrics()["prefill_tokens_total"] - before == prompt_len   # one prefill for four choices
        assert [_tokens(o) for o in outs] == alone                              # choice i: seed + i
        assert len({tuple(a) for a in alone}) == 4
        assert all(o[-1].stats.n_prompt == prompt_len for o in outs)
        greedy = [_tokens(list(s)) for s in eng.submit_n(prompt, SamplingParams(temperature=0), 4, max_tokens=24)]
        assert greedy == [greedy_alone] * 4
        eng.check_consistency()
        eng.clear_prefix_cache()
        assert eng.metrics()["kv_pages_used"] == 0 and eng.metrics()["kv_pages_reserved"] == 0


def test_n_choices_cancel_zero_tokens_and_limits(synth):
    m, _, stores = synth
    with running_engine(stores["f16"], ctx=256, parallel=4) as eng:
        zero = [list(s) for s in eng.submit_n([5, 6, 7], None, 3, max_tokens=0)]
        assert [o[-1].finish_reason for o in zero] == ["length"] * 3
        streams = eng.submit_n(list(range(1, 200)), None, 3, max_tokens=50)
        streams[0].cancel()   # the choice that prefills, maybe before it has: the others end too, never hang
        outs = [list(s) for s in streams]
        assert outs[0][-1].finish_reason == "cancelled" and all(o[-1].finish_reason for o in outs)
        with pytest.raises(BitNetError, match="n 5: must be in 1..4"):
            eng.submit_n([5], None, 5)
        with pytest.raises(BitNetError, match="logit_bias 999999: token id outside"):
            eng.submit([5], SamplingParams(logit_bias={999999: 1.0}))
        eng.check_consistency()
        eng.clear_prefix_cache()
        assert eng.metrics()["kv_pages_used"] == 0 and eng.metrics()["kv_pages_reserved"] == 0


def test_n_choices_each_keep_their_own_constraint():
    """n choices under one JSON Schema (the bundled model): each is valid and equals the same request alone
    seeded seed + i, so a fork's matcher starts where the shared prompt left it, independent of the others."""
    import json

    import jsonschema

    from bitnet_cpu.engine.api import Constraint
    schema = {"type": "object", "additionalProperties": False, "required": ["tags"],
              "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": {"type": "string", "maxLength": 6}}}}
    c = Constraint.json_schema(schema)
    with running_engine(None, parallel=4) as eng:
        ids = eng.chat_prompt([{"role": "user", "content": "Tags for a cat"}])
        hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=40)
        outs = [list(s) for s in eng.submit_n(ids, hot, 3, max_tokens=120, constraint=c)]
        for i, o in enumerate(outs):
            jsonschema.validate(json.loads("".join(ch.text for ch in o)), schema)
            alone = list(eng.submit(ids, SamplingParams(**{**hot.__dict__, "seed": 40 + i}), max_tokens=120, constraint=c))
            assert _tokens(o) == _tokens(alone), i
        eng.check_consistency()
