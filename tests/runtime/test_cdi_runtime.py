"""Devices in containers by pod kind, through a real runtime: podman with runc and with crun,
given exactly what atedevd's Allocate answers (DeviceSpecs, CDI names whose spec atedevd
wrote), for a `c 10:232` node made 0660 root:999 (and then 0666, what host_mode keeps).

Each row is a pod kind: root; uid 1000; uid 1000 with the node's group; a user namespace
(uid/gid 0 mapped to 100000, as `hostUsers: false`) as root, and as uid 1000. Each cell is
what the container saw when it opened the node read-write: "ok" (and KVM_GET_API_VERSION
answered 12: the node is the host's kvm) or the errno. The table measured is in
docs/devices-in-containers.md."""

import grp
import os

import pytest

from rig.harness import wait_until
from rig.nodes import mknod
from tests.runtime import oci_runtime

pytestmark = [pytest.mark.slow, pytest.mark.skipif(oci_runtime.missing() is not None,
                                                   reason=str(oci_runtime.missing()))]

KVM = "ate.dev/kvm"
GROUP = 999  # the node's group, as in the measurement ("0660 root:999")
ROWS = {
    "root": (),
    "uid 1000": ("--user", "1000:1000"),
    "uid 1000 + node's group": ("--user", "1000:1000", "--group-add", str(GROUP)),
    "user namespace, root": oci_runtime.USERNS,
    "user namespace, uid 1000": oci_runtime.USERNS + ("--user", "1000:1000"),
}
USERNS_ROWS = ("user namespace, root", "user namespace, uid 1000")
OK, EACCES = "ok", "EACCES"

# (runtime, grant) -> row -> what the open gave, host node 0660 root:999 (then 0666: user namespaces only)
EXPECTED = {
    ("runc", "devicespec"): {"root": OK, "uid 1000": EACCES, "uid 1000 + node's group": OK,
                             "user namespace, root": EACCES, "user namespace, uid 1000": EACCES},
    ("crun", "devicespec"): {"root": OK, "uid 1000": EACCES, "uid 1000 + node's group": OK,
                             "user namespace, root": OK, "user namespace, uid 1000": EACCES},
    ("runc", "cdi"): {"root": OK, "uid 1000": OK, "uid 1000 + node's group": OK,
                      "user namespace, root": EACCES, "user namespace, uid 1000": EACCES},
    ("crun", "cdi"): {"root": OK, "uid 1000": OK, "uid 1000 + node's group": OK,
                      "user namespace, root": OK, "user namespace, uid 1000": OK},
}
EXPECTED_0666 = {
    ("runc", "devicespec"): {"user namespace, root": OK, "user namespace, uid 1000": OK},
    ("crun", "devicespec"): {"user namespace, root": OK, "user namespace, uid 1000": EACCES},
    ("runc", "cdi"): {"user namespace, root": OK, "user namespace, uid 1000": OK},
    ("crun", "cdi"): {"user namespace, root": OK, "user namespace, uid 1000": OK},
}
GRANTS = {  # the [daemon] settings of each column
    "devicespec": "",
    "cdi+devicespec": "cdi = true\n",
    "cdi": "cdi = true\ndevice_specs = false\n",
}


def _node(tmp_path):
    dev = tmp_path / "devroot"
    node = mknod(dev, "kvm", 10, 232)
    os.chown(node, 0, GROUP)
    os.chmod(node, 0o660)
    return str(dev), node


@pytest.mark.parametrize("runtime", ["runc", "crun"])
@pytest.mark.parametrize("grant", ["devicespec", "cdi+devicespec"])  # CDI alone: the same (tests/runtime/test_cri_runtime.py)
def test_each_pod_kind_opens_the_node_or_gets_the_errno_the_docs_promise(start_daemon, kubelet, tmp_path, runtime, grant):
    dev_root, node = _node(tmp_path)
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir(mode=0o755)
    config = tmp_path / "c.toml"
    config.write_text(f'[daemon]\ncdi_spec_dir = "{spec_dir}"\n{GRANTS[grant]}')
    d = start_daemon(dev_root=dev_root, config=str(config))
    d.wait_ready()
    assert kubelet.wait_connected(KVM), d.log()
    answer = kubelet.allocate(KVM, ["kvm-0"]).container_responses[0]
    assert [c.name for c in answer.cdi_devices] == ([] if grant == "devicespec" else ["ate.dev/kvm=kvm"])
    assert len(answer.devices) == (0 if grant == "cdi" else 1)
    args = oci_runtime.device_args(answer, dev_root)
    column = "devicespec" if grant == "devicespec" else "cdi"  # with the DeviceSpec beside it or not, CDI's node wins

    seen = {row: oci_runtime.run(runtime, str(spec_dir), node, args, user) for row, user in ROWS.items()}
    table = {row: s["open"] for row, s in seen.items()}
    assert table == EXPECTED[(runtime, column)], _table(runtime, grant, seen)
    for row, s in seen.items():
        if s["open"] == OK:
            assert s["ioctl"] == 12, (row, s)  # the host's kvm, through the device cgroup
    root, uid = seen["root"]["stat"], seen["uid 1000"]["stat"]
    if column == "cdi":  # the runtime made the node as the spec says: 0666, the container's user's
        assert root == (0o666, 0, 0, 10, 232) and uid == (0o666, 1000, 1000, 10, 232)
    else:  # the host node's own mode and owner
        assert root == uid == (0o660, 0, GROUP, 10, 232)

    os.chmod(node, 0o666)  # the one fix for user namespaces: a host node others may open (host_mode)
    seen = {row: oci_runtime.run(runtime, str(spec_dir), node, args, ROWS[row]) for row in USERNS_ROWS}
    assert {row: s["open"] for row, s in seen.items()} == EXPECTED_0666[(runtime, column)], _table(runtime, grant, seen)


def test_atedevd_keeps_the_host_node_at_host_mode_and_a_user_namespaced_pod_opens_it(start_daemon, kubelet, tmp_path):
    """host_mode: the daemon makes the host node 0666 at start and again after anyone changes it;
    runc then binds an openable node into a user-namespaced pod."""
    dev_root, node = _node(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\nhost_mode = 0o666\n')
    d = start_daemon(dev_root=dev_root, config=str(config))
    d.wait_ready()
    assert kubelet.wait_connected(KVM), d.log()
    assert os.stat(node).st_mode & 0o7777 == 0o666
    os.chmod(node, 0o660)  # udev, or anyone: put back
    assert wait_until(lambda: os.stat(node).st_mode & 0o7777 == 0o666, 5), d.log()
    args = oci_runtime.device_args(kubelet.allocate(KVM, ["kvm-0"]).container_responses[0], dev_root)
    seen = oci_runtime.run("runc", str(tmp_path), node, args, ROWS["user namespace, uid 1000"])
    assert (seen["open"], seen["ioctl"]) == (OK, 12), seen
    assert "keeping it at 0666" in d.log()


def _table(runtime, grant, seen) -> str:
    name = grp.getgrgid(GROUP).gr_name if GROUP in [g.gr_gid for g in grp.getgrall()] else str(GROUP)
    lines = [f"{runtime} {oci_runtime.versions()}, grant {grant}, node group {name}:"]
    lines += [f"  {row:28} {s['open']:7} stat={s['stat']}" for row, s in seen.items()]
    return "\n".join(lines)
