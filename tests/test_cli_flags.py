"""The command line as llama.cpp and ollama users type it, in subprocesses: llama.cpp flag spellings, -n -1,
--ignore-eos, -sys, -cnv, unknown flags answered with the subcommand's usage and a suggestion, --json,
non-UTF-8 input, a closed stdout or stdin, --version, `bitnet info`, shell completion."""
import json
import os
import subprocess
import sys

import pytest

from bitnet_cpu.engine.api import load_model
from test_model_fixtures import make_synth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("flags"), seed=21, lm_heads=("f16",))[2]["f16"]


@pytest.fixture(scope="module")
def bundled():
    from bitnet_cpu.engine.formats.convert import bundled_model

    path = bundled_model()
    if path is None:
        pytest.skip("no bundled model in models/ (it ships with the package)")
    return path


def run(module, *args, stdin=None, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True,
                          timeout=timeout, cwd=ROOT, env=env, text=not isinstance(stdin, bytes))


def bitnet(*args, **kw):
    return run("bitnet_cpu", *args, **kw)


def json_lines(text):
    return [json.loads(x) for x in text.splitlines()]


def test_llama_cpp_spellings_mean_the_same(store):
    base = bitnet("run", "-m", store, "-p", "Once upon a time", "-n", "12", "-c", "64", "-t", "1", "--temp", "0")
    assert base.returncode == 0 and base.stdout, base.stderr
    long = bitnet("run", "--model", store, "--prompt", "Once upon a time", "--n-predict", "12", "--ctx-size", "64",
                  "--threads", "1", "--temperature", "0")
    assert long.returncode == 0 and long.stdout == base.stdout, long.stderr
    assert bitnet("run", "-m", store, "-p", "Once upon a time", "--max-tokens", "12", "--ctx", "64",
                  "--temp", "0").stdout == base.stdout
    # -sys / --system-prompt apply the chat template as --chat --system does
    chat = bitnet("run", "-m", store, "--chat", "--system", "Be brief.", "-p", "Hi", "-n", "8", "--temp", "0")
    assert chat.returncode == 0 and chat.stdout != ""
    for flag in ("-sys", "--system-prompt"):
        r = bitnet("run", "-m", store, flag, "Be brief.", "-p", "Hi", "-n", "8", "--temp", "0")
        assert r.returncode == 0 and r.stdout == chat.stdout, r.stderr


