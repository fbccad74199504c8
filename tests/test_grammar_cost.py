"""What one structured-output spec may cost the server (engine/runtime/grammar_cost.py, constraints._Compiler).

A 24-byte pattern with nested counted repetitions ((a{1000}){1000}) took ~0.5 s per token's mask, set the pace of
every sequence in the step and kept ~400 MB in the compile cache; compiles past the time limit ran on in threads
nobody counted. Now such a spec is refused by its text before anything compiles (the same answer under any load),
ordinary patterns still compile, at most COMPILE_SLOTS compiles run at once (refused ones included), a spec asked
for while it compiles joins that compile, and the cache is bounded in bytes."""
import threading

import pytest

from bitnet_cpu.engine.api import Constraint, ConstraintError, load_model
from bitnet_cpu.engine.errors import GrammarBusyError
from bitnet_cpu.engine.runtime import constraints as C
from bitnet_cpu.engine.runtime.grammar_cost import MAX_REPEAT_COST, regex_cost

LIMIT = f"{MAX_REPEAT_COST:,}"


@pytest.fixture(scope="module")
def llm():
    m = load_model(None, progress=False)
    yield m
    m.close()


def _compiler(llm):
    llm.compile_constraint("json")   # makes the tokenizer's compiler
    return C._COMPILERS[llm.tokenizer]


def _compile_threads() -> int:
    return sum(t.name == "bitnet-grammar-compile" and t.is_alive() for t in threading.enumerate())


