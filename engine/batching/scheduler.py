"""The continuous-batching scheduler: one background thread runs every admitted sequence through shared steps.

Each step: retire cancelled sequences, admit waiting requests whose pages can be promised (longest cached
prefix from the radix index first), then build the step's rows under the token budget -- one row per decoding
sequence first, then prefill chunks in admission order, so a long prompt never stalls the others -- make sure
every written position has a page of its own (allocate, or copy-on-write a shared one), run the batched
forward, sample each sequence with its own sampler, stream its Chunks, and retire the finished ones (pages
back to the pool; full pages stay in the prefix index for later requests until evicted).

With prompt lookup on (lookup=LookupParams, engine/runtime/speculative.py), a decoding sequence whose recent
tokens repeat an earlier n-gram of its own context runs its last sampled token plus up to K draft tokens as
rows of the same step (positions n_past .. n_past+K, logits of every row), in the room the step's token budget
leaves after every other sequence's decode row and the prefill chunks. Its rows are then sampled one by one
exactly as the single-stream generator (engine/runtime/generate.py) samples a verify pass: the draft is kept
while the sampled token equals it, the first mismatch ends the pass, and n_past rolls back to the committed
tokens (the rejected positions are overwritten later). Each emitted token comes from the same logits with the
same sampler state as without lookup, so the output is identical (greedy and seeded). Only committed positions
ever reach the prefix index: a page is indexed once full, i.e. once every position in it is committed.

Chunks are exactly those of engine.generate.generate (per token with the running Stats, then a final one);
finish reasons add "cancelled", "error" (that sequence's sampling, or a forward pass of its rows, raised: _run_plan)
and "excluded" (its grammar, logit_bias and ignore_eos left no token to draw: the request's doing, not a fault).
Only the scheduler thread touches the pool, the index and the model;
submit/cancel/metrics take the lock.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from ..errors import BitNetError, ContextOverflowError, ModelChangedError, QueueFullError, token_ids
from ..runtime.constraints import compile_constraint
from ..runtime.generate import Chunk, Stats, _StopMatcher, last_text, stop_strings, whole_number
from ..memory import available_memory
from ..runtime.model import _gib, decode_rows_attention
from ..runtime.reasoning import budget_matcher
from ..runtime.sampling import EXCLUDED, NoTokenAllowedError, Sampler, SamplingParams, checked_params
from ..runtime.speculative import OFF, DraftLength, LookupParams, PromptLookup, checked_lookup
from ..cpu import BATCH_TOKENS_MAX
from .batch_model import BatchModel, batch_model_bytes
from .drafts import FORCED_DRAFT_MAX, Drafts
from .embed import Embeddings
from .score import ScoreRequest, Scoring
from .kv_pool import PAGE_TOKENS, KVPool
from .prefix_cache import PrefixCache
from .stream import Stream


def _owner(s):
    """The request a sequence serves: an embedding's texts are sequences of one request; any other is its own."""
    return getattr(s.embed, "req", s)


class _Seq:
    """Per-sequence state: tokens, KV pages, sampler, detokenizer, stop matcher, timings."""

    def __init__(self, sid, prompt, params, max_tokens, stop, stream, tokenizer, vocab):
        self.id, self.prompt, self.max_tokens, self.stream = sid, prompt, max_tokens, stream
        self.sampler = Sampler(params, vocab, tokenizer)
        self.tokens = list(prompt)       # prompt + sampled tokens still to run
        self.n_past = 0                  # positions whose K/V are in the pages
        self.pages: list[int] = []
        self.reserve = 0                 # pages promised by the pool, not yet taken
        self.n_indexed = 0               # full pages handed to the prefix index
        self.n_cached = 0
        self.n_gen = 0
        self.detok = tokenizer.stream()
        self.matcher = _StopMatcher(stop)
        self.state = "waiting"
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_prefilled = self.t_first = self.t_last = 0.0
        self.banned: list[int] = []      # token ids never sampled (ignore_eos)
        self.ends: frozenset = frozenset()   # the request's own end-of-text tokens (end_ids), beside the model's
        self.finder: PromptLookup | None = None   # prompt lookup (engine lookup on): n-gram index of tokens
        self.draft_len: DraftLength | None = None
        self.draft: list[int] = []       # draft tokens run in the current step after tokens[n_past]
        self.looked_up = False           # the draft came from prompt lookup (not the grammar's forced tokens)
        self.n_drafted = self.n_accepted = 0
        self.cm = None                   # TokenMatcher of the sequence's constraint (engine/runtime/constraints.py)
        self.forks: list[_Seq] = []      # the other choices of an n > 1 request (this one prefills for them)
        self.fork_of: _Seq | None = None  # the choice whose prefill this one waits for (then shares its pages)
        self.embed = None                # an embedding sequence's request slot and running mean (embed.py)


IDLE_POLL_S = 1.0   # an idle scheduler thread lets go of its engine this often (a dropped Engine is then freed)


def _scheduler_main(ref: "weakref.ref[BatchScheduler]"):
    """The scheduler thread: turns of the engine while it is open and referenced by anyone but this thread."""
    eng = ref()
    if eng is None:
        return
    try:
        while eng._turn():
            eng = None   # between turns: no reference of ours (the last one dropped frees it, here)
            eng = ref()
            if eng is None:
                return
    except BaseException as e:  # pragma: no cover - a bug: end every stream instead of hanging consumers
        eng._error = e
        import traceback
        traceback.print_exc()
    eng._wind_down()


