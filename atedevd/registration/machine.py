"""One resource's registration with kubelet: the machine that composes the parts.

`Registration.handle(now, event)` takes a typed event (`messages.py`) with the
time (seconds on a monotonic clock); `take()` gives the actions to perform;
`get_timer()` is when it wants `handle_timer(now)`. Nothing here reads a file,
a socket or a clock, so one seed of the simulation replays one run exactly.

It composes four parts, each with a job and a state of its own: the
`SocketBook` (which sockets exist and what each is for), the `Handover` (the
wait for kubelet to let go of an old socket), the `CountCheck` (does kubelet
count our devices?) and the `Tally` (what `STATUS=` and the metrics tell).
What is left here is the registration's own state, `State`, and its moves
between them, every one listed in `TRANSITIONS`.

The rules, each from a way kubelet really behaves (docs/design.md, "Registration"):
every Register names a socket of its own, the next one already serving in the
standby directory; one Register in flight, triggers that come meanwhile acted on
when it ends; while the same kubelet stays up, a new registration first hands
over; a Register refused because kubelet.sock is not listening yet is sent again
at once on the same socket; a Register that returned OK is believed only once
kubelet opens ListAndWatch and, where it can be asked, counts our devices.
"""

import enum
import logging
from typing import Dict, NamedTuple, Optional

from atedevd.registration import messages as m
from atedevd.registration.count_check import CountCheck
from atedevd.registration.handover import Handover, Purpose, Verdict
from atedevd.registration.messages import Listing, Outcome, State, Timer, Why
from atedevd.registration.report import Tally
from atedevd.registration.socket_book import SocketBook

ERROR, WARNING, INFO, DEBUG = logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG

VERIFY_S = 5.0  # Register returned OK: kubelet's ListAndWatch must open by then
STABLE_AFTER_S = 2.0  # a stream end after this long is answered at once; earlier ones back off
FAST_RETRY_S = 0.00025  # kubelet.sock exists but is not listening yet: try again this soon ...
FAST_WINDOW_S = 0.02  # ... for this long after it appeared, then back off
LISTEN_GRACE_S = 5.0  # a Register refused though sent this long after kubelet.sock appeared: that kubelet is gone
SLOW_RETRY_S = 10.0  # kubelet down: look again this often, in case an event was lost
STANDBY_AGAIN_S = 1.0  # the standby socket was deleted: bind the next one this much later
OLD_KUBELET_MARGIN_S = 0.1  # a Register started this long before the newest kubelet.sock appeared went to the old one

_SERVED = (State.WAITING, State.LETTING_GO, State.REGISTERING, State.VERIFYING, State.REGISTERED)
_STREAMING = (State.VERIFYING, State.REGISTERED)
_IDLE = (State.UNSERVED, State.STOPPING, State.STOPPED)

# Every move the machine makes, and on what. `_set` refuses any other.
TRANSITIONS = (
    (State.UNSERVED, State.WAITING, "the device is advertised and the plugin directory exists"),
    (State.WAITING, State.REGISTERING, "a socket is ready and kubelet serves, or a retry is due"),
    (State.WAITING, State.LETTING_GO, "at start kubelet lists an earlier instance; a retry hands over"),
    (State.LETTING_GO, State.REGISTERING, "kubelet let go of our old socket"),
    (State.LETTING_GO, State.WAITING, "pod-resources refused: kubelet is down"),
    (State.REGISTERING, State.VERIFYING, "Register returned OK"),
    (State.REGISTERING, State.WAITING, "Register refused or failed"),
    (State.REGISTERING, State.LETTING_GO, "Register returned OK, but a trigger came meanwhile"),
    (State.VERIFYING, State.REGISTERED, "kubelet opened ListAndWatch on the new socket"),
    (State.VERIFYING, State.WAITING, "no stream within VERIFY_S; the stream ended at once"),
    (State.VERIFYING, State.LETTING_GO, "the stream ended, the socket was deleted, the configuration changed"),
    (State.VERIFYING, State.REGISTERING, "kubelet restarted"),
    (State.REGISTERED, State.LETTING_GO, "the stream ended, the socket was deleted, the configuration changed, not counted"),
    (State.REGISTERED, State.REGISTERING, "kubelet restarted: nothing to hand over"),
    (State.REGISTERED, State.WAITING, "a young stream ended (back off), or kubelet is down"),
    *((s, State.UNSERVED, "the plugin directory is gone, or a socket cannot be served") for s in _SERVED),
    *((s, State.STOPPING, "SIGTERM") for s in _SERVED),
    *((s, State.STOPPED, "closed") for s in (State.UNSERVED, *_SERVED, State.STOPPING)),
)
_ALLOWED = {(a, b) for a, b, _ in TRANSITIONS}


