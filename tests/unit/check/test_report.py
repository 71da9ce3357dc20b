"""`atedevd check` / `check-config`: the table a human reads and the exit status a script reads."""

import io
import os
import re
import stat

import pytest

from atedevd import config
from atedevd.check import report as check
from atedevd.config import Device
from rig.harness import REPO
from tests.unit.check.fake_node import atedevd, config_file, run


def test_all_present_and_kubelet_accepting(node):
    node.kubelet()
    code, out = run(node.cfg())
    assert code == check.EX_READY == 0
    w = len(node.dev) + 4
    assert out == (
        "config: built-in defaults\n"
        f"dev root: {node.dev}\n"
        "\n"
        f"RESOURCE     PATH      {'HOST PATH'.ljust(w)}  PRESENT  TYPE             UNITS\n"
        f"ate.dev/kvm  /dev/kvm  {node.dev}/kvm  yes      char device 1:3  1024 (kvm-0..kvm-1023)\n"
        "\n"
        "Inside a container a device node keeps its host owner and mode, so a pod that runs as a\n"
        "non-root user opens it only if that mode lets it (a root pod always can):\n"
        f"RESOURCE     {'HOST PATH'.ljust(w)}  OWNER      MODE  NON-ROOT CONTAINER CAN OPEN IT\n"
        f"ate.dev/kvm  {node.dev}/kvm  root:root  0666  yes\n"
        "\n"
        "Which pods can open ate.dev/kvm (/dev/kvm):\n"
        "POD KIND                    OPENS IT  WHY\n"
        "root                        yes       root in the host's user namespace opens any node the device cgroup allows\n"
        f"non-root                    yes       {node.dev}/kvm is 0666 root:root: others may open it\n"
        f"non-root, the node's group  yes       {node.dev}/kvm is 0666 root:root: with supplementalGroups: [0] (the node's gid)\n"
        "non-root, through CDI       no        cdi = false: answers carry the DeviceSpec alone\n"
        "user namespace              no        runc bind-mounts the host's /dev/kvm (the container path), which is "
        f"{'another node' if os.path.exists('/dev/kvm') else 'missing'}, not {node.dev}/kvm\n"
        "  fix for non-root, through CDI: [daemon] cdi = true (containerd 1.7 with enable_cdi = true, containerd 2.x, CRI-O)\n"
        "  fix for user namespace: serve the node at the path pods see: /dev/kvm on the host\n"
        "\n"
        f"plugin dir    {node.dp.ljust(len(node.sock))}  present\n"
        f"sandbox       {'atedevd.service'.ljust(len(node.sock))}  unknown (atedevd.service is not loaded here)\n"
        f"kubelet.sock  {node.sock}  accepting connections\n"
        "\n"
        f"kubelet's view: no pod-resources API at {node.root}/pod-resources/kubelet.sock; not shown\n"
        "\n"
        "READY: this node can serve ate.dev/kvm\n")


def test_missing_device(node):
    node.kubelet()
    code, out = run(node.cfg(Device("ate.dev/kvm", "/dev/kvm"), Device("ate.dev/vhost-net", "/dev/vhost-net", 2)))
    assert code == check.EX_NOT_READY == 1
    row = next(line for line in out.splitlines() if line.startswith("ate.dev/vhost-net"))
    assert row.split() == ["ate.dev/vhost-net", "/dev/vhost-net", f"{node.dev}/vhost-net", "no", "missing",
                           "2", "(vhost-net-0..vhost-net-1)"]
    assert out.endswith("NOT READY: this node cannot serve every configured resource (1 problem):\n"
                        f"  - ate.dev/vhost-net: {node.dev}/vhost-net: missing\n")


def test_dangling_symlink_is_missing(node):
    node.kubelet()
    os.symlink("/nonexistent-device", os.path.join(node.dev, "fuse"))
    code, out = run(node.cfg(Device("ate.dev/fuse", "/dev/fuse", 1)))
    assert code == 1
    assert f"  - ate.dev/fuse: {node.dev}/fuse: missing\n" in out


