"""Speed of one model step by step: prefill tok/s, decode tok/s and the Python overhead of a decode step.

    python bench/bench_step.py MODEL [-t THREADS] [-p 128] [-n 32]

Lives in bench/ (not in the runtime's generator) so that the engine never imports the synthetic-model writers
or its own public API back: the runtime stays a one-way stack.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time_decode(model, n: int) -> float:
    """Seconds per decode step (median of n), on whatever is in the cache."""
    times = []
    tok = 1
    for _ in range(n):
        t = time.perf_counter()
        model.decode(tok)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def python_overhead_per_step(model, n: int = 200) -> float:
    """Seconds of interpreter + binding overhead in one decode step of `model`: the same decode loop run on
    a tiny synthetic model with the same layer count and LM head kind, where the C work is negligible
    (so this slightly over-estimates the overhead)."""
    import tempfile

    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.runtime.model import Model
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    cfg = model.config
    tiny = SynthModel(small_config(hidden_size=64, intermediate_size=64, num_hidden_layers=cfg.n_layers,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=512), seed=0)
    with tempfile.TemporaryDirectory(prefix="bitnet-overhead-") as d:
        write_hf_dir(tiny, f"{d}/hf")
        store = Store(convert(f"{d}/hf", f"{d}/tiny.bnstore", lm_head=model.lm_head, progress=False))
        m = Model(store, n_ctx=n + 16, kv_dtype=model.kv_dtype)
        m.prefill([1, 2, 3])
        dt = _time_decode(m, n)
        store.close()
    return dt


def main(argv=None) -> int:
    import argparse

    import numpy as np

    from bitnet_cpu.engine.api import load_model

    p = argparse.ArgumentParser(prog="python bench/bench_step.py", description="prefill / decode speed and "
                                "Python overhead per decode step of one model")
    p.add_argument("model")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-p", "--n-prompt", type=int, default=128)
    p.add_argument("-n", "--n-gen", type=int, default=32)
    a = p.parse_args(argv)
    llm = load_model(a.model, ctx=a.n_prompt + a.n_gen + 8, threads=a.threads, progress=False)
    m = llm.model
    ids = np.random.default_rng(0).integers(0, llm.config.vocab_size, a.n_prompt).tolist()
    m.prefill(ids[:4])  # warm the page cache / lazy state
    m.reset()
    t = time.perf_counter()
    m.prefill(ids)
    pre = time.perf_counter() - t
    step = _time_decode(m, a.n_gen)
    over = python_overhead_per_step(m)
    print(f"model {llm.name}: {llm.config.n_layers} layers, hidden {llm.config.hidden_size}, {m.lm_head} head, "
          f"threads {a.threads or 'default'}")
    print(f"prefill {a.n_prompt} tokens: {a.n_prompt / pre:.1f} tok/s")
    print(f"decode: {1 / step:.2f} tok/s ({step * 1000:.1f} ms/step, median of {a.n_gen})")
    print(f"python overhead: {over * 1000:.3f} ms/step = {100 * over / step:.2f}% of the step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
