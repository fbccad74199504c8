"""`bitnet perplexity`: llama-perplexity's chunks, scored tokens and arithmetic, and its base-logits file.

- PPL: the command's figures equal a computation written here from the definition (each chunk from an empty cache
  with BOS in front, the logits of its second half scored against the next tokens, log-softmax in f64), over
  LLM.forward's logits; and transformers' BitNet over the same chunks agrees within 0.5% (the numerical reference;
  skipped, saying so, without it);
- the base file is parsed here from llama.cpp's documented layout (not with the engine's reader): header, the
  tokens, and every stored row within one rounding step of the exact log-probabilities, the floor stored as 0;
- KL divergence of a model from itself is 0 with the same top token everywhere; of the f16-head model from the q4
  head's (the same weights, another head) it equals the exact KL computed here from both models' logits;
- bad input: one line and exit 2; Ctrl-C prints the estimate so far, exits 130 and leaves an existing base file as
  it was.
"""
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from bitnet_cpu.engine.api import load_model
from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.models import DEFAULT_MODEL_DIR
from bitnet_cpu.models.corpus import hellaswag_text, multiple_choice_bytes, story, winogrande_text
from helpers import ROOT

CTX = 128


def bitnet(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", "perplexity", "-t", "2", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(11)
    path = tmp_path_factory.mktemp("ppl") / "stories.txt"
    path.write_text("\n".join(story(rng) for _ in range(40)), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def llm():
    m = load_model(None, ctx=CTX, threads=2, progress=False)
    yield m
    m.close()


def chunks_of(llm, text_file, n_ctx=CTX, n=None):
    ids = llm.tokenize(open(text_file, encoding="utf-8").read(), add_bos=True, special=False)
    count = len(ids) // n_ctx if n is None else n
    return [list(ids[c * n_ctx: (c + 1) * n_ctx]) for c in range(count)]


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def scored(llm, chunk, logits_of):
    """(log-probabilities of the scored rows [n/2 .. n-2], their next tokens) of one chunk, BOS in front."""
    ids = list(chunk)
    ids[0] = llm.tokenizer.bos_id
    n = len(ids)
    rows = np.arange(n // 2, n - 1)
    return log_softmax(logits_of(ids)[rows]), np.asarray(chunk)[rows + 1]


def test_ppl_is_the_definition(llm, text_file):
    r = bitnet("-f", text_file, "-c", str(CTX), "--chunks", "4")
    assert r.returncode == 0, r.stderr
    running, total, count = [], 0.0, 0
    for chunk in chunks_of(llm, text_file, n=4):
        lp, nxt = scored(llm, chunk, llm.forward)
        total -= lp[np.arange(len(nxt)), nxt].sum()
        count += len(nxt)
        running.append(np.exp(total / count))
    assert count == 4 * (CTX - 1 - CTX // 2)
    line, final = r.stdout.strip().split("\n")
    got = [float(x.split("]")[1]) for x in line.rstrip(",").split(",")]
    assert [f"[{i + 1}]" for i in range(4)] == [x[: x.index("]") + 1] for x in line.rstrip(",").split(",")]
    assert got == pytest.approx(running, rel=1e-4)   # printed with 4 decimals
    assert final.startswith("Final estimate: PPL = ")
    ppl = float(final.split("=")[1].split("+/-")[0])
    assert ppl == pytest.approx(running[-1], rel=1e-4)
    js = bitnet("-f", text_file, "-c", str(CTX), "--chunks", "4", "--json")
    assert js.returncode == 0, js.stderr
    rec = json.loads(js.stdout)
    assert rec["ppl"] == pytest.approx(running[-1], rel=1e-6)
    assert rec["chunks"] == 4 and rec["tokens_scored"] == count and rec["n_ctx"] == CTX


def test_python_api_gives_the_commands_figure(llm, text_file):
    rec = json.loads(bitnet("-f", text_file, "-c", str(CTX), "--chunks", "3", "--json").stdout)
    got = llm.perplexity(open(text_file, encoding="utf-8").read(), chunk=CTX, chunks=3)
    assert got["ppl"] == rec["ppl"] and got["ppl_err"] == rec["ppl_err"]
    assert got["chunks"] == 3 and got["tokens_scored"] == rec["tokens_scored"]
    with pytest.raises(BitNetError):
        llm.perplexity("too short", chunk=CTX)
    with pytest.raises(BitNetError):
        llm.perplexity(open(text_file, encoding="utf-8").read(), chunk=2 * CTX)


def test_every_whole_chunk_by_default(llm, text_file):
    n = len(chunks_of(llm, text_file))
    rec = json.loads(bitnet("-f", text_file, "-c", str(CTX), "--json").stdout)
    assert rec["chunks"] == n and rec["tokens_scored"] == n * (CTX - 1 - CTX // 2)


def test_ppl_near_the_transformers_reference(llm, text_file):
    from test_model_fixtures import load_reference, reference_logits

    ref = load_reference(DEFAULT_MODEL_DIR)   # skips, saying why, without torch + transformers
    total, count = 0.0, 0
    for chunk in chunks_of(llm, text_file, n=3):
        lp, nxt = scored(llm, chunk, lambda ids: reference_logits(ref, ids))
        total -= lp[np.arange(len(nxt)), nxt].sum()
        count += len(nxt)
    rec = json.loads(bitnet("-f", text_file, "-c", str(CTX), "--chunks", "3", "--json").stdout)
    assert rec["ppl"] == pytest.approx(np.exp(total / count), rel=5e-3)


def read_base_file(path):
    """llama.cpp's layout, parsed from its description (tools/perplexity): header, tokens, u16 rows."""
    data = open(path, "rb").read()
    magic, n_ctx, vocab, n_chunk = struct.unpack_from("<8sIii", data)
    assert magic == b"_logits_"
    off = 20
    tokens = np.frombuffer(data, "<i4", n_ctx * n_chunk, off)
    off += 4 * n_ctx * n_chunk
    nv = 2 * ((vocab + 1) // 2) + 4
    n_rows = n_ctx - 1 - n_ctx // 2
    assert len(data) == off + 2 * nv * n_rows * n_chunk
    rows = np.frombuffer(data, "<u2", nv * n_rows * n_chunk, off).reshape(n_chunk, n_rows, nv)
    return n_ctx, vocab, tokens.reshape(n_chunk, n_ctx), rows


def stored_log_probs(rows, vocab):
    """One chunk's rows of a base file as llama.cpp reads them back: (scale, min) f32 per row, then
    value * scale + min per vocabulary entry (value 0: at or below the floor)."""
    head = rows[:, :4].copy().view("<f4")
    return head[:, :1] * rows[:, 4: 4 + vocab].astype(np.float32) + head[:, 1:2]


def test_the_saved_note_is_a_line_of_its_own(text_file, tmp_path):
    """stdout and stderr merged (2>&1, a terminal): the note that the base logits were saved came between the running
    `[1]ppl,[2]ppl,` pieces and the line that ends them, glued onto them."""
    base = str(tmp_path / "base.kld")
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "perplexity", "-t", "2", "-f", text_file, "-c", str(CTX),
                        "--chunks", "2", "--kl-divergence-base", base], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout
    saved = [ln for ln in r.stdout.splitlines() if "saved the base logits" in ln]
    assert len(saved) == 1 and saved[0].startswith("perplexity: saved"), r.stdout


def test_base_file_is_llama_cpp_layout(llm, text_file, tmp_path):
    base = str(tmp_path / "base.kld")
    r = bitnet("-f", text_file, "-c", str(CTX), "--chunks", "2", "--kl-divergence-base", base)
    assert r.returncode == 0, r.stderr
    assert "Final estimate" in r.stdout and not list(tmp_path.glob("*.partial"))
    n_ctx, vocab, tokens, rows = read_base_file(base)
    chunks = chunks_of(llm, text_file, n=2)
    assert (n_ctx, vocab) == (CTX, llm.config.vocab_size)
    assert tokens.tolist() == chunks   # the text's tokens, BOS not substituted
    for c, chunk in enumerate(chunks):
        lp, _ = scored(llm, chunk, llm.forward)
        scale = rows[c, :, :4].copy().view("<f4")[:, 0]
        q = rows[c, :, 4: 4 + vocab].astype(np.float64)
        back = stored_log_probs(rows[c], vocab)
        top = lp.max(axis=1, keepdims=True)
        above = lp > top - 16 + 1e-4   # the floor: top - 16, stored as 0
        assert np.all(np.abs(back - lp)[above] <= (scale[:, None] * 0.5 + 1e-4).repeat(vocab, 1)[above])
        assert np.all(q[lp < top - 16 - 1e-4] == 0)
        assert np.all(q.max(axis=1) == 65535)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """The bundled model converted with an f16 head and with a q4 head: the same weights, two heads."""
    from bitnet_cpu.engine.formats.convert import convert

    d = tmp_path_factory.mktemp("heads")
    return {h: convert(DEFAULT_MODEL_DIR, str(d / f"{h}.bnstore"), lm_head=h, progress=False) for h in ("f16", "q4")}


def test_kld_of_a_model_from_itself_is_zero(text_file, tmp_path):
    base = str(tmp_path / "self.kld")
    first = bitnet("-f", text_file, "-c", str(CTX), "--chunks", "4", "--kl-divergence-base", base, "--json")
    assert first.returncode == 0, first.stderr
    r = bitnet("--kl-divergence-base", base, "--kl-divergence", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    k = rec["kl_divergence"]
    assert rec["ppl"] == pytest.approx(json.loads(first.stdout)["ppl"], rel=1e-9)
    assert abs(k["kld"]) < 1e-6 and k["kld_percentiles"]["max"] < 1e-4
    assert k["same_top"] == 1.0 and k["count"] == 4 * (CTX - 1 - CTX // 2)
    text = bitnet("--kl-divergence-base", base, "--kl-divergence").stdout
    assert "====== KL divergence statistics ======" in text and "Same top p: 100.000 ± 0.000 %" in text
    # llama-perplexity's command lines as scripts keep them: -f beside --kl-divergence (not read: the base file's
    # tokens are scored), -b / -ub (chunks run one by one here): the same figures
    again = bitnet("-f", text_file, "-b", "512", "-ub", "512", "--kl-divergence-base", base, "--kl-divergence", "--json")
    assert again.returncode == 0, again.stderr
    assert [json.loads(again.stdout)[k] for k in ("ppl", "kl_divergence")] == [rec["ppl"], rec["kl_divergence"]]
    assert "is not read" in again.stderr


def test_kld_between_heads_is_the_exact_kl(heads, text_file, tmp_path):
    base = str(tmp_path / "f16.kld")
    assert bitnet("-m", heads["f16"], "-f", text_file, "-c", str(CTX), "--chunks", "4",
                  "--kl-divergence-base", base).returncode == 0
    r = bitnet("-m", heads["q4"], "--kl-divergence-base", base, "--kl-divergence", "--json")
    assert r.returncode == 0, r.stderr
    k = json.loads(r.stdout)["kl_divergence"]
    f16 = load_model(heads["f16"], ctx=CTX, threads=2, progress=False)
    q4 = load_model(heads["q4"], ctx=CTX, threads=2, progress=False)
    _, vocab, _, rows = read_base_file(base)
    klds, exact, same = [], [], 0
    for c, chunk in enumerate(chunks_of(f16, text_file, n=4)):
        lp, _ = scored(f16, chunk, f16.forward)
        lq, _ = scored(q4, chunk, q4.forward)
        # llama.cpp's KL is against the base as stored and sums only the entries stored above -16
        lb = stored_log_probs(rows[c], vocab)
        klds.append(np.where(lb > -16, np.exp(lb.astype(np.float64)) * (lb - lq), 0.0).sum(axis=1))
        exact.append(np.where(lp > -16, np.exp(lp) * (lp - lq), 0.0).sum(axis=1))
        same += int((lp.argmax(axis=1) == lq.argmax(axis=1)).sum())
    klds, exact = np.concatenate(klds), np.concatenate(exact)
    assert exact.mean() > 1e-5   # the heads differ: a comparison that cannot see it would pass the next lines at 0
    assert k["kld"] == pytest.approx(klds.mean(), rel=1e-3)
    assert k["kld_percentiles"]["max"] == pytest.approx(klds.max(), rel=1e-3)
    # the 16-bit base moves each position's KL by its rounding, not the mean: the exact KL of the two heads
    assert k["kld"] == pytest.approx(exact.mean(), rel=0.02, abs=2e-6)
    assert abs(k["same_top"] * len(klds) - same) <= 1   # a near tie may round either way in 16 bits


def test_strided_pass_is_the_definition(llm, text_file):
    """--ppl-stride S: windows of -c tokens starting every S tokens, run as the text has them (llama-perplexity
    puts no BOS in front: it writes its BOS only after the run), each scored over its last S rows."""
    stride, n = 48, 5
    ids = llm.tokenize(open(text_file, encoding="utf-8").read(), add_bos=True, special=False)
    assert len(ids) > CTX + (n - 1) * stride
    running, total, count = [], 0.0, 0
    for w in range(n):
        window = list(ids[w * stride: w * stride + CTX])
        rows = np.arange(CTX - stride - 1, CTX - 1)
        lp = log_softmax(llm.forward(window)[rows])
        total -= lp[np.arange(stride), np.asarray(window)[rows + 1]].sum()
        count += stride
        running.append(np.exp(total / count))
    r = bitnet("-f", text_file, "-c", str(CTX), "--ppl-stride", str(stride), "--chunks", str(n))
    assert r.returncode == 0, r.stderr
    line, final = r.stdout.strip().split("\n")
    assert [float(x.split("]")[1]) for x in line.rstrip(",").split(",")] == pytest.approx(running, rel=1e-4)
    assert float(final.split("=")[1].split("+/-")[0]) == pytest.approx(running[-1], rel=1e-4)
    r1 = bitnet("-f", text_file, "-c", str(CTX), "--ppl-stride", str(stride), "--chunks", str(n),
                "--ppl-output-type", "1")
    rows = [x.split() for x in r1.stdout.strip().split("\n")[:n]]
    assert [int(x[0]) for x in rows] == [w * stride for w in range(n)]
    assert [float(x[1]) for x in rows] == pytest.approx(running, rel=1e-4)
    rec = json.loads(bitnet("-f", text_file, "-c", str(CTX), "--ppl-stride", str(stride), "--chunks", str(n),
                            "--json").stdout)
    assert rec["ppl"] == pytest.approx(running[-1], rel=1e-6) and rec["tokens_scored"] == count
    assert rec["stride"] == stride and rec["chunks"] == n
    got = llm.perplexity(ids, chunk=CTX, chunks=n, stride=stride)
    assert got["ppl"] == rec["ppl"] and got["tokens_scored"] == count
    every = (len(ids) - CTX + stride - 1) // stride   # llama-perplexity's window count: while a whole one fits
    assert llm.perplexity(ids, chunk=CTX, stride=stride)["chunks"] == every


def test_output_type_1_is_llama_perplexitys_lines(llm, text_file):
    """--ppl-output-type 1 over whole chunks: each chunk's first token, the PPL so far, the mean negative
    log-likelihood and its uncertainty (llama-perplexity's "%8d  %.4lf  %4lf  %4lf")."""
    nlls = []
    r = bitnet("-f", text_file, "-c", str(CTX), "--chunks", "3", "--ppl-output-type", "1")
    assert r.returncode == 0, r.stderr
    for chunk in chunks_of(llm, text_file, n=3):
        lp, nxt = scored(llm, chunk, llm.forward)
        nlls.extend(-lp[np.arange(len(nxt)), nxt])
        a = np.asarray(nlls)
        want = (np.exp(a.mean()), a.mean(), np.sqrt((np.mean(a * a) - a.mean() ** 2) / (len(a) - 1)))
        line = r.stdout.strip().split("\n")[len(nlls) // len(nxt) - 1].split()
        assert int(line[0]) == (len(nlls) // len(nxt) - 1) * CTX
        assert [float(x) for x in line[1:]] == pytest.approx(want, rel=1e-3)
    assert r.stdout.strip().split("\n")[-1].startswith("Final estimate: PPL = ")


@pytest.mark.parametrize("case", ["no_file", "short", "chunks0", "ctx", "missing", "kld_no_base",
                                  "not_base", "truncated", "vocab", "ctx_mismatch", "base_dir", "base_is_text",
                                  "stride_ctx", "stride_neg", "stride_kld", "stride_short"])
def test_bad_input_is_one_line(case, text_file, tmp_path):
    base = str(tmp_path / "b.kld")
    if case in ("truncated", "ctx_mismatch", "vocab"):
        assert bitnet("-f", text_file, "-c", str(CTX), "--chunks", "2", "--kl-divergence-base", base).returncode == 0
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time", encoding="utf-8")
    junk = tmp_path / "junk.kld"
    junk.write_bytes(b"GGUF" + bytes(100))
    args = {
        "no_file": (),
        "short": ("-f", str(short)),
        "chunks0": ("-f", text_file, "--chunks", "0"),
        "ctx": ("-f", text_file, "-c", "2"),
        "missing": ("-f", str(tmp_path / "nope.txt")),
        "kld_no_base": ("--kl-divergence",),
        "not_base": ("--kl-divergence-base", str(junk), "--kl-divergence"),
        "truncated": ("--kl-divergence-base", base, "--kl-divergence"),
        "vocab": ("-m", "SYNTH", "--kl-divergence-base", base, "--kl-divergence"),
        "ctx_mismatch": ("-c", "64", "--kl-divergence-base", base, "--kl-divergence"),
        # the file to write: refused before any chunk runs, the text never overwritten
        "base_dir": ("-f", text_file, "--kl-divergence-base", str(tmp_path)),
        "base_is_text": ("-f", str(short), "--kl-divergence-base", str(short)),
        "stride_ctx": ("-f", text_file, "-c", str(CTX), "--ppl-stride", str(CTX)),
        "stride_neg": ("-f", text_file, "--ppl-stride", "-1"),
        "stride_kld": ("-f", text_file, "--ppl-stride", "8", "--kl-divergence-base", base),
        "stride_short": ("-f", str(short), "-c", "16", "--ppl-stride", "4"),
    }[case]
    if case == "truncated":
        with open(base, "r+b") as f:
            f.truncate(os.path.getsize(base) - 10)
    if case == "vocab":
        from test_model_fixtures import make_synth
        _, _, stores = make_synth(tmp_path, vocab_size=300)
        args = tuple(stores["f16"] if a == "SYNTH" else a for a in args)
    r = bitnet(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitnet: error: "), r.stderr
    want = {"short": "fewer than one chunk", "chunks0": "--chunks 0", "ctx": "-c/--ctx-size 2", "missing": "nope.txt",
            "no_file": "-f/--file", "kld_no_base": "--kl-divergence-base",
            "not_base": "not a file of base logits", "truncated": "truncated", "vocab": "vocabulary",
            "ctx_mismatch": "chunks of 128", "base_dir": "a directory", "base_is_text": "refusing to overwrite",
            "stride_ctx": f"--ppl-stride {CTX}", "stride_neg": "--ppl-stride -1", "stride_kld": "--kl-divergence",
            "stride_short": "more than one window"}[case]
    assert want in lines[0]
    assert short.read_text(encoding="utf-8") == "Once upon a time" and not list(tmp_path.glob("*.partial"))


def test_ctrl_c_keeps_the_estimate_and_the_old_base_file(text_file, tmp_path):
    long_text = tmp_path / "long.txt"
    long_text.write_text(open(text_file, encoding="utf-8").read() * 40, encoding="utf-8")
    base = tmp_path / "keep.kld"
    base.write_bytes(b"_logits_ an earlier base file")   # a file of base logits (only such a file is replaced)
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "perplexity", "-t", "1", "-f", str(long_text), "-c", "64",
                          "--kl-divergence-base", str(base)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         # a suite started in the background has SIGINT ignored and a child keeps that (POSIX)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(4)   # "[1]2" : the first chunk is done
    assert first.startswith(b"[1]"), p.stderr.read().decode()
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=120)
    out = (first + rest).decode()
    assert p.returncode == 130, err.decode()
    assert "Estimate over " in out and " chunks: PPL = " in out and b"Traceback" not in err
    assert base.read_bytes() == b"_logits_ an earlier base file"
    assert not list(base.parent.glob("*.partial"))


def test_ctrl_c_inside_a_chunk_leaves_it_out_of_the_estimate(text_file, tmp_path):
    """Ctrl-C while a chunk is scored (its rows come in several pieces): the estimate is over the chunks done,
    the last running figure printed; it counted the pieces of the cut chunk too (an estimate over "7 chunks" of
    1913 rows, not 7 x 255). Ctrl-Cs at several points of the second chunk."""
    long_text = tmp_path / "long.txt"
    long_text.write_text(open(text_file, encoding="utf-8").read() * 60, encoding="utf-8")
    for wait in (0.01, 0.03, 0.05, 0.07, 0.09):   # a chunk takes ~0.1 s here, its second half in pieces
        p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "perplexity", "-t", "1", "-f", str(long_text),
                              "-c", "512"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        first = b""
        while len(first) < 3:   # "[1]": the first chunk is done, the second being scored (read from the pipe
            got = os.read(p.stdout.fileno(), 3 - len(first))   # itself: a buffered read keeps what follows)
            assert got, p.stderr.read().decode()
            first += got
        assert first == b"[1]", first
        time.sleep(wait)
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=120)
        out = (first + rest).decode()
        assert p.returncode == 130, err.decode()
        running = re.findall(r"\[(\d+)\]([0-9.]+),", out)
        done = re.search(r"Estimate over (\d+) of \d+ chunks: PPL = ([0-9.]+)", out)
        assert running and done, out
        assert (done.group(1), done.group(2)) == running[-1], (wait, out[-300:])


def test_special_token_spelling_is_plain_text(llm, tmp_path):
    """As llama-perplexity: a text that spells a special token is scored as those characters, not as the token."""
    eos = llm.tokenizer.eos_ids[0] if llm.tokenizer.eos_ids else None
    spelled = llm.detokenize([eos]) if eos is not None else "<|end_of_text|>"
    assert spelled and llm.tokenize(spelled, special=True) == [eos]
    rng = random.Random(3)
    path = tmp_path / "spelled.txt"
    path.write_text(f" {spelled} ".join(story(rng) for _ in range(12)), encoding="utf-8")
    base = str(tmp_path / "spelled.kld")
    assert bitnet("-f", str(path), "-c", str(CTX), "--kl-divergence-base", base).returncode == 0
    _, _, tokens, _ = read_base_file(base)
    assert eos not in tokens.ravel().tolist()
    assert tokens.ravel().tolist() == llm.tokenize(path.read_text(encoding="utf-8"), add_bos=True,
                                                   special=False)[: tokens.size]


# ---- HellaSwag -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hellaswag_file(tmp_path_factory):
    """llama.cpp's 6-line layout, made from the corpus (models/corpus.py): a story's opening, its next sentence among
    three of other stories (the model knows the stories: most tasks are right, not all)."""
    path = tmp_path_factory.mktemp("hs") / "hellaswag.txt"
    path.write_text(hellaswag_text(24), encoding="utf-8")
    return str(path)


def ending_scores(llm, context, endings):
    """Each ending's mean log-probability (LLM.forward over its whole sequence, BOS + context + " " + ending) over
    its tokens after the part all the sequences share."""
    seqs = [llm.tokenize(context + " " + e, add_bos=True, special=False) for e in endings]
    common = 0
    while len({s[common] for s in seqs}) == 1:
        common += 1
    want = []
    for s in seqs:
        lp = log_softmax(llm.forward(s))
        want.append(float(np.mean([lp[t - 1, s[t]] for t in range(common, len(s))])))
    return want


def test_hellaswag_is_the_definition(llm, hellaswag_file):
    """Each ending's score is the mean log-probability of its tokens after the part the four sequences share
    (computed here from LLM.forward over each whole sequence); the task is right when the gold ending's is the
    highest; the running accuracy and its Wilson interval are llama-perplexity's lines."""
    r = bitnet("--hellaswag", "-f", hellaswag_file, "--hellaswag-tasks", "0", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    lines = open(hellaswag_file, encoding="utf-8").read().split("\n")
    assert rec["tasks"] == 24 and sorted(x["task"] for x in rec["results"]) == list(range(24))
    right = 0
    for res in rec["results"]:
        block = lines[6 * res["task"]: 6 * res["task"] + 6]
        want = ending_scores(llm, block[0], block[2:])
        assert res["scores"] == pytest.approx(want, abs=1e-5)
        assert res["gold"] == int(block[1]) and res["chosen"] == int(np.argmax(want))
        right += res["chosen"] == res["gold"]
    assert rec["acc_norm"] == pytest.approx(100 * right / 24)
    assert 0 < right < 24   # neither all nor none: a mix-up of gold and chosen could not pass both ways
    text = bitnet("--hellaswag", "-f", hellaswag_file, "--hellaswag-tasks", "0").stdout.strip().splitlines()
    assert text[0] == "task\tacc_norm\t95% confidence interval"
    n, acc, ci = text[-1].split("\t")
    assert int(n) == 24 and float(acc.rstrip("%")) == pytest.approx(100 * right / 24, abs=1e-6)
    lo, hi = (float(x.strip(" %")) for x in ci.strip("[]").split(","))
    assert lo == pytest.approx(rec["ci95"][0], abs=1e-4) and hi == pytest.approx(rec["ci95"][1], abs=1e-4)


def test_hellaswag_draws_the_tasks_asked(hellaswag_file):
    rec = json.loads(bitnet("--hellaswag", "-f", hellaswag_file, "--hellaswag-tasks", "7", "--json").stdout)
    picked = [x["task"] for x in rec["results"]]
    assert rec["tasks"] == 7 and len(set(picked)) == 7 and all(0 <= t < 24 for t in picked)
    again = json.loads(bitnet("--hellaswag", "-f", hellaswag_file, "--hellaswag-tasks", "7", "--json").stdout)
    assert [x["task"] for x in again["results"]] == picked   # a fixed seed


@pytest.mark.parametrize("case", ["lines", "gold", "kld", "ctx", "negative"])
def test_hellaswag_bad_input_is_one_line(case, hellaswag_file, tmp_path):
    bad = tmp_path / "bad.txt"
    good = open(hellaswag_file, encoding="utf-8").read().split("\n")
    if case == "lines":
        bad.write_text("\n".join(good[:7]) + "\n", encoding="utf-8")
    elif case == "gold":
        bad.write_text("\n".join(good[:1] + ["seven"] + good[2:6]) + "\n", encoding="utf-8")
    args = {"lines": ("-f", str(bad)), "gold": ("-f", str(bad)),
            "kld": ("-f", hellaswag_file, "--kl-divergence-base", str(tmp_path / "x.kld")),
            "ctx": ("-f", hellaswag_file, "-c", "8"), "negative": ("-f", hellaswag_file, "--hellaswag-tasks", "-1")}[case]
    r = bitnet("--hellaswag", *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitnet: error: "), r.stderr
    want = {"lines": "6 lines per task", "gold": "not a gold ending index", "kld": "--kl-divergence",
            "ctx": "raise -c", "negative": "--hellaswag-tasks -1"}[case]
    assert want in lines[0]


def test_hellaswag_ctrl_c_keeps_what_was_scored(hellaswag_file, tmp_path):
    many = tmp_path / "many.txt"
    many.write_text(open(hellaswag_file, encoding="utf-8").read() * 400, encoding="utf-8")
    p = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "perplexity", "-t", "1", "--hellaswag", "-f", str(many),
                          "--hellaswag-tasks", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head = b""
    while b"\n1\t" not in head:   # the header, then the first task's line
        piece = p.stdout.read1(4096)
        assert piece, p.stderr.read().decode()
        head += piece
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 130 and b"Traceback" not in err, err.decode()
    assert b"interrupted after " in err and b"of 9600 tasks" in err


# ---- the task draws: llama-perplexity's, checked against libstdc++ itself ----------------------------------------
DRAWS_CPP = r"""
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
int main(int argc, char **argv) {
    size_t n = strtoul(argv[1], 0, 10), k = strtoul(argv[2], 0, 10);
    {   // hellaswag_score: a uniform index into the tasks left
        std::mt19937 rng(1);
        std::vector<size_t> left(n);
        for (size_t i = 0; i < n; i++) left[i] = i;
        for (size_t i = 0; i < k; i++) {
            std::uniform_int_distribution<size_t> dist(0, left.size() - 1);
            size_t idx = dist(rng);
            printf("%zu ", left[idx]);
            left.erase(left.begin() + idx);
        }
        printf("\n");
    }
    {   // winogrande_score: a float index, the pick replaced by the last one
        std::mt19937 rng(1);
        std::vector<int> aux(n);
        for (size_t i = 0; i < n; i++) aux[i] = i;
        float scale = 1/(1.f + (float)rng.max());
        for (size_t i = 0; i < k; i++) {
            int j = int(scale*rng()*aux.size());
            printf("%d ", aux[j]);
            aux[j] = aux.back();
            aux.pop_back();
        }
        printf("\n");
    }
}
"""


def test_task_draws_are_llama_perplexitys(tmp_path):
    """The tasks drawn equal what llama-perplexity's code draws when built with GCC's libstdc++ (compiled here)."""
    import shutil
    from bitnet_cpu.engine.runtime.perplexity import draw_hellaswag, draw_winogrande

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++): the draws are compared with libstdc++'s own std::mt19937 and "
                    "uniform_int_distribution")
    (tmp_path / "draws.cpp").write_text(DRAWS_CPP)
    exe = str(tmp_path / "draws")
    subprocess.run([cxx, "-O1", "-o", exe, str(tmp_path / "draws.cpp")], check=True, capture_output=True, timeout=120)
    for n, k in ((10042, 400), (1267, 100), (7, 7), (3, 1)):
        hs, wg = subprocess.run([exe, str(n), str(k)], capture_output=True, text=True, check=True).stdout.splitlines()
        assert draw_hellaswag(list(range(n)), k) == [int(x) for x in hs.split()]
        if k < n:
            assert draw_winogrande(list(range(n)), k) == [int(x) for x in wg.split()]


# ---- Winogrande ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def winogrande_file(tmp_path_factory):
    """llama.cpp's CSV from the corpus (models/corpus.py): a header, then 30 rows, a story's opening with its hero's
    last mention as "_" (quoted sentences with commas), the hero and another story's hero as the choices."""
    path = tmp_path_factory.mktemp("wg") / "winogrande.csv"
    path.write_text(winogrande_text(30), encoding="utf-8")
    return str(path)


def test_winogrande_lines_that_are_no_task_are_named_with_why(tmp_path):
    """A row with answer 3, or without "_", was skipped as "2 lines that are not tasks (a header?)": which lines, and
    why, are said now (llama-perplexity names each bad line)."""
    lines = winogrande_text(6).split("\n")
    lines[2] = re.sub(r",[12]$", ",3", lines[2])
    lines[3] = lines[3].replace("_", "x")
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines), encoding="utf-8")
    r = bitnet("--winogrande", "-f", str(path))
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "skipped" in ln]
    assert len(said) == 1 and "skipped 3 lines that are not a task: line 1: " in said[0], r.stderr
    assert "line 3: answer '3' is not 1 or 2" in said[0] and "line 4: no _ in its sentence" in said[0], said


def test_winogrande_is_the_definition(llm, winogrande_file):
    """Each choice's score is the mean log-probability of the tokens after "first part + choice" (the last token
    left out), computed here from LLM.forward; the higher one is chosen (1 on a tie, as llama-perplexity)."""
    import csv
    r = bitnet("--winogrande", "-f", winogrande_file, "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    rows = list(csv.reader(open(winogrande_file, encoding="utf-8")))[1:-1]   # header off; the last line is not read
    assert rec["tasks"] == len(rows) == 29 and [x["task"] for x in rec["results"]] == list(range(29))
    right = 0
    for res, (_, sentence, c1, c2, answer) in zip(rec["results"], rows):
        first, second = sentence.split("_", 1)
        seqs = [llm.tokenize(first + c + second, add_bos=True, special=False) for c in (c1, c2)]
        common = 0
        while seqs[0][common] == seqs[1][common]:
            common += 1
        skip = all(len(s) - common > 3 for s in seqs)
        want = []
        for s, c in zip(seqs, (c1, c2)):
            start = len(llm.tokenize(first + c, add_bos=True, special=False)) if skip else common
            last = 1 if len(s) - start > 1 else 0
            lp = log_softmax(llm.forward(s))
            want.append(float(np.mean([lp[t - 1, s[t]] for t in range(start, len(s) - last)])))
        assert res["scores"] == pytest.approx(want, abs=1e-5)
        assert res["answer"] == int(answer) and res["chosen"] == (1 if want[0] > want[1] else 2)
        right += res["chosen"] == res["answer"]
    assert rec["score"] == pytest.approx(100 * right / 29)
    assert 0 < right < 29
    lines = bitnet("--winogrande", "-f", winogrande_file).stdout.strip().splitlines()
    n, acc, *_ = lines[-1].split("\t")
    assert int(n) == 29 and float(acc) == pytest.approx(100 * right / 29, abs=1e-4)


@pytest.mark.parametrize("flag,task", [("--hellaswag-tasks", "--hellaswag"), ("--winogrande-tasks", "--winogrande"),
                                       ("--multiple-choice-tasks", "--multiple-choice")])
def test_a_task_count_without_its_task_set_is_one_line(flag, task, winogrande_file):
    """llama-perplexity ignores --hellaswag-tasks N without --hellaswag; a plain perplexity run followed, and the
    count the user asked for meant nothing: said now, in one line."""
    # at its default value too (400 / 0 typed out ran without a word)
    for n in ("5", "400" if flag == "--hellaswag-tasks" else "0"):
        r = bitnet("-f", winogrande_file, flag, n)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"bitnet: error: {flag} counts the tasks of {task}, which this run does not score"], r.stderr


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_batch_size_below_one_is_one_line(value, text_file):
    """-b / -ub are taken for llama-perplexity's command lines and not used, but a nonsense value is said (it ran)."""
    r = bitnet("-f", text_file, "-c", "128", "--chunks", "1", "-b", value)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"bitnet: error: -b/--batch-size {value}: must be >= 1"], r.stderr


@pytest.mark.parametrize("args,want", [
    (("--winogrande", "--chunks", "3"), "--chunks counts the chunks of a text's perplexity; --winogrande scores tasks"),
    (("--hellaswag", "--chunks", "1"), "--chunks counts the chunks of a text's perplexity; --hellaswag scores tasks"),
    (("--winogrande", "--ppl-output-type", "1"), "--ppl-output-type 1 chooses the lines of a text's perplexity; "
                                                 "--winogrande prints its own"),
    (("--json", "--ppl-output-type", "1"), "--ppl-output-type 1 chooses the lines of a text's perplexity; --json "
                                           "prints its own"),
])
def test_a_flag_the_run_would_not_use_is_one_line(args, want, winogrande_file):
    """--chunks on a task set and --ppl-output-type where another printer prints were taken and did nothing (as
    llama-perplexity ignores them): said now, in one line."""
    r = bitnet("-f", winogrande_file, *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"bitnet: error: {want}"), r.stderr


@pytest.mark.parametrize("case", ["none", "both", "ctx", "kld"])
def test_winogrande_bad_input_is_one_line(case, winogrande_file, tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("index,sentence,option1,option2,answer\nno tasks here\n", encoding="utf-8")
    args = {"none": ("-f", str(empty)), "both": ("-f", winogrande_file, "--hellaswag"),
            "ctx": ("-f", winogrande_file, "-c", "8"),
            "kld": ("-f", winogrande_file, "--kl-divergence-base", str(tmp_path / "x.kld"))}[case]
    r = bitnet("--winogrande", *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitnet: error: "), r.stderr
    want = {"none": "no Winogrande tasks", "both": "one task set at a time", "ctx": "raise -c",
            "kld": "--kl-divergence"}[case]
    assert want in lines[0]


# ---- multiple choice (ARC, MMLU, TruthfulQA in llama.cpp's binary file) ---------------------------------------
@pytest.fixture(scope="module")
def choice_file(tmp_path_factory):
    """llama.cpp's binary layout from the corpus (models/corpus.py): a story's opening, its next sentence among 1-4
    sentences of other stories (2-5 answers a task), an mc2 set read past."""
    path = tmp_path_factory.mktemp("mc") / "choices.bin"
    path.write_bytes(multiple_choice_bytes(20))
    return str(path)


def test_multiple_choice_is_the_definition(llm, choice_file):
    """Each answer's score is the mean log-probability of the tokens of BOS + question + " " + answer after the
    part every answer shares (computed here from LLM.forward, the file parsed here from its layout); the task is
    right when the best answer's label is 1; the lines and the final result are llama-perplexity's."""
    data = open(choice_file, "rb").read()
    n, = struct.unpack_from("<I", data)
    offsets = struct.unpack_from(f"<{n}I", data, 4)

    def read_task(pos):
        def string():
            nonlocal pos
            size, = struct.unpack_from("<I", data, pos)
            pos += 4 + size
            return data[pos - size: pos].decode("utf-8")
        question = string()
        count, = struct.unpack_from("<I", data, pos)
        pos += 4
        answers = [string() for _ in range(count)]
        return question, answers, list(struct.unpack_from(f"<{count}i", data, pos))

    r = bitnet("--multiple-choice", "-f", choice_file, "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["tasks"] == n == 20 and [x["task"] for x in rec["results"]] == list(range(n))
    right = answers_total = 0
    for res in rec["results"]:
        question, answers, labels = read_task(offsets[res["task"]])
        want = ending_scores(llm, question, answers)
        assert res["scores"] == pytest.approx(want, abs=1e-5) and res["labels"] == labels
        assert res["chosen"] == int(np.argmax(want)) and res["right"] == (labels[res["chosen"]] == 1)
        right += res["right"]
        answers_total += len(answers)
    assert 0 < right < n   # neither all nor none
    assert rec["accuracy"] == pytest.approx(100 * right / n)
    assert rec["random_chance"] == pytest.approx(100 * n / answers_total)
    text = bitnet("--multiple-choice", "-f", choice_file).stdout.strip().splitlines()
    assert text[0] == "task\tacc_norm" and text[n] == f"{n}\t{100 * right / n:.8f}"
    p, q = right / n, n / answers_total
    assert text[-2:] == [f"Final result: {100 * p:.4f} +/- {100 * np.sqrt(p * (1 - p) / (n - 1)):.4f}",
                         f"Random chance: {100 * q:.4f} +/- {100 * np.sqrt(q * (1 - q) / (n - 1)):.4f}"]


def test_multiple_choice_draws_read_each_task_at_its_offset(choice_file):
    """A drawn subset is llama-perplexity's draw (the float draw Winogrande uses, checked against libstdc++ above),
    each task read at its offset; every task (0) is read in turn after the offsets. A file whose tasks lie in
    another order than their offsets shows the two apart."""
    from bitnet_cpu.engine.runtime.perplexity import float_draw, parse_multiple_choice

    data = open(choice_file, "rb").read()
    n, = struct.unpack_from("<I", data)
    offsets = list(struct.unpack_from(f"<{n}I", data, 4)) + [len(data)]
    blobs = [data[offsets[i]: offsets[i + 1]] for i in range(n)]
    # the same tasks stored backwards, their offsets still in task order
    body, pos, new_offsets = b"".join(reversed(blobs)), 4 + 4 * n, [0] * n
    for i in reversed(range(n)):
        new_offsets[i] = pos
        pos += len(blobs[i])
    flipped = struct.pack(f"<I{n}I", n, *new_offsets) + body
    every, count = parse_multiple_choice(data, 0)
    assert count == n and [t.index for t in every] == list(range(n))
    assert [t.question for t in parse_multiple_choice(flipped, 0)[0]] == [t.question for t in reversed(every)]
    drawn, _ = parse_multiple_choice(flipped, 6)
    assert [t.index for t in drawn] == float_draw(n, 6)
    assert [t.question for t in drawn] == [every[i].question for i in float_draw(n, 6)]
    rec = json.loads(bitnet("--multiple-choice", "-f", choice_file, "--multiple-choice-tasks", "6", "--json").stdout)
    assert [x["task"] for x in rec["results"]] == float_draw(n, 6)


@pytest.mark.parametrize("case", ["short", "count", "answers", "utf8", "empty", "both", "ctx", "negative",
                                  "offset"])
def test_multiple_choice_bad_input_is_one_line(case, choice_file, tmp_path):
    data = open(choice_file, "rb").read()
    bad = tmp_path / "bad.bin"
    first = struct.unpack_from("<I", data, 4)[0]          # the first task's offset
    qlen = struct.unpack_from("<I", data, first)[0]
    bad.write_bytes({"short": data[: len(data) - 7], "count": struct.pack("<I", 0),
                     "answers": data[: first + 4 + qlen] + struct.pack("<I", 101) + data[first + 8 + qlen:],
                     "utf8": data[: first + 4] + b"\xff" + data[first + 5:],
                     "empty": data[:first] + struct.pack("<I", 0) + data[first + 4 + qlen:],
                     # the first task's offset past the end: said so ("-99988618 bytes left" was said)
                     "offset": data[:4] + struct.pack("<I", 10 ** 8) * struct.unpack_from("<I", data)[0]
                     + data[4 + 4 * struct.unpack_from("<I", data)[0]:]}.get(case, data))
    extra = {"both": ("--winogrande",), "ctx": ("-c", "8"), "negative": ("--multiple-choice-tasks", "-1"),
             "offset": ("--multiple-choice-tasks", "5")}.get(case, ())   # drawn tasks are read at their offsets
    r = bitnet("--multiple-choice", "-f", str(bad), *extra)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitnet: error: ") and "Traceback" not in r.stderr, r.stderr
    want = {"short": "cut short", "count": "no tasks", "answers": "101 answers", "utf8": "not UTF-8",
            "empty": "empty question", "both": "one task set at a time", "ctx": "raise -c",
            "negative": "--multiple-choice-tasks -1", "offset": "past the end of the file"}[case]
    assert want in lines[0], lines[0]


def test_c_0_is_the_models_trained_context(text_file):
    """llama-perplexity's -c 0: chunks of the model's trained context (512 for the bundled model), the same figure
    as asking for that size."""
    trained = load_model(None, ctx=8, progress=False).config.context_length
    a = json.loads(bitnet("-f", text_file, "-c", "0", "--chunks", "1", "--json").stdout)
    b = json.loads(bitnet("-f", text_file, "-c", str(trained), "--chunks", "1", "--json").stdout)
    assert a["n_ctx"] == trained and a["ppl"] == b["ppl"]
    r = bitnet("-f", text_file, "-c", "-1")
    assert r.returncode == 2 and "-c/--ctx-size -1" in r.stderr


def test_a_base_logits_file_the_disk_refuses_is_one_line_and_no_partial_file(tmp_path):
    """A write past what the disk takes (here the file-size limit, which binds root too, SIGXFSZ ignored: EFBIG)
    while the base logits are written: one line naming the file (it reached the command as an OSError, "a bug in
    bitnet-cpu") and no PATH.partial left behind, whichever write fails (a chunk's, or the close's last flush)."""
    import resource
    import signal

    from bitnet_cpu.engine.errors import BitNetError
    from bitnet_cpu.engine.runtime.perplexity import LogitsWriter

    path = str(tmp_path / "base.kld")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        for rows in (64, 1):   # one write past the limit; small writes that the buffer flushes past it
            w = LogitsWriter(path, 4, 1000, list(range(8)))
            with pytest.raises(BitNetError, match="cannot write .*base.kld"):
                for _ in range(200):
                    w.add(np.zeros((rows, 1000), np.float32))
                w.commit()
            assert sorted(os.listdir(tmp_path)) == [], rows
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_the_base_logits_never_write_through_a_name_made_before(tmp_path):
    """PATH.partial was opened by name, following a link: in a folder others may write, a link made there first
    (to a file of the user's) was truncated and written over. A link, a FIFO or a hard link there is refused in
    one line now, and what it points at is left as it was."""
    from bitnet_cpu.engine.runtime.perplexity import LogitsWriter
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = str(tmp_path / "base.kld")
    os.symlink(victim, path + ".partial")
    with pytest.raises(BitNetError, match="not a plain file of yours") as e:
        LogitsWriter(path, 4, 1000, list(range(8)))
    assert "\n" not in str(e.value)
    assert victim.read_text() == "keep me" and os.path.islink(path + ".partial") and not os.path.exists(path)
    os.unlink(path + ".partial")
    os.link(victim, path + ".partial")   # a hard link: the same file under the name
    with pytest.raises(BitNetError, match="not a plain file of yours"):
        LogitsWriter(path, 4, 1000, list(range(8)))
    assert victim.read_text() == "keep me"
    os.unlink(path + ".partial")
    os.mkfifo(path + ".partial")   # opening it for writing would wait for a reader for ever
    with pytest.raises(BitNetError, match="not a plain file of yours"):
        LogitsWriter(path, 4, 1000, list(range(8)))
    os.unlink(path + ".partial")
    w = LogitsWriter(path, 4, 1000, list(range(8)))
    w.add(np.zeros((4, 1000), np.float32))
    w.add(np.zeros((4, 1000), np.float32))
    w.commit()
    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_"
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o666 & ~_umask_now())   # as open() would make it


def test_a_killed_runs_partial_base_logits_are_written_over_not_piled_up(tmp_path):
    """Each run wrote a fresh PATH.XXXX.partial: every run killed (SIGKILL, the out-of-memory killer, the fault
    guard's exit) left one of its own for good, each as large as the base logits (gigabytes)."""
    from bitnet_cpu.engine.runtime.perplexity import LogitsReader, LogitsWriter, scored_rows
    path = str(tmp_path / "base.kld")
    with open(path + ".partial", "wb") as f:   # what a killed run left: its header and part of its rows
        f.write(b"_logits_" + b"\0" * 50_000)
    w = LogitsWriter(path, 8, 1000, list(range(16)))
    w.add(np.zeros((scored_rows(8), 1000), np.float32))
    w.add(np.zeros((scored_rows(8), 1000), np.float32))
    w.commit()
    assert sorted(os.listdir(tmp_path)) == ["base.kld"]
    r = LogitsReader(path)   # whole: nothing of the old leftover in it
    assert r.n_chunk == 2 and list(r.tokens) == list(range(16))
    r.close()
    w = LogitsWriter(path, 4, 1000, list(range(8)))
    w.abort()
    assert sorted(os.listdir(tmp_path)) == ["base.kld"]


def _umask_now() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
