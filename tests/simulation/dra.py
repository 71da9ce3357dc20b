"""DRA mode under simulation: a node whose atedevd serves kubelet's DRA side, on a simulated clock.

atedevd here is atedevd's own code: each process's `Driver` (atedevd/dra/driver.py: the publisher,
the preparer, the handover, the stop) and its `Look` (atedevd/dra/look.py: the device-plugin
mode's tables judging real nodes in a dev root of this process's own, the CDI keeper writing real
specs). Each process carries out its driver's actions by a table of types (`_DO`, held to
`driver.ACTIONS` as the daemon's is). What the simulation replaces is the I/O beneath, every step
of it a random delay: the two socket files kubelet dials and the listening socket behind them
(held by the process serving it, by systemd's store, by a reload's successor), kubelet's
connection and its calls, the API server (slices, claims, the watch), the checkpoint file.

kubelet's DRA side is rig/dra_kubelet_model.py's `PluginManager`, the model the stand-in runs,
with kubelet's pod sync around it: a pod whose prepare failed is tried again only at its next
resync (60-90 s), an unprepare that failed at the next reconcile (60 s). A scheduler allocates
each pod's claim from the slices the API server lists: the shareable `kvm` to any number of
claims, a pattern unit to one claim at a time.

After every event (`stepped`) the world holds atedevd to what must hold at every moment: no
claim kubelet holds as prepared is missing from the checkpoint on disk (a restart, a crash or a
handover knows it), no pattern unit is held by two claims kubelet holds, a claim asked again is
answered as before, the pool's generation on the server never goes back, and whenever the main
process has nothing under way the slices list exactly the devices there now (tainted: a gone one
a claim still holds). `end_state` adds what must hold once the node settles.
"""

import itertools
import os
from typing import Callable, Dict, List, Optional, Set, Tuple

from atedevd.config import Config, Device
from atedevd.dra import driver as d
from atedevd.dra import preparer as prep
from atedevd.dra import publisher as pub
from atedevd.dra.claims import ClaimRef
from atedevd.dra.look import Look
from atedevd.dra.node import LOOK_EVERY_S
from atedevd.dra.slices import DRIVER, GONE, device_name
from atedevd.glue.notices import Ready, Reloading, StartSuccessor, Status
from atedevd.glue.resource_events import TimerDue
from atedevd.registration.messages import Say
from atedevd.upgrade.machines import BecomeMain, Exit, MainPid, Send, StopSuccessor
from rig.dra_kubelet_model import PREFACE_WAIT_S, RESYNC_S, Info, PluginManager
from tests.simulation.clock import SimClock
from tests.simulation.world import cdi_dir, dev_root

NODE = "node-a"
KVM = "ate.dev/kvm"
UNIT = "ate.dev/unit"
UNITS = 4
RECONCILE_S = 60.0  # kubelet's DRA reconcile: an unprepare that failed is tried again then
CONNECT_BACKOFF_S = (1.0, 1.6, 120.0)  # gRPC's reconnect back-off: first, factor, most
VERSIONS = ("1.34", "1.36", "1.37")


# --- the API server ---------------------------------------------------------------------------------

