"""A simulated node: a clock, kubelet's plugin directory, a kubelet model, and atedevd.

atedevd here is atedevd's own code: the `Node` that the daemon's loop drives
(atedevd/glue/plugin_dir.py: the reading of directory events, what each resource is told,
the timers, the reconciling after every wake-up), each `Resource`, its
`Performer` and its registration machine, unchanged. Only the I/O beneath them
is simulated (tests/simulation/host.py): Register and pod-resources calls,
the plugin servers' connections and streams, and inotify events each take a
random delay on the world's clock. Directory events reach the daemon in
batches of random size, in order, as inotify's `watch.DirEvent`s.
"""

import multiprocessing.util
import os
import shutil
import tempfile
from typing import Callable, Dict, List, Optional

import inotify.constants as ic

from atedevd.cdi import files as cdi_files
from atedevd.cdi import keeper as cdi_keeper
from atedevd.cdi import names as cdi
from atedevd.config import Config, Device
from atedevd.daemon.watch import DirEvent
from atedevd.devices import policy
from atedevd.devices.invariants import Invariants
from atedevd.glue import metrics
from atedevd.glue.plugin_dir import PluginDir
from atedevd.glue.process import (Process, ReadConfig, Ready, Reloading, ServingBegan, StartSuccessor, StartWork,
                                  Status, WriteMetrics)
from atedevd.kubelet.identity import KubeletFound
from atedevd.registration.messages import Say, State
from atedevd.upgrade.machines import BecomeMain, Exit, MainPid, Message, Send, StopSuccessor, UpgradePhase
from tests.simulation.clock import SimClock
from tests.simulation.host import KUBELET_SOCK, PLUGIN_DIR, SimHost, SimServer
from tests.simulation.kubelet import KubeletModel
from tests.simulation.udev import Udev

RESOURCE = "ate.dev/kvm"
# A pattern resource beside it: one exclusive unit per node matching PATTERN.
PATTERN_RESOURCE = "ate.dev/unit"
PATTERN = "/dev/unit*"
# The daemon's own look at its nodes is real: links, in a dev root of the process's own, to
# character devices every machine has and the device policy allows (nothing is opened).
_NODES = {"null": "/dev/null", "unit0": "/dev/zero", "unit1": "/dev/full", "unit2": "/dev/random", "unit3": "/dev/urandom"}
UNITS = 4
_dev_root: Optional[str] = None
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the CDI specs' directory: fsync costs nothing there
_dev_root_pid: Optional[int] = None


def dev_root() -> str:
    """This process's dev root, every node in place (a scenario may unplug one). A forked
    worker makes its own: rounds in two processes must not unplug each other's nodes."""
    global _dev_root, _dev_root_pid
    if _dev_root_pid != os.getpid():
        _dev_root, _dev_root_pid = tempfile.mkdtemp(prefix="atedevd-sim-dev-"), os.getpid()
        # Removed at this process's exit, a pool worker's too (atexit does not run in one).
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(_dev_root, True), exitpriority=0)
    for name, target in _NODES.items():
        if not os.path.islink(os.path.join(_dev_root, name)):
            os.symlink(target, os.path.join(_dev_root, name))
    return _dev_root


_cdi_base: Optional[str] = None
_cdi_pid: Optional[int] = None


def cdi_dir() -> str:
    """An empty CDI spec directory for a world, of the same name for every world of this process
    (they run one after another; a replay says the same words)."""
    global _cdi_base, _cdi_pid
    if _cdi_pid != os.getpid():
        _cdi_base, _cdi_pid = tempfile.mkdtemp(prefix="atedevd-sim-cdi-", dir=_SCRATCH), os.getpid()
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(_cdi_base, True), exitpriority=0)
    path = os.path.join(_cdi_base, "cdi")
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path, 0o755)
    return path


def unplug(n: int) -> None:
    os.unlink(os.path.join(_dev_root, f"unit{n}"))


def plug(n: int) -> None:
    os.symlink(_NODES[f"unit{n}"], os.path.join(_dev_root, f"unit{n}"))
