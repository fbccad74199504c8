"""Smoke tests of the benchmark harness (bench/) at tiny sizes: the pieces run and their arithmetic is right.
No timing is asserted (speed is what the benchmark prints, not what a unit test checks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import e2e_worker  # noqa: E402
import limits  # noqa: E402
import report  # noqa: E402


def test_stream_bandwidth_small_buffer():
    res = limits.stream_bandwidth(threads=1, mib=8, passes=2)
    assert res["bandwidth_Bps"] > 1e8  # anything below 100 MB/s means the measurement is broken
    assert res["buffer_bytes"] >= 8 << 20 and res["method"]


def test_int8_peak_is_the_best_of_its_passes_each_with_its_cpu_share():
    # one timed pass read a busy moment as the machine's peak (shares of it came out above 100%): every pass is kept
    # with its process CPU / wall, and the peak is the fastest of them, as the bandwidth probe takes its best pass
    res = limits.int8_peak(threads=1, passes=3, iters=200_000)
    assert res is not None and "peak_dot_error" not in res
    runs = res["register_peak_runs"]
    assert len(runs) == 3 and all(r["mac_per_s"] > 0 and r["cpu_per_wall"] > 0 for r in runs)
    best = max(runs, key=lambda r: r["mac_per_s"])
    assert res["register_peak_mac_per_s"] == best["mac_per_s"]
    assert res["peak_dot_cpu_per_wall"] == best["cpu_per_wall"]


def test_stats_and_dotted_lookup():
    assert report.stats([3.0, None, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert report.stats([None]) is None
    s = {"prefill_tps": {"512": 7.0}, "chat_ttft_s": [1.0, 2.0]}
    assert report._get(s, "prefill_tps.512") == 7.0
    assert report._get(s, "chat_ttft_s.1") == 2.0 and report._get(s, "chat_ttft_s.5") is None


def _session(engine, rep, decode, pp512, ttft1, ttft5, rss):
    return {"engine": engine, "repeat": rep, "load_s": 0.1, "first_token_s": 0.2, "decode_tps": decode,
            "prefill_tps": {"128": pp512 * 1.1, "512": pp512}, "ttft_s": 0.5,
            "chat_ttft_s": [ttft1, 0, 0, 0, ttft5], "peak_rss": rss}


def test_aggregate_pairs_ratios_per_repeat_and_checks_targets():
    sessions = [_session("ours", 0, 30.0, 150.0, 0.40, 0.44, 900 << 20),
                _session("llama", 0, 10.0, 50.0, 1.0, 1.5, 1200 << 20),
                _session("ours", 1, 24.0, 140.0, 0.40, 0.60, 950 << 20),
                _session("llama", 1, 12.0, 45.0, 1.0, 1.4, 1200 << 20)]
    table = report.aggregate(sessions, [], turns=5)
    # per-repeat ratios 3.0 and 2.0, not a ratio of medians (27 / 11)
    assert table["decode"]["ratio"]["min"] == pytest.approx(2.0)
    assert table["decode"]["ratio"]["max"] == pytest.approx(3.0)
    assert table["decode"]["ours"]["median"] == pytest.approx(27.0)
    assert table["chat_ttft_ratio"]["ours"]["max"] == pytest.approx(1.5)
    tg = {t["target"]: t for t in report.targets(table, ours_bytes_per_token=1 << 30, bandwidth_Bps=32 << 30,
                                                     store_bytes=1000 << 20, kv_bytes=100 << 20, turns=5,
                                                     peak_mac_per_s=None, macs_per_token=1e9)}
    assert tg["decode vs llama.cpp TQ2_0, same file"]["status"] == "met"  # median ratio 2.5
    bw = tg["decode share of read bandwidth"]  # 27 tok/s of a 32 tok/s limit = 84%
    assert bw["status"] == "met" and bw["measured"] == "84%"
    assert tg["prefill 512 vs 2x bitnet.cpp 67.5 tok/s (quoted)"]["status"] == "met"  # 145 >= 135
    assert tg["chat TTFT turn 5 within 20% of turn 1"]["status"] == "MISSED"  # median 1.3
    assert "1.08x over" in tg["chat TTFT turn 5 within 20% of turn 1"]["note"]


def test_quoted_peer_figures_are_not_compared_with_another_shape():
    """The quoted peer figures are of the 2B-4T shape: a run of another shape (--shape small) shows its ratios to
    them as n/a, with one line saying why, and the target set against them is n/a (it printed 616.90x and graded
    the 2B-4T target on a tiny model)."""
    sessions = [_session("ours", 0, 7000.0, 25000.0, 0.001, 0.002, 50 << 20)]
    table = report.aggregate(sessions, [], turns=5)
    kw = dict(ours_bytes_per_token=1 << 20, bandwidth_Bps=1e10, store_bytes=1 << 20, kv_bytes=1 << 20, turns=5,
              peak_mac_per_s=None, macs_per_token=1e6)
    name = "prefill 512 vs 2x bitnet.cpp 67.5 tok/s (quoted)"
    small = {t["target"]: t for t in report.targets(table, **kw, quoted_shape="small")}[name]
    assert small["status"] == "n/a" and "small" in small["note"] and small["measured"] == "25000.0 tok/s"
    assert {t["target"]: t for t in report.targets(table, **kw, quoted_shape="2b4t")}[name]["status"] == "met"
    ctx = {"command": "x", "date": "d", "machine": {"cpu": "c", "cores": 2, "flags": "f", "ram_gib": 1.0,
                                                     "kernel": "k", "python": "p", "numpy": "n",
                                                     "kernel_path": "avx2", "llama_cpp": "v"},
           "threads": 2, "limits": {"bandwidth_Bps": 1e10, "method": "m"}, "setup": [], "repeats": 1,
           "table": table, "bandwidth_rows": [], "targets": [],
           "quoted_rows": [{"name": "bitnet.cpp I2_S decode tok/s", "quoted": 12.6, "ours": 7000.0}]}
    quoted = lambda md: [ln for ln in md.splitlines() if ln.startswith("| bitnet.cpp I2_S decode")]
    assert quoted(report.markdown(dict(ctx, shape="small"))) == ["| bitnet.cpp I2_S decode tok/s | 12.6 | 7000 | n/a |"]
    assert "`small` shape" in report.markdown(dict(ctx, shape="small"))
    assert quoted(report.markdown(dict(ctx, shape="2b4t")))[0].endswith("| 555.56x |")


def test_markdown_and_chart(tmp_path):
    sessions = [_session("ours", 0, 30.0, 150.0, 0.4, 0.44, 900 << 20),
                _session("llama", 0, 10.0, 50.0, 1.0, 1.5, 1200 << 20)]
    table = report.aggregate(sessions, [dict(s, load_s=1.0) for s in sessions], turns=5)
    assert table["load_cold_s"]["ours"]["median"] == 1.0
    ctx = {"command": "x", "date": "d", "machine": {"cpu": "c", "cores": 2, "flags": "f", "ram_gib": 1.0,
                                                     "kernel": "k", "python": "p", "numpy": "n",
                                                     "kernel_path": "avx512", "llama_cpp": "v"},
           "threads": 2, "limits": {"bandwidth_Bps": 3.3e10, "method": "m"}, "setup": ["s"], "repeats": 1,
           "table": table, "bandwidth_rows": [{"engine": "ours", "bytes": 800 << 20, "what": "w", "limit": 39.0,
                                               "decode": 30.0}],
           "targets": [], "quoted_rows": [{"name": "bitnet.cpp I2_S decode tok/s", "quoted": 12.6, "ours": 30.0}]}
    md = report.markdown(ctx)
    assert "| decode (128 tokens) | tok/s | 30.0 (30.0 .. 30.0) | 10.0 (10.0 .. 10.0) | 3.00" in md
    assert "NOT measured in this run" in md and "2.38x" in md and "| 77% |" in md
    png = tmp_path / "r.png"
    if report.chart(table, str(png), "t"):
        assert png.stat().st_size > 1000


def test_evict_and_prompt_ids(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(1 << 20))
    ev = e2e_worker.evict(str(p))
    assert ev["method"].startswith("posix_fadvise")
    if ev["resident_after"] is not None:
        assert ev["resident_after"] < (1 << 20)
    ids = e2e_worker.prompt_ids(50, 0, 128256)
    assert len(ids) == 50 and all(256 <= t < 128000 for t in ids)
    assert ids == e2e_worker.prompt_ids(50, 0, 128256) != e2e_worker.prompt_ids(50, 1, 128256)


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    import make_models

    cache = str(tmp_path_factory.mktemp("bench_cache"))
    return make_models.make(cache, "small", f16=False, progress=False)


def _worker(engine, model, *extra):
    r = subprocess.run([sys.executable, os.path.join(BENCH, "e2e_worker.py"), "--engine", engine, "--model", model,
                        "--threads", "1", "--ctx", "1024", "--prefill", "8,32", "--decode", "8", "--turns", "3",
                        "--turn-tokens", "8", "--reply-tokens", "4", *extra],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_make_models_small(small_models):
    assert os.path.getsize(small_models["tq2_0"]) > 0 and os.path.getsize(small_models["store_i8"]) > 0
    from bitnet_cpu.engine.formats.store import Store

    with Store(small_models["store_i8"]) as st:
        assert st.meta.get("lm_head") == "i8" and st.config.hidden_size == 256
    with Store(small_models["store_q4"]) as st:   # the default head, what the sweeps run
        assert st.meta.get("lm_head") == "q4" and st.info("output")["layout"] == "q4g_tile16"


def test_make_models_converts_only_the_heads_asked_and_the_ik_file_alone(tmp_path):
    """A leased machine makes only what its run reads: --heads i8 converts that store alone; --only-ik writes the
    IQ2_BN file from the synthetic model without the TQ2_0 file (the quantizer here: a copy of its F16 input)."""
    import make_models

    quantize = tmp_path / "quantize"
    quantize.write_text('#!/bin/sh\ncp "$1" "$2"\n')
    quantize.chmod(0o755)
    ik = make_models.make(str(tmp_path / "a"), "small", progress=False, ik_quantize=str(quantize), only_ik=True)
    assert set(ik) == {"iq2_bn", "manifest"}
    got = make_models.make(str(tmp_path / "b"), "small", progress=False, heads=("i8",))
    assert set(got) == {"tq2_0", "store_i8", "manifest"}
    with pytest.raises(SystemExit):   # --only-ik without a quantizer is a usage error
        make_models.main(["--cache", str(tmp_path / "c"), "--shape", "small", "--only-ik"])
    assert not (tmp_path / "c").exists()


def test_make_models_sigterm_removes_the_store_being_written(small_models, tmp_path):
    """A SIGTERM while make_models converts (a script's timeout, a lease ending) unwinds as the CLI does: exit 143,
    no hidden .bnstore-* temporary left (over 1 GB at the 2B-4T shape), no store under the final name. The signal
    is sent from the conversion's own progress report, so it lands mid-write every time."""
    import shutil
    import signal

    import make_models

    cache = str(tmp_path)
    shutil.copy(small_models["tq2_0"], make_models.model_paths(cache, "small")["tq2_0"])
    code = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); import make_models; "
            "make_models.make(sys.argv[2], 'small', heads=('q4',), "
            "progress=lambda done, total: os.kill(os.getpid(), signal.SIGTERM))")
    r = subprocess.run([sys.executable, "-c", code, BENCH, cache], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    assert r.returncode == 128 + signal.SIGTERM and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert not [n for n in os.listdir(cache) if n.startswith(".bnstore-")], os.listdir(cache)
    assert not os.path.exists(make_models.model_paths(cache, "small")["store_q4"])


def test_i2s_file_holds_the_same_weights(small_models):
    """bitnet.cpp's row (decode_rows --bitnet-bench) runs make_i2s's I2_S file: the same ternary matrices and
    scales as the TQ2_0 file llama.cpp runs and our stores are converted from."""
    import make_models
    from bitnet_cpu.engine.formats.gguf import GGUFFile

    cache = os.path.dirname(small_models["tq2_0"])
    path = make_models.make_i2s(cache, "small")
    assert path == make_models.model_paths(cache, "small")["i2_s"]
    with GGUFFile(path) as i2s, GGUFFile(small_models["tq2_0"]) as tq:
        assert i2s.get("general.architecture", str) == "bitnet"
        names = [n for n, t in i2s.tensors.items() if t.type_name == "I2_S"]
        assert len(names) == 7 * 2 and set(names) <= set(tq.tensors)   # 7 matrices per layer, 2 layers
        for n in names:
            w_i, s_i = i2s.ternary(n)
            w_t, s_t = tq.ternary(n)
            np.testing.assert_array_equal(w_i, w_t)
            np.testing.assert_allclose(s_t, s_i[0], rtol=1e-3)   # TQ2_0 keeps the scale per block in f16


def test_worker_session_ours(small_models):
    res = _worker("ours", small_models["store_i8"])
    assert set(res["prefill_tps"]) == {"8", "32"} and all(v > 0 for v in res["prefill_tps"].values())
    assert res["decode_generated"] >= 1 and len(res["chat_ttft_s"]) == 3
    # each chat turn's prompt is the previous prompt + its reply + 8 new tokens
    assert res["chat_prompt_tokens"][0] == 8 and res["chat_prompt_tokens"][1] > 8 + 8
    assert res["peak_rss"] >= res["rss_baseline"] > 0


def test_worker_cold_ours(small_models):
    res = _worker("ours", small_models["store_i8"], "--mode", "cold")
    assert res["evict"]["method"].startswith("posix_fadvise") and res["first_token_s"] >= res["load_s"] > 0
    assert "prefill_tps" not in res


def test_worker_llama_if_installed(small_models):
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.skip("llama-cpp-python not installed (optional, `bash bench/setup_llama.sh`)")
    res = _worker("llama", small_models["tq2_0"])
    assert res["decode_generated"] == 9 and res["prefill_tps"]["32"] > 0 and len(res["chat_ttft_s"]) == 3


def test_bench_e2e_orchestrator_small(small_models, tmp_path):
    """The whole command on the tiny model, our engine only: report, chart and raw JSON are written; of our
    stores only the one it runs is converted (the i8 one was made and never read). Run from another directory with
    a relative --cache: its worker runs in the repository and was handed the relative path (every session failed)."""
    import shutil

    import make_models

    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    shutil.copy(small_models["tq2_0"], make_models.model_paths(cache, "small")["tq2_0"])
    out, png, js = tmp_path / "R.md", tmp_path / "r.png", tmp_path / "r.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_e2e.py"), "--quick", "--shape", "small",
                        "--cache", "cache", "--engines", "ours", "--ctx", "1024", "--threads", "1", "--bw-mib", "32",
                        "--out", str(out), "--png", str(png), "--json", str(js)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    md = out.read_text()
    assert "| prefill 512 tokens | tok/s |" in md and "## Targets" in md and "NOT measured" in md
    # the quoted 2B-4T peer figures are not divided into a tiny model's results
    peers = [ln for ln in md.splitlines() if ln.startswith(("| bitnet.cpp I2_S", "| llama.cpp TQ2_0 decode tok/s",
                                                                  "| llama.cpp TQ2_0 prefill"))]
    assert peers and all(ln.endswith("| n/a |") for ln in peers), peers
    raw = json.loads(js.read_text())
    assert {s["engine"] for s in raw["sessions"]} == {"ours"} and len(raw["cold"]) == 1 and not raw["failures"]
    assert raw["facts"]["bytes_per_token"] > 0 and raw["facts"]["macs_per_token"] > 0
    made = make_models.model_paths(cache, "small")
    assert os.path.exists(made["store_q4"]) and not os.path.exists(made["store_i8"])


