"""The end-to-end suite's fixtures: one real cluster per kubelet version, atedevd on its node.

The versions are ATEDEVD_E2E_KUBE's minors ("1.37", or "1.32 1.33 ..."; `make e2e KUBE=...`),
by default every kubelet the builder has cached. The cluster is session-scoped and parametrized
by version, so pytest runs every test of one version on one cluster, then stops it before the
next version's starts: one cluster at a time on the shared cores. Each test prints its figure and
the figures are repeated, by version, at the end of the run, and after them the kubelet ×
behaviour table (markdown, dated) the README's *Kubelet versions* is taken from.

Without root or without the built binaries every test here is skipped, with the reason.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import pytest

from tests.e2e import build
from tests.e2e.api import wait_for
from tests.e2e.cluster import Cluster
from tests.e2e.plugin import Atedevd, gone
from tests.e2e.workloads import RESOURCE

FIGURES: Dict[str, List[str]] = {}
TABLE: Dict[str, Dict[str, str]] = {}  # behaviour -> kubelet version -> what this run measured


def _selected() -> List[str]:
    wanted = os.environ.get("ATEDEVD_E2E_KUBE", "").replace(",", " ").split()
    cached = build.kubelet_versions()
    if not wanted:
        return cached
    return [v for v in cached if any(v.lstrip("v") == w or v.lstrip("v").startswith(w + ".") for w in wanted)] \
        + [f"missing-{w}" for w in wanted if not any(v.lstrip("v").startswith(w + ".") or v.lstrip("v") == w
                                                      for v in cached)]


def _why_not() -> str:
    if os.geteuid() != 0:
        return "the e2e cluster needs root (mounts, cgroups, device nodes)"
    try:
        for name in ("kube-apiserver", "etcd", "containerd", "ctr", "runc", "crictl"):
            build.binary(name)
    except FileNotFoundError as e:
        return str(e)
    return ""


VERSIONS = _selected() or ["none-built"]


@pytest.fixture(scope="session", params=VERSIONS, ids=[v.lstrip("v") for v in VERSIONS])
def kube(request) -> str:
    """The kubelet version under test (a cached one, e.g. v1.36.3)."""
    return request.param


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("e2e figures")
        for version, lines in FIGURES.items():
            for line in lines:
                terminalreporter.write_line(f"{version}  {line}")
    if TABLE:
        versions = sorted({v for cells in TABLE.values() for v in cells}, key=lambda v: [int(x) for x in v[1:].split(".")])
        terminalreporter.section("kubelet x behaviour")
        terminalreporter.write_line(f"measured by make e2e on {time.strftime('%Y-%m-%d')}, kubelets {', '.join(versions)}")
        terminalreporter.write_line("| | " + " | ".join(versions) + " |")
        terminalreporter.write_line("|---|" + "---|" * len(versions))
        for row, cells in TABLE.items():
            terminalreporter.write_line(f"| {row} | " + " | ".join(cells.get(v, "not run") for v in versions) + " |")


@pytest.fixture(scope="session")
def cluster(kube):
    """The running cluster of this version, started once for all of its tests."""
    why = _why_not()
    if why:
        pytest.skip(why)
    if kube.startswith(("missing-", "none-")):
        pytest.skip(f"no kubelet {kube.split('-', 1)[1]} is built: run `make e2e-build KUBE=...`")
    c = Cluster(kube)
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    print(f"\ncluster with kubelet {c.kubelet_version} (control plane {c.control_plane}) up in {c.started_in:.1f} s")
    yield c
    c.stop()
    left = c.host_changes()
    assert not left, f"the run left behind: {left}"


@pytest.fixture
def figure(cluster, request):
    """figure(text, row=, cell=): print one of the test's figures and keep it for the run's
    summary; `cell` is what the kubelet × behaviour table says in `row` for this kubelet."""
    def say(text: str, row: Optional[str] = None, cell: str = "") -> None:
        line = f"{request.node.name.split('[')[0]}: {text}"
        print(f"\nFIGURE {cluster.kubelet_version} {line}")
        FIGURES.setdefault(cluster.kubelet_version, []).append(line)
        if row is not None:
            TABLE.setdefault(row, {})[cluster.kubelet_version] = cell
    return say


def clean_pods(cluster: Cluster) -> None:
    """Every workload and pod of the test gone (kubelet stops them at once: grace 0)."""
    cluster._delete_pods()


def wait_counted(cluster: Cluster, units: int = 1024, timeout: float = 60) -> None:
    """kubelet counts `units` healthy units of the resource, as its pod-resources API lists them
    and the Node's allocatable says."""
    wait_for(f"the Node to have {units} {RESOURCE}", lambda: cluster.allocatable(RESOURCE) == str(units), timeout, 0.2)


@pytest.fixture
def start_atedevd(cluster):
    """start_atedevd(**Atedevd options): atedevd on the node, started and registered with kubelet;
    afterwards stopped, and the test's pods gone."""
    started: List[Atedevd] = []

    def start(wait: bool = True, **kwargs) -> Atedevd:
        a = Atedevd(cluster, **kwargs)
        started.append(a)
        since = time.time()
        a.start()
        if wait:
            wait_for("kubelet to register the resource", lambda: cluster_healthy(cluster, since), 60, 0.05)
        return a

    yield start
    clean_pods(cluster)
    for a in started:
        if not gone(a.main_pid):
            a.stop()
        a.close()
        cluster._extra_cleanup.remove(a.close)


@pytest.fixture
def node(start_atedevd):
    """The cluster's node with atedevd serving /dev/kvm on it (the default configuration),
    registered and counted."""
    return start_atedevd()


def cluster_healthy(cluster: Cluster, since: float = 0.0) -> bool:
    """kubelet's log: a healthy list since `since`, and no window open now."""
    log = cluster.klog()
    windows = log.windows()
    return bool(log.healthy_lists(since)) and (not windows or windows[-1][2] != float("inf"))
