"""What kubelet is told of one resource at one moment: an immutable snapshot, one kind per kind of table.

gRPC threads read a snapshot and never share mutable state with the loop. It carries, for each
Healthy unit, the nodes a grant makes (`NodeGrant`: the path pods see and the numbers its table
judged), which Allocate answers with, the CDI spec writes, and the invariants hold against the
node: one look's numbers, never a second lookup.
"""

import threading
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from atedevd.api import pb
from atedevd.config import Device
from atedevd.record import Record

HEALTHY = "Healthy"


UNHEALTHY = "Unhealthy"


class NodeGrant(Record):
    """One node a grant makes in a container: the path pods see and the numbers judged (the CDI
    spec names these; host_mode widens only the node that has them)."""

    path: str
    major: int
    minor: int


def unit_ids(device: Device) -> tuple:
    """`kvm-0` … `kvm-4095`: the units kubelet counts and hands out."""
    return tuple(device.unit_id(i) for i in range(device.count))


class Unit(Record):
    """One unit of a pattern resource as kubelet is told of it: one node, one container."""

    id: str
    path: str  # the node pods get, as they see it
    healthy: bool
    numa: Tuple[int, ...] = ()  # NUMA nodes sysfs places it on; () when it does not say
    nodes: Tuple[NodeGrant, ...] = ()  # while healthy: its node and the companions, with the numbers judged


class Snapshot:
    """What ListAndWatch sends for one resource at one moment; never changed once made. One kind
    per kind of table: `SharedSnapshot` (a node's `count` interchangeable units), `UnitSnapshot`
    (a pattern's units, a node each). The nodes a grant makes come from here, with the numbers
    the table judged: what Allocate names, the CDI spec writes and kubelet counts are one look's.

    The message (1 ms for 1024 units) and the set of IDs are made when first needed, on
    whichever thread needs them first: a start's first Register does not wait for them,
    kubelet asks for them only after it."""

    __slots__ = ("version", "healthy", "device", "_ids", "_response", "_lock")

    def __init__(self, device: Device, healthy: bool, version: int, built=None) -> None:
        self.version = version
        self.healthy = healthy  # at least one unit is Healthy
        self.device = device
        self._ids: Optional[FrozenSet[str]]
        self._response: Optional[pb.ListAndWatchResponse]
        self._ids, self._response = built or (None, None)
        self._lock = threading.Lock()

    @property
    def ids(self) -> FrozenSet[str]:
        return self._made()[0]

    @property
    def response(self) -> pb.ListAndWatchResponse:
        return self._made()[1]

    @property
    def units(self) -> int:
        """How many units kubelet is told of."""
        raise NotImplementedError

    @property
    def healthy_units(self) -> int:
        """How many of them are Healthy: what kubelet should count as allocatable."""
        raise NotImplementedError

    def again(self) -> "Snapshot":
        """An equal snapshot that is not this one: a stream sends it as news."""
        raise NotImplementedError

    def grants(self) -> Dict[Optional[str], Tuple[NodeGrant, ...]]:
        """The nodes each healthy grant makes: the shareable node's (key None), or each healthy
        unit's (its ID), companions last, with the numbers judged."""
        raise NotImplementedError

    def refusal(self, ids: Iterable[str], earlier: Callable[[str], Any]) -> Optional[str]:
        """Why IDs kubelet asks for (every one of them known) are not granted now, or None.
        `earlier`: how a list kubelet may still hold had an ID (atedevd/kubelet/lists.py)."""
        raise NotImplementedError

    def paths(self, ids: Iterable[str]) -> List[str]:
        """The nodes a container gets for these IDs, as pods see them (companions not included)."""
        raise NotImplementedError

    def listed_healthy(self, device_id: str) -> Any:
        """What this list says of `device_id` when it lists it Healthy (itself, or the Unit); None otherwise."""
        raise NotImplementedError

    def numa(self, device_id: str) -> Tuple[int, ...]:
        return ()

    def _list(self) -> Tuple[Iterable[str], pb.ListAndWatchResponse]:
        raise NotImplementedError

    def _made(self) -> Tuple[FrozenSet[str], pb.ListAndWatchResponse]:
        with self._lock:
            if self._ids is None:
                ids, response = self._list()
                self._ids, self._response = frozenset(ids), response
            return self._ids, self._response


