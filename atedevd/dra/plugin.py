"""The gRPC services kubelet calls in DRA mode, on a socket of this run's own that the relay
(atedevd/dra/relay.py) carries kubelet's connections to.

`GetInfo` answers type `DRAPlugin`, our driver name, the service socket kubelet dials (the held
one, atedevd/dra/listeners.py) and the services we serve, newest first: `v1.DRAPlugin` (kubelet
1.34 and newer), `v1beta1.DRAPlugin` (every DRA kubelet) and `v1.DRAResourceHealth` (1.37 opens
the health stream only for a plugin that names it; 1.36 opens `v1alpha1` for every plugin, which
is served too). Each call is handed to the loop (`Calls`) and its thread waits for the answer:
the loop alone decides (atedevd/dra/driver.py). The health stream sends the whole device list
whenever it changes and at least every HEALTH_EVERY_S (kubelet takes a device it has heard
nothing of for 30 s as Unknown).
"""

import itertools
import logging
import os
import threading
from concurrent import futures
from typing import Callable, Dict, List, Optional, Tuple

import grpc

from atedevd.api import dra_health_v1_pb2 as healthpb
from atedevd.api import dra_health_v1alpha1_pb2 as healthpb_alpha
from atedevd.api import dra_v1_pb2 as drapb
from atedevd.api import dra_v1beta1_pb2 as drapb_beta
from atedevd.api import pluginregistration_pb2 as regpb
from atedevd.api import service
from atedevd.dra.claims import ClaimRef
from atedevd.dra.listeners import REGISTRY, plugin_dir
from atedevd.dra.preparer import PREPARE, UNPREPARE, Asked, ClaimOutcome
from atedevd.dra.slices import DRIVER
from atedevd.kubelet import sockets

SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth")  # as kubelet names them: newest first
CALL_LIMIT_S = 50.0  # a call's thread waits this long for the loop (kubelet gives up after 45 s)
HEALTH_EVERY_S = 10.0


def inner_path(root: str, run: str) -> str:
    return os.path.join(plugin_dir(root), f"inner-{run}.sock")


def remove_leftovers(root: str, say: Callable[..., None]) -> List[str]:
    """Sockets of ours that no process serves any more: an earlier version's, named per run,
    and this run's inner sockets of a run that was killed. A live one stays."""
    removed = sockets.remove_dead_sockets(os.path.join(root, REGISTRY),
                                          lambda n: n.startswith(f"{DRIVER}-") and n.endswith("-reg.sock"))
    removed += sockets.remove_dead_sockets(plugin_dir(root), lambda n: n.endswith(".sock") and
                                           (n.startswith("dra-") or n.startswith("inner-")))
    if removed:
        say(logging.INFO, "dra-leftover", f"removed sockets of an earlier run that no process serves: {', '.join(removed)}")
    return removed


class Calls:
    """Kubelet's calls, from the gRPC threads to the loop and back."""

    def __init__(self, post: Callable[[object], None]) -> None:
        self._post = post  # hands an event to the loop
        self._numbers = itertools.count(1)
        self._waiting: Dict[int, Tuple[threading.Event, List[Dict[str, ClaimOutcome]]]] = {}
        self._lock = threading.Lock()

    def ask(self, kind: str, claims: Tuple[ClaimRef, ...]) -> Optional[Dict[str, ClaimOutcome]]:
        """The loop's answer, by claim UID; None if it gave none in CALL_LIMIT_S (it stopped)."""
        n = next(self._numbers)
        done: Tuple[threading.Event, List[Dict[str, ClaimOutcome]]] = (threading.Event(), [])
        with self._lock:
            self._waiting[n] = done
        self._post(Asked(n, kind, claims))
        done[0].wait(CALL_LIMIT_S)
        with self._lock:
            self._waiting.pop(n, None)
        return done[1][0] if done[1] else None

    def answer(self, call: int, outcomes: Dict[str, ClaimOutcome]) -> None:
        """From the loop."""
        with self._lock:
            waiting = self._waiting.get(call)
        if waiting is not None:
            waiting[1].append(outcomes)
            waiting[0].set()


