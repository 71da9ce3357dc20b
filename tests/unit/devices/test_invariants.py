"""The runtime invariants below the daemon: the checker (atedevd/devices/invariants.py) finds each kind
of violation, and the tables with their claims (atedevd/devices/claims.py) hold every invariant
after each of a few thousand udev-like events (nodes plugged in and out under overlapping
patterns, links made, retargeted and removed, reloads racing unplugs), judged the way the
daemon judges them.

Nodes are links to the host's own character devices (/dev/null, /dev/zero, ...), as in the
simulation: no root needed. /dev/kmsg is the refused one."""

import os
import random

import inotify.constants as ic
import pytest

from atedevd.config import Device
from atedevd.daemon.watch import DirEvent
from atedevd.devices import claims as claims_mod
from atedevd.devices import invariants
from atedevd.devices.snapshot import UnitSnapshot
from atedevd.glue.resource import node_table

# Character devices every Linux host has, each its own numbers; /dev/mem is refused by the policy.
NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
REFUSED = "/dev/kmsg"  # the kernel log: every Linux host has it (not always /dev/mem)


class Resources:
    """What invariants.check reads of a Node: its resources' tables and published snapshots,
    looked at as a Resource looks (its `Reconcile`) (a resource another one pokes looks again)."""

    def __init__(self, devices, dev_root, registry=True):
        self.dev_root, self.sys_root = dev_root, "/sys"
        self.poked = set()
        self.claims = claims_mod.Claims(self.poked.add) if registry else None
        self.resources = {}
        self.apply(devices)

    def apply(self, devices):
        """A reload: unchanged tables forget (the nodes there now are accepted), the rest are made anew."""
        if self.claims is not None:
            self.claims.configure(devices, self.dev_root)
        old = self.resources
        self.resources = {}
        for d in devices:
            r = old.get(d.resource)
            if r is not None and r.device == d:
                r.table.forget()
            else:
                r = _Resource(d, node_table(d, self.dev_root, self.sys_root, self.claims))
            self.resources[d.resource] = r
        self.look()

    def look(self):
        for r in self.resources.values():
            r.look()
        for _ in range(len(self.resources) + 1):  # the daemon's loop wakes at once for a poked resource
            poked, self.poked = set(self.poked), set()
            for name in poked & set(self.resources):
                self.resources[name].look()
            if not poked:
                return


class _Resource:
    def __init__(self, device, table):
        self.device, self.table, self.version = device, table, 0
        self.look()

    def look(self):
        self.table.look()
        self.version += 1
        self.snapshot = self.table.snapshot(self.version)


def link(root, name, target):
    path = os.path.join(str(root), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)
    return path


def test_a_healthy_unit_whose_node_went_or_changed_is_a_violation_until_the_table_looks(tmp_path):
    link(tmp_path, "ttyUSB0", "/dev/null")
    link(tmp_path, "ttyUSB1", "/dev/zero")
    node = Resources([Device("a.dev/serial", "/dev/ttyUSB*")], str(tmp_path))
    check = invariants.Invariants()
    assert check.check(node) == []
    os.unlink(tmp_path / "ttyUSB1")
    assert check.check(node) == ["a.dev/serial: unit ttyUSB1 is Healthy but /dev/ttyUSB1 is gone"]
    node.look()
    assert check.check(node) == []
    link(tmp_path, "ttyUSB1", "/dev/full")  # back with other numbers
    link(tmp_path, "ttyUSB0", REFUSED)  # swapped for a refused node
    node.resources["a.dev/serial"].snapshot = _healthy_again(node.resources["a.dev/serial"].snapshot)
    zero = os.stat("/dev/zero").st_rdev
    assert sorted(check.check(node)) == [
        f"a.dev/serial: unit ttyUSB0 is Healthy but /dev/ttyUSB0 is {_mm(os.stat(REFUSED).st_rdev)}, not the "
        f"{_mm(os.stat('/dev/null').st_rdev)} first served",
        f"a.dev/serial: unit ttyUSB1 is Healthy but /dev/ttyUSB1 is {_mm(os.stat('/dev/full').st_rdev)}, not the "
        f"{_mm(zero)} first served"]
    node.look()
    assert check.check(node) == []
    assert {u.id: u.healthy for u in node.resources["a.dev/serial"].snapshot.by_id.values()} == {
        "ttyUSB0": False, "ttyUSB1": False}


