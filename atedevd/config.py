"""What a configuration is: the `[daemon]` settings and the `[[device]]` tables, as values.

The vocabulary every part of the daemon shares (a `Device`, a `Pattern`, where a node is looked
up), with nothing of how the file is read or checked: that is atedevd/config_file/, which uses
the rules of the devices, the socket names and CDI to judge a file, while those import only this.
"""

import errno
import functools
import os
import re
import stat
from typing import List, Optional, Tuple

from atedevd.record import Record

EX_CONFIG = 78
DEFAULT_CONFIG_PATH = "/etc/atedevd/config.toml"
MAX_FILE_BYTES = 1 << 20  # the largest configuration file read
MIN_COUNT, MAX_COUNT = 1, 65536
MAX_DEVICE_ID = 63  # kubelet's limit on a device ID
LOG_LEVELS = ("debug", "info", "warning", "error")
DAEMON_KEYS = ("device_plugin_dir", "dev_root", "sys_root", "log_level", "metrics_dir", "kubelet_endpoints",
               "cdi", "cdi_spec_dir", "device_specs", "api", "kubeconfig", "node_name")
# [daemon] keys that are true or false (the others are strings, and the command line may give them)
DAEMON_BOOLS = ("cdi", "device_specs")
# How kubelet keys a resource's endpoints, which decides how an upgrade registers its successor:
# by resource name (kubelet <= 1.36: only once kubelet let go of its predecessor) or by socket
# (kubernetes PR #135437, kubelet 1.37: beside it). "auto": as the kubelet behind kubelet.sock
# says of itself (atedevd/kubelet/identity.py), per-resource where it says nothing.
KUBELET_ENDPOINTS = ("auto", "per-resource", "per-socket")
# Which kubelet API serves the devices (docs/dra.md): the device plugin API, or DRA (Dynamic Resource
# Allocation: a kubelet plugin that prepares claims, and ResourceSlices published with the node's
# credentials). Switching is a restart: one node never serves a resource through both.
APIS = ("device-plugin", "dra")
DEVICE_KEYS = ("resource", "path", "count", "permissions", "allow_host_access", "companions",
               "container_mode", "container_uid", "container_gid", "host_mode")
MAX_ID = 4294967294  # a uid or gid (4294967295 is "none" to the kernel)
MAX_COMPANIONS = 8
_GLOB = "*?["  # a path with one of these is a pattern: one exclusive unit per matching node


def is_pattern(path: str) -> bool:
    """`/dev/ttyUSB*`, `/dev/vfio/[0-9]*`: a path that stands for every node it matches."""
    return any(c in path for c in _GLOB)


class Pattern:
    """The matches of one pattern path, looked up under a dev root."""

    def __init__(self, path: str, dev_root: str) -> None:
        self.path = path  # as configured, under /dev
        directory, self.glob = os.path.split(path)
        self.directory = directory  # as pods see it
        self.host_directory = os.path.normpath(host_path(directory, dev_root))
        import fnmatch  # only where a pattern is configured: a start without pays nothing (0.2 ms)

        self._match = re.compile(fnmatch.translate(self.glob)).match
        self._dots = self.glob.startswith(".")

    def names(self) -> List[str]:
        """Every entry of the directory the pattern matches, sorted; [] when the directory is not there."""
        try:
            entries = os.listdir(self.host_directory)
        except OSError:
            return []
        match, dots = self._match, self._dots
        return sorted(n for n in entries if (dots or n[0] != ".") and match(n))

    def path_of(self, name: str) -> str:
        """The path pods see for a match: `/dev/vfio/12`."""
        return self.directory + "/" + name

    def host_path_of(self, name: str) -> str:
        return os.path.join(self.host_directory, name)


