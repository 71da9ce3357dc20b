"""One resource's registration with kubelet: the machine that composes the parts.

`Registration.handle(now, event)` takes a typed event (`messages.py`) with the
time (seconds on a monotonic clock); `take()` gives the actions to perform;
`get_timer()` is when it wants `handle_timer(now)`. Nothing here reads a file,
a socket or a clock, so one seed of the simulation replays one run exactly.

It is composed of parts, each with a job and a state of its own: the
`SocketBook` (which sockets exist and what each is for), `Attempts` (the
Register in flight and its retries), the `LetGo` (the wait for kubelet to let
go of an old socket), `Questions` (pod-resources calls), the `CountCheck` (does
kubelet count our devices?) and the `Tally` (what `STATUS=` and the metrics
tell); `Moves` (moves.py) holds its `State` and makes every move between them,
each one listed in `TRANSITIONS`. What is here is what each event means.

The rules, each from a way kubelet really behaves (docs/design.md, "Registration"):
every Register names a socket of its own, the next one already serving in the
standby directory; one Register in flight, triggers that come meanwhile acted on
when it ends; while the same kubelet stays up, a new registration first hands
over; a Register refused because kubelet.sock is not listening yet is sent again
at once on the same socket; a Register that returned OK is believed only once
kubelet opens ListAndWatch and, where it can be asked, counts our devices.
"""

import logging
from typing import Callable, Dict, List, Optional

from atedevd.registration import messages as m
from atedevd.registration.attempts import SLOW_RETRY_S, Retry
from atedevd.registration.letgo import Purpose
from atedevd.registration.messages import Listing, Outcome, State, Timer, Why
from atedevd.registration.moves import (IDLE, LETTING, SERVED, STREAMING, TRANSITIONS, VERIFY_S, YIELD_STATES,
                                        InvalidTransition, Moves)
from atedevd.registration.questions import Question
from atedevd.registration.report import Report

WARNING, INFO = logging.WARNING, logging.INFO

STABLE_AFTER_S = 2.0  # a stream end after this long is answered at once; earlier ones back off
STANDBY_AGAIN_S = 1.0  # the standby socket was deleted: bind the next one this much later

__all__ = ["InvalidTransition", "Registration", "TRANSITIONS"]


