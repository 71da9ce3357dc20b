"""What goes into the registration machine and what comes out: typed values only.

Events go in through `Registration.handle(now, event)`, actions come out of
`Registration.take()`, and the performer carries each action out by its type
(`atedevd/glue/performer.py`; the simulation's fakes sit beneath that performer).
Every enum here is a bounded set: the metrics' labels are their values, so a
reworded log line can never change a series.
"""

import enum
from typing import Optional, Tuple

from atedevd.record import Record


class State(enum.Enum):
    """Where one resource's registration stands (the metrics' `state` label)."""

    UNSERVED = "unserved"  # nothing bound: not advertised, no directory, or binding fails
    WAITING = "waiting"  # kubelet not serving, or a retry is due
    LETTING_GO = "letting-go"  # waiting for kubelet to let go of an old socket of ours
    REGISTERING = "registering"  # a socket being put in place, or Register in flight
    VERIFYING = "verifying"  # Register returned OK; waiting for kubelet's ListAndWatch
    REGISTERED = "registered"  # kubelet streams our devices (and counts them, where we can see)
    YIELDING = "yielding"  # an upgrade: streams ended for the successor, waiting for kubelet to let go
    YIELDED = "yielded"  # kubelet let go: the successor registers (we take it back if it fails)
    STOPPING = "stopping"  # SIGTERM: streams ended, waiting for kubelet to let go
    STOPPED = "stopped"


class Why(enum.Enum):
    """Why a registration was begun: the metrics' `reason` label, and the journal's words."""

    FIRST = "first-registration"
    KUBELET_RESTARTED = "kubelet-restarted"
    NEW_KUBELET_SOCKET = "kubelet-socket-recreated"
    SOCKET_DELETED = "socket-deleted"
    STREAM_ENDED = "stream-ended"
    CONFIG_CHANGED = "config-changed"
    NOT_WATCHED = "not-watched"
    NOT_COUNTED = "not-counted"
    UPGRADE = "upgrade"  # a successor's first registration, after its predecessor (atedevd/upgrade/machines.py)
    TAKEN_BACK = "taken-back"  # the successor failed: its predecessor registers again
    RETRY = "retry"  # the attempt before failed (its error is the tally's `last_error`)

    @property
    def text(self) -> str:
        return _WHY_TEXT[self]


_WHY_TEXT = {
    Why.FIRST: "first registration",
    Why.KUBELET_RESTARTED: "kubelet restarted",
    Why.NEW_KUBELET_SOCKET: "new kubelet.sock",
    Why.SOCKET_DELETED: "our socket was deleted",
    Why.STREAM_ENDED: "kubelet ended our stream",
    Why.CONFIG_CHANGED: "configuration changed",
    Why.NOT_WATCHED: "kubelet never opened ListAndWatch",
    Why.NOT_COUNTED: "kubelet does not count our devices",
    Why.UPGRADE: "an upgrade: after the atedevd it replaces",
    Why.TAKEN_BACK: "the new atedevd failed",
    Why.RETRY: "retry",
}


class Outcome(enum.Enum):
    """How a Register call ended."""

    OK = "ok"
    REFUSED = "refused"  # nobody accepts connections on kubelet.sock
    FAILED = "failed"  # kubelet answered with an error, or did not answer


class Listing(enum.Enum):
    """How a pod-resources `GetAllocatableResources` call ended."""

    LISTED = "listed"  # answered: `count` of our devices are allocatable
    ABSENT = "absent"  # kubelet serves no pod-resources API (or not that call)
    REFUSED = "refused"  # nobody accepts connections: kubelet is not serving
    EXHAUSTED = "exhausted"  # kubelet's rate limit refused it (ResourceExhausted): ask again later
    FAILED = "failed"  # any other error


class Timer(enum.Enum):
    """The machine's named timers (`Registration.get_timer()` is the earliest)."""

    RETRY = "retry"  # register again, or send the refused Register again
    STANDBY = "standby"  # bind the next standby socket
    SERVE = "serve"  # binding failed: try serving again
    LET_GO = "let-go"  # the next step of waiting for kubelet to let go
    VERIFY = "verify"  # kubelet's ListAndWatch should have opened by now
    CHECK = "check"  # ask pod-resources whether kubelet counts our devices
    ASK = "ask"  # pod-resources refused a question for its rate limit: ask it again
    WARN = "warn"  # still not registered: say so


class Event(Record):
    """What happened: every event the machine takes (`Registration.handle`) is one."""


class Action(Record):
    """What to do: every action the machine asks for (`Registration.take`) is one."""


# --- events: what happened --------------------------------------------------------------


class Serve(Event):
    """The device is advertised and the plugin directory exists. `kubelet_at`: when the
    kubelet.sock there now appeared, if one is there. `on_hold`: a successor's, bound but not
    registered until `Release` (its predecessor still serves)."""

    kubelet_up: bool
    kubelet_at: Optional[float] = None
    on_hold: bool = False


