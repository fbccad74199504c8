"""`bitnet inspect FILE`: what is in a model file (weight store, GGUF, or HF directory): architecture,
dimensions, tensor table, tokenizer, chat template, and the ternary share of -1/0/+1 with the scale."""
from __future__ import annotations

import os

HELP = "print what a model file holds (store, GGUF or HF directory)"


def add_arguments(p):
    p.add_argument("file", metavar="FILE", help="weight store, GGUF file or HF model directory")
    p.add_argument("--tensors", type=int, default=None, metavar="N",
                   help="show at most N rows of the tensor table (default: all)%(default).0s")


def main(args) -> int:
    from ..engine.errors import BitNetError
    from ..engine.formats.describe import describe

    if args.tensors is not None and args.tensors < 0:   # -1 printed all but one row, then "... 14 more" of 13
        raise BitNetError(f"--tensors {args.tensors}: must be 0 or more (leave it out for every row)")

    # all of it first: a file that fails part-way (missing, a tensor type not supported) is one error line, not
    # half a description then the error
    lines = [*describe(os.fspath(args.file), max_tensors=args.tensors)]
    print("\n".join(lines))
    return 0
