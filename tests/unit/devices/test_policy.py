"""The device policy: nodes that give a container the host are known by what they are.

Every rule in atedevd.policy.RULES has a case here, judged from the kernel's
account of the node (a fabricated sysfs) and, where devices.txt fixes its
numbers, from the numbers alone (a node no sysfs describes). The docs list the
same rules.
"""

import os
import stat

import pytest

from atedevd.config_file import load as loader
from atedevd.devices import judgement, policy, shared
from atedevd.devices.policy import DeviceNode as Node
from rig.harness import REPO
from rig.nodes import fake_sysfs

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")

# (the rule's `what` starts with, kind, major, minor, sysfs class, kernel name). Numbers
# of classes the kernel numbers at boot (nvme, bsg, ...) are what such a node might get.
REFUSED = [
    ("physical memory", "char", 1, 1, "mem", "mem"),
    ("kernel virtual memory", "char", 1, 2, "mem", "kmem"),
    ("I/O ports", "char", 1, 4, "mem", "port"),
    ("the kernel log", "char", 1, 11, "mem", "kmsg"),
    ("CPU model-specific registers", "char", 202, 3, "msr", "cpu/3/msr"),
    ("CPUID", "char", 203, 0, "cpuid", "cpu/0/cpuid"),
    ("the CPU microcode loader", "char", 10, 184, "misc", "cpu/microcode"),
    ("a disk", "block", 8, 0, "block", "sda"),
    ("a disk", "block", 259, 1, "block", "nvme0n1p1"),
    ("SCSI generic", "char", 21, 0, "scsi_generic", "sg0"),
    ("block SCSI generic", "char", 246, 0, "bsg", "bsg/0:0:0:0"),
    ("an NVMe controller", "char", 241, 0, "nvme", "nvme0"),
    ("an NVMe namespace", "char", 242, 0, "nvme-generic", "ng0n1"),
    ("a raw disk binding", "char", 162, 1, "raw", "raw/raw1"),
    ("raw flash", "char", 90, 0, "mtd", "mtd0"),
    ("the device-mapper control", "char", 10, 236, "misc", "mapper/control"),
    ("the loop control", "char", 10, 237, "misc", "loop-control"),
    ("the hibernation image", "char", 10, 231, "misc", "snapshot"),
    ("a watchdog", "char", 10, 130, "misc", "watchdog"),
    ("a watchdog", "char", 247, 0, "watchdog", "watchdog0"),
    ("user-level input", "char", 10, 223, "misc", "uinput"),
    ("user-level HID", "char", 10, 239, "misc", "uhid"),
    ("a user-level serio port", "char", 10, 240, "misc", "userio"),
    ("a virtual console", "char", 4, 1, "tty", "tty1"),
    ("a virtual console", "char", 5, 1, "tty", "console"),
    ("virtual console memory", "char", 7, 1, "vc", "vcs1"),
    ("firmware settings", "char", 10, 144, "misc", "nvram"),
    ("a TPM", "char", 10, 224, "tpm", "tpm0"),
    ("a TPM", "char", 253, 65536, "tpmrm", "tpmrm0"),
    ("IPMI", "char", 239, 0, "ipmi", "ipmi0"),
    ("an I2C/SMBus adapter", "char", 89, 0, "i2c-dev", "i2c-0"),
    ("CUSE", "char", 10, 203, "misc", "cuse"),
    ("a VFIO group without an IOMMU", "char", 243, 0, "vfio", "vfio/noiommu-0"),
    ("a VFIO device without an IOMMU", "char", 511, 0, "vfio-dev", "vfio/devices/noiommu-vfio0"),
    ("the crash driver", "char", 10, 60, "misc", "crash"),
    ("Xen privileged commands", "char", 10, 61, "misc", "xen/privcmd"),
    ("the EFI capsule loader", "char", 10, 62, "misc", "efi_capsule_loader"),
    ("a userspace I/O device", "char", 240, 0, "uio", "uio0"),
]

