"""bf16 prefill attention (opt-in: simd set_attention_precision("bf16"), BITNET_ATTENTION, bitnet
--prefill-attention): the rows of a prompt chunk take q, k, the softmax weights and v rounded to bf16 and
multiplied in pairs with f32 sums (vdpbf16ps where the CPU has AVX512_BF16, the same arithmetic in scalar C
elsewhere; on the AMX-BF16 tiles, tdpbf16ps, 16 rows a pass, where the tile mode is amx, or their emulation);
decode rows and the int8 cache never do.

Stated tolerance, against the f32 attention of the same rows: the largest difference at most 2^-5 of the
output's largest magnitude and the mean one at most 2^-9 of it (bf16 keeps 8 significant bits: q . k over
head_dim products and a softmax of sharpened rows; measured 0.7-0.9% and ~0.05-0.1%). A broken pairing or
layout is off by the output's own size (measured 150%), far outside it. Shapes as tests/test_attention_paths.py:
head sizes not a multiple of 64 (80) and small (16), GQA groups, rows past 256 positions (pieces folded in
order), a partial last block, contiguous and paged."""
import subprocess
import sys

import numpy as np
import pytest

import bitnet_cpu.simd._kernels as K
import bitnet_cpu.simd._ops as ops
from test_attention_paths import CHUNKS, _contiguous, _contiguous_q8, _inputs, _paged

SHAPES = [(8, 2, 128), (4, 2, 16), (6, 2, 64), (4, 1, 80)]   # heads, KV heads, head_dim (multiples of 16)
TILE_SHAPES = [(8, 2, 128), (6, 2, 64)]   # the tile passes take head_dim in steps of 32
CPU_HAS_AMX_BF16 = K.features().get("amx-bf16") and K.tiles_reason().endswith("granted by Linux")
PATHS = [None] + [p for p in K.supported_isas() if p in ("scalar", "avx2", "avx512")]
N_DECODE = sum(1 for m in CHUNKS if m == 1)


def _bf16(fn, *args):
    ops.set_attention_precision("bf16")
    try:
        return fn(*args)
    finally:
        ops.set_attention_precision("f32")


def _within_bf16(out, ref, what):
    scale = float(np.abs(ref).max())
    d = np.abs(out - ref)
    assert np.all(np.isfinite(out)), what
    assert d.max() <= scale / 32 and d.mean() <= scale / 512, (
        f"{what}: max |diff| {d.max():.3g}, mean {d.mean():.3g} against an output of {scale:.3g}")


@pytest.mark.parametrize("kv_dtype", [np.float32, np.uint16], ids=["f32", "f16"])
@pytest.mark.parametrize("nh,nkv,hd", SHAPES)
def test_prefill_rows_within_bf16_rounding_of_f32(kv_dtype, nh, nkv, hd):
    qkv, cos, sin = _inputs(nh, nkv, hd, seed=hd + nh)
    ref, ref_k, ref_v = _contiguous(None, kv_dtype, nh, nkv, hd, qkv, cos, sin)
    prefill, decode = slice(0, len(qkv) - N_DECODE), slice(len(qkv) - N_DECODE, None)
    for isa in PATHS:
        out, kc, vc = _bf16(_contiguous, isa, kv_dtype, nh, nkv, hd, qkv, cos, sin)
        # the caches are written as before; only the products of prompt rows change
        assert kc.tobytes() == ref_k.tobytes() and vc.tobytes() == ref_v.tobytes(), isa
        assert out[decode].tobytes() == ref[decode].tobytes(), f"{isa}: decode rows changed"
        assert out[prefill].tobytes() != ref[prefill].tobytes(), f"{isa}: the bf16 switch changed nothing"
        _within_bf16(out[prefill], ref[prefill], f"{isa or 'auto'} {nh}/{nkv}x{hd}")
        paged = _bf16(_paged, isa, kv_dtype, nh, nkv, hd, qkv, cos, sin)
        assert paged.tobytes() == out.tobytes(), f"{isa}: paged rows differ from the contiguous ones"


@pytest.mark.parametrize("tiles", ["emu", "amx"])
@pytest.mark.parametrize("nh,nkv,hd", TILE_SHAPES)
def test_tile_passes_within_bf16_rounding_of_f32(nh, nkv, hd, tiles):
    """Prompt chunks of 16+ rows on the tiles (tdpbf16ps, 16 rows of one head a pass; the chunks of 64 and 162 rows
    here), the emulation on every path, the hardware where the CPU has AMX-BF16: within the same tolerance of f32,
    within a bf16 rounding of the 4-row vector passes (the tiles add each pair low half first, vdpbf16ps high half
    first, so a weight may round the other way), decode rows and paged as above."""
    if tiles == "amx" and not CPU_HAS_AMX_BF16:
        pytest.skip("no AMX-BF16 tiles granted here (" + K.tiles_reason() + "): the emulated tile passes ran")
    qkv, cos, sin = _inputs(nh, nkv, hd, seed=hd + nh)
    ref, _, _ = _contiguous(None, np.uint16, nh, nkv, hd, qkv, cos, sin)
    # the 4-row vector passes: on an AMX machine the automatic path is amx, whose prompt rows take the tile passes
    four, _, _ = _bf16(_contiguous, "avx512" if "amx" in K.supported_isas() else None, np.uint16, nh, nkv, hd, qkv,
                       cos, sin)
    prefill, decode = slice(0, len(qkv) - N_DECODE), slice(len(qkv) - N_DECODE, None)
    for isa in (["avx512"] if tiles == "amx" else PATHS):
        out, _, _ = _bf16(_contiguous, isa, np.uint16, nh, nkv, hd, qkv, cos, sin, tiles)
        assert out[decode].tobytes() == ref[decode].tobytes(), f"{isa}: decode rows changed"
        assert out.tobytes() != four.tobytes(), f"{isa}: the tile passes did not run"
        _within_bf16(out[prefill], ref[prefill], f"{tiles} tiles on {isa or 'auto'} {nh}/{nkv}x{hd}")
        assert np.abs(out - four).max() <= np.abs(ref).max() / 256, isa   # within a bf16 rounding of each other
        paged = _bf16(_paged, isa, np.uint16, nh, nkv, hd, qkv, cos, sin, tiles)
        assert paged.tobytes() == out.tobytes(), f"{isa}: paged rows differ from the contiguous ones"