def test_n_minus_one_runs_to_a_full_context_and_stops_cleanly(store):
    r = bitnet("run", "-m", store, "-p", "Once", "-n", "-1", "-c", "40", "--ignore-eos", "--temp", "0", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    done = json_lines(r.stdout)[-1]
    # the context is full: every position holds a token (the last one sampled needs no room of its own)
    assert done["finish_reason"] == "context" and done["stats"]["n_prompt"] + done["stats"]["n_generated"] == 41
    r = bitnet("run", "-m", store, "-p", "Once", "-n", "-3")   # (-2 is llama.cpp's "until the context is full")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "-1" in r.stderr


def test_ignore_eos_never_samples_the_end_token(bundled):
    plain = json_lines(bitnet("run", "-m", bundled, "-p", "2+2=", "-n", "40", "--temp", "0", "--json").stdout)
    assert plain[-1]["finish_reason"] == "eos", "the bundled model should end its answer to 2+2= by itself"
    r = bitnet("run", "-m", bundled, "-p", "2+2=", "-n", "40", "--temp", "0", "--json", "--ignore-eos")
    lines = json_lines(r.stdout)
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["stats"]["n_generated"] == 40
    llm = load_model(bundled, progress=False)
    eos = set(llm.tokenizer.eos_ids)
    assert not eos & {x["token"] for x in lines[:-1]}
    # the text before the point where it would have stopped is the same
    assert "".join(x["text"] for x in lines[:-1]).startswith("".join(x["text"] for x in plain[:-1]))


def test_json_lines_are_the_text_then_the_stats(store):
    plain = bitnet("run", "-m", store, "-p", "Once upon a time", "-n", "12", "--temp", "0")
    r = bitnet("run", "-m", store, "-p", "Once upon a time", "-n", "12", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    lines = json_lines(r.stdout)
    assert "".join(x["text"] for x in lines[:-1]) == plain.stdout
    done = lines[-1]
    assert done["done"] is True and done["finish_reason"] in ("eos", "length")
    assert done["stats"]["n_generated"] >= len(lines) - 1 and done["stats"]["decode_tps"] >= 0


@pytest.mark.parametrize("module,argv,usage,suggested", [
    ("bitnet_cpu", ["run", "--ctx-szie", "64", "-p", "x"], "usage: bitnet run", "--ctx-size"),
    ("bitnet_cpu", ["run", "--ignore-eso", "-p", "x"], "usage: bitnet run", "--ignore-eos"),
    ("bitnet_cpu", ["run", "--n-predcit", "4", "-p", "x"], "usage: bitnet run", "--n-predict"),
    ("bitnet_cpu", ["list", "--jsno"], "usage: bitnet list", "--json"),
    ("bitnet_cpu.cli.chat", ["--system-promt", "x"], "usage: bitchat", "--system-prompt"),
])
def test_unknown_flag_gets_the_subcommand_usage_and_a_suggestion(module, argv, usage, suggested):
    r = run(module, *argv)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(usage), r.stderr
    assert f"did you mean {suggested}?" in r.stderr and "Traceback" not in r.stderr


def test_conversation_mode_chats_on_stdin_like_bitchat(store, tmp_path):
    env = dict(os.environ, BITCHAT_HISTORY="", NO_COLOR="1")
    stdin = "Hello there.\n/set temp 0\nWhat next?\n"
    cnv = bitnet("run", "-m", store, "-cnv", "-n", "6", "--temp", "0", "-t", "1", stdin=stdin, env=env)
    chat = run("bitnet_cpu.cli.chat", "-m", store, "-n", "6", "--temp", "0", "-t", "1", stdin=stdin, env=env)
    assert cnv.returncode == 0 and chat.returncode == 0, cnv.stderr + chat.stderr
    assert cnv.stdout == chat.stdout and cnv.stdout.strip()
    assert cnv.stderr.count("prefill") == 2                       # two turns, with their stats lines
    # -p is the first message; --conversation is the long spelling
    first = bitnet("run", "-m", store, "--conversation", "-p", "Hello there.", "-n", "6", "--temp", "0",
                   stdin="What next?\n", env=env)
    assert first.returncode == 0 and first.stdout == chat.stdout, first.stderr


def test_conversation_mode_takes_a_schema_as_its_format_and_refuses_what_it_ignored(store, tmp_path):
    """-cnv -j / --json-schema-file is the chat's starting format (/set format's; it was refused as "plain text
    answers"), --no-jump-forward is honoured (no forced-token drafts), and -v, which the chat ignored, is refused in
    one line, as is a GBNF grammar (the chat's formats are JSON Schemas)."""
    env = dict(os.environ, BITCHAT_HISTORY="", BITCHAT_RECOVERY="", NO_COLOR="1")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    common = ("run", "-m", store, "-cnv", "-n", "40", "--temp", "0", "-t", "1")
    drafts = {}
    for extra in ((), ("--no-jump-forward",)):
        r = bitnet(*common, "--json-schema-file", str(path), *extra, stdin="Hello\n/stats\n/show parameters\n",
                   env=env)
        assert r.returncode == 0, r.stderr
        answer = r.stdout.split("\n")[0]
        assert isinstance(json.loads(answer)["a"], int), r.stdout   # the schema is in force
        assert "format=" + str(path) in r.stderr   # /show parameters (a command's output goes to stderr)
        drafts[extra] = "draft tokens accepted" in r.stderr
    assert drafts == {(): True, ("--no-jump-forward",): False}
    r = bitnet(*common, "-j", json.dumps(schema), stdin="Hello\n", env=env)
    assert r.returncode == 0 and isinstance(json.loads(r.stdout.split("\n")[0])["a"], int), r.stdout + r.stderr
    for extra, flag in ((("-v",), "-v/--verbose"), (("--grammar", 'root ::= "a"'), "--grammar")):
        r = bitnet(*common, *extra, stdin="Hello\n", env=env)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and flag in r.stderr, r.stderr
        assert "-cnv" in r.stderr and "Traceback" not in r.stderr
    r = bitnet(*common, "--grammar", 'root ::= "a"', stdin="Hello\n", env=env)
    assert "/set format" in r.stderr


def test_non_utf8_input_is_one_line_naming_the_byte(store, tmp_path):
    r = bitnet("run", "-m", store, "-p", "-", stdin=b"hello \xff\n")
    err = r.stderr.decode()
    assert r.returncode == 2 and len(err.strip().splitlines()) == 1 and "0xff" in err and "UTF-8" in err
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-m", store, "-p", b"caf\xe9"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)               # an argument that is not UTF-8 either
    assert r.returncode == 2 and "0xe9" in r.stderr and "-p/--prompt" in r.stderr and len(r.stderr.splitlines()) == 1
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    r = bitnet("run", "-m", store, "-f", str(bad))
    assert r.returncode == 2 and "0xe9" in r.stderr and str(bad) in r.stderr and len(r.stderr.splitlines()) == 1
    # bitchat: the bad line is named and skipped, the session goes on, the exit code says something failed
    r = run("bitnet_cpu.cli.chat", "-m", store, "-n", "4", "--temp", "0", stdin=b"hello \xff\nsecond line\n",
            env=dict(os.environ, BITCHAT_HISTORY=""))
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err and "internal error" not in err
    assert [x for x in err.splitlines() if "0xff" in x and "stdin line 1" in x]
    assert err.count("prefill") == 1 and r.stdout.strip()         # the second line was answered


def _default_buffering() -> dict:
    """os.environ without PYTHONUNBUFFERED: the pipe tests see the buffering a user's shell gives."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def test_cnv_refuses_a_stop_string_naming_the_flag_as_typed():
    """`bitnet run -cnv -r x` said "--stop does not apply", a flag the user never typed."""
    for flag in ("-r", "--reverse-prompt", "--stop"):
        r = bitnet("run", "-cnv", flag, "User:", stdin="Hello\n")
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert "error: -r/--reverse-prompt/--stop does not apply to -cnv" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", [["bitnet_cpu", "run", "-p", "Once", "-n", "5000", "-c", "6000", "--ignore-eos"],
                                 ["bitnet_cpu.cli.chat", "-n", "5000", "-c", "6000"]])
def test_closed_stdout_ends_quietly(store, cmd, tmp_path):
    """`| head -c 3`: exit 0, nothing on stderr about the pipe, and (bitchat, its turns from a script) no
    recovery copy left behind (one was left, unannounced, per run)."""
    args = [sys.executable, "-m", cmd[0], "-m", store, "--temp", "1", "--seed", "1", "-t", "1", *cmd[1:]]
    if cmd[0] == "bitnet_cpu":
        args = [sys.executable, "-m", "bitnet_cpu", cmd[1], "-m", store, "--temp", "1", "--seed", "1", "-t", "1", *cmd[2:]]
    p = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(_default_buffering(), BITCHAT_HISTORY="", XDG_STATE_HOME=str(tmp_path)))
    if cmd[0] == "bitnet_cpu.cli.chat":
        p.stdin.write(b"Tell me everything.\n")
    p.stdin.close()
    assert p.stdout.read(3)                                       # like `| head -c 3`
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert not list(tmp_path.rglob("recovery-*.json"))


@pytest.mark.parametrize("argv", [["bitnet_cpu", "run", "-p", "Once", "-n", "50", "-m"],
                                  ["bitnet_cpu.cli.chat", "-n", "20", "-m"],
                                  ["bitnet_cpu", "info"], ["bitnet_cpu", "info", "--json"], ["bitnet_cpu", "--version"],
                                  ["bitnet_cpu", "run", "--help"], ["bitnet_cpu.cli.chat", "--version"]])
def test_stdout_closed_before_anything_is_written(store, argv, tmp_path):
    """Every command, however little it prints: exit 0 and nothing on stderr about the pipe. Python's default
    buffering, not PYTHONUNBUFFERED's: a short output then meets the closed pipe only in the interpreter's last
    flush (a shell with PYTHONUNBUFFERED=1 hid that `bitnet info` exited 120 there)."""
    read_end, write_end = os.pipe()
    os.close(read_end)                                            # nobody will ever read
    extra = [store] if argv[-1] == "-m" else []
    env = _default_buffering()
    try:
        r = subprocess.run([sys.executable, "-m", *argv, *extra], stdout=write_end, stderr=subprocess.PIPE,
                           input=b"Hello\n", cwd=ROOT, timeout=120,
                           env=dict(env, BITCHAT_HISTORY="", XDG_STATE_HOME=str(tmp_path)))
    finally:
        os.close(write_end)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, err
    assert "internal error" not in err, err
    assert not list(tmp_path.rglob("recovery-*.json"))


BITCHAT_MAIN = "import sys; from bitnet_cpu.cli.bitchat import main; sys.exit(main())"   # the console script's


@pytest.mark.parametrize("argv", [["-m", "bitnet_cpu", "run", "-f", "-", "-n", "6"],
                                  ["-m", "bitnet_cpu", "run", "-p", "-", "-n", "6"],
                                  ["-m", "bitnet_cpu", "run", "-cnv", "-n", "6"],
                                  ["-c", BITCHAT_MAIN, "-n", "6"]])
def test_closed_stdin_is_empty_input(store, argv, tmp_path):
    """`<&-` (a daemon's, cron's): Python makes sys.stdin None; the same as `</dev/null` (it was "internal error:
    'NoneType' object has no attribute 'buffer'", exit 70, or bitchat's raw traceback)."""
    args = [sys.executable, *argv, "-m", store, "--temp", "0", "-t", "1"]
    env = dict(os.environ, BITCHAT_HISTORY="", XDG_STATE_HOME=str(tmp_path))
    want = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=env)
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env,
                       preexec_fn=lambda: os.close(0))
    assert want.returncode == 0, want.stderr
    assert (r.returncode, r.stdout) == (0, want.stdout), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


@pytest.mark.parametrize("argv", [["-m", "bitnet_cpu", "run", "-p", "Once", "-n", "6", "-m"],
                                  ["-m", "bitnet_cpu", "run", "-p", "Once", "-n", "6", "--json", "-m"],
                                  ["-m", "bitnet_cpu", "run", "-cnv", "-n", "6", "-m"],
                                  ["-c", BITCHAT_MAIN, "-n", "6", "-m"],
                                  ["-m", "bitnet_cpu", "info"]])
def test_closed_stdout_at_start_ends_quietly(store, argv, tmp_path):
    """`>&-`: Python makes sys.stdout None; the answer goes nowhere and the exit is 0, as when a reader closes the
    pipe (it was "internal error: AttributeError: 'NoneType' object has no attribute 'write'" and a traceback)."""
    extra = [store, "-t", "1"] if argv[-1] == "-m" else []
    r = subprocess.run([sys.executable, *argv, *extra], input="Hello\n", stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, BITCHAT_HISTORY="", XDG_STATE_HOME=str(tmp_path)),
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert not list(tmp_path.rglob("recovery-*.json"))


def test_versions_agree_and_info_is_a_table_or_json():
    a, b = bitnet("--version"), run("bitnet_cpu.cli.chat", "--version")
    assert a.returncode == 0 and b.returncode == 0
    from bitnet_cpu.engine import __version__

    assert a.stdout.split()[-1] == b.stdout.split()[-1] == __version__
    facts = json.loads(bitnet("info", "--json").stdout)
    assert facts["version"] == __version__ and facts["active"] in facts["supported"]
    table = bitnet("info").stdout
    assert "{" not in table and "'" not in table                  # not a Python dict
    row = next(x for x in table.splitlines() if x.startswith("kernel path"))
    assert row.split()[-1] == facts["active"] or facts["active"] in row


@pytest.mark.parametrize("module,line,want", [
    ("bitnet_cpu", "bitnet run --ctx", "--ctx-size"),
    ("bitnet_cpu", "bitnet pu", "pull"),
    ("bitnet_cpu", "bitnet run --ign", "--ignore-eos"),
    ("bitnet_cpu.cli.chat", "bitchat --system-p", "--system-prompt"),
])
def test_shell_completion(module, line, want, tmp_path):
    out = tmp_path / "completions"
    env = dict(os.environ, _ARGCOMPLETE="1", COMP_LINE=line, COMP_POINT=str(len(line)),
               _ARGCOMPLETE_STDOUT_FILENAME=str(out))
    r = run(module, env=env)
    assert r.returncode == 0, r.stderr
    assert want in out.read_text().replace("\v", " ").split()


def test_prefill_attention_bf16_only_where_its_vector_bodies_run(store):
    """--prefill-attention bf16 runs where the CPU has AVX512_BF16 on the avx512 path; elsewhere it is refused in
    one line (the scalar bf16 bodies exist for the tests and are slower than f32)."""
    from bitnet_cpu import simd

    args = ("run", "-m", store, "-p", "Once upon a time", "-n", "6", "-c", "64", "--temp", "0")
    assert bitnet(*args, "--prefill-attention", "f32").returncode == 0
    if simd.attention_bf16_vector():
        r = bitnet(*args, "--prefill-attention", "bf16")
        assert r.returncode == 0 and r.stdout, r.stderr
    x86 = "avx2" in simd.supported_isas()
    r = bitnet(*args, "--prefill-attention", "bf16", env={**os.environ, "BITNET_ISA": "avx2"} if x86 else None)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("bitnet: error: --prefill-attention bf16: ")


def test_help_states_each_default_once():
    """argparse's ArgumentDefaultsHelpFormatter appends "(default: X)" to every option's help unless the help names
    %(default) itself: an option whose help already says its default in words must (`%(default).0s`), or --help
    shows two defaults, the second a bare None / False ("(default: the model's name) (default: None)")."""
    import argparse

    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.chat import build_parser as chat_parser

    subparsers: dict = {}
    build_parser(subparsers)
    parsers = {**subparsers, "bitchat": chat_parser()}
    twice = []
    for name, p in parsers.items():
        for a in p._actions:
            if a.help and a.help is not argparse.SUPPRESS and "(default" in a.help and "%(default)" not in a.help \
                    and a.default is not argparse.SUPPRESS and (a.option_strings or a.nargs in ("?", "*")):
                twice.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert not twice, twice


def test_seed_help_names_no_flag_the_command_lacks():
    """bitchat --help said the random seed is "printed with -v", and bitchat has no -v: bitnet run's -v says it."""
    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.chat import build_parser as chat_parser

    subparsers: dict = {}
    build_parser(subparsers)
    for name, p in {**subparsers, "bitchat": chat_parser()}.items():
        seed = p._option_string_actions.get("--seed")
        if seed is not None:
            assert "-v" not in seed.help or "-v" in p._option_string_actions, (name, seed.help)
    assert "seed" in subparsers["run"]._option_string_actions["-v"].help


def _parse(prog, argv):
    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.chat import build_parser as bitchat_parser
    subs = {}
    build_parser(subs)
    return (bitchat_parser() if prog == "bitchat" else subs[prog]).parse_known_args(argv)


@pytest.mark.parametrize("prog,argv,dest,want", [
    ("serve", ["--metrics"], "metrics_public", False),   # llama-server's --metrics is not --metrics-public
    ("run", ["-s", "42"], "seed", 42),                    # llama.cpp's seed, not -sys 42 (a system prompt)
    ("run", ["-s", "42"], "system", None),
    ("bitchat", ["-s", "42"], "system", None),
    ("run", ["-r", "User:"], "stop", ["User:"]),          # llama.cpp's reverse prompt: a stop string
    ("serve", ["-cb", "--jinja"], "cont_batching", True),
])
def test_flags_mean_what_llama_cpp_users_mean(prog, argv, dest, want):
    args, extras = _parse(prog, argv)
    assert not extras and getattr(args, dest) == want


@pytest.mark.parametrize("prog", ["run", "serve", "bitchat"])
def test_no_jinja_is_taken_with_one_line_saying_it_changes_nothing(prog, capsys):
    """llama.cpp's --no-jinja (its other template renderer): templates are always Jinja2 here, so the flag is taken
    with one warning line saying so, where it was argparse's usage and "did you mean --jinja?"."""
    args, extras = _parse(prog, ["--no-jinja"])
    err = capsys.readouterr().err.strip().splitlines()
    assert not extras and len(err) == 1 and "warning: --no-jinja:" in err[0] and "always" in err[0], err


def test_llama_arg_jinja_off_is_named_as_no_jinja():
    """LLAMA_ARG_JINJA=0 (llama-server's --no-jinja by variable) was taken in silence: it gets the same warning,
    naming the variable; true is --jinja, and an empty one is unset."""
    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.flags import llama_env_argv
    subs = {}
    build_parser(subs)
    for value in ("0", "false", "off"):
        out, notes, _ = llama_env_argv(subs["serve"], [], {"LLAMA_ARG_JINJA": value})
        assert out == [] and len(notes) == 1 and notes[0].startswith(f"LLAMA_ARG_JINJA={value!r}: chat templates")
    assert llama_env_argv(subs["serve"], [], {"LLAMA_ARG_JINJA": "1"})[:2] == (["--jinja"], [])
    assert llama_env_argv(subs["serve"], [], {"LLAMA_ARG_JINJA": ""})[:2] == ([], [])


@pytest.mark.parametrize("prog,argv", [
    ("serve", ["--keep", "256"]),      # was --keep-alive-timeout 256
    ("serve", ["-n", "64"]),           # was -np 64
    ("run", ["-pps"]),                 # was -p "ps"
    ("run", ["-n5"]),                  # no value glued to a flag
    ("run", ["--temperat", "0"]),      # no abbreviations
])
def test_no_flag_is_a_guess_at_another(prog, argv):
    args, extras = _parse(prog, argv)
    assert extras, vars(args)


def test_a_flag_before_any_command_says_the_command_comes_first():
    """`bitnet -p hi` (llama-cli's habit) said "invalid choice: 'hi'" for COMMAND; --version and --help still
    work at the top."""
    r = bitnet("-p", "hi there")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "bitnet: error: -p: a command comes first, as in `bitnet run -p 'hi there'` (`bitnet --help` lists the "
        "commands)"], r.stderr
    assert bitnet("--version").returncode == 0 and bitnet("--help").returncode == 0


