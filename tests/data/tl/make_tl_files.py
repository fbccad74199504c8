"""Make tests/data/tl/*.gguf.xz with bitnet.cpp's own converter code (run once; CI only reads the results).

    BITNET_SRC=/tmp/bnconv PYTHONPATH=<dir holding bitnet_cpu> python tests/data/tl/make_tl_files.py

BITNET_SRC is a work tree made from microsoft/BitNet at its 2024-11 release commit 7c57a5a plus the gguf-py of its
llama.cpp fork (Eddie-Wang1120/llama.cpp, branch merge-dev, 406a5036):

    git --git-dir=<BitNet mirror> archive 7c57a5a utils preset_kernels include setup_env.py | tar x -C /tmp/bnconv
    git --git-dir=<fork mirror> archive merge-dev gguf-py | tar x -C /tmp/bnconv

What runs unchanged: bitnet.cpp's codegen scripts (utils/codegen_tl1.py / codegen_tl2.py with --model/--BM/--BK/
--bm, which write include/kernel_config.ini), or a preset's kernel_config_tl*.ini copied over it, then the
converter's transform_to_tl1 / transform_to_tl2 (and HEAD's quantize_to_i2_s, cut from the 2026 converter
utils/convert-hf-to-gguf-bitnet.py at 16da220: the same 128-weight-block layout the C quantize_i2_s of both the
2024-11 and the 2026 x86 builds writes) and the fork's GGUFWriter (which hides `<name>_scale` in a tail).
What is reproduced here, because the converter needs torch (not installable on the machine that made these
files): BitnetModel.write_tensors' loop (7c57a5a, lines 980-1080): weight_quant (s = 1/max(mean|W|, 1e-5),
round(W*s).clamp(-1, 1)/s, in f32: exact for these weights), the tensor names (map_tensor_name), F16 token_embd
(--quant-embd, as setup_env.py passes for TL), F32 norms, and Model.set_gguf_parameters' keys; the vocabulary
keys follow _set_vocab_sentencepiece.
"""
from __future__ import annotations

import lzma
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bitnet_conv  # noqa: E402
import tl_cases as C  # noqa: E402

SRC = os.environ.get("BITNET_SRC", "/tmp/bnconv")
HEAD_CONVERTER = os.environ.get("BITNET_HEAD_CONVERTER", "/tmp/conv_head.py")  # 16da220's converter

