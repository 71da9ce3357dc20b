"""The control loop: the single owner of state, dispatching events.

Inputs are inotify events (plugin directory and device directories),
signals, timers and callables posted by gRPC threads (a call finished, a
stream opened or ended). Registration decisions live in `registration.py`
(no I/O) and are carried out by `registrar.py`; this loop tracks device
presence, kubelet.sock and the plugin directory, and tells each resource's
`Registrar` what happened.
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
from typing import Callable, Dict, List, Optional, Tuple

import inotify.constants as ic

from atedevd import devices, metrics, sockets
from atedevd.config import Config, ConfigError, Device, load
from atedevd.kubelet import KUBELET_SOCKET, KubeletView, warm_up
from atedevd.plugin import Workers
from atedevd.registrar import Context, Registrar
from atedevd.registration import State
from atedevd.systemd import Notifier, event, set_level
from atedevd.watch import Watcher

log = logging.getLogger(__name__)

WARNING, INFO, DEBUG = logging.WARNING, logging.INFO, logging.DEBUG
# Events after which some may be missing: look at kubelet.sock itself.
OVERFLOW_SAY_EVERY_S = 60.0
START_WORK_LATEST_S = 0.5  # the start's deferred work waits for the first Registers this long at most
_LOST_EVENTS = ic.IN_Q_OVERFLOW | ic.IN_DELETE_SELF | ic.IN_MOVE_SELF | ic.IN_IGNORED


class Resource:
    """The loop's record of one configured device."""

    def __init__(self, device: Device, reg: Optional[Registrar] = None) -> None:
        self.device = device
        self.reg = reg  # type: ignore[assignment] - None only while the resource is being added
        self.advertised = False  # once served, kept served (Unhealthy while the node is missing)
        self.present: Optional[bool] = None
        self.version = 0
        # Its nodes as last looked at, made at the first look: devices.table() (a SharedTable, or a
        # patterns.ExclusiveTable for a pattern: look(), snapshot(), forget(), healthy, advertised).
        self.table = None

    @property
    def name(self) -> str:
        return self.device.resource


