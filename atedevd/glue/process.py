"""One atedevd process as decisions: what it does after every wake-up, and in an upgrade.

The daemon's loop (atedevd/daemon/loop.py) and the simulation (tests/simulation) both run
a `Process` over the same `PluginDir`: after each wake-up `wake(now)` runs what is due on
the node, the start's deferred work once the first Registers are out, the upgrade's
two machines (atedevd/upgrade/machines.py) with what they see of the node, and says when the
status line and the metrics may have changed. What the process itself must do comes
out as typed actions, which each side carries out by a table of types: the daemon
with sd_notify, the upgrade's channel and the metrics file; the simulation with its
clock and its channel. `ACTIONS` lists them; a test holds both tables to it.
"""

from typing import Callable, Dict, FrozenSet, List, Optional, Tuple, Type, Union

from atedevd.glue.plugin_dir import PluginDir
from atedevd.record import Record
from atedevd.registration.messages import Yield, RegisterAgain, Release, Say, TakeBack
from atedevd.registration.report import Report, describe
from atedevd.upgrade.machines import (BecomeMain, Exit, MainPid, Message, Predecessor, Send, StopSuccessor, Successor,
                                      UpgradeAction, UpgradePhase)

START_WORK_LATEST_S = 0.5  # the start's deferred work waits for the first Registers this long at most


class StartWork(Record):
    """The start's deferred work: every first Register is on its way (or the wait is over)."""


class Status(Record):
    """`STATUS=`: what each resource's registration is, in one line (it changed)."""

    text: str


class Ready(Record):
    """`READY=1` again, with the status: a reload, or an upgrade's take-back, is over."""


class WriteMetrics(Record):
    """What the metrics show may have changed."""


class ServingBegan(Record):
    """A resource began to be served: the daemon notes whether its directory is a mount."""


class WatchDirectories(Record):
    """Watch these directories (they changed: a resource's links lead somewhere new, or the
    configuration did)."""

    directories: FrozenSet[str]


ProcessAction = Union[StartWork, Status, Ready, WriteMetrics, ServingBegan, WatchDirectories, Send, StopSuccessor,
                      MainPid, Exit, BecomeMain, Say]
ACTIONS: Tuple[type, ...] = ProcessAction.__args__  # type: ignore[attr-defined]


