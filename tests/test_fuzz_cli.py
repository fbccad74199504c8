"""Seeded mutation fuzzing of what users hand to `bitnet`: GGUF headers, weight-store headers and indexes,
config.json, tokenizer.json, tokenizer_config.json (its chat template). Every case goes through the CLI's own
entry, engine.cli.main (convert, then run the result), in-process for speed; a sample also runs through the
real `python -m engine` subprocess. Whatever the bytes, a case either loads and generates (exit 0) or exits 2
with exactly one line on stderr ("bitnet: error: ..."), never a traceback, an "internal error" (exit 70),
a signal or a hang. A failure prints the category and the case's seed: rerun it with
BITNET_FUZZ_CLI_ONLY=category:seed. BITNET_FUZZ_CLI_CASES sets the number of cases (default 1500).
"""
import contextlib
import copy
import hashlib
import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time

import pytest

from bitnet_cpu.cli import main
from bitnet_cpu.engine.formats.gguf import GGUFFile
from bitnet_cpu.engine.formats.store import _HEADER
from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_i2s, write_gguf_tq, write_hf_dir
from helpers import ROOT, address_space_cap

CASES = int(os.environ.get("BITNET_FUZZ_CLI_CASES", "1500"))
CASE_SECONDS = 20   # CPU seconds of this process per case: a busy machine stretches wall time, not work
CATEGORIES = ("gguf_header", "store_header", "store_index", "config_json", "tokenizer_json", "tokenizer_bytes",
              "chat_template")
ODD_VALUES = [None, True, False, 0, -1, 1, 3, 255, 2 ** 31, 2 ** 63, 2 ** 64 + 5, -(2 ** 40), 1e308, -0.0, 0.5,
              float("nan"), float("inf"), "", "x", "relu2", "BPE", "\udcff"[:0] + "é", [], [1, 2], ["a"], {}, {"a": 1},
              {"type": "BPE"}, [[1, 2]], "{{", "{% for %}"]
HOSTILE_TEMPLATES = [
    "{% for i in range(10**9) %}x{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% set a = range(90000)|list %}{% for i in a %}{% for j in a %}{{ '' }}{% endfor %}{% endfor %}",
    "{{ 'x' * 10000000000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ '%3000000000s'|format('x') }}",
    "{{ 'y'|center(5000000000) }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ messages[99]['content'] }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ raise_exception('no') }}",
    "{% for m in messages %}{{ m.content|upper }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}",
    "{{ (1).__class__.__subclasses__() }}",
    "{% for %}",
    "{{ 1 // 0 }}",
    "{{ messages|tojson(indent=3000000000) }}",
]


def _cli(argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, err.getvalue()


def _check(rc, err, what):
    assert rc in (0, 2), f"{what}: exit {rc}: {err}"
    assert "Traceback" not in err and "internal error" not in err, f"{what}: {err}"
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("bitnet: warning: ")]
        assert len(lines) == 1 and lines[0].startswith("bitnet: error: "), f"{what}: {err!r}"


@pytest.fixture(autouse=True)
def _memory_cap():
    """A lying file must never make us allocate gigabytes: cap the address space while fuzzing (what this
    process already maps plus 3 GiB)."""
    with address_space_cap(3 << 30):
        yield


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzcli")
    m = SynthModel(small_config(num_hidden_layers=1, vocab_size=300), seed=9)
    hf = write_hf_dir(m, str(d / "hf"))
    gguf = {"i2s": write_gguf_i2s(m, str(d / "i2s.gguf")), "tq2": write_gguf_tq(m, str(d / "tq2.gguf"), "TQ2_0")}
    offsets = {}
    for k, p in gguf.items():
        with GGUFFile(p) as g:
            offsets[k] = g.data_offset
    store = str(d / "base.bnstore")
    assert _cli(["convert", hf, "-o", store, "--no-progress"])[0] == 0
    return {"dir": d, "hf": hf, "gguf": gguf, "gguf_data_offset": offsets, "store": store}


