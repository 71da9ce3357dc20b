"""A kubelet stand-in that behaves like the device manager of a real kubelet, on the wire.

kubelet's bookkeeping, in both generations (`kubelet="1.32"`, `"current"`), is
rig/kubelet_model.py's (`DeviceManager`, read from kubelet's devicemanager source; the
simulation runs the same); this is its driver on real sockets, threads and gRPC: the
Registration and pod-resources servers, the dial back to the plugin (blocking, 10 s),
GetDevicePluginOptions, a ListAndWatch thread per client and the teardown after it, each at
the step the model names, and the checkpoint file. Register errors are plain errors (gRPC
UNKNOWN); Allocate through the stand-in fails on a stopped endpoint ("endpoint ... has been
stopped"); the grace period of a stopped endpoint (5 min in kubelet) is a constructor parameter.

Restarts are back to back like a real kubelet's: kill (connections drop, kubelet.sock stays,
stale), then the new process reads the checkpoint, wipes the sockets in the directory (only
sockets, only the directory itself: subdirectories are skipped) and serves a new kubelet.sock at
once (`gap`, default 0, puts a pause between the wipe and serving). kubelet.sock is made as Go's
net.Listen makes it: bound (the file appears: exactly one creation event per start), then
listened on; a Register sent in between is refused (ECONNREFUSED, gRPC UNAVAILABLE).
`listen_gap` (constructor, or per start/restart/recreate_socket; default 0: kubelet's code has
nothing between the two system calls, a real gap is the thread being descheduled there) widens
it. The pod-resources API v1 (GetAllocatableResources, a minimal List) is served on
`<root>/pod-resources/kubelet.sock`, root being the parent of the plugin directory, with the
model's answer: the devices in the resource's healthy set, regardless of the endpoint's stop
time. kubelet rate-limits that API (apis/podresources/grpc/ratelimit.go: 100 requests a second
with a burst of 10, for all clients together, a full bucket per kubelet process; the rest fail
with ResourceExhausted "rejected by rate limit"): so does the stand-in, unless told not to
(`rate_limit=None`, `serve --no-rate-limit`), every call counted per client either way
(`pod_resources_calls`).

Delays can be injected at each of the model's STEPS on the kubelet side (`delays`, seconds or
callables returning seconds): before_dial, after_dial, before_options, before_set_endpoint,
before_return (Register), before_stream (ListAndWatch thread), teardown (after a stream ends,
before the lookup by name/path), teardown_lookup (between that lookup and the deregistration).

Admission: `rejection(resource)` says why kubelet would reject (UnexpectedAdmissionError) a pod
requesting the resource right now (the model's); `record_admission(resource)` logs it at every
change and every millisecond, for the rejection-window benchmark. The pods bound to the node
(`pods`: name, resource, the devices the checkpoint gave them) are admitted again by every
kubelet start, as after a reboot, in one batch `first_admission` seconds after kubelet.sock
appears (kubelet: its sync loop's first pass once the runtime is up; `readmission(pod)`), logged
in `first_admissions`.

Used in-process by the tests and benchmarks (`Kubelet`), and as a script in the
systemd container and the demo:
  kubelet_standin.py serve --plugin-dir DIR --state FILE [--kubelet 1.32|current]
      [--gap S] [--listen-gap S] [--rate-limit] [--pods FILE --first-admission S]
      (SIGHUP: restart like kubelet; SIGTERM: exit, leaving a stale socket)
  kubelet_standin.py allocate --plugin-dir DIR --resource R --ids a,b
"""

import argparse
import collections
import glob
import itertools
import json
import math
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from concurrent import futures
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union

import grpc

from atedevd.api import API_VERSION, DevicePluginStub, pb, pod_resources_handler, prpb, registration_handler

try:
    from rig.kubelet_model import DOWN, GRACE_PERIOD_S, MODES, STEPS, Client, Device, DeviceManager
except ImportError:  # run as a script (the systemd container): the model beside it
    from kubelet_model import DOWN, GRACE_PERIOD_S, MODES, STEPS, Client, Device, DeviceManager

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
POD_RESOURCES_DIR = "pod-resources"
DIAL_TIMEOUT_S = 10.0
_DIAL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # every dial is a fresh connection, as in Go
# kubelet's pod-resources limiter (DefaultQPS, DefaultBurstTokens) and its refusal.
KUBELET_RATE_LIMIT = (100.0, 10)
RATE_LIMITED = "rejected by rate limit"
# On, as kubelet has it: atedevd stays inside it (a budget of its own, 20 a second) and takes
# ResourceExhausted for "ask again later".
RATE_LIMIT_BY_DEFAULT = KUBELET_RATE_LIMIT

Delay = Union[float, Callable[[], float]]


class KubeletError(Exception):
    """An error kubelet itself raises (not the plugin's answer): e.g. a stopped endpoint."""


