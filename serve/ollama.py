"""ollama's HTTP API beside OpenAI's, over the same engine calls (engine.submit, chat_prompt, compile_constraint):
a second thin adapter, so the desktop tools and the official `ollama` clients can use `bitnet serve`.

/api/chat and /api/generate stream NDJSON by default (one JSON object a line; `"stream": false` for one
object) and end with ollama's final object: done_reason and its counts and durations in nanoseconds.
`options` map onto SamplingParams (checked by the engine's own rules, named `options.X`), `format` ("json" or a
JSON Schema) onto the constraint layer. /api/tags, /api/show, /api/ps and /api/version describe the one loaded
model. What a one-model server cannot do (pull, push, create, copy, delete) answers in ollama's error shape
`{"error": "..."}` with the reason. `tools` on /api/chat go through the engine's tool layer (engine/runtime/tools.py:
the model's own call format, a call once begun is grammar-constrained) and come back as message.tool_calls.
The request fields accepted, refused and ignored: docs/api.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import re
import time
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, PrivateAttr, StrictBool, ValidationError, model_validator

from ..engine.errors import shown_number
from ..engine.runtime.chat_template import choose_template   # the one rendered: the fallback too
from ..engine.runtime.sampling import SamplingParams, setting_problem
from .logprobs import Said, chat_entry
from .metrics import TokenClock
from .offload import (NOT_JSON, Streamed, chars_bound, next_or_gone, not_json, prepare_sampling, run_off_loop,
                      too_long_for_context)
from .fim import cut_to, fim_ends, fim_tokens, infill_ids, suffix_refusal
from .schemas import (JSONTyped, error_message, error_where, is_off, json_text, main_error, off_refusal,
                      overflow_message, request_seed, shown_path, stops_problem, tagged_name, unanswered, utc_iso)

FOREVER = math.inf
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


MAX_DURATION = (2 ** 63 - 1) / 1e9   # seconds: Go's time.Duration, which ollama parses keep_alive into


def parse_keep_alive(value) -> float:
    """ollama's keep_alive in seconds: a number of seconds, or a Go duration string ("5m", "1h30m", "90s", "-1");
    negative = for ever (math.inf), 0 = unload after the request. ValueError if it is neither."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"keep_alive: {json_text(value)} is not a duration (seconds, or a string such as \"5m\")")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive: {json_text(text)}"
                                 " is not a duration (seconds, or a string such as \"5m\")")
            value = sign * sum(float(n) * _UNIT[u] for n, u in parts)
    if math.isnan(value):
        raise ValueError(f"keep_alive: {json_text(value)} is not a duration")
    if MAX_DURATION < value < math.inf:   # a date past year 9999 broke /api/ps's expires_at (a lasting 500)
        raise ValueError(f"keep_alive: {shown_number(value)} s is over the longest duration "
                         "(Go's, ollama's: 2562047h); "
                         "-1 keeps the model loaded for ever")
    return FOREVER if value < 0 or math.isinf(value) else float(value)

# the version /api/version reports: clients written for ollama check a minimum (the fields served here are
# those of ollama's API at this version)
OLLAMA_VERSION = "0.12.0"
DONE = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
# options -> SamplingParams field (same meaning, same name apart from these)
OPTION_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed",
                 "presence_penalty", "frequency_penalty", "typical_p", "mirostat", "mirostat_tau", "mirostat_eta",
                 # llama.cpp's samplers the engine has (not ollama's options; llama-server takes them per request)
                 "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length",
                 "dry_penalty_last_n", "top_n_sigma", "dynatemp_range", "dynatemp_exponent", "min_keep")