COSTLY = [
    (Constraint.regex("^(a{1000}){1000}$"), ["regex", '"^(a{1000}){1000}$"']),
    (Constraint.regex("^(a{300}){300}$"), ["90,300"]),
    (Constraint.json_schema({"type": "string", "pattern": "^(a{1000}){999}$"}, where="response_format"),
     ["response_format: at the schema's root: pattern", "(a{1000}){999}"]),
    (Constraint.json_schema({"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "pattern": "(ab{100}){300}"}}}}), ["at /properties/tags/items: pattern"]),
    (Constraint.json_schema({"type": "object", "patternProperties": {"^(x{500}){500}$": {"type": "integer"}}}),
     ["at /patternProperties: patternProperties key pattern"]),
    (Constraint.gbnf('root ::= s\ns ::= ([a]{1000}){1000}'), ["GBNF grammar: rule s:"]),
    (Constraint.gbnf('root ::= t{1000}\nt ::= "a"{1000}'), ["GBNF grammar: rule root:", "1,000,000"]),
    (Constraint.gbnf('root ::= ("a"{300}){300}'), ["rule root"]),
    (Constraint.lark('start: /(a{1000}){1000}/'), ["Lark grammar: regex"]),
    # a one-character class however it is written is a literal to the engine
    (Constraint.regex("^([a-a]{1000}){1000}$"), ["regex"]),
    (Constraint.regex(r"^([\x61]{1000}){1000}$"), ["regex"]),
    (Constraint.regex(r"^([\u0061]{1000}){1000}$"), ["regex"]),
    (Constraint.regex(r"^([\x61a]{1000}){1000}$"), ["regex"]),
    (Constraint.regex(r"^([^\x00-\x60\x62-\U0010FFFF]{1000}){1000}$"), ["regex"]),
    (Constraint.json_schema({"type": "string", "pattern": "^([a-a]{1000}){1000}$"}), ["at the schema's root"]),
    # verbose mode (the engine's syntax): the space is no atom, the count applies to the group
    (Constraint.regex("(?x)(a{1000}) {1000}"), ["regex"]),
    (Constraint.regex("(?x)(a{1000}) # a comment\n{1000}"), ["regex"]),
    (Constraint.lark('start: /(?x)(a{1000}) {1000}/'), ["Lark grammar: regex"]),
    # a JSON Schema inside a Lark grammar (%json): its patterns count too
    (Constraint.lark('start: "a" | b\nb: %json {"type": "string", "pattern": "^(a{1000}){1000}$"}'),
     ["Lark grammar: %json", "pattern"]),
]


@pytest.mark.parametrize("spec,words", COSTLY, ids=[s.source[:30] for s, _ in COSTLY])
def test_a_costly_spec_is_refused_by_its_text_before_any_compile(llm, spec, words):
    comp = _compiler(llm)
    started = comp.compiles_started
    for attempt in range(2):   # the same answer every time
        with pytest.raises(ConstraintError) as e:
            llm.compile_constraint(spec)
        text = str(e.value)
        assert LIMIT in text and "counted repetitions" in text, text
        for w in words:
            assert w in text, (w, text)
        assert "\n" not in text
    assert comp.compiles_started == started   # refused by the static check: no compile thread was started
    with pytest.raises(ConstraintError, match=LIMIT):   # and without a tokenizer (the tools' check path)
        C.check(spec)


ORDINARY = [
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "date", "pattern": "^2024-"},
    {"type": "string", "pattern": "^.{0,5000}$"},
    {"type": "string", "pattern": r"^[a-z]{1,64}(\.[a-z]{1,64}){0,10}$"},
    {"type": "string", "pattern": r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d*$"},   # pydantic's Decimal
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    {"type": "string", "pattern": "^([a-z]{1000}){1000}$"},   # runs of a class cost the engine nothing
    {"type": "string", "pattern": "^(a{100}){100}$"},          # 10,100: within the limit
    {"type": "string", "pattern": "^(?:apple|banana|cherry)$"},
]


@pytest.mark.parametrize("schema", ORDINARY, ids=[s.get("pattern", s.get("format")) for s in ORDINARY])
def test_ordinary_patterns_still_compile(llm, schema):
    assert llm.compile_constraint(Constraint.json_schema(schema)) is not None


def test_a_long_alternation_of_words_costs_nothing():
    """Only counted repetitions count: a pattern listing many words (within the size limit) is not refused."""
    words = "|".join(f"word{i:05d}" for i in range(5000))
    assert regex_cost(f"^(?:{words})$") == 0
    assert regex_cost("^(a{300}){300}$") > MAX_REPEAT_COST >= regex_cost("^(a{100}){100}$")
    assert regex_cost("^([a]{1000}){300}$") > MAX_REPEAT_COST   # a class of one character is a literal
    for free in ("[ab]", "[a-b]", r"[\x61\x62]", r"[\d]", "[^a]", r"[^\x00-\x60\x63-\U0010FFFF]", "[[:alpha:]]"):
        assert regex_cost(f"^({free}{{1000}}){{1000}}$") == 0, free


def test_the_refusal_s_example_is_the_measured_cost():
    from bitnet_cpu.engine.runtime.grammar_cost import too_costly
    assert "(a{300}){300} is 90,300" in too_costly(30_000) and str(regex_cost("(a{300}){300}")) == "90300"


@pytest.mark.parametrize("spec", [Constraint.gbnf('root ::= "a"{' + "1" * 5000 + "}"), Constraint.regex("a{\u00b2}"),
                                  Constraint.regex("a{" + "1" * 5000 + "}"), Constraint.lark("start: /a{\u00b2}/"),
                                  Constraint.regex("a{1," + "9" * 5000 + "}")], ids=range(5))
def test_a_huge_or_odd_count_is_a_constraint_error_not_a_value_error(llm, spec):
    """A count of 5000 digits (or a superscript digit) raised Python's own ValueError (a 500 on the server)."""
    for attempt in (lambda: spec.refuse_costly(), lambda: llm.compile_constraint(spec)):
        try:
            attempt()
        except ConstraintError as e:
            assert "\n" not in str(e) and "4300" not in str(e), str(e)
        # (a pattern the engine takes is served: only a raw ValueError / other exception fails)


@pytest.mark.parametrize("pattern", ["(?x)(a{10}) {10}", "(?i)abc", "a(?s).b", "(?x:a b)"])
def test_an_inline_flag_in_a_json_schema_pattern_is_refused(llm, pattern):
    """ECMA-262 patterns have no inline flags ((?x) hid a count from the cost check): refused, in one line."""
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema({"type": "string", "pattern": pattern}))
    assert "inline flag" in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConstraintError, match="inline flag"):
        llm.compile_constraint(Constraint.json_schema({"type": "object", "patternProperties": {pattern: {}}}))


def test_a_format_beside_tools_is_costed_before_it_goes_into_the_grammar(llm):
    """A format sent with tools (choice auto) went into the Lark grammar as %json {...}, and its patterns were never
    costed: now refused, naming the format's field, the pointer and the limit."""
    from bitnet_cpu.engine.runtime.tools import functions_from_tools, tool_format, with_answer_format
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    calls = tool_format(None).constraint(functions_from_tools(tools), "auto", True)
    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
           "required": ["x"]}
    with pytest.raises(ConstraintError) as e:
        both = with_answer_format(calls, Constraint.json_schema(bad, where="response_format"))
        llm.compile_constraint(both)
    text = str(e.value)
    assert text.startswith("response_format") and "/properties/x" in text and LIMIT in text, text


