"""Fixtures: a fake dev root, a kubelet stand-in, and atedevd run as a process."""

import os

import pytest

from tests.harness import Daemon, fake_dev_root
from tests.kubelet_standin import Kubelet


@pytest.fixture
def dev_root(tmp_path):
    return fake_dev_root(str(tmp_path / "dev"))


@pytest.fixture
def plugin_dir(tmp_path):
    return str(tmp_path / "device-plugins")


@pytest.fixture
def kubelet(plugin_dir):
    k = Kubelet(plugin_dir)
    k.start()
    yield k
    k.close()


@pytest.fixture
def start_daemon(tmp_path, plugin_dir, dev_root):
    """Start `atedevd run` processes; all are killed at the end of the test."""
    started = []

    def start(**kwargs):
        kwargs.setdefault("plugin_dir", plugin_dir)
        kwargs.setdefault("dev_root", dev_root)
        d = Daemon(str(tmp_path / "run"), **kwargs)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


@pytest.fixture
def daemon(start_daemon, kubelet):
    """A daemon registered with a running kubelet stand-in."""
    d = start_daemon()
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    return d