def test_no_cnv_is_llama_cli_s_one_prompt_one_answer():
    """-no-cnv (in very many llama-cli command lines) was "unrecognized arguments": it is bitnet run's default, and
    the later of -cnv / -no-cnv wins, as with llama-cli."""
    for argv, conversation in ((["-no-cnv"], False), (["--no-conversation"], False), (["-cnv", "-no-cnv"], False),
                               (["-no-cnv", "-cnv"], True), ([], None)):   # None: neither given
        args, extras = _parse("run", argv + ["-p", "x"])
        assert not extras and args.conversation is conversation, argv


@pytest.mark.parametrize("argv,said", [
    (["run", "-ngl", "99", "-p", "x"], "bitnet run: error: -ngl: GPU offload does not apply"),
    (["run", "-tb", "2", "-p", "x"], "bitnet run: error: -tb: one thread count"),
    (["serve", "-n", "64"], "bitnet serve: error: -n: bitnet serve has no server-wide answer length"),
    (["run", "-ctk", "q8_0", "-p", "x"], "bitnet run: error: -ctk: the KV cache's type is --kv"),
    (["embed", "-n", "5"], "bitnet embed: error: unrecognized arguments: -n 5"),   # serve's reason is serve's
    # llama-cli's, and serve's own flag here: not "did you mean --reasoning-effort?"
    (["run", "--reasoning-format", "none", "-p", "x"], "bitnet run: error: --reasoning-format: bitchat shows"),
    (["bitnet_cpu.cli.chat", "--reasoning-format=deepseek"], "bitchat: error: --reasoning-format: bitchat shows"),
    (["run", "-b", "512", "-p", "x"], "bitnet run: error: -b: the prompt is processed in the engine's own batches"),
    (["run", "--ubatch-size", "512", "-p", "x"], "bitnet run: error: --ubatch-size: the prompt is processed"),
    (["serve", "-ub", "512"], "bitnet serve: error: -ub: one step's size is -b/--batch-size here"),
    (["run", "--special", "-p", "x"], "bitnet run: error: --special: special tokens are never printed here"),
    (["run", "--verbose-prompt", "-p", "x"], "bitnet run: error: --verbose-prompt: the prompt's tokens are not"),
    # llama-server's: one line, not the whole usage and "did you mean -t?" / "--api-key-file?"
    (["serve", "--ssl-key-file", "k.pem"], "bitnet serve: error: --ssl-key-file: TLS is not supported here"),
    (["serve", "--ssl-cert-file", "c.pem"], "bitnet serve: error: --ssl-cert-file: TLS is not supported here"),
    (["serve", "-to", "600"], "bitnet serve: error: -to: a request's time limit is --request-timeout here"),
    (["serve", "--timeout", "600"], "bitnet serve: error: --timeout: a request's time limit is --request-timeout"),
    (["serve", "-nocb"], "bitnet serve: error: -nocb: batching is always continuous here"),
    (["serve", "--no-cont-batching"], "bitnet serve: error: --no-cont-batching: batching is always continuous"),
    (["serve", "--threads-http", "4"], "bitnet serve: error: --threads-http: HTTP is served by one event loop"),
    (["serve", "--no-slots"], "bitnet serve: error: --no-slots: /slots is always served here"),
    (["serve", "--props"], "bitnet serve: error: --props: /props is read-only here"),
    (["serve", "--path", "ui"], "bitnet serve: error: --path: the chat page is built in; there are no static"),
    (["serve", "--slot-save-path", "slots"], "bitnet serve: error: --slot-save-path: slot save / restore is not"),
    (["serve", "--log-disable"], "bitnet serve: error: --log-disable: the server's log is uvicorn's"),
    (["serve", "--log-format", "json"], "bitnet serve: error: --log-format: the server's log is uvicorn's"),
    (["serve", "--reranking"], "bitnet serve: error: --reranking: reranking (/rerank) is not supported"),
    (["serve", "--cache-reuse", "256"], "bitnet serve: error: --cache-reuse: the prefix cache reuses"),
    (["serve", "--grammar-file", "g.gbnf"], "bitnet serve: error: --grammar-file: a server-wide grammar or schema"),
    (["serve", "-j", "{}"], "bitnet serve: error: -j: a server-wide grammar or schema is not supported"),
])
def test_llama_cpp_only_flags_get_their_reason(argv, said):
    r = run(argv[0], *argv[1:]) if argv[0].startswith("bitnet_cpu") else bitnet(*argv)
    assert r.returncode == 2 and said in r.stderr.splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_llama_cli_flags_that_ask_for_what_run_does_are_accepted():
    """llama-cli's script flags whose request is bitnet run's own behaviour were "unrecognized arguments" and the
    whole usage: no prompt echo, no context shift, no warm-up, no logs on stdout, plain text."""
    argv = ["--no-display-prompt", "--no-context-shift", "--no-warmup", "--log-disable", "--simple-io", "-p", "x"]
    args, extras = _parse("run", argv)
    assert not extras and args.prompt == "x"
    help_text = " ".join(bitnet("run", "--help").stdout.split())
    assert help_text.count("accepted for llama-cli's command lines") == 4


