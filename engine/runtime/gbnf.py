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
- `.` any character (a newline too), groups ( ), repetition * + ? {m} {m,} {m,n} (a minimum of at most 2,000; a
  maximum over 2,000 is none, as there); [] and [^] match the empty string and [z-a] nothing, as there; a rule
  defined again replaces the earlier one, as there;
- tokens: <[id]> (a token id), <name> (a special token by its text). llama.cpp's negated tokens !<...> are
  refused (llguidance has no such terminal).

Everything else is a ConstraintError-worthy GbnfError naming the line and column.
"""
from __future__ import annotations

import json

from .grammar_cost import MAX_REPEAT_COST, too_costly

MAX_REPETITION = 2000    # llama.cpp's MAX_REPETITION_THRESHOLD
DIGITS = "0123456789"


class GbnfError(ValueError):
    pass


# ---- sets of characters: sorted, disjoint, non-adjacent (lo, hi) code point ranges ---------------------------
TOP = 0x10FFFF
ALL = ((0, TOP),)
NONE = ()


def norm(ranges) -> tuple:
    out: list = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def complement(ranges) -> tuple:
    out, at = [], 0
    for lo, hi in norm(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= TOP:
        out.append((at, TOP))
    return tuple(out)


def union(*sets) -> tuple:
    return norm([r for x in sets for r in x])


def meets(a, b) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False


def _is_word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


# ( ... ) inside ( ... ): llguidance's own grammar parser refuses the converted grammar between 50 and 60 levels
# ("lark grammar too deeply nested", quoting the converted text), and this parser recursed out of Python's stack
# at a few hundred; 50 measured to pass in every shape (options, alternatives, repetitions, references)
MAX_GROUP_DEPTH = 50


class _Parser:
    def __init__(self, text: str):
        self.s, self.i = text, 0
        self.used: dict[str, int] = {}    # rule name -> where it was first referred to
        self.depth = 0                    # groups open where the parser is

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
    def grammar(self) -> dict:
        """name -> the rule's tree, in the order written."""
        rules: dict = {}
        self.space(True)
        while self.i < len(self.s):
            name = self.name()
            self.space(False)
            if self.s[self.i:self.i + 3] != "::=":
                self.fail("expected ::=")
            self.i += 3   # a rule defined again replaces the earlier one, as llama.cpp's add_rule does
            self.space(True)
            rules[name] = self.alternates(nested=False)
            c = self.peek()
            if c == "\r":
                self.i += 2 if self.peek(1) == "\n" else 1
            elif c == "\n":
                self.i += 1
            elif c:
                self.fail("expected the end of the line")
            self.space(True)
        if "root" not in rules:
            raise GbnfError("the grammar has no root rule (root ::= ...)")
        for name, at in self.used.items():
            if name not in rules:
                self.fail(f"rule {name!r} is used but never defined", at)
        return rules

    def alternates(self, nested: bool):
        alts = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            alts.append(self.sequence(nested))
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self, nested: bool):
        items: list = []
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
                items.append(("lit", chars))
            elif c == "[":
                self.i += 1
                neg = self.peek() == "^"
                if neg:
                    self.i += 1
                ranges, empty = [], True
                while self.peek() != "]":
                    if not self.peek():
                        self.fail("a character class is not closed", at)
                    lo = self.char()
                    hi = lo
                    if self.peek() == "-" and self.peek(1) not in ("]", ""):
                        self.i += 1
                        hi = self.char()
                    if lo <= hi:   # llama.cpp: a range that runs backwards matches nothing
                        ranges.append((lo, hi))
                    empty = False
                self.i += 1
                if empty:   # llama.cpp: [] and [^] add no element at all, so they match the empty string
                    items.append(("lit", []))
                else:
                    items.append(("cls", complement(ranges) if neg else norm(ranges)))
            elif c == ".":
                self.i += 1
                items.append(("cls", ALL))
            elif c == "(":
                self.depth += 1
                if self.depth > MAX_GROUP_DEPTH:
                    self.fail(f"groups nested more than {MAX_GROUP_DEPTH} deep (name some of them as rules)")
                self.i += 1
                self.space(True)
                inner = self.alternates(nested=True)
                self.depth -= 1
                if self.peek() != ")":
                    self.fail("expected )")
                self.i += 1
                items.append(inner)
            elif c == "<" or c == "!":
                items.append(("tok", self.token()))
            elif _is_word(c):
                name = self.name()
                self.used.setdefault(name, at)
                items.append(("ref", name))
            elif c in "*+?":
                if not items:
                    self.fail(f"{c} follows nothing")
                self.i += 1
                items[-1] = ("rep", items[-1], 1 if c == "+" else 0, 1 if c == "?" else None)
            elif c == "{":
                if not items:
                    self.fail("a repetition follows nothing")
                items[-1] = self.repeat(items[-1], nested)
                continue
            else:
                break
            self.space(nested)
        if not items:   # an empty alternative: the empty string
            return ("lit", [])
        return items[0] if len(items) == 1 else ("seq", items)

    def repeat(self, item, nested: bool):
        self.i += 1
        self.space(nested)
        lo = self.number()
        self.space(nested)
        hi: int | None = lo
        if self.peek() == ",":
            self.i += 1
            self.space(nested)
            hi = self.number() if self.peek() in DIGITS else None
            self.space(nested)
        if self.peek() != "}":
            self.fail("expected } to close a repetition")
        self.i += 1
        self.space(nested)
        if lo > MAX_REPETITION:
            self.fail(f"a repetition of at least {lo}: over {MAX_REPETITION} (llama.cpp's limit)")
        if hi is not None and hi > MAX_REPETITION:   # llama.cpp: a maximum past its limit is no maximum
            hi = None
        if hi is not None and hi < lo:
            self.fail("a repetition's maximum is below its minimum")
        return ("rep", item, lo, hi)

    def number(self) -> int:
        j = self.i
        while self.peek() and self.peek() in DIGITS:
            self.i += 1
        if self.i == j:
            self.fail("expected a number")
        digits = self.s[j:self.i]
        return int(digits) if len(digits) <= 18 else 10 ** 18   # past MAX_REPETITION either way (int() stops at 4300)

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
            if not body[1:-1] or any(c not in DIGITS for c in body[1:-1]):
                self.fail("a token id <[...]> must be a number", at)
            return f"<[{int(body[1:-1])}]>"
        if not body or any(c in body for c in "<> \n"):
            self.fail("a token <...> names a special token by its text", at)
        return f"<{body}>"


