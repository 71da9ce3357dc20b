"""What one resource's registration has to tell: the tally it keeps, and the typed
report that `STATUS=`, the metrics and the journal read. No I/O, bounded in size:
Registers are counted by `Why` (an enum), and the last error's text is kept once.
"""

import logging
import time
from typing import Dict, Optional, Tuple

from atedevd.record import Record
from atedevd.registration.messages import Say, State, Why

WARN_AFTER_S = 20.0  # failing this long after a first registration (past any kubelet restart): a WARNING ...
WARN_EVERY_S = 60.0  # ... and again at most this often
REFUSED_SAY_EVERY_S = 60.0  # refused streams: one line a minute at most
WAITING_SAY_EVERY_S = 60.0  # before a first registration, a new reason to wait is INFO this often at most


class Tally:
    """Counts and times of one resource's registrations, kept by the machine, and the
    journal lines that tell them."""

    def __init__(self, name: str, out: list) -> None:
        self.name = name
        self._out = out
        self.registrations = 0  # accepted and verified
        self.begun: Dict[Why, int] = {}  # registrations begun, by why
        self.begun_total = 0
        self.registered_at: Optional[float] = None
        self.lost_at: Optional[float] = None  # the registration was lost then; not yet back
        self.last_error: Optional[str] = None
        self.failing_since: Optional[float] = None
        self.serve_error: Optional[str] = None
        self.standby_error: Optional[str] = None  # the next registration's socket cannot be bound
        self.last_reregistration: Optional[Tuple[float, float]] = None  # (at, seconds taken)
        self.refused_streams = 0
        self._refused_said_at: Optional[float] = None
        self._waiting_said_at: Optional[float] = None
        self.deadline: Optional[float] = None  # the next "still not registered" warning

    def begin(self, why: Why) -> None:
        self.begun[why] = self.begun.get(why, 0) + 1
        self.begun_total += 1
        said = f"retry: {self.last_error}" if why is Why.RETRY and self.last_error else why.text
        self._say(logging.DEBUG, "registering", f"registering ({said})")

    def lost(self, now: float, level: int = 0, kind: str = "", text: str = "") -> None:
        """The registration is lost (said at `level`, when there is a `text`)."""
        self.lost_at = now
        if text:
            self._say(level, kind, text)

    def failing(self, now: float, reason: str) -> None:
        """Not registered, for `reason`. A new reason is worth an INFO line before any
        registration (after one, the gaps of a restarting kubelet are expected), once a
        minute at most (kubelet's errors can name something new every time)."""
        worth = reason != self.last_error and self.registrations == 0 and (
            self._waiting_said_at is None or now - self._waiting_said_at >= WAITING_SAY_EVERY_S)
        if worth:
            self._waiting_said_at = now
        self._say(logging.INFO if worth else logging.DEBUG, "waiting-for-kubelet", f"waiting for kubelet: {reason}")
        self.last_error = reason
        if self.failing_since is None:
            self.failing_since = now
            if self.registrations > 0:
                self.deadline = now + WARN_AFTER_S

    def verified(self, now: float, units: int, device_path: str) -> None:
        """kubelet streams our devices: said, with how long it took since the registration was lost."""
        self.registrations += 1
        self.registered_at = now
        self.last_error = self.failing_since = self.deadline = None
        if self.lost_at is not None:
            took = now - self.lost_at
            self.last_reregistration = (now, took)
            self.lost_at = None
            self._say(logging.INFO, "reregistered", f"registered again with kubelet ({took * 1000:.0f} ms after the loss)")
        elif self.registrations == 1:
            self._say(logging.INFO, "registered", f"registered with kubelet ({units} units of {device_path})")
        else:
            self._say(logging.INFO, "reregistered", "registered again with kubelet")

    def shown(self) -> tuple:
        """What the report shows of it: it changed when this did."""
        return (self.registrations, self.begun_total, self.refused_streams, self.last_error, self.failing_since,
                self.serve_error, self.last_reregistration)

    def cancel_timer(self) -> None:
        self.deadline = None

    def serving(self) -> None:
        """A socket was bound: whatever could not be served is served now."""
        self.serve_error = self.standby_error = None

    def serve_failed(self, error: str) -> None:
        """A socket cannot be served (retried on every wake-up: said once, until it can)."""
        text = f"{self.name}: cannot serve {error}"
        if self.serve_error is None:
            self._out.append(Say(logging.ERROR, "serve-failed", text))
        self.serve_error = text

    def standby_failed(self, error: str) -> None:
        """The socket for the next registration cannot be bound; the registered one serves on
        (retried: said once, until one is bound)."""
        if self.standby_error is None:
            self._say(logging.WARNING, "standby-failed", f"cannot bind the socket for the next registration "
                      f"{error}; the registered one serves on, binding is tried again")
        self.standby_error = error

    def stream_refused(self, now: float, where: str, limit: int) -> None:
        self.refused_streams += 1
        if self._refused_said_at is None or now - self._refused_said_at >= REFUSED_SAY_EVERY_S:
            self._refused_said_at = now
            self._say(logging.ERROR, "stream-refused", f"refused a ListAndWatch stream on {where}: {limit} already open for this resource ({self.refused_streams} refused so far)")

    def on_timer(self, now: float, registered: bool) -> None:
        """Still not registered, long after having been: a WARNING, again every minute."""
        self.deadline = None
        if registered or self.registrations == 0 or self.failing_since is None:
            return
        self._say(logging.WARNING, "still-unregistered", f"not registered with kubelet for {now - self.failing_since:.0f} s: {self.last_error}")
        self.deadline = now + WARN_EVERY_S

    def report(self, state: State, changed_at: float, device_path: str, pattern: bool, advertised: bool, units: int,
               healthy_units: int, kubelet_count: Optional[int], registers_sent: int, allocate_calls: int,
               allocate_failures: int) -> "Report":
        """The report of its resource, with what the registration and the resource know."""
        return Report(
            name=self.name, device_path=device_path, pattern=pattern, state=state, changed_at=changed_at,
            advertised=advertised, units=units, healthy_units=healthy_units, kubelet_count=kubelet_count,
            registrations=self.registrations, begun=dict(self.begun), registers_sent=registers_sent,
            allocate_calls=allocate_calls, allocate_failures=allocate_failures, refused_streams=self.refused_streams,
            last_error=self.last_error, failing_since=self.failing_since, serve_error=self.serve_error,
            last_reregistration=self.last_reregistration)

    def _say(self, level: int, kind: str, text: str) -> None:
        self._out.append(Say(level, kind, f"{self.name}: {text}"))


