"""Embeddings in the engine (engine/runtime/embed.py, engine/batching/embed.py) on small synthetic models: the vector
is the mean of the final-norm hidden states, L2-normalised (checked through the model's own f16 LM head, which is
linear in them); the same text gives the same bits alone, in a batch cut into other chunks, beside a running
generation and through the single-session LLM; an embedding never changes a generation's tokens, never enters the
prefix index and gives back every page; texts over the context, empty ones and an engine closed under a request
are refused or ended with a reason."""
import threading
import time

import numpy as np
import pytest

from bitnet_cpu.engine.api import Engine, SamplingParams, load_model
from bitnet_cpu.engine.errors import BitNetError, ContextOverflowError
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.simd import _kernels as K
from test_model_fixtures import make_synth, running_engine

GREEDY = SamplingParams(temperature=0.0)
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 3, "a",
         "Embeddings are pooled over every token of the text, BOS included.", "12345 67890 " * 6]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("embed"), seed=5, lm_heads=("f16", "q4"))


@pytest.fixture(scope="module")
def llm(synth):
    m = load_model(synth[2]["f16"], threads=1, progress=False)
    yield m
    m.close()


def _cos(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_vector_is_the_l2_normalised_mean_of_final_norm_rows(llm):
    """With an f16 head, logits = W h for each row's final-norm state h: W applied to the vector must point where
    the mean of the rows' logits points (mean pooling of those states), and nowhere near the last row's alone."""
    w = llm.model.weights
    assert w.lm_head == "f16"
    for text in TEXTS[:4]:
        vec = llm.embed(text)[0]
        assert vec.dtype == np.float32 and abs(np.linalg.norm(vec.astype(np.float64)) - 1) < 1e-6
        ids = llm.tokenize(text, add_bos=True)
        rows = llm.forward(ids).astype(np.float64)
        got = np.zeros(llm.config.vocab_size, np.float32)
        K.gemv_f16(w.out_w, vec, got)
        assert _cos(got, rows.mean(0)) > 1 - 1e-9
        scale = (got.astype(np.float64) @ rows.mean(0)) / (got.astype(np.float64) @ got)
        assert scale > 0   # the same direction, not the opposite one
        if len(ids) > 2:
            assert _cos(got, rows[-1]) < 0.999   # last-token pooling would be a different vector


def test_last_and_none_poolings_are_the_last_row_and_every_row(llm):
    """pooling last: W applied to the vector points where the last row's logits point; none: the rows themselves,
    W applied to row i gives row i's logits (the same f16 head), in token order."""
    w = llm.model.weights
    for text in TEXTS[:4]:
        ids = llm.tokenize(text, add_bos=True)
        logits = llm.forward(ids).astype(np.float64)
        last = llm.embed(text, pooling="last")[0]
        assert abs(np.linalg.norm(last.astype(np.float64)) - 1) < 1e-6
        got = np.zeros(llm.config.vocab_size, np.float32)
        K.gemv_f16(w.out_w, last, got)
        assert _cos(got, logits[-1]) > 1 - 1e-9
        rows = llm.embed(text, pooling="none")[0]
        assert isinstance(rows, np.ndarray) and rows.shape == (len(ids), llm.config.hidden_size)
        for i, row in enumerate(rows):
            K.gemv_f16(w.out_w, row, got)
            assert np.allclose(got, logits[i], rtol=1e-4, atol=1e-4 * np.abs(logits[i]).max()), i
        if len(ids) > 2:
            assert _cos(last, llm.embed(text)[0]) < 0.999   # not the mean


def test_embd_normalize_is_llama_cpp_s_norm(llm):
    """-1 leaves the pooled vector as it is; 0 scales its largest magnitude to 32760 (int16's range); 1, 2 and 3
    give it unit taxicab, Euclidean and 3-norm; every one points the same way."""
    raw = llm.embed(TEXTS, normalize=-1).astype(np.float64)
    l2 = llm.embed(TEXTS).astype(np.float64)
    assert np.allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), l2, atol=1e-6)
    assert np.all(np.linalg.norm(raw, axis=1) > 1.5)   # not already a unit vector: the checks below mean something
    for p, norm_of in ((0, lambda v: np.abs(v).max() / 32760), (1, lambda v: np.abs(v).sum()), (2, np.linalg.norm),
                       (3, lambda v: (np.abs(v) ** 3).sum() ** (1 / 3))):
        got = llm.embed(TEXTS, normalize=p).astype(np.float64)
        for v, r in zip(got, raw):
            assert abs(norm_of(v) - 1) < 1e-5 and _cos(v, r) > 1 - 1e-9, p
    # a p of hundreds: |v|^p overflows a double (the vector came out all zero, as llama.cpp's does); the same norm
    for p in (700, 5000):
        got = llm.embed(TEXTS, normalize=p).astype(np.float64)
        for v, r in zip(got, raw):
            m = np.abs(v).max()
            assert abs(m * ((np.abs(v) / m) ** p).sum() ** (1 / p) - 1) < 1e-5 and _cos(v, r) > 1 - 1e-9, p
    with pytest.raises(BitNetError, match="pooling cls: .*same vector"):
        llm.embed("x", pooling="cls")
    for bad in (-2, 1.5, True, "2"):   # named as the caller passed it (embd_normalize is the server's field)
        with pytest.raises(BitNetError, match="^normalize "):
            llm.embed("x", normalize=bad)


