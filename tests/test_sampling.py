"""Sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds; llama.cpp's top-n-sigma,
typical, XTC, dynamic temperature and Mirostat against their definitions."""
import math
import warnings

import numpy as np
import pytest

from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.runtime.sampling import Sampler, SamplingParams


def logits_of(probs):
    return np.log(np.asarray(probs, np.float64)).astype(np.float32)


def draw(params, logits, n, history=()):
    s = Sampler(params, len(logits))
    return [s.sample(logits.copy(), list(history)) for _ in range(n)]


def test_every_token_excluded_is_said_so_not_blamed_on_the_weights():
    """-inf everywhere is a grammar's mask with ignore_eos's ban, not corrupt weights (NaN or +inf still are)."""
    with pytest.raises(BitNetError) as e:
        draw(SamplingParams(temperature=0), np.full(50, -np.inf, np.float32), 1)
    assert "no token is allowed here" in str(e.value) and "corrupt" not in str(e.value)
    for bad in (np.nan, np.inf):
        lg = np.zeros(50, np.float32)
        lg[3] = bad
        with pytest.raises(BitNetError, match="corrupt"):
            draw(SamplingParams(temperature=0), lg, 1)


@pytest.mark.parametrize("chain", [dict(temperature=0), dict(temperature=0.8), dict(temperature=0.8, top_k=0),
                                   dict(temperature=0.8, mirostat=1), dict(temperature=0.8, mirostat=2)])
def test_a_bias_that_bans_every_allowed_token_is_the_same_refusal(chain):
    """A -inf logit_bias on every token, or on every token a mask (a grammar's) leaves, excludes every token as a
    mask alone does: the same refusal, checked after the bias, never a banned token drawn with NaN logprobs (and no
    numpy warnings on the way)."""
    lg = np.random.default_rng(1).standard_normal(50).astype(np.float32)
    masked = lg.copy()
    masked[:45] = -np.inf   # a grammar's mask leaves tokens 45..49
    for logits, banned in ((lg, range(50)), (masked, range(45, 50))):
        params = SamplingParams(**chain, logit_bias={i: -np.inf for i in banned}, record_logprobs=2, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(BitNetError, match="no token is allowed here"):
                draw(params, logits, 1)
    # one token left unbanned is drawn, every time
    params = SamplingParams(**chain, logit_bias={i: -np.inf for i in range(49)}, record_logprobs=2, seed=0)
    s = Sampler(params, 50)
    assert [s.sample(lg.copy()) for _ in range(5)] == [49] * 5 and s.record.logprob == 0.0


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
    # -1: the whole history (llama.cpp's and ollama's), as a window longer than it; -2 is refused
    long_ago = [0] + [3] * 200
    assert draw(SamplingParams(**greedy, repeat_penalty=1.5, repeat_last_n=-1), lg, 1, history=long_ago) == \
        draw(SamplingParams(**greedy, repeat_penalty=1.5, repeat_last_n=1000), lg, 1, history=long_ago) == [1]
    with pytest.raises(BitNetError, match="repeat_last_n -2"):
        SamplingParams(repeat_last_n=-2).check()


@pytest.mark.parametrize("penalty", [1e-38, 1e-300, 5e-324, 1e300, 1.7976931348623157e308])
def test_an_extreme_repeat_penalty_keeps_the_logits_finite(penalty):
    """Any penalty the rule takes (> 0, finite) gives finite logits: a float32 overflow (a positive logit over a tiny
    penalty, 0 times a penalty past float32) saturates instead of failing the request as corrupt weights, with no
    numpy warnings. A masked token stays masked, and a NaN logit is still the weights' fault."""
    lg = np.array([20.0, 0.0, -1.0, -np.inf, 1.5], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = Sampler(SamplingParams(temperature=0, repeat_penalty=penalty), 5)
        x = lg.copy()
        s._penalize(x, [0, 1, 2, 3])
        assert np.isfinite(x[[0, 1, 2, 4]]).all() and x[3] == -np.inf
        assert x[1] == 0 and x[0] >= 0 >= x[2]   # the rule: positive shrinks (to 0 at worst), negative falls
        tok = draw(SamplingParams(temperature=0, repeat_penalty=penalty), lg, 1, history=[0, 1, 2, 3])[0]
        assert tok == (0 if penalty < 1 else 4)   # a tiny penalty favours the repeat; a huge one the fresh token
        draw(SamplingParams(temperature=1, top_k=0, seed=1, repeat_penalty=penalty, record_logprobs=2), lg, 2,
             history=[0, 1, 2])
    bad = lg.copy()
    bad[0] = np.nan
    with pytest.raises(BitNetError, match="corrupt"):
        draw(SamplingParams(temperature=0, repeat_penalty=penalty), bad, 1, history=[0])


def test_a_huge_top_n_sigma_keeps_every_token_without_warnings():
    """top_n_sigma far past float32 (1e300) keeps every finite logit, as a large one does, with no numpy warning of
    an overflowing cast on each step."""
    lg = np.random.default_rng(2).standard_normal(50).astype(np.float32)
    lg[7] = -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = Sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, top_n_sigma=1e300), 50)
        kept = set(int(t) for t in s.candidates(lg.copy())[0])
    assert kept == set(range(50)) - {7}


