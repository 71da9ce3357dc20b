"""The control loop: the single owner of state, reacting to events.

Inputs are inotify events (plugin directory and device directories),
signals, timers (retry backoff, watchdog) and messages posted by gRPC threads
(a registration finished, kubelet ended a stream). Each wake-up ends with a
reconcile pass that compares what should be served with what is.
"""

import logging
import os
import queue
import re
import select
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import inotify.constants as ic

from atedevd import devices
from atedevd.config import Config, ConfigError, Device, load
from atedevd.plugin import PluginServer, Workers
from atedevd.registration import KUBELET_SOCKET, Attempt, Backoff
from atedevd.systemd import Notifier, event, set_level
from atedevd.watch import Watcher

log = logging.getLogger(__name__)

# A registration that held this long is stable: the next loss starts the backoff afresh.
STABLE_AFTER_S = 10.0
WARNING, INFO, DEBUG = logging.WARNING, logging.INFO, logging.DEBUG


@dataclass
class Resource:
    """The loop's record of one configured device."""

    device: Device
    server: Optional[PluginServer] = None
    advertised: bool = False  # once served, kept served (Unhealthy while the node is missing)
    present: Optional[bool] = None
    version: int = 0
    state: str = "absent"  # absent | waiting | registering | registered
    attempt: Optional[Attempt] = None
    generation: int = 0
    retry_at: Optional[float] = None
    backoff: Backoff = field(default_factory=Backoff)
    registered_at: Optional[float] = None
    lost_at: Optional[float] = None
    last_error: Optional[str] = None
    serve_error: Optional[str] = None
    last_reregistration: Optional[Tuple[float, float]] = None  # wall time, seconds taken
    registrations: int = 0

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
        self._inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._stopping = False
        self.exit_code = 0
        self._plugin_dir_was_mount = False  # under systemd, ReadWritePaths= binds it
        self._workers = Workers()

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
        self._apply(self.cfg, first=True)
        self.notifier.ready(self._status())
        event(INFO, "started", f"atedevd serving {self._summary()} in {self.cfg.device_plugin_dir}")
        try:
            self._loop()
        finally:
            self._shutdown()
        return self.exit_code

    def _loop(self) -> None:
        poller = select.poll()
        for fd in (self._watcher.fileno(), self._wake_r, self._sig_r):
            poller.register(fd, select.POLLIN)
        next_watchdog = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if self.notifier.watchdog_interval and now >= next_watchdog:
                self.notifier.watchdog()
                next_watchdog = now + self.notifier.watchdog_interval
            deadlines = [r.retry_at for r in self.resources.values() if r.retry_at is not None]
            if self.notifier.watchdog_interval:
                deadlines.append(next_watchdog)
            poll_at = self._watcher.poll_deadline()  # directories inotify could not watch are polled
            if poll_at is not None:
                deadlines.append(poll_at)
            timeout = None if not deadlines else max(0, int((min(deadlines) - now) * 1000) + 1)
            for fd, _ in poller.poll(timeout):
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
            self._on_timers()
            self._reconcile()
            self.notifier.status(self._status())

    def _shutdown(self) -> None:
        self.notifier.stopping()
        event(INFO, "stopping", "stopping: removing our sockets")
        for r in self.resources.values():
            self._stop_serving(r)
        self._workers.executor.shutdown(wait=False)
        self._watcher.close()

    # --- inputs ---------------------------------------------------------------

    def _post(self, message: tuple) -> None:
        """Called from gRPC threads: hand a message to the loop and wake it."""
        self._inbox.put(message)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the loop is already due to wake

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind, *args = message
            if kind == "registered":
                self._on_register_done(*args)
            elif kind == "stream-ended":
                self._on_stream_end(*args)

    def _on_signals(self, signums: bytes) -> None:
        for signum in signums:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self._stopping = True
            elif signum == signal.SIGHUP and not self._stopping:
                self._reload()

    def _on_fs_events(self, events) -> None:
        plugin_dir = os.path.normpath(self.cfg.device_plugin_dir)
        ours = {devices.socket_name(n) for n in self.resources}
        kubelet_back = False
        for ev in events:
            if ev.is_(ic.IN_Q_OVERFLOW):
                kubelet_back = True  # events were lost: assume the worst
            if ev.directory != plugin_dir or ev.name in ours:
                continue
            if ev.name == KUBELET_SOCKET and ev.is_(ic.IN_CREATE | ic.IN_MOVED_TO):
                kubelet_back = True
            for r in self.resources.values():  # any news from kubelet's side cuts a wait short
                if r.retry_at is not None:
                    r.retry_at = time.monotonic()
        if kubelet_back:
            since = time.monotonic()
            self._reconcile()  # our sockets first: kubelet deleted them before serving again
            for r in self.resources.values():
                if r.attempt is not None and r.attempt.started >= since:
                    continue  # re-served just now, and registering with this kubelet already
                if r.server is not None:
                    if r.state == "registered":
                        event(WARNING, "kubelet-restarted", f"{r.name}: kubelet is serving anew; registering again", resource=r.name)
                        r.lost_at = time.monotonic()
                    r.backoff.reset()  # kubelet may refuse for a moment between bind and listen
                    self._register(r)

    def _on_timers(self) -> None:
        now = time.monotonic()
        for r in self.resources.values():
            if r.retry_at is not None and r.retry_at <= now and r.attempt is None:
                r.retry_at = None
                if r.server is not None:
                    self._register(r)

    # --- serving --------------------------------------------------------------

    def _reconcile(self) -> None:
        """Make what is served match what exists: devices, the plugin directory, our sockets."""
        dir_ok = os.path.isdir(self.cfg.device_plugin_dir)
        for r in self.resources.values():
            self._check_presence(r)
            if r.server is not None and not (dir_ok and r.server.socket_is_ours()):
                self._lose_socket(r, dir_ok)
            if r.server is None and r.advertised and dir_ok:
                self._start_serving(r)

    def _check_presence(self, r: Resource) -> None:
        found = devices.presence(r.device, self.cfg.dev_root)
        present = found == "present"
        if present == r.present:
            return
        first = r.present is None
        r.present = present
        where = r.device.host_path(self.cfg.dev_root)
        if present:
            if not first:
                event(INFO, "device-present", f"{r.name}: {r.device.path} is present again" if r.advertised else f"{r.name}: {r.device.path} appeared; advertising it", resource=r.name, device=r.device.path)
            r.advertised = True
        elif found == "missing":
            level = INFO if first else WARNING
            event(level, "device-missing", f"{r.name}: {r.device.path} is missing ({where}); {'units are Unhealthy' if r.advertised else 'not advertised until it appears'}", resource=r.name, device=r.device.path)
        else:
            event(WARNING, "device-missing", f"{r.name}: {where} is {found}; treating it as missing", resource=r.name, device=r.device.path)
        if r.server is not None:
            self._publish(r)

    def _publish(self, r: Resource) -> None:
        r.version += 1
        r.server.publish(devices.Snapshot.build(r.device, bool(r.present), r.version))

    def _start_serving(self, r: Resource) -> None:
        path = os.path.join(self.cfg.device_plugin_dir, devices.socket_name(r.name))
        server = PluginServer(r.device, path, self._workers, self._stream_callback(r))
        r.server = server
        self._publish(r)
        try:
            server.start()
        except OSError as e:
            if self._plugin_dir_replaced():
                event(logging.ERROR, "plugin-dir-replaced", f"{self.cfg.device_plugin_dir} was replaced while atedevd ran and is read-only in its view (the sandbox bound the old one); exiting so that systemd restarts atedevd with a fresh view", socket=path)
                self._stopping = True
                self.exit_code = 1
                return
            error = f"{r.name}: cannot serve on {path}: {e}"
            if error != r.serve_error:  # retried on every wake-up; said once
                event(logging.ERROR, "serve-failed", error, resource=r.name, socket=path)
            r.serve_error = error
            r.server = None
            r.state = "absent"
            # Retry on a timer too: a directory made writable again (a remount) raises no event.
            r.retry_at = time.monotonic() + r.backoff.next()
            return
        r.serve_error = None
        self._plugin_dir_was_mount = _is_mount_point(self.cfg.device_plugin_dir)
        r.backoff.reset()
        event(INFO if r.registrations == 0 else DEBUG, "serving", f"{r.name}: serving {r.device.count} units of {r.device.path} on {path}", resource=r.name, device=r.device.path, socket=path)
        self._register(r)

    def _plugin_dir_replaced(self) -> bool:
        """Our sandbox's writable bind of the plugin directory is gone (kubelet's
        directory was deleted and made anew) and what is there now is read-only to us."""
        path = self.cfg.device_plugin_dir
        return self._plugin_dir_was_mount and not _is_mount_point(path) and not os.access(path, os.W_OK)

    def _lose_socket(self, r: Resource, dir_ok: bool) -> None:
        path = r.server.socket_path
        if r.state == "registered":
            why = "was deleted (kubelet is restarting?)" if dir_ok else "directory is gone"
            event(WARNING, "registration-lost", f"{r.name}: lost registration: our socket {path} {why}", resource=r.name, socket=path)
            r.lost_at = time.monotonic()
        self._stop_serving(r)

    def _stop_serving(self, r: Resource) -> None:
        if r.attempt is not None:
            r.attempt.cancel()
            r.attempt = None
        if r.server is not None:
            r.server.stop()
            r.server = None
        r.state = "absent"
        r.retry_at = None

    def _stream_callback(self, r: Resource):
        def on_end(generation: int) -> None:
            self._post(("stream-ended", r.name, generation))

        return on_end

    # --- registration -----------------------------------------------------------

    def _register(self, r: Resource) -> None:
        """Start a Register attempt now, replacing any in flight."""
        if r.attempt is not None:
            r.attempt.cancel()
            r.attempt = None
        r.retry_at = None
        if not os.path.exists(os.path.join(self.cfg.device_plugin_dir, KUBELET_SOCKET)):
            self._waiting(r, "kubelet.sock does not exist yet", retry=False)
            return
        r.server.end_streams()  # kubelet must see old streams end before the new Register
        r.generation = r.server.new_generation()
        r.state = "registering"
        r.attempt = Attempt(
            self.cfg.device_plugin_dir,
            r.name,
            devices.socket_name(r.name),
            lambda a, error: self._post(("registered", r.name, a, error)),
        )

    def _on_register_done(self, name: str, attempt: Attempt, error: Optional[str]) -> None:
        attempt.close()
        r = self.resources.get(name)
        if r is None or attempt is not r.attempt:
            return  # superseded
        r.attempt = None
        if error is not None:
            self._waiting(r, error, retry=True)
            return
        now = time.monotonic()
        r.state = "registered"
        r.registrations += 1
        r.registered_at = now
        r.last_error = None
        if r.lost_at is not None:
            took = now - r.lost_at
            r.last_reregistration = (time.time(), took)
            r.lost_at = None
            event(INFO, "reregistered", f"{r.name}: registered again with kubelet ({took * 1000:.0f} ms after the loss)", resource=r.name)
        elif r.registrations == 1:
            event(INFO, "registered", f"{r.name}: registered with kubelet ({r.device.count} units of {r.device.path})", resource=r.name, socket=r.server.socket_path)
        else:
            event(INFO, "reregistered", f"{r.name}: registered again with kubelet", resource=r.name)

    def _waiting(self, r: Resource, reason: str, retry: bool) -> None:
        r.state = "waiting"
        if reason != r.last_error and r.registrations == 0:
            event(INFO, "waiting-for-kubelet", f"{r.name}: waiting for kubelet: {reason}", resource=r.name)
        else:  # retries, and the expected gaps of a restarting kubelet
            log.debug("%s: waiting for kubelet: %s", r.name, reason)
        r.last_error = reason
        r.retry_at = time.monotonic() + r.backoff.next() if retry else None

    def _on_stream_end(self, name: str, generation: int) -> None:
        """kubelet ended the stream it opened for our current registration."""
        r = self.resources.get(name)
        if r is None or r.server is None or generation != r.generation:
            return
        if r.state not in ("registered", "registering"):
            return
        now = time.monotonic()
        event(WARNING, "stream-ended", f"{r.name}: kubelet ended our ListAndWatch stream; registering again", resource=r.name)
        if r.state == "registered":
            r.lost_at = now
            if r.registered_at is not None and now - r.registered_at > STABLE_AFTER_S:
                r.backoff.reset()
        if r.attempt is not None:
            r.attempt.cancel()
            r.attempt = None
        r.state = "waiting"
        r.retry_at = now + r.backoff.next()  # a kubelet that keeps dropping us is not hammered

    # --- configuration --------------------------------------------------------------

    def _apply(self, cfg: Config, first: bool = False) -> None:
        """Adopt `cfg`: resources added start, removed stop, unchanged are not touched."""
        old_root = self.cfg.dev_root
        if not first and cfg.device_plugin_dir != self.cfg.device_plugin_dir:
            event(WARNING, "reload", f"device_plugin_dir cannot change on reload; still using {self.cfg.device_plugin_dir} (restart to change it)")
            cfg = replace(cfg, device_plugin_dir=self.cfg.device_plugin_dir)
        set_level(cfg.log_level)
        self.cfg = cfg
        wanted = {d.resource: d for d in cfg.devices}
        for name in list(self.resources):
            r = self.resources[name]
            if wanted.get(name) != r.device or cfg.dev_root != old_root:
                self._stop_serving(r)
                del self.resources[name]
                if not first:
                    event(INFO, "resource-removed" if name not in wanted else "resource-changed", f"{name}: {'no longer configured' if name not in wanted else 'configuration changed'}; stopped serving it", resource=name)
        for name, device in wanted.items():
            if name not in self.resources:
                self.resources[name] = Resource(device)
        dirs = [self.cfg.device_plugin_dir] + [os.path.dirname(d.host_path(cfg.dev_root)) for d in cfg.devices]
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
            self._apply(cfg)
            event(INFO, "reloaded", f"configuration reloaded: {self._summary()}")
        self.notifier.ready(self._status())

    # --- reporting ------------------------------------------------------------------

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
            return f"{r.device.path} missing, not advertised"
        if not dir_ok:
            return f"waiting for {self.cfg.device_plugin_dir}"
        if r.state != "registered":
            return "waiting for kubelet"
        healthy = r.device.count if r.present else 0
        text = f"registered, {healthy}/{r.device.count} healthy"
        if r.last_reregistration:
            at, took = r.last_reregistration
            text += f", re-registered {time.strftime('%H:%M:%S', time.localtime(at))} in {took * 1000:.0f} ms"
        return text


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
