"""Prompt lookup in the batching engine: aggregate tok/s with lookup off vs on, at 1 and N concurrent
requests on repetitive prompts, with the acceptance rate. Runs are interleaved (off, on, off, on, ...) because
the machine may be shared; min / median / max over the repeats are reported.

    python bench/bench_lookup_batch.py [--model PATH|synth] [--levels 1,8] [--gen 64] [--repeats 3] [--draft-max 4]

--model synth: a small random model (test fixture shape, 1024 hidden, 4 layers) whose greedy output loops;
default: the bundled model (a small story model that repeats the stories it is shown).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _prompts(eng, n: int) -> list[list[int]]:
    story = ("Once upon a time, there was a kind fox named Leo. It was a nice day and the sky was blue. "
             "Leo loved the big city because it was full of things to see. ")
    code = "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n\ndef h(x):\n    return x + "
    base = [story * 3 + "Once upon", story * 2 + "Leo loved the", code * 2, story + story[:60]]
    return [eng.tokenize(base[i % len(base)] + " " * (i // len(base)), add_bos=True) for i in range(n)]


def run_once(eng, prompts, gen: int) -> dict:
    from bitnet_cpu.engine.api import SamplingParams

    m0 = eng.metrics()
    t0 = time.perf_counter()
    streams = [eng.submit(p, SamplingParams(temperature=0.0), max_tokens=gen, ignore_eos=True) for p in prompts]
    n_tok = sum(sum(1 for c in s if c.token is not None) for s in streams)
    dt = time.perf_counter() - t0
    m1 = eng.metrics()
    d = m1["lookup_drafted_total"] - m0["lookup_drafted_total"]
    a = m1["lookup_accepted_total"] - m0["lookup_accepted_total"]
    return {"tps": n_tok / dt, "drafted": d, "accepted": a, "steps": m1["steps_total"] - m0["steps_total"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from bitnet_cpu.engine.api import LookupParams, load_engine

    model = a.model
    if model == "synth":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from test_model_fixtures import make_synth
        model = make_synth(tempfile.mkdtemp(), seed=2, max_position_embeddings=4096, hidden_size=1024,
                           intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4)[2]["f16"]
    levels = [int(x) for x in a.levels.split(",")]
    engines = {name: load_engine(model, ctx=1024, parallel=max(levels), threads=a.threads, progress=False,
                                 lookup=lk)
               for name, lk in (("off", None), ("on", LookupParams(draft_max=a.draft_max)))}
    try:
        print(f"model {engines['off'].name}, threads {a.threads}, gen {a.gen}, draft_max {a.draft_max}, "
              f"load {os.getloadavg()[0]:.1f}")
        print("| requests | lookup | agg tok/s min / median / max | steps | drafted | accepted | acceptance | speed-up (median) |")
        print("|---|---|---|---|---|---|---|---|")
        for n in levels:
            prompts = _prompts(engines["off"], n)
            for e in engines.values():   # warm-up (and the prefix cache) outside the timing
                run_once(e, prompts, 4)
            res = {"off": [], "on": []}
            for _ in range(a.repeats):
                for name in ("off", "on"):
                    res[name].append(run_once(engines[name], prompts, a.gen))
            med_off = statistics.median(r["tps"] for r in res["off"])
            for name in ("off", "on"):
                tps = sorted(r["tps"] for r in res[name])
                d = sum(r["drafted"] for r in res[name])
                acc = sum(r["accepted"] for r in res[name])
                steps = statistics.median(r["steps"] for r in res[name])
                print(f"| {n} | {name} | {tps[0]:.1f} / {statistics.median(tps):.1f} / {tps[-1]:.1f} | {steps:.0f} | "
                      f"{d} | {acc} | {acc / d if d else 0:.0%} | {statistics.median(tps) / med_off:.2f}x |", flush=True)
    finally:
        for e in engines.values():
            e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
