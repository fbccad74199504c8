"""The one streaming generator (consumed by `bitnet run`, bitchat and benchmarks through engine/api.py).

generate() reuses the longest common prefix of the prompt with the tokens already in the KV cache,
prefills the rest in chunks, then samples / decodes one token at a time, yielding a Chunk per token (text
may be "" while a UTF-8 character is incomplete or might start a stop string) with the running Stats, and a
final Chunk with the finish reason and the final Stats. The cache only ever advances by fully processed tokens, so a consumer that stops
iterating (break, Ctrl-C) leaves it consistent. With prompt lookup on (engine/speculative.py), a draft is
verified in one Model.verify pass and each token is still sampled from its own row of logits, in order, with
the same sampler: the output is the same as without it; rejected positions are truncated from the cache.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ..errors import BitNetError, ContextOverflowError
from .constraints import compile_constraint
from .reasoning import budget_matcher
from .sampling import Sampler, SamplingParams, TokenLogprob
from .speculative import DraftLength, LookupParams, PromptLookup, checked_lookup, choose_draft, default_lookup

FINISH_MESSAGES = {
    "eos": "end of sequence",
    "stop": "stop string",
    "length": "max tokens reached",
    "context": "context window full: generation stopped",
}


@dataclass(slots=True)
class Stats:
    """Where a generation stands. Every Chunk carries a fresh one (as mlx-lm's stream_generate does), so a
    consumer that stops early (Ctrl-C) still has the engine's numbers; the final Chunk's has the finish reason.
    Slotted: one small object per token, a fraction of a microsecond next to a decode step."""
    n_prompt: int          # prompt tokens
    n_cached: int          # of which reused from the KV cache
    n_generated: int       # tokens sampled so far (the eos token counts)
    load_s: float          # model load time of the session
    ttft_s: float          # time to first token: prefill + first sample (0 until then)
    prefill_tps: float     # prompt tokens processed per second (cached ones excluded)
    decode_tps: float      # generated tokens per second after the first, so far
    finish_reason: str | None = None
    n_drafted: int = 0     # prompt-lookup draft tokens verified (engine/speculative.py)
    n_accepted: int = 0    # of which accepted
    stop_word: str | None = None   # the stop string that ended the text (finish reason "stop")


@dataclass(slots=True)
class Chunk:
    text: str
    token: int | None
    finish_reason: str | None = None
    stats: Stats | None = None   # always set by generate() and the batching scheduler: the running Stats
    logprob: TokenLogprob | None = None   # this token's, when SamplingParams.record_logprobs asks for them
    # how many of the generated tokens so far (this one included) have text in the answer released so far: a
    # token is said once the released text reaches past its start. Tokens of a stop string, which the answer
    # leaves out, are never said (logprobs give out a token's record with its text, streamed or whole)
    said: int = 0


ONE_AT_A_TIME = "one LLM generates one text at a time (its KV cache is one); load_engine() serves many"


def whole_number(value, name: str, minimum: int = 0, flag: str = "") -> int:
    """A count the Python API takes (max_tokens, threads, ctx): an int (numpy's too) >= minimum, else one
    BitNetError naming it, and the command line's flag for it (a float was truncated, a str failed deep inside)."""
    said = f"{name} {value!r}" + (f" ({flag})" if flag else "")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BitNetError(f"{said}: must be a whole number (int), not {type(value).__name__}")
    if value < minimum:
        raise BitNetError(f"{said}: must be >= {minimum}")
    return int(value)


def stop_strings(stop) -> tuple[str, ...]:
    """The stop strings of a call: one str is one stop string (OpenAI's `stop: string | array`, which a str
    iterated letter by letter was not), None is none, else a sequence of str; an empty one is refused."""
    if stop is None:
        return ()
    if not isinstance(stop, str) and (isinstance(stop, (bytes, bytearray, dict)) or not hasattr(stop, "__iter__")):
        raise BitNetError(f"stop: a string or a list of strings, not {type(stop).__name__}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str):
            raise BitNetError(f"stop: every stop sequence must be a string, not {type(s).__name__} ({s!r})")
        if not s:   # it never matched, in silence; the HTTP APIs' 400 in their words
            raise BitNetError("stop: an empty stop string (each must be non-empty)")
    return stops


def superseded(model) -> BitNetError:
    closed = model.taken_by.startswith("close()")   # not another generation: the one-at-a-time advice is beside it
    return BitNetError(f"this generation was superseded by {model.taken_by} on the same model",
                       hint=None if closed else ONE_AT_A_TIME)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _StopMatcher:
    """Holds back text that could be the start of a stop string; reports where a stop string ends, and how many
    of the tokens fed (one feed per token) have text released (`said`)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None   # the stop string found
        self.said = 0        # tokens whose text has begun to be released
        self._fed = 0        # characters fed so far
        self._starts: deque[int] = deque()   # where each token not yet said begins, in characters fed

    def feed(self, text: str, token: bool = True) -> tuple[str, bool]:
        """One token's text (token False: text of no token of its own) -> (text safe to emit now, stopped)."""
        if not self.stops:
            self.said += token
            return text, False
        if token:
            self._starts.append(self._fed)
        self._fed += len(text)
        self.pending += text
        best = -1
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched = i, s
        if best >= 0:
            out = self.pending[:best]
            self._release(self._fed - len(self.pending) + best)   # the tokens past the cut are never said
            self.pending = ""
            return out, True
        hold = 0
        for s in self.stops:  # longest suffix of pending that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        self._release(self._fed - hold)
        return out, False

    def _release(self, upto: int):
        while self._starts and self._starts[0] < upto:
            self._starts.popleft()
            self.said += 1

    def flush_text(self, text: str) -> str:
        """At an end other than a stop string: the detokenizer's last text (`text`) and everything held back,
        as far as a stop string in them; every token is said."""
        out, _ = self.feed(text, token=False)
        out += self.pending
        self.pending = ""
        self.said += len(self._starts)
        self._starts.clear()
        return out


def last_text(detok, reason: str) -> str:
    """The detokenizer's text left at an end: at a cut (max_tokens, the context) the bytes of a character begun
    are dropped, so the text is a true prefix of the longer one ('日' of '日本語', not '日\ufffd'); at the model's
    own end an incomplete tail stays visible as U+FFFD."""
    return "" if reason in ("length", "context") else detok.flush()


def generate(model, tokenizer, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
             max_tokens: int = 256, stop: Sequence[str] = (), load_s: float = 0.0,
             ignore_eos: bool = False, lookup: LookupParams | None = None, constraint=None,
             cancel=None) -> Iterator[Chunk]:
    """See engine/api.py LLM.generate. ignore_eos: end-of-text tokens can never be sampled (llama.cpp's
    --ignore-eos: their logits are set to -inf), so only length, context or a stop string end the text.
    lookup: prompt-lookup speculation (None: default_lookup(model)). constraint: a Constraint (or a compiled
    one, engine/runtime/constraints.py) every sampled token obeys; the text ends ("eos") once it is complete.
    What is wrong with the request (prompt, settings, constraint) is raised here, before the first next()."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        if tokenizer.bos_id is None:
            raise BitNetError("empty prompt and the model has no BOS token to start from")
        prompt = [tokenizer.bos_id]
    if len(prompt) > model.n_ctx:
        raise ContextOverflowError(f"the prompt has {len(prompt)} tokens but the context holds {model.n_ctx}",
                                   hint=model.context_hint(len(prompt)), n_prompt_tokens=len(prompt),
                                   n_ctx=model.n_ctx)
    max_tokens = whole_number(max_tokens, "max_tokens")
    stop = stop_strings(stop)
    sampler = Sampler(params, model.config.vocab_size, tokenizer)
    compiled = compile_constraint(tokenizer, model.config.vocab_size, constraint)   # errors before any work
    spec = default_lookup(model) if lookup is None else checked_lookup(lookup)
    if cancel is not None and not callable(cancel):
        raise BitNetError("cancel: give a function of no arguments that returns true to stop")
    return _steps(model, tokenizer, prompt, sampler, compiled, max_tokens, stop, load_s, ignore_eos, spec, cancel)


def _steps(model, tokenizer, prompt: list[int], sampler: Sampler, compiled, max_tokens: int, stop: Sequence[str],
           load_s: float, ignore_eos: bool, spec: LookupParams, cancel=None) -> Iterator[Chunk]:
    """generate()'s tokens, its request already checked."""
    t_start = time.perf_counter()
    eos = set(tokenizer.eos_ids)
    banned = [t for t in eos if 0 <= t < model.config.vocab_size] if ignore_eos else []
    # a newer generate() on the same model owns the cache from now on; an older generator that is
    # resumed afterwards must not decode into it
    with model.lock:
        if model.closed:   # close() came between generate() and the first next()
            raise BitNetError("this model is closed", hint="load it again with load_model()")
        model.generation += 1
        model.taken_by = "a newer generate() call"
        mine = model.generation
        # reuse the cached prefix; the last prompt token is always run, since its logits pick the first token
        n_cached = common_prefix(model.cache_ids, prompt)
        if n_cached == len(prompt) and max_tokens > 0:
            n_cached -= 1
        model.truncate(n_cached)
        todo = prompt[n_cached:]
        logits = model.prefill(todo, cancel=cancel) if todo else None
        cancelled = bool(todo) and logits is None   # cancel() said stop between two prefill chunks
        n_done = model.n_past - n_cached
    t_prefill = time.perf_counter()
    prefill_s = t_prefill - t_start
    prefill_tps = n_done / prefill_s if n_done and prefill_s > 0 else 0.0

    finder = PromptLookup(spec) if spec.draft_max > 0 and model.verify_max > 1 else None
    draft_len = DraftLength(min(spec.draft_max, model.verify_max - 1)) if finder else None
    cm = budget_matcher(compiled.matcher() if compiled is not None else None, tokenizer, prompt,
                        sampler.p.reasoning_budget, sampler.p.reasoning_budget_message)
    forcing = cm is not None and cm.jump_forward and model.verify_max > 1
    # the verify pass being consumed: rows[i] = logits after draft[:i]; base = n_past before it; j = row in use;
    # looked_up: the draft came from prompt lookup (its length adapts), not from the grammar's forced tokens
    rows, draft, base, j, looked_up = None, [], 0, 0, False
    n_drafted = n_accepted = 0

    n_prompt = len(prompt)

    def stats(n_gen, ttft, dt, reason):   # called per token: positional, in Stats' field order (cheaper)
        return Stats(n_prompt, n_cached, n_gen, load_s, ttft, prefill_tps,
                     (n_gen - 1) / dt if n_gen > 1 and dt > 0 else 0.0, reason, n_drafted, n_accepted,
                     matcher.matched if reason == "stop" else None)

    if cancelled:   # the chunks done stay cached (a next call with the same prompt goes on from there)
        yield Chunk("", None, "cancelled", stats(0, prefill_s, 0.0, "cancelled"))
        return
    if max_tokens == 0:  # prefill only (chat re-prefills a loaded conversation this way)
        yield Chunk("", None, "length", stats(0, prefill_s, 0.0, "length"))
        return
    if cm is not None and cm.done:   # complete before any token (root ::= ""): only end of text could come, and
        yield Chunk("", None, "eos", stats(0, prefill_s, 0.0, "eos"))   # with ignore_eos no token at all
        return

    history = list(prompt)
    stream = tokenizer.stream()
    matcher = _StopMatcher(stop)
    # decode time counts the engine's own work (sampling, detokenizing, decoding), not the consumer's
    n_gen, ttft, decode_s, reason = 0, 0.0, 0.0, None
    t0 = t_start
    try:
        while True:
            with model.lock:   # the logits are the model's buffer: still ours only if no generate() came since
                if model.generation != mine:
                    raise superseded(model)
                if banned:
                    logits[banned] = -np.inf
                if cm is not None:
                    cm.apply(logits)
                tok = sampler.sample(logits, history)
            n_gen += 1
            if n_gen == 1:
                ttft = time.perf_counter() - t_start
            else:  # one interval per token after the first: decode of the previous token + this sample
                decode_s += time.perf_counter() - t0
            if tok in eos:
                reason = "eos"
                break
            if cm is not None:
                cm.advance(tok)
            history.append(tok)
            text, stopped = matcher.feed(stream.push(tok))
            yield Chunk(text, tok, None, stats(n_gen, ttft, decode_s, None), sampler.record, matcher.said)
            t0 = time.perf_counter()
            if stopped:
                reason = "stop"
                break
            if cm is not None and cm.done:   # the grammar is complete: only end of text could follow
                reason = "eos"
                break
            if n_gen >= max_tokens:
                reason = "length"
                break
            # the model's cache is one: a step runs under its lock, and a generate() started since (another
            # thread's, or a newer call in this one) has taken it over
            with model.lock:
                if model.generation != mine:
                    raise superseded(model)
                if (base + j + 1 if rows is not None else model.n_past) >= model.n_ctx:
                    reason = "context"
                    break
                if rows is not None:
                    if j < len(draft) and tok == draft[j]:  # accepted: its logits are already computed
                        j += 1
                        n_accepted += 1
                        logits = rows[j]
                        if j == len(draft):
                            if looked_up:
                                draft_len.update(len(draft), j)
                            rows = None
                        continue
                    if looked_up:
                        draft_len.update(len(draft), j)
                    model.truncate(base + j + 1)  # rejected: drop the positions after the last accepted token
                    rows = None
                # no draft past the context or past the tokens still wanted (the last one needs no check)
                room = min(model.verify_max - 1, model.n_ctx - model.n_past - 1, max_tokens - n_gen - 1)
                lookup = finder is not None and draft_len.ready()
                draft, looked_up = choose_draft(cm, room if forcing else 0, finder if lookup else None, history,
                                                min(room, draft_len.k) if lookup else 0)
                if draft:
                    base, j = model.n_past, 0
                    rows = model.verify([tok] + draft)
                    n_drafted += len(draft)
                    logits = rows[0]
                    continue
                if cm is not None:
                    cm.start_mask()   # the next mask is computed while the forward pass runs
                logits = model.decode(tok)
    finally:  # the cache keeps only processed tokens (also when the consumer stops iterating)
        with model.lock:
            if rows is not None and model.generation == mine:
                model.truncate(base + j + 1)
    if reason != "stop":
        rest = matcher.flush_text(last_text(stream, reason))
        if rest:
            yield Chunk(rest, None, None, stats(n_gen, ttft, decode_s, None), said=matcher.said)
    yield Chunk("", None, reason, stats(n_gen, ttft, decode_s, reason), said=matcher.said)
