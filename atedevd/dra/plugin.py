"""The sockets kubelet dials in DRA mode, and the gRPC services on them.

Kubelet's plugin watcher finds `<kubelet root>/plugins_registry/ate.dev-<run>-reg.sock`, asks
`GetInfo` (type `DRAPlugin`, our driver name, the service socket, the services we serve:
`v1.DRAPlugin` for kubelet 1.34 and newer, `v1beta1.DRAPlugin` for all) and says with
`NotifyRegistrationStatus` whether it took us. The service socket is
`<kubelet root>/plugins/ate.dev/dra-<run>.sock`. Each run has its own pair of names: kubelet
1.33 and newer keep two instances of a driver at once (an upgrade) only under distinct
endpoints, and a file left by a killed run is removed at the next start, which tells kubelet
that instance is gone.
"""

import errno
import logging
import os
from concurrent import futures
from typing import Callable, List, Optional

import grpc

from atedevd.api import service
from atedevd.api import dra_v1_pb2 as drapb
from atedevd.api import dra_v1beta1_pb2 as drapb_beta
from atedevd.api import pluginregistration_pb2 as regpb
from atedevd.dra.slices import DRIVER
from atedevd.kubelet import sockets

REGISTRY = "plugins_registry"
PLUGINS = "plugins"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # as kubelet names them in registration: newest first


def kubelet_root(device_plugin_dir: str) -> str:
    """Kubelet's root directory (`--root-dir`): the one its device-plugin directory is in."""
    return os.path.dirname(os.path.normpath(device_plugin_dir))


def registration_path(root: str, run: str) -> str:
    return os.path.join(root, REGISTRY, f"{DRIVER}-{run}-reg.sock")


def plugin_dir(root: str) -> str:
    """The driver's own directory: its service sockets and its checkpoint."""
    return os.path.join(root, PLUGINS, DRIVER)


def service_path(root: str, run: str) -> str:
    return os.path.join(plugin_dir(root), f"dra-{run}.sock")


def remove_leftovers(root: str, say: Callable[..., None]) -> List[str]:
    """Sockets of ours that no process serves any more (a run killed before it could remove
    them): gone, so that kubelet forgets those instances. A live one (the other instance of an
    upgrade) stays."""
    removed = sockets.remove_dead_sockets(os.path.join(root, REGISTRY),
                                          lambda n: n.startswith(f"{DRIVER}-") and n.endswith("-reg.sock"))
    removed += sockets.remove_dead_sockets(plugin_dir(root), lambda n: n.startswith("dra-") and n.endswith(".sock"))
    if removed:
        say(logging.INFO, "dra-leftover", f"removed sockets of an earlier run that no process serves: {', '.join(removed)}")
    return removed


class PluginInfoService:
    """kubelet's plugin watcher's side of us: GetInfo, and what kubelet said of it."""

    def __init__(self, endpoint: str, registered: Callable[[bool, str], None]) -> None:
        self.endpoint = endpoint
        self._registered = registered

    def GetInfo(self, request, context):
        return regpb.PluginInfo(type="DRAPlugin", name=DRIVER, endpoint=self.endpoint,
                                supported_versions=list(SERVICES))

    def NotifyRegistrationStatus(self, request, context):
        self._registered(bool(request.plugin_registered), str(request.error))
        return regpb.RegistrationStatusResponse()


class DraService:
    """DRAPlugin in one version: each call handed to `prepare` / `unprepare`, which answer a
    dict by claim UID ({"devices": [...]} or {"error": ...})."""

    def __init__(self, pb, prepare, unprepare) -> None:
        self._pb, self._prepare, self._unprepare = pb, prepare, unprepare

    def NodePrepareResources(self, request, context):
        answers = self._prepare([(c.namespace, c.name, c.uid) for c in request.claims])
        out = self._pb.NodePrepareResourcesResponse()
        for uid, a in answers.items():
            entry = out.claims[uid]
            if a.get("error"):
                entry.error = a["error"]
                continue
            for p in a["devices"]:
                d = entry.devices.add(request_names=list(p.request_names), pool_name=p.pool_name,
                                      device_name=p.device_name, cdi_device_ids=list(p.cdi_ids))
                if p.share_id and self._pb is drapb:
                    d.share_id = p.share_id
        return out

    def NodeUnprepareResources(self, request, context):
        answers = self._unprepare([(c.namespace, c.name, c.uid) for c in request.claims])
        out = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in answers.items():
            out.claims[uid].error = error
        return out


class DraSockets:
    """The two sockets of one run, served by one gRPC server."""

    def __init__(self, root: str, run: str, registration: PluginInfoService, prepare, unprepare) -> None:
        self.registration_path = registration_path(root, run)
        self.service_path = service_path(root, run)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dra"))
        self._server.add_generic_rpc_handlers((
            service.handler(service.PLUGIN_REGISTRATION, registration),
            service.handler(service.DRA_PLUGIN, DraService(drapb, prepare, unprepare)),
            service.handler(service.DRA_PLUGIN_BETA, DraService(drapb_beta, prepare, unprepare)),
        ))
        self._inodes: dict = {}

    def start(self) -> None:
        """The service socket first, then the registration socket: kubelet dials the service as
        soon as it has registered us."""
        for directory in (os.path.dirname(self.service_path), os.path.dirname(self.registration_path)):
            os.makedirs(directory, mode=0o750, exist_ok=True)
            if not os.access(directory, os.W_OK):  # (a read-only view: gRPC's bind would fail without saying why)
                raise OSError(errno.EROFS, "not writable here", directory)
        for path in (self.service_path, self.registration_path):
            if os.path.lexists(path):
                os.unlink(path)  # (this run's own name: nobody else's)
            if self._server.add_insecure_port("unix:" + path) == 0:
                raise OSError(f"cannot bind {path}")
        self._server.start()
        for path in (self.service_path, self.registration_path):
            os.chmod(path, 0o600)
            self._inodes[path] = os.lstat(path).st_ino

    def missing(self) -> Optional[str]:
        """A socket of ours that is gone or was replaced (someone removed it: kubelet forgets
        us when the registration socket goes), or None."""
        for path, inode in self._inodes.items():
            try:
                if os.lstat(path).st_ino == inode:
                    continue
            except OSError:
                pass
            return path
        return None

    def stop(self, grace: float = 1.0) -> None:
        """The registration socket first (kubelet deregisters this instance), then the service."""
        for path in (self.registration_path, self.service_path):
            try:
                if os.lstat(path).st_ino == self._inodes.get(path):
                    os.unlink(path)
            except OSError:
                pass
        self._server.stop(grace).wait()
