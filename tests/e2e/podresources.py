"""kubelet's pod-resources API (v1) on the cluster's node, asked as a node agent asks it: which
units kubelet holds allocatable, and which it gave each pod's containers."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Set

import grpc

from atedevd.api import PodResourcesStub, prpb


def _stub(kubelet_root: Path):
    channel = grpc.insecure_channel(f"unix:{kubelet_root / 'pod-resources' / 'kubelet.sock'}")
    return channel, PodResourcesStub(channel)


def allocatable(kubelet_root: Path, resource: str) -> Set[str]:
    """The unit IDs kubelet lists as allocatable for `resource` (only those it holds healthy)."""
    channel, stub = _stub(kubelet_root)
    try:
        answer = stub.GetAllocatableResources(prpb.AllocatableResourcesRequest(), timeout=10)
    finally:
        channel.close()
    return {i for d in answer.devices if d.resource_name == resource for i in d.device_ids}


def assigned(kubelet_root: Path, resource: str) -> Dict[str, List[str]]:
    """pod name -> the unit IDs of `resource` its containers were given."""
    channel, stub = _stub(kubelet_root)
    try:
        answer = stub.List(prpb.ListPodResourcesRequest(), timeout=10)
    finally:
        channel.close()
    out: Dict[str, List[str]] = {}
    for pod in answer.pod_resources:
        ids = [i for c in pod.containers for d in c.devices if d.resource_name == resource for i in d.device_ids]
        if ids:
            out[pod.name] = ids
    return out
