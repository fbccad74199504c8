"""GBNF grammars mean what they mean in llama.cpp (engine/runtime/gbnf.py): matched character by character, so
a rule of characters never swallows what the grammar needs next. Each case says whether llama.cpp's parser
(src/llama-grammar.cpp, its documented syntax in grammars/README.md) takes a text; the compiled grammar is fed
the text's tokens and must take exactly the same. llguidance's own converter, used before, made every rule of
characters one greedy lexeme: the first four cases never completed, and several escapes and names were refused."""
from __future__ import annotations

import pytest

from bitnet_cpu.engine.api import Constraint, ConstraintError, load_model
from bitnet_cpu.engine.runtime.gbnf import GbnfError, gbnf_to_lark
from test_constraints import ARITHMETIC   # llama.cpp's grammars/arithmetic.gbnf

CASES = [   # grammar, texts it takes, texts it does not (a prefix of a match counts as not taken)
    (ARITHMETIC, ["1+2=3\n", "(3*4)-5 = x\n", "a = b\n\n\n"], ["1+2=3", "1+2\n"]),
    ('root ::= word "x"\nword ::= [a-z]+', ["abx", "xx", "xxx"], ["ab", "x"]),
    ('root ::= "Answer: " ans "."\nans ::= [^\\n]+', ["Answer: yes.", "Answer: a.b."], ["Answer: ."]),
    ('root ::= [a-z]* "end"', ["endend", "end", "xend"], ["en", "endx"]),
    ('root ::= ("a" | "ab") "b"', ["ab", "abb"], ["a", "abbb"]),
    ('root ::= "a" . "b"', ["a\nb", "axb"], ["ab"]),           # . is any character, a newline too
    ('root ::= [a\\-z]+', ["a-z", "-"], ["b"]),                 # \- in a class
    ('root ::= "\\[x\\]"', ["[x]"], ["x"]),                     # \[ \] in a literal
    ('root ::= "\\u00e9\\U0001F600\\x41"', ["\u00e9\U0001F600A"], ["\u00e9"]),
    ('root ::= [+--]+', ["+,-", "-"], ["."]),                   # a range from + to -, not a set operator
    ('root ::= [~~&&]', ["~", "&"], ["~~"]),
    ('root ::= start\nstart ::= "s"', ["s"], [""]),             # rule names llguidance's converter refused
    ('root ::= 2x\n2x ::= "q"', ["q"], [""]),
    ('root ::= fooBar foo-bar\nfooBar ::= "1"\nfoo-bar ::= "2"', ["12"], ["11", "22"]),
    ('root ::= ( "a" | "b" )* | # a comment\n  (\n "c"\n )', ["abab", "c", ""], ["ac"]),
    ('root ::= "x"{2,} "y"{0,2} "z"{1}', ["xxz", "xxxxyyz"], ["xz", "xxyyyz"]),
    ('root ::= ws "[" ws "]"\nws ::= | " " | "\\n" [ \\t]{0,2}', ["[]", " [\n  ]"], ["[\n   ]"]),
    # llama.cpp's own readings: a later definition replaces an earlier one, [] and [^] add nothing (the empty
    # string), a backwards range matches nothing, a maximum past 2,000 is no maximum, DEL is a character
    ('root ::= "a"\nroot ::= "b" [] [^] [z-a]?', ["b"], ["a"]),
    ('root ::= "x"{0,3000} "\x7f" | "(" root ")"', ["x" * 2500 + "\x7f", "(\x7f)"], ["x"]),
    # found by fuzzing against a reference recognizer: a part of a sequence that may be empty before a last
    # one (x's "ab" grows into "abb"), lexemes beside terminals of other paths, {0}
    ('root ::= x "b" | "(" root ")"\nx ::= "a" "b"? "b"', ["abb", "abbb"], ["ab"]),
    ('root ::= . r4 | "" | . root\nr4 ::= . . .', ["aaa", "", "a"], []),
    ('root ::= r1 "\\nb"\nr1 ::= r2 | r1 r2\nr2 ::= "\\nb"', ["\nb\nb", "\nb\nb\nb"], ["\nb"]),
    ('root ::= .+ r1 (root | "")\nr1 ::= . "\\n"', ["aa\n\n", "ab\n"], ["a\n"]),
    ('root ::= ("a" root){0} "b"', ["b"], ["ab"]),
    # a lexeme beside another terminal with the same first character: num would take "12" greedily
    ('root ::= num "a" | "1" [0-9] "b" | "(" root ")"\nnum ::= [0-9]+', ["12b", "12a", "(1a)"], ["12", "1b"]),
    ('root ::= w? "xy" | "(" root ")"\nw ::= [a-z]+ "!"', ["xy", "ab!xy", "(xy)"], ["x"]),
]