INT_OPTIONS = ("top_k", "repeat_last_n", "seed", "mirostat", "dry_allowed_length", "dry_penalty_last_n", "min_keep")
# read by the handlers themselves
HANDLED_OPTIONS = {"num_predict", "num_ctx", "stop"}
# options ollama's Go server once had and now ignores (its log: "invalid option provided"): ignored here too
RETIRED_OPTIONS = {"penalize_newline", "num_gqa", "rope_frequency_base", "rope_frequency_scale"}
# load-time options of a local ollama (the model is loaded once, by `bitnet serve`'s flags): ignored by design
LOAD_OPTIONS = {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep"}
# ...but typed as ollama's Options.FromMap types them ("option \"num_thread\" must be of type integer"): a wrong
# type is a 400 here too, not a 200 that looked as if the value had been taken
LOAD_INT_OPTIONS = {"num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep"}
# options that would change sampling in ways the engine does not do: refused unless left at their "off" value
REFUSED_OPTIONS = {"tfs_z": 1.0}
UNSUPPORTED_ENDPOINTS = {
    "pull": "bitnet serve does not download models: it serves the one it was started with (bitnet serve -m MODEL)",
    "push": "bitnet serve does not push models",
    "create": "bitnet serve does not create models: convert one with `bitnet convert` and serve it with -m",
    "copy": "bitnet serve serves one model under one name (use --alias NAME to rename it)",
    "delete": "bitnet serve does not delete models",
}

BLOBS_WHY = ("/api/blobs: bitnet serve takes no model uploads (ollama create's blobs): convert a model with "
             "`bitnet convert` on the server's machine and serve it")


class OllamaError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _Body(JSONTyped):
    model_config = ConfigDict(extra="ignore")
    _end_ids: list = PrivateAttr(default_factory=list)   # more tokens that end the answer (a middle's: fim.py)
    _compile_ns: int = PrivateAttr(default=0)   # time its format / tools took to compile: in total_duration

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """ollama's Go server reads a null as a field left out ("stream": null streams, its default)."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            data = {k: v for k, v in data.items() if v is not None}
        return data

    model: Optional[str] = None
    stream: bool = True
    options: Optional[dict[str, Any]] = None
    format: Union[StrictBool, str, dict[str, Any], None] = None   # a boolean: JSON Schema's true / false
    keep_alive: Any = None   # checked as a duration (parse_keep_alive); the model stays loaded while the server runs
    think: Union[bool, str, None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    # ollama's context switches: its true (cut the oldest history / slide the context at its end) is not done
    # here, so true is a 400 (refuse_common); false is what this server does anyway
    truncate: Optional[StrictBool] = None
    shift: Optional[StrictBool] = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Optional[str] = ""
    images: Optional[list[Any]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None   # ollama's: [{"function": {"name", "arguments": {...}}}]
    tool_name: Optional[str] = None                      # a tool result: which tool it comes from
    thinking: Optional[str] = None                       # an assistant's earlier thought (the template's to show)


class ShowBody(_Body):
    name: Optional[str] = None   # ollama's older field for /api/show's model (it still takes it)


class ChatBody(_Body):
    messages: Optional[list[_Message]] = None


class GenerateBody(_Body):
    prompt: Optional[str] = None
    system: Optional[str] = None
    raw: bool = False
    context: Optional[list[int]] = None
    suffix: Optional[str] = None
    template: Optional[str] = None
    images: Optional[list[Any]] = None
    width: Optional[int] = None    # ollama's image generation (refused: text only)
    height: Optional[int] = None
    steps: Optional[int] = None


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# set by `bitnet serve --models-dir`'s router (which drops it from its clients' requests): the nanoseconds the
# request waited there for this model's process to load, ollama's load_duration (a single model is loaded before
# the server answers: 0)
LOAD_WAIT_HEADER = "x-bitnet-load-wait-ns"


def load_wait_ns(request) -> int:
    value = request.headers.get(LOAD_WAIT_HEADER, "")
    return min(int(value), 2 ** 63 - 1) if value.isascii() and value.isdigit() else 0


def sampling_from_options(options: dict | None, defaults: SamplingParams | None) -> SamplingParams:
    """SamplingParams of ollama's `options` (a field left out takes the server's default); a bad value raises
    OllamaError naming `options.X` with the engine's rule."""
    base = defaults or SamplingParams()
    values = {}
    for key, value in (options or {}).items():
        if key in REFUSED_OPTIONS:
            if value is not None and not is_off(value, REFUSED_OPTIONS[key]):
                raise OllamaError(400, off_refusal(f"options.{key}", value, REFUSED_OPTIONS[key]))
            continue
        if key not in OPTION_FIELDS and key not in HANDLED_OPTIONS | LOAD_OPTIONS | RETIRED_OPTIONS:
            # a typo (temprature) changed nothing in silence
            raise OllamaError(400, f"options.{key}: not an option (see ollama's Modelfile parameters; "
                                   f"sampling ones here: {', '.join(OPTION_FIELDS[:9])}, ...)")
        if key in LOAD_OPTIONS and value is not None:
            if key in LOAD_INT_OPTIONS:
                option_int(options, key)
            elif not isinstance(value, bool):
                raise OllamaError(400, f"options.{key} {json_text(value)}: must be a boolean")
        if key not in OPTION_FIELDS or value is None:
            continue
        integer = key in INT_OPTIONS
        if integer:
            value = option_int(options, key)
        if key == "seed":   # ollama: -1 is a fresh random seed; another negative one is a seed (the one range)
            try:
                value = request_seed(value, "options.seed")
            except ValueError as e:
                raise OllamaError(400, str(e)) from None
        if key == "top_k" and value < 0:   # ollama's Go sampler: k <= 0 is off
            value = 0
        if key == "repeat_last_n" and value == -1:   # ollama: -1 looks back over the whole context
            value = 1 << 30
        if not integer and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise OllamaError(400, f"options.{key} {json_text(value)}: must be a number")
        problem = setting_problem(key, value, f"options.{key}", json_terms=True)
        if problem:
            raise OllamaError(400, problem)
        values[key] = value
    # the server's defaults for the rest (its --xtc-probability, ...); the penalties count the prompt, as ollama's
    # llama.cpp runner
    return dataclasses.replace(base, penalize_prompt=True, **values)


