"""inotify on the directories the daemon cares about, even before they exist.

We use `inotify.calls` for the system calls and read the descriptor
ourselves: the package's adapter polls every second, which would cost idle
CPU and event latency. A directory that does not exist yet is watched
through its nearest existing ancestor and re-armed as the path appears.
"""

import os
import struct
from typing import Dict, Iterable, List, NamedTuple, Set

import inotify.calls
import inotify.constants as c

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len

MASK = (
    c.IN_CREATE
    | c.IN_DELETE
    | c.IN_MOVED_FROM
    | c.IN_MOVED_TO
    | c.IN_ATTRIB
    | c.IN_DELETE_SELF
    | c.IN_MOVE_SELF
    | c.IN_ONLYDIR
)
# Events after which the set of existing directories may have changed.
_TOPOLOGY = c.IN_DELETE_SELF | c.IN_MOVE_SELF | c.IN_IGNORED | c.IN_Q_OVERFLOW


class Event(NamedTuple):
    directory: str  # the watched directory the event happened in
    name: str  # the entry's name, "" for events on the directory itself
    mask: int

    def is_(self, flags: int) -> bool:
        return bool(self.mask & flags)


class Watcher:
    """Watches a set of directories; `fileno()` goes into the control loop's poll."""

    def __init__(self) -> None:
        self._fd = inotify.calls.inotify_init()
        os.set_blocking(self._fd, False)
        os.set_inheritable(self._fd, False)
        self._wanted: Set[str] = set()
        self._by_path: Dict[str, int] = {}
        self._by_wd: Dict[int, str] = {}

    def fileno(self) -> int:
        return self._fd

    def want(self, directories: Iterable[str]) -> None:
        """Watch exactly these directories (or their nearest existing ancestors)."""
        self._wanted = {os.path.normpath(d) for d in directories}
        self.rearm()

    def rearm(self) -> None:
        """Move each watch to the deepest existing directory of its wanted path."""
        armed = {self._arm(d) for d in self._wanted}
        for path in list(self._by_path):
            if path not in armed:
                self._drop(path)

    def _arm(self, wanted: str) -> str:
        """Watch the deepest existing directory on the way to `wanted`; returns it.

        A directory can vanish between the check and the watch (a recursive
        delete): then its parent is watched instead, so no path goes unwatched.
        """
        path = _deepest_existing(wanted)
        while True:
            if path in self._by_path:
                return path
            try:
                wd = inotify.calls.inotify_add_watch(self._fd, path.encode(), MASK)
            except inotify.calls.InotifyError:
                parent = os.path.dirname(path)
                if parent == path:
                    raise
                path = parent
                continue
            self._by_path[path] = wd
            self._by_wd[wd] = path
            return path

    def read(self) -> List[Event]:
        """Every event queued now (never blocks); re-arms when directories come or go."""
        events: List[Event] = []
        while True:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                break
            events.extend(self._parse(buf))
        if any(e.is_(_TOPOLOGY) or (e.is_(c.IN_ISDIR) and e.name) for e in events):
            self.rearm()
        return events

    def close(self) -> None:
        os.close(self._fd)

    def _parse(self, buf: bytes) -> Iterable[Event]:
        offset = 0
        while offset + _HEADER.size <= len(buf):
            wd, mask, _cookie, length = _HEADER.unpack_from(buf, offset)
            offset += _HEADER.size
            name = buf[offset : offset + length].rstrip(b"\0").decode(errors="surrogateescape")
            offset += length
            if mask & c.IN_IGNORED:
                path = self._by_wd.pop(wd, None)
                if path is not None and self._by_path.get(path) == wd:
                    del self._by_path[path]
            yield Event(self._by_wd.get(wd, ""), name, mask)

    def _drop(self, path: str) -> None:
        wd = self._by_path.pop(path)
        self._by_wd.pop(wd, None)
        try:
            inotify.calls.inotify_rm_watch(self._fd, wd)
        except inotify.calls.InotifyError:
            pass  # already gone with its directory


def _deepest_existing(path: str) -> str:
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path
