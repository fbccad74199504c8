"""Constrained decoding: JSON, JSON Schema, regular expressions and grammars that every sampled token obeys.

A `Constraint` is a spec (what the user asked for); `compile_constraint(tokenizer, n_vocab, spec)` turns it
into a `CompiledConstraint` against the model's tokenizer once (cached per tokenizer and spec), and each
sequence gets its own `TokenMatcher` from it. Before a token is sampled, `TokenMatcher.apply(logits)` sets
the logit of every token the grammar forbids to -inf (end of text is allowed only where the grammar is
complete); after it is sampled, `advance(token)` moves the matcher on. Every path that samples (generate(),
the batching scheduler, so `bitnet run`, bitchat, the Python API and `bitnet serve`) does exactly that.

The grammar engine is llguidance (Rust core, no torch, on PyPI): it takes JSON Schema, regexes and Lark
grammars, and llama.cpp's GBNF through its own GBNF -> Lark converter. Why it and not xgrammar: see
docs/structured-output.md (xgrammar's package pulls torch; the engine must never need torch).

Where the cost goes: the mask for the next step depends only on the tokens so far, so `start_mask()` computes
it on a helper thread while the forward pass runs (llguidance releases the GIL), and `apply()` waits for it.
`forced(k)`: the tokens the grammar admits as the only continuation (JSON keys, punctuation); the generators
run them as a draft through one multi-row verify pass, each row still sampled under its mask, so the output
is token for token what plain constrained decoding gives, at one weight read for the whole forced run.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal

import numpy as np

from ..errors import BitNetError, ConstraintError, GrammarBusyError, json_text, shown_number
from .grammar_cost import MAX_REPEAT_COST, regex_cost, too_costly

KINDS = ("json_object", "json_schema", "regex", "gbnf", "lark")
MAX_SPEC_BYTES = 256 << 10          # a schema or grammar larger than this is refused before compiling
# What a spec may cost is judged before compiling, by its text (grammar_cost.MAX_REPEAT_COST, MAX_SPEC_BYTES), the
# same answer every time. The time limit is the last resort for what that misses: a compile past it is refused (400),
# and runs on to its end in the background, holding its compile slot (it cannot be stopped inside the engine).
COMPILE_TIMEOUT_S = 60.0            # a spec whose compilation (with its first mask) takes longer is refused
COMPILE_SLOTS = 2                   # compiles that run at once, in the whole process; others wait for a slot
COMPILE_WAIT_S = 30.0               # a request that waited this long for a slot gets GrammarBusyError (503)
CACHE_SPECS = 64                    # compiled specs kept per tokenizer (LRU) ...
# ... and the memory they may hold together (each one's estimate: the process's RSS growth while it compiled)
CACHE_BYTES = None                  # None: BITNET_GRAMMAR_CACHE_MB (MiB, default 256), read when used


def cache_bytes() -> int:
    """CACHE_BYTES, or BITNET_GRAMMAR_CACHE_MB in MiB (a whole number, 0 = no cache): BitNetError, one line, for
    another value (256M was a traceback at import that stopped every command; -5 was taken silently)."""
    if CACHE_BYTES is not None:
        return CACHE_BYTES
    value = os.environ.get("BITNET_GRAMMAR_CACHE_MB", "256").strip()
    if not (value.isascii() and value.isdigit()) or len(value) > 9:
        raise BitNetError(f"BITNET_GRAMMAR_CACHE_MB={value!r}: expected a whole number of MiB (0 = no cache)")
    return int(value) << 20
# compact JSON with OpenAI's separators: the model cannot pad an answer with endless whitespace, and more of
# the text is forced (jump-forward) instead of sampled
JSON_OPTIONS = {"whitespace_flexible": False}
# An integer the schema leaves unbounded gets int64's range, so a model cannot write digits until max_tokens (a
# small one does: '{"a":29901099901990900199...'; llama.cpp's converter caps such integers at 16 digits). The grammar
# engine reads bounds as doubles, so the bound is 2**63 - 1024, the largest double under 2**63.
INT_BOUND = 2 ** 63 - 1024
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")   # name -> schema
_DATA_KEYWORDS = ("const", "enum", "default", "examples")                                       # values, not schemas


@dataclass(frozen=True)
class Constraint:
    """What the output must match. kind: "json_object" (any JSON object) | "json_schema" | "regex" | "gbnf"
    (llama.cpp's grammar format) | "lark" (llguidance's Lark dialect). source: the schema as JSON
    text, or the regex / grammar text. where: how the caller's user names the field (for error messages).
    jump_forward: run forced tokens as a verified draft (same output, fewer weight passes).
    free_start: the answer may start as free text (a tool grammar's "auto": text, or a thought, before any call);
    otherwise the grammar decides how it starts, and its output is the answer, never a thought (reasoning.py)."""
    kind: str
    source: str = ""
    where: str = "constraint"
    jump_forward: bool = True
    free_start: bool = False

    @classmethod
    def json_object(cls, *, where: str = "response_format", jump_forward: bool = True) -> "Constraint":
        return cls("json_object", "", where, jump_forward)

    @classmethod
    def json_schema(cls, schema, *, where: str = "json_schema", jump_forward: bool = True) -> "Constraint":
        """schema: a dict (or its JSON text), or JSON Schema's true (any value). Refused here when it is not a JSON
        object at all, or false; everything else is judged when compiling (unsupported keywords, bad $refs)."""
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"{where}: not valid JSON: {e}", where=where) from None
        if schema is True:
            schema = {}
        if schema is False:   # JSON Schema's boolean schema that no value matches
            raise ConstraintError(f"{where}: the schema false matches no value, so no answer can be generated",
                                  where=where)
        if not isinstance(schema, dict):
            raise ConstraintError(f"{where}: a JSON Schema must be a JSON object, got {type(schema).__name__}",
                                  where=where)
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)   # key order kept: it is the output order
        except (TypeError, ValueError) as e:
            raise ConstraintError(f"{where}: not a JSON document: {e}", where=where) from None
        return cls("json_schema", text, where, jump_forward)

    @classmethod
    def regex(cls, pattern: str, *, where: str = "regex", jump_forward: bool = True) -> "Constraint":
        return cls("regex", _text(pattern, where), where, jump_forward)

    @classmethod
    def gbnf(cls, grammar: str, *, where: str = "grammar", jump_forward: bool = True) -> "Constraint":
        return cls("gbnf", _text(grammar, where), where, jump_forward)

    @classmethod
    def lark(cls, grammar: str, *, where: str = "grammar", jump_forward: bool = True) -> "Constraint":
        return cls("lark", _text(grammar, where), where, jump_forward)

    @classmethod
    def coerce(cls, value, *, where: str = "constraint") -> "Constraint | None":
        """The Python API's `constraint=` argument: a Constraint, a JSON Schema dict or boolean schema (True: any
        JSON value; False matches none: a ConstraintError saying so), "json" (any object), or None. Regexes and
        grammars are given as Constraint.regex(...) / Constraint.gbnf(...): a bare string would be ambiguous."""
        if value is None or isinstance(value, Constraint):
            return value
        if isinstance(value, dict) or value is True or value is False:
            return cls.json_schema(value, where=where)
        if value == "json":
            return cls.json_object(where=where)
        raise ConstraintError(f"{where}: expected a Constraint, a JSON Schema (a dict, True or False) or 'json', "
                              f"got {value!r:.60}",
                              where=where)

    def _surrogate(self, e: UnicodeEncodeError) -> ConstraintError:
        return ConstraintError(f"{self.where}: holds a lone UTF-16 surrogate (\\u{ord(e.object[e.start]):04x}): "
                               "not text", where=self.where)

    def refuse_costly(self):
        """ConstraintError for a spec too large or too costly by its text alone (MAX_SPEC_BYTES, repeat_problem):
        judged the same way every time, before anything is compiled."""
        try:
            size = len(self.source.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise self._surrogate(e) from None
        if size > MAX_SPEC_BYTES:
            raise ConstraintError(f"{self.where}: {size} bytes is larger than the"
                                  f" {MAX_SPEC_BYTES >> 10} KiB limit for a schema or grammar", where=self.where)
        try:
            problem = repeat_problem(self)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:   # a count past what Python reads
            raise ConstraintError(f"{self.where}: cannot be enforced: {_one_line(e)}", where=self.where) from None
        if problem:
            raise ConstraintError(f"{self.where}: {problem}", where=self.where)

    def grammar(self) -> str:
        """The spec as an llguidance grammar (JSON text)."""
        try:
            return self._grammar()
        except UnicodeEncodeError as e:   # a lone surrogate in a pattern or a schema's string: as a prompt's
            raise self._surrogate(e) from None
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            # llguidance's own refusals of a spec it cannot represent (an integer past 64 bits in a schema)
            raise ConstraintError(f"{self.where}: cannot be enforced: {_one_line(e)}", where=self.where) from None

    def _refused_step(self) -> str | None:
        """The grammar engine's "Value for 'multipleOf' has too many digits: 9999999999999992" (for 1e-300: its own
        reading of the double, not the number sent) said with the client's value and where it stands: the first
        multipleOf of the schema that the engine refuses alone."""
        from llguidance import LLMatcher
        try:
            schema = json.loads(self.source)
        except ValueError:
            return None
        for ptr, node in _schema_nodes(schema):
            v = node.get("multipleOf")
            if not _is_num(v):
                continue
            try:
                alone = LLMatcher.grammar_from_json_schema(_schema_copy({"type": "number", "multipleOf": v},
                                                                        _decimal_steps))
                refused = bool(LLMatcher.validate_grammar(alone))
            except (ValueError, TypeError, OverflowError):
                refused = True
            if refused:
                return (f"{_pointer(ptr)}: multipleOf {_short_number(v)}: the grammar engine writes "
                        "multiples of a step of at most 9 significant digits, down to about 10^-10 (it reads the step "
                        "as a double: 123456789012345 and 1e-20 are past it); use a shorter step, or check the "
                        "multiple after parsing")
        return None

    def _grammar(self) -> str:
        from llguidance import LLMatcher

        self.refuse_costly()
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(prepared(json.loads(self.source), self.where),
                                                      defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        if self.kind == "gbnf":
            from .gbnf import GbnfError, gbnf_to_lark

            try:
                lark = gbnf_to_lark(self.source)
            except GbnfError as e:  # the converter's own syntax errors
                raise ConstraintError(f"{self.where}: GBNF grammar: {_one_line(e)}", where=self.where) from None
            return LLMatcher.grammar_from_lark(lark)
        raise ConstraintError(f"{self.where}: unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})",
                              where=self.where)


def _schema_copy(schema, fix):
    """A copy of a JSON Schema (its values under const / enum / default / examples kept as they are), each
    subschema passed through fix(copy) after its own subschemas were."""
    if isinstance(schema, list):
        return [_schema_copy(x, fix) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _DATA_KEYWORDS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _schema_copy(sub, fix) for name, sub in v.items()}
        else:
            out[k] = _schema_copy(v, fix)
    return fix(out)


def rebased(schema, pointer: str):
    """A copy of a JSON Schema to be placed at JSON pointer `pointer` of another (a tool's parameters inside
    the call's schema): its local references ("#", "#/$defs/...") point where their targets now are."""
    def fix(out):
        v = out.get("$ref")
        if isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out["$ref"] = "#" + pointer + v[1:]
        return out
    return _schema_copy(schema, fix)


EXACT_INT = 1 << 53   # integers past this are not all doubles; the grammar engine reads a schema's numbers as doubles
WIDE = (-(1 << 63), 1 << 64)   # the integers the grammar engine takes as such (int64, uint64); others go as doubles


def _wide(v) -> bool:
    """An integer the grammar engine cannot take as one (its JSON reader holds 64 bits): it gets the double."""
    return isinstance(v, int) and not isinstance(v, bool) and not WIDE[0] <= v < WIDE[1]


def _as_double(v):
    """A wide integer as the double that the grammar engine enforces by its shortest digits (1e20 is written
    100000000000000000000); None where those digits are another integer (2^64's double is 18446744073709552000)
    or no double holds it."""
    try:
        d = float(v)
    except OverflowError:
        return None
    return d if int(Decimal(repr(d))) == v else None


def unenforceable(schema) -> str | None:
    """What of a JSON Schema the grammar engine would enforce other than written (None: nothing), found before
    it is handed over: an integer past 2^53 that no double equals, in multipleOf, const or enum (it was rounded:
    const 9007199254740993 gave 9007199254740992, a snowflake id another id; bounds are rounded inward instead,
    _inward_bounds), or one past 64 bits that a double's shortest digits do not write (_as_double); an integer
    bound that leaves nothing within int64's range (INT_BOUND); minProperties above 1 over keys that may come
    from patternProperties / additionalProperties
    (the grammar cannot see a key repeated, and counted {"a":1,"a":2} as two; one key is one key), and
    min/maxProperties over optional keys in a way the grammar engine cannot count (_key_counts)."""
    found: list[str] = []

    def inexact(v) -> bool:
        if isinstance(v, bool):
            return False
        if _wide(v):
            return _as_double(v) is None
        if isinstance(v, int):
            return abs(v) > EXACT_INT and float(v) != v
        if isinstance(v, list):
            return any(inexact(x) for x in v)
        if isinstance(v, dict):
            return any(inexact(x) for x in v.values())
        return False

    def fix(out):
        for key in ("multipleOf", "const", "enum"):
            if key in out and inexact(out[key]):
                found.append(f"{key}: an integer past 2^53 ({out[key]!r:.80}) that the grammar engine cannot "
                             "write exactly (it reads numbers as doubles, and past 64 bits writes a double's shortest "
                             "digits: 2^64 as 18446744073709552000); give it as a string")
        if _integers_only(out):
            past = [f"{k} {_short_number(out[k])}" for k in ("minimum", "exclusiveMinimum", "maximum",
                                                             "exclusiveMaximum")
                    if _is_num(out.get(k)) and (out[k] > INT_BOUND if "min" in k else out[k] < -INT_BOUND)]
            if past:
                found.append(f"{past[0]}: no integer the grammar engine can write is within it (it holds integers "
                             f"to int64's range, +-{INT_BOUND} as doubles): give such numbers as strings")
        counts = _key_counts(out)
        if counts:
            found.append(counts)
        return out
    _schema_copy(schema, fix)
    return found[0] if found else None


def _short_number(v) -> str:
    """A number of the request as a message shows it: every digit up to 40 (10^39 is not cut to look like
    10^39 when it was 10^300), else its first digits and its size (1000000000... (301 digits))."""
    text = shown_number(v)
    digits = text.lstrip("-")
    return text if len(digits) <= 40 or not digits.isdigit() else f"{text[:20]}... ({len(digits)} digits)"


def _key_counts(out) -> str | None:
    """unenforceable's word on a node's minProperties / maxProperties. The grammar engine counts keys only where
    every key in properties is required, or, with no other keys allowed, for one key more than the required ones
    (at least one / at most one of the optional keys): it refused the rest with advice of its own, after this
    check had advised listing the keys, so each 400 sent the client to the other."""
    mn, mx = (out.get(k) if _is_num(out.get(k)) else None for k in ("minProperties", "maxProperties"))
    if mn is None and mx is None:
        return None
    props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
    required = {k for k in out.get("required") or () if isinstance(k, str)} \
        if isinstance(out.get("required"), list) else set()
    n_req, optional = len(required), [k for k in props if k not in required]
    free = out.get("additionalProperties", True) is not False or out.get("patternProperties")
    works = "make every key in properties required, or (with additionalProperties false) ask for one key more " \
        f"than the required ones: minProperties / maxProperties {n_req + 1}"
    if mn is not None and mn > 1 and mn > n_req and free:
        return f"minProperties {mn} over keys not listed in properties cannot be enforced (a key written twice " \
               f"would count twice); list the keys in properties with additionalProperties false, and {works}"
    for name, v in (("minProperties", mn), ("maxProperties", mx)):
        if v is None or not optional or (name == "minProperties" and v <= n_req) or (not free and v == n_req + 1):
            continue
        return f"{name} {v} over optional keys ({', '.join(optional[:3])}{', ...' if len(optional) > 3 else ''}) " \
               f"cannot be enforced; {works}"
    return None


def _inward_bounds(out):
    """An integer schema node's bounds past 2^53 that no double equals, made the nearest doubles inside them
    (maximum 2^63 - 1, int64's, becomes 2^63 - 1024): the grammar engine reads bounds as doubles, and rounded
    outward one let a value past the bound through (minimum 2^53 + 1 took 2^53)."""
    def inside(v, down: bool) -> int:
        d = float(v)
        if (d > v) if down else (d < v):
            d = math.nextafter(d, -math.inf if down else math.inf)
        return int(d)

    def tighten(down: bool, bound: int):
        """The inclusive bound, kept as the tighter of it and one the node already has (maximum 5 beside
        exclusiveMaximum 10^20 stays 5)."""
        name = "maximum" if down else "minimum"
        have = out.get(name)
        if _is_num(have) and (have < bound if down else have > bound) and abs(have) <= INT_BOUND:
            bound = have
        if out.get("exclusive" + name.capitalize()) is True:   # draft 4's flag, now about a bound it never saw
            del out["exclusive" + name.capitalize()]
        out[name] = bound

    if not _integers_only(out):
        return out
    for key, down, step in (("maximum", True, 0), ("exclusiveMaximum", True, -1),
                            ("minimum", False, 0), ("exclusiveMinimum", False, 1)):
        v = out.get(key)
        if _is_num(v) and (v > INT_BOUND if down else v < -INT_BOUND):
            # past int64's range: the grammar engine's integers stop there (it failed on 10^20, or took 2^64 as
            # a value it cannot hold); int64's range less its last 1023 values, as for an unbounded integer
            del out[key]
            tighten(down, INT_BOUND if down else -INT_BOUND)
        elif _is_num(v) and float(v).is_integer() and (step and abs(v) >= EXACT_INT or float(v) != v):
            # an exclusive integer bound becomes the inclusive one inside: also one that is a double past 2^53,
            # which the grammar engine moved by 1 in doubles (2^53 + 1 is 2^53) and so took the bound itself
            del out[key]
            tighten(down, inside(int(v) + step, down))
    return out


def _exclusive_numbers(out):
    """A number node's exclusive integer bound on the side towards 0 (exclusiveMinimum 0, or draft 4's minimum 0
    with exclusiveMinimum true) where its other bound lies within one integer step of it: as the nearest double
    inside it, inclusive.
    The grammar engine's range of decimals then let the bound itself through ((0, 0.5) took 0, (-1.5, -1) took
    -1, (-0.25, 0) took -0). For 0 the bound is 10^-30 (or a tenth of the other bound, nearer): the engine writes
    a bound's digits out, and the double next to 0 has 324 of them."""
    if _integers_only(out):
        return out
    for side, other_side, sign in (("Minimum", "Maximum", 1), ("Maximum", "Minimum", -1)):
        excl, incl = "exclusive" + side, side.lower()
        v = out.get(excl)
        if v is True and _is_num(out.get(incl)):   # draft 4: the flag makes `minimum` itself exclusive
            v = out[incl]
        if not _is_num(v) or not math.isfinite(v) or not float(v).is_integer():
            continue
        others = [out.get(k) for k in ("exclusive" + other_side, other_side.lower())]
        other = next((o for o in others if _is_num(o)), None)
        if other is None or v * sign < 0 or not 0 < (other - v) * sign < 1:
            continue   # (the far side of a range in one step, (-2, -1.5)'s -2, is the engine's right)
        if v == 0:
            inside = sign * min(1e-30, abs(other) / 10)
        else:
            inside = math.nextafter(float(v), sign * math.inf)
        out.pop(excl)
        have = out.get(incl)
        if not _is_num(have) or (have < inside if sign > 0 else have > inside) or have == v:
            out[incl] = inside
    return out


def _integers_only(out) -> bool:
    t = out.get("type")
    types = t if isinstance(t, list) else [t]
    return "integer" in types and "number" not in types


def _doubles(out):
    """A node's wide integers (WIDE) as the doubles that equal them, in its values (const, enum) and its bounds:
    the grammar engine refused them whole ("Value is not JSON serializable"); unenforceable refused those no
    double's digits write. default / examples, which enforce nothing, are dropped where one would not pass."""
    def conv(v):
        if _wide(v):
            d = _as_double(v)
            if d is None:
                raise ValueError(f"{v!r:.40}: an integer past 64 bits that no double's digits write")
            return d
        if isinstance(v, list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    for key, v in list(out.items()):
        if key in _SCHEMA_MAPS or isinstance(v, dict) and key not in _DATA_KEYWORDS:
            continue   # schemas: their own nodes were converted
        try:
            out[key] = conv(v) if key in _DATA_KEYWORDS or _wide(v) else v
        except ValueError:
            if key not in ("default", "examples"):
                raise
            del out[key]
    return out


_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "dependentSchemas", "if")   # keywords whose schemas add to a node's


def closed_objects(schema):
    """A copy of a JSON Schema in which an object that lists `properties` and says nothing of others
    (additionalProperties, patternProperties, unevaluatedProperties) has only those: llama.cpp's and ollama's
    reading (json-schema-to-grammar), which the schemas clients send rely on (pydantic's never say
    additionalProperties; OpenAI's strict mode requires it false). By the letter of JSON Schema other keys are
    allowed, and a small model then ran on writing invented keys. Schemas that combine with others stay open:
    a node with allOf / anyOf / oneOf / $ref beside its properties, the parts of an allOf, the branches of an
    anyOf / oneOf beside properties (or inside an allOf part), and the definitions those refer to; closed, each
    would refuse the others' properties (llama.cpp merges such parts into one object)."""
    from urllib.parse import unquote
    closed: set[int] = set()

    def fix(out):
        props, required = out.get("properties"), out.get("required")
        if isinstance(props, dict) and not any(
                k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties", *_COMBINED)) \
                and all(k in props for k in (required if isinstance(required, list) else ())):
            out["additionalProperties"] = False   # (a required key it does not list stays allowed: left open)
            closed.add(id(out))
        return out
    out = _schema_copy(schema, fix)
    unresolved = []

    def target(ref):
        """The node a local JSON pointer ("#/$defs/a%20b") names; None, noted, for any other $ref ("#anchor", a
        $id's URL): what it combines with is not known here, so nothing is closed at all."""
        if not ref.startswith("#/"):
            unresolved.append(ref)
            return None
        node = out
        for key in ref[2:].split("/"):
            key = unquote(key).replace("~1", "/").replace("~0", "~")
            node = node.get(key) if isinstance(node, dict) else node[int(key)] \
                if isinstance(node, list) and key.isdigit() and int(key) < len(node) else None
        if node is None:
            unresolved.append(ref)
        return node

    def reopen(node, seen):
        """node and every schema it is combined with (its composition's parts, its $ref's target), open."""
        while isinstance(node, dict) and id(node) not in seen:
            seen.add(id(node))
            if id(node) in closed:
                del node["additionalProperties"]
                closed.discard(id(node))
            for key in ("allOf", "anyOf", "oneOf"):
                for part in node.get(key) if isinstance(node.get(key), list) else ():
                    reopen(part, seen)
            ref = node.get("$ref")
            node = target(ref) if isinstance(ref, str) else None

    seen: set[int] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if "allOf" in node or (isinstance(node.get("properties"), dict) and any(k in node for k in _COMBINED)):
            for key in ("allOf", "anyOf", "oneOf"):
                for part in node.get(key) if isinstance(node.get(key), list) else ():
                    reopen(part, seen)
            ref = node.get("$ref")
            if isinstance(ref, str):
                reopen(target(ref), seen)
        stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)
    return _schema_copy(schema, lambda x: x) if unresolved else out


# RFC 3339 dates and times, exactly: the grammar engine's own formats took February 29 of any year and a leap second
# at any minute ("2023-02-29", "21:18:60+13:48"), which JSON Schema's format checkers refuse. A leap second is
# left out (it is valid at one instant of a few days in history); a fraction has at most 9 digits (nanoseconds).
_DATE = ("(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         "|02-(?:0[1-9]|1[0-9]|2[0-8]))|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
         "-02-29)")
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[tT]{_TIME}$"}
# the longest text a format allows, where the grammar engine's own format has no limit (it gave hostnames of 1,000
# characters): RFC 1123's 253 for a hostname, RFC 5321's 254 for an email address
FORMAT_MAX_LENGTH = {"hostname": 253, "email": 254}
# An email address as the grammar engine's own format writes one (a dot-string, then a domain of labels; its
# address literals, "[192.0.2.1]", left out), and RFC 5321's 64-character cap on the part before the "@" (the
# engine's format had none: a small model wrote local parts of 252 characters, which validators refuse). Two
# patterns the engine intersects: its own format beside a second pattern and maxLength was too much for it. Beside
# a pattern of the schema's own, three patterns were too much as well: there the part before the "@" is at most 32
# characters between dots, 63 in all (EMAIL_PATTERN_SHORT, one pattern).
_ATEXT = "[a-zA-Z0-9!#$%&'*+\\-/=?^_`{|}~]"
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
EMAIL_PATTERN = f"^{_ATEXT}+(?:\\.{_ATEXT}+)*@{_LABEL}(?:\\.{_LABEL})*$"
EMAIL_LOCAL_PART = "^[^@]{1,64}@"
EMAIL_PATTERN_SHORT = f"^{_ATEXT}(?:\\.?{_ATEXT}){{0,31}}@{_LABEL}(?:\\.{_LABEL})*$"


