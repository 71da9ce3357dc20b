"""What kubelet sees is what the node grants, at every moment: the daemon as a process, nodes
made with mknod under a dev root, changed the way udev changes them.

- a node plugged in after start that several resources reach is served by none of them;
- a node removed just before a reload does not stay Healthy;
- a link's unit is judged by the node it points at, when that node is made anew;
- two by-id names whose IDs share a hash never share an ID;
- what kubelet may still Allocate from the list it had before a reload is served.
"""

import os
import re
import signal

import grpc
import pytest

from rig.harness import wait_until, write_file
from rig.nodes import mknod
from tests.process.test_exclusive import allocated_paths, health, reload

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (CI runs as root)")]

A, B, GPS, BY_ID = "ate.dev/a", "ate.dev/b", "ate.dev/gps", "ate.dev/serial"
OVERLAPPING = (f'[[device]]\nresource = "{A}"\npath = "/dev/ttyUSB*"\n'
               f'[[device]]\nresource = "{B}"\npath = "/dev/ttyUSB[0-9]"\n')
# Two udev by-id names (USB descriptors choose them) whose IDs end in the same 40-bit hash: found
# offline in under a second by a birthday search over the serial-number part.
COLLIDING = ("usb-Silicon_Labs_CP2102N_USB_to_UART_Bridge_Controller_000271a6-if00-port0",
             "usb-Silicon_Labs_CP2102N_USB_to_UART_Bridge_Controller_000271c0-if00-port0")


def healthy(kubelet, resource):
    return {i for i, h in health(kubelet, resource).items() if h == "Healthy"}


def by_id_link(dev_root, name, target):
    link = os.path.join(dev_root, "serial", "by-id", name)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(f"../../{target}", link)
    return link


# --- one node, one resource ------------------------------------------------------------------


