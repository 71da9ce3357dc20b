"""DRA mode on a real node (`[daemon] api = "dra"`, docs/dra.md): kubelet's own credentials publish
the node's ResourceSlice, the DeviceClass maps `ate.dev/kvm` to it (`extendedResourceName`), and
pods whose spec is unchanged (`ate.dev/kvm: 1`) get a claim the scheduler made, prepared by
atedevd, and open /dev/kvm through its CDI name; 100 pods share it, a pattern's units are each one
pod's; an upgrade, an atedevd restart, a kill -9 and a kubelet restart each leave the running pods
untouched and the slice there, and pods sent during each start once the driver answers. atedevd
runs with systemd's descriptor store (rig/harness.FdStore), as the unit with DRA mode's drop-in
does. kubelet 1.34 and newer (extended resources through DRA: alpha in 1.34 and 1.35, whose gates the
cluster turns on, tests/e2e/cluster.py; beta and on in 1.36, GA in 1.37)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest

from atedevd.dra import slices as dra_slices
from tests.e2e import workloads as w
from tests.e2e.api import ApiError, pod_phase, rejected, wait_for
from tests.e2e.cluster import NODE, minor
from tests.e2e.conftest import clean_pods
from tests.e2e.plugin import Atedevd

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{w.NS}/resourceclaims"
SERIAL = "ate.dev/e2e-serial"
MAJOR = 188  # USB serial adapters' numbers: a driverless node the device policy lets pods have
UNITS = 2


@pytest.fixture
def serial_dir(cluster):
    """A pattern's units: nodes made with mknod in a directory of the host's /dev."""
    path = f"/dev/ae2e-{cluster.id}"
    os.mkdir(path, 0o755)
    for i in range(UNITS):
        os.mknod(f"{path}/ttyE2E{i}", 0o660 | 0o020000, os.makedev(MAJOR, i))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def dra_node(cluster, serial_dir):
    """atedevd in DRA mode on the node, once kubelet no longer counts the resource as a device
    plugin's (the Node's allocatable 0: the scheduler then takes the DRA way), with the DeviceClasses."""
    if minor(cluster.kubelet_version) < (1, 34):
        pytest.skip(f"kubelet {cluster.kubelet_version}: no extended resources through DRA (1.34 and 1.35 with their "
                    "gates, which the cluster turns on; 1.36 and newer)")
    wait_for("the Node to count no device-plugin ate.dev/kvm", lambda: cluster.allocatable(w.RESOURCE) == "0", 120, 0.5)
    for resource in (w.RESOURCE, SERIAL):
        try:
            cluster.api.create(CLASSES, dra_slices.device_class(resource))
        except ApiError as e:
            if e.status != 409:
                raise
    devices = (f'[[device]]\nresource = "{w.RESOURCE}"\npath = "/dev/kvm"\n\n'
               f'[[device]]\nresource = "{SERIAL}"\npath = "{serial_dir}/ttyE2E*"\n')
    a = Atedevd(cluster, devices=devices, cdi=True, store=True,
                daemon=f'api = "dra"\nkubeconfig = "{cluster.kubeconfigs["kubelet"]}"\n')
    a.start()
    wait_for("the node's ResourceSlice", lambda: len(devices_listed(cluster)) == 1 + UNITS or None, 60, 0.05)
    registered(a, 1)
    yield a
    clean_pods(cluster)
    a.stop()
    a.close()
    cluster._extra_cleanup.remove(a.close)


def registrations(a: Atedevd) -> int:
    return a.log().count("kubelet registered DRA driver")


def registered(a: Atedevd, times: int) -> None:
    """kubelet has taken the driver `times` times (across the processes of this test)."""
    wait_for("kubelet to register the driver", lambda: registrations(a) >= times or None, 60, 0.01)


def node_slices(cluster) -> list:
    return [s for s in cluster.api.items(SLICES) if s["spec"].get("nodeName") == NODE
            and s["spec"].get("driver") == dra_slices.DRIVER]


def devices_listed(cluster) -> list:
    return sorted(d["name"] for s in node_slices(cluster) for d in s["spec"]["devices"])


def running(cluster, name: str) -> dict:
    return cluster.api.get(f"{w.PODS}/{name}")


def test_an_unchanged_pod_gets_a_claim_prepared_by_atedevd_and_opens_kvm(dra_node, cluster, figure):
    assert "kvm" in devices_listed(cluster)
    t0 = time.monotonic()
    cluster.api.create(w.PODS, w.pod("dra-asks", cluster.image))
    pod = w.wait_probed(cluster.api, cluster.pod_logs, "dra-asks")
    took = time.monotonic() - t0
    got = w.seen(cluster.pod_logs, pod)
    assert not rejected(pod), pod.get("status")
    assert got["open"] == "ok" and got["ioctl"] == 12, got
    claims = [c for c in cluster.api.items(CLAIMS) if c["metadata"]["name"].startswith("dra-asks-")]
    assert claims and claims[0]["status"]["allocation"]["devices"]["results"][0]["device"] == "kvm", claims
    assert "prepared claim default/dra-asks-" in dra_node.log()
    figure(f"ate.dev/kvm: 1, unchanged pod spec: claim {claims[0]['metadata']['name']} prepared, /dev/kvm opened, "
           f"KVM_GET_API_VERSION {got['ioctl']}; created -> probed {took:.1f} s",
           "DRA mode: an unchanged ate.dev/kvm: 1 pod", "opens (measured)")


def test_a_hundred_pods_share_kvm_and_a_pod_with_its_own_claim_too(dra_node, cluster, figure):
    t0 = time.monotonic()
    cluster.api.create(w.DEPLOYMENTS, w.deployment("dra-many", cluster.image, replicas=100))
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "own-kvm"},
             "spec": {"devices": {"requests": [{"name": "kvm", "exactly": {"deviceClassName": "kvm.ate.dev"}}]}}}
    cluster.api.create(CLAIMS, claim)
    own = w.pod("dra-own", cluster.image, resource=None)
    own["spec"]["resourceClaims"] = [{"name": "kvm", "resourceClaimName": "own-kvm"}]
    own["spec"]["containers"][0]["resources"] = {"claims": [{"name": "kvm"}]}
    cluster.api.create(w.PODS, own)

    def all_running():
        pods = [p for p in w.pods_of(cluster.api, "dra-many") if pod_phase(p) == "Running"]
        return pods if len(pods) == 100 else None
    pods = wait_for("100 running pods", all_running, 600, 1.0)
    took = time.monotonic() - t0
    opened = [w.seen(cluster.pod_logs, w.wait_probed(cluster.api, cluster.pod_logs, p["metadata"]["name"])).get("open")
              for p in pods]
    assert opened == ["ok"] * 100, opened
    assert not [p for p in w.pods_of(cluster.api, "dra-many") if rejected(p)]
    mine = w.wait_probed(cluster.api, cluster.pod_logs, "dra-own")
    assert w.seen(cluster.pod_logs, mine)["open"] == "ok"
    figure(f"100 pods of a Deployment share /dev/kvm, Running in {took:.1f} s; a pod with its own claim opens it too",
           "DRA mode: 100 pods share one /dev/kvm; a ResourceClaim pod", "all open (measured)")


def test_a_pattern_unit_is_one_pod_s_and_a_pod_more_than_units_waits(dra_node, cluster, serial_dir, figure):
    paths = [f"{serial_dir}/ttyE2E{i}" for i in range(UNITS)]
    for i in range(UNITS + 1):
        cluster.api.create(w.PODS, w.pod(f"dra-serial{i}", cluster.image, resource=SERIAL, paths=paths, hold=True))
    got = {}
    for i in range(UNITS):
        p = w.wait_probed(cluster.api, cluster.pod_logs, f"dra-serial{i}")
        present = {k: v for k, v in w.opened_paths(cluster.pod_logs, p).items() if v != "ENOENT"}
        assert len(present) == 1, present  # exactly its own unit's node, nothing else of the pattern
        (path, errno), = present.items()
        assert errno != "EPERM", present  # the device cgroup lets it in (no driver behind it: ENXIO)
        got[f"dra-serial{i}"] = path
    assert len(set(got.values())) == UNITS, got  # exclusive: no node given twice
    waiting = cluster.api.get(f"{w.PODS}/dra-serial{UNITS}")
    assert pod_phase(waiting) == "Pending" and not waiting["spec"].get("nodeName"), waiting["status"]
    cluster.api.delete(f"{w.PODS}/dra-serial0")
    p = w.wait_probed(cluster.api, cluster.pod_logs, f"dra-serial{UNITS}", timeout=180)
    present = {k: v for k, v in w.opened_paths(cluster.pod_logs, p).items() if v != "ENOENT"}
    assert list(present) == [got["dra-serial0"]], present  # the unit let go of, and only it
    figure(f"{UNITS} units, {UNITS + 1} pods: each running pod has its own unit's node alone, the last waits "
           "unscheduled and gets the unit let go of", "DRA mode: pattern units are exclusive", "exclusive (measured)")


def test_a_shared_device_s_count_bounds_the_claims_that_share_it(dra_node, cluster, figure):
    """`count = 2`, applied by a reload: the slice gives kvm a capacity of 2 claims, each pod's claim
    takes one, and a third pod waits unscheduled until one goes."""
    dra_node.reload(f'[[device]]\nresource = "{w.RESOURCE}"\npath = "/dev/kvm"\ncount = 2\n', cdi=True)

    def capacity():
        kvm = [d for s in node_slices(cluster) for d in s["spec"]["devices"] if d["name"] == "kvm"]
        return kvm[0]["capacity"]["claims"]["value"] if kvm and kvm[0].get("capacity") else None
    assert wait_for("the slice to give kvm a capacity of 2", lambda: capacity() == "2" or None, 60, 0.1)
    for i in range(3):
        cluster.api.create(w.PODS, w.pod(f"dra-count{i}", cluster.image, hold=True))
    for i in range(2):
        assert w.seen(cluster.pod_logs, w.wait_probed(cluster.api, cluster.pod_logs, f"dra-count{i}"))["open"] == "ok"
    time.sleep(3)  # (the scheduler has had its chances: it retries an unschedulable pod on every slice or claim change)
    third = running(cluster, "dra-count2")
    assert pod_phase(third) == "Pending" and not third["spec"].get("nodeName"), third.get("status")
    cluster.api.delete(f"{w.PODS}/dra-count0", grace=0)
    assert w.seen(cluster.pod_logs, w.wait_probed(cluster.api, cluster.pod_logs, "dra-count2", timeout=180))["open"] == "ok"
    figure("count = 2: the slice's capacity 2 claims; 2 pods run, the third waits unscheduled and runs once one goes",
           "DRA mode: a shared device's count bounds its claims", "bounded (measured)")


def health_of(pod: dict) -> dict:
    """What kubelet's status says of the pod's devices (allocatedResourcesStatus): resource ID -> health."""
    out = {}
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        for entry in status.get("allocatedResourcesStatus") or ():
            for r in entry.get("resources") or ():
                out[r.get("resourceID")] = r.get("health")
    return out


def test_a_unit_that_goes_while_a_pod_holds_it_is_unhealthy_in_its_status_and_tainted_in_the_slice(
        dra_node, cluster, serial_dir, figure):
    if minor(cluster.kubelet_version) < (1, 36):
        pytest.skip(f"kubelet {cluster.kubelet_version}: the health stream (ResourceHealthStatus) is off before 1.36")
    # A claim the pod names: kubelet (1.37, cm/dra/manager.go) reports device health only for a
    # container's resources.claims, never for the claim behind an extended resource.
    paths = [f"{serial_dir}/ttyE2E{i}" for i in range(UNITS)]
    cluster.api.create(CLAIMS, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                "metadata": {"name": "a-unit"}, "spec": {"devices": {"requests": [
                                    {"name": "unit", "exactly": {"deviceClassName": dra_slices.class_name(SERIAL)}}]}}})
    holds = w.pod("dra-holds", cluster.image, resource=None, paths=paths, hold=True)
    holds["spec"]["resourceClaims"] = [{"name": "unit", "resourceClaimName": "a-unit"}]
    holds["spec"]["containers"][0]["resources"] = {"claims": [{"name": "unit"}]}
    cluster.api.create(w.PODS, holds)
    pod = w.wait_probed(cluster.api, cluster.pod_logs, "dra-holds")
    [(path, _)] = [(k, v) for k, v in w.opened_paths(cluster.pod_logs, pod).items() if v != "ENOENT"]
    unit = os.path.basename(path)
    [(cdi_id, health)] = wait_for("kubelet to say how the unit is", lambda: list(health_of(running(
        cluster, "dra-holds")).items()) or None, 60, 0.2)
    assert health == "Healthy" and cdi_id.startswith(f"{SERIAL}=") and cdi_id.endswith(unit), (cdi_id, health)
    t0 = time.monotonic()
    os.unlink(path)
    wait_for("the unit unhealthy in the pod's status", lambda: health_of(running(cluster, "dra-holds")).get(cdi_id)
             == "Unhealthy" or None, 60, 0.05)
    unhealthy = time.monotonic() - t0
    [result] = cluster.api.get(f"{CLAIMS}/a-unit")["status"]["allocation"]["devices"]["results"]
    name = result["device"]

    def tainted():
        found = [d for s in node_slices(cluster) for d in s["spec"]["devices"] if d["name"] == name]
        return found if found and found[0].get("taints") else None
    [device] = wait_for("the gone unit tainted in the slice", tainted, 60, 0.05)
    assert [t["key"] for t in device["taints"]] == [dra_slices.GONE] and device["taints"][0]["effect"] == "NoSchedule"
    assert pod_phase(running(cluster, "dra-holds")) == "Running"  # (NoSchedule: the pod holding it is left alone)
    cluster.api.delete(f"{w.PODS}/dra-holds", grace=0)
    wait_for("the gone unit out of the slice once no claim holds it", lambda: name not in devices_listed(cluster) or None,
             120, 0.1)
    os.mknod(path, 0o660 | 0o020000, os.makedev(MAJOR, int(unit[len("ttyE2E"):])))
    wait_for("the unit back in the slice", lambda: name in devices_listed(cluster) or None, 60, 0.05)
    figure(f"a held unit's node removed (Healthy before): Unhealthy in the pod's allocatedResourcesStatus {unhealthy * 1000:.0f} ms later "
           f"(health stream), tainted {dra_slices.GONE}:NoSchedule in the slice; gone from it once the pod went; back "
           "when made again",
           "DRA mode: a held device that goes", "Unhealthy in the pod's status, tainted in the slice (measured)")


@pytest.mark.parametrize("event", ["atedevd upgrade", "atedevd SIGTERM", "atedevd kill -9", "kubelet restart"])
def test_running_pods_are_untouched_and_pods_sent_during_start_once_the_driver_answers(dra_node, cluster, figure, event):
    cluster.api.create(w.PODS, w.pod("dra-held", cluster.image, hold=True))
    wait_for("dra-held running", lambda: pod_phase(running(cluster, "dra-held")) == "Running" or None, 120, 0.2)
    uid = running(cluster, "dra-held")["metadata"]["uid"]
    before = registrations(dra_node)
    generation = node_slices(cluster)[0]["spec"]["pool"]["generation"]
    sent = []

    def send():
        name = f"dra-during{len(sent)}"
        cluster.api.create(w.PODS, w.pod(name, cluster.image))
        sent.append((name, time.monotonic()))
    t0 = time.monotonic()
    if event == "kubelet restart":
        cluster.stop_kubelet()
        send()  # (the scheduler binds it; kubelet sees it once it is back)
        cluster.start_kubelet()
        send()
    elif event == "atedevd upgrade":  # a file of the package replaced, then the postinst's reload: a handover
        send()
        dra_node.upgrade()
        send()
    else:
        dra_node.stop(signal.SIGTERM if "SIGTERM" in event else signal.SIGKILL)
        send()  # while no atedevd runs: its prepare waits in the socket's backlog
        dra_node.start(wait=False)
    send()
    if event == "kubelet restart":  # kubelet deletes the node's slices as it starts: published again, one on
        wait_for("the slice wiped and published again", lambda: [s for s in node_slices(cluster)
                                                                 if s["spec"]["pool"]["generation"] > generation] or None,
                 60, 0.01)
        registered(dra_node, before + 1)
    back = time.monotonic() - t0
    probed = {name: (w.wait_probed(cluster.api, cluster.pod_logs, name, timeout=400), at) for name, at in sent}
    took = {name: max(0.0, _probed_at(cluster, p) - at) for name, (p, at) in probed.items()}
    held = running(cluster, "dra-held")
    assert held["metadata"]["uid"] == uid and pod_phase(held) == "Running", held.get("status")
    for name, (p, _) in probed.items():
        assert not rejected(p) and w.seen(cluster.pod_logs, p)["open"] == "ok", (name, p.get("status"))
    if event != "kubelet restart":
        assert registrations(dra_node) == before, "kubelet registered the driver anew: it saw it go"
        known = re.findall(r"(\d+) prepared claim\(s\) known", dra_node.log())
        assert known and int(known[-1]) >= 1, "the new process did not know the running pod's claim"
        assert devices_listed(cluster) and node_slices(cluster)[0]["spec"]["pool"]["generation"] == generation, \
            "the slices changed: kubelet wiped them, or a run published anew"
    slowest = max(took.values())
    figure(f"{event}: the running pod untouched; {len(sent)} pods sent around it, none rejected, each created -> "
           f"running {', '.join(f'{t:.1f}' for t in took.values())} s; the slice "
           + (f"back after {back * 1000:.0f} ms" if event == "kubelet restart" else "never left, no new registration"),
           f"DRA mode: {event}", f"pods sent during ran within {slowest:.1f} s (measured)")


def _probed_at(cluster, pod: dict) -> float:
    """When the pod's container started, on our monotonic clock (its status's startedAt is the wall's)."""
    import calendar

    state = (pod.get("status", {}).get("containerStatuses") or [{}])[0].get("state", {})
    started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
    if not started:
        return time.monotonic()
    wall = calendar.timegm(time.strptime(started, "%Y-%m-%dT%H:%M:%SZ"))
    return time.monotonic() - (time.time() - wall)
