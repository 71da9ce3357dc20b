"""The I/O beneath the performer and the node, on a real host.

Everything `atedevd/glue/performer.py` and `atedevd/glue/plugin_dir.py` do to the world goes
through one `Host`: the clocks, kubelet.sock and our socket files, the plugin
servers, the Register and pod-resources calls, the journal. The simulation
(tests/simulation/host.py) implements the same methods against its model of
kubelet and the directory, on its own clock: that is all it fakes.

Outcomes of calls come back through `post` (onto the loop, never on a gRPC
thread), already typed: a `RegisterDone` for Register, an `Allocatable` for pod-resources.
"""

import logging
import os
import time
from functools import partial
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from atedevd.kubelet import sockets
from atedevd.kubelet.calls import KUBELET_SOCKET, Allocatable, AllocatableCall, RegisterCall, pod_resources_socket
from atedevd.kubelet.plugin import PluginServer, Workers
from atedevd.registration.messages import RegisterDone
from atedevd.systemd import event

if TYPE_CHECKING:
    from atedevd.cdi.keeper import Specs
    from atedevd.daemon.watch import Watcher

log = logging.getLogger(__name__)


class Host:
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)
    isdir = staticmethod(os.path.isdir)
    exists = staticmethod(os.path.exists)
    listening = staticmethod(sockets.listening)  # someone accepts connections on that socket
    cdi: Optional["Specs"] = None  # the daemon's CDI specs (atedevd/cdi/keeper.py), set by the daemon
    watcher: Optional["Watcher"] = None  # the loop's (atedevd/daemon/watch.py), set by the daemon before its start

    def __init__(self, plugin_dir: str, workers: Workers, post: Callable[[Callable[[], None]], None]) -> None:
        self.plugin_dir = plugin_dir
        self.kubelet_socket = os.path.join(plugin_dir, KUBELET_SOCKET)
        self.pod_resources_socket = pod_resources_socket(plugin_dir)
        self.workers = workers
        self.post = post  # run a callable on the loop (from gRPC threads)
        self._said: Set[str] = set()  # `once` keys already logged
        # Kubelet's connections counted for a let-go wait, watched for its hang-up: a
        # duplicate of each descriptor, by who counted them (the loop polls them).
        self._watched: Dict[object, Tuple[List[int], Callable[[], None]]] = {}

    @staticmethod
    def connections_visible() -> bool:
        """Our descriptors show kubelet's connections to our sockets (/proc is readable)."""
        return sockets.held_connections(()) is not None

    def count_connections(self, who: object, bind_paths: List[str], on_hangup: Callable[[], None]) -> Tuple[Optional[int], bool]:
        """kubelet's connections still open to the sockets bound at these paths (None: our
        descriptors cannot show them), and whether `on_hangup` runs on the loop when kubelet
        hangs one of them up (`who`'s earlier watch ends here)."""
        self.unwatch(who)
        fds: List[int] = []
        held = sockets.held_connections(bind_paths, keep=fds)
        if fds:
            self._watched[who] = (fds, on_hangup)
        return held, bool(fds)

    def unwatch(self, who: object) -> None:
        """Close `who`'s duplicates: a connection we hold open would not close for kubelet."""
        fds, _ = self._watched.pop(who, ((), None))
        for fd in fds:
            os.close(fd)

    def watched_fds(self) -> List[int]:
        return [fd for fds, _ in self._watched.values() for fd in fds]

    def hung_up(self, fd: int) -> None:
        """The loop saw `fd` hung up: its watch ends, and whoever counted is told (on the loop)."""
        for who, (fds, on_hangup) in list(self._watched.items()):
            if fd in fds:
                self.unwatch(who)
                self.post(on_hangup)
                return

    @staticmethod
    def identity(path: str) -> Optional[Tuple[int, int]]:
        """(inode, ctime) of the file at `path`, None when there is none."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def watch(self, directories: FrozenSet[str]) -> None:
        """Watch exactly these directories from now on (the loop reads the events)."""
        assert self.watcher is not None
        self.watcher.want(directories)

    @staticmethod
    def make_dir(path: str) -> None:
        try:
            os.mkdir(path, mode=0o700)
        except FileExistsError:
            pass

    def server(self, device, path: str, slots, allocations, on_event: Callable) -> PluginServer:
        """A plugin server for `device` at `path`, not started; `on_event(StreamEvent)` runs on the loop."""
        return PluginServer(device, path, self.workers, slots, lambda kind: self.post(partial(on_event, kind)), allocations)

    def register(self, resource: str, endpoint: str, cid: int, done: Callable[[RegisterDone], None]) -> RegisterCall:
        """Register `endpoint` for `resource` (the machine's call `cid`); `done` on the loop. Returns the call (cancel())."""
        call = RegisterCall(self.plugin_dir, resource, endpoint, cid, self.post, done)
        self.workers.registering()
        return call

    def ask_allocatable(self, path: str, done: Callable[[Allocatable], None]) -> AllocatableCall:
        """How many devices kubelet lists per resource: `done` on the loop."""
        return AllocatableCall(path, self.post, done)

    def say(self, level: int, kind: str, text: str, once: Optional[str] = None, **fields: str) -> None:
        """A journal line (`once`: a key said at most once per daemon)."""
        if once is not None:
            if once in self._said:
                return
            self._said.add(once)
        if level == logging.DEBUG:
            log.debug("%s", text)
        else:
            event(level, kind, text, **fields)
