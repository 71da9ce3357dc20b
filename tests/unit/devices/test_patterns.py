"""Pattern devices below the daemon: matching, stable IDs, the table of units and its
judgements, NUMA placement, the preferred allocation, the configuration's checks of
patterns and companions, and the trust check of the configuration file."""

import io
import logging
import os

import pytest

from atedevd import config
from atedevd.check import report as check
from atedevd.config import Device
from atedevd.config_file import load as loader
from atedevd.config_file.load import ConfigError
from atedevd.devices import patterns, placement, policy
from atedevd.glue.resource import node_table
from rig.nodes import fake_vfio_sysfs, mknod, vfio_nodes

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and chown need root")
VFIO = Device("ate.dev/vfio", "/dev/vfio/[0-9]*", companions=("/dev/vfio/vfio",))


def look(table):
    changes, changed = table.look()
    return changes, changed, {u.id: (u.path, u.healthy) for u in table.snapshot(1).by_id.values()}


# --- matching and IDs ------------------------------------------------------------------------


def test_a_pattern_matches_names_in_one_directory_as_the_shell_does(tmp_path):
    for name in ("ttyUSB0", "ttyUSB1", "ttyUSB10", ".ttyUSB9", "ttyS0"):
        (tmp_path / name).write_text("")
    assert config.Pattern("/dev/ttyUSB*", str(tmp_path)).names() == ["ttyUSB0", "ttyUSB1", "ttyUSB10"]
    assert config.Pattern("/dev/tty*", str(tmp_path)).names() == ["ttyS0", "ttyUSB0", "ttyUSB1", "ttyUSB10"]
    assert config.Pattern("/dev/.tty*", str(tmp_path)).names() == [".ttyUSB9"]
    assert config.Pattern("/dev/vfio/[0-9]*", str(tmp_path)).names() == []  # no directory: nothing, no error


def test_an_id_is_the_path_under_dev_and_never_two_paths_share_one():
    assert patterns.unit_id("/dev/ttyUSB0") == "ttyUSB0"
    assert patterns.unit_id("/dev/vfio/12") == "vfio-12"
    link = "/dev/serial/by-id/usb-Silicon_Labs_CP2102N_USB_to_UART_Bridge_Controller_d2b0a2c4c2e4eb11a5a2-if00-port0"
    long_id = patterns.unit_id(link)
    assert len(long_id) == 63 and long_id.startswith("serial-by-id-usb-Silicon_Labs") and "~" in long_id
    assert patterns.unit_id(link + "1") != long_id  # the hash is of the whole path
    odd = patterns.unit_id("/dev/weird name")
    assert odd.startswith("weird_name~") and odd != patterns.unit_id("/dev/weird_name") == "weird_name"
    assert patterns.unit_id("/dev/vfio/12") == patterns.unit_id("/dev/vfio/12")  # a function of the path alone


# --- the configuration ------------------------------------------------------------------------


def load(tmp_path, text, dev_root=None, sys_root=None):
    path = tmp_path / "c.toml"
    daemon = f'[daemon]\ndev_root = "{dev_root or tmp_path / "nodev"}"\n'
    if sys_root:
        daemon += f'sys_root = "{sys_root}"\n'
    path.write_text(daemon + text)
    return loader.load(str(path), required=True)


def errors(tmp_path, text, **kw):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text, **kw)
    return e.value.errors


def test_pattern_and_companions_are_read(tmp_path):
    cfg = load(tmp_path, '[[device]]\nresource = "ate.dev/vfio"\npath = "/dev/vfio/[0-9]*"\n'
                         'companions = ["/dev/vfio/vfio"]\npermissions = "rwm"\n')
    (dev,) = cfg.devices
    assert dev.pattern and dev.companions == ("/dev/vfio/vfio",) and dev.permissions == "rwm"
    assert not config.Device("ate.dev/kvm", "/dev/kvm").pattern


