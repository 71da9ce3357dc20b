"""The v1beta1 DevicePlugin service for one resource, on one unix socket.

Handlers only read the current immutable `Snapshot` and wait for the next
one; they never decide anything. What the registration must know — kubelet
opened its stream, ended it, or a stream was refused — is reported through
`on_event(StreamEvent)`, from gRPC threads; all decisions are made in the control loop.
"""

import _thread
import enum
import logging
import os
import queue
import threading
import time
from concurrent import futures
from typing import Callable, Optional, Set

import grpc

from atedevd.api import device_plugin_handler, pb
from atedevd.config import Device
from atedevd.devices.snapshot import Snapshot
from atedevd.kubelet import lists
from atedevd.kubelet.sockets import MAX_SOCKET_PATH

log = logging.getLogger(__name__)

# Each ListAndWatch stream holds a worker thread for its whole life. kubelet
# holds one per resource, two while one registration replaces another; one more leaves room for a
# debugging client. Every resource has this budget of its own.
STREAMS_PER_RESOURCE = 3
# Workers that streams can never take, for Allocate and the other unary calls.
UNARY_WORKERS = 12
# The smallest pool: what one resource used before streams had a budget each.
PRESTARTED_WORKERS = 16
# Long lists of bad IDs are named only this far in an error.
_NAMED_IDS = 3



def plugin_options(device: Device) -> pb.DevicePluginOptions:
    """What GetDevicePluginOptions answers for `device`: kubelet reads it inside Register,
    so a change to it needs a new registration (nothing else a reload changes does). Units
    of a pattern are not interchangeable (one node each, on its NUMA node): kubelet asks
    which to give when we say so. Shareable units are all one node: nothing to prefer."""
    return pb.DevicePluginOptions(get_preferred_allocation_available=device.pattern)


class StreamEvent(enum.Enum):
    """What a server tells the loop about kubelet's ListAndWatch streams."""

    OPENED = "stream-opened"  # kubelet's stream (the first one on this socket)
    LIST_SENT = "list-sent"  # ... has taken our first device list (gRPC asked for the next message)
    ENDED = "stream-ended"  # ... ended, not by us
    REFUSED = "stream-refused"  # a stream beyond the resource's budget was refused


class Workers(futures.Executor):
    """The worker threads every plugin server shares: each resource's stream budget
    plus `UNARY_WORKERS` that streams can never take. All are started before kubelet
    could need them (the thread count and memory seen at start are what the node
    pays, and a burst of calls cannot grow the pool and thrash the GIL); a reload that
    adds devices `grow`s it. A start waits for each thread to run (0.3 ms each on a
    busy node), so none are started before a Register is sent: `registering` starts
    what kubelet's first calls after it need, `grow` the rest of the pool (the daemon
    calls it once the first Registers are sent). gRPC only ever calls `submit`."""

    def __init__(self, resources: int, start_now: Optional[int] = None) -> None:
        self._tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: list = []
        self._resources = resources
        self._registering = 0
        self.grow(resources, start_now)

    def grow(self, resources: int, limit: Optional[int] = None) -> None:
        if limit is None:
            self._resources = resources
        size = max(PRESTARTED_WORKERS, UNARY_WORKERS + STREAMS_PER_RESOURCE * resources)
        if limit is not None:
            size = min(size, limit)
        while len(self._threads) < size:
            # Not threading.Thread.start, which waits until the new thread has run: 0.3 ms on
            # a quiet node, up to a few ms each (the GIL's switch interval) while kubelet dials
            # back at boot. Like a daemon thread, it does not hold up the exit.
            name = f"grpc-{len(self._threads)}"
            self._threads.append(_thread.start_new_thread(self._work, (name,)))

    def registering(self) -> None:
        """A Register is on its way: kubelet dials back next. Its ListAndWatch stream and
        one unary call of every resource registering so far find a thread at once."""
        self._registering = min(self._registering + 1, self._resources)  # re-registrations add none
        self.grow(self._registering, limit=STREAMS_PER_RESOURCE * self._registering + 1)

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in self._threads:
            self._tasks.put(None)

    def _work(self, name: str) -> None:
        threading.current_thread().name = name  # (what a log line or a traceback names)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: B036 - handed to whoever waits on it
                future.set_exception(e)
            del task, future, fn, args, kwargs  # no references kept between tasks


