"""Synthetic BitNet b1.58 models for tests and benchmarks: random ternary weights, written in every source
format the converter reads, from tiny (tests) up to the exact 2B-4T shape (benchmarks), streamed tensor by
tensor so memory stays around one tensor.

API
---
    m = SynthModel(config=None, *, seed=0, style="bitnet")
        config: an HF-style config dict (keys as in config.json: hidden_size, intermediate_size,
                num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, ...); missing keys
                come from `small_config()`. `bitnet_2b4t_config()` is the exact 2B-4T shape.
        style:  "bitnet"  -> BitNetForCausalLM (relu2, sub-norms attn_sub_norm / ffn_sub_norm, tied embeddings)
                "1bitllm" -> BitnetForCausalLM llama style (silu, inner_attn_ln / ffn_layernorm, lm_head)
                "llama"   -> LlamaForCausalLM ternary (Falcon3-1.58bit, Llama3-8B-1.58, Falcon-E, TriLM): silu,
                             no sub-norms, untied bf16 lm_head, explicit head_dim, rope_theta 1000042, eps 1e-6
    m.config                       HF config dict (what config.json gets)
    m.model_config()               engine.config.ModelConfig
    m.linears()                    [(hf_prefix, out, in)], e.g. ("model.layers.0.self_attn.q_proj", 64, 64)
    m.ternary(prefix)              int8 [out, in] in {-1, 0, +1}    (deterministic per seed and name)
    m.weight_scale(prefix)         float, the multiplying scale (bf16- and f16-exact)
    m.master(prefix)               f32 [out, in], bf16-exact full-precision master (the "online" checkpoint)
    m.embed(rows=None)             f32 [V, D] (or a row slice), bf16- and f16-exact
    m.norm(hf_name)                f32 norm weight, bf16-exact
    m.lm_head()                    f32 [V, D] untied output weight (1bitllm style)
    m.tokenizer_info()             bitnet: byte-level BPE tokenizer.json (LLaMA-3 style: bos/eos/eot specials,
                                   ignore_merges, trained on built-in text) + GGUF tokens/types/merges;
                                   1bitllm: SentencePiece model bytes + tokens/types/scores (LLaMA-2 style)
    m.tokenizer_json()             the tokenizer.json text (bitnet style)
    m.chat_template                the 2B-4T chat Jinja template

Writers (return the path written):
    write_hf_dir(m, dir, *, form="packed"|"online", linear_class="autobitlinear"|"bitlinear", shards=1,
                 embed_dtype="bf16"|"f32")
        packed: microsoft/bitnet-b1.58-2B-4T layout (uint8 [out/4, in] packed along the output dim in quarters
        + weight_scale bf16 [1]; "bitlinear" stores 1/scale because that class divides).
        online: bf16 master weights, quantization_config mode "online" (2B-4T-bf16 form); 1bitllm style is
        always written this way (f16 weights, no quantization_config, tokenizer.model, untied lm_head).
        The directory loads in transformers (AutoModelForCausalLM; needs accelerate), tested.
    write_gguf_tq(m, path, qtype="TQ2_0"|"TQ1_0", *, embed_type="F16", hidden_activation="relu2"|None,
                  scale_tensors=False, pre="llama-bpe", quantizer="gguf"|"fast")
        llama.cpp `bitnet` arch via gguf.GGUFWriter (streaming API) and gguf's quantizer (scale folded in d);
        quantizer="fast" packs TQ2_0 with numpy directly (identical bytes; tested), for 2B-sized files.
        Every ternary matrix's input dim must be a multiple of 256 (llama.cpp's block size).
        scale_tensors=True: the older form, d = 1 in the blocks and blk.N.*.scale tensors holding the scale.
        hidden_activation=None leaves out the bitnet.hidden_activation key (llama.cpp's default then is SiLU).
    write_gguf_i2s(m, path, *, arch="bitnet-b1.58", pre=None, broken_template=True)
        bitnet.cpp I2_S (type 36) written with our own GGUF writer (gguf does not know type 36); like the
        official file by default: no tokenizer.ggml.pre, the broken "Human:/BITNETAssistant:" template.
    i2s_pack(w_t, scale) -> bytes ; tq2_pack(w_t, scale) -> uint8 blocks
"""
from __future__ import annotations

import json
import zlib

import numpy as np