class SharedSnapshot(Snapshot):
    """`count` interchangeable units of one node: Healthy together or not at all."""

    __slots__ = ("nodes",)

    def __init__(self, device: Device, healthy: bool, version: int, nodes: Tuple[NodeGrant, ...] = (),
                 built=None) -> None:
        super().__init__(device, healthy, version, built)
        self.nodes = nodes if healthy else ()  # the node and its companions, as judged

    @property
    def units(self) -> int:
        return self.device.count

    @property
    def healthy_units(self) -> int:
        return self.device.count if self.healthy else 0

    def again(self) -> "SharedSnapshot":
        return SharedSnapshot(self.device, self.healthy, self.version, self.nodes,
                              (self._ids, self._response) if self._ids is not None else None)

    def grants(self) -> Dict[Optional[str], Tuple[NodeGrant, ...]]:
        return {None: self.nodes} if self.healthy and self.nodes else {}

    def refusal(self, ids: Iterable[str], earlier: Callable[[str], Any]) -> Optional[str]:
        if self.healthy:
            return None
        missing = " (or a companion node is missing)" if self.device.companions else ""
        return f"{self.device.resource}: {self.device.path} is not present on this node{missing}"

    def paths(self, ids: Iterable[str]) -> List[str]:
        return [self.device.path]  # any number of units of one device still mean one device node

    def listed_healthy(self, device_id: str) -> Any:
        return self if self.healthy and device_id in self.ids else None

    def _list(self) -> Tuple[Iterable[str], pb.ListAndWatchResponse]:
        response = pb.ListAndWatchResponse()
        add = response.devices.add  # half the time of a list of pb.Device
        ids = unit_ids(self.device)
        health = HEALTHY if self.healthy else UNHEALTHY
        for i in ids:
            add(ID=i, health=health)
        return ids, response


class UnitSnapshot(Snapshot):
    """A pattern's units, each one node with its own health and NUMA nodes."""

    __slots__ = ("by_id",)

    def __init__(self, device: Device, version: int, units: Tuple[Unit, ...], built=None) -> None:
        super().__init__(device, any(u.healthy for u in units), version, built)
        self.by_id: Dict[str, Unit] = {u.id: u for u in units}

    @property
    def units(self) -> int:
        return len(self.by_id)

    @property
    def healthy_units(self) -> int:
        return sum(u.healthy for u in self.by_id.values())

    def again(self) -> "UnitSnapshot":
        return UnitSnapshot(self.device, self.version, tuple(self.by_id.values()),
                            (self._ids, self._response) if self._ids is not None else None)

    def grants(self) -> Dict[Optional[str], Tuple[NodeGrant, ...]]:
        return {u.id: u.nodes for u in self.by_id.values() if u.healthy and u.nodes}

    def refusal(self, ids: Iterable[str], earlier: Callable[[str], Any]) -> Optional[str]:
        ids = list(dict.fromkeys(ids))
        gone = [i for i in ids if i not in self.by_id]
        if gone:  # in a list kubelet may still hold, not in ours
            return _left(earlier(gone[0]), self.device.resource)
        down = [self.by_id[i] for i in ids if not self.by_id[i].healthy]
        if down:
            named = ", ".join(f"{u.id[:80]!r} ({u.path})" for u in down[:3])
            return f"{self.device.resource}: unit {named} is not healthy on this node"
        return None

    def paths(self, ids: Iterable[str]) -> List[str]:
        return [self.by_id[i].path for i in dict.fromkeys(ids)]

    def listed_healthy(self, device_id: str) -> Any:
        unit = self.by_id.get(device_id)
        return unit if unit is not None and unit.healthy else None

    def numa(self, device_id: str) -> Tuple[int, ...]:
        unit = self.by_id.get(device_id)
        return unit.numa if unit is not None else ()

    def _list(self) -> Tuple[Iterable[str], pb.ListAndWatchResponse]:
        response = pb.ListAndWatchResponse()
        add = response.devices.add
        for u in self.by_id.values():
            d = add(ID=u.id, health=HEALTHY if u.healthy else UNHEALTHY)
            if u.numa:
                d.topology.nodes.extend(pb.NUMANode(ID=n) for n in u.numa)
        return tuple(self.by_id), response


def _left(unit, resource: str) -> str:
    """Why an ID of a pattern's unit kubelet may still hold as Healthy is not granted."""
    what = f"unit {unit.id!r} ({unit.path})" if hasattr(unit, "path") else "the unit"
    return (f"{resource}: {what} left the device list (its node is gone, or no longer this resource's) "
            "after kubelet was last sent it; kubelet has not yet taken the new list")
