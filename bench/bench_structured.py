"""Structured output: what a constraint costs per decode step, what jump-forward saves, and the same extraction
on llama-server in the same run.

    python bench/bench_structured.py [--model STORE] [--threads 2] [--repeats 3] [--parallel 16]
                                     [--llama-server PATH --gguf PATH] [--json OUT]

Rows (each a median of --repeats runs, printed with min..max):
  1 sequence   unconstrained decode vs the same tokens under a JSON Schema (jump-forward off: the mask alone),
               tok/s and the ratio; mask time per token (the grammar engine alone, replaying the tokens)
  extraction   an object of 10 keys with short values: tok/s with jump-forward off and on, share of tokens forced
  16 sequences the extraction from --parallel clients at once through one batching engine: aggregate tok/s,
               unconstrained / constrained / constrained + jump-forward
  HTTP         --parallel clients of `bitnet serve` and (if --llama-server is given) of llama-server on the same
               TQ2_0 weights (`json_schema` field, same threads, -np --parallel), aggregate tok/s and the ratio
Default model: the synthetic 2B-4T store of bench/make_models.py (random weights: the values are nonsense, the
token counts and step costs are real).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench_serve import free_port, stop_server, wait_healthy  # noqa: E402  (bench/, this script's folder)

EXTRACTION = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "email", "city", "country", "phone", "member", "score", "tags", "id"],
    "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email", "maxLength": 32}, "city": {"type": "string", "maxLength": 16},
        "country": {"enum": ["France", "Germany", "Japan", "Kenya", "Peru", "Canada"]},
        "phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}, "member": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}},
        "id": {"type": "integer", "minimum": 1, "maximum": 99999}}}
TEXT = ("Extract the customer record as JSON. Customer: Amélie Durand, 34, amelie.durand@example.org, lives in Lyon, "
        "France; phone +33 612 3456; loyalty member since 2019, satisfaction score 87, tags: vip, early; id 40213.")
DECODE_TOKENS = 64


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _span(xs, fmt="{:.1f}"):
    return f"{fmt.format(_median(xs))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})" if xs else "-"


def one_sequence(llm, repeats: int) -> dict:
    """Same prompt, greedy: unconstrained for DECODE_TOKENS tokens, then the extraction schema with jump-forward
    off (each token sampled under its mask) and on."""
    from bitnet_cpu.engine.api import Constraint, SamplingParams
    from bitnet_cpu.engine.runtime.constraints import TokenMatcher

    greedy = SamplingParams(temperature=0)
    ids = llm.chat_prompt([{"role": "user", "content": TEXT}])
    res = {"free_tps": [], "off_tps": [], "on_tps": [], "off_tokens": 0, "forced": 0, "mask_us": []}
    list(llm.generate(ids, greedy, max_tokens=8, constraint=Constraint.json_schema(EXTRACTION)))   # warm-up
    for _ in range(repeats):
        llm.reset()
        last = list(llm.generate(ids, greedy, max_tokens=DECODE_TOKENS, ignore_eos=True))[-1]
        res["free_tps"].append(last.stats.decode_tps)
        for jf, key in ((False, "off_tps"), (True, "on_tps")):
            llm.reset()
            chunks = list(llm.generate(ids, greedy, max_tokens=400, constraint=Constraint.json_schema(EXTRACTION, jump_forward=jf)))
            st = chunks[-1].stats
            res[key].append(st.decode_tps)
            if jf:
                res["forced"] = st.n_accepted
            else:
                res["off_tokens"] = st.n_generated
                toks = [c.token for c in chunks if c.token is not None]
    # the grammar engine alone: replay the answer through a fresh matcher, timing each mask
    cm: TokenMatcher = llm.compile_constraint(Constraint.json_schema(EXTRACTION)).matcher()
    for t in toks:
        t0 = time.perf_counter()
        cm._compute()
        res["mask_us"].append((time.perf_counter() - t0) * 1e6)
        cm.advance(t)
    t0 = time.perf_counter()
    llm.compile_constraint(Constraint.json_schema(dict(EXTRACTION, title=str(time.time()))))   # a new schema
    res["compile_ms"] = (time.perf_counter() - t0) * 1000
    res["answer"] = llm.detokenize(toks)
    return res


def batched(eng, n: int, repeats: int) -> dict:
    """n extraction requests at once, greedy; a warm-up round first, which also fixes each unconstrained
    request's length to its constrained answer's (same rows per step as the answers end), then each repeat runs
    the three variants in turn."""
    from bitnet_cpu.engine.api import Constraint, SamplingParams

    prompts = [eng.chat_prompt([{"role": "user", "content": TEXT + f" (record {i})"}]) for i in range(n)]
    specs = {"free": None, "off": Constraint.json_schema(EXTRACTION, jump_forward=False),
             "on": Constraint.json_schema(EXTRACTION, jump_forward=True)}

    def run(name, lengths):
        eng.clear_prefix_cache()
        spec = specs[name]
        t0 = time.perf_counter()
        streams = [eng.submit(p, SamplingParams(temperature=0), **(dict(max_tokens=400, constraint=spec) if spec else
                                                                   dict(max_tokens=k, ignore_eos=True)))
                   for p, k in zip(prompts, lengths)]
        counts = [list(s)[-1].stats.n_generated for s in streams]
        return counts, sum(counts) / (time.perf_counter() - t0)

    lengths, _ = run("off", [0] * n)
    out = {"tokens": sum(lengths) // n, "free": [], "off": [], "on": []}
    for _ in range(repeats):
        for name in ("free", "off", "on"):
            out[name].append(run(name, lengths)[1])
    return out


def _http_load(url: str, n: int, body: dict) -> float:
    """n concurrent clients, one request each; aggregate completion tokens per second."""
    import httpx

    counts, errors = [0] * n, []

    def client(i):
        try:
            r = httpx.post(url, json=dict(body, seed=i), timeout=600)
            r.raise_for_status()
            counts[i] = r.json()["usage"]["completion_tokens"]
        except Exception as e:  # reported, not hidden
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return sum(counts) / dt


def http_row(cmd: list[str], port: int, n: int, repeats: int, body: dict) -> list[float]:
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        _http_load(url + "/v1/chat/completions", 1, body)   # warm-up (llama-server compiles the grammar)
        return [_http_load(url + "/v1/chat/completions", n, body) for _ in range(repeats)]
    finally:
        stop_server(proc)


def main(argv=None) -> int:
    from make_models import bench_parser, model_paths, save_json

    ap = bench_parser(__doc__)
    ap.add_argument("--model", help="a store (default: bench/cache/2b4t.q4.bnstore from bench/make_models.py)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--llama-server", help="llama-server binary for the same-run peer row")
    ap.add_argument("--gguf", help="the TQ2_0 GGUF for llama-server (default: bench/cache/2b4t.tq2_0.gguf)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    from bitnet_cpu.engine.api import load_engine, load_model

    paths = model_paths()
    model = a.model or paths["store_q4"]
    if not os.path.exists(model):
        print(f"bench_structured: {model} does not exist: run `python bench/make_models.py` first (or --model)",
              file=sys.stderr)
        return 2
    res: dict = {"model": model, "threads": a.threads, "parallel": a.parallel}
    llm = load_model(model, threads=a.threads, progress=False)
    one = one_sequence(llm, a.repeats)
    llm.close()
    res["one"] = one
    ratio = [o / f for o, f in zip(one["off_tps"], one["free_tps"])]
    print(f"model {os.path.basename(model)}, {a.threads} threads, {a.repeats} repeats (median (min..max))")
    print(f"1 sequence   unconstrained {_span(one['free_tps'])} tok/s | JSON Schema, mask only {_span(one['off_tps'])}"
          f" tok/s = {_span(ratio, '{:.3f}')}x")
    print(f"             mask {_span(one['mask_us'], '{:.0f}')} us per token (grammar engine alone, "
          f"{len(one['mask_us'])} tokens); a new schema compiles in {one['compile_ms']:.0f} ms")
    jf = [on / off for on, off in zip(one["on_tps"], one["off_tps"])]
    print(f"extraction   {one['off_tokens']} tokens, {one['forced']} forced ({100 * one['forced'] / max(1, one['off_tokens']):.0f}%):"
          f" jump-forward off {_span(one['off_tps'])} tok/s, on {_span(one['on_tps'])} tok/s = {_span(jf, '{:.2f}')}x")
    print(f"             answer: {one['answer'][:160]}")

    eng = load_engine(model, threads=a.threads, parallel=a.parallel, progress=False)
    try:
        b = batched(eng, a.parallel, a.repeats)
    finally:
        eng.close()
    res["batched"] = b
    print(f"{a.parallel} sequences aggregate tok/s: unconstrained {_span(b['free'])} | constrained {_span(b['off'])}"
          f" ({_median(b['off']) / _median(b['free']):.3f}x) | + jump-forward {_span(b['on'])}"
          f" ({_median(b['on']) / _median(b['off']):.2f}x constrained)")

    body = {"messages": [{"role": "user", "content": TEXT}], "temperature": 0, "max_tokens": 400,
            "json_schema": EXTRACTION}
    port = free_port()
    ours = http_row([sys.executable, "-m", "bitnet_cpu", "serve", "-m", model, "--host", "127.0.0.1", "--port",
                     str(port), "-t", str(a.threads), "--parallel", str(a.parallel)], port, a.parallel, a.repeats, body)
    res["http_ours"] = ours
    line = f"HTTP {a.parallel} clients, json_schema: bitnet serve {_span(ours)} tok/s"
    if a.llama_server:
        port = free_port()
        gguf = a.gguf or paths["tq2_0"]
        theirs = http_row([a.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
                           "-np", str(a.parallel), "-c", str(a.parallel * 1024), "-cb"], port, a.parallel, a.repeats, body)
        res["http_llama"] = theirs
        line += f" | llama-server {_span(theirs)} tok/s | ratio {_median(ours) / _median(theirs):.2f}x"
    print(line)
    save_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
