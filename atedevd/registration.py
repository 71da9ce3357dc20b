"""The registration of one resource with kubelet: a state machine, all in this module.

The control loop only forwards events here (kubelet.sock appeared, our socket
vanished, a stream opened or ended, a call finished, a timer is due); every
decision and every state change of a registration is made below.

The rules, each from a way kubelet really behaves (docs/design.md, "Registration"):

- Every Register names a socket file of its own (`sockets.socket_name`). The
  next one waits, already serving, in a subdirectory kubelet's wipe does not
  touch, and is renamed into place when needed, so that a restarted kubelet
  gets our Register within a millisecond or two of serving again.
- One Register in flight per resource. Triggers that arrive meanwhile are
  remembered and acted on when it ends: never two Registers for one kubelet.
- While the same kubelet stays up, a new registration first hands over: the
  old socket's streams are ended, and Register waits (at most 10 s) until
  kubelet has closed its connections to the old socket, plus a short settle.
  kubelet <= 1.36 tears a resource down *by name*, so an old teardown that
  lands after a new Register would stop the new endpoint, silently.
- A Register that returned OK is not believed until kubelet opens ListAndWatch
  on the new socket, and, where kubelet serves pod-resources, lists our
  devices as allocatable. Anything less is a lost registration: register again.
"""

import collections
import enum
import logging
import os
import threading
import time
from functools import partial
from typing import Callable, Dict, List, Optional

from atedevd import sockets
from atedevd.config import Device
from atedevd.devices import Snapshot
from atedevd.kubelet import AllocatableCall, KubeletView, RegisterCall
from atedevd.plugin import STREAM_ENDED, STREAM_OPENED, STREAM_REFUSED, STREAMS_PER_RESOURCE, AllocateCounts, PluginServer, Workers
from atedevd.systemd import event

log = logging.getLogger(__name__)
WARNING, INFO, DEBUG, ERROR = logging.WARNING, logging.INFO, logging.DEBUG, logging.ERROR

HANDOVER_LIMIT_S = 10.0  # kubelet's own dial timeout; past it we register anyway
SETTLE_S = 0.05  # after kubelet closes the old connection it marks the resource disconnected
POLL_S = 0.005  # how often a handover looks at kubelet's connections
VERIFY_S = 5.0  # Register returned OK: kubelet's ListAndWatch must open by then
STABLE_AFTER_S = 2.0  # a stream end after this long is answered at once; earlier ones back off
CHECK_FIRST_S = 0.25  # verified: ask pod-resources this soon ...
CHECK_CONFIRM_S = 0.5  # ... again this soon when kubelet's count differs from ours ...
CHECK_EVERY_S = 60.0  # ... and otherwise this often (kubelet's grace for a lost plugin is 5 min)
STOP_WAIT_S = 5.0  # on SIGTERM, wait this long at most for kubelet to let go (TimeoutStopSec=20s)
WARN_AFTER_S = 5.0  # failing this long after a first registration: say so as a WARNING ...
WARN_EVERY_S = 60.0  # ... and again at most this often
# A Register started this long before the newest kubelet.sock appeared went to the old one.
OLD_KUBELET_MARGIN_S = 0.1
# Re-registering this many times in a row without kubelet counting us: stop acting on the
# check (say so, keep reporting it), so that a kubelet we misread is never hammered.
CHECK_MAX_REREGISTRATIONS = 3
REFUSED_SAY_EVERY_S = 60.0


class State(enum.Enum):
    UNSERVED = "unserved"  # nothing bound: not advertised, no directory, or binding fails
    WAITING = "waiting"  # a socket ready; kubelet not serving, or a retry is due
    HANDOVER = "handover"  # kubelet still holds an old socket of ours: waiting for it to let go
    REGISTERING = "registering"  # Register in flight
    VERIFYING = "verifying"  # Register returned OK; waiting for kubelet's ListAndWatch
    REGISTERED = "registered"  # kubelet streams our devices (and counts them, where we can see)
    STOPPING = "stopping"  # SIGTERM: streams ended, waiting for kubelet to let go
    STOPPED = "stopped"


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


