"""bitnet.cpp's TL1 / TL2 GGUFs (and its I2_S of the same weights) read back to the checkpoint's ternary matrices.

The files in tests/data/tl were made with bitnet.cpp's own codegen scripts and packing functions
(tests/data/tl/make_tl_files.py says how); their weights come from tests/data/tl/tl_cases.py, so every test
compares with the checkpoint itself. Real shapes: the one-layer bitnet_b1_58-large model (TL1, TL2, I2_S), and
the matrices alone for bitnet_b1_58-3B and Llama3-8B-1.58 (every TL1 / TL2 tiling the presets use).
"""
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.api import load_model
from bitnet_cpu.engine.errors import UnsupportedError
from bitnet_cpu.engine.formats import tl_layouts
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.formats.gguf import GGUFFile
from bitnet_cpu.engine.synth import write_gguf_tq
from helpers import assert_conversion_refused, bitnet_inspect, gguf_fields, xz_files
from test_model_fixtures import our_greedy

DATA = os.path.join(os.path.dirname(__file__), "data", "tl")
sys.path.insert(0, DATA)
import tl_cases as C  # noqa: E402

SHORT = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return xz_files(tmp_path_factory.mktemp("tl"), DATA)


@pytest.fixture(scope="module")
def model():
    return C.SparseModel()


def _write_ini(path, stem):
    kind, model, BM, BK, bm, _ = C.MATS[stem]
    with open(path, "w") as f:
        for i, (M, K, a, b, c) in enumerate(C.config_rows(model, BM, BK, bm)):
            f.write(f"[Kernels_{i}]\nm = {M}\nk = {K}\nbm = {a}\nbk = {b}\nbmm = {c}\n\n")
    return str(path)


# ---- the one-layer bitnet_b1_58-large model ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["TL1", "TL2", "I2_S"])
def test_model_file_decodes_to_the_checkpoint(files, model, kind):
    with GGUFFile(files(f"model_large_{kind.lower()}")) as g:
        assert g.arch == "bitnet"   # what bitnet.cpp's 2024-11 converter writes for BitnetForCausalLM
        for prefix, out, inp in model.linears():
            name = f"blk.0.{SHORT[prefix.split('layers.0.')[1]]}.weight"
            assert g.info(name).type_name == kind
            w, scale = g.ternary(name)
            np.testing.assert_array_equal(w, model.ternary(prefix), err_msg=name)
            assert scale.tolist() == [C.SCALE]
        if kind != "I2_S":
            setup = {(t.BM, t.BK, t.bm) for t in g.tl_tilings.values()}
            want = {(int(a), int(b), int(c)) for a, b, c in zip(*(s.split(",") for s in C.MODEL[kind]))}
            assert setup == want and all("setup_env.py" in t.source for t in g.tl_tilings.values())


def test_tl_models_give_the_tq2_0_files_greedy_tokens(files, model):
    root = files.root
    tq = str(root / "model_large_tq2_0.gguf")
    write_gguf_tq(model, tq, "TQ2_0", hidden_activation=None)
    runs = {}
    for kind, path in (("TQ2_0", tq), ("TL1", files("model_large_tl1")), ("TL2", files("model_large_tl2")),
                       ("I2_S", files("model_large_i2_s"))):
        store = convert(path, str(root / f"{kind}.bnstore"), lm_head="f16", progress=False)
        m = load_model(store, ctx=64, progress=False)
        ids = m.tokenize("Once upon a time, in a small village", add_bos=True)
        runs[kind] = (m.forward(ids), our_greedy(m.model, ids, 24))
        assert m.model.config.hidden_act == "silu"
    ref_logits, ref_tokens = runs.pop("TQ2_0")   # (a sparse synthetic model: greedy repeats itself; the logits
                                                 # of all 22 prompt positions are compared bit for bit)
    for kind, (logits, tokens) in runs.items():
        np.testing.assert_array_equal(logits, ref_logits, err_msg=kind)
        assert tokens == ref_tokens, kind


