"""The Python API's chat messages and tools checked as `bitnet serve` checks them: a malformed assistant call, a
call or a function_call on another role, a tool result that answers no call, `content: []`, a tool list that
cannot be a tool list -- one BitNetError naming the field, never an AttributeError / KeyError from inside, nor a
prompt that differs from the history given. What the server takes (a call cut at max_tokens sent back, the legacy
function_call as that message's one call) renders. The bundled model, in process; the server's checks are read
from its request schemas (no server is started)."""
from __future__ import annotations

import json

import pytest

from bitnet_cpu.engine.api import BitNetError, load_model

U = {"role": "user", "content": "a"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# a template that renders tools and calls itself (engine/runtime/tools.py's native path)
NATIVE = ('{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}'
          '{% set f = c.function if c.function is defined else c %}<tool_call>\n'
          '{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}\n</tool_call>'
          '{% endfor %}\n{% endfor %}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}')


@pytest.fixture(scope="module")
def llm():
    with load_model(ctx=128, progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def native():
    with load_model(ctx=128, progress=False) as m:
        m.set_chat_template(NATIVE)
        assert m.tool_format().template_renders_tools
        yield m


def _assistant(**kw):
    return {"role": "assistant", "content": None, **kw}


MALFORMED_CALLS = [   # (tool_calls, the field the error names)
    ("x", r"messages\[1\]\.tool_calls"),
    ({"id": "1"}, r"messages\[1\]\.tool_calls"),
    ([5], r"messages\[1\]\.tool_calls\[0\]"),
    ([None], r"messages\[1\]\.tool_calls\[0\]"),
    ([{}], r"messages\[1\]\.tool_calls\[0\]"),
    ([{"id": "1", "type": "function"}], r"messages\[1\]\.tool_calls\[0\]"),
    ([{"id": "1", "type": "function", "function": "f"}], r"messages\[1\]\.tool_calls\[0\]\.function"),
    ([{"id": "1", "type": "function", "function": {"arguments": "{}"}}], r"messages\[1\]\.tool_calls\[0\]\.function"),
    ([{"id": "1", "type": "function", "function": {"name": 5}}], r"messages\[1\]\.tool_calls\[0\]\.function"),
    ([{"id": "1", "type": "function", "function": {"name": "f", "arguments": [1]}}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
    ([{"id": "1", "type": "function", "function": {"name": "f", "arguments": 5}}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
    ([{"id": "1", "type": "bogus", "function": {"name": "f"}}], r"messages\[1\]\.tool_calls\[0\]\.type"),
    ([{"id": 5, "type": "function", "function": {"name": "f"}}], r"messages\[1\]\.tool_calls\[0\]\.id"),
]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("calls, where", MALFORMED_CALLS)
def test_a_malformed_assistant_call_is_one_error_naming_it(llm, native, calls, where, tools):
    """These were AttributeError ('str' object has no attribute 'get') or KeyError ('name') from
    engine/runtime/tools.py, or went into the prompt as written (arguments [1], a name 5)."""
    msgs = [U, _assistant(tool_calls=calls)]
    for model in (llm, native):
        for call in (model.chat_prompt, model.chat_text):
            with pytest.raises(BitNetError, match=where) as e:
                call(msgs, tools=tools)
            assert "\n" not in str(e.value)


REFUSED = [   # (messages, the field the error names): what the server's chat endpoint answers 400 for
    ([U, {"role": "user", "content": "b", "function_call": {"name": "f"}}], r"messages\[1\]\.function_call"),
    ([U, _assistant(tool_calls=[CALL], function_call={"name": "f"})], r"messages\[1\]\.function_call"),
    ([U, _assistant(function_call="f")], r"messages\[1\]\.function_call"),
    ([U, _assistant(function_call={"name": "f", "arguments": 5})], r"messages\[1\]\.function_call\.arguments"),
    ([U, _assistant(tool_calls=[CALL]), {"role": "tool", "content": "5"}], r"messages\[2\]\.tool_call_id"),
    ([U, _assistant(tool_calls=[CALL]), {"role": "tool", "tool_call_id": "nope", "content": "5"}],
     r"messages\[2\]\.tool_call_id"),
    ([U, _assistant(tool_calls=[CALL]), {"role": "tool", "tool_call_id": 5, "content": "5"}],
     r"messages\[2\]\.tool_call_id"),
    ([U, {"role": "tool", "tool_call_id": "c1", "content": "5"}], r"messages\[1\]\.tool_call_id"),
    ([{"role": "user", "content": []}], r"messages\[0\]\.content"),
    ([U, _assistant(tool_calls=[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]),
      {"role": "tool", "tool_call_id": "c1", "content": 5}], r"messages\[2\]\.content"),
]


@pytest.mark.parametrize("msgs, where", REFUSED)
def test_what_the_server_refuses_in_messages_is_one_error(llm, native, msgs, where):
    """Each rendered in silence before: a function_call dropped, a result answering no call, an empty turn."""
    from bitnet_cpu.serve.schemas import ChatCompletionRequest, RequestProblem
    from pydantic import ValidationError
    with pytest.raises((ValidationError, RequestProblem)):   # the server's 400 for the same messages
        ChatCompletionRequest(messages=msgs).check_tool_messages()
    for model in (llm, native):
        for tools in (None, TOOLS):
            with pytest.raises(BitNetError, match=where) as e:
                model.chat_prompt(msgs, tools=tools)
            assert "\n" not in str(e.value)


def test_tool_calls_on_another_role_are_one_error(llm):
    """A user's tool_calls were dropped in silence (the prompt differed from the history given)."""
    for role in ("user", "system", "tool"):
        msg = {"role": role, "content": "b", "tool_calls": [CALL]}
        msgs = [U, _assistant(tool_calls=[CALL]), msg] if role == "tool" else [msg]
        if role == "tool":
            msg["tool_call_id"] = "c1"
        with pytest.raises(BitNetError, match=r"messages\[\d\]\.tool_calls: only an assistant message"):
            llm.chat_prompt(msgs)


@pytest.mark.parametrize("tools, where", [
    ([{}], r"tools\[0\]"), ([{"type": "function"}], r"tools\[0\]"),
    ([{"type": "function", "function": "f"}], r"tools\[0\]"),
    ([{"type": "function", "function": {"name": 5}}], r"tools\[0\]\.function\.name"),
    ([{"type": "bogus", "function": {"name": "f"}}], r"tools\[0\]"),
    (TOOLS + TOOLS, r"tools\[1\]\.function\.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], r"tools\[0\]\.function\.parameters"),
])
def test_a_tool_list_the_server_refuses_is_one_error(llm, native, tools, where):
    """The items were written into the system block as given ({}, "f", a name 5, two tools named f)."""
    from bitnet_cpu.engine.errors import ConstraintError
    for model in (llm, native):
        with pytest.raises(ConstraintError, match=where) as e:
            model.chat_prompt([U], tools=tools)
        assert isinstance(e.value, BitNetError) and "\n" not in str(e.value)


def test_function_call_is_that_message_s_one_tool_call(llm, native):
    """The deprecated function_call rendered as an empty assistant turn; the server takes it as the message's one
    tool call, and so does the API now: the same text as the call in tool_calls."""
    fc = {"name": "f", "arguments": '{"x": 1}'}
    as_call = [U, _assistant(tool_calls=[{"type": "function", "function": fc}])]
    for model in (llm, native):
        for tools in (None, TOOLS):
            got = model.chat_text([U, _assistant(function_call=fc)], tools=tools)
            assert got == model.chat_text(as_call, tools=tools)
            assert '"name": "f"' in got and "<tool_call>" in got


def test_what_the_server_takes_still_renders(llm, native):
    """A call cut at max_tokens sent back (its arguments no JSON, as the server returned them), transformers' flat
    call with object arguments, results by id in any order, a call never answered, an assistant's content []."""
    cut = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1'}}
    flat = {"name": "f", "arguments": {"x": 1}}
    ok = [
        [U, _assistant(tool_calls=[CALL, cut]), {"role": "tool", "tool_call_id": "c2", "content": "2"},
         {"role": "tool", "tool_call_id": "c1", "content": "1"}],
        [U, _assistant(tool_calls=[flat]), {"role": "tool", "tool_call_id": "any", "content": "1"}],
        [U, _assistant(tool_calls=[CALL]), {"role": "user", "content": "never mind"}],
        [U, {"role": "assistant", "content": []}],
        [U, _assistant(tool_calls=[])],
    ]
    for msgs in ok:
        for model in (llm, native):
            for tools in (None, TOOLS):
                assert model.chat_prompt(msgs, tools=tools)
    assert '"arguments": {"x": 1}\n</tool_call>' in llm.chat_text(ok[0], tools=TOOLS)   # as written


def test_results_in_order_take_ollama_s_tool_messages(llm):
    """ollama's /api/chat history: tool results with no tool_call_id (each answers the calls in order), taken
    with results_in_order=True, as that endpoint takes them; the default is OpenAI's rule."""
    msgs = [U, _assistant(tool_calls=[CALL]), {"role": "tool", "content": "5"}]
    with pytest.raises(BitNetError, match=r"messages\[2\]\.tool_call_id"):
        llm.chat_prompt(msgs)
    assert "<tool_response>\n5\n</tool_response>" in llm.chat_text(msgs, results_in_order=True)
    with_ids = [U, _assistant(tool_calls=[CALL]), {"role": "tool", "content": "5", "tool_call_id": CALL["id"]}]
    # with ids the flag changes nothing (a results_in_order run still renders OpenAI's histories as they are)
    assert llm.chat_prompt(with_ids, results_in_order=True) == llm.chat_prompt(with_ids)
    with pytest.raises(BitNetError, match="results_in_order"):
        llm.chat_prompt(msgs, results_in_order="yes")


def test_the_server_s_tool_result_check_is_the_engine_s():
    """One check of tool results for the server and the API: the server's 400 names the field and says it in the
    engine's words."""
    from bitnet_cpu.engine.runtime.tools import MessageError, check_tool_results
    from bitnet_cpu.serve.schemas import ChatCompletionRequest, RequestProblem
    for msgs in ([U, _assistant(tool_calls=[CALL]), {"role": "tool", "content": "5"}],
                 [U, _assistant(tool_calls=[CALL]), {"role": "tool", "tool_call_id": "zz", "content": "5"}],
                 [U, {"role": "tool", "tool_call_id": "c1", "content": "5"}]):
        with pytest.raises(MessageError) as engine:
            check_tool_results(json.loads(json.dumps(msgs)))
        with pytest.raises(RequestProblem) as server:
            ChatCompletionRequest(messages=msgs).check_tool_messages()
        assert (server.value.param, str(server.value)) == (engine.value.where, str(engine.value))


def test_what_the_server_takes_reaches_chat_prompt_and_renders(llm):
    """The server's messages pass the engine's checks: a user's tool_calls (taken, never rendered) are left out
    before chat_prompt, which now refuses them; ollama's tool results without ids render with results_in_order,
    as its /api/chat passes them."""
    from bitnet_cpu.serve.ollama import _Message, _engine_message
    from bitnet_cpu.serve.schemas import ChatCompletionRequest
    msgs = [{**U, "tool_calls": [CALL]}, _assistant(tool_calls=[CALL]),
            {"role": "tool", "tool_call_id": "c1", "content": "5"}, _assistant(function_call={"name": "f"})]
    body = ChatCompletionRequest(messages=msgs)
    body.check_tool_messages()
    sent = [m.as_dict() for m in body.messages]
    assert "tool_calls" not in sent[0]
    assert llm.chat_text(sent, tools=TOOLS) == llm.chat_text([U] + msgs[1:], tools=TOOLS)
    ollama = [{**U, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
              {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
              {"role": "tool", "content": "5"}, {"role": "tool", "content": "6", "tool_name": "f"}]
    sent = [_engine_message(i, _Message(**m)) for i, m in enumerate(ollama)]
    assert "tool_calls" not in sent[0]
    text = llm.chat_text(sent, tools=TOOLS, results_in_order=True)
    assert "<tool_response>\n5\n</tool_response>" in text and '"arguments": {"x": 1}' in text


def test_text_parts_are_one_text_with_a_newline_between_them(llm):
    """OpenAI's text parts of one message are one text with "\\n" between two, as llama-server joins them (and vLLM):
    "Hi" + "there" rendered "Hithere", and a document part ran into the question after it. The server's request
    schema joins them the same way."""
    from bitnet_cpu.serve.schemas import ChatCompletionRequest
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    msgs = [{"role": "system", "content": [{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}]},
            {"role": "user", "content": parts}, {"role": "assistant", "content": parts}, U]
    joined = [{"role": m["role"], "content": "\n".join(p["text"] for p in m["content"])} if isinstance(
        m["content"], list) else m for m in msgs]
    assert llm.chat_text(msgs) == llm.chat_text(joined)
    assert "Hi\nthere" in llm.chat_text(msgs) and "s1\ns2" in llm.chat_text(msgs)
    assert [m.as_dict()["content"] for m in ChatCompletionRequest(messages=msgs).messages] == \
        [m["content"] for m in joined]
    # one part alone is that part; an empty first part adds no newline of its own (llama-server's rule)
    assert llm.chat_text([{"role": "user", "content": [{"type": "text", "text": "a"}]}]) == llm.chat_text([U])
    lead = [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "a"}]}]
    assert llm.chat_text(lead) == llm.chat_text([U])


def test_text_parts_join_as_llama_server_joins_them_part_by_part():
    """join_text_parts is one "\\n".join after the leading empty parts (adding part by part, as the rule reads, was
    quadratic: 30,000 parts of one body held the event loop for 20 s); every list of parts still gives what
    llama-server's loop gives: a "\\n" before each part once the text so far is not empty."""
    import itertools

    from bitnet_cpu.engine.runtime.chat_template import join_text_parts

    def llama_server(parts):
        text = ""
        for p in parts:
            if text:
                text += "\n"
            text += p
        return text
    for n in range(6):
        for parts in itertools.product(["", "a", "\n", "bc"], repeat=n):
            assert join_text_parts(parts) == llama_server(parts), parts
            assert join_text_parts(iter(parts)) == llama_server(parts), parts   # any iterable, read once
