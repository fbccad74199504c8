"""simd._ops: the runtime helper kernels of the transformer (C in simd/ops/, wrappers in simd/_ops.pxi):
fused residual add + RMSNorm + int8 activation quantization, the gated MLP activation, RoPE + KV-cache
write + causal GQA attention, f16 embedding lookup, top-k, exact rescoring of an approximate LM head's best.

They are compiled into simd._kernels (one C library): the ISA choice (set_isa, BITNET_ISA) and the worker
pool and its thread count are the kernels' own, so `active`, `set_isa`, `set_num_threads` and
`get_num_threads` here are simd._kernels' functions and govern both (there were once two dispatchers and two
thread layers, and they disagreed). This module only gives the helpers their own name.
"""
from ._kernels import (  # noqa: F401
    ACT_RELU2,
    ACT_SILU,
    ATTENTION_PRECISIONS,
    ATTENTION_SCRATCH_ROWS,
    KEY_BLOCK,
    Q8_MAX_HEAD_DIM,
    active,
    add_rmsnorm,
    add_rmsnorm_quant,
    attention,
    attention_bf16_vector,
    attention_precision,
    attention_paged,
    attention_paged_q8,
    attention_plan,
    attention_q8,
    embed_f16,
    get_num_threads,
    glu_rmsnorm,
    glu_rmsnorm_quant,
    head_rescore,
    head_rmsnorm,
    key_cache_shape,
    q8_block_bytes,
    q8_cache_shape,
    set_attention_precision,
    paged_key_pool_shape,
    paged_q8_pool_shape,
    paged_value_pool_shape,
    set_isa,
    set_num_threads,
    topk,
)
