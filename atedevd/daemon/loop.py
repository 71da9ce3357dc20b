"""The control loop and the process: the single owner of state, dispatching events.

Inputs are inotify events (plugin directory and device directories), signals,
timers, callables posted by gRPC threads (a call finished, a stream opened or
ended), kubelet's hang-ups of connections counted in a let-go wait, and an
upgrade's channel. The loop hands them to the `Process` (atedevd/glue/process.py), the
glue the simulation runs too, which tells the `PluginDir` and the upgrade's machines
and says what the process must do; registration decisions live in
`atedevd/registration/` (no I/O). What stays here is the I/O of the process: the
loop, signals, sd_notify, reading the configuration file, starting the upgrade's
successor and its channel, and the metrics file.
"""

import gc
import logging
import math
import os
import select
import signal
import time
from typing import Callable, Dict, List, Optional

from atedevd.cdi import keeper as cdi_keeper
from atedevd.config import Config
from atedevd.config_file.load import ConfigError, load
from atedevd.daemon import instance, sandbox, textfile
from atedevd.daemon.inbox import Inbox, pipe
from atedevd.daemon.host import Host
from atedevd.daemon.watch import Watcher
from atedevd.glue import metrics
from atedevd.glue.plugin_dir import PluginDir
from atedevd.glue.process import (Process, ProcessAction, ReadConfig, Ready, Reloading, ServingBegan, StartSuccessor,
                                  StartWork, Status, WriteMetrics)
from atedevd.kubelet import sockets
from atedevd.kubelet.calls import warm_up
from atedevd.kubelet.identity import kubelet_behind
from atedevd.kubelet.plugin import Workers
from atedevd.registration.messages import Say
from atedevd.systemd import Notifier, event, set_level
from atedevd.upgrade import machines
from atedevd.upgrade import peers as upgrade

log = logging.getLogger(__name__)

WARNING, INFO = logging.WARNING, logging.INFO
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR


class Daemon:
    def __init__(self, cfg: Config, config_path: str, config_required: bool, overrides: dict,
                 lock_fd: int = -1, parent: Optional[upgrade.Parent] = None):
        self.cfg = cfg
        self.config_path = config_path
        self.config_required = config_required
        self.overrides = overrides
        self.lock_fd = lock_fd  # the instance lock (a successor inherits it)
        self.peers = upgrade.Peers(parent)  # an upgrade's other process: our successor, or our predecessor
        self._installed: Optional[tuple] = None  # the package's files as they were once started
        self._replaced = False  # our successor is main: exit without a last word
        self.notifier = Notifier(quiet=parent is not None)  # a successor speaks to systemd once main
        self.inbox = Inbox()  # what gRPC threads hand to the loop
        self.exit_code = 0
        self._bind = sandbox.PluginDirBind(cfg.device_plugin_dir)
        # No thread before the first Registers (each Register starts what kubelet's calls after
        # it need, Workers.registering); the rest of the pool once they are sent (StartWork).
        self._workers = Workers(len(cfg.devices), start_now=0)
        self.metrics = textfile.TextfileWriter(None if parent else textfile.resolve_dir(cfg.metrics_dir))
        self._run_id = sockets.new_run_id()
        self.host = Host(cfg.device_plugin_dir, self._workers, self.inbox.post)
        self.cdi = self.host.cdi = cdi_keeper.Specs(self.host.say, sharing=parent is not None)  # a successor keeps its predecessor's
        self.plugins = PluginDir(cfg.device_plugin_dir, cfg.dev_root, cfg.sys_root, self.host, self._run_id, self._serve_failed)
        # A successor serves what its predecessor served, and registers once it says so.
        self.process = Process(self.plugins, inherited=parent.inherited if parent is not None else None)

    # --- life cycle -----------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the caller has taken the instance lock."""
        os.umask(0o077)  # our sockets: owner only
        self._watcher = self.host.watcher = Watcher()
        self._sig_r, sig_w = pipe()
        signal.set_wakeup_fd(sig_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the loop reads the number from the wakeup fd
        set_level(self.cfg.log_level)
        self._perform(self.process.start(time.monotonic(), self.cfg))  # (on the threads __init__ started)
        self._info = metrics.DaemonInfo.current()
        self._wall_offset = textfile.WallOffset()
        self.notifier.ready(self.process.status())
        event(INFO, "started", f"atedevd serving {self.process.summary()} in {self.cfg.device_plugin_dir}")
        try:
            if self.peers.parent is not None and self.plugins.kubelet.serving:
                warm_up(self.cfg.device_plugin_dir)  # held: the Register on GO need not pay for grpc's first channel
            self._perform(self.process.wake(time.monotonic()))  # a successor's sockets are bound: ready, before the first wait
            self._loop()
        finally:
            self._shutdown()
        return self.exit_code

    def _loop(self) -> None:
        next_watchdog = time.monotonic()
        while not self.process.stopped:
            other = self.peers.talking()
            talk = other.fileno() if other is not None else None
            watched = self.host.watched_fds()
            fds = [self._watcher.fileno(), self.inbox.fileno(), self._sig_r] + ([talk] if talk is not None else [])
            now = time.monotonic()
            if self.notifier.watchdog_interval and now >= next_watchdog:
                self.notifier.watchdog()
                next_watchdog = now + self.notifier.watchdog_interval
            deadlines = [d for d in (self.process.deadline(), self._watcher.poll_deadline(),  # unwatched directories are polled
                                     next_watchdog if self.notifier.watchdog_interval else None, self.metrics.deadline())
                         if d is not None]
            for fd in _wait(fds, watched, None if not deadlines else min(deadlines) - now):
                if fd == self._sig_r:
                    self._on_signals(os.read(fd, 64))
                elif fd == self.inbox.fileno():
                    self.inbox.run()
                elif fd == talk:
                    for message, gone in self.peers.heard():
                        self.process.heard(time.monotonic(), message, gone)
                elif fd in watched:
                    self.host.hung_up(fd)  # its let-go wait counts again (posted: the inbox is read next time)
                else:
                    self.plugins.on_directory_events(self._watcher.read(), time.monotonic())
            poll_at = self._watcher.poll_deadline()
            if poll_at is not None and time.monotonic() >= poll_at:
                self.plugins.on_directory_events(self._watcher.read(), time.monotonic())
            self._perform(self.process.wake(time.monotonic()))
            due = self.metrics.deadline()
            if due is not None and time.monotonic() >= due:
                self._write_metrics()  # a change held back by the interval, or the refresh

    def _perform(self, actions: List[ProcessAction]) -> None:
        self.peers.reap()
        for a in actions:
            _DO[type(a)](self, a)

    def _start_work(self, a: StartWork) -> None:
        """What a start can do once every resource's first Register is on its way (the
        first one waits for pod-resources' answer, which comes through the loop)."""
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
        if not self.plugins.kubelet.serving:  # kubelet comes later (boot): its first Register need not pay for grpc's first channel
            warm_up(self.cfg.device_plugin_dir)

    def _shutdown(self) -> None:
        if self._replaced:
            event(INFO, "stopping", f"handed over to the new atedevd (pid {self.peers.successor_pid}); removing our sockets")
        else:
            event(INFO, "stopping", "stopping: removing our sockets")
        self.plugins.close(time.monotonic())  # (the CDI specs stay: kubelet's checkpointed answers name them)
        if not self._replaced:  # (after an upgrade it is the successor's: it binds its next socket there)
            sockets.remove_standby_dir(self.cfg.device_plugin_dir)  # nothing of ours left in kubelet's directory
        self._write_metrics(force=True)  # the last word: every resource stopped, not registered (not after an upgrade: the successor writes them)
        self._workers.shutdown(wait=False)
        self._watcher.close()

    def _begin_stop(self) -> None:
        """End our streams; the loop runs on until kubelet has let go of them (bounded)."""
        if not self.plugins.stopping:
            self.notifier.stopping()
        self.process.stop(time.monotonic())

    # --- inputs ---------------------------------------------------------------

    def _on_signals(self, signums: bytes) -> None:
        for signum in signums:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self._begin_stop()
            elif signum == signal.SIGHUP:
                upgraded = self._installed is not None and upgrade.fingerprint() != self._installed
                self._perform(self.process.hangup(time.monotonic(), upgraded))

    # --- serving --------------------------------------------------------------

    def _serve_failed(self, path: str, error: OSError) -> bool:
        """A socket could not be bound. True when that means the daemon must restart (the
        stop goes through the loop: the performer that asks is in the middle of its work)."""
        if not self._bind.replaced():
            return False
        event(logging.ERROR, "plugin-dir-replaced", f"{self.cfg.device_plugin_dir} was replaced while atedevd ran and is read-only in its view (the sandbox bound the old one); exiting so that systemd restarts atedevd with a fresh view", socket=path)
        self.exit_code = 1
        self.inbox.post(self._begin_stop)
        return True

    def _serving_began(self, a: ServingBegan) -> None:
        self._bind.served()

    # --- a reload, or an upgrade handed to a warm successor (atedevd/upgrade/machines.py) --------------

    def _reloading(self, a: Reloading) -> None:
        self.notifier.reloading()

    def _read_config(self, a: ReadConfig) -> None:
        """The file read again and checked; what only a restart can change stays as it is."""
        try:
            cfg = load(self.config_path, required=self.config_required, overrides=self.overrides)
        except ConfigError as e:
            self._perform(self.process.reload_failed(time.monotonic(), str(e)))
            return
        if cfg.device_plugin_dir != self.cfg.device_plugin_dir:
            event(WARNING, "reload", f"device_plugin_dir cannot change on reload; still using {self.cfg.device_plugin_dir} (restart to change it)")
            cfg = cfg._replace(device_plugin_dir=self.cfg.device_plugin_dir)
        if cfg.api != self.cfg.api:  # one node never serves a resource through both APIs at once
            self._perform(self.process.reload_failed(time.monotonic(), (
                f'[daemon] api = "{cfg.api}" takes a restart (systemctl restart atedevd), and the node drained '
                f'first (docs/dra.md); still serving through the {self.cfg.api} API')))
            return
        set_level(cfg.log_level)
        if cfg.metrics_dir != self.cfg.metrics_dir:
            self.metrics = textfile.TextfileWriter(textfile.resolve_dir(cfg.metrics_dir))
        self.cfg = cfg
        self._workers.grow(len(cfg.devices))
        self._perform(self.process.reloaded(time.monotonic(), cfg))

    def _start_successor(self, a: StartSuccessor) -> None:
        """The installed atedevd is another: start it; the process hands over once it is ready."""
        try:
            self.peers.start_successor(self.lock_fd, list(a.served))
        except OSError as e:
            self._perform(self.process.successor_failed(time.monotonic(), str(e)))
        else:  # (how it goes beside us, if it may, is the kubelet's to say)
            self._perform(self.process.successor_started(time.monotonic(), kubelet_behind(self.host.kubelet_socket)))

    # --- the process's actions (atedevd/glue/process.py) ------------------------------------------

    def _send(self, a: machines.Send) -> None:
        self.peers.send(a.message)

    def _stop_successor(self, a: machines.StopSuccessor) -> None:
        self.peers.stop_successor(a.kill)

    def _main_pid(self, a: machines.MainPid) -> None:
        self.notifier.main_pid(self.peers.successor_pid)

    def _exit(self, a: machines.Exit) -> None:
        self._replaced = True  # no STOPPING=1: the unit goes on, with the new main process
        self.metrics = textfile.TextfileWriter(None)  # the successor's now

    def _become_main(self, a: machines.BecomeMain) -> None:
        instance.adopt(self.lock_fd)
        self.notifier.become_main()
        self.notifier.ready(self.process.status())
        self.metrics = textfile.TextfileWriter(textfile.resolve_dir(self.cfg.metrics_dir))
        event(INFO, "upgraded", f"took over as systemd's main process: atedevd serving {self.process.summary()}")

    def _say(self, a: Say) -> None:
        event(a.level, a.kind, a.text)

    def _ready(self, a: Ready) -> None:
        self.notifier.ready(self.process.status())

    def _status(self, a: Status) -> None:
        self.notifier.status(a.text)

    def _write_metrics(self, a: Optional[WriteMetrics] = None, force: bool = False) -> None:
        """atedevd.prom, when it changed or is due (rendered at most once a second)."""
        self.metrics.update(self._render_metrics, time.monotonic(), force=force)

    def _render_metrics(self) -> str:
        return metrics.render(self._info, self.plugins.reports(), polling=self._watcher.poll_deadline() is not None,
                              reload_ok=self.process.reload_error is None, wall_offset=self._wall_offset.current())


# (A type checker cannot tie each key to its function's parameter: tests/meta/test_dispatch.py does.)
_DO: Dict[type, Callable[..., None]] = {
    StartWork: Daemon._start_work, Status: Daemon._status, Ready: Daemon._ready, WriteMetrics: Daemon._write_metrics,
    ServingBegan: Daemon._serving_began, Reloading: Daemon._reloading, ReadConfig: Daemon._read_config,
    StartSuccessor: Daemon._start_successor, machines.Send: Daemon._send, machines.StopSuccessor: Daemon._stop_successor,
    machines.MainPid: Daemon._main_pid, machines.Exit: Daemon._exit, machines.BecomeMain: Daemon._become_main,
    Say: Daemon._say,
}


def _wait(fds: List[int], hangups: List[int], wait: Optional[float]) -> List[int]:
    """The fds readable (or, of `hangups`, hung up by their peer) within `wait` seconds
    (None: until one is). Slept, never spun for (a busy loop would take the CPU from the
    kubelet we wait for): poll() counts whole milliseconds, so a shorter wait (the retries
    while kubelet.sock is not yet listened on, a quarter of a millisecond apart) is
    select()'s, which counts microseconds (and cannot tell a hang-up from data to read)."""
    if wait is not None and 0 < wait < 0.001 and max(fds) < 1024:  # FD_SETSIZE; hang-ups wait for the next poll
        return select.select(fds, [], [], wait)[0]
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    for fd in hangups:
        poller.register(fd, _HANGUP)
    return [fd for fd, _ in poller.poll(None if wait is None else max(0, math.ceil(wait * 1000)))]