def _refs(x, out: set) -> set:
    """The rules x names (added to out)."""
    if x[0] == "ref":
        out.add(x[1])
    elif x[0] in ("seq", "alt"):
        for y in x[1]:
            _refs(y, out)
    elif x[0] == "rep":
        _refs(x[1], out)
    return out


def _users(refs: dict) -> dict:
    """rule -> the rules naming it."""
    users: dict = {n: set() for n in refs}
    for n, rs in refs.items():
        for m in rs:
            users[m].add(n)
    return users


def _ends(x, finite: set) -> bool:
    """Whether x matches some finite text, given the rules that do."""
    k = x[0]
    if k == "ref":
        return x[1] in finite
    if k == "seq":
        return all(_ends(y, finite) for y in x[1])
    if k == "alt":
        return any(_ends(y, finite) for y in x[1])
    if k == "rep":
        return x[2] == 0 or _ends(x[1], finite)
    return True   # lit, cls, tok


def _pruned(x, finite: set):
    """x without its alternatives that never end (None when x itself never does)."""
    k = x[0]
    if k == "ref":
        return x if x[1] in finite else None
    if k == "seq":
        items = [_pruned(y, finite) for y in x[1]]
        return None if None in items else ("seq", items)
    if k == "alt":
        alts = [y for y in (_pruned(y, finite) for y in x[1]) if y is not None]
        return None if not alts else alts[0] if len(alts) == 1 else ("alt", alts)
    if k == "rep":
        inner = _pruned(x[1], finite)
        if inner is None:
            return ("lit", []) if x[2] == 0 else None
        return ("rep", inner, x[2], x[3])
    return x


