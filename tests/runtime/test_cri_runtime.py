"""Devices in containers by pod kind through the CRI path kubelet takes: containerd 1.7.24 (Debian
13) with runc 1.1.15, given exactly what atedevd's Allocate answers, for a `c 10:232` node made
0660 root:999 (then 0666); with `enable_cdi` on, and off as containerd 1.7 ships. The same rows as
tests/runtime/test_cdi_runtime.py (podman); the table is README's "Non-root pods"."""

import os

import pytest

from tests.runtime import cri_runtime, oci_runtime
from tests.runtime.test_cdi_runtime import EACCES, GRANTS, GROUP, KVM, OK, _node

pytestmark = [pytest.mark.slow, pytest.mark.skipif(oci_runtime.missing() is not None,
                                                   reason=str(oci_runtime.missing()))]
ROOTFS = (cri_runtime.ROOTFS,) if oci_runtime.missing() is None else ()  # built in the background (conftest.py)

ROWS = {
    "root": {},
    "uid 1000": {"user": 1000},
    "uid 1000 + node's group": {"user": 1000, "groups": [GROUP]},
    "user namespace, root": {"userns": True},
    "user namespace, uid 1000": {"userns": True, "user": 1000},
}
USERNS_ROWS = ("user namespace, root", "user namespace, uid 1000")
DEVICESPEC = {"root": OK, "uid 1000": EACCES, "uid 1000 + node's group": OK,
              "user namespace, root": EACCES, "user namespace, uid 1000": EACCES}
CDI = {"root": OK, "uid 1000": OK, "uid 1000 + node's group": OK,
       "user namespace, root": EACCES, "user namespace, uid 1000": EACCES}
NO_NODE = dict.fromkeys(ROWS, "ENOENT")  # the names ignored, and no DeviceSpec: nothing at /dev/kvm


@pytest.fixture(scope="module")
def containerd(request, tmp_path_factory):
    """containerd with `enable_cdi` = request.param, for every test of the module that asks for it so."""
    base = tmp_path_factory.mktemp("cri")
    dev_root, node = _node(base)
    spec_dir = base / "cdi"
    spec_dir.mkdir(mode=0o755)
    c = cri_runtime.Containerd(str(spec_dir), node, enable_cdi=request.param)
    c.enable_cdi, c.dev_root, c.node, c.spec_dir = request.param, dev_root, node, spec_dir
    yield c
    c.close()


@pytest.mark.parametrize("containerd, grant", [
    (True, "devicespec"), (True, "cdi+devicespec"), (True, "cdi"),
    (False, "cdi+devicespec"), (False, "cdi"),  # containerd 1.7 as shipped: CDI names ignored
], indirect=["containerd"], ids=["enable_cdi-devicespec", "enable_cdi-cdi+devicespec", "enable_cdi-cdi",
                                  "cdi-off-cdi+devicespec", "cdi-off-cdi"])
def test_each_pod_kind_through_the_cri(containerd, start_daemon, kubelet, tmp_path, grant):
    os.chmod(containerd.node, 0o660)
    config = tmp_path / "c.toml"
    config.write_text(f'[daemon]\ncdi_spec_dir = "{containerd.spec_dir}"\n{GRANTS[grant]}')
    d = start_daemon(dev_root=containerd.dev_root, config=str(config))
    d.wait_ready()
    assert kubelet.wait_connected(KVM), d.log()
    answer = kubelet.allocate(KVM, ["kvm-0"]).container_responses[0]
    assert containerd.version.runtime_version.startswith("1.7.")
    if grant == "devicespec" or (not containerd.enable_cdi and grant == "cdi+devicespec"):
        expected = DEVICESPEC  # (containerd with CDI off ignores the names)
    elif containerd.enable_cdi:
        expected = CDI  # the spec's node, with or without the DeviceSpec beside the name
    else:
        expected = NO_NODE

    seen = {row: containerd.run(answer, **kw) for row, kw in ROWS.items()}
    assert {row: s.get("open") for row, s in seen.items()} == expected, (containerd.runc_version(), seen)
    for row, s in seen.items():
        if s["open"] == OK:
            assert s["ioctl"] == 12, (row, s)
    if expected is CDI:
        assert seen["uid 1000"]["stat"] == (0o666, 1000, 1000, 10, 232)  # made as the spec says
    if expected is DEVICESPEC:
        assert seen["uid 1000"]["stat"] == (0o660, 0, GROUP, 10, 232)  # the host node's mode and owner
    if expected is not NO_NODE:
        os.chmod(containerd.node, 0o666)  # host_mode's fix for user namespaces
        seen = {row: containerd.run(answer, **ROWS[row]) for row in USERNS_ROWS}
        assert {row: s["open"] for row, s in seen.items()} == dict.fromkeys(USERNS_ROWS, OK), seen
