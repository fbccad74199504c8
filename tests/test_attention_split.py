"""How attention splits a step over the threads (simd/ops/attention.c att_plan, ops.attention_plan), and that the
split never changes a float.

A prompt chunk's work items are (KV head, part of its query heads); on many threads there are too few of them (the
2B shape on 16 threads: 5 KV heads x 4 query heads = 20 items, a second round that keeps 4 of 16 threads busy), so
the chunk also goes in blocks of its rows, 16-row aligned and at least 16 rows long, the last rows first. Every
pass (4 rows, or 16 on the bf16 tiles) then groups the rows it groups unsplit: a step on many threads gives the
bytes of the same step on one thread, for every cache type and precision, contiguous and paged."""
import numpy as np
import pytest

import bitnet_cpu.simd._kernels as K
import bitnet_cpu.simd._ops as ops
from bitnet_cpu.simd.errors import KernelError
from test_attention_paths import _contiguous, _contiguous_q8, _inputs, _paged


@pytest.mark.parametrize("threads", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("m,pos0", [(128, 0), (128, 384), (100, 3000), (512, 0), (16, 40), (31, 0), (7, 0)])
def test_a_prompt_chunk_goes_in_aligned_row_blocks_only_when_the_heads_are_too_few(threads, m, pos0):
    sub, runs = ops.attention_plan([m], [pos0], 20, 5, 128, threads)   # the 2B-4T shape
    # the runs cover the chunk's rows exactly once, each at its own positions
    assert sorted(r for r0, n, _ in runs for r in range(r0, r0 + n)) == list(range(m))
    assert all(p0 == pos0 + r0 for r0, _, p0 in runs)
    # blocks start 16 rows apart from the chunk's start and hold at least 16 rows: every pass groups the same rows
    if len(runs) > 1:
        assert all(r0 % 16 == 0 and n >= 16 for r0, n, _ in runs)
        assert [r0 for r0, _, _ in runs] == sorted((r0 for r0, _, _ in runs), reverse=True)   # the longest first
    items = 5 * (4 // sub) * len(runs)   # one per KV head, part of its group and block
    # the query heads are split first (2 threads: the 2B shape's 10 items, unchanged); rows only past that
    assert sub == {1: 4, 2: 2}.get(threads, 1)
    if items < 4 * threads:   # still short of 4 items a thread: only because the rows cannot go in more blocks
        assert len(runs) == max(1, m // 16) or m < 32
    if 5 * 4 < 4 * threads and m >= 32:
        assert len(runs) > 1, "many threads, few heads: the chunk was not split"
    if threads <= 4:
        assert len(runs) == 1


def test_decode_rows_and_mixed_steps_keep_their_items():
    """A batched step's decode rows are never split, and a step whose items already fill the threads is as before."""
    sub, runs = ops.attention_plan([1] * 16, list(range(100, 116)), 20, 5, 128, 16)
    assert runs == [(i, 1, 100 + i) for i in range(16)]
    sub, runs = ops.attention_plan([1, 128, 1], [300, 0, 50], 20, 5, 128, 16)   # 20 items with sub 1: enough
    assert (sub, runs) == (1, [(0, 1, 300), (1, 128, 0), (129, 1, 50)])
    sub, runs = ops.attention_plan([128, 64], [0, 10], 20, 5, 128, 32)
    assert sub == 1 and sorted(runs) == sorted(set(runs)) and sum(n for _, n, _ in runs) == 192 and len(runs) > 2
    # an odd group cannot be split: rows still can
    sub, runs = ops.attention_plan([128], [0], 9, 3, 64, 16)
    assert sub == 3 and len(runs) == 8
    with pytest.raises(KernelError):
        ops.attention_plan([0], [0], 20, 5, 128, 4)
    with pytest.raises(KernelError):
        ops.attention_plan([4], [0], 20, 3, 128, 4)


def _run(threads, fn):
    K.set_num_threads(threads)
    try:
        return fn()
    finally:
        K.set_num_threads(0)


def _precision(precision, fn):
    ops.set_attention_precision(precision)
    try:
        return fn()
    finally:
        ops.set_attention_precision("f32")


CASES = [("f32", np.float32, None), ("f16", np.uint16, None), ("bf16", np.uint16, None), ("bf16", np.uint16, "emu")]


@pytest.mark.parametrize("nh,nkv,hd", [(8, 2, 128), (6, 2, 64), (4, 1, 80)])
@pytest.mark.parametrize("precision,kv_dtype,tiles", CASES, ids=["f32", "f16", "bf16", "bf16-tiles-emu"])
def test_many_threads_give_the_bytes_of_one(nh, nkv, hd, precision, kv_dtype, tiles):
    """The scratch of these calls has rows for nh threads: 8 / 6 / 4 threads split the 64- and 162-row chunks
    into row blocks (checked through the plan), one thread runs them whole."""
    if tiles and hd % 32:
        pytest.skip("the bf16 tile passes take head_dim in steps of 32")
    qkv, cos, sin = _inputs(nh, nkv, hd, seed=hd + nh + 1)
    threads = nh
    _, runs = ops.attention_plan([162], [135], nh, nkv, hd, threads)   # CHUNKS' third chunk
    assert len(runs) > 1, "the plan did not split the chunk: this test would compare nothing new"

    def both(runner):
        one = _run(1, lambda: _precision(precision if precision == "bf16" else "f32", runner))
        many = _run(threads, lambda: _precision(precision if precision == "bf16" else "f32", runner))
        return one, many

    one, many = both(lambda: _contiguous(None, kv_dtype, nh, nkv, hd, qkv, cos, sin, tiles)[0])
    assert np.all(np.isfinite(one)) and np.any(one != 0)
    bad = np.flatnonzero((one != many).any(axis=1))
    assert bad.size == 0, f"rows {bad[:8].tolist()} differ on {threads} threads, max |diff| {np.abs(one - many).max():.3g}"
    one_p, many_p = both(lambda: _paged(None, kv_dtype, nh, nkv, hd, qkv, cos, sin, tiles))
    assert one_p.tobytes() == many_p.tobytes() == one.tobytes()
    if precision == "f32" and kv_dtype is np.float32 and hd % 4 == 0:   # and the int8 cache
        one_q, many_q = both(lambda: _contiguous_q8(nh, nkv, hd, qkv, cos, sin))
        assert one_q.tobytes() == many_q.tobytes()
