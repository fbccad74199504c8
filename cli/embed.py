"""`bitnet embed`: sentence embeddings of one or more texts, as llama.cpp's `llama-embedding` prints them.

    bitnet embed -p "Hello World!"                                   # the vector, then nothing else
    bitnet embed -p $'a cat\na dog\na car' --embd-output-format json+ # OpenAI-style JSON and the cosine matrix
    bitnet embed -f lines.txt --embd-output-format raw > vectors.txt  # one vector a line, space separated

The texts are the prompt (-p, or -f FILE; '-' reads stdin) cut at --embd-separator (a newline by default; a file's
final newline ends its last text rather than starting an empty one). Each runs with BOS through the model and is
pooled (--pooling: mean of every token, the last token's, or none: every token's own vector, as it is) and
normalised (--embd-normalize, llama.cpp's norms; under none only when given, each row as llama-embedding), the
numbers `bitnet serve` answers (engine/runtime/embed.py); the texts run together through the batching engine.
Vectors go to stdout in llama-embedding's formats; a one-line summary goes to stderr.
"""
HELP = ("print sentence embeddings of texts (llama-embedding's poolings, norms and output formats: plain, array, "
        "json, json+, raw)")

FORMATS = ("", "array", "json", "json+", "raw")


def add_arguments(p):
    from .flags import add_model_args
    add_model_args(p)
    p.add_argument("-p", "--prompt", default=None, metavar="TEXT",
                   help="the texts, cut at --embd-separator%(default).0s")
    p.add_argument("-f", "--file", default=None, metavar="FILE", help="read the texts from FILE ('-': stdin)%(default).0s")
    p.add_argument("-e", "--escape", dest="escape", action="store_true", default=True,
                   help="process escapes (\\n \\r \\t \\' \\\" \\\\ \\xHH) in -p, as llama-embedding does: -p 'a\\nb' is two "
                        "texts (on; a file's text is taken as it is)%(default).0s")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take -p as typed%(default).0s")
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=None, metavar="N",
                   help="the most tokens of one text (default: the model's trained context, 2048 to 4096)%(default).0s")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default, 0 or less too, as llama.cpp: one per physical core, or "
                        "$OMP_NUM_THREADS)%(default).0s")
    p.add_argument("--pooling", default="mean", metavar="{mean,last,none}",
                   help="a text's vector: the mean of its tokens' final states, the last token's, or none: one "
                        "vector per token")
    p.add_argument("--embd-normalize", dest="embd_normalize", type=int, default=2, metavar="N",
                   help="-1 none, 0 max-absolute scaled to int16, 1 taxicab, 2 Euclidean, >2 p-norm (llama.cpp's)")
    p.add_argument("--embd-separator", dest="embd_separator", default="\n", metavar="SEP",
                   help="what separates the texts (default: a newline)%(default).0s")
    p.add_argument("--embd-output-format", dest="embd_output_format", default="", choices=FORMATS,
                   metavar="{,array,json,json+,raw}",
                   help="empty: llama-embedding's listing (and the cosine similarity matrix for several texts); "
                        "array: [[...],...]; json: OpenAI's list object; json+: json and the cosine similarities; "
                        "raw: one vector a line")


def texts_of(args) -> list[str]:
    """The texts of -p / -f cut at the separator, or BitNetError (none given, both given, an empty one)."""
    from ..engine.errors import BitNetError
    from .flags import escaped, read_text_file
    if (args.prompt is None) == (args.file is None):
        raise BitNetError("give the texts as -p TEXT or -f FILE" if args.prompt is None else
                          "-p and -f: give the texts one way")
    if not args.embd_separator:
        raise BitNetError("--embd-separator: must not be empty")
    text = escaped(args, args.prompt, "-p/--prompt") if args.prompt is not None else read_text_file(args.file)
    texts = text.split(args.embd_separator)
    if args.file is not None and len(texts) > 1 and texts[-1] == "":
        texts.pop()   # the file's final newline
    empty = [i for i, t in enumerate(texts) if not t]
    if empty:
        raise BitNetError(f"text {empty[0] + 1} of {len(texts)} is empty: nothing to embed",
                          hint="remove the empty line, or choose another --embd-separator")
    return texts


def _cos_matrix(vectors):
    """Every pair's cosine similarity, as one product (the pairs one by one in Python took 20 s for 1,000 texts,
    minutes for 3,000); llama.cpp's common_embd_similarity_cos: two zero vectors are alike, one is not."""
    import numpy as np
    m = np.asarray(vectors, np.float64)
    n = np.sqrt(np.einsum("ij,ij->i", m, m))
    with np.errstate(divide="ignore", invalid="ignore"):
        sim = (m @ m.T) / np.outer(n, n)
    zero = n == 0
    sim[zero[:, None] | zero[None, :]] = 0.0
    sim[zero[:, None] & zero[None, :]] = 1.0
    return sim


