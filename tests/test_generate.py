"""The streaming generator and public API: chunks and stats, KV prefix reuse, consistency after an early
stop, stop strings / eos / length / context, prefill-only requests."""
import os
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.api import Chunk, SamplingParams, Stats, load_model
from bitnet_cpu.engine.errors import ContextOverflowError
from test_model_fixtures import make_synth

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("gen"), seed=11, lm_heads=("i8",))[2]["i8"]


@pytest.fixture
def llm(store):
    return load_model(store, ctx=128, progress=False)


def run(llm, prompt, params=GREEDY, **kw):
    chunks = list(llm.generate(prompt, params, **kw))
    assert all(isinstance(c, Chunk) for c in chunks)
    final = chunks[-1]
    assert final.finish_reason and final.token is None and final.text == "" and isinstance(final.stats, Stats)
    assert all(c.finish_reason is None for c in chunks[:-1])
    toks = [c.token for c in chunks[:-1] if c.token is not None]
    return toks, "".join(c.text for c in chunks), final


def test_stream_matches_greedy_forward(llm):
    prompt = llm.tokenize("Once upon a time", add_bos=True)
    toks, text, final = run(llm, prompt, max_tokens=20)
    assert final.finish_reason in ("length", "eos")
    # the same tokens as argmax over forward() of the growing sequence
    seq = list(prompt)
    for t in toks:
        assert int(np.argmax(llm.forward(seq)[-1])) == t
        seq.append(t)
    assert text == llm.tokenizer.decode(toks, skip_special=True)
    s = final.stats
    assert s.n_prompt == len(prompt) and s.n_generated >= len(toks) and s.ttft_s > 0 and s.prefill_tps > 0


def test_kv_prefix_reuse_and_same_output(llm):
    p1 = llm.tokenize("The quick brown fox", add_bos=True)
    a, _, f1 = run(llm, p1, max_tokens=8)
    assert f1.stats.n_cached == 0
    # a follow-up prompt extending the first one (a chat turn) only prefills its new tokens
    p2 = p1 + a + llm.tokenize(" jumps over")
    b, _, f2 = run(llm, p2, max_tokens=8)
    assert f2.stats.n_cached == len(p1) + len(a) - 1  # the last generated token was never fed
    fresh = load_model(llm.store.path, ctx=128, progress=False)
    assert run(fresh, p2, max_tokens=8)[0] == b
    # the identical prompt again: everything but its last token comes from the cache
    c, _, f3 = run(llm, p2, max_tokens=8)
    assert c == b and f3.stats.n_cached == len(p2) - 1


def test_consumer_stops_midway_cache_stays_consistent(llm):
    p = llm.tokenize("Lily walked to the river", add_bos=True)
    want = run(load_model(llm.store.path, ctx=128, progress=False), p, max_tokens=12)[0]
    gen = llm.generate(p, GREEDY, max_tokens=12)
    got = [next(gen).token for _ in range(5)]
    gen.close()  # like a break or Ctrl-C in the consumer
    assert llm.model.cache_ids == p + got[:4]
    assert run(llm, p + got, max_tokens=7)[0] == want[5:]


def test_seeded_sampling_repeats(llm):
    p = llm.tokenize("Numbers:", add_bos=True)
    params = SamplingParams(temperature=1.0, seed=5)
    a = run(llm, p, params, max_tokens=16)[0]
    llm.reset()
    assert run(llm, p, params, max_tokens=16)[0] == a


def test_stop_on_eos_and_stop_string(llm):
    p = llm.tokenize("Once upon a time", add_bos=True)
    params = SamplingParams(temperature=1.0, seed=1)
    toks, text, _ = run(llm, p, params, max_tokens=10)
    # make a token that first appears at position i > 0 an end-of-turn id: generation stops before it
    i = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    llm.tokenizer.eos_ids = (toks[i],)
    t2, _, f = run(llm, p, params, max_tokens=10)
    assert f.finish_reason == "eos" and t2 == toks[:i] and f.stats.n_generated == i + 1
    llm.tokenizer.eos_ids = ()
    # a stop string inside the generated text: output is cut right before it
    chunks = list(llm.generate(p, GREEDY, max_tokens=10))
    full = "".join(c.text for c in chunks)
    assert chunks[-1].said == 10   # every token's text is in an answer no stop string cut
    stop = full[3:6]
    _, text, f = run(llm, p, max_tokens=10, stop=["no such text", stop])
    assert f.finish_reason == "stop" and text == full[: full.index(stop)]
    # the tokens whose text begins before the cut (each token's text starts where the ones before it end)
    starts = [sum(len(c.text) for c in chunks[:j]) for j in range(10)]
    assert f.said == sum(1 for x in starts if x < len(text))
    assert f.stats.stop_word == stop   # which stop string ended it (llama-server's stopping_word)
    assert run(llm, p, max_tokens=10)[2].stats.stop_word is None


