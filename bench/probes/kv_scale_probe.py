"""Probe: int8 K/V with one scale per position per KV head (what --kv q8 stores) against one scale per 32 values
(llama.cpp's q8_0: an f16 scale per block of 32), on the bundled model's held-out text.

    python bench/probes/kv_scale_probe.py [--depth 1024]

The model runs token by token on an f32 cache; after each step the position just written is rounded in place,
in every layer, to one scheme (the step's own position saw its exact K / V once, the same for both schemes and
small next to `depth` positions). Prints, per scheme, the perplexity of the last 256 tokens, the mean KL of the
next-token distribution from the exact cache's, and the relative RMS error of the rounded K and V.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from bitnet_cpu.engine.formats.store import Store  # noqa: E402
from bitnet_cpu.engine.formats.tokenizer import Tokenizer  # noqa: E402
from bitnet_cpu.engine.runtime.model import Model  # noqa: E402
from bitnet_cpu.models import corpus  # noqa: E402

STORE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "models", "default.bnstore")


def round_groups(x: np.ndarray, group: int, f16_scale: bool) -> np.ndarray:
    """x [..., hd] rounded to int8 with one scale per `group` values (max|x| / 127), back to f32."""
    g = x.reshape(x.shape[:-1] + (-1, group))
    d = np.abs(g).max(-1, keepdims=True) / np.float32(127)
    if f16_scale:
        d = d.astype(np.float16).astype(np.float32)
    q = np.clip(np.rint(g / np.where(d > 0, d, 1)), -127, 127)
    return (q * d).astype(np.float32).reshape(x.shape)


def run(st, ids, scheme, hd):
    m = Model(st, n_ctx=len(ids) + 1, kv_dtype="f32")
    kc, vc = m._k_cache, m._v_cache          # [L, nkv, blocks, hd, 32] (transposed blocks), [L, nkv, ctx, hd]
    logps, err = [], {"k": [0.0, 0.0], "v": [0.0, 0.0]}
    for p, t in enumerate(ids):
        lg = m.decode(t).astype(np.float64)
        logps.append(lg - lg.max() - np.log(np.exp(lg - lg.max()).sum()))
        if scheme is None:
            continue
        k = kc[:, :, p // 32, :, p % 32].copy()
        v = vc[:, :, p, :].copy()
        kq, vq = (round_groups(x, *scheme) for x in (k, v))
        for name, x, xq in (("k", k, kq), ("v", v, vq)):
            err[name][0] += float(((x - xq) ** 2).sum())
            err[name][1] += float((x ** 2).sum())
        kc[:, :, p // 32, :, p % 32], vc[:, :, p, :] = kq, vq
    return np.array(logps), {n: (e[0] / e[1]) ** 0.5 if e[1] else 0.0 for n, e in err.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=1024)
    a = ap.parse_args()
    st = Store(STORE)
    tok = Tokenizer.from_store(st)
    hd = st.config.head_dim
    rng = random.Random(987654321)           # held out, as bench/kv_quality.py
    text, ids = "", []
    while len(ids) < a.depth + 1:
        text += corpus.story_doc(rng) + "\n"
        ids = tok.encode(text)
    ids = ids[: a.depth + 1]
    schemes = {"exact (f32)": None, f"per position per head ({hd} values, f32 scale)": (hd, False),
               "per 32 values (f16 scale, q8_0)": (32, True)}
    res = {name: run(st, ids[:-1], s, hd) for name, s in schemes.items()}
    tgt = np.array(ids[1:])[-256:]
    ref = res["exact (f32)"][0][-256:]
    print(f"bundled model, {a.depth} tokens of held-out text, head_dim {hd}; last 256 tokens:")
    print("| K/V rounding | perplexity | mean KL from exact | K rel. RMS error | V rel. RMS error |")
    print("|---|---|---|---|---|")
    for name, (lp, err) in res.items():
        lp = lp[-256:]
        ppl = float(np.exp(-lp[np.arange(256), tgt].mean()))
        kl = float((np.exp(ref) * (ref - lp)).sum(-1).mean())
        print(f"| {name} | {ppl:.4f} | {kl:.2e} | {err['k']:.4f} | {err['v']:.4f} |")


if __name__ == "__main__":
    main()