def test_same_bits_alone_batched_chunked_and_through_llm(synth, llm):
    path = synth[2]["f16"]
    want = llm.embed(TEXTS)
    assert want.shape == (len(TEXTS), llm.config.hidden_size)
    assert not np.array_equal(want[0], want[1])
    # small steps: texts are cut into chunks that differ between alone and batched
    for kw in (dict(parallel=4, max_batch_tokens=7), dict(parallel=16, max_batch_tokens=256)):
        with running_engine(path, threads=1, **kw) as eng:
            batched = eng.embed(TEXTS, timeout=120)
            alone = np.stack([eng.embed([t], timeout=120)[0] for t in TEXTS])
            assert np.array_equal(batched, want) and np.array_equal(alone, want)
            twice = eng.embed([TEXTS[1], TEXTS[1]], timeout=120)
            assert np.array_equal(twice[0], want[1]) and np.array_equal(twice[1], want[1])
            ids = eng.embed_tokens(TEXTS)
            assert np.array_equal(eng.embed_ids(ids, timeout=120), want)
            # the other poolings and norms, cut into the same chunks
            for pooling, normalize in (("last", 2), ("mean", 1), ("last", -1)):
                assert np.array_equal(eng.embed(TEXTS, timeout=120, pooling=pooling, normalize=normalize),
                                      llm.embed(TEXTS, pooling=pooling, normalize=normalize)), (pooling, normalize)
            rows = eng.embed(TEXTS, timeout=120, pooling="none")
            assert len(rows) == len(TEXTS)
            for got, want_rows in zip(rows, llm.embed(TEXTS, pooling="none")):
                assert np.array_equal(got, want_rows)


def test_same_bits_with_the_q4_head_and_more_threads(synth):
    """The head never enters an embedding: a q4-head store of the same weights gives the f16 store's bits, at
    2 threads too."""
    with running_engine(synth[2]["f16"], threads=1) as eng:
        want = eng.embed(TEXTS, timeout=120)
    with running_engine(synth[2]["q4"], threads=2, max_batch_tokens=16) as eng:
        assert np.array_equal(eng.embed(TEXTS, timeout=120), want)


def test_beside_a_generation_tokens_and_vectors_unchanged_pages_returned(synth, llm):
    path = synth[2]["f16"]
    prompt = llm.tokenize("Once upon a time", add_bos=True)
    want_vecs = llm.embed(TEXTS * 3)
    with running_engine(path, threads=1, parallel=6, max_batch_tokens=12) as eng:
        alone = [c.token for c in eng.submit(prompt, GREEDY, max_tokens=24, ignore_eos=True) if c.token is not None]
        eng.clear_prefix_cache()
        done = threading.Event()
        chunks = []

        def on_chunk(c):
            chunks.append(c)
            if c.finish_reason:
                done.set()
        eng.submit(prompt, GREEDY, max_tokens=24, ignore_eos=True, callback=on_chunk)
        vecs = eng.embed(TEXTS * 3, timeout=120)
        assert done.wait(120)
        assert [c.token for c in chunks if c.token is not None] == alone and chunks[-1].finish_reason == "length"
        assert np.array_equal(vecs, want_vecs)
        m = eng.metrics()
        assert m["embed_inputs_total"] == 3 * len(TEXTS) and m["running"] == 0 and m["kv_pages_reserved"] == 0
        eng.check_consistency()
    with running_engine(path, threads=1) as eng:   # alone: nothing stays behind, not even in the prefix index
        eng.embed(TEXTS, timeout=120)
        m = eng.metrics()
        assert m["kv_pages_used"] == 0 and m["kv_pages_cached"] == 0 and m["prefix_hits_tokens"] == 0
        assert eng.check_consistency()["held"] == 0