class _Connection:
    """A client's gRPC connection to its plugin (the model's `Client.conn`) and its ListAndWatch call."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.stub = DevicePluginStub(channel)
        self.stream = None


class _Incarnation:
    """One kubelet process: its device manager (the model) and its sockets, servers and
    connections; everything here dies with it (the checkpoint file survives)."""

    def __init__(self, kubelet: "Kubelet", n: int, restored: List[str] = ()):
        self.kubelet = kubelet
        self.n = n
        self.started_at = time.monotonic()
        self.manager = DeviceManager(kubelet.mode, n, self.started_at, kubelet._numbers, restored,
                                     checkpoint=lambda _registered: kubelet.write_checkpoint(), grace=kubelet.grace,
                                     rate_limit=kubelet.rate_limit)
        self.channels: set = set()
        self.listeners: list = []  # kubelet.sock: a _KubeletSocket or _RenamedSocket
        self.servers: List[grpc.Server] = []  # Registration (first), pod-resources

    @property
    def alive(self) -> bool:
        return self.manager.alive


class Kubelet:
    def __init__(self, plugin_dir: str, kubelet: str = "current", wipe: str = "sockets", on_change=None,
                 grace: float = GRACE_PERIOD_S, delays: Optional[Dict[str, Delay]] = None,
                 pod_resources: bool = True, dial_timeout: float = DIAL_TIMEOUT_S, listen_gap: Delay = 0.0,
                 rate_limit: Optional[Tuple[float, int]] = RATE_LIMIT_BY_DEFAULT, pods: Optional[List[dict]] = None,
                 first_admission: Optional[Delay] = None):
        if kubelet not in MODES:
            raise ValueError(f"kubelet must be one of {MODES}, not {kubelet!r}")
        if not _is_gap(listen_gap):
            raise ValueError(f"listen_gap must be seconds >= 0, a callable returning them or a threading.Event, "
                             f"not {listen_gap!r}")
        if rate_limit is not None and not (len(rate_limit) == 2 and rate_limit[0] > 0 and rate_limit[1] >= 1):
            raise ValueError(f"rate_limit must be (requests a second > 0, burst >= 1) or None, not {rate_limit!r}")
        if (first_admission is None) != (not pods) or not (
                first_admission is None or callable(first_admission)
                or (isinstance(first_admission, (int, float)) and first_admission >= 0)):
            raise ValueError(f"pods and first_admission (seconds >= 0 or a callable) go together, not "
                             f"{len(pods or ())} pods and {first_admission!r}")
        for pod in pods or ():
            if not isinstance(pod, dict) or not isinstance(pod.get("name"), str) or not isinstance(pod.get("resource"), str):
                raise ValueError(f"a pod is {{'name': str, 'resource': str, 'devices': [str, ...]}}, not {pod!r}")
        unknown = set(delays or ()) - set(STEPS)
        if unknown:
            raise ValueError(f"unknown delay steps {sorted(unknown)}; known: {STEPS}")
        self.dir = plugin_dir
        self.socket = os.path.join(plugin_dir, KUBELET_SOCKET)
        self.root = os.path.dirname(os.path.abspath(plugin_dir))
        self.pod_resources_socket = os.path.join(self.root, POD_RESOURCES_DIR, KUBELET_SOCKET) if pod_resources else None
        self.mode = kubelet
        self.wipe_mode = wipe
        self.grace = grace
        self.delays: Dict[str, Delay] = dict(delays or {})
        self.dial_timeout = dial_timeout
        self.listen_gap = listen_gap  # seconds (or a callable) from kubelet.sock's bind to its listen
        self._refuse_registers = None  # refuse_registers()
        self.rate_limit = rate_limit  # pod-resources: (requests a second, burst), None: unlimited
        self.pods = [dict(p) for p in pods or ()]  # bound to the node: admitted again at each start
        self.first_admission = first_admission  # seconds from kubelet.sock appearing to that batch
        self.first_admissions: List[dict] = []  # per start: incarnation, serving_at, at, pods [{name, resource, reason}]
        # pod-resources calls: the newest (monotonic time, client, method, answered), and counts of
        # all of them per client ({"answered": n, "refused": n}); client: _client_of()
        self.pod_resources_log: Deque[Tuple[float, str, str, bool]] = collections.deque(maxlen=100_000)
        self.pod_resources_counts: Dict[str, Dict[str, int]] = {}
        self.cond = _Condition()  # an RLock: kubelet's mutexes, never held across a delay or an RPC
        self._started = 0
        self._numbers = itertools.count(1)  # the clients of every process, numbered
        self.inc = _Incarnation(self, 0)
        self.inc.manager.killed()
        self.processes: List[_Incarnation] = []  # every one started (duplicates() looks at each)
        self.restarts = 0
        self.updates = 0
        # The wire's log, over every process: each Register call (resource, endpoint, at, restart,
        # incarnation, done_at, error, client), the accepted ones, and the refusals' texts.
        self.register_calls: List[dict] = []
        self.registrations: List[dict] = []
        self.rejections: List[str] = []
        self.marks: List[int] = []
        self.serving_at: Optional[float] = None  # when the newest kubelet.sock appeared (bound)
        self.listening_at: Optional[float] = None  # ... and when kubelet listened on it
        self._on_change = on_change

    # --- process life ---------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.inc.alive

    @property
    def manager(self) -> DeviceManager:
        """The running (or last) kubelet process's bookkeeping."""
        return self.inc.manager

    @property
    def incarnation(self) -> int:
        """Which kubelet process this is (1, 2, ...: every start, restart or not)."""
        return self.inc.n

    def start(self, gap: float = 0.0, listen_gap: Optional[Delay] = None) -> None:
        """What a starting kubelet does: restore from the checkpoint, wipe the sockets, serve
        kubelet.sock (`gap` seconds after the wipe; listening `listen_gap` seconds after the
        file appears, the constructor's `listen_gap` if None; a threading.Event: once it is
        set). Returns once it listens."""
        if listen_gap is not None and not _is_gap(listen_gap):
            raise ValueError(f"listen_gap must be seconds >= 0, a callable returning them or a threading.Event, "
                             f"not {listen_gap!r}")
        with self.cond:
            if self.inc.alive:
                raise RuntimeError("already running")
        os.makedirs(self.dir, exist_ok=True)
        restored = self._read_checkpoint()
        with self.cond:
            self._started += 1
            self.inc = _Incarnation(self, self._started, restored)
            inc = self.inc
            self.processes.append(inc)
            self.cond.notify_all()
        self.wipe()
        if gap:
            time.sleep(gap)
        self._serve(inc, listen_gap)
    def _listen(self, inc: _Incarnation, listen_gap: Optional[Delay]):
        """Serve Registration on kubelet.sock, the file appearing once (one creation event,
        stamped `serving_at`) and kubelet listening on it `listen_gap` seconds later (stamped
        `listening_at`); a Register sent in between is refused (ECONNREFUSED).

        With a gap, kubelet.sock is bound at once and listened on after the gap, as Go's
        net.Listen does (bind, then listen); Python's gRPC server binds and listens in one
        step, so it serves on a private abstract address and kubelet.sock relays each
        connection to it (_KubeletSocket; the relay adds about 0.3 ms to a fresh connection
        and its first call). Without one, the server binds and listens in a private
        directory and the socket is renamed into place: it appears already listening, with
        no relay. Either way a killed kubelet leaves kubelet.sock behind, stale."""
        gap = self.listen_gap if listen_gap is None else listen_gap
        gate = gap if isinstance(gap, threading.Event) else None  # listen once it is set (tests)
        gap = 0.0 if gate else gap() if callable(gap) else gap
        server = grpc.server(futures.ThreadPoolExecutor(16), handlers=[registration_handler(_Registration(self, inc))])
        private = os.path.join(self.dir, ".standin", f"k{inc.n}-{time.monotonic_ns() % 10**6}.sock")  # short: sun_path
        if not gate and not (gap and gap > 0) and len(os.fsencode(private)) <= 107:
            os.makedirs(os.path.dirname(private), exist_ok=True)
            if server.add_insecure_port("unix:" + private) == 0:
                raise OSError(f"cannot bind {private}")
            server.start()
            ks = _RenamedSocket()
            with self.cond:
                inc.servers.append(server)
                inc.listeners.append(ks)
                self.serving_at = self.listening_at = ks.created_at = ks.listening_at = time.monotonic()
                inc.manager.listening = True
            os.rename(private, self.socket)
            with self.cond:
                self.cond.notify_all()
            return ks
        abstract = f"atedevd-standin/{os.getpid()}/{id(self):x}/{inc.n}/{time.monotonic_ns()}"
        if server.add_insecure_port("unix-abstract:" + abstract) == 0:
            raise OSError(f"cannot bind the abstract address {abstract!r}")
        server.start()
        with self.cond:
            inc.servers.append(server)
        ks = _KubeletSocket(self.socket, "\0" + abstract)
        with self.cond:
            inc.listeners.append(ks)
            self.serving_at = ks.created_at
            self.listening_at = None
            self.cond.notify_all()
        if gate is not None:
            gate.wait(60)
        elif gap and gap > 0:
            time.sleep(gap)
        ks.listen()
        with self.cond:
            if ks.listening_at is not None:
                self.listening_at = ks.listening_at
                inc.manager.listening = inc.alive
            self.cond.notify_all()
        return ks

    def _serve(self, inc: _Incarnation, listen_gap: Optional[Delay] = None) -> None:
        self._listen(inc, listen_gap)
        if self.pods:
            threading.Thread(target=self._first_admission, args=(inc, self.serving_at), daemon=True,
                             name="first-admission").start()
        if self.pod_resources_socket:
            os.makedirs(os.path.dirname(self.pod_resources_socket), exist_ok=True)
            try:
                os.unlink(self.pod_resources_socket)  # kubelet's listener replaces a stale socket
            except FileNotFoundError:
                pass
            pr = grpc.server(futures.ThreadPoolExecutor(4), handlers=[pod_resources_handler(_PodResources(self, inc))])
            if pr.add_insecure_port("unix:" + self.pod_resources_socket) == 0:
                raise OSError(f"cannot bind {self.pod_resources_socket}")
            pr.start()
            with self.cond:
                inc.servers.append(pr)
        self._changed()

    def kill(self) -> None:
        """What SIGKILL does to kubelet: connections drop, kubelet.sock stays behind, stale."""
        with self.cond:
            inc = self.inc
            if not inc.alive:
                return
            inc.manager.killed()
            channels, inc.channels = list(inc.channels), set()
            listeners, inc.listeners = list(inc.listeners), []
            servers, inc.servers = list(inc.servers), []
            self.cond.notify_all()
        for ks in listeners:  # kubelet.sock stays, stale: connecting to it is refused
            ks.close()
        for ch in channels:
            _close(ch)
        for s in servers:
            s.stop(None).wait(5)
        path = self.pod_resources_socket  # grpc unlinks it on stop; kubelet's file stays
        if path and not os.path.exists(path) and os.path.isdir(os.path.dirname(path)):
            _stale_socket(path)
        self._changed()

    def restart(self, gap: float = 0.0, listen_gap: Optional[Delay] = None) -> None:
        """Die, then start again back to back (`gap` seconds between the wipe and kubelet.sock,
        `listen_gap` between kubelet.sock appearing and kubelet listening on it)."""
        self.kill()
        with self.cond:
            self.restarts += 1
        self.start(gap, listen_gap)

    def recreate_socket(self, listen_gap: Optional[Delay] = None) -> None:
        """What newer kubelets can do without restarting: serve a new kubelet.sock, keep clients."""
        with self.cond:
            inc = self.inc
            old = inc.listeners.pop(0) if inc.listeners else None
            old_server = inc.servers.pop(0) if inc.servers else None  # the Registration server comes first
        if old is not None:
            old.close()
        if old_server is not None:
            old_server.stop(None).wait(5)
        try:
            os.unlink(self.socket)  # kubelet's listener replaces its socket
        except FileNotFoundError:
            pass
        ks = self._listen(inc, listen_gap)
        with self.cond:  # first again: the next recreate_socket replaces it
            inc.listeners.remove(ks)
            inc.listeners.insert(0, ks)
            server = inc.servers.pop()
            inc.servers.insert(0, server)
            self.cond.notify_all()
        self._changed()

    def drop(self, resource: str) -> None:
        """The current endpoint's ListAndWatch stream ends on kubelet's side (an HTTP/2 reset);
        kubelet's teardown then runs as usual."""
        with self.cond:
            e = self.manager.endpoints.get(resource)
            conn = e.client.conn if e is not None and e.client is not None else None
            stream = conn.stream if conn is not None else None
        if stream is not None:
            stream.cancel()

    def close(self) -> None:
        """Test teardown: kill and remove kubelet's sockets."""
        self.kill()
        for path in (self.socket, self.pod_resources_socket):
            try:
                if path:
                    os.unlink(path)
            except FileNotFoundError:
                pass
        shutil.rmtree(os.path.join(self.dir, ".standin"), ignore_errors=True)

    def wipe(self) -> None:
        """CleanupPluginDirectory: the directory's own entries, never recursing; the checkpoint
        stays; os.Stat follows symlinks; directories are skipped and, in "sockets" mode (1.32 and
        master), so is everything that is not a socket. "files": very old kubelets' removeContents."""
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name == CHECKPOINT:
                continue
            try:
                mode = os.stat(path).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode) or (self.wipe_mode == "sockets" and not stat.S_ISSOCK(mode)):
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # --- Registration (plugin/v1beta1/server.go, handler.go, client.go), the model's steps ------

    def Register(self, request, context):
        inc = getattr(_TLS, "inc", None) or self.inc
        name = request.resource_name
        call = {"resource": name, "endpoint": request.endpoint, "at": time.monotonic(), "restart": self.restarts,
                "incarnation": inc.n, "done_at": None, "error": None, "client": None}
        with self.cond:
            self.register_calls.append(call)
            self.cond.notify_all()
        try:
            problem = _invalid(request)
            if problem:
                raise KubeletError(problem)
            refuse = self._refuse_registers
            if refuse is not None and refuse(request.endpoint):  # a test's: as a dial that fails
                raise KubeletError(f"failed to dial device plugin: {request.endpoint}: refused by the test")
            client = self._connect_client(inc, name, request.endpoint)
            call["client"] = client
            self._delay("before_return")
        except KubeletError as e:
            with self.cond:
                call["error"] = str(e)
                call["done_at"] = time.monotonic()
                self.rejections.append(str(e))
                self.cond.notify_all()
            self._changed()
            context.abort(grpc.StatusCode.UNKNOWN, str(e))  # a plain Go error: codes.Unknown
        with self.cond:
            inc.manager.returned(client)
            call["done_at"] = time.monotonic()
            self.registrations.append(call)
            self.cond.notify_all()
        self._changed()
        return pb.Empty()

    def _connect_client(self, inc: _Incarnation, name: str, endpoint: str) -> Client:
        m = inc.manager
        with self.cond:
            c = m.register(name, endpoint, os.path.join(self.dir, endpoint), time.monotonic())
        try:
            self._delay("before_dial")
            channel = self._dial_plugin(inc, c.path)
            with self.cond:  # set even if a teardown's Disconnect ran meanwhile (it found nothing to close)
                c.conn = _Connection(channel)
            self._delay("after_dial")
            self._plugin_connected(inc, c)
        except KubeletError:
            with self.cond:
                m.failed(c)
            raise
        threading.Thread(target=self._run_client, args=(inc, c), daemon=True, name=f"law-{name}").start()
        return c

    def _dial_plugin(self, inc: _Incarnation, path: str) -> grpc.Channel:
        with self.cond:
            if not inc.alive:
                raise KubeletError("kubelet is shutting down")
            channel = grpc.insecure_channel("unix:" + path, options=_DIAL_OPTIONS)
            inc.channels.add(channel)
        if not _dial(channel, self.dial_timeout):
            _close(channel)
            raise KubeletError("failed to dial device plugin: context deadline exceeded")
        return channel

    def _plugin_connected(self, inc: _Incarnation, c: Client) -> None:
        """ManagerImpl.PluginConnected: options (no timeout in kubelet), then the endpoint."""
        m = inc.manager
        self._delay("before_options")
        try:
            with self.cond:
                conn = c.conn
            if conn is None:
                raise ValueError("closed")
            options = conn.stub.GetDevicePluginOptions(pb.Empty(), timeout=60)
        except (grpc.RpcError, ValueError) as e:
            detail = f"rpc error: code = {e.code().name} desc = {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            with self.cond:
                close = m.options_failed(c)
            if close:
                self._close_connection(c)
            raise KubeletError(f"failed to get device plugin options: {detail}")
        self._delay("before_set_endpoint")
        with self.cond:
            refused = m.set_endpoint(c, options)
            self.cond.notify_all()
        if refused:
            self._close_connection(c)
            raise KubeletError(refused)

    def _run_client(self, inc: _Incarnation, c: Client) -> None:
        """runClient: Run, then the teardown, looking the client up again (by name in 1.32)."""
        m = inc.manager
        self._delay("before_stream")
        if not self._run(inc, c):
            return
        self._delay("teardown")
        with self.cond:
            found = m.lookup(c, time.monotonic())
        if found is not None:
            self._delay("teardown_lookup")
            with self.cond:
                if not m.alive:
                    return
                m.let_go(c, found)
                conn, found.conn = found.conn, None
            if conn is not None:
                conn.channel.close()  # at once, as Go's conn.Close(): the plugin sees it before the devices go unhealthy
            with self.cond:
                m.disconnected(c, found, time.monotonic())
        with self.cond:
            self.cond.notify_all()
        self._changed()

    def _run(self, inc: _Incarnation, c: Client) -> bool:
        """c.Run(): ListAndWatch until it ends, every message to the device manager. True: the
        teardown follows."""
        m = inc.manager
        try:
            with self.cond:
                stream = None
                if m.alive and m.may_stream(c):
                    c.conn.stream = stream = c.conn.stub.ListAndWatch(pb.Empty())
                    m.stream_opened(c, time.monotonic())
                    self.cond.notify_all()
            for resp in stream or ():
                with self.cond:
                    t = time.perf_counter()
                    if not m.listed(c, _devices(resp.devices)):
                        break
                    self.updates += 1
                    self.message_handled(c, resp, time.perf_counter() - t)
                    self.cond.notify_all()
        except (grpc.RpcError, ValueError):  # ValueError: the channel closed before the call began
            pass
        finally:
            with self.cond:
                follows = m.stream_ended(c, time.monotonic())
                self.cond.notify_all()
        return follows

    def _close_connection(self, c: Client) -> None:
        with self.cond:
            conn, c.conn = c.conn, None
        if conn is not None:
            conn.channel.close()

    def _delay(self, step: str) -> None:
        d = self.delays.get(step)
        if d is None:
            return
        s = d() if callable(d) else d
        if s and s > 0:
            time.sleep(s)

    # --- pod-resources (apis/podresources/server_v1.go) -------------------------------------

    def get_allocatable_resources(self, inc: Optional[_Incarnation] = None) -> prpb.AllocatableResourcesResponse:
        inc = inc or self.inc
        resp = prpb.AllocatableResourcesResponse()
        with self.cond:
            # kubelet's node status sync (GetCapacity) runs every 10 s; here, at each reading
            m = inc.manager
            for name, ids in sorted(m.allocatable(time.monotonic()).items()):
                for dev_id in sorted(ids):
                    nodes = m.all_devices[name][dev_id][1]
                    if nodes is None:
                        resp.devices.add(resource_name=name, device_ids=[dev_id])
                    else:
                        for n in nodes:
                            resp.devices.add(resource_name=name, device_ids=[dev_id],
                                             topology=prpb.TopologyInfo(nodes=[prpb.NUMANode(ID=n)]))
        return resp

    # --- admission (the device manager's part of admitting a pod) ---------------------------

    def rejection(self, resource: str, inc: Optional[_Incarnation] = None) -> Optional[str]:
        """Why kubelet would reject a pod requesting one unit of `resource` right now (the
        model's DeviceManager.rejection: None admits, DOWN when no kubelet runs). For the
        connection, an ended ListAndWatch stream stands in for a plugin that is gone (a stream
        kubelet itself ended is counted from then on, a little early). Same in both modes: the
        current endpoint is what Allocate uses."""
        with self.cond:
            return (inc or self.inc).manager.rejection(resource)

    def readmission(self, pod: dict, inc: Optional[_Incarnation] = None) -> Optional[str]:
        """Why kubelet would reject `pod`, bound to the node with its containers not running
        (a reboot), at admission now; None if it admits it (DeviceManager.readmission)."""
        with self.cond:
            return (inc or self.inc).manager.readmission(pod["resource"], pod.get("devices") or ())

    def _first_admission(self, inc: _Incarnation, serving_at: float) -> None:
        """The batch of pods bound to the node, `first_admission` seconds after kubelet.sock
        appeared (kubelet's sync loop, once the runtime is up, handles them in one pass)."""
        d = self.first_admission
        left = serving_at + (d() if callable(d) else d) - time.monotonic()
        if left > 0:
            time.sleep(left)
        with self.cond:
            if not inc.alive:
                return
            batch = {"incarnation": inc.n, "serving_at": serving_at, "at": time.monotonic(),
                     "pods": [{"name": p["name"], "resource": p["resource"], "reason": self.readmission(p, inc)}
                              for p in self.pods]}
            self.first_admissions.append(batch)
            self.cond.notify_all()
        self._changed()

    def admits(self, resource: str) -> bool:
        return self.rejection(resource) is None

    def record_admission(self, resource: str, period: float = 0.001) -> "AdmissionLog":
        """Start recording, every `period` and at every change kubelet notifies, whether a pod
        requesting `resource` would be admitted; stop() the log when done."""
        return AdmissionLog(self, resource, period).start()

    # --- what tests ask ------------------------------------------------------------

    @property
    def clients(self) -> Dict[str, Client]:
        """The client behind each resource's current endpoint."""
        with self.cond:
            return {n: e.client for n, e in self.manager.endpoints.items() if e.client is not None}

    def current_endpoint(self, resource: str) -> Optional[str]:
        """The socket file name of the resource's current endpoint (None if none)."""
        with self.cond:
            e = self.manager.endpoints.get(resource)
            return e.name if e is not None else None

    def stopped(self, resource: str) -> Optional[bool]:
        """Whether the resource's current endpoint is stopped (None: no endpoint)."""
        with self.cond:
            e = self.manager.endpoints.get(resource)
            return None if e is None else e.stopped_at is not None

    def refuse_registers(self, endpoint_refused) -> None:
        """Fail every Register whose endpoint (a socket's file name) `endpoint_refused` says
        yes to, as a dial that fails (None: none)."""
        self._refuse_registers = endpoint_refused

    def live_streams(self, resource: str) -> List[Client]:
        """Clients of this kubelet process whose ListAndWatch for `resource` is open."""
        with self.cond:
            return [c for c in self.manager.all_clients if c.resource == resource and c.streaming]

    def registration_count(self, resource: str) -> int:
        with self.cond:
            return sum(1 for r in self.registrations if r["resource"] == resource)

    def capacity(self, resource: str) -> int:
        """The node's allocatable for `resource` (GetCapacity): healthy units, 0 once stopped units
        are marked unhealthy, gone after the grace period."""
        with self.cond:
            m = self.manager
            return m.capacity(time.monotonic()).get(resource, (0, 0))[1] if m.alive else 0

    node_allocatable = capacity

    def allocatable(self, resource: str) -> int:
        """What pod-resources GetAllocatableResources reports for `resource` (distinct device IDs)."""
        if not self.inc.alive:
            return 0
        resp = self.get_allocatable_resources()
        return len({i for d in resp.devices if d.resource_name == resource for i in d.device_ids})

    def pod_resources_calls(self, since: float = 0.0) -> Dict[str, Dict[str, int]]:
        """Pod-resources calls since `since` (monotonic; the newest 100,000), per client:
        {"answered": n, "refused": n}."""
        out: Dict[str, Dict[str, int]] = {}
        with self.cond:
            log = list(self.pod_resources_log)
        for at, client, _method, answered in log:
            if at >= since:
                counts = out.setdefault(client, {"answered": 0, "refused": 0})
                counts["answered" if answered else "refused"] += 1
        return out

    def devices(self, resource: str) -> Dict[str, str]:
        """The device manager's view: every known ID of the resource and its health."""
        with self.cond:
            m = self.manager
            out = {i: "Unhealthy" for i in m.unhealthy.get(resource, ())}
            out.update({i: "Healthy" for i in m.healthy.get(resource, ())})
            return out

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def wait_connected(self, resource: str, registrations: int = 1, timeout: float = 10.0) -> bool:
        """Until `resource` has registered at least `registrations` times (in all) and the
        current endpoint is not stopped and its stream is up."""

        def ok():
            e = self.manager.endpoints.get(resource)
            n = sum(1 for r in self.registrations if r["resource"] == resource)
            return n >= registrations and e is not None and e.stopped_at is None and e.client is not None \
                and e.client.connected
        return self.wait(ok, timeout)

    def allocate(self, resource: str, ids: List[str], timeout: float = 10.0, check_health: bool = False) -> pb.AllocateResponse:
        """Allocate as kubelet does: one container request, on the current endpoint; kubelet's own
        refusals raise KubeletError. check_health adds devicesToAllocate's checks."""
        with self.cond:
            m = self.manager
            refusal = m.allocate_refusal(resource, check_health)
            if refusal is not None:
                raise KubeletError(refusal)
            e = m.endpoints[resource]
            conn = e.client.conn if e.client is not None else None
        if conn is None:
            raise KubeletError(f"endpoint {e!r} has no connection")
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        try:
            return conn.stub.Allocate(req, timeout=timeout)
        except ValueError as err:  # the connection was closed under it
            raise KubeletError(f"endpoint {e!r}: {err}")

    def mark(self) -> int:
        """Start a registration round: assert_healthy(since=...) looks only at later Register calls."""
        with self.cond:
            return len(self.register_calls)

    def duplicates(self, resource: str, since: int = 0) -> List[tuple]:
        """Pairs of Register calls for `resource` accepted by one kubelet process, since the mark
        `since`, the second arriving before the first's client had been torn down by kubelet."""
        with self.cond:
            among = {r["client"] for r in self.register_calls[since:] if r["client"] is not None}
            return [(a.client, b.client) for inc in self.processes for a, b in inc.manager.duplicates(resource, among)]

    def assert_healthy(self, resource: str, expected: int, since: int = 0, new_registrations: int = 0,
                       timeout: float = 10.0) -> None:
        """The healthy end state, waited for up to `timeout`: the model's (DeviceManager.problems:
        kubelet quiet, exactly one live ListAndWatch stream for `resource`, on the newest
        registration's socket, that endpoint current and not stopped, allocatable to the node and in
        pod-resources equal to `expected`), with at least `new_registrations` Register calls of
        `resource` accepted since `since` (a mark()) and none in flight, in any process; then an
        Allocate through kubelet's endpoint succeeds, the state still holds, and no duplicate
        registration since `since`."""

        def problems() -> List[str]:
            out = self.manager.problems(resource, expected, time.monotonic())
            new = [r for r in self.register_calls[since:] if r["resource"] == resource and r["error"] is None
                   and r["done_at"] is not None]
            if len(new) < new_registrations:
                out.append(f"{len(new)} registrations accepted since the mark, expected >= {new_registrations}")
            busy = [r["endpoint"] for r in self.register_calls if r["done_at"] is None]
            if busy:
                out.append(f"Register calls in flight: {busy}")
            return out

        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = problems()
                left = deadline - time.monotonic()
                if not found or left <= 0:
                    break
                self.cond.wait(min(left, 0.05))  # device counts also change on the clock (grace period)
        if found:
            raise AssertionError(f"{resource}: not in the healthy end state: {'; '.join(found)}\n{self.dump(resource)}")
        ids = sorted(self.devices(resource))[:1]
        try:
            resp = self.allocate(resource, ids, check_health=True)
        except (KubeletError, grpc.RpcError) as err:
            raise AssertionError(f"{resource}: Allocate({ids}) through kubelet failed: {err}\n{self.dump(resource)}")
        if len(resp.container_responses) != 1:
            raise AssertionError(f"{resource}: Allocate answered {resp}\n{self.dump(resource)}")
        with self.cond:
            found = problems()
        if found:
            raise AssertionError(f"{resource}: left the healthy end state: {'; '.join(found)}\n{self.dump(resource)}")
        dup = self.duplicates(resource, since)
        if dup:
            pairs = "; ".join(f"{a.endpoint}@{a.registered_at:.4f} then {b.endpoint}@{b.registered_at:.4f}" for a, b in dup)
            raise AssertionError(f"{resource}: duplicate registrations in one kubelet process: {pairs}\n{self.dump(resource)}")

    def dump(self, resource: Optional[str] = None, last: int = 12) -> str:
        """The state, for failure messages."""
        with self.cond:
            inc, m = self.inc, self.manager
            t0 = inc.started_at
            lines = [f"kubelet stand-in mode={self.mode} kubelet#{inc.n} alive={inc.alive} grace={self.grace}s"]
            calls = [r for r in self.register_calls if resource is None or r["resource"] == resource][-last:]
            lines.append(f"Register calls (last {len(calls)}; times from kubelet#{inc.n} start):")
            for r in calls:
                c = r["client"]
                lines.append(
                    f"  kubelet#{r['incarnation']} {r['resource']} {r['endpoint']} at {r['at'] - t0:+.4f}"
                    f" done {((r['done_at'] or t0) - t0):+.4f} {'ERROR ' + r['error'] if r['error'] else 'OK'}"
                    + (f" stream {_t(c.stream_started_at, t0)}..{_t(c.stream_ended_at, t0)} torn down {_t(c.torn_down_at, t0)}"
                       if c else ""))
            for name, e in sorted(m.endpoints.items()):
                if resource is None or name == resource:
                    lines.append(f"  endpoint {name}: {e!r} stopped={'no' if e.stopped_at is None else _t(e.stopped_at, t0)}"
                                 f" client={e.client}")
            for name in sorted(set(m.healthy) | set(m.unhealthy)):
                if resource is None or name == resource:
                    lines.append(f"  devices {name}: healthy={len(m.healthy.get(name, ()))}"
                                 f" unhealthy={len(m.unhealthy.get(name, ()))}")
            for name, hc in sorted(m.server_clients.items()):
                if resource is None or name == resource:
                    lines.append(f"  handler clients {name}: {hc}")
            live = [c for c in m.all_clients if c.streaming and (resource is None or c.resource == resource)]
            lines.append(f"  live streams: {live}")
        try:
            lines.append(f"  plugin dir: {sorted(os.listdir(self.dir))}")
        except OSError as e:
            lines.append(f"  plugin dir: {e}")
        return "\n".join(lines)

    def state(self) -> dict:
        with self.cond:
            m = self.manager
            caps = m.capacity(time.monotonic()) if m.alive else {}
            resources = {}
            names = set(m.endpoints) | set(m.healthy) | {r["resource"] for r in self.registrations}
            for name in sorted(names):
                e = m.endpoints.get(name)
                c = e.client if e else None
                resources[name] = {
                    "endpoint": e.name if e else None,
                    "registrations": sum(1 for r in self.registrations if r["resource"] == name),
                    "connected": bool(c and c.connected and e.stopped_at is None),
                    "stopped": bool(e and e.stopped_at is not None),
                    "healthy": len(m.healthy.get(name, ())),
                    "unhealthy": len(m.unhealthy.get(name, ())),
                    "allocatable": caps.get(name, (0, 0))[1],
                    "live_streams": sum(1 for x in m.all_clients if x.resource == name and x.streaming),
                }
            calls = {client: dict(counts) for client, counts in self.pod_resources_counts.items()}
            return {"pid": os.getpid(), "mode": self.mode, "restarts": self.restarts, "alive": m.alive,
                    "resources": resources, "pod_resources_calls": calls,
                    "first_admissions": [dict(b, pods=[dict(p) for p in b["pods"]]) for b in self.first_admissions],
                    "rate_limit": list(self.rate_limit) if self.rate_limit else None}

    def write_checkpoint(self) -> None:
        """As kubelet does after every ListAndWatch message (the model calls it, with the lock
        held): the registered resources and their healthy IDs."""
        data = {"RegisteredDevices": {n: sorted(ids) for n, ids in self.manager.healthy.items()}}
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".checkpoint")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, os.path.join(self.dir, CHECKPOINT))
        except OSError:
            pass  # the directory may be going away under a test

    def _read_checkpoint(self) -> List[str]:
        """readCheckpoint: the registered resources (the model restores them stopped, with no devices)."""
        try:
            with open(os.path.join(self.dir, CHECKPOINT)) as f:
                return list(json.load(f).get("RegisteredDevices", {}))
        except (OSError, ValueError, AttributeError):
            return []

    def message_handled(self, client: Client, resp, seconds: float) -> None:
        """Called (lock held) after each ListAndWatch message is handled, with the time the
        device manager's part took (device sets and checkpoint); for benchmarks to override."""

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