def test_regular_file_is_not_a_char_device(node):
    node.kubelet()
    open(os.path.join(node.dev, "fuse"), "w").close()
    code, out = run(node.cfg(Device("ate.dev/kvm", "/dev/kvm"), Device("ate.dev/fuse", "/dev/fuse", 1)))
    assert code == 1
    row = next(line for line in out.splitlines() if line.startswith("ate.dev/fuse"))
    assert " yes      regular file, not a char device  1 (fuse-0)" in row
    assert f"  - ate.dev/fuse: {node.dev}/fuse: regular file, not a char device\n" in out


def test_nested_device_path_is_looked_up_under_dev_root(node):
    node.kubelet()
    os.mkdir(os.path.join(node.dev, "net"))
    os.symlink("/dev/null", os.path.join(node.dev, "net", "tun"))
    code, out = run(node.cfg(Device("ate.dev/tun", "/dev/net/tun")))
    assert code == 0
    assert f"ate.dev/tun  /dev/net/tun  {node.dev}/net/tun  yes      char device 1:3" in out


def test_directory_in_place_of_a_device(node):
    node.kubelet()
    os.mkdir(os.path.join(node.dev, "vfio"))
    code, out = run(node.cfg(Device("ate.dev/vfio", "/dev/vfio")))
    assert code == 1
    assert f"  - ate.dev/vfio: {node.dev}/vfio: directory, not a char device\n" in out


@pytest.mark.parametrize("listen, close", [(True, True), (False, False)], ids=["bound-then-closed", "not-listening"])
def test_stale_kubelet_sock(node, listen, close):
    node.kubelet(listen=listen, close=close)
    code, out = run(node.cfg())
    assert code == 1
    assert f"kubelet.sock  {node.sock}  stale: refusing connections (kubelet not running)\n" in out
    assert out.endswith("(1 problem):\n  - kubelet.sock: stale: refusing connections (kubelet not running)\n")


def test_no_kubelet_sock(node):
    code, out = run(node.cfg())
    assert code == 1
    assert "(kubelet not running, or another device plugin directory)" in out
    assert f"plugin dir    {node.dp.ljust(len(node.sock))}  present\n" in out


def test_no_plugin_dir_and_missing_device_both_reported(node):
    os.rmdir(node.dp)
    os.unlink(os.path.join(node.dev, "kvm"))
    code, out = run(node.cfg())
    assert code == 1
    assert f"plugin dir    {node.dp.ljust(len(node.sock))}  missing\n" in out
    assert out.endswith("(2 problems):\n"
                        f"  - ate.dev/kvm: {node.dev}/kvm: missing\n"
                        "  - kubelet.sock: missing (kubelet not running, or another device plugin directory)\n")


def test_kubelet_sock_that_is_not_a_socket(node):
    open(node.sock, "w").close()
    assert check.socket_state(node.sock) == (False, "not a socket (regular file)")


def test_socket_state_accepting(node):
    node.kubelet()
    assert check.socket_state(node.sock) == (True, "accepting connections")


def test_device_state_char_device():
    assert check.device_state("/dev/null") == ("yes", "char device 1:3", True)


# --- check-config -----------------------------------------------------------

def test_check_config_ok(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
                    '[[device]]\nresource = "ate.dev/fuse"\npath = "/dev/fuse"\n')
    out = io.StringIO()
    assert check.check_config(str(path), out, required=True) == 0
    assert out.getvalue() == f"config OK: {path}, 2 devices\n"


def test_check_config_default_missing(tmp_path):
    out = io.StringIO()
    assert check.check_config(str(tmp_path / "none.toml"), out) == 0
    assert out.getvalue() == f"config OK: built-in defaults ({tmp_path}/none.toml not found), 1 device\n"


