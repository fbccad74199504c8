"""Thread sweep: decode tok/s and prefill pp512 from 1 to N threads, ours vs llama.cpp (and ik_llama.cpp)
on the same synthetic 2B-4T weights, with the streaming-read rate, the per-token time outside the parallel
kernels and the busy-core case measured in the same run; writes bench/THREADS_RESULTS.md,
bench/threads_results.png and bench/threads_results.json.

    python bench/bench_threads.py [--max-threads N] [--decode 64] [--engines ours,llama] [--no-busy]

Per thread count t (1..N, N = engine.cpu.default_threads(): the physical cores here), interleaved in one run:
  stream   bench/limits.py --threads t (best of a few passes over a 512 MiB buffer): the decode limit is that
           rate / the bytes our decode reads per token (store layout, bench_e2e.store_facts)
  ours     bench/e2e_worker.py on bench/cache/2b4t.q4.bnstore (the default head), its own process, OMP_NUM_THREADS=t
  llama    the same worker on bench/cache/2b4t.tq2_0.gguf (llama-cpp-python), n_threads = n_threads_batch = t
  serial   ms per decode step outside the parallel kernels: bench_step.python_overhead_per_step (the same
           decode loop on a tiny model of the same layer count and head kind, where the C work is negligible,
           so it counts Python, numpy, bindings and thread fork/join), in its own process with t threads
Busy core: a busy-loop process pinned to CPU 0 runs (bounded in time) while our worker runs with the default
thread count and then with -t 1; decode and pp512 for both.
Each figure is one session (no repeats): on a shared machine only same-run ratios mean something.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from llama_bench import llama_bench  # noqa: E402  (bench/llama_bench.py)

WORKER = os.path.join(HERE, "e2e_worker.py")
LIMITS = os.path.join(HERE, "limits.py")
CACHE = os.path.join(HERE, "cache")
BUSY_SRC = ("import os, sys, time\nos.sched_setaffinity(0, {0})\nend = time.time() + float(sys.argv[1])\n"
            "while time.time() < end:\n    pass\n")


def run_json(cmd: list[str], threads: int | None, timeout: float = 300) -> dict:
    """Run a JSON-printing child; threads None leaves OMP_NUM_THREADS unset (the engine picks its default)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.pop(var, None)
        if threads is not None:
            env[var] = str(threads)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": " ".join(cmd)}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        return {"error": f"exit {r.returncode}: {tail}", "cmd": " ".join(cmd)}
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def worker(engine: str, model: str, threads: int, a) -> dict:
    """One session: pp512 (fresh cache) and decode of a.decode tokens; threads 0 = the engine's default."""
    cmd = [sys.executable, WORKER, "--engine", engine, "--model", model, "--threads", str(threads), "--ctx", "1024",
           "--prefill", "512", "--decode", str(a.decode), "--turns", "0"]
    return run_json(cmd, threads or None)


def overhead_worker(store: str) -> int:
    """Child mode: print {"serial_s": ...} for the store's shape at the OMP_NUM_THREADS the parent set."""
    from bench_step import python_overhead_per_step

    from bitnet_cpu.engine.api import load_model

    llm = load_model(store, ctx=64, progress=False)
    print(json.dumps({"serial_s": python_overhead_per_step(llm.model, n=200), "threads": llm.threads}))
    return 0


def sweep(a, store: str, gguf: str, engines: list[str]) -> list[dict]:
    rows = []
    counts = [int(x) for x in a.threads.split(",")] if a.threads else range(1, a.max_threads + 1)
    for t in counts:
        row: dict = {"threads": t}
        row["limits"] = run_json([sys.executable, LIMITS, "--threads", str(t), "--mib", "512", "--passes", "4"], t)
        order = engines if t % 2 else engines[::-1]   # alternate which engine goes first
        for eng in order:
            if eng == "ik":
                row[eng] = llama_bench(a.ik_bench, a.ik_model, t, a.decode, ("-rtr", "1"))
            elif eng == "llama" and a.llama_bench:
                row[eng] = llama_bench(a.llama_bench, gguf, t, a.decode)
            else:
                row[eng] = worker(eng, store if eng == "ours" else gguf, t, a)
        row["serial"] = run_json([sys.executable, os.path.abspath(__file__), "--overhead-worker", store], t)
        rows.append(row)
        print("row " + json.dumps(row), flush=True)   # a sweep cut short still leaves its rows in the log
        print(f"  threads {t}: " + ", ".join(f"{e} decode {_f(row[e], 'decode_tps')} pp512 {_pp(row[e])}"
                                              for e in engines), flush=True)
    return rows


