"""Pattern devices, the daemon as a process: nodes made with mknod under a dev root (and a
fabricated sysfs where the policy and the NUMA node need one), matched, hot-plugged and
unplugged one by one, allocated with their companions, with IDs that survive a restart
and nodes made anew in another order; refused matches; an untrusted configuration."""

import os
import re
import signal
import subprocess
import sys

import grpc
import pytest

from atedevd.api import pb
from rig.harness import REPO, wait_until, write_file
from rig.nodes import fake_vfio_sysfs, mknod, vfio_nodes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (CI runs as root)")

SERIAL, VFIO = "ate.dev/serial", "ate.dev/vfio"
SERIAL_TOML = f'[[device]]\nresource = "{SERIAL}"\npath = "/dev/ttyUSB*"\n'
VFIO_TOML = (f'[[device]]\nresource = "{VFIO}"\npath = "/dev/vfio/[0-9]*"\ncompanions = ["/dev/vfio/vfio"]\n'
             'permissions = "rw"\n')


def health(kubelet, resource):
    return kubelet.devices(resource)


def reload(d):
    n = len(d.notify.messages)
    d.send(signal.SIGHUP)
    assert d.notify.wait_for("RELOADING", "1", timeout=5, after=n)
    assert d.notify.wait_for("READY", "1", timeout=5, after=n)


def serial_nodes(dev_root, n):
    for i in range(n):
        mknod(dev_root, f"ttyUSB{i}", 188, i)


def allocated_paths(kubelet, resource, ids):
    return [(s.host_path, s.container_path, s.permissions)
            for s in kubelet.allocate(resource, ids).container_responses[0].devices]