class Report(Record):
    """One resource as `STATUS=` and the metrics show it, at one moment."""

    name: str
    device_path: str
    pattern: bool  # its path is a pattern: one unit per matching node
    state: State
    changed_at: float  # monotonic
    advertised: bool  # its device was seen at some point: served (Unhealthy while missing)
    units: int  # advertised to kubelet (0 while nothing is served)
    healthy_units: int
    kubelet_count: Optional[int]  # what pod-resources last listed; None: not asked, or not served
    registrations: int
    begun: Dict[Why, int]  # registrations begun, by why (a copy)
    registers_sent: int
    allocate_calls: int
    allocate_failures: int
    refused_streams: int
    last_error: Optional[str]
    failing_since: Optional[float]
    serve_error: Optional[str]
    last_reregistration: Optional[Tuple[float, float]]

    @property
    def registered(self) -> bool:
        return self.state is State.REGISTERED

    @property
    def served(self) -> bool:
        return self.state not in (State.UNSERVED, State.STOPPED)


def describe(r: Report, now: float, wall_now: float) -> str:
    """This resource's registration in words, for STATUS= (`wall_now`: the wall clock at `now`)."""

    def clock(at: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(wall_now - (now - at)))

    s = r.state
    if s is State.REGISTERED:
        text = f"registered, {r.healthy_units}/{r.units} healthy"
        if r.kubelet_count is not None:
            text += f", kubelet counts {r.kubelet_count}"
        if r.last_reregistration:
            at, took = r.last_reregistration
            text += f", re-registered {clock(at)} in {took * 1000:.0f} ms"
    elif s in (State.REGISTERING, State.VERIFYING, State.LETTING_GO):
        text = "registering with kubelet"
    elif s is State.UNSERVED:
        text = "not served" + (f": {r.serve_error.rsplit(': ', 1)[-1]}" if r.serve_error else "")
    else:
        text = "waiting for kubelet"
        if r.last_error and r.failing_since is not None and r.registrations > 0:
            text += f" since {clock(r.failing_since)}: {r.last_error}"
    if r.refused_streams:
        text += f", {r.refused_streams} stream(s) refused"
    return text
