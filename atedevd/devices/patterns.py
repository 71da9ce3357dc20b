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

import base64
import hashlib
import logging
import os
import re
import stat
import time
from typing import Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from atedevd import trust
from atedevd.config import MAX_DEVICE_ID, Device, Pattern
from atedevd.devices import policy
from atedevd.devices.judgement import (Change, Judgement, Memo, NodeState, _numbers, directories, judge,
                                       link_directories, see, trust_changed, trust_stamp)
from atedevd.devices.placement import placement
from atedevd.devices.rows import NodeRow, Served, state_text
from atedevd.devices.shared import Companions
from atedevd.devices.snapshot import NodeGrant, Unit, UnitSnapshot

log = logging.getLogger(__name__)

# Characters an ID keeps as they are; a name with any other gets a hash of itself.
_PLAIN = re.compile(r"[A-Za-z0-9._:+@-]+")
# The hash an ID of an unusual or long name ends in: 128 bits of sha256 (26 base32 letters), so
# that nobody can find two names that share one (40 bits were found in about a second).
_HASH = 26
# A directory listed no longer ago than this may have changed within the same tick of the
# kernel's coarse file clock, which its mtime would not show (git's "racily clean" entries).
_RACY_NS = 50_000_000


def unit_id(path: str) -> str:
    """The ID of the unit at `path` (under /dev): the path below /dev, "/" as "-"; a name
    with characters IDs do not keep, or longer than kubelet's 63, is cut and ends in "~" and
    a hash of the whole path, so two paths never share an ID (no plain ID has a "~")."""
    plain = path[len("/dev/"):].replace("/", "-")
    if len(plain) <= MAX_DEVICE_ID and _PLAIN.fullmatch(plain):
        return plain
    digest = base64.b32encode(hashlib.sha256(os.fsencode(path)).digest()[:16]).decode().lower().rstrip("=")
    kept = "".join(c if _PLAIN.fullmatch(c) else "_" for c in plain)
    return kept[:MAX_DEVICE_ID - _HASH - 1] + "~" + digest


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

    __slots__ = ("name", "path", "host", "id", "judged", "key", "first", "numa", "pci", "unit", "via", "rival", "taken")

    def __init__(self, name: str, path: str, host: str) -> None:
        self.name, self.path, self.host = name, path, host
        self.id: Optional[str] = None  # its unit's ID, once it is a unit
        self.judged = Judgement(NodeState.MISSING)  # PRESENT, or why it is not served
        self.key: Optional[tuple] = None  # what the stat judged showed
        self.first: Optional[Tuple[int, int]] = None  # the numbers first served as its unit
        self.numa: Tuple[int, ...] = ()
        self.pci: Tuple[str, ...] = ()
        self.unit = False  # advertised: kept in the list (Unhealthy while not PRESENT) until a reload
        self.via: Tuple[str, ...] = ()  # the directories its link leads through
        self.rival = None  # claims.Rival: another resource reaches its node
        self.taken: Optional[str] = None  # the path its ID meant first, when not this one

    @property
    def state(self) -> NodeState:
        return self.judged.state

    @property
    def numbers(self) -> Optional[Tuple[int, int]]:
        return self.judged.numbers


