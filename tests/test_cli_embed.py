"""`bitnet embed` end to end in a subprocess on the bundled model: every output format (llama-embedding's listing
with its cosine matrix, array, json, json+, raw) carries the Python API's vectors to the printed precision; texts
come from -p or -f (a file's final newline ends its last text), cut at --embd-separator; pooling none prints every
token's vector as it is, as the server's /embedding answers it; bad input is one line and exit 2."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.api import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["a cat sat on the mat", "a dog", "Ternary weights: -1, 0 and +1."]


@pytest.fixture(scope="module")
def llm():
    m = load_model(None, threads=1, progress=False)
    yield m
    m.close()


def embed(*args, stdin=None):
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "embed", "-t", "1", *args], input=stdin,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    return r.returncode, r.stdout, r.stderr


def cosines(v):
    v = np.asarray(v, np.float64)
    n = v / np.linalg.norm(v, axis=1, keepdims=True)
    return n @ n.T


def test_json_array_and_raw_carry_the_api_vectors(llm, tmp_path):
    want = llm.embed(TEXTS)
    code, out, err = embed("-p", "\n".join(TEXTS), "--embd-output-format", "json+")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["object"] == "list" and [d["index"] for d in doc["data"]] == [0, 1, 2]
    got = np.array([d["embedding"] for d in doc["data"]])
    assert got.shape == want.shape and np.abs(got - want).max() <= 6e-8   # "%1.7f" (and the f32 cast before it)
    assert np.abs(np.array(doc["cosineSimilarity"]) - cosines(want)).max() <= 0.005 + 1e-9   # "%6.2f"
    assert f"3 texts, {sum(len(t) for t in llm.embed_tokens(TEXTS))} tokens" in err
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")   # the final newline starts no fourth text
    code, out, _ = embed("-f", str(f), "--embd-output-format", "array")
    assert code == 0 and np.abs(np.array(json.loads(out)) - want).max() <= 6e-8
    code, out, _ = embed("-f", "-", "--embd-output-format", "raw", stdin="|".join(TEXTS), )
    assert code == 0   # one text: the separator is a newline
    assert np.abs(np.array([float(x) for x in out.split()]) - llm.embed("|".join(TEXTS))[0]).max() <= 6e-8
    code, out, _ = embed("-p", "|".join(TEXTS), "--embd-separator", "|", "--embd-output-format", "raw")
    rows = [[float(x) for x in line.split()] for line in out.splitlines()]
    assert code == 0 and np.abs(np.array(rows) - want).max() <= 6e-8
    code, out, _ = embed("-p", TEXTS[0], "--embd-output-format", "json")   # json: no matrix
    assert code == 0 and "cosineSimilarity" not in json.loads(out)


def test_the_listing_norms_and_poolings(llm):
    want = llm.embed(TEXTS)
    code, out, _ = embed("-p", "\n".join(TEXTS))
    lines = out.splitlines()
    assert code == 0
    vecs = [[float(x) for x in line.split(":")[1].split()] for line in lines if line.startswith("embedding ")]
    assert len(vecs) == 3 and all(len(v) == 16 for v in vecs)   # several texts: the first 16 numbers
    assert np.abs(np.array(vecs) - want[:, :16]).max() <= 5e-7   # "%9.6f"
    i = lines.index("cosine similarity matrix:")
    matrix = [[float(x) for x in line.split()[:3]] for line in lines[i + 3:i + 6]]
    assert np.abs(np.array(matrix) - cosines(want)).max() <= 0.005 + 1e-9
    code, out, _ = embed("-p", TEXTS[0], "--embd-normalize", "0", "--pooling", "last")   # one text: all of it
    v = [float(x) for x in out.split(":")[1].split()]
    want0 = llm.embed(TEXTS[0], pooling="last", normalize=0)[0]
    assert code == 0 and len(v) == llm.config.hidden_size and max(abs(x) for x in v) == 32760
    assert np.abs(np.array(v) - want0).max() <= 0.5   # "%6.0f"
    # none: every token's vector as it is, the numbers of `bitnet serve --pooling none`'s /embedding and of
    # LLM.embed(pooling="none") (docs/usage.md); each row was normalised here (llama-embedding's way), unlike both
    code, out, _ = embed("-p", TEXTS[1], "--pooling", "none", "--embd-output-format", "array")
    rows = llm.embed(TEXTS[1], pooling="none")[0].astype(np.float64)
    assert code == 0
    assert np.abs(np.array(json.loads(out)) - rows).max() <= 6e-8
    code, out, _ = embed("-p", TEXTS[1], "--pooling", "none")
    listed = [line for line in out.splitlines() if line.startswith("embedding ")]
    assert code == 0 and len(listed) == len(rows) and all(" ... " in line for line in listed)
    # a norm given with none normalises each row, as llama-embedding does (the server and LLM.embed refuse one)
    code, out, _ = embed("-p", TEXTS[1], "--pooling", "none", "--embd-normalize", "2", "--embd-output-format", "array")
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    assert code == 0 and np.abs(np.array(json.loads(out)) - unit).max() <= 6e-8


def test_escapes_in_p_as_llama_embedding(llm, tmp_path):
    """-p's escapes are processed (llama.cpp's -e, on by default): -p 'a\\nb' is two texts, as llama-embedding
    reads it; --no-escape takes it as typed; a file's text is taken as it is."""
    two = llm.embed(TEXTS[:2])
    code, out, _ = embed("-p", TEXTS[0] + "\\n" + TEXTS[1], "--embd-output-format", "array")
    assert code == 0 and np.abs(np.array(json.loads(out)) - two).max() <= 6e-8
    code, out, _ = embed("-p", TEXTS[0] + "\\n" + TEXTS[1], "--no-escape", "--embd-output-format", "array")
    assert code == 0 and len(json.loads(out)) == 1
    f = tmp_path / "t.txt"
    f.write_text(TEXTS[0] + "\\n" + TEXTS[1], encoding="utf-8")
    code, out, _ = embed("-f", str(f), "--embd-output-format", "array")
    assert code == 0 and len(json.loads(out)) == 1


