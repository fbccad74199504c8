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