@pytest.mark.parametrize("table,message", [
    ('path = "/dev/*/tty0"', 'a pattern may only be in the last part of the path'),
    ('path = "/dev/ttyUSB*"\ncount = 4', "count: a pattern path is one unit per matching node"),
    ('path = "/dev/vfio/*"\ncompanions = "/dev/vfio/vfio"', "companions: must be an array of paths, got string"),
    ('path = "/dev/vfio/*"\ncompanions = ["vfio"]', 'companions: "vfio" must be an absolute path under /dev/'),
    ('path = "/dev/vfio/*"\ncompanions = ["/dev/vfio/*"]', "a companion is one node, not a pattern"),
    ('path = "/dev/vfio/*"\ncompanions = ["/dev/a", "/dev/a"]', "companions: lists a path twice"),
    ('path = "/dev/kvm"\ncompanions = ["/dev/kvm"]', "companions: \"/dev/kvm\" is the device's own path"),
])
def test_pattern_mistakes_are_named_with_their_line(tmp_path, table, message):
    errs = errors(tmp_path, f'[[device]]\nresource = "a.dev/x"\n{table}\n')
    assert len(errs) == 1 and message in errs[0], errs
    assert errs[0].startswith(f"{tmp_path / 'c.toml'}:"), errs  # FILE:LINE


@needs_root
def test_a_refused_companion_fails_the_configuration_a_refused_match_does_not(tmp_path):
    dev = tmp_path / "dev"
    mknod(dev, "vfio/12", 243, 0)
    mknod(dev, "vfio/vfio", 1, 1)  # the "companion" is /dev/mem
    mknod(dev, "m0", 1, 1)
    errs = errors(tmp_path, '[[device]]\nresource = "a.dev/x"\npath = "/dev/vfio/[0-9]*"\ncompanions = ["/dev/vfio/vfio"]\n',
                  dev_root=dev)
    assert len(errs) == 1 and "[[device]] #1 companions: \"/dev/vfio/vfio\" (a.dev/x): refused:" in errs[0], errs
    assert "is physical memory" in errs[0] and errs[0].startswith(f"{tmp_path / 'c.toml'}:6:")
    cfg = load(tmp_path, '[[device]]\nresource = "a.dev/m"\npath = "/dev/m*"\n', dev_root=dev)
    out = io.StringIO()
    assert check.check_config(cfg.source, out, required=True) == 0
    assert f"WARNING: a.dev/m: /dev/m* matches {dev}/m0 (1:1), not advertised: refused:" in out.getvalue()


@needs_root
def test_a_node_a_pattern_hands_out_and_another_device_reaches_is_named_not_a_configuration_error(tmp_path):
    """Which nodes two entries share depends on what udev made: the daemon serves neither
    (atedevd/devices/claims.py) and `check-config` says so, at start as later; it is no reason to
    refuse the configuration (a node plugged in while the daemon ran would refuse its next start)."""
    dev = tmp_path / "dev"
    mknod(dev, "ttyUSB0", 188, 0)
    mknod(dev, "ttyUSB1", 188, 1)
    os.symlink("ttyUSB0", dev / "gps")
    cfg = load(tmp_path, '[[device]]\nresource = "a.dev/serial"\npath = "/dev/ttyUSB*"\n'
                         '[[device]]\nresource = "a.dev/gps"\npath = "/dev/gps"\n', dev_root=dev)
    out = io.StringIO()
    assert check.check_config(cfg.source, out, required=True) == 0
    assert (f"WARNING: a.dev/serial: /dev/ttyUSB* matches {dev}/ttyUSB0 (188:0), not advertised: claimed: a.dev/gps "
            "reaches it too, as /dev/gps") in out.getvalue(), out.getvalue()
    rows = {n["path"]: n for n in check.node_rows(cfg, cfg.devices[0])}
    assert rows["/dev/ttyUSB1"]["state"] == "ok" and rows["/dev/ttyUSB1"]["id"] == "ttyUSB1"
    assert rows["/dev/ttyUSB0"]["role"] == "match" and rows["/dev/ttyUSB0"]["id"] is None
    [gps] = check.node_rows(cfg, cfg.devices[1])
    assert gps["state"] == "claimed: a.dev/serial reaches it too, as /dev/ttyUSB0", gps
    problems = [f.message for f in check.collect(cfg, lambda: None).problems if f.check == "device"]
    assert f"{dev}/gps: claimed: a.dev/serial reaches it too, as /dev/ttyUSB0" in problems, problems  # NOT READY