def test_a_node_two_patterns_reach_is_served_by_neither_after_a_plug_a_reload_and_a_restart(
        start_daemon, kubelet, dev_root, tmp_path):
    mknod(dev_root, "ttyUSB10", 188, 10)  # ttyUSB* only
    cfg = write_file(tmp_path / "c.toml", OVERLAPPING)
    d = start_daemon(config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected(A), d.log()
    assert kubelet.wait(lambda: healthy(kubelet, A) == {"ttyUSB10"}, 5), d.log()
    conflict = r"ERROR ate.dev/\w: .*/ttyUSB5 \(char 188:5, not in sysfs\) is reached by ate.dev/\w as /dev/ttyUSB5 " \
               r"and by ate.dev/\w as /dev/ttyUSB5: a node handed to one container at a time is no other resource's"

    mknod(dev_root, "ttyUSB5", 188, 5)  # plugged in after start: both reach it
    assert wait_until(lambda: len(re.findall(conflict, d.log())) == 1, 5), d.log()
    assert healthy(kubelet, A) == {"ttyUSB10"} and kubelet.registration_count(B) == 0, (health(kubelet, A), d.log())
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate(A, ["ttyUSB5"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    reload(d)  # the running daemon's next reload is not refused for it
    assert "reload failed" not in (d.status() or "") and healthy(kubelet, A) == {"ttyUSB10"}, (d.status(), d.log())
    assert d.stop() == 0
    d = start_daemon(config=cfg)  # nor its next start: the node is refused, not the configuration
    d.wait_ready()
    assert kubelet.wait_connected(A, registrations=2), d.log()
    assert kubelet.wait(lambda: healthy(kubelet, A) == {"ttyUSB10"}, 5), d.log()
    assert len(re.findall(conflict, d.log())) == 1 and kubelet.registration_count(B) == 0, d.log()

    os.unlink(os.path.join(dev_root, "ttyUSB5"))
    mknod(dev_root, "ttyUSB50", 188, 5)  # the same node under a name only ttyUSB* matches: A's alone, and served
    assert kubelet.wait(lambda: healthy(kubelet, A) == {"ttyUSB10", "ttyUSB50"}, 5), (health(kubelet, A), d.log())


def test_a_shareable_node_that_a_link_of_a_pattern_comes_to_reach_is_served_by_neither(start_daemon, kubelet, dev_root,
                                                                                       tmp_path):
    """udev makes the by-id link after the node: the shareable resource served it, and stops
    the moment the pattern's link reaches it; when the link goes, it serves it again."""
    cfg = write_file(tmp_path / "c.toml", f'[[device]]\nresource = "{GPS}"\npath = "/dev/ttyUSB5"\ncount = 4\n'
                                     f'[[device]]\nresource = "{BY_ID}"\npath = "/dev/serial/by-id/*"\n')
    d = start_daemon(config=cfg)
    d.wait_ready()
    mknod(dev_root, "ttyUSB5", 188, 5)
    assert kubelet.wait_connected(GPS), d.log()
    assert kubelet.wait(lambda: len(healthy(kubelet, GPS)) == 4, 5), d.log()
    link = by_id_link(dev_root, "usb-u-blox_GNSS-if00", "ttyUSB5")
    assert kubelet.wait(lambda: healthy(kubelet, GPS) == set(), 5), (health(kubelet, GPS), d.log())
    assert healthy(kubelet, BY_ID) == set()
    lines = [x for x in d.log().splitlines() if " ERROR " in x and "is reached by" in x]
    assert len(lines) == 1 and GPS in lines[0] and BY_ID in lines[0] and "(char 188:5" in lines[0], d.log()
    os.unlink(link)
    assert kubelet.wait(lambda: len(healthy(kubelet, GPS)) == 4, 5), (health(kubelet, GPS), d.log())


# --- a unit is Healthy only while its node is there -----------------------------------------------


def test_a_node_removed_just_before_a_reload_does_not_stay_healthy(start_daemon, kubelet, dev_root, tmp_path):
    """kill -STOP, rm, kill -HUP, kill -CONT: the event and the reload arrive together."""
    for n in range(3):
        mknod(dev_root, f"ttyUSB{n}", 188, n)
    d = start_daemon(config=write_file(tmp_path / "c.toml", f'[[device]]\nresource = "{A}"\npath = "/dev/ttyUSB*"\n'))
    d.wait_ready()
    assert kubelet.wait_connected(A), d.log()
    assert kubelet.wait(lambda: healthy(kubelet, A) == {"ttyUSB0", "ttyUSB1", "ttyUSB2"}, 5), d.log()
    n = len(d.notify.messages)
    d.send(signal.SIGSTOP)
    try:
        os.unlink(os.path.join(dev_root, "ttyUSB1"))
        d.send(signal.SIGHUP)
    finally:
        d.send(signal.SIGCONT)
    assert d.notify.wait_for("READY", "1", timeout=5, after=n + 1), d.log()
    assert kubelet.wait(lambda: healthy(kubelet, A) == {"ttyUSB0", "ttyUSB2"}, 5), (health(kubelet, A), d.log())
    assert wait_until(lambda: f"{A}: registered, 2/2 healthy" in (d.status() or ""), 5), d.status()
    with pytest.raises(grpc.RpcError) as e:  # the list kubelet had a moment ago named it Healthy
        kubelet.allocate(A, ["ttyUSB1"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert "unit 'ttyUSB1' (/dev/ttyUSB1) left the device list" in e.value.details()


def test_a_links_unit_is_judged_by_the_node_it_points_at_when_that_node_is_made_anew(start_daemon, kubelet, dev_root,
                                                                                      tmp_path):
    mknod(dev_root, "ttyUSB0", 188, 0)
    by_id_link(dev_root, "usb-FTDI_FT232R-if00-port0", "ttyUSB0")
    d = start_daemon(config=write_file(tmp_path / "c.toml", f'[[device]]\nresource = "{BY_ID}"\npath = "/dev/serial/by-id/*"\n'))
    d.wait_ready()
    assert kubelet.wait_connected(BY_ID), d.log()
    unit = "serial-by-id-usb-FTDI_FT232R-if00-port0"
    assert kubelet.wait(lambda: healthy(kubelet, BY_ID) == {unit}, 5), d.log()
    os.unlink(os.path.join(dev_root, "ttyUSB0"))
    mknod(dev_root, "ttyUSB0", 1, 1)  # the link stays; its node is now /dev/mem's numbers (nothing in by-id/ moved)
    assert kubelet.wait(lambda: healthy(kubelet, BY_ID) == set(), 5), (health(kubelet, BY_ID), d.log())
    refused = (r"ERROR ate.dev/serial: /dev/serial/by-id/usb-FTDI_FT232R-if00-port0: refused: .* -> .*/ttyUSB0 "
               r"\(char 1:1, not in sysfs\) is physical memory .*; unit serial-by-id-usb-FTDI_FT232R-if00-port0 is "
               r"Unhealthy")
    # (Unhealthy first, perhaps, as missing: a look between the unlink and the mknod; judged again on the mknod's news)
    assert wait_until(lambda: re.search(refused, d.log()), 5), d.log()
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate(BY_ID, [unit])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# --- IDs: one path each, for the whole run ----------------------------------------------------


def test_two_by_id_names_whose_ids_once_shared_a_hash_are_two_units(start_daemon, kubelet, dev_root, tmp_path):
    """Their IDs were one under 40 bits of hash (a maker's descriptors kept the second adapter off the
    node); with 128 both are served, each its own. The loud refusal of two paths with one ID, should
    one ever be found, is held in tests/unit/devices/test_invariants.py."""
    from atedevd.devices.patterns import unit_id

    first, second = (f"/dev/serial/by-id/{name}" for name in COLLIDING)
    assert unit_id(first) != unit_id(second)
    mknod(dev_root, "ttyUSB0", 188, 0)
    by_id_link(dev_root, COLLIDING[0], "ttyUSB0")
    d = start_daemon(config=write_file(tmp_path / "c.toml", f'[[device]]\nresource = "{BY_ID}"\npath = "/dev/serial/by-id/*"\n'))
    d.wait_ready()
    assert kubelet.wait_connected(BY_ID), d.log()
    assert kubelet.wait(lambda: healthy(kubelet, BY_ID) == {unit_id(first)}, 5), d.log()
    mknod(dev_root, "ttyUSB1", 188, 1)
    by_id_link(dev_root, COLLIDING[1], "ttyUSB1")  # the second adapter
    assert kubelet.wait(lambda: healthy(kubelet, BY_ID) == {unit_id(first), unit_id(second)}, 5), d.log()
    for path in (first, second):
        assert allocated_paths(kubelet, BY_ID, [unit_id(path)]) == [(path, path, "rw")]
    assert "would be unit" not in d.log()


# --- what kubelet may still Allocate ----------------------------------------------------------------


@pytest.mark.registration  # both kubelet generations the stand-in models
def test_an_id_of_the_list_kubelet_still_holds_is_granted_after_a_reload_lowers_the_count(start_daemon, kubelet,
                                                                                          tmp_path):
    """kubelet 1.32 kept allocating from the 1024-unit list for up to 57 ms after the 512-unit one
    was sent: here it takes the new list only once the test lets it."""
    cfg = write_file(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    d = start_daemon(config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm") and kubelet.wait(lambda: kubelet.capacity("ate.dev/kvm") == 1024, 5)
    with kubelet.cond:  # kubelet has not processed what we send next
        write_file(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 512\n')
        reload(d)
        assert "kvm-987" in kubelet.manager.healthy["ate.dev/kvm"]  # still the old list
        answer = kubelet.allocate("ate.dev/kvm", ["kvm-987"])
        assert [(s.host_path, s.permissions) for s in answer.container_responses[0].devices] == [("/dev/kvm", "rw")]
    assert kubelet.wait(lambda: kubelet.capacity("ate.dev/kvm") == 512, 5), d.log()
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate("ate.dev/kvm", ["kvm-1024"])  # never in any list
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown device ID 'kvm-1024'" in e.value.details()
    assert kubelet.registration_count("ate.dev/kvm") == 1  # the count rode the open stream