def test_nodes_are_matched_unplugged_and_plugged_one_by_one(start_daemon, kubelet, dev_root, tmp_path):
    serial_nodes(dev_root, 3)
    d = start_daemon(config=write_file(tmp_path / "c.toml", SERIAL_TOML))
    d.wait_ready()
    assert kubelet.wait_connected(SERIAL), d.log()
    assert kubelet.wait(lambda: health(kubelet, SERIAL) == dict.fromkeys(["ttyUSB0", "ttyUSB1", "ttyUSB2"], "Healthy"), 5)
    assert "3 units from /dev/ttyUSB*: ttyUSB0 (188:0), ttyUSB1 (188:1), ttyUSB2 (188:2)" in d.log()
    os.unlink(os.path.join(dev_root, "ttyUSB1"))  # unplugged: its unit only
    assert kubelet.wait(lambda: health(kubelet, SERIAL) == {"ttyUSB0": "Healthy", "ttyUSB1": "Unhealthy", "ttyUSB2": "Healthy"}, 5), d.log()
    assert kubelet.capacity(SERIAL) == 2 and kubelet.allocatable(SERIAL) == 2
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate(SERIAL, ["ttyUSB1"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'ttyUSB1' (/dev/ttyUSB1)" in e.value.details()
    assert allocated_paths(kubelet, SERIAL, ["ttyUSB2"]) == [("/dev/ttyUSB2", "/dev/ttyUSB2", "rw")]
    mknod(dev_root, "ttyUSB3", 188, 3)  # plugged: advertised without a restart
    assert kubelet.wait(lambda: health(kubelet, SERIAL).get("ttyUSB3") == "Healthy", 5), d.log()
    mknod(dev_root, "ttyUSB1", 188, 1)  # back
    assert kubelet.wait(lambda: set(health(kubelet, SERIAL).values()) == {"Healthy"} and len(health(kubelet, SERIAL)) == 4, 5)
    assert wait_until(lambda: f"{SERIAL}: registered, 4/4 healthy" in (d.status() or ""), 5), d.status()
    assert kubelet.registration_count(SERIAL) == 1  # every change rode the stream
    log = d.log()
    assert re.search(r"WARNING ate.dev/serial: /dev/ttyUSB1 is gone \(.*/ttyUSB1\); unit ttyUSB1 is Unhealthy", log), log
    assert "INFO ate.dev/serial: /dev/ttyUSB3 appeared; advertising it as unit ttyUSB3 (" in log
    assert "INFO ate.dev/serial: /dev/ttyUSB1 is present again: unit ttyUSB1" in log
    # the shareable default is untouched by all of it
    assert kubelet.capacity("ate.dev/kvm") == 0  # not configured here
    client = kubelet.clients[SERIAL]
    assert client.options.get_preferred_allocation_available


def test_a_pattern_that_matches_nothing_is_not_advertised_until_a_node_appears(start_daemon, kubelet, dev_root, tmp_path, plugin_dir):
    d = start_daemon(config=write_file(tmp_path / "c.toml", VFIO_TOML))
    d.wait_ready()
    assert wait_until(lambda: "no node matches /dev/vfio/[0-9]*, not advertised" in (d.status() or ""), 5), d.status()
    assert kubelet.registration_count(VFIO) == 0
    mknod(dev_root, "vfio/vfio", 10, 196)  # the directory appears with the driver
    mknod(dev_root, "vfio/12", 243, 0)
    assert kubelet.wait_connected(VFIO, timeout=5), d.log()
    assert kubelet.wait(lambda: health(kubelet, VFIO) == {"vfio-12": "Healthy"}, 5), d.log()


def test_companions_come_in_the_same_answer_and_a_missing_one_stops_every_unit(start_daemon, kubelet, dev_root, tmp_path):
    vfio_nodes(dev_root, 12, 13)
    d = start_daemon(config=write_file(tmp_path / "c.toml", VFIO_TOML.replace('"rw"', '"rwm"')))
    d.wait_ready()
    assert kubelet.wait_connected(VFIO), d.log()
    assert kubelet.wait(lambda: health(kubelet, VFIO) == {"vfio-12": "Healthy", "vfio-13": "Healthy"}, 5)
    assert allocated_paths(kubelet, VFIO, ["vfio-13"]) == [("/dev/vfio/13", "/dev/vfio/13", "rwm"),
                                                          ("/dev/vfio/vfio", "/dev/vfio/vfio", "rwm")]
    assert allocated_paths(kubelet, VFIO, ["vfio-12", "vfio-13"]) == [  # one container, two groups: vfio once
        ("/dev/vfio/12", "/dev/vfio/12", "rwm"), ("/dev/vfio/13", "/dev/vfio/13", "rwm"), ("/dev/vfio/vfio", "/dev/vfio/vfio", "rwm")]
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate(VFIO, ["vfio-14"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'vfio-14'" in e.value.details()
    os.unlink(os.path.join(dev_root, "vfio", "vfio"))
    assert kubelet.wait(lambda: set(health(kubelet, VFIO).values()) == {"Unhealthy"}, 5), d.log()
    assert "companion /dev/vfio/vfio is missing" in d.log()
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate(VFIO, ["vfio-12"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    mknod(dev_root, "vfio/vfio", 10, 196)
    assert kubelet.wait(lambda: set(health(kubelet, VFIO).values()) == {"Healthy"}, 5), d.log()


def test_numa_nodes_reach_kubelet_and_the_preferred_allocation_keeps_to_one(start_daemon, kubelet, dev_root, tmp_path):
    mknod(dev_root, "vfio/vfio", 10, 196)
    groups = {}
    for g in range(4):  # groups 10, 11 on NUMA node 0; 12, 13 on node 1
        mknod(dev_root, f"vfio/{10 + g}", 243, g)
        groups[10 + g] = (g, g // 2, f"0000:{0x3b + g:02x}:00.0")
    sys_root = fake_vfio_sysfs(tmp_path / "sys", groups)
    d = start_daemon(config=write_file(tmp_path / "c.toml", VFIO_TOML), extra_args=["--sys-root", sys_root])
    d.wait_ready()
    assert kubelet.wait_connected(VFIO), d.log()
    assert kubelet.wait(lambda: len(kubelet.manager.all_devices.get(VFIO, {})) == 4, 5)
    with kubelet.cond:
        numa = {i: nodes for i, (_, nodes) in kubelet.manager.all_devices[VFIO].items()}
    assert numa == {"vfio-10": [0], "vfio-11": [0], "vfio-12": [1], "vfio-13": [1]}
    allocatable = kubelet.get_allocatable_resources()
    assert {(d.device_ids[0], d.topology.nodes[0].ID) for d in allocatable.devices if d.resource_name == VFIO} == {
        ("vfio-10", 0), ("vfio-11", 0), ("vfio-12", 1), ("vfio-13", 1)}
    stub = kubelet.clients[VFIO].conn.stub
    req = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=["vfio-13", "vfio-10", "vfio-12", "vfio-11"], must_include_deviceIDs=["vfio-12"],
        allocation_size=2)])
    assert list(stub.GetPreferredAllocation(req).container_responses[0].deviceIDs) == ["vfio-12", "vfio-13"]
    assert "2 units" not in d.log() and "(243:0, NUMA 0)" in d.log()


def test_kvm_keeps_its_defaults_beside_a_pattern(start_daemon, kubelet, dev_root, tmp_path):
    serial_nodes(dev_root, 2)
    d = start_daemon(config=write_file(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n' + SERIAL_TOML))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm") and kubelet.wait_connected(SERIAL), d.log()
    assert kubelet.wait(lambda: kubelet.capacity("ate.dev/kvm") == 1024 and kubelet.capacity(SERIAL) == 2, 5)
    assert not kubelet.clients["ate.dev/kvm"].options.get_preferred_allocation_available  # interchangeable units
    assert allocated_paths(kubelet, "ate.dev/kvm", ["kvm-0", "kvm-7"]) == [("/dev/kvm", "/dev/kvm", "rw")]


def test_ids_survive_a_restart_and_nodes_made_anew_in_another_order(start_daemon, kubelet, dev_root, tmp_path):
    """kubelet's checkpoint maps IDs to running pods: an ID must name the same node after a
    daemon restart and after the nodes are made again in another order (a reboot, a re-plug)."""
    names = [f"ttyUSB{i}" for i in (0, 1, 2, 3)]
    for i, name in enumerate(names):
        mknod(dev_root, name, 188, i)
    cfg = write_file(tmp_path / "c.toml", SERIAL_TOML)

    def served(registrations):
        d = start_daemon(config=cfg)
        d.wait_ready()
        assert kubelet.wait_connected(SERIAL, registrations=registrations), d.log()
        assert kubelet.wait(lambda: list(health(kubelet, SERIAL).values()) == ["Healthy"] * 4, 5), d.log()
        got = {i: allocated_paths(kubelet, SERIAL, [i])[0][0] for i in sorted(health(kubelet, SERIAL))}
        assert d.stop() == 0
        return got

    first = served(1)
    assert first == {name: f"/dev/{name}" for name in names}
    assert served(2) == first  # a restart
    for name in names:
        os.unlink(os.path.join(dev_root, name))
    for name in reversed(names):  # made anew, last first (other inodes, another directory order)
        mknod(dev_root, name, 188, int(name[-1]))
    assert served(3) == first


def test_a_pattern_never_reaches_a_refused_node(start_daemon, kubelet, dev_root, tmp_path, plugin_dir):
    """/dev/* must not pull in /dev/mem; /dev/vfio/* must not pull in a group without an IOMMU:
    each named at start, on reload and when it appears later, in the journal and in `check`."""
    mknod(dev_root, "mem", 1, 1)
    mknod(dev_root, "ttyS0", 4, 64)
    mknod(dev_root, "vfio/vfio", 10, 196)
    mknod(dev_root, "vfio/12", 243, 0)
    mknod(dev_root, "vfio/noiommu-0", 243, 1)
    sys_root = fake_vfio_sysfs(tmp_path / "sys", {12: (0, 0, "0000:3b:00.0"), "noiommu-0": (1, 0, None)})
    cfg = write_file(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/all"\npath = "/dev/*"\n'
                                     f'[[device]]\nresource = "{VFIO}"\npath = "/dev/vfio/*"\ncompanions = ["/dev/vfio/vfio"]\n')
    d = start_daemon(config=cfg, extra_args=["--sys-root", sys_root])
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/all") and kubelet.wait_connected(VFIO), d.log()
    assert kubelet.wait(lambda: health(kubelet, VFIO) == {"vfio-12": "Healthy"}, 5), d.log()
    units = set(health(kubelet, "ate.dev/all"))
    assert "mem" not in units and "ttyS0" in units and "kvm" in units  # the fake root's kvm: a link to /dev/null
    mem = r"ERROR ate.dev/all: /dev/mem: refused: .*/mem \(char 1:1, .*\) is physical memory .*; not advertised"
    noiommu = r"ERROR ate.dev/vfio: /dev/vfio/noiommu-0: refused: .* is a VFIO group without an IOMMU .*; not advertised"
    assert re.search(mem, d.log()) and re.search(noiommu, d.log()), d.log()
    assert len(re.findall(mem, d.log())) == 1
    reload(d)
    assert wait_until(lambda: len(re.findall(mem, d.log())) == 2, 5), d.log()  # named again on reload
    mknod(dev_root, "port", 1, 4)  # appears later
    assert wait_until(lambda: re.search(r"ERROR ate.dev/all: /dev/port: refused: .* is I/O ports", d.log()), 5), d.log()
    assert "port" not in health(kubelet, "ate.dev/all")
    out = subprocess.run([sys.executable, "-m", "atedevd", "check", "--config", cfg, "--dev-root", dev_root,
                          "--sys-root", sys_root, "--device-plugin-dir", plugin_dir],
                         cwd=REPO, capture_output=True, text=True)
    assert re.search(r"\n-\s+/dev/mem\s+1:1\s+-\s+-\s+yes\s+no\s+refused: ", out.stdout), out.stdout
    assert re.search(r"\nvfio-12\s+/dev/vfio/12\s+243:0\s+0\s+0000:3b:00.0\s+yes\s+yes\s+ok", out.stdout), out.stdout
    assert f"WARNING: {VFIO}: /dev/vfio/* matches {dev_root}/vfio/noiommu-0 (243:1), not advertised: refused:" in out.stdout
    assert kubelet.registration_count("ate.dev/all") == 1


def test_a_configuration_others_can_write_is_refused_at_start_and_on_reload(start_daemon, kubelet, dev_root, tmp_path):
    serial_nodes(dev_root, 2)
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir(mode=0o755)
    cfg = write_file(conf_dir / "config.toml", SERIAL_TOML, mode=0o666)
    d = start_daemon(config=cfg)
    assert d.wait(10) == 78
    log = d.log()
    assert "configuration error, not starting" in log
    assert f"{cfg}: not trusted: {cfg} is writable by its group and others (owner root:root, mode 0666): chmod go-w {cfg}" in log
    assert kubelet.registration_count(SERIAL) == 0
    check = subprocess.run([sys.executable, "-m", "atedevd", "check-config", "--config", cfg], cwd=REPO,
                           capture_output=True, text=True)
    assert check.returncode == 78 and "not trusted" in check.stderr and "mode 0666" in check.stderr

    os.chmod(cfg, 0o644)
    d = start_daemon(config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected(SERIAL), d.log()
    write_file(cfg, SERIAL_TOML + '[[device]]\nresource = "ate.dev/more"\npath = "/dev/ttyUSB1"\n', mode=0o644)
    os.chmod(conf_dir, 0o777)  # anyone could have swapped the file
    reload(d)
    assert wait_until(lambda: "reload failed" in (d.status() or ""), 5), d.status()
    assert f"{conf_dir} is writable by its group and others (owner root:root, mode 0777), so {cfg} can be replaced" in d.log()
    assert kubelet.registration_count("ate.dev/more") == 0 and kubelet.registration_count(SERIAL) == 1
    assert kubelet.capacity(SERIAL) == 2  # the running configuration serves on
