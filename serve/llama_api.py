"""llama-server's own endpoints that clients use beside OpenAI's: `/completion` (its native completion API, also
at `/completions`), `/tokenize`, `/detokenize`, `/apply-template` (a conversation through the model's chat
template) and `/props` (the server's defaults, slots and template). Token counting, prompt previews and front
ends written for llama-server (its web UI, SillyTavern, editors' plugins) call them. Shapes follow llama-server's
README; what differs is in docs/api.md. `/completion` runs on the OpenAI endpoints' pipeline (serve/app.py's
submit, constraint and collection, passed in as `pipe`). Nothing here knows of kernels.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field, field_validator

from ..engine import __version__
from ..engine.runtime.chat_template import choose_template   # the one rendered: the fallback too
from ..engine.runtime.sampling import SamplingParams
from .logprobs import chat_entry
from .fim import INFILL_FIELDS, NO_FIM, cut_to, extra_chunks, fim_ends, fim_tokens, field_refusal, infill_ids
from .fim import off as fim_off
from .offload import Streamed, chars_bound, run_off_loop, too_long_for_context
from .schemas import (CHAIN, SAMPLER_ALIASES, ChatMessage, JSONTyped, RequestProblem, ToolMessages,
                      _Sampling, continuation, json_text, shown_path, tools_refused, unanswered)

# fields /completion takes but cannot honour: their "off" values (taken, as clients send them), and why any other
# is refused, naming /completion's own field where there is one (the mirror of /v1/completions' n_probs refusal)
NOT_HERE = {
    "logprobs": ((None, False), "the OpenAI endpoints' field; on /completion ask for n_probs (0..20)"),
    "top_logprobs": ((None,), "the OpenAI endpoints' field; on /completion ask for n_probs (0..20)"),
    "echo": ((None, False), "not supported on /completion (the answer's `prompt` field is the prompt it ran)"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "max_completion_tokens": ((None,), "the chat endpoint's field; on /completion set n_predict (or max_tokens)"),
    "return_progress": ((None, False), "prompt-processing progress is not reported"),
    "n_cmpl": ((None, 1), "/completion gives one completion (send several requests, or use /v1/completions' n)"),
    "chat_template_kwargs": ((None, {}), "/completion takes a raw prompt, with no chat template to pass them to "
                                         "(/v1/chat/completions and /apply-template take them)"),
}
# llama-server's endpoints for what this server has not: a POST to any of these paths is a 501 saying why (it was
# a bare 404 / 405), from a model's server (serve/app.py) and from the --models-dir router alike, no model loaded
NOT_SERVED = {
    ("/v1/fim/completions",): "/v1/fim/completions (Mistral's fill-in-the-middle API) is not served here: send "
                              "prompt and suffix to /v1/completions, or input_prefix and input_suffix to /infill "
                              "(for a model whose vocabulary has fill-in-the-middle tokens)",
    ("/beta/completions",): "/beta/completions (DeepSeek's fill-in-the-middle API) is not served here: send prompt "
                            "and suffix to /v1/completions, or input_prefix and input_suffix to /infill (for a model "
                            "whose vocabulary has fill-in-the-middle tokens)",
    ("/slots/{id_slot}",): "slot actions (save, restore, erase) are not supported: the prefix cache keeps recent "
                           "prompts' KV by itself",
    ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        "reranking is not supported: no reranking model is served here (/v1/embeddings gives vectors to compare)",
    ("/props",): "POST /props is not supported: /props is read-only here (GET); the server's settings are its flags, "
                 "changed by a restart",
}
# of those, the paths a GET serves: a POST there is HTTP's 405 (Allow: GET, HEAD) with the reason, not a 501 (a
# method the path does not take is a client's error; fuzzers and HTTP tools expect 405)
READ_ONLY = ("/props",)
LORA_WHY = ("LoRA adapters are not supported: none is loaded here (GET /lora-adapters lists none), so there is no "
            "scale to set")


def lora_request_is_empty(body: bytes) -> bool:
    """POST /lora-adapters with [] (every adapter's scale, of none) asks for nothing: llama-server's success."""
    try:
        return len(body) <= 64 and json.loads(body) == []
    except (ValueError, RecursionError):
        return False


STOP_TYPE = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit", "cancelled": "none"}


class NativeCompletionRequest(_Sampling):
    """llama-server's POST /completion body: its names (n_predict, n_probs, logit_bias as pairs) over the
    OpenAI endpoints' sampling fields and checks (temperature without OpenAI's cap)."""
    N_PROBS: ClassVar[bool] = True   # n_probs is this endpoint's own logprobs field
    MAX_TEMPERATURE: ClassVar[Optional[float]] = None
    DRY_BASE_BELOW_1_IS_DEFAULT: ClassVar[bool] = True
    EMPTY_STOP_SKIPPED: ClassVar[bool] = True   # as llama-server skips an empty stop word
    prompt: Union[str, list[Any]]
    max_tokens: Optional[int] = None   # n_predict's other name in llama-server (-1: to the context's end)
    return_tokens: bool = False
    response_fields: Optional[list[str]] = None
    cache_prompt: bool = True     # ignored by design: a cached prefix gives the same bits as a fresh one
    id_slot: Optional[int] = None  # ignored by design: the scheduler places sequences
    n_keep: Optional[int] = None   # ignored by design: the context never shifts (a prompt over it is refused)
    logit_bias: Union[dict[str, float], list[Any], None] = None
    tools: Optional[Any] = None   # llama-server ignores these here; refused (tools_refused), never dropped in silence
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None
    # the OpenAI endpoints' fields and llama-server's that this endpoint cannot honour: read, so that a value other
    # than "off" is refused (NOT_HERE) rather than dropped in silence (max_completion_tokens ran to EOS)
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None            # fill-in-the-middle: /infill's fields and suffix, refused by the route (fim.py)
    input_prefix: Any = None
    input_suffix: Any = None
    input_extra: Any = None
    max_completion_tokens: Any = None
    return_progress: Any = None
    n_cmpl: Any = None
    chat_template_kwargs: Any = None

    def unsupported(self):
        return tools_refused(self) or self.not_here() or super().unsupported()

    def not_here(self) -> Optional[tuple[str, str]]:
        """(param, message) for the first NOT_HERE field set to other than its "off" values."""
        for name, (off, why) in NOT_HERE.items():
            value = getattr(self, name)
            if not any(value is x or (type(value) is type(x) and value == x) for x in off):
                return name, f"{name}: {why}"
        return None

    @field_validator("temperature", mode="before")
    @classmethod
    def _negative_is_greedy(cls, v):   # llama-server: a temperature <= 0 samples greedily
        return 0.0 if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0 else v

    @field_validator("repeat_last_n", mode="before")
    @classmethod
    def _whole_context(cls, v):   # -1: the whole context
        return 1 << 30 if v == -1 else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _pairs(cls, v):
        """[[id, bias], ...] or {id: bias} as OpenAI's {id: bias}; a bias of false is "never" in both forms (as
        llama-server reads them), true is refused (pydantic would read it as +1); strings as keys cannot be
        given here."""
        from pydantic_core import PydanticCustomError

        def bias(key, b):
            if b is True:
                raise PydanticCustomError("invalid_setting", f"logit_bias {key}: a number, or false (never)")
            return -math.inf if b is False else b   # llama-server's: never drawn, whatever the other logits
        if isinstance(v, dict):
            return {k: bias(k, b) for k, b in v.items()}
        if not isinstance(v, list):
            return v
        out = {}
        for pair in v:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise PydanticCustomError("invalid_setting", "logit_bias: [[token id, bias], ...]")
            key = pair[0]
            if isinstance(key, float) and key.is_integer():   # JSON's 14.0 is the integer 14
                key = int(key)
            if isinstance(key, str):
                raise PydanticCustomError("invalid_setting", "logit_bias: [[token id, bias], ...] (a string as the "
                                          "key is not supported: find its ids with /tokenize)")
            if isinstance(key, bool) or not isinstance(key, int):
                raise PydanticCustomError("invalid_setting", f"logit_bias {json_text(key)}"
                                                             ": [[token id, bias], ...] with the "
                                          "token id an integer")
            b, was = bias(key, pair[1]), out.get(str(key))
            if all(isinstance(x, (int, float)) for x in (b, was)):   # a token given twice: its biases add up, as
                b += was                                                # llama-server's (false stays never: -inf)
            out[str(key)] = b
        return out

    def limit(self) -> Optional[int]:   # llama-server: n_predict, else max_tokens; negative: the context's end
        if self.n_predict is None and self.max_tokens is not None:
            return self.max_tokens if self.max_tokens >= 0 else None
        return self.predict_limit(None)

    def record_logprobs(self):
        return self.n_probs or None

    def sampling_params(self, defaults=None):
        """llama-server's penalties: presence / frequency count the last repeat_last_n tokens, prompt included."""
        return dataclasses.replace(super().sampling_params(defaults), penalize_prompt=True)