class ApiServer:
    """The slices, the claims and the watch, as the API server keeps them; every call a step."""

    def __init__(self, w: "DraWorld") -> None:
        self.w = w
        self.slices: Dict[str, dict] = {}
        self.claims: Dict[str, dict] = {}  # by UID
        self.version = 0
        self.down_until = -1.0
        self.writes: List[float] = []  # when each slice write was applied
        self.highest = 0  # the highest pool generation ever written
        self.watching = 0  # watch events on their way to a process

    @property
    def down(self) -> bool:
        return self.w.now < self.down_until

    def ask(self, who: "SimDra", work: Callable[[], object], failed: Callable[[str], object]) -> None:
        """A question of a process, answered a step later (an error while the server is down)."""
        def answer():
            if who.alive:
                who.event(failed("connection refused") if self.down else work())
        self.w.after(self.w.delay(), answer)

    def listed(self) -> Tuple[dict, ...]:
        return tuple(dict(s) for s in self.slices.values() if s["spec"]["nodeName"] == NODE)

    def write(self, a: pub.WriteSlices) -> object:
        for doc in a.creates:
            if doc["metadata"]["name"] in self.slices:
                return pub.ApiFailed(f"HTTP 409 {doc['metadata']['name']} exists")
        for doc, version in a.replaces:
            now = self.slices.get(doc["metadata"]["name"])
            if now is None or now["metadata"]["resourceVersion"] != version:
                return pub.ApiFailed(f"HTTP 409 {doc['metadata']['name']} changed")
        docs = list(a.creates) + [doc for doc, _ in a.replaces]
        generation = docs[0]["spec"]["pool"]["generation"] if docs else self.highest + 1
        if generation <= self.highest:
            self.w.problem(f"the pool's generation went back: {generation} written, {self.highest} before")
        self.highest = max(self.highest, generation)
        for doc in docs:
            self.version += 1
            self.slices[doc["metadata"]["name"]] = {**doc, "metadata": {**doc["metadata"], "resourceVersion": str(self.version)}}
        for name in a.deletes:
            self.slices.pop(name, None)
        self.writes.append(self.w.now)
        self.changed()
        return pub.Written()

    def wipe(self) -> None:
        """kubelet's: every slice of the node (at its start), or of the driver (30 s after it went)."""
        if any(s["spec"]["nodeName"] == NODE for s in self.slices.values()):
            self.slices = {n: s for n, s in self.slices.items() if s["spec"]["nodeName"] != NODE}
            self.w.note("kubelet", "wipes the node's slices")
            self.changed()

    def changed(self) -> None:
        """The watch of every process that watches tells it, a step later."""
        for p in self.w.processes:
            if p.driver.publisher.connected:
                self.watching += 1
                self.w.after(self.w.delay(), self._tell, p)
        self.w.scheduler_look()

    def _tell(self, p: "SimDra") -> None:
        self.watching -= 1
        if p.alive:
            p.event(pub.SlicesChanged())

    def devices(self) -> Dict[str, dict]:
        """The node's devices as the scheduler reads them: untainted, by name."""
        return {dev["name"]: dev for s in self.slices.values() if s["spec"]["nodeName"] == NODE
                for dev in s["spec"]["devices"] if not dev.get("taints")}


# --- the sockets kubelet dials ---------------------------------------------------------------------

class Listener:
    """The listening socket behind the two files: who holds it, who accepts on it, what waits."""

    def __init__(self, inode: int) -> None:
        self.inode = inode
        self.holders: Set[object] = set()  # processes, and "store"
        self.accepting: List["SimDra"] = []
        self.backlog: List[Callable[["SimDra"], None]] = []  # connections waiting to be accepted

    @property
    def alive(self) -> bool:
        return bool(self.holders)


class Sockets:
    """The registration and service socket files (one inode for both: they come and go together)."""

    def __init__(self, w: "DraWorld") -> None:
        self.w = w
        self.inode: Optional[int] = None  # the files' (None: no files)
        self.listener: Optional[Listener] = None
        self.store: Optional[Listener] = None  # what systemd's store keeps (with `store`)
        self._inodes = itertools.count(1)

    def bind(self, p: "SimDra") -> Listener:
        """New files and a new listening socket (kubelet sees the registration socket made anew)."""
        if self.listener is not None:
            self.listener.holders.discard(p)
        self.inode = next(self._inodes)
        self.listener = Listener(self.inode)
        self.listener.holders.add(p)
        self.w.kubelet.files_changed(removed=True, created=True)
        return self.listener

    def remove(self) -> None:
        self.inode = None
        if self.store is not None:
            self.store.holders.discard("store")
            self.store = None
        self.w.kubelet.files_changed(removed=True, created=False)

    def connect(self, then: Callable[["SimDra"], None]) -> bool:
        """A connection to the files: False if refused (nobody listens there); else `then(process)`
        once a process accepts it, now or later."""
        l = self.listener
        if self.inode is None or l is None or not l.alive or l.inode != self.inode:
            return False
        if l.accepting:
            self.w.after(self.w.delay() * 0.01, then, self.w.rng.choice(l.accepting))
        else:
            l.backlog.append(then)
        return True

    def accepting(self, p: "SimDra", on: bool) -> None:
        l = p.listener
        if l is None:
            return
        if on and p not in l.accepting:
            l.accepting.append(p)
            waiting, l.backlog = l.backlog, []
            for then in waiting:
                self.w.after(self.w.delay() * 0.01, then, p)
        elif not on and p in l.accepting:
            l.accepting.remove(p)


# --- kubelet ------------------------------------------------------------------------------------------

class Pod:
    __slots__ = ("name", "kind", "claim", "state", "device", "sync_at", "created_at", "failures", "deleted")

    def __init__(self, name: str, kind: str, created_at: float) -> None:
        self.name, self.kind, self.created_at = name, kind, created_at
        self.claim: Optional[str] = None  # its claim's UID, once allocated
        self.device: Optional[str] = None
        self.state = "pending"  # pending (unscheduled), scheduled, bound, preparing, running, unpreparing, gone
        self.sync_at: Optional[float] = None
        self.failures = 0  # prepares that failed (kubelet tried again at a later sync)
        self.deleted = False