_MASKS = {"create": ic.IN_CREATE, "delete": ic.IN_DELETE, "moved_to": ic.IN_MOVED_TO,
          "gone": ic.IN_DELETE_SELF, "made": ic.IN_CREATE | ic.IN_ISDIR}


class World(SimClock):
    def __init__(self, seed: int, mode: str, max_delay: float = 1.0, pod_resources: bool = True, count: int = 1024,
                 connections_visible: bool = True, agent_rps: float = 80.0, udev: bool = False, cdi: bool = True):
        super().__init__(seed, max_delay)
        self.fs = Directory(self)
        self.kubelet = KubeletModel(self, mode, pod_resources, agent_rps)
        self.count = count
        self.connections_visible = connections_visible
        # The nodes: links, in a dev root, to character devices every machine has. With `udev`
        # (tests/simulation/udev.py), a dev root of the round's own that the scenario changes
        # as udev does, and resources whose paths overlap; else the process's, unchanged but
        # for a unit unplugged and put back.
        self.udev = Udev(self) if udev else None
        self.dev_root = self.udev.root if self.udev else dev_root()
        self.checks: list = []  # a scenario's own end-state checks: each returns problems
        self.orphaned: set = set()  # sockets named in a Register that was in flight when its daemon was killed
        self.daemon: Optional["AtedevdProcess"] = None  # systemd's main process
        self.processes: List["AtedevdProcess"] = []  # every atedevd process alive (two during an upgrade)
        self.ever: List["AtedevdProcess"] = []  # every atedevd process started, alive or not
        self.daemons = 0
        # CDI specs (atedevd/cdi/keeper.py), in a directory of the round's own: every name a
        # daemon could have answered Allocate with resolves there after every event, and a
        # killed daemon's until the next start has written its own.
        self.cdi = cdi  # `[daemon] cdi` for every daemon of the round (off: the default configuration)
        self.cdi_dir = cdi_dir()
        self.cdi_problems: List[str] = []
        self.invariant_problems: List[str] = []
        self._gone_owed: set = set()  # a stopped or killed daemon's names, until the next start
        self._cdi_seen: Optional[tuple] = None
        self._resolved: Dict[str, list] = {}
        self._parsed: Dict[str, tuple] = {}
        self._judged: Dict[str, set] = {}  # qualified CDI name -> the numbers ever granted its unit, by any daemon

    def moves_taken(self) -> set:
        """Every (from, to) move any registration machine of any process made."""
        return {(a, b) for d in self.ever for r in d.plugins.resources.values() for a, b, _ in r.machine.moves.taken}

    def check_cdi(self) -> None:
        """CDI specs, after every event a daemon takes (nothing else writes them, grows what is
        owed or changes what is granted), and after an exit:
        - every name a live daemon keeps and could have answered resolves, and a stopped or
          killed daemon's until the next start (the specs outlive the daemon);
        - every name that resolves makes, as its unit's node, numbers the policy allows and that
          some daemon's table granted that very unit, and no node granted under another name now."""
        written = (len(self._gone_owed), tuple((d.n, tuple((k._written, len(k.book.ever_answerable)) for k in
                                                           d.host.cdi.keepers.values())) for d in self.processes))
        seen = (written, tuple((d.n, tuple(r.snapshot.version for r in d.plugins.all_resources())) for d in self.processes))
        if seen == self._cdi_seen:  # (a test reads the keepers' fields)
            return
        if self._cdi_seen is None or written != self._cdi_seen[0]:
            self._resolved = cdi_files.resolved(self.cdi_dir, self._parsed)  # (the disk changes only with a write, or an exit)
        self._cdi_seen = seen
        granted: Dict[str, str] = {}  # numbers "M:m" -> the qualified name of a unit granted them now (a pattern's)
        names_now = set()
        for d in self.processes:
            for r in d.plugins.all_resources():
                for key, nodes in r.snapshot.grants().items():
                    name = cdi.qualified(r.name, cdi.shared_name(r.name) if key is None else cdi.unit_name(key))
                    numbers = f"{nodes[0].major}:{nodes[0].minor}"
                    self._judged.setdefault(name, set()).add(numbers)
                    names_now.add(name)
                    if r.device.pattern:
                        granted[numbers] = name
        resolved = self._resolved
        owed = set(self._gone_owed).union(*(d.host.cdi.owed() for d in self.processes))
        problems = [f"CDI names answerable but not resolvable at {self.now:.4f}: {sorted(owed - set(resolved))}"] \
            if owed - set(resolved) else []
        for name, nodes in sorted(resolved.items()):
            if not nodes:
                continue
            numbers = f"{nodes[0].get('major')}:{nodes[0].get('minor')}"
            found = policy.judge(policy.by_numbers(nodes[0].get("path", "?"), nodes[0]["major"], nodes[0]["minor"]))
            if found is not None:
                problems.append(f"at {self.now:.4f}: {name} makes {numbers}, refused by the policy: {found}")
            if numbers not in self._judged.get(name, ()):
                problems.append(f"at {self.now:.4f}: {name} makes {numbers}, never granted its unit "
                                f"(granted: {sorted(self._judged.get(name, ()))})")
            holder = granted.get(numbers)
            if holder is not None and holder != name and name not in names_now:
                problems.append(f"at {self.now:.4f}: {name} makes {numbers}, the node {holder} is granted now")
        for p in problems:
            if len(self.cdi_problems) < 3:
                self.cdi_problems.append(p)

    def daemon_gone(self, d: "AtedevdProcess") -> None:
        """A daemon stopped or was killed: its names stay owed until the next start (not after an
        upgrade's hand-over: its successor keeps them)."""
        if not d.replaced:
            self._gone_owed |= d.host.cdi.owed()
        self.check_cdi()

    def close(self) -> None:
        shutil.rmtree(self.cdi_dir, ignore_errors=True)
        if self.udev is not None:
            self.udev.close()

    # --- atedevd's process ---------------------------------------------------------

    def start_daemon(self, count: Optional[int] = None, parent: Optional["AtedevdProcess"] = None) -> "AtedevdProcess":
        """A new atedevd process: systemd's (a start), or `parent`'s successor (an upgrade)."""
        self.daemons += 1
        d = AtedevdProcess(self, self.daemons, count or self.count, parent)
        if parent is None:
            self.daemon = d
        d.start()
        if parent is None:
            self._gone_owed = set()  # what it kept of the last run's specs is its own to owe now
            self.check_cdi()
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


    def restart_unit(self) -> None:
        """`systemctl restart`: SIGTERM to every process of the unit (an upgrade's two, too),
        and a new start once all have exited."""
        alive = list(self.processes)
        count = self.daemon.count if self.daemon else self.count

        def exited():
            if not self.processes:
                self.after(self.delay(), self.start_daemon, count)
        for d in alive:
            d.on_exit = exited
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
        self.present = True  # the directory itself exists

    def inode(self) -> int:
        self._inode += 1
        return self._inode

    def _event(self, kind: str, name: str) -> None:
        if self.w.now < self.dropping_until:
            if not self._pending or not self._pending[-1].is_(ic.IN_Q_OVERFLOW):
                self._pending.append(DirEvent("", "", ic.IN_Q_OVERFLOW))  # inotify's overflow names no directory
        else:
            self._pending.append(DirEvent(PLUGIN_DIR, name, _MASKS[kind]))
        if self._delivery_at is None:  # the daemon reads a batch after a while: events pile up
            self._delivery_at = self.w.now + self.w.delay()
            self.w.after(self._delivery_at - self.w.now, self._deliver)

    def _deliver(self) -> None:
        batch, self._pending, self._delivery_at = self._pending, [], None
        self.w.note("inotify", "batch " + ", ".join(f"{e.name or 'overflow'}:{e.mask:#x}" for e in batch))
        for d in list(self.w.processes):  # each process has its own inotify watch
            d.fs_events(batch)

    # anyone's side
    def remove_dir(self) -> None:
        """The directory goes, with everything in it (`rm -r`: each entry, then the directory)."""
        for name in list(self.entries):
            del self.entries[name]
            self._event("delete", name)
        self.standby.clear()
        self.present = False
        self._event("gone", "")

    def make_dir(self) -> None:
        """The directory is made again (kubelet makes it at start)."""
        if not self.present:
            self.present = True
            self._event("made", "")

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
        if not self.present:
            raise FileNotFoundError(2, "No such file or directory")
        server.inode = self.inode()
        if standby:
            self.standby[server.name] = server
        else:
            self.entries[server.name] = server
            self._event("create", server.name)

    def place(self, server: SimServer) -> bool:
        if not self.present or self.standby.get(server.name) is not server:
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