def test_check_config_invalid(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[daemon]\nlog_level = "loud"\n[[device]]\nresource = "kvm"\npath = "/dev/kvm"\n')
    out, err = io.StringIO(), io.StringIO()
    assert check.check_config(str(path), out, err=err) == config.EX_CONFIG == 78
    assert out.getvalue() == ""
    assert err.getvalue() == (
        f'{path}:2: [daemon] log_level: must be one of debug, info, warning, error, got "loud"\n'
        f'{path}:4: [[device]] #1 resource: "kvm" must be <domain>/<name> with exactly one "/", e.g. "ate.dev/kvm"\n'
        "config INVALID: 2 errors\n")


# --- as a process, the way an operator or a provisioning script runs it -----



def test_process_ready(node):
    node.kubelet()
    p = atedevd("check", "--config", config_file(node))
    assert p.returncode == 0, p.stderr
    assert p.stdout.endswith("READY: this node can serve ate.dev/kvm\n")


def test_process_missing_device(node):
    node.kubelet()
    p = atedevd("check", "--config", config_file(node, '[[device]]\nresource = "ate.dev/fuse"\npath = "/dev/fuse"\n'))
    assert p.returncode == 1
    assert f"  - ate.dev/fuse: {node.dev}/fuse: missing\n" in p.stdout


def test_process_regular_file(node):
    node.kubelet()
    open(os.path.join(node.dev, "fuse"), "w").close()
    p = atedevd("check", "--config", config_file(node, '[[device]]\nresource = "ate.dev/fuse"\npath = "/dev/fuse"\n'))
    assert p.returncode == 1
    assert "regular file, not a char device" in p.stdout


def test_process_stale_and_absent_kubelet_sock(node):
    path = config_file(node)
    p = atedevd("check", "--config", path)
    assert p.returncode == 1 and "kubelet.sock: missing" in p.stdout
    node.kubelet(close=True)
    p = atedevd("check", "--config", path)
    assert p.returncode == 1 and "kubelet.sock: stale: refusing connections" in p.stdout


def test_process_flags_override_the_file(node):
    node.kubelet()
    path = config_file(node)
    other = os.path.join(node.root, "empty-dev")
    os.mkdir(other)
    p = atedevd("check", "--config", path, "--dev-root", other)
    assert p.returncode == 1 and f"  - ate.dev/kvm: {other}/kvm: missing\n" in p.stdout


def test_process_invalid_config_is_ex_config(node):
    path = config_file(node, "count = 0\n")
    p = atedevd("check", "--config", path)
    assert p.returncode == 78
    assert f"{path}:7: [[device]] #1 count: must be between 1 and 65536, got 0" in p.stderr
    p = atedevd("check-config", "--config", path)
    assert p.returncode == 78
    assert f"{path}:7: [[device]] #1 count: must be between 1 and 65536, got 0" in p.stderr


def test_process_check_config_ok(node):
    p = atedevd("check-config", "--config", config_file(node))
    assert p.returncode == 0 and p.stdout.startswith("config OK: ")


# --- non-root containers: the host's owner and mode decide -------------------------------

def mknod(node, name, mode, uid=0, gid=0):
    """A real character device node (1:3, as /dev/null) with the given owner and mode (needs root)."""
    path = os.path.join(node.dev, name)
    if os.path.lexists(path):
        os.unlink(path)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and chown need root")


@needs_root
@pytest.mark.parametrize("mode, uid, gid, permissions, verdict", [
    (0o600, 0, 0, "rw", "no"),
    (0o660, 0, 4242, "rw", "only with supplementalGroups: [4242]"),
    (0o666, 0, 0, "rw", "yes"),
    (0o644, 0, 0, "r", "yes"),
    (0o644, 0, 0, "rw", "no"),
    (0o640, 0, 4242, "r", "only with supplementalGroups: [4242]"),
    (0o600, 4343, 0, "rw", "only with runAsUser: 4343"),
    (0o000, 0, 0, "m", "yes"),
])
def test_non_root_verdict_from_owner_and_mode(node, mode, uid, gid, permissions, verdict):
    node.kubelet()
    mknod(node, "kvm", mode, uid, gid)
    code, out = run(node.cfg(Device("ate.dev/kvm", "/dev/kvm", permissions=permissions)))
    assert code == 0  # a root pod needs nothing: not a readiness problem
    row = next(line for line in out.splitlines() if line.startswith("ate.dev/kvm") and "NON-ROOT" not in line
               and f"{mode:04o}" in line)
    owner = f"{check._user(uid)}:{check._group(gid)}"
    assert row.split(None, 4) == ["ate.dev/kvm", f"{node.dev}/kvm", owner, f"{mode:04o}", verdict]
    fixes = "For non-root pods, do one of:" in out
    assert fixes == (verdict != "yes"), out


@needs_root
def test_non_root_fixes_name_the_runtime_option_and_the_group(node):
    node.kubelet()
    mknod(node, "kvm", 0o660, 0, 4242)
    _, out = run(node.cfg())
    assert '[plugins."io.containerd.grpc.v1.cri"]   device_ownership_from_security_context = true' in out
    assert "[crio.runtime]" in out and "device_ownership_from_security_context = true" in out
    assert "securityContext.supplementalGroups: [4242]" in out
    mknod(node, "kvm", 0o600)
    _, out = run(node.cfg())
    assert "securityContext.supplementalGroups: [<the node's gid>]" in out


def test_non_root_section_leaves_out_missing_devices(node):
    node.kubelet()
    _, out = run(node.cfg(Device("ate.dev/fuse", "/dev/fuse")))
    assert "NON-ROOT CONTAINER" not in out


# --- the plugin directory in the unit's sandbox ---------------------------------------------

K0S = "/var/lib/k0s/kubelet/device-plugins"
DEFAULT_UNIT = {"LoadState": "loaded", "ProtectSystem": "strict", "ReadWritePaths": "-/var/lib/kubelet/device-plugins"}
K0S_UNIT = dict(DEFAULT_UNIT, ReadWritePaths=f"-{K0S}")


@pytest.mark.parametrize("plugin_dir, unit, ok", [
    ("/var/lib/kubelet/device-plugins", DEFAULT_UNIT, True),
    (K0S, DEFAULT_UNIT, False),
    (K0S, K0S_UNIT, True),
    (K0S, dict(DEFAULT_UNIT, ReadWritePaths="/var/lib/k0s"), True),  # a parent is writable
    (K0S, dict(DEFAULT_UNIT, ReadWritePaths="/var/lib/k0s/kubelet/device"), False),  # a prefix, not a parent
    (K0S, dict(DEFAULT_UNIT, ProtectSystem="full"), True),  # /var is not read-only then
    (K0S, None, True),  # no unit: nothing to say
])
def test_sandbox_state(plugin_dir, unit, ok):
    assert check.sandbox_state(plugin_dir, unit)[0] is ok


def test_plugin_dir_read_only_in_the_sandbox_prints_the_drop_in(node):
    node.kubelet()
    code, out = run(node.cfg(), unit=DEFAULT_UNIT)  # node.dp is not under ReadWritePaths=
    assert code == 1
    assert f"  - plugin dir: {node.dp} is read-only in atedevd.service's sandbox" in out
    drop_in = out[out.index("# /etc/systemd/system/atedevd.service.d/kubelet-root.conf"):]
    assert drop_in == check.drop_in(node.dp)
    assert f"ReadWritePaths=-{node.dp}\n" in drop_in and f"ExecStartPre=-+/bin/mkdir -p -m 0750 /run/cdi {node.dp}\n" in drop_in
    assert "ReadWritePaths=-/run/cdi\n" in drop_in
    code, out = run(node.cfg(), unit=dict(DEFAULT_UNIT, ReadWritePaths=f"-{node.dp}"))
    assert code == 0 and "kubelet-root.conf" not in out


def test_plugin_dir_not_writable_at_all(node, monkeypatch):
    node.kubelet()
    real = os.access
    monkeypatch.setattr(check.os, "access", lambda p, m: False if p == node.dp else real(p, m))
    code, out = run(node.cfg())
    assert code == 1 and f"  - plugin dir: {node.dp} is not writable (a read-only mount?)" in out


# --- metrics ------------------------------------------------------------------------------


def test_metrics_state(tmp_path, monkeypatch):
    here = str(tmp_path / "textfile")
    os.makedirs(here)
    unit_rw = dict(DEFAULT_UNIT, ReadWritePaths=f"-/var/lib/kubelet/device-plugins -{here}")
    assert check.metrics_state("", None) == (check.OK, "off (metrics_dir is empty)")
    assert check.metrics_state(here, None) == (check.OK, f"atedevd.prom is written to {here}")
    assert check.metrics_state(here, unit_rw)[0] == check.OK
    status, text = check.metrics_state(here, DEFAULT_UNIT)  # ProtectSystem=strict, not listed
    assert status == check.WARNING and f"{here} is read-only in atedevd.service's sandbox" in text
    status, text = check.metrics_state(str(tmp_path / "gone"), None)
    assert status == check.WARNING and "is missing: atedevd.prom is not written" in text
    real = os.access
    monkeypatch.setattr(check.os, "access", lambda p, m: False if p == here else real(p, m))
    status, text = check.metrics_state(here, None)
    assert status == check.WARNING and f"{here} is not writable" in text


def test_unwritable_metrics_are_a_warning_not_a_problem(node, tmp_path):
    node.kubelet()
    code, out = run(node.cfg(metrics_dir=str(tmp_path / "no-such-dir")))
    assert code == check.EX_READY
    assert f"WARNING: metrics: {tmp_path / 'no-such-dir'} is missing: atedevd.prom is not written\n" in out
    assert "fix: set metrics_dir in" in out and "READY: this node can serve" in out
    code, out = run(node.cfg(metrics_dir=""))
    assert code == check.EX_READY and "metrics" not in out


def test_shipped_drop_in_example_is_what_check_prints():
    with open(os.path.join(REPO, "systemd/atedevd.service.d/kubelet-root.conf.example")) as f:
        assert f.read() == check.drop_in(K0S)


# --- kubelet's own view, through pod-resources ------------------------------------------


class PodResources:
    """A pod-resources server that lists `counts[resource]` allocatable IDs."""

    def __init__(self, node, counts):
        from concurrent import futures

        import grpc

        from atedevd.api import pod_resources_handler

        self.counts = counts
        path = os.path.join(node.root, "pod-resources", "kubelet.sock")
        os.makedirs(os.path.dirname(path))
        self.server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[pod_resources_handler(self)])
        self.server.add_insecure_port("unix:" + path)
        self.server.start()

    def GetAllocatableResources(self, request, context):
        from atedevd.api import prpb

        return prpb.AllocatableResourcesResponse(devices=[
            prpb.ContainerDevices(resource_name=r, device_ids=[f"x-{i}"]) for r, n in self.counts.items() for i in range(n)])

    def List(self, request, context):
        from atedevd.api import prpb

        return prpb.ListPodResourcesResponse()


