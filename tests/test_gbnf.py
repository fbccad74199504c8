"""GBNF grammars mean what they mean in llama.cpp (engine/runtime/gbnf.py): matched character by character, so
a rule of characters never swallows what the grammar needs next. Each case says whether llama.cpp's parser
(src/llama-grammar.cpp, its documented syntax in grammars/README.md) takes a text; the compiled grammar is fed
the text's tokens and must take exactly the same. llguidance's own converter, used before, made every rule of
characters one greedy lexeme: the first four cases never completed, and several escapes and names were refused."""
from __future__ import annotations

import pytest

from bitnet_cpu.engine.api import Constraint, ConstraintError, load_model
from bitnet_cpu.engine.runtime.gbnf import GbnfError, gbnf_to_lark

ARITHMETIC = r'''
root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
'''

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


def test_a_grammar_no_text_matches_is_refused(llm):
    with pytest.raises(ConstraintError) as e:
        llm.compile_constraint(Constraint.gbnf('root ::= [^\\x00-\\U0010FFFF] | root "a"'))
    assert "no text matches it" in str(e.value)