def test_llama3_tl_models_read_like_their_tq2_0_file(files):
    """bitnet.cpp's LlamaModel path (Llama3-8B-1.58's shape, one layer): `llama` architecture, file type 38 / 39,
    q/k rows permuted as llama.cpp does; the same logits and greedy tokens as the TQ2_0 file of the same weights."""
    from bitnet_cpu.engine.synth.writers import _gguf_ternary

    m = C.SparseLlama()
    root = files.root
    tq = str(root / "model_llama3_tq2_0.gguf")
    write_gguf_tq(m, tq, "TQ2_0", hidden_activation=None, quantizer="fast", arch="llama")
    runs = {}
    for kind, path in (("TQ2_0", tq), ("TL1", files("model_llama3_tl1")), ("TL2", files("model_llama3_tl2"))):
        if kind != "TQ2_0":
            with GGUFFile(path) as g:
                assert g.arch == "llama"
                for prefix, _, _ in m.linears():
                    name = f"blk.0.{SHORT[prefix.split('layers.0.')[1]]}.weight"
                    assert g.info(name).type_name == kind
                    np.testing.assert_array_equal(g.ternary(name)[0], _gguf_ternary(m, prefix, "llama"))
        store = convert(path, str(root / f"llama3.{kind}.bnstore"), lm_head="f16", progress=False)
        lm = load_model(store, ctx=64, progress=False)
        ids = lm.tokenize("Once upon a time, in a small village", add_bos=True)
        runs[kind] = (lm.forward(ids), our_greedy(lm.model, ids, 8))
    ref_logits, ref_tokens = runs.pop("TQ2_0")
    for kind, (logits, tokens) in runs.items():
        np.testing.assert_array_equal(logits, ref_logits, err_msg=kind)
        assert tokens == ref_tokens, kind


def test_inspect_names_layout_and_tiling(files):
    out, _ = bitnet_inspect(files("model_large_tl2"))
    assert "bitnet.cpp lookup-table layout" in out
    assert "TL2 1536x1536: BM=128 BK=192 bm=32 (setup_env.py codegen bitnet_b1_58-large)" in out
    assert "TL2 4096x1536: BM=256 BK=96 bm=32" in out


# ---- the matrices alone: every preset tiling of bitnet_b1_58-3B and Llama3-8B-1.58 ----------------------------
@pytest.mark.parametrize("stem", ["mats_3b_tl1", "mats_3b_tl2", "mats_llama3_tl1", "mats_llama3_tl2"])
def test_preset_tilings_decode_to_the_checkpoint(files, stem):
    with GGUFFile(files(stem)) as g:
        for name, want in C.mats_weights(stem):
            w, scale = g.ternary(name)
            np.testing.assert_array_equal(w, want, err_msg=name)
            assert scale.tolist() == [C.SCALE]
        assert all(t.source.startswith("setup_env.py codegen") for t in g.tl_tilings.values())


def test_llama3_tl1_preset_ini_needs_the_override(files, tmp_path, monkeypatch):
    """Llama3-8B's TL1 preset ini and setup_env.py's codegen tile differently, and TL1 codes cannot tell them
    apart: setup_env.py's is assumed (it rewrites kernel_config.ini after copying the preset); a file converted
    with the preset ini reads right with BITNET_TL_KERNEL_CONFIG pointing at it."""
    stem = "mats_llama3_tl1_ini"
    with GGUFFile(files(stem)) as g:
        name, want = C.mats_weights(stem)[0]
        assert not np.array_equal(g.ternary(name)[0], want)
    monkeypatch.setenv(tl_layouts.ENV_CONFIG, _write_ini(tmp_path / "kernel_config.ini", stem))
    with GGUFFile(files(stem)) as g:
        for name, want in C.mats_weights(stem):
            np.testing.assert_array_equal(g.ternary(name)[0], want, err_msg=name)