def test_a_busy_server_answers_busy_and_starts_nothing(llm, monkeypatch):
    """Every compile slot taken (here by the test itself): a new spec waits its turn up to COMPILE_WAIT_S, then
    gets GrammarBusyError (a 503 to retry: not the spec's fault); nothing was started or left behind."""
    comp = _compiler(llm)
    monkeypatch.setattr(C, "COMPILE_WAIT_S", 0.05)
    taken = [C._COMPILE_SLOTS.acquire(timeout=60) for _ in range(C.COMPILE_SLOTS)]
    try:
        assert all(taken)
        started = comp.compiles_started
        with pytest.raises(GrammarBusyError, match="busy compiling"):
            llm.compile_constraint(Constraint.regex("^busy-[0-9]{3}$"))
        assert comp.compiles_started == started and not comp._jobs
    finally:
        for _ in taken:
            C._COMPILE_SLOTS.release()
    assert llm.compile_constraint(Constraint.regex("^busy-[0-9]{3}$")) is not None   # a slot free: served


def test_a_spec_asked_for_while_it_compiles_joins_that_compile(llm):
    """Two requests for one spec start one compile: the second waits for the first's."""
    comp = _compiler(llm)
    spec = Constraint.json_schema({"type": "object", "properties": {"joined": {"type": "integer"}}})
    key = (spec.kind, spec.source)
    taken = [C._COMPILE_SLOTS.acquire(timeout=60) for _ in range(C.COMPILE_SLOTS)]
    results, threads = [], []
    try:
        started = comp.compiles_started
        for where in ("first", "second"):
            threads.append(threading.Thread(target=lambda w=where: results.append(llm.compile_constraint(
                Constraint.json_schema(spec.source, where=w)))))
            threads[-1].start()
            for _ in range(2000):   # bounded: until the first one's compile is registered (waiting for a slot)
                if key in comp._jobs:
                    break
                threading.Event().wait(0.005)
            assert key in comp._jobs
    finally:
        for _ in taken:
            C._COMPILE_SLOTS.release()
    for t in threads:
        t.join(120)
    assert len(results) == 2 and comp.compiles_started == started + 1
    assert {r.spec.where for r in results} == {"first", "second"}


def test_compiles_past_the_time_limit_do_not_pile_up(llm, monkeypatch):
    """A compile past COMPILE_TIMEOUT_S is refused to its request and runs on to its end in its slot: however
    many such requests come, at most COMPILE_SLOTS compile threads live, and each one's work ends up cached (the
    same spec asked again is served without a new compile)."""
    comp = _compiler(llm)
    monkeypatch.setattr(C, "COMPILE_TIMEOUT_S", 0.0)   # every new compile is "too slow" for its request
    monkeypatch.setattr(C, "COMPILE_WAIT_S", 120.0)
    specs = [Constraint.json_schema({"type": "object", "properties": {f"p{i}_{k}": {"type": "integer"}
                                                                      for k in range(200)}}) for i in range(8)]
    most = 0
    for spec in specs:
        try:
            llm.compile_constraint(spec)
        except ConstraintError as e:
            assert "took more than" in str(e)
        most = max(most, _compile_threads())
        assert _compile_threads() <= C.COMPILE_SLOTS
    assert most <= C.COMPILE_SLOTS
    for _ in range(12000):   # bounded wait for the last ones to end
        if not comp._jobs and _compile_threads() == 0:
            break
        threading.Event().wait(0.01)
    assert not comp._jobs and _compile_threads() == 0
    started = comp.compiles_started
    for spec in specs:   # their work was not lost: all cached (CACHE_BYTES holds these small specs)
        assert llm.compile_constraint(spec) is not None
    assert comp.compiles_started == started


def test_the_cache_is_bounded_in_bytes(llm, monkeypatch):
    """CACHE_BYTES bounds the estimated memory of the cached specs (each at least 64 KiB): with room for three,
    at most three stay, the newest among them, and the total never passes the budget."""
    comp = _compiler(llm)
    monkeypatch.setattr(C, "CACHE_BYTES", 3 * (64 << 10))
    for i in range(10):
        llm.compile_constraint(Constraint.regex(f"^bytes{i}-[0-9]{{2}}$"))
        assert comp.cached_bytes <= C.CACHE_BYTES
    assert len(comp._cache) <= 3
    assert ("regex", "^bytes9-[0-9]{2}$") in comp._cache   # the newest stays


@pytest.mark.parametrize("value", ["256M", "-5", "1.5", ""])
def test_a_bad_cache_size_is_one_line_naming_the_variable(llm, monkeypatch, value):
    """BITNET_GRAMMAR_CACHE_MB=256M was a raw traceback at import (every command failed); -5 was taken silently."""
    from bitnet_cpu.engine.errors import BitNetError
    monkeypatch.setenv("BITNET_GRAMMAR_CACHE_MB", value)
    with pytest.raises(BitNetError) as e:
        llm.compile_constraint(Constraint.regex(f"^cachemb-{len(value)}[0-9]$"))
    assert "BITNET_GRAMMAR_CACHE_MB" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("BITNET_GRAMMAR_CACHE_MB", "0")   # 0: nothing is cached, everything still compiles
    comp = _compiler(llm)
    assert llm.compile_constraint(Constraint.regex("^cachemb-zero[0-9]$")) is not None
    assert ("regex", "^cachemb-zero[0-9]$") not in comp._cache


