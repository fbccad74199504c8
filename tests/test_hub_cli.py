"""Models by Hugging Face hub id (`-m REPO[:FILE][@REV]`), `bitnet pull`, `bitnet list`, `bitnet rm`.

The hub cache is built here on disk in huggingface_hub's own layout (models--OWNER--NAME/{blobs,refs,
snapshots/COMMIT}, snapshot files symlinked to blobs), and the engine finds models in it only through
huggingface_hub's cache API. Nothing here touches the network: `pull` is tested offline (HF_HUB_OFFLINE=1)
and against an endpoint on 127.0.0.1 where nothing listens.
"""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("huggingface_hub", reason="huggingface_hub is a dependency of the hub features")

from bitnet_cpu.engine.api import SamplingParams, load_model  # noqa: E402
from bitnet_cpu.engine.formats.hub import hub_names, parse_hub_ref, quant_tag  # noqa: E402
from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_i2s, write_gguf_tq, write_hf_dir  # noqa: E402
from serve_proc import pythonpath  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def add_snapshot(cache: str, repo: str, commit: str, files: dict[str, str], refs=("main",)) -> str:
    """Put `files` (name -> local file) into `cache` as huggingface_hub stores a download of `repo` at `commit`."""
    storage = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(storage, "snapshots", commit)
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    for name, src in files.items():
        data = open(src, "rb").read()
        blob = os.path.join(storage, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snap, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    for ref in refs:
        with open(os.path.join(storage, "refs", ref), "w") as f:
            f.write(commit)   # no newline, as huggingface_hub writes it
    return snap


def hf_files(d: str) -> dict[str, str]:
    return {f: os.path.join(d, f) for f in os.listdir(d)}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache with o/tiny at two commits (main -> B, tag v1 -> A) and o/tiny-gguf (one GGUF file)."""
    root = tmp_path_factory.mktemp("hub")
    models = {}
    for seed, commit, refs in ((3, COMMIT_A, ("v1",)), (4, COMMIT_B, ("main",))):
        m = SynthModel(small_config(), seed=seed)
        d = write_hf_dir(m, str(root / f"src{seed}"))
        add_snapshot(str(root / "cache"), "o/tiny", commit, hf_files(d), refs)
        models[commit] = d
    gguf = write_gguf_i2s(SynthModel(small_config(), seed=5), str(root / "model-i2_s.gguf"))
    add_snapshot(str(root / "cache"), "o/tiny-gguf", COMMIT_A, {"model-i2_s.gguf": gguf})
    quants = quant_files(root)
    add_snapshot(str(root / "cache"), "o/quants", COMMIT_A, quants)
    return {"cache": str(root / "cache"), "hf": models, "gguf": gguf, "quants": quants}


def quant_files(root) -> dict[str, str]:
    """Two quantizations of two different models, as a -GGUF repository holds them: {file name: local file}."""
    return {"m-1.58bit-i2_s.gguf": write_gguf_i2s(SynthModel(small_config(), seed=6), str(root / "q-i2_s.gguf")),
            "m-1.58bit-TQ2_0.gguf": write_gguf_tq(SynthModel(small_config(), seed=7), str(root / "q-tq2_0.gguf"))}


def env_for(hub, tmp_path, **extra):
    env = dict(os.environ, HF_HUB_CACHE=hub["cache"], BITNET_CACHE=str(tmp_path / "stores"), HF_HUB_OFFLINE="1")
    env.pop("HF_HOME", None)
    env.update(extra)
    return env


def bitnet(*args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def greedy(model_path, n=8):
    llm = load_model(model_path, ctx=128, progress=False)
    try:
        ids = llm.tokenize("Once upon", add_bos=True)
        return "".join(c.text for c in llm.generate(ids, SamplingParams(temperature=0), max_tokens=n))
    finally:
        llm.close()


def run_text(ref, env):
    r = bitnet("run", "-m", ref, "-p", "Once upon", "-n", "8", "--temp", "0", "-t", "1", env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_hub_ids_resolve_through_the_cache_with_revisions(hub, tmp_path):
    env = env_for(hub, tmp_path)
    want_b, want_a = greedy(hub["hf"][COMMIT_B]), greedy(hub["hf"][COMMIT_A])
    assert want_a != want_b, "the two revisions must differ for this test to mean something"
    assert run_text("o/tiny", env) == want_b                      # refs/main
    assert run_text(f"o/tiny@{COMMIT_A}", env) == want_a          # a commit hash
    assert run_text("o/tiny@v1", env) == want_a                   # a tag/branch ref
    assert run_text("o/tiny-gguf", env) == greedy(hub["gguf"])    # the -gguf repo's single file
    assert run_text("o/tiny-gguf:model-i2_s.gguf", env) == greedy(hub["gguf"])
    # HF_HOME alone (no HF_HUB_CACHE) points at HF_HOME/hub
    home = tmp_path / "hfhome"
    home.mkdir()
    os.symlink(hub["cache"], home / "hub")
    env2 = env_for(hub, tmp_path, HF_HOME=str(home))
    env2.pop("HF_HUB_CACHE")
    assert run_text("o/tiny", env2) == want_b


def test_quant_tags_of_file_names():
    assert quant_tag("ggml-model-i2_s.gguf") == "i2_s"
    assert quant_tag("Falcon3-1B-Instruct-1.58bit-TQ2_0.gguf") == "TQ2_0"
    assert quant_tag("sub/model.Q4_K_M.gguf") == "Q4_K_M"
    assert quant_tag("model-Q4_K_M-00001-of-00002.gguf") == "Q4_K_M"    # a shard's number is not its tag
    assert quant_tag("config.json") is None
    assert parse_hub_ref("o/r:latest") == ("o/r", None, None)            # ollama's default tag: no file
    assert parse_hub_ref("o/r:TQ2_0@v1") == ("o/r", "TQ2_0", "v1")
    assert hub_names("o/r:m-TQ2_0.gguf@abc") == ["o/r:m-tq2_0.gguf", "o/r:tq2_0", "o/r"]
    assert hub_names("o/r@abc") == ["o/r"] and hub_names("?") == []


def test_a_quant_tag_names_its_gguf_file(hub, tmp_path):
    """REPO:TAG runs the GGUF file whose name ends in -TAG (any case); a repository of several GGUF files and
    no tag, or a tag it lacks, is one line naming the tags it has; `bitnet rm REPO:TAG` removes that one."""
    env = env_for(hub, tmp_path)
    want_tq, want_i2 = greedy(hub["quants"]["m-1.58bit-TQ2_0.gguf"]), greedy(hub["quants"]["m-1.58bit-i2_s.gguf"])
    assert want_tq != want_i2, "the two files must differ for this test to mean something"
    assert run_text("o/quants:TQ2_0", env) == want_tq
    assert run_text("o/quants:tq2_0", env) == want_tq
    assert run_text("o/quants:i2_s", env) == want_i2
    for ref, words in (("o/quants", ["2 GGUF files", "i2_s, TQ2_0", "-m o/quants:i2_s"]),
                       ("o/quants:latest", ["2 GGUF files"]),
                       ("o/quants:Q4_K_M", ["no GGUF file of o/quants", "'Q4_K_M'", "i2_s, TQ2_0"])):
        r = bitnet("run", "-m", ref, "-p", "x", env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), (ref, r.stderr)
    rows = [json.loads(x) for x in bitnet("list", "--json", env=env).stdout.splitlines()]
    assert sorted(x["source"].split("@")[0] for x in rows) == ["o/quants:m-1.58bit-TQ2_0.gguf",
                                                                "o/quants:m-1.58bit-i2_s.gguf"]
    r = bitnet("rm", "o/quants:TQ2_0", env=env)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in bitnet("list", "--json", env=env).stdout.splitlines()]
    assert [x["source"].split("@")[0] for x in rows] == ["o/quants:m-1.58bit-i2_s.gguf"]


def test_missing_hub_id_is_one_line_with_the_pull_hint(hub, tmp_path):
    r = bitnet("run", "-m", "o/not-downloaded", "-p", "x", env=env_for(hub, tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bitnet pull o/not-downloaded" in lines[0] and hub["cache"] in lines[0]
    r = bitnet("run", "-m", "o/tiny:nope.gguf", "-p", "x", env=env_for(hub, tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "o/tiny:nope.gguf" in r.stderr


@pytest.mark.parametrize("ref", ["o/tiny:/etc/passwd", "o/tiny:sub\\..\\x.gguf", "o/tiny:a/../b.gguf"])
def test_a_file_part_that_is_no_file_of_the_repository_is_one_line(hub, tmp_path, ref):
    """huggingface_hub refuses an absolute, drive, backslash or '..' FILE with a ValueError, which reached the user
    as "internal error ... a bug in bitnet-cpu" (exit 70): one line naming the part, exit 2, for run and pull."""
    for args in (("run", "-m", ref, "-p", "x"), ("pull", ref)):
        r = bitnet(*args, env=env_for(hub, tmp_path))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "the file part" in lines[0] and "bug" not in lines[0], \
            (args, r.stderr)


@pytest.mark.parametrize("ref", ["o/tiny@..", "o/tiny@a/../b", "o/tiny@/main", "o/tiny:i2_s@.."])
def test_a_revision_that_is_no_revision_is_one_line(hub, tmp_path, ref):
    """A REVISION of '..' had huggingface_hub open refs/.. (a folder): its IsADirectoryError reached the user as
    "internal error ... a bug in bitnet-cpu" (exit 70): one line naming the revision, exit 2, for run and pull."""
    for args in (("run", "-m", ref, "-p", "x"), ("pull", ref)):
        r = bitnet(*args, env=env_for(hub, tmp_path))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "the revision" in lines[0] and "bug" not in lines[0], \
            (args, r.stderr)


def test_list_inspect_and_rm(hub, tmp_path):
    env = env_for(hub, tmp_path)
    r = bitnet("list", env=env)
    assert r.returncode == 0 and r.stdout == "" and "no converted models" in r.stderr
    run_text("o/tiny", env)
    run_text("o/tiny-gguf", env)
    r = bitnet("list", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["NAME", "SOURCE", "SIZE", "HEAD", "STATUS", "LAST", "USED"] and len(lines) == 3
    rows = [json.loads(x) for x in bitnet("list", "--json", env=env).stdout.splitlines()]
    sources = sorted(r["source"] for r in rows)
    assert sources == [f"o/tiny-gguf:model-i2_s.gguf@{COMMIT_A[:12]}", f"o/tiny@{COMMIT_B[:12]}"]
    assert all(r["lm_head"] == "q4" and r["size"] == os.path.getsize(r["path"]) for r in rows)
    assert all(r["status"] == "current" for r in rows)   # a download's stamp: its commit's files' sizes
    assert all(row["name"] in "\n".join(lines) for row in rows)
    # inspect names the file it was given and the recorded source, with no path of this machine
    store = next(r for r in rows if r["source"].startswith("o/tiny@"))["path"]
    out = bitnet("inspect", store, "--tensors", "1", env=env).stdout
    assert out.splitlines()[0] == f"file: {store}"
    source_line = next(x for x in out.splitlines() if x.startswith("source:"))
    assert f"o/tiny@{COMMIT_B[:12]}" in source_line and str(tmp_path) not in source_line and "/" + "root" not in source_line
    # rm: by hub id (every conversion of it), unknown names refused, --all empties the cache
    r = bitnet("rm", "o/tiny", env=env)
    assert r.returncode == 0 and "deleted" in r.stdout, r.stderr
    assert [json.loads(x)["source"] for x in bitnet("list", "--json", env=env).stdout.splitlines()] == \
        [f"o/tiny-gguf:model-i2_s.gguf@{COMMIT_A[:12]}"]
    r = bitnet("rm", "nothing-like-this", env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "bitnet list" in r.stderr
    assert bitnet("rm", env=env).returncode == 2                  # neither names nor --all
    # a dangling link in the cache (a store deleted under it) is listed as unreadable and removable
    os.symlink(str(tmp_path / "gone.bnstore"), str(tmp_path / "stores" / "dangling.bnstore"))
    r = bitnet("list", env=env)
    assert r.returncode == 0 and "dangling" in r.stdout and "unreadable" in r.stdout, r.stderr
    # a directory named like a store: --all removes the rest and says what it left (it stopped at it, exit 2)
    os.mkdir(str(tmp_path / "stores" / "adir.bnstore"))
    r = bitnet("rm", "--all", env=env)
    assert r.returncode == 2 and r.stdout.count("deleted") == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "adir" in r.stderr and "a directory" in r.stderr, r.stderr
    os.rmdir(str(tmp_path / "stores" / "adir.bnstore"))
    assert bitnet("list", "--json", env=env).stdout == ""
    assert os.path.isdir(hub["cache"]) and os.listdir(hub["cache"])   # the downloads are never touched


def test_a_cache_that_is_not_a_directory_is_one_line(hub, tmp_path):
    """BITNET_CACHE naming a file: list and rm said "internal error ... a bug in bitnet-cpu" (exit 70), where run
    said what was wrong."""
    (tmp_path / "file").write_text("not a directory")
    env = {**env_for(hub, tmp_path), "BITNET_CACHE": str(tmp_path / "file")}
    for args in (("list",), ("list", "--json"), ("rm", "x"), ("rm", "--all")):
        r = bitnet(*args, env=env)
        assert r.returncode == 2 and "cannot read the cache directory" in r.stderr, (args, r.stderr)
        assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def test_list_last_used_follows_runs_not_conversion(hub, tmp_path):
    env = env_for(hub, tmp_path)
    run_text("o/tiny-gguf", env)
    row = json.loads(bitnet("list", "--json", env=env).stdout)
    os.utime(row["path"], (row["last_used"] - 7200, os.stat(row["path"]).st_mtime - 7200))
    assert "2 hours ago" in bitnet("list", env=env).stdout
    run_text("o/tiny-gguf", env)
    assert "just now" in bitnet("list", env=env).stdout


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "unreachable endpoint"])
def test_pull_offline_says_so_in_one_line(hub, tmp_path, how):
    empty = tmp_path / "empty-cache"
    extra = {"HF_HUB_CACHE": str(empty)}
    if how == "HF_HUB_OFFLINE":
        extra["HF_HUB_OFFLINE"] = "1"
    else:
        extra.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HUB_ETAG_TIMEOUT="5",
                     HF_HUB_DOWNLOAD_TIMEOUT="5")
    env = env_for(hub, tmp_path, **extra)
    for ref in ("o/tiny", "o/tiny-gguf:model-i2_s.gguf"):
        r = bitnet("pull", ref, env=env, timeout=120)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "offline" in lines[0] and "Traceback" not in r.stderr, r.stderr
        assert ("HF_HUB_OFFLINE" in lines[0]) if how == "HF_HUB_OFFLINE" else ("127.0.0.1" in lines[0])


def test_pull_of_a_cached_model_works_offline_and_converts(hub, tmp_path):
    env = env_for(hub, tmp_path)
    r = bitnet("pull", "o/tiny-gguf:model-i2_s.gguf", env=env)
    assert r.returncode == 0, r.stderr
    store = r.stdout.strip()
    assert store.startswith(str(tmp_path / "stores")) and os.path.exists(store)
    assert "bitnet run -m o/tiny-gguf:model-i2_s.gguf" in r.stderr
    r = bitnet("pull", "not a hub id!", env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    # a damaged conversion in the cache is converted again (pull said "ready" over it, and the run then failed)
    with open(store, "r+b") as f:
        f.truncate(os.path.getsize(store) - 1000)
    r = bitnet("pull", "o/tiny-gguf:model-i2_s.gguf", env=env)
    assert r.returncode == 0 and "is damaged" in r.stderr and r.stdout.strip() == store, r.stderr
    assert run_text("o/tiny-gguf:model-i2_s.gguf", env) == greedy(hub["gguf"])
    # another head: the hint runs that conversion (without the flag, `run` converted the model a second time)
    r = bitnet("pull", "o/tiny-gguf:model-i2_s.gguf", "--lm-head", "f16", env=env)
    assert r.returncode == 0 and "ready: bitnet run -m o/tiny-gguf:model-i2_s.gguf --lm-head f16" in r.stderr


def test_a_local_path_wins_over_a_hub_id(hub, tmp_path):
    """A directory that happens to be called like a repo id is used as the path it is."""
    local = tmp_path / "o" / "tiny"
    shutil.copytree(hub["hf"][COMMIT_A], local)
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-m", "o/tiny", "-p", "Once upon", "-n", "8",
                        "--temp", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(env_for(hub, tmp_path), PYTHONPATH=pythonpath()))
    assert r.returncode == 0 and r.stdout == greedy(hub["hf"][COMMIT_A]), r.stderr


def test_convert_and_inspect_take_a_hub_id(hub, tmp_path):
    env = env_for(hub, tmp_path)
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", "o/tiny-gguf", "--no-progress"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path, env=dict(env, PYTHONPATH=pythonpath()))
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert os.path.basename(out) == "o--tiny-gguf--model-i2_s.bnstore" and os.path.dirname(os.path.abspath(
        os.path.join(tmp_path, out))) == str(tmp_path)
    info = bitnet("inspect", os.path.join(tmp_path, out), env=env).stdout
    assert f"source: o/tiny-gguf:model-i2_s.gguf@{COMMIT_A[:12]}" in info


class FakeHub:
    """The requests `bitnet pull` makes of the hub (the repository's listing and revision, HEAD for a file's
    metadata, GET for its bytes), answered on 127.0.0.1 for one repository at one commit: enough to see it
    download for real."""

    def __init__(self, repo: str, files: dict[str, bytes], commit: str, file_status: int = 200, said: str = "",
                 corrupt: bool = False, page: str | None = None):
        """file_status: the hub's answer to a file's HEAD / GET (429: its rate limit), `said` its error text;
        corrupt: a file's bytes come down altered (one byte), its listing and ETag those of the true bytes;
        page "file" / "listing": that answer is an HTML page with status 200 (a captive portal, a proxy's login)."""
        import http.server
        import threading

        hub = self
        self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _tree(self):
                """The repository's listing (`HfApi.list_repo_files`: one page, files only), and its revision
                (`HfApi.repo_info`, as snapshot_download asks it)."""
                if self.path.startswith(f"/api/models/{repo}/revision/"):
                    return json.dumps({"id": repo, "sha": commit,
                                       "siblings": [{"rfilename": name} for name in files]}).encode()
                if not self.path.startswith(f"/api/models/{repo}/tree/"):
                    return None
                return json.dumps([{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                                   for name, data in files.items()]).encode()

            def _file(self):
                prefix = f"/{repo}/resolve/"
                if not self.path.startswith(prefix):
                    return None
                name = self.path[len(prefix):].split("/", 1)[-1]
                return files.get(name)

            def _page(self, body: bool):
                html = b"<html><body>Sign in to continue</body></html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(html)))
                self.end_headers()
                self.wfile.write(html if body else b"")

            def _answer(self, body: bool):
                hub.requests.append((self.command, self.path))
                tree = self._tree()
                if tree is not None and page == "listing":
                    return self._page(body)
                if tree is None and page == "file" and body and self._file() is not None:
                    return self._page(body)
                if tree is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(tree)))
                    self.end_headers()
                    self.wfile.write(tree if body else b"")
                    return
                data = self._file()
                if data is not None and file_status != 200:
                    err = json.dumps({"error": said}).encode()
                    self.send_response(file_status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("X-Error-Message", said)
                    self.send_header("Content-Length", str(len(err)))
                    self.end_headers()
                    self.wfile.write(err if body else b"")
                    return
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data[:-1] + bytes([data[-1] ^ 1]) if corrupt else data)

            def do_HEAD(self):
                self._answer(False)

            def do_GET(self):
                self._answer(True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def online_env(hub, tmp_path, fake):
    """The environment of a pull from `fake` (the hub online, its downloads under tmp_path/downloads)."""
    return env_for(hub, tmp_path, HF_HUB_CACHE=str(tmp_path / "downloads"), HF_HUB_OFFLINE="0",
                   HF_ENDPOINT=fake.url, HF_HUB_DISABLE_TELEMETRY="1")


def test_pull_downloads_converts_and_then_runs_offline(hub, tmp_path):
    commit = "c" * 40
    fake = FakeHub("o/remote", {"model-i2_s.gguf": open(hub["gguf"], "rb").read()}, commit)
    try:
        env = online_env(hub, tmp_path, fake)
        r = bitnet("pull", "o/remote:model-i2_s.gguf", env=env)
        assert r.returncode == 0, r.stderr
        assert ("GET", "/o/remote/resolve/main/model-i2_s.gguf") in fake.requests
        store = r.stdout.strip()
        assert os.path.exists(store) and "bitnet run -m o/remote:model-i2_s.gguf" in r.stderr
        r = bitnet("pull", "o/remote:missing.gguf", env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "missing.gguf" in r.stderr
    finally:
        fake.close()
    offline = dict(env, HF_HUB_OFFLINE="1")
    assert run_text("o/remote:model-i2_s.gguf", offline) == greedy(hub["gguf"])
    rows = [json.loads(x) for x in bitnet("list", "--json", env=offline).stdout.splitlines()]
    assert [x["source"] for x in rows] == [f"o/remote:model-i2_s.gguf@{commit[:12]}"] and rows[0]["path"] == store


@pytest.mark.parametrize("status", [429, 403, 500])
def test_an_error_answer_of_the_hub_is_said_as_such_not_offline(hub, tmp_path, status):
    """The hub answering a file with an error status (429: its rate limit, which anonymous bursts meet) is that
    answer in one line, with what to do; it read "offline: cannot reach" the hub that had just answered."""
    fake = FakeHub("o/busy", {"model-i2_s.gguf": open(hub["gguf"], "rb").read()}, "d" * 40, file_status=status,
                   said="slow down" if status == 429 else "no access")
    try:
        env = online_env(hub, tmp_path, fake)
        r = bitnet("pull", "o/busy:model-i2_s.gguf", env=env, timeout=300)
    finally:
        fake.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "offline" not in r.stderr, r.stderr
    assert lines[-1].startswith(f"bitnet: error: pull o/busy:model-i2_s.gguf: the hub answered {status}"), r.stderr
    assert len(lines) == 1, r.stderr   # huggingface_hub's retries logged a line each ("Retrying in 8s ...")


@pytest.mark.parametrize("where", ["file", "listing"])
def test_a_page_where_the_hub_should_answer_is_one_line_of_ours(hub, tmp_path, where):
    """A captive portal or a proxy's login page, 200 and HTML, where the file or the repository's listing should
    be: the error was huggingface_hub's own words ("OSError: Consistency check failed: file should be of size
    ...", "JSONDecodeError: Expecting value: line 1 column 1")."""
    fake = FakeHub("o/portal", {"model-i2_s.gguf": open(hub["gguf"], "rb").read()}, "d" * 40, page=where)
    try:
        env = online_env(hub, tmp_path, fake)
        r = bitnet("pull", "o/portal", env=env, timeout=300)
    finally:
        fake.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("bitnet: error: pull o/portal: "), r.stderr
    assert "page" in lines[0] and "Consistency" not in lines[0] and "JSONDecodeError" not in lines[0], r.stderr
    assert ("model-i2_s.gguf" in lines[0]) if where == "file" else ("listing" in lines[0]), r.stderr


def test_a_download_with_other_bytes_than_listed_is_deleted_and_fetched_again(hub, tmp_path):
    """Bytes that differ from the hub's listed sha256 (a proxy, a bad resume): one line, and nothing kept, so the
    next pull downloads the file again; they were kept under the expected name, and every later pull said
    "downloaded" over them and failed in the converter ("not a GGUF file")."""
    data = open(hub["gguf"], "rb").read()
    env = env_for(hub, tmp_path, HF_HUB_CACHE=str(tmp_path / "downloads"), HF_HUB_OFFLINE="0",
                  HF_HUB_DISABLE_TELEMETRY="1")
    fake = FakeHub("o/flaky", {"model-i2_s.gguf": data}, "e" * 40, corrupt=True)
    try:
        r = bitnet("pull", "o/flaky:model-i2_s.gguf", env=dict(env, HF_ENDPOINT=fake.url))
    finally:
        fake.close()
    assert r.returncode == 2 and "came down with other bytes than the hub lists" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    fake = FakeHub("o/flaky", {"model-i2_s.gguf": data}, "e" * 40)
    try:
        r = bitnet("pull", "o/flaky:model-i2_s.gguf", env=dict(env, HF_ENDPOINT=fake.url))
        assert r.returncode == 0, r.stderr
        assert ("GET", "/o/flaky/resolve/main/model-i2_s.gguf") in fake.requests   # fetched again
    finally:
        fake.close()


def test_a_damaged_file_already_downloaded_is_fetched_again_in_the_same_pull(hub, tmp_path):
    """A file of the download cache damaged since (a disk error, a copy cut short): the pull said it "came down
    with other bytes" (nothing had come down) and failed, and only the next pull worked. It says the cached copy
    was damaged and downloads it again, once, in the same pull."""
    data = open(hub["gguf"], "rb").read()
    fake = FakeHub("o/again", {"model-i2_s.gguf": data}, "e" * 40)
    env = online_env(hub, tmp_path, fake)
    try:
        assert bitnet("pull", "--no-convert", "o/again", env=env).returncode == 0
        blobs = tmp_path / "downloads" / "models--o--again" / "blobs"
        (blob,) = blobs.iterdir()
        with open(blob, "r+b") as f:
            f.truncate(len(data) // 2)
        del fake.requests[:]
        r = bitnet("pull", "o/again", env=env)
        assert r.returncode == 0, r.stderr
        assert "came down" not in r.stderr and "damaged" in r.stderr and "model-i2_s.gguf" in r.stderr, r.stderr
        assert ("GET", "/o/again/resolve/main/model-i2_s.gguf") in fake.requests
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        fake.close()


def test_the_same_commit_downloaded_again_reuses_its_conversion(hub, tmp_path):
    """A download fetched again (its folder removed, a damaged blob replaced) is the same commit, the same bytes:
    it was converted again (the stores were keyed by the blobs' times), and `bitnet list` showed two rows of one
    SOURCE, the old one never used again."""
    data = open(hub["gguf"], "rb").read()
    fake = FakeHub("o/twice", {"model-i2_s.gguf": data}, "e" * 40)
    env = online_env(hub, tmp_path, fake)
    try:
        first = bitnet("pull", "o/twice", env=env)
        assert first.returncode == 0, first.stderr
        shutil.rmtree(tmp_path / "downloads" / "models--o--twice")
        again = bitnet("pull", "o/twice", env=env)
        assert again.returncode == 0, again.stderr
    finally:
        fake.close()
    assert again.stdout == first.stdout
    rows = [json.loads(x) for x in bitnet("list", "--json", env=env).stdout.splitlines()]
    assert [r["path"] for r in rows] == [first.stdout.strip()], rows


def test_a_split_gguf_is_pulled_whole(hub, tmp_path):
    """A model in gguf-split parts (m-TQ2_0-00001-of-0000N.gguf ...): `pull REPO`, `pull REPO:TAG` and a part's
    name each download every part and run as the one file does; the hints went in a circle (pick the tag -> name
    the file -> part 2 of N is missing)."""
    single = write_gguf_tq(SynthModel(small_config(), seed=8), str(tmp_path / "one.gguf"))
    src = tmp_path / "src"
    src.mkdir()
    write_gguf_tq(SynthModel(small_config(), seed=8), str(src / "m-TQ2_0.gguf"), split_max_tensors=5)
    parts = {p.name: p.read_bytes() for p in sorted(src.iterdir())}
    assert len(parts) >= 3 and all("-of-" in n for n in parts), list(parts)
    want = greedy(single)
    for i, ref in enumerate(("o/split", "o/split:TQ2_0", f"o/split:{sorted(parts)[0]}")):
        fake = FakeHub("o/split", parts, "f" * 40)
        env = env_for(hub, tmp_path, HF_HUB_CACHE=str(tmp_path / f"downloads{i}"), HF_HUB_OFFLINE="0",
                      HF_ENDPOINT=fake.url, HF_HUB_DISABLE_TELEMETRY="1", BITNET_CACHE=str(tmp_path / f"stores{i}"))
        try:
            r = bitnet("pull", ref, env=env)
            assert r.returncode == 0, (ref, r.stderr)
            got = {path.rsplit("/", 1)[-1] for method, path in fake.requests if method == "GET"}
            assert set(parts) <= got, (ref, got)
        finally:
            fake.close()
        assert run_text(ref, dict(env, HF_HUB_OFFLINE="1")) == want, ref


def test_pull_of_a_quant_tag_downloads_that_file_alone(hub, tmp_path):
    """`bitnet pull REPO:TAG` lists the repository and downloads the one GGUF file of that tag; without a tag, a
    repository of several GGUF files is refused before any download, naming its tags."""
    commit = "d" * 40
    fake = FakeHub("o/remote-quants", {name: open(p, "rb").read() for name, p in hub["quants"].items()}, commit)
    try:
        env = online_env(hub, tmp_path, fake)
        for ref in ("o/remote-quants", "o/remote-quants:latest", "o/remote-quants:Q8_0"):
            r = bitnet("pull", ref, env=env)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and "i2_s, TQ2_0" in lines[0], (ref, r.stderr)
        assert not [p for m, p in fake.requests if m == "GET" and p.endswith(".gguf")], fake.requests
        r = bitnet("pull", "--json-progress", "o/remote-quants:TQ2_0", env=env)
        assert r.returncode == 0, r.stderr
        got = [p for m, p in fake.requests if m == "GET" and p.endswith(".gguf")]
        assert got == ["/o/remote-quants/resolve/main/m-1.58bit-TQ2_0.gguf"], fake.requests
        assert "bitnet run -m o/remote-quants:TQ2_0" in r.stderr
        # the bytes as they came, for the server's ollama /api/pull: the file, its sha256, completed <= total
        data = open(hub["quants"]["m-1.58bit-TQ2_0.gguf"], "rb").read()
        updates = [json.loads(x[len("bitnet: progress "):]) for x in r.stderr.splitlines()
                   if x.startswith("bitnet: progress ")]
        got = [u for u in updates if "file" in u]
        assert got and got[-1] == {"file": "m-1.58bit-TQ2_0.gguf", "completed": len(data), "total": len(data),
                                   "digest": "sha256:" + hashlib.sha256(data).hexdigest()}, r.stderr
        assert all(0 <= u["completed"] <= u["total"] for u in updates)
        # then the conversion, step by step, after the last byte
        steps = [u for u in updates if "convert" in u]
        assert steps and updates.index(steps[0]) > updates.index(got[-1])
        assert [u["completed"] for u in steps] == list(range(1, steps[0]["total"] + 1)), steps
        assert {u["convert"] for u in steps} == {"o/remote-quants:TQ2_0"}
    finally:
        fake.close()
    offline = dict(env, HF_HUB_OFFLINE="1")
    assert run_text("o/remote-quants:TQ2_0", offline) == greedy(hub["quants"]["m-1.58bit-TQ2_0.gguf"])
    r = bitnet("run", "-m", "o/remote-quants:i2_s", "-p", "x", env=offline)   # listed there, not downloaded
    assert r.returncode == 2 and "bitnet pull o/remote-quants:i2_s" in r.stderr


def test_pull_of_an_hf_repository_takes_its_model_files_with_progress(hub, tmp_path):
    """An HF-layout repository comes down as a snapshot of the model's files alone (no README, no GGUF beside
    them), its bytes reported as one item named by the repository; the model then runs offline as it was."""
    commit = "e" * 40
    files = {name: open(p, "rb").read() for name, p in hf_files(hub["hf"][COMMIT_B]).items()}
    extra = {"README.md": b"# a model card\n", "m-1.58bit-TQ2_0.gguf": open(hub["quants"]["m-1.58bit-TQ2_0.gguf"], "rb").read()}
    fake = FakeHub("o/remote-hf", {**files, **extra}, commit)
    try:
        env = online_env(hub, tmp_path, fake)
        r = bitnet("pull", "--json-progress", "o/remote-hf", env=env)
        assert r.returncode == 0, r.stderr
        fetched = {p.rsplit("/", 1)[-1] for m, p in fake.requests if m == "GET" and "/resolve/" in p}
        assert fetched == set(files), fake.requests
        updates = [json.loads(x[len("bitnet: progress "):]) for x in r.stderr.splitlines()
                   if x.startswith("bitnet: progress ") and '"file"' in x]
        total = sum(len(d) for d in files.values())
        assert updates and updates[-1] == {"file": "o/remote-hf", "digest": "o/remote-hf", "completed": total,
                                           "total": total}, r.stderr
        # the listing's size from the first object on (a client sizes its bar by it): it grew as files were found
        assert all(u["total"] == total and 0 <= u["completed"] <= total for u in updates), updates
    finally:
        fake.close()
    assert run_text("o/remote-hf", dict(env, HF_HUB_OFFLINE="1")) == greedy(hub["hf"][COMMIT_B])


def test_a_download_missing_a_weight_shard_is_one_line(hub, tmp_path):
    """A sharded model whose download lacks a shard (an interrupted pull) says which, rather than failing in
    the loader; the rest of the snapshot is found as it is."""
    d = write_hf_dir(SynthModel(small_config(), seed=8), str(tmp_path / "sharded"), shards=2)
    files = hf_files(d)
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) == 2 and "model.safetensors.index.json" in files
    cache = str(tmp_path / "cache")
    add_snapshot(cache, "o/sharded", COMMIT_A, files)
    env = env_for(hub, tmp_path, HF_HUB_CACHE=cache)
    assert run_text("o/sharded", env) == greedy(d)
    add_snapshot(cache, "o/half", COMMIT_A, {f: p for f, p in files.items() if f != shards[1]})
    r = bitnet("run", "-m", "o/half", "-p", "x", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"lacks 1 of its 2 weight files ({shards[1]})" in lines[0], r.stderr


@pytest.mark.parametrize("weight_map", [{"a": None}, {"a": 3}, "deep"])
def test_a_broken_shard_index_by_hub_id_is_one_line(hub, tmp_path, weight_map):
    """A downloaded index whose weight_map names no files, or nests past the stack, is the loader's one line
    (exit 2), as the same folder given by path says; the hub's own look at the index crashed (exit 70)."""
    d = write_hf_dir(SynthModel(small_config(), seed=8), str(tmp_path / "sharded"), shards=2)
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write("[" * 100000 + "]" * 100000 if weight_map == "deep" else json.dumps({"weight_map": weight_map}))
    cache = str(tmp_path / "cache")
    add_snapshot(cache, "o/broken", COMMIT_A, hf_files(d))
    env = env_for(hub, tmp_path, HF_HUB_CACHE=cache)
    by_path = bitnet("run", "-m", d, "-p", "x", env=env)
    r = bitnet("run", "-m", "o/broken", "-p", "x", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == by_path.returncode == 2 and len(lines) == 1, (r.stderr, by_path.stderr)
    assert "model.safetensors.index.json" in lines[0] and "Traceback" not in r.stderr


def test_a_split_gguf_download_missing_a_part_says_which(hub, tmp_path):
    """A split GGUF whose download lacks a part (an interrupted pull): REPO and REPO:TAG say which part is not
    there and to pull again; they sent the user round (pick the tag -> name the file -> part N is missing)."""
    src = tmp_path / "src"
    src.mkdir()
    write_gguf_tq(SynthModel(small_config(), seed=8), str(src / "m-TQ2_0.gguf"), split_max_tensors=5)
    parts = sorted(p.name for p in src.iterdir())
    assert len(parts) >= 3, parts
    cache = str(tmp_path / "cache")
    add_snapshot(cache, "o/cut", COMMIT_A, {p: str(src / p) for p in parts if p != parts[1]})
    env = env_for(hub, tmp_path, HF_HUB_CACHE=cache)
    for ref in ("o/cut", "o/cut:TQ2_0"):
        r = bitnet("run", "-m", ref, "-p", "x", env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (ref, r.stderr)
        assert f"lacks part 2 of {len(parts)}" in lines[0] and f"bitnet pull {ref}" in lines[0], (ref, r.stderr)


def test_a_deleted_blob_names_its_file_and_an_unused_one_is_no_matter(hub, tmp_path):
    """A snapshot whose link points at a deleted blob: the error names that file (it named the folder, "cannot
    read: No such file or directory"); a dangling link to a file the conversion does not read is no reason to
    refuse the model (run refused it where convert worked)."""
    d = write_hf_dir(SynthModel(small_config(), seed=8), str(tmp_path / "sharded"), shards=2)
    files = hf_files(d)
    cache = str(tmp_path / "cache")
    snap = add_snapshot(cache, "o/gone", COMMIT_A, files)
    os.symlink("../../blobs/" + "0" * 64, os.path.join(snap, "unused.json"))
    env = env_for(hub, tmp_path, HF_HUB_CACHE=cache)
    assert run_text("o/gone", env) == greedy(d)
    assert "tokenizer.json" in files
    os.remove(os.path.realpath(os.path.join(snap, "tokenizer.json")))
    r = bitnet("run", "-m", "o/gone", "-p", "x", env=env, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and os.path.join(snap, "tokenizer.json") in lines[0], r.stderr


def test_offline_pull_of_an_unfinished_download_says_offline_and_what_works_offline(hub, tmp_path):
    """Offline, a pull of a download left unfinished said "finish it with `bitnet pull o/half`" (the command just
    run, which cannot finish it offline), and a pull of a model not downloaded pointed at `bitnet run -m REPO`,
    which sends the user back to `bitnet pull`. The line says offline, and the hint what works offline."""
    d = write_hf_dir(SynthModel(small_config(), seed=8), str(tmp_path / "src"))
    cache = str(tmp_path / "cache")
    add_snapshot(cache, "o/half", COMMIT_A, {f: p for f, p in hf_files(d).items() if not f.endswith(".safetensors")})
    env = env_for(hub, tmp_path, HF_HUB_CACHE=cache)
    for ref in ("o/half", "o/absent"):
        r = bitnet("pull", ref, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and f"pull {ref}: offline: HF_HUB_OFFLINE" in lines[0], r.stderr
        hint = lines[0].split("(hint: ", 1)[1]
        assert f"bitnet pull {ref}" not in hint and "bitnet run -m REPO" not in hint, r.stderr
        assert "unset HF_HUB_OFFLINE" in hint and "local" in hint, r.stderr
    assert "no *.safetensors" in bitnet("pull", "o/half", env=env).stderr   # what is wrong with the download
    # `run` offline: the pull it suggests needs HF_HUB_OFFLINE unset first
    r = bitnet("run", "-m", "o/absent", "-p", "x", env=env)
    assert r.returncode == 2 and "unset HF_HUB_OFFLINE" in r.stderr and "bitnet pull o/absent" in r.stderr, r.stderr
    # an unreachable hub: the hint is about the network, not the same command
    r = bitnet("pull", "o/absent", env=env_for(hub, tmp_path, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="0",
                                              HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "offline: cannot reach" in lines[0], r.stderr
    hint = lines[0].split("(hint: ", 1)[1]
    assert "bitnet run -m REPO" not in hint and "HF_HUB_OFFLINE" in hint and "local" in hint, r.stderr


def test_tags_that_differ_only_in_case_get_a_hint_that_picks_one(hub, tmp_path):
    """Two GGUF files whose tags differ only in case (tags match in any case): the hint said `pick one: ...:I2_S`,
    a tag that names both files, so following it was the next error. The hint names a file where a tag cannot."""
    cache = str(tmp_path / "cache")
    add_snapshot(cache, "o/two", COMMIT_A, {"a-i2_s.gguf": hub["gguf"], "b-I2_S.gguf": hub["gguf"]})
    env = env_for(hub, tmp_path, HF_HUB_CACHE=cache)
    r = bitnet("run", "-m", "o/two", "-p", "x", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "I2_S" in lines[0] and "i2_s" in lines[0], r.stderr
    suggested = lines[0].split("-m ")[-1].rstrip(")")
    assert suggested == "o/two:a-i2_s.gguf", r.stderr
    assert run_text(suggested, env) == greedy(hub["gguf"])
    # online, before anything is downloaded: the same
    fake = FakeHub("o/two", {"a-i2_s.gguf": b"x", "b-I2_S.gguf": b"y", "c-TQ2_0.gguf": b"z"}, "d" * 40)
    try:
        r = bitnet("pull", "o/two", env=online_env(hub, tmp_path, fake))
    finally:
        fake.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "pick one: bitnet pull o/two:TQ2_0" in lines[0], r.stderr


@pytest.mark.parametrize("ref", ["o/tiny-gguf\n", "o/tiny-gguf\r", "o/tiny-gguf:model-i2_s.gguf\n", "\to/tiny-gguf",
                                 "o/tiny-gguf@main\n", "o/tiny-\x1b[2Jgguf"])
def test_a_hub_id_with_a_control_character_is_refused_in_one_line(hub, tmp_path, ref):
    """`bitnet pull $'o/r\\n'` was taken as o/r (a trailing newline passed the id's pattern, a trailing space did
    not), and its lines were split by the newline. Refused, as ollama refuses such a name, in one line."""
    env = env_for(hub, tmp_path)
    for args in (("pull", ref), ("run", "-m", ref, "-p", "x"), ("convert", ref)):
        r = bitnet(*args, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "control character" in lines[0] and repr(ref) in lines[0], (args, r.stderr)
    assert parse_hub_ref(ref) is None


def test_the_ready_hint_is_quoted_for_the_shell(hub, tmp_path):
    """The line after a pull showed `bitnet run -m o/sp:sub dir/m ü-i2_s.gguf`, which a shell splits: pasted, it
    ran another model or none. The name is quoted where it needs to be, and the line runs as printed."""
    import shlex

    cache = str(tmp_path / "cache")
    name = "sub dir/m ü-i2_s.gguf"
    add_snapshot(cache, "o/sp", COMMIT_A, {name: hub["gguf"]})
    env = env_for(hub, tmp_path, HF_HUB_CACHE=cache)
    r = bitnet("pull", f"o/sp:{name}", env=env)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if "ready: " in ln]
    command = line.split("ready: ", 1)[1]
    assert command == f"bitnet run -m 'o/sp:{name}'", line
    argv = shlex.split(command)
    assert argv[:3] == ["bitnet", "run", "-m"] and argv[3] == f"o/sp:{name}"
    assert run_text(argv[3], env) == greedy(hub["gguf"])
    r = bitnet("pull", "o/tiny-gguf", "--lm-head", "f16", env=env_for(hub, tmp_path))   # a plain name stays plain
    assert r.returncode == 0 and "ready: bitnet run -m o/tiny-gguf --lm-head f16" in r.stderr, r.stderr


@pytest.mark.parametrize("ref, said", [("o/tiny-gguf:model-i2_s.gguf", "o/tiny-gguf:model-i2_s.gguf"),
                                       ("o/tiny@v1", f"o/tiny@{COMMIT_A}")], ids=["gguf-at-main", "dir-at-a-tag"])
def test_a_stale_cache_entry_of_a_download_says_a_command_that_replaces_it(hub, tmp_path, ref, said):
    """A cache entry of a hub download that an older bitnet-cpu made (every one, after a converter change) said
    `bitnet run -m <the blob or snapshot path in the hub cache>`: that run made a second entry, named after the
    blob, and the stale one stayed and was said at every `serve --models-cache` start. The line now gives the hub
    id (with the full commit where it is not the repository's main), and that command converts the entry in place."""
    import shlex

    from bitnet_cpu.engine.formats.convert import CONVERTER_VERSION
    from bitnet_cpu.engine.formats.store import Store
    from test_store_compat import rewrite

    env = env_for(hub, tmp_path)
    run_text(ref, env)
    stores = tmp_path / "stores"
    [entry] = [str(p) for p in stores.iterdir() if p.name.endswith(".bnstore")]

    def as_older(index):   # as converter 3 left it (its stamp is not today's)
        index["meta"]["converter_version"] = "3"
        index["meta"]["cache"]["stamp"] = "0" * 20
    rewrite(entry, entry + ".tmp", as_older)
    os.replace(entry + ".tmp", entry)
    llm = load_model(entry, ctx=64, progress=False)
    said_lines = [w for w in llm.warnings if "stale" in w]
    llm.close()
    assert len(said_lines) == 1 and f"`bitnet run -m {shlex.quote(said)}`" in said_lines[0], said_lines
    cmd = shlex.split(said_lines[0].split("`")[1])
    assert cmd[0] == "bitnet"
    r = bitnet(*cmd[1:], "-p", "Once upon", "-n", "2", "-t", "1", env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in stores.iterdir() if p.name.endswith(".bnstore")) == [os.path.basename(entry)]
    assert Store(entry, load="mmap").meta["converter_version"] == CONVERTER_VERSION
    llm = load_model(entry, ctx=64, progress=False)
    assert llm.warnings == [], llm.warnings
    llm.close()
