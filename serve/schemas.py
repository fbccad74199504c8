"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Field names and defaults follow OpenAI's API; llama.cpp's extras that clients send (`top_k`, `min_p`,
`repeat_penalty`, `ignore_eos`) are accepted too. Unknown top-level fields are ignored (clients send many); the
ones ignored by design are listed in docs/api.md. A sibling endpoint's field, or an unknown key inside OpenAI's own
objects (stream_options, response_format), is a 400 naming it. Values the engine cannot honour are rejected by
`unsupported()` with the parameter named, so the client gets a clear 400 instead of a silently different answer.
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import fields
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Optional, Union, get_args, get_origin

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from ..engine.errors import json_text, shown_number  # noqa: F401  (json_text: the serve modules' name for it)
from ..engine.runtime.chat_template import join_text_parts
from ..engine.runtime.sampling import EXCLUDED, NO_TOKEN_ALLOWED, SamplingParams, setting_problem


_DEFAULT = SamplingParams()
WHOLE_CONTEXT = 1 << 30   # repeat_last_n covering every token of a sequence (llama-server's -1)
# the branch tags pydantic puts in an error's location inside a union ("str", "dict[str,float]", a model's name)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|bytes|[a-z-]+\[.*\]|[A-Z]\w*)$")


def main_error(errors: list[dict]) -> dict:
    """The one error a 400 reports: the deepest, so that inside a union it is the branch that got furthest (a
    list of parts with a part missing its text, not "expected a string" for the whole list)."""
    return max(errors, key=lambda e: len(e.get("loc", ())), default={})


# pydantic's words for the Python types its errors name, as JSON names them (a tuple or list is an array, a dict or
# a model an object): "Input should be a valid tuple" said a type no client sends
_JSON_TYPE_WORDS = (("a valid tuple", "an array"), ("a valid list", "an array"), ("a valid set", "an array"),
                    ("a valid dictionary", "an object"), ("Tuple should", "Array should"),
                    ("List should", "Array should"), ("Dictionary should", "Object should"))


def error_message(err: dict) -> str:
    """A pydantic error's message in JSON's terms (see _JSON_TYPE_WORDS; "or instance of ChatMessage", a Python
    class, left out): the one builder every API's 400 for a body that fails its model goes through."""
    msg = re.sub(r" or instance of \w+", "", err.get("msg", "invalid value"))
    for python, js in _JSON_TYPE_WORDS:
        msg = msg.replace(python, js)
    return msg


def error_where(err: dict) -> str | None:
    """The field a pydantic error is about, dotted ("options.stop", "messages.0.content"), without FastAPI's
    "body" and pydantic's union-branch tags; None for the body itself."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not (isinstance(x, str) and _UNION_TAG.match(x))]
    return ".".join(loc) or None

# request fields that are SamplingParams fields of the same name and meaning (record_logprobs is set from the
# request's logprobs / top_logprobs, whose shapes differ per endpoint; penalize_prompt by the endpoint)
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name not in ("record_logprobs", "penalize_prompt"))
# OpenAI request fields the server cannot honour: refused with a 400 naming them, never silently dropped
REFUSED = {
    "audio": "audio output is not supported (text only)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "functions is OpenAI's deprecated form of tools: send tools ([{\"type\": \"function\", "
                 "\"function\": {...}}])",
    "function_call": "function_call is OpenAI's deprecated form of tool_choice: send tool_choice",
    "truncate_prompt_tokens": "truncate_prompt_tokens (vLLM's) is not supported: a prompt is never cut here (one "
                              "over the context is a 400)",
}
# the tool fields on a completion endpoint (text in, text out: no messages to carry calls and results); taken, they
# were ignored, even tool_choice "required"
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
TOOLS_ELSEWHERE = "only /v1/chat/completions (and /v1/responses, /v1/messages, /api/chat) take tools"


# the /v1/completions fields a chat request may send: taken at their "off" values (they ask for nothing), else a
# 400 saying where they belong (they were dropped in silence: echo true echoed nothing)
COMPLETIONS_ONLY = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


def sibling_refused(body, fields: dict, where: str) -> tuple[str, str] | None:
    """(param, message) for the first of `fields` (name: its "off" values) that a request sets to another value:
    a field of the sibling endpoint `where`."""
    for name, off in fields.items():
        value = getattr(body, name)
        if not any(value is x or (type(value) is type(x) and value == x) for x in off):
            return name, f"{name}: a {where} field, not taken here"
    return None


def tools_refused(body) -> tuple[str, str] | None:
    """(param, message) for the first tool field a completion request (/v1/completions, /completion) gives."""
    name = next((n for n in TOOL_FIELDS if getattr(body, n, None) is not None), None)
    return None if name is None else (name, f"{name}: {TOOLS_ELSEWHERE}")


# The one range that differs from the engine's on purpose: OpenAI's API takes temperature in [0, 2] only (the
# engine and llama.cpp take any >= 0), and a client written against OpenAI should get the same 400 here.
OPENAI_MAX_TEMPERATURE = 2.0
# A request's seed, on every API (OpenAI's, llama-server's /completion, ollama's options): OpenAI's signed int64 or
# an unsigned 64-bit one. -1 is a fresh random seed (llama-server's and ollama's), another negative one its unsigned
# twin (ollama's runner reads its int64 seed as unsigned)
SEED_RULE = "must be an integer in -2^63 .. 2^64-1 (-1: a fresh random seed; another negative one: seed + 2^64)"


def request_seed(value, name: str = "seed"):
    """A request's integer seed as the engine takes it (None: a fresh random one), or ValueError with the one
    message every API gives for one outside SEED_RULE's range. Anything else is returned as is (the engine's
    check names its type)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"{name} {value}: {SEED_RULE}")
    return None if value == -1 else value % (1 << 64)


def overflow_message(e, what: str = "messages") -> str:
    """A ContextOverflowError as an API's message: OpenAI's sentence first where the counts are known ("This
    model's maximum context length is N tokens. However, your messages resulted in M tokens"), the wording clients
    classify by (LiteLLM's ContextWindowExceededError, its routers' context-window fallbacks, match its start;
    vLLM and llama-cpp-python answer it too), then the engine's own line and hint. `what`: what the request sent
    ("messages", "prompt" on the completion routes, "input" on the embedding ones)."""
    n, ctx = getattr(e, "n_prompt_tokens", None), getattr(e, "n_ctx", None)
    if n is None or ctx is None:
        return str(e)
    return f"This model's maximum context length is {ctx} tokens. However, your {what} resulted in {n} tokens: {e}"


ENGINE_FAULT = "the engine failed while generating this answer (the server goes on; see its log)"
NEVER_STARTED = "the server is shutting down: this request never started; retry it"


