"""Kubelet's plugin directory as the unit's sandbox shows it.

Under systemd, `ReadWritePaths=` binds /var/lib/kubelet/device-plugins writable into
the daemon's mount namespace, the rest of /var staying read-only. If kubelet's directory
is deleted and made anew while we run, the new one is not that bind: it is read-only in
our view, no socket can be bound there again, and only a restart (a fresh namespace)
serves it. `PluginDirBind` tells that case apart from a directory that is read-only for
any other reason.
"""

import os
import re


class PluginDirBind:
    def __init__(self, path: str) -> None:
        self.path = path
        self.was_mount = False  # when a resource began to be served, the directory was a mount of its own

    def served(self) -> None:
        """A resource began to be served there: note whether it is our sandbox's bind."""
        self.was_mount = is_mount_point(self.path)

    def replaced(self) -> bool:
        """Our sandbox's writable bind is gone (kubelet's directory was deleted and made anew)
        and what is there now is read-only to us."""
        return self.was_mount and not is_mount_point(self.path) and not os.access(self.path, os.W_OK)


def is_mount_point(path: str) -> bool:
    """From /proc/self/mountinfo: a bind mount on the same filesystem is invisible to os.path.ismount."""
    target = os.fsencode(os.path.abspath(path))
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            mount_points = [line.split(b" ")[4] for line in f]
    except (OSError, IndexError):
        return False
    unescape = lambda m: bytes([int(m.group(1), 8)])  # noqa: E731 - "\040" is a space
    return any(re.sub(rb"\\([0-7]{3})", unescape, mp) == target for mp in mount_points)
