"""Structured output (engine/runtime/constraints.py): every answer parses and validates, in every sampler mode,
with and without prompt lookup and jump-forward, alone and batched; GBNF grammars from llama.cpp's examples give
only strings the grammar accepts; what cannot be enforced is refused with the field named and leaves nothing
behind. The validators (json, jsonschema, small parsers below) are independent of the grammar engine."""
import json
import re

import jsonschema
import numpy as np
import pytest

from bitnet_cpu.engine.api import Constraint, ConstraintError, LookupParams, SamplingParams, load_engine, load_model
from bitnet_cpu.engine.runtime.constraints import MAX_SPEC_BYTES

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
SCHEMAS = {
    "object": PERSON,
    "nested": {"type": "object", "additionalProperties": False, "required": ["owner", "pet"],
               "properties": {"owner": PERSON, "pet": {"type": "object", "additionalProperties": False, "required": ["kind"],
                                                       "properties": {"kind": {"enum": ["cat", "dog", "owl"]}}}}},
    "array_bounds": {"type": "object", "additionalProperties": False, "required": ["tags"],
                     "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 4,
                                             "items": {"type": "string", "maxLength": 6}}}},
    "enum_const": {"type": "object", "additionalProperties": False, "required": ["color", "v"],
                   "properties": {"color": {"enum": ["red", "green", "blue"]}, "v": {"const": 3}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["x"],
               "properties": {"x": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"},
                                              {"type": "string", "maxLength": 4}]}}},
    "ref_defs": {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                     "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
                 "type": "object", "additionalProperties": False, "required": ["a", "b"],
                 "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}},
    "formats_patterns": {"type": "object", "additionalProperties": False, "required": ["day", "code", "mail"],
                         "properties": {"day": {"type": "string", "format": "date"},
                                        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                        "mail": {"type": "string", "format": "email", "maxLength": 24}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["p", "q"],
                "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1},
                               "q": {"type": "integer", "exclusiveMinimum": 10, "maximum": 99}}},
    "optional_keys": {"type": "object", "additionalProperties": False, "required": ["id"],
                      "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50},
                                     "note": {"type": "string", "maxLength": 10}}},
}
MODES = {
    "greedy": SamplingParams(temperature=0),
    "temp1": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7),
    "top_k_p_min_p_penalty": SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.1, repeat_penalty=1.3, seed=3),
}
MAX_TOKENS = 200   # every schema above completes well within this (bounded strings and numbers)


@pytest.fixture(scope="module")
def llm():
    m = load_model(None, progress=False)
    yield m
    m.close()


def _ask(llm, text):
    return llm.chat_prompt([{"role": "user", "content": text}])


def _run(llm, ids, params, constraint, **kw):
    chunks = list(llm.generate(ids, params, max_tokens=kw.pop("max_tokens", MAX_TOKENS), constraint=constraint, **kw))
    return "".join(c.text for c in chunks), [c.token for c in chunks if c.token is not None], chunks[-1]



@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_answer_validates(llm, name, mode):
    schema = SCHEMAS[name]
    text, _, last = _run(llm, _ask(llm, f"Answer with JSON ({name})."), MODES[mode], Constraint.json_schema(schema))
    assert last.finish_reason == "eos", (text, last.finish_reason)
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.mark.parametrize("mode", ["greedy", "temp1"])
def test_lookup_and_jump_forward_give_the_same_tokens(llm, mode):
    """Prompt lookup drafts and forced-token drafts never change a token (greedy and seeded sampling)."""
    schema = SCHEMAS["nested"]
    ids = _ask(llm, "A pet and its owner as JSON, please. " * 3)
    outs = {}
    for jf in (False, True):
        for lk in (LookupParams(draft_max=0), LookupParams(draft_max=6, ngram_min=1)):
            _, toks, last = _run(llm, ids, MODES[mode], Constraint.json_schema(schema, jump_forward=jf), lookup=lk)
            outs[(jf, lk.draft_max)] = (toks, last.stats.n_drafted, last.stats.n_accepted)
    base = outs[(False, 0)]
    assert base[1] == 0
    for key, (toks, drafted, accepted) in outs.items():
        assert toks == base[0], key
    # the grammar forces most of this schema (keys, punctuation, the enum's words): jump-forward drafted them
    toks, drafted, accepted = outs[(True, 0)]
    assert accepted > len(toks) // 4, (accepted, len(toks))


def test_batched_equals_alone_with_jump_forward(llm):
    eng = load_engine(None, progress=False, parallel=8)
    try:
        c = Constraint.json_schema(SCHEMAS["array_bounds"])
        prompts = [eng.chat_prompt([{"role": "user", "content": f"Tags for item {i}"}]) for i in range(8)]
        streams = [eng.submit(p, SamplingParams(temperature=1.0, seed=i), max_tokens=MAX_TOKENS, constraint=c)
                   for i, p in enumerate(prompts)]
        for i, (st, p) in enumerate(zip(streams, prompts)):
            got = list(st)
            text = "".join(ch.text for ch in got)
            jsonschema.validate(json.loads(text), SCHEMAS["array_bounds"])
            _, alone, _ = _run(llm, p, SamplingParams(temperature=1.0, seed=i), c)
            assert [ch.token for ch in got if ch.token is not None] == alone, i
        met = eng.metrics()   # forced tokens ran as drafts, counted apart from prompt lookup's (which is off)
        assert met["forced_accepted_total"] > 0 and met["lookup_drafted_total"] == met["lookup_accepted_total"] == 0
        eng.check_consistency()
    finally:
        eng.close()


def test_json_object_and_regex(llm):
    text, _, last = _run(llm, _ask(llm, "Some JSON"), MODES["temp1"], "json")
    assert isinstance(json.loads(text), dict)
    rx = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}\."
    text, _, last = _run(llm, _ask(llm, "Say something"), MODES["temp1"], Constraint.regex(rx))
    assert re.fullmatch(rx, text), text
    assert last.finish_reason == "eos"


def test_the_boolean_schemas_are_constraints_as_documented(llm):
    """structured-output.md: wherever a schema goes, true is one (any JSON value) and false matches none.
    constraint=True was refused as "expected a Constraint ... got True", and False got the same generic line."""
    text, _, last = _run(llm, _ask(llm, "Some JSON"), MODES["greedy"], True, max_tokens=60)
    assert last.finish_reason == "eos" and text.strip(), text
    json.loads(text)
    assert llm.compile_constraint(True).spec == Constraint.json_schema(True, where="constraint")
    with load_engine(None, progress=False, parallel=1) as eng:
        assert eng.compile_constraint(True).spec == Constraint.json_schema(True, where="constraint")
        with pytest.raises(ConstraintError, match="the schema false matches no value"):
            eng.submit("Q", max_tokens=4, constraint=False)
    with pytest.raises(ConstraintError, match="the schema false matches no value"):
        llm.generate("Q", max_tokens=4, constraint=False)
    for other in (1, 0, "true", ["json"]):   # not the booleans: still refused naming what is taken
        with pytest.raises(ConstraintError, match="expected a Constraint, a JSON Schema"):
            llm.generate("Q", max_tokens=4, constraint=other)


