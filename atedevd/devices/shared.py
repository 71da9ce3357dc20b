"""The table of a shareable device: one node advertised as `count` interchangeable units (`/dev/kvm`).

`NodeWatch` is one path a table serves whole (the node, each companion): the major:minor first
served and what was judged last, judged again only when what one stat() shows of the path
changed or another resource's reach of it did. The node stays the node: a node with other
numbers at that path is not present (Unhealthy) until the first one is back or a reload
accepts the new one; a container is given whatever the path resolves to when it is made, so a
renumbered or swapped node would otherwise reach pods promised the first one.
"""

import logging
import os
from typing import Any, FrozenSet, List, Optional, Tuple

from atedevd.config import Device
from atedevd.devices import policy
from atedevd.devices.judgement import (Change, Judgement, Memo, NodeState, _numbers, directories, judge,
                                       link_directories, see, trust_changed, trust_stamp)
from atedevd.devices.rows import Served, row
from atedevd.devices.snapshot import NodeGrant, SharedSnapshot


def _claimed_change(rival, advertised: bool) -> Change:
    served = "units are Unhealthy" if advertised else "not advertised"
    return Change(False, logging.ERROR if rival.news else logging.DEBUG, "device-conflict", f"{rival.text}; {served}")


class NodeWatch:
    """One path a table serves whole (a shareable device's node, a companion): the major:minor
    first served and what was judged last, judged again only when what one stat() shows of the
    path changed, or when told to (`recheck`: another resource's reach of it changed).

    With `claims` (atedevd/devices/claims.py), a node another resource hands out one container at a
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


class Companions:
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
        self._companions = Companions(device, dev_root, sys_root, claims) if device.companions else None
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
