"""A Jinja2 sandbox with limits, for chat templates that come from downloaded model files.

jinja2's ImmutableSandboxedEnvironment already refuses unsafe attributes and mutation; it does not bound
time or size: `range(10**9)` fails with a raw OverflowError, two nested loops over range(100000) run for
hours, `"x" * 10**10` or a namespace string doubled in a loop eat all memory. Here, without threads or
signals, every render has a deadline and a size budget, checked where a template can spend time or memory:

- every `{% for %}` iterable is wrapped (by rewriting the parsed tree) in a counter that checks the deadline
  and a total iteration budget;
- the sandbox hooks (calls, attribute and item lookups, the binary operators * ** + %) check the deadline,
  refuse a product, power, format width, replace or join that would be too large before computing it, and
  any integer argument beyond the size budget (widths, indents, counts); they check the size of what they
  return; every filter is wrapped the same way;
- `range()` is bounded; `lipsum` is gone; the rendered output is streamed and counted.

Exceeding a limit raises TemplateLimitError (a BitNetError: one line, exit 2). Limits are per render:
render_limited(template, limits, **context).
"""
from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import BitNetError

MAX_RANGE = 100_000
_DIGITS = re.compile(r"\d+")
HINT = "the model's chat template loops or grows without bound: fix or replace the template in the model file"


class TemplateLimitError(BitNetError):
    """A chat template ran past its time, iteration or size budget."""


@dataclass(frozen=True)
class Limits:
    seconds: float = 2.0            # wall time of one render
    max_chars: int = 1 << 20        # size of any value or of the output (plus 4x the input, see for_messages)
    max_iterations: int = 200_000   # loop iterations over the whole render (real templates: a few hundred)

    def for_messages(self, messages) -> "Limits":
        n = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        return Limits(self.seconds, self.max_chars + 4 * n, self.max_iterations)


_state = threading.local()   # the render in progress on this thread: (deadline, limits, [iterations])


def _fail(what: str):
    raise TemplateLimitError(f"chat template: {what}", hint=HINT)


def _tick():
    """Called by every hook; reads the clock on every 16th call (a hook costs far less than a microsecond)."""
    st = getattr(_state, "render", None)
    if st is not None:
        st[2][1] += 1
        if not st[2][1] & 15 and time.perf_counter() > st[0]:
            _fail(f"rendering took more than {st[1].seconds:g} s")


def _max_chars() -> int:
    st = getattr(_state, "render", None)
    return st[1].max_chars if st is not None else Limits.max_chars


def _check_size(value):
    if isinstance(value, (str, bytes, list, tuple, dict)):
        if len(value) > _max_chars():
            _fail(f"a value grew to {len(value)} items (limit {_max_chars()})")
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 65536:
        _fail("an integer grew beyond 65536 bits")
    return value


def _check_format(fmt):
    """A format string whose width or precision alone exceeds the budget ("%2000000000s", "{:>2000000000}")."""
    if isinstance(fmt, str):
        for digits in _DIGITS.findall(fmt):
            if len(digits) > 12 or int(digits) > _max_chars():
                _fail(f"a format width of {digits} (limit {_max_chars()})")


def _guarded_iter(iterable):
    st = getattr(_state, "render", None)
    if st is None:
        yield from iterable
        return
    deadline, limits, count = st
    for item in iterable:
        count[0] += 1
        if count[0] > limits.max_iterations:
            _fail(f"loops ran more than {limits.max_iterations} iterations")
        if not count[0] & 1023 and time.perf_counter() > deadline:
            _fail(f"rendering took more than {limits.seconds:g} s")
        yield item


def _bounded_range(*args):
    r = range(*args)
    if len(r) > MAX_RANGE:
        _fail(f"range() of {len(r)} items (limit {MAX_RANGE})")
    return r


_bounded_range.__name__ = "range"


def _precheck(name: str, args, kwargs, self_obj=None):
    """Refuse, before running it, a call whose result would outgrow the budget: any integer argument beyond
    it (widths, indents, counts: center(10**10), tojson(indent=10**10), slice(10**9), 'x'.zfill(10**10)), or a
    replace / join whose result size is known from the arguments."""
    limit = _max_chars()
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and v > limit:
            _fail(f"{name}() with an argument of {v} (limit {limit})")
    strs = [a for a in ((self_obj,) if self_obj is not None else ()) + tuple(args) if isinstance(a, str)]
    if name == "replace" and len(strs) >= 3:
        text, old, new = strs[:3]
        hits = (len(text) + 1) if not old else text.count(old)
        if len(text) + hits * max(0, len(new) - len(old)) > limit:
            _fail(f"replace() would grow the text past {limit} characters")
    elif name == "join":
        seps = [a for a in strs if a is not self_obj] if self_obj is None else [self_obj]
        items = next((a for a in args if isinstance(a, (list, tuple, dict))), None)
        if seps and items is not None and len(seps[-1]) * len(items) > limit:
            _fail(f"join() would grow the text past {limit} characters")


def _guard_filter(name, f):
    @functools.wraps(f)   # keeps jinja's pass_context / pass_eval_context markers
    def guarded(*args, **kwargs):
        _tick()
        if name == "format" and args:
            _check_format(args[0])
        _precheck(f"filter {name}", args, kwargs) if name not in ("replace", "join") else _precheck(name, args, kwargs)
        return _check_size(f(*args, **kwargs))

    return guarded


class LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **kw):
        super().__init__(**kw)
        self.filters = {k: _guard_filter(k, f) for k, f in self.filters.items()}
        self.globals.pop("lipsum", None)
        self.globals["range"] = _bounded_range
        self.guarded_iter = _guarded_iter

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("guarded_iter"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        return tree

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _tick()
        _precheck(getattr(__obj, "__name__", "call"), args, kwargs, getattr(__obj, "__self__", None)
                  if isinstance(getattr(__obj, "__self__", None), str) else None)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        if getattr(value, "__name__", None) in ("format", "format_map"):
            _check_format(getattr(value, "__self__", None))
        return super().wrap_str_format(value)

    def getattr(self, obj, attribute):
        _tick()
        return _check_size(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        _tick()
        return _check_size(super().getitem(obj, argument))

    def call_binop(self, context, operator, left, right):
        _tick()
        limit = _max_chars()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * n > limit:
                    _fail(f"a repetition of {len(seq)} x {n} items (limit {limit})")
        elif operator == "%":
            _check_format(left)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * abs(left).bit_length() > 65536:
                _fail("a power beyond 65536 bits")
        return _check_size(super().call_binop(context, operator, left, right))


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's own tokens with it (its
    AssistantTracker, for training masks) and renders the body as it is; so do we (LFM2.5's, SmolLM3's templates)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def make_environment() -> LimitedSandbox:
    return LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag])


def render_limited(template, limits: Limits, **context) -> str:
    """Render a template of a LimitedSandbox within `limits` (streamed; the output is counted as it grows)."""
    _state.render = (time.perf_counter() + limits.seconds, limits, [0, 0])   # deadline, limits, [loops, ticks]
    try:
        out, size, cap = [], 0, limits.max_chars
        append = out.append
        for piece in template.generate(**context):   # pieces come from hooks and loops that check the clock
            size += len(piece)
            if size > cap:
                _fail(f"the output grew past {cap} characters")
            append(piece)
        return "".join(out)
    finally:
        _state.render = None
