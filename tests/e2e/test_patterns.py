"""Pattern devices on a real kubelet: nodes made with mknod in a directory of the host's /dev,
one unit per node, each given to one pod at a time, and nodes plugged in later advertised to
kubelet without a new registration."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.e2e import podresources, workloads as w
from tests.e2e.api import pod_phase, wait_for
from tests.e2e.kubelet_log import PROCESSED, KubeletLog

RESOURCE = "ate.dev/e2e-serial"
MAJOR = 188  # USB serial adapters' numbers: a driverless node the device policy lets pods have


@pytest.fixture
def serial_dir(cluster):
    path = f"/dev/ae2e-{cluster.id}"
    os.mkdir(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def plug(path: str, i: int) -> str:
    node = f"{path}/ttyE2E{i}"
    os.mknod(node, 0o660 | 0o020000, os.makedev(MAJOR, i))
    return node


def counted(cluster, total: int, since: float) -> bool:
    return any(int(ln.kv["totalCount"]) == total and int(ln.kv["healthyCount"]) == total
               for ln in KubeletLog(cluster.klog().lines, RESOURCE).of(PROCESSED, since))


def test_one_unit_per_pod_exclusive_and_hot_plug(start_atedevd, cluster, serial_dir, figure):
    nodes = [plug(serial_dir, i) for i in range(3)]
    pattern = f'[[device]]\nresource = "{RESOURCE}"\npath = "{serial_dir}/ttyE2E*"\n'
    since = time.time()
    start_atedevd(devices='[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n' + pattern)
    wait_for("3 units counted", lambda: counted(cluster, 3, since), 60, 0.05)
    registers = KubeletLog(cluster.klog().lines, RESOURCE).registers(since)
    wait_for("the Node's allocatable", lambda: cluster.allocatable(RESOURCE) == "3", 60, 0.2)  # what the scheduler reads
    paths = nodes + [f"{serial_dir}/ttyE2E3"]
    for i in range(4):  # one more pod than units: it waits for a unit
        cluster.api.create(w.PODS, w.pod(f"serial{i}", cluster.image, resource=RESOURCE, paths=paths, hold=True))
    got = {}
    for i in range(3):
        p = w.wait_probed(cluster.api, cluster.pod_logs, f"serial{i}")
        present = {k: v for k, v in w.opened_paths(cluster.pod_logs, p).items() if v != "ENOENT"}
        assert len(present) == 1, present  # exactly its own unit's node, nothing else of the pattern
        (path, errno), = present.items()
        assert errno != "EPERM", present  # the device cgroup lets it in (no driver behind it: ENXIO)
        got[f"serial{i}"] = (path, errno)
    assert len({path for path, _ in got.values()}) == 3, got  # exclusive: no node given twice
    waiting = cluster.api.get(f"{w.PODS}/serial3")
    assert pod_phase(waiting) == "Pending" and not waiting["spec"].get("nodeName"), waiting["status"]
    assigned = podresources.assigned(cluster.kubelet_root, RESOURCE)
    assert sorted(i for ids in assigned.values() for i in ids) == sorted({i for ids in assigned.values() for i in ids})
    # Hot-plug: a fourth node; kubelet counts it without a new Register and the waiting pod gets it.
    plugged_at = time.time()
    plug(serial_dir, 3)
    wait_for("the plugged node counted", lambda: counted(cluster, 4, plugged_at), 30, 0.02)
    seen_at = [ln.at for ln in KubeletLog(cluster.klog().lines, RESOURCE).of(PROCESSED, plugged_at)
               if int(ln.kv["totalCount"]) == 4][0]
    p = w.wait_probed(cluster.api, cluster.pod_logs, "serial3", timeout=120)
    present = {k: v for k, v in w.opened_paths(cluster.pod_logs, p).items() if v != "ENOENT"}
    assert list(present) == [f"{serial_dir}/ttyE2E3"], present
    # Unplug one held by no one... all are held: unplug the last pod's node after deleting its pod.
    cluster.api.delete(f"{w.PODS}/serial3", grace=0)
    unplugged_at = time.time()
    os.unlink(f"{serial_dir}/ttyE2E3")
    def unhealthy():
        return any(int(ln.kv["totalCount"]) == 4 and int(ln.kv["healthyCount"]) == 3
                   for ln in KubeletLog(cluster.klog().lines, RESOURCE).of(PROCESSED, unplugged_at))
    wait_for("the unplugged node's unit Unhealthy", unhealthy, 30, 0.02)
    later = KubeletLog(cluster.klog().lines, RESOURCE).registers(since)
    assert later == registers == 1, (registers, later)
    figure(f"3 pods, 3 distinct nodes ({', '.join(os.path.basename(v[0]) + ' ' + v[1] for v in got.values())}), "
           f"the 4th Pending; plugged node counted by kubelet {round((seen_at - plugged_at) * 1000)} ms after mknod, "
           f"given to the waiting pod; unplugged: 3 of 4 healthy; Registers {later}",
           "pattern devices: one node per pod, hot-plug", f"exclusive; plug seen in {round((seen_at - plugged_at) * 1000)} ms")
