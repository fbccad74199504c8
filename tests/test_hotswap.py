"""A model file rewritten in place (`cp` over it, `rsync --inplace`, same size or larger) while a model is loaded from
its mapping: every page is valid again, so no SIGBUS says anything, and the old index would read the new bytes
(garbage with exit 0 / HTTP 200). The engine looks at the file (one fstat) before each request: a changed file is
one clear error naming it; a rename or removal of the path is no change; weights read into memory are unaffected."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from bitnet_cpu.engine.api import BitNetError, load_engine, load_model, model_card
from bitnet_cpu.engine.errors import ModelChangedError
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.runtime.sampling import SamplingParams
from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir
from helpers import slowness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(small, larger): two stores of other weights, the second larger (a bigger model copied over the first)."""
    d = tmp_path_factory.mktemp("hotswap")
    out = []
    for i, layers in enumerate((2, 3)):
        m = SynthModel(small_config(num_hidden_layers=layers, vocab_size=512), seed=10 + i)
        write_hf_dir(m, str(d / f"hf{i}"))
        out.append(convert(str(d / f"hf{i}"), str(d / f"m{i}.bnstore"), progress=False))
    assert os.path.getsize(out[1]) > os.path.getsize(out[0])
    return out


def _copy_over(src: str, dst: str):
    """`cp src dst`: the same inode, truncated and written again."""
    with open(src, "rb") as f, open(dst, "r+b") as g:
        g.truncate(0)
        g.write(f.read())


