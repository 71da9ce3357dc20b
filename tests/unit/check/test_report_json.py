"""`atedevd check --json`: the same findings and exit status as the table, as a document a
fleet tool reads; and the /dev/char/MAJOR:MINOR link check."""

import io
import json
import os

import pytest

from atedevd.check import report as check
from atedevd.config import Device
from rig.nodes import mknod, vfio_nodes
from tests.unit.check.fake_node import atedevd, config_file, run
from tests.unit.devices.test_patterns import load

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and chown need root")
FINDING_KEYS = {"check", "subject", "status", "message", "fix"}
DEVICE_KEYS = {"resource", "path", "host_path", "present", "type", "units", "device_number", "uid", "gid",
               "owner", "mode", "non_root", "char_link", "nodes", "pods"}


def as_json(cfg, unit=None):
    out = io.StringIO()
    code = check.run(cfg, out, unit=lambda: unit, as_json=True)
    return code, json.loads(out.getvalue())


def problems_in_text(text):
    if "NOT READY" not in text:
        return []
    tail = text.split("NOT READY", 1)[1].split("\n\nInstall this drop-in", 1)[0]
    return [line[4:] for line in tail.splitlines() if line.startswith("  - ")]


def test_ready_node_as_json(node):
    node.kubelet()
    code, doc = as_json(node.cfg())
    assert code == 0
    assert doc["schema"] == "atedevd-check/v1" and doc["ready"] is True and doc["exit_code"] == 0
    assert doc["config"] is None and doc["dev_root"] == node.dev and doc["plugin_dir"] == node.dp
    [dev] = doc["devices"]
    assert set(dev) == DEVICE_KEYS
    pods = dev.pop("pods")
    assert [(p["kind"], p["opens"], p["fix"] is not None) for p in pods] == [
        ("root", "yes", False), ("non-root", "yes", False), ("non-root-with-group", "yes", False),
        ("non-root-cdi", "no", True), ("user-namespace", "no", True)]  # the fake node is not the host's /dev/kvm
    assert dev == dict(resource="ate.dev/kvm", path="/dev/kvm", host_path=f"{node.dev}/kvm", present=True,
                       type="char device 1:3", units=1024, device_number="1:3", uid=0, gid=0, owner="root:root",
                       mode="0666", non_root="yes", char_link=f"{node.dev}/char/1:3",
                       nodes=[dict(id=None, path="/dev/kvm", host_path=f"{node.dev}/kvm", role="node", device_number="1:3",
                                   numa=[], pci=[], present=True, allowed=True, state="ok")])
    for f in doc["findings"]:
        assert set(f) == FINDING_KEYS and f["status"] in ("ok", "problem", "warning"), f
    assert {f["check"] for f in doc["findings"]} == {"device", "char-link", "non-root", "pod-kind", "plugin-dir",
                                                    "sandbox", "metrics", "kubelet-socket", "kubelet-version"}
    assert all(f["status"] == "ok" for f in doc["findings"] if f["check"] not in ("pod-kind", "kubelet-version")), doc["findings"]
    # the fake kubelet is this test's own process: a program that names no Kubernetes version
    (version,) = [f for f in doc["findings"] if f["check"] == "kubelet-version"]
    assert version["status"] == "warning" and f"the program of PID {os.getpid()} names no Kubernetes version" in version["message"]
    assert "registers once kubelet has let go" in version["message"] and 'kubelet_endpoints = "per-socket"' in version["fix"]
    assert [f["status"] for f in doc["findings"] if f["check"] == "pod-kind"] == ["ok"] * 3 + ["warning"] * 2
    assert doc["kubelet_view"]["counts"] is None and "no pod-resources API" in doc["kubelet_view"]["note"]
    assert doc["drop_in"] is None


def test_the_same_problems_and_exit_status_as_the_table(node):
    """Two problems (a missing device, no kubelet) and a sandbox that needs a drop-in."""
    cfg = node.cfg(Device("ate.dev/kvm", "/dev/kvm"), Device("ate.dev/fuse", "/dev/fuse", 1))
    unit = {"LoadState": "loaded", "ProtectSystem": "strict", "ReadWritePaths": "-/var/lib/kubelet/device-plugins"}
    code_text, text = run(cfg, unit=unit)
    code, doc = as_json(cfg, unit=unit)
    assert code == code_text == doc["exit_code"] == check.EX_NOT_READY and doc["ready"] is False
    problems = [f for f in doc["findings"] if f["status"] == "problem"]
    assert len(problems) == len(problems_in_text(text)) == 3, text
    assert {(f["check"], f["subject"]) for f in problems} == {
        ("device", "ate.dev/fuse"), ("sandbox", "atedevd.service"), ("kubelet-socket", f"{node.dp}/kubelet.sock")}
    for f, line in zip(problems, problems_in_text(text)):
        assert line.endswith(f["message"]), (line, f)
    sandbox = next(f for f in problems if f["check"] == "sandbox")
    assert sandbox["fix"].startswith(f"install the drop-in as {check.DROP_IN}") and doc["drop_in"] == check.drop_in(node.dp)
    fuse = next(d for d in doc["devices"] if d["resource"] == "ate.dev/fuse")
    assert fuse["present"] is False and fuse["type"] == "missing" and fuse["device_number"] is None