def test_refusals(synth, llm):
    long_text = "word " * 400   # the synthetic model's context is 256 tokens
    # texts counted as `bitnet embed`'s other messages count them, "text N of M" from 1 (this said "input 1")
    with pytest.raises(ContextOverflowError, match="text 2 of 2 has"):
        llm.embed(["ok", long_text])
    with running_engine(synth[2]["f16"], threads=1) as eng:
        # a server's context is at least 2048 (api.serving_ctx), past the model's 256: over the engine's own
        with pytest.raises(ContextOverflowError, match="text 2 of 3 has"):
            eng.embed(["ok", "word " * (eng.n_ctx + 10), "ok"])
        with pytest.raises(BitNetError, match="text 2 of 2 is empty: nothing to embed"):
            eng.embed(["ok", ""])
        with pytest.raises(BitNetError, match="text 1 of 1: expected a string, got int"):
            llm.embed([5])
        with pytest.raises(BitNetError, match="no texts"):
            eng.embed([])
        with pytest.raises(BitNetError, match="outside the vocabulary"):
            eng.submit_embed([[1, 2, 10 ** 6]])
        with pytest.raises(BitNetError, match="text 1 of 1: no tokens"):
            eng.submit_embed([[]])
        # exactly the context fits
        ids = [int(t) for t in np.random.default_rng(0).integers(3, llm.config.vocab_size, eng.n_ctx)]
        assert eng.embed_ids([ids], timeout=120).shape == (1, llm.config.hidden_size)
        assert eng.check_consistency()["held"] == 0


def test_an_embedding_request_takes_one_place_in_the_queue(synth):
    """A request of many texts waits as one request, whatever its n (each text is a sequence of its own): 50
    texts took 50 of max_queue's places, so a server's other clients got queue_full behind one request."""
    from bitnet_cpu.engine.errors import QueueFullError
    eng = Engine(Store(synth[2]["f16"]), threads=1, parallel=2, max_queue=2)   # never started: all waits
    try:
        eng.submit_embed([[1, 2, 3]] * 50)   # its first texts take the two free slots; it waits for the rest
        eng.submit([1, 2], GREEDY, max_tokens=2)   # max_queue 2: the embedding and this one wait
        assert eng.metrics()["waiting"] == 2   # requests, as /metrics says (it counted 51: the texts)
        with pytest.raises(QueueFullError):
            eng.submit([1, 2], GREEDY, max_tokens=2)
    finally:
        eng.close()


def test_a_request_of_many_texts_takes_turns_with_later_requests(synth, llm):
    """parallel 2: an embeddings request of 40 texts, then a generation, queued together (between two steps). The
    generation is admitted at the first free slot beside the texts and ends long before the last text: it waited
    behind every one (a chat behind a 2,048-text request waited out all of it). The vectors are as before."""
    ids = llm.embed_tokens(TEXTS)
    texts = (ids * 8)[:40]
    box = {}
    with running_engine(synth[2]["f16"], threads=1, parallel=2) as eng:
        def both():   # the callback runs on the scheduler thread as the last text ends: was the generation over?
            box["req"] = eng.submit_embed(texts, callback=lambda r: box.setdefault("gen_over", box["gen"].finish_reason))
            box["gen"] = eng.submit([1, 2, 3], GREEDY, max_tokens=4)
        eng.run_in_scheduler(both)
        assert np.array_equal(box["req"].result(timeout=120), llm.embed((TEXTS * 8)[:40]))
        assert box["gen_over"] is not None   # its finish reason was set before the embeddings' last text
        eng.check_consistency()


def test_close_ends_a_waiting_request(synth):
    eng = Engine(Store(synth[2]["f16"]), threads=1)   # never started: the request waits
    got = []
    req = eng.submit_embed([[1, 2, 3], [4, 5]], callback=got.append)
    assert eng.metrics()["waiting"] == 1   # one request waiting (its two texts are two sequences)
    eng.close()
    assert got == [req] and req.error == "cancelled"
    with pytest.raises(BitNetError, match="cancelled"):
        req.result(timeout=5)
    t0 = time.monotonic()
    with pytest.raises(BitNetError, match="closed"):
        eng.submit_embed([[1]])
    assert time.monotonic() - t0 < 5


