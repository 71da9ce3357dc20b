"""The device table of one resource: presence on the node, unit IDs, health snapshots, and
where a node sits (its NUMA node and PCI address, from sysfs) as `atedevd check` lists it.

A device node is advertised as `count` shareable units; a pattern path
(`/dev/ttyUSB*`) as one unit per matching node, each handed to one container.
Presence is read from the node (a character device under the dev root, every
symlink followed, as the container runtime follows them); what kubelet sees is
an immutable `Snapshot`, so gRPC threads never share mutable state with the loop.
The loop owns one table per resource (`resource.node_table()`): it looks at the nodes on every
wake-up and says what changed.

The node stays the node: `NodeWatch` remembers the major:minor first served
and holds a node with other numbers at that path as not present (Unhealthy)
until the first one is back or a reload accepts the new one. A container is
given whatever the path resolves to when it is created, so a renumbered or
swapped node would otherwise reach pods that were promised the first one. A
pattern's units keep that rule each, and numbers once served as one unit are
that unit's while the daemon runs: a container keeps its device-cgroup rule by
number, so another node given those numbers later (a VFIO group made anew, an
adapter re-plugged) is not handed to a second pod until a reload.
"""

import logging
import os
import stat
import threading
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from atedevd import policy
from atedevd.api import pb
from atedevd.config import Device, file_type, host_path
from atedevd.record import Record

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
PRESENT = "present"
MISSING = "missing"


class Presence(Record):
    """What is at a device's path now: `state` is PRESENT or why not."""

    state: str
    node: Optional[policy.DeviceNode] = None
    refusal: Optional[policy.Refusal] = None  # a rule matched (granted anyway when opted in)


def presence(device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT) -> Presence:
    """PRESENT for a character device the policy lets pods have; otherwise why not."""
    path = device.host_path(dev_root)
    try:
        node = policy.look(path, sys_root)  # follows symlinks, as the container runtime does
        if node is None:
            return Presence(f"a {file_type(os.stat(path).st_mode)}, not a character device")
    except FileNotFoundError:
        return Presence(MISSING)
    except OSError as e:
        return Presence(f"unreadable ({e.strerror})")
    found = policy.judge(node)  # a block device is refused whatever the configuration says
    if found is not None and policy.refused(found, device.allow_host_access):
        return Presence(policy.refusal_text(found), node, found)
    return Presence(PRESENT, node, found)


class Change(Record):
    """A device's presence changed: what to tell the journal, and whether it is served Healthy."""

    present: bool
    level: int
    event: str
    message: str
    device: Optional[str] = None  # the node it is about (ATEDEVD_DEVICE); None: the device's path


def stat_key(path: str) -> tuple:
    """What one stat() of a node (every link followed) says: its type, numbers and identity
    (a node made anew under the same name, or a link led elsewhere, is another key), or the
    error."""
    try:
        st = os.stat(path)
    except OSError as e:
        return ("error", e.errno)
    return (stat.S_IFMT(st.st_mode), st.st_rdev, st.st_dev, st.st_ino)


def is_node(key: tuple, numbers: Optional[Tuple[int, int]]) -> bool:
    """`key` (stat_key) is a character device with these numbers."""
    return numbers is not None and key[0] == stat.S_IFCHR and key[1] == os.makedev(*numbers)


def link_directories(path: str) -> Tuple[str, ...]:
    """The directories a chain of symlinks at `path` leads through, the one its node sits in
    last: a node replaced there (udev's by-id link stays, its target is made anew) changes
    what the path reaches without an event in the link's own directory."""
    found: List[str] = []
    for _ in range(40):  # the kernel's limit on links in one lookup
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                break
            target = os.readlink(path)
        except OSError:
            break
        path = os.path.join(os.path.realpath(os.path.dirname(path)), target)
        found.append(os.path.realpath(os.path.dirname(path)))
    return tuple(dict.fromkeys(found))


