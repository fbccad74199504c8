"""Tool calling: the engine's call formats and parsers (engine/runtime/tools.py) on the bundled model, and
`bitnet serve` driven by the official `openai` client (a real subprocess): required / named / auto, streamed and
not, 8 at once, arguments that validate against each function's schema, a full call -> result -> answer round
trip, and 400s naming the field (examples/agent.py, run as its docstring says: test_examples.py)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from bitnet_cpu.engine.api import ConstraintError, SamplingParams, load_model
from bitnet_cpu.engine.runtime.tools import (HermesParser, JsonCallParser, Llama3JsonFormat, functions_from_tools,
                                             tool_format)

ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                      "b": {"type": "integer", "minimum": -99, "maximum": 99}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
         {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": CITY}}]
SCHEMA = {"add": ADD, "weather": CITY}
# templates as real ones show their call format (the format is read from that)
HERMES_TEMPLATE = ('{% if tools %}<tools>{{ tools | tojson }}</tools>\nFor each call return\n<tool_call>\n'
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>{% endif %}')
LLAMA3_TEMPLATE = ('{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument '
                   'name and its value}.{{ tools | tojson }}{% endif %}<|python_tag|>')
Q = [{"role": "user", "content": "What is 2+3, and the weather in Oslo? Use the tools."}]


# ---- engine level ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_hermes_parser_any_split(cut):
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    p, content, calls = HermesParser(), "", []
    for i in range(0, len(text), cut):
        c, k = p.feed(text[i:i + cut])
        content += c
        calls += k
        assert "<tool" not in content   # a half-written tag is never shown as text
    c, k = p.finish()
    content, calls = content + c, calls + k
    assert content == "Sure.\n"
    assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == \
        [("add", {"a": 1, "b": 2}), ("weather", {"city": "Oslo", "unit": "C"})]
    assert len({x["id"] for x in calls}) == 2


def _fn(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_plain_text_passes_and_cut_call_is_a_partial_call():
    p = HermesParser()
    assert p.feed("a < b and <tool") == ("a < b and ", [])
    assert p.feed("bar>") == ("<toolbar>", [])
    p = HermesParser()   # cut inside the name: no call (OpenAI sends a name whole; "a" is no tool to look up)
    assert p.feed('<tool_call>\n{"name": "a') == ("", [])
    assert p.finish(cut=True) == ("", [])
    p = HermesParser()   # the name whole: the call, its arguments not begun
    p.feed('<tool_call>\n{"name": "add"')
    content, calls = p.finish(cut=True)
    assert content == "" and _fn(calls) == [("add", "")] and calls[0]["id"]
    p = HermesParser()
    assert p.feed('Sure. <tool_call>\n{"name":"add","arguments":{"a":1001') == ("Sure. ", [])
    assert _fn(p.finish(cut=True)[1]) == [("add", '{"a":1001')]
    p = HermesParser()   # cut between the arguments and the block's end: whole arguments
    p.feed('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool')
    assert _fn(p.finish(cut=True)[1]) == [("add", '{"a": 1, "b": 2}')]
    p = HermesParser()   # cut inside the opening tag: a call not begun, not text, and no call
    assert p.feed("<tool_ca") == ("", [])
    assert p.finish(cut=True) == ("", [])
    p = HermesParser()   # ... but a text that ends so at end of text is text
    assert p.feed("x <") == ("x ", []) and p.finish() == ("<", [])
    p = HermesParser()   # and a lone "<" at a cut too: any text may end so (the cut text is a prefix of the whole)
    assert p.feed("5 <") == ("5 ", []) and p.finish(cut=True) == ("<", [])
    jp = JsonCallParser()
    assert jp.feed('{"name": "add", "parameters": {"a": 1') == ("", [])
    assert _fn(jp.finish(cut=True)[1]) == [("add", '{"a": 1')]
    jp = JsonCallParser()
    assert jp.feed('{"name": "add", "parameters": {"a": 1, "b": 2}}') == ("", [])
    content, calls = jp.finish()
    assert content == "" and calls[0]["function"]["name"] == "add"


def test_formats_from_templates():
    assert tool_format(None).name == "hermes" and not tool_format(None).template_renders_tools
    assert tool_format(HERMES_TEMPLATE).name == "hermes" and tool_format(HERMES_TEMPLATE).template_renders_tools
    llama31 = '{% if tools %}{{ "Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary of ' \
              'argument name and its value}" }}{% endif %}<|python_tag|>'
    assert isinstance(tool_format(llama31), Llama3JsonFormat)


@pytest.fixture(scope="module")
def llm():
    m = load_model(None, ctx=2048, progress=False)
    yield m
    m.close()


@pytest.mark.parametrize("fmt_template", [None, LLAMA3_TEMPLATE])
@pytest.mark.parametrize("choice", ["required", "weather"])
def test_constrained_calls_validate(llm, fmt_template, choice):
    fmt = tool_format(fmt_template)
    spec = fmt.constraint(functions_from_tools(TOOLS), choice, parallel=True)
    ids = llm.chat_prompt(Q, tools=TOOLS)
    for seed in range(3):
        chunks = list(llm.generate(ids, SamplingParams(temperature=1.0, seed=seed), max_tokens=200, constraint=spec))
        text = "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason == "eos", text
        p = fmt.parser()
        content, calls = p.feed(text)
        rest, more = p.finish()
        calls += more
        assert calls and not (content + rest).strip(), text
        for c in calls:
            name = c["function"]["name"]
            assert choice == "required" or name == choice
            jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMA[name])


NESTED = {"$defs": {"Point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                             "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
          "type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"$ref": "#/$defs/Point"}, "b": {"$ref": "#/$defs/Point"}}}
TREE = {"type": "object", "additionalProperties": False, "required": ["v", "kids"],
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                       "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}}}


@pytest.mark.parametrize("fmt_template", [None, LLAMA3_TEMPLATE])
@pytest.mark.parametrize("n_tools", [1, 2])
def test_parameters_with_references_validate(llm, fmt_template, n_tools):
    """Parameters with $defs (openai.pydantic_function_tool writes them for nested models) and a recursive "#":
    their references point into the tool's own schema inside the call's (they were a 400, or a "#" meaning the
    whole call)."""
    tools = [{"type": "function", "function": {"name": "segment", "parameters": NESTED}},
             {"type": "function", "function": {"name": "tree", "parameters": TREE}}][2 - n_tools:]
    schema = {"segment": NESTED, "tree": TREE}
    fmt = tool_format(fmt_template)
    spec = fmt.constraint(functions_from_tools(tools), "required", parallel=False)
    ids = llm.chat_prompt(Q, tools=tools)
    seen = set()
    for seed in range(4):
        chunks = list(llm.generate(ids, SamplingParams(temperature=1.0, seed=seed), max_tokens=160, constraint=spec))
        if chunks[-1].finish_reason != "eos":   # a tree as deep as max_tokens allows: no whole call to check
            continue
        p = fmt.parser()
        _, calls = p.feed("".join(c.text for c in chunks))
        calls += p.finish()[1]
        for c in calls:
            seen.add(c["function"]["name"])
            jsonschema.validate(json.loads(c["function"]["arguments"]), schema[c["function"]["name"]])
    assert seen, "no call ended within max_tokens"


LIST_TEMPLATE = ("{% if tools %}For each call answer\\n<tool_call>\\n[{\\\"name\\\": ..., \\\"arguments\\\": {...}}, ...]"
                 "\\n</tool_call>{{ tools | tojson }}{% endif %}")   # as Falcon3's template shows the model
MISTRAL_LIKE = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"


def takes(llm, spec, text: str) -> bool:
    """Does the compiled constraint accept `text` whole (every token, and an end there)?"""
    m = llm.compile_constraint(spec).matcher()
    ids = llm.tokenize(text, add_bos=False)
    if m.valid_prefix(ids) != ids:
        return False
    for t in ids:
        m.advance(t)
    return m.accepting


# calls as the templates write them (tojson / json.dumps separators): the grammar holds the model to that
ADD_CALL = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
OSLO_CALL = json.dumps({"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}})


def test_auto_takes_text_then_calls_and_constrains_them(llm):
    """tool_choice auto (hermes): a text answer, calls alone, or text -- a thought, a Qwen3 <think> block --
    followed by calls; what follows the opening tag is still a valid call, and nothing follows the calls."""
    fmt = tool_format(HERMES_TEMPLATE)
    for parallel in (True, False):
        auto = fmt.constraint(functions_from_tools(TOOLS), "auto", parallel)
        block = f"<tool_call>\n{ADD_CALL}\n</tool_call>"
        yes = ["Five.", block, f"Let me add.\n{block}", f"<think>\nI should add.\n</think>\n\n{block}",
               "a < b, <tool and more"]
        no = [f"Let me add.\n<tool_call>\n{{\"name\":\"sub\",\"arguments\":{{}}}}\n</tool_call>",
              f"Let me add.\n{block}\nDone.", f"Hi <tool_call> hi"]
        two = f"{block}\n<tool_call>\n{OSLO_CALL}\n</tool_call>"
        (yes if parallel else no).append(f"Sure.\n{two}")
        for text in yes:
            assert takes(llm, auto, text), (parallel, text)
        for text in no:
            assert not takes(llm, auto, text), (parallel, text)
    p = fmt.parser()
    content, calls = p.feed(f"<think>\nI should add.\n</think>\n\n<tool_call>\n{ADD_CALL}\n</tool_call>")
    assert content == "<think>\nI should add.\n</think>\n\n" and _fn(calls) == [("add", '{"a": 1, "b": 2}')]


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, LIST_TEMPLATE, LLAMA3_TEMPLATE])
def test_auto_lets_a_thought_name_calls_before_the_real_one(llm, template):
    """tool_choice auto, a thinking template: a thought that names <tool_call> (or writes a whole call while it
    plans) is a thought, and the call after it is a call. The tag in the thought was forced into a call's JSON
    and then only the end: the thought never closed and the real call never came. The thought is the model's
    to open ("may") or the prompt's ("open": it must close before a call); the call after it stays held to its
    schema, and nothing follows it."""
    fmt = tool_format(template)
    call = fmt.call_text("add", {"a": 1, "b": 2})
    bad = fmt.call_text("sub", {})
    for thought, pre in (("may", "<think>\n"), ("open", "")):
        auto = fmt.constraint(functions_from_tools(TOOLS), "auto", False, thought)
        yes = [f"{pre}Maybe {call} works.\n</think>\n\n{call}", f"{pre}I should add.\n</think>\n\n{call}",
               f"{pre}I will write <tool_call> next.\n</think>\n\n{call}",
               f"{pre}No <tool_call> needed.\n</think>\n\nFive.", "Five."]
        no = [f"{pre}Hm.\n</think>\n\n{bad}", f"{pre}Hm.\n</think>\n\n{call}\nDone."]
        for text in yes:
            assert takes(llm, auto, text), (thought, text)
        for text in no:
            assert not takes(llm, auto, text), (thought, text)


def test_answer_thought_says_where_the_prompt_leaves_the_thought(llm):
    """What the server builds the tool grammar for: a template that opens the thought in its generation prompt
    ("open"), one whose model opens it (or that closed an empty one: enable_thinking false), none that thinks."""
    think = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
             "{% elif open_thought is not defined or open_thought %}<think>\n{% endif %}{% endif %}")
    llm.set_chat_template(think)
    try:
        assert llm.answer_thought(llm.chat_prompt(Q)) == "open"
        assert llm.answer_thought(llm.chat_prompt(Q, template_kwargs={"open_thought": False})) == "may"
        assert llm.answer_thought(llm.chat_prompt(Q, template_kwargs={"enable_thinking": False})) == "may"
    finally:
        llm._chat_template = None
    assert not llm.thinks and llm.answer_thought(llm.chat_prompt(Q)) is None


def test_llama3_json_is_one_call_an_answer(llm):
    """Llama 3.x templates refuse two calls in the history, and its parser read only the first of two (the rest
    was lost as 'stop'): the grammar allows one, whatever parallel_tool_calls says."""
    fmt = tool_format(LLAMA3_TEMPLATE)
    one, two = '{"name": "add", "parameters": {"a": 1, "b": 2}}', '{"name": "add", "parameters": {"a": 3, "b": 4}}'
    for choice in ("auto", "required"):
        spec = fmt.constraint(functions_from_tools(TOOLS), choice, True)
        assert takes(llm, spec, one) and not takes(llm, spec, one + "\n" + two), choice


# templates whose own call format is none of ours, as they show it (Qwen3-Coder / Nemotron 3, GLM-4.6 / ling,
# Functionary v3.1, Command-R7B): they get the default block, so the prompt and the grammar agree on hermes
OWN_FORMATS = [
    '{% if tools %}{{ tools | tojson }}\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>'
    '\nvalue_1\n</parameter>\n</function>\n</tool_call>{% endif %}',
    "{% if tools %}{{ tools | tojson }} within the following XML format:\n<tool_call>{function-name}\n"
    "<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n</tool_call>{% endif %}"
    "{% for tc in tool_calls %}{{ '<tool_call>' + tc.name }}{% endfor %}",
    '{% if tools %}{{ tools | tojson }} Use the function "parameters" as <function=example_function_name>'
    '{"example_name": "example_value"}</function>{% endif %}<|python_tag|>',
    '{% if tools %}{"name": ..., "parameters": {{ tools | tojson }}}<|START_ACTION|>[{"tool_name": title, '
    '"parameters": {}}]<|END_ACTION|>{% endif %}',
]


@pytest.mark.parametrize("template", OWN_FORMATS)
def test_a_template_with_its_own_call_format_gets_the_default_block(template):
    fmt = tool_format(template)
    assert fmt.name == "hermes" and not fmt.template_renders_tools
    messages, tools_arg = fmt.prepare([{"role": "user", "content": "hi"}], TOOLS)
    assert tools_arg is None and "<tool_call>" in messages[0]["content"]   # the format the grammar holds to


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, LLAMA3_TEMPLATE])
def test_calls_are_held_to_the_templates_separators(llm, template):
    """A template shows its calls, and renders past ones, with tojson's ", " and ": "; llama.cpp's grammar takes
    that spacing. The grammar holds a call to it (it refused it for compact JSON the prompt never showed)."""
    fmt = tool_format(template)
    key = "parameters" if fmt.name == "llama3_json" else "arguments"
    spaced = json.dumps({"name": "add", key: {"a": 1, "b": 2}})
    compact = json.dumps({"name": "add", key: {"a": 1, "b": 2}}, separators=(",", ":"))
    wrap = (lambda c: c) if fmt.name == "llama3_json" else (lambda c: f"<tool_call>\n{c}\n</tool_call>")
    assert fmt.call_text("add", {"a": 1, "b": 2}) == wrap(spaced)   # as the history renders it
    # a past call's string with DEL in it is written as the grammar writes it (escaped), never raw
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["v"], "properties": {"v": {"const": "a\x7fb"}}}}}]
    spec = fmt.constraint(functions_from_tools(odd), "required", False)
    past = fmt.call_text("f", {"v": "a\x7fb"})
    assert "\x7f" not in past and takes(llm, spec, past) and json.loads(
        past.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))[key]["v"] == "a\x7fb"
    for choice in ("auto", "required", "add"):
        spec = fmt.constraint(functions_from_tools(TOOLS), choice, True)
        assert takes(llm, spec, wrap(spaced)) and not takes(llm, spec, wrap(compact)), choice


def test_llama3_auto_answers_in_any_text_that_is_no_call(llm):
    """Llama 3.x, tool_choice auto: an answer that opens as a call ({"name", or {"type": "function", "name", the
    way llama.cpp spots one) is a call; any other text is an answer, JSON and leading whitespace included (a
    model asked for JSON was forced into a call)."""
    fmt = tool_format(LLAMA3_TEMPLATE)
    auto = fmt.constraint(functions_from_tools(TOOLS), "auto", True)
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    for text in ('{"answer": 42}', '{\n  "city": "Oslo"\n}', " Hello", "\n\nHello", "Five.", call):
        assert takes(llm, auto, text), text
    assert not takes(llm, auto, '{"name": "sub", "parameters": {}}')   # a call opened is a valid call
    # whitespace then a call is not text either: the parser reads past whitespace, so it would be a call that
    # skipped the call grammar (a function never offered, arguments off its schema)
    assert not takes(llm, auto, ' {"name": "sub", "parameters": {}}')
    assert not takes(llm, auto, '\n{"name": "add", "parameters": {"a": "x"}}')
    for text in ('{"answer": 42}', " Hello", '[1, 2]'):
        p = JsonCallParser()
        content, calls = p.feed(text)
        rest, more = p.finish()
        assert (content + rest, calls + more) == (text, []) and not p.cut_call
    for text in (call, '{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}'):
        p = JsonCallParser()
        p.feed(text)
        content, calls = p.finish()
        assert content == "" and _fn(calls) == [("add", '{"a": 1, "b": 2}')]


@pytest.mark.parametrize("step", [None, 1, 5])
def test_a_close_tag_inside_an_argument_is_the_arguments(step):
    """The block ends at the </tool_call> after a whole call: one inside an argument's string is text (a coding
    agent editing this very file writes one); it was a 500 or a stream cut off."""
    args = {"text": "end with </tool_call> please", "n": 1}
    text = ("Sure.\n<tool_call>\n" + json.dumps({"name": "write", "arguments": args}) + "\n</tool_call>\n<tool_call>\n"
            + json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}}) + "\n</tool_call>")
    p, content, calls = HermesParser(), "", []
    for i in range(0, len(text), step or len(text)):
        c, k = p.feed(text[i:i + (step or len(text))])
        content, calls = content + c, calls + k
    c, k = p.finish()
    assert content + c == "Sure.\n" and not p.cut_call
    assert [(n, json.loads(a)) for n, a in _fn(calls + k)] == [("write", args), ("add", {"a": 1, "b": 2})]
    p = HermesParser()   # a block that never closes after a whole call: cut, as far as written
    assert p.feed('<tool_call>\n{"name": "write", "arguments": {"text": "a </tool_call> b') == ("", [])
    content, [cut] = p.finish(cut=True)
    assert content == "" and p.cut_call and cut["function"]["name"] == "write"


def test_falcon3_list_format(llm):
    """A template that shows the model one <tool_call> block holding a JSON list (Falcon3's) gets that format:
    the grammar takes one call or several in the list (whitespace between them, as its example), the parser
    gives each; a template with a tool format of its own (Mistral's [TOOL_CALLS]) gets the default block, so
    the prompt never shows the model a format the grammar forbids."""
    fmt = tool_format(LIST_TEMPLATE)
    assert fmt.name == "hermes_list" and fmt.template_renders_tools
    assert tool_format(MISTRAL_LIKE).name == "hermes" and not tool_format(MISTRAL_LIKE).template_renders_tools
    listed = f"<tool_call>\n[\n  {ADD_CALL},\n  {OSLO_CALL}\n]\n</tool_call>"
    for choice, parallel, yes, no in (
            ("required", True, [listed, f"<tool_call>\n[{ADD_CALL}]\n</tool_call>"],
             [f"<tool_call>\n{ADD_CALL}\n</tool_call>", f"<tool_call>\n[{ADD_CALL}]\n</tool_call>\n" + listed]),
            ("required", False, [f"<tool_call>\n[{ADD_CALL}]\n</tool_call>"], [listed]),
            ("auto", True, ["Five.", f"Let me see.\n{listed}"], [f"Let me see.\n<tool_call>\n{ADD_CALL}"])):
        spec = fmt.constraint(functions_from_tools(TOOLS), choice, parallel)
        for text in yes:
            assert takes(llm, spec, text), (choice, parallel, text)
        for text in no:
            assert not takes(llm, spec, text), (choice, parallel, text)
    p = fmt.parser()
    content, calls = p.feed("Let me see.\n" + listed)
    assert content == "Let me see.\n" and [c["function"]["name"] for c in calls] == ["add", "weather"]
    assert len({c["id"] for c in calls}) == 2
    p = fmt.parser()
    p.feed(f'<tool_call>\n[\n  {{"name":"add","arguments":{{"a":1')
    assert _fn(p.finish(cut=True)[1]) == [("add", '{"a":1')]
    spec = fmt.constraint(functions_from_tools(TOOLS), "required", False)   # sampled: calls that validate
    for seed in range(3):
        chunks = list(llm.generate(llm.chat_prompt(Q, tools=TOOLS), SamplingParams(temperature=1.0, seed=seed),
                                   max_tokens=200, constraint=spec))
        assert chunks[-1].finish_reason == "eos"
        p = fmt.parser()
        content, calls = p.feed("".join(c.text for c in chunks))
        calls += p.finish()[1]
        assert len(calls) == 1 and not content.strip()
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMA[calls[0]["function"]["name"]])


UNIQUE = {"type": "object", "properties": {"u": {"type": "array", "uniqueItems": True}}}


def test_bad_tools_refused_naming_the_tool():
    bad = TOOLS + [{"type": "function", "function": {"name": "u", "parameters": UNIQUE}}]
    with pytest.raises(ConstraintError) as e:
        tool_format(None).constraint(functions_from_tools(bad), "required", True)
    assert e.value.where == "tools[2].function.parameters"
    # a call's arguments are an object: OpenAI and Anthropic refuse a tool whose parameters are a string's or a
    # list's (here a string's arguments reached the client as a JSON string)
    for params in ({"type": "string"}, {"type": "array", "items": {"type": "boolean"}}, {"type": ["object", "null"]}):
        with pytest.raises(ConstraintError) as e:
            functions_from_tools(TOOLS + [{"type": "function", "function": {"name": "s", "parameters": params}}])
        assert e.value.where == "tools[2].function.parameters" and '"object"' in str(e.value)
    # no type but properties, no parameters, and {} stay what they were: an object's arguments / none
    for params in ({"properties": {"a": {"type": "integer"}}}, None, {}):
        fn = {"name": "s", **({} if params is None else {"parameters": params})}
        assert functions_from_tools([{"type": "function", "function": fn}])
    with pytest.raises(ConstraintError) as e:
        functions_from_tools(TOOLS + [TOOLS[0]])
    assert e.value.where == "tools[2].function.name"
    # a top-level anyOf/oneOf with a branch no object can take: no call could ever have those arguments
    for params in ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, {"oneOf": [{"type": "object"}, {"const": 1}]}):
        with pytest.raises(ConstraintError) as e:
            functions_from_tools([{"type": "function", "function": {"name": "s", "parameters": params}}])
        assert e.value.where == "tools[0].function.parameters" and "Of[" in str(e.value), e.value


def test_constraint_takes_the_openai_tool_list_and_refuses_a_bad_choice_in_one_line(llm):
    """ToolFormat.constraint(tools, ...) as the module's docstring shows it: the OpenAI-style list raised
    AttributeError ('dict' object has no attribute 'parameters'), and a tool_choice naming no listed function or a
    mistyped mode ("requird") IndexError. The list is now taken as functions_from_tools takes it, and a bad
    choice, a list of neither, or not a list is a one-line ConstraintError naming the functions."""
    fmt = tool_format(None)
    for choice in ("required", "weather", "auto"):
        assert fmt.constraint(TOOLS, choice, True) == fmt.constraint(functions_from_tools(TOOLS), choice, True)
    for tools in (TOOLS, functions_from_tools(TOOLS)):
        for choice in ("requird", "g", "", None, 5):
            with pytest.raises(ConstraintError, match="tool_choice") as e:
                fmt.constraint(tools, choice, True)
            assert e.value.where == "tool_choice" and "add, weather" in str(e.value), e.value
            assert "\n" not in str(e.value)
    for tools in ("add", [functions_from_tools(TOOLS)[0], TOOLS[1]], [5], {"add": ADD}):
        with pytest.raises(ConstraintError, match="functions_from_tools") as e:
            fmt.constraint(tools, "required", True)
        assert "\n" not in str(e.value)
    with pytest.raises(ConstraintError, match="tools: a list") as e:
        functions_from_tools("notalist")
    assert fmt.constraint(TOOLS, "none", True) is None and fmt.constraint([], "auto", True) is None
    # the whole Python path, prompt to parsed call, with the OpenAI-style list alone
    ids = llm.chat_prompt(Q, tools=TOOLS)
    text = "".join(c.text for c in llm.generate(ids, SamplingParams(temperature=0), max_tokens=120,
                                                 constraint=fmt.constraint(TOOLS, "add", False)))
    parser = llm.tool_format().parser()
    calls = parser.feed(text)[1] + parser.finish()[1]
    assert [c["function"]["name"] for c in calls] == ["add"], text


def test_a_function_named_like_a_mode_is_that_function_when_named(llm):
    """named=True: the choice is a function's name, never a mode. A tool called "required", "auto" or "none" forced
    by name is one call of that tool (as a mode, "required" took a call of any tool, "auto" a text answer too, and
    "none" no grammar at all); a name that is no tool is refused, even "auto"."""
    for mode in ("required", "auto", "none"):
        tools = [{"type": "function", "function": {"name": mode, "parameters": ADD}}, TOOLS[1]]
        spec = tool_format(None).constraint(tools, mode, False, named=True)
        assert spec is not None and not spec.free_start, mode
        own = "<tool_call>\n" + json.dumps({"name": mode, "arguments": {"a": 1, "b": 2}}) + "\n</tool_call>"
        assert takes(llm, spec, own), mode
        assert not takes(llm, spec, "<tool_call>\n" + OSLO_CALL + "\n</tool_call>"), mode
        assert not takes(llm, spec, "Hello."), mode
        assert not takes(llm, spec, own + "\n" + own), mode
    with pytest.raises(ConstraintError, match="no function of that name") as e:
        tool_format(None).constraint(TOOLS, "auto", True, named=True)
    assert e.value.where == "tool_choice" and "add, weather" in str(e.value)


@pytest.mark.parametrize("params", [{}, {"properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                                    {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}])
def test_parameters_without_a_type_still_give_object_arguments(llm, params):
    """A schema without "type" (no type, its properties only, an anyOf of untyped branches) is an object's: the
    grammar held such calls to no type at all, and a call's arguments came back as "0" or "0.1098..."."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    fmt = tool_format(None)
    spec = fmt.constraint(functions_from_tools(tools), "required", parallel=False)
    ids = llm.chat_prompt(Q, tools=tools)
    for seed in range(4):
        chunks = list(llm.generate(ids, SamplingParams(temperature=1.0, seed=seed), max_tokens=120, constraint=spec))
        text = "".join(c.text for c in chunks)
        p = fmt.parser()
        _, calls = p.feed(text)
        calls += p.finish()[1]
        [call] = calls
        arguments = call["function"]["arguments"]
        assert arguments.lstrip().startswith("{"), text   # an object's, even where max_tokens cut it
        if chunks[-1].finish_reason == "eos":   # (the random model may run on with keys of its own: untyped
            args = json.loads(arguments)        # branches take any; which seeds end varies with the kernel path)
            assert isinstance(args, dict), text
            jsonschema.validate(args, params)


# ---- through the server --------------------------------------------------------------------------------------
openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install .[test])")


@pytest.fixture(scope="module")
def server():
    """This module's server (2048-token context for tool schemas in the prompt); `client` and `model_id` come
    from conftest.py."""
    from serve_proc import Server

    s = Server("--parallel", "8", "-c", "2048")
    yield s
    s.stop()


def _calls_valid(calls, only=None):
    assert calls
    for c in calls:
        assert c.id and c.type == "function" and (only is None or c.function.name == only)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_required_and_named_stream_and_not(client, model_id, choice):
    only = None if choice == "required" else "weather"
    r = client.chat.completions.create(model=model_id, messages=Q, tools=TOOLS, tool_choice=choice, temperature=0,
                                       max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    _calls_valid(r.choices[0].message.tool_calls, only)
    chunks = list(client.chat.completions.create(model=model_id, messages=Q, tools=TOOLS, tool_choice=choice,
                                                 temperature=0, max_tokens=200, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == [c.function.name for c in r.choices[0].message.tool_calls]
    assert [d.function.arguments for d in deltas] == [c.function.arguments for c in r.choices[0].message.tool_calls]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_close_tag_in_a_forced_argument_comes_back_whole(client, model_id, stream):
    """The grammar lets an argument hold "</tool_call>" (here the only value it may have): the call comes back
    whole, streamed or not (it was a 500, or a stream closed with no [DONE])."""
    value = "end with </tool_call> please"
    tools = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["text"],
        "properties": {"text": {"const": value}}}}}]
    kw = dict(model=model_id, messages=Q, tools=tools, tool_choice="required", temperature=0, max_tokens=300,
              parallel_tool_calls=False)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        got = [(d.function.name, json.loads(d.function.arguments)) for d in deltas]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    else:
        r = client.chat.completions.create(**kw)
        got = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
        finish = [r.choices[0].finish_reason]
    assert got == [("note", {"text": value})] and finish == ["tool_calls"]


def test_eight_at_once_sampled(client, model_id):
    def one(i):
        r = client.chat.completions.create(model=model_id, messages=Q, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=i, max_tokens=200)
        return r.choices[0]

    with ThreadPoolExecutor(8) as ex:
        for ch in ex.map(one, range(8)):
            assert ch.finish_reason == "tool_calls"
            _calls_valid(ch.message.tool_calls)


def test_auto_and_round_trip(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=Q, tools=TOOLS, tool_choice="auto", temperature=0,
                                       max_tokens=60)
    c = r.choices[0]
    if c.message.tool_calls:   # the model chose a call: it is a valid one
        _calls_valid(c.message.tool_calls)
    else:
        assert c.message.content and "<tool_call>" not in c.message.content
    first = client.chat.completions.create(model=model_id, messages=Q, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200).choices[0].message
    history = Q + [first.model_dump(exclude_none=True)] + \
        [{"role": "tool", "tool_call_id": call.id, "content": "5"} for call in first.tool_calls]
    final = client.chat.completions.create(model=model_id, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=40).choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.content and not final.message.tool_calls


@pytest.mark.parametrize("cut", [4, 12, 33, 44])   # inside <tool_call>, the name, the arguments, after them
def test_call_cut_by_max_tokens_is_a_partial_call(client, model_id, cut):
    """A forced call cut by max_tokens: tool_calls holds the call as written so far (never template markup in
    content), streamed as delta.tool_calls, finish_reason length; cut before its name is whole, no call at all
    (OpenAI sends a name whole, first: a call named "" or "ad" broke agent loops, and /v1/responses refused it sent
    back). The bundled model's whole call here is 53 tokens ({"a":20,"b":0}); the greedy cut's arguments are a prefix
    of the whole call's, as the grammar wrote them."""
    kw = dict(model=model_id, messages=Q, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              temperature=0)
    whole = client.chat.completions.create(max_tokens=200, **kw).choices[0].message.tool_calls[0].function
    compact = json.dumps(json.loads(whole.arguments), separators=(",", ":"))
    r = client.chat.completions.create(max_tokens=cut, **kw).choices[0]
    assert r.finish_reason == "length" and not r.message.content, r
    if cut <= 12:
        assert not r.message.tool_calls, r
        chunks = list(client.chat.completions.create(max_tokens=cut, stream=True, **kw))
        assert not any(ch.choices[0].delta.tool_calls or ch.choices[0].delta.content for ch in chunks if ch.choices)
        return
    [call] = r.message.tool_calls
    assert call.function.name == whole.name and call.id and call.type == "function"
    args = call.function.arguments
    assert compact.startswith(args) or json.loads(args) == json.loads(whole.arguments), (args, compact)
    chunks = list(client.chat.completions.create(max_tokens=cut, stream=True, **kw))
    assert not any("tool_call" in (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, call.function.name, args)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    # an agent loop keeps every turn: the cut call, sent back with a tool result, is history like any other
    history = Q + [r.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "?"}]
    again = client.chat.completions.create(model=model_id, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=4)
    assert again.choices[0].message.content and again.usage.prompt_tokens > 0


def test_call_cut_by_a_stop_string_is_no_text_and_not_tool_calls(client, model_id):
    """A stop string inside a call cuts it as max_tokens does: the call so far, no markup in content, and the finish
    reason length, streamed or not (a stop reason passed the cut arguments off as a whole call: openai's parse()
    raised a raw validation error on them; length is its LengthFinishReasonError)."""
    kw = dict(model=model_id, messages=Q, tools=TOOLS, temperature=0, max_tokens=200,
              tool_choice={"type": "function", "function": {"name": "add"}}, stop=['"b"'])
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and not c.message.content, c
    [call] = c.message.tool_calls
    assert call.function.name == "add" and re.fullmatch(r'\{"a": -?[0-9]+, ', call.function.arguments), call
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    # one that cuts the call before its name is whole (the newline after <tool_call>) leaves no call to give: still
    # length, as the Responses API's incomplete and Anthropic's max_tokens (it said stop: a required call vanished
    # behind a normal stop)
    kw = dict(kw, tool_choice="required", stop=["\n"])
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls and not c.message.content, c
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert not any(ch.choices[0].delta.tool_calls or ch.choices[0].delta.content for ch in chunks if ch.choices)


def test_allowed_tools_narrow_the_calls_not_the_prompt(client, model_id, server):
    """OpenAI's tool_choice {"type": "allowed_tools"}: both tools stay in the prompt (the same prompt tokens as
    without the restriction), and every sampled call, over several seeds, is to an allowed tool; the Responses
    API's flat form does the same."""
    import httpx

    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "weather"}}]}}
    free = client.chat.completions.create(model=model_id, messages=Q, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=1)
    for seed in range(4):
        r = client.chat.completions.create(model=model_id, messages=Q, tools=TOOLS, tool_choice=allowed,
                                           temperature=1.0, seed=seed, max_tokens=200)
        assert r.usage.prompt_tokens == free.usage.prompt_tokens
        assert r.choices[0].finish_reason == "tool_calls"
        _calls_valid(r.choices[0].message.tool_calls, only="weather")
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    for seed in range(2):
        out = httpx.post(server.url + "/v1/responses", timeout=120, json={
            "input": Q[0]["content"], "tools": flat, "temperature": 1.0, "seed": seed, "max_output_tokens": 200,
            "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function",
                                                                                   "name": "add"}]}}).json()
        calls = [o for o in out["output"] if o["type"] == "function_call"]
        assert calls and all(c["name"] == "add" for c in calls), out["output"]
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMA["add"])


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "nope"}}]}}}, "tool_choice"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "x", "parameters": UNIQUE}}],
      "tool_choice": "required"}, "tools[2].function.parameters"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[2].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    # an allowed list naming tools that are not there is refused with no tools too (mode auto was answered 200)
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "nope"}}]}}}, "tool_choice"),
    # a tool result answers a call of an earlier assistant message, by its id (OpenAI's 400s): it was rendered as
    # an answer to no call
    ({"messages": Q + [CALLED, {"role": "tool", "content": "5"}]}, "messages[2].tool_call_id"),
    ({"messages": Q + [CALLED, {"role": "tool", "tool_call_id": "call_nope", "content": "5"}]},
     "messages[2].tool_call_id"),
    ({"messages": Q + [{"role": "tool", "tool_call_id": "call_1", "content": "5"}]}, "messages[1].tool_call_id"),
    # OpenAI's shapes: a tool's type, and a call's arguments as a JSON string
    ({"tools": [TOOLS[0], {"function": TOOLS[1]["function"]}]}, "tools[1].type"),
    ({"messages": Q + [{**CALLED, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_tool_errors_400(server, body, param):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    if param.startswith("messages"):   # the token count refuses the same body
        r = httpx.post(server.url + "/v1/chat/completions/input_tokens", json={"messages": Q, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
@pytest.mark.parametrize("field, value", [("tools", TOOLS), ("tool_choice", "required"), ("parallel_tool_calls", False),
                                          ("functions", [TOOLS[0]["function"]]), ("function_call", "auto")])
def test_completion_endpoints_refuse_tools(server, path, field, value):
    """Text completion has no messages to carry calls: tools there were ignored (200 plain text, even with
    tool_choice required), and functions' 400 told the client to send tools, which that endpoint then ignored."""
    import httpx

    r = httpx.post(server.url + path, json={"prompt": "Hi", "max_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "/v1/chat/completions" in err["message"], err


def test_calls_answered_and_unanswered_are_taken(server):
    """A result per call, by id, in any order, is taken; so are calls never answered (sent back mid-conversation)."""
    import httpx

    two = {**CALLED, "tool_calls": CALLED["tool_calls"] + [
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]}
    for msgs in (Q + [two, {"role": "tool", "tool_call_id": "call_2", "content": "2"},
                      {"role": "tool", "tool_call_id": "call_1", "content": "5"}],
                 Q + [CALLED, {"role": "user", "content": "Never mind."}]):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text


def test_history_calls_in_either_shape_render():
    """Earlier assistant calls come as OpenAI's {"function": {...}} or transformers' flat {"name", "arguments"};
    both render (as <tool_call> blocks for a template without tools, passed through for one with them)."""
    flat = {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    nested = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    for m in (flat, nested):
        msgs, _ = tool_format(None).prepare([m], None)
        assert msgs[0]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        native, _ = tool_format(HERMES_TEMPLATE).prepare([m], TOOLS)
        calls = native[0]["tool_calls"]
        assert (calls[0].get("function") or calls[0])["arguments"] == {"a": 1, "b": 2}
    cut = {"role": "assistant", "content": None,   # a call the server returned cut at max_tokens: as written
           "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1'}}]}
    msgs, _ = tool_format(None).prepare([cut], None)
    assert msgs[0]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'
    native, _ = tool_format(HERMES_TEMPLATE).prepare([cut], TOOLS)
    assert native[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1'


def test_a_turn_s_tool_results_are_one_message_for_a_template_without_tools():
    """Two calls answered by two tool results become one user turn of two <tool_response> blocks, so a template
    that wants roles to alternate (Mistral's, now given the default block) renders the conversation."""
    from bitnet_cpu.engine.runtime.chat_template import render
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
             for i in (1, 2)]
    history = Q + [{"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "c1", "content": "3"},
                   {"role": "tool", "tool_call_id": "c2", "content": "3"}]
    msgs, _ = tool_format(MISTRAL_ALTERNATE).prepare(history, TOOLS)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[-1]["content"].count("<tool_response>\n") == 2 and msgs[-1]["content"].endswith("</tool_response>")
    assert render(MISTRAL_ALTERNATE, msgs)   # the template's alternation check passes


def test_a_tool_result_names_the_function_it_answers():
    """With the default block a result says which function's call it answers (by its tool_call_id): results sent
    back in another order than the calls reached the model as bare text, each taken as the answer to the call in
    its place."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
             {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    history = Q + [{"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "c2", "content": "cold"},
                   {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    msgs, _ = tool_format(None).prepare(history, TOOLS)
    blocks = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", msgs[-1]["content"], re.S)
    assert [json.loads(b) for b in blocks] == [{"name": "weather", "content": "cold"}, {"name": "add", "content": "3"}]
    # a template that renders tools itself gets the messages as sent (it renders the results its own way)
    native, _ = tool_format(HERMES_TEMPLATE).prepare(history, TOOLS)
    assert [m["content"] for m in native[-2:]] == ["cold", "3"]


MISTRAL_ALTERNATE = (   # the check of Mistral-7B-Instruct's template, with a tools section of its own
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% set loop_messages = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    "{% for m in loop_messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}[TOOL_CALLS]")


def test_a_json_format_beside_tools_shapes_the_text_answer(server):
    """Tools with choice auto and a JSON format together (OpenAI's response_format, Anthropic's
    output_config.format, ollama's format; Anthropic documents the pair): the model calls a tool, or answers in
    the format -- it was a 400."""
    import httpx

    fmt = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
           "additionalProperties": False}

    def check(content, calls):
        if calls:
            assert all(c["name"] in SCHEMA for c in calls), calls
        else:
            jsonschema.validate(json.loads(content), fmt)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": Q, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": fmt}}})
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    check(m["content"], [c["function"] for c in m.get("tool_calls") or []])
    a = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 60, "temperature": 0, "messages": Q,
        "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in TOOLS],
        "output_config": {"format": {"type": "json_schema", "schema": fmt}}})
    assert a.status_code == 200, a.text
    blocks = a.json()["content"]
    check("".join(b["text"] for b in blocks if b["type"] == "text"),
          [b for b in blocks if b["type"] == "tool_use"])
    o = httpx.post(server.url + "/api/chat", timeout=120, json={
        "model": "m", "messages": Q, "tools": TOOLS, "format": fmt, "stream": False,
        "options": {"temperature": 0, "num_predict": 60}})
    assert o.status_code == 200, o.text
    msg = o.json()["message"]
    check(msg["content"], [c["function"] for c in msg.get("tool_calls") or []])


def test_a_format_beside_a_required_call_is_the_call_on_openai_s_apis(server):
    """tool_choice required / a named function with response_format (chat) or text.format (Responses): OpenAI
    takes the pair and the answer is the call (the format shapes a later turn's text); instructor's Responses mode
    and the Agents SDK's forced tool use send it on every request, and got a 400. Anthropic's tool_choice any with
    output_config.format stays its API's 400."""
    import httpx

    fmt = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": Q, "tools": TOOLS, "tool_choice": choice, "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": fmt}}})
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] in SCHEMA for c in calls)
    resp = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "input": Q[0]["content"], "max_output_tokens": 60, "temperature": 0, "tool_choice": "required",
        "tools": [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                  for t in TOOLS],
        "text": {"format": {"type": "json_schema", "name": "a", "schema": fmt}}})
    assert resp.status_code == 200, resp.text
    assert any(item["type"] == "function_call" for item in resp.json()["output"])
    a = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 60, "messages": Q, "tool_choice": {"type": "any"},
        "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
        "output_config": {"format": {"type": "json_schema", "schema": fmt}}})
    assert a.status_code == 400 and "tool_choice" in a.text


def test_a_named_choice_is_exactly_one_call_on_every_endpoint(server):
    """A named tool choice is one call of that tool (OpenAI: "call exactly one specific function"), whatever
    parallel_tool_calls says; the grammar let the model write one or more, and the tiny model repeated the call
    up to max_tokens (instructor's default mode then raised on the cut last copy). ignore_eos takes away the
    model's own stop, so only the grammar can end the answer: after one call it must. "required" keeps one or
    more, and so does Anthropic's type tool with disable_parallel_tool_use: false sent (the flag it documents)."""
    import httpx

    def post(path, body):
        r = httpx.post(server.url + path, timeout=120, json={"temperature": 0, "ignore_eos": True, **body})
        assert r.status_code == 200, (path, body, r.text)
        return r.json()

    named = {"type": "function", "function": {"name": "add"}}
    for extra in ({}, {"parallel_tool_calls": True}, {"parallel_tool_calls": False}):
        c = post("/v1/chat/completions", {"messages": Q, "tools": TOOLS, "tool_choice": named, "max_tokens": 300,
                                          **extra})["choices"][0]
        assert c["finish_reason"] == "tool_calls", extra
        assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["add"], extra
    c = post("/v1/chat/completions", {"messages": Q, "tools": TOOLS, "tool_choice": "required",
                                      "max_tokens": 300})["choices"][0]
    assert c["finish_reason"] == "length" and len(c["message"]["tool_calls"]) >= 2   # more than one may come
    flat = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in TOOLS]
    for extra in ({}, {"parallel_tool_calls": True}):
        r = post("/v1/responses", {"input": Q[0]["content"], "tools": flat, "max_output_tokens": 300,
                                   "tool_choice": {"type": "function", "name": "add"}, **extra})
        assert r["status"] == "completed", extra
        assert [o["name"] for o in r["output"] if o["type"] == "function_call"] == ["add"], extra
    anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for flag, one in ((None, True), (True, True), (False, False)):
        choice = {"type": "tool", "name": "add", **({} if flag is None else {"disable_parallel_tool_use": flag})}
        m = post("/v1/messages", {"model": "m", "messages": Q, "tools": anthropic_tools, "tool_choice": choice,
                                  "max_tokens": 300})
        uses = [b["name"] for b in m["content"] if b["type"] == "tool_use"]
        if one:
            assert m["stop_reason"] == "tool_use" and uses == ["add"], flag
        else:
            assert m["stop_reason"] == "max_tokens" and len(uses) >= 2 and set(uses) == {"add"}


def test_a_tool_named_like_a_mode_is_forced_by_name_on_every_endpoint(server):
    """A tool named "required", "auto" or "none" (valid OpenAI names) forced by name is one call of that tool on
    chat, Responses and Messages: the named choice reached the grammar as the bare string, so "required" meant any
    tool one or more times, "auto" maybe text, and "none" no tools at all and a text answer. ignore_eos: only the
    grammar can end the answer. A name the tools lack is a 400 naming tool_choice, "auto" too, and so is a named
    choice with no tools (it was a 200 for "none": the tool choice was read as the mode)."""
    import httpx

    def post(path, body, status=200):
        r = httpx.post(server.url + path, timeout=120, json={"temperature": 0, "ignore_eos": True, **body})
        assert r.status_code == status, (path, body, r.text)
        return r.json()

    for name in ("required", "auto", "none"):
        tools = [{"type": "function", "function": {"name": name, "description": "Add two integers",
                                                   "parameters": ADD}}, TOOLS[1]]
        c = post("/v1/chat/completions", {"messages": Q, "tools": tools, "max_tokens": 300,
                                          "tool_choice": {"type": "function", "function": {"name": name}}})
        c = c["choices"][0]
        assert c["finish_reason"] == "tool_calls", (name, c)
        assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == [name], c
        flat = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                for t in tools]
        r = post("/v1/responses", {"input": Q[0]["content"], "tools": flat, "max_output_tokens": 300,
                                   "tool_choice": {"type": "function", "name": name}})
        assert r["status"] == "completed", (name, r)
        assert [o["name"] for o in r["output"] if o["type"] == "function_call"] == [name], r
        assert not [o for o in r["output"] if o["type"] == "message"], r
        anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                           for t in tools]
        m = post("/v1/messages", {"model": "m", "messages": Q, "tools": anthropic_tools, "max_tokens": 300,
                                  "tool_choice": {"type": "tool", "name": name}})
        assert m["stop_reason"] == "tool_use", (name, m)
        assert [b["name"] for b in m["content"] if b["type"] == "tool_use"] == [name], m
        assert not [b for b in m["content"] if b["type"] == "text"], m
        # a name the tools lack: the 400 of any unknown name (TOOLS has no tool of these names)
        e = post("/v1/chat/completions", {"messages": Q, "tools": TOOLS, "max_tokens": 5,
                                          "tool_choice": {"type": "function", "function": {"name": name}}}, 400)
        assert e["error"]["param"] == "tool_choice" and name in e["error"]["message"], e
        e = post("/v1/messages", {"model": "m", "messages": Q, "max_tokens": 5,
                                  "tool_choice": {"type": "tool", "name": name}}, 400)
        assert "tool_choice" in json.dumps(e) and name in json.dumps(e), e


def test_a_grammar_beside_tools_is_refused_whatever_the_choice(server):
    """A GBNF grammar cannot go with tools (llama-server: "Cannot use custom grammar constraints with tools."):
    tool_choice auto said so, but required, a named function and allowed_tools required dropped the grammar
    unread (an invalid one too) and answered with a call."""
    import httpx

    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "add"}}, allowed):
        for grammar in ('root ::= "yes" | "no"', "root ::= oops"):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "messages": Q, "tools": TOOLS, "tool_choice": choice, "max_tokens": 20, "temperature": 0,
                "grammar": grammar})
            assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", (choice, grammar, r.text)
