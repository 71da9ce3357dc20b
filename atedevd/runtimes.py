"""What the node's container runtime will do with a grant, from its configuration files.

`atedevd check` judges which pods can open a device; the runtime decides part of it: whether
it honours CDI names (containerd 1.7 only with `enable_cdi`, 2.x by default, CRI-O always),
which directories it reads specs from, whether it gives a DeviceSpec's node the pod's
runAsUser/runAsGroup (`device_ownership_from_security_context`), and which OCI runtime makes
the container (runc binds the host's node into a user namespace; crun makes one). Only what
the files say is read (containerd's `/etc/containerd/config.toml`, CRI-O's `crio.conf` and its
drop-ins); what they leave out is the runtime's default, which depends on its version.
"""

import glob
import os
import sys
from typing import Dict, List, Optional

from atedevd.record import Record

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONTAINERD = "/etc/containerd/config.toml"
CRIO = "/etc/crio/crio.conf"
CRIO_DROP_INS = "/etc/crio/crio.conf.d"
DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


class Runtime(Record):
    """One container runtime's settings that decide a grant."""

    name: str  # "containerd" or "CRI-O"
    source: str  # the file(s) read
    cdi: Optional[bool]  # honours CDI names; None: not said (containerd: 1.7 off, 2.x on)
    spec_dirs: tuple  # where it reads CDI specs
    ownership_from_security_context: bool  # a DeviceSpec's node gets the pod's runAsUser/runAsGroup
    oci_runtime: Optional[str]  # "runc", "crun", ...; None: not said


def read(root: str = "/") -> List[Runtime]:
    """The runtimes configured on this node (none when neither file is there)."""
    found = []
    containerd = _load(os.path.join(root, CONTAINERD.lstrip("/")))
    if containerd is not None:
        found.append(_containerd(containerd, os.path.join(root, CONTAINERD.lstrip("/"))))
    crio_files = [os.path.join(root, CRIO.lstrip("/"))] + sorted(glob.glob(os.path.join(root, CRIO_DROP_INS.lstrip("/"), "*.conf")))
    merged: Dict[str, dict] = {}
    read_files = []
    for path in crio_files:
        data = _load(path)
        if data is not None:
            read_files.append(path)
            merged.setdefault("runtime", {}).update(data.get("crio", {}).get("runtime", {}))
    if read_files:
        found.append(_crio(merged.get("runtime", {}), " ".join(read_files)))
    return found


def _load(path: str) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError):
        return None


def _containerd(data: dict, path: str) -> Runtime:
    plugins = data.get("plugins", {})
    if data.get("version") == 3:  # containerd 2.x
        cri = plugins.get("io.containerd.cri.v1.runtime", {})
        cdi = cri.get("enable_cdi", True)
        runtime = cri.get("containerd", {}).get("default_runtime_name")
    else:  # version 2: containerd 1.x (2.x reads it too, with CDI on unless said)
        cri = plugins.get("io.containerd.grpc.v1.cri", {})
        cdi = cri.get("enable_cdi")
        runtime = cri.get("containerd", {}).get("default_runtime_name")
    return Runtime("containerd", path, cdi if isinstance(cdi, bool) else None,
                   tuple(cri.get("cdi_spec_dirs") or DEFAULT_SPEC_DIRS),
                   cri.get("device_ownership_from_security_context") is True, _oci(runtime))


def _crio(runtime: dict, source: str) -> Runtime:
    return Runtime("CRI-O", source, True, tuple(runtime.get("cdi_spec_dirs") or DEFAULT_SPEC_DIRS),
                   runtime.get("device_ownership_from_security_context") is True,
                   _oci(runtime.get("default_runtime")))


def _oci(name) -> Optional[str]:
    if not isinstance(name, str):
        return None
    return "crun" if "crun" in name else "runc" if "runc" in name else name
