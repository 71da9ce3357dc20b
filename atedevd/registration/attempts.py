"""One Register in flight per resource, what comes meanwhile, and when to try again: no I/O.

A Register refused because kubelet.sock is not listening yet (kubelet creates the
file a moment before it listens) is sent again on the same socket: FAST_RETRY_S, then
after half the socket's age each time for the first FAST_WINDOW_S after it appeared, then backing
off, for LISTEN_GRACE_S; a refusal later than that means the kubelet that left the
socket is gone, and only SLOW_RETRY_S looks again (its successor's kubelet.sock
wakes us first). Any other failure retires the socket: the next try registers anew.
"""

import enum
from typing import Iterator, Optional

from atedevd.record import Record
from atedevd.registration.messages import CancelCall, Outcome, SendRegister, Why
from atedevd.registration.report import Tally
from atedevd.registration.socket_book import SocketBook

# kubelet.sock exists but is not listening yet (Go binds, then listens: microseconds apart, a
# loaded node a few ms): try again this soon, and then after half the socket's age each time
# (0.25 ms, 0.4, 0.6, ... ~11 tries in the first FAST_WINDOW_S), then back off. Nothing tells
# when it listens: a poll at the rate a prompt Register needs, no faster.
FAST_RETRY_S = 0.00025
FAST_WINDOW_S = 0.02
LISTEN_GRACE_S = 5.0  # a Register refused though sent this long after kubelet.sock appeared: that kubelet is gone
SLOW_RETRY_S = 10.0  # kubelet down: look again this often, in case an event was lost
OLD_KUBELET_MARGIN_S = 0.1  # a Register started this long before the newest kubelet.sock appeared went to the old one


class Retry(enum.Enum):
    NONE = "none"
    SAME = "same"  # send Register again on the current socket
    NEW = "new"  # begin a registration (on a new socket)


class Backoff:
    """Capped exponential delay between failed attempts: 10 ms … 2 s."""

    def __init__(self, first: float = 0.01, cap: float = 2.0):
        self.first, self.cap, self.delay = first, cap, 0.0

    def next(self) -> float:
        self.delay = self.first if self.delay == 0 else min(self.delay * 2, self.cap)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


class RegisterInFlight(Record):
    cid: int
    started: float
    sid: int  # the socket it names