class InfillRequest(NativeCompletionRequest):
    """llama-server's POST /infill body: /completion's sampling fields, the text before the gap (input_prefix),
    after it (input_suffix), other files' text (input_extra) and the middle's start (prompt, optional)."""
    prompt: str = ""
    input_prefix: str
    input_suffix: str
    input_extra: Optional[list[Any]] = None


def prompt_pieces(prompt, vocab: int) -> list:
    """The one prompt as a list of strings and token ids; refuses several prompts and ids outside the vocabulary
    (ValueError with the message)."""
    if isinstance(prompt, str):
        return [prompt]
    items = prompt
    if len(items) == 1 and isinstance(items[0], (list, str)):   # a one-prompt list
        items = items[0] if isinstance(items[0], list) else [items[0]]
    if not items:
        raise ValueError("prompt: empty")
    if any(isinstance(x, list) for x in items) or (len(items) > 1 and all(isinstance(x, str) for x in items)):
        raise ValueError("prompt: one prompt per request (send several requests; they run batched)")
    return mixed_pieces(items, vocab, "prompt")


def mixed_pieces(items, vocab: int, field: str) -> list:
    """llama-server's tokenize_mixed input: a string, or a list of strings and token ids, each checked (ValueError
    naming field[i]: an id outside the vocabulary, anything else)."""
    if isinstance(items, str):
        return [items]
    if not isinstance(items, list):
        raise ValueError(f"{field}: a string, or a list of strings and token ids")
    for i, x in enumerate(items):
        if isinstance(x, bool) or not isinstance(x, (int, str)):
            raise ValueError(f"{field}[{i}]: a string or a token id")
        if isinstance(x, int) and not 0 <= x < vocab:
            raise ValueError(f"{field}[{i}] {x}: not in the vocabulary (0..{vocab - 1})")
    return items


