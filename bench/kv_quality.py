"""The int8 KV cache (--kv q8) against f16 on the bundled model: greedy agreement over long generations and
perplexity of held-out procedural text (models/corpus.py stories from seeds the training never drew) at depths.

    python bench/kv_quality.py [--tokens 1000] [--depths 512,2048,4096]

Prints one line per prompt (position of the first greedy divergence, share of positions equal) and one per depth
(perplexity of the last 256 tokens of a window of that many tokens with f32, f16 and q8 KV, and the mean KL of
the f16 and q8 caches' next-token distributions from the f32 cache's).
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bitnet_cpu.engine.formats.store import Store  # noqa: E402
from bitnet_cpu.engine.formats.tokenizer import Tokenizer  # noqa: E402
from bitnet_cpu.engine.runtime.model import Model  # noqa: E402
from bitnet_cpu.models import corpus  # noqa: E402

STORE = os.path.join(os.path.dirname(HERE), "models", "default.bnstore")


def greedy(st, kv, prompt, n):
    m = Model(st, n_ctx=len(prompt) + n + 1, kv_dtype=kv)
    lg, out = m.prefill(prompt), []
    for _ in range(n):
        t = int(np.argmax(lg))
        out.append(t)
        lg = m.decode(t)
    return out


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000, help="greedy tokens per prompt")
    ap.add_argument("--depths", default="512,2048,4096")
    a = ap.parse_args()
    st = Store(STORE)
    tok = Tokenizer.from_store(st)
    cfg = st.config
    print(f"model: {STORE} (trained context {cfg.context_length}, {cfg.n_layers} layers, {cfg.n_kv_heads} KV heads "
          f"x {cfg.head_dim})")
    prompts = ["Once upon a time", "What is 37 + 45?", "The little robot"]
    for p in prompts:
        ids = tok.encode(p)
        f, q = greedy(st, "f16", ids, a.tokens), greedy(st, "q8", ids, a.tokens)
        first = next((i for i, (x, y) in enumerate(zip(f, q)) if x != y), a.tokens)
        same = float(np.mean(np.array(f) == np.array(q)))
        print(f"greedy {a.tokens} tokens after {p!r}: first divergence at token {first}, positions equal {same:.3f}")
    rng = random.Random(987654321)   # held out: training drew its stories from other seeds
    text = ""
    ids: list[int] = []
    depths = [int(d) for d in a.depths.split(",")]
    while len(ids) < max(depths):
        text += corpus.story_doc(rng) + "\n"
        ids = tok.encode(text)
    for d in depths:
        window = ids[:d]
        res = {}
        for kv in ("f32", "f16", "q8"):
            m = Model(st, n_ctx=d, kv_dtype=kv)
            lp = log_softmax(m.forward(window[:-1])[-256:])
            res[kv] = lp
        tgt = np.array(window[-256:])
        ppl = {kv: float(np.exp(-lp[np.arange(256), tgt].mean())) for kv, lp in res.items()}
        kl = {kv: float((np.exp(res["f32"]) * (res["f32"] - res[kv])).sum(-1).mean()) for kv in ("f16", "q8")}
        warn = " (past the trained context)" if d > cfg.context_length else ""
        print(f"depth {d}{warn}: perplexity of the last 256 tokens f32 {ppl['f32']:.4f}  f16 {ppl['f16']:.4f}  "
              f"q8 {ppl['q8']:.4f}; mean KL from the f32 cache: f16 {kl['f16']:.2e}  q8 {kl['q8']:.2e}")


if __name__ == "__main__":
    main()