@pytest.mark.parametrize("prog", ["run", "serve", "bitchat"])
def test_context_shift_and_prompt_cache_switches_get_one_answer_everywhere(prog):
    """llama.cpp's --no-context-shift (common in llama-server launch scripts) asks for what every command here does:
    `bitnet serve` and bitchat answered it with the whole usage and "unrecognized arguments" (bitnet run took it);
    so did --cache-prompt. Both are taken by all three, and --help says they change nothing; their other sides
    (--context-shift, --no-cache-prompt) are one line naming the flag, exit 2, the same on all three."""
    args, extras = _parse(prog, ["--no-context-shift", "--cache-prompt"])
    assert not extras
    cmd = ("bitnet_cpu.cli.chat",) if prog == "bitchat" else ("bitnet_cpu", prog)
    help_text = " ".join(run(*cmd, "--help").stdout.split())
    for flag in ("--no-context-shift", "--cache-prompt"):
        assert f"{flag} accepted for llama.cpp's command lines" in help_text, (prog, flag)
    name = "bitchat" if prog == "bitchat" else f"bitnet {prog}"
    for flag, said in (("--context-shift", "the context does not shift here"),
                       ("--no-cache-prompt", "the prompt cache cannot be turned off here")):
        r = run(*cmd, flag, *(["-p", "x"] if prog == "run" else []), stdin="")
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"{name}: error: {flag}: " +
                                                                       r.stderr.split(f"{flag}: ", 1)[1].strip()]
        assert said in r.stderr and "usage:" not in r.stderr, r.stderr


