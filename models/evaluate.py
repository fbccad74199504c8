"""Evaluate a trained TinyBitNet in torch (eval mode = the exact quantized math the engine runs).

    python models/evaluate.py                    # the shipped model: the sums table (every form) + samples
    python models/evaluate.py --model DIR        # an exported directory; --ckpt PATH: a trainer checkpoint

Addition accuracy is greedy-decoding accuracy computed in one teacher-forced pass per prompt: greedy
decoding reproduces an expected continuation exactly when the argmax at every position of that
continuation is the expected token, so "all argmaxes match" == "greedy output is the expected answer".
Expected answers are what the model was trained to say: bare form "<bos>a+b=" -> "{a+b}<|end_of_text|>",
chat forms (the rendered template, like `bitchat`, no system prompt; user text as in FORMS)
"... Assistant: " -> "a+b={a+b}." (the question restated with the numbers as written, checked through the
token after the sum, so the number is complete). Anything else counts as wrong (conservative).
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bitnet_cpu.models import corpus  # noqa: E402


# form name -> what the user types (None: the bare prompt "a+b=", continued by the sum and end of text)
FORMS = {
    "bare": None,
    "chat": "What is {a}+{b}?",
    "chat a+b": "{a}+{b}",
    "chat What is a + b?": "What is {a} + {b}?",
    "chat what's a plus b": "what's {a} plus {b}",
    "chat add a and b": "add {a} and {b}",
}


ALL_PAIRS = [(a, b) for a in range(100) for b in range(100)]
ONE_DIGIT = [(a, b) for a in range(10) for b in range(10)]


def addition_cases(tok, form: str, pairs=ALL_PAIRS):
    """[(a, b, prompt ids, expected continuation ids)] for `pairs` (default: all 10,000)."""
    out = []
    for a, b in pairs:
        s = a + b
        if FORMS[form] is None:
            prompt = tok.encode(f"{corpus.BOS}{a}+{b}=", add_special_tokens=False).ids
            want = tok.encode(f"{s}{corpus.EOS}", add_special_tokens=False).ids
        else:
            user = FORMS[form].format(a=a, b=b)
            prompt = tok.encode(corpus.render_chat([("User", user)], None) + "Assistant: ",
                                add_special_tokens=False).ids
            want = tok.encode(f"{a}+{b}={s}.", add_special_tokens=False).ids
        out.append((a, b, prompt, want))
    return out


@torch.no_grad()
def addition_accuracy(model, tok, form: str, batch: int = 500, pairs=ALL_PAIRS):
    """(accuracy over `pairs`, fn(subset of them) -> accuracy on it, [wrong (a, b, greedy text)])."""
    model.eval()
    groups = defaultdict(list)
    for case in addition_cases(tok, form, pairs):
        groups[(len(case[2]), len(case[3]))].append(case)
    ok: dict[tuple[int, int], bool] = {}
    wrong = []
    for (lp, lw), cases in sorted(groups.items()):
        for i in range(0, len(cases), batch):
            chunk = cases[i:i + batch]
            ids = torch.tensor([c[2] + c[3] for c in chunk])
            pred = model(ids[:, :-1])[:, lp - 1:].argmax(-1)          # predictions for the continuation
            want = ids[:, lp:]
            good = (pred == want).all(-1)
            for c, g, p in zip(chunk, good.tolist(), pred.tolist()):
                ok[(c[0], c[1])] = g
                if not g and len(wrong) < 50:
                    wrong.append((c[0], c[1], tok.decode(p)))
    acc = sum(ok.values()) / len(ok)

    def on(pairs) -> float:
        pairs = list(pairs)
        return sum(ok[p] for p in pairs) / max(1, len(pairs))
    return acc, on, wrong


def addition_table(model, tok, heldout_pairs, pairs=ALL_PAIRS) -> dict:
    """{form: {one_digit, all, heldout, wrong}}: exact greedy accuracy on the 100 pairs a, b < 10, on all
    10,000 pairs (or the sample `pairs`, which must contain the one-digit and held-out ones) and on the
    held-out training split, per form in FORMS."""
    table = {}
    for form in FORMS:
        acc, on, wrong = addition_accuracy(model, tok, form, pairs=pairs)
        table[form] = {"one_digit": on(ONE_DIGIT), "all": acc, "heldout": on(heldout_pairs),
                       "wrong": [list(w) for w in wrong[:10]]}
    return table


def table_markdown(table: dict) -> str:
    rows = ["| form (user types) | a, b < 10 (100 pairs) | all 10,000 pairs | held-out 200 pairs |", "|---|---|---|---|"]
    for form, r in table.items():
        shown = "`a+b=` (bare)" if FORMS[form] is None else "`" + FORMS[form].format(a="a", b="b") + "`"
        rows.append(f"| {shown} | {r['one_digit']:.0%} | {r['all']:.2%} | {r['heldout']:.1%} |")
    return "\n".join(rows)


SAMPLE_PROMPTS = [
    ("story", corpus.BOS + "Once upon a time"),
    ("story", corpus.BOS + "One day, a little fox named Pip"),
    ("bare", corpus.BOS + "2+3="),
    ("bare", corpus.BOS + "57+68="),
    ("chat", corpus.render_chat([("User", "Hello!")], None) + "Assistant: "),
    ("chat", corpus.render_chat([("User", "Who are you?")], "You are a helpful AI assistant.") + "Assistant: "),
    ("chat", corpus.render_chat([("User", "What is 23+45?")], None) + "Assistant: "),
    ("chat", corpus.render_chat([("User", "2+2")], None) + "Assistant: "),
    ("chat", corpus.render_chat([("User", "what's 12 plus 30")], None) + "Assistant: "),
    ("chat", corpus.render_chat([("User", "Tell me a story.")], None) + "Assistant: "),
]


@torch.no_grad()
def samples(model, tok, max_tokens: int = 120) -> list[dict]:
    model.eval()
    stop = tuple(tok.token_to_id(s) for s in (corpus.EOS, corpus.EOT))
    out = []
    for kind, text in SAMPLE_PROMPTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        gen = model.greedy(ids, max_tokens, stop=stop)
        out.append({"kind": kind, "prompt": text, "output": tok.decode(gen)})
    return out


def main(argv=None) -> int:
    import argparse

    from tokenizers import Tokenizer

    from bitnet_cpu.models import DEFAULT_MODEL_DIR
    from bitnet_cpu.models.bitnet_torch import TinyBitNet, TinyConfig

    ap = argparse.ArgumentParser(description="addition accuracy (every form) and samples of a trained model")
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR, help="exported directory (default: the shipped model)")
    ap.add_argument("--ckpt", default=None, help="checkpoint written by train.py (instead of --model)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one in --model)")
    ap.add_argument("--seed", type=int, default=1, help="the training seed (which 200 pairs were held out)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-samples", action="store_true")
    ap.add_argument("--quick", type=int, default=0, metavar="N",
                    help="only the one-digit pairs, the held-out ones and N random others (the 'all' column is then that sample)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.ckpt:
        ck = torch.load(args.ckpt, map_location="cpu")
        model = TinyBitNet(TinyConfig(**ck["config"]))
        model.load_state_dict(ck["state"])
    else:
        from bitnet_cpu.models.export import config_from_hf_dir, init_from_export
        model = init_from_export(TinyBitNet(config_from_hf_dir(args.model)), args.model)
    tok = Tokenizer.from_file(args.tokenizer or os.path.join(args.model, "tokenizer.json"))
    heldout = corpus.split_pairs(args.seed)[1]
    pairs = ALL_PAIRS
    if args.quick:
        import random
        pairs = sorted(set(ONE_DIGIT) | set(heldout) | set(random.Random(0).sample(ALL_PAIRS, args.quick)))
    table = addition_table(model, tok, heldout, pairs)
    print(table_markdown(table))
    for form, r in table.items():
        print(f"{form}: e.g. wrong: {r['wrong'][:6]}")
    for s in [] if args.no_samples else samples(model, tok):
        print(f"[{s['kind']}] {s['prompt']!r} -> {s['output']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
