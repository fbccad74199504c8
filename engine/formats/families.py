"""The ternary model families the engine runs, how a source file is recognized as one, and what the runtime
does with it (for `bitnet inspect`, docs/models.md and error messages).

The runtime never branches on the family: one ModelConfig (activation, sub_norms, tied head, head_dim, RoPE
theta and LongRoPE factors, eps) drives engine/runtime/model.py; constant scalings (MiniCPM) are folded into the
weights at conversion (engine/formats/sources.py). The family name is informational, kept in the store's meta ("family").

    FAMILIES: {key: Family}                       key as stored in meta["family"]
    hf_family(cfg: dict, names: set[str]) -> key  best guess from config.json and tensor names
    gguf_family(arch, vocab, head_dim, hidden_act, tokenizer) -> key
    runtime_summary(config) -> str                 one line: what the forward pass does for this model
    refuse_unsupported_hf(path, cfg)               UnsupportedError for known non-ternary / unsupported archs
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedError


@dataclass(frozen=True)
class Family:
    label: str      # human name
    files: str      # what a user downloads (docs/models.md)


FAMILIES = {
    "bitnet-b1.58": Family("BitNet b1.58 2B-4T (microsoft)",
                           "HF dir (`bitnet-b1.58-2B-4T` packed, `-bf16` masters) or `ggml-model-i2_s.gguf`"),
    "1bitllm": Family("1bitLLM bitnet_b1_58 large / 3B",
                      "HF dir: config.json, model.safetensors (fp16 latent weights), tokenizer.model"),
    "falcon3-1.58bit": Family("Falcon3-{1,3,7,10}B(-Instruct)-1.58bit (tiiuae)",
                              "HF dir: config.json, model*.safetensors (packed), tokenizer.json, tokenizer_config.json;"
                              " or a llama.cpp TQ1_0/TQ2_0 / bitnet.cpp I2_S GGUF"),
    "llama3-1.58": Family("Llama3-8B-1.58-100B-tokens (HF1BitLLM)",
                          "HF dir: config.json, model*.safetensors (packed), tokenizer.json, tokenizer_config.json,"
                          " generation_config.json"),
    "falcon-e": Family("Falcon-E-{1,3}B (Base / Instruct, tiiuae)",
                       "HF dir (main: packed; `bfloat16` revision: masters) or a bitnet.cpp I2_S GGUF"),
    "trilm": Family("TriLM (SpectraSuite, `*_Unpacked`)",
                    "HF dir: config.json, model*.safetensors (fp16 ternary x scale), tokenizer files"),
    "bitcpm4": Family("BitCPM4 / BitCPM-CANN (OpenBMB; MiniCPM architecture)",
                      "HF dir: config.json, model*.safetensors (bf16 ternary x scale: per tensor, row, or 128 weights"
                      " of a row), tokenizer files;"
                      " scale_emb, depth-scaled residuals and the dim_model_base logit scale folded in at conversion"),
    "bonsai": Family("Ternary Bonsai 1.7B / 4B / 8B (PrismML; Qwen3 architecture)",
                     "`Ternary-Bonsai-*-Q2_0.gguf` (or `-F16.gguf`), or the `-unpacked` HF dir (config.json,"
                     " model*.safetensors, tokenizer.json, tokenizer_config.json)"),
    "llama-ternary": Family("other Llama-architecture ternary model",
                            "HF dir with quant_method bitnet, fake-quantized ternary weights, or a `llama` GGUF"
                            " with TQ1_0 / TQ2_0 / I2_S tensors"),
}


def hf_family(cfg: dict, names: set, ternary_floats: bool = False, path: str = "") -> str:
    """Best guess (informational): the architecture first, then the model's name (config `_name_or_path` or
    the directory name), then its shape (Falcon3: vocab 131072 + head_dim 256; Llama-3: vocab 128256)."""
    archs = set(cfg.get("architectures") or [])
    if "Qwen3ForCausalLM" in archs or cfg.get("model_type") == "qwen3":
        return "bonsai"
    if "MiniCPMForCausalLM" in archs or cfg.get("model_type") == "minicpm":
        return "bitcpm4"
    if "BitNetForCausalLM" in archs or cfg.get("model_type") == "bitnet":
        return "bitnet-b1.58"
    if "BitnetForCausalLM" in archs:
        return "1bitllm"
    where = (str(cfg.get("_name_or_path", "")) + " " + path.rstrip("/").rsplit("/", 1)[-1]).lower()
    for key, pats in (("falcon-e", ("falcon-e", "falcon_e")), ("falcon3-1.58bit", ("falcon3",)),
                      ("trilm", ("trilm",)), ("llama3-1.58", ("llama3-8b-1.58", "hf1bitllm"))):
        if any(p in where for p in pats):
            return key
    q = cfg.get("quantization_config") or {}
    if isinstance(q, dict) and q.get("quant_method") == "bitnet":
        if cfg.get("vocab_size") == 131072 and cfg.get("head_dim") == 256:
            return "falcon3-1.58bit"
        if cfg.get("vocab_size") == 128256:
            return "llama3-1.58"
        return "llama-ternary"
    if ternary_floats and cfg.get("torch_dtype") == "float16":
        return "trilm"
    return "llama-ternary"


def gguf_family(arch: str, vocab: int, head_dim: int, hidden_act: str = "", tokenizer: str | None = None) -> str:
    """llama.cpp's `bitnet` architecture holds both BitNet families: 2B-4T's relu^2 (LLaMA-3 byte-level BPE vocab)
    and 1bitLLM's SiLU (SentencePiece vocab); the size of the vocabulary decides only what those leave open."""
    if arch == "qwen3":
        return "bonsai"
    if arch in ("bitnet-b1.58", "bitnet-25"):
        return "bitnet-b1.58"
    if arch == "bitnet":
        if hidden_act == "relu2":
            return "bitnet-b1.58"
        if hidden_act == "silu" and tokenizer == "llama":
            return "1bitllm"
        return "bitnet-b1.58" if vocab >= 100000 else "1bitllm"
    if vocab == 131072 and head_dim == 256:
        return "falcon3-1.58bit"
    if vocab == 128256:
        return "llama3-1.58"
    return "llama-ternary"


