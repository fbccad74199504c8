"""GBNF grammars: our converter (engine/runtime/gbnf.py) against llguidance's own (llguidance.gbnf_to_lark), on
one tokenizer: compile time, and the mask time per token while a valid text is fed token by token.

    python bench/bench_gbnf.py [-m MODEL] [--grammars DIR]

MODEL: a store, GGUF or HF directory (default: the bundled model; the 2B-4T store of `python bench/make_models.py
--heads q4 --no-f16`, bench/cache/2b4t.q4.bnstore, has the 128k vocabulary the numbers in
docs/structured-output.md come from). DIR: llama.cpp's grammars/ (default: the one vendored in the
llama-cpp-python sdist under bench/cache/src). llguidance's converter misreads some grammars (its lexemes are
greedy): a text it refuses prints "refused" in its row, not a time (only each token's admission is checked,
not that the text completes the grammar).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

SAMPLES = {   # a text each grammar takes
    "json.gbnf": json.dumps({"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "hello world"],
                             "nested": {"x": 1.5, "y": [1, 2, 3], "z": None, "ok": True}}, indent=1),
    "english.gbnf": "The cat sat on the mat. It was happy and warm today.",
    "arithmetic.gbnf": "12+ab*(3-4) = 77\nx=y\n",
    "per-character [^\\n]+": "((A: the quick brown fox, jumps. over.))",
}
EXTRA = {"per-character [^\\n]+": 'root ::= "A: " ans "." | "(" root ")"\nans ::= [^\\n]+'}


def masks(llm, spec, text):
    """(compile ms, [mask ms per token]) or (compile ms, None) when the compiled grammar refuses the text."""
    t = time.perf_counter()
    tm = llm.compile_constraint(spec).matcher()
    compile_ms = (time.perf_counter() - t) * 1e3
    logits = np.zeros(llm.config.vocab_size, np.float32)
    out = []
    for tok in llm.tokenize(text, add_bos=False):
        t = time.perf_counter()
        tm.apply(logits.copy())
        out.append((time.perf_counter() - t) * 1e3)
        if tm.valid_prefix([tok]) != [tok]:
            return compile_ms, None
        tm.advance(tok)
    return compile_ms, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--grammars", default=None)
    args = ap.parse_args(argv)
    from llguidance.gbnf_to_lark import gbnf_to_lark as theirs

    from bitnet_cpu.engine.api import Constraint, ConstraintError, load_model
    gdir = args.grammars or next(iter(glob.glob(os.path.join(HERE, "cache", "src", "*", "vendor", "llama.cpp",
                                                             "grammars"))), None)
    grammars = dict(EXTRA)
    for name in SAMPLES:
        if gdir and os.path.isfile(os.path.join(gdir, name)):
            grammars[name] = open(os.path.join(gdir, name)).read()
    llm = load_model(args.model, threads=1, progress=False, mmap=True)
    llm.compile_constraint(Constraint.gbnf('root ::= "x"'))   # the tokenizer's setup, not counted below
    print(f"vocabulary {llm.config.vocab_size}; grammars from {gdir or '(none found: only the built-in one)'}")
    for name, g in grammars.items():
        for label, spec in (("ours", lambda: Constraint.gbnf(g)), ("llguidance's", lambda: Constraint.lark(theirs(g)))):
            try:
                c_ms, ms = masks(llm, spec(), SAMPLES[name])
            except (ConstraintError, Exception) as e:   # noqa: B014 (their converter raises its own errors)
                print(f"{name:22s} {label:13s} refused: {str(e)[:80]}")
                continue
            if ms is None:
                print(f"{name:22s} {label:13s} compile {c_ms:7.1f} ms   refused the sample text")
                continue
            print(f"{name:22s} {label:13s} compile {c_ms:7.1f} ms   mask median {np.median(ms):6.2f} ms  "
                  f"p90 {np.percentile(ms, 90):6.2f} ms  ({len(ms)} tokens)")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
