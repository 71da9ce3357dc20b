"""The control loop: the single owner of state, dispatching events.

Inputs are inotify events (plugin directory and device directories),
signals, timers and callables posted by gRPC threads (a call finished, a
stream opened or ended). The loop hands them to the `Node` (atedevd/node.py),
which tells each `Resource` what happened; registration decisions live in
`atedevd/registration/` (no I/O). What stays here is the process: the loop,
signals, systemd, the configuration's reload and the metrics file.
"""

import gc
import logging
import math
import os
import queue
import re
import select
import signal
import time
from typing import Callable, List, Optional, Tuple

from atedevd import handoff, instance, metrics, sockets, upgrade
from atedevd.config import Config, ConfigError, load
from atedevd.host import Host
from atedevd.kubelet import warm_up
from atedevd.node import Node
from atedevd.plugin import Workers
from atedevd.registration.report import Report, describe
from atedevd.systemd import Notifier, event, set_level
from atedevd.watch import Watcher

log = logging.getLogger(__name__)

WARNING, INFO, DEBUG = logging.WARNING, logging.INFO, logging.DEBUG
OVERFLOW_SAY_EVERY_S = 60.0
START_WORK_LATEST_S = 0.5  # the start's deferred work waits for the first Registers this long at most
EXIT_STATUS_WAIT_S = 0.1  # a successor that hung up before it forked: its exit status is read within this (it names the failure)


