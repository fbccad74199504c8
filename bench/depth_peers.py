"""Decode at depth and a long prompt's prefill: ours (f16 and q8 KV) against llama.cpp and ik_llama.cpp, on the
same synthetic 2B-4T weights, in one run, rounds alternating between engines so all see the same machine load.

    python bench/depth_peers.py --llama-bench PATH --ik-bench PATH [--depths 0,1024,4096,16384] [--rounds 3]
                                [--prefill 4096] [--threads 2] [--head q4|i8] [--json out.json] [--plot out.png]
    python bench/depth_peers.py --report run1.json run2.json [--plot out.png]    (saved runs, one table)

Rows:
  decode at depth d : ours = `--tokens` decode steps after d cached positions (the cache filled with real,
                      non-zero pages, as bench/depth_sweep.py does); llama.cpp = its llama-bench `-d d -p 0 -n N`;
                      ik_llama.cpp = its llama-bench `-gp d,N -rtr 1` (IQ2_BN repacked to IQ2_BN_R4 at load, its
                      author's advice; flash attention on, its default). Peers keep an f16 KV cache (their default).
  prefill           : one `--prefill`-token prompt from an empty cache (ours: Model.prefill, chunked as
                      `bitnet run` does; peers: llama-bench `-p N -n 0`).
Each decode row's share: tok/s x (weight bytes + d x KV bytes per token) / the stream rate (bench/limits.py,
measured before and after; the lower one). Peers' weight bytes: the GGUF's tensors; their KV: f16, 2B-4T shape.
Models: bench/make_models.py (`--ik-quantize PATH` writes the IQ2_BN file for ik_llama.cpp).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from decode_rows import ensure_store, gguf_bytes_per_token, store_bytes_per_token  # noqa: E402
from depth_sweep import fill_cache  # noqa: E402
from limits import stream_bandwidth  # noqa: E402
from make_models import DEFAULT_CACHE, save_json  # noqa: E402

F16_KV_PER_POS = 30 * 2 * 5 * 128 * 2        # 2B-4T: layers x (K, V) x KV heads x head_dim x f16


def run_bench(cmd: list[str], timeout: float) -> float | None:
    """One llama-bench run (JSON output): the avg tok/s of its single test, None (and the reason on stderr) if
    it failed or ran past `timeout` seconds (a peer's row at 16k depth first prefills 16k tokens: on 2 loaded
    cores that took over 15 minutes)."""
    import subprocess

    try:
        r = subprocess.run(cmd + ["-r", "1", "-o", "json"], capture_output=True, text=True, timeout=timeout)
        tests = json.loads(r.stdout[r.stdout.index("["):])
        return float(tests[-1]["avg_ts"])
    except (subprocess.TimeoutExpired, OSError, ValueError, KeyError, IndexError) as e:
        print(f"depth_peers: {' '.join(cmd)}: {type(e).__name__} {e}", file=sys.stderr)
        return None


def ours_decode(store, kv: str, depth: int, tokens: int, threads: int) -> float:
    from bitnet_cpu.engine.runtime.model import Model

    m = Model(store, n_ctx=depth + tokens + 2, kv_dtype=kv, threads=threads)
    fill_cache(m)
    m.n_past = depth
    m.decode(7)                                   # warm: run state first-touched, pool up
    t0 = time.perf_counter()
    for _ in range(tokens):
        m.decode(7)
    return tokens / (time.perf_counter() - t0)


def ours_prefill(store, kv: str, n: int, threads: int) -> float:
    from bitnet_cpu.engine.runtime.model import Model

    ids = np.random.default_rng(n).integers(100, 1000, n).tolist()
    m = Model(store, n_ctx=n + 2, kv_dtype=kv, threads=threads)
    m.prefill(ids[:16])                           # warm
    m.truncate(0)
    t0 = time.perf_counter()
    m.prefill(ids)
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench (left out if not given)")
    ap.add_argument("--ik-bench", help="ik_llama.cpp's llama-bench (left out if not given)")
    ap.add_argument("--depths", default="0,1024,4096,16384")
    ap.add_argument("--peer-depths", help="the depths the peers run at (default: all of --depths; a peer's row "
                    "first prefills its depth, which takes minutes at 16k)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per row (median reported)")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens timed per row")
    ap.add_argument("--prefill", type=int, default=4096, help="prompt length of the prefill rows (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", default="q4", choices=("q4", "i8"),
                    help="our store's LM head (default q4, what `bitnet run` uses; i8 where only that one is made)")
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--json", help="also write the rows here (rewritten after every row, so a stopped run keeps "
                    "what it measured)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one peer run may take (default 900)")
    ap.add_argument("--plot", help="also draw decode tok/s and share of the limit against depth (PNG)")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="measure nothing: print the table of saved runs (--json files, or files holding a list of "
                    "runs) together, and --plot them")
    a = ap.parse_args(argv)
    if a.report:
        runs = []
        for p in a.report:
            with open(p) as f:
                got = json.load(f)
            runs += got if isinstance(got, list) else [got]     # a file of several runs: a list of them
        print("\n".join(report_lines(runs)))
        if a.plot:
            plot(runs, a.plot)
        return 0
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.engine.runtime.model import kv_bytes_per_token
    from bitnet_cpu.simd import _kernels as K

    path = ensure_store(a.cache, head=a.head)
    store = Store(path)
    K.set_num_threads(a.threads)
    tq2, iq2 = os.path.join(a.cache, "2b4t.tq2_0.gguf"), os.path.join(a.cache, "2b4t.iq2_bn.gguf")
    engines = {"ours f16": None, "ours q8": None}
    if a.llama_bench:
        if os.path.exists(tq2):
            engines["llama.cpp TQ2_0"] = tq2
        else:
            print(f"depth_peers: {tq2} missing (bench/make_models.py): llama.cpp left out", file=sys.stderr)
    if a.ik_bench:
        if os.path.exists(iq2):
            engines["ik_llama.cpp IQ2_BN_R4"] = iq2
        else:
            print(f"depth_peers: {iq2} missing (bench/make_models.py --ik-quantize): ik left out", file=sys.stderr)
    wbytes = {e: (store_bytes_per_token(path) if p is None else gguf_bytes_per_token(p)) for e, p in engines.items()}
    kvpos = {e: (kv_bytes_per_token(store.config, e.split()[1]) if e.startswith("ours") else F16_KV_PER_POS)
             for e in engines}
    t = str(a.threads)

    def measure(e: str, depth: int | None) -> float | None:
        """depth None: the prefill row."""
        if e.startswith("ours"):
            kv = e.split()[1]
            return (ours_prefill(store, kv, a.prefill, a.threads) if depth is None
                    else ours_decode(store, kv, depth, a.tokens, a.threads))
        if e.startswith("llama.cpp"):
            args = (["-p", str(a.prefill), "-n", "0"] if depth is None
                    else ["-p", "0", "-n", str(a.tokens), "-d", str(depth)])
            return run_bench([a.llama_bench, "-m", engines[e], "-t", t, *args], a.timeout)
        args = (["-p", str(a.prefill), "-n", "0"] if depth is None
                else (["-p", "0", "-n", str(a.tokens)] if depth == 0 else ["-p", "0", "-n", "0", "-gp",
                                                                           f"{depth},{a.tokens}"]))
        return run_bench([a.ik_bench, "-m", engines[e], "-t", t, "-rtr", "1", *args], a.timeout)

    bw0 = stream_bandwidth(a.threads, mib=512, passes=3)["bandwidth_Bps"]
    rows = []
    plan = [int(d) for d in a.depths.split(",") if d] + ([None] if a.prefill else [])
    peer_depths = None if a.peer_depths is None else {int(d) for d in a.peer_depths.split(",") if d}
    for depth in plan:
        here = [e for e in engines if e.startswith("ours") or depth is None or peer_depths is None
                or depth in peer_depths]
        got: dict[str, list[float]] = {e: [] for e in here}
        for r in range(a.rounds):
            order = here if r % 2 == 0 else here[::-1]
            for e in order:
                v = measure(e, depth)
                if v is not None:
                    got[e].append(v)
        for e, vals in got.items():
            if vals:
                rows.append({"engine": e, "depth": depth, "tps": sorted(vals)[len(vals) // 2], "min": min(vals),
                             "max": max(vals), "n": len(vals)})
        done = [f"{r['engine']} {r['tps']:.1f}" for r in rows if r["depth"] == depth]
        print(f"[depth_peers] {'prefill' if depth is None else f'depth {depth}'}: {', '.join(done)} tok/s",
              file=sys.stderr, flush=True)
        save_json(a.json, {"stream_Bps": [bw0], "threads": a.threads, "path": K.active(), "rounds": a.rounds,
                           "prefill": a.prefill, "head": a.head, "weights_bytes": wbytes,
                           "kv_bytes_per_position": kvpos, "rows": rows})
    bw1 = stream_bandwidth(a.threads, mib=512, passes=3)["bandwidth_Bps"]
    bw = min(bw0, bw1)
    for r in rows:
        if r["depth"] is not None:
            r["share"] = r["tps"] * (wbytes[r["engine"]] + r["depth"] * kvpos[r["engine"]]) / bw
    res = {"stream_Bps": [bw0, bw1], "threads": a.threads, "path": K.active(), "rounds": a.rounds,
           "prefill": a.prefill, "head": a.head, "weights_bytes": wbytes, "kv_bytes_per_position": kvpos,
           "rows": rows}
    save_json(a.json, res)
    print("\n".join(report_lines([res])))
    if a.plot:
        plot([res], a.plot)
    return 0


def report_lines(runs: list[dict]) -> list[str]:
    """The markdown table of one or more runs' rows (a run per depth range: the peers' 16k rows take long
    enough to be a run of their own); each row's share uses its own run's stream rate."""
    out = []
    for res in runs:
        bw = res["stream_Bps"]
        out.append(f"{res['threads']} threads, path {res.get('path', '?')}; stream "
                   + " / ".join(f"{b / 1e9:.1f}" for b in bw) + " GB/s (before / after); median of "
                   + f"{res.get('rounds', '?')} alternating rounds (min-max)")
    out += ["", "| row | engine | tok/s | share of limit | ours q8 / it |", "|---|---|---|---|---|"]
    rows = [r for res in runs for r in res["rows"]]
    rows.sort(key=lambda r: (r["depth"] is None, r["depth"] or 0))
    prefill = next((res.get("prefill") for res in runs if res.get("prefill")), None)
    for r in rows:
        name = f"prefill pp{prefill}" if r["depth"] is None else f"decode at {r['depth']}"
        share = f"{r['share']:.0%}" if "share" in r else ""
        q8 = next((x["tps"] for x in rows if x["engine"] == "ours q8" and x["depth"] == r["depth"]), None)
        ratio = f"{q8 / r['tps']:.2f}x" if q8 and r["engine"] != "ours q8" else ""
        out.append(f"| {name} | {r['engine']} | {r['tps']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | {share} | {ratio} |")
    return out


def plot(runs: list[dict], path: str) -> None:
    """Decode tok/s and share of the bandwidth limit against depth, one line per engine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for res in runs for r in res["rows"] if r["depth"] is not None]
    depths = sorted({r["depth"] for r in rows})
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for e, style in zip(engines, ("o-", "o--", "s-", "^-", "v-")):
        got = {r["depth"]: r for r in rows if r["engine"] == e}
        xs = [i for i, d in enumerate(depths) if d in got]
        ax1.plot(xs, [got[depths[i]]["tps"] for i in xs], style, label=e)
        ax2.plot(xs, [100 * got[depths[i]].get("share", float("nan")) for i in xs], style, label=e)
    ax2.axhline(85, color="k", ls=":", lw=1, label="goal 85%")
    for ax, title in ((ax1, "decode tok/s"), (ax2, "share of the bandwidth limit, %")):
        ax.set_xticks(range(len(depths)), [str(d) for d in depths])
        ax.set_xlabel("positions already in the KV cache")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    bw = min(b for res in runs for b in res["stream_Bps"])
    fig.suptitle(f"2B-4T synthetic, {runs[0]['threads']} threads, path {runs[0].get('path', '?')}; "
                 f"stream >= {bw / 1e9:.1f} GB/s in each run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