def _size_and_cost(x, sizes: dict) -> tuple[int, int]:
    """(x written out, the repeat cost of x's own repetitions: grammar_cost's measure), the rules it names taken
    at their size in `sizes` (one not there, a recursion, counts 1)."""
    k = x[0]
    if k == "lit":
        return len(x[1]), 0
    if k in ("cls", "tok"):
        return 1, 0
    if k == "ref":
        return sizes.get(x[1], 1), 0
    if k in ("seq", "alt"):
        size = cost = 0
        for y in x[1]:
            a, b = _size_and_cost(y, sizes)
            size, cost = min(_CAP, size + a), min(_CAP, cost + b)
        return size, cost
    size, cost = _size_and_cost(x[1], sizes)
    times = x[3] if x[3] is not None else x[2]
    if times <= 1 or x[1][0] == "cls" and x[1][1] and x[1][1] != ((x[1][1][0][0],) * 2,):
        # a run of one class (of more than one character: [a] is a literal) is one step for the engine
        return size, cost
    return min(_CAP, size * times), min(_CAP, cost + size * times)


_CAP = 10 ** 18


def repeat_cost(rules: dict, refs: dict) -> tuple[str, int] | None:
    """The first rule (in the order they are reached from root) whose counted repetitions cost more than
    MAX_REPEAT_COST (grammar_cost), with that cost; None: none does. A rule named inside a repetition counts
    at its written-out size: t ::= "a"{1000} and s ::= t{1000} make s cost 1,000,000."""
    sizes: dict = {}
    on_path, stack = {"root"}, [("root", iter(sorted(refs["root"])))]
    while stack:   # rules after the ones they name (iterative: a chain may be 1000 rules deep)
        nxt = next(stack[-1][1], None)
        if nxt is None:
            name = stack.pop()[0]
            on_path.discard(name)
            sizes[name], cost = _size_and_cost(rules[name], sizes)
            if cost > MAX_REPEAT_COST:
                return name, cost
        elif nxt not in sizes and nxt not in on_path:
            on_path.add(nxt)
            stack.append((nxt, iter(sorted(refs[nxt]))))
    return None


def _finite_only(rules: dict, refs: dict) -> dict:
    """The rules that match some finite text (the standard "productive" rules: a rule is, when one of its
    alternatives is made of terminals and such rules alone), with every alternative that never ends dropped.
    The grammar engine follows a path that never ends (`tail ::= "x" tail`: "x" forced forever) until its own
    limit, mid-generation, so a branch that can never complete is cut here and a root that never completes is
    refused."""
    users = _users(refs)
    finite: set = set()
    todo = [n for n in rules if _ends(rules[n], finite)]
    finite.update(todo)
    while todo:
        for u in users[todo.pop()]:
            if u not in finite and _ends(rules[u], finite):
                finite.add(u)
                todo.append(u)
    if "root" not in finite:
        raise GbnfError("no text matches it (no finite text): every way through root names a rule that never"
                        " ends (each of its alternatives names itself again, like tail ::= \"x\" tail)")
    return {n: _pruned(b, finite) for n, b in rules.items() if n in finite}


MAX_REGEX_DEPTH = 160   # groups nested in a lexeme's regular expression (the regex engine refuses past 250)


