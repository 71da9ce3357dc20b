"""The registration of one resource with kubelet: a state machine that does no I/O.

Events go in as method calls with the time (`now`, seconds on a monotonic
clock); what must be done comes out as actions (`take()`), and the next moment
the machine wants to be woken is `deadline`. `atedevd/registrar.py` performs
the actions for real (sockets, gRPC calls, the journal) and feeds their
outcomes back in; the tests' simulation performs them against models of each
kubelet generation under a simulated clock. Nothing here reads a file, a
socket or a clock, so one seed replays one run exactly.

The rules, each from a way kubelet really behaves (docs/design.md, "Registration"):

- Every Register names a socket file of its own. The next one waits, already
  serving, in a subdirectory kubelet's wipe does not touch, and is renamed
  into place when needed; it is bound only once kubelet has our first device
  list, so that nothing competes with kubelet reading it.
- One Register in flight per resource; triggers that arrive meanwhile are
  remembered and acted on when it ends.
- While the same kubelet stays up, a new registration first hands over: the
  old socket's streams are ended, and Register waits until kubelet's teardown
  of the old connection is visible — pod-resources stops listing the resource,
  which kubelet's last teardown step causes — bounded; where pod-resources is
  not served, a fixed wait instead. kubelet <= 1.36 tears a resource down *by
  name*, so an old teardown that lands after a new Register would stop the new
  endpoint, silently. The same wait runs at start-up when kubelet still lists
  the resource, and before exit.
- A Register refused because kubelet.sock is not listening yet is sent again
  at once on the same socket. While kubelet is down nothing is bound and
  nothing is sent until kubelet.sock appears (a slow timer only as a fallback).
- A Register that returned OK is not believed until kubelet opens ListAndWatch
  on the new socket and, where kubelet serves pod-resources, lists our devices.
  Anything less is a lost registration: register again, with a capped backoff
  when it is pod-resources that disagrees, and never give up.
"""

import enum
import logging
from typing import Dict, List, Optional, Tuple

ERROR, WARNING, INFO, DEBUG = logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG

LET_GO_LIMIT_S = 10.0  # kubelet's own dial timeout; past it we register anyway
LET_GO_POLL_S = 0.005  # how often pod-resources is asked while waiting for kubelet to let go
FIXED_WAIT_S = 0.5  # without pod-resources: how long kubelet is given to let go
RELIST_LIMIT_S = 2.0  # a fresh device list should make kubelet list us again within this
RESEND_EVERY_S = 0.5  # ... sent again this often while it does not
CONFIRM_LIMIT_S = 1.0  # kubelet closed its connection: its listing should be gone within this
VERIFY_S = 5.0  # Register returned OK: kubelet's ListAndWatch must open by then
STABLE_AFTER_S = 2.0  # a stream end after this long is answered at once; earlier ones back off
CHECK_FIRST_S = 0.25  # kubelet has our first list: ask pod-resources this soon ...
CHECK_CONFIRM_S = 0.5  # ... again this soon when kubelet's count differs from ours ...
CHECK_EVERY_S = 60.0  # ... and otherwise this often (kubelet's grace for a lost plugin is 5 min)
CHECK_BACKOFF_S = (0.0, 30.0, 60.0, 120.0, 300.0)  # between re-registrations the check drives
STOP_LIMIT_S = 5.0  # on SIGTERM, wait this long at most for kubelet to let go (TimeoutStopSec=20s)
FAST_RETRY_S = 0.00025  # kubelet.sock exists but is not listening yet: try again this soon ...
FAST_WINDOW_S = 0.02  # ... for this long after it appeared, then back off
LISTEN_GRACE_S = 5.0  # a Register refused though sent this long after kubelet.sock appeared: that kubelet is gone
SLOW_RETRY_S = 10.0  # kubelet down: look again this often, in case an event was lost
WARN_AFTER_S = 20.0  # failing this long after a first registration (past any kubelet restart): a WARNING ...
WARN_EVERY_S = 60.0  # ... and again at most this often
REFUSED_SAY_EVERY_S = 60.0
STANDBY_AGAIN_S = 1.0  # the standby socket was deleted: bind the next one this much later
# A Register started this long before the newest kubelet.sock appeared went to the old one.
OLD_KUBELET_MARGIN_S = 0.1

# Outcomes of a Register call, as the performer reports them.
OK, REFUSED, FAILED = "ok", "refused", "failed"  # refused: nobody listens on kubelet.sock
# Outcomes of a pod-resources call: a count, or one of these.
PR_ABSENT, PR_REFUSED, PR_FAILED = "absent", "refused", "failed"


class State(enum.Enum):
    UNSERVED = "unserved"  # nothing bound: not advertised, no directory, or binding fails
    WAITING = "waiting"  # kubelet not serving, or a retry is due
    LETTING_GO = "letting-go"  # waiting for kubelet to let go of an old socket of ours
    REGISTERING = "registering"  # a socket being put in place, or Register in flight
    VERIFYING = "verifying"  # Register returned OK; waiting for kubelet's ListAndWatch
    REGISTERED = "registered"  # kubelet streams our devices (and counts them, where we can see)
    STOPPING = "stopping"  # SIGTERM: streams ended, waiting for kubelet to let go
    STOPPED = "stopped"