def test_a_node_healthy_in_two_resources_is_a_violation_which_claims_prevent(tmp_path):
    link(tmp_path, "ttyUSB5", "/dev/null")
    devices = [Device("a.dev/all", "/dev/ttyUSB*"), Device("a.dev/digit", "/dev/ttyUSB[0-9]"),
               Device("a.dev/gps", "/dev/ttyUSB5", count=4)]
    null = _mm(os.stat("/dev/null").st_rdev)
    without = Resources(devices, str(tmp_path), registry=False)  # the tables alone: each serves it
    assert invariants.Invariants().check(without) == [
        f"char {null} is Healthy as a.dev/all's unit ttyUSB5 (/dev/ttyUSB5), a.dev/digit's unit ttyUSB5 (/dev/ttyUSB5), "
        "a.dev/gps's every unit (/dev/ttyUSB5)"]
    node = Resources(devices, str(tmp_path))
    assert invariants.Invariants().check(node) == []
    assert not any(r.snapshot.healthy for r in node.resources.values())
    assert [row.state for row in node.resources["a.dev/all"].table.listing()] == [
        "claimed: a.dev/digit reaches it too, as /dev/ttyUSB5"]


def test_an_id_that_meant_one_path_and_then_another_is_a_violation():
    from atedevd.devices.snapshot import Unit, UnitSnapshot

    device = Device("a.dev/serial", "/dev/serial/by-id/*")

    class Table:
        def __init__(self, path):
            self.path = path

        def served(self):
            return []

    class R:
        def __init__(self, path):
            self.device, self.table = device, Table(path)
            self.snapshot = UnitSnapshot(device, 1, (Unit("x~1", path, False),))

    class N:
        sys_root = "/sys"

    n = N()
    check = invariants.Invariants()
    n.resources = {device.resource: R("/dev/serial/by-id/a")}
    assert check.check(n) == []
    n.resources = {device.resource: R("/dev/serial/by-id/b")}
    assert check.check(n) == ["a.dev/serial: ID x~1 meant /dev/serial/by-id/a, now /dev/serial/by-id/b"]


# Two by-id names whose IDs were one under the 40 bits of hash IDs ended in until 2026-12 (found by
# a search of about a second): a USB adapter's maker chose the name, and so the other adapter's fate.
COLLIDED_ONCE = ("usb-Silicon_Labs_CP2102N_USB_to_UART_Bridge_Controller_000271a6-if00-port0",
                 "usb-Silicon_Labs_CP2102N_USB_to_UART_Bridge_Controller_000271c0-if00-port0")


def test_names_whose_ids_once_collided_are_two_units_now(tmp_path):
    import hashlib

    from atedevd.devices.patterns import unit_id

    first, second = (f"/dev/serial/by-id/{n}" for n in COLLIDED_ONCE)
    old = [hashlib.sha256(p.encode()).hexdigest()[:10] for p in (first, second)]
    assert old[0] == old[1]  # what the 40-bit ID was made of: one hash for both
    assert unit_id(first) != unit_id(second) and all(len(unit_id(p)) == 63 for p in (first, second))
    for name, target in zip(COLLIDED_ONCE, ("/dev/null", "/dev/zero")):
        link(tmp_path, f"serial/by-id/{name}", target)
    node = Resources([Device("a.dev/serial", "/dev/serial/by-id/*")], str(tmp_path))
    units = node.resources["a.dev/serial"].snapshot.by_id
    assert sorted(u.path for u in units.values() if u.healthy) == sorted([first, second])


