"""Keep large work off the event loop: one slow request must never delay another one's tokens.

- `OffloopRoute`: FastAPI's route class whose request parses its JSON body in a worker thread (json.loads of
  an 8 MB body holds the loop ~30-60 ms here otherwise); validation and the OpenAPI schema are unchanged.
- `too_long_for_context(eng, n_chars)`: a prompt of more characters than (bytes of the tokenizer's longest
  token x the context) cannot fit, whatever the tokenizer makes of it (a character is at least one byte), so
  it is refused before it is rendered or tokenized (a 10 MB prompt tokenized on the loop stalled every other
  client for 19 s). Rendering and tokenizing the rest: `await run_off_loop(fn, ...)`.
"""
from __future__ import annotations

import asyncio
import json
import weakref

from fastapi import Request
from fastapi.routing import APIRoute

# normalizers may drop characters (zero-width, accents): allow twice the strict bound before refusing unseen
SAFETY = 2


class OffloopRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(json.loads, body) if len(body) > 64 << 10 else json.loads(body)
        return self._json


class OffloopRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(OffloopRequest(request.scope, request.receive))
        return route_handler


_longest: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_bytes(tok) -> int:
    """UTF-8 bytes of the tokenizer's longest token (its exact bytes for byte-level BPE, else its piece's text,
    which is as long or longer: '▁' is 3 bytes for one space, '<0xE3>' 6 for one byte)."""
    n = _longest.get(tok)
    if n is None:
        n = 1
        for i in range(tok.vocab_size):
            b = tok.token_bytes(i)
            if b is None:
                t = tok.id_to_token(i)
                b = t.encode("utf-8", "surrogatepass") if t else b""
            n = max(n, len(b))
        _longest[tok] = n
    return n


async def too_long_for_context(eng, n_chars: int) -> str | None:
    """A message when `n_chars` characters of prompt cannot fit the context, else None."""
    bound = SAFETY * eng.n_ctx * await asyncio.to_thread(longest_token_bytes, eng.tokenizer)
    if n_chars <= bound:
        return None
    return (f"the prompt has {n_chars} characters; the context holds {eng.n_ctx} tokens, at most ~{bound} "
            f"characters of prompt")


async def run_off_loop(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)
