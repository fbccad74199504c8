"""Helpers several test files share (plain functions; the shared fixtures are in conftest.py)."""
import contextlib
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
