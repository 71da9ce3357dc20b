"""What a DRA node publishes, as values: its devices, the ResourceSlices that list them and the
DeviceClasses that name them. No I/O.

The devices are the ones the device-plugin mode judges (atedevd/devices: one table per
`[[device]]`, the same policy, invariants and trust rules): a shareable resource (`/dev/kvm`) is
one device that claims share (`allowMultipleAllocations`, consumable capacity: on by default
since 1.36), at most its `count` of them at once (a capacity each claim takes one of), each unit
of a pattern a device of its own. A device is
listed while it is healthy, with the CDI names a prepared claim is answered with, which the
resource's CDI spec (atedevd/cdi) has on disk before the device is listed.
"""

import hashlib
import re
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from atedevd.record import Record

DRIVER = "ate.dev"  # the DRA driver name; kubelet finds the plugin by it
MAX_DEVICES_PER_SLICE = 128  # the API server's limit
MAX_TAINTED_PER_SLICE = 64  # ... where a device of the slice has taints
GONE = "ate.dev/node-gone"  # the taint of a device whose node went while a claim holds it
NUMA_ATTRIBUTE = "resource.kubernetes.io/numaNode"
CLAIMS = "claims"  # a shared device's capacity: how many claims may share it
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class DraDevice(Record):
    """One device as a ResourceSlice lists it and a prepared claim is answered with it."""

    name: str  # a DNS label, unique in the node's pool
    resource: str  # its `[[device]]`'s resource (`ate.dev/kvm`): the DeviceClass selects by it
    path: str  # the node pods see
    shared: bool  # one node any number of claims may share
    cdi_ids: Tuple[str, ...]  # qualified CDI names, on disk
    numa: Tuple[int, ...] = ()
    taint: str = ""  # a taint's key (GONE): listed, but the scheduler allocates it no more
    capacity: int = 0  # (shared) how many claims may share it at once: its `count`; 0: any number


def device_name(resource: str, unit: Optional[str]) -> str:
    """The device's name in the pool: the resource's name (`kvm`), or the resource's and the
    unit's (`vfio-vfio-12`), as a DNS label. What is not one already is written in its letters
    and digits and a hash of what it was, so that two units never share a name."""
    base = resource.split("/", 1)[1] if unit is None else f"{resource.split('/', 1)[1]}-{unit}"
    if len(base) <= 63 and _LABEL.fullmatch(base):
        return base
    digest = hashlib.sha256(f"{resource}\0{unit}".encode()).hexdigest()[:10]
    plain = re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-")[:52] or "d"
    return f"{plain}-{digest}"


def slice_name(node: str, index: int) -> str:
    """`<node>-ate.dev-0`: one name per slice of the node's pool, so that a publish is a create
    or a replace by name, and a node's slices never collide with another's."""
    name = f"{node}-{DRIVER}-{index}"
    return name if len(name) <= 253 else f"{hashlib.sha256(node.encode()).hexdigest()[:16]}-{DRIVER}-{index}"


def _device_entry(d: DraDevice) -> dict:
    attributes: Dict[str, dict] = {"resource": {"string": d.resource}, "path": {"string": d.path}}
    if len(d.numa) == 1:
        attributes[NUMA_ATTRIBUTE] = {"int": d.numa[0]}
    entry: dict = {"name": d.name, "attributes": attributes}
    if d.shared:
        entry["allowMultipleAllocations"] = True
    if d.shared and d.capacity:  # each claim takes one of `capacity` (consumable capacity, KEP-5075)
        entry["capacity"] = {CLAIMS: {"value": str(d.capacity), "requestPolicy": {"default": "1", "validValues": ["1"]}}}
    if d.taint:
        entry["taints"] = [{"key": d.taint, "effect": "NoSchedule"}]
    return entry


def slices(node: str, node_uid: Optional[str], devices: Sequence[DraDevice], generation: int) -> List[dict]:
    """The node's ResourceSlices (`resource.k8s.io/v1`): one pool named after the node, its
    devices in slices of at most MAX_DEVICES_PER_SLICE, owned by the Node so that a deleted
    Node takes them along. A node with no device publishes one empty slice: the pool says there
    is nothing, rather than nothing saying so."""
    ordered = sorted(devices, key=lambda d: d.name)
    most = MAX_TAINTED_PER_SLICE if any(d.taint for d in ordered) else MAX_DEVICES_PER_SLICE
    chunks = [ordered[i:i + most] for i in range(0, len(ordered), most)] or [[]]
    out = []
    for i, chunk in enumerate(chunks):
        meta: dict = {"name": slice_name(node, i)}
        if node_uid:
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                        "controller": True}]
        out.append({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta,
            "spec": {"driver": DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
                     "devices": [_device_entry(d) for d in chunk]},
        })
    return out


def same_content(published: Mapping, wanted: Mapping, taints: bool = True) -> bool:
    """Whether a slice on the server lists what we want it to (its pool's generation aside):
    no update is sent for a slice that says it already. `taints`: compared too (an API server
    without device taints, DRADeviceTaints off, drops them)."""
    a, b = dict(published.get("spec") or {}), dict(wanted.get("spec") or {})
    pa, pb = dict(a.pop("pool", None) or {}), dict(b.pop("pool", None) or {})
    pa.pop("generation", None), pb.pop("generation", None)
    return pa == pb and _comparable(a, taints) == _comparable(b, taints) and \
        (published.get("metadata") or {}).get("ownerReferences") == (wanted.get("metadata") or {}).get("ownerReferences")


def _comparable(spec: dict, taints: bool) -> dict:
    """A slice's spec without what the server adds by default (an empty list, a false flag, a
    taint's timeAdded)."""
    out = {k: v for k, v in spec.items() if v not in (None, [], {}, False)}
    devices = []
    for d in spec.get("devices") or ():
        d = {k: v for k, v in d.items() if v not in (None, [], {}, False)}
        if "taints" in d:
            d["taints"] = [{k: v for k, v in t.items() if k != "timeAdded" and v not in (None, "")} for t in d["taints"]]
        if not taints:
            d.pop("taints", None)
        devices.append(d)
    out["devices"] = devices
    return out


def class_name(resource: str) -> str:
    """The DeviceClass of a resource: `kvm.ate.dev` for `ate.dev/kvm`."""
    return f"{device_name(resource, None)}.{resource.split('/', 1)[0]}"


def device_class(resource: str) -> dict:
    """The DeviceClass that selects a resource's devices on every DRA node, and maps the extended
    resource name to it (`extendedResourceName`, KEP-5004: GA in 1.37), so that a pod asking for
    `ate.dev/kvm: 1`, unchanged, gets a claim on it where the node serves it through DRA."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": class_name(resource)},
        "spec": {
            "selectors": [{"cel": {"expression":
                                   f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].resource == "{resource}"'}}],
            "extendedResourceName": resource,
        },
    }


def by_name(devices: Iterable[DraDevice]) -> Dict[str, DraDevice]:
    return {d.name: d for d in devices}
