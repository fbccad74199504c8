"""What a regex or grammar costs the grammar engine, counted before it is compiled.

A pattern of a few bytes can stand for a huge automaton: `^(a{1000}){1000}$` is 24 bytes, and llguidance then
took ~0.3-0.5 s for each token's mask (one request set the pace of every sequence in the step) and ~350 MB that
stayed in the compile cache. None of llguidance's own limits (lexer fuel, lexer states, Earley items) stops it:
the time goes to its regex derivatives, which they do not count. So the cost is counted here, on the text, the
same way every time, whatever the load: the characters that counted repetitions write out.

repeat_cost: each counted repetition x{n}, x{n,}, x{n,m} with a count above 1 costs count x size(x), where
size(x) is x written out (its own counted repetitions expanded, a rule it names inlined); the count is m, or n
where there is no maximum. A repetition of one character class ([a-z]{1000}, .{0,5000}, \\d{4}; not [a], a
literal) costs nothing:
the engine handles such a run in one step (measured: 0.0 ms per mask for ([a-z]{1000}){1000}). *, + and ? add
nothing (the engine's loops are cheap). Measured on the bundled model (1.2k tokens), per mask, median / worst:
cost 10,000 ((a{100}){100}, a{10000}): 2-3 / 12 ms; 50,000 (a{50000}): 10 / 54 ms; 90,300 ((a{300}){300}):
16-21 / 120 ms; 1,000,000 ((a{1000}){1000}): 335 / 2,500 ms and 350 MB. MAX_REPEAT_COST keeps a mask within
a few milliseconds; every ordinary pattern (dates, emails, [a-z]{1,64}(\\.[a-z]{1,64}){0,10}, pydantic's) costs
at most a few hundred.
"""
from __future__ import annotations

import re

MAX_REPEAT_COST = 20_000
_CAP = 10 ** 18   # counts past this are all "too much": keeps the numbers small
_CLASS_ESCAPES = set("dDsSwWpPhHvVRNX")


def _count(pattern: str, i: int):
    """A {n}, {n,}, {n,m} quantifier at pattern[i] (the "{"): ((n, m or None), index after it), or None where
    the brace is a plain character. A count of more than 18 digits is _CAP (Python's int() refuses 4300)."""
    j = pattern.find("}", i)
    if j < 0:
        return None
    body = pattern[i + 1:j].replace(" ", "")
    lo, comma, hi = body.partition(",")
    if not _digits(lo) or (hi and not _digits(hi)):
        return None
    return (_number(lo), _number(hi) if hi else (None if comma else _number(lo))), j + 1


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _number(digits: str) -> int:
    return _CAP if len(digits) > 18 else int(digits)


_SIMPLE = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7, "0": 0, "e": 27}
_HEX = {"x": 2, "u": 4, "U": 8}
_UNIVERSE = 0x110000 - 0x800   # Unicode scalar values (no surrogates): what the engine's classes hold


def _escape(body: str, k: int):
    """The codepoint of the escape at body[k] (a backslash) and the index after it; (None, index) for a class
    escape (\\d, \\p{L}: many codepoints); raises ValueError for one it cannot read."""
    e = body[k + 1:k + 2]
    if not e:
        raise ValueError("a lone backslash")
    if e in _CLASS_ESCAPES:
        if e in "pP" and body[k + 2:k + 3] == "{":
            end = body.find("}", k)
            if end < 0:
                raise ValueError("unclosed \\p{")
            return None, end + 1
        return None, k + 2 + (e in "pP")
    if e in _HEX:
        if body[k + 2:k + 3] == "{":
            end = body.find("}", k)
            if end < 0:
                raise ValueError("unclosed \\x{")
            digits, after = body[k + 3:end], end + 1
        else:
            digits, after = body[k + 2:k + 2 + _HEX[e]], k + 2 + _HEX[e]
        if not digits or len(digits) > 8 or any(ch not in "0123456789abcdefABCDEF" for ch in digits):
            raise ValueError("not hexadecimal")
        return int(digits, 16), after
    if e in _SIMPLE:
        return _SIMPLE[e], k + 2
    if e.isascii() and e.isalnum():   # \c, \b and the like: not read here
        raise ValueError("an escape not read here")
    return ord(e), k + 2


