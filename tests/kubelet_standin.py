"""A kubelet stand-in that behaves like kubelet's device manager on the wire.

What it does, as kubelet does (design.md §2):
- serves v1beta1.Registration on `kubelet.sock`; inside Register it checks the
  version and resource name, dials the plugin's socket (blocking, 10 s), calls
  GetDevicePluginOptions and starts ListAndWatch in the background, and only
  then returns;
- every ListAndWatch message replaces the resource's device set and is written
  to `kubelet_internal_checkpoint`;
- a restart kills the old process's connections (leaving a stale kubelet.sock),
  then the new one deletes every socket in the directory, waits, and serves a
  new kubelet.sock; resources stay known at capacity 0 until registered again;
- `kubelet="1.32"` keeps one client per resource name: when an old stream ends
  after a new registration of the same resource, the new one is disconnected.
  The default (newer kubelet) disconnects the old client when a new one registers.

Used in-process by the tests and benchmarks (`Kubelet`), and as a script in the
systemd container and the demo:
  kubelet_standin.py serve --plugin-dir DIR --state FILE [--kubelet 1.32]
      (SIGHUP: restart like kubelet; SIGTERM: exit, leaving a stale socket)
  kubelet_standin.py allocate --plugin-dir DIR --resource R --ids a,b
"""

import argparse
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from concurrent import futures
from typing import Dict, List, Optional

import grpc

from atedevd.api import API_VERSION, DevicePluginStub, pb, registration_handler

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
DIAL_TIMEOUT_S = 10.0
_DIAL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # every dial is a fresh connection, as in Go


class Client:
    """kubelet's connection to one registered plugin."""

    def __init__(self, kubelet: "Kubelet", resource: str, endpoint: str, channel: grpc.Channel):
        self.kubelet = kubelet
        self.resource = resource
        self.endpoint = endpoint
        self.channel = channel
        self.stub = DevicePluginStub(channel)
        self.devices: Dict[str, str] = {}
        self.connected = False  # first ListAndWatch message received, stream open
        self.closed = False
        self.options: Optional[pb.DevicePluginOptions] = None
        self._stream = None

    def run(self) -> None:
        try:
            self._stream = self.stub.ListAndWatch(pb.Empty())
            for resp in self._stream:
                with self.kubelet.cond:
                    self.devices = {d.ID: d.health for d in resp.devices}
                    self.connected = True
                    self.kubelet.updates += 1
                    self.kubelet.write_checkpoint()
                    self.kubelet.cond.notify_all()
        except (grpc.RpcError, ValueError):  # ValueError: closed before the stream began
            pass
        finally:
            self.kubelet.stream_ended(self)

    def close(self) -> None:
        self.closed = True
        self.connected = False
        if self._stream is not None:
            self._stream.cancel()
        # grpc's close takes ~0.2 s (its poller's period); a dying kubelet does not wait for it
        threading.Thread(target=self.channel.close, daemon=True).start()