class _Analysis:
    """What each rule can begin with, whether it can be empty, what can follow it (sets of characters), and
    which rules can be one greedy lexeme without changing what the grammar takes."""

    def __init__(self, rules: dict):
        self.rules = rules
        self.refs = {n: _refs(b, set()) for n, b in rules.items()}   # rule -> the rules it names
        self.users = users = _users(self.refs)                       # rule -> the rules naming it
        # fixpoints on worklists: a rule is looked at again only when one it names (nullable, first) or one naming
        # it (follow) changed; a full pass per change took a pass per level of a chain of rules (quadratic: a
        # chain of 2000 took 23 s)
        self.nullable = {n: False for n in rules}
        self.first = {n: NONE for n in rules}
        todo, queued = list(rules), set(rules)
        while todo:
            n = todo.pop()
            queued.discard(n)
            nul, fst = self.nul(rules[n]), self.fst(rules[n])
            if nul != self.nullable[n] or fst != self.first[n]:
                self.nullable[n], self.first[n] = nul, fst
                for u in users[n] - queued:
                    queued.add(u)
                    todo.append(u)
        self.follow = {n: NONE for n in rules}
        todo, queued = list(rules), set(rules)
        while todo:
            n = todo.pop()
            queued.discard(n)
            changed: set = set()
            self._walk(rules[n], self.follow[n], changed)
            for m in changed - queued:
                queued.add(m)
                todo.append(m)
        self.lexemes = self._lexemes()

    def nul(self, x) -> bool:
        k = x[0]
        if k == "lit":
            return not x[1]
        if k in ("cls", "tok"):
            return False
        if k == "ref":
            return self.nullable[x[1]]
        if k == "seq":
            return all(self.nul(y) for y in x[1])
        if k == "alt":
            return any(self.nul(y) for y in x[1])
        return x[2] == 0 or self.nul(x[1])   # rep

    def fst(self, x) -> tuple:
        k = x[0]
        if k == "lit":
            return ((x[1][0], x[1][0]),) if x[1] else NONE
        if k == "cls":
            return x[1]
        if k == "tok":
            return NONE
        if k == "ref":
            return self.first[x[1]]
        if k == "seq":
            out = NONE
            for y in x[1]:
                out = union(out, self.fst(y))
                if not self.nul(y):
                    break
            return out
        if k == "alt":
            return union(*(self.fst(y) for y in x[1]))
        return self.fst(x[1])   # rep

    def _walk(self, x, follow, changed: set):
        """Adds to the follow sets of the rules x names (`follow`: what may follow x); changed: those that grew."""
        k = x[0]
        if k == "ref":
            grown = union(self.follow[x[1]], follow)
            if grown != self.follow[x[1]]:
                self.follow[x[1]] = grown
                changed.add(x[1])
        elif k == "seq":
            cur = follow
            for y in reversed(x[1]):
                self._walk(y, cur, changed)
                cur = union(self.fst(y), cur) if self.nul(y) else self.fst(y)
        elif k == "alt":
            for y in x[1]:
                self._walk(y, follow, changed)
        elif k == "rep":
            again = x[3] is None or x[3] > 1
            self._walk(x[1], union(follow, self.fst(x[1])) if again else follow, changed)

    # ---- lexemes ------------------------------------------------------------------------------------
    def _has_token(self, x) -> bool:
        if x[0] == "tok":
            return True
        if x[0] in ("seq", "alt"):
            return any(self._has_token(y) for y in x[1])
        return x[0] == "rep" and self._has_token(x[1])

    def _lexemes(self) -> set:
        """Rules of characters alone (no tokens, no recursion) that a greedy lexeme matches as the grammar
        does: none of the characters that could extend a whole match may follow the rule anywhere."""
        refs = self.refs
        chars_only = {n for n, b in self.rules.items() if not self._has_token(b)}
        todo = [n for n in self.rules if n not in chars_only]
        while todo:   # only rules of such rules: a rule naming one that is not, is not
            for u in self.users[todo.pop()]:
                if u in chars_only:
                    chars_only.discard(u)
                    todo.append(u)
        # no recursion through its references, and an inlined regular expression shallow enough for the regex
        # engine (its nesting limit is 250; a chain of 50 rules `r1 ::= "x" r2 | "y"` went past it and the
        # grammar was refused): rules taken in dependency order, without recursion in Python either (a chain of
        # thousands of rules), each one's inlined depth from those it refers to
        depth: dict = {}
        waiting = {n: set(refs[n]) for n in chars_only}
        users: dict = {}
        for n, rs in waiting.items():
            for m in rs:
                users.setdefault(m, set()).add(n)
        ready = [n for n, rs in waiting.items() if not rs]
        while ready:
            n = ready.pop()
            depth[n] = self._regex_depth(self.rules[n], depth)
            for u in users.get(n, ()):
                waiting[u].discard(n)
                if not waiting[u] and u not in depth:
                    ready.append(u)
        flat = {n for n in chars_only if depth.get(n, MAX_REGEX_DEPTH + 1) <= MAX_REGEX_DEPTH}
        lexemes = {n for n in flat if not meets(_Lexeme(self.rules, self.rules[n]).extends(), self.follow[n])}
        while True:   # a lexeme must not share a first character with any other terminal of the grammar: where
            seen = []   # both may begin at one place (by any path), its greed would take the other path away
            for n, body in self.rules.items():
                if n not in lexemes:   # a lexeme's own body is one regular expression: exact
                    self._terminals(body, lexemes, seen)
            clash = {name for name in lexemes if any(other != name and meets(first, self.first[name])
                                                     for other, first in seen)}
            if not clash:
                return lexemes
            lexemes -= clash

    def _regex_depth(self, x, depth: dict) -> int:
        """How deeply _Emitter.regex nests groups for x, its references' depths taken from `depth`."""
        k = x[0]
        if k in ("lit", "cls", "tok"):
            return 1
        if k == "ref":
            return 1 + depth[x[1]]
        if k in ("seq", "alt"):
            return 2 + max((self._regex_depth(y, depth) for y in x[1]), default=0)
        return 1 + self._regex_depth(x[1], depth)   # rep

    def _terminals(self, x, lexemes, out: list):
        """(lexeme name or None, first characters) of every terminal written in x: each character of a literal
        (each is a lexeme of its own), each class, each reference to a lexeme."""
        k = x[0]
        if k == "lit":
            out.extend((None, ((c, c),)) for c in x[1])
        elif k == "cls":
            out.append((None, x[1]))
        elif k == "ref" and x[1] in lexemes:
            out.append((x[1], self.first[x[1]]))
        elif k in ("seq", "alt"):
            for y in x[1]:
                self._terminals(y, lexemes, out)
        elif k == "rep":
            self._terminals(x[1], lexemes, out)


