"""Performs what one resource's `Registration` decides: the thin layer with the I/O.

It owns the resource's plugin servers (one per socket id) and its calls to
kubelet, turns the machine's actions into binds, renames, Register and
pod-resources calls, stream endings and journal lines, and feeds every outcome
back in. It decides nothing: `registration.py` does, without any I/O.
"""

import logging
import os
import threading
import time
from functools import partial
from typing import Callable, Dict, Optional, Set

from atedevd import kubelet as kubelet_api
from atedevd import registration as rm
from atedevd import sockets
from atedevd.config import Device
from atedevd.devices import Snapshot
from atedevd.kubelet import AllocatableCall, KubeletView, RegisterCall
from atedevd.plugin import (LIST_SENT, STREAM_ENDED, STREAM_OPENED, STREAM_REFUSED, STREAMS_PER_RESOURCE, AllocateCounts,
                            PluginServer, Workers)
from atedevd.systemd import event

log = logging.getLogger(__name__)
State = rm.State


class Context:
    """What every resource of one daemon shares."""

    def __init__(
        self,
        plugin_dir: str,
        run_id: str,
        workers: Workers,
        kubelet: KubeletView,
        post: Callable[[Callable[[], None]], None],
        serve_failed: Callable[[str, OSError], bool],
    ):
        self.plugin_dir = plugin_dir
        self.run_id = run_id
        self.workers = workers
        self.kubelet = kubelet
        self.post = post  # run a callable on the loop (from gRPC threads)
        self.serve_failed = serve_failed  # True: the daemon is stopping because of it
        self.said: Set[str] = set()  # `once` keys already logged


