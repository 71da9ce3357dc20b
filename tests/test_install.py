"""The packages, installed for real: the .deb with apt and dpkg, the .rpm with rpm --root.

Both are built from the working tree (`make deb`, `make deb DEB_REVISION=2`,
`make rpm`, into a temporary DIST_DIR) and installed into the CLEAN rootfs of
tests/container.py: Debian bookworm with systemd but without Python or any of
atedevd's dependencies. Those are only in apt's cache there, downloaded from
Debian's mirror when the rootfs was built, and the container has no network:
so `apt install ./atedevd.deb` proves the package's Depends name Debian's own
packages and that the daemon runs on them (python3-grpcio 1.51, protobuf 3.21).

The .deb goes through its whole life in one booted container, in order:
install -> upgrade to the -2 build -> purge (each a module fixture built on the
previous one). The .rpm is installed into an unbooted rootfs, as an image build
would, then the rootfs is booted to see the unit enabled for real, then the
package is erased.
"""

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from tests.container import (
    CLEAN,
    PLUGIN_DIR,
    RESOURCE,
    RUNTIME_PACKAGES,
    our_sockets,
    Container,
    cached_rootfs,
    fake_kvm,
    install_test_helpers,
    resource_state,
    run_in_rootfs,
    start_standin,
    wait_registered,
    wait_until,
)

REPO = Path(__file__).resolve().parent.parent
VERSION = re.search(r'^__version__ = "([^"]+)"$', (REPO / "atedevd/__init__.py").read_text(), re.M).group(1)
DEBS = "/var/cache/atedevd-test-debs"  # inside the container
CONFIG = "/etc/atedevd/config.toml"
WANTS = "/etc/systemd/system/multi-user.target.wants/atedevd.service"


def make(dist: Path, *args: str) -> None:
    p = subprocess.run(["make", "-C", str(REPO), *args, f"DIST_DIR={dist}"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                                                            "HOME": "/root", "DIST_DIR": str(dist)})
    assert p.returncode == 0, f"make {' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    make(dist, "deb")
    make(dist, "deb", "DEB_REVISION=2")
    make(dist, "rpm")
    found = {
        "deb1": dist / f"atedevd_{VERSION}-1_all.deb",
        "deb2": dist / f"atedevd_{VERSION}-2_all.deb",
        "rpm": next(iter(sorted(dist.glob(f"atedevd-{VERSION}-1*.noarch.rpm"))), None),
    }
    missing = [k for k, v in found.items() if v is None or not v.is_file()]
    assert not missing, f"not built: {missing}; dist/ has {sorted(p.name for p in dist.iterdir())}"
    return found


# --- .deb: install, upgrade, purge ----------------------------------------------------------


@pytest.fixture(scope="module")
def node(packages):
    with Container(cached_rootfs(CLEAN)) as n:
        for key in ("deb1", "deb2"):
            n.copy_in(packages[key], f"{DEBS}/{packages[key].name}")
        install_test_helpers(n)  # the kubelet stand-in; it will use the installed atedevd.api
        fake_kvm(n)
        yield n


def apt_install(node, deb: Path) -> str:
    # The container has no network: every dependency must come from the cached Debian packages. (Not
    # --no-download: apt 2.6 then fails on a local .deb with "Pathname to install is not absolute".)
    p = node.run("apt-get", "install", "-y", "--no-install-recommends", f"{DEBS}/{deb.name}",
                 check=False, timeout=300)
    assert p.returncode == 0, f"apt-get install {deb.name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def deb_version(node, package: str) -> str:
    p = node.run("dpkg-query", "-W", "-f=${Status} ${Version}", package, check=False)
    return p.stdout if p.returncode == 0 else ""


@pytest.fixture(scope="module")
def installed(node, packages):
    assert node.systemctl("show", "-P", "LoadState", "atedevd").stdout.strip() == "not-found"
    apt_install(node, packages["deb1"])
    return node


@pytest.fixture(scope="module")
def registered(installed):
    node = installed
    # Installed and started before kubelet, as on a node where kubelet comes later: it waits.
    wait_until(lambda: "waiting for kubelet" in node.show("atedevd", "StatusText")["StatusText"], 30,
               "STATUS= waiting for kubelet", lambda: node.systemctl("status", "atedevd", check=False).stdout)
    start_standin(node)
    wait_registered(node, 1)
    return node