class AllocateCounts:
    """Allocate calls and failures of one resource, over all its sockets (for metrics);
    counted on gRPC threads, read by the loop. `cdi`: the resource's CDI answers
    (atedevd/cdi/keeper.py), which its sockets share likewise."""

    def __init__(self, cdi=None) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.failures = 0
        self.cdi = cdi

    def count(self, failed: bool) -> None:
        with self._lock:
            self.calls += 1
            self.failures += failed


class _Stream:
    __slots__ = ("primary", "ended_by_us")

    def __init__(self, primary: bool):
        self.primary = primary  # the first stream after registration: kubelet's
        self.ended_by_us = False


class PluginServer:
    """Serves one resource on one socket file, for exactly one registration."""

    def __init__(
        self,
        device: Device,
        bind_path: str,
        workers: Workers,
        stream_slots: threading.BoundedSemaphore,
        on_event: Callable[[StreamEvent], None],
        allocations: Optional[AllocateCounts] = None,
    ):
        self.device = device
        self.bind_path = bind_path  # where it was bound: /proc/net/unix names it so
        self.socket_path = bind_path  # where it is now (after `move_to`)
        self._workers = workers
        self._slots = stream_slots
        self._on_event = on_event
        self._allocations = allocations or AllocateCounts()
        self._cond = threading.Condition()
        self._snapshot: Optional[Snapshot] = None
        self._streams: Set[_Stream] = set()
        self._primary_taken = False
        self._server: Optional[grpc.Server] = None
        self.inode: Optional[int] = None
        # Nodes every unit brings along (VFIO: /dev/vfio/vfio), in every answer.
        self._companions = _companion_specs(device)
        self._sent = lists.SentLists()  # what kubelet may still allocate from (atedevd/kubelet/lists.py)

    # --- control loop side ---------------------------------------------------

    def start(self) -> None:
        """Bind the socket and serve; grpc replaces a stale file at the path."""
        size = len(os.fsencode(self.bind_path))
        if size > MAX_SOCKET_PATH:
            raise OSError(f"the socket path is {size} bytes; unix sockets allow at most {MAX_SOCKET_PATH}")
        if not os.access(os.path.dirname(self.bind_path), os.W_OK):  # e.g. EROFS; grpc would log a stack per try
            raise OSError("cannot bind the socket: the directory is not writable")
        server = grpc.server(
            self._workers,  # type: ignore[arg-type]  # (an Executor: grpc uses submit() alone)
            handlers=[device_plugin_handler(self)],
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
        )
        try:
            port = server.add_insecure_port("unix:" + self.bind_path)
        except RuntimeError:  # newer grpcio raises where older returns 0
            port = 0
        if port == 0:
            raise OSError("cannot bind the socket")
        server.start()
        self._server = server
        self.inode = os.lstat(self.bind_path).st_ino

    def move_to(self, path: str) -> None:
        """Rename the bound socket file into place (same filesystem): it keeps serving."""
        os.rename(self.socket_path, path)
        self.socket_path = path

    def stop(self) -> None:
        """Stop serving and remove our socket file if it is still ours (grpc
        unlinks only the path it bound, not where the file was moved)."""
        self.end_streams()
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self.socket_is_ours():
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            except OSError as e:  # e.g. EROFS: the directory was made read-only under us
                log.debug("cannot remove %s: %s", self.socket_path, e)
        self.inode = None

    def socket_is_ours(self) -> bool:
        try:
            return self.inode is not None and os.lstat(self.socket_path).st_ino == self.inode
        except OSError:
            return False

    def retarget(self, device: Device) -> None:
        """A reload changed what Allocate answers (the path, the permissions, the companions):
        the next Allocate answers with it, on the same socket, for the same registration."""
        self._companions = _companion_specs(device)
        self.device = device

    def publish(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._snapshot = snapshot
            self._cond.notify_all()

    def resend(self) -> None:
        """Send the current device list again on every open stream."""
        with self._cond:
            if self._snapshot is not None:
                self._snapshot = self._snapshot.again()  # equal, but not the one sent
                self._cond.notify_all()

    def end_streams(self) -> None:
        """Ask every open stream to end; returns at once (handlers finish on their threads)."""
        with self._cond:
            for s in self._streams:
                s.ended_by_us = True
            self._cond.notify_all()

    # --- gRPC side (worker threads) ------------------------------------------

    def GetDevicePluginOptions(self, request, context):
        return plugin_options(self.device)

    def ListAndWatch(self, request, context):
        if not self._slots.acquire(blocking=False):
            self._on_event(StreamEvent.REFUSED)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.device.resource}: already {STREAMS_PER_RESOURCE} ListAndWatch streams open",
            )
        with self._cond:
            stream = _Stream(primary=not self._primary_taken)
            self._primary_taken = True
            self._streams.add(stream)
        try:
            if stream.primary:
                self._on_event(StreamEvent.OPENED)
            context.add_callback(self._wake)
            sent = None
            first = stream.primary
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: stream.ended_by_us or not context.is_active() or self._snapshot is not sent
                    )
                    if stream.ended_by_us or not context.is_active():
                        return
                    sent = self._snapshot
                assert sent is not None  # (published before the server started: the wait passes no None)
                yield sent.response
                if stream.primary:  # kubelet's: what it may allocate from until it has taken the next
                    self._sent.sent(sent, time.monotonic())
                if first:  # gRPC wants the next message: the first one is on its way to kubelet
                    first = False
                    self._on_event(StreamEvent.LIST_SENT)
        finally:
            with self._cond:
                self._streams.discard(stream)
            self._slots.release()
            if stream.primary and not stream.ended_by_us:
                self._on_event(StreamEvent.ENDED)

    def Allocate(self, request, context):
        try:
            resp = self._allocate(request, context)
        except BaseException:  # context.abort raises: a refusal kubelet sees
            self._allocations.count(failed=True)
            raise
        self._allocations.count(failed=False)
        return resp

    def _allocate(self, request, context):
        snap = self._snapshot
        assert snap is not None  # (published before the server started: no Allocate comes before it)
        resp = pb.AllocateResponse()
        earlier = lambda i: self._sent.earlier(i, time.monotonic())  # noqa: E731
        for n, creq in enumerate(request.container_requests):
            problem = self._check_ids(creq.devices_ids, snap)
            if problem:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"container request {n}: {problem}")
            refusal = snap.refusal(creq.devices_ids, earlier)
            if refusal:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"container request {n}: {refusal}")
            perm = self.device.permissions
            specs = [pb.DeviceSpec(container_path=p, host_path=p, permissions=perm) for p in snap.paths(creq.devices_ids)]
            answer = resp.container_responses.add()
            cdi = self._allocations.cdi
            names = cdi.names(creq.devices_ids) if cdi is not None else ()
            if names:  # a runtime with CDI makes the node as the spec says (mode, owner); others ignore the names
                answer.cdi_devices.extend(pb.CDIDevice(name=n) for n in names)
            if not names or cdi.device_specs:
                answer.devices.extend(specs + self._companions)
        return resp

    def GetPreferredAllocation(self, request, context):
        """Advertised for pattern resources: units on one NUMA node where one can give them all
        (kubelet's Topology Manager aligns by the same information, when its policy asks)."""
        from atedevd.devices.patterns import preferred  # loaded where some device has a pattern

        snap = self._snapshot
        numa = snap.numa if snap is not None else (lambda i: ())
        resp = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            chosen = preferred(creq.available_deviceIDs, creq.must_include_deviceIDs, creq.allocation_size, numa)
            resp.container_responses.add().deviceIDs.extend(chosen)
        return resp

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _check_ids(self, ids, snap: Snapshot) -> Optional[str]:
        if not ids:
            return "no device IDs"
        unknown = [i for i in ids if i not in snap.ids and self._sent.earlier(i, time.monotonic()) is None]
        if not unknown:
            return None
        named = ", ".join(_quote(i) for i in unknown[:_NAMED_IDS])
        more = f" and {len(unknown) - _NAMED_IDS} more" if len(unknown) > _NAMED_IDS else ""
        return f"unknown device ID {named}{more} for {self.device.resource}"


def _companion_specs(device: Device) -> list:
    return [pb.DeviceSpec(container_path=p, host_path=p, permissions=device.permissions) for p in device.companions]


def _quote(device_id: str, limit: int = 80) -> str:
    text = repr(device_id[:limit])
    return text + "…" if len(device_id) > limit else text
