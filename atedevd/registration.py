"""Register a plugin with kubelet, and the backoff between failed attempts.

An attempt is asynchronous: the control loop starts it and is told the
outcome through a callback, so a kubelet that hangs never blocks the loop.
"""

import os
import time
from typing import Callable, Optional

import grpc

from atedevd.api import API_VERSION, RegistrationStub, pb

KUBELET_SOCKET = "kubelet.sock"
# kubelet dials our socket for up to 10 s inside Register; give it more.
REGISTER_TIMEOUT_S = 20.0

_CHANNEL_OPTIONS = [
    # What kubelet's own client sends; grpc core would send the socket path.
    ("grpc.default_authority", "localhost"),
    # A fresh channel per attempt must not inherit another one's reconnect backoff.
    ("grpc.use_local_subchannel_pool", 1),
]


class Attempt:
    """One Register call in flight; `cancel()` when a newer kubelet makes it moot."""

    def __init__(
        self,
        plugin_dir: str,
        resource: str,
        endpoint: str,
        on_done: Callable[["Attempt", Optional[str]], None],
    ):
        self.resource = resource
        self.started = time.monotonic()
        self._on_done = on_done
        self._channel = grpc.insecure_channel(
            "unix:" + os.path.join(plugin_dir, KUBELET_SOCKET), options=_CHANNEL_OPTIONS
        )
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=endpoint,
            resource_name=resource,
            options=pb.DevicePluginOptions(),
        )
        self._future = RegistrationStub(self._channel).Register.future(
            request, timeout=REGISTER_TIMEOUT_S
        )
        self._future.add_done_callback(self._done)

    def cancel(self) -> None:
        self._future.cancel()

    def _done(self, future: grpc.Future) -> None:
        error = None
        if future.cancelled():
            error = "cancelled"
        else:
            exc = future.exception()
            if exc is not None:
                error = describe(exc)
        self._on_done(self, error)

    def close(self) -> None:
        """Release the channel; called by the loop, never from a gRPC callback thread."""
        self._channel.close()


def describe(exc: BaseException) -> str:
    """A one-line reason without a stack trace: refusals are normal while kubelet restarts."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        details = (exc.details() or "").strip()
        if code == grpc.StatusCode.UNAVAILABLE:
            return "kubelet is not accepting connections"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"kubelet did not answer within {REGISTER_TIMEOUT_S:.0f} s"
        return f"kubelet refused: {code.name}: {details}"
    return str(exc)


class Backoff:
    """Capped exponential delay between failed attempts: 10 ms … 2 s."""

    def __init__(self, first: float = 0.01, cap: float = 2.0):
        self.first = first
        self.cap = cap
        self.delay = 0.0

    def next(self) -> float:
        self.delay = self.first if self.delay == 0 else min(self.delay * 2, self.cap)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0