def family_label(key: str) -> str:
    f = FAMILIES.get(key)
    return f.label if f else (key or "unknown")


def runtime_summary(c) -> str:
    act = {"relu2": "relu(gate)^2 * up", "silu": "silu(gate) * up"}[c.hidden_act]
    norms = ("RMSNorm sub-norms before o_proj and down_proj" if c.sub_norms
             else "no sub-norms (activations quantized straight after attention / the MLP product)")
    head = "LM head tied to the embedding" if c.tie_word_embeddings else "untied LM head"
    rope = f"half-split RoPE theta {c.rope_theta:.10g}"
    if c.rope_factors:
        rope += (f" with LongRoPE ({len(c.rope_factors)} per-frequency factors {min(c.rope_factors):.4g}.."
                 f"{max(c.rope_factors):.4g}, cos/sin x{c.rope_attn_factor:.6g})")
    qk = "; RMSNorm of each q and k head before RoPE" if c.qk_norm else ""
    quant = (f"ternary weights with one f16 scale per {c.weight_groups} weights of a row, int8 activations per"
             f" group of {c.weight_groups}" if c.weight_groups else "ternary weights with per-row scales, int8"
             " per-token activations")
    return (f"runtime: {act}; {norms}; {head}; {c.n_heads} query / {c.n_kv_heads} kv heads of {c.head_dim}{qk};"
            f" {rope}; RMSNorm eps {c.rms_norm_eps:g}; {quant}")


# Architectures people will try that are ternary in name only or need math this engine does not have.
# (model_type / architecture prefix, checked in this order: "minicpm3" before the MiniCPM family itself)
_KNOWN_UNSUPPORTED = {
    "minicpm3": "MiniCPM3 (multi-head latent attention, MLA)",
    "minicpmv": "MiniCPM-V (vision-language)",
    "minicpmo": "MiniCPM-o (omni-modal)",
    "qwen3_moe": "Qwen3-MoE (mixture of experts)",
    "qwen3_next": "Qwen3-Next (hybrid linear attention)",
    "qwen3_5": "Qwen3.5 (hybrid linear attention)",
    "qwen3_vl": "Qwen3-VL (vision-language)",
}
_HINT = ("supported: BitNet b1.58, 1bitLLM, Llama-architecture ternary models (Falcon3-1.58bit, Llama3-8B-1.58,"
         " Falcon-E, TriLM), BitCPM4 (MiniCPM) and Ternary Bonsai (Qwen3); see docs/models.md")


def is_minicpm(cfg: dict) -> bool:
    archs = cfg.get("architectures") or []
    return "MiniCPMForCausalLM" in archs or str(cfg.get("model_type", "")).lower() == "minicpm"


def refuse_unsupported_hf(path: str, cfg: dict):
    mt = str(cfg.get("model_type", "")).lower()
    archs = cfg.get("architectures") or []
    for key, why in _KNOWN_UNSUPPORTED.items():
        if mt.startswith(key) or any(str(a).lower().startswith(key) for a in archs):
            raise UnsupportedError(f"{path}: unsupported model architecture {why}", hint=_HINT)
    if is_minicpm(cfg):  # dense MiniCPM (1/2/4, BitCPM4) only
        for key, why in (("num_experts", "mixture of experts"), ("q_lora_rank", "multi-head latent attention"),
                         ("kv_lora_rank", "multi-head latent attention"),
                         ("sparse_config", "InfLLM v2 sparse attention")):
            v = cfg.get(key)
            if v not in (None, 0, False, {}):
                raise UnsupportedError(f"{path}: unsupported MiniCPM variant: {why} ({key} = {str(v)[:60]})",
                                       hint="dense MiniCPM / BitCPM4 models only")
