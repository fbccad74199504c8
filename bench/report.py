"""Aggregate end-to-end benchmark sessions into numbers, targets, a markdown report and a bar chart.

Input: the JSON lines of bench/e2e_worker.py (one per session), the limits of bench/limits.py, and bytes
read per decoded token for each engine. Every figure is min / median / max over the repeats; a ratio
ours/theirs is taken per repeat (the two engines ran back to back) and then summarized the same way.
"""
from __future__ import annotations

import statistics
from typing import Callable, Iterable

# Quoted, not measured in this run: figures measured earlier on this machine, before this benchmark existed
# (2 threads, 2B-4T shape, synthetic weights).
QUOTED = {
    "bitnet.cpp I2_S decode tok/s": 12.6,
    "bitnet.cpp I2_S prefill pp512 tok/s": 67.5,
    "llama.cpp TQ2_0 (f16 embd) decode tok/s": 12.9,
    "llama.cpp TQ2_0 (f16 embd) prefill pp512 tok/s": 50.6,
    "llama.cpp TQ2_0 (Q6_K embd) decode tok/s": 16.4,
    "streaming read GB/s (2 threads)": 33.0,
}
QUOTED_SHAPE = "2b4t"   # the model shape they were measured on (bench/make_models.py --shape)

GB = 1e9
MIB = 1 << 20


def stats(values: Iterable[float | None]) -> dict | None:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    return {"min": v[0], "median": statistics.median(v), "max": v[-1], "n": len(v)}


def _get(session: dict, key: str):
    """Dotted lookup: "prefill_tps.512", "chat_ttft_s.4" (list index)."""
    cur = session
    for part in key.split("."):
        if cur is None:
            return None
        if isinstance(cur, list):
            i = int(part)
            cur = cur[i] if -len(cur) <= i < len(cur) else None
        else:
            cur = cur.get(part)
    return cur


# metric key -> (label, unit, higher is better, extractor)
def metric_table(turns: int, decode: int = 128) -> list[tuple[str, str, str, bool, Callable[[dict], float | None]]]:
    last = turns - 1

    def chat_ratio(s):
        a, b = _get(s, f"chat_ttft_s.{last}"), _get(s, "chat_ttft_s.0")
        return a / b if a and b else None

    return [
        ("load_cold_s", "load, cold page cache", "s", False, None),
        ("first_token_cold_s", "load to first prompt token, cold", "s", False, None),
        ("load_warm_s", "load, warm", "s", False, lambda s: s.get("load_s")),
        ("first_token_warm_s", "load to first prompt token, warm", "s", False, lambda s: s.get("first_token_s")),
        ("prefill128", "prefill 128 tokens", "tok/s", True, lambda s: _get(s, "prefill_tps.128")),
        ("prefill512", "prefill 512 tokens", "tok/s", True, lambda s: _get(s, "prefill_tps.512")),
        ("decode", f"decode ({decode} tokens)", "tok/s", True, lambda s: s.get("decode_tps")),
        ("ttft", "time to first token (128-token prompt)", "s", False, lambda s: s.get("ttft_s")),
        ("chat_ttft_1", "chat turn 1 time to first token", "s", False, lambda s: _get(s, "chat_ttft_s.0")),
        (f"chat_ttft_{turns}", f"chat turn {turns} time to first token", "s", False,
         lambda s: _get(s, f"chat_ttft_s.{last}")),
        ("chat_ttft_ratio", f"chat TTFT turn {turns} / turn 1", "x", False, chat_ratio),
        ("peak_rss_mib", "peak resident memory", "MiB", False,
         lambda s: s["peak_rss"] / MIB if s.get("peak_rss") else None),
    ]


def aggregate(sessions: list[dict], cold: list[dict], turns: int, decode: int = 128) -> dict:
    """{metric: {engine: stats, "ratio": stats of per-repeat ours/llama}} plus the raw per-repeat values."""
    table = {}
    cold_get = {"load_cold_s": lambda s: s.get("load_s"), "first_token_cold_s": lambda s: s.get("first_token_s")}
    for key, label, unit, higher, fn in metric_table(turns, decode):
        src = cold if key in cold_get else sessions
        fn = cold_get.get(key, fn)
        per = {}
        for s in src:
            per.setdefault(s["engine"], {}).setdefault(s.get("repeat", 0), fn(s))
        row = {"label": label, "unit": unit, "higher_is_better": higher}
        for eng, by_rep in per.items():
            row[eng] = stats(by_rep.values())
        if "ours" in per and "llama" in per:
            ratios = [per["ours"][r] / per["llama"][r] for r in per["ours"]
                      if r in per["llama"] and per["ours"][r] and per["llama"][r]]
            row["ratio"] = stats(ratios)
        table[key] = row
    return table


