"""Our socket files in kubelet's plugin directory: names, leftovers, connections.

Every registration gets a socket file of its own, `ate.dev_kvm.<run>-<n>.sock`
(`<run>` is random per daemon start, `<n>` counts registrations), so no kubelet
version can mistake the teardown of an old connection for the new one. The
resource's part of the name is the resource with its "/" written "_": a
resource's domain cannot contain "_", so the first "_" is where the domain
ends and no two resources share a name (`a.dev/b-c` is `a.dev_b-c`,
`a.dev-b/c` is `a.dev-b_c`; the "-" that earlier versions used made both
`a.dev-b-c`). The
next socket is bound in advance in a subdirectory, which kubelet's wipe of the
directory leaves alone (it removes files, never directories), and renamed into
place when it is needed: a rename costs microseconds, building a gRPC server
about 12 ms, and kubelet admits pods ~13 ms after it serves again.
"""

import os
import re
import select
import socket
import stat
from typing import Callable, Dict, Iterable, List, Optional, Sequence

STANDBY_DIR = ".atedevd"
# sun_path is 108 bytes with the terminating NUL.
MAX_SOCKET_PATH = 107
_RUN_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_RUN_LENGTH = 6
# Registrations one daemon may make before its names outgrow what was checked: one
# a second for eleven days. `check_names` keeps room for this many digits of <n>.
_N_DIGITS = 6
# The resource's part of a socket name, at most: with the run, a count of _N_DIGITS
# and ".sock", the path fits a unix socket in kubelet directories of up to 56 bytes
# (microk8s: /var/snap/microk8s/common/var/lib/kubelet/device-plugins).
MAX_PREFIX = 31
_HASH_CHARS = 12


def new_run_id() -> str:
    """Random per daemon start: names never repeat across restarts."""
    # 256 is a multiple of 32: uniform. (`secrets` would load OpenSSL for six letters.)
    return "".join(_RUN_ALPHABET[b % len(_RUN_ALPHABET)] for b in os.urandom(_RUN_LENGTH))


def prefix(resource: str) -> str:
    """`ate.dev/kvm` -> `ate.dev_kvm`: one name per resource, never shared.

    A resource is `<domain>/<name>` where the domain is a DNS subdomain (no
    "_") and the name may hold "_": the first "_" is the "/", so the mapping
    is injective and reads back. A resource longer than MAX_PREFIX bytes
    (kubelet accepts 300) keeps its beginning and ends in "~" and a hash of
    the whole name: "~" is in no resource name, so it meets no short one, and
    `check_names` refuses a configuration where two long ones would meet.
    """
    name = resource.replace("/", "_", 1)
    if len(name) <= MAX_PREFIX:
        return name
    digest = f"{_fnv1a64(resource.encode()):016x}"[:_HASH_CHARS]
    return f"{name[:MAX_PREFIX - _HASH_CHARS - 1]}~{digest}"