@pytest.fixture(scope="module")
def llm():
    m = load_model(None, threads=1, progress=False)
    yield m
    m.close()


def takes(llm, grammar: str, text: str) -> bool:
    m = llm.compile_constraint(Constraint.gbnf(grammar)).matcher()
    ids = llm.tokenize(text, add_bos=False) if text else []
    if m.valid_prefix(ids) != ids:
        return False
    for t in ids:
        m.advance(t)
    return m.accepting


@pytest.mark.parametrize("grammar,yes,no", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_takes_what_llama_cpp_takes(llm, grammar, yes, no):
    for text in yes:
        assert takes(llm, grammar, text), (grammar, text)
    for text in no:
        assert not takes(llm, grammar, text), (grammar, text)


def test_lexemes_only_where_greed_changes_nothing():
    """A rule of characters becomes one lexeme (fast masks on a large vocabulary) where nothing that could
    extend it may follow it, and stays character by character where something may."""
    lark = gbnf_to_lark(ARITHMETIC)
    assert "G" not in "".join(x.split(":")[0] for x in lark.splitlines())   # ws, num, ident: "\n" may follow
    json_like = 'root ::= "{" ws (string | root) ws "}"\nstring ::= "\\"" [a-z]* "\\""\nws ::= [ ]*'
    lexemes = [x.split(":")[0] for x in gbnf_to_lark(json_like).splitlines() if x[:1].isupper()]
    assert len(lexemes) == 2 and all("STRING" in x or "WS" in x for x in lexemes), lexemes


@pytest.mark.parametrize("grammar,words", [
    ('root ::= "a', "literal is not closed"),
    ('root ::= [a-', "class is not closed"),
    ('root ::= x', "'x' is used but never defined"),
    ('x ::= "a"', "no root rule"),
    ('root ::= "\\q"', "unknown escape \\q"),
    ('root ::= "\\u12"', "4 hex digits"),
    ('root ::= "a"{3,2}', "below its minimum"),
    ('root ::= "a"{2001}', "over 2000"),
    ('root ::= "a"{\u00b2}', "expected a number"),   # a digit, but not one llama.cpp reads
    ('root ::= !<[5]>', "negated tokens"),
    ('root ::= "a"\n  | "b"', "expected a rule name at line 2"),   # llama.cpp: a new line ends the rule
])
def test_syntax_errors_name_the_place(grammar, words):
    with pytest.raises(GbnfError) as e:
        gbnf_to_lark(grammar)
    assert words in str(e.value)


def _chain(n: int) -> str:
    """root -> r0 -> r1 -> ... -> rn, each rule naming the next: the texts x^k y (k < n) and x^n z."""
    return "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(n)) + f'r{n} ::= "z"\n'


@pytest.mark.parametrize("n", [50, 200, 990])
def test_a_long_chain_of_rules_takes_its_texts(llm, n):
    """Rules each naming the next (a form written field by field, 50 of them) were inlined into one regular
    expression past the regex engine's nesting limit and refused; 160+ ran out of Python's stack."""
    g = _chain(n)
    for text in ("y", "x" * 7 + "y", "x" * n + "z"):
        assert takes(llm, g, text), (n, text)
    for text in ("z", "x" * (n + 1) + "z", "x" * n + "y" + "y"):
        assert not takes(llm, g, text), (n, text)


def test_groups_nested_as_deep_as_allowed_take_their_texts(llm):
    g = 'root ::= ' + '("a" | ' * 50 + '"z"' + ')*' * 50
    for text in ("", "a", "aaz", "zzaz"):
        assert takes(llm, g, text), text
    assert not takes(llm, g, "b")


@pytest.mark.parametrize("grammar,words", [
    (_chain(1500), "rules chained 1502 deep"),   # llguidance's stack overflowed (the process died) at ~2000
    ('root ::= ' + '("a" ' * 60 + ')?' * 60, "groups nested more than 50 deep"),   # llguidance's own limit is near
], ids=["chain1500", "nested60"])
def test_too_deep_a_grammar_is_one_clear_error(llm, grammar, words):
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.gbnf(grammar))
    assert words in str(e.value)


