"""Prompt-lookup speculative decoding (engine/speculative.py) and the multi-row kernels behind its verify pass
(simd/kernels/gemv_rows.c): the kernels equal per-row GEMVs bit for bit on every ISA path, Model.verify rows
equal step-by-step decode logits, and generation gives the same tokens with and without speculation (greedy
and seeded sampling, both head kinds) while actually drafting; an early stop leaves the cache consistent."""
import numpy as np
import pytest

from bitnet_cpu.engine.api import SamplingParams, load_model
from bitnet_cpu.engine.errors import BitNetError, KernelError
from bitnet_cpu.engine.runtime.speculative import OFF, DraftLength, LookupParams, PromptLookup
from bitnet_cpu.simd import _kernels as K
from test_kernels import ISAS, make_i8, make_ternary, quantized
from test_model_fixtures import make_synth

GREEDY = SamplingParams(temperature=0.0)


# ---- kernels --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", [(1, 4), (37, 100), (250, 68), (100, 3200), (3840, 2560), (33, 8640)])
def test_gemv_rows_ternary_equals_per_row_gemv(isa, n, k):
    rng = np.random.default_rng(7 * n + k)
    _, w, rs = make_ternary(rng, n, k)
    for m in range(1, K.ROWS_MAX + 1):
        _, xq, s, sm = quantized(rng, m, k)
        xq[0, : min(k, 5)] = -128
        out = np.full((m, n), np.nan, np.float32)
        K.gemv_rows_ternary(w, rs, xq, s, sm, out)
        ref = np.empty((m, n), np.float32)
        K.set_isa("scalar")
        for i in range(m):
            K.gemv_ternary(w, rs, xq[i], float(s[i]), int(sm[i]), ref[i])
        K.set_isa(isa)
        assert np.array_equal(out.view(np.int32), ref.view(np.int32)), (m, n, k)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", [(1, 4), (37, 100), (250, 68), (2000, 2560), (33, 8640)])
def test_gemv_rows_i8_equals_per_row_gemv(isa, n, k):
    rng = np.random.default_rng(5 * n + k)
    _, w, sc, rowsum = make_i8(rng, n, k)
    for m in (1, 2, 3, 5, K.ROWS_MAX):
        _, xq, s, _ = quantized(rng, m, k)
        xq[-1, : min(k, 7)] = -128
        out = np.full((m, n), np.nan, np.float32)
        K.gemv_rows_i8(w, sc, rowsum, xq, s, out)
        ref = np.empty((m, n), np.float32)
        K.set_isa("scalar")
        for i in range(m):
            K.gemv_i8(w, sc, rowsum, xq[i], float(s[i]), ref[i])
        K.set_isa(isa)
        assert np.array_equal(out.view(np.int32), ref.view(np.int32)), (m, n, k)


def test_gemv_rows_bad_arguments():
    rng = np.random.default_rng(0)
    _, w, rs = make_ternary(rng, 32, 64)
    _, xq, s, sm = quantized(rng, K.ROWS_MAX + 1, 64)
    with pytest.raises(KernelError, match="1 <= M"):
        K.gemv_rows_ternary(w, rs, xq, s, sm, np.empty((K.ROWS_MAX + 1, 32), np.float32))
    with pytest.raises(KernelError, match="act_scale"):
        K.gemv_rows_ternary(w, rs, xq[:2], s[:3], sm[:2], np.empty((2, 32), np.float32))
    with pytest.raises(KernelError, match="elements"):
        K.gemv_rows_ternary(w[:-1], rs, xq[:2], s[:2], sm[:2], np.empty((2, 32), np.float32))


# ---- prompt lookup --------------------------------------------------------------------------------------
def test_prompt_lookup_proposes_latest_longest_match():
    pl = PromptLookup(LookupParams(draft_max=3, ngram_min=1, ngram_max=3))
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # suffix (2, 3): latest earlier occurrence is followed by 5, 6, 7
    assert pl.propose(toks, 3) == [5, 6, 7]
    # the longest suffix that occurred before wins: (2, 3, 4) over (3, 4) and (4,)
    toks2 = toks + [4]
    assert pl.propose(toks2, 2) == [9, 2]          # (2, 3, 4) first seen at the start, followed by 9, 2
    assert PromptLookup(LookupParams(ngram_min=2)).propose([1, 2, 3, 4], 4) == []  # no repeat, no draft
    assert PromptLookup(LookupParams(ngram_min=1)).propose([1, 2, 1], 4) == [2, 1]  # bounded by the context end
    assert pl.propose(toks2, 0) == []


