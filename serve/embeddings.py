"""Embeddings over HTTP: OpenAI's `/v1/embeddings`, ollama's `/api/embed` and its older `/api/embeddings`,
llama-server's `/embedding` (and its alias `/embeddings`), all over the engine's `submit_embed`
(engine/batching/embed.py: each text a prefill-only sequence beside the running generations). The vector is the
model's final-norm hidden states pooled over the text's tokens (BOS first) -- by default their mean, L2-normalised,
as llama-server `--embeddings --pooling mean` computes it (engine/runtime/embed.py says why mean; `bitnet serve
--pooling last|none --embd-normalize N` choose otherwise). What each field does here: docs/api.md. Answers are
encoded off the event loop: a request of a thousand vectors is seconds of JSON that would stall every stream.
Nothing here knows of kernels.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Optional

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import ConfigDict

from .offload import (NOT_JSON, OFFLOAD_BYTES, BodyRefused, chars_bound, checked_text, loads, next_or_gone,
                      not_json, run_off_loop, too_long_for_context)
from .schemas import JSONTyped, error_message, error_where, json_text, main_error, overflow_message, unanswered

ENGINE_FAULT = "the engine failed while embedding this input (the server goes on; see its log)"


MAX_INPUTS = 2048   # texts in one request (OpenAI's own limit)


class EmbeddingRequest(JSONTyped):
    """OpenAI's body but `input` (checked by openai_inputs): a string, a list of strings, a list of token ids or a
    list of such lists."""
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    encoding_format: Optional[str] = None   # "float" (default) | "base64" (little-endian float32)
    dimensions: Optional[int] = None
    user: Optional[str] = None              # ignored by design (OpenAI's abuse-monitoring tag)
    embd_normalize: Optional[int] = None    # llama-server's: -1 none, 0 max-abs int16, 1 taxicab, 2 L2, >2 p-norm


_IDS = {"type": "array", "items": {"type": "integer"}}
OPENAPI_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["input"], "properties": {
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, _IDS,
                            {"type": "array", "items": _IDS}]},
        **EmbeddingRequest.model_json_schema()["properties"]}}}}}}


def json_object(raw: bytes) -> dict:
    """The body as a JSON object, or Refused (invalid_json)."""
    try:
        data = checked_text(raw, loads(raw))
    except NOT_JSON as e:
        raise Refused(400, not_json(e), None, "invalid_json") from None
    except BodyRefused as e:
        raise Refused(400, e.detail, e.param, e.code) from None
    if not isinstance(data, dict):
        raise Refused(400, "request body must be a JSON object", None, "invalid_json")
    return data


def parse_openai(raw: bytes) -> tuple[EmbeddingRequest, list]:
    """The body and its inputs, or Refused. Not through the generating endpoints' body parser (serve/offload.py),
    whose bound on numbers is one context's worth: a request here may carry up to MAX_INPUTS contexts of token
    ids, bounded by --max-body-mb alone. Runs off the event loop for large bodies (json.loads and the checks)."""
    from pydantic import ValidationError
    data = json_object(raw)
    try:
        body = EmbeddingRequest.model_validate({k: v for k, v in data.items() if k != "input"})
    except ValidationError as e:
        err = main_error(e.errors())
        where = error_where(err)
        raise Refused(400, f"{where}: {error_message(err)}", where) from None
    return body, openai_inputs(data.get("input"))


class Refused(Exception):
    """A request the endpoint refuses: status, message, the field it is about, OpenAI's error code."""

    def __init__(self, status: int, message: str, param: str | None = "input", code: str = "invalid_value",
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("server_error" if status >= 500 else "invalid_request_error")   # OpenAI's error type


def openai_inputs(value) -> list:
    """The texts (str) and token lists (list[int]) of OpenAI's `input`, or Refused. An empty string or list is
    refused, as OpenAI refuses it."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise Refused(400, "input: expected a string, a list of strings, or token ids" if value is not None
                      else "input is required")
    elif value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]   # one list of token ids
    if not value:
        raise Refused(400, "input: an empty list has nothing to embed")
    if len(value) > MAX_INPUTS:
        raise Refused(400, f"input: {len(value)} items; at most {MAX_INPUTS} in one request")
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise Refused(400, f"input.{i}: an empty string has nothing to embed")
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            if not item:
                raise Refused(400, f"input.{i}: an empty list of token ids has nothing to embed")
        else:
            raise Refused(400, f"input.{i}: expected a string or a list of token ids")
    return value


# token ids are read in the model's own vocabulary; the common sender of others is LangChain's OpenAIEmbeddings,
# which tokenizes with OpenAI's tiktoken unless told not to (ids that fall inside the vocabulary cannot be told
# apart: they embed some other text, which docs/api.md warns of)
FOREIGN_IDS = ("this model's own vocabulary (LangChain's OpenAIEmbeddings sends OpenAI tiktoken ids unless "
               "check_embedding_ctx_length=False; send the text instead)")


async def tokenized(eng, items: list, where: str, truncate: bool = False, one: bool = False,
                    num_ctx: int = 0) -> list[list[int]]:
    """Token lists of texts (each with BOS, as llama-server tokenizes an embedding input) and of token-id lists
    (as given), each checked against the vocabulary and the context: Refused(400) naming `where.i`. truncate: a
    text over the context keeps its first n_ctx tokens instead (ollama's `truncate: true`). one: the field holds
    one text, named `where` alone (/api/embeddings' prompt). num_ctx: ollama's options.num_ctx, a bound below
    the context (min of the two, as ollama's EmbedHandler; 0 or less: the context's)."""
    n_ctx, vocab = eng.n_ctx, eng.config.vocab_size
    limit = min(n_ctx, num_ctx) if num_ctx > 0 else n_ctx

    def name(i):
        return where if one else f"{where}.{i}"

    def over(i, n):
        if limit < n_ctx:
            return (f"{name(i)} has {n} tokens, over options.num_ctx {limit} (truncate true keeps its first "
                    f"{limit})")
        return f"This model's maximum context length is {n_ctx} tokens. However, {name(i)} has {n} tokens"
    items = list(items)
    bound = await chars_bound(eng) if any(isinstance(t, str) for t in items) else 0
    for i, item in enumerate(items):   # before the tokenizer sees megabytes of text (it stalls every stream)
        if isinstance(item, str) and len(item) > bound:
            if not truncate:
                raise Refused(400, f"{name(i)}: {await too_long_for_context(eng, len(item))}",
                              param=where, code="context_length_exceeded")
            items[i] = item[:bound]   # truncate: the text past what n_ctx tokens can cover is never tokenized
    texts = [t for t in items if isinstance(t, str)]
    done = iter(await run_off_loop(lambda: [eng.tokenize(t, add_bos=True) for t in texts]) if texts else ())
    out = []
    for i, item in enumerate(items):
        ids = next(done) if isinstance(item, str) else [int(t) for t in item]
        if any(not 0 <= t < vocab for t in ids):   # only ids as sent can be past it: a text's never are
            raise Refused(400, f"{name(i)}: token ids must be in 0..{vocab - 1}, {FOREIGN_IDS}", where)
        if len(ids) > limit:
            if not truncate:
                raise Refused(400, over(i, len(ids)), where, "context_length_exceeded")
            ids = ids[:limit]
        out.append(ids)
    return out


def check_dimensions(eng, dimensions) -> None:
    """`dimensions` is honoured only as the model's own width: these models were not trained for shortened
    (Matryoshka) vectors, so a cut vector would be a worse one, not a smaller version of the same."""
    if isinstance(dimensions, float) and dimensions.is_integer():   # JSON's 256.0, taken as /v1/embeddings takes it
        dimensions = int(dimensions)
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
        raise Refused(400, f"dimensions {json_text(dimensions)}"
                           ": expected an integer", param="dimensions", code="invalid_value")
    if dimensions is not None and dimensions != eng.config.hidden_size:
        raise Refused(400, f"dimensions {dimensions}: this model's embeddings have {eng.config.hidden_size} "
                      "dimensions and it was not trained for shortened ones; leave dimensions out",
                      param="dimensions", code="unsupported_parameter")


NOT_POOLED = ("Pooling type 'none' is not OAI compatible. Please use a different pooling type (this server runs "
              "with --pooling none: its vectors are per token, at /embedding)")   # llama-server's words, and where


def pooled_only(eng) -> None:
    """The OpenAI and ollama routes answer one vector a text: Refused under --pooling none, as llama-server."""
    if eng.pooling == "none":
        raise Refused(400, NOT_POOLED, None, "pooling_none")


def check_normalize(eng, value) -> Optional[int]:
    """A request's embd_normalize (llama-server's field), or Refused: not an integer >= -1, or given to a server
    whose vectors are per token and never normalised (--pooling none)."""
    from ..engine.errors import BitNetError
    from ..engine.runtime.embed import check_normalize as check
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():   # 2.0, as /v1/embeddings' schema reads it
        value = int(value)
    try:
        value = check(value, json_terms=True)
    except BitNetError as e:
        raise Refused(400, str(e), "embd_normalize") from None
    if eng.pooling == "none":
        raise Refused(400, "embd_normalize: this server runs with --pooling none, whose per-token vectors are "
                      "never normalised", "embd_normalize", "unsupported_parameter")
    return value


async def json_answer(build) -> Response:
    """build() -> a JSON-able object (the vectors' tolist() inside it), encoded off the event loop."""
    def encode():
        return json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return Response(await run_off_loop(encode), media_type="application/json")


async def run_embed(eng, state, request: Request, ids: list[list[int]], metrics=None, normalize: Optional[int] = None):
    """Submit the token lists, wait for their vectors ([n, hidden] float32; pooling none: a list of [tokens,
    hidden]), cancelling if the client goes away (None then). Engine refusals become Refused."""
    from ..engine.errors import BitNetError, ContextOverflowError, ModelChangedError, QueueFullError
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    try:
        req = eng.submit_embed(ids, callback=lambda r: loop.call_soon_threadsafe(q.put_nowait, r), normalize=normalize)
    except QueueFullError as e:
        if metrics is not None:
            metrics.rejected.inc()
        raise Refused(503, str(e), None, "queue_full") from None
    except ContextOverflowError as e:
        raise Refused(400, overflow_message(e, "input"), code="context_length_exceeded") from None
    except ModelChangedError:   # the server's error (500 model_changed, and it stops), not the client's
        raise
    except BitNetError as e:
        raise Refused(400, str(e)) from None
    state.streams.add(req)   # a drain cancels it with the generations
    if metrics is not None:
        metrics.prompt_tokens.inc(sum(len(t) for t in ids))
    try:
        got = await next_or_gone(q, request)
    finally:
        state.streams.discard(req)
        if not req.done:
            req.cancel()
    if got is None:
        return None
    if req.error is not None:
        # as the generating routes: a fault is a 500 naming a request id the log names too; one a stopping server
        # ended (its drain cancels it) is NEVER_STARTED's 503 to retry
        bad = unanswered("unavailable" if req.error == "cancelled" else "error", state.retry_after, None,
                         request.url.path, fault=ENGINE_FAULT)
        raise Refused(bad.status, bad.message, None, bad.code, bad.type)
    return req.vectors


def parse_llama(raw: bytes) -> tuple[dict, list]:
    """llama-server's /embedding body and its prompts, or Refused: `input`, else `content` (a string; a list of
    token ids and strings, one prompt; or a list of such prompts), as its handle_embeddings_impl reads them. Each
    prompt comes back as a str, a list of ids, or a list mixing both (llama_prompt_ids tokenizes it)."""
    data = json_object(raw)
    where = "input" if "input" in data else "content"
    if where not in data:
        raise Refused(400, '"input" or "content" must be provided', None)
    value = data[where]

    def number(x):
        return isinstance(x, int) and not isinstance(x, bool)
    if isinstance(value, str):
        prompts = [value]
    elif isinstance(value, list) and any(number(x) for x in value):
        prompts = [value]   # ids, or ids and strings: one prompt (llama.cpp's json_is_array_and_contains_numbers)
    elif isinstance(value, list):
        prompts = value
    else:
        raise Refused(400, f"{where}: expected a string, token ids, or a list of them", where)
    if not prompts:
        raise Refused(400, f"{where}: an empty list has nothing to embed", where)
    if len(prompts) > MAX_INPUTS:
        raise Refused(400, f"{where}: {len(prompts)} items; at most {MAX_INPUTS} in one request", where)
    for i, p in enumerate(prompts):
        name = where if value is p else f"{where}.{i}"
        if isinstance(p, str):
            if not p:
                raise Refused(400, f"{name}: an empty string has nothing to embed", where)
        elif isinstance(p, list) and p and all(number(x) or isinstance(x, str) for x in p):
            if not any(number(x) or x for x in p):
                raise Refused(400, f"{name}: nothing to embed", where)
        elif isinstance(p, list) and not p:
            raise Refused(400, f"{name}: an empty list of token ids has nothing to embed", where)
        else:
            raise Refused(400, f"{name}: expected a string, or a list of token ids and strings (image and other "
                          "content parts are not supported)", where)
    return data, prompts


def llama_prompt_ids(eng, prompts: list) -> list:
    """The prompts as tokenized() takes them: a str or a list of ids as they are; a list mixing ids and strings
    tokenized piece by piece, BOS first when it starts with a string (as /completion's prompt)."""
    from .llama_api import prompt_ids
    return [p if isinstance(p, str) or all(not isinstance(x, str) for x in p) else prompt_ids(eng, p)
            for p in prompts]


def register(app, state, ready, api_error: type, check_model, *, metrics=None):
    """Add the embeddings routes to `app` (serve/app.py's create_app): ready(request) -> the engine or raises
    api_error; check_model(name) applies --strict-model-name (OpenAI's shape)."""
    from .ollama import (OllamaError, check_model_name, load_wait_ns, option_int, option_stops, parse_keep_alive,
                         read_object, ready_engine, sampling_from_options)

    def openai_error(e: Refused):
        return api_error(e.status, e.message, e.type, e.param, e.code,
                         {"Retry-After": str(state.retry_after)} if e.status == 503 else None)

    @app.post("/v1/embeddings", openapi_extra=OPENAPI_BODY)
    async def embeddings(request: Request):
        eng = ready(request)
        try:
            raw = await request.body()
            body, items = await run_off_loop(parse_openai, raw) if len(raw) > OFFLOAD_BYTES else parse_openai(raw)
            check_model(body.model)
            pooled_only(eng)
            fmt = "float" if body.encoding_format is None else body.encoding_format   # "" is no format
            if fmt not in ("float", "base64"):
                raise Refused(400, f"encoding_format {json_text(fmt)}"
                                   ": expected \"float\" or \"base64\"", "encoding_format")
            check_dimensions(eng, body.dimensions)
            normalize = check_normalize(eng, body.embd_normalize)
            ids = await tokenized(eng, items, "input")
            vectors = await run_embed(eng, state, request, ids, metrics, normalize)
        except Refused as e:
            raise openai_error(e) from None
        if vectors is None:
            return gone()

        def encode(v: np.ndarray):
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" else v.tolist()
        n = sum(len(t) for t in ids)
        return await json_answer(lambda: {
            "object": "list", "model": state.model_id,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}})

    # ---- ollama ----
    def engine(request: Request):
        return ready_engine(ready, api_error, request)

    def ollama_model(name):
        check_model_name(state, name)

    async def ollama_body(request: Request, eng) -> dict:
        """The body, its `options` checked as /api/generate checks them (the same 400 for one that is not an
        option or a bad value; the sampling ones are then ignored, as ollama ignores them here: nothing samples),
        `keep_alive`, `truncate` and `dimensions` checked."""
        data = await read_object(request)
        options = data.get("options")
        if options is not None and not isinstance(options, dict):
            raise OllamaError(400, "options: expected an object")
        sampling_from_options(options, None)
        for key in ("num_ctx", "num_predict"):
            option_int(options or {}, key)
        option_stops(options or {})
        if data.get("keep_alive") is not None:
            try:
                parse_keep_alive(data["keep_alive"])
            except ValueError as e:
                raise OllamaError(400, str(e)) from None
        truncate = data.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise OllamaError(400, "truncate: expected true or false")
        try:
            check_dimensions(eng, data.get("dimensions"))   # a load request (no input) too
        except Refused as e:
            raise OllamaError(400, e.message) from None
        return data

    async def ollama_vectors(eng, request, data, texts, where, truncate=False, one=False):
        """The token lists and vectors of `texts`, options.num_ctx a bound below the context (cut or refused as
        `truncate` says), as ollama's EmbedHandler."""
        try:
            pooled_only(eng)
            num_ctx = option_int(data.get("options") or {}, "num_ctx")
            ids = await tokenized(eng, texts, where, truncate, one, num_ctx)
            return ids, await run_embed(eng, state, request, ids, metrics)
        except Refused as e:
            raise OllamaError(e.status, e.message) from None

    @app.post("/api/embed")
    async def api_embed(request: Request):
        t0 = time.perf_counter()
        eng = engine(request)
        data = await ollama_body(request, eng)
        ollama_model(data.get("model"))
        value, truncate = data.get("input"), data.get("truncate")
        if value is None or value == "" or value == []:   # ollama: nothing to embed is an empty list (a load)
            return {"model": state.model_id, "embeddings": []}
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise OllamaError(400, "input: expected a string or a list of strings")
        if len(texts) > MAX_INPUTS:   # as /v1/embeddings: 4 MB of "a", is 800k texts and a response of gigabytes
            raise OllamaError(400, f"input: {len(texts)} items; at most {MAX_INPUTS} in one request")
        empty = [i for i, t in enumerate(texts) if not t]
        if empty:
            raise OllamaError(400, f"input.{empty[0]}: an empty string has nothing to embed")
        # ollama's default is true: only an explicit false refuses a text over the context
        ids, vectors = await ollama_vectors(eng, request, data, texts, "input", truncate is not False)
        if vectors is None:
            return gone()
        load_ns = load_wait_ns(request)   # the router's wait for this model's load (ollama counts it)
        return await json_answer(lambda: {
            "model": state.model_id, "embeddings": [v.tolist() for v in vectors],
            "total_duration": max(0, int((time.perf_counter() - t0) * 1e9)) + load_ns, "load_duration": load_ns,
            "prompt_eval_count": sum(len(t) for t in ids)})

    @app.post("/api/embeddings")
    async def api_embeddings(request: Request):
        eng = engine(request)
        data = await ollama_body(request, eng)
        ollama_model(data.get("model"))
        prompt = data.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise OllamaError(400, "prompt: expected a string")
        if not prompt:   # ollama answers an empty prompt with an empty embedding
            return {"embedding": []}
        # /api/embed's truncate, but false when left out, as before: ollama's older route has no such field
        _, vectors = await ollama_vectors(eng, request, data, [prompt], "prompt", data.get("truncate") is True,
                                          one=True)
        if vectors is None:
            return gone()
        return {"embedding": vectors[0].tolist()}

    # ---- llama-server ----
    async def llama_embedding(request: Request):
        """llama-server's /embedding: [{"index": i, "embedding": [vector]}] a prompt; with --pooling none,
        "embedding" holds the prompt's rows, one per token, as they are."""
        eng = ready(request)
        try:
            raw = await request.body()
            data, prompts = await run_off_loop(parse_llama, raw) if len(raw) > OFFLOAD_BYTES else parse_llama(raw)
            if isinstance(data.get("model"), str):
                check_model(data["model"])
            fmt = "float" if data.get("encoding_format") is None else data["encoding_format"]   # null: the default
            if fmt != "float":
                raise Refused(400, f"encoding_format {json_text(fmt)}: this route answers floats, as llama-server's "
                              "(base64 is /v1/embeddings')", "encoding_format")
            normalize = check_normalize(eng, data.get("embd_normalize"))
            check_dimensions(eng, data.get("dimensions"))   # as the other routes: taken only as the model's width
            where = "input" if "input" in data else "content"
            items = await run_off_loop(llama_prompt_ids, eng, prompts)
            ids = await tokenized(eng, items, where, one=prompts[0] is data[where])   # one prompt: named alone
            if eng.pooling == "none" and sum(len(t) for t in ids) > eng.n_ctx:
                raise Refused(400, f"{where}: {sum(len(t) for t in ids)} tokens; with --pooling none every token "
                              f"is a vector, at most {eng.n_ctx} (the context) in one request",
                              where, "context_length_exceeded")
            vectors = await run_embed(eng, state, request, ids, metrics, normalize)
        except Refused as e:
            raise openai_error(e) from None
        if vectors is None:
            return gone()
        rows = (lambda v: v.tolist()) if eng.pooling == "none" else (lambda v: [v.tolist()])
        return await json_answer(lambda: [{"index": i, "embedding": rows(v)} for i, v in enumerate(vectors)])

    app.add_api_route("/embedding", llama_embedding, methods=["POST"])
    app.add_api_route("/embeddings", llama_embedding, methods=["POST"], include_in_schema=False)   # its alias


def gone():
    """The answer to a client that went away while its texts ran (nobody reads it)."""
    return Response(status_code=499)