def test_max_tokens_zero_prefills_only(llm):
    p = llm.tokenize("Once upon a time", add_bos=True)
    chunks = list(llm.generate(p, GREEDY, max_tokens=0))
    assert len(chunks) == 1 and chunks[0].finish_reason == "length" and chunks[0].stats.n_generated == 0
    assert llm.model.cache_ids == p
    _, _, f = run(llm, p, max_tokens=3)
    assert f.stats.n_cached == len(p) - 1


def test_cancel_stops_the_prompt_between_chunks_and_keeps_what_was_done(llm):
    """cancel= is asked between prefill chunks: once it says stop, the stream is one "cancelled" Chunk, the chunks
    done stay cached, and the same prompt afterwards goes on from them to the same tokens as an uncancelled run."""
    from bitnet_cpu.engine.errors import BitNetError

    p = llm.tokenize("Once upon a time there was a tiny model that read a long prompt " * 4, add_bos=True)
    llm.model.chunk = 8   # the session's buffers hold 128 rows; fewer per chunk is allowed
    assert len(p) > 3 * 8
    ref, _, _ = run(llm, p, max_tokens=6)
    llm.reset()
    asked = []
    chunks = list(llm.generate(p, GREEDY, max_tokens=6, cancel=lambda: asked.append(1) or len(asked) >= 2))
    assert [(c.text, c.token, c.finish_reason) for c in chunks] == [("", None, "cancelled")]
    assert chunks[0].stats.n_generated == 0 and chunks[0].stats.finish_reason == "cancelled"
    assert len(asked) == 2 and llm.cached_tokens == p[:16]   # asked before chunks 2 and 3: two chunks ran
    toks, _, f = run(llm, p, max_tokens=6, cancel=lambda: False)
    assert toks == ref and f.stats.n_cached == 16
    # a prompt of one chunk never asks; a cancel that is not a function is refused before any work
    llm.reset()
    run(llm, p[:8], max_tokens=1, cancel=lambda: pytest.fail("asked with nothing left to stop"))
    with pytest.raises(BitNetError, match="cancel"):
        llm.generate(p, GREEDY, cancel=True)


def test_context_overflow_and_full(store):
    llm = load_model(store, ctx=32, progress=False)
    with pytest.raises(ContextOverflowError):
        list(llm.generate(list(range(33)), GREEDY, max_tokens=4))
    toks, _, f = run(llm, list(range(5, 30)), max_tokens=100)
    assert f.finish_reason == "context" and len(toks) == 32 - 25 + 1
    assert llm.model.n_past == 32


def test_superseded_generator_stops(llm):
    p = llm.tokenize("Once upon a time", add_bos=True)
    old = llm.generate(p, GREEDY, max_tokens=10)
    next(old)
    run(llm, llm.tokenize("The sea", add_bos=True), max_tokens=3)
    with pytest.raises(Exception, match="superseded"):
        next(old)


def test_overhead_measurement_runs(llm):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from bench_step import python_overhead_per_step

    llm.generate(llm.tokenize("x", add_bos=True), GREEDY, max_tokens=1)
    over = python_overhead_per_step(llm.model, n=5)
    assert 0 < over < 1.0


def _check_running_stats(chunks, n_prompt):
    """Every chunk carries the engine's Stats: the prompt, the tokens sampled so far, one finish reason at the end."""
    assert all(isinstance(c.stats, Stats) for c in chunks)
    assert all(c.stats.n_prompt == n_prompt for c in chunks)
    counts = [c.stats.n_generated for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1
    sampled = 0
    for c in chunks[:-1]:
        sampled += c.token is not None
        assert c.stats.finish_reason is None and c.stats.n_generated >= sampled and c.stats.ttft_s > 0
    assert chunks[-1].stats.finish_reason == chunks[-1].finish_reason
    assert chunks[-2].stats is not chunks[-1].stats   # a snapshot each: keeping one never sees it change


def test_every_chunk_carries_the_running_stats(llm):
    prompt = llm.tokenize("Once upon a time", add_bos=True)
    chunks = list(llm.generate(prompt, GREEDY, max_tokens=16, ignore_eos=True))
    _check_running_stats(chunks, len(prompt))
    assert [c.stats.n_generated for c in chunks[:16]] == list(range(1, 17))
    assert chunks[-2].stats.decode_tps > 0 and chunks[-1].stats.n_generated == 16