def _poison_norm(path: str):
    """The store at `path` rewritten in place, same size, its output norm all NaN (other weights under the old
    index: what a same-size copy of another model does)."""
    with Store(path, load="index") as s:
        e = s.info("output_norm")
        at = s._data_offset + e["offset"]
        n = e["nbytes"]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.full(n // 4, np.nan, np.float32).tobytes())


def _text(llm, prompt="Once upon", n=6):
    return "".join(c.text for c in llm.generate(prompt, GREEDY, max_tokens=n, ignore_eos=True))


def test_api_a_larger_store_copied_over_a_mapped_one_is_one_error_naming_it(stores, tmp_path):
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    with load_model(victim, mmap=True, progress=False, threads=1) as llm:
        _text(llm)
        _copy_over(stores[1], victim)
        with pytest.raises(ModelChangedError) as e:
            _text(llm)
        msg = str(e.value)
        assert victim in msg and "rewritten in place" in msg and "\n" not in msg
        assert "restart" in e.value.hint or "reload" in e.value.hint
        for call in (lambda: llm.embed("x"), lambda: llm.forward([1, 2]), lambda: llm.perplexity("a b " * 40,
                                                                                                 chunk=8)):
            with pytest.raises(ModelChangedError):
                call()


def test_api_a_same_size_rewrite_is_seen_too(stores, tmp_path):
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    with load_model(victim, mmap=True, progress=False, threads=1) as llm:
        _text(llm)
        size = os.path.getsize(victim)
        _poison_norm(victim)
        assert os.path.getsize(victim) == size
        with pytest.raises(ModelChangedError, match="rewritten in place"):
            _text(llm)


def test_a_run_under_way_when_the_file_changes_is_told_the_cause_not_corrupt_weights(stores, tmp_path):
    # the request was admitted before the change: what it reads next is the new file's (here NaN norms); the error
    # names the change, not "its weights are corrupt: re-convert", which would not help
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    with load_model(victim, mmap=True, progress=False, threads=1) as llm:
        gen = llm.generate("Once upon", GREEDY, max_tokens=20, ignore_eos=True)
        next(gen)
        _poison_norm(victim)
        with pytest.raises(BitNetError) as e:
            for _ in gen:
                pass
        assert isinstance(e.value, ModelChangedError) and victim in str(e.value), str(e.value)
        assert "corrupt" not in str(e.value)


def test_a_rename_or_removal_of_the_path_changes_nothing_loaded(stores, tmp_path):
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    with load_model(victim, mmap=True, progress=False, threads=1) as llm:
        before = _text(llm)
        os.chmod(victim, 0o644)                       # its ctime moves, its contents do not
        staged = str(tmp_path / "new.bnstore")
        shutil.copy(stores[1], staged)
        os.replace(staged, victim)                    # the documented way to update a store in use
        assert _text(llm) == before
        os.unlink(victim)
        assert _text(llm) == before


def test_weights_read_into_memory_are_not_affected(stores, tmp_path):
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    with load_model(victim, mmap=False, progress=False, threads=1) as llm:
        before = _text(llm)
        _copy_over(stores[1], victim)
        assert _text(llm) == before


def test_engine_refuses_a_request_once_its_mapped_file_changed(stores, tmp_path):
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    with load_engine(victim, mmap=True, progress=False, threads=1, parallel=2, ctx=256) as eng:
        assert list(eng.submit("Once", GREEDY, max_tokens=3))[-1].finish_reason
        _copy_over(stores[1], victim)
        with pytest.raises(ModelChangedError, match="rewritten in place"):
            eng.submit("Once", GREEDY, max_tokens=3)
        with pytest.raises(ModelChangedError):
            eng.embed("Once")


def test_a_listing_reads_a_store_without_mapping_it(stores, tmp_path):
    # the router's /api/tags and /api/show read model files in its own process: a mapping there made a file
    # rewritten meanwhile a SIGBUS that ended the router and every model with it
    victim = str(tmp_path / "listed.bnstore")
    shutil.copy(stores[0], victim)
    with Store(victim, load="index") as s:
        with open("/proc/self/maps") as f:
            assert victim not in f.read()
        assert s.config.n_layers == 2
        with pytest.raises(BitNetError):
            s.tensor("output_norm")
    assert model_card(victim).config.n_layers == 2
    os.truncate(victim, 5000)   # cut short: its index is gone; one error for this file
    with pytest.raises(BitNetError, match="truncated or corrupt"):
        model_card(victim)


def _get(url: str, body: dict | None = None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_answers_one_clear_error_and_stops_once_its_model_file_changed(stores, tmp_path):
    # as a SIGBUS on its file stops it (docs/usage.md: exit 2, one line): a supervisor, or the router, starts it
    # again on the file as it is now; the request that found the change is told what happened
    from serve_proc import free_port, pythonpath, wait_healthy
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "-m", victim, "--mmap", "--host", "127.0.0.1",
                          "--port", str(port), "-t", "1", "--parallel", "2", "-c", "256"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=pythonpath()), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert wait_healthy(url, 120 * slowness(), p)
        body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        status, _ = _get(url + "/v1/completions", body)
        assert status == 200
        _copy_over(stores[1], victim)
        status, answer = _get(url + "/v1/completions", body)
        assert status == 500, answer
        assert answer["error"]["code"] == "model_changed"
        assert victim in answer["error"]["message"] and "rewritten in place" in answer["error"]["message"]
        _, err = p.communicate(timeout=120 * slowness())
        rc = p.returncode
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc == 2, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert lines[-1].startswith("bitnet serve: error: ") and victim in lines[-1], err
    assert "rewritten in place" in lines[-1]


def test_python_api_a_store_truncated_during_a_run_is_one_line_not_a_bare_bus_error(stores, tmp_path):
    # load_model installs the fault guard where the program has none: a program embedding the engine died with a
    # bare "Bus error" (exit 135), no file named
    victim = str(tmp_path / "embedded.bnstore")
    shutil.copy(stores[0], victim)
    script = ("import os, sys\n"
              "from bitnet_cpu.engine.api import load_model, SamplingParams\n"
              "llm = load_model(sys.argv[1], mmap=True, progress=False, threads=1)\n"
              "gen = llm.generate('Once', SamplingParams(temperature=0), max_tokens=50, ignore_eos=True)\n"
              "next(gen)\n"
              "os.truncate(sys.argv[1], 4096)\n"
              "for _ in gen:\n"
              "    pass\n"
              "print('not reached')\n")
    from serve_proc import pythonpath
    r = subprocess.run([sys.executable, "-c", script, victim], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath()),
                       capture_output=True, text=True, timeout=120 * slowness())
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("bitnet_cpu: error: ") and victim in lines[-1], r.stderr
    assert "changed or was truncated while in use" in lines[-1] and "not reached" not in r.stdout