def test_draft_length_adapts():
    d = DraftLength(4)
    d.update(4, 0)
    assert d.k == 2
    d.update(2, 1)
    assert d.k == 2
    d.update(2, 2)
    assert d.k == 3
    d.update(3, 3)
    d.update(4, 4)
    assert d.k == 4
    # misses pause drafting for 1, 2, 4 ... tokens; a hit resets the pause
    assert d.ready()
    d.update(4, 0)
    assert [d.ready() for _ in range(2)] == [False, True]
    d.update(2, 0)
    assert [d.ready() for _ in range(3)] == [False, False, True]
    d.update(1, 1)
    d.update(2, 0)
    assert [d.ready() for _ in range(2)] == [False, True]


def test_lookup_params_checked():
    with pytest.raises(BitNetError, match="--draft-max"):
        LookupParams(draft_max=-1).check(flags=True)
    with pytest.raises(BitNetError, match="--lookup-ngram-min"):
        LookupParams(ngram_min=0).check(flags=True)
    with pytest.raises(BitNetError, match="LookupParams.draft_max -1"):   # the API's own name from Python
        LookupParams(draft_max=-1).check()


@pytest.mark.parametrize("bad", [dict(draft_max=2.5), dict(ngram_min=1.5), dict(draft_max="4"),
                                 dict(draft_max=None), dict(ngram_max=True)])
def test_lookup_params_of_the_wrong_type_are_refused_at_the_call(stores, bad):
    """A float, a str, None or a bool in LookupParams: one BitNetError when the call is made. generate() streamed
    tokens and then raised a TypeError from a slice; an Engine's scheduler thread died on it, ending the request
    as "cancelled" and refusing every later one (the engine stopped after an internal error)."""
    from bitnet_cpu.engine.api import load_engine
    llm = load_model(stores["i8"], ctx=64, progress=False)
    with pytest.raises(BitNetError, match="LookupParams"):
        llm.generate("Once upon a time", max_tokens=4, lookup=LookupParams(**bad))
    with pytest.raises(BitNetError, match="LookupParams"):
        load_engine(stores["i8"], ctx=64, lookup=LookupParams(**bad))
    llm.close()


# ---- model and generator ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("spec"), seed=5, lm_heads=("i8", "f16"))[2]


@pytest.mark.parametrize("head,kv", [("i8", "f16"), ("f16", "f16"), ("f16", "q8")])
def test_verify_rows_equal_decode(stores, head, kv):
    llm = load_model(stores[head], ctx=64, progress=False, kv_dtype=kv)
    m = llm.model
    prompt = [1, 5, 9, 13, 2, 7]
    ids = [3, 8, 8, 4, 11, 6, 2]
    m.reset()
    m.prefill(prompt)
    rows = m.verify(ids).copy()
    assert m.n_past == len(prompt) + len(ids)
    m.truncate(len(prompt))
    for i, t in enumerate(ids):
        assert np.array_equal(m.decode(t), rows[i]), i
    with pytest.raises(BitNetError, match="per pass"):
        m.verify(list(range(m.verify_max + 1)))


def _gen(llm, prompt, params, lookup, n=48):
    llm.reset()
    toks, final = [], None
    for c in llm.generate(prompt, params, max_tokens=n, lookup=lookup):
        if c.token is not None:
            toks.append(c.token)
        final = c
    return toks, final.stats


@pytest.mark.parametrize("head", ["i8", "f16"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, seed=3),
                                    SamplingParams(temperature=0.0, repeat_penalty=1.3)],
                         ids=["greedy", "seeded", "penalty"])