class InvalidTransition(Exception):
    pass


class Backoff:
    """Capped exponential delay between failed attempts: 10 ms … 2 s."""

    def __init__(self, first: float = 0.01, cap: float = 2.0):
        self.first, self.cap, self.delay = first, cap, 0.0

    def next(self) -> float:
        self.delay = self.first if self.delay == 0 else min(self.delay * 2, self.cap)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


class Call(NamedTuple):
    cid: int
    started: float
    sid: int  # the socket it names


class Question(enum.Enum):
    """Whose answer a pod-resources call in flight is."""

    START = "start"  # at start: is an earlier instance's teardown pending?
    CHECK = "check"  # the CountCheck's
    HANDOVER = "handover"  # the Handover's


class Asking(NamedTuple):
    cid: int
    question: Question


class Registration:
    """One resource's sockets and its registration with kubelet, as decisions only."""

    def __init__(self, name: str, units: int, healthy_units: Optional[int] = None, standby_possible: bool = True,
                 device_path: str = "the device", connections_visible: bool = True):
        self.name = name
        self.units = units  # advertised
        self.healthy_units = units if healthy_units is None else healthy_units
        self.device_path = device_path  # for what we say
        self.standby_possible = standby_possible  # False where the standby path would be too long
        self.state = State.UNSERVED
        self.changed_at = 0.0  # when `state` last changed
        self.actions: list = []
        self.kubelet_up = False
        self.kubelet_at: Optional[float] = None  # when the newest kubelet.sock appeared
        self.book = SocketBook(self.actions)
        self.handover = Handover(name, self.book, self.actions, connections_visible)
        self.check = CountCheck(name, self.actions)
        self.tally = Tally(name, self.actions)
        self._timers: Dict[Timer, float] = {}  # the machine's own (the parts keep theirs)
        self._last_cid = 0
        self.call: Optional[Call] = None  # the Register in flight
        self._ask: Optional[Asking] = None  # the pod-resources call in flight
        self.redo: Optional[Why] = None  # register again once the call in flight ends, and why
        self._why = Why.FIRST  # why the registration under way was begun
        self._retry_same = False  # the due retry resends Register on the current socket ...
        self._retry_why = Why.RETRY  # ... or begins a registration for this
        self.backoff = Backoff()

    # --- for the performer ---------------------------------------------------------------

    def handle(self, now: float, event) -> None:
        _HANDLERS[type(event)](self, now, event)

    def take(self) -> list:
        actions = list(self.actions)
        self.actions.clear()
        return actions

    def get_timer(self) -> Optional[float]:
        """When `handle_timer` is due next: the earliest of the machine's timers and its parts'."""
        times = [t for t in (self.handover.deadline, self.check.deadline, self.tally.deadline) if t is not None]
        if self._timers:
            times.append(min(self._timers.values()))
        return min(times) if times else None

    def timer_due(self, timer: Timer, now: float) -> bool:
        at = self._timers.get(timer)
        return at is not None and at <= now

    def handle_timer(self, now: float) -> None:
        for timer, fire in _TIMERS:
            if self.timer_due(timer, now):
                del self._timers[timer]
                fire(self, now)
        if self.handover.deadline is not None and self.handover.deadline <= now:
            if self.state in (State.LETTING_GO, State.STOPPING):
                self._after_handover(now, self.handover.on_timer(now, self.healthy_units > 0, self.check.served))
            else:
                self.handover.cancel()
        if self.check.deadline is not None and self.check.deadline <= now:
            self.check.deadline = None
            if self.state is State.REGISTERED and self._ask is None:
                self._ask_pod_resources(Question.CHECK)
        if self.tally.deadline is not None and self.tally.deadline <= now:
            self.tally.on_timer(now, self.state is State.REGISTERED)

    @property
    def stopped(self) -> bool:
        return self.state in (State.STOPPED, State.UNSERVED)

    # --- events: the node and the daemon -------------------------------------------------

    def _serve(self, now: float, e: m.Serve) -> None:
        if self.state is not State.UNSERVED:
            return
        self.kubelet_up = e.kubelet_up
        if e.kubelet_at is not None:
            self.kubelet_at = e.kubelet_at
        self._set(State.WAITING, now)
        if e.kubelet_up:
            self._ask_pod_resources(Question.START)  # a previous instance's teardown may be pending
        if self.standby_possible:
            self.book.bind(standby=True)
        self._try_start(now)

    def _unserve(self, now: float, e: m.Unserve) -> None:
        if self.state in _IDLE:
            return
        if self.state in _STREAMING:
            self._say(WARNING, "registration-lost", f"{self.name}: lost registration: {e.why}")
            self.tally.lost(now)
        self._close_all()
        self._set(State.UNSERVED, now)

    def _publish(self, now: float, e: m.Publish) -> None:
        self.healthy_units = e.healthy_units
        if self.state is State.REGISTERED and self._ask is None:  # kubelet's count follows: look again soon
            self.check.soon(now)

    def _reconfigure(self, now: float, e: m.Reconfigure) -> None:
        self.units, self.healthy_units = e.units, e.healthy_units
        self.book.close(self.book.standby)  # it serves the old table
        if self.state in _IDLE:
            return
        if self.state in _STREAMING:
            self.tally.lost(now)
        self._attempt(now, Why.CONFIG_CHANGED)

    def _stop(self, now: float, e: m.Stop) -> None:
        if self.state in (State.STOPPING, State.STOPPED):
            return
        if self.state is State.UNSERVED:
            self._set(State.STOPPED, now)
            return
        # A Register in flight is not cancelled: kubelet goes on with it whatever we do, so
        # its outcome is waited for (bounded) and its socket let go of like the others.
        if self._ask is not None:
            self._cancel_ask()
        self.book.close(self.book.placing)
        self.book.close(self.book.standby)
        streaming = self.book.retire_current()
        self._timers.clear()
        self.check.stop()
        self.tally.deadline = None
        self._set(State.STOPPING, now)
        if not self.kubelet_up or not (self.book.known_retiring() or self.call is not None):
            self._finish_stop(now)
            return
        self._hand_over(now, Purpose.STOP, streaming)

    def _close(self, now: float, e: m.CloseAll) -> None:
        self._close_all()
        self._set(State.STOPPED, now)

    # --- events: kubelet's directory ---------------------------------------------------

    def _kubelet_created(self, now: float, e: m.KubeletCreated) -> None:
        """A starting kubelet deletes every socket in the directory first, so if none of
        ours kubelet may hold is still there, kubelet restarted: the new one has no client
        of ours that a late teardown could confuse, so no waiting. If one is still there,
        the same kubelet re-created its socket and still holds our client."""
        self.kubelet_up, self.kubelet_at = True, e.at
        if self.state in _IDLE:
            return
        restarted = not e.ours_present
        if self.call is not None:
            if self.call.started >= e.at - OLD_KUBELET_MARGIN_S and not restarted:
                return  # it dialled this kubelet (or fails at once): its outcome decides
            # Hanging on a kubelet that is gone, or naming a socket that kubelet's wipe removed.
            self.actions.append(m.CancelCall(self.call.cid))
            self.call = None
        if self._ask is not None and self._ask.question is not Question.CHECK:
            self._cancel_ask()
        if self.state in _STREAMING:
            how = "kubelet restarted" if restarted else "kubelet serves a new kubelet.sock"
            self._say(INFO, "kubelet-restarted", f"{self.name}: {how}; registering again")
            self.tally.lost(now)
        self.redo = None
        self.backoff.reset()
        if restarted:
            for sid in self.book.held():
                self.book.deleted(sid)
        self._attempt(now, Why.KUBELET_RESTARTED if restarted else Why.NEW_KUBELET_SOCKET, wait=not restarted)

    def _kubelet_gone(self, now: float, e: m.KubeletGone) -> None:
        self.kubelet_up = False
        if self.state is State.WAITING and Timer.RETRY in self._timers:
            self._timers[Timer.RETRY] = now + SLOW_RETRY_S

    def _socket_deleted(self, now: float, e: m.SocketDeleted) -> None:
        self.book.deleted(e.sid)
        if e.sid == self.book.standby:  # someone cleans up (rm -rf, a purge): not at once
            self.book.close(e.sid)
            self._timers[Timer.STANDBY] = now + STANDBY_AGAIN_S
            return
        if e.sid != self.book.current:
            return
        if self.state is State.REGISTERING:
            self.redo = Why.SOCKET_DELETED
        elif self.state in _STREAMING:
            self._say(INFO, "socket-deleted", f"{self.name}: our socket was deleted; registering again")
            self.tally.lost(now)
            self._attempt(now, Why.SOCKET_DELETED)

    def _nudge(self, now: float, e: m.Nudge) -> None:
        if Timer.RETRY in self._timers and self.kubelet_up and self.kubelet_at is not None \
                and now - self.kubelet_at < LISTEN_GRACE_S:
            self._timers[Timer.RETRY] = min(self._timers[Timer.RETRY], now)

    # --- events: our sockets -------------------------------------------------------------

    def _bound(self, now: float, e: m.Bound) -> None:
        if not self.book.has(e.sid):
            return  # closed since it was asked for: moot, whatever became of it
        if e.error is not None:
            self._serve_error(now, e.error)
            return
        self.book.bound(e.sid)
        if e.sid == self.book.placing:
            self._placed_now(now, e.sid)
        elif e.sid == self.book.standby:
            self.tally.serve_error = None
            if self.state is State.WAITING and self.book.current is None:
                self._try_start(now)

    def _placed(self, now: float, e: m.Placed) -> None:
        if e.sid != self.book.placing:
            return
        if e.error is not None:
            self.book.close(e.sid)
            self._serve_error(now, e.error)
            return
        self._placed_now(now, e.sid)

    def _stream_opened(self, now: float, e: m.StreamOpened) -> None:
        ended = self.book.opened(e.sid)
        if e.sid != self.book.current:
            if ended:  # a retiring socket: its stream is ended as it opens
                self.actions.append(m.EndStreams(e.sid))
            return
        if self.state is State.VERIFYING:
            self._verified(now)

    def _list_sent(self, now: float, e: m.ListSent) -> None:
        """kubelet has the current socket's first device list: the work that could wait may go now."""
        if e.sid != self.book.current or self.book.list_sent:
            return
        self.book.mark_list_sent()
        if self.state is State.REGISTERED:
            self._after_first_list(now)

    def _stream_ended(self, now: float, e: m.StreamEnded) -> None:
        if e.sid != self.book.current:
            return  # an old socket's stream, already handed over
        self.book.streaming = False
        if self.state is State.REGISTERING:
            self.redo = Why.STREAM_ENDED
        elif self.state in _STREAMING:
            self._say(INFO, "stream-ended", f"{self.name}: kubelet ended our ListAndWatch stream; registering again")
            self.tally.lost(now)
            at = self.tally.registered_at
            if at is not None and now - at >= STABLE_AFTER_S:
                self.backoff.reset()
                self._attempt(now, Why.STREAM_ENDED)
            else:  # no hammering a kubelet that keeps ending it
                self._waiting(now, "kubelet ended our stream")
                self._retry_later(now + self.backoff.next(), Why.STREAM_ENDED)

    def _stream_refused(self, now: float, e: m.StreamRefused) -> None:
        self.tally.stream_refused(now, e.where or str(e.sid), e.limit)

    # --- events: calls to kubelet ----------------------------------------------------------

    def _register_done(self, now: float, e: m.RegisterDone) -> None:
        if self.call is None or self.call.cid != e.cid:
            return  # cancelled: a newer kubelet made it moot
        started, sid = self.call.started, self.call.sid
        self.call = None
        if e.outcome is not Outcome.REFUSED:
            self.book.reached_kubelet(sid)  # kubelet has (or had) a client for it
        if self.state is State.STOPPING:  # let go of this one too before exit
            self.book.end([sid])
            self._hand_over(now, Purpose.STOP, False)
            return
        self.book.close_retiring()  # kubelet let go of them before we registered, or it restarted
        if e.outcome is Outcome.OK:
            if self.redo is not None:
                why, self.redo = self.redo, None
                self._attempt(now, why)
                return
            self._set(State.VERIFYING, now)
            if self.book.streaming:
                self._verified(now)
            else:
                self._timers[Timer.VERIFY] = now + VERIFY_S
            return
        appeared_since = self.kubelet_at is not None and self.kubelet_at > started
        if self.redo is not None and appeared_since:
            self.redo = None
        current = self.book.current
        if e.outcome is Outcome.REFUSED and current is not None and not self.book.is_gone(current):
            # kubelet.sock is there but nobody listens: just created (try again at once, on
            # the same socket), or left by a kubelet that is gone (wait for a new one).
            since = started - self.kubelet_at if self.kubelet_at is not None else LISTEN_GRACE_S
            self._waiting(now, e.error or "kubelet is not accepting connections")
            if not self.kubelet_up or since >= LISTEN_GRACE_S:
                delay = SLOW_RETRY_S
            elif since < FAST_WINDOW_S:
                delay = FAST_RETRY_S
            else:
                delay = self.backoff.next()
            self._retry_later(now + delay, same=True)
            return
        # kubelet answered with an error, or did not answer: it may have half a client of
        # ours; that socket retires and the next try hands over from it. A kubelet that
        # appeared since deserves a try at once.
        self._waiting(now, e.error or "Register failed")
        self._retry_later(now + (0.0 if appeared_since else self.backoff.next()))

    def _listed(self, now: float, e: m.Listed) -> None:
        if self._ask is None or e.cid != self._ask.cid:
            return
        question = self._ask.question
        self._ask = None
        self.check.seen(e.listing)
        if e.listing is Listing.LISTED and e.count > 0 and question is not Question.START:
            self.book.listed_seen = True
        if question is Question.START:
            self._start_answer(now, e)
        elif question is Question.HANDOVER:
            if self.state in (State.LETTING_GO, State.STOPPING):
                self._after_handover(now, self.handover.on_listing(now, e.listing, e.count, self.healthy_units > 0,
                                                                   self.check.served))
        elif self.state is State.REGISTERED and self.check.on_answer(now, e.listing, e.count, self.healthy_units):
            self.tally.lost(now)
            self._attempt(now, Why.NOT_COUNTED)

    def _connections_counted(self, now: float, e: m.ConnectionsCounted) -> None:
        if self.state in (State.LETTING_GO, State.STOPPING):
            self._after_handover(now, self.handover.on_connections(now, e.held, self.healthy_units > 0, self.check.served))

    # --- timers ------------------------------------------------------------------------------

    def _timer_retry(self, now: float) -> None:
        if self.state is not State.WAITING or self.call is not None:
            return
        current = self.book.current
        if self._retry_same and current is not None and not self.book.is_gone(current):
            if self.kubelet_up:
                self._send_register(now, current)
            else:
                self._timers[Timer.RETRY] = now + SLOW_RETRY_S
            return
        self._attempt(now, self._retry_why)

    def _timer_standby(self, now: float) -> None:
        if self.state not in _IDLE and self.book.standby is None and self.standby_possible:
            self.book.bind(standby=True)

    def _timer_serve(self, now: float) -> None:
        if self.state is State.UNSERVED:  # binding failed: a directory made writable raises no event
            self._serve(now, m.Serve(self.kubelet_up))

    def _timer_verify(self, now: float) -> None:
        if self.state is not State.VERIFYING:
            return
        self._say(WARNING, "not-watched", f"{self.name}: kubelet accepted the registration but opened no ListAndWatch within {VERIFY_S:.0f} s; registering again")
        self.tally.lost(now)
        self._set(State.WAITING, now)
        self._attempt(now, Why.NOT_WATCHED)

    # --- moves ---------------------------------------------------------------------------------

    def _set(self, state: State, now: float) -> None:
        if state is self.state:
            return
        if (self.state, state) not in _ALLOWED:
            raise InvalidTransition(f"{self.name}: {self.state.value} -> {state.value} is not in TRANSITIONS")
        self.state, self.changed_at = state, now

    def _try_start(self, now: float) -> None:
        """Start-up: register once a socket is ready and pod-resources has answered."""
        if self.book.current is not None or self.call is not None or self.book.placing is not None:
            return
        if self._ask is not None and self._ask.question is Question.START:
            return  # its answer decides
        if self.standby_possible and not self.book.is_bound(self.book.standby):
            return  # Bound comes back here
        if not self.kubelet_up:
            self._waiting(now, "kubelet.sock does not exist yet")
            self._retry_later(now + SLOW_RETRY_S)
            return
        self._register(now, Why.FIRST)

    def _start_answer(self, now: float, e: m.Listed) -> None:
        if self.state is not State.WAITING:
            return
        if e.listing is Listing.LISTED and e.count > 0:
            # No instance of ours is registered, yet kubelet lists the resource: an earlier
            # instance's stream is still being torn down. Registering now could be undone by it.
            self._say(INFO, "earlier-instance", f"{self.name}: kubelet still lists {e.count} devices of an earlier instance; waiting for it to let go")
            self._set(State.LETTING_GO, now)
            self._why = Why.FIRST
            self.handover.begin_earlier_instance(now)
            return
        self._try_start(now)

    def _attempt(self, now: float, why: Why, wait: bool = True) -> None:
        """Register on a fresh socket. First the socket kubelet knew retires and, unless
        kubelet restarted (`wait` False), kubelet is given time to let go of it."""
        if self.call is not None or self.book.placing is not None:
            self.redo = why  # one Register in flight per resource
            return
        if wait and self.state is State.VERIFYING and not self.book.streaming:
            # kubelet has a client for this socket whose stream is still to come; retiring it
            # now would leave that stream's teardown, by name, to land on the next one.
            self.redo = why  # acted on once verified, or when the verify timer runs out
            return
        self._timers.pop(Timer.RETRY, None)
        self._timers.pop(Timer.VERIFY, None)
        self.check.stop()
        self.handover.cancel()
        if self._ask is not None and self._ask.question is not Question.START:
            self._cancel_ask()
        self._retry_same = False
        streaming = self.book.retire_current()
        if not self.kubelet_up:
            self.book.end(self.book.retiring)
            # Its creation wakes us; the slow timer is for an event that was lost.
            self._waiting(now, "kubelet.sock does not exist")
            self._retry_later(now + SLOW_RETRY_S)
            return
        if wait and self.book.known_retiring():
            self._set(State.LETTING_GO, now)
            self._why = why
            self._hand_over(now, Purpose.REGISTER, streaming)
            return
        self.book.end(self.book.retiring)
        self._register(now, why)

    def _hand_over(self, now: float, purpose: Purpose, streaming: bool) -> None:
        if self._ask is not None:  # an answer to an earlier wait would be read as this one's
            self._cancel_ask()
        self._after_handover(now, self.handover.begin(now, purpose, streaming, self.healthy_units > 0, self.check.served))

    def _after_handover(self, now: float, verdict: Verdict) -> None:
        if verdict is Verdict.WAIT:
            return
        if verdict is Verdict.ASK:
            self._ask_pod_resources(Question.HANDOVER)
        elif verdict is Verdict.KUBELET_DOWN:
            self.book.close_retiring()
            self._waiting(now, "kubelet is not accepting connections")
            self._retry_later(now + SLOW_RETRY_S)
        elif self.handover.purpose is Purpose.STOP:
            if self.call is None or not self.handover.await_call(now):  # Register's outcome starts it again
                self._finish_stop(now)
        else:
            self.book.close_retiring()
            self._register(now, self._why)

    def _finish_stop(self, now: float) -> None:
        self._close_all()
        self._set(State.STOPPED, now)

    def _register(self, now: float, why: Why) -> None:
        """Put a socket in place (the standby if one is ready, so it cannot have been
        wiped) and Register it."""
        self._why = why
        self.redo = None  # what it was about is moot: this registration answers it
        self._set(State.REGISTERING, now)
        self.tally.begin(why)
        said = f"retry: {self.tally.last_error}" if why is Why.RETRY and self.tally.last_error else why.text
        self._say(DEBUG, "registering", f"{self.name}: registering ({said})")
        if self.book.place_standby() is None:  # none ready (a standby still binding stays the standby)
            self.book.bind(standby=False)

    def _placed_now(self, now: float, sid: int) -> None:
        self.book.make_current(sid)
        self._send_register(now, sid)

    def _send_register(self, now: float, sid: int) -> None:
        self._last_cid += 1
        self.call = Call(self._last_cid, now, sid)
        self._set(State.REGISTERING, now)
        self.actions.append(m.SendRegister(self._last_cid, sid))

    def _verified(self, now: float) -> None:
        self._timers.pop(Timer.VERIFY, None)
        self._set(State.REGISTERED, now)
        took = self.tally.verified(now)
        self.check.registered()
        if took is not None:
            self._say(INFO, "reregistered", f"{self.name}: registered again with kubelet ({took * 1000:.0f} ms after the loss)")
        elif self.tally.registrations == 1:
            self._say(INFO, "registered", f"{self.name}: registered with kubelet ({self.units} units of {self.device_path})")
        else:
            self._say(INFO, "reregistered", f"{self.name}: registered again with kubelet")
        if self.book.list_sent:
            self._after_first_list(now)
        if self.redo is not None:  # a trigger that came while kubelet's stream was still to open
            why, self.redo = self.redo, None
            self._attempt(now, why)

    def _after_first_list(self, now: float) -> None:
        if self.book.standby is None and self.standby_possible:
            self._timers[Timer.STANDBY] = now
        self.check.first_list(now)

    def _waiting(self, now: float, reason: str) -> None:
        self._set(State.WAITING, now)
        level = INFO if self.tally.failing(now, reason) else DEBUG  # retries, and a restarting kubelet's gaps: DEBUG
        self._say(level, "waiting-for-kubelet", f"{self.name}: waiting for kubelet: {reason}")

    def _retry_later(self, at: float, why: Why = Why.RETRY, same: bool = False) -> None:
        self._timers[Timer.RETRY] = at
        self._retry_why, self._retry_same = why, same

    def _ask_pod_resources(self, question: Question) -> None:
        if self._ask is not None:
            self._cancel_ask()
        self._last_cid += 1
        self._ask = Asking(self._last_cid, question)
        self.actions.append(m.AskPodResources(self._last_cid))

    def _cancel_ask(self) -> None:
        self.actions.append(m.CancelCall(self._ask.cid))
        self._ask = None

    def _close_all(self) -> None:
        if self.call is not None:
            self.actions.append(m.CancelCall(self.call.cid))
            self.call = None
        if self._ask is not None:
            self._cancel_ask()
        self.book.close_all()
        self.redo = None
        self._timers = {t: at for t, at in self._timers.items() if t is Timer.SERVE}
        self.check.stop()
        self.handover.cancel()
        self.tally.deadline = None

    def _serve_error(self, now: float, error: str) -> None:
        self._close_all()
        self._set(State.UNSERVED, now)
        text = f"{self.name}: cannot serve {error}"
        if self.tally.serve_error is None:  # retried on every wake-up; said once
            self._say(ERROR, "serve-failed", text)
        self.tally.serve_error = text
        self._timers[Timer.SERVE] = now + self.backoff.next()

    def _say(self, level: int, kind: str, text: str) -> None:
        self.actions.append(m.Say(level, kind, text))


_HANDLERS = {
    m.Serve: Registration._serve, m.Unserve: Registration._unserve, m.Publish: Registration._publish,
    m.Reconfigure: Registration._reconfigure, m.Stop: Registration._stop, m.CloseAll: Registration._close,
    m.KubeletCreated: Registration._kubelet_created, m.KubeletGone: Registration._kubelet_gone,
    m.SocketDeleted: Registration._socket_deleted, m.Nudge: Registration._nudge,
    m.Bound: Registration._bound, m.Placed: Registration._placed,
    m.StreamOpened: Registration._stream_opened, m.ListSent: Registration._list_sent,
    m.StreamEnded: Registration._stream_ended, m.StreamRefused: Registration._stream_refused,
    m.RegisterDone: Registration._register_done, m.Listed: Registration._listed,
    m.ConnectionsCounted: Registration._connections_counted,
}
_TIMERS = ((Timer.RETRY, Registration._timer_retry), (Timer.STANDBY, Registration._timer_standby),
           (Timer.SERVE, Registration._timer_serve), (Timer.VERIFY, Registration._timer_verify))