class NodeWatch:
    """What the loop knows of one device's node between two looks: the
    major:minor first served, and the last state reported.

    With `claims` (atedevd/claims.py), a node another resource hands out one container at
    a time (or, for `exclusive`, any node another resource reaches) is "claimed" and not
    served, and judged again at every look until only one of them reaches it."""

    def __init__(self, claims=None, resource: str = "", exclusive: bool = False) -> None:
        self.first: Optional[Tuple[int, int]] = None
        self._last: Optional[tuple] = None
        self._stat: Optional[tuple] = None  # what one stat() saw last: the loop looks on every wake-up
        self.via: Tuple[str, ...] = ()  # the directories its link leads through (link_directories)
        self.rival: Optional[Any] = None  # claims.Rival while another resource reaches the node
        self.numbers: Optional[Tuple[int, int]] = None  # the node's, as last judged
        self._claims, self._resource, self._exclusive = claims, resource, exclusive

    def forget(self) -> None:
        """A reload: the node at the path now is accepted as the device's (the
        configuration check has judged it)."""
        self.first = None
        self._stat = None

    def recheck(self) -> None:
        """Judge the node in full at the next look (another resource reaches it now)."""
        self._stat = None

    def look(self, device: Device, dev_root: str, advertised: bool, sys_root: str = policy.SYS_ROOT) -> Optional[Change]:
        """The change since the last look, or None.

        One stat() when nothing changed (6 us a look here, against 50 us for the
        full one: symlinks, sysfs, the policy), which runs only when the node's
        type or numbers changed. A driver that takes over a node's numbers has
        its node made anew by udev, so it is looked at in full.
        """
        where = device.host_path(dev_root)
        seen = stat_key(where)
        if seen == self._stat and self.rival is None:
            return None
        self._stat = seen
        self.via = link_directories(where)
        found = presence(device, dev_root, sys_root)
        numbers = (found.node.major, found.node.minor) if found.node else None
        state = found.state
        rival, self.rival = self.rival, None
        if state == PRESENT and self._claims is not None:  # before our own rule: released only when not reached
            self._claims.new_look()
            self.rival = self._claims.rival(self._resource, found.node, self._exclusive, device.path)
            if self.rival is not None:
                state = "claimed"
        if state == PRESENT and self.first is not None and numbers != self.first:
            state = "changed"
        if rival is not None and self.rival is None and self.numbers is not None:
            self._claims.release(self._resource, os.makedev(*self.numbers))
        self.numbers = numbers
        if state == PRESENT and self.first is None:  # the first node served (again after a reload)
            self.first = numbers
        key = (state, numbers)
        if key == self._last:
            return None
        first_look, self._last = self._last is None, key
        rival = self.rival
        if state == "claimed" and rival is not None:
            return Change(False, logging.ERROR if rival.news else logging.DEBUG, "device-conflict",
                          f"{rival.text}; {'units are Unhealthy' if advertised else 'not advertised'}")
        what = found.node.describe() if found.node is not None else "not a node"
        if state == PRESENT:
            if found.refusal is not None:  # opted in: said at every start and whenever it appears
                return Change(True, logging.WARNING, "device-host-access",
                              f"{device.path} gives pods the host, granted because allow_host_access = true: {found.refusal}")
            if first_look:
                return Change(True, logging.DEBUG, "device-present", f"{device.path} is present ({what})")
            return Change(True, logging.INFO, "device-present",
                          f"{device.path} is present again" if advertised else f"{device.path} appeared; advertising it")
        if state == "changed":
            return Change(False, logging.ERROR, "device-changed",
                          f"{where} is now {what}, not the {_numbers(self.first)} first served; "
                          f"units are Unhealthy until {_numbers(self.first)} is back or a reload accepts the new node")
        if found.refusal is not None:
            return Change(False, logging.ERROR, "device-refused",
                          f"{device.path}: {state}; {'units are Unhealthy' if advertised else 'not advertised'}")
        if state == MISSING:
            return Change(False, logging.INFO if first_look else logging.WARNING, "device-missing",
                          f"{device.path} is missing ({where}); "
                          f"{'units are Unhealthy' if advertised else 'not advertised until it appears'}")
        return Change(False, logging.WARNING, "device-missing", f"{where} is {state}; treating it as missing")