class Daemon:
    def __init__(self, cfg: Config, config_path: str, config_required: bool, overrides: dict,
                 lock_fd: int = -1, parent: Optional[upgrade.Parent] = None):
        self.cfg = cfg
        self.config_path = config_path
        self.config_required = config_required
        self.overrides = overrides
        self.lock_fd = lock_fd  # the instance lock (a successor inherits it)
        # An upgrade (atedevd/handoff.py): as a successor, `parent` is the daemon we take over
        # from; as a predecessor, `child` is the one we hand over to.
        self.parent, self.successor = parent, handoff.Successor() if parent else None
        self.child: Optional[upgrade.Child] = None
        self.predecessor: Optional[handoff.Predecessor] = None
        self._installed: Optional[tuple] = None  # the package's files as they were once started
        self._handed_over = False  # our successor is main: exit without a last word
        self.notifier = Notifier(quiet=parent is not None)  # a successor speaks to systemd once main
        self.reload_error: Optional[str] = None
        self._inbox: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._start_work_due: Optional[float] = None
        self.exit_code = 0
        self._plugin_dir_was_mount = False  # under systemd, ReadWritePaths= binds it
        self._overflow_said: Optional[float] = None
        self._watched: frozenset = frozenset()  # the directories the watcher was last asked for
        # No thread before the first Registers (each Register starts what kubelet's calls after
        # it need, Workers.registering); the rest of the pool once they are sent (_start_work).
        self._workers = Workers(len(cfg.devices), start_now=0)
        self.metrics = metrics.TextfileWriter(None if parent else metrics.resolve_dir(cfg.metrics_dir))
        self._run_id = sockets.new_run_id()
        self.host = Host(cfg.device_plugin_dir, self._workers, self._post)
        self.node = Node(cfg.device_plugin_dir, cfg.dev_root, cfg.sys_root, self.host, self._run_id, self._serve_failed)
        if parent is not None:  # serve, but register once the predecessor says so
            self.node.held, self.node.inherited = True, parent.inherited

    # --- life cycle -----------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the caller has taken the instance lock."""
        os.umask(0o077)  # our sockets: owner only
        self._watcher = Watcher()
        self._wake_r, self._wake_w = _pipe()
        self._sig_r, sig_w = _pipe()
        signal.set_wakeup_fd(sig_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the loop reads the number from the wakeup fd
        self.node.kubelet.refresh(created=False, events_lost=True)
        self._apply(self.cfg, first=True)
        self._info = metrics.DaemonInfo.current()
        self._wall_offset = metrics.WallOffset()
        self.notifier.ready(self._status())
        event(INFO, "started", f"atedevd serving {self._summary()} in {self.cfg.device_plugin_dir}")
        self._start_work_due = time.monotonic() + START_WORK_LATEST_S
        try:
            if self.successor is not None and self.node.kubelet.serving:
                warm_up(self.cfg.device_plugin_dir)  # held: the Register on GO need not pay for grpc's first channel
            self._upgrade_steps(time.monotonic())  # a successor's sockets are bound: ready, before the loop's first wait
            self._loop()
        finally:
            self._shutdown()
        return self.exit_code

    def _loop(self) -> None:
        poller = select.poll()
        base = (self._watcher.fileno(), self._wake_r, self._sig_r)
        for fd in base:
            poller.register(fd, select.POLLIN)
        talk: Optional[int] = None  # the upgrade's channel, while there is one
        next_watchdog = time.monotonic()
        while not self.node.stopped:
            other = self._other_side()
            if (other.fileno() if other is not None else None) != talk:
                if talk is not None:
                    poller.unregister(talk)
                talk = other.fileno() if other is not None else None
                if talk is not None:
                    poller.register(talk, select.POLLIN)
            fds = base + ((talk,) if talk is not None else ())
            now = time.monotonic()
            if self.notifier.watchdog_interval and now >= next_watchdog:
                self.notifier.watchdog()
                next_watchdog = now + self.notifier.watchdog_interval
            deadlines = [self.node.deadline(), self.node.look_deadline(), self._start_work_due,
                         self.predecessor.deadline if self.predecessor is not None else None,
                         self._watcher.poll_deadline(),  # directories inotify could not watch are polled
                         next_watchdog if self.notifier.watchdog_interval else None, self.metrics.deadline()]
            deadlines = [d for d in deadlines if d is not None]
            wait = None if not deadlines else min(deadlines) - now
            for fd in _wait(poller, fds, wait):
                if fd == self._sig_r:
                    self._on_signals(os.read(fd, 64))
                elif fd == self._wake_r:
                    os.read(fd, 4096)
                    self._drain_inbox()
                elif fd == talk:
                    self._on_talk(other.receive())
                else:
                    self._on_fs_events(self._watcher.read())
            poll_at = self._watcher.poll_deadline()
            if poll_at is not None and time.monotonic() >= poll_at:
                self._on_fs_events(self._watcher.read())
            now = time.monotonic()
            if self.node.wake(now):  # a resource began to be served: is its directory our sandbox's bind?
                self._plugin_dir_was_mount = _is_mount_point(self.cfg.device_plugin_dir)
            self._watch()  # a link's node may sit in a directory not watched yet
            if self._start_work_due is not None and (
                    now >= self._start_work_due or self.node.stopping or self.node.registers_sent()):
                self._start_work()
            self._upgrade_steps(now)
            self.notifier.status(self._status())
            self._write_metrics()

    def _start_work(self) -> None:
        """What a start can do once every resource's first Register is on its way (the
        first one waits for pod-resources' answer, which comes through the loop)."""
        self._start_work_due = None
        gc.freeze()  # what the start made lives as long as the process: no collection looks at it again
        gc.enable()  # off since launch.main, for the start's imports
        log.debug("start-up done: cycle collection on, %d objects of the start frozen", gc.get_freeze_count())
        self._workers.grow(len(self.cfg.devices))  # the whole pool
        # An earlier run's dead sockets are in no one's way (every run's names are its own,
        # and kubelet neither watches nor dials them once a newer Register replaced them),
        # and removing them raises no event the loop acts on (our names are skipped).
        names = (d.resource for d in self.cfg.devices)
        for path in sockets.remove_leftovers(self.cfg.device_plugin_dir, names, keep_run=self._run_id):
            event(INFO, "leftover-removed", f"removed {path}, left behind by an earlier run", socket=path)
        self._installed = upgrade.fingerprint()  # a reload compares: the package was upgraded?
        self._write_metrics()
        if not self.node.kubelet.serving:  # kubelet comes later (boot): its first Register need not pay for grpc's first channel
            warm_up(self.cfg.device_plugin_dir)

    def _shutdown(self) -> None:
        if self._handed_over:
            event(INFO, "stopping", f"handed over to the new atedevd (pid {self.child.pid}); removing our sockets")
        else:
            event(INFO, "stopping", "stopping: removing our sockets")
        self.node.close(time.monotonic())
        sockets.remove_standby_dir(self.cfg.device_plugin_dir)  # nothing of ours left in kubelet's directory
        self._write_metrics(force=True)  # the last word: every resource stopped, not registered (not after a handover: off)
        self._workers.shutdown(wait=False)
        self._watcher.close()

    def _begin_stop(self) -> None:
        """End our streams; the loop runs on until kubelet has let go of them (bounded)."""
        if self.node.stopping:
            return
        self.notifier.stopping()
        if self.child is not None and self.predecessor is not None and self.predecessor.phase is not handoff.Phase.DONE:
            self.child.terminate()  # an upgrade under way: the new one stops too
        self.node.begin_stop(time.monotonic())

    # --- inputs ---------------------------------------------------------------

    def _post(self, call: Callable[[], None]) -> None:
        """Called from gRPC threads: hand a callable to the loop and wake it."""
        self._inbox.put(call)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the loop is already due to wake

    def _drain_inbox(self) -> None:
        while True:
            try:
                call = self._inbox.get_nowait()
            except queue.Empty:
                return
            call()

    def _on_signals(self, signums: bytes) -> None:
        for signum in signums:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self._begin_stop()
            elif signum == signal.SIGHUP and not self.node.stopping and self._upgrading() is None:
                self._reload()

    def _on_fs_events(self, events) -> None:
        if self.node.on_directory_events(events, time.monotonic()).overflowed:
            self._overflowed()

    def _overflowed(self) -> None:
        """Said once a minute at most: the kernel dropped events (a burst in a watched directory)."""
        now = time.monotonic()
        if self._overflow_said is not None and now - self._overflow_said < OVERFLOW_SAY_EVERY_S:
            return
        self._overflow_said = now
        try:
            with open("/proc/sys/fs/inotify/max_queued_events") as f:
                limit = f" (fs.inotify.max_queued_events is {f.read().strip()})"
        except OSError:
            limit = ""
        event(WARNING, "inotify-overflow", f"the inotify queue overflowed{limit}: events were lost; re-checking kubelet.sock, our sockets and the devices")

    # --- serving --------------------------------------------------------------

    def _serve_failed(self, path: str, error: OSError) -> bool:
        """A socket could not be bound. True when that means the daemon must restart."""
        if not self._plugin_dir_replaced():
            return False
        event(logging.ERROR, "plugin-dir-replaced", f"{self.cfg.device_plugin_dir} was replaced while atedevd ran and is read-only in its view (the sandbox bound the old one); exiting so that systemd restarts atedevd with a fresh view", socket=path)
        self._begin_stop()
        self.exit_code = 1
        return True

    def _plugin_dir_replaced(self) -> bool:
        """Our sandbox's writable bind of the plugin directory is gone (kubelet's
        directory was deleted and made anew) and what is there now is read-only to us."""
        path = self.cfg.device_plugin_dir
        return self._plugin_dir_was_mount and not _is_mount_point(path) and not os.access(path, os.W_OK)

    # --- configuration --------------------------------------------------------------

    def _apply(self, cfg: Config, first: bool = False) -> None:
        """Adopt `cfg`: the node adds, removes and changes resources (atedevd/node.py)."""
        if not first and cfg.device_plugin_dir != self.cfg.device_plugin_dir:
            event(WARNING, "reload", f"device_plugin_dir cannot change on reload; still using {self.cfg.device_plugin_dir} (restart to change it)")
            cfg = cfg._replace(device_plugin_dir=self.cfg.device_plugin_dir)
        set_level(cfg.log_level)
        if not first and cfg.metrics_dir != self.cfg.metrics_dir:
            self.metrics = metrics.TextfileWriter(metrics.resolve_dir(cfg.metrics_dir))
        self.cfg = cfg
        if not first:  # the first pass runs on the threads started in __init__; run() starts the rest
            self._workers.grow(len(cfg.devices))
        now = time.monotonic()
        self.node.apply(cfg.devices, cfg.dev_root, cfg.sys_root, now)
        self._watch()
        if self.node.reconcile(now):
            self._plugin_dir_was_mount = _is_mount_point(self.cfg.device_plugin_dir)

    def _watch(self) -> None:
        """Watch kubelet's directory and every directory whose events can change what a
        resource serves: its nodes', and those its links lead through (atedevd/devices.py)."""
        dirs = self.node.directories() | {self.cfg.device_plugin_dir}
        if dirs != self._watched:
            new = dirs - self._watched
            self._watched = dirs
            self._watcher.want(dirs)
            if new:  # a change there before its watch was armed has no event: look once more
                for r in self.node.resources.values():
                    r.nodes_may_have_changed()

    def _reload(self) -> None:
        self.notifier.reloading()
        if self._installed is not None and upgrade.fingerprint() != self._installed:
            self._upgrade()
            return
        try:
            cfg = load(self.config_path, required=self.config_required, overrides=self.overrides)
        except ConfigError as e:
            self.reload_error = str(e).splitlines()[0]
            event(logging.ERROR, "reload-failed", f"reload failed; keeping the running configuration:\n{e}")
        else:
            self.reload_error = None
            self.node.accept_nodes()  # the checked configuration accepts the nodes there now
            self._apply(cfg)
            event(INFO, "reloaded", f"configuration reloaded: {self._summary()}")
        self.notifier.ready(self._status())

    # --- an upgrade, handed to a warm successor (atedevd/handoff.py) --------------------------

    def _upgrading(self) -> Optional[str]:
        """Which side of an upgrade under way this daemon is on, if any."""
        if self.predecessor is not None and not (self.predecessor.over and self.predecessor.phase is handoff.Phase.FAILED):
            return "predecessor"
        if self.successor is not None and self.parent is not None:
            return "successor"
        return None

    def _other_side(self):
        """The other process of an upgrade under way (its channel), if any."""
        if self.child is not None and self.child.talking:
            return self.child
        return self.parent

    def _upgrade(self) -> None:
        """The installed atedevd is another: start it, and hand over to it once it is ready."""
        now = time.monotonic()
        served = [r.name for r in self.node.resources.values() if r.advertised]
        try:
            self.child = upgrade.Child(self.lock_fd, served)
        except OSError as e:
            event(logging.ERROR, "upgrade", f"upgrade: cannot start the new atedevd: {e}; the running one serves on")
            self.notifier.ready(self._status())
            return
        overlap = self.cfg.kubelet_endpoints == "per-socket"
        event(INFO, "upgrade", f"upgrade: the installed atedevd is not the one running; started it "
              f"to hand over to, {'beside us (kubelet tracks endpoints per socket)' if overlap else 'once kubelet has let go of us'}")
        self.predecessor = handoff.Predecessor(overlap, now)

    def _on_talk(self, messages) -> None:
        now = time.monotonic()
        for message in messages:
            if self.predecessor is not None:
                # (it may have died since it spoke; once it hung up, its status is a moment away)
                gone = self.child.ended(EXIT_STATUS_WAIT_S if message is None else 0.0)
                if message is None or gone:
                    self.child.hang_up()
                    self.predecessor.exited(now, gone or "closed its end of the channel")
                    message = None
                else:
                    self.predecessor.received(now, message)
            elif message is None:  # the predecessor exited (or died)
                if self.successor is not None:
                    self.successor.predecessor_gone()
                self.parent.close()
                self.parent = None
            elif self.successor is not None:
                self.successor.received(message)
            self._upgrade_steps(now)
            if message is None:
                return

    def _upgrade_steps(self, now: float) -> None:
        """What the upgrade's machines see of the node now, and what they ask for."""
        p, s = self.predecessor, self.successor
        if self.child is not None:
            self.child.ended()  # reaped as soon as it has exited
        handoff.observe(now, self.node, p, s)
        for machine, perform in ((p, self._as_predecessor), (s, self._as_successor)):
            for a in machine.take() if machine is not None else ():
                handoff.to_node(now, self.node, a)
                perform(a)

    def _as_predecessor(self, a) -> None:
        """The process's part of the predecessor's action (`handoff.to_node` did the node's)."""
        if isinstance(a, handoff.Send):
            self.child.send(a.message)
        elif isinstance(a, handoff.Stop):
            if a.kill:
                self.child.kill()
            else:
                self.child.terminate()  # it lets go of what it registered; its exit ends the talk
        elif isinstance(a, handoff.TakeBack):
            self.notifier.ready(self._status())  # the reload is over: we serve on
        elif isinstance(a, handoff.MainPid):
            self.notifier.hand_over(self.child.pid)
        elif isinstance(a, handoff.Exit):
            self._handed_over = True  # no STOPPING=1: the unit goes on, with the new main process
            self.metrics = metrics.TextfileWriter(None)  # the successor's now
        elif isinstance(a, handoff.Say):
            event(a.level, "upgrade", a.text)

    def _as_successor(self, a) -> None:
        if isinstance(a, handoff.Send):
            self.parent.send(a.message)
        elif isinstance(a, handoff.BecomeMain):
            instance.adopt(self.lock_fd)
            self.notifier.become_main()
            self.notifier.ready(self._status())
            self.metrics = metrics.TextfileWriter(metrics.resolve_dir(self.cfg.metrics_dir))
            self.successor = None
            event(INFO, "upgraded", f"took over as systemd's main process: atedevd serving {self._summary()}")

    # --- reporting ------------------------------------------------------------------

    def _write_metrics(self, force: bool = False) -> None:
        """atedevd.prom, when it changed or is due (rendered at most once a second)."""
        self.metrics.update(self._render_metrics, time.monotonic(), force=force)

    def _render_metrics(self) -> str:
        return metrics.render(self._info, self.node.reports(), polling=self._watcher.poll_deadline() is not None,
                              reload_ok=self.reload_error is None, wall_offset=self._wall_offset.current())

    def _summary(self) -> str:
        return ", ".join(f"{r.name} ({r.device.path})" for r in self.node.resources.values()) or "no devices"

    def _status(self) -> str:
        parts: List[str] = []
        if self.reload_error:
            parts.append(f"reload failed, running previous config: {self.reload_error}")
        dir_ok = os.path.isdir(self.cfg.device_plugin_dir)
        now, wall = time.monotonic(), time.time()
        for r in self.node.reports():
            parts.append(f"{r.name}: {self._describe(r, dir_ok, now, wall)}")
        return "; ".join(parts) or "no devices configured"

    def _describe(self, r: Report, dir_ok: bool, now: float, wall: float) -> str:
        if not r.advertised:
            return f"no node matches {r.device_path}, not advertised" if r.pattern else \
                f"{r.device_path} missing, not advertised"
        if not dir_ok:
            return f"waiting for {self.cfg.device_plugin_dir}"
        return describe(r, now, wall)


def _wait(poller: "select.poll", fds: Tuple[int, ...], wait: Optional[float]) -> List[int]:
    """The fds readable within `wait` seconds (None: until one is). Slept, never spun for (a
    busy loop would take the CPU from the kubelet we wait for): poll() counts whole
    milliseconds, so a shorter wait (the retries while kubelet.sock is not yet listened on,
    a quarter of a millisecond apart) is select()'s, which counts microseconds."""
    if wait is not None and 0 < wait < 0.001 and max(fds) < 1024:  # FD_SETSIZE
        return select.select(fds, [], [], wait)[0]
    return [fd for fd, _ in poller.poll(None if wait is None else max(0, math.ceil(wait * 1000)))]


def _is_mount_point(path: str) -> bool:
    """From /proc/self/mountinfo: a bind mount on the same filesystem is invisible to os.path.ismount."""
    target = os.fsencode(os.path.abspath(path))
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            mount_points = [line.split(b" ")[4] for line in f]
    except (OSError, IndexError):
        return False
    unescape = lambda m: bytes([int(m.group(1), 8)])  # noqa: E731 - "\040" is a space
    return any(re.sub(rb"\\([0-7]{3})", unescape, mp) == target for mp in mount_points)


def _pipe() -> Tuple[int, int]:
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    return r, w
