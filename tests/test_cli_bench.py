"""`bitnet bench` (cli/bench.py), llama-bench's flags and table, as a real subprocess on a small synthetic model:
every test is a row (pp, tg, pp+tg; per thread count), the formats for scripts carry the same records, the
numbers are consistent with themselves (mean and spread of the samples, the rate from the times), and bad flags
are one line and exit 2. No rate is asserted against a bound: the machine is shared."""
from __future__ import annotations

import csv
import io
import json
import os
import statistics
import subprocess
import sys

import pytest

from test_model_fixtures import make_synth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("bench"), seed=5, lm_heads=("f16",))[2]["f16"]


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_table_has_a_row_per_test(store):
    r = bench("-m", store, "-p", "16,32", "-n", "4", "-pg", "8,3", "-r", "2", "-t", "1", "-npl", "1,2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split("|")[1:-1] and [c.strip() for c in lines[0].split("|")[1:-1]] == \
        ["model", "size", "params", "backend", "threads", "test", "t/s"]
    rows = [[c.strip() for c in x.split("|")[1:-1]] for x in lines[2:]]
    assert [row[5] for row in rows] == ["pp16", "pp32", "tg4", "pp8+tg3", "pp16 x2", "pp32 x2", "tg4 x2",
                                        "pp8+tg3 x2"]
    for row in rows:
        assert row[4] == "1" and row[3].startswith("CPU ")
        mean, spread = (float(x) for x in row[6].split("±"))
        assert mean > 0 and spread >= 0


def test_a_test_that_fills_the_trained_context_is_no_warning():
    """A prompt test as long as the bundled model's trained context (512: pp512, the default test) fits it and
    warns of nothing (it warned of a '-c/--ctx 513' nobody gave); a longer test says so in the bench's own terms."""
    from bitnet_cpu.engine.api import load_model
    n = load_model(None, progress=False).config.context_length
    r = bench("-p", str(n), "-n", "4", "-r", "1", "-t", "1")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    r = bench("-p", "0", "-n", "0", "-pg", f"{n},16", "-r", "1", "-t", "1")
    assert r.returncode == 0 and f"the longest test runs {n + 16} positions, past the {n}" in r.stderr, r.stderr
    assert "-c/--ctx" not in r.stderr


def test_records_are_consistent(store):
    r = bench("-m", store, "-p", "16", "-n", "5", "-r", "3", "-t", "1,2", "-npl", "1,3", "-o", "json")
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)
    assert [(x["n_threads"], x["n_parallel"], x["n_prompt"], x["n_gen"]) for x in recs] == \
        [(t, b, pp, tg) for t in (1, 2) for b in (1, 3) for pp, tg in ((16, 0), (0, 5))]
    for x in recs:
        assert len(x["samples_ns"]) == len(x["samples_ts"]) == 3
        for ns, ts in zip(x["samples_ns"], x["samples_ts"]):   # every sequence's tokens over the run's time
            assert ts == pytest.approx(x["n_parallel"] * (x["n_prompt"] + x["n_gen"]) / (ns / 1e9), rel=1e-4)
        assert x["avg_ts"] == pytest.approx(statistics.mean(x["samples_ts"]))
        assert x["stddev_ts"] == pytest.approx(statistics.stdev(x["samples_ts"]))
        assert x["model_size"] == os.path.getsize(store) and x["model_n_params"] > 0
    many = bench("-m", store, "-p", "4", "-n", "1", "-r", "1", "-t", "1", "-npl", "80", "-o", "json")   # > max_queue
    assert many.returncode == 0 and [x["n_parallel"] for x in json.loads(many.stdout)] == [80, 80], many.stderr
    lines = bench("-m", store, "-p", "8", "-n", "0", "-r", "2", "-t", "1", "-o", "jsonl").stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["n_prompt"] == 8
    table = list(csv.DictReader(io.StringIO(bench("-m", store, "-p", "8", "-n", "2", "-r", "2", "-t", "1",
                                                  "-o", "csv").stdout)))
    assert [(x["n_prompt"], x["n_gen"]) for x in table] == [("8", "0"), ("0", "2")]
    assert all(float(x["avg_ts"]) > 0 for x in table)


# llama-bench's record fields, in its order (tools/llama-bench/llama-bench.cpp, test::get_fields): what scripts and
# llama.cpp's compare-llama-bench.py read
LLAMA_BENCH_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type", "model_size",
    "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll", "type_k", "type_v",
    "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "load_mode", "lazy_mode", "embeddings", "no_op_offload", "no_host", "repack",
    "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns", "avg_ts",
    "stddev_ts"]


