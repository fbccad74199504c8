"""File writers for engine.synth models (see the API in engine/synth.py): HF directories (safetensors, our
own streaming writer so bf16 needs no torch), llama.cpp `bitnet` GGUF (TQ1_0/TQ2_0 through gguf.GGUFWriter),
bitnet.cpp GGUF (I2_S through our own GGUF writer). Every writer streams: one tensor in memory at a time.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

# What the official bitnet-b1.58-2B-4T GGUF embeds (wrong; the converter replaces it).
BROKEN_GGUF_TEMPLATE = (
    "{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ 'Human: ' + message['content'] + '\\n\\nBITNETAssistant: ' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}"
)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 values that are bf16-exact -> uint16 bf16 bit patterns."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


# ---------------------------------------------------------------------------------------------------------
# packers
def hf_pack(w_t: np.ndarray) -> np.ndarray:
    """int8 [out, in] ternary -> uint8 [out/4, in], packed along the output dim in quarters (transformers' BitNet packed layout)."""
    out, inp = w_t.shape
    p = out // 4
    codes = (w_t + 1).astype(np.uint8).reshape(4, p, inp)
    return codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6)


def i2s_pack(w_t: np.ndarray, scale: float) -> bytes:
    """bitnet.cpp I2_S bytes: 128-value blocks of 32 bytes (bits 7-6: +0, 5-4: +32, 3-2: +64, 1-0: +96),
    then the f32 scale and padding to a 32-byte tail."""
    flat = (np.asarray(w_t).reshape(-1) + 1).astype(np.uint8)
    if flat.size % 128:
        raise ValueError(f"I2_S needs a multiple of 128 elements, got {flat.size}")
    c = flat.reshape(-1, 4, 32)
    packed = (c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]
    return packed.tobytes() + struct.pack("<f", scale) + b"\0" * 28


def tq2_pack(w_t: np.ndarray, scale: float) -> np.ndarray:
    """TQ2_0 blocks (66 bytes: qs[64] then f16 d) of a ternary [out, in] matrix with d = scale; the same bytes
    gguf's quantizer makes from W_t * scale (tested)."""
    codes = (np.asarray(w_t) + 1).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, l, m]
    qs = codes[:, :, 0] | (codes[:, :, 1] << 2) | (codes[:, :, 2] << 4) | (codes[:, :, 3] << 6)
    d = np.full((qs.shape[0], 1), scale, np.float16).view(np.uint8)
    return np.concatenate([qs.reshape(-1, 64), d], axis=1).reshape(w_t.shape[0], -1)


def embed_chunked(m, convert: Callable[[np.ndarray], np.ndarray], rows: int = 8192) -> np.ndarray:
    """The embedding converted chunk by chunk (never the whole f32 matrix in memory)."""
    parts = [np.ascontiguousarray(convert(m.embed(slice(s, s + rows)))) for s in range(0, m.V, rows)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ---------------------------------------------------------------------------------------------------------
# safetensors (streaming)
def write_safetensors(path: str, specs: list[tuple[str, str, list[int], Callable[[], np.ndarray]]]):
    """specs: (name, dtype tag "BF16"/"F16"/"F32"/"U8", shape, producer returning the raw array)."""
    sizes = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1}
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dt, shape, _ in specs:
        n = int(np.prod(shape, dtype=np.int64)) * sizes[dt]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dt, shape, make in specs:
            arr = np.ascontiguousarray(make())
            want = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            assert arr.nbytes == want, (name, arr.nbytes, want)
            f.write(arr.tobytes())


def _float_tag(x: np.ndarray, tag: str) -> np.ndarray:

    if tag == "BF16":
        return bf16_bits(x)
    return x.astype(np.float16 if tag == "F16" else np.float32)