# ---- mutators --------------------------------------------------------------------------------------------
def _mutate_bytes(rng: random.Random, data: bytes, hot_end: int) -> bytes:
    """1-4 edits, most inside [0, hot_end) (the header: counts, lengths, types, dims, offsets)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not b:
            break
        pos = rng.randrange(min(hot_end, len(b))) if rng.random() < 0.85 else rng.randrange(len(b))
        kind = rng.choice(["byte", "byte", "u32", "u64", "truncate", "delete", "insert"])
        if kind == "byte":
            b[pos] = rng.randrange(256)
        elif kind in ("u32", "u64"):
            n = 4 if kind == "u32" else 8
            v = rng.choice([0, 1, 2, 7, 9, 36, 255, 2 ** 31, 2 ** 32 - 1, 2 ** 40, 2 ** 64 - 1, rng.getrandbits(64)])
            b[pos: pos + n] = struct.pack("<Q", v % 2 ** 64)[:n][: len(b) - pos]
        elif kind == "truncate":
            del b[pos:]
        elif kind == "delete":
            del b[pos: pos + rng.randint(1, 16)]
        else:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(b)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):  # a few elements of long lists (vocabularies, merges)
            yield from _paths(v, prefix + (i,))


def _mutate_json(rng: random.Random, obj):
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(obj) if p]
        if not paths:
            return copy.deepcopy(rng.choice(ODD_VALUES))
        path = rng.choice(paths)
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        r = rng.random()
        if r < 0.15 and isinstance(parent, dict):
            del parent[key]
        elif r < 0.25 and isinstance(parent[key], (dict, list)) and parent[key]:
            parent[key] = type(parent[key])()  # emptied
        else:
            parent[key] = copy.deepcopy(rng.choice(ODD_VALUES))   # never share (or mutate) the pool
    return obj


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


# ---- one case ----------------------------------------------------------------------------------------------
def _run_case(base, work, category: str, seed: int):
    """Build the mutated input in `work`, feed it to the CLI, check the outcome."""
    rng = random.Random(f"{category}:{seed}")
    what = f"{category}:{seed}"
    out = os.path.join(work, "out.bnstore")
    if category == "gguf_header":
        which = rng.choice(sorted(base["gguf"]))
        src = os.path.join(work, "mut.gguf")
        data = open(base["gguf"][which], "rb").read()
        with open(src, "wb") as f:
            f.write(_mutate_bytes(rng, data, base["gguf_data_offset"][which]))
    elif category in ("store_header", "store_index"):
        data = bytearray(open(base["store"], "rb").read())
        _, _, _, ioff, isize, doff, _ = _HEADER.unpack_from(data, 0)
        if category == "store_header":
            hot = _HEADER.size if rng.random() < 0.6 else len(data)
            data = bytearray(_mutate_bytes(rng, bytes(data), hot))
        else:  # a structurally wrong index with a valid checksum: gets past the sha256 to the real checks
            index = _mutate_json(rng, json.loads(bytes(data[ioff: ioff + isize])))
            raw = _json_bytes(index)
            data = data[:ioff] + raw
            struct.pack_into("<QQ", data, 16, ioff, len(raw))
            data[40:72] = hashlib.sha256(raw).digest()
        src = os.path.join(work, "mut.bnstore")
        with open(src, "wb") as f:
            f.write(bytes(data))
        out = src
    else:
        src = os.path.join(work, "hf")
        if not os.path.isdir(src):
            shutil.copytree(base["hf"], src)
        for fn in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(base["hf"], fn), os.path.join(src, fn))
        if category == "config_json":
            fn, mutate = "config.json", "json"
        elif category == "tokenizer_json":
            fn, mutate = "tokenizer.json", "json"
        elif category == "tokenizer_bytes":
            fn, mutate = rng.choice(["tokenizer.json", "config.json", "tokenizer_config.json"]), "bytes"
        else:
            fn, mutate = "tokenizer_config.json", "template"
        p = os.path.join(src, fn)
        if mutate == "json":
            new = _json_bytes(_mutate_json(rng, json.load(open(p, encoding="utf-8"))))
        elif mutate == "bytes":
            data = open(p, "rb").read()
            new = _mutate_bytes(rng, data, len(data))
        else:
            tc = json.load(open(p, encoding="utf-8"))
            tc["chat_template"] = copy.deepcopy(rng.choice(HOSTILE_TEMPLATES + [rng.choice(ODD_VALUES)]))
            new = _json_bytes(tc)
        with open(p, "wb") as f:
            f.write(new)
    t0 = time.process_time()
    if out != src:
        rc, err = _cli(["convert", src, "-o", out, "--no-progress"])
        _check(rc, err, what + " convert")
        if rc != 0:
            return rc
    rc, err = _cli(["run", "-m", out, "-p", "Hi there", "-n", "2", "--temp", "0", "-t", "1"]
                   + (["--chat"] if category == "chat_template" or rng.random() < 0.3 else []))
    _check(rc, err, what + " run")
    assert time.process_time() - t0 < CASE_SECONDS, f"{what}: took {time.process_time() - t0:.1f} CPU s"
    return rc


def _cases():
    only = os.environ.get("BITNET_FUZZ_CLI_ONLY")
    if only:
        cat, seed = only.split(":")
        return [(cat, int(seed))]
    per = max(1, CASES // len(CATEGORIES))
    return [(c, s) for c in CATEGORIES for s in range(per)]


@pytest.mark.filterwarnings("error::RuntimeWarning")   # a numpy warning would be a second stderr line for users
def test_fuzz_cli_in_process(base, tmp_path):
    counts = {c: [0, 0] for c in CATEGORIES}   # [loaded, refused]
    for category, seed in _cases():
        work = str(tmp_path / category)
        os.makedirs(work, exist_ok=True)
        rc = _run_case(base, work, category, seed)
        counts[category][rc != 0] += 1
    print("loaded/refused per category:", counts)
    if not os.environ.get("BITNET_FUZZ_CLI_ONLY"):
        # the fuzzer must reach both outcomes, or it is not exercising the loaders
        assert all(r > 0 for _, r in counts.values()), counts
        assert sum(ok for ok, _ in counts.values()) > 0, counts


def test_fuzz_cli_subprocess_sample(base, tmp_path):
    """A sample of the same cases through the real CLI process: exit status, one stderr line, no signal."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for category in CATEGORIES:
        for seed in (1, 2):
            work = str(tmp_path / f"{category}-{seed}")
            os.makedirs(work, exist_ok=True)
            rng = random.Random(f"{category}:{seed}")
            _run_case(base, work, category, seed)   # leaves the mutated input in `work`
            target = next((os.path.join(work, f) for f in ("mut.gguf", "mut.bnstore", "hf") if
                           os.path.exists(os.path.join(work, f))))
            cache = os.path.join(work, "cache")
            r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-m", target, "-p", "Hi", "-n", "2", "--temp",
                                "0", "-t", "1"] + (["--chat"] if rng.random() < 0.5 else []), cwd=ROOT,
                               env=dict(env, BITNET_CACHE=cache), capture_output=True, text=True, timeout=120)
            _check(r.returncode, r.stderr, f"{category}:{seed} subprocess")
            assert not [f for f in os.listdir(cache) if f.startswith(".bnstore-")] if os.path.isdir(cache) else True
