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
cost 10,000 ((a{100}){100}, a{10000}): 2-3 / 12 ms; 50,000 (a{50000}): 10 / 54 ms; 90,000 ((a{300}){300}):
16-21 / 120 ms; 1,000,000 ((a{1000}){1000}): 335 / 2,500 ms and 350 MB. MAX_REPEAT_COST keeps a mask within
a few milliseconds; every ordinary pattern (dates, emails, [a-z]{1,64}(\\.[a-z]{1,64}){0,10}, pydantic's) costs
at most a few hundred.
"""
from __future__ import annotations

MAX_REPEAT_COST = 20_000
_CAP = 10 ** 18   # counts past this are all "too much": keeps the numbers small
_CLASS_ESCAPES = set("dDsSwWpPhHvVRNX")


def _count(pattern: str, i: int):
    """A {n}, {n,}, {n,m} quantifier at pattern[i] (the "{"): ((n, m or None), index after it), or None where
    the brace is a plain character."""
    j = pattern.find("}", i)
    if j < 0:
        return None
    body = pattern[i + 1:j].replace(" ", "")
    lo, comma, hi = body.partition(",")
    if not lo.isdigit() or (hi and not hi.isdigit()):
        return None
    return (int(lo), int(hi) if hi else (None if comma else int(lo))), j + 1


def _one_character(cls: str, negated: bool) -> bool:
    """Whether a class ("[...]" as written) holds one character only ([a], [\\x{61}]): a literal to the engine,
    and as costly as one (([a]{1000}){300} took 89 ms a mask, ([ab]{1000}){1000} 0.0 ms)."""
    if negated:
        return False
    body, members, k = cls[1:-1], set(), 0
    while k < len(body):
        if body[k] == "\\":
            e = body[k + 1:k + 2]
            if e in _CLASS_ESCAPES:
                return False
            end = body.find("}", k) + 1 if body[k + 2:k + 3] == "{" else k + 2
            members.add(body[k:end or len(body)])
            k = end or len(body)
        elif body[k] == "-" and members and k + 1 < len(body) or body[k] == "[":
            return False
        else:
            members.add(body[k])
            k += 1
    return len(members) == 1


def _times(count) -> int:
    lo, hi = count
    return hi if hi is not None else lo


def regex_cost(pattern: str) -> int:
    """The repeat cost (see the module's docstring) of a regular expression, ECMA-262's or the grammar engine's
    (Rust's) syntax alike. Read leniently: whatever it does not understand counts as one character (a pattern that
    does not parse is refused by the engine itself)."""
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
            f"90,000), over the limit of {MAX_REPEAT_COST:,} (each token's mask would take the grammar engine too "
            "long); use fewer or smaller counts, or * / + in place of large ones")
