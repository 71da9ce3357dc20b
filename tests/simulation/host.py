"""The simulation's host: atedevd/daemon/host.py's methods, against the world's models.

The daemon in the simulation is atedevd's own `Node`, `Resource`, `Performer`
and registration machine; this is all that is faked beneath them. The world's
clock is the daemon's clock; kubelet.sock, our socket files and their servers
live in the world's `Directory`; Register and pod-resources calls go to the
world's kubelet model and come back later, through `post`, as on a real node
where gRPC threads post outcomes onto the loop.
"""

import logging
import os
from functools import partial
from typing import Callable, List, Optional, Tuple

from atedevd.kubelet import sockets
from atedevd.kubelet.calls import Allocatable
from atedevd.kubelet.plugin import StreamEvent
from atedevd.registration.messages import Listing, Outcome, RegisterDone

PLUGIN_DIR = "/sim/device-plugins"
STANDBY = os.path.join(PLUGIN_DIR, sockets.STANDBY_DIR)
KUBELET_SOCK = "kubelet.sock"


class _NoCall:
    """A call in flight: cancelling it changes nothing in kubelet (the machine ignores its outcome)."""

    def cancel(self) -> None:
        pass


class SimHost:
    cdi = None  # no CDI specs unless the world gives the process some

    def __init__(self, world, daemon) -> None:
        self.w = world
        self.d = daemon
        self.plugin_dir = PLUGIN_DIR
        self.kubelet_socket = os.path.join(PLUGIN_DIR, KUBELET_SOCK)
        self.pod_resources_socket = "/sim/pod-resources/kubelet.sock"
        self._said: set = set()
        self._watched: dict = {}  # who -> (servers, on_hangup): connections counted, watched for kubelet's hang-up

    # --- clocks and files ------------------------------------------------------------

    def monotonic(self) -> float:
        return self.w.now

    def wall(self) -> float:
        return self.w.now

    def identity(self, path: str):
        sock = self.w.fs.kubelet_sock() if path == self.kubelet_socket else None
        return (sock.inode, int(sock.created * 1e9)) if sock else None

    def isdir(self, path: str) -> bool:
        return self.w.fs.present

    def exists(self, path: str) -> bool:
        return path != self.pod_resources_socket or self.w.kubelet.pod_resources

    def listening(self, path: str) -> bool:
        sock = self.w.fs.kubelet_sock()
        inc = self.w.kubelet.inc
        return sock is not None and sock.inc is inc and inc.alive and inc.listening

    def connections_visible(self) -> bool:
        return self.w.connections_visible

    def count_connections(self, who, bind_paths, on_hangup) -> Tuple[Optional[int], bool]:
        """kubelet's connections to those sockets; `on_hangup` is posted when kubelet closes one."""
        if not self.w.connections_visible:
            return None, False
        self.unwatch(who)
        wanted = set(bind_paths)
        held = [s for s in self.d.servers() if s.bind_path in wanted and s.conns]
        if held:
            self._watched[who] = (held, on_hangup)
            for s in held:
                s.watchers.add(who)
        return sum(len(s.conns) for s in held), bool(held)

    def unwatch(self, who) -> None:
        servers, _ = self._watched.pop(who, ((), None))
        for s in servers:
            s.watchers.discard(who)

    def hung_up(self, server: "SimServer") -> None:
        """kubelet closed a connection to `server`: whoever watches it is told, on the loop."""
        for who in list(server.watchers):
            _, on_hangup = self._watched[who]
            self.unwatch(who)
            self.post(on_hangup)

    def make_dir(self, path: str) -> None:
        pass

    def watch(self, directories) -> None:
        pass  # the world's directories tell every process (tests/simulation: Directory, and the scenarios)

    # --- serving -----------------------------------------------------------------------

    def server(self, device, path: str, slots, allocations, on_event: Callable) -> "SimServer":
        return SimServer(self, device, path, lambda kind: self.post(partial(on_event, kind)))

    # --- calls -----------------------------------------------------------------------------

    def register(self, resource: str, endpoint: str, cid: int, done: Callable[[RegisterDone], None]) -> _NoCall:
        self.w.note(f"daemon#{self.d.n}", f"Register {endpoint} sent")

        def answered(outcome: str, detail: str = "") -> None:
            self.post(partial(done, RegisterDone(cid, Outcome(outcome), "" if outcome == "ok" else detail or f"Register: {outcome}")))

        def arrive() -> None:
            if self.d.alive:
                self.w.kubelet.register(resource, endpoint, answered)
        self.w.after(self.w.delay(), arrive)
        return _NoCall()

    def ask_allocatable(self, path: str, done: Callable[[Allocatable], None]) -> _NoCall:
        def answer() -> None:
            if not self.d.alive:
                return
            got = self.w.kubelet.allocatable(self.d.plugins.resources)
            if got == "absent":
                reply = Allocatable(Listing.ABSENT, {}, "unimplemented")
            elif got == "refused":
                reply = Allocatable(Listing.REFUSED, {}, "kubelet is not accepting connections")
            elif got == "exhausted":
                reply = Allocatable(Listing.EXHAUSTED, {}, "RESOURCE_EXHAUSTED: rejected by rate limit")
            else:
                reply = Allocatable(Listing.LISTED, got)
            self.w.after(self.w.delay(), self._deliver, partial(done, reply))
        self.w.after(self.w.delay(), answer)
        return _NoCall()

    # --- the loop and the journal ---------------------------------------------------------------

    def post(self, fn: Callable[[], None]) -> None:
        """From a gRPC thread to the loop: a moment later."""
        self.w.after(self.w.delay() * 0.01, self._deliver, fn)

    def _deliver(self, fn: Callable[[], None]) -> None:
        if self.d.alive:
            fn()
            self.d.woke()

    def say(self, level: int, kind: str, text: str, once: Optional[str] = None, **fields: str) -> None:
        if once is not None:
            if once in self._said:
                return
            self._said.add(once)
        if level > logging.DEBUG or self.w.trace:
            self.w.said.append((self.w.now, level, kind, text))


