"""Calls to kubelet: Register, and pod-resources `GetAllocatableResources`.

Both are asynchronous: the control loop starts a call and is told the outcome
through a callback (posted to the loop), so a kubelet that hangs never blocks it.
"""

import os
from typing import Callable, Dict, Optional, Tuple

import grpc

from atedevd.api import API_VERSION, PodResourcesStub, RegistrationStub, pb, prpb

KUBELET_SOCKET = "kubelet.sock"
# kubelet dials our socket for up to 10 s inside Register; give it more.
REGISTER_TIMEOUT_S = 20.0
POD_RESOURCES_TIMEOUT_S = 5.0

_CHANNEL_OPTIONS = [
    # What kubelet's own client sends; grpc core would send the socket path.
    ("grpc.default_authority", "localhost"),
    # A fresh channel per call must not inherit another one's reconnect backoff.
    ("grpc.use_local_subchannel_pool", 1),
]


def pod_resources_socket(plugin_dir: str) -> str:
    """`<kubelet root>/pod-resources/kubelet.sock`, beside the plugin directory."""
    return os.path.join(os.path.dirname(os.path.normpath(plugin_dir)), "pod-resources", KUBELET_SOCKET)


def warm_up(plugin_dir: str) -> None:
    """Build and drop one channel to kubelet.sock, connecting nothing: a process's first
    channel costs ~3 ms more than later ones (grpc's client stack), which a kubelet
    that starts after us (at boot) would otherwise wait for in its first Register."""
    grpc.insecure_channel("unix:" + os.path.join(plugin_dir, KUBELET_SOCKET), options=_CHANNEL_OPTIONS).close()


class KubeletView:
    """What the loop knows of kubelet: is kubelet.sock there, and since when.

    A new kubelet is told by the inotify event of its socket being created,
    not by inode numbers (a restarted kubelet can get the old one back); after
    lost events, by the socket's inode and ctime together. `identity(path)`
    gives those two, or None when there is no file (the host's I/O).
    """

    def __init__(self, plugin_dir: str, identity: Callable[[str], Optional[Tuple[int, int]]]):
        self.socket = os.path.join(plugin_dir, KUBELET_SOCKET)
        self._identify = identity
        self.serving = False
        self.since = 0.0  # ctime of the kubelet.sock we know (wall clock)
        self.gone = False  # the last refresh found the socket deleted since the one before
        self._identity: Optional[Tuple[int, int]] = None

    def refresh(self, created: bool, events_lost: bool = False) -> bool:
        """Re-read kubelet.sock; True when a kubelet started serving since the last look.

        `created`: an event said the socket was (re)created. `events_lost`: events
        may be missing (start-up, queue overflow, polling), so a changed inode or
        ctime counts too; otherwise it does not (a chmod changes the ctime).
        """
        identity = self._identify(self.socket)
        if identity is None:
            self.gone = self.serving
            self.serving, self._identity = False, None
            return False
        self.gone = False
        new = created or (events_lost and identity != self._identity)
        self.serving, self._identity = True, identity
        if new:
            self.since = identity[1] / 1e9
        return new


class _Call:
    """One unary call in flight on its own channel; `on_done(call, result, error)`.
    After it ends, `code` is its gRPC status code (None when it succeeded)."""

    def __init__(self, target: str, on_done: Callable) -> None:
        self.code: Optional[grpc.StatusCode] = None
        self._on_done = on_done
        self._channel = grpc.insecure_channel("unix:" + target, options=_CHANNEL_OPTIONS)
        self._future: Optional[grpc.Future] = None

    def _begin(self, future: grpc.Future) -> None:
        self._future = future
        future.add_done_callback(self._done)

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def _done(self, future: grpc.Future) -> None:
        result, error = None, None
        if future.cancelled():
            error, self.code = "cancelled", grpc.StatusCode.CANCELLED
        else:
            exc = future.exception()
            if exc is not None:
                error = describe(exc)
                self.code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            else:
                result = future.result()
        self._on_done(self, result, error)

    def close(self) -> None:
        """Release the channel; called by the loop, never from a gRPC callback thread."""
        self._channel.close()


class RegisterCall(_Call):
    """Register `endpoint` (a socket file name in the plugin directory) for `resource`."""

    def __init__(self, plugin_dir: str, resource: str, endpoint: str, on_done: Callable) -> None:
        super().__init__(os.path.join(plugin_dir, KUBELET_SOCKET), on_done)
        request = pb.RegisterRequest(
            version=API_VERSION, endpoint=endpoint, resource_name=resource, options=pb.DevicePluginOptions()
        )
        self._begin(RegistrationStub(self._channel).Register.future(request, timeout=REGISTER_TIMEOUT_S))


class AllocatableCall(_Call):
    """Ask kubelet's pod-resources API which device IDs it counts as allocatable.

    The result handed to `on_done` is {resource name: set of device IDs}.
    """

    def __init__(self, socket_path: str, on_done: Callable) -> None:
        super().__init__(socket_path, on_done)
        stub = PodResourcesStub(self._channel)
        self._begin(stub.GetAllocatableResources.future(prpb.AllocatableResourcesRequest(), timeout=POD_RESOURCES_TIMEOUT_S))

    def _done(self, future: grpc.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return super()._done(future)
        self._on_done(self, allocatable_ids(future.result()), None)


def allocatable_counts(socket_path: str, timeout: float) -> Dict[str, int]:
    """{resource: device IDs kubelet holds allocatable}, asked and waited for (`atedevd
    check`; the daemon asks with `AllocatableCall`). Raises OSError when there is no answer."""
    channel = grpc.insecure_channel("unix:" + socket_path, options=_CHANNEL_OPTIONS)
    try:
        resp = PodResourcesStub(channel).GetAllocatableResources(prpb.AllocatableResourcesRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise OSError(f"{e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    return {name: len(ids) for name, ids in allocatable_ids(resp).items()}


def not_listening(code: Optional[grpc.StatusCode]) -> bool:
    """The call never reached a server: nobody accepts connections on the socket."""
    return code == grpc.StatusCode.UNAVAILABLE


def allocatable_ids(response) -> dict:
    """{resource name: set of device IDs} from an AllocatableResourcesResponse, which
    has one entry per device (per NUMA node where topology is set)."""
    ids: dict = {}
    for d in response.devices:
        ids.setdefault(d.resource_name, set()).update(d.device_ids)
    return ids


def describe(exc: BaseException) -> str:
    """A one-line reason without a stack trace: refusals are normal while kubelet restarts."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        details = (exc.details() or "").strip()
        if code == grpc.StatusCode.UNAVAILABLE:
            return "kubelet is not accepting connections"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "kubelet did not answer in time"
        return f"kubelet refused: {code.name}: {details}"
    return str(exc)
