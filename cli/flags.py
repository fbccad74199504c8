"""Flags shared by `bitnet run` and `bitchat` (and any later front end): model, context, threads, answer
length, system prompt and sampling, spelled as llama.cpp spells them, plus the parsing helper that answers an
unknown flag with the subcommand's own usage and a "did you mean" suggestion.

    add_model_args(p); add_context_args(p, n_predict_default=256); add_system_args(p); add_sampling_args(p)
    add_lookup_args(p)   # --draft-max / --lookup-ngram-min (also `bitnet serve`)
    args = parse_args_suggesting(parser, argv, subparsers={"run": run_parser, ...})

Values are only typed here; range checks stay with their users (SamplingParams.check, engine.api), so every
front end reports a bad value the same way.
"""
from __future__ import annotations

import argparse
import difflib
import sys

# llama.cpp's defaults, shared so `bitnet run --help` and `bitchat --help` show the same numbers
SAMPLING_DEFAULTS = {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
                     "repeat_last_n": 64}
UNTIL_END = -1   # -n -1: until the end of text or a full context (llama.cpp's meaning)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", metavar="MODEL", default=None,
                   help="a converted store, a GGUF file, an HF model directory, or a Hugging Face hub id "
                        "(REPO[:FILE][@REVISION]) already downloaded (default: the bundled model)%(default).0s")


def add_context_args(p: argparse.ArgumentParser, *, n_predict_default: int) -> None:
    p.add_argument("-n", "--n-predict", "--max-tokens", dest="n_predict", type=int, default=n_predict_default,
                   metavar="N", help="max tokens per answer (-1 = until the end of text or a full context)")
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=None, metavar="N",
                   help="context size in tokens (default: min(model's, 4096))%(default).0s")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default: all cores)%(default).0s")


def add_system_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None, metavar="TEXT",
                   help="system prompt (default: none)%(default).0s")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SAMPLING_DEFAULTS
    p.add_argument("--temp", "--temperature", dest="temp", type=float, default=d["temp"], metavar="T",
                   help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=d["top_k"], metavar="K", help="top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=d["top_p"], metavar="P", help="top-p (1 = off)")
    p.add_argument("--min-p", type=float, default=d["min_p"], metavar="P", help="min-p (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=d["repeat_penalty"], metavar="R",
                   help="repetition penalty (1 = off)")
    p.add_argument("--repeat-last-n", type=int, default=d["repeat_last_n"], metavar="N",
                   help="tokens the repetition penalty looks back at")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed; -1 or none: a random one (printed with -v)%(default).0s")


def add_lookup_args(p: argparse.ArgumentParser) -> None:
    """Prompt-lookup speculative decoding (engine/runtime/speculative.py; llama.cpp's spelling), shared by
    `bitnet run`, bitchat and `bitnet serve`; engine.runtime.speculative.lookup_from_flags reads them."""
    p.add_argument("--draft-max", type=int, default=None, metavar="K",
                   help="prompt-lookup speculative decoding: most draft tokens verified per pass, 0 = off "
                        "(default: off; --draft-max 4 is a good start on repetitive text; same output either way)%(default).0s")
    p.add_argument("--lookup-ngram-min", type=int, default=None, metavar="N",
                   help="prompt lookup: shortest repeated n-gram that proposes a draft (default: 2)%(default).0s")


def check_n_predict(n: int) -> str | None:
    """A one-line complaint about -n, or None when it is valid."""
    if n < UNTIL_END:
        return f"-n/--n-predict {n}: must be >= 0, or -1 for until the end of text or a full context"
    return None


# ---- unknown flags: the subcommand's usage and a suggestion -------------------------------------------------
def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings]


def suggestion(parser: argparse.ArgumentParser, word: str) -> str | None:
    """The option of `parser` closest to `word` (`--ctx-szie` -> `--ctx-size`), or None."""
    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        return None
    close = difflib.get_close_matches(flag, _option_strings(parser), n=1, cutoff=0.6)
    return close[0] if close else None


def reject_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """parser.error() (usage + one line, exit 2) naming the unrecognized arguments and a close flag."""
    msg = f"unrecognized arguments: {' '.join(extras)}"
    for word in extras:
        close = suggestion(parser, word)
        if close:
            msg += f" (did you mean {close}?)"
            break
    parser.error(msg)


def parse_args_suggesting(parser: argparse.ArgumentParser, argv: list[str] | None,
                          subparsers: dict[str, argparse.ArgumentParser] | None = None,
                          command_dest: str = "command") -> argparse.Namespace:
    """parse_args, except that unknown arguments are reported by the subcommand they were given to."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = (subparsers or {}).get(getattr(args, command_dest, None) or "")
        reject_unknown(sub or parser, extras)
    return args


def maybe_autocomplete(parser: argparse.ArgumentParser) -> None:
    """Shell completion through argcomplete, only when a shell asks for it (no import cost otherwise).
    Enable with: eval "$(register-python-argcomplete bitnet)" (and the same for bitchat)."""
    import os

    if "_ARGCOMPLETE" not in os.environ:
        return
    try:
        import argcomplete
    except ImportError:  # pragma: no cover - argcomplete is a dependency
        sys.exit(1)
    argcomplete.autocomplete(parser)


# ---- text that must be UTF-8 (prompts, piped chat lines) -----------------------------------------------------
