"""Which pods can open a granted node, by pod kind: the verdicts `atedevd check` prints.

Opening a node in a container passes its permissions, then the device cgroup (which the
grant sets up for every kind). What the permissions are depends on the pod kind and on how
the node was made (docs/devices-in-containers.md has the measured table):

- a DeviceSpec grant makes the node with the host node's mode and owner (a runtime with
  `device_ownership_from_security_context` gives it the pod's runAsUser/runAsGroup);
- a CDI grant makes it with the spec's mode (`container_mode`) and owner (`container_uid`,
  `container_gid`; unset, the runtime's CDI library makes it the container's user's);
- in a user namespace (`hostUsers: false`) runc cannot make a node: it bind-mounts the
  host's node at the container path, whose own mode is judged for a uid that is nobody on
  the host. Only a host node others may read and write opens.
"""

import stat
from typing import Iterable, List, Optional

from atedevd.check.runtimes import Runtime
from atedevd.config import Device
from atedevd.record import Record

ROOT, NON_ROOT, GROUP, CDI, USERNS = "root", "non-root", "non-root-with-group", "non-root-cdi", "user-namespace"
KINDS = (ROOT, NON_ROOT, GROUP, CDI, USERNS)
TITLES = {ROOT: "root", NON_ROOT: "non-root", GROUP: "non-root, the node's group", CDI: "non-root, through CDI",
          USERNS: "user namespace"}
YES, NO = "yes", "no"


class HostNode(Record):
    """A granted node as the host has it."""

    container_path: str  # the path pods see
    host_path: str  # where atedevd looks it up
    mode: int
    uid: int
    gid: int
    rdev: int
    # the host's node at the container path, which runc binds into a user namespace: its rdev, or None
    at_container_path: Optional[int]
    owner: str = ""  # user:group in words


class PodVerdict(Record):
    kind: str
    opens: str  # YES or NO
    why: str
    fix: Optional[str] = None


def _need(permissions: str) -> int:
    return (4 if "r" in permissions else 0) | (2 if "w" in permissions else 0)


def _lets(mode: int, shift: int, need: int) -> bool:
    return ((mode >> shift) & need) == need