class SimKubelet:
    """kubelet's DRA side: the model's plugin manager, the connection, the calls, the pods."""

    def __init__(self, w: "DraWorld", version: str) -> None:
        self.w = w
        self.version = version
        self.pm = PluginManager(version)
        self.incarnation = 0
        self.running = False
        self.conn: Optional["SimDra"] = None  # the process its connection is to
        self.connecting = False  # a connection waits to be accepted
        self.failed_until = -1.0  # the connection failed: calls fail at once until then
        self.backoff = CONNECT_BACKOFF_S[0]
        self.waiting: List[Tuple[str, tuple, Callable]] = []  # calls waiting for the connection
        self.in_flight: Dict[int, Tuple["SimDra", str, tuple, Callable]] = {}
        self.prepared: Dict[str, tuple] = {}  # claim UID -> the devices it was answered (what kubelet holds)
        self.pods: List[Pod] = []
        self.registrations = 0
        self._calls = itertools.count(1)
        self._reg_pending = False

    # the process

    def start(self) -> None:
        if self.running:
            self.kill()  # (one kubelet process at a time: a start while one runs is a restart)
        self.incarnation += 1
        inc = self.incarnation
        self.running = True
        self.pm = PluginManager(self.version)
        self.conn, self.connecting, self.waiting = None, False, []
        self._reg_pending = False  # (one the last process scheduled is its own)
        self.w.note("kubelet", f"#{inc} starts")
        self.w.after(self.w.delay(), lambda: self.running and self.incarnation == inc and self.w.api.wipe())
        if self.w.sockets.inode is not None:
            self._register_soon()
        for pod in self.pods:
            if pod.state in ("bound", "preparing", "running", "unpreparing"):
                self._sync_at(pod, self.w.delay())
        self.w.after(1.0, self._tick, inc)

    def kill(self) -> None:
        if not self.running:
            return
        self.running = False
        self.w.note("kubelet", f"#{self.incarnation} killed")
        self.in_flight.clear()  # (their answers reach no one)
        self.waiting = []
        self.conn, self.connecting = None, False
        for pod in self.pods:
            if pod.state == "preparing":
                pod.state = "bound"
            if pod.state == "unpreparing":
                pod.state = "running"

    def _tick(self, inc: int) -> None:
        if not self.running or inc != self.incarnation:
            return
        for _ in self.pm.wipes_due(self.w.now):
            self.w.api.wipe()
        self.w.after(1.0, self._tick, inc)

    # the plugin watcher

    def files_changed(self, removed: bool, created: bool) -> None:
        """fsnotify on plugins_registry: a Remove deregisters, a Create registers (a step later)."""
        if not self.running:
            return
        if removed:
            for i in self.pm.deregister(self.w.now, "reg"):
                self.w.note("kubelet", f"deregisters {i}")
            self.conn, self.connecting = None, False
        if created:
            self._register_soon()

    def _register_soon(self) -> None:
        if not self._reg_pending:
            self._reg_pending = True
            self.w.after(self.w.delay(), self._register, self.incarnation, 0.5)

    def _register(self, inc: int, backoff: float) -> None:
        self._reg_pending = False
        if not self.running or inc != self.incarnation or self.w.sockets.inode is None:
            return
        inode = self.w.sockets.inode

        def got_info(p: "SimDra") -> None:
            if not self.running or inc != self.incarnation or self.w.sockets.inode != inode or not p.alive:
                return
            instance, why = self.pm.register(self.w.now, "reg", Info("DRAPlugin", DRIVER, "dra.sock",
                                                                     ("v1.DRAPlugin", "v1beta1.DRAPlugin")))
            self.registrations += instance is not None
            self.w.note("kubelet", f"registers {instance or why}")
            self.w.after(self.w.delay(), lambda: p.alive and p.event(d.RegistrationSaid(instance is not None, why)))
            self._connect()
        if not self.w.sockets.connect(got_info) and self.version != "1.34":
            self._reg_pending = True  # refused: tried again (1.34 does not)
            self.w.after(backoff, self._register, inc, min(backoff * 2, 122.0))

    # the connection to the service socket

    def _connect(self) -> None:
        instance = self.pm.chosen(DRIVER)
        if instance is None or self.conn is not None or self.connecting:
            return
        inc = self.incarnation

        def accepted(p: "SimDra") -> None:
            if not self.running or inc != self.incarnation or not self.connecting:
                return
            self.connecting = False
            if not p.alive:
                self._lost()
                return
            self.conn, self.backoff = p, CONNECT_BACKOFF_S[0]
            waiting, self.waiting = self.waiting, []
            for kind, claims, back in waiting:
                self._send(kind, claims, back)
        if self.w.sockets.connect(accepted):
            self.connecting = True
            self.pm.connection(self.w.now, instance, True)  # (connected: connect() succeeded)
            self.w.after(PREFACE_WAIT_S, self._preface_timeout, inc)
        else:
            self.pm.connection(self.w.now, instance, False)
            self.failed_until = self.w.now + self.backoff
            self.w.after(self.backoff, self._retry, inc)
            self.backoff = min(self.backoff * CONNECT_BACKOFF_S[1], CONNECT_BACKOFF_S[2])
            self._fail_waiting("connection refused")

    def _preface_timeout(self, inc: int) -> None:
        if self.running and inc == self.incarnation and self.connecting:
            self.connecting = False
            self._fail_waiting("no answer from the server in 20 s")
            self._lost()

    def _retry(self, inc: int) -> None:
        if self.running and inc == self.incarnation and self.conn is None and not self.connecting:
            self._connect()

    def _lost(self) -> None:
        """The connection ended: kubelet dials again at once."""
        self.conn = None
        instance = self.pm.chosen(DRIVER)
        if instance is not None:
            self.pm.connection(self.w.now, instance, False)
        self._connect()

    def process_gone(self, p: "SimDra") -> None:
        """A process died or exited: calls on its connection fail, kubelet dials again."""
        for call, (q, kind, claims, back) in list(self.in_flight.items()):
            if q is p:
                del self.in_flight[call]
                back(None, "Unavailable: the connection was closed")
        if self.conn is p:
            self._lost()

    def going_away(self, p: "SimDra") -> None:
        """GOAWAY from `p`: no new call on that connection; the next goes on a new one."""
        if self.conn is p:
            self.conn = None
            self._connect()

    def _fail_waiting(self, why: str) -> None:
        waiting, self.waiting = self.waiting, []
        for _, _, back in waiting:
            back(None, why)

    # the calls

    def call(self, kind: str, claims: Tuple[ClaimRef, ...], back: Callable) -> None:
        """A prepare or unprepare: `back(outcomes, "")` or `back(None, why it failed)`."""
        if self.pm.chosen(DRIVER) is None:
            back(None, "DRA driver ate.dev is not registered")
            return
        if self.conn is not None and self.conn.alive and self.conn.accepting_calls():
            self._send(kind, claims, back)
        elif self.now_failing():
            back(None, "Unavailable: connection refused")
        else:
            self.waiting.append((kind, claims, back))
            self._connect()

    def now_failing(self) -> bool:
        return self.w.now < self.failed_until and not self.connecting

    def _send(self, kind: str, claims: tuple, back: Callable) -> None:
        p = self.conn
        assert p is not None
        n = next(self._calls)
        self.in_flight[n] = (p, kind, claims, back)
        self.w.after(self.w.delay() * 0.1, p.kubelet_asks, n, kind, claims)

    def answered(self, p: "SimDra", n: int, outcomes: Dict[str, prep.ClaimOutcome]) -> None:
        got = self.in_flight.pop(n, None)
        if got is not None and got[0] is p:
            got[3](outcomes, "")

    # the pods

    def _sync_at(self, pod: Pod, delay: float) -> None:
        at = self.w.now + delay
        if pod.sync_at is None or at < pod.sync_at or pod.sync_at <= self.w.now:
            pod.sync_at = at
            self.w.after(delay, self._sync, pod, at)

    def _sync(self, pod: Pod, at: float) -> None:
        if pod.sync_at != at or not self.running:
            return
        pod.sync_at = None
        if pod.deleted and pod.state in ("running", "bound"):
            self._unprepare(pod)
        elif pod.state == "bound":
            self._prepare(pod)

    def bound(self, pod: Pod) -> None:
        """The scheduler's binding reached kubelet."""
        pod.state = "bound"
        self._sync_at(pod, self.w.delay())

    def delete(self, pod: Pod) -> None:
        pod.deleted = True
        if pod.state == "pending":
            pod.state = "gone"
        elif pod.state == "scheduled":
            pass  # (kubelet sees it once bound, deleted: it unprepares what was allocated)
        elif pod.state in ("running", "bound"):
            self._sync_at(pod, self.w.delay())

    def _prepare(self, pod: Pod) -> None:
        pod.state = "preparing"
        self.w.note("kubelet", f"{pod.name}: prepare {pod.claim}")
        ref = self.w.claim_ref(pod)
        inc = self.incarnation

        def back(outcomes, why):
            if inc != self.incarnation or pod.state != "preparing":
                return
            o = (outcomes or {}).get(ref.uid)
            if o is None or o.error:
                pod.state, pod.failures = "bound", pod.failures + 1
                self.w.note("kubelet", f"prepare of {pod.name} failed: {why or (o.error if o else 'no answer')}")
                self._sync_at(pod, self.w.rng.uniform(*RESYNC_S))
                return
            before = self.prepared.get(ref.uid)
            if before is not None and before != o.devices:
                self.w.problem(f"claim {ref.uid} answered {o.devices}, before {before}")
            self.prepared[ref.uid] = o.devices
            self.w.note("kubelet", f"{pod.name}: {ref.uid} prepared")
            pod.state = "running"
            self.w.stepped()
            if pod.deleted:
                self._sync_at(pod, self.w.delay())
        self.call(prep.PREPARE, (ref,), back)

    def _unprepare(self, pod: Pod) -> None:
        pod.state = "unpreparing"
        self.w.note("kubelet", f"{pod.name}: unprepare {pod.claim}")
        ref = self.w.claim_ref(pod)
        inc = self.incarnation

        def back(outcomes, why):
            if inc != self.incarnation or pod.state != "unpreparing":
                return
            o = (outcomes or {}).get(ref.uid)
            if o is None or o.error:
                self.w.note("kubelet", f"unprepare of {pod.name} failed: {why or (o.error if o else 'no answer')}")
                pod.state = "running"
                self._sync_at(pod, RECONCILE_S)
                return
            self.prepared.pop(ref.uid, None)
            self.w.note("kubelet", f"{pod.name}: {ref.uid} unprepared")
            pod.state = "gone"
            self.w.claim_freed(pod)
        self.call(prep.UNPREPARE, (ref,), back)


