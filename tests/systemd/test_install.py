"""The packages, installed for real: the .deb with apt and dpkg, the .rpm with rpm --root.

The matrix (Debian suites stand in for other distributions' Python stacks):
  atedevd .deb          Debian 12 and 13: apt install, registered, journald fields, upgrade, purge
  atedevd .rpm          Debian 13 rootfs (Python 3.13, not the build host's): --nodeps, the exact
                        Requires/Provides asserted instead; boots enabled, registered, erased
  atedevd-bundled .deb  Debian 11/12/13 with python3 and systemd only (Python 3.9/3.11/3.13):
  and .rpm              registered, journald fields, start->registered <= 2 s, upgrade, removal

Both are built from the working tree (`make deb`, `make deb DEB_REVISION=2`,
`make rpm`, into a temporary DIST_DIR) and installed into the CLEAN rootfs of
rig/container.py: Debian bookworm with systemd but without Python or any of
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

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rig.container import (PLUGIN_DIR, RESOURCE, RUNTIME_PACKAGES, Container, bare, cached_rootfs, clean, fake_kvm,
                           install_test_helpers, our_sockets, resource_state, run_in_rootfs, start_standin,
                           wait_registered, wait_until)
from rig.harness import REPO as HARNESS_REPO
from rig.package_upgrade import (CONFIG, DEBS, METRICS_DIR, VERSION, apt_install, build_deb, deb_version, make,
                                 print_timeline, start_kubelet, upgrade)

REPO = Path(HARNESS_REPO)
WANTS = "/etc/systemd/system/multi-user.target.wants/atedevd.service"


# suite -> its python3, for the self-contained packages
BUNDLED = {"bullseye": "3.9", "bookworm": "3.11", "trixie": "3.13"}
# built in the background from the session's start, in the order the tests need them (conftest.py)
ROOTFS = (clean("bookworm"), clean("trixie"), bare("bullseye"))
TIMINGS = {}  # unit start -> registered, per cell, printed at the end (pytest -s) and asserted <= 2 s


def in_parallel(*calls) -> list:
    """Each build in a temporary tree of its own, into one dist directory: they overlap (a
    build waits on PyPI, the compressor and the disk), a core each."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return [f.result() for f in [pool.submit(fn, *args) for fn, *args in calls]]


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    """The .deb and its "-2" revision (`make deb`, `make deb DEB_REVISION=2`), into one dist directory."""
    dist = tmp_path_factory.mktemp("dist")
    return dist, dict(zip((1, 2), in_parallel((build_deb, dist, 1), (build_deb, dist, 2))))


@pytest.fixture(scope="module")
def packages(debs):
    dist, _ = debs
    in_parallel((make, dist, "rpm"),
                *((make, dist, "deb-bundled", f"PYTHON_VERSION={py}", f"DEB_REVISION={rev}")
                  for py in BUNDLED.values() for rev in ("1", "2")),
                *((make, dist, "rpm-bundled", f"PYTHON_VERSION={py}") for py in BUNDLED.values()))
    found = {
        "deb1": dist / f"atedevd_{VERSION}-1_all.deb",
        "deb2": dist / f"atedevd_{VERSION}-2_all.deb",
        "rpm": next(iter(sorted(dist.glob(f"atedevd-{VERSION}-1*.noarch.rpm"))), None),
    }
    for py in BUNDLED.values():
        tag = "py" + py.replace(".", "")
        for rev in ("1", "2"):
            found[f"bdeb{rev}-{py}"] = next(iter(dist.glob(f"atedevd-bundled_{VERSION}-{rev}+{tag}_*.deb")), None)
        found[f"brpm-{py}"] = next(iter(dist.glob(f"atedevd-bundled-{VERSION}-1.{tag}.*.rpm")), None)
    missing = [k for k, v in found.items() if v is None or not v.is_file()]
    assert not missing, f"not built: {missing}; dist/ has {sorted(p.name for p in dist.iterdir())}"
    return found


# --- .deb: install, upgrade, purge ----------------------------------------------------------


