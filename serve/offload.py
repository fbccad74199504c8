"""Keep large work off the event loop: one slow request must never delay another one's tokens.

- `offloop_route(n_ctx)`: FastAPI's route class whose request parses its JSON body in a worker thread, and
  refuses a body whose structure cannot fit the context before FastAPI validates it: more messages, content
  parts or prompt token ids than the context has tokens, or more JSON objects than a request that fits could
  hold (a response format's schema, which never enters the context, bounded on its own: SCHEMA_NODES).
  Why a bound and not only a thread: json.loads and pydantic's validation hold the GIL for their whole run,
  so a thread does not free the loop; measured here, 8 MB of small messages held it 2.5 s (0.4 s parse, 2.1 s
  validation) and 1M token ids took 2 s to validate. What is left is bounded by --max-body-mb: one 8 MB string
  parses in ~60 ms.
- `too_long_for_context(eng, n_chars)`: a prompt of more characters than (bytes of the tokenizer's longest
  token x the context) cannot fit, whatever the tokenizer makes of it (a character is at least one byte), so
  it is refused before it is rendered or tokenized (a 10 MB prompt tokenized on the loop stalled every other
  client for 19 s). Rendering and tokenizing the rest: `await run_off_loop(fn, ...)`.
- `within(aw, timeout)`, `next_or_gone(q, request)`: waits with a time limit that, unlike asyncio.wait_for on
  Python 3.10-3.11, never lose a cancellation (a non-streaming handler's wait for its next chunk, a body read).
- `Streamed`: the streaming response every streaming endpoint answers with; it closes its generator however
  the response ends, so the generator's `finally` (which cancels the engine sequences) always runs.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import weakref

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute

# normalizers may drop characters (zero-width, accents): allow twice the strict bound before refusing unseen
SAFETY = 2


OFFLOAD_BYTES = 64 << 10   # smaller bodies parse in well under a millisecond: not worth a thread hop


class BodyRefused(HTTPException):
    """A body refused from its structure alone (FastAPI lets HTTPExceptions out of body parsing as they are)."""

    def __init__(self, message: str, param: str | None, code: str, extra: dict | None = None):
        super().__init__(400, message)
        self.param, self.code, self.extra = param, code, extra


def _over(n_ctx: int, n: int, exact: bool, what: str, param: str) -> BodyRefused:
    """A body that cannot fit the context, in the words of every other context_length_exceeded 400 (OpenAI's
    sentence, which clients classify by: schemas.overflow_message), with llama-server's counts where exact."""
    return BodyRefused(f"This model's maximum context length is {n_ctx} tokens. However, your {param} resulted in "
                       f"{'' if exact else 'at least '}{n} tokens: {what}", param, "context_length_exceeded",
                       {"n_prompt_tokens": n, "n_ctx": n_ctx} if exact else None)


def check_structure(obj, n_ctx: int | None):
    """Raise BodyRefused when the parsed body cannot fit a context of n_ctx tokens (each message, content part
    and prompt id takes at least one token). A prompt list with a token id in it is one prompt (ids, or
    llama-server's mix of ids and strings); one of strings or lists is a batch, each prompt run alone (bounded by
    --max-queue, not the context: 300 two-token prompts were refused as too long for a context of 256)."""
    if n_ctx is None or not isinstance(obj, dict):
        return
    msgs = obj.get("messages")
    if isinstance(msgs, list):
        parts = sum(len(m["content"]) for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list))
        if len(msgs) + parts > n_ctx:
            raise _over(n_ctx, len(msgs) + parts, False, f"{len(msgs)} messages ({parts} content parts), each at "
                        "least one token", "messages")
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) > n_ctx and any(type(x) is int for x in prompt):
        ids = all(type(x) is int for x in prompt)
        raise _over(n_ctx, len(prompt), ids, f"a prompt of {len(prompt)} " + ("token ids" if ids else
                    "token ids and strings"), "prompt")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(obj) -> None:
    """Raise BodyRefused for a string holding a lone UTF-16 surrogate (JSON's "\\ud800" with no pair): not text,
    and every tokenizer, template and response writer after this would fail on it (a 500)."""
    stack = [("", obj)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, str):
            m = _SURROGATE.search(x)
            if m:
                name = where.lstrip(".") or "body"
                raise BodyRefused(f"{name}: a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at character "
                                  f"{m.start() + 1}) is not text", name, "invalid_value")
        elif isinstance(x, dict):
            stack.extend((f"{where}.{k}", v) for k, v in x.items())
            stack.extend((where, k) for k in x)
        elif isinstance(x, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(x))


