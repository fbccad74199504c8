"""The runtime on tiny random models: prefill (GEMM, chunked) == step-by-step decode (GEMV), chunking
does not change results, no allocation per decode step, both MLP variants, context limits."""
import tracemalloc

import numpy as np
import pytest

from bitnet_cpu.engine.errors import ContextOverflowError
from bitnet_cpu.engine.runtime.model import Model
from bitnet_cpu.engine.formats.store import Store
from test_model_fixtures import make_synth


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("model"), seed=3, lm_heads=("f16", "i8", "q4"))


@pytest.mark.parametrize("kv", ["f16", "f32", "q8"])
@pytest.mark.parametrize("head", ["f16", "i8", "q4"])
def test_prefill_equals_decode(synth, kv, head):
    m, _, stores = synth
    ids = np.random.default_rng(1).integers(0, m.V, 70).tolist()
    model = Model(Store(stores[head]), n_ctx=128, kv_dtype=kv, chunk=32)  # 70 = 32 + 32 + 6: three chunks
    pre = model.forward(ids)
    assert pre.shape == (70, m.V) and np.isfinite(pre).all()
    model.reset()
    step = np.stack([model.decode(t).copy() for t in ids])
    # same kernels' math per row: bit-identical, not just close (the int8 and q4 heads take a chunk's rows
    # together, 8 or all at a time, against one row a step)
    np.testing.assert_array_equal(pre, step)
    # the last-row-only prefill returns the same logits as the all-rows one
    model.reset()
    np.testing.assert_array_equal(model.prefill(ids), pre[-1])
    assert model.n_past == 70 and model.cache_ids == ids


def test_chunk_size_does_not_matter(synth):
    m, _, stores = synth
    ids = np.random.default_rng(2).integers(0, m.V, 50).tolist()
    a = Model(Store(stores["f16"]), n_ctx=64, chunk=64).forward(ids)
    b = Model(Store(stores["f16"]), n_ctx=64, chunk=7).forward(ids)
    np.testing.assert_array_equal(a, b)


def test_weights_in_memory_give_the_same_logits(synth, monkeypatch):
    """Weights read into (huge-page) memory run the same kernels on the same bytes as the mapped file; "auto"
    reads a store over the size threshold when the kernel offers huge pages, and maps it when it does not."""
    import bitnet_cpu.engine.formats.store as store_mod

    m, _, stores = synth
    ids = np.random.default_rng(4).integers(0, m.V, 20).tolist()
    mapped = Store(stores["i8"], load="mmap")
    read = Store(stores["i8"], load="memory")
    assert (mapped.load_mode, read.load_mode) == ("mmap", "memory")
    np.testing.assert_array_equal(Model(mapped, n_ctx=32).forward(ids), Model(read, n_ctx=32).forward(ids))
    monkeypatch.setattr(store_mod, "AUTO_MIN_BYTES", 0)
    monkeypatch.setattr(store_mod, "thp_mode", lambda: "madvise")
    assert Store(stores["i8"]).load_mode == "memory"
    monkeypatch.setattr(store_mod, "thp_mode", lambda: "never")
    assert Store(stores["i8"]).load_mode == "mmap"
    monkeypatch.setattr(store_mod, "thp_mode", lambda: "always")
    monkeypatch.setattr(store_mod, "available_memory", lambda: read.data_bytes)   # no room left beside it
    assert Store(stores["i8"]).load_mode == "mmap"
    monkeypatch.setattr(store_mod, "available_memory", lambda: read.data_bytes - 1)
    from bitnet_cpu.engine.errors import BitNetError

    with pytest.raises(BitNetError, match="more than the") as e:   # asked for explicitly: refused, not an OOM
        Store(stores["i8"], load="memory")
    assert "--mmap" in e.value.hint


def test_resume_after_truncate(synth):
    """Rewinding the cache and continuing gives the same logits as a fresh run (prefix reuse)."""
    m, _, stores = synth
    ids = np.random.default_rng(3).integers(0, m.V, 40).tolist()
    model = Model(Store(stores["f16"]), n_ctx=64, chunk=16)
    full = model.forward(ids)
    model.truncate(25)
    assert model.cache_ids == ids[:25]
    np.testing.assert_array_equal(model.prefill(ids[25:], all_logits=True), full[25:])