class Registration:
    """One resource's registration with kubelet: what each event and timer means, as decisions only."""

    def __init__(self, name: str, units: int, healthy_units: Optional[int] = None, standby_possible: bool = True,
                 device_path: str = "the device", connections_visible: bool = True):
        self.name = name
        self.moves = Moves(name, units, units if healthy_units is None else healthy_units, standby_possible,
                           device_path, connections_visible)
        mv = self.moves  # its parts, by their names
        self.actions, self.book, self.tally, self.attempts = mv.actions, mv.book, mv.tally, mv.attempts
        self.letgo, self.questions, self.check = mv.letgo, mv.questions, mv.check

    @property
    def state(self) -> State:
        return self.moves.state

    @property
    def changed_at(self) -> float:
        return self.moves.changed_at

    @property
    def units(self) -> int:
        return self.moves.units

    @property
    def healthy_units(self) -> int:
        return self.moves.healthy_units

    # --- for the performer ---------------------------------------------------------------

    def handle(self, now: float, event: m.Event) -> None:
        self.moves.cause = type(event)
        _HANDLERS[type(event)](self, now, event)

    def take(self) -> list:
        actions = list(self.actions)
        self.actions.clear()
        return actions

    def get_timer(self) -> Optional[float]:
        """When `handle_timer` is due next (the loop asks after every wake-up: no table walk)."""
        a = self.attempts
        times = [t for t in (a.deadline, a.verify_by, self.book.deadline, self.moves.serve_at, self.letgo.deadline,
                             self.check.deadline, self.questions.deadline, self.tally.deadline) if t is not None]
        return min(times) if times else None

    def timer_at(self, timer: Timer) -> Optional[float]:
        return _DEADLINE[timer](self)

    @property
    def idle(self) -> bool:
        """No timer is set but the periodic count check: no retry, wait, question or warning."""
        return all(deadline(self) is None for timer, deadline, _ in _TIMERS if timer is not Timer.CHECK)

    def handle_timer(self, now: float) -> None:
        """Whatever is due, each timer looked at in turn (one may set or stop another)."""
        for timer, deadline, fire in _TIMERS:
            at = deadline(self)
            if at is not None and at <= now:
                self.moves.cause = timer
                fire(self, now)

    @property
    def stopped(self) -> bool:
        return self.moves.state in (State.STOPPED, State.UNSERVED)

    # --- queries -------------------------------------------------------------------------

    def held_sockets(self) -> List[int]:
        """The sockets kubelet may hold: the current one and those retiring."""
        return self.book.held()

    @property
    def on_hold(self) -> bool:
        """Served, but registering only once released (an upgrade's successor, or a predecessor
        that handed over and was unserved meanwhile)."""
        return self.moves.on_hold

    @property
    def standby_ready(self) -> bool:
        """The next registration's socket is serving (or none is possible)."""
        return not self.moves.standby_possible or self.book.is_bound(self.book.standby)

    def shown(self) -> tuple:
        """What its report shows: it changed when this did (cheaper to compare than the report)."""
        mv = self.moves
        return mv.state, mv.units, mv.healthy_units, self.check.kubelet_count, self.tally.shown()

    def report(self, device_path: str, pattern: bool, advertised: bool, registers_sent: int,
               allocate_calls: int, allocate_failures: int) -> Report:
        """This registration as `STATUS=` and the metrics show it, with its resource's figures."""
        served = self.state not in (State.UNSERVED, State.STOPPED)
        return self.tally.report(self.state, self.changed_at, device_path, pattern, advertised,
                                 self.units if served else 0, self.healthy_units if served else 0,
                                 self.check.kubelet_count, registers_sent, allocate_calls, allocate_failures)

    # --- events: the node and the daemon -------------------------------------------------

    def _serve(self, now: float, e: m.Serve) -> None:
        if self.moves.state is not State.UNSERVED:
            return
        self.moves.kubelet_seen(e.kubelet_up, e.kubelet_at)
        self.moves.move(State.WAITING, now)
        if e.on_hold:  # a successor: its predecessor says when (no earlier instance to wait for)
            self.moves.hold()
        elif e.kubelet_up:
            self.questions.ask(Question.START)  # a previous instance's teardown may be pending
        if self.moves.standby_possible:
            self.book.bind(standby=True)
        self.moves.try_start(now)

    def _unserve(self, now: float, e: m.Unserve) -> None:
        if self.moves.state in IDLE:
            return
        if self.moves.state in STREAMING:
            self.tally.lost(now, WARNING, "registration-lost", f"lost registration: {e.why}")
        handed = self.moves.state in YIELD_STATES
        self.moves.close_all()
        self.moves.move(State.UNSERVED, now)
        if handed:  # its successor registers: served again, it waits to be told to take back
            self.moves.hold(Why.TAKEN_BACK)

    def _publish(self, now: float, e: m.Publish) -> None:
        self.moves.advertise(e.units, e.healthy_units)
        if self.moves.state is State.REGISTERED:  # kubelet's count follows: look again soon, afresh
            if self.questions.asked is Question.CHECK:
                self.questions.cancel()  # its answer may predate the new list: no verdict on it
            if self.questions.asked is Question.NONE:
                self.check.soon(now)

    def _reconfigure(self, now: float, e: m.Reconfigure) -> None:
        self.moves.advertise(e.units, e.healthy_units)
        self.book.close(self.book.standby)  # it serves the old table
        if self.moves.state in IDLE or self.moves.state in YIELD_STATES:
            return
        if self.moves.state in STREAMING:
            self.tally.lost(now)
        self.moves.attempt(now, Why.CONFIG_CHANGED)

    def _stop(self, now: float, e: m.Stop) -> None:
        if self.moves.state in (State.STOPPING, State.STOPPED):
            return
        if self.moves.state is State.UNSERVED:
            self.moves.move(State.STOPPED, now)
            return
        # A Register in flight is not cancelled: kubelet goes on with it whatever we do, so
        # its outcome is waited for (bounded) and its socket let go of like the others.
        streaming = self.moves.wind_down(now, State.STOPPING)
        waits_for = self.attempts.call is not None or (self.book.known_retiring() and not e.replaced)
        if not self.moves.kubelet_up or not waits_for:
            self.moves.finish_stop(now)
            return
        self.moves.begin_let_go(now, Purpose.STOP, streaming)

    def _release(self, now: float, e: m.Release) -> None:
        if self.moves.release():
            if self.moves.state is State.WAITING:
                self.moves.try_start(now)

    def _yield(self, now: float, e: m.Yield) -> None:
        """Like a stop, but the standby stays: if the successor fails, we register again on it."""
        if self.moves.state is State.UNSERVED:  # served again later, it waits to be told to take back
            self.moves.hold(Why.TAKEN_BACK)
        if self.moves.state not in SERVED:
            return
        streaming = self.moves.wind_down(now, State.YIELDING)
        if not self.moves.kubelet_up or not (self.book.known_retiring() or self.attempts.call is not None):
            self.moves.yielded(now)
            return
        self.moves.begin_let_go(now, Purpose.YIELD, streaming)

    def _register_again(self, now: float, e: m.RegisterAgain) -> None:
        if self.moves.state in SERVED and self.moves.state not in YIELD_STATES:
            self.moves.attempt(now, Why.TAKEN_BACK)

    def _take_back(self, now: float, e: m.TakeBack) -> None:
        held = self.moves.release()  # (unserved while handing over, and held since)
        if self.moves.state in YIELD_STATES or (held and self.moves.state is State.WAITING):
            self.moves.take_back(now)

    def _close(self, now: float, e: m.CloseAll) -> None:
        self.moves.closed(now)

    # --- events: kubelet's directory ---------------------------------------------------

    def _kubelet_created(self, now: float, e: m.KubeletCreated) -> None:
        """A starting kubelet deletes every socket in the directory first, so if none of
        ours kubelet may hold is still there, kubelet restarted: the new one has no client
        of ours that a late teardown could confuse, so no waiting. If one is still there,
        the same kubelet re-created its socket and still holds our client."""
        self.moves.kubelet_seen(True, e.at)
        if self.moves.state in IDLE:
            return
        restarted = not e.ours_present
        if self.moves.state in YIELD_STATES:  # the successor registers with the new kubelet
            if restarted and self.moves.state is State.YIELDING:
                self.attempts.cancel()  # a Register in flight went to the kubelet that is gone
                self.moves.yielded(now)  # the kubelet that held our streams is gone
            return
        if self.attempts.reached(e.at) and not restarted:
            return  # the Register in flight dialled this kubelet (or fails at once): its outcome decides
        # One hanging on a kubelet that is gone, or naming a socket that kubelet's wipe removed.
        self.attempts.cancel()
        self.questions.cancel(unless=Question.CHECK)
        if self.moves.state in STREAMING:
            how = "kubelet restarted" if restarted else "kubelet serves a new kubelet.sock"
            self.tally.lost(now, INFO, "kubelet-restarted", f"{how}; registering again")
        self.attempts.forget_redo()
        self.attempts.reset_backoff()
        if restarted:
            for sid in self.book.held():
                self.book.deleted(sid)
        self.moves.attempt(now, Why.KUBELET_RESTARTED if restarted else Why.NEW_KUBELET_SOCKET, wait=not restarted)

    def _kubelet_gone(self, now: float, e: m.KubeletGone) -> None:
        self.moves.kubelet_seen(False)
        if self.moves.state is State.WAITING:
            self.attempts.slow(now)

    def _socket_deleted(self, now: float, e: m.SocketDeleted) -> None:
        self.book.deleted(e.sid)
        if e.sid == self.book.standby:  # someone cleans up (rm -rf, a purge): not at once
            self.book.close(e.sid)
            self.book.standby_at(now + STANDBY_AGAIN_S)
            return
        if e.sid != self.book.current:
            return
        if self.moves.state is State.REGISTERING:
            self.attempts.defer(Why.SOCKET_DELETED)
        elif self.moves.state in STREAMING:
            self.tally.lost(now, INFO, "socket-deleted", "our socket was deleted; registering again")
            self.moves.attempt(now, Why.SOCKET_DELETED)

    def _nudge(self, now: float, e: m.Nudge) -> None:
        self.attempts.nudge(now, self.moves.kubelet_up, self.moves.kubelet_at)

    # --- events: our sockets -------------------------------------------------------------

    def _bound(self, now: float, e: m.Bound) -> None:
        if not self.book.has(e.sid):
            return  # closed since it was asked for: moot, whatever became of it
        if e.error is not None:
            if e.sid == self.book.standby and self.book.current is not None:
                # only the spare for the next registration: the registered socket serves on
                self.book.close(e.sid)
                self.book.standby_at(now + STANDBY_AGAIN_S)
                self.tally.standby_failed(e.error)
                return
            self.moves.serve_error(now, e.error)
            return
        self.book.bound(e.sid)
        if e.sid == self.book.placing:
            self.moves.placed(now, e.sid)
        elif e.sid == self.book.standby:
            self.tally.serving()
            if self.moves.state is State.WAITING and self.book.current is None:
                self.moves.try_start(now)

    def _placed(self, now: float, e: m.Placed) -> None:
        if e.sid != self.book.placing:
            return
        if e.error is not None:
            self.book.close(e.sid)
            self.moves.serve_error(now, e.error)
            return
        self.moves.placed(now, e.sid)

    def _stream_opened(self, now: float, e: m.StreamOpened) -> None:
        ended = self.book.opened(e.sid)
        if e.sid != self.book.current:
            if ended:  # a retiring socket: its stream is ended as it opens
                self.actions.append(m.EndStreams(e.sid))
            return
        if self.moves.state is State.VERIFYING:
            self.moves.verified(now)

    def _list_sent(self, now: float, e: m.ListSent) -> None:
        """kubelet has the current socket's first device list: the work that could wait may go now."""
        if e.sid != self.book.current or self.book.list_sent:
            return
        self.book.mark_list_sent()
        if self.moves.state is State.REGISTERED:
            self.moves.after_first_list(now)

    def _stream_ended(self, now: float, e: m.StreamEnded) -> None:
        if e.sid != self.book.current:
            return  # an old socket's stream, already handed over
        self.book.stream_ended()
        if self.moves.state is State.REGISTERING:
            self.attempts.defer(Why.STREAM_ENDED)
        elif self.moves.state in STREAMING:
            self.tally.lost(now, INFO, "stream-ended", "kubelet ended our ListAndWatch stream; registering again")
            at = self.tally.registered_at
            if at is not None and now - at >= STABLE_AFTER_S:
                self.attempts.reset_backoff()
                self.moves.attempt(now, Why.STREAM_ENDED)
            else:  # no hammering a kubelet that keeps ending it
                self.moves.waiting(now, "kubelet ended our stream")
                self.attempts.later(now + self.attempts.next_delay(), why=Why.STREAM_ENDED)

    def _stream_refused(self, now: float, e: m.StreamRefused) -> None:
        self.tally.stream_refused(now, e.where or str(e.sid), e.limit)

    # --- events: calls to kubelet ----------------------------------------------------------

    def _register_done(self, now: float, e: m.RegisterDone) -> None:
        call = self.attempts.ended(e.cid)
        if call is None:
            return  # cancelled: a newer kubelet made it moot
        if e.outcome is not Outcome.REFUSED:
            self.book.reached_kubelet(call.sid)  # kubelet has (or had) a client for it
        if self.moves.state in (State.STOPPING, State.YIELDING):  # let go of this one too
            self.book.end([call.sid])
            self.moves.begin_let_go(now, Purpose.STOP if self.moves.state is State.STOPPING else Purpose.YIELD, False)
            return
        self.book.close_retiring()  # kubelet let go of them before we registered, or it restarted
        if e.outcome is Outcome.OK:
            redo = self.attempts.take_redo()
            if redo is not None:
                self.moves.attempt(now, redo)
                return
            self.moves.move(State.VERIFYING, now)
            if self.book.streaming:
                self.moves.verified(now)
            else:
                self.attempts.expect_stream(now + VERIFY_S)
            return
        current = self.book.current
        refused = e.outcome is Outcome.REFUSED
        self.moves.waiting(now, e.error or ("kubelet is not accepting connections" if refused else "Register failed"))
        away = self.attempts.failed(now, call, e.outcome, current is not None and not self.book.is_gone(current),
                                    self.moves.kubelet_at, self.moves.kubelet_up)
        if away and self.book.standby is None and self.moves.standby_possible:
            # kubelet is gone (the socket a reboot left): the next one wipes the socket we placed;
            # a standby is renamed in the moment it comes, where binding one anew takes ms
            self.book.bind(standby=True)

    def _listed(self, now: float, e: m.Listed) -> None:
        question = self.questions.answered(now, e)
        if question is not Question.START and e.listing is Listing.LISTED and e.devices > 0:
            self.book.saw_listing()
        if question is Question.START:
            self.moves.start_answer(now, e)
        elif question is Question.LET_GO:
            if self.moves.state in LETTING:
                self.moves.after_let_go(now, self.letgo.on_listing(now, e.listing, e.devices, self.moves.healthy_units > 0,
                                                                   self.questions.served))
        elif question is Question.CHECK and self.moves.state is State.REGISTERED \
                and self.check.on_answer(now, e.listing, e.devices, self.moves.healthy_units):
            self.tally.lost(now)
            self.moves.attempt(now, Why.NOT_COUNTED)

    def _connections_counted(self, now: float, e: m.ConnectionsCounted) -> None:
        if self.moves.state in LETTING:
            self.moves.after_let_go(now, self.letgo.on_connections(
                now, e.held, self.moves.healthy_units > 0, self.questions.served, e.watched))

    def _hung_up(self, now: float, e: m.HungUp) -> None:
        if self.moves.state in LETTING:
            self.letgo.on_hangup()

    # --- timers ------------------------------------------------------------------------------

    def _timer_retry(self, now: float) -> None:
        retry = self.attempts.fire()
        if self.moves.state is not State.WAITING or self.attempts.call is not None:
            return
        current = self.book.current
        if retry is Retry.SAME and current is not None and not self.book.is_gone(current):
            if self.moves.kubelet_up:
                self.moves.send_register(now, current)
            else:
                self.attempts.later(now + SLOW_RETRY_S, Retry.SAME)
            return
        self.moves.attempt(now, self.attempts.why)

    def _timer_serve(self, now: float) -> None:
        self.moves.cancel_serve()
        if self.moves.state is State.UNSERVED:  # binding failed: a directory made writable raises no event
            self._serve(now, m.Serve(self.moves.kubelet_up))

    def _timer_verify(self, now: float) -> None:
        """kubelet accepted Register but opened no stream: register again."""
        self.attempts.stream_seen()
        if self.moves.state is State.VERIFYING:
            self.tally.lost(now, WARNING, "not-watched", f"kubelet accepted the registration but opened no ListAndWatch within {VERIFY_S:.0f} s; registering again")
            self.moves.move(State.WAITING, now)
            self.moves.attempt(now, Why.NOT_WATCHED)

    def _timer_let_go(self, now: float) -> None:
        if self.moves.state in LETTING:
            self.moves.after_let_go(now, self.letgo.on_timer(now, self.moves.healthy_units > 0, self.questions.served))
        else:
            self.letgo.cancel()

    def _timer_check(self, now: float) -> None:
        self.check.stop()
        if self.moves.state is State.REGISTERED and self.questions.asked is Question.NONE:
            self.questions.ask(Question.CHECK)


