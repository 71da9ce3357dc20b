"""Which resources reach which node: a node one resource hands to one container at a time
is no other resource's, at every moment, whatever appeared since the configuration was
checked.

Patterns overlap (`/dev/ttyUSB*` and `/dev/ttyUSB[0-9]`), a shareable path names a node a
pattern matches (`/dev/ttyUSB5`), a link points at another resource's node
(`/dev/serial/by-id/*`): which nodes two entries share depends on what udev made, and
changes with every hot-plug. So each table asks here whenever it judges a node (one that
appeared, changed, or is due again): does another configured resource reach this node now,
as one of its pattern's units (exclusive) or at all while ours is? Then neither serves it,
one ERROR names both resources and the node, and the other resource is told to judge it
again at once. When one of them no longer reaches it, the other is told, and serves it.

What another resource reaches is read from its configuration and the disk (a listing of
its pattern's directory and a stat per match, its path, its companions), not from its
table, which may not have looked yet: the first resource to see a new node already knows.
Each reach is read once per look of the table that asks. The IDs every pattern resource
has given out live here too (`ids`): they outlast a reload's new table.
"""

import os
import stat
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from atedevd.config import Device, Pattern, host_path
from atedevd.devices import policy
from atedevd.record import Record

Reach = Dict[int, List[Tuple[str, bool]]]  # st_rdev -> (path pods see, handed to one container at a time)


class Rival(Record):
    """Another resource that reaches a node we judged."""

    resource: str
    path: str  # its way to the node
    news: bool  # not said before: the table says `text` as an ERROR (else at DEBUG)
    text: str  # names both resources and the node


class Claims:
    """Every configured resource's reach, for the tables of one Node (or of one `check`)."""

    def __init__(self, poke: Optional[Callable[[str], None]] = None) -> None:
        self._poke = poke or (lambda name: None)  # the resource must look again (Resource.nodes_may_have_changed)
        self._devices: Dict[str, Device] = {}
        self._patterns: Dict[str, Pattern] = {}
        self._dev_root = "/dev"
        self._tables: Dict[str, Any] = {}  # resource -> its table (recheck)
        self._ids: Dict[str, Dict[str, str]] = {}  # resource -> ID -> the path it meant first
        self._open: Dict[int, Set[str]] = {}  # st_rdev -> the resources in a conflict over it
        self._said: Dict[int, Set[FrozenSet[str]]] = {}  # st_rdev -> the pairs whose conflict over it was said
        self._memo: Dict[str, Reach] = {}

    def configure(self, devices: Iterable[Device], dev_root: str) -> None:
        """The devices configured now (at start, on every reload): conflicts of a resource that
        is gone end, and its rivals are told."""
        self._devices = {d.resource: d for d in devices}
        self._patterns = {d.resource: Pattern(d.path, dev_root) for d in self._devices.values() if d.pattern}
        self._dev_root = dev_root
        self._memo.clear()
        for name in list(self._tables):
            if name not in self._devices:
                self.leave(name)

    def join(self, name: str, table) -> None:
        """`table` is `name`'s now (a new one after a reload changed the device)."""
        self._tables[name] = table

    def leave(self, name: str) -> None:
        self._tables.pop(name, None)
        for rdev in [r for r, names in self._open.items() if name in names]:
            self.release(name, rdev)

    def ids(self, name: str) -> Dict[str, str]:
        """The IDs `name` has given out this run, each to the path it meant first."""
        return self._ids.setdefault(name, {})

    def new_look(self) -> None:
        """A table begins judging: what others reach is read afresh."""
        self._memo.clear()

    def rival(self, name: str, node: policy.DeviceNode, exclusive: bool, path: str) -> Optional[Rival]:
        """The other resource that reaches `node` now, where one of the two hands it to one
        container at a time (`exclusive`: `name` does, as `path`), and whose policy would
        serve it; None when `name` may serve it."""
        rdev = os.makedev(node.major, node.minor)
        for other in sorted(self._devices):
            if other == name:
                continue
            ways = [way for way, alone in self._reach(other).get(rdev, ()) if exclusive or alone]
            if not ways or policy.refused(policy.judge(node), self._devices[other].allow_host_access):
                continue
            pair = frozenset((name, other))
            said = self._said.setdefault(rdev, set())
            news = pair not in said
            said.add(pair)
            self._open.setdefault(rdev, set()).update((name, other))
            if news:  # it may serve the node now, or be about to: it judges it again at once
                self._tell(other, rdev)
            text = (f"{node.describe()} is reached by {name} as {path} and by {other} as {ways[0]}: a node handed to "
                    f"one container at a time is no other resource's, so neither serves it until only one reaches it")
            return Rival(other, ways[0], news, text)
        return None

    def release(self, name: str, rdev: int) -> None:
        """`name` no longer reaches node `rdev` as a conflict (it is gone, or another's no more):
        the others in the conflict judge it again."""
        names = self._open.get(rdev)
        if not names or name not in names:
            return
        names.discard(name)
        said = self._said.get(rdev, set())
        said -= {pair for pair in said if name in pair}
        if not said:
            self._said.pop(rdev, None)
        for other in names:
            self._tell(other, rdev)
        if len(names) <= 1:
            del self._open[rdev]

    def _tell(self, name: str, rdev: int) -> None:
        table = self._tables.get(name)
        if table is not None:
            table.recheck(rdev)
            self._poke(name)

    def _reach(self, name: str) -> Reach:
        if name not in self._memo:
            self._memo[name] = reach(self._devices[name], self._dev_root, self._patterns.get(name))
        return self._memo[name]


def reach(device: Device, dev_root: str, pattern: Optional[Pattern] = None) -> Reach:
    """Every character device `device` reaches now, every link followed: its path (or its
    pattern's matches, each handed to one container at a time) and its companions."""
    out: Reach = {}
    companions = []
    for path in device.companions:
        rdev = _char(host_path(path, dev_root))
        if rdev is not None:
            out.setdefault(rdev, []).append((path, False))
            companions.append(rdev)
    if not device.pattern:
        rdev = _char(device.host_path(dev_root))
        if rdev is not None:
            out.setdefault(rdev, []).append((device.path, False))
        return out
    pattern = pattern or Pattern(device.path, dev_root)
    for name in pattern.names():
        path = pattern.path_of(name)
        if path in device.companions:
            continue
        rdev = _char(pattern.host_path_of(name))
        if rdev is not None:
            out.setdefault(rdev, []).append((path, rdev not in companions))
    return out


def _char(path: str) -> Optional[int]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_rdev if stat.S_ISCHR(st.st_mode) else None