def test_deb_installs_enabled_and_active(installed):
    node = installed
    assert deb_version(node, "atedevd") == f"install ok installed {VERSION}-1"
    assert node.systemctl("is-enabled", "atedevd").stdout.strip() == "enabled"
    assert node.systemctl("is-active", "atedevd").stdout.strip() == "active"
    assert node.run("readlink", "-f", WANTS).stdout.strip() == "/usr/lib/systemd/system/atedevd.service"
    assert node.run("atedevd", "--version").stdout.strip() == f"atedevd {VERSION}"


def test_deb_ships_the_unit_config_and_docs(installed):
    node = installed
    shipped = node.run("cat", "/lib/systemd/system/atedevd.service").stdout
    assert shipped == (REPO / "systemd/atedevd.service").read_text()
    assert node.run("cat", CONFIG).stdout == (REPO / "etc/config.toml").read_text()
    assert CONFIG in node.run("cat", "/var/lib/dpkg/info/atedevd.conffiles").stdout
    # The unit's Documentation= targets exist on the node.
    node.run("test", "-f", "/usr/share/doc/atedevd/README.md")
    node.run("test", "-f", "/usr/share/man/man8/atedevd.8.gz")
    node.run("test", "-f", "/usr/share/man/man5/atedevd.toml.5.gz")


def test_deb_runs_on_debian_python_stack_and_registers(registered):
    node = registered
    assert resource_state(node)["healthy"] == 4096
    for pkg in RUNTIME_PACKAGES:
        assert deb_version(node, pkg).startswith("install ok installed"), pkg
    assert deb_version(node, "python3-grpcio").split()[-1].startswith("1.51.")
    assert deb_version(node, "python3-protobuf").split()[-1].startswith("3.21.")
    # The running daemon loaded Debian's grpc, and nothing from /usr/local or a venv.
    pid = node.main_pid()
    maps = node.run("cat", f"/proc/{pid}/maps").stdout
    assert "/usr/lib/python3/dist-packages/grpc/_cython/cygrpc." in maps
    assert "/usr/local/" not in maps and "site-packages" not in maps
    assert our_sockets(node), "no socket served"


@pytest.fixture(scope="module")
def upgraded(registered, packages):
    node = registered
    node.run("sh", "-c", f"echo '# local edit: kept across upgrades' >> {CONFIG}")
    before = {
        "pid": node.main_pid(),
        "registrations": resource_state(node)["registrations"],
        "config": node.run("sha256sum", CONFIG).stdout,
    }
    apt_install(node, packages["deb2"])
    return node, before


def test_deb_upgrade_restarts_reregisters_and_keeps_config(upgraded):
    node, before = upgraded
    assert deb_version(node, "atedevd") == f"install ok installed {VERSION}-2"
    wait_until(lambda: node.main_pid() not in (0, before["pid"]), 30, "a new main process after the upgrade")
    assert node.systemctl("is-active", "atedevd").stdout.strip() == "active"
    assert node.systemctl("is-enabled", "atedevd").stdout.strip() == "enabled"
    wait_registered(node, before["registrations"] + 1)
    # The edited conffile is untouched, without a prompt and without a .dpkg-dist beside it.
    assert node.run("sha256sum", CONFIG).stdout == before["config"]
    assert node.run("ls", "/etc/atedevd").stdout.split() == ["config.toml"]


@pytest.fixture(scope="module")
def purged(upgraded):
    node, _ = upgraded
    pid = node.main_pid()
    node.run("dpkg", "--purge", "atedevd", timeout=120)
    return node, pid


def test_deb_purge_stops_and_removes_everything(purged):
    node, pid = purged
    assert deb_version(node, "atedevd") == ""
    assert node.run("test", "-d", f"/proc/{pid}", check=False).returncode != 0, "daemon still running"
    assert node.show("atedevd", "LoadState", "ActiveState") == {"LoadState": "not-found", "ActiveState": "inactive"}
    assert our_sockets(node) == [], "socket left behind"
    for path in ("/etc/atedevd", "/lib/systemd/system/atedevd.service", WANTS, "/usr/bin/atedevd",
                 "/usr/lib/python3/dist-packages/atedevd", "/var/lib/systemd/deb-systemd-helper-enabled/atedevd.service"):
        assert node.run("test", "-e", path, check=False).returncode != 0, f"{path} left behind"
    # kubelet's directory and socket are kubelet's: left alone.
    node.run("test", "-S", f"{PLUGIN_DIR}/kubelet.sock")
    wait_until(lambda: not resource_state(node).get("connected"), 10, "the stand-in to see the stream end")


