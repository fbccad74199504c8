"""What git tracks stays small and source-only: every clone downloads every tracked file, forever.

A 10 MB linter wheel once sat at the repository root, committed alongside an unrelated change. These tests
fail on tracked packages / archives anywhere, and on any tracked file over 5 MB outside models/ (the bundled
default model is the one large file the product needs).
"""
import os
import shutil
import subprocess

import pytest

from helpers import ROOT

MAX_BYTES = 5 * 1024 * 1024
ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".7z", ".rar", ".egg")


def tracked_files():
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot list tracked files")
    proc = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout (an sdist or installed copy): nothing is tracked")
    return [p for p in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def test_no_tracked_packages_or_archives():
    found = [p for p in tracked_files() if p.lower().endswith(ARCHIVE_SUFFIXES)]
    assert not found, f"built packages / archives are tracked (git rm them; .gitignore lists the types): {found}"


def test_no_large_tracked_files_outside_models():
    large = []
    for path in tracked_files():
        if path.startswith("models/"):
            continue
        full = os.path.join(ROOT, path)
        if os.path.isfile(full) and os.path.getsize(full) > MAX_BYTES:
            large.append((path, os.path.getsize(full)))
    assert not large, f"tracked files over {MAX_BYTES >> 20} MB outside models/: {large}"


def test_gitignore_keeps_packages_out():
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        patterns = {line.strip() for line in f}
    assert {"*.whl", "*.tar.gz", "*.zip"} <= patterns


TEXT_SUFFIXES = (".py", ".pyx", ".pxi", ".pxd", ".c", ".h", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml")


def test_no_issue_numbers_in_tracked_text():
    """An issue number means nothing to a reader of the repository: code, comments, docs, headings and file
    names say what a thing does or measures instead."""
    import re
    pattern = re.compile(r"\bissues? ?#?\d+\b", re.IGNORECASE)
    found = []
    for path in tracked_files():
        if pattern.search(os.path.basename(path)):
            found.append(path)
        if not path.endswith(TEXT_SUFFIXES) or not os.path.isfile(os.path.join(ROOT, path)):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line):
                    found.append(f"{path}:{n}: {line.strip()[:80]}")
    assert not found, "issue numbers in tracked files (say what the thing does instead):\n" + "\n".join(found)


def test_every_kernel_source_ships_in_the_packages():
    """The sdist and the wheel carry simd's sources by [tool.setuptools.package-data]'s patterns: _ops.pxi (which
    _kernels.pyx includes) matched none, so `pip install` of the sdist (PyPI's fallback where no wheel fits) and
    `python -m build` failed with Cython's "'_ops.pxi' not found". Every tracked source the build reads must match."""
    import fnmatch
    try:
        import tomllib
    except ImportError:   # Python 3.10: pytest's own dependency
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["bitnet_cpu.simd"]
    sources = [p[len("simd/"):] for p in tracked_files()
               if p.startswith("simd/") and p.endswith((".pyx", ".pxd", ".pxi", ".c", ".h"))]
    assert sources
    left_out = [p for p in sources if not any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]
    assert not left_out, f"simd sources no package-data pattern of pyproject.toml ships: {left_out}"
