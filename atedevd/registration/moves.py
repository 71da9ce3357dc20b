"""How a registration moves between its states: every change of `State`, by the table.

A registration begun (register), a Register placed and sent, kubelet's stream seen
(verified), a wait (waiting), a new registration that first retires the socket
kubelet knew and waits until kubelet let go of it (attempt, begin_let_go,
after_let_go), and the closing of it all.
Each move is checked against `TRANSITIONS`; `Moves` also holds what every move
needs: what is advertised, what is known of kubelet, and the parts
(`SocketBook`, `Attempts`, `LetGo`, `Questions`, `CountCheck`, `Tally`).
`Registration` (machine.py) decides, from each event and timer, which move to make.
"""

import itertools
from typing import Optional, Set, Tuple, Type, Union

from atedevd.registration import messages as m
from atedevd.registration.attempts import SLOW_RETRY_S, Attempts
from atedevd.registration.count_check import CountCheck
from atedevd.registration.letgo import LetGo, Purpose, Verdict
from atedevd.registration.messages import Listing, State, Timer, Why
from atedevd.registration.questions import Question, Questions
from atedevd.registration.report import Tally
from atedevd.registration.socket_book import SocketBook

VERIFY_S = 5.0  # Register returned OK: kubelet's ListAndWatch must open by then

# The states in which sockets are served and a registration is under way; kubelet streams from
# us; nothing is registered nor can be.
SERVED = (State.WAITING, State.LETTING_GO, State.REGISTERING, State.VERIFYING, State.REGISTERED)
STREAMING = (State.VERIFYING, State.REGISTERED)
IDLE = (State.UNSERVED, State.STOPPING, State.STOPPED)
YIELD_STATES = (State.YIELDING, State.YIELDED)  # a predecessor's, for its successor
# The states in which the LetGo waits for kubelet to let go.
LETTING = (State.LETTING_GO, State.STOPPING, State.YIELDING)

# Every move the machine makes, and on what. `Moves.move` refuses any other.
TRANSITIONS = (
    (State.UNSERVED, State.WAITING, "the device is advertised and the plugin directory exists"),
    (State.WAITING, State.WAITING, "still waiting, for a new reason: kubelet.sock is not there, or not listened on"),
    (State.WAITING, State.REGISTERING, "a socket is ready and kubelet serves, or a retry is due"),
    (State.WAITING, State.LETTING_GO, "at start kubelet lists an earlier instance; a retry hands over"),
    (State.LETTING_GO, State.REGISTERING, "kubelet let go of our old socket"),
    (State.LETTING_GO, State.LETTING_GO, "a new trigger while kubelet lets go (a new kubelet.sock, a take-back's second registration): the wait begins anew"),
    (State.LETTING_GO, State.WAITING, "pod-resources refused: kubelet is down"),
    (State.REGISTERING, State.REGISTERING, "the socket is in place: Register is sent; or kubelet restarted meanwhile: anew"),
    (State.REGISTERING, State.VERIFYING, "Register returned OK"),
    (State.REGISTERING, State.WAITING, "Register refused or failed"),
    (State.REGISTERING, State.LETTING_GO, "Register returned OK, but a trigger came meanwhile"),
    (State.VERIFYING, State.REGISTERED, "kubelet opened ListAndWatch on the new socket"),
    (State.VERIFYING, State.WAITING, "no stream within VERIFY_S; the stream ended at once"),
    (State.VERIFYING, State.REGISTERING, "kubelet restarted"),
    (State.REGISTERED, State.LETTING_GO, "the stream ended, the socket was deleted, the configuration changed, not counted"),
    (State.REGISTERED, State.REGISTERING, "kubelet restarted: nothing to hand over"),
    (State.REGISTERED, State.WAITING, "a young stream ended (back off), or kubelet is down"),
    *((s, State.YIELDING, "an upgrade: the successor is ready, our streams end") for s in SERVED),
    (State.YIELDING, State.YIELDED, "kubelet let go of our streams: the successor registers"),
    *((s, State.WAITING, "the successor failed: we register again") for s in YIELD_STATES),
    *((s, State.UNSERVED, "the plugin directory is gone, or a socket cannot be served") for s in (*SERVED, *YIELD_STATES)),
    *((s, State.STOPPING, "SIGTERM, or the successor is main") for s in (*SERVED, *YIELD_STATES)),
    (State.UNSERVED, State.STOPPED, "SIGTERM while nothing is served"),
    (State.STOPPING, State.STOPPED, "kubelet let go of our streams (or the wait's limit passed)"),
)
_ALLOWED = {(a, b) for a, b, _ in TRANSITIONS}
# And one move from any state, outside the table: CloseAll (the resource is no longer
# configured, or the process exits) stops every socket of it, whatever it was doing.
CLOSED = "closed: no longer configured, or the process exits"
Cause = Union[Type[m.Event], Timer]  # what made a move: an event's type, or a timer


class InvalidTransition(Exception):
    pass


