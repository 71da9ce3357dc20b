"""One atedevd process as decisions: its start, a reload, an upgrade, and every wake-up.

The daemon's loop (atedevd/daemon/loop.py) and the simulation (tests/simulation) both run
a `Process` over the same `PluginDir`. `start` adopts the first configuration; a SIGHUP is
`hangup`, which asks for the configuration (`ReadConfig`: `reloaded` or `reload_failed`
comes back) or, when the installed atedevd is another, for a successor (`StartSuccessor`:
`successor_started` or `successor_failed`); after each wake-up `wake(now)` runs what is due
on the node, the start's deferred work once the first Registers are out, the upgrade's two
machines (atedevd/upgrade/machines.py) with where the resources stand (`Standing`, handed
over by the node as it changes), and says when the status line and the metrics may have
changed. What the process itself must do comes out as typed actions, which each side
carries out by a table of types: the daemon with sd_notify, the configuration file, the
upgrade's channel and the metrics file; the simulation with its clock and its channel.
`ACTIONS` lists them; a test holds both tables to it.
"""

import logging
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple, Type, Union

from atedevd.config import Config
from atedevd.glue.notices import Ready, Reloading, StartSuccessor, Status
from atedevd.glue.plugin_dir import PluginDir, Standing
from atedevd.kubelet.identity import KubeletFound, upgrade_beside
from atedevd.record import Record
from atedevd.registration.messages import RegisterAgain, Release, Say, TakeBack, Yield
from atedevd.registration.report import Report, describe
from atedevd.upgrade.machines import (BecomeMain, Exit, MainPid, Message, Predecessor, Send, StopSuccessor, Successor,
                                      UpgradeAction, UpgradePhase)

START_WORK_LATEST_S = 0.5  # the start's deferred work waits for the first Registers this long at most
INFO, ERROR = logging.INFO, logging.ERROR


class StartWork(Record):
    """The start's deferred work: every first Register is on its way (or the wait is over)."""


class WriteMetrics(Record):
    """What the metrics show may have changed."""


class ServingBegan(Record):
    """A resource began to be served: the daemon notes whether its directory is a mount."""


class ReadConfig(Record):
    """Read the configuration file again: `Process.reloaded` or `reload_failed` follows."""


ProcessAction = Union[StartWork, Status, Ready, WriteMetrics, ServingBegan, Reloading, ReadConfig, StartSuccessor,
                      Send, StopSuccessor, MainPid, Exit, BecomeMain, Say]
ACTIONS: Tuple[type, ...] = ProcessAction.__args__  # type: ignore[attr-defined]