class Registrar:
    """One resource: its machine, its sockets, its calls to kubelet."""

    def __init__(self, device: Device, snapshot: Snapshot, ctx: Context):
        self.device = device
        self.snapshot = snapshot
        self.ctx = ctx
        longest = os.path.join(ctx.plugin_dir, sockets.STANDBY_DIR, sockets.socket_name(device.resource, ctx.run_id, 10**6))
        self.machine = rm.Registration(device.resource, _counted(snapshot), snapshot.healthy,
                                       standby_possible=len(os.fsencode(longest)) <= sockets.MAX_SOCKET_PATH,
                                       device_path=device.path,
                                       connections_visible=sockets.held_connections(()) >= 0)
        self.servers: Dict[int, PluginServer] = {}
        self._calls: Dict[int, object] = {}
        self._gone: Set[int] = set()  # sids told to the machine as deleted
        self._slots = threading.BoundedSemaphore(STREAMS_PER_RESOURCE)
        self.allocations = AllocateCounts()  # shared by this resource's servers (metrics)
        self._n = 0  # socket names used
        self._registers = 0

    @property
    def name(self) -> str:
        return self.device.resource

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def deadline(self) -> Optional[float]:
        return self.machine.deadline

    # What the metrics read.
    registrations = property(lambda self: self.machine.registrations)
    reasons = property(lambda self: self.machine.reasons)
    changed_at = property(lambda self: self.machine.changed_at)
    kubelet_count = property(lambda self: self.machine.kubelet_count)

    @property
    def registers_sent(self) -> int:
        return self._registers

    @property
    def stopped(self) -> bool:
        return self.machine.stopped

    # --- events from the loop, passed on -----------------------------------------------

    def serve(self, now: float) -> None:
        k = self.ctx.kubelet
        self.machine.serve(now, k.serving, self._on_our_clock(now, k.since) if k.serving else None)
        self._perform()

    def unserve(self, now: float, why: str) -> None:
        self.machine.unserve(now, why)
        self._perform()

    def kubelet_started(self, now: float) -> None:
        at = self._on_our_clock(now, self.ctx.kubelet.since)
        ours = any(self._is_ours(sid) for sid in self.machine.held())
        self.machine.kubelet_created(now, at, ours)
        self._perform()

    def kubelet_gone(self, now: float) -> None:
        self.machine.kubelet_gone(now)
        self._perform()

    def check_sockets(self, now: float) -> None:
        """After a plugin-directory event: is every socket of ours still ours?"""
        for sid, server in list(self.servers.items()):
            if sid not in self._gone and server.inode is not None and not server.socket_is_ours():
                self._gone.add(sid)
                self.machine.socket_deleted(now, sid)
        self._perform()

    def nudge(self, now: float) -> None:
        self.machine.nudge(now)

    def publish(self, snapshot: Snapshot, now: float) -> None:
        self.snapshot = snapshot
        for server in self.servers.values():
            if server.device == self.device:  # after a reload, old sockets keep the old table
                server.publish(snapshot)
        self.machine.count = _counted(snapshot)
        self.machine.publish(now, snapshot.healthy)
        self._perform()

    def reconfigure(self, device: Device, snapshot: Snapshot, now: float) -> None:
        self.device, self.snapshot = device, snapshot
        self.machine.reconfigure(now, _counted(snapshot))
        self._perform()

    def begin_stop(self, now: float) -> None:
        self.machine.stop(now)
        self._perform()

    def close(self) -> None:
        self.machine.close(time.monotonic())
        self._perform()

    def on_timer(self, now: float) -> None:
        self.machine.tick(now)
        self._perform()

    def retry_due(self, now: float) -> bool:
        at = self.machine.timers.get("retry")
        return at is not None and at <= now

    def describe(self) -> str:
        return self.machine.describe(time.monotonic(), time.time())

    # --- outcomes from gRPC threads (run on the loop through ctx.post) -------------------

    def _stream_event(self, kind: str, sid: int) -> None:
        now = time.monotonic()
        m = self.machine
        if kind == STREAM_OPENED:
            m.stream_opened(now, sid)
        elif kind == LIST_SENT:
            m.list_sent(now, sid)
        elif kind == STREAM_ENDED:
            m.stream_ended(now, sid)
        elif kind == STREAM_REFUSED:
            server = self.servers.get(sid)
            m.stream_refused(now, sid, STREAMS_PER_RESOURCE, server.socket_path if server else "")
        self._perform()

    def _register_done(self, cid: int, call: RegisterCall, error: Optional[str]) -> None:
        call.close()
        self._calls.pop(cid, None)
        if error is None:
            outcome = rm.OK
        elif kubelet_api.not_listening(call.code):
            outcome = rm.REFUSED
        else:
            outcome = rm.FAILED
        self.machine.register_done(time.monotonic(), cid, outcome, error or "")
        self._perform()

    def _ask_done(self, cid: int, call: AllocatableCall, result: Optional[dict], error: Optional[str]) -> None:
        call.close()
        self._calls.pop(cid, None)
        if error is None:
            answer = len(result.get(self.name, ()))
        elif kubelet_api.not_listening(call.code):
            answer = rm.PR_REFUSED
        elif call.code is not None and call.code.name == "UNIMPLEMENTED":
            answer = rm.PR_ABSENT
        else:
            log.debug("%s: pod-resources did not answer: %s", self.name, error)
            answer = rm.PR_FAILED
        self.machine.allocatable_done(time.monotonic(), cid, answer)
        self._perform()

    # --- performing ----------------------------------------------------------------------

    def _perform(self) -> None:
        """Carry out every action the machine has asked for, feeding outcomes back."""
        m = self.machine
        while m.actions:
            for action in m.take():
                getattr(self, "_do_" + action[0])(*action[1:])

    def _do_bind(self, sid: int, standby: bool) -> None:
        self._n += 1
        name = sockets.socket_name(self.name, self.ctx.run_id, self._n)
        directory = os.path.join(self.ctx.plugin_dir, sockets.STANDBY_DIR) if standby else self.ctx.plugin_dir
        path = os.path.join(directory, name)
        server = PluginServer(self.device, path, self.ctx.workers, self._slots,
                              lambda kind, _server, sid=sid: self.ctx.post(partial(self._stream_event, kind, sid)),
                              self.allocations)
        server.publish(self.snapshot)
        try:
            if standby:  # never the plugin directory itself: that is kubelet's to make
                try:
                    os.mkdir(directory, mode=0o700)
                except FileExistsError:
                    pass
            server.start()
        except OSError as e:
            server.stop()
            if self.ctx.serve_failed(path, e):
                return  # the daemon stops: the machine was told to
            self.machine.bound(time.monotonic(), sid, f"on {path}: {e.strerror or e}")
            return
        self.servers[sid] = server
        self.machine.bound(time.monotonic(), sid, None)

    def _do_place(self, sid: int) -> None:
        server = self.servers.get(sid)
        error = None
        try:
            if server is None:
                raise OSError("the socket is gone")
            server.move_to(os.path.join(self.ctx.plugin_dir, os.path.basename(server.bind_path)))
        except OSError as e:
            error = f"on {self.ctx.plugin_dir}: {e.strerror or e}"
        self.machine.placed(time.monotonic(), sid, error)

    def _do_register(self, cid: int, sid: int) -> None:
        server = self.servers[sid]
        if not sockets.listening(self.ctx.kubelet.socket):  # kubelet.sock made, not yet listened on
            self.machine.register_done(time.monotonic(), cid, rm.REFUSED, "kubelet is not accepting connections")
            return
        self._registers += 1
        level = logging.INFO if self._registers == 1 else logging.DEBUG
        event(level, "serving", f"{self.name}: serving {self.snapshot.units} units of {self.device.path} on {server.socket_path}",
              resource=self.name, device=self.device.path, socket=server.socket_path)
        call = RegisterCall(self.ctx.plugin_dir, self.name, os.path.basename(server.socket_path),
                            lambda c, _result, error: self.ctx.post(partial(self._register_done, cid, c, error)))
        self._calls[cid] = call
        self.ctx.workers.registering()

    def _do_ask(self, cid: int) -> None:
        path = self.ctx.kubelet.pod_resources
        if not os.path.exists(path):
            self.machine.allocatable_done(time.monotonic(), cid, rm.PR_ABSENT)
            return
        self._calls[cid] = AllocatableCall(path, lambda c, result, error: self.ctx.post(partial(self._ask_done, cid, c, result, error)))

    def _do_probe(self, sids) -> None:
        paths = [self.servers[s].bind_path for s in sids if s in self.servers]
        self.machine.probed(time.monotonic(), sockets.held_connections(paths) if paths else 0)

    def _do_cancel(self, cid: int) -> None:
        call = self._calls.get(cid)
        if call is not None:
            call.cancel()  # its outcome still comes back and closes the channel; the machine ignores it

    def _do_end_streams(self, sid: int) -> None:
        server = self.servers.get(sid)
        if server is not None:
            server.end_streams()

    def _do_resend(self, sid: int) -> None:
        server = self.servers.get(sid)
        if server is not None:
            server.resend()

    def _do_close(self, sid: int) -> None:
        server = self.servers.pop(sid, None)
        self._gone.discard(sid)
        if server is not None:
            server.stop()

    def _do_say(self, level: int, kind: str, text: str, once: Optional[str]) -> None:
        if once is not None:
            if once in self.ctx.said:
                return
            self.ctx.said.add(once)
        if level == logging.DEBUG:
            log.debug("%s", text)
        else:
            event(level, kind, text, resource=self.name)

    @staticmethod
    def _on_our_clock(now: float, wall: float) -> float:
        """A wall-clock time (kubelet.sock's ctime) on the monotonic clock."""
        return now - max(0.0, time.time() - wall)

    def _is_ours(self, sid: int) -> bool:
        server = self.servers.get(sid)
        return server is not None and server.socket_is_ours()


def _counted(snapshot: Snapshot) -> int:
    """What the machine takes as the count: it expects kubelet to list `count` allocatable while
    `healthy`, which is every unit of a shareable device but only the Healthy ones of a pattern's.
    (A stand-in until the machine compares kubelet's count with `snapshot.healthy_units` itself.)"""
    return snapshot.healthy_units or snapshot.units
