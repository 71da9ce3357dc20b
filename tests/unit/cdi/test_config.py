"""The CDI keys of the configuration, and host_mode on a refused node: every problem at once."""

import os

import pytest

from atedevd.config_file.load import ConfigError, load
from rig.harness import write_file
from rig.nodes import mknod

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and root-owned directories need root (CI runs as root)")


# --- the configuration ---------------------------------------------------------------------------------

def test_cdi_keys_are_checked_all_at_once(tmp_path):
    path = write_file(tmp_path / "c.toml", "\n".join([
        "[daemon]", 'cdi = "yes"', "device_specs = false",
        "[[device]]", 'resource = "ate.dev/3d"', 'path = "/dev/kvm"', "container_mode = 0o777",
        "container_uid = -1", 'container_gid = "kvm"', "host_mode = 0o4666", ""]))
    with pytest.raises(ConfigError) as e:
        load(path)
    text = str(e.value)
    assert f"{path}:2: [daemon] cdi: must be true or false, got string" in text
    assert f"{path}:7: [[device]] #1 container_mode: 0o777 is not a device node's mode" in text
    assert f"{path}:8: [[device]] #1 container_uid: must be between 0 and 4294967294, got -1" in text
    assert f"{path}:9: [[device]] #1 container_gid: must be an integer" in text
    assert f"{path}:10: [[device]] #1 host_mode: 0o4666 is not a device node's mode" in text
    path = write_file(tmp_path / "d.toml", "[daemon]\ndevice_specs = false\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert "device_specs = false needs cdi = true" in str(e.value)
    path = write_file(tmp_path / "e.toml", '[daemon]\ncdi = true\n[[device]]\nresource = "ate.dev/3d"\npath = "/dev/kvm"\n'
                 '[[device]]\nresource = "ate.dev/a.b"\npath = "/dev/a"\n[[device]]\nresource = "ate.dev/a_b"\npath = "/dev/b"\n')
    with pytest.raises(ConfigError) as e:
        load(path)
    assert '[[device]] #1 resource: "ate.dev/3d" cannot name a CDI kind' in str(e.value)
    assert '[[device]] #3 resource: "ate.dev/a_b" and "ate.dev/a.b" are one CDI kind, "ate.dev/a_b"' in str(e.value)
    cfg = load(write_file(tmp_path / "f.toml", '[daemon]\ncdi = true\ncdi_spec_dir = "/run/x"\n[[device]]\n'
                     'resource = "ate.dev/kvm"\npath = "/dev/kvm"\ncontainer_mode = 0o660\ncontainer_gid = 107\n'))
    assert (cfg.cdi, cfg.cdi_spec_dir, cfg.device_specs) == (True, "/run/x", True)
    assert (cfg.devices[0].container_mode, cfg.devices[0].container_uid, cfg.devices[0].container_gid) == (0o660, None, 107)


@root_only
def test_host_mode_is_refused_for_a_node_the_policy_refuses(tmp_path):
    dev = tmp_path / "dev"
    mknod(dev, "mem", 1, 1)  # /dev/mem: the host's memory
    path = write_file(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/mem"\npath = "/dev/mem"\n'
                 'allow_host_access = true\nhost_mode = 0o666\n')
    with pytest.raises(ConfigError) as e:
        load(path, overrides={"dev_root": str(dev)})
    assert '[[device]] #1 host_mode: "/dev/mem" (ate.dev/mem): refused: ' in str(e.value)
    assert '(char 1:1, not in sysfs) is physical memory (/dev/mem)' in str(e.value)
    assert "atedevd never widens the host's mode of such a node" in str(e.value)