class _Condition(threading.Condition):
    """The stand-in's lock and condition. Every change to kubelet's state is followed by
    notify_all() with the lock held: `on_change` callbacks run right there, so a change is
    seen the moment it is made (the admission log stamps it), not when a waiter next runs."""

    def __init__(self):
        super().__init__()
        self.on_change: List[Callable[[], None]] = []

    def notify_all(self) -> None:
        for fn in self.on_change:
            fn()
        super().notify_all()

    notifyAll = notify_all


POD_PERIOD_S = 0.01  # AdmissionLog.pods_rejected(): a pod put in every 10 ms (100 a second)


class AdmissionLog:
    """Kubelet.rejection() looked at whenever the stand-in changes kubelet's state (at the
    change, under its lock) and every `period` seconds besides (1 ms: changes made without a
    notification, and time), kept as transitions: (time, state, reason) with state "admit",
    "reject" or "down", one whenever the reason changes. `rejected(t0, t1)` sums the time kubelet would have rejected a pod in
    [t0, t1]. `max_gap` is the widest gap between the periodic samples (a loaded machine)."""

    def __init__(self, kubelet: "Kubelet", resource: str, period: float = 0.001):
        if not period > 0:
            raise ValueError(f"period must be > 0 seconds, not {period!r}")
        self.kubelet = kubelet
        self.resource = resource
        self.period = period
        self.transitions: List[tuple] = []
        self.samples = 0
        self.max_gap = 0.0
        self._running = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "AdmissionLog":
        self._running = True
        with self.kubelet.cond:
            self.kubelet.cond.on_change.append(self._look)
            self._look()
        self._thread = threading.Thread(target=self._run, daemon=True, name="admission")
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.kubelet.cond:
            self._running = False
            if self._look in self.kubelet.cond.on_change:
                self.kubelet.cond.on_change.remove(self._look)
            self.kubelet.cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    def _look(self) -> None:
        """With the lock held: log the state if it changed."""
        reason = self.kubelet.rejection(self.resource)
        state = "admit" if reason is None else "down" if reason == DOWN else "reject"
        if not self.transitions or self.transitions[-1][2] != reason:
            self.transitions.append((time.monotonic(), state, reason))

    def _run(self) -> None:
        cond = self.kubelet.cond
        last_at = None
        with cond:
            while self._running:
                now = time.monotonic()
                self._look()
                if last_at is not None:
                    self.max_gap = max(self.max_gap, now - last_at)
                last_at = now
                self.samples += 1
                threading.Condition.wait(cond, self.period)  # woken by changes too: then it looks again

    @property
    def state(self) -> Optional[str]:
        """The newest state logged."""
        with self.kubelet.cond:
            return self.transitions[-1][1] if self.transitions else None

    def state_at(self, t: float) -> Optional[str]:
        with self.kubelet.cond:
            found = None
            for at, state, _ in self.transitions:
                if at > t:
                    break
                found = state
            return found

    def rejected_by_reason(self, t0: float, t1: float) -> Dict[str, float]:
        """Seconds rejecting within [t0, t1], per reason kubelet would give."""
        with self.kubelet.cond:
            marks = list(self.transitions)
        out: Dict[str, float] = {}
        for i, (at, state, reason) in enumerate(marks):
            end = marks[i + 1][0] if i + 1 < len(marks) else max(t1, at)
            a, b = max(at, t0), min(end, t1)
            if state == "reject" and b > a:
                out[reason] = out.get(reason, 0.0) + b - a
        return out

    def pods_rejected(self, t0: float, t1: float, period: float = POD_PERIOD_S) -> Tuple[int, int]:
        """(rejected, put in): the pods an admission loop putting one in every `period`
        seconds (at the multiples of `period` on the monotonic clock) within [t0, t1] would
        have seen rejected, and how many it put in while kubelet ran. Read from the
        transitions, which are stamped as kubelet's state changes: a loop's own lateness on a
        busy machine is not in it."""
        with self.kubelet.cond:
            marks = list(self.transitions)
        rejected = put_in = 0
        for i, (at, state, _reason) in enumerate(marks):
            end = marks[i + 1][0] if i + 1 < len(marks) else max(t1, at)
            a, b = max(at, t0), min(end, t1)
            if b <= a or state == "down":
                continue
            n = math.floor(b / period - 1e-12) - math.floor(a / period - 1e-12)  # multiples in (a, b]
            put_in += n
            if state == "reject":
                rejected += n
        return rejected, put_in

    def rejected(self, t0: float, t1: float) -> Tuple[float, int, List[str]]:
        """(seconds rejecting within [t0, t1], how many separate rejecting spells, their reasons)."""
        with self.kubelet.cond:
            marks = list(self.transitions)
        merged = []  # [start, end, reasons] of each run of "reject" entries
        for i, (at, state, reason) in enumerate(marks):
            end = marks[i + 1][0] if i + 1 < len(marks) else max(t1, at)
            if state != "reject":
                continue
            if merged and merged[-1][1] == at:
                merged[-1][1] = end
                merged[-1][2].append((at, end, reason))
            else:
                merged.append([at, end, [(at, end, reason)]])
        total, spells, reasons = 0.0, 0, []
        for start, end, parts in merged:
            a, b = max(start, t0), min(end, t1)
            if b <= a:
                continue
            total += b - a
            spells += 1
            for part_start, part_end, reason in parts:
                if min(part_end, t1) > max(part_start, t0) and reason not in reasons:
                    reasons.append(reason)
        return total, spells, reasons


