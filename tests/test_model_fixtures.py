"""Helpers shared by the runtime tests (no tests here): synthetic models converted into stores, and the
transformers reference loaded in float32 (FORMATS.md §6)."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

# torch.compile on transformers' BitLinear helpers only costs compile time on CPU; results are the same
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@contextlib.contextmanager
def running_engine(path, **kw):
    """load_engine(path, progress=False, **kw), closed on leaving the block (also when a test fails in it)."""
    from bitnet_cpu.engine.api import load_engine

    eng = load_engine(path, progress=False, **kw)
    try:
        yield eng
    finally:
        eng.close()


def make_synth(tmp_dir, seed: int = 0, *, style: str = "bitnet", lm_heads=("f16",), **cfg):
    """Write a small random BitNet as an HF dir and convert it; returns (SynthModel, hf_dir, {lm_head: store})."""
    m = SynthModel(small_config(**cfg) if style == "bitnet" else cfg or None, seed=seed, style=style)
    hf_dir = os.path.join(str(tmp_dir), f"hf-{style}-{seed}-{'-'.join(f'{k}{v}' for k, v in sorted(cfg.items()))}")
    if not os.path.isdir(hf_dir):
        write_hf_dir(m, hf_dir)
    stores = {}
    for head in lm_heads:
        out = hf_dir + f".{head}.bnstore"
        stores[head] = out if os.path.exists(out) else convert(hf_dir, out, lm_head=head, progress=False)
    return m, hf_dir, stores


def reference_or_skip():
    """(torch, transformers) or skip with the reason: the parity tests need the numerical reference."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as e:
        pytest.skip(f"reference not installed ({e.name}): pip install torch transformers accelerate")
    if not hasattr(transformers, "BitNetForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no BitNetForCausalLM")
    transformers.logging.set_verbosity_error()
    return torch, transformers


def load_reference(hf_dir):
    """BitNetForCausalLM in float32: bf16 leftovers (embeddings, norms, scales) cast after loading."""
    torch, transformers = reference_or_skip()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()
    return model.eval()


def reference_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def reference_greedy(model, ids, n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy tokens through transformers' own KV-cache decode path; also the logits of every step."""
    import torch

    out_ids, steps = [], []
    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), use_cache=True)
        for _ in range(n):
            lg = out.logits[0, -1].float().numpy()
            steps.append(lg)
            t = int(lg.argmax())
            out_ids.append(t)
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids, steps


def our_greedy(model, ids, n: int) -> list[int]:
    model.reset()
    lg = model.prefill(ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(lg))
        out.append(t)
        lg = model.decode(t)
    return out


def assert_same_or_near_tie(ours: list[int], ref_ids: list[int], ref_steps, tolerance: float):
    """Greedy runs must be identical, or part only where the reference's top-2 logits are within `tolerance`
    (float summation order can flip a near tie; anything wider is a real divergence)."""
    if ours == ref_ids:
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, ref_ids)) if a != b)
    margin = ref_steps[i][ref_ids[i]] - ref_steps[i][ours[i]]
    assert margin <= tolerance, f"diverged at step {i} where the reference's margin is {margin:.3f}: {ours} vs {ref_ids}"
