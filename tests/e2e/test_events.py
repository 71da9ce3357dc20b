"""atedevd's own lifecycle events on a real kubelet, each as systemd would do it, with the window
measured from kubelet's log and pods put into it (tests/e2e/window.py). ATEDEVD_E2E_ROUNDS rounds
an event (default 3)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e import workloads as w
from tests.e2e.api import wait_for
from tests.e2e.conftest import cluster_healthy, clean_pods
from tests.e2e.kubelet_log import PROCESSED, PUSHED, REGISTERED, spread
from tests.e2e.window import cell, check_pods, measure, summary

ROUNDS = int(os.environ.get("ATEDEVD_E2E_ROUNDS", "3"))


def kvm(count: int) -> str:
    return f'[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = {count}\n'


def per_socket(cluster) -> bool:
    """kubelet keeps a client per name and socket path (it logs the path with the client)."""
    return any("socketPath" in ln.kv for ln in cluster.klog().of(REGISTERED))


def assert_a_pod_gets_the_device(cluster, tag: str) -> None:
    """After the event: the resource serves (an endpoint kubelet stopped silently would fail this)."""
    cluster.api.create(w.PODS, w.pod(f"after-{tag}", cluster.image))
    got = w.seen(cluster.pod_logs, w.wait_probed(cluster.api, cluster.pod_logs, f"after-{tag}"))
    assert got["open"] == "ok" and got["ioctl"] == 12, got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["restart", "kill-9"])
def test_a_restart_of_atedevd(node, cluster, figure, sig):
    """`systemctl restart` (SIGTERM, a new process once it exited) and a kill -9 restarted by
    Restart=always, RestartSec=0: every pod kubelet takes in meanwhile is rejected."""
    rounds = []
    for i in range(ROUNDS):
        rounds.append(measure(cluster, lambda: node.restart(sig), lambda t: cluster_healthy(cluster, t),
                              f"{'term' if sig == signal.SIGTERM else 'kill'}{i}", pods=3, gap=0.03))
        node.current.wait_ready(30)
        clean_pods(cluster)
    figure(summary(rounds), f"atedevd {'restarted (SIGTERM)' if sig == signal.SIGTERM else 'killed (-9), restarted'}: "
                            "window, pods rejected", cell(rounds))
    for r in rounds:
        assert len(r.windows) == 1 and 0 < r.window_s < 3, r.windows
        assert r.registers == 1, r.registers
    check_pods(rounds)
    assert any(p.rejected for r in rounds for p in r.pods), "no pod landed in any window"
    assert_a_pod_gets_the_device(cluster, "restart")


def counted(cluster, units: int, since: float) -> bool:
    """kubelet processed a list of `units` units, all healthy, since `since`."""
    return any(int(ln.kv.get("totalCount", 0)) == units == int(ln.kv.get("healthyCount", 0))
               for ln in cluster.klog().of(PROCESSED, since))


@pytest.mark.parametrize("before, after", [(1024, 4096), (4096, 256)], ids=["raise", "lower"])
def test_a_reload_that_changes_the_count(start_atedevd, cluster, figure, before, after):
    """SIGHUP with a new count: a device-list update for kubelet, no new Register, no window;
    pods sent at the reload are admitted (lowering: kubelet may still allocate from the old list,
    and what it allocates must be served). Also kubelet's time to process the new list."""
    a = start_atedevd(devices=kvm(before))
    rounds, processing = [], []
    for i in range(ROUNDS):
        if i:
            t = time.time()
            a.reload(kvm(before))
            wait_for("the count back", lambda: counted(cluster, before, t), 30, 0.02)
        r = measure(cluster, lambda: a.reload(kvm(after)), lambda t: counted(cluster, after, t), f"reload{i}",
                    pods=2, gap=0.01, trigger=())
        rounds.append(r)
        log = cluster.klog()
        done = [ln for ln in log.of(PROCESSED, r.since) if int(ln.kv["totalCount"]) == after][0]
        pushed = [ln for ln in log.of(PUSHED, r.since, done.at)][-1]
        processing.append(done.at - pushed.at)
        clean_pods(cluster)
    figure(f"{before} -> {after}: {summary(rounds)}; kubelet's list of {after} processed in {spread(processing)}",
           f"reload, count {before} -> {after}", cell(rounds))
    for r in rounds:
        assert not r.windows and r.registers == 0, (r.windows, r.registers)
        assert not any(p.rejected for p in r.pods), r.pods
    assert_a_pod_gets_the_device(cluster, f"reload-{before}-{after}")


@pytest.mark.parametrize("endpoints", ["auto", "per-resource", "per-socket"])
def test_an_upgrade(start_atedevd, cluster, figure, endpoints):
    """A package upgrade (a file of the installed package renamed over, then a reload): the
    successor registers once kubelet let go of us (per-resource) or beside us (per-socket). On a
    kubelet that keeps a client per socket, per-socket leaves no window; the default, "auto",
    reads the kubelet's version and goes beside it exactly where kubelet keeps a client per socket."""
    a = start_atedevd(endpoints=None if endpoints == "auto" else endpoints, log_level="debug")
    rounds = []
    for i in range(ROUNDS):
        a.wait_startup_done(times=i + 1)
        rounds.append(measure(cluster, a.upgrade, lambda t: cluster_healthy(cluster, t), f"up{i}", pods=3, gap=0.005))
        clean_pods(cluster)
    figure(f"{endpoints}: {summary(rounds)}", f"upgrade, kubelet_endpoints = {endpoints}"
           + (" (the default)" if endpoints == "auto" else ""), cell(rounds))
    for r in rounds:
        assert r.registers >= 1, r.registers
        assert r.window_s < 3, r.windows
    check_pods(rounds)
    if endpoints == "auto":
        beside = "beside us (kubelet tracks endpoints per socket" in a.log()
        assert f"kubelet {cluster.kubelet_version}, the program of PID " in a.log(), a.log()  # (after "(" or "; ")
        assert beside == per_socket(cluster), (beside, a.log())
    if endpoints in ("auto", "per-socket") and per_socket(cluster):
        assert all(not r.windows for r in rounds), [r.windows for r in rounds]
        assert all(r.registers == 1 for r in rounds), [r.registers for r in rounds]
    assert_a_pod_gets_the_device(cluster, f"upgrade-{endpoints}")
