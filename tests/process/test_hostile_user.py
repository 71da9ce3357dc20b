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

from rig.harness import REPO, wait_until, write_file
from rig.nodes import fake_sysfs, mknod
from tests.process.test_exclusive import SERIAL, SERIAL_TOML, health, reload, serial_nodes
from tests.process.test_upgrade import hup, upgrade

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="mknod, chown and setuid need root (CI runs as root)")]

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


# --- the configuration: every directory and link the kernel walks ----------------------------


def test_a_link_on_the_way_to_the_configuration_is_as_trusted_as_its_directory(start_daemon, kubelet, dev_root, place):
    """/etc/atedevd/config.toml -> a link in a directory a user owns -> a root-owned file: the
    user chooses which root-owned file is the configuration. Refused at reload, as at start."""
    mknod(dev_root, "mem", 1, 1)
    etc = os.path.join(place, "etc")
    os.makedirs(etc, mode=0o755)
    benign = write_file(os.path.join(etc, "benign.toml"), '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    example = write_file(os.path.join(etc, "mem-example.toml"), MEM_TOML)  # root's, as an example file would be
    cfg = write_file(os.path.join(etc, "config.toml"), open(benign).read())
    home = nobodys_dir(os.path.join(place, "home"))
    d = start_daemon(config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()

    as_nobody(f"import os; os.symlink({benign!r}, {home + '/link.toml'!r})")
    os.unlink(cfg)
    os.symlink(os.path.join(home, "link.toml"), cfg)  # root's link, into the user's directory
    reload(d)
    refused = f"{home} is owned by nobody (owner nobody:nogroup, mode 0755), not root: chown root {home}"
    assert wait_until(lambda: "reload failed" in (d.status() or ""), 5), (d.status(), d.log())
    assert refused in d.log(), d.log()

    as_nobody(f"import os; os.unlink({home + '/link.toml'!r}); os.symlink({example!r}, {home + '/link.toml'!r})")
    reload(d)
    assert wait_until(lambda: d.log().count(refused) >= 2, 5), d.log()
    assert kubelet.registration_count("ate.dev/mem") == 0 and d.proc.poll() is None
    assert kubelet.capacity("ate.dev/kvm") == 1024  # the running configuration serves on


def test_dot_dot_in_the_configurations_path_is_taken_on_the_disk(start_daemon, kubelet, dev_root, place):
    """etc/sub is root's link into a user's directory; `etc/sub/../config.toml` is, to the
    kernel, the `config.toml` beside wherever the user's link leads, not etc/config.toml."""
    mknod(dev_root, "mem", 1, 1)
    etc = os.path.join(place, "etc")
    os.makedirs(etc, mode=0o755)
    write_file(os.path.join(etc, "config.toml"), '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    examples = os.path.join(place, "examples", "a")
    os.makedirs(examples, mode=0o755)
    write_file(os.path.join(place, "examples", "config.toml"), MEM_TOML)  # root's
    home = nobodys_dir(os.path.join(place, "home"))
    as_nobody(f"import os; os.symlink({examples!r}, {home + '/deep'!r})")
    os.symlink("../home/deep", os.path.join(etc, "sub"))
    d = start_daemon(config=os.path.join(etc, "sub", "..", "config.toml"))
    assert d.wait(10) == 78, d.log()
    assert f"{home} is owned by nobody (owner nobody:nogroup, mode 0755), not root" in d.log(), d.log()
    assert kubelet.registration_count("ate.dev/mem") == 0


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
    cfg = write_file(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/all"\npath = "/dev/*"\n'
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
        d = start_daemon(config=write_file(tmp_path / "one.toml", f'[[device]]\nresource = "ate.dev/x"\npath = "{path}"\n'))
        assert d.wait(10) == 78 and f'"{path}" (ate.dev/x): refused: ' in d.log(), d.log()


# --- the metrics directory: nothing planted there blocks the loop -----------------------------


FIFO_LAUNCHER = """
import os, sys
metrics_dir = {metrics_dir!r}
if os.fork() == 0:  # the attacker, who can see our pid in /proc, plants a FIFO at the temporary name
    os.setgid(65534); os.setuid(65534)
    os.mkfifo(os.path.join(metrics_dir, ".atedevd.prom.%d.tmp" % os.getppid()))
    os._exit(0)
os.wait()
from atedevd.launch import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_fifo_in_a_metrics_directory_others_can_write_blocks_nothing(start_daemon, kubelet, dev_root, tmp_path, place):
    """A metrics directory others can write is refused with one WARNING; nothing planted there
    (a FIFO at the name the writer once used) keeps an unplug from reaching kubelet."""
    metrics_dir = os.path.join(place, "metrics")
    os.makedirs(metrics_dir)
    os.chmod(metrics_dir, 0o1777)  # like /tmp: anyone may create files in it
    serial_nodes(dev_root, 2)
    d = start_daemon(config=write_file(tmp_path / "c.toml", SERIAL_TOML), metrics_dir=metrics_dir,
                     launcher=("-c", FIFO_LAUNCHER.format(metrics_dir=metrics_dir)))
    d.wait_ready()
    assert kubelet.wait_connected(SERIAL), d.log()
    for n in (0, 1):  # the loop answers every change: not blocked in open()
        os.unlink(os.path.join(dev_root, f"ttyUSB{n}"))
        assert kubelet.wait(lambda: health(kubelet, SERIAL).get(f"ttyUSB{n}") == "Unhealthy", 5), d.log()
    reload(d)
    warnings = [line for line in d.log().splitlines() if " WARNING " in line and "cannot write metrics" in line]
    assert len(warnings) == 1 and f"cannot write metrics to {metrics_dir}/atedevd.prom: refused: another user could " \
        f"put a file of theirs where atedevd writes (a FIFO would block its loop): {metrics_dir} is writable by its " \
        f"group and others (owner root:root, mode 1777): chmod go-w {metrics_dir}" in warnings[0], warnings
    assert not os.path.exists(os.path.join(metrics_dir, "atedevd.prom"))


def test_metrics_in_a_directory_only_root_can_write_leave_no_predictable_name(tmp_path, place):
    from atedevd.daemon import textfile

    metrics_dir = os.path.join(place, "m")
    os.makedirs(metrics_dir, mode=0o755)
    fifo = os.path.join(metrics_dir, f".atedevd.prom.{os.getpid()}.tmp")
    os.mkfifo(fifo)  # the name the writer once used: never opened now
    writer = threading.Thread(target=textfile.write_atomically, args=(os.path.join(metrics_dir, "atedevd.prom"), "a 1\n"),
                              daemon=True)
    writer.start()
    writer.join(5)
    if writer.is_alive():  # blocked in open(): let it go (a reader), and fail
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail("the metrics writer opened the FIFO planted at its temporary name and waited for a reader")
    assert open(os.path.join(metrics_dir, "atedevd.prom")).read() == "a 1\n"
    assert sorted(os.listdir(metrics_dir)) == [f".atedevd.prom.{os.getpid()}.tmp", "atedevd.prom"]
    os.symlink(metrics_dir, os.path.join(place, "link"))
    with pytest.raises(OSError, match="is a symbolic link: set metrics_dir to the directory it points to"):
        textfile.write_atomically(os.path.join(place, "link", "atedevd.prom"), "a 2\n")
    os.chown(metrics_dir, NOBODY, NOBODY)
    with pytest.raises(OSError, match=f"{metrics_dir} is owned by nobody .*, not root"):
        textfile.write_atomically(os.path.join(metrics_dir, "atedevd.prom"), "a 3\n")
    assert open(os.path.join(metrics_dir, "atedevd.prom")).read() == "a 1\n"


# --- an upgrade's successor: the installed code, whatever the working directory holds ------------


def test_the_successor_of_an_upgrade_runs_the_installed_package_not_the_working_directorys(
        start_daemon, kubelet, tmp_path, place):
    """Started as `python3 -m atedevd run` from a directory a user can write: the user puts an
    `atedevd/` there once it runs, and an upgrade's successor must not import it (as root)."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(REPO, "atedevd"), site / "atedevd", ignore=shutil.ignore_patterns("__pycache__"))
    cwd = nobodys_dir(os.path.join(place, "work"))
    cfg = write_file(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    d = start_daemon(config=cfg, cwd=cwd, env={"PYTHONPATH": str(site)}, log_level="debug")
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    assert wait_until(lambda: "start-up done" in d.log(), 5), d.log()  # the installed files are noted then
    marker = os.path.join(cwd, "ran-as-root")
    pkg = os.path.join(cwd, "atedevd")
    source = f"import os\nopen({marker!r}, 'w').write(str(os.getuid()))\n"
    trojan = (f"import os\nos.makedirs({pkg!r})\nfor name in ('__init__.py', 'launch.py', '__main__.py'):\n"
              f"    open(os.path.join({pkg!r}, name), 'w').write({source!r})\n")
    as_nobody(trojan)
    upgrade(site)
    n = hup(d)
    main = d.notify.wait_for("MAINPID", timeout=15, after=n)
    assert main, d.log()
    successor = int(main["fields"]["MAINPID"])
    try:
        assert d.wait(15) == 0, d.log()
        assert not os.path.exists(marker), f"the successor ran the working directory's atedevd as uid {open(marker).read()}"
        assert os.readlink(f"/proc/{successor}/cwd") == "/"
        with open(f"/proc/{successor}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[1] == b"-I", argv  # isolated: no PYTHONPATH, user site or working directory
        assert kubelet.wait_connected("ate.dev/kvm", registrations=2), d.log()
    finally:
        os.kill(successor, signal.SIGTERM)
        wait_until(lambda: not os.path.exists(f"/proc/{successor}"), 10)
    assert stat.S_ISDIR(os.stat(os.path.join(cwd, "atedevd")).st_mode)  # the trojan was there all along
