"""The HTTP server: an ASGI app (FastAPI) over a batching engine (engine.api.load_engine). OpenAI's chat and
completions endpoints are here; OpenAI's Responses API and Anthropic's Messages API run the same chat pipeline
(start_chat) through their adapters' translation and builders (serve/responses.py, serve/anthropic.py: answer_with);
ollama's API, llama-server's own endpoints and the embeddings register their routes from their modules.

`create_app(load)` returns the app; `load()` builds the engine in a background thread at startup, so
`/health` answers 503 while the model loads. The handlers only translate HTTP <-> `engine.submit`: each
request gets an asyncio queue that the engine's scheduler thread feeds via `call_soon_threadsafe`; a client
that goes away cancels its stream (its KV pages are freed at the next engine step). Nothing here knows of
kernels. The same app runs under uvicorn (`bitnet serve`) and as a Ray Serve deployment (ray_app.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic import CountTokensRequest, MessageBuilder, MessagesRequest, anthropic_names
from .auth import AuthMiddleware, KeyChecker, allow_cross_origin
from .limits import (LLAMA_SERVER_COMPLETION, Limits, LimitsMiddleware, RouteNorms, allow_header, allowed_methods,
                     anthropic_error_body, anthropic_shaped, anthropic_status, llama_overflow, refuses_method)
from .logprobs import Said, ShownRecords, TextOffsets, TokenText, chat_entry, completion_logprobs, echo_logprobs
from .metrics import CONTENT_TYPE, ServerMetrics, TokenClock
from .offload import (BodyRefused, ClientGone, Streamed, chars_bound, next_or_gone, offloop_route,
                      prepare_sampling, prompt_body_bound, run_off_loop, too_long_for_context, unless_gone, warm_bounds)
from .responses import STORED_RESPONSE_ROUTES, ResponseBuilder, ResponsesRequest, not_stored, responses_names
from .fim import INFILL_FIELDS, cut_to, field_refusal, fim_ends, fim_tokens, infill_ids, suffix_refusal
from .fim import off as fim_off
from .llama_api import LORA_WHY, NOT_SERVED, READ_ONLY, lora_request_is_empty
from .llama_api import timings_of as llama_timings
from .schemas import (ChatCompletionRequest, CompletionRequest, NamedTool, RequestProblem, continuation, cut_short,
                      error_message, error_where, json_text, main_error, model_object, name_key, overflow_message,
                      unanswered)

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
UNSTARTED = "unavailable"   # the finish reason of a request a stopping server ended before it had a slot
PAGE = os.path.join(os.path.dirname(__file__), "chat.html")
# the endpoints whose body is bounded by the context (serve/offload.py prompt_body_bound), and their prompt field
PROMPT_FIELD = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input",
                "/v1/messages": "messages", "/completion": "prompt", "/completions": "prompt", "/api/chat": "messages",
                "/api/generate": "prompt", "/v1/responses/input_tokens": "input",
                "/v1/chat/completions/input_tokens": "messages", "/chat/completions": "messages",
                "/responses": "input"}


def page_response(webui: bool) -> Response:
    """GET / : the chat page, or (bitnet serve --no-webui, llama-server's flag) ollama's plain "is running" line,
    which still answers the ollama CLI's HEAD / heartbeat."""
    if not webui:
        return PlainTextResponse("bitnet serve is running")
    with open(PAGE, encoding="utf-8") as f:
        return HTMLResponse(f.read())


def import_for_requests():
    """What requests import lazily, imported once the model has loaded: a first request that imports it when the
    process is out of file descriptors (ulimit -n, many clients) failed with "Too many open files" on a module."""
    import importlib
    # every sampler's generator, a template's string escapes, requests with tools, what a template that raises
    # imports (jinja2 is optional: a store without a chat template), anyio's backend (a streaming answer's first)
    for name in ("numpy.random", "encodings.unicode_escape", "..engine.runtime.tools", "jinja2.debug",
                 "anyio._backends._asyncio"):
        try:
            importlib.import_module(name, __package__)
        except ImportError:
            pass


def out_of_resources(e: BaseException) -> bool:
    """The process ran out of file descriptors or memory: the server's state, not the request's fault."""
    return isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS)


RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers
        self.extra = extra   # more fields of the error object (llama-server's n_prompt_tokens / n_ctx)


def error_response(status, message, type_="invalid_request_error", param=None, code=None, headers=None, extra=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code, **(extra or {})}},
                        status_code=status, headers=headers)


def overflow_fields(e) -> dict | None:
    """llama-server's fields of a context-exceeded error (its web UI reads them), where the counts are known."""
    n, ctx = getattr(e, "n_prompt_tokens", None), getattr(e, "n_ctx", None)
    return {"n_prompt_tokens": n, "n_ctx": ctx} if n is not None and ctx is not None else None


class ServerState:
    """The engine once loaded, the in-flight streams (for drain), and the server's settings."""

    def __init__(self, load: Callable[[], Any], api_key: str | None, model_id: str | None, retry_after: int,
                 strict_model: bool = False, sampling=None):
        self.load, self.api_key, self.model_id, self.retry_after = load, api_key, model_id, retry_after
        self.strict_model = strict_model   # False: any `model` is answered by the loaded one (llama-server's way)
        self._token_text = None
        self.engine = None
        self.load_error: str | None = None
        self.draining = False
        self.closed = False
        self._closing = threading.Lock()   # a load that ends after close() closes its engine (never kept mapped)
        self.streams: set = set()
        self.created = int(time.time())
        self.sampling = sampling           # the requests' default SamplingParams (create_app's sampling)
        self.on_load_error: Callable[[BaseException], None] | None = None   # create_app's
        self.model_changed = False   # the model file was found rewritten under the loaded model: the server stops

    def refuses(self, name) -> bool:
        """Whether a request naming `name` gets a 404: only under --strict-model-name, for a name other than the
        served id, as the router matches one: case and Unicode normalisation aside, and ":latest" on neither side
        (ollama's NAME and NAME:latest are one model, so `--alias m:latest` answers `m` too). Every route asks this,
        so they agree."""
        if not (self.strict_model and name):
            return False
        return not isinstance(name, str) or name_key(name) != name_key(self.model_id or "")

    def token_text(self, eng) -> TokenText:
        """The server's one token -> (text, bytes) cache for logprobs."""
        if self._token_text is None:
            self._token_text = TokenText(eng.tokenizer)
        return self._token_text

    def engine_metrics(self):
        return self.engine.metrics() if self.engine is not None else None

    def start_loading(self):
        def run():
            try:
                eng = self.load()
                if hasattr(eng, "warm_constraints"):
                    eng.warm_constraints()   # structured output's first request need not build the vocabulary view
                if self.sampling is not None:
                    eng.prepare_sampling(self.sampling)   # the server's defaults: DRY's breaker table, if on
                warm_bounds(eng)             # the prompt bounds need the tokenizer's longest token
                import_for_requests()
                with self._closing:
                    if not self.closed:
                        if self.model_id is None:
                            self.model_id = eng.name
                        self.engine = eng
                        return
                eng.close()   # the app shut down while this loaded: nobody will close it later
            except BaseException as e:  # reported by /health (503 load_failed), and to on_load_error
                self.load_error = str(e) or type(e).__name__
                if self.on_load_error is not None:
                    self.on_load_error(e)
        t = threading.Thread(target=run, name="bitnet-load", daemon=True)
        t.start()
        return t

    def drain(self):
        """Stop admitting and end what is in flight now (finish_reason 'stop'): each stream's final chunk is given
        from here, not at the engine's next step, which a long prefill makes seconds away (uvicorn then cancelled
        the handlers: a bare 500, streams cut without their last event). One still waiting for a slot ends
        'unavailable' (a 503 to retry: an empty 'stop' looked like a model that said nothing)."""
        self.draining = True
        streams = list(self.streams)
        ending = [s for s in streams if hasattr(s, "end_now")]
        if ending:
            self.engine.end_now(ending, "stop", UNSTARTED)
        for s in streams:
            if not hasattr(s, "end_now"):
                s.cancel()   # an embedding request: one step, its own end

    def close(self):
        with self._closing:
            self.closed = True
        self.drain()
        if self.engine is not None:
            self.engine.close()


