"""The implicit conversion cache (`-m FILE`, `bitnet list`, `bitnet rm`): one store per source and options, a
changed source converted again in place of its earlier store, `list` telling sources apart and marking stale
ones, `rm` refusing a file name that several folders' files share, and `rm --stale`."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.formats.convert import convert, resolve_model
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_i2s, write_hf_dir
from serve_proc import pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models():
    return SynthModel(small_config(), seed=11), SynthModel(small_config(), seed=12)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("BITNET_CACHE", str(d))
    return d


def bitnet(*args, cache):
    env = dict(os.environ, BITNET_CACHE=str(cache), PYTHONPATH=pythonpath())
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def listed(cache) -> list[dict]:
    r = bitnet("list", "--json", cache=cache)
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines()]


def gguf(model, path) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return write_gguf_i2s(model, path)


def later(path, seconds=10):
    """The source changed as a re-download, a checkout or an rsync changes it: its mtime moves on."""
    t = os.stat(path).st_mtime_ns + seconds * 10**9
    os.utime(path, ns=(t, t))


def stamp(src) -> str:
    from bitnet_cpu.engine.formats.convert import source_stamp
    return source_stamp(src)


def tensors(path) -> dict:
    with Store(path) as s:
        return {n: np.array(s.tensor(n)) for n in s.tensor_names}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_a_touched_source_replaces_its_conversion(models, cache, tmp_path):
    """A new mtime converted the source into a second store beside the first, which stayed forever (142 stores of
    a day's use); the new conversion now replaces it, under the same name, and the next run uses it as it is."""
    src = write_gguf_i2s(models[0], str(tmp_path / "m.gguf"))
    p1 = resolve_model(src, progress=False)
    later(src)
    p2 = resolve_model(src, progress=False)
    assert sorted(os.listdir(cache)) == [os.path.basename(p2)]
    assert p2 == p1
    assert Store(p2).meta["cache"]["stamp"] == stamp(src)   # the second run's store is the current one
    made = os.stat(p2).st_mtime_ns
    assert resolve_model(src, progress=False) == p2 and os.stat(p2).st_mtime_ns == made   # used, not converted
    assert [r["status"] for r in listed(cache)] == ["current"]


def test_a_changed_source_is_read_anew_and_the_open_old_store_stays_readable(models, cache, tmp_path):
    """Other weights at the same path: the cache's store is theirs after the next use, and a process that had the
    earlier store mapped keeps reading it whole (the new one is renamed over it, not written into it)."""
    src = write_gguf_i2s(models[0], str(tmp_path / "m.gguf"))
    old = Store(resolve_model(src, progress=False), load="mmap")
    before = {n: np.array(old.tensor(n)) for n in old.tensor_names}
    write_gguf_i2s(models[1], src)
    later(src)
    path = resolve_model(src, progress=False)
    assert same_tensors(tensors(path), tensors(convert(src, str(tmp_path / "ref.bnstore"), progress=False)))
    assert not same_tensors(tensors(path), before)
    assert same_tensors({n: np.array(old.tensor(n)) for n in old.tensor_names}, before)
    old.close()
    assert len(os.listdir(cache)) == 1


def test_an_edited_file_of_a_model_folder_replaces_its_conversion(models, cache, tmp_path):
    src = write_hf_dir(models[0], str(tmp_path / "hf"))
    p1 = resolve_model(src, progress=False)
    later(os.path.join(src, "config.json"))
    assert resolve_model(src, progress=False) == p1 and len(os.listdir(cache)) == 1
    assert Store(p1).meta["cache"]["stamp"] == stamp(src)
    resolve_model(src, lm_head="f16", progress=False)   # other options: a store of their own beside it
    assert len(os.listdir(cache)) == 2


def test_list_shows_the_source_path_and_marks_stale_and_missing_sources(models, cache, tmp_path):
    """`list` showed the file name alone (two folders' model.gguf looked the same) and nothing said which store
    was of a source that had changed or was gone."""
    a = gguf(models[0], str(tmp_path / "a" / "model.gguf"))
    b = gguf(models[1], str(tmp_path / "b" / "model.gguf"))
    pa, pb = resolve_model(a, progress=False), resolve_model(b, progress=False)
    rows = {r["path"]: r for r in listed(cache)}
    assert {rows[pa]["source_path"], rows[pb]["source_path"]} == {os.path.realpath(a), os.path.realpath(b)}
    assert rows[pa]["source"] == "model.gguf" and rows[pa]["status"] == rows[pb]["status"] == "current"
    table = bitnet("list", cache=cache).stdout.splitlines()
    assert table[0].split() == ["NAME", "SOURCE", "SIZE", "HEAD", "STATUS", "LAST", "USED"]
    assert any(os.path.realpath(a) in x and "current" in x for x in table[1:])
    assert any(os.path.realpath(b) in x for x in table[1:])
    later(a)
    shutil.rmtree(tmp_path / "b")
    rows = {r["path"]: r for r in listed(cache)}
    assert (rows[pa]["status"], rows[pb]["status"]) == ("stale", "source missing")
    table = bitnet("list", cache=cache).stdout
    assert "stale" in table and "source missing" in table


def old_style_entry(src, cache) -> str:
    """A conversion an earlier bitnet left in the cache: named by a key of the source's mtime, no record of it."""
    os.makedirs(cache, exist_ok=True)
    return convert(src, os.path.join(cache, os.path.basename(src) + "-0123456789abcdef0123.bnstore"),
                   progress=False)


def test_rm_refuses_a_file_name_of_two_folders_and_all_takes_both(models, cache, tmp_path):
    """`rm model.gguf` deleted every conversion of every model.gguf, from any folder, without asking."""
    a = gguf(models[0], str(tmp_path / "a" / "model.gguf"))
    b = gguf(models[1], str(tmp_path / "b" / "model.gguf"))
    pa, pb = resolve_model(a, progress=False), resolve_model(b, progress=False)
    r = bitnet("rm", "model.gguf", cache=cache)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    names = [os.path.basename(p)[: -len(".bnstore")] for p in (pa, pb)]
    assert all(n in lines[0] for n in names) and "--all" in lines[0], lines
    assert os.path.exists(pa) and os.path.exists(pb)
    r = bitnet("rm", names[0], cache=cache)        # the store's name picks one
    assert r.returncode == 0 and not os.path.exists(pa) and os.path.exists(pb), r.stderr
    pa = resolve_model(a, progress=False)
    r = bitnet("rm", os.path.join(str(tmp_path), "b", "model.gguf"), cache=cache)   # so does the source's path
    assert r.returncode == 0 and os.path.exists(pa) and not os.path.exists(pb), r.stderr
    pb = resolve_model(b, progress=False)
    resolve_model(a, lm_head="f16", progress=False)   # two heads of one file: one source, no question
    r = bitnet("rm", "model.gguf", "--all", cache=cache)
    assert r.returncode == 0 and r.stdout.count("deleted") == 3 and listed(cache) == [], (r.stdout, r.stderr)
    resolve_model(a, progress=False)
    resolve_model(a, lm_head="f16", progress=False)
    r = bitnet("rm", "model.gguf", cache=cache)
    assert r.returncode == 0 and r.stdout.count("deleted") == 2, (r.stdout, r.stderr)


def test_rm_stale_removes_changed_missing_and_old_entries_and_says_the_space(models, cache, tmp_path):
    keep = write_gguf_i2s(models[0], str(tmp_path / "keep.gguf"))
    changed = write_gguf_i2s(models[1], str(tmp_path / "changed.gguf"))
    gone = gguf(models[1], str(tmp_path / "gone" / "gone.gguf"))
    current = resolve_model(keep, progress=False)
    stale = [resolve_model(changed, progress=False), resolve_model(gone, progress=False), old_style_entry(keep, cache)]
    mine = convert(keep, str(cache / "mine.bnstore"), progress=False)   # put there by hand: not the cache's
    later(changed)
    shutil.rmtree(tmp_path / "gone")
    status = {r["path"]: r["status"] for r in listed(cache)}
    assert [status[p] for p in stale] == ["stale", "source missing", "stale"] and status[mine] == "unknown"
    assert bitnet("rm", "--stale", "keep.gguf", cache=cache).returncode == 2   # with names: refused, nothing goes
    assert all(os.path.exists(p) for p in stale)
    size = sum(os.path.getsize(p) for p in stale)
    r = bitnet("rm", "--stale", cache=cache)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert sorted(x.split()[1] for x in out if x.startswith("deleted")) == \
        sorted(os.path.basename(p)[: -len(".bnstore")] for p in stale)
    assert out[-1].startswith("freed") and f"({size} bytes)" in out[-1], out
    assert sorted(os.listdir(cache)) == sorted(os.path.basename(p) for p in (current, mine))
    r = bitnet("rm", "--stale", cache=cache)
    assert r.returncode == 0 and "nothing to remove" in r.stdout
