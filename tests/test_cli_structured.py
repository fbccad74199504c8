"""`bitnet run`'s structured-output flags (llama.cpp's spellings) in a subprocess on the bundled model: the
answer on stdout matches the schema / grammar, what cannot be enforced is one line naming the flag (exit 2)
before any token, and --help tells -j from --json."""
import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}


def bitnet(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("how", ["inline", "file"])
def test_json_schema_flags(tmp_path, how):
    if how == "inline":
        flag = ["-j", json.dumps(SCHEMA)]
    else:
        p = tmp_path / "s.json"
        p.write_text(json.dumps(SCHEMA))
        flag = ["--json-schema-file", str(p)]
    for seed in ("1", "2"):
        r = bitnet("-p", "Best city?", "--chat", "--temp", "1", "--seed", seed, "-n", "200", *flag)
        assert r.returncode == 0, r.stderr
        jsonschema.validate(json.loads(r.stdout), SCHEMA)


def test_grammar_flags_and_jump_forward_off_same_text(tmp_path):
    g = 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'
    p = tmp_path / "g.gbnf"
    p.write_text(g)
    a = bitnet("-p", "Is it?", "--temp", "0", "-n", "60", "--grammar", g)
    b = bitnet("-p", "Is it?", "--temp", "0", "-n", "60", "--grammar-file", str(p), "--no-jump-forward")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", a.stdout), a.stdout
    assert a.stdout == b.stdout


@pytest.mark.parametrize("args, words", [
    (["-j", '{"type": "strin"}'], "-j/--json-schema: cannot be enforced"),
    (["-j", '{"type": "array", "uniqueItems": true}'], "uniqueItems"),
    (["-j", "[1, 2"], "-j/--json-schema: not valid JSON"),
    (["-j", '{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}'],
     "-j/--json-schema: cannot be enforced: no finite JSON value"),
    (["--grammar", 'root ::= "a'], "--grammar: GBNF grammar"),
    (["--json-schema-file", "/nonexistent/s.json"], "--json-schema-file /nonexistent/s.json"),
    (["-j", "{}", "--grammar", 'root ::= "a"'], "not allowed with argument"),
])
def test_bad_constraints_one_line_exit_2(args, words):
    r = bitnet("-p", "x", "-n", "4", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_help_tells_json_lines_from_json_answers():
    out = bitnet("--help").stdout
    assert "--json-schema" in out and "--grammar-file" in out and "to make the ANSWER JSON, use -j" in " ".join(out.split())


@pytest.mark.parametrize("how", ["-j {}", "-j ''", "file {}"])
def test_empty_schema_is_a_json_object(tmp_path, how):
    """'{}' is "a JSON object" (docs/structured-output.md's table, --help, /set format json, llama.cpp's converter),
    never any JSON value: it gave 60, 8, 59911.59119."""
    if how.startswith("file"):
        p = tmp_path / "s.json"
        p.write_text("{}\n")
        flag = ["--json-schema-file", str(p)]
    else:
        flag = ["-j", "{}" if how == "-j {}" else ""]
    for seed in ("1", "2", "3"):
        r = bitnet("-p", "Hi", "--seed", seed, "-n", "80", "--json", *flag)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(line) for line in r.stdout.splitlines()]
        text, done = "".join(d.get("text", "") for d in lines), lines[-1]
        assert text.startswith("{"), (seed, text)
        if done["finish_reason"] == "stop":   # whole: an object (cut by -n: its start says it)
            assert isinstance(json.loads(text), dict), (seed, text)


def test_empty_schema_is_a_json_object_in_the_chat():
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-cnv", "-j", "{}", "--temp", "0", "-n", "40"],
                       input="Hi\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("{"), r.stdout


@pytest.mark.parametrize("flag", ["--json-schema-file", "--grammar-file"])
def test_a_constraint_file_is_a_regular_file_of_bounded_size(tmp_path, flag):
    """--json-schema-file / --grammar-file read the whole of whatever they were given: /dev/zero grew the process
    without bound (and a FIFO with no writer hung it), as /set format did in bitchat. Only a regular file of at
    most 4 MiB is read now, `~` expanded; anything else is one line naming the flag, exit 2."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b" " * ((4 << 20) + 1))
    cases = [("/dev/zero", "not a regular file"), (str(fifo), "not a regular file"),
             (str(tmp_path), "is a directory"), (str(big), "over 4 mib")]
    for path, words in cases:
        r = subprocess.run([sys.executable, "-c", "import resource, runpy, sys; "
                            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
                            "sys.argv = ['bitnet', 'run', '-p', 'x', '-n', '2', *sys.argv[1:]]; "
                            "runpy.run_module('bitnet_cpu', run_name='__main__')", flag, path],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and flag in lines[0], (path, r.stderr)
        assert words in lines[0].lower(), (path, r.stderr)
    home = tmp_path / "home"
    home.mkdir()
    (home / "g").write_text(json.dumps(SCHEMA) if flag == "--json-schema-file" else 'root ::= "yes"')
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-p", "x", "-n", "4", "--temp", "0", f"{flag}=~/g"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, HOME=str(home)))
    assert r.returncode == 0, r.stderr