# ---- tilings outside the presets ------------------------------------------------------------------------------
def test_tl2_tiling_matching_nothing_is_refused_in_one_line(files, tmp_path, monkeypatch):
    """3B's attn_q written with BK=192 (codegen_tl2.py --BK 96,192,96): the preset's BK=96 splits K elsewhere,
    which breaks the layout's invariants, so the file is refused naming the shape and the presets tried."""
    stem = "mats_3b_tl2_extra"
    with GGUFFile(files(stem)) as g:
        with pytest.raises(UnsupportedError) as e:
            g.ternary("blk.0.attn_q.weight")
        # ffn_down's tiling (BM 320, preset 160) splits K where the preset does: the invariants hold and the matrix
        # reads wrong (docs/formats.md says so; the override below is the way out)
        name, want = C.mats_weights(stem)[0]
        assert not np.array_equal(g.ternary(name)[0], want)
    msg = str(e.value)
    assert "no TL2 tiling fits a 3200x3200 matrix (presets tried: BM=320 BK=96 bm=32 (setup_env.py codegen" in msg
    assert "\n" not in msg and tl_layouts.ENV_CONFIG in msg
    monkeypatch.setenv(tl_layouts.ENV_CONFIG, _write_ini(tmp_path / "kernel_config.ini", stem))
    with GGUFFile(files(stem)) as g:
        for name, want in C.mats_weights(stem):
            np.testing.assert_array_equal(g.ternary(name)[0], want, err_msg=name)
            assert g.tl_tilings[("TL2", *want.shape)].source.startswith(tl_layouts.ENV_CONFIG)


def test_tl1_extra_tiling_reads_with_its_kernel_config(files, tmp_path, monkeypatch):
    stem = "mats_large_tl1_extra"
    monkeypatch.setenv(tl_layouts.ENV_CONFIG, _write_ini(tmp_path / "kernel_config.ini", stem))
    with GGUFFile(files(stem)) as g:
        for name, want in C.mats_weights(stem):
            np.testing.assert_array_equal(g.ternary(name)[0], want, err_msg=name)


def test_tl1_shape_without_preset_is_refused(tmp_path):
    raw = np.full(256 * 512 // 4 + 32, 0x44, np.uint8)
    with pytest.raises(UnsupportedError, match=r"TL1 tiling of a 256x512 matrix unknown \(bitnet.cpp presets"):
        tl_layouts.decode("TL1", raw, 256, 512, "x")


# ---- broken files ---------------------------------------------------------------------------------------------
def _copy(files, stem, tmp_path):
    path = str(tmp_path / f"{stem}.gguf")
    shutil.copyfile(files(stem), path)
    return path


def test_truncated_tl_file_is_refused(files, tmp_path):
    path = _copy(files, "model_large_tl2", tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    assert_conversion_refused(path, tmp_path, "lies past the end of the file")


def test_bit_flipped_tl1_code_is_refused(files, tmp_path):
    path = _copy(files, "model_large_tl1", tmp_path)
    with GGUFFile(path) as g:
        off = g.info("blk.0.ffn_up.weight").offset + 12345
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b | 0x80]))    # a code of 4 (two zeros) becomes 12: no TL1 code
    assert_conversion_refused(path, tmp_path, "TL1 tensor holds 1 invalid codes")


def test_bit_flipped_tl2_sign_is_refused(files, tmp_path):
    """A sign bit set on an all-zero triple: the sign stream starts M*K3/6 bytes into the tensor."""
    path = _copy(files, "model_large_tl2", tmp_path)
    with GGUFFile(path) as g:
        t = g.info("blk.0.attn_v.weight")   # 1536x1536, BK 192: K3 = K
        off = t.offset + 1536 * 1536 // 6 + 100
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        for bit in range(8):
            if not b >> bit & 1:
                f.seek(off)
                f.write(bytes([b | 1 << bit]))
                break
    assert_conversion_refused(path, tmp_path, "TL2 tensor breaks its layout's invariants in 1 places")