class Daemon:
    def __init__(self, cfg: Config, config_path: str, config_required: bool, overrides: dict):
        self.cfg = cfg
        self.config_path = config_path
        self.config_required = config_required
        self.overrides = overrides
        self.notifier = Notifier()
        self.resources: Dict[str, Resource] = {}
        self.reload_error: Optional[str] = None
        self._inbox: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._stopping = False
        self._start_work_due: Optional[float] = None
        self.exit_code = 0
        self._plugin_dir_was_mount = False  # under systemd, ReadWritePaths= binds it
        self._overflow_said = -OVERFLOW_SAY_EVERY_S
        # No thread before the first Registers (each Register starts what kubelet's calls after
        # it need, Workers.registering); the rest of the pool once they are sent (_start_work).
        self._workers = Workers(len(cfg.devices), start_now=0)
        self.kubelet = KubeletView(cfg.device_plugin_dir)
        self.metrics = metrics.TextfileWriter(metrics.resolve_dir(cfg.metrics_dir))
        self._ctx = Context(cfg.device_plugin_dir, sockets.new_run_id(), self._workers, self.kubelet, self._post, self._serve_failed)

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
        self.kubelet.refresh(created=False, events_lost=True)
        self._apply(self.cfg, first=True)
        self._info = metrics.DaemonInfo.current()
        self._wall_offset = metrics.WallOffset()
        self.notifier.ready(self._status())
        event(INFO, "started", f"atedevd serving {self._summary()} in {self.cfg.device_plugin_dir}")
        self._start_work_due = time.monotonic() + START_WORK_LATEST_S
        try:
            self._loop()
        finally:
            self._shutdown()
        return self.exit_code

    def _loop(self) -> None:
        poller = select.poll()
        fds = (self._watcher.fileno(), self._wake_r, self._sig_r)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        next_watchdog = time.monotonic()
        while not (self._stopping and all(r.reg.stopped for r in self.resources.values())):
            now = time.monotonic()
            if self.notifier.watchdog_interval and now >= next_watchdog:
                self.notifier.watchdog()
                next_watchdog = now + self.notifier.watchdog_interval
            deadlines = [r.reg.deadline for r in self.resources.values() if r.reg.deadline is not None]
            if self._start_work_due is not None:
                deadlines.append(self._start_work_due)
            if self.notifier.watchdog_interval:
                deadlines.append(next_watchdog)
            poll_at = self._watcher.poll_deadline()  # directories inotify could not watch are polled
            if poll_at is not None:
                deadlines.append(poll_at)
            if self.metrics.enabled:
                deadlines.append(self.metrics.deadline())
            wait = None if not deadlines else min(deadlines) - now
            for fd in _wait(poller, fds, wait):
                if fd == self._sig_r:
                    self._on_signals(os.read(fd, 64))
                elif fd == self._wake_r:
                    os.read(fd, 4096)
                    self._drain_inbox()
                else:
                    self._on_fs_events(self._watcher.read())
            poll_at = self._watcher.poll_deadline()
            if poll_at is not None and time.monotonic() >= poll_at:
                self._on_fs_events(self._watcher.read())
            now = time.monotonic()
            if not self._stopping and any(r.reg.retry_due(now) for r in self.resources.values()):
                self._look_at_kubelet(created=False, lost=True)  # in case an event was lost
            for r in list(self.resources.values()):
                if r.reg.deadline is not None and r.reg.deadline <= now:
                    r.reg.on_timer(now)
            self._reconcile()
            if self._start_work_due is not None and (
                    now >= self._start_work_due or self._stopping
                    or all(r.reg.registers_sent or r.reg.state is not State.WAITING for r in self.resources.values())):
                self._start_work()
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
        for path in sockets.remove_leftovers(self.cfg.device_plugin_dir, names, keep_run=self._ctx.run_id):
            event(INFO, "leftover-removed", f"removed {path}, left behind by an earlier run", socket=path)
        self._write_metrics()
        if not self.kubelet.serving:  # kubelet comes later (boot): its first Register need not pay for grpc's first channel
            warm_up(self.cfg.device_plugin_dir)

    def _shutdown(self) -> None:
        event(INFO, "stopping", "stopping: removing our sockets")
        for r in self.resources.values():
            r.reg.close()
        sockets.remove_standby_dir(self.cfg.device_plugin_dir)  # nothing of ours left in kubelet's directory
        self._write_metrics(force=True)  # the last word: every resource stopped, not registered
        self._workers.shutdown(wait=False)
        self._watcher.close()

    def _begin_stop(self) -> None:
        """End our streams; the loop runs on until kubelet has let go of them (bounded)."""
        if self._stopping:
            return
        self._stopping = True
        self.notifier.stopping()
        now = time.monotonic()
        for r in self.resources.values():
            r.reg.begin_stop(now)

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
            elif signum == signal.SIGHUP and not self._stopping:
                self._reload()

    def _on_fs_events(self, events) -> None:
        plugin_dir = os.path.normpath(self.cfg.device_plugin_dir)
        ours = tuple(sockets.prefix(n) + "." for n in self.resources) + (sockets.STANDBY_DIR,)
        created = lost = news = False
        if any(ev.is_(ic.IN_Q_OVERFLOW) for ev in events):
            self._overflowed()
        for ev in events:
            lost |= ev.is_(_LOST_EVENTS) or (ev.is_(ic.IN_ISDIR) and ev.is_(ic.IN_CREATE | ic.IN_MOVED_TO))
            if ev.directory != plugin_dir or ev.name.startswith(ours):
                continue
            news = True
            created |= ev.name == KUBELET_SOCKET and ev.is_(ic.IN_CREATE | ic.IN_MOVED_TO)
        if self._stopping:
            return
        self._look_at_kubelet(created, lost)
        if news or lost:  # any news from kubelet's side cuts a retry wait short
            now = time.monotonic()
            for r in self.resources.values():
                r.reg.nudge(now)

    def _look_at_kubelet(self, created: bool, lost: bool) -> None:
        """Tell every resource when kubelet.sock appeared anew or went away."""
        now = time.monotonic()
        if self.kubelet.refresh(created, events_lost=lost):
            for r in self.resources.values():
                r.reg.kubelet_started(now)
        elif self.kubelet.gone:
            self.kubelet.gone = False
            for r in self.resources.values():
                r.reg.kubelet_gone(now)

    def _overflowed(self) -> None:
        """Said once a minute at most: the kernel dropped events (a burst in a watched directory)."""
        now = time.monotonic()
        if now - self._overflow_said < OVERFLOW_SAY_EVERY_S:
            return
        self._overflow_said = now
        try:
            with open("/proc/sys/fs/inotify/max_queued_events") as f:
                limit = f" (fs.inotify.max_queued_events is {f.read().strip()})"
        except OSError:
            limit = ""
        event(WARNING, "inotify-overflow", f"the inotify queue overflowed{limit}: events were lost; re-checking kubelet.sock, our sockets and the devices")

    # --- serving --------------------------------------------------------------

    def _reconcile(self) -> None:
        """Make what is served match what exists: devices, the plugin directory, our sockets."""
        if self._stopping:
            return
        now = time.monotonic()
        dir_ok = os.path.isdir(self.cfg.device_plugin_dir)
        for r in self.resources.values():
            self._check_presence(r, now)
            if not dir_ok:
                r.reg.unserve(now, "the plugin directory is gone")
            elif r.advertised:
                unserved = r.reg.state is State.UNSERVED
                r.reg.serve(now)
                if unserved and r.reg.state is not State.UNSERVED:
                    self._plugin_dir_was_mount = _is_mount_point(self.cfg.device_plugin_dir)
                r.reg.check_sockets(now)

    def _check_presence(self, r: Resource, now: float) -> None:
        if r.present is None:  # new, or its configuration changed: whatever node is there now is judged afresh
            r.table = devices.table(r.device, self.cfg.dev_root, self.cfg.sys_root)
        changes, changed = r.table.look()
        for c in changes:
            event(c.level, c.event, f"{r.name}: {c.message}", resource=r.name, device=c.device or r.device.path)
        if not changed:
            return
        r.present = r.table.healthy
        r.advertised |= r.table.advertised
        if r.reg is not None:  # None while the resource is being added
            r.reg.publish(self._snapshot(r), now)

    def _snapshot(self, r: Resource) -> devices.Snapshot:
        r.version += 1
        return r.table.snapshot(r.version)

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
        """Adopt `cfg`: resources added start, removed stop, changed register anew
        (handing over their old socket), unchanged are not touched."""
        old_root, old_sys = self.cfg.dev_root, self.cfg.sys_root
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
        wanted = {d.resource: d for d in cfg.devices}
        for name in list(self.resources):
            r = self.resources[name]
            if name not in wanted:
                r.reg.close()
                del self.resources[name]
                event(INFO, "resource-removed", f"{name}: no longer configured; stopped serving it", resource=name)
            elif wanted[name] != r.device or cfg.dev_root != old_root or cfg.sys_root != old_sys:
                r.device, r.present = wanted[name], None
                self._check_presence(r, now)
                r.reg.reconfigure(r.device, self._snapshot(r), now)
                event(INFO, "resource-changed", f"{name}: configuration changed; registering it anew", resource=name)
        for name, device in wanted.items():
            if name not in self.resources:
                r = Resource(device)
                self._check_presence(r, now)
                r.reg = Registrar(device, self._snapshot(r), self._ctx)
                self.resources[name] = r
        dirs = [self.cfg.device_plugin_dir] + [p for d in cfg.devices for p in devices.directories(d, cfg.dev_root)]
        self._watcher.want(dirs)
        self._reconcile()

    def _reload(self) -> None:
        self.notifier.reloading()
        try:
            cfg = load(self.config_path, required=self.config_required, overrides=self.overrides)
        except ConfigError as e:
            self.reload_error = str(e).splitlines()[0]
            event(logging.ERROR, "reload-failed", f"reload failed; keeping the running configuration:\n{e}")
        else:
            self.reload_error = None
            for r in self.resources.values():  # the checked configuration accepts the nodes there now
                r.table.forget()
            self._apply(cfg)
            event(INFO, "reloaded", f"configuration reloaded: {self._summary()}")
        self.notifier.ready(self._status())

    # --- reporting ------------------------------------------------------------------

    def _write_metrics(self, force: bool = False) -> None:
        """atedevd.prom, when it changed or is due (rendered at most once a second)."""
        self.metrics.update(self._render_metrics, time.monotonic(), force=force)

    def _render_metrics(self) -> str:
        return metrics.render(self._info, (r.reg for r in self.resources.values()), State,
                              polling=self._watcher.poll_deadline() is not None,
                              reload_ok=self.reload_error is None, wall_offset=self._wall_offset.current())

    def _summary(self) -> str:
        return ", ".join(f"{r.name} ({r.device.path})" for r in self.resources.values()) or "no devices"

    def _status(self) -> str:
        parts: List[str] = []
        if self.reload_error:
            parts.append(f"reload failed, running previous config: {self.reload_error}")
        dir_ok = os.path.isdir(self.cfg.device_plugin_dir)
        for r in self.resources.values():
            parts.append(f"{r.name}: {self._describe(r, dir_ok)}")
        return "; ".join(parts) or "no devices configured"

    def _describe(self, r: Resource, dir_ok: bool) -> str:
        if not r.advertised:
            return f"no node matches {r.device.path}, not advertised" if r.device.pattern else \
                f"{r.device.path} missing, not advertised"
        if not dir_ok:
            return f"waiting for {self.cfg.device_plugin_dir}"
        return r.reg.describe()


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
