"""`atedevd check` in DRA mode (`[daemon] api = "dra"`, docs/dra.md): what a DRA node needs
beyond its devices. Are the credentials there, and who are they? Are the node's slices published?
Is there a DeviceClass that names each resource? Does the kubelet version support extended
resources through DRA? Does kubelet still count a resource as a device plugin's (the switch's
hazard)? May the unit's sandbox serve kubelet's plugin directories and reach the API server?
Each is a finding, asked with the same credentials and client the daemon uses."""

import os
import re
from typing import Callable, Dict, Optional, Tuple

from atedevd.config import Config
from atedevd.dra import listeners
from atedevd.dra.cluster import NODE_USER_PREFIX, ClusterError, KubeApi, find_kubeconfig
from atedevd.dra.slices import DRIVER, class_name

DROP_IN = "/etc/systemd/system/atedevd.service.d/dra.conf"
STORED = 2  # the listening sockets atedevd hands systemd to keep (atedevd/dra/listeners.py)
OK, PROBLEM, WARNING = "ok", "problem", "warning"  # (report.py's)


def add(cfg: Config, report, props: Optional[Dict[str, str]], sandbox_state: Callable[..., Tuple[bool, str]],
        api: Callable[[str], KubeApi] = KubeApi) -> None:
    """Every DRA finding into `report` (atedevd/check/report.py's NodeReport; `sandbox_state` is its
    judgement of a directory in the unit's sandbox)."""
    root = listeners.kubelet_root(cfg.device_plugin_dir)
    _sandbox(root, props, report, sandbox_state)
    path, why = find_kubeconfig(cfg.kubeconfig)
    if path is None:
        report.add("dra-credentials", cfg.kubeconfig or "kubelet's kubeconfig", PROBLEM, why,
                   "name the node's kubeconfig with [daemon] kubeconfig")
        return
    c = api(path)
    try:
        user = c.whoami()
    except ClusterError as e:
        report.add("dra-credentials", path, PROBLEM, f"the API server could not be asked: {e}")
        return
    node = cfg.node_name or (user[len(NODE_USER_PREFIX):] if user.startswith(NODE_USER_PREFIX) else None)
    if node is None:
        report.add("dra-credentials", path, PROBLEM, f"{user!r} is not a node's identity (system:node:<name>)",
                   "name the node with [daemon] node_name, or use kubelet's own kubeconfig")
        return
    report.add("dra-credentials", path, OK, f"{user} (node {node})")
    try:
        n = c.node(node)
    except ClusterError as e:
        report.add("dra-kubelet", node, PROBLEM, f"the Node could not be read: {e}")
        n = {}
    _kubelet(n, node, report)
    for resource in dict.fromkeys(d.resource for d in cfg.devices):
        counted = str(((n.get("status") or {}).get("allocatable") or {}).get(resource, "0"))
        if counted not in ("0", ""):
            report.add("dra-switch", resource, PROBLEM,
                       f"kubelet still counts {resource} as a device plugin's (allocatable {counted}): a pod scheduled "
                       "now goes the device-plugin way and is rejected",
                       "stop the device plugin and drain the node; kubelet drops the count within a minute")
        else:
            report.add("dra-switch", resource, OK, f"no device plugin counted for {resource}")
        _device_class(c, resource, report)
    try:
        slices, _ = c.slices(node, DRIVER)
    except ClusterError as e:
        report.add("dra-slices", node, PROBLEM, f"the node's ResourceSlices could not be listed: {e}")
        return
    names = [d.get("name") for s in slices for d in (s.get("spec") or {}).get("devices") or ()]
    if not slices:
        report.add("dra-slices", node, PROBLEM, f"no ResourceSlice of driver {DRIVER} is published for node {node}",
                   "start atedevd (systemctl restart atedevd) and see journalctl -u atedevd")
    else:
        generation = max(int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0) for s in slices)
        report.add("dra-slices", node, OK, f"{len(names)} device(s) published ({', '.join(map(str, names[:8]))}), "
                   f"pool generation {generation}")


def _device_class(c: KubeApi, resource: str, report) -> None:
    name = class_name(resource)
    try:
        dc = c.device_class(name)
    except ClusterError as e:
        if e.status == 403:
            report.add("dra-class", name, WARNING, "the node's credentials may not read DeviceClasses",
                       f"check with kubectl get deviceclass {name}")
        else:
            report.add("dra-class", name, PROBLEM, f"no DeviceClass {name}: {e}",
                       "atedevd device-classes | kubectl apply -f -")
        return
    named = (dc.get("spec") or {}).get("extendedResourceName")
    if named != resource:
        report.add("dra-class", name, PROBLEM, f"DeviceClass {name} maps {named!r}, not {resource}: pods asking for "
                   f"{resource} do not get a claim on it", "atedevd device-classes | kubectl apply -f -")
    else:
        report.add("dra-class", name, OK, f"extendedResourceName {resource}")


def _kubelet(n: dict, node: str, report) -> None:
    version = str(((n.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion") or "")
    m = re.match(r"v?(\d+)\.(\d+)", version)
    if not m:
        report.add("dra-kubelet", node, WARNING, f"kubelet's version is not known ({version!r})")
        return
    minor = (int(m.group(1)), int(m.group(2)))
    if minor >= (1, 36):
        report.add("dra-kubelet", node, OK, f"kubelet {version}: extended resources through DRA are on")
    elif minor >= (1, 34):
        report.add("dra-kubelet", node, WARNING, f"kubelet {version}: extended resources through DRA need the "
                   "DRAExtendedResource gate on kubelet, the API server and the scheduler (alpha)")
    else:
        report.add("dra-kubelet", node, PROBLEM, f"kubelet {version}: no extended resources through DRA (1.34 and newer)",
                   'keep this node on api = "device-plugin"')


def _sandbox(root: str, props: Optional[Dict[str, str]], report, sandbox_state) -> None:
    fix = f"install systemd/atedevd.service.d/dra.conf.example as {DROP_IN}; systemctl daemon-reload"
    for directory in (os.path.join(root, listeners.REGISTRY), listeners.plugin_dir(root)):
        ok, text = sandbox_state(directory, props)
        report.add("dra-sandbox", directory, OK if ok else PROBLEM, text, None if ok else fix)
    if props is not None and props.get("PrivateNetwork") == "yes":
        report.add("dra-sandbox", "network", PROBLEM, "atedevd.service has no network (PrivateNetwork=yes): it cannot "
                   "reach the API server", fix)
    if props is not None:
        kept = props.get("FileDescriptorStoreMax", "0")
        if kept.isdigit() and int(kept) >= STORED:
            report.add("dra-sandbox", "restarts", OK, f"systemd keeps kubelet's DRA sockets across a restart "
                       f"(FileDescriptorStoreMax={kept}): prepares sent meanwhile wait for the next start")
        else:
            report.add("dra-sandbox", "restarts", WARNING, f"systemd keeps no socket of atedevd's across a restart "
                       f"(FileDescriptorStoreMax={kept}): kubelet's prepares are refused while atedevd restarts, and "
                       "their pods wait for their next sync (a minute or more)", fix)
