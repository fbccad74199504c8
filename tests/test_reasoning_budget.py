"""The reasoning budget (llama.cpp's --reasoning-budget; engine/runtime/reasoning.py ThoughtBudget): after N tokens
inside the answer's <think> block, the next tokens are the budget message and the closing tag, whatever the
model would have said, and the answer goes on from there. A thought that closes in time, an answer that never
opens one, and a grammar that forbids the end are left alone. The single-stream generator and the batching
engine give the same tokens. On the bundled model, greedy, in process."""
from __future__ import annotations

import pytest

from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model
from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.runtime.reasoning import BUDGET_END, ThoughtBudget

HEAD = "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def llm():
    return load_model(ctx=256, progress=False)


def run(llm, prompt: str, max_tokens=30, constraint=None, **params):
    ids = llm.tokenize(prompt, add_bos=True)
    toks = [c.token for c in llm.generate(ids, SamplingParams(temperature=0, **params), max_tokens=max_tokens,
                                          ignore_eos=True, constraint=constraint) if c.token is not None]
    return toks


def test_the_thought_is_cut_after_n_tokens_and_closed(llm):
    free = run(llm, HEAD + "<think>\n")
    end = llm.tokenize(BUDGET_END)
    for n in (0, 1, 5):
        got = run(llm, HEAD + "<think>\n", reasoning_budget=n)
        assert got[:n] == free[:n]                       # the thought as the model wrote it, up to the budget
        assert got[n:n + len(end)] == end                # then its end, forced
        assert llm.detokenize(got[:n + len(end)]).count("</think>") == 1
    msg = run(llm, HEAD + "<think>\n", reasoning_budget=3, reasoning_budget_message=" Enough.")
    forced = llm.tokenize(" Enough." + BUDGET_END)
    assert msg[:3] == free[:3] and msg[3:3 + len(forced)] == forced
    assert run(llm, HEAD + "<think>\n", reasoning_budget=-1) == free


def test_a_thought_the_model_opens_itself_counts_from_there(llm):
    """The prompt does not open the thought; a grammar makes the answer start with <think> and then lets the
    model write freely: the budget counts from the token that completes the tag."""
    from bitnet_cpu.engine.runtime.constraints import Constraint
    g = Constraint.gbnf('root ::= "<think>\\n" [^\\x00]*')
    free = run(llm, HEAD, constraint=g)
    opened = len(llm.tokenize("<think>"))
    assert llm.detokenize(free[:opened]) == "<think>"
    got = run(llm, HEAD, constraint=g, reasoning_budget=4)
    end = llm.tokenize(BUDGET_END)
    assert got[:opened + 4] == free[:opened + 4] and got[opened + 4:opened + 4 + len(end)] == end


def test_what_the_budget_leaves_alone(llm):
    from bitnet_cpu.engine.runtime.constraints import Constraint
    # an answer that does not start with a thought
    assert run(llm, HEAD, reasoning_budget=0) == run(llm, HEAD)
    # a thought that closes within the budget (a grammar writes it)
    g = Constraint.gbnf('root ::= "<think>\\nI add.\\n</think>\\n\\n" [^\\x00]*')
    assert run(llm, HEAD, constraint=g, reasoning_budget=40) == run(llm, HEAD, constraint=g)
    # a grammar that forbids the forced end: the grammar's output, as without a budget
    g = Constraint.gbnf('root ::= "I add 2 and 3, and the sum is five." [^\\x00]*')
    assert run(llm, HEAD + "<think>\n", constraint=g, reasoning_budget=2) == run(llm, HEAD + "<think>\n", constraint=g)
    # ... also when it allows the end's first token but not the rest (a newline, then no "</think>"): nothing of
    # the end is written
    g = Constraint.gbnf('root ::= "<think>\\n" [a-zA-Z .,\\n]*')
    assert run(llm, HEAD, constraint=g, reasoning_budget=3) == run(llm, HEAD, constraint=g)
    # a grammar that decides how the answer starts makes its output the answer though the prompt opened a thought
    # (engine.api think_splitter's rule): no thought to cut
    g = Constraint.gbnf('root ::= [^\\x00]*')
    assert run(llm, HEAD + "<think>\n", constraint=g, reasoning_budget=3) == run(llm, HEAD + "<think>\n", constraint=g)


def test_the_batching_engine_gives_the_same_tokens(llm):
    want = run(llm, HEAD + "<think>\n", reasoning_budget=5, reasoning_budget_message=" Stop.")
    eng = load_engine(ctx=256, parallel=2, progress=False)
    try:
        ids = llm.tokenize(HEAD + "<think>\n", add_bos=True)
        params = SamplingParams(temperature=0, reasoning_budget=5, reasoning_budget_message=" Stop.")
        streams = eng.submit_n(ids, params, 2, max_tokens=30, ignore_eos=True)
        for s in streams:
            assert [c.token for c in s if c.token is not None] == want
    finally:
        eng.close()


def test_the_end_waits_for_a_character_cut_in_two(llm):
    """A budget that runs out inside a character made of several byte tokens ends after the character."""
    tok = llm.tokenizer
    text = "\U0001d518\U0001d518"   # a 4-byte character: byte tokens in a small vocabulary
    ids = tok.encode(text, add_bos=False)
    if len(ids) < 3:
        pytest.skip("this tokenizer writes the character in fewer than 3 tokens: no cut to test")
    forced = tok.encode(BUDGET_END, add_bos=False)
    budget = ThoughtBudget(None, tok, 1, forced, opened=True)
    stream, seen = tok.stream(), []
    for t in ids:
        budget.advance(t)
        seen.append((stream.push(t), budget.state))
    # the state turns to "force" only on a token that ends a character, never while one is pending
    for i, (piece, state) in enumerate(seen):
        if state == "force":
            assert piece, (i, seen)
            break
    else:
        pytest.fail(f"the budget never ran out: {seen}")


def test_bad_budgets_are_refused():
    for bad in (-2, 1.5, True):
        with pytest.raises(BitNetError, match="reasoning_budget"):
            SamplingParams(reasoning_budget=bad).check()
    with pytest.raises(BitNetError, match="reasoning_budget_message"):
        SamplingParams(reasoning_budget_message=3).check()