def parse_bounded(body: bytes, n_ctx: int | None):
    """json.loads, stopped once it has built more objects and numbers than a body that fits n_ctx could hold
    (4 MB of small messages: refused after ~50 ms instead of ~300 ms of parsing and 1 s of validation); a string
    with a lone surrogate escape is refused (check_text: looked for only when the body has such an escape)."""
    try:
        return checked_text(body, _parse_bounded(body, n_ctx))
    except RecursionError:   # one line as every endpoint words it (FastAPI's own: "error parsing the body")
        raise BodyRefused(too_deep(), None, "invalid_json") from None
    except UnicodeDecodeError:   # json.loads of bytes: not a JSONDecodeError, so FastAPI's vague "error parsing"
        raise BodyRefused("request body is not valid JSON: it is not UTF-8 text", None, "invalid_json") from None


# what json.loads raises for a body it will not read: JSONDecodeError, bad UTF-8 and an integer of 5,000 digits
# (plain ValueErrors, which gave a 500), RecursionError for nesting
NOT_JSON = (ValueError, RecursionError)


def too_deep() -> str:
    """The one line for a body nested deeper than the parser reads: it may be valid JSON (a schema 500 levels
    deep is), so say the limit, not "not valid JSON"."""
    import sys
    return (f"request body is nested too deeply to be read: over about {sys.getrecursionlimit() - 100} levels of "
            "objects and arrays in all (a JSON Schema takes two per nested object); nest it less")


def not_json(e: BaseException) -> str:
    """The one line for a body loads refused with one of NOT_JSON."""
    if isinstance(e, RecursionError):
        return too_deep()
    why = ": it is not UTF-8 text" \
        if isinstance(e, UnicodeDecodeError) else "" if isinstance(e, json.JSONDecodeError) else f": {e}"
    return f"request body is not valid JSON{why}"


def loads(body: bytes, **hooks):
    """json.loads of a request body, decoded strictly: json.loads(bytes) decodes with "surrogatepass", so UTF-8-encoded
    surrogates (ED A0..BF, CESU-8 / WTF-8, what Java's modified UTF-8 writes for an emoji) came through as lone
    surrogates that every tokenizer, template and response writer failed on (500s). Every body parser reads through
    here: UnicodeDecodeError (a ValueError, so in NOT_JSON) for a body that is not UTF-8 text. JSON on the wire is
    UTF-8 (RFC 8259), as llama-server and ollama read it: a UTF-16 or UTF-32 body (json.loads' guess from its
    first bytes, which took it) is refused as docs/api.md says; a leading UTF-8 BOM is ignored, as the RFC allows."""
    # (the BOM dropped by hand: the utf-8-sig codec is imported on first use, which a process out of file
    # descriptors cannot do: every body was a 400 there)
    text = (body[3:] if body[:3] == b"\xef\xbb\xbf" else body).decode("utf-8")
    limit = _int_digits()
    if not limit:
        return json.loads(text, **hooks)
    make_int, huge = hooks.pop("parse_int", int), []

    def parse_int(digits: str):
        n = len(digits) - digits.startswith("-")
        if n > limit:   # int() refuses it in Python's words ("use sys.set_int_max_str_digits()"): found below
            huge.append(n)
            return _TOO_LONG
        return make_int(digits)
    obj = json.loads(text, parse_int=parse_int, **hooks)
    if huge:
        name = _where(obj, _TOO_LONG)
        raise BodyRefused(f"{name}: an integer of {huge[0]} digits is out of range (numbers here have at most "
                          f"{limit} digits)", name, "invalid_value")
    return obj


_TOO_LONG = object()   # stands in for an integer too long to convert while the body is parsed


def _int_digits() -> int:
    """The most digits Python converts to an int (sys.set_int_max_str_digits, 3.11 and 3.10.7+), 0: no limit."""
    import sys
    get = getattr(sys, "get_int_max_str_digits", None)
    return get() if get is not None else 0


def _where(obj, target) -> str:
    """Where `target` is in obj, as the errors name a field: messages[0].content, logit_bias.5 ("body": obj)."""
    stack = [("", obj)]
    while stack:
        where, x = stack.pop()
        if x is target:
            return where.lstrip(".") or "body"
        if isinstance(x, dict):
            stack.extend(reversed([(f"{where}.{k}", v) for k, v in x.items()]))
        elif isinstance(x, list):
            stack.extend(reversed([(f"{where}[{i}]", v) for i, v in enumerate(x)]))
    return "body"