@pytest.fixture(scope="module", params=["bookworm", "trixie"])
def node(packages, request):
    with Container(cached_rootfs(clean(request.param))) as n:
        n.suite = request.param
        for key in ("deb1", "deb2"):
            n.copy_in(packages[key], f"{DEBS}/{packages[key].name}")
        install_test_helpers(n)  # the kubelet stand-in; it will use the installed atedevd.api
        fake_kvm(n)
        yield n


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
    version = node.run("atedevd", "--version").stdout
    assert version.startswith(f"atedevd {VERSION}\npackage: deb\nruns on: grpcio 1.51."), version


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
    assert resource_state(node)["healthy"] == 1024
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
    python = node.run("python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()
    assert python == {"bookworm": "3.11", "trixie": "3.13"}[node.suite]


def test_deb_journal_carries_atedevd_fields(registered):
    assert_journal_fields(registered)


def test_deb_unit_start_to_registered_within_2s(registered):
    assert_start_to_registered(registered, f"deb on {registered.suite}")


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


def test_deb_upgrade_with_kubelet_outside_the_unit_registers_once_and_leaves_nothing_old(debs):
    """`apt install` of the newer revision over the running, registered daemon on Debian 12's
    systemd, kubelet (the stand-in, 1.32's device manager) in a unit of its own recording
    admission throughout: exactly one Register, the new process registered, healthy, counted by
    kubelet (pod-resources, read back by the daemon), the old process and its sockets gone, no
    warning in the journal. How long kubelet rejected meanwhile is bench.upgrade's figure.
    And from inside its sandbox the daemon saw the process behind kubelet.sock and read its
    program (the stand-in's is Python, which names no Kubernetes version): on a real kubelet
    that is where its version comes from (`kubelet_endpoints = "auto"`)."""
    _, built = debs
    with Container(cached_rootfs(clean("bookworm"))) as node:
        install_test_helpers(node)
        fake_kvm(node)
        node.run("mkdir", "-p", METRICS_DIR)
        apt_install(node, built[1])
        start_kubelet(node, "1.32")
        r = upgrade(node, built[2])
        said = [line for line in node.journal("-u", "atedevd", "-o", "cat").splitlines()
                if line.startswith("upgrade: the installed atedevd")]
    print_timeline(r)
    assert not r["problems"], "\n".join(r["problems"])
    assert (r["registers"], r["accepted"]) == (1, 1), r
    assert len(said) == 1 and "kubelet's version unknown: " in said[0], said
    assert "names no Kubernetes version in its build information" in said[0], said


@pytest.fixture(scope="module")
def purged(upgraded):
    node, _ = upgraded
    pid = node.main_pid()
    plant_leftover(node)
    node.run("dpkg", "--purge", "atedevd", timeout=120)
    return node, pid


def test_deb_purge_stops_and_removes_everything(purged):
    node, pid = purged
    assert deb_version(node, "atedevd") == ""
    assert node.run("test", "-d", f"/proc/{pid}", check=False).returncode != 0, "daemon still running"
    assert node.show("atedevd", "LoadState", "ActiveState") == {"LoadState": "not-found", "ActiveState": "inactive"}
    assert_nothing_of_ours(node.run("ls", "-A", PLUGIN_DIR).stdout)
    for path in ("/etc/atedevd", "/lib/systemd/system/atedevd.service", WANTS, "/usr/bin/atedevd",
                 "/usr/lib/python3/dist-packages/atedevd", "/var/lib/systemd/deb-systemd-helper-enabled/atedevd.service"):
        assert node.run("test", "-e", path, check=False).returncode != 0, f"{path} left behind"
    # kubelet's directory and socket are kubelet's: left alone.
    node.run("test", "-S", f"{PLUGIN_DIR}/kubelet.sock")
    wait_until(lambda: not resource_state(node).get("connected"), 10, "the stand-in to see the stream end")


# --- shared checks ----------------------------------------------------------------------------


def assert_journal_fields(node, pid=None):
    """The daemon's structured fields reached journald (systemd-python, or our native-protocol sender)."""
    def entries():
        out = node.journal("-u", "atedevd", "-o", "json", "ATEDEVD_EVENT=registered")
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    found = wait_until(entries, 15, "a registered event with journald fields", lambda: node.journal("-u", "atedevd", "-n", "20"))
    e = found[-1]
    assert e["ATEDEVD_RESOURCE"] == RESOURCE and e["PRIORITY"] == "6" and e["SYSLOG_IDENTIFIER"] == "atedevd", e
    assert e.get("CODE_FUNC") and e.get("LOGGER") == "atedevd", e


def assert_start_to_registered(node, cell: str, pythonpath: str = "") -> float:
    """Stop the unit, start it, time until the stand-in holds a new registration's stream."""
    node.systemctl("stop", "atedevd")
    before = resource_state(node).get("registrations", 0)
    t0 = time.monotonic()
    node.systemctl("start", "atedevd")
    wait_until(lambda: resource_state(node).get("registrations", 0) > before and resource_state(node).get("connected"),
               10, f"{cell}: a registration after the start", interval=0.02)
    took = time.monotonic() - t0
    TIMINGS[cell] = took
    print(f"\n{cell}: unit start -> registered {took * 1000:.0f} ms")
    assert took <= 2.0, f"{cell}: unit start -> registered took {took:.2f} s"
    return took


# What a daemon that was killed leaves in its standby directory: a socket nobody listens on.
LEFTOVER = f"{PLUGIN_DIR}/.atedevd/ate.dev_kvm.zzzzzz-9.sock"
PLANT = ("import os, socket, sys; os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True); "
         "os.chdir(os.path.dirname(sys.argv[1])); socket.socket(socket.AF_UNIX).bind(os.path.basename(sys.argv[1]))")
KUBELETS = {"kubelet.sock", "kubelet_internal_checkpoint", ".standin"}  # the stand-in's own entries


def plant_leftover(node_or_root) -> None:
    """A dead socket in the standby directory, as a killed daemon leaves it: the package's removal
    script, not the daemon's stop, must take it and the directory away."""
    if isinstance(node_or_root, Path):  # bound relative to its directory: the rootfs path is long
        subprocess.run(["python3", "-c", PLANT, str(node_or_root / LEFTOVER.lstrip("/"))], check=True)
    else:
        node_or_root.run("python3", "-c", PLANT, LEFTOVER)


def assert_nothing_of_ours(ls_a: str) -> None:
    """`ls -A` of kubelet's directory after removal: only kubelet's (the stand-in's) entries."""
    left = set(ls_a.split()) - KUBELETS
    assert not left, f"left behind in {PLUGIN_DIR}: {sorted(left)}"


def gone(node_or_root, paths):
    left = []
    for path in paths:
        if isinstance(node_or_root, Path):
            p = node_or_root / path.lstrip("/")
            if p.exists() or p.is_symlink():
                left.append(path)
        elif node_or_root.run("test", "-e", path, check=False).returncode == 0 or \
                node_or_root.run("test", "-L", path, check=False).returncode == 0:
            left.append(path)
    return left


# --- .rpm (distribution dependencies): into a Debian 13 image, boot, erase ----------------------

RPM_REQUIRES = ["/bin/sh"] * 5 + ["/usr/bin/python3", "config(atedevd) = {v}-1",
                "python(abi) >= 3.9", "python3dist(grpcio) >= 1.51", "python3dist(protobuf) >= 4.21",
                "python3dist(systemd-python) >= 234", "rpmlib(CompressedFileNames) <= 3.0.4-1",
                "rpmlib(FileDigests) <= 4.6.0-1", "rpmlib(PayloadFilesHavePrefix) <= 4.0-1",
                "systemd", "systemd", "systemd"]
RPM_PROVIDES = ["atedevd = {v}-1", "bundled(python3dist(inotify)) = 0.2.12", "bundled(python3dist(sdnotify)) = 0.3.2",
                "config(atedevd) = {v}-1"]


@pytest.fixture(scope="module")
def rpm_root(packages):
    # Debian 13: Python 3.13, where the build host's 3.11 paths or bytecode would not do.
    c = Container(cached_rootfs(clean("trixie")))
    try:
        root = c.mount()
        rpm = packages["rpm"]
        # --nodeps only here: Debian's packages are not in an rpm database; what the package
        # requires and provides is asserted exactly below instead.
        p = subprocess.run(["rpm", "--root", str(root), "-ivh", "--nodeps", str(rpm)], capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        yield c, rpm
    finally:
        c.destroy()


def rpm_q(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["rpm", "--root", str(root), *args], capture_output=True, text=True)


def test_rpm_requires_and_provides_exactly(packages):
    rpm = packages["rpm"]
    q = lambda *a: subprocess.run(["rpm", "-qp", *a, str(rpm)], capture_output=True, text=True).stdout.splitlines()
    assert sorted(q("--requires")) == sorted(r.format(v=VERSION) for r in RPM_REQUIRES)
    assert sorted(q("--provides")) == sorted(r.format(v=VERSION) for r in RPM_PROVIDES)


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
    for f in ("usr/share/man/man8/atedevd.8.gz", "usr/share/man/man5/atedevd.toml.5.gz", "usr/share/doc/atedevd/README.md",
              "usr/share/licenses/atedevd/LICENSE", "usr/lib/atedevd/site-packages/inotify/calls.py",
              "usr/lib/atedevd/site-packages/sdnotify/__init__.py"):
        assert (root / f).is_file(), f
    assert "/etc/atedevd/config.toml" in rpm_q(root, "-qc", "atedevd").stdout.split()
    # No bytecode in the payload; %post compiled it with the node's python (if rpm could run it here).
    assert not [f for f in rpm_q(root, "-ql", "atedevd").stdout.split() if f.endswith(".pyc")]
    wants = root / WANTS.lstrip("/")
    assert wants.is_symlink() and str(wants.readlink()).endswith("/systemd/system/atedevd.service"), wants


def test_rpm_installed_unit_starts_at_boot_and_registers_on_python_3_13(rpm_root):
    c, _ = rpm_root
    # The image's runtime: Debian 13's packages here (on Fedora/EL, dnf resolves the Requires above).
    run_in_rootfs(c.root, "apt-get", "install", "-y", "--no-download", "--no-install-recommends", *RUNTIME_PACKAGES)
    c.boot()
    try:
        install_test_helpers(c)
        fake_kvm(c)
        wait_until(lambda: "waiting for kubelet" in c.show("atedevd", "StatusText")["StatusText"], 30,
                   "atedevd started at boot", lambda: c.systemctl("status", "atedevd", check=False).stdout)
        assert c.show("atedevd", "ActiveState", "UnitFileState") == {"ActiveState": "active", "UnitFileState": "enabled"}
        start_standin(c, pythonpath="/usr/lib/atedevd")
        wait_registered(c, 1)
        version = c.run("atedevd", "--version").stdout
        assert "package: rpm\n" in version and "Python 3.13." in version, version
        assert_journal_fields(c)
        assert_start_to_registered(c, "rpm on trixie")
        maps = c.run("cat", f"/proc/{c.main_pid()}/maps").stdout
        assert "/usr/lib/python3/dist-packages/grpc/_cython/cygrpc.cpython-313" in maps
    finally:
        c.shutdown()


def test_rpm_erase_removes_it_cleanly(rpm_root):
    c, _ = rpm_root
    root = c.root
    plant_leftover(root)
    p = rpm_q(root, "-e", "atedevd")
    assert p.returncode == 0, p.stdout + p.stderr
    assert rpm_q(root, "-q", "atedevd").returncode != 0
    left = gone(root, ["/usr/lib/systemd/system/atedevd.service", WANTS, "/etc/atedevd/config.toml", "/usr/bin/atedevd",
                       "/usr/lib/atedevd", "/usr/share/man/man8/atedevd.8.gz", "/usr/share/licenses/atedevd"])
    assert not left, f"left behind: {left}"
    assert_nothing_of_ours(" ".join(p.name for p in (root / PLUGIN_DIR.lstrip("/")).iterdir()))


# --- self-contained packages on nodes with python3 and systemd only ----------------------------

BUNDLED_SITE = "/usr/lib/atedevd/site-packages:/usr/lib/atedevd"
STACK = ("python3-grpcio", "python3-protobuf", "python3-inotify", "python3-sdnotify", "python3-systemd")


def bare_node(suite: str) -> Container:
    # bullseye: a rootfs with python3 installed; bookworm/trixie: the clean one, python3 from apt's cache.
    return Container(cached_rootfs(bare(suite) if suite == "bullseye" else clean(suite)))


def ensure_python(node) -> None:
    if node.run("test", "-x", "/usr/bin/python3", check=False).returncode != 0:
        node.run("apt-get", "install", "-y", "--no-install-recommends", "python3", timeout=300)
    for pkg in STACK:
        assert not deb_version(node, pkg).startswith("install ok installed"), f"{pkg} is installed: not a bare node"


@pytest.fixture(scope="module", params=list(BUNDLED))
def bundled_node(packages, request):
    suite = request.param
    with bare_node(suite) as n:
        n.suite, n.py = suite, BUNDLED[suite]
        for rev in ("1", "2"):
            deb = packages[f"bdeb{rev}-{n.py}"]
            n.copy_in(deb, f"{DEBS}/{deb.name}")
        install_test_helpers(n)
        fake_kvm(n)
        ensure_python(n)
        yield n


def test_bundled_deb_lifecycle(bundled_node, packages):
    node, py = bundled_node, bundled_node.py
    cell = f"bundled deb on {node.suite}"
    apt_install(node, packages[f"bdeb1-{py}"])
    assert deb_version(node, "atedevd-bundled").startswith("install ok installed")
    assert node.show("atedevd", "ActiveState", "UnitFileState") == {"ActiveState": "active", "UnitFileState": "enabled"}
    version = node.run("atedevd", "--version").stdout
    assert version.startswith(f"atedevd {VERSION}\npackage: self-contained\nruns on: grpcio 1.80.1, protobuf 6.33.6, Python {py}."), version
    start_standin(node, pythonpath=BUNDLED_SITE)
    wait_registered(node, 1)
    maps = node.run("cat", f"/proc/{node.main_pid()}/maps").stdout
    assert "/usr/lib/atedevd/site-packages/grpc/_cython/cygrpc." in maps
    # Bytecode compiled at install time for this node's python, not shipped.
    tag = "cpython-" + py.replace(".", "")
    node.run("test", "-f", f"/usr/lib/atedevd/atedevd/daemon/__pycache__/loop.{tag}.pyc")
    assert_journal_fields(node)
    assert_start_to_registered(node, cell, BUNDLED_SITE)

    # upgrade: restarted, registers again, edited config kept
    node.run("sh", "-c", f"echo '# local edit' >> {CONFIG}")
    pid, regs = node.main_pid(), resource_state(node)["registrations"]
    apt_install(node, packages[f"bdeb2-{py}"])
    assert deb_version(node, "atedevd-bundled").split()[-1] == f"{VERSION}-2+py{py.replace('.', '')}"
    wait_until(lambda: node.main_pid() not in (0, pid), 30, "a new main process after the upgrade")
    wait_registered(node, regs + 1)
    assert "# local edit" in node.run("cat", CONFIG).stdout

    # purge: nothing of ours left (the compiled bytecode included, and in kubelet's directory)
    pid = node.main_pid()
    plant_leftover(node)
    node.run("dpkg", "--purge", "atedevd-bundled", timeout=120)
    assert_nothing_of_ours(node.run("ls", "-A", PLUGIN_DIR).stdout)
    assert node.run("test", "-d", f"/proc/{pid}", check=False).returncode != 0, "daemon still running"
    left = gone(node, ["/usr/lib/atedevd", "/etc/atedevd", "/usr/bin/atedevd", "/lib/systemd/system/atedevd.service",
                       "/usr/lib/systemd/system/atedevd.service", WANTS, "/usr/share/doc/atedevd",
                       "/usr/share/doc/atedevd-bundled"])
    assert not left, f"left behind: {left}"
    assert node.show("atedevd", "LoadState")["LoadState"] == "not-found"


def test_bundled_deb_for_another_python_is_refused_by_apt(bundled_node, packages):
    node = bundled_node
    other = next(p for s, p in BUNDLED.items() if s != node.suite)
    deb = packages[f"bdeb1-{other}"]
    node.copy_in(deb, f"{DEBS}/{deb.name}")
    p = node.run("apt-get", "install", "-y", "--no-install-recommends", f"{DEBS}/{deb.name}", check=False, timeout=120)
    assert p.returncode != 0 and "python3" in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr[-2000:]


@pytest.mark.parametrize("suite", list(BUNDLED))
def test_bundled_rpm_into_image_boots_registers_and_erases(packages, suite):
    py = BUNDLED[suite]
    rpm = packages[f"brpm-{py}"]
    c = bare_node(suite)
    try:
        root = c.mount()
        if suite != "bullseye":
            run_in_rootfs(root, "apt-get", "install", "-y", "--no-download", "--no-install-recommends", "python3")
        # --nodeps: Debian's python3 and systemd are not in an rpm database. The package asks for exactly:
        requires = subprocess.run(["rpm", "-qpR", str(rpm)], capture_output=True, text=True).stdout.split("\n")
        assert f"python(abi) = {py}" in requires and "glibc >= 2.17" in requires, requires
        p = subprocess.run(["rpm", "--root", str(root), "-ivh", "--nodeps", str(rpm)], capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        c.boot()
        install_test_helpers(c)
        fake_kvm(c)
        wait_until(lambda: c.show("atedevd", "ActiveState")["ActiveState"] == "active", 30, "atedevd active at boot",
                   lambda: c.systemctl("status", "atedevd", check=False).stdout)
        start_standin(c, pythonpath=BUNDLED_SITE)
        wait_registered(c, 1)
        assert "package: self-contained" in c.run("atedevd", "--version").stdout
        assert_journal_fields(c)
        assert_start_to_registered(c, f"bundled rpm on {suite}", BUNDLED_SITE)
        c.shutdown()
        plant_leftover(root)
        p = rpm_q(root, "-e", "atedevd-bundled")
        assert p.returncode == 0, p.stdout + p.stderr
        assert_nothing_of_ours(" ".join(p.name for p in (root / PLUGIN_DIR.lstrip("/")).iterdir()))
        left = gone(root, ["/usr/lib/atedevd", "/etc/atedevd/config.toml", "/usr/bin/atedevd",
                           "/usr/lib/systemd/system/atedevd.service", WANTS, "/usr/share/doc/atedevd"])
        assert not left, f"left behind: {left}"
    finally:
        c.destroy()
