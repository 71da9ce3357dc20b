"""The `node` fixture every check test runs against."""

import os
import shutil
import tempfile

import pytest

from tests.unit.check.fake_node import CheckedNode


@pytest.fixture
def node():
    """A fake node: dev root with kvm (a char device via /dev/null), and a plugin dir.

    Short paths under /tmp: AF_UNIX socket paths must fit in 108 bytes.
    """
    root = tempfile.mkdtemp(prefix="atedevd-ck")
    os.mkdir(os.path.join(root, "dev"))
    os.mkdir(os.path.join(root, "dp"))
    os.symlink("/dev/null", os.path.join(root, "dev", "kvm"))
    os.mkdir(os.path.join(root, "dev", "char"))
    os.symlink("../kvm", os.path.join(root, "dev", "char", "1:3"))  # what udev makes (here /dev/null's number)
    socks = []
    yield CheckedNode(root, socks)
    for s in socks:
        s.close()
    shutil.rmtree(root)