class Kubelet:
    def __init__(self, plugin_dir: str, kubelet: str = "1.33", wipe: str = "sockets", on_change=None):
        self.dir = plugin_dir
        self.socket = os.path.join(plugin_dir, KUBELET_SOCKET)
        self.mode = kubelet
        self.wipe_mode = wipe
        self.cond = threading.Condition()
        self.clients: Dict[str, Client] = {}
        self.known: set = set()  # resources restored from the checkpoint, capacity 0 until registered
        self.registrations: List[dict] = []  # resource, endpoint, at (monotonic), restart
        self.rejections: List[str] = []
        self.restarts = 0
        self.updates = 0
        self.serving_at: Optional[float] = None
        self.alive = False
        self._server: Optional[grpc.Server] = None
        self._on_change = on_change

    # --- process life ---------------------------------------------------------

    def start(self) -> None:
        """What a starting kubelet does: wipe the sockets, then serve kubelet.sock."""
        os.makedirs(self.dir, exist_ok=True)
        self.wipe()
        self._serve()

    def _serve(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(16), handlers=[registration_handler(self)])
        if server.add_insecure_port("unix:" + self.socket) == 0:
            raise OSError(f"cannot bind {self.socket}")
        with self.cond:
            self.alive = True
        server.start()
        self._server = server
        with self.cond:
            self.serving_at = time.monotonic()
            self.cond.notify_all()
        self._changed()

    def kill(self) -> None:
        """What SIGKILL does to kubelet: connections drop, kubelet.sock stays behind, stale."""
        with self.cond:
            self.alive = False
            clients = list(self.clients.values())
            self.known |= set(self.clients)
            self.clients.clear()
            self.cond.notify_all()
        for c in clients:
            c.close()
        if self._server is not None:
            self._server.stop(None).wait(5)
            self._server = None
        if not os.path.exists(self.socket) and os.path.isdir(self.dir):
            _stale_socket(self.socket)  # newer grpc unlinks on stop; kubelet's file stays
        self._changed()

    def restart(self, gap: float = 0.0) -> None:
        """Die, then start again: the sockets vanish `gap` seconds before kubelet.sock is back."""
        self.kill()
        with self.cond:
            self.restarts += 1
        os.makedirs(self.dir, exist_ok=True)
        self.wipe()
        time.sleep(gap)
        self._serve()

    def recreate_socket(self) -> None:
        """What newer kubelets can do without restarting: serve a new kubelet.sock, keep clients."""
        if self._server is not None:
            self._server.stop(None).wait(5)  # grpc unlinks the path on stop
        self._serve()

    def drop(self, resource: str) -> None:
        """kubelet ends the plugin's ListAndWatch stream (and forgets the client)."""
        with self.cond:
            client = self.clients.get(resource)
        if client is not None:
            client.close()

    def close(self) -> None:
        """Test teardown: kill and remove kubelet.sock."""
        self.kill()
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass

    def wipe(self) -> None:
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            doomed = stat.S_ISSOCK(mode) if self.wipe_mode == "sockets" else (not stat.S_ISDIR(mode) and name != CHECKPOINT)
            if doomed:
                os.unlink(path)

    # --- the Registration service -------------------------------------------------

    def Register(self, request, context):
        problem = _invalid(request)
        if problem:
            with self.cond:
                self.rejections.append(problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        channel = grpc.insecure_channel("unix:" + os.path.join(self.dir, request.endpoint), options=_DIAL_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT_S)
            client = Client(self, request.resource_name, request.endpoint, channel)
            client.options = client.stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        except (grpc.FutureTimeoutError, grpc.RpcError) as e:
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {e!r}")
        with self.cond:
            if not self.alive:
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is shutting down")
            old = self.clients.get(request.resource_name)
            self.clients[request.resource_name] = client
            self.known.add(request.resource_name)
            self.registrations.append(
                {"resource": request.resource_name, "endpoint": request.endpoint, "at": time.monotonic(), "restart": self.restarts}
            )
            self.cond.notify_all()
        if old is not None and self.mode != "1.32":
            old.close()  # newer kubelets replace the old client
        threading.Thread(target=client.run, daemon=True, name=f"law-{request.resource_name}").start()
        self._changed()
        return pb.Empty()

    def stream_ended(self, client: Client) -> None:
        with self.cond:
            if not self.alive or client.kubelet is not self:
                return
            if self.mode == "1.32":
                # One client per resource name: the end of any stream of the
                # resource disconnects whichever client is registered now.
                current = self.clients.pop(client.resource, None)
            else:
                current = client if self.clients.get(client.resource) is client else None
                if current is not None:
                    del self.clients[client.resource]
            client.connected = False
            self.cond.notify_all()
        if current is not None:
            current.close()
        self._changed()

    # --- what tests ask ------------------------------------------------------------

    def registration_count(self, resource: str) -> int:
        with self.cond:
            return sum(1 for r in self.registrations if r["resource"] == resource)

    def capacity(self, resource: str) -> int:
        """Healthy units kubelet would report as allocatable now."""
        with self.cond:
            c = self.clients.get(resource)
            if c is None or not c.connected:
                return 0
            return sum(1 for h in c.devices.values() if h == "Healthy")

    def devices(self, resource: str) -> Dict[str, str]:
        with self.cond:
            c = self.clients.get(resource)
            return dict(c.devices) if c else {}

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def wait_connected(self, resource: str, registrations: int = 1, timeout: float = 10.0) -> bool:
        """Until `resource` has registered at least `registrations` times and its stream is up."""

        def ok():
            c = self.clients.get(resource)
            n = sum(1 for r in self.registrations if r["resource"] == resource)
            return n >= registrations and c is not None and c.connected
        return self.wait(ok, timeout)

    def allocate(self, resource: str, ids: List[str], timeout: float = 10.0) -> pb.AllocateResponse:
        """Allocate as kubelet does: one container request, on the registered client."""
        with self.cond:
            c = self.clients[resource]
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        return c.stub.Allocate(req, timeout=timeout)

    def state(self) -> dict:
        with self.cond:
            resources = {}
            for name in sorted(self.known | set(self.clients)):
                c = self.clients.get(name)
                devs = c.devices if c else {}
                resources[name] = {
                    "endpoint": c.endpoint if c else None,
                    "registrations": sum(1 for r in self.registrations if r["resource"] == name),
                    "connected": bool(c and c.connected),
                    "healthy": sum(1 for h in devs.values() if h == "Healthy") if c and c.connected else 0,
                    "unhealthy": sum(1 for h in devs.values() if h != "Healthy") if c and c.connected else 0,
                }
            return {"pid": os.getpid(), "restarts": self.restarts, "alive": self.alive, "resources": resources}

    def write_checkpoint(self) -> None:
        """As kubelet does after every ListAndWatch message (called with the lock held)."""
        data = {n: sorted(c.devices) for n, c in self.clients.items()}
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".checkpoint")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, os.path.join(self.dir, CHECKPOINT))
        except OSError:
            pass  # the directory may be going away under a test

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)


def _invalid(request) -> Optional[str]:
    """kubelet's checks on a RegisterRequest."""
    if request.version != API_VERSION:
        return f"unsupported API version {request.version!r}"
    name = request.resource_name
    domain = name.split("/", 1)[0]
    if "/" not in name or domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or name.startswith("requests."):
        return f"invalid extended resource name {name!r}"
    if not request.endpoint or "/" in request.endpoint:
        return f"endpoint must be a socket file name, got {request.endpoint!r}"
    return None


def _stale_socket(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
    finally:
        s.close()


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

    kubelet = Kubelet(args.plugin_dir, kubelet=args.kubelet, on_change=on_change if args.state else None)
    restart = threading.Event()
    stop = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: restart.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    kubelet.start()
    print(f"kubelet stand-in serving {kubelet.socket}", flush=True)
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


def _allocate(args) -> int:
    channel = grpc.insecure_channel("unix:" + os.path.join(args.plugin_dir, args.resource.replace("/", "-") + ".sock"))
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
    s.add_argument("--kubelet", default="1.33", choices=["1.32", "1.33"])
    s.add_argument("--gap", type=float, default=0.1, help="seconds between the wipe and serving again on restart")
    a = sub.add_parser("allocate")
    a.add_argument("--plugin-dir", required=True)
    a.add_argument("--resource", required=True)
    a.add_argument("--ids", required=True)
    args = p.parse_args(argv)
    return _serve(args) if args.command == "serve" else _allocate(args)


if __name__ == "__main__":
    sys.exit(main())