class Attempts:
    """A registration begun: its socket put in place, the Register call in flight, the
    trigger that came meanwhile, the check that kubelet's stream opens, the next retry."""

    def __init__(self, out: list, cids: Iterator[int], book: SocketBook, tally: Tally) -> None:
        self._out = out
        self._cids = cids  # shared with the machine's other calls
        self.book = book
        self.tally = tally
        self.call: Optional[RegisterInFlight] = None
        self.redo: Optional[Why] = None  # register again once the call in flight ends, and why
        self.retry = Retry.NONE
        self.why = Why.RETRY  # what a NEW retry begins a registration for
        self.deadline: Optional[float] = None  # the retry is due then
        self.verify_by: Optional[float] = None  # Register returned OK: kubelet's stream must open by then
        self.backoff = Backoff()

    # --- the call -----------------------------------------------------------------------

    def begin(self, why: Why) -> None:
        """Put a socket in place for Register: the standby if one is serving (it cannot have
        been wiped), else one bound in place. What came meanwhile is moot: this answers it."""
        self.redo = None
        self.tally.begin(why)
        if self.book.place_standby() is None:  # a standby still binding stays the standby
            self.book.bind(standby=False)

    def placed(self, now: float, sid: int) -> None:
        """The socket is in place: it is the current one, and Register names it."""
        self.book.make_current(sid)
        self.send(now, sid)

    def send(self, now: float, sid: int) -> None:
        cid = next(self._cids)
        self.call = RegisterInFlight(cid, now, sid)
        self._out.append(SendRegister(cid, sid))

    def ended(self, cid: int) -> Optional[RegisterInFlight]:
        """The call `cid` came back: it, if it is the one in flight (else it was cancelled)."""
        if self.call is None or self.call.cid != cid:
            return None
        call, self.call = self.call, None
        return call

    def cancel(self) -> None:
        if self.call is not None:
            self._out.append(CancelCall(self.call.cid))
            self.call = None

    def reached(self, kubelet_at: float) -> bool:
        """The call in flight dialled the kubelet whose kubelet.sock appeared at `kubelet_at`
        (or fails at once): its own outcome decides."""
        return self.call is not None and self.call.started >= kubelet_at - OLD_KUBELET_MARGIN_S

    # --- retrying -------------------------------------------------------------------------

    def later(self, at: float, retry: Retry = Retry.NEW, why: Why = Why.RETRY) -> None:
        self.deadline, self.retry, self.why = at, retry, why

    def failed(self, now: float, call: RegisterInFlight, outcome: Outcome, same_socket: bool,
               kubelet_at: Optional[float], kubelet_up: bool) -> bool:
        """The Register `call` was refused or failed: when, and how, to try again.

        Refused with the socket still ours: nobody listened on kubelet.sock, which was
        just created (again at once, on the same socket) or left by a kubelet that is gone
        (slowly). Anything else: kubelet may hold half a client of ours, so that socket
        retires and a new registration follows, at once for a kubelet that appeared
        since the call began, else backing off. True when the kubelet that left kubelet.sock
        is gone (a refusal long after the socket appeared)."""
        appeared = kubelet_at is not None and kubelet_at > call.started
        if appeared:
            self.redo = None  # the kubelet that appeared since is the next try's anyway
        if outcome is Outcome.REFUSED and same_socket:
            since = call.started - kubelet_at if kubelet_at is not None else LISTEN_GRACE_S
            if not kubelet_up or since >= LISTEN_GRACE_S:
                self.later(now + SLOW_RETRY_S, Retry.SAME)
                return True  # the kubelet that left kubelet.sock is gone
            elif since < FAST_WINDOW_S:
                delay = max(FAST_RETRY_S, (now - kubelet_at) / 2 if kubelet_at is not None else 0.0)
            else:
                delay = self.backoff.next()
            self.later(now + delay, Retry.SAME)
        else:
            self.later(now + (0.0 if appeared else self.backoff.next()))
        return False

    def defer(self, why: Why) -> None:
        """A trigger came while a registration is under way: act on it when it ends."""
        self.redo = why

    def forget_redo(self) -> None:
        self.redo = None

    def expect_stream(self, by: float) -> None:
        """Register returned OK: kubelet's ListAndWatch must open by then."""
        self.verify_by = by

    def stream_seen(self) -> None:
        """kubelet's stream opened (or is no longer waited for)."""
        self.verify_by = None

    def next_delay(self) -> float:
        """The next backoff delay (10 ms, doubling, up to 2 s)."""
        return self.backoff.next()

    def reset_backoff(self) -> None:
        self.backoff.reset()

    def take_redo(self) -> Optional[Why]:
        why, self.redo = self.redo, None
        return why

    def due(self, now: float) -> bool:
        return self.deadline is not None and self.deadline <= now

    def fire(self) -> Retry:
        """The retry is due: what it is (it is not due again unless set again)."""
        self.deadline = None
        return self.retry

    def nudge(self, now: float, kubelet_up: bool, kubelet_at: Optional[float]) -> None:
        """News from kubelet's directory: a retry that waits may go now (unless kubelet is down)."""
        if self.deadline is not None and kubelet_up and kubelet_at is not None and now - kubelet_at < LISTEN_GRACE_S:
            self.deadline = min(self.deadline, now)

    def slow(self, now: float) -> None:
        """kubelet.sock is gone: a waiting retry only looks again slowly."""
        if self.deadline is not None:
            self.deadline = now + SLOW_RETRY_S

    def clear(self) -> None:
        """No retry due, no stream waited for."""
        self.deadline, self.retry, self.verify_by = None, Retry.NONE, None

    def stop(self) -> None:
        """Nothing more of this registration: the call cancelled, no retry, nothing to verify."""
        self.cancel()
        self.redo = None
        self.clear()
