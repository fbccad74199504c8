"""llama.cpp's GBNF grammars as llguidance Lark, with llama.cpp's meaning.

llama.cpp matches a GBNF grammar character by character: `num ::= [0-9]+ ws`, `ws ::= [ \\t\\n]*`, then "\\n"
ends a line of its arithmetic grammar. llguidance lexes first, and a lexeme is greedy: its own converter
(`llguidance.gbnf_to_lark`) turns a rule of characters into one lexeme, which then eats the "\\n" the grammar
needs next (that grammar never finished), and a literal "end" after `[a-z]*` could never match. Here every
terminal is one character (a literal's characters one by one, a class, `.`), so no lexeme is ever longer than
a character and the Earley parser sees every choice llama.cpp's does. The syntax is llama.cpp's
(src/llama-grammar.cpp, grammars/README.md):

- rules `name ::= alternatives`, names of letters, digits and `-`; `root` is the start; `#` comments;
- literals "..." and classes [...] / [^...] with escapes \\x.. \\u.... \\U........ \\t \\r \\n \\\\ \\" \\[ \\] \\-;
- `.` any character (a newline too), groups ( ), repetition * + ? {m} {m,} {m,n} (at most 2,000, as there);
- tokens: <[id]> (a token id), <name> (a special token by its text). llama.cpp's negated tokens !<...> are
  refused (llguidance has no such terminal).

Everything else is a ConstraintError-worthy GbnfError naming the line and column.
"""
from __future__ import annotations

import json

MAX_REPETITION = 2000    # llama.cpp's MAX_REPETITION_THRESHOLD


class GbnfError(ValueError):
    pass