def write_hf_dir(m, out_dir: str, *, form: str = "packed", linear_class: str = "autobitlinear", shards: int = 1,
                 embed_dtype: str = "bf16") -> str:
    if form not in ("packed", "online", "unpacked", "float"):
        raise ValueError("form must be 'packed', 'online', 'unpacked' or 'float'")
    if form in ("unpacked", "float") and m.style != "llama":
        raise ValueError(f"form {form!r} exists for the llama style only")
    if linear_class not in ("autobitlinear", "bitlinear"):
        raise ValueError("linear_class must be 'autobitlinear' or 'bitlinear'")
    os.makedirs(out_dir, exist_ok=True)
    onebit = m.style == "1bitllm"
    # TriLM's unpacked checkpoints are fp16 (ternary * scale); Falcon3 / Falcon-E / 2B-4T are bf16
    ftag = "F16" if onebit or form == "unpacked" else "BF16"
    if form == "unpacked":
        embed_dtype = "f16"
    etag = {"bf16": "BF16", "f32": "F32", "f16": "F16"}[embed_dtype]
    specs: list = []

    def embed_maker():
        return embed_chunked(m, lambda e: _float_tag(e, etag))

    specs.append(("model.embed_tokens.weight", etag, [m.V, m.D], embed_maker))
    for i in range(m.L):
        for hf in m.norm_names(i).values():
            specs.append((hf, ftag, [m.norm(hf).size], lambda hf=hf: _float_tag(m.norm(hf), ftag)))
        for prefix, o, n in m.linears():
            if not prefix.startswith(f"model.layers.{i}."):
                continue
            if form in ("online", "float") or onebit:
                specs.append((prefix + ".weight", ftag, [o, n], lambda p=prefix: _float_tag(m.master(p), ftag)))
            elif form == "unpacked":  # TriLM: fake-quantized ternary * scale, no quantization_config
                specs.append((prefix + ".weight", ftag, [o, n], lambda p=prefix: _float_tag(
                    m.ternary(p).astype(np.float32) * np.float32(m.weight_scale(p)), ftag)))
            else:
                specs.append((prefix + ".weight", "U8", [o // 4, n], lambda p=prefix: hf_pack(m.ternary(p))))
                if linear_class == "bitlinear":
                    # this class divides by weight_scale: store the reciprocal (f32 so 1/x is exact enough;
                    # bf16 as Falcon3 does for the llama style)
                    st = "BF16" if m.style == "llama" else "F32"
                    specs.append((prefix + ".weight_scale", st, [1], lambda p=prefix, st=st: _float_tag(
                        np.array([1.0 / m.weight_scale(p)], np.float32), st)))
                else:
                    specs.append((prefix + ".weight_scale", "BF16", [1],
                                  lambda p=prefix: _float_tag(np.array([m.weight_scale(p)], np.float32), "BF16")))
    specs.append(("model.norm.weight", ftag, [m.D], lambda: _float_tag(m.norm("model.norm.weight"), ftag)))
    if onebit or not m.config.get("tie_word_embeddings", True):
        specs.append(("lm_head.weight", ftag, [m.V, m.D], lambda: _float_tag(m.lm_head(), ftag)))
    # shards: contiguous groups of tensors
    shards = max(1, min(shards, len(specs)))
    groups = [specs[k * len(specs) // shards:(k + 1) * len(specs) // shards] for k in range(shards)]
    if shards == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), specs)
    else:
        weight_map = {}
        for k, g in enumerate(groups):
            fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(os.path.join(out_dir, fn), g)
            weight_map.update({s[0]: fn for s in g})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    cfg = dict(m.config)
    tok = m.tokenizer_info()
    # llama style: the first stop id is tokenizer_config's eos_token, as in Falcon3 (chat templates render it)
    stops = [tok["eot"], tok["eos"]] if m.style == "llama" else [tok["eos"], tok["eot"]]
    cfg.update(bos_token_id=tok["bos"], eos_token_id=tok["eos"] if onebit else stops)
    if m.style == "llama" and form == "packed" and linear_class == "bitlinear":
        # Falcon3-1.58bit / Llama3-8B-1.58: no linear_class key (transformers' default: bitlinear, divides)
        cfg["quantization_config"] = {"modules_to_not_convert": ["lm_head"], "quant_method": "bitnet"}
    elif not onebit and form not in ("unpacked", "float"):
        cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": linear_class,
                                      "quantization_mode": "online" if form == "online" else "offline"}
        if m.style == "llama":
            cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    if form == "unpacked":
        cfg["torch_dtype"] = "float16"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if tok["kind"] == "llama":  # 1bitLLM: SentencePiece model only, no chat template
        with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
            f.write(tok["model"])
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                       "tokenizer_class": "LlamaTokenizer"}, f, indent=1)
        return out_dir
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok["json"])
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": m.chat_template,
                   "model_max_length": m.config["max_position_embeddings"],
                   "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True}, f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok["bos"], "eos_token_id": stops, "do_sample": False}, f)
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# GGUF
def _gguf_tensor_order(m) -> Iterator[tuple[str, str]]:
    """(gguf name, what) in llama.cpp order; what: 'embed' | 'norm:<hf>' | 'lin:<hf prefix>'."""
    yield "token_embd.weight", "embed"
    for i in range(m.L):
        nn = m.norm_names(i)
        yield f"blk.{i}.attn_norm.weight", "norm:" + nn["attn_norm"]
        for short in ("attn_q", "attn_k", "attn_v", "attn_output"):
            yield f"blk.{i}.{short}.weight", f"lin:model.layers.{i}.{HF_NAMES[short]}"
        if m.sub_norms:
            yield f"blk.{i}.attn_sub_norm.weight", "norm:" + nn["attn_sub_norm"]
        yield f"blk.{i}.ffn_norm.weight", "norm:" + nn["ffn_norm"]
        for short in ("ffn_gate", "ffn_up", "ffn_down"):
            yield f"blk.{i}.{short}.weight", f"lin:model.layers.{i}.{HF_NAMES[short]}"
        if m.sub_norms:
            yield f"blk.{i}.ffn_sub_norm.weight", "norm:" + nn["ffn_sub_norm"]
    yield "output_norm.weight", "norm:model.norm.weight"
    if m.style != "bitnet" or not m.config.get("tie_word_embeddings", True):
        yield "output.weight", "lm_head"


