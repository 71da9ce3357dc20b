"""A stand-in for kubelet's DRA side on real sockets: its plugin watcher, its DRA plugin manager
(the bookkeeping is rig/dra_kubelet_model.py's, which the simulation runs too) and its calls.

It watches `<root>/plugins_registry/` with inotify as kubelet does (a socket created, or there
at the start, is registered: GetInfo, the model's checks, NotifyRegistrationStatus; one
removed is deregistered; a file that stays is never asked again), keeps one gRPC channel per
instance that reconnects by itself, follows its state into the model's "connected" (the slices
of a driver with no connected instance are wiped 30 s later on the API server stand-in), opens
the health stream where the model's kubelet version would, and sends prepare and unprepare to
the instance the model chooses, without waiting for a connection that failed (kubelet's calls
do not wait for ready), with kubelet's 45 s timeout. `start_anew` is a kubelet restart: every
instance forgotten, the node's slices wiped, the directory read again.
"""

import os
import select
import stat
import threading
import time
from typing import Dict, List, Optional, Tuple

import grpc
import inotify.constants as ic

from atedevd.api import dra_health_v1_pb2 as healthpb
from atedevd.api import dra_health_v1alpha1_pb2 as healthpb_alpha
from atedevd.api import dra_v1_pb2 as drapb
from atedevd.api import dra_v1beta1_pb2 as drapb_beta
from atedevd.api import pluginregistration_pb2 as regpb
from atedevd.api import service
from atedevd.daemon.watch import Watcher

try:
    from rig.dra_kubelet_model import CALL_TIMEOUT_S, Info, Instance, PluginManager
except ImportError:  # run as a script (the systemd container): the model beside it
    from dra_kubelet_model import CALL_TIMEOUT_S, Info, Instance, PluginManager  # type: ignore[no-redef]

SERVICES = {"v1.DRAPlugin": (service.DRA_PLUGIN, drapb), "v1beta1.DRAPlugin": (service.DRA_PLUGIN_BETA, drapb_beta)}
HEALTH = {"v1.DRAResourceHealth": (service.DRA_HEALTH, healthpb),
          "v1alpha1.DRAResourceHealth": (service.DRA_HEALTH_ALPHA, healthpb_alpha)}
HEALTH_RETRY_S = 5.0


