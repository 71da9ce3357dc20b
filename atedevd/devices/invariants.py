"""What kubelet is told, checked against what is on the node: the runtime invariants as one
call, for the simulation to make after every event (and for tests).

- A node is Healthy in at most one resource where any of them hands it to one container at
  a time (a pattern's unit); two Healthy units of one resource are two nodes.
- A Healthy unit's node, and each of its companions, is there, a character device with the
  numbers it was first served with, and allowed by the device policy now.
- An ID means one path for as long as the checker watches (kubelet's checkpoint ties a
  running container's IDs to the paths it was answered with).

It reads what each resource publishes (`Resource.snapshot`, what ListAndWatch sends) and
what its table says it serves (`table.served()`: the path, the numbers first served); what
is at a path comes from `observe`, so the check does no I/O of its own: `observe_disk`
(the default) stats the node and judges it as the daemon does, a simulation may pass its
own view of the node.
"""

import os
import stat
from typing import Callable, Dict, List, Optional, Tuple

from atedevd.devices import policy
from atedevd.devices.rows import Served
from atedevd.devices.snapshot import UnitSnapshot
from atedevd.record import Record


class Observed(Record):
    """What is at a node's path now."""

    kind: str  # "char", "block", "other" or "missing"
    rdev: Optional[int] = None
    allowed: bool = True  # the device policy lets pods have it (with the device's opt-in)


Observe = Callable[[str, bool], Observed]  # (host path, allow_host_access) -> Observed


def observe_disk(sys_root: str = policy.SYS_ROOT) -> Observe:
    """The node at a path as the daemon sees it: every link followed, judged by the policy.
    The policy's verdict is remembered per major:minor (sysfs is read once for each: it
    does not change under a simulation or a test; take a new observer where it may)."""
    verdicts: Dict[Tuple[int, bool], bool] = {}

    def observe(host_path: str, allow_host_access: bool) -> Observed:
        try:
            st = os.stat(host_path)
        except OSError:
            return Observed("missing")
        if not stat.S_ISCHR(st.st_mode):
            return Observed("block" if stat.S_ISBLK(st.st_mode) else "other", st.st_rdev, False)
        key = (st.st_rdev, allow_host_access)
        if key not in verdicts:
            node = policy.look(host_path, sys_root)
            verdicts[key] = node is not None and not policy.refused(policy.judge(node), allow_host_access)
        return Observed("char", st.st_rdev, verdicts[key])

    return observe


class Invariants:
    """Checks a Node (atedevd/glue/plugin_dir.py) as often as asked, remembering every ID it has seen."""

    def __init__(self) -> None:
        self._ids: Dict[Tuple[str, str], str] = {}  # (resource, ID) -> the path it meant first
        self._observe: Optional[Observe] = None

    def check(self, node, observe: Optional[Observe] = None) -> List[str]:
        """Every violation now, one line each; [] when all hold. `observe`: what is at a path
        (default: the disk, judged as the daemon judges it, the policy's verdicts remembered)."""
        if observe is None:
            observe = self._observe = self._observe or observe_disk(node.sys_root)
        found: List[str] = []
        holders: Dict[int, List[Tuple[str, str, bool]]] = {}  # rdev -> (resource, what, exclusive) served Healthy
        for name, r in sorted(node.resources.items()):
            served = r.table.served()
            units = [s for s in served if s.role == "unit"]
            self._check_ids(name, r.snapshot, units, found)
            self._check_grants(name, r.snapshot, served, found)
            companions = [s for s in served if s.role == "companion"]
            for what, nodes, exclusive in self._healthy(r.snapshot, served, units, companions):
                for s in nodes:
                    seen = observe(s.host_path, r.device.allow_host_access)
                    problem = _wrong(s, seen)
                    if problem:
                        found.append(f"{name}: {what} is Healthy but {s.path} {problem}")
                    elif seen.rdev is not None:
                        holders.setdefault(seen.rdev, []).append((name, f"{what} ({s.path})", exclusive and s.role == "unit"))
        for rdev, held in sorted(holders.items()):
            alone = [n for n, _, exclusive in held if exclusive]
            if alone and (len({n for n, _, _ in held}) > 1 or len(alone) > 1):
                ways = ", ".join(sorted({f"{n}'s {w}" for n, w, _ in held}))
                found.append(f"char {os.major(rdev)}:{os.minor(rdev)} is Healthy as {ways}")
        return found

    def _healthy(self, snapshot, served, units, companions):
        """(what, the nodes it needs, exclusive) for each unit the snapshot lists Healthy."""
        if not isinstance(snapshot, UnitSnapshot):
            if snapshot.healthy:
                yield "every unit", [s for s in served if s.role != "unit"], False
            return
        by_id = {s.id: s for s in units}
        for unit in snapshot.by_id.values():
            if not unit.healthy:
                continue
            s = by_id.get(unit.id)
            if s is None:  # listed Healthy, but not one the table serves
                yield f"unit {unit.id}", [_unknown(unit)], True
            else:
                yield f"unit {unit.id}", [s] + companions, True

    def _check_grants(self, name: str, snapshot, served, found: List[str]) -> None:
        """What a grant would make (the snapshot's nodes, which Allocate and the CDI spec carry)
        is exactly what the table judged and serves: each node with the numbers first served."""
        first = {s.path: s.first for s in served}
        for key, nodes in snapshot.grants().items():
            for n in nodes:
                if first.get(n.path) != (n.major, n.minor):
                    found.append(f"{name}: {'unit ' + key if key else 'the grant'} makes {n.path} as {n.major}:{n.minor}, "
                                 f"not the {first.get(n.path)} its table serves")

    def _check_ids(self, name: str, snapshot, units, found: List[str]) -> None:
        listed = [(u.id, u.path) for u in (snapshot.by_id.values() if isinstance(snapshot, UnitSnapshot) else ())]
        paths: Dict[str, str] = {}
        for uid, path in listed + [(s.id, s.path) for s in units]:
            if paths.setdefault(uid, path) != path:
                found.append(f"{name}: ID {uid} means {paths[uid]} and {path} at once")
        for uid, path in paths.items():
            first = self._ids.setdefault((name, uid), path)
            if first != path:
                found.append(f"{name}: ID {uid} meant {first}, now {path}")


def _unknown(unit) -> Served:
    return Served(unit.id, unit.path, "", None, "unit")


def _wrong(s, seen: Observed) -> Optional[str]:
    """What is wrong with the node a Healthy unit needs, or None."""
    if not s.host_path:
        return "is not a node the table serves"
    if seen.kind == "missing":
        return "is gone"
    if seen.kind != "char":
        return f"is a {seen.kind} file, not a character device"
    if s.first is not None and seen.rdev is not None and seen.rdev != os.makedev(*s.first):
        return f"is {os.major(seen.rdev)}:{os.minor(seen.rdev)}, not the {s.first[0]}:{s.first[1]} first served"
    if not seen.allowed:
        return "is refused by the device policy"
    return None
