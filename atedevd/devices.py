"""The device table of one resource: presence on the node, unit IDs, health snapshots.

A device node is advertised as `count` shareable units; a pattern path
(`/dev/ttyUSB*`) as one unit per matching node, each handed to one container.
Presence is read from the node (a character device under the dev root, every
symlink followed, as the container runtime follows them); what kubelet sees is
an immutable `Snapshot`, so gRPC threads never share mutable state with the loop.
The loop owns one table per resource (`table()`): it looks at the nodes on every
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
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

from atedevd import policy
from atedevd.api import pb
from atedevd.config import Device, file_type, host_path, refusal_text

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
PRESENT = "present"
MISSING = "missing"


class Presence(NamedTuple):
    """What is at a device's path now: `state` is PRESENT or why not."""

    state: str
    node: Optional[policy.Node] = None
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
    if policy.refused(found, device.allow_host_access):
        return Presence(refusal_text(found), node, found)
    return Presence(PRESENT, node, found)


class Change(NamedTuple):
    """A device's presence changed: what to tell the journal, and whether it is served Healthy."""

    present: bool
    level: int
    event: str
    message: str
    device: Optional[str] = None  # the node it is about (ATEDEVD_DEVICE); None: the device's path


class NodeWatch:
    """What the loop knows of one device's node between two looks: the
    major:minor first served, and the last state reported."""

    def __init__(self) -> None:
        self.first: Optional[Tuple[int, int]] = None
        self._last: Optional[tuple] = None
        self._stat: Optional[tuple] = None  # what one stat() saw last: the loop looks on every wake-up

    def forget(self) -> None:
        """A reload: the node at the path now is accepted as the device's (the
        configuration check has judged it)."""
        self.first = None
        self._stat = None

    def look(self, device: Device, dev_root: str, advertised: bool, sys_root: str = policy.SYS_ROOT) -> Optional[Change]:
        """The change since the last look, or None.

        One stat() when nothing changed (6 us a look here, against 50 us for the
        full one: symlinks, sysfs, the policy), which runs only when the node's
        type or numbers changed. A driver that takes over a node's numbers has
        its node made anew by udev, so it is looked at in full.
        """
        try:
            st = os.stat(device.host_path(dev_root))
            seen: tuple = (stat.S_IFMT(st.st_mode), st.st_rdev)
        except OSError as e:
            seen = ("error", e.errno)
        if seen == self._stat:
            return None
        self._stat = seen
        found = presence(device, dev_root, sys_root)
        numbers = (found.node.major, found.node.minor) if found.node else None
        state = found.state
        if state == PRESENT:
            if self.first is None:  # the first node served (again after a reload)
                self.first = numbers
            elif numbers != self.first:
                state = "changed"
        key = (state, numbers)
        if key == self._last:
            return None
        first_look, self._last = self._last is None, key
        where = device.host_path(dev_root)
        if state == PRESENT:
            if found.refusal is not None:  # opted in: said at every start and whenever it appears
                return Change(True, logging.WARNING, "device-host-access",
                              f"{device.path} gives pods the host, granted because allow_host_access = true: {found.refusal}")
            if first_look:
                return Change(True, logging.DEBUG, "device-present", f"{device.path} is present ({found.node.describe()})")
            return Change(True, logging.INFO, "device-present",
                          f"{device.path} is present again" if advertised else f"{device.path} appeared; advertising it")
        if state == "changed":
            return Change(False, logging.ERROR, "device-changed",
                          f"{where} is now {found.node.describe()}, not the {_numbers(self.first)} first served; "
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


class Unit(NamedTuple):
    """One unit of a pattern resource as kubelet is told of it: one node, one container."""

    id: str
    path: str  # the node pods get, as they see it
    healthy: bool
    numa: Tuple[int, ...] = ()  # NUMA nodes sysfs places it on; () when it does not say


class Snapshot:
    """What ListAndWatch sends for one resource at one moment; never changed once made.

    Shareable units (`units` is None when made): the message of `count` devices (1 ms
    for 1024) and the set of IDs are made when first needed, on whichever thread needs
    them first: a start's first Register does not wait for them, kubelet asks for them
    only after it. A pattern resource's units are given, each with its own health and
    NUMA nodes. `healthy`: at least one unit is Healthy."""

    __slots__ = ("version", "healthy", "by_id", "_device", "_ids", "_response", "_lock")

    def __init__(self, device: Device, healthy: bool, version: int, _built=None,
                 units: Optional[Tuple[Unit, ...]] = None) -> None:
        self.version = version
        self.by_id: Optional[Dict[str, Unit]] = None if units is None else {u.id: u for u in units}
        self.healthy = healthy if units is None else any(u.healthy for u in units)
        self._device = device
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


def preferred(available, must_include, size: int, numa: Callable[[str], Tuple[int, ...]]) -> List[str]:
    """Which `size` of the `available` unit IDs to give one container, `must_include` first:
    all from one NUMA node when one node has enough (the one the must-includes sit on
    first, then the one with the fewest to spare, which keeps larger nodes whole for larger
    requests); otherwise from as few nodes as it can, units sysfs places nowhere last.
    Within a node, by ID. Kubelet's own order is a map's: nothing to keep."""
    size = max(int(size), 0)
    chosen = list(dict.fromkeys(must_include))[:size]
    taken = set(chosen)
    need = size - len(chosen)
    if need <= 0:
        return chosen
    groups: Dict[Optional[int], List[str]] = {}
    for i in sorted(dict.fromkeys(available)):
        if i not in taken:
            nodes = numa(i)
            groups.setdefault(nodes[0] if len(nodes) == 1 else None, []).append(i)
    near = {numa(i)[0] for i in chosen if len(numa(i)) == 1}
    nodes = [n for n in groups if n is not None]
    fits = [n for n in nodes if len(groups[n]) >= need]
    if fits:
        best = min(fits, key=lambda n: (n not in near, len(groups[n]), n))
        return chosen + groups[best][:need]
    for n in sorted(nodes, key=lambda n: (n not in near, -len(groups[n]), n)) + [None]:
        chosen += groups.get(n, [])[:size - len(chosen)]
    return chosen


# --- the loop's table of one resource ------------------------------------------------------

def table(device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT) -> "SharedTable":
    """The loop's record of one resource's nodes: a pattern's units, or one shareable node."""
    if device.pattern:
        return ExclusiveTable(device, dev_root, sys_root)
    return SharedTable(device, dev_root, sys_root)


def directories(device: Device, dev_root: str) -> List[str]:
    """The directories whose events can change what the resource serves (its nodes come and go there)."""
    return list(dict.fromkeys(os.path.dirname(host_path(p, dev_root)) for p in (device.path, *device.companions)))


class _Companions:
    """The nodes every unit brings along (VFIO: /dev/vfio/vfio). Each is judged as a
    device path is and keeps its first node; while one is not there, no unit is Healthy."""

    def __init__(self, device: Device, dev_root: str, sys_root: str) -> None:
        self._dev_root, self._sys_root = dev_root, sys_root
        self._nodes = [(Device(device.resource, path, allow_host_access=device.allow_host_access), NodeWatch())
                       for path in device.companions]
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

    def listing(self) -> List["NodeRow"]:
        return [_row(dev, self._dev_root, self._sys_root, "companion") for dev, _ in self._nodes]


class SharedTable:
    """One node advertised as `count` interchangeable units (the default, `/dev/kvm`)."""

    def __init__(self, device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT) -> None:
        self.device, self._dev_root, self._sys_root = device, dev_root, sys_root
        self._node = NodeWatch()
        self._present: Optional[bool] = None
        self._companions = _Companions(device, dev_root, sys_root) if device.companions else None
        self.advertised = False  # once its node was present; then kept served (Unhealthy while missing)
        self.healthy = False

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

    def listing(self) -> List["NodeRow"]:
        """The device's node and its companions, for `atedevd check`."""
        rows = [_row(self.device, self._dev_root, self._sys_root, "node")]
        return rows + (self._companions.listing() if self._companions else [])


class _Match:
    """One name the pattern matches, as the loop last judged it."""

    __slots__ = ("name", "path", "id", "state", "node", "refusal", "first", "numa", "pci", "unit")

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        self.id: Optional[str] = None  # its unit's ID, once it is a unit
        self.state = MISSING  # PRESENT, or why it is not served
        self.node: Optional[policy.Node] = None
        self.refusal: Optional[policy.Refusal] = None
        self.first: Optional[Tuple[int, int]] = None  # the numbers first served as its unit
        self.numa: Tuple[int, ...] = ()
        self.pci: Tuple[str, ...] = ()
        self.unit = False  # advertised: kept in the list (Unhealthy while not PRESENT) until a reload


class ExclusiveTable:
    """Every node a pattern path matches, each one unit that kubelet hands to one container.

    On each look the directory is listed and each match stat()ed (one listdir and a
    stat per match when nothing changed); a match whose type or numbers changed is
    judged in full: the policy, its numbers against those first served, its NUMA
    node. A unit, once advertised, stays in the list (Unhealthy while its node is
    gone) until a reload, so the ID a running container holds stays known to kubelet.
    """

    def __init__(self, device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT) -> None:
        from atedevd import patterns  # only where some device has a pattern

        self.device, self._dev_root, self._sys_root = device, dev_root, sys_root
        self._unit_id = patterns.unit_id
        self._pattern = patterns.Pattern(device.path, dev_root)
        self._skip = {p.rsplit("/", 1)[1] for p in device.companions if p.rsplit("/", 1)[0] == self._pattern.directory}
        self._companions = _Companions(device, dev_root, sys_root)
        self._matches: Dict[str, _Match] = {}
        self._seen: Dict[str, tuple] = {}  # name -> what one stat() saw last
        self._claims: Dict[Tuple[int, int], str] = {}  # numbers first served -> the unit's name
        self._first = True
        self._published: tuple = ()
        self.advertised = False
        self.healthy = False

    @property
    def units(self) -> List[_Match]:
        return sorted((m for m in self._matches.values() if m.unit), key=lambda m: m.id)

    def look(self) -> Tuple[List[Change], bool]:
        """What to tell the journal since the last look, and whether what kubelet is sent changed."""
        seen: Dict[str, tuple] = {}
        for name in self._pattern.names():
            if name in self._skip:
                continue
            try:
                st = os.stat(self._pattern.host_path_of(name))
                seen[name] = (stat.S_IFMT(st.st_mode), st.st_rdev)
            except OSError as e:
                seen[name] = ("error", e.errno)
        changes, _ = self._companions.look()
        first, self._first = self._first, False
        if first or seen != self._seen:
            for name in sorted(set(seen) | set(self._seen)):
                if seen.get(name) != self._seen.get(name):
                    self._judge(name, name in seen, first, changes)
            self._seen = seen
            if first:
                changes.append(self._summary())
        ok = self._companions.ok
        units = tuple((m.id, m.state == PRESENT and ok, m.numa) for m in self.units)
        changed, self._published = first or units != self._published, units
        self.advertised |= bool(units)
        self.healthy = any(h for _, h, _ in units)
        return changes, changed

    def _judge(self, name: str, there: bool, first_look: bool, changes: List[Change]) -> None:
        m = self._matches.get(name)
        if m is None:
            m = self._matches[name] = _Match(name, self._pattern.path_of(name))
        host = self._pattern.host_path_of(name)
        say = lambda level, event, text: changes.append(Change(m.state == PRESENT, level, event, text, m.path))  # noqa: E731
        was = m.state
        if not there:
            m.state, m.node, m.refusal = MISSING, None, None
            if m.unit:
                say(logging.WARNING, "device-missing", f"{m.path} is gone ({host}); unit {m.id} is Unhealthy")
            else:
                del self._matches[name]
            return
        found = presence(Device(self.device.resource, m.path, allow_host_access=self.device.allow_host_access),
                         self._dev_root, self._sys_root)
        m.node, m.refusal = found.node, found.refusal
        m.numa, m.pci = placement(found.node, self._sys_root) if found.node is not None else ((), ())
        if found.node is None:  # not a device node at all: a directory, a file, unreadable
            m.state = found.state
            if m.unit:
                say(logging.WARNING, "device-missing", f"{host} is {found.state}; unit {m.id} is Unhealthy")
            else:
                del self._matches[name]  # never a candidate
            return
        numbers = (found.node.major, found.node.minor)
        if found.state != PRESENT:  # refused by the policy
            m.state = "refused"
            unit = f"unit {m.id} is Unhealthy" if m.unit else "not advertised"
            say(logging.ERROR, "device-refused", f"{m.path}: {found.state}; {unit}")
            return
        if numbers in self._companions.numbers:
            m.state = "a companion"
            log.debug("%s: %s is a companion's node, not a unit", self.device.resource, m.path)
            return
        owner = self._claims.get(numbers)
        if m.first is not None and numbers != m.first:
            m.state = "changed"
            say(logging.ERROR, "device-changed",
                f"{host} is now {found.node.describe()}, not the {_numbers(m.first)} first served as unit {m.id}; "
                f"it is Unhealthy until {_numbers(m.first)} is back or a reload accepts the new node")
            return
        if owner is not None and owner != name:
            m.state = "held"
            holder = self._matches[owner]
            served = "Unhealthy" if m.unit else "not advertised"
            if holder.node is not None and (holder.node.major, holder.node.minor) == numbers:
                say(logging.ERROR, "device-conflict", f"{m.path} is {found.node.describe()}, the same node as unit "
                    f"{holder.id} ({holder.path}): {served}, so that no two containers are given it")
            else:
                say(logging.ERROR, "device-conflict", f"{m.path} is {found.node.describe()}, the node first served as "
                    f"unit {holder.id} ({holder.path}, {holder.state}): {served} while a container may still hold it "
                    f"through {holder.id}; a reload accepts it")
            return
        if m.first is None:
            m.first = numbers
            self._claims[numbers] = name
        m.state = PRESENT
        where = f"{found.node.describe()}" + (f", NUMA node {_numa(m.numa)}" if m.numa else "")
        if found.refusal is not None:  # opted in: said whenever it appears
            say(logging.WARNING, "device-host-access", f"{m.path} gives pods the host, granted because "
                f"allow_host_access = true: {found.refusal}")
        if m.unit:
            if was == PRESENT:  # judged again after a reload
                say(logging.DEBUG, "device-present", f"{m.path} is unit {m.id} ({where})")
            else:
                say(logging.INFO, "device-present", f"{m.path} is present again: unit {m.id} ({where})")
        else:
            m.unit, m.id = True, self._unit_id(m.path)
            level = logging.DEBUG if first_look else logging.INFO
            say(level, "device-present", f"{m.path} appeared; advertising it as unit {m.id} ({where})")

    def _summary(self) -> Change:
        """At the first look (a start, a changed configuration): one line for the resource."""
        units = self.units
        if not units:
            return Change(False, logging.INFO, "device-missing",
                          f"no node matches {self.device.path} ({self._pattern.host_directory}); "
                          "not advertised until one appears")
        named = ", ".join(f"{m.id} ({m.node.numbers}{', NUMA ' + _numa(m.numa) if m.numa else ''})" for m in units[:8])
        more = f" and {len(units) - 8} more" if len(units) > 8 else ""
        return Change(True, logging.INFO, "device-present",
                      f"{len(units)} unit{'s' if len(units) != 1 else ''} from {self.device.path}: {named}{more}")

    def snapshot(self, version: int) -> Snapshot:
        ok = self._companions.ok
        units = tuple(Unit(m.id, m.path, m.state == PRESENT and ok, m.numa) for m in self.units)
        return Snapshot(self.device, bool(units) and any(u.healthy for u in units), version, units=units)

    def forget(self) -> None:
        """A reload: accept the nodes there now. A unit stays one while its node is there and
        allowed, now pinned to the numbers it has; the others leave the list. Every match is
        judged (and named) again at the next look."""
        self._companions.forget()
        self._claims.clear()
        for m in sorted(self._matches.values(), key=lambda m: m.id or ""):
            m.first = None
            if m.unit and m.node is not None and m.state != "refused":
                numbers = (m.node.major, m.node.minor)
                if numbers not in self._claims:
                    m.first, self._claims[numbers] = numbers, m.name
            else:
                m.unit, m.id = False, None
        self._seen = {}

    def listing(self) -> List["NodeRow"]:
        """Every node the pattern matches, then every companion, for `atedevd check`."""
        rows = []
        for m in sorted(self._matches.values(), key=lambda m: m.name):
            numbers = m.node.numbers if m.node is not None else None
            allowed = m.node is not None and m.state != "refused"
            rows.append(NodeRow(m.id, m.path, self._pattern.host_path_of(m.name), "unit" if m.unit else "match",
                                numbers, m.numa, m.pci, m.node is not None, allowed, _state(m)))
        return rows + self._companions.listing()


class NodeRow(NamedTuple):
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


def _state(m: _Match) -> str:
    if m.state == PRESENT:
        return "ok"
    if m.state == "refused" and m.refusal is not None:
        return f"refused: {m.refusal}"
    if m.state == "held":
        return "held: the node first served as another unit"
    if m.state == "changed":
        return f"changed: not the {_numbers(m.first)} first served"
    return m.state


def _row(device: Device, dev_root: str, sys_root: str, role: str) -> NodeRow:
    """A node judged on its own (a shareable device's, a companion)."""
    found = presence(device, dev_root, sys_root)
    numa, pci = placement(found.node, sys_root) if found.node is not None else ((), ())
    refused = found.refusal is not None and found.state != PRESENT
    return NodeRow(None, device.path, device.host_path(dev_root), role, found.node.numbers if found.node else None,
                   numa, pci, found.state != MISSING, not refused,
                   "ok" if found.state == PRESENT else found.state)


def placement(node: policy.Node, sys_root: str = policy.SYS_ROOT) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
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
    devices = os.path.join(sys_root, "devices")
    here = os.path.realpath(os.path.join(sys_root, "dev", node.kind, f"{node.major}:{node.minor}", "device"))
    while here.startswith(devices + "/"):
        n = _read_numa(os.path.join(here, "numa_node"))
        if n is not None or os.path.exists(os.path.join(here, "numa_node")):
            return ((n,) if n is not None else ()), ()
        here = os.path.dirname(here)
    return (), ()


def _read_numa(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            n = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return n if n >= 0 else None


def _numa(nodes: Tuple[int, ...]) -> str:
    return ",".join(map(str, nodes))
