"""Smoke test of bench/bench_embed.py at a tiny size: it serves the small synthetic model, sends the texts as
/v1/embeddings token lists in requests of --batch, and writes a report whose numbers add up. No timing is asserted
(speed is what the benchmark prints, not what a unit test checks); llama-server is not needed (ours only)."""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
import bench_embed  # noqa: E402
import make_models  # noqa: E402


def test_pieces(tmp_path, monkeypatch):
    ts = bench_embed.texts(5, 7, seed=1, vocab=50)
    assert len(ts) == 5 and all(len(t) == 7 and all(0 <= i < 50 for i in t) for t in ts)
    assert ts == bench_embed.texts(5, 7, seed=1, vocab=50)   # the same ids to both servers
    assert [len(b) for b in bench_embed.batches(list(range(10)), 4)] == [4, 4, 2]
    cs = bench_embed.cosines([[1, 0], [1, 1]], [[2, 0], [-1, -1]])
    assert np.allclose(cs, [1.0, -1.0])
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    # not executable: passed over (to PATH's, if any)
    assert bench_embed.find_llama_server(str(exe), str(tmp_path / "none")) == shutil.which("llama-server")
    exe.chmod(0o755)
    assert bench_embed.find_llama_server(str(exe), str(tmp_path / "none")) == str(exe)
    assert bench_embed.find_llama_server(None, str(tmp_path)) == str(exe)   # bench/cache/llama-server


def test_runs_ours_on_the_small_model(tmp_path):
    make_models.make(str(tmp_path), "small", f16=False, heads=("q4",), progress=False)
    out = tmp_path / "out"
    out.mkdir()
    rc = bench_embed.main(["--shape", "small", "--cache", str(tmp_path), "--out-dir", str(out), "--engines", "ours",
                           "--texts", "6", "--tokens", "20", "--batch", "4", "--repeats", "2"])
    assert rc == 0
    res = json.loads((out / "embed_results.json").read_text())
    r = res["engines"]["bitnet serve"]
    assert len(r["walls_s"]) == 2 and r["eps_best"] == pytest.approx(6 / min(r["walls_s"]))
    assert r["dim"] == 256 and "vectors" not in r
    md = (out / "EMBED_RESULTS.md").read_text()
    assert "| bitnet serve |" in md and "6 texts of 20" in md
