"""Which device nodes atedevd will not grant: judged by what the node is, not its name.

A pod that holds /dev/mem reads and writes the host's memory; one that holds a
disk's SCSI generic node rewrites the disk under the host's filesystems. Such
nodes are recognised by the node itself, after every symlink is followed (as
the container runtime follows them): block or character, its major:minor, and
the kernel's own account of it in sysfs (/sys/dev/char/MAJ:MIN: its class and
its kernel name). A path's name proves nothing: `/dev/kvm` may be a symlink to
/dev/mem, and /dev/mem may be a node made anywhere with mknod.

The numbers come from the kernel's device list (Documentation/admin-guide/
devices.txt) for nodes with fixed numbers; nodes whose numbers the kernel hands
out at boot (NVMe, bsg, watchdog, TPM resource manager, IPMI) are known by their
sysfs class only. A rule matches on either, so a fixed-number node is refused
even where sysfs does not describe it (a container's /sys, a node made with
mknod and no driver). docs/device-policy.md lists every rule with its reason;
a test keeps the two in step.
"""

import functools
import os
import stat
from typing import Callable, Dict, Optional, Tuple

from atedevd.record import Record

SYS_ROOT = "/sys"


class DeviceNode(Record):
    """A device node as the kernel knows it."""

    path: str  # the path looked at
    resolved: str  # every symlink followed
    kind: str  # "char" or "block"
    major: int
    minor: int
    subsystem: Optional[str] = None  # sysfs class, e.g. "misc", "nvme"; None when sysfs does not say
    name: Optional[str] = None  # the kernel's name (DEVNAME), e.g. "mapper/control"

    @property
    def numbers(self) -> str:
        return f"{self.major}:{self.minor}"

    def describe(self) -> str:
        """`/dev/mem (char 1:1, sysfs class mem, kernel name mem)`."""
        sysfs = (f"sysfs class {self.subsystem}" + (f", kernel name {self.name}" if self.name else "")
                 if self.subsystem else "not in sysfs")
        shown = self.path if self.resolved == self.path else f"{self.path} -> {self.resolved}"
        return f"{shown} ({self.kind} {self.numbers}, {sysfs})"


class Rule(Record):
    """One kind of node that gives a container the host, and why."""

    what: str  # what the node is, in words
    reason: str  # what a pod holding it could do
    numbers: Callable[[str, int, int], bool]  # (kind, major, minor) from devices.txt
    sysfs: Callable[[str, str], bool]  # (class, kernel name)
    opt_in: bool = True  # False: no configuration grants it


def _num(major: int, *minors: int, kind: str = "char") -> Callable[[str, int, int], bool]:
    """Fixed numbers: `major` with any of `minors` (every minor when none are given)."""
    return lambda k, ma, mi: k == kind and ma == major and (not minors or mi in minors)


def _cls(subsystem: str, *names: str, prefix: str = "") -> Callable[[str, str], bool]:
    """A sysfs class, optionally only some of its kernel names (or names starting with `prefix`)."""
    def match(cls: str, name: str) -> bool:
        if cls != subsystem:
            return False
        if names:
            return name in names
        return name.startswith(prefix)
    return match


_NEVER_NUM = lambda k, ma, mi: False  # noqa: E731 - only sysfs knows these (numbers given out at boot)
_NEVER_CLS = lambda c, n: False  # noqa: E731


def _any(*tests: Callable) -> Callable:
    return lambda *a: any(t(*a) for t in tests)