def _class_ranges(body: str):
    """A class's members (body: between "[" or "[^" and "]") as codepoint ranges; None where one of them stands
    for many (\\d, [:alpha:]). Raises ValueError for what it cannot read (a nested class, a set operation)."""
    ranges, k = [], 0
    while k < len(body):
        if body.startswith("[:", k):   # [[:alpha:]]
            return None
        if body[k] == "[" or body[k:k + 2] in ("&&", "--", "~~"):
            raise ValueError("a nested class or a set operation")
        if body[k] == "\\":
            lo, k = _escape(body, k)
            if lo is None:
                return None
        else:
            lo, k = ord(body[k]), k + 1
        hi = lo
        if body[k:k + 1] == "-" and k + 1 < len(body):   # a range (a "-" last is the character)
            if body[k + 1] == "\\":
                hi, k = _escape(body, k + 1)
                if hi is None:
                    raise ValueError("a range to a class escape")
            elif body[k + 1] == "[":
                raise ValueError("a range to a class")
            else:
                hi, k = ord(body[k + 1]), k + 2
        ranges.append((min(lo, hi), max(lo, hi)))
    return ranges


def _one_character(cls: str, negated: bool) -> bool:
    """Whether a class ("[...]" as written) may hold one character only ([a], [a-a], [\\x61], [^\\x00-\\x60\\x62-
    \\U0010FFFF]): a literal to the engine (its parser turns any class of one codepoint into one), and as costly as
    one (([a]{1000}){300} took 89 ms a mask, ([ab]{1000}){1000} 0.0 ms). Judged by meaning, not spelling: a class
    is free only when it provably holds at least two codepoints; one this cannot read counts as a literal."""
    body = cls[1 + negated:-1]
    try:
        ranges = _class_ranges(body)
    except ValueError:
        return True
    if ranges is None:
        return False
    held, end = 0, -1
    for lo, hi in sorted(ranges):   # merged: [aa] and [\\x61a] are one codepoint
        lo = max(lo, end + 1)
        if hi >= lo:
            held += hi - lo + 1 - max(0, min(hi, 0xDFFF) - max(lo, 0xD800) + 1)
            end = hi
    return (_UNIVERSE - held if negated else held) < 2


