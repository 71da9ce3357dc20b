"""What a user without root can do to atedevd, tried as that user: the daemon as a process,
the attacker's steps run as `nobody` (uid 65534), nodes made with mknod under a dev root.

- a link on the way to the configuration, in a directory the user owns, chooses which
  root-owned file is the configuration (and `..` in --config is the disk's, not the string's);
- input-injection nodes (uhid, userio) and the iommufd form of a VFIO device without an
  IOMMU reach pods through a pattern;
- a FIFO at the metrics file's temporary name blocks the control loop;
- the successor of an upgrade imports what the working directory holds.
"""

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from tests.harness import REPO, wait_until
from tests.test_exclusive import SERIAL, SERIAL_TOML, health, reload, serial_nodes, write
from tests.test_patterns import mknod
from tests.test_policy import fake_sysfs
from tests.test_upgrade import hup, upgrade

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod, chown and setuid need root (CI runs as root)")

NOBODY = 65534
MEM_TOML = '[[device]]\nresource = "ate.dev/mem"\npath = "/dev/mem"\nallow_host_access = true\n'


@pytest.fixture
def place():
    """A directory every user can reach (pytest's tmp_path is root's alone), root's, 0755."""
    root = tempfile.mkdtemp(prefix="atedevd-hostile-", dir="/tmp")
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def as_nobody(code: str) -> None:
    """The attacker's step: Python run as nobody, not root."""
    subprocess.run([sys.executable, "-c", code], user=NOBODY, group=NOBODY, check=True, cwd="/")


def nobodys_dir(path: str) -> str:
    os.makedirs(path, mode=0o755)
    os.chown(path, NOBODY, NOBODY)
    return path


# --- the device policy: input injection, VFIO without an IOMMU ------------------------------


def test_input_injection_nodes_and_a_vfio_device_without_an_iommu_are_never_units(start_daemon, kubelet, dev_root,
                                                                                   tmp_path, place):
    mknod(dev_root, "uinput", 10, 223)
    mknod(dev_root, "uhid", 10, 239)
    mknod(dev_root, "userio", 10, 240)
    mknod(dev_root, "ttyS0", 4, 64)
    mknod(dev_root, "vfio/devices/noiommu-vfio0", 511, 0)
    mknod(dev_root, "vfio/devices/vfio1", 511, 1)
    sys_root = str(tmp_path / "sys")
    fake_sysfs(sys_root, "char", 511, 0, "vfio-dev", "vfio/devices/noiommu-vfio0")
    fake_sysfs(sys_root, "char", 511, 1, "vfio-dev", "vfio/devices/vfio1")
    cfg = write(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/all"\npath = "/dev/*"\n'
                                     '[[device]]\nresource = "ate.dev/vfio"\npath = "/dev/vfio/devices/*"\n')
    d = start_daemon(config=cfg, extra_args=["--sys-root", sys_root])
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/all") and kubelet.wait_connected("ate.dev/vfio"), d.log()
    assert kubelet.wait(lambda: health(kubelet, "ate.dev/vfio") == {"vfio-devices-vfio1": "Healthy"}, 5), d.log()
    units = set(health(kubelet, "ate.dev/all"))
    assert "ttyS0" in units and not units & {"uinput", "uhid", "userio"}, units
    log = d.log()
    for name, what in (("uinput", "user-level input"), ("uhid", "user-level HID"), ("userio", "a user-level serio port")):
        assert f"ERROR ate.dev/all: /dev/{name}: refused: " in log and f"is {what} (/dev/{name})" in log, log
    assert "ERROR ate.dev/vfio: /dev/vfio/devices/noiommu-vfio0: refused: " in log
    assert "is a VFIO device without an IOMMU" in log
    for path in ("/dev/uhid", "/dev/userio"):  # as a device's path: a configuration error, exit 78
        d = start_daemon(config=write(tmp_path / "one.toml", f'[[device]]\nresource = "ate.dev/x"\npath = "{path}"\n'))
        assert d.wait(10) == 78 and f'"{path}" (ate.dev/x): refused: ' in d.log(), d.log()
