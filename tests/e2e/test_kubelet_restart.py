"""kubelet restarted under a registered atedevd, with pods created through the API while it is
down or while it starts: which of them kubelet rejects, per version, and why (its message)."""
from __future__ import annotations

import os

from tests.e2e.conftest import clean_pods, cluster_healthy
from tests.e2e.kubelet_log import REGISTER, SERVER, spread
from tests.e2e.window import cell, check_pods, measure, summary

ROUNDS = int(os.environ.get("ATEDEVD_E2E_ROUNDS", "3"))


def reasons(rounds) -> str:
    found = sorted({p.message for r in rounds for p in r.pods if p.rejected})
    return " | ".join(found) or "none"


def test_pods_sent_while_kubelet_is_down(node, cluster, figure):
    """Pods bound to the node while kubelet is stopped are taken in by its first sync."""
    def event(into):
        cluster.stop_kubelet()
        into.send()
        cluster.start_kubelet()
    rounds = []
    for i in range(ROUNDS):
        rounds.append(measure(cluster, event, lambda t: cluster_healthy(cluster, t), f"down{i}", pods=2,
                              send_in_event=True))
        clean_pods(cluster)
    log = cluster.klog()
    first_sync = [min(p.admitted_at for p in r.pods) - log.of(SERVER, r.since, resource=False)[0].at for r in rounds]
    figure(f"{summary(rounds)}; kubelet took them in {spread(first_sync)} after its registration server; why: {reasons(rounds)}",
           "kubelet restarts, pods sent while it is down", cell(rounds))
    for r in rounds:
        assert len(r.windows) == 1 and r.registers == 1, (r.windows, r.registers)
    check_pods(rounds)


def test_pods_sent_while_kubelet_starts(node, cluster, figure):
    """Pods sent the moment kubelet's registration server starts (its log says so)."""
    def event(into):
        cluster.stop_kubelet()
        into.arm(into_since[0])
        cluster.start_kubelet()
    rounds, into_since = [], [0.0]
    for i in range(ROUNDS):
        import time
        into_since[0] = time.time()
        rounds.append(measure(cluster, event, lambda t: cluster_healthy(cluster, t), f"start{i}", pods=3, gap=0.005,
                              trigger=(SERVER,), send_in_event=True))
        clean_pods(cluster)
    log = cluster.klog()
    to_register = [log.of(REGISTER, r.since)[0].at - log.of(SERVER, r.since, resource=False)[0].at for r in rounds]
    figure(f"{summary(rounds)}; registration server -> our Register {spread(to_register)}; why: {reasons(rounds)}",
           "kubelet restarts, pods sent as it starts", cell(rounds))
    for r in rounds:
        assert len(r.windows) == 1 and r.registers == 1, (r.windows, r.registers)
    check_pods(rounds)
