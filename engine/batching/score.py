"""Prompt scoring through the batching engine (a mixin of BatchScheduler, engine/batching/scheduler.py): the
log-probability of every prompt token given the ones before it, and the best k alternatives at each position,
what OpenAI's legacy completions return for `echo` with `logprobs` (the way lm-evaluation-harness and other
evaluation tools score a continuation against a server).

A scoring request is a prefill-only sequence, as an embedding is (engine/batching/embed.py): queued, admitted and
run in prefill chunks beside the generations, never sampled. After each step its rows go through the final norm
and the LM head (in pieces of the head's row buffer, after the step's own sampling is done with it) and each row's
log-softmax is taken for the next prompt token (engine/runtime/sampling.token_logprob, the arithmetic a sampled
token's logprob gets). It reuses no cached prefix (every row's logits are needed) and leaves none; once its last
token has run the result goes to the request and the sequence retires.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..errors import BitNetError, token_ids
from ..runtime.generate import whole_number
from ..runtime.sampling import SamplingParams, TokenLogprob, token_logprob
from .stream import OneShot, Stream, checked_timeout

SCORED = "scored"   # the finish reason of a scoring sequence that delivered its result


class ScoreRequest(OneShot):
    """The consumer's end of one scoring request: result() blocks for the list of len(ids) - 1 TokenLogprob
    (entry i: token i + 1 given tokens 0..i); or pass callback(request) to submit_score, called once on the
    scheduler thread when it is done or failed."""

    what = "scores"

    def __init__(self, engine, ids: Sequence[int], top_k: int, callback):
        super().__init__(engine, callback)
        self.ids, self.top_k = list(ids), int(top_k)
        self.logprobs: list[TokenLogprob] = []
        self.sid: int | None = None

    def result(self, timeout: float | None = None) -> list[TokenLogprob]:
        self._wait(timeout)
        return self.logprobs

    def cancel(self):
        if self.sid is not None:
            self._engine.cancel(self.sid)


class Scoring:
    scored_tokens_total = 0   # prompt tokens scored (BatchScheduler.metrics)

    def submit_score(self, ids: Sequence[int], top_k: int = 0,
                     callback: Callable[[ScoreRequest], None] | None = None) -> ScoreRequest:
        """Queue the scoring of a prompt of 1..n_ctx token ids (never blocks): for each position after the
        first, the log-probability of its token and the best `top_k` (0..20) tokens there. QueueFullError when
        max_queue requests wait; ContextOverflowError / BitNetError for ids that do not fit or are not tokens."""
        ids = token_ids(ids, "ids", text_ok=False)   # a float, a str of digits, bytes: refused, not converted
        if not ids:
            raise BitNetError("no tokens to score")
        top_k = whole_number(top_k, "top_k")
        if top_k > 20:
            raise BitNetError(f"top_k {top_k}: must be in 0..20")
        if callback is not None and not callable(callback):
            raise BitNetError(f"callback: a function of the request, not {type(callback).__name__}")
        self._check_ids(ids)
        req = ScoreRequest(self, ids, top_k, callback)
        with self._lock:
            self._check_admission()
            sid = next(self._ids)
            stream = Stream(sid, self, lambda ch: req._end(ch.finish_reason)
                            if ch.finish_reason not in (None, SCORED) else None)
            seq = self._new_seq(sid, ids, SamplingParams(temperature=0), 0, (), stream, self.tokenizer,
                                self.config.vocab_size)
            seq.embed = req   # prefill-only, as an embedding (the scheduler's checks), handled by _score_rows
            req.sid = sid
            self._waiting.append(seq)
            self._by_id[sid] = seq
            self.requests_total += 1
            self._wake.notify()
        return req

    def score_ids(self, ids: Sequence[int], top_k: int = 0, timeout: float | None = None) -> list[TokenLogprob]:
        """submit_score and wait (a timeout or Ctrl-C cancels it)."""
        timeout = checked_timeout(timeout)   # before the ids run
        return self.submit_score(ids, top_k).wait(timeout)

    def _score_rows(self, s, row0: int, r: int):
        """s (a scoring sequence) ran rows row0 .. row0+r-1 of the last step, positions s.n_past - r ..
        s.n_past - 1: score the next token of each (the last position has none), then, once the prompt has run,
        hand the result to its request and retire s. Runs after the step's sampling: the head's row buffer is
        free."""
        req: ScoreRequest = s.embed
        try:
            pos0 = s.n_past - r
            rows = [row0 + j for j in range(r) if pos0 + j + 1 < len(s.tokens)]
            step = self.model.max_logit_rows
            for a in range(0, len(rows), step):
                part = rows[a: a + step]
                logits = self.model.head_rows(part)
                for j, row in enumerate(part):
                    nxt = s.tokens[pos0 + (row - row0) + 1]
                    req.logprobs.append(token_logprob(logits[j], nxt, req.top_k))
            self.scored_tokens_total += len(rows)
            if s.n_past < len(s.tokens):
                return
        except Exception as e:   # ends this request only, as a sampling fault ends its sequence
            self._fail(s, e, "its scoring")
            return
        self._finish(s, SCORED)   # pages back first: a consumer woken by the result sees them free
        req._end()
