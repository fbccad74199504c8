"""The bundled model's one-digit sums, through the engine (no torch): every pair a, b in 0..9, exact, greedy.

Forms: the bare prompt `a+b=` (continued by the sum), and the chat questions people type first,
`a+b`, `what's a plus b`, `What is a + b?`, `add a and b`, each answered by restating the question with
the numbers as written: `a+b=s.`. The full table over all 10,000 pairs is a benchmark
(`python models/evaluate.py`, models/README.md), not a test.

Every form must be exact on all 100 pairs (reached by phase 9, models/README.md; before it the bare chat
question `a+b` missed `0+0`, `1+5`, `1+6`). The old `What is a+b?` phrasing is checked too.
"""
import re

import pytest

from bitnet_cpu.engine.api import SamplingParams, load_model
from bitnet_cpu.models import DEFAULT_STORE

CHAT_FORMS = ["{a}+{b}", "what's {a} plus {b}", "What is {a} + {b}?", "add {a} and {b}", "What is {a}+{b}?"]
PAIRS = [(a, b) for a in range(10) for b in range(10)]
GREEDY = SamplingParams(temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def llm():
    m = load_model(DEFAULT_STORE, threads=2, ctx=128, progress=False)
    yield m
    m.close()


def _answer(llm, prompt, max_tokens: int) -> str:
    return "".join(c.text for c in llm.generate(prompt, GREEDY, max_tokens=max_tokens))


def test_one_digit_sums_bare(llm):
    wrong = []
    for a, b in PAIRS:
        out = _answer(llm, f"{a}+{b}=", 4)
        if not re.match(rf"{a + b}(\D|$)", out):
            wrong.append((f"{a}+{b}=", out))
    assert not wrong, wrong


@pytest.mark.parametrize("form", CHAT_FORMS)
def test_one_digit_sums_chat(llm, form):
    wrong = []
    for a, b in PAIRS:
        ids = llm.chat_prompt([{"role": "user", "content": form.format(a=a, b=b)}])
        out = _answer(llm, ids, 10).strip()
        if not re.match(rf"{a}\+{b}={a + b}(\D|$)", out):
            wrong.append((form.format(a=a, b=b), out))
    assert not wrong, wrong
