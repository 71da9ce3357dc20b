"""A simulated node: a clock, kubelet's plugin directory, a kubelet model, and atedevd.

atedevd here is atedevd's own code: the `Node` that the daemon's loop drives
(atedevd/node.py: the reading of directory events, what each resource is told,
the timers, the reconciling after every wake-up), each `Resource`, its
`Performer` and its registration machine, unchanged. Only the I/O beneath them
is simulated (tests/simulation/host.py): Register and pod-resources calls,
the plugin servers' connections and streams, and inotify events each take a
random delay on the world's clock. Directory events reach the daemon in
batches of random size, in order, as inotify's `watch.Event`s.
"""

import atexit
import heapq
import os
import random
import shutil
import tempfile
from typing import Dict, List, Optional

import inotify.constants as ic

from atedevd import handoff
from atedevd.config import Device
from atedevd.node import Node
from atedevd.registration.messages import State
from atedevd.watch import Event
from tests.simulation.host import KUBELET_SOCK, PLUGIN_DIR, SimHost, SimServer
from tests.simulation.kubelet import KubeletModel

RESOURCE = "ate.dev/kvm"
# A pattern resource beside it: one exclusive unit per node matching PATTERN.
PATTERN_RESOURCE = "ate.dev/unit"
PATTERN = "/dev/unit*"
# The daemon's own look at its nodes is real: links, in a dev root of the process's own, to
# character devices every machine has and the device policy allows (nothing is opened).
_NODES = {"null": "/dev/null", "unit0": "/dev/zero", "unit1": "/dev/full", "unit2": "/dev/random", "unit3": "/dev/urandom"}
UNITS = 4
_dev_root: Optional[str] = None
_dev_root_pid: Optional[int] = None


def dev_root() -> str:
    """This process's dev root, every node in place (a scenario may unplug one). A forked
    worker makes its own: rounds in two processes must not unplug each other's nodes."""
    global _dev_root, _dev_root_pid
    if _dev_root_pid != os.getpid():
        _dev_root, _dev_root_pid = tempfile.mkdtemp(prefix="atedevd-sim-dev-"), os.getpid()
        atexit.register(shutil.rmtree, _dev_root, True)
    for name, target in _NODES.items():
        if not os.path.islink(os.path.join(_dev_root, name)):
            os.symlink(target, os.path.join(_dev_root, name))
    return _dev_root


def unplug(n: int) -> None:
    os.unlink(os.path.join(_dev_root, f"unit{n}"))


def plug(n: int) -> None:
    os.symlink(_NODES[f"unit{n}"], os.path.join(_dev_root, f"unit{n}"))
_MASKS = {"create": ic.IN_CREATE, "delete": ic.IN_DELETE, "moved_to": ic.IN_MOVED_TO}


class World:
    def __init__(self, seed: int, mode: str, max_delay: float = 1.0, pod_resources: bool = True, count: int = 1024,
                 connections_visible: bool = True, agent_rps: float = 80.0):
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self.max_delay = max_delay
        self._q: list = []
        self._seq = 0
        self.fs = Directory(self)
        self.kubelet = KubeletModel(self, mode, pod_resources, agent_rps)
        self.count = count
        self.connections_visible = connections_visible
        self.dev_root = dev_root()  # every unit plugged in
        self.checks: list = []  # a scenario's own end-state checks: each returns problems
        self.orphaned: set = set()  # sockets named in a Register that was in flight when its daemon was killed
        self.daemon: Optional["Daemon"] = None  # systemd's main process
        self.processes: List["Daemon"] = []  # every atedevd process alive (two during an upgrade)
        self.daemons = 0
        self.said: List[tuple] = []  # (time, level, kind, text) of every daemon that ran
        self.events = 0
        self.trace = False  # when replaying: every action and kubelet step goes into `said`

    def note(self, who: str, text: str) -> None:
        if self.trace:
            self.said.append((self.now, 0, who, text))

    def delay(self) -> float:
        """One step's delay: often a few ms, often anything up to `max_delay`."""
        r = self.rng.random()
        return r * 0.004 if r < 0.5 else (r - 0.5) * 2 * self.max_delay

    def after(self, delay: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._q, (self.now + delay, self._seq, fn, args))

    def run_until(self, t: float) -> None:
        q = self._q
        while q and q[0][0] <= t:
            at, _, fn, args = heapq.heappop(q)
            self.now = at
            self.events += 1
            fn(*args)
        self.now = max(self.now, t)

    # --- atedevd's process ---------------------------------------------------------

    def start_daemon(self, count: Optional[int] = None, parent: Optional["Daemon"] = None) -> "Daemon":
        """A new atedevd process: systemd's (a start), or `parent`'s successor (an upgrade)."""
        self.daemons += 1
        d = Daemon(self, self.daemons, count or self.count, parent)
        if parent is None:
            self.daemon = d
        d.start()
        return d

    def restart_daemon(self, how: str) -> None:
        """SIGTERM (waits for the daemon to exit) or kill -9, then a new process."""
        d = self.daemon
        if how == "kill":
            d.die()
            self.after(self.delay(), self.start_daemon, d.count)
        else:
            d.on_exit = lambda: self.after(self.delay(), self.start_daemon, d.count)
            d.sigterm()