from ..config import ModelConfig

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)
# Falcon3-*-Instruct(-1.58bit)'s template (its tools branch left out)
FALCON3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{{- '<|system|>\n' + message['content'] + '\n' }}{%- elif message['role'] == 'user' %}"
    "{{- '<|user|>\n' + message['content'] + '\n' }}{%- elif message['role'] == 'assistant' %}"
    "{%- if not loop.last %}{{- '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{%- else %}{{- '<|assistant|>\n' + message['content'] + eos_token }}{%- endif %}{%- endif %}"
    "{%- if loop.last and add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}{%- endfor %}"
)
# Meta-Llama-3-8B-Instruct's template (HF1BitLLM/Llama3-8B-1.58-100B-tokens ships the Llama-3 tokenizer)
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TRAIN_TEXT = """Once upon a time, in a small village near the mountains, there lived a curious girl named Lily.
Every morning she walked to the river and watched the water run over the stones. "Where does the river go?"
she asked her grandmother. The old woman smiled and said, "To the sea, my dear, and from the sea to the sky,
and from the sky back to the mountains." Lily thought about this for a long time. One day she packed bread,
cheese and apples, and followed the river. She met a fox, a heron and a boy with a red boat. The boy said,
"I am going to the sea too. Come with me!" They sailed for three days and three nights. On the fourth day
they saw the sea: it was blue and green and grey, and it was bigger than anything Lily had ever seen.
User: How are you today? Assistant: I am fine, thank you. What can I do for you?
System: You are a helpful AI assistant. Answer the question in one sentence.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ! ? . , ; : ' "
Numbers: 1, 2, 3, 10, 42, 100, 2024, 3.14159. Code: def main(): return 0  # comment
Café, naïve, über,日本語, 中文, русский, emoji 🙂 -- unicode text must round trip byte for byte.
"""