def test_router_with_no_models_says_so_for_an_unknown_name(tmp_path):
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    from serve_proc import Server
    cache = tmp_path / "cache"   # an empty model cache (a pull that failed on a full disk)
    cache.mkdir()
    s = Server("--models-cache", threads=1, env={"BITNET_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    try:
        status, answer = _get(s.url + "/v1/completions", {"model": "x", "prompt": "Once", "max_tokens": 2})
    finally:
        s.stop()
    assert status == 404
    msg = answer["error"]["message"]
    assert "no models here yet" in msg and "models here: )" not in msg, msg


def test_a_router_removes_what_a_router_that_died_left_in_the_temp_dir(tmp_path):
    # a router ended by the fault guard (or SIGKILL) runs no Python: its key file and logs were left for good
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    from serve_proc import Server
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    from bitnet_cpu.serve.router import router_stamp
    ns = os.stat("/proc/self/ns/pid").st_ino   # a router of this PID namespace, whose pid is gone
    left = tmp / "bitnet-router-left"
    left.mkdir()
    (left / "pid").write_text(f"{dead.stdout.strip()} - {ns}\n")
    (left / "key").write_text("secret\n")
    other = tmp / "bitnet-router-live"   # a router still running (this test's own process stands for it)
    other.mkdir()
    (other / "pid").write_text(router_stamp())
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), models / "a.bnstore")
    s = Server("--models-dir", str(models), threads=1, env={"TMPDIR": str(tmp)})
    try:
        assert not left.exists()
        assert other.exists()
        mine = [p for p in tmp.iterdir() if p.name.startswith("bitnet-router-") and p not in (other,)]
        assert len(mine) == 1 and (mine[0] / "pid").read_text().split()[0] == str(s.proc.pid)
    finally:
        s.stop()
    assert not mine[0].exists()


def test_single_server_lists_the_model_it_loaded_not_the_file_renamed_over_it(stores, tmp_path):
    # ollama's digest identifies the model loaded: a client watching it was told of an update that was not served
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    from serve_proc import Server
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    s = Server("-m", victim, "-c", "256", threads=1)
    try:
        _, before = _get(s.url + "/api/tags")
        staged = str(tmp_path / "staged.bnstore")
        shutil.copy(stores[1], staged)
        os.replace(staged, victim)   # bitnet convert -o over it: the server goes on with the old model
        _, after = _get(s.url + "/api/tags")
    finally:
        s.stop()
    keys = ("size", "digest", "modified_at")
    assert [after["models"][0][k] for k in keys] == [before["models"][0][k] for k in keys]
    assert before["models"][0]["size"] == os.path.getsize(stores[0])


def test_router_tells_a_stream_cut_by_its_model_file_changing_why(tmp_path):
    # the child's one line (the fault guard's) was in the router's log only; the client got "stopped" and no reason
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    import httpx
    from serve_proc import Server
    models = tmp_path / "models"
    models.mkdir()
    victim = models / "alpha.bnstore"
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), victim)
    s = Server("--models-dir", str(models), "-c", "2048", threads=1)
    lines = []
    try:
        body = {"model": "alpha", "stream": True, "prompt": "Once", "max_tokens": 100_000, "ignore_eos": True}
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120 * slowness()) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        os.truncate(victim, 4096)   # the model's next token reads past the file's new end
    finally:
        s.stop()
    errors = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: {\"error\"")]
    assert errors, lines[-3:]
    msg = errors[-1]["error"]["message"]
    assert "stopped in the middle of this answer" in msg
    assert "changed or was truncated while in use" in msg and str(victim) in msg, msg



