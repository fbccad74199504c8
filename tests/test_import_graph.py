"""The floor plan, checked from the code's own imports (read with `ast`, nothing is imported).

The installed package is `bitnet_cpu`; its subpackages are the repository's top-level folders. Each room may
import only the rooms below it:

    cli                      the `bitnet` / `bitchat` commands
    chat, serve              the REPL and the HTTP server, both over engine.api
    engine                   api (top) > batching, synth > runtime, formats > config, errors, cpu, faults, fileio,
                             memory
    simd                     C kernels and their wrappers: imports nothing of the others
    models                   the bundled model and its trainer: a leaf, imported by nobody in the runtime

Every import counts, also the ones inside functions: a lazy import is still an arrow in the house.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ["simd", "engine", "chat", "serve", "cli", "models"]
OLD_TOP_NAMES = {"simd", "engine", "chat", "serve", "cli", "models"}


def package_modules():
    """{module name: path} for every .py file of the package (bitnet_cpu.<folder>...)."""
    mods = {"bitnet_cpu": os.path.join(ROOT, "__init__.py"), "bitnet_cpu.__main__": os.path.join(ROOT, "__main__.py")}
    for top in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    mods[".".join(["bitnet_cpu"] + rel)] = os.path.join(dirpath, f)
    return mods


MODULES = package_modules()


def _is_package(name):
    return MODULES[name].endswith("__init__.py")


def imports_of(name):
    """The modules of ours that `name` imports (relative imports resolved; `from pkg import mod` -> pkg.mod)."""
    tree = ast.parse(open(MODULES[name]).read())
    here = name.split(".") if _is_package(name) else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            targets = subs or [mod]          # `from pkg import mod` is an arrow to mod, not to pkg
        else:
            continue
        for t in targets:
            if t.split(".")[0] in OLD_TOP_NAMES:
                found.add("BARE:" + t)           # an import of the old top-level names
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t.startswith("bitnet_cpu.") and t != name:
                found.add(t)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def room(mod):
    """engine's rooms are its subpackages (formats, runtime, ...) and its top files; other packages are one room."""
    parts = mod.split(".")
    if len(parts) < 2:
        return "bitnet_cpu"
    if parts[1] == "engine" and len(parts) >= 3:
        return "engine." + parts[2]
    return parts[1]


# what each room may import (besides itself); everything else is an arrow the wrong way
ENGINE_BASE = {"engine.errors", "engine.config", "engine.cpu", "engine.faults", "engine.fileio", "engine.memory"}
ALLOWED = {
    "simd": set(),
    "models": set(),
    "engine": {"simd"},                                  # engine/__init__.py
    "engine.errors": {"simd"},
    "engine.config": {"engine.errors"},
    "engine.cpu": set(),
    "engine.faults": {"engine.errors", "simd"},
    "engine.fileio": {"engine.errors", "engine.faults"},
    "engine.memory": {"engine.errors"},
    "engine.formats": ENGINE_BASE | {"simd"},
    "engine.runtime": ENGINE_BASE | {"simd"},
    "engine.batching": ENGINE_BASE | {"simd", "engine.runtime"},
    "engine.synth": ENGINE_BASE | {"simd", "engine.formats"},
    "engine.api": ENGINE_BASE | {"simd", "engine.formats", "engine.runtime", "engine.batching"},
    "chat": {"engine", "engine.api", "engine.formats", "engine.runtime"} | ENGINE_BASE,
    "serve": {"engine", "engine.api", "engine.runtime"} | ENGINE_BASE,
    "cli": {"simd", "engine", "chat", "serve", "engine.api", "engine.formats", "engine.runtime"} | ENGINE_BASE,
    "__main__": {"cli"},
    "bitnet_cpu": set(),
}


def test_the_walk_found_the_package():
    assert "bitnet_cpu.simd" in MODULES and "bitnet_cpu.engine.api" in MODULES and "bitnet_cpu.cli" in MODULES
    assert len(MODULES) > 60
    assert any("bitnet_cpu.simd.errors" in deps for deps in GRAPH.values())   # arrows are seen at all


def test_no_module_imports_the_old_top_level_names():
    bare = sorted((m, t[5:]) for m, deps in GRAPH.items() for t in deps if t.startswith("BARE:"))
    assert not bare, f"imports of a bare top-level name instead of bitnet_cpu.*: {bare}"


def test_every_arrow_points_down():
    wrong = []
    for mod, deps in GRAPH.items():
        here = room(mod)
        for d in deps:
            if d.startswith("BARE:"):
                continue
            there = room(d)
            if there != here and there not in ALLOWED[here]:
                wrong.append(f"{mod} -> {d}")
    assert not wrong, "arrows that run the wrong way:\n" + "\n".join(sorted(wrong))


def test_simd_imports_nothing_above_it():
    up = [(m, d) for m, deps in GRAPH.items() if room(m) == "simd" for d in deps if room(d) != "simd"]
    assert not up, up


def test_no_import_circles():
    """Tarjan's strongly connected components over every import (lazy ones too)."""
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w.startswith("BARE:") or w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not sccs, f"import circles: {sccs}"


def test_the_runtime_never_imports_writers_or_the_trainer():
    runtime_rooms = {"engine.runtime", "engine.batching", "engine.api", "engine.formats", "chat", "serve", "cli"}
    bad = [(m, d) for m, deps in GRAPH.items() if room(m) in runtime_rooms for d in deps
           if room(d) in ("engine.synth", "models")]
    assert not bad, bad


def test_the_distribution_installs_one_import_name():
    from importlib import metadata

    try:
        dist = metadata.distribution("bitnet-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("bitnet-cpu is not installed (pip install -e .): no installed metadata to check")
    top = (dist.read_text("top_level.txt") or "").split()
    assert top == ["bitnet_cpu"], top
    for script in dist.entry_points:
        assert script.value.startswith("bitnet_cpu."), script


@pytest.mark.parametrize("cwd", ["root", "tmp"])
def test_python_m_bitnet_cpu_runs_from_any_directory(cwd, tmp_path):
    import subprocess
    import sys

    where = ROOT if cwd == "root" else str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "--version"], cwd=where, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("bitnet "), r.stderr
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu.simd"], cwd=where, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "active:" in r.stdout, r.stderr


def test_tests_and_benchmarks_import_the_package_by_its_one_name():
    """Outside the package too: `import engine` would load a second copy of the code from the checkout."""
    bad = []
    for folder in ("tests", "bench"):
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if not f.endswith(".py"):
                continue
            path = os.path.join(ROOT, folder, f)
            for node in ast.walk(ast.parse(open(path).read())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                bad += [f"{folder}/{f}:{node.lineno} {n}" for n in names if n.split(".")[0] in OLD_TOP_NAMES]
    assert not bad, bad
