"""A fault inside the batched forward pass ends only the sequence that causes it. The fault is real: the engine's
test hook (BITNET_FAULT_TOKEN, engine/batching/batch_model.py) hands the attention kernel of the last layer an
out-of-range page for a sequence holding that token, so the kernel's own boundary check raises, after the earlier
layers have written every sequence's K/V. The step then runs again in halves until the culprit fails alone: its
stream ends with finish_reason "error", every other sequence's tokens are those of a run without it, and every
page comes back."""
import numpy as np
import pytest

from bitnet_cpu.engine.api import SamplingParams, load_engine
from test_model_fixtures import make_synth

GREEDY = SamplingParams(temperature=0.0)
N_TOKENS = 24


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("faults"), seed=11)


def _tokens(chunks):
    return [c.token for c in chunks if c.token is not None]


def _run(eng, requests):
    """Submit every (prompt, max_tokens) between two scheduler steps (so the first step holds them all), and
    collect each stream's chunks."""
    streams = eng.run_in_scheduler(lambda: [eng.submit(p, GREEDY, max_tokens=n) for p, n in requests])
    return [list(s) for s in streams]


def _all_pages_back(eng):
    eng.check_consistency()
    eng.clear_prefix_cache()
    m = eng.metrics()
    assert m["kv_pages_used"] == 0 and m["kv_pages_reserved"] == 0 and m["running"] == m["waiting"] == 0


@pytest.mark.parametrize("kv_dtype", ["f16", "q8"])
def test_forward_fault_ends_only_its_sequence(synth, kv_dtype, monkeypatch, capsys):
    m, _, stores = synth
    rng = np.random.default_rng(5)
    healthy = [rng.integers(1, m.V, int(rng.integers(4, 30))).tolist() for _ in range(5)]
    candidates = [rng.integers(1, m.V, 20).tolist() for _ in range(6)]   # one will fault while decoding
    # a run without any fault: the healthy answers, and what the candidates say
    monkeypatch.delenv("BITNET_FAULT_TOKEN", raising=False)
    eng = load_engine(stores["f16"], ctx=256, parallel=12, kv_dtype=kv_dtype, progress=False)
    try:
        ref = [_tokens(c) for c in _run(eng, [(p, N_TOKENS) for p in healthy + candidates])]
    finally:
        eng.close()
    clean = {t for p, out in zip(healthy, ref) for t in p + out}
    # the fault token: one a candidate generates as its 6th token or later, for the first time, and seen nowhere
    # in the healthy sequences
    decoder, said, k = next((p, out, i) for p, out in zip(candidates, ref[5:]) for i in range(5, N_TOKENS - 4)
                            if out[i] not in clean and out[i] not in p + out[:i])
    fault = said[k]
    monkeypatch.setenv("BITNET_FAULT_TOKEN", str(fault))
    eng = load_engine(stores["f16"], ctx=256, parallel=8, kv_dtype=kv_dtype, progress=False)
    try:
        # healthy, a prompt holding the token (fails in its prefill, beside the others' prefill chunks), the
        # decoder (fails in the step after it samples the token, beside the others' decode rows), healthy again
        requests = [(p, N_TOKENS) for p in healthy[:3]] + [(healthy[0][:3] + [fault] + healthy[1], N_TOKENS),
                                                           (decoder, N_TOKENS)] + [(p, N_TOKENS) for p in healthy[3:]]
        out = _run(eng, requests)
        got = [_tokens(c) for c in out]
        assert got[:3] + got[5:] == ref[:5]
        for c in out[:3] + out[5:]:
            assert c[-1].finish_reason in ("length", "eos")
        assert out[3][-1].finish_reason == "error" and got[3] == []
        assert out[4][-1].finish_reason == "error" and got[4] == said[: k + 1]   # streamed up to the token, no more
        met = eng.metrics()
        assert met["sequence_errors_total"] == 2
        assert met["steps_split_total"] >= 2   # each fault came from a step with other sequences in it
        err = capsys.readouterr().err
        assert err.count("failed in its forward pass (KernelError: simd._ops.attention_paged") == 2, err
        _all_pages_back(eng)
        # the engine goes on: the same requests again, without the faulty ones, give the same answers
        assert [_tokens(c) for c in _run(eng, [(p, N_TOKENS) for p in healthy])] == ref[:5]
        _all_pages_back(eng)
    finally:
        eng.close()


def test_fault_in_a_prompt_shared_by_n_choices_ends_them_all(synth, monkeypatch):
    """n choices share one prefill: a fault there ends every choice of that request, and nothing else."""
    m, _, stores = synth
    monkeypatch.setenv("BITNET_FAULT_TOKEN", "7")
    eng = load_engine(stores["f16"], ctx=256, parallel=8, progress=False)
    try:
        alone = _tokens(_run(eng, [([1, 2, 3, 4, 5], 8)])[0])
        assert 7 not in alone   # the healthy request never meets the fault token
        ok = eng.submit([1, 2, 3, 4, 5], GREEDY, max_tokens=8)
        forks = eng.submit_n([9, 8, 7, 6], SamplingParams(temperature=0.8, seed=1), 3, max_tokens=8)
        assert [list(f)[-1].finish_reason for f in forks] == ["error"] * 3
        assert _tokens(list(ok)) == alone
        _all_pages_back(eng)
    finally:
        eng.close()