class _Lexeme:
    """A rule of characters as an automaton over character ranges (its references inlined), to find exactly
    the characters that extend some whole match of it into a longer possible one."""
    MAX_STATES = 20000   # past these (bounded repetitions of large parts), every character counts as one

    def __init__(self, rules: dict, body):
        self.rules = rules
        self.moves: list[list] = []   # state -> [(ranges, next state)]
        self.eps: list[list] = []     # state -> [next state]
        try:
            self.start, self.end = self._build(body)
        except OverflowError:
            self.start = None

    def _state(self) -> int:
        if len(self.moves) >= self.MAX_STATES:
            raise OverflowError
        self.moves.append([])
        self.eps.append([])
        return len(self.moves) - 1

    def _build(self, x):
        k = x[0]
        a = self._state()
        if k == "lit":
            cur = a
            for c in x[1]:
                nxt = self._state()
                self.moves[cur].append((((c, c),), nxt))
                cur = nxt
            return a, cur
        if k == "cls":
            b = self._state()
            if x[1]:
                self.moves[a].append((x[1], b))
            return a, b
        if k == "ref":
            s, e = self._build(self.rules[x[1]])
            self.eps[a].append(s)
            return a, e
        if k == "seq":
            cur = a
            for y in x[1]:
                s, e = self._build(y)
                self.eps[cur].append(s)
                cur = e
            return a, cur
        if k == "alt":
            b = self._state()
            for y in x[1]:
                s, e = self._build(y)
                self.eps[a].append(s)
                self.eps[e].append(b)
            return a, b
        # rep: lo copies, then hi - lo optional ones (or a loop)
        _, y, lo, hi = x
        cur = a
        for _ in range(lo):
            s, e = self._build(y)
            self.eps[cur].append(s)
            cur = e
        end = self._state()
        self.eps[cur].append(end)
        if hi is None:
            s, e = self._build(y)
            self.eps[cur].append(s)
            self.eps[e].append(cur)
        else:
            for _ in range(hi - lo):
                s, e = self._build(y)
                self.eps[cur].append(s)
                self.eps[e].append(end)
                cur = e
        return a, end

    def _closure(self, states) -> frozenset:
        out, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in out:
                    out.add(t)
                    todo.append(t)
        return frozenset(out)

    def extends(self) -> tuple:
        if self.start is None:
            return ALL
        back: list[list] = [[] for _ in self.moves]   # which states can still reach the end
        for s in range(len(self.moves)):
            for t in self.eps[s]:
                back[t].append(s)
            for _, t in self.moves[s]:
                back[t].append(s)
        live, todo = {self.end}, [self.end]
        while todo:
            for s in back[todo.pop()]:
                if s not in live:
                    live.add(s)
                    todo.append(s)
        out: list = []
        first = self._closure([self.start])
        seen, todo = {first}, [first]
        while todo:   # the sets of states some text reaches; at each one the text completes, the live moves
            cur = todo.pop()
            moves = [(r, t) for s in cur for r, t in self.moves[s] if t in live]
            if self.end in cur:
                out.extend(r for rs, _ in moves for r in rs)
            cuts = sorted({lo for rs, _ in moves for lo, _ in rs} | {hi + 1 for rs, _ in moves for _, hi in rs})
            for lo, hi in zip(cuts, cuts[1:]):   # one successor per run of characters that move alike
                nxt = self._closure([t for rs, t in moves if any(a <= lo and hi - 1 <= b for a, b in rs)])
                if nxt and nxt not in seen:
                    if len(seen) >= self.MAX_STATES:
                        return ALL
                    seen.add(nxt)
                    todo.append(nxt)
        return norm(out)


