"""The q4 head (q4g_tile16) at M > 1 on the matrix tiles (simd/kernels/gemm_tiles_q4_body.h): its group scales
split into two nibbles and multiplied into two B tiles; the results must be the vector paths' bits.

As tests/test_tiles.py: every vector path with the emulated tiles on top (the unpack is AVX-512 on the avx512
path, portable C elsewhere), the hardware where it is granted; then a whole model with a q4 head (the bundled
one, converted with --lm-head q4): prefill, verify and a batched step of more than ROWS_MAX sequences.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.simd import _kernels as K
from bitnet_cpu.simd import layout
from test_tiles import VECTOR_ISAS, _bodies, _vector, tiles  # noqa: F401 (tiles: the fixture)


def _head(rng, n, k, s_max=63):
    q = rng.integers(-8, 8, size=(n, layout.pad_to(k, 64))).astype(np.int8)
    q[:, k:] = 0
    s = rng.integers(0, s_max + 1, size=(n, q.shape[1] // 32)).astype(np.uint8)
    d = np.zeros(layout.pad_to(n, 16), np.float32)
    d[:n] = rng.random(n, dtype=np.float32) + np.float32(0.25)
    return q, s, d


def _oracle(q, s, xq):
    n, m = q.shape[0], xq.shape[0]
    return np.einsum("ngc,mgc->mn", q.reshape(n, -1, 32).astype(np.int64) * s[:, :, None].astype(np.int64),
                     xq.reshape(m, -1, 32).astype(np.int64))


def _xq(rng, m, k):
    xq = np.zeros((m, layout.pad_to(k, 64)), np.int8)
    xq[:, :k] = rng.integers(-128, 128, size=(m, k))
    return xq


def _check(q, s, d, xq, sc, want_tiles=True):
    """The tiles' raw dots equal the oracle, their floats the vector path's and the formula's."""
    codes, gs = layout.pack_q4g(q), layout.pack_q4g_scales(s)
    m, n = xq.shape[0], q.shape[0]
    dots = _oracle(q, s, xq)
    assert np.abs(dots).max(initial=0) < 2 ** 31
    raw = np.zeros((m, n), np.int32)
    used = K._tile_products()
    K.gemv_q4g_i32(codes, gs, xq, raw)
    assert (K._tile_products() > used) == want_tiles     # the product ran on the tiles (or, below them, not)
    assert np.array_equal(raw, dots.astype(np.int32))
    out, ref = np.full((m, n), np.nan, np.float32), np.full((m, n), np.nan, np.float32)
    K.gemv_q4g(codes, gs, d, xq, sc, out)
    _vector(K.gemv_q4g, codes, gs, d, xq, sc, ref)
    assert np.array_equal(out.view(np.int32), ref.view(np.int32))
    assert np.array_equal(out, (dots.astype(np.int32).astype(np.float32) / sc[:, None]) * d[None, :n])


def test_q4_head_every_row_count_on_tiles(tiles):
    # every M around the 16-row groups (a lone group, pairs, the zero-padded tail), 64, one weight tile pair
    rng = np.random.default_rng(1)
    q, s, d = _head(rng, 37, 100)
    for m in list(range(1, 41)) + [64]:
        _check(q, s, d, _xq(rng, m, 100), rng.random(m, dtype=np.float32) + np.float32(0.1))


# the weights read ahead or not (set_tile_warm), each next tile unpacked beside the multiply or not
# (set_tile_overlap): ranges of one tile, two, and many (300 rows: 19 tiles); one and several row-group pairs
# and the streamed body at M <= 32 (set_tile_stream: each tile one 64-k step at a time through the ring; above 32
# rows the whole-K body runs as before), K of one step, two and many
@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("body", ["whole", "overlap", "stream"])
@pytest.mark.parametrize("n,k,m", [(16, 640, 17), (30, 2560, 16), (300, 2560, 33), (40, 64, 70), (33, 96, 5),
                                   (45, 6912, 32), (20, 128, 1)])
def test_q4_head_on_tiles_warm_or_not(tiles, warm, body, n, k, m):
    rng = np.random.default_rng(n + m + warm + 2 * len(body))
    q, s, d = _head(rng, n, k)
    _bodies(warm=warm, overlap=body == "overlap", stream=body == "stream")
    try:
        _check(q, s, d, _xq(rng, m, k), rng.random(m, dtype=np.float32) + np.float32(0.1))
    finally:
        _bodies()


