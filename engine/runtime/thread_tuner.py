"""Decode's thread count on a desktop whose cores may be busy.

Decode is memory-bound and its kernels split each matrix across the pool's threads; when another process keeps
one core busy, a worker sharing that core is preempted while it holds a chunk, and the step waits for it. On the
2-core machine here, with a busy loop pinned to one core, 2 threads decoded at 0.91x of `-t 1` (median of 3
paired runs). The tuner measures instead of guessing: decode runs on the default count, and now and then a short
window on one thread fewer; the faster window's count is kept until the next probe. Probes start 32 tokens
apart and back off to 1024 while the default keeps winning (an idle machine pays a window of 8 slower tokens
once in a while); a switch, or steps getting 25% slower than when last compared, brings probing back.

Only the default thread count is tuned: an explicit `-t N` is used as given. Prefill and verify passes always
use the default count (compute-bound: a shared core still adds throughput there).

    t = ThreadTuner(n)          # n: the default count (>= 2)
    nt = t.threads()            # the count for the next decode step
    t.record(seconds)           # that step's wall time
"""
from __future__ import annotations

WINDOW = 8          # decode steps per measurement
FIRST_GAP = 32      # steps between probes after a start or a switch
MAX_GAP = 1024      # ... doubling up to this while the current count keeps winning
GAIN = 0.05         # the probed count must be this much faster (median step time) to take over
SLOWDOWN = 1.25     # steps this much slower than at the last comparison: probe again soon


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class ThreadTuner:
    def __init__(self, n: int):
        if n < 2:
            raise ValueError("ThreadTuner needs a default of at least 2 threads")
        self.n = n                  # the default count
        self.cur = n                # the count decode runs on now
        self.gap = FIRST_GAP
        self.next_probe = FIRST_GAP
        self.steps = 0
        self.recent: list[float] = []   # the last WINDOW step times at self.cur
        self.probe: list[float] | None = None
        self.ref = None             # median step time at the last comparison (for SLOWDOWN)
        self.switches = 0

    def _other(self) -> int:
        return self.n - 1 if self.cur == self.n else self.n

    def threads(self) -> int:
        return self._other() if self.probe is not None else self.cur

    def record(self, seconds: float):
        self.steps += 1
        if self.probe is not None:
            self.probe.append(seconds)
            if len(self.probe) >= WINDOW:
                self._decide()
            return
        self.recent.append(seconds)
        if len(self.recent) > WINDOW:
            del self.recent[0]
        if (self.ref is not None and len(self.recent) == WINDOW and _median(self.recent) > self.ref * SLOWDOWN
                and self.next_probe - self.steps > FIRST_GAP):
            self.gap, self.next_probe = FIRST_GAP, self.steps + FIRST_GAP // 4   # the machine changed: look soon
        if self.steps >= self.next_probe and len(self.recent) == WINDOW:
            self.probe = []

    def _decide(self):
        here, there = _median(self.recent), _median(self.probe)
        if there < here * (1.0 - GAIN):
            self.cur = self._other()
            self.switches += 1
            self.gap = FIRST_GAP
            self.recent, self.ref = list(self.probe), there
        else:
            self.gap = min(self.gap * 2, MAX_GAP)
            self.ref = here
        self.probe = None
        self.next_probe = self.steps + self.gap
