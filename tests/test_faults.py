"""Model files truncated while they are mapped (subprocess tests): `bitnet run` mid-generation, `bitnet convert`
mid-conversion, bitchat between turns. Each must end with one line naming the file, exit 2, no temporary file
left behind, and bitchat must leave the conversation on disk; a SIGBUS outside any model file is still a crash
(a bug), after removing the registered temporary files."""
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir
from helpers import slowness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    small = SynthModel(small_config(num_hidden_layers=2, vocab_size=512), seed=5)
    write_hf_dir(small, str(d / "hf"))
    store = convert(str(d / "hf"), str(d / "m.bnstore"), progress=False)
    # big enough that converting it takes a while (the test truncates it mid-conversion)
    big = SynthModel(small_config(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, vocab_size=32768),
                     seed=6)
    write_hf_dir(big, str(d / "hf_big"))
    return d, store


def _one_line_error(stderr: str, path: str):
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr
    assert lines and "changed or was truncated while in use" in lines[-1] and path in lines[-1], stderr
    return lines[-1]


def test_run_store_truncated_during_generation(models, tmp_path):
    d, store = models
    victim = str(tmp_path / "victim.bnstore")
    shutil.copy(store, victim)
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "run", "-m", victim, "-p", "Once", "-n", "100000",
                          "-c", "60000", "--temp", "0.9", "--seed", "1", "-t", "1", "--mmap"], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.read(1)            # generation is under way
        os.truncate(victim, 4096)          # a `cp` over the file / a full disk
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 2, (p.returncode, err)
    _one_line_error(err.decode(), victim)
    assert os.listdir(tmp_path) == ["victim.bnstore"]   # nothing temporary left next to it


def test_run_store_read_into_memory_survives_truncation(models, tmp_path):
    # --no-mmap: the weights were read when the model loaded; the file changing afterwards cannot hurt the run
    d, store = models
    victim = str(tmp_path / "victim.bnstore")
    shutil.copy(store, victim)
    cmd = [sys.executable, "-m", "bitnet_cpu", "run", "-m", victim, "-p", "Once", "-n", "1500", "-c", "2048",
           "--ignore-eos", "--temp", "0.9", "--seed", "1", "-t", "1", "--no-mmap", "-v"]
    # 1500 tokens: a second or two here, minutes under qemu: the bounds scale with this interpreter's speed
    bound = 120 * slowness()
    whole = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, timeout=bound)
    assert whole.returncode == 0, whole.stderr.decode()
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = os.read(p.stdout.fileno(), 1)   # generation is under way (unbuffered: communicate reads the fd)
        os.truncate(victim, 4096)
        out, err = p.communicate(timeout=bound)
    finally:
        p.kill()
    assert p.returncode == 0, err.decode()
    assert "weights in memory" in err.decode() and "generated: 1500 tokens" in err.decode()
    assert first + out == whole.stdout     # the same text as the run the file stayed whole for


def test_convert_source_truncated_mid_conversion(models, tmp_path):
    d, _ = models
    src = str(tmp_path / "hf_big")
    shutil.copytree(str(d / "hf_big"), src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / "big.bnstore")
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "convert", src, "-o", out, "--no-progress"], cwd=ROOT,
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not glob.glob(str(out_dir / ".bnstore-*")) and p.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.002)
        os.truncate(os.path.join(src, "model.safetensors"), 4096)   # the download is still being written
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 2, (p.returncode, err)
    _one_line_error(err, "model.safetensors")
    assert os.listdir(out_dir) == [], "the temporary store must be removed"


