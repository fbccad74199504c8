"""Whole models in bitnet.cpp's TL1 / TL2 layouts (a script, not CI: it needs bitnet.cpp's converter source).

For each TL model shape bitnet.cpp ships presets for, a synthetic checkpoint at full depth (tiny vocabulary) is
packed to TL1 and TL2 with bitnet.cpp's own code after its codegen script ran with setup_env.py's preset command
for that model (see tests/data/tl/make_tl_files.py for what runs unchanged and what is reproduced), then our
`convert` reads it; the greedy tokens and the logits must equal those of the TQ2_0 file of the same weights (for
bitnet_b1_58-3B, whose 3200 / 8640 are not whole 256-blocks and which TQ2_0 cannot hold, those of the f16
checkpoint directory itself, ternarized by us at conversion).
Reports bitnet.cpp's packing time and our conversion time.

    BITNET_SRC=/tmp/bnconv PYTHONPATH=<dir holding bitnet_cpu> python bench/tl_whole_models.py \
        [--models bitnet_b1_58-large,bitnet_b1_58-3B] [--layers N] [--out DIR]

Llama3-8B-1.58 goes through bitnet.cpp's LlamaModel path (make_tl_files.make_llama_model: q/k permuted, untied
F16 head, no weight_quant), its checkpoint style engine.synth's "llama" (SiLU, no sub-norms).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "data", "tl"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import make_tl_files as MK  # noqa: E402

from bitnet_cpu.engine.api import load_model  # noqa: E402
from bitnet_cpu.engine.formats.convert import convert  # noqa: E402
from bitnet_cpu.engine.synth import SynthModel, write_gguf_tq, write_hf_dir  # noqa: E402

# setup_env.py's codegen commands (microsoft/BitNet 7c57a5a) and the models' shapes
PRESETS = {
    "bitnet_b1_58-large": ({"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 24,
                            "num_attention_heads": 16, "num_key_value_heads": 16},
                           {"TL1": ("256,128,256", "128,64,128", "32,64,32"),
                            "TL2": ("256,128,256", "96,192,96", "32,32,32")}),
    "bitnet_b1_58-3B": ({"hidden_size": 3200, "intermediate_size": 8640, "num_hidden_layers": 26,
                         "num_attention_heads": 32, "num_key_value_heads": 32},
                        {"TL1": ("160,320,320", "64,128,64", "32,64,32"),
                         "TL2": ("160,320,320", "96,96,96", "32,32,32")}),
    "Llama3-8B-1.58-100B-tokens": ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                    "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
                                   {"TL1": ("256,128,256,128", "128,64,128,64", "32,64,32,64"),
                                    "TL2": ("256,128,256,128", "96,96,96,96", "32,32,32,32")}),
}
# ternary by random byte: exactly two nonzeros in every 4 consecutive weights (6 places x 4 signs), so mean|W| is
# exactly half of |W|'s one value and the converter's scale is a power of two (f16-exact, as TQ2_0 stores it)
_PATTERNS = np.array([[a, b] for a in range(4) for b in range(a + 1, 4)])
_LUT = np.zeros((256, 4), np.int8)
for v in range(256):
    a, b = _PATTERNS[v % 6]
    _LUT[v, a] = 1 if v // 6 % 2 else -1
    _LUT[v, b] = 1 if v // 12 % 2 else -1


class HalfDense(SynthModel):
    def ternary(self, prefix):
        out, inp = self._shape(prefix)
        return _LUT[np.frombuffer(self._rng(prefix + ".t").bytes(out * inp // 4), np.uint8)].reshape(out, inp)

    def weight_scale(self, prefix):
        return 2.0 ** -5

    def master(self, prefix):
        return self.ternary(prefix).astype(np.float32) * np.float32(2.0 ** -4)

    def lm_head(self):
        return self.embed() if self.style != "llama" else super().lm_head()


def run(model: str, layers: int | None, out: str, ns) -> list[str]:
    cfg, options = PRESETS[model]
    llama = model.startswith("Llama3")
    cfg = dict(cfg, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=not llama)
    if layers:
        cfg["num_hidden_layers"] = layers
    m = HalfDense(cfg, seed=3, style="llama" if llama else "1bitllm")
    rows, runs = [], {}
    if m.D % 256 == 0 and m.I % 256 == 0:   # TQ2_0 needs rows that are whole 256-blocks
        ref, ref_path = "TQ2_0", os.path.join(out, f"{model}.tq2_0.gguf")
        write_gguf_tq(m, ref_path, "TQ2_0", hidden_activation=None, quantizer="fast",
                      arch="llama" if llama else "bitnet")
    else:                                   # 3B (3200 / 8640): the f16 checkpoint directory itself
        ref, ref_path = "checkpoint", write_hf_dir(m, os.path.join(out, f"{model}.hf"))
    for kind in (ref, "TL1", "TL2"):
        path, pack_s = ref_path, 0.0
        if kind != ref:
            t0 = time.time()
            if llama:
                MK.make_llama_model(ns, kind, out, m, f"{model}.{kind.lower()}", model, options[kind])
            else:
                MK.make_model(ns, kind, out, m=m, stem=f"{model}.{kind.lower()}", model=model,
                              options=options[kind], compress=False)
            pack_s = time.time() - t0
            path = os.path.join(out, f"{model}.{kind.lower()}.gguf")
        t0 = time.time()
        store = convert(path, path + ".bnstore", lm_head="f16", progress=False)
        conv_s = time.time() - t0
        lm = load_model(store, ctx=64, progress=False)
        ids = lm.tokenize("Once upon a time, in a small village", add_bos=True)
        logits = lm.forward(ids)
        lm.model.reset()
        lg, toks = lm.model.prefill(ids), []
        for _ in range(16):
            toks.append(int(np.argmax(lg)))
            lg = lm.model.decode(toks[-1])
        runs[kind] = (logits, toks)
        same = "reference" if kind == ref else (
            "equal" if toks == runs[ref][1] and np.array_equal(logits, runs[ref][0]) else "DIFFERENT")
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) if os.path.isdir(path) else \
            os.path.getsize(path)
        rows.append(f"| {model} | {m.L} | {kind} | {size / 1e6:.0f} MB | "
                    + (f"{pack_s:.1f} s" if kind != ref else "-") + f" | {conv_s:.1f} s | {same} |")
        print(rows[-1], flush=True)
        for p in (path + ".bnstore",):
            if os.path.exists(p):
                os.remove(p)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real depth (quick runs)")
    ap.add_argument("--out", default="/tmp/tl_whole")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ns = MK.bitnet_conv.load(os.path.join(MK.SRC, "utils", "convert-hf-to-gguf-bitnet.py"))
    print("| model | layers | file | size | bitnet.cpp packing + write | our convert | greedy 16 + logits vs reference |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        run(model, args.layers, args.out, ns)


if __name__ == "__main__":
    main()