class _Client:
    """kubelet's connection to one instance: a channel, its stub, its health stream."""

    def __init__(self, kubelet: "DraKubelet", instance: Instance) -> None:
        self.instance = instance
        self.registered_at = time.monotonic()
        self.channel = grpc.insecure_channel("unix:" + instance.endpoint)
        name, self.pb = SERVICES[instance.service]
        self.stub = service.stub(name, self.channel)
        self.closed = False
        self.health: Optional[List[Tuple[str, str, int, str]]] = None  # the newest list: (pool, device, health, why)
        self.health_lists = 0
        self._kubelet = kubelet
        self.channel.subscribe(self._state, try_to_connect=True)
        if instance.health is not None:
            threading.Thread(target=self._watch_health, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return self.instance.endpoint

    @property
    def chosen(self) -> str:
        return self.instance.service

    def _state(self, state: grpc.ChannelConnectivity) -> None:
        self._kubelet._connected(self, state is grpc.ChannelConnectivity.READY)

    def _watch_health(self) -> None:
        name, pb = HEALTH[self.instance.health or ""]
        stub = service.stub(name, self.channel)
        while not self.closed:
            try:
                for response in stub.NodeWatchResources(pb.NodeWatchResourcesRequest()):
                    self.health = [(d.device.pool_name, d.device.device_name, int(d.health), d.message)
                                   for d in response.devices]
                    self.health_lists += 1
            except grpc.RpcError:
                pass
            for _ in range(int(HEALTH_RETRY_S / 0.05)):
                if self.closed:
                    return
                time.sleep(0.05)

    def close(self) -> None:
        self.closed = True
        self.channel.close()


class DraKubelet:
    def __init__(self, root: str, apiserver=None, version: str = "1.37", node: Optional[str] = None) -> None:
        self.root = root
        self.registry = os.path.join(root, "plugins_registry")
        os.makedirs(self.registry, exist_ok=True)
        self.apiserver = apiserver
        self.node = node
        self.version = version
        self.model = PluginManager(version)
        self.clients: Dict[str, _Client] = {}  # by registration socket
        self.order: List[_Client] = []
        self.wipes = 0
        self._lock = threading.RLock()  # (a client made under it subscribes to its channel)
        self._stop = threading.Event()
        self._watcher = Watcher()
        self._watcher.want([self.registry])
        self._pending = sorted(os.path.join(self.registry, n) for n in os.listdir(self.registry))
        self._thread = threading.Thread(target=self._run, name="dra-kubelet", daemon=True)
        self._thread.start()

    # --- what the tests see ------------------------------------------------------------------------

    @property
    def instances(self) -> List[_Client]:
        with self._lock:
            return [c for c in self.order if not c.closed]

    @property
    def refused(self) -> List[Tuple[str, str]]:
        return list(self.model.refused)

    def newest(self) -> Optional[_Client]:
        """The client kubelet's calls go to now."""
        with self._lock:
            i = self.model.chosen("ate.dev")
            return next((c for c in self.order if c.instance is i), None) if i is not None else None

    def wait_registered(self, timeout: float = 10.0, after: float = 0.0) -> _Client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            c = self.newest()
            if c is not None and c.registered_at > after:
                return c
            time.sleep(0.005)
        raise AssertionError(f"no DRA plugin registered within {timeout} s (refused: {self.refused})")

    def prepare(self, claims: List[Tuple[str, str, str]], timeout: float = CALL_TIMEOUT_S):
        """NodePrepareResources for (namespace, name, uid) claims: the answer by UID."""
        return self._call("NodePrepareResources", claims, timeout)

    def unprepare(self, claims: List[Tuple[str, str, str]], timeout: float = CALL_TIMEOUT_S):
        return self._call("NodeUnprepareResources", claims, timeout)

    def _call(self, method: str, claims: List[Tuple[str, str, str]], timeout: float):
        c = self.newest()
        if c is None:
            raise RuntimeError("DRA driver ate.dev is not registered")
        request = getattr(c.pb, f"{method}Request")(claims=[c.pb.Claim(namespace=n, name=m, uid=u) for n, m, u in claims])
        return getattr(c.stub, method)(request, timeout=timeout).claims

    def start_anew(self) -> int:
        """A kubelet restart: instances forgotten, the node's slices wiped; the wiped count."""
        with self._lock:
            for c in self.order:
                c.close()
            self.clients, self.order = {}, []
            self.model = PluginManager(self.version)
            self._pending = sorted(os.path.join(self.registry, n) for n in os.listdir(self.registry))
        return self.apiserver.wipe() if self.apiserver is not None else 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.order:
            c.close()

    # --- kubelet's threads ------------------------------------------------------------------------------

    def _connected(self, client: _Client, connected: bool) -> None:
        with self._lock:
            if not client.closed:
                self.model.connection(time.monotonic(), client.instance, connected)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending, self._pending = self._pending, []
            for path in pending:
                self._created(path)
            ready = select.select([self._watcher.fileno()], [], [], 0.05)[0]
            if ready or self._watcher.poll_deadline():
                for e in self._watcher.read():
                    path = os.path.join(e.directory, e.name)
                    if os.path.dirname(path) != os.path.normpath(self.registry) or not e.name:
                        continue
                    if e.is_(ic.IN_DELETE | ic.IN_MOVED_FROM):
                        self._removed(path)
                    elif e.is_(ic.IN_CREATE | ic.IN_MOVED_TO):
                        self._removed(path)  # (a new file at a known path: a new plugin)
                        self._created(path)
            with self._lock:
                wipes = self.model.wipes_due(time.monotonic())
            for _ in wipes:
                self.wipes += 1
                if self.apiserver is not None:
                    self.apiserver.wipe()

    def _removed(self, path: str) -> None:
        with self._lock:
            for i in self.model.deregister(time.monotonic(), path):
                c = self.clients.pop(path, None)
                if c is not None:
                    c.close()

    def _created(self, path: str) -> None:
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                return
        except OSError:
            return
        channel = grpc.insecure_channel("unix:" + path)
        try:
            ready = grpc.channel_ready_future(channel)
            for _ in range(100):  # kubelet's dial: 10 s (a close of the stand-in cuts it short)
                try:
                    ready.result(timeout=0.1)
                    break
                except grpc.FutureTimeoutError:
                    if self._stop.is_set():
                        raise
            else:
                raise grpc.FutureTimeoutError()
            reg = service.stub(service.PLUGIN_REGISTRATION, channel)
            info = reg.GetInfo(regpb.InfoRequest(), timeout=1)
            with self._lock:  # (the client made with the registration, before kubelet says so: its add())
                instance, why = self.model.register(time.monotonic(), path, Info(
                    info.type, info.name, info.endpoint or path, tuple(info.supported_versions)))
                if instance is not None:
                    self.clients[path] = c = _Client(self, instance)
                    self.order.append(c)
            reg.NotifyRegistrationStatus(regpb.RegistrationStatus(plugin_registered=not why, error=why), timeout=5)
        except (grpc.RpcError, grpc.FutureTimeoutError) as e:
            with self._lock:
                self.model.refused.append((path, f"{type(e).__name__}"))
            return
        finally:
            channel.close()


def main(argv=None) -> int:
    """`prepare NS NAME UID`: once, as kubelet does it, against the plugins under `--root`
    (registration, then NodePrepareResources); the answer printed as JSON (the container tests)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="dra_kubelet.py")
    p.add_argument("command", choices=["prepare"])
    p.add_argument("--root", default="/var/lib/kubelet")
    p.add_argument("claim", nargs=3, metavar=("NAMESPACE", "NAME", "UID"))
    args = p.parse_args(argv)
    k = DraKubelet(args.root)
    try:
        instance = k.wait_registered(30)
        answer = k.prepare([tuple(args.claim)])[args.claim[2]]
        print(json.dumps({"service": instance.chosen, "error": answer.error,
                          "cdi": [i for d in answer.devices for i in d.cdi_device_ids]}))
    finally:
        k.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