# N not a multiple of 16, K_pad from 64 (K = 32: one group padded to two) to 8192 and K not a multiple of 64
@pytest.mark.parametrize("n,k,m", [(1, 32, 17), (16, 64, 9), (250, 68, 33), (33, 1000, 16), (300, 2560, 40),
                                   (45, 8192, 19), (129, 480, 64)])
def test_q4_head_on_tiles_equals_vector_path(tiles, n, k, m):
    rng = np.random.default_rng(n + k + m)
    q, s, d = _head(rng, n, k)
    s[:, 0] = 0                                         # an all-zero group scale
    xq = _xq(rng, m, k)
    xq[0, :k] = -128
    xq[-1, :k] = 127
    _check(q, s, d, xq, rng.random(m, dtype=np.float32) + np.float32(0.1))


def test_q4_head_extremes_on_tiles(tiles):
    # the largest dots the format allows: u = 0 / 15 (q = -8 / 7), s = 0 / 63, x = -128 / 127 over K = 8192
    n, k, m = 20, 8192, 17
    for u in (0, 15):
        for sv in (0, 63):
            for xv in (-128, 127):
                q = np.full((n, k), u - 8, np.int8)
                s = np.full((n, k // 32), sv, np.uint8)
                xq = np.full((m, k), xv, np.int8)
                d = np.ones(32, np.float32)
                _check(q, s, d, xq, np.ones(m, np.float32))
                raw = np.empty((m, n), np.int32)
                K.gemv_q4g_i32(layout.pack_q4g(q), layout.pack_q4g_scales(s), xq, raw)
                assert (raw == (u - 8) * sv * xv * k).all()


def test_q4_head_any_byte_scale_on_tiles(tiles):
    # the format's scales are 0..63; the split (16 s_hi + s_lo) keeps every byte exact, so even 64..255 give the
    # vector paths' dots (K small enough that no path overflows)
    rng = np.random.default_rng(7)
    q, s, d = _head(rng, 40, 256, s_max=255)
    s[:, 1] = 255
    _check(q, s, d, _xq(rng, 21, 256), rng.random(21, dtype=np.float32) + np.float32(0.1))


@pytest.mark.parametrize("threads", [2, 3])
def test_q4_head_on_tiles_split_over_threads(tiles, threads):
    # 45 tiles over the pool's 4-tile grains: ranges of odd length in every thread
    rng = np.random.default_rng(threads)
    q, s, d = _head(rng, 45 * 16 - 5, 448)
    K.set_num_threads(threads)
    _check(q, s, d, _xq(rng, 37, 448), rng.random(37, dtype=np.float32) + np.float32(0.1))


def test_q4_head_below_the_crossover_stays_on_the_vector_path():
    rng = np.random.default_rng(3)
    q, s, d = _head(rng, 50, 300)
    K.set_tiles("emu")
    try:
        for m, on_tiles in ((19, False), (20, True), (3, False)):
            K.set_tile_min_rows(20)         # (_check's vector run sets 1 again)
            _check(q, s, d, _xq(rng, m, 300), np.ones(m, np.float32), want_tiles=on_tiles)
    finally:
        K.set_tile_min_rows(0)
        K.set_isa(None)


@pytest.mark.parametrize("isa", VECTOR_ISAS, indirect=True)
def test_q4_head_takes_any_row_count_and_checks_the_rest(isa):
    # more than ROWS_MAX rows in one call (the vector bodies run up to 64 per pass) equal row by row
    rng = np.random.default_rng(4)
    q, s, d = _head(rng, 70, 192)
    codes, gs = layout.pack_q4g(q), layout.pack_q4g_scales(s)
    m = 2 * 64 + 5
    xq, sc = _xq(rng, m, 192), rng.random(m, dtype=np.float32) + np.float32(0.1)
    out = np.empty((m, 70), np.float32)
    K.gemv_q4g(codes, gs, d, xq, sc, out)
    for r in range(m):
        one = np.empty((1, 70), np.float32)
        K.gemv_q4g(codes, gs, d, xq[r: r + 1], sc[r: r + 1], one)
        assert np.array_equal(one[0], out[r])
    with pytest.raises(KernelError, match="rows"):
        K.gemv_q4g(codes, gs, d, xq, sc, out[:-1])
    with pytest.raises(KernelError, match="act_scale"):
        K.gemv_q4g(codes, gs, d, xq, sc[:-1], out)
    with pytest.raises(KernelError, match="K_pad"):       # K_pad is a multiple of 64 (of 32 is not enough)
        K.gemv_q4g_i32(np.zeros(16 * 96 // 2, np.uint8), np.zeros(16 * 96 // 32, np.uint8), np.zeros((1, 96), np.int8),
                       np.empty((1, 16), np.int32))


# ---------------------------------------------------------------- a whole model with a q4 head
@pytest.fixture(scope="module")
def q4_bundled(tmp_path_factory):
    from bitnet_cpu.engine.formats.convert import BUNDLED_HF_DIR, convert

    return convert(BUNDLED_HF_DIR, str(tmp_path_factory.mktemp("q4tiles") / "tiny.q4.bnstore"), lm_head="q4",
                   progress=False)


def _on_tiles_and_off(fn, monkeypatch):
    """fn() on the vector path (the best one, tiles off), then with the emulated tiles on it. Weights.q4_logits is
    watched: each row's logits with the tiles must equal the vector path's for the same activation row (the greedy
    tokens alone would hide an error: the best candidates are recomputed from the f16 rows). Returns both results
    and the row counts of the head calls that ran on the tiles."""
    from bitnet_cpu.engine.runtime.model import Weights

    head, on_tiles, seen, compared = Weights.q4_logits, [], {}, []

    def watched(self, xq, act_scale, h, out, *args):
        used = K._tile_products()
        head(self, xq, act_scale, h, out, *args)
        m = xq.shape[0]
        if K._tile_products() > used:
            on_tiles.append(m)
        for r in range(m):
            key = (xq[r].tobytes(), float(act_scale[r]), h[r].tobytes())
            if K.tiles() == "off":
                seen[key] = out[r].copy()
            elif key in seen:
                compared.append(np.array_equal(seen[key].view(np.int32), out[r].view(np.int32)))

    monkeypatch.setattr(Weights, "q4_logits", watched)
    try:
        K.set_isa(VECTOR_ISAS[-1])
        off = fn()
        assert not on_tiles
        K.set_tiles("emu")
        on = fn()
    finally:
        K.set_isa(None)
    assert len(compared) > K.ROWS_MAX and all(compared), f"{compared.count(False)} of {len(compared)} rows differ"
    return off, on, on_tiles


def test_q4_model_on_tiles_gives_the_same_logits_and_tokens(q4_bundled, monkeypatch):
    from bitnet_cpu.engine.api import SamplingParams, load_model

    llm = load_model(q4_bundled, ctx=128, threads=2, progress=False)
    assert llm.model.lm_head == "q4"
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)
    assert len(ids) > K.ROWS_MAX

    def run():
        llm.reset()
        full = llm.model.forward(ids).copy()            # every prompt row's logits
        llm.model.truncate(len(ids) - K.ROWS_MAX)
        rows = llm.model.verify(ids[-K.ROWS_MAX:]).copy()
        llm.reset()
        toks = [c.token for c in llm.generate(ids, SamplingParams(temperature=0), max_tokens=12) if c.token is not None]
        return full, rows, toks

    (full, rows, toks), (full_t, rows_t, toks_t), head_rows = _on_tiles_and_off(run, monkeypatch)
    assert K.ROWS_MAX in head_rows and 1 in head_rows      # verify's rows in one call; prefill / decode rows
    assert np.array_equal(full.view(np.int32), full_t.view(np.int32))
    assert np.array_equal(rows.view(np.int32), rows_t.view(np.int32))
    assert np.array_equal(rows, full[-K.ROWS_MAX:])
    assert toks == toks_t and len(toks) > 2


def test_q4_model_batched_step_of_many_sequences_on_tiles(q4_bundled, monkeypatch):
    """The batching engine with more sequences than ROWS_MAX: its q4 head runs every decode row in one call."""
    from bitnet_cpu.engine.api import SamplingParams, load_engine

    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,", "A tiny robot", "2+3=", "Hello",
               "What is 7+5?", "Cats and dogs", "The sun", "Rain falls", "Red, green,", "Bye"]
    assert len(prompts) > K.ROWS_MAX

    def run():
        eng = load_engine(q4_bundled, threads=2, parallel=len(prompts), ctx=128, progress=False)
        try:
            greedy = SamplingParams(temperature=0)
            streams = [eng.submit(eng.tokenizer.encode(p), greedy, max_tokens=8) for p in prompts]
            return [[c.token for c in s if c.token is not None] for s in streams]
        finally:
            eng.close()

    want, got, head_rows = _on_tiles_and_off(run, monkeypatch)
    assert len(prompts) in head_rows                    # a decode step of every sequence: one call, on the tiles
    assert got == want and all(len(t) > 0 for t in want)


# ---------------------------------------------------------------- every path in C (aarch64 under qemu)
HARNESS = r"""
#include "q4g.h"
#include "tiles.h"

/* every path this machine runs, with the emulated tiles on top against the same path without them: the q4 head,
 * M around the 16-row groups and over ROWS_MAX, N not a multiple of 16, K_pad 64 and 576, threads 1 and 3 */
int main(void) {
    static const int MS[6] = {1, 9, 16, 17, 33, 40}, KS[2] = {64, 576};
    const int n = 21 * 16 - 3, n_pad = 21 * 16;
    uint8_t *codes = malloc((size_t)n_pad * 576 / 2), *gs = malloc((size_t)n_pad * 576 / 32);
    int8_t *xq = malloc(40 * 576);
    float *d = malloc(4 * (size_t)n_pad), act_scale[40];
    float *a = malloc(4 * 40 * (size_t)n), *b = malloc(4 * 40 * (size_t)n);
    for (size_t i = 0; i < (size_t)n_pad * 576 / 2; i++) codes[i] = (uint8_t)rnd();
    for (size_t i = 0; i < (size_t)n_pad * 576 / 32; i++) gs[i] = (uint8_t)(rnd() % 64);
    for (int i = 0; i < n_pad; i++) d[i] = 0.5f + (rnd() % 1000) / 1000.0f;
    for (int i = 0; i < 40 * 576; i++) xq[i] = (int8_t)(rnd() % 256 - 128);
    for (int r = 0; r < 40; r++) act_scale[r] = 0.25f + (rnd() % 1000) / 500.0f;
    for (int p = 0; p < BK_N_ISA; p++) {
        if (!bk_isa_supported(p)) continue;
        for (int th = 1; th <= 3; th += 2)
            for (int kk = 0; kk < 2; kk++)
                for (int i = 0; i < 6; i++) {
                    const int m = MS[i], k_pad = KS[kk];
                    CHECK(bk_set_isa(p) == 0, "path %d", p);
                    bk_set_num_threads(th);
                    CHECK(bk_gemv_q4g(codes, gs, d, xq, m, k_pad, act_scale, a, NULL, n) == 0, "q4g");
                    CHECK(bk_set_tiles(BK_TILES_EMU) == 0, "emu tiles");
                    uint64_t used = bk_tiles_products();
                    CHECK(bk_gemv_q4g(codes, gs, d, xq, m, k_pad, act_scale, b, NULL, n) == 0, "q4g tiles");
                    CHECK(bk_tiles_products() > used, "tiles not taken path %d m %d", p, m);
                    CHECK(!memcmp(a, b, 4 * (size_t)m * n), "q4g tiles path %d m %d k %d threads %d", p, m, k_pad, th);
                }
    }
    return REPORT();
}
"""


def test_q4_head_on_emulated_tiles_under_every_aarch64_path(tmp_path):
    cross_c = pytest.importorskip("cross_c")
    if not (cross_c.CC_AARCH64 and cross_c.QEMU_AARCH64):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    cross_c.run_harness(tmp_path, HARNESS, name="tiles_q4_aarch64")


# ---------------------------------------------------------------- the benchmark's head sweep
def test_bench_tiles_times_the_q4_head(tmp_path):
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_tiles.py")
    out = tmp_path / "tiles.json"
    r = subprocess.run([sys.executable, bench, "--emu", "--quick", "--threads", "1", "--ms", "16", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    heads = {h["shape"]: h for h in json.loads(out.read_text())["head"]}
    assert set(heads) == {"head_i8", "head_q4"} and all(h["m"] == 16 and h["us_on"] > 0 for h in heads.values())