def checked_text(body: bytes, obj):
    """obj (body parsed), after check_text where the body has a surrogate escape at all."""
    if _SURROGATE_ESCAPE.search(body):
        check_text(obj)
    return obj


# The top-level fields that hold a response format's schema, which never enters the context (chat's and
# /completion's, ollama's format, Responses' text.format, Anthropic's output_config.format / output_format), and
# the JSON objects and numbers allowed in them beyond the context's bound: as many as a schema of the 256 KiB spec
# limit can hold (a number and its comma are 2 bytes at least). An enum of 10,000 integers was refused as not
# fitting a 2048-token context.
SCHEMA_FIELDS = ("response_format", "json_schema", "format", "text", "output_config", "output_format")
SCHEMA_NODES = (256 << 10) // 2


def _nodes(x) -> int:
    """JSON objects and numbers in x (what the parser's hooks count)."""
    n, stack = 0, [x]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            n += 1
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            n += 1
    return n


def _parse_bounded(body: bytes, n_ctx: int | None):
    if n_ctx is None:
        return loads(body)
    limit, count = 4 * n_ctx + 256, 0

    def too_many(what: str):
        return BodyRefused(f"the request body has over {limit} JSON objects and numbers {what}, the most one for a "
                           f"context of {n_ctx} tokens can hold (4 x context + 256, token ids to /detokenize too: "
                           "parsing pauses every stream, so it stops there)", None, "context_length_exceeded")

    def counted(make):
        def hook(x):
            nonlocal count
            count += 1
            if count > limit + SCHEMA_NODES:
                raise too_many(f"outside its schemas (and {SCHEMA_NODES} in them)")
            return make(x)
        return hook
    obj = loads(body, object_hook=counted(lambda d: d), parse_int=counted(int), parse_float=counted(float))
    if count > limit and isinstance(obj, dict):   # what a response format's schema holds is bounded on its own
        count -= min(SCHEMA_NODES, sum(_nodes(obj[k]) for k in SCHEMA_FIELDS if k in obj))
    if count > limit:   # a prompt of token ids (or messages) past the context says so, as one under this bound does
        check_structure(obj, n_ctx)
        raise too_many("outside its schemas")
    check_structure(obj, n_ctx)
    return obj


def offloop_route(n_ctx):
    """An APIRoute class for app.router.route_class; n_ctx() -> the engine's context, or None while loading."""

    class OffloopRequest(Request):
        async def json(self):
            if not hasattr(self, "_json"):
                body = await self.body()
                ctx = n_ctx()
                if len(body) > OFFLOAD_BYTES:
                    self._json = await asyncio.to_thread(parse_bounded, body, ctx)
                else:
                    self._json = parse_bounded(body, ctx)
            return self._json

    class OffloopRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def route_handler(request: Request):
                return await handler(OffloopRequest(request.scope, request.receive))
            return route_handler
    return OffloopRoute


_longest: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_bytes(tok) -> int:
    """Bytes of the tokenizer's longest token (Tokenizer.token_bytes)."""
    n = _longest.get(tok)
    if n is None:
        n = 1
        for i in range(tok.vocab_size):
            n = max(n, len(tok.token_bytes(i)))
        _longest[tok] = n
    return n


# the most bytes of request body one character of prompt can take: a JSON escape of a character outside the
# BMP (a surrogate pair, "\ud83d\ude00" in the body)
ESCAPED_BYTES = 12
# what else a request may carry beside its prompt (a response_format schema or grammar, stop strings, sampling
# fields), and a logit_bias over the whole vocabulary at this many bytes an entry ("128255": -100.5,)
OTHER_FIELDS_BYTES, LOGIT_BIAS_ENTRY_BYTES = 1 << 20, 24


def prompt_body_bound(eng) -> int | None:
    """The most bytes a request body to a generating endpoint can have with a prompt that fits eng's context
    (None until the tokenizer's longest token is known: warm_bounds)."""
    longest = _longest.get(eng.tokenizer)
    if longest is None:
        return None
    return (ESCAPED_BYTES * SAFETY * eng.n_ctx * longest + OTHER_FIELDS_BYTES
            + LOGIT_BIAS_ENTRY_BYTES * eng.config.vocab_size)


def warm_bounds(eng) -> None:
    """Compute the tokenizer's longest token once (a pass over the vocabulary), where the model loads."""
    longest_token_bytes(eng.tokenizer)