def test_a_file_changed_while_a_chat_waits_for_its_format_is_the_servers_model_changed(stores, tmp_path):
    # the file changed between the server's own check (as the request began) and the engine's (as it was
    # submitted, after its format compiled, which waits for a compile slot under load): ollama's routes answered
    # 400, as if the client were at fault, and the server went on serving the changed file
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    pytest.importorskip("llguidance", reason="a format needs the grammar engine (pip install .[grammar])")
    import threading
    import time

    import uvicorn
    from serve_proc import free_port, wait_healthy

    from bitnet_cpu.engine.runtime import constraints
    from bitnet_cpu.serve.app import create_app
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    stopped = []
    app = create_app(lambda: load_engine(victim, mmap=True, progress=False, threads=1, parallel=2, ctx=256),
                     on_load_error=stopped.append)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    got = {}
    held = 0
    try:
        assert wait_healthy(url, 120 * slowness(), poll=0.1)
        # every compile slot taken (as other requests' schemas take them): this request's compile waits for one
        for _ in range(constraints.COMPILE_SLOTS):
            assert constraints._COMPILE_SLOTS.acquire(timeout=60 * slowness())
            held += 1
        schema = {"type": "object", "properties": {"hotswap_waits": {"type": "integer"}}}
        body = {"model": "m", "messages": [{"role": "user", "content": "Once"}], "stream": False,
                "format": schema, "options": {"num_predict": 2}}
        asker = threading.Thread(target=lambda: got.update(answer=_get(url + "/api/chat", body)), daemon=True)
        asker.start()
        deadline = time.monotonic() + 60 * slowness()
        while time.monotonic() < deadline and not any(c._jobs for c in list(constraints._COMPILERS.values())):
            time.sleep(0.02)   # until the request waits for a slot (it passed the server's check)
        assert any(c._jobs for c in list(constraints._COMPILERS.values()))
        _copy_over(stores[1], victim)
    finally:
        for _ in range(held):
            constraints._COMPILE_SLOTS.release()
        if held:
            asker.join(120 * slowness())
        server.should_exit = True
        thread.join(30 * slowness())
    status, answer = got["answer"]
    assert status == 500, answer
    assert "rewritten in place" in answer["error"] and victim in answer["error"], answer
    assert len(stopped) == 1 and isinstance(stopped[0], ModelChangedError)


def test_the_embedding_routes_pass_a_changed_file_on_as_the_servers_error_not_a_400(stores, tmp_path):
    # run_embed, which every embedding route submits through, made the engine's ModelChangedError a 400 of its
    # own: the client was told it was at fault and the server went on
    from bitnet_cpu.serve.embeddings import Refused, run_embed
    victim = str(tmp_path / "served.bnstore")
    shutil.copy(stores[0], victim)
    with load_engine(victim, mmap=True, progress=False, threads=1, parallel=2, ctx=256) as eng:
        ids = [eng.tokenize("Once upon", add_bos=True)]
        _copy_over(stores[1], victim)
        import asyncio
        try:
            asyncio.run(run_embed(eng, None, None, ids))
        except Refused as e:
            pytest.fail(f"a changed model file answered as the client's fault: {e.status} {e.message}")
        except ModelChangedError as e:
            assert "rewritten in place" in str(e)
        else:
            pytest.fail("a changed model file was embedded")


def test_the_docs_say_when_a_default_load_is_safe_from_a_later_change_as_the_loader_decides(stores):
    # docs/api.md promised that every store over 64 MiB loaded with the default ignores a later change; the default
    # maps it where the kernel has no transparent huge pages or memory is short, and a user who relied on that
    # and copied over it got ModelChangedError or exit 2
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("**A model file changed while it is loaded.**")
    end = text.find("\n\n", start)
    para = text[start:end if end >= 0 else len(text)]
    assert "stores over 64 MiB by default) are unaffected" not in para
    for condition in ("transparent huge pages", "memory available", "load_mode", "mmap=False"):
        assert condition in para, condition
    with load_model(stores[0], progress=False, threads=1) as llm:   # where the doc says to look, as it says
        assert llm.store.load_mode == "mmap"   # a small store: always mapped by default


