"""Sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds."""
import numpy as np
import pytest

from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.runtime.sampling import Sampler, SamplingParams


def logits_of(probs):
    return np.log(np.asarray(probs, np.float64)).astype(np.float32)


def draw(params, logits, n, history=()):
    s = Sampler(params, len(logits))
    return [s.sample(logits.copy(), list(history)) for _ in range(n)]


def test_greedy_is_argmax():
    lg = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert draw(SamplingParams(temperature=0), lg, 3) == [int(lg.argmax())] * 3


def test_same_seed_same_output_and_different_seed_differs():
    lg = np.zeros(50, np.float32)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a, b = draw(p, lg, 40), draw(p, lg, 40)
    assert a == b
    assert a != draw(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43), lg, 40)


def test_temperature_follows_softmax():
    probs = np.array([0.5, 0.3, 0.2])
    lg = logits_of(probs)
    n = 6000
    got = np.bincount(draw(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), lg, n), minlength=3) / n
    assert np.abs(got - probs).max() < 0.03
    # temperature 0.5 squares the odds
    sharp = probs ** 2 / (probs ** 2).sum()
    got = np.bincount(draw(SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=2), lg, n), minlength=3) / n
    assert np.abs(got - sharp).max() < 0.03


def test_top_k_top_p_min_p_filter():
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    lg = logits_of(probs)
    free = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    assert set(draw(SamplingParams(**{**free, "top_k": 2}), lg, 500)) == {0, 1}
    assert set(draw(SamplingParams(**{**free, "top_p": 0.65}), lg, 500)) == {0, 1}   # 0.4 + 0.3 >= 0.65
    assert set(draw(SamplingParams(**{**free, "top_p": 0.71}), lg, 500)) == {0, 1, 2}  # smallest set reaching p
    assert set(draw(SamplingParams(**{**free, "min_p": 0.45}), lg, 500)) == {0, 1, 2}  # >= 0.45 * 0.4
    assert set(draw(SamplingParams(**{**free, "min_p": 0.6}), lg, 500)) == {0, 1}
    assert set(draw(SamplingParams(**{**free, "top_k": 1}), lg, 50)) == {0}
    assert set(draw(SamplingParams(**free), lg, 3000)) == {0, 1, 2, 3, 4}


def test_repeat_penalty():
    lg = np.array([2.0, 1.9, -1.0, -1.05], np.float32)
    greedy = dict(temperature=0.0)
    assert draw(SamplingParams(**greedy), lg, 1) == [0]
    # token 0 was just used: 2.0 / 1.5 < 1.9
    assert draw(SamplingParams(**greedy, repeat_penalty=1.5), lg, 1, history=[0]) == [1]
    # negative logits get pushed down (multiplied)
    s = Sampler(SamplingParams(**greedy, repeat_penalty=2.0), 4)
    x = lg.copy()
    s._penalize(x, [2, 2, 3])
    np.testing.assert_allclose(x, [2.0, 1.9, -2.0, -2.1])
    # outside repeat_last_n: no effect
    assert draw(SamplingParams(**greedy, repeat_penalty=1.5, repeat_last_n=1), lg, 1, history=[0, 3]) == [0]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(min_p=2.0), dict(repeat_penalty=0.0)])
def test_bad_params(bad):
    with pytest.raises(BitNetError):
        SamplingParams(**bad).check()


FREE = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


def test_presence_frequency_follow_openai_formula():
    """logit[t] -= count[t] * frequency + (count[t] > 0) * presence, counting only generated tokens (the first
    call's history is the prompt): the logits the sampler leaves and the distribution it draws from."""
    lg = np.array([1.0, 0.5, 0.2, 0.0, -0.3], np.float32)
    prompt, gen = [3, 3, 4], [0, 0, 0, 1, 2, 0]
    counts = np.bincount(gen, minlength=5).astype(np.float32)
    pres, freq = 0.6, 0.35
    want = lg - counts * np.float32(freq) - (counts > 0) * np.float32(pres)
    s = Sampler(SamplingParams(**FREE, seed=5, presence_penalty=pres, frequency_penalty=freq), 5)
    s.sample(lg.copy(), prompt)                       # establishes the prompt: nothing generated yet
    for i in range(1, len(gen) + 1):                  # counted one step at a time, as the generator grows it
        x = lg.copy()
        s.sample(x, prompt + gen[:i])
    np.testing.assert_allclose(x, want, rtol=0, atol=1e-6)   # prompt tokens 3, 4 untouched
    n = 8000
    got = np.bincount([s.sample(lg.copy(), prompt + gen) for _ in range(n)], minlength=5) / n
    assert np.abs(got - softmax(want)).max() < 0.02
    # negative values encourage repetition (OpenAI allows [-2, 2])
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=-2.0), 5)
    s.sample(lg.copy(), prompt)
    assert s.sample(lg.copy(), prompt + [4]) == 4     # -0.3 + 2 > 1.0


def test_logit_bias_adds_and_bans_and_checks_vocab():
    lg = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    bias = {0: -100.0, 2: 1.5}
    want = softmax(lg + np.array([-100.0, 0.0, 1.5], np.float32))
    n = 6000
    got = np.bincount(draw(SamplingParams(**FREE, seed=9, logit_bias=bias), lg, n), minlength=3) / n
    assert got[0] == 0 and np.abs(got - want).max() < 0.02
    assert draw(SamplingParams(temperature=0, logit_bias={1: 100}), lg, 1) == [1]
    with pytest.raises(BitNetError, match="logit_bias 3: token id outside"):
        Sampler(SamplingParams(logit_bias={3: 1.0}), 3)
    with pytest.raises(BitNetError, match=r"logit_bias 1: 101"):
        SamplingParams(logit_bias={1: 101}).check()
    with pytest.raises(BitNetError, match="presence_penalty 2.5"):
        SamplingParams(presence_penalty=2.5).check()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_record_is_log_softmax_after_bias_and_penalties(temperature):
    rng = np.random.default_rng(4)
    lg = rng.standard_normal(300).astype(np.float32) * 3
    p = SamplingParams(temperature=temperature, seed=1, logit_bias={7: 4.0}, presence_penalty=1.0, record_logprobs=5)
    s = Sampler(p, 300)
    s.sample(lg.copy(), [1])
    tok = s.sample(lg.copy(), [1, 9])
    seen = lg.astype(np.float64)
    seen[7] += 4.0
    seen[9] -= 1.0
    ref = seen - seen.max() - np.log(np.exp(seen - seen.max()).sum())
    assert abs(s.record.logprob - ref[tok]) < 1e-5
    assert [i for i, _ in s.record.top] == list(np.argsort(-ref, kind="stable")[:5])
    np.testing.assert_allclose([v for _, v in s.record.top], np.sort(ref)[::-1][:5], atol=1e-5)
    assert Sampler(SamplingParams(), 300).record is None   # off unless asked
