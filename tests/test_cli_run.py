"""`bitnet run` end to end in a subprocess: stdout is exactly the generated text, prompts from -p/-f/stdin,
--chat, --verbose on stderr, one-line errors (exit 2), Ctrl-C keeps the printed text (exit 130)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from bitnet_cpu import simd
from bitnet_cpu.engine.api import SamplingParams, load_model
from test_model_fixtures import make_synth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synth(tmp_path_factory.mktemp("cli"), seed=21, lm_heads=("f16",))


@pytest.fixture(scope="module")
def store(synth):
    return synth[2]["f16"]


def bitnet(*args, stdin=None, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def api_text(store, ids, n):
    llm = load_model(store, ctx=256, progress=False)
    return "".join(c.text for c in llm.generate(ids, SamplingParams(temperature=0), max_tokens=n))


def test_stdout_is_the_generated_text(store, tmp_path):
    llm = load_model(store, ctx=256, progress=False)
    prompt = "Once upon a time"
    want = api_text(store, llm.tokenize(prompt, add_bos=True), 24)
    r = bitnet("-m", store, "-p", prompt, "-n", "24", "--temp", "0", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want and r.stderr == ""
    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    assert bitnet("-m", store, "-f", str(f), "-n", "24", "--temp", "0").stdout == want
    assert bitnet("-m", store, "-f", "-", "-n", "24", "--temp", "0", stdin=prompt).stdout == want
    assert bitnet("-m", store, "-p", "-", "-n", "24", "--temp", "0", stdin=prompt).stdout == want
    # a file's (or stdin's) one final newline is no part of the prompt, as llama.cpp's -f reads it
    for ending in ("\n", "\r\n"):
        f.write_bytes((prompt + ending).encode())
        assert bitnet("-m", store, "-f", str(f), "-n", "24", "--temp", "0").stdout == want, repr(ending)
    assert bitnet("-m", store, "-p", "-", "-n", "24", "--temp", "0", stdin=prompt + "\n").stdout == want
    two = api_text(store, llm.tokenize(prompt + "\n", add_bos=True), 24)   # a second newline stays
    f.write_text(prompt + "\n\n", encoding="utf-8")
    assert bitnet("-m", store, "-f", str(f), "-n", "24", "--temp", "0").stdout == two
    v = bitnet("-m", store, "-p", prompt, "-n", "24", "--temp", "0", "--verbose")
    assert v.stdout == want and "tok/s" in v.stderr
    for isa in simd.supported_isas():   # the kernel path that ran, as llama.cpp's feature line says it
        forced = bitnet("-m", store, "-p", prompt, "-n", "2", "--temp", "0", "--verbose",
                        env={**os.environ, "BITNET_ISA": isa})
        assert f"kernels {isa})" in forced.stderr, (isa, forced.stderr)
    # seeded sampling is reproducible from the command line too
    a = bitnet("-m", store, "-p", prompt, "-n", "16", "--seed", "7", "--top-k", "5", "--top-p", "0.9",
               "--min-p", "0.01", "--repeat-penalty", "1.1")
    assert a.returncode == 0 and a.stdout == bitnet("-m", store, "-p", prompt, "-n", "16", "--seed", "7", "--top-k", "5",
                                                    "--top-p", "0.9", "--min-p", "0.01", "--repeat-penalty", "1.1").stdout


@pytest.mark.parametrize("stderr", ["closed", "/dev/full"])
def test_an_unwritable_stderr_loses_only_the_timings(store, stderr):
    """`bitnet run -v 2>&-` (or 2>/dev/full): the text still comes on stdout, exit 0 (writing the timings raised
    EBADF / ENOSPC: exit 1 or 70, after the answer)."""
    if stderr == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    args = ["-m", store, "-p", "Once upon a time", "-n", "8", "--temp", "0", "-t", "1"]
    want = bitnet(*args)
    assert want.returncode == 0 and want.stdout
    with open(os.devnull if stderr == "closed" else stderr, "w") as err:
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", *args, "--verbose"], stdout=subprocess.PIPE,
                           stderr=err, text=True, timeout=60, cwd=ROOT,
                           preexec_fn=(lambda: os.close(2)) if stderr == "closed" else None)
    assert r.returncode == 0 and r.stdout == want.stdout


HOST = """
import os, signal, sys
from bitnet_cpu.cli import main
got = []
def host(signum, frame):
    got.append(signum)
sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
for s in sigs:
    signal.signal(s, host)
rc = main(["run", "-m", sys.argv[1], "-p", "Once upon a time", "-n", "2", "--temp", "0"])
print("\\n" + str(rc), all(signal.getsignal(s) is host for s in sigs))   # (after the text, no newline)
os.kill(os.getpid(), signal.SIGTERM)   # the host's handler runs, not the command's
print(got)
"""


def test_main_called_by_a_program_gives_its_signal_handlers_back(store):
    """bitnet_cpu.cli.main() from a host program (a notebook): when it returns, the host's SIGINT / SIGTERM /
    SIGHUP handlers are in place again (the command's raise_terminated stayed, and a later SIGTERM raised
    Terminated in whatever the host ran next)."""
    r = subprocess.run([sys.executable, "-c", HOST, store], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-2:] == ["0 True", f"[{int(signal.SIGTERM)}]"], r.stdout + r.stderr


NO_ISATTY = """
import sys
class Writes:   # a logger adapter's stand-in: write and flush only
    def write(self, s):
        return len(s)
    def flush(self):
        pass
sys.stderr = Writes()
from bitnet_cpu.cli import main
rc = main(["run", "-m", sys.argv[1], "-p", "Once upon a time", "-n", "2", "--temp", "0"])
print("\\n" + str(rc))
"""


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_main_called_with_a_stream_without_isatty_runs(store, stream):
    """cli.main() from a host whose stderr or stdout has no isatty (redirect_stderr to a logger adapter, a
    notebook's stdout): the command runs (the progress check, then the answer's last newline, raised
    AttributeError: exit 70, an internal error)."""
    code = NO_ISATTY.replace("sys.stderr = Writes()", f"sys.{stream} = Writes()").replace(
        'print("\\n" + str(rc))', 'sys.__stdout__.write("\\n" + str(rc) + "\\n")')
    r = subprocess.run([sys.executable, "-c", code, store], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stdout.splitlines()[-1:] == ["0"], r.stdout + r.stderr


def test_llama_cpps_other_sampler_flags_reach_the_sampler(store):
    """--typical, --top-nsigma, --xtc-*, --dynatemp-*, --mirostat* and --dry-* change a seeded answer (each one
    reaching the engine), and the same flags give the same answer twice; --dry-sequence-breaker none is accepted."""
    base = ["-m", store, "-p", "Once upon a time", "-n", "24", "--seed", "3", "--temp", "1.5", "--top-k", "0",
            "--top-p", "1", "--min-p", "0"]
    plain = bitnet(*base).stdout
    for extra in (["--typical", "0.2"], ["--top-nsigma", "0.5"], ["--xtc-probability", "1", "--xtc-threshold", "0.02"],
                  ["--dynatemp-range", "1.4"], ["--mirostat", "2", "--mirostat-ent", "1"],
                  ["--mirostat", "1", "--mirostat-ent", "1", "--mirostat-lr", "0.5"],
                  ["--dry-multiplier", "4", "--dry-allowed-length", "1", "--dry-penalty-last-n", "-1",
                   "--dry-sequence-breaker", "none"]):
        r = bitnet(*base, *extra)
        assert r.returncode == 0 and r.stdout != plain, (extra, r.stderr)
        assert bitnet(*base, *extra).stdout == r.stdout, extra


def test_source_model_converted_once_with_lm_head(synth, tmp_path):
    """-m on an HF dir converts it into the cache (with --lm-head f16 passed through) and runs it."""
    _, hf_dir, stores = synth
    env = dict(os.environ, BITNET_CACHE=str(tmp_path / "cache"))
    llm = load_model(stores["f16"], ctx=256, progress=False)
    want = api_text(stores["f16"], llm.tokenize("Once", add_bos=True), 10)
    r = bitnet("-m", hf_dir, "--lm-head", "f16", "-p", "Once", "-n", "10", "--temp", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want
    assert len(os.listdir(tmp_path / "cache")) == 1


def test_chat(store):
    llm = load_model(store, ctx=256, progress=False)
    ids = llm.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    r = bitnet("-m", store, "--chat", "--system", "Be brief.", "-p", "Hello", "-n", "12", "--temp", "0", "-c", "64")
    assert r.returncode == 0, r.stderr
    assert r.stdout == api_text(store, ids, 12)


@pytest.mark.parametrize("args,needle", [
    (["-m", "/nonexistent/model.gguf", "-p", "x"], "/nonexistent/model.gguf"),
    (["-p", "x", "--top-p", "3"], "--top-p"),
    (["-p", "x", "--mirostat", "3"], "--mirostat 3"),
    (["-p", "x", "--typical", "1.5"], "--typical 1.5"),
    (["-p", "x", "--dry-base", "0.5", "--dry-multiplier", "1"], "--dry-base 0.5"),
    (["-p", "x", "--xtc-probability", "2"], "--xtc-probability 2"),
    (["-p", "x", "-n", "-3"], "-n"),
    (["-p", "x", "-r", "y", "-r", ""], '-r/--stop "": an empty stop string'),   # it never matched, in silence
    (["-p", "Once upon a time, in a small village", "-c", "4"], "-c/--ctx"),
    ([], "prompt"),
    (["-f", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt"),
])
def test_errors_are_one_line(store, args, needle):
    if "-m" not in args:
        args = ["-m", store] + args
    r = bitnet(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitnet: error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_context_full_is_reported(store):
    r = bitnet("-m", store, "-p", "x", "-c", "6", "-n", "50", "--temp", "0")
    assert r.returncode == 0 and "context window full" in r.stderr and "n_ctx 6" in r.stderr


def test_default_model(store):
    r = bitnet("-p", "Once", "-n", "4", "--temp", "0")
    from bitnet_cpu.engine.formats.convert import bundled_model

    if bundled_model() is None:
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "-m" in r.stderr
    else:
        assert r.returncode == 0, r.stderr


INTERRUPT_AT_IMPORT = """
import importlib.abc, os, signal, sys
class Interrupt(importlib.abc.MetaPathFinder):   # Ctrl-C (a real SIGINT) the moment Python imports `at`
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
import importlib
sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))
"""


@pytest.mark.parametrize("at, entry, args", [
    ("bitnet_cpu.cli.serve", "bitnet_cpu.cli", ["run", "-p", "Once", "-n", "2"]),   # the parser's subcommands
    ("bitnet_cpu.engine.api", "bitnet_cpu.cli", ["run", "-p", "Once", "-n", "2"]),  # loading the engine
    ("bitnet_cpu.chat.commands", "bitnet_cpu.cli.bitchat", ["-n", "2"]),            # bitchat importing its REPL
    ("argparse", "bitnet_cpu.cli.bitchat", ["-n", "2"]),   # bitchat's first import of a module Python has not loaded
])
def test_ctrl_c_while_starting_is_one_exit_130(at, entry, args):
    """Ctrl-C at any moment: while the command is still importing its parts, too (a SIGINT at a chosen import,
    so the moment is exact), the exit is 130 with no traceback, as at any later moment."""
    r = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, at, entry, *args], cwd=ROOT, input="",
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130 and "Traceback" not in r.stderr and not r.stdout, (r.returncode, r.stderr)


BEFORE_THE_GUARD = """
import importlib.util, sys
root = sys.argv[1]
before = set(sys.modules)
spec = importlib.util.spec_from_file_location("bitnet_cpu", root + "/__init__.py", submodule_search_locations=[root])
package = importlib.util.module_from_spec(spec)
sys.modules["bitnet_cpu"] = package
spec.loader.exec_module(package)
import bitnet_cpu.cli
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_bitchat_loads_nothing_heavy_before_its_ctrl_c_guard():
    """bitchat imports cli/__init__.py before its Ctrl-C guard, so a Ctrl-C there is a raw traceback: it must not
    load `typing` (not loaded at startup: -S, as where no editable install's .pth loads it first), nor argparse."""
    r = subprocess.run([sys.executable, "-S", "-c", BEFORE_THE_GUARD, ROOT], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = r.stdout.split()
    assert "bitnet_cpu.cli" in loaded and "typing" not in loaded and "argparse" not in loaded, loaded


INTERRUPT_TURNED_INTO_IMPORT_ERROR = """
import importlib.abc, os, signal, sys
class Interrupt(importlib.abc.MetaPathFinder):   # a Ctrl-C inside an extension's import, which turns it into an
    def find_spec(self, name, path=None, target=None):   # ImportError (numpy's C code, at its datetime capsule)
        if name == sys.argv[1]:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):   # (the handler runs at the next bytecode)
                    pass
            except KeyboardInterrupt:
                raise ImportError('PyCapsule_Import could not import module "datetime"') from None
        return None
sys.meta_path.insert(0, Interrupt())
import importlib
sys.exit(importlib.import_module("bitnet_cpu.cli.bitchat").main(sys.argv[2:]))
"""


def test_ctrl_c_that_an_import_turned_into_another_error_is_still_exit_130():
    """A Ctrl-C inside numpy's import came out as an ImportError ("PyCapsule_Import could not import module
    "datetime""): a traceback and exit 1. bitchat hears the signal itself while it imports, so it is exit 130 with
    one line, as a Ctrl-C at any other moment of the start."""
    r = subprocess.run([sys.executable, "-c", INTERRUPT_TURNED_INTO_IMPORT_ERROR, "numpy", "-n", "2"], cwd=ROOT,
                       input="", capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130 and "Traceback" not in r.stderr and not r.stdout, (r.returncode, r.stderr)
    assert r.stderr.strip() == "bitchat: interrupted", r.stderr


FAIL_AT_IMPORT = """
import importlib.abc, sys
class Fail(importlib.abc.MetaPathFinder):   # the import of `at` fails as under a tight `ulimit -v`
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            if sys.argv[2] == "map":
                raise ImportError(name + ".so: failed to map segment from shared object")
            raise MemoryError()
        return None
sys.meta_path.insert(0, Fail())
import importlib
sys.exit(importlib.import_module("bitnet_cpu.cli").main(sys.argv[3:]))
"""


@pytest.mark.parametrize("at, how", [
    ("tokenizers", "map"),              # a library loaded lazily, with the model
    ("bitnet_cpu.cli.serve", "memory"),  # the parser's subcommands: before the error handler was in place
    ("bitnet_cpu.cli.serve", "map"),
])
def test_out_of_memory_while_importing_is_the_out_of_memory_line(store, at, how):
    """A library that cannot be mapped under an address-space limit was "internal error ... a bug, please report
    it" (exit 70), and a MemoryError while the parser imported the subcommands a raw traceback (exit 1): both are
    out of memory, said in one line, exit 2."""
    r = subprocess.run([sys.executable, "-c", FAIL_AT_IMPORT, at, how, "run", "-m", store, "-p", "Once", "-n", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "bitnet: error: out of memory (hint: use a smaller -c/--ctx, or close other programs)"], r.stderr


def test_ctrl_c_keeps_text(store):
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "run", "-m", store, "-p", "Once upon a time", "-n", "100000",
                          "-c", "60000", "--temp", "1", "--seed", "1", "-t", "1"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         # a suite started in the background (`cmd &`) has SIGINT ignored, and a child keeps that
                         # (POSIX), so Ctrl-C would never reach it: give it a terminal's default
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(1)
    assert first, p.stderr.read().decode()
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=30)
    assert p.returncode == 130, err.decode()
    assert len(first + rest) > 1 and b"Traceback" not in err