def test_router_never_gives_a_killed_models_cut_stream_another_requests_error_as_its_reason(tmp_path):
    # the reason was the last line of the model's log with "error" in it, whoever wrote it and whenever: a model
    # killed (SIGKILL: it writes nothing) after another request had failed told this client that one's error
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    import signal

    import httpx
    from serve_proc import Server
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), models / "alpha.bnstore")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = Server("--models-dir", str(models), "-c", "2048", threads=1, env={"TMPDIR": str(tmp)})
    lines = []
    try:
        status, _ = _get(s.url + "/v1/completions", {"model": "alpha", "prompt": "Once", "max_tokens": 2})
        assert status == 200
        logs = [p for d in tmp.iterdir() if d.name.startswith("bitnet-router-") for p in d.glob("*alpha*.log")]
        assert len(logs) == 1
        with open(logs[0], "a") as f:   # what the model's process wrote of another client's failed request
            f.write("bitnet engine: sequence 12 failed in decode (ConstraintError: another client's error text)\n")
        with open(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
        assert len(kids) == 1
        body = {"model": "alpha", "stream": True, "prompt": "Once", "max_tokens": 100_000, "ignore_eos": True}
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120 * slowness()) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        os.kill(kids[0], signal.SIGKILL)   # as the out-of-memory killer ends it
                    if len(lines) > 100_000:
                        break
    finally:
        s.stop()
    errors = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: {\"error\"")]
    assert errors, lines[-3:]
    msg = errors[-1]["error"]["message"]
    assert "stopped in the middle of this answer" in msg
    assert "another client" not in msg and "sequence 12" not in msg, msg
    assert "killed by signal 9" in msg, msg


def test_a_models_log_tail_reads_only_what_came_after_a_point_and_only_its_end(tmp_path):
    # a cut stream's reason is one line written since its request began; a long-lived model's log was read whole
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    import asyncio

    from bitnet_cpu.serve.router import Child
    log = tmp_path / "1-alpha.log"
    log.write_text("bitnet engine: sequence 3 failed (ConstraintError: an earlier request's)\n")
    since = log.stat().st_size
    child = asyncio.run(_child(Child, str(log)))
    assert child.log_tail(since) == ""
    assert "earlier request" in child.log_tail()
    with open(log, "a") as f:
        f.write("x" * 20_000 + " error in a long line\n" + "bitnet serve: error: FILE: changed while in use\n")
    assert child.log_tail(since) == "FILE: changed while in use"
    with open(log, "a") as f:
        f.write("a" * 5000 + " error cut by the window's start\n" + "y" * 8000 + "\n")
    assert child.log_tail(since) == ""   # the window starts inside the line that said "error": no half line


async def _child(cls, log_path):
    return cls(None, None, 0, log_path)


def test_a_router_never_removes_a_dir_whose_router_may_live_in_another_pid_namespace(tmp_path, monkeypatch):
    # containers that share /tmp but not their PID namespace see each other's dirs and not each other's pids: a
    # router took another container's live router for dead and removed its key file and logs
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    import tempfile

    from bitnet_cpu.serve.router import remove_dead_routers_dirs, router_stamp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    ns = os.stat("/proc/self/ns/pid").st_ino
    with open("/proc/stat") as f:
        boot = next(float(ln.split()[1]) for ln in f if ln.startswith("btime "))

    def router_dir(name, stamp, mtime=None):
        d = tmp_path / f"bitnet-router-{name}"
        d.mkdir()
        (d / "pid").write_text(stamp)
        (d / "key").write_text("secret\n")
        if mtime is not None:
            os.utime(d / "pid", (mtime, mtime))
        return d
    elsewhere = router_dir("elsewhere", f"{dead} 12345 {ns + 1}\n")      # its pid is not ours to see
    older = router_dir("older", f"{dead}\n")                            # an older router's (a pid only)
    before_boot = router_dir("before-boot", f"{dead} 1 {ns + 1}\n", mtime=boot - 3600)
    gone = router_dir("gone", f"{dead} - {ns}\n")                       # this namespace, the pid gone
    with open(f"/proc/{os.getppid()}/stat", "rb") as f:
        started = int(f.read().rpartition(b")")[2].split()[19])
    reused = router_dir("reused", f"{os.getppid()} {started + 1} {ns}\n")   # its pid now another process's
    live = router_dir("live", router_stamp())                              # this process stands for a live one
    remove_dead_routers_dirs()
    assert elsewhere.exists() and older.exists() and live.exists()
    assert not before_boot.exists() and not gone.exists() and not reused.exists()
