"""Which kubelet serves kubelet.sock: its version, read from the program the listening process runs.

An upgrade goes beside its predecessor only where kubelet keys a resource's endpoints by
socket (kubelet 1.37, kubernetes PR #135437); an older kubelet tears an endpoint down by
resource name, and a successor registered beside its predecessor there is torn down with it.
Nothing on the wire says which kubelet answers, so the version is read from the kubelet
process itself, found without a race:

1. the process behind kubelet.sock: the peer credentials of a connection to it name the
   process that listens on the very socket we register on (SO_PEERCRED);
2. its program: `/proc/PID/exe` where our user namespace may read it (the inode it runs);
   under the unit's `PrivateUsers=` it may not, and the path it was started from is used
   only when that file was last changed before the process started (else the program at
   the path may be a newer kubelet, installed but not yet running: unknown);
3. the version in the program's Go build information (section `.go.buildinfo`): the
   `k8s.io/kubernetes` module it was built from (a build from modules, k3s's fork), or the
   `gitVersion` its build stamped (a build from kubernetes' own tree).

Any step that cannot be taken gives no version and the reason, never a guess.
"""

import os
import re
import socket
import struct
import time
from typing import Optional, Tuple

from atedevd.record import Record

PER_SOCKET_SINCE = (1, 37)  # kubernetes PR #135437: endpoints keyed by resource name and socket
READ_LIMIT = 1 << 20  # of the build information: its modules' list is some 30 KiB in a kubelet
_MAGIC = b"\xff Go buildinf:"
_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)\S*")
_STAMPED = re.compile(r"k8s\.io/component-base/version\.gitVersion=(v\d+\.\d+\.\d+\S*?)['\" ]")


class KubeletFound(Record):
    """What was learned of the kubelet behind kubelet.sock."""

    version: Optional[str]  # "v1.37.2"; None: not learned
    how: str  # where it came from, or why it could not be learned (for the journal and `check`)

    @property
    def minor(self) -> Optional[Tuple[int, int]]:
        m = _VERSION.fullmatch(self.version or "")
        return (int(m.group(1)), int(m.group(2))) if m else None

    @property
    def per_socket(self) -> bool:
        """It keys endpoints by socket: a successor may register beside its predecessor."""
        minor = self.minor
        return minor is not None and minor >= PER_SOCKET_SINCE


def upgrade_beside(setting: str, kubelet: KubeletFound) -> Tuple[bool, str]:
    """Whether an upgrade's successor registers beside its predecessor, and what decided:
    `kubelet_endpoints` (the configuration's word), or under "auto" the kubelet's version
    (unknown: not beside, the way that is safe on every kubelet)."""
    if setting != "auto":
        return setting == "per-socket", f"kubelet_endpoints = {setting!r}"
    if kubelet.version is None:
        return False, f"kubelet's version unknown: {kubelet.how}"
    return kubelet.per_socket, f"kubelet {kubelet.version}, {kubelet.how}"


def kubelet_behind(socket_path: str, proc: str = "/proc") -> KubeletFound:
    """The kubelet listening on `socket_path`, and its version if its program says it."""
    pid = listener_pid(socket_path)
    if pid is None:
        return KubeletFound(None, f"nobody accepts connections on {socket_path}")
    if pid == 0:
        return KubeletFound(None, "the process behind kubelet.sock is in another PID namespace")
    program, how = program_of(pid, proc)
    if program is None:
        return KubeletFound(None, how)
    try:
        version = kubernetes_version(program)
    except OSError as e:
        return KubeletFound(None, f"cannot read {how}: {e.strerror or e}")
    if version is None:
        return KubeletFound(None, f"{how} names no Kubernetes version in its build information")
    return KubeletFound(version, how)


