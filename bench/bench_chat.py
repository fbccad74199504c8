"""Chat time-to-first-token per turn, measured on bitchat's own session (chat/session.py, which uses
only the public engine API). With the KV cache kept across turns a turn only prefills its new tokens,
so TTFT must not grow with the turn number for short turns.

    python bench/bench_chat.py [-m MODEL] [--turns 6] [-n 32] [-c CTX] [-t THREADS] [--no-baseline]
                               [--no-splice]

Per turn: prompt tokens, how many were reused from the cache, TTFT, and (baseline: a second session
whose cache is reset before each turn) the TTFT of prefilling the same prompt from scratch.
--no-splice re-renders the whole conversation each turn instead of extending the cached tokens
(chat/splice.py), to show what splicing saves.
"""
from __future__ import annotations

import argparse
import io
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="model (default: the bundled one)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("-n", "--max-tokens", type=int, default=32, help="answer length per turn")
    ap.add_argument("-c", "--ctx-size", type=int, default=None)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-baseline", action="store_true", help="skip the from-scratch prefill column")
    ap.add_argument("--no-splice", action="store_true", help="re-render the whole conversation every turn")
    args = ap.parse_args(argv)

    from bitnet_cpu.chat.commands import Settings
    from bitnet_cpu.chat.render import Output
    from bitnet_cpu.chat.session import ChatSession
    from bitnet_cpu.engine.api import SamplingParams, load_model

    from bitnet_cpu.engine.errors import BitNetError

    t0 = time.perf_counter()
    try:   # a missing or broken model: one line, as `bitnet bench` says it
        llm = load_model(args.model, ctx=args.ctx_size, threads=args.threads, progress=False)
        fresh = None if args.no_baseline else load_model(args.model, ctx=args.ctx_size, threads=args.threads,
                                                         progress=False)
    except BitNetError as e:
        print(f"bench_chat: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"# model {llm.name}, n_ctx {llm.n_ctx}, loaded in {time.perf_counter() - t0:.2f} s, "
          f"{args.turns} turns, answers of <= {args.max_tokens} tokens, greedy, "
          f"{'re-rendered' if args.no_splice else 'spliced'} prompts", flush=True)
    sink = io.StringIO()
    session = ChatSession(llm, Settings(temp=0.0, max_tokens=args.max_tokens), Output(sink, sink, interactive=False),
                          system="You are a helpful assistant. Answer briefly.")
    session.splice = not args.no_splice
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'new':>5} {'ttft_ms':>9} {'full_prefill_ms':>16} "
          f"{'answer':>7} {'decode_tok/s':>13}")
    ttfts = []
    for turn in range(args.turns):
        session.ask(QUESTIONS[turn % len(QUESTIONS)])
        s = session.last_stats
        if s is None or getattr(s, "n_cached", None) is None:
            print(f"# turn {turn + 1}: no answer ({sink.getvalue().strip().splitlines()[-1:]})")
            break
        full = "-"
        if fresh is not None:
            fresh.reset()
            for chunk in fresh.generate(session.last_prompt_ids, SamplingParams(temperature=0.0), max_tokens=1):
                if chunk.stats is not None:
                    full = f"{chunk.stats.ttft_s * 1000:.1f}"
        ttfts.append(s.ttft_s)
        print(f"{turn + 1:>4} {s.n_prompt:>7} {s.n_cached:>7} {s.n_prompt - s.n_cached:>5} "
              f"{s.ttft_s * 1000:>9.1f} {full:>16} {s.n_generated:>7} {s.decode_tps:>13.1f}", flush=True)
    if len(ttfts) >= 2:
        later = ttfts[1:]
        print(f"# TTFT with KV reuse: turn 1 {ttfts[0] * 1000:.1f} ms, turns 2..{len(ttfts)} "
              f"min {min(later) * 1000:.1f} / max {max(later) * 1000:.1f} ms "
              f"(last/second = {ttfts[-1] / ttfts[1]:.2f})")
    if session.n_dropped:
        print(f"# {session.n_dropped} turns were dropped to fit the context")
    return 0


if __name__ == "__main__":
    sys.exit(main())