# --- .rpm: into an image, boot, erase -------------------------------------------------------------


@pytest.fixture(scope="module")
def rpm_root(packages):
    c = Container(cached_rootfs(CLEAN))
    try:
        root = c.mount()
        rpm = packages["rpm"]
        # --nodeps: Debian's packages are not in an rpm database; what the package requires is checked below.
        p = subprocess.run(["rpm", "--root", str(root), "-ivh", "--nodeps", str(rpm)], capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        yield c, rpm
    finally:
        c.destroy()


def rpm_q(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["rpm", "--root", str(root), *args], capture_output=True, text=True)


def test_rpm_installs_files_in_place_and_enables_the_unit(rpm_root):
    c, rpm = rpm_root
    root = c.root
    assert rpm_q(root, "-q", "atedevd").stdout.startswith(f"atedevd-{VERSION}-1")
    p = rpm_q(root, "-V", "--nodeps", "atedevd")
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr
    unit = root / "usr/lib/systemd/system/atedevd.service"
    assert unit.read_text() == (REPO / "systemd/atedevd.service").read_text()
    assert (root / "etc/atedevd/config.toml").read_text() == (REPO / "etc/config.toml").read_text()
    assert (root / "usr/bin/atedevd").stat().st_mode & 0o111
    assert (root / "usr/share/man/man8/atedevd.8.gz").is_file()
    assert (root / "usr/share/man/man5/atedevd.toml.5.gz").is_file()
    assert (root / "usr/share/doc/atedevd/README.md").is_file()
    configs = rpm_q(root, "-qc", "atedevd").stdout.split()
    assert "/etc/atedevd/config.toml" in configs
    # Enabled by the %post preset, as the distribution's policy says (Debian's: enable).
    wants = root / WANTS.lstrip("/")
    assert wants.is_symlink() and str(wants.readlink()).endswith("/systemd/system/atedevd.service"), wants
    requires = subprocess.run(["rpm", "-qpR", str(rpm)], capture_output=True, text=True).stdout
    for dep in ("python3dist(grpcio)", "python3dist(protobuf)", "python3dist(inotify)", "python3dist(sdnotify)",
                "python3dist(systemd-python)"):
        assert dep in requires, (dep, requires)


def test_rpm_installed_unit_starts_at_boot(rpm_root):
    c, _ = rpm_root
    # The image's runtime: Debian's packages here (on Fedora/EL, dnf resolves the Requires above).
    run_in_rootfs(c.root, "apt-get", "install", "-y", "--no-download", "--no-install-recommends", *RUNTIME_PACKAGES)
    c.boot()
    try:
        fake_kvm(c)
        # Nobody starts it: enabled means started at boot.
        wait_until(lambda: "waiting for kubelet" in c.show("atedevd", "StatusText")["StatusText"], 30,
                   "atedevd started at boot", lambda: c.systemctl("status", "atedevd", check=False).stdout)
        assert c.show("atedevd", "ActiveState", "UnitFileState") == {"ActiveState": "active", "UnitFileState": "enabled"}
    finally:
        c.shutdown()


def test_rpm_erase_removes_it_cleanly(rpm_root):
    c, _ = rpm_root
    root = c.root
    p = rpm_q(root, "-e", "atedevd")
    assert p.returncode == 0, p.stdout + p.stderr
    assert rpm_q(root, "-q", "atedevd").returncode != 0
    for path in ("usr/lib/systemd/system/atedevd.service", WANTS.lstrip("/"), "etc/atedevd/config.toml",
                 "usr/bin/atedevd", "usr/lib/python3/dist-packages/atedevd", "usr/share/man/man8/atedevd.8.gz"):
        assert not (root / path).exists() and not (root / path).is_symlink(), f"{path} left behind"
