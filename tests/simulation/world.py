"""A simulated node: a clock, kubelet's plugin directory, a kubelet model, and atedevd.

atedevd here is the real registration machine (`atedevd.registration`), unchanged;
only its performer is simulated: binds, renames, Register and pod-resources
calls, stream endings and inotify events each take a random delay on the
world's clock, as `atedevd/registrar.py` and the control loop would on a node.
The directory events reach the daemon in batches of random size, in order,
and it reads them the way `Daemon._on_fs_events` does.
"""

import heapq
import random
from typing import Dict, List, Optional

from atedevd.registration import State, Registration
from tests.simulation.kubelet import KubeletModel

RESOURCE = "ate.dev/kvm"
KUBELET_SOCK = "kubelet.sock"


class World:
    def __init__(self, seed: int, mode: str, max_delay: float = 1.0, pod_resources: bool = True, count: int = 1024,
                 connections_visible: bool = True):
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self.max_delay = max_delay
        self._q: list = []
        self._seq = 0
        self.fs = Directory(self)
        self.kubelet = KubeletModel(self, mode, pod_resources)
        self.count = count
        self.connections_visible = connections_visible
        self.orphaned: set = set()  # sockets named in a Register that was in flight when its daemon was killed
        self.daemon: Optional["Daemon"] = None
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

    def start_daemon(self, count: Optional[int] = None) -> "Daemon":
        self.daemons += 1
        self.daemon = Daemon(self, self.daemons, count or self.count)
        self.daemon.start()
        return self.daemon

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
        self.entries: Dict[str, object] = {}  # name -> Sock | Server
        self.standby: Dict[str, "Server"] = {}
        self._inode = 0
        self._pending: List[tuple] = []  # events not yet read by the daemon
        self._delivery_at: Optional[float] = None
        self.dropping_until = -1.0  # events lost (queue overflow) until then

    def inode(self) -> int:
        self._inode += 1
        return self._inode

    def _event(self, kind: str, name: str) -> None:
        if self.w.now < self.dropping_until:
            if not self._pending or self._pending[-1][0] != "overflow":
                self._pending.append(("overflow", ""))
        else:
            self._pending.append((kind, name))
        if self._delivery_at is None:  # the daemon reads a batch after a while: events pile up
            self._delivery_at = self.w.now + self.w.delay()
            self.w.after(self._delivery_at - self.w.now, self._deliver)

    def _deliver(self) -> None:
        batch, self._pending, self._delivery_at = self._pending, [], None
        self.w.note("inotify", f"batch {batch}")
        d = self.w.daemon
        if d is not None and d.alive:
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

    def dial(self, name: str) -> Optional["Server"]:
        s = self.entries.get(name)
        return s if isinstance(s, Server) and s.serving else None

    # our side
    def bind(self, server: "Server", standby: bool) -> None:
        server.inode = self.inode()
        if standby:
            self.standby[server.name] = server
        else:
            self.entries[server.name] = server
            self._event("create", server.name)

    def place(self, server: "Server") -> bool:
        if self.standby.get(server.name) is not server:
            return False
        del self.standby[server.name]
        self.entries[server.name] = server
        self._event("moved_to", server.name)
        return True

    def unlink(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self._event("delete", name)

    def remove(self, server: "Server") -> None:
        if self.entries.get(server.name) is server:
            self.unlink(server.name)
        if self.standby.get(server.name) is server:
            del self.standby[server.name]

    def is_ours(self, server: "Server") -> bool:
        return self.entries.get(server.name) is server or self.standby.get(server.name) is server

    def kubelet_sock(self) -> Optional[Sock]:
        s = self.entries.get(KUBELET_SOCK)
        return s if isinstance(s, Sock) else None


class Server:
    """One plugin socket of ours: the gRPC server, its connections and streams."""

    def __init__(self, daemon: "Daemon", sid: int, name: str, count: int, healthy: bool):
        self.d = daemon
        self.w = daemon.w
        self.sid = sid
        self.name = name
        self.count = count
        self.healthy = healthy
        self.inode = 0
        self.serving = True
        self.conns: List = []
        self.streams: List = []
        self._primary = False

    def connected(self, c) -> None:
        self.conns.append(c)

    def open_stream(self, c) -> bool:
        if not self.serving or not self.d.alive:
            return False
        self.streams.append(c)
        primary = not self._primary
        self._primary = True
        if primary:
            self.d.post(self.d.m.stream_opened, self.sid)
        self._send(c)
        if primary:
            self.d.post(self.d.m.list_sent, self.sid)
        return True

    def _send(self, c) -> None:
        healthy = self.count if self.healthy else 0
        self.w.after(self.w.delay(), self.w.kubelet.devices_sent, c, healthy)

    def kubelet_closed(self, c) -> None:
        """kubelet closed its connection (or died): its stream, if open, ended, not by us."""
        if c in self.conns:
            self.conns.remove(c)
        if c in self.streams:
            self.streams.remove(c)
            if self.serving and self.d.alive:
                self.d.post(self.d.m.stream_ended, self.sid)

    def kubelet_ended_stream(self, c) -> None:
        if c in self.streams:
            self.streams.remove(c)
            if self.serving and self.d.alive:
                self.d.post(self.d.m.stream_ended, self.sid)

    def end_streams(self) -> None:
        for c in self.streams:
            self.w.after(self.w.delay(), self.w.kubelet.stream_closed, c)
        self.streams = []

    def resend(self) -> None:
        for c in self.streams:
            self._send(c)

    def publish(self, healthy: bool) -> None:
        self.healthy = healthy
        for c in self.streams:
            self._send(c)

    def close(self, unlink: bool = True) -> None:
        """Stop serving: every connection drops (kubelet's Recv fails after a while)."""
        self.serving = False
        for c in self.conns:
            c.conn = None
            self.w.after(self.w.delay(), self.w.kubelet.stream_closed, c)
        self.conns, self.streams = [], []
        if unlink:
            self.w.fs.remove(self)


class Daemon:
    """One atedevd process: the real machine, its actions performed on the world's clock."""

    def __init__(self, world: World, n: int, count: int):
        self.w = world
        self.n = n
        self.count = count
        self.alive = True
        self.m = Registration(RESOURCE, count, healthy=True, standby_possible=True,
                              connections_visible=world.connections_visible)
        self.servers: Dict[int, Server] = {}
        self.told_gone: set = set()
        self.kubelet_inode: Optional[int] = None
        self.on_exit = None
        self._wake_at: Optional[float] = None
        self._names = 0

    # --- the process -----------------------------------------------------------------

    def start(self) -> None:
        fs = self.w.fs
        for name, s in list(fs.entries.items()) + [(n, s) for n, s in list(fs.standby.items())]:
            if isinstance(s, Server) and not s.serving:  # an earlier run's leftover
                fs.remove(s)
        k = fs.kubelet_sock()
        self.kubelet_inode = k.inode if k else None
        self.m.serve(self.w.now, k is not None, k.created if k else None)
        self.perform()

    def sigterm(self) -> None:
        if not self.alive:
            return
        self.m.stop(self.w.now)
        self.perform()

    def die(self) -> None:
        """kill -9: connections drop, socket files stay behind."""
        self.alive = False
        # A registration in progress goes on in kubelet. Unless kubelet already listed its
        # devices, its teardown will not show in pod-resources: no later process can see it.
        for sid in ([self.m.call[2]] if self.m.call is not None else []) + \
                ([self.m.current] if self.m.current is not None and not self.m._listed_seen else []):
            s = self.servers.get(sid)
            if s is not None:
                self.w.orphaned.add(s.name)
        for s in self.servers.values():
            s.close(unlink=False)
        self.servers = {}

    def _exit(self) -> None:
        for s in list(self.servers.values()):
            s.close()
        self.servers = {}
        self.alive = False
        if self.on_exit:
            self.on_exit()

    def reload(self, count: int) -> None:
        """SIGHUP: a changed resource is served anew; an unchanged one is not touched."""
        if count == self.count:
            return
        self.count = count
        self.m.reconfigure(self.w.now, count)
        self.perform()

    # --- inputs -------------------------------------------------------------------------

    def post(self, fn, *args) -> None:
        """From a gRPC thread to the loop: a moment later."""
        self.w.after(self.w.delay() * 0.01, self._run, fn, args)

    def _run(self, fn, args) -> None:
        if not self.alive:
            return
        fn(self.w.now, *args)
        self.perform()

    def fs_events(self, batch: List[tuple]) -> None:
        """Daemon._on_fs_events: kubelet.sock made anew, gone, our sockets, and a nudge."""
        if not self.alive or self.m.state in (State.STOPPING, State.STOPPED):
            return
        now = self.w.now
        created = any(k in ("create", "moved_to") and n == KUBELET_SOCK for k, n in batch)
        lost = any(k == "overflow" for k, _ in batch)
        sock = self.w.fs.kubelet_sock()
        if sock is None:
            if self.kubelet_inode is not None:
                self.kubelet_inode = None
                self.m.kubelet_gone(now)
        elif created or (lost and sock.inode != self.kubelet_inode):
            self.kubelet_inode = sock.inode
            ours = any(self.w.fs.is_ours(self.servers[s]) for s in self.m.held() if s in self.servers)
            self.m.kubelet_created(now, sock.created, ours)
        self.perform()
        for sid, server in list(self.servers.items()):
            if sid not in self.told_gone and not self.w.fs.is_ours(server):
                self.told_gone.add(sid)
                self.m.socket_deleted(now, sid)
                self.perform()
        self.m.nudge(now)
        self._arm()

    def _tick(self) -> None:
        self._wake_at = None
        if not self.alive:
            return
        self.m.tick(self.w.now)
        self.perform()

    # --- performing ---------------------------------------------------------------------

    def perform(self) -> None:
        m, w = self.m, self.w
        while m.actions:
            for a in m.take():
                kind = a[0]
                if w.trace and kind != "say":
                    w.note(f"daemon#{self.n} {m.state.value}", " ".join(map(str, a)))
                if kind == "bind":
                    w.after(w.delay(), self._bind, a[1], a[2])
                elif kind == "place":
                    w.after(w.delay() * 0.01, self._place, a[1])
                elif kind == "register":
                    w.after(w.delay(), self._register, a[1], a[2])
                elif kind == "ask":
                    w.after(w.delay(), self._ask, a[1])
                elif kind == "end_streams":
                    s = self.servers.get(a[1])
                    if s:
                        s.end_streams()
                elif kind == "probe":
                    held = sum(len(self.servers[s].conns) for s in a[1] if s in self.servers)
                    m.probed(w.now, held if w.connections_visible else -1)
                elif kind == "resend":
                    s = self.servers.get(a[1])
                    if s:
                        s.resend()
                elif kind == "close":
                    s = self.servers.pop(a[1], None)
                    if s:
                        s.close()
                elif kind == "say":
                    w.said.append((w.now, a[1], a[2], a[3]))
                # "cancel": the machine ignores a cancelled call's outcome; nothing to do here
        if m.state is State.STOPPED and self.alive:  # the process exits
            self._exit()
            return
        self._arm()

    def _arm(self) -> None:
        at = self.m.deadline
        if at is not None and (self._wake_at is None or at < self._wake_at):
            self._wake_at = at
            self.w.after(max(0.0, at - self.w.now), self._tick)

    def _bind(self, sid: int, standby: bool) -> None:
        if not self.alive:
            return
        self._names += 1
        s = Server(self, sid, f"ate.dev-kvm.d{self.n}-{self._names}.sock", self.m.count, self.m.healthy)
        self.w.fs.bind(s, standby)
        self.servers[sid] = s
        self.m.bound(self.w.now, sid, None)
        self.perform()

    def _place(self, sid: int) -> None:
        if not self.alive:
            return
        s = self.servers.get(sid)
        ok = s is not None and self.w.fs.place(s)
        self.m.placed(self.w.now, sid, None if ok else "the standby socket is gone")
        self.perform()

    def _register(self, cid: int, sid: int) -> None:
        if not self.alive:
            return
        s = self.servers.get(sid)
        if s is None:
            self.post(self.m.register_done, cid, "failed", "no socket")
            return
        self.w.kubelet.register(RESOURCE, s.name, lambda outcome: self._run(self.m.register_done, (cid, outcome, outcome)))

    def _ask(self, cid: int) -> None:
        if not self.alive:
            return
        answer = self.w.kubelet.allocatable(RESOURCE)
        self.w.after(self.w.delay(), self._run, self.m.allocatable_done, (cid, answer))

    # --- for the checks -----------------------------------------------------------------

    def current_socket(self) -> Optional[str]:
        s = self.servers.get(self.m.current) if self.m.current is not None else None
        return s.name if s else None