# ECMA-262's \s (WhiteSpace and LineTerminator) in the grammar engine's regex syntax: Rust's \s is Unicode's
# White_Space, which adds U+0085 (NEL) and leaves out U+FEFF
ECMA_SPACE = ("\\t\\n\\x0B\\x0C\\r \\xA0\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
              "\\x{3000}\\x{FEFF}")


def ecma_pattern(pattern: str) -> str:
    """A JSON Schema pattern (ECMA-262) for the grammar engine's regexes (Rust's), where they read the same text
    differently: `.` outside a class matches no line terminator (Rust's took \\r, U+2028, U+2029); `\\s` / `\\S` are
    ECMA's set (Rust's took U+0085 and refused U+FEFF); a `[` inside a class is a plain `[` (Rust's opens a nested
    class). Refused (ValueError, saying what to write): a POSIX class `[[:alpha:]]` (Rust's syntax; ECMA reads the
    class `[[:alph]` then `]`), a class that starts `[]` or `[^]` (ECMA's empty / any-character class; Rust reads
    `]` as a member), `&&`, `--`, `~~` in a class (Rust's set operations, ECMA's plain characters), and a
    look-around (the grammar engine's regexes have none: split_lookaheads takes the one form it can write first).
    The ValueError says what and what to write; the caller names the pattern and where it stands."""
    def refuse(what: str, write: str):
        raise ValueError(f"{what}; {write}")

    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            esc = pattern[i:i + 2]
            if esc in ("\\s", "\\S"):   # in a class, a nested class: a union there
                out.append(("[^" if esc[1] == "S" else "[") + ECMA_SPACE + "]")
            else:
                out.append(esc)
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            elif c == "[":
                posix = re.match(r"\[:\^?[a-z]+:\]", pattern[i:])
                if posix:
                    refuse(f"{posix.group()!r} is a POSIX class, which ECMA-262 (JSON Schema's regexes) does not "
                           "have", "write the characters, such as [a-zA-Z] for [[:alpha:]] or [0-9] for [[:digit:]]")
                c = "\\["
            elif pattern[i:i + 2] in ("&&", "--", "~~"):
                refuse(f"{pattern[i:i + 2]!r} in a class is a set operation in the grammar engine's regexes, not "
                       "ECMA-262's characters", f"write each character escaped (\\{pattern[i]}\\{pattern[i]})")
        elif c == "[":
            in_class = True
            start = pattern[i + 1:i + 3]
            if start.startswith("]") or start == "^]":
                empty = start.startswith("]")
                refuse(f"{'[]' if empty else '[^]'!r} is ECMA-262's {'empty' if empty else 'any-character'} "
                       "class, which the grammar engine reads as a class holding ']'",
                       "write \\] for a ']' in a class, or [\\s\\S] for any character")
            if start.startswith("^"):   # the negation, then the class's first member
                out.append("[^")
                i += 2
                continue
        elif c == "(" and re.match(r"\(\?<?[=!]", pattern[i:]):
            kind = re.match(r"\(\?<?[=!]", pattern[i:]).group()
            refuse(f"the look-around {kind!r} cannot be enforced: the grammar engine's regexes have none (of them it "
                   "takes only a leading (?!C*$) or (?!C+$), C one character class: some character is not C)",
                   "write the pattern without it (fold what it excludes into the pattern, or check that after "
                   "parsing)")
        elif c == ".":
            c = "[^\\n\\r\u2028\u2029]"
        out.append(c)
        i += 1
    return "".join(out)