def test_cannot_complete_within_max_tokens_is_length(llm):
    text, toks, last = _run(llm, _ask(llm, "JSON"), MODES["greedy"], Constraint.json_schema(SCHEMAS["nested"]),
                            max_tokens=5)
    assert last.finish_reason == "length" and len(toks) == 5


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm):
    text, _, last = _run(llm, _ask(llm, "JSON"), MODES["greedy"], Constraint.json_schema(PERSON), ignore_eos=True)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("grammar", ['root ::= ""', 'root ::= [a-z]{0}'])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_complete_at_the_start_ends_with_no_token(llm, grammar, ignore_eos):
    """Only end of text can come: with ignore_eos every logit was -inf and the request failed as corrupt weights,
    and without it the end of text counted as a generated token. Alone and batched alike."""
    c = Constraint.gbnf(grammar)
    ids = _ask(llm, "Say nothing.")
    chunks = list(llm.generate(ids, MODES["temp1"], max_tokens=8, constraint=c, ignore_eos=ignore_eos))
    assert "".join(ch.text for ch in chunks) == "" and chunks[-1].finish_reason == "eos"
    assert chunks[-1].stats.n_generated == 0
    eng = load_engine(None, progress=False, parallel=2)
    try:
        got = list(eng.submit(ids, MODES["temp1"], max_tokens=8, constraint=c, ignore_eos=ignore_eos))
        assert "".join(ch.text for ch in got) == "" and got[-1].finish_reason == "eos"
        assert got[-1].stats.n_generated == 0
        eng.check_consistency()
    finally:
        eng.close()


def test_done_waits_for_a_mask_being_computed(llm):
    """The batching scheduler asks `done` before its first sample, while the helper thread may still compute the
    mask started during the prefill: the grammar engine's matcher, borrowed twice, failed the sequence
    ("Already mutably borrowed", a 500 now and then). `done` now takes the mask first."""
    c = llm.compile_constraint(Constraint.gbnf(ARITHMETIC))
    for _ in range(300):
        m = c.matcher()
        m.start_mask()
        assert not m.done
        assert m._pending is None   # nothing left running on the matcher: the race cannot happen


def _in_a_forked_child(work) -> str:
    """work() run in a fork()ed child (an alarm bounds it: a hang is a failure); what it returned."""
    import os
    import signal

    if not hasattr(os, "fork"):
        pytest.skip("no fork() on this platform")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report on the pipe, never return into pytest
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(60)
            os.write(w, work().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, got)
    return got


def test_structured_output_in_a_forked_child_after_the_parent_used_it(llm):
    """fork() after a constrained generation (multiprocessing's 'fork', gunicorn --preload): the child inherited
    the mask pool but not its thread, and its constrained generation waited for ever -- with the parent's LLM and
    with a model or engine loaded in the child (the documented remedy) alike."""
    ids = _ask(llm, "Describe a person as JSON.")
    want, _, _ = _run(llm, ids, MODES["greedy"], PERSON)
    jsonschema.validate(json.loads(want), PERSON)

    def work():
        outs = [_run(llm, ids, MODES["greedy"], PERSON)[0]]
        with load_model(None, progress=False) as own:
            outs.append(_run(own, ids, MODES["greedy"], PERSON)[0])
        with load_engine(None, parallel=2, progress=False) as eng:
            outs.append("".join(c.text for c in eng.submit(ids, MODES["greedy"], max_tokens=MAX_TOKENS,
                                                           constraint=PERSON)))
        return json.dumps(outs)
    for text in json.loads(_in_a_forked_child(work)):
        jsonschema.validate(json.loads(text), PERSON)
        assert text == want   # greedy: the child's answer is the parent's


def test_a_mask_queued_at_fork_is_computed_in_the_child(llm):
    """A matcher whose mask was queued on the parent's pool thread when the process forked: the child computes
    it itself (the queued job never runs there) and gets the mask a fresh matcher gets."""
    import threading

    from bitnet_cpu.engine.runtime.constraints import MASK_WORKERS, _mask_pool

    c = llm.compile_constraint(PERSON)
    n = c.n_vocab
    busy, release = [threading.Event() for _ in range(MASK_WORKERS)], threading.Event()
    for b in busy:   # every thread of the pool, taken
        _mask_pool().submit(lambda b=b: (b.set(), release.wait(60)))
    for b in busy:
        b.wait(30)
    m = c.matcher()
    m.start_mask()   # queued behind it

    def work():
        got, ref = np.zeros(n, np.float32), np.zeros(n, np.float32)
        m.apply(got)
        c.matcher().apply(ref)
        return "same" if np.array_equal(np.isinf(got), np.isinf(ref)) and np.isinf(got).any() else "different"
    try:
        assert _in_a_forked_child(work) == "same"
    finally:
        release.set()
    m.apply(np.zeros(n, np.float32))   # the parent's own queued job still runs


def test_a_length_cut_inside_a_character_is_a_true_prefix(llm):
    """max_tokens ending inside a multi-byte character ('日本語' is 9 bytes, a token each here) gave '日\ufffd': the
    character begun is dropped, so the text is a prefix of the whole answer. Alone and batched alike."""
    c, want = Constraint.gbnf('root ::= "日本語"'), "日本語"
    ids = _ask(llm, "Say it.")
    eng = load_engine(None, progress=False, parallel=2)
    try:
        cut = 0
        for n in range(1, 10):
            alone = list(llm.generate(ids, MODES["greedy"], max_tokens=n, constraint=c))
            batched = list(eng.submit(ids, MODES["greedy"], max_tokens=n, constraint=c))
            for chunks in (alone, batched):
                text = "".join(ch.text for ch in chunks)
                assert want.startswith(text), (n, text)
                cut += chunks[-1].finish_reason == "length" and len(text.encode()) < 9
    finally:
        eng.close()
    assert cut >= 2   # some cut did fall inside a character


# ---- unbounded integers get int64's range ---------------------------------------------------------------------
INT64 = (-2 ** 63, 2 ** 63 - 1)
TWO_INTS = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


@pytest.mark.parametrize("question", ["What is 1001+889?", "Give me two numbers as JSON.", "What is 17*3?"])
def test_unbounded_integers_end_in_int64(llm, question):
    """Unbounded, the bundled model writes digits until max_tokens ('{"a":29901099901990900199...', finish
    length); bounded, each answer ends well within 600 tokens, parses, and every integer fits int64."""
    text, _, last = _run(llm, _ask(llm, question), MODES["greedy"], Constraint.json_schema(TWO_INTS), max_tokens=600)
    assert last.finish_reason != "length", text[:200]
    got = json.loads(text)
    jsonschema.validate(got, TWO_INTS)
    assert all(INT64[0] <= v <= INT64[1] for v in got.values()), got