class _RenamedSocket:
    """kubelet.sock renamed into place already listening (no gap): the gRPC server owns it."""

    upstream = None

    def __init__(self):
        self.created_at: Optional[float] = None
        self.listening_at: Optional[float] = None

    def close(self) -> None:
        pass  # the server's stop() closes the listener; the file stays


class _KubeletSocket:
    """kubelet.sock as Go's net.Listen makes it: bind (the file appears), then listen. Until
    listen(), connect() is refused (ECONNREFUSED: gRPC's UNAVAILABLE, "Connection refused");
    after close() the file stays, stale, and connecting is refused again, as after a kill.
    Each accepted connection is relayed to `upstream` (the Registration server's private
    abstract address) by two threads copying bytes, one per direction."""

    def __init__(self, path: str, upstream: str):
        self.path = path
        self.upstream = upstream
        self.created_at: Optional[float] = None
        self.listening_at: Optional[float] = None
        self._lock = threading.Lock()
        self._closed = False
        self._relayed: List[socket.socket] = []
        self.accepted: List[float] = []  # when each connection was accepted
        self.first_bytes: List[float] = []  # when each connection that sent anything sent its first bytes
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind_unix(self._sock, path)
        except OSError as e:
            self._sock.close()
            raise OSError(e.errno, f"cannot bind {path}: {e.strerror}") from None
        self.created_at = time.monotonic()
        self._listening = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="kubelet.sock").start()

    def listen(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._sock.listen(4096)  # Go: net.core.somaxconn
            self.listening_at = time.monotonic()
        self._listening.set()

    def _accept(self) -> None:
        """Accept, and hand the connection over at once (as Go's accept loop starts a
        goroutine per connection): a connection that is slow to relay holds up no other.
        Started with the socket, so that accepting begins the moment it listens (a
        thread's start takes a Python process a fraction of a millisecond; Go's
        accept loop runs right after listen returns)."""
        self._listening.wait()
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self.accepted.append(time.monotonic())
            threading.Thread(target=self._relay, args=(conn,), daemon=True, name="kubelet.sock relay").start()

    def _relay(self, conn: socket.socket) -> None:
        """The server is dialled when the client first sends: a connection that closes
        without a word (a connect probe) costs kubelet nothing, as in Go's server."""
        try:
            first = conn.recv(65536)
        except OSError:
            first = b""
        if not first:
            conn.close()
            return
        self.first_bytes.append(time.monotonic())
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(self.upstream)
            up.sendall(first)
        except OSError:
            conn.close()
            up.close()
            return
        with self._lock:
            if self._closed:
                conn.close()
                up.close()
                return
            self._relayed += [conn, up]
        pair = [2]  # pumps still running; the last one closes both sockets
        threading.Thread(target=self._pump, args=(up, conn, conn, up, pair), daemon=True,
                         name="kubelet.sock relay").start()
        self._pump(conn, up, conn, up, pair)

    def _pump(self, src: socket.socket, dst: socket.socket, a: socket.socket, b: socket.socket, pair: list) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)  # pass the end of stream on
        except OSError:
            pass
        with self._lock:
            pair[0] -= 1
            last = pair[0] == 0
            if last:
                for s in (a, b):
                    if s in self._relayed:
                        self._relayed.remove(s)
        if last:
            a.close()
            b.close()

    def close(self) -> None:
        """The process dies: the listener closes (the file stays), relayed connections drop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            relayed = list(self._relayed)
        for s in [self._sock] + relayed:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes accept() and recv() in the other threads
            except OSError:
                pass
        self._sock.close()
        self._listening.set()  # one that never listened: its accept thread ends on the closed socket


def _is_gap(value) -> bool:
    return callable(value) or isinstance(value, threading.Event) or \
        (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0)


def _bind_unix(sock: socket.socket, path: str) -> None:
    """bind() at `path`, through /proc/self/fd when the path does not fit in sun_path (107 bytes)."""
    if len(os.fsencode(path)) <= 107:
        sock.bind(path)
        return
    dfd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        sock.bind(f"/proc/self/fd/{dfd}/{os.path.basename(path)}")
    finally:
        os.close(dfd)


_TLS = threading.local()  # the kubelet process whose server is handling this thread's call


class _Registration:
    """The v1beta1.Registration servicer of one kubelet process."""

    def __init__(self, kubelet: Kubelet, inc: _Incarnation):
        self.kubelet = kubelet
        self.inc = inc

    def Register(self, request, context):
        _TLS.inc = self.inc  # through the Kubelet's (overridable) method, bound to this process
        try:
            return self.kubelet.Register(request, context)
        finally:
            _TLS.inc = None


class _PodResources:
    """The v1.PodResourcesLister servicer of one kubelet process, behind its limiter."""

    def __init__(self, kubelet: Kubelet, inc: _Incarnation):
        self.kubelet = kubelet
        self.inc = inc

    def _admit(self, method: str, context) -> None:
        """kubelet's LimiterUnaryServerInterceptor: refuse when the bucket is empty; count either way."""
        client = _client_of(context)
        with self.kubelet.cond:
            limiter = self.inc.manager.limiter
            answered = limiter is None or limiter.allow(time.monotonic())
            self.kubelet.pod_resources_log.append((time.monotonic(), client, method, answered))
            counts = self.kubelet.pod_resources_counts.setdefault(client, {"answered": 0, "refused": 0})
            counts["answered" if answered else "refused"] += 1
            self.kubelet.cond.notify_all()
        if not answered:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, RATE_LIMITED)

    def GetAllocatableResources(self, request, context):
        self._admit("GetAllocatableResources", context)
        return self.kubelet.get_allocatable_resources(self.inc)

    def List(self, request, context):
        self._admit("List", context)
        return prpb.ListPodResourcesResponse()  # no pods on this node


