"""What a stopped command leaves behind: a conversion ended by SIGTERM / SIGHUP (a service stopped, its terminal
closed) removes its temporary store, in `bitnet convert` and in `bitnet serve`'s first load alike; temporary
stores left by a killed writer are cleared once stale; the router's key directory goes whatever ends it. Real
processes and signals; the sizes are chosen so the conversion is still writing when the signal comes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bitnet_cpu.engine.formats.store import STALE_TMP_S, write_store
from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_tq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory):
    """~60 MB of TQ2_0: its conversion writes for a second or more here."""
    m = SynthModel(small_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=8,
                                num_key_value_heads=4, vocab_size=512), seed=1)
    return write_gguf_tq(m, str(tmp_path_factory.mktemp("big") / "big.gguf"))


def _temps(d):
    return [n for n in os.listdir(d) if n.startswith(".bnstore-")] if os.path.isdir(d) else []


def _signal_while_writing(cmd, watch, sig, env=None, cwd=None):
    """Start cmd, send `sig` once a temporary store appears in `watch`; (exit status, stderr). None when the
    command ended before one was seen (then the caller tries again)."""
    path = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         env=dict(os.environ, PYTHONPATH=path, **(env or {})))
    deadline = time.monotonic() + 120
    while p.poll() is None and not _temps(watch) and time.monotonic() < deadline:
        time.sleep(0.002)
    if p.poll() is not None:
        p.communicate()
        return None
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_conversion_stopped_by_a_signal_removes_its_temporary_store(big_gguf, tmp_path, sig):
    """`bitnet convert` under SIGTERM / SIGHUP: exit 128 + signum with one line, and no hidden .bnstore-* (the
    signal's default action killed it mid-write, leaving up to hundreds of MB unseen in the directory)."""
    out = tmp_path / "out"
    out.mkdir()
    for _ in range(3):
        got = _signal_while_writing([sys.executable, "-m", "bitnet_cpu", "convert", big_gguf, "-o",
                                     str(out / "big.bnstore")], str(out), sig)
        if got is not None:
            break
        os.unlink(out / "big.bnstore")
    else:
        pytest.fail("the conversion always ended before its temporary store could be seen")
    code, err = got
    assert code == 128 + sig, err
    assert f"terminated ({signal.Signals(sig).name})" in err and "Traceback" not in err
    assert _temps(str(out)) == [] and not (out / "big.bnstore").exists()


def test_serve_stopped_during_its_first_load_removes_the_partial_store(big_gguf, tmp_path):
    """`bitnet serve -m model.gguf` converts into the cache in a thread; a SIGTERM then drains and exits, and the
    conversion's temporary store went with the thread unfinished (656 MB seen for the 2B model)."""
    from serve_proc import free_port
    cache = tmp_path / "cache"
    for _ in range(3):
        got = _signal_while_writing([sys.executable, "-m", "bitnet_cpu", "serve", "-m", big_gguf, "--host",
                                     "127.0.0.1", "--port", str(free_port()), "-t", "1"],
                                    str(cache), signal.SIGTERM, env={"BITNET_CACHE": str(cache)})
        if got is not None:
            break
    else:
        pytest.fail("the first load always ended before its temporary store could be seen")
    left = [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names if n.startswith(".bnstore-")]
    assert left == [], got[1]


def test_stale_temporary_stores_are_cleared(tmp_path):
    """A temporary store nobody wrote for STALE_TMP_S (its writer was SIGKILLed, or the OOM killer took it) is
    removed when a store is next written there; one being written (recent) is not."""
    import numpy as np

    from bitnet_cpu.engine.config import ModelConfig
    from bitnet_cpu.engine.formats.store import TensorSpec

    old, new = tmp_path / ".bnstore-old", tmp_path / ".bnstore-new"
    old.write_bytes(b"x" * 100)
    new.write_bytes(b"x" * 100)
    past = time.time() - STALE_TMP_S - 60
    os.utime(old, (past, past))
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=100)
    write_store(tmp_path / "m.bnstore", cfg, [TensorSpec("t", np.zeros(4, np.float32))])
    assert not old.exists() and new.exists() and (tmp_path / "m.bnstore").exists()


def test_the_routers_key_directory_goes_whatever_ends_it(tmp_path):
    """bitnet serve --models-dir writes its key in a temporary directory: a port already in use (exit 2) and a
    SIGHUP (its terminal closed) left it, key included, in /tmp."""
    import shutil
    import socket

    from serve_proc import free_port, wait_healthy
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), models / "tiny.bnstore")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--models-dir", str(models), "--host",
                            "127.0.0.1", "--port", str(taken.getsockname()[1])], env=env, capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 2 and "in use" in r.stderr and os.listdir(tmp) == [], (r.stderr, os.listdir(tmp))
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--models-dir", str(models), "--host",
                          "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", 120, p)
        assert [n for n in os.listdir(tmp) if n.startswith("bitnet-router-")]
        p.send_signal(signal.SIGHUP)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert os.listdir(tmp) == [], os.listdir(tmp)