class Unanswered(NamedTuple):
    """The error a generating request answers when its sequence ended without an answer."""
    status: int
    message: str
    type: str
    code: str
    headers: dict | None


def unanswered(finish_reason: str | None, retry_after: int, rid: str | None = None, where: str = "",
               seq: int | None = None, fault: str = ENGINE_FAULT) -> Unanswered | None:
    """How every API refuses a sequence that ended without an answer: "error" (a fault in its forward pass or
    sampling: a 500, the server goes on), "excluded" (the request's grammar, logit_bias and ignore_eos left no
    token to draw: a 400 saying so) or "unavailable" (a stopping server ended it before it had a slot: a 503
    with Retry-After, which clients and load balancers retry: an empty "stop" looked like a model that said
    nothing); None for any other end. A fault is logged (stderr) naming the request id the client got (rid), its
    path (where) and the engine's sequence (seq: the engine's own line names only that), and the message names
    rid, so an operator can find the cause from what the client saw (an API whose answers have no id: one made
    here, req-...). `fault`: the 500's message before the id (the embedding routes' names what they do)."""
    if finish_reason == "error":
        import sys
        import uuid
        rid = rid or f"req-{uuid.uuid4().hex[:24]}"
        print(f"bitnet serve: request {rid} ({where}) failed: the engine ended its sequence"
              f"{'' if seq is None else f' {seq}'} on a fault (the 'bitnet engine' line says why)", file=sys.stderr)
        return Unanswered(500, f"{fault[:-1]}, request {rid})", "server_error", "engine_error", None)
    if finish_reason == EXCLUDED:   # the request's grammar and logit_bias left no token to draw: its own doing
        return Unanswered(400, NO_TOKEN_ALLOWED, "invalid_request_error", "no_token_allowed", None)
    if finish_reason == "unavailable":
        return Unanswered(503, NEVER_STARTED, "unavailable_error", "shutting_down",
                          {"Retry-After": str(retry_after)})
    return None


# stop sequences on every endpoint (OpenAI's own API takes 4, but the local servers code-completion clients are
# written for take more: llama-server, ollama, vLLM; a FIM client sends its model's 5-10 control tokens): each is
# matched at every token in the scheduler's step, which every stream shares (20,000 made another's 23x slower),
# so their count and their total length are bounded
MANY_STOPS = 64
STOP_CHARS = 8192


def stops_problem(stops: list, name: str = "stop") -> str | None:
    """The 400's message for stop strings over MANY_STOPS or STOP_CHARS (counted as sent), else None."""
    if len(stops) > MANY_STOPS:
        return f"{name}: at most {MANY_STOPS} stop sequences, got {len(stops)}"
    total = sum(len(x) for x in stops if isinstance(x, str))
    if total > STOP_CHARS:
        return f"{name}: the stop sequences are {total} characters long together; at most {STOP_CHARS}"
    return None


def utc_iso(ts: float | None = None) -> str:
    """A Unix time (None: now) as the APIs write times: ISO 8601, UTC, with "Z"."""
    import datetime
    when = datetime.datetime.now(datetime.timezone.utc) if ts is None else \
        datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
    return when.isoformat().replace("+00:00", "Z")


def bare_name(name: str) -> str:
    """A model's name less ollama's ":latest" tag (in any case), which names the model without it."""
    return name[: -len(":latest")] if name.lower().endswith(":latest") else name


def tagged_name(name: str) -> str:
    """A model's name as ollama lists it (/api/tags, /api/ps): NAME:latest where the name has no tag of its own.
    ollama's clients check a name against that list with its tag ("m:latest" was "not found" beside "m"; a list of
    "m:latest" passes "m" too); every route takes either spelling."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def name_key(name: str) -> str:
    """What two model names that mean one model share: the name less ":latest", in any case and any Unicode
    normalisation (a file named on macOS is NFD, "cafe" + U+0301; a name typed elsewhere is NFC, U+00E9: they look
    the same). Unicode's caseless match: NFC before and after the case fold."""
    import unicodedata
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", bare_name(name)).casefold())


def shown_path(path: str) -> str:
    """A file path as a reply shows it: a name that is not UTF-8 (its bytes surrogate-escaped by os.listdir /
    argv) with each bad byte as U+FFFD, since JSON cannot carry a lone surrogate."""
    return os.fsencode(path).decode("utf-8", "replace")


def model_object(model_id: str, created: int, **extra) -> dict:
    """One model as `GET /v1/models` lists it, in OpenAI's shape and Anthropic's at once (both SDKs call that path;
    each reads its own fields: object/created/owned_by, type/display_name/created_at); `extra`: ours (meta, ...)."""
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": "bitnet-cpu", "type": "model",
            "display_name": model_id, "created_at": utc_iso(created), **extra}