# a leading negative look-ahead that says "not made only of C to the end": C one ECMA character class ([...], \d,
# \s, \w and their negations, or .), after the pattern's own ^ and with one of its own or none (pydantic's Decimal
# pattern is ^(?!^[-+.]*$)[+-]?0*\d*\.?\d*$: a number that is more than signs and dots; "not blank" is (?!\s*$))
_LEADING_NOT = re.compile(r"\(\?!\^?(\[\^?(?!\])(?:\\.|[^\]\\])+\]|\\[dDsSwW]|\.)([*+])\$\)")
_NEGATED = {"\\d": "\\D", "\\D": "\\d", "\\s": "\\S", "\\S": "\\s", "\\w": "\\W", "\\W": "\\w",
            ".": "[\\n\\r\u2028\u2029]"}


def split_lookaheads(pattern: str) -> tuple[str, list[str]]:
    """A JSON Schema pattern (ECMA-262) whose leading negative look-aheads the grammar engine can write, as the
    pattern without them (ECMA's still) and the patterns that must hold beside it (the grammar engine's regexes;
    it intersects a node's pattern with its allOf's). At the start (^), (?!C*$) holds where some character is not
    C, and (?!C+$) where the text is empty or one is. Any other pattern comes back as it is, with none."""
    if not pattern.startswith("^"):
        return pattern, []
    i, beside = 1, []
    while (m := _LEADING_NOT.match(pattern, i)) is not None:
        atom, repeat = m.groups()
        if atom in _NEGATED:
            other = _NEGATED[atom]
        elif atom.startswith("[^"):   # [^^a]'s complement is [\^a]: a ^ left first would negate it again
            body = atom[2:-1]
            other = "[" + ("\\" + body if body.startswith("^") else body) + "]"
        else:
            other = "[^" + atom[1:]
        some = f"(?s:.*){ecma_pattern(other)}(?s:.*)"
        beside.append(f"^{some}$" if repeat == "*" else f"^(?:{some})?$")
        i = m.end()
    if beside and _alternates(pattern[i:]):   # ^(?!X)a|b: the look-ahead guards a alone, not the whole text
        return pattern, []
    return "^" + pattern[i:], beside