class Process:
    """The node and the upgrade's machines, between the loop and the I/O."""

    def __init__(self, plugins: PluginDir, inherited: Optional[FrozenSet[str]] = None) -> None:
        """`inherited`: an upgrade's successor, serving what its predecessor served (these
        resources) and registering once released."""
        self.plugins = plugins
        self.host = plugins.host
        self.cfg: Optional[Config] = None  # the configuration running
        self.predecessor: Optional[Predecessor] = None  # an upgrade of ours, under way
        self.successor: Optional[Successor] = None  # until we are main
        if inherited is not None:
            plugins.hold(inherited)
            self.successor = Successor()
        self.start_work_due: Optional[float] = None
        self.reload_error: Optional[str] = None  # the last reload's, while its configuration is not running
        self._standing = Standing(False, False, False)  # where the resources stood at the node's last word
        self._status_seen: Optional[tuple] = None
        self._metrics_seen: Optional[tuple] = None
        self._out: List[ProcessAction] = []

    # --- inputs ------------------------------------------------------------------------------

    def start(self, now: float, cfg: Config) -> List[ProcessAction]:
        """The first pass over the configuration: every resource served that can be, before
        READY=1; the deferred work is due once the first Registers are out, or by the limit."""
        self.plugins.kubelet.refresh(created=False, events_lost=True)
        self.configure(now, cfg)
        self.start_work_due = now + START_WORK_LATEST_S
        return self._take()

    def configure(self, now: float, cfg: Config) -> None:
        """Adopt `cfg`: the CDI specs first (before a resource's first snapshot), then the node
        adds, removes and changes resources; the directories whose events now matter are
        watched before anything is served (what happens there from now on is news)."""
        self.cfg = cfg
        if self.host.cdi is not None:
            self.host.cdi.configure(cfg)
        self.plugins.apply(cfg.devices, cfg.dev_root, cfg.sys_root, now)
        self._watch()
        if self.plugins.reconcile(now):
            self._out.append(ServingBegan())

    def hangup(self, now: float, installed_changed: bool) -> List[ProcessAction]:
        """SIGHUP: reload, or upgrade when the installed atedevd is not the one running (a
        stop or an upgrade under way: nothing)."""
        if self.plugins.stopping or self.upgrading is not None or self.cfg is None:
            return []
        self._out.append(Reloading())
        self._out.append(StartSuccessor(tuple(self.plugins.served())) if installed_changed else ReadConfig())
        return self._take()

    def reloaded(self, now: float, cfg: Config) -> List[ProcessAction]:
        """The configuration read again and checked: its nodes are accepted as the devices', and it runs."""
        self.reload_error = None
        self.plugins.accept_nodes(now)
        self.configure(now, cfg)
        self._out.append(Say(INFO, "reloaded", f"configuration reloaded: {self.summary()}"))
        self._out.append(Ready())
        return self._take()

    def reload_failed(self, now: float, error: str) -> List[ProcessAction]:
        """The configuration could not be read or checked: the running one stays, and says so."""
        self.reload_error = error.splitlines()[0]
        self._out.append(Say(ERROR, "reload-failed", f"reload failed; keeping the running configuration:\n{error}"))
        self._out.append(Ready())
        return self._take()

    def successor_started(self, now: float, kubelet: KubeletFound) -> List[ProcessAction]:
        """A successor was started: hand over to it once it is ready, beside us where kubelet
        tracks endpoints per socket (`kubelet_endpoints`; "auto": as `kubelet` says of itself)."""
        overlap, why = upgrade_beside(self.cfg.kubelet_endpoints if self.cfg is not None else "auto", kubelet)
        self.predecessor = Predecessor(overlap, now)
        self._out.append(Say(INFO, "upgrade", "upgrade: the installed atedevd is not the one running; started it to hand "
                                              "over to, " + ("beside us (kubelet tracks endpoints per socket; " if overlap
                                                             else "once kubelet has let go of us (") + f"{why})"))
        return self._take()

    def successor_failed(self, now: float, error: str) -> List[ProcessAction]:
        self._out.append(Say(ERROR, "upgrade", f"upgrade: cannot start the new atedevd: {error}; the running one serves on"))
        self._out.append(Ready())
        return self._take()

    def stop(self, now: float) -> None:
        """SIGTERM: end our streams (the loop runs on until kubelet let go); a successor
        being started stops too."""
        if self.plugins.stopping:
            return
        p = self.predecessor
        if p is not None and p.phase is not UpgradePhase.DONE:
            self._out.append(StopSuccessor(kill=False))
        self.plugins.begin_stop(now)

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
        self._watch()
        due = self.start_work_due
        if due is not None and (now >= due or self.plugins.stopping or self.plugins.registers_sent() or self._kubelet_away()):
            self.start_work_due = None
            self._out.append(StartWork())
        self.upgrade_steps(now)
        self._changed()
        return self._take()

    def _watch(self) -> None:
        """The directories whose events can change what is served, watched when they changed (a
        resource's links lead somewhere new, or the configuration did): the host's watcher, at
        once, so that nothing served meanwhile goes unwatched."""
        dirs = self.plugins.directories_to_watch()
        if dirs is not None:
            self.host.watch(dirs)

    def _take(self) -> List[ProcessAction]:
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

    @property
    def idle(self) -> bool:
        """Nothing of its own is due but the periodic timers (the look at the nodes, kubelet's
        count): no upgrade, no deferred start work, no retry, wait, question or warning."""
        return self.start_work_due is None and self.predecessor is None and self.successor is None and self.plugins.idle

    def upgrade_steps(self, now: float) -> None:
        """What the upgrade's machines see of the node now, and what they ask for."""
        for standing in self.plugins.news():  # (the node's word, each time it changed)
            self._standing = standing
        stands = self._standing
        p, s = self.predecessor, self.successor
        if self.host.cdi is not None:
            self.host.cdi.sharing = self.upgrading is not None  # both daemons keep the specs meanwhile
        if p is not None:
            if p.phase is UpgradePhase.YIELDING and stands.yielded:
                p.let_go(now)
            p.on_timer(now)
        if s is not None:
            if s.phase is UpgradePhase.STARTING and stands.ready_on_hold:
                s.ready()
            elif s.phase is UpgradePhase.REGISTERING and stands.registered:
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
        return ", ".join(f"{v.name} ({v.device.path})" for v in (r.view() for r in self.plugins.resources.values())) \
            or "no devices"

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
        status = (shown, self.reload_error, self.host.isdir(self.plugins.plugin_dir))
        if status != self._status_seen:
            self._status_seen = status
            self._out.append(Status(self.status()))
        metrics = (shown, self.reload_error, self.plugins.allocations())
        if metrics != self._metrics_seen:
            self._metrics_seen = metrics
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
