"""Each habit the kubelet stand-in (rig/kubelet_standin.py) and the simulation's model
(tests/simulation/kubelet.py) give kubelet, measured on the real kubelet and printed beside the
model's (issue 36, item 5). The model's side is what those files and docs/design.md say."""
from __future__ import annotations

import os
import signal
import statistics
import time

from tests.e2e import workloads as w
from tests.e2e.api import pod_phase, rejected, wait_for
from tests.e2e.conftest import clean_pods, cluster_healthy
from tests.e2e.kubelet_log import (CONNECTED, DEREGISTERED, DISCONNECTED, PROCESSED, PUSHED, REGISTER, REGISTERED,
                                   SERVER, STREAM_ENDED, UNHEALTHY, ms, spread)
from tests.e2e.cluster import NODE
from tests.e2e.window import EDGE_S

ROUNDS = int(os.environ.get("ATEDEVD_E2E_ROUNDS", "3"))
MODEL = {
    "dial-back": "stand-in: dials back and asks the options inside Register, then starts ListAndWatch and returns; "
                 "simulation: each of those steps 0-4 ms half the time, else up to 1 s",
    "list": "stand-in (make bench-units): one list handled 1.6 ms at 256 units, 3.3 at 1024, 8.1 at 4096, 28 at 16384",
    "let-go": "stand-in: lets go of an ended stream within a millisecond (a Go kubelet's habit); simulation: two "
              "random steps (teardown, teardown_lookup)",
    "endpoints": "two models: 1.32 (every kubelet before kubernetes PR #135437: one client per resource name) and "
                 "current (clients per name and socket path; another live endpoint takes over)",
    "admission": "stand-in at boot (rig/node_boot.py): kubelet's first batch of pods 40 ms after kubelet.sock",
}


def registrations(log, since: float):
    """For each Register since `since`: (register, connected, pushed, processed) times."""
    out = []
    for reg in log.of(REGISTER, since):
        conn = [ln.at for ln in log.of(CONNECTED, reg.at, reg.at + 10) if ln.message == "Device plugin connected"]
        pushed = [ln.at for ln in log.of(PUSHED, reg.at, reg.at + 10)]
        done = [ln.at for ln in log.healthy_lists(reg.at, reg.at + 10)]
        if conn and pushed and done:
            out.append((reg.at, conn[0], pushed[0], done[0]))
    return out


def test_habit_dial_back_before_register_returns(node, cluster, figure):
    since = time.time()
    for _ in range(ROUNDS):
        t = time.time()
        node.restart(signal.SIGTERM)
        wait_for("registered again", lambda: cluster_healthy(cluster, t), 60, 0.02)
    regs = registrations(cluster.klog(), since)
    assert len(regs) == ROUNDS, regs
    for reg, conn, pushed, done in regs:
        assert reg <= conn <= pushed <= done, (reg, conn, pushed, done)  # dialled and asked before the stream
    figure(f"real: Register -> dialled back and options done {spread([c - r for r, c, _, _ in regs])}, "
           f"-> first list received {spread([p - r for r, _, p, _ in regs])}, -> processed "
           f"{spread([d - r for r, _, _, d in regs])}; model: {MODEL['dial-back']}")