class Context:
    """What every registration of one daemon shares."""

    def __init__(
        self,
        plugin_dir: str,
        run_id: str,
        workers: Workers,
        kubelet: KubeletView,
        post: Callable[[Callable[[], None]], None],
        serve_failed: Callable[[str, OSError], bool],
    ):
        self.plugin_dir = plugin_dir
        self.run_id = run_id
        self.workers = workers
        self.kubelet = kubelet
        self.post = post  # run a callable on the loop (from gRPC threads)
        self.serve_failed = serve_failed  # True: the daemon is stopping because of it
        self.pod_resources_seen: Optional[bool] = None  # logged once each way


class Registration:
    """One resource's sockets and its registration with kubelet."""

    def __init__(self, device: Device, snapshot: Snapshot, ctx: Context):
        self.device = device
        self.snapshot = snapshot
        self.ctx = ctx
        self.changed_at = time.monotonic()  # when `state` last changed (metrics)
        self._state = State.UNSERVED
        self.reasons: "collections.Counter[str]" = collections.Counter()  # why each Register was sent (metrics)
        self.allocations = AllocateCounts()  # shared by this resource's servers (metrics)
        self.current: Optional[PluginServer] = None  # named in the last Register (or about to be)
        self.standby: Optional[PluginServer] = None  # serving in the standby directory
        self.retiring: List[PluginServer] = []  # old sockets kubelet may still hold
        self.call: Optional[RegisterCall] = None
        self.redo: Optional[str] = None  # why to register again once the call in flight ends
        self.backoff = Backoff()
        self._timers: Dict[str, float] = {}
        self._n = 0
        self._slots = threading.BoundedSemaphore(STREAMS_PER_RESOURCE)
        self._stream_open = False
        self._handover_until = 0.0
        self._settle_at: Optional[float] = None
        self._handover_why = ""
        self._check: Optional[AllocatableCall] = None
        self._mismatches = 0
        self._check_reregistrations = 0  # in a row, without kubelet's count matching since
        self._n_registers = 0  # Register calls made
        self._refused_said = -REFUSED_SAY_EVERY_S
        # What `describe` and the journal tell.
        self.registrations = 0
        self.registered_at: Optional[float] = None
        self.lost_at: Optional[float] = None
        self.last_error: Optional[str] = None
        self.error_since: Optional[float] = None  # wall clock, for STATUS=
        self._failing_since: Optional[float] = None
        self.serve_error: Optional[str] = None
        self.last_reregistration: Optional[tuple] = None  # wall time, seconds taken
        self.kubelet_count: Optional[int] = None
        self.refused_streams = 0

    @property
    def name(self) -> str:
        return self.device.resource

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        if value is not self._state:
            self._state = value
            self.changed_at = time.monotonic()

    @property
    def deadline(self) -> Optional[float]:
        return min(self._timers.values()) if self._timers else None

    # --- events from the loop -----------------------------------------------------

    def serve(self, now: float) -> None:
        """The device is advertised and the plugin directory exists: have a socket ready."""
        if self.state is not State.UNSERVED:
            return
        if not self._ensure_standby():
            return
        self.state = State.WAITING
        self._attempt(now, "first registration")

    def unserve(self, now: float, why: str) -> None:
        """The plugin directory is gone: nothing can be served until it is back."""
        if self.state is State.UNSERVED:
            return
        if self.state in (State.REGISTERED, State.VERIFYING):
            event(WARNING, "registration-lost", f"{self.name}: lost registration: {why}", resource=self.name)
            self.lost_at = now
        self._close_all()
        self.state = State.UNSERVED

    def kubelet_started(self, now: float) -> None:
        """A new kubelet.sock: kubelet restarted, or re-created its socket.

        A starting kubelet deletes every socket in the directory first. So if
        ours was deleted, kubelet restarted: no handover wait, the kubelet that
        held our old sockets is gone and the new one has no client of ours that
        a late teardown could confuse. If ours is still there, the same kubelet
        re-created its socket and still holds our client: hand over as usual.
        """
        if self.state in (State.UNSERVED, State.STOPPING, State.STOPPED):
            return
        if self.call is not None:
            if self.call.started >= self.ctx.kubelet.since - OLD_KUBELET_MARGIN_S:
                return  # it dialled this kubelet (or fails at once): its outcome decides
            self.call.cancel()  # hanging on a kubelet that is gone
            self.call = None
        restarted = not any(s.socket_is_ours() for s in self._kubelet_held())
        if self.state in (State.REGISTERED, State.VERIFYING):
            how = "kubelet restarted" if restarted else "kubelet serves a new kubelet.sock"
            event(WARNING, "kubelet-restarted", f"{self.name}: {how}; registering again", resource=self.name)
            self.lost_at = now
        self.redo = None
        self.backoff.reset()
        self._attempt(now, "kubelet restarted" if restarted else "new kubelet.sock", wait=not restarted)

    def check_socket(self, now: float) -> None:
        """After a plugin-directory event: is the socket kubelet knows still ours?"""
        if self.current is None or self.current.socket_is_ours():
            return
        if self.state is State.REGISTERING:
            self.redo = "our socket was deleted"
        elif self.state in (State.REGISTERED, State.VERIFYING):
            event(WARNING, "registration-lost", f"{self.name}: lost registration: our socket {self.current.socket_path} was deleted", resource=self.name, socket=self.current.socket_path)
            self.lost_at = now
            self._attempt(now, "our socket was deleted")

    def nudge(self, now: float) -> None:
        """News from kubelet's directory: a retry that is waiting may go now."""
        if "retry" in self._timers:
            self._timers["retry"] = now

    def publish(self, snapshot: Snapshot, now: float) -> None:
        self.snapshot = snapshot
        for server in (self.current, self.standby):
            if server is not None:
                server.publish(snapshot)
        if self.state is State.REGISTERED:  # kubelet's count follows: look again soon
            self._mismatches = 0
            self._timers["check"] = now + CHECK_FIRST_S

    def reconfigure(self, device: Device, snapshot: Snapshot, now: float) -> None:
        """The resource's configuration changed on reload: serve it anew, handing over."""
        self.device = device
        self.snapshot = snapshot  # for the new sockets only: the old one serves the old device
        if self.standby is not None:
            self.standby.stop()
            self.standby = None
        if self.state is State.UNSERVED:
            return
        if self.state in (State.REGISTERED, State.VERIFYING):
            self.lost_at = now
        if self.call is not None:
            self.redo = "configuration changed"
        else:
            self._attempt(now, "configuration changed")

    def on_timer(self, now: float) -> None:
        for name in [n for n, at in self._timers.items() if at <= now]:
            self._timers.pop(name, None)
            getattr(self, "_timer_" + name)(now)

    def begin_stop(self, now: float) -> None:
        """SIGTERM: end our streams and give kubelet a moment to let go of them."""
        self._cancel_calls()
        if self.standby is not None:
            self.standby.stop()
            self.standby = None
        for server in self._kubelet_held():
            server.end_streams()
        self._timers = {"stop": now}
        self._handover_until = now + STOP_WAIT_S
        self.state = State.STOPPING

    @property
    def stopped(self) -> bool:
        return self.state in (State.STOPPED, State.UNSERVED)

    def close(self) -> None:
        """Stop every server now and remove our sockets."""
        self._close_all()
        self.state = State.STOPPED

    # --- events from gRPC threads (run on the loop through ctx.post) ---------------

    def on_stream_event(self, kind: str, server: PluginServer) -> None:
        now = time.monotonic()
        if kind == STREAM_REFUSED:
            self.refused_streams += 1
            if now - self._refused_said >= REFUSED_SAY_EVERY_S:  # a flood of them is one line a minute
                self._refused_said = now
                event(ERROR, "stream-refused", f"{self.name}: refused a ListAndWatch stream on {server.socket_path}: {STREAMS_PER_RESOURCE} already open for this resource ({self.refused_streams} refused so far)", resource=self.name, socket=server.socket_path)
            return
        if server is not self.current:
            return  # an old socket's stream, already handed over
        if kind == STREAM_OPENED:
            self._stream_open = True
            if self.state is State.VERIFYING:
                self._verified(now)
        elif kind == STREAM_ENDED:
            self._stream_open = False
            if self.state is State.REGISTERING:
                self.redo = "kubelet ended our stream"
            elif self.state in (State.VERIFYING, State.REGISTERED):
                event(WARNING, "stream-ended", f"{self.name}: kubelet ended our ListAndWatch stream; registering again", resource=self.name)
                self.lost_at = now
                stable = self.registered_at is not None and now - self.registered_at >= STABLE_AFTER_S
                if stable:
                    self.backoff.reset()
                self.state = State.WAITING
                self._timers["retry"] = now + (0.0 if stable else self.backoff.next())  # no hammering

    def on_register_done(self, call: RegisterCall, error: Optional[str]) -> None:
        call.close()
        if call is not self.call:
            return  # cancelled: a newer kubelet made it moot
        self.call = None
        now = time.monotonic()
        self._stop_retiring()  # kubelet has let go of them, or the wait ran out
        if error is not None:
            # A kubelet that appeared since the call began deserves a try at once.
            retry_now = self.ctx.kubelet.since > call.started
            self._failed(now, error, 0.0 if retry_now else self.backoff.next())
            return
        if self.redo is not None:
            why, self.redo = self.redo, None
            self._attempt(now, why)
            return
        self.state = State.VERIFYING
        if self._stream_open:
            self._verified(now)
        else:
            self._timers["verify"] = now + VERIFY_S

    def on_check_done(self, call: AllocatableCall, counted: Optional[dict], error: Optional[str]) -> None:
        call.close()
        if call is not self._check:
            return
        self._check = None
        if self.state is not State.REGISTERED:
            return
        now = time.monotonic()
        if error is not None:
            log.debug("%s: pod-resources did not answer: %s", self.name, error)
            self._timers["check"] = now + CHECK_EVERY_S
            return
        # kubelet lists only the IDs it holds healthy; 0 while we send Healthy means
        # it stopped counting us (stopped endpoint, disconnected, restored from its checkpoint).
        count = len(counted.get(self.name, ()))
        expected = len(self.snapshot.ids) if self.snapshot.healthy else 0
        self.kubelet_count = count
        if count == expected or expected == 0:
            self._mismatches = 0
            self._check_reregistrations = 0
            self._timers["check"] = now + CHECK_EVERY_S
            return
        self._mismatches += 1
        if self._mismatches < 2:
            self._timers["check"] = now + CHECK_CONFIRM_S
            return
        if self._check_reregistrations >= CHECK_MAX_REREGISTRATIONS:
            if self._mismatches == 2:
                event(WARNING, "not-counted", f"{self.name}: kubelet still lists {count} of our {expected} devices as allocatable after {CHECK_MAX_REREGISTRATIONS} registrations; no longer registering again for that (STATUS= keeps showing kubelet's count)", resource=self.name)
            self._timers["check"] = now + CHECK_EVERY_S
            return
        self._check_reregistrations += 1
        event(WARNING, "not-counted", f"{self.name}: kubelet does not count our devices (pod-resources lists {count} of {expected} as allocatable) although we are registered; registering again", resource=self.name)
        self.lost_at = now
        self._attempt(now, "kubelet does not count our devices")

    # --- timers ------------------------------------------------------------------------

    def _timer_retry(self, now: float) -> None:
        if self.state is State.WAITING:
            self.ctx.kubelet.refresh(created=False)
            self._attempt(now, self.last_error or "retry")

    def _timer_standby(self, now: float) -> None:
        if self.state not in (State.UNSERVED, State.STOPPING, State.STOPPED):
            self._ensure_standby()

    def _timer_handover(self, now: float) -> None:
        if self.state is not State.HANDOVER:
            return
        held = sockets.connections(s.bind_path for s in self.retiring)
        if held > 0 and now < self._handover_until:
            self._timers["handover"] = now + POLL_S
            return
        if held > 0 and self._settle_at is None:
            event(WARNING, "handover-timeout", f"{self.name}: kubelet still holds {held} connection(s) to our old socket after {HANDOVER_LIMIT_S:.0f} s; registering anyway", resource=self.name)
        elif held < 0:  # /proc/self/net/unix unreadable: a fixed wait instead
            log.debug("%s: cannot read /proc/self/net/unix; waiting %.1f s instead", self.name, 10 * SETTLE_S)
            if self._settle_at is None:
                self._settle_at = now + 10 * SETTLE_S
        if self._settle_at is None:
            self._settle_at = now + SETTLE_S
        if now < self._settle_at:
            self._timers["handover"] = self._settle_at
            return
        log.debug("%s: handover done after %.0f ms", self.name, (now - self._handover_until + HANDOVER_LIMIT_S) * 1000)
        self._register(now, self._handover_why)

    def _timer_verify(self, now: float) -> None:
        if self.state is not State.VERIFYING:
            return
        event(WARNING, "not-watched", f"{self.name}: kubelet accepted the registration of {os.path.basename(self.current.socket_path)} but opened no ListAndWatch within {VERIFY_S:.0f} s; registering again", resource=self.name)
        self.lost_at = now
        self._attempt(now, "kubelet never opened ListAndWatch")

    def _timer_check(self, now: float) -> None:
        if self.state is not State.REGISTERED or self._check is not None:
            return
        path = self.ctx.kubelet.pod_resources
        seen = os.path.exists(path)
        if seen != self.ctx.pod_resources_seen:
            if not seen:
                event(INFO, "pod-resources", f"kubelet's pod-resources API is not at {path}: not cross-checking that kubelet counts our devices")
            elif self.ctx.pod_resources_seen is False:
                event(INFO, "pod-resources", f"kubelet's pod-resources API is at {path}: cross-checking that kubelet counts our devices")
            self.ctx.pod_resources_seen = seen
        if not seen:
            self._timers["check"] = now + CHECK_EVERY_S
            return
        self._check = AllocatableCall(path, lambda c, result, error: self.ctx.post(partial(self.on_check_done, c, result, error)))

    def _timer_warn(self, now: float) -> None:
        if self.state is State.REGISTERED or self.registrations == 0 or self._failing_since is None:
            return
        took = now - self._failing_since
        event(WARNING, "still-unregistered", f"{self.name}: not registered with kubelet for {took:.0f} s: {self.last_error}", resource=self.name)
        self._timers["warn"] = now + WARN_EVERY_S

    def _timer_stop(self, now: float) -> None:
        held = sockets.connections(s.bind_path for s in self._kubelet_held())
        if held > 0 and now < self._handover_until:
            self._timers["stop"] = now + POLL_S
            return
        log.debug("%s: kubelet let go of our sockets after %.0f ms (%d still held)", self.name, (now - self._handover_until + STOP_WAIT_S) * 1000, max(held, 0))
        self._close_all()
        self.state = State.STOPPED

    # --- transitions -----------------------------------------------------------------

    def _attempt(self, now: float, why: str, wait: bool = True) -> None:
        """Register on a fresh socket. First the socket kubelet knew retires (its
        streams end) and, unless kubelet restarted (`wait` False), kubelet is
        given time to let go of it."""
        if self.call is not None:
            self.redo = why  # one Register in flight per resource
            return
        for name in ("retry", "verify", "check", "handover"):
            self._timers.pop(name, None)
        if self.current is not None:
            self.current.end_streams()
            self.retiring.append(self.current)
            self.current = None
            self._stream_open = False
        if not self.ctx.kubelet.serving:
            # Its creation event wakes us; the timer is for one that came before a
            # re-created directory was watched again.
            self._failed(now, "kubelet.sock does not exist yet", self.backoff.next())
            return
        log.debug("%s: registering (%s)", self.name, why)
        # Without `wait` the old servers are stopped once Register is on its way (on_register_done).
        if wait and (any(s.kubelet_connected for s in self.retiring) or sockets.connections(s.bind_path for s in self.retiring) > 0):
            self.state = State.HANDOVER
            self._handover_until = now + HANDOVER_LIMIT_S
            self._settle_at = None
            self._handover_why = why
            self._timers["handover"] = now + POLL_S
            return
        self._register(now, why, urgent=not wait)

    def _register(self, now: float, why: str, urgent: bool = False) -> None:
        """Put a fresh socket in place (so it cannot have been wiped) and Register it.

        The standby is kept for `urgent` Registers: a kubelet that just started admits
        pods within milliseconds. Others (a handover, a retry, perhaps against a dead
        kubelet's socket) bind a socket now, about 12 ms, and leave the standby ready."""
        if not self._promote(use_standby=urgent or self._n_registers == 0):
            return
        path = self.current.socket_path
        level = INFO if self.registrations == 0 and self._n_registers == 0 else DEBUG
        event(level, "serving", f"{self.name}: serving {self.device.count} units of {self.device.path} on {path}", resource=self.name, device=self.device.path, socket=path)
        self._n_registers += 1
        self.reasons[why] += 1
        self.state = State.REGISTERING
        self.call = RegisterCall(
            self.ctx.plugin_dir,
            self.name,
            os.path.basename(self.current.socket_path),
            lambda c, _result, error: self.ctx.post(partial(self.on_register_done, c, error)),
        )
        self._timers["standby"] = now  # the next socket, now that Register is on its way

    def _verified(self, now: float) -> None:
        self._timers.pop("verify", None)
        self._timers.pop("warn", None)
        self.state = State.REGISTERED
        self.registrations += 1
        self.registered_at = now
        self.last_error = self.error_since = self._failing_since = None
        self._mismatches = 0
        self._timers["check"] = now + CHECK_FIRST_S
        socket = os.path.basename(self.current.socket_path)
        if self.lost_at is not None:
            took = now - self.lost_at
            self.last_reregistration = (time.time(), took)
            self.lost_at = None
            event(INFO, "reregistered", f"{self.name}: registered again with kubelet ({took * 1000:.0f} ms after the loss), on {socket}", resource=self.name, socket=socket)
        elif self.registrations == 1:
            event(INFO, "registered", f"{self.name}: registered with kubelet ({self.device.count} units of {self.device.path}), on {socket}", resource=self.name, socket=socket)
        else:
            event(INFO, "reregistered", f"{self.name}: registered again with kubelet, on {socket}", resource=self.name, socket=socket)

    def _failed(self, now: float, reason: str, delay: float) -> None:
        self._waiting(now, reason)
        self._timers["retry"] = now + delay

    def _waiting(self, now: float, reason: str) -> None:
        self.state = State.WAITING
        if reason != self.last_error and self.registrations == 0:
            event(INFO, "waiting-for-kubelet", f"{self.name}: waiting for kubelet: {reason}", resource=self.name)
        else:  # retries, and the expected gaps of a restarting kubelet
            log.debug("%s: waiting for kubelet: %s", self.name, reason)
        self.last_error = reason
        if self._failing_since is None:
            self._failing_since = now
            self.error_since = time.time()
            if self.registrations > 0:
                self._timers["warn"] = now + WARN_AFTER_S

    # --- sockets ---------------------------------------------------------------------

    def _next_name(self) -> str:
        self._n += 1
        return sockets.socket_name(self.name, self.ctx.run_id, self._n)

    def _new_server(self, path: str) -> PluginServer:
        server = PluginServer(self.device, path, self.ctx.workers, self._slots, self._post_stream_event, self.allocations)
        server.publish(self.snapshot)
        server.start()
        return server

    def _post_stream_event(self, kind: str, server: PluginServer) -> None:
        self.ctx.post(partial(self.on_stream_event, kind, server))

    def _ensure_standby(self) -> bool:
        """Bind the next socket in the standby directory, where kubelet's wipe
        cannot reach it. False (and the reason logged) when nothing can be bound.
        Where that path would be too long for a unix socket, nothing is bound in
        advance: `_promote` binds in place, about 12 ms slower."""
        if self.standby is not None:
            return True
        directory = os.path.join(self.ctx.plugin_dir, sockets.STANDBY_DIR)
        path = os.path.join(directory, self._next_name())
        try:
            if len(os.fsencode(path)) > sockets.MAX_SOCKET_PATH:
                if not os.access(self.ctx.plugin_dir, os.W_OK):
                    raise OSError("cannot bind the socket: the directory is not writable")
                self._n -= 1
                return True
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.standby = self._new_server(path)
        except OSError as e:
            return self._serve_error(path, e)
        self.serve_error = None
        return True

    def _promote(self, use_standby: bool) -> bool:
        """Put the standby (or a socket bound now) in place."""
        server = None
        if use_standby:
            server, self.standby = self.standby, None
        try:
            if server is None:  # not urgent, or none ready: bind one in place
                server = self._new_server(os.path.join(self.ctx.plugin_dir, self._next_name()))
            else:
                server.move_to(os.path.join(self.ctx.plugin_dir, os.path.basename(server.bind_path)))
        except OSError as e:
            if server is not None:
                server.stop()
            return self._serve_error(self.ctx.plugin_dir, e)
        self.current = server
        self._stream_open = False
        return True

    def _serve_error(self, path: str, e: OSError) -> bool:
        self._close_all()
        self.state = State.UNSERVED
        if self.ctx.serve_failed(path, e):
            return False
        error = f"{self.name}: cannot serve on {path}: {e.strerror or e}"
        if self.serve_error is None:  # retried on every wake-up (each with a new name); said once
            event(ERROR, "serve-failed", error, resource=self.name, socket=path)
        else:
            log.debug("%s", error)
        self.serve_error = error
        # Retried on a timer too: a directory made writable again (a remount) raises no event.
        self._timers["standby"] = time.monotonic() + self.backoff.next()
        return False

    def _kubelet_held(self) -> List[PluginServer]:
        return [s for s in [self.current] + self.retiring if s is not None]

    def _stop_retiring(self) -> None:
        for server in self.retiring:
            server.stop()
        self.retiring = []

    def _cancel_calls(self) -> None:
        """Cancel our calls to kubelet; their outcomes, when they arrive, are ignored."""
        if self.call is not None:
            self.call.cancel()
            self.call = None
        if self._check is not None:
            self._check.cancel()
            self._check = None

    def _close_all(self) -> None:
        self._cancel_calls()
        for server in self._kubelet_held() + ([self.standby] if self.standby else []):
            server.stop()
        self.current, self.standby, self.retiring = None, None, []
        self._stream_open = False
        keep = {"standby"} if self.state is State.UNSERVED else set()
        self._timers = {k: v for k, v in self._timers.items() if k in keep}

    # --- reporting -------------------------------------------------------------------

    def describe(self) -> str:
        """This resource's part of STATUS=."""
        s = self.state
        if s is State.REGISTERED:
            healthy = len(self.snapshot.ids) if self.snapshot.healthy else 0
            text = f"registered, {healthy}/{self.device.count} healthy"
            if self.kubelet_count is not None and self.kubelet_count != healthy:
                text += f", kubelet counts {self.kubelet_count}"
            if self.last_reregistration:
                at, took = self.last_reregistration
                text += f", re-registered {time.strftime('%H:%M:%S', time.localtime(at))} in {took * 1000:.0f} ms"
        elif s in (State.REGISTERING, State.VERIFYING, State.HANDOVER):
            text = "registering with kubelet"
        elif s is State.UNSERVED:
            text = "not served" + (f": {self.serve_error.split(': ', 1)[1]}" if self.serve_error else "")
        else:
            text = "waiting for kubelet"
            if self.last_error and self.error_since is not None and self.registrations > 0:
                text += f" since {time.strftime('%H:%M:%S', time.localtime(self.error_since))}: {self.last_error}"
        if self.refused_streams:
            text += f", {self.refused_streams} stream(s) refused"
        return text