def test_llama_server_variables_for_those_switches_agree_with_the_flags(capsys):
    """LLAMA_ARG_CONTEXT_SHIFT=1 started a server without a context shift and a warning that the variable "has no
    meaning here", while --context-shift was refused; LLAMA_ARG_NO_CONTEXT_SHIFT (what the server does) got the same
    warning. A variable now gets its flag's answer: what is always done is taken in silence, the other side is the
    flag's line naming the variable, exit 2. As in llama.cpp, LLAMA_ARG_NO_<NAME> set is off, and a typed flag wins."""
    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.flags import llama_env_argv
    subs = {}
    build_parser(subs)
    for env in ({"LLAMA_ARG_CONTEXT_SHIFT": "0"}, {"LLAMA_ARG_CONTEXT_SHIFT": "false"},
                {"LLAMA_ARG_NO_CONTEXT_SHIFT": "1"},
                {"LLAMA_ARG_NO_CONTEXT_SHIFT": "1", "LLAMA_ARG_CONTEXT_SHIFT": "1"},
                {"LLAMA_ARG_CACHE_PROMPT": "1"}, {"LLAMA_ARG_CACHE_PROMPT": "true"}, {"LLAMA_ARG_CACHE_PROMPT": ""},
                {"LLAMA_ARG_CONTEXT_SHIFT": "1", "LLAMA_ARG_CACHE_PROMPT": "0", "ARGV": "--no-context-shift "
                 "--cache-prompt"}):
        argv = env.pop("ARGV", "").split()
        assert llama_env_argv(subs["serve"], argv, env)[:2] == ([], []), env
    for env, flag, said in (({"LLAMA_ARG_CONTEXT_SHIFT": "1"}, "--context-shift", "the context does not shift"),
                            ({"LLAMA_ARG_CACHE_PROMPT": "0"}, "--no-cache-prompt", "cannot be turned off"),
                            ({"LLAMA_ARG_NO_CACHE_PROMPT": "1"}, "--no-cache-prompt", "cannot be turned off")):
        with pytest.raises(SystemExit) as e:
            llama_env_argv(subs["serve"], [], env)
        err = capsys.readouterr().err.strip().splitlines()
        (name, value), = env.items()
        assert e.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"bitnet serve: error: {name}={value!r} ({flag}): ") and said in err[0], err
    out, notes, _ = llama_env_argv(subs["serve"], [], {"LLAMA_ARG_CONTEXT_SHIFT": "maybe"})
    assert out == [] and notes == ["LLAMA_ARG_CONTEXT_SHIFT='maybe': not a switch value (true / false); left out"]