def small_config(**overrides) -> dict:
    """A tiny HF config.json dict (dimensions sized for TQ's 256-blocks and the kernels' tiles)."""
    cfg = {
        "architectures": ["BitNetForCausalLM"], "model_type": "bitnet", "hidden_act": "relu2",
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def bitnet_2b4t_config() -> dict:
    return small_config(hidden_size=2560, intermediate_size=6912, num_hidden_layers=30, num_attention_heads=20,
                        num_key_value_heads=5, vocab_size=128256, max_position_embeddings=4096)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round f32 to the nearest bf16 (ties to even); returned as f32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    return r.view(np.float32)


def _exact_both(x: np.ndarray) -> np.ndarray:
    """bf16-round and flush values too small for f16 normals, so the value is exact in bf16 AND f16."""
    x = bf16_round(x)
    x[np.abs(x) < np.float32(2.0 ** -14)] = 0
    return x


# ternary value by random byte: ~30% -1, ~40% 0, ~30% +1
_TERNARY_LUT = np.where(np.arange(256) < 77, -1, np.where(np.arange(256) < 179, 0, 1)).astype(np.int8)
_EMBED_CHUNK = 4096


class SynthModel:
    def __init__(self, config: dict | None = None, *, seed: int = 0, style: str = "bitnet"):
        if style not in ("bitnet", "1bitllm", "llama"):
            raise ValueError(f"style must be 'bitnet', '1bitllm' or 'llama', not {style!r}")
        self.style = style
        base = small_config()
        if style == "1bitllm":
            base.update(architectures=["BitnetForCausalLM"], model_type="llama", hidden_act="silu",
                        tie_word_embeddings=False, rope_theta=10000.0, torch_dtype="float16")
        elif style == "llama":  # Falcon3-1.58bit's config.json, scaled down
            base.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                        tie_word_embeddings=False, rope_theta=1000042.0, rms_norm_eps=1e-6, head_dim=64,
                        mlp_bias=False, pretraining_tp=1, is_bitnet_config=True)
        base.update(config or {})
        self.config = base
        self.seed = int(seed)
        c = base
        self.D, self.I, self.L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        self.H, self.KV, self.V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
        self.head_dim = c.get("head_dim") or self.D // self.H
        self.chat_template = CHAT_TEMPLATE
        self._tok: dict | None = None
        for n, v in (("hidden", self.D), ("intermediate", self.I), ("q", self.H * self.head_dim),
                     ("kv", self.KV * self.head_dim)):
            if v % 4:
                raise ValueError(f"{n} dimension {v} is not a multiple of 4")

    # ---- weights -----------------------------------------------------------------------------------
    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def linears(self) -> list[tuple[str, int, int]]:
        q, kv, D, I = self.H * self.head_dim, self.KV * self.head_dim, self.D, self.I
        out = []
        for i in range(self.L):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            out += [(f"{a}.q_proj", q, D), (f"{a}.k_proj", kv, D), (f"{a}.v_proj", kv, D), (f"{a}.o_proj", D, q),
                    (f"{m}.gate_proj", I, D), (f"{m}.up_proj", I, D), (f"{m}.down_proj", D, I)]
        return out

    def _shape(self, prefix: str) -> tuple[int, int]:
        for p, o, i in self.linears():
            if p == prefix:
                return o, i
        raise KeyError(prefix)

    def ternary(self, prefix: str) -> np.ndarray:
        out, inp = self._shape(prefix)
        raw = np.frombuffer(self._rng(prefix + ".t").bytes(out * inp), dtype=np.uint8)
        return _TERNARY_LUT[raw].reshape(out, inp)

    def weight_scale(self, prefix: str) -> float:
        _, inp = self._shape(prefix)
        f = self._rng(prefix + ".s").uniform(0.5, 1.5)
        return float(_exact_both(np.array([f / np.sqrt(0.6 * inp)], np.float32))[0])

    def master(self, prefix: str) -> np.ndarray:
        """Full-precision weights for the online form (ternarized by the reference at load)."""
        out, inp = self._shape(prefix)
        w = self._rng(prefix + ".m").standard_normal((out, inp), dtype=np.float32)
        return bf16_round(w * np.float32(self.weight_scale(prefix)))

    def embed(self, rows: slice | None = None) -> np.ndarray:
        start, stop = (0, self.V) if rows is None else (rows.start or 0, min(rows.stop, self.V))
        parts = []
        c0 = start // _EMBED_CHUNK
        for c in range(c0, (stop + _EMBED_CHUNK - 1) // _EMBED_CHUNK):
            n = min(_EMBED_CHUNK, self.V - c * _EMBED_CHUNK)
            e = self._rng(f"embed.{c}").standard_normal((n, self.D), dtype=np.float32)
            parts.append(e * np.float32(2.0 / np.sqrt(self.D)))
        e = np.concatenate(parts) if len(parts) != 1 else parts[0]
        off = start - c0 * _EMBED_CHUNK
        return _exact_both(e[off: off + stop - start])

    def lm_head(self) -> np.ndarray:
        """Untied output weight (1bitllm style only)."""
        e = self._rng("lm_head").standard_normal((self.V, self.D), dtype=np.float32)
        return _exact_both(e * np.float32(2.0 / np.sqrt(self.D)))

    def norm(self, name: str) -> np.ndarray:
        size = self.I if "ffn_sub_norm" in name or "ffn_layernorm" in name else (
            self.H * self.head_dim if "attn_sub_norm" in name or "inner_attn_ln" in name else self.D)
        return _exact_both(1.0 + 0.1 * self._rng(name).standard_normal(size, dtype=np.float32))

    @property
    def sub_norms(self) -> bool:
        return self.style != "llama"

    def norm_names(self, i: int) -> dict[str, str]:
        """engine-side short name -> HF name, for layer i (no sub-norms in the llama style)."""
        if not self.sub_norms:
            p = f"model.layers.{i}"
            return {"attn_norm": f"{p}.input_layernorm.weight", "ffn_norm": f"{p}.post_attention_layernorm.weight"}
        a_sub = "inner_attn_ln" if self.style == "1bitllm" else "attn_sub_norm"
        f_sub = "ffn_layernorm" if self.style == "1bitllm" else "ffn_sub_norm"
        p = f"model.layers.{i}"
        return {"attn_norm": f"{p}.input_layernorm.weight", "ffn_norm": f"{p}.post_attention_layernorm.weight",
                "attn_sub_norm": f"{p}.self_attn.{a_sub}.weight", "ffn_sub_norm": f"{p}.mlp.{f_sub}.weight"}

    def model_config(self) -> ModelConfig:
        tok = self.tokenizer_info()
        return ModelConfig(
            hidden_size=self.D, intermediate_size=self.I, n_layers=self.L, n_heads=self.H, n_kv_heads=self.KV,
            head_dim=self.head_dim, vocab_size=self.V, context_length=self.config["max_position_embeddings"],
            rope_theta=float(self.config["rope_theta"]), rms_norm_eps=float(self.config["rms_norm_eps"]),
            hidden_act=self.config["hidden_act"], tie_word_embeddings=bool(self.config["tie_word_embeddings"]),
            bos_token_id=tok["bos"], eos_token_ids=tuple(x for x in (tok["eos"], tok["eot"]) if x is not None),
            sub_norms=self.sub_norms, arch="bitnet-b1.58", name="synth")

    # ---- tokenizer ---------------------------------------------------------------------------------
    def tokenizer_info(self) -> dict:
        """bitnet style: {"kind": "gpt2", "json": tokenizer.json text, "tokens", "types", "merges", bos, eos, eot};
        1bitllm style: {"kind": "llama", "model": SentencePiece model bytes, "tokens", "types", "scores", bos,
        eos, eot None} (LLaMA-2-like: byte fallback, <unk> 0, <s> 1, </s> 2; ids past the SentencePiece vocab
        are <pad>, </line>, <unused_k> as in 1bitLLM's 32000 + 2)."""
        if self._tok is None:
            self._tok = _build_sp_tokenizer(self.V) if self.style == "1bitllm" else _build_tokenizer(self.V)
        return self._tok

    def tokenizer_json(self) -> str:
        return self.tokenizer_info()["json"]


def _build_tokenizer(vocab_size: int) -> dict:
    """LLaMA-3-like byte-level BPE: trained tokens, unreachable fillers up to vocab_size - n_special, then the
    specials (<|begin_of_text|>, <|end_of_text|>, reserved..., <|eot_id|> at +9, ...), as LLaMA-3 orders them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_special = 256 if vocab_size >= 4096 else 16
    n_regular = vocab_size - n_special
    if n_regular < 256 + 16:
        raise ValueError(f"vocab_size {vocab_size} too small for a byte-level BPE (need >= {256 + 16 + n_special})")
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=min(n_regular, 256 + 400), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([TRAIN_TEXT] * 4, trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in trained["merges"]]
    for i in range(len(vocab), n_regular):
        vocab[f"<filler_{i}>"] = i
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
    specials += [f"<|reserved_special_token_{k}|>" for k in range(2, n_special - len(specials) + 2)]
    bos, eos, eot = n_regular, n_regular + 1, n_regular + 9
    final = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], ignore_merges=True))
    final.pre_tokenizer = pre
    final.decoder = decoders.ByteLevel()
    final.add_special_tokens(specials)
    final.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    tokens = [None] * vocab_size
    for t, i in vocab.items():
        tokens[i] = t
    for k, t in enumerate(specials):
        tokens[n_regular + k] = t
    assert final.get_vocab_size() == vocab_size and all(t is not None for t in tokens)
    types = [1] * n_regular + [3] * n_special
    return {"kind": "gpt2", "json": final.to_str(), "tokens": tokens, "types": types, "merges": merges,
            "bos": bos, "eos": eos, "eot": eot, "specials": specials}


def _build_sp_tokenizer(vocab_size: int) -> dict:
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT.splitlines() * 3), model_writer=buf, vocab_size=min(vocab_size, 480),
        model_type="bpe", byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, add_dummy_prefix=True, normalization_rule_name="identity", split_digits=True,
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    if n > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} too small for the SentencePiece model ({n} pieces)")
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    scores = [float(sp.get_score(i)) for i in range(n)]
    extra = ["<pad>", "</line>"] + [f"<unused_{k}>" for k in range(vocab_size - n - 2)]
    tokens += extra[: vocab_size - n]
    types += [4] * (vocab_size - n)
    scores += [0.0] * (vocab_size - n)
    return {"kind": "llama", "model": buf.getvalue(), "tokens": tokens, "types": types, "scores": scores,
            "bos": 1, "eos": 2, "eot": None}


from .writers import (  # noqa: E402,F401  (the writers own the file formats; synth re-exports them)
    BROKEN_GGUF_TEMPLATE, QWEN3_CHAT_TEMPLATE, bf16_bits, bonsai_weights, i2s_pack, q2_0_pack, tq2_pack,
    write_bonsai_dir, write_bonsai_gguf, write_gguf_i2s, write_gguf_tq, write_hf_dir)
