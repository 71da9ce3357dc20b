"""Keep a device's host nodes at a configured mode (`host_mode`): the one way a pod in a user
namespace opens a node.

A runtime in a user namespace cannot make a device node: runc bind-mounts the host's node
at the container path, and the kernel judges the host node's own mode for a uid that is
nobody on the host. So such a pod opens the node only where the host node lets others
read and write it. An operator who decides for that sets `host_mode = 0o666` on the
device; atedevd then applies it at start and again whenever udev (or anyone) changes the
mode, with no udev rule of their own. It never widens a node the device policy refuses
(atedevd/devices/policy.py), opted in or not, nor one its table did not judge present for the
device: only a node with the numbers its table judged is changed, through the descriptor
then checked (opened O_PATH, which opens no device), so a link retargeted or a node made
anew in between changes nothing that was not judged.
"""

import logging
import os
import stat
from typing import Callable, Iterable, Tuple

from atedevd.config import Device
from atedevd.devices import policy


class HostMode:
    def __init__(self, device: Device, sys_root: str, say: Callable[..., None]) -> None:
        self.device, self.sys_root, self.say = device, sys_root, say

    def keep(self, judged: Iterable[Tuple[str, Tuple[int, int]]]) -> None:
        """Every node the table judged present and allowed (host path, numbers) at its host
        mode: an fstat each when they are. Only the node with the numbers judged is changed,
        whatever the path names by now."""
        mode = self.device.host_mode
        if mode is None:
            return
        for path, numbers in judged:
            self._keep(path, numbers, mode)

    def _keep(self, path: str, numbers: Tuple[int, int], mode: int) -> None:
        res = self.device.resource
        try:
            if stat.S_IMODE(os.stat(path).st_mode) == mode:
                return  # (the usual case: a stat, nothing opened)
        except OSError:
            return
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)  # opens no device
        except OSError:
            return  # gone: judged again at the next look
        try:
            st = os.fstat(fd)
            if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(*numbers):
                return  # not the node judged (udev made another since): the next look judges it
            before = stat.S_IMODE(st.st_mode)
            if before == mode:
                return
            here = f"/proc/self/fd/{fd}"
            node = policy.look(here, self.sys_root, st)
            found = policy.judge(node) if node is not None else None
            if found is not None:  # (judged allowed: a rule that matched since, say by sysfs, still wins)
                self.say(logging.ERROR, "host-mode-refused", f"{res}: host_mode: not applied to {path}: {found}",
                         once=f"host-mode-refused:{path}:{node.numbers if node else None}", resource=res, device=path)
                return
            os.chmod(here, mode)  # the inode judged, whatever the path names now
        except OSError as e:
            self.say(logging.ERROR, "host-mode", f"{res}: cannot keep {path} at {mode:04o}: {e.strerror or e}",
                     once=f"host-mode:{path}:{e.errno}", resource=res, device=path)
            return
        finally:
            os.close(fd)
        self.say(logging.INFO, "host-mode", f"{res}: {path} was {before:04o}; keeping it at {mode:04o} (host_mode)",
                 resource=res, device=path)