def test_an_unknown_token_name_is_said_without_the_vocabulary(llm):
    """<foo> that is no special token: its name and how to write one, not a dump of every special token id."""
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.gbnf('root ::= "a" <foo> "b"'))
    assert '"<foo>"' in str(e.value) and "<[ID]>" in str(e.value) and "<[1279]>" not in str(e.value), str(e.value)


def test_a_grammar_no_text_matches_is_refused(llm):
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.gbnf('root ::= [^\\x00-\\U0010FFFF] | root "a"'))
    assert "no text matches it" in str(e.value)


@pytest.mark.parametrize("grammar", [
    'root ::= "a" root',
    'root ::= [a-z]{1,3} "." tail\ntail ::= "x" tail',
    'root ::= item+\nitem ::= "(" item ")"',
], ids=["self", "tail", "nested"])
def test_a_grammar_with_no_finite_text_is_refused(llm, grammar):
    """Every path never ends: the grammar engine forced "x" after "x" until its own limit, mid-generation (a 500
    after some tokens); refused before generating instead."""
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.gbnf(grammar))
    assert "no text matches it (no finite text)" in str(e.value), str(e.value)


def test_a_branch_that_never_ends_is_never_taken(llm):
    """ "b" leads only into a rule that never ends: the model biased hard against "a" took "b" and the request
    failed mid-generation; the branch is cut, so "a" is the answer."""
    from bitnet_cpu.engine.api import SamplingParams
    a = llm.tokenize("a", add_bos=False)
    assert len(a) == 1
    params = SamplingParams(temperature=0, logit_bias={a[0]: -100.0})
    c = Constraint.gbnf('root ::= "a" | "b" tail\ntail ::= "x" tail')
    chunks = list(llm.generate(llm.tokenize("Say b.", add_bos=True), params, max_tokens=8, constraint=c))
    assert "".join(ch.text for ch in chunks) == "a" and chunks[-1].finish_reason == "eos"


def _analysis_calls(grammar: str) -> int:
    """Calls of the converter's analysis functions while converting (or refusing) a grammar: a measure of its
    work, not of time."""
    import sys
    from bitnet_cpu.engine.runtime import gbnf
    n = [0]

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == gbnf.__file__ and frame.f_code.co_name in (
                "nul", "fst", "_walk"):
            n[0] += 1
    sys.setprofile(count)
    try:
        gbnf.gbnf_to_lark(grammar)
    except GbnfError:
        pass
    finally:
        sys.setprofile(None)
    return n[0]


def _back_chain(n: int) -> str:
    """root -> r1 -> ... -> rn, each rule naming the next first: `r1 ::= r2 "x"` (the text a x^(n-1))."""
    return "root ::= r1\n" + "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(1, n)) + f'r{n} ::= "a"\n'