def test_llama_server_flags_that_ask_for_what_serve_does_are_accepted():
    """llama-server's flags whose request is bitnet serve's own behaviour were "unrecognized arguments" and the
    whole usage: -a (its short --alias), --embedding(s) (always served), --slots (always on); --no-webui is
    honoured (tests/test_serve.py)."""
    args, extras = _parse("serve", ["-a", "mine", "--embeddings", "--embedding", "--slots", "--no-webui"])
    assert not extras and args.alias == "mine"
    help_text = " ".join(bitnet("serve", "--help").stdout.split())
    for flag in ("--embedding, --embeddings", "--slots"):
        assert f"{flag} accepted for llama-server's command lines" in help_text, flag


def test_single_turn_is_one_chat_answer(bundled):
    """-st/--single-turn (llama-cli: its conversation mode, one turn) is one answer to the prompt in the chat
    template, as --chat; with -cnv too."""
    def n_prompt(*argv):
        r = bitnet("run", "-m", bundled, "-p", "hi", "-n", "1", "--temp", "0", "--json", *argv)
        assert r.returncode == 0, r.stderr
        return json_lines(r.stdout)[-1]["stats"]["n_prompt"]
    chat = n_prompt("--chat")
    assert n_prompt("-st") == n_prompt("--single-turn") == n_prompt("-cnv", "-st") == chat != n_prompt()