def test_a_dry_breaker_that_is_not_text_is_one_error_naming_it():
    """A breaker holding a lone UTF-16 surrogate is refused by the settings check, naming the breaker, as a prompt
    is (it was a raw UnicodeEncodeError from the breaker table at the call)."""
    with pytest.raises(BitNetError, match=r"dry_sequence_breakers\[1\]: a lone UTF-16 surrogate \(\\ud83d at "
                                          r"character 2\) is not text"):
        SamplingParams(dry_multiplier=1, dry_sequence_breakers=["\n", "x\ud83d"]).check()
    assert SamplingParams(dry_multiplier=1, dry_sequence_breakers=["\U0001f600"]).check()


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=-0.1), dict(top_p=1.5),
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


@pytest.mark.parametrize("last_n", [4, -1, 0])
def test_presence_frequency_count_the_prompt_under_llama_cpps_rule(last_n):
    """penalize_prompt (llama-server's /completion, ollama): the counts are those of the last repeat_last_n tokens,
    prompt included (-1: all of them, 0: none), as llama.cpp's penalties sampler; repeat_penalty off here."""
    lg = np.array([1.0, 0.5, 0.2, 0.0, -0.3], np.float32)
    prompt, gen = [3, 3, 4, 4, 4], [0, 1, 0]
    pres, freq = 0.6, 0.35
    s = Sampler(SamplingParams(**FREE, presence_penalty=pres, frequency_penalty=freq, repeat_last_n=last_n,
                               penalize_prompt=True), 5)
    for i in range(len(gen) + 1):
        x = lg.copy()
        seq = prompt + gen[:i]
        s.sample(x, seq)
        window = [] if last_n == 0 else seq if last_n < 0 else seq[-last_n:]
        counts = np.bincount(window, minlength=5).astype(np.float32)
        np.testing.assert_allclose(x, lg - counts * np.float32(freq) - (counts > 0) * np.float32(pres),
                                   rtol=0, atol=1e-6)


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
    # -inf is "never" (llama-server's false): even a token 150 logits ahead, where -100 leaves it the best
    far = np.array([150.0, 0.0, 0.0], np.float32)
    assert draw(SamplingParams(temperature=0, logit_bias={0: -100.0}), far, 1) == [0]
    for params in (SamplingParams(temperature=0, logit_bias={0: -np.inf}),
                   SamplingParams(**FREE, seed=1, logit_bias={0: float("-inf")})):
        assert 0 not in draw(params, far, 200)
    with pytest.raises(BitNetError, match=r"logit_bias 1: inf"):
        SamplingParams(logit_bias={1: float("inf")}).check()
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


# ---- llama.cpp's other samplers: each kept set against its definition, written here ------------------------------
OFF = FREE   # top-k, top-p and min-p off, temperature 1: only the sampler under test filters