def test_cosines_as_llama_embedding_prints_them():
    """json+ adds the matrix over several texts only (one text's tokens under --pooling none are not texts); a
    p-norm of thousands normalises (llama.cpp's overflows to all-zero vectors, and so did ours), and two all-zero
    vectors are alike, 1.00, one is unlike any other, as llama.cpp's common_embd_similarity_cos."""
    import numpy as np

    from bitnet_cpu.cli.embed import _cos_matrix
    code, out, _ = embed("-p", TEXTS[0], "--pooling", "none", "--embd-output-format", "json+")
    assert code == 0 and "cosineSimilarity" not in json.loads(out) and len(json.loads(out)["data"]) > 1
    code, out, _ = embed("-p", "a\na", "--embd-normalize", "5000", "--embd-output-format", "json+")
    doc = json.loads(out)
    assert code == 0 and all(any(x != 0 for x in d["embedding"]) for d in doc["data"])
    assert [[round(c, 6) for c in row] for row in doc["cosineSimilarity"]] == [[1.0, 1.0], [1.0, 1.0]]
    zero, one, two = np.zeros(4, np.float32), np.ones(4, np.float32), np.array([1, 0, 0, 0], np.float32)
    sim = _cos_matrix([zero, one, zero, two])
    assert sim[0].tolist() == [1.0, 0.0, 1.0, 0.0] and sim[:, 1].tolist() == [0.0, 1.0, 0.0, 0.5]
    assert sim[1, 3] == sim[3, 1] == 0.5   # as the pair by pair: 1 / (2 * 1)


@pytest.mark.parametrize("args, words", [
    ((), "give the texts as -p TEXT or -f FILE"),
    (("-p", "a", "-f", "x"), "give the texts one way"),
    (("-p", "a\n\nb"), "text 2 of 3 is empty"),
    (("-f", "/nonexistent/texts.txt"), "No such file"),
    (("-p", "a", "--pooling", "cls"), "every text would get the same vector"),
    (("-p", "a", "--embd-normalize", "-2"), "--embd-normalize -2"),
    # none's rows are never normalised (as the server's /embedding): a norm asked for is refused, not ignored
    # texts are counted one way in every message, "text N of M" from 1 (the context's error said "input 0")
    (("-p", "word " * 3000), "error: text 1 of 1 has"),
    (("-p", "a\nword word word word", "-c", "2"), "error: text 2 of 2 has"),
    (("-p", "a", "--embd-separator", ""), "--embd-separator: must not be empty"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    code, out, err = embed(*args)
    assert code == 2 and out == "" and words in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_a_text_past_the_trained_context_is_warned_of(llm):
    """The default context of `bitnet embed` is past a short-trained model's (the bundled one: 512 tokens), so a
    longer text is embedded, and the user is told which text went past the trained length; a short one is not."""
    trained = llm.config.context_length
    long = "word " * trained   # two tokens a word with the space: past the trained length, within the default
    code, out, err = embed("-p", f"short\n{long}")
    assert code == 0 and out.count("embedding ") == 2, err
    warn = [line for line in err.splitlines() if "warning" in line]
    assert len(warn) == 1 and "text 2 of 2 has" in warn[0] and f"past the {trained} the model was trained on" \
        in warn[0], err
    code, out, err = embed("-p", "short")
    assert code == 0 and "warning" not in err, err
