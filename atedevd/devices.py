"""The device table of one resource: presence on the node, unit IDs, health snapshots, and
where a node sits (its NUMA node and PCI address, from sysfs) as `atedevd check` lists it.

A device node is advertised as `count` shareable units; a pattern path
(`/dev/ttyUSB*`) as one unit per matching node, each handed to one container.
Presence is read from the node (a character device under the dev root, every
symlink followed, as the container runtime follows them); what kubelet sees is
an immutable `Snapshot`, so gRPC threads never share mutable state with the loop.
The loop owns one table per resource (`resource.node_table()`): it looks at the nodes
(`resource.LOOK_EVERY_S`, and on news from their directories) and says what changed.

One judgement, one set of numbers: a look stats each path once (`see`), and a path whose
stat shows another type, number or identity is judged from that very stat (`judge`) into a
`Judgement` over `NodeState`, which both tables use. What a grant makes (the snapshot's
`NodeGrant`s: the path pods see, the numbers judged) comes from there and is never looked up
again by path: udev replaces nodes and retargets links between any two looks.

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

import enum
import errno
import functools
import logging
import os
import stat
import threading
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from atedevd import policy, trust
from atedevd.api import pb
from atedevd.config import Device, file_type, host_path
from atedevd.record import Record

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class NodeState(enum.Enum):
    """What a table judged a path to be: served only when PRESENT (both tables, one word each)."""

    PRESENT = "present"  # a character device pods may have, this resource's
    MISSING = "missing"  # nothing at the path (a dangling link too)
    NOT_A_NODE = "not a node"  # a file, a directory, a FIFO ...
    UNREADABLE = "unreadable"  # stat() failed otherwise
    REFUSED = "refused"  # the device policy keeps it from pods (a block device too)
    UNTRUSTED = "untrusted"  # a directory or link on the way that someone other than root can change
    CHANGED = "changed"  # a node with other numbers than those first served at the path
    CLAIMED = "claimed"  # another resource reaches it, and one of the two hands it to one container
    HELD = "held"  # (patterns) the numbers another unit was first served with
    COMPANION = "a companion"  # (patterns) a companion's node, never a unit
    ID_TAKEN = "id-taken"  # (patterns) its ID meant another path this run


class Seen(Record):
    """What one stat() of a path (every link followed) showed: its type, numbers and identity
    (a node made anew under the same name, or a link led elsewhere, is another key), or the
    error. A judgement is made of this very stat, never of a second look."""

    key: tuple
    st: Optional[os.stat_result] = None


def see(path: str) -> Seen:
    try:
        st = os.stat(path)
    except OSError as e:
        return Seen(("error", e.errno))
    return Seen((stat.S_IFMT(st.st_mode), st.st_rdev, st.st_dev, st.st_ino), st)


class Judgement(Record):
    """A path as judged from one `Seen`: its state, the node (its type and numbers, from that
    stat), the policy rule it matched (granted anyway when opted in), and the words for a
    state that needs them (what is there instead, the rule, the untrusted directory)."""

    state: NodeState
    node: Optional[policy.DeviceNode] = None
    refusal: Optional[policy.Refusal] = None
    why: str = ""

    @property
    def numbers(self) -> Optional[Tuple[int, int]]:
        return (self.node.major, self.node.minor) if self.node is not None else None

    def text(self) -> str:
        """The state in words, as the journal and `check` say it."""
        return self.why or self.state.value


Memo = Dict[str, List[str]]  # the directories' trust, walked once per look (atedevd/trust.py)


def judge(seen: Seen, host: str, allow_host_access: bool, sys_root: str = policy.SYS_ROOT,
          memo: Optional[Memo] = None) -> Judgement:
    """A path's judgement from what one stat() of it showed (`seen`): present (a character
    device the policy lets pods have), or why not. Every directory and link the kernel walks
    to reach the node must be root's alone, or whoever may write one chooses the node."""
    if seen.st is None:
        code = seen.key[1]
        if code in (errno.ENOENT, errno.ENOTDIR):
            return Judgement(NodeState.MISSING)
        return Judgement(NodeState.UNREADABLE, why=f"unreadable ({os.strerror(code)})")
    problems = trust.device_problems(host, memo)
    node = policy.look(host, sys_root, seen.st)  # the numbers of this stat: one judgement, one set of numbers
    if problems:
        return Judgement(NodeState.UNTRUSTED, node, why=f"not trusted: {problems[0]}")
    if node is None:
        return Judgement(NodeState.NOT_A_NODE, why=f"a {file_type(seen.st.st_mode)}, not a character device")
    found = policy.judge(node)  # a block device is refused whatever the configuration says
    if found is not None and policy.refused(found, allow_host_access):
        return Judgement(NodeState.REFUSED, node, found, policy.refusal_text(found))
    return Judgement(NodeState.PRESENT, node, found)


