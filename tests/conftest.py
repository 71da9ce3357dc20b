"""Fixtures: a fake dev root, a kubelet stand-in, and atedevd run as a process.

The `kubelet` fixture models the newest kubelet ("current"); tests marked
`registration` (and every test in test_registration.py) run against each
kubelet version the stand-in models (rig.kubelet_standin.MODES).
"""

import os
import shutil
import tempfile

import pytest

from rig.harness import DaemonUnderTest, fake_dev_root, wait_until
from rig.kubelet_standin import MODES, Kubelet


def pytest_configure(config):
    config.addinivalue_line("markers", "registration: run against every kubelet version the stand-in models")
    config.addinivalue_line("markers", "slow: seconds of its own; `make check` (the fast layer) leaves it out")


# Files whose tests take minutes, run first: `make test` hands files to its workers in this
# order (pytest-xdist), and a long one begun last would run on alone at the end.
FIRST = ("simulation/test_simulation.py", "systemd/test_install.py", "process/test_registration.py",
         "systemd/test_packaging.py", "process/test_daemon.py", "process/test_faults.py", "runtime/test_cri_runtime.py",
         "systemd/test_systemd.py")
TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(item.path, TESTS), len(FIRST)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    """The rootfs the selected tests' modules name (`ROOTFS = (...)`), built in the background
    from the start of the session: a fresh machine has none (rig/container.py)."""
    specs = [spec for module in dict.fromkeys(item.module for item in session.items if getattr(item, "module", None))
             for spec in getattr(module, "ROOTFS", ())]
    if specs and not session.config.option.collectonly:
        from rig import container
        container.prefetch(specs)


def pytest_sessionfinish(session):
    from rig import container
    container.prefetch_done(stop=True)


def pytest_generate_tests(metafunc):
    given = any("kubelet_mode" in m.args[0] for m in metafunc.definition.iter_markers("parametrize"))
    if "kubelet_mode" in metafunc.fixturenames and not given:
        both = metafunc.definition.get_closest_marker("registration") is not None \
            or metafunc.module.__name__.endswith("test_registration")
        metafunc.parametrize("kubelet_mode", MODES if both else ("current",), ids=lambda m: f"kubelet-{m}")


@pytest.fixture
def dev_root(tmp_path):
    return fake_dev_root(str(tmp_path / "dev"))


@pytest.fixture
def plugin_dir():
    """Short, like kubelet's /var/lib/kubelet/device-plugins: a unix socket path has 107
    bytes, and pytest's tmp_path would leave too few for the sockets' names."""
    root = tempfile.mkdtemp(prefix="ate", dir="/tmp")
    yield os.path.join(root, "device-plugins")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def kubelet(plugin_dir, kubelet_mode):
    k = Kubelet(plugin_dir, kubelet=kubelet_mode)
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
        d = DaemonUnderTest(str(tmp_path / "run"), **kwargs)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


@pytest.fixture
def daemon(start_daemon, kubelet):
    """A daemon registered with a running kubelet stand-in: kubelet has its stream, and the
    daemon has taken in Register's answer (on a starved machine that can come later, and a
    test's next event would then meet a Register still in flight)."""
    d = start_daemon()
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    assert wait_until(lambda: ": registered, " in (d.status() or ""), 10), (d.status(), d.log())
    return d
