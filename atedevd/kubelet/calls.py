"""Calls to kubelet: Register, and pod-resources `GetAllocatableResources`.

Both are asynchronous: the control loop starts a call and is told its outcome, typed,
through one callback run on the loop (`post`: never on a gRPC thread), so a kubelet that
hangs never blocks it: `RegisterDone` for Register, an `Allocatable` for pod-resources.
"""

import os
from typing import Any, Callable, Dict, Optional, Tuple

import grpc

from atedevd.api import API_VERSION, PodResourcesStub, RegistrationStub, pb, prpb
from atedevd.record import Record
from atedevd.registration.messages import Listing, Outcome, RegisterDone

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


Post = Callable[[Callable[[], None]], None]  # runs a callable on the loop (from a gRPC thread)


class Allocatable(Record):
    """pod-resources' answer: how many devices kubelet lists per resource, or why there is none."""

    listing: Listing
    counts: Dict[str, int]  # {resource: device IDs kubelet holds allocatable}
    error: Optional[str] = None


class _Call:
    """One unary call in flight on its own channel. Its end is read on a gRPC thread (`code`,
    the result, the error) and finished on the loop (`post`): the channel closed, then the
    outcome handed to the caller's one callback."""

    def __init__(self, target: str, post: Post) -> None:
        self.code: Optional[grpc.StatusCode] = None  # after it ends: None when it succeeded
        self._post = post
        self._channel = grpc.insecure_channel("unix:" + target, options=_CHANNEL_OPTIONS)
        self._future: Optional[grpc.Future] = None
        self._result: Any = None
        self._error: Optional[str] = None

    def _begin(self, future: grpc.Future) -> None:
        self._future = future
        future.add_done_callback(self._done)

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def _done(self, future: grpc.Future) -> None:
        """On a gRPC thread: what the call ended with, then the rest on the loop."""
        if future.cancelled():
            self._error, self.code = "cancelled", grpc.StatusCode.CANCELLED
        else:
            exc = future.exception()
            if exc is not None:
                self._error = describe(exc)
                self.code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            else:
                self._result = future.result()
        self._post(self._finish)

    def _finish(self) -> None:
        """On the loop (a channel is never closed from its own callback thread)."""
        self._channel.close()
        self._answer()

    def _answer(self) -> None:
        raise NotImplementedError


class RegisterCall(_Call):
    """Register `endpoint` (a socket file name in the plugin directory) for `resource`: the
    machine's call `cid`, answered with its `RegisterDone`."""

    def __init__(self, plugin_dir: str, resource: str, endpoint: str, cid: int, post: Post,
                 done: Callable[[RegisterDone], None]) -> None:
        super().__init__(os.path.join(plugin_dir, KUBELET_SOCKET), post)
        self._cid, self._deliver = cid, done
        request = pb.RegisterRequest(
            version=API_VERSION, endpoint=endpoint, resource_name=resource, options=pb.DevicePluginOptions()
        )
        self._begin(RegistrationStub(self._channel).Register.future(request, timeout=REGISTER_TIMEOUT_S))

    def _answer(self) -> None:
        if self._error is None:
            self._deliver(RegisterDone(self._cid, Outcome.OK, ""))
        else:
            outcome = Outcome.REFUSED if not_listening(self.code) else Outcome.FAILED
            self._deliver(RegisterDone(self._cid, outcome, self._error))


class AllocatableCall(_Call):
    """Ask kubelet's pod-resources API how many device IDs it counts as allocatable, per resource."""

    def __init__(self, socket_path: str, post: Post, done: Callable[[Allocatable], None]) -> None:
        super().__init__(socket_path, post)
        self._deliver = done
        stub = PodResourcesStub(self._channel)
        self._begin(stub.GetAllocatableResources.future(prpb.AllocatableResourcesRequest(), timeout=POD_RESOURCES_TIMEOUT_S))

    def _answer(self) -> None:
        code = self.code
        if self._error is None and self._result is not None:
            counts = {name: len(ids) for name, ids in allocatable_ids(self._result).items()}
            self._deliver(Allocatable(Listing.LISTED, counts))
        elif not_listening(code):
            self._deliver(Allocatable(Listing.REFUSED, {}, self._error))
        elif code is not None and code.name == "UNIMPLEMENTED":
            self._deliver(Allocatable(Listing.ABSENT, {}, self._error))
        elif code is not None and code.name == "RESOURCE_EXHAUSTED":  # kubelet's rate limit
            self._deliver(Allocatable(Listing.EXHAUSTED, {}, self._error))
        else:
            self._deliver(Allocatable(Listing.FAILED, {}, self._error))


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
