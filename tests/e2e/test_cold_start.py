"""A cold start of kubelet and atedevd together, as at a boot: the pods bound to the node from
before (a Deployment's and a bare pod, holding units) are taken in by kubelet's first sync; are
they admitted? The reboot is made as far as a running host allows: atedevd stopped, kubelet
stopped, every pod sandbox removed from containerd (their containers are gone, as after a power
cycle), then atedevd started (Before=kubelet.service: kubelet waits for its READY=1) and kubelet
at once."""
from __future__ import annotations

import calendar
import signal
import time

from tests.e2e import workloads as w
from tests.e2e.api import pod_phase, rejected, wait_for
from tests.e2e.conftest import cluster_healthy
from tests.e2e.kubelet_log import SERVER, ms
from tests.e2e.window import EDGE_S


def test_kubelets_first_pods_after_a_boot(node, cluster, figure):
    cluster.api.create(w.DEPLOYMENTS, w.deployment("boot-dep", cluster.image, replicas=2))
    bare = w.pod("boot-bare", cluster.image, restart="Always", hold=True)
    cluster.api.create(w.PODS, bare)
    running = lambda: [p for p in w.pods_of(cluster.api, "boot-dep") + w.pods_of(cluster.api, "boot-bare")
                       if pod_phase(p) == "Running"]
    before = {p["metadata"]["name"] for p in wait_for("3 pods running", lambda: len(running()) == 3 and running(), 120, 0.3)}
    node.stop(signal.SIGTERM)  # shutdown: systemd stops atedevd after kubelet, both go
    cluster.stop_kubelet()
    cluster.crictl("rmp", "--all", "--force", timeout=120)
    since = time.time()
    node.start(wait=True)
    cluster.start_kubelet()
    wait_for("the node healthy again", lambda: cluster_healthy(cluster, since), 60, 0.05)

    def started_again(pod: dict) -> bool:
        """Its container runs again, started after the boot (the status from before says Running too)."""
        for c in pod.get("status", {}).get("containerStatuses", []):
            started = c.get("state", {}).get("running", {}).get("startedAt")
            if started and calendar.timegm(time.strptime(started, "%Y-%m-%dT%H:%M:%SZ")) >= int(since):
                return True
        return False

    def decided():
        log = cluster.klog()
        pods = {p["metadata"]["name"]: p for p in cluster.api.items(w.PODS)}
        if all(n in pods and log.admitted_at(n, since) and (rejected(pods[n]) or started_again(pods[n]))
               for n in before):
            return pods
        return None
    pods = wait_for("kubelet to decide the pods from before the boot", decided, 120, 0.3)
    log = cluster.klog()
    server = log.of(SERVER, since, resource=False)[0].at
    (start, healthy, settled), = log.windows(since)
    rows, lost = [], 0
    for name in sorted(before):
        at = log.admitted_at(name, since)
        lost += rejected(pods[name])
        rows.append(f"{name}: taken in {ms(at - server) if at else '?'} ms after the registration server, "
                    f"{'REJECTED' if rejected(pods[name]) else 'admitted'}")
        if at is not None and at > settled + EDGE_S:
            assert not rejected(pods[name]), (name, pods[name]["status"])
    figure(f"healthy {ms(healthy - server)} ms after kubelet's registration server; {len(before) - lost} of "
           f"{len(before)} pods from before admitted; " + "; ".join(rows),
           "cold start with kubelet (a boot): its first pods", f"{len(before) - lost}/{len(before)} admitted")
    assert lost == 0, rows