def ref_chain(lg, top_n_sigma=-1.0, top_k=0, typical_p=1.0, top_p=1.0, min_p=0.0, min_keep=0):
    """llama.cpp's chain on candidate lists (llama-sampler.cpp): top-n-sigma over every logit, top-k, typical
    (sorted by |surprise - entropy|, kept while the running sum has not passed p), top-p, min-p; each on the
    softmax of what the ones before kept, and typical, top-p and min-p keeping at least min_keep. Returns the
    kept ids as a set."""
    lg = np.asarray(lg, np.float64)
    ids = np.arange(len(lg))
    if top_n_sigma > 0:
        ids = ids[lg[ids] >= lg.max() - top_n_sigma * lg.std()]
    ids = ids[np.argsort(-lg[ids], kind="stable")]
    if top_k > 0:
        ids = ids[:top_k]
    if typical_p < 1:
        pr = softmax(lg[ids])
        ent = -(pr * np.log(pr)).sum()
        order = np.argsort(np.abs(-np.log(pr) - ent), kind="stable")
        cum, kept = 0.0, []
        for j in order:
            cum += pr[j]
            kept.append(ids[j])
            if cum > typical_p and len(kept) >= min_keep:
                break
        ids = np.array(sorted(kept, key=lambda t: -lg[t]))
    if top_p < 1:
        pr, cum, n = softmax(lg[ids]), 0.0, 0
        for q in pr:
            cum += q
            n += 1
            if cum >= top_p and n >= min_keep:
                break
        ids = ids[:n]
    if min_p > 0:
        pr = softmax(lg[ids])
        ids = ids[(pr >= min_p * pr.max()) | (np.arange(len(ids)) < min_keep)]
    return set(int(t) for t in ids)


@pytest.mark.parametrize("chain", [
    dict(typical_p=0.3), dict(typical_p=0.9), dict(typical_p=0.0), dict(top_n_sigma=1.0), dict(top_n_sigma=2.5),
    dict(top_n_sigma=2.0, top_k=50, typical_p=0.5, top_p=0.8, min_p=0.02),
    dict(typical_p=0.6, min_p=0.1), dict(top_k=40, typical_p=0.95, top_p=0.95, min_p=0.05),
    # top-k off: top-p before min-p, on the whole vocabulary's probabilities
    dict(top_p=0.6, min_p=0.05), dict(top_p=0.3, min_p=0.01), dict(top_n_sigma=2.0, top_p=0.5, min_p=0.02),
    dict(top_p=0.0), dict(top_p=0.0, min_p=0.1),
    # min_keep: each truncating sampler keeps at least that many (it was not read at all)
    dict(typical_p=0.0, min_keep=7), dict(top_p=0.01, min_keep=5), dict(min_p=0.99, min_keep=4),
    dict(top_k=40, top_p=0.05, min_p=0.5, min_keep=9), dict(top_p=0.3, min_p=0.2, min_keep=3),
])
def test_kept_tokens_follow_llama_cpps_chain(chain):
    for seed in range(5):
        lg = (np.random.default_rng(seed).standard_normal(2000) * 2.5).astype(np.float32)
        s = Sampler(SamplingParams(**{**OFF, **chain}), len(lg))
        cand, vals = s.candidates(lg.copy())
        assert set(cand.tolist()) == ref_chain(lg, **chain), (chain, seed)
        assert list(vals) == sorted(vals, reverse=True)   # most likely first
        # every draw comes from the kept set
        assert set(draw(SamplingParams(**{**OFF, **chain}, seed=seed), lg, 50)) <= set(cand.tolist())


