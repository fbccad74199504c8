"""LM head precision vs the f16 head: greedy (top-1) agreement and KL(f16 || head) over N positions.

    python bench/head_quality.py [--positions 10000]

Models: the bundled trained model (models/bitnet-b1.58-tiny, on its own corpus: stories, chat, sums) and
random models shaped like the parity tests' (engine/synth.py small_config, random token ids; their logits are
nearly flat, the hard case for a quantized head). Each model is converted once per head kind (f16, i8, q4)
into a temporary directory, then the same windows of tokens run through Model.forward.

The q4 head recomputes its best RESCORE_K candidates from f16 rows (engine/runtime/model.py); rows "q4 K=n"
run the same store with n candidates rescored (K=0: the q4 head alone), to show where agreement saturates.
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
from bitnet_cpu.engine.runtime.model import RESCORE_K, Model  # noqa: E402
from bitnet_cpu.engine.formats.store import Store  # noqa: E402
from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir  # noqa: E402

HEADS = ("i8", "q4")
RESCORE_KS = (0, 4, 16, 64)


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def with_rescore_k(model: Model, k: int) -> Model:
    """The model with k candidates rescored (0: none), through the scratch widths head_rescore reads k from."""
    if k == 0:
        model.weights.rescore = None
    else:
        model._resc_heap = np.zeros((model._resc_heap.shape[0], k), np.float32)
        model._resc_idx = np.zeros((model._resc_idx.shape[0], k), np.int32)
    return model


def compare(src: str, windows: list[list[int]], tmp: str, label: str):
    stores = {h: Store(convert(src, os.path.join(tmp, f"{label}.{h}.bnstore"), lm_head=h, progress=False))
              for h in ("f16",) + HEADS}
    n_ctx = max(len(w) for w in windows)
    models = {"f16": Model(stores["f16"], n_ctx=n_ctx), "i8": Model(stores["i8"], n_ctx=n_ctx)}
    for k in RESCORE_KS:
        name = "q4" if k == RESCORE_K else f"q4 K={k}"
        models[name] = with_rescore_k(Model(stores["q4"], n_ctx=n_ctx), k)
    kinds = [h for h in models if h != "f16"]
    agree = {h: 0 for h in kinds}
    kl = {h: 0.0 for h in kinds}
    n = 0
    for w in windows:
        ref = log_softmax(models["f16"].forward(w))
        top = ref.argmax(axis=1)
        for h in kinds:
            lp = log_softmax(models[h].forward(w))
            agree[h] += int((lp.argmax(axis=1) == top).sum())
            kl[h] += float((np.exp(ref) * (ref - lp)).sum())
        n += len(w)
    for h in kinds:
        name = f"{h} (K={RESCORE_K}, default)" if h == "q4" else h
        print(f"{label:28s} head {name:18s}: top-1 agreement {agree[h] / n:8.4%}  mean KL {kl[h] / n:.2e} nats  "
              f"({n} positions)", flush=True)
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
