"""A stand-in for kubelet's DRA side: its plugin watcher and its DRA plugin manager, as
kubelet 1.34-1.37 behave (read from kubernetes' pkg/kubelet/pluginmanager and cm/dra/plugin).

It watches `<root>/plugins_registry/` for sockets, dials each new one, asks GetInfo, checks
what kubelet checks (type DRAPlugin, one of the services it speaks, an endpoint no other
instance has) and says so with NotifyRegistrationStatus; an instance whose registration socket
goes is deregistered. Prepare and unprepare go to the newest registered instance, with
kubelet's 45 s timeout. `start_anew` is a kubelet restart: every instance forgotten, the node's
slices wiped on the API server (as kubelet does when it starts), the directory scanned again.
"""

import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import grpc

from atedevd.api import service
from atedevd.api import dra_v1_pb2 as drapb
from atedevd.api import dra_v1beta1_pb2 as drapb_beta
from atedevd.api import pluginregistration_pb2 as regpb

SPOKEN = (("v1.DRAPlugin", service.DRA_PLUGIN, drapb), ("v1beta1.DRAPlugin", service.DRA_PLUGIN_BETA, drapb_beta))
CALL_TIMEOUT_S = 45.0


class Instance:
    def __init__(self, registration: str, endpoint: str, chosen: str, stub, pb) -> None:
        self.registration, self.endpoint, self.chosen, self.stub, self.pb = registration, endpoint, chosen, stub, pb
        self.registered_at = time.monotonic()


class DraKubelet:
    def __init__(self, root: str, apiserver=None, speaks=("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> None:
        self.root = root
        self.registry = os.path.join(root, "plugins_registry")
        os.makedirs(self.registry, exist_ok=True)
        self.apiserver = apiserver
        self.speaks = speaks
        self.instances: List[Instance] = []
        self.refused: List[Tuple[str, str]] = []  # (socket, why)
        self._seen: Dict[str, int] = {}  # socket -> inode dialled
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dra-kubelet", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def start_anew(self) -> int:
        """A kubelet restart: instances forgotten, the node's slices wiped; the wiped count."""
        with self._lock:
            self.instances, self._seen = [], {}
        return self.apiserver.wipe() if self.apiserver is not None else 0

    def newest(self) -> Optional[Instance]:
        with self._lock:
            return self.instances[-1] if self.instances else None

    def wait_registered(self, timeout: float = 10.0, after: float = 0.0) -> Instance:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.newest()
            if i is not None and i.registered_at > after:
                return i
            time.sleep(0.005)
        raise AssertionError(f"no DRA plugin registered within {timeout} s (refused: {self.refused})")

    def prepare(self, claims: List[Tuple[str, str, str]], timeout: float = CALL_TIMEOUT_S):
        """NodePrepareResources for (namespace, name, uid) claims: the answer by UID."""
        return self._call("NodePrepareResources", claims, timeout)

    def unprepare(self, claims: List[Tuple[str, str, str]], timeout: float = CALL_TIMEOUT_S):
        return self._call("NodeUnprepareResources", claims, timeout)

    def _call(self, method: str, claims: List[Tuple[str, str, str]], timeout: float):
        i = self.newest()
        if i is None:
            raise RuntimeError("DRA driver ate.dev is not registered")
        request = getattr(i.pb, f"{method}Request")(claims=[i.pb.Claim(namespace=n, name=c, uid=u) for n, c, u in claims])
        return getattr(i.stub, method)(request, timeout=timeout).claims

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                names = sorted(os.listdir(self.registry))
            except OSError:
                names = []
            present = {}
            for name in names:
                path = os.path.join(self.registry, name)
                try:
                    present[path] = os.lstat(path).st_ino
                except OSError:
                    continue
            with self._lock:
                gone = [p for p in self._seen if present.get(p) != self._seen[p]]
                for p in gone:
                    del self._seen[p]
                    self.instances = [i for i in self.instances if i.registration != p]
            for path, inode in present.items():
                if path not in self._seen:
                    self._seen[path] = inode
                    self._register(path)
            self._stop.wait(0.005)

    def _register(self, path: str) -> None:
        channel = grpc.insecure_channel("unix:" + path)
        try:
            reg = service.stub(service.PLUGIN_REGISTRATION, channel)
            info = reg.GetInfo(regpb.InfoRequest(), timeout=5)
            why = ""
            chosen = next(((v, svc, pb) for v, svc, pb in SPOKEN if v in info.supported_versions and v in self.speaks), None)
            if info.type != "DRAPlugin":
                why = f"type {info.type!r}"
            elif chosen is None:
                why = f"none of services supported by the plugin ({list(info.supported_versions)}) are supported by the kubelet"
            elif any(i.endpoint == info.endpoint for i in self.instances):
                why = f"endpoint {info.endpoint} already registered for DRA driver plugin {info.name}"
            reg.NotifyRegistrationStatus(regpb.RegistrationStatus(plugin_registered=not why, error=why), timeout=5)
        except grpc.RpcError as e:
            self.refused.append((path, f"{e.code()}"))
            return
        finally:
            channel.close()
        if why:
            self.refused.append((path, why))
            return
        version, svc, pb = chosen
        stub = service.stub(svc, grpc.insecure_channel("unix:" + info.endpoint))
        with self._lock:
            self.instances.append(Instance(path, info.endpoint, version, stub, pb))


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