def test_unbounded_integer_in_a_forced_tool_call_ends_in_int64(llm):
    from bitnet_cpu.engine.runtime.tools import functions_from_tools, tool_format
    tools = [{"type": "function", "function": {"name": "add", "parameters": TWO_INTS}}]
    fmt = tool_format(None)
    spec = fmt.constraint(functions_from_tools(tools), "required", False)
    text, _, last = _run(llm, llm.chat_prompt([{"role": "user", "content": "What is 1001+889?"}], tools=tools),
                         MODES["greedy"], spec, max_tokens=600)
    assert last.finish_reason != "length", text[:200]
    parser = fmt.parser()
    _, calls = parser.feed(text)
    calls += parser.finish()[1]
    args = json.loads(calls[0]["function"]["arguments"])
    assert all(INT64[0] <= v <= INT64[1] for v in args.values()), args


def test_bounded_integers_rewrites_only_unbounded_integers():
    from bitnet_cpu.engine.runtime.constraints import INT_BOUND, bounded_integers
    b = (-INT_BOUND, INT_BOUND)
    schema = {"type": "object", "properties": {
        "i": {"type": "integer"}, "lo": {"type": "integer", "minimum": 3}, "hi": {"type": "integer", "exclusiveMaximum": 9},
        "n": {"type": "number"}, "in": {"type": ["integer", "null"]}, "mixed": {"type": ["integer", "number"]},
        "arr": {"type": "array", "items": {"type": "integer"}}, "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "type": {"$ref": "#/$defs/x"}, "enum": {"type": "integer", "enum": [1, 2]},
        "c": {"const": {"type": "integer"}}, "d4": {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
        "big": {"type": "integer", "maximum": 1e30}},
        "$defs": {"x": {"type": "integer", "maximum": 5}}}
    out = bounded_integers(schema)
    p = out["properties"]
    assert (p["i"]["minimum"], p["i"]["maximum"]) == b
    assert (p["lo"]["minimum"], p["lo"]["maximum"]) == (3, b[1])
    assert p["hi"] == {"type": "integer", "exclusiveMaximum": 9, "minimum": b[0]}
    assert p["n"] == {"type": "number"} and p["mixed"] == {"type": ["integer", "number"]}
    assert (p["in"]["minimum"], p["in"]["maximum"]) == b
    assert (p["arr"]["items"]["minimum"], p["any"]["anyOf"][0]["maximum"]) == (b[0], b[1])
    assert out["$defs"]["x"] == {"type": "integer", "maximum": 5, "minimum": b[0]}
    assert p["c"] == {"const": {"type": "integer"}}   # data, not a schema
    assert p["d4"] == {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": b[1]}
    assert p["big"] == {"type": "integer", "maximum": 1e30}   # past int64 on purpose: left as the schema says
    assert schema["properties"]["i"] == {"type": "integer"}   # a copy: the caller's schema is untouched


# ---- GBNF grammars from llama.cpp's grammars/ folder (arithmetic, list, json), checked by our own parsers ----
ARITHMETIC = r'''
root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
'''
LIST = r'''
root ::= item+
# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
'''
JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
'''


def _arith_ok(text: str) -> bool:
    """A recursive-descent parser of the arithmetic grammar (whole text)."""
    pos = 0

    def ws():
        nonlocal pos
        while pos < len(text) and text[pos] in " \t\n":
            pos += 1

    def term():
        nonlocal pos
        m = re.compile(r"[a-z][a-z0-9_]*|[0-9]+").match(text, pos)
        if m:
            pos = m.end()
            ws()
            return True
        if text.startswith("(", pos):
            pos += 1
            ws()
            if not expr() or not text.startswith(")", pos):
                return False
            pos += 1
            ws()
            return True
        return False

    def expr():
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "-+*/":
            pos += 1
            if not term():
                return False
        return True

    lines = 0
    while pos < len(text):
        if not expr() or not text.startswith("=", pos):
            return False
        pos += 1
        ws()
        if not term():
            return False
        # the term's trailing ws may have eaten the "\n" line end: the grammar needs one "\n" after it
        if text[pos - 1] != "\n":
            return False
        lines += 1
    return lines >= 1


@pytest.mark.parametrize("mode", ["greedy", "temp1"])
def test_gbnf_examples_from_llama_cpp(llm, mode):
    params = MODES[mode]
    text, _, last = _run(llm, _ask(llm, "Some sums"), params, Constraint.gbnf(ARITHMETIC), max_tokens=60)
    if last.finish_reason == "eos":
        assert _arith_ok(text), text
    else:   # cut at max_tokens: what came is still a prefix the grammar admits (checked token by token by the mask)
        assert last.finish_reason == "length" and re.fullmatch(r"[a-z0-9_()+\-*/= \t\n]*", text), text
    text, _, last = _run(llm, _ask(llm, "A list"), params, Constraint.gbnf(LIST), max_tokens=60)
    item = r"- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n"
    whole = f"({item})+" if last.finish_reason == "eos" else f"({item})*(- [^\n]*)?"
    assert re.fullmatch(whole, text), text
    text, _, last = _run(llm, _ask(llm, "JSON"), params, Constraint.gbnf(JSON_GBNF), max_tokens=150)
    if last.finish_reason == "eos":
        assert isinstance(json.loads(text), dict), text


# ---- what cannot be enforced ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, words", [
    (lambda: Constraint.json_schema({"type": "strin"}), "strin"),
    (lambda: Constraint.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}), "nope"),
    (lambda: Constraint.json_schema({"type": "string", "format": "no-such-format"}), "no-such-format"),
    (lambda: Constraint.json_schema("[1, 2"), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "must be a JSON object"),
    (lambda: Constraint.regex("a(b"), "unclosed group"),
    (lambda: Constraint.gbnf('root ::= "a'), "GBNF"),
    (lambda: Constraint.gbnf("root ::= undefined-rule"), "undefined-rule"),
    (lambda: Constraint.json_schema({"enum": ["x" * 1000] * (MAX_SPEC_BYTES // 1000 + 1)}), "KiB limit"),
    # integers past 64 bits the grammar engine cannot write: the double's digits are another number, no integer
    # within int64's range meets the bound
    (lambda: Constraint.json_schema({"const": 2 ** 64}), "past 2^53"),
    (lambda: Constraint.json_schema({"enum": [1, 10 ** 400]}), "past 2^53"),
    (lambda: Constraint.json_schema({"type": "integer", "minimum": 10 ** 20}), "int64"),
    (lambda: Constraint.json_schema({"type": "integer", "exclusiveMaximum": -(10 ** 20)}), "int64"),
    # integers no double equals (the grammar engine's numbers): they were rounded to another value, silently
    (lambda: Constraint.json_schema({"const": 9007199254740993}), "past 2^53"),
    (lambda: Constraint.json_schema({"type": "integer", "enum": [1, 1234567890123456789]}), "past 2^53"),
    # a key the grammar may repeat would count twice towards minProperties
    (lambda: Constraint.json_schema({"type": "object", "additionalProperties": {"type": "integer"},
                                     "minProperties": 2}), "minProperties"),
    # grammars no text matches: refused when compiled, not by the first step of a request (an engine error)
    (lambda: Constraint.gbnf('root ::= root "a"'), "no text matches it"),
    (lambda: Constraint.gbnf('root ::= "a" | "b" x\nx ::= x "c"'), None),
    # schemas no finite JSON matches: refused when compiled, not by the engine's item limit mid-generation (a 500)
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
     "no finite JSON value"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
                                     "required": ["v", "next"]}), "no finite JSON value"),
    (lambda: Constraint.json_schema({"$defs": {"A": {"type": "object", "required": ["b"], "properties": {
        "b": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/A"}}}}}, "$ref": "#/$defs/A"}),
     "no finite JSON value"),
    (lambda: Constraint.json_schema({"$ref": "#"}), "no finite JSON value"),
    # a lone UTF-16 surrogate is not text: said so, as for a prompt (it was the codec's "can't encode character")
    (lambda: Constraint.regex("a\ud83d"), "regex: holds a lone UTF-16 surrogate (\\ud83d): not text"),
    (lambda: Constraint.json_schema({"const": "\ud83d"}), "json_schema: holds a lone UTF-16 surrogate (\\ud83d)"),
    # uniqueItems false asks for nothing (JSON Schema's default, which schema generators write)
    (lambda: Constraint.json_schema({"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False}}}), None),
    # a way out (an optional key, null, minItems 0) is no error
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}}), None),
    (lambda: Constraint.json_schema({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}},
                                     "required": ["a"]}), None),
    (lambda: Constraint.json_schema({"$defs": {"A": {"type": "object", "required": ["b"], "properties": {
        "b": {"type": "array", "items": {"$ref": "#/$defs/A"}}}}}, "$ref": "#/$defs/A"}), None),
])
def test_refused_with_the_reason(llm, spec, words):
    if words is None:   # a grammar with a dead branch beside a live one is no error: it matches "a"; a schema
        # with a way out of its recursion neither
        assert llm.compile_constraint(spec()) is not None
        return
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(spec())
    assert words in str(e.value)


@pytest.mark.parametrize("bounds", [{"minimum": 0, "maximum": 1e19}, {"minimum": 1e20}, {"exclusiveMinimum": 1e307},
                                    {"minimum": -1e20}])
def test_number_bounds_too_large_say_what_is_supported(llm, bounds):
    """A number's bounds past what the grammar engine's digit ranges hold were refused in its internal words
    ("Failed to generate regex for float range: min=Some(0.0), max=Some(1e19)"); now in ours, saying which range
    is supported, and bounds within it compile."""
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema({"type": "number", **bounds}))
    assert "within -10^17 .. 10^17" in str(e.value) and "Some(" not in str(e.value), e.value
    for inside in ({"minimum": -1e17, "maximum": 1e17}, {"minimum": 1e17}, {"exclusiveMaximum": -1e17}):
        schema = {"type": "number", **inside}
        assert llm.compile_constraint(Constraint.json_schema(schema)) is not None, schema


def test_unique_items_false_is_taken_and_asks_for_nothing(llm):
    """uniqueItems false was a 400 "Unimplemented keys": it is JSON Schema's default, so duplicates stay allowed;
    true is still refused (a grammar cannot keep items unique)."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "uniqueItems": False}
    assert _complete(llm, schema, "[1,1]") and jsonschema.Draft202012Validator(schema).is_valid([1, 1])
    with pytest.raises(ConstraintError, match="uniqueItems"):
        llm.compile_constraint(Constraint.json_schema({**schema, "uniqueItems": True}))


def test_key_counts_over_listed_keys_are_refused_with_advice_that_works(llm):
    """min/maxProperties over keys listed in properties: the grammar engine counts them only where every key is
    required, or one key past the required ones. What it cannot count is refused by this check, never by the
    engine's own words (this check had advised listing the keys, and the engine then refused that form in turn),
    and the form advised compiles."""
    props = {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in "abc"}
    for n_req in range(3):   # each count over 3 listed keys (closed), of which n_req are required
        for name in ("minProperties", "maxProperties"):
            for v in range(n_req if name == "maxProperties" else 0, 5):
                schema = {"type": "object", "properties": props, "required": list("abc"[:n_req]), name: v,
                          "additionalProperties": False}
                try:
                    llm.compile_constraint(Constraint.json_schema(schema))
                except ConstraintError as e:
                    assert f"{name} {v} over optional keys" in str(e) and "listed in" not in str(e), (schema, e)
    schema = {"type": "object", "properties": props, "minProperties": 2, "additionalProperties": False}
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema(schema))
    assert "make every key in properties required" in str(e.value) and "minProperties / maxProperties 1" in str(e.value)
    for advised in ({"required": list(props)}, {"minProperties": 1}):
        assert llm.compile_constraint(Constraint.json_schema({**schema, **advised})) is not None


@pytest.mark.parametrize("n,required", [(600, True), (600, False), (1200, True)])
def test_schemas_of_thousands_of_properties_are_enforced(llm, n, required):
    """OpenAI takes up to 5,000 properties; llguidance's default limits refused 600 required ones (its lexer's
    initial fuel) and 600 optional enums (an Earley row's items). Each answer still obeys the schema."""
    props = {f"p{i}": ({"type": "integer"} if i % 2 else {"enum": ["a", "b"]})
             for i in range(n)}
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = list(props)
    text, _, last = _run(llm, _ask(llm, "JSON"), SamplingParams(temperature=1.0, seed=3),
                         Constraint.json_schema(schema), max_tokens=60)
    assert last.finish_reason in ("eos", "length") and text.startswith("{")
    if last.finish_reason == "eos":
        jsonschema.validate(json.loads(text), schema)


def test_refused_request_leaves_nothing_behind():
    eng = load_engine(None, progress=False, parallel=2)
    try:
        before = eng.metrics()
        for bad in ({"type": "strin"}, {"type": "array", "uniqueItems": True}):
            with pytest.raises(ConstraintError):
                eng.submit(eng.tokenize("hi", add_bos=True), max_tokens=4, constraint=bad)
        after = eng.metrics()
        assert after["requests_total"] == before["requests_total"] and after["waiting"] == 0
        assert after["kv_pages_used"] == before["kv_pages_used"]
        eng.check_consistency()
        ok = list(eng.submit(eng.tokenize("hi", add_bos=True), max_tokens=40, constraint="json"))
        assert ok[-1].finish_reason in ("eos", "length")
    finally:
        eng.close()


def test_sentencepiece_tokenizer_is_converted(tmp_path):
    """A model with a sentencepiece tokenizer.model (1bitLLM style) is constrained too, not refused."""
    pytest.importorskip("sentencepiece")
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, write_hf_dir

    m = SynthModel(seed=3, style="1bitllm")
    store = convert(write_hf_dir(m, str(tmp_path / "hf")), str(tmp_path / "spm.bnstore"), progress=False)
    sp_llm = load_model(store, progress=False)
    try:
        assert sp_llm.tokenizer.kind == "sentencepiece"
        schema = {"type": "object", "additionalProperties": False, "required": ["w"],
                  "properties": {"w": {"type": "string", "maxLength": 5}}}
        for seed in range(3):
            ids = sp_llm.tokenize("The answer is", add_bos=True)
            text, _, last = _run(sp_llm, ids, SamplingParams(temperature=1.0, seed=seed), Constraint.json_schema(schema),
                                 max_tokens=60)
            assert last.finish_reason == "eos", text
            jsonschema.validate(json.loads(text), schema)
    finally:
        sp_llm.close()


def _complete(llm, schema, text) -> bool:
    """Whether the compiled schema takes `text` whole, as a finished answer."""
    from test_tools import takes
    return takes(llm, Constraint.json_schema(schema), text)


def test_listed_properties_only_unless_the_schema_opens_more(llm):
    """An object schema that lists properties and says nothing of others has only those, as llama.cpp's and
    ollama's json-schema-to-grammar read it: the bundled model then answers {"answer": ...} and stops, where it
    ran on inventing keys to max_tokens. additionalProperties true / a schema keeps others; allOf's parts stay
    open (closed, each would refuse the other's keys)."""
    answer = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    ids = llm.chat_prompt([{"role": "system", "content": "Answer in JSON."},
                           {"role": "user", "content": "Is it raining?"}])
    text, _, last = _run(llm, ids, MODES["greedy"], Constraint.json_schema(answer), max_tokens=60)
    assert last.finish_reason != "length", text
    assert set(json.loads(text)) == {"answer"}
    assert _complete(llm, answer, '{"answer":"no"}') and not _complete(llm, answer, '{"answer":"no","x":1}')
    nested = {"type": "object", "properties": {"p": answer}}
    assert not _complete(llm, nested, '{"p":{"answer":"no","x":1}}')
    assert _complete(llm, {**answer, "additionalProperties": True}, '{"answer":"no","x":1}')
    assert _complete(llm, {**answer, "additionalProperties": {"type": "integer"}}, '{"answer":"no","x":1}')
    parts = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                       {"$ref": "#/$defs/B"}],
             "$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}}}
    assert _complete(llm, parts, '{"a":1,"b":2}')
    # properties beside anyOf / $ref, and an anyOf inside an allOf part, combine with them (as llama.cpp merges)
    beside = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
              "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                        {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]}
    assert _complete(llm, beside, '{"kind":"k","x":1}')
    ref = {"$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}},
           "$ref": "#/$defs/B", "properties": {"c": {"type": "integer"}}, "required": ["c"]}
    assert _complete(llm, ref, '{"b":1,"c":2}')
    inner = {"allOf": [{"anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                                  {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
                       {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}]}
    assert _complete(llm, inner, '{"x":1,"c":2}')
    # a definition named by an escaped pointer or an anchor still combines; a required key that properties do not
    # list is allowed (closing would make it unsatisfiable)
    b = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    z = {"properties": {"z": {"type": "string"}}, "required": ["z"]}
    escaped = {"$defs": {"a b": b}, "allOf": [{"$ref": "#/$defs/a%20b"}, z]}
    anchored = {"$defs": {"b": {**b, "$anchor": "base"}}, "allOf": [{"$ref": "#base"}, z]}
    assert _complete(llm, escaped, '{"id":1,"z":"q"}') and _complete(llm, anchored, '{"id":1,"z":"q"}')
    unlisted = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]}
    assert _complete(llm, unlisted, '{"a":1,"zz":2}')
    # one key is one key: minProperties 1 over free keys (pydantic's non-empty dict) is enforced, not refused
    nonempty = {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 1}
    assert _complete(llm, nonempty, '{"a":"x"}') and not _complete(llm, nonempty, "{}")
    # tool parameters and a format beside tools read the same way
    from bitnet_cpu.engine.runtime.tools import functions_from_tools, tool_format, with_answer_format
    tools = [{"type": "function", "function": {"name": "f", "parameters": answer}}]
    fmt = tool_format(None)
    calls = fmt.constraint(functions_from_tools(tools), "required", False)
    from test_tools import takes

    def call(args):   # a call's JSON with the templates' separators
        return '<tool_call>\n{"name": "f", "arguments": ' + args + '}\n</tool_call>'
    assert takes(llm, calls, call('{"answer": "no"}')) and not takes(llm, calls, call('{"answer": "no", "x": 1}'))
    both = with_answer_format(fmt.constraint(functions_from_tools(tools), "auto", True),
                              Constraint.json_schema(answer))
    assert takes(llm, both, '{"answer":"no"}') and not takes(llm, both, '{"answer":"no","x":1}')


def test_integers_a_double_holds_are_kept_exactly(llm):
    """Past 2^53 an integer that is a double is enforced as written; a bound that is not one is rounded inward
    (int64's maximum, 2^63 - 1, as pydantic writes it, is 2^63 - 1024; minimum 2^53 + 1 took 2^53)."""
    assert not _complete(llm, {"type": "integer", "minimum": 2 ** 53 + 1}, str(2 ** 53))
    assert _complete(llm, {"type": "integer", "minimum": 2 ** 53 + 1}, str(2 ** 53 + 2))
    int64 = {"type": "integer", "minimum": 0, "maximum": 2 ** 63 - 1}
    assert _complete(llm, int64, str(2 ** 63 - 1024)) and not _complete(llm, int64, str(2 ** 63))
    big = 2 ** 62 + 2 ** 10
    assert _complete(llm, {"type": "integer", "enum": [big]}, str(big))
    assert not _complete(llm, {"type": "integer", "enum": [big]}, str(big + 1))
    assert _complete(llm, {"const": -big}, str(-big))


def test_integers_past_64_bits_in_bounds_and_values(llm):
    """A bound past int64's range holds integers to it (the grammar engine's integers are 64-bit), a const / enum
    integer past 64 bits is enforced where a double's digits write it (10^20), and default / examples enforce
    nothing: each was a 400 "Value is not JSON serializable"."""
    for bounds in ({"maximum": 2 ** 64}, {"minimum": -(10 ** 20), "exclusiveMaximum": 10 ** 20}):
        schema = {"type": "integer", **bounds}
        assert _complete(llm, schema, "-7") and _complete(llm, schema, str(2 ** 63 - 1024))
        assert not _complete(llm, schema, str(2 ** 63))
    beside = {"type": "integer", "maximum": 5, "exclusiveMaximum": 10 ** 20}   # the tighter bound stands
    assert _complete(llm, beside, "5") and not _complete(llm, beside, "6")
    assert _complete(llm, {"const": 10 ** 20}, str(10 ** 20)) and not _complete(llm, {"const": 10 ** 20}, "1e+20")
    values = {"enum": [10 ** 20, -(10 ** 30), "a"]}
    assert _complete(llm, values, str(-(10 ** 30))) and _complete(llm, values, '"a"')
    assert not _complete(llm, values, str(10 ** 20 + 1))
    assert _complete(llm, {"const": {"a": [10 ** 20]}}, '{"a":[100000000000000000000]}')
    assert _complete(llm, {"type": "string", "default": 2 ** 70 + 1, "examples": [10 ** 400]}, '"a"')


@pytest.mark.parametrize("bounds, excluded, inside", [
    ({"exclusiveMinimum": 0, "exclusiveMaximum": 0.5}, "0", "0.3"),
    ({"exclusiveMinimum": 0, "exclusiveMaximum": 0.1}, "0", "0.05"),
    ({"exclusiveMinimum": 1, "exclusiveMaximum": 1.5}, "1", "1.2"),
    ({"exclusiveMinimum": 10, "maximum": 10.5}, "10", "10.5"),
    ({"exclusiveMinimum": 3, "exclusiveMaximum": 3.001}, "3", "3.0005"),
    ({"exclusiveMinimum": -1.5, "exclusiveMaximum": -1}, "-1", "-1.2"),
    ({"exclusiveMinimum": -0.25, "exclusiveMaximum": 0}, "-0", "-0.1"),
    ({"minimum": 0, "exclusiveMinimum": True, "maximum": 0.5}, "0", "0.25"),   # draft 4's flag
    ({"exclusiveMinimum": 0, "exclusiveMaximum": 0.3, "multipleOf": 0.1}, "0", "0.2")])
def test_a_number_s_exclusive_bound_within_one_integer_step_is_excluded(llm, bounds, excluded, inside):
    """A number between two bounds in one integer step: the grammar engine's range of decimals took the bare
    integer bound itself ((0, 0.5) gave 0, (-1.5, -1) gave -1), which jsonschema rejects."""
    schema = {"type": "number", **bounds}
    assert not _complete(llm, schema, excluded) and _complete(llm, schema, inside)
    obj = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    validator = (jsonschema.Draft4Validator if bounds.get("exclusiveMinimum") is True
                 else jsonschema.Draft202012Validator)(obj)
    for text in (f'{{"a":{excluded}}}', f'{{"a":{inside}}}'):   # the grammar's verdicts are jsonschema's
        assert _complete(llm, obj, text) == validator.is_valid(json.loads(text)), text
    for seed in range(3):
        text, _, last = _run(llm, _ask(llm, "A number?"), SamplingParams(temperature=1.0, seed=seed),
                             Constraint.json_schema(obj), max_tokens=40)
        if last.finish_reason == "eos":
            validator.validate(json.loads(text))


def test_multipleof_a_power_of_ten_caps_a_numbers_decimals_and_bounds_do_not(llm):
    """What docs/structured-output.md tells a user whose float ran on (llama.cpp caps a number at 16 digits each
    side of the point; nothing here does): minimum / maximum bound the integer part only, never the fraction's
    digits; multipleOf 0.01 allows at most two decimals; with both, a number's length is bounded."""
    bounded = {"type": "number", "minimum": 0, "maximum": 100}
    assert _complete(llm, bounded, "0." + "3" * 40) and not _complete(llm, bounded, "123")
    step = {"type": "number", "multipleOf": 0.01}
    assert _complete(llm, step, "12.34") and _complete(llm, step, "-3.5") and _complete(llm, step, "7")
    assert not _complete(llm, step, "12.345") and not _complete(llm, step, "0." + "3" * 40)
    both = {**bounded, **step}
    assert _complete(llm, both, "99.99") and not _complete(llm, both, "12.345") and not _complete(llm, both, "123")

@pytest.mark.parametrize("step", ["0.25", "0.125", "0.75", "0.15", "0.35", "2.25", "0.0625", "0.05", "1e-3"])
@pytest.mark.parametrize("bounds", [{}, {"minimum": 0, "maximum": 3}, {"anyOf": [{"minimum": 1}, {"maximum": -1}]}])
def test_multipleof_takes_every_multiple_in_its_shortest_form(llm, step, bounds):
    """multipleOf with decimals: the grammar engine took a multiple with as many decimals as the step or none, so
    0.25 refused 0.5 and 1.5 (only 1.50), 0.15 refused 0.3, 0.0625 refused 0.125: every multiple in its shortest
    form is taken now, every other number still refused (checked in exact fractions: jsonschema's floats call
    0.15 no multiple of 0.05)."""
    from decimal import Decimal
    from fractions import Fraction
    exact = Fraction(step)
    schema = {"type": "number", "multipleOf": float(step), **bounds}
    in_bounds = jsonschema.Draft202012Validator({"type": "number", **bounds})

    def shortest(f):
        return format((Decimal(f.numerator) / Decimal(f.denominator)).normalize(), "f")
    texts = [shortest(exact * k) for k in range(-10, 14)] + ["0.1", "0.7", "1.1", "0.35", "1.3", "4", "0.5", "1.5"]
    wrong = [t for t in texts
             if _complete(llm, schema, t) != (in_bounds.is_valid(float(t)) and Fraction(t) % exact == 0)]
    assert wrong == []
    some = next((t for t in texts if "." in t and in_bounds.is_valid(float(t)) and Fraction(t) % exact == 0
                and len(t.lstrip("-")) < len(shortest(exact))), "0")   # fewer decimals than the step
    assert _complete(llm, {"type": "object", "properties": {"a": schema}, "required": ["a"]}, '{"a":%s}' % some)


@pytest.mark.parametrize("bounds", [
    {"exclusiveMinimum": 2 ** 53, "exclusiveMaximum": 2 ** 53 + 4},
    {"exclusiveMinimum": 2 ** 53, "maximum": 2 ** 53 + 2},
    {"exclusiveMinimum": 2 ** 60}, {"exclusiveMaximum": 2 ** 60}, {"exclusiveMaximum": -(2 ** 60)},
    {"exclusiveMinimum": float(2 ** 53)}])
def test_an_exclusive_integer_bound_that_is_a_double_past_2_53_is_excluded(llm, bounds):
    """An exclusive integer bound past 2^53 that is a double: the grammar engine added 1 in doubles (2^53 + 1 is
    2^53) and took the bound itself; it is the inclusive bound inside, rounded inward, as one no double equals."""
    schema = {"type": "integer", **bounds}
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in bounds:
            v = int(bounds[key])
            assert not _complete(llm, schema, str(v)), (schema, v)
            step = 2 if abs(v) < 2 ** 54 else 256
            near = v + step if key == "exclusiveMinimum" else v - step
            assert _complete(llm, schema, str(near)) == jsonschema.Draft202012Validator(schema).is_valid(near)


@pytest.mark.parametrize("fmt, text, valid", [
    ("date", '"2024-02-29"', True), ("date", '"2000-02-29"', True), ("date", '"2023-02-29"', False),
    ("date", '"1900-02-29"', False), ("date", '"2023-04-31"', False), ("date", '"2023-12-31"', True),
    ("time", '"23:59:59Z"', True), ("time", '"10:00:00.123+01:00"', True), ("time", '"21:18:60+13:48"', False),
    ("date-time", '"2024-02-29t00:00:00.5-05:30"', True), ("date-time", '"1900-02-29T00:00:00Z"', False)])
def test_dates_and_times_are_rfc_3339_exactly(llm, fmt, text, valid):
    """date / time / date-time take what JSON Schema's format checker takes: February 29 in leap years only, no
    second 60 at any minute (the grammar engine's own formats took both)."""
    schema = {"type": "string", "format": fmt}
    assert _complete(llm, schema, text) == valid


@pytest.mark.parametrize("fmt, pattern, text, valid", [
    ("date", "^2023-02-2", '"2023-02-29"', False), ("date", "^2023-02-2", '"2023-02-28"', True),
    ("date-time", "^2023-", '"2023-02-29T00:00:00Z"', False), ("date-time", "^2023-", '"2023-01-01T00:00:60Z"', False),
    ("date-time", "Z$", '"2024-02-29T00:00:00Z"', True), ("time", "^1", '"10:00:60Z"', False),
    ("time", "^1", '"10:00:59Z"', True)])
def test_dates_and_times_beside_a_pattern_are_still_rfc_3339_exactly(llm, fmt, pattern, text, valid):
    """A pattern of the schema's own beside date / time / date-time: both hold. The grammar engine's loose format
    stayed in place then, and the answer to ^2023-02-2 was "2023-02-29", which the format checker refuses."""
    schema = {"type": "string", "format": fmt, "pattern": pattern}
    assert _complete(llm, schema, text) == valid
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert checker.is_valid(json.loads(text)) == valid   # the verdicts are the format checker's


def test_hostnames_and_emails_have_their_rfc_lengths(llm):
    """A hostname is at most 253 characters (RFC 1123), an email address 254 (RFC 5321): the grammar engine's own
    formats had no limit, and a small model wrote hostnames of 1,000 characters that ended as "stop". A smaller
    maxLength the schema gives still holds."""
    host = ".".join(["abcdefghi"] * 30)
    schema = {"type": "string", "format": "hostname"}
    assert _complete(llm, schema, f'"{host[:253]}"') and not _complete(llm, schema, f'"{host[:299]}"')
    assert not _complete(llm, {**schema, "maxLength": 20}, f'"{host[:29]}"')
    mail = {"type": "string", "format": "email"}
    local, domain = "a" * 60, ".".join(["b" * 60] * 4)
    assert _complete(llm, mail, f'"{local}@{domain[:193]}"') and not _complete(llm, mail, f'"{local}@{domain[:194]}"')


def test_an_email_s_local_part_is_at_most_64_characters(llm):
    """RFC 5321 caps the part before the "@" at 64 characters: the grammar engine's format had no such cap, and
    every sampled address ran to 254 characters with a local part of 252, which email validators refuse. Beside a
    pattern of the schema's own, both hold."""
    mail = {"type": "string", "format": "email"}
    assert _complete(llm, mail, f'"{"a" * 64}@b.com"') and not _complete(llm, mail, f'"{"a" * 65}@b.com"')
    assert _complete(llm, mail, f'"{"a." * 31}ab@b.com"') and not _complete(llm, mail, '"a..b@b.com"')
    own = {**mail, "pattern": "@example\\.com$"}
    assert _complete(llm, own, '"x.y@example.com"') and not _complete(llm, own, '"x.y@example.org"')
    assert not _complete(llm, own, f'"{"a" * 65}@example.com"')
    obj = {"type": "object", "properties": {"email": mail}, "required": ["email"], "additionalProperties": False}
    for seed in range(3):
        text, _, last = _run(llm, _ask(llm, "An email?"), SamplingParams(temperature=1.0, seed=seed),
                             Constraint.json_schema(obj), max_tokens=300)
        if last.finish_reason == "eos":
            address = json.loads(text)["email"]
            assert len(address.rpartition("@")[0]) <= 64 and len(address) <= 254, address


def test_a_pattern_s_dot_is_ecma_s(llm):
    """JSON Schema patterns are ECMA-262 regexes: `.` matches no line terminator (\\r, U+2028, U+2029 as well as
    \\n); the grammar engine's regexes took them. A dot in a class or escaped stays a dot."""
    schema = {"type": "string", "pattern": "^a.b$"}
    assert _complete(llm, schema, '"axb"')
    for text in ('"a\\rb"', '"a\\u2028b"', '"a\\u2029b"', '"a\\nb"'):
        assert not _complete(llm, schema, text), text
    assert _complete(llm, {"type": "string", "pattern": "^a[.]b\\.$"}, '"a.b."')


ECMA_SPACES = "\t\n\x0b\x0c\r \xa0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"   # ECMA-262's \s


def test_a_pattern_s_whitespace_and_classes_are_ecma_s(llm):
    """\\s is ECMA-262's set, not Rust's (which took U+0085, NEL, and refused U+FEFF), in and out of classes and
    negated; a `[` inside a class is a plain `[` (Rust's opens a nested class)."""
    def takes_char(pattern, ch):
        return _complete(llm, {"type": "string", "pattern": pattern}, json.dumps(ch, ensure_ascii=False))
    for ch in ECMA_SPACES + "\x85a,":
        space = ch in ECMA_SPACES
        assert takes_char("^\\s$", ch) == space and takes_char("^\\S$", ch) == (not space), ascii(ch)
        assert takes_char("^[\\s,]$", ch) == (space or ch == ","), ascii(ch)
        assert takes_char("^[^\\s,]$", ch) == (not space and ch != ","), ascii(ch)
    assert takes_char("^[a[b]$", "[") and takes_char("^[a[b]$", "b") and not takes_char("^[a[b]$", "c")


@pytest.mark.parametrize("pattern, words", [
    ("^[[:alpha:]]{3}$", "POSIX class"), ("^[[:digit:]]$", "POSIX class"), ("^[]a]$", "empty class"),
    ("^[^]a]$", "any-character class"), ("^[a&&b]$", "set operation"), ("^[a--b]$", "set operation")])
def test_pattern_syntax_ecma_reads_otherwise_is_refused(llm, pattern, words):
    """Constructs the grammar engine's (Rust) regexes read otherwise than ECMA-262: [[:alpha:]] took "uss", which
    ECMA (and Python's jsonschema) reject; [] is ECMA's empty class, which Rust read as a class holding ']'. A 400
    that names the construct and what to write, as for back-references and look-arounds."""
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema({"type": "string", "pattern": pattern}))
    assert words in str(e.value) and "write" in str(e.value) and pattern in str(e.value), e.value


def test_pydantic_s_decimal_pattern_is_enforced_as_written(llm):
    """pydantic writes a Decimal field as a number or a string whose pattern opens with a negative look-ahead
    (^(?!^[-+.]*$)...: not signs and dots alone); the grammar engine's regexes have no look-around, and every
    client's structured output with a Decimal field was a 400. A leading (?!C*$) / (?!C+$) is now enforced as the
    pattern AND some character outside C: what the grammar takes is what jsonschema (Python's re) takes."""
    from decimal import Decimal

    import pydantic

    class Price(pydantic.BaseModel):
        amount: Decimal

    schema = Price.model_json_schema()
    validator = jsonschema.Draft202012Validator(schema)
    texts = ["1.50", "-0.5", ".5", "5.", "+7", "007", "", "+", ".", "-.", "+-", "1.2.3", "1e5", "a1", " 1"]
    for t in texts:
        doc = {"amount": t}
        assert _complete(llm, schema, json.dumps(doc, separators=(",", ":"))) == validator.is_valid(doc), t
    assert _complete(llm, schema, '{"amount":2.25}') and _complete(llm, schema, '{"amount":"0.10"}')
    assert Price.model_validate_json('{"amount":"0.10"}').amount == Decimal("0.10")   # what it takes, pydantic reads


@pytest.mark.parametrize("pattern, texts", [
    ("^(?!\\s*$).{1,8}$", ["", " ", "  \t", " a", "a", "ab cd"]),
    ("^(?![0-9]+$)[a-z0-9]{0,6}$", ["", "0", "123", "1a", "abc", "a1b2"]),
    ("^(?!^[-+.]*$)(?!\\d*$)[-+.0-9a]*$", ["", "+", "12", "+1", "a", "1a", "-.a"]),
    # a negated class whose first member is ^: its complement is the class of ^ and the rest, not [^rest]
    ("^(?![^^a]*$).*", ["", "xyz", "a", "aaa", "^", "x^y", "xa"]),
    ("^(?![^^]*$).*", ["", "xyz", "^", "a^b"]),
    ("^(?![\\^a]+$).*", ["", "^", "a^", "xa", "b"]),
])
def test_a_leading_negative_look_ahead_of_one_class_is_enforced(llm, pattern, texts):
    schema = {"type": "string", "pattern": pattern}
    validator = jsonschema.Draft202012Validator(schema)
    for t in texts:
        assert _complete(llm, schema, json.dumps(t)) == validator.is_valid(t), (pattern, t)


@pytest.mark.parametrize("field, pattern, words", [
    ("code", "^(?=[A-Z])\\w+$", "look-around '(?='"), ("code", "^a(?!b)\\w*$", "look-around '(?!'"),
    ("code", "^(?<!x)y$", "look-around '(?<!'"), ("code", "^(?!\\s*$)a|b$", "look-around '(?!'"),
    ("code", "^(a)\\1$", "backreferences"), ("code", "^[[:alpha:]]$", "POSIX class")])
def test_a_pattern_it_cannot_enforce_is_refused_naming_where_it_stands(llm, field, pattern, words):
    """A look-around past the one form taken, a back-reference, a construct Rust's regexes read otherwise: the 400
    names the property (a JSON pointer into the schema as sent), quotes the pattern as the client wrote it (the
    engine's message quoted it rewritten, \\d as [0-9], and named no property), and says what to write."""
    schema = {"type": "object", "$defs": {"Item": {"type": "object", "properties": {
        field: {"anyOf": [{"type": "string", "pattern": pattern}, {"type": "null"}]}}}},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}}}
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema(schema, where="response_format.json_schema.schema"))
    msg = str(e.value)
    assert msg.startswith("response_format.json_schema.schema: at /$defs/Item/properties/code/anyOf/0: pattern ")
    assert json.dumps(pattern) in msg and words in msg and "write" in msg and "\n" not in msg, msg


def test_pydantic_s_set_and_bytes_are_refused_naming_the_field_and_what_to_write(llm):
    """set[str] (uniqueItems true) and bytes (format binary) were refused in the grammar engine's words
    ("Unimplemented keys: [\"uniqueItems\"]", "Unknown format: binary"), naming no field and no way out."""
    import pydantic

    class Tagged(pydantic.BaseModel):
        tags: set[str]

    class Blob(pydantic.BaseModel):
        data: bytes

    for model, where, words in ((Tagged, "/properties/tags", "list[str]"), (Blob, "/properties/data", "str")):
        with pytest.raises(ConstraintError) as e:
            llm.compile_constraint(Constraint.json_schema(model.model_json_schema(), where="schema"))
        assert str(e.value).startswith(f"schema: at {where}: ") and words in str(e.value), e.value
    schema = {"type": "string", "format": "idn-email"}   # any format it does not know: the ones it does are listed
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema(schema))
    assert "at the schema's root" in str(e.value) and "leave the format out" in str(e.value)
    from bitnet_cpu.engine.runtime.constraints import KNOWN_FORMATS
    for fmt in KNOWN_FORMATS:
        assert llm.compile_constraint(Constraint.json_schema({"type": "string", "format": fmt})) is not None, fmt


@pytest.mark.parametrize("mirostat", [1, 2])
def test_mirostat_under_a_grammar_that_leaves_one_token(llm, mirostat):
    """Mirostat 1 estimates a Zipf exponent over the tokens left: one left (a grammar's mask) made its formula
    0 / 0, a ZeroDivisionError that ended the answer as an engine error; as llama.cpp's float arithmetic, the one
    token left is taken."""
    params = SamplingParams(temperature=0.8, mirostat=mirostat, seed=3)
    text, _, last = _run(llm, _ask(llm, "yes?"), params, Constraint.gbnf('root ::= "yes"'), max_tokens=8)
    assert text == "yes" and last.finish_reason in ("eos", "stop")


def test_patternproperties_keys_read_as_ecma_patterns(llm):
    """A patternProperties key is a JSON Schema pattern (ECMA-262) as `pattern` is: the grammar engine read it as
    its own regex, so `.` took a carriage return in a key that jsonschema refuses, and a look-ahead, a POSIX class or
    a back-reference came back as the engine's parse error without saying which key; now the key is converted as
    `pattern` is, and each of those is refused naming patternProperties and the key."""
    schema = {"type": "object", "patternProperties": {"^x-.$": {"type": "integer"}, "^n\\sm$": {"type": "integer"}},
              "additionalProperties": False}
    # ECMA-262's verdicts (jsonschema's Python regexes are not ECMA's: their `.` takes "\\r")
    verdicts = {'{"x-a":1}': True, '{"x-\\r":1}': False, '{"x-\u2028":1}': False, '{"y":1}': False,
                '{"n m":1}': True, '{"n\ufeffm":1}': True, '{"n\u0085m":1}': False}
    assert {text: _complete(llm, schema, text) for text in verdicts} == verdicts
    for key, what in (("^(?!x)", "look-around"), ("^(?!\\s*$)", "look-ahead"), ("^[[:alpha:]]+$", "POSIX class"),
                      ("(a)\\1", "backreferences")):
        with pytest.raises(ConstraintError) as e:
            llm.compile_constraint(Constraint.json_schema(
                {"type": "object", "properties": {"p": {"patternProperties": {key: {"type": "string"}}}}}))
        message = str(e.value)
        assert "/properties/p/patternProperties" in message and json.dumps(key) in message and what in message


def test_patternproperties_keys_that_convert_alike_keep_both_schemas(llm):
    """Two keys that ECMA's conversion writes as the same pattern ("^x.$" and the class it stands for) were merged
    silently, the last one's schema winning: a key matching both now has to hold both schemas."""
    dot = "^x[^\\n\\r\u2028\u2029]$"
    schema = {"type": "object", "additionalProperties": False,
              "patternProperties": {"^x.$": {"type": "integer"}, dot: {"minimum": 5}}}
    assert _complete(llm, schema, '{"xa":7}')
    assert not _complete(llm, schema, '{"xa":3}')       # the second key's schema holds
    assert not _complete(llm, schema, '{"xa":"s"}')     # and the first's (it was a string schema's alone)


def test_a_refused_key_at_the_root_is_named_by_a_json_pointer(llm):
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema({"type": "object", "patternProperties": {"(a)\\1": {}}}))
    assert "at /patternProperties: key pattern" in str(e.value), str(e.value)
