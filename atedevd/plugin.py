"""The v1beta1 DevicePlugin service for one resource, on its own unix socket.

Handlers only read the current immutable `Snapshot` and wait for the next
one; they never decide anything. What the control loop must know (a stream
that kubelet ended) is handed to it through `on_stream_end`.
"""

import itertools
import logging
import os
import threading
from concurrent import futures
from typing import Callable, Optional, Set

import grpc

from atedevd.api import device_plugin_handler, pb
from atedevd.config import Device
from atedevd.devices import Snapshot

log = logging.getLogger(__name__)

# Each ListAndWatch stream holds a worker thread for its whole life. kubelet
# holds one per resource (two while it re-registers); the budget is shared by
# every resource and leaves workers free for Allocate whatever streams do.
WORKERS = 16
MAX_STREAMS = 12
# sun_path is 108 bytes with the terminating NUL.
MAX_SOCKET_PATH = 107
# Long lists of bad IDs are named only this far in an error.
_NAMED_IDS = 3
# Generations are unique across servers: a stream of a stopped server that ends late
# must never match the registration made on its successor.
_generations = itertools.count(1)


class _Stream:
    __slots__ = ("generation", "primary", "ended_by_us")

    def __init__(self, generation: int, primary: bool):
        self.generation = generation
        self.primary = primary  # the first stream of its registration: the one kubelet opens
        self.ended_by_us = False


class Workers:
    """The worker threads every plugin server shares, and the streams' share of them."""

    def __init__(self) -> None:
        self.executor = futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="grpc")
        self.stream_slots = threading.BoundedSemaphore(MAX_STREAMS)
        # Start every worker now (the pool would start them on demand), so the
        # thread count and resident memory seen at start are what the node pays.
        everyone = threading.Barrier(WORKERS + 1)
        for _ in range(WORKERS):
            self.executor.submit(everyone.wait)
        everyone.wait()


class PluginServer:
    """Serves one resource; `publish` a new snapshot, `end_streams` before re-registering."""

    def __init__(
        self,
        device: Device,
        socket_path: str,
        workers: Workers,
        on_stream_end: Callable[[int], None],
    ):
        self.device = device
        self.socket_path = socket_path
        self._workers = workers
        self._on_stream_end = on_stream_end
        self._cond = threading.Condition()
        self._snapshot: Optional[Snapshot] = None
        self._streams: Set[_Stream] = set()
        self._generation = 0
        self._primary_taken = 0  # the generation whose kubelet stream has opened
        self._server: Optional[grpc.Server] = None
        self.inode: Optional[int] = None
        self._spec = pb.DeviceSpec(
            container_path=device.path, host_path=device.path, permissions=device.permissions
        )

    # --- control loop side ---------------------------------------------------

    def start(self) -> None:
        """Bind the socket and serve; grpc replaces a stale file at the path."""
        size = len(os.fsencode(self.socket_path))
        if size > MAX_SOCKET_PATH:
            raise OSError(f"the socket path is {size} bytes; unix sockets allow at most {MAX_SOCKET_PATH}")
        directory = os.path.dirname(self.socket_path)
        if not os.access(directory, os.W_OK):  # e.g. EROFS; grpc core would log a stack of errors per try
            raise OSError("cannot bind the socket: the directory is not writable")
        server = grpc.server(
            self._workers.executor,
            handlers=[device_plugin_handler(self)],
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
        )
        try:
            port = server.add_insecure_port("unix:" + self.socket_path)
        except RuntimeError:  # newer grpcio raises where older returns 0
            port = 0
        if port == 0:
            raise OSError("cannot bind the socket")
        server.start()
        self._server = server
        self.inode = os.lstat(self.socket_path).st_ino

    def stop(self) -> None:
        """Stop serving, end every stream, and remove our socket if it is still there
        (grpc unlinks the path itself on stop; this covers versions that do not)."""
        self.end_streams()
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self.socket_is_ours():
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        self.inode = None

    def socket_is_ours(self) -> bool:
        try:
            return self.inode is not None and os.lstat(self.socket_path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def publish(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._snapshot = snapshot
            self._cond.notify_all()

    def new_generation(self) -> int:
        """Streams opened from now on belong to the registration about to be made."""
        with self._cond:
            self._generation = next(_generations)
            return self._generation

    def end_streams(self, timeout: float = 0.2) -> None:
        """End every open stream and wait briefly for the handlers to return,
        so kubelet sees the old stream end before our next Register."""
        with self._cond:
            for s in self._streams:
                s.ended_by_us = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._streams, timeout)

    # --- gRPC side (worker threads) ------------------------------------------

    def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions()

    def ListAndWatch(self, request, context):
        if not self._workers.stream_slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.device.resource}: already {MAX_STREAMS} ListAndWatch streams open",
            )
        with self._cond:
            stream = _Stream(self._generation, primary=self._primary_taken != self._generation)
            self._primary_taken = self._generation
            self._streams.add(stream)
        context.add_callback(self._wake)
        sent = None
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: stream.ended_by_us
                        or not context.is_active()
                        or self._snapshot is not sent
                    )
                    if stream.ended_by_us or not context.is_active():
                        return
                    sent = self._snapshot
                yield sent.response
        finally:
            with self._cond:
                self._streams.discard(stream)
                self._cond.notify_all()
            self._workers.stream_slots.release()
            if stream.primary and not stream.ended_by_us:
                self._on_stream_end(stream.generation)

    def Allocate(self, request, context):
        snap = self._snapshot
        resp = pb.AllocateResponse()
        for n, creq in enumerate(request.container_requests):
            problem = self._check_ids(creq.devices_ids, snap)
            if problem:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"container request {n}: {problem}")
            if not snap.healthy:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.device.resource}: {self.device.path} is not present on this node",
                )
            # Any number of units of one device still mean one device node.
            resp.container_responses.add().devices.append(self._spec)
        return resp

    def GetPreferredAllocation(self, request, context):
        # Not advertised (units are interchangeable); answer sensibly anyway.
        resp = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            chosen = list(dict.fromkeys(creq.must_include_deviceIDs))
            for i in creq.available_deviceIDs:
                if len(chosen) >= creq.allocation_size:
                    break
                if i not in chosen:
                    chosen.append(i)
            resp.container_responses.add().deviceIDs.extend(chosen[: max(creq.allocation_size, 0)])
        return resp

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _check_ids(self, ids, snap: Snapshot) -> Optional[str]:
        if not ids:
            return "no device IDs"
        unknown = [i for i in ids if i not in snap.ids]
        if not unknown:
            return None
        named = ", ".join(_quote(i) for i in unknown[:_NAMED_IDS])
        more = f" and {len(unknown) - _NAMED_IDS} more" if len(unknown) > _NAMED_IDS else ""
        return f"unknown device ID {named}{more} for {self.device.resource}"


def _quote(device_id: str, limit: int = 80) -> str:
    text = repr(device_id[:limit])
    return text + "…" if len(device_id) > limit else text
