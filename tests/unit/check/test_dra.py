"""`atedevd check` in DRA mode, against the API server stand-in: each finding, ok and not."""

import os

from atedevd.check import report as check
from atedevd.config import Config
from atedevd.dra.slices import device_class, slices, DraDevice
from rig.apiserver_standin import ApiServerStandIn
from rig.harness import fake_dev_root


def findings(tmp_path, api, props=None, **cfg):
    kubeconfig = api.kubeconfig(str(tmp_path / "kc.json"))
    os.makedirs(tmp_path / "kubelet" / "device-plugins", exist_ok=True)
    c = Config(api="dra", kubeconfig=kubeconfig, device_plugin_dir=str(tmp_path / "kubelet" / "device-plugins"),
               dev_root=fake_dev_root(str(tmp_path / "dev")) if not (tmp_path / "dev").exists() else str(tmp_path / "dev"),
               cdi_spec_dir=str(tmp_path / "cdi"), **cfg)
    report = check.collect(c, lambda: props, runtimes=lambda: [])
    return report, {(f.check, f.subject): f for f in report.findings if f.check.startswith("dra-")}


def test_a_node_not_switched_yet_is_not_ready_and_each_reason_is_named(tmp_path):
    api = ApiServerStandIn("node-a")
    try:
        api.node_status["allocatable"] = {"ate.dev/kvm": "1024"}
        report, f = findings(tmp_path, api, props={"ProtectSystem": "strict", "PrivateNetwork": "yes",
                                                   "ReadWritePaths": "-/var/lib/kubelet/device-plugins -/run/cdi"})
        assert report.exit_code == check.EX_NOT_READY
        assert f[("dra-credentials", str(tmp_path / "kc.json"))].message == "system:node:node-a (node node-a)"
        assert "still counts ate.dev/kvm as a device plugin's (allocatable 1024)" in f[("dra-switch", "ate.dev/kvm")].message
        assert f[("dra-class", "kvm.ate.dev")].status == "problem" and "device-classes" in f[("dra-class", "kvm.ate.dev")].fix
        assert f[("dra-slices", "node-a")].status == "problem"
        assert f[("dra-sandbox", "network")].status == "problem"
        assert f[("dra-sandbox", "restarts")].status == "warning" and "FileDescriptorStoreMax=0" in \
            f[("dra-sandbox", "restarts")].message
        assert f[("dra-kubelet", "node-a")].status == "ok"
        assert not any(x.check in ("kubelet-socket", "plugin-dir") for x in report.findings), "device-plugin checks ran"
    finally:
        api.close()


def test_a_switched_node_with_its_class_and_slice_is_ready(tmp_path):
    api = ApiServerStandIn("node-a")
    try:
        api.device_classes["kvm.ate.dev"] = device_class("ate.dev/kvm")
        [doc] = slices("node-a", api.node_uid, [DraDevice("kvm", "ate.dev/kvm", "/dev/kvm", True, ("ate.dev/kvm=kvm",))], 3)
        api.slices[doc["metadata"]["name"]] = dict(doc, metadata=dict(doc["metadata"], resourceVersion="5"))
        report, f = findings(tmp_path, api)
        bad = [(x.check, x.subject, x.message) for x in report.findings if x.status == "problem"]
        assert [b for b in bad if b[0].startswith("dra-")] == [], bad
        assert f[("dra-slices", "node-a")].message == "1 device(s) published (kvm), pool generation 3"
        api.node_status["nodeInfo"]["kubeletVersion"] = "v1.33.4"
        _, f = findings(tmp_path, api)
        assert f[("dra-kubelet", "node-a")].status == "problem"
    finally:
        api.close()


def test_no_kubeconfig_is_a_problem_that_names_the_key(tmp_path):
    c = Config(api="dra", kubeconfig=str(tmp_path / "missing.conf"), device_plugin_dir=str(tmp_path / "device-plugins"),
               dev_root=fake_dev_root(str(tmp_path / "dev")), cdi_spec_dir=str(tmp_path / "cdi"))
    report = check.collect(c, lambda: None, runtimes=lambda: [])
    [f] = [x for x in report.findings if x.check == "dra-credentials"]
    assert f.status == "problem" and "no such file" in f.message and "[daemon] kubeconfig" in f.fix
