"""Decode's thread-count tuner (engine/runtime/thread_tuner.py): pure logic driven with step times, so every
branch is reachable without a busy machine; and its place in Model (default count only, prefill untouched)."""
import numpy as np
import pytest

from bitnet_cpu.engine.errors import BitNetError

from bitnet_cpu.engine.runtime import thread_tuner as T
from bitnet_cpu.engine.runtime.thread_tuner import ThreadTuner


def drive(tuner, cost, steps):
    """Run `steps` decode steps where a step on n threads takes cost(n, step) seconds; returns the counts used."""
    used = []
    for i in range(steps):
        n = tuner.threads()
        used.append(n)
        tuner.record(cost(n, i))
    return used


def test_idle_machine_keeps_the_default_and_backs_off():
    t = ThreadTuner(2)
    used = drive(t, lambda n, i: 0.025 if n == 2 else 0.038, 3000)
    assert t.cur == 2 and t.switches == 0
    probes = sum(1 for n in used if n == 1)
    assert 0 < probes <= 8 * 8          # a handful of 8-step windows, gaps doubling up to MAX_GAP
    assert t.gap == T.MAX_GAP


def test_busy_core_switches_to_one_thread_fewer_and_back():
    t = ThreadTuner(4)
    busy = {"on": True}

    def cost(n, i):
        if busy["on"]:
            return 0.030 if n == 3 else 0.045      # one core taken: 3 threads beat 4
        return 0.020 if n == 4 else 0.026

    used = drive(t, cost, 200)
    assert t.cur == 3 and t.switches == 1 and used[-1] == 3
    assert used.index(3) <= T.FIRST_GAP + T.WINDOW   # found at the first probe
    busy["on"] = False                                 # the other process ends
    used = drive(t, cost, 400)
    assert t.cur == 4 and t.switches == 2


def test_a_small_difference_does_not_switch():
    t = ThreadTuner(2)
    drive(t, lambda n, i: 0.030 if n == 2 else 0.030 * (1 - T.GAIN / 2), 500)
    assert t.cur == 2 and t.switches == 0


def test_a_slowdown_brings_the_next_probe_forward():
    t = ThreadTuner(2)
    drive(t, lambda n, i: 0.025 if n == 2 else 0.038, 2000)      # backed off ...
    for _ in range(T.MAX_GAP + T.WINDOW):                           # ... to just after a probe
        if t.next_probe - t.steps > 4 * T.FIRST_GAP:
            break
        drive(t, lambda n, i: 0.025 if n == 2 else 0.038, 1)
    assert t.next_probe - t.steps > 4 * T.FIRST_GAP
    drive(t, lambda n, i: 0.040 if n == 2 else 0.030, T.WINDOW)   # steps 60% slower now
    assert t.next_probe - t.steps <= T.FIRST_GAP
    drive(t, lambda n, i: 0.040 if n == 2 else 0.030, 3 * T.FIRST_GAP)
    assert t.cur == 1


def test_needs_two_threads():
    with pytest.raises(ValueError):
        ThreadTuner(1)


def test_model_tunes_only_the_default_count(monkeypatch):
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.formats.convert import bundled_model
    from bitnet_cpu.simd import _kernels as K

    path = bundled_model()
    if path is None:
        pytest.skip("no bundled model store")
    monkeypatch.setattr("bitnet_cpu.engine.api.default_threads", lambda: 2)
    try:
        llm = load_model(path, ctx=64, progress=False)                 # no -t: the default, tuned
        m = llm.model
        assert m.tuner is not None and m.tuner.n == 2
        assert load_model(path, ctx=64, threads=2, progress=False).model.tuner is None   # -t 2: as given
        monkeypatch.setenv("BITNET_TUNE_THREADS", "0")
        assert load_model(path, ctx=64, progress=False).model.tuner is None
        for bad in ("off", "false", "no"):   # each left the tuning on, silently; now one line, as every switch
            monkeypatch.setenv("BITNET_TUNE_THREADS", bad)
            with pytest.raises(BitNetError, match=f"BITNET_TUNE_THREADS={bad}: 0 or 1"):
                load_model(path, ctx=64, threads=1, progress=False)
        monkeypatch.setenv("BITNET_TUNE_THREADS", "0")
        # decode on the tuned count, prefill on the default; the outputs do not depend on the count
        m.tuner.cur = 1
        m.prefill([1, 2, 3])
        assert K.get_num_threads() == 2
        a = m.decode(4).copy()
        assert K.get_num_threads() == 1
        m.truncate(3)
        m.tuner.cur = 2
        assert np.array_equal(m.decode(4), a)
    finally:
        K.set_num_threads(0)