def judge_path(device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT) -> Judgement:
    """A device's path judged now, on its own (a configuration check, `check`)."""
    host = device.host_path(dev_root)
    return judge(see(host), host, device.allow_host_access, sys_root)


class NodeGrant(Record):
    """One node a grant makes in a container: the path pods see and the numbers judged (the CDI
    spec names these; host_mode widens only the node that has them)."""

    path: str
    major: int
    minor: int


class Change(Record):
    """A device's presence changed: what to tell the journal, and whether it is served Healthy."""

    present: bool
    level: int
    event: str
    message: str
    device: Optional[str] = None  # the node it is about (ATEDEVD_DEVICE); None: the device's path


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


def _claimed_change(rival, advertised: bool) -> Change:
    served = "units are Unhealthy" if advertised else "not advertised"
    return Change(False, logging.ERROR if rival.news else logging.DEBUG, "device-conflict", f"{rival.text}; {served}")


class NodeWatch:
    """One path a table serves whole (a shareable device's node, a companion): the major:minor
    first served and what was judged last, judged again only when what one stat() shows of the
    path changed, or when told to (`recheck`: another resource's reach of it changed).

    With `claims` (atedevd/claims.py), a node another resource hands out one container at a
    time (or, for `exclusive`, any node another resource reaches) is CLAIMED and not served;
    the other resource's table tells when that ends."""

    def __init__(self, device: Device, dev_root: str, sys_root: str, claims=None, exclusive: bool = False) -> None:
        self.device = device
        self.host = device.host_path(dev_root)
        self._sys_root = sys_root
        self.first: Optional[Tuple[int, int]] = None
        self.judged: Optional[Judgement] = None
        self._key: Optional[tuple] = None  # what the stat judged showed; None: judge at the next look
        self.via: Tuple[str, ...] = ()  # the directories its link leads through (link_directories)
        self.rival: Optional[Any] = None  # claims.Rival while another resource reaches the node
        self._claims, self._exclusive = claims, exclusive

    @property
    def present(self) -> bool:
        return self.judged is not None and self.judged.state is NodeState.PRESENT

    def grant(self) -> Optional[NodeGrant]:
        """Its node as a grant makes it (the numbers judged), while it is present."""
        numbers = self.judged.numbers if self.judged is not None and self.present else None
        return NodeGrant(self.device.path, *numbers) if numbers is not None else None

    def forget(self) -> None:
        """A reload: the node at the path now is accepted as the device's (the configuration
        check has judged it)."""
        self.first = None
        self._key = None

    def recheck(self) -> None:
        """Judge the node in full at the next look (another resource's reach of it changed)."""
        self._key = None

    def look(self, advertised: bool, memo: Optional[Memo] = None) -> Optional[Change]:
        """The change since the last look, or None. One stat() when nothing changed; judged
        in full (links, trust, sysfs, the policy, the claims) from that same stat when what it
        shows changed."""
        seen = see(self.host)
        if seen.key == self._key:
            return None
        self._key = seen.key
        self.via = link_directories(self.host)
        found = judge(seen, self.host, self.device.allow_host_access, self._sys_root, memo)
        rival, self.rival = self.rival, None
        before = self.judged.numbers if self.judged is not None else None
        if found.state is NodeState.PRESENT and self._claims is not None:  # before our own rule: released only when not reached
            self._claims.new_look()
            self.rival = self._claims.rival(self.device.resource, found.node, self._exclusive, self.device.path)
            if self.rival is not None:
                found = found._replace(state=NodeState.CLAIMED, why=f"claimed: {self.rival.resource} reaches it too, "
                                                                     f"as {self.rival.path}")
        if found.state is NodeState.PRESENT and self.first is not None and found.numbers != self.first:
            found = found._replace(state=NodeState.CHANGED, why=f"changed: not the {_numbers(self.first)} first served")
        if rival is not None and self.rival is None and before is not None:
            self._claims.release(self.device.resource, os.makedev(*before))
        if found.state is NodeState.PRESENT and self.first is None:  # the first node served (again after a reload)
            self.first = found.numbers
        last, self.judged = self.judged, found
        if last is not None and (last.state, last.numbers) == (found.state, found.numbers):
            return None
        return self._change(found, last is None, advertised)

    def _change(self, found: Judgement, first_look: bool, advertised: bool) -> Change:
        path = self.device.path
        served = "units are Unhealthy" if advertised else "not advertised"
        what = found.node.describe() if found.node is not None else "not a node"
        if found.state is NodeState.CLAIMED and self.rival is not None:
            return _claimed_change(self.rival, advertised)
        if found.state is NodeState.PRESENT:
            if found.refusal is not None:  # opted in: said at every start and whenever it appears
                return Change(True, logging.WARNING, "device-host-access",
                              f"{path} gives pods the host, granted because allow_host_access = true: {found.refusal}")
            if first_look:
                return Change(True, logging.DEBUG, "device-present", f"{path} is present ({what})")
            return Change(True, logging.INFO, "device-present",
                          f"{path} is present again" if advertised else f"{path} appeared; advertising it")
        if found.state is NodeState.CHANGED:
            return Change(False, logging.ERROR, "device-changed",
                          f"{self.host} is now {what}, not the {_numbers(self.first)} first served; "
                          f"units are Unhealthy until {_numbers(self.first)} is back or a reload accepts the new node")
        if found.state is NodeState.REFUSED:
            return Change(False, logging.ERROR, "device-refused", f"{path}: {found.why}; {served}")
        if found.state is NodeState.UNTRUSTED:
            return Change(False, logging.ERROR, "device-untrusted", f"{path}: {found.why}; {served}")
        if found.state is NodeState.MISSING:
            return Change(False, logging.INFO if first_look else logging.WARNING, "device-missing",
                          f"{path} is missing ({self.host}); "
                          f"{'units are Unhealthy' if advertised else 'not advertised until it appears'}")
        return Change(False, logging.WARNING, "device-missing", f"{self.host} is {found.text()}; treating it as missing")