class ExclusiveTable:
    """Every node a pattern path matches, each one unit that kubelet hands to one container.

    A look lists the directory and stat()s each match, unless no directory it reads changed
    since the last listing (their mtime, identity and trust: a stat each), which is what
    keeps a quiet node quiet however many nodes match. A match whose stat shows another type,
    number or identity is judged in full from that very stat: trust, the policy, its numbers
    against those first served, whether another resource reaches it (`claims`), its NUMA
    node. A unit, once advertised, stays in the list (Unhealthy while its node is gone) until
    a reload, so the ID a running container holds stays known to kubelet.

    Held at every look, whatever was said or missed before: a unit is Healthy only while
    its node is there, a character device with the numbers first served (this look's
    stat), allowed, trusted, and no other resource's; an ID means one path for the whole run.
    """

    def __init__(self, device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT, claims=None) -> None:
        self.device, self._dev_root, self._sys_root = device, dev_root, sys_root
        self._pattern = Pattern(device.path, dev_root)
        self._skip = {p.rsplit("/", 1)[1] for p in device.companions if p.rsplit("/", 1)[0] == self._pattern.directory}
        self._companions = Companions(device, dev_root, sys_root, claims)
        self._matches: Dict[str, _Match] = {}
        self._judge_all = True  # at first, and after a reload or a change of trust: every name judged anew
        self._claims: Dict[Tuple[int, int], str] = {}  # numbers first served -> the unit's name
        self._registry = claims  # other resources' reach (atedevd/devices/claims.py)
        self._ids: Dict[str, str] = claims.ids(device.resource) if claims is not None else {}  # ID -> path, this run
        self._recheck: Set[int] = set()  # st_rdev another resource reaches now, or no longer
        self._first = True
        self._published: tuple = ()
        self._directories = frozenset(map(os.path.normpath, directories(device, dev_root)))
        self._watched: Optional[FrozenSet[str]] = None  # directories(), until a judgement
        self._trust: Optional[tuple] = None  # (directories, their trust_stamp) as last judged
        self._listed: Optional[tuple] = None  # (directories, their _contents, when) at the last listing
        self._memo: Memo = {}  # the directories' trust, while trust_stamp says nothing changed
        self.advertised = False
        self.healthy = False
        if claims is not None:
            claims.join(device.resource, self)

    @property
    def units(self) -> List[_Match]:
        return sorted((m for m in self._matches.values() if m.unit), key=lambda m: m.id or "")

    def look(self, periodic: bool = True) -> Tuple[List[Change], bool]:
        """What to tell the journal since the last look, and whether what kubelet is sent changed.
        `periodic`: the look's own deadline, which also looks for what no event says (a directory on
        the way that changed owner or mode)."""
        if periodic or self._trust is None:
            dirs = self.directories()
            stamp = trust_stamp(dirs)  # (before judging: a change while it judges shows next time)
            if trust_changed(self._trust, dirs, stamp):
                self._judge_all = True  # a directory on the way changed owner or mode: every match judged anew
                self._companions.recheck()
                self._memo = {}  # (the directories' verdicts hold while their stamp does)
            self._trust = (dirs, stamp)
        memo = self._memo
        changes, companions_changed = self._companions.look(memo)
        first, self._first = self._first, False
        if self._judge_all or self._recheck or self._contents_changed():
            self._list(first, changes, memo)
        if first:
            changes.append(self._summary())
        ok = self._companions.ok
        units = tuple((m.id, m.state is NodeState.PRESENT and ok, m.numa, m.numbers) for m in self.units)
        changed, self._published = first or companions_changed or units != self._published, units
        self.advertised |= bool(units)
        self.healthy = any(h for _, h, _, _ in units)
        return changes, changed

    def _contents_changed(self) -> bool:
        """Whether a listing could find anything new: any directory it reads changed since the
        last one (its identity or mtime), or was changed so close to it that its mtime cannot
        tell (the kernel's file clock is coarse)."""
        if self._listed is None:
            return True
        dirs, contents, at = self._listed
        if dirs != self.directories() or _contents(dirs) != contents:
            return True
        return any(mtime is not None and mtime >= at - _RACY_NS for _, _, mtime in contents)

    def _list(self, first: bool, changes: List[Change], memo: Memo) -> None:
        dirs = self.directories()
        self._listed = (dirs, _contents(dirs), time.time_ns())  # (before the listing: a change during it shows next time)
        seen = {}
        for name in self._pattern.names():
            if name not in self._skip:
                seen[name] = see(self._pattern.host_path_of(name))
        due = set(seen) | set(self._matches) if self._judge_all else \
            {n for n in set(seen) | set(self._matches)
             if n not in self._matches or (seen[n].key if n in seen else None) != self._matches[n].key}
        recheck, self._recheck, self._judge_all = self._recheck, set(), False
        if recheck:
            due |= {n for n, m in self._matches.items() if m.numbers is not None and os.makedev(*m.numbers) in recheck}
        if due:
            self._watched = None
            if self._registry is not None:
                self._registry.new_look()
        for name in sorted(due):
            self._judge(name, seen.get(name), first, changes, memo)

    def recheck(self, rdev: int) -> None:
        """Another resource reaches node `rdev` now, or no longer: judge its matches again at the next look."""
        self._recheck.add(rdev)
        self._companions.recheck(rdev)

    def _judge(self, name: str, seen, first_look: bool, changes: List[Change], memo: Memo) -> None:
        m = self._matches.get(name)
        if m is None:
            m = self._matches[name] = _Match(name, self._pattern.path_of(name), self._pattern.host_path_of(name))
        rival, numbers = m.rival, m.numbers
        self._judge_node(m, seen, first_look, changes, memo)
        if rival is not None and m.rival is None:  # not another's any more, or not there: the other may serve it
            self._registry.release(self.device.resource, os.makedev(*numbers))
        if m.state in (NodeState.MISSING, NodeState.NOT_A_NODE) and not m.unit:
            del self._matches[name]  # never a candidate

    def _judge_node(self, m: _Match, seen, first_look: bool, changes: List[Change], memo: Memo) -> None:
        def say(level: int, event: str, text: str) -> None:
            changes.append(Change(m.state is NodeState.PRESENT, level, event, text, m.path))

        was = m.state
        m.rival = None
        if seen is None:
            m.key, m.judged = None, Judgement(NodeState.MISSING)
            if m.unit:
                say(logging.WARNING, "device-missing", f"{m.path} is gone ({m.host}); unit {m.id} is Unhealthy")
            return
        m.key = seen.key
        m.via = link_directories(m.host)
        problems = trust.directory_problems(self._pattern.host_directory, memo)  # anyone who may add a name chooses a node
        found = judge(seen, m.host, self.device.allow_host_access, self._sys_root, memo)
        if problems and found.state is not NodeState.MISSING:
            found = found._replace(state=NodeState.UNTRUSTED, why=f"not trusted: {problems[0]}")
        m.judged = found
        m.numa, m.pci = placement(found.node, self._sys_root) if found.node is not None else ((), ())
        served = f"unit {m.id} is Unhealthy" if m.unit else "not advertised"
        if found.state in (NodeState.MISSING, NodeState.NOT_A_NODE, NodeState.UNREADABLE):
            if m.unit:
                say(logging.WARNING, "device-missing", f"{m.host} is {found.text()}; unit {m.id} is Unhealthy")
            return
        if found.state is NodeState.UNTRUSTED:
            say(logging.ERROR, "device-untrusted", f"{m.path}: {found.why}; {served}")
            return
        if found.state is NodeState.REFUSED:
            say(logging.ERROR, "device-refused", f"{m.path}: {found.why}; {served}")
            return
        node = found.node
        if node is None:  # (a judgement PRESENT has its node)
            return
        numbers = (node.major, node.minor)
        if numbers in self._companions.numbers:
            m.judged = found._replace(state=NodeState.COMPANION)
            log.debug("%s: %s is a companion's node, not a unit", self.device.resource, m.path)
            return
        if self._registry is not None:  # before our own rules: a release must mean no other sees us reach it
            m.rival = self._registry.rival(self.device.resource, node, True, m.path)
            if m.rival is not None:
                m.judged = found._replace(state=NodeState.CLAIMED,
                                          why=f"claimed: {m.rival.resource} reaches it too, as {m.rival.path}")
                say(logging.ERROR if m.rival.news else logging.DEBUG, "device-conflict", f"{m.rival.text}; {served}")
                return
        if m.first is not None and numbers != m.first:
            m.judged = found._replace(state=NodeState.CHANGED, why=f"changed: not the {_numbers(m.first)} first served")
            say(logging.ERROR, "device-changed",
                f"{m.host} is now {node.describe()}, not the {_numbers(m.first)} first served as unit {m.id}; "
                f"it is Unhealthy until {_numbers(m.first)} is back or a reload accepts the new node")
            return
        owner = self._claims.get(numbers)
        if owner is not None and owner != m.name:
            holder = self._matches[owner]
            m.judged = found._replace(state=NodeState.HELD, why="held: the node first served as another unit")
            served = "Unhealthy" if m.unit else "not advertised"
            if holder.numbers == numbers:
                say(logging.ERROR, "device-conflict", f"{m.path} is {node.describe()}, the same node as unit "
                    f"{holder.id} ({holder.path}): {served}, so that no two containers are given it")
            else:
                say(logging.ERROR, "device-conflict", f"{m.path} is {node.describe()}, the node first served as "
                    f"unit {holder.id} ({holder.path}, {holder.state.value}): {served} while a container may still hold "
                    f"it through {holder.id}; a reload accepts it")
            return
        if not m.unit:
            uid = unit_id(m.path)
            meant = self._ids.setdefault(uid, m.path)
            if meant != m.path:  # two names, one ID: never one ID for two paths
                if m.taken is None:
                    say(logging.ERROR, "device-conflict", f"{m.path} would be unit {uid}, the ID {meant} has had "
                        f"since it was first seen: not advertised while atedevd runs; name one otherwise (a udev rule)")
                m.judged, m.taken = found._replace(state=NodeState.ID_TAKEN, why=f"ID taken: {uid} is {meant}'s"), meant
                return
        if m.first is None:
            m.first = numbers
            self._claims[numbers] = m.name
        where = f"{node.describe()}" + (f", NUMA node {_numa(m.numa)}" if m.numa else "")
        if found.refusal is not None:  # opted in: said whenever it appears
            say(logging.WARNING, "device-host-access", f"{m.path} gives pods the host, granted because "
                f"allow_host_access = true: {found.refusal}")
        if m.unit:
            if was is NodeState.PRESENT:  # judged again after a reload
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
        named = ", ".join(f"{m.id} ({m.judged.node.numbers if m.judged.node else '?'}"
                          f"{', NUMA ' + _numa(m.numa) if m.numa else ''})" for m in units[:8])
        more = f" and {len(units) - 8} more" if len(units) > 8 else ""
        return Change(True, logging.INFO, "device-present",
                      f"{len(units)} unit{'s' if len(units) != 1 else ''} from {self.device.path}: {named}{more}")

    def snapshot(self, version: int) -> UnitSnapshot:
        companions = self._companions.grants()
        units = []
        for m in self.units:
            healthy = m.state is NodeState.PRESENT and companions is not None
            nodes = (NodeGrant(m.path, *m.first),) + companions if healthy and m.first is not None else ()  # type: ignore[operator]
            units.append(Unit(m.id or "", m.path, bool(nodes), m.numa, nodes))  # (a unit has an ID)
        return UnitSnapshot(self.device, version, tuple(units))

    def forget(self) -> None:
        """A reload: accept the nodes there now. A unit stays one while its node is there and
        allowed, now pinned to the numbers it has; the others leave the list. Every match,
        those whose node went meanwhile included, is judged (and named) again at the next
        look. The IDs keep what they meant: kubelet's checkpoint outlives the reload."""
        self._companions.forget()
        self._claims.clear()
        for m in sorted(self._matches.values(), key=lambda m: m.id or ""):
            m.first = None
            numbers = m.numbers
            now = see(m.host).key
            if m.unit and m.state is not NodeState.REFUSED and numbers is not None and numbers not in self._claims \
                    and now[0] == stat.S_IFCHR and now[1] == os.makedev(*numbers):
                m.first, self._claims[numbers] = numbers, m.name  # (its node now: one gone since the last look leaves the list)
            else:
                m.unit, m.id = False, None
        self._judge_all = True

    def directories(self) -> FrozenSet[str]:
        """Where events can change what it serves: the pattern's and the companions' directories,
        and those its matches' links lead through (where a link's node is made anew)."""
        if self._watched is None:  # (asked after every wake-up: made again only after a judgement)
            via = {d for m in self._matches.values() for d in m.via} | set(self._companions.via)
            self._watched = self._directories.union(via)
        return self._watched

    def served(self) -> List[Served]:
        """Its units and companions as served (for the invariants' check)."""
        units = [Served(m.id, m.path, m.host, m.first, "unit") for m in self.units]
        return units + self._companions.served()

    def kept(self) -> List[Tuple[str, Tuple[int, int]]]:
        """(host path, numbers) of every node host_mode may keep: units judged present with the
        numbers first served and refused by no rule, and the companions."""
        units: List[Tuple[str, Tuple[int, int]]] = [(m.host, m.first) for m in self.units if m.first is not None
                                                    and m.state is NodeState.PRESENT and m.judged.refusal is None]
        return units + self._companions.kept()

    def listing(self) -> List[NodeRow]:
        """Every node the pattern matches, then every companion, for `atedevd check`."""
        rows = []
        for m in sorted(self._matches.values(), key=lambda m: m.name):
            node = m.judged.node
            rows.append(NodeRow(m.id, m.path, m.host, "unit" if m.unit else "match", node.numbers if node else None,
                                m.numa, m.pci, node is not None, m.state is not NodeState.REFUSED, state_text(m.judged)))
        return rows + self._companions.listing()


def _contents(dirs) -> tuple:
    """Each directory's identity and mtime (None where it is not there): what a listing reads."""
    out: List[tuple] = []
    for d in sorted(dirs):
        try:
            st = os.stat(d)
        except OSError:
            out.append((d, None, None))
            continue
        out.append((d, (st.st_dev, st.st_ino), st.st_mtime_ns))
    return tuple(out)


def _numa(nodes: Tuple[int, ...]) -> str:
    return ",".join(map(str, nodes))