def targets(table: dict, ours_bytes_per_token: int, bandwidth_Bps: float, store_bytes: int, kv_bytes: int,
            turns: int, peak_mac_per_s: float | None, macs_per_token: float,
            quoted_shape: str | None = None) -> list[dict]:
    """Each target (decode, bandwidth share, prefill, load, memory, chat TTFT): the measured median, the goal, met or
    missed and by how much. quoted_shape: the model shape of this run where it is not QUOTED_SHAPE, the one the
    quoted peer figures were measured on: the target set against them is n/a (a tiny model beat them 300-fold)."""
    def med(key, eng="ours"):
        st = (table.get(key) or {}).get(eng)
        return st["median"] if st else None

    out = []

    def add(name, value, goal, ok_if_ge, fmt, note=""):
        if value is None:
            out.append({"target": name, "measured": "not measured", "goal": fmt(goal), "status": "n/a", "note": note})
            return
        ok = value >= goal if ok_if_ge else value <= goal
        miss = "" if ok else (f"{goal / value:.2f}x short" if ok_if_ge else f"{value / goal:.2f}x over")
        out.append({"target": name, "measured": fmt(value), "goal": fmt(goal), "status": "met" if ok else "MISSED",
                    "note": (note + ("; " if note and miss else "") + miss)})

    x = lambda v: f"{v:.2f}x"
    ratio = (table.get("decode") or {}).get("ratio")
    add("decode vs llama.cpp TQ2_0, same file", ratio["median"] if ratio else None, 2.0, True, x)
    dec = med("decode")
    limit = bandwidth_Bps / ours_bytes_per_token if ours_bytes_per_token else None
    add("decode share of read bandwidth", dec / limit if dec and limit else None, 0.75, True,
        lambda v: f"{100 * v:.0f}%", f"limit {limit:.1f} tok/s" if limit else "")
    pp = med("prefill512")
    note = ""
    if peak_mac_per_s and pp:
        note = f"path peak {peak_mac_per_s / 1e9:.0f} GMAC/s = {peak_mac_per_s / macs_per_token:.0f} tok/s; " \
               f"reached {100 * pp * macs_per_token / peak_mac_per_s:.0f}%"
    name, tps = "prefill 512 vs 2x bitnet.cpp 67.5 tok/s (quoted)", lambda v: f"{v:.1f} tok/s"
    if quoted_shape and quoted_shape != QUOTED_SHAPE:   # measured, but not comparable with the quoted figure
        out.append({"target": name, "measured": "not measured" if pp is None else tps(pp), "goal": tps(2 * 67.5),
                    "status": "n/a", "note": f"quoted for the {QUOTED_SHAPE} shape; this run's is {quoted_shape}"})
    else:
        add(name, pp, 2 * 67.5, True, tps, note)
    add("warm load to first prompt token", med("first_token_warm_s"), 0.3, False, lambda v: f"{v:.3f} s",
        f"load alone {med('load_warm_s'):.3f} s" if med("load_warm_s") is not None else "")
    peak = med("peak_rss_mib")
    budget = (store_bytes + kv_bytes) * 1.1 / MIB
    add("peak memory <= store + KV cache + 10%", peak, budget, False, lambda v: f"{v:.0f} MiB",
        f"store {store_bytes / MIB:.0f} MiB + KV {kv_bytes / MIB:.0f} MiB")
    add(f"chat TTFT turn {turns} within 20% of turn 1", med("chat_ttft_ratio"), 1.2, False, x)
    return out


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v:.3f}"
    if unit == "x":
        return f"{v:.2f}"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _mmm(st: dict | None, unit: str) -> str:
    if not st:
        return "-"
    return f"{_fmt(st['median'], unit)} ({_fmt(st['min'], unit)} .. {_fmt(st['max'], unit)})"