def _bytes_kept(run) -> int:
    """Bytes that Python objects allocated by run() still hold when it returns (tracemalloc, per file)."""
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        run()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename")
               if s.size_diff > 0 and "tracemalloc" not in str(s.traceback))


@pytest.mark.parametrize("kv", ["f16", "q8"])
def test_decode_allocates_nothing(synth, kv):
    m, _, stores = synth
    model = Model(Store(stores["i8"]), n_ctx=256, kv_dtype=kv)
    model.prefill([1, 2, 3])
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, m.V, 160)]
    for t in tokens[:5]:  # warm-up: lazily created objects
        model.decode(t)
    def steps():
        for t in tokens[5:155]:
            model.decode(t)

    grown = _bytes_kept(steps)
    assert grown < 4096, f"{grown} bytes allocated and kept over 150 decode steps"


def test_silu_variant(tmp_path):
    """The llama-style 1bitLLM variant (silu, untied head) runs, and prefill == decode there too."""
    m, _, stores = make_synth(tmp_path, seed=5, style="1bitllm")
    store = Store(stores["f16"])
    assert store.config.hidden_act == "silu"
    model = Model(store, n_ctx=64)
    ids = list(range(3, 40))
    pre = model.forward(ids)
    model.reset()
    np.testing.assert_array_equal(pre, np.stack([model.decode(t).copy() for t in ids]))


def test_context_limits(synth):
    m, _, stores = synth
    model = Model(Store(stores["f16"]), n_ctx=16)
    with pytest.raises(ContextOverflowError):
        model.prefill(list(range(17)))
    assert model.n_past == 0
    model.prefill(list(range(16)))
    with pytest.raises(ContextOverflowError):
        model.decode(1)
    with pytest.raises(Exception, match="outside the vocabulary"):
        Model(Store(stores["f16"]), n_ctx=16).prefill([m.V])


def test_llama_architecture_variant(tmp_path):
    """Llama-architecture ternary models (no sub-norms, explicit head_dim, untied head): prefill == decode bit
    for bit, and a decode step allocates nothing there either."""
    m, _, stores = make_synth(tmp_path, seed=6, style="llama", head_dim=96)
    store = Store(stores["f16"])
    assert (store.config.sub_norms, store.config.head_dim) == (False, 96)
    model = Model(store, n_ctx=256, chunk=16)
    ids = list(range(3, 40))
    pre = model.forward(ids)
    model.reset()
    np.testing.assert_array_equal(pre, np.stack([model.decode(t).copy() for t in ids]))
    for t in ids[:5]:
        model.decode(t)
    def steps():
        for t in range(100):
            model.decode(t + 3)

    grown = _bytes_kept(steps)
    assert grown < 4096, f"{grown} bytes allocated and kept over 100 decode steps"


@pytest.mark.parametrize("head", ["q4", "f16"])
def test_base3_weights_give_identical_logits(tmp_path, head):
    """--weights t1.6 (tile16b3, 1.6 bits per weight): prefill in chunks (GEMM), multi-row verify and decode
    (GEMV) give exactly the logits of the t2 (tile16) store of the same model."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    m = SynthModel(small_config(intermediate_size=400), seed=5)   # K = 400 -> K_pad 448: a tile16 block tail
    d = write_hf_dir(m, str(tmp_path / "hf"))
    t2 = Store(convert(d, str(tmp_path / "t2.bnstore"), lm_head=head, progress=False))
    b3 = Store(convert(d, str(tmp_path / "b3.bnstore"), lm_head=head, weights="t1.6", progress=False))
    assert b3.info("blk.0.ffn_down")["layout"] == "tile16b3" and t2.info("blk.0.ffn_down")["layout"] == "tile16"
    assert b3.data_bytes < t2.data_bytes
    ids = np.random.default_rng(8).integers(0, m.V, 45).tolist()
    a, b = Model(t2, n_ctx=64, chunk=16), Model(b3, n_ctx=64, chunk=16)
    assert b.weights.b3 and not a.weights.b3
    np.testing.assert_array_equal(a.forward(ids[:40]), b.forward(ids[:40]))
    np.testing.assert_array_equal(a.verify(ids[40:44]), b.verify(ids[40:44]))
    np.testing.assert_array_equal(a.decode(ids[44]), b.decode(ids[44]))
