"""The consumer's end of one request of the batching scheduler (engine/batching/scheduler.py): chunks reach it
through a queue (iterate it) or a callback called on the scheduler thread; a prefill-only request's (embeddings,
scoring) end is a OneShot, done once with one result."""
from __future__ import annotations

import dataclasses
import queue
import threading

from ..errors import BitNetError
from ..runtime.generate import Chunk


def checked_timeout(timeout) -> float | None:
    """A wait's timeout: None or inf (no limit), or seconds >= 0; anything else one BitNetError naming it (it read
    as "not ready within -1 s", or a bare TypeError for a string)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise BitNetError(f"timeout {timeout!r:.40}: None (no limit) or seconds, 0 or more")
    return None if timeout == float("inf") else timeout


def _not_on_engine_thread(engine, what: str):
    """A wait on the scheduler's own thread (a callback's) would wait for itself, and the engine with it, for good."""
    if threading.current_thread() is getattr(engine, "_thread", None):
        raise BitNetError(f"{what} from the engine's own thread (a callback) would wait for itself: the engine stops "
                          "for good", hint="give the callback's work to another thread, or pass that request a "
                                           "callback of its own")


_TAKEN = object()   # left in a stream's queue after its final chunk: wakes any other thread iterating it


class Stream:
    """The consumer's end of one request: iterate it (blocking) or pass a callback to submit()."""

    def __init__(self, sid: int, engine, callback):
        self.id = sid
        self._engine = engine
        self._callback = callback
        self._q: queue.SimpleQueue | None = None if callback else queue.SimpleQueue()
        self.finish_reason: str | None = None
        self._drained = False   # the final chunk has been taken: iterating again gives nothing (never waits)
        self._last: Chunk | None = None   # the latest chunk given out (its running stats and said count)
        self._ending = threading.RLock()   # end_now() and the scheduler's chunks: one final, nothing after it
        self.ended_now = False   # end_now() ended it (a stopping server cut it): not an end of the engine's own
        # end_now()'s reason once it has begun (set under the scheduler's lock for a request still waiting): the
        # engine's "cancelled" end, if it comes first, is that cut and says its reason
        self._cut_reason: str | None = None

    def _emit(self, chunk: Chunk):
        with self._ending:
            if self.finish_reason is not None:
                return   # ended already (end_now): what the engine made since is for nobody
            if chunk.finish_reason:
                if self._cut_reason is not None and chunk.finish_reason == "cancelled":
                    chunk = dataclasses.replace(chunk, finish_reason=self._cut_reason)
                    self.ended_now = True
                self.finish_reason = chunk.finish_reason
            self._last = chunk
            self._deliver(chunk)

    def end_now(self, finish_reason: str = "stop"):
        """Cancel, and give the consumer its final chunk now, from this thread, instead of at the engine's next
        step (a long prefill step can take seconds: a server stopping at its drain deadline must not wait for it);
        the engine's own chunks for this stream are dropped from then on. No-op once the stream has ended."""
        self._cut_reason = finish_reason   # before the cancel: the engine's "cancelled" end for it may come first
        self._engine.cancel(self.id)
        with self._ending:
            if self.finish_reason is not None:
                return   # the engine's own end came first (its "cancelled", by the cut above, says finish_reason)
            self.finish_reason = finish_reason
            self.ended_now = True
            last = self._last
            self._deliver(Chunk("", None, finish_reason, stats=last.stats if last is not None else None,
                                said=last.said if last is not None else 0))

    def _deliver(self, chunk: Chunk):
        if self._callback is not None:
            try:
                self._callback(chunk)
            except BaseException as e:  # a broken consumer ends its own request, never the engine (a callback's
                # sys.exit() or KeyboardInterrupt runs on the scheduler thread: it stopped the engine for good)
                import sys
                if not chunk.finish_reason:
                    print(f"bitnet engine: stream {self.id}: callback raised {e!r}; cancelling it", file=sys.stderr)
                    self._engine.cancel(self.id)
                else:   # nothing left to cancel, but said: code waiting on what this handler sets would wait on
                    # in silence (it was swallowed)
                    print(f"bitnet engine: stream {self.id}: callback raised {e!r} on the final chunk "
                          f"({chunk.finish_reason})", file=sys.stderr)
        else:
            self._q.put(chunk)

    def __iter__(self):
        """The chunks, blocking for each. Iteration that stops before the final chunk (a break, an exception,
        Ctrl-C: the iterator closed or collected) cancels the request, as LLM.generate's does: an abandoned
        stream no longer holds its slot and KV pages, decoding to max_tokens for nobody. Threads iterating one
        stream at once share its chunks, a work queue's way (each chunk goes to one of them; all end at the final
        chunk): not an error, as handing a stream to a worker thread while another still holds it is common; a
        thread that needs the whole text iterates alone."""
        if self._q is None:
            raise BitNetError("this stream delivers its chunks to a callback")
        if not self._drained:
            _not_on_engine_thread(self._engine, "iterating a stream")
        try:
            while not self._drained:
                c = self._q.get()
                if c is _TAKEN:   # another thread took the final chunk: this one ends too, instead of waiting forever
                    self._q.put(_TAKEN)
                    return
                if c.finish_reason:
                    self._drained = True
                    self._q.put(_TAKEN)
                yield c
        finally:
            if not self._drained:
                self._engine.abandon(self.id)

    def cancel(self):
        self._engine.cancel(self.id)


class OneShot:
    """The consumer's end of a prefill-only request (embed.py, score.py): result(timeout) blocks until it is done,
    or callback(request) is called once on the scheduler thread. `what` names its results in messages."""

    what = "results"

    def __init__(self, engine, callback):
        self._engine, self._callback = engine, callback
        self.error: str | None = None    # "cancelled" or "error" (a fault in its forward pass) when it failed
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _end(self, error: str | None = None):
        if self._done.is_set():
            return
        self.error = error
        self._done.set()
        if self._callback is not None:
            try:
                self._callback(self)
            except Exception as e:  # a broken consumer never takes the engine down
                import sys
                print(f"bitnet engine: {self.what} callback raised {e!r}", file=sys.stderr)

    def wait(self, timeout: float | None = None):
        """result(timeout) for a caller that gives up if it ends any other way: a timeout, Ctrl-C or another
        exception in the waiting thread cancels the request, so its texts do not run on for nobody (as leaving a
        Stream's loop does). result() alone leaves it running, for a caller that polls."""
        try:
            return self.result(timeout)
        except BaseException:
            self.cancel()
            raise

    def _wait(self, timeout: float | None):
        timeout = checked_timeout(timeout)
        if not self._done.is_set():
            _not_on_engine_thread(self._engine, f"waiting for {self.what}")
        if not self._done.wait(timeout):
            raise BitNetError(f"the {self.what} were not ready within {timeout} s")
        if self.error is not None:
            raise BitNetError(f"the {self.what} request ended: {self.error}")
