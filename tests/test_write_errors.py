"""Output that cannot be written (stdout on a full disk: /dev/full fails every write with ENOSPC) is one line naming
the problem and exit 2, as any other trouble the user can act on: it was "internal error ... this is a bug in
bitnet-cpu" and exit 70 for `bitnet run / embed / bench / info`, and bitchat went on answering into the void
("[internal error: ...; the session goes on]"). A model file that cannot be read says so (it was called "not a GGUF
file, a BitNet store or a Hugging Face model directory")."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "default.bnstore")

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fail writes")


def _to_full(args, prog="bitnet", stdin=None, env=None):
    module = "bitnet_cpu.cli" if prog == "bitnet" else "bitnet_cpu.cli.bitchat"   # the console scripts' entry points
    code = f"import sys; from {module} import main; sys.exit(main())"
    with open("/dev/full", "w") as full:
        return subprocess.run([sys.executable, "-c", code, *args], stdout=full, stderr=subprocess.PIPE, input=stdin,
                              text=True, timeout=180, cwd=ROOT, env=env)


@pytest.mark.parametrize("args", [
    ["run", "-m", MODEL, "-p", "Once upon a time", "-n", "8", "-t", "1", "--temp", "0"],
    ["embed", "-m", MODEL, "-t", "1", "--embd-output-format", "json", "-p", "a text"],
    ["bench", "-m", MODEL, "-p", "8", "-n", "2", "-r", "1", "-t", "1", "-o", "json"],
    ["info"],
], ids=["run", "embed", "bench", "info"])
def test_bitnet_output_on_a_full_disk_is_one_line(args):
    r = _to_full(args)
    lines = [x for x in r.stderr.splitlines() if x.startswith("bitnet")]
    assert r.returncode == 2, r.stderr
    assert "bitnet: error: write error: No space left on device" in lines, r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("prog, args", [("bitnet", ["--version"]), ("bitnet", ["--help"]),
                                        ("bitnet", ["run", "--help"]), ("bitchat", ["--version"])])
def test_help_and_version_on_a_full_disk_are_one_line(prog, args):
    """argparse drops an error writing its help or version: they exited 0 with nothing written and nothing said."""
    r = _to_full(args, prog=prog)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"{prog}: error: write error: No space left on device"], r.stderr


def test_bitchat_output_on_a_full_disk_leaves_with_the_turns_kept(tmp_path):
    rec = tmp_path / "rec.json"
    env = {**os.environ, "BITCHAT_RECOVERY": str(rec), "BITCHAT_HISTORY": str(tmp_path / "hist")}
    r = _to_full(["-m", MODEL, "-t", "1", "-n", "4"], prog="bitchat", stdin="hello\nand again\n", env=env)
    assert r.returncode == 2, r.stderr
    assert (f"bitchat: error: write error: No space left on device; the conversation so far is saved in {rec}"
            in r.stderr.splitlines()), r.stderr
    assert "internal error" not in r.stderr and "the session goes on" not in r.stderr
    assert rec.is_file() and "hello" in rec.read_text()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root reads every file: an unreadable model cannot be made here")
def test_a_model_file_that_cannot_be_read_says_so(tmp_path):
    m = tmp_path / "secret.bnstore"
    shutil.copy(MODEL, m)
    os.chmod(m, 0)
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-m", str(m), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and f"bitnet: error: {m}: cannot read: Permission denied" in r.stderr, r.stderr
