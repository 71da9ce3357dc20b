"""DRA mode's process: the I/O around the `Driver` (atedevd/dra/driver.py), which decides.

The loop is the one owner of the driver. It waits on signals, on the inbox (what the gRPC threads
and the API server's threads hand it: kubelet's calls, the answers to our questions), on the
channel to a reload's other process and on inotify in the nodes' directories; it looks at the
nodes when they change (and every LOOK_EVERY_S, in case an event was lost); and it carries out
what the driver asks by a table of action types (`_DO`, held to `driver.ACTIONS`): the API
server's questions on a thread of their own (slices) and on a small pool (claims), so that the
loop never waits for the network; the checkpoint written and read on the loop; kubelet's
answers handed back to the waiting gRPC threads; systemd told through sd_notify.

The sockets kubelet dials are held (atedevd/dra/listeners.py): stored with systemd, handed to a
reload's successor, adopted at the next start. The relay (atedevd/dra/relay.py) carries
kubelet's connections on them to this run's gRPC server (atedevd/dra/plugin.py).
"""

import errno
import logging
import os
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Optional

from atedevd.config import DEFAULT_CONFIG_PATH, Config
from atedevd.config_file.load import ConfigError, load
from atedevd.daemon.inbox import Inbox, pipe
from atedevd.daemon.watch import Watcher
from atedevd.dra import checkpoint, driver as d, listeners, plugin
from atedevd.dra import preparer as prep
from atedevd.dra import publisher as pub
from atedevd.dra.cluster import NODE_USER_PREFIX, ClusterError, KubeApi, find_kubeconfig
from atedevd.dra.look import Look
from atedevd.glue.notices import Ready, Reloading, StartSuccessor, Status
from atedevd.glue.resource_events import TimerDue
from atedevd.dra.relay import Relay
from atedevd.dra.slices import DRIVER
from atedevd.kubelet import sockets
from atedevd.registration.messages import Say
from atedevd.systemd import Notifier, event
from atedevd.upgrade import peers
from atedevd.upgrade.machines import BecomeMain, Exit, MainPid, Send, StopSuccessor

INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR
LOOK_EVERY_S = 10.0  # the nodes, looked at this often besides their directories' events
EX_CONFIG = 78  # the unit does not restart: the sandbox or the file must change first
_SAID: set = set()


def say(level: int, kind: str, text: str, once: Optional[str] = None, **fields: str) -> None:
    """A journal line (`once`: a key said at most once per run)."""
    if once is not None:
        if once in _SAID:
            return
        _SAID.add(once)
    event(level, kind, text, **fields)