# --- one atedevd process ---------------------------------------------------------------------------------

class SimDra:
    """One atedevd process in DRA mode: the daemon's own `Driver` and `Look`; its I/O simulated."""

    def __init__(self, w: "DraWorld", n: int, parent: Optional["SimDra"] = None) -> None:
        self.w = w
        self.n = n
        self.alive = True
        self.parent, self.child = parent, None
        self.handed = parent is not None  # a successor is handed its predecessor's listening socket
        self.listener: Optional[Listener] = None
        self.driver = d.Driver(None, successor=parent is not None, inherited=self.handed)
        self.look = Look(w.config(), self.say)
        self.serving = False  # its relay accepts
        self.draining = False
        self.calls: Dict[int, int] = {}  # the driver's call number -> kubelet's
        self.status = ""
        self.health: Optional[d.Health] = None
        self._numbers = itertools.count(1)
        self._wake_at: Optional[float] = None
        self._written_at = 0.0
        w.processes.append(self)
        w.ever.append(self)

    def say(self, level: int, kind: str, text: str, once: Optional[str] = None, **fields) -> None:
        if self.w.trace:
            self.w.said.append((self.w.now, level, f"daemon#{self.n} {kind}", text))

    # what the daemon's run() does

    def start(self) -> None:
        s = self.w.sockets
        if self.handed:
            self.listener = self.parent.listener if self.parent is not None else None
        elif s.store is not None and s.store.inode == s.inode and s.store.alive:
            self.listener = s.store  # LISTEN_FDS: what systemd kept
        else:
            self.listener = s.bind(self)
            if self.w.store:
                s.store = self.listener
                self.listener.holders.add("store")
        if self.listener is not None:
            self.listener.holders.add(self)
        self.serving = True
        self.w.sockets.accepting(self, True)
        devices = self.look.look(first=True)
        self.event(d.Looked(devices or ()))
        self._perform(self.driver.start(self.w.now))
        self._look_timer()

    def idle(self) -> bool:
        return not self.alive or (self.driver.idle and not self.calls)

    def accepting_calls(self) -> bool:
        return self.alive and not self.draining

    def event(self, e) -> None:
        if self.alive:
            self._perform(self.driver.handle(self.w.now, e))

    def kubelet_asks(self, n: int, kind: str, claims: tuple) -> None:
        if not self.alive:
            return
        mine = next(self._numbers)
        self.calls[mine] = n
        self.event(prep.Asked(mine, kind, claims))

    def _perform(self, actions) -> None:
        for a in actions:
            if not self.alive:
                return
            _DO[type(a)](self, a)
        self._timer()

    def _timer(self) -> None:
        at = self.driver.deadline()
        if self.alive and at is not None and (self._wake_at is None or at < self._wake_at):
            self._wake_at = at
            self.w.timer_at(at, self._due, at)

    def _due(self, at: float) -> None:
        if at == self._wake_at:
            self._wake_at = None
            self.event(TimerDue())

    def _look_timer(self) -> None:
        self.w.timer_at(self.w.now + LOOK_EVERY_S, self._periodic_look)

    def _periodic_look(self) -> None:
        if self.alive:
            self.looks()
            self._look_timer()

    def looks(self) -> None:
        """inotify's events from the nodes' directories (or the periodic look)."""
        if self.alive:
            devices = self.look.look()
            if devices is not None:
                self.event(d.Looked(devices))

    def sigterm(self) -> None:
        self.event(d.Terminate("SIGTERM"))

    def die(self) -> None:
        """kill -9: its copies of the listening socket close; the files and systemd's stay."""
        if not self.alive:
            return
        self._gone()
        for other in (self.parent, self.child):
            if other is not None and other.alive:
                self.w.after(self.w.delay() * 0.01, other.event, d.Heard(None))

    def _gone(self) -> None:
        self.alive = False
        if self in self.w.processes:
            self.w.processes.remove(self)
        if self.listener is not None:
            self.listener.holders.discard(self)
            self.w.sockets.accepting(self, False)
        self.w.kubelet.process_gone(self)
        if not self.w.processes:  # systemd: the unit's processes are gone; Restart=always (or the restart job)
            self.w.after(self.w.delay(), self.w.start_daemon)

    # the actions

    def _say(self, a: Say) -> None:
        self.say(a.level, a.kind, a.text)

    def _status(self, a: Status) -> None:
        self.status = a.text

    def _nothing(self, a) -> None:
        pass

    def _read_checkpoint(self, a: d.ReadCheckpoint) -> None:
        self.event(d.CheckpointRead(self.w.disk))

    def _write_checkpoint(self, a: prep.WriteCheckpoint) -> None:
        """Written a moment later, in order (a process killed meanwhile wrote nothing)."""
        self._written_at = max(self._written_at, self.w.now) + self.w.delay() * 0.01

        def done():
            if self.alive:
                self.w.disk = a.document
                self.event(prep.CheckpointWritten(a.call))
        self.w.timer_at(self._written_at, done)

    def _answer(self, a: prep.Answer) -> None:
        n = self.calls.pop(a.call, None)
        if n is not None:
            self.w.after(self.w.delay() * 0.1, lambda: self.alive and self.w.kubelet.answered(self, n, a.outcomes))

    def _health(self, a: d.Health) -> None:
        self.health = a

    def _connect(self, a: pub.Connect) -> None:
        self.w.api.ask(self, lambda: pub.Connected(NODE, "uid-node", f"system:node:{NODE}"),
                       lambda why: pub.ApiFailed(why))

    def _list(self, a: pub.ListSlices) -> None:
        self.w.api.ask(self, lambda: pub.SlicesListed(self.w.api.listed()), lambda why: pub.ApiFailed(why))

    def _write(self, a: pub.WriteSlices) -> None:
        self.w.api.ask(self, lambda: self.w.api.write(a), lambda why: pub.ApiFailed(why))

    def _read_claim(self, a: prep.ReadClaim) -> None:
        def read():
            c = self.w.api.claims.get(a.ref.uid)
            if c is None:
                return prep.ClaimNotRead(a.call, a.ref.uid, "HTTP 404 Not Found", 404)
            return prep.ClaimRead(a.call, a.ref.uid, c)
        self.w.api.ask(self, read, lambda why: prep.ClaimNotRead(a.call, a.ref.uid, why, None))

    def _start_successor(self, a: StartSuccessor) -> None:
        def spawn():
            if self.alive and self.driver.child_since is not None:
                self.child = self.w.start_daemon(parent=self)
        self.w.after(self.w.delay(), spawn)

    def _stop_successor(self, a: StopSuccessor) -> None:
        if self.child is not None:
            self.child.die() if a.kill else self.child.sigterm()

    def _main_pid(self, a: MainPid) -> None:
        self.w.main = self.child

    def _send(self, a: Send) -> None:
        other = self.child if self.child is not None else self.parent
        if other is not None and other.alive:
            self.w.after(self.w.delay() * 0.01, other.event, d.Heard(a.message))

    def _become_main(self, a: BecomeMain) -> None:
        self.parent = None

    def _drain(self, a: d.Drain) -> None:
        self.draining = True
        self.w.sockets.accepting(self, False)
        if a.remove:
            self.w.sockets.remove()
        self.w.kubelet.going_away(self)
        self._drained_when_done()

    def _drained_when_done(self) -> None:
        if not self.alive or not self.draining:
            return
        if any(q is self for q, _, _, _ in self.w.kubelet.in_flight.values()):
            self.w.after(0.01, self._drained_when_done)
        else:
            self.w.after(self.w.delay() * 0.01, lambda: self.draining and self.event(d.Drained()))

    def _resume(self, a: d.Resume) -> None:
        self.draining = False
        self.w.sockets.accepting(self, True)

    def _exit(self, a: Exit) -> None:
        self._gone()


