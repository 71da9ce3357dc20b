"""DRA mode's daemon: the configured devices judged as in device-plugin mode, their CDI specs
written, the kubelet plugin served, the claims kubelet prepares kept, and the node's
ResourceSlices kept true on the API server.

Three threads, each with one job. The loop (`run`) looks at the nodes every LOOK_EVERY_S, writes
what changed to the CDI specs before a device is listed, and says when the slices are to change;
it also feeds the watchdog and acts on signals. gRPC's threads prepare and unprepare, one call at
a time: a claim kubelet already holds is answered from the checkpoint, without the API server;
a new one is read from the API server and checked (atedevd/dra/claims.py), and the checkpoint
written, before the answer goes. The publisher makes the node's slices what the loop wants
whenever it is told to or the watch on them says they changed (kubelet deletes a node's
slices when it starts, and a driver's 30 s after the driver went): it lists them, and writes
only where they differ, with the pool's generation one higher, so nothing churns while nothing
changes. An API server out of reach delays the slices and new claims; it never stops a
prepare kubelet already holds, nor the start.
"""

import errno
import logging
import os
import select
import signal
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from atedevd.cdi import keeper as cdi_keeper
from atedevd.config import DEFAULT_CONFIG_PATH, Config
from atedevd.config_file.load import ConfigError, load
from atedevd.devices.claims import Claims
from atedevd.dra import checkpoint, plugin
from atedevd.dra.claims import Book, ClaimRef, allocated
from atedevd.dra.cluster import NODE_USER_PREFIX, ClusterError, KubeApi, find_kubeconfig
from atedevd.dra.slices import DRIVER, DraDevice, by_name, device_name, same_content, slices
from atedevd.glue.resource import node_table
from atedevd.kubelet import sockets
from atedevd.systemd import Notifier, event
from atedevd.upgrade import peers
from atedevd.upgrade.machines import Message

INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR
LOOK_EVERY_S = 1.0  # the nodes, looked at this often (device-plugin mode also follows inotify)
RETRY_FIRST_S, RETRY_MOST_S = 0.5, 10.0  # the publisher's back-off when the API server fails
# A new claim's prepare waits this long for the API server (the first connection, a failed read)
# before it answers an error: kubelet gives a prepare 45 s, but a pod whose prepare failed is tried
# again only by its pod sync's back-off, a minute or more later (measured on 1.37).
PREPARE_WAIT_S = 30.0
# A reload (SIGHUP, a package upgrade's) hands over to a successor that registers beside us: kubelet
# 1.33 and newer keep both instances and call the newest, so no prepare finds the driver away.
DRA_MARK = "dra"  # what a DRA predecessor tells its successor it serves (peers.INHERITED)
HANDOVER_LATEST_S = 30.0  # the successor registered by then, or it is stopped and we serve on
KUBELET_AWAY_S = 5.0  # a successor that kubelet has not taken by then takes over all the same
EX_RUNTIME = 1
EX_CONFIG = 78  # the unit does not restart: the sandbox or the file must change first


_SAID: set = set()


def say(level: int, kind: str, text: str, once: Optional[str] = None, **fields: str) -> None:
    """A journal line (`once`: a key said at most once per run), as the device-plugin mode's host says it."""
    if once is not None:
        if once in _SAID:
            return
        _SAID.add(once)
    event(level, kind, text, **fields)


