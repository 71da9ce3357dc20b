"""Our socket files in kubelet's plugin directory: names, leftovers, connections.

Every registration gets a socket file of its own, `ate.dev-kvm.<run>-<n>.sock`
(`<run>` is random per daemon start, `<n>` counts registrations), so no kubelet
version can mistake the teardown of an old connection for the new one. The
next socket is bound in advance in a subdirectory, which kubelet's wipe of the
directory leaves alone (it removes files, never directories), and renamed into
place when it is needed: a rename costs microseconds, building a gRPC server
about 12 ms, and kubelet admits pods ~13 ms after it serves again.
"""

import os
import re
import socket
import stat
from typing import Iterable, List

STANDBY_DIR = ".atedevd"
# sun_path is 108 bytes with the terminating NUL.
MAX_SOCKET_PATH = 107
_RUN_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_RUN_LENGTH = 6
_CONNECTED = "03"  # SS_CONNECTED in /proc/net/unix


def new_run_id() -> str:
    """Random per daemon start: names never repeat across restarts."""
    # 256 is a multiple of 32: uniform. (`secrets` would load OpenSSL for six letters.)
    return "".join(_RUN_ALPHABET[b % len(_RUN_ALPHABET)] for b in os.urandom(_RUN_LENGTH))


def prefix(resource: str) -> str:
    """`ate.dev/kvm` -> `ate.dev-kvm`."""
    return resource.replace("/", "-")


def socket_name(resource: str, run_id: str, n: int) -> str:
    return f"{prefix(resource)}.{run_id}-{n}.sock"


def _leftover_pattern(resources: Iterable[str]) -> "re.Pattern[str]":
    names = "|".join(re.escape(prefix(r)) for r in resources)
    # Ours from any earlier run, and the single fixed name of atedevd 0.1.
    return re.compile(rf"^(?:{names})(?:\.[a-z0-9]{{1,16}}-[0-9]+)?\.sock$")


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
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            if pattern.match(name) and not (own and own in name) and _is_dead_socket(path):
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
    return removed


def _is_dead_socket(path: str) -> bool:
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
    except ConnectionRefusedError:
        return True
    except BlockingIOError:  # a listener with a full backlog: alive
        return False
    except OSError:
        return False
    finally:
        s.close()
    return False


def connections(bind_paths: Iterable[str]) -> int:
    """Open connections accepted on sockets bound at these paths (what kubelet
    still holds to them), from /proc/self/net/unix. -1 when it cannot be read.

    The kernel lists an accepted connection under the path its listener was
    bound at, even after the file was renamed or deleted.
    """
    wanted = set(bind_paths)
    try:
        with open("/proc/self/net/unix") as f:
            lines = f.readlines()[1:]
    except OSError:
        return -1
    count = 0
    for line in lines:
        fields = line.rstrip("\n").split(None, 7)
        if len(fields) == 8 and fields[5] == _CONNECTED and fields[7] in wanted:
            count += 1
    return count
