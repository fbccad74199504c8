"""The group-quantized LM head ("q4g_tile16"): layout round trip, the kernel's exact int32 dots and f32 outputs on
every ISA path against a numpy oracle (M = 1..8 rows, odd shapes, xq = -128), conversion with --lm-head q4,
and a q4 model whose prefill equals step-by-step decode and whose verify rows equal decode."""
import numpy as np
import pytest

from bitnet_cpu.simd import layout
from bitnet_cpu.engine.api import SamplingParams, load_model
from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.engine.runtime.speculative import OFF, LookupParams
from bitnet_cpu.simd import _kernels as K
from test_kernels import ISAS, quantized
from test_model_fixtures import make_synth


@pytest.fixture
def isa(request):
    K.set_isa(request.param)
    yield request.param
    K.set_isa(None)
    K.set_num_threads(0)


def test_q4g_layout_round_trip_and_error_bound():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 100)).astype(np.float32)
    q, s, d = layout.quantize_rows_q4g(w)
    assert q.shape == (37, 128) and s.shape == (37, 4) and q.min() >= -8 and q.max() <= 7 and s.max() <= 63
    assert np.array_equal(layout.unpack_q4g(layout.pack_q4g(q), 37, 128), q)
    deq = layout.dequantize_q4g(q, s, d)
    assert np.all(deq[:, 100:] == 0)
    wp = np.zeros((37, 128), np.float32)
    wp[:, :100] = w
    amax = np.abs(wp).reshape(37, 4, 32).max(axis=2).repeat(32, axis=1)
    # rounding (half a step) or clipping by the searched step (at most amax * (1 - 1/1.3)), plus the 6-bit
    # rounding of the group scale
    assert np.all(np.abs(deq - wp) <= 0.25 * amax + 1e-6)
    assert np.mean((deq - wp) ** 2) < np.mean(wp ** 2) / 100


def oracle(q, s, d, xq, sc):
    n, m = q.shape[0], xq.shape[0]
    dots = np.einsum("ngc,mgc->mn", q.reshape(n, -1, 32).astype(np.int64) * s[:, :, None].astype(np.int64),
                     xq.reshape(m, -1, 32).astype(np.int64))
    dots = dots.astype(np.int32)
    return dots, (dots.astype(np.float32) / sc[:, None]) * d[None, :]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", [(1, 4), (37, 100), (250, 68), (300, 2560), (33, 8192)])
def test_gemv_q4g_exact_on_every_path(isa, n, k):
    rng = np.random.default_rng(n + k)
    w = (rng.standard_normal((n, k)) * rng.random((n, 1)) * 4).astype(np.float32)
    w[:, : min(k, 32)] = 0  # an all-zero group (scale 0)
    q, s, d = layout.quantize_rows_q4g(w)
    codes, gs = layout.pack_q4g(q), layout.pack_q4g_scales(s)
    dd = np.zeros(layout.pad_to(n, 16), np.float32)
    dd[:n] = d
    for m in (1, 2, 5, K.ROWS_MAX):
        _, xq, sc, _ = quantized(rng, m, k)
        xq[0, : min(k, 9)] = -128
        xq[-1, -3:] = 127
        dots, ref = oracle(q, s, d, xq, sc)
        raw = np.zeros((m, n), np.int32)
        K.gemv_q4g_i32(codes, gs, xq, raw)
        assert np.array_equal(raw, dots)
        out = np.full((m, n), np.nan, np.float32)
        K.gemv_q4g(codes, gs, dd, xq, sc, out)
        assert np.array_equal(out.view(np.int32), ref.view(np.int32))


def test_gemv_q4g_checks_arguments():
    q, s, d = layout.quantize_rows_q4g(np.ones((16, 64), np.float32))
    codes, gs = layout.pack_q4g(q), layout.pack_q4g_scales(s)
    xq = np.zeros((1, 64), np.int8)
    with pytest.raises(KernelError, match="codes"):
        K.gemv_q4g(codes[:-1], gs, d, xq, np.ones(1, np.float32), np.empty((1, 16), np.float32))
    with pytest.raises(KernelError, match="gscale"):
        K.gemv_q4g(codes, gs[:-1], d, xq, np.ones(1, np.float32), np.empty((1, 16), np.float32))
    with pytest.raises(KernelError, match="K_pad"):
        K.gemv_q4g_i32(np.zeros(16 * 8256 // 2, np.uint8), np.zeros(16 * 8256 // 32, np.uint8),
                       np.zeros((1, 8256), np.int8), np.empty((1, 16), np.int32))


@pytest.fixture(scope="module")
def q4_store(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("q4"), seed=9, lm_heads=("q4", "f16"))[2]


def test_q4_model_prefill_equals_decode_and_tracks_f16(q4_store):
    llm = load_model(q4_store["q4"], ctx=64, progress=False)
    m = llm.model
    assert m.lm_head == "q4"
    ids = [1, 7, 3, 9, 12, 5, 40, 2, 2, 8]
    full = m.forward(ids)
    m.reset()
    for i, t in enumerate(ids):
        assert np.array_equal(m.decode(t), full[i])
    m.truncate(3)
    rows = m.verify(ids[3:8]).copy()
    assert np.array_equal(rows, full[3:8])
    # close to the f16 head's logits (a 4-bit head: loose bound, exact agreement is measured in bench/)
    f16 = load_model(q4_store["f16"], ctx=64, progress=False).forward(ids)
    assert np.corrcoef(full.ravel(), f16.ravel())[0, 1] > 0.95


def test_q4_model_same_tokens_with_lookup(q4_store):
    llm = load_model(q4_store["q4"], ctx=128, progress=False)
    prompt = [1] + [5, 9, 13, 2] * 6
    out = []
    for lk in (OFF, LookupParams(draft_max=7, ngram_min=1)):
        llm.reset()
        out.append([c.token for c in llm.generate(prompt, SamplingParams(temperature=0), max_tokens=30, lookup=lk)
                    if c.token is not None])
    assert out[0] == out[1]