def test_top_p_sees_every_token_when_top_k_is_off():
    """One token at 0.30, twenty at 0.02 and a tail of 0.30 spread thin: top-p 0.59 keeps the first and fifteen of
    the twenty (0.30 + 15 x 0.02 = 0.60), and min-p 0.05 (of 0.30: 0.015) keeps those; a top-p over what min-p
    alone would keep (the first and the twenty: 0.70 in all) stops after six of them."""
    probs = np.array([0.30] + [0.02] * 20 + [0.30 / 3000] * 3000)
    lg = np.log(probs).astype(np.float32)
    for top_k in (0, len(lg)):
        s = Sampler(SamplingParams(**{**OFF, "top_k": top_k, "top_p": 0.59, "min_p": 0.05}), len(lg))
        cand, _ = s.candidates(lg.copy())
        assert len(cand) == 16 and ref_chain(lg, top_p=0.59, min_p=0.05) == set(cand.tolist()), top_k


def test_xtc_drops_every_top_choice_but_the_least_likely():
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    lg = logits_of(probs)
    on = Sampler(SamplingParams(**OFF, xtc_probability=1.0, xtc_threshold=0.12), len(lg))
    assert on.candidates(lg.copy())[0].tolist() == [2, 3, 4, 5]   # 0.4, 0.25 go; 0.15 (the last above) stays
    for off in (dict(xtc_probability=0.0), dict(xtc_probability=1.0, xtc_threshold=0.6),   # > 0.5: off
                dict(xtc_probability=1.0, xtc_threshold=0.3)):   # one token above: nothing goes
        s = Sampler(SamplingParams(**OFF, **off), len(lg))
        assert s.candidates(lg.copy())[0].tolist() == list(range(6)), off
    # min_keep: nothing goes where fewer than min_keep would stay (llama.cpp's size - pos_last >= min_keep)
    keep5 = Sampler(SamplingParams(**OFF, xtc_probability=1.0, xtc_threshold=0.12, min_keep=5), len(lg))
    assert keep5.candidates(lg.copy())[0].tolist() == list(range(6))
    keep4 = Sampler(SamplingParams(**OFF, xtc_probability=1.0, xtc_threshold=0.12, min_keep=4), len(lg))
    assert keep4.candidates(lg.copy())[0].tolist() == [2, 3, 4, 5]
    # probability 0.5: about half the steps exclude (the uniform draw below it, as llama.cpp's)
    half = Sampler(SamplingParams(**OFF, xtc_probability=0.5, xtc_threshold=0.12, seed=4), len(lg))
    cut = sum(half.candidates(lg.copy())[0][0] == 2 for _ in range(2000))
    assert 900 < cut < 1100


def test_dynamic_temperature_follows_the_entropy():
    p = SamplingParams(**{**OFF, "temperature": 0.8}, dynatemp_range=0.5, dynatemp_exponent=2.0)
    s = Sampler(p, 4)
    for probs in ([0.25] * 4, [0.97, 0.01, 0.01, 0.01], [0.5, 0.3, 0.15, 0.05]):
        pr = np.asarray(probs)
        h = -(pr * np.log(pr)).sum() / np.log(len(pr))
        want = 0.3 + (1.3 - 0.3) * h ** 2.0
        assert s.temperature_of(np.log(pr)) == pytest.approx(want, rel=1e-9)
    assert Sampler(SamplingParams(**OFF), 4).temperature_of(np.log([0.5, 0.5])) == 1.0
    # at the high end every token is alike, at the low end one dominates: the draws show the temperature
    lg = logits_of([0.7, 0.1, 0.1, 0.1])
    hot = draw(SamplingParams(**{**OFF, "temperature": 1.0}, dynatemp_range=1.0, seed=3), lg, 3000)
    assert np.bincount(hot, minlength=4)[0] / 3000 < 0.7


