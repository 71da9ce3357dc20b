"""DRA mode on a real node (`[daemon] api = "dra"`, docs/dra.md): kubelet's own credentials publish
the node's ResourceSlice, the DeviceClass maps `ate.dev/kvm` to it (`extendedResourceName`), and
pods whose spec is unchanged (`ate.dev/kvm: 1`) get a claim the scheduler made, prepared by
atedevd, and open /dev/kvm through its CDI name; an atedevd restart, a kill -9 and a kubelet
restart each leave the running pods untouched and the slice back. kubelet 1.36 and newer
(extended resources through DRA: beta and on in 1.36, GA in 1.37)."""
from __future__ import annotations

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


@pytest.fixture
def dra_node(cluster):
    """atedevd in DRA mode on the node, once kubelet no longer counts the resource as a device
    plugin's (the Node's allocatable 0: the scheduler then takes the DRA way), with the DeviceClass."""
    if minor(cluster.kubelet_version) < (1, 36):
        pytest.skip(f"kubelet {cluster.kubelet_version}: extended resources through DRA need 1.36 (1.34 with gates)")
    wait_for("the Node to count no device-plugin ate.dev/kvm", lambda: cluster.allocatable(w.RESOURCE) == "0", 120, 0.5)
    try:
        cluster.api.create(CLASSES, dra_slices.device_class(w.RESOURCE))
    except ApiError as e:
        if e.status != 409:
            raise
    a = Atedevd(cluster, cdi=True, daemon=f'api = "dra"\nkubeconfig = "{cluster.kubeconfigs["kubelet"]}"\n')
    a.start()
    wait_for("the node's ResourceSlice", lambda: node_slices(cluster), 60, 0.05)
    registered(a, 1)
    yield a
    clean_pods(cluster)
    a.stop()
    a.close()
    cluster._extra_cleanup.remove(a.close)


def registered(a: Atedevd, times: int) -> None:
    """kubelet has taken the driver `times` times (across the processes of this test)."""
    wait_for("kubelet to register the driver", lambda: a.log().count("kubelet registered DRA driver") >= times or None,
             60, 0.01)


def node_slices(cluster) -> list:
    return [s for s in cluster.api.items(SLICES) if s["spec"].get("nodeName") == NODE
            and s["spec"].get("driver") == dra_slices.DRIVER]


def running(cluster, name: str) -> dict:
    return cluster.api.get(f"{w.PODS}/{name}")


def test_an_unchanged_pod_gets_a_claim_prepared_by_atedevd_and_opens_kvm(dra_node, cluster, figure):
    [s] = node_slices(cluster)
    assert [d["name"] for d in s["spec"]["devices"]] == ["kvm"], s
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


def test_ten_pods_share_kvm_and_a_pod_with_its_own_claim_too(dra_node, cluster, figure):
    t0 = time.monotonic()
    cluster.api.create(w.DEPLOYMENTS, w.deployment("dra-many", cluster.image, replicas=10))
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "own-kvm"},
             "spec": {"devices": {"requests": [{"name": "kvm", "exactly": {"deviceClassName": "kvm.ate.dev"}}]}}}
    cluster.api.create(CLAIMS, claim)
    own = w.pod("dra-own", cluster.image, resource=None)
    own["spec"]["resourceClaims"] = [{"name": "kvm", "resourceClaimName": "own-kvm"}]
    own["spec"]["containers"][0]["resources"] = {"claims": [{"name": "kvm"}]}
    cluster.api.create(w.PODS, own)
    def all_running():
        pods = [p for p in w.pods_of(cluster.api, "dra-many") if pod_phase(p) == "Running"]
        return pods if len(pods) == 10 else None
    pods = wait_for("10 running pods", all_running, 180, 0.5)
    took = time.monotonic() - t0
    opened = [w.seen(cluster.pod_logs, w.wait_probed(cluster.api, cluster.pod_logs, p["metadata"]["name"])).get("open")
              for p in pods]
    assert opened == ["ok"] * 10, opened
    mine = w.wait_probed(cluster.api, cluster.pod_logs, "dra-own")
    assert w.seen(cluster.pod_logs, mine)["open"] == "ok"
    figure(f"10 pods of a Deployment share /dev/kvm, Running in {took:.1f} s; a pod with its own claim opens it too",
           "DRA mode: 10 pods share one /dev/kvm; a ResourceClaim pod", "all open (measured)")


@pytest.mark.parametrize("event", ["atedevd upgrade", "atedevd SIGTERM", "atedevd kill -9", "kubelet restart"])
def test_running_pods_are_untouched_and_the_slice_comes_back(dra_node, cluster, figure, event):
    cluster.api.create(w.PODS, w.pod("dra-held", cluster.image, hold=True))
    wait_for("dra-held running", lambda: pod_phase(running(cluster, "dra-held")) == "Running" or None, 120, 0.2)
    uid = running(cluster, "dra-held")["metadata"]["uid"]
    registrations = dra_node.log().count("kubelet registered DRA driver")
    generation = node_slices(cluster)[0]["spec"]["pool"]["generation"]
    t0 = time.monotonic()
    if event == "kubelet restart":
        cluster.stop_kubelet()
        cluster.start_kubelet()
        # kubelet deletes the node's slices as it starts; atedevd publishes them again, one generation on
        try:
            wait_for("the slice wiped and published again", lambda: [s for s in node_slices(cluster)
                                                                     if s["spec"]["pool"]["generation"] > generation] or None,
                     60, 0.01)
        except AssertionError as e:
            wiped = [ln for ln in cluster.kubelet_log.read_text(errors="replace").splitlines() if "ResourceSlice" in ln]
            raise AssertionError(f"{e}\nslices now: {node_slices(cluster)}\nkubelet: {wiped[-10:]}\n"
                                 f"atedevd: {dra_node.log()[-3000:]}") from None
    elif event == "atedevd upgrade":  # a file of the package replaced, then the postinst's reload: a handover
        cluster.api.create(w.PODS, w.pod("dra-during", cluster.image))  # sent as the handover begins
        dra_node.upgrade()
    else:
        dra_node.restart(signal.SIGTERM if "SIGTERM" in event else signal.SIGKILL)
    if event != "atedevd upgrade":
        cluster.api.create(w.PODS, w.pod("dra-during", cluster.image))  # sent while the driver is away
    wait_for("the slice back", lambda: node_slices(cluster), 60, 0.01)
    back = time.monotonic() - t0
    registered(dra_node, registrations + 1)
    answered = time.monotonic() - t0
    during = w.wait_probed(cluster.api, cluster.pod_logs, "dra-during", timeout=400)
    started = time.monotonic() - t0
    held = running(cluster, "dra-held")
    assert held["metadata"]["uid"] == uid and pod_phase(held) == "Running", held.get("status")
    assert not rejected(during) and w.seen(cluster.pod_logs, during)["open"] == "ok", during.get("status")
    why = " (its prepare failed while no instance was registered: kubelet tried again on its pod-sync back-off)" \
        if started > 10 else ""
    figure(f"{event}: the running pod untouched; the slice back after {back * 1000:.0f} ms, the driver registered "
           f"after {answered * 1000:.0f} ms; a pod sent meanwhile not rejected, probed {started:.1f} s after the "
           f"event{why}",
           f"DRA mode: {event}", f"slice back {back:.1f} s; pod sent meanwhile ran after {started:.0f} s (measured)")