@pytest.mark.parametrize("n", [4096, 65536])
def test_a_tl2_tensor_with_garbage_in_its_codes_is_said_corrupt(files, tmp_path, n):
    """Random bytes over part of attn_v's codes, in a file whose tiling is the preset's: more broken places than
    a stray bit gives, which sent the user to BITNET_TL_KERNEL_CONFIG ("no TL2 tiling fits"); no K split of the
    shape reads those bytes as codes either, so the tensor is said corrupt."""
    path = _copy(files, "model_large_tl2", tmp_path)
    with GGUFFile(path) as g:
        off = g.info("blk.0.attn_v.weight").offset + 1000
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes())
    err = assert_conversion_refused(path, tmp_path, "tensor 'blk.0.attn_v.weight': TL2 tensor breaks its layout's")
    assert "corrupt file?" in err and tl_layouts.ENV_CONFIG not in err, err


@pytest.mark.parametrize("dims,words", [
    ((1536, 768), f"(TL2 [768, 1536]: {tl_layouts.tensor_bytes('TL2', 768, 1536)} bytes) is followed by"),
    ((1535, 1536), "TL2 tensor 'blk.0.attn_q.weight' has shape [1536, 1535]")])
def test_one_tl2_tensor_with_a_bad_shape_is_named_as_tl2(files, tmp_path, dims, words):
    """One type-39 tensor whose shape field is corrupt no longer makes the whole file MXFP4 (an intact tensor
    then blamed as "truncated?"): the others are TL2-sized, so the odd one is named, as TL2."""
    path = _copy(files, "model_large_tl2", tmp_path)
    _, ndims, _ = gguf_fields(path)
    with open(path, "r+b") as f:
        f.seek(ndims["blk.0.attn_q.weight"] + 4)
        f.write(struct.pack("<2Q", *dims))
    err = assert_conversion_refused(path, tmp_path, "tensor 'blk.0.attn_q.weight'")
    assert words in err and "MXFP4" not in err and "truncated" not in err, err


def test_a_llama_tl2_file_with_another_file_type_still_reads_as_tl2(files, tmp_path):
    """general.file_type 39 -> 1 in bitnet.cpp's Llama3 TL2 file: every type-39 tensor is still TL2-sized (none
    MXFP4-sized), so it reads as TL2, to the same weights."""
    src = files("model_llama3_tl2")
    path = _copy(files, "model_llama3_tl2", tmp_path)
    keys, _, _ = gguf_fields(path)
    with open(path, "r+b") as f:
        f.seek(keys["general.file_type"][1])
        f.write(struct.pack("<I", 1))
    with GGUFFile(path) as g, GGUFFile(src) as want:
        assert g.kv["general.file_type"] == 1
        for t in want.tensors.values():
            assert g.info(t.name).type_name == t.type_name
            if t.type_name == "TL2":
                np.testing.assert_array_equal(g.ternary(t.name)[0], want.ternary(t.name)[0])


