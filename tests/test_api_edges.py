"""The Python API's edges a developer meets: arguments refused as the server refuses them, in the Python names
(a DRY breaker that is not text, an empty stop string, embed's normalize, a tool grammar's thought / parallel), a
copy that says it is no copy, and a callback that raises on its final chunk said so on stderr. The bundled model,
in process."""
from __future__ import annotations

import copy
import pickle

import pytest

from bitnet_cpu.engine.api import BitNetError, ConstraintError, SamplingParams, load_engine, load_model

PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def llm():
    with load_model(ctx=256, progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def eng():
    with load_engine(ctx=256, parallel=2, progress=False) as e:
        yield e


def test_a_dry_breaker_that_is_not_text_is_one_error_at_the_call(llm, eng):
    """A lone surrogate in dry_sequence_breakers was a raw UnicodeEncodeError from LLM.generate and Engine.submit;
    the engine still serves after it."""
    sp = SamplingParams(temperature=0, dry_multiplier=1, dry_sequence_breakers=["\n", "\ud83d"])
    for call in (lambda: llm.generate(PROMPT, sp, max_tokens=4), lambda: eng.submit(PROMPT, sp, max_tokens=4)):
        with pytest.raises(BitNetError, match=r"dry_sequence_breakers\[1\]: a lone UTF-16 surrogate"):
            call()
    assert list(eng.submit(PROMPT, GREEDY, max_tokens=2))[-1].finish_reason == "length"


@pytest.mark.parametrize("stop", [[""], ["x", ""], ""])
def test_an_empty_stop_string_is_refused_as_the_http_apis_refuse_it(llm, eng, stop):
    """It never matched, in silence; every HTTP API but llama-server's /completion answers it with a 400."""
    for call in (lambda: llm.generate(PROMPT, GREEDY, stop=stop), lambda: eng.submit(PROMPT, GREEDY, stop=stop)):
        with pytest.raises(BitNetError, match="stop: an empty stop string"):
            call()


@pytest.mark.parametrize("value", [2.0, True, -2])
def test_embed_names_its_normalize_argument(llm, eng, value):
    """The errors named embd_normalize, the server's field, not the argument the caller passed."""
    for call in (lambda: llm.embed("x", normalize=value), lambda: eng.embed("x", normalize=value)):
        with pytest.raises(BitNetError, match=r"^normalize ") as e:
            call()
        assert "embd_normalize" not in str(e.value)


def test_a_copy_is_refused_in_words_of_a_copy(llm, eng):
    """copy.copy / copy.deepcopy said "cannot cross processes" though nothing crossed one; pickling still says
    that."""
    for obj, kind in ((llm, "an LLM"), (eng, "an Engine")):
        for how in (copy.copy, copy.deepcopy):
            with pytest.raises(BitNetError, match=f"^{kind} cannot be copied") as e:
                how(obj)
            assert "process" not in str(e.value)
        with pytest.raises(BitNetError, match=f"^{kind} cannot cross processes"):
            pickle.dumps(obj)
    assert "".join(c.text for c in llm.generate(PROMPT, GREEDY, max_tokens=2))   # both still work
    assert list(eng.submit(PROMPT, GREEDY, max_tokens=2))[-1].finish_reason == "length"


def test_a_tool_grammar_s_bad_thought_or_parallel_is_a_constraint_error(llm):
    """tool_format().constraint is the documented Python route for tools: a bad thought was a raw ValueError, and
    parallel="no" was taken as true (several calls allowed)."""
    fmt = llm.tool_format()
    with pytest.raises(ConstraintError, match="thought 'x': None, 'may' or 'open'"):
        fmt.constraint(TOOLS, "auto", False, thought="x")
    with pytest.raises(ConstraintError, match="parallel 'no': True or False"):
        fmt.constraint(TOOLS, "auto", "no")
    assert fmt.constraint(TOOLS, "required", False) is not None


def test_a_callback_raising_on_the_final_chunk_is_said_on_stderr(capfd):
    """It was swallowed without a word (one raising on an earlier chunk is said, and cancels its request): a bug in
    the code that sets a future on the final chunk left its awaiter waiting in silence. The engine still serves."""
    def on_chunk(chunk):
        if chunk.finish_reason:
            raise ValueError("bug in the final handler")
    with load_engine(ctx=128, parallel=2, progress=False) as e:
        s = e.submit(PROMPT, GREEDY, max_tokens=3, callback=on_chunk)
        assert list(e.submit(PROMPT, GREEDY, max_tokens=2))[-1].finish_reason == "length"
    # close() joined the scheduler thread: the callback has run
    err = capfd.readouterr().err
    assert f"stream {s.id}: callback raised ValueError('bug in the final handler') on the final chunk (length)" \
        in err, err


STORY = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]


def test_chat_prompt_continues_a_final_assistant_message_as_the_server_does(llm, eng):
    """The server continues a final assistant message by default (llama-server's rule); chat_prompt closed it and
    opened a second assistant turn, so the same messages gave another prompt and answer in Python.
    continue_final_message=False is that old rendering; what the server refuses is one BitNetError."""
    for m in (llm, eng):
        assert m.chat_prompt(STORY) == m.chat_prompt(STORY[:1], prefill="Once upon")
        assert m.chat_prompt(STORY, prefill=" a") == m.chat_prompt(STORY[:1], prefill="Once upon a")
        assert m.chat_text(STORY).endswith("Once upon")
    closed = llm.chat_prompt(STORY, continue_final_message=False)
    assert closed[:len(llm.chat_prompt(STORY, add_generation_prompt=False))] == \
        llm.chat_prompt(STORY, add_generation_prompt=False) != closed   # closed, then a new turn opened
    # no generation prompt asked: rendered as it is (the server's add_generation_prompt false continues only with
    # continue_final_message); True continues whatever add_generation_prompt says
    assert llm.chat_text(STORY, add_generation_prompt=False).startswith(llm.chat_text(STORY))
    assert llm.chat_prompt(STORY, add_generation_prompt=False, continue_final_message=True) == llm.chat_prompt(STORY)
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    assert llm.chat_prompt(STORY[:1] + [call], tools=TOOLS)   # tool calls are no text to continue: a new turn
    for kw, words in (({"messages": STORY + [{"role": "assistant", "content": "x"}]}, "two assistant messages"),
                      ({"messages": STORY[:1], "continue_final_message": True}, "not an assistant's text"),
                      ({"messages": STORY, "continue_final_message": "no"}, "continue_final_message 'no'")):
        with pytest.raises(BitNetError, match=words):
            llm.chat_prompt(**kw)
    assert llm.chat_prompt(STORY + [{"role": "assistant", "content": "x"}], continue_final_message=False)
