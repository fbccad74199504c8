"""LM head precision vs the f16 head: greedy (top-1) agreement and KL(f16 || head) over N positions.

    python bench/head_quality.py [--positions 10000]

Models: the bundled trained model (models/bitnet-b1.58-tiny, on its own corpus: stories, chat, sums) and
random models shaped like the parity tests' (engine/synth.py small_config, random token ids; their logits are
nearly flat, the hard case for a quantized head). Each model is converted once per head kind (f16, i8, q4)
into a temporary directory, then the same windows of tokens run through Model.forward.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bitnet_cpu.engine.formats.convert import convert  # noqa: E402
from bitnet_cpu.engine.runtime.model import Model  # noqa: E402
from bitnet_cpu.engine.formats.store import Store  # noqa: E402
from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir  # noqa: E402

HEADS = ("i8", "q4")


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def compare(src: str, windows: list[list[int]], tmp: str, label: str):
    stores = {h: Store(convert(src, os.path.join(tmp, f"{label}.{h}.bnstore"), lm_head=h, progress=False))
              for h in ("f16",) + HEADS}
    models = {h: Model(s, n_ctx=max(len(w) for w in windows)) for h, s in stores.items()}
    agree = {h: 0 for h in HEADS}
    kl = {h: 0.0 for h in HEADS}
    n = 0
    for w in windows:
        ref = log_softmax(models["f16"].forward(w))
        top = ref.argmax(axis=1)
        for h in HEADS:
            lp = log_softmax(models[h].forward(w))
            agree[h] += int((lp.argmax(axis=1) == top).sum())
            kl[h] += float((np.exp(ref) * (ref - lp)).sum())
        n += len(w)
    for h in HEADS:
        print(f"{label:28s} head {h}: top-1 agreement {agree[h] / n:.4%}  mean KL {kl[h] / n:.2e} nats  ({n} positions)")
    for s in stores.values():
        s.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--positions", type=int, default=10000)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bitnet-headq-") as tmp:
        # the bundled model on its own corpus
        sys.path.insert(0, os.path.join(ROOT, "models"))
        import corpus  # models/corpus.py
        from bitnet_cpu.engine.formats.store import Store as _S
        from bitnet_cpu.engine.formats.tokenizer import Tokenizer
        bundled = os.path.join(ROOT, "models", "bitnet-b1.58-tiny")
        tok = Tokenizer.from_store(_S(os.path.join(ROOT, "models", "default.bnstore")))
        rng = random.Random(7)
        pairs = corpus.split_pairs(1)[1]
        ids: list[int] = []
        while len(ids) < a.positions:
            doc = rng.choice([corpus.story_doc(rng), corpus.chat_doc(rng, pairs), corpus.bare_add_doc(rng, pairs)])
            ids += tok.encode(doc, add_bos=False, special=True)
        ids = ids[: a.positions]
        compare(bundled, [ids[i: i + 500] for i in range(0, len(ids), 500)], tmp, "bundled (own corpus)")
        # random parity-test-like models
        for seed, cfg in ((1, {}), (2, {"hidden_size": 512, "vocab_size": 2048})):
            m = SynthModel(small_config(**cfg), seed=seed)
            d = os.path.join(tmp, f"synth{seed}")
            write_hf_dir(m, d)
            r = np.random.default_rng(seed)
            V = m.config["vocab_size"] if isinstance(m.config, dict) else small_config(**cfg)["vocab_size"]
            seq = r.integers(0, V, a.positions).tolist()
            compare(d, [seq[i: i + 250] for i in range(0, len(seq), 250)], tmp,
                    f"random hidden {small_config(**cfg)['hidden_size']} vocab {V}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