class DraNode:
    """One run of DRA mode."""

    def __init__(self, cfg: Config, notifier: Notifier, lock_fd: int = -1,
                 parent: Optional[peers.Parent] = None, handed: Optional[Dict[str, int]] = None) -> None:
        self.cfg = cfg
        self.notifier = notifier
        self.lock_fd = lock_fd
        self.parent = parent
        self.child: Optional[peers.Child] = None
        self.root = listeners.kubelet_root(cfg.device_plugin_dir)
        self.state_dir = listeners.plugin_dir(self.root)
        self.listeners = listeners.Listeners(self.root)
        self.handed = handed or {}
        self.inbox = Inbox()
        self.calls = plugin.Calls(self.post)
        self.driver = d.Driver(cfg.node_name, successor=parent is not None, inherited=bool(self.handed))
        self.look: Optional[Look] = None
        self.watcher: Optional[Watcher] = None
        self.server: Optional[plugin.DraServer] = None
        self.relay: Optional[Relay] = None
        self._cluster: Optional[KubeApi] = None
        self._slices_lane = ThreadPoolExecutor(1, thread_name_prefix="dra-slices")
        self._claims_lane = ThreadPoolExecutor(4, thread_name_prefix="dra-claims")
        self._watching = False
        self._stop = threading.Event()

    # --- what other threads hand the loop -----------------------------------------------------------

    def post(self, event_: object) -> None:
        self.inbox.post(lambda: self.handle(event_))

    def handle(self, event_: object) -> None:
        self._perform(self.driver.handle(time.monotonic(), event_))  # type: ignore[arg-type]

    # --- the sockets -------------------------------------------------------------------------------------

    def _serve(self) -> None:
        """The listening sockets (handed to us, or bound), this run's gRPC server, the relay."""
        for why in self.listeners.adopt(self.handed):
            say(WARNING, "dra-sockets", f"a socket handed to us was not taken: {why}")
        plugin.remove_leftovers(self.root, say)
        bound = self.listeners.bind()
        run = sockets.new_run_id()
        self.server = plugin.DraServer(plugin.inner_path(self.root, run), self.listeners.paths[listeners.SERVICE],
                                       self.calls, lambda ok, error: self.post(d.RegistrationSaid(ok, error)))
        self.server.start()
        self.relay = Relay(self.listeners.sockets, self.server.path, self._accepted)
        self.relay.start()
        how = "bound anew" if bound else "kept from the last run"
        if self.listeners.adopted and self.parent is not None:
            how = "handed over by the predecessor"
        say(INFO, "dra-serving", f"serving DRA driver {DRIVER} at {self.listeners.paths[listeners.SERVICE]}, "
            f"registration at {self.listeners.paths[listeners.REGISTRATION]} ({how})")
        if bound and self.parent is None:
            self._store()

    def _accepted(self, kind: str) -> None:
        """From the relay's thread: a connection accepted; kubelet dials the service only once registered."""
        if kind == listeners.SERVICE:
            self.post(d.KubeletDialed())

    def _store(self) -> None:
        """Our listening sockets with systemd, for the next start (what it keeps under the same
        names is replaced; with no systemd, or a unit that keeps none, nothing happens)."""
        self.notifier.store_fds(self.listeners.names())

    def _serve_again(self, gone: str) -> None:
        """Someone removed or replaced a socket file of ours: new ones, bound and stored instead
        (kubelet registers the driver again, as for any new registration socket)."""
        say(WARNING, "dra-socket", f"{gone} was removed or replaced by someone else; serving on new sockets")
        assert self.relay is not None and self.server is not None
        old = list(self.listeners.names())
        self.relay.stop()
        self.listeners.close(remove=True)
        self.notifier.drop_fds(old)
        self.listeners.bind()
        self.relay = Relay(self.listeners.sockets, self.server.path, self._accepted)
        self.relay.start()
        if self.parent is None:
            self._store()

    # --- the loop ----------------------------------------------------------------------------------------

    def run(self) -> int:
        self._wake_r, wake_w = pipe()
        signal.set_wakeup_fd(wake_w)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, lambda *_: None)  # (the loop reads the number from the wakeup fd)
        try:
            self.look = Look(self.cfg, say)
            self._serve()
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            say(ERROR, "serve-failed", f"cannot serve DRA sockets in {self.root}: {e.strerror or e} ({e.filename or ''}); "
                "under atedevd.service DRA mode needs the drop-in dra.conf (docs/dra.md), which makes kubelet's plugin "
                "directories writable and lets it reach the API server")
            return EX_CONFIG
        self.watcher = Watcher()
        self._looked(first=True)
        self._perform(self.driver.start(time.monotonic()))
        next_look = time.monotonic() + LOOK_EVERY_S
        next_dog = 0.0
        while self.driver.exit_code is None:
            now = time.monotonic()
            if self.notifier.watchdog_interval and now >= next_dog:
                self.notifier.watchdog()
                next_dog = now + self.notifier.watchdog_interval
            due = self.driver.deadline()
            if due is not None and now >= due:
                self.handle(TimerDue())
                continue
            times = [t for t in (due, next_look, self.watcher.poll_deadline(),
                                 next_dog if self.notifier.watchdog_interval else None) if t is not None]
            peer = self.child if self.child is not None else self.parent
            fds = [self._wake_r, self.inbox.fileno(), self.watcher.fileno()]
            if peer is not None and peer.fileno() >= 0:
                fds.append(peer.fileno())
            ready = select.select(fds, [], [], max(0.0, min(times) - now))[0]
            if self._wake_r in ready:
                self._signals()
            if self.inbox.fileno() in ready:
                self.inbox.run()
            if peer is not None and peer.fileno() in ready:
                self._peer(peer)
            events = self.watcher.read() if self.watcher.fileno() in ready or self.watcher.poll_deadline() else []
            if events or time.monotonic() >= next_look:
                next_look = time.monotonic() + LOOK_EVERY_S
                self._looked()
                gone = self.listeners.missing() if not self.driver.unserving else None  # (their directories' events)
                if gone:
                    self._serve_again(gone)
            self.look.wake(time.monotonic())
        self._finish()
        return self.driver.exit_code

    def _looked(self, first: bool = False) -> None:
        assert self.look is not None and self.watcher is not None
        devices = self.look.look(first)
        # (the sockets' directories too: a file of ours removed is seen at once)
        self.watcher.want(self.look.directories() + sorted({os.path.dirname(p) for p in self.listeners.paths.values()}))
        if devices is not None:
            self.handle(d.Looked(devices))

    def _signals(self) -> None:
        try:
            data = os.read(self._wake_r, 64)
        except BlockingIOError:
            return
        for signum in data:
            if signum == signal.SIGHUP:
                self.handle(self._hangup())
            elif signum in (signal.SIGTERM, signal.SIGINT):
                self.handle(d.Terminate(signal.Signals(signum).name))

    def _hangup(self) -> d.Hangup:
        try:
            cfg = load(self.cfg.source or DEFAULT_CONFIG_PATH, required=self.cfg.source is not None)
        except ConfigError as e:
            return d.Hangup(None, str(e))
        return d.Hangup(cfg.api)

    def _peer(self, peer) -> None:
        for message in peer.receive():
            if peer is self.child and message is None:
                why = self.child.ended(wait_s=1.0) or "exited"
                self.child = None
                self.handle(d.SuccessorFailed(f"{why} before it served"))
            else:
                self.handle(d.Heard(message))

    def _finish(self) -> None:
        """Our copies of what is held go (systemd's, or the successor's, stay), the threads end."""
        self._stop.set()
        if self.relay is not None:
            self.relay.stop()
        if self.server is not None:
            self.server.stop(0)
        self.listeners.close(remove=False)
        self._slices_lane.shutdown(wait=False)
        self._claims_lane.shutdown(wait=False)

    # --- the actions ---------------------------------------------------------------------------------------

    def _perform(self, actions) -> None:
        for a in actions:
            _DO[type(a)](self, a)

    def _say(self, a: Say) -> None:
        say(a.level, a.kind, a.text, once=a.once)

    def _status(self, a: Status) -> None:
        self.notifier.status(a.text)

    def _ready(self, a: Ready) -> None:
        self.notifier.ready(self.driver.status())

    def _reloading(self, a: Reloading) -> None:
        self.notifier.reloading()

    def _read_checkpoint(self, a: d.ReadCheckpoint) -> None:
        doc, why = checkpoint.read(self.state_dir)
        self.handle(d.CheckpointRead(doc, why))

    def _write_checkpoint(self, a: prep.WriteCheckpoint) -> None:
        try:
            checkpoint.write(self.state_dir, a.document)
            error = ""
        except OSError as e:
            error = f"{os.path.join(self.state_dir, checkpoint.FILE)}: {e.strerror or e}"
        self.handle(prep.CheckpointWritten(a.call, error))

    def _answer(self, a: prep.Answer) -> None:
        self.calls.answer(a.call, a.outcomes)

    def _health(self, a: d.Health) -> None:
        if self.server is not None:
            self.server.board.set(a.pool, a.devices)

    # the API server, off the loop

    def _api(self, lane: ThreadPoolExecutor, work: Callable[[], object], failed: Callable[[ClusterError], object]) -> None:
        def run():
            try:
                result = work()
            except ClusterError as e:
                result = failed(e)
            self.post(result)
        try:
            lane.submit(run)
        except RuntimeError:
            pass  # (stopping)

    def _connect(self, a: pub.Connect) -> None:
        def work():
            if self._cluster is None:
                path, why = find_kubeconfig(self.cfg.kubeconfig)
                if path is None:
                    raise ClusterError(why)
                self._cluster = KubeApi(path)
            c = self._cluster
            node = self.cfg.node_name
            user = c.whoami()
            if node is None:
                if not user.startswith(NODE_USER_PREFIX):
                    raise ClusterError(f"{c.kubeconfig} is {user!r}, not a node's credentials (system:node:<name>): "
                                       "name the node with [daemon] node_name")
                node = user[len(NODE_USER_PREFIX):]
            uid = c.node_uid(node)
            c.warm_up()  # (the resources the claims' threads use, found before they run at once)
            self._watch(c, node)
            return pub.Connected(node, uid, user)
        self._api(self._slices_lane, work, lambda e: pub.ApiFailed(str(e)))

    def _list(self, a: pub.ListSlices) -> None:
        c = self._cluster
        assert c is not None
        self._api(self._slices_lane, lambda: pub.SlicesListed(tuple(c.slices(a.node, DRIVER)[0])),
                  lambda e: pub.ApiFailed(str(e)))

    def _write(self, a: pub.WriteSlices) -> None:
        c = self._cluster
        assert c is not None

        def work():
            for doc in a.creates:
                c.create_slice(doc)
            for doc, version in a.replaces:
                c.replace_slice(doc, version)
            for name in a.deletes:
                c.delete_slice(name)
            return pub.Written()
        self._api(self._slices_lane, work, lambda e: pub.ApiFailed(str(e)))

    def _read_claim(self, a: prep.ReadClaim) -> None:
        c = self._cluster
        assert c is not None
        ref = a.ref
        self._api(self._claims_lane, lambda: prep.ClaimRead(a.call, ref.uid, c.claim(ref.namespace, ref.name)),
                  lambda e: prep.ClaimNotRead(a.call, ref.uid, str(e), e.status))

    def _watch(self, c: KubeApi, node: str) -> None:
        """A thread that tells the publisher of every change to the node's slices (a wipe, an
        edit), and that it began anew (what changed between two watches no watch says)."""
        if self._watching:
            return
        self._watching = True

        def run():
            delay = pub.RETRY_FIRST_S
            while not self._stop.is_set():
                try:
                    _, version = c.slices(node, DRIVER)
                    self.post(pub.SlicesChanged())
                    for _ in c.watch_slices(node, DRIVER, version):
                        self.post(pub.SlicesChanged())
                        if self._stop.is_set():
                            return
                    delay = pub.RETRY_FIRST_S
                except ClusterError:
                    self._stop.wait(delay)
                    delay = min(pub.RETRY_MOST_S, delay * 2)
        threading.Thread(target=run, name="dra-watch", daemon=True).start()

    # a reload's handover, a stop

    def _start_successor(self, a: StartSuccessor) -> None:
        try:
            self.child = peers.Child(self.lock_fd, a.served, fds=self.listeners.names())
        except OSError as e:
            self.handle(d.SuccessorFailed(f"could not be started ({e})"))

    def _stop_successor(self, a: StopSuccessor) -> None:
        if self.child is not None:
            self.child.kill() if a.kill else self.child.terminate()
            if a.kill:
                self.child = None

    def _main_pid(self, a: MainPid) -> None:
        if self.child is not None and self.child.pid is not None:
            self.notifier.main_pid(self.child.pid)

    def _send(self, a: Send) -> None:
        peer = self.child if self.child is not None else self.parent
        if peer is not None:
            peer.send(a.message)

    def _become_main(self, a: BecomeMain) -> None:
        self.notifier.become_main()
        if self.parent is not None:
            self.parent.close()
            self.parent = None
        if not self.listeners.adopted:
            self._store()  # (our predecessor handed us nothing: an older atedevd)

    def _unserve(self, a: d.Drain) -> None:
        """Kubelet's connections let go of once all it sent on them is answered (atedevd/dra/relay.py):
        then `Unserved`. New ones wait in the backlog for the successor or the next start."""
        assert self.server is not None and self.relay is not None
        self.server.board.close()  # (kubelet opens the health stream again where it connects next)
        relay = self.relay
        relay.drain()
        if a.remove:  # (kubelet forgets the driver; our sockets close once the relay is done with them)
            self.notifier.drop_fds(list(self.listeners.names()))
            self.listeners.remove_files()

        def wait():
            relay.drained.wait()
            self.post(d.Drained())
        threading.Thread(target=wait, name="dra-unserve", daemon=True).start()

    def _serve_on(self, a: d.Resume) -> None:
        old = self.server
        self.server = plugin.DraServer(plugin.inner_path(self.root, sockets.new_run_id()),
                                    self.listeners.paths[listeners.SERVICE], self.calls,
                                    lambda ok, error: self.post(d.RegistrationSaid(ok, error)))
        self.server.start()
        self.relay.resume(self.server.path)  # type: ignore[union-attr]
        if old is not None:
            old.stop(0)

    def _stopping(self, a: d.Stopping) -> None:
        self.notifier.stopping()

    def _exit(self, a: Exit) -> None:
        pass  # (the loop ends on the driver's exit code)