def _client_of(context) -> str:
    """Who made a pod-resources call, for counting: the product of its user-agent
    (`node-agent` for rig/node_agent.py, `grpc-python` for atedevd and other Python
    clients that set none). grpc gives a unix socket's peer as "unix:", whoever it is."""
    for key, value in context.invocation_metadata():
        if key == "user-agent" and value:
            return value.split()[0].split("/")[0]
    return "unknown"


def _invalid(request) -> Optional[str]:
    """kubelet's checks on a RegisterRequest, with its error texts (the endpoint is not checked)."""
    if request.version != API_VERSION:
        return f'requested API version "{request.version}" is not supported by kubelet. Supported version is ["{API_VERSION}"]'
    name = request.resource_name
    domain = name.split("/", 1)[0]
    if "/" not in name or domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or name.startswith("requests."):
        return f'the ResourceName "{name}" is invalid'
    return None


def _dial(channel: grpc.Channel, timeout: float) -> bool:
    """grpc.DialContext(..., WithBlock()): until the channel is connected (True) or `timeout`
    seconds have passed (False).

    Not grpc.channel_ready_future: its connectivity poller watches the channel in 0.2 s
    steps and lingers for one more step after the channel is ready, and a close() waits for
    that watch to come due (grpc's cygrpc `_close`: "TODO: Cancel connectivity watching"), so
    a connection closed within 0.2 s of its dial stayed open up to 0.2 s longer, where Go's
    kubelet closes it at once. Watched here one state change at a time instead, nothing is
    left pending once it is ready, and close() takes a tenth of a millisecond. Through the
    channel's core object (grpc's own poller uses the same two calls); a grpc without them
    gets the ready future and its linger."""
    core = getattr(channel, "_channel", None)
    if not (hasattr(core, "check_connectivity_state") and hasattr(core, "watch_connectivity_state")):
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False
    from grpc._cython import cygrpc

    deadline = time.time() + timeout  # the core's deadlines are on the realtime clock
    state = core.check_connectivity_state(True)
    while state != cygrpc.ConnectivityState.ready:
        if time.time() >= deadline:
            return False
        core.watch_connectivity_state(state, deadline)  # returns at the next change, or the deadline
        state = core.check_connectivity_state(True)  # try again after a failure (Go's WithBlock retries)
    return True


