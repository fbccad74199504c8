"""Readers that present every supported source (bitnet.cpp / llama.cpp GGUF, HF safetensors directories) as
one interface for engine.convert:

    src.config: ModelConfig        src.source_format: str      src.meta: dict (notes: how things were decided)
    src.embed(r0, r1) -> f32 rows  src.norm(short, i) -> f32   (short: attn_norm ffn_norm attn_sub_norm ffn_sub_norm;
                                                                 i None: output_norm)
    src.linear(short, i) -> (W_t int8 [out, in], scale f32 multiplying form, scales_seen list); for a model with
                            config.weight_groups (Ternary Bonsai): scale is f16 [out, in / 128], one per group
    src.lm_head(r0, r1) -> f32 rows, or None when tied     src.tokenizer -> (kind, bytes) | None
    src.chat_template -> str | None

Facts (which scale multiplies, which activation, tensor names) come from each family's public config and transformers' / llama.cpp's loading code.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

from ..config import ModelConfig
from ..errors import FormatError, UnsupportedError, json_why, quoted
from ..fileio import not_a_file, why_missing
from .families import gguf_family, hf_family, is_minicpm, refuse_unsupported_hf
from .gguf import GGUFFile
from .safetensors_io import SafetensorsDir
from .tokenizer_build import fix_chat_template, gguf_tokenizer, special_ids_from_hf_json

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HF_LINEAR = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
GGUF_ARCHS = ("bitnet-b1.58", "bitnet-25", "bitnet", "llama", "qwen3")
GROUP = 128   # weights per scale of the group-scaled (Ternary Bonsai) models


def ternarize_online(w: np.ndarray) -> tuple[np.ndarray, float]:
    """The reference's online quantization (transformers WeightQuant, computed in f32):
    s_w = 1/max(mean|W|, 1e-5); W_t = clamp(round_half_even(W*s_w), -1, 1); effective scale 1/s_w (multiplies).
    The mean is accumulated in float64 and rounded once: torch's own f32 reduction order can land one ulp
    away (scale off by ~1e-7 relative; the ternary codes agree; tests/test_synth.py checks both)."""
    w = np.asarray(w, dtype=np.float32)
    mean = np.float32(np.abs(w).mean(dtype=np.float64))
    s_w = np.float32(1.0) / np.maximum(mean, np.float32(1e-5))
    w_t = np.clip(np.rint(w * s_w), -1, 1).astype(np.int8)
    return w_t, float(np.float32(1.0) / s_w)


def ternary_from_fakequant(path: str, name: str, w: np.ndarray) -> tuple[np.ndarray, float | np.ndarray]:
    """A float matrix that is already ternary x scale (TriLM's unpacked checkpoints): every row holds 0 and
    one magnitude. Returns (W_t, scale): a float when all rows share the magnitude (one scale per tensor),
    else an f32 per-row array (one scale per row or row block, e.g. per model-parallel shard).
    Anything else is not a ternary checkpoint: FormatError naming the tensor."""
    a = np.abs(np.asarray(w, dtype=np.float32))
    mag = a.max(axis=1)
    bad = ~((a == 0) | (a == mag[:, None]))
    if bad.any():
        r = int(np.nonzero(bad.any(axis=1))[0][0])
        n = np.unique(a[r][a[r] > 0]).size
        raise FormatError(f"{path}: tensor {name!r} is not ternary (row {r} holds {n} different magnitudes)",
                          hint="this engine runs ternary (1.58-bit) models only, with one scale per tensor, row or"
                               " 128 weights of a row; for the latent (master) weights of a BitNet model, such as"
                               " Falcon-E's bfloat16 revision, convert with `bitnet convert --ternarize DIR`")
    if not np.isfinite(mag).all():
        raise FormatError(f"{path}: tensor {name!r} holds NaN/inf values")
    live = mag[mag > 0]
    w_t = np.sign(w).astype(np.int8)
    if live.size == 0 or (live == live[0]).all():
        return w_t, float(live[0]) if live.size else 1.0
    return w_t, np.where(mag > 0, mag, np.float32(1.0)).astype(np.float32)


def ternary_groups_from_float(path: str, name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float matrix that is ternary x one scale per 128 weights of a row (Ternary Bonsai's unpacked checkpoints,
    or a dequantized Q2_0 tensor): every group of 128 holds 0 and one magnitude. Returns (W_t int8, scales f16
    [out, in / 128]); a bf16 magnitude is rounded to f16 (relative 2^-11). Anything else: FormatError."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % GROUP:
        raise UnsupportedError(f"{path}: tensor {name!r} has {k} columns, not a multiple of the {GROUP}-weight scale groups")
    a = np.abs(w).reshape(n, k // GROUP, GROUP)
    mag = a.max(axis=2)
    bad = ~((a == 0) | (a == mag[:, :, None]))
    if bad.any():
        r, g = (int(v[0]) for v in np.nonzero(bad.any(axis=2)))
        m = np.unique(a[r, g][a[r, g] > 0]).size
        raise FormatError(f"{path}: tensor {name!r} is not ternary with one scale per {GROUP} weights (row {r}, group"
                          f" {g} holds {m} different magnitudes)", hint="this engine runs ternary (1.58-bit) models only")
    if not np.isfinite(mag).all() or mag.max(initial=0) > 65504:
        raise FormatError(f"{path}: tensor {name!r} holds NaN/inf values or scales beyond the f16 range")
    return np.sign(w).astype(np.int8), mag.astype(np.float16)


def _group_seen(sc: np.ndarray) -> list[float]:
    """The range of a matrix's live group scales (the store's ternary_stats, `bitnet inspect`)."""
    live = sc[sc > 0].astype(np.float32)
    return [float(live.min()), float(live.max())] if live.size else []


def _pair_q2_0_scales(path: str, name: str, w: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The f16 scale per 128 weights of a Q2_0 tensor: PrismML's blocks hold 128 weights already; ggml's hold 64,
    and a Ternary Bonsai model written with them repeats each 128-group's scale in both halves (a half whose
    weights are all 0 may carry any scale). Two different live scales in one 128-group: UnsupportedError."""
    if d.shape[1] * GROUP == w.shape[1]:
        return d
    out = d.shape[0]
    live = np.abs(w).reshape(out, -1, 64).any(axis=2)                    # [out, in/64]
    a, b = d[:, 0::2], d[:, 1::2]
    la, lb = live[:, 0::2], live[:, 1::2]
    clash = la & lb & (a.view(np.uint16) != b.view(np.uint16))
    if clash.any():
        r, g = (int(v[0]) for v in np.nonzero(clash))
        raise UnsupportedError(f"{path}: Q2_0 tensor {name!r} has two different scales in the 128 weights at row {r},"
                               f" columns {128 * g}..{128 * g + 127} (a model with one scale per 64 weights); this"
                               " engine runs one scale per 128 (Ternary Bonsai)")
    return np.where(la | ~lb, a, b)