def test_mirostat_v2_keeps_the_tokens_under_mu_and_follows_tau():
    rng = np.random.default_rng(7)
    lg = (rng.standard_normal(5000) * 3).astype(np.float32)
    p = SamplingParams(**{**OFF, "temperature": 0.9}, mirostat=2, mirostat_tau=4.0, mirostat_eta=0.2, seed=1)
    s = Sampler(p, len(lg))
    for step in range(30):
        mu = s.mu if s.mu is not None else 2 * 4.0
        scaled = lg.astype(np.float64) / 0.9
        surprise = -np.log2(softmax(scaled))
        want = set(np.flatnonzero(surprise <= mu).tolist()) or {int(np.argmax(lg))}
        s_cand, s_probs = s.mirostat_candidates(lg.copy())
        assert set(s_cand.tolist()) == want and s_probs.sum() == pytest.approx(1.0)
        tok = s.sample(lg.copy())
        i = s_cand.tolist().index(tok)
        assert s.mu == pytest.approx(mu - 0.2 * (-np.log2(s_probs[i]) - 4.0))
    # over many steps the surprise of the drawn tokens averages tau (its control loop)
    s = Sampler(p, len(lg))
    bits = []
    for _ in range(3000):
        cand, probs = s.mirostat_candidates(lg.copy())
        tok = s.sample(lg.copy())
        bits.append(-np.log2(probs[cand.tolist().index(tok)]))
    assert np.mean(bits[500:]) == pytest.approx(4.0, abs=0.15)


def test_mirostat_v1_sizes_top_k_from_the_zipf_exponent():
    """On exact Zipf probabilities p_i ~ 1/i^s the estimate of s is exact, so the kept count is llama.cpp's
    k = (eps 2^mu / (1 - V^-eps))^(1/s), eps = s - 1."""
    v, zipf = 3000, 1.3
    lg = (-zipf * np.log(np.arange(1, v + 1))).astype(np.float32)
    for tau in (2.0, 3.0, 5.0):
        s = Sampler(SamplingParams(**OFF, mirostat=1, mirostat_tau=tau, seed=0), v)
        cand, _ = s.mirostat_candidates(lg.copy())
        eps, mu = zipf - 1, 2 * tau
        k = int(((eps * 2 ** mu) / (1 - v ** -eps)) ** (1 / zipf))
        assert len(cand) == max(1, k) and cand.tolist() == list(range(len(cand))), tau


def test_mirostat_v1_with_a_huge_mu_keeps_the_whole_vocabulary():
    """mu bounds the surprise allowed: one so large that 2^mu overflows allows any, so v1 keeps every token as v2
    does, not the top token alone (mu 1024 and up made v1 greedy: a silent cliff after ~2,700 confident tokens)."""
    v = 3000
    lg = (-1.3 * np.log(np.arange(1, v + 1))).astype(np.float32)
    for mu in (1023.0, 1025.0, 5000.0, math.inf):
        for version in (1, 2):
            s = Sampler(SamplingParams(**OFF, mirostat=version, seed=0), v)
            s.mu = mu
            cand, probs = s.mirostat_candidates(lg.copy())
            assert len(cand) == v and probs.sum() == pytest.approx(1.0), (version, mu)
    # and draws stay random there: a large target surprise (tau) with no learning keeps mu at 2 tau
    lg = np.zeros(50, np.float32)
    draws = draw(SamplingParams(**OFF, mirostat=1, mirostat_tau=600.0, mirostat_eta=0.0, seed=1), lg, 200)
    assert len(set(draws)) > 30


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_at_a_temperature_whose_logits_overflow_is_greedy(version):
    """A temperature so small that logit / temperature overflows (1e-308 on logits of a few units, or a larger one
    on large logits) is the limit of a small temperature: the most likely token, as the chain without Mirostat
    draws at that temperature, never a draw from NaN probabilities (BOS, token 0: the first +inf)."""
    rng = np.random.default_rng(5)
    cases = [(rng.standard_normal(500).astype(np.float32) * 4, t) for t in (1e-307, 1e-308, 1e-310, 5e-324)]
    cases.append(((rng.standard_normal(500) * 1e30).astype(np.float32), 1e-290))   # |logit| / T about 1e320
    masked = cases[0][0].copy()
    masked[: int(np.argmax(masked))] = -np.inf   # a grammar's mask before the best token
    cases.append((masked, 1e-310))
    for lg, t in cases:
        best = int(np.argmax(lg))
        s = Sampler(SamplingParams(**OFF | {"temperature": t}, mirostat=version, seed=1), len(lg))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert draw(SamplingParams(**OFF | {"temperature": t}, seed=1), lg, 5) == [best] * 5   # the chain
            cand, probs = s.mirostat_candidates(lg.copy())
            assert cand.tolist() == [best] and probs.tolist() == [1.0], t
            assert [s.sample(lg.copy()) for _ in range(5)] == [best] * 5, t
        assert np.isfinite(s.mu), t