def test_a_fault_in_one_texts_forward_ends_only_its_request(synth, llm, monkeypatch):
    """BITNET_FAULT_TOKEN (engine/batching/batch_model.py's test hook) makes a kernel fault in the steps holding
    that token: the request with that text ends with "error", the other request in the same steps gets its vectors."""
    ok = llm.embed_tokens(TEXTS[:3])
    bad = [llm.tokenize("x", add_bos=True) + [7] * 20, ok[0]]
    monkeypatch.setenv("BITNET_FAULT_TOKEN", "7")
    assert all(7 not in t for t in ok)
    with running_engine(synth[2]["f16"], threads=1, parallel=8) as eng:
        r_bad = eng.submit_embed(bad)
        r_ok = eng.submit_embed(ok)
        assert np.array_equal(r_ok.result(timeout=120), llm.embed(TEXTS[:3]))
        with pytest.raises(BitNetError, match="error"):
            r_bad.result(timeout=120)
        assert eng.metrics()["sequence_errors_total"] >= 1
        eng.check_consistency()


def test_the_engine_s_own_pooling_is_what_a_call_naming_none_gets(synth, llm):
    """load_engine(pooling=, embd_normalize=) (`bitnet serve --pooling --embd-normalize`) set what embed() gives
    a call that names neither; a call's own choice still wins; a pooling no decoder can use is refused at load."""
    path = synth[2]["f16"]
    with running_engine(path, threads=1, pooling="last", embd_normalize=1) as eng:
        assert np.array_equal(eng.embed(TEXTS, timeout=120), llm.embed(TEXTS, pooling="last", normalize=1))
        assert np.array_equal(eng.embed(TEXTS, timeout=120, pooling="mean", normalize=2), llm.embed(TEXTS))
    for bad, match in (("cls", "same vector"), ("rank", "classification head"), ("max", "expected one of")):
        with pytest.raises(BitNetError, match=match):
            running_engine(path, threads=1, pooling=bad).__enter__()


def test_a_norm_asked_of_pooling_none_is_refused_as_the_server_refuses_it(synth, llm):
    """LLM.embed(pooling="none", normalize=2) returned the raw rows and dropped normalize without a word, where the
    server answers the same request 400 "... per-token vectors are never normalised". Both engines now refuse it in
    the server's words; left out, the rows come as they are."""
    for kw in ({"normalize": 2}, {"normalize": -1}, {"normalize": 0}):
        with pytest.raises(BitNetError, match="per-token vectors are never normalised"):
            llm.embed(TEXTS[:2], pooling="none", **kw)
    rows = llm.embed(TEXTS[:2], pooling="none")
    assert len(rows) == 2 and all(r.ndim == 2 for r in rows)
    assert np.array_equal(llm.embed(TEXTS[:2]), llm.embed(TEXTS[:2], normalize=2))   # pooled: 2 stays the default
    with running_engine(synth[2]["f16"], threads=1) as eng:
        with pytest.raises(BitNetError, match="per-token vectors are never normalised"):
            eng.embed(TEXTS[:2], timeout=120, pooling="none", normalize=2)
        for got, want in zip(eng.embed(TEXTS[:2], timeout=120, pooling="none"), rows):
            assert np.array_equal(got, want)
    with running_engine(synth[2]["f16"], threads=1, pooling="none") as eng:
        with pytest.raises(BitNetError, match="per-token vectors are never normalised"):
            eng.embed(TEXTS[:2], timeout=120, normalize=1)


def _until_idle(eng, seconds=300):
    deadline = time.monotonic() + seconds
    while eng.metrics()["running"] + eng.metrics()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    m = eng.metrics()
    assert m["running"] == m["waiting"] == 0, m
    return m


def test_a_wait_that_ends_early_cancels_the_texts(synth):
    """embed_ids / embed (and score_ids, tests/test_score.py) wait for the request; a timeout or Ctrl-C ending
    that wait cancels it: the texts ran on for nobody (300 of them: seconds of a server's engine) and delayed every
    request behind them. Counted, not timed: after the timeout and the engine's idling, far fewer texts than were
    submitted were embedded (all 300 before)."""
    from test_model_fixtures import running_engine
    ids = [[1 + (7 * i + j) % 200 for j in range(100)] for i in range(300)]   # ~240 steps of 128 rows
    with running_engine(synth[2]["f16"], threads=1, parallel=4) as eng:
        with pytest.raises(BitNetError, match="not ready within"):
            eng.embed_ids(ids, timeout=0)
        assert _until_idle(eng)["embed_inputs_total"] < len(ids)