_LIVE: "weakref.WeakSet[BatchScheduler]" = weakref.WeakSet()


def _after_fork_in_child():
    """A fork()ed child has the engine's memory but not its scheduler thread, and its locks as that thread held
    them: every engine of the parent refuses new work there, one clear error, instead of queueing requests
    nobody runs (a stream waited for ever) or waiting on a lock nobody releases."""
    for s in list(_LIVE):
        s._lock = threading.Lock()
        s._wake = threading.Condition(s._lock)
        s._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class BatchScheduler(Drafts, Embeddings, Scoring):
    """The engine core (engine.api.Engine adds tokenizer helpers). Start with start(); stop with close()."""
    _new_seq = _Seq   # the mixins (embed.py) make sequences through this, not by importing this module

    def __init__(self, store, tokenizer, *, n_ctx: int, parallel: int, kv_pool_tokens: int, max_batch_tokens: int,
                 max_queue: int, kv_dtype: str = "f16", load_s: float = 0.0, threads: int | None = None,
                 lookup: LookupParams | None = None):
        cfg = store.config
        self.store, self.config, self.tokenizer = store, cfg, tokenizer
        self.n_ctx, self.parallel, self.max_queue = int(n_ctx), int(parallel), int(max_queue)
        self.max_batch_tokens = int(max_batch_tokens)
        if self.parallel < 1 or self.max_batch_tokens < 1 or self.max_queue < 0:
            raise BitNetError("parallel and max_batch_tokens must be >= 1, max_queue >= 0")
        if self.max_batch_tokens > BATCH_TOKENS_MAX:
            raise BitNetError(f"max_batch_tokens {self.max_batch_tokens}: at most {BATCH_TOKENS_MAX} rows a step")
        self.max_pages = (self.n_ctx + PAGE_TOKENS - 1) // PAGE_TOKENS
        n_pages = max(1, -(-int(kv_pool_tokens) // PAGE_TOKENS))
        if n_pages < self.max_pages:
            raise BitNetError(f"kv_pool_tokens {kv_pool_tokens}: the pool must hold at least one context "
                              f"({self.n_ctx} tokens)")
        # prompt lookup (None: off, as `bitnet run`); a draft never exceeds the step's rows
        self.lookup = checked_lookup(OFF if lookup is None else lookup)
        self.draft_max = min(self.lookup.draft_max, self.max_batch_tokens - 1)
        # a constrained sequence's forced tokens (jump-forward) run as a draft of up to this many rows, whatever
        # the lookup setting (its logit rows are sized for it: untouched rows cost no memory)
        self.forced_max = min(FORCED_DRAFT_MAX, self.max_batch_tokens - 1)
        self.max_step_seqs = min(self.parallel, self.max_batch_tokens)   # sequences in one step
        sizes = dict(max_rows=self.max_batch_tokens, n_ctx=self.n_ctx,
                     max_logit_rows=min(self.max_step_seqs * (1 + max(self.draft_max, self.forced_max)),
                                        self.max_batch_tokens),
                     max_threads=max(2, int(threads or 0), _cpu_count()))
        self._check_memory(cfg, n_pages, kv_dtype, sizes)
        self.pool = KVPool(cfg.n_layers, n_pages, cfg.n_kv_heads, cfg.head_dim, kv_dtype)
        self.prefix = PrefixCache(self.pool)
        self.model = BatchModel(store, self.pool, threads=threads, **sizes)
        self.load_s = load_s
        self._eos = set(tokenizer.eos_ids)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[int, _Seq] = {}
        self._closed = False
        self._forked = False   # this is a fork()ed child's copy: no scheduler thread runs it
        _LIVE.add(self)
        self.requests_total = self.tokens_generated_total = self.prefix_hits_tokens = self.steps_total = 0
        self.lookup_drafted_total = self.lookup_accepted_total = 0   # prompt lookup's drafts
        self.forced_drafted_total = self.forced_accepted_total = 0   # a grammar's forced tokens run as drafts
        self.prefill_tokens_total = 0   # prompt tokens run through the model (cached prefixes and forks excluded)
        self.sequence_errors_total = 0  # sequences ended by a fault (finish_reason "error")
        self.steps_split_total = 0      # batched steps run again in halves to find the sequence a fault came from
        self._page_table = np.zeros((self.max_step_seqs, self.max_pages), np.int32)
        # the thread holds the engine only weakly between its turns: an Engine dropped without close() is freed
        # (weights, KV pool) and its thread ends, as a dropped LLM is (it stayed for the process's life)
        self._thread = threading.Thread(target=_scheduler_main, args=(weakref.ref(self),), name="bitnet-scheduler",
                                        daemon=True)
        self._error: BaseException | None = None
        self._outbox: list[tuple[Stream, Chunk]] = []   # final chunks, emitted once the lock is released
        self._calls: deque = deque()                      # (fn, result box) to run on the scheduler thread

    def _check_memory(self, cfg, n_pages: int, kv_dtype: str, sizes: dict):
        """Refuse, before allocating any of it, a KV pool and buffers larger than the memory available, as
        Model() refuses a session's (engine/runtime/model.py): np.zeros maps them lazily, so without this a
        huge -c/--ctx was accepted and the server ground for minutes (RoPE tables) until the kernel killed it."""
        need = n_pages * PAGE_TOKENS * KVPool.bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_dtype)
        need += batch_model_bytes(cfg, **sizes)
        avail = available_memory()
        if avail is not None and need > avail:
            more = "" if self.parallel == 1 else f" with --parallel {self.parallel}"
            raise BitNetError(f"-c/--ctx {self.n_ctx}{more}: the KV cache and buffers would need {_gib(need)}, more "
                              f"than the {_gib(avail)} of memory available", hint="use a smaller -c/--ctx or "
                              f"--parallel (the model was trained for {cfg.context_length})")

    def start(self):
        self._thread.start()
        return self

    # ---- public, any thread ---------------------------------------------------------------------------
    def _check_admission(self, need: int = 1):
        """Under self._lock: a new request needing `need` slots at once may queue (the engine runs, the queue
        has room), else raise. max_queue bounds the requests that wait for a slot: what is queued in FIFO order
        takes the free slots first (a burst into free slots is not yet admitted, as the scheduler thread takes
        it at its next step, but waits for nothing); max_queue 0 means "never wait"."""
        if self._closed:
            raise BitNetError("the engine is closed")
        if self._forked:
            raise BitNetError("this engine was loaded before fork(): its scheduler thread does not run in this "
                              "process", hint="load the engine in the child process (after the fork, or with "
                              "multiprocessing's 'spawn' start method)")
        if self._error is not None:
            raise BitNetError(f"the engine stopped after an internal error: {self._error!r}")
        # the model file rewritten in place under its mapping: another file's bytes through this index (one fstat
        # per request, never per token)
        self.store.check_unchanged()
        free, waiting = max(0, self.parallel - len(self._running)), set()
        for s in self._waiting:
            n = 1 + len(s.forks)   # n choices are admitted together
            if n <= free:
                free -= n
            else:   # an embedding's texts are sequences of one request; a scoring sequence is its own
                waiting.add(id(_owner(s)))
        queued = len(waiting) + (need > free)
        if queued > self.max_queue:
            if self.max_queue == 0:
                raise QueueFullError("no slot is free and requests never wait (max_queue 0)", hint="retry later")
            raise QueueFullError(f"{len(waiting)} {'request is' if len(waiting) == 1 else 'requests are'} already "
                                 "waiting to start (max_queue "
                                 f"{self.max_queue})", hint="retry later")

    def _check_ids(self, ids: list, text: str | None = None):
        """A prompt's ids (text None) or those of embedding text `text` ("text 2 of 3"): every id in the vocabulary
        (BitNetError) and no more than the context holds (ContextOverflowError)."""
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BitNetError(f"{text + ': ' if text else ''}token id {bad[0]} is outside the vocabulary "
                              f"(0..{vocab - 1})")
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"{text or 'the prompt'} has {len(ids)} tokens but the context holds "
                                       f"{self.n_ctx}",
                                       hint=f"raise the context or shorten the {'text' if text else 'prompt'}",
                                       n_prompt_tokens=len(ids), n_ctx=self.n_ctx)

    def submit(self, prompt_ids: Sequence[int] | str, params: SamplingParams | None = None, *, max_tokens: int = 256,
               stop: Sequence[str] = (), callback: Callable[[Chunk], None] | None = None,
               ignore_eos: bool = False, constraint=None, end_ids: Sequence[int] = ()) -> Stream:
        """Queue a request (never blocks; a str prompt is tokenized with BOS); see engine.api.Engine. ignore_eos:
        end-of-text tokens are never sampled, as LLM.generate(ignore_eos=True). constraint: as LLM.generate's (compiled here unless it already
        is: a server compiles off its event loop); a ConstraintError leaves nothing behind. end_ids: more tokens
        that end this request as end of text does ("eos"; a filled-in middle's FIM pad and separators)."""
        return self.submit_n(prompt_ids, params, 1, max_tokens=max_tokens, stop=stop,
                             callbacks=None if callback is None else [callback], ignore_eos=ignore_eos,
                             constraint=constraint, end_ids=end_ids)[0]

    def submit_n(self, prompt_ids: Sequence[int] | str, params: SamplingParams | None = None, n: int = 1, *,
                 max_tokens: int = 256, stop: Sequence[str] = (),
                 callbacks: Sequence[Callable[[Chunk], None]] | None = None, ignore_eos: bool = False,
                 constraint=None, end_ids: Sequence[int] = ()) -> list[Stream]:
        """n completions of one prompt (OpenAI's `n`), one Stream each: choice i samples with its own sampler,
        seeded params.seed + i (a fixed seed gives the same n choices every run), and its own constraint matcher.
        The prompt is prefilled once: the first sequence runs it, and the others then take its pages (shared,
        copy-on-write) and sample their first token from the same logits row. Admitted together: n slots
        (n <= parallel) and all pages promised."""
        if isinstance(prompt_ids, (bytes, bytearray)):
            raise BitNetError("prompt: give text (str) or token ids, not bytes")
        # a text is tokenized with BOS, as LLM.generate takes it
        prompt = self.tokenizer.encode(prompt_ids, add_bos=True) if isinstance(prompt_ids, str) else \
            token_ids(prompt_ids)
        if not prompt:
            if self.tokenizer.bos_id is None:
                raise BitNetError("empty prompt and the model has no BOS token to start from")
            prompt = [self.tokenizer.bos_id]
        self._check_ids(prompt)
        vocab = self.config.vocab_size
        max_tokens = whole_number(max_tokens, "max_tokens")
        stop = stop_strings(stop)
        ends = frozenset(token_ids(end_ids, "end_ids", text_ok=False)) - self._eos
        if any(not 0 <= t < vocab for t in ends):
            raise BitNetError(f"end_ids: token ids of this model (0..{vocab - 1})")
        if not isinstance(ignore_eos, (bool, np.bool_)):   # "no" was true
            raise BitNetError(f"ignore_eos {ignore_eos!r}: True or False")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= self.parallel:
            raise BitNetError(f"n {n}: must be in 1..{self.parallel} (the sequences this engine runs at once)")
        if callbacks is not None:   # checked here: a str failed on the scheduler thread, an iterator had no len()
            if isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
                raise BitNetError(f"callbacks: a list of functions of a Chunk, not {type(callbacks).__name__}")
            callbacks = list(callbacks)
            bad = next((c for c in callbacks if not callable(c)), None)
            if bad is not None:
                raise BitNetError(f"callback: a function of a Chunk, not {type(bad).__name__}")
            if len(callbacks) != n:
                raise BitNetError(f"{len(callbacks)} callbacks for n={n} streams")
        lead, _, extra = self._promise(len(prompt), max_tokens, n - 1)
        promise = lead + extra
        if promise > self.pool.n_pages:   # it would wait for ever, and every request behind it
            longest = min(max_tokens, self.n_ctx - len(prompt) + 1)
            raise BitNetError(f"n {n}: {n} answers of up to {longest} tokens each need {promise} pages of the KV "
                              f"cache ({PAGE_TOKENS} tokens a page) and it holds {self.pool.n_pages}",
                              hint="ask for fewer choices, or set max_tokens")
        params = checked_params(params)
        choice_params = [params if i == 0 or params.seed is None else replace(params, seed=(params.seed + i) % (1 << 64))
                         for i in range(n)]
        compiled = compile_constraint(self.tokenizer, vocab, constraint)
        with self._lock:
            self._check_admission(n)
            seqs = []
            for i in range(n):
                sid = next(self._ids)
                stream = Stream(sid, self, callbacks[i] if callbacks is not None else None)
                seq = _Seq(sid, prompt, choice_params[i], int(max_tokens), stop, stream, self.tokenizer, vocab)
                seq.ends = ends
                if ignore_eos:
                    seq.banned = [t for t in self._eos | ends if 0 <= t < vocab]
                if self.draft_max > 0:
                    seq.finder, seq.draft_len = PromptLookup(self.lookup), DraftLength(self.draft_max)
                seq.cm = budget_matcher(compiled.matcher() if compiled is not None else None, self.tokenizer, prompt,
                                        params.reasoning_budget, params.reasoning_budget_message)
                seqs.append(seq)
            lead = seqs[0]
            lead.forks = seqs[1:]
            for f in lead.forks:
                f.fork_of = lead
            self._waiting.append(lead)   # the forks ride on it: admitted, prefilled and counted with it
            for seq in seqs:
                self._by_id[seq.id] = seq
            self.requests_total += 1
            self._wake.notify()
        return [seq.stream for seq in seqs]

    def cancel(self, stream_id: int):
        with self._lock:
            seq = self._by_id.get(stream_id)
            if seq is not None:
                seq.cancelled = True
                self._wake.notify()

    def end_now(self, streams, finish_reason: str = "stop", waiting_reason: str = "unavailable"):
        """Stream.end_now() for each of `streams` (a server stopping): one still waiting for a slot ends with
        `waiting_reason` instead, so its client can tell an answer that never started (to retry) from one cut
        short. Which is which is decided under the lock, where those waiting are cancelled: none is admitted
        after, to give out chunks before its end. Each is told its reason before it is cancelled: the scheduler's
        own "cancelled" end could come first, once the lock is free, and a request that never started ended as one
        cut short (a 200 with nothing, where its client should have had the 503 to retry)."""
        with self._lock:
            waiting = set()
            for st in streams:
                seq = self._by_id.get(st.id)
                if seq is not None and seq.state == "waiting":
                    st._cut_reason = waiting_reason
                    seq.cancelled = True
                    waiting.add(st.id)
        for st in streams:
            st.end_now(waiting_reason if st.id in waiting else finish_reason)

    def abandon(self, stream_id: int):
        """cancel() for a stream whose iterator was closed early. That may happen inside the garbage collector,
        in any thread, also one holding self._lock (a non-reentrant lock: cancel() would wait for ever): the
        flag is set without it (the scheduler reads it at its next step) and the scheduler woken only if the
        lock is free."""
        seq = self._by_id.get(stream_id)
        if seq is not None:
            seq.cancelled = True
            if self._lock.acquire(blocking=False):
                try:
                    self._wake.notify()
                finally:
                    self._lock.release()

    def metrics(self) -> dict:
        with self._lock:
            return {"running": len(self._running), "waiting": len({id(_owner(s)) for s in self._waiting}),   # requests
                    "kv_pages_total": self.pool.n_pages, "kv_pages_used": self.pool.n_used,
                    "kv_pages_free": self.pool.n_free, "kv_pages_reserved": self.pool.reserved,
                    "kv_pages_cached": self.prefix.n_nodes, "kv_pages_evictable": self.prefix.n_evictable(),
                    "kv_page_tokens": PAGE_TOKENS,
                    "kv_dtype": self.pool.kv_dtype, "kv_pool_bytes": self.pool.nbytes,
                    "prefix_hits_tokens": self.prefix_hits_tokens, "requests_total": self.requests_total,
                    "tokens_generated_total": self.tokens_generated_total, "steps_total": self.steps_total,
                    "lookup_draft_max": self.draft_max, "lookup_drafted_total": self.lookup_drafted_total,
                    "lookup_accepted_total": self.lookup_accepted_total,
                    "forced_drafted_total": self.forced_drafted_total,
                    "forced_accepted_total": self.forced_accepted_total,
                    "prefill_tokens_total": self.prefill_tokens_total,
                    "sequence_errors_total": self.sequence_errors_total, "steps_split_total": self.steps_split_total,
                    "embed_inputs_total": self.embed_inputs_total, "scored_tokens_total": self.scored_tokens_total,
                    "n_batch": self.max_batch_tokens}

    def slots(self) -> list[dict]:
        with self._lock:
            return [{"id": s.id, "state": s.state, "n_prompt": len(s.prompt), "n_generated": s.n_gen,
                     "n_cached": s.n_cached, "n_drafted": s.n_drafted, "n_accepted": s.n_accepted}
                    for s in list(self._running) + list(self._waiting)]

    def close(self):
        if threading.current_thread() is self._thread:   # it would join itself (RuntimeError, the engine half closed)
            raise BitNetError("close() from the engine's own thread (a callback): call it from another thread",
                              hint="a callback can cancel its own stream (Stream.cancel) or signal another thread")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()
        else:  # never started: end what waits
            for s in list(self._waiting):
                self._finish(s, "cancelled")
            self._flush()

    # ---- the scheduler thread -------------------------------------------------------------------------
    def run_in_scheduler(self, fn, timeout: float = 60.0):
        """fn() on the scheduler thread between two steps (pool and index are quiet); returns its result."""
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            return fn()
        box: dict = {}
        done = threading.Event()
        with self._lock:
            self._calls.append((fn, box, done))
            self._wake.notify()
        if not done.wait(timeout):
            raise BitNetError(f"the scheduler did not answer within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix page nobody uses; returns how many pages went back to the pool."""
        return self.run_in_scheduler(lambda: self.prefix.evict(self.pool.n_pages))

    def _run_calls(self):
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, box, done = self._calls.popleft()
            try:
                box["result"] = fn()
            except BaseException as e:
                box["error"] = e
            done.set()

    def _flush(self):
        with self._lock:
            out, self._outbox = self._outbox, []
        for stream, chunk in out:
            stream._emit(chunk)

    def _turn(self) -> bool:
        """One pass of the scheduler thread (_scheduler_main): a step, or a wait of at most IDLE_POLL_S while
        there is nothing to do; False once the engine is closed."""
        with self._lock:
            if not self._closed and not self._waiting and not self._running and not self._calls:
                self._wake.wait(IDLE_POLL_S)
                return True
            if self._closed:
                return False
        self._run_calls()
        self._step()
        self._flush()
        return True

    def _wind_down(self):
        """The scheduler thread's end (closed, or a bug): every stream ends, no consumer waits for ever."""
        with self._lock:
            everyone = list(self._running) + list(self._waiting)
            for s in everyone:
                self._finish(s, "cancelled", locked=True)
        self._flush()
        self._run_calls()

    def _step(self):
        with self._lock:
            for s in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(s)
                self._finish(s, "cancelled", locked=True)
            for s in [s for s in self._running if s.cancelled]:
                self._finish(s, "cancelled", locked=True)
            self._admit()
            running = [s for s in self._running if s.fork_of is None]   # forks wait for their prompt's prefill
        if not running:
            if self._waiting:  # nothing runs, yet the head cannot be admitted: only possible after a bug
                time.sleep(0.001)
            return
        budget = self.max_batch_tokens
        plan = []  # [seq, n_rows]: a decode row (plus a draft), or a prefill chunk
        for s in running:  # decode rows first
            if len(s.tokens) - s.n_past == 1 and s.n_gen > 0 and budget > 0 and len(plan) < self.max_step_seqs:
                plan.append([s, 1])
                budget -= 1
        for s in running:  # then prefill chunks, oldest first
            todo = len(s.tokens) - s.n_past
            if budget > 0 and not (todo == 1 and s.n_gen > 0) and todo > 0 and len(plan) < self.max_step_seqs:
                r = min(todo, budget)
                plan.append([s, r])
                budget -= r
                self.prefill_tokens_total += r
        if self.draft_max > 0 or any(s.cm is not None for s, _ in plan):  # then drafts, in the room left
            budget = self._plan_drafts(plan, budget)
        for s, r in plan:   # masks of the rows sampled first are computed while the step runs
            if s.cm is not None and s.n_past + r >= len(s.tokens):
                s.cm.start_mask()
        self._run_plan(plan)

    def _run_plan(self, plan):
        """The forward pass of the plan's rows, then each sequence's sampling. A fault inside the forward (a
        kernel's boundary check, a workspace it could not allocate) ends only the sequence whose rows cause it:
        the plan runs again in halves until the culprit runs alone and fails alone, with finish_reason "error".
        Running a failed step again is safe: nothing of it was committed (n_past moves after the forward, pages
        reach the prefix index only once committed), and its K/V writes went to the same positions of pages its
        sequence holds alone (copy-on-write happens before the forward), which the rerun overwrites with the
        same numbers (per-row quantization: a row's values do not depend on the rows beside it)."""
        try:
            logits = self._forward(plan)
        except Exception as e:
            if len(plan) == 1:
                self._fail(plan[0][0], e, "its forward pass")
                return
            self.steps_split_total += 1
            half = len(plan) // 2
            self._run_plan(plan[:half])    # each half samples before the next forward reuses the logits buffer
            self._run_plan(plan[half:])
            return
        now = time.perf_counter()
        li = row = 0
        prefill_only = []
        for s, r in plan:
            row += r
            if s.draft:
                n_rows = len(s.draft) + 1
                nxt = self._sample_or_fail(s, self._sample_draft, logits, li)
                li = nxt if nxt is not None else li + n_rows
                continue
            s.n_past += r
            if s.embed is not None:   # prefill-only: pooled (embed.py) or scored (score.py), never sampled nor indexed
                prefill_only.append((s, row - r, r))
                continue
            self._index(s)
            if s.n_past == len(s.tokens):
                if s.n_gen == 0:
                    s.t_prefilled = now
                    if s.forks:
                        self._fork(s, logits[li])
                self._sample_or_fail(s, self._sample, logits[li])
                li += 1
        for s, row0, r in prefill_only:   # after the sampling: scoring reuses the head's row buffer
            if isinstance(s.embed, ScoreRequest):
                self._score_rows(s, row0, r)
            else:
                self._embed_rows(s, row0, r)

    def _forward(self, plan) -> np.ndarray:
        """One batched step over the plan's rows (pages of their own for every written position first); the
        logits of the rows sampled next."""
        n = len(plan)
        ids = np.empty(sum(r for _, r in plan), np.int32)
        seq_rows = np.zeros(n + 1, np.int32)
        seq_pos0 = np.zeros(n, np.int32)
        pt = self._page_table[:n]
        logit_rows, row = [], 0
        for i, (s, r) in enumerate(plan):
            self._pages_for(s, s.n_past, s.n_past + r)
            if s.draft:  # the last sampled token, then the draft: every row's logits
                ids[row] = s.tokens[s.n_past]
                ids[row + 1: row + r] = s.draft
                logit_rows.extend(range(row, row + r))
            else:
                ids[row: row + r] = s.tokens[s.n_past: s.n_past + r]
                if s.n_past + r == len(s.tokens) and s.embed is None:
                    logit_rows.append(row - 1 + r)
            seq_pos0[i] = s.n_past
            pt[i, : len(s.pages)] = s.pages
            row += r
            seq_rows[i + 1] = row
        # draft rows decode: f32 attention products, as decode steps
        with decode_rows_attention() if any(s.draft for s, _ in plan) else contextlib.nullcontext():
            logits = self.model.step(ids, seq_rows, seq_pos0, pt, logit_rows)
        self.steps_total += 1
        return logits

    def _sample_or_fail(self, s: _Seq, sample, *args):
        """sample(s, *args), where a fault (sampler, constraint, detokenizer, stop matcher) ends only s, with
        finish_reason "error": its pages go back, the step's other sequences carry on."""
        try:
            return sample(s, *args)
        except NoTokenAllowedError:   # the request's grammar and logit_bias exclude every token: its doing, no fault
            s.draft = []
            self._finish(s, EXCLUDED)
            return None
        except Exception as e:
            self._fail(s, e, "its sampling")
            return None

    def _fail(self, s: _Seq, e: Exception, where: str):
        """End s after a fault (one line on stderr): finish_reason "error", its pages back to the pool."""
        import sys
        why = self.store.changed()
        if why is not None:   # the cause, not what it made of the numbers ("NaN logits: weights corrupt")
            e = ModelChangedError(f"{self.store.path}: the BitNet store changed while in use (it {why})")
        print(f"bitnet engine: sequence {s.id} failed in {where} ({type(e).__name__}: {e}); ending it",
              file=sys.stderr)
        s.draft = []
        self.sequence_errors_total += 1
        self._finish(s, "error")

    def _fork(self, s: _Seq, logits: np.ndarray):
        """s has prefilled its prompt: each fork takes s's pages (shared; copy-on-write on their first write) and
        samples its first token from its own copy of s's logits row (a sampler modifies the row in place)."""
        for f in s.forks:
            if f.state != "running" or f.fork_of is not s:
                continue
            f.fork_of = None
            f.pages = list(s.pages)
            for p in f.pages:
                self.pool.incref(p)
            f.n_past, f.n_cached, f.n_indexed = s.n_past, len(s.prompt), s.n_indexed
            f.t_prefilled = s.t_prefilled
            self._sample_or_fail(f, self._sample, logits.copy())
        s.forks = []

    def _index(self, s: _Seq):
        """Hand s's newly full pages to the prefix index (every position below n_past is committed)."""
        n_full = s.n_past // PAGE_TOKENS
        if n_full > s.n_indexed:
            self.prefix.insert(s.tokens, s.pages, n_full)
            s.n_indexed = n_full

    def _promise(self, n_prompt: int, max_tokens: int, n_forks: int, n_cached: int = 0) -> tuple[int, int, int]:
        """(lead, fork, extra): the pages a request is promised at admission. lead: its pages, whole, less its
        cached prefix; fork: each fork's pages past the prompt's full ones (the shared partial page is copied on
        write); extra: the forks' together, and one more for whichever sequence writes that partial page first
        while the others still share it."""
        pages = -(-min(n_prompt + max(max_tokens - 1, 0), self.n_ctx) // PAGE_TOKENS)
        fork = pages - n_prompt // PAGE_TOKENS
        return (pages - n_cached // PAGE_TOKENS, fork,
                fork * n_forks + (1 if n_forks and n_prompt % PAGE_TOKENS else 0))

    def _next_waiting(self) -> int:
        """The index in the queue of the sequence to admit next: the first whose request has the fewest sequences
        running, so one request of many texts (embeddings: a sequence each) takes its turns beside later requests
        instead of holding every slot until its last text (a chat waited out a 2,048-text request). Requests of
        one sequence keep their order (lock held)."""
        head = _owner(self._waiting[0])
        if head is self._waiting[0]:
            return 0
        running: dict[int, int] = {}
        for s in self._running:
            running[id(_owner(s))] = running.get(id(_owner(s)), 0) + 1
        if not running.get(id(head)):
            return 0
        best, fewest, last = 0, running[id(head)], head
        for i, s in enumerate(self._waiting):
            owner = _owner(s)
            if owner is last:   # the rest of a request already looked at
                continue
            last, n = owner, running.get(id(owner), 0)
            if n < fewest:
                best, fewest = i, n
                if n == 0:
                    break
        return best

    def _admit(self):
        """Admit waiting requests while there are slots and pages can be promised, in order but for a request
        of many sequences, which takes turns (_next_waiting) (lock held)."""
        while self._waiting:
            i = self._next_waiting()
            s = self._waiting[i]
            if len(self._running) + 1 + len(s.forks) > self.parallel:
                return
            limit = len(s.prompt) - (1 if s.max_tokens > 0 else 0)
            # an embedding pools every row of its text: no cached prefix stands in for any of them
            pages, n_cached = self.prefix.match(s.prompt, limit) if s.embed is None else ([], 0)
            need, fork_need, extra = self._promise(len(s.prompt), s.max_tokens, len(s.forks), n_cached)
            if need + extra > self.pool.n_free + self.prefix.n_evictable() - self.pool.reserved:
                for p in pages:
                    self.pool.decref(p)
                if not pages:
                    return
                # the matched pages, held, are no longer evictable, and a page matched in part saves none: in a
                # pool of one context that was one page too many for ever (nothing ran to free one). Without them
                pages, n_cached = [], 0
                need, fork_need, extra = self._promise(len(s.prompt), s.max_tokens, len(s.forks))
                if need + extra > self.pool.n_free + self.prefix.n_evictable() - self.pool.reserved:
                    return
            del self._waiting[i]
            s.pages, s.n_past, s.n_cached, s.reserve = pages, n_cached, n_cached, need
            s.n_indexed = n_cached // PAGE_TOKENS
            self.pool.reserved += need
            self.prefix_hits_tokens += n_cached
            s.state, s.t_admit = "running", time.perf_counter()
            self._running.append(s)
            if s.forks:
                s.reserve += extra - fork_need * len(s.forks)
                self.pool.reserved += extra
                for f in s.forks:
                    f.reserve, f.state, f.t_admit = fork_need, "running", s.t_admit
                    self._running.append(f)
            if s.max_tokens == 0 and n_cached == len(s.prompt):
                s.t_prefilled = s.t_admit
                self._finish(s, "length", locked=True)

    def _take(self, s: _Seq) -> int:
        s.reserve -= 1
        self.pool.reserved -= 1
        if s.reserve < 0:
            raise AssertionError(f"sequence {s.id} took more pages than it was promised")
        return self.pool.alloc()

    def _pages_needed(self, s: _Seq, p0: int, p1: int) -> int:
        """Pages _pages_for(s, p0, p1) would take from s's promise."""
        n = 0
        for b in range(p0 // PAGE_TOKENS, (p1 - 1) // PAGE_TOKENS + 1):
            n += b >= len(s.pages) or self.pool.refs[s.pages[b]] > 1
        return n

    def _pages_for(self, s: _Seq, p0: int, p1: int):
        """Pages of their own for positions p0 .. p1-1 of s (new ones, or copies of shared ones)."""
        for b in range(p0 // PAGE_TOKENS, (p1 - 1) // PAGE_TOKENS + 1):
            if b < len(s.pages):
                p = s.pages[b]
                if self.pool.refs[p] > 1:  # copy-on-write: another sequence or the index holds it
                    q = self._take(s)
                    self.pool.k[:, q] = self.pool.k[:, p]
                    self.pool.v[:, q] = self.pool.v[:, p]
                    self.pool.decref(p)
                    s.pages[b] = q
            else:
                s.pages.append(self._take(s))

    def _sample(self, s: _Seq, logits: np.ndarray) -> int | None:
        """Sample s's next token from logits (the row after tokens[:n_past]), emit it, finish s or append it."""
        if s.max_tokens == 0:
            self._finish(s, "length")
            return None
        if s.n_gen == 0 and s.cm is not None and s.cm.done:   # complete before any token (root ::= ""): only
            self._finish(s, "eos")                             # end of text could come (none with ignore_eos)
            return None
        if s.banned:
            logits[s.banned] = -np.inf
        if s.cm is not None:
            s.cm.apply(logits)
        tok = s.sampler.sample(logits, s.tokens)
        now = time.perf_counter()
        s.n_gen += 1
        self.tokens_generated_total += 1
        if s.n_gen == 1:
            s.t_first = now
        s.t_last = now
        if tok in self._eos or tok in s.ends:
            self._finish(s, "eos")
            return tok
        if s.cm is not None:
            s.cm.advance(tok)
        text, stopped = s.matcher.feed(s.detok.push(tok))
        s.stream._emit(Chunk(text, tok, None, self._stats(s, None), s.sampler.record, s.matcher.said))
        if stopped:
            self._finish(s, "stop")
        elif s.cm is not None and s.cm.done:   # the grammar is complete: only end of text could follow
            self._finish(s, "eos")
        elif s.n_gen >= s.max_tokens:
            self._finish(s, "length")
        elif s.n_past >= self.n_ctx:
            self._finish(s, "context")
        else:
            s.tokens.append(tok)
        return tok

    def _finish(self, s: _Seq, reason: str, locked: bool = False):
        """Release s's pages and promise, emit its last chunks, forget it."""
        if s.state == "done":
            return
        if not locked:
            with self._lock:
                return self._finish(s, reason, locked=True)
        if s in self._running:
            self._running.remove(s)
        elif s in self._waiting:
            self._waiting.remove(s)
        for p in s.pages:
            self.pool.decref(p)
        s.pages = []
        self.pool.reserved -= s.reserve
        s.reserve = 0
        s.state = "done"
        self._by_id.pop(s.id, None)
        forks, s.forks = s.forks, []
        for f in forks:   # still waiting for s's prefill (only a cancel or max_tokens 0 ends s before it)
            if f.fork_of is s:
                f.fork_of = None
                self._finish(f, reason, locked=True)
        if reason not in ("stop", "cancelled", "error", EXCLUDED):
            rest = s.matcher.flush_text(last_text(s.detok, reason))
            if rest:
                self._outbox.append((s.stream, Chunk(rest, None, None, self._stats(s, None), said=s.matcher.said)))
        self._outbox.append((s.stream, Chunk("", None, reason, self._stats(s, reason), said=s.matcher.said)))

    def _stats(self, s: _Seq, reason: str | None) -> Stats:
        """Where s stands (every Chunk carries one, as generate()'s do)."""
        n_pre = len(s.prompt) - s.n_cached
        pre_s = (s.t_prefilled - s.t_admit) if s.t_prefilled else 0.0
        dt = s.t_last - s.t_first
        return Stats(n_prompt=len(s.prompt), n_cached=s.n_cached, n_generated=s.n_gen, load_s=self.load_s,
                     ttft_s=(s.t_first or s.t_prefilled or time.perf_counter()) - s.t_submit,
                     prefill_tps=n_pre / pre_s if n_pre and pre_s > 0 else 0.0,
                     decode_tps=(s.n_gen - 1) / dt if s.n_gen > 1 and dt > 0 else 0.0, finish_reason=reason,
                     n_drafted=s.n_drafted, n_accepted=s.n_accepted,
                     stop_word=s.matcher.matched if reason == "stop" else None)

    # ---- checks (tests) -------------------------------------------------------------------------------
    def check_consistency(self) -> dict:
        """Recount every page reference from the holders (on the scheduler thread, between steps); raises
        AssertionError on any mismatch."""
        return self.run_in_scheduler(self._check_consistency)

    def _check_consistency(self) -> dict:
        with self._lock:
            want = np.zeros(self.pool.n_pages, np.int64)
            for s in self._running:
                for p in s.pages:
                    want[p] += 1
            stack = list(self.prefix.root.children.values())
            while stack:
                n = stack.pop()
                want[n.page] += 1
                stack.extend(n.children.values())
            assert np.array_equal(want, self.pool.refs), "page reference counts do not match their holders"
            free = set(self.pool._free)
            assert len(free) == len(self.pool._free), "a page is twice in the free list"
            assert free == set(np.flatnonzero(want == 0).tolist()), "free list != pages nobody holds"
            assert self.pool.reserved == sum(s.reserve for s in self._running), "reservations do not add up"
            return {"held": int((want > 0).sum()), "free": len(free)}


def _cpu_count() -> int:
    """An upper bound on the threads the kernels may run with (sizes the per-thread attention scratch):
    every logical CPU (the C side's fallback) or the default count (OMP_NUM_THREADS may exceed it)."""
    import os

    from ..cpu import default_threads
    return max(os.cpu_count() or 1, default_threads())
