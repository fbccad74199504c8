"""The group-quantized LM head ("q4g_tile16"): layout round trip, the kernel's exact int32 dots and f32 outputs on
every ISA path against a numpy oracle (M = 1..8 rows, odd shapes, xq = -128), conversion with --lm-head q4,
and a q4 model whose prefill equals step-by-step decode and whose verify rows equal decode.

Its best RESCORE_K candidates are recomputed from f16 rows (ops.head_rescore): those logits must equal the f16
head's bit for bit on every path, in decode, verify and the batching engine, for tied and untied heads."""
import numpy as np
import pytest

from bitnet_cpu.simd import layout
from bitnet_cpu.simd import _ops as ops
from bitnet_cpu.engine.api import SamplingParams, load_model
from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.formats.describe import describe, head_line as describe_head
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.runtime.model import RESCORE_K, Model
from bitnet_cpu.engine.synth import SynthModel, write_hf_dir
from bitnet_cpu.engine.runtime.speculative import OFF, LookupParams
from bitnet_cpu.simd import _kernels as K
from test_kernels import ISAS, quantized
from test_model_fixtures import make_synth


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
    for m in (1, 2, 3, 5, 7, K.ROWS_MAX):   # every register block of the 4-row bodies: 1-4 rows after 4s
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


# ---------------------------------------------------------------- exact rescoring of the best candidates
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("v,d,k,m", [(40, 3, 5, 1), (300, 100, 64, 3), (1000, 2560, 64, 2), (77, 37, 13, 9),
                                     (10, 16, 64, 1)])
def test_head_rescore_gives_the_f16_head_floats(isa, v, d, k, m):
    rng = np.random.default_rng(v + d + k)
    table = rng.standard_normal((v, d)).astype(np.float16)
    table[0, 0] = np.float16(6e-8)  # a subnormal half
    x = rng.standard_normal((m, d)).astype(np.float32)
    exact = np.empty((m, v), np.float32)
    packed = layout.pack_f16(table)
    for r in range(m):
        K.gemv_f16(packed, x[r], exact[r])
    approx = (exact + rng.standard_normal((m, v)).astype(np.float32) * 0.5).astype(np.float32)
    approx[0, 3] = np.nan  # never a candidate
    logits = approx.copy()
    heap, idx = np.zeros((m, k), np.float32), np.zeros((m, k), np.int32)
    ops.head_rescore(table.view(np.uint16), x, logits, heap, idx)
    for r in range(m):
        finite = np.flatnonzero(~np.isnan(approx[r]))
        want = finite[np.argsort(-approx[r, finite], kind="stable")[: min(k, finite.size)]]
        got = idx[r][idx[r] >= 0]
        assert sorted(got.tolist()) == sorted(want.tolist())
        assert np.all(idx[r][got.size:] == -1)
        assert np.array_equal(logits[r, got].view(np.int32), exact[r, got].view(np.int32))  # bit for bit
        rest = np.setdiff1d(np.arange(v), got)
        assert np.array_equal(logits[r, rest].view(np.int32), approx[r, rest].view(np.int32))  # untouched


def test_head_rescore_checks_arguments():
    t = np.zeros((10, 8), np.uint16)
    x = np.zeros((2, 8), np.float32)
    lg, hp, ix = np.zeros((2, 10), np.float32), np.zeros((2, 4), np.float32), np.zeros((2, 4), np.int32)
    with pytest.raises(KernelError, match="table rows"):
        ops.head_rescore(t[:, :7].copy(), x, lg, hp, ix)
    with pytest.raises(KernelError, match="table has"):
        ops.head_rescore(t, x, np.zeros((2, 11), np.float32), hp, ix)
    with pytest.raises(KernelError, match="cover"):
        ops.head_rescore(t, x, lg[:1], hp, ix)
    with pytest.raises(KernelError, match="heap_vals"):
        ops.head_rescore(t, x, lg, hp[:, :3].copy(), ix)


