"""`bitnet serve --ray-replicas 2` on a local Ray instance (loopback only) with the bundled model: requests from
the openai client spread over both replicas, and a killed replica is replaced while the other keeps answering.
Bounded: ~3 minutes on an idle machine, at most ~15 under load. Skipped (with the reason) when ray[serve] is not
installed or Ray cannot start."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="needs the openai client (pip install .[test])")
pytest.importorskip("ray.serve", reason="Ray Serve not installed (pip install .[cluster])")
from helpers import slowness  # noqa: E402
from serve_proc import ROOT, free_port, wait_healthy  # noqa: E402

pytestmark = pytest.mark.slow


def _instances(client, n):
    seen = []
    for i in range(n):
        raw = client.chat.completions.with_raw_response.create(
            model="bitnet-b1.58-tiny", messages=[{"role": "user", "content": f"What is {i}+1?"}], temperature=0,
            max_tokens=8)
        assert raw.parse().choices[0].message.content
        seen.append(raw.headers["x-bitnet-instance"])
    return seen


@contextlib.contextmanager
def _ray_app(parallel: int, stop=signal.SIGINT):
    """`bitnet serve --ray-replicas 2` started and waited for until both replicas answer (bounded: 400 s to be
    healthy, as long again for both replicas, each times slowness(): Ray alone takes minutes under qemu, and
    with every core of a 2-core machine busy its start and Serve's proxy took 2 minutes; the app itself waits
    up to 300 s for that proxy); yields
    (url, openai client, the two instance ids seen, app). On leaving, the app gets `stop` and app["returncode"]
    its exit status. Skips with Ray's last line when Ray cannot start here."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--ray-replicas", "2", "--host", "127.0.0.1",
                             "--port", str(port), "-t", "1", "--parallel", str(parallel)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    app = {"returncode": None}
    try:
        bound = 400 * slowness()
        up = wait_healthy(url, bound, proc, poll=1)
        if proc.poll() is not None:
            pytest.skip(f"Ray could not start here (exit {proc.returncode}): {proc.stderr.read().strip().splitlines()[-1:]}")
        assert up, f"Ray Serve app not healthy within {bound:.0f} s"
        deadline = time.monotonic() + bound
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=2, timeout=60 * slowness())
        # both replicas load their own engine; wait until two distinct ones answer (bounded)
        seen = set()
        while len(seen) < 2 and time.monotonic() < deadline:
            seen |= set(_instances(client, 6))
        assert len(seen) == 2, seen
        yield url, client, seen, app
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
        try:
            proc.wait(60 * slowness())   # Serve and Ray shut down: a minute and more under qemu
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        app["returncode"] = proc.returncode


def test_ray_two_replicas_spread_and_replace():
    """SIGTERM one of two idle replicas (a replica told to stop, where the next test kills one mid-stream): the
    other keeps answering while Serve's controller starts a replacement, which then answers too. The replica is
    reached through the app alone (its process id is in X-Bitnet-Instance), not through a second Ray driver:
    `ray.init(address="auto")` finds the cluster by scanning process command lines, which qemu's emulated
    processes do not show as Ray's."""
    with _ray_app(parallel=4, stop=signal.SIGTERM) as (url, client, seen, app):
        # on loopback, a Host not naming this machine is refused (DNS rebinding), as without Ray (it was answered)
        assert httpx.get(url + "/v1/models", headers={"Host": "evil.example.com"}, timeout=60).status_code == 403
        victim, survivor = sorted(seen)
        os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGTERM)
        t_kill = time.monotonic()
        after, loading = set(), []
        while time.monotonic() - t_kill < 90 * slowness():   # a replacement loads its model: minutes under qemu
            after |= set(_instances(client, 3))
            # unretried (the openai client retries a 503): a replacement gets requests once its model is loaded
            r = httpx.get(url + "/health", timeout=60)
            if r.status_code == 503 and "loading model" in r.text:
                loading.append(r.headers.get("x-bitnet-instance"))
            if survivor in after and after - seen:
                break
            time.sleep(0.5)
        assert survivor in after, f"the other replica did not answer after {victim} was stopped: {after}"
        assert after - seen, f"no replacement replica answered within the bound (seen {sorted(after)})"
        assert not loading, f"replicas answered 'model is loading': {loading}"
    assert app["returncode"] == 0   # SIGTERM stops it as Ctrl-C does (Ray's own handler aborted it: -6)