class SimServer:
    """One plugin socket of ours: the gRPC server, its connections and streams."""

    def __init__(self, host: SimHost, device, bind_path: str, on_event: Callable) -> None:
        self.host = host
        self.w = host.w
        self.device = device
        self.bind_path = self.socket_path = bind_path
        self.name = os.path.basename(bind_path)
        self.on_event = on_event
        self.inode: Optional[int] = None
        self.serving = False
        self.snapshot = None
        self.conns: List = []
        self.streams: List = []
        self._sent_at: dict = {}  # stream -> when its last message reaches kubelet
        self._primary = False
        self.watchers: set = set()  # who counted its connections and waits for a hang-up

    # the performer's side (atedevd/kubelet/plugin.py's PluginServer)
    def start(self) -> None:
        self.w.fs.bind(self, standby=os.path.dirname(self.bind_path) == STANDBY)
        self.serving = True

    def move_to(self, path: str) -> None:
        if not self.w.fs.place(self):
            raise OSError("the standby socket is gone")
        self.socket_path = path

    def stop(self, unlink: bool = True) -> None:
        """Stop serving: every connection drops (kubelet's Recv fails after a while)."""
        self.serving = False
        for c in self.conns:
            c.conn = None
            self.w.after(self.w.delay(), self.w.kubelet.stream_closed, c)
        self.conns, self.streams = [], []
        if unlink:
            self.w.fs.remove(self)
        self.inode = None

    def socket_is_ours(self) -> bool:
        return self.inode is not None and self.w.fs.is_ours(self)

    def retarget(self, device) -> None:
        self.device = device

    def publish(self, snapshot) -> None:
        self.snapshot = snapshot
        for c in self.streams:
            self._send(c)

    def resend(self) -> None:
        for c in self.streams:
            self._send(c)

    def end_streams(self) -> None:
        for c in self.streams:
            self.w.after(self.w.delay(), self.w.kubelet.stream_closed, c)
        self.streams = []

    # kubelet's side
    def connected(self, c) -> None:
        self.conns.append(c)

    def open_stream(self, c) -> bool:
        if not self.serving or not self.host.d.alive:
            return False
        self.streams.append(c)
        primary = not self._primary
        self._primary = True
        if primary:
            self.on_event(StreamEvent.OPENED)
        self._send(c)
        if primary:
            self.on_event(StreamEvent.LIST_SENT)
        return True

    def _send(self, c) -> None:
        """One ListAndWatch message: it reaches kubelet after a while, and never before an
        earlier one on the same stream (a stream is in order)."""
        at = max(self.w.now + self.w.delay(), self._sent_at.get(c, 0.0))
        self._sent_at[c] = at
        self.w.after(at - self.w.now, self.w.kubelet.devices_sent, c, self.snapshot.healthy_units)

    def kubelet_closed(self, c) -> None:
        """kubelet closed its connection (or died): its stream, if open, ended, not by us."""
        if c in self.conns:
            self.conns.remove(c)
            if self.watchers and self.host.d.alive:
                self.host.hung_up(self)
        self.kubelet_ended_stream(c)

    def kubelet_ended_stream(self, c) -> None:
        if c in self.streams:
            self.streams.remove(c)
            if self.serving and self.host.d.alive:
                self.on_event(StreamEvent.ENDED)