def _numbers(numbers: Optional[Tuple[int, int]]) -> str:
    return f"{numbers[0]}:{numbers[1]}" if numbers else "?"


def unit_ids(device: Device) -> tuple:
    """`kvm-0` … `kvm-4095`: the units kubelet counts and hands out."""
    return tuple(device.unit_id(i) for i in range(device.count))


class Snapshot:
    """What ListAndWatch sends for one resource at one moment; never changed once made.

    Shareable units (`units` is None when made): the message of `count` devices (1 ms
    for 1024) and the set of IDs are made when first needed, on whichever thread needs
    them first: a start's first Register does not wait for them, kubelet asks for them
    only after it. A pattern resource's units are given, each with its own health and
    NUMA nodes. `healthy`: at least one unit is Healthy."""

    __slots__ = ("version", "healthy", "by_id", "_device", "_ids", "_response", "_lock")

    def __init__(self, device: Device, healthy: bool, version: int, _built=None, units: Optional[tuple] = None) -> None:
        self.version = version
        self.by_id: Optional[dict] = None if units is None else {u.id: u for u in units}  # ID -> patterns.Unit
        self.healthy = healthy if units is None else any(u.healthy for u in units)
        self._device = device
        self._ids: Optional[FrozenSet[str]]
        self._response: Optional[pb.ListAndWatchResponse]
        self._ids, self._response = _built or (None, None)
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
        return self._device.count if self.by_id is None else len(self.by_id)

    @property
    def healthy_units(self) -> int:
        """How many of them are Healthy: what kubelet should count as allocatable."""
        if self.by_id is None:
            return self._device.count if self.healthy else 0
        return sum(u.healthy for u in self.by_id.values())

    def again(self) -> "Snapshot":
        """An equal snapshot that is not this one: a stream sends it as news."""
        units = None if self.by_id is None else tuple(self.by_id.values())
        return Snapshot(self._device, self.healthy, self.version,
                        (self._ids, self._response) if self._ids is not None else None, units)

    def _made(self) -> Tuple[FrozenSet[str], pb.ListAndWatchResponse]:
        with self._lock:
            if self._ids is None:
                response = pb.ListAndWatchResponse()
                add = response.devices.add  # half the time of a list of pb.Device
                if self.by_id is None:
                    ids = unit_ids(self._device)
                    health = HEALTHY if self.healthy else UNHEALTHY
                    for i in ids:
                        add(ID=i, health=health)
                else:
                    ids = tuple(self.by_id)
                    for u in self.by_id.values():
                        d = add(ID=u.id, health=HEALTHY if u.healthy else UNHEALTHY)
                        if u.numa:
                            d.topology.nodes.extend(pb.NUMANode(ID=n) for n in u.numa)
                self._ids, self._response = frozenset(ids), response
            return self._ids, self._response


# --- the loop's table of one resource ------------------------------------------------------

def directories(device: Device, dev_root: str) -> List[str]:
    """The directories whose events can change what the resource serves (its nodes come and go there)."""
    return list(dict.fromkeys(os.path.dirname(host_path(p, dev_root)) for p in (device.path, *device.companions)))