def _same_candidates(q4_logits, f16_logits, idx):
    idx = idx[idx >= 0]
    assert idx.size == min(RESCORE_K, q4_logits.size)
    assert np.array_equal(q4_logits[idx].view(np.int32), f16_logits[idx].view(np.int32))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_q4_head_candidates_carry_f16_logits_and_greedy_matches(isa, q4_store):
    """Tied head: rescored from token_embd. Decode and verify rows give the f16 head's floats at the candidates,
    and greedy decoding picks the f16 head's tokens."""
    q = load_model(q4_store["q4"], ctx=96, progress=False)
    f = load_model(q4_store["f16"], ctx=96, progress=False)
    assert q.model.weights.rescore is q.model.weights.embd
    assert "exact logits from token_embd (tied)" in describe_head(q.model.store)
    ids = [1, 7, 3, 9, 12, 5, 40, 2, 2, 8]
    for t in ids:
        _same_candidates(q.model.decode(t), f.model.decode(t), q.model._resc_idx[0])
    rows = q.model.verify([4, 6, 8]).copy()
    frows = f.model.verify([4, 6, 8])
    for r in range(3):
        _same_candidates(rows[r], frows[r], q.model._resc_idx[r])
    out = []
    for llm in (q, f):
        llm.reset()
        out.append([c.token for c in llm.generate(ids, SamplingParams(temperature=0), max_tokens=40)
                    if c.token is not None])
    assert out[0] == out[1]


def test_untied_q4_head_stores_f16_rows(tmp_path):
    m = SynthModel({"head_dim": 64}, seed=4, style="llama")
    d = str(tmp_path / "llama")
    write_hf_dir(m, d)
    q4, f16 = (convert(d, str(tmp_path / f"{h}.bnstore"), lm_head=h, progress=False) for h in ("q4", "f16"))
    st = Store(q4)
    assert not st.config.tie_word_embeddings and "output.rows" in st.tensor_names
    mq, mf = Model(st, n_ctx=32), Model(Store(f16), n_ctx=32)
    assert mq.weights.rescore is not None and mq.weights.rescore is not mq.weights.embd
    for t in (1, 5, 9, 30, 2):
        _same_candidates(mq.decode(t), mf.decode(t), mq._resc_idx[0])
    lines = {h: [ln for ln in describe(p) if ln.startswith("lm head:")] for h, p in (("q4", q4), ("f16", f16))}
    assert "exact logits from output.rows" in lines["q4"][0] and "f16 (the reference" in lines["f16"][0]


def test_default_head_is_q4_within_its_kernel_bound():
    from types import SimpleNamespace

    from bitnet_cpu.engine.formats.convert import default_lm_head

    assert default_lm_head(SimpleNamespace(hidden_size=2560)) == "q4"
    assert default_lm_head(SimpleNamespace(hidden_size=layout.Q4G_MAX_K)) == "q4"
    assert default_lm_head(SimpleNamespace(hidden_size=layout.Q4G_MAX_K + 4)) == "i8"   # beyond the int32 bound


@pytest.mark.parametrize("name,edit", [("output", "halve"), ("output.gscale", "halve"), ("output.scale", "halve"),
                                       ("output", "int8")])
def test_a_q4_head_of_the_wrong_size_or_dtype_is_refused_at_load(q4_store, tmp_path, name, edit):
    """An index edited with its checksum made right again (any tool that rewrites a store): the kernel's sizes
    are checked at load, so the damage is a one-line FormatError there, not an internal error at each request."""
    import hashlib
    import json

    from bitnet_cpu.engine.errors import FormatError
    from bitnet_cpu.engine.formats.store import _HEADER

    data = bytearray(open(q4_store["q4"], "rb").read())
    magic, ver, res, ioff, isize, doff, _ = _HEADER.unpack_from(data)
    index = json.loads(data[ioff:ioff + isize])
    e = index["tensors"][name]
    if edit == "halve":
        e["shape"][0] //= 2
        e["nbytes"] //= 2
    else:
        e["dtype"] = "int8"
    raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    out = data[:ioff] + raw
    out[:_HEADER.size] = _HEADER.pack(magic, ver, res, ioff, len(raw), doff, hashlib.sha256(raw).digest())
    p = tmp_path / "bad.bnstore"
    p.write_bytes(bytes(out))
    with pytest.raises(FormatError, match=f"tensor {name} has dtype"):
        Model(Store(str(p)), n_ctx=32)