# --- the table of a pattern's units ------------------------------------------------------------


@needs_root
def test_units_come_and_go_one_by_one_and_ids_follow_the_path(tmp_path):
    dev = tmp_path / "dev"
    for i in range(3):
        mknod(dev, f"ttyUSB{i}", 188, i)
    t = node_table(Device("a.dev/s", "/dev/ttyUSB*"), str(dev), str(tmp_path / "nosys"))
    changes, changed, units = look(t)
    assert changed and units == {f"ttyUSB{i}": (f"/dev/ttyUSB{i}", True) for i in range(3)}
    assert [c.message for c in changes if c.level >= logging.INFO] == [
        "3 units from /dev/ttyUSB*: ttyUSB0 (188:0), ttyUSB1 (188:1), ttyUSB2 (188:2)"]
    assert look(t)[:2] == ([], False)  # nothing new: nothing said, nothing sent
    os.unlink(dev / "ttyUSB1")
    changes, changed, units = look(t)
    assert changed and units["ttyUSB1"] == ("/dev/ttyUSB1", False) and units["ttyUSB0"][1] and units["ttyUSB2"][1]
    assert [(c.level, c.device) for c in changes] == [(logging.WARNING, "/dev/ttyUSB1")]
    mknod(dev, "ttyUSB3", 188, 3)
    changes, changed, units = look(t)
    assert changed and units["ttyUSB3"] == ("/dev/ttyUSB3", True)
    assert "/dev/ttyUSB3 appeared; advertising it as unit ttyUSB3" in changes[0].message
    mknod(dev, "ttyUSB1", 188, 1)
    assert look(t)[2]["ttyUSB1"] == ("/dev/ttyUSB1", True)
    assert t.snapshot(7).units == 4 and t.snapshot(7).healthy_units == 4 and t.snapshot(7).healthy


@needs_root
def test_numbers_once_served_are_that_units_until_a_reload(tmp_path):
    """A container keeps its device rule by number: another node with those numbers (a VFIO group
    made anew, an adapter re-plugged) is not a second unit; nor is a second link to one node."""
    dev = tmp_path / "dev"
    mknod(dev, "ttyUSB0", 188, 0)
    os.symlink("ttyUSB0", dev / "ttyUSBlink")
    t = node_table(Device("a.dev/s", "/dev/ttyUSB*"), str(dev), str(tmp_path / "nosys"))
    changes, _, units = look(t)
    assert units == {"ttyUSB0": ("/dev/ttyUSB0", True)}
    assert any(c.event == "device-conflict" and "the same node as unit ttyUSB0" in c.message for c in changes), changes
    os.unlink(dev / "ttyUSBlink")
    os.unlink(dev / "ttyUSB0")
    look(t)
    mknod(dev, "ttyUSB5", 188, 0)  # a new node with the numbers ttyUSB0 was served with
    changes, changed, units = look(t)
    assert not changed and units == {"ttyUSB0": ("/dev/ttyUSB0", False)}
    [c] = changes
    assert c.level == logging.ERROR and c.event == "device-conflict"
    assert "the node first served as unit ttyUSB0 (/dev/ttyUSB0, missing): not advertised" in c.message
    assert "a reload accepts it" in c.message
    mknod(dev, "ttyUSB0", 188, 7)  # ttyUSB0 back with other numbers: not the node first served
    changes, _, units = look(t)
    assert units["ttyUSB0"] == ("/dev/ttyUSB0", False) and changes[0].event == "device-changed"
    assert "not the 188:0 first served as unit ttyUSB0" in changes[0].message
    t.forget()  # a reload: the nodes there now are accepted
    changes, changed, units = look(t)
    assert changed and units == {"ttyUSB0": ("/dev/ttyUSB0", True), "ttyUSB5": ("/dev/ttyUSB5", True)}