class HealthBoard:
    """The device health the streams send: the newest list, and a condition to wait on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pool = ""
        self._devices: Tuple[Tuple[str, int, str], ...] = ()
        self._version = 0
        self._closed = False

    def set(self, pool: str, devices: Tuple[Tuple[str, int, str], ...]) -> None:
        with self._cond:
            self._pool, self._devices = pool, devices
            self._version += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stream(self, pb, context):
        """NodeWatchResources: the list now, then again on every change or HEALTH_EVERY_S."""
        seen = -1
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._version != seen or not context.is_active(),
                                    HEALTH_EVERY_S)
                if self._closed or not context.is_active():
                    return
                seen, pool, devices = self._version, self._pool, self._devices
            if pool:
                yield pb.NodeWatchResourcesResponse(devices=[
                    pb.DeviceHealth(device=pb.DeviceIdentifier(pool_name=pool, device_name=name), health=health,
                                    message=why) for name, health, why in devices])


class _PluginInfo:
    def __init__(self, endpoint: str, said: Callable[[bool, str], None]) -> None:
        self._endpoint, self._said = endpoint, said

    def GetInfo(self, request, context):
        return regpb.PluginInfo(type="DRAPlugin", name=DRIVER, endpoint=self._endpoint,
                                supported_versions=list(SERVICES))

    def NotifyRegistrationStatus(self, request, context):
        self._said(bool(request.plugin_registered), str(request.error))
        return regpb.RegistrationStatusResponse()


class _DraPlugin:
    """DRAPlugin in one version."""

    def __init__(self, pb, calls: Calls) -> None:
        self._pb, self._calls = pb, calls

    def _ask(self, kind: str, request, context) -> Dict[str, ClaimOutcome]:
        refs = tuple(ClaimRef(c.namespace, c.name, c.uid) for c in request.claims)
        answer = self._calls.ask(kind, refs)
        if answer is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "atedevd is stopping: ask again")
        return answer  # type: ignore[return-value]

    def NodePrepareResources(self, request, context):
        out = self._pb.NodePrepareResourcesResponse()
        for uid, o in self._ask(PREPARE, request, context).items():
            entry = out.claims[uid]
            if o.error:
                entry.error = o.error
                continue
            for p in o.devices:
                d = entry.devices.add(request_names=list(p.request_names), pool_name=p.pool_name,
                                      device_name=p.device_name, cdi_device_ids=list(p.cdi_ids))
                if p.share_id and self._pb is drapb:
                    d.share_id = p.share_id
        return out

    def NodeUnprepareResources(self, request, context):
        out = self._pb.NodeUnprepareResourcesResponse()
        for uid, o in self._ask(UNPREPARE, request, context).items():
            out.claims[uid].error = o.error
        return out


class _Health:
    def __init__(self, pb, board: HealthBoard) -> None:
        self._pb, self._board = pb, board

    def NodeWatchResources(self, request, context):
        return self._board.stream(self._pb, context)


class DraServer:
    """This run's gRPC server, on its own socket (`path`), serving every service kubelet calls."""

    def __init__(self, path: str, endpoint: str, calls: Calls, registered: Callable[[bool, str], None]) -> None:
        self.path = path
        self.board = board = HealthBoard()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="dra"))
        self._server.add_generic_rpc_handlers((
            service.handler(service.PLUGIN_REGISTRATION, _PluginInfo(endpoint, registered)),
            service.handler(service.DRA_PLUGIN, _DraPlugin(drapb, calls)),
            service.handler(service.DRA_PLUGIN_BETA, _DraPlugin(drapb_beta, calls)),
            service.handler(service.DRA_HEALTH, _Health(healthpb, board)),
            service.handler(service.DRA_HEALTH_ALPHA, _Health(healthpb_alpha, board)),
        ))

    def start(self) -> None:
        if os.path.lexists(self.path):
            os.unlink(self.path)  # (this run's own name)
        if self._server.add_insecure_port("unix:" + self.path) == 0:
            raise OSError(f"cannot bind {self.path}")
        self._server.start()
        os.chmod(self.path, 0o600)

    def stop(self, grace: Optional[float]) -> threading.Event:
        """Calls under way are answered (up to `grace`), new ones refused, health streams ended;
        set once it is over. The socket goes."""
        self.board.close()
        done = self._server.stop(grace)
        try:
            os.unlink(self.path)
        except OSError:
            pass
        return done