# In the order docs/device-policy.md lists them. Minors and names are devices.txt's.
RULES: Tuple[Rule, ...] = (
    Rule("physical memory (/dev/mem)", "reads and writes all of the host's RAM, the kernel's included",
         _num(1, 1), _cls("mem", "mem")),
    Rule("kernel virtual memory (/dev/kmem)", "reads and writes the running kernel's memory",
         _num(1, 2), _cls("mem", "kmem")),
    Rule("I/O ports (/dev/port)", "drives the host's hardware directly, past every driver",
         _num(1, 4), _cls("mem", "port")),
    Rule("the kernel log (/dev/kmsg)", "reads every host kernel message (addresses, other pods' events) and writes forged ones",
         _num(1, 11), _cls("mem", "kmsg")),
    Rule("CPU model-specific registers (/dev/cpu/N/msr)", "rewrites host CPU state the kernel relies on: kernel code execution",
         _num(202), _cls("msr")),
    Rule("CPUID of a chosen CPU (/dev/cpu/N/cpuid)", "learns any host CPU's exact model and microcode, and nothing else: no pod needs the device (the CPUID instruction works without it), so it is refused with msr",
         _num(203), _cls("cpuid")),
    Rule("the CPU microcode loader (/dev/cpu/microcode)", "loads microcode into every host CPU",
         _num(10, 184), _cls("misc", "cpu/microcode")),
    Rule("a disk (block device)", "reads and writes the whole disk, beneath every filesystem and file permission on it (atedevd grants character devices only)",
         lambda k, ma, mi: k == "block", _NEVER_CLS, opt_in=False),
    Rule("SCSI generic (/dev/sgN)", "sends raw SCSI commands to a host disk: reads and writes beneath its filesystems, firmware updates",
         _num(21), _cls("scsi_generic")),
    Rule("block SCSI generic (/dev/bsg/*)", "sends raw SCSI commands to a host block device",
         _NEVER_NUM, _cls("bsg")),
    Rule("an NVMe controller (/dev/nvmeN)", "sends admin and I/O commands to a host disk: every namespace, format, firmware",
         _NEVER_NUM, _cls("nvme")),
    Rule("an NVMe namespace's generic node (/dev/ngNnM)", "sends raw I/O commands to a host disk",
         _NEVER_NUM, _cls("nvme-generic")),
    Rule("a raw disk binding (/dev/raw/rawN)", "reads and writes the host block device it is bound to",
         _num(162), _cls("raw")),
    Rule("raw flash (/dev/mtdN)", "reads and rewrites a flash chip, often the host's firmware",
         _num(90), _cls("mtd")),
    Rule("the device-mapper control (/dev/mapper/control)", "maps any host disk anew and reads and writes it through the mapping",
         _num(10, 236), _cls("misc", "mapper/control")),
    Rule("the loop control (/dev/loop-control)", "adds and removes the host's loop devices, which hold other mounts' images",
         _num(10, 237), _cls("misc", "loop-control")),
    Rule("the hibernation image (/dev/snapshot)", "reads all of the host's memory as an image and restores one",
         _num(10, 231), _cls("misc", "snapshot")),
    Rule("a watchdog (/dev/watchdog)", "reboots the host: opening it arms a timer that fires when the pod stops writing",
         _any(_num(10, 130), _num(10, 212, 213, 214, 215)), _any(_cls("misc", "watchdog"), _cls("watchdog"))),
    Rule("user-level input (/dev/uinput)", "creates a keyboard and types commands into the host's console and sessions",
         _num(10, 223), _cls("misc", "uinput", "input/uinput")),
    Rule("user-level HID (/dev/uhid)", "creates a HID device, such as a keyboard, and types commands into the host's console and sessions",
         _num(10, 239), _cls("misc", "uhid")),
    Rule("a user-level serio port (/dev/userio)", "emulates a PS/2 port, and a keyboard on it types commands into the host's console and sessions",
         _num(10, 240), _cls("misc", "userio")),
    Rule("a virtual console (/dev/ttyN, N < 64; /dev/console)", "types commands into what runs there (TIOCSTI), a root login included",
         _any(_num(4, *range(64)), _num(5, 1)), _any(_cls("tty", *(f"tty{i}" for i in range(64))), _cls("tty", "console"))),
    Rule("virtual console memory (/dev/vcsN)", "reads and rewrites what the host's consoles show",
         _num(7), _cls("vc")),
    Rule("firmware settings (/dev/nvram)", "rewrites the host's CMOS configuration",
         _num(10, 144), _cls("misc", "nvram")),
    Rule("a TPM (/dev/tpmN, /dev/tpmrmN)", "unseals secrets sealed to the host's boot state and spoils its measured-boot record",
         _num(10, 224), _any(_cls("tpm"), _cls("tpmrm"))),
    Rule("IPMI (/dev/ipmiN)", "commands the host's BMC: power off, reset, users, firmware",
         _NEVER_NUM, _cls("ipmi")),
    Rule("an I2C/SMBus adapter (/dev/i2c-N)", "talks to the host's sensor, EEPROM and voltage-regulator chips directly",
         _num(89), _cls("i2c-dev")),
    Rule("CUSE (/dev/cuse)", "creates character devices on the host, named and served by the pod",
         _num(10, 203), _cls("misc", "cuse")),
    Rule("a VFIO group without an IOMMU (/dev/vfio/noiommu-N)", "drives a device whose DMA reaches all of the host's memory",
         _NEVER_NUM, _cls("vfio", prefix="vfio/noiommu-")),
    Rule("a VFIO device without an IOMMU (/dev/vfio/devices/noiommu-vfioN)", "drives a device whose DMA reaches all of the host's memory",
         _NEVER_NUM, _cls("vfio-dev", prefix="vfio/devices/noiommu-")),
    Rule("the crash driver (/dev/crash)", "reads the host kernel's memory",
         _NEVER_NUM, _cls("misc", "crash")),
    Rule("Xen privileged commands (/dev/xen/privcmd)", "makes hypercalls as the host domain: every guest on the host",
         _NEVER_NUM, _cls("misc", "xen/privcmd")),
    Rule("the EFI capsule loader (/dev/efi_capsule_loader)", "queues a firmware update for the host's next boot",
         _NEVER_NUM, _cls("misc", "efi_capsule_loader")),
    Rule("a userspace I/O device (/dev/uioN)", "maps a PCI device's registers and drives its DMA with no IOMMU between "
         "it and the host's memory: all of that memory, as with VFIO without an IOMMU",
         _NEVER_NUM, _cls("uio")),
)