def test_mxfp4_in_a_bitnet_file_is_still_mxfp4(tmp_path):
    """Type 39 is llama.cpp's MXFP4 too: sized as MXFP4, not as TL2, it stays MXFP4."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "bitnet")
    w.add_tensor("x", np.zeros((256, 256 // 32 * 17), np.uint8), raw_shape=(256, 256 // 32 * 17),
                 raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(str(tmp_path / "m.gguf")) as g:
        assert g.info("x").type_name == "MXFP4"


# ---- I2_S of other bitnet.cpp builds ----------------------------------------------------------------------------
def _repack_i2s_64(w: np.ndarray, scale: float) -> bytes:
    """quantize_i2_s of a 2025-11+ ARM build (src/ggml-bitnet-mad.cpp, QK_I2_S 64): 64-weight blocks of 16 bytes,
    byte g holding weights g, g+16, g+32, g+48 at bits 7-6, 5-4, 3-2, 1-0."""
    c = (w.reshape(-1, 4, 16) + 1).astype(np.uint8)
    packed = (c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]
    return packed.tobytes() + np.float32(scale).tobytes() + b"\0" * 28


def test_i2s_64_weight_blocks_read_with_the_setting(files, model, tmp_path, monkeypatch):
    """The 2024-11 release (every ISA) and the 2026 x86 builds write 128-weight I2_S blocks (model_large_i2_s);
    a 2025-11+ ARM build writes 64. Same codes in another order: not detectable from the file, so the 128-block
    reading of a 64-block file is wrong, and BITNET_I2S_BLOCK=64 reads it right."""
    path = _copy(files, "model_large_i2_s", tmp_path)
    prefix = "model.layers.0.self_attn.q_proj"
    want = model.ternary(prefix)
    with GGUFFile(path) as g:
        off, nbytes = g.info("blk.0.attn_q.weight").offset, g.info("blk.0.attn_q.weight").nbytes
    blob = _repack_i2s_64(want, C.SCALE)
    assert len(blob) == nbytes
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(blob)
    with GGUFFile(path) as g:
        assert not np.array_equal(g.ternary("blk.0.attn_q.weight")[0], want)
    monkeypatch.setenv("BITNET_I2S_BLOCK", "64")
    with GGUFFile(path) as g:
        np.testing.assert_array_equal(g.ternary("blk.0.attn_q.weight")[0], want)


@pytest.mark.parametrize("seed", range(12))
def test_mutated_tl_files_fail_only_with_one_line_errors(files, tmp_path, seed):
    """Random bytes changed in the header or the TL codes: the file reads, or a BitNetError (one line) says why."""
    from bitnet_cpu.engine.errors import BitNetError

    stem = "model_large_tl2" if seed % 2 else "model_large_tl1"
    path = _copy(files, stem, tmp_path)
    rng = np.random.default_rng(seed)
    with GGUFFile(path) as g:
        data_start = g.data_offset
        first = g.info("blk.0.attn_q.weight").offset
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        for _ in range(1 + seed % 4):
            where = int(rng.integers(0, data_start)) if seed < 6 else int(rng.integers(first, size))
            f.seek(where)
            f.write(bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8)))
    try:
        with GGUFFile(path) as g:
            for t in list(g.tensors.values()):
                if t.type_name in ("TL1", "TL2"):
                    g.ternary(t.name)
    except BitNetError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize("values", ["bm=0 bk=64 bmm=32", "bm=256 bk=0 bmm=32", "bm=256 bk=64 bmm=0",
                                    "bm=-256 bk=64 bmm=32", "bm=abc bk=64 bmm=32"])
def test_a_kernel_config_with_unusable_tile_sizes_is_one_line(tmp_path, monkeypatch, values):
    """A tile size of 0 divided by zero when the file was read (exit 70, "a bug in bitnet-cpu"), a negative one
    failed in numpy's reshape: both are the ini's fault, refused in one line naming it."""
    ini = tmp_path / "kernel_config.ini"
    ini.write_text("[Kernels_0]\nm = 1536\nk = 4096\n" + "".join(f"{kv.replace('=', ' = ')}\n" for kv in values.split()))
    monkeypatch.setenv(tl_layouts.ENV_CONFIG, str(ini))
    with pytest.raises(UnsupportedError) as e:
        tl_layouts.env_tilings(1536, 4096)
    assert "\n" not in str(e.value) and str(ini) in str(e.value)
    assert tl_layouts.env_tilings(1536, 1536) == []   # another shape: its section is not read


@pytest.mark.parametrize("stem,values", [("model_large_tl2", "bm=7 bk=5 bmm=3"),
                                         ("model_large_tl2", "bm=1536 bk=1536 bmm=1536"),
                                         ("model_large_tl2", "bm=128 bk=64 bmm=64"),   # the TL1 ini's tiling
                                         ("model_large_tl1", "bm=7 bk=5 bmm=3"),
                                         ("model_large_tl1", "bm=128 bk=64 bmm=16")])
def test_a_kernel_config_tiling_that_cannot_apply_is_refused(files, tmp_path, monkeypatch, stem, values):
    """An ini whose tiling for the shape bitnet.cpp's converter could not have used (not dividing it, or bm other
    than TL2's 32) was skipped without a word and the preset read instead: refused in one line naming the ini,
    the shape and its tiling."""
    BM, BK, bm = (int(kv.split("=")[1]) for kv in values.split())
    ini = tmp_path / "kernel_config.ini"
    ini.write_text(f"[Kernels_0]\nm = 1536\nk = 1536\nbm = {BM}\nbk = {BK}\nbmm = {bm}\n")
    monkeypatch.setenv(tl_layouts.ENV_CONFIG, str(ini))
    with GGUFFile(files(stem)) as g:
        with pytest.raises(UnsupportedError) as e:
            g.ternary("blk.0.attn_q.weight")
    msg = str(e.value)
    assert "\n" not in msg and f"{tl_layouts.ENV_CONFIG}={ini}" in msg, msg
    assert f"1536x1536 as BM={BM} BK={BK} bm={bm}" in msg and "blk.0.attn_q.weight" in msg, msg
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", files(stem), "-o", str(tmp_path / "x.bnstore")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and f"BM={BM} BK={BK} bm={bm}" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2 and not os.path.exists(tmp_path / "x.bnstore"), r.stderr


# ---- the conversion cache and the kernel config -----------------------------------------------------------------
def _tiling_ini(path, BM, BK) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"[Kernels_0]\nm = 1536\nk = 1536\nbm = {BM}\nbk = {BK}\nbmm = 32\n")
    return str(path)


def _weights(path) -> dict:
    from bitnet_cpu.engine.formats.store import Store
    with Store(path) as s:
        return {n: np.array(s.tensor(n)) for n in s.tensor_names if n.startswith("blk.")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_the_cache_converts_again_when_the_kernel_config_file_changes(files, tmp_path, monkeypatch):
    """The cache was keyed by BITNET_TL_KERNEL_CONFIG's text: the ini fixed in place (what docs/formats.md tells a
    user to do), or another folder's ini of the same relative name, got the first conversion back, read with the
    wrong tiling, without a word. Now the file's resolved path and its content decide."""
    from bitnet_cpu.engine.formats.convert import resolve_model

    src = files("model_large_tl2")
    want = _weights(convert(src, str(tmp_path / "preset.bnstore"), progress=False))   # the right tiling: the preset
    cache = tmp_path / "cache"
    monkeypatch.setenv("BITNET_CACHE", str(cache))
    ini = _tiling_ini(tmp_path / "ini" / "kernel_config.ini", 256, 96)   # a tiling this file was not written with
    monkeypatch.setenv(tl_layouts.ENV_CONFIG, ini)
    assert not _same(_weights(resolve_model(src, progress=False)), want), "the wrong tiling must read otherwise"
    _tiling_ini(ini, 128, 192)                                             # fixed in place
    assert _same(_weights(resolve_model(src, progress=False)), want)
    assert len(os.listdir(cache)) == 1   # one source and one ini: the fixed conversion replaced the wrong one
    # the same relative name in two folders: two files, two conversions
    monkeypatch.setenv(tl_layouts.ENV_CONFIG, "kernel_config.ini")
    _tiling_ini(tmp_path / "dA" / "kernel_config.ini", 256, 96)
    _tiling_ini(tmp_path / "dB" / "kernel_config.ini", 128, 192)
    monkeypatch.chdir(tmp_path / "dA")
    assert not _same(_weights(resolve_model(src, progress=False)), want)
    monkeypatch.chdir(tmp_path / "dB")
    assert _same(_weights(resolve_model(src, progress=False)), want)
