"""Simulated time for a world: a seeded random source, a queue of events by time, and the rule for
how long one step takes. The device-plugin world (world.py) and DRA mode's (dra.py) both run on one."""

import heapq
import random
from typing import Callable, List, Optional


class SimClock:
    def __init__(self, seed: int, max_delay: float = 1.0) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self.max_delay = max_delay
        self._q: list = []
        self._seq = 0
        self._pending = 0  # queued events that are not a process's timer (`timer_at`)
        self.events = 0
        self.said: List[tuple] = []  # (time, level, kind, text) of every daemon that ran
        self.trace = False  # when replaying: every action and model step goes into `said`

    def idle(self) -> bool:
        """Every process has nothing of its own under way (`run_until`'s `settled`)."""
        return all(d.idle() for d in self.processes)  # type: ignore[attr-defined]


    def note(self, who: str, text: str) -> None:
        if self.trace:
            self.said.append((self.now, 0, who, text))

    def delay(self) -> float:
        """One step's delay: often a few ms, often anything up to `max_delay`."""
        r = self.rng.random()
        return r * 0.004 if r < 0.5 else (r - 0.5) * 2 * self.max_delay

    def after(self, delay: float, fn, *args) -> None:
        self._seq += 1
        self._pending += 1
        heapq.heappush(self._q, (self.now + delay, self._seq, fn, args, True))

    def timer_at(self, at: float, fn, *args) -> None:
        """A process's wake-up for its own timers: the only kind of event `run_until`'s
        `settled` lets stay queued."""
        self._seq += 1
        heapq.heappush(self._q, (self.now + max(0.0, at - self.now), self._seq, fn, args, False))

    def run_until(self, t: float, settled: Optional[Callable[[], bool]] = None) -> None:
        """Every event due by `t`; with `settled`, stop sooner once nothing can change any more
        (nothing is queued but the processes' own wake-ups, and each process's timers are only the
        periodic ones) and `settled()` holds: from there on only periodic looks come, which find
        what is there, and the end state is what it is now."""
        q = self._q
        while q and q[0][0] <= t:
            at, _, fn, args, pending = heapq.heappop(q)
            self.now = at
            self.events += 1
            self._pending -= pending
            fn(*args)
            self.stepped()
            if settled is not None and not self._pending and self.idle() and settled():
                return
        self.now = max(self.now, t)

    def stepped(self) -> None:
        """After every event: a world's checks that hold at every moment."""
