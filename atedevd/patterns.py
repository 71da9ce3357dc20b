"""Pattern devices (`/dev/ttyUSB*`, `/dev/vfio/[0-9]*`): each matched node's ID, the table of
units the loop keeps, and which units to prefer. What a pattern matches is `config.Pattern`
(the configuration's check reads it too); where a node sits (NUMA, PCI) is `devices.placement`.

Only imported where some device has a pattern: a start with the shareable default pays
nothing for it.

Only the last part of the path may hold a pattern, so one directory holds every
match and one inotify watch sees every node come and go. Names are matched as
the shell's glob matches them: `*` and `?` do not match a leading dot unless the
pattern starts with one.

A unit's ID is the matched node's path under /dev with each "/" written "-":
`/dev/vfio/12` is `vfio-12`, `/dev/ttyUSB0` is `ttyUSB0`. kubelet keeps, in its
checkpoint, both the IDs a container holds and the Allocate answer that gave it
its nodes (the path), and when the container starts again (after a crash, a
kubelet restart, a reboot) checks those IDs are Healthy and replays that
answer. Only an ID that always means the same path keeps the two from
disagreeing; an ID from a listing's order does not (the second node
of a directory is another node once the first is unplugged), and neither does
an ID from the hardware when the path it is answered with is the kernel's name
for whatever holds it now. Where the kernel's names are not stable enough, match
the links udev makes from the hardware (`/dev/serial/by-id/*`), whose names are.
"""

import hashlib
import logging
import os
import re
from typing import Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from atedevd import policy
from atedevd.config import MAX_DEVICE_ID, Device, Pattern
from atedevd.devices import (MISSING, PRESENT, Change, NodeRow, Served, Snapshot, _Companions, _numbers, directories, is_node,
                             link_directories, placement, presence, stat_key)
from atedevd.record import Record

log = logging.getLogger(__name__)

# Characters an ID keeps as they are; a name with any other gets a hash of itself.
_PLAIN = re.compile(r"[A-Za-z0-9._:+@-]+")
_HASH = 10  # hex digits of sha256 when an ID is shortened or its name was not plain


def unit_id(path: str) -> str:
    """The ID of the unit at `path` (under /dev): the path below /dev, "/" as "-"; a name
    with characters IDs do not keep, or longer than kubelet's 63, is cut and ends in a hash
    of the whole path, so two paths never share an ID."""
    plain = path[len("/dev/"):].replace("/", "-")
    if len(plain) <= MAX_DEVICE_ID and _PLAIN.fullmatch(plain):
        return plain
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:_HASH]
    kept = "".join(c if _PLAIN.fullmatch(c) else "_" for c in plain)
    return kept[:MAX_DEVICE_ID - _HASH - 1] + "~" + digest


class Unit(Record):
    """One unit of a pattern resource as kubelet is told of it: one node, one container."""

    id: str
    path: str  # the node pods get, as they see it
    healthy: bool
    numa: Tuple[int, ...] = ()  # NUMA nodes sysfs places it on; () when it does not say


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
            at = numa(i)
            groups.setdefault(at[0] if len(at) == 1 else None, []).append(i)
    near = {numa(i)[0] for i in chosen if len(numa(i)) == 1}
    nodes = [n for n in groups if n is not None]
    fits = [n for n in nodes if len(groups[n]) >= need]
    if fits:
        best = min(fits, key=lambda n: (n not in near, len(groups[n]), n))
        return chosen + groups[best][:need]
    for n in sorted(nodes, key=lambda n: (n not in near, -len(groups[n]), n)) + [None]:
        chosen += groups.get(n, [])[:size - len(chosen)]
    return chosen


class _Match:
    """One name the pattern matches, as the loop last judged it."""

    __slots__ = ("name", "path", "id", "state", "node", "refusal", "first", "numa", "pci", "unit", "via", "rival",
                 "taken")

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        self.id: Optional[str] = None  # its unit's ID, once it is a unit
        self.state = MISSING  # PRESENT, or why it is not served
        self.node: Optional[policy.DeviceNode] = None
        self.refusal: Optional[policy.Refusal] = None
        self.first: Optional[Tuple[int, int]] = None  # the numbers first served as its unit
        self.numa: Tuple[int, ...] = ()
        self.pci: Tuple[str, ...] = ()
        self.unit = False  # advertised: kept in the list (Unhealthy while not PRESENT) until a reload
        self.via: Tuple[str, ...] = ()  # the directories its link leads through
        self.rival = None  # claims.Rival: another resource reaches its node
        self.taken: Optional[str] = None  # the path its ID meant first, when not this one