def _numbers(numbers: Optional[Tuple[int, int]]) -> str:
    return f"{numbers[0]}:{numbers[1]}" if numbers else "?"


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
        `earlier`: how a list kubelet may still hold had an ID (atedevd/lists.py)."""
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
        from atedevd import lists

        ids = list(dict.fromkeys(ids))
        gone = [i for i in ids if i not in self.by_id]
        if gone:  # in a list kubelet may still hold, not in ours
            return lists.left(earlier(gone[0]), self.device.resource)
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


# --- the loop's table of one resource ------------------------------------------------------

def directories(device: Device, dev_root: str) -> List[str]:
    """The directories whose events can change what the resource serves (its nodes come and go there)."""
    return list(dict.fromkeys(os.path.dirname(host_path(p, dev_root)) for p in (device.path, *device.companions)))


def _ancestors(directory: str) -> List[str]:
    out = []
    while True:
        out.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            return out
        directory = parent


@functools.lru_cache(maxsize=256)  # (a table asks at every look, for the same few directories)
def _walked(dirs: FrozenSet[str]) -> Tuple[str, ...]:
    return tuple(sorted({a for d in dirs for a in _ancestors(d)}))


def trust_stamp(dirs: Iterable[str]) -> tuple:
    """One lstat of every directory on the way to each of `dirs`: their identity, owner and mode,
    which is all their trust depends on. A table judges its nodes again in full when this
    changed (a `chmod o+w` of a directory on the way says nothing at the node itself)."""
    seen: List[tuple] = []
    for d in _walked(frozenset(dirs)):
        try:
            st = os.lstat(d)
        except OSError as e:
            seen.append((d, e.errno))
            continue
        seen.append((d, st.st_ino, st.st_mode, st.st_uid, st.st_gid))
    return tuple(seen)


def trust_changed(last: Optional[tuple], dirs: FrozenSet[str], stamp: tuple) -> bool:
    """Whether the directories judged last (`last`: (dirs, trust_stamp)) changed owner or mode
    since; `stamp`: the trust_stamp of `dirs` now."""
    if last is None:
        return True
    return (stamp if last[0] == dirs else trust_stamp(last[0])) != last[1]



class _Companions:
    """The nodes every unit brings along (VFIO: /dev/vfio/vfio). Each is judged as a
    device path is and keeps its first node; while one is not there, no unit is Healthy."""

    def __init__(self, device: Device, dev_root: str, sys_root: str, claims=None) -> None:
        self._dev_root, self._sys_root = dev_root, sys_root
        self.watches = [NodeWatch(Device(device.resource, path, allow_host_access=device.allow_host_access), dev_root,
                                  sys_root, claims) for path in device.companions]

    @property
    def ok(self) -> bool:
        return all(w.present for w in self.watches)

    @property
    def numbers(self) -> set:
        """The companions' major:minor (a match with these is a companion, never a unit)."""
        return {w.first for w in self.watches if w.first is not None}

    def grants(self) -> Optional[Tuple[NodeGrant, ...]]:
        """Every companion's node as judged; None while one is not present."""
        found = tuple(w.grant() for w in self.watches)
        return None if None in found else found  # type: ignore[return-value]

    def look(self, memo: Optional[Memo] = None) -> Tuple[List[Change], bool]:
        changes: List[Change] = []
        before = self.ok
        for watch in self.watches:
            change = watch.look(True, memo)
            if change is not None:
                changes.append(change._replace(message="companion " + change.message, device=watch.device.path))
        return changes, self.ok != before

    def forget(self) -> None:
        for watch in self.watches:
            watch.forget()

    def recheck(self, rdev: Optional[int] = None) -> None:
        for watch in self.watches:
            numbers = watch.judged.numbers if watch.judged is not None else None
            if rdev is None or (numbers is not None and os.makedev(*numbers) == rdev):
                watch.recheck()

    @property
    def via(self) -> Tuple[str, ...]:
        return tuple(d for watch in self.watches for d in watch.via)

    def served(self) -> List["Served"]:
        return [Served(None, w.device.path, w.host, w.first, "companion") for w in self.watches]

    def kept(self) -> List[Tuple[str, Tuple[int, int]]]:
        return [kept for kept in (_kept(w) for w in self.watches) if kept is not None]

    def listing(self) -> list:
        return [row(w, self._sys_root, "companion") for w in self.watches]