def render(vectors, texts: list[str], fmt: str, normalize: int, pooled: bool) -> str:
    """llama-embedding's stdout for the vectors (one per text, or per token when not pooled)."""
    num = "%6.0f " if normalize == 0 else "%9.6f "
    fine = "%1.0f" if normalize == 0 else "%1.7f"
    lines = []
    if fmt == "":
        lines.append("")
        if not pooled:
            for j, v in enumerate(vectors):
                head, tail = v[:3], v[-3:] if len(v) >= 3 else v
                lines.append(f"embedding {j}: " + "".join(num % x for x in head) + " ... "
                             + "".join(num % x for x in tail))
        else:
            width = min(16, len(vectors[0])) if len(vectors) > 1 else len(vectors[0])
            for j, v in enumerate(vectors):
                lines.append(f"embedding {j}: " + "".join(num % x for x in v[:width]))
            if len(vectors) > 1:
                lines += ["", "cosine similarity matrix:", "", "".join("%6.6s " % t for t in texts)]
                for i, row in enumerate(_cos_matrix(vectors)):
                    lines.append("".join("%6.2f " % x for x in row) + texts[i][:10])
        return "\n".join(lines) + "\n"
    if fmt == "raw":
        return "".join(" ".join(fine % x for x in v) + "\n" for v in vectors)
    body = [("[" + ",".join(fine % x for x in v) + "]") for v in vectors]
    if fmt == "array":
        return "[" + ",".join(body) + "]\n"
    items = [f'    {{\n      "object": "embedding",\n      "index": {j},\n      "embedding": {b}\n    }}'
             for j, b in enumerate(body)]
    out = '{\n  "object": "list",\n  "data": [\n' + ",\n".join(items) + "\n  ]"
    if fmt == "json+" and len(texts) > 1:   # llama-embedding's: over several texts (not one text's tokens)
        rows = ["    [" + ", ".join("%6.2f" % x for x in row) + " ]" for row in _cos_matrix(vectors)]
        out += ',\n  "cosineSimilarity": [\n' + ",\n".join(rows) + "\n  ]"
    return out + "\n}\n"


def main(args) -> int:
    import sys
    import time

    from ..engine.api import load_engine
    from ..engine.formats.convert import stderr_is_terminal
    import numpy as np

    from ..engine.runtime.embed import check_normalize, check_pooling, normalized
    from . import write_stdout
    from .flags import auto_threads, given
    check_pooling(args.pooling, "--pooling")
    normalize = check_normalize(args.embd_normalize, "--embd-normalize")
    # none: every token's row as it is, the numbers of the server's /embedding and LLM.embed; a norm given here
    # normalises each row, as llama-embedding does (the server and LLM.embed refuse one)
    row_norm = normalize if args.pooling == "none" and given(args, "--embd-normalize", 2) else None
    texts = texts_of(args)
    pooled = args.pooling != "none"
    eng = load_engine(args.model, ctx=args.ctx, threads=auto_threads(args.threads), parallel=min(16, len(texts)),
                      progress=stderr_is_terminal(), pooling=args.pooling, embd_normalize=normalize)
    try:
        for w in eng.warnings:   # a default context past the trained one bounds only the longest text here
            if args.ctx is not None or not w.startswith("context "):
                print(f"bitnet: warning: {w}", file=sys.stderr)
        t0 = time.perf_counter()
        ids = eng.embed_tokens(texts)
        trained = eng.config.context_length
        long = [i for i, t in enumerate(ids) if len(t) > trained]
        if long and args.ctx is None:   # the default context is past the trained one: say where it mattered
            i, more = long[0], f" (and {len(long) - 1} more)" if len(long) > 1 else ""
            print(f"bitnet: warning: text {i + 1} of {len(ids)}{more} has {len(ids[i])} tokens, past the {trained} the model was trained on: its embedding may be "
                  f"garbage (-c {trained} refuses such texts)", file=sys.stderr)
        got = eng.embed_ids(ids)
        took = time.perf_counter() - t0
    finally:
        eng.close()
    vectors = list(got) if pooled else [row for rows in got for row in rows]
    if row_norm is not None:
        vectors = [normalized(row.astype(np.float64), row_norm) for row in vectors]
    write_stdout(render(vectors, texts, args.embd_output_format, normalize, pooled))
    n_tok = sum(len(t) for t in ids)
    print(f"embed: {len(texts)} text{'s' * (len(texts) != 1)}, {n_tok} tokens, {len(vectors[0])} dimensions, "
          f"pooling {args.pooling}, in {took:.2f} s ({n_tok / max(took, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0