def test_the_analysis_grows_linearly_with_a_chain_of_rules():
    """Nullable / first / follow were computed by full passes until nothing changed: one pass per level of a
    chain, quadratic (a chain of 900 accepted, with 3000 one-line rules beside it, took 15 s)."""
    small, large = _analysis_calls(_back_chain(200)), _analysis_calls(_back_chain(800))
    assert large < 6 * small, (small, large)   # 4 times the rules: 16 times the work when quadratic


@pytest.mark.parametrize("n", [2000, 4000])
def test_a_chain_too_deep_is_refused_before_the_analysis(llm, n):
    """A chain past the depth limit was refused only after the (quadratic) analysis: 23 s for 2000 rules, 148 s
    for 4000, outside the compile time limit."""
    assert _analysis_calls(_back_chain(n)) == 0
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.gbnf(_back_chain(n)))
    assert f"rules chained {n + 1} deep" in str(e.value), str(e.value)


def test_the_conversion_runs_inside_the_timed_compile(llm):
    """A spec's conversion (the GBNF analysis, a schema's rewriting) counts in the compile time limit: it ran on
    the caller's thread before the timed one started."""
    import threading
    threads = []

    class Watched(Constraint):
        def grammar(self):
            threads.append(threading.current_thread().name)
            return super().grammar()

    llm.compile_constraint(Watched("gbnf", 'root ::= "watched" [0-9]', "grammar"))
    assert threads == ["bitnet-grammar-compile"], threads


# ---- random grammars against a reference recognizer -----------------------------------------------------------
ALPHABET = "abx \n"


def _show(x) -> str:
    """A tree of gbnf._Parser's shape as GBNF text."""
    k = x[0]
    if k == "lit":
        return '"' + "".join({"\n": "\\n", '"': '\\"', "\\": "\\\\"}.get(chr(c), chr(c)) for c in x[1]) + '"'
    if k == "cls":
        neg, ranges = x[2], x[1]
        if ranges == "any":
            return "."
        body = "".join({"\n": "\\n"}.get(chr(c), chr(c)) for c, _ in ranges)
        return f"[{'^' if neg else ''}{body}]"
    if k == "ref":
        return x[1]
    if k == "seq":
        return " ".join(_show(y) for y in x[1])
    if k == "alt":
        return "(" + " | ".join(_show(y) for y in x[1]) + ")"
    _, y, lo, hi = x
    op = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi), "{%d,%s}" % (lo, "" if hi is None else hi))
    return f"({_show(y)}){op}"


def _random_node(rng, names, depth):
    r = rng.random()
    if depth > 2 or r < 0.35:
        t = rng.random()
        if t < 0.35:
            return ("lit", [ord(c) for c in rng.choice(["", "a", "b", "ab", "x\n", " a", "ba"])])
        if t < 0.7:
            chars = sorted(set(rng.sample(ALPHABET, rng.randint(1, 3))))
            return ("cls", [(ord(c), ord(c)) for c in chars], rng.random() < 0.3)
        if t < 0.8:
            return ("cls", "any", False)
        return ("ref", rng.choice(names))
    if r < 0.6:
        return ("seq", [_random_node(rng, names, depth + 1) for _ in range(rng.randint(2, 3))])
    if r < 0.8:
        return ("alt", [_random_node(rng, names, depth + 1) for _ in range(rng.randint(2, 3))])
    lo, hi = rng.choice([(0, None), (1, None), (0, 1), (2, 3), (0, 0), (1, 2)])
    return ("rep", _random_node(rng, names, depth + 1), lo, hi)