def busy_case(a, store: str) -> dict:
    """Ours at the default thread count and at -t 1 while a busy loop holds CPU 0."""
    out: dict = {}
    for label, t in (("default", 0), ("t1", 1)):
        busy = subprocess.Popen([sys.executable, "-c", BUSY_SRC, str(a.busy_limit_s)])
        try:
            time.sleep(0.3)
            out[label] = worker("ours", store, t, a)
        finally:
            busy.terminate()
            busy.wait(timeout=10)
    return out


def _f(d: dict, k: str, fmt: str = "{:.1f}") -> str:
    v = d.get(k) if isinstance(d, dict) else None
    return fmt.format(v) if isinstance(v, (int, float)) else "—"


def _pp(d: dict) -> str:
    v = (d.get("prefill_tps") or {}).get("512") if isinstance(d, dict) else None
    return f"{v:.1f}" if v else "—"


def _ratio(x, y) -> str:
    return f"{x / y:.2f}x" if x and y else "—"


def render(res: dict) -> str:
    bpt, rows = res["bytes_per_token"], sorted(res["rows"], key=lambda r: r["threads"])
    load = f"{res['load'][0]:.1f}" if res.get("load") else "not recorded"
    llama = (f"llama.cpp ({res['llama_cpp']}) on `{res['gguf']}` (same weights)"
             if any("llama" in r for r in rows) else "llama.cpp not measured")
    if any("ik" in r for r in rows):
        llama += (f"; ik_llama.cpp ({res.get('ik_version', '?')}, its llama-bench, -rtr 1: IQ2_BN repacked to "
                  f"IQ2_BN_R4) on `{res.get('ik_model')}` (the same ternary values, its own default embedding type)")
    L = [f"# Thread sweep, {res['date']}", "",
         f"Machine: {res['machine']}, {res['cpus']} logical CPUs, {res['physical']} physical cores available to "
         f"the process; threads {', '.join(str(r['threads']) for r in rows)}; load average at start {load}. "
         f"Synthetic 2B-4T weights: ours on `{res['store']}` ({res.get('lm_head', 'i8')} LM head, {bpt / 1e9:.3f} GB read per token); "
         f"{llama}. One session per figure, engines interleaved, decode {res['decode']} tokens after a 16-token "
         f"prompt (llama-bench: its tg from an empty cache), "
         f"pp512 = 512 tokens / time to the first token (fresh cache). Command: `{res['command']}` "
         f"(total {res['total_s']:.0f} s).", "",
         f"{res['cpus']} CPUs here: no figures above {max(r['threads'] for r in rows)} threads are claimed.", "",
         "| threads | stream GB/s | decode limit tok/s | decode ours | decode llama.cpp | decode ik | ours/llama "
         "| ours/ik | ours % of limit | pp512 ours | pp512 llama.cpp | pp512 ik | ours/llama | ours/ik "
         "| ours pp512 vs linear | serial ms/token | serial % of step |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base_pp = None
    for r in rows:
        bw = (r.get("limits") or {}).get("bandwidth_Bps")
        o, ll, ik = r.get("ours", {}), r.get("llama", {}), r.get("ik", {})
        od, ld, kd = o.get("decode_tps"), ll.get("decode_tps"), ik.get("decode_tps")
        op, lp, kp = ((d.get("prefill_tps") or {}).get("512") for d in (o, ll, ik))
        if base_pp is None and op:
            base_pp = op / r["threads"]   # per-thread rate of the first (smallest) count
        lin = f"{op / (base_pp * r['threads']):.2f}" if op and base_pp else "—"
        ser = (r.get("serial") or {}).get("serial_s")
        L.append(f"| {r['threads']} | {bw / 1e9:.1f} | {bw / bpt:.1f} | " if bw else f"| {r['threads']} | — | — | ")
        share = f"{100 * od * bpt / bw:.0f}%" if od and bw else "—"
        ser_ms = f"{ser * 1e3:.2f}" if ser else "—"
        ser_pct = f"{100 * ser * od:.1f}%" if ser and od else "—"
        L[-1] += (f"{_f(o, 'decode_tps')} | {_f(ll, 'decode_tps')} | {_f(ik, 'decode_tps')} | {_ratio(od, ld)} | "
                  f"{_ratio(od, kd)} | {share} | {_pp(o)} | {_pp(ll)} | {_pp(ik)} | {_ratio(op, lp)} | "
                  f"{_ratio(op, kp)} | {lin} | {ser_ms} | {ser_pct} |")
    errs = [f"- threads {r['threads']} {k}: {r[k]['error']}" for r in rows for k in r
            if isinstance(r[k], dict) and "error" in r[k]]
    b = res.get("busy")
    if b:
        d, t1 = b.get("default", {}), b.get("t1", {})
        L += ["", f"## One core busy (a busy loop pinned to CPU 0 for the duration), ours", "",
              "| threads | decode tok/s | pp512 tok/s |", "|---|---|---|",
              f"| default ({d.get('threads_used', '?')}) | {_f(d, 'decode_tps')} | {_pp(d)} |",
              f"| -t 1 | {_f(t1, 'decode_tps')} | {_pp(t1)} |",
              f"| default / -t 1 | {_ratio(d.get('decode_tps'), t1.get('decode_tps'))} | "
              f"{_ratio((d.get('prefill_tps') or {}).get('512'), (t1.get('prefill_tps') or {}).get('512'))} |"]
        errs += [f"- busy {k}: {v['error']}" for k, v in b.items() if "error" in v]
    if res.get("notes"):
        L += [""] + [f"- {n}" for n in res["notes"]]
    L += ["", "Serial = per decode step time outside the parallel kernels (bench_step.python_overhead_per_step: "
          "the same loop on a tiny model of the same layer count, so Python, numpy, bindings and the thread "
          "fork/join of every kernel call; a slight over-estimate). Its share of the step is serial x decode tok/s; "
          "by Amdahl the decode ceiling from it alone is 1 / serial."]
    if errs:
        L += ["", "Errors:"] + errs
    return "\n".join(L) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, bpt = sorted(res["rows"], key=lambda r: r["threads"]), res["bytes_per_token"]
    ts = [r["threads"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    lim = [(r.get("limits") or {}).get("bandwidth_Bps", float("nan")) / bpt for r in rows]
    ax1.plot(ts, lim, "k--", label="stream-read limit (ours' bytes/token)")
    names = {"ours": "ours", "llama": "llama.cpp TQ2_0", "ik": "ik_llama.cpp IQ2_BN_R4"}
    for eng, style in (("ours", "o-"), ("llama", "s-"), ("ik", "^-")):
        if any(eng in r for r in rows):
            ax1.plot(ts, [r.get(eng, {}).get("decode_tps") or float("nan") for r in rows], style,
                     label=names[eng])
            ax2.plot(ts, [(r.get(eng, {}).get("prefill_tps") or {}).get("512") or float("nan") for r in rows],
                     style, label=names[eng])
    for ax, title in ((ax1, "decode tok/s"), (ax2, "prefill pp512 tok/s")):
        ax.set_xlabel("threads")
        ax.set_xticks(ts)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    load = res["load"][0] if res.get("load") else "?"
    fig.suptitle(f"2B-4T synthetic, {res['cpus']}-CPU machine, load avg {load} at start, one run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/bench_threads.py", description=__doc__.splitlines()[0])
    ap.add_argument("--max-threads", type=int, default=None, help="default: engine.cpu.default_threads()")
    ap.add_argument("--decode", type=int, default=64, help="decode tokens per session")
    ap.add_argument("--engines", default="ours,llama", help="any of ours, llama, ik (ik needs --ik-bench)")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1..--max-threads)")
    ap.add_argument("--ik-bench", metavar="PATH", default=os.environ.get("IK_LLAMA_BENCH"),
                    help="ik_llama.cpp's llama-bench binary (or $IK_LLAMA_BENCH)")
    ap.add_argument("--llama-bench", metavar="PATH", default=os.environ.get("LLAMA_BENCH"),
                    help="llama.cpp's llama-bench binary instead of llama-cpp-python (or $LLAMA_BENCH)")
    ap.add_argument("--ik-model", default=os.path.join(CACHE, "2b4t.iq2_bn.gguf"),
                    help="IQ2_BN GGUF of the same weights (python bench/make_models.py --ik-quantize ...)")
    ap.add_argument("--store", default=os.path.join(CACHE, "2b4t.q4.bnstore"), type=os.path.abspath,
                    help="our store (default the q4-head one, what `bitnet run` uses)")
    ap.add_argument("--no-busy", action="store_true", help="skip the busy-core case")
    ap.add_argument("--busy-limit-s", type=float, default=120, help="the busy loop ends by itself after this")
    ap.add_argument("--out", default=HERE, help="directory for THREADS_RESULTS.md / threads_results.{png,json}")
    ap.add_argument("--render", metavar="JSON",
                    help="only render a results JSON (one written by a sweep elsewhere) to JSON's name .md / .png")
    ap.add_argument("--overhead-worker", metavar="STORE", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.overhead_worker:
        return overhead_worker(a.overhead_worker)
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        stem = os.path.splitext(a.render)[0]
        plot(res, stem + ".png")
        with open(stem + ".md", "w") as f:
            f.write(render(res) + f"\n![tok/s vs threads]({os.path.basename(stem)}.png)\n")
        print(f"wrote {stem}.md, {stem}.png")
        return 0

    from bench_e2e import store_facts
    from bitnet_cpu.engine.cpu import available_cores, cpu_brand, default_threads, physical_cores

    t_start = time.perf_counter()
    store, gguf = a.store, os.path.join(CACHE, "2b4t.tq2_0.gguf")
    engines = [e for e in a.engines.split(",") if e]
    for path in [store] + ([gguf] if "llama" in engines else []):
        if not os.path.exists(path):
            print(f"bench_threads: {path} missing: run python bench/make_models.py first", file=sys.stderr)
            return 2
    if "ik" in engines and not (a.ik_bench and os.path.exists(a.ik_bench) and os.path.exists(a.ik_model)):
        print(f"bench_threads: ik_llama.cpp needs --ik-bench and {a.ik_model}: left out", file=sys.stderr)
        engines.remove("ik")
    llama_v = None
    if "llama" in engines and a.llama_bench:
        llama_v = os.environ.get("LLAMA_VERSION", "llama-bench")
    elif "llama" in engines:
        r = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
        llama_v = f"llama-cpp-python {r.stdout.strip()}" if r.returncode == 0 else None
        if llama_v is None:
            print("bench_threads: llama-cpp-python not installed (bash bench/setup_llama.sh): ours only",
                  file=sys.stderr)
            engines.remove("llama")
    a.max_threads = a.max_threads or default_threads()
    cpu, facts = cpu_brand(), store_facts(store, 1024)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": cpu,
           "cpus": os.cpu_count(), "available": available_cores(), "physical": physical_cores(),
           "load": os.getloadavg(), "store": os.path.relpath(store, ROOT), "gguf": os.path.relpath(gguf, ROOT),
           "llama_cpp": llama_v or "not installed", "decode": a.decode,
           "ik_model": os.path.relpath(a.ik_model, ROOT) if "ik" in engines else None,
           "ik_version": os.environ.get("IK_LLAMA_VERSION", "?"),
           **{k: facts[k] for k in ("bytes_per_token", "lm_head")},
           "command": "python bench/bench_threads.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"sweep {a.threads or f'1..{a.max_threads}'} threads, engines {engines}", flush=True)
    print("meta " + json.dumps(res), flush=True)   # with the row lines, a log that is cut short can be rendered
    res["rows"] = sweep(a, store, gguf, engines)
    if not a.no_busy:
        print("busy-core case ...", flush=True)
        res["busy"] = busy_case(a, store)
    res["total_s"] = time.perf_counter() - t_start
    md = render(res)
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "THREADS_RESULTS.md"), "w") as f:
        f.write(md + "\n![tok/s vs threads](threads_results.png)\n")
    with open(os.path.join(a.out, "threads_results.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "threads_results.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