def _hparams(m, arch: str, hidden_activation: str | None) -> list[tuple[str, str, object]]:
    c = m.config
    kv = [(f"{arch}.vocab_size", "u32", m.V), (f"{arch}.context_length", "u32", c["max_position_embeddings"]),
          (f"{arch}.embedding_length", "u32", m.D), (f"{arch}.block_count", "u32", m.L),
          (f"{arch}.feed_forward_length", "u32", m.I), (f"{arch}.rope.dimension_count", "u32", m.head_dim),
          (f"{arch}.attention.head_count", "u32", m.H), (f"{arch}.attention.head_count_kv", "u32", m.KV),
          (f"{arch}.attention.layer_norm_rms_epsilon", "f32", c["rms_norm_eps"]),
          (f"{arch}.rope.freq_base", "f32", c["rope_theta"])]
    if hidden_activation:
        kv.append((f"{arch}.hidden_activation", "str", hidden_activation))
    if m.head_dim != m.D // m.H:  # what llama.cpp's converter writes for an explicit head_dim
        kv += [(f"{arch}.attention.key_length", "u32", m.head_dim), (f"{arch}.attention.value_length", "u32", m.head_dim)]
    return kv


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute of q_proj / k_proj rows (n_head: the kv heads for
    k): its `llama` graph applies RoPE to interleaved pairs, the HF weights are laid out for half-split RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_ternary(m, prefix: str, arch: str) -> np.ndarray:
    """The ternary matrix as a GGUF of `arch` stores it (q, k rows permuted for the llama arch)."""
    w = m.ternary(prefix)
    if arch == "llama" and prefix.endswith((".q_proj", ".k_proj")):
        w = llama_permute(w, m.H if prefix.endswith(".q_proj") else m.KV)
    return w


def _tokenizer_kv(m, pre: str | None, template: str) -> list[tuple[str, str, object]]:
    t = m.tokenizer_info()
    if t["kind"] == "llama":
        return [("tokenizer.ggml.model", "str", "llama"), ("tokenizer.ggml.tokens", "arr_str", t["tokens"]),
                ("tokenizer.ggml.scores", "arr_f32", t["scores"]), ("tokenizer.ggml.token_type", "arr_i32", t["types"]),
                ("tokenizer.ggml.bos_token_id", "u32", t["bos"]), ("tokenizer.ggml.eos_token_id", "u32", t["eos"]),
                ("tokenizer.ggml.unknown_token_id", "u32", 0), ("tokenizer.ggml.add_bos_token", "bool", True)]
    kv = [("tokenizer.ggml.model", "str", "gpt2")]
    if pre:
        kv.append(("tokenizer.ggml.pre", "str", pre))
    kv += [("tokenizer.ggml.tokens", "arr_str", t["tokens"]), ("tokenizer.ggml.token_type", "arr_i32", t["types"]),
           ("tokenizer.ggml.merges", "arr_str", t["merges"]), ("tokenizer.ggml.bos_token_id", "u32", t["bos"]),
           ("tokenizer.ggml.eos_token_id", "u32", t["eos"]), ("tokenizer.ggml.eot_token_id", "u32", t["eot"]),
           ("tokenizer.ggml.add_bos_token", "bool", True), ("tokenizer.chat_template", "str", template)]
    return kv


