"""One DRA process as decisions: its start, kubelet's calls, the node's slices, a reload's
handover, a stop. No I/O.

The daemon's loop (atedevd/dra/node.py) and the simulation (tests/simulation/dra) both run a
`Driver`: `handle(now, event)` is its one entry, and what the process must do comes back as
typed actions, which each side carries out by a table of types (`ACTIONS` lists them; a test
holds both tables to it). The publisher (atedevd/dra/publisher.py) keeps the slices, the
preparer (atedevd/dra/preparer.py) answers kubelet; the driver feeds them the devices and the
API server's reachability, and owns the process's life:

- a start reads the checkpoint before anything is answered;
- a SIGHUP with a good DRA file starts a successor that is handed the sockets kubelet dials
  (kubelet sees no change: no second registration, no window); once it serves them it says
  REGISTERED, we stop accepting (`Drain`), answer what we hold, make it main (`MainPid`,
  MAIN) and exit. A successor started by an atedevd that hands no sockets over binds its own
  and says REGISTERED once kubelet registered it (or kubelet is away for KUBELET_AWAY_S).
  The successor answers nothing until MAIN: then the checkpoint holds every claim we prepared;
- a SIGTERM stops accepting, answers what is held and exits; the sockets stay where systemd
  holds them for the next start (`Drain(remove=False)`), so kubelet's calls wait for it in
  the socket's backlog rather than failing.
"""

import logging
from typing import Dict, List, Optional, Sequence, Tuple, Union

from atedevd.dra import preparer as prep
from atedevd.dra import publisher as pub
from atedevd.dra.claims import Book
from atedevd.dra.slices import GONE, DraDevice, by_name
from atedevd.record import Record
from atedevd.registration.messages import Say
from atedevd.glue.notices import Ready, Reloading, StartSuccessor, Status
from atedevd.glue.resource_events import TimerDue
from atedevd.upgrade.machines import BecomeMain, Exit, MainPid, Message, Send, StopSuccessor

INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR
HANDOVER_LATEST_S = 30.0  # the successor serves by then, or it is stopped and we serve on
KUBELET_AWAY_S = 5.0  # a successor that bound its own sockets says REGISTERED by then, kubelet or not
UNSERVE_LATEST_S = 40.0  # what we hold is answered by then (a prepare waits 30 s for the API server)
HEALTH = {"healthy": 1, "unhealthy": 2}
DRA_MARK = "dra"  # what a DRA predecessor tells its successor it serves (atedevd.upgrade.peers.INHERITED)


# --- what the process tells it -------------------------------------------------------------------

class CheckpointRead(Record):
    """The checkpoint as found (None: there is none), or why it could not be read."""

    document: Optional[object]
    why: str = ""


class Looked(Record):
    """The devices judged present and allowed now, their CDI specs on disk."""

    devices: Tuple[DraDevice, ...]


class RegistrationSaid(Record):
    """kubelet's NotifyRegistrationStatus."""

    ok: bool
    error: str = ""


class KubeletDialed(Record):
    """kubelet connected to the service socket: it has the driver registered (perhaps before this run)."""


class Hangup(Record):
    """SIGHUP: the configuration file read again. `api`: its `[daemon] api` (None: it is bad, `error` says why)."""

    api: Optional[str]
    error: str = ""


class Terminate(Record):
    """SIGTERM or SIGINT."""

    signal: str


class SuccessorFailed(Record):
    """The successor could not be started, or ended before it served."""

    why: str


class Heard(Record):
    """The other process of a handover said `message` (None: it hung up)."""

    message: Optional[Message]


class Drained(Record):
    """The sockets are no longer served: every call that came through them is answered."""


DriverEvent = Union[CheckpointRead, Looked, RegistrationSaid, KubeletDialed, Hangup, Terminate, SuccessorFailed, Heard, Drained, TimerDue,
                    pub.PublisherEvent, prep.PreparerEvent]


# --- what it asks the process to do -------------------------------------------------------------------

class ReadCheckpoint(Record):
    """Read the checkpoint: `CheckpointRead`."""


class Drain(Record):
    """Stop accepting kubelet's connections and end those open once their calls are answered:
    `Drained`. `remove`: the socket files go too (kubelet forgets the driver); else they stay
    (held by systemd, or by the successor)."""

    remove: bool


class Resume(Record):
    """Accept kubelet's connections again (a successor that failed after we stopped)."""


class Health(Record):
    """Every device's health, to every health stream kubelet has open (the whole list)."""

    pool: str
    devices: Tuple[Tuple[str, int, str], ...]  # (device name, HEALTHY or UNHEALTHY, why)


