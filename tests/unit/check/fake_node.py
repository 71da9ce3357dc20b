"""The fake node `atedevd check` is run against, and the two ways to run it: in this process and as one."""

import io
import os
import socket
import subprocess

from atedevd import config
from atedevd.check import report as check
from atedevd.config import Config
from rig.harness import REPO


class CheckedNode:
    """A dev root with kvm and a plugin directory, and a kubelet socket made on demand."""

    def __init__(self, root, socks):
        self.root, self.socks = root, socks
        self.dev = os.path.join(root, "dev")
        self.dp = os.path.join(root, "dp")
        self.sock = os.path.join(self.dp, "kubelet.sock")

    def kubelet(self, listen=True, close=False):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.sock)
        if listen:
            s.listen(8)
        if close:
            s.close()  # the socket file stays behind: what a killed kubelet leaves
        else:
            self.socks.append(s)

    def cfg(self, *devices, **kw):
        return Config(device_plugin_dir=self.dp, dev_root=self.dev,
                      devices=devices or config.DEFAULT_DEVICES, **kw)


def run(cfg, unit=None, runtimes=()):
    """check.run with atedevd.service's sandbox properties `unit` (None: no such unit) and the
    container runtimes' settings `runtimes` (none configured, unless given)."""
    out = io.StringIO()
    return check.run(cfg, out, unit=lambda: unit, runtimes=lambda: list(runtimes)), out.getvalue()


def atedevd(*args):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(["/usr/bin/python3", "-m", "atedevd", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def config_file(node, extra=""):
    path = os.path.join(node.root, "config.toml")
    with open(path, "w") as f:
        f.write(f'[daemon]\ndevice_plugin_dir = "{node.dp}"\ndev_root = "{node.dev}"\n'
                '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n' + extra)
    return path