_DO: Dict[type, Callable] = {
    Say: SimDra._say, Status: SimDra._status, Ready: SimDra._nothing, Reloading: SimDra._nothing,
    d.Stopping: SimDra._nothing, d.ReadCheckpoint: SimDra._read_checkpoint, prep.WriteCheckpoint: SimDra._write_checkpoint,
    prep.Answer: SimDra._answer, d.Health: SimDra._health, pub.Connect: SimDra._connect, pub.ListSlices: SimDra._list,
    pub.WriteSlices: SimDra._write, prep.ReadClaim: SimDra._read_claim, StartSuccessor: SimDra._start_successor,
    StopSuccessor: SimDra._stop_successor, MainPid: SimDra._main_pid, Send: SimDra._send,
    BecomeMain: SimDra._become_main, d.Drain: SimDra._drain, d.Resume: SimDra._resume, Exit: SimDra._exit,
}


# --- the world -------------------------------------------------------------------------------------

class DraWorld(SimClock):
    def __init__(self, seed: int, version: str = "1.37", max_delay: float = 1.0, store: bool = True) -> None:
        super().__init__(seed, max_delay)
        self.store = store  # the unit keeps the listening sockets in systemd's store (DRA mode's drop-in)
        self.dev_root = dev_root()
        self.cdi_dir = cdi_dir()
        self.api = ApiServer(self)
        self.sockets = Sockets(self)
        self.kubelet = SimKubelet(self, version)
        self.processes: List[SimDra] = []
        self.ever: List[SimDra] = []
        self.main: Optional[SimDra] = None
        self.disk: Optional[dict] = None  # the checkpoint file
        self.problems: List[str] = []
        self.daemons = 0
        self._pods = itertools.count(1)
        self._uids = itertools.count(1)
        self.unplugged: Set[int] = set()
        self.checks: list = []  # a scenario's own end-state checks: each returns problems

    def config(self) -> Config:
        return Config(api="dra", cdi=True, cdi_spec_dir=self.cdi_dir, dev_root=self.dev_root, sys_root="/sys",
                      devices=(Device(KVM, "/dev/null", 1), Device(UNIT, "/dev/unit*")))

    def problem(self, text: str) -> None:
        if len(self.problems) < 3:
            self.problems.append(f"at {self.now:.4f}: {text}")

    # atedevd

    def start_daemon(self, parent: Optional[SimDra] = None) -> SimDra:
        self.daemons += 1
        p = SimDra(self, self.daemons, parent)
        if parent is None:
            self.main = p
        p.start()
        return p

    def restart_daemon(self, how: str) -> None:
        """systemctl restart (SIGTERM to every process of the unit) or kill -9; systemd starts
        atedevd again once none is left (`SimDra._gone`)."""
        for p in list(self.processes):
            p.die() if how == "kill" else p.sigterm()

    # the pods and the scheduler

    def create_pod(self, kind: str) -> Pod:
        pod = Pod(f"pod{next(self._pods)}", kind, self.now)
        self.kubelet.pods.append(pod)
        self.after(self.delay(), self.scheduler_look)
        return pod

    def claim_ref(self, pod: Pod) -> ClaimRef:
        return ClaimRef("default", f"{pod.name}-claim", pod.claim or "")

    def scheduler_look(self) -> None:
        """Every unscheduled pod given a device the slices list, if one is free for it."""
        devices = self.api.devices()
        held = {p.device for p in self.kubelet.pods if p.claim is not None and p.state != "gone"}
        for pod in self.kubelet.pods:
            if pod.state != "pending" or pod.deleted:
                continue
            if pod.kind == "kvm":
                name = device_name(KVM, None) if device_name(KVM, None) in devices else None
            else:
                free = sorted(n for n in devices if n.startswith("unit-") and n not in held)
                name = free[0] if free else None
            if name is None:
                continue
            held.add(name)
            pod.state, pod.claim, pod.device = "scheduled", f"claim-uid-{next(self._uids)}", name
            self.api.claims[pod.claim] = {"metadata": {"uid": pod.claim, "name": f"{pod.name}-claim"}, "status": {
                "allocation": {"devices": {"results": [
                    {"request": "r", "driver": DRIVER, "pool": NODE, "device": name}]}}}}
            self.after(self.delay(), self.kubelet.bound, pod)

    def claim_freed(self, pod: Pod) -> None:
        self.api.claims.pop(pod.claim or "", None)
        self.after(self.delay(), self.scheduler_look)

    # the nodes

    def unplug(self, n: int) -> None:
        os.unlink(os.path.join(self.dev_root, f"unit{n}"))
        self.unplugged.add(n)
        self._told_later()

    def plug(self, n: int) -> None:
        from tests.simulation.world import _NODES
        os.symlink(_NODES[f"unit{n}"], os.path.join(self.dev_root, f"unit{n}"))
        self.unplugged.discard(n)
        self._told_later()

    def _told_later(self) -> None:
        for p in self.processes:
            self.after(self.delay(), p.looks)

    def close(self) -> None:
        for n in sorted(self.unplugged):
            self.plug(n)

    # the checks

    def idle(self) -> bool:
        return all(p.idle() for p in self.processes)

    def stepped(self) -> None:
        """After every event: what holds at every moment."""
        k = self.kubelet
        on_disk = set(((self.disk or {}).get("claims") or {}))
        # A deleted pod's claim is only ever unprepared now: the checkpoint may have let go of it before
        # kubelet heard (its answer in flight, or lost with a process that died after writing).
        letting_go = {p.claim for p in k.pods if p.deleted}
        lost = sorted(set(k.prepared) - on_disk - letting_go)
        if lost:
            self.problem(f"claims kubelet holds as prepared are not in the checkpoint: {lost}")
        holders: Dict[str, List[str]] = {}
        for uid, devices in k.prepared.items():
            for p in devices:
                holders.setdefault(p.device_name, []).append(uid)
        twice = {name: uids for name, uids in holders.items() if name.startswith("unit-") and len(uids) > 1}
        if twice:
            self.problem(f"a pattern unit prepared for two claims kubelet holds: {twice}")
        m = self.main
        if m is not None and m.alive and m.driver.role == d.MAIN and m.idle() and not self.api.watching and \
                not self._pending_looks():
            self._slices_true(m)

    def _pending_looks(self) -> bool:
        return any(fn == SimDra.looks or getattr(fn, "__func__", None) is SimDra.looks for _, _, fn, _, _ in self._q)

    def _slices_true(self, m: SimDra) -> None:
        """With nothing under way, the slices list the devices there now, and tainted only a gone
        one a claim holds."""
        present = {device_name(KVM, None)} | {device_name(UNIT, f"unit{n}") for n in range(UNITS)
                                              if n not in self.unplugged}
        listed = {dev["name"]: dev for s in self.api.slices.values() if s["spec"]["nodeName"] == NODE
                  for dev in s["spec"]["devices"]}
        untainted = {n for n, dev in listed.items() if not dev.get("taints")}
        if untainted != present:
            self.problem(f"the slices list {sorted(untainted)}, the node has {sorted(present)}")
        held = {p.device_name for devices in m.driver.book.claims.values() for p in devices[1]}
        for n, dev in listed.items():
            if dev.get("taints") and (n in present or n not in held or dev["taints"][0]["key"] != GONE):
                self.problem(f"device {n} is listed tainted: present {n in present}, held {n in held}")


