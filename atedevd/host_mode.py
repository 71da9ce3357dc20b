"""Keep a device's host nodes at a configured mode (`host_mode`): the one way a pod in a user
namespace opens a node.

A runtime in a user namespace cannot make a device node: runc bind-mounts the host's node
at the container path, and the kernel judges the host node's own mode for a uid that is
nobody on the host. So such a pod opens the node only where the host node lets others
read and write it. An operator who decides for that sets `host_mode = 0o666` on the
device; atedevd then applies it at start and again whenever udev (or anyone) changes the
mode, with no udev rule of their own. It never widens a node the device policy refuses
(atedevd/policy.py), opted in or not: the node is judged on the descriptor that is then
changed (opened O_PATH, which opens no device), so a link retargeted in between changes
nothing it did not judge.
"""

import logging
import os
import stat
from typing import Callable, List

from atedevd import policy
from atedevd.config import Device, Pattern, host_path


class HostMode:
    def __init__(self, device: Device, dev_root: str, sys_root: str, say: Callable[..., None]) -> None:
        self.device, self.dev_root, self.sys_root, self.say = device, dev_root, sys_root, say
        self._pattern = Pattern(device.path, dev_root) if device.pattern else None

    def keep(self) -> None:
        """Every node of the device at its host mode (a stat each when they are)."""
        mode = self.device.host_mode
        if mode is None:
            return
        for path in self._paths():
            try:
                st = os.stat(path)
            except OSError:
                continue  # not there: looked at again when it appears
            if stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
                self._apply(path, mode)

    def _paths(self) -> List[str]:
        paths = [host_path(p, self.dev_root) for p in self.device.companions]
        if self._pattern is None:
            return [self.device.host_path(self.dev_root)] + paths
        return [self._pattern.host_path_of(n) for n in self._pattern.names()] + paths

    def _apply(self, path: str, mode: int) -> None:
        res = self.device.resource
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            here = f"/proc/self/fd/{fd}"
            node = policy.look(here, self.sys_root)
            found = policy.judge(node) if node is not None else None
            if node is None or found is not None:
                if found is not None:
                    numbers = node.numbers if node is not None else None
                    self.say(logging.ERROR, "host-mode-refused", f"{res}: host_mode: not applied to {path}: {found}",
                             once=f"host-mode-refused:{path}:{numbers}", resource=res, device=path)
                return
            before = stat.S_IMODE(os.fstat(fd).st_mode)
            os.chmod(here, mode)  # the inode judged, whatever the path names now
        except OSError as e:
            self.say(logging.ERROR, "host-mode", f"{res}: cannot keep {path} at {mode:04o}: {e.strerror or e}",
                     once=f"host-mode:{path}:{e.errno}", resource=res, device=path)
            return
        finally:
            os.close(fd)
        self.say(logging.INFO, "host-mode", f"{res}: {path} was {before:04o}; keeping it at {mode:04o} (host_mode)",
                 resource=res, device=path)
