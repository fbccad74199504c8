"""Export a trained TinyBitNet to a Hugging Face directory in the microsoft/bitnet-b1.58-2B-4T packed layout.

What is written (microsoft/bitnet-b1.58-2B-4T's packed layout), the same layout engine/synth/writers.write_hf_dir makes:
- config.json: BitNetForCausalLM, relu2, tied embeddings, quantization_config
  {quant_method bitnet, linear_class autobitlinear, quantization_mode offline};
- model.safetensors: per BitLinear a uint8 [out/4, in] tensor packed along the output dim in quarters
  (row i*P + p in bits 2i..2i+1 of packed row p, codes 0/1/2 = -1/0/+1) and `weight_scale` bf16 [1]
  (the multiplying scale mean|W|); embeddings and norms bf16 (the model was rounded to bf16 before export,
  so these are exact);
- tokenizer.json, tokenizer_config.json (with the chat template), generation_config.json.

Needs torch (the caller has a torch model) and safetensors.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from bitnet_cpu.models.bitnet_torch import BitLinear, TinyBitNet, TinyConfig, weight_ternary


def pack_quarters(w_t: np.ndarray) -> np.ndarray:
    """int [out, in] in {-1,0,1} -> uint8 [out/4, in]: W_t[i*P + p, c] = ((packed[p, c] >> 2i) & 3) - 1."""
    out, _ = w_t.shape
    if out % 4:
        raise ValueError(f"output dim {out} is not a multiple of 4")
    codes = (w_t + 1).astype(np.uint8).reshape(4, out // 4, -1)
    return (codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6)).astype(np.uint8)


def unpack_quarters(packed: np.ndarray) -> np.ndarray:
    return np.concatenate([((packed >> (2 * i)) & 3).astype(np.int8) - 1 for i in range(4)], axis=0)


def state_tensors(model: TinyBitNet) -> dict[str, torch.Tensor]:
    """HF name -> tensor as stored (uint8 packed ternary, bf16 scales, embeddings and norms)."""
    out: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, BitLinear):
            wt, scale = weight_ternary(mod.weight.detach().float())
            out[f"model.{name}.weight"] = torch.from_numpy(pack_quarters(wt.to(torch.int8).numpy()))
            out[f"model.{name}.weight_scale"] = scale.reshape(1).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "_proj." not in name:   # embeddings and norms
            out[f"model.{name}"] = p.detach().to(torch.bfloat16).contiguous()
    return out


def config_from_hf_dir(src_dir: str) -> TinyConfig:
    """The TinyConfig of an exported directory (inverse of hf_config)."""
    with open(os.path.join(src_dir, "config.json")) as f:
        c = json.load(f)
    return TinyConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                      intermediate_size=c["intermediate_size"], n_layers=c["num_hidden_layers"],
                      n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"],
                      max_position_embeddings=c["max_position_embeddings"], rope_theta=c["rope_theta"],
                      rms_norm_eps=c["rms_norm_eps"])


@torch.no_grad()
def init_from_export(model: TinyBitNet, src_dir: str) -> TinyBitNet:
    """Load an exported directory back into `model` as trainable latent weights (the inverse of state_tensors).

    The export keeps only W_t in {-1,0,1} and scale per BitLinear, so the latent weight becomes
    W_t * scale / f with f = mean|W_t| (the fraction of non-zeros): then mean|W| == scale and
    round(W / scale) == W_t, i.e. the model computes exactly what was exported (the test of
    `state_tensors(model) == the file` holds). Embeddings and norms are bf16 in the file, f32 here."""
    sd = load_file(os.path.join(src_dir, "model.safetensors"))
    for name, mod in model.named_modules():
        if isinstance(mod, BitLinear):
            wt = torch.from_numpy(unpack_quarters(sd[f"model.{name}.weight"].numpy())).float()
            scale = sd[f"model.{name}.weight_scale"].float().reshape(())
            mod.weight.copy_(wt * (scale / wt.abs().mean().clamp(min=1e-6)))
    for name, p in model.named_parameters():
        if "_proj." not in name:
            p.copy_(sd[f"model.{name}"].float())
    return relatent_from_ternary(model)


@torch.no_grad()
def relatent_from_ternary(model: TinyBitNet) -> TinyBitNet:
    """Replace every BitLinear's latent weight by W_t * scale / mean|W_t|, what its export determines.

    mean|W| is then the stored scale again and round(W / scale) == W_t, so the model computes what it
    computed before (embeddings and norms must already be bf16-rounded). Used to start training from an
    export: the latent weights a trainer had are not in the export."""
    for mod in model.modules():
        if isinstance(mod, BitLinear):
            wt, scale = weight_ternary(mod.weight.float())
            mod.weight.copy_(wt * (scale / wt.abs().mean().clamp(min=1e-6)))
    return model


def hf_config(model: TinyBitNet, bos: int, eos: int, eot: int) -> dict:
    c = model.cfg
    return {
        "architectures": ["BitNetForCausalLM"], "model_type": "bitnet", "hidden_act": "relu2",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": True,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos, "eos_token_id": [eos, eot], "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                "quantization_mode": "offline"},
    }


def export_hf_dir(model: TinyBitNet, tok, out_dir: str, *, chat_template: str) -> str:
    """Write `model` (already rounded with round_to_export_precision) and tokenizer `tok` to out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    bos, eos, eot = (tok.token_to_id(s) for s in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    save_file(state_tensors(model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(model, bos, eos, eot), f, indent=1)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
                   "chat_template": chat_template, "model_max_length": model.cfg.max_position_embeddings,
                   "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False},
                  f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": [eos, eot], "do_sample": False}, f, indent=1)
    return out_dir
