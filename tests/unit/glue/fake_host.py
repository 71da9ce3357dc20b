"""A host for the glue's own tests: every call noted, nothing of the world touched but /dev/null.

`HostIO` (atedevd/glue/seams.py) is what the glue does to the world; this one answers from
fields a test sets (is kubelet there, is it listening) and keeps the servers it made, so a
test can see what a resource carried out without a socket.
"""

from typing import Callable, List, Optional, Tuple


class FakeServer:
    """One plugin socket's server, never bound: `start_hook` runs inside its start."""

    def __init__(self, host: "FakeHost", device, path: str, on_event: Callable) -> None:
        self.host, self.device, self.bind_path, self.socket_path = host, device, path, path
        self.on_event = on_event
        self.inode: Optional[int] = None
        self.snapshot = None
        self.deleted = False  # its file deleted or replaced by someone else

    def start(self) -> None:
        self.inode = len(self.host.servers)
        if self.host.start_hook is not None:
            self.host.start_hook()

    def stop(self) -> None:
        self.inode = None

    def move_to(self, path: str) -> None:
        self.socket_path = path

    def socket_is_ours(self) -> bool:
        return self.inode is not None and not self.deleted

    def publish(self, snapshot) -> None:
        self.snapshot = snapshot

    def retarget(self, device) -> None:
        self.device = device

    def resend(self) -> None:
        pass

    def end_streams(self) -> None:
        pass


class FakeHost:
    plugin_dir = "/fake/device-plugins"
    kubelet_socket = "/fake/device-plugins/kubelet.sock"
    pod_resources_socket = "/fake/pod-resources/kubelet.sock"
    cdi = None

    def __init__(self) -> None:
        self.now = 100.0
        self.kubelet: Optional[Tuple[int, int]] = (1, 99_000_000_000)  # kubelet.sock's (inode, ctime ns); None: absent
        self.accepting = False  # someone listens on kubelet.sock
        self.servers: List[FakeServer] = []
        self.registers: List[tuple] = []  # (resource, endpoint, cid, done) of each Register sent
        self.said: List[tuple] = []
        self.start_hook: Optional[Callable[[], None]] = None

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1000.0 + self.now

    def isdir(self, path: str) -> bool:
        return True

    def exists(self, path: str) -> bool:
        return False

    def listening(self, path: str) -> bool:
        return self.accepting

    def identity(self, path: str) -> Optional[Tuple[int, int]]:
        return self.kubelet if path == self.kubelet_socket else None

    def make_dir(self, path: str) -> None:
        pass

    def watch(self, directories) -> None:
        self.watched = directories

    def connections_visible(self) -> bool:
        return True

    def count_connections(self, who, bind_paths, on_hangup) -> Tuple[Optional[int], bool]:
        return 0, False

    def unwatch(self, who) -> None:
        pass

    def server(self, device, path: str, slots, allocations, on_event) -> FakeServer:
        server = FakeServer(self, device, path, on_event)
        self.servers.append(server)
        return server

    def register(self, resource: str, endpoint: str, cid: int, done):
        self.registers.append((resource, endpoint, cid, done))
        return UnansweredCall()

    def ask_allocatable(self, path: str, done):
        return UnansweredCall()

    def post(self, call: Callable[[], None]) -> None:
        call()

    def say(self, level: int, kind: str, text: str, once: Optional[str] = None, **fields: str) -> None:
        self.said.append((kind, text))


class UnansweredCall:
    def cancel(self) -> None:
        pass
