"""Batched benchmark: many sequences at once through our batching engine (engine.api.load_engine) vs llama.cpp's
batched decode (llama-cpp-python low-level API: one llama_batch holding a token of every sequence, one seq id
each) on the same synthetic 2B-4T-shaped TQ2_0 file, same machine, same run. Writes bench/BATCH_RESULTS.md,
bench/batch_results.png and bench/batch_results.json.

    python bench/bench_batch.py [--levels 1,4,8,16,32] [--gen 128] [--prompt 32] [--threads 2]
                                [--engines ours,llama] [--lm-head q4|i8|f16]

For each concurrency N, N requests (distinct random 32-token prompts, greedy) arrive together; measured:
  aggregate decode tok/s  tokens generated after every sequence has its first token / that window's wall time
  TTFT                    submit -> first token of each request (median and max over the N)
  end-to-end tok/s        all generated tokens / wall time from submit to the last token
Also: peak RSS of each engine's process (each engine runs in its own subprocess), the int8 MAC peak of the
kernel path (bench/limits.py, start and end of the run) and the share of it the batched step reaches at each
N, and the single-stream decode of engine/model.py (the `bitnet run` path) in the same process as ours.
Needs the models of bench/make_models.py (bench/cache). The machine may be shared: ratios measured in the same
run are what mean something; the report says how busy the machine was (load average).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from make_models import bench_parser, model_paths  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(vocab, 30000), length).tolist() for _ in range(n)]


def macs_per_token(cfg) -> int:
    """int8 multiply-adds of one token through every weight matrix and the LM head."""
    D, Q, KV, I, V = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    return cfg.n_layers * ((Q + 2 * KV) * D + D * Q + 2 * I * D + D * I) + V * D


def summarize(n: int, t0: float, first: list[float], ends: list[float], counts: list[int], times_all: list[float]):
    """Shared arithmetic of both engines: first[i] first-token time, ends[i] last-token time, counts[i] tokens."""
    w0 = max(first)
    w1 = max(ends)
    in_window = sum(1 for t in times_all if t > w0)
    ttft = sorted(f - t0 for f in first)
    return {"n": n, "generated": sum(counts), "agg_decode_tps": in_window / (w1 - w0) if w1 > w0 else None,
            "e2e_tps": sum(counts) / (w1 - t0), "ttft_median_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1],
            "wall_s": w1 - t0}


# ---- workers (one subprocess per engine) ---------------------------------------------------------------------

def worker_ours(a) -> dict:
    import threading

    from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model

    levels = [int(x) for x in a.levels.split(",")]
    ctx = a.prompt + a.gen + 16
    eng = load_engine(a.model, ctx=ctx, threads=a.threads, parallel=max(levels), progress=False)
    cfg = eng.config
    greedy = SamplingParams(temperature=0.0)
    list(eng.submit(prompts(1, a.prompt, cfg.vocab_size, 99)[0], greedy, max_tokens=4))  # warm-up
    out = {"engine": "ours", "levels": [], "macs_per_token": macs_per_token(cfg)}
    for n in levels:
        ps = prompts(n, a.prompt, cfg.vocab_size, seed=n)
        lock = threading.Lock()
        first, ends, counts, times_all = [None] * n, [0.0] * n, [0] * n, []
        done = threading.Event()
        left = [n]

        def cb_for(i):
            def cb(c):
                now = time.perf_counter()
                with lock:
                    if c.token is not None:
                        times_all.append(now)
                        counts[i] += 1
                        ends[i] = now
                        if first[i] is None:
                            first[i] = now
                    if c.finish_reason:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
            return cb

        c0, t0 = time.process_time(), time.perf_counter()
        for i, p in enumerate(ps):
            eng.submit(p, greedy, max_tokens=a.gen, callback=cb_for(i))
        done.wait(3600)
        eng.clear_prefix_cache()
        res = summarize(n, t0, [f or t0 for f in first], ends, counts, times_all)
        res["cpu_per_wall"] = (time.process_time() - c0) / (time.perf_counter() - t0)   # the engine's share
        res["steps"] = eng.metrics()["steps_total"]
        out["levels"].append(res)
        print(f"  ours  N={n:3d}: {res['agg_decode_tps']:.1f} tok/s aggregate decode, TTFT median "
              f"{res['ttft_median_s']:.2f} s, CPU / wall {res['cpu_per_wall']:.2f}", file=sys.stderr, flush=True)
    eng.close()
    out["peak_rss_engine"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the single-stream path of `bitnet run` / bitchat (engine/model.py) in the same process
    llm = load_model(a.model, ctx=ctx, threads=a.threads, progress=False)
    chunks = list(llm.generate(prompts(1, a.prompt, cfg.vocab_size, 7)[0], greedy, max_tokens=a.gen))
    out["single_stream_decode_tps"] = chunks[-1].stats.decode_tps
    llm.close()
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def worker_ab(a) -> dict:
    """Single stream, interleaved: engine/model.py (`bitnet run`) vs the batching engine with one request,
    alternating rounds in one process (a busy machine drifts; alternation keeps the comparison fair)."""
    from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model

    ctx = a.prompt + a.gen + 16
    llm = load_model(a.model, ctx=ctx, threads=a.threads, progress=False)
    eng = load_engine(a.model, ctx=ctx, threads=a.threads, parallel=1, progress=False)
    greedy = SamplingParams(temperature=0.0)
    p = prompts(1, a.prompt, llm.config.vocab_size, 7)[0]
    model_tps, engine_tps = [], []
    for r in range(a.ab_rounds + 1):
        m = list(llm.generate(p, greedy, max_tokens=a.gen))[-1].stats.decode_tps
        e = list(eng.submit(p, greedy, max_tokens=a.gen))[-1].stats.decode_tps
        eng.clear_prefix_cache()
        if r:  # round 0 warms both
            model_tps.append(m)
            engine_tps.append(e)
    eng.close()
    llm.close()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"  single stream: model {med(model_tps):.2f} tok/s, engine {med(engine_tps):.2f} tok/s", file=sys.stderr)
    return {"engine": "ab", "model_tps": model_tps, "engine_tps": engine_tps, "model_median": med(model_tps),
            "engine_median": med(engine_tps), "gen": a.gen}


def worker_llama(a) -> dict:
    import ctypes

    import llama_cpp as L
    import numpy as np

    levels = [int(x) for x in a.levels.split(",")]
    quiet = L.llama_log_callback(lambda level, text, user: None)  # keep a reference while llama.cpp runs
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {a.model}")
    vocab = L.llama_model_get_vocab(model)
    nv = L.llama_vocab_n_tokens(vocab)
    out = {"engine": "llama", "version": L.__version__, "levels": []}
    per_seq = a.prompt + a.gen + 16
    for n in [levels[0]] + levels:  # the first run (4 tokens) warms the page cache and is dropped
        gen = a.gen if out.get("_warm") else 4
        cp = L.llama_context_default_params()
        cp.n_ctx = n * per_seq
        cp.n_batch = max(512, n * a.prompt)
        cp.n_ubatch = 512
        cp.n_seq_max = n
        cp.n_threads = cp.n_threads_batch = a.threads
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit("llama.cpp could not create a context")
        batch = L.llama_batch_init(max(n * a.prompt, n), 0, 1)

        def decode(items):
            """items: (token, pos, seq, want_logits); returns batch indices of the logit rows."""
            batch.n_tokens = 0
            for tok, pos, seq, want in items:
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, 1 if want else 0
                batch.n_tokens += 1
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise SystemExit(f"llama_decode returned {rc}")

        def argmax(i):
            p = L.llama_get_logits_ith(ctx, i)
            return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_float)), (nv,))))

        ps = prompts(n, a.prompt, nv, seed=n)
        t0 = time.perf_counter()
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(ps) for j, t in enumerate(p)]
        decode(items)
        now = time.perf_counter()
        last = [argmax(s * a.prompt + a.prompt - 1) for s in range(n)]
        first, ends, counts, times_all = [now] * n, [now] * n, [1] * n, [now] * n
        for step in range(1, gen):
            decode([(last[s], a.prompt + step - 1, s, True) for s in range(n)])
            last = [argmax(s) for s in range(n)]
            now = time.perf_counter()
            times_all += [now] * n
            for s in range(n):
                counts[s] += 1
                ends[s] = now
        res = summarize(n, t0, first, ends, counts, times_all)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        if out.get("_warm"):
            out["levels"].append(res)
            print(f"  llama N={n:3d}: {res['agg_decode_tps']:.1f} tok/s aggregate decode, TTFT median "
                  f"{res['ttft_median_s']:.2f} s", file=sys.stderr, flush=True)
        out["_warm"] = True
    out.pop("_warm")
    L.llama_model_free(model)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# ---- driver ----------------------------------------------------------------------------------------------------

def run_worker(engine: str, model: str, a) -> dict:
    levels, gen = (a.llama_levels or a.levels, a.llama_gen or a.gen) if engine == "llama" else (a.levels, a.gen)
    if engine == "ab":
        gen = a.ab_gen
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--model", model, "--levels", levels,
           "--gen", str(gen), "--prompt", str(a.prompt), "--threads", str(a.threads), "--ab-rounds", str(a.ab_rounds)]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=7200)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"engine": engine, "error": f"exit {r.returncode}"}
    return json.loads(lines[-1])


def limits(threads: int) -> dict:
    r = subprocess.run([sys.executable, os.path.join(HERE, "limits.py"), "--threads", str(threads), "--mib", "512",
                        "--passes", "3"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": r.stderr.strip()[-300:]}


def best_peak(r: dict):
    """The int8 peak a run's shares use: the better of its start and end probes (each already the best of its
    passes); a busy probe only reads low, so the mean of the two inflated every share."""
    peaks = [p for p in (r.get("peak_start"), r.get("peak_end")) if p]
    return max(peaks) if peaks else None


def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def report(res: dict, out_dir: str):
    ours = {r["n"]: r for r in res.get("ours", {}).get("levels", [])}
    llama = {r["n"]: r for r in res.get("llama", {}).get("levels", [])}
    peak = best_peak(res["ours_from"]) if res.get("ours_from") else best_peak(res)
    mpt = res.get("ours", {}).get("macs_per_token")
    lines = ["# Batched decode: many sequences at once (bench/bench_batch.py)", "",
             f"Run {res['date']} on {res['cpu']}, {res['threads']} threads, load average at start "
             f"{res['load_start']}, at end {res['load_end']} (a shared machine: compare the "
             "ratios, measured in the same run). Model: synthetic 2B-4T-shaped TQ2_0 "
             f"(`{os.path.basename(res['gguf'])}`; ours: the converted {res['lm_head']}-head store). "
             f"Each request: {res['prompt']}-token prompt, {res['gen']} greedy tokens; N requests arrive together.", "",
             "| N | ours agg. decode tok/s | llama.cpp agg. decode tok/s | ours / llama.cpp | ours TTFT median / max (s) "
             "| llama.cpp TTFT median / max (s) | ours share of int8 peak | ours CPU / wall |",
             "|---|---|---|---|---|---|---|---|"]
    for n in sorted(set(ours) | set(llama)):
        o, l_ = ours.get(n, {}), llama.get(n, {})
        ratio = (o["agg_decode_tps"] / l_["agg_decode_tps"]) if o.get("agg_decode_tps") and l_.get("agg_decode_tps") else None
        share = o["agg_decode_tps"] * mpt / peak if o.get("agg_decode_tps") and peak and mpt else None
        lines.append(f"| {n} | {_fmt(o.get('agg_decode_tps'))} | {_fmt(l_.get('agg_decode_tps'))} | "
                     f"{_fmt(ratio, '.2f') + ('x' if ratio else '')} | {_fmt(o.get('ttft_median_s'), '.2f')} / {_fmt(o.get('ttft_max_s'), '.2f')} | "
                     f"{_fmt(l_.get('ttft_median_s'), '.2f')} / {_fmt(l_.get('ttft_max_s'), '.2f')} | "
                     f"{_fmt(share and 100 * share, '.0f')}% | {_fmt(o.get('cpu_per_wall'), '.2f')} |")
    o = res.get("ours", {})
    one = ours.get(1, {}).get("agg_decode_tps")
    ab = res.get("ab", {})
    lines += [""]
    if res.get("ours_from"):
        of = res["ours_from"]
        lines.append(f"- Our engine's rows come from the run of {of['date']} (load average {of['load_start']} -> "
                     f"{of['load_end']}, int8 peak {_fmt(of.get('peak_start') and of['peak_start'] / 1e9)} -> "
                     f"{_fmt(of.get('peak_end') and of['peak_end'] / 1e9)} G/s); the share column uses that run's peak.")
    if res.get("llama_gen") != res["gen"] or res.get("llama_levels") != ",".join(str(n) for n in sorted(ours)):
        lines.append(f"- llama.cpp ran levels {res.get('llama_levels')} with {res.get('llama_gen')} tokens per request "
                     "(fewer: on this busy machine its decode is very slow); aggregate decode tok/s "
                     "is a rate, comparable across lengths.")
    if ab.get("model_median"):
        lines.append(f"- Single stream, interleaved rounds in one process ({ab['gen']} tokens, median of "
                     f"{len(ab['model_tps'])}): engine/model.py (`bitnet run`, bitchat) {ab['model_median']:.2f} tok/s, "
                     f"the batching engine with one request {ab['engine_median']:.2f} tok/s "
                     f"(ratio {ab['engine_median'] / ab['model_median']:.2f}).")
    lines += [
              f"- int8 MAC peak of the kernel path (register-only VNNI loop, bench/limits.py, best of 5 passes): "
              f"start {_fmt(res.get('peak_start') and res['peak_start'] / 1e9)} G/s (CPU / wall "
              f"{_fmt(res.get('peak_start_cpu_wall'), '.2f')}), end "
              f"{_fmt(res.get('peak_end') and res['peak_end'] / 1e9)} G/s (CPU / wall "
              f"{_fmt(res.get('peak_end_cpu_wall'), '.2f')}); the share uses the higher "
              f"({_fmt(mpt and mpt / 1e9, '.2f')} G multiply-adds per token). CPU / wall: the process's CPU seconds "
              f"per second, {res['threads']} when nothing else ran.",
              f"- Single stream, not interleaved (model at the end of our worker, engine N=1 at its start): "
              f"{_fmt(o.get('single_stream_decode_tps'))} tok/s; the batching engine with N=1: {_fmt(one)} tok/s "
              f"(ratio {_fmt(one / o['single_stream_decode_tps'] if one and o.get('single_stream_decode_tps') else None, '.2f')}).",
              f"- Peak RSS: ours {_fmt(o.get('peak_rss') and o['peak_rss'] / 2**30, '.2f')} GiB "
              f"(engine part {_fmt(o.get('peak_rss_engine') and o['peak_rss_engine'] / 2**30, '.2f')} GiB), llama.cpp "
              f"{_fmt(res.get('llama', {}).get('peak_rss') and res['llama']['peak_rss'] / 2**30, '.2f')} GiB "
              "(weights are mapped files: their resident pages count).",
              ]
    if llama:
        lines.append("- Why llama.cpp is so slow here: its CPU backend joins its threads at a barrier after every "
                     "graph node (~1100 per token); on an oversubscribed machine a descheduled thread stalls each "
                     "one. Our kernels hand out work without a join barrier (simd/kernels/threadpool.c). On an idle "
                     "machine the gap is much smaller (bench/RESULTS.md: single-stream decode).")
    if "error" in res.get("llama", {}) or not llama:
        lines.append(f"- llama.cpp: not measured ({res.get('llama', {}).get('error', 'skipped')}).")
    md = os.path.join(out_dir, "BATCH_RESULTS.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name, d, style in (("ours", ours, "o-"), ("llama.cpp", llama, "s--")):
            if d:
                ns = sorted(d)
                ax1.plot(ns, [d[n]["agg_decode_tps"] or 0 for n in ns], style, label=name)
                ax2.plot(ns, [d[n]["ttft_median_s"] for n in ns], style, label=f"{name} (median)")
        ax1.set(xlabel="concurrent sequences", ylabel="aggregate decode tok/s", title="Aggregate decode", xscale="log", xticks=[1, 4, 8, 16, 32])
        ax2.set(xlabel="concurrent sequences", ylabel="time to first token (s)", title="TTFT, N requests arriving together", xscale="log", xticks=[1, 4, 8, 16, 32])
        for ax in (ax1, ax2):
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"2B-4T shape, {res['threads']} threads, load average at start {res['load_start']}")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "batch_results.png"), dpi=110)
    except Exception as e:  # noqa: BLE001 - the table is the result; the plot is a convenience
        print(f"plot skipped: {e}", file=sys.stderr)
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = bench_parser(__doc__, levels="1,4,8,16,32")
    ap.add_argument("--lm-head", default="q4", choices=("q4", "i8", "f16"), help="which store (default: the default head)")
    ap.add_argument("--llama-levels", help="llama.cpp's levels when they differ (it is slow on a busy machine)")
    ap.add_argument("--llama-gen", type=int, help="llama.cpp's tokens per request when they differ")
    ap.add_argument("--ab-gen", type=int, default=32, help="tokens per single-stream A/B round")
    ap.add_argument("--ab-rounds", type=int, default=3)
    ap.add_argument("--ours-from", help="reuse our engine's results from an earlier batch_results.json")
    ap.add_argument("--worker", choices=("ours", "llama", "ab"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        fn = {"ours": worker_ours, "llama": worker_llama, "ab": worker_ab}[a.worker]
        print(json.dumps(fn(a)))
        return 0
    paths = model_paths(a.cache)
    gguf, store = paths["tq2_0"], paths[f"store_{a.lm_head}"]
    for p in (gguf, store):
        if not os.path.exists(p):
            print(f"missing {p}: run python bench/make_models.py first", file=sys.stderr)
            return 2
    from bitnet_cpu.engine.cpu import cpu_brand

    cpu = cpu_brand()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "threads": a.threads,
           "prompt": a.prompt, "gen": a.gen, "gguf": gguf, "lm_head": a.lm_head,
           "load_start": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    lim0 = limits(a.threads)
    res["peak_start"] = (lim0.get("int8") or {}).get("register_peak_mac_per_s")
    res["peak_start_cpu_wall"] = (lim0.get("int8") or {}).get("peak_dot_cpu_per_wall")
    engines = a.engines.split(",")
    res["llama_gen"], res["llama_levels"] = a.llama_gen or a.gen, a.llama_levels or a.levels
    if a.ours_from:
        with open(a.ours_from) as f:
            old = json.load(f)
        res["ours"], res["ours_from"] = old["ours"], {k: old.get(k) for k in ("date", "load_start", "load_end",
                                                                              "peak_start", "peak_end", "gen")}
    if "ab" in engines:
        print("single stream A/B ...", file=sys.stderr, flush=True)
        res["ab"] = run_worker("ab", store, a)
    if "ours" in engines and not a.ours_from:
        print("ours ...", file=sys.stderr, flush=True)
        res["ours"] = run_worker("ours", store, a)
    if "llama" in engines:
        r = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
        if r.returncode != 0:
            print("llama.cpp skipped: `import llama_cpp` fails (run bash bench/setup_llama.sh)", file=sys.stderr)
            res["llama"] = {"error": "llama_cpp not importable"}
        else:
            print("llama.cpp ...", file=sys.stderr, flush=True)
            res["llama"] = run_worker("llama", gguf, a)
    lim1 = limits(a.threads)
    res["peak_end"] = (lim1.get("int8") or {}).get("register_peak_mac_per_s")
    res["peak_end_cpu_wall"] = (lim1.get("int8") or {}).get("peak_dot_cpu_per_wall")
    res["int8_peak_mac_per_s"] = best_peak(res)
    res["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with open(os.path.join(a.out_dir, "batch_results.json"), "w") as f:
        json.dump(res, f, indent=1)
    report(res, a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