class _Companions:
    """The nodes every unit brings along (VFIO: /dev/vfio/vfio). Each is judged as a
    device path is and keeps its first node; while one is not there, no unit is Healthy."""

    def __init__(self, device: Device, dev_root: str, sys_root: str, claims=None) -> None:
        self._dev_root, self._sys_root = dev_root, sys_root
        self._nodes = [(Device(device.resource, path, allow_host_access=device.allow_host_access),
                        NodeWatch(claims, device.resource)) for path in device.companions]
        self._present: Dict[str, bool] = {}

    @property
    def ok(self) -> bool:
        return all(self._present.get(d.path) for d, _ in self._nodes)

    @property
    def numbers(self) -> set:
        """The companions' major:minor (a match with these is a companion, never a unit)."""
        return {w.first for _, w in self._nodes if w.first is not None}

    def look(self) -> Tuple[List[Change], bool]:
        changes: List[Change] = []
        before = self.ok
        for dev, watch in self._nodes:
            change = watch.look(dev, self._dev_root, True, self._sys_root)
            if change is not None:
                changes.append(change._replace(message="companion " + change.message, device=dev.path))
                self._present[dev.path] = change.present
        return changes, self.ok != before

    def forget(self) -> None:
        for _, watch in self._nodes:
            watch.forget()

    def recheck(self, rdev: int) -> None:
        for _, watch in self._nodes:
            if watch.numbers is not None and os.makedev(*watch.numbers) == rdev:
                watch.recheck()

    @property
    def via(self) -> Tuple[str, ...]:
        return tuple(d for _, watch in self._nodes for d in watch.via)

    def served(self) -> List["Served"]:
        return [Served(None, dev.path, dev.host_path(self._dev_root), watch.first, "companion") for dev, watch in self._nodes]

    def listing(self) -> list:
        return [row(dev, self._dev_root, self._sys_root, "companion", watch.rival) for dev, watch in self._nodes]


class SharedTable:
    """One node advertised as `count` interchangeable units (the default, `/dev/kvm`)."""

    def __init__(self, device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT, claims=None) -> None:
        self.device, self._dev_root, self._sys_root = device, dev_root, sys_root
        self._node = NodeWatch(claims, device.resource)
        self._present: Optional[bool] = None
        self._companions = _Companions(device, dev_root, sys_root, claims) if device.companions else None
        self.advertised = False  # once its node was present; then kept served (Unhealthy while missing)
        self.healthy = False
        self._directories = frozenset(map(os.path.normpath, directories(device, dev_root)))
        if claims is not None:
            claims.join(device.resource, self)

    def look(self) -> Tuple[List[Change], bool]:
        """What to tell the journal since the last look, and whether what kubelet is sent changed."""
        changes: List[Change] = []
        change = self._node.look(self.device, self._dev_root, self.advertised, self._sys_root)
        if change is not None:
            changes.append(change)
            self._present = change.present
            self.advertised |= change.present
        if self._companions is not None:
            more, _ = self._companions.look()
            changes += more
        healthy = bool(self._present) and (self._companions is None or self._companions.ok)
        changed, self._first = self._first or healthy != self.healthy, False  # the first look is news
        self.healthy = healthy
        return changes, changed

    _first = True

    def snapshot(self, version: int) -> Snapshot:
        return Snapshot(self.device, self.healthy, version)

    def forget(self) -> None:
        """A reload: the nodes there now are accepted (the configuration check has judged them)."""
        self._node.forget()
        if self._companions is not None:
            self._companions.forget()

    def recheck(self, rdev: int) -> None:
        """Another resource reaches node `rdev` now, or no longer: judge it again at the next look."""
        if self._node.numbers is not None and os.makedev(*self._node.numbers) == rdev:
            self._node.recheck()
        if self._companions is not None:
            self._companions.recheck(rdev)

    def directories(self) -> FrozenSet[str]:
        """Where events can change what it serves: its paths' directories, and those their links lead through."""
        via = self._node.via + (self._companions.via if self._companions else ())
        return self._directories.union(via) if via else self._directories

    def served(self) -> List["Served"]:
        """Its node and companions as served (for the invariants' check)."""
        node = Served(None, self.device.path, self.device.host_path(self._dev_root), self._node.first, "node")
        return [node] + (self._companions.served() if self._companions else [])

    def listing(self) -> list:
        """The device's node and its companions, for `atedevd check`."""
        rows = [row(self.device, self._dev_root, self._sys_root, "node", self._node.rival)]
        return rows + (self._companions.listing() if self._companions else [])


