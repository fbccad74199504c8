"""The weight store writes, maps zero-copy, and refuses corrupt files with a FormatError."""
import os

import numpy as np
import pytest

from bitnet_cpu.engine.config import ModelConfig
from bitnet_cpu.engine.errors import FormatError
from bitnet_cpu.engine.formats.store import Store, TensorSpec, write_store

CFG = ModelConfig(hidden_size=64, intermediate_size=128, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=100)


def _write(tmp_path):
    a = np.arange(1000, dtype=np.float32)
    b = np.arange(77, dtype=np.uint8)
    p = write_store(tmp_path / "m.bnstore", CFG, [TensorSpec("a", a, {"layout": "plain"}), TensorSpec("b", b)],
                    meta={"source": "test"}, chat_template="{{x}}", tokenizer_kind="hf_json", tokenizer_blob=b"{}")
    return p, a, b


def test_round_trip_zero_copy(tmp_path):
    p, a, b = _write(tmp_path)
    s = Store(p)
    assert s.config == CFG
    assert np.array_equal(s.tensor("a"), a) and np.array_equal(s.tensor("b"), b)
    assert not s.tensor("a").flags.writeable and not s.tensor("a").flags.owndata
    assert s.tensor("a").ctypes.data % 64 == 0
    assert s.info("a")["layout"] == "plain"
    assert s.tokenizer_spec == ("hf_json", b"{}")
    assert s.chat_template == "{{x}}" and s.meta["source"] == "test"


@pytest.mark.parametrize("mutate", ["truncate", "magic", "index", "version", "empty"])
def test_corrupt_files_raise(tmp_path, mutate):
    p, _, _ = _write(tmp_path)
    data = bytearray(open(p, "rb").read())
    if mutate == "truncate":
        data = data[: len(data) // 2]
    elif mutate == "magic":
        data[0:4] = b"GGUF"
    elif mutate == "index":
        data[-5] ^= 0xFF
    elif mutate == "version":
        data[8] = 99
    else:
        data = b""
    with open(p, "wb") as f:
        f.write(data)
    with pytest.raises(FormatError):
        Store(p)


def test_missing_file(tmp_path):
    with pytest.raises(FormatError, match="cannot open"):
        Store(tmp_path / "nope")
    assert not os.path.exists(tmp_path / "nope")


# ---------------------------------------------------------------- weights read into (huge-page) memory
@pytest.mark.parametrize("load", ["memory", "mmap", "auto"])
def test_load_modes_give_the_same_tensors(tmp_path, load):
    p, a, b = _write(tmp_path)
    s = Store(p, load=load)
    # a tiny store: "auto" maps it (huge pages only pay for large weights)
    assert s.load_mode == ("memory" if load == "memory" else "mmap")
    assert np.array_equal(s.tensor("a"), a) and np.array_equal(s.tensor("b"), b)
    assert not s.tensor("a").flags.writeable                    # read-only in both modes
    assert s.tensor("a").ctypes.data % 64 == 0
    assert s.tokenizer_spec == ("hf_json", b"{}")
    assert ("in memory" if load == "memory" else "mapped") in s.load_summary()
    assert s.data_bytes >= a.nbytes + b.nbytes
    s.close()


def test_memory_copy_outlives_the_file(tmp_path):
    # read into memory, the weights no longer depend on the file: truncating it changes nothing
    p, a, _ = _write(tmp_path)
    s = Store(p, load="memory")
    v = s.tensor("a")
    os.truncate(p, 100)
    assert np.array_equal(v, a)


def test_unknown_load_mode(tmp_path):
    p, _, _ = _write(tmp_path)
    from bitnet_cpu.engine.errors import BitNetError

    with pytest.raises(BitNetError, match="load 'fast'"):
        Store(p, load="fast")


def test_read_into_memory_short_file_and_progress(tmp_path):
    from bitnet_cpu.engine.memory import HUGE, huge_page_bytes, read_into_memory

    f = tmp_path / "blob"
    data = np.random.default_rng(0).integers(0, 256, 3 * HUGE + 123, dtype=np.uint8)
    f.write_bytes(data.tobytes())
    seen = []
    mm, start = read_into_memory(str(f), 7, data.size - 7, progress=lambda d, t: seen.append((d, t)))
    got = np.frombuffer(mm, np.uint8, count=data.size - 7, offset=start)
    assert np.array_equal(got, data[7:])
    assert got.ctypes.data % HUGE == 0                          # starts on a huge-page boundary
    assert seen and seen[-1] == (data.size - 7, data.size - 7)
    hp = huge_page_bytes(got.ctypes.data, data.size - 7)
    assert hp is None or 0 <= hp <= data.size - 7
    del got
    mm.close()
    with pytest.raises(FormatError, match="truncated"):
        read_into_memory(str(f), 0, data.size + 1)


# ---------------------------------------------------------------- damaged tensor data


def _poison(path, name, value):
    """Write `value` over tensor `name`'s first float32 in place (tensor data has no checksum)."""
    with Store(path, load="mmap") as s:
        at = s._data_offset + s.info(name)["offset"]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.float32(value).tobytes())


