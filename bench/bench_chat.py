"""Chat time-to-first-token per turn: with the KV cache kept across turns (what bitchat does), a turn
only prefills its new tokens, so TTFT must not grow with the turn number for short turns.

    python bench/bench_chat.py [-m MODEL] [--turns 6] [-n 32] [-c CTX] [-t THREADS] [--no-baseline]

Uses only the public API (engine.api), like bitchat. For each turn it prints the prompt length, how
many tokens were reused from the cache, the TTFT with reuse, and (baseline, a second session whose
cache is reset before every turn) the TTFT of prefilling the whole conversation from scratch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

QUESTIONS = [
    "Hi! What is your name?",
    "What is a ternary weight?",
    "Why is decoding memory-bound?",
    "Give me one tip for fast CPU inference.",
    "What does a KV cache store?",
    "Thanks. Summarise our chat in one line.",
    "What is two plus two?",
    "Name a colour.",
]


def run_turn(llm, ids, params, max_tokens):
    """Generate one answer; returns (text, Stats)."""
    text, stats = [], None
    for chunk in llm.generate(ids, params, max_tokens=max_tokens):
        text.append(chunk.text)
        if chunk.stats is not None:
            stats = chunk.stats
    return "".join(text), stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="model (default: the bundled one)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("-n", "--max-tokens", type=int, default=32, help="answer length per turn")
    ap.add_argument("-c", "--ctx-size", type=int, default=None)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-baseline", action="store_true", help="skip the from-scratch prefill column")
    args = ap.parse_args(argv)

    from engine.api import SamplingParams, load_model

    t0 = time.perf_counter()
    llm = load_model(args.model, ctx=args.ctx_size, threads=args.threads, progress=False)
    fresh = None if args.no_baseline else load_model(args.model, ctx=args.ctx_size, threads=args.threads,
                                                     progress=False)
    print(f"# model {llm.name}, n_ctx {llm.n_ctx}, loaded in {time.perf_counter() - t0:.2f} s, "
          f"{args.turns} turns, answers of <= {args.max_tokens} tokens, greedy", flush=True)
    params = SamplingParams(temperature=0.0)
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'new':>5} {'ttft_ms':>9} {'full_prefill_ms':>16} "
          f"{'answer':>7} {'decode_tok/s':>13}")
    ttfts = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        ids = llm.chat_prompt(messages)
        if len(ids) + args.max_tokens >= llm.n_ctx:
            print(f"# stopping: turn {turn + 1} would overflow the {llm.n_ctx}-token context")
            break
        full = "-"
        if fresh is not None:
            fresh.reset()
            _, fstats = run_turn(fresh, ids, params, 1)
            full = f"{fstats.ttft_s * 1000:.1f}"
        answer, stats = run_turn(llm, ids, params, args.max_tokens)
        messages.append({"role": "assistant", "content": answer})
        ttfts.append(stats.ttft_s)
        print(f"{turn + 1:>4} {stats.n_prompt:>7} {stats.n_cached:>7} {stats.n_prompt - stats.n_cached:>5} "
              f"{stats.ttft_s * 1000:>9.1f} {full:>16} {stats.n_generated:>7} {stats.decode_tps:>13.1f}",
              flush=True)
    if len(ttfts) >= 2:
        later = ttfts[1:]
        print(f"# TTFT with KV reuse: turn 1 {ttfts[0] * 1000:.1f} ms, turns 2..{len(ttfts)} "
              f"min {min(later) * 1000:.1f} / max {max(later) * 1000:.1f} ms "
              f"(last/second = {ttfts[-1] / ttfts[1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