def _is_word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    def __init__(self, text: str):
        self.s, self.i = text, 0
        self.names: dict[str, str] = {}   # GBNF rule name -> Lark rule name
        self.defined: set[str] = set()
        self.used: dict[str, int] = {}    # rule name -> where it was first referred to

    # ---- positions and errors ---------------------------------------------------------------------------
    def fail(self, msg: str, at: int | None = None):
        at = self.i if at is None else at
        line = self.s.count("\n", 0, at) + 1
        col = at - (self.s.rfind("\n", 0, at) + 1) + 1
        near = self.s[at:at + 20].split("\n")[0]
        raise GbnfError(f"{msg} at line {line}, column {col}" + (f" ({near!r})" if near else ""))

    def peek(self, n: int = 0) -> str:
        j = self.i + n
        return self.s[j] if j < len(self.s) else ""

    def space(self, newlines: bool):
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < len(self.s) and self.s[self.i] not in "\r\n":
                    self.i += 1
            else:
                return

    def name(self) -> str:
        j = self.i
        while self.i < len(self.s) and _is_word(self.s[self.i]):
            self.i += 1
        if self.i == j:
            self.fail("expected a rule name")
        return self.s[j:self.i]

    def lark_name(self, name: str) -> str:
        got = self.names.get(name)
        if got is None:
            safe = "".join(c if c.isascii() and c.isalnum() else "_" for c in name.lower())
            got = self.names[name] = f"g{len(self.names)}_{safe}"   # distinct even where fooBar meets foo-bar
        return got

    # ---- characters ---------------------------------------------------------------------------------
    def char(self) -> int:
        """One character of a literal or class (an escape, or one code point): its code point."""
        c = self.peek()
        if not c:
            self.fail("unexpected end of the grammar")
        if c != "\\":
            self.i += 1
            return ord(c)
        e = self.peek(1)
        hexes = {"x": 2, "u": 4, "U": 8}.get(e)
        if hexes is not None:
            digits = self.s[self.i + 2:self.i + 2 + hexes]
            if len(digits) != hexes or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{e} needs {hexes} hex digits")
            cp = int(digits, 16)
            if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                self.fail(f"\\{e}{digits} is not a Unicode character")
            self.i += 2 + hexes
            return cp
        simple = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}.get(e)
        if simple is None:
            self.fail(f"unknown escape \\{e}")
        self.i += 2
        return simple

    # ---- the grammar --------------------------------------------------------------------------------
    def grammar(self) -> list[str]:
        rules: list[str] = []
        self.space(True)
        while self.i < len(self.s):
            start = self.i
            name = self.name()
            self.space(False)
            if self.s[self.i:self.i + 3] != "::=":
                self.fail("expected ::=")
            if name in self.defined:
                self.fail(f"rule {name!r} is defined twice", start)
            self.defined.add(name)
            self.i += 3
            self.space(True)
            rules.append(f"{self.lark_name(name)}: {self.alternates(nested=False)}")
            c = self.peek()
            if c == "\r":
                self.i += 2 if self.peek(1) == "\n" else 1
            elif c == "\n":
                self.i += 1
            elif c:
                self.fail("expected the end of the line")
            self.space(True)
        if "root" not in self.defined:
            raise GbnfError("the grammar has no root rule (root ::= ...)")
        for name, at in self.used.items():
            if name not in self.defined:
                self.fail(f"rule {name!r} is used but never defined", at)
        return rules

    def alternates(self, nested: bool) -> str:
        alts = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            alts.append(self.sequence(nested))
        return " | ".join(alts)

    def sequence(self, nested: bool) -> str:
        items: list[str] = []
        while self.i < len(self.s):
            c = self.peek()
            at = self.i
            if c == '"':
                self.i += 1
                chars = []
                while self.peek() != '"':
                    if not self.peek():
                        self.fail("a literal is not closed", at)
                    chars.append(self.char())
                self.i += 1
                # one lexeme per character ("": the empty string)
                lits = [json.dumps(chr(x), ensure_ascii=False) for x in chars] or ['""']
                items.append(lits[0] if len(lits) == 1 else "(" + " ".join(lits) + ")")
            elif c == "[":
                self.i += 1
                neg = self.peek() == "^"
                if neg:
                    self.i += 1
                parts = []
                while self.peek() != "]":
                    if not self.peek():
                        self.fail("a character class is not closed", at)
                    lo = self.char()
                    if self.peek() == "-" and self.peek(1) not in ("]", ""):
                        self.i += 1
                        hi = self.char()
                        if hi < lo:
                            self.fail("a character range runs backwards", at)
                        parts.append(f"\\x{{{lo:X}}}-\\x{{{hi:X}}}")
                    else:
                        parts.append(f"\\x{{{lo:X}}}")
                self.i += 1
                if not parts:   # llama.cpp: [] matches nothing, [^] any character
                    items.append("/(?s:.)/" if neg else "/[^\\x{0}-\\x{10FFFF}]/")
                else:
                    items.append("/[" + ("^" if neg else "") + "".join(parts) + "]/")
            elif c == ".":
                self.i += 1
                items.append("/(?s:.)/")
            elif c == "(":
                self.i += 1
                self.space(True)
                inner = self.alternates(nested=True)
                if self.peek() != ")":
                    self.fail("expected )")
                self.i += 1
                items.append(f"({inner})")
            elif c == "<" or c == "!":
                items.append(self.token())
            elif _is_word(c):
                name = self.name()
                self.used.setdefault(name, at)
                items.append(self.lark_name(name))
            elif c in "*+?":
                if not items:
                    self.fail(f"{c} follows nothing")
                self.i += 1
                items[-1] = f"({items[-1]}){c}"
            elif c == "{":
                if not items:
                    self.fail("a repetition follows nothing")
                items[-1] = self.repeat(items[-1], nested)
                continue
            else:
                break
            self.space(nested)
        return " ".join(items) if items else '""'

    def repeat(self, item: str, nested: bool) -> str:
        self.i += 1
        self.space(nested)
        lo = self.number()
        self.space(nested)
        hi: int | None = lo
        if self.peek() == ",":
            self.i += 1
            self.space(nested)
            hi = self.number() if self.peek().isdigit() else None
            self.space(nested)
        if self.peek() != "}":
            self.fail("expected } to close a repetition")
        self.i += 1
        self.space(nested)
        if max(lo, hi or 0) > MAX_REPETITION:
            self.fail(f"a repetition over {MAX_REPETITION} (llama.cpp's limit)")
        if hi is not None and hi < lo:
            self.fail("a repetition's maximum is below its minimum")
        if hi is None:
            return f"({item}){{{lo},}}" if lo else f"({item})*"
        return f"({item}){{{lo},{hi}}}"

    def number(self) -> int:
        j = self.i
        while self.peek().isdigit():
            self.i += 1
        if self.i == j:
            self.fail("expected a number")
        return int(self.s[j:self.i])

    def token(self) -> str:
        at = self.i
        if self.peek() == "!":
            self.fail("negated tokens (!<...>) are not supported")
        end = self.s.find(">", self.i)
        if end < 0:
            self.fail("a token <...> is not closed", at)
        body = self.s[self.i + 1:end]
        self.i = end + 1
        if body.startswith("[") and body.endswith("]"):
            if not body[1:-1].isdigit():
                self.fail("a token id <[...]> must be a number", at)
            return f"<[{int(body[1:-1])}]>"
        if not body or any(c in body for c in "<> \n"):
            self.fail("a token <...> names a special token by its text", at)
        return f"<{body}>"


def gbnf_to_lark(text: str) -> str:
    """A GBNF grammar as llguidance Lark (see the module's docstring); GbnfError when it does not parse."""
    p = _Parser(text)
    rules = p.grammar()
    return f"start: {p.lark_name('root')}\n" + "\n".join(rules) + "\n"