def _verbose(pattern: str) -> str:
    """The pattern with verbose mode's ignored text gone ((?x): whitespace outside classes, # to the line's end)
    wherever a flag group turns x on anywhere in it, so that (?x)(a{1000}) {1000} counts as (a{1000}){1000};
    removing it elsewhere can only join atoms, never hide a count."""
    out, i, n, in_class = [], 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            out.append(c)
            if pattern[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
            if pattern[i + 1:i + 2] == "]":
                out.append("]")
                i += 1
            i += 1
            continue
        elif c.isspace():
            i += 1
            continue
        elif c == "#":
            end = pattern.find("\n", i)
            i = end + 1 if end >= 0 else n
            continue
        out.append(c)
        i += 1
    return "".join(out)


_FLAGS_X = re.compile(r"\(\?[A-Za-z]*x[A-Za-z]*(?:-[A-Za-z]*)?[:)]")


def _times(count) -> int:
    lo, hi = count
    return hi if hi is not None else lo


def regex_cost(pattern: str) -> int:
    """The repeat cost (see the module's docstring) of a regular expression, ECMA-262's or the grammar engine's
    (Rust's) syntax alike. Read leniently: whatever it does not understand counts as one character (a pattern that
    does not parse is refused by the engine itself)."""
    if _FLAGS_X.search(pattern):
        pattern = _verbose(pattern)
    # frames: [alternatives' size so far, current sequence's size, last atom's size, last atom one class, cost]
    stack = [[0, 0, 0, False, 0]]
    i, n = 0, len(pattern)

    def atom(size: int, one_class: bool):
        top = stack[-1]
        top[1] += size
        top[2], top[3] = size, one_class

    while i < n:
        c = pattern[i]
        if c == "\\":
            e = pattern[i + 1:i + 2]
            i += 2
            if e in ("x", "u", "p", "P") and pattern[i:i + 1] == "{":   # \x{41}, \u{41}, \p{L}
                end = pattern.find("}", i)
                i = end + 1 if end >= 0 else n
            atom(1, e in _CLASS_ESCAPES or e in ("p", "P"))
            continue
        if c == "[":   # a class, to its closing "]" (nested classes: the grammar engine's [a-z&&[^x]])
            j = i + 1
            j += pattern[j:j + 1] == "^"
            j += pattern[j:j + 1] == "]"
            depth = 1
            while j < n and depth:
                ch = pattern[j]
                if ch == "\\":
                    j += 2
                    continue
                if ch == "[" and pattern[j + 1:j + 2] == ":":   # [[:alpha:]]
                    end = pattern.find(":]", j + 2)
                    j = end + 2 if end >= 0 else j + 1
                    continue
                depth += (ch == "[") - (ch == "]")
                j += 1
            atom(1, not _one_character(pattern[i:j], pattern[i + 1:i + 2] == "^"))
            i = j
            continue
        if c == "(":
            i += 1
            if pattern[i:i + 1] == "?":   # (?:, (?<name>, (?P<name>, (?=, (?!, (?<=, (?s:; (?i) sets flags only
                j = i + 1
                while j < n and pattern[j] not in ":)>=!":
                    j += 1
                if pattern[j:j + 1] == ")":
                    i = j + 1
                    continue
                i = j + 1
            stack.append([0, 0, 0, False, 0])
            continue
        if c == ")" and len(stack) > 1:
            alts, seq, last, one, cost = stack.pop()
            single = alts == 0 and one and seq == last   # the group is one class: ([a-z])
            stack[-1][4] = min(_CAP, stack[-1][4] + cost)
            atom(min(_CAP, alts + seq), single)
            i += 1
            continue
        if c == "|":
            top = stack[-1]
            top[0], top[1], top[2], top[3] = min(_CAP, top[0] + top[1]), 0, 0, False
            i += 1
            continue
        if c == "{":
            got = _count(pattern, i)
            if got is not None:
                count, i = got
                top = stack[-1]
                k = min(_CAP, _times(count))
                if k != 1 and not top[3]:
                    top[1] = min(_CAP, top[1] - top[2] + top[2] * k)
                    top[4] = min(_CAP, top[4] + top[2] * k)
                    top[2] = min(_CAP, top[2] * k)
                if i < n and pattern[i] in "?+":   # lazy / possessive
                    i += 1
                continue
        if c in "*+?":
            i += 1
            if i < n and pattern[i] in "?+":
                i += 1
            continue
        if c in "^$":
            i += 1
            continue
        atom(1, c == ".")
        i += 1
    while len(stack) > 1:   # an unclosed group: the engine refuses it; its cost still counts
        alts, seq, last, one, cost = stack.pop()
        stack[-1][4] = min(_CAP, stack[-1][4] + cost)
    return stack[0][4]


def too_costly(cost: int) -> str:
    """The words of a refusal for a repeat cost over MAX_REPEAT_COST."""
    return (f"its counted repetitions write out {cost:,} characters (nested counts multiply: (a{{300}}){{300}} is "
            f"90,300), over the limit of {MAX_REPEAT_COST:,} (each token's mask would take the grammar engine too "
            "long); use fewer or smaller counts, or * / + in place of large ones")
