"""What the node's container runtime will do with a grant, from its configuration files.

`atedevd check` judges which pods can open a device; the runtime decides part of it: whether
it honours CDI names (containerd 1.x only with `enable_cdi`, 2.x by default, CRI-O always),
which directories it reads specs from, whether it gives a DeviceSpec's node the pod's
runAsUser/runAsGroup (`device_ownership_from_security_context`), and which OCI runtime makes
the container (runc binds the host's node into a user namespace; crun makes one), named by the
default runtime or by its binary (`BinaryName`, `runtime_path`). Only what the files say is
read (containerd's `/etc/containerd/config.toml`, CRI-O's `crio.conf` and its drop-ins); what
they leave out is the runtime's default, which depends on its version: containerd's is asked
of `containerd --version`. Each file is read as atedevd's own configuration is (a regular file,
opened without blocking, at most 1 MiB), every value's type checked: a file that cannot be read
or has a wrong type is a problem of the runtime's, named, never a hang or a traceback.
"""

import glob
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

from atedevd.config import read_regular
from atedevd.record import Record

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONTAINERD = "/etc/containerd/config.toml"
CRIO = "/etc/crio/crio.conf"
CRIO_DROP_INS = "/etc/crio/crio.conf.d"
DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
MAX_BYTES = 1 << 20
VERSION_TIMEOUT_S = 2.0


class Runtime(Record):
    """One container runtime's settings that decide a grant."""

    name: str  # "containerd" or "CRI-O"
    source: str  # the file(s) read
    cdi: Optional[bool]  # honours CDI names; None: cannot tell (a containerd whose version is not known)
    spec_dirs: tuple  # where it reads CDI specs
    ownership_from_security_context: bool  # a DeviceSpec's node gets the pod's runAsUser/runAsGroup
    oci_runtime: Optional[str]  # "runc", "crun", ...; None: not said
    version: Optional[str] = None  # e.g. "1.7.24", where it could be asked
    enable_cdi: Optional[bool] = None  # what the file says of CDI; None: nothing (the version's default)
    problems: Tuple[str, ...] = ()  # what could not be read, or had the wrong type


def read(root: str = "/", containerd_version: Optional[str] = None) -> List[Runtime]:
    """The runtimes configured on this node (none when neither file is there). `containerd_version`:
    what containerd says it is (default: asked of `containerd --version`, when it has a file)."""
    found = []
    path = os.path.join(root, CONTAINERD.lstrip("/"))
    if os.path.lexists(path):
        data, problems = _load(path)
        found.append(_containerd(data, path, containerd_version or installed_containerd(), problems))
    crio_files = [os.path.join(root, CRIO.lstrip("/"))] + sorted(glob.glob(os.path.join(root, CRIO_DROP_INS.lstrip("/"), "*.conf")))
    merged: Dict[str, Any] = {}
    read_files, problems = [], []
    for path in crio_files:
        if not os.path.lexists(path):
            continue
        data, more = _load(path)
        read_files.append(path)
        problems += more
        runtime = _table(_table(data, "crio", path, problems), "runtime", path, problems)
        for key, value in runtime.items():
            if key == "runtimes" and isinstance(value, dict):
                merged.setdefault("runtimes", {}).update(value)
            else:
                merged[key] = value
    if read_files:
        found.append(_crio(merged, " ".join(read_files), problems))
    return found


def installed_containerd() -> Optional[str]:
    """The version `containerd --version` prints ("1.7.24", "2.2.9"); None when it cannot say."""
    try:
        out = subprocess.run(["containerd", "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bv?(\d+\.\d+(?:\.\d+)?)", out)
    return m.group(1) if m else None


def _load(path: str) -> Tuple[dict, List[str]]:
    """A runtime's TOML file, read as the configuration is; ({}, [why]) when it cannot be."""
    try:
        _, raw, _ = read_regular(path, MAX_BYTES)
    except (OSError, ValueError) as e:
        return {}, [f"{path}: cannot read: {getattr(e, 'strerror', None) or e}"]
    if len(raw) > MAX_BYTES:
        return {}, [f"{path}: larger than {MAX_BYTES} bytes: not read"]
    try:
        return tomllib.loads(raw.decode("utf-8")), []
    except (UnicodeDecodeError, ValueError) as e:
        return {}, [f"{path}: not valid TOML: {e}"]


def _table(data: Any, key: str, path: str, problems: List[str]) -> Dict[str, Any]:
    """`data[key]` when it is a table; {} when it is absent, and a problem when it is something else."""
    value = data.get(key, {}) if isinstance(data, dict) else {}
    if not isinstance(value, dict):
        problems.append(f"{path}: {key} is a {type(value).__name__}, not a table: not read")
        return {}
    return value


def _value(table: Dict[str, Any], key: str, kind: type, path: str, problems: List[str]) -> Any:
    """`table[key]` when it is a `kind`; None when absent, and a problem when it is of another type."""
    value = table.get(key)
    if value is None:
        return None
    if kind is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if kind is not tuple and isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    problems.append(f"{path}: {key} = {value!r} is not a {'list of strings' if kind is tuple else kind.__name__}: not read")
    return None


def _major(version: Optional[str]) -> Optional[int]:
    try:
        return int(version.split(".")[0]) if version else None
    except ValueError:
        return None


def _containerd(data: dict, path: str, version: Optional[str], problems: List[str]) -> Runtime:
    plugins = _table(data, "plugins", path, problems)
    # containerd 2.x's own formats, 3 and (2.4 on) 4, keep the CRI runtime's settings in one place;
    # 2.x reads version 2 too. (Read as 2, a version-4 file's enable_cdi = false would go unseen.)
    given = data.get("version")
    three = isinstance(given, int) and not isinstance(given, bool) and given >= 3
    cri = _table(plugins, "io.containerd.cri.v1.runtime" if three else "io.containerd.grpc.v1.cri", path, problems)
    said = cdi = _value(cri, "enable_cdi", bool, path, problems)
    if cdi is None:  # off in 1.x unless said, on in 2.x unless said
        major = 2 if three else _major(version)
        cdi = None if major is None else major >= 2
    ctrd = _table(cri, "containerd", path, problems)
    name = _value(ctrd, "default_runtime_name", str, path, problems) or "runc"
    options = _table(_table(_table(ctrd, "runtimes", path, problems), name, path, problems), "options", path, problems)
    binary = _value(options, "BinaryName", str, path, problems)
    return Runtime("containerd", path, cdi, _value(cri, "cdi_spec_dirs", tuple, path, problems) or DEFAULT_SPEC_DIRS,
                   _value(cri, "device_ownership_from_security_context", bool, path, problems) is True,
                   _oci(binary or name), version, said, tuple(problems))


def _crio(runtime: dict, source: str, problems: List[str]) -> Runtime:
    name = _value(runtime, "default_runtime", str, source, problems)
    table = _table(_table(runtime, "runtimes", source, problems), name, source, problems) if name else {}
    binary = _value(table, "runtime_path", str, source, problems)
    return Runtime("CRI-O", source, True, _value(runtime, "cdi_spec_dirs", tuple, source, problems) or DEFAULT_SPEC_DIRS,
                   _value(runtime, "device_ownership_from_security_context", bool, source, problems) is True,
                   _oci(binary or name), None, True, tuple(problems))


def _oci(name: Optional[str]) -> Optional[str]:
    """The OCI runtime a name or a binary's path stands for: "crun", "runc", or the name itself."""
    if not isinstance(name, str):
        return None
    base = os.path.basename(name)
    return "crun" if "crun" in base else "runc" if "runc" in base else base