@pytest.mark.skipif(not ops.attention_bf16_vector(), reason="no AVX512_BF16 here: only the scalar bf16 bodies run, "
                                                            "checked against f32 above")
@pytest.mark.parametrize("nh,nkv,hd", SHAPES)
def test_vector_bodies_match_the_scalar_arithmetic(nh, nkv, hd):
    """vdpbf16ps against its definition in scalar C (pairs added hi then lo, products exact): a CPU's own
    denormal handling may move a last bit, so the bound is a few f32 ulps of the output, not bytes."""
    qkv, cos, sin = _inputs(nh, nkv, hd, seed=3 * hd + nh)
    vec, _, _ = _bf16(_contiguous, "avx512", np.uint16, nh, nkv, hd, qkv, cos, sin)
    ref, _, _ = _bf16(_contiguous, "scalar", np.uint16, nh, nkv, hd, qkv, cos, sin)
    assert np.abs(vec - ref).max() <= 1e-5 * np.abs(ref).max()


def test_the_int8_cache_is_not_affected():
    nh, nkv, hd = 8, 2, 128
    qkv, cos, sin = _inputs(nh, nkv, hd, seed=5)

    def run():
        return _contiguous_q8(nh, nkv, hd, qkv, cos, sin)

    assert _bf16(run).tobytes() == run().tobytes()


def test_the_setting():
    assert ops.attention_precision() == "f32"   # the default
    ops.set_attention_precision("bf16")
    try:
        assert ops.attention_precision() == "bf16"
    finally:
        ops.set_attention_precision("f32")
    with pytest.raises(K.KernelError, match="f32, bf16"):
        ops.set_attention_precision("fp8")
    assert ops.attention_precision() == "f32"


@pytest.mark.parametrize("value,ok", [("bf16", True), ("f32", True), ("fp16", False)])
def test_the_environment_variable(value, ok):
    code = "import bitnet_cpu.simd._ops as o; print(o.attention_precision())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "BITNET_ATTENTION": value})
    if ok:
        assert r.returncode == 0 and r.stdout.strip() == value, r.stderr
    else:
        assert r.returncode != 0 and f"BITNET_ATTENTION={value}: f32 or bf16" in r.stderr


def test_drafts_decode_in_f32_under_bf16_prefill():
    """bf16 products are for prompt rows: a verify pass (the last sampled token and prompt lookup's draft, or a
    grammar's forced tokens) decodes, so with bf16 on, drafting still changes nothing (every seed's text differed)."""
    from bitnet_cpu.engine.api import LookupParams, SamplingParams, load_model
    from bitnet_cpu.models.corpus import story
    import random

    llm = load_model(None, ctx=1024, threads=1, progress=False)
    try:
        text = story(random.Random(5))
        ids = llm.tokenize(text + "\n" + text[:400], add_bos=True)

        def run(draft_max, seed):
            llm.reset()
            chunks = list(llm.generate(ids, SamplingParams(temperature=1.0, seed=seed), max_tokens=80,
                                       ignore_eos=True, lookup=LookupParams(draft_max=draft_max)))
            return [c.token for c in chunks if c.token is not None], chunks[-1].stats

        ops.set_attention_precision("bf16")
        try:
            drafted = 0
            for seed in range(3):
                off, _ = run(0, seed)
                on, st = run(8, seed)
                assert on == off, seed
                drafted += st.n_drafted
            assert drafted > 0   # the drafts ran (else the comparison says nothing)
            assert ops.attention_precision() == "bf16"   # switched back after each verify pass
        finally:
            ops.set_attention_precision("f32")
    finally:
        llm.close()


def test_the_variable_on_a_cpu_without_the_bf16_bodies_warns():
    """BITNET_ATTENTION=bf16 where only the scalar bodies run (they are for tests): every command says prompts will
    be many times slower (12,039 -> 321 tok/s on the bundled model), where --prefill-attention bf16 is refused; where
    the vector bodies run, nothing is said."""
    from bitnet_cpu import simd
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-p", "hi", "-n", "1", "-t", "1"],
                       capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "BITNET_ATTENTION": "bf16"})
    assert r.returncode == 0, r.stderr
    warned = "BITNET_ATTENTION=bf16 on a CPU or kernel path without AVX512_BF16 bodies" in r.stderr
    assert warned == (not simd.attention_bf16_vector()), r.stderr