def test_process_exit_codes_match(node):
    node.kubelet()
    path = config_file(node)
    for extra in ((), ("--dev-root", os.path.join(node.root, "nowhere"))):
        table, js = atedevd("check", "--config", path, *extra), atedevd("check", "--json", "--config", path, *extra)
        doc = json.loads(js.stdout)
        assert js.returncode == table.returncode == doc["exit_code"], (table.stdout, js.stdout)
    assert doc["exit_code"] == 1 and doc["ready"] is False


def test_process_invalid_config_is_78_and_a_document(node):
    path = os.path.join(node.root, "bad.toml")
    with open(path, "w") as f:
        f.write('[daemon]\nlog_level = "loud"\n')
    p = atedevd("check", "--json", "--config", path)
    assert p.returncode == 78
    doc = json.loads(p.stdout)
    assert doc["schema"] == "atedevd-check/v1" and doc["exit_code"] == 78 and doc["ready"] is False
    assert len(doc["config_errors"]) == 1 and "log_level" in doc["config_errors"][0]
    assert "log_level" in p.stderr  # people still read stderr


# --- /dev/char/MAJOR:MINOR ------------------------------------------------------------------------


def test_a_missing_char_link_is_a_warning_with_the_fix(node):
    node.kubelet()
    os.unlink(os.path.join(node.dev, "char", "1:3"))
    code, text = run(node.cfg())
    assert code == check.EX_READY, text  # said, not a reason to refuse the node
    link = f"{node.dev}/char/1:3"
    assert (f"  - ate.dev/kvm: {link} is missing\n"
            f"    fix: udevadm trigger --action=add {node.dev}/kvm (udev makes the link), or: ln -s ../kvm {link}\n") in text
    assert "DeviceAllow=/dev/char/MAJOR:MINOR, applied again on every systemctl daemon-reload" in text
    code, doc = as_json(node.cfg())
    [f] = [f for f in doc["findings"] if f["check"] == "char-link"]
    assert f["status"] == "warning" and f["subject"] == "ate.dev/kvm" and f["message"] == f"{link} is missing"
    assert f["fix"].endswith(f"ln -s ../kvm {link}")
    assert doc["ready"] is True and code == 0


def test_the_fix_makes_the_link_that_check_accepts(node):
    os.unlink(os.path.join(node.dev, "char", "1:3"))
    _, doc = as_json(node.cfg())
    [f] = [f for f in doc["findings"] if f["check"] == "char-link"]
    target, link = f["fix"].split("ln -s ", 1)[1].split()
    os.symlink(target, link)
    _, doc = as_json(node.cfg())
    [f] = [f for f in doc["findings"] if f["check"] == "char-link"]
    assert f["status"] == "ok", f


def test_a_char_link_to_another_device_is_a_warning(node):
    os.unlink(os.path.join(node.dev, "char", "1:3"))
    os.symlink("/dev/zero", os.path.join(node.dev, "char", "1:3"))  # 1:5, not 1:3
    ok, text, fix = check.char_link_state(node.dev, os.path.join(node.dev, "kvm"), os.stat(os.path.join(node.dev, "kvm")))
    assert not ok and text == f"{node.dev}/char/1:3 does not lead to {node.dev}/kvm"
    assert fix == f"ln -sfn ../kvm {node.dev}/char/1:3"


def test_agrees_with_this_machines_own_dev():
    """/dev/null on the real /dev: the link is judged present exactly when it is there."""
    st = os.stat("/dev/null")
    ok, text, _ = check.char_link_state("/dev", "/dev/null", st)
    assert ok == os.path.exists("/dev/char/1:3"), text


@needs_root
def test_check_lists_every_node_and_a_missing_companion_is_a_problem(tmp_path):
    dev = tmp_path / "dev"
    vfio_nodes(dev, 12, 13)
    os.unlink(dev / "vfio" / "vfio")
    cfg = load(tmp_path, '[[device]]\nresource = "a.dev/v"\npath = "/dev/vfio/[0-9]*"\ncompanions = ["/dev/vfio/vfio"]\n'
                         '[[device]]\nresource = "a.dev/kvm"\npath = "/dev/kvm"\ncompanions = ["/dev/vhost-net"]\n',
               dev_root=dev)
    mknod(dev, "kvm", 10, 232)

    def doc():
        out = io.StringIO()
        check.run(cfg, out, unit=lambda: None, as_json=True)
        return json.loads(out.getvalue())

    found = doc()
    vfio, kvm = found["devices"]
    assert [(n["id"], n["role"], n["device_number"], n["present"]) for n in vfio["nodes"]] == [
        ("vfio-12", "unit", "243:0", True), ("vfio-13", "unit", "243:1", True), (None, "companion", None, False)]
    assert vfio["units"] == 0 and kvm["nodes"][1]["role"] == "companion" and not kvm["nodes"][1]["present"]
    problems = {(f["subject"], f["message"]) for f in found["findings"] if f["status"] == "problem" and f["check"] == "device"}
    assert problems == {("a.dev/v", f"companion {dev}/vfio/vfio: missing"), ("a.dev/kvm", f"companion {dev}/vhost-net: missing")}
    mknod(dev, "vfio/vfio", 10, 196)
    mknod(dev, "vhost-net", 10, 238)
    found = doc()
    assert found["devices"][0]["units"] == 2
    assert not [f for f in found["findings"] if f["check"] == "device" and f["status"] != "ok"], found["findings"]