def test_kubelet_view_matches(node):
    node.kubelet()
    pr = PodResources(node, {"ate.dev/kvm": 1024, "other.io/x": 2})
    try:
        code, out = run(node.cfg())
    finally:
        pr.server.stop(None)
    assert "kubelet's view (pod-resources " in out
    assert re.search(r"ate\.dev/kvm +1024 +1024 +match\n", out), out
    assert code == 0, out


def test_kubelet_view_mismatch_is_a_problem(node):
    node.kubelet()
    pr = PodResources(node, {})  # kubelet does not count us: not registered, or a stopped endpoint
    try:
        code, out = run(node.cfg())
    finally:
        pr.server.stop(None)
    assert re.search(r"ate\.dev/kvm +1024 +0 +MISMATCH\n", out), out
    assert code == 1
    assert "ate.dev/kvm: kubelet counts 0 allocatable, we advertise 1024 healthy (is atedevd running and registered?)" in out


def test_kubelet_view_absent_is_said_and_not_a_problem(node):
    node.kubelet()
    code, out = run(node.cfg())
    assert f"kubelet's view: no pod-resources API at {os.path.join(node.root, 'pod-resources', 'kubelet.sock')}; not shown" in out
    assert code == 0, out


def test_process_check_shows_kubelet_counting_the_running_daemon(daemon, kubelet, plugin_dir, dev_root, tmp_path):
    """End to end: the daemon registered with the stand-in; `atedevd check` reads kubelet's
    pod-resources and finds its count equal to ours."""
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    p = atedevd("check", "--config", str(cfg), "--device-plugin-dir", plugin_dir, "--dev-root", dev_root)
    assert re.search(r"ate\.dev/kvm +1024 +1024 +match\n", p.stdout), p.stdout + p.stderr
    kubelet.kill()  # kubelet gone: its pod-resources socket is stale, the view cannot be read
    p = atedevd("check", "--config", str(cfg), "--device-plugin-dir", plugin_dir, "--dev-root", dev_root)
    assert "kubelet's view: " in p.stdout and "did not answer" in p.stdout, p.stdout