class Sock:
    """kubelet.sock: which kubelet process made it."""

    __slots__ = ("inc", "inode", "created")

    def __init__(self, inc, inode: int, created: float):
        self.inc, self.inode, self.created = inc, inode, created


class Directory:
    """The plugin directory (sockets only) and our standby subdirectory, with inotify."""

    def __init__(self, world: World):
        self.w = world
        self.entries: Dict[str, object] = {}  # name -> Sock | SimServer
        self.standby: Dict[str, SimServer] = {}
        self._inode = 0
        self._pending: List[tuple] = []  # events not yet read by the daemon
        self._delivery_at: Optional[float] = None
        self.dropping_until = -1.0  # events lost (queue overflow) until then

    def inode(self) -> int:
        self._inode += 1
        return self._inode

    def _event(self, kind: str, name: str) -> None:
        if self.w.now < self.dropping_until:
            if not self._pending or not self._pending[-1].is_(ic.IN_Q_OVERFLOW):
                self._pending.append(Event("", "", ic.IN_Q_OVERFLOW))  # inotify's overflow names no directory
        else:
            self._pending.append(Event(PLUGIN_DIR, name, _MASKS[kind]))
        if self._delivery_at is None:  # the daemon reads a batch after a while: events pile up
            self._delivery_at = self.w.now + self.w.delay()
            self.w.after(self._delivery_at - self.w.now, self._deliver)

    def _deliver(self) -> None:
        batch, self._pending, self._delivery_at = self._pending, [], None
        self.w.note("inotify", "batch " + ", ".join(f"{e.name or 'overflow'}:{e.mask:#x}" for e in batch))
        for d in list(self.w.processes):  # each process has its own inotify watch
            d.fs_events(batch)

    # kubelet's side
    def wipe(self) -> None:
        """A starting kubelet deletes every socket in the directory, never subdirectories."""
        for name in list(self.entries):
            del self.entries[name]
            self._event("delete", name)

    def create_kubelet_sock(self, inc) -> None:
        self.entries[KUBELET_SOCK] = Sock(inc, self.inode(), self.w.now)
        self._event("create", KUBELET_SOCK)

    def dial(self, name: str) -> Optional[SimServer]:
        s = self.entries.get(name)
        return s if isinstance(s, SimServer) and s.serving else None

    # our side
    def bind(self, server: SimServer, standby: bool) -> None:
        server.inode = self.inode()
        if standby:
            self.standby[server.name] = server
        else:
            self.entries[server.name] = server
            self._event("create", server.name)

    def place(self, server: SimServer) -> bool:
        if self.standby.get(server.name) is not server:
            return False
        del self.standby[server.name]
        self.entries[server.name] = server
        self._event("moved_to", server.name)
        return True

    def unlink(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self._event("delete", name)

    def remove(self, server: SimServer) -> None:
        if self.entries.get(server.name) is server:
            self.unlink(server.name)
        if self.standby.get(server.name) is server:
            del self.standby[server.name]

    def is_ours(self, server: SimServer) -> bool:
        return self.entries.get(server.name) is server or self.standby.get(server.name) is server

    def kubelet_sock(self) -> Optional[Sock]:
        s = self.entries.get(KUBELET_SOCK)
        return s if isinstance(s, Sock) else None


class Daemon:
    """One atedevd process: atedevd's Node on the simulated host."""

    def __init__(self, world: World, n: int, count: int, parent: Optional["Daemon"] = None):
        self.w = world
        self.n = n
        self.count = count
        self.alive = True
        world.processes.append(self)
        self.host = SimHost(world, self)
        self.node = Node(PLUGIN_DIR, world.dev_root, "/sys", self.host, f"d{n}", lambda path, error: False)
        self.on_exit = None
        self._wake_at: Optional[float] = None
        # An upgrade (atedevd/handoff.py), its two sides as the daemon drives them.
        self.parent, self.child = parent, None
        self.successor = handoff.Successor() if parent is not None else None
        self.predecessor: Optional[handoff.Predecessor] = None
        if parent is not None:
            self.node.held = True
            self.node.inherited = frozenset(r.name for r in parent.node.resources.values() if r.advertised)

    @property
    def resource(self):
        return self.node.resources[RESOURCE]

    def devices(self, count: int) -> List[Device]:
        return [Device(RESOURCE, "/dev/null", count), Device(PATTERN_RESOURCE, PATTERN)]

    def servers(self) -> List[SimServer]:
        return [s for r in self.node.resources.values() for s in r.performer.servers.values()]

    # --- the process: what Daemon.run, its signals and its loop do ---------------------------------

    def start(self) -> None:
        fs = self.w.fs
        for name, s in list(fs.entries.items()) + list(fs.standby.items()):
            if isinstance(s, SimServer) and not s.serving:  # an earlier run's leftover
                fs.remove(s)
        self.node.kubelet.refresh(created=False, events_lost=True)
        self.node.apply(self.devices(self.count), self.w.dev_root, "/sys", self.w.now)
        self.node.reconcile(self.w.now)
        self.woke()

    def sigterm(self) -> None:
        if self.alive and not self.node.stopping:
            self.node.begin_stop(self.w.now)
            self.woke()

    def reload(self, count: int) -> None:
        """SIGHUP: a changed resource is served anew; an unchanged one is not touched."""
        self.count = count
        self.node.accept_nodes()
        self.node.apply(self.devices(count), self.w.dev_root, "/sys", self.w.now)
        self.node.reconcile(self.w.now)
        self.woke()

    def upgrade(self, overlap: bool) -> None:
        """A reload that finds the installed atedevd is another: start it, hand over to it."""
        if not self.alive or self.node.stopping or self.predecessor is not None or self.successor is not None:
            return
        self.predecessor = handoff.Predecessor(overlap, self.w.now)
        self.w.after(self.w.delay(), self._spawn)

    def _spawn(self) -> None:
        if self.alive and self.predecessor is not None and self.predecessor.phase is handoff.Phase.STARTING:
            self.child = self.w.start_daemon(self.count, parent=self)

    def tell(self, message: Optional[handoff.Message]) -> None:
        """The other process said `message` (None: its end of the channel closed): a while later."""
        self.w.after(self.w.delay() * 0.01, self._heard, message)

    def _heard(self, message: Optional[handoff.Message]) -> None:
        if not self.alive:
            return
        now = self.w.now
        if self.predecessor is not None:
            if message is None or (self.child is not None and not self.child.alive):  # it may have died since
                self.predecessor.exited(now, "was killed")
            else:
                self.predecessor.received(now, message)
        elif self.successor is not None:
            if message is None:
                self.successor.predecessor_gone()
            else:
                self.successor.received(message)
        self.woke()

    def _upgrade_steps(self) -> None:
        """Daemon._upgrade_steps, with the simulation's process and channel."""
        now, p, s = self.w.now, self.predecessor, self.successor
        handoff.observe(now, self.node, p, s)
        for a in p.take() if p is not None else ():
            handoff.to_node(now, self.node, a)
            if isinstance(a, handoff.Send) and self.child is not None:
                self.child.tell(a.message)
            elif isinstance(a, handoff.Stop) and self.child is not None:
                if a.kill:
                    self.child.die()
                else:
                    self.child.sigterm()  # it lets go of what it registered; its exit ends the talk
            elif isinstance(a, handoff.MainPid):
                self.w.daemon = self.child
        if p is not None and p.phase is handoff.Phase.FAILED and p.over:
            self.predecessor = None  # an upgrade of our own, no longer under way
        for a in s.take() if s is not None else ():
            handoff.to_node(now, self.node, a)
            if isinstance(a, handoff.Send) and self.parent is not None and self.parent.alive:
                self.parent.tell(a.message)
            elif isinstance(a, handoff.BecomeMain):
                self.successor = None

    def die(self) -> None:
        """kill -9: connections drop, socket files stay behind."""
        self.alive = False
        if self in self.w.processes:
            self.w.processes.remove(self)
        for other in (self.parent, self.child):
            if other is not None and other.alive:
                other.tell(None)  # its end of the channel closes
        # A registration in progress goes on in kubelet. Unless kubelet already listed its
        # devices, its teardown will not show in pod-resources: no later process can see it.
        for r in self.node.resources.values():
            book, call, servers = r.machine.book, r.machine.attempts.call, r.performer.servers
            for sid in ([call.sid] if call is not None else []) + \
                    ([book.current] if book.current is not None and not book.listed_seen else []):
                if sid in servers:
                    self.w.orphaned.add(servers[sid].name)
            for s in servers.values():
                s.stop(unlink=False)

    def fs_events(self, batch: List[Event]) -> None:
        if self.alive:
            self.node.on_directory_events(batch, self.w.now)
            self.woke()

    def woke(self) -> None:
        """What the loop does after each wake-up: what is due, reconciling; exit once stopped."""
        if not self.alive:
            return
        self.node.wake(self.w.now)
        self._upgrade_steps()
        if self.node.stopped:
            self.node.close(self.w.now)
            self.alive = False
            self.w.processes.remove(self)
            for other in (self.parent, self.child):
                if other is not None and other.alive:
                    other.tell(None)
            if self.on_exit:
                self.on_exit()
            return
        at = self.node.deadline()
        if self.predecessor is not None and self.predecessor.deadline is not None:
            at = self.predecessor.deadline if at is None else min(at, self.predecessor.deadline)
        if at is not None and (self._wake_at is None or at < self._wake_at):
            self._wake_at = at
            self.w.after(max(0.0, at - self.w.now), self._tick)

    def _tick(self) -> None:
        self._wake_at = None
        self.woke()

    # --- for the checks ---------------------------------------------------------------------

    def state(self, resource: str = RESOURCE) -> State:
        return self.node.resources[resource].state

    def current_socket(self, resource: str = RESOURCE) -> Optional[str]:
        r = self.node.resources[resource]
        current = r.machine.book.current
        s = r.performer.servers.get(current) if current is not None else None
        return s.name if s else None
