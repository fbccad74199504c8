"""engine.cpu: the default thread count is one per physical core this process may use, read from a sysfs
topology tree (a fake one here), intersected with the affinity set; OMP_NUM_THREADS overrides it."""
import json
import os
import subprocess
import sys

import pytest

from bitnet_cpu.engine import cpu


def _fake_sysfs(tmp_path, siblings: dict[int, str], name="core_cpus_list"):
    for c, text in siblings.items():
        d = tmp_path / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        (d / name).write_text(text + "\n")
    return str(tmp_path)


def test_parse_cpu_list():
    assert cpu.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    with pytest.raises(ValueError):
        cpu.parse_cpu_list("3-1")


def test_smt_pairs_count_once(tmp_path):
    # 4 cores x 2 threads, Intel numbering: cpu i and i+4 share a core
    root = _fake_sysfs(tmp_path, {i: f"{i % 4},{i % 4 + 4}" for i in range(8)})
    assert cpu.physical_cores(root, cpus=set(range(8))) == 4
    # affinity to both threads of core 0 and one of core 1: two cores
    assert cpu.physical_cores(root, cpus={0, 4, 1}) == 2
    # affinity to one thread of each core: four
    assert cpu.physical_cores(root, cpus={0, 1, 2, 3}) == 4


def test_older_kernels_thread_siblings_list(tmp_path):
    # AMD-style numbering (siblings adjacent), only the older file name present
    root = _fake_sysfs(tmp_path, {i: f"{i - i % 2}-{i - i % 2 + 1}" for i in range(6)}, name="thread_siblings_list")
    assert cpu.physical_cores(root, cpus=set(range(6))) == 3


def test_missing_or_broken_topology_falls_back_to_affinity_count(tmp_path):
    assert cpu.physical_cores(str(tmp_path / "nothing"), cpus={0, 1, 2}) == 3
    root = _fake_sysfs(tmp_path, {0: "garbage", 1: "5"})   # unreadable, and a list that omits the cpu itself
    assert cpu.physical_cores(root, cpus={0, 1}) == 2


def test_default_threads_env_and_real_machine(tmp_path, monkeypatch):
    root = _fake_sysfs(tmp_path, {c: str(c) for c in cpu.affinity_cpus()})   # no SMT: one core per cpu
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu.default_threads(root) == cpu.available_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu.default_threads(root) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    assert cpu.default_threads(root) == cpu.available_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert cpu.default_threads(root) == cpu.available_cores()
    assert 1 <= cpu.physical_cores() <= cpu.available_cores()


def test_info_and_run_verbose_show_threads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-m", "bitnet_cpu", "info", "--json"], capture_output=True, text=True,
                         env=env, check=True).stdout
    f = json.loads(out)
    assert f["threads"] == f["physical_cores"] == cpu.physical_cores()
    table = subprocess.run([sys.executable, "-m", "bitnet_cpu", "info"], capture_output=True, text=True, env=env,
                           check=True).stdout
    assert f"{f['threads']} (physical cores" in table
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-v", "-n", "2", "-p", "hi"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "threads 1," in r.stderr   # (then the kernel path)
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-v", "-t", "1", "-n", "2", "-p", "hi"],
                       capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": str(cpu.available_cores())})
    assert r.returncode == 0 and "threads 1," in r.stderr


def test_two_sessions_keep_their_own_thread_count():
    """The thread count belongs to the session that owns it: creating a second session (or engine) with another
    count does not change what the first one runs with."""
    from bitnet_cpu import simd
    from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model

    one = load_model(None, threads=1, ctx=64, progress=False)
    two = load_model(None, threads=2, ctx=64, progress=False)
    greedy = SamplingParams(temperature=0)
    for llm, want in ((one, 1), (two, 2), (one, 1)):
        list(llm.generate("2+3=", greedy, max_tokens=2))
        assert simd.get_num_threads() == want
    eng = load_engine(None, threads=2, ctx=64, parallel=2, progress=False)
    try:
        list(eng.submit(eng.tokenize("2+3=", add_bos=True), greedy, max_tokens=2))   # in the scheduler thread
        list(one.generate("2+3=", greedy, max_tokens=2))
        assert simd.get_num_threads() == 1
    finally:
        eng.close()


def test_the_kernel_thread_count_is_per_calling_thread():
    import threading

    from bitnet_cpu import simd

    simd.set_num_threads(1)
    seen = []
    t = threading.Thread(target=lambda: (simd.set_num_threads(3), seen.append(simd.get_num_threads())))
    t.start()
    t.join()
    try:
        assert seen == [3] and simd.get_num_threads() == 1
    finally:
        simd.set_num_threads(0)          # back to the process default


def test_cpu_name_from_py_cpuinfo_in_info_and_never_on_the_load_path():
    """py-cpuinfo names the CPU in `bitnet info` (and the bench headers); its probe takes about a second, so
    loading a model, generating and building every command's parser never import it."""
    cpuinfo = pytest.importorskip("cpuinfo")
    f = json.loads(subprocess.run([sys.executable, "-m", "bitnet_cpu", "info", "--json"], capture_output=True,
                                  text=True, check=True).stdout)
    assert f["cpu"] == (cpuinfo.get_cpu_info().get("brand_raw") or f["cpu"]) and f["cpu"].strip()
    code = ("import sys\n"
            "from bitnet_cpu.cli import build_parser\n"
            "from bitnet_cpu.cli.chat import build_parser as chat_parser\n"
            "from bitnet_cpu.engine.api import SamplingParams, load_model\n"
            "build_parser(); chat_parser()\n"
            "llm = load_model(None, ctx=64, threads=1, progress=False)\n"
            "list(llm.generate('Hi', SamplingParams(temperature=0), max_tokens=2))\n"
            "assert 'cpuinfo' not in sys.modules, 'py-cpuinfo was imported on the load path'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
