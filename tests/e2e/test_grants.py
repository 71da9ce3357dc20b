"""The grant itself on a real node: registration as kubelet counts it, and what pods sent
through the API as users write them (a bare pod, a Deployment, a Job; root, non-root with and
without the node's group, `hostUsers: false`) can do with /dev/kvm (0660 root:KVM_GID here)."""
from __future__ import annotations

from tests.e2e import podresources, workloads as w
from tests.e2e.api import pod_phase, wait_for
from tests.e2e.cluster import KVM_GID
from tests.e2e.kubelet_log import PUSHED, REGISTER, ms


def test_registration_and_pod_resources_agree(node, cluster, figure):
    log = cluster.klog()
    assert log.registers() >= 1
    register, healthy = log.of(REGISTER)[-1], log.healthy_lists()[-1]
    assert int(healthy.kv["totalCount"]) == int(healthy.kv["healthyCount"]) == 1024, healthy
    ids = podresources.allocatable(cluster.kubelet_root, w.RESOURCE)
    assert len(ids) == 1024, len(ids)
    wait_for("the Node's allocatable", lambda: cluster.allocatable(w.RESOURCE) == "1024", 60, 0.2)
    pushed = [ln for ln in log.of(PUSHED) if ln.at >= register.at][0]
    figure(f"Register -> first list received {ms(pushed.at - register.at)} ms, -> {healthy.kv['healthyCount']} "
           f"healthy {ms(healthy.at - register.at)} ms; pod-resources allocatable {len(ids)}, "
           f"Node allocatable {cluster.allocatable(w.RESOURCE)}")


def test_a_pod_that_asks_opens_kvm_and_one_that_mounts_it_without_asking_gets_eperm(node, cluster, figure):
    cluster.api.create(w.PODS, w.pod("asks", cluster.image, node=None))
    cluster.api.create(w.PODS, w.pod("mounts", cluster.image, resource=None, mount_host_kvm=True))
    asks = w.wait_probed(cluster.api, cluster.pod_logs, "asks")
    mounts = w.wait_probed(cluster.api, cluster.pod_logs, "mounts")
    got_asks, got_mounts = w.seen(cluster.pod_logs, asks), w.seen(cluster.pod_logs, mounts)
    assert got_asks["open"] == "ok" and got_asks["ioctl"] == 12, got_asks  # KVM_GET_API_VERSION
    assert got_mounts["stat"] and got_mounts["open"] == "EPERM", got_mounts  # the node is there; the device cgroup refuses
    given = podresources.assigned(cluster.kubelet_root, w.RESOURCE)
    assert len(given.get("asks", [])) == 1 and "mounts" not in given, given
    figure(f"asks: open ok, KVM_GET_API_VERSION {got_asks['ioctl']}, unit {given['asks'][0]} (pod-resources); "
           f"mounts /dev/kvm without asking: {got_mounts['open']}",
           "a pod asking for ate.dev/kvm; one mounting /dev/kvm without asking", f"opens; {got_mounts['open']}")


KINDS = [
    # name, how it is sent, pod fields, what it must see with a DeviceSpec grant of a 0660 root:KVM_GID node
    ("root-deployment", "deployment", {}, "ok"),
    ("root-job", "job", {}, "ok"),
    ("uid1000-bare", "pod", {"user": 1000}, "EACCES"),
    ("uid1000-group-job", "job", {"user": 1000, "groups": [KVM_GID]}, "ok"),
    ("userns-root-bare", "pod", {"host_users": False}, "EACCES"),
]


def test_pods_of_every_kind_get_what_the_node_allows(node, cluster, figure):
    for name, how, fields, _ in KINDS:
        make = {"deployment": w.deployment, "job": w.job, "pod": w.pod}[how]
        path = {"deployment": w.DEPLOYMENTS, "job": w.JOBS, "pod": w.PODS}[how]
        cluster.api.create(path, make(name, cluster.image, **fields))
    rows = []
    for name, how, fields, expected in KINDS:
        pod = wait_for(f"a pod of {name}", lambda: w.pods_of(cluster.api, name), 60, 0.2)[0]
        pod = w.wait_probed(cluster.api, cluster.pod_logs, pod["metadata"]["name"])
        got = w.seen(cluster.pod_logs, pod)
        rows.append(f"{name}: {got['open']} (uid {got['uid']}, node {oct(got['stat'][0]) if got['stat'] else '-'} "
                    f"{got['stat'][1] if got['stat'] else ''}:{got['stat'][2] if got['stat'] else ''})")
        assert got["open"] == expected, (name, got, pod_phase(pod))
        if expected == "ok":
            assert got["ioctl"] == 12, (name, got)
    # The Deployment's pod keeps running, with its unit.
    dep = wait_for("the Deployment's pod Running", lambda: [p for p in w.pods_of(cluster.api, "root-deployment")
                                                             if pod_phase(p) == "Running"], 60, 0.2)[0]
    assert dep["metadata"]["name"] in podresources.assigned(cluster.kubelet_root, w.RESOURCE)
    figure("; ".join(rows))