_DO: Dict[type, Callable] = {
    Say: DraNode._say, Status: DraNode._status, Ready: DraNode._ready, Reloading: DraNode._reloading,
    d.ReadCheckpoint: DraNode._read_checkpoint, prep.WriteCheckpoint: DraNode._write_checkpoint,
    prep.Answer: DraNode._answer, d.Health: DraNode._health, pub.Connect: DraNode._connect,
    pub.ListSlices: DraNode._list, pub.WriteSlices: DraNode._write, prep.ReadClaim: DraNode._read_claim,
    StartSuccessor: DraNode._start_successor, StopSuccessor: DraNode._stop_successor, MainPid: DraNode._main_pid,
    Send: DraNode._send, BecomeMain: DraNode._become_main, d.Drain: DraNode._unserve, d.Resume: DraNode._serve_on,
    d.Stopping: DraNode._stopping, Exit: DraNode._exit,
}


def run(cfg: Config, lock_fd: int = -1, parent: Optional[peers.Parent] = None) -> int:
    """DRA mode's process; `parent`: the DRA predecessor we take over from (a reload)."""
    handed, why = listeners.handed_to_us(os.environ)
    if why:
        say(WARNING, "dra-sockets", f"the sockets handed to this process were not taken: {why}")
    return DraNode(cfg, Notifier(quiet=parent is not None), lock_fd, parent, handed).run()