class Process:
    """The node and the upgrade's machines, between the loop and the I/O."""

    def __init__(self, plugins: PluginDir, successor: bool = False) -> None:
        self.plugins = plugins
        self.host = plugins.host
        self.predecessor: Optional[Predecessor] = None  # an upgrade of ours, under way
        self.successor: Optional[Successor] = Successor() if successor else None  # until we are main
        self.start_work_due: Optional[float] = None
        self.reload_error: Optional[str] = None  # the last reload's, while its configuration is not running
        self._status_seen: Optional[tuple] = None
        self._metrics_seen: Optional[tuple] = None
        self._out: List[ProcessAction] = []

    # --- inputs ------------------------------------------------------------------------------

    def started(self, now: float) -> None:
        """The first pass over the configuration is done: the deferred work is due by the limit."""
        self.start_work_due = now + START_WORK_LATEST_S

    def stop(self, now: float) -> None:
        """SIGTERM: end our streams (the loop runs on until kubelet let go); a successor
        being started stops too."""
        if self.plugins.stopping:
            return
        p = self.predecessor
        if p is not None and p.phase is not UpgradePhase.DONE:
            self._out.append(StopSuccessor(kill=False))
        self.plugins.begin_stop(now)

    def upgrade(self, now: float, overlap: bool) -> None:
        """A successor was started: hand over to it once it is ready (`overlap`: beside us)."""
        self.predecessor = Predecessor(overlap, now)

    def heard(self, now: float, message: Optional[Message], gone: Optional[str] = None) -> None:
        """The other process said `message`; None: its end of the channel closed (`gone`: how
        a successor ended, when it did)."""
        if self.predecessor is not None:
            if message is None or gone is not None:
                self.predecessor.exited(now, gone or "closed its end of the channel")
            else:
                self.predecessor.received(now, message)
        elif self.successor is not None:
            if message is None:
                self.successor.predecessor_gone()
            else:
                self.successor.received(message)

    @property
    def upgrading(self) -> Optional[str]:
        """Which side of an upgrade under way this process is on, if any."""
        if self.predecessor is not None:
            return "predecessor"
        return "successor" if self.successor is not None else None

    # --- after every wake-up --------------------------------------------------------------------

    def wake(self, now: float) -> List[ProcessAction]:
        """What is due, then what the process must do."""
        if self.host.cdi is not None:
            self.host.cdi.wake(now)  # a CDI spec that could not be written; the look at the spec directory
        if self.plugins.wake(now):
            self._out.append(ServingBegan())
        dirs = self.plugins.directories_to_watch()
        if dirs is not None:
            self._out.append(WatchDirectories(dirs))
        due = self.start_work_due
        if due is not None and (now >= due or self.plugins.stopping or self.plugins.registers_sent() or self._kubelet_away()):
            self.start_work_due = None
            self._out.append(StartWork())
        self.upgrade_steps(now)
        self._changed()
        out, self._out = self._out, []
        return out

    def _kubelet_away(self) -> bool:
        """Nothing can be registered now: no kubelet.sock, or one nobody accepts on (the one
        a kubelet left at a reboot). The deferred work is then done before kubelet comes, not
        while it dials back (at boot it starts after our READY)."""
        kubelet = self.plugins.kubelet
        return not kubelet.serving or not self.host.listening(kubelet.socket)

    def deadline(self) -> Optional[float]:
        """When `wake` is due next for a timer of ours."""
        times = [t for t in (self.plugins.deadline(), self.start_work_due,
                             self.predecessor.deadline if self.predecessor is not None else None,
                             self.host.cdi.deadline if self.host.cdi is not None else None) if t is not None]
        return min(times) if times else None

    @property
    def stopped(self) -> bool:
        return self.plugins.stopped

    def upgrade_steps(self, now: float) -> None:
        """What the upgrade's machines see of the node now, and what they ask for."""
        p, s = self.predecessor, self.successor
        if self.host.cdi is not None:
            self.host.cdi.sharing = self.upgrading is not None  # both daemons keep the specs meanwhile
        if p is not None:
            if p.phase is UpgradePhase.YIELDING and self.plugins.yielded:
                p.let_go(now)
            p.on_timer(now)
        if s is not None:
            if s.phase is UpgradePhase.STARTING and self.plugins.ready_on_hold:
                s.ready()
            elif s.phase is UpgradePhase.REGISTERING and self.plugins.registered:
                s.registered()
        for machine in (p, s):
            for action in machine.take() if machine is not None else ():
                _UPGRADE[type(action)](self, now, action)
        if p is not None and p.over and p.phase is UpgradePhase.FAILED:
            self.predecessor = None  # it failed and is gone: we serve on, as before it

    # --- what it tells ---------------------------------------------------------------------

    def status(self) -> str:
        """The status line: each resource's registration, and a failed reload."""
        parts: List[str] = []
        if self.reload_error:
            parts.append(f"reload failed, running previous config: {self.reload_error}")
        dir_ok = self.host.isdir(self.plugins.plugin_dir)
        now, wall = self.host.monotonic(), self.host.wall()
        for r in self.plugins.reports():
            parts.append(f"{r.name}: {self._describe(r, dir_ok, now, wall)}")
        return "; ".join(parts) or "no devices configured"

    def summary(self) -> str:
        """What is served, in a few words."""
        return ", ".join(f"{r.name} ({r.device.path})" for r in self.plugins.resources.values()) or "no devices"

    def _describe(self, r: Report, dir_ok: bool, now: float, wall: float) -> str:
        if not r.advertised:
            return f"no node matches {r.device_path}, not advertised" if r.pattern else \
                f"{r.device_path} missing, not advertised"
        if not dir_ok:
            return f"waiting for {self.plugins.plugin_dir}"
        return describe(r, now, wall)

    def _changed(self) -> None:
        """Status and metrics are said again only when what they show may have changed."""
        shown = self.plugins.shown()
        seen = (shown, self.reload_error, self.host.isdir(self.plugins.plugin_dir))
        if seen != self._status_seen:
            self._status_seen = seen
            self._out.append(Status(self.status()))
        allocations = tuple((r.allocations.calls, r.allocations.failures) for r in self.plugins.resources.values())
        seen = (shown, self.reload_error, allocations)
        if seen != self._metrics_seen:
            self._metrics_seen = seen
            self._out.append(WriteMetrics())

    # --- the upgrade's actions: the node's part here, the process's out -------------------------

    def _to_plugins(self, now: float, a: UpgradeAction) -> None:
        self.plugins.tell_all(now, a)  # type: ignore[arg-type]

    def _out_too(self, now: float, a: UpgradeAction) -> None:
        self._out.append(a)  # type: ignore[arg-type]

    def _taken_back(self, now: float, a: UpgradeAction) -> None:
        self.plugins.tell_all(now, a)  # type: ignore[arg-type]
        self._out.append(Ready())  # the reload is over: we serve on

    def _released(self, now: float, a: UpgradeAction) -> None:
        self.plugins.release(now)

    def _exit(self, now: float, a: UpgradeAction) -> None:
        self.plugins.begin_stop(now, replaced=True)  # our successor is registered: no let-go to wait for
        self._out.append(a)  # type: ignore[arg-type]

    def _main(self, now: float, a: UpgradeAction) -> None:
        self.successor = None  # an upgrade of ours no longer: we are systemd's main process
        self._out.append(a)  # type: ignore[arg-type]


_UPGRADE: Dict[Type, Callable[[Process, float, UpgradeAction], None]] = {
    Yield: Process._to_plugins, RegisterAgain: Process._to_plugins, TakeBack: Process._taken_back,
    Release: Process._released, Exit: Process._exit, BecomeMain: Process._main,
    Send: Process._out_too, StopSuccessor: Process._out_too, MainPid: Process._out_too, Say: Process._out_too,
}