class RequestProblem(ValueError):
    """A request an adapter (Responses, Anthropic) cannot translate: (param, message), answered as a 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def continuation(msgs: list[dict], continue_final: bool | None,
                 add_generation_prompt: bool | None) -> tuple[list[dict], str | None]:
    """llama-server's continuation of a final assistant message (its default, --prefill-assistant; the web UI's
    Continue sends continue_final_message true and add_generation_prompt false): (the messages the template renders
    with its generation prompt, the text the answer continues, or None: a new turn). RequestProblem as
    llama-server refuses: both flags true, two assistant messages at the end, nothing to continue."""
    if continue_final and add_generation_prompt:
        raise RequestProblem("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                                                       "both be true")
    last = msgs[-1] if msgs else {}
    can = last.get("role") == "assistant" and not last.get("tool_calls")
    if continue_final is None:
        continue_final = can
    if not continue_final:
        if add_generation_prompt is False:
            raise RequestProblem("add_generation_prompt", "add_generation_prompt false: only to continue a final "
                                                          "assistant message (continue_final_message)")
        return msgs, None
    if not can:
        raise RequestProblem("continue_final_message", "continue_final_message: the last message is not an "
                                                       "assistant's text to continue")
    if len(msgs) >= 2 and msgs[-2].get("role") == "assistant":
        raise RequestProblem("messages", "messages: two assistant messages at the end (the last one is continued)")
    return msgs[:-1], last.get("content") or ""


# the content parts that carry something other than text (OpenAI's chat and Responses, Anthropic's): refused as
# such; any other type is not a content part at all
MEDIA_PARTS = frozenset({"image_url", "input_audio", "file", "input_image", "input_file", "image", "document",
                         "audio", "video", "input_video"})


def part_refusal(where: str, kind, kinds: tuple[str, ...]) -> str:
    """Why a content part of type `kind` (not one of the text `kinds`) is refused, in words naming `where`."""
    if kind in MEDIA_PARTS:
        return f"{where}.type {json_text(kind)}: this model takes text only ({', '.join(kinds)} parts)"
    return f"{where}.type {json_text(kind)}: not a content part type here (its text parts: {', '.join(kinds)})"


def text_of_parts(content, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content (a string, or parts of the given text kinds) as text, a newline between two parts
    (join_text_parts: as llama-server); a part of another kind (an image, a file: this model takes text only) is a
    RequestProblem naming it.
    The Responses and Anthropic adapters share it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestProblem(where, f"{where}: expected a string or a list of content parts")
    texts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds:
            raise RequestProblem(f"{where}[{j}]", part_refusal(f"{where}[{j}]", kind, kinds))
        t = p.get("refusal" if kind == "refusal" else "text")
        if not isinstance(t, str):
            raise RequestProblem(f"{where}[{j}]", f"{where}[{j}]: a text part needs a string")
        texts.append(t)
    return join_text_parts(texts)


@functools.lru_cache(maxsize=None)   # per field annotation: every request validates each field through it
def _json_kind(annotation) -> str | None:
    """"boolean" / "number" for a field typed bool / int / float (or Optional of one), "numbers" for a map to
    numbers (logit_bias), "ids" for a list of token ids, "prompt ids" for a prompt that may be one (a string, a
    list of strings, of ids or of lists of ids), "strings" for a list of strings, else None."""
    args = get_args(annotation) if get_origin(annotation) is Union else (annotation,)
    kinds = {a for a in args if a is not type(None)}
    if kinds == {bool}:
        return "boolean"
    if kinds in ({list[str]}, {tuple[str, ...]}):
        return "strings"
    if list[int] in kinds or list[list[int]] in kinds:
        return "ids" if kinds == {list[int]} else "prompt ids"
    if len(kinds) == 1 and get_origin(next(iter(kinds))) is dict and get_args(next(iter(kinds)))[1] in (int, float):
        return "numbers"
    return "number" if kinds and kinds <= {int, float} else None


def _id_items(value: list, nested: bool):
    """(where, item) of a list of token ids, or (nested) of lists of them."""
    for i, x in enumerate(value):
        if nested and isinstance(x, list):
            yield from ((f"[{i}][{j}]", y) for j, y in enumerate(x))
        else:
            yield f"[{i}]", x


def boolean_or_none(value) -> bool:
    """Whether a flag the APIs type as a boolean (a tool's `strict`) is one, or left out: "yes" or 1 is their 400,
    which a lax reading took as true (and false as true, for "false")."""
    return value is None or isinstance(value, bool)


# OpenAI's pattern for a function's name and a response format's name (its API refuses "a b", "x</tool_call>y")
OPENAI_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def check_openai_name(name, where: str) -> None:
    """RequestProblem for a tool's or a format's name outside OpenAI's pattern, on OpenAI's endpoints (ollama's
    and llama-server's own take any); a name that is not a string is left to the check of its shape."""
    if isinstance(name, str) and not OPENAI_NAME.fullmatch(name):
        raise RequestProblem(where, f"{where} {json_text(name)}: expected 1 to 64 letters, digits, underscores or "
                                    f"dashes ('^{OPENAI_NAME.pattern}$'), as OpenAI's API")


def cut_short(finish_reason: str | None, parser=None) -> bool:
    """Whether an answer is to be reported as cut by the token limit (chat's finish_reason length, the Responses
    API's incomplete, Anthropic's stop_reason max_tokens), the one rule of every OpenAI- and Anthropic-shaped
    endpoint: it ran into the limit or the context (finish_reason length or context), or it ended otherwise (a stop
    string, the end of text) but cut a tool call (`parser.cut_call`: never to be run, even where no call was left
    to give). An answer in a JSON format a stop string cut is not cut short: it ends as any answer a stop string
    ends (stop), as OpenAI's and llama-server's do, and as the Python API's; a larger limit would not make it
    whole."""
    if finish_reason in ("length", "context"):
        return True
    return parser is not None and parser.cut_call


class JSONTyped(BaseModel):
    """A request model whose booleans and numbers take JSON's own types, as OpenAI's API and ollama's Go server
    do: "0.5" for a temperature, "yes" or 1 for stream, true for max_tokens are a 400 naming the field, where
    pydantic's lax mode would have read them as 0.5, true and 1. A token id is a JSON integer: true is not token
    1, 3.0 not token 3. A null in a field with a default other than null is left out: the default applies, as
    if the field had not been sent (docs/api.md; /tokenize's "parse_special": null was a 400)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        if isinstance(data, dict) and any(v is None for v in data.values()):
            data = {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].is_required() or cls.model_fields[k].default is None}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _json_type(cls, value, info: ValidationInfo):
        kind = _json_kind(cls.model_fields[info.field_name].annotation)
        if kind is None or value is None:
            return value
        if kind == "boolean" and not isinstance(value, bool):
            raise PydanticCustomError("json_type", f"expected true or false, got {json_text(value)}")
        if kind == "number" and (isinstance(value, (bool, str)) or not isinstance(value, (int, float))):
            raise PydanticCustomError("json_type", f"expected a number, got {json_text(value)}")
        if kind == "strings" and not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise PydanticCustomError("json_type", f"expected an array of strings, got {json_text(value)}")
        if kind == "number" and isinstance(value, float) and not abs(value) < 2 ** 63:   # (the field's type: only
            annotation = cls.model_fields[info.field_name].annotation                  # for such a number)
            if float not in (get_args(annotation) or (annotation,)):   # an integer field: pydantic said "Unable to
                # parse input string as an integer, exceeded maximum size" of 1e30, a string the client never sent
                raise PydanticCustomError("json_type", f"expected an integer within range, got {json_text(value)} "
                                          "(too large)")
        if kind == "number" and isinstance(value, int) and not isinstance(value, bool) and not abs(value) < 2 ** 63 \
                and info.field_name != "seed":   # the same bound as a JSON integer (a seed has its own: SEED_RULE)
            annotation = cls.model_fields[info.field_name].annotation
            if float not in (get_args(annotation) or (annotation,)):   # it ran a max_tokens of 1e23 to the end
                raise PydanticCustomError("json_type", f"expected an integer within range, got {json_text(value)} "
                                          "(too large)")
        if kind == "numbers" and isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, (bool, str)) or not isinstance(v, (int, float)):
                    raise PydanticCustomError("json_type", f"{json_text(k)}: expected a number, got {json_text(v)}")
        if kind in ("ids", "prompt ids") and isinstance(value, list) and \
                (kind == "ids" or not all(isinstance(x, str) for x in value)):   # a list of strings: texts
            for where, x in _id_items(value, nested=kind == "prompt ids"):
                if isinstance(x, bool) or not isinstance(x, int):
                    raise PydanticCustomError("json_type", f"{info.field_name}{where}: expected a token id, "
                                              f"got {json_text(x)}")
        return value


def _metadata_checked(value: dict) -> dict:
    """OpenAI's rule for `metadata` (its 400 otherwise): at most 16 pairs, keys of at most 64 characters, values of
    at most 512 (string values: the type says so)."""
    if len(value) > 16:
        raise PydanticCustomError("metadata", f"at most 16 keys, got {len(value)}")
    for k, v in value.items():
        if len(k) > 64:
            raise PydanticCustomError("metadata", f"key {json_text(k[:20])}...: at most 64 characters, got {len(k)}")
        if len(v) > 512:
            raise PydanticCustomError("metadata", f"{json_text(k)}: a value of at most 512 characters, got {len(v)}")
    return value


# OpenAI's `metadata` and `service_tier` (chat completions and Responses alike): nothing here reads them, but a value
# OpenAI refuses is a 400 here too (a client's bug is found before it meets OpenAI)
Metadata = Annotated[dict[str, str], AfterValidator(_metadata_checked)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class StreamOptions(JSONTyped):
    """OpenAI's stream_options; any other key is a 400 naming its path (stream_options.foo): no client's extension
    lives there but vLLM's continuous_usage_stats, which is taken when false."""
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None   # taken either way: no chunk is padded here (nothing to hide)
    continuous_usage_stats: Optional[bool] = None   # vLLM's usage in every chunk: not done here

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_usage_per_chunk(cls, value):
        if value:
            raise PydanticCustomError("unsupported", "vLLM's usage in every chunk is not given here "
                                      "(include_usage gives it in a final chunk)")
        return value


def _schema_given(value):
    """One message for what is not a schema: the union's first failure said "Input should be a valid boolean" for a
    schema sent as a string of JSON."""
    if value is not None and not isinstance(value, (bool, dict)):
        what = "a string (send the schema itself, not its JSON text)" if isinstance(value, str) else \
            f"a JSON {'array' if isinstance(value, list) else 'number'}"
        raise PydanticCustomError("json_schema_value", f"a JSON Schema is an object (or true / false), not {what}")
    return value


# a JSON Schema as a request gives it: an object, or JSON Schema's boolean schema (true: any value; false: none, a
# 400 from Constraint.json_schema); not "yes" or 1, which lax validation would have read as true
JSONSchemaValue = Annotated[Union[StrictBool, dict[str, Any]], BeforeValidator(_schema_given)]


class JSONSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: {name, description, schema, strict}. The schema is enforced
    whatever `strict` says (a constrained decoder has no cheaper mode). Any other key is a 400 naming its path."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[JSONSchemaValue] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None   # OpenAI's 400 for "yes" or 1, which lax validation read as true


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`; llama-server's {"type": "json_object", "schema": {...}} form too. Any other key
    is a 400 naming its path (response_format.foo), as no client's extension lives there."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None
    schema_: Optional[JSONSchemaValue] = Field(default=None, alias="schema")


# llama-server's sampler names. The engine's chain is bias -> penalties -> dry -> top_n_sigma -> top_k -> typ_p ->
# top_p -> min_p -> xtc -> temperature (engine/runtime/sampling.py, llama.cpp's default order); a `samplers` list
# may leave any of those out (that one is off) but not reorder them. The other names are samplers that are always
# on (penalties) or that this engine has not (tfs_z, infill), so naming them changes nothing.
CHAIN = ("dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
NO_OP_SAMPLERS = {"tfs_z", "penalties", "infill"}
# llama.cpp's other spellings of the chain's names (kebab-case, no underscore, a few words)
SAMPLER_ALIASES = {**{n.replace("_", "-"): n for n in CHAIN}, **{n.replace("_", ""): n for n in CHAIN},
                   "typical_p": "typ_p", "typical": "typ_p", "typ": "typ_p", "nucleus": "top_p", "temp": "temperature"}
# llama-server's one-letter names (`"samplers": "kpt"`; common_sampler_type_to_chr)
SAMPLER_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                   "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties"}
# a sampler left out of the chain: the SamplingParams field that turns it off, and its "off" value
CHAIN_OFF = {"dry": ("dry_multiplier", 0.0), "top_n_sigma": ("top_n_sigma", -1.0), "top_k": ("top_k", 0),
             "typ_p": ("typical_p", 1.0), "top_p": ("top_p", 1.0), "min_p": ("min_p", 0.0),
             "xtc": ("xtc_probability", 0.0)}
# llama-server fields for samplers and features this engine does not have: refused unless at their "off" value,
# on every endpoint that takes llama-server's extras (its own /completion and the OpenAI ones)
OFF = {"n_indent": 0, "t_max_predict_ms": 0, "post_sampling_probs": False, "image_data": None,
       "lora": None, "multimodal_data": None, "tfs_z": 1.0}
OFF_WHY = {"tfs_z": "llama.cpp removed tail-free sampling"}   # (ollama's options.tfs_z is refused the same way)


def is_off(value, off) -> bool:
    """Whether a value sent for one of OFF's fields is its off value (an empty list is off for a null one, as
    llama.cpp's web UI sends them; true is not a number's 1)."""
    if isinstance(value, bool) and not isinstance(off, bool):
        return False
    return value == off or (off is None and value in ([], {}))


def off_refusal(name: str, value, off) -> str:
    """The 400's message for a value of an OFF field (or ollama's REFUSED_OPTIONS) other than its off value."""
    why = OFF_WHY.get(name.removeprefix("options."))
    return (f"{name} {json_text(value)}: not supported (only {json.dumps(off)}{' or []' if off is None else ''}, off"
            f"{': ' + why if why else ''})")


LAZY = ("grammar_lazy", "grammar_triggers")   # refused when set (true, non-empty)


class _Sampling(JSONTyped):
    model_config = ConfigDict(extra="ignore")
    MAX_TEMPERATURE: ClassVar[Optional[float]] = OPENAI_MAX_TEMPERATURE   # None: the engine's range only
    # a format beside a required tool call (no text answer this turn): OpenAI takes the pair ("drop": the call
    # grammar alone), Anthropic's API refuses it ("refuse": 400); engine/runtime/tools.py with_answer_format
    FORCED_CALL_FORMAT: ClassVar[str] = "drop"
    EFFORT_NONE: ClassVar[bool] = False   # reasoning_effort "none" is taken (the chat endpoint's)
    # llama-server's leniency, on its own /completion only: a dry_base below 1 is its default (elsewhere a 400, as
    # ollama's options give: the rule that no value is dropped in silence)
    DRY_BASE_BELOW_1_IS_DEFAULT: ClassVar[bool] = False
    # an empty stop string: a 400 (as Anthropic's API refuses one), but skipped on llama-server's own /completion,
    # as llama-server skips it there
    EMPTY_STOP_SKIPPED: ClassVar[bool] = False

    _end_ids: list = PrivateAttr(default_factory=list)   # more tokens that end the answer (a middle's: fim.py)
    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    timings_per_token: bool = False   # llama-server's: every streamed chunk carries `timings` (its web UI's speed)
    max_tokens: Optional[int] = Field(default=None, ge=0)
    n_predict: Optional[int] = None   # llama-server's length field (-1: to the context's end), where the
    #                                   endpoint's own (max_tokens, ...) is left out
    # defaults and checks: the engine's SamplingParams / setting_problem (the same words as --temp and /set temp)
    temperature: float = _DEFAULT.temperature
    top_p: float = _DEFAULT.top_p
    top_k: int = _DEFAULT.top_k
    min_p: float = _DEFAULT.min_p
    repeat_penalty: float = _DEFAULT.repeat_penalty
    repeat_last_n: int = _DEFAULT.repeat_last_n
    ignore_eos: bool = False
    seed: Optional[int] = _DEFAULT.seed
    stop: Union[str, list[str], None] = None
    n: int = 1   # 1..--parallel: checked where the engine is known (a fixed bound here named a wrong limit)
    presence_penalty: float = _DEFAULT.presence_penalty
    frequency_penalty: float = _DEFAULT.frequency_penalty
    logit_bias: Optional[dict[str, float]] = None
    # llama-server's other samplers (the engine's names and defaults: off)
    dry_multiplier: float = _DEFAULT.dry_multiplier
    dry_base: float = _DEFAULT.dry_base
    dry_allowed_length: int = _DEFAULT.dry_allowed_length
    dry_penalty_last_n: int = _DEFAULT.dry_penalty_last_n
    dry_sequence_breakers: tuple[str, ...] = _DEFAULT.dry_sequence_breakers
    top_n_sigma: float = _DEFAULT.top_n_sigma
    typical_p: float = _DEFAULT.typical_p
    xtc_probability: float = _DEFAULT.xtc_probability
    xtc_threshold: float = _DEFAULT.xtc_threshold
    dynatemp_range: float = _DEFAULT.dynatemp_range
    dynatemp_exponent: float = _DEFAULT.dynatemp_exponent
    mirostat: int = _DEFAULT.mirostat
    mirostat_tau: float = _DEFAULT.mirostat_tau
    mirostat_eta: float = _DEFAULT.mirostat_eta
    min_keep: int = _DEFAULT.min_keep   # llama-server's: the truncating samplers keep at least this many
    # llama-server's reasoning budget (also spelled reasoning_budget_tokens and thinking_budget_tokens there)
    reasoning_budget: int = _DEFAULT.reasoning_budget
    reasoning_budget_message: str = _DEFAULT.reasoning_budget_message
    user: Optional[str] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None   # OpenAI's answer-length hint: only "medium" (the model's own length) is honoured
    functions: Optional[Any] = None       # the deprecated forms of tools / tool_choice: refused, naming the new ones
    function_call: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None   # vLLM's prompt cut: refused (REFUSED)
    # structured output: OpenAI's response_format, llama-server's `json_schema` and `grammar` (GBNF) fields
    response_format: Optional[ResponseFormat] = None
    json_schema: Optional[JSONSchemaValue] = None
    grammar: Optional[str] = None
    # llama-server's sampler chain (names, or its string of letters "kpt") and its fields for what this engine has
    # not (OFF, LAZY): read on every endpoint, as llama-server reads them, so none is dropped in silence
    samplers: Optional[list[str]] = None
    n_probs: int = Field(default=0, ge=0, le=20)   # /completion's logprobs; the OpenAI endpoints' are their own
    n_indent: Any = OFF["n_indent"]
    t_max_predict_ms: Any = OFF["t_max_predict_ms"]
    post_sampling_probs: Any = OFF["post_sampling_probs"]
    tfs_z: Any = OFF["tfs_z"]
    image_data: Any = None
    lora: Any = None
    multimodal_data: Any = None
    grammar_lazy: Any = None
    grammar_triggers: Any = None
    N_PROBS: ClassVar[bool] = False   # n_probs honoured (llama-server's /completion)

    @field_validator("samplers", mode="before")
    @classmethod
    def _sampler_letters(cls, value):
        return [SAMPLER_LETTERS.get(c, c) for c in value] if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _minus_one_is_no_limit(cls, data):
        """llama-server's -1 for a length field (max_tokens, max_completion_tokens, max_output_tokens: n_predict's
        aliases there) is "to the context's end"; llama.cpp's web UI sends it on every message. Other negatives
        stay the 400 of the field's own rule."""
        if isinstance(data, dict):
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if data.get(name) == -1 and name in cls.model_fields and not cls.model_fields[name].is_required():
                    data = {**{k: v for k, v in data.items() if k != name}, "n_predict": data.get("n_predict", -1)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _budget_aliases(cls, data):
        """llama-server's other names of reasoning_budget: reasoning_budget_tokens, thinking_budget_tokens; -1 in
        any of them is the server's default (its --reasoning-budget), as llama-server reads it."""
        if not isinstance(data, dict):
            return data
        if data.get("reasoning_budget") == -1:
            data = {k: v for k, v in data.items() if k != "reasoning_budget"}
        if "reasoning_budget" not in data:
            for alias in ("reasoning_budget_tokens", "thinking_budget_tokens"):
                if data.get(alias) is not None and data[alias] != -1:
                    return {**data, "reasoning_budget": data[alias]}
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """OpenAI's API takes null for its optional fields ("temperature": null: the default), and clients send it
        (LangChain, LiteLLM): a null in a sampling field or a field with a non-null default is left out, so the
        server's default (its --temp, --seed, ...) applies, as if the field had not been sent."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            data = {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()
                    or (cls.model_fields[k].default is None and k not in SAMPLING_FIELDS)}
        return data

    @field_validator(*SAMPLING_FIELDS)
    @classmethod
    def _sampling_value(cls, value, info: ValidationInfo):
        field = info.field_name
        if field == "seed":
            try:
                value = request_seed(value)
            except ValueError as e:
                raise PydanticCustomError("invalid_setting", str(e)) from None
        if field == "dry_base" and cls.DRY_BASE_BELOW_1_IS_DEFAULT and isinstance(value, (int, float)) \
                and value < 1:   # llama-server's: its default
            return _DEFAULT.dry_base
        # llama-server reads its extras on these endpoints as /completion does: top_k -1 is off (its clients' way
        # of saying so; other negatives stay the 400 every front end gives), repeat_last_n -1 the whole context
        if field == "top_k" and value == -1:
            return 0
        if field == "repeat_last_n" and value == -1:
            return WHOLE_CONTEXT
        if field == "logit_bias" and value is not None:   # JSON keys are strings: token ids as text
            bias = {}
            for k, v in value.items():   # plain digits: int() also took "1_0" and " 10" as 10
                if not re.fullmatch(r"-?[0-9]+", k):
                    raise PydanticCustomError("invalid_setting", f"logit_bias {json_text(k)}: a key must be a token id")
                bias[int(k)] = v
            value = bias
        problem = setting_problem(field, value, json_terms=True)
        if problem is None and field == "temperature" and cls.MAX_TEMPERATURE is not None \
                and value > cls.MAX_TEMPERATURE:
            problem = f"temperature {shown_number(value)}: must be <= {cls.MAX_TEMPERATURE:g} (this API's range)"
        if problem:
            raise PydanticCustomError("invalid_setting", problem)   # the message as is, named by its field
        return value

    def sampling_params(self, defaults: SamplingParams | None = None) -> SamplingParams:
        """The request's sampling; a field the request did not send takes `defaults`' value (the server's
        --temp / --top-k ... flags), else the engine's default."""
        base = defaults or _DEFAULT
        p = SamplingParams(**{f: getattr(self, f) if f in self.model_fields_set else getattr(base, f)
                              for f in SAMPLING_FIELDS}, record_logprobs=self.record_logprobs())
        if self.samplers is not None:   # a sampler left out of the chain is off
            chain = {SAMPLER_ALIASES.get(x, x) for x in self.samplers}
            for name, (field, off) in CHAIN_OFF.items():
                if name not in chain:
                    setattr(p, field, off)
            if "temperature" not in chain and p.temperature > 0:   # no temperature stage, so no dynatemp either
                p.temperature, p.dynatemp_range = 1.0, 0.0
        return p

    def record_logprobs(self) -> int | None:
        """How many alternatives per token the engine must record (None: no logprobs asked)."""
        return None

    def constraint(self):
        """The one Constraint the request asks for (engine/runtime/constraints.py), or None. Raises
        ConstraintError naming the field when the spec is malformed or two are given."""
        from ..engine.errors import ConstraintError
        from ..engine.runtime.constraints import Constraint

        given = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_schema":
                if rf.json_schema is None or rf.json_schema.schema_ is None:   # param: the path the words name
                    where = "response_format.json_schema" + (".schema" if rf.json_schema is not None else "")
                    raise ConstraintError(f"{where}: required for type json_schema", where=where)
                given.append(Constraint.json_schema(rf.json_schema.schema_, where="response_format.json_schema.schema"))
            elif rf.schema_ is not None:
                given.append(Constraint.json_schema(rf.schema_, where="response_format.schema"))
            else:
                given.append(Constraint.json_object(where="response_format"))
        if self.json_schema is not None:
            given.append(Constraint.json_schema(self.json_schema, where="json_schema"))
        if self.grammar:   # "" is llama-server's "no grammar" (its default, echoed in /props)
            given.append(Constraint.gbnf(self.grammar, where="grammar"))
        if len(given) > 1:
            raise ConstraintError("give one of response_format, json_schema and grammar, not several",
                                  where=given[1].where)
        return given[0] if given else None

    def predict_limit(self, default: Optional[int]) -> Optional[int]:
        """n_predict's limit: the value; None (the context's end) when negative; `default` when not sent."""
        if self.n_predict is None:
            return default
        return self.n_predict if self.n_predict >= 0 else None

    def stop_entries(self) -> list[str]:
        """The stop strings as the request sent them, empty ones included (what the limit counts)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def stops(self) -> list[str]:
        """The stop strings the engine matches (an empty one matches nothing: skipped where it is taken)."""
        return [x for x in self.stop_entries() if x]

    def stream_options_alone(self) -> tuple[str, str] | None:
        """OpenAI's 400 for stream_options on a request that does not stream (its chat and completions endpoints;
        vLLM's too): nothing would carry them."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first value we cannot honour, else None."""
        for name, why in REFUSED.items():
            if getattr(self, name) is not None:
                return name, why
        for name, off in OFF.items():
            value = getattr(self, name)
            if not is_off(value, off):
                return name, off_refusal(name, value, off)
        for name in LAZY:   # a lazy grammar waits for a trigger; ignored, it would constrain from the first token
            if getattr(self, name):
                return name, (f"{name}: lazy grammars (applied from a trigger on) are not supported; the grammar "
                              "applies from the first token")
        if self.n_probs and not self.N_PROBS:
            return "n_probs", "n_probs: llama-server's /completion field; on this endpoint ask for logprobs"
        if self.samplers is not None:
            names = [SAMPLER_ALIASES.get(x, x) if isinstance(x, str) else x for x in self.samplers]
            unknown = [x for x in names if x not in CHAIN and x not in NO_OP_SAMPLERS]
            if unknown:
                return "samplers", f"samplers: unknown {json_text(unknown[0])}"
            given = [x for x in names if x in CHAIN]
            if given != [x for x in CHAIN if x in given]:
                return "samplers", f"samplers: the engine's order is {', '.join(CHAIN)} (any may be left out)"
        if self.reasoning_effort is not None and (self.reasoning_effort != "none" or not self.EFFORT_NONE):
            return "reasoning_effort", (f"reasoning_effort {json_text(self.reasoning_effort)}: no effort levels here"
                                        + (" (\"none\" turns a thinking template's thinking off)" if self.EFFORT_NONE
                                           else " (a chat completion's field)"))
        if self.verbosity not in (None, "medium"):
            return "verbosity", f"verbosity {json_text(self.verbosity)}: only \"medium\" (the model's own length)"
        if self.modalities is not None and set(self.modalities) - {"text"}:
            return "modalities", "only the text modality is supported"
        entries = self.stop_entries()   # Anthropic's: stop_sequences too
        param = "stop" if self.stop is not None else "stop_sequences"
        if bad := stops_problem(entries, param):   # counted as sent, empty ones too
            return param, bad
        if "" in entries and not self.EMPTY_STOP_SKIPPED:   # it was dropped in silence
            return param, f"{param}: an empty stop string (each must be non-empty)"
        return None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None   # an assistant's refusal part

    @model_validator(mode="after")
    def _text_given(self):
        if self.type == "text" and self.text is None:   # OpenAI: a 400, not an empty message
            raise PydanticCustomError("missing_text", "a text part needs its text")
        return self


CHAT_TEXT_PARTS = ("text", "refusal")   # the chat content parts this model can take (image_url, input_audio, file: 400)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None     # an assistant's earlier calls
    tool_call_id: Optional[str] = None              # a tool result: which call it answers
    name: Optional[str] = None
    reasoning_content: Optional[str] = None         # an assistant's earlier thought (llama-server's field)
    function_call: Optional[FunctionCall] = None    # OpenAI's deprecated form of one call: tool_calls' one call
    refusal: Optional[str] = None                   # an assistant's refusal (OpenAI's field): its text

    @field_validator("content")
    @classmethod
    def _parts_given(cls, value, info: ValidationInfo):
        """OpenAI's 400 for an empty array of parts (it was an empty turn); an assistant's may be empty, as null."""
        role = info.data.get("role")
        if isinstance(value, list) and not value and role not in (None, "assistant"):
            raise PydanticCustomError("empty_content", f"an empty array: a {role} message needs at least one "
                                      "content part (or a string)")
        return value

    @model_validator(mode="after")
    def _content_given(self):
        for key in ("function_call", "refusal"):   # only an assistant's: said, never dropped in silence
            if getattr(self, key) is not None and self.role != "assistant":
                raise PydanticCustomError("invalid_field", f"{key}: only an assistant message has one, not a "
                                          f"{self.role} message")
        if self.function_call is not None and self.tool_calls:
            raise PydanticCustomError("invalid_field", "function_call is the deprecated form of tool_calls: give "
                                      "one of them")
        if self.content is None and self.role != "assistant":   # only an assistant's (tool calls) may be null
            raise PydanticCustomError("missing_content", f"a {self.role} message needs its content")
        return self

    def as_dict(self) -> dict:
        """The message as the engine's chat_prompt takes it (developer is system)."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.refusal:   # the assistant's refusal is what it said (as refusal content parts are)
            d["content"] = d["content"] + "\n" + self.refusal if d["content"] else self.refusal
        if self.tool_calls and self.role == "assistant":   # another role's were never rendered (the engine's
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]   # chat_prompt now refuses them)
        elif self.function_call is not None:   # the legacy one call: a tool call as the template renders them
            d["tool_calls"] = [ToolCall(function=self.function_call).model_dump()]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        if self.reasoning_content is not None and self.role == "assistant":   # the template decides: Qwen3's shows
            d["reasoning_content"] = self.reasoning_content   # those after the last user message (a tool loop's)
        return d

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return join_text_parts((p.refusal if p.type == "refusal" else p.text) or "" for p in self.content)

    def misplaced_refusal(self) -> Optional[int]:
        """The index of a refusal part in a message that is not an assistant's (OpenAI's schema: only its), or None."""
        if isinstance(self.content, list) and self.role != "assistant":
            return next((j for j, p in enumerate(self.content) if p.type == "refusal"), None)
        return None

    def other_part(self) -> Optional[int]:
        """The index of the first content part that is not text (an image, audio, a file), or None."""
        if isinstance(self.content, list):
            return next((j for j, p in enumerate(self.content) if p.type not in CHAT_TEXT_PARTS), None)
        return None


class NamedTool(NamedTuple):
    """A tool_choice that names a function: kept apart from the modes "none" / "auto" / "required", which are also
    valid function names (a tool named "required" forced by name is one call of it, not "any tool")."""
    name: str


ToolChoiceName = Union[str, NamedTool]   # a mode ("none" | "auto" | "required"), or NamedTool


class ToolChoiceFunction(BaseModel):
    name: str


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class AllowedToolRef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class AllowedTools(BaseModel):
    model_config = ConfigDict(extra="ignore")
    mode: Literal["auto", "required"]
    tools: list[AllowedToolRef] = Field(min_length=1)


class AllowedToolsChoice(BaseModel):
    """OpenAI's {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}: every tool stays in the prompt, the
    model may call only these (auto: or answer in text; required: one of them)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class ToolMessages:
    """The checks of tool definitions and of the messages that carry calls and results, for every request with
    `tools` and `messages` (the chat endpoint, and llama-server's /apply-template, which checks them as there)."""

    def check_tool_messages(self):
        """RequestProblem for what OpenAI's API refuses in the tools and the messages that carry calls and
        results (check_tool_shapes, then check_tool_results)."""
        self.check_tool_shapes()
        self.check_tool_results()

    def check_tool_shapes(self):
        """RequestProblem (OpenAI's 400s) for a tool without its "type", or an assistant's call whose arguments are
        not the JSON string OpenAI's API sends (an object was taken here, and refused by every other server)."""
        for i, t in enumerate(self.tools or ()):
            if isinstance(t, dict) and "type" not in t:
                raise RequestProblem(f"tools[{i}].type", f"Missing required parameter: 'tools[{i}].type'.")
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and not boolean_or_none(fn.get("strict")):   # OpenAI's 400 ("yes" was taken)
                raise RequestProblem(f"tools[{i}].function.strict", f"tools[{i}].function.strict: expected a boolean")
        for i, m in enumerate(self.messages):
            for j, c in enumerate(m.tool_calls or ()):
                if not isinstance(c.function.arguments, str):
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise RequestProblem(where, f"{where}: a JSON string (the arguments as JSON text), not an object")

    def check_tool_results(self):
        """RequestProblem (OpenAI's 400s) for a tool message without tool_call_id, with no assistant tool_calls
        before it, or answering an id none of those calls has: the engine's check (engine/runtime/tools.py
        check_tool_results, which the Python API's chat_prompt runs too)."""
        from ..engine.runtime.tools import MessageError, check_tool_results
        try:
            check_tool_results([{"role": m.role, "tool_call_id": m.tool_call_id,
                                 "tool_calls": [c.model_dump() for c in m.tool_calls or ()]} for m in self.messages])
        except MessageError as e:
            raise RequestProblem(e.where, str(e)) from None


class VLLMRepetition(JSONTyped):
    """vLLM's `repetition_penalty` (its most used sampling extension, sent by clients written for vLLM): HF's
    multiplicative rule over every token of the prompt and the answer, which is llama.cpp's `repeat_penalty`
    (the same CTRL rule) over the whole context (`repeat_last_n: -1`), so it is taken as that pair. Sent beside a
    `repeat_penalty` of another value, or a `repeat_last_n` other than -1, it is a 400 naming both; its "off" (1)
    beside them leaves them as sent."""
    repetition_penalty: Optional[float] = None

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_value(cls, value):
        if value is not None:
            problem = setting_problem("repeat_penalty", value, json_terms=True)
            if problem:
                raise PydanticCustomError("invalid_setting", problem.replace("repeat_penalty", "repetition_penalty"))
        return value

    def _repetition_off_beside_llama(self) -> bool:
        """repetition_penalty 1 (vLLM's "off", which its clients send in every request) beside llama.cpp's own
        fields: those say what the client wants (it was a 400, "the same penalty: send one of them")."""
        return self.repetition_penalty == 1 and bool({"repeat_penalty", "repeat_last_n"} & self.model_fields_set)

    def repetition_conflict(self) -> tuple[str, str] | None:
        rp = self.repetition_penalty
        if rp is None or self._repetition_off_beside_llama():
            return None
        if "repeat_penalty" in self.model_fields_set and self.repeat_penalty != rp:
            return "repetition_penalty", (f"repetition_penalty {shown_number(rp)} (vLLM's) and repeat_penalty "
                                          f"{shown_number(self.repeat_penalty)} (llama.cpp's) are the same penalty: "
                                          "send one of them")
        if "repeat_last_n" in self.model_fields_set and self.repeat_last_n != WHOLE_CONTEXT:
            return "repetition_penalty", (f"repetition_penalty counts the whole context (vLLM's rule), not the last "
                                          f"repeat_last_n {self.repeat_last_n} tokens: send repeat_penalty with "
                                          "repeat_last_n instead")
        return None

    def sampling_params(self, defaults=None):
        p = super().sampling_params(defaults)
        if self.repetition_penalty is not None and not self._repetition_off_beside_llama():
            p.repeat_penalty, p.repeat_last_n = self.repetition_penalty, WHOLE_CONTEXT
        return p


class ChatCompletionRequest(ToolMessages, VLLMRepetition, _Sampling):
    EFFORT_NONE: ClassVar[bool] = True   # reasoning_effort "none": a thinking template does not think
    messages: list[ChatMessage] = Field(min_length=1)
    # llama-server's: variables for the chat template (enable_thinking: false turns Qwen3's thinking off), and
    # where a thinking model's <think> block goes ("none": left in content; else reasoning_content)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_format: Optional[Literal["none", "auto", "deepseek", "deepseek-legacy"]] = None
    # llama-server's: a final assistant message is continued (its default); these two say so explicitly
    continue_final_message: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoice, AllowedToolsChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[Metadata] = None        # taken, not used (checked as OpenAI checks them)
    service_tier: Optional[ServiceTier] = None
    echo: Any = None      # /v1/completions' fields (COMPLETIONS_ONLY): read, so they are not dropped in silence
    best_of: Any = None
    suffix: Any = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_flag(cls, value):
        """An integer logprobs is /v1/completions' count of alternatives: said so, with chat's way to ask."""
        if isinstance(value, int) and not isinstance(value, bool):
            raise PydanticCustomError("json_type", f"expected true or false, got {value} (an integer is "
                                      f"/v1/completions' logprobs; here send logprobs: true, top_logprobs: {value})")
        return value

    def record_logprobs(self):
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_tool_shapes(self):
        """ToolMessages' checks, and OpenAI's pattern for the tools' and the response format's names (llama-server's
        /apply-template, which shares the others, takes any name)."""
        super().check_tool_shapes()
        for i, t in enumerate(self.tools or ()):
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict):
                check_openai_name(fn.get("name"), f"tools[{i}].function.name")
        if self.response_format is not None and self.response_format.json_schema is not None:
            name, where = self.response_format.json_schema.name, "response_format.json_schema.name"
            if name is None:   # OpenAI's 400 (and its words), as /v1/responses' text.format.name
                raise RequestProblem(where, f"Missing required parameter: '{where}'.")
            check_openai_name(name, where)

    def unsupported(self):
        if self.top_logprobs and not self.logprobs:   # ollama's /api/chat rule too; the harmless 0 is taken
            return "top_logprobs", f"top_logprobs {self.top_logprobs} needs logprobs: true"
        if bad := self.repetition_conflict():
            return bad
        if bad := self.stream_options_alone():
            return bad
        if bad := sibling_refused(self, COMPLETIONS_ONLY, "/v1/completions"):
            return bad
        for i, m in enumerate(self.messages):
            j = m.other_part()
            if j is not None:
                return (f"messages.{i}.content.{j}", part_refusal(f"messages.{i}.content.{j}", m.content[j].type,
                                                                   CHAT_TEXT_PARTS))
            j = m.misplaced_refusal()
            if j is not None:
                return (f"messages.{i}.content.{j}", f"messages.{i}.content.{j}.type \"refusal\": only an assistant "
                                                     f"message has refusal parts, not a {m.role} message")
        return super().unsupported()

    def tool_choice_name(self) -> ToolChoiceName:
        """"none" | "auto" | "required" | NamedTool(a function name); OpenAI's default: auto with tools, none
        without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, AllowedToolsChoice):
            return self.tool_choice.allowed_tools.mode
        return self.tool_choice if isinstance(self.tool_choice, str) else NamedTool(self.tool_choice.function.name)

    def allowed_tools(self) -> Optional[list[str]]:
        """The names tool_choice "allowed_tools" lets the model call (None: every tool)."""
        if isinstance(self.tool_choice, AllowedToolsChoice):
            return [t.function.name for t in self.tool_choice.allowed_tools.tools]
        return None

    def limit(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else self.predict_limit(None)


class CompletionRequest(VLLMRepetition, _Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]   # [[ids]]: one tokenized prompt (lm-eval sends so)
    logprobs: Optional[int] = Field(default=None, ge=0, le=5)   # OpenAI's legacy range: 0..5 alternatives
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None              # fill-in-the-middle where the model can (the route: serve/fim.py)
    input_prefix: Any = None                  # /infill's fields: refused by the route, not dropped in silence
    input_suffix: Any = None
    input_extra: Any = None
    tools: Optional[Any] = None               # refused (tools_refused): read, so they are not dropped in silence
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None
    top_logprobs: Optional[Any] = None        # the chat endpoint's field: refused, not dropped in silence
    messages: Optional[Any] = None            # the chat endpoint's: refused, not dropped in silence (the prompt ran)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)   # the newer name, honoured as on chat
    metadata: Optional[Metadata] = None        # taken, not used (checked as OpenAI checks them, as on chat)
    service_tier: Optional[ServiceTier] = None

    def limit(self) -> Optional[int]:
        """As chat's (and vLLM's): max_completion_tokens over max_tokens, then n_predict, then OpenAI's 16."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else self.predict_limit(16)

    def record_logprobs(self):
        return self.logprobs

    def unsupported(self):
        if bad := tools_refused(self) or self.repetition_conflict():
            return bad
        if self.messages is not None:
            return "messages", "messages: a /v1/chat/completions field, not taken here (/v1/completions takes prompt)"
        if self.top_logprobs is not None:
            return "top_logprobs", ("top_logprobs: the chat endpoint's field; on /v1/completions ask for logprobs "
                                    "(0..5)")
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if bad := self.stream_options_alone():
            return bad
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], list) and \
                not all(self.prompt):
            return "prompt", "an empty token list"
        if isinstance(self.prompt, list) and not self.prompt:   # no prompt at all: it was run from BOS alone
            return "prompt", "an empty list (give text, token ids, or a list of either)"
        return super().unsupported()