@pytest.mark.parametrize("load", ["mmap", "memory"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_in_a_float_tensor_is_refused(tmp_path, load, value):
    p, _, _ = _write(tmp_path)
    _poison(p, "a", value)
    with pytest.raises(FormatError, match=r"tensor 'a' holds NaN/inf values") as e:
        Store(p, load=load)
    assert str(e.value).startswith(f"{p}: ") and "\n" not in str(e.value)


def test_a_cached_conversion_with_a_nan_norm_is_converted_again(tmp_path, capsys):
    from bitnet_cpu.engine.formats.convert import resolve_model

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "bitnet-b1.58-tiny")
    cache = str(tmp_path / "cache")
    path = resolve_model(src, cache_dir=cache, lm_head="f16", progress=False)
    with Store(path) as s:
        want = s.tensor("blk.0.attn_norm").copy()
    _poison(path, "blk.0.attn_norm", np.nan)
    assert resolve_model(src, cache_dir=cache, lm_head="f16", progress=False) == path
    assert "is damaged" in capsys.readouterr().err
    with Store(path) as s:
        assert np.array_equal(s.tensor("blk.0.attn_norm"), want)


def _edit_index(path, edit):
    """Rewrite the store's index JSON through edit(index) with a valid checksum: a deliberately edited file."""
    import hashlib
    import json

    from bitnet_cpu.engine.formats.store import _HEADER
    raw = open(path, "rb").read()
    magic, version, flags, ioff, ilen, doff, _ = _HEADER.unpack(raw[:_HEADER.size])
    index = json.loads(raw[ioff:ioff + ilen])
    edit(index)
    new = json.dumps(index).encode()
    head = _HEADER.pack(magic, version, flags, ioff, len(new), doff, hashlib.sha256(new).digest())
    with open(path, "wb") as f:
        f.write(head + raw[_HEADER.size:ioff] + new)


@pytest.mark.parametrize("edit, words", [
    (lambda ix: ix["tensors"]["b"].update(offset=ix["tensors"]["b"]["offset"] + 1), "'b' has a corrupt index entry"),
    (lambda ix: ix["tensors"]["b"].update(offset=64), "overlap"),
])
def test_an_index_edited_to_misplace_a_tensor_is_refused(tmp_path, edit, words):
    """write_store aligns every tensor to 64 bytes and places each after the last: an index (its checksum made
    anew) that puts one off its alignment or over another is refused, not read as other bytes."""
    p, a, b = _write(tmp_path)
    _edit_index(p, lambda ix: None)
    assert np.array_equal(Store(p).tensor("b"), b)   # the rewrite alone changes nothing
    _edit_index(p, edit)
    with pytest.raises(FormatError, match=words):
        Store(p)