def test_colliding_ids_are_refused_loudly_and_an_id_keeps_its_path_through_reloads(tmp_path, monkeypatch):
    """No two names share a 128-bit hash that anyone can find; if two IDs were one all the same,
    the second path is refused loudly, and an ID keeps its path through reloads."""
    from atedevd.devices import patterns

    first, second = COLLIDED_ONCE
    real = patterns.unit_id
    monkeypatch.setattr(patterns, "unit_id", lambda path: real(path.replace(first, second)))  # one ID for two names
    uid = patterns.unit_id(f"/dev/serial/by-id/{first}")
    assert uid == patterns.unit_id(f"/dev/serial/by-id/{second}")
    link(tmp_path, f"serial/by-id/{second}", "/dev/zero")
    node = Resources([Device("a.dev/serial", "/dev/serial/by-id/*")], str(tmp_path))
    table = node.resources["a.dev/serial"].table
    assert [(u.id, u.path) for u in table.units] == [(uid, f"/dev/serial/by-id/{second}")]  # the one there first
    link(tmp_path, f"serial/by-id/{first}", "/dev/null")
    changes, _ = table.look()
    assert [c.message for c in changes if c.level >= 40] == [
        f"/dev/serial/by-id/{first} would be unit {uid}, the ID /dev/serial/by-id/{second} has had since it was first "
        "seen: not advertised while atedevd runs; name one otherwise (a udev rule)"]
    os.unlink(tmp_path / "serial" / "by-id" / second)
    node.apply([Device("a.dev/serial", "/dev/serial/by-id/*", permissions="r")])  # a changed device: a new table
    assert node.resources["a.dev/serial"].snapshot.by_id == {}  # the ID is still the second path's
    assert invariants.Invariants().check(node) == []


@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(n, marks=pytest.mark.slow) for n in range(2, 12)])
def test_every_invariant_holds_after_each_udev_event(tmp_path, seed):
    """Nodes plugged in and out under overlapping patterns and a shareable path, by-id links
    made, retargeted (to a refused node too) and removed, nodes made anew under a link,
    reloads racing unplugs (the node goes between the event and the look): after each look,
    no node Healthy in two resources, no Healthy unit without its node, no ID for two paths."""
    rng = random.Random(seed)
    devices = [Device("a.dev/all", "/dev/ttyUSB[15]*"), Device("a.dev/digit", "/dev/ttyUSB[0-9]"),
               Device("a.dev/gps", "/dev/gps", count=4), Device("a.dev/by-id", "/dev/serial/by-id/*"),
               Device("a.dev/vfio", "/dev/vfio/*", companions=("/dev/vfio/vfio",))]
    names = ["ttyUSB1", "ttyUSB5", "ttyUSB7", "ttyUSB12", "ttyUSB50", "ttyACM0", "ttyACM1"]  # ttyACM*: no pattern's
    node = Resources(devices, str(tmp_path))
    check = invariants.Invariants()
    healthy_seen = set()
    for step in range(300):
        what = rng.random()
        if what < 0.35:  # udev: a node comes, goes, or is made anew with other numbers
            name = rng.choice(names)
            if os.path.lexists(tmp_path / name) and rng.random() < 0.5:
                os.unlink(tmp_path / name)
            else:
                link(tmp_path, name, rng.choice(NODES + (REFUSED,)))
        elif what < 0.6:  # a link made, retargeted or removed: a by-id one, or the shareable path's
            by_id = rng.choice([f"serial/by-id/usb-{rng.randrange(3)}", "gps"])
            if os.path.lexists(tmp_path / by_id) and rng.random() < 0.3:
                os.unlink(tmp_path / by_id)
            elif by_id == "gps":
                link(tmp_path, by_id, rng.choice(names + list(NODES)))
            else:
                link(tmp_path, by_id, f"../../{rng.choice(names)}")
        elif what < 0.75:  # a VFIO group or the container node
            name = rng.choice(["vfio/1", "vfio/2", "vfio/vfio"])
            if os.path.lexists(tmp_path / name) and rng.random() < 0.5:
                os.unlink(tmp_path / name)
            else:
                link(tmp_path, name, rng.choice(NODES))
        elif what < 0.85:  # a reload racing an unplug: the node goes, then the reload, then the look
            present = [n for n in names if os.path.lexists(tmp_path / n)]
            if present:
                os.unlink(tmp_path / rng.choice(present))
            node.apply(devices if rng.random() < 0.7 else rng.sample(devices, rng.randrange(1, len(devices) + 1)))
            assert check.check(node) == [], f"seed {seed}, step {step}: after a reload"
            continue
        else:  # the periodic look only
            pass
        node.look()
        problems = check.check(node)
        assert problems == [], f"seed {seed}, step {step}: {problems}"
        healthy_seen |= {(n, u.id) for n, r in node.resources.items() if isinstance(r.snapshot, UnitSnapshot)
                         for u in r.snapshot.by_id.values() if u.healthy}
        healthy_seen |= {(n, "*") for n, r in node.resources.items()
                         if not isinstance(r.snapshot, UnitSnapshot) and r.snapshot.healthy}
    served = {n for n, _ in healthy_seen}
    assert served == {"a.dev/all", "a.dev/digit", "a.dev/gps", "a.dev/by-id", "a.dev/vfio"}, served  # all exercised