def test_decode_rows_small(small_models, capsys):
    import decode_rows  # bench/decode_rows.py

    cache = os.path.dirname(small_models["tq2_0"])
    rc = decode_rows.main(["--cache", cache, "--shape", "small", "--heads", "i8,q4", "--tokens", "4",
                           "--repeats", "1", "--threads", "1", "--bw-mib", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = {ln.split("|")[1].strip(): ln for ln in out.splitlines() if ln.startswith("| ours")}
    # small stores are mapped by default ("auto"); --mmap rows say so too; t1.6 rows for the base-3 stores
    assert set(rows) == ({f"ours tile16 + {h} head, weights mapped{m}" for h in ("i8", "q4") for m in ("", " (--mmap)")}
                         | {f"ours tile16b3 (t1.6) + {h} head, weights mapped" for h in ("i8", "q4")})
    mb = {k: float(v.split("|")[2].split()[0]) for k, v in rows.items()}
    assert mb["ours tile16 + q4 head, weights mapped"] < mb["ours tile16 + i8 head, weights mapped"]  # q4 reads fewer
    assert mb["ours tile16b3 (t1.6) + q4 head, weights mapped"] < mb["ours tile16 + q4 head, weights mapped"]
    # every row has a share against the probes taken beside its runs
    assert all(v.split("|")[5].strip().endswith("%") and "-%" not in v.split("|")[5] for v in rows.values())
    assert "repetitive code | off" in out and "random ids | --draft-max 4" in out


def test_decode_rows_converts_a_missing_store_and_shows_no_ratio_it_lacks(small_models, tmp_path, capsys):
    """A t2 row whose store make_models did not write (here the f16 head: only the GGUF is in the cache) is
    converted and measured, not dropped (it printed an empty table and exited 1 without a word); a ratio with
    nothing to divide by is "-", not "-x"."""
    import shutil

    import decode_rows  # bench/decode_rows.py
    import make_models

    cache = str(tmp_path)
    shutil.copy(small_models["tq2_0"], make_models.model_paths(cache, "small")["tq2_0"])
    rc = decode_rows.main(["--cache", cache, "--shape", "small", "--heads", "f16", "--weights", "t2", "--no-mmap-rows",
                           "--tokens", "4", "--repeats", "1", "--threads", "1", "--bw-mib", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ours")]
    assert len(rows) == 1 and rows[0].startswith("| ours tile16 + f16 head"), out
    assert os.path.exists(make_models.model_paths(cache, "small")["store_f16"])
    assert not any(c.strip() == "-x" for ln in out.splitlines() if ln.startswith("|") for c in ln.split("|")), out
    with pytest.raises(SystemExit):   # a head that does not exist is a usage error, not a KeyError
        decode_rows.parse_args(["--heads", "q5"])


def test_bench_batch_arithmetic():
    from types import SimpleNamespace

    import bench_batch
    from bitnet_cpu.engine.synth import bitnet_2b4t_config

    c = bitnet_2b4t_config()
    hd = c["hidden_size"] // c["num_attention_heads"]
    cfg = SimpleNamespace(hidden_size=c["hidden_size"], q_dim=c["num_attention_heads"] * hd,
                          kv_dim=c["num_key_value_heads"] * hd, intermediate_size=c["intermediate_size"],
                          vocab_size=c["vocab_size"], n_layers=c["num_hidden_layers"])
    assert abs(bench_batch.macs_per_token(cfg) / 1e9 - 2.41) < 0.01   # the 2B-4T shape: 2.41 G per token
    # two sequences: first tokens at t=1 and t=2, then tokens at 3, 4 (both) -> 4 tokens in 2 s after t=2
    r = bench_batch.summarize(2, 0.0, [1.0, 2.0], [4.0, 4.0], [3, 3], [1.0, 2.0, 3.0, 3.0, 4.0, 4.0])
    assert r["agg_decode_tps"] == 2.0 and r["e2e_tps"] == 1.5
    assert r["ttft_median_s"] == 2.0 and r["ttft_max_s"] == 2.0 and r["generated"] == 6


def test_bench_batch_share_uses_the_best_peak_and_shows_cpu_per_wall(tmp_path):
    import bench_batch

    res = {"date": "d", "cpu": "c", "threads": 2, "load_start": "1.0", "load_end": "2.0", "gguf": "/x/m.gguf",
           "lm_head": "q4", "prompt": 32, "gen": 64, "llama": {"error": "skipped"}, "llama_gen": 64,
           "llama_levels": "4",
           "peak_start": 20e9, "peak_end": 10e9, "peak_start_cpu_wall": 1.97, "peak_end_cpu_wall": 1.02,
           "ours": {"macs_per_token": 1e9, "levels": [{"n": 4, "agg_decode_tps": 10.0, "ttft_median_s": 0.5,
                                                        "ttft_max_s": 0.6, "cpu_per_wall": 1.93}]}}
    bench_batch.report(res, str(tmp_path))
    md = open(tmp_path / "BATCH_RESULTS.md").read()
    row = next(ln for ln in md.splitlines() if ln.startswith("| 4 |"))
    # 10 tok/s x 1 G MACs of the better 20 G/s peak: 50% (the mean of a busy and a quiet probe read 67%)
    assert row.rstrip().endswith("| 50% | 1.93 |"), row
    assert "1.97" in md and "1.02" in md   # each probe's CPU / wall beside its peak


def test_bench_threads_table_ratios_and_plot(tmp_path):
    import bench_threads

    def sess(dec, pp, used=None):
        return {"decode_tps": dec, "prefill_tps": {"512": pp}, "threads_used": used}

    rows = [{"threads": 1, "limits": {"bandwidth_Bps": 20e9}, "ours": sess(10.0, 50.0), "llama": sess(5.0, 20.0),
             "ik": sess(8.0, 40.0), "serial": {"serial_s": 0.002}},
            {"threads": 2, "limits": {"bandwidth_Bps": 30e9}, "ours": sess(15.0, 80.0), "llama": {"error": "boom"},
             "serial": {"serial_s": 0.003}}]
    res = {"date": "d", "machine": "m", "cpus": 2, "available": 2, "physical": 2, "load": (1.0, 1.0, 1.0),
           "store": "s", "gguf": "g", "llama_cpp": "0.3", "decode": 8, "bytes_per_token": 1e9, "command": "c",
           "total_s": 1.0, "rows": rows, "busy": {"default": sess(12.0, 60.0, 2), "t1": sess(10.0, 40.0, 1)}}
    md = bench_threads.render(res)
    # threads 1: limit 20 tok/s, ours 50% of it, 2.00x llama / 1.25x ik decode, 2.50x / 1.25x prefill,
    # serial 2 ms = 2% of a 100 ms step
    assert ("| 1 | 20.0 | 20.0 | 10.0 | 5.0 | 8.0 | 2.00x | 1.25x | 50% | 50.0 | 20.0 | 40.0 | 2.50x | 1.25x | 1.00 "
            "| 2.00 | 2.0% |") in md
    # threads 2: prefill 80 vs linear 100 -> 0.80; the failed llama session shows as — and is listed; no ik row
    assert ("| 2 | 30.0 | 30.0 | 15.0 | — | — | — | — | 50% | 80.0 | — | — | — | — | 0.80 | 3.00 | 4.5% |"
            in md)
    assert "threads 2 llama: boom" in md
    assert "| default / -t 1 | 1.20x | 1.50x |" in md and "| default (2) |" in md
    bench_threads.plot(res, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_depth_peers_report_merges_runs_and_plots(tmp_path):
    import depth_peers

    def row(e, d, tps, share=None):
        r = {"engine": e, "depth": d, "tps": tps, "min": tps - 1, "max": tps, "n": 2}
        return r if share is None else {**r, "share": share}

    short = {"stream_Bps": [20e9, 21e9], "threads": 2, "path": "avx2", "rounds": 2, "prefill": 4096,
             "rows": [row("ours q8", 4096, 18.0, 0.7), row("ik_llama.cpp IQ2_BN_R4", 4096, 9.0, 0.4),
                      row("ours q8", None, 40.0), row("ik_llama.cpp IQ2_BN_R4", None, 32.0)]}
    long = {"stream_Bps": [19e9, 19e9], "threads": 2, "path": "avx2", "rounds": 1, "prefill": 0,
            "rows": [row("ours q8", 16384, 6.0, 0.35), row("ik_llama.cpp IQ2_BN_R4", 16384, 2.5, 0.2)]}
    files = []
    for i, res in enumerate((long, short)):
        files.append(str(tmp_path / f"r{i}.json"))
        with open(files[-1], "w") as f:
            json.dump(res, f)
    png = tmp_path / "d.png"
    assert depth_peers.main(["--report", *files, "--plot", str(png)]) == 0
    md = "\n".join(depth_peers.report_lines([long, short]))
    lines = [ln for ln in md.splitlines() if ln.startswith("| decode") or ln.startswith("| prefill")]
    # depth order across the two runs, prefill last with the run's prompt length; ratios ours q8 / peer
    assert [ln.split("|")[1].strip() for ln in lines] == ["decode at 4096"] * 2 + ["decode at 16384"] * 2 + \
        ["prefill pp4096"] * 2
    assert "| decode at 4096 | ik_llama.cpp IQ2_BN_R4 | 9.0 (8.0-9.0) | 40% | 2.00x |" in md
    assert "| decode at 16384 | ik_llama.cpp IQ2_BN_R4 | 2.5 (1.5-2.5) | 20% | 2.40x |" in md
    assert "| prefill pp4096 | ik_llama.cpp IQ2_BN_R4 | 32.0 (31.0-32.0) |  | 1.25x |" in md
    assert png.stat().st_size > 1000


def test_llama_bench_json_reader(tmp_path):
    """llama.cpp's and ik_llama.cpp's llama-bench -o json (bench/llama_bench.py): pp512 and tg lines become
    prefill / decode tok/s; a binary that fails is reported with its exit code and last line, not a traceback."""
    import stat

    from llama_bench import llama_bench

    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'build: 1234 (abcd)'\necho \"$@\" > " + str(tmp_path / "args") + "\n"
                    "cat <<'J'\n[\n {\"n_prompt\": 512, \"n_gen\": 0, \"avg_ts\": 321.5},\n"
                    " {\"n_prompt\": 0, \"n_gen\": 64, \"avg_ts\": 45.25}\n]\nJ\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = llama_bench(str(fake), "m.gguf", 8, 64, ("-rtr", "1"))
    assert out["decode_tps"] == 45.25 and out["prefill_tps"] == {"512": 321.5} and out["threads_used"] == 8
    assert (tmp_path / "args").read_text().split() == ["-m", "m.gguf", "-t", "8", "-p", "512", "-n", "64", "-r", "1",
                                                      "-o", "json", "-rtr", "1"]
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    bad = llama_bench(str(fake), "m.gguf", 1, 64)
    assert "exit 3" in bad["error"] and "failed to load model" in bad["error"]


@pytest.mark.parametrize("gap", [80.0, 86.0, 87.0])
def test_attention_peaked_builds_the_weights_it_names(gap):
    """attention_peaked.py's layer: with values 0 at the two top positions, each output is the sum of the other
    positions' weights x 2^-7, so it shows the weights are exp(-gap) / 2: at gap 80 and 86 normal floats, the sum
    they give; at 87 under FLT_MIN (subnormal), which the kernel counts as 0."""
    import attention_peaked

    depth = 256
    call, caches, out = attention_peaked.layer(depth, gap, threads=1, n_caches=1, zero_top=True)
    call(*caches[0])
    w = np.exp(-gap) / 2
    subnormal = w < np.finfo(np.float32).tiny
    assert subnormal == (gap == 87.0)
    np.testing.assert_allclose(out, 0.0 if subnormal else (depth - 1) * w * 2.0 ** -7, rtol=1e-2, atol=0)



def test_depth_sweep_prefill_attention_rows_against_the_fma_peak(capsys):
    """depth_sweep.py --prefill-attention needs no model: one layer's chunk attention per cache type, the f16 row
    also as f32 multiply-adds per second and a share of the FMA peak measured in the same run."""
    import depth_sweep

    assert depth_sweep.main(["--prefill-attention", "0,40", "--chunk", "8", "--kv", "f16,q8", "--threads", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| f16")
            or line.startswith("| q8")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("f16", "0"), ("q8", "0"), ("f16", "40"), ("q8", "40")]
    for r in rows:
        assert (float(r[4]) > 0) if r[0].strip() == "f16" else r[4].strip() == "-"


def test_serve_stall_runs_each_batch_size(small_models, tmp_path, capsys):
    """serve_stall.py: a real bitnet serve per -b (loopback, stopped after), streams then a long prompt; each -b
    has its gaps counted from every stream's tokens, the prompt's time under load and alone, and a table row."""
    pytest.importorskip("fastapi", reason="serve_stall.py starts bitnet serve (pip install .[serve])")
    import serve_stall  # bench/serve_stall.py

    out = tmp_path / "stall.json"
    assert serve_stall.main(["--store", small_models["store_q4"], "--threads", "1", "--streams", "2", "--gen", "6",
                             "--prompt", "40", "--batch", "8,64", "--json", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert set(raw["runs"]) == {"8", "64"}
    for runs in raw["runs"].values():
        (r,) = runs
        assert r["gaps"] >= 2 * 4 and 0 <= r["gap_p50_s"] <= r["gap_p99_s"] <= r["gap_max_s"]
        assert r["answer_s"] > 0 and r["alone_s"] > 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 8 |", "| 64 |"))]
    assert len(table) == 2
    assert serve_stall.main(["--store", small_models["store_q4"], "--streams", "16"]) == 2


def test_bench_apis_counts_every_apis_tokens(small_models, tmp_path, capsys):
    """bench_apis.py: one real bitnet serve (loopback, stopped after), the same streaming load through chat,
    Responses, Messages, /completion and chat through a `--models-dir` router; every API's answers are counted from its own final event (each request
    makes --gen tokens, eos ignored), a table row per API with its ratio to chat."""
    pytest.importorskip("fastapi", reason="bench_apis.py starts bitnet serve (pip install .[serve])")
    import bench_apis  # bench/bench_apis.py

    out = tmp_path / "apis.json"
    assert bench_apis.main(["--store", small_models["store_q4"], "--threads", "1", "--clients", "3", "--requests",
                            "2", "--gen", "5", "--rounds", "2", "--json", str(out), "--router"]) == 0
    raw = json.loads(out.read_text())["results"]
    assert set(raw) == {"chat", "responses", "messages", "completion", "router"}   # router: chat via --models-dir
    for api, runs in raw.items():
        assert len(runs) == 2
        for r in runs:
            assert r["tokens"] == 3 * 2 * 5, (api, r)   # every answer's count, from its API's own final event
            assert r["tok_s"] > 0 and r["ttft_ms"] > 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line.endswith("x |")]
    assert len(rows) == 5 and rows[0].startswith("| chat |") and rows[0].endswith("1.000x |")
    with pytest.raises(SystemExit):
        bench_apis.main(["--store", small_models["store_q4"], "--apis", "chat,grpc"])


def test_batch_depth_parts_times_a_batched_step(small_models, tmp_path, capsys):
    """batch_depth.py --parts: a batched step of 8 sequences kernel by kernel, ms per step per mode (avx512 and amx
    where the tiles are), the paged attention and every GEMM shape among the parts, the kernels within the wall."""
    import batch_depth  # bench/batch_depth.py
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.simd import _kernels as K

    out = tmp_path / "bparts.json"
    assert batch_depth.main(["--parts", "--store", small_models["store_q4"], "--seqs", "8", "--depth", "40",
                             "--steps", "2", "--rounds", "2", "--threads", "1", "--kv", "f16,q8",
                             "--json", str(out)]) == 0
    text = capsys.readouterr().out
    raw = json.loads(out.read_text())
    assert set(raw["tables"]) == {"f16", "q8"}
    with Store(small_models["store_q4"]) as st:
        c = st.config
    shapes = {(c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.hidden_size, 2 * c.intermediate_size}
    for kv, t in raw["tables"].items():
        parts = {r["part"]: r for r in t["rows"]}
        assert ("attention_paged_q8" if kv == "q8" else "attention_paged") in parts, (kv, set(parts))
        gemms = {int(p.split()[1].split("x")[0]) for p in parts if p.startswith(("gemm_ternary", "gemv_rows_ternary"))}
        assert gemms == shapes, (kv, set(parts))
        assert K.active() != "amx" or t["modes"] == ["avx512", "amx"]
        for m in t["modes"]:
            kernels = sum(r[m] for p, r in parts.items() if p not in ("wall", "python and the rest"))
            assert 0 < kernels <= parts["wall"][m] and t["tok_s"][m] > 0
            assert f"{m}: {t['tok_s'][m]:.1f} tok/s" in text


def test_prefill_parts_times_every_gemm_shape_and_attention(small_models, tmp_path, capsys):
    import prefill_parts  # bench/prefill_parts.py
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.simd import _kernels as K

    out = tmp_path / "parts.json"
    assert prefill_parts.main(["--store", small_models["store_q4"], "--threads", "1", "--prompt", "24", "--rounds",
                               "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    with Store(small_models["store_q4"]) as st:
        c = st.config
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    k_pad = lambda k: -(-k // 64) * 64   # noqa: E731
    want = {f"gemm_ternary {n}x{k_pad(k)}" for n, k in ((qkv, c.hidden_size), (c.hidden_size, c.hidden_size),
                                                         (2 * c.intermediate_size, c.hidden_size),
                                                         (c.hidden_size, c.intermediate_size))}
    raw = json.loads(out.read_text())
    parts = {r["part"]: r for r in raw["rows"]}
    assert want <= set(parts), (want, set(parts))
    assert "attention" in parts and "add_rmsnorm_quant" in parts
    mode = raw["modes"][0]
    kernels = sum(r[mode] for p, r in parts.items() if p not in ("wall", "python and the rest"))
    assert 0 < kernels <= parts["wall"][mode]
    assert f"{mode}: " in text and "tok/s" in text
    assert K.active() != "amx" or raw["modes"] == ["avx512", "amx"]   # where the tiles are, both sides
    # two chunk sizes: a column per (path, chunk), the same GEMM shapes in both
    assert prefill_parts.main(["--store", small_models["store_q4"], "--threads", "1", "--prompt", "24", "--rounds",
                               "1", "--chunks", "8,24", "--json", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert raw["chunks"] == [8, 24] and sorted({m.split(" chunk ")[1] for m in raw["modes"]}) == ["24", "8"]
    gemm = [r for r in raw["rows"] if r["part"] in want]
    assert len(gemm) == 4 and all(r[m] > 0 for r in gemm for m in raw["modes"])
    # both attention precisions: a column each, attention timed in both, the process left at f32
    from bitnet_cpu.simd import _ops as ops

    assert prefill_parts.main(["--store", small_models["store_q4"], "--threads", "1", "--prompt", "24", "--rounds",
                               "1", "--attention", "f32,bf16", "--json", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert raw["attention"] == ["f32", "bf16"] and {m.split()[-1] for m in raw["modes"]} == {"f32", "bf16"}
    att = next(r for r in raw["rows"] if r["part"] == "attention")
    assert all(att[m] > 0 for m in raw["modes"]) and ops.attention_precision() == "f32"
    assert prefill_parts.main(["--store", small_models["store_q4"], "--attention", "fp8"]) == 2
