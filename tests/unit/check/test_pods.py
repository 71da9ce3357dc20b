"""`atedevd check` names, per device, which pod kinds can open it and the fix for those that
cannot (atedevd/check/pod_kinds.py): from the host node's mode and owner, the container path, the
CDI settings and the container runtime's own configuration (atedevd/check/runtimes.py)."""

import json
import os
import subprocess

import pytest

from atedevd.check import report as check
from atedevd.check import runtimes
from atedevd.config import Device
from rig.harness import REPO
from rig.nodes import mknod


def pods(out_json):
    return {p["kind"]: p for p in out_json["devices"][0]["pods"]}


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/kvm"), reason="binds a node over /dev/kvm (root)")
def test_a_0660_kvm_leaves_user_namespaced_pods_out_and_check_names_the_one_fix(tmp_path):
    """`atedevd check --json` as a process, in a mount namespace where /dev/kvm is a 0660 root:999 node."""
    node = mknod(tmp_path, "kvm", 10, 232)
    os.chown(node, 0, 999)
    os.chmod(node, 0o660)
    (tmp_path / "dp").mkdir()
    config = tmp_path / "c.toml"
    config.write_text('[daemon]\ncdi = true\n')
    script = (f"mount --bind {node} /dev/kvm && exec /usr/bin/python3 -m atedevd check --json --config {config} "
              f"--device-plugin-dir {tmp_path / 'dp'}")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    doc = json.loads(done.stdout)
    kinds = pods(doc)
    assert {k: v["opens"] for k, v in kinds.items()} == {
        "root": "yes", "non-root": "no", "non-root-with-group": "yes", "non-root-cdi": "yes", "user-namespace": "no"}
    userns = kinds["user-namespace"]
    assert "/dev/kvm is 0660 root:" in userns["why"] and "runc binds the host node" in userns["why"]
    assert userns["fix"].startswith("the one fix: a host node others may read and write: host_mode = 0o666")
    assert "every user and process on the host may open /dev/kvm too" in userns["fix"]
    assert kinds["non-root-cdi"]["why"] == "the runtime makes it 0666, the container's user's"
    assert kinds["non-root"]["fix"].startswith("[daemon] cdi = true")
    finding = next(f for f in doc["findings"] if f["check"] == "pod-kind" and f["message"].startswith("user namespace:"))
    assert finding["status"] == "warning" and finding["fix"] == userns["fix"]
    assert done.returncode == 1  # no kubelet here: NOT READY, whatever the pod kinds say
    text = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script.replace(" --json", "")],
                          cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    assert "Which pods can open ate.dev/kvm (/dev/kvm):" in text
    assert "  fix for user namespace: the one fix: a host node others may read and write: host_mode = 0o666" in text


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_runtimes_own_settings_decide_the_cdi_and_non_root_rows(node, tmp_path):
    root = tmp_path / "etc-root"
    write(root / "etc/containerd/config.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = false\n')
    found = runtimes.read(str(root), containerd_version="1.7.24")
    assert found == [runtimes.Runtime("containerd", f"{root}/etc/containerd/config.toml", False,
                                      runtimes.DEFAULT_SPEC_DIRS, False, "runc", "1.7.24", False)]
    cfg = node.cfg(cdi=True)
    code, doc = as_json(cfg, found)
    cdi = pods(doc)["non-root-cdi"]
    assert (cdi["opens"], cdi["fix"]) == ("no", f"enable_cdi = true in {root}/etc/containerd/config.toml, then restart containerd")
    # containerd 2.4's `config default` writes version 4, the CRI runtime's table where version 3 has it
    write(root / "etc/containerd/config.toml", "version = 4\n[plugins.'io.containerd.cri.v1.runtime']\nenable_cdi = false\n")
    found = runtimes.read(str(root), containerd_version="2.4.2")
    assert [(r.cdi, r.enable_cdi) for r in found] == [(False, False)], found
    assert pods(as_json(cfg, found)[1])["non-root-cdi"]["opens"] == "no"
    write(root / "etc/containerd/config.toml", 'version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n'
          'device_ownership_from_security_context = true\ncdi_spec_dirs = ["/etc/cdi"]\n')
    write(root / "etc/crio/crio.conf.d/10-crun.conf", '[crio.runtime]\ndefault_runtime = "crun"\n')
    found = runtimes.read(str(root), containerd_version="2.2.9")
    assert [(r.name, r.cdi, r.spec_dirs, r.ownership_from_security_context, r.oci_runtime) for r in found] == [
        ("containerd", True, ("/etc/cdi",), True, "runc"), ("CRI-O", True, runtimes.DEFAULT_SPEC_DIRS, False, "crun")]
    kinds = pods(as_json(node.cfg(cdi=True), found)[1])
    assert kinds["non-root-cdi"]["why"] == "containerd reads CDI specs from /etc/cdi, not /var/run/cdi"
    assert kinds["non-root-cdi"]["fix"] == 'cdi_spec_dir = "/etc/cdi" in [daemon]'
    assert "; CRI-O: CRI-O runs crun, which makes the node in the user namespace itself" in kinds["user-namespace"]["why"]
    mode = node.cfg(Device("ate.dev/kvm", "/dev/kvm", container_mode=0o660, container_uid=0))
    kinds = pods(as_json(mode._replace(cdi=True), [])[1])
    assert (kinds["non-root-cdi"]["opens"], kinds["non-root-cdi"]["fix"]) == (
        "no", "container_mode = 0o666 (the default) in this [[device]]")


def test_a_spec_directory_the_sandbox_keeps_read_only_is_a_problem(node):
    node.kubelet()
    unit = {"LoadState": "loaded", "ProtectSystem": "strict", "ReadWritePaths": f"-{node.dp}"}
    code, doc = as_json(node.cfg(cdi=True, cdi_spec_dir="/var/run/cdi"), [], unit)
    [f] = [f for f in doc["findings"] if f["check"] == "cdi-spec-dir"]
    assert (code, f["status"]) == (check.EX_NOT_READY, "problem")
    assert "atedevd cannot write its CDI specs there" in f["message"] and "ReadWritePaths=-/var/run/cdi" in f["fix"]
    unit["ReadWritePaths"] += " -/run/cdi"  # the unit's own: /var/run is /run
    code, doc = as_json(node.cfg(cdi=True, cdi_spec_dir="/var/run/cdi"), [], unit)
    [f] = [f for f in doc["findings"] if f["check"] == "cdi-spec-dir"]
    assert (code, f["status"], f["message"]) == (0, "ok", "CDI specs are written to /var/run/cdi")


def as_json(cfg, found, unit=None):
    import io

    out = io.StringIO()
    code = check.run(cfg, out, unit=lambda: unit, as_json=True, runtimes=lambda: list(found))
    return code, json.loads(out.getvalue())


def test_host_mode_is_the_user_namespace_verdict_where_atedevd_keeps_it():
    from atedevd.check import pod_kinds

    node = pod_kinds.HostNode("/dev/kvm", "/dev/kvm", 0o660, 0, 107, 2792, 2792, "root:kvm")
    [userns] = [v for v in pod_kinds.judge(node, Device("ate.dev/kvm", "/dev/kvm"), False, "/var/run/cdi", [])
                if v.kind == "user-namespace"]
    assert userns.opens == "no" and userns.fix.startswith("the one fix")
    kept = Device("ate.dev/kvm", "/dev/kvm", host_mode=0o666)
    [userns] = [v for v in pod_kinds.judge(node, kept, False, "/var/run/cdi", []) if v.kind == "user-namespace"]
    assert (userns.opens, userns.fix) == ("yes", None)
    assert userns.why == "host_mode = 0o666: atedevd keeps /dev/kvm so, and runc binds the host node (now 0660)"
    moved = node._replace(at_container_path=None)
    [userns] = [v for v in pod_kinds.judge(moved, kept, False, "/var/run/cdi", []) if v.kind == "user-namespace"]
    assert userns.opens == "no" and "which is missing" in userns.why
