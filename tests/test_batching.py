"""The batching engine (engine/batching, engine.api.load_engine) on small synthetic models: batched steps give
bit-identical logits to each sequence alone (mixed prefill / decode, any chunking, both LM heads), greedy
output is the same alone, with 15 others and through LLM.generate; pages go back on finish and on cancel;
prefix sharing reuses pages and copy-on-write keeps the other sequence's output; an exhausted pool makes
requests wait; random submit/cancel from two threads leaves the pool consistent."""
import threading
import time

import numpy as np
import pytest

from bitnet_cpu.engine.api import Engine, SamplingParams, load_engine, load_model
from bitnet_cpu.engine.batching.batch_model import BatchModel
from bitnet_cpu.engine.batching.kv_pool import PAGE_TOKENS, KVPool
from bitnet_cpu.engine.errors import ContextOverflowError, QueueFullError
from bitnet_cpu.engine.runtime import model as model_mod
from bitnet_cpu.engine.runtime.model import Model
from bitnet_cpu.simd import _kernels as K
from bitnet_cpu.engine.formats.store import Store
from test_model_fixtures import make_synth, running_engine

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("batch"), seed=11, lm_heads=("f16", "i8", "q4"))


def _collect(stream, timeout=120.0):
    out, t0 = [], time.monotonic()
    for c in stream:
        out.append(c)
        assert time.monotonic() - t0 < timeout
    return out


def _tokens(chunks):
    return [c.token for c in chunks if c.token is not None]


class _Chunks(list):
    """A submit() callback: keeps the chunks (made on the scheduler thread), sets `finished` on the last one, then
    runs then(self) there too, between two steps, where what it does (cancel, read slots) lands at a fixed point."""

    def __init__(self, then=None):
        super().__init__()
        self.finished, self._then = threading.Event(), then

    def __call__(self, c):
        self.append(c)
        if c.finish_reason:
            self.finished.set()
        if self._then is not None:
            self._then(self)

    def wait(self, timeout=120.0):
        assert self.finished.wait(timeout), "the stream never finished"
        return self


def _assert_every_page_returns(eng):
    """The pool and prefix index agree, and once the index is dropped no page is in use."""
    eng.check_consistency()
    eng.clear_prefix_cache()
    assert eng.metrics()["kv_pages_used"] == 0


def _submit_together(eng, requests):
    """Submit every (prompt, params, kwargs) between two scheduler steps, so the next step sees them all: how the
    requests are batched (and so steps_total, drafts beside other rows) then depends on the workload alone, not
    on how far the scheduler got while this thread was submitting them one by one."""
    return eng.run_in_scheduler(lambda: [eng.submit(p, sp, **kw) for p, sp, kw in requests])


# ---- the batched forward ------------------------------------------------------------------------------------

class _Driver:
    """Runs sequences through a BatchModel by hand: teacher-forced tokens, pages from the pool."""

    def __init__(self, store, n_pages=64, max_rows=256, n_ctx=256, kv_dtype="f16"):
        self.pool = KVPool(store.config.n_layers, n_pages, store.config.n_kv_heads, store.config.head_dim, kv_dtype)
        self.bm = BatchModel(store, self.pool, max_rows=max_rows, n_ctx=n_ctx, max_logit_rows=max_rows)
        self.pages: dict[int, list[int]] = {}
        self.pos: dict[int, int] = {}

    def step(self, work):
        """work: [(seq, ids)]; returns {seq: logits of every row}."""
        n = len(work)
        rows = np.zeros(n + 1, np.int32)
        pos0 = np.zeros(n, np.int32)
        pt = np.zeros((n, self.bm.max_pages), np.int32)
        ids = []
        for i, (s, t) in enumerate(work):
            p = self.pos.setdefault(s, 0)
            pages = self.pages.setdefault(s, [])
            while len(pages) * PAGE_TOKENS < p + len(t):
                pages.append(self.pool.alloc())
            pos0[i], rows[i + 1] = p, rows[i] + len(t)
            pt[i, : len(pages)] = pages
            ids += t
        logits = self.bm.step(np.array(ids, np.int32), rows, pos0, pt, list(range(len(ids)))).copy()
        out = {}
        for i, (s, t) in enumerate(work):
            self.pos[s] += len(t)
            out[s] = logits[rows[i]: rows[i + 1]]
        return out


@pytest.mark.parametrize("rows_max", [0, 7], ids=["gemm", "rows-gemv"])
@pytest.mark.parametrize("head", ["f16", "i8", "q4"])
def test_batched_logits_equal_alone(synth, head, rows_max, monkeypatch):
    """Whichever kernel a few-row pass takes on this path (the GEMM, or the multi-row GEMV that avx512 picks for
    up to 7 rows), every step's logits equal the sequence run alone."""
    monkeypatch.setitem(model_mod.ROWS_GEMV_MAX, K.active(), rows_max)
    m, _, stores = synth
    rng = np.random.default_rng(5)
    seqs = {s: rng.integers(0, m.V, n).tolist() for s, n in enumerate([45, 20, 70, 5, 33])}
    store = Store(stores[head])
    # alone: the contiguous single-sequence model, whole sequence at once
    model = Model(store, n_ctx=256)
    want = {s: model.forward(ids) for s, ids in seqs.items()}
    # alone through the paged model, one token at a time (the GEMV path)
    d = _Driver(store)
    for s in (1, 3):
        got = np.concatenate([d.step([(s, [t])])[s] for t in seqs[s]])
        np.testing.assert_array_equal(got, want[s])
    # batched: random chunks per sequence, several sequences per step, decode rows beside prefill chunks
    d = _Driver(store)
    done = {s: 0 for s in seqs}
    got = {s: [] for s in seqs}
    steps = 0
    while any(done[s] < len(seqs[s]) for s in seqs):
        work = []
        for s in seqs:
            left = len(seqs[s]) - done[s]
            if left and rng.random() < 0.8:
                n = 1 if rng.random() < 0.4 else int(rng.integers(1, left + 1))
                work.append((s, seqs[s][done[s]: done[s] + n]))
                done[s] += n
        if not work:
            continue
        steps += 1
        for s, lg in d.step(work).items():
            got[s].append(lg)
    assert steps > 5
    for s in seqs:
        np.testing.assert_array_equal(np.concatenate(got[s]), want[s])