def test_other_samplers_reject_bad_values():
    for field, bad in (("typical_p", 1.5), ("xtc_probability", -0.1), ("xtc_threshold", 2.0), ("mirostat", 3),
                       ("mirostat_tau", -1.0), ("dynatemp_range", float("inf")), ("top_n_sigma", float("nan")),
                       ("min_keep", -1), ("min_keep", 1.5)):
        with pytest.raises(BitNetError, match=field):
            SamplingParams(**{field: bad}).check()


# ---- DRY ---------------------------------------------------------------------------------------------------------
def brute_dry(window, allowed, breakers=(), heads=()):
    """DRY's repeats by their definition: for each earlier position i, the longest run of tokens ending at i that
    equals the window's last tokens (at most rep_limit: the tokens after the most recent sequence breaker, a
    single token in `breakers` or a (head, tail...) in `heads`); the token after i would extend it."""
    n = len(window)
    if n <= allowed:
        return {}
    rep_limit = n
    for d in range(n):   # d: distance from the end of a breaker's head
        t = window[n - 1 - d]
        hits = [0] if t in breakers else []
        hits += [len(tail) for head, *tail in heads if head == t and len(tail) <= d
                 and list(window[n - d: n - d + len(tail)]) == list(tail)]
        if hits:
            rep_limit = d - max(hits)
            break
    if rep_limit < allowed:
        return {}
    out = {}
    for i in range(n - 1):
        length = 0
        while length <= i and window[i - length] == window[n - 1 - length]:
            length += 1
        length = min(length, rep_limit)
        if length >= allowed:
            out[window[i + 1]] = max(out.get(window[i + 1], 0), length)
    return out


def test_dry_repeats_are_the_definition():
    from bitnet_cpu.engine.runtime.dry import dry_penalties

    rng = np.random.default_rng(5)
    for trial in range(400):
        n = int(rng.integers(1, 60))
        window = [int(x) for x in rng.integers(0, 4 if trial % 2 else 7, size=n)]
        allowed = int(rng.integers(0, 4))
        table, breakers, heads = {}, (), ()
        if trial % 3 == 1:
            table, breakers = {3: [()]}, (3,)
        elif trial % 3 == 2:
            table, heads = {2: [(1,), (1, 0)]}, ((2, 1), (2, 1, 0))
        assert dry_penalties(window, table, allowed) == brute_dry(window, allowed, breakers, heads), (window, allowed)


def test_dry_penalty_is_llama_cpps_and_spares_breakers():
    from bitnet_cpu.engine.runtime.dry import apply_dry

    window = [5, 6, 7, 9, 5, 6, 7, 9, 5, 6]   # 5 6 7 9 repeats: 7 would extend "5 6" (length 2 here, 6 earlier)
    lg = np.zeros(12, np.float32)
    apply_dry(lg, window, {}, 0.8, 1.75, 2)
    reps = brute_dry(window, 2)
    want = np.zeros(12)
    for t, r in reps.items():
        want[t] = -0.8 * 1.75 ** (r - 2)
    assert np.allclose(lg, want) and lg[7] < 0
    lg = np.zeros(12, np.float32)
    apply_dry(lg, window, {7: [()]}, 0.8, 1.75, 2)   # 7 is a single-token breaker: never penalized
    assert lg[7] == 0
    lg = np.zeros(12, np.float32)
    apply_dry(lg, [1, 2] * 200, {}, 1.0, 3.0, 0)   # a huge exponent is clamped: the penalty stays finite
    assert np.isfinite(lg).all() and lg.min() < -1e30