def test_ray_replica_sigkill_under_load():
    """SIGKILL one of two replicas while 8 streams run on them: each client gets a whole answer, a 5xx or a
    closed stream, never a hang; requests succeed again within seconds (the router stops sending to the dead
    one) and a new replica takes load. The replica's process id comes from the X-Bitnet-Instance header."""
    import threading
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 400, "temperature": 2.0,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "ignore_eos": True}
    patience = slowness()   # the bounds below were set for x86; an emulated CPU gets proportionally longer
    with _ray_app(parallel=8) as (url, client, seen, _):
        ends, lock = [], threading.Lock()
        started = threading.Semaphore(0)

        def stream():
            t0, lines = time.monotonic(), []
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True),
                                  timeout=90 * patience) as r:
                    inst = r.headers.get("x-bitnet-instance")
                    for ln in r.iter_lines():
                        if ln.startswith("data: "):
                            if not lines:
                                started.release()
                            lines.append(ln)
                    out = (inst, r.status_code, "done" if lines[-1:] == ["data: [DONE]"] else "cut")
            except httpx.HTTPError as e:
                out = (None, type(e).__name__, "closed")
            if not lines:   # ended before its first event: nothing more to wait for
                started.release()
            with lock:
                ends.append(out + (time.monotonic() - t0,))
        ts = [threading.Thread(target=stream) for _ in range(8)]
        for t in ts:
            t.start()
        # streams running on both replicas: each has its first event (bounded; one that never starts is still
        # judged below: it must end whole, with a 5xx or closed, never hang)
        t_wait = time.monotonic() + 60 * patience
        for _ in ts:
            started.acquire(timeout=max(0.0, t_wait - time.monotonic()))
        victim = sorted(seen)[0]
        os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)
        t_kill = time.monotonic()
        for t in ts:
            t.join(120 * patience)
        assert not any(t.is_alive() for t in ts), "a client hung after the replica was killed"
        # the router stops sending to the dead replica: 10 requests in a row answered
        ok_run, t_ok, refused = 0, None, []
        while time.monotonic() - t_kill < 60 * patience and ok_run < 10:
            try:
                r = httpx.post(url + "/v1/chat/completions", timeout=30 * patience,
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                ok_run = ok_run + 1 if r.status_code == 200 else 0
                if r.status_code != 200:   # Ray's plain-text 500 for a dead replica: the front's JSON 503
                    refused.append((r.status_code, r.headers.get("content-type"), r.headers.get("retry-after")))
            except httpx.HTTPError:
                ok_run = 0
            if ok_run == 1:
                t_ok = time.monotonic()
        assert ok_run == 10, "requests did not recover after the replica was killed"
        assert all(ct == "application/json" and (st != 503 or ra) for st, ct, ra in refused), refused
        # a new replica takes load (a process id not seen before)
        after = set()
        while time.monotonic() - t_kill < 120 * patience and not (after - seen):
            after |= set(_instances(client, 4))
            time.sleep(0.5)
        print(f"\nreplica {victim} SIGKILLed: clients {sorted((str(s), k) for _, s, k, _ in ends)}; "
              f"answers again {t_ok - t_kill:.1f} s after; new replica(s) {sorted(after - seen)} "
              f"{time.monotonic() - t_kill:.0f} s after")
        assert after - seen, "no new replica took load"
        assert victim not in after


def test_ray_that_cannot_start_is_one_line_exit_2(tmp_path):
    """A Ray that cannot start (here: its temporary directory under a regular file, which Ray fails to create at
    once) is the environment's problem: one line naming Ray and exit 2, not "internal error ... a bug in
    bitnet-cpu" (exit 70)."""
    (tmp_path / "file").write_text("")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(tmp_path / "file" / "ray"))
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--ray-replicas", "1", "--host", "127.0.0.1",
                        "--port", str(free_port()), "-t", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120 * slowness())
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Ray did not start" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "bug" not in r.stderr, r.stderr[-2000:]


READY = "Ray Serve replicas on http://"


def _env(**extra):
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                RAY_USAGE_STATS_ENABLED="0", **extra)


@pytest.fixture(autouse=True)
def ray_stopped(monkeypatch):
    """Each test's Ray lives under a temporary directory of its own (RAY_TMPDIR, which `ray start`, ray.init()
    and RAY_ADDRESS=auto all follow; short: Ray's socket paths have a length limit), and whatever the test leaves
    of it (a start it interrupted, old code's server it had to stop) is killed by that directory on the process
    command lines: `ray stop --force` here stopped every Ray on the machine, a user's own cluster too."""
    import tempfile
    own = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", own)
    try:
        yield own
    finally:
        _kill_ray_under(own)
        shutil.rmtree(own, ignore_errors=True)


