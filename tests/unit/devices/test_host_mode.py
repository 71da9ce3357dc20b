"""host_mode (atedevd/devices/host_mode.py): only a node its table judged present, with the numbers
judged, is widened; never one the policy refuses."""

import os
import stat

import pytest

from rig.nodes import mknod

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and root-owned directories need root (CI runs as root)")


# --- host_mode -------------------------------------------------------------------------------------------

@root_only
def test_host_mode_widens_a_pattern_match_but_never_one_the_policy_refuses(tmp_path):
    from atedevd.config import Device
    from atedevd.devices.host_mode import HostMode
    from atedevd.glue.resource import node_table

    dev = tmp_path / "dev"
    good = mknod(dev, "x0", 188, 0)
    bad = mknod(dev, "x1", 1, 1)  # /dev/mem's numbers under another name
    said = []
    device = Device("ate.dev/x", "/dev/x*", allow_host_access=True, host_mode=0o666)
    table = node_table(device, str(dev), str(tmp_path / "nosys"))
    table.look()
    keeper = HostMode(device, "/sys", lambda level, kind, text, **kw: said.append((kind, text)))
    keeper.keep(table.kept())  # what the table judged: the opted-in /dev/mem is served, never widened
    assert (os.stat(good).st_mode & 0o7777, os.stat(bad).st_mode & 0o7777) == (0o666, 0o600)
    assert [k for k, _ in said] == ["host-mode"] and f"{good} was 0600; keeping it at 0666 (host_mode)" in said[0][1]
    said.clear()
    keeper.keep(table.kept())  # as it should be: nothing done
    assert said == []
    os.chmod(good, 0o600)
    os.unlink(good)
    replaced = mknod(dev, "x0", 202, 0)  # udev made another node there since the table judged it: an MSR's numbers
    keeper.keep(table.kept())
    assert stat.S_IMODE(os.stat(replaced).st_mode) == 0o600 and said == []  # not the node judged: left alone