def prompt_ids(eng, pieces: list, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """Token ids: strings tokenized (special tokens parsed unless parse_special is false), BOS first when the
    prompt starts with a string and add_special (llama-server's tokenize_mixed: ids as they are)."""
    ids: list[int] = []
    for i, x in enumerate(pieces):
        ids += eng.tokenize(x, add_bos=add_special and i == 0, special=parse_special) if isinstance(x, str) else [x]
    return ids


def settings_of(p, n_ctx: int, **extra) -> dict:
    """A SamplingParams in llama-server's generation-settings names."""
    return {"n_ctx": n_ctx, "seed": -1 if p.seed is None else p.seed, "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_last_n": p.repeat_last_n,
            "repeat_penalty": p.repeat_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "dry_multiplier": p.dry_multiplier, "dry_base": p.dry_base,
            "dry_allowed_length": p.dry_allowed_length, "dry_penalty_last_n": p.dry_penalty_last_n,
            "dry_sequence_breakers": list(p.dry_sequence_breakers), "top_n_sigma": p.top_n_sigma,
            "typical_p": p.typical_p,
            "xtc_probability": p.xtc_probability, "xtc_threshold": p.xtc_threshold,
            "dynatemp_range": p.dynatemp_range, "dynatemp_exponent": p.dynatemp_exponent, "mirostat": p.mirostat,
            "mirostat_tau": p.mirostat_tau, "mirostat_eta": p.mirostat_eta, "min_keep": p.min_keep,
            "samplers": list(CHAIN), **extra}


def chain_of(samplers) -> list[str]:
    """The sampler chain a request ran, in llama-server's names: its `samplers` (the chain's names, in the
    chain's order; validated by _Sampling.unsupported), else the whole chain."""
    if samplers is None:
        return list(CHAIN)
    given = {SAMPLER_ALIASES.get(x, x) for x in samplers}
    return [x for x in CHAIN if x in given]


def timings_of(st) -> dict:
    n_pre = st.n_prompt - st.n_cached
    pre_ms = n_pre / st.prefill_tps * 1000 if st.prefill_tps else 0.0
    dec_ms = (st.n_generated - 1) / st.decode_tps * 1000 if st.decode_tps else 0.0
    d = {"cache_n": st.n_cached, "prompt_n": n_pre, "prompt_ms": round(pre_ms, 3),
         "prompt_per_token_ms": round(pre_ms / n_pre, 3) if n_pre else 0.0,
         "prompt_per_second": round(st.prefill_tps, 2), "predicted_n": st.n_generated,
         "predicted_ms": round(dec_ms, 3),
         "predicted_per_token_ms": round(dec_ms / max(1, st.n_generated - 1), 3),
         "predicted_per_second": round(st.decode_tps, 2)}
    if getattr(st, "n_drafted", 0):   # llama-server's, when drafts ran (its web UI shows them)
        d["draft_n"], d["draft_n_accepted"] = st.n_drafted, st.n_accepted
    return d


def pick_fields(obj: dict, fields: list[str]) -> dict:
    """llama-server's response_fields: the named fields only; "a/b" takes obj["a"]["b"] as "a/b"; a missing one
    is left out."""
    out = {}
    for f in fields:
        cur = obj
        for k in f.split("/"):
            cur = cur.get(k) if isinstance(cur, dict) else None
            if cur is None:
                break
        if cur is not None:
            out[f] = cur
    return out


class TokenizeRequest(JSONTyped):
    model_config = ConfigDict(extra="ignore")
    content: Union[str, list[Any]]   # llama-server's tokenize_mixed: a string, or a list of strings and token ids
    add_special: bool = False     # BOS first, as the model's prompts start
    parse_special: bool = True    # special tokens written in the text ("<|eot_id|>") are those tokens
    with_pieces: bool = False     # [{"id", "piece"}]: the piece a string if valid UTF-8, else its bytes


class DetokenizeRequest(JSONTyped):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]   # JSON's integers (JSONTyped): true is not token 1, 3.0 not token 3