def test_records_carry_llama_bench_s_fields_and_a_list_flag_adds_up(store):
    """The records start with llama-bench's fields in its order (model_filename as -m gave it, test_time as
    %FT%TZ, the KV cache's type as type_k / type_v); a list flag given twice runs both, as llama-bench."""
    import datetime
    r = bench("-m", store, "-p", "8", "-p", "12", "-n", "0", "-r", "1", "-t", "1", "--kv", "q8", "-o", "jsonl")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["n_prompt"] for x in recs] == [8, 12]
    for x in recs:
        assert [*x][:len(LLAMA_BENCH_FIELDS)] == LLAMA_BENCH_FIELDS
        assert x["model_filename"] == store and (x["type_k"], x["type_v"]) == ("q8_0", "q8_0")
        datetime.datetime.strptime(x["test_time"], "%Y-%m-%dT%H:%M:%SZ")
    # -m given twice tests both models, one after the other (only the last was tested)
    default = os.path.join(ROOT, "models", "default.bnstore")
    r = bench("-m", store, "-m", default, "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-o", "jsonl")
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["model_filename"] for x in r.stdout.splitlines()] == [store, default]
    header = bench("-m", store, "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-o", "csv").stdout.splitlines()[0]
    assert header.split(",")[:len(LLAMA_BENCH_FIELDS)] == LLAMA_BENCH_FIELDS


def test_depth_runs_each_test_after_that_many_tokens(store):
    """-d N (llama-bench's n_depth): every test again with N tokens already in the context, named 'pp8 @ d16' in
    the table and recorded as n_depth; on one sequence only (with -npl above 1, one line)."""
    r = bench("-m", store, "-p", "8", "-n", "3", "-d", "0,16", "-r", "1", "-t", "1", "-o", "jsonl")
    assert r.returncode == 0, r.stderr
    assert [(x["n_prompt"], x["n_gen"], x["n_depth"]) for x in map(json.loads, r.stdout.splitlines())] == \
        [(8, 0, 0), (0, 3, 0), (8, 0, 16), (0, 3, 16)]
    md = bench("-m", store, "-p", "8", "-n", "0", "-d", "16", "-r", "1", "-t", "1").stdout
    assert "pp8 @ d16" in md
    bad = bench("-m", store, "-d", "16", "-npl", "2")
    assert bad.returncode == 2 and "-npl" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, needle", [
    (("-p", "x"), "-p/--n-prompt"),
    (("-p", "-4"), "-p/--n-prompt"),
    (("-t", "two"), "-t/--threads"),
    (("-npl", "0"), "-npl"),
    (("-pg", "5"), "-pg"),
    (("-p", "0", "-n", "0"), "no tests"),
    (("-r", "0"), "--repetitions"),
    (("-o", "xml"), "-o/--output"),
])
def test_bad_flags_are_one_line(store, args, needle):
    r = bench("-m", store, *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([x for x in r.stderr.splitlines() if "error" in x]) == 1


def test_a_kv_type_other_than_f16_has_its_columns(store):
    """--kv q8: the md table has llama-bench's type_k and type_v columns after threads (an f16 run's table, which
    has none, was printed for it); the row says q8_0 in both."""
    r = bench("-m", store, "-p", "8", "-n", "0", "-r", "1", "-t", "1", "--kv", "q8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert head == ["model", "size", "params", "backend", "threads", "type_k", "type_v", "test", "t/s"]
    assert len(lines[1].split("|")) == len(lines[0].split("|"))
    row = dict(zip(head, (c.strip() for c in lines[2].split("|")[1:-1])))
    assert row["type_k"] == row["type_v"] == "q8_0" and row["test"] == "pp8"


def test_threads_0_is_the_default_count(store):
    """-t 0 is the default thread count, as `bitnet run -t 0` takes it (bench refused it: 'integers >= 1')."""
    from bitnet_cpu.engine.cpu import default_threads
    r = bench("-m", store, "-p", "8", "-n", "0", "-r", "1", "-t", "0", "-o", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["n_threads"] == default_threads() >= 1


def test_a_bad_model_is_found_before_any_test_and_a_failed_run_keeps_its_json_whole(store, tmp_path):
    """A missing -m after a good one: one line before anything runs (it ran the first model's tests, then
    failed); a model that fails to load after rows were printed leaves a whole JSON array (it was left open)."""
    r = bench("-m", store, "-m", str(tmp_path / "nope.bnstore"), "-p", "8", "-n", "0", "-r", "1", "-t", "1",
              "-o", "json")
    assert r.returncode == 2 and r.stdout == "" and "nope.bnstore" in r.stderr, r.stderr
    broken = tmp_path / "broken.bnstore"
    broken.write_bytes(open(store, "rb").read()[:4096])   # a store's start: found, refused at load
    r = bench("-m", store, "-m", str(broken), "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-o", "json")
    assert r.returncode == 2 and "broken.bnstore" in r.stderr, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 1 and rows[0]["n_prompt"] == 8


def test_ctrl_c_keeps_the_rows_printed(store):
    """Ctrl-C during a test: exit 130, one line, the rows already printed kept (a table a user can still read)."""
    import signal
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "bench", "-m", store, "-p", "8", "-n", "4000", "-r",
                          "1000", "-t", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # a suite started in the background has SIGINT ignored, and a child keeps that: reset it
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        rows = [p.stdout.readline() for _ in range(3)]   # the head, its rule, then the pp8 row: tg4000 is running
        assert "pp8" in rows[2], rows
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert "tg4000" not in rest