def _fnv1a64(data: bytes) -> int:
    """FNV-1a, 64 bits: a stable hash without hashlib, which loads OpenSSL."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _old_prefix(resource: str) -> str:
    """The name part earlier versions used (`ate.dev-kvm`), which two resources
    could share; only looked for, to remove what those versions left behind."""
    return resource.replace("/", "-")


def socket_name(resource: str, run_id: str, n: int) -> str:
    """The file name of registration `n` of `resource` in daemon run `run_id`."""
    return f"{prefix(resource)}.{run_id}-{n}.sock"


def check_names(plugin_dir: str, resources: Sequence[str]) -> List[str]:
    """Problems with these resources' socket files in `plugin_dir`, one line each:
    two resources with one file name, or a path too long for a unix socket
    (with room for a registration count of `_N_DIGITS` digits; the standby
    directory's longer path is not needed, see registration). Empty when every
    name is its own and fits."""
    problems: List[str] = []
    owner: Dict[str, str] = {}
    longest = "z" * _RUN_LENGTH, 10 ** _N_DIGITS - 1
    for resource in resources:
        name = socket_name(resource, *longest)
        if name in owner:
            problems.append(f"resources {owner[name]!r} and {resource!r} would share the socket file name {name!r}")
            continue
        owner[name] = resource
        path = os.path.join(plugin_dir, name)
        size = len(os.fsencode(path))
        if size > MAX_SOCKET_PATH:
            problems.append(f"resource {resource!r}: its socket path {path!r} is {size} bytes, more than the "
                            f"{MAX_SOCKET_PATH} a unix socket allows; device_plugin_dir is too long")
    return problems


def _leftover_pattern(resources: Iterable[str]) -> "re.Pattern[str]":
    resources = list(resources)
    names = "|".join(re.escape(prefix(r)) for r in resources)
    old = "|".join(re.escape(_old_prefix(r)) for r in resources)
    # Ours from any earlier run, and the names of earlier versions: one per
    # registration (`ate.dev-kvm.<run>-<n>.sock`) and the single fixed `ate.dev-kvm.sock`.
    run = r"\.[a-z0-9]{1,16}-[0-9]+"
    return re.compile(rf"^(?:(?:{names}){run}|(?:{old})(?:{run})?)\.sock$")


def remove_leftovers(plugin_dir: str, resources: Iterable[str], keep_run: str = "") -> List[str]:
    """Unlink sockets that earlier runs left behind: our names, nobody listening.

    A path someone still accepts connections on is never touched, whatever
    its name; the names of run `keep_run` (this one's) are not even probed.
    Returns the paths removed.
    """
    resources = list(resources)
    removed: List[str] = []
    if not resources:
        return removed
    pattern = _leftover_pattern(resources)
    own = f".{keep_run}-" if keep_run else None
    for directory in (plugin_dir, os.path.join(plugin_dir, STANDBY_DIR)):
        removed += remove_dead_sockets(directory, lambda name: bool(pattern.match(name)) and not (own and own in name))
    return removed


def remove_dead_sockets(directory: str, ours: Callable[[str], bool]) -> List[str]:
    """Unlink each socket in `directory` whose name is `ours` and that nobody listens on (a run
    that was killed left it); a path someone still accepts connections on is never touched.
    Returns the paths removed."""
    removed: List[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        if ours(name) and is_dead_socket(path):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def remove_standby_dir(plugin_dir: str) -> bool:
    """Remove our standby directory when nothing is left in it (at stop, after
    the sockets are gone), so nothing of ours stays in kubelet's directory.
    True when it is gone; a directory someone put something else in is kept."""
    try:
        os.rmdir(os.path.join(plugin_dir, STANDBY_DIR))
    except FileNotFoundError:
        return True
    except OSError:  # ENOTEMPTY: not only ours; EBUSY, EROFS: not ours to change
        return False
    return True


def is_dead_socket(path: str) -> bool:
    """A socket file of ours that nobody listens on (refused; any other error: leave it)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    return isinstance(connect_error(path), ConnectionRefusedError)


def listening(path: str) -> bool:
    """Whether anyone accepts connections on the unix socket at `path` now (a connect
    that is refused costs microseconds; a gRPC call that fails, about a millisecond)."""
    return connect_error(path) is None


def connect_error(path: str, timeout: Optional[float] = None) -> Optional[OSError]:
    """Why a connect to the unix socket at `path` fails, or None when someone listens.
    Without `timeout` it does not block, and a full backlog counts as listening; with
    one, the connection must be accepted within it (else socket.timeout)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if timeout is None:
        s.setblocking(False)
    else:
        s.settimeout(timeout)
    try:
        s.connect(path)
    except (BlockingIOError, InterruptedError) as e:
        return None if timeout is None else e
    except OSError as e:
        return e
    finally:
        s.close()
    return None


def held_connections(bind_paths: Iterable[str], keep: Optional[List[int]] = None) -> Optional[int]:
    """How many connections accepted on sockets bound at these paths are still open
    (what kubelet holds of them): None when our descriptors cannot be read.

    Read from our own descriptors, not /proc/net/unix: an accepted AF_UNIX connection
    is listed in the *connecting* process's network namespace, so under the unit's
    PrivateNetwork= kubelet's connections never show there. The accepted socket is in
    our descriptor table whatever the namespace, and its own address is the path its
    listener was bound at, even after the file was renamed or deleted. A connection
    whose peer has hung up counts as let go, whether or not gRPC has closed it yet.
    `keep`: a duplicate of each held connection's descriptor is appended there, for the
    caller to poll for the peer's hang-up (POLLRDHUP) and to close.
    """
    wanted = {os.fsencode(p) for p in bind_paths}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    count = 0
    poller = select.poll()
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue  # closed meanwhile
        s = socket.socket(fileno=dup)
        try:
            if s.family != socket.AF_UNIX or os.fsencode(s.getsockname()) not in wanted:
                continue
            s.getpeername()  # a listener is not connected: OSError
            poller.register(dup, select.POLLRDHUP)
            hung_up = poller.poll(0)
            poller.unregister(dup)
            if not hung_up:
                count += 1
                if keep is not None:
                    keep.append(os.dup(dup))
        except OSError:
            pass
        finally:
            s.close()
    return count