class AtedevdProcess:
    """One atedevd process: the daemon's own `Process` (atedevd/glue/process.py: the glue its loop
    runs) over its own `Node`, on the simulated host. What is left here is the process's I/O,
    simulated: the clock's wake-ups, the upgrade's channel, the exit, and what each of the
    process's actions does (`_DO`, held to `process.ACTIONS` as the daemon's table is)."""

    def __init__(self, world: World, n: int, count: int, parent: Optional["AtedevdProcess"] = None):
        self.w = world
        self.n = n
        self.count = count
        self.alive = True
        world.processes.append(self)
        world.ever.append(self)
        self.host = SimHost(world, self)
        self.host.cdi = cdi_keeper.Specs(self.host.say, sharing=parent is not None)
        self.plugins = PluginDir(PLUGIN_DIR, world.dev_root, "/sys", self.host, f"d{n}", lambda path, error: False)
        # A successor serves what its predecessor served (what the daemon's channel hands it).
        self.process = Process(self.plugins, inherited=frozenset(parent.plugins.served()) if parent is not None else None)
        self.on_exit = None
        self._wake_at: Optional[float] = None
        self.parent, self.child = parent, None
        self.pattern = parent.pattern if parent is not None else True  # the pattern resource is configured
        self.status = ""  # STATUS=, as it would be sent
        self.metrics_due = 0  # times the metrics would have been written
        self.replaced = False
        self.udev_pending = 0  # batches of device events on their way to it (the udev model's)
        self.invariants = Invariants()  # what kubelet is told, held against the node (atedevd/devices/invariants.py)
        self._judged: Optional[tuple] = None
        self.started_work = False

    @property
    def resource(self):
        return self.plugins.resources[RESOURCE]

    def devices(self, count: int) -> List[Device]:
        shared = Device(RESOURCE, "/dev/null", count)
        devices = [shared, Device(PATTERN_RESOURCE, PATTERN)] if self.pattern else [shared]
        return devices + (self.w.udev.devices(self.pattern) if self.w.udev is not None else [])

    def servers(self) -> List[SimServer]:
        return [s for r in self.plugins.all_resources() for s in r.performer.servers.values()]

    # --- the process: what Daemon.run, its signals and its loop do ---------------------------------

    def config(self, count: int) -> Config:
        """What its configuration file says (`kubelet_endpoints` is "auto": the kubelet says)."""
        return Config(cdi=self.w.cdi, cdi_spec_dir=self.w.cdi_dir, dev_root=self.w.dev_root, sys_root="/sys",
                      devices=tuple(self.devices(count)))

    def start(self) -> None:
        self._perform(self.process.start(self.w.now, self.config(self.count)))
        self.status = self.process.status()  # READY=1
        self.woke()

    def sigterm(self) -> None:
        if self.alive and not self.plugins.stopping:
            self.process.stop(self.w.now)
            self.woke()

    def reload(self, count: int, pattern: bool = True) -> None:
        """SIGHUP with this configuration in the file: a changed resource is served anew; an
        unchanged one is not touched; one no longer configured (`pattern` False: the pattern
        resource) is closed. (A stop or an upgrade under way: the process ignores it.)"""
        if not self.alive:
            return
        self._configured = (count, pattern)
        self._perform(self.process.hangup(self.w.now, installed_changed=False))
        self.woke()

    def upgrade(self) -> None:
        """A SIGHUP that finds the installed atedevd is another: start it, hand over to it."""
        if self.alive:
            self._perform(self.process.hangup(self.w.now, installed_changed=True))
            self.woke()

    def _spawn(self) -> None:
        p = self.process.predecessor  # (the daemon starts it at once, but its start takes a while)
        if self.alive and not self.plugins.stopping and p is not None and p.phase is UpgradePhase.STARTING:
            self.child = self.w.start_daemon(self.count, parent=self)

    def tell(self, message: Optional[Message]) -> None:
        """The other process said `message` (None: its end of the channel closed): a while later."""
        self.w.after(self.w.delay() * 0.01, self._channel_said, message)

    def _channel_said(self, message: Optional[Message]) -> None:
        if not self.alive:
            return
        child_dead = self.process.predecessor is not None and (
            message is None or (self.child is not None and not self.child.alive))
        self.process.heard(self.w.now, None if child_dead else message, "was killed" if child_dead else None)
        self.woke()

    def die(self) -> None:
        """kill -9: connections drop, socket files stay behind (and CDI specs: valid, for the next start)."""
        self.alive = False
        if self in self.w.processes:
            self.w.processes.remove(self)
        self.w.daemon_gone(self)
        for other in (self.parent, self.child):
            if other is not None and other.alive:
                other.tell(None)  # its end of the channel closes
        # A registration in progress goes on in kubelet. Unless kubelet already listed its
        # devices, its teardown will not show in pod-resources: no later process can see it.
        for r in self.plugins.all_resources():
            call, book = r.machine.attempts.call, r.machine.book  # (the machine's parts, as a test reads them)
            unseen = ([call.sid] if call is not None else []) + \
                ([book.current] if book.current is not None and not book.listed_seen else [])
            for sid in unseen:
                name = r.performer.socket_name(sid)
                if name is not None:
                    self.w.orphaned.add(name)
            for server in r.performer.servers.values():
                server.stop(unlink=False)

    def fs_events(self, batch: List[DirEvent]) -> None:
        if self.alive:
            self.plugins.on_directory_events(batch, self.w.now)
            self.woke()

    def device_events(self, batch: List[DirEvent]) -> None:
        """inotify's events from the nodes' directories (the udev model's), read a while after."""
        self.udev_pending -= 1
        self.fs_events(batch)

    def woke(self) -> None:
        """What the loop does after each wake-up: the process's glue, its actions; exit once stopped."""
        if not self.alive:
            return
        try:
            self._woke()
        finally:
            self.w.check_cdi()
            if self.w.udev is not None:
                self.check_invariants()

    def check_invariants(self) -> None:
        """The runtime invariants, after every event it takes, while no device event is still
        on its way to it (until inotify tells, a node gone is rightly still served): looked at
        again only when what it publishes or the nodes changed since."""
        if not self.alive or self.plugins.stopping or self.udev_pending:
            return
        seen = (self.w.udev.changes, tuple((n, r.snapshot.version) for n, r in self.plugins.resources.items()))
        if seen == self._judged:
            return
        self._judged = seen
        for problem in self.invariants.check(self.plugins, self.w.udev.observe):
            if len(self.w.invariant_problems) < 3:
                self.w.invariant_problems.append(f"at {self.w.now:.4f}, daemon#{self.n}: {problem}")

    def _perform(self, actions) -> None:
        for a in actions:
            _DO[type(a)](self, a)

    def _woke(self) -> None:
        self._perform(self.process.wake(self.w.now))
        if self.process.stopped:
            self.plugins.close(self.w.now)  # (its CDI specs stay)
            self.alive = False
            self.w.processes.remove(self)
            self.w.daemon_gone(self)
            for other in (self.parent, self.child):
                if other is not None and other.alive:
                    other.tell(None)
            if self.on_exit:
                self.on_exit()
            return
        at = self.process.deadline()
        if at is not None and (self._wake_at is None or at < self._wake_at):
            self._wake_at = at  # (a later one already set is moot: `_tick` ignores it)
            self.w.timer_at(at, self._tick, at)

    def _tick(self, at: float) -> None:
        """A timer of the process is due, as the loop's wait ends at the earliest deadline."""
        if at != self._wake_at:
            return  # set for a deadline since replaced by an earlier one
        self._wake_at = None
        self.woke()

    # --- the process's actions, as the simulated process carries them out --------------------

    def _start_work(self, a: StartWork) -> None:
        self.started_work = True
        fs = self.w.fs  # an earlier run's dead sockets go, as Daemon._start_work removes them
        for name, s in list(fs.entries.items()) + list(fs.standby.items()):
            if isinstance(s, SimServer) and not s.serving:
                fs.remove(s)

    def _status(self, a: Status) -> None:
        self.status = a.text

    def _ready(self, a: Ready) -> None:
        self.status = self.process.status()

    def _write_metrics(self, a: WriteMetrics) -> None:
        self.metrics_due += 1  # rendered once, at the end of the round (`metrics_now`): a render costs ~1 ms

    def metrics_now(self) -> str:
        """atedevd.prom, as the daemon would write it now."""
        return metrics.render(_info(), self.plugins.reports(), polling=False, reload_ok=self.process.reload_error is None,
                              wall_offset=0.0)

    def _reloading(self, a: Reloading) -> None:
        pass  # RELOADING=1: nothing here reads it

    def _read_config(self, a: ReadConfig) -> None:
        self.count, self.pattern = self._configured
        self._perform(self.process.reloaded(self.w.now, self.config(self.count)))

    def _start_successor(self, a: StartSuccessor) -> None:
        """The daemon starts it at once; here its start takes a while (and the predecessor may
        be stopped or killed meanwhile)."""
        version = "v1.37.0" if self.w.kubelet.mode == "current" else "v1.32.0"  # (the generations the model keeps)
        self._perform(self.process.successor_started(self.w.now, KubeletFound(version, "the model's")))
        self.w.after(self.w.delay(), self._spawn)

    def _serving_began(self, a: ServingBegan) -> None:
        pass  # no sandbox here: the plugin directory is never a mount of its own

    def _send(self, a: Send) -> None:
        other = self.child if self.process.predecessor is not None else self.parent
        if other is not None and other.alive:
            other.tell(a.message)

    def _stop_successor(self, a: StopSuccessor) -> None:
        if self.child is not None:
            if a.kill:
                self.child.die()
            else:
                self.child.sigterm()  # it lets go of what it registered; its exit ends the talk

    def _main_pid(self, a: MainPid) -> None:
        self.w.daemon = self.child

    def _exit(self, a: Exit) -> None:
        self.replaced = True  # the node's part (its streams end, no let-go wait) is the glue's; the exit follows

    def _become_main(self, a: BecomeMain) -> None:
        pass  # systemd's main process: the world's `daemon` already (its predecessor said MainPid)

    def _say(self, a: Say) -> None:
        self.host.say(a.level, a.kind, a.text)

    # --- for the checks ---------------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing of its own is due but the periodic timers (`Process.idle`)."""
        return self.process.idle

    def state(self, resource: str = RESOURCE) -> State:
        return self.plugins.resources[resource].state

    def current_socket(self, resource: str = RESOURCE) -> Optional[str]:
        r = self.plugins.resources[resource]
        held = r.machine.held_sockets()
        current = r.machine.book.current
        return r.performer.socket_name(current) if current is not None and current in held else None


_DO: Dict[type, Callable] = {
    StartWork: AtedevdProcess._start_work, Status: AtedevdProcess._status, Ready: AtedevdProcess._ready,
    WriteMetrics: AtedevdProcess._write_metrics, ServingBegan: AtedevdProcess._serving_began,
    Reloading: AtedevdProcess._reloading, ReadConfig: AtedevdProcess._read_config,
    StartSuccessor: AtedevdProcess._start_successor,
    Send: AtedevdProcess._send, StopSuccessor: AtedevdProcess._stop_successor, MainPid: AtedevdProcess._main_pid,
    Exit: AtedevdProcess._exit, BecomeMain: AtedevdProcess._become_main, Say: AtedevdProcess._say,
}
_daemon_info: Optional[metrics.DaemonInfo] = None


def _info() -> metrics.DaemonInfo:
    global _daemon_info
    if _daemon_info is None:
        _daemon_info = metrics.DaemonInfo.current()
    return _daemon_info