def test_thinking_flags_on_a_template_that_does_not_think_are_said(bundled):
    """-rea on / --reasoning-budget N on a template without a <think> block changed nothing in silence (bitchat's
    /set think refuses it): a warning each, on bitnet run and bitchat; -rea off asks for nothing."""
    if load_model(bundled, ctx=64, progress=False).thinks:
        pytest.skip("the bundled model's template thinks")
    base = ["-m", bundled, "-p", "hi", "-n", "2", "--temp", "0"]
    r = bitnet("run", *base, "-rea", "on", "--reasoning-budget", "5")
    assert r.returncode == 0, r.stderr
    assert "warning: -rea/--reasoning on: " in r.stderr and "does not think" in r.stderr, r.stderr
    assert "warning: --reasoning-budget 5: " in r.stderr, r.stderr
    assert "does not think" not in bitnet("run", *base, "-rea", "off").stderr
    c = run("bitnet_cpu.cli.chat", "-m", bundled, "-n", "2", "-rea", "on", stdin="hi\n",
            env=dict(os.environ, BITCHAT_HISTORY="", BITCHAT_RECOVERY=""))
    assert c.returncode == 0 and "bitchat: warning: -rea/--reasoning on: " in c.stderr, c.stderr


def test_escapes_as_llama_cpp_processes_them(store):
    from bitnet_cpu.cli.flags import process_escapes
    for typed, want in [("a\\nb", "a\nb"), ("\\t\\\\x", "\t\\x"), ("\\x41\\x4", "A\\x4"), ("end\\", "end\\"),
                        ("q\\'\\\"", "q'\""), ("\\q", "\\q"), ("\\x4g", "\\x4g")]:
        assert process_escapes(typed) == want, typed
    args, _ = _parse("run", ["--dry-sequence-breaker", "\\n", "--dry-sequence-breaker", ":"])
    from bitnet_cpu.cli.flags import sampling_params_from_args
    assert sampling_params_from_args(args).dry_sequence_breakers == ("\n", ":")
    args, _ = _parse("run", ["--no-escape", "--dry-sequence-breaker", "\\n"])
    assert sampling_params_from_args(args).dry_sequence_breakers == ("\\n",)

    def n_prompt(*argv):
        r = bitnet("run", "-m", store, "-n", "1", "--temp", "0", "--json", *argv)
        assert r.returncode == 0, r.stderr
        return json_lines(r.stdout)[-1]["stats"]["n_prompt"]
    escaped = n_prompt("-p", "a\\nb")
    assert escaped == n_prompt("-p", "a\nb") != n_prompt("--no-escape", "-p", "a\\nb")


def test_hex_escapes_are_bytes_of_utf8_as_in_llama_cpp(store):
    """\\xHH is a byte there: a run of them is UTF-8 (\\xc3\\xa9 was the two characters 'Ã©'); bytes that are not
    UTF-8 are one line naming the flag, exit 2."""
    from bitnet_cpu.cli.flags import process_escapes
    for typed, want in [("caf\\xc3\\xa9", "caf\u00e9"), ("\\xe2\\x82\\xac\\n", "\u20ac\n"),
                        ("\\x41\\xc3\\xa9!", "A\u00e9!"), ("\\xF0\\x9F\\x99\\x82", "\U0001f642")]:
        assert process_escapes(typed) == want, typed
    for bad in ("caf\\xe9", "\\xc3", "\\xc3\\n\\xa9", "\\xff"):
        with pytest.raises(ValueError):
            process_escapes(bad)

    def n_prompt(*argv):
        r = bitnet("run", "-m", store, "-n", "1", "--temp", "0", "--json", *argv)
        assert r.returncode == 0, r.stderr
        return json_lines(r.stdout)[-1]["stats"]["n_prompt"]
    assert n_prompt("-p", "caf\\xc3\\xa9") == n_prompt("-p", "caf\u00e9")
    for flag in ("-p", "-r", "--dry-sequence-breaker"):
        argv = ["-p", "x", flag, "caf\\xe9"] if flag != "-p" else ["-p", "caf\\xe9"]
        r = bitnet("run", "-m", store, "-n", "1", *argv)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert "\\xe9 is not UTF-8" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_chat_template_flag_makes_run_a_chat(bundled):
    def n_prompt(*argv):
        r = bitnet("run", "-m", bundled, "-p", "hi", "-n", "1", "--temp", "0", "--json", *argv)
        assert r.returncode == 0, r.stderr
        return json_lines(r.stdout)[-1]["stats"]["n_prompt"]
    plain, chat = n_prompt(), n_prompt("--chat", "--chat-template", "chatml")
    assert n_prompt("--chat-template", "chatml") == chat != plain


