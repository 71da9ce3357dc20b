"""Device nodes and sysfs as the tests lay them out: nodes made with mknod (root) under a dev root of
the test's own, and a fabricated sysfs where the device policy or the NUMA node needs the kernel's
account of a node. Shared by the unit tests, the daemon as a process and the benchmarks."""

import os
import stat


def mknod(root, name, major, minor):
    path = os.path.join(str(root), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    return path


def vfio_nodes(dev, *groups):
    """/dev/vfio/vfio and a group node per name, minors in order (243 is a major VFIO gets)."""
    mknod(dev, "vfio/vfio", 10, 196)
    for minor, group in enumerate(groups):
        mknod(dev, f"vfio/{group}", 243, minor)


def fake_vfio_sysfs(root, groups):
    """sysfs as the kernel shows VFIO groups: /sys/dev/char/MAJ:MIN of class vfio named vfio/N,
    and /sys/kernel/iommu_groups/N/devices/<PCI address>/numa_node. groups: {N: (minor, numa, pci)};
    a name that is not a number is a group without an IOMMU (vfio/noiommu-N)."""
    root = str(root)
    for group, (minor, numa, pci) in groups.items():
        entry = os.path.join(root, "devices", "virtual", "vfio", str(group))
        os.makedirs(entry)
        os.makedirs(os.path.join(root, "class", "vfio"), exist_ok=True)
        os.symlink(os.path.relpath(os.path.join(root, "class", "vfio"), entry), os.path.join(entry, "subsystem"))
        with open(os.path.join(entry, "uevent"), "w") as f:
            f.write(f"MAJOR=243\nMINOR={minor}\nDEVNAME=vfio/{group}\n")
        os.makedirs(os.path.join(root, "dev", "char"), exist_ok=True)
        os.symlink(os.path.relpath(entry, os.path.join(root, "dev", "char")), os.path.join(root, "dev", "char", f"243:{minor}"))
        if pci:
            device = os.path.join(root, "kernel", "iommu_groups", str(group), "devices", pci)
            os.makedirs(device)
            with open(os.path.join(device, "numa_node"), "w") as f:
                f.write(f"{numa}\n")
    return root


def fake_sysfs(root, kind, major, minor, cls, name):
    entry = os.path.join(root, "devices", "virtual", cls, os.path.basename(name))
    os.makedirs(entry)
    os.makedirs(os.path.join(root, "class", cls), exist_ok=True)
    os.symlink(os.path.relpath(os.path.join(root, "class", cls), entry), os.path.join(entry, "subsystem"))
    with open(os.path.join(entry, "uevent"), "w") as f:
        f.write(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}\n")
    link_dir = os.path.join(root, "dev", kind)
    os.makedirs(link_dir, exist_ok=True)
    os.symlink(os.path.relpath(entry, link_dir), os.path.join(link_dir, f"{major}:{minor}"))
    return root