def _alternates(pattern: str) -> bool:
    """Whether an ECMA pattern has a | outside every group and class."""
    depth, in_class, i = 0, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            return True
        i += 1
    return False


KNOWN_FORMATS = ("date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri")


def _engine_refusal(grammar_error: str) -> str:
    found = re.search(r"error: ([^\n]+)", grammar_error)
    return (found.group(1) if found else _one_line(grammar_error)).strip()


_pattern_problems: dict[str, str | None] = {}
_format_problems: dict[str, bool] = {}


def _pattern_problem(pattern: str) -> str | None:
    """Why the grammar engine cannot enforce a schema's pattern, and what to write (None: it can)."""
    if pattern in _pattern_problems:
        return _pattern_problems[pattern]
    from llguidance import LLMatcher
    problem = _inline_flags(pattern)
    try:
        if problem:
            raise ValueError(problem)
        rest, beside = split_lookaheads(pattern)
        for rx in (ecma_pattern(rest), *beside):
            err = LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(rx))
            if err:
                problem = (f"{_engine_refusal(err)} in the grammar engine's regexes; write the pattern without it "
                           "(ECMA-262 less back-references and look-arounds)")
                break
    except ValueError as e:
        problem = str(e)
    if len(_pattern_problems) < 4096:
        _pattern_problems[pattern] = problem
    return problem


_FLAG_GROUP = re.compile(r"\(\?[A-Za-z]*(?:-[A-Za-z]*)?[:)]")