def test_lm_head_of_a_converted_store_is_not_silently_another(bundled):
    """--lm-head picks the head at conversion; on a store with another head it was ignored without a word."""
    r = bitnet("run", "-m", bundled, "--lm-head", "q4", "-p", "hi", "-n", "1")
    assert r.returncode == 2 and "--lm-head q4" in r.stderr and "f16 head" in r.stderr, r.stderr
    assert bitnet("run", "-m", bundled, "--lm-head", "f16", "-p", "hi", "-n", "1").returncode == 0


def test_c_0_is_the_models_context_and_n_minus_2_runs_to_the_end(store):
    """llama.cpp's -c 0 (the model's trained context) and -n -2 (until the context is full; here as -1: until the
    end of text or a full context)."""
    from bitnet_cpu.engine.api import load_model
    trained = load_model(store, progress=False).config.context_length
    r = bitnet("run", "-m", store, "-c", "0", "-p", "Once", "-n", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert json_lines(r.stdout)[-1]["stats"]["n_ctx"] == trained
    a = bitnet("run", "-m", store, "-c", "64", "-p", "Once", "-n", "-2", "--temp", "0", "--ignore-eos", "--json")
    b = bitnet("run", "-m", store, "-c", "64", "-p", "Once", "-n", "-1", "--temp", "0", "--ignore-eos", "--json")
    assert a.returncode == b.returncode == 0
    (*text_a, done_a), (*text_b, done_b) = json_lines(a.stdout), json_lines(b.stdout)
    assert text_a == text_b and done_a["finish_reason"] == done_b["finish_reason"] == "context"


def test_bitnet_debug_shows_the_errors_own_traceback(monkeypatch, capsys):
    """BITNET_DEBUG=1, as the internal-error line promises, shows the error's traceback also where the error is
    reported after its except block (bitnet serve's start-up failures printed "NoneType: None")."""
    from bitnet_cpu.cli import report_bug
    monkeypatch.setenv("BITNET_DEBUG", "1")
    try:
        raise OverflowError("value too large to convert to int")
    except OverflowError as e:
        err = e
    assert report_bug("bitnet serve", err) == 70
    out = capsys.readouterr().err
    assert "Traceback" in out and "OverflowError: value too large" in out and "NoneType: None" not in out, out


def test_bitnet_chat_points_to_bitchat_and_help_names_it():
    """`bitnet chat` (ollama's and llama.cpp users' guess) said "invalid choice: 'chat'", and `bitnet --help`
    never named bitchat: one line pointing to bitchat and `bitnet run -cnv`, exit 2; the help names bitchat."""
    for argv in (["chat"], ["chat", "-m", "x", "--temp", "0"]):
        r = bitnet(*argv)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "bitchat" in lines[0] and "bitnet run -cnv" in lines[0], lines
    r = bitnet("--help")
    assert r.returncode == 0 and "bitchat" in r.stdout, r.stdout


def test_bitchat_takes_run_s_lm_head(bundled):
    """README: `bitnet run` and `bitchat` share the model flags; `bitchat --lm-head f16` was "unrecognized
    arguments". It is the same flag, checked the same way against a converted store's head."""
    r = run("bitnet_cpu.cli.chat", "-m", bundled, "--lm-head", "q4", "-n", "2", stdin="hi\n")
    assert r.returncode == 2 and "--lm-head q4" in r.stderr and "f16 head" in r.stderr, r.stderr
    r = run("bitnet_cpu.cli.chat", "-m", bundled, "--lm-head", "f16", "-n", "2", "--temp", "0", stdin="hi\n")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_bitchat_n_over_the_context_is_taken_as_set_max_tokens_is(bundled):
    """bitchat -c 256 -n 1000 showed max_tokens=256 in silence while /set num_predict 1000 was refused ("must be
    <= 256"): both are now taken as the context's size, with the same line saying so."""
    r = run("bitnet_cpu.cli.chat", "-m", bundled, "-c", "256", "-n", "1000", "-t", "1",
            stdin="/set\n/set num_predict 1000\n", env={**os.environ, "BITCHAT_RECOVERY": ""})
    assert r.returncode == 0, r.stderr
    line = "max_tokens 1000 is more than the 256-token context window, where an answer ends anyway: max_tokens = 256"
    assert f"bitchat: warning: -n 1000: {line}" in r.stderr.splitlines(), r.stderr
    said = (r.stdout + r.stderr).splitlines()
    assert f"[{line}]" in said and any("max_tokens=256" in x for x in said), said


def test_run_json_errors_are_a_json_object_too(store, tmp_path):
    """`bitnet run --json` with a prompt over the context gave its JSON consumer nothing on stdout (a stop at the
    context mid-answer is a JSON line): an error is now one JSON object there, the server's shape with its counts;
    stderr's one line and exit 2 stay, for that error and any other (a model that is not there)."""
    r = bitnet("run", "-m", store, "-c", "32", "-p", "once upon a time " * 40, "-n", "2", "--json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    (obj,) = json_lines(r.stdout)
    e = obj["error"]
    assert e["n_ctx"] == 32 and e["n_prompt_tokens"] > 32 and e["exit_code"] == 2, e
    assert e["message"] in r.stderr and "context" in e["message"], (e, r.stderr)
    r = bitnet("run", "-m", str(tmp_path / "none.bnstore"), "-p", "x", "--json")
    assert r.returncode == 2 and json_lines(r.stdout)[0]["error"]["message"] in r.stderr, (r.stdout, r.stderr)
    r = bitnet("run", "-m", store, "-c", "32", "-p", "once upon a time " * 40, "-n", "2")   # no --json: stderr only
    assert r.returncode == 2 and r.stdout == "", r.stdout