def _llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf LlamaModel.permute: its `llama` graph rotates
    interleaved pairs; engine/model.py rotates halves as transformers does)."""
    return np.ascontiguousarray(w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
                                .swapaxes(1, 2).reshape(w.shape))


def _adds_bos(kind: str, blob: bytes, tc: dict, bos: int) -> bool:
    """Whether transformers starts a text's tokens with BOS: LlamaTokenizer(Fast) and SentencePiece models by
    tokenizer_config's add_bos_token (default true; the fast one rebuilds its post-processor from it), any other
    tokenizer.json by its own post-processor (Qwen3's adds none, though config.json names a bos_token_id)."""
    flag = tc.get("add_bos_token")
    if kind == "sentencepiece" or str(tc.get("tokenizer_class") or "").startswith("Llama"):
        return flag if isinstance(flag, bool) else True
    from tokenizers import Tokenizer as HFTokenizer

    from .tokenizer import hf_adds_bos
    try:
        hf = HFTokenizer.from_str(blob.decode("utf-8"))
    except Exception:   # the tokenizer's own load reports a broken file, naming it
        return True
    return hf_adds_bos(hf, bos)   # the rule a store without add_bos is read by too (Tokenizer.from_store)


def _f32(v) -> float:
    """A GGUF f32 value as the decimal it was written from (1e-5, not 9.999999747378752e-06)."""
    return float(str(np.float32(v))) if isinstance(v, (float, np.floating)) else float(v)


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None


def _config(path: str, **kw) -> ModelConfig:
    try:
        c = ModelConfig(**kw)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    for t in ((c.bos_token_id,) if c.bos_token_id is not None else ()) + c.eos_token_ids:
        if not 0 <= t < c.vocab_size:  # the runtime would index the embedding with it
            raise FormatError(f"{path}: special token id {t} is outside the vocabulary (size {c.vocab_size})")
    return c


def _cfg_int(where: str, cfg: dict, key: str, default: int | None = None) -> int:
    """A positive integer field of config.json (null or absent -> default); FormatError naming the field."""
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise FormatError(f"{where}: missing field {key!r}")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= 1 << 24:
        raise FormatError(f"{where}: {key} must be a positive integer (at most {1 << 24}), got {v!r}")
    return v


def _cfg_float(where: str, cfg: dict, key: str, default: float) -> float:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v <= 0:
        raise FormatError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def _check_scale(path: str, name: str, s: float) -> float:
    if not np.isfinite(s) or s == 0:
        raise FormatError(f"{path}: tensor {name!r} has a {'NaN/inf' if not np.isfinite(s) else 'zero'} weight scale")
    return float(s)


def _shape_check(path, name, got, want):
    if tuple(got) != tuple(want):
        raise FormatError(f"{path}: tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}")


# ---------------------------------------------------------------------------------------------------------
class GGUFSource:
    def __init__(self, path: str, hidden_act: str | None = None, check_ternary: bool = True):
        self.path = path
        self.g = g = GGUFFile(path)
        arch = g.arch
        if arch not in GGUF_ARCHS:
            raise UnsupportedError(f"{path}: unsupported GGUF architecture {quoted(arch)}",
                                   hint="this engine runs ternary models: GGUF architectures bitnet-b1.58,"
                                        " bitnet-25, bitnet, and llama with TQ1_0 / TQ2_0 / I2_S / TL1 / TL2 tensors")
        self.meta: dict = {"gguf_arch": arch}

        def key(k, typ=int, default=None):
            v = g.get(f"{arch}.{k}", int if typ is int else float, default)
            if v is None:
                raise FormatError(f"{path}: missing GGUF key {arch}.{k}")
            return typ(v)

        D, L, H = key("embedding_length"), key("block_count"), key("attention.head_count")
        hd = g.get(f"{arch}.attention.key_length", int)  # explicit head_dim (Falcon3: 256)
        if H <= 0:
            raise FormatError(f"{path}: attention.head_count {H}: must be a positive integer")
        if hd is None and D % H:
            raise FormatError(f"{path}: embedding_length {D} is not a multiple of head_count {H}")
        hd = hd or D // H
        vd = g.get(f"{arch}.attention.value_length", int)
        if vd is not None and vd != hd:
            raise UnsupportedError(f"{path}: attention.value_length {vd} != key_length {hd}")
        # tensors of layers past block_count: the count or the tensors are wrong, and either way the file is not
        # what it says (llama.cpp refuses it: "wrong number of tensors")
        layers = {int(m.group(1)) for n in g.tensors if (m := re.match(r"blk\.(\d+)\.", n))}
        extra = sorted(i for i in layers if i >= L)
        if extra:
            raise FormatError(f"{path}: tensors of layer blk.{extra[0]} but block_count is {L}"
                              + (f" (layers {extra[0]}-{extra[-1]} past it)" if len(extra) > 1 else ""))
        emb = g.info("token_embd.weight")
        if len(emb.shape) != 2 or emb.shape[1] != D:
            raise FormatError(f"{path}: token_embd.weight has shape {emb.shape}, expected [vocab, {D}]")
        V = key("vocab_size", int, emb.shape[0])
        _shape_check(path, "token_embd.weight", emb.shape, (V, D))
        tok = gguf_tokenizer(g)
        self.tokenizer, self.chat_template = tok["blob"], tok["chat_template"]
        self.meta.update(tok["meta"])
        self.hidden_act = self._activation(arch, hidden_act, tok["kind"])
        self.config = _config(
            path, hidden_size=D, intermediate_size=key("feed_forward_length"), n_layers=L, n_heads=H,
            n_kv_heads=key("attention.head_count_kv", int, H), head_dim=hd, vocab_size=V,
            context_length=key("context_length", int, 4096), rope_theta=key("rope.freq_base", _f32, 10000.0),
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", _f32, 1e-5), hidden_act=self.hidden_act,
            tie_word_embeddings="output.weight" not in g.tensors, bos_token_id=tok["bos"],
            eos_token_ids=tuple(tok["eos"]), arch=arch, name=str(g.kv.get("general.name", ""))[:200].replace("\n", " "),
            # any sub-norm makes them all required (each missing one is then named), not one layer's alone
            sub_norms=any(n.endswith(("attn_sub_norm.weight", "ffn_sub_norm.weight")) for n in g.tensors),
            weight_groups=GROUP if arch == "qwen3" else 0, qk_norm="blk.0.attn_q_norm.weight" in g.tensors)
        self.meta["family"] = gguf_family(arch, V, hd, self.hidden_act, tok["kind"])
        rd = g.get(f"{arch}.rope.dimension_count", int)
        if rd is not None and rd != hd:
            raise UnsupportedError(f"{path}: partial RoPE (rope.dimension_count {rd} != head_dim {hd})")
        # RoPE scaling, as llama.cpp reads it (the HF path refuses rope_scaling the same way): ignored, the positions
        # would be rotated as an unscaled model's and every answer would be silently worse
        # (the factor scales: bitnet.cpp's files say type linear with factor 1, which is no scaling at all)
        kind = g.get(f"{arch}.rope.scaling.type", str)
        factor = g.get(f"{arch}.rope.scaling.factor", float) or g.get(f"{arch}.rope.scale_linear", float)
        if factor not in (None, 0.0, 1.0):
            raise UnsupportedError(f"{path}: RoPE scaling {str(kind or 'linear')!r} (x{factor or 1:g}) is not supported")
        if "rope_freqs.weight" in g.tensors:   # Llama 3.1's rope_scaling llama3, as llama.cpp's converter writes it
            raise UnsupportedError(f"{path}: RoPE scaling 'llama3' (tensor rope_freqs.weight) is not supported")
        if arch == "llama":
            self.meta["qk_rows"] = "un-permuted from llama.cpp's interleaved-RoPE order"
        self.unused_tensors = self._unused_tensors()
        if self.unused_tensors and check_ternary:   # inspect lists the file (and flags them)
            missing = next((n for n in self._required() if n not in g.tensors), None)
            if missing:   # a tensor renamed: the one missing is the better news (named as such)
                g.info(missing)
            biases = [n for n in self.unused_tensors if n.endswith(".bias")]
            if biases:   # as the HF path says it
                raise UnsupportedError(f"{path}: linear biases ({biases[0]} ...) are not supported")
            more = len(self.unused_tensors) - 1
            raise FormatError(f"{path}: tensor {self.unused_tensors[0]!r}" + (f" (and {more} more)" if more else "")
                              + f" is not one a {arch} model has (llama.cpp refuses the file: wrong number of tensors)")
        types = sorted({g.info(f"blk.0.{s}.weight").type_name for s in LINEARS})
        self.source_format = f"gguf-{arch}-" + "+".join(t.lower() for t in types)
        self.fit_notes: dict[str, dict] = {}
        self._first_fit = None
        first = g.info("blk.0.attn_q.weight")
        if not check_ternary or first.type_name in ("I2_S", "TL1", "TL2", "TQ1_0", "TQ2_0", "Q2_0", "Q2_0_G128"):
            pass
        elif self.config.weight_groups:   # refuse a non-ternary file before anything is written
            ternary_groups_from_float(path, first.name, g.dequantize(first.name).reshape(first.shape))
        else:
            # refuse a non-ternary file before anything is written (the fit is kept for linear())
            self._first_fit = (first.name, self.ternary_fit(first.name, raise_if_not=True))

    def _layer_tensors(self) -> list[str]:
        """The names (after blk.N.) of the tensors each layer must have."""
        c = self.config
        return [f"{s}.weight" for s in ("attn_norm", "ffn_norm", *LINEARS,
                                        *(("attn_q_norm", "attn_k_norm") if c.qk_norm else ()),
                                        *(("attn_sub_norm", "ffn_sub_norm") if c.sub_norms else ()))]

    def _required(self):
        yield from ("token_embd.weight", "output_norm.weight")
        per_layer = self._layer_tensors()
        for i in range(self.config.n_layers):
            yield from (f"blk.{i}.{s}" for s in per_layer)

    def _unused_tensors(self) -> list[str]:
        """The file's tensors that conversion would not read (a bias, a tensor of another architecture): left out,
        the model would run without them, its output silently different from what the file says."""
        per_layer = {*self._layer_tensors(), *(f"{s}.scale" for s in LINEARS)}   # scales: optional (llama.cpp's too)
        out = []
        for n in self.g.tensors:
            m = re.fullmatch(r"blk\.(0|[1-9]\d*)\.(.+)", n)
            if n not in ("token_embd.weight", "output_norm.weight", "output.weight") and not (
                    m and int(m.group(1)) < self.config.n_layers and m.group(2) in per_layer):
                out.append(n)
        return out

    def _activation(self, arch, override, tok_kind) -> str:
        act = self.g.get(f"{arch}.hidden_activation", str)
        if override:
            self.meta["hidden_act_from"] = "caller"
            return override
        if act is not None:
            act = {"relu2": "relu2", "relu_sqr": "relu2", "relu_squared": "relu2", "silu": "silu",
                   "swiglu": "silu"}.get(str(act).lower())
            if act is None:
                raise UnsupportedError(f"{self.path}: unsupported {arch}.hidden_activation "
                                       f"{quoted(self.g.kv[f'{arch}.hidden_activation'])}")
            self.meta["hidden_act_from"] = "gguf key"
            return act
        if arch in ("bitnet-b1.58", "bitnet-25"):
            self.meta["hidden_act_from"] = "architecture (bitnet.cpp b1.58 models use relu2)"
            return "relu2"
        if arch in ("llama", "qwen3"):
            self.meta["hidden_act_from"] = f"architecture ({arch}: SwiGLU)"
            return "silu"
        # llama.cpp `bitnet` without the key: its graph assumes SiLU, right for 1bitLLM (SentencePiece vocab),
        # wrong for the 2B-4T family (LLaMA-3 byte-level BPE vocab), so decide by the tokenizer.
        self.meta["hidden_act_from"] = f"inferred from the {tok_kind} tokenizer (no {arch}.hidden_activation key)"
        return "relu2" if tok_kind == "gpt2" else "silu"

    def embed(self, r0, r1):
        """Rows as f32, or f16 straight from the file when it is F16 (no round trip through f32)."""
        t = self.g.info("token_embd.weight")
        if t.type_name == "F16":
            row = t.shape[-1] * 2
            return self.g.raw(t.name)[r0 * row: r1 * row].view("<f2").reshape(r1 - r0, -1)
        return self.g.dequantize("token_embd.weight", slice(r0, r1))

    def lm_head(self, r0, r1):
        if "output.weight" not in self.g.tensors:
            return None
        _shape_check(self.path, "output.weight", self.g.info("output.weight").shape,
                     (self.config.vocab_size, self.config.hidden_size))
        return self.g.dequantize("output.weight", slice(r0, r1))

    def norm(self, short, i):
        c = self.config
        name = "output_norm.weight" if i is None else f"blk.{i}.{short}.weight"
        size = {"attn_sub_norm": c.q_dim, "ffn_sub_norm": c.intermediate_size, "attn_q_norm": c.head_dim,
                "attn_k_norm": c.head_dim}.get(short, c.hidden_size)
        t = self.g.info(name)
        if tuple(t.shape) != (size,):   # a vector: llama.cpp refuses a [1, n] norm too
            raise FormatError(f"{self.path}: tensor {name!r} has shape {tuple(t.shape)}, expected ({size},)")
        return self.g.dequantize(name).reshape(-1)

    def linear(self, short, i):
        c = self.config
        name = f"blk.{i}.{short}.weight"
        out, inp = {"attn_q": (c.q_dim, c.hidden_size), "attn_k": (c.kv_dim, c.hidden_size),
                    "attn_v": (c.kv_dim, c.hidden_size), "attn_output": (c.hidden_size, c.q_dim),
                    "ffn_gate": (c.intermediate_size, c.hidden_size), "ffn_up": (c.intermediate_size, c.hidden_size),
                    "ffn_down": (c.hidden_size, c.intermediate_size)}[short]
        t = self.g.info(name)
        _shape_check(self.path, name, t.shape, (out, inp))
        if c.weight_groups:   # qwen3 (Ternary Bonsai): Q2_0 as it is, any other type dequantized and fitted
            if t.type_name in ("Q2_0", "Q2_0_G128"):
                w, d = self.g.ternary(name)
                sc = _pair_q2_0_scales(self.path, name, w, d.reshape(out, -1))
                live = np.abs(w).reshape(out, -1, GROUP).any(axis=2)
                if not np.isfinite(sc[live]).all():   # as every other format: a NaN would poison whole rows
                    raise FormatError(f"{self.path}: tensor {name!r} has a NaN/inf weight scale")
                sc = np.where(live, sc, np.zeros((), sc.dtype))   # a group of zeros may carry any scale
            else:
                w, sc = ternary_groups_from_float(self.path, name, self.g.dequantize(name).reshape(out, inp))
            return w, sc, _group_seen(sc)
        if t.type_name in ("I2_S", "TL1", "TL2", "TQ1_0", "TQ2_0"):
            w, d = self.g.ternary(name)
            if t.type_name in ("I2_S", "TL1", "TL2"):   # one scale per tensor, in the tail after the codes
                scale = float(d[0])
            else:
                # llama.cpp folds the per-tensor scale into every block's d: they must agree, except blocks that
                # are all zero (their d is irrelevant and may be 0)
                live = np.abs(w.reshape(d.size, -1)).any(axis=1)
                ds = np.unique(d[live])
                if ds.size > 1:
                    raise UnsupportedError(f"{self.path}: tensor {name!r} has {ds.size} different block scales"
                                           " (not a BitNet per-tensor scale; re-convert the model)")
                scale = float(ds[0]) if ds.size else 1.0
        else:  # any other type (F16, Q8_0, K-quants, IQ*): dequantize, check it is ternary, recover the scale
            kept, self._first_fit = self._first_fit, None
            fit = kept[1] if kept and kept[0] == name else self.ternary_fit(name, raise_if_not=True)
            w, scale = fit.codes, fit.scale
        sname = f"blk.{i}.{short}.scale"
        if sname in self.g.tensors:
            s = self.g.dequantize(sname).reshape(-1)
            if s.size != 1:
                raise FormatError(f"{self.path}: tensor {sname!r} has {s.size} values, expected 1")
            scale *= float(s[0])
        if self.g.arch == "llama" and short in ("attn_q", "attn_k"):
            w = _llama_unpermute(w, c.n_heads if short == "attn_q" else c.n_kv_heads)
        return w, _check_scale(self.path, name, np.float32(scale)), [scale]

    def ternary_fit(self, name: str, raise_if_not: bool = False):
        """engine.ternary_check.TernaryFit of a linear weight stored in a non-ternary type; its report is kept in
        self.fit_notes (the store's ternary_stats and `bitnet inspect` show it)."""
        from .ternary_check import check_ternary, fit_exact_raw, fit_ternary

        t = self.g.info(name)
        fit = fit_exact_raw(self.g.raw(name), t.type_name, t.shape)  # F16/BF16/F32/Q8_0 holding exact ternary values
        if fit is None:
            wf = self.g.dequantize(name).reshape(t.shape)
            fit = check_ternary(self.path, name, wf, t.type_name) if raise_if_not else fit_ternary(wf, t.type_name)
        self.fit_notes[name] = fit.note()
        return fit

    def close(self):
        self.g.close()


# ---------------------------------------------------------------------------------------------------------
# what HFSource reads of a model folder besides the weights (convert.cache_key stamps these and the shards)
HF_READS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
            "chat_template.jinja")