class ExclusiveTable:
    """Every node a pattern path matches, each one unit that kubelet hands to one container.

    On each look the directory is listed and each match stat()ed (one listdir and a
    stat per match when nothing changed); a match whose type, numbers or identity
    changed is judged in full: the policy, its numbers against those first served, its
    NUMA node, whether another resource reaches it (`claims`). A unit, once advertised,
    stays in the list (Unhealthy while its node is gone) until a reload, so the ID a
    running container holds stays known to kubelet.

    Held at every look, whatever was said or missed before: a unit is Healthy only while
    its node is there, a character device with the numbers first served (this look's
    stat), allowed, and no other resource's; an ID means one path for the whole run.
    """

    def __init__(self, device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT, claims=None) -> None:
        self.device, self._dev_root, self._sys_root = device, dev_root, sys_root
        self._pattern = Pattern(device.path, dev_root)
        self._skip = {p.rsplit("/", 1)[1] for p in device.companions if p.rsplit("/", 1)[0] == self._pattern.directory}
        self._companions = _Companions(device, dev_root, sys_root, claims)
        self._matches: Dict[str, _Match] = {}
        self._seen: Optional[Dict[str, tuple]] = None  # name -> what one stat() saw last; None: judge all anew
        self._claims: Dict[Tuple[int, int], str] = {}  # numbers first served -> the unit's name
        self._registry = claims  # other resources' reach (atedevd/claims.py)
        self._ids: Dict[str, str] = claims.ids(device.resource) if claims is not None else {}  # ID -> path, this run
        self._recheck: Set[int] = set()  # st_rdev another resource reaches now, or no longer
        self._first = True
        self._published: tuple = ()
        self._directories = frozenset(map(os.path.normpath, directories(device, dev_root)))
        self._watched: Optional[FrozenSet[str]] = None  # directories(), until a judgement
        self.advertised = False
        self.healthy = False
        if claims is not None:
            claims.join(device.resource, self)

    @property
    def units(self) -> List[_Match]:
        return sorted((m for m in self._matches.values() if m.unit), key=lambda m: m.id or "")

    def look(self) -> Tuple[List[Change], bool]:
        """What to tell the journal since the last look, and whether what kubelet is sent changed."""
        seen: Dict[str, tuple] = {}
        for name in self._pattern.names():
            if name not in self._skip:
                seen[name] = stat_key(self._pattern.host_path_of(name))
        changes, _ = self._companions.look()
        first, self._first = self._first, False
        due = self._due(seen)
        if due:
            self._watched = None
            if self._registry is not None:
                self._registry.new_look()
        for name in sorted(due):
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

    def _due(self, seen: Dict[str, tuple]) -> Set[str]:
        """The names to judge in full: all after a reload (or at first); else those whose stat
        changed, those another resource's reach concerns, and any unit served Healthy whose
        node this stat does not show as the one first served (what an event missed)."""
        if self._seen is None:
            due = set(seen) | set(self._matches)
        else:
            due = {n for n in set(seen) | set(self._seen) if seen.get(n) != self._seen.get(n)}
        recheck, self._recheck = self._recheck, set()
        for name, m in self._matches.items():
            if m.rival is not None or (m.node is not None and os.makedev(m.node.major, m.node.minor) in recheck):
                due.add(name)
            elif m.state == PRESENT and not is_node(seen.get(name, ("error",)), m.first):
                due.add(name)
        return due

    def recheck(self, rdev: int) -> None:
        """Another resource reaches node `rdev` now, or no longer: judge its matches again at the next look."""
        self._recheck.add(rdev)
        self._companions.recheck(rdev)

    def _judge(self, name: str, there: bool, first_look: bool, changes: List[Change]) -> None:
        m = self._matches.get(name)
        if m is None:
            m = self._matches[name] = _Match(name, self._pattern.path_of(name))
        rival, node = m.rival, m.node
        self._judge_node(m, there, first_look, changes)
        if rival is not None and m.rival is None:  # not another's any more, or not there: the other may serve it
            self._registry.release(self.device.resource, os.makedev(node.major, node.minor))
        if m.state in (MISSING, "not a node") and not m.unit:
            del self._matches[name]  # never a candidate

    def _judge_node(self, m: _Match, there: bool, first_look: bool, changes: List[Change]) -> None:
        host = self._pattern.host_path_of(m.name)
        say = lambda level, event, text: changes.append(Change(m.state == PRESENT, level, event, text, m.path))  # noqa: E731
        was = m.state
        m.rival = None
        if not there:
            m.state, m.node, m.refusal = MISSING, None, None
            if m.unit:
                say(logging.WARNING, "device-missing", f"{m.path} is gone ({host}); unit {m.id} is Unhealthy")
            return
        m.via = link_directories(host)
        found = presence(Device(self.device.resource, m.path, allow_host_access=self.device.allow_host_access),
                         self._dev_root, self._sys_root)
        m.node, m.refusal = found.node, found.refusal
        m.numa, m.pci = placement(found.node, self._sys_root) if found.node is not None else ((), ())
        if found.node is None:  # not a device node at all: a directory, a file, unreadable
            m.state = found.state if m.unit else "not a node"
            if m.unit:
                say(logging.WARNING, "device-missing", f"{host} is {found.state}; unit {m.id} is Unhealthy")
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
        if self._registry is not None:  # before our own rules: a release must mean no other sees us reach it
            m.rival = self._registry.rival(self.device.resource, found.node, True, m.path)
            if m.rival is not None:
                m.state = "claimed"
                served = f"unit {m.id} is Unhealthy" if m.unit else "not advertised"
                say(logging.ERROR if m.rival.news else logging.DEBUG, "device-conflict", f"{m.rival.text}; {served}")
                return
        owner = self._claims.get(numbers)
        if m.first is not None and numbers != m.first:
            m.state = "changed"
            say(logging.ERROR, "device-changed",
                f"{host} is now {found.node.describe()}, not the {_numbers(m.first)} first served as unit {m.id}; "
                f"it is Unhealthy until {_numbers(m.first)} is back or a reload accepts the new node")
            return
        if owner is not None and owner != m.name:
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
        if not m.unit:
            uid = unit_id(m.path)
            meant = self._ids.setdefault(uid, m.path)
            if meant != m.path:  # two names, one hash: never one ID for two paths
                if m.taken is None:
                    say(logging.ERROR, "device-conflict", f"{m.path} would be unit {uid}, the ID {meant} has had "
                        f"since it was first seen (an ID of a long or unusual name ends in a hash of the path, and "
                        f"these two share one): not advertised while atedevd runs; name one otherwise (a udev rule)")
                m.state, m.taken = "id-taken", meant
                return
        if m.first is None:
            m.first = numbers
            self._claims[numbers] = m.name
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
            m.unit, m.id = True, unit_id(m.path)
            level = logging.DEBUG if first_look else logging.INFO
            say(level, "device-present", f"{m.path} appeared; advertising it as unit {m.id} ({where})")

    def _summary(self) -> Change:
        """At the first look (a start, a changed configuration): one line for the resource."""
        units = self.units
        if not units:
            return Change(False, logging.INFO, "device-missing",
                          f"no node matches {self.device.path} ({self._pattern.host_directory}); "
                          "not advertised until one appears")
        named = ", ".join(f"{m.id} ({m.node.numbers if m.node else '?'}{', NUMA ' + _numa(m.numa) if m.numa else ''})"
                          for m in units[:8])
        more = f" and {len(units) - 8} more" if len(units) > 8 else ""
        return Change(True, logging.INFO, "device-present",
                      f"{len(units)} unit{'s' if len(units) != 1 else ''} from {self.device.path}: {named}{more}")

    def snapshot(self, version: int) -> Snapshot:
        ok = self._companions.ok
        units = tuple(Unit(m.id or "", m.path, m.state == PRESENT and ok, m.numa) for m in self.units)  # (a unit has an ID)
        return Snapshot(self.device, any(u.healthy for u in units), version, units=units)

    def forget(self) -> None:
        """A reload: accept the nodes there now. A unit stays one while its node is there and
        allowed, now pinned to the numbers it has; the others leave the list. Every match,
        those whose node went meanwhile included, is judged (and named) again at the next
        look. The IDs keep what they meant: kubelet's checkpoint outlives the reload."""
        self._companions.forget()
        self._claims.clear()
        for m in sorted(self._matches.values(), key=lambda m: m.id or ""):
            m.first = None
            numbers = (m.node.major, m.node.minor) if m.node is not None else None
            if m.unit and m.state != "refused" and numbers is not None and \
                    is_node(stat_key(self._pattern.host_path_of(m.name)), numbers):
                if numbers not in self._claims:  # (its node now: one gone since the last look leaves the list)
                    m.first, self._claims[numbers] = numbers, m.name
            else:
                m.unit, m.id = False, None
        self._seen = None

    def directories(self) -> FrozenSet[str]:
        """Where events can change what it serves: the pattern's and the companions' directories,
        and those its matches' links lead through (where a link's node is made anew)."""
        if self._watched is None:  # (asked after every wake-up: made again only after a judgement)
            via = {d for m in self._matches.values() for d in m.via} | set(self._companions.via)
            self._watched = self._directories.union(via)
        return self._watched

    def served(self) -> List[Served]:
        """Its units and companions as served (for the invariants' check)."""
        units = [Served(m.id, m.path, self._pattern.host_path_of(m.name), m.first, "unit") for m in self.units]
        return units + self._companions.served()

    def listing(self) -> List["NodeRow"]:
        """Every node the pattern matches, then every companion, for `atedevd check`."""
        rows = []
        for m in sorted(self._matches.values(), key=lambda m: m.name):
            numbers = m.node.numbers if m.node is not None else None
            allowed = m.node is not None and m.state != "refused"
            rows.append(NodeRow(m.id, m.path, self._pattern.host_path_of(m.name), "unit" if m.unit else "match",
                                numbers, m.numa, m.pci, m.node is not None, allowed, _state(m)))
        return rows + self._companions.listing()


def _state(m: _Match) -> str:
    if m.state == PRESENT:
        return "ok"
    if m.state == "refused" and m.refusal is not None:
        return f"refused: {m.refusal}"
    if m.state == "held":
        return "held: the node first served as another unit"
    if m.state == "changed":
        return f"changed: not the {_numbers(m.first)} first served"
    if m.state == "claimed" and m.rival is not None:
        return f"claimed: {m.rival.resource} reaches it too, as {m.rival.path}"
    if m.state == "id-taken":
        return f"ID taken: {unit_id(m.path)} is {m.taken}'s"
    return m.state


def _numa(nodes: Tuple[int, ...]) -> str:
    return ",".join(map(str, nodes))
