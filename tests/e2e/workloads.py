"""The pods the suite sends through the API, as users write them, and what their probe saw.

Every container runs the image's probe on the device paths it is given (tests/e2e/image.py) and
prints what it saw; kubelet writes that to the pod's log in the cluster's podLogsDir, read here
(the Node has no address kubectl logs could reach: kubelet refuses a loopback one).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests.e2e.api import Api, pod_phase, rejected, wait_for
from tests.runtime import oci_runtime

NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
RESOURCE = "ate.dev/kvm"


def container(image: str, paths: Sequence[str] = ("/dev/kvm",), resource: Optional[str] = RESOURCE, units: int = 1,
              user: Optional[int] = None, hold: bool = False, mount_host_kvm: bool = False) -> dict:
    c: dict = {"name": "probe", "image": image, "imagePullPolicy": "Never",
               "command": ["/probe-hold" if hold else "/probe", *paths]}
    if resource:
        c["resources"] = {"limits": {resource: str(units)}}
    if user is not None:
        c["securityContext"] = {"runAsUser": user, "runAsGroup": user, "runAsNonRoot": True,
                                "allowPrivilegeEscalation": False}
    if mount_host_kvm:
        c["volumeMounts"] = [{"name": "host-kvm", "mountPath": "/dev/kvm"}]
    return c


def pod_spec(image: str, restart: str = "Never", groups: Sequence[int] = (), host_users: Optional[bool] = None,
             node: Optional[str] = None, mount_host_kvm: bool = False, **kwargs) -> dict:
    spec: dict = {"restartPolicy": restart, "terminationGracePeriodSeconds": 1,
                  "containers": [container(image, mount_host_kvm=mount_host_kvm, **kwargs)]}
    if groups:
        spec["securityContext"] = {"supplementalGroups": list(groups)}
    if host_users is not None:
        spec["hostUsers"] = host_users
    if node:
        spec["nodeName"] = node  # a bare pod bound by its writer, as a DaemonSet's or a static pod's are
    if mount_host_kvm:
        spec["volumes"] = [{"name": "host-kvm", "hostPath": {"path": "/dev/kvm", "type": "CharDevice"}}]
    return spec


def pod(name: str, image: str, labels: Optional[Dict[str, str]] = None, **kwargs) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {"e2e": name}},
            "spec": pod_spec(image, **kwargs)}


def deployment(name: str, image: str, replicas: int = 1, **kwargs) -> dict:
    labels = {"e2e": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": pod_spec(image, restart="Always", hold=True, **kwargs)}}}


def job(name: str, image: str, **kwargs) -> dict:
    labels = {"e2e": name}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": labels},
                                                      "spec": pod_spec(image, restart="Never", **kwargs)}}}


# ---- what the pods saw ------------------------------------------------------------------------------

def log_text(pod_logs: Path, pod_obj: dict, container_name: str = "probe") -> Optional[str]:
    """The container's output (CRI log lines without their timestamp and stream), or None."""
    meta = pod_obj["metadata"]
    path = pod_logs / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container_name / "0.log"
    try:
        raw = path.read_text(errors="replace")
    except OSError:
        return None
    return "\n".join(line.split(" ", 3)[-1] for line in raw.splitlines())


def seen(pod_logs: Path, pod_obj: dict) -> Dict[str, object]:
    """What the probe saw of its first path (oci_runtime.parse: stat, open, ioctl, uid)."""
    return oci_runtime.parse(log_text(pod_logs, pod_obj) or "")


def opened_paths(pod_logs: Path, pod_obj: dict) -> Dict[str, str]:
    """Each path the probe found, and 'ok' or the errno of its open."""
    out = {}
    for line in (log_text(pod_logs, pod_obj) or "").splitlines():
        m = re.fullmatch(r"open (\S+) (?:ok ioctl=-?\d+|errno=(\w+))", line)
        if m:
            out[m.group(1)] = m.group(2) or "ok"
    return out


def wait_probed(api: Api, pod_logs: Path, name: str, timeout: float = 120) -> dict:
    """The pod once its probe has printed (or kubelet rejected it); the pod object."""
    def done():
        p = api.get(f"{PODS}/{name}")
        if rejected(p) or pod_phase(p) == "Failed":
            return p
        text = log_text(pod_logs, p) if p.get("metadata", {}).get("uid") else None
        return p if text and "uid=" in text else None
    return wait_for(f"pod {name} to have probed", done, timeout, 0.2)


def pods_of(api: Api, label: str) -> List[dict]:
    return api.items(PODS, f"e2e={label}")