class HFSource:
    def __init__(self, path: str, hidden_act: str | None = None, ternarize: bool = False):
        self.path = path
        special = [name for name in sorted(os.listdir(path)) if not_a_file(os.path.join(path, name))]
        if special:   # a FIFO (opening it waits for a writer: every command hung) or a device among the files
            raise FormatError(f"{os.path.join(path, special[0])}: not a regular file (a model directory holds files)")
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
        except OSError as e:
            raise FormatError(f"{path}: no readable config.json ({e.strerror})") from None
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path}/config.json: invalid JSON: {json_why(e)}") from None
        self.cfg = cfg
        self.st = SafetensorsDir(path)
        archs = cfg.get("architectures") or []
        archs = cfg["architectures"] = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
        if not isinstance(cfg.get("model_type", ""), str):
            raise FormatError(f"{path}/config.json: model_type must be a string, got {cfg['model_type']!r}")
        mt = cfg.get("model_type", "")
        refuse_unsupported_hf(path, cfg)
        # MiniCPM (BitCPM4): the Llama layout (same tensor names, SwiGLU, no sub-norms, RMSNorm) plus three
        # constant scalings, folded into the weights below, and LongRoPE, which drives the RoPE tables
        self.minicpm = minicpm = is_minicpm(cfg)
        # Qwen3 (Ternary Bonsai): the Llama layout plus q/k norms, one scale per 128 weights of a row
        self.qwen3 = qwen3 = mt == "qwen3" or "Qwen3ForCausalLM" in archs
        if qwen3 and (cfg.get("use_sliding_window") or cfg.get("attention_bias")):
            raise UnsupportedError(f"{path}: Qwen3 with {'sliding-window attention' if cfg.get('use_sliding_window') else 'attention biases'}"
                                   " is not supported")
        llama = minicpm or qwen3 or "LlamaForCausalLM" in archs or (mt == "llama" and "BitnetForCausalLM" not in archs)
        if not ({"BitNetForCausalLM", "BitnetForCausalLM"} & set(archs) or mt == "bitnet" or llama):
            raise UnsupportedError(f"{path}: unsupported model (architectures {archs}, model_type {mt!r})",
                                   hint="this engine runs ternary BitNet b1.58 / Llama-architecture models (docs/models.md)")
        q = cfg.get("quantization_config") or {}
        if not isinstance(q, dict):
            raise FormatError(f"{path}/config.json: quantization_config is not an object")
        if q and q.get("quant_method") != "bitnet":
            raise UnsupportedError(f"{path}: quantization_config.quant_method {q.get('quant_method')!r} is not a"
                                   " ternary (bitnet) checkpoint", hint="this engine runs 1.58-bit models only")
        if q.get("use_rms_norm"):
            raise UnsupportedError(f"{path}: quantization_config.use_rms_norm (an RMSNorm inside every BitLinear)"
                                   " is not supported")
        # transformers' BitNetQuantConfig defaults: linear_class "bitlinear" (divides), mode "offline";
        # no quantization_config: 1bitLLM (latent weights, quantized online) or fake-quantized floats (TriLM)
        self.linear_class = q.get("linear_class", "bitlinear") if q else "autobitlinear"
        if self.linear_class not in ("autobitlinear", "bitlinear"):
            raise UnsupportedError(f"{path}: unknown quantization_config.linear_class {self.linear_class!r}")
        self.mode = q.get("quantization_mode", "offline") if q else ("fakequant" if llama else "online")
        if ternarize and self.mode == "fakequant":  # the caller says: latent BitNet weights (Falcon-E bfloat16)
            self.mode = "online"
        elif ternarize and q:   # it did nothing, in silence
            raise UnsupportedError(f"{path}: --ternarize is for latent float weights without a quantization_config; "
                                   f"these are BitNet's already (quantization_config {self.mode!r})",
                                   hint="convert without --ternarize")
        self.meta: dict = {"hf_linear_class": self.linear_class, "hf_quantization_mode": self.mode}
        names = set(self.st.names())
        self.attn_sub = "attn_sub_norm" if "model.layers.0.self_attn.attn_sub_norm.weight" in names else "inner_attn_ln"
        self.ffn_sub = "ffn_sub_norm" if "model.layers.0.mlp.ffn_sub_norm.weight" in names else "ffn_layernorm"
        sub_norms = any(n.endswith((f".{self.attn_sub}.weight", f".{self.ffn_sub}.weight")) for n in names)
        biases = sorted(n for n in names if n.endswith(".bias"))
        if biases:
            raise UnsupportedError(f"{path}: linear biases ({biases[0]} ...) are not supported")
        rope = cfg.get("rope_scaling") or {}
        rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        rope_type = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else rope
        rope_type = rope_type or rope_params.get("rope_type")
        where = os.path.join(path, "config.json")
        D, H = _cfg_int(where, cfg, "hidden_size"), _cfg_int(where, cfg, "num_attention_heads")
        hd = _cfg_int(where, cfg, "head_dim", D // H)
        rope_factors, rope_attn = (), 1.0
        if minicpm and rope_type == "longrope":
            rope_factors, rope_attn = self._longrope(where, rope if isinstance(rope, dict) and rope else rope_params, hd, _cfg_int(where, cfg, "max_position_embeddings", 4096))
        elif rope_type not in (None, "default"):
            raise UnsupportedError(f"{path}/config.json: RoPE scaling {rope_type!r} is not supported")
        act = hidden_act or cfg.get("hidden_act") or ("relu2" if mt == "bitnet" else "silu")
        act = {"relu2": "relu2", "relu_squared": "relu2", "silu": "silu", "swish": "silu"}.get(str(act))
        if act is None:
            raise UnsupportedError(f"{path}/config.json: unsupported hidden_act {cfg.get('hidden_act')!r}")
        self.emb_scale = self.res_scale = self.logit_div = 1.0
        if minicpm:
            # modeling_minicpm.py: embeddings x scale_emb; every residual branch x scale_depth / sqrt(layers);
            # logits = lm_head(h / (hidden_size / dim_model_base))
            n_layers = _cfg_int(where, cfg, "num_hidden_layers")
            self.emb_scale = _cfg_float(where, cfg, "scale_emb", 1.0)
            self.res_scale = _cfg_float(where, cfg, "scale_depth", 1.0) / float(np.sqrt(n_layers))
            self.logit_div = D / _cfg_float(where, cfg, "dim_model_base", 1.0)
            self.meta["folded"] = (f"scale_emb {self.emb_scale:g} into token_embd; scale_depth/sqrt(layers) ="
                                   f" {self.res_scale:.6g} into the attn_output / ffn_down row scales; 1/(hidden_size/"
                                   f"dim_model_base) = 1/{self.logit_div:.6g} into the output rows (head untied)")
        # one scale per 128 weights of a row: Qwen3 (Ternary Bonsai) always; a fake-quantized checkpoint (BitCPM-CANN:
        # "ternary with group-wise scaling") when its first matrix has one magnitude per 128-group, not per row
        groups = GROUP if qwen3 else (self._group_scaled() if self.mode == "fakequant" else 0)
        tok, tmpl, bos, eos = self._tokenizer(cfg)
        rope_theta = cfg.get("rope_theta") if cfg.get("rope_theta") is not None else rope_params.get("rope_theta")
        self.config = _config(
            path, hidden_size=D, intermediate_size=_cfg_int(where, cfg, "intermediate_size"),
            n_layers=_cfg_int(where, cfg, "num_hidden_layers"), n_heads=H,
            n_kv_heads=_cfg_int(where, cfg, "num_key_value_heads", H), head_dim=hd,
            vocab_size=_cfg_int(where, cfg, "vocab_size"),
            context_length=_cfg_int(where, cfg, "max_position_embeddings", 4096),
            # transformers' defaults when the file says nothing: BitNetConfig's 500000, LlamaConfig's 10000
            rope_theta=_cfg_float(where, {"rope_theta": rope_theta}, "rope_theta",
                                  500000.0 if mt == "bitnet" else 10000.0),
            rms_norm_eps=_cfg_float(where, cfg, "rms_norm_eps", 1e-5),
            # MiniCPM: the head always gets its own (logit-scaled) rows, since the embedding is stored scaled
            hidden_act=act, sub_norms=sub_norms, rope_factors=rope_factors, rope_attn_factor=rope_attn,
            # config.json says whether the head is tied, as transformers reads it (Qwen3Config's, LlamaConfig's and
            # BitNetConfig's default: not): tied, a saved lm_head is not used; untied, it must be there (lm_head)
            tie_word_embeddings=(cfg.get("tie_word_embeddings", False) is True) and not minicpm,
            weight_groups=groups, qk_norm="model.layers.0.self_attn.q_norm.weight" in names,
            bos_token_id=bos, eos_token_ids=tuple(eos),
            arch="bitnet-b1.58" if mt == "bitnet" else ("minicpm" if minicpm else "qwen3" if qwen3 else
                                                         "llama" if llama else "1bitllm"),
            name=os.path.basename(os.path.abspath(path)))
        try:
            self.meta["family"] = hf_family(cfg, names, self.mode == "fakequant", path)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{where}: bad field: {e!r}") from None
        self.tokenizer, self.chat_template = tok, tmpl
        # before anything is allocated from the config's sizes: the embedding must have exactly that shape
        _shape_check(path, "model.embed_tokens.weight", self.st.info("model.embed_tokens.weight")[1],
                     (self.config.vocab_size, self.config.hidden_size))
        if qwen3:   # an ordinary (not ternary) Qwen3 is refused before anything is written
            q0 = "model.layers.0.self_attn.q_proj.weight"
            if self.st.info(q0)[0] in ("BF16", "F16", "F32"):
                ternary_groups_from_float(path, q0, self.st.get_f32(q0))
        kind = "packed" if self.st.info("model.layers.0.self_attn.q_proj.weight")[0] == "U8" else "online"
        self.source_format = f"hf-{kind}-{self.linear_class}"

    def _group_scaled(self) -> int:
        """GROUP when layer 0's q_proj holds one magnitude per 128 weights of a row but not one per row, else 0."""
        name = "model.layers.0.self_attn.q_proj.weight"
        if name not in self.st.names() or self.st.info(name)[0] not in ("BF16", "F16", "F32"):
            return 0
        a = np.abs(self.st.get_f32(name))
        if a.ndim != 2 or a.shape[1] % GROUP:
            return 0
        one = lambda g: bool(((g == 0) | (g == g.max(axis=-1, keepdims=True))).all())   # noqa: E731
        if one(a) or not one(a.reshape(a.shape[0], -1, GROUP)):
            return 0
        self.meta["weight_groups"] = f"one scale per {GROUP} weights of a row (read from {name})"
        return GROUP

    @staticmethod
    def _longrope(where: str, rope: dict, hd: int, max_pos: int) -> tuple[tuple[float, ...], float]:
        """MiniCPM's LongRoPE (modeling_minicpm.py MiniCPMLongRoPE): the cos/sin cache is built once for
        max_position_embeddings positions, with long_factor when that exceeds original_max_position_embeddings,
        else short_factor (so the choice is fixed by the config, not by the prompt's length); every frequency
        is divided by its factor and cos, sin are multiplied by sqrt(1 + ln(scale) / ln(original)),
        scale = max_position_embeddings / original_max_position_embeddings."""
        orig = rope.get("original_max_position_embeddings")
        if isinstance(orig, float) and orig.is_integer():
            orig = int(orig)
        if not isinstance(orig, int) or isinstance(orig, bool) or orig < 2:
            raise FormatError(f"{where}: rope_scaling.original_max_position_embeddings must be an integer >= 2,"
                              f" got {orig!r}")
        key = "long_factor" if max_pos > orig else "short_factor"
        f = rope.get(key)
        if (not isinstance(f, list) or len(f) != hd // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) and x > 0 for x in f)):
            raise FormatError(f"{where}: rope_scaling.{key} must be a list of {hd // 2} positive numbers (head_dim/2)")
        attn = float(np.sqrt(1.0 + np.log(max_pos / orig) / np.log(orig)))
        return tuple(float(x) for x in f), attn

    def _read_json(self, fn):
        p = os.path.join(self.path, fn)
        if not os.path.isfile(p):
            return None
        try:
            with open(p, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise FormatError(f"{p}: unreadable JSON: {json_why(e)}") from None
        if not isinstance(d, dict):
            raise FormatError(f"{p}: expected a JSON object, got {type(d).__name__}")
        return d

    def _tokenizer(self, cfg):
        tj = os.path.join(self.path, "tokenizer.json")
        sp = os.path.join(self.path, "tokenizer.model")
        tc = self._read_json("tokenizer_config.json") or {}
        gen = self._read_json("generation_config.json") or {}
        eos: list[int] = []
        for v in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, int) and x not in eos:
                    eos.append(x)
        self.tokenizer_path = None
        if os.path.isfile(tj):
            blob, kind = _read_bytes(tj), "hf_json"
            self.tokenizer_path = tj
            for x in special_ids_from_hf_json(blob, ("<|eot_id|>", "<|end_of_text|>"), tj):
                if x not in eos:
                    eos.append(x)
        elif os.path.isfile(sp):
            blob, kind = _read_bytes(sp), "sentencepiece"
            self.tokenizer_path = sp
        else:
            blob, kind = None, None
            self.meta["tokenizer_note"] = "no tokenizer.json or tokenizer.model in the directory"
        # the strings a chat template gets as bos_token / eos_token: tokenizer_config's, as transformers passes them
        # (Llama-3's eos_token is <|eot_id|>, where config.json's eos_token_id is <|end_of_text|>)
        for key in ("bos_token", "eos_token"):
            v = tc.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and v:
                self.meta[key] = v
        named = self._chat_templates(tc)
        tmpl = named.get("default")
        if isinstance(named.get("tool_use"), str):   # the template for requests with tools (runtime: template_for)
            self.meta["chat_template_tool_use"] = named["tool_use"]
        if tmpl is None and cfg.get("model_type") == "bitnet":
            tmpl = fix_chat_template(None)
        elif tmpl is not None:
            tmpl = fix_chat_template(tmpl)
        bos = cfg.get("bos_token_id")
        bos = bos if isinstance(bos, int) else None
        if blob is not None and bos is not None:
            self.meta["add_bos"] = _adds_bos(kind, blob, tc, bos)
        return ((kind, blob) if blob is not None else None), tmpl, bos, eos

    def _chat_templates(self, tc: dict) -> dict:
        """The chat templates by name ("default", "tool_use", ...), as transformers loads them: chat_template.jinja
        (and additional_chat_templates/NAME.jinja) beside the weights take priority over tokenizer_config.json's
        chat_template, a string (the default) or a list of {"name", "template"}."""
        jinja = os.path.join(self.path, "chat_template.jinja")
        more = os.path.join(self.path, "additional_chat_templates")
        files = sorted(f for f in os.listdir(more) if f.endswith(".jinja")) if os.path.isdir(more) else []
        if os.path.isfile(jinja) or files:
            named = {f[:-len(".jinja")]: _read_bytes(os.path.join(more, f)).decode("utf-8", errors="replace")
                     for f in files}
            if os.path.isfile(jinja):
                named["default"] = _read_bytes(jinja).decode("utf-8", errors="replace")
            return named
        tmpl, where = tc.get("chat_template"), os.path.join(self.path, "tokenizer_config.json")
        if tmpl is None:
            return {}
        if isinstance(tmpl, str):
            return {"default": tmpl}
        if isinstance(tmpl, list):   # [{"name": ..., "template": ...}]
            return {t["name"]: t["template"] for t in tmpl if isinstance(t, dict) and isinstance(t.get("name"), str)
                    and isinstance(t.get("template"), str)}
        raise FormatError(f"{where}: chat_template must be a string, got {type(tmpl).__name__}")

    def _hf(self, short, i):
        return f"model.layers.{i}.{HF_LINEAR[short]}"

    def embed(self, r0, r1):
        name = "model.embed_tokens.weight"
        _shape_check(self.path, name, self.st.info(name)[1], (self.config.vocab_size, self.config.hidden_size))
        rows = self._rows_f32(name, r0, r1)
        return rows * np.float32(self.emb_scale) if self.emb_scale != 1.0 else rows

    def _rows_f32(self, name, r0, r1):
        from .safetensors_io import bf16_to_f32

        tag, _ = self.st.info(name)
        v = self.st.get(name)[r0:r1]
        if tag == "BF16":
            return bf16_to_f32(v)
        if tag in ("F16", "F32"):
            return v.astype(np.float32)
        raise FormatError(f"{self.path}: tensor {name!r} is {tag}, expected a float tensor")

    def lm_head(self, r0, r1):
        if self.config.tie_word_embeddings:
            return None
        name = "lm_head.weight"
        if self.minicpm and self.cfg.get("tie_word_embeddings", True) is not False:
            # MiniCPMConfig ties by default (transformers then ignores a saved lm_head): the file's embedding
            name = "model.embed_tokens.weight"
        elif name not in self.st.names():
            said = "says tie_word_embeddings false" if "tie_word_embeddings" in self.cfg else \
                "leaves tie_word_embeddings out (transformers reads false)"
            raise FormatError(f"{self.path}: config.json {said} but there is no lm_head.weight (transformers would "
                              "start the head from random weights)",
                              hint="if the head is the embedding, set \"tie_word_embeddings\": true in config.json")
        _shape_check(self.path, name, self.st.info(name)[1], (self.config.vocab_size, self.config.hidden_size))
        rows = self._rows_f32(name, r0, r1)
        return rows / np.float32(self.logit_div) if self.logit_div != 1.0 else rows

    def norm(self, short, i):
        c = self.config
        if i is None:
            name, size = "model.norm.weight", c.hidden_size
        else:
            p = f"model.layers.{i}"
            name, size = {"attn_norm": (f"{p}.input_layernorm.weight", c.hidden_size),
                          "ffn_norm": (f"{p}.post_attention_layernorm.weight", c.hidden_size),
                          "attn_sub_norm": (f"{p}.self_attn.{self.attn_sub}.weight", c.q_dim),
                          "ffn_sub_norm": (f"{p}.mlp.{self.ffn_sub}.weight", c.intermediate_size),
                          "attn_q_norm": (f"{p}.self_attn.q_norm.weight", c.head_dim),
                          "attn_k_norm": (f"{p}.self_attn.k_norm.weight", c.head_dim)}[short]
        _shape_check(self.path, name, self.st.info(name)[1], (size,))
        return self.st.get_f32(name).reshape(-1)

    def linear(self, short, i):
        w, scale, seen = self._linear(short, i)
        if self.res_scale != 1.0 and short in ("attn_output", "ffn_down"):
            # MiniCPM: x += branch * scale_depth / sqrt(layers): folded into the branch's last matrix
            if isinstance(scale, np.ndarray):
                scale = (scale.astype(np.float64) * self.res_scale).astype(np.float32)
            else:
                scale = _check_scale(self.path, self._hf(short, i) + ".weight", float(np.float32(scale * self.res_scale)))
        return w, scale, seen

    def _linear(self, short, i):
        c = self.config
        out, inp = {"attn_q": (c.q_dim, c.hidden_size), "attn_k": (c.kv_dim, c.hidden_size),
                    "attn_v": (c.kv_dim, c.hidden_size), "attn_output": (c.hidden_size, c.q_dim),
                    "ffn_gate": (c.intermediate_size, c.hidden_size), "ffn_up": (c.intermediate_size, c.hidden_size),
                    "ffn_down": (c.hidden_size, c.intermediate_size)}[short]
        name = self._hf(short, i) + ".weight"
        tag, shape = self.st.info(name)
        if c.weight_groups:
            if tag not in ("BF16", "F16", "F32"):
                raise UnsupportedError(f"{self.path}: tensor {name!r} has dtype {tag}; a Qwen3 (Ternary Bonsai)"
                                       " directory holds float weights (the `-unpacked` files)")
            _shape_check(self.path, name, shape, (out, inp))
            w, sc = ternary_groups_from_float(self.path, name, self.st.get_f32(name))
            return w, sc, _group_seen(sc)
        if tag == "U8":
            if out % 4:
                raise FormatError(f"{self.path}: {name!r}: output dim {out} is not a multiple of 4")
            _shape_check(self.path, name, shape, (out // 4, inp))
            p = self.st.get(name)
            w = np.empty((4, out // 4, inp), np.uint8)
            for k in range(4):  # low bits = first quarter of the rows (transformers' BitNet unpacking order)
                np.bitwise_and(p >> (2 * k), 3, out=w[k])
            if (w == 3).any():
                raise FormatError(f"{self.path}: tensor {name!r} holds invalid packed code 3")
            w = (w.view(np.int8) - np.int8(1)).reshape(out, inp)
            sname = self._hf(short, i) + ".weight_scale"
            s = self.st.get_f32(sname).reshape(-1)
            if s.size != 1:
                raise FormatError(f"{self.path}: tensor {sname!r} has {s.size} values, expected 1")
            raw = float(s[0])
            _check_scale(self.path, sname, raw)
            # autobitlinear multiplies by weight_scale; the legacy bitlinear class divides
            scale = raw if self.linear_class == "autobitlinear" else float(np.float32(1.0) / np.float32(raw))
            return w, _check_scale(self.path, sname, scale), [raw]
        if tag == "I8":  # unpacked ternary values next to a weight_scale
            _shape_check(self.path, name, shape, (out, inp))
            w = np.array(self.st.get(name))
            if w.size and (w.min() < -1 or w.max() > 1):
                raise FormatError(f"{self.path}: int8 tensor {name!r} is not ternary (values outside -1..1)")
            sname = self._hf(short, i) + ".weight_scale"
            s = self.st.get_f32(sname).reshape(-1)
            if s.size != 1:
                raise FormatError(f"{self.path}: tensor {sname!r} has {s.size} values, expected 1")
            raw = _check_scale(self.path, sname, float(s[0]))
            scale = raw if self.linear_class == "autobitlinear" else float(np.float32(1.0) / np.float32(raw))
            return w, _check_scale(self.path, sname, scale), [raw]
        if tag in ("BF16", "F16", "F32"):
            _shape_check(self.path, name, shape, (out, inp))
            if self.mode == "fakequant":  # TriLM: already ternary x scale in float
                w, scale = ternary_from_fakequant(self.path, name, self.st.get_f32(name))
                seen = sorted(set(np.atleast_1d(scale).tolist()))
                return w, scale, seen
            w, scale = ternarize_online(self.st.get_f32(name))
            return w, _check_scale(self.path, name, scale), [scale]
        raise UnsupportedError(f"{self.path}: tensor {name!r} has dtype {tag} (expected U8 packed or float)")

    def close(self):
        self.st.close()


def open_source(path: str, hidden_act: str | None = None, ternarize: bool = False, check_ternary: bool = True):
    """GGUFSource for a GGUF file, HFSource for a directory; FormatError otherwise. ternarize: float weights of
    a Llama-architecture directory without quantization_config are BitNet latent weights, ternarized like
    transformers' online AutoBitLinear (otherwise they must already be ternary x scale). check_ternary=False
    (inspect): a GGUF whose weights are not ternary opens anyway (its linear() still refuses them)."""
    from .gguf import is_gguf

    if os.path.isdir(path):
        return HFSource(path, hidden_act, ternarize)
    if not os.path.exists(path):
        raise FormatError(f"{path}: {why_missing(path)}")
    if ternarize and not path.endswith(".safetensors"):   # a GGUF's weights are ternary or refused: it did nothing
        raise UnsupportedError(f"{path}: --ternarize is for a Hugging Face directory of latent float weights, not a "
                               "single file", hint="convert without --ternarize")
    if not os.path.isfile(path):
        raise FormatError(f"{path}: not a regular file (a model is read from a file or a directory)")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None
    if size == 0:
        raise FormatError(f"{path}: the file is empty (0 bytes)", hint="an interrupted download or copy? fetch it again")
    try:   # the readers' magic checks take an unreadable file for a foreign one: say what is wrong instead
        with open(path, "rb"):
            pass
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None
    if is_gguf(path):
        return GGUFSource(path, hidden_act, check_ternary)
    if path.endswith(".safetensors"):
        return HFSource(os.path.dirname(os.path.abspath(path)), hidden_act, ternarize)
    raise FormatError(f"{path}: not a GGUF file, a BitNet store or a Hugging Face model directory")