def write_gguf_tq(m, path: str, qtype: str = "TQ2_0", *, embed_type: str = "F16",
                  hidden_activation: str | None = "relu2", scale_tensors: bool = False, pre: str | None = "llama-bpe",
                  quantizer: str = "gguf", arch: str = "bitnet", gaussian: bool = False,
                  split_max_tensors: int = 0) -> str:
    """Linear weights in `qtype`: TQ1_0 / TQ2_0, or any type gguf's numpy quantizers write (F32, F16, BF16,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: the ternary values times the scale, as llama.cpp's converter stores them).
    gaussian=True writes the full-precision masters instead (a non-ternary model, which must be refused).
    split_max_tensors > 0: a split model (llama.cpp's gguf-split naming, PATH-stem-0000N-of-0000M.gguf); returns
    the first part's path."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    if qtype not in ("TQ1_0", "TQ2_0", "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") and \
            not callable(quantizer):
        raise ValueError(f"qtype {qtype}: not one gguf's numpy quantizers write (pass an encoder as quantizer)")
    if quantizer == "fast" and qtype != "TQ2_0":
        raise ValueError("quantizer='fast' exists for TQ2_0 only")
    for p, o, n in m.linears():
        if n % 256:
            raise ValueError(f"{p}: input dim {n} is not a multiple of 256 (TQ block size)")
    et = gguf.GGMLQuantizationType[embed_type]
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_name(f"synth-{arch}")
    act = hidden_activation if arch == "bitnet" else None  # llama: SiLU, no key
    for key, typ, val in _hparams(m, arch, act) + _tokenizer_kv(m, pre, m.chat_template):
        _gguf_writer_kv(w, key, typ, val)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_TQ2_0 if qtype == "TQ2_0" else gguf.LlamaFileType.MOSTLY_TQ1_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    plan: list[tuple[str, list[int], np.dtype, int, object, Callable[[], np.ndarray]]] = []
    for name, what in _gguf_tensor_order(m):
        if what == "embed":
            shape = [m.V, m.D]
            if et in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
                dt = np.float16 if et == gguf.GGMLQuantizationType.F16 else np.float32
                plan.append((name, shape, np.dtype(dt), m.V * m.D * np.dtype(dt).itemsize, None,
                             lambda dt=dt: embed_chunked(m, lambda e: e.astype(dt))))
            else:
                bs, ts = gguf.GGML_QUANT_SIZES[et]
                plan.append((name, [m.V, m.D // bs * ts], np.dtype(np.uint8), m.V * m.D // bs * ts, et,
                             lambda: embed_chunked(m, lambda e: gguf.quants.quantize(e, et))))
        elif what == "lm_head":
            plan.append((name, [m.V, m.D], np.dtype(np.float16), m.V * m.D * 2, None,
                         lambda: m.lm_head().astype(np.float16)))
        elif what.startswith("norm:"):
            hf = what[5:]
            n = m.norm(hf).size
            plan.append((name, [n], np.dtype(np.float32), n * 4, None, lambda hf=hf: m.norm(hf)))
        else:
            prefix = what[4:]
            o, n = m._shape(prefix)
            bs, ts = gguf.GGML_QUANT_SIZES[qt]

            def make(prefix=prefix):
                # older llama.cpp files: d = 1 in the blocks and the scale in a separate blk.N.*.scale tensor
                wt, s = _gguf_ternary(m, prefix, arch), (1.0 if scale_tensors else m.weight_scale(prefix))
                if quantizer == "fast":
                    return tq2_pack(wt, s)
                wf = m.master(prefix) if gaussian else wt.astype(np.float32) * np.float32(s)
                return quantizer(wf) if callable(quantizer) else gguf.quants.quantize(wf, qt)
            plan.append((name, [o, n // bs * ts], np.dtype(np.uint8), o * n // bs * ts, qt, make))
            if scale_tensors:
                plan.append((name[:-len(".weight")] + ".scale", [1], np.dtype(np.float32), 4, None,
                             lambda prefix=prefix: np.array([m.weight_scale(prefix)], np.float32)))
    for name, shape, dt, nbytes, raw, _ in plan:
        w.add_tensor_info(name, shape, dt, nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, dt, nbytes, raw, make in plan:
        arr = np.ascontiguousarray(make())
        if raw is not None:
            arr = arr.view(np.uint8)
        w.write_tensor_data(arr)
    w.close()
    return str(w.format_shard_names(Path(path))[0]) if split_max_tensors else path


def _gguf_writer_kv(w, key, typ, val):
    import gguf

    V = gguf.GGUFValueType
    if typ == "u32":
        w.add_uint32(key, int(val))
    elif typ == "f32":
        w.add_float32(key, float(val))
    elif typ == "str":
        w.add_string(key, val)
    elif typ == "bool":
        w.add_bool(key, bool(val))
    elif typ == "arr_str":
        w.add_key_value(key, list(val), V.ARRAY, sub_type=V.STRING)
    elif typ == "arr_i32":
        w.add_key_value(key, [int(x) for x in val], V.ARRAY, sub_type=V.INT32)
    elif typ == "arr_f32":
        w.add_key_value(key, [float(x) for x in val], V.ARRAY, sub_type=V.FLOAT32)
    else:
        raise ValueError(typ)


class RawGGUFWriter:
    """A minimal streaming GGUF v3 writer for tensor types gguf does not know (bitnet.cpp's I2_S = 36)."""

    _SCALAR = {"u8": (0, "<B"), "i8": (1, "<b"), "u16": (2, "<H"), "i16": (3, "<h"), "u32": (4, "<I"),
               "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<?"), "u64": (10, "<Q"), "i64": (11, "<q"),
               "f64": (12, "<d")}

    def __init__(self, path: str, alignment: int = 32):
        self.path, self.alignment = path, alignment
        self.kv: list[bytes] = []
        self.infos: list[tuple[str, list[int], int, int]] = []  # name, torch-order shape, type, nbytes

    @staticmethod
    def _str(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def add(self, key: str, typ: str, val):
        out = self._str(key)
        if typ == "str":
            out += struct.pack("<I", 8) + self._str(val)
        elif typ.startswith("arr_"):
            sub = typ[4:]
            if sub == "str":
                out += struct.pack("<IIQ", 9, 8, len(val)) + b"".join(self._str(v) for v in val)
            else:
                tid, fmt = self._SCALAR[sub]
                out += struct.pack("<IIQ", 9, tid, len(val)) + np.asarray(val, dtype=np.dtype(fmt)).tobytes()
        else:
            tid, fmt = self._SCALAR[typ]
            out += struct.pack("<I", tid) + struct.pack(fmt, val)
        self.kv.append(out)

    def add_tensor_info(self, name: str, shape: list[int], ggml_type: int, nbytes: int):
        self.infos.append((name, list(shape), ggml_type, nbytes))

    def write(self, producers: list[Callable[[], bytes | np.ndarray]]):
        """Write everything; producers[i]() returns the bytes of tensor i (called in order, one at a time)."""
        a = self.alignment
        with open(self.path, "wb") as f:
            f.write(b"GGUF" + struct.pack("<IQQ", 3, len(self.infos), len(self.kv)))
            for kv in self.kv:
                f.write(kv)
            off = 0
            for name, shape, t, nbytes in self.infos:
                f.write(self._str(name) + struct.pack("<I", len(shape)))
                f.write(struct.pack(f"<{len(shape)}Q", *reversed(shape)) + struct.pack("<IQ", t, off))
                off += -(-nbytes // a) * a
            f.write(b"\0" * (-f.tell() % a))
            for (name, shape, t, nbytes), make in zip(self.infos, producers):
                data = make()
                data = data.tobytes() if isinstance(data, np.ndarray) else data
                assert len(data) == nbytes, (name, len(data), nbytes)
                f.write(data + b"\0" * (-nbytes % a))


def write_gguf_i2s(m, path: str, *, arch: str = "bitnet-b1.58", pre: str | None = None,
                   broken_template: bool = True) -> str:

    w = RawGGUFWriter(path)
    w.add("general.architecture", "str", arch)
    w.add("general.name", "str", "synth-bitnet-i2s")
    w.add("general.file_type", "u32", 40)
    w.add("general.quantization_version", "u32", 2)
    for key, typ, val in _hparams(m, arch, None) + _tokenizer_kv(
            m, pre, BROKEN_GGUF_TEMPLATE if broken_template else m.chat_template):
        w.add(key, typ, val)
    makers = []
    for name, what in _gguf_tensor_order(m):
        if what == "embed":
            w.add_tensor_info(name, [m.V, m.D], 1, m.V * m.D * 2)
            makers.append(lambda: embed_chunked(m, lambda e: e.astype(np.float16)))
        elif what == "lm_head":
            w.add_tensor_info(name, [m.V, m.D], 1, m.V * m.D * 2)
            makers.append(lambda: m.lm_head().astype(np.float16))
        elif what.startswith("norm:"):
            hf = what[5:]
            w.add_tensor_info(name, [m.norm(hf).size], 0, m.norm(hf).size * 4)
            makers.append(lambda hf=hf: m.norm(hf).astype(np.float32))
        else:
            prefix = what[4:]
            o, n = m._shape(prefix)
            w.add_tensor_info(name, [o, n], 36, o * n // 4 + 32)
            makers.append(lambda prefix=prefix: i2s_pack(_gguf_ternary(m, prefix, arch), m.weight_scale(prefix)))
    w.write(makers)
    return path


# ---------------------------------------------------------------------------------------------------------
# Ternary Bonsai (Qwen3 architecture, one f16 scale per 128 weights of a row)
BONSAI_GROUP = 128
# Qwen3's template constructs (written here, not copied): a namespace scan of the reversed messages for the last
# real user query, string tests and methods, reasoning split out of earlier assistant turns, tool calls as JSON,
# and the no-thinking switch at the generation prompt
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(multi=true, last=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- set i = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi and m.role == 'user' and m.content is string and not (m.content.startswith('<tool_response>')"
    " and m.content.endswith('</tool_response>')) %}{%- set ns.multi = false %}{%- set ns.last = i %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- set c = m.content if m.content is string else '' %}"
    "{%- if m.role == 'user' or (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- else %}{%- set r = '' %}{%- endif %}"
    "{%- if loop.index0 > ns.last and r %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + c }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + c }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + ({'name': tc.name, 'arguments': tc.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def bonsai_weights(m, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """A SynthModel matrix in the Ternary Bonsai form: its ternary codes and one f16 scale per 128 weights of a
    row (the matrix's own scale times a per-group factor in 0.5..1.5)."""
    t = m.ternary(prefix)
    o, n = t.shape
    if n % BONSAI_GROUP:
        raise ValueError(f"{prefix}: input dim {n} is not a multiple of {BONSAI_GROUP}")
    f = m._rng(prefix + ".g").uniform(0.5, 1.5, (o, n // BONSAI_GROUP))
    return t, (f * m.weight_scale(prefix)).astype(np.float16)


def bonsai_dense(m, prefix: str) -> np.ndarray:
    """The f16 matrix the unpacked checkpoint holds: ternary x group scale (exact in f16)."""
    t, sc = bonsai_weights(m, prefix)
    return t.astype(np.float16) * np.repeat(sc, BONSAI_GROUP, axis=1)


def bonsai_ternarize(e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float rows -> (ternary, f16 scale per 128) as Ternary Bonsai's embedding and head are: per group, the weights
    above half the mean magnitude keep their sign, the scale is the mean magnitude of those (f16)."""
    e = np.asarray(e, np.float32)
    g = e.reshape(e.shape[0], -1, BONSAI_GROUP)
    a = np.abs(g)
    t = np.where(a > 0.5 * a.mean(axis=2, keepdims=True), np.sign(g), 0).astype(np.int8)
    sc = ((a * np.abs(t)).sum(axis=2) / np.maximum(np.abs(t).sum(axis=2), 1)).astype(np.float16)
    return t.reshape(e.shape), sc


def bonsai_rows(t: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """f16 rows of ternary x group scale (exact)."""
    return t.astype(np.float16) * np.repeat(sc, BONSAI_GROUP, axis=1)


def bonsai_embed(m) -> tuple[np.ndarray, np.ndarray]:
    return bonsai_ternarize(m.embed())


def bonsai_lm_head(m) -> tuple[np.ndarray, np.ndarray]:
    return bonsai_ternarize(m.lm_head())


def bonsai_qk_norm(m, name: str) -> np.ndarray:
    """q_norm / k_norm weights [head_dim], exact in f16 (the files store them so)."""
    w = 1.0 + 0.1 * m._rng(name).standard_normal(m.head_dim, dtype=np.float32)
    return w.astype(np.float16).astype(np.float32)


def write_bonsai_dir(m, out_dir: str) -> str:
    """A Ternary Bonsai `-unpacked` style HF directory (Qwen3ForCausalLM, f16 weights that are ternary x one scale
    per 128 weights, the embedding and an untied head included; q_norm / k_norm, tie_word_embeddings from
    m.config) for a SynthModel of the llama style."""
    os.makedirs(out_dir, exist_ok=True)
    tie = bool(m.config.get("tie_word_embeddings", True))
    specs: list = [("model.embed_tokens.weight", "F16", [m.V, m.D], lambda: bonsai_rows(*bonsai_embed(m)))]
    for i in range(m.L):
        p = f"model.layers.{i}"
        for hf in m.norm_names(i).values():
            specs.append((hf, "F16", [m.D], lambda hf=hf: m.norm(hf).astype(np.float16)))
        for short in ("q_norm", "k_norm"):
            nm = f"{p}.self_attn.{short}.weight"
            specs.append((nm, "F16", [m.head_dim], lambda nm=nm: bonsai_qk_norm(m, nm).astype(np.float16)))
        for prefix, o, n in m.linears():
            if prefix.startswith(p + "."):
                specs.append((prefix + ".weight", "F16", [o, n], lambda prefix=prefix: bonsai_dense(m, prefix)))
    specs.append(("model.norm.weight", "F16", [m.D], lambda: m.norm("model.norm.weight").astype(np.float16)))
    if not tie:
        specs.append(("lm_head.weight", "F16", [m.V, m.D], lambda: bonsai_rows(*bonsai_lm_head(m))))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), specs)
    tok = m.tokenizer_info()
    c = m.config
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": m.D,
           "intermediate_size": m.I, "num_hidden_layers": m.L, "num_attention_heads": m.H,
           "num_key_value_heads": m.KV, "head_dim": m.head_dim, "vocab_size": m.V,
           "max_position_embeddings": c["max_position_embeddings"], "rope_theta": float(c["rope_theta"]),
           "rms_norm_eps": float(c["rms_norm_eps"]), "hidden_act": "silu", "tie_word_embeddings": tie,
           "attention_bias": False, "use_sliding_window": False, "torch_dtype": "float16",
           "bos_token_id": tok["bos"], "eos_token_id": tok["eot"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok["json"])
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|eot_id|>", "chat_template": QWEN3_CHAT_TEMPLATE,
                   "model_max_length": c["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast"},
                  f, indent=1)
    return out_dir


def q2_0_pack(t: np.ndarray, sc: np.ndarray, block: int = 128) -> np.ndarray:
    """GGUF type-42 blocks of a ternary matrix [o, n] with f16 scales [o, n/128]: per block the f16 d, then
    block/4 bytes whose byte j/4, bits 2(j%4) hold t[j] + 1. block 128: PrismML's Q2_0 (34 bytes, Ternary
    Bonsai's files); 64: ggml's Q2_0 (18 bytes; each 128-group's scale written in both of its blocks)."""
    codes = (t.astype(np.int16) + 1).astype(np.uint8).reshape(-1, block // 4, 4)
    qs = codes[:, :, 0] | (codes[:, :, 1] << 2) | (codes[:, :, 2] << 4) | (codes[:, :, 3] << 6)
    d = np.repeat(sc.astype("<f2"), BONSAI_GROUP // block, axis=1).reshape(-1, 1)
    return np.ascontiguousarray(np.concatenate([np.ascontiguousarray(d).view(np.uint8), qs], axis=1)).reshape(-1)


def write_bonsai_gguf(m, path: str, *, linear_type: str = "Q2_0_G128", embed_f16: bool = False) -> str:
    """The `qwen3` GGUF of the same model: linear_type "Q2_0_G128" as Ternary-Bonsai-*-Q2_0.gguf holds it
    (PrismML's 128-weight blocks, type 42), "Q2_0" in ggml's own 64-weight blocks (same type id: what mainline
    llama.cpp reads), "F16" the -F16.gguf form. The embedding (and an untied head) in the same type, or F16 with
    embed_f16 (the same values). llama.cpp keeps Qwen's q/k rows in HF order (NEOX RoPE)."""
    if linear_type not in ("Q2_0_G128", "Q2_0", "F16"):
        raise ValueError(f"linear_type {linear_type!r}: expected Q2_0_G128, Q2_0 or F16")
    arch = "qwen3"
    w = RawGGUFWriter(path)
    w.add("general.architecture", "str", arch)
    w.add("general.name", "str", "synth-ternary-bonsai")
    w.add("general.quantization_version", "u32", 2)
    kv = _hparams(m, arch, None) + [(f"{arch}.attention.key_length", "u32", m.head_dim),
                                     (f"{arch}.attention.value_length", "u32", m.head_dim)]
    for key, typ, val in dict((k, (k, t, v)) for k, t, v in kv).values():
        w.add(key, typ, val)
    for key, typ, val in _tokenizer_kv(m, "qwen2", QWEN3_CHAT_TEMPLATE):
        w.add(key, typ, val)
    makers = []

    def f32(name, make, n):
        w.add_tensor_info(name, [n], 0, n * 4)
        makers.append(lambda: np.asarray(make(), np.float32))

    def linear(name, prefix, o, n):
        if linear_type != "F16":
            block = 128 if linear_type == "Q2_0_G128" else 64
            w.add_tensor_info(name, [o, n], 42, o * n // block * (2 + block // 4))
            makers.append(lambda: q2_0_pack(*bonsai_weights(m, prefix), block=block))
        else:
            w.add_tensor_info(name, [o, n], 1, o * n * 2)
            makers.append(lambda: bonsai_dense(m, prefix))

    def rows(name, make):   # the embedding / head: Q2_0 like the linears (Ternary Bonsai's files), or F16
        if linear_type != "F16" and not embed_f16:
            block = 128 if linear_type == "Q2_0_G128" else 64
            w.add_tensor_info(name, [m.V, m.D], 42, m.V * m.D // block * (2 + block // 4))
            makers.append(lambda: q2_0_pack(*make(), block=block))
        else:
            w.add_tensor_info(name, [m.V, m.D], 1, m.V * m.D * 2)
            makers.append(lambda: bonsai_rows(*make()))

    rows("token_embd.weight", lambda: bonsai_embed(m))
    for i in range(m.L):
        p, nn = f"model.layers.{i}", m.norm_names(i)
        f32(f"blk.{i}.attn_norm.weight", lambda h=nn["attn_norm"]: m.norm(h).astype(np.float16), m.D)
        for short, hf in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                          ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj")):
            linear(f"blk.{i}.{short}.weight", f"{p}.{hf}", *m._shape(f"{p}.{hf}"))
        for short in ("q_norm", "k_norm"):
            nm = f"{p}.self_attn.{short}.weight"
            f32(f"blk.{i}.attn_{short}.weight", lambda nm=nm: bonsai_qk_norm(m, nm).astype(np.float16), m.head_dim)
        f32(f"blk.{i}.ffn_norm.weight", lambda h=nn["ffn_norm"]: m.norm(h).astype(np.float16), m.D)
        for short, hf in (("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            linear(f"blk.{i}.{short}.weight", f"{p}.{hf}", *m._shape(f"{p}.{hf}"))
    f32("output_norm.weight", lambda: m.norm("model.norm.weight").astype(np.float16), m.D)
    if not m.config.get("tie_word_embeddings", True):
        rows("output.weight", lambda: bonsai_lm_head(m))
    w.write(makers)
    return path