def _cls(ranges) -> str:
    if not ranges:
        return "[^\\x{0}-\\x{10FFFF}]"
    if ranges == ALL:
        return "(?s:.)"
    return "[" + "".join(f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}" for lo, hi in ranges) + "]"


def _rep(inner: str, lo: int, hi) -> str:
    if (lo, hi) == (0, None):
        return inner + "*"
    if (lo, hi) == (1, None):
        return inner + "+"
    if (lo, hi) == (0, 1):
        return inner + "?"
    return inner + ("{%d,}" % lo if hi is None else "{%d,%d}" % (lo, hi))


class _Emitter:
    def __init__(self, rules: dict, an: _Analysis):
        self.rules, self.an = rules, an
        self.names: dict[str, str] = {}

    def name(self, rule: str) -> str:
        got = self.names.get(rule)
        if got is None:   # distinct even where fooBar meets foo-bar; a lexeme's name is upper case
            safe = "".join(c if c.isascii() and c.isalnum() else "_" for c in rule.lower())
            got = f"g{len(self.names)}_{safe}"
            self.names[rule] = got.upper() if rule in self.an.lexemes else got
        return self.names[rule]

    def regex(self, x) -> str:
        """A lexeme's body as one regular expression (its rules inlined)."""
        k = x[0]
        if k == "rep" and x[3] == 0:   # {0}: the empty string
            return "(?:)"
        if k == "lit":
            return "".join(f"\\x{{{c:X}}}" for c in x[1]) or "(?:)"
        if k == "cls":
            return _cls(x[1])
        if k == "ref":
            return "(?:" + self.regex(self.rules[x[1]]) + ")"
        if k == "seq":
            return "".join("(?:" + self.regex(y) + ")" for y in x[1])
        if k == "alt":
            return "(?:" + "|".join(self.regex(y) for y in x[1]) + ")"
        return _rep("(?:" + self.regex(x[1]) + ")", x[2], x[3])

    def grammar(self, x) -> str:
        """A rule's body with one lexeme per character (literals split, classes one character each)."""
        k = x[0]
        if k == "rep" and x[3] == 0:   # {0}: the empty string (llguidance refuses a count range ending at 0)
            return '""'
        if k == "lit":
            lits = [json.dumps(chr(c), ensure_ascii=0x7F <= c <= 0x9F) for c in x[1]] or ['""']
            return lits[0] if len(lits) == 1 else "(" + " ".join(lits) + ")"
        if k == "cls":
            return "/" + _cls(x[1]) + "/"
        if k == "ref":
            return self.name(x[1])
        if k == "tok":
            return x[1]
        if k == "seq":
            return " ".join(self.grammar(y) for y in x[1])
        if k == "alt":
            return "(" + " | ".join(self.grammar(y) for y in x[1]) + ")"
        return _rep("(" + self.grammar(x[1]) + ")", x[2], x[3])

    def lark(self) -> str:
        lines = [f"start: {self.name('root')}"]
        for rule, body in self.rules.items():
            if rule in self.an.lexemes:
                lines.append(f"{self.name(rule)}: /{self.regex(body)}/")
            else:
                lines.append(f"{self.name(rule)}: {self.grammar(body)}")
        return "\n".join(lines) + "\n"


