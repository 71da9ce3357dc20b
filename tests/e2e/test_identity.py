"""The kubelet atedevd finds behind kubelet.sock (atedevd/kubelet/identity.py) on a real node: the
version read from the running kubelet's own program is the one under test, and what `check` says
an upgrade would do (beside the running atedevd, or once kubelet let go) is what this kubelet's
log shows it does with endpoints (a client per socket from 1.37)."""
from __future__ import annotations

from tests.e2e.test_events import per_socket


def test_the_kubelet_behind_the_socket_is_the_one_running(node, cluster, figure):
    found = [f for f in node.check()["findings"] if f["check"] == "kubelet-version"]
    assert len(found) == 1, found
    (f,) = found
    assert f["status"] == "ok", f
    assert f"kubelet {cluster.kubelet_version}, the program of PID " in f["message"], f
    beside = "registers beside the running atedevd" in f["message"]
    assert beside == per_socket(cluster), (f, per_socket(cluster))
    figure(f"identity: {f['message']}", "version atedevd reads from kubelet's program; its upgrades register",
           f"{cluster.kubelet_version}; {'beside' if beside else 'after the let-go'}")
