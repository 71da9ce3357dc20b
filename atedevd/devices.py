"""The device table of one resource: presence on the node, unit IDs, health snapshots.

A device node is advertised as `count` shareable units. Presence is read from
the node (a character device under the dev root, every symlink followed, as
the container runtime follows them); what kubelet sees is an immutable
`Snapshot`, so gRPC threads never share mutable state with the loop.

The node stays the node: `NodeWatch` remembers the major:minor first served
and holds a node with other numbers at that path as not present (Unhealthy)
until the first one is back or a reload accepts the new one. A container is
given whatever the path resolves to when it is created, so a renumbered or
swapped node would otherwise reach pods that were promised the first one.
"""

import logging
import os
import stat
import threading
from typing import FrozenSet, NamedTuple, Optional, Tuple

from atedevd import policy
from atedevd.api import pb
from atedevd.config import Device, file_type

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
        return Presence(policy.refusal_text(found), node, found)
    return Presence(PRESENT, node, found)


class Change(NamedTuple):
    """A device's presence changed: what to tell the journal, and whether it is served Healthy."""

    present: bool
    level: int
    event: str
    message: str


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


class Snapshot:
    """What ListAndWatch sends for one resource at one moment; never changed once made.

    The message of `count` devices (1 ms for 1024) and the set of IDs are made when
    first needed, on whichever thread needs them first: a start's first Register does
    not wait for them, kubelet asks for them only after it."""

    __slots__ = ("version", "healthy", "_device", "_ids", "_response", "_lock")

    def __init__(self, device: Device, healthy: bool, version: int, _built=None) -> None:
        self.version = version
        self.healthy = healthy
        self._device = device
        self._ids, self._response = _built or (None, None)
        self._lock = threading.Lock()

    @property
    def ids(self) -> FrozenSet[str]:
        return self._made()[0]

    @property
    def response(self) -> pb.ListAndWatchResponse:
        return self._made()[1]

    def again(self) -> "Snapshot":
        """An equal snapshot that is not this one: a stream sends it as news."""
        return Snapshot(self._device, self.healthy, self.version, (self._ids, self._response) if self._ids is not None else None)

    def _made(self) -> Tuple[FrozenSet[str], pb.ListAndWatchResponse]:
        with self._lock:
            if self._ids is None:
                ids = unit_ids(self._device)
                health = HEALTHY if self.healthy else UNHEALTHY
                response = pb.ListAndWatchResponse()
                add = response.devices.add  # half the time of a list of pb.Device
                for i in ids:
                    add(ID=i, health=health)
                self._ids, self._response = frozenset(ids), response
            return self._ids, self._response