def listener_pid(socket_path: str) -> Optional[int]:
    """The PID that listens on `socket_path` (0: in another PID namespace); None when nobody accepts."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(1.0)
        s.connect(socket_path)
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid
    except OSError:
        return None
    finally:
        s.close()


def program_of(pid: int, proc: str = "/proc") -> Tuple[Optional[str], str]:
    """A path that opens exactly the program `pid` runs, and how it was found (or why not)."""
    exe = os.path.join(proc, str(pid), "exe")
    try:
        with open(exe, "rb"):
            return exe, f"the program of PID {pid}"
    except OSError:
        pass  # (another user namespace's process: its link is not ours to follow)
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            argv0 = f.read(4096).split(b"\0", 1)[0].decode("utf-8", "replace")
        started = _started_at(pid, proc)
    except (OSError, ValueError) as e:
        return None, f"cannot read PID {pid}'s command line: {getattr(e, 'strerror', None) or e}"
    if not os.path.isabs(argv0):
        return None, f"PID {pid} was started as {argv0!r}, not by a full path"
    try:
        changed = os.stat(argv0).st_ctime
    except OSError as e:
        return None, f"{argv0} (PID {pid}'s program): {e.strerror or e}"
    if changed >= started:
        return None, f"{argv0} changed after PID {pid} started: the program there may not be the one it runs"
    return argv0, f"{argv0} (PID {pid}'s program, unchanged since it started)"


def _started_at(pid: int, proc: str) -> float:
    """When `pid` started, on the wall clock: its stat's start time after boot, plus the boot's
    time from the clocks (the unit's ProcSubset=pid hides /proc/stat and its btime)."""
    with open(os.path.join(proc, str(pid), "stat"), "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # (the name in parentheses may hold anything)
    ticks = int(fields[19])  # field 22, starttime, counted from the state (field 3)
    return boot_time() + ticks / os.sysconf("SC_CLK_TCK")


def boot_time() -> float:
    """The wall clock's time at boot, as /proc/stat's btime is made."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def kubernetes_version(path: str) -> Optional[str]:
    """The Kubernetes version a Go program was built as, from its build information; None if it
    names none. Raises OSError when the file cannot be read as an ELF program."""
    info = build_info(path)
    if info is None:
        return None
    for line in info.splitlines():
        parts = line.split("\t")
        # (a module replaced, as k3s replaces it with its fork, keeps its own version on its line)
        if parts[0] in ("mod", "dep") and len(parts) >= 3 and parts[1] == "k8s.io/kubernetes" and _VERSION.fullmatch(parts[2]):
            return parts[2]
    stamped = _STAMPED.search(info + " ")
    return stamped.group(1) if stamped else None


def build_info(path: str) -> Optional[str]:
    """The module and build lines of a Go program's `.go.buildinfo` section (Go 1.18 and later);
    None when it has none. Raises OSError for a file that is not a 64-bit little-endian ELF."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":
            raise OSError(0, "not a 64-bit little-endian ELF program")
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        if not shoff or shentsize < 64 or shstrndx >= shnum:
            return None
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(len(table) // shentsize)]
        if shstrndx >= len(sections):
            return None
        _, _, _, _, names_at, names_size = sections[shstrndx]
        f.seek(names_at)
        names = f.read(min(names_size, READ_LIMIT))
        for name, _, _, _, offset, size in sections:
            if names[name:names.find(b"\0", name)] == b".go.buildinfo":
                f.seek(offset)
                return _modinfo(f.read(min(size, READ_LIMIT)))
    return None


def _modinfo(data: bytes) -> Optional[str]:
    """The module lines of a build information blob whose strings are inline (flag 2: Go 1.18+)."""
    if not data.startswith(_MAGIC) or len(data) < 32 or not data[15] & 2:
        return None
    at = 32
    for _ in range(2):  # the Go version, then the module information
        length, at = _uvarint(data, at)
        text, at = data[at:at + length], at + length
    if len(text) < 33:
        return None
    return text[16:-16].decode("utf-8", "replace")  # (between its two 16-byte sentinels)


def _uvarint(data: bytes, at: int) -> Tuple[int, int]:
    value = shift = 0
    while at < len(data):
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return 0, at