def _close(channel: grpc.Channel) -> None:
    """Close in the background, for a kill dropping every connection at once (a close
    waits until the channel's open calls are cancelled and drained)."""
    threading.Thread(target=channel.close, daemon=True).start()


def _devices(devices) -> Dict[str, Device]:
    """A ListAndWatch message's devices as the model keeps them: ID -> (health, NUMA node IDs or None)."""
    return {d.ID: (d.health, [n.ID for n in d.topology.nodes] if d.HasField("topology") else None) for d in devices}


def _t(at: Optional[float], t0: float) -> str:
    return "-" if at is None else f"{at - t0:+.4f}"


def _stale_socket(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
    except OSError:
        pass
    finally:
        s.close()


def plugin_sockets(plugin_dir: str, resource: str) -> List[str]:
    """The plugin's socket files for `resource` in the directory, newest first
    (`ate.dev_kvm.<instance>-<n>.sock`, or the oldest fixed `ate.dev-kvm.sock`)."""
    base = resource.replace("/", "_", 1)
    paths = glob.glob(os.path.join(glob.escape(plugin_dir), f"{glob.escape(base)}.*.sock"))
    fixed = os.path.join(plugin_dir, resource.replace("/", "-") + ".sock")
    if os.path.exists(fixed):
        paths.append(fixed)
    paths = [p for p in paths if _is_socket(p)]
    return sorted(paths, key=lambda p: _mtime_ns(p), reverse=True)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _mtime_ns(path: str) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return 0


# --- script -----------------------------------------------------------------------


def _write_state(path: str, kubelet: Kubelet) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".state")
    with os.fdopen(fd, "w") as f:
        json.dump(kubelet.state(), f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _serve(args) -> int:
    lock = threading.Lock()

    def on_change(k):
        with lock:
            _write_state(args.state, k)

    kubelet = Kubelet(args.plugin_dir, kubelet=args.kubelet, on_change=on_change if args.state else None,
                      grace=args.grace, pod_resources=not args.no_pod_resources, listen_gap=args.listen_gap,
                      rate_limit=KUBELET_RATE_LIMIT if args.rate_limit else None, pods=_read_pods(args.pods),
                      first_admission=args.first_admission)
    restart = threading.Event()
    stop = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: restart.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    kubelet.start()
    print(f"kubelet stand-in ({args.kubelet}) serving {kubelet.socket}", flush=True)
    last = None
    while not stop.is_set():
        if restart.wait(0.2):
            restart.clear()
            kubelet.restart(args.gap)
            print(f"kubelet stand-in restarted ({kubelet.restarts})", flush=True)
        if args.state:
            state = kubelet.state()  # device updates arrive on stream threads
            if state != last:
                on_change(kubelet)
                last = state
    kubelet.kill()
    return 0


def _read_pods(path: Optional[str]) -> Optional[List[dict]]:
    """The pods bound to the node: a JSON list of {"name", "resource", "devices"}."""
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def _allocate(args) -> int:
    """Allocate on the resource's plugin socket: the one named in the stand-in's state file if
    given, else the newest matching socket in the directory."""
    path = None
    if args.state and os.path.exists(args.state):
        with open(args.state) as f:
            name = ((json.load(f).get("resources") or {}).get(args.resource) or {}).get("endpoint")
        path = os.path.join(args.plugin_dir, name) if name else None
    if path is None:
        found = plugin_sockets(args.plugin_dir, args.resource)
        if not found:
            print(json.dumps({"code": "NOT_FOUND", "details": f"no socket for {args.resource} in {args.plugin_dir}"}))
            return 1
        path = found[0]
    channel = grpc.insecure_channel("unix:" + path)
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=args.ids.split(","))])
    try:
        resp = DevicePluginStub(channel).Allocate(req, timeout=10)
    except grpc.RpcError as e:
        print(json.dumps({"code": e.code().name, "details": e.details()}))
        return 1
    out = [{"devices": [{"host_path": d.host_path, "container_path": d.container_path, "permissions": d.permissions} for d in c.devices]} for c in resp.container_responses]
    print(json.dumps({"container_responses": out}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--plugin-dir", required=True)
    s.add_argument("--state")
    s.add_argument("--kubelet", default="current", choices=MODES)
    s.add_argument("--gap", type=float, default=0.0, help="seconds between the wipe and serving again on restart")
    s.add_argument("--listen-gap", type=float, default=0.0,
                   help="seconds between kubelet.sock appearing and kubelet listening on it (Register refused meanwhile)")
    s.add_argument("--grace", type=float, default=GRACE_PERIOD_S, help="seconds a stopped endpoint's resource is kept")
    s.add_argument("--no-pod-resources", action="store_true", help="do not serve <root>/pod-resources/kubelet.sock")
    s.add_argument("--pods", help="the pods bound to the node (JSON: [{name, resource, devices}]), admitted again "
                                   "at each start, as after a reboot")
    s.add_argument("--first-admission", type=float, help="seconds from kubelet.sock appearing to that admission")
    s.add_argument("--rate-limit", action=argparse.BooleanOptionalAction, default=RATE_LIMIT_BY_DEFAULT is not None,
                   help="limit pod-resources as kubelet does: 100 requests a second, burst 10, all clients together")
    a = sub.add_parser("allocate")
    a.add_argument("--plugin-dir", required=True)
    a.add_argument("--resource", required=True)
    a.add_argument("--ids", required=True)
    a.add_argument("--state", help="the serving stand-in's state file, naming the current socket")
    args = p.parse_args(argv)
    return _serve(args) if args.command == "serve" else _allocate(args)


if __name__ == "__main__":
    sys.exit(main())