class CountingMiddleware:
    """Counts each answered request by path and status (bitnet_http_requests) and names the process that
    answered (X-Bitnet-Instance: load balancers, Ray replicas). Pure ASGI: Starlette's @app.middleware("http")
    wraps `receive`, and behind it request.is_disconnected() never saw a client hang up, so a non-streaming
    request ran to its end for nobody."""

    def __init__(self, app, metrics, routes=()):
        self.app, self.metrics, self.routes = app, metrics, routes
        self.instance = f"{socket.gethostname()}:{os.getpid()}".encode()

    def _route_of(self, scope) -> str | None:
        """The path of the route that takes this request, for one answered before routing (a 413, a 401): it was
        counted as "other" though a route takes it."""
        from starlette.routing import Match
        for r in self.routes:
            if hasattr(r, "path") and r.matches(scope)[0] != Match.NONE:
                return r.path
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_counted(msg):
            if msg["type"] == "http.response.start":
                msg = dict(msg, headers=[*msg.get("headers", ()), (b"x-bitnet-instance", self.instance)])
                # every request, by route (/v1/models/{model_name}, /slots/{id_slot}): a path no route takes is
                # "other", so a client cannot grow the series without bound (one per URL it makes up, before any
                # key is checked); a list of paths to count left served ones out (/models, /openapi.json, /)
                route = getattr(scope.get("route"), "path", None) or self._route_of(scope)
                self.metrics.requests.labels(route or "other", str(msg["status"])).inc()
            await send(msg)
        await self.app(scope, receive, send_counted)