# Nodes a pod may have: what atedevd is for, and the near misses of the rules above.
ALLOWED = [
    ("kvm", "char", 10, 232, "misc", "kvm"),
    ("fuse", "char", 10, 229, "misc", "fuse"),
    ("tun", "char", 10, 200, "misc", "net/tun"),
    ("vhost-net", "char", 10, 238, "misc", "vhost-net"),
    ("vhost-vsock", "char", 10, 241, "misc", "vhost-vsock"),
    ("the VFIO container", "char", 10, 196, "misc", "vfio/vfio"),
    ("a VFIO group behind an IOMMU", "char", 243, 1, "vfio", "vfio/12"),
    ("a VFIO device behind an IOMMU (the iommufd cdev)", "char", 511, 1, "vfio-dev", "vfio/devices/vfio1"),
    ("hpet (the driver refuses write opens)", "char", 10, 228, "misc", "hpet"),
    ("cpu_dma_latency", "char", 10, 59, "misc", "cpu_dma_latency"),
    ("null", "char", 1, 3, "mem", "null"),
    ("urandom", "char", 1, 9, "mem", "urandom"),
    ("a serial port", "char", 4, 64, "tty", "ttyS0"),
    ("the caller's tty", "char", 5, 0, "tty", "tty"),
    ("ptmx", "char", 5, 2, "tty", "ptmx"),
    ("an input event node", "char", 13, 64, "input", "input/event0"),
    ("a GPU", "char", 226, 0, "drm", "dri/card0"),
    ("a GPU's render node", "char", 226, 128, "drm", "dri/renderD128"),
    ("a USB device", "char", 189, 0, "usb", "bus/usb/001/001"),
]


def node(kind, major, minor, cls=None, name=None, path="/dev/x"):
    return Node(path, path, kind, major, minor, cls, name)


@pytest.mark.parametrize("what,kind,major,minor,cls,name", REFUSED, ids=[f"{c[0]}-{c[5]}" for c in REFUSED])
def test_refused_by_what_the_kernel_says_it_is(what, kind, major, minor, cls, name):
    found = policy.judge(node(kind, major, minor, cls, name))
    assert found is not None and found.rule.what.startswith(what), found


@pytest.mark.parametrize("what,kind,major,minor,cls,name", REFUSED, ids=[f"{c[0]}-{c[5]}" for c in REFUSED])
def test_fixed_numbers_are_refused_without_sysfs_and_boot_numbers_are_not(what, kind, major, minor, cls, name):
    """Where devices.txt fixes a node's numbers, a node sysfs does not describe (a mknod
    somewhere, a container's /sys) is still refused; numbers the kernel gives out at
    boot mean nothing without sysfs."""
    found = policy.judge(node(kind, major, minor))
    fixed = cls not in ("bsg", "nvme", "nvme-generic", "ipmi", "vfio", "vfio-dev", "watchdog", "tpmrm", "uio") and name not in (
        "crash", "xen/privcmd", "efi_capsule_loader")
    if fixed:
        assert found is not None and found.rule.what.startswith(what), found
    else:
        assert found is None, found


@pytest.mark.parametrize("what,kind,major,minor,cls,name", ALLOWED, ids=[c[0] for c in ALLOWED])
def test_allowed(what, kind, major, minor, cls, name):
    assert policy.judge(node(kind, major, minor, cls, name)) is None
    assert policy.judge(node(kind, major, minor)) is None


def test_every_rule_has_a_case():
    covered = {policy.judge(node(*c[1:])).rule for c in REFUSED}
    assert covered == set(policy.RULES)


def test_a_name_proves_nothing_sysfs_decides_for_dynamic_minors():
    """A misc node with a dynamic minor is whatever the kernel says it is."""
    assert policy.judge(node("char", 10, 57, "misc", "mapper/control")).rule.what.startswith("the device-mapper")
    assert policy.judge(node("char", 10, 57, "misc", "kvm")) is None
    assert policy.judge(node("char", 10, 57, path="/dev/mapper/control")) is None  # the path is not looked at


