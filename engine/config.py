"""ModelConfig: every dimension of a BitNet model, read from the file's metadata; nothing hard-coded. Also the
one chat form a model falls back to (BITNET_CHAT_TEMPLATE) and the one rule for when it must
(is_broken_chat_template): the converter stores it, the runtime renders with it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import FormatError


# Config keys a ModelConfig of an earlier bitnet-cpu had and this one no longer has: a store converted then holds
# them, and compat.check_runnable (which refuses a key it does not know as a newer writer's) lets them pass. A
# field removed from ModelConfig is added here.
RETIRED_CONFIG_KEYS = frozenset({"family"})


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int                 # D, e.g. 2560
    intermediate_size: int           # I, e.g. 6912
    n_layers: int                    # e.g. 30
    n_heads: int                     # query heads, e.g. 20
    n_kv_heads: int                  # key/value heads (GQA), e.g. 5
    head_dim: int                    # e.g. 128 (1bitLLM-3B: 100)
    vocab_size: int                  # e.g. 128256
    context_length: int = 4096       # max_position_embeddings
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    hidden_act: str = "relu2"        # "relu2" (2B-4T) or "silu" (1bitLLM llama-style)
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()   # stop on any of these (2B-4T: 128001 and 128009)
    sub_norms: bool = True           # attn_sub_norm / ffn_sub_norm before o_proj / down_proj (BitNet b1.58,
                                     # 1bitLLM); False for Llama-architecture ternary models (Falcon3, TriLM)
    rope_factors: tuple[float, ...] = ()  # LongRoPE (MiniCPM): every RoPE frequency divided by its factor
                                     # (head_dim/2 values); empty: plain RoPE
    rope_attn_factor: float = 1.0    # LongRoPE: cos and sin multiplied by this (q.k scaled by its square)
    weight_groups: int = 0           # 0: one scale per weight matrix, int8 activations per token (BitNet);
                                     # 128: one f16 scale per 128 weights of a row and int8 activations per
                                     # group of 128 (Ternary Bonsai, GGUF Q2_0; layout "tg128")
    qk_norm: bool = False            # RMSNorm over each head of q and k before RoPE (Qwen3)
    arch: str = "bitnet-b1.58"       # informational: where it came from
    name: str = ""                   # human name of the model

    def __post_init__(self):
        for f in ("hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "context_length"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0 or v > 1 << 24:
                raise FormatError(f"model config: {f}={v!r} is not a sane positive size")
        if self.n_heads % self.n_kv_heads:
            raise FormatError(f"model config: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.hidden_act not in ("relu2", "silu"):
            raise FormatError(f"model config: unknown hidden_act {self.hidden_act!r} (expected relu2 or silu)")
        for f, top in (("rms_norm_eps", 1.0), ("rope_theta", 1e30)):   # both are used as float32
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < top:
                raise FormatError(f"model config: {f}={v!r} must be a positive number below {top:g}")
        if not isinstance(self.rope_factors, tuple) or (self.rope_factors and len(self.rope_factors) != self.head_dim // 2):
            raise FormatError(f"model config: rope_factors must hold head_dim/2 = {self.head_dim // 2} values,"
                              f" got {len(self.rope_factors) if isinstance(self.rope_factors, tuple) else self.rope_factors!r}")
        for v in self.rope_factors + (self.rope_attn_factor,):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e30 or v != v:
                raise FormatError(f"model config: LongRoPE factor {v!r} must be a positive number")
        if self.weight_groups not in (0, 128):
            raise FormatError(f"model config: weight_groups={self.weight_groups!r} (expected 0 or 128)")
        if self.weight_groups:
            for f in ("hidden_size", "intermediate_size", "q_dim"):
                if getattr(self, f) % self.weight_groups:
                    raise FormatError(f"model config: {f}={getattr(self, f)} is not a multiple of the "
                                      f"{self.weight_groups}-weight scale groups")
        if not isinstance(self.qk_norm, bool):
            raise FormatError(f"model config: qk_norm={self.qk_norm!r} must be a boolean")
        ids = ((self.bos_token_id,) if self.bos_token_id is not None else ()) + tuple(self.eos_token_ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise FormatError(f"model config: special token id {t!r} is not in the vocabulary (0..{self.vocab_size - 1})")
        if not isinstance(self.tie_word_embeddings, bool) or not isinstance(self.arch, str) or not isinstance(self.name, str):
            raise FormatError("model config: tie_word_embeddings must be a boolean, arch and name strings")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_params(self) -> int:
        """Weights of the model (embeddings, the head unless tied, attention and MLP matrices; norms left out)."""
        d = self.hidden_size
        per_layer = d * self.q_dim * 2 + d * self.kv_dim * 2 + 3 * d * self.intermediate_size
        return self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + self.n_layers * per_layer

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rope_factors"] = list(self.rope_factors)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "eos_token_ids" in kw:
            if not isinstance(kw["eos_token_ids"], (list, tuple)):
                raise FormatError(f"model config: eos_token_ids={kw['eos_token_ids']!r} is not a list")
            kw["eos_token_ids"] = tuple(kw["eos_token_ids"])
        if "rope_factors" in kw:
            if not isinstance(kw["rope_factors"], (list, tuple)):
                raise FormatError(f"model config: rope_factors={kw['rope_factors']!r} is not a list")
            kw["rope_factors"] = tuple(kw["rope_factors"])
        try:
            return cls(**kw)
        except TypeError as e:
            raise FormatError(f"model config: {e}") from None


# The BitNet b1.58 2B-4T chat form: <|begin_of_text|>System: ...<|eot_id|>User: ...<|eot_id|>Assistant:
# with each content trimmed, as the model's own template (microsoft/bitnet-b1.58-2B-4T tokenizer_config) trims it
BITNET_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)
# the same form without the trim, as earlier conversions stored it: rendered as BITNET_CHAT_TEMPLATE
LEGACY_BITNET_CHAT_TEMPLATE = BITNET_CHAT_TEMPLATE.replace(" | trim }}", " }}")


def is_broken_chat_template(template: str | None) -> bool:
    """Missing or blank, or the official 2B-4T GGUF's wrong "Human: ... BITNETAssistant:" template (a template
    that merely contains "Human: " is the model's own and is kept)."""
    return not template or not template.strip() or "BITNETAssistant" in template
