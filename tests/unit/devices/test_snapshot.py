"""Snapshots, one kind per table: what they count, what their grants make; and the preferred allocation
of a pattern's units (atedevd/devices/patterns.py)."""

import os

import pytest

from atedevd.config import Device
from atedevd.devices import patterns, snapshot

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and chown need root")
VFIO = Device("ate.dev/vfio", "/dev/vfio/[0-9]*", companions=("/dev/vfio/vfio",))


def look(table):
    changes, changed = table.look()
    return changes, changed, {u.id: (u.path, u.healthy) for u in table.snapshot(1).by_id.values()}


# --- snapshots and the preferred allocation ---------------------------------------------------


def test_a_snapshot_counts_its_units_and_the_healthy_ones():
    kvm = (snapshot.NodeGrant("/dev/kvm", 10, 232),)
    shared = snapshot.SharedSnapshot(Device("a.dev/kvm", "/dev/kvm", 8), True, 1, kvm)
    assert (shared.units, shared.healthy_units, shared.grants()) == (8, 8, {None: kvm})
    down = snapshot.SharedSnapshot(Device("a.dev/kvm", "/dev/kvm", 8), False, 1, kvm)
    assert (down.healthy_units, down.grants()) == (0, {})  # nothing granted: no numbers carried
    a = (snapshot.NodeGrant("/dev/a", 188, 0),)
    units = (snapshot.Unit("a", "/dev/a", True, (0,), a), snapshot.Unit("b", "/dev/b", False))
    snap = snapshot.UnitSnapshot(Device("a.dev/x", "/dev/*"), 2, units)
    assert (snap.units, snap.healthy_units, snap.healthy, snap.grants()) == (2, 1, True, {"a": a})  # at least one is
    again = snap.again()
    assert again is not snap and again.by_id == snap.by_id and again.ids == {"a", "b"}
    assert type(again) is snapshot.UnitSnapshot and type(shared.again()) is snapshot.SharedSnapshot
    assert not snapshot.UnitSnapshot(Device("a.dev/x", "/dev/*"), 3, ()).healthy


NUMA = {"n0-a": (0,), "n0-b": (0,), "n1-a": (1,), "n1-b": (1,), "n1-c": (1,), "none": ()}


@pytest.mark.parametrize("must,size,expected", [
    ([], 1, ["n0-a"]),  # a node that fits with the least to spare
    ([], 2, ["n0-a", "n0-b"]),
    ([], 3, ["n1-a", "n1-b", "n1-c"]),  # the only node with three
    (["n1-b"], 2, ["n1-b", "n1-a"]),  # beside the unit that must be given
    ([], 4, ["n1-a", "n1-b", "n1-c", "n0-a"]),  # no node has four: as few nodes as can be
    ([], 6, ["n1-a", "n1-b", "n1-c", "n0-a", "n0-b", "none"]),
])
def test_the_preferred_allocation_keeps_a_container_on_one_numa_node(must, size, expected):
    available = ["none", "n1-c", "n0-b", "n1-a", "n0-a", "n1-b"]  # kubelet's order is a map's
    assert patterns.preferred(available, must, size, lambda i: NUMA[i]) == expected
