"""More devices, health both ways, hot-plug and reload: the daemon as a process."""

import os
import re
import signal

import grpc
import pytest

from tests.harness import RESOURCE, plugin_sockets, wait_until

KVM_VHOST_FUSE = """
[[device]]
resource = "ate.dev/kvm"
path = "/dev/kvm"

[[device]]
resource = "ate.dev/vhost-net"
path = "/dev/vhost-net"
count = 64
permissions = "rwm"

[[device]]
resource = "ate.dev/fuse"
path = "/dev/fuse"
count = 8
"""


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def node(dev_root, name, target="/dev/null"):
    path = os.path.join(dev_root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(target, path)
    return path


def health(kubelet, resource):
    return set(kubelet.devices(resource).values())


def test_several_devices_each_registered_on_its_own_socket(start_daemon, kubelet, dev_root, plugin_dir, tmp_path):
    node(dev_root, "vhost-net")
    node(dev_root, "fuse")
    d = start_daemon(config=write(tmp_path / "c.toml", KVM_VHOST_FUSE))
    d.wait_ready()
    for resource, count in (("ate.dev/kvm", 4096), ("ate.dev/vhost-net", 64), ("ate.dev/fuse", 8)):
        assert kubelet.wait_connected(resource), d.log()
        assert wait_until(lambda: kubelet.capacity(resource) == count, 5)
    endpoints = sorted(re.sub(r"^(ate\.dev_[a-z-]+)\.[a-z0-9]+-[0-9]+\.sock$", r"\1.sock", r["endpoint"]) for r in kubelet.registrations)
    assert endpoints == ["ate.dev_fuse.sock", "ate.dev_kvm.sock", "ate.dev_vhost-net.sock"]  # one name per registration
    (spec,) = kubelet.allocate("ate.dev/vhost-net", ["vhost-net-3"]).container_responses[0].devices
    assert (spec.host_path, spec.container_path, spec.permissions) == ("/dev/vhost-net", "/dev/vhost-net", "rwm")
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate("ate.dev/fuse", ["fuse-8"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'fuse-8'" in e.value.details()
    assert wait_until(lambda: "ate.dev/fuse: registered, 8/8 healthy" in (d.status() or ""), 5), d.status()


def test_removed_node_goes_unhealthy_and_back_healthy_registration_kept(daemon, kubelet, dev_root):
    kvm = os.path.join(dev_root, "kvm")
    for _ in range(3):
        os.unlink(kvm)
        assert kubelet.wait(lambda: health(kubelet, RESOURCE) == {"Unhealthy"}, 5), daemon.log()
        assert kubelet.capacity(RESOURCE) == 0 and len(kubelet.devices(RESOURCE)) == 4096
        with pytest.raises(grpc.RpcError) as e:
            kubelet.allocate(RESOURCE, ["kvm-0"])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert wait_until(lambda: "0/4096 healthy" in (daemon.status() or ""), 5), daemon.status()
        os.symlink("/dev/null", kvm)
        assert kubelet.wait(lambda: health(kubelet, RESOURCE) == {"Healthy"}, 5), daemon.log()
    assert kubelet.registration_count(RESOURCE) == 1  # the stream carried it; no re-registration
    assert "is missing" in daemon.log() and "present again" in daemon.log()


def test_device_missing_at_start_is_not_advertised_until_it_appears(start_daemon, kubelet, tmp_path, plugin_dir):
    empty_dev = str(tmp_path / "emptydev")
    os.makedirs(empty_dev)
    d = start_daemon(dev_root=empty_dev)
    d.wait_ready()
    assert wait_until(lambda: "missing, not advertised" in (d.status() or ""), 5), d.status()
    assert plugin_sockets(plugin_dir, RESOURCE) == []
    assert kubelet.registration_count(RESOURCE) == 0
    node(empty_dev, "kvm")
    assert kubelet.wait_connected(RESOURCE, timeout=5), d.log()
    assert kubelet.capacity(RESOURCE) == 4096
    assert "appeared" in d.log()


def test_device_in_a_subdirectory_created_later(start_daemon, kubelet, dev_root, tmp_path):
    cfg = write(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/tun"\npath = "/dev/net/tun"\n')
    d = start_daemon(config=cfg)
    d.wait_ready()
    assert not os.path.exists(os.path.join(dev_root, "net"))
    node(dev_root, "net/tun")  # the directory and the node appear together
    assert kubelet.wait_connected("ate.dev/tun", timeout=5), d.log()
    assert sorted(kubelet.devices("ate.dev/tun"))[:2] == ["tun-0", "tun-1"]


def test_a_regular_file_is_not_a_device(start_daemon, kubelet, tmp_path, plugin_dir):
    dev = str(tmp_path / "filedev")
    os.makedirs(dev)
    write(os.path.join(dev, "kvm"), "not a device")
    d = start_daemon(dev_root=dev)
    d.wait_ready()
    assert wait_until(lambda: "not a character device" in d.log(), 5), d.log()
    assert "WARNING" in d.log()
    assert kubelet.registration_count(RESOURCE) == 0
    os.unlink(os.path.join(dev, "kvm"))
    node(dev, "kvm")
    assert kubelet.wait_connected(RESOURCE, timeout=5), d.log()


# --- reload ------------------------------------------------------------------------------


def reload(d):
    n = len(d.notify.messages)
    d.send(signal.SIGHUP)
    reloading = d.notify.wait_for("RELOADING", "1", timeout=5, after=n)
    assert reloading and int(reloading["fields"]["MONOTONIC_USEC"]) > 0
    assert d.notify.wait_for("READY", "1", timeout=5, after=n)


def test_reload_adds_removes_and_leaves_unchanged_alone(start_daemon, kubelet, dev_root, plugin_dir, tmp_path):
    node(dev_root, "vhost-net")
    node(dev_root, "fuse")
    cfg = tmp_path / "c.toml"
    write(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
               '[[device]]\nresource = "ate.dev/fuse"\npath = "/dev/fuse"\n')
    d = start_daemon(config=str(cfg))
    d.wait_ready()
    assert kubelet.wait_connected(RESOURCE) and kubelet.wait_connected("ate.dev/fuse"), d.log()
    kvm_client = kubelet.clients[RESOURCE]

    write(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
               '[[device]]\nresource = "ate.dev/vhost-net"\npath = "/dev/vhost-net"\n')
    reload(d)
    assert kubelet.wait_connected("ate.dev/vhost-net", timeout=5), d.log()
    assert plugin_sockets(plugin_dir, "ate.dev/fuse") == []
    assert kubelet.wait(lambda: kubelet.capacity("ate.dev/fuse") == 0, 5)
    # unchanged: no new registration, the same stream still open
    assert kubelet.registration_count(RESOURCE) == 1
    assert kubelet.clients[RESOURCE] is kvm_client and kvm_client.connected
    assert kubelet.allocate(RESOURCE, ["kvm-0"]).container_responses[0].devices[0].host_path == "/dev/kvm"


def test_reload_with_a_changed_device_restarts_only_that_one(start_daemon, kubelet, dev_root, tmp_path):
    node(dev_root, "fuse")
    cfg = tmp_path / "c.toml"
    base = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n[[device]]\nresource = "ate.dev/fuse"\npath = "/dev/fuse"\n'
    write(cfg, base + "count = 4\n")
    d = start_daemon(config=str(cfg))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/fuse") and kubelet.wait_connected(RESOURCE)
    write(cfg, base + "count = 16\n")
    reload(d)
    assert kubelet.wait(lambda: kubelet.capacity("ate.dev/fuse") == 16, 5), d.log()
    assert kubelet.registration_count(RESOURCE) == 1


def test_invalid_reload_keeps_the_running_config_and_says_so(start_daemon, kubelet, tmp_path, plugin_dir):
    cfg = tmp_path / "c.toml"
    write(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    d = start_daemon(config=str(cfg))
    d.wait_ready()
    assert kubelet.wait_connected(RESOURCE)
    write(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "dev/kvm"\ncolor = "blue"\n')
    reload(d)
    assert wait_until(lambda: "reload failed" in (d.status() or ""), 5), d.status()
    log = d.log()
    assert "ERROR" in log and str(cfg) in log and "path" in log and "color" in log
    assert d.proc.poll() is None
    assert kubelet.registration_count(RESOURCE) == 1 and kubelet.capacity(RESOURCE) == 4096
    assert plugin_sockets(plugin_dir, RESOURCE)
    write(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
    reload(d)  # fixed: the failure note goes away
    assert wait_until(lambda: "reload failed" not in (d.status() or "reload failed"), 5), d.status()