def test_batched_q8_kv_equals_alone(synth):
    """int8 pages: every row of a batched step (decode rows beside prefill chunks) equals the sequence alone in the
    contiguous int8 cache, bit for bit."""
    m, _, stores = synth
    rng = np.random.default_rng(8)
    seqs = {s: rng.integers(0, m.V, n).tolist() for s, n in enumerate([45, 20, 70, 5])}
    store = Store(stores["f16"])
    model = Model(store, n_ctx=256, kv_dtype="q8")
    want = {s: model.forward(ids) for s, ids in seqs.items()}
    d = _Driver(store, kv_dtype="q8")
    done = {s: 0 for s in seqs}
    got = {s: [] for s in seqs}
    while any(done[s] < len(seqs[s]) for s in seqs):
        work = []
        for s in seqs:
            left = len(seqs[s]) - done[s]
            if left:
                n = 1 if rng.random() < 0.5 else int(rng.integers(1, left + 1))
                work.append((s, seqs[s][done[s]: done[s] + n]))
                done[s] += n
        for s, lg in d.step(work).items():
            got[s].append(lg)
    for s in seqs:
        np.testing.assert_array_equal(np.concatenate(got[s]), want[s])


# ---- the engine -----------------------------------------------------------------------------------------------

def _prompts(V, n, rng, lo=3, hi=60):
    return [rng.integers(1, V, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_greedy_same_alone_and_with_15_others(synth):
    m, _, stores = synth
    prompts = _prompts(m.V, 16, np.random.default_rng(1))
    llm = load_model(stores["i8"], ctx=256, progress=False)
    alone = [_tokens(llm.generate(p, GREEDY, max_tokens=12)) for p in prompts]
    llm.close()
    with running_engine(stores["i8"], ctx=256, parallel=16) as eng:
        streams = [eng.submit(p, GREEDY, max_tokens=12) for p in prompts]
        outs = [_collect(s) for s in streams]
        assert [_tokens(o) for o in outs] == alone
        for o in outs:
            assert o[-1].finish_reason in ("length", "eos") and o[-1].stats.n_generated >= 1
        one = _collect(eng.submit(prompts[3], GREEDY, max_tokens=12))
        assert _tokens(one) == alone[3]
        from test_generate import _check_running_stats

        for p, o in zip(prompts, outs):   # every chunk carries the running Stats, as LLM.generate's do
            _check_running_stats(o, len(p))
        met = eng.metrics()
        assert met["requests_total"] == 17 and met["running"] == 0 and met["waiting"] == 0
        # nothing held but the prefix index; dropping it returns every page
        assert met["kv_pages_used"] == met["kv_pages_cached"]
        _assert_every_page_returns(eng)


def test_cancel_frees_pages_and_close_cancels(synth):
    m, _, stores = synth
    with running_engine(stores["f16"], ctx=256, parallel=4) as eng:
        # cancelled on the scheduler thread after its third token (so how far it got is fixed), and submitted
        # there too, so that `stream` holds it before the first step can call back
        stream = []
        got = _Chunks(then=lambda ch: len(ch) == 3 and stream[0].cancel())
        sampled = SamplingParams(temperature=0.9, seed=3)
        eng.run_in_scheduler(lambda: stream.append(eng.submit(list(range(1, 50)), sampled, max_tokens=200,
                                                              callback=got)))
        got.wait()
        assert got[-1].finish_reason == "cancelled" and got[-1].stats.n_generated == 3
        _assert_every_page_returns(eng)
        # close() ends what is in flight with "cancelled"
        s2 = eng.submit(list(range(1, 20)), GREEDY, max_tokens=10_000)
        s3 = eng.submit(list(range(1, 20)), GREEDY, max_tokens=10_000)
    for st in (s2, s3):
        assert _collect(st)[-1].finish_reason in ("cancelled", "context", "eos")


def test_end_now_gives_the_final_chunk_at_once_and_nothing_after(synth):
    """Stream.end_now() (a server at its drain deadline): the consumer's final chunk ("stop", with the running
    stats) comes from the calling thread, not at the engine's next step; what the engine makes after it, its own
    "cancelled" end included, is dropped; the sequence's pages come back."""
    m, _, stores = synth
    with running_engine(stores["f16"], ctx=256, parallel=4) as eng:
        third = threading.Event()
        got = _Chunks(then=lambda ch: len(ch) == 3 and third.set())
        stream = eng.submit(list(range(1, 50)), GREEDY, max_tokens=200, callback=got)
        assert third.wait(120)
        stream.end_now("stop")
        assert got.finished.is_set() and got[-1].finish_reason == "stop" and got[-1].stats is not None
        n = len(got)
        deadline = time.monotonic() + 60
        while eng.metrics()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.metrics()["running"] == 0
        assert len(got) == n and [c.finish_reason for c in got].count(None) == n - 1   # one end, the last
        stream.end_now("stop")   # ended: nothing more
        assert len(got) == n
        _assert_every_page_returns(eng)


def test_end_now_ends_a_waiting_request_with_its_reason_whichever_end_comes_first(synth):
    """Engine.end_now(streams, "stop", "unavailable") (a server at its drain deadline) for requests still waiting
    for a slot: each ends "unavailable" (a 503 to retry) also when the scheduler's own "cancelled" end for it comes
    before end_now() reaches it. That order ended it "cancelled" (a 200 with nothing) now and then in a server's
    drain; here it is made certain: the first stream end_now() ends delivers its end to a callback (on this
    thread) that waits for the scheduler to end the second, queued before it."""
    m, _, stores = synth
    with running_engine(stores["f16"], ctx=256, parallel=1) as eng:
        running = iter(eng.submit(list(range(1, 20)), GREEDY, max_tokens=40, ignore_eos=True))
        assert next(running).finish_reason is None   # it holds the one slot (the iterator kept: not abandoned)
        first = _Chunks()   # queued first: the scheduler comes to it first
        second = _Chunks(then=lambda got: got[-1].finish_reason and first.finished.wait(60))
        a = eng.submit(list(range(1, 10)), GREEDY, max_tokens=20, callback=first)
        b = eng.submit(list(range(1, 12)), GREEDY, max_tokens=20, callback=second)
        eng.end_now([b, a], "stop", "unavailable")
        assert first.finished.is_set(), "the scheduler never ended the first: nothing was tested"
        assert [c.finish_reason for c in first] == ["unavailable"] and a.finish_reason == "unavailable", \
            [c.finish_reason for c in first]
        assert second.wait()[-1].finish_reason == "unavailable"
        assert [c.finish_reason for c in running][-1] == "length"


def test_a_stream_iterated_by_two_threads_ends_in_both(synth):
    """Two threads iterating one Stream share its chunks; the one that does not take the final chunk ends too,
    instead of waiting on the queue forever (a consumer handing the stream to a worker thread hung at exit)."""
    m, _, stores = synth
    with running_engine(stores["f16"], ctx=256, parallel=4) as eng:
        stream = eng.submit(list(range(1, 30)), GREEDY, max_tokens=6, ignore_eos=True)
        got = {0: [], 1: []}

        def take(i):
            for c in stream:
                got[i].append(c)

        threads = [threading.Thread(target=take, args=(i,), daemon=True) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a thread iterating the stream never ended"
        chunks = got[0] + got[1]
        assert [c.finish_reason for c in chunks].count(None) == len(chunks) - 1
        assert len(_tokens(chunks)) == 6
        assert list(stream) == []   # drained: iterating again gives nothing, at once
        _assert_every_page_returns(eng)


def test_prefix_sharing_reuses_pages_and_cow_keeps_outputs(synth):
    m, _, stores = synth
    rng = np.random.default_rng(9)
    a = rng.integers(1, m.V, 100).tolist()
    b = a[:80] + rng.integers(1, m.V, 30).tolist()
    c = a[:40] + rng.integers(1, m.V, 20).tolist()
    fresh = {}
    for name, p in (("a", a), ("b", b), ("c", c)):
        e = load_engine(stores["f16"], ctx=256, parallel=4, progress=False)
        fresh[name] = _tokens(_collect(e.submit(p, GREEDY, max_tokens=8)))
        e.close()
    with running_engine(stores["f16"], ctx=256, parallel=4) as eng:
        out_a = _collect(eng.submit(a, GREEDY, max_tokens=8))
        assert _tokens(out_a) == fresh["a"]
        n_a = out_a[-1].stats.n_prompt + out_a[-1].stats.n_generated - 1   # positions computed
        assert eng.metrics()["kv_pages_cached"] == n_a // PAGE_TOKENS == 3
        out_b = _collect(eng.submit(b, GREEDY, max_tokens=8))
        # two whole pages and 16 positions of a third (copied before B writes into it)
        assert out_b[-1].stats.n_cached == 80
        assert _tokens(out_b) == fresh["b"]
        met = eng.metrics()
        assert met["prefix_hits_tokens"] == 80
        assert met["kv_pages_cached"] == 4   # B added only its own third page; the first two are A's
        # A again (its pages were shared and one was copied by B): same output; C and A side by side too
        sa = eng.submit(a, GREEDY, max_tokens=8)
        sc = eng.submit(c, GREEDY, max_tokens=8)
        out_a2, out_c = _collect(sa), _collect(sc)
        assert out_a2[-1].stats.n_cached == 96 and _tokens(out_a2) == fresh["a"]
        assert out_c[-1].stats.n_cached == 40 and _tokens(out_c) == fresh["c"]
        _assert_every_page_returns(eng)


def test_pool_exhaustion_waits_and_does_not_corrupt(synth):
    m, _, stores = synth
    prompts = _prompts(m.V, 6, np.random.default_rng(4), lo=35, hi=45)
    llm = load_model(stores["f16"], ctx=128, progress=False)
    alone = [_tokens(llm.generate(p, GREEDY, max_tokens=30)) for p in prompts]
    llm.close()
    # 4 pages: each request needs 3 (up to 74 positions), so one runs at a time and the others wait
    eng = load_engine(stores["f16"], ctx=128, parallel=6, kv_pool_tokens=128, progress=False)
    states = []   # read right after the step that made the first request's first token
    first = _Chunks(then=lambda ch: len(ch) == 1 and states.extend(sl["state"] for sl in eng.slots()))
    try:
        streams = _submit_together(eng, [(prompts[0], GREEDY, {"max_tokens": 30, "callback": first})]
                                   + [(p, GREEDY, {"max_tokens": 30}) for p in prompts[1:]])
        outs = [first.wait()] + [_collect(s) for s in streams[1:]]
        assert [_tokens(o) for o in outs] == alone
        assert all(o[-1].finish_reason in ("length", "eos") for o in outs)
        assert states == ["running"] + ["waiting"] * 5, states
        eng.check_consistency()
    finally:
        eng.close()


def test_a_prefix_computed_twice_is_not_promised_to_a_third_request(synth):
    """Two requests with the same long prefix admitted in one step both compute it; the second's later pages go
    into the index under the first one's prefix pages. Once the first ends, those prefix pages are held by the index
    alone but cannot be freed while the second runs: a third request must wait for them, not be admitted on them
    (its pages then failed to allocate and the sequence ended in an engine error)."""
    m, _, stores = synth
    rng = np.random.default_rng(8)
    prefix = rng.integers(1, m.V, 5 * PAGE_TOKENS).tolist()
    a, b = rng.integers(1, m.V, 40).tolist(), rng.integers(1, m.V, 40).tolist()
    third = rng.integers(1, m.V, 230).tolist()
    eng = load_engine(stores["f16"], ctx=256, parallel=2, progress=False)   # the pool: 2 x (256 + 32) tokens
    try:
        late, submitted = [], threading.Event()   # the third request, submitted at the step the first one ends

        def then(ch):
            if ch[-1].finish_reason and not late:
                late.append(eng.submit(third, GREEDY, max_tokens=26, ignore_eos=True))
                submitted.set()
        first = _Chunks(then=then)
        streams = _submit_together(eng, [(prefix + a, GREEDY, {"max_tokens": 1, "callback": first}),
                                         (prefix + b, GREEDY, {"max_tokens": 56, "ignore_eos": True})])
        assert submitted.wait(120)
        third_out, second_out = _collect(late[0]), _collect(streams[1])
        assert third_out[-1].finish_reason == "length" and len(_tokens(third_out)) == 26
        assert second_out[-1].finish_reason == "length"
        assert eng.metrics()["sequence_errors_total"] == 0
        eng.check_consistency()
    finally:
        eng.close()


def test_n_choices_to_the_context_s_end_fit_the_default_pool_or_are_refused(synth):
    """n = parallel choices, each allowed to run to the context's end, need a context of pages each plus one for
    their shared partial page: the default pool holds that (they ran, and answered); a pool that can never hold a
    request refuses it at submit, naming n, where it used to wait for ever with every request behind it."""
    from bitnet_cpu.engine.errors import BitNetError
    m, _, stores = synth
    prompt = [1, 5, 9]
    with running_engine(stores["f16"], ctx=128, parallel=2, threads=1) as eng:
        streams = eng.submit_n(prompt, GREEDY, 2, max_tokens=500, ignore_eos=True)
        outs = [_collect(s) for s in streams]
        assert [len(_tokens(o)) for o in outs] == [126, 126] and outs[0][-1].finish_reason == "context"
        eng.check_consistency()
    with running_engine(stores["f16"], ctx=128, parallel=2, threads=1, kv_pool_tokens=256) as eng:
        with pytest.raises(BitNetError, match="^n 2: .*need 9 pages .* holds 8"):
            eng.submit_n(prompt, GREEDY, 2, max_tokens=500)
        # a limit that fits is admitted, and an unrelated request behind it is not held up
        outs = [_collect(s) for s in eng.submit_n(prompt, GREEDY, 2, max_tokens=60, ignore_eos=True)]
        assert [len(_tokens(o)) for o in outs] == [60, 60]
        assert len(_tokens(_collect(eng.submit(prompt, GREEDY, max_tokens=4, ignore_eos=True)))) == 4


def test_submit_errors(synth):
    m, _, stores = synth
    eng = load_engine(stores["f16"], ctx=64, parallel=1, max_queue=2, progress=False)
    try:
        with pytest.raises(ContextOverflowError):
            eng.submit(list(range(1, 80)))
        # a callback that blocks holds the scheduler thread: nothing leaves the queue meanwhile
        release, entered = threading.Event(), threading.Event()

        def hold(c):
            entered.set()
            release.wait(60)

        running = eng.submit([1, 2, 3], GREEDY, max_tokens=5, callback=hold)
        assert entered.wait(60)
        queued = [eng.submit([1, 2], GREEDY, max_tokens=5) for _ in range(2)]
        with pytest.raises(QueueFullError):
            eng.submit([1, 2], GREEDY, max_tokens=5)
        assert eng.metrics()["waiting"] == 2
        release.set()
        for s in queued:
            assert _collect(s)[-1].finish_reason in ("length", "eos")
        assert running.finish_reason is not None or eng.metrics()["running"] == 0
    finally:
        release.set()
        eng.close()


def test_a_burst_into_free_slots_is_not_queue_full(synth):
    """max_queue bounds what waits for a slot: requests submitted at once into free slots (not yet admitted, as
    the scheduler takes them at its next step) are no queue, so --parallel 4 --max-queue 1 takes four at once
    plus one waiting (it used to refuse the second), and max_queue 0 takes only what a free slot runs."""
    m, _, stores = synth
    for max_queue, take in ((1, 4), (0, 3)):
        eng = load_engine(stores["f16"], ctx=64, parallel=4, max_queue=max_queue, progress=False)
        release, entered = threading.Event(), threading.Event()

        def hold(c):
            entered.set()
            release.wait(60)
        try:
            running = eng.submit([1, 2, 3], GREEDY, max_tokens=5, callback=hold)
            assert entered.wait(60)   # the scheduler thread is held: nothing more is admitted meanwhile
            burst = [eng.submit([1, 2], GREEDY, max_tokens=5) for _ in range(take)]
            with pytest.raises(QueueFullError):
                eng.submit([1, 2], GREEDY, max_tokens=5)
            release.set()
            for s in burst:
                assert _collect(s)[-1].finish_reason in ("length", "eos")
            assert running.finish_reason is not None or eng.metrics()["running"] == 0
        finally:
            release.set()
            eng.close()
    # n choices need n slots at once: with three free, one n=3 request fits and a second one would wait
    eng = load_engine(stores["f16"], ctx=64, parallel=4, max_queue=0, progress=False)
    release, entered = threading.Event(), threading.Event()
    try:
        eng.submit([1, 2, 3], GREEDY, max_tokens=5, callback=hold)
        assert entered.wait(60)
        three = eng.submit_n([1, 2], GREEDY, 3, max_tokens=3)
        with pytest.raises(QueueFullError, match="never wait"):
            eng.submit_n([1, 2], GREEDY, 3, max_tokens=3)
        release.set()
        for s in three:
            assert _collect(s)[-1].finish_reason in ("length", "eos")
    finally:
        release.set()
        eng.close()


def test_random_submit_cancel_two_threads(synth):
    m, _, stores = synth
    eng = load_engine(stores["f16"], ctx=128, parallel=4, kv_pool_tokens=320, max_batch_tokens=48,
                      max_queue=1000, progress=False)
    shared = np.random.default_rng(0).integers(1, m.V, 70).tolist()
    streams, lock = [], threading.Lock()
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        mine = []
        try:
            for _ in range(100):
                if mine and rng.random() < 0.4:
                    mine[int(rng.integers(len(mine)))].cancel()
                else:
                    k = int(rng.integers(0, 70))
                    p = shared[:k] + rng.integers(1, m.V, int(rng.integers(1, 30))).tolist()
                    sp = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=int(rng.integers(1000)))
                    s = eng.submit(p, sp, max_tokens=int(rng.integers(0, 20)))
                    mine.append(s)
                    with lock:
                        streams.append(s)
                if rng.random() < 0.2:
                    time.sleep(0.002)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        ts = [threading.Thread(target=worker, args=(i,)) for i in (1, 2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors
        reasons = [_collect(s)[-1].finish_reason for s in streams]
        assert len(reasons) > 100 and set(reasons) <= {"length", "eos", "cancelled", "context"}
        assert "cancelled" in reasons
        met = eng.metrics()
        assert met["running"] == 0 and met["waiting"] == 0 and met["kv_pages_reserved"] == 0
        _assert_every_page_returns(eng)
        # still serving correctly afterwards
        assert _collect(eng.submit([1, 2, 3], GREEDY, max_tokens=3))[-1].finish_reason in ("length", "eos")
    finally:
        eng.close()


def test_engine_attributes(synth):
    m, _, stores = synth
    with running_engine(stores["f16"], ctx=64, parallel=2) as eng:
        assert isinstance(eng, Engine) and eng.n_ctx == 64 and eng.config.vocab_size == m.V and eng.name
        ids = eng.tokenize("hello world")
        assert eng.detokenize(ids) == "hello world"
        assert eng.chat_prompt([{"role": "user", "content": "hi"}])
        assert eng.slots() == []


def test_pool_size_in_mib_and_bad_sizes(synth):
    from bitnet_cpu.engine.errors import BitNetError

    m, _, stores = synth
    cfg = Store(stores["f16"]).config
    per_tok = KVPool.bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, "f16")
    with running_engine(stores["f16"], ctx=64, parallel=2, kv_pool_mib=per_tok * 256 / 2**20) as eng:
        assert eng.metrics()["kv_pages_total"] == 256 // PAGE_TOKENS
    # int8 pages in the same MiB: (128 + 4) / 256 of the bytes per token at head_dim 128, so ~1.9x the pages
    per_q8 = KVPool.bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, "q8")
    assert per_q8 == 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + 4)
    eng = load_engine(stores["f16"], ctx=64, parallel=2, kv_pool_mib=per_tok * 256 / 2**20, kv_dtype="q8",
                      progress=False)
    try:
        got = eng.metrics()
        assert got["kv_pages_total"] == -(-(per_tok * 256 // per_q8) // PAGE_TOKENS) > 256 // PAGE_TOKENS
        assert got["kv_dtype"] == "q8" and got["kv_pool_bytes"] == got["kv_pages_total"] * PAGE_TOKENS * per_q8
    finally:
        eng.close()
    with pytest.raises(BitNetError, match="q8"):
        load_engine(stores["f16"], ctx=64, kv_dtype="int4", progress=False)
    with pytest.raises(BitNetError):   # smaller than one context
        load_engine(stores["f16"], ctx=256, kv_pool_tokens=64, progress=False)
    with pytest.raises(BitNetError):
        load_engine(stores["f16"], ctx=64, kv_pool_tokens=64, kv_pool_mib=1, progress=False)


@pytest.mark.parametrize("raised", [RuntimeError("consumer went away"), SystemExit(0), KeyboardInterrupt()])
def test_failing_callback_cancels_only_its_request(synth, capsys, raised):
    """A callback that raises ends its own request; the engine serves the others and later ones. A sys.exit() or
    a KeyboardInterrupt in it stopped the engine for good ("the engine stopped after an internal error: 0")."""
    m, _, stores = synth
    with running_engine(stores["f16"], ctx=128, parallel=4) as eng:
        def bad(chunks):
            raise raised

        got = _Chunks(then=bad)
        eng.submit([1, 2, 3, 4], GREEDY, max_tokens=50, callback=got)
        ok = eng.submit([5, 6, 7], GREEDY, max_tokens=5)
        assert _collect(ok)[-1].finish_reason in ("length", "eos")
        assert got.wait()[-1].finish_reason == "cancelled"
        assert type(raised).__name__ in capsys.readouterr().err
        assert _collect(eng.submit([5, 6, 7], GREEDY, max_tokens=5))[-1].finish_reason in ("length", "eos")
        eng.check_consistency()


def test_ignore_eos_matches_generate(synth):
    m, _, stores = synth
    llm = load_model(stores["f16"], ctx=128, progress=False)
    eos = llm.tokenizer.eos_ids
    p = [5, 6, 7, 8]
    want = _tokens(llm.generate(p, SamplingParams(temperature=1.5, seed=4), max_tokens=40, ignore_eos=True))
    llm.close()
    with running_engine(stores["f16"], ctx=128, parallel=2) as eng:
        out = _collect(eng.submit(p, SamplingParams(temperature=1.5, seed=4), max_tokens=40, ignore_eos=True))
        assert _tokens(out) == want and len(want) == 40 and not set(want) & set(eos)
        assert out[-1].finish_reason == "length"


def test_llama_architecture_model_batched_equals_alone(tmp_path):
    """Models without sub-norms (Falcon3 / TriLM style) through the batched forward: same logits as alone."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, write_hf_dir

    m = SynthModel({"head_dim": 64, "vocab_size": 640}, seed=8, style="llama")
    d = write_hf_dir(m, str(tmp_path / "ternary-llama"), form="packed", linear_class="autobitlinear")
    store = Store(convert(d, str(tmp_path / "tl.bnstore"), lm_head="i8", progress=False))
    assert store.config.sub_norms is False
    _assert_batched_equals_alone(store, seed=3)


def _assert_batched_equals_alone(store, seed):
    """Three sequences stepped together (1..19 rows each) give the logits each gives alone."""
    rng = np.random.default_rng(seed)
    seqs = {s: rng.integers(0, store.config.vocab_size, n).tolist() for s, n in enumerate([30, 12, 41])}
    model = Model(store, n_ctx=128)
    want = {s: model.forward(ids) for s, ids in seqs.items()}
    drv = _Driver(store, n_ctx=128)
    got = {s: [] for s in seqs}
    for lo, hi in [(0, 10), (10, 11), (11, 30), (30, 41)]:
        work = [(s, ids[lo:hi]) for s, ids in seqs.items() if ids[lo:hi]]
        for s, lg in drv.step(work).items():
            got[s].append(lg)
    for s in seqs:
        np.testing.assert_array_equal(np.concatenate(got[s]), want[s])


def test_group_scaled_qwen3_model_batched_equals_alone(tmp_path):
    """Ternary Bonsai (tg128 weights, per-group activations, q/k norms) through the batched forward: the same
    logits as alone, bit for bit (each row is quantized and accumulated on its own)."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, write_bonsai_dir

    m = SynthModel({"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 64, "vocab_size": 640, "tie_word_embeddings": True}, seed=9, style="llama")
    d = write_bonsai_dir(m, str(tmp_path / "Ternary-Bonsai-tiny-unpacked"))
    store = Store(convert(d, str(tmp_path / "tb.bnstore"), progress=False))
    assert store.config.weight_groups == 128 and store.config.qk_norm
    _assert_batched_equals_alone(store, seed=4)


# ---- prompt lookup (speculative decoding) in the batching engine -------------------------------------------

def _index_pages(eng):
    """{token-key path of every prefix-index node: (K bytes, V bytes)} read on the scheduler thread."""
    def read():
        out, stack = {}, [((), n) for n in eng.prefix.root.children.values()]
        while stack:
            path, n = stack.pop()
            path = path + (n.key,)
            out[path] = (eng.pool.k[:, n.page].tobytes(), eng.pool.v[:, n.page].tobytes())
            stack.extend((path, c) for c in n.children.values())
        return out
    return eng.run_in_scheduler(read)


def _lookup_workload(V):
    """A shared system prompt (a full page plus a part of the next, so requests copy a shared page), then
    repetitive and random user parts; greedy, seeded and penalized sampling."""
    rng = np.random.default_rng(21)
    system = rng.integers(1, V, 45).tolist()
    rep = [[5, 9, 13, 2, 7, 21, 4] * 6, [3, 8, 8, 4, 11] * 7, [17, 30, 2] * 10, [40, 41, 42, 43, 44, 45] * 5]
    rand = [rng.integers(1, V, 25).tolist() for _ in range(2)]
    params = [GREEDY, SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=0.7, seed=11),
              SamplingParams(temperature=0.0, repeat_penalty=1.2), GREEDY, SamplingParams(temperature=1.0, seed=5)]
    return system, [(system + u, sp) for u, sp in zip(rep + rand, params)]


def _run_workload(store, lookup, system, work, max_batch_tokens=256, max_tokens=48):
    with running_engine(store, ctx=256, parallel=8, max_batch_tokens=max_batch_tokens, lookup=lookup) as eng:
        # the system prompt alone first, so that every request below finds its pages in the prefix index
        outs = [_collect(eng.submit(system + [1, 2, 3] * 8, GREEDY, max_tokens=4))]
        streams = _submit_together(eng, [(p, sp, {"max_tokens": max_tokens}) for p, sp in work])
        outs += [_collect(s) for s in streams]
        met = eng.metrics()
        pages = _index_pages(eng)
        assert met["running"] == 0 and met["kv_pages_reserved"] == 0
        assert met["kv_pages_used"] == met["kv_pages_cached"]  # nothing held but the prefix index
        _assert_every_page_returns(eng)
        return outs, met, pages


@pytest.mark.parametrize("head,max_batch_tokens", [("i8", 256), ("f16", 256), ("i8", 10)])
def test_lookup_same_streams_as_without(synth, head, max_batch_tokens):
    """Several concurrent requests (repetitive and not; greedy, seeded, penalized) after a prefix-shared system
    prompt: the same chunks with lookup on as off, drafts accepted, every page freed, and the prefix index
    holding the same blocks with bit-identical K/V (no page with a rejected draft position was indexed). A
    budget of 10 rows for 7 sequences leaves drafts only the rows the decode rows do not use."""
    from bitnet_cpu.engine.runtime.speculative import LookupParams

    m, _, stores = synth
    system, work = _lookup_workload(m.V)
    off, met_off, pages_off = _run_workload(stores[head], None, system, work, max_batch_tokens)
    assert met_off["lookup_drafted_total"] == 0
    for lk in (LookupParams(draft_max=4), LookupParams(draft_max=7, ngram_min=1)):
        on, met, pages = _run_workload(stores[head], lk, system, work, max_batch_tokens)
        assert [[(c.text, c.token, c.finish_reason) for c in o] for o in on] == \
               [[(c.text, c.token, c.finish_reason) for c in o] for o in off], lk
        assert met["prefix_hits_tokens"] == met_off["prefix_hits_tokens"] > 0
        assert 0 < met["lookup_accepted_total"] <= met["lookup_drafted_total"], met
        # drafts only take rows the decode rows leave, so they never cost a step; whether they save one depends
        # on whether the longest stream had drafts accepted, which depends on the streams' numbers, not on lookup
        # working (under qemu on aarch64 this workload took 52 steps with lookup and without)
        assert met["steps_total"] <= met_off["steps_total"]
        assert sum(o[-1].stats.n_accepted for o in on) == met["lookup_accepted_total"]
        assert sum(o[-1].stats.n_drafted for o in on) == met["lookup_drafted_total"]
        assert pages.keys() == pages_off.keys() and pages == pages_off


def test_lookup_finish_inside_a_draft_stops_where_plain_decoding_stops(synth):
    """max_tokens, a stop string and an end-of-text token that land on a token accepted from a draft (rows
    after it were computed too): the stream ends exactly where it ends without lookup, pages all freed."""
    from bitnet_cpu.engine.runtime.speculative import LookupParams

    m, _, stores = synth
    p0 = [1] + [5, 9, 13, 2, 7, 21, 4] * 6
    off = load_engine(stores["i8"], ctx=256, parallel=4, progress=False)
    on = load_engine(stores["i8"], ctx=256, parallel=4, progress=False, lookup=LookupParams(draft_max=6))
    accepted: list[int] = []     # indices (in the output) of the tokens the last `on` request accepted from drafts
    sample_draft = on._sample_draft

    def spy(s, logits, li):
        n0, a0 = s.n_gen, s.n_accepted
        r = sample_draft(s, logits, li)
        accepted.extend(range(n0, n0 + s.n_accepted - a0))
        return r

    on._sample_draft = spy

    def both(prompt, params, max_tokens=40, stop=()):
        return [[(c.text, c.token, c.finish_reason, c.said)
                 for c in _collect(e.submit(prompt, params, max_tokens=max_tokens, stop=stop))] for e in (off, on)]

    try:
        toks0 = _tokens(_collect(off.submit(p0, GREEDY, max_tokens=40)))
        n_eos = n_stop = 0
        # prompts that end in the model's own output: the continuation repeats them, drafts copy from the prompt
        for prompt, params in [(p0, GREEDY), (p0 + toks0[:6], GREEDY), (p0 + toks0[:4], GREEDY),
                               (p0 + toks0[:6], SamplingParams(temperature=0.6, seed=2)),
                               (p0, SamplingParams(temperature=0.9, seed=3))]:
            accepted.clear()
            a, b = both(prompt, params)
            assert a == b and a[-1][2] == "length"
            assert accepted, "no draft token was accepted"
            toks = [t for _, t, _, _ in a if t is not None]
            pieces = [x for x, t, _, _ in a if t is not None]
            cut = accepted[:: max(1, len(accepted) // 5)]     # a few accepted positions, spread over the output
            for n in sorted({1, 2, 40} | {i + 1 for i in cut} | {i + 2 for i in cut}):   # max_tokens
                x, y = both(prompt, params, max_tokens=n)
                assert x == y and [t for _, t, _, _ in x if t is not None] == toks[:n] and x[-1][2] == "length"
            first = [i for i in accepted if toks[i] not in toks[:i]]
            for i in sorted(set(cut + first[:3])):
                if pieces[i]:   # a stop string first complete at token i
                    text = "".join(pieces[: i + 1])
                    before = "".join(pieces[:i])
                    stop = next(text[-k:] for k in range(1, len(text) + 1) if text[-k:] not in before)
                    x, y = both(prompt, params, stop=[stop])
                    assert x == y and x[-1][2] == "stop", stop
                    assert "".join(c for c, _, _, _ in x) == text[: len(text) - len(stop)]
                    starts = [len("".join(pieces[:j])) for j in range(i + 1)]   # the tokens before the cut
                    assert x[-1][3] == sum(1 for s in starts if s < len(text) - len(stop))
                    n_stop += 1
                if toks[i] not in toks[:i]:   # an end-of-text token first sampled at i
                    for e in (off, on):
                        e._eos = {toks[i]}
                    try:
                        x, y = both(prompt, params)
                    finally:
                        for e in (off, on):
                            e._eos = set(e.tokenizer.eos_ids)
                    assert x == y and x[-1][2] == "eos"
                    assert [t for _, t, _, _ in x if t is not None] == toks[:i]
                    n_eos += 1
        assert n_stop > 0 and n_eos > 0, (n_stop, n_eos)
        for e in (off, on):
            _assert_every_page_returns(e)
    finally:
        off.close()
        on.close()


def test_lookup_drafts_only_fill_the_rows_left(synth):
    """With a budget of 6 rows and 4 sequences: every decoding sequence gets its row in every step and drafts
    get only what is left (never past the budget, never past the step's logit rows); output as without."""
    from bitnet_cpu.engine.runtime.speculative import LookupParams

    m, _, stores = synth
    prompts = [[1] + [5, 9, 13, 2, 7, 21, 4] * 6, [1] + [3, 8, 8, 4, 11] * 7, [1] + [17, 30, 2] * 10, [6, 7, 8]]
    outs = {}
    for lk in (None, LookupParams(draft_max=4, ngram_min=1)):
        eng = load_engine(stores["i8"], ctx=256, parallel=4, max_batch_tokens=6, progress=False, lookup=lk)
        seen = []
        plan_drafts = eng._plan_drafts

        def spy(plan, budget):
            decoding = {s.id for s in eng._running if s.n_gen > 0 and len(s.tokens) - s.n_past == 1}
            assert decoding <= {s.id for s, _ in plan}          # decode rows first, for every sequence
            left = plan_drafts(plan, budget)
            rows = sum(r for _, r in plan)
            assert rows <= 6 and left == 6 - rows >= 0
            seen.append((len(decoding), rows))
            return left

        eng._plan_drafts = spy
        try:
            streams = _submit_together(eng, [(p, GREEDY, {"max_tokens": 40}) for p in prompts])
            outs[lk] = [_tokens(_collect(s)) for s in streams]
            met = eng.metrics()
            eng.check_consistency()
        finally:
            eng.close()
        if lk is not None:
            assert met["lookup_accepted_total"] > 0
            assert any(d >= 2 and rows > d for d, rows in seen)   # drafts beside other sequences' decode rows
    assert outs[None] == outs[LookupParams(draft_max=4, ngram_min=1)]


def test_base3_weights_batched_equal_alone_and_equal_tile16(tmp_path):
    """A model converted with --weights t1.6 (tile16b3) through the batched forward gives the logits it gives
    alone, and those equal the t2 (tile16) conversion's bit for bit."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    m = SynthModel(small_config(), seed=12)
    d = write_hf_dir(m, str(tmp_path / "hf"))
    b3 = Store(convert(d, str(tmp_path / "b3.bnstore"), lm_head="i8", weights="t1.6", progress=False))
    t2 = Store(convert(d, str(tmp_path / "t2.bnstore"), lm_head="i8", progress=False))
    assert b3.info("blk.0.ffn_down")["layout"] == "tile16b3" and b3.meta["weights"] == "t1.6"
    _assert_batched_equals_alone(b3, seed=5)
    ids = np.random.default_rng(6).integers(0, m.V, 40).tolist()
    np.testing.assert_array_equal(Model(b3, n_ctx=64).forward(ids), Model(t2, n_ctx=64).forward(ids))


@pytest.mark.parametrize("kv", ["f16", "q8"])
def test_a_pool_of_one_context_serves_a_prompt_that_matches_a_cached_page_in_part(kv):
    """The smallest pool load_engine takes (one context's pages), its cached pages left by earlier prompts, then a
    request sharing their first tokens (part of a page) that needs the whole pool: it runs (the partly matched
    page, held, was not evictable and saved nothing, so its promise was one page short for ever: nothing ran to
    free one, and every request behind it waited too)."""
    with running_engine(None, ctx=512, threads=1, parallel=4, kv_pool_tokens=512, kv_dtype=kv) as eng:
        ids = eng.tokenize("Once upon a time there was a cat named Tom. " * 30)
        for p in (ids[:200], ids[:210]):   # pages left in the prefix index
            _collect(eng.submit(p, GREEDY, max_tokens=200))
        big, after = _Chunks(), _Chunks()
        eng.submit(ids[:10], GREEDY, max_tokens=600, callback=big)
        eng.submit(ids[:10], GREEDY, max_tokens=5, callback=after)
        big.wait()
        after.wait()
        assert big[-1].finish_reason in ("length", "eos") and after[-1].finish_reason in ("length", "eos")
        _assert_every_page_returns(eng)
