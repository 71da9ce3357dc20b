"""CDI (the Container Device Interface) names and spec documents, without I/O.

A runtime with CDI (containerd 1.7 with `enable_cdi`, 2.x, CRI-O, podman) makes a device node
for a CDI name as the spec says: its numbers, and its mode and owner in the container. A
DeviceSpec grant keeps the host node's mode and owner, which a pod that does not run as
root often cannot open. So where CDI grants are on, each resource keeps a spec (one kind per
resource, `ate.dev/kvm`) and an Allocate answer names its devices: one device for a
shareable resource (its units are one node), one per unit of a pattern (each unit's node
and the companions).

The names and the document follow what the oldest CDI libraries still in use accept
(podman 4.3 and containerd 1.7.0 carry 0.5.x, whose highest spec version is 0.5.0): a
vendor starts with a letter; a class has letters, digits, `_` and `-` only (dots came with
0.6.0); a device name starting with a digit needs 0.5.0, anything else 0.3.0. The spec
gives each node's type and numbers, so the runtime looks nothing up at the host path: the
node the unit was served with is the one granted (docs/design.md, "The numbers stay a
unit's"), and no `hostPath` is needed (0.5.0).
"""

import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

from atedevd.record import Record

FILE_PREFIX = "atedevd-"  # every spec file of ours: the packages' removal scripts find them by it
_VENDOR = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?")
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
MAX_ID = 63  # kubelet's limit on a device ID (config.MAX_DEVICE_ID)


def kind(resource: str) -> str:
    """The CDI kind of a resource: the resource name, a `.` in its name written `_` (`ate.dev/kvm`)."""
    vendor, name = resource.split("/", 1)
    return f"{vendor}/{name.replace('.', '_')}"


def kind_problem(resource: str) -> Optional[str]:
    """Why a (valid) resource name cannot be a CDI kind, or None."""
    vendor, name = resource.split("/", 1)
    if not _VENDOR.fullmatch(vendor):
        return "cannot name a CDI kind: a CDI vendor (the domain) must start with a letter"
    if not _CLASS.fullmatch(name.replace(".", "_")):
        return "cannot name a CDI kind: a CDI class (the name) must start with a letter"
    return None


def file_name(resource: str) -> str:
    """The spec file of a resource: `atedevd-ate.dev_kvm.json` (a domain has no `_`: the first is the `/`)."""
    return FILE_PREFIX + resource.replace("/", "_", 1) + ".json"


def shared_name(resource: str) -> str:
    """The one CDI device of a shareable resource: its name (`kvm`), whatever its path, so that an
    answer kubelet replays from its checkpoint resolves after a reload that moved the node."""
    return resource.split("/", 1)[1]


def unit_name(unit_id: str) -> str:
    """The CDI device of a pattern's unit: its ID where the ID is a valid CDI name (`vfio-12`,
    `ttyUSB0`). Any other ID (`ttyUSB-`, a hashed `...~<hash>`) is written as its letters and
    digits, `-` to make the name longer than any ID can be, a `.` and the ID in hex: a name no
    other ID has, whatever the IDs (an ID is at most 63 characters, so an ID's own name never
    is one of these; the part after the last `.` gives the ID back)."""
    if _NAME.fullmatch(unit_id):
        return unit_id
    code = unit_id.encode().hex()
    plain = re.sub(r"[^A-Za-z0-9]+", "-", unit_id).strip("-") or "u"
    return plain.ljust(MAX_ID - len(code), "-") + "." + code


def unit_of(name: str) -> Optional[str]:
    """The unit ID a name of `unit_name` stands for: itself, or what its hex says (None: not one of ours)."""
    if len(name) <= MAX_ID:
        return name
    try:
        return bytes.fromhex(name.rsplit(".", 1)[1]).decode()
    except (IndexError, ValueError):
        return None


def qualified(resource: str, name: str) -> str:
    """`ate.dev/kvm=kvm`: what an Allocate answer names and the runtime looks up."""
    return f"{kind(resource)}={name}"


class Settings(Record):
    """How a resource's nodes are made in the container (its `[[device]]` table)."""

    mode: int = 0o666
    uid: Optional[int] = None
    gid: Optional[int] = None
    permissions: str = "rw"  # the device cgroup's access


VERSIONS = ("0.3.0", "0.4.0", "0.5.0")  # what the oldest CDI libraries in use read (0.5.x's highest is 0.5.0)


def version(names: Iterable[str]) -> str:
    """The lowest spec version that allows these device names."""
    return "0.5.0" if any(n[:1].isdigit() for n in names) else "0.3.0"


def device_entry(name: str, nodes: Iterable[Any], settings: Settings) -> dict:
    """One CDI device: its nodes (devices.NodeGrant: the path pods see, the numbers judged), each
    with its type, numbers, container-side mode (and owner) and cgroup access."""
    edits: List[dict] = []
    for n in nodes:
        node: Dict[str, object] = {"path": n.path, "type": "c", "major": n.major, "minor": n.minor,
                                   "fileMode": settings.mode, "permissions": settings.permissions}
        if settings.uid is not None:
            node["uid"] = settings.uid
        if settings.gid is not None:
            node["gid"] = settings.gid
        edits.append(node)
    return {"name": name, "containerEdits": {"deviceNodes": edits}}


def document(resource: str, devices: List[dict]) -> dict:
    """The spec of one resource, its devices sorted by name."""
    devices = sorted(devices, key=lambda d: d["name"])
    return {"cdiVersion": version(d["name"] for d in devices), "kind": kind(resource), "devices": devices}


def device_names(doc: object) -> Tuple[str, ...]:
    """The device names a spec document defines (none when it is not one)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        return ()
    return tuple(d["name"] for d in doc["devices"] if isinstance(d, dict) and isinstance(d.get("name"), str))