def test_only_block_devices_cannot_be_opted_in():
    assert [r.what for r in policy.RULES if not r.opt_in] == ["a disk (block device)"]
    mem = policy.judge(node("char", 1, 1))
    disk = policy.judge(node("block", 8, 0))
    assert policy.refused(mem, allowed=False) and not policy.refused(mem, allowed=True)
    assert policy.refused(disk, allowed=False) and policy.refused(disk, allowed=True)
    assert not policy.refused(None, allowed=False)


def test_refusal_names_the_node_its_numbers_and_why():
    text = str(policy.judge(Node("/dev/kvm", "/dev/mem", "char", 1, 1, "mem", "mem")))
    assert text.startswith("/dev/kvm -> /dev/mem (char 1:1, sysfs class mem, kernel name mem) is physical memory")
    assert "reads and writes all of the host's RAM" in text
    assert "(char 1:1, not in sysfs)" in str(policy.judge(node("char", 1, 1)))


@needs_root
def test_look_follows_symlinks_and_reads_the_kernels_account(tmp_path):
    dev = tmp_path / "dev"
    (dev / "nvme").mkdir(parents=True)
    os.mknod(dev / "nvme" / "ctl", stat.S_IFCHR | 0o600, os.makedev(241, 0))
    os.symlink("nvme/ctl", dev / "accel")  # an innocent name, relative like udev's links
    sys_root = fake_sysfs(str(tmp_path / "sys"), "char", 241, 0, "nvme", "nvme0")
    found = policy.look(str(dev / "accel"), sys_root)
    assert found == Node(str(dev / "accel"), str(dev / "nvme" / "ctl"), "char", 241, 0, "nvme", "nvme0")
    assert policy.refusal(str(dev / "accel"), sys_root).rule.what.startswith("an NVMe controller")
    assert policy.refusal(str(dev / "accel"), str(tmp_path / "nosys")) is None  # numbers from boot: sysfs only


@needs_root
def test_sysfs_is_read_once_per_device_and_again_when_another_device_has_the_numbers(tmp_path):
    """The class and kernel name are remembered per device entry: a device that takes the same
    numbers next (a hot-plug) is at another entry of sysfs, and is judged by its own."""
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "thing", stat.S_IFCHR | 0o600, os.makedev(240, 7))
    sys_root = fake_sysfs(str(tmp_path / "sys"), "char", 240, 7, "tty", "ttyUSB7")
    assert policy.refusal(str(dev / "thing"), sys_root) is None
    os.unlink(os.path.join(sys_root, "dev", "char", "240:7"))  # unplugged: another device takes 240:7
    fake_sysfs(sys_root, "char", 240, 7, "misc", "uinput")
    found = policy.refusal(str(dev / "thing"), sys_root)
    assert found is not None and "uinput" in found.node.describe()
    assert policy.look(str(dev / "thing"), sys_root).subsystem == "misc"


@needs_root
def test_look_at_what_is_not_a_node(tmp_path):
    (tmp_path / "file").write_text("")
    assert policy.look(str(tmp_path / "file")) is None
    with pytest.raises(FileNotFoundError):
        policy.look(str(tmp_path / "absent"))
    os.symlink("absent", tmp_path / "dangling")
    with pytest.raises(FileNotFoundError):
        policy.look(str(tmp_path / "dangling"))  # as the container runtime fails on it


def test_the_docs_list_every_rule_with_its_reason():
    with open(os.path.join(REPO, "docs", "device-policy.md")) as f:
        doc = " ".join(f.read().split())
    for rule in policy.RULES:
        assert rule.what in doc, rule.what
        assert " ".join(rule.reason.split()) in doc, rule.reason
    man = open(os.path.join(REPO, "man", "atedevd.toml.5")).read()
    assert "allow_host_access" in man and ".SH \"DEVICE POLICY\"" in man and r"device\-policy.md" in man


def test_the_docs_name_every_class_the_policy_was_asked_about():
    """Refused or allowed, each class these tests judge is in docs/device-policy.md, with its reason."""
    with open(os.path.join(REPO, "docs", "device-policy.md")) as f:
        doc = f.read()
    tables = doc[doc.index("## Refused nodes"):doc.index("## Opting in")]
    cells = {c.strip() for row in tables.splitlines() if row.startswith("|")
             for part in row.split("|")[2].split(";") for c in part.split(",")}
    classes = {c[4] for c in REFUSED + ALLOWED if c[4] != "block"}
    assert classes - cells == set(), classes - cells