def _octal(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def judge(node: HostNode, device: Device, cdi: bool, spec_dir: str, runtimes: Iterable[Runtime]) -> List[PodVerdict]:
    """The verdict of every pod kind for one node of `device`."""
    runtimes = list(runtimes)
    need = _need(device.permissions)
    where = f"{node.host_path} is {_octal(node.mode)} {node.owner or f'{node.uid}:{node.gid}'}"
    out = [PodVerdict(ROOT, YES, "root in the host's user namespace opens any node the device cgroup allows")]

    owners = [r.name for r in runtimes if r.ownership_from_security_context]
    if _lets(node.mode, 0, need):
        out.append(PodVerdict(NON_ROOT, YES, f"{where}: others may open it"))
    elif owners:
        out.append(PodVerdict(NON_ROOT, YES, f"{', '.join(owners)} gives the node the pod's runAsUser/runAsGroup "
                                          "(device_ownership_from_security_context)"))
    else:
        out.append(PodVerdict(NON_ROOT, NO, f"{where}: the node keeps that mode and owner in the container",
                           "[daemon] cdi = true (the row below), or device_ownership_from_security_context = true "
                           "in the container runtime"))
    if _lets(node.mode, 3, need):
        out.append(PodVerdict(GROUP, YES, f"{where}: with supplementalGroups: [{node.gid}] (the node's gid)"))
    else:
        out.append(PodVerdict(GROUP, NO, f"{where}: its group may not open it",
                           "make the host node 0660 with a group of its own (a udev rule) and give the pod that gid"))
    out.append(_cdi(device, cdi, spec_dir, runtimes, need))
    out.append(_userns(node, device, out[-1].opens == YES, runtimes, need, where))
    return out


def _cdi(device: Device, cdi: bool, spec_dir: str, runtimes: List[Runtime], need: int) -> PodVerdict:
    if not cdi:
        return PodVerdict(CDI, NO, "cdi = false: answers carry the DeviceSpec alone",
                       "[daemon] cdi = true (containerd 1.7 with enable_cdi = true, containerd 2.x, CRI-O)")
    off = [r for r in runtimes if r.cdi is not True]
    if off:
        r = off[0]
        if r.cdi is False and r.enable_cdi is None:
            why = f"{r.name} {r.version} does not honour CDI names unless enable_cdi = true, which {r.source} does not set"
        elif r.cdi is False:
            why = f"{r.name} does not honour CDI names ({r.source}: enable_cdi = false)"
        else:
            why = (f"{r.name}'s version is not known and {r.source} does not set enable_cdi: containerd 1.x, as shipped, "
                   "does not honour CDI names (2.x does)")
        return PodVerdict(CDI, NO, why, f"enable_cdi = true in {r.source}, then restart {r.name}")
    blind = [r for r in runtimes if spec_dir.rstrip("/") not in [d.rstrip("/") for d in r.spec_dirs]]
    if blind:
        r = blind[0]
        return PodVerdict(CDI, NO, f"{r.name} reads CDI specs from {', '.join(r.spec_dirs)}, not {spec_dir}",
                       f"cdi_spec_dir = \"{r.spec_dirs[-1]}\" in [daemon]")
    mode = device.container_mode
    made = f"the runtime makes it {mode:04o}"
    if device.container_uid is None and _lets(mode, 6, need):
        return PodVerdict(CDI, YES, f"{made}, the container's user's")
    if _lets(mode, 0, need):
        return PodVerdict(CDI, YES, f"{made}: others may open it")
    if device.container_gid is not None and _lets(mode, 3, need):
        return PodVerdict(CDI, YES, f"{made}, group {device.container_gid}: with supplementalGroups: "
                                 f"[{device.container_gid}]")
    return PodVerdict(CDI, NO, f"{made}, owner {device.container_uid}: the pod's user may not open it",
                   "container_mode = 0o666 (the default) in this [[device]]")


def _userns(node: HostNode, device: Device, cdi: bool, runtimes: List[Runtime], need: int, where: str) -> PodVerdict:
    """The user-namespace verdict, by the OCI runtime each container runtime runs (runc when none says)."""
    verdicts = [_userns_crun(device, cdi and r.cdi is True, r, need) if r.oci_runtime == "crun" else
                _userns_runc(node, device, need, where) for r in runtimes] or [_userns_runc(node, device, need, where)]
    worst = next((v for v in verdicts if v.opens == NO), verdicts[0])
    if len({v.why for v in verdicts}) > 1:  # the runtimes differ: each says its own
        worst = worst._replace(why="; ".join(f"{r.name}: {v.why}" for r, v in zip(runtimes, verdicts)))
    return worst


def _userns_crun(device: Device, cdi: bool, runtime: Runtime, need: int) -> PodVerdict:
    """crun makes the node in the user namespace itself (measured: crun 1.8.1, podman 4.3): with the
    spec's mode and the container's user as owner through CDI, else the host node's mode less the
    umask (0660 becomes 0640) and the container's root as owner."""
    who = f"{runtime.name} runs crun, which makes the node in the user namespace itself"
    if cdi and device.container_uid is None:
        return PodVerdict(USERNS, YES, f"{who}, as the CDI spec says: owned by the container's user")
    if cdi and _lets(device.container_mode & ~0o022, 0, need):
        return PodVerdict(USERNS, YES, f"{who}, as the CDI spec says: {device.container_mode & ~0o022:04o}")
    return PodVerdict(USERNS, NO, f"{who}, with the host node's mode less the umask (0660 becomes 0640), owned by the "
                                  "container's root: root in the user namespace opens it, another user does not",
                      "[daemon] cdi = true (crun then makes the node the container's user's)" if not cdi else
                      "leave container_uid unset in this [[device]] (the node is then the container's user's)")


def _userns_runc(node: HostNode, device: Device, need: int, where: str) -> PodVerdict:
    if node.at_container_path != node.rdev:
        return PodVerdict(USERNS, NO, f"runc bind-mounts the host's {node.container_path} (the container path), which "
                                   f"is {'missing' if node.at_container_path is None else 'another node'}, not "
                                   f"{node.host_path}",
                       f"serve the node at the path pods see: {node.container_path} on the host")
    if device.host_mode is not None and _lets(device.host_mode, 0, need):
        return PodVerdict(USERNS, YES, f"host_mode = 0o{device.host_mode:o}: atedevd keeps {node.host_path} so, and runc "
                                    f"binds the host node (now {_octal(node.mode)})")
    if _lets(node.mode, 0, need):
        return PodVerdict(USERNS, YES, f"{where}: runc binds the host node, and others may open it")
    return PodVerdict(USERNS, NO, f"{where}: runc binds the host node, and the kernel judges its own mode for a uid "
                               f"that is nobody on the host (the spec's and the runtime's owner do not apply)",
                   f"the one fix: a host node others may read and write: host_mode = 0o666 in this [[device]] "
                   f"(atedevd keeps it so; or a udev rule with MODE=\"0666\"). It means every user and process on "
                   f"the host may open {node.container_path} too, not only the pods granted it")


def combine(per_node: List[List[PodVerdict]]) -> List[PodVerdict]:
    """One verdict per kind for a device of several nodes (its companions, a pattern's units):
    a kind opens the device when it opens every node; else the first node it cannot."""
    out = []
    for i, kind in enumerate(KINDS):
        verdicts = [v[i] for v in per_node]
        out.append(next((v for v in verdicts if v.opens == NO), verdicts[0]))
    return out