def _kill_ray_under(own: str, bound: float = 30.0) -> None:
    """SIGKILL every process whose command line names the directory `own` (Ray's raylet, GCS, agents and
    dashboard carry --temp-dir / --session-dir; its workers exit with their raylet), then wait (bounded) until
    they are gone."""
    key = own.encode()
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if key in f.read():
                        pids.add(int(d))
            except OSError:
                pass
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + bound
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _serve_until_ready_or_exit(argv, env=None, bound=None):
    """Run `python -m bitnet_cpu serve ARGV` until it exits or prints its ready line (then it is stopped with
    SIGINT: a server that came up where it should have refused); -> (returncode, stderr, ready)."""
    return _until_ready_or_exit([sys.executable, "-m", "bitnet_cpu", "serve", "--host", "127.0.0.1",
                                 "--port", str(free_port()), *argv], env, bound)


def _until_ready_or_exit(cmd, env=None, bound=None):
    """_serve_until_ready_or_exit's run of any command line."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or _env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout = proc.stderr   # _read_until's reader takes the stream it reads from proc.stdout
    try:
        lines, ready = _read_until(proc, lambda ln: READY in ln, bound or 400 * slowness())
        if ready:
            proc.send_signal(signal.SIGINT)
        lines += _read_until(proc, lambda ln: False, 60 * slowness())[0]
        proc.wait(60 * slowness())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines), ready


def _one_line_exit_2(rc, err, ready):
    assert not ready, err[-2000:]
    assert rc == 2, (rc, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0], err[-2000:]
    assert "Traceback" not in err and "internal error" not in err, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("model", ["/nonexistent/model.bnstore", "README.md"])
def test_ray_model_that_does_not_load_is_one_line_exit_2(model, ray_stopped):
    """-m naming no model: said before Ray starts, as the plain server says it (exit 2), not a ready line over
    replicas that Ray restarts for ever while every endpoint answers 503."""
    line = _one_line_exit_2(*_serve_until_ready_or_exit(["--ray-replicas", "2", "-t", "1", "-m", model]))
    assert model in line


def test_ray_replica_that_cannot_load_fails_the_deployment(ray_stopped):
    """A model that the replicas cannot load (run_ray given one the CLI did not resolve: what a file gone or
    unreadable on a replica comes to) fails the deployment: one error naming the reason, exit 2, and no ready
    line (Ray restarted the replicas for ever behind a server that said it was up)."""
    code = ("import argparse, sys\n"
            "from bitnet_cpu.cli.serve import add_arguments\n"
            "from bitnet_cpu.serve.ray_app import run_ray\n"
            "from bitnet_cpu.engine.errors import BitNetError\n"
            "p = argparse.ArgumentParser(); add_arguments(p)\n"
            "a = p.parse_args(['-m', '/nonexistent/replica.bnstore', '--ray-replicas', '1', '-t', '1',\n"
            "                  '--host', '127.0.0.1', '--port', sys.argv[1]])\n"
            "try:\n"
            "    sys.exit(run_ray(a))\n"
            "except BitNetError as e:\n"
            "    print('error:', e, file=sys.stderr); sys.exit(e.exit_code)\n")
    rc, err, ready = _until_ready_or_exit([sys.executable, "-c", code, str(free_port())])
    assert not ready, err[-2000:]
    assert rc == 2, (rc, err[-2000:])
    assert "error: the model did not load on Ray's replicas" in err and "/nonexistent/replica.bnstore" in err, \
        err[-2000:]


@pytest.mark.parametrize("flag", ["--max-connections=3", "--header-timeout=2", "--send-timeout=5",
                                  "--keep-alive-timeout=2", "--drain-timeout=1", "--log-level=info"])
def test_ray_takes_the_connection_flags(flag, ray_stopped):
    """The flags of the server's own connections apply under --ray-replicas too (its front, serve/ray_front.py,
    holds the connections): taken, not refused (here the bad model is what stops it, at once)."""
    line = _one_line_exit_2(*_serve_until_ready_or_exit(["--ray-replicas", "1", "-t", "1", flag,
                                                         "-m", "/nonexistent/m.bnstore"]))
    assert "no such file" in line, line


def test_ray_replicas_beyond_the_cores_refused(ray_stopped):
    """--ray-replicas far past the machine (each replica is an engine) is one line before Ray starts: 100000
    replicas never came up, and nothing but SIGKILL ended the wait."""
    n = len(os.sched_getaffinity(0)) + 1
    line = _one_line_exit_2(*_serve_until_ready_or_exit(["--ray-replicas", str(n), "-t", "1"]))
    assert f"--ray-replicas {n}" in line


def test_ray_ignores_serve_run_variables(ray_stopped):
    """`bitnet serve --ray-replicas` builds its app from its flags: a stray BITNET_REPLICAS (`serve run`'s) does
    not stop it with an internal error (here the missing model is what it says, exit 2)."""
    line = _one_line_exit_2(*_serve_until_ready_or_exit(
        ["--ray-replicas", "1", "-t", "1", "-m", "/nonexistent/m.bnstore"], env=_env(BITNET_REPLICAS="x")))
    assert "no such file" in line and "BITNET_REPLICAS" not in line


@pytest.mark.parametrize("var,value", [("BITNET_REPLICAS", "0"), ("BITNET_REPLICAS", "x"),
                                       ("BITNET_THREADS", "auto"), ("BITNET_MAX_QUEUE", "-1")])
def test_serve_run_bad_variable_is_one_line(var, value):
    """`serve run bitnet_cpu.serve.ray_app:app` looks `app` up in the module: a bad BITNET_* value is an error
    whose message is one line naming the variable (it was a ValueError, or Ray's own failure, at import)."""
    r = _look_up_app(_env(**{var: value}))
    out = r.stdout.strip()
    assert r.returncode == 0 and "\n" not in out, (r.returncode, out, r.stderr[-2000:])
    assert out.startswith(f"BitNetError: {var}={value!r}"), out


def test_ray_not_installed_is_one_line_exit_2(tmp_path):
    """Without Ray (`import ray` fails, as before `pip install ".[cluster]"`): one line with that hint, exit 2,
    not an internal error (exit 70)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None   # import ray fails\n")
    env = _env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    line = _one_line_exit_2(*_serve_until_ready_or_exit(["--ray-replicas", "1", "-t", "1"], env=env))
    assert "--ray-replicas" in line and 'pip install ".[cluster]"' in line


def _descendants(pid: int) -> set:
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        todo.extend(kids - out)
        out |= kids
    return out


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ray_signal_while_starting_stops_it(sig, code, ray_stopped):
    """Ctrl-C / SIGTERM while Ray and Serve start stop them and exit 128 + the signal, leaving no Ray process
    behind (the signal was waited out until Serve was up, or for ever where it never came up). The signal is
    sent once the raylet has started its agents (the raylet's children: a SIGTERM then left DashboardAgent and
    RuntimeEnvAgent running for a minute after bitnet had exited); every process bitnet started, seen up to the
    signal, is gone when bitnet has exited (nothing waited for after that)."""
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--ray-replicas", "1", "-t", "1",
                             "--host", "127.0.0.1", "--port", str(free_port())], cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import threading
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120 * slowness()
        kids: set = set()
        while proc.poll() is None and time.monotonic() < deadline and not _named(kids, "RuntimeEnvAgent"):
            kids |= _descendants(proc.pid)
            time.sleep(0.05)
        assert _named(kids, "RuntimeEnvAgent"), "Ray's raylet did not start its agents"
        ready_before = any(READY in ln for ln in lines)   # then it is the running server's stop, as checked too
        kids |= _descendants(proc.pid)
        proc.send_signal(sig)
        rc = proc.wait(300 * slowness())
        left = _alive(kids)   # at once: bitnet stops what it started before it exits
        reader.join(60)
        err = "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not left, f"Ray processes outlived bitnet: {sorted(_cmdlines(left))}"
    if ready_before:
        assert rc == 0 and "bitnet serve: stopped" in err, (rc, err[-2000:])
        return
    assert READY not in err, err[-2000:]
    assert rc == code, (rc, err[-2000:])
    assert "stopped while Ray Serve was starting" in err and "Traceback" not in err, err[-2000:]
    # a signal inside ray.init(): the shutdown that follows must not start a Ray of its own to stop
    assert "Started a local Ray instance" not in err.split("stopped while Ray Serve was starting", 1)[1], err[-2000:]


def _cmdlines(pids) -> list:
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{p} {cmd[:80]}")
        except OSError:
            pass
    return out


def _named(pids, name: str) -> bool:
    """Whether one of pids runs a command line holding `name`."""
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if name.encode() in f.read():
                    return True
        except OSError:
            pass
    return False


def _alive(pids) -> set:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(p)
        except OSError:
            pass
    return out


def _ray_cli() -> str:
    return shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")


OTHER_APP = """from ray import serve


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Other:
    def __call__(self, request):
        return "other app alive"


app = Other.bind()
"""


def _read_until(proc, stop_at, bound: float) -> tuple[list, bool]:
    """proc's output lines until one for which stop_at(line) is true (-> True), the output ends or `bound`
    seconds pass (-> False): read by a thread, so a process that prints nothing cannot hang the test."""
    import queue
    import threading
    q = getattr(proc, "lines_read", None)   # one reader per process: a second one (or communicate()) took lines
    if q is None:
        q = proc.lines_read = queue.Queue()
        threading.Thread(target=lambda: ([q.put(ln) for ln in proc.stdout], q.put(None)), daemon=True).start()
    lines, deadline = [], time.monotonic() + bound
    while True:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return lines, False
        if line is None:
            q.put(None)   # the end stays seen: a later call (the rest after a stop) returns at once, not at its bound
            return lines, False
        lines.append(line)
        if stop_at(line):
            return lines, True


def _rest(proc, lines: list, bound: float) -> str:
    """The output left after a stop (bounded), joined to `lines`: read from _read_until's reader, which holds
    proc's stdout (communicate() here raced it for the last lines: "bitnet serve: stopped" went missing)."""
    more, _ = _read_until(proc, lambda ln: False, bound)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return "".join(lines + more)


def _replicas_until_ready_then_stopped(port: int, env, when_ready=None):
    """`bitnet serve --ray-replicas 1` on `port` until ready (bounded), when_ready() called then, stopped by
    SIGINT: (the process, whether it was ready, all its output, when_ready's result or None)."""
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--ray-replicas", "1", "-t", "1",
                             "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    got = None
    try:
        lines, ready = _read_until(proc, lambda ln: READY in ln, 400 * slowness())
        if ready and when_ready is not None:
            got = when_ready()
        proc.send_signal(signal.SIGINT)
        out = _rest(proc, lines, 120 * slowness())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, ready, out, got


def _serve_cli(*argv) -> list:
    """Ray's `serve` command line, run by this interpreter (no PATH needed)."""
    return [sys.executable, "-c", "import sys; from ray.serve.scripts import cli; sys.exit(cli())", *argv]


def test_ray_replicas_beside_another_cluster_leave_it_running(ray_stopped):
    """A Ray cluster already runs on the machine (started here with `ray start --head`, its own Serve app on its
    own port) and RAY_ADDRESS names it: `bitnet serve --ray-replicas` starts a private local Ray instead of
    joining it, says that RAY_ADDRESS is not used, serves on its own --port, and its stop leaves the other
    cluster's app answering (it answered on the other cluster's port, and its stop shut down that cluster's Serve
    and every app on it)."""
    import tempfile
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")   # the other app's module
    gcs_port, other_port, port = free_port(), free_port(), free_port()
    bound = 300 * slowness()
    cluster_env = _env(RAY_ADDRESS="auto")   # the cluster `ray start` made, found on the machine (as the report's)
    with open(os.path.join(tmp, "other_app.py"), "w") as f:
        f.write(OTHER_APP)

    def run(cmd, env):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=bound)
        assert r.returncode == 0, (cmd, r.stdout[-1500:], r.stderr[-1500:])
    try:
        run([_ray_cli(), "start", "--head", f"--port={gcs_port}", "--include-dashboard=false",
             "--disable-usage-stats"], _env())
        run(_serve_cli("start", "--http-host", "127.0.0.1", "--http-port", str(other_port)), cluster_env)
        run(_serve_cli("run", "--non-blocking", "--name", "other", "--route-prefix", "/other", "--app-dir", tmp,
                       "other_app:app"), cluster_env)
        other = f"http://127.0.0.1:{other_port}/other"
        assert httpx.get(other, timeout=60).text == "other app alive"

        proc, ready, out, health = _replicas_until_ready_then_stopped(
            port, cluster_env, lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).status_code)
        assert health == 200, f"nothing answered on --port {port}: {out[-2000:]}"
        assert proc.returncode == 0, (proc.returncode, out[-2000:])
        assert "RAY_ADDRESS" in out, out[-2000:]   # said, not silently ignored
        assert httpx.get(other, timeout=60).text == "other app alive", "bitnet's stop took the other app down"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # the cluster `ray start` made: the ray_stopped fixture's


