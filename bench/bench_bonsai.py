"""Ternary Bonsai decode, ours vs llama.cpp on the same Q2_0 GGUF, in one run.

    python bench/bench_bonsai.py [--shape 1.7b|small] [--tokens 64] [--repeats 3] [--threads 2]
                                 [--llama-bench PATH/TO/llama-bench]

Makes (once, cached in bench/cache) a synthetic model of the Ternary-Bonsai-1.7B shape (Qwen3-1.7B: hidden 2048,
intermediate 6144, 28 layers, 16 query / 8 KV heads of 128, vocab 151936, tied f16 embedding; random ternary
weights with one f16 scale per 128 weights) as a `qwen3` GGUF with ggml's Q2_0 blocks (what mainline llama.cpp
reads; PrismML's files use 128-weight blocks of the same type id), and converts that very file
into our store (tg128 weights, default q4 head with exact rescoring). Then, alternating, each run in its own
process: our greedy decode and llama.cpp's (its own llama-bench, tg only; ggml type Q2_0 is in the llama.cpp the
llama-cpp-python 0.3.36 sdist vendors). Prints and writes bench/BONSAI_RESULTS.md: bytes read per token, tok/s
(best and median), share of the streaming-read bandwidth measured in the same run, ratio to llama.cpp.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from decode_rows import bandwidth, run_worker, store_bytes_per_token  # noqa: E402
from make_models import DEFAULT_CACHE  # noqa: E402

SHAPES = {
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960},
    "small": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 2048},
}


def gguf_bytes(path: str) -> int:
    """Every tensor of the file (llama.cpp reads them all per token: the tied f16 embedding is its head)."""
    from bitnet_cpu.engine.formats.gguf import GGUFFile

    with GGUFFile(path) as g:   # our reader: the `gguf` package does not know type 42 (Q2_0)
        return sum(t.nbytes for t in g.tensors.values())


def paths(cache: str, shape: str) -> tuple[str, str]:
    return os.path.join(cache, f"bonsai{shape}.q2_0.gguf"), os.path.join(cache, f"bonsai{shape}.bnstore")


def ensure_models(cache: str, shape: str) -> tuple[str, str]:
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, write_bonsai_gguf

    gguf, store = paths(cache, shape)
    os.makedirs(cache, exist_ok=True)
    if not os.path.exists(gguf):
        t0 = time.perf_counter()
        cfg = dict(SHAPES[shape], rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
        # ggml's own Q2_0 blocks (64 weights; each 128-group's scale in both halves): what llama.cpp reads.
        # PrismML's 128-weight blocks (Ternary Bonsai's published files) convert to the same store.
        # The embedding stays F16 (the same ternary values): llama.cpp then runs its tied head in F16, its
        # fastest form, rather than through its scalar Q2_0 dot.
        write_bonsai_gguf(SynthModel(cfg, seed=0, style="llama"), gguf + ".tmp", linear_type="Q2_0", embed_f16=True)
        os.replace(gguf + ".tmp", gguf)
        print(f"wrote {gguf} ({os.path.getsize(gguf) / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    if not os.path.exists(store):
        t0 = time.perf_counter()
        convert(gguf, store + ".tmp", progress=True)
        os.replace(store + ".tmp", store)
        print(f"converted to {store} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return gguf, store


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (else ours only)")
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--out", default=os.path.join(HERE, "BONSAI_RESULTS.md"))
    a = ap.parse_args(argv)
    if not 1 <= a.repeats <= 20 or not 1 <= a.tokens <= 4096:
        ap.error("--repeats 1..20, --tokens 1..4096")
    gguf, store = ensure_models(a.cache, a.shape)
    engines = ["ours"] + (["llama.cpp"] if a.llama_bench else [])
    runs: dict[str, list[float]] = {e: [] for e in engines}
    bws = [bandwidth(a.threads)]
    for rep in range(a.repeats):
        for eng in (engines if rep % 2 == 0 else engines[::-1]):
            if eng == "ours":
                r = run_worker(["--engine", "ours", "--model", store, "--draft-max", "0", "--tokens", str(a.tokens)],
                               a.threads)
            else:
                from llama_bench import llama_bench

                r = llama_bench(a.llama_bench, gguf, a.threads, a.tokens, prompt=0)
            print(f"{eng} repeat {rep + 1}: {r}", file=sys.stderr, flush=True)
            if "decode_tps" in r:
                runs[eng].append(r["decode_tps"])
    bws.append(bandwidth(a.threads))
    bw = max(b for b in bws if b) if any(bws) else None
    nbytes = {"ours": store_bytes_per_token(store), "llama.cpp": gguf_bytes(gguf)}
    ref = max(runs.get("llama.cpp") or [0]) or None
    ref_med = statistics.median(runs["llama.cpp"]) if runs.get("llama.cpp") else None
    lines = [f"# Ternary Bonsai decode ({a.shape} shape), ours vs llama.cpp Q2_0, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "",
             f"Synthetic model of the Ternary-Bonsai-{a.shape.upper()} shape (random ternary weights, one f16 scale per 128"
             f" weights), `{os.path.basename(gguf)}` (qwen3, Q2_0 linears, tied f16 embedding); ours converted from that"
             f" file. {a.threads} threads, {a.tokens} tokens, greedy, engines alternating, {a.repeats} runs each;"
             f" `python bench/bench_bonsai.py --shape {a.shape} --repeats {a.repeats} --tokens {a.tokens}"
             f"{' --llama-bench PATH' if a.llama_bench else ''}`. Streaming-read bandwidth in the same run:"
             f" {bw / 1e9:.1f} GB/s." if bw else "", "",
             "| engine | bytes/token | decode tok/s best | median | share of read bandwidth (best) | vs llama.cpp (best / median) |",
             "|---|---|---|---|---|---|"]
    for eng in engines:
        if not runs[eng]:
            lines.append(f"| {eng} | {nbytes[eng] / 1e6:.1f} MB | failed | | | |")
            continue
        best, med = max(runs[eng]), statistics.median(runs[eng])
        share = f"{best * nbytes[eng] / bw:.0%}" if bw else "-"
        ratio = f"{best / ref:.2f}x / {med / ref_med:.2f}x" if ref and ref_med else "-"
        lines.append(f"| {'ours (tg128 + q4 head)' if eng == 'ours' else 'llama.cpp Q2_0'} | {nbytes[eng] / 1e6:.1f} MB |"
                     f" {best:.1f} | {med:.1f} | {share} | {ratio} |")
    lines += ["", "Every run (tok/s): " + "; ".join(f"{e} " + " / ".join(f"{v:.1f}" for v in runs[e]) for e in engines), ""]
    text = "\n".join(lines)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
