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

from tests.harness import wait_until
from tests.test_exclusive import allocated_paths, health, reload, write
from tests.test_patterns import mknod

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (CI runs as root)")

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


# --- what kubelet may still Allocate ----------------------------------------------------------------


def test_an_id_of_the_list_kubelet_still_holds_is_granted_after_a_reload_lowers_the_count(start_daemon, kubelet,
                                                                                          tmp_path):
    """kubelet 1.32 kept allocating from the 1024-unit list for up to 57 ms after the 512-unit one
    was sent: here it takes the new list only once the test lets it."""
    cfg = write(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    d = start_daemon(config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm") and kubelet.wait(lambda: kubelet.capacity("ate.dev/kvm") == 1024, 5)
    with kubelet.cond:  # kubelet has not processed what we send next
        write(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 512\n')
        reload(d)
        assert "kvm-987" in kubelet.inc.healthy["ate.dev/kvm"]  # still the old list
        answer = kubelet.allocate("ate.dev/kvm", ["kvm-987"])
        assert [(s.host_path, s.permissions) for s in answer.container_responses[0].devices] == [("/dev/kvm", "rw")]
    assert kubelet.wait(lambda: kubelet.capacity("ate.dev/kvm") == 512, 5), d.log()
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate("ate.dev/kvm", ["kvm-1024"])  # never in any list
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown device ID 'kvm-1024'" in e.value.details()
    assert kubelet.registration_count("ate.dev/kvm") == 1  # the count rode the open stream