def test_a_thread_that_cannot_start_gives_its_slot_back(llm, monkeypatch):
    """A compile thread that failed to start (can't start new thread) kept its slot and its job: two such failures
    and every new spec was a 503 for good, and the spec itself waited 60 s on every later request."""
    import threading as T
    comp = _compiler(llm)

    class NoStart(T.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")
    monkeypatch.setattr(C.threading, "Thread", NoStart)
    spec = Constraint.regex("^nostart-[0-9]{3}$")
    for _ in range(C.COMPILE_SLOTS + 1):
        with pytest.raises(GrammarBusyError) as e:
            llm.compile_constraint(spec)
        assert "\n" not in str(e.value)
        assert (spec.kind, spec.source) not in comp._jobs
    monkeypatch.undo()
    taken = [C._COMPILE_SLOTS.acquire(blocking=False) for _ in range(C.COMPILE_SLOTS)]
    for t in taken:
        if t:
            C._COMPILE_SLOTS.release()
    assert all(taken)
    assert llm.compile_constraint(spec) is not None


def test_a_remembered_refusal_keeps_no_traceback(llm):
    """A refused spec's stored error kept its traceback, and with it the parsed schema and matchers."""
    comp = _compiler(llm)
    spec = Constraint.json_schema({"type": "array", "items": {"type": "string"}, "uniqueItems": True,
                                   "description": "remembered"})
    with pytest.raises(ConstraintError):
        llm.compile_constraint(spec)
    kept = list(comp._refused.values())
    assert kept and all(e.__traceback__ is None for e in kept)
    with pytest.raises(ConstraintError, match="uniqueItems"):
        llm.compile_constraint(spec)


def test_a_schema_nested_past_the_engine_s_depth_says_the_limit(llm):
    """An object nested 200 deep was refused with "recursion limit exceeded at line 1 column 2220", a place in
    the grammar engine's internal text: now the nesting limit, in the schema's terms."""
    node = {"type": "integer"}
    for _ in range(200):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema(node))
    assert "nested too deeply" in str(e.value) and "128 levels" in str(e.value) and "line 1" not in str(e.value)


@pytest.mark.parametrize("step", [1e-300, 1e-20, 123456789012345])
def test_a_multipleof_the_engine_cannot_write_is_named_as_sent(llm, step):
    """The grammar engine's refusal showed its own reading of the double (9999999999999992 for 1e-300) and said
    nothing of the limit; now the client's number, where it stands and the limit."""
    schema = {"type": "object", "properties": {"v": {"type": "number", "multipleOf": step}}}
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema(schema))
    text = str(e.value)
    assert f"at /properties/v: multipleOf {step!r}" in text and "9 significant digits" in text, text
    assert "999999" not in text


def test_a_huge_bound_is_shown_with_its_size_not_cut_to_another_number(llm):
    """minimum 10^300 was shown as 40 digits, which reads as 10^39."""
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.json_schema({"type": "integer", "minimum": 10 ** 300}))
    assert "(301 digits)" in str(e.value), str(e.value)


def test_a_body_nested_past_the_parser_says_the_limit_not_invalid_json():
    """A JSON Schema 500 objects deep is valid JSON, 7 KB: it was "request body is not valid JSON: nested too
    deeply"; now the body's nesting limit, in one line."""
    from bitnet_cpu.serve.offload import BodyRefused, parse_bounded
    body = '{"format": ' + '{"type": "object", "properties": {"a": ' * 500 + '{"type": "integer"}' + "}}" * 500 + "}"
    with pytest.raises(BodyRefused) as e:
        parse_bounded(body.encode(), None)
    text = e.value.detail
    assert "nested too deeply" in text and "levels" in text and "not valid JSON" not in text, text


def test_the_size_estimate_leaves_out_file_pages(tmp_path):
    """A compile's size was the process's whole RSS growth, file-backed pages included: the model's weights paged
    in by forward passes during a compile were charged to the spec (hundreds of MB for a small schema, which
    flushed the cache). Only anonymous memory counts now."""
    import mmap
    path = tmp_path / "pages.bin"
    path.write_bytes(b"\1" * (64 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        before = C._rss_bytes()
        assert sum(m[i] for i in range(0, len(m), 4096)) == (64 << 20) // 4096   # every page touched
        assert C._rss_bytes() - before < (16 << 20)
