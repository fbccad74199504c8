"""Prompt scoring in the batching engine (engine/batching/score.py): every prompt token's log-probability given the
ones before it, and the best k there, equal to the log-softmax of the single-sequence model's own logits over the
same ids (LLM.forward, a fresh cache) however the prompt is chunked, the head's rows are split, or generations run
beside it; generations beside a scoring are unchanged by it."""
from __future__ import annotations

import time

import pytest

from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model
from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.runtime.sampling import token_logprob

TEXT = ("Once upon a time, in a small village by the sea, there lived an old fisherman and his three curious "
        "grandchildren, who asked him every evening about the stars.")


@pytest.fixture(scope="module")
def llm():
    m = load_model(None, threads=1, progress=False)
    yield m
    m.close()


def reference(llm, ids, k):
    logits = llm.forward(ids)
    return [token_logprob(logits[j - 1], ids[j], k) for j in range(1, len(ids))]


@pytest.mark.parametrize("batch_tokens", [7, 128])
def test_scores_equal_the_models_own_log_softmax(llm, batch_tokens):
    """7 rows a step: the prompt runs in chunks; 128: in one step, whose rows the head takes in pieces of its
    row buffer (18 rows here)."""
    ids = llm.tokenize(TEXT, add_bos=True)
    eng = load_engine(None, threads=1, parallel=2, ctx=512, max_batch_tokens=batch_tokens, progress=False)
    try:
        assert len(ids) > batch_tokens or len(ids) - 1 > eng.model.max_logit_rows   # chunked, or the head split
        got = eng.score_ids(ids, top_k=3, timeout=120)
        assert got == reference(llm, ids, 3)
        assert eng.metrics()["scored_tokens_total"] == len(ids) - 1
        assert eng.metrics()["kv_pages_used"] == 0   # retired: its pages went back, none indexed
    finally:
        eng.close()


def test_scoring_beside_generations_changes_neither(llm):
    ids = llm.tokenize(TEXT, add_bos=True)
    prompts = [llm.tokenize(t, add_bos=True) for t in ("The fox", "Two owls sat", "In the morning the sea")]
    eng = load_engine(None, threads=1, parallel=6, ctx=512, max_batch_tokens=16, progress=False)
    try:
        alone = [[c.token for c in eng.submit(p, SamplingParams(temperature=0), max_tokens=20)] for p in prompts]
        streams = [eng.submit(p, SamplingParams(temperature=0), max_tokens=20) for p in prompts[:2]]
        req = eng.submit_score(ids, top_k=2)
        streams.append(eng.submit(prompts[2], SamplingParams(temperature=0), max_tokens=20))
        together = [[c.token for c in s] for s in streams]
        assert together == alone
        assert req.result(120) == reference(llm, ids, 2)
    finally:
        eng.close()


def test_cancel_and_bad_requests():
    eng = load_engine(None, threads=1, parallel=2, ctx=512, max_batch_tokens=4, progress=False)
    try:
        ids = eng.tokenize(TEXT * 3, add_bos=True)
        req = eng.submit_score(ids)
        req.cancel()
        with pytest.raises(BitNetError, match="cancelled"):
            req.result(60)
        for bad, kw in (([], {}), ([1, 2], {"top_k": 21}), ([eng.config.vocab_size], {})):
            with pytest.raises(BitNetError):
                eng.submit_score(bad, **kw)
        assert eng.score_ids([ids[0]], timeout=60) == []   # one token: nothing before it to score it by
        # a wait that ends early (a timeout, Ctrl-C) cancels the scoring: it ran on to its end for nobody
        long = (ids * 4)[:400]
        before = eng.metrics()["scored_tokens_total"]
        with pytest.raises(BitNetError, match="not ready within"):
            eng.score_ids(long, timeout=0)
        deadline = time.monotonic() + 300
        while eng.metrics()["running"] + eng.metrics()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.metrics()["scored_tokens_total"] - before < len(long) - 1
        deadline_free = eng.metrics()
        assert deadline_free["running"] == 0 and deadline_free["kv_pages_used"] == 0
    finally:
        eng.close()
