"""One lifecycle event on the real node, measured as kubelet saw it: the window in which it held
no healthy unit (from its log), the Register calls it got, and pods put into the window.

Pods are put in when kubelet's log says the window opened (or, for an event that should open
none, at the moment one would), a few milliseconds apart, as bare pods bound to the node (no
scheduler in between). Whether each was rejected is read from the API (UnexpectedAdmissionError:
kubelet never retries it), when kubelet took it in from its log ("SyncLoop ADD").
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from tests.e2e import workloads as w
from tests.e2e.api import pod_phase, rejected, wait_for
from tests.e2e.cluster import NODE, Cluster
from tests.e2e.kubelet_log import SERVER, STREAM_ENDED, UNHEALTHY, ms, spread

EDGE_S = 0.003  # a pod taken in this close to a window's edge may fall either way (admission follows the log line)


@dataclass
class PodOutcome:
    name: str
    sent_at: float
    admitted_at: Optional[float]
    rejected: bool
    message: str = ""


@dataclass
class EventRound:
    since: float
    windows: List[Tuple[float, float, float]]  # (start, healthy, settled): KubeletLog.windows
    registers: int
    pods: List[PodOutcome] = field(default_factory=list)

    @property
    def window_s(self) -> float:
        """How long kubelet could not allocate: from the window's start to the healthy list."""
        return sum(b - a for a, b, _ in self.windows)

    def inside(self, p: PodOutcome, margin: float = 0.0) -> bool:
        return p.admitted_at is not None and any(a + margin <= p.admitted_at <= b - margin for a, b, _ in self.windows)

    def outside(self, p: PodOutcome, margin: float = 0.0) -> bool:
        """Taken in clear of every window, its start to the list's processing done."""
        return p.admitted_at is not None and all(not (a - margin <= p.admitted_at <= c + margin)
                                                 for a, _, c in self.windows)


class PodsIntoWindow:
    """`count` bare pods, `gap` s apart, sent when kubelet's log first shows one of `trigger` after
    `since` (or at once, trigger=())."""

    def __init__(self, cluster: Cluster, tag: str, count: int = 3, gap: float = 0.01,
                 trigger: Sequence[str] = (UNHEALTHY, STREAM_ENDED, SERVER)):
        self.cluster, self.tag, self.count, self.gap, self.trigger = cluster, tag, count, gap, tuple(trigger)
        self.sent: List[Tuple[str, float]] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def arm(self, since: float) -> "PodsIntoWindow":
        self._thread = threading.Thread(target=self._run, args=(since,), daemon=True)
        self._thread.start()
        return self

    def _run(self, since: float) -> None:
        deadline = time.monotonic() + 60
        while self.trigger and not self._stop.is_set() and time.monotonic() < deadline:
            log = self.cluster.klog()
            if any(log.of(m, since, resource=(m != SERVER)) for m in self.trigger):
                break
            time.sleep(0.001)
        if not self._stop.is_set():
            self.send()

    def send(self) -> None:
        """The pods, now (what arm's thread does once the trigger is seen)."""
        for i in range(self.count):
            name = f"{self.tag}-{i}"
            at = time.time()
            self.cluster.api.create(w.PODS, w.pod(name, self.cluster.image, node=NODE, labels={"window": self.tag}))
            self.sent.append((name, at))
            time.sleep(self.gap)

    def outcomes(self, since: float, timeout: float = 120) -> List[PodOutcome]:
        """Each pod once kubelet decided it: rejected, or running (or done)."""
        if self._thread is not None:
            self._thread.join(70)
        self._stop.set()
        out = []
        for name, at in self.sent:
            def decided():
                p = self.cluster.api.get(f"{w.PODS}/{name}")
                return p if rejected(p) or pod_phase(p) in ("Running", "Succeeded", "Failed") else None
            p = wait_for(f"kubelet to decide pod {name}", decided, timeout, 0.1)
            st = p.get("status", {})
            out.append(PodOutcome(name, at, self.cluster.klog().admitted_at(name, since), rejected(p),
                                  f"{st.get('reason', '')}: {st.get('message', '')}" if rejected(p) else ""))
        return out


def measure(cluster: Cluster, event: Callable[..., None], settled: Callable[[float], bool], tag: str,
            pods: int = 3, gap: float = 0.01, trigger: Sequence[str] = (UNHEALTHY, STREAM_ENDED, SERVER),
            settle_timeout: float = 60, send_in_event: bool = False) -> EventRound:
    """Run `event`, with pods put into its window, until `settled(since)`; what kubelet saw.
    send_in_event: the event is given the pods to send when it chooses (event(into))."""
    since = time.time()
    into = PodsIntoWindow(cluster, tag, pods, gap, trigger) if pods else None
    if send_in_event:
        event(into)
    else:
        if into:
            into.arm(since)
        event()
    wait_for(f"the node to settle after {tag}", lambda: settled(since), settle_timeout, 0.02)
    time.sleep(0.5)  # what kubelet does right after (a late teardown) is part of the event
    outcomes = into.outcomes(since) if into else []
    until = time.time()
    log = cluster.klog()
    return EventRound(since, [(a, min(b, until), min(c, until)) for a, b, c in log.windows(since, until)],
                 log.registers(since, until), outcomes)


def summary(rounds: List[EventRound]) -> str:
    """Windows min/median/max, Registers per round, pods taken in inside the windows (start to the
    healthy list), while kubelet processed that list, and clear of them, and how many were rejected."""
    pods = [(r, p) for r in rounds for p in r.pods]
    inside = [p for r, p in pods if r.inside(p)]
    outside = [p for r, p in pods if r.outside(p)]
    edge = [p for r, p in pods if not r.inside(p) and not r.outside(p)]
    regs = sorted({r.registers for r in rounds})
    text = (f"window {spread([r.window_s for r in rounds])} over {len(rounds)} rounds "
            f"({sum(1 for r in rounds if r.windows)} with a window); Registers per round {'/'.join(map(str, regs))}; "
            f"pods {len(pods)}: in a window {len(inside)} (rejected {sum(p.rejected for p in inside)})")
    if edge:
        text += f", while kubelet processed the list {len(edge)} (rejected {sum(p.rejected for p in edge)})"
    return text + f", clear of it {len(outside)} (rejected {sum(p.rejected for p in outside)})"


def cell(rounds: List[EventRound]) -> str:
    """The table's word for an event: the median window and the pods kubelet rejected of those sent."""
    pods = [p for r in rounds for p in r.pods]
    if not any(r.windows for r in rounds):
        return f"no window; {sum(p.rejected for p in pods)}/{len(pods)} rejected"
    windows = sorted(r.window_s for r in rounds)
    return f"{ms(windows[len(windows) // 2])} ms; {sum(p.rejected for p in pods)}/{len(pods)} rejected"


def check_pods(rounds: List[EventRound]) -> None:
    """kubelet's rule, as the design states it: a pod taken in while no unit is healthy is
    rejected, one taken in while the resource is healthy is admitted."""
    for r in rounds:
        for p in r.pods:
            assert p.admitted_at is not None, f"kubelet's log never took {p.name} in"
            if r.inside(p, EDGE_S):
                assert p.rejected, (p, [(ms(a - p.admitted_at), ms(b - p.admitted_at)) for a, b, _ in r.windows])
            if r.outside(p, EDGE_S):
                assert not p.rejected, (p, [(ms(a - p.admitted_at), ms(c - p.admitted_at)) for a, _, c in r.windows])