class Refusal(Record):
    """A node that gives a container the host."""

    node: DeviceNode
    rule: Rule

    def __str__(self) -> str:
        return f"{self.node.describe()} is {self.rule.what}: a pod holding it {self.rule.reason}"


def refusal_text(found: Refusal) -> str:
    """Why a device is refused and what would let it through (the configuration check,
    the daemon and `check` all say it so)."""
    if not found.rule.opt_in:
        return f"refused: {found}"
    return (f"refused: {found}. If pods on this node are meant to have that, "
            f"set allow_host_access = true in this [[device]] table")


def look(path: str, sys_root: str = SYS_ROOT, st: Optional[os.stat_result] = None) -> Optional[DeviceNode]:
    """The device node at `path`, symlinks followed; None when it is not a device node.
    `st`: the stat() already made of `path`, whose numbers are the ones judged (a second
    look at the path could see another node: udev replaces nodes between two looks).

    Raises OSError (FileNotFoundError when nothing is there) as os.stat does.
    """
    st = os.stat(path) if st is None else st
    if stat.S_ISCHR(st.st_mode):
        kind = "char"
    elif stat.S_ISBLK(st.st_mode):
        kind = "block"
    else:
        return None
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    subsystem, name = _sysfs(sys_root, kind, major, minor)
    try:
        resolved = os.path.realpath(path) if stat.S_ISLNK(os.lstat(path).st_mode) else path  # (a walk per link: words only)
    except OSError:
        resolved = path
    return DeviceNode(path, resolved, kind, major, minor, subsystem, name)


def by_numbers(path: str, major: int, minor: int, sys_root: str = SYS_ROOT) -> DeviceNode:
    """The character device `major:minor` as the kernel knows it, with no path looked up: how a
    grant written earlier (a CDI spec of an earlier run) is judged again."""
    subsystem, name = _sysfs(sys_root, "char", major, minor)
    return DeviceNode(path, path, "char", major, minor, subsystem, name)


def _sysfs(sys_root: str, kind: str, major: int, minor: int) -> Tuple[Optional[str], Optional[str]]:
    """(class, kernel name) of a node from /sys/dev/<kind>/MAJ:MIN; (None, None) when sysfs does
    not say. Read once per device: /sys/dev/<kind>/MAJ:MIN links to the device's own entry,
    whose class and kernel name do not change while it is there, and a device that takes the
    numbers next is at another entry (a hot-plug judges dozens of nodes; ~40 us a read)."""
    entry = os.path.join(sys_root, "dev", kind, f"{major}:{minor}")
    key = (entry, device_of(entry))
    found = _SEEN.get(key) if key[1] is not None else None
    if found is None:
        found = _read_sysfs(entry)
        if key[1] is not None and None not in found:  # (what could not be read is read again next time)
            if len(_SEEN) >= _SEEN_MAX:
                _SEEN.clear()
            _SEEN[key] = found
    return found


_SEEN: Dict[Tuple[str, Optional[str]], Tuple[Optional[str], Optional[str]]] = {}  # (entry, its device) -> _read_sysfs
_SEEN_MAX = 4096


def device_of(entry: str) -> Optional[str]:
    """The device entry /sys/dev/<kind>/MAJ:MIN links to (None: not a link, or nothing there)."""
    try:
        return os.readlink(entry)
    except OSError:
        return None


def _read_sysfs(entry: str) -> Tuple[Optional[str], Optional[str]]:
    try:
        subsystem = os.path.basename(os.readlink(os.path.join(entry, "subsystem")))
    except OSError:
        return None, None
    name = None
    try:
        with open(os.path.join(entry, "uevent")) as f:
            for line in f:
                if line.startswith("DEVNAME="):
                    name = line[len("DEVNAME="):].strip()
    except OSError:
        pass
    return subsystem, name


def judge(node: DeviceNode) -> Optional[Refusal]:
    """The rule that refuses `node`, or None when a pod may have it."""
    rule = _rule_for(node.kind, node.major, node.minor, node.subsystem, node.name)
    return Refusal(node, rule) if rule is not None else None


@functools.lru_cache(maxsize=8192)  # (a node's numbers: thousands of them on a node with many adapters)
def _rule_for(kind: str, major: int, minor: int, subsystem: Optional[str], name: Optional[str]) -> Optional[Rule]:
    """The first rule that refuses such a node: a rule reads nothing but these."""
    for rule in RULES:
        if rule.numbers(kind, major, minor) or (subsystem is not None and rule.sysfs(subsystem, name or "")):
            return rule
    return None


def refusal(path: str, sys_root: str = SYS_ROOT) -> Optional[Refusal]:
    """`judge` of the node at `path`; None when there is none (or nothing to judge).

    Raises OSError from os.stat (FileNotFoundError: absent, judged when it appears).
    """
    node = look(path, sys_root)
    return judge(node) if node is not None else None


def refused(found: Optional[Refusal], allowed: bool) -> bool:
    """Whether a device is kept from pods: refused by a rule that its opt-in does not lift."""
    return found is not None and not (allowed and found.rule.opt_in)