def _derive(rules: dict, x, rng, budget: list) -> str:
    """A random string of x's language (budget[0]: the references left; past it, the shortest-looking way)."""
    k = x[0]
    if k == "lit":
        return "".join(map(chr, x[1]))
    if k == "cls":
        if x[1] == "any":
            return rng.choice(ALPHABET)
        inside = [chr(c) for c, _ in x[1]]
        pool = [c for c in ALPHABET if c not in inside] if x[2] else inside
        return rng.choice(pool) if pool else "\x00"
    if k == "ref":
        budget[0] -= 1
        return _derive(rules, rules[x[1]], rng, budget) if budget[0] > 0 else "\x00"
    if k == "seq":
        return "".join(_derive(rules, y, rng, budget) for y in x[1])
    if k == "alt":
        return _derive(rules, rng.choice(x[1]), rng, budget)
    _, y, lo, hi = x
    times = rng.randint(lo, lo + 2 if hi is None else hi) if budget[0] > 0 else lo
    return "".join(_derive(rules, y, rng, budget) for _ in range(times))


def _reference_takes(rules: dict, text: str) -> bool:
    """Whether root derives text, by a fixpoint over (rule, start) -> ends (left recursion included)."""
    n = len(text)
    table = {(r, i): set() for r in rules for i in range(n + 1)}

    def ends(x, i) -> set:
        k = x[0]
        if k == "lit":
            s = "".join(map(chr, x[1]))
            return {i + len(s)} if text.startswith(s, i) else set()
        if k == "cls":
            if i >= n:
                return set()
            inside = True if x[1] == "any" else any(ord(text[i]) == c for c, _ in x[1])
            return {i + 1} if inside != x[2] else set()
        if k == "ref":
            return set(table[(x[1], i)])
        if k == "seq":
            cur = {i}
            for y in x[1]:
                cur = {e for j in cur for e in ends(y, j)}
            return cur
        if k == "alt":
            return set().union(*(ends(y, i) for y in x[1]))
        _, y, lo, hi = x
        cur, out = {i}, set()
        for count in range(n + 2 if hi is None else hi + 1):
            if count >= lo:
                out |= cur
            cur = {e for j in cur for e in ends(y, j)}
        return out

    changed = True
    while changed:
        changed = False
        for (r, i), got in table.items():
            new = ends(rules[r], i)
            if new - got:
                got |= new
                changed = True
    return n in table[("root", 0)]


def test_random_grammars_take_what_a_reference_recognizer_takes(llm):
    """400 random grammars (recursion, classes, negation, ., repetitions, empty literals) and strings of a small
    alphabet: the compiled grammar takes a string exactly when a plain context-free recognizer does. A fuzzer
    like this one found the lexeme choices that lost paths (a later part of a sequence that may be empty, a
    lexeme beside another terminal with the same first character, {0})."""
    import random
    rng = random.Random(20261129)
    checked = positives = 0
    for _ in range(400):
        names = ["root"] + [f"r{i}" for i in range(rng.randint(1, 3))]
        rules = {name: _random_node(rng, names, 0) for name in names}
        text = "\n".join(f"{name} ::= {_show(body)}" for name, body in rules.items())
        try:
            compiled = llm.compile_constraint(Constraint.gbnf(text))
        except ConstraintError:
            continue   # no text matches it, or past the grammar engine's limits: refused, never misread
        for j in range(8):   # strings of the grammar (a step off, half of them) and strings of the alphabet
            s = _derive(rules, rules["root"], rng, [6]) if j < 4 else \
                "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 5)))
            if j in (1, 3) and s:
                s = s[:-1] if rng.random() < 0.5 else s + rng.choice(ALPHABET)
            if "\x00" in s or len(s) > 12:
                continue
            want = _reference_takes(rules, s)
            m = compiled.matcher()
            ids = llm.tokenize(s, add_bos=False) if s else []
            got = m.valid_prefix(ids) == ids and all(m.advance(t) is None for t in ids) and m.accepting
            assert got == want, (text, s, want, gbnf_to_lark(text))
            checked += 1
            positives += want
    assert checked > 1000 and positives > 100, (checked, positives)
