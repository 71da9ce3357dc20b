"""`atedevd check` / `check-config`: the table a human reads and the exit status a script reads."""

import io
import os
import shutil
import socket
import subprocess
import tempfile

import pytest

from atedevd import check, config
from atedevd.config import Config, Device


@pytest.fixture
def node():
    """A fake node: dev root with kvm (a char device via /dev/null), and a plugin dir.

    Short paths under /tmp: AF_UNIX socket paths must fit in 108 bytes.
    """
    root = tempfile.mkdtemp(prefix="atedevd-ck")
    os.mkdir(os.path.join(root, "dev"))
    os.mkdir(os.path.join(root, "dp"))
    os.symlink("/dev/null", os.path.join(root, "dev", "kvm"))
    socks = []
    yield Node(root, socks)
    for s in socks:
        s.close()
    shutil.rmtree(root)


class Node:
    def __init__(self, root, socks):
        self.root, self.socks = root, socks
        self.dev = os.path.join(root, "dev")
        self.dp = os.path.join(root, "dp")
        self.sock = os.path.join(self.dp, "kubelet.sock")

    def kubelet(self, listen=True, close=False):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.sock)
        if listen:
            s.listen(8)
        if close:
            s.close()  # the socket file stays behind: what a killed kubelet leaves
        else:
            self.socks.append(s)

    def cfg(self, *devices, **kw):
        return Config(device_plugin_dir=self.dp, dev_root=self.dev,
                      devices=devices or config.DEFAULT_DEVICES, **kw)


def run(cfg):
    out = io.StringIO()
    return check.run(cfg, out), out.getvalue()


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
        f"ate.dev/kvm  /dev/kvm  {node.dev}/kvm  yes      char device 1:3  4096 (kvm-0..kvm-4095)\n"
        "\n"
        f"plugin dir    {node.dp.ljust(len(node.sock))}  present\n"
        f"kubelet.sock  {node.sock}  accepting connections\n"
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def atedevd(*args):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(["/usr/bin/python3", "-m", "atedevd", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def config_file(node, extra=""):
    path = os.path.join(node.root, "config.toml")
    with open(path, "w") as f:
        f.write(f'[daemon]\ndevice_plugin_dir = "{node.dp}"\ndev_root = "{node.dev}"\n'
                '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n' + extra)
    return path


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
