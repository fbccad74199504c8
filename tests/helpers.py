"""Helpers several test files share (plain functions; the shared fixtures are in conftest.py)."""
import contextlib
import functools
import os
import resource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout (its files, not imports)


@contextlib.contextmanager
def address_space_cap(headroom: int = 3 << 30):
    """Cap this process's address space at what it already maps (torch from other tests, thread stacks) plus
    `headroom` bytes, so a lying header that makes the code allocate gigabytes fails with MemoryError."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm = 0
    try:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        pass
    cap = vm + headroom
    if hard != resource.RLIM_INFINITY and hard < cap:
        cap = hard
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def file_size_cap(limit: int):
    """Writes past `limit` bytes of a file fail (EFBIG) while the block runs, as on a full disk: the OS's own limit
    (RLIMIT_FSIZE; Python ignores SIGXFSZ), so a write that fails then works again needs no stand-in of our code."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def assert_conversion_refused(src: str, tmp_path, match: str) -> str:
    """A source that must not convert: convert() raises FormatError matching `match` and leaves no file, and
    `bitnet convert` exits 2 with one error line (plus at most a hint), no traceback. Returns that stderr."""
    import subprocess
    import sys

    import pytest

    from bitnet_cpu.engine.errors import FormatError
    from bitnet_cpu.engine.formats.convert import convert

    with pytest.raises(FormatError, match=match):
        convert(src, str(tmp_path / "x.bnstore"), progress=False)
    assert not os.path.exists(tmp_path / "x.bnstore")
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", src, "-o", str(tmp_path / "y.bnstore")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2, r.stderr
    return r.stderr


def bitnet_inspect(target: str) -> tuple[str, str]:
    """`bitnet inspect target` in a fresh process: (its stdout, its "runtime:" line); it must exit 0."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "inspect", target], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout, next(line for line in r.stdout.splitlines() if line.startswith("runtime:"))


def console_script(name: str) -> list[str]:
    """The command for our console script `name` ("bitnet" or "bitchat") that runs the code this interpreter
    imports: the script pip installed beside sys.executable, else the same entry point via `python -m`. Never a
    lookup on PATH, which may find another interpreter's script (a pyenv shim, a stale install)."""
    import sys

    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return [here]
    return [sys.executable, "-m", {"bitnet": "bitnet_cpu", "bitchat": "bitnet_cpu.cli.chat"}[name]]


@functools.lru_cache(maxsize=None)
def slowness() -> float:
    """How many times slower than the development machine this interpreter runs a fixed pure-Python loop (1.0
    there or on anything faster). Tests that wait for a long generation, a server or Ray multiply their bounds by
    it, so an emulated CPU (qemu-user aarch64: ~16x here), a Raspberry Pi or a loaded CI runner waits longer
    instead of failing; nothing is asserted on it. The loop ran in 0.06 s (best of 3) on the 2-core EPYC,
    loaded; 0.1 s is the reference so ordinary x86 machines keep the bounds as written."""
    import time

    def loop() -> float:
        t0, x = time.perf_counter(), 0
        for i in range(1_000_000):
            x += i * i
        return time.perf_counter() - t0
    return max(1.0, min(loop() for _ in range(3)) / 0.1)


def rope_tables(n_ctx: int, head_dim: int):
    """The half-split RoPE cos / sin tables (theta 10000) the attention ops take: float32 [n_ctx, head_dim / 2]."""
    import numpy as np

    inv = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    fr = np.arange(n_ctx, dtype=np.float32)[:, None] * inv[None]
    return np.cos(fr).astype(np.float32), np.sin(fr).astype(np.float32)


def xz_files(root, data_dir: str):
    """get(stem) -> the path of data_dir/stem.gguf.xz unpacked under root (once per stem); get.root is root.
    The test data of bitnet.cpp's formats (tests/data/tl, tests/data/i2s) is kept xz-compressed."""
    import lzma
    import shutil

    def get(stem: str) -> str:
        path = os.path.join(str(root), f"{stem}.gguf")
        if not os.path.exists(path):
            with lzma.open(os.path.join(data_dir, f"{stem}.gguf.xz")) as f, open(path, "wb") as g:
                shutil.copyfileobj(f, g)
        return path
    get.root = root
    return get


def gguf_fields(path: str) -> tuple[dict, dict, int]:
    """Where a GGUF file's header fields sit, read without our reader (whose parse a test of it must not lean
    on): ({key: (position of its length field, position of its value)}, {tensor name: position of its n_dims
    field}, the end of the tensor infos)."""
    import struct

    b = open(path, "rb").read()
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(pos: int, t: int) -> int:
        if t == 8:
            return pos + 8 + struct.unpack_from("<Q", b, pos)[0]
        if t == 9:
            sub, count = struct.unpack_from("<IQ", b, pos)
            pos += 12
            if sub in sizes:
                return pos + count * sizes[sub]
            for _ in range(count):
                pos = skip(pos, sub)
            return pos
        return pos + sizes[t]

    n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)
    pos, keys, ndims = 24, {}, {}
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", b, pos)
        key = b[pos + 8: pos + 8 + n].decode()
        (t,) = struct.unpack_from("<I", b, pos + 8 + n)
        keys[key] = (pos, pos + 8 + n + 4)
        pos = skip(pos + 8 + n + 4, t)
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", b, pos)
        name = b[pos + 8: pos + 8 + n].decode()
        pos += 8 + n
        ndims[name] = pos
        (nd,) = struct.unpack_from("<I", b, pos)
        pos += 4 + 8 * nd + 4 + 8
    return keys, ndims, pos
