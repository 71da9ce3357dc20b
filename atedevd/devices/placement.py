"""Where a node sits: its NUMA node and PCI address, as sysfs tells them (`TopologyInfo`, `check`)."""

import os
from typing import Dict, Optional, Tuple

from atedevd.devices import policy


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