# rules reached one through another from root (a chain `r1 ::= "x" r2 | "y"`, `r2 ::= ...`): llguidance walks
# them recursively, and a chain of ~2000 overflowed its stack (the process died: SIGSEGV, a server with it)
MAX_RULE_DEPTH = 1000


def _rule_depth(refs: dict) -> int:
    """The deepest chain of rule references from root (refs: _Analysis.refs), as a depth-first walk meets them
    (each rule once)."""
    deepest, seen, stack = 1, {"root"}, [("root", iter(sorted(refs["root"])))]
    while stack:
        nxt = next(stack[-1][1], None)
        if nxt is None:
            stack.pop()
        elif nxt not in seen:
            seen.add(nxt)
            stack.append((nxt, iter(sorted(refs[nxt]))))
            deepest = max(deepest, len(stack))
    return deepest


def gbnf_costs(text: str) -> tuple[dict, dict]:
    """(rules, the rules each names) of a GBNF grammar that parses and that the engine can take at an acceptable
    cost (rule chains at most MAX_RULE_DEPTH deep, counted repetitions within MAX_REPEAT_COST): GbnfError naming
    the rule otherwise. Linear in the text: a caller checks this before compiling anything."""
    rules = _Parser(text).grammar()
    refs = {n: _refs(b, set()) for n, b in rules.items()}
    depth = _rule_depth(refs)   # first: the analysis of a chain far too deep would take long before refusing it
    if depth > MAX_RULE_DEPTH:
        raise GbnfError(f"rules chained {depth} deep (each naming the next, from root): at most {MAX_RULE_DEPTH}; "
                        "write a repetition (x*, x{m,n}) or a recursive rule instead of a chain")
    costly = repeat_cost(rules, refs)
    if costly is not None:
        raise GbnfError(f"rule {costly[0]}: {too_costly(costly[1])}")
    return rules, refs


def gbnf_to_lark(text: str) -> str:
    """A GBNF grammar as llguidance Lark (see the module's docstring); GbnfError when it does not parse, is
    deeper than the engine can take or costs it too much (gbnf_costs)."""
    rules, refs = gbnf_costs(text)
    rules = _finite_only(rules, refs)
    return _Emitter(rules, _Analysis(rules)).lark()