def test_ray_start_and_stop_say_only_what_matters(ray_stopped):
    """A normal start and stop print bitnet's own lines, not Ray's: no "New http_options ... will not be applied"
    (bitnet started that Serve itself, with its --host/--port), no raylet report of the controller bitnet's stop
    killed, and no raw terminal colour codes in a log."""
    proc, ready, out, _ = _replicas_until_ready_then_stopped(free_port(), _env())
    assert ready and proc.returncode == 0 and "bitnet serve: stopped" in out, (proc.returncode, out[-2000:])
    assert "will not be applied" not in out, out[-2000:]
    assert "graceful_shutdown" not in out and "killed by `ray.kill`" not in out, out[-2000:]
    assert "\x1b[" not in out, out[-2000:]


def _look_up_app(env) -> subprocess.CompletedProcess:
    """`serve run`'s look-up of `app` (the application built, nothing deployed): stdout is 'built' or the error."""
    code = ("import bitnet_cpu.serve.ray_app as m\n"
            "try:\n"
            "    m.app\n"
            "except Exception as e:\n"
            "    print(type(e).__name__ + ': ' + str(e))\n"
            "else:\n"
            "    print('built')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120 * slowness())


@pytest.mark.parametrize("model", ["/nonexistent/model.bnstore", "README.md"])
def test_serve_run_bad_model_is_one_error_naming_the_variable(model):
    """`serve run` with a BITNET_MODEL that names no model: one error when `app` is looked up, naming
    BITNET_MODEL (not -m/--model, which the user never typed), instead of a deployment whose every replica
    failed with its own traceback (13 of them, and `serve run` exited 0)."""
    r = _look_up_app(_env(BITNET_MODEL=model))
    out = r.stdout.strip()
    assert r.returncode == 0 and "\n" not in out, (r.returncode, out, r.stderr[-2000:])
    assert out.startswith(f"BitNetError: BITNET_MODEL={model!r}"), out
    assert "-m/--model" not in out, out


def test_serve_run_replicas_past_the_cores_warned():
    """BITNET_REPLICAS x BITNET_THREADS past this machine's cores is said when `serve run` builds the app, as
    `bitnet serve --ray-replicas` says it for its flags (it started 4 replicas of 2 threads on 2 cores in
    silence). A warning, not a refusal: on a cluster of several machines the replicas spread over them."""
    from bitnet_cpu.engine.cpu import available_cores
    n = available_cores() + 1
    r = _look_up_app(_env(BITNET_REPLICAS=str(n), BITNET_THREADS="2"))
    assert r.stdout.strip() == "built", (r.stdout, r.stderr[-2000:])
    warned = [ln for ln in r.stderr.splitlines() if "warning" in ln]
    assert any(f"BITNET_REPLICAS={n}" in ln and "BITNET_THREADS=2" in ln and "cores" in ln for ln in warned), \
        r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_serve_run_shows_the_replicas_load_warnings(ray_stopped):
    """Under `serve run` each replica logs its engine's load warnings (here -t past the cores), which Ray passes
    on to `serve run`'s output: they were only returned by a method nobody called there."""
    from bitnet_cpu.engine.cpu import available_cores
    env = _env(BITNET_REPLICAS="1", BITNET_THREADS=str(available_cores() + 1))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(_serve_cli("run", "bitnet_cpu.serve.ray_app:app"), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines, seen = _read_until(proc, lambda ln: "ServeReplica" in ln and "CPU cores available" in ln,
                                  400 * slowness())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120 * slowness())
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert seen, "".join(lines)[-3000:]


def test_cluster_extra_needs_a_ray_with_token_auth():
    """Ray's internal services (GCS, raylet, agents) listen on every interface whatever --host says (Ray has no
    setting to bind them to loopback): the cluster extra asks for a Ray whose ray.init() instance authenticates
    them with a token (Ray 2.59), not one that answers anyone who can reach them."""
    import re
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    m = re.search(r'"ray\[serve\]>=(\d+)\.(\d+)', text)
    assert m and (int(m.group(1)), int(m.group(2))) >= (2, 59), m and m.group(0)