class Moves:
    """One registration's state, what its moves need, and the moves."""

    def __init__(self, name: str, units: int, healthy_units: int, standby_possible: bool, device_path: str,
                 connections_visible: bool) -> None:
        self.name = name
        self.units = units  # advertised
        self.healthy_units = healthy_units
        self.device_path = device_path  # for what we say
        self.standby_possible = standby_possible  # False where the standby path would be too long
        self.state = State.UNSERVED
        self.changed_at = 0.0  # when `state` last changed
        self.cause: Optional[Cause] = None  # the event or timer being handled
        self.taken: Set[Tuple[State, State, Optional[Cause]]] = set()  # every move made, and on what
        self.kubelet_up = False
        self.kubelet_at: Optional[float] = None  # when the newest kubelet.sock appeared
        self.why = Why.FIRST  # why the registration under way was begun
        self.on_hold = False  # a successor's: serve, but register only once released
        self.first_why = Why.FIRST  # why the first registration is made
        self.serve_at: Optional[float] = None  # serving failed: try again then
        self.actions: list = []
        cids = itertools.count(1)  # Register and pod-resources calls share one count
        self.book = SocketBook(self.actions)
        self.tally = Tally(name, self.actions)
        self.attempts = Attempts(self.actions, cids, self.book, self.tally)
        self.letgo = LetGo(name, self.book, self.actions, connections_visible)
        self.questions = Questions(self.actions, cids)
        self.check = CountCheck(name, self.actions)

    # --- what the machine learns ----------------------------------------------------------

    def kubelet_seen(self, up: bool, at: Optional[float] = None) -> None:
        """kubelet.sock is there (made at `at`, when known) or not."""
        self.kubelet_up = up
        if at is not None:
            self.kubelet_at = at

    def hold(self, why: Why = Why.UPGRADE) -> None:
        """Serve, but register only once released, for `why`: a successor's until its
        predecessor says GO (an upgrade's); a predecessor's that has handed over until it is
        told to take back."""
        self.on_hold, self.first_why = True, why

    def release(self) -> bool:
        """Released from hold; whether it was on hold."""
        was, self.on_hold = self.on_hold, False
        return was

    def advertise(self, units: int, healthy_units: int) -> None:
        self.units, self.healthy_units = units, healthy_units

    def cancel_serve(self) -> None:
        self.serve_at = None

    # --- moves ---------------------------------------------------------------------------

    def move(self, state: State, now: float) -> None:
        """To `state`, if TRANSITIONS has the move (a move to the same state too)."""
        if (self.state, state) not in _ALLOWED:
            raise InvalidTransition(f"{self.name}: {self.state.value} -> {state.value} is not in TRANSITIONS")
        self.taken.add((self.state, state, self.cause))
        if state is not self.state:
            self.state, self.changed_at = state, now

    def try_start(self, now: float) -> None:
        """Start-up: register once a socket is ready and pod-resources has answered."""
        if self.book.current is not None or self.attempts.call is not None or self.book.placing is not None:
            return
        if self.questions.asked is Question.START:
            return  # its answer decides
        if self.standby_possible and not self.book.is_bound(self.book.standby):
            return  # Bound comes back here
        if self.on_hold:
            return  # Release comes back here
        if not self.kubelet_up:
            self.waiting(now, "kubelet.sock does not exist yet")
            self.attempts.later(now + SLOW_RETRY_S)
            return
        self.register(now, self.first_why)

    def start_answer(self, now: float, e: m.Listed) -> None:
        if self.state is not State.WAITING:
            return
        if e.listing is Listing.LISTED and e.devices > 0:  # an earlier instance's teardown is pending
            self.move(State.LETTING_GO, now)
            self.why = self.first_why
            self.letgo.begin_earlier_instance(now, e.devices)
            return
        self.try_start(now)

    def attempt(self, now: float, why: Why, wait: bool = True) -> None:
        """Register on a fresh socket. First the socket kubelet knew retires and, unless
        kubelet restarted (`wait` False), kubelet is given time to let go of it."""
        if self.on_hold:
            return  # an upgrade's successor, or a predecessor that handed over: `Release` or `TakeBack` begins it
        if self.attempts.call is not None or self.book.placing is not None:
            self.attempts.defer(why)  # one Register in flight per resource
            return
        if wait and self.state is State.VERIFYING and not self.book.streaming:
            # kubelet has a client for this socket whose stream is still to come; retiring it
            # now would leave that stream's teardown, by name, to land on the next one.
            self.attempts.defer(why)  # acted on once verified, or when the verify timer runs out
            return
        self.stop_timers()
        self.questions.cancel(unless=Question.START)
        streaming = self.book.retire_current()
        if not self.kubelet_up:
            self.book.end(self.book.retiring)
            # Its creation wakes us; the slow timer is for an event that was lost.
            self.waiting(now, "kubelet.sock does not exist")
            self.attempts.later(now + SLOW_RETRY_S)
            return
        if wait and self.book.known_retiring():
            self.move(State.LETTING_GO, now)
            self.why = why
            self.begin_let_go(now, Purpose.REGISTER, streaming)
            return
        self.book.end(self.book.retiring)
        self.register(now, why)

    def begin_let_go(self, now: float, purpose: Purpose, streaming: bool) -> None:
        self.questions.cancel()  # an answer to an earlier wait would be read as this one's
        self.after_let_go(now, self.letgo.begin(now, purpose, streaming, self.healthy_units > 0, self.questions.served))

    def after_let_go(self, now: float, verdict: Verdict) -> None:
        if verdict is Verdict.WAIT:
            return
        if verdict is Verdict.ASK:
            self.questions.ask(Question.LET_GO)
        elif verdict is Verdict.KUBELET_DOWN:
            self.book.close_retiring()
            self.waiting(now, "kubelet is not accepting connections")
            self.attempts.later(now + SLOW_RETRY_S)
        elif self.letgo.purpose is not Purpose.REGISTER:
            if self.attempts.call is None or not self.letgo.await_call(now):  # Register's outcome starts it again
                if self.letgo.purpose is Purpose.STOP:
                    self.finish_stop(now)
                else:
                    self.yielded(now)
        else:
            self.book.close_retiring()
            self.register(now, self.why)

    def yielded(self, now: float) -> None:
        """kubelet let go of our streams: our old sockets go; the standby stays, for a take-back."""
        self.letgo.cancel()
        self.book.close_retiring()
        self.move(State.YIELDED, now)

    def wind_down(self, now: float, state: State) -> bool:
        """A stop (STOPPING) or a hand-off (YIELDING): nothing more is begun and the current
        socket retires; whether kubelet was streaming from it. A hand-off keeps the standby
        and its timers: if the successor fails, we register again on it."""
        self.questions.cancel()
        self.book.close(self.book.placing)
        if state is State.STOPPING:
            self.book.close(self.book.standby)
        streaming = self.book.retire_current()
        self.stop_timers()
        if state is State.STOPPING:
            self.cancel_serve()
            self.book.cancel_timer()
            self.tally.cancel_timer()
        self.move(state, now)
        return streaming

    def take_back(self, now: float) -> None:
        """The successor failed: as a start after an earlier instance. It may have registered
        before it failed, and kubelet (<= 1.36) would tear down by name whatever we register
        before it let go of the successor's endpoint; what kubelet lists says when."""
        self.letgo.cancel()
        self.questions.cancel()
        self.book.close_retiring()  # (handing off, a Register of ours in flight: kubelet's let go shows below)
        self.move(State.WAITING, now)
        self.tally.lost(now)
        self.first_why = Why.TAKEN_BACK
        if self.kubelet_up:
            self.questions.ask(Question.START)
        self.try_start(now)

    def closed(self, now: float) -> None:
        """CloseAll, from any state (CLOSED): nothing served, nothing in flight."""
        self.close_all()
        self.taken.add((self.state, State.STOPPED, self.cause))
        self.state, self.changed_at = State.STOPPED, now

    def finish_stop(self, now: float) -> None:
        self.close_all()
        self.move(State.STOPPED, now)

    def register(self, now: float, why: Why) -> None:
        self.why = why
        self.move(State.REGISTERING, now)
        self.attempts.begin(why)

    def send_register(self, now: float, sid: int) -> None:
        self.attempts.send(now, sid)
        self.move(State.REGISTERING, now)

    def verified(self, now: float) -> None:
        self.attempts.stream_seen()
        self.move(State.REGISTERED, now)
        self.tally.verified(now, self.units, self.device_path)
        self.check.registered()
        if self.book.list_sent:
            self.after_first_list(now)
        redo = self.attempts.take_redo()  # a trigger that came while kubelet's stream was still to open
        if redo is not None:
            self.attempt(now, redo)

    def after_first_list(self, now: float) -> None:
        if self.book.standby is None and self.standby_possible:
            self.book.standby_at(now)
        self.check.first_list(now)

    def waiting(self, now: float, reason: str) -> None:
        self.move(State.WAITING, now)
        self.tally.failing(now, reason)

    def stop_timers(self) -> None:
        """Every timer stops but serving's and the warning's: what a new registration would set anew."""
        self.attempts.clear()
        self.letgo.cancel()
        self.check.stop()

    def close_all(self) -> None:
        """Nothing served, nothing in flight, nothing due (but serving again, when it failed)."""
        self.attempts.stop()
        self.questions.cancel()
        self.book.close_all()
        self.letgo.cancel()
        self.check.stop()
        self.book.cancel_timer()
        self.tally.cancel_timer()

    def placed(self, now: float, sid: int) -> None:
        self.attempts.placed(now, sid)
        self.move(State.REGISTERING, now)

    def serve_error(self, now: float, error: str) -> None:
        self.close_all()
        self.move(State.UNSERVED, now)
        self.tally.serve_failed(error)
        self.serve_at = now + self.attempts.next_delay()
