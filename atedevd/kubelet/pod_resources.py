"""Every resource's questions to kubelet's pod-resources API, within a budget of our own.

kubelet serves pod-resources at 100 requests a second with a burst of 10, to every
client on the node together (pkg/kubelet/apis/podresources/constants.go): monitoring
and topology agents poll the same API, and what is over the limit is refused
ResourceExhausted. One GetAllocatableResources answer counts the devices of every
resource, so one call is made for all the questions that wait, and atedevd takes at
most RATE_PER_S calls a second (a burst of BURST): kubelet's limit minus an agent
polling at 80 a second. A question asked while a call is in flight waits for the next
call: the answer must be newer than what made the question.
"""

from typing import TYPE_CHECKING, Callable, List, Optional, Protocol

if TYPE_CHECKING:
    from atedevd.kubelet.calls import Allocatable

Answer = Callable[["Allocatable"], None]

RATE_PER_S = 20.0  # atedevd's calls a second at most, over all its resources ...
BURST = 5  # ... after a quiet while, this many at once


class _Question:
    __slots__ = ("done", "cancelled")

    def __init__(self, done: Answer) -> None:
        self.done = done
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Asking(Protocol):
    """What the client needs of the host (atedevd/glue/seams.py's HostIO has it)."""

    pod_resources_socket: str

    def monotonic(self) -> float: ...
    def ask_allocatable(self, path: str, done: Answer) -> object: ...


class PodResourcesClient:
    """Asks pod-resources for every resource of one daemon, through the host's I/O."""

    def __init__(self, host: Asking) -> None:
        self.host = host
        self.deadline: Optional[float] = None  # the next call may go then (the budget)
        self.calls = 0  # made, over the daemon's life
        self._waiting: List[_Question] = []  # for the next call
        self._riding: List[_Question] = []  # answered by the call in flight
        self._in_flight = False
        self._tokens = float(BURST)
        self._filled_at: Optional[float] = None

    def ask(self, done: Answer) -> _Question:
        """`done(Allocatable)` on the loop, with an answer newer than now."""
        q = _Question(done)
        self._waiting.append(q)
        self._pump()
        return q

    def on_timer(self, now: float) -> None:
        self.deadline = None
        self._pump()

    def _pump(self) -> None:
        if self._in_flight:
            return
        self._waiting = [q for q in self._waiting if not q.cancelled]
        if not self._waiting:
            return
        now = self.host.monotonic()
        if self._filled_at is not None:
            self._tokens = min(float(BURST), self._tokens + (now - self._filled_at) * RATE_PER_S)
        self._filled_at = now
        if self._tokens < 1.0:  # (never less than a millisecond: a rounding must not make the loop spin)
            self.deadline = now + max((1.0 - self._tokens) / RATE_PER_S, 0.001)
            return
        self._tokens -= 1.0
        self._riding, self._waiting = self._waiting, []
        self._in_flight = True
        self.calls += 1
        self.host.ask_allocatable(self.host.pod_resources_socket, self._answered)

    def _answered(self, answer: "Allocatable") -> None:
        riding, self._riding = self._riding, []
        self._in_flight = False
        for q in riding:
            if not q.cancelled:
                q.done(answer)
        self._pump()