def _inline_flags(pattern: str) -> str | None:
    """Why a JSON Schema pattern's inline flag group ((?x), (?i), (?s:...)) is refused: JSON Schema's patterns are
    ECMA-262's, which the grammar engine would read otherwise ((?x) ignores spaces: it hid a count from the cost
    check; (?i) and (?s) change what matches). None: the pattern has none (outside escapes and classes)."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + (pattern[i + 1:i + 2] == "]")   # a "]" first in a class is a character
            continue
        elif c == "(":
            found = _FLAG_GROUP.match(pattern, i)
            if found and found.group() not in ("(?:", "(?)"):
                return (f"an inline flag group {found.group()} is not JSON Schema's (ECMA-262) pattern syntax, and "
                        "the grammar engine would read it as a change of meaning; write the pattern without it")
        i += 1
    return None


def _unknown_format(fmt: str) -> bool:
    if fmt not in _format_problems:
        from llguidance import LLMatcher
        err = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema({"type": "string", "format": fmt}))
        if len(_format_problems) < 4096:
            _format_problems[fmt] = bool(err)
        return bool(err)
    return _format_problems[fmt]


def _pointer(ptr: str) -> str:
    return f"at {ptr}" if ptr else "at the schema's root"


def _schema_nodes(node, ptr: str = ""):
    """(JSON pointer, node) for every schema node of a JSON Schema, parents first (values under const / enum /
    default / examples are not schemas)."""
    stack = [(ptr, node)]
    while stack:   # iterative: a schema may nest deeper than Python's recursion limit
        ptr, node = stack.pop()
        if isinstance(node, list):
            stack.extend((f"{ptr}/{i}", x) for i, x in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        yield ptr, node
        subs = []
        for k, v in node.items():
            if k in _DATA_KEYWORDS:
                continue
            key = k.replace("~", "~0").replace("/", "~1")
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                subs.extend((f"{ptr}/{key}/{name.replace('~', '~0').replace('/', '~1')}", sub)
                            for name, sub in v.items())
            else:
                subs.append((f"{ptr}/{key}", v))
        stack.extend(reversed(subs))


def _pattern_cost(pattern: str) -> int:
    """A JSON Schema pattern's repeat cost (grammar_cost), as the grammar engine gets it (ECMA's syntax read as
    ecma_pattern writes it); 0 for a pattern refused for its syntax (that refusal comes later, in its words)."""
    try:
        rest, beside = split_lookaheads(pattern)
        return max(regex_cost(rx) for rx in (ecma_pattern(rest), *beside))
    except ValueError:
        return 0


_LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/")


def repeat_problem(spec: "Constraint") -> str | None:
    """Why a spec costs the grammar engine too much to enforce, by its text alone (grammar_cost's measure of
    counted repetitions, MAX_REPEAT_COST), with where it stands (a JSON pointer, a GBNF rule), the pattern and the
    limit; None: it does not. Cheap (one pass over the text), so it runs before any compile starts."""
    if spec.kind == "regex":
        cost = regex_cost(spec.source)
        return f"regex {json_text(spec.source, 120)}: {too_costly(cost)}" if cost > MAX_REPEAT_COST else None
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except (ValueError, RecursionError):
            return None   # refused later, in the schema's own words
        return _schema_repeat_problem(schema, _pattern_cost)
    if spec.kind == "gbnf":
        from .gbnf import GbnfError, gbnf_costs
        try:
            gbnf_costs(spec.source)
        except GbnfError as e:
            return f"GBNF grammar: {_one_line(e)}"
        return None
    if spec.kind == "lark":   # its regex terminals (/.../); its rules' own repetitions are the engine's to bound
        for found in _LARK_REGEX.finditer(spec.source):
            cost = regex_cost(found.group(1))
            if cost > MAX_REPEAT_COST:
                return f"Lark grammar: regex /{found.group(1)[:120]}/: {too_costly(cost)}"
        # and the patterns of each %json {...} schema in it (a format beside tools is one: the engine's syntax)
        for found in _LARK_JSON.finditer(spec.source):
            try:
                schema, _ = json.JSONDecoder().raw_decode(spec.source, found.end())
            except (ValueError, RecursionError):
                continue   # refused by the engine, in its words
            problem = _schema_repeat_problem(schema, regex_cost)
            if problem:
                return f"Lark grammar: %json {problem}"
    return None


_LARK_JSON = re.compile(r"%json\s*")


def _schema_repeat_problem(schema, cost_of) -> str | None:
    """repeat_problem's words for the first pattern of a JSON Schema (or patternProperties key) that costs too
    much, cost_of(pattern) being its cost; None: none does."""
    for ptr, node in _schema_nodes(schema):
        keys = node.get("patternProperties")
        for what, pattern in [("pattern", node.get("pattern")),
                              *(("patternProperties key pattern", k) for k in
                                (keys if isinstance(keys, dict) else ()))]:
            cost = cost_of(pattern) if isinstance(pattern, str) else 0
            if cost > MAX_REPEAT_COST:
                at = _pointer(ptr + ("/patternProperties" if what != "pattern" else ""))
                return f"{at}: {what} {json_text(pattern, 120)}: {too_costly(cost)}"
    return None


def unwritable_strings(schema) -> str | None:
    """A JSON Schema's string and array keywords the grammar engine refuses in words of its own, said with where
    they stand (a JSON pointer into the schema as sent), the pattern as the client wrote it, and what to write
    instead: a pattern it cannot read (a look-around past split_lookaheads', a back-reference, a construct it reads
    otherwise than ECMA-262), a format it does not know (pydantic's bytes is format binary), and uniqueItems true
    (pydantic's set[...]). None: none of these."""
    for ptr, node in _schema_nodes(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            problem = _pattern_problem(pattern)
            if problem:
                return f"{_pointer(ptr)}: pattern {json_text(pattern, 120)}: {problem}"
        keys = node.get("patternProperties")
        for key in keys if isinstance(keys, dict) else ():
            problem = _pattern_problem(key)
            if not problem and split_lookaheads(key)[1]:   # a key's regex has no allOf to carry the look-ahead
                problem = ("a look-ahead cannot be enforced in a patternProperties key: the grammar engine's "
                           "regexes have none; write the key's pattern without it")
            if problem:
                return f"{_pointer(ptr + '/patternProperties')}: key pattern {json_text(key, 120)}: {problem}"
        if node.get("uniqueItems") is True:
            return (f"{_pointer(ptr)}: uniqueItems true (pydantic's set[...]) cannot be enforced: a grammar cannot "
                    "compare an item with the ones before it; use a list (list[str]) and drop repeats after "
                    "parsing")
        fmt, kind = node.get("format"), node.get("type", "string")
        if isinstance(fmt, str) and ("string" in kind if isinstance(kind, list) else kind == "string") \
                and fmt not in KNOWN_FORMATS and _unknown_format(fmt):
            what = " (pydantic's bytes)" if fmt == "binary" else ""
            write = ("declare the field str (base64 text, if it carries bytes)" if fmt == "binary" else
                     "leave the format out, or give a pattern for the text instead")
            return (f"{_pointer(ptr)}: format {json_text(fmt)}{what} is not one the grammar engine can write (it "
                    f"knows {', '.join(KNOWN_FORMATS)}); {write}")
    return None


def _exact_strings(out):
    """A schema node's date / time / date-time format as FORMAT_PATTERNS' exact RFC 3339 pattern (in an allOf
    beside a pattern of its own), a hostname's or email's length held to FORMAT_MAX_LENGTH, an email's part
    before the "@" to 64 characters (EMAIL_PATTERN), and its pattern's and patternProperties keys' `.` as ECMA's."""
    keys = out.get("patternProperties")
    if isinstance(keys, dict):   # a key is a pattern too: ECMA's `.`, `\\s` and classes (a look-ahead was refused)
        merged = {}
        for k, v in keys.items():   # two keys written alike (^x.$ and the class it stands for): both schemas hold
            k = ecma_pattern(k)
            merged[k] = {"allOf": [merged[k], v]} if k in merged else v
        out["patternProperties"] = merged
    if isinstance(out.get("pattern"), str):
        rest, beside = split_lookaheads(out["pattern"])
        out["pattern"] = ecma_pattern(rest)
        if beside and isinstance(out.get("allOf", []), list):   # both hold: the grammar engine intersects them
            out["allOf"] = [*out.get("allOf", []), *({"pattern": b} for b in beside)]
        elif beside:   # the look-ahead has nowhere to go: refused, never dropped
            raise ValueError("allOf: expected a list of schemas")
    if out.get("format") in FORMAT_PATTERNS and ("pattern" not in out or isinstance(out.get("allOf", []), list)):
        exact = FORMAT_PATTERNS[out.pop("format")]
        if "pattern" in out:
            # both hold (the grammar engine intersects them): beside the schema's own pattern the engine's loose
            # format stayed, and "2023-02-29" passed the pattern "^2023-02-2"
            out["allOf"] = [*out.get("allOf", []), {"pattern": exact}]
        else:
            out["pattern"] = exact
    limit = FORMAT_MAX_LENGTH.get(out.get("format"))
    if out.get("format") == "email" and isinstance(out.get("allOf", []), list):
        del out["format"]
        if "pattern" in out:
            out["allOf"] = [*out.get("allOf", []), {"pattern": EMAIL_PATTERN_SHORT}]
        else:
            out["pattern"] = EMAIL_PATTERN
            out["allOf"] = [*out.get("allOf", []), {"pattern": EMAIL_LOCAL_PART}]
    given = out.get("maxLength")
    if limit is not None and (given is None or _is_num(given)):   # (one not a number is the engine's to refuse)
        out["maxLength"] = limit if given is None else min(given, limit)
    return out


def endless(schema) -> str | None:
    """Where a JSON Schema admits no finite value (None: it does): every value of it must hold another value of
    it inside, through required keys, minItems and $refs that lead back without end ({"properties": {"a": {"$ref":
    "#"}}, "required": ["a"]}). The grammar engine then forced "{\"a\":" after "{\"a\":" until its own item limit,
    an engine error mid-generation (HTTP 500), or, with a key to sample first, wrote until max_tokens. Found as a
    least fixed point: a node has a finite value once its own type can be written with the parts it requires (a
    required key's schema, the first minItems items' schemas), every allOf part and $ref target has one, and
    some anyOf / oneOf branch has one. Anything not understood here ($refs past local pointers, keys of
    patternProperties) counts as finite: only a sure case is refused."""
    from urllib.parse import unquote
    nodes: list[dict] = []

    def collect(node):
        if isinstance(node, list):
            for x in node:
                collect(x)
        elif isinstance(node, dict):
            for k, v in node.items():
                if k in _DATA_KEYWORDS:
                    continue
                if k in _SCHEMA_MAPS and isinstance(v, dict):
                    for sub in v.values():
                        collect(sub)
                else:
                    collect(v)
            nodes.append(node)   # children first: one pass settles a schema without recursion
    collect(schema)

    def target(ref: str):
        if ref == "#":
            return schema
        if not ref.startswith("#/"):
            return True
        node = schema
        for key in ref[2:].split("/"):
            key = unquote(key).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return True   # an unknown target is the grammar engine's to refuse
        return node

    done: set[int] = set()

    def ok(x) -> bool:
        return x is not False and (not isinstance(x, dict) or id(x) in done)

    def own(node) -> bool:
        t = node.get("type")
        types = t if isinstance(t, list) else [t]
        for t in types:
            if t == "object":
                props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
                required = node.get("required") if isinstance(node.get("required"), list) else []
                extra = node.get("additionalProperties", True)
                if all(ok(props[k]) if k in props else (ok(extra) or bool(node.get("patternProperties")))
                       for k in required if isinstance(k, str)):
                    return True
            elif t == "array":
                n = node.get("minItems") if _is_num(node.get("minItems")) else 0
                prefix = node.get("prefixItems")
                rest = node.get("items", True)
                if isinstance(rest, list):   # draft 7's tuple form
                    prefix, rest = rest, node.get("additionalItems", True)
                prefix = prefix if isinstance(prefix, list) else []
                if all(ok(prefix[i]) if i < len(prefix) else ok(rest) for i in range(min(int(n), len(prefix) + 1))):
                    return True
            else:   # a scalar type, or no type (any value)
                return True
        return False

    def finite(node) -> bool:
        if "const" in node or isinstance(node.get("enum"), list) and node["enum"]:
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and not ok(target(ref)):
            return False
        for key in ("anyOf", "oneOf"):
            parts = node.get(key)
            if isinstance(parts, list) and parts and not any(ok(p) for p in parts):
                return False
        parts = node.get("allOf")
        if isinstance(parts, list) and not all(ok(p) for p in parts):
            return False
        return own(node)

    changed = True
    while changed:
        changed = False
        for node in nodes:
            if id(node) not in done and finite(node):
                done.add(id(node))
                changed = True
    if ok(schema):
        return None
    return ("cannot be enforced: no finite JSON value matches it: each value must hold another one inside "
            "without end (a required key, minItems or $ref leads back to the same schema); give the recursion a "
            "way to stop, such as an optional key, an anyOf with a plain value, or minItems 0")


def prepared(schema, where: str):
    """A JSON Schema as the grammar engine gets it (closed_objects; then, in one more copy, each node's exact
    strings, inward bounds and int64 bounds), after unenforceable's check (ConstraintError naming `where`): one
    reading for response formats, tool parameters and a format beside tools."""
    schema = closed_objects(schema)
    problem = unenforceable(schema) or endless(schema) or unwritable_strings(schema)
    if problem:
        raise ConstraintError(f"{where}: {problem}", where=where)
    return _schema_copy(schema, lambda out: _decimal_steps(_doubles(_bounded(_inward_bounds(_exclusive_numbers(
        _exact_strings(_no_ops(out))))))))


def _decimal_steps(out):
    """A `multipleOf` with decimals as the steps of each shorter fraction. The grammar engine writes a multiple of
    m x 10^-d with d decimals or none: 0.25 took 0.75 and 2 but refused 0.5 and 1.5 (only 1.50), 0.15 refused 0.3,
    0.125 refused 0.5, so a model that wrote 1.5 had to pad it or pick another value. A multiple written with
    k < d decimals is one of m / gcd(m, 10^(d-k)) x 10^-k (for 0.25: 0.5 with one decimal, 1 with none), each of
    those steps a multiple of the schema's: the node takes any of them (anyOf), so every shortest form passes."""
    step = out.get("multipleOf")
    if not _is_num(step) or not math.isfinite(step) or step <= 0 or _integers_only(out):
        return out
    _, digits, exp = Decimal(repr(float(step))).as_tuple()   # the shortest digits, as the engine reads the double
    if not isinstance(exp, int) or not -20 <= exp < -1:   # one decimal: nothing shorter but integers, taken
        return out
    m, d = int("".join(map(str, digits))), -exp
    steps = []
    for k in range(d + 1):
        s = float(Decimal(m // math.gcd(m, 10 ** (d - k))).scaleb(-k))
        if s not in steps:
            steps.append(s)
    if len(steps) < 2:
        return out
    branches = [{"multipleOf": s} for s in steps]
    if "anyOf" not in out:
        out["anyOf"] = branches
    elif isinstance(out.get("allOf", []), list):
        out["allOf"] = [*out.get("allOf", []), {"anyOf": branches}]
    else:
        return out
    del out["multipleOf"]
    return out


def _no_ops(out):
    """Keywords that ask for nothing, dropped: uniqueItems false is JSON Schema's default (schema generators
    write it), and the grammar engine refused the key whatever its value; uniqueItems true stays refused."""
    if out.get("uniqueItems") is False:
        del out["uniqueItems"]
    return out


def bounded_integers(schema):
    """A copy of a JSON Schema in which every `integer` without a lower (upper) bound gets -INT_BOUND (INT_BOUND).
    A `number` is left as it is: bounds would also forbid its exponent form (1e-30), and its fraction has no
    digit limit in the grammar engine either way."""
    return _schema_copy(schema, _bounded)


def _bounded(out):
    """bounded_integers' rewrite of one schema node."""
    t = out.get("type")
    types = t if isinstance(t, list) else [t]
    if "integer" in types and "number" not in types:
        def bound(key, exclusive):   # a draft-4 boolean exclusiveMinimum qualifies `minimum`: no bound itself
            return _is_num(out.get(key)) or _is_num(out.get(exclusive))
        given = [out.get(k) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")]
        if any(_is_num(v) and abs(v) > INT_BOUND for v in given):
            return out   # the schema asks for integers past int64: its own bounds stand alone
        if not bound("minimum", "exclusiveMinimum"):
            out["minimum"] = -INT_BOUND
        if not bound("maximum", "exclusiveMaximum"):
            out["maximum"] = INT_BOUND
    return out


def parser_limits():
    """llguidance's resource limits, two of them raised: a schema of a few thousand properties (OpenAI takes up
    to 5,000) passes the lexer's initial fuel (default 1M, ~20 ms) and an Earley row's items (default 2,000).
    The per-step limits stay llguidance's (step_lexer_fuel 200k, step_max_items 50k, max_lexer_states 250k):
    a mask past them is an error that ends its own request (finish_reason "error"), never a stall. They do not
    bound the cost of nested counted repetitions ((a{1000}){1000} ran 0.3-2.5 s a mask with step_lexer_fuel
    20k, max_lexer_states 5k or step_max_items 5k alike): repeat_problem refuses those before compiling."""
    from llguidance import LLParserLimits
    return LLParserLimits(initial_lexer_fuel=20_000_000, max_items_in_row=20_000, verbose_errors=False)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check(spec: Constraint) -> Constraint:
    """Raise ConstraintError (naming spec.where) when the spec cannot be enforced, without a tokenizer: what a
    caller uses to find which of several parts (a tool's parameters) is at fault before compiling the whole."""
    from llguidance import LLMatcher

    err = LLMatcher.validate_grammar(spec.grammar(), limits=parser_limits())
    if err:
        raise ConstraintError(f"{spec.where}: cannot be enforced: {engine_error(err, spec)}", where=spec.where)
    return spec


def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConstraintError(f"{where}: expected a non-empty string", where=where)
    return value


def engine_error(e, spec: "Constraint | None" = None) -> str:
    """One line of the grammar engine's refusal of a compiled grammar, in the client's terms: its JSON reader's
    "recursion limit exceeded at line 1 column 2220" points into the engine's internal grammar text, not the
    schema: it says the nesting limit instead; a multipleOf it cannot write is named as the client sent it."""
    text = _one_line(e)
    if spec is not None and spec.kind == "json_schema" and "'multipleOf'" in text:
        text = spec._refused_step() or text
    if "recursion limit exceeded" in text:
        return ("nested too deeply for the grammar engine: it reads the schema as JSON at most 128 levels deep (a "
                "nested object takes two levels, an array's items one: about 60 objects inside each other); "
                "nest it less, or name the inner parts in $defs and use $ref")
    return text


def _one_line(e) -> str:
    text = " ".join(str(e).split())
    # the grammar engine lists every special token after an unknown one's name (a 128k vocabulary's worth, cut at
    # 400 characters into a wall of ids): the name and how to write a token instead
    cut = text.find("; following special tokens are available")
    if cut >= 0:
        text = text[:cut] + " (a token is written <NAME> with its exact text, such as <|eot_id|>, or <[ID]>)"
    # a number bound past what its range of digits holds (int64's, and less for a lower bound alone): in words
    # that say what to write, not its internal "min=Some(0.0), max=Some(1e19)"
    found = re.search(r"Failed to generate regex for float range: min=(?:Some\(([^)]*)\)|None), "
                      r"max=(?:Some\(([^)]*)\)|None)", text)
    if found:
        given = ", ".join(f"{name} {v}" for name, v in zip(("minimum", "maximum"), found.groups()) if v)
        text = (f"a number's bounds ({given}) are too large: the grammar engine writes a bounded number as "
                "ranges of 64-bit integer digits; keep a number's minimum / maximum within -10^17 .. "
                "10^17, or leave the bound out (an unbounded number is taken), or give such values as strings")
    # its advice names an option of its own that no request can set: what the client can write instead
    text = text.replace("Enable 'coerce_one_of' option to approximate oneOf with anyOf",
                        "A oneOf whose branches may match the same value cannot be enforced exactly: make them "
                        "exclusive, or write anyOf if a value may match more than one")
    return text[:400]


# ---- the tokenizer as llguidance sees it -------------------------------------------------------------------
def vocab_bytes(tok, n_vocab: int) -> list[bytes]:
    """Every id's text as the bytes it adds (Tokenizer.token_bytes: a byte-level BPE token's exact bytes, a
    SentencePiece piece with "▁" as a space and <0xNN> as that byte, also where a GGUF's SentencePiece vocab became
    a tokenizer.json). A SentencePiece vocabulary's control and unknown pieces are empty (no grammar matches them);
    a byte-level one's added tokens keep their text. (The grammar layer's vocabulary, and DRY's:
    engine/runtime/dry.py.)"""
    if tok.byte_level:
        return [tok.token_bytes(i) for i in range(n_vocab)]
    return [b"" if tok.is_special(i) or tok.is_unknown(i) else tok.token_bytes(i) for i in range(n_vocab)]


class _SentencePieceVocab:
    """A sentencepiece model as llguidance's TokenizerWrapper wants it: every id's exact bytes ("▁" is a space,
    <0xNN> pieces are that byte, control and unknown pieces are empty) and an encode function."""

    def __init__(self, tok, n_vocab: int):
        sp = tok._sp
        self.eos_token_id = tok.eos_ids[0] if tok.eos_ids else 0
        self.bos_token_id = tok.bos_id
        self.special_token_ids = sorted(i for i in range(sp.GetPieceSize()) if sp.IsControl(i) or sp.IsUnknown(i))
        tokens = vocab_bytes(tok, n_vocab)
        self.tokens = tokens
        self._sp = sp
        self._ids = {}
        for i, b in enumerate(tokens):
            if b:
                self._ids.setdefault(b, i)
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, s):
        """Ids whose bytes are exactly `s` (llguidance tokenizes forced text with it). sentencepiece's own
        encoding adds a leading "▁" and folds spaces, so it is used only when it round-trips; else a longest-match
        split over the vocabulary (exact, not always the canonical tokens: a jump-forward draft may then be
        rejected, never a wrong token accepted)."""
        data = s if isinstance(s, bytes) else s.encode("utf-8")
        ids = self._sp.EncodeAsIds(data.decode("utf-8", "replace"))
        if b"".join(self.tokens[i] for i in ids if i < len(self.tokens)) == data:
            return ids
        out, pos = [], 0
        while pos < len(data):
            for n in range(min(self._longest, len(data) - pos), 0, -1):
                i = self._ids.get(data[pos:pos + n])
                if i is not None:
                    out.append(i)
                    pos += n
                    break
            else:   # a byte no token holds (a vocabulary without byte fallback): it cannot be produced
                pos += 1
        return out


def _ll_tokenizer(tok, n_vocab: int):
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = list(tok.eos_ids) or None
    if tok.kind == "hf_json":
        return LLTokenizer(tok._hf.to_str(), n_vocab=n_vocab, eos_token=eos)
    return LLTokenizer(TokenizerWrapper(_SentencePieceVocab(tok, n_vocab)), n_vocab=n_vocab, eos_token=eos)


_COMPILE_SLOTS = threading.BoundedSemaphore(COMPILE_SLOTS)
REFUSED_SPECS = 64   # refusals remembered per tokenizer, by a digest of the spec (its text is not kept)


def _refused_key(spec: "Constraint") -> tuple:
    return spec.kind, hashlib.sha256(spec.source.encode("utf-8", "surrogatepass")).digest()


def _rss_bytes() -> int:
    """The process's anonymous resident memory (RssAnon): what a compile's matcher takes, without the file-backed
    pages (the model's weights paged in by forward passes meanwhile) that statm's RSS counted too."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _Job:
    """One spec's compile, shared by every request for that spec while it runs (a second request waits for it
    instead of starting another). done: set when it ended; then exactly one of compiled / error is set."""

    def __init__(self, where: str):
        self.where = where   # the field of the request that started it (its refusals are worded so)
        self.done = threading.Event()
        self.compiled: CompiledConstraint | None = None
        self.error: ConstraintError | None = None


class _Compiler:
    """One per tokenizer: the llguidance tokenizer (built once: ~0.1 s for a small vocabulary, 6-10 s for 128k
    tokens on 2 busy cores: the server builds it in the background after loading, Engine.warm_constraints) and
    the LRU of compiled specs, bounded in count (CACHE_SPECS) and in estimated bytes (CACHE_BYTES).

    A compile runs on a thread of its own, at most COMPILE_SLOTS at a time in the process (a request waits up to
    COMPILE_WAIT_S for a slot, then GrammarBusyError); a spec asked for while its compile runs joins that compile.
    A compile past COMPILE_TIMEOUT_S is refused to its requests and runs on to its end (the engine cannot be
    stopped mid-compile), in its slot, so abandoned compiles never pile up; what it built is then cached (the
    next request for it is served at once), and a spec refused for what it is stays refused without compiling
    again (_refused)."""

    def __init__(self, tok, n_vocab: int):
        self.tok, self.n_vocab = tok, n_vocab
        self._ll = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
        self._sizes: dict[tuple, int] = {}       # a cached spec's estimated bytes
        self._refused: OrderedDict[tuple, ConstraintError] = OrderedDict()
        self._jobs: dict[tuple, _Job] = {}       # the compiles running now
        self.compiles_started = 0                # compile threads started (a statically refused spec starts none)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def ll(self):
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tok, self.n_vocab)
            return self._ll

    @staticmethod
    def _as_theirs(e: ConstraintError, job_where: str, spec: Constraint) -> ConstraintError:
        """A refusal of a compile another request started, in this request's words (its field's name)."""
        text = str(e)
        if spec.where != job_where and text.startswith(job_where + ":"):
            text = spec.where + text[len(job_where):]
        return ConstraintError(text, where=spec.where)

    def compile(self, spec: Constraint) -> "CompiledConstraint":
        key = (spec.kind, spec.source)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return CompiledConstraint(spec, hit._template, self.n_vocab,   # this spec's where / jump_forward
                                          hit.complete_at_start)
            refused = self._refused.get(_refused_key(spec))
        if refused is not None:
            raise self._as_theirs(refused, refused.where, spec)
        spec.refuse_costly()   # by the text alone, before any thread or slot: the same answer under any load
        budget = cache_bytes()
        ll = self.ll()
        with self._lock:
            hit = self._cache.get(key)   # (one that ended since the first look)
            job = self._jobs.get(key)
            mine = job is None and hit is None
            if mine:
                job = self._jobs[key] = _Job(spec.where)
        if hit is not None:
            return CompiledConstraint(spec, hit._template, self.n_vocab, hit.complete_at_start)
        if mine:
            if not _COMPILE_SLOTS.acquire(timeout=COMPILE_WAIT_S):
                with self._lock:
                    self._jobs.pop(key, None)
                job.error = GrammarBusyError(
                    f"{spec.where}: the server is busy compiling other schemas or grammars ({COMPILE_SLOTS} at a "
                    f"time; waited {COMPILE_WAIT_S:g} s for a turn); retry later")
                job.done.set()
                raise job.error
            with self._lock:
                self.compiles_started += 1
            try:
                threading.Thread(target=self._run, args=(spec, ll, key, job, budget), name="bitnet-grammar-compile",
                                 daemon=True).start()
            except BaseException as e:   # can't start new thread: the slot and the job go back, waiters are told
                with self._lock:
                    self.compiles_started -= 1
                    self._jobs.pop(key, None)
                _COMPILE_SLOTS.release()
                job.error = GrammarBusyError(f"{spec.where}: the server could not start a compile ({_one_line(e)});"
                                             " retry later")
                job.done.set()
                raise job.error from None
        if not job.done.wait(COMPILE_TIMEOUT_S):
            raise ConstraintError(f"{spec.where}: compiling it took more than {COMPILE_TIMEOUT_S:g} s, past the"
                                  " limit for a schema or grammar; simplify it", where=spec.where)
        if job.error is not None:
            if isinstance(job.error, GrammarBusyError):
                raise job.error
            raise self._as_theirs(job.error, job.where, spec)
        return CompiledConstraint(spec, job.compiled._template, self.n_vocab, job.compiled.complete_at_start)

    def _run(self, spec: Constraint, ll, key: tuple, job: _Job, budget: int):
        """The compile thread: build, then cache (or note the refusal), give the slot back, wake the waiters."""
        rss0 = _rss_bytes()
        try:
            try:
                job.compiled = self._build(spec, ll)
            except ConstraintError as e:   # kept without its traceback (the frames held the schema, the matchers)
                job.error = ConstraintError(e.args[0] if e.args else str(e), e.hint, where=e.where)
            except Exception as e:   # a failure of the engine or the process (memory): this request's, not kept
                job.error = ConstraintError(f"{spec.where}: cannot be enforced: {_one_line(e)}", where=spec.where)
                job.error.transient = True
            with self._lock:
                if job.compiled is not None:
                    # its estimated size: the memory the process took while building it (what its matcher keeps:
                    # ~350 MB for (a{1000}){1000}, now refused before compiling); at least its grammar's text
                    size = max(_rss_bytes() - rss0, 2 * len(spec.source.encode("utf-8")), 64 << 10)
                    if size <= budget:
                        self._cache[key], self._sizes[key] = job.compiled, size
                        while len(self._cache) > CACHE_SPECS or sum(self._sizes.values()) > budget:
                            old, _ = self._cache.popitem(last=False)
                            self._sizes.pop(old, None)
                elif not getattr(job.error, "transient", False):   # the spec's own fault: the same every time
                    self._refused[_refused_key(spec)] = job.error
                    while len(self._refused) > REFUSED_SPECS:
                        self._refused.popitem(last=False)
                self._jobs.pop(key, None)
        finally:
            _COMPILE_SLOTS.release()
            job.done.set()

    def _build(self, spec: Constraint, ll) -> "CompiledConstraint":
        """The spec compiled (llguidance drops the GIL while it compiles), with its first mask and forced tokens
        computed, so that they fail here and not mid-request. ConstraintError: it cannot be enforced."""
        from llguidance import LLMatcher
        grammar = spec.grammar()   # the spec's conversion too (a large GBNF grammar's analysis) counts in the time
        m = LLMatcher(ll, grammar, log_level=0, limits=parser_limits())
        if m.is_error():
            raise ConstraintError(f"{spec.where}: cannot be enforced: {engine_error(m.get_error(), spec)}",
                                  where=spec.where)
        probe = m.deep_copy()
        words = np.zeros((self.n_vocab + 31) // 32, np.int32)
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if spec.jump_forward and not probe.is_error():
            probe.compute_ff_tokens()
        if probe.is_error():   # NoExtensionBias: no token can begin any text the grammar takes
            err = probe.get_error()
            why = engine_error(err, spec)
            raise ConstraintError(f"{spec.where}: cannot be enforced: "
                                  f"{'no text matches it' if err.startswith('NoExtension') else why}",
                                  where=spec.where)
        if not words.any():
            raise ConstraintError(f"{spec.where}: cannot be enforced: no text matches it", where=spec.where)
        # only end of text at the start (root ::= ""): is_stopped() says so only after a token
        allowed = np.unpackbits(words.view(np.uint8), count=self.n_vocab, bitorder="little")
        complete = set(np.flatnonzero(allowed).tolist()) <= set(self.tok.eos_ids)
        return CompiledConstraint(spec, m, self.n_vocab, complete)


_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compile_constraint(tokenizer, n_vocab: int, spec) -> "CompiledConstraint | None":
    """spec (a Constraint, or what Constraint.coerce takes) compiled for this tokenizer and logits width; None
    for None. Raises ConstraintError naming spec.where for anything that cannot be enforced exactly."""
    if isinstance(spec, CompiledConstraint):
        return spec
    spec = Constraint.coerce(spec)
    if spec is None:
        return None
    with _COMPILERS_LOCK:
        c = _COMPILERS.get(tokenizer)
        if c is None or c.n_vocab != n_vocab:
            c = _COMPILERS[tokenizer] = _Compiler(tokenizer, n_vocab)
    return c.compile(spec)


class CompiledConstraint:
    """A spec compiled against one tokenizer: a matcher in its start state, copied for every sequence."""

    def __init__(self, spec: Constraint, template, n_vocab: int, complete_at_start: bool = False):
        self.spec, self._template, self.n_vocab = spec, template, n_vocab
        self.complete_at_start = complete_at_start   # the grammar takes only the empty text

    def matcher(self) -> "TokenMatcher":
        return TokenMatcher(self._template.deep_copy(), self.n_vocab, self.spec, self.complete_at_start)


_MASK_POOL: ThreadPoolExecutor | None = None
_MASK_POOL_LOCK = threading.Lock()


MASK_WORKERS = max(1, min(4, os.cpu_count() or 1))   # masks of several constrained sequences at once


def _mask_pool() -> ThreadPoolExecutor:
    """The helper threads that compute masks during the forward pass (llguidance drops the GIL): MASK_WORKERS of
    them, so one sequence's mask does not queue behind another's (each mask's own time is bounded by the
    spec's repeat cost, grammar_cost)."""
    global _MASK_POOL
    with _MASK_POOL_LOCK:
        if _MASK_POOL is None:
            _MASK_POOL = ThreadPoolExecutor(max_workers=MASK_WORKERS, thread_name_prefix="bitnet-mask")
        return _MASK_POOL


def _after_fork_in_child():
    """A fork()ed child inherits the mask pool but not its worker thread: a mask submitted there never ran and
    the generation waited for ever (with the parent's LLM and with one loaded in the child alike). The child
    starts a pool of its own on first use, and gets new locks (one held by a thread of the parent at the fork,
    a warm-up building the grammar tokenizer, would be held for ever)."""
    global _MASK_POOL, _MASK_POOL_LOCK, _COMPILERS_LOCK, _COMPILE_SLOTS
    _MASK_POOL = None
    _MASK_POOL_LOCK = threading.Lock()
    _COMPILERS_LOCK = threading.Lock()
    _COMPILE_SLOTS = threading.BoundedSemaphore(COMPILE_SLOTS)   # the parent's compiles hold none here
    for c in list(_COMPILERS.values()):
        c._lock = threading.Lock()
        c._jobs = {}   # their threads are the parent's: a request here compiles afresh


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class TokenMatcher:
    """One sequence's position in its grammar. apply(logits) masks; advance(token) moves on."""

    def __init__(self, m, n_vocab: int, spec: Constraint, complete_at_start: bool = False):
        self._m, self.n_vocab, self.spec = m, n_vocab, spec
        self._complete_now = complete_at_start   # until the first token is taken
        self.jump_forward = spec.jump_forward
        self._words = np.zeros((n_vocab + 31) // 32, np.int32)   # allowed-token bitmask (llguidance's layout)
        self._fresh = False          # _words holds the mask of the current state
        self._pending: Future | None = None
        self._pending_pid = 0        # the process that submitted _pending (a fork()ed child has no pool thread)
        self._job = [0]              # _pending's progress: 0 queued, 1 computing, 2 written

    # -- masks ------------------------------------------------------------------------------------------
    def _compute(self):
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)

    def _compute_job(self, job: list):
        job[0] = 1
        self._compute()
        job[0] = 2

    def start_mask(self):
        """Begin computing the current state's mask on the helper thread (call before a forward pass)."""
        if not self._fresh and self._pending is None:
            self._job = [0]
            self._pending_pid = os.getpid()
            self._pending = _mask_pool().submit(self._compute_job, self._job)

    def _settle(self) -> bool:
        """Wait for the pending mask; whether it was written. One submitted before a fork() (its pool thread is
        the parent's) is not waited for: not started, it is dropped; cut off mid-computation, the matcher's state
        is unknown, and the generation ends in one error instead of waiting for ever."""
        fut, self._pending = self._pending, None
        if self._pending_pid == os.getpid():
            fut.result()
            return True
        if self._job[0] == 1:
            raise BitNetError("this generation's structured-output step was under way in another thread when the"
                              " process forked: start the generation again in this process")
        return self._job[0] == 2

    def _ready(self):
        if self._pending is None or not self._settle():
            self._compute()
        self._fresh = True

    def apply(self, logits: np.ndarray):
        """Set every forbidden token's logit to -inf (logits: this state's row, width >= n_vocab)."""
        if not self._fresh:
            self._ready()
        if self._m.is_error():
            raise ConstraintError(f"{self.spec.where}: {_one_line(self._m.get_error())}", where=self.spec.where)
        if not self._words.any():
            raise ConstraintError(f"{self.spec.where}: the grammar allows no token here", where=self.spec.where)
        # one pass with a boolean view of the bits: ~30 us on a 128k vocabulary (a gather / scatter of the allowed
        # ids took ~0.6 ms inside a JSON string, where most tokens are allowed)
        allowed = np.unpackbits(self._words.view(np.uint8), count=self.n_vocab, bitorder="little").view(bool)
        np.copyto(logits[: self.n_vocab], np.float32(-np.inf), where=~allowed)
        logits[self.n_vocab:] = -np.inf

    # -- moving on --------------------------------------------------------------------------------------
    def advance(self, token: int):
        if self._pending is not None:   # a mask started for a state we leave (a finished draft row)
            self._settle()
        if not self._m.consume_token(int(token)):
            raise ConstraintError(f"{self.spec.where}: token {token} is not allowed here:"
                                  f" {_one_line(self._m.get_error())}", where=self.spec.where)
        self._fresh = False
        self._complete_now = False

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing can follow (only end of text); before any token too (the
        generators then end at once: with ignore_eos, no token at all could be sampled)."""
        if self._complete_now:
            return True
        if self._pending is not None:   # the helper thread holds the matcher while it computes the mask
            self._ready()
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a whole match: end of text may come here (more may follow too)."""
        return self._m.is_accepting()

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens that are the grammar's only continuation from here (may be empty)."""
        if limit <= 0 or not self.jump_forward:
            return []
        return list(self._m.compute_ff_tokens()[:limit])

    def valid_prefix(self, tokens) -> list[int]:
        """The longest prefix of `tokens` the grammar allows from here (a prompt-lookup draft is cut there)."""
        if not tokens:
            return []
        return list(tokens[: self._m.validate_tokens([int(t) for t in tokens])])
