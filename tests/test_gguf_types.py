"""A GGUF of a ternary model in any tensor type loads (dequantize, check it is ternary, recover the scale) and
gives the same model as its TQ2_0 file; a GGUF whose weights are not ternary is refused in one line.

Files are made here: gguf's writer with its numpy quantizers (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0),
llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize) for the K-quants and IQ types.
Greedy continuations must equal the TQ2_0 file's, or part from it only at a near tie (the TQ2_0 model's own margin
between the two tokens at most NEAR_TIE, the bound tests/test_parity_hf.py uses): a scale blurred by the container
moves every logit a little."""
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.errors import FormatError, UnsupportedError
from bitnet_cpu.engine.formats.describe import describe
from bitnet_cpu.engine.runtime.model import Model
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.synth import TRAIN_TEXT, SynthModel, write_gguf_tq
from bitnet_cpu.engine.formats.ternary_check import MAX_OFF_SHARE, TOLERANCE, fit_ternary
from bitnet_cpu.engine.formats.tokenizer import Tokenizer
from test_model_fixtures import our_greedy

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test files (pip install '.[test]')")

NEAR_TIE = 0.45
EXACT = ("F32", "F16", "BF16")  # the ternary values are stored exactly: same store as TQ2_0, bit for bit


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(SynthModel, directory, TQ2_0 store, prompt ids)."""
    d = tmp_path_factory.mktemp("types")
    m = SynthModel(seed=13)
    path = write_gguf_tq(m, str(d / "m.TQ2_0.gguf"), "TQ2_0")
    store = convert(path, path + ".bnstore", lm_head="f16", progress=False)
    info = m.tokenizer_info()
    ids = Tokenizer("hf_json", m.tokenizer_json().encode(), bos_id=info["bos"]).encode(TRAIN_TEXT[:300], add_bos=True)
    return m, d, store, ids[:24]


def _same_model(ref_store, store, ids, exact, n=24):
    """Every ternary code equal; scales equal (exact) or within the blur; greedy equal or a near tie."""
    a, b = Store(ref_store), Store(store)
    for name in a.tensor_names:
        if a.info(name).get("layout") == "tile16":
            assert np.array_equal(a.tensor(name), b.tensor(name)), f"{name}: ternary codes differ"
            sa, sb = a.tensor(name + ".scale"), b.tensor(name + ".scale")
            if exact:
                assert np.array_equal(sa, sb), name
            else:
                assert np.allclose(sa, sb, rtol=0.08), (name, sa[:1], sb[:1])
    ma, mb = Model(a, n_ctx=96), Model(b, n_ctx=96)
    want, got = our_greedy(ma, ids, n), our_greedy(mb, ids, n)
    if exact:
        assert got == want
    elif got != want:
        i = next(i for i, (x, y) in enumerate(zip(want, got)) if x != y)
        lg = ma.forward(ids + want[:i])[-1]
        assert lg[want[i]] - lg[got[i]] <= NEAR_TIE, f"diverged at step {i} with margin {lg[want[i]] - lg[got[i]]:.3f}"


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "TQ1_0"])
def test_gguf_quantizer_types_load_as_the_tq2_model(ref, qtype):
    m, d, ref_store, ids = ref
    path = write_gguf_tq(m, str(d / f"m.{qtype}.gguf"), qtype)
    store = convert(path, path + ".bnstore", lm_head="f16", progress=False)
    _same_model(ref_store, store, ids, exact=qtype in EXACT or qtype == "TQ1_0")
    stats = Store(store).meta["ternary_stats"]
    if qtype != "TQ1_0":
        for name, s in stats.items():
            assert s["off"] == 0 and s["tol"] == TOLERANCE[qtype], name
            assert (s["blur"] == 0) == (qtype in EXACT + ("Q8_0",)), (name, s["blur"])


@pytest.mark.parametrize("qtype", ["F16", "Q4_0", "Q8_0"])
def test_non_ternary_gguf_is_refused_and_leaves_nothing(ref, qtype, tmp_path):
    m, _, _, _ = ref
    path = write_gguf_tq(m, str(tmp_path / f"gauss.{qtype}.gguf"), qtype, gaussian=True)
    out = str(tmp_path / "out" / "x.bnstore")
    with pytest.raises(UnsupportedError, match=r"'blk\.0\.attn_q\.weight' .*is not ternary: .*% .*llama\.cpp"):
        convert(path, out, progress=False)
    assert not os.path.exists(os.path.dirname(out)) or os.listdir(os.path.dirname(out)) == []
    # the CLI: one line on stderr, exit 2, no traceback
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", path, "-o", out], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "not ternary" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not os.path.exists(out)
    # inspect reports it instead of refusing
    text = "\n".join(describe(path))
    assert "NOT TERNARY" in text and "off " in text


def test_refusal_midway_leaves_no_store(ref, tmp_path):
    """Layer 0 ternary, layer 1 Gaussian: the refusal comes after tensors were written; the store must not exist."""
    m, _, _, _ = ref

    class Mixed(SynthModel):
        def master(self, prefix):
            return super().master(prefix) if ".1." in prefix else self.ternary(prefix) * np.float32(
                self.weight_scale(prefix))

    mixed = Mixed(seed=13)
    path = write_gguf_tq(mixed, str(tmp_path / "mixed.gguf"), "F16", gaussian=True)
    with pytest.raises(UnsupportedError, match=r"blk\.1\."):
        convert(path, str(tmp_path / "mixed.bnstore"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["mixed.gguf"]


def test_inspect_reports_the_check(ref):
    m, d, _, _ = ref
    for qtype, kind in (("F16", "scale exact"), ("Q4_0", "scale best effort")):
        path = str(d / f"m.{qtype}.gguf")
        if not os.path.exists(path):
            write_gguf_tq(m, path, qtype)
        lines = [ln for ln in describe(path) if ln.startswith("  blk.0.attn_q ")]
        assert len(lines) == 1 and "off 0.00%" in lines[0] and kind in lines[0], lines


# ---- the fit itself ---------------------------------------------------------------------------------------
def test_fit_exact_and_blurred_and_gaussian():
    rng = np.random.default_rng(0)
    codes = rng.integers(-1, 2, (64, 256)).astype(np.int8)
    s = np.float32(0.0371)
    fit = fit_ternary(codes * s, "F16")
    assert np.array_equal(fit.codes, codes) and fit.scale == float(s) and fit.blur == 0 and fit.ok
    # Q4_0-like: one sign at 7/8 of the scale
    w = np.where(codes > 0, s, np.float32(-0.875) * s) * (codes != 0)
    fit = fit_ternary(w.astype(np.float32), "Q4_0")
    assert np.array_equal(fit.codes, codes) and fit.ok and 0.06 < fit.blur < 0.07
    assert abs(fit.scale / s - 0.9375) < 0.01
    # a Gaussian weight is far from ternary in every type's tolerance
    g = rng.standard_normal((64, 256)).astype(np.float32)
    for t in TOLERANCE:
        assert fit_ternary(g, t).off_share > 10 * MAX_OFF_SHARE, t
    z = fit_ternary(np.zeros((4, 32), np.float32), "Q8_0")
    assert z.ok and not z.codes.any()
    with pytest.raises(FormatError, match="NaN"):
        fit_ternary(np.full((2, 32), np.nan, np.float32), "F16")


# ---- K-quants and IQ types, through llama.cpp's own quantizer ---------------------------------------------
# llama.cpp file types (enum llama_ftype). IQ3_XXS, IQ2_* and IQ1_* need an importance matrix, which the C API
# takes only as a C++ map (llama.cpp: "this quantization requires an importance matrix!"), so they are not made here.
LLAMA_FTYPES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q3_K_S": 11, "Q4_K_S": 14,
                "Q5_K_S": 16, "IQ3_M": 27, "IQ3_S": 26, "IQ4_NL": 25, "IQ4_XS": 30}


def _llama_quantize(src, dst, ftype):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (bash bench/setup_llama.sh)")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
    if rc != 0:
        pytest.fail(f"llama_model_quantize returned {rc} for ftype {ftype}")
    return dst


@pytest.mark.parametrize("name", list(LLAMA_FTYPES))
def test_llama_cpp_quantized_types_load_as_the_tq2_model(ref, name):
    m, d, ref_store, ids = ref
    src = str(d / "m.F32.gguf")
    if not os.path.exists(src):
        write_gguf_tq(m, src, "F32")
    path = _llama_quantize(src, str(d / f"m.{name}.gguf"), LLAMA_FTYPES[name])
    store = convert(path, path + ".bnstore", lm_head="f16", progress=False)
    types = {t.type_name for t in __import__("bitnet_cpu.engine.formats.gguf", fromlist=["GGUFFile"]).GGUFFile(path).tensors.values()}
    base = name.split("_")[0] if name.startswith("IQ") else name[:4].rstrip("_")
    assert any(t.startswith(base) for t in types), (name, types)
    _same_model(ref_store, store, ids, exact=False)
    for tname, s in Store(store).meta["ternary_stats"].items():
        assert s["off"] <= (MAX_OFF_SHARE if name.startswith("IQ3") else 0), (tname, s)


@pytest.mark.parametrize("name", ["Q4_K_M", "Q2_K", "IQ4_XS"])
def test_llama_cpp_quantized_gaussian_is_refused(ref, name, tmp_path):
    """An ordinary (non-ternary) model quantized by llama.cpp: refused, nothing written."""
    m, _, _, _ = ref
    src = write_gguf_tq(m, str(tmp_path / "gauss.F32.gguf"), "F32", gaussian=True)
    path = _llama_quantize(src, str(tmp_path / f"gauss.{name}.gguf"), LLAMA_FTYPES[name])
    with pytest.raises(UnsupportedError, match=r"is not ternary: .*llama\.cpp"):
        convert(path, str(tmp_path / "g.bnstore"), progress=False)
    assert not os.path.exists(tmp_path / "g.bnstore")


# ---- IQ1_S through a small test-only encoder (llama.cpp makes it only with an importance matrix) ------------
def _iq1s_grid():
    from gguf.quants import IQ1_S

    IQ1_S.init_grid()
    return IQ1_S.grid.reshape(2048, 8).astype(np.int8)


def _iq1s_nearest():
    """For each of the 3^8 ternary patterns of 8 values (base-3 index), the nearest IQ1_S grid entry."""
    grid = _iq1s_grid().astype(np.float32)
    pats = ((np.arange(6561)[:, None] // 3 ** np.arange(8)) % 3 - 1).astype(np.float32)
    d2 = (pats ** 2).sum(1)[:, None] - 2 * pats @ grid.T + (grid ** 2).sum(1)[None, :]
    return d2.argmin(1)


def _iq1s_encode(w):
    """Ternary w = codes * s (codes already IQ1_S grid patterns) -> IQ1_S blocks: d = s/15, every sub-block scale 7
    (dl = 15 d = s), delta +0.125, so each value decodes to s * (code + 0.125)."""
    s = float(np.abs(w).max())
    codes = np.rint(w / s).astype(np.int64).reshape(-1, 8)
    idx = _iq1s_nearest()[((codes + 1) * 3 ** np.arange(8)).sum(1)]
    nb = codes.shape[0] // 32
    idx = idx.reshape(nb, 8, 4)  # block, sub-block, group
    out = np.zeros((nb, 50), np.uint8)
    out[:, :2] = np.frombuffer(np.float16(s / 15).tobytes(), np.uint8)
    out[:, 2:34] = (idx & 0xFF).reshape(nb, 32)
    qh = (7 << 12) | sum(((idx[:, :, k] >> 8) & 7) << (3 * k) for k in range(4))
    out[:, 34:] = qh.astype("<u2").view(np.uint8).reshape(nb, 16)
    return out.reshape(w.shape[0], -1)


def test_iq1s_test_encoder_loads_as_its_tq2_model(ref, tmp_path):
    """The model projected onto what IQ1_S can hold (its grid has 2048 of the 3^8 patterns of 8 ternary values):
    as IQ1_S (every value blurred by +12.5% of the scale) it is the same model as its TQ2_0 file."""
    m, _, _, ids = ref
    nearest, grid = _iq1s_nearest(), _iq1s_grid()

    class Projected(SynthModel):
        def ternary(self, prefix):
            t = super().ternary(prefix)
            g = ((t.reshape(-1, 8).astype(np.int64) + 1) * 3 ** np.arange(8)).sum(1)
            return grid[nearest[g]].reshape(t.shape)

    p = Projected(seed=13)
    tq2 = write_gguf_tq(p, str(tmp_path / "p.TQ2_0.gguf"), "TQ2_0")
    iq1 = write_gguf_tq(p, str(tmp_path / "p.IQ1_S.gguf"), "IQ1_S", quantizer=_iq1s_encode)
    ref_store = convert(tq2, tq2 + ".bnstore", lm_head="f16", progress=False)
    store = convert(iq1, iq1 + ".bnstore", lm_head="f16", progress=False)
    _same_model(ref_store, store, ids, exact=False)
    for name, s in Store(store).meta["ternary_stats"].items():
        assert s["off"] == 0 and 0.12 < s["blur"] < 0.2, (name, s)  # +12.5% around a fitted mean


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0"])
def test_fast_path_on_stored_bits_agrees_with_the_general_fit(ref, qtype):
    from bitnet_cpu.engine.formats.gguf import GGUFFile
    from bitnet_cpu.engine.formats.ternary_check import fit_exact_raw

    m, d, _, _ = ref
    path = str(d / f"m.{qtype}.gguf")
    if not os.path.exists(path):
        write_gguf_tq(m, path, qtype)
    g = GGUFFile(path)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        t = g.info(name)
        fast = fit_exact_raw(g.raw(name), t.type_name, t.shape)
        slow = fit_ternary(g.dequantize(name).reshape(t.shape), t.type_name)
        assert fast is not None and np.array_equal(fast.codes, slow.codes) and fast.scale == slow.scale
        assert fast.blur == slow.blur == 0 and fast.off_share == slow.off_share == 0
    # one value moved off the three bit patterns: the fast path declines, the general fit decides
    raw = np.array(g.raw("blk.0.attn_q.weight"))
    raw[40] ^= 1
    assert fit_exact_raw(raw, qtype, g.info("blk.0.attn_q.weight").shape) is None
    g.close()