def judged_devices(tables: Dict[str, object], keepers: Dict[str, object], cfg: Config, version: int) -> List[DraDevice]:
    """Every device that may be listed now: healthy as its table judged it, and its CDI names on
    disk (a device whose spec could not be written is not listed: no claim could use it)."""
    out: List[DraDevice] = []
    seen: Dict[str, str] = {}
    for d in cfg.devices:
        snap = tables[d.resource].snapshot(version)  # type: ignore[attr-defined]
        keeper = keepers[d.resource]
        keeper.publish(snap, d)  # type: ignore[attr-defined]
        for key, nodes in snap.grants().items():
            ids = keeper.names(() if key is None else (key,))  # type: ignore[attr-defined]
            if not ids or not nodes:
                continue
            name = device_name(d.resource, key)
            if name in seen:
                say(ERROR, "dra-device-name", f"{d.resource}: device name {name} is {seen[name]}'s already; not listed",
                    once=f"dra-name:{name}", resource=d.resource)
                continue
            seen[name] = d.resource
            out.append(DraDevice(name, d.resource, nodes[0].path, key is None, tuple(ids),
                                 tuple(snap.numa(key)) if key is not None else ()))
    return out


class Publisher:
    """Keeps the node's ResourceSlices what `want` last said, from its own thread."""

    def __init__(self, cfg: Config, status: Callable[[], None]) -> None:
        self.cfg = cfg
        self.node: Optional[str] = cfg.node_name
        self.node_uid: Optional[str] = None
        self.generation = 0
        self.published: Optional[Tuple[DraDevice, ...]] = None  # what the server lists now, as far as we know
        self.problem = ""  # why the slices are not published (the status line says it)
        self._wanted: Tuple[DraDevice, ...] = ()
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._status = status
        self._cluster: Optional[KubeApi] = None
        self.connected = threading.Event()  # the node's name and UID are known: claims can be read
        self.republished = 0  # slices written again after someone else changed or deleted them

    @property
    def cluster(self) -> Optional[KubeApi]:
        return self._cluster

    def want(self, devices: Sequence[DraDevice]) -> None:
        self._wanted = tuple(devices)
        self._poke.set()

    def start(self) -> None:
        threading.Thread(target=self._run, name="dra-publisher", daemon=True).start()
        threading.Thread(target=self._watch, name="dra-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()

    def _failed(self, text: str) -> None:
        if text != self.problem:
            say(WARNING, "dra-api", f"ResourceSlices not published: {text}; trying again")
            self.problem = text
            self._status()

    def _connect(self) -> KubeApi:
        if self._cluster is None:
            path, why = find_kubeconfig(self.cfg.kubeconfig)
            if path is None:
                raise ClusterError(why)
            self._cluster = KubeApi(path)
        c = self._cluster
        if self.node is None:
            user = c.whoami()
            if not user.startswith(NODE_USER_PREFIX):
                raise ClusterError(f"{c.kubeconfig} is {user!r}, not a node's credentials (system:node:<name>): "
                                   "name the node with [daemon] node_name")
            self.node = user[len(NODE_USER_PREFIX):]
            say(INFO, "dra-node", f"node {self.node}: the credentials of {c.kubeconfig} ({user})")
        if self.node_uid is None:
            self.node_uid = c.node_uid(self.node)
        self.connected.set()
        return c

    def _run(self) -> None:
        delay = RETRY_FIRST_S
        while not self._stop.is_set():
            self._poke.wait()
            if self._stop.is_set():
                return
            self._poke.clear()
            try:
                self._ensure(self._connect())
                delay = RETRY_FIRST_S
                if self.problem:
                    say(INFO, "dra-api", "ResourceSlices published again")
                    self.problem = ""
                self._status()
            except ClusterError as e:
                self._failed(str(e))
                self._stop.wait(delay)
                delay = min(RETRY_MOST_S, delay * 2)
                self._poke.set()

    def _ensure(self, c: KubeApi) -> None:
        """The node's slices as wanted: listed, and only what differs written."""
        wanted = self._wanted
        assert self.node is not None
        existing, _ = c.slices(self.node, DRIVER)
        on_server = {str((s.get("metadata") or {}).get("name")): s for s in existing}
        generations = [int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0) for s in existing]
        # The pool's generation never goes back: an earlier run's, or what the server holds, is where it stands.
        self.generation = max([self.generation] + generations)
        docs = slices(self.node, self.node_uid, wanted, self.generation)
        if len(on_server) == len(docs) and all(d["metadata"]["name"] in on_server and
                                               same_content(on_server[d["metadata"]["name"]], d) for d in docs):
            self.published = wanted
            return
        self.generation += 1
        if self.published is not None:
            self.republished += 1
        for d in slices(self.node, self.node_uid, wanted, self.generation):
            name = d["metadata"]["name"]
            if name in on_server:
                c.replace_slice(d, str(on_server[name]["metadata"].get("resourceVersion", "")))
            else:
                c.create_slice(d)
        names = {d["metadata"]["name"] for d in docs}
        for name in on_server:
            if name not in names:
                c.delete_slice(name)
        gone = "" if self.published is not None or not existing else " (an earlier run's replaced)"
        say(INFO, "dra-slices", f"published {len(wanted)} device(s) of node {self.node} in {len(docs)} "
            f"ResourceSlice(s), pool generation {self.generation}{gone}")
        self.published = wanted

    def _watch(self) -> None:
        """Any change to the node's slices (a wipe, someone's edit) pokes the publisher."""
        delay = RETRY_FIRST_S
        while not self._stop.is_set():
            c, node = self._cluster, self.node
            if c is None or node is None or self.published is None:
                self._stop.wait(0.2)
                continue
            try:
                _, version = c.slices(node, DRIVER)
                # What changed between the last watch's end and this list no watch will say: the
                # publisher looks (a list; nothing is written where nothing differs).
                self._poke.set()
                for kind in c.watch_slices(node, DRIVER, version):
                    if kind in ("DELETED", "MODIFIED", "ADDED"):
                        self._poke.set()
                    if self._stop.is_set():
                        return
                delay = RETRY_FIRST_S
            except ClusterError:
                self._poke.set()  # (the publisher says what failed)
                self._stop.wait(delay)
                delay = min(RETRY_MOST_S, delay * 2)


