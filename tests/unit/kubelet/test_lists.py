"""The device lists kubelet may still allocate from (atedevd/kubelet/lists.py), on a clock of our own."""

from atedevd.config import Device
from atedevd.devices.snapshot import NodeGrant, SharedSnapshot, Unit, UnitSnapshot
from atedevd.kubelet import lists

KVM = Device("ate.dev/kvm", "/dev/kvm", count=4)


def test_an_earlier_lists_healthy_ids_are_honoured_until_taken_s_after_a_newer_one_went_out():
    sent = lists.SentLists()
    node = (NodeGrant("/dev/kvm", 10, 232),)
    old, new = SharedSnapshot(KVM, True, 1, node), SharedSnapshot(KVM._replace(count=2), True, 2, node)
    assert sent.earlier("kvm-3", 0.0) is None  # nothing sent yet
    sent.sent(old, 10.0)
    assert sent.earlier("kvm-3", 10.0) is old  # the newest sent: kubelet allocates from it
    sent.sent(new, 20.0)
    assert sent.earlier("kvm-3", 20.0 + lists.TAKEN_S - 0.001) is old  # kubelet may not have taken the new one
    assert sent.earlier("kvm-3", 20.0 + lists.TAKEN_S) is None  # it has by now (or we registered anew)
    assert sent.earlier("kvm-1", 100.0) is new and sent.earlier("kvm-9", 0.0) is None
    sent.sent(SharedSnapshot(KVM, False, 3), 30.0)  # a list with every unit Unhealthy grants nothing of its own
    assert sent.earlier("kvm-3", 30.0) is None and sent.earlier("kvm-1", 30.0) is new


def test_a_patterns_unit_is_found_healthy_or_not_and_only_so_many_lists_are_kept():
    device = Device("ate.dev/serial", "/dev/ttyUSB*")
    sent = lists.SentLists()
    up = Unit("ttyUSB1", "/dev/ttyUSB1", True)
    sent.sent(UnitSnapshot(device, 1, (up,)), 0.0)
    sent.sent(UnitSnapshot(device, 2, (up._replace(healthy=False),)), 1.0)
    assert sent.earlier("ttyUSB1", 2.0) is up
    newest = UnitSnapshot(device, 3, ())  # its node gone: an Allocate of it is refused with why, not as unknown
    assert "unit 'ttyUSB1' (/dev/ttyUSB1) left the device list" in newest.refusal(["ttyUSB1"], lambda i: sent.earlier(i, 2.0))
    for n in range(3, 3 + 2 * lists.KEPT):
        sent.sent(UnitSnapshot(device, n, ()), 2.0)
    assert sent.earlier("ttyUSB1", 2.0) is None  # a burst of lists pushes the oldest out