def create_app(load: Callable[[], Any], *, api_key: str | None = None, model_id: str | None = None,
               retry_after: int = 1, on_shutdown: Callable[[], None] | None = None,
               sampling: Any = None, strict_model: bool = False, limits: Limits | None = None,
               api_keys: tuple = (), metrics_public: bool = False, cors_origins: tuple = (),
               on_load_error: Callable[[BaseException], None] | None = None,
               reasoning_format: str = "auto", local_only: bool = False, wait_load: bool = False,
               webui: bool = True, model_format: str = "bnstore") -> FastAPI:
    """The ASGI app. load() -> an engine with ENGINE_API.md's interface (called once, in a thread).
    sampling: SamplingParams whose values a request's omitted sampling fields take (None: the engine's).
    model_id: the id the server answers with (None: the model's name; `--alias`); strict_model: a request
    naming another model gets a 404 (default: it is answered by this one, as llama-server does).
    limits: serve/limits.py's (None: its defaults); api_key / api_keys: the keys every endpoint but /health
    needs (serve/auth.py), /metrics too unless metrics_public; cors_origins: the origins whose pages may call it
    beside this machine's (serve/auth.py allow_cross_origin; "*": any); local_only: it listens on loopback only
    (requests whose Host is not this machine are refused: DNS rebinding). on_load_error(e): called (in the loading
    thread) when load() raised -- `bitnet serve` then says so and exits; without it the server answers 503 -- and
    when the loaded model's file is found rewritten in place (ModelChangedError: every request answers 500).
    reasoning_format: where a chat's <think> block goes when the request does not say (llama-server's
    --reasoning-format: auto / deepseek: reasoning_content, none: left in content, deepseek-legacy: streamed,
    left in content with its tags, else as deepseek). wait_load: the lifespan's startup returns once the load
    ended (Ray Serve sends a replica requests once its startup returned: they were answered 503 "model is
    loading" meanwhile); else at once, the model loading behind /health's 503. model_format: ollama's
    details.format, of the file the server was given (cli/serve.py given_format: "gguf" for -m x.gguf, as a
    router lists that file), not of the conversion it loads."""
    state = ServerState(load, api_key, model_id, retry_after, strict_model, sampling)
    state.on_load_error = on_load_error
    metrics = ServerMetrics(state.engine_metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loading = state.start_loading()
        if wait_load:
            await asyncio.to_thread(loading.join)
        yield
        await asyncio.to_thread(state.close)   # joins the engine's thread, which may be in a step: off the loop
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="bitnet serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    # JSON bodies parsed off the event loop and bounded by the context (serve/offload.py)
    app.router.route_class = offloop_route(lambda: state.engine.n_ctx if state.engine is not None else None)
    app.state.bitnet = state
    app.state.metrics = metrics

    def prompt_bound(path: str):
        """(bytes, field) a body to a generating endpoint may have (serve/offload.py), or None."""
        param = PROMPT_FIELD.get(path)
        if param is None or state.engine is None:
            return None
        bound = prompt_body_bound(state.engine)
        return None if bound is None else (bound, param)
    # the last added runs first: request counting (below), then keys (before any body is read), then limits
    app.add_middleware(LimitsMiddleware, limits=limits or Limits(), prompt_bound=prompt_bound)
    app.add_middleware(AuthMiddleware, checker=KeyChecker(([api_key] if api_key else []) + list(api_keys)),
                       metrics_public=metrics_public)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return in_family(request, error_response(e.status, e.message, e.type, e.param, e.code, e.headers, e.extra))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        return in_family(request, validation_response(e))

    def in_family(request, resp):
        """ollama's routes (/api/) answer errors as {"error": "message"}, Anthropic's (serve/limits.py
        anthropic_shaped) as {"type": "error", "error": {"type", "message"}} with its status (529 overloaded); the
        rest in OpenAI's shape."""
        status = resp.status_code
        if request.url.path.startswith("/api/"):
            body = {"error": json.loads(resp.body)["error"]["message"]}
        elif anthropic_shaped(request.scope):
            status = anthropic_status(status)
            body = anthropic_error_body(status, json.loads(resp.body)["error"]["message"])
        elif request.url.path in LLAMA_SERVER_COMPLETION:   # a context overflow there: in llama-server's words
            body = {"error": llama_overflow(request.url.path, json.loads(resp.body)["error"])}
        else:
            return resp
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(body, status_code=status, headers=headers)

    def validation_response(e: RequestValidationError):
        err = main_error(e.errors())
        param = error_where(err)
        if err.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", code="invalid_json")
        if param is None:
            return error_response(400, "request body must be a JSON object", code="invalid_json")
        msg = error_message(err)
        if err.get("type") != "invalid_setting":   # a sampling setting's message names it already
            msg = f"{param or 'body'}: {msg}"
        return error_response(400, msg, param=param,
                              code="invalid_value")

    @app.exception_handler(BodyRefused)
    async def _refused(request, e: BodyRefused):
        return in_family(request, error_response(400, str(e.detail), param=e.param, code=e.code, extra=e.extra))

    @app.exception_handler(OSError)
    @app.exception_handler(MemoryError)
    async def _out_of_resources(request, e: Exception):
        """Out of file descriptors or memory under load: a 503 in the API's shape and one log line, not a 500 in
        plain text with a traceback; any other OSError is a bug and goes on as one."""
        if not out_of_resources(e):
            raise e
        why = "out of memory" if isinstance(e, MemoryError) else os.strerror(e.errno).lower()
        print(f"bitnet serve: {request.method} {request.url.path}: {why} ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)
        return in_family(request, error_response(503, f"the server is out of resources ({why}); retry later",
                                                 "server_error", code="out_of_resources",
                                                 headers={"Retry-After": str(state.retry_after)}))

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        """An exception nothing above maps (a bug): a JSON 500 server_error in the API's shape, its traceback still
        in the log. Starlette's was a plain-text 500, which is what Ray's own failures look like: Ray's front made
        it a 503 "the replica stopped" with Retry-After, and clients retried a bug at once."""
        return in_family(request, error_response(500, f"internal server error ({type(e).__name__}); see the "
                                                      "server's log", "server_error", code="server_error"))

    from ..engine.errors import ModelChangedError

    @app.exception_handler(ModelChangedError)
    async def _changed(request, e: ModelChangedError):
        """The model file found rewritten after the request's own check (the engine's, as it was submitted: a
        format's compile or the body's tokenizing came between): the server's model_changed, on every route."""
        bad = changed_error(e)
        return in_family(request, error_response(bad.status, bad.message, bad.type, code=bad.code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # its headers too: a 405's Allow (RFC 9110 15.5.6: it MUST be there), every method its path takes
        headers = e.headers
        if e.status_code == 405:
            headers = {**(e.headers or {}), "Allow": allow_header(allowed_methods(app.router.routes, request.scope))}
        return in_family(request, error_response(e.status_code, str(e.detail), type_, headers=headers))

    app.add_middleware(RouteNorms)
    app.add_middleware(CountingMiddleware, metrics=metrics, routes=app.router.routes)
    allow_cross_origin(app, cors_origins, local_only, keyed=bool(api_key or api_keys))   # outermost: a preflight
    # is answered before the key check

    def unavailable() -> APIError | None:
        """Why the model cannot answer now (None: it can): one error for /health and every route that needs the
        model, as llama-server answers every route while it loads (503 "unavailable_error", Retry-After); a model
        that failed to load is the server's fault, and a retry will not help."""
        if state.load_error:
            return APIError(503, f"model failed to load: {state.load_error}", "server_error", code="load_failed")
        changed = model_changed()
        if changed is not None:
            return changed
        if state.draining or state.engine is None:
            msg, code = ("server is shutting down", "shutting_down") if state.draining else ("loading model", "loading")
            return APIError(503, msg, "unavailable_error", code=code, headers={"Retry-After": str(state.retry_after)})
        return None

    def model_changed() -> APIError | None:
        """The model file rewritten in place under the loaded model's mapping (one fstat): every request would read
        another file's bytes through the old index, so it is refused with what happened and what to do, and the
        server stops as a SIGBUS on that file would stop it (on_load_error: one line, exit 2; a supervisor or the
        router starts it again on the file as it is now)."""
        from ..engine.errors import ModelChangedError
        store = getattr(state.engine, "store", None)
        try:
            if store is not None:
                store.check_unchanged()
        except ModelChangedError as e:
            return changed_error(e)
        return None

    def changed_error(e) -> APIError:
        if not state.model_changed:
            state.model_changed = True
            if state.on_load_error is not None:
                state.on_load_error(e)
            else:
                print(f"bitnet serve: error: {e}", file=sys.stderr, flush=True)
        return APIError(500, str(e), "server_error", code="model_changed")

    def ready(request: Request):
        """Availability (the key was checked before the body was read: serve/auth.py)."""
        why = unavailable()
        if why is not None:
            raise why
        return state.engine

    async def refuse_too_long(eng, n_chars, param):
        msg = await too_long_for_context(eng, n_chars)
        if msg:
            raise APIError(400, msg, param=param, code="context_length_exceeded")

    def check_model(name):
        """llama-server's rule by default: any name is answered by the loaded model (clients send fixed names);
        --strict-model-name: only the served id (or its alias)."""
        if state.refuses(name):
            raise APIError(404, f"model '{name}' does not exist (this server has '{state.model_id}')",
                           "not_found_error", "model", "model_not_found")

    async def compile_constraint(eng, req, tool_spec=None):
        """The request's structured-output spec (or its tool-call grammar) compiled for the model, off the event
        loop (a new schema takes ~10-100 ms to compile; repeats come from a cache), or None. A spec that cannot
        be enforced: 400 naming the field."""
        from ..engine.errors import ConstraintError, GrammarBusyError
        try:
            spec = req.constraint()
            if spec is not None and tool_spec is not None:   # call tools, or answer in the format
                from ..engine.runtime.tools import with_answer_format
                spec = with_answer_format(tool_spec, spec, forced=req.FORCED_CALL_FORMAT)
            spec = spec or tool_spec
            return None if spec is None else await asyncio.to_thread(eng.compile_constraint, spec)
        except GrammarBusyError as e:   # every compile slot taken by other requests: to retry, not the spec's fault
            raise APIError(503, str(e), "unavailable_error", code="grammar_busy", headers={"Retry-After": "5"}) \
                from None
        except ConstraintError as e:
            raise APIError(400, str(e), param=e.where, code="invalid_constraint") from None

    def tool_setup(eng, tools, choice, parallel, allowed=None, named_parallel=False):
        """(tools for the prompt, a maker of their call grammar, a maker of answer parsers: one per choice) of a chat
        request's tools (chat shape), tool choice ("none" | "auto" | "required" | NamedTool: a function named, which
        may itself be called "auto", "required" or "none") and parallel_tool_calls;
        allowed: the names the model may call (OpenAI's allowed_tools: every tool stays in the prompt, the grammar
        takes only these); (None, None, None) without tools or with tool_choice "none". A named choice is exactly
        one call of that tool, whatever parallel_tool_calls says (OpenAI's "call exactly one specific function";
        a grammar of one or more let a small model repeat the call up to max_tokens), unless named_parallel: the
        request's API lets it ask for more (Anthropic's disable_parallel_tool_use: false, sent). The grammar (checked
        here) is made for where the rendered prompt leaves a thought (grammar(eng.answer_thought(prompt_ids)):
        choice auto lets a thought before the calls name them)."""
        from ..engine.errors import ConstraintError
        from ..engine.runtime.tools import functions_from_tools
        named = isinstance(choice, NamedTool) or choice not in ("none", "auto", "required")
        if isinstance(choice, NamedTool):
            choice = choice.name
        if allowed and not tools:   # the same 400 as with tools that lack the name (mode auto was answered 200)
            raise APIError(400, f"tool_choice: allowed tool {json_text(allowed[0])}"
                                " is not among the tools (the request gives "
                           "no tools)", param="tool_choice", code="invalid_value")
        if not tools or (choice == "none" and not named):
            if named or choice == "required":   # said in no API's own words ("required" is Anthropic's "any")
                what = f"a call of {json_text(choice)}" if named else "a tool call"
                raise APIError(400, f"tool_choice asks for {what} but the request gives no tools",
                               param="tool_choice", code="invalid_value")
            return None, None, None
        fmt = eng.tool_format()
        try:
            functions = functions_from_tools(tools)
            names = {f.name for f in functions}
            if named and choice not in names:
                raise ConstraintError(f"tool_choice: no tool named {json_text(choice)}", where="tool_choice")
            if allowed is not None:
                missing = [n for n in allowed if n not in names]
                if missing:
                    raise ConstraintError(f"tool_choice: allowed tool {json_text(missing[0])} is not among the tools",
                                          where="tool_choice")
                functions = [f for f in functions if f.name in allowed]
            many = named_parallel if named else parallel is not False
            spec = fmt.constraint(functions, choice, many, named=named)
        except ConstraintError as e:
            raise APIError(400, str(e), param=e.where, code="invalid_value") from None

        def grammar(thought=None):
            if thought is None or spec is None or not spec.free_start:
                return spec
            return fmt.constraint(functions, choice, many, thought, checked=True, named=named)
        return tools, grammar, fmt.parser

    async def render_prompt(eng, msgs, tools, param, prefill="", template_kwargs=None):
        """The prompt ids of a conversation through the model's template (with the tools); prefill: text the
        answer continues (Anthropic's final assistant message), after the template's generation prompt;
        template_kwargs: llama-server's chat_template_kwargs (enable_thinking, ...)."""
        await refuse_too_long(eng, sum(len(m["content"]) for m in msgs) + len(prefill), param)
        try:
            # continued or not by each endpoint's own rule (continuation; a Responses input ending with an
            # assistant message gets a new turn), never again by chat_prompt's default
            return await run_off_loop(eng.chat_prompt, msgs, tools=tools, prefill=prefill,
                                      template_kwargs=template_kwargs, continue_final_message=False)
        except Exception as e:  # the template rejected the conversation (e.g. roles out of order)
            if out_of_resources(e):   # not the conversation's fault: a 503 (_out_of_resources)
                raise
            if str(e).startswith("chat_template_kwargs"):
                raise APIError(400, str(e), param="chat_template_kwargs", code="invalid_value") from None
            raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None

    async def start_chat(request, body, msgs, tools, choice, param, prefill="", allowed=None, thinking=True,
                         asked=False, split=True):
        """The chat-shaped endpoints' common start (/v1/chat/completions, /v1/responses, /v1/messages): the engine,
        the prompt through the model's template (with the tools), the constraint, the submitted streams.
        thinking False: a thinking template is asked not to think (enable_thinking false; Anthropic's default);
        asked: the request asked it to think (Anthropic's thinking enabled), over the server's -rea off.
        split: the endpoint takes a thought out of the answer with the think splitter (then the tool grammar lets
        the thought name calls; without, the parser would read them as calls).
        -> (engine, prompt ids, streams, queue, maker of tool-call parsers or None, maker of think splitters or
        None: one per choice, for a thinking template)"""
        eng = ready(request)
        check_model(body.model)
        tools, tool_grammar, new_parser = tool_setup(eng, tools, choice, body.parallel_tool_calls, allowed,
                                                     getattr(body, "named_parallel_calls", False))
        kwargs = getattr(body, "chat_template_kwargs", None)
        if eng.thinks and (not thinking or asked):
            kwargs = {"enable_thinking": bool(thinking), **(kwargs or {})}
        prompt_ids = await render_prompt(eng, msgs, tools, param, prefill, kwargs)
        tool_spec = tool_grammar and tool_grammar(eng.answer_thought(prompt_ids) if split and not prefill else None)
        constraint = await compile_constraint(eng, body, tool_spec)
        # no grammar decides the start (tools, choice auto), or the grammar goes on with the prompt's thought
        free = constraint is None or constraint.spec.free_start or await run_off_loop(eng.thought_may_open,
                                                                                       constraint)
        if eng.thinks and not free and (asked or (kwargs or {}).get("enable_thinking") is True) \
                and not await run_off_loop(eng.grammar_thinks, constraint):
            # a format (or a required call) is the answer from its first token: the thought asked for has no room
            # (docs/structured-output.md); it was answered without one, in silence. A grammar that writes the
            # thought itself (<think> ... </think> answer) is what the docs advise instead
            raise APIError(400, "thinking with a format or a required tool call: the constrained output is the "
                           "answer from its first token and leaves no room for a thought; turn thinking off or "
                           "leave it to the template", param="thinking" if asked else
                           "chat_template_kwargs.enable_thinking", code="invalid_value")
        params = await sampling_for(eng, body, chat=thinking)
        streams, q = submit(eng, body, prompt_ids, asyncio.get_running_loop(), constraint, param, params=params)
        return eng, prompt_ids, streams, q, new_parser, (lambda: eng.think_splitter(prompt_ids, free))

    async def sampling_for(eng, req, chat: bool = False):
        """The request's SamplingParams (checked by its model, serve/schemas.py), with what its sampler takes
        from the tokenizer built off the event loop. The server's --reasoning-budget is for a thinking template's
        chats (chat: the prompt is one, asked to think), as llama-server's; a request's own budget applies as sent."""
        params = req.sampling_params(sampling)
        if params.reasoning_budget >= 0 and "reasoning_budget" not in req.model_fields_set \
                and not (chat and eng.thinks):
            params = replace(params, reasoning_budget=-1)
        await prepare_sampling(eng, params)
        return params

    def submit(eng, req, prompt_ids, loop, constraint=None, param="prompt", q=None, offset=0, *, params):
        """Submit the request's n choices to the engine with `params` (sampling_for's); return (streams, queue of
        (choice index, Chunk)). Maps engine errors to HTTP ones. q, offset: the queue of a request of several
        prompts, and the index of this prompt's first choice there."""
        from ..engine.errors import BitNetError, ContextOverflowError, ModelChangedError, QueueFullError
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        if not 1 <= req.n <= eng.parallel:   # the engine's words, before a callback per choice is made
            raise APIError(400, f"n {req.n}: must be in 1..{eng.parallel} (the answers this server makes at once: "
                           "bitnet serve --parallel)", param="n", code="invalid_value")
        q = asyncio.Queue() if q is None else q
        limit = req.limit()
        # no limit: until the context is full, which the engine ends as "context" (the last token needs no place
        # in the cache, so that is n_ctx - prompt + 1 tokens: a limit of the room would stop one short, as "length")
        max_tokens = eng.n_ctx + 1 if limit is None else limit
        callbacks = [(lambda ch, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, ch)))
                     for i in range(offset, offset + req.n)]
        try:
            ends = getattr(req, "_end_ids", None)   # a filled-in middle's (fim.py); only given where there are
            streams = eng.submit_n(prompt_ids, params, req.n, max_tokens=max(0, max_tokens), stop=req.stops(),
                                   ignore_eos=req.ignore_eos, constraint=constraint, callbacks=callbacks,
                                   **({"end_ids": ends} if ends else {}))
        except QueueFullError as e:
            metrics.rejected.inc()
            raise APIError(503, str(e), "server_error", code="queue_full",
                           headers={"Retry-After": str(state.retry_after)}) from None
        except ContextOverflowError as e:
            # named as the request named it: "your input" on /v1/responses, where "messages" is no field
            raise APIError(400, overflow_message(e, param if param in ("prompt", "input") else "messages"), param=param,
                           code="context_length_exceeded",
                           extra=overflow_fields(e)) from None
        except ModelChangedError as e:
            raise changed_error(e) from None
        except BitNetError as e:
            field = str(e).split(" ", 1)[0]   # the engine's messages start with the setting they are about
            raise APIError(400, str(e), param=field if field in type(req).model_fields else None,
                           code="invalid_value") from None
        state.streams.update(streams)
        metrics.prompt_tokens.inc(len(prompt_ids))
        return streams, q

    class Timer(TokenClock):
        def __init__(self):
            super().__init__(metrics)

        def done(self, n_prompt, finals):
            """(usage, timings): the prompt counted once, the completions of every choice; timings: choice 0's.
            bitnet_generated_tokens counts what usage counts (an end-of-text token too, which has no chunk)."""
            stats = [f.stats if f is not None else None for f in finals]
            n_gen = sum(st.n_generated for st in stats if st is not None) if any(stats) else self.n
            self.settle(n_gen)
            metrics.e2e.observe(time.perf_counter() - self.t0)
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
            if stats[0] is not None:   # OpenAI's: the prompt tokens the prefix cache held (not run again)
                usage["prompt_tokens_details"] = {"cached_tokens": stats[0].n_cached}
            return usage, timings_of(stats[0])

    def timings_of(st):
        """llama-server's timings (its web UI reads them: prompt_n is the prompt run, cache_n the part reused),
        with this server's cached_n and ttft_ms (the chat page's)."""
        if st is None:
            return None
        return {**llama_timings(st), "cached_n": st.n_cached, "ttft_ms": round(st.ttft_s * 1000, 1)}

    class Choices:
        """What each of a request's n choices has made: text pieces, (token, TokenLogprob) items of the tokens
        whose text has been released (serve/logprobs.py Said), final Chunk."""

        def __init__(self, n):
            self.texts = [[] for _ in range(n)]
            self.tokens = [[] for _ in range(n)]
            self.said = [Said() for _ in range(n)]
            self.logprobs = [x.items for x in self.said]
            self.finals = [None] * n
            # per chunk: (text, logprob records given out so far, tokens in it): what a builder is fed
            self.steps: list[list[tuple[str, int, int]]] = [[] for _ in range(n)]

        def add(self, i, ch, timer) -> bool:
            """Take choice i's chunk; True once every choice has finished."""
            if ch.token is not None or ch.text:
                timer.token(int(ch.token is not None))
                self.texts[i].append(ch.text)
            if ch.token is not None:
                self.tokens[i].append(ch.token)
            self.said[i].add(ch)
            self.steps[i].append((ch.text or "", len(self.logprobs[i]), int(ch.token is not None)))
            if ch.finish_reason is not None:
                self.finals[i] = ch
            return all(f is not None for f in self.finals)

        def feed(self, out, start: int = 0) -> list[str]:
            """Choice 0's chunks from `start` on into a builder (serve/responses.py, serve/anthropic.py), as each
            came: a streamed and a whole answer are built from the same steps, so they give the same items."""
            ev = []
            sent = self.steps[0][start - 1][1] if start else 0
            for text, upto, n_tokens in self.steps[0][start:]:
                lps = self.logprobs[0][sent:upto]
                sent = upto
                if text or lps or n_tokens:
                    ev += out.feed(text, lps, n_tokens)
            return ev

        def finish(self, i):
            return FINISH.get(self.finals[i].finish_reason, "stop")

    async def run_to_end(request, streams, q):
        """Collect whole answers (non-streaming), cancelling if the client goes away."""
        got, timer = Choices(len(streams)), Timer()
        try:
            while True:
                item = await next_or_gone(q, request)
                if item is None:
                    return None, timer
                i, ch = item
                if got.add(i, ch, timer):
                    return got, timer
        finally:
            for i, s in enumerate(streams):
                if got.finals[i] is None:
                    s.cancel()
                state.streams.discard(s)

    def refuse_unanswered(finals, streams, rid, where):
        """The error of a whole answer one of whose sequences ended without one (schemas.unanswered); rid: the id
        the client gets, where: the path."""
        for f, s in zip(finals, streams):
            bad = unanswered(f.finish_reason, state.retry_after, rid, where, s.id)
            if bad is not None:
                raise APIError(bad.status, bad.message, bad.type, code=bad.code, headers=bad.headers)

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream_events(streams, q, n_prompt, make_chunk, include_usage, per_token, rid, where):
        """SSE lines for one request's choices. On client disconnect Starlette cancels this generator: we cancel
        the engine streams in `finally`, so their sequences stop at the next step. make_chunk is given the logprob
        items of the tokens since its previous call for that choice (tokens held back as a possible stop string
        wait); where it holds a chunk back (None) it keeps them for a later one."""
        n = len(streams)
        got, timer = Choices(n), Timer()
        sent = [0] * n   # logprob items of each choice already sent
        try:
            for i in range(n):
                first = make_chunk(i, None, None, first=True)
                if first is not None:
                    yield sse(first)
            while True:
                i, ch = await q.get()
                every = got.add(i, ch, timer)
                bad = unanswered(ch.finish_reason, state.retry_after, rid, where, streams[i].id)
                if bad is not None:   # this request's sequence failed (the others go on), or never started
                    yield sse({"error": {"message": bad.message, "type": bad.type, "param": None, "code": bad.code}})
                    return
                if ch.text:
                    c = make_chunk(i, ch.text, None, lps=got.logprobs[i][sent[i]:])
                    sent[i] = len(got.logprobs[i])
                    if c is not None:   # None: text held back (a tool call being written); make_chunk keeps its items
                        if per_token and ch.stats is not None:
                            c["timings"] = timings_of(ch.stats)
                        yield sse(c)
                if ch.finish_reason is not None:
                    last = make_chunk(i, None, got.finish(i), lps=got.logprobs[i][sent[i]:] or None)
                    last["timings"] = timings_of(ch.stats)
                    if getattr(streams[i], "ended_now", False):   # finish "stop" as documented, but cut short
                        last["cut_by"] = "shutdown"               # by the drain: a client can tell (the page)
                    yield sse(last)
                if every:
                    break
            usage, _ = timer.done(n_prompt, got.finals)
            if include_usage:   # the last chunk's head (id, model, ...) without choices: no parser is asked again
                u = {k: v for k, v in last.items() if k not in ("choices", "timings")}
                u["choices"], u["usage"] = [], usage
                yield sse(u)
            yield "data: [DONE]\n\n"
        finally:
            for i, s in enumerate(streams):
                if got.finals[i] is None:
                    s.cancel()
                state.streams.discard(s)

    sse_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    async def respond(request, body, streams, q, n_prompt, make_chunk, make_choice, rid):
        """The one tail of both endpoints: an SSE stream of make_chunk(i, text, finish, first, lps) objects
        (each with "usage": null when the client asked for stream_options.include_usage), or the whole answer
        with make_choice(i, text, finish, lps) per choice, plus usage and timings. rid: the answer's id."""
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(i, text, finish, first=False, lps=None):
                c = make_chunk(i, text, finish, first, lps)
                if c is not None and include_usage:
                    c["usage"] = None
                return c
            return Streamed(stream_events(streams, q, n_prompt, chunk, include_usage,
                                          getattr(body, "timings_per_token", False), rid, request.url.path),
                            media_type="text/event-stream", headers=sse_headers)
        got, timer = await run_to_end(request, streams, q)
        if got is None:
            return Response(status_code=499)
        refuse_unanswered(got.finals, streams, rid, request.url.path)
        usage, timings = timer.done(n_prompt, got.finals)
        choices = [make_choice(i, "".join(got.texts[i]), got.finish(i), got.logprobs[i]) for i in range(len(streams))]
        return {"choices": choices, "usage": usage, "timings": timings}

    def refuse_chat_suffix(request, body):
        """A chat request's suffix: where the model has no FIM tokens, the message every endpoint gives; else
        where fill-in-the-middle is (it was "a /v1/completions field" alone, which refused it too)."""
        if not fim_off(getattr(body, "suffix", None)):
            why = suffix_refusal(ready(request)) or ("suffix: a /v1/completions field (fill-in-the-middle), not "
                                                     "taken here")
            raise APIError(400, why, param="suffix", code="unsupported_parameter")

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)   # llama-server's: an SDK pointed at the bare root
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        refuse_chat_suffix(request, body)
        with translated():   # a final assistant message is continued, as llama-server does
            body.check_tool_messages()
            msgs, prefill = continuation([m.as_dict() for m in body.messages], body.continue_final_message,
                                         body.add_generation_prompt)
            if prefill is not None and (body.chat_template_kwargs or {}).get("enable_thinking") is True:
                raise RequestProblem("chat_template_kwargs", "a continued assistant message cannot think first "
                                     "(enable_thinking: true), as llama-server refuses it")
        # a thinking model's <think> block goes to reasoning_content (llama-server's --reasoning-format deepseek);
        # none: in the content as generated; deepseek-legacy, as llama-server: streamed, the block stays in the
        # content with its tags (the opening one too where the prompt opened it), else as deepseek
        fmt = body.reasoning_format or reasoning_format
        if fmt == "deepseek-legacy" and not body.stream:
            fmt = "deepseek"
        # a continued answer is the answer: a thinking template is asked not to think (as /v1/messages renders it)
        eng, prompt_ids, streams, q, new_parser, new_splitter = await start_chat(
            request, body, msgs, body.tools, body.tool_choice_name(), "messages", prefill or "",
            allowed=body.allowed_tools(), thinking=body.reasoning_effort != "none" and prefill is None,
            split=fmt not in ("none", "deepseek-legacy") and prefill is None)
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), state.model_id
        head = {"id": cid, "created": created, "model": model, "system_fingerprint": None}
        text_of, n_top = state.token_text(eng), body.top_logprobs or 0
        parsers = [new_parser() if new_parser is not None else None for _ in streams]   # one per choice
        n_calls = [0] * len(streams)

        def ended(i, called: bool) -> str:
            """Choice i's finish reason where a stop string (or the end of text) ended it: length for a call it cut
            (never to be run: the rule the other APIs share, schemas.cut_short), tool_calls for whole calls, else
            stop (an answer in a JSON format too, whole or not, as OpenAI's and llama-server's)."""
            if cut_short("stop", parsers[i]):
                return "length"
            return "tool_calls" if called else "stop"
        splitters = [new_splitter() if fmt != "none" and prefill is None else None for _ in streams]
        opened = ["<think>\n" if fmt == "deepseek-legacy" and sp is not None and sp.opened else "" for sp in splitters]
        if fmt == "deepseek-legacy":
            splitters = [None] * len(streams)

        def split(i, text):
            """(reasoning, content) of the next text of choice i (text None: the end)."""
            sp = splitters[i]
            if sp is None:
                return "", text
            return sp.finish() if text is None else sp.feed(text)

        def logprobs(lps):
            if not body.logprobs or lps is None:
                return None
            return {"content": [chat_entry(text_of, t, lp, n_top) for t, lp in lps], "refusal": None}

        # the logprob items of a stream's chunks held back (text a tag or a call may start with), and with a tool
        # parser, which items are of the text shown (serve/logprobs.py ShownRecords): a call's markup has none
        waiting = [[] for _ in streams]
        shown = [ShownRecords(eng.tokenizer) if p is not None else None for p in parsers]

        def held(i) -> int:
            """Bytes of the answer's text that choice i's thought splitter and tool parser hold, not yet given out."""
            return sum(len(x.buf.encode("utf-8")) for x in (splitters[i], parsers[i]) if x is not None)

        def shown_items(i, lps, raw: int, held_before: int, fed: str, parsed_before: int, content, last: bool):
            """Choice i's items of the text given out in one step: `raw` new bytes of the answer's text, `fed` the
            text given to the tool parser (which held parsed_before bytes before it), `content` what it gave out."""
            parsed_after = len(parsers[i].buf.encode("utf-8"))
            called = len(fed.encode("utf-8")) + parsed_before - parsed_after - len((content or "").encode("utf-8"))
            return shown[i].step(lps, raw + held_before - held(i), max(called, 0), last)

        def tool_delta(i, content, calls):
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [dict(c, index=n_calls[i] + k) for k, c in enumerate(calls)]
                n_calls[i] += len(calls)
            return delta

        def make_chunk(i, text, finish, first=False, lps=None):
            parser = parsers[i]
            held_before = held(i)
            parsed_before = len(parser.buf.encode("utf-8")) if parser is not None else 0
            reasoning, content = split(i, text) if not first else ("", None)
            if first:
                delta = {"role": "assistant", "content": opened[i]}
            elif parser is not None:   # tool calls: content streams, each call goes out once its block closes
                if text is not None:
                    delta = tool_delta(i, *parser.feed(content))
                else:   # the end: what the splitter held, then what the parser held
                    said, calls = parser.feed(content or "")
                    rest, more = parser.finish(finish == "length")
                    delta = tool_delta(i, said + rest, calls + more)
                lps = shown_items(i, lps or [], len((text or "").encode("utf-8")), held_before, content or "",
                                  parsed_before, delta.get("content"), text is None)
            else:
                delta = {"content": content} if content else {}
            if finish == "stop":
                finish = ended(i, n_calls[i] > 0)
            if reasoning:
                delta = {"reasoning_content": reasoning, **delta}
            if not first:   # the items of a chunk held back go out with the next one
                lps, waiting[i] = waiting[i] + (lps or []), []
            if text is not None and not delta:
                waiting[i] = lps
                return None   # held back: a tag being written, or a tool call
            if not first and not lps and (text is None or parser is not None):
                lps = None   # no records: null (a call's chunk, the last one), as OpenAI's
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": delta, "logprobs": logprobs(lps), "finish_reason": finish}]}

        def make_choice(i, text, finish, lps):
            whole = text
            reasoning, text = split(i, text)
            if splitters[i] is not None:
                more, rest = split(i, None)
                reasoning, text = reasoning + more, text + rest
            message = {"role": "assistant", "content": text, "refusal": None}
            if reasoning:
                message["reasoning_content"] = reasoning
            parser = parsers[i]
            if parser is not None:
                content, calls = parser.feed(text)
                rest, more = parser.finish(finish == "length")   # a call cut off: the call so far, not markup
                calls += more
                message["content"] = (content + rest) or None if calls else content + rest
                if body.logprobs:   # the items of the text shown: none of a call's markup (null content: null)
                    lps = shown_items(i, lps, len(whole.encode("utf-8")), 0, text, 0, message["content"], True)
                    lps = lps if message["content"] is not None or reasoning else None
                if calls:
                    message["tool_calls"] = calls
            if finish == "stop":
                finish = ended(i, "tool_calls" in message)
            records = logprobs(lps)
            if body.logprobs and records is None:   # a message of calls alone: no content, no records (OpenAI's)
                records = {"content": None, "refusal": None}
            return {"index": i, "message": message, "logprobs": records, "finish_reason": finish}
        out = await respond(request, body, streams, q, len(prompt_ids), make_chunk, make_choice, cid)
        return {**head, "object": "chat.completion", **out} if isinstance(out, dict) else out

    async def fill_in_the_middle(eng, body: CompletionRequest):
        """The model's FIM tokens where the request fills in the middle (a suffix), else None; a 400 for /infill's
        fields (they were dropped in silence) and for a suffix the model or the request cannot take."""
        for name in INFILL_FIELDS:
            if not fim_off(getattr(body, name)):
                raise APIError(400, field_refusal(eng, name), param=name, code="unsupported_parameter")
        if not body.suffix:   # "" and null: what clients send at a file's end
            return None
        why = suffix_refusal(eng)
        if why is None and not isinstance(body.prompt, str):
            why = "suffix: the prompt is then one text, the text before the gap (not token ids or several prompts)"
        if why is None and body.echo:
            why = "suffix: not with echo (the prompt is the text before the gap, not the text the model ran)"
        if why is not None:
            raise APIError(400, why, param="suffix", code="unsupported_parameter")
        fim = fim_tokens(eng.tokenizer)
        body._end_ids = fim_ends(eng, fim)
        return fim

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = ready(request)
        check_model(body.model)
        bad = body.unsupported()   # before the prompt is read: [[]] (submit checks it again)
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        fim = await fill_in_the_middle(eng, body)
        p = body.prompt
        # OpenAI's prompt shapes: a text, a token list, or a list of either (several prompts: choice p * n + j)
        items = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(items) > max(1, eng.max_queue):
            raise APIError(400, f"prompt: {len(items)} prompts; at most {max(1, eng.max_queue)} in one request (the "
                                "server's --max-queue)", param="prompt", code="invalid_value")
        prompts = []   # (ids, echo text, first echoed token: 1 skips the BOS added to a text prompt)
        for item in items:
            if isinstance(item, list) and item and isinstance(item[0], int):
                ids = [int(t) for t in item]
                if any(t < 0 or t >= eng.config.vocab_size for t in ids):
                    raise APIError(400, "prompt: token id out of the vocabulary", param="prompt", code="invalid_value")
                prompts.append((ids, await run_off_loop(eng.detokenize, ids) if body.echo else "", 0))
            elif fim is not None:   # the prompt is the text before the gap, suffix the text after it
                prefix, suffix = cut_to(item, body.suffix, await chars_bound(eng))   # cut to fit, not refused
                ids = await run_off_loop(infill_ids, eng, fim, prefix, suffix, (), (), body.limit())
                prompts.append((ids, item, 0))
            else:
                text = item if isinstance(item, str) else ""
                await refuse_too_long(eng, len(text), "prompt")
                ids = await run_off_loop(eng.tokenize, text, add_bos=True)
                bos = eng.tokenizer.bos_id
                prompts.append((ids, text, 1 if bos is not None and ids[:1] == [bos] else 0))
        constraint = await compile_constraint(eng, body)
        params = await sampling_for(eng, body)
        loop = asyncio.get_running_loop()
        streams, q = [], asyncio.Queue()
        n = body.n
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"   # before the scoring passes: a fault there names it
        try:
            for k, (ids, _, _) in enumerate(prompts):
                streams += submit(eng, body, ids, loop, constraint, q=q, offset=k * n, params=params)[0]
            echo_lp, echo_end = [None] * len(prompts), [0] * len(prompts)
            if body.echo and body.logprobs is not None:   # every prompt token's logprob: scoring passes beside,
                # stopped with the answers when the client hangs up (a long prompt's pass runs for many seconds)
                scores = await unless_gone(asyncio.gather(
                    *(score_prompt(eng, ids, body.logprobs, cid, request.url.path) for ids, _, _ in prompts)), request)
                for k, ((ids, echoed, shown), sc) in enumerate(zip(prompts, scores)):
                    echo_lp[k], echo_end[k] = echo_logprobs(state.token_text(eng), ids, sc, shown, body.logprobs,
                                                            echoed)
        except BaseException as e:
            for st in streams:
                st.cancel()
                state.streams.discard(st)
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            raise
        created, model = int(time.time()), state.model_id
        head = {"id": cid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None}
        text_of = state.token_text(eng)
        offsets = [TextOffsets(eng.tokenizer, echo_end[i // n]) for i in range(len(streams))]   # one per choice

        def echo_of(i):
            return prompts[i // n][1] if body.echo else ""

        def logprobs(i, lps):
            if body.logprobs is None or lps is None:
                return None
            return completion_logprobs(text_of, lps, body.logprobs, offsets[i])

        def make_chunk(i, text, finish, first=False, lps=None):
            if first:   # an echo goes out first, with its logprobs
                return {**head, "choices": [{"index": i, "text": echo_of(i), "logprobs": echo_lp[i // n],
                                             "finish_reason": None}]} if body.echo else None
            return {**head, "choices": [{"index": i, "text": text or "", "logprobs": logprobs(i, lps),
                                         "finish_reason": finish}]}

        def make_choice(i, text, finish, lps):
            got, echoed = logprobs(i, lps), echo_lp[i // n]
            if echoed is not None:
                got = {k: echoed[k] + (got[k] if got else []) for k in echoed}
            return {"index": i, "text": echo_of(i) + text, "logprobs": got, "finish_reason": finish}
        out = await respond(request, body, streams, q, sum(len(ids) for ids, _, _ in prompts), make_chunk,
                            make_choice, cid)
        return {**head, **out} if isinstance(out, dict) else out

    async def score_prompt(eng, prompt_ids, top_k, rid, where):
        """The prompt's per-token TokenLogprobs (engine.submit_score: a prefill-only pass of its own), awaited
        on the event loop; cancelled with the request."""
        from ..engine.errors import ModelChangedError, QueueFullError
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def finished(req):
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(req))
        try:
            req = eng.submit_score(prompt_ids, top_k, callback=finished)
        except QueueFullError as e:
            metrics.rejected.inc()
            raise APIError(503, str(e), "server_error", code="queue_full",
                           headers={"Retry-After": str(state.retry_after)}) from None
        except ModelChangedError as e:
            raise changed_error(e) from None
        try:
            await done
        except BaseException:
            req.cancel()
            raise
        if req.error is not None:   # as the answers' own ends: a fault names the request, a drain says retry
            bad = unanswered("unavailable" if req.error == "cancelled" else "error", state.retry_after, rid, where)
            raise APIError(bad.status, bad.message, bad.type, code=bad.code, headers=bad.headers)
        return req.logprobs

    @contextlib.contextmanager
    def translated():
        """An adapter's translation of a request (serve/responses.py, serve/anthropic.py): its RequestProblem is a
        400 naming the field."""
        try:
            yield
        except RequestProblem as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None

    def responses_conversation(body):
        """(messages, tools, tool choice, allowed tool names) of a Responses request, its text.format checked.
        What is not supported is said first: previous_response_id with a function_call_output was blamed on the
        output's call_id (no call before it), not on the stored response it pointed to."""
        bad = body.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        with translated():
            msgs, tools, choice = body.messages(), body.chat_tools(), body.tool_choice_name()
            body.format_spec()
            return msgs, tools, choice, body.allowed_tools()

    @app.post("/v1/responses")
    @app.post("/responses", include_in_schema=False)
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API over the chat pipeline (serve/responses.py translates both ways)."""
        msgs, tools, choice, allowed = responses_conversation(body)
        think = (body.reasoning or {}).get("effort") != "none"   # effort "none": a thinking template does not think
        try:
            eng, prompt_ids, streams, q, new_parser, new_splitter = await start_chat(
                request, body, msgs, tools, choice, "input", allowed=allowed, thinking=think)
        except APIError as e:   # named as the client named it (tools[1].name: Responses tools are flat)
            e.message, e.param = responses_names(e.message), responses_names(e.param)
            raise
        text_of, n_top = state.token_text(eng), body.top_logprobs or 0
        out = ResponseBuilder(body, state.model_id, body.sampling_params(sampling),
                              parser=new_parser() if new_parser is not None else None,
                              entry=(lambda t, lp: chat_entry(text_of, t, lp, n_top)) if body.wants_logprobs() else None,
                              splitter=new_splitter())   # effort none: a thought written anyway is still one
        return await answer_with(request, body, streams[0], q, len(prompt_ids), out)

    async def count_input_tokens(request, body, msgs, tools, choice, param, allowed=None) -> dict:
        """The prompt a chat-shaped request would run (its template, instructions and tools), counted without
        generating: OpenAI's input token count object."""
        eng = ready(request)
        check_model(body.model)
        refuse_chat_suffix(request, body)
        bad = body.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        tools, _, _ = tool_setup(eng, tools, choice, body.parallel_tool_calls, allowed)
        kwargs = getattr(body, "chat_template_kwargs", None)   # as start_chat renders it
        if eng.thinks and (getattr(body, "reasoning", None) or {}).get("effort") == "none":
            kwargs = {"enable_thinking": False, **(kwargs or {})}
        return {"object": "response.input_tokens",
                "input_tokens": len(await render_prompt(eng, msgs, tools, param, "", kwargs))}

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(body: ResponsesRequest, request: Request):
        """OpenAI's `client.responses.input_tokens.count(...)`: a Responses request's input tokens."""
        msgs, tools, choice, allowed = responses_conversation(body)
        return await count_input_tokens(request, body, msgs, tools, choice, "input", allowed)

    @app.post("/v1/chat/completions/input_tokens")
    async def chat_input_tokens(body: ChatCompletionRequest, request: Request):
        """llama-server's token count of a chat completion body (the same object as OpenAI's Responses count)."""
        with translated():
            body.check_tool_messages()
        return await count_input_tokens(request, body, [m.as_dict() for m in body.messages], body.tools,
                                        body.tool_choice_name(), "messages", body.allowed_tools())

    async def response_not_stored(request: Request, response_id: str):
        raise APIError(404, not_stored(response_id), "not_found_error", "response_id", "not_stored")

    @app.post("/v1/responses/compact", include_in_schema=False)
    async def responses_compact(request: Request):
        """OpenAI's `client.responses.compact(...)` (codex-like clients call it): a 400 saying why, not a bare 405
        (a 5xx the openai client would retry)."""
        raise APIError(400, "compacting a conversation is not supported here (its output is an opaque item only "
                       "OpenAI's models read); send the whole conversation as input", param=None,
                       code="unsupported_endpoint")

    for path, methods in STORED_RESPONSE_ROUTES:
        app.add_api_route(path, response_not_stored, methods=methods, include_in_schema=False)

    async def answer_with(request, body, stream, q, n_prompt, out):
        """Run one answer through a builder of another API's shape (serve/responses.py, serve/anthropic.py: start,
        feed, finish, fail, result): its SSE events as they come, or (stream false) its whole result."""
        if body.stream:
            return Streamed(builder_events(stream, q, n_prompt, out, request.url.path), media_type="text/event-stream",
                            headers=sse_headers)
        got, timer = await run_to_end(request, [stream], q)
        if got is None:
            return Response(status_code=499)
        fin = got.finals[0]
        refuse_unanswered(got.finals, [stream], out.id, request.url.path)
        usage, _ = timer.done(n_prompt, got.finals)
        out.start(n_prompt)
        got.feed(out)
        out.finish(fin, usage)
        return out.result()

    async def builder_events(stream, q, n_prompt, out, where):
        """A builder's SSE events for one answer; the stream is cancelled if the client goes."""
        got, timer = Choices(1), Timer()
        try:
            for e in out.start(n_prompt):
                yield e
            while True:
                _, ch = await q.get()
                got.add(0, ch, timer)
                bad = unanswered(ch.finish_reason, state.retry_after, out.id, where, stream.id)
                if bad is not None:   # this request's sequence failed (the others go on), or never started
                    for e in out.fail(bad.message, bad.status):
                        yield e
                    return
                for e in got.feed(out, len(got.steps[0]) - 1):
                    yield e
                if ch.finish_reason is not None:
                    usage, _ = timer.done(n_prompt, got.finals)
                    # cut short by a stopping server's drain: its last event says so (as the chat stream's)
                    for e in out.finish(ch, usage, cut_by="shutdown" if getattr(stream, "ended_now", False) else None):
                        yield e
                    return
        finally:
            if got.finals[0] is None:
                stream.cancel()
            state.streams.discard(stream)

    def anthropic_conversation(body):
        """(messages, prefill, tools, tool choice, thinking on) of an Anthropic request."""
        with translated():
            (msgs, prefill), tools, choice = body.chat_messages(), body.chat_tools(), body.tool_choice_name()
            thinking = body.check_thinking()
            if thinking and (prefill or body.ends_in_thought()):
                raise RequestProblem("thinking", "thinking may not be enabled with a prefilled answer (a final "
                                                 "assistant message), as Anthropic's API")
        return msgs, prefill, tools, choice, thinking

    @app.post("/v1/messages")
    async def anthropic_messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API over the chat pipeline (serve/anthropic.py translates both ways)."""
        msgs, prefill, tools, choice, thinking = anthropic_conversation(body)
        with translated():
            body.format_spec()
        try:
            eng, prompt_ids, streams, q, new_parser, new_splitter = await start_chat(
                request, body, msgs, tools, choice, "messages", prefill, thinking=thinking, asked=thinking)
        except APIError as e:   # named as the client named it (tools.0.input_schema, not the chat shape's path)
            e.message, e.param = anthropic_names(e.message), anthropic_names(e.param)
            raise
        out = MessageBuilder(state.model_id, new_parser() if new_parser is not None else None,
                             new_splitter() if not prefill else None,
                             thinking=(body.thinking or {}).get("display", "summarized") if thinking else None)
        return await answer_with(request, body, streams[0], q, len(prompt_ids), out)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: CountTokensRequest, request: Request):
        eng = ready(request)
        check_model(body.model)
        msgs, prefill, tools, choice, thinking = anthropic_conversation(body)
        try:
            tools, _, _ = tool_setup(eng, tools, choice, body.parallel_tool_calls)
        except APIError as e:
            e.message, e.param = anthropic_names(e.message), anthropic_names(e.param)
            raise
        kwargs = {"enable_thinking": bool(thinking)} if eng.thinks else None   # as /v1/messages renders it
        return {"input_tokens": len(await render_prompt(eng, msgs, tools, "messages", prefill, kwargs))}

    def model_entry(eng) -> dict:
        return model_object(state.model_id, state.created, meta={"n_ctx": eng.n_ctx})

    @app.get("/v1/models")
    @app.get("/models")   # llama-server's other path (the --models-dir router serves it too)
    async def models(request: Request):
        """The one model, as a list (with Anthropic's page fields)."""
        return {"object": "list", "data": [model_entry(ready(request))], "has_more": False,
                "first_id": state.model_id, "last_id": state.model_id}

    @app.get("/v1/models/{model_name:path}")
    async def model_one(model_name: str, request: Request):
        """`client.models.retrieve(NAME)`: the model that a request naming NAME gets (any name but under
        --strict-model-name, as the generating endpoints)."""
        eng = ready(request)
        check_model(model_name)
        return model_entry(eng)

    def not_served(why: str, path: str = ""):
        async def refuse():   # llama-server's /infill, slot actions, /rerank: a 501, not a bare 404; POST /props 405
            if path in READ_ONLY:
                raise APIError(405, why, "not_supported_error", code="not_supported", headers={"Allow": "GET, HEAD"})
            raise APIError(501, why, "not_supported_error", code="not_supported")
        return refuses_method(refuse) if path in READ_ONLY else refuse

    for paths, why in NOT_SERVED.items():
        for path in paths:
            app.add_api_route(path, not_served(why, path), methods=["POST"], include_in_schema=False)

    @app.get("/lora-adapters", include_in_schema=False)
    async def lora_adapters():   # llama-server's list of loaded adapters: none here
        return []

    @app.post("/lora-adapters", include_in_schema=False)
    async def lora_scales(request: Request):
        if lora_request_is_empty(await request.body()):
            return {"success": True}
        raise APIError(501, LORA_WHY, "not_supported_error", code="not_supported")

    def get_and_head(path: str, **kw):
        """A GET route and its HEAD twin, which stays out of the OpenAPI schema: one route of both methods gave
        both operations one operationId (OpenAPI: unique; client generators fail on it, FastAPI warns)."""
        def deco(fn):
            app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False, **kw)
            return app.get(path, **kw)(fn)
        return deco

    @get_and_head("/health")   # HEAD: load balancers' checks (HAProxy's httpchk)
    @get_and_head("/v1/health")   # llama-server's other path
    async def health():
        why = unavailable()
        if why is None:
            return {"status": "ok"}
        return error_response(why.status, why.message, why.type, code=why.code, headers=why.headers)

    @get_and_head("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/slots")
    async def slots(request: Request):
        eng = ready(request)
        m = eng.metrics()
        # llama-server's load-balancer check: ?fail_on_no_slot=1 answers 503 while every sequence slot is taken
        if request.query_params.get("fail_on_no_slot", "").lower() in ("1", "true") and m["running"] >= eng.parallel:
            raise APIError(503, "no slot available", "unavailable_error", code="no_slot_available",
                           headers={"Retry-After": str(state.retry_after)})
        return {"model": state.model_id, "n_ctx": eng.n_ctx, "metrics": m, "slots": eng.slots()}

    from .ollama import register as register_ollama   # ollama's API: a second adapter over the same engine
    register_ollama(app, state, ready, APIError, sampling=sampling, metrics=metrics, model_format=model_format)
    from .embeddings import register as register_embeddings   # /v1/embeddings, /api/embed, /api/embeddings
    register_embeddings(app, state, ready, APIError, check_model, metrics=metrics)
    from .llama_api import register as register_llama   # llama-server's /completion, /tokenize, /props, ...
    pipe = SimpleNamespace(check_model=check_model, refuse_too_long=refuse_too_long, submit=submit,
                           sampling_for=sampling_for, compile_constraint=compile_constraint, run_to_end=run_to_end,
                           Choices=Choices, Timer=Timer, tool_setup=tool_setup,
                           loop=asyncio.get_running_loop, sse_headers=sse_headers,
                           refuse_unanswered=refuse_unanswered)
    register_llama(app, state, ready, APIError, pipe, sampling=sampling)

    @get_and_head("/", response_class=HTMLResponse)
    async def page():   # HEAD /: the ollama CLI's check that a server is up, before every command
        return page_response(webui)

    return app