# Every named timer: when it is due, and what it does then (`handle_timer`, in this order).
_TIMERS = (
    (Timer.RETRY, lambda r: r.attempts.deadline, Registration._timer_retry),
    (Timer.STANDBY, lambda r: r.book.deadline,
     lambda r, now: r.book.on_timer(r.moves.state not in IDLE and r.moves.standby_possible)),
    (Timer.SERVE, lambda r: r.moves.serve_at, Registration._timer_serve),
    (Timer.VERIFY, lambda r: r.attempts.verify_by, Registration._timer_verify),
    (Timer.LET_GO, lambda r: r.letgo.deadline, Registration._timer_let_go),
    (Timer.CHECK, lambda r: r.check.deadline, Registration._timer_check),
    (Timer.ASK, lambda r: r.questions.deadline, lambda r, now: r.questions.on_timer()),
    (Timer.WARN, lambda r: r.tally.deadline, lambda r, now: r.tally.on_timer(now, r.moves.state is State.REGISTERED)),
)
_DEADLINE = {timer: deadline for timer, deadline, _ in _TIMERS}
_HANDLERS: Dict[type, Callable[..., None]] = {
    m.Serve: Registration._serve, m.Unserve: Registration._unserve, m.Publish: Registration._publish,
    m.Reconfigure: Registration._reconfigure, m.Stop: Registration._stop, m.CloseAll: Registration._close,
    m.Release: Registration._release, m.Yield: Registration._yield, m.TakeBack: Registration._take_back,
    m.RegisterAgain: Registration._register_again,
    m.KubeletCreated: Registration._kubelet_created, m.KubeletGone: Registration._kubelet_gone,
    m.SocketDeleted: Registration._socket_deleted, m.Nudge: Registration._nudge,
    m.Bound: Registration._bound, m.Placed: Registration._placed,
    m.StreamOpened: Registration._stream_opened, m.ListSent: Registration._list_sent,
    m.StreamEnded: Registration._stream_ended, m.StreamRefused: Registration._stream_refused,
    m.RegisterDone: Registration._register_done, m.Listed: Registration._listed,
    m.ConnectionsCounted: Registration._connections_counted, m.HungUp: Registration._hung_up,
}