def test_dry_breakers_of_a_real_vocabulary():
    """llama.cpp's matching of breakers against the token texts: a token holding the breaker is a single-token
    breaker; one ending in the breaker's first bytes is a head whose tail is the rest, tokenized."""
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.runtime.constraints import vocab_bytes
    from bitnet_cpu.engine.runtime.dry import breaker_table

    llm = load_model(None, ctx=64, threads=1, progress=False)
    try:
        tok, v = llm.tokenizer, llm.config.vocab_size
        words = vocab_bytes(tok, v)
        breakers = ("\n", "ab.", "e e", "...")   # the last two: a breaker's start recurs inside it
        table = breaker_table(tok, v, breakers)
        singles = {t for t, tails in table.items() if () in tails}
        assert singles == {t for t, w in enumerate(words) if any(b.encode() in w for b in breakers)}
        for t, w in enumerate(words):
            want = set()
            for b in breakers:
                for k in range(1, len(b)):   # w ends in b's first k bytes (and does not hold b)
                    if b.encode() not in w and w.endswith(b.encode()[:k]):
                        want.add(tuple(tok.encode(b[k:], add_bos=False, special=False)))
            got = [x for x in table.get(t, []) if x != ()]
            assert sorted(got) == sorted(want), (t, w)
        assert breaker_table(tok, v, breakers) is table   # cached per tokenizer
    finally:
        llm.close()


def test_dry_breakers_of_a_gguf_sentencepiece_vocabulary(tmp_path):
    """A GGUF with a SentencePiece ("llama") vocabulary, as llama.cpp's converter writes 1bitLLM's models, becomes a
    tokenizer.json that spells a newline "<0x0A>" and a space "\u2581": DRY's breakers are matched against the
    text the tokens give, not those spellings (a "\n" breaker broke no sequence there before)."""
    pytest.importorskip("sentencepiece")
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.runtime.dry import breaker_table
    from bitnet_cpu.engine.synth import SynthModel, write_gguf_tq

    llm = load_model(write_gguf_tq(SynthModel(seed=3, style="1bitllm"), str(tmp_path / "spm.gguf")), ctx=64,
                     threads=1, progress=False)
    try:
        tok, v = llm.tokenizer, llm.config.vocab_size
        assert tok.kind == "hf_json" and not tok.byte_level
        table = breaker_table(tok, v, ("\n", "the cat"))
        assert () in table[tok.token_to_id("<0x0A>")]
        the = tok.token_to_id("\u2581the")
        assert the is not None and table[the] == [tuple(tok.encode(" cat", add_bos=False, special=False))]
    finally:
        llm.close()


@pytest.mark.parametrize("base", [1e10, 1e200, 1e308])
def test_dry_with_a_huge_base_bans_the_repeat_and_never_raises(base):
    """A base past e^88.7 (log(FLT_MAX)) clamps the exponent below 1, as llama.cpp's float: the repeat's next
    token gets a penalty of about FLT_MAX (never drawn); Python's float power raised OverflowError here."""
    lg = np.zeros(8, np.float32)
    lg[7] = 5.0   # the token that extends the repeat is the most likely one
    history = [1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5]   # 7 would extend the repeat (exponent 5 at allowed length 0)
    p = SamplingParams(temperature=0, dry_multiplier=1.0, dry_base=base, dry_allowed_length=0)
    s = Sampler(p, 8)
    x = lg.copy()
    tok = s.sample(x, history)
    assert tok != 7 and x[7] < -1e20


