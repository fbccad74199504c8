"""The commands the README and docs/*.md show as runnable do run, on the bundled model, as a user would type them.

A shell block is runnable when its fence says so (```sh runnable) or a `<!-- runnable -->` line comes right
before it; each of its lines runs through bash from the repository root (so `models/default.bnstore` resolves),
with the `bitnet` / `bitchat` of this interpreter, an empty model cache and no network. Mark only commands that
take a few seconds on 2 cores on the bundled model. Also: every relative link in those pages points at a file, and
every block that talks to `bitnet serve` (curl, the openai client) works against a plain `bitnet serve`.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = "<!-- runnable -->"
COMMAND_SECONDS = 120          # a hang guard for one command, not a speed check


def runnable_blocks(path):
    """[(line number, [command, ...])] of the runnable shell blocks of one Markdown file."""
    text = open(path, encoding="utf-8").read()
    blocks = []
    for m in FENCE.finditer(text):
        info = m.group(1).split()
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if not (info[:1] in (["sh"], ["bash"], ["shell"]) and "runnable" in info[1:]) and before != MARKER:
            continue
        lines, cmd = [], ""
        for raw in m.group(2).splitlines():   # join backslash continuations
            cmd += raw[:-1] + " " if raw.endswith("\\") else raw
            if not raw.endswith("\\"):
                if cmd.strip() and not cmd.strip().startswith("#"):
                    lines.append(cmd.strip())
                cmd = ""
        blocks.append((text.count("\n", 0, m.start()) + 1, lines))
    return blocks


def _cases():
    for path in PAGES:
        for line, commands in runnable_blocks(path):
            for cmd in commands:
                yield pytest.param(cmd, id=f"{os.path.relpath(path, ROOT)}:{line}:{cmd.split('#')[0].strip()}")


def _shell_prelude():
    """The installed console scripts when they sit beside this interpreter (pip install -e), else the same
    entry points run by this interpreter, so the checkout's code is what runs either way."""
    bindir = os.path.dirname(sys.executable)
    if shutil.which("bitnet", path=bindir) and shutil.which("bitchat", path=bindir):
        return bindir, ""
    py = sys.executable.replace("'", "'\\''")
    return bindir, (f"bitnet() {{ '{py}' -m bitnet_cpu \"$@\"; }}\n"
                    f"bitchat() {{ '{py}' -c 'import sys; from bitnet_cpu.cli.bitchat import main; "
                    f"sys.exit(main(sys.argv[1:]))' \"$@\"; }}\n")


def test_the_guide_has_runnable_commands():
    readme = runnable_blocks(os.path.join(ROOT, "README.md"))
    assert readme and all(cmds for _, cmds in readme), "README.md lost its runnable blocks"
    assert sum(len(c) for p in PAGES for _, c in runnable_blocks(p)) >= 5


@pytest.mark.parametrize("cmd", list(_cases()))
def test_runnable_command(cmd, tmp_path):
    bindir, prelude = _shell_prelude()
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), BITNET_CACHE=str(tmp_path),
               HF_HUB_OFFLINE="1")
    env.pop("BITNET_ISA", None)
    r = subprocess.run(["bash", "-o", "pipefail", "-c", prelude + cmd], cwd=ROOT, env=env, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=COMMAND_SECONDS)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip(), f"{cmd}: printed nothing on stdout"


def test_relative_links_point_at_files():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    missing = []
    for path in PAGES:
        text = FENCE.sub("", open(path, encoding="utf-8").read())
        for target in link.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            full = os.path.normpath(os.path.join(os.path.dirname(path), target))
            if not os.path.exists(full):
                missing.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not missing, missing


DOC_SERVER = "127.0.0.1:8080"


def client_blocks():
    """[(page:line, language, code)] of the blocks that talk to a documented server (curl, the openai client), not
    those that start one."""
    out = []
    for path in PAGES:
        text = open(path, encoding="utf-8").read()
        for m in FENCE.finditer(text):
            code = m.group(2)
            if DOC_SERVER in code and not re.search(r"^\s*(pip|bitnet serve|upstream)\b", code, re.M):
                out.append((f"{os.path.relpath(path, ROOT)}:{text.count(chr(10), 0, m.start()) + 1}",
                            m.group(1).split()[:1], code))
    return out


def test_client_commands_work_on_a_plain_server():
    """Every curl and Python block of the README and docs/ that talks to `bitnet serve` runs as written against a
    plain `bitnet serve` (the bundled model, no flags; only the port differs, as tests run beside each other)."""
    pytest.importorskip("openai", reason="the client blocks use the openai client (pip install .[test])")
    from serve_proc import Server

    blocks = client_blocks()
    assert len(blocks) >= 3, blocks
    s = Server(threads=None)
    try:
        for where, lang, code in blocks:
            code = code.replace(DOC_SERVER, f"127.0.0.1:{s.port}")
            argv = [sys.executable, "-c", code] if lang == ["python"] else ["bash", "-o", "pipefail", "-c", code]
            r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=COMMAND_SECONDS)
            assert r.returncode == 0 and r.stdout.strip(), f"{where}: exit {r.returncode}\n{r.stderr[-2000:]}"
            assert "Traceback" not in r.stderr and '"error"' not in r.stdout, f"{where}: {r.stdout[:500]}{r.stderr}"
    finally:
        rc, err = s.stop()
        assert rc == 0 and "Traceback" not in err, err[-2000:]


def api_blocks():
    """[(page:line, code)] of the Python blocks of the README and docs/ that use the Python API (no server)."""
    out = []
    for path in PAGES:
        text = open(path, encoding="utf-8").read()
        for m in FENCE.finditer(text):
            if m.group(1).split()[:1] == ["python"] and "from bitnet_cpu.engine.api import" in m.group(2) \
                    and DOC_SERVER not in m.group(2):
                out.append((f"{os.path.relpath(path, ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(2)))
    return out


def test_python_api_blocks_run_as_written():
    """The README's Python examples loaded "bitnet-2b.bnstore", a file nothing had made: a new user's first run
    was "no such file or directory". Every Python API block runs as written, on the bundled model."""
    blocks = api_blocks()
    assert len(blocks) >= 3, blocks
    for where, code in blocks:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=COMMAND_SECONDS)
        assert r.returncode == 0, f"{where}: exit {r.returncode}\n{r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr, f"{where}: {r.stderr[-2000:]}"


def test_the_asyncio_recipe_answers_as_the_engine_does():
    """docs/api.md's asyncio recipe (the API has no async methods; users of the openai and ollama clients expect
    them) runs as written, and its answers, awaited through the callback bridge, are the ones Engine.submit gives
    the same requests when iterated."""
    import ast

    text = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
    section = text[text.index("## The Python API from asyncio"):]
    code = next(m.group(2) for m in FENCE.finditer(section) if m.group(1).strip() == "python")
    assert "asyncio.run(" in code and "call_soon_threadsafe" in code
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=COMMAND_SECONDS)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    got = ast.literal_eval(r.stdout.strip().splitlines()[-1])

    from bitnet_cpu.engine.api import SamplingParams, load_engine
    with load_engine(None, threads=2, parallel=2, progress=False) as eng:
        want = ["".join(c.text for c in eng.submit(eng.chat_prompt([{"role": "user", "content": q}]),
                                                   SamplingParams(temperature=0), max_tokens=24))
                for q in ("Tell me a story", "What is 2+2?")]
    assert got == want