class Stopping(Record):
    """`STOPPING=1`."""


DriverAction = Union[ReadCheckpoint, Status, Ready, Reloading, StartSuccessor, Drain, Resume, Health, Stopping, Exit, Send,
                     StopSuccessor, MainPid, BecomeMain, Say, pub.Connect, pub.ListSlices, pub.WriteSlices,
                     prep.ReadClaim, prep.WriteCheckpoint, prep.Answer]
ACTIONS: Tuple[type, ...] = DriverAction.__args__  # type: ignore[attr-defined]

_PUBLISHER = pub.PublisherEvent.__args__  # type: ignore[attr-defined]
_PREPARER = (prep.Asked, prep.ClaimRead, prep.ClaimNotRead, prep.CheckpointWritten)

MAIN, SUCCESSOR, HANDING_OVER, STOPPING = "main", "successor", "handing over", "stopping"


class Driver:
    """One DRA process. `successor`: started by a reload, to take over; `inherited`: handed the
    sockets kubelet dials (else it bound its own, and kubelet must register it)."""

    def __init__(self, node: Optional[str], successor: bool = False, inherited: bool = False) -> None:
        self.book = Book()
        self.publisher = pub.Publisher(node, publishing=not successor)
        self.preparer = prep.Preparer(self.book, opened=False)
        self.role = SUCCESSOR if successor else MAIN
        self.inherited = inherited
        self.registered = False
        self.devices: Dict[str, DraDevice] = {}  # judged present and allowed now
        self.seen: Dict[str, DraDevice] = {}  # every device this run judged so, as last seen
        self._gone_listed: Tuple[str, ...] = ()
        self.child_since: Optional[float] = None  # a successor of ours is starting (or serving, once unserved)
        self.unserving = False
        self.exit_code: Optional[int] = None
        self._told = False  # (a successor) REGISTERED sent
        self._started_at = 0.0
        self._unserve_since: Optional[float] = None
        self._health: Optional[Health] = None
        self._status: Optional[str] = None
        self._now = 0.0  # the time of the event being handled
        self._out: List[DriverAction] = []

    # --- the one entry ---------------------------------------------------------------------------

    def start(self, now: float) -> List[DriverAction]:
        """Called once the sockets are served. The checkpoint first: no call is answered before
        its claims are in the book. A successor reads it once its predecessor has let go; handed
        the sockets, it says at once that it serves them."""
        self._now = self._started_at = now
        if self.role is SUCCESSOR:
            if self.inherited:
                self._tell_registered()
        else:
            self._out.append(ReadCheckpoint())
        return self._take(now)

    def handle(self, now: float, event: DriverEvent) -> List[DriverAction]:
        self._now = now
        if isinstance(event, TimerDue):
            self._due(now)
        elif isinstance(event, _PUBLISHER):
            self._publisher(now, event)
        elif isinstance(event, _PREPARER):
            self._preparer(now, event)
        elif isinstance(event, Looked):
            self._looked(now, event.devices)
        elif isinstance(event, CheckpointRead):
            self._checkpoint_read(now, event)
        elif isinstance(event, RegistrationSaid):
            self._registration(event)
        elif isinstance(event, KubeletDialed) and not self.registered:
            self.registered = True  # (the sockets outlived the last run: kubelet registered the driver then)
            self._out.append(Say(INFO, "dra-registered", "kubelet is connected to the driver, registered before this "
                                                         "run: its sockets were kept"))
        elif isinstance(event, Hangup):
            self._hangup(event)
        elif isinstance(event, Terminate):
            self._terminate(now, event.signal)
        elif isinstance(event, SuccessorFailed):
            self._successor_failed(event.why)
        elif isinstance(event, Heard):
            self._heard(now, event.message)
        elif isinstance(event, Drained):
            self._unserved()
        return self._take(now)

    def deadline(self) -> Optional[float]:
        times = [self.publisher.deadline(), self.preparer.deadline()]
        if self.child_since is not None and not self.unserving:
            times.append(self.child_since + HANDOVER_LATEST_S)
        if self.role is SUCCESSOR and not self._told and not self.inherited:
            times.append(self._started_at + KUBELET_AWAY_S)
        if self._unserve_since is not None:
            times.append(self._unserve_since + UNSERVE_LATEST_S)
        found = [t for t in times if t is not None]
        return min(found) if found else None

    @property
    def idle(self) -> bool:
        """Nothing of its own is under way: no call unanswered, no question to the API server out."""
        return self.preparer.idle and not self.publisher.busy and self.child_since is None and not self.unserving

    # --- the parts ------------------------------------------------------------------------------------

    def _publisher(self, now: float, event) -> None:
        if isinstance(event, pub.SlicesChanged) and self.role in (SUCCESSOR, STOPPING):
            return  # (a successor publishes once main, after its predecessor's last word; one stopping, no more)
        was = self.publisher.connected
        for a in self.publisher.handle(now, event):
            if isinstance(a, pub.WriteSlices) and self.book.generation != self.publisher.generation:
                # The generation on disk first: a run after a crash and a wipe by kubelet carries on above it.
                self._out.append(prep.WriteCheckpoint(0, self.book.carry(self.publisher.generation)))
            self._out.append(a)
        if self.publisher.connected and not was:
            assert self.publisher.node is not None
            self._out += self.preparer.handle(now, prep.Reachable(self.publisher.node))
            self._health_now()

    def _preparer(self, now: float, event) -> None:
        if isinstance(event, prep.CheckpointWritten) and event.call == 0 and event.error:
            self._out.append(Say(ERROR, "dra-checkpoint", f"the pool's generation was not kept: {event.error}",
                                 once="dra-generation"))
        self._out += self.preparer.handle(now, event)
        if isinstance(event, prep.CheckpointWritten) and self._gone() != self._gone_listed:
            self._want(now)  # (a claim that held a gone device let go of it: the device leaves)

    def _looked(self, now: float, devices: Sequence[DraDevice]) -> None:
        self.devices = by_name(devices)
        self.seen.update(self.devices)
        self._out += self.preparer.handle(now, prep.Devices(self.devices))
        self._want(now)

    def _gone(self) -> Tuple[str, ...]:
        """The devices a prepared claim holds that are not there now."""
        return tuple(sorted(n for n in self.book.held() if n not in self.devices))

    def _want(self, now: float) -> None:
        """The slices list the devices there now and, tainted, each gone one a prepared claim
        still holds, as this run last saw it: the scheduler allocates it no more, and the slice
        says why. The health stream says the same."""
        self._gone_listed = self._gone()
        gone = tuple(self.seen[n]._replace(taint=GONE) for n in self._gone_listed if n in self.seen)
        self._out += self.publisher.handle(now, pub.Want(tuple(self.devices.values()) + gone))
        self._health_now()

    def _health_now(self) -> None:
        pool = self.publisher.node
        if pool is None:
            return
        entries = [(name, HEALTH["healthy"], "") for name in self.devices]
        entries += [(name, HEALTH["unhealthy"], "its device node is gone") for name in self._gone_listed]
        h = Health(pool, tuple(sorted(entries)))
        if h != self._health:
            self._health = h
            self._out.append(h)

    def _checkpoint_read(self, now: float, event: CheckpointRead) -> None:
        if event.why:
            self._out.append(Say(ERROR, "dra-checkpoint", f"prepared claims not read: {event.why}; claims kubelet "
                                                          "holds are read from the API server again"))
        elif event.document is not None:
            why = self.book.load(event.document)
            self.publisher.generation = max(self.publisher.generation, self.book.generation)
            if why:
                self._out.append(Say(ERROR, "dra-checkpoint", f"the checkpoint was not used: {why}"))
            elif self.role is MAIN:
                self._out.append(Say(INFO, "dra-checkpoint", f"{len(self.book.claims)} prepared claim(s) known "
                                                             "from the checkpoint"))
        if self.role is SUCCESSOR:  # (what our predecessor prepared: now we answer, and publish)
            self.role = MAIN
            self.publisher.publishing = True
            self._out.append(BecomeMain())
            self._out.append(Say(INFO, "reload", f"took over: {len(self.book.claims)} prepared claim(s) known"))
            self._want(now)
        self._out += self.preparer.handle(now, prep.Open())
        self._out.append(Ready())

    def _registration(self, event: RegistrationSaid) -> None:
        self.registered = event.ok
        if event.ok:
            self._out.append(Say(INFO, "dra-registered", "kubelet registered DRA driver ate.dev"))
            if self.role is SUCCESSOR and not self.inherited:
                self._tell_registered()
        else:
            self._out.append(Say(ERROR, "dra-registration", f"kubelet refused DRA driver ate.dev: {event.error}"))

    def _tell_registered(self) -> None:
        if not self._told:
            self._told = True
            self._out.append(Send(Message.REGISTERED))

    def _hangup(self, event: Hangup) -> None:
        if self.role is not MAIN or self.child_since is not None or self.unserving:
            return  # (a handover or a stop under way)
        if event.api is None:
            self._out.append(Say(ERROR, "reload", f"configuration not applied, still serving as before:\n{event.error}"))
            return
        if event.api != "dra":
            self._out.append(Say(WARNING, "reload", f'[daemon] api = "{event.api}": restarting into it (drain the node '
                                                    "first: docs/dra.md)"))
            self._stop(remove=True, why="restarting to apply the configuration")
            return
        self._out.append(Reloading())
        self._out.append(StartSuccessor((DRA_MARK,)))
        self.child_since = self._now
        self._out.append(Say(INFO, "reload", "configuration read: a successor takes over the sockets kubelet dials"))

    def _terminate(self, now: float, signal: str) -> None:
        if self.child_since is not None:
            self._out.append(StopSuccessor(kill=False))
            self.child_since = None
        if self.role is SUCCESSOR:
            self._out.append(Exit())  # (our predecessor serves on; nothing of ours was answered)
            self.exit_code = 0
            return
        self._stop(remove=False, why=f"stopping ({signal})")

    def _stop(self, remove: bool, why: str) -> None:
        if self.role is STOPPING:
            return
        self._out.append(Say(INFO, "stopping", why))
        self._out.append(Stopping())
        self.role = STOPPING
        self._unserve(remove)

    def _unserve(self, remove: bool) -> None:
        if not self.unserving:
            self.unserving = True
            self._unserve_since = self._now
            self._out.append(Drain(remove))

    def _successor_failed(self, why: str) -> None:
        if self.child_since is None:
            return
        self.child_since = None
        self._out.append(Say(ERROR, "reload", f"the successor {why}; still serving as before"))
        if self.unserving and self.role is HANDING_OVER:
            self.role = MAIN
            self.unserving, self._unserve_since = False, None
            self._out.append(Resume())
        self._out.append(Ready())

    def _heard(self, now: float, message: Optional[Message]) -> None:
        if self.role is SUCCESSOR:
            if message is Message.MAIN or message is None:
                self._out.append(ReadCheckpoint())  # (then BecomeMain, and the calls are answered)
            return
        if self.child_since is None:
            return
        if message is None:
            self._successor_failed("ended before it served")
        elif message is Message.REGISTERED and self.role is MAIN:
            self.role = HANDING_OVER
            self._unserve(remove=False)  # (they are the successor's too now)
            self._out.append(Say(INFO, "reload", "the successor serves; answering what we hold, then handing over"))

    def _unserved(self) -> None:
        if not self.unserving:
            return
        self._unserve_since = None
        if self.role is HANDING_OVER:
            self._out.append(MainPid())
            self._out.append(Send(Message.MAIN))
            self._out.append(Say(INFO, "stopping", "handed over to the successor"))
            self._exit(0)
        elif self.role is STOPPING:
            self._exit(0)

    def _exit(self, code: int) -> None:
        self.exit_code = code
        self._out.append(Exit())

    def _due(self, now: float) -> None:
        self._out += self.publisher.handle(now, TimerDue())
        self._out += self.preparer.handle(now, TimerDue())
        if self.child_since is not None and not self.unserving and now >= self.child_since + HANDOVER_LATEST_S:
            self._out.append(StopSuccessor(kill=True))
            self._successor_failed(f"did not serve within {HANDOVER_LATEST_S:.0f} s: stopped it")
        if self.role is SUCCESSOR and not self._told and not self.inherited and now >= self._started_at + KUBELET_AWAY_S:
            self._tell_registered()  # kubelet is away: nothing calls either of us
        if self._unserve_since is not None and now >= self._unserve_since + UNSERVE_LATEST_S:
            self._out.append(Say(ERROR, "stopping", f"calls still unanswered after {UNSERVE_LATEST_S:.0f} s: leaving "
                                                    "them (kubelet asks again)"))
            self._unserved()

    # --- the status line --------------------------------------------------------------------------

    def status(self) -> str:
        kubelet = "registered with kubelet" if self.registered else "waiting for kubelet"
        p = self.publisher
        if p.problem:
            slices_text = f"slices not published ({p.problem[:120]})"
        elif p.published is None:
            slices_text = "slices not published yet"
        else:
            slices_text = f"{len(p.published)} device(s) published, generation {p.generation}"
        return (f"DRA: {kubelet}; {len(self.devices)} device(s) judged present; {slices_text}; "
                f"{len(self.book.claims)} claim(s) prepared")

    def _take(self, now: float) -> List[DriverAction]:
        status = self.status()
        if status != self._status and self.role is not SUCCESSOR:
            self._status = status
            self._out.append(Status(status))
        out, self._out = self._out, []
        return out
