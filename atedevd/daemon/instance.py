"""One atedevd per plugin directory: grpc unlinks a socket path before binding,
so a second instance would silently steal the first one's sockets.

The lock lives in systemd's RuntimeDirectory (or /run/atedevd), never in the
plugin directory, which kubelet wipes on restart.
"""

import fcntl
import os
import re


class AlreadyRunning(Exception):
    pass


def lock_path(plugin_dir: str) -> str:
    runtime = os.environ.get("RUNTIME_DIRECTORY", "/run/atedevd").split(":")[0]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.normpath(os.path.abspath(plugin_dir)).strip("/"))
    return os.path.join(runtime, (name or "root") + ".lock")


def acquire(plugin_dir: str) -> int:
    """Take the lock for `plugin_dir` for the life of the process; returns its fd."""
    path = lock_path(plugin_dir)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyRunning(
            f"another atedevd (pid {holder}) is already serving {plugin_dir} (lock {path})"
        ) from None
    adopt(fd)
    return fd


def adopt(fd: int) -> None:
    """The lock is this process's (taken, or inherited from the daemon it took over from):
    it names our pid."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
