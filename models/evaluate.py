"""Evaluate a trained TinyBitNet in torch (eval mode = the exact quantized math the engine runs).

    python models/evaluate.py [--ckpt PATH]      # addition accuracy over all 10,000 pairs + samples

Addition accuracy is greedy-decoding accuracy computed in one teacher-forced pass per prompt: greedy
decoding reproduces an expected continuation exactly when the argmax at every position of that
continuation is the expected token, so "all argmaxes match" == "greedy output is the expected answer".
Expected answers are what the model was trained to say: bare form "<bos>a+b=" -> "{a+b}<|end_of_text|>",
chat form (the rendered template, like `bitchat`) "... Assistant: " -> "a+b={a+b}." (checked through the
token after the sum, so the number is complete). Anything else counts as wrong (conservative).
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import corpus  # noqa: E402


def addition_cases(tok, form: str):
    """[(a, b, prompt ids, expected continuation ids)] for all 10,000 pairs."""
    out = []
    for a in range(100):
        for b in range(100):
            s = a + b
            if form == "bare":
                prompt = tok.encode(f"{corpus.BOS}{a}+{b}=", add_special_tokens=False).ids
                want = tok.encode(f"{s}{corpus.EOS}", add_special_tokens=False).ids
            else:
                prompt = tok.encode(corpus.render_chat([("User", f"What is {a}+{b}?")], None) + "Assistant: ",
                                    add_special_tokens=False).ids
                want = tok.encode(f"{a}+{b}={s}.", add_special_tokens=False).ids
            out.append((a, b, prompt, want))
    return out


@torch.no_grad()
def addition_accuracy(model, tok, form: str, batch: int = 500):
    """(accuracy over all pairs, fn(subset of pairs) -> accuracy on it, [wrong (a, b, greedy text)])."""
    model.eval()
    groups = defaultdict(list)
    for case in addition_cases(tok, form):
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


SAMPLE_PROMPTS = [
    ("story", corpus.BOS + "Once upon a time"),
    ("story", corpus.BOS + "One day, a little fox named Pip"),
    ("bare", corpus.BOS + "2+3="),
    ("bare", corpus.BOS + "57+68="),
    ("chat", corpus.render_chat([("User", "Hello!")], None) + "Assistant: "),
    ("chat", corpus.render_chat([("User", "Who are you?")], "You are a helpful AI assistant.") + "Assistant: "),
    ("chat", corpus.render_chat([("User", "What is 23+45?")], None) + "Assistant: "),
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

    from models import DEFAULT_MODEL_DIR
    from models.bitnet_torch import TinyBitNet, TinyConfig

    ap = argparse.ArgumentParser(description="addition accuracy and samples of a trained checkpoint")
    ap.add_argument("--ckpt", required=True, help="checkpoint written by train.py")
    ap.add_argument("--tokenizer", default=os.path.join(DEFAULT_MODEL_DIR, "tokenizer.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ck = torch.load(args.ckpt, map_location="cpu")
    model = TinyBitNet(TinyConfig(**ck["config"]))
    model.load_state_dict(ck["state"])
    tok = Tokenizer.from_file(args.tokenizer)
    for form in ("bare", "chat"):
        acc, _, wrong = addition_accuracy(model, tok, form)
        print(f"addition accuracy ({form} form, all 10,000 pairs): {acc:.4f}; e.g. wrong: {wrong[:5]}")
    for s in samples(model, tok):
        print(f"[{s['kind']}] {s['prompt']!r} -> {s['output']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