def test_this_hosts_sysfs_names_dev_null_as_the_rules_expect():
    """The classes and kernel names the rules match are the kernel's own: read from this host."""
    found = policy.look("/dev/null")
    assert (found.kind, found.numbers, found.subsystem, found.name) == ("char", "1:3", "mem", "null")
    assert policy.judge(found) is None


@needs_root
def test_check_and_check_config_warn_about_every_opted_in_device(tmp_path):
    import io

    from atedevd.check import report as check

    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "msr", stat.S_IFCHR | 0o600, os.makedev(202, 0))
    os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, os.makedev(10, 232))
    path = tmp_path / "c.toml"
    path.write_text(f'[daemon]\ndev_root = "{dev}"\ndevice_plugin_dir = "{tmp_path}/dp"\n'
                    '[[device]]\nresource = "a.dev/msr"\npath = "/dev/msr"\nallow_host_access = true\n'
                    '[[device]]\nresource = "a.dev/kvm"\npath = "/dev/kvm"\nallow_host_access = true\n'
                    '[[device]]\nresource = "a.dev/later"\npath = "/dev/later"\nallow_host_access = true\n')
    out = io.StringIO()
    assert check.check_config(str(path), out, required=True) == 0
    warned = out.getvalue()
    assert (f"WARNING: a.dev/msr: granted because allow_host_access = true: {dev}/msr (char 202:0, not in sysfs) "
            "is CPU model-specific registers") in warned
    assert "note: a.dev/kvm: allow_host_access = true has no effect" in warned
    assert "WARNING: a.dev/later: allow_host_access = true and /dev/later is not there" in warned
    out = io.StringIO()
    check.run(loader.load(str(path), required=True), out, unit=lambda: None)
    assert "WARNING: a.dev/msr: granted because allow_host_access = true" in out.getvalue()


def test_presence_follows_symlinks_as_the_runtime_does(tmp_path):
    """containerd resolves a DeviceSpec's host path (EvalSymlinks) and stats the target; a dangling
    link fails the container and a link to a directory would grant every node in it."""

    from atedevd.config import Device

    dev = tmp_path / "dev"
    (dev / "dri").mkdir(parents=True)
    os.symlink("/dev/null", dev / "dri" / "card0")
    os.symlink("dri/card0", dev / "gpu")  # relative, like udev's by-path links
    os.symlink("dri", dev / "gpus")
    os.symlink("nothing", dev / "gone")
    look = lambda name: judgement.judge_path(Device("a.dev/x", f"/dev/{name}"), str(dev))  # noqa: E731
    gpu = look("gpu")
    assert gpu.state is judgement.NodeState.PRESENT and (gpu.node.resolved, gpu.node.numbers) == ("/dev/null", "1:3")
    gpus = look("gpus")
    assert (gpus.state, gpus.why) == (judgement.NodeState.NOT_A_NODE, "a directory, not a character device")
    assert look("gone").state is judgement.NodeState.MISSING


def test_node_watch_keeps_the_first_node_across_a_reload_that_changed_nothing(tmp_path):

    from atedevd.config import Device

    dev = tmp_path / "dev"
    dev.mkdir()
    os.symlink("/dev/null", dev / "kvm")
    watch = shared.NodeWatch(Device("ate.dev/kvm", "/dev/kvm"), str(dev), "/sys")
    assert watch.look(advertised=False).present
    assert watch.look(advertised=True) is None  # nothing changed: nothing to say
    watch.forget()  # a reload
    assert watch.look(advertised=True) is None
    os.symlink("/dev/zero", dev / "kvm.new")
    os.rename(dev / "kvm.new", dev / "kvm")
    change = watch.look(advertised=True)
    assert not change.present and change.event == "device-changed" and "not the 1:3 first served" in change.message