def option_int(options: dict, key: str, default: int = 0) -> int:
    """An integer option (`default` when not sent): JSON numbers are doubles to ollama's Go server, so 100.0 is
    100; a fraction, a string or a boolean is a 400."""
    value = options.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise OllamaError(400, f"options.{key} {json_text(value)}: must be an integer")
    return value


def option_stops(options: dict) -> list[str]:
    """options.stop: ollama's list of strings (a single string is taken too); anything else is a 400."""
    stop = options.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise OllamaError(400, f"options.stop {json_text(options['stop'])}: must be an array of strings")
    if bad := stops_problem(stop, "options.stop"):   # each is matched at every token, in every stream's step
        raise OllamaError(400, bad)
    return [s for s in stop if s]


def _engine_message(i: int, m: _Message) -> dict:
    """An ollama message as the engine's chat_prompt takes it (OpenAI's shape: tool calls with ids and
    arguments, tool results with the tool's name)."""
    if m.images:
        raise OllamaError(400, f"messages.{i}.images: this model takes text only")
    if m.role not in ("system", "user", "assistant", "tool"):
        raise OllamaError(400, f"messages.{i}.role {json_text(m.role)}: expected system, user, assistant or tool")
    d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise OllamaError(400, f"messages.{i}.tool_calls.{j}: expected {{\"function\": {{\"name\", \"arguments\"}}}}")
            args = fn.get("arguments")
            args = {} if args is None else args
            if isinstance(args, str):   # OpenAI's shape (a JSON text), taken where it holds an object
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            if not isinstance(args, dict):   # ollama's arguments are an object (its Go server's 400 for others):
                # 5, "not json" and [] reached the template as if they were a call's arguments
                raise OllamaError(400, f"messages.{i}.tool_calls.{j}.function.arguments: expected an object")
            calls.append({"id": c.get("id") or f"call_{i}_{j}", "type": "function",
                          "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        if m.role == "assistant":   # another role's calls were never rendered (the engine now refuses them)
            d["tool_calls"] = calls
    if m.role == "tool" and m.tool_name:
        d["name"] = m.tool_name
    if m.role == "assistant" and m.thinking is not None:
        d["reasoning_content"] = m.thinking
    return d


def _param_size(cfg) -> str:
    n = cfg.n_params
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def model_details(cfg, fmt: str = "bnstore") -> dict:
    """ollama's `details` of a model (/api/tags, /api/ps, /api/show) from its config; fmt: its file's format."""
    return {"parent_model": "", "format": fmt, "family": cfg.arch, "families": [cfg.arch],
            "parameter_size": _param_size(cfg), "quantization_level": "ternary (b1.58)"}


def show_answer(*, cfg, name: str, template: str | None, thinks: bool, path: str, n_ctx: int,
                sampling: SamplingParams | None, details: dict, modified_at: str) -> dict:
    """ollama's /api/show answer for a model: cfg its ModelConfig, name its name (general.name), template the chat
    template it renders with (None: the built-in fallback), thinks whether that template thinks, path its file,
    n_ctx the context it is served with, sampling the server's defaults. The one form of a single-model server
    (of its loaded engine) and of a router (of the model's file, unloaded: serve/router.py)."""
    arch = cfg.arch
    # ollama's model_info is the model file's: the context it was trained for; the server's -c is the
    # parameters' num_ctx (and /api/ps' context_length, the loaded one's)
    info = {"general.architecture": arch, "general.name": name, f"{arch}.context_length": cfg.context_length,
            f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.block_count": cfg.n_layers,
            f"{arch}.attention.head_count": cfg.n_heads, f"{arch}.attention.head_count_kv": cfg.n_kv_heads,
            f"{arch}.feed_forward_length": cfg.intermediate_size, "tokenizer.vocab_size": cfg.vocab_size}
    s = sampling or SamplingParams()
    shown = [("temperature", s.temperature), ("top_k", s.top_k), ("top_p", s.top_p), ("min_p", s.min_p),
             ("repeat_penalty", s.repeat_penalty), ("num_ctx", n_ctx)]
    off = SamplingParams()
    shown += [(k, getattr(s, k)) for k in ("typical_p", "mirostat", "mirostat_tau", "mirostat_eta")
              if getattr(s, k) != getattr(off, k)]   # ollama's other options, where the server's flags set them
    params = "\n".join(f"{k:<15}{v}" for k, v in shown)
    return {"modelfile": f"# served by bitnet serve\nFROM {shown_path(path)}\n",
            "parameters": params,
            "template": choose_template(template), "details": details, "model_info": info,
            "capabilities": ["completion", "tools", "embedding", *(["thinking"] if thinks else [])],
            "modified_at": modified_at}


def ready_engine(ready, api_error: type, request):
    """The engine, or the server's refusal (auth, loading, draining) as an ollama-shaped error."""
    try:
        return ready(request)
    except api_error as e:
        raise OllamaError(e.status, e.message) from None


def check_model_name(state, name):
    """ollama's model field: required; under --strict-model-name the served name (or NAME:latest)."""
    if name is not None and not isinstance(name, str):   # as the pydantic routes say it (/api/chat, /api/show)
        raise OllamaError(400, f"model: Input should be a valid string, not {type(name).__name__}")
    if not name:
        raise OllamaError(400, "model is required")
    if state.refuses(name):
        raise OllamaError(404, f"model '{name}' not found (this server has '{state.model_id}')")


async def read_object(request: Request) -> dict:
    """The request body as a JSON object, or ollama's 400 (not JSON, or not an object)."""
    try:
        data = await request.json()
    except NOT_JSON as e:
        raise OllamaError(400, not_json(e)) from None
    if not isinstance(data, dict):
        raise OllamaError(400, "request body must be a JSON object")
    return data


def answered(eng, tokens: list[int], text: str, final) -> list[int]:
    """The answer's tokens as its text reads: where a stop string cut the text, the tokens of what was shown (ollama's
    `context` is Tokenize(prompt + response): a client feeding it back never conditions on the hidden stop text)."""
    if final.finish_reason == "stop":
        return eng.tokenize(text, add_bos=False, special=False) if text else []
    return tokens


def register(app, state, ready, api_error: type, *, sampling: SamplingParams | None = None, metrics=None,
             model_format: str = "bnstore"):
    """Add ollama's routes to `app` (serve/app.py's create_app). ready(request) -> the engine, or raises the
    server's `api_error` (auth, loading, draining: .status, .message), which these routes answer in ollama's shape.
    model_format: details.format, of the file the server was given (cli/serve.py given_format)."""

    @app.exception_handler(OllamaError)
    async def _ollama_error(request, e: OllamaError):
        # a 503 (queue full, loading, shutting down) says when to retry, as every other route's does
        headers = {"Retry-After": str(state.retry_after)} if e.status == 503 else None
        return JSONResponse({"error": e.message}, status_code=e.status, headers=headers)

    def engine(request: Request):
        return ready_engine(ready, api_error, request)

    def check_model(name):
        check_model_name(state, name)

    async def parse(request: Request, cls):
        data = await read_object(request)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = main_error(e.errors())
            where = error_where(err) or "body"
            raise OllamaError(400, f"{where}: {error_message(err)}") from None

    async def refuse_too_long(eng, n_chars: int):
        """More characters than the context could hold: a 400 before the template or tokenizer sees them."""
        msg = await too_long_for_context(eng, n_chars)
        if msg:
            raise OllamaError(400, msg)

    def refuse_common(body: _Body, eng):
        sampling_from_options(body.options, sampling)   # a bad option is a 400 even on an empty (load) request
        if body.tools is not None and not isinstance(body, ChatBody):
            raise OllamaError(400, "tools: only /api/chat takes tools")
        if body.think not in (None, False) and not (body.think is True and eng.thinks):
            raise OllamaError(400, f"\"{state.model_id}\" does not support thinking" if not eng.thinks else
                              f"think {json_text(body.think)}"
                              ": this model thinks or not (true / false); levels are gpt-oss's")
        if body.keep_alive is not None:   # the model stays loaded here, but a malformed value is ollama's 400
            try:
                parse_keep_alive(body.keep_alive)
            except ValueError as e:
                raise OllamaError(400, str(e)) from None
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise OllamaError(400, f"top_logprobs {body.top_logprobs}: must be in 0..20")
        if body.top_logprobs and not body.logprobs:   # dropped in silence; the OpenAI routes' 400 too
            raise OllamaError(400, f"top_logprobs {body.top_logprobs} needs logprobs: true")
        if body.truncate:   # both were dropped in silence: a client asking for them got something else
            raise OllamaError(400, "truncate: true is not supported here: a prompt over the context is a 400, its "
                                   "history is never cut (send false, or leave it out)")
        if body.shift:
            raise OllamaError(400, "shift: true is not supported here: an answer ends at the context's end "
                                   "(done_reason \"length\"), the context never slides (send false, or leave it out)")

    async def generation_request(request: Request, cls):
        """The engine, and the body parsed and checked (model name, options, what this model cannot do)."""
        eng = engine(request)
        body = await parse(request, cls)
        check_model(body.model)
        refuse_common(body, eng)
        return eng, body

    def think_kwargs(eng, body: _Body):
        """A thinking template's variables: think true / false turn its thinking on / off (Qwen3's enable_thinking)."""
        return {"enable_thinking": bool(body.think)} if eng.thinks and body.think is not None else None

    def think_splitter(eng, body: _Body, prompt_ids, free_start: bool):
        """Where a thinking model's <think> block goes (`thinking`), unless think is false; free_start False: a
        `format` decides how the answer starts (engine api's think_splitter). think true with such a format is a
        400: the format is the answer from its first token, with no room for the thought asked for
        (docs/structured-output.md; it was answered without one, in silence)."""
        if body.think is True and not free_start:
            raise OllamaError(400, "think: true with format: the format decides the answer from its first token and "
                                   "leaves no room for a thought here; send think false, or leave think out")
        return eng.think_splitter(prompt_ids, free_start) if body.think is not False else None

    async def constraint_of(eng, body: _Body, tool_spec=None):
        """The request's format (with its tools' grammar) compiled; the time it took goes into body._compile_ns
        (ollama's total_duration counts it: a new schema's compile was left out of it)."""
        t0 = time.perf_counter()
        try:
            return await _constraint_of(eng, body, tool_spec)
        finally:
            body._compile_ns = _ns(time.perf_counter() - t0)

    async def _constraint_of(eng, body: _Body, tool_spec=None):
        from ..engine.errors import ConstraintError, GrammarBusyError
        from ..engine.runtime.constraints import Constraint
        fmt = body.format
        if fmt in (None, ""):
            try:
                return None if tool_spec is None else await asyncio.to_thread(eng.compile_constraint, tool_spec)
            except GrammarBusyError as e:
                raise OllamaError(503, str(e)) from None
            except ConstraintError as e:
                raise OllamaError(400, str(e)) from None
        try:
            if fmt == "json":
                spec = Constraint.json_object(where="format")
            elif isinstance(fmt, (dict, bool)):
                spec = Constraint.json_schema(fmt, where="format")
            else:
                raise OllamaError(400, f"format {json_text(fmt)}: expected \"json\" or a JSON Schema object")
            if tool_spec is not None:   # the model calls tools, or answers in the format
                from ..engine.runtime.tools import with_answer_format
                spec = with_answer_format(tool_spec, spec)
            return await asyncio.to_thread(eng.compile_constraint, spec)
        except GrammarBusyError as e:   # not the request's fault: to retry
            raise OllamaError(503, str(e)) from None
        except ConstraintError as e:
            raise OllamaError(400, str(e)) from None

    def sampling_of(body: _Body) -> SamplingParams:
        params = sampling_from_options(body.options or {}, sampling)
        if body.logprobs:
            params.record_logprobs = body.top_logprobs or 0
        return params

    def submit(eng, body: _Body, prompt_ids, constraint, loop, params: SamplingParams):
        from ..engine.errors import BitNetError, ContextOverflowError, ModelChangedError, QueueFullError
        opts = body.options or {}
        n_ctx = eng.n_ctx
        num_ctx = option_int(opts, "num_ctx")
        if 0 < num_ctx and len(prompt_ids) <= num_ctx:   # the server's context is fixed at start: a larger one
            n_ctx = min(n_ctx, num_ctx)                    # is capped; a prompt that fits num_ctx (one as long
            # as it too: one token, as the server's own context) runs in it; a prompt longer than num_ctx runs in the
            # server's (ollama would cut the prompt to fit)
        room = max(0, n_ctx - len(prompt_ids)) + 1   # the last token needs no place in the cache
        num_predict = option_int(opts, "num_predict")
        max_tokens = room if num_predict <= 0 else min(num_predict, room)   # ollama: 0 or less, no limit
        stop = option_stops(opts)
        q: asyncio.Queue = asyncio.Queue()
        try:
            stream = eng.submit(prompt_ids, params, max_tokens=max_tokens, stop=stop, constraint=constraint,
                                callback=lambda ch: loop.call_soon_threadsafe(q.put_nowait, ch),
                                **({"end_ids": body._end_ids} if body._end_ids else {}))
        except QueueFullError as e:
            if metrics is not None:
                metrics.rejected.inc()
            raise OllamaError(503, str(e)) from None
        except ContextOverflowError as e:
            raise OllamaError(400, overflow_message(e, "prompt" if isinstance(body, GenerateBody) else "messages")) \
                from None
        except ModelChangedError:   # the server's error (500 model_changed, and it stops), not the client's
            raise
        except BitNetError as e:
            raise OllamaError(400, str(e)) from None
        state.streams.add(stream)
        if metrics is not None:
            metrics.prompt_tokens.inc(len(prompt_ids))
        return stream, q

    def final_fields(clock, final, load_ns: int = 0, compile_ns: int = 0):
        """load_ns: how long the request waited for its model's load (the router's, load_wait_ns): ollama counts
        it in load_duration and total_duration; compile_ns: its format's compile, in total_duration."""
        st, t0, t_first = final.stats, clock.t0, clock.first
        now = time.perf_counter()
        clock.settle(st.n_generated)
        if metrics is not None:
            metrics.e2e.observe(now - t0)
        return {"done": True, "done_reason": DONE.get(final.finish_reason, "stop"),
                "total_duration": _ns(now - t0) + load_ns + compile_ns, "load_duration": load_ns,
                "prompt_eval_count": st.n_prompt, "prompt_eval_duration": _ns((t_first or now) - t0),
                "eval_count": st.n_generated, "eval_duration": _ns(now - (t_first or now))}

    async def answer(request, body: _Body, eng, prompt_ids, constraint, piece, extra_final=None, parser=None,
                     splitter=None):
        """Run one request and answer it: NDJSON lines of piece(text, calls, thinking) + {"done": false}, then the
        final object; or (stream false) one object with the whole text. parser: the tool-call parser (text that
        may be a call is held back; each call goes out once complete, as ollama streams them); splitter: a
        thinking model's ThinkSplitter (its <think> block goes to `thinking`)."""

        def parsed(text, end=None):
            """(thinking, text, calls) of the next text; end (the finish reason) also flushes what was held."""
            thinking = ""
            if splitter is not None:
                thinking, text = splitter.feed(text)
                if end is not None:
                    more, rest = splitter.finish()
                    thinking, text = thinking + more, text + rest
            calls = []
            if parser is not None:
                text, calls = parser.feed(text) if text else ("", [])
                if end is not None:
                    rest, more = parser.finish(DONE.get(end) == "length")
                    text, calls = text + rest, calls + more
            return thinking, text, calls
        loop = asyncio.get_running_loop()
        params = sampling_of(body)
        if splitter is None:   # the server's --reasoning-budget is for a thinking template's chats (as llama-server)
            params = dataclasses.replace(params, reasoning_budget=-1)
        await prepare_sampling(eng, params)   # off the loop: DRY's breaker table scans the vocabulary
        stream, q = submit(eng, body, prompt_ids, constraint, loop, params)
        clock, model = TokenClock(metrics), state.model_id
        load_ns = load_wait_ns(request)
        text_of = state.token_text(eng)
        n_top = body.top_logprobs or 0

        def lp_list(items):
            return [chat_entry(text_of, t, lp, n_top) for t, lp in items] if body.logprobs else None

        if body.stream:
            async def lines():
                final, tokens, said, sent, shown = None, [], Said(), 0, []
                try:
                    while True:
                        ch = await q.get()
                        if ch.token is not None:
                            clock.token()
                            tokens.append(ch.token)
                        said.add(ch)
                        shown.append(ch.text)
                        bad = unanswered(ch.finish_reason, state.retry_after, None, request.url.path, stream.id)
                        if bad is not None:   # this request's sequence failed (the others go on), or never started
                            final = ch
                            yield json.dumps({"error": bad.message}) + "\n"
                            return
                        thinking, text, calls = parsed(ch.text or "", ch.finish_reason)
                        if text or calls or thinking:
                            obj = {"model": model, "created_at": utc_iso(), **piece(text, calls, thinking),
                                   "done": False}
                            if body.logprobs:
                                obj["logprobs"] = lp_list(said.items[sent:])
                                sent = len(said.items)
                            yield json.dumps(obj, ensure_ascii=False) + "\n"
                        if ch.finish_reason is not None:
                            final = ch
                            break
                    obj = {"model": model, "created_at": utc_iso(), **piece(""),
                           **final_fields(clock, final, load_ns, body._compile_ns)}
                    if body.logprobs and said.items[sent:]:   # tokens of no text of their own, said at the end
                        obj["logprobs"] = lp_list(said.items[sent:])
                    if extra_final:
                        obj.update(extra_final(answered(eng, tokens, "".join(shown), final)))
                    if getattr(stream, "ended_now", False):   # done_reason "stop", but cut short by a stopping
                        obj["cut_by"] = "shutdown"            # server's drain: a client can tell (as OpenAI's SSE)
                    yield json.dumps(obj, ensure_ascii=False) + "\n"
                finally:
                    if final is None:
                        stream.cancel()
                    state.streams.discard(stream)
            return Streamed(lines(), media_type="application/x-ndjson")
        pieces, tokens, said, final = [], [], Said(), None
        try:
            while final is None:
                ch = await next_or_gone(q, request)
                if ch is None:
                    return JSONResponse({"error": "client disconnected"}, status_code=499)
                if ch.token is not None:
                    clock.token()
                    tokens.append(ch.token)
                said.add(ch)
                pieces.append(ch.text)
                if ch.finish_reason is not None:
                    final = ch
        finally:
            if final is None:
                stream.cancel()
            state.streams.discard(stream)
        bad = unanswered(final.finish_reason, state.retry_after, None, request.url.path, stream.id)
        if bad is not None:   # this request's sequence failed (the others go on), or never started
            return JSONResponse({"error": bad.message}, status_code=bad.status, headers=bad.headers)
        thinking, text, calls = parsed("".join(pieces), final.finish_reason)
        obj = {"model": model, "created_at": utc_iso(), **piece(text, calls, thinking),
               **final_fields(clock, final, load_ns, body._compile_ns)}
        if body.logprobs:
            obj["logprobs"] = lp_list(said.items)
        if extra_final:
            obj.update(extra_final(answered(eng, tokens, "".join(pieces), final)))
        return obj

    def loaded(body: _Body, piece):
        """ollama's answer to an empty request: the model is loaded (done_reason "load")."""
        return {"model": state.model_id, "created_at": utc_iso(), **piece(""), "done": True, "done_reason": "load"}

    @app.post("/api/chat")
    async def api_chat(request: Request):
        eng, body = await generation_request(request, ChatBody)

        def piece(text, calls=(), thinking=""):
            message = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
            whole = []
            for c in calls:   # ollama's shape: arguments as an object, no call ids
                try:
                    whole.append({"function": {"name": c["function"]["name"],
                                               "arguments": json.loads(c["function"]["arguments"])}})
                except ValueError:   # a call cut by num_predict has no arguments object: left out (done_reason length)
                    pass
            if whole:
                message["tool_calls"] = whole
            return {"message": message}
        if not body.messages:
            return loaded(body, piece)
        msgs = [_engine_message(i, m) for i, m in enumerate(body.messages)]
        prefill = ""
        if msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls"):
            prefill = msgs.pop()["content"] or ""   # ollama continues a final assistant message (its templates
            #                                          leave it open); the answer is the continuation
        tools, tool_spec, parser = None, None, None
        if body.tools:   # ollama has no tool_choice: the model chooses ("auto"), a call once begun is valid
            from ..engine.errors import ConstraintError
            from ..engine.runtime.tools import functions_from_tools
            fmt = eng.tool_format()
            try:
                functions = functions_from_tools(body.tools)
                tool_spec = fmt.constraint(functions, "auto", True)
            except ConstraintError as e:
                raise OllamaError(400, str(e)) from None
            tools, parser = body.tools, fmt.parser()
        await refuse_too_long(eng, sum(len(m["content"] or "") for m in msgs) + len(prefill))
        try:
            prompt_ids = await run_off_loop(eng.chat_prompt, msgs, tools=tools, prefill=prefill,
                                            template_kwargs=think_kwargs(eng, body), results_in_order=True,
                                            continue_final_message=False)   # continued above, as ollama does
        except Exception as e:   # the template rejected the conversation (e.g. roles out of order)
            raise OllamaError(400, f"messages: {e}") from None
        thought = eng.answer_thought(prompt_ids) if tool_spec is not None and not prefill and body.think is not False \
            else None   # a thought split off the answer may name calls: the grammar knows where it stands
        if thought is not None:
            tool_spec = fmt.constraint(functions, "auto", True, thought, checked=True)
        constraint = await constraint_of(eng, body, tool_spec)
        # tools (ollama's are "auto") leave the start free; a grammar may go on with the prompt's thought
        free = constraint is None or constraint.spec.free_start or await run_off_loop(eng.thought_may_open,
                                                                                       constraint)
        return await answer(request, body, eng, prompt_ids, constraint, piece, parser=parser,
                            splitter=think_splitter(eng, body, prompt_ids, free) if not prefill else None)

    @app.post("/api/generate")
    async def api_generate(request: Request):
        eng, body = await generation_request(request, GenerateBody)
        if body.images:
            raise OllamaError(400, "images: this model takes text only")
        for name in ("width", "height", "steps"):
            if getattr(body, name) is not None:
                raise OllamaError(400, f"{name}: image generation is not supported (this model writes text)")
        fim = None
        if body.suffix:   # fill-in-the-middle: prompt is the text before the gap (ollama's template .Suffix)
            why = suffix_refusal(eng)
            if why is not None:
                raise OllamaError(400, why)
            fim = fim_tokens(eng.tokenizer)
            body._end_ids = fim_ends(eng, fim)
        if body.template:
            raise OllamaError(400, "template: the model's own chat template is used (a Go template cannot be)")

        def piece(text, calls=(), thinking=""):
            return {"response": text, **({"thinking": thinking} if thinking else {})}
        if not body.prompt and not body.context and fim is None:
            return loaded(body, piece)
        vocab = eng.config.vocab_size
        context = [int(t) for t in body.context or []]
        if any(not 0 <= t < vocab for t in context):
            raise OllamaError(400, f"context: token ids must be in 0..{vocab - 1}")
        if fim is None:   # (the text around a gap is cut to fit, not refused)
            await refuse_too_long(eng, len(body.prompt or "") + (0 if body.raw else len(body.system or "")))
        if fim is not None:   # no template, no system prompt (ollama's FIM templates have neither)
            limit = option_int(body.options or {}, "num_predict")
            prefix, suffix = cut_to(body.prompt or "", body.suffix, await chars_bound(eng))
            ids = await run_off_loop(infill_ids, eng, fim, prefix, suffix, (), (), limit if limit > 0 else None)
            bos = eng.tokenizer.bos_id
            if context and bos is not None and ids[:1] == [bos]:
                ids = ids[1:]
        elif body.raw:
            ids = await run_off_loop(eng.tokenize, body.prompt or "", add_bos=not context)
        else:
            msgs = ([{"role": "system", "content": body.system}] if body.system else []) + \
                   [{"role": "user", "content": body.prompt or ""}]
            try:
                ids = await run_off_loop(eng.chat_prompt, msgs, template_kwargs=think_kwargs(eng, body))
            except Exception as e:   # the template rejected the request
                raise OllamaError(400, f"prompt: {e}") from None
            bos = eng.tokenizer.bos_id
            if context and bos is not None and ids[:1] == [bos]:
                ids = ids[1:]   # the context holds the conversation's BOS already (ollama's: one, first)
        prompt_ids = context + ids
        constraint = await constraint_of(eng, body)
        return await answer(request, body, eng, prompt_ids, constraint, piece,
                            extra_final=lambda tokens: {"context": prompt_ids + tokens},
                            splitter=None if body.raw or fim is not None else
                            think_splitter(eng, body, prompt_ids, constraint is None))

    def describe(eng) -> dict:
        path = eng.store.path
        opened = getattr(eng.store, "opened", None)
        if opened is not None:   # the file loaded, not what the path holds now (a store renamed over it is not served)
            size, mtime = opened
        else:
            try:
                st = os.stat(path)
                size, mtime = st.st_size, st.st_mtime
            except OSError:
                size, mtime = 0, time.time()
        cfg = eng.config
        # of the file's path, size and time, not its content (gigabytes, read at each listing): it changes with the
        # file, but two copies differ (docs/serving.md)
        digest = hashlib.sha256(os.fsencode(os.path.abspath(path)) + f":{size}:{mtime}".encode()).hexdigest()
        details = model_details(cfg, model_format)
        modified = utc_iso(mtime)
        listed = tagged_name(state.model_id)   # as ollama lists a name: its clients match it with the tag
        return {"name": listed, "model": listed, "modified_at": modified, "size": size,
                "digest": digest, "details": details}

    @app.get("/api/tags")
    async def api_tags(request: Request):
        return {"models": [describe(engine(request))]}

    @app.get("/api/ps")
    async def api_ps(request: Request):
        eng = engine(request)
        d = describe(eng)
        return {"models": [{**{k: d[k] for k in ("name", "model", "size", "digest", "details")},
                            "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0, "context_length": eng.n_ctx}]}

    @app.post("/api/show")
    async def api_show(request: Request):
        eng = engine(request)
        data = await parse(request, ShowBody)
        check_model(data.model or data.name)
        d = describe(eng)
        return show_answer(cfg=eng.config, name=eng.name, template=eng.chat_template, thinks=eng.thinks,
                           path=eng.store.path, n_ctx=eng.n_ctx, sampling=sampling, details=d["details"],
                           modified_at=d["modified_at"])

    @app.get("/api/version")
    async def api_version():
        return {"version": OLLAMA_VERSION}

    def unsupported(name: str, why: str):
        async def handler(request: Request):
            raise OllamaError(501, why)
        handler.__name__ = f"api_{name}"
        # answered (ollama's clients get the reason), but no operation of this API: /openapi.json does not list it
        app.add_api_route(f"/api/{name}", handler, methods=["POST", "DELETE"] if name == "delete" else ["POST"],
                          include_in_schema=False)

    for name, why in UNSUPPORTED_ENDPOINTS.items():
        unsupported(name, why)

    async def api_blobs(request: Request, digest: str):
        # `ollama create` uploads its GGUF here before /api/create: a bare 404 "Not Found" hid create's reason
        raise OllamaError(501, BLOBS_WHY)
    app.add_api_route("/api/blobs/{digest}", api_blobs, methods=["HEAD", "POST"], include_in_schema=False)