# --- a node as `atedevd check` lists it ----------------------------------------------------

class NodeRow(Record):
    """One node of a resource as `atedevd check` lists it."""

    id: Optional[str]  # the unit's ID; None for a node that is no unit (refused, held, a companion)
    path: str  # as pods see it
    host_path: str
    role: str  # "unit", "match" (matched, not a unit), "node" (a shareable device's), "companion"
    device_number: Optional[str]  # MAJOR:MINOR
    numa: Tuple[int, ...]
    pci: Tuple[str, ...]
    present: bool
    allowed: bool  # the device policy lets pods have it
    state: str  # "ok", or why it is not served


class Served(Record):
    """A node as a table serves it: what the invariants' check compares with the node there."""

    id: Optional[str]  # the unit's ID (a pattern's); None: a shareable device's node, a companion
    path: str
    host_path: str
    first: Optional[Tuple[int, int]]  # the numbers first served; None: not served yet
    role: str  # "unit", "node", "companion"


def row(device: Device, dev_root: str, sys_root: str, role: str, rival=None) -> NodeRow:
    """A node judged on its own (a shareable device's, a companion); `rival`: another resource
    reaches it too (claims.Rival)."""
    found = presence(device, dev_root, sys_root)
    numa, pci = placement(found.node, sys_root) if found.node is not None else ((), ())
    refused = found.refusal is not None and found.state != PRESENT
    state = "ok" if found.state == PRESENT else found.state
    if rival is not None and found.state == PRESENT:
        state = f"claimed: {rival.resource} reaches it too, as {rival.path}"
    return NodeRow(None, device.path, device.host_path(dev_root), role, found.node.numbers if found.node else None,
                   numa, pci, found.state != MISSING, not refused, state)


def placement(node: policy.DeviceNode, sys_root: str = policy.SYS_ROOT) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """(NUMA nodes, PCI addresses) of the hardware behind a node, as sysfs tells them.

    A VFIO group (`/dev/vfio/N`, sysfs class vfio) has no device of its own in sysfs:
    its devices are /sys/kernel/iommu_groups/N/devices/<PCI address>, each with a
    `numa_node`. Any other node's device is /sys/dev/char/MAJ:MIN/device; the nearest
    ancestor with a `numa_node` (a USB serial adapter's is its host controller's) says.
    -1 (no NUMA information) and an unreadable file say nothing."""
    if node.subsystem == "vfio" and node.name and node.name.startswith("vfio/") and node.name[5:].isdigit():
        group = os.path.join(sys_root, "kernel", "iommu_groups", node.name[5:], "devices")
        try:
            pci = tuple(sorted(os.listdir(group)))
        except OSError:
            return (), ()
        numa = {_read_numa(os.path.join(group, addr, "numa_node")) for addr in pci}
        return tuple(sorted(n for n in numa if n is not None)), pci
    entry = os.path.join(sys_root, "dev", node.kind, f"{node.major}:{node.minor}")
    key = (entry, policy.device_of(entry))  # read once per device entry, as its class is (policy.py)
    found = _PLACED.get(key)
    if found is None:
        found = _numa_of(sys_root, entry)
        if key[1] is not None:
            if len(_PLACED) >= 4096:
                _PLACED.clear()
            _PLACED[key] = found
    return found, ()


_PLACED: Dict[Tuple[str, Optional[str]], Tuple[int, ...]] = {}


def _numa_of(sys_root: str, entry: str) -> Tuple[int, ...]:
    devices = os.path.join(sys_root, "devices")
    here = os.path.realpath(os.path.join(entry, "device"))
    while here.startswith(devices + "/"):
        n = _read_numa(os.path.join(here, "numa_node"))
        if n is not None or os.path.exists(os.path.join(here, "numa_node")):
            return (n,) if n is not None else ()
        here = os.path.dirname(here)
    return ()


def _read_numa(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            n = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return n if n >= 0 else None