class DraNode:
    """One run of DRA mode."""

    def __init__(self, cfg: Config, notifier: Notifier, lock_fd: int = -1,
                 parent: Optional[peers.Parent] = None) -> None:
        self.cfg = cfg
        self.notifier = notifier
        self.lock_fd = lock_fd
        self.parent = parent  # a predecessor we take over from: prepares wait until it is gone
        self._gate = threading.Event()  # open: this process answers prepares (at once, without a predecessor)
        if parent is None:
            self._gate.set()
        self._told_registered = False
        self.child: Optional[peers.Child] = None  # our successor, while a reload hands over
        self._child_since = 0.0
        self.root = plugin.kubelet_root(cfg.device_plugin_dir)
        self.state_dir = plugin.plugin_dir(self.root)
        self.run_id = sockets.new_run_id()
        self.claims = Claims()
        self.claims.configure(cfg.devices, cfg.dev_root)
        self.tables = {d.resource: node_table(d, cfg.dev_root, cfg.sys_root, self.claims) for d in cfg.devices}
        self.specs = cdi_keeper.Specs(say)
        self.keepers: Dict[str, object] = {}
        self.book = Book()
        self._lock = threading.Lock()  # one prepare or unprepare at a time
        self.devices: Dict[str, DraDevice] = {}
        self._version = 0
        self.registered = ""  # the service kubelet chose, once it said it took us
        self.publisher = Publisher(cfg, self._status)
        self.server: Optional[plugin.DraSockets] = None
        self._signal: Optional[int] = None

    # --- gRPC threads --------------------------------------------------------------------------

    def prepare(self, claims: List[Tuple[str, str, str]]) -> Dict[str, dict]:
        out: Dict[str, dict] = {}
        self._gate.wait(HANDOVER_LATEST_S)  # (a successor: its predecessor's last claims are on disk first)
        with self._lock:
            for namespace, name, uid in claims:
                ref = ClaimRef(namespace, name, uid)
                held = self.book.answer(uid)
                if held is not None:
                    out[uid] = {"devices": held}
                    continue
                out[uid] = self._prepare_new(ref)
        return out

    def _prepare_new(self, ref: ClaimRef) -> dict:
        deadline = time.monotonic() + PREPARE_WAIT_S
        if not self.publisher.connected.wait(PREPARE_WAIT_S):
            return {"error": f"claim {ref.namespace}/{ref.name}: the API server has not been reached in "
                             f"{PREPARE_WAIT_S:.0f} s ({self.publisher.problem or 'starting'})"}
        c, pool = self.publisher.cluster, self.publisher.node
        assert c is not None and pool is not None
        while True:
            try:
                claim = c.claim(ref.namespace, ref.name)
                break
            except ClusterError as e:
                status = e.status
                if (status is not None and 400 <= status < 500 and status not in (401, 429)) or \
                        time.monotonic() >= deadline:
                    return {"error": str(e)}  # (a claim that is not there, or not ours to read: no wait helps)
                time.sleep(0.2)
        devices, why = allocated(claim, ref, pool, self.devices)
        held = [(p.device_name, self.book.sharing(p.device_name)) for p in devices or ()
                if not self.devices[p.device_name].shared and self.book.sharing(p.device_name)]
        if held:  # a pattern unit is one container's: the scheduler never allocates it twice, nor do we
            devices, why = None, (f"claim {ref.namespace}/{ref.name}: device {held[0][0]} is prepared for claim "
                                  f"{held[0][1][0]} already, and is one claim's at a time")
        if devices is None:
            say(WARNING, "dra-prepare", f"not prepared: {why}")
            return {"error": why}
        doc = self.book.prepare(ref, devices)
        try:
            checkpoint.write(self.state_dir, doc)
        except OSError as e:
            self.book.unprepare(ref.uid)
            return {"error": f"claim {ref.namespace}/{ref.name}: the checkpoint could not be written: {e}"}
        say(INFO, "dra-prepared", f"prepared claim {ref.namespace}/{ref.name} ({ref.uid}): "
            + ", ".join(f"{p.device_name} ({', '.join(p.cdi_ids)})" for p in devices))
        return {"devices": tuple(devices)}

    def unprepare(self, claims: List[Tuple[str, str, str]]) -> Dict[str, str]:
        out: Dict[str, str] = {}
        self._gate.wait(HANDOVER_LATEST_S)
        with self._lock:
            for namespace, name, uid in claims:
                doc = self.book.unprepare(uid)
                out[uid] = ""
                if doc is None:
                    continue
                try:
                    checkpoint.write(self.state_dir, doc)
                except OSError as e:
                    out[uid] = f"claim {namespace}/{name}: the checkpoint could not be written: {e}"
                    continue
                say(INFO, "dra-unprepared", f"unprepared claim {namespace}/{name} ({uid})")
        return out

    def _registered(self, ok: bool, error: str) -> None:
        if ok:
            self.registered = "yes"
            self._tell_registered()
            say(INFO, "dra-registered", f"kubelet registered DRA driver {DRIVER} ({self.server.service_path if self.server else ''})")
        else:
            self.registered = ""
            say(ERROR, "dra-registration", f"kubelet refused DRA driver {DRIVER}: {error}")
        self._status()

    # --- the loop -------------------------------------------------------------------------------

    def status_line(self) -> str:
        n = len(self.devices)
        kubelet = "registered with kubelet" if self.registered else "waiting for kubelet"
        if self.publisher.problem:
            slices_text = f"slices not published ({self.publisher.problem[:120]})"
        elif self.publisher.published is None:
            slices_text = "slices not published yet"
        else:
            slices_text = f"{len(self.publisher.published)} device(s) published, generation {self.publisher.generation}"
        return f"DRA: {kubelet}; {n} device(s) judged present; {slices_text}; {len(self.book.claims)} claim(s) prepared"

    def _status(self) -> None:
        self.notifier.status(self.status_line())

    def _look(self, first: bool = False) -> None:
        changed = first
        for d in self.cfg.devices:
            changes, news = self.tables[d.resource].look(True)
            for ch in changes:
                say(ch.level, ch.event, f"{d.resource}: {ch.message}", resource=d.resource, device=ch.device or d.path)
            changed |= news
        if not changed:
            return
        self._version += 1
        devices = judged_devices(self.tables, self.keepers, self.cfg, self._version)
        self.devices = by_name(devices)
        self.publisher.want(devices)
        self._status()

    def start(self) -> None:
        cfg = self.cfg
        doc, why = checkpoint.read(self.state_dir)
        if why:
            say(ERROR, "dra-checkpoint", f"prepared claims not read: {why}; claims kubelet holds are read from the API "
                "server again")
        elif doc is not None:
            why = self.book.load(doc)
            if why:
                say(ERROR, "dra-checkpoint", f"{os.path.join(self.state_dir, checkpoint.FILE)}: {why}; not used")
            else:
                say(INFO, "dra-checkpoint", f"{len(self.book.claims)} prepared claim(s) known from the checkpoint")
        self.specs.configure(cfg._replace(cdi=True, device_specs=False))
        self.keepers = {d.resource: self.specs.keeper(d.resource) for d in cfg.devices}
        self._look(first=True)
        plugin.remove_leftovers(self.root, say)
        self.server = plugin.DraSockets(self.root, self.run_id, plugin.PluginInfoService(
            plugin.service_path(self.root, self.run_id), self._registered), self.prepare, self.unprepare)
        self.server.start()
        say(INFO, "dra-serving", f"serving DRA driver {DRIVER} at {self.server.service_path}, registration at "
            f"{self.server.registration_path}")
        self.publisher.start()
        self._started_at = time.monotonic()
        if self.parent is None:
            self.notifier.ready(self.status_line())

    def run(self) -> int:
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)  # (a signal's byte wakes the loop's select)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        try:
            self.start()
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            say(ERROR, "serve-failed", f"cannot serve DRA sockets in {self.root}: {e.strerror or e} ({e.filename or ''}); "
                "under atedevd.service DRA mode needs the drop-in dra.conf (docs/dra.md), which makes kubelet's plugin "
                "directories writable and lets it reach the API server")
            return EX_CONFIG
        assert self.server is not None
        next_dog = 0.0
        while True:
            sig = self._signal
            if sig is not None:
                self._signal = None
                if sig == signal.SIGHUP:
                    cfg = self._hangup()
                    if cfg is not None and cfg.api == "dra" and self.child is None and self.parent is None:
                        self._start_successor()
                    elif cfg is not None and self.child is None and self.parent is None:
                        return self._stop("restarting to apply the configuration")
                    continue
                if self.child is not None:
                    self.child.terminate()
                return self._stop(f"stopping ({signal.Signals(sig).name})")
            if self.child is not None:
                done = self._successor_news()
                if done is not None:
                    return done
            if self.parent is not None:
                self._predecessor_news()
            now = time.monotonic()
            if self.notifier.watchdog_interval and now >= next_dog:
                self.notifier.watchdog()
                next_dog = now + self.notifier.watchdog_interval
            self._look()
            self.specs.wake(now)
            self._status()  # (the claims prepared since; said only when the line changed)
            gone = self.server.missing()
            if gone:
                say(WARNING, "dra-socket", f"{gone} was removed or replaced by someone else; serving on new sockets")
                self.server.stop(0)
                self.run_id = sockets.new_run_id()
                self.server = plugin.DraSockets(self.root, self.run_id, plugin.PluginInfoService(
                    plugin.service_path(self.root, self.run_id), self._registered), self.prepare, self.unprepare)
                self.server.start()
            channels = [c.fileno() for c in (self.child, self.parent) if c is not None and c.fileno() >= 0]
            if select.select([self._wake_r] + channels, [], [], LOOK_EVERY_S)[0]:  # a signal or a peer: at once
                while True:
                    try:
                        os.read(self._wake_r, 512)
                    except BlockingIOError:
                        break

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def _hangup(self) -> Optional[Config]:
        """SIGHUP: the file is checked. A good one is applied by a successor that registers beside
        us and takes over (the installed atedevd, so a package upgrade's reload runs the new code);
        a switch to the device plugin API by a restart (systemd's Restart=always starts the daemon
        again); a bad file changes nothing."""
        try:
            cfg = load(self.cfg.source or DEFAULT_CONFIG_PATH, required=self.cfg.source is not None)
        except ConfigError as e:
            say(ERROR, "reload", f"configuration not applied, still serving as before:\n{e}")
            return None
        if cfg.api != "dra":
            say(WARNING, "reload", f'[daemon] api = "{cfg.api}": restarting into it (drain the node first: docs/dra.md)')
        return cfg

    # --- a reload: the handover to a successor ------------------------------------------------------

    def _start_successor(self) -> None:
        self.notifier.reloading()
        try:
            self.child = peers.Child(self.lock_fd, (DRA_MARK,))
        except OSError as e:
            say(ERROR, "reload", f"the successor could not be started ({e}); still serving as before")
            self.notifier.ready(self.status_line())
            return
        self._child_since = time.monotonic()
        say(INFO, "reload", "configuration read: a successor registers beside this process and takes over")

    def _successor_news(self) -> Optional[int]:
        """What the successor said: REGISTERED (it serves: it becomes main, we leave), or its end
        (it failed: we serve on). The exit status once we are done, else None."""
        child = self.child
        assert child is not None
        for message in child.receive():
            if message is Message.REGISTERED and child.pid is not None:
                self.notifier.main_pid(child.pid)
                code = self._stop(f"handed over to pid {child.pid}")  # (our sockets go: kubelet calls it alone)
                child.send(Message.MAIN)
                return code
            if message is None:
                why = child.ended(wait_s=1.0) or "exited"
                say(ERROR, "reload", f"the successor {why} before it was registered; still serving as before")
                self.child = None
                self.notifier.ready(self.status_line())
                return None
        if time.monotonic() - self._child_since > HANDOVER_LATEST_S:
            say(ERROR, "reload", f"the successor was not registered in {HANDOVER_LATEST_S:.0f} s; stopped it, still "
                "serving as before")
            child.kill()
            self.child = None
            self.notifier.ready(self.status_line())
        return None

    def _tell_registered(self) -> None:
        if self.parent is not None and not self._told_registered:
            self._told_registered = True
            self.parent.send(Message.REGISTERED)

    def _predecessor_news(self) -> None:
        """A successor's: kubelet took us (or is away), we said so; MAIN (or the predecessor's end)
        makes us systemd's main process, with every claim it prepared read from the checkpoint."""
        parent = self.parent
        assert parent is not None
        if not self._told_registered and time.monotonic() - self._started_at > KUBELET_AWAY_S:
            self._tell_registered()  # kubelet is away: nothing calls either of us
        for message in parent.receive():
            if message is Message.MAIN or message is None:
                parent.close()
                self.parent = None
                self.notifier.become_main()
                doc, why = checkpoint.read(self.state_dir)
                with self._lock:
                    if doc is not None and not why:
                        self.book.load(doc)
                self._gate.set()
                say(INFO, "reload", f"took over: {len(self.book.claims)} prepared claim(s) known")
                self.notifier.ready(self.status_line())
                return

    def _stop(self, why: str) -> int:
        """Sockets gone (kubelet forgets this instance), the checkpoint and the CDI specs kept:
        kubelet's prepared claims still resolve while we are down."""
        say(INFO, "stopping", why)
        self.notifier.stopping()
        self.publisher.stop()
        if self.server is not None:
            self.server.stop()
        return 0


def run(cfg: Config, lock_fd: int = -1, parent: Optional[peers.Parent] = None) -> int:
    """DRA mode's process; `parent`: the DRA predecessor we take over from (a reload)."""
    return DraNode(cfg, Notifier(quiet=parent is not None), lock_fd, parent).run()