def test_bitchat_keeps_the_transcript(models, tmp_path):
    d, store = models
    victim = str(tmp_path / "chat.bnstore")
    shutil.copy(store, victim)
    recovery = str(tmp_path / "state" / "recovery.json")
    env = dict(ENV, BITCHAT_RECOVERY=recovery, BITCHAT_HISTORY="")
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu.cli.chat", "-m", victim, "-n", "6", "--temp", "0", "-t", "1"],
                         cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        p.stdin.write("first question\n")
        p.stdin.flush()
        first_answer = p.stdout.readline().rstrip("\n")   # the user has seen the first answer
        os.truncate(victim, 4096)
        p.stdin.write("second question\n")
        p.stdin.close()
        p.wait(timeout=60)
        err = p.stderr.read()
    finally:
        p.kill()
    assert p.returncode == 2, (p.returncode, err)
    line = _one_line_error(err, victim)
    assert recovery in line
    saved = json.load(open(recovery, encoding="utf-8"))
    assert [t["user"] for t in saved["turns"]] == ["first question", "second question"]
    assert saved["turns"][0]["assistant"] == first_answer and saved["turns"][1]["assistant"] is None


def test_bitchat_normal_exit_removes_the_recovery_copy(models, tmp_path):
    _, store = models
    recovery = str(tmp_path / "recovery.json")
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu.cli.chat", "-m", store, "-n", "4", "--temp", "0", "--seed", "-1"],
                       cwd=ROOT, env=dict(ENV, BITCHAT_RECOVERY=recovery, BITCHAT_HISTORY=""), input="hello\n",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and not os.path.exists(recovery)


def test_bitchat_ctrl_c_between_turns_says_where_the_transcript_is(models, tmp_path):
    """Ctrl-C while a piped bitchat waits for its next line: exit 130, and the turns so far stay in the recovery
    copy, which the one line names (it used to be left behind unannounced, one file per interrupted session)."""
    _, store = models
    recovery = str(tmp_path / "recovery.json")
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu.cli.chat", "-m", store, "-n", "4", "--temp", "0", "-t", "1"],
                         cwd=ROOT, env=dict(ENV, BITCHAT_RECOVERY=recovery, BITCHAT_HISTORY=""), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        p.stdin.write("hello\n")
        p.stdin.flush()
        p.stdout.readline()   # the answer is out: the session now waits for the next line
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert recovery in err and "Traceback" not in err
    assert [t["user"] for t in json.load(open(recovery, encoding="utf-8"))["turns"]] == ["hello"]


def test_sigbus_outside_model_files_is_still_a_crash(tmp_path):
    """The guard only speaks for registered maps: any other SIGBUS is reported as a bug and kills the process
    as before (core dump, faulthandler), after unlinking the registered temporary files."""
    mapped, tmp = str(tmp_path / "other.bin"), str(tmp_path / "partial.tmp")
    code = f"""
import mmap, os
from bitnet_cpu.engine import faults
faults.install("bitnet")
open({tmp!r}, "wb").close()
with open({mapped!r}, "wb") as f:
    f.write(b"x" * 65536)
f = open({mapped!r}, "rb")
mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
with faults.removed_on_fault({tmp!r}):
    os.truncate({mapped!r}, 0)
    mm[40000]
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == -7, (r.returncode, r.stderr)   # SIGBUS
    assert "outside any model file: this is a bug, please report it" in r.stderr
    assert not os.path.exists(tmp)


def test_serve_store_truncated_while_serving_says_it_as_the_server(models, tmp_path):
    """A single-model server whose (mapped) store is truncated under it: one line and exit 2, starting
    "bitnet serve:" as every other line of the server (it was "bitnet: error:", the command line's prefix)."""
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    import httpx
    from serve_proc import Server
    d, store = models
    victim = str(tmp_path / "victim.bnstore")
    shutil.copy(store, victim)
    s = Server("-m", victim, "--mmap", "-c", "256", threads=1)
    try:
        body = {"prompt": "Once", "max_tokens": 8, "temperature": 0}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60 * slowness()).status_code == 200
        os.truncate(victim, 4096)
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(s.url + "/v1/completions", json=body, timeout=60 * slowness())
        s.proc.wait(timeout=60 * slowness())
    finally:
        rc, err = s.stop()
    assert rc == 2, (rc, err)
    line = _one_line_error(err, victim)
    assert line.startswith("bitnet serve: error: "), err