def test_habit_time_to_process_a_list_by_size(start_atedevd, cluster, figure):
    kvm = lambda n: f'[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = {n}\n'
    a = start_atedevd(devices=kvm(1024))
    sizes = [256, 4096, 16384, 1024]
    took = {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for n in sizes:
            t = time.time()
            a.reload(kvm(n))
            log = wait_for(f"a list of {n}", lambda: (lambda lg: lg if any(int(ln.kv["totalCount"]) == n
                                                                               for ln in lg.of(PROCESSED, t)) else None)(cluster.klog()), 30, 0.02)
            done = [ln for ln in log.of(PROCESSED, t) if int(ln.kv["totalCount"]) == n][0]
            took[n].append(done.at - log.of(PUSHED, t, done.at)[-1].at)
    figure("real: list received -> processed " + ", ".join(f"{n}: {spread(v)}" for n, v in took.items())
           + f"; model: {MODEL['list']}")
    assert statistics.median(took[16384]) > statistics.median(took[256]), took


def test_habit_when_a_closed_stream_is_let_go_and_teardown_by_name_or_socket(node, cluster, figure):
    since = time.time()
    for _ in range(ROUNDS):
        t = time.time()
        node.restart(signal.SIGKILL)
        wait_for("registered again", lambda: cluster_healthy(cluster, t), 60, 0.02)
    log = cluster.klog()
    let_go, unhealthy, by_socket = [], [], []
    for end in log.of(STREAM_ENDED, since):
        dereg = log.of(DEREGISTERED, end.at, end.at + 5)[0]
        let_go.append(dereg.at - end.at)
        unhealthy.append(log.of(UNHEALTHY, end.at, end.at + 5)[0].at - end.at)
        by_socket.append("socketPath" in dereg.kv)
    assert len(let_go) == ROUNDS and max(let_go) < 0.1, let_go
    assert len(set(by_socket)) == 1, by_socket
    teardown = "by name and socket path" if by_socket[0] else "by resource name"
    disconnected = log.of(DISCONNECTED, since)
    figure(f"real: stream ended -> client deregistered {spread(let_go)}, -> every unit Unhealthy {spread(unhealthy)}; "
           f"teardown {teardown} ({len(disconnected)} 'Device plugin disconnected'); model: {MODEL['let-go']}")


def test_habit_endpoints_per_resource_or_per_socket(start_atedevd, cluster, figure):
    """A second registration of the resource on a new socket while the first one's stream is live
    (an upgrade with kubelet_endpoints = "per-socket"): does kubelet keep both, and does the first
    one's teardown leave the resource healthy?"""
    a = start_atedevd(endpoints="per-socket", log_level="debug")
    clients = {"socketPath" in ln.kv for ln in cluster.klog().of(REGISTERED)}
    a.wait_startup_done()
    t = time.time()
    a.upgrade()
    wait_for("the successor registered", lambda: cluster_healthy(cluster, t), 60, 0.02)
    time.sleep(1.0)
    log = cluster.klog()
    new_register = log.of(REGISTER, t)[0].at
    old_end = [ln.at for ln in log.of(STREAM_ENDED, t)]
    windows = log.windows(t)
    kept = not windows
    figure(f"real: clients kept {'per name and socket path' if clients == {True} else 'per resource name'}; "
           f"new Register {ms(old_end[0] - new_register) if old_end else '?'} ms before the old stream ended; "
           f"the resource {'stayed healthy' if kept else 'lost every healthy unit for ' + spread([b - s for s, b, _ in windows])}"
           f"; model: {MODEL['endpoints']}",
           "kubelet keeps device plugin clients per", "name and socket" if clients == {True} else "resource name")
    assert old_end and old_end[0] > new_register, (old_end, new_register)
    if clients == {True}:
        assert kept, windows


def test_habit_when_pods_are_admitted_after_a_restart(node, cluster, figure):
    took, healthy, fates = [], [], []
    for i in range(ROUNDS):
        cluster.stop_kubelet()
        since = time.time()
        cluster.api.create(w.PODS, w.pod(f"waiting{i}", cluster.image, node=NODE))
        cluster.start_kubelet()
        wait_for("kubelet took the pod in", lambda: cluster.klog().admitted_at(f"waiting{i}", since), 60, 0.05)
        log = cluster.klog()
        server = log.of(SERVER, since, resource=False)[0].at
        took.append(log.admitted_at(f"waiting{i}", since) - server)
        healthy.append(log.healthy_lists(since)[0].at - server)
        pod = wait_for("kubelet to decide", lambda: (lambda p: p if rejected(p) or pod_phase(p) in ("Running", "Succeeded")
                                                     else None)(cluster.api.get(f"{w.PODS}/waiting{i}")), 60, 0.1)
        fates.append(rejected(pod))
        clean_pods(cluster)
    figure(f"real: registration server -> first pods taken in {spread(took)}, -> our units healthy {spread(healthy)}; "
           f"pods rejected {sum(fates)} of {len(fates)}; model: {MODEL['admission']}")
    for h, t, lost in zip(healthy, took, fates):
        assert lost == (t < h - EDGE_S) or abs(t - h) <= EDGE_S, (h, t, lost)  # taken in before we were healthy: rejected
