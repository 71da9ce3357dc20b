"""CDI on containerd 2 (CDI on as shipped) and `hostUsers: false`, on a real node: what each pod
kind opens under three configurations, and whether `atedevd check` on that node says the same.

    device-spec       cdi = false: the DeviceSpec alone (the node keeps the host's 0660 root:KVM_GID)
    cdi-names-alone   cdi = true, device_specs = false: containerd makes the node from the spec (0666)
    cdi-host-mode     cdi = true, host_mode = 0o666: the host node too, for user namespaces
"""
from __future__ import annotations

import os
import stat

import pytest

from tests.e2e import workloads as w
from tests.e2e.cluster import KVM, KVM_GID

# pod name -> (pod fields, atedevd check's kind for it)
KINDS = {
    "root": ({}, "root"),
    "uid1000": ({"user": 1000}, "non-root"),
    "uid1000-group": ({"user": 1000, "groups": [KVM_GID]}, "non-root-with-group"),
    "userns-root": ({"host_users": False}, "user-namespace"),
    "userns-uid1000": ({"host_users": False, "user": 1000}, "user-namespace"),
}
CONFIGS = {
    "device-spec": (False, "", "", {"root": "ok", "uid1000": "EACCES", "uid1000-group": "ok",
                                    "userns-root": "EACCES", "userns-uid1000": "EACCES"}),
    "cdi-names-alone": (True, "device_specs = false", "", {"root": "ok", "uid1000": "ok", "uid1000-group": "ok",
                                                           "userns-root": "EACCES", "userns-uid1000": "EACCES"}),
    "cdi-host-mode": (True, "", "host_mode = 0o666\n", {"root": "ok", "uid1000": "ok", "uid1000-group": "ok",
                                                        "userns-root": "ok", "userns-uid1000": "ok"}),
}


@pytest.fixture
def kvm_put_back():
    """host_mode changes the host's node: the cluster's 0660 root:KVM_GID is put back after the
    test (after atedevd stopped: it would keep its mode)."""
    st = os.stat(KVM)
    yield
    os.chown(KVM, st.st_uid, st.st_gid)
    os.chmod(KVM, stat.S_IMODE(st.st_mode))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_pod_kinds_and_what_check_says(kvm_put_back, start_atedevd, cluster, figure, config):
    cdi, daemon, device_extra, expected = CONFIGS[config]
    a = start_atedevd(cdi=cdi, daemon=daemon,
                      devices=f'[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n{device_extra}')
    if cdi:
        assert any(cluster.cdi_dir.glob("atedevd-*.json")), list(cluster.cdi_dir.iterdir())
    for name, (fields, _) in KINDS.items():
        cluster.api.create(w.PODS, w.pod(f"{config}-{name}", cluster.image, **fields))
    got = {name: w.seen(cluster.pod_logs, w.wait_probed(cluster.api, cluster.pod_logs, f"{config}-{name}"))
           for name in KINDS}
    report = a.check()
    (device,) = [d for d in report["devices"] if d["resource"] == "ate.dev/kvm"]
    verdicts = {k["kind"]: k["opens"] for k in device["pods"]}
    rows, disagree = [], []
    for name, (fields, kind) in KINDS.items():
        if cdi and kind == "non-root":
            kind = "non-root-cdi"
        opened = got[name]["open"] == "ok"
        rows.append(f"{name}: {got[name]['open']} (check {kind}: {verdicts.get(kind)})")
        if (verdicts.get(kind) == "yes") != opened:
            disagree.append(name)
    host = os.stat(KVM)
    figure(f"{config} (host node {oct(stat.S_IMODE(host.st_mode))}): " + "; ".join(rows),
           f"{config}: root, uid 1000, uid 1000 + group, hostUsers: false root, uid 1000",
           ", ".join(got[name]["open"] for name in KINDS) + ("; check agrees" if not disagree else "; check DISAGREES"))
    assert {name: g["open"] for name, g in got.items()} == expected, got
    for name in ("root", "uid1000", "uid1000-group", "userns-root"):
        if expected[name] == "ok":
            assert got[name]["ioctl"] == 12, (name, got[name])
    assert not disagree, (disagree, verdicts)
