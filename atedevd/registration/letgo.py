"""The wait for kubelet to let go of our retiring sockets: a small machine, no I/O.

kubelet <= 1.36 tears a stream down in steps: it looks the client up *by
name*, deregisters it, closes the connection, then `PluginDisconnected(name)`
marks the resource's devices unhealthy and stops whatever endpoint is current.
A Register sent before the last step is undone by it, silently. So a new
registration (and the daemon's exit) waits on what kubelet shows:

- CONNECTIONS: kubelet's connections to the retiring sockets, counted in our
  own descriptors, until none is left (the step before PluginDisconnected);
- CONFIRM: then pod-resources no longer lists the resource (the last step);
- where our descriptors cannot show it, pod-resources alone: a streaming
  socket is first made LISTED (a fresh device list, if kubelet lists nothing
  of a stopped endpoint), its stream ended, then the listing must go
  (UNLISTED);
- where nothing can show it, a FIXED wait.

Each step's outcome is a `Verdict` for the machine that composes this one.
"""

import enum
import logging
from typing import Optional

from atedevd.registration.messages import CountConnections, Listing, ResendList, Say
from atedevd.registration.socket_book import SocketBook

LIMIT_S = 10.0  # kubelet's own dial timeout; past it we register anyway
STOP_LIMIT_S = 5.0  # on SIGTERM, wait this long at most (TimeoutStopSec=20s)
POLL_S = 0.005  # how often pod-resources or our descriptors are looked at while waiting
FAST_POLL_S = 0.001  # ... our descriptors, at first, where no hang-up can wake us: a Go kubelet lets go within a millisecond
FIXED_WAIT_S = 0.5  # without pod-resources: how long kubelet is given to let go
RELIST_LIMIT_S = 2.0  # a fresh device list should make kubelet list us again within this
RESEND_EVERY_S = 0.5  # ... sent again this often while it does not
CONFIRM_LIMIT_S = 1.0  # kubelet closed its connection: its listing should be gone within this


class Phase(enum.Enum):
    IDLE = "idle"
    CONNECTIONS = "connections"  # counting kubelet's connections to the retiring sockets
    CONFIRM = "confirm"  # none left: pod-resources should stop listing us
    LISTED = "listed"  # making kubelet list the streaming socket before its stream is ended
    UNLISTED = "unlisted"  # streams ended: pod-resources should stop listing us
    FIXED = "fixed"  # nothing shows kubelet's teardown: a fixed wait
    AWAIT_CALL = "await-call"  # stopping: kubelet let go; a Register in flight is still to come back


class Purpose(enum.Enum):
    REGISTER = "register"  # a registration waits for it
    STOP = "stop"  # the daemon's exit waits for it
    YIELD = "yield"  # a successor's registration waits for it (atedevd/upgrade/machines.py)


class Verdict(enum.Enum):
    WAIT = "wait"  # a timer or a count is out: nothing to do until it comes back
    ASK = "ask"  # ask pod-resources; its answer goes to `on_listing`
    LET_GO = "let-go"  # kubelet let go (or the wait ran out): go on
    KUBELET_DOWN = "kubelet-down"  # pod-resources is refused: kubelet is not serving


