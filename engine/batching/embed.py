"""Embeddings through the batching engine (a mixin of BatchScheduler, engine/batching/scheduler.py).

A request of n texts becomes n prefill-only sequences: queued, admitted and run in prefill chunks like any prompt
(decode rows of running generations still go first in every step, so a generation keeps making a token per step;
a request that comes later takes the next free slot before the rest of the texts, scheduler._next_waiting),
never sampled and never given logit rows. After each step the rows of an embedding sequence are taken after the
final norm and added to its pool (engine/runtime/embed.py: a running mean by default); once its last token has
run, the vector is normalised and handed to the request, and the sequence retires at once: its KV pages go back to
the pool (they are not put in the prefix index, and no cached prefix is reused, because the pool needs every row).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import BitNetError, token_ids
from ..runtime.embed import NORMALIZE, POOLING, Pool, check_normalize, check_pooling, check_unpooled_norm
from ..runtime.sampling import SamplingParams
from .stream import OneShot, Stream, checked_timeout

EMBEDDED = "embedded"   # the finish reason of an embedding sequence that delivered its vector


class EmbedRequest(OneShot):
    """The consumer's end of one embeddings request: result() blocks for the [n, hidden] float32 vectors (row i:
    text i; pooling none: a list of [n_tokens[i], hidden] arrays); or pass callback(request) to submit_embed,
    called once on the scheduler thread when every text is done or the request failed. n_tokens[i]: the tokens
    text i ran through the model."""

    what = "embeddings"

    def __init__(self, engine, texts: Sequence[Sequence[int]], dim: int, callback, pooling: str = POOLING):
        super().__init__(engine, callback)
        self.n_tokens = [len(t) for t in texts]
        self.pooling = pooling
        self.vectors = [None] * len(texts) if pooling == "none" else np.zeros((len(texts), dim), np.float32)
        self._left = len(texts)
        self.ids: list[int] = []         # the engine's sequence ids (cancel)

    def _put(self, i: int, vec: np.ndarray):
        if self._done.is_set():
            return
        self.vectors[i] = vec
        self._left -= 1
        if self._left == 0:
            self._end()

    def _failed(self, reason: str):
        if self._done.is_set():
            return
        for sid in self.ids:    # the request's other texts need not run
            self._engine.cancel(sid)
        self._end(reason)

    def result(self, timeout: float | None = None):
        self._wait(timeout)
        return self.vectors

    def cancel(self):
        for sid in self.ids:
            self._engine.cancel(sid)


class _Slot:
    """What an embedding sequence carries: its request, its index there, its pool."""

    def __init__(self, req: EmbedRequest, i: int, dim: int, normalize: int):
        self.req, self.i, self.pool = req, i, Pool(dim, req.pooling, normalize)


class Embeddings:
    embed_inputs_total = 0   # texts embedded (BatchScheduler.metrics: embed_inputs_total)
    pooling = POOLING         # what a request that names none gets (load_engine's pooling / embd_normalize)
    embd_normalize = NORMALIZE

    def submit_embed(self, texts: Sequence[Sequence[int]],
                     callback: Callable[[EmbedRequest], None] | None = None, *, pooling: str | None = None,
                     normalize: int | None = None) -> EmbedRequest:
        """Queue the token lists of n texts (never blocks). Each must have 1..n_ctx tokens (ContextOverflowError
        names the one that does not fit, BitNetError an empty one or an id outside the vocabulary); QueueFullError
        when max_queue requests wait (the request counts as one, whatever its n). pooling / normalize: as
        engine/runtime/embed.py's check_pooling / check_normalize take them (None: the engine's own)."""
        pooling = check_pooling(self.pooling if pooling is None else pooling)
        if normalize is not None:
            check_normalize(normalize, "normalize")   # this argument's name (embd_normalize is the server's field)
            check_unpooled_norm(pooling, normalize)   # asked of rows that are never normalised: said, not dropped
        normalize = check_normalize(self.embd_normalize if normalize is None else normalize)
        vocab, dim = self.config.vocab_size, self.config.hidden_size
        if texts is None or isinstance(texts, (str, bytes)) or not hasattr(texts, "__iter__"):
            raise BitNetError(f"texts: give lists of token ids, not {type(texts).__name__}")
        texts = list(texts)

        def name(i):   # counted as LLM.embed and `bitnet embed` count texts: "text 2 of 3", from 1
            return f"text {i + 1} of {len(texts)}"
        texts = [token_ids(ids, name(i), text_ok=False) for i, ids in enumerate(texts)]
        if not texts:
            raise BitNetError("no texts to embed")
        for i, ids in enumerate(texts):
            if not ids:
                raise BitNetError(f"{name(i)}: no tokens to embed")
            self._check_ids(ids, name(i))   # BatchScheduler's: the vocabulary and the context
        req = EmbedRequest(self, texts, dim, callback, pooling)
        params = SamplingParams(temperature=0)
        with self._lock:
            self._check_admission()
            for i, ids in enumerate(texts):
                sid = next(self._ids)
                stream = Stream(sid, self, lambda ch, req=req: req._failed(ch.finish_reason)
                                if ch.finish_reason not in (None, EMBEDDED) else None)
                seq = self._new_seq(sid, ids, params, 0, (), stream, self.tokenizer, vocab)
                seq.embed = _Slot(req, i, dim, normalize)
                req.ids.append(sid)
                self._waiting.append(seq)
                self._by_id[sid] = seq
            self.requests_total += 1
            self._wake.notify()
        return req

    def embed_ids(self, texts: Sequence[Sequence[int]], timeout: float | None = None, *, pooling: str | None = None,
                  normalize: int | None = None):
        """submit_embed(texts, pooling=, normalize=) and wait (a timeout or Ctrl-C cancels it): [n, hidden] float32
        (by default mean-pooled and L2-normalised: engine/runtime/embed.py), or a list of [tokens, hidden] rows for
        pooling none."""
        timeout = checked_timeout(timeout)   # before the texts run
        return self.submit_embed(texts, pooling=pooling, normalize=normalize).wait(timeout)

    def _embed_rows(self, s, row0: int, r: int):
        """s (an embedding sequence) ran rows row0 .. row0+r-1 of the last step: pool them; once its last token
        has run, hand the vector to its request and retire s (pages back to the pool)."""
        slot = s.embed
        try:
            slot.pool.add(self.model.final_norm(row0, row0 + r))
            if s.n_past < len(s.tokens):
                return
            vec = slot.pool.result()
        except Exception as e:   # ends this text's request only, as a sampling fault ends its sequence
            self._fail(s, e, "its pooling")
            return
        slot.req._put(slot.i, vec)
        self.embed_inputs_total += 1
        self._finish(s, EMBEDDED)