class ApplyTemplateRequest(ToolMessages, JSONTyped):
    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[dict]] = None
    add_generation_prompt: Optional[bool] = None   # None: true, unless a final assistant message is continued
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None   # as the chat endpoint takes them


def piece_of(text_of, i: int):
    """A token's piece as llama-server gives it: its text if its bytes are valid UTF-8, else the bytes."""
    _, b = text_of(i)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def register(app, state, ready, api_error: type, pipe, *, sampling=None):
    """Add the routes to `app` (serve/app.py's create_app); ready(request) -> the engine or raises api_error;
    pipe: the generating endpoints' check_model, compile_constraint, sampling_for, submit, run_to_end, Choices,
    Timer, tool_setup."""

    def one_completion(body, eng, where: str):
        pipe.check_model(body.model)
        if body.n != 1:   # one completion per request here, as llama-server's; the OpenAI route has `n`
            raise api_error(400, f"n {body.n}: {where} gives one completion (send several requests, or use "
                            "/v1/completions' n)", param="n", code="invalid_value")

    async def completion(body: NativeCompletionRequest, request: Request):
        eng = ready(request)
        one_completion(body, eng, "/completion")
        for name in ("suffix",) + INFILL_FIELDS:   # fill-in-the-middle: /infill's (they were dropped in silence)
            if not fim_off(getattr(body, name)):
                raise api_error(400, field_refusal(eng, name), param=name, code="unsupported_parameter")
        try:
            pieces = prompt_pieces(body.prompt, eng.config.vocab_size)
        except ValueError as e:
            raise api_error(400, str(e), param="prompt", code="invalid_value") from None
        await pipe.refuse_too_long(eng, sum(len(x) for x in pieces if isinstance(x, str)), "prompt")
        return await answer(body, request, eng, await run_off_loop(prompt_ids, eng, pieces))

    async def infill(body: InfillRequest, request: Request):
        """llama-server's /infill: the middle between input_prefix and input_suffix, after input_extra's files,
        starting with prompt; answered as /completion answers. A model without FIM tokens: a 501 saying so."""
        eng = ready(request)
        fim = fim_tokens(eng.tokenizer)
        if fim is None:
            raise api_error(501, f"/infill: {NO_FIM}", "not_supported_error", code="not_supported")
        one_completion(body, eng, "/infill")
        if not fim_off(body.suffix):
            raise api_error(400, "suffix: /v1/completions' field; /infill takes the text after the gap as "
                            "input_suffix", param="suffix", code="unsupported_parameter")
        try:
            extra = extra_chunks(body.input_extra)
        except ValueError as e:
            raise api_error(400, str(e), param="input_extra", code="invalid_value") from None
        await pipe.refuse_too_long(eng, len(body.prompt), "prompt")   # prefix and suffix: cut to fit, not refused
        prefix, suffix = cut_to(body.input_prefix, body.input_suffix, await chars_bound(eng))
        body._end_ids = fim_ends(eng, fim)
        ids = await run_off_loop(lambda: infill_ids(eng, fim, prefix, suffix, extra,
                                                    eng.tokenize(body.prompt, add_bos=False), body.limit()))
        return await answer(body, request, eng, ids)

    async def answer(body, request: Request, eng, ids: list[int]):
        """/completion's answer (and /infill's) to the prompt `ids`."""
        constraint = await pipe.compile_constraint(eng, body)
        params = await pipe.sampling_for(eng, body)
        streams, q = pipe.submit(eng, body, ids, pipe.loop(), constraint, "prompt", params=params)
        text_of, n_probs = state.token_text(eng), body.n_probs
        head = {"index": 0, "id_slot": -1, "model": state.model_id, "tokens_evaluated": len(ids)}

        def probs(items):
            out = []
            for t, lp in items:
                e = chat_entry(text_of, t, lp, n_probs)
                for (i, _), alt in zip(lp.top[:n_probs], e["top_logprobs"]):
                    alt["id"] = i
                out.append({"id": t, **e})
            return out

        def final(text, tokens, lps, st, whole):
            """The last object: in a stream, what the partial ones did not carry (llama-server's); `whole`: the
            answer's text, for has_new_line."""
            obj = {**head, "content": text, "tokens": tokens if body.return_tokens else [], "stop": True,
                   "tokens_predicted": st.n_generated, "generation_settings": settings_of(
                       params, eng.n_ctx, n_predict=-1 if body.limit() is None else body.limit(),
                       stop=body.stops(), ignore_eos=body.ignore_eos, n_probs=n_probs, grammar=body.grammar or "",
                       samplers=chain_of(body.samplers)),
                   "prompt": eng.detokenize(ids), "has_new_line": "\n" in whole,
                   "truncated": st.finish_reason == "context", "stop_type": STOP_TYPE.get(st.finish_reason, "none"),
                   "stopping_word": st.stop_word or "", "tokens_cached": st.n_cached, "timings": timings_of(st)}
            if n_probs:
                obj["completion_probabilities"] = probs(lps)
            return pick_fields(obj, body.response_fields) if body.response_fields else obj

        if body.stream:
            async def events():
                got, timer, sent, sent_tokens = pipe.Choices(1), pipe.Timer(), 0, 0
                try:
                    while True:
                        _, ch = await q.get()
                        got.add(0, ch, timer)
                        bad = unanswered(ch.finish_reason, state.retry_after, None, request.url.path,
                                         streams[0].id)
                        if bad is not None:   # this request's sequence failed (the others go on), or never started
                            yield "data: " + json.dumps({"error": {"code": bad.status, "message": bad.message,
                                                                   "type": bad.type}}) + "\n\n"
                            return
                        if ch.finish_reason is not None:
                            timer.done(len(ids), got.finals)
                            obj = final(ch.text or "", got.tokens[0][sent_tokens:], got.logprobs[0][sent:], ch.stats,
                                        "".join(got.texts[0]))
                            if getattr(streams[0], "ended_now", False):   # cut short by a stopping server's drain
                                obj["cut_by"] = "shutdown"
                            yield "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"
                            return
                        if ch.text or ch.token is not None:
                            obj = {**head, "content": ch.text, "tokens": [ch.token] if ch.token is not None else [],
                                   "stop": False, "tokens_predicted": len(got.tokens[0])}
                            if n_probs:
                                obj["completion_probabilities"] = probs(got.logprobs[0][sent:])
                                sent = len(got.logprobs[0])
                            if body.timings_per_token and ch.stats is not None:
                                obj["timings"] = timings_of(ch.stats)
                            sent_tokens = len(got.tokens[0])
                            yield "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"
                finally:
                    if got.finals[0] is None:
                        streams[0].cancel()
                    state.streams.discard(streams[0])
            return Streamed(events(), media_type="text/event-stream", headers=pipe.sse_headers)
        got, timer = await pipe.run_to_end(request, streams, q)
        if got is None:
            return Response(status_code=499)
        fin = got.finals[0]
        pipe.refuse_unanswered(got.finals, streams, None, request.url.path)
        timer.done(len(ids), got.finals)
        text = "".join(got.texts[0])
        return final(text, got.tokens[0], got.logprobs[0], fin.stats, text)

    app.add_api_route("/completion", completion, methods=["POST"])
    app.add_api_route("/completions", completion, methods=["POST"], include_in_schema=False)   # its alias
    app.add_api_route("/infill", infill, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        eng = ready(request)
        try:
            pieces = mixed_pieces(body.content, eng.config.vocab_size, "content")
        except ValueError as e:
            raise api_error(400, str(e), param="content", code="invalid_value") from None
        # the prompts' bound: tokenizing holds the GIL (4 MiB of text: 2.4 s of every stream)
        msg = await too_long_for_context(eng, sum(len(x) for x in pieces if isinstance(x, str)))
        if msg:
            raise api_error(400, msg, param="content", code="context_length_exceeded")
        ids = await run_off_loop(prompt_ids, eng, pieces, body.add_special, body.parse_special)
        if not body.with_pieces:
            return {"tokens": ids}
        text_of = state.token_text(eng)
        return {"tokens": [{"id": i, "piece": piece_of(text_of, i)} for i in ids]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        eng = ready(request)
        vocab = eng.config.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise api_error(400, f"tokens[{bad}] {body.tokens[bad]}: not in the vocabulary (0..{vocab - 1})",
                            param=f"tokens[{bad}]", code="invalid_value")
        return {"content": await run_off_loop(eng.detokenize, body.tokens)}

    @app.post("/apply-template")
    async def apply_template(body: ApplyTemplateRequest, request: Request):
        eng = ready(request)
        try:   # as the chat endpoint checks them: a tool result answers a call, a call's arguments are JSON text
            body.check_tool_messages()
        except RequestProblem as e:
            raise api_error(400, str(e), param=e.param, code="invalid_value") from None
        for i, m in enumerate(body.messages):
            j = m.other_part()
            if j is not None:
                raise api_error(400, f"messages.{i}.content.{j}.type {json_text(m.content[j].type)}"
                                     ": this model takes text "
                                "only", param=f"messages.{i}.content.{j}", code="invalid_value")
        msgs = [m.as_dict() for m in body.messages]
        msg = await too_long_for_context(eng, sum(len(m["content"]) for m in msgs))
        if msg:
            raise api_error(400, msg, param="messages", code="context_length_exceeded")
        # a final assistant message is continued, as the chat endpoint continues it (llama-server's default); else
        # add_generation_prompt false renders the conversation as it is
        as_is = body.continue_final_message is False or (
            body.add_generation_prompt is False and not body.continue_final_message and msgs[-1]["role"] != "assistant")
        if as_is:
            head, prefill, gen = msgs, "", body.add_generation_prompt is not False
        else:
            try:
                head, prefill = continuation(msgs, body.continue_final_message, body.add_generation_prompt)
            except RequestProblem as e:
                raise api_error(400, str(e), param=e.param, code="invalid_value") from None
            gen, prefill = True, prefill or ""
        # the request's template variables, as the chat endpoint renders them: a continued answer on a thinking
        # template is not inside a thought
        kwargs = body.chat_template_kwargs
        if prefill and kwargs and kwargs.get("enable_thinking") is True:
            raise api_error(400, "a continued assistant message cannot think first (enable_thinking: true), as "
                            "llama-server refuses it", param="chat_template_kwargs", code="invalid_value")
        if prefill and eng.thinks:
            kwargs = {**(kwargs or {}), "enable_thinking": False}
        tools, _, _ = pipe.tool_setup(eng, body.tools, "auto", None)   # checked and rendered as chat's
        try:
            prompt = await run_off_loop(eng.chat_text, head, gen, tools, kwargs,   # continued above, or not at all
                                        continue_final_message=False) + prefill
        except Exception as e:   # the template rejected the conversation (roles out of order) or the variables
            where = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise api_error(400, str(e) if where != "messages" else f"messages: {e}", param=where,
                            code="invalid_value") from None
        # as llama.cpp's chat code: without the template's BOS when the tokenizer adds one, so the prompt sent on to
        # /completion (llama-server's documented flow) runs with one BOS, not two
        bos = eng.bos_text()
        return {"prompt": prompt[len(bos):] if bos and prompt.startswith(bos) else prompt}

    @app.get("/props")
    async def props(request: Request):
        eng = ready(request)
        params = settings_of(sampling or SamplingParams(), eng.n_ctx, n_predict=-1, stop=[], max_tokens=-1,
                             ignore_eos=False, n_probs=0, grammar="")
        # the strings the chat template is rendered with, so a client rendering chat_template itself with them
        # gets the server's prompt (llama-server's are the same too)
        bos, eos = (t or None for t in eng.template_tokens())
        return {"default_generation_settings": {"n_ctx": eng.n_ctx, "params": params},
                "total_slots": getattr(eng, "parallel", 1), "model_path": shown_path(eng.store.path),
                "model_alias": state.model_id, "chat_template": choose_template(eng.chat_template),
                "bos_token": bos, "eos_token": eos, "modalities": {"vision": False, "audio": False},
                "build_info": f"bitnet-cpu {__version__}"}