def test_dry_in_generation_is_the_penalty_on_each_step():
    """Greedy decoding with DRY picks, at every step, the argmax of the model's logits less DRY's penalty over the
    prompt and what came before (no breakers here, so the penalties are brute_dry's alone)."""
    from bitnet_cpu.engine.api import load_model

    llm = load_model(None, ctx=128, threads=1, progress=False)
    try:
        prompt = llm.tokenize("Once upon a time, there was a little cat named Tom. Once upon a time, there was a "
                              "little cat named Tom. Once upon a time,", add_bos=True)
        p = SamplingParams(temperature=0, dry_multiplier=3.0, dry_base=1.75, dry_allowed_length=2,
                           dry_penalty_last_n=-1, dry_sequence_breakers=())
        gen = [c.token for c in llm.generate(prompt, p, max_tokens=12) if c.token is not None]
        plain = [c.token for c in llm.generate(prompt, SamplingParams(temperature=0), max_tokens=12)
                 if c.token is not None]
        assert gen != plain   # the prompt's loop is penalized
        for i, t in enumerate(gen):
            seq = prompt + gen[:i]
            lg = llm.forward(seq)[-1].astype(np.float64)
            for tok, r in brute_dry(seq, 2).items():
                lg[tok] -= 3.0 * 1.75 ** (r - 2)
            assert t == int(np.argmax(lg)), i
    finally:
        llm.close()


@pytest.mark.parametrize("kw", [dict(typical_p=0.5, top_k=0, min_p=0.0), dict(mirostat=1), dict(mirostat=2),
                                dict(xtc_probability=1.0, top_k=0), dict(dynatemp_range=1.0, top_k=0, min_p=0.0),
                                dict(top_n_sigma=1.0, top_k=0), dict(dry_multiplier=2.0, dry_allowed_length=0)])
def test_other_samplers_under_a_mask_draw_only_allowed_tokens(kw):
    """A grammar's mask (or ignore_eos) leaves -inf logits: every sampler draws among the rest, without numpy
    warnings (0 * log 0 in an entropy, a Zipf fit over the masked tail)."""
    import warnings

    lg = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    lg[5:] = -np.inf
    s = Sampler(SamplingParams(seed=1, **kw), 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drawn = {s.sample(lg.copy(), [3, 4, 3, 4, 3]) for _ in range(60)}
    assert drawn and drawn <= set(range(5))


def test_new_samplers_give_one_output_on_every_path():
    """DRY, typical and XTC together, seeded: the same tokens from LLM.generate and the batching engine, with
    prompt lookup off and on (its drafts copy the prompt's loop, which DRY penalizes): the samplers see the same
    history on each path."""
    from bitnet_cpu.engine.api import LookupParams, load_engine, load_model

    p = SamplingParams(temperature=0.7, seed=5, dry_multiplier=2.0, dry_penalty_last_n=-1, typical_p=0.9,
                       xtc_probability=0.5)
    text = "Once upon a time, there was a little cat named Tom. " * 3 + "Once upon a time,"
    outs = []
    for lookup in (LookupParams(draft_max=0), LookupParams(draft_max=6)):
        llm = load_model(None, ctx=256, threads=1, progress=False)
        try:
            ids = llm.tokenize(text, add_bos=True)
            outs.append([c.token for c in llm.generate(ids, p, max_tokens=40, lookup=lookup)])
        finally:
            llm.close()
        eng = load_engine(None, ctx=256, threads=1, parallel=2, progress=False, lookup=lookup)
        try:
            outs.append([c.token for c in eng.submit(ids, p, max_tokens=40)])
        finally:
            eng.close()
    assert all(o == outs[0] for o in outs) and len(outs[0]) > 20


def test_dry_tables_are_kept_for_the_lists_used_last():
    """Each breaker list costs a scan of the vocabulary once; a client sending a new list with every request
    cannot grow the cache past TABLES_KEPT lists per tokenizer."""
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.runtime import dry

    llm = load_model(None, ctx=64, threads=1, progress=False)
    try:
        tok, v = llm.tokenizer, llm.config.vocab_size
        first = dry.breaker_table(tok, v, ("\n",))
        for i in range(dry.TABLES_KEPT + 5):
            dry.breaker_table(tok, v, (f"#{i}",))
            assert dry.breaker_table(tok, v, ("\n",)) is first   # used again: kept
        assert len(dry._TABLES[tok]) == dry.TABLES_KEPT
    finally:
        llm.close()
