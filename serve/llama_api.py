"""llama-server's own endpoints that clients use beside OpenAI's: `/tokenize`, `/detokenize`, `/apply-template`
(a conversation through the model's chat template) and `/props` (the server's defaults, slots and template).
Token counting, prompt previews and front ends written for llama-server (its web UI, SillyTavern, editors'
plugins) call them. Shapes follow llama-server's README; what differs is in docs/api.md. Nothing here knows of
kernels: the engine's tokenizer and template (engine/api.py).
"""
from __future__ import annotations

from typing import Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from .offload import run_off_loop, too_long_for_context
from .schemas import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: str
    add_special: bool = False     # BOS first, as the model's prompts start
    parse_special: bool = True    # special tokens written in the text ("<|eot_id|>") are those tokens
    with_pieces: bool = False     # [{"id", "piece"}]: the piece a string if valid UTF-8, else its bytes


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class ApplyTemplateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[dict]] = None
    add_generation_prompt: bool = True


def piece_of(text_of, i: int):
    """A token's piece as llama-server gives it: its text if its bytes are valid UTF-8, else the bytes."""
    _, b = text_of(i)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def register(app, state, ready, api_error: type, *, sampling=None):
    """Add the routes to `app` (serve/app.py's create_app); ready(request) -> the engine or raises api_error."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        eng = ready(request)
        msg = await too_long_for_context(eng, len(body.content))   # the prompts' bound: tokenizing holds the GIL
        if msg:                                                      # (4 MiB of text: 2.4 s of every stream)
            raise api_error(400, msg, param="content", code="context_length_exceeded")
        ids = await run_off_loop(eng.tokenize, body.content, add_bos=body.add_special, special=body.parse_special)
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
        msgs = [m.as_dict() for m in body.messages]
        msg = await too_long_for_context(eng, sum(len(m["content"]) for m in msgs))
        if msg:
            raise api_error(400, msg, param="messages", code="context_length_exceeded")
        try:
            prompt = await run_off_loop(eng.chat_text, msgs, body.add_generation_prompt, body.tools)
        except Exception as e:   # the template rejected the conversation (roles out of order, bad tools)
            raise api_error(400, f"messages: {e}", param="messages", code="invalid_value") from None
        return {"prompt": prompt}

    @app.get("/props")
    async def props(request: Request):
        from ..engine.runtime.sampling import SamplingParams
        eng = ready(request)
        s = sampling or SamplingParams()
        params = {"n_predict": -1, "seed": -1 if s.seed is None else s.seed, "temperature": s.temperature,
                  "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p, "repeat_last_n": s.repeat_last_n,
                  "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
                  "frequency_penalty": s.frequency_penalty, "stop": [], "max_tokens": -1, "ignore_eos": False,
                  "n_probs": 0, "grammar": ""}
        tok = eng.tokenizer
        bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
        eos = tok.id_to_token(tok.eos_ids[0]) if tok.eos_ids else None
        from .. import engine as _engine
        return {"default_generation_settings": {"n_ctx": eng.n_ctx, "params": params},
                "total_slots": getattr(eng, "parallel", 1), "model_path": eng.store.path,
                "model_alias": state.model_id, "chat_template": eng.store.chat_template or "",
                "bos_token": bos, "eos_token": eos, "modalities": {"vision": False, "audio": False},
                "build_info": f"bitnet-cpu {_engine.__version__}"}