@needs_root
def test_companions_travel_with_every_unit_and_a_missing_one_takes_them_all(tmp_path):
    dev = tmp_path / "dev"
    vfio_nodes(dev, 12, 13)
    t = node_table(Device("a.dev/v", "/dev/vfio/*", companions=("/dev/vfio/vfio",)), str(dev), str(tmp_path / "nosys"))
    assert look(t)[2] == {"vfio-12": ("/dev/vfio/12", True), "vfio-13": ("/dev/vfio/13", True)}  # vfio is no unit
    os.unlink(dev / "vfio" / "vfio")
    changes, changed, units = look(t)
    assert changed and not any(h for _, h in units.values()) and not t.healthy
    assert changes[0].message.startswith("companion /dev/vfio/vfio is missing") and changes[0].device == "/dev/vfio/vfio"
    mknod(dev, "vfio/vfio", 10, 196)
    assert all(h for _, h in look(t)[2].values())


@needs_root
def test_vfio_groups_carry_their_numa_node_and_a_noiommu_group_is_refused(tmp_path):
    dev = tmp_path / "dev"
    vfio_nodes(dev, 12, 13, "noiommu-0")
    sys_root = fake_vfio_sysfs(tmp_path / "sys", {12: (0, 1, "0000:3b:00.0"), 13: (1, -1, "0000:af:00.0"),
                                                  "noiommu-0": (2, 0, None)})
    t = node_table(Device("a.dev/v", "/dev/vfio/*", companions=("/dev/vfio/vfio",)), str(dev), sys_root)
    changes, _, _ = look(t)
    snap = t.snapshot(1)
    assert snap.by_id["vfio-12"].numa == (1,) and snap.by_id["vfio-13"].numa == ()  # -1: sysfs does not know
    assert set(snap.by_id) == {"vfio-12", "vfio-13"}
    refused = [c for c in changes if c.event == "device-refused"]
    assert len(refused) == 1 and refused[0].level == logging.ERROR and refused[0].device == "/dev/vfio/noiommu-0"
    assert "a VFIO group without an IOMMU" in refused[0].message and refused[0].message.endswith("; not advertised")
    (d12,) = [d for d in snap.response.devices if d.ID == "vfio-12"]
    assert [n.ID for n in d12.topology.nodes] == [1]
    (d13,) = [d for d in snap.response.devices if d.ID == "vfio-13"]
    assert not d13.HasField("topology")
    rows = {r.path: r for r in t.listing()}
    assert rows["/dev/vfio/12"].pci == ("0000:3b:00.0",) and rows["/dev/vfio/12"].device_number == "243:0"
    assert not rows["/dev/vfio/noiommu-0"].allowed and rows["/dev/vfio/noiommu-0"].id is None
    assert rows["/dev/vfio/vfio"].role == "companion" and rows["/dev/vfio/vfio"].state == "ok"


def test_a_usb_adapters_numa_node_is_its_controllers(tmp_path):
    """The nearest ancestor in sysfs with a numa_node says where a node's hardware sits."""
    sys_root = tmp_path / "sys"
    pci = sys_root / "devices" / "pci0000:00" / "0000:00:14.0"
    tty = pci / "usb1" / "1-2" / "1-2:1.0" / "ttyUSB0"
    tty.mkdir(parents=True)
    (pci / "numa_node").write_text("1\n")
    (sys_root / "dev" / "char" / "188:0").mkdir(parents=True)
    os.symlink(tty.parent, sys_root / "dev" / "char" / "188:0" / "device")
    node = policy.DeviceNode("/dev/ttyUSB0", "/dev/ttyUSB0", "char", 188, 0)
    assert placement.placement(node, str(sys_root)) == ((1,), ())
    (pci / "numa_node").write_text("-1\n")
    assert placement.placement(node, str(sys_root)) == ((), ())