# Actions: tuples, the first item names what to do.
#   ("bind", sid, standby)      serve a new socket: in the standby directory, or in place
#   ("place", sid)              rename the standby socket into kubelet's directory
#   ("register", cid, sid)      send Register naming sid's socket
#   ("ask", cid)                ask pod-resources how many of our devices kubelet lists
#   ("probe", sids)             count kubelet's open connections to these sockets: `probed()`
#   ("cancel", cid)             cancel a call; its outcome, if it comes, is ignored
#   ("end_streams", sid)        end the ListAndWatch streams on sid
#   ("resend", sid)             send the device list again on sid's streams
#   ("close", sid)              stop serving sid and remove its socket file
#   ("say", level, kind, text, once)  log (`once`: a key said at most once per daemon)
Action = Tuple


class Backoff:
    """Capped exponential delay between failed attempts: 10 ms … 2 s."""

    def __init__(self, first: float = 0.01, cap: float = 2.0):
        self.first = first
        self.cap = cap
        self.delay = 0.0

    def next(self) -> float:
        self.delay = self.first if self.delay == 0 else min(self.delay * 2, self.cap)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


class LetGo:
    """Where a wait for kubelet to let go of our retiring sockets stands."""

    def __init__(self) -> None:
        self.purpose = "let-go"  # or "stop"
        self.phase = "unlisted"  # "connections", "confirm", "listed", "unlisted", "await-call"
        self.begun = self.until = 0.0
        self.fixed_until: Optional[float] = None  # a fixed wait, where nothing shows the teardown
        self.relist_until = 0.0  # "listed": kubelet should list the streaming socket by then
        self.resent_at: Optional[float] = None
        self.confirm_until = 0.0  # "confirm": pod-resources should stop listing us by then
        self.no_signal = False  # kubelet never listed the retiring socket: its teardown cannot show
        self.held_said = False


