"""What tests/data/tl holds, shared by make_tl_files.py (which writes it) and tests/test_tl_layouts.py (which checks
it): sparse synthetic ternary weights (so the files compress to a few hundred KB at the real matrix shapes) and
the tilings each file was converted with.

Weights: every run of D consecutive weights (row-major) holds exactly one nonzero, at a random place with a
random sign, so every tile of every tiling holds some, and mean|W| = alpha / D exactly (the converter's
weight_quant then maps W to sign(W) * alpha / D with no rounding, and the scale it stores is alpha / D: a power of
two, exact in f16, so the TQ2_0 file of the same weights has the same scale).
"""
from __future__ import annotations

import zlib

import numpy as np

from bitnet_cpu.engine.synth import SynthModel

MODEL_D = 256          # one nonzero per 256 weights in the one-layer model
MATS_D = 4096          # and per 4096 in the matrices-alone files
SCALE = 2.0 ** -4      # the stored (effective) scale of every matrix


def sparse_ternary(seed_name: str, M: int, K: int, D: int) -> np.ndarray:
    n = M * K
    rng = np.random.default_rng([7, zlib.crc32(seed_name.encode())])
    w = np.zeros(n, np.int8)
    pos = np.arange(0, n, D) + rng.integers(0, D, n // D)
    w[pos] = np.where(rng.integers(0, 2, n // D) == 1, 1, -1)
    return w.reshape(M, K)


class SparseModel(SynthModel):
    """A 1bitLLM-style (SiLU, inner_attn_ln / ffn_layernorm) synthetic model of the bitnet_b1_58-large width with
    sparse ternary weights and low-entropy embeddings; tied embeddings (bitnet.cpp's 2024-11 BitnetModel also sends
    lm_head through the TL packing, which has no tiling for a vocab-sized matrix)."""

    def __init__(self):
        super().__init__({"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 1,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 512,
                          "max_position_embeddings": 2048, "tie_word_embeddings": True}, seed=5, style="1bitllm")

    def ternary(self, prefix):
        out, inp = self._shape(prefix)
        return sparse_ternary(prefix, out, inp, MODEL_D)

    def weight_scale(self, prefix):
        return SCALE

    def master(self, prefix):
        """The f32 checkpoint weight: sign * alpha, alpha = SCALE * D (so mean|W| = SCALE)."""
        return self.ternary(prefix).astype(np.float32) * np.float32(SCALE * MODEL_D)

    def embed(self, rows=None):
        e = np.random.default_rng([5, 99]).integers(-1, 2, (self.V, self.D)).astype(np.float32) * np.float32(2 ** -3)
        return e if rows is None else e[rows]

    def lm_head(self):
        """engine.synth's TQ2_0 writer always writes output.weight for this style: the tied embedding's values."""
        return self.embed()


class SparseLlama(SynthModel):
    """One layer of the Llama3-8B-1.58 shape (engine.synth's "llama" style: SiLU, no sub-norms, untied head),
    converted by bitnet.cpp's LlamaModel path; weights sparse as above (one nonzero per MATS_D), scale SCALE;
    embedding and head sparse too (and equal, so the compressed file holds them once)."""

    def __init__(self):
        super().__init__({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 1,
                          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 512,
                          "max_position_embeddings": 2048, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
                         seed=6, style="llama")

    def ternary(self, prefix):
        out, inp = self._shape(prefix)
        return sparse_ternary("llama/" + prefix, out, inp, MATS_D)

    def weight_scale(self, prefix):
        return SCALE

    def embed(self, rows=None):
        e = sparse_ternary("llama/embed", self.V, self.D, 16).astype(np.float32) * np.float32(2 ** -2)
        return e if rows is None else e[rows]

    def lm_head(self):
        return self.embed()


LARGE = "bitnet_b1_58-large"
SHAPES = {  # model -> [(tensor name, M, K)] as codegen_tl*.py's ModelShapeDict orders them
    LARGE: [("blk.0.ffn_down.weight", 1536, 4096), ("blk.0.attn_q.weight", 1536, 1536),
            ("blk.0.ffn_up.weight", 4096, 1536)],
    "bitnet_b1_58-3B": [("blk.0.ffn_down.weight", 3200, 8640), ("blk.0.attn_q.weight", 3200, 3200),
                        ("blk.0.ffn_up.weight", 8640, 3200)],
    "Llama3-8B-1.58-100B-tokens": [("blk.0.ffn_up.weight", 14336, 4096), ("blk.0.ffn_down.weight", 4096, 14336),
                                   ("blk.0.attn_k.weight", 1024, 4096), ("blk.0.attn_q.weight", 4096, 4096)],
}
# matrices-alone files: file stem -> (kind, model, codegen --BM, --BK, --bm, how the tiling was chosen)
MATS = {
    "mats_3b_tl1": ("TL1", "bitnet_b1_58-3B", "160,320,320", "64,128,64", "32,64,32", "setup_env.py"),
    "mats_3b_tl2": ("TL2", "bitnet_b1_58-3B", "160,320,320", "96,96,96", "32,32,32", "setup_env.py"),
    "mats_llama3_tl1": ("TL1", "Llama3-8B-1.58-100B-tokens", "256,128,256,128", "128,64,128,64", "32,64,32,64",
                        "setup_env.py"),
    "mats_llama3_tl1_ini": ("TL1", "Llama3-8B-1.58-100B-tokens", "256,256,128,128", "128,128,64,64",
                            "64,32,64,32", "preset_kernels/Llama3-8B-1.58-100B-tokens/kernel_config_tl1.ini"),
    "mats_llama3_tl2": ("TL2", "Llama3-8B-1.58-100B-tokens", "256,128,256,128", "96,96,96,96", "32,32,32,32",
                        "setup_env.py"),
    # one more tiling each, written with the codegen scripts' options (not a preset)
    "mats_3b_tl2_extra": ("TL2", "bitnet_b1_58-3B", "320,160,160", "96,192,96", "32,32,32", "codegen options"),
    "mats_large_tl1_extra": ("TL1", LARGE, "128,256,128", "64,128,64", "64,32,64", "codegen options"),
}
# the one-layer Llama3-8B-1.58 model: kind -> codegen options (setup_env.py's)
LLAMA_MODEL = {"TL1": ("256,128,256,128", "128,64,128,64", "32,64,32,64"),
               "TL2": ("256,128,256,128", "96,96,96,96", "32,32,32,32")}
# the one-layer model (large shape): kind -> codegen options (setup_env.py's for bitnet_b1_58-large)
MODEL = {"TL1": ("256,128,256", "128,64,128", "32,64,32"), "TL2": ("256,128,256", "96,192,96", "32,32,32")}


def mats_weights(stem: str):
    """[(tensor name, W int8 [M, K])] of a matrices-alone file."""
    _, model, *_ = MATS[stem]
    return [(name, sparse_ternary(f"{model}/{name}", M, K, MATS_D)) for name, M, K in SHAPES[model]]


def config_rows(model: str, BM: str, BK: str, bm: str):
    """kernel_config.ini rows (M, K, BM, BK, bm), as codegen_tl*.py writes them for these options."""
    return [(M, K, int(a), int(b), int(c)) for (_, M, K), a, b, c in
            zip(SHAPES[model], BM.split(","), BK.split(","), bm.split(","))]