class Device(Record):
    """One device node advertised as `count` shareable units of `resource`; or, when
    `path` is a pattern, every node it matches, each one unit handed to one container.
    `companions` are nodes every unit brings along (VFIO: /dev/vfio/vfio)."""

    resource: str
    path: str
    count: int = 1024  # type: ignore[assignment]  # the configuration's key; it hides tuple.count, never called; docs/design.md, "How many units"
    permissions: str = "rw"
    # Grant it even if the device policy (policy.py) refuses the node: an
    # operator who means it, warned at every start and by `atedevd check`.
    allow_host_access: bool = False
    companions: Tuple[str, ...] = ()
    # The node's mode and owner in the container, where it is granted through CDI (atedevd/cdi/names.py):
    # by default any user in the container opens it (the device cgroup already limits the node to
    # the containers granted it); no owner: the runtime makes it the container's user's.
    container_mode: int = 0o666
    container_uid: Optional[int] = None
    container_gid: Optional[int] = None
    # Keep the host node at this mode (atedevd/devices/host_mode.py): an operator's opt-in for pods in
    # user namespaces, which open the host's node itself. None: the node's mode is udev's.
    host_mode: Optional[int] = None

    @property
    def pattern(self) -> bool:
        return is_pattern(self.path)

    def host_path(self, dev_root: str = "/dev") -> str:
        """Where this node is looked up: `/dev/net/tun` -> `<dev_root>/net/tun`."""
        return host_path(self.path, dev_root)

    def unit_id(self, n: int) -> str:
        """Device ID of unit `n`: `<basename>-<n>`, e.g. `kvm-0`."""
        return f"{os.path.basename(self.path)}-{n}"


@functools.lru_cache(maxsize=256)  # the loop looks at every node on every wake-up
def host_path(path: str, dev_root: str = "/dev") -> str:
    """Where a node pods see as `path` is looked up on this host.

    `path` is what kubelet and the container see; `dev_root` lets the daemon
    (and tests) look at another tree without changing what pods get.
    """
    return os.path.join(dev_root, os.path.relpath(path, "/dev"))


DEFAULT_DEVICES = (Device("ate.dev/kvm", "/dev/kvm"),)
# The most devices one daemon serves: each may hold three ListAndWatch threads
# of the worker pool (plugin.Workers: 12 + 3 per device, started up front).
MAX_DEVICES = 32


class Config(Record):
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    dev_root: str = "/dev"
    sys_root: str = "/sys"  # where the kernel's account of a node is read (the policy, NUMA nodes)
    log_level: str = "info"
    metrics_dir: Optional[str] = None  # node_exporter's textfile directory; None: the default, "": off
    kubelet_endpoints: str = "auto"  # KUBELET_ENDPOINTS
    # Grant through CDI (atedevd/cdi/names.py): a spec per resource in cdi_spec_dir, its names in every
    # Allocate answer; device_specs: the answer carries the DeviceSpec too (runtimes without CDI).
    cdi: bool = False
    cdi_spec_dir: str = "/var/run/cdi"  # the runtimes' dynamic spec directory
    device_specs: bool = True
    devices: Tuple[Device, ...] = DEFAULT_DEVICES
    api: str = "device-plugin"  # APIS
    kubeconfig: Optional[str] = None  # DRA mode: the credentials; None: kubelet's own (atedevd/dra/cluster.py)
    node_name: Optional[str] = None  # DRA mode: None: the name the credentials say they are (system:node:<name>)
    source: Optional[str] = None  # the file read; None for the built-in defaults


def read_regular(path: str, limit: int) -> Tuple[os.stat_result, bytes, bool]:
    """A regular file's first `limit` + 1 bytes, opened without blocking (a FIFO at the path must
    not hang the daemon or `check`; a device is never opened), as (its fstat, the bytes, whether
    it stayed the one at the path and unchanged throughout). Raises OSError, whose strerror says
    what is wrong ("not a regular file (FIFO)"), and ValueError for a path with a NUL."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # (a device, a FIFO: not even opened)
        raise OSError(errno.EINVAL, f"not a regular file ({file_type(os.stat(path).st_mode)})")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file ({file_type(st.st_mode)})")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(limit + 1)
        after = os.fstat(fd)
        there = os.stat(path)
    finally:
        os.close(fd)
    same = lambda a, b: (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == \
        (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns)  # noqa: E731
    return st, raw, same(st, after) and same(st, there) and (len(raw) == st.st_size or len(raw) > limit)


def file_type(mode: int) -> str:
    """What a file is, in words (shared with `atedevd check`)."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "unknown file type"