async def chars_bound(eng) -> int:
    """The most characters of text whose tokens could still fit the context (SAFETY x n_ctx tokens of the
    vocabulary's longest): the first n_ctx tokens of any text lie within its first chars_bound characters."""
    return SAFETY * eng.n_ctx * await asyncio.to_thread(longest_token_bytes, eng.tokenizer)


async def too_long_for_context(eng, n_chars: int) -> str | None:
    """A message when `n_chars` characters of prompt cannot fit the context, else None."""
    bound = await chars_bound(eng)
    if n_chars <= bound:
        return None
    return (f"the prompt has {n_chars} characters; the context holds {eng.n_ctx} tokens, at most ~{bound} "
            f"characters of prompt")


async def run_off_loop(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


async def prepare_sampling(eng, params) -> None:
    """What the request's sampler takes from the tokenizer (DRY's breaker table: a new breaker list scans the
    vocabulary, the first ~0.3 s for 128k tokens) built off the event loop, where it would stall every stream."""
    if not eng.sampling_ready(params):
        await asyncio.to_thread(eng.prepare_sampling, params)


async def within(aw, timeout: float):
    """(True, result of aw) if it completes within `timeout` s, else (False, None) with aw cancelled; its
    exception, or a cancellation of the caller, passes through. Not asyncio.wait_for, which on Python 3.10 and
    3.11 returns the result of an inner wait that completes as the caller is cancelled, and so loses the
    cancellation (a server stopping, a request past its time). asyncio.timeout (3.11+) cancels inside the one
    task, so a queue get cancelled before it resumed has taken nothing either."""
    if _timeout is not None:
        cm = _timeout(timeout)
        try:
            async with cm:
                return True, await aw
        except TimeoutError:
            if not cm.expired():   # aw's own TimeoutError
                raise
            return False, None
    # Python 3.10: asyncio.wait never swallows a cancellation (an item the inner get took in that same instant
    # is dropped with the cancelled caller)
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait((fut,), timeout=timeout)
    except BaseException:
        fut.cancel()
        raise
    if not done:
        fut.cancel()
        return False, None
    return True, fut.result()


_timeout = getattr(asyncio, "timeout", None)


class ClientGone(Exception):
    """The client hung up while its request was being worked on (unless_gone)."""


# how often a handler that is not streaming looks for a client that hung up: its sequence runs on till then (at
# 0.5 s a non-streamed answer went on for 0.4-0.6 s, hundreds of tokens of the tiny model); a look costs ~20 us
HANGUP_POLL = 0.1


async def unless_gone(aw, request, poll: float = HANGUP_POLL, lost=None):
    """aw's result, awaited while the client is there: looked at every `poll` s; once it has hung up, aw is
    cancelled (the work it waits on with it) and ClientGone is raised. lost(result): given a result that came
    while the hang-up was being found (what it holds is released there, never leaked)."""
    fut = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait((fut,), timeout=poll)
            if done:
                return fut.result()
            if await request.is_disconnected():
                raise ClientGone
    except BaseException:
        fut.cancel()
        if lost is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            lost(fut.result())
        # read its end, whatever it is: a cancelled gather() ends with CancelledError set as its exception, which
        # asyncio logged ('exception was never retrieved', a traceback) for every such hang-up
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise


async def next_or_gone(q: asyncio.Queue, request, poll: float = HANGUP_POLL):
    """q's next item, or None once the client has hung up: looked at every `poll` s, whether items come (a
    decoding answer gives one every few ms) or not (a request waiting in the queue)."""
    key = "bitnet.hangup_checked"
    while True:
        now = time.monotonic()
        if now - request.scope.setdefault(key, now) >= poll:
            request.scope[key] = now
            if await request.is_disconnected():
                return None
        done, item = await within(q.get(), poll)
        if done:
            return item
        request.scope[key] = time.monotonic()
        if await request.is_disconnected():
            return None


class Streamed(StreamingResponse):
    """A StreamingResponse that closes its body generator however the response ends. Starlette leaves one paused
    at a `yield` as it is when its task is cancelled in send() (a client that stopped reading, its socket full,
    cut by --request-timeout): the generator's `finally`, which cancels the engine sequence, waited for the
    garbage collector, and the sequence ran on to max_tokens."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                try:
                    await close()
                except RuntimeError:   # still running: it is ending by itself (the cancellation is inside it)
                    pass
