"""Each script in examples/ runs exactly as its docstring says: the indented command lines of the docstring are
run as written, a `bitnet serve &` line as a plain `bitnet serve` (the bundled model, every default flag) on a free
port of 127.0.0.1 (the one change, made in both commands: tests run beside each other, 8080 may be taken), then
the example's own command line. No -c, no -t: what a new user types is what is tested."""
from __future__ import annotations

import ast
import glob
import os
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("openai", reason="the examples need the openai client (pip install .[test])")
from helpers import slowness  # noqa: E402
from serve_proc import ROOT, Server  # noqa: E402

EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
DOC_PORT = "8080"


def documented_commands(path: str) -> list[list[str]]:
    """The docstring's indented lines (its usage block), each split as the shell would (comments dropped)."""
    doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read())) or ""
    return [shlex.split(line, comments=True) for line in doc.splitlines()
            if line.startswith("    ") and line.strip() and not line.strip().startswith("#")]


def test_every_example_documents_its_command():
    assert EXAMPLES
    for path in EXAMPLES:
        cmds = documented_commands(path)
        rel = os.path.relpath(path, ROOT)
        assert any(c[:2] == ["python", rel] for c in cmds), (rel, cmds)


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_example_runs_as_documented(path):
    cmds = documented_commands(path)
    servers = [c for c in cmds if c[:2] == ["bitnet", "serve"]]
    rest = [c for c in cmds if c[:2] != ["bitnet", "serve"]]
    assert len(servers) <= 1 and all(c[0] == "python" for c in rest), cmds
    server = None
    if servers:
        flags = [a for a in servers[0][2:] if a != "&"]
        assert not flags, f"the example's server has flags {flags}: run it with them, or document it without"
        server = Server(threads=None)   # bitnet serve --host 127.0.0.1 --port <free>: nothing else
    try:
        for c in rest:
            argv = [sys.executable] + [a.replace(f"127.0.0.1:{DOC_PORT}", f"127.0.0.1:{server.port}") if server else a
                                       for a in c[1:]]
            r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300 * slowness())
            print(r.stdout)
            assert r.returncode == 0, f"{shlex.join(c)}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
            assert "Traceback" not in r.stderr, r.stderr[-3000:]
    finally:
        if server is not None:
            rc, err = server.stop()
            assert rc == 0 and "Traceback" not in err, err[-3000:]


def test_agent_does_not_run_a_call_cut_by_max_tokens():
    """examples/agent.py ran a tool call the server marked cut (finish_reason "length", arguments "") and died in
    json.loads with a traceback; a cut step is now one line saying so (raise --max-tokens), and arguments that are
    not JSON reach the model as the tool's error, never a traceback. Greedy answers for max-tokens from "cut before
    any call" to "whole", against a real `bitnet serve`."""
    server = Server(threads=1)
    seen = set()
    try:
        for n in (10, 16, 20, 24, 128, 256):
            r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "agent.py"), "--base-url",
                                server.url + "/v1", "--max-tokens", str(n), "Use the calculator: what is 17*3?"],
                               cwd=ROOT, capture_output=True, text=True, timeout=300 * slowness())
            assert "Traceback" not in r.stderr, (n, r.stderr[-3000:])
            if r.returncode:
                assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, (n, r.stderr)
                assert "--max-tokens" in r.stderr and "length" in r.stderr, (n, r.stderr)
                seen.add("cut")
            else:
                assert "answer:" in r.stdout, (n, r.stdout)
                seen.add("whole")
    finally:
        rc, err = server.stop()
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert seen == {"cut", "whole"}


def test_agent_tool_arguments_that_are_not_json_are_the_tools_error():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import agent
    finally:
        sys.path.pop(0)
    for bad in ("", "{", "[1]", '{"x": 1}'):
        result = agent.run_tool("calculator", bad)
        assert result.startswith("error:") and "\n" not in result, (bad, result)
    assert agent.run_tool("calculator", '{"expression": "17*3"}') == "51"


def test_agent_failures_are_one_line_not_a_traceback():
    """examples/agent.py died with a 25-line traceback when the server could not be reached (APIConnectionError)
    and when it refused the request: a `bitnet serve -c 512` (what the start-up warning names for the bundled
    model) cannot take the two tools, a 400 context_length_exceeded. Each is now one line on stderr, exit 1."""
    from serve_proc import free_port
    agent = os.path.join(ROOT, "examples", "agent.py")
    nowhere = f"http://127.0.0.1:{free_port()}/v1"   # nothing listens there
    r = subprocess.run([sys.executable, agent, "--base-url", nowhere], cwd=ROOT, capture_output=True, text=True,
                       timeout=120 * slowness())
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and nowhere in r.stderr, r.stderr
    server = Server("-c", "512", threads=1)
    try:
        r = subprocess.run([sys.executable, agent, "--base-url", server.url + "/v1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300 * slowness())
    finally:
        rc, err = server.stop()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "400" in line and "512" in line, line
    assert rc == 0 and "Traceback" not in err, err[-3000:]


def test_agent_says_which_limit_cut_the_tool_call():
    """A step 1 cut by the server's context (finish_reason length with fewer tokens than --max-tokens) was told to
    "raise --max-tokens", which can never help; it names the context and -c now. A cut at --max-tokens still says to
    raise that."""
    import openai
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import agent as example
    finally:
        sys.path.pop(0)
    script = os.path.join(ROOT, "examples", "agent.py")
    server = Server("-c", "600", threads=1)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        # what the agent's step 1 gets: cut by the context (the calls the model makes need more than its room)
        first = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What time is it, and what is 17*3?"}],
            tools=example.TOOLS, tool_choice="required", temperature=0, max_tokens=5000)
        used = first.usage.prompt_tokens + first.usage.completion_tokens
        assert first.choices[0].finish_reason == "length" and used == 601, first.usage
        said = {}
        for max_tokens in ("5000", "3"):
            r = subprocess.run([sys.executable, script, "--base-url", server.url + "/v1", "--max-tokens", max_tokens],
                               cwd=ROOT, capture_output=True, text=True, timeout=300 * slowness())
            assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
            said[max_tokens] = r.stderr.strip()
    finally:
        rc, err = server.stop()
    assert "context" in said["5000"] and "larger -c" in said["5000"] and "600" in said["5000"], said
    assert "--max-tokens" not in said["5000"], said
    assert "cut at 3 tokens" in said["3"] and "raise --max-tokens" in said["3"], said
    assert rc == 0, err[-3000:]


def test_the_default_context_warning_names_what_the_trained_length_costs():
    """The server's start-up warning (its default context past the bundled model's trained 512) said "-c 512 keeps
    to it" as plain advice; followed, the agent example's two tools no longer fit. It names that cost now."""
    from bitnet_cpu.engine.api import load_engine
    eng = load_engine(None, threads=1, parallel=1, progress=False)
    try:
        trained = eng.config.context_length
        assert eng.n_ctx > trained   # the server's default context: the warning's case
        (w,) = [w for w in eng.warnings if f"-c {trained}" in w]
    finally:
        eng.close()
    assert "tool" in w and "system prompt" in w and "\n" not in w, w