def _mm(rdev):
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def _healthy_again(snapshot):
    """The snapshot as if the table had not looked since the nodes changed (a stale publish)."""
    units = tuple(u._replace(healthy=True) for u in snapshot.by_id.values())
    return UnitSnapshot(snapshot.device, snapshot.version, units)


# --- the daemon's own Node: the look has a deadline of its own, links' directories are watched ----


class _Host:
    """What a Node needs of its host when kubelet's directory is not there (nothing is served)."""

    plugin_dir = "/nonexistent/device-plugins"

    def __init__(self):
        self.said = []

    def identity(self, path):
        return None

    cdi = None

    def connections_visible(self):
        return True

    def isdir(self, path):
        return False

    def say(self, level, event, text, **fields):
        self.said.append((level, event, text))

    def monotonic(self):
        return 0.0

    def wall(self):
        return 0.0


def test_a_daemons_node_looks_at_its_nodes_on_a_deadline_of_its_own_and_watches_where_links_lead(tmp_path):
    """What the simulation does after each event: Invariants().check(node) on the daemon's own Node."""
    from atedevd.glue.plugin_dir import PluginDir
    from atedevd.glue.resource import LOOK_EVERY_S

    link(tmp_path, "ttyUSB0", "/dev/null")
    link(tmp_path, "serial/by-id/usb-gps", "../../ttyUSB0")
    node = PluginDir(_Host.plugin_dir, str(tmp_path), "/sys", _Host(), "r1", lambda path, error: False)
    node.apply([Device("a.dev/serial", "/dev/serial/by-id/*"), Device("a.dev/kvm", "/dev/kvm")], str(tmp_path), "/sys", 100.0)
    check = invariants.Invariants()
    # the pattern's directory, and every one its link leads through: ttyUSB0's, and the node's at the end
    assert node.directories_to_watch() == {str(tmp_path / "serial" / "by-id"), str(tmp_path), "/dev", _Host.plugin_dir}
    assert node.directories_to_watch() is None  # (asked again: nothing new)
    node.wake(100.0)
    assert check.check(node) == []
    assert node.deadline() == 100.0 + LOOK_EVERY_S  # the look's own (nothing is served: nothing else is due)
    serial = node.resources["a.dev/serial"]
    assert [u.healthy for u in serial.snapshot.by_id.values()] == [True]
    link(tmp_path, "ttyUSB0", REFUSED)  # its node made anew, and no event told
    node.wake(101.0)  # a wake-up for something else, within the period: not looked at yet
    assert check.check(node) == ["a.dev/serial: unit serial-by-id-usb-gps is Healthy but /dev/serial/by-id/usb-gps is "
                                 f"{_mm(os.stat(REFUSED).st_rdev)}, not the {_mm(os.stat('/dev/null').st_rdev)} first served"]
    node.wake(node.deadline())  # its own deadline
    assert check.check(node) == [] and [u.healthy for u in serial.snapshot.by_id.values()] == [False]
    link(tmp_path, "kvm", "ttyUSB0")  # now the shareable path reaches a node the pattern hands out ...
    link(tmp_path, "ttyUSB0", "/dev/zero")
    node.on_directory_events([DirEvent(str(tmp_path), name, ic.IN_CREATE) for name in ("kvm", "ttyUSB0")], 103.0)
    node.wake(103.0)
    assert not node.resources["a.dev/kvm"].snapshot.healthy and not serial.snapshot.healthy  # ... each told by the events
    assert check.check(node) == []
    assert [r.state for r in serial.table.listing()] == ["claimed: a.dev/kvm reaches it too, as /dev/kvm"]
    node.begin_stop(104.0)
    assert node.deadline() is None  # stopping: no more looks, no spinning
