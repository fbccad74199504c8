"""Decode rows per weight layout / LM head, and prompt-lookup speculation, measured in one run.

    python bench/decode_rows.py [--tokens 64] [--repeats 2] [--threads 2] [--heads i8,q4,f16] [--weights t2,t1.6]
    python bench/bench_e2e.py --decode-rows ...      (appends the same tables to RESULTS.md)

For each of our stores of the synthetic 2B-4T file (bench/make_models.py; the q4-head store is converted
here once, next to the others) and for llama.cpp TQ2_0 on the same source file (when llama-cpp-python is
installed): bytes read per token, greedy decode tok/s (prompt lookup off), the share of the streaming-read
bandwidth measured in the same run (bench/limits.py, before and after), and the ratio to llama.cpp.
Engines alternate, each run in its own process; the best of `repeats` is kept (slower runs are interference
from other processes on the shared machine: only the ratios of one run mean something).

Weights: ours read into huge-page memory (the default for a model this size where the kernel has transparent
huge pages) and, as a second row per head, mapped from the file (--mmap); llama.cpp (llama-bench) both with its
default mmap and with `-lm none` (read into its own buffers): the best of the two is its ratio's denominator.

bitnet.cpp (--bitnet-bench PATH: its llama-bench, built by bench/setup_bitnet_cpp.sh) runs the same weights as
I2_S (make_models.make_i2s) and gets its own ratio column.

Prompt lookup: tok/s with --draft-max 0 vs 4 on a repetitive, code-like prompt and on a random
one (where drafts are rarely made), with the draft acceptance rate.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from llama_bench import llama_bench  # noqa: E402
from make_models import DEFAULT_CACHE, LIMITS, model_paths, sigterm_unwinds  # noqa: E402

CODE = "".join(f"def get_{f}(self):\n    return self._{f}\n\ndef set_{f}(self, value):\n    self._{f} = value\n\n"
               for f in ("name", "size", "color", "weight", "owner", "price"))


def store_bytes_per_token(path: str) -> int:
    from bitnet_cpu.engine.formats.store import Store

    st = Store(path)
    try:
        # not read per token: the embedding (one row), the tokenizer, a q4 head's f16 rows (RESCORE_K rows)
        return sum(st.info(n)["nbytes"] for n in st.tensor_names
                   if n not in ("token_embd", "tokenizer.blob", "output.rows"))
    finally:
        st.close()


def gguf_bytes_per_token(path: str) -> int:
    from bitnet_cpu.engine.formats.gguf import GGUFFile   # reads I2_S too (the gguf package does not know it)

    with GGUFFile(path) as g:
        ts = sorted(g.tensors.values(), key=lambda t: t.offset)
        ends = [t.offset for t in ts[1:]] + [g.size]
        # a type our reader has no size for (ik_llama.cpp's IQ2_BN, id 135): the span up to the next tensor
        # (alignment padding included, at most 31 bytes a tensor)
        return int(sum(t.nbytes if t.nbytes >= 0 else end - t.offset for t, end in zip(ts, ends)))


# ---- one measurement in its own process ---------------------------------------------------------------------
def worker(a) -> dict:
    import numpy as np

    ids = np.random.default_rng(0).integers(0, 1000, 16).tolist()
    if a.engine == "llama":
        from llama_cpp import Llama

        llm = Llama(model_path=a.model, n_ctx=512, n_threads=a.threads, n_threads_batch=a.threads, n_batch=512,
                    logits_all=False, use_mmap=True, verbose=False)
        times = []
        for i, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)):
            times.append(time.perf_counter())
            if i >= a.tokens:
                break
        return {"decode_tps": (len(times) - 1) / (times[-1] - times[0])}
    from bitnet_cpu.engine.api import LookupParams, SamplingParams, load_model
    from bitnet_cpu.engine.runtime.speculative import OFF

    llm = load_model(a.model, ctx=1024, threads=a.threads or None, progress=False, mmap=True if a.mmap else None)
    if a.prompt == "code":
        ids = llm.tokenize(CODE + "def get_", add_bos=True)
    lookup = OFF if a.draft_max == 0 else (LookupParams(draft_max=a.draft_max) if a.draft_max > 0 else None)
    stats = None
    for ch in llm.generate(ids, SamplingParams(temperature=0.0), max_tokens=a.tokens + 1, lookup=lookup):
        stats = ch.stats or stats
    return {"decode_tps": stats.decode_tps, "drafted": stats.n_drafted, "accepted": stats.n_accepted,
            "lm_head": llm.model.lm_head, "load": llm.store.load_mode}


def run_worker(args: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, __file__, "--worker", *args, "--threads", str(threads)], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": " | ".join((r.stderr or r.stdout).strip().splitlines()[-2:])}
    return json.loads(lines[-1])


def bandwidth(threads: int, mib: int = 512) -> float | None:
    r = subprocess.run([sys.executable, LIMITS, "--threads", str(threads), "--mib", str(mib)], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]).get("bandwidth_Bps") if lines else None


def ensure_store(cache: str, shape: str = "2b4t", head: str = "q4", weights: str = "t2") -> str:
    """Our store of the benchmark file with this head and ternary layout: the one make_models wrote, or (any
    head, any layout: a row asked for is measured, never dropped for want of its store) converted here once,
    next to the others."""
    paths = model_paths(cache, shape)
    path = paths[f"store_{head}"]
    if weights != "t2":
        path = path.removesuffix(".bnstore") + f".{weights}.bnstore"
    if not os.path.exists(path):
        from bitnet_cpu.engine.formats.convert import convert

        if not os.path.exists(paths["tq2_0"]):
            raise SystemExit(f"decode_rows: {paths['tq2_0']} is missing: make it with `python bench/make_models.py "
                             f"--shape {shape} --cache {cache} --gguf-only`")
        print(f"converting {paths['tq2_0']} -> {path} (lm head {head}, weights {weights}) ...", file=sys.stderr,
              flush=True)
        with sigterm_unwinds():   # a SIGTERM removes the store being written, as in make_models
            convert(paths["tq2_0"], path + ".tmp", lm_head=head, weights=weights, progress=False)
            os.replace(path + ".tmp", path)
    return path


def ensure_q4_store(cache: str, shape: str = "2b4t") -> str:
    """The q4-head store (make_models writes it too; this converts it when only the GGUF is there)."""
    return ensure_store(cache, shape, "q4", "t2")


LAYOUT_NAMES = {"t2": "tile16", "t1.6": "tile16b3 (t1.6)"}


def measure(a) -> dict:
    log = lambda *x: print(*x, file=sys.stderr, flush=True)
    paths = model_paths(a.cache, a.shape)
    stores = {}   # engine -> (store path, head, weights)
    for wl in a.weights:
        for h in a.heads:
            stores[f"ours_{h}" + ("" if wl == "t2" else f"_{wl}")] = (ensure_store(a.cache, a.shape, h, wl), h, wl)
    if a.llama_bench:
        have_llama = os.path.exists(paths["tq2_0"])
    else:
        try:
            import llama_cpp  # noqa: F401
            have_llama = os.path.exists(paths["tq2_0"])
        except ImportError:
            have_llama = False
    if a.mmap_rows:   # the t2 stores mapped from the file too
        stores.update({f"{e}_mmap": v for e, v in list(stores.items()) if v[2] == "t2"})
    engines = (list(stores) + (["llama"] + (["llama_nommap"] if a.llama_bench else []) if have_llama else [])
               + (["bitnet"] if a.bitnet_bench else []))
    if a.bitnet_bench:
        from make_models import make_i2s

        make_i2s(a.cache, a.shape)
    nbytes = {e: (gguf_bytes_per_token(paths["tq2_0"]) if e.startswith("llama")
                  else gguf_bytes_per_token(paths["i2_s"]) if e == "bitnet"
                  else store_bytes_per_token(stores[e][0])) for e in engines}
    # the host's memory bandwidth drifts by tens of percent within minutes: besides the best probe of the run, each
    # decode run is set against the mean of the probes taken right before and right after it
    bws = [bandwidth(a.threads, a.bw_mib)]
    best: dict[str, float] = {}
    shares: dict[str, list[tuple[float, float]]] = {}   # engine -> [(tok/s, share of the adjacent probes)]
    loads: dict[str, str | None] = {}
    for rep in range(a.repeats):
        for eng in (engines if rep % 2 == 0 else engines[::-1]):
            if eng == "bitnet":   # bitnet.cpp's llama-bench (tg only)
                r = llama_bench(a.bitnet_bench, paths["i2_s"], a.threads, a.tokens, prompt=0)
            elif eng.startswith("llama") and a.llama_bench:   # llama.cpp timed by its own llama-bench (tg only)
                r = llama_bench(a.llama_bench, paths["tq2_0"], a.threads, a.tokens, prompt=0,
                                extra=("-lm", "none") if eng == "llama_nommap" else ())
            elif eng.startswith("llama"):
                r = run_worker(["--engine", "llama", "--model", paths["tq2_0"], "--tokens", str(a.tokens)], a.threads)
            else:
                r = run_worker(["--engine", "ours", "--model", stores[eng][0], "--draft-max", "0", "--tokens",
                                str(a.tokens)] + (["--mmap"] if eng.endswith("_mmap") else []), a.threads)
            bws.append(bandwidth(a.threads, a.bw_mib))
            log(f"decode {eng} repeat {rep + 1}: {r} | stream {bws[-2] and bws[-2] / 1e9:.1f} -> "
                f"{bws[-1] and bws[-1] / 1e9:.1f} GB/s")
            if "decode_tps" in r:
                best[eng] = max(best.get(eng, 0.0), r["decode_tps"])
                loads[eng] = r.get("load")
                if bws[-2] and bws[-1]:
                    shares.setdefault(eng, []).append(
                        (r["decode_tps"], r["decode_tps"] * nbytes[eng] / ((bws[-2] + bws[-1]) / 2)))
    spec = {}
    head = "q4" if "ours_q4" in stores else next((v[1] for v in stores.values()), None)   # the default head
    if head:
        spec_store = stores.get("ours_q4", next(iter(stores.values())))[0]
        for prompt in ("code", "random"):
            for dm in (0, 4):
                r = run_worker(["--engine", "ours", "--model", spec_store, "--draft-max", str(dm), "--prompt", prompt,
                                "--tokens", str(a.tokens)], a.threads)
                log(f"lookup {prompt} draft_max {dm}: {r}")
                spec[(prompt, dm)] = r
    bws.append(bandwidth(a.threads, a.bw_mib))
    bw = max(b for b in bws if b) if any(bws) else None
    rows = []
    llama_tps = max(best.get("llama", 0.0), best.get("llama_nommap", 0.0)) or None   # llama.cpp at its best
    bitnet_tps = best.get("bitnet") or None
    names = {"llama": "llama.cpp TQ2_0 (mmap)", "llama_nommap": "llama.cpp TQ2_0 (-lm none)",
             "bitnet": "bitnet.cpp I2_S"}
    for eng in engines:
        tps = best.get(eng)
        how = {"memory": "weights in memory", "mmap": "weights mapped"}.get(loads.get(eng) or "", "")
        label = names.get(eng)
        if label is None:
            _, h, wl = stores[eng]
            label = (f"ours {LAYOUT_NAMES[wl]} + {h} head" + (f", {how}" if how else "")
                     + (" (--mmap)" if eng.endswith("_mmap") else ""))
        adj = sorted(shares.get(eng, []))
        rows.append({"engine": label, "bytes_per_token": nbytes[eng], "decode_tps": tps,
                     "bw_share": (tps * nbytes[eng] / bw) if tps and bw else None,
                     "adj_share_best": adj[-1][1] if adj else None,
                     "adj_share_median": sorted(x[1] for x in adj)[len(adj) // 2] if adj else None,
                     "vs_llama": (tps / llama_tps) if tps and llama_tps else None,
                     "vs_bitnet": (tps / bitnet_tps) if tps and bitnet_tps else None})
    return {"bandwidth_Bps": bw, "bandwidth_all_Bps": bws, "rows": rows,
            "spec": {f"{p}/{'off' if d == 0 else 'on'}": v for (p, d), v in spec.items()},
            "spec_head": head, "llama": have_llama, "threads": a.threads, "tokens": a.tokens,
            "llama_how": "its own llama-bench, tg only" if a.llama_bench else "llama-cpp-python",
            "bitnet": bool(a.bitnet_bench)}


def markdown(res: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    x = lambda v: "-" if v is None else f"{v:.2f}x"   # a ratio not measured: "-", not "-x"
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"
    out = [f"## Decode per layout / LM head ({res['threads']} threads, {res['tokens']} tokens, best of the run)", "",
           f"Streaming-read bandwidth measured in the same run: {f(res['bandwidth_Bps'] and res['bandwidth_Bps'] / 1e9, '.1f')} GB/s. "
           "The machine was shared with other jobs: compare the ratios, not the absolute numbers."
           + (f" llama.cpp timed by {res.get('llama_how', 'llama-cpp-python')}." if res["llama"] else
              " llama-cpp-python is not installed: no llama.cpp column."), "",
           "Share of read bandwidth: the best tok/s against the best probe of the run; \"beside it\": each run against "
           "the mean of the probes taken just before and after it (the run with the best tok/s / the median run).", "",
           "| engine | bytes/token | decode tok/s | share of read bandwidth | share, probes beside it (best / median run) "
           "| vs llama.cpp TQ2_0 (its best) |" + (" vs bitnet.cpp I2_S |" if res.get("bitnet") else ""),
           "|---|---|---|---|---|---|" + ("---|" if res.get("bitnet") else "")]
    for r in res["rows"]:
        out.append(f"| {r['engine']} | {r['bytes_per_token'] / 1e6:.2f} MB | {f(r['decode_tps'], '.1f')} | "
                   f"{pct(r['bw_share'])} | {pct(r.get('adj_share_best'))} / {pct(r.get('adj_share_median'))} | "
                   f"{x(r['vs_llama'])} |" + (f" {x(r.get('vs_bitnet'))} |" if res.get("bitnet") else ""))
    if res["spec"]:
        out += ["", f"### Prompt-lookup speculative decoding ({res['spec_head']} head, greedy, same output)", "",
                "| prompt | lookup | decode tok/s | drafted | accepted | acceptance | speed-up |", "|---|---|---|---|---|---|---|"]
        for p in ("code", "random"):
            off, on = res["spec"].get(f"{p}/off", {}), res["spec"].get(f"{p}/on", {})
            for name, r in (("off", off), ("--draft-max 4", on)):
                acc = r.get("accepted", 0) / r["drafted"] if r.get("drafted") else None
                sp = r.get("decode_tps") / off["decode_tps"] if r.get("decode_tps") and off.get("decode_tps") else None
                out.append(f"| {'repetitive code' if p == 'code' else 'random ids'} | {name} | "
                           f"{f(r.get('decode_tps'), '.1f')} | {r.get('drafted', '-')} | {r.get('accepted', '-')} | "
                           f"{pct(acc)} | {x(sp)} |")
    return "\n".join(out) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--draft-max", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default="random", help=argparse.SUPPRESS)
    ap.add_argument("--mmap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-mmap-rows", dest="mmap_rows", action="store_false",
                    help="skip our rows with the weights mapped from the file (--mmap)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="0: the default count (decode thread count tuned)")
    ap.add_argument("--heads", type=lambda s: [h for h in s.split(",") if h], default=["i8", "q4", "f16"])
    ap.add_argument("--weights", type=lambda s: [w for w in s.split(",") if w], default=["t2", "t1.6"],
                    help="ternary layouts to time (t2 = tile16, t1.6 = base-3 tile16b3; converted once into the cache)")
    ap.add_argument("--cache", default=DEFAULT_CACHE, type=os.path.abspath)
    ap.add_argument("--shape", default="2b4t", help="2b4t (the benchmark) or small (harness check)")
    ap.add_argument("--bw-mib", type=int, default=512, help="bandwidth probe buffer (MiB)")
    ap.add_argument("--llama-bench", metavar="PATH", default=os.environ.get("LLAMA_BENCH"),
                    help="llama.cpp's llama-bench binary instead of llama-cpp-python (or $LLAMA_BENCH)")
    ap.add_argument("--bitnet-bench", metavar="PATH", default=os.environ.get("BITNET_BENCH"),
                    help="bitnet.cpp's llama-bench binary (bench/setup_bitnet_cpp.sh; or $BITNET_BENCH): adds its "
                         "I2_S row and ratio column")
    a = ap.parse_args(argv)
    if not a.heads or set(a.heads) - {"q4", "i8", "f16"}:
        ap.error(f"--heads {','.join(a.heads)!r}: expected a comma list of q4, i8, f16")
    if not a.weights or set(a.weights) - set(LAYOUT_NAMES):
        ap.error(f"--weights {','.join(a.weights)!r}: expected a comma list of {', '.join(LAYOUT_NAMES)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    res = measure(a)
    print(markdown(res))
    if any(r["decode_tps"] for r in res["rows"]):
        return 0
    print("decode_rows: no row was measured" + (" (see the errors above)" if res["rows"] else " (no engine to run)"),
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