def test_same_tokens_with_and_without_lookup(stores, head, params):
    llm = load_model(stores[head], ctx=256, progress=False)
    # a repetitive prompt: the random model's own output also tends to loop, so drafts get made and accepted
    prompt = [1] + [5, 9, 13, 2, 7, 21, 4] * 6
    base, s0 = _gen(llm, prompt, params, OFF)
    assert s0.n_drafted == 0
    drafted = 0
    for lk in (LookupParams(draft_max=1), LookupParams(), LookupParams(draft_max=7, ngram_min=1)):
        toks, s = _gen(llm, prompt, params, lk)
        assert toks == base, lk
        assert 0 <= s.n_accepted <= s.n_drafted
        drafted += s.n_drafted
        # the cache holds exactly the prompt and the processed tokens
        assert llm.cached_tokens == (prompt + toks)[: len(llm.cached_tokens)]
        assert len(llm.cached_tokens) >= len(prompt) + len(toks) - 1
    assert drafted > 0  # the speculative path ran


def test_early_stop_leaves_cache_consistent(stores):
    llm = load_model(stores["i8"], ctx=256, progress=False)
    prompt = [1] + [5, 9, 13, 2] * 8
    ref, _ = _gen(llm, prompt, GREEDY, OFF, n=30)
    lk = LookupParams(draft_max=7, ngram_min=1)
    for stop_after in (1, 3, 6, 10):
        llm.reset()
        got = []
        for c in llm.generate(prompt, GREEDY, max_tokens=30, lookup=lk):
            if c.token is not None:
                got.append(c.token)
            if len(got) == stop_after:
                break
        cached = llm.cached_tokens
        assert cached == (prompt + got)[: len(cached)] and len(cached) >= len(prompt) + len(got) - 1
        # continuing from that cache gives the reference continuation
        rest, _ = [], None
        for c in llm.generate(prompt + got, GREEDY, max_tokens=30 - len(got), lookup=lk):
            if c.token is not None:
                rest.append(c.token)
        assert got + rest == ref[: len(got) + len(rest)]


def test_context_limit_with_lookup(stores):
    llm = load_model(stores["i8"], ctx=40, progress=False)
    prompt = [1] + [5, 9, 13, 2] * 8
    a, sa = _gen(llm, prompt, GREEDY, OFF, n=100)
    b, sb = _gen(llm, prompt, GREEDY, LookupParams(draft_max=7, ngram_min=1), n=100)
    assert a == b and sa.finish_reason == sb.finish_reason


# ---- command line ----------------------------------------------------------------------------------------
def test_bitnet_run_flags_same_text_and_errors(stores):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-m", stores["i8"], "-p", "a b a b a b a b",
                               "-n", "24", "--temp", "0", "-t", "1", *extra], capture_output=True, text=True,
                              timeout=120, cwd=root)

    off = run("--draft-max", "0")
    assert off.returncode == 0, off.stderr
    on = run("--draft-max", "5", "--lookup-ngram-min", "1", "-v")
    assert on.returncode == 0 and on.stdout == off.stdout
    assert "draft tokens accepted" in on.stderr
    # lookup on and nothing drafted: said (0/0), not left out as if lookup were off
    none = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-m", stores["i8"], "-p", "a", "-n", "1",
                           "--temp", "0", "-t", "1", "--draft-max", "4", "-v"], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert none.returncode == 0 and "0/0 draft tokens accepted" in none.stderr, none.stderr
    bad = run("--draft-max", "-2")
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "--draft-max" in bad.stderr


def test_bitchat_flags(stores):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def chat(*extra):
        return subprocess.run([sys.executable, "-m", "bitnet_cpu.cli.chat", "-m", stores["i8"], "--temp", "0", "-n", "16", *extra],
                              input="a b a b a b\n", capture_output=True, text=True, timeout=120, cwd=root)

    off, on = chat("--draft-max", "0"), chat("--draft-max", "4", "--lookup-ngram-min", "1")
    assert off.returncode == 0 and on.returncode == 0, on.stderr
    assert on.stdout == off.stdout and off.stdout.strip()
    # /stats says what the drafts took (the doc's advice: measure with --draft-max before turning it on)
    stats = subprocess.run([sys.executable, "-m", "bitnet_cpu.cli.chat", "-m", stores["i8"], "--temp", "0", "-n",
                            "16", "--draft-max", "4", "--lookup-ngram-min", "1"], input="a b a b a b\n/stats\n",
                           capture_output=True, text=True, timeout=120, cwd=root)
    assert stats.returncode == 0 and "draft tokens accepted" in stats.stdout + stats.stderr, stats.stdout
    bad = chat("--draft-max", "-1")
    assert bad.returncode == 2 and "--draft-max" in bad.stderr