def markdown(ctx: dict) -> str:
    """ctx: machine, settings, table, targets, limits, bytes, quoted comparison, notes."""
    L = []
    m = ctx["machine"]
    L.append("# End-to-end benchmark: bitnet-cpu vs llama.cpp\n")
    L.append(f"Generated by `{ctx['command']}` on {ctx['date']} (git {ctx.get('git', '?')}).\n")
    L.append("## Machine\n")
    L.append(f"- CPU: {m['cpu']}, {m['cores']} cores, flags: {m['flags']}")
    L.append(f"- RAM {m['ram_gib']:.0f} GiB, kernel {m['kernel']}, Python {m['python']}, numpy {m['numpy']}")
    L.append(f"- our kernel path: `{m['kernel_path']}`; llama.cpp: llama-cpp-python {m['llama_cpp']}")
    L.append(f"- measured in this run, {ctx['threads']} threads: streaming read "
             f"{ctx['limits']['bandwidth_Bps'] / GB:.1f} GB/s ({ctx['limits']['method']})")
    if ctx.get("peak_note"):
        L.append(f"- int8 path: {ctx['peak_note']}")
    L.append("")
    L.append("## Setup\n")
    for line in ctx["setup"]:
        L.append(f"- {line}")
    L.append("")
    L.append(f"## Results ({ctx['repeats']} repeats, engines alternating; median (min .. max))\n")
    f16 = any("ours_f16" in row for row in ctx["table"].values())
    L.append("| metric | unit | ours | " + ("ours, f16 LM head | " if f16 else "") + "llama.cpp | ours / llama.cpp |")
    L.append("|---|---|---|---|" + ("---|" if f16 else "") + "---|")
    for key, row in ctx["table"].items():
        extra = f"{_mmm(row.get('ours_f16'), row['unit'])} | " if f16 else ""
        L.append(f"| {row['label']} | {row['unit']} | {_mmm(row.get('ours'), row['unit'])} | {extra}"
                 f"{_mmm(row.get('llama'), row['unit'])} | {_mmm(row.get('ratio'), 'x')} |")
    L.append("")
    L.append("## Decode against the memory limit\n")
    L.append("| engine | weight bytes read per token | limit at measured bandwidth | decode (median) | share |")
    L.append("|---|---|---|---|---|")
    for row in ctx["bandwidth_rows"]:
        L.append(f"| {row['engine']} | {row['bytes'] / MIB:.0f} MiB ({row['what']}) | {row['limit']:.1f} tok/s | "
                 f"{_fmt(row['decode'], 'tok/s')} tok/s | {_pct(row['decode'], row['limit'])} |")
    L.append("")
    L.append("## Targets\n")
    L.append("| target | measured (median) | goal | status | note |")
    L.append("|---|---|---|---|---|")
    for t in ctx["targets"]:
        L.append(f"| {t['target']} | {t['measured']} | {t['goal']} | {t['status']} | {t['note']} |")
    L.append("")
    L.append("## Quoted reference figures (NOT measured in this run)\n")
    L.append("Measured earlier on this machine, before this benchmark existed (2 threads, 2B-4T shape, synthetic weights).\n")
    shape = ctx.get("shape") or QUOTED_SHAPE
    if shape != QUOTED_SHAPE:
        L.append(f"This run's model has the `{shape}` shape, not theirs: its ratios to them would compare different "
                 "models (n/a).\n")
    L.append("| reference | quoted | ours (this run, median) | ours / quoted |")
    L.append("|---|---|---|---|")
    for row in ctx["quoted_rows"]:
        rel = ("n/a" if shape != QUOTED_SHAPE else "-" if row["ours"] is None
               else f"{row['ours'] / row['quoted']:.2f}x")
        L.append(f"| {row['name']} | {row['quoted']} | {_fmt(row['ours'], 'tok/s')} | {rel} |")
    L.append("")
    if ctx.get("notes"):
        L.append("## Notes\n")
        for n in ctx["notes"]:
            L.append(f"- {n}")
        L.append("")
    return "\n".join(L)


def _pct(v, limit):
    return "-" if not v or not limit else f"{100 * v / limit:.0f}%"


def chart(table: dict, path: str, title: str) -> bool:
    """Grouped bars (median with min..max whiskers) for the throughput metrics and the latency metrics."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    last_turn = [k for k in table if k.startswith("chat_ttft_") and k[10:].isdigit() and k != "chat_ttft_1"]
    groups = [("throughput (tok/s, higher is better)", ["prefill128", "prefill512", "decode"]),
              ("latency (s, lower is better)", ["first_token_warm_s", "first_token_cold_s", "ttft", "chat_ttft_1"]
               + last_turn)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"ours": "#2a7ab9", "ours_f16": "#7fb3de", "llama": "#d9822b"}
    names = {"ours": "bitnet-cpu (ours)", "ours_f16": "ours, f16 LM head", "llama": "llama.cpp"}
    engines = [e for e in colors if any(e in row for row in table.values())]
    width = 0.8 / max(len(engines), 1)
    for ax, (gtitle, keys) in zip(axes, groups):
        flat = [k for k in keys if k in table]
        for j, eng in enumerate(engines):
            xs, ys, lo, hi = [], [], [], []
            for i, k in enumerate(flat):
                st = table[k].get(eng)
                if st:
                    xs.append(i + (j - (len(engines) - 1) / 2) * width)
                    ys.append(st["median"])
                    lo.append(st["median"] - st["min"])
                    hi.append(st["max"] - st["median"])
            if xs:
                ax.bar(xs, ys, width=width, color=colors[eng], yerr=[lo, hi], capsize=3, label=names[eng])
                for x_, y_ in zip(xs, ys):
                    ax.annotate(f"{y_:.3g}", (x_, y_), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(flat)))
        ax.set_xticklabels([table[k]["label"].replace(" time to first token", " TTFT") for k in flat],
                           rotation=20, ha="right", fontsize=8)
        ax.set_title(gtitle, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
