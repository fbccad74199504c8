"""BitNet b1.58 in torch for training (quantization-aware) and as the reference for the export test.

Same math as transformers' BitNetForCausalLM: RMSNorm, half-split RoPE, GQA,
attn_sub_norm before o_proj, relu² gated MLP, ffn_sub_norm before down_proj, tied embeddings.
Every linear is a BitLinear: absmean ternary weights and per-token int8 absmax activations in the
forward pass, straight-through estimator (identity gradient) in the backward pass. The master weights
stay f32; what the forward pass sees is exactly what export.py writes (the weight scale is rounded to
bf16, the format of `weight_scale` in the 2B-4T checkpoint), so the exported model reproduces it.

Training-only: the engine never imports torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyConfig:
    vocab_size: int = 3072
    hidden_size: int = 256
    intermediate_size: int = 768
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


def weight_ternary(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_t in {-1,0,1}, scale) with scale = max(mean|W|, 1e-5) rounded to bf16 (what is stored)."""
    scale = w.abs().mean().clamp(min=1e-5).to(torch.bfloat16).float()
    return (w / scale).round().clamp(-1, 1), scale


def act_quant_int(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 absmax quantization: (x_q as float integers, s_x). Round half to even (torch.round)."""
    s = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * s).round().clamp(-128, 127), s


# How training computes the bf16 products (operands bf16, f32 accumulation, result rounded to bf16):
# "native": bf16 matmuls (fast on CPUs with AVX512-BF16/AMX; ~40x slower than f32 on CPUs without, e.g.
# an AMD EPYC without avx512_bf16); "f32": the same products as f32 matmuls of the bf16-rounded operands,
# rounded to bf16 afterwards. The forward products are exact integers (|x_q| <= 128, W_t in {-1,0,1},
# sums < 2^24), so both modes give the same forward; backward sums differ only in f32 accumulation order.
# Phase 9 of train.py uses "f32" (set_bf16_products), so it reproduces on any CPU.
BF16_PRODUCTS = "native"


def set_bf16_products(mode: str) -> None:
    global BF16_PRODUCTS
    if mode not in ("native", "f32"):
        raise ValueError(f"bf16 products mode {mode!r}: 'native' or 'f32'")
    BF16_PRODUCTS = mode


def _mm_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 operands, result rounded to bf16 and returned as f32 (see BF16_PRODUCTS)."""
    if BF16_PRODUCTS == "f32":
        return (a.float() @ b.float()).to(torch.bfloat16).float()
    return (a @ b).float()


class _BitLinearTrain(torch.autograd.Function):
    """Training matmul: integer-valued operands in bf16 (exact: |x_q| <= 128, W_t in {-1,0,1}), about 4x
    faster than f32 on this CPU (AVX512-BF16). Only the product is rounded to bf16 (mixed precision, as
    usual); the eval path is exact f32. Backward is the straight-through estimator:
    dL/dx = dL/dy . (W_t * scale), dL/dW = dL/dy^T . x_dequant."""

    @staticmethod
    def forward(ctx, x, w):
        wt, ws = weight_ternary(w)
        xq, sx = act_quant_int(x)
        wt_b, xq_b = wt.to(torch.bfloat16), xq.to(torch.bfloat16)
        ctx.save_for_backward(xq_b, sx, wt_b, ws)
        return _mm_bf16(xq_b, wt_b.t()) / sx * ws

    @staticmethod
    def backward(ctx, gy):
        xq_b, sx, wt_b, ws = ctx.saved_tensors
        gx = _mm_bf16(gy.to(torch.bfloat16), wt_b) * ws
        gys = (gy / sx).to(torch.bfloat16)
        gw = _mm_bf16(gys.reshape(-1, gys.shape[-1]).t(), xq_b.reshape(-1, xq_b.shape[-1]))
        return gx, gw


class BitLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return _BitLinearTrain.apply(x, self.weight)
        # exact f32 path, in the engine's order of operations: (W_t . x_q) / s_x * weight_scale
        wt, ws = weight_ternary(self.weight)
        xq, sx = act_quant_int(x)
        return F.linear(xq, wt) / sx * ws


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg: TinyConfig, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    t = torch.arange(n, dtype=torch.float32, device=device)
    f = torch.outer(t, inv_freq)
    emb = torch.cat([f, f], dim=-1)          # half-split convention: the same angle for i and i + d/2
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = BitLinear(d, cfg.n_heads * hd)
        self.k_proj = BitLinear(d, cfg.n_kv_heads * hd)
        self.v_proj = BitLinear(d, cfg.n_kv_heads * hd)
        self.o_proj = BitLinear(cfg.n_heads * hd, d)
        self.attn_sub_norm = RMSNorm(cfg.n_heads * hd, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        g = cfg.n_heads // cfg.n_kv_heads
        k = k.repeat_interleave(g, dim=1)   # kv head j serves q heads j*g .. j*g+g-1
        v = v.repeat_interleave(g, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, t, cfg.n_heads * cfg.head_dim)
        return self.o_proj(self.attn_sub_norm(a))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.gate_proj = BitLinear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = BitLinear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = BitLinear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_sub_norm = RMSNorm(cfg.intermediate_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        f = F.relu(self.gate_proj(h)).square() * self.up_proj(h)
        return self.down_proj(self.ffn_sub_norm(f))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyBitNet(nn.Module):
    """Parameter names follow the HF checkpoint minus the `model.` prefix (export adds it)."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, std)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.data.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V] (f32)."""
        t = ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed_tokens(ids)
        for blk in self.layers:
            x = blk(x, cos, sin)
        return F.linear(self.norm(x), self.embed_tokens.weight)

    @torch.no_grad()
    def round_to_export_precision(self):
        """Round embeddings and norms to bf16 in place: the model then computes exactly what is exported."""
        for name, p in self.named_parameters():
            if not isinstance(self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self, BitLinear):
                p.copy_(p.to(torch.bfloat16).float())

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int, stop: tuple[int, ...] = ()) -> list[int]:
        """Greedy continuation by full recomputation (a reference, not fast)."""
        out = list(ids)
        for _ in range(n):
            ctx = out[-self.cfg.max_position_embeddings:]
            nxt = int(self(torch.tensor([ctx]))[0, -1].argmax())
            out.append(nxt)
            if nxt in stop:
                break
        return out[len(ids):]