class LetGo:
    """One resource's wait for kubelet to let go of its retiring sockets."""

    def __init__(self, name: str, book: SocketBook, out: list, connections_visible: bool = True) -> None:
        self.name = name
        self.book = book
        self._out = out
        self.connections_visible = connections_visible  # our descriptors show kubelet's connections
        self.phase = Phase.IDLE
        self.purpose = Purpose.REGISTER
        self.deadline: Optional[float] = None  # the next step is due then
        self._begun = self._until = 0.0
        self._fixed_until: Optional[float] = None
        self._relist_until = 0.0
        self._resent_at: Optional[float] = None
        self._confirm_until = 0.0
        self._no_signal = False  # kubelet never listed the retiring socket: its teardown cannot show
        self._held_said = False
        self._counts = 0  # CountConnections asked for in this wait

    @property
    def waiting(self) -> bool:
        return self.phase is not Phase.IDLE

    # --- beginning ------------------------------------------------------------------

    def begin(self, now: float, purpose: Purpose, streaming: bool, healthy: bool,
              pod_resources: Optional[bool]) -> Verdict:
        """Wait for the retiring sockets. `streaming`: kubelet was streaming from the one
        that retired last; `pod_resources`: whether kubelet serves that API (None: unknown)."""
        self.purpose = purpose
        self._begun, self._until = now, now + (LIMIT_S if purpose is Purpose.REGISTER else STOP_LIMIT_S)
        self._relist_until = now + RELIST_LIMIT_S
        self._fixed_until = self._resent_at = None
        self._held_said = self._no_signal = False
        self._counts = 0
        if self.connections_visible:
            self._end()
            self.phase = Phase.CONNECTIONS
        elif streaming and healthy and pod_resources is not False:
            self.phase = Phase.LISTED
        else:
            self._end()
            self.phase = Phase.UNLISTED
            self._no_signal = not self.book.listed_seen
        return self._step(now, healthy, pod_resources)

    def begin_earlier_instance(self, now: float, listed: int) -> None:
        """At start, kubelet still lists the resource: an earlier instance's teardown is pending
        (no instance of ours is registered). Registering now could be undone by it."""
        self._say(logging.INFO, "earlier-instance", f"{self.name}: kubelet still lists {listed} devices of an earlier instance; waiting for it to let go")
        self.purpose = Purpose.REGISTER
        self._begun, self._until = now, now + LIMIT_S
        self._fixed_until = None
        self.phase, self._no_signal = Phase.UNLISTED, False
        self.deadline = now + POLL_S

    # --- inputs -----------------------------------------------------------------------

    def on_timer(self, now: float, healthy: bool, pod_resources: Optional[bool]) -> Verdict:
        self.deadline = None
        return self._step(now, healthy, pod_resources)

    def on_hangup(self) -> Verdict:
        """kubelet hung up a connection it held to a retiring socket: count again."""
        if self.phase is Phase.CONNECTIONS:
            self._count()
        return Verdict.WAIT

    def on_connections(self, now: float, held: Optional[int], healthy: bool,
                       pod_resources: Optional[bool], watched: bool = False) -> Verdict:
        """Kubelet's connections to the retiring sockets (None: they cannot be seen);
        `watched`: a hang-up of one of them wakes us."""
        if self.phase is not Phase.CONNECTIONS:
            return Verdict.WAIT
        if held is None:  # cannot be seen after all: kubelet's count alone, from now on
            self.connections_visible = False
            self.phase, self._no_signal = Phase.UNLISTED, not self.book.listed_seen
            return self._step(now, healthy, pod_resources)
        if held > 0:
            if not self._held_said:
                self._held_said = True
                self._say(logging.DEBUG, "let-go", f"{self.name}: kubelet holds {held} connection(s) to our old socket; waiting for it to let go")
            if now < self._until:
                if watched:  # a hang-up wakes us to count again (and a connection made since shows then)
                    self.deadline = self._until
                else:  # counting costs ~0.1 ms: every millisecond at first, backing off to POLL_S
                    self.deadline = now + min(POLL_S, max(FAST_POLL_S, (now - self._begun) / 4))
                return Verdict.WAIT
            self._say(logging.WARNING, "let-go-timeout", f"{self.name}: kubelet still holds {held} connection(s) to our old socket after {now - self._begun:.0f} s; {self._going_on()} anyway")
            return self.done(now)
        self.phase, self._confirm_until = Phase.CONFIRM, now + CONFIRM_LIMIT_S
        return self._step(now, healthy, pod_resources)

    def on_listing(self, now: float, listing: Listing, count: int, healthy: bool,
                   pod_resources: Optional[bool]) -> Verdict:
        """pod-resources' answer: how many of our devices kubelet lists."""
        if self.phase in (Phase.IDLE, Phase.CONNECTIONS, Phase.FIXED, Phase.AWAIT_CALL):
            return Verdict.WAIT  # not asked for (the machine cancels what it no longer wants)
        listed = listing is Listing.LISTED
        if self.phase is Phase.CONFIRM:
            if listed and count > 0 and now < self._confirm_until:
                self.deadline = now + POLL_S
                return Verdict.WAIT
            if listing is Listing.REFUSED and self.purpose is Purpose.REGISTER:
                return self._kubelet_down()
            return self.done(now)
        if listed and self.phase is Phase.LISTED:
            if count > 0:
                self._end()
                self.phase, self.deadline = Phase.UNLISTED, now + POLL_S
            elif now >= self._relist_until:
                self._fixed_wait(now)  # kubelet lists nothing of a streaming socket: no signal
            else:
                if self._resent_at is None or now - self._resent_at >= RESEND_EVERY_S:
                    # A stopped endpoint with its stream open (kubelet <= 1.36) lists nothing;
                    # a fresh device list makes kubelet list it again.
                    self._resent_at = now
                    self._out.extend(ResendList(sid) for sid in self.book.retiring)
                self.deadline = now + POLL_S
            return Verdict.WAIT
        if listed and count > 0:
            if now < self._until:
                self.deadline = now + POLL_S
                return Verdict.WAIT
            self._say(logging.WARNING, "let-go-timeout", f"{self.name}: kubelet still lists our old socket's devices after {now - self._begun:.0f} s; {self._going_on()} anyway")
            return self.done(now)
        if listed:
            return self.done(now)
        if listing is Listing.REFUSED:  # pod-resources is served by kubelet itself: kubelet is down
            self._end()
            return self._kubelet_down() if self.purpose is Purpose.REGISTER else self.done(now)
        self._fixed_wait(now)  # not served, or it failed
        return Verdict.WAIT

    # --- ending -----------------------------------------------------------------------

    def done(self, now: float) -> Verdict:
        """kubelet let go (or the wait ran out): the retiring sockets' streams are ended."""
        self.deadline = None
        counted = f", {self._counts} count(s) of its connections" if self._counts else ""
        self._say(logging.DEBUG, "let-go", f"{self.name}: kubelet let go of our old socket after {(now - self._begun) * 1000:.0f} ms ({self.phase.value}{counted})")
        self._end()
        self.phase = Phase.IDLE
        return Verdict.LET_GO

    def await_call(self, now: float) -> bool:
        """Stopping or handing off, with a Register still in flight: wait for it until the
        limit. False when the limit has passed."""
        if now >= self._until:
            return False
        self.phase, self.deadline = Phase.AWAIT_CALL, self._until
        return True

    def cancel(self) -> None:
        self.phase, self.deadline = Phase.IDLE, None

    # --- steps --------------------------------------------------------------------------

    def _step(self, now: float, healthy: bool, pod_resources: Optional[bool]) -> Verdict:
        if self.phase is Phase.FIXED:
            if self._fixed_until is not None and now < self._fixed_until:
                self.deadline = self._fixed_until
                return Verdict.WAIT
            return self.done(now)
        if self.phase is Phase.AWAIT_CALL:  # the Register never came back: go on all the same
            self.phase = Phase.IDLE
            return Verdict.LET_GO
        if self.phase is Phase.CONNECTIONS:
            self._count()
            return Verdict.WAIT
        if self.phase is Phase.UNLISTED and (pod_resources is False or not healthy or self._no_signal):
            self._fixed_wait(now)  # kubelet's count cannot show the teardown
            return Verdict.WAIT
        if self.phase is Phase.CONFIRM and (pod_resources is False or not healthy):
            return self.done(now)
        return Verdict.ASK

    def _count(self) -> None:
        self._counts += 1
        self._out.append(CountConnections(tuple(self.book.retiring)))

    def _fixed_wait(self, now: float) -> None:
        self._end()
        self.phase = Phase.FIXED
        self._fixed_until = self.deadline = min(now + FIXED_WAIT_S, self._until)

    def _kubelet_down(self) -> Verdict:
        self.phase, self.deadline = Phase.IDLE, None
        return Verdict.KUBELET_DOWN

    def _end(self) -> None:
        self.book.end(self.book.retiring)

    def _going_on(self) -> str:
        return {Purpose.REGISTER: "registering", Purpose.STOP: "exiting", Purpose.YIELD: "handing over"}[self.purpose]

    def _say(self, level: int, kind: str, text: str) -> None:
        self._out.append(Say(level, kind, text))
