"""The device table of one resource: presence on the node, unit IDs, health snapshots.

A device node is advertised as `count` shareable units. Presence is read from
the node (a character device under the dev root); what kubelet sees is an
immutable `Snapshot`, so gRPC threads never share mutable state with the loop.
"""

import os
import stat
from dataclasses import dataclass
from typing import FrozenSet

from atedevd.api import pb
from atedevd.config import Device, file_type

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


def presence(device: Device, dev_root: str) -> str:
    """'present', or why not: only a character device can be granted to a container."""
    try:
        st = os.stat(device.host_path(dev_root))  # follows symlinks, as opening it would
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if stat.S_ISCHR(st.st_mode):
        return "present"
    return f"a {file_type(st.st_mode)}, not a character device"


def unit_ids(device: Device) -> tuple:
    """`kvm-0` … `kvm-4095`: the units kubelet counts and hands out."""
    return tuple(device.unit_id(i) for i in range(device.count))


@dataclass(frozen=True)
class Snapshot:
    """What ListAndWatch sends for one resource at one moment; never mutated."""

    version: int
    healthy: bool
    ids: FrozenSet[str]
    response: pb.ListAndWatchResponse

    @classmethod
    def build(cls, device: Device, healthy: bool, version: int) -> "Snapshot":
        ids = unit_ids(device)
        health = HEALTHY if healthy else UNHEALTHY
        response = pb.ListAndWatchResponse()
        add = response.devices.add  # half the time of a list of pb.Device: 1.8 ms for 4096, on every start
        for i in ids:
            add(ID=i, health=health)
        return cls(version=version, healthy=healthy, ids=frozenset(ids), response=response)