def end_state(w: DraWorld) -> List[str]:
    """Once the node settled: one main process, registered; every pod that can run runs, none
    was rejected; what kubelet holds is exactly what the checkpoint and the main's book hold."""
    problems = list(w.problems)
    m = w.main
    if m is None or not m.alive or m.driver.role != d.MAIN:
        return problems + ["no atedevd is main"]
    if len(w.processes) != 1:
        problems.append(f"{len(w.processes)} atedevd processes alive")
    if w.kubelet.pm.chosen(DRIVER) is None:
        problems.append("kubelet has no instance of the driver registered")
    k = w.kubelet
    on_disk = set(((w.disk or {}).get("claims") or {}))
    if set(k.prepared) != on_disk or set(m.driver.book.claims) != on_disk:
        problems.append(f"kubelet holds {sorted(k.prepared)}, the checkpoint {sorted(on_disk)}, the book "
                        f"{sorted(m.driver.book.claims)}")
    free_units = UNITS - len(w.unplugged) - len({p.device for p in k.pods if p.kind == "unit" and p.state == "running"})
    for pod in k.pods:
        if pod.deleted and pod.state != "gone":
            problems.append(f"{pod.name}: deleted, still {pod.state}")
        elif not pod.deleted and pod.state != "running" and not (pod.state == "pending" and pod.kind == "unit"
                                                                  and free_units <= 0):
            problems.append(f"{pod.name} ({pod.kind}): {pod.state}, not running")
    if not m.driver.idle:
        problems.append("atedevd has something under way")
    return problems