def _fork_gguf():
    """The fork's gguf-py (knows TL1 / TL2), kept out of sys.modules so the pip `gguf` stays importable."""
    saved = {k: v for k, v in sys.modules.items() if k == "gguf" or k.startswith("gguf.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, os.path.join(SRC, "gguf-py"))
    try:
        import gguf as fork
    finally:
        sys.path.pop(0)
        for k in [k for k in sys.modules if k == "gguf" or k.startswith("gguf.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return fork


gguf = _fork_gguf()

I2_S = 36
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def weight_quant(w: np.ndarray) -> np.ndarray:
    s = np.float32(1) / np.maximum(np.abs(w).mean(dtype=np.float32), np.float32(1e-5))
    return (np.clip(np.round(w * s), -1, 1) / s).astype(np.float32)


def codegen(kind: str, model: str, BM: str, BK: str, bm: str, preset_ini: str | None = None):
    """include/kernel_config.ini in SRC, written by bitnet.cpp's codegen script (or copied from a preset)."""
    if preset_ini:
        shutil.copyfile(os.path.join(SRC, preset_ini), os.path.join(SRC, "include", "kernel_config.ini"))
    else:
        subprocess.run([sys.executable, f"utils/codegen_{kind.lower()}.py", "--model", model, "--BM", BM, "--BK", BK,
                        "--bm", bm], cwd=SRC, check=True)
    os.chdir(SRC)   # the converter reads include/kernel_config.ini relative to the working directory


def pack(ns, kind: str, x: np.ndarray):
    if kind == "I2_S":
        return ns["quantize_to_i2_s"](x), None
    data, scale = ns["transform_to_tl1" if kind == "TL1" else "transform_to_tl2"](x)
    return data, scale


def add_linear(w, ns, kind, name, x):
    data, scale = pack(ns, kind, x)
    qtype = {"TL1": gguf.GGMLQuantizationType.TL1, "TL2": gguf.GGMLQuantizationType.TL2}.get(kind, I2_S)
    w.add_tensor(name, data, raw_shape=x.shape, raw_dtype=qtype)
    if scale is not None:
        w.add_tensor(name + "_scale", scale, raw_dtype=gguf.GGMLQuantizationType.F32)


def finish(w, path):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "rb") as f, lzma.open(os.path.join(HERE, os.path.basename(path) + ".xz"), "wb",
                                          preset=9 | lzma.PRESET_EXTREME) as g:
        shutil.copyfileobj(f, g)
    os.remove(path)


def make_mats(ns, stem, out_dir):
    kind, model, BM, BK, bm, how = C.MATS[stem]
    codegen(kind, model, BM, BK, bm, how if how.endswith(".ini") else None)
    w = gguf.GGUFWriter(os.path.join(out_dir, stem + ".gguf"), "bitnet")
    w.add_name(stem)
    t0 = time.time()
    for name, tern in C.mats_weights(stem):
        add_linear(w, ns, kind, name, weight_quant(tern.astype(np.float32) * np.float32(C.SCALE * C.MATS_D)))
    print(f"{stem}: packed in {time.time() - t0:.1f} s")
    finish(w, os.path.join(out_dir, stem + ".gguf"))


def make_model(ns, kind, out_dir, m=None, stem=None, model=C.LARGE, options=None, compress=True) -> float:
    """A BitnetForCausalLM checkpoint (an engine.synth model) as bitnet.cpp's converter writes it; returns the
    seconds its packing took. Default: the tests' one-layer large model, xz-compressed into tests/data/tl."""
    m = m or C.SparseModel()
    stem = stem or f"model_large_{kind.lower()}"
    if kind != "I2_S":
        codegen(kind, model, *(options or C.MODEL[kind]))
    w = gguf.GGUFWriter(os.path.join(out_dir, stem + ".gguf"), "bitnet")
    cfg = m.config
    w.add_name(stem)
    w.add_block_count(m.L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(m.D)
    w.add_feed_forward_length(m.I)
    w.add_head_count(m.H)
    w.add_head_count_kv(m.KV)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type({"TL1": 38, "TL2": 39, "I2_S": 40}[kind])
    w.add_vocab_size(m.V)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(1.0)
    tok = m.tokenizer_info()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tok["tokens"])
    w.add_token_scores(tok["scores"])
    w.add_token_types(tok["types"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_tensor("token_embd.weight", m.embed().astype(np.float16))
    t0 = time.time()
    for i in range(m.L):
        norms = m.norm_names(i)
        w.add_tensor(f"blk.{i}.attn_norm.weight", m.norm(norms["attn_norm"]))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", m.norm(norms["ffn_norm"]))
        w.add_tensor(f"blk.{i}.attn_sub_norm.weight", m.norm(norms["attn_sub_norm"]))
        w.add_tensor(f"blk.{i}.ffn_sub_norm.weight", m.norm(norms["ffn_sub_norm"]))
        for prefix, _, _ in m.linears():
            if not prefix.startswith(f"model.layers.{i}."):
                continue
            short = HF_TO_GGUF[prefix.split(f"model.layers.{i}.")[1]]
            add_linear(w, ns, kind, f"blk.{i}.{short}.weight", weight_quant(m.master(prefix)))
    w.add_tensor("output_norm.weight", m.norm("model.norm.weight"))
    took = time.time() - t0
    print(f"{stem}: converted in {took:.1f} s")
    if compress:
        finish(w, os.path.join(out_dir, stem + ".gguf"))
    else:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return took


def make_llama_model(ns, kind, out_dir, m, stem, model, options) -> float:
    """A LlamaForCausalLM ternary checkpoint (Llama3-8B-1.58 shape; an engine.synth "llama"-style model) as bitnet.cpp's
    converter writes it (7c57a5a, LlamaModel: q/k rows permuted by LlamaModel.permute, no weight_quant: the f32
    weights W_t * scale go to transform_to_tl* as they are; lm_head F16, norms F32, token_embd F16), with the keys
    and tokenizer of llama.cpp's `llama` files (engine.synth's lists, as its TQ2_0 writer writes them)."""
    from bitnet_cpu.engine.synth.writers import _gguf_ternary, _hparams, _tokenizer_kv

    codegen(kind, model, *options)
    w = gguf.GGUFWriter(os.path.join(out_dir, stem + ".gguf"), "llama")
    w.add_name(stem)
    w.add_file_type({"TL1": 38, "TL2": 39}[kind])
    add = {"u32": w.add_uint32, "f32": w.add_float32, "str": w.add_string, "bool": w.add_bool}
    for key, typ, val in _hparams(m, "llama", None) + _tokenizer_kv(m, "llama-bpe", m.chat_template):
        if typ.startswith("arr_"):
            w.add_array(key, list(val))
        else:
            add[typ](key, val)
    w.add_tensor("token_embd.weight", m.embed().astype(np.float16))
    t0 = time.time()
    for i in range(m.L):
        norms = m.norm_names(i)
        w.add_tensor(f"blk.{i}.attn_norm.weight", m.norm(norms["attn_norm"]))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", m.norm(norms["ffn_norm"]))
        for prefix, _, _ in m.linears():
            if prefix.startswith(f"model.layers.{i}."):
                short = HF_TO_GGUF[prefix.split(f"model.layers.{i}.")[1]]
                x = _gguf_ternary(m, prefix, "llama").astype(np.float32) * np.float32(m.weight_scale(prefix))
                add_linear(w, ns, kind, f"blk.{i}.{short}.weight", x)
    w.add_tensor("output_norm.weight", m.norm("model.norm.weight"))
    w.add_tensor("output.weight", m.lm_head().astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return time.time() - t0


def main():
    ns = bitnet_conv.load(os.path.join(SRC, "utils", "convert-hf-to-gguf-bitnet.py"))
    ns["quantize_to_i2_s"] = bitnet_conv.load(HEAD_CONVERTER)["quantize_to_i2_s"]
    out_dir = os.path.join(SRC, "out")
    os.makedirs(out_dir, exist_ok=True)
    only = sys.argv[1:]
    for kind in ("TL1", "TL2", "I2_S"):
        if not only or f"model_large_{kind.lower()}" in only:
            make_model(ns, kind, out_dir)
    for stem in C.MATS:
        if not only or stem in only:
            make_mats(ns, stem, out_dir)
    for kind in ("TL1", "TL2"):
        stem = f"model_llama3_{kind.lower()}"
        if not only or stem in only:
            make_llama_model(ns, kind, out_dir, C.SparseLlama(), stem, "Llama3-8B-1.58-100B-tokens",
                             C.LLAMA_MODEL[kind])
            path = os.path.join(out_dir, stem + ".gguf")
            with open(path, "rb") as f, lzma.open(os.path.join(HERE, stem + ".gguf.xz"), "wb",
                                                  preset=9 | lzma.PRESET_EXTREME) as g:
                shutil.copyfileobj(f, g)
            os.remove(path)


if __name__ == "__main__":
    main()