class Registration:
    """One resource's sockets and its registration with kubelet, as decisions only."""

    def __init__(self, name: str, count: int, healthy: bool = True, standby_possible: bool = True,
                 device_path: str = "the device", connections_visible: bool = True):
        self.name = name
        self.count = count  # units configured
        self.device_path = device_path  # for what we say
        self.healthy = healthy  # the device node is present: we send Healthy
        self.standby_possible = standby_possible  # False where the standby path would be too long
        # Whether ("probe", sids) can count kubelet's connections to our sockets.
        self.connections_visible = connections_visible
        self.state = State.UNSERVED
        self.changed_at = 0.0  # when `state` last changed
        self.actions: List[Action] = []
        self.timers: Dict[str, float] = {}
        self.kubelet_up = False
        self.kubelet_at = -1e9  # when the newest kubelet.sock appeared
        # Sockets, by id: the one named in the last Register (or about to be), the
        # one waiting in the standby directory, and old ones kubelet may still hold.
        self.current: Optional[int] = None
        self.standby: Optional[int] = None
        self.retiring: List[int] = []
        self._sid = 0
        self._bound: set = set()  # sids serving (bound)
        self._placing: Optional[int] = None  # a socket being put in place for Register
        self._gone: set = set()  # sids whose file was deleted under us
        self._watched: set = set()  # sids kubelet opened a stream on
        self._stream_open = False  # on `current`
        self._list_sent = False  # kubelet has `current`'s first device list
        # Calls in flight.
        self._cid = 0
        self.call: Optional[Tuple[int, float, int]] = None  # (cid, started, sid) of the Register in flight
        self._ask: Optional[int] = None  # the pod-resources call in flight
        self._ask_for = ""  # what its answer is for: "check", "let-go", "start", "stop"
        self.redo: Optional[str] = None  # register again once the call in flight ends, and why
        self._retry_same = False  # the due retry resends Register on `current`
        self.backoff = Backoff()
        self._lg = LetGo()  # the wait for kubelet to let go of old sockets
        # The pod-resources check.
        self.pod_resources: Optional[bool] = None  # served, as last seen (None: not asked yet)
        self.kubelet_count: Optional[int] = None
        self._mismatches = 0
        self._check_rereg = 0  # re-registrations the check drove, in a row
        self._check_rereg_at = -1e9
        # What `describe`, the journal and the metrics tell.
        self.registrations = 0
        self.reasons: Dict[str, int] = {}  # why each Register was sent
        self.registered_at: Optional[float] = None
        self.lost_at: Optional[float] = None
        self.last_error: Optional[str] = None
        self.failing_since: Optional[float] = None
        self.serve_error: Optional[str] = None
        self.last_reregistration: Optional[Tuple[float, float]] = None  # (at, seconds taken)
        self.refused_streams = 0
        self._refused_said = -REFUSED_SAY_EVERY_S
        self._why = ""
        self._listed_seen = False  # pod-resources listed `current`'s devices since it was placed
        self._known: set = set()  # sids kubelet may have a client for (a Register reached it)
        self._ended: set = set()  # sids whose streams we ended

    # --- for the performer -----------------------------------------------------------

    def take(self) -> List[Action]:
        actions, self.actions = self.actions, []
        return actions

    @property
    def deadline(self) -> Optional[float]:
        return min(self.timers.values()) if self.timers else None

    @property
    def stopped(self) -> bool:
        return self.state in (State.STOPPED, State.UNSERVED)

    # --- events: the node and the daemon ---------------------------------------------

    def serve(self, now: float, kubelet_up: bool, kubelet_at: Optional[float] = None) -> None:
        """The device is advertised and the plugin directory exists: get ready, register.
        `kubelet_at`: when the kubelet.sock there now appeared, if it is there."""
        if self.state is not State.UNSERVED:
            return
        self.kubelet_up = kubelet_up
        if kubelet_at is not None:
            self.kubelet_at = kubelet_at
        self._set(State.WAITING, now)
        if kubelet_up:
            self._ask_pod_resources("start")  # a previous instance's teardown may be pending
        if self.standby_possible:
            self._bind(now, standby=True)
        if self.state is State.UNSERVED:
            return
        self._try_start(now)

    def unserve(self, now: float, why: str) -> None:
        """The plugin directory is gone: nothing can be served until it is back."""
        if self.state in (State.UNSERVED, State.STOPPING, State.STOPPED):
            return
        if self.state in (State.REGISTERED, State.VERIFYING):
            self._say(WARNING, "registration-lost", f"{self.name}: lost registration: {why}")
            self.lost_at = now
        self._close_all()
        self._set(State.UNSERVED, now)

    def publish(self, now: float, healthy: bool) -> None:
        """A new device table was published to our sockets (the performer does that)."""
        self.healthy = healthy
        if self.state is State.REGISTERED and self._ask is None:  # kubelet's count follows: look again soon
            self._mismatches = 0
            self.timers["check"] = now + CHECK_FIRST_S

    def reconfigure(self, now: float, count: int) -> None:
        """The resource's configuration changed on reload: serve it anew, handing over."""
        self.count = count
        if self.standby is not None:  # it serves the old table
            self._close(self.standby)
            self.standby = None
        if self.state in (State.UNSERVED, State.STOPPING, State.STOPPED):
            return
        if self.state in (State.REGISTERED, State.VERIFYING):
            self.lost_at = now
        self._attempt(now, "configuration changed")

    def stop(self, now: float) -> None:
        """SIGTERM: end our streams and wait until kubelet has let go of them (bounded)."""
        if self.state in (State.STOPPING, State.STOPPED):
            return
        if self.state is State.UNSERVED:
            self._set(State.STOPPED, now)
            return
        # A Register in flight is not cancelled: kubelet goes on with it whatever we do, so
        # its outcome is waited for (bounded) and its socket let go of like the others.
        if self._ask is not None:
            self._cancel_ask()
        if self._placing is not None:
            self._close(self._placing)
            self._placing = None
        if self.standby is not None:
            self._close(self.standby)
            self.standby = None
        streaming = self._stream_open
        if self.current is not None:
            self.retiring.append(self.current)
            self.current = None
        self.timers = {}
        self._set(State.STOPPING, now)
        if not self.kubelet_up or not (self._known & set(self.retiring) or self.call is not None):
            self._finish_stop(now)
            return
        self._begin_let_go(now, "stop", streaming)

    def close(self, now: float) -> None:
        """Stop every socket now."""
        self._close_all()
        self._set(State.STOPPED, now)

    # --- events: kubelet's directory -------------------------------------------------

    def kubelet_created(self, now: float, at: float, ours_present: bool) -> None:
        """A new kubelet.sock (created at `at`): kubelet restarted, or re-created its socket.

        A starting kubelet deletes every socket in the directory first, so if none
        of ours kubelet may hold is still there (`ours_present` False), kubelet
        restarted: the kubelet that held them is gone and the new one has no client
        of ours that a late teardown could confuse, so no waiting. If one is still
        there, the same kubelet re-created its socket and still holds our client."""
        self.kubelet_up, self.kubelet_at = True, at
        if self.state in (State.UNSERVED, State.STOPPING, State.STOPPED):
            return
        restarted = not ours_present
        if self.call is not None:
            if self.call[1] >= at - OLD_KUBELET_MARGIN_S and not restarted:
                return  # it dialled this kubelet (or fails at once): its outcome decides
            # Hanging on a kubelet that is gone, or naming a socket that kubelet's wipe removed.
            self.actions.append(("cancel", self.call[0]))
            self.call = None
        if self._ask is not None and self._ask_for != "check":
            self._cancel_ask()
        if self.state in (State.REGISTERED, State.VERIFYING):
            how = "kubelet restarted" if restarted else "kubelet serves a new kubelet.sock"
            self._say(INFO, "kubelet-restarted", f"{self.name}: {how}; registering again")
            self.lost_at = now
        self.redo = None
        self.backoff.reset()
        if restarted:
            self._gone.update(self._held())
        self._attempt(now, "kubelet restarted" if restarted else "new kubelet.sock", wait=not restarted)

    def kubelet_gone(self, now: float) -> None:
        """kubelet.sock was deleted: nothing is sent until a new one appears."""
        self.kubelet_up = False
        if self.state is State.WAITING and "retry" in self.timers:
            self.timers["retry"] = now + SLOW_RETRY_S

    def socket_deleted(self, now: float, sid: int) -> None:
        """A socket file of ours was deleted (kubelet's wipe, or someone else)."""
        self._gone.add(sid)
        if sid == self.standby:  # someone cleans up (rm -rf, a purge): not at once
            self._close(sid)
            self.standby = None
            self.timers["standby"] = now + STANDBY_AGAIN_S
            return
        if sid != self.current:
            return
        if self.state is State.REGISTERING:
            self.redo = "our socket was deleted"
        elif self.state in (State.REGISTERED, State.VERIFYING):
            self._say(INFO, "socket-deleted", f"{self.name}: our socket was deleted; registering again")
            self.lost_at = now
            self._attempt(now, "our socket was deleted")

    def nudge(self, now: float) -> None:
        """News from kubelet's directory: a retry that waits may go now (unless kubelet is down)."""
        if "retry" in self.timers and self.kubelet_up and now - self.kubelet_at < LISTEN_GRACE_S:
            self.timers["retry"] = min(self.timers["retry"], now)

    # --- events: our sockets ---------------------------------------------------------

    def bound(self, now: float, sid: int, error: Optional[str]) -> None:
        """The outcome of ("bind", sid, ...)."""
        if error is not None:
            self._serve_error(now, error)
            return
        self._bound.add(sid)
        if sid == self._placing:
            self._placed(now, sid)
        elif sid == self.standby:
            self.serve_error = None
            if self.state is State.WAITING and self.current is None:
                self._try_start(now)

    def placed(self, now: float, sid: int, error: Optional[str]) -> None:
        """The outcome of ("place", sid)."""
        if sid != self._placing:
            return
        if error is not None:
            self._placing = None
            self._close(sid)
            self._serve_error(now, error)
            return
        self._placed(now, sid)

    def stream_opened(self, now: float, sid: int) -> None:
        self._watched.add(sid)
        self._known.add(sid)
        if sid != self.current:
            if sid in self._ended:  # a retiring socket: its stream is ended as it opens
                self.actions.append(("end_streams", sid))
            return
        self._stream_open = True
        if self.state is State.VERIFYING:
            self._verified(now)

    def list_sent(self, now: float, sid: int) -> None:
        """kubelet has `sid`'s first device list: the work that could wait may go now."""
        if sid != self.current or self._list_sent:
            return
        self._list_sent = True
        if self.state is State.REGISTERED:
            self._after_first_list(now)

    def stream_ended(self, now: float, sid: int) -> None:
        """kubelet ended its ListAndWatch on `sid` (not we)."""
        if sid != self.current:
            return  # an old socket's stream, already handed over
        self._stream_open = False
        if self.state is State.REGISTERING:
            self.redo = "kubelet ended our stream"
        elif self.state in (State.VERIFYING, State.REGISTERED):
            self._say(INFO, "stream-ended", f"{self.name}: kubelet ended our ListAndWatch stream; registering again")
            self.lost_at = now
            stable = self.registered_at is not None and now - self.registered_at >= STABLE_AFTER_S
            if stable:
                self.backoff.reset()
                self._attempt(now, "kubelet ended our stream")
            else:  # no hammering a kubelet that keeps ending it
                self._waiting(now, "kubelet ended our stream")
                self._retry_same = False
                self.timers["retry"] = now + self.backoff.next()

    def stream_refused(self, now: float, sid: int, limit: int, where: str = "") -> None:
        self.refused_streams += 1
        if now - self._refused_said >= REFUSED_SAY_EVERY_S:  # a flood of them is one line a minute
            self._refused_said = now
            self._say(ERROR, "stream-refused", f"{self.name}: refused a ListAndWatch stream on {where or sid}: {limit} already open for this resource ({self.refused_streams} refused so far)")

    # --- events: calls to kubelet ----------------------------------------------------

    def register_done(self, now: float, cid: int, outcome: str, reason: str = "") -> None:
        if self.call is None or self.call[0] != cid:
            return  # cancelled: a newer kubelet made it moot
        _, started, sid = self.call
        self.call = None
        if outcome != REFUSED:
            self._known.add(sid)  # kubelet has (or had) a client for it
        if self.state is State.STOPPING:  # let go of this one too before exit
            self._end([sid])
            self._begin_let_go(now, "stop", False)
            return
        self._stop_retiring()  # kubelet let go of them before we registered, or it restarted
        if outcome == OK:
            if self.redo is not None:
                why, self.redo = self.redo, None
                self._attempt(now, why)
                return
            self._set(State.VERIFYING, now)
            if self._stream_open:
                self._verified(now)
            else:
                self.timers["verify"] = now + VERIFY_S
            return
        if self.redo is not None and self.kubelet_at > started:
            self.redo = None
        if outcome == REFUSED and self.current is not None and self.current not in self._gone:
            # kubelet.sock is there but nobody listens: just created (try again at once, on
            # the same socket), or left by a kubelet that is gone (wait for a new one).
            since = started - self.kubelet_at
            self._waiting(now, reason or "kubelet is not accepting connections")
            self._retry_same = True
            if not self.kubelet_up or since >= LISTEN_GRACE_S:
                delay = SLOW_RETRY_S
            elif since < FAST_WINDOW_S:
                delay = FAST_RETRY_S
            else:
                delay = self.backoff.next()
            self.timers["retry"] = now + delay
            return
        # kubelet answered with an error, or did not answer: it may have half a client of
        # ours; that socket retires and the next try hands over from it.
        retry_now = self.kubelet_at > started  # a kubelet that appeared since deserves a try at once
        self._waiting(now, reason or "Register failed")
        self._retry_same = False
        self.timers["retry"] = now + (0.0 if retry_now else self.backoff.next())

    def allocatable_done(self, now: float, cid: int, result) -> None:
        """The outcome of ("ask", cid): how many of our devices kubelet lists, or PR_*."""
        if cid != self._ask:
            return
        self._ask = None
        purpose = self._ask_for
        if isinstance(result, int):
            self._pod_resources_seen(True)
            if result > 0 and purpose != "start":
                self._listed_seen = True
        elif result == PR_ABSENT:
            self._pod_resources_seen(False)
        if purpose == "start":
            self._start_answer(now, result)
        elif purpose in ("let-go", "stop"):
            self._let_go_answer(now, result, purpose)
        elif purpose == "check":
            self._check_answer(now, result)

    # --- the clock ---------------------------------------------------------------------

    def tick(self, now: float) -> None:
        for name in [n for n, at in self.timers.items() if at <= now]:
            if self.timers.get(name, now + 1) <= now:
                del self.timers[name]
                getattr(self, "_timer_" + name.replace("-", "_"))(now)

    def _timer_retry(self, now: float) -> None:
        if self.state is not State.WAITING or self.call is not None:
            return
        if self._retry_same and self.current is not None and self.current not in self._gone:
            if self.kubelet_up:
                self._send_register(now, self.current)
            else:
                self.timers["retry"] = now + SLOW_RETRY_S
            return
        self._attempt(now, self.last_error or "retry")

    def _timer_standby(self, now: float) -> None:
        if self.state not in (State.UNSERVED, State.STOPPING, State.STOPPED) and self.standby is None \
                and self.standby_possible:
            self._bind(now, standby=True)

    def _timer_serve(self, now: float) -> None:
        if self.state is State.UNSERVED:  # binding failed: a directory made writable raises no event
            self.serve(now, self.kubelet_up)

    def _timer_let_go(self, now: float) -> None:
        if self.state is State.LETTING_GO:
            self._wait_let_go(now, "let-go")
        elif self.state is State.STOPPING:
            self._wait_let_go(now, "stop")

    def _timer_verify(self, now: float) -> None:
        if self.state is not State.VERIFYING:
            return
        self._say(WARNING, "not-watched", f"{self.name}: kubelet accepted the registration but opened no ListAndWatch within {VERIFY_S:.0f} s; registering again")
        self.lost_at = now
        self._set(State.WAITING, now)
        self._attempt(now, "kubelet never opened ListAndWatch")

    def _timer_check(self, now: float) -> None:
        if self.state is State.REGISTERED and self._ask is None:
            self._ask_pod_resources("check")

    def _timer_warn(self, now: float) -> None:
        if self.state is State.REGISTERED or self.registrations == 0 or self.failing_since is None:
            return
        took = now - self.failing_since
        self._say(WARNING, "still-unregistered", f"{self.name}: not registered with kubelet for {took:.0f} s: {self.last_error}")
        self.timers["warn"] = now + WARN_EVERY_S

    # --- transitions -------------------------------------------------------------------

    def _set(self, state: State, now: float) -> None:
        if state is not self.state:
            self.state, self.changed_at = state, now

    def _try_start(self, now: float) -> None:
        """Start-up: register once a socket is ready and pod-resources has answered."""
        if self.current is not None or self.call is not None or self._placing is not None:
            return
        if self._ask is not None and self._ask_for == "start":
            return  # its answer decides
        if self.standby_possible and self.standby not in self._bound:
            return  # bound() comes back here
        if not self.kubelet_up:
            self._waiting(now, "kubelet.sock does not exist yet", first=True)
            self.timers["retry"] = now + SLOW_RETRY_S
            return
        self._register(now, "first registration")

    def _start_answer(self, now: float, result) -> None:
        if self.state is not State.WAITING:
            return
        if isinstance(result, int) and result > 0:
            # No instance of ours is registered, yet kubelet lists the resource: an earlier
            # instance's stream is still being torn down. Registering now could be undone by it.
            self._say(INFO, "earlier-instance", f"{self.name}: kubelet still lists {result} devices of an earlier instance; waiting for it to let go")
            self._set(State.LETTING_GO, now)
            self._lg.begun, self._lg.until = now, now + LET_GO_LIMIT_S
            self._lg.fixed_until = None
            self._lg.phase, self._lg.no_signal = "unlisted", False
            self.timers["let-go"] = now + LET_GO_POLL_S
            return
        self._try_start(now)

    def _attempt(self, now: float, why: str, wait: bool = True) -> None:
        """Register on a fresh socket. First the socket kubelet knew retires and, unless
        kubelet restarted (`wait` False), kubelet is given time to let go of it."""
        if self.call is not None or self._placing is not None:
            self.redo = why  # one Register in flight per resource
            return
        if wait and self.state is State.VERIFYING and not self._stream_open:
            # kubelet has a client for this socket whose stream is still to come; retiring it
            # now would leave that stream's teardown, by name, to land on the next one.
            self.redo = why  # acted on once verified, or when the verify timer runs out
            return
        for name in ("retry", "verify", "check", "let-go"):
            self.timers.pop(name, None)
        if self._ask is not None and self._ask_for != "start":
            self._cancel_ask()
        self._retry_same = False
        streaming = False
        if self.current is not None:
            streaming = self._stream_open
            self.retiring.append(self.current)
            self.current = None
            self._stream_open = self._list_sent = False
        held = [s for s in self.retiring if s in self._known]
        if not self.kubelet_up:
            self._end(self.retiring)
            # Its creation wakes us; the slow timer is for an event that was lost.
            self._waiting(now, "kubelet.sock does not exist")
            self.timers["retry"] = now + SLOW_RETRY_S
            return
        if wait and held:
            self._set(State.LETTING_GO, now)
            self._why = why
            self._begin_let_go(now, "let-go", streaming)
            return
        self._end(self.retiring)
        self._register(now, why)

    def _begin_let_go(self, now: float, purpose: str, streaming: bool) -> None:
        """Wait for kubelet to let go of our retiring sockets, on what kubelet shows.

        kubelet's last teardown step marks the devices unhealthy, and pod-resources
        stops listing them: that is the signal. It shows only if kubelet listed them
        before, so a socket whose stream is open is first made listed (a fresh device
        list, if need be), then its stream is ended, then the listing must go."""
        if self._ask is not None:  # an answer to an earlier wait would be read as this one's
            self._cancel_ask()
        self._lg.begun, self._lg.until = now, now + (STOP_LIMIT_S if purpose == "stop" else LET_GO_LIMIT_S)
        self._lg.relist_until = now + RELIST_LIMIT_S
        self._lg.fixed_until = None
        self._lg.resent_at = None
        self._lg.held_said = False
        if self.connections_visible:
            # Our own descriptors show kubelet closing its connection, the step just before
            # PluginDisconnected; pod-resources then confirms the listing is gone.
            self._end(self.retiring)
            self._lg.phase = "connections"
        elif streaming and self.healthy and self.pod_resources is not False:
            self._lg.phase = "listed"
        else:
            self._end(self.retiring)
            self._lg.phase = "unlisted"
            self._lg.no_signal = not self._listed_seen
        self._wait_let_go(now, purpose)

    def _wait_let_go(self, now: float, purpose: str) -> None:
        """One step of waiting for kubelet to let go of our old sockets."""
        if self._lg.fixed_until is not None:
            if now < self._lg.fixed_until:
                self.timers["let-go"] = self._lg.fixed_until
                return
            self._let_go_done(now, purpose)
            return
        if self._lg.phase == "await-call":
            self._finish_stop(now)  # the Register never came back: exit all the same
            return
        if self._lg.phase == "connections":
            self._lg.purpose = purpose
            self.actions.append(("probe", tuple(self.retiring)))
            return
        if self._lg.phase == "unlisted" and (self.pod_resources is False or not self.healthy or self._lg.no_signal):
            self._fixed_wait(now)  # kubelet's count cannot show the teardown
            return
        if self._lg.phase == "confirm" and (self.pod_resources is False or not self.healthy):
            self._let_go_done(now, purpose)
            return
        self._ask_pod_resources(purpose)

    def probed(self, now: float, held: int) -> None:
        """The outcome of ("probe", ...): kubelet's connections still open, -1 if unknown."""
        purpose = self._lg.purpose
        if self.state is not (State.STOPPING if purpose == "stop" else State.LETTING_GO) or self._lg.phase != "connections":
            return
        if held < 0:  # cannot be seen after all: kubelet's count alone
            self.connections_visible = False
            self._lg.phase, self._lg.no_signal = "unlisted", not self._listed_seen
            self._wait_let_go(now, purpose)
        elif held > 0:
            if not self._lg.held_said:
                self._lg.held_said = True
                self._say(DEBUG, "let-go", f"{self.name}: kubelet holds {held} connection(s) to our old socket; waiting for it to let go")
            if now < self._lg.until:
                self.timers["let-go"] = now + LET_GO_POLL_S
                return
            self._say(WARNING, "let-go-timeout", f"{self.name}: kubelet still holds {held} connection(s) to our old socket after {now - self._lg.begun:.0f} s; {'exiting' if purpose == 'stop' else 'registering'} anyway")
            self._let_go_done(now, purpose)
        else:
            self._lg.phase = "confirm"
            self._lg.confirm_until = now + CONFIRM_LIMIT_S
            self._wait_let_go(now, purpose)

    def _fixed_wait(self, now: float) -> None:
        self._end(self.retiring)
        self._lg.phase = "unlisted"
        self._lg.fixed_until = min(now + FIXED_WAIT_S, self._lg.until)
        self.timers["let-go"] = self._lg.fixed_until

    def _let_go_answer(self, now: float, result, purpose: str) -> None:
        expected = State.STOPPING if purpose == "stop" else State.LETTING_GO
        if self.state is not expected or self._lg.phase in ("connections", "await-call"):
            return
        if self._lg.phase == "confirm":
            if isinstance(result, int) and result > 0 and now < self._lg.confirm_until:
                self.timers["let-go"] = now + LET_GO_POLL_S
            elif result == PR_REFUSED and purpose != "stop":
                self._stop_retiring()
                self._waiting(now, "kubelet is not accepting connections")
                self.timers["retry"] = now + SLOW_RETRY_S
            else:
                self._let_go_done(now, purpose)
            return
        if isinstance(result, int) and self._lg.phase == "listed":
            if result > 0:
                self._end(self.retiring)
                self._lg.phase = "unlisted"
                self.timers["let-go"] = now + LET_GO_POLL_S
            elif now >= self._lg.relist_until:
                self._fixed_wait(now)  # kubelet lists nothing of a streaming socket: no signal
            else:
                if self._lg.resent_at is None or now - self._lg.resent_at >= RESEND_EVERY_S:
                    # A stopped endpoint with its stream open (kubelet <= 1.36) lists nothing;
                    # a fresh device list makes kubelet list it again.
                    self._lg.resent_at = now
                    for sid in self.retiring:
                        self.actions.append(("resend", sid))
                self.timers["let-go"] = now + LET_GO_POLL_S
        elif isinstance(result, int) and result > 0:
            if now < self._lg.until:
                self.timers["let-go"] = now + LET_GO_POLL_S
                return
            self._say(WARNING, "let-go-timeout", f"{self.name}: kubelet still lists our old socket's devices after {now - self._lg.begun:.0f} s; {'exiting' if purpose == 'stop' else 'registering'} anyway")
            self._let_go_done(now, purpose)
        elif isinstance(result, int):
            self._let_go_done(now, purpose)
        elif result == PR_REFUSED:  # pod-resources is served by kubelet itself: kubelet is down
            self._end(self.retiring)
            if purpose == "stop":
                self._let_go_done(now, purpose)
            else:
                self._stop_retiring()
                self._waiting(now, "kubelet is not accepting connections")
                self.timers["retry"] = now + SLOW_RETRY_S
        else:  # not served, or it failed: a fixed wait
            self._fixed_wait(now)

    def _let_go_done(self, now: float, purpose: str) -> None:
        self.timers.pop("let-go", None)
        if self._lg.phase != "await-call":
            self._say(DEBUG, "let-go", f"{self.name}: kubelet let go of our old socket after {(now - self._lg.begun) * 1000:.0f} ms ({self._lg.phase})")
        self._end(self.retiring)
        if purpose == "stop":
            if self.call is not None and now < self._lg.until:
                self._lg.phase = "await-call"  # register_done starts the wait again
                self.timers["let-go"] = self._lg.until
                return
            self._finish_stop(now)
            return
        self._stop_retiring()
        self._register(now, self._why or "registering again")

    def _end(self, sids: List[int]) -> None:
        """End the streams on these sockets (once each: a stream opened later is ended when it opens)."""
        for sid in sids:
            if sid not in self._ended:
                self._ended.add(sid)
                self.actions.append(("end_streams", sid))

    def _finish_stop(self, now: float) -> None:
        self._close_all()
        self._set(State.STOPPED, now)

    def _register(self, now: float, why: str) -> None:
        """Put a socket in place (the standby if one is ready, so it cannot have been
        wiped) and Register it."""
        self._why = why
        self.redo = None  # what it was about is moot: this registration answers it
        self._set(State.REGISTERING, now)
        self.reasons[why] = self.reasons.get(why, 0) + 1
        self._say(DEBUG, "registering", f"{self.name}: registering ({why})")
        if self.standby is not None and self.standby in self._bound:
            sid, self.standby = self.standby, None
            self._placing = sid
            self.actions.append(("place", sid))
        else:  # none ready (a standby still binding stays the standby)
            self._placing = self._bind(now, standby=False)

    def _placed(self, now: float, sid: int) -> None:
        self._placing = None
        self.current = sid
        self._stream_open = sid in self._watched
        self._list_sent = self._listed_seen = False
        self._send_register(now, sid)

    def _send_register(self, now: float, sid: int) -> None:
        self._cid += 1
        self.call = (self._cid, now, sid)
        self._set(State.REGISTERING, now)
        self.actions.append(("register", self._cid, sid))

    def _verified(self, now: float) -> None:
        self.timers.pop("verify", None)
        self.timers.pop("warn", None)
        self._set(State.REGISTERED, now)
        self.registrations += 1
        self.registered_at = now
        self.last_error = self.failing_since = None
        self._mismatches = 0
        if self.lost_at is not None:
            took = now - self.lost_at
            self.last_reregistration = (now, took)
            self.lost_at = None
            self._say(INFO, "reregistered", f"{self.name}: registered again with kubelet ({took * 1000:.0f} ms after the loss)")
        elif self.registrations == 1:
            self._say(INFO, "registered", f"{self.name}: registered with kubelet ({self.count} units of {self.device_path})")
        else:
            self._say(INFO, "reregistered", f"{self.name}: registered again with kubelet")
        if self._list_sent:
            self._after_first_list(now)
        if self.redo is not None:  # a trigger that came while kubelet's stream was still to open
            why, self.redo = self.redo, None
            self._attempt(now, why)

    def _after_first_list(self, now: float) -> None:
        if self.standby is None and self.standby_possible:
            self.timers["standby"] = now
        self.timers["check"] = now + CHECK_FIRST_S

    def _waiting(self, now: float, reason: str, first: bool = False) -> None:
        self._set(State.WAITING, now)
        if reason != self.last_error and self.registrations == 0:
            self._say(INFO, "waiting-for-kubelet", f"{self.name}: waiting for kubelet: {reason}")
        else:  # retries, and the expected gaps of a restarting kubelet
            self._say(DEBUG, "waiting-for-kubelet", f"{self.name}: waiting for kubelet: {reason}")
        self.last_error = reason
        if self.failing_since is None:
            self.failing_since = now
            if self.registrations > 0:
                self.timers["warn"] = now + WARN_AFTER_S

    # --- the pod-resources check -----------------------------------------------------------

    def _ask_pod_resources(self, purpose: str) -> None:
        if self._ask is not None:
            self._cancel_ask()
        self._cid += 1
        self._ask, self._ask_for = self._cid, purpose
        self.actions.append(("ask", self._cid))

    def _cancel_ask(self) -> None:
        self.actions.append(("cancel", self._ask))
        self._ask = None

    def _pod_resources_seen(self, served: bool) -> None:
        if served == self.pod_resources:
            return
        if served:
            self._say(INFO, "pod-resources", "kubelet's pod-resources API is served: it cross-checks that kubelet counts our devices, and shows when kubelet has let go of an old socket", once="pod-resources-served")
        else:
            self._say(INFO, "pod-resources", f"kubelet's pod-resources API is not served: nothing cross-checks that kubelet counts our devices, and kubelet is given a fixed {FIXED_WAIT_S * 1000:.0f} ms to let go of an old socket", once="pod-resources-absent")
        self.pod_resources = served

    def _check_answer(self, now: float, result) -> None:
        if self.state is not State.REGISTERED:
            return
        if not isinstance(result, int):
            self.timers["check"] = now + CHECK_EVERY_S
            return
        # kubelet lists only the IDs it holds healthy; 0 while we send Healthy means it
        # stopped counting us (stopped endpoint, disconnected, restored from its checkpoint).
        expected = self.count if self.healthy else 0
        self.kubelet_count = result
        if result == expected or expected == 0:
            self._mismatches = 0
            self._check_rereg = 0
            self.timers["check"] = now + CHECK_EVERY_S
            return
        self._mismatches += 1
        if self._mismatches < 2:
            self.timers["check"] = now + CHECK_CONFIRM_S
            return
        wait = CHECK_BACKOFF_S[min(self._check_rereg, len(CHECK_BACKOFF_S) - 1)]
        if now < self._check_rereg_at + wait:
            self.timers["check"] = min(self._check_rereg_at + wait, now + CHECK_EVERY_S)
            return
        self._check_rereg += 1
        self._check_rereg_at = now
        self._say(WARNING, "not-counted", f"{self.name}: kubelet does not count our devices (pod-resources lists {result} of {expected} as allocatable) although we are registered; registering again (time {self._check_rereg} in a row)")
        self.lost_at = now
        self._attempt(now, "kubelet does not count our devices")

    # --- sockets ---------------------------------------------------------------------------

    def _bind(self, now: float, standby: bool) -> int:
        self._sid += 1
        sid = self._sid
        if standby:
            self.standby = sid
        self.actions.append(("bind", sid, standby))
        return sid

    def _close(self, sid: int) -> None:
        self._bound.discard(sid)
        self.actions.append(("close", sid))

    def held(self) -> List[int]:
        """The sockets kubelet may hold: the current one and those retiring."""
        return self._held()

    def _held(self) -> List[int]:
        return [s for s in [self.current] + self.retiring if s is not None]

    def _stop_retiring(self) -> None:
        for sid in self.retiring:
            self._close(sid)
        self.retiring = []

    def _cancel_calls(self) -> None:
        if self.call is not None:
            self.actions.append(("cancel", self.call[0]))
            self.call = None
        if self._ask is not None:
            self._cancel_ask()

    def _close_all(self) -> None:
        self._cancel_calls()
        for sid in self._held() + ([self.standby] if self.standby is not None else []) + \
                ([self._placing] if self._placing is not None else []):
            self._close(sid)
        self.current = self.standby = self._placing = None
        self.retiring = []
        self._stream_open = self._list_sent = False
        self.redo = None
        self.timers = {k: v for k, v in self.timers.items() if k == "serve"}

    def _serve_error(self, now: float, error: str) -> None:
        self._close_all()
        self._set(State.UNSERVED, now)
        text = f"{self.name}: cannot serve {error}"
        if self.serve_error is None:  # retried on every wake-up; said once
            self._say(ERROR, "serve-failed", text)
        self.serve_error = text
        self.timers["serve"] = now + self.backoff.next()

    def _say(self, level: int, kind: str, text: str, once: Optional[str] = None) -> None:
        self.actions.append(("say", level, kind, text, once))

    # --- reporting -------------------------------------------------------------------------

    def describe(self, now: float, wall_now: float) -> str:
        """This resource's part of STATUS= (`wall_now`: the wall clock at `now`)."""
        import time as _time  # formatting only

        def clock(at: float) -> str:
            return _time.strftime("%H:%M:%S", _time.localtime(wall_now - (now - at)))

        s = self.state
        if s is State.REGISTERED:
            healthy = self.count if self.healthy else 0
            text = f"registered, {healthy}/{self.count} healthy"
            if self.kubelet_count is not None:
                text += f", kubelet counts {self.kubelet_count}"
            if self.last_reregistration:
                at, took = self.last_reregistration
                text += f", re-registered {clock(at)} in {took * 1000:.0f} ms"
        elif s in (State.REGISTERING, State.VERIFYING, State.LETTING_GO):
            text = "registering with kubelet"
        elif s is State.UNSERVED:
            text = "not served" + (f": {self.serve_error.rsplit(': ', 1)[-1]}" if self.serve_error else "")
        else:
            text = "waiting for kubelet"
            if self.last_error and self.failing_since is not None and self.registrations > 0:
                text += f" since {clock(self.failing_since)}: {self.last_error}"
        if self.refused_streams:
            text += f", {self.refused_streams} stream(s) refused"
        return text