def _kept(watch: NodeWatch) -> Optional[Tuple[str, Tuple[int, int]]]:
    """(host path, numbers) of a watched node host_mode may keep: present, and refused by no rule."""
    judged = watch.judged
    if judged is None or judged.state is not NodeState.PRESENT or judged.refusal is not None or judged.numbers is None:
        return None
    return watch.host, judged.numbers


class SharedTable:
    """One node advertised as `count` interchangeable units (the default, `/dev/kvm`)."""

    def __init__(self, device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT, claims=None) -> None:
        self.device, self._dev_root, self._sys_root = device, dev_root, sys_root
        self._node = NodeWatch(device, dev_root, sys_root, claims)
        self._companions = _Companions(device, dev_root, sys_root, claims) if device.companions else None
        self.advertised = False  # once its node was present; then kept served (Unhealthy while missing)
        self.healthy = False
        self._directories = frozenset(map(os.path.normpath, directories(device, dev_root)))
        self._trust: Optional[tuple] = None
        self._memo: Memo = {}
        self._via: Tuple[str, ...] = ()
        self._watched = self._directories
        if claims is not None:
            claims.join(device.resource, self)

    def look(self, periodic: bool = True) -> Tuple[List[Change], bool]:
        """What to tell the journal since the last look, and whether what kubelet is sent changed.
        `periodic`: the look's own deadline, which also looks for what no event says (a directory on
        the way that changed owner or mode)."""
        if periodic or self._trust is None:
            dirs = self.directories()
            stamp = trust_stamp(dirs)
            if trust_changed(self._trust, dirs, stamp):  # a directory on the way changed owner or mode: judge anew
                self._node.recheck()
                if self._companions is not None:
                    self._companions.recheck()
                self._memo = {}  # (the directories' verdicts hold while their stamp does)
            self._trust = (dirs, stamp)
        memo = self._memo
        changes: List[Change] = []
        change = self._node.look(self.advertised, memo)
        if change is not None:
            changes.append(change)
            self.advertised |= change.present
        if self._companions is not None:
            more, _ = self._companions.look(memo)
            changes += more
        healthy = self._node.present and (self._companions is None or self._companions.ok)
        changed, self._first = self._first or healthy != self.healthy or change is not None, False  # the first look is news
        self.healthy = healthy
        return changes, changed

    _first = True

    def snapshot(self, version: int) -> SharedSnapshot:
        node = self._node.grant()
        companions = self._companions.grants() if self._companions is not None else ()
        nodes = (node,) + companions if self.healthy and node is not None and companions is not None else ()
        return SharedSnapshot(self.device, bool(nodes), version, nodes)

    def forget(self) -> None:
        """A reload: the nodes there now are accepted (the configuration check has judged them)."""
        self._node.forget()
        if self._companions is not None:
            self._companions.forget()

    def recheck(self, rdev: int) -> None:
        """Another resource reaches node `rdev` now, or no longer: judge it again at the next look."""
        numbers = self._node.judged.numbers if self._node.judged is not None else None
        if numbers is not None and os.makedev(*numbers) == rdev:
            self._node.recheck()
        if self._companions is not None:
            self._companions.recheck(rdev)

    def directories(self) -> FrozenSet[str]:
        """Where events can change what it serves: its paths' directories, and those their links lead through."""
        via = self._node.via + (self._companions.via if self._companions else ())
        if via != self._via:  # (asked after every wake-up: made again only when a judgement moved a link)
            self._via, self._watched = via, self._directories.union(via)
        return self._watched

    def served(self) -> List["Served"]:
        """Its node and companions as served (for the invariants' check)."""
        node = Served(None, self.device.path, self._node.host, self._node.first, "node")
        return [node] + (self._companions.served() if self._companions else [])

    def kept(self) -> List[Tuple[str, Tuple[int, int]]]:
        """(host path, numbers) of every node host_mode may keep: judged present, refused by no rule."""
        node = _kept(self._node)
        return ([node] if node is not None else []) + (self._companions.kept() if self._companions else [])

    def listing(self) -> list:
        """The device's node and its companions as last judged, for `atedevd check`."""
        rows = [row(self._node, self._sys_root, "node")]
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


def state_text(judged: Optional[Judgement]) -> str:
    """A judgement as `check` lists it: "ok", or why the node is not served."""
    if judged is None:
        return NodeState.MISSING.value
    return "ok" if judged.state is NodeState.PRESENT else judged.text()


def row(watch: NodeWatch, sys_root: str, role: str) -> NodeRow:
    """A node judged on its own (a shareable device's, a companion), as last judged."""
    judged = watch.judged or Judgement(NodeState.MISSING)
    numa, pci = placement(judged.node, sys_root) if judged.node is not None else ((), ())
    return NodeRow(None, watch.device.path, watch.host, role, judged.node.numbers if judged.node else None, numa, pci,
                   judged.state is not NodeState.MISSING, judged.state is not NodeState.REFUSED, state_text(judged))


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
    if key[1] is None and not os.path.lexists(entry):
        return (), ()  # sysfs has no device of these numbers: nothing places it
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