class Release(Event):
    """A successor's: its predecessor let go (or registers beside it): register now."""


class Yield(Event):
    """A predecessor's: a successor is ready; end our streams, wait until kubelet let go."""


class TakeBack(Event):
    """A predecessor's: the successor failed; register again."""


class RegisterAgain(Event):
    """A predecessor's, some time after a take-back: a Register of the failed successor may
    have reached kubelet (<= 1.36) after ours, unseen, and stopped our endpoint by name when
    it was torn down; a registration of ours made after that is safe."""


class Unserve(Event):
    """The plugin directory is gone: nothing can be served until it is back."""

    why: str


class Publish(Event):
    """A new device table went to our sockets: `units`, `healthy_units` of them Healthy. kubelet
    learns it on the open stream: no new registration."""

    units: int
    healthy_units: int


class Reconfigure(Event):
    """The resource's configuration changed on reload: serve it anew, handing over."""

    units: int
    healthy_units: int


class Stop(Event):
    """SIGTERM: end our streams and wait until kubelet has let go of them (bounded).
    `replaced`: the exit after an upgrade, our successor registered: what kubelet lists
    is its, and nothing of ours can undo its registration (kubelet had let go of us, or
    tracks endpoints per socket), so only a Register in flight is waited for."""

    replaced: bool = False


class CloseAll(Event):
    """Stop every socket now (exit, or the resource is no longer configured)."""


class KubeletCreated(Event):
    """A new kubelet.sock, created at `at`. `ours_present`: a socket of ours kubelet may
    hold is still in the directory (a starting kubelet deletes them all first)."""

    at: float
    ours_present: bool


class KubeletGone(Event):
    """kubelet.sock was deleted."""


class SocketDeleted(Event):
    """A socket file of ours was deleted (kubelet's wipe, or someone else)."""

    sid: int


class Nudge(Event):
    """News from kubelet's directory: a retry that waits may go now."""


class Bound(Event):
    """The outcome of `Bind`: None, or the error."""

    sid: int
    error: Optional[str] = None


class Placed(Event):
    """The outcome of `Place`: None, or the error."""

    sid: int
    error: Optional[str] = None


class StreamOpened(Event):
    """kubelet opened its ListAndWatch stream on `sid`."""

    sid: int


class ListSent(Event):
    """kubelet has `sid`'s first device list (gRPC asked for the next message)."""

    sid: int


class StreamEnded(Event):
    """kubelet ended its ListAndWatch stream on `sid` (not we)."""

    sid: int


class StreamRefused(Event):
    """A ListAndWatch stream beyond the resource's budget was refused."""

    sid: int
    limit: int
    where: str


class RegisterDone(Event):
    """The outcome of `SendRegister` `cid`; `error`: kubelet's words, when not OK."""

    cid: int
    outcome: Outcome
    error: str = ""


class Listed(Event):
    """The outcome of `AskPodResources` `cid`: how many of our devices kubelet lists."""

    cid: int
    listing: Listing
    devices: int = 0


class ConnectionsCounted(Event):
    """The outcome of `CountConnections`: kubelet's connections still open to those
    sockets, None when our descriptors cannot show them. `watched`: the host wakes us
    with `HungUp` when kubelet hangs one of them up."""

    held: Optional[int]
    watched: bool = False


class HungUp(Event):
    """kubelet hung up a connection to a socket whose connections were counted (the host
    watches the ones it counted): count again."""


# --- actions: what to do ------------------------------------------------------------------


class Bind(Action):
    """Serve a new socket: in the standby directory, or in kubelet's directory."""

    sid: int
    standby: bool


class Place(Action):
    """Rename the standby socket into kubelet's directory."""

    sid: int


class SendRegister(Action):
    """Register the socket `sid` with kubelet; the outcome comes back as `RegisterDone`."""

    cid: int
    sid: int


class AskPodResources(Action):
    """Ask pod-resources how many of our devices kubelet lists: `Listed`."""

    cid: int


class CountConnections(Action):
    """Count kubelet's open connections to these sockets: `ConnectionsCounted`."""

    sids: Tuple[int, ...]


class CancelCall(Action):
    """Cancel a call; its outcome, if it still comes, is ignored."""

    cid: int


class EndStreams(Action):
    """End the ListAndWatch streams on `sid`."""

    sid: int


class ResendList(Action):
    """Send the device list again on `sid`'s streams."""

    sid: int


class CloseSocket(Action):
    """Stop serving `sid` and remove its socket file."""

    sid: int


class Say(Action):
    """A journal line; `once`: a key said at most once per daemon."""

    level: int
    kind: str
    text: str
    once: Optional[str] = None
