"""Packaging: one version, `make deb` / `make rpm` build what a node needs, lintian and
rpmlint are clean, and the Packer provisioner does what the README says.

Builds the real packages from this tree (as root, with Debian's tools: see the report of
the packaging issue for the apt packages). Installing them into a booted systemd is
tests/systemd/test_install.py's job, not this file's.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import atedevd
from rig.harness import REPO

ROOT = Path(REPO)
DIST = ROOT / "dist"
VERSION = atedevd.__version__
# Debian's interpreter and tools, whatever python runs pytest.
ENV = dict(os.environ, PATH="/usr/sbin:/usr/bin:/sbin:/bin")
ENV.pop("PYTHONPATH", None)
ENV.pop("VIRTUAL_ENV", None)

# procps: the unit's ExecReload= runs /bin/kill.
DEB_RUNTIME = {"python3-grpcio", "python3-protobuf", "python3-inotify", "python3-sdnotify", "python3-systemd", "procps"}
RPM_RUNTIME = {"grpcio", "protobuf", "systemd-python"}  # inotify and sdnotify are bundled
PACKER = ROOT / "packaging" / "packer"


def run(*cmd, check=True, **kw):
    kw.setdefault("env", ENV)
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def leftovers():
    """Build products that must never appear in the work tree (only dist/ may change)."""
    found = set()
    for pattern in ("debian/.debhelper", "debian/atedevd", "debian/tmp", "debian/files", "debian/*.substvars",
                    "debian/*.debhelper.log", "debian/debhelper-build-stamp", ".pybuild", "build", "*.egg-info",
                    "rpm-wheel", "rpm/*.rpm"):
        found.update(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
    return found


def python_package_files():
    """The package's files as the source tree has them, relative to the site directory."""
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "atedevd").rglob("*.py") if "__pycache__" not in p.parts}
    return files | {str(p.relative_to(ROOT)) for p in (ROOT / "atedevd" / "api").glob("*.proto")}


def changelog_version():
    return run("dpkg-parsechangelog", "-l", str(ROOT / "debian/changelog"), "-S", "Version").stdout.strip()


# ---------------------------------------------------------------- one version


def test_version_is_set_once_and_everything_follows_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+([.+~][0-9A-Za-z.]+)?", VERSION), VERSION
    assert changelog_version() == f"{VERSION}-1", "debian/changelog's top entry must be <atedevd.__version__>-1"
    spec = (ROOT / "rpm/atedevd.spec").read_text()
    assert re.search(r"^Version:\s+%\{atedevd_version\}$", spec, re.M), "the spec takes its version from the build"
    assert VERSION not in spec, "no literal version in the spec: it comes from atedevd.__version__"
    assert 'atedevd_version $version' in (ROOT / "packaging/build-rpm").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = {attr = "atedevd.__version__"}' in pyproject
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M), "pyproject.toml must not set a literal version"


def test_rpm_spec_refuses_to_build_without_a_version():
    r = run("rpmspec", "-q", "--qf", "%{VERSION}\n", str(ROOT / "rpm/atedevd.spec"), check=False)
    assert r.returncode != 0 and "atedevd_version is not defined" in r.stderr


# ---------------------------------------------------------------- .deb


@pytest.fixture(scope="module")
def deb(tmp_path_factory):
    before = leftovers()
    run("make", "-C", str(ROOT), "deb", cwd=ROOT)
    path = DIST / f"atedevd_{VERSION}-1_all.deb"
    assert path.is_file()
    assert leftovers() == before, "make deb left build products in the work tree"
    tree = tmp_path_factory.mktemp("deb")
    run("dpkg-deb", "-x", str(path), str(tree))
    return path, tree


def deb_paths(path):
    out = run("dpkg-deb", "-c", str(path)).stdout
    return {line.split()[5].removeprefix(".") for line in out.splitlines()}


def test_deb_installs_binary_unit_config_python_package_and_man_pages(deb):
    path, _ = deb
    paths = deb_paths(path)
    for f in ("/usr/bin/atedevd", "/etc/atedevd/config.toml", "/usr/share/man/man8/atedevd.8.gz",
              "/usr/share/man/man5/atedevd.toml.5.gz", "/usr/share/doc/atedevd/README.md",
              "/usr/share/doc/atedevd/copyright", "/usr/share/doc/atedevd/dra.conf.example",
              "/usr/share/doc/atedevd/deviceclasses.json"):
        assert f in paths, f
    assert {"/lib/systemd/system/atedevd.service", "/usr/lib/systemd/system/atedevd.service"} & paths
    site = "/usr/lib/python3/dist-packages/"
    packaged = {p.removeprefix(site) for p in paths if p.startswith(site + "atedevd/") and p.endswith((".py", ".proto"))}
    assert packaged == python_package_files()
    assert f"{site}atedevd-{VERSION}.dist-info/entry_points.txt" in paths
    # Debian's runtime, not a bundled copy of it.
    assert not [p for p in paths if re.match(r"/usr/lib/python3/dist-packages/(grpc|google|inotify|sdnotify|systemd)\b", p)]


def test_deb_ships_the_repository_unit_and_config_unchanged(deb):
    _, tree = deb
    unit = next(p for p in (tree / "lib/systemd/system/atedevd.service", tree / "usr/lib/systemd/system/atedevd.service") if p.exists())
    assert unit.read_bytes() == (ROOT / "systemd/atedevd.service").read_bytes()
    assert (tree / "etc/atedevd/config.toml").read_bytes() == (ROOT / "etc/config.toml").read_bytes()


def test_deb_control_depends_on_debian_runtime_and_marks_the_config_conffile(deb):
    path, _ = deb
    fields = {k: run("dpkg-deb", "-f", str(path), k).stdout.strip() for k in ("Package", "Version", "Architecture", "Depends")}
    assert fields["Package"] == "atedevd" and fields["Version"] == f"{VERSION}-1" and fields["Architecture"] == "all"
    names = {re.split(r"[\s(]", alt.strip())[0] for dep in fields["Depends"].split(",") for alt in dep.split("|")}
    assert DEB_RUNTIME <= names, fields["Depends"]
    assert "python3:any" in names or "python3" in names
    conffiles = run("dpkg-deb", "-I", str(path), "conffiles").stdout.split()
    assert conffiles == ["/etc/atedevd/config.toml"]


def test_deb_dependencies_resolve_on_this_debian(deb):
    """The versioned Depends are satisfiable from Debian's own archive (apt plans it; nothing is installed)."""
    path, _ = deb
    r = run("apt-get", "install", "-s", "--no-install-recommends", str(path))
    assert re.search(rf"^Inst atedevd \({re.escape(VERSION)}-1 ", r.stdout, re.M), r.stdout


def test_deb_maintainer_scripts_enable_start_reload_and_stop_the_unit(deb):
    path, _ = deb
    script = {s: run("dpkg-deb", "-I", str(path), s).stdout for s in ("postinst", "prerm", "postrm")}
    assert "deb-systemd-helper enable 'atedevd.service'" in script["postinst"]
    assert "deb-systemd-invoke start 'atedevd.service'" in script["postinst"]  # a first install
    assert "_dh_action=restart" not in script["postinst"]  # an upgrade is a reload (below), not debhelper's restart
    assert "deb-systemd-invoke stop 'atedevd.service'" in script["prerm"]
    # An upgrade reloads the unit in the new postinst, after the unpack: the running daemon
    # hands over to the new code without a window. Nothing stops it before the unpack (a stop
    # there left the node without the resource through the unpack: 0.64-0.82 s, docs/design.md),
    # prerm stops it only on removal.
    assert re.search(r'^if .*\[ "\$1" = remove \] .*\n\tdeb-systemd-invoke stop', script["prerm"], re.M), script["prerm"]
    preinst = run("dpkg-deb", "-I", str(path), "preinst", check=False).stdout
    assert "deb-systemd-invoke stop" not in preinst, preinst
    assert "deb-systemd-helper purge 'atedevd.service'" in script["postrm"]
    assert "rmdir \"$standby\"" in script["postrm"]  # a killed daemon's standby directory goes too
    assert re.search(r'if \[ "\$1" = purge \] && \[ -d /run/cdi \] && \[ ! -L /run/cdi \]; then\n'
                     r"    find /run/cdi -maxdepth 1 \\\( -name 'atedevd-\*\.json'", script["postrm"]), script["postrm"]
    # (its CDI specs go at a purge only: a removal, as a stop, leaves the names kubelet checkpointed resolvable)


@pytest.mark.parametrize("unit_changed, expected", [(False, "reload"), (True, "restart")])
def test_deb_upgrade_reloads_a_running_daemon_and_restarts_it_only_for_a_changed_unit(deb, tmp_path, unit_changed,
                                                                                  expected):
    """The postinst, run as dpkg runs it on an upgrade, with systemctl and deb-systemd-invoke
    stubbed: the running unit is reloaded (the upgrade to the new code), or restarted when its
    unit file changed (a new sandbox applies only to a process systemd starts)."""
    path, _ = deb
    root = tmp_path / "root"
    root.mkdir()
    run("dpkg-deb", "-e", str(path), str(root / "DEBIAN"))
    unit = tmp_path / "lib" / "atedevd.service"
    unit.parent.mkdir()
    unit.write_text("[Service]\nExecStart=/usr/bin/atedevd run\n")
    before = tmp_path / "run" / "atedevd-upgrade.service"
    before.parent.mkdir()
    before.write_text(unit.read_text() + ("# changed\n" if unit_changed else ""))
    stub, log = tmp_path / "bin", tmp_path / "calls"
    stub.mkdir()
    for name in ("systemctl", "deb-systemd-invoke", "deb-systemd-helper", "py3compile", "pybuild-autopkgtest"):
        (stub / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n')
        (stub / name).chmod(0o755)
    script = (root / "DEBIAN" / "postinst").read_text()
    script = script.replace("/lib/systemd/system/atedevd.service", str(unit)).replace(
        "/run/atedevd-upgrade.service", str(before)).replace("[ -d /run/systemd/system ]", "true")
    run("/bin/sh", "-ec", script, "postinst", "configure", f"{VERSION}-1", env=dict(ENV, PATH=f"{stub}:/usr/bin:/bin"))
    calls = [c for c in log.read_text().splitlines() if c.startswith("deb-systemd-invoke")]
    assert calls == ["deb-systemd-invoke start atedevd.service", f"deb-systemd-invoke {expected} atedevd.service"], calls
    assert not before.exists()


def test_deb_entry_point_runs_on_debian_python_with_the_shipped_config(deb):
    _, tree = deb
    launcher = tree / "usr/bin/atedevd"
    assert launcher.read_text().splitlines()[0] == "#!/usr/bin/python3"
    env = dict(ENV, PYTHONPATH=str(tree / "usr/lib/python3/dist-packages"))
    r = run("/usr/bin/python3", str(launcher), "--version", env=env, cwd=tree)
    assert r.stdout.startswith(f"atedevd {VERSION}\npackage: deb\nruns on: grpcio "), r.stdout
    r = run("/usr/bin/python3", str(launcher), "check-config", "--config", str(tree / "etc/atedevd/config.toml"), env=env, cwd=tree)
    assert r.stdout.startswith("config OK"), r.stdout
    where = run("/usr/bin/python3", "-c", "import atedevd.cli; print(atedevd.__file__)", env=env, cwd=tree).stdout
    assert where.startswith(str(tree)), "tested the tree, not the packaged copy"


def test_lintian_pedantic_reports_no_errors_or_warnings(deb):
    path, _ = deb
    changes = next(DIST.glob(f"atedevd_{VERSION}-1_*.changes"))
    r = run("lintian", "--pedantic", "--fail-on", "error,warning", str(changes), check=False)
    bad = [line for line in r.stdout.splitlines() if line.startswith(("E:", "W:"))]
    assert not bad and r.returncode == 0, r.stdout + r.stderr
    # Every override says why.
    lines = (ROOT / "debian/atedevd.lintian-overrides").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert i > 0 and lines[i - 1].startswith("# ") and len(lines[i - 1]) > 20, f"override without a reason: {line}"


def test_make_deb_with_a_debian_revision_builds_a_genuine_upgrade():
    changelog = (ROOT / "debian/changelog").read_bytes()
    before = leftovers()
    run("make", "-C", str(ROOT), "deb", "DEB_REVISION=2", cwd=ROOT)
    path = DIST / f"atedevd_{VERSION}-2_all.deb"
    assert run("dpkg-deb", "-f", str(path), "Version").stdout.strip() == f"{VERSION}-2"
    run("dpkg", "--compare-versions", f"{VERSION}-2", "gt", f"{VERSION}-1")
    assert (ROOT / "debian/changelog").read_bytes() == changelog, "the revision entry belongs in the temp copy only"
    assert leftovers() == before
    r = run("make", "-C", str(ROOT), "deb", "DEB_REVISION=bad_rev", cwd=ROOT, check=False)
    assert r.returncode != 0 and "is not a Debian revision" in r.stderr


# ---------------------------------------------------------------- .rpm


@pytest.fixture(scope="module")
def rpm(tmp_path_factory):
    before = leftovers()
    run("make", "-C", str(ROOT), "rpm", cwd=ROOT)
    path = DIST / f"atedevd-{VERSION}-1.noarch.rpm"
    assert path.is_file()
    assert leftovers() == before, "make rpm left build products in the work tree"
    return path


def rpmq(path, *args):
    return run("rpm", "-qp", *args, str(path)).stdout


def test_rpm_version_release_arch_follow_the_single_version(rpm):
    assert rpmq(rpm, "--qf", "%{NAME} %{VERSION} %{RELEASE} %{ARCH}") == f"atedevd {VERSION} 1 noarch"


def test_rpm_installs_the_same_files_in_its_private_directory(rpm, deb):
    paths = set(rpmq(rpm, "-l").split())
    for f in ("/usr/bin/atedevd", "/usr/lib/systemd/system/atedevd.service", "/etc/atedevd/config.toml",
              "/usr/share/man/man8/atedevd.8.gz", "/usr/share/man/man5/atedevd.toml.5.gz",
              "/usr/share/doc/atedevd/README.md", "/usr/share/doc/atedevd/dra.conf.example",
              "/usr/share/doc/atedevd/deviceclasses.json", "/usr/share/licenses/atedevd/LICENSE",
              "/usr/share/licenses/atedevd/inotify-LICENSE", "/usr/share/licenses/atedevd/sdnotify-LICENSE.txt",
              "/usr/lib/atedevd/site-packages/inotify/calls.py", "/usr/lib/atedevd/site-packages/sdnotify/__init__.py"):
        assert f in paths, f
    # Whatever the node's Python: no site directory, no bytecode of the build host's Python.
    assert not [p for p in paths if re.match(r"/usr/lib/python3|.*\.pyc$|.*__pycache__", p)]
    site = "/usr/lib/atedevd/"
    packaged = {p.removeprefix(site) for p in paths if p.startswith(site + "atedevd/") and p.endswith((".py", ".proto"))}
    assert packaged == python_package_files()
    # The .deb carries the same package.
    assert packaged == {p.removeprefix("/usr/lib/python3/dist-packages/") for p in deb_paths(deb[0])
                        if p.startswith("/usr/lib/python3/dist-packages/atedevd/") and p.endswith((".py", ".proto"))}
    flags = dict(line.split() for line in rpmq(rpm, "--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]").splitlines()
                 if len(line.split()) == 2)
    assert set(flags["/etc/atedevd/config.toml"]) >= {"c", "n"}, "config must be %config(noreplace)"
    assert "l" in flags["/usr/share/licenses/atedevd/LICENSE"], "LICENSE must be %license"
    assert rpmq(rpm, "--configfiles").split() == ["/etc/atedevd/config.toml"]


def test_rpm_launcher_runs_the_packaged_copy_and_names_its_flavour(rpm, tmp_path):
    run("sh", "-c", f"cd {tmp_path} && rpm2cpio {rpm} | cpio -idm --quiet")
    lib = tmp_path / "usr/lib/atedevd"
    code = (f"import sys; sys.path[:0] = [{str(lib)!r}, {str(lib / 'site-packages')!r}]; "
            "import atedevd, inotify; from atedevd.launch import main; print(atedevd.__file__, inotify.__file__); sys.exit(main(['--version']))")
    out = run("/usr/bin/python3", "-I", "-c", code).stdout
    assert out.startswith(f"{lib}/atedevd/__init__.py {lib}/site-packages/inotify/__init__.py\natedevd {VERSION}\npackage: rpm\n"), out
    launcher = (tmp_path / "usr/bin/atedevd").read_text()
    assert launcher.startswith("#!/usr/bin/python3 -I\n") and '"/usr/lib/atedevd"' in launcher


def test_rpm_bundled_versions_follow_the_lock():
    lock = (ROOT / "packaging/bundled/requirements.lock").read_text()
    spec = (ROOT / "rpm/atedevd.spec").read_text()
    for name in ("inotify", "sdnotify"):
        pinned = re.search(rf"^{name}==(\S+)", lock, re.M).group(1)
        assert re.search(rf"^%global {name}_version {re.escape(pinned)}$", spec, re.M), name


def test_rpm_requires_every_runtime_dependency(rpm):
    requires = rpmq(rpm, "--requires")
    named = set(re.findall(r"^python3dist\(([^)]+)\)", requires, re.M))
    assert RPM_RUNTIME <= named, requires
    assert re.search(r"^systemd$", requires, re.M)


def scriptlets(path):
    out = rpmq(path, "--scripts")
    parts = re.split(r"^(\w+) scriptlet \(using /bin/sh\):\n", out, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("scriptlet,arg,expected", [
    ("postinstall", "1", ["--no-reload preset atedevd.service"]),  # first install: preset policy
    ("postinstall", "2", []),  # upgrade: leave the admin's choice alone
    ("preuninstall", "0", ["--no-reload disable --now atedevd.service"]),  # removal: stop and disable
    ("preuninstall", "1", []),  # upgrade: keep running
    ("postuninstall", "1", ["daemon-reload"]),  # upgrade: the reload is %posttrans's
    ("postuninstall", "0", ["daemon-reload"]),
])
def test_rpm_systemd_scriptlets_do_the_usual_thing(rpm, tmp_path, scriptlet, arg, expected):
    script = scriptlets(rpm)[scriptlet]
    stub = tmp_path / "bin"
    stub.mkdir()
    log = tmp_path / "calls"
    (stub / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (stub / "systemctl").chmod(0o755)
    run("/bin/sh", "-ec", script, "scriptlet", arg, env=dict(ENV, PATH=f"{stub}:/usr/bin:/bin"))
    calls = log.read_text().splitlines() if log.exists() else []
    assert calls == expected


def test_rpm_erase_removes_our_cdi_specs_only(rpm):
    """A killed daemon leaves its CDI specs in /run/cdi: an erase removes ours (atedevd-*.json), no one else's."""
    script = scriptlets(rpm)["postuninstall"]
    assert re.search(r'if \[ "\$1" -eq 0 \] && \[ -d /run/cdi \] && \[ ! -L /run/cdi \]; then\n    find /run/cdi '
                     r"-maxdepth 1 \\\( -name 'atedevd-\*\.json' -o -name '\.atedevd-\*\.tmp' \\\)", script), script


@pytest.mark.parametrize("unit_changed, expected", [(False, "reload"), (True, "try-restart")])
def test_rpm_upgrade_reloads_a_running_daemon_and_restarts_it_only_for_a_changed_unit(rpm, tmp_path, unit_changed,
                                                                                   expected):
    """%pre keeps the unit file as it was; %posttrans reloads the running unit (the upgrade to
    the new code), or restarts it when the unit file changed."""
    scripts = scriptlets(rpm)
    unit = tmp_path / "atedevd.service"
    unit.write_text("[Service]\nExecStart=/usr/bin/atedevd run\n")
    before = tmp_path / "atedevd-upgrade.service"
    stub, log = tmp_path / "bin", tmp_path / "calls"
    stub.mkdir()
    (stub / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (stub / "systemctl").chmod(0o755)
    env = dict(ENV, PATH=f"{stub}:/usr/bin:/bin")

    def local(script):
        return script.replace("/usr/lib/systemd/system/atedevd.service", str(unit)).replace(
            "/run/atedevd-upgrade.service", str(before))
    run("/bin/sh", "-ec", local(scripts["preinstall"]), "scriptlet", "2", env=env)
    assert before.read_text() == unit.read_text()
    if unit_changed:
        unit.write_text(unit.read_text() + "# changed\n")
    run("/bin/sh", "-ec", local(scripts["posttrans"]), "scriptlet", env=env)
    assert log.read_text().splitlines() == ["is-active --quiet atedevd.service", f"{expected} atedevd.service"]
    assert not before.exists()


def test_rpm_spec_uses_fedora_macros_when_they_exist():
    fedora = ["--define", "atedevd_version 9.9.9", "--define", "fedora 41",
              "--define", "systemd_post() SD_POST %1", "--define", "systemd_preun() SD_PREUN %1",
              "--define", "systemd_postun() SD_POSTUN %1", "--define", "systemd_requires Requires(post): SD_REQUIRES",
              "--define", "_unitdir /usr/lib/systemd/system"]
    spec = run("rpmspec", "-P", *fedora, str(ROOT / "rpm/atedevd.spec")).stdout
    for marker in ("SD_POST atedevd.service", "SD_PREUN atedevd.service", "SD_POSTUN atedevd.service", "SD_REQUIRES",
                   "BuildRequires:  systemd-rpm-macros"):
        assert marker in spec, marker
    assert "preset atedevd.service" not in spec
    plain = run("rpmspec", "-P", "--define", "atedevd_version 9.9.9", str(ROOT / "rpm/atedevd.spec")).stdout
    assert "preset atedevd.service" in plain and "systemd-rpm-macros" not in plain
    # What the plain path runs in %prep/%install/%check, it build-requires.
    for tool in ("python3", "tar", "gzip"):
        assert re.search(rf"^BuildRequires:\s+{tool}$", plain, re.M), tool
    # sdnotify: bundled by default, the distribution's with --without bundled_sdnotify.
    assert "bundled(python3dist(sdnotify))" in plain
    dist = run("rpmspec", "-P", "--define", "atedevd_version 9.9.9", "--without", "bundled_sdnotify",
               str(ROOT / "rpm/atedevd.spec")).stdout
    assert "Requires:       python3dist(sdnotify)" in dist and "bundled(python3dist(sdnotify))" not in dist


def test_source_packages_build(tmp_path):
    """dpkg-buildpackage -S (3.0 (quilt), the orig tarball generated) and rpmbuild -ts."""
    env = dict(ENV, DIST_DIR=str(tmp_path))
    run("make", "-C", str(ROOT), "deb-source", env=env)
    dsc = tmp_path / f"atedevd_{VERSION}-1.dsc"
    assert dsc.is_file() and (tmp_path / f"atedevd_{VERSION}.orig.tar.gz").is_file()
    run("dpkg-source", "-x", str(dsc), str(tmp_path / "x"), cwd=tmp_path)
    assert (tmp_path / "x/debian/rules").is_file() and (tmp_path / "x/atedevd/daemon/loop.py").is_file()
    run("make", "-C", str(ROOT), "rpm-source", env=env)
    srpm = tmp_path / f"atedevd-{VERSION}-1.src.rpm"
    files = run("rpm", "-qpl", str(srpm)).stdout.split()
    assert sorted(files) == sorted([f"atedevd-{VERSION}.tar.gz", "atedevd.spec", "inotify-0.2.12-py2.py3-none-any.whl",
                                    "sdnotify-0.3.2.tar.gz"])


def test_rpmlint_reports_no_errors(rpm, tmp_path):
    rc = ROOT / "rpm/atedevd.rpmlintrc"
    # One rpmlintrc serves the rpm and the spec: a filter for the spec alone is unused for the rpm.
    r = run("rpmlint", "--ignore-unused-rpmlintrc", "-r", str(rc), str(rpm), check=False)
    assert re.search(r"\b0 errors\b", r.stdout) and r.returncode == 0, r.stdout + r.stderr
    # The spec itself, with the version the build passes.
    spec = tmp_path / "atedevd.spec"
    spec.write_text(f"%global atedevd_version {VERSION}\n" + (ROOT / "rpm/atedevd.spec").read_text())
    r = run("rpmlint", "--ignore-unused-rpmlintrc", "-r", str(rc), str(spec), check=False)
    assert re.search(r"\b0 errors\b", r.stdout) and r.returncode == 0, r.stdout + r.stderr
    # Every filter says why.
    lines = rc.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("addFilter"):
            assert lines[i - 1].startswith("# "), f"filter without a reason: {line}"


# ---------------------------------------------------------------- Packer example


def test_packer_provisioner_script_is_clean_shell():
    script = PACKER / "install-atedevd.sh"
    assert os.access(script, os.X_OK)
    run("sh", "-n", str(script))
    run("bash", "-n", str(script))
    assert shutil.which("shellcheck", path=ENV["PATH"]), "shellcheck is a test dependency (apt install shellcheck)"
    run("shellcheck", "--shell=sh", str(script))


def _provision(tmp_path, managers, package, atedevd_rc=0, cwd=None):
    """Run the provisioner with stub package managers, systemctl and atedevd; return (result, calls)."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    log = tmp_path / "calls"
    for name in managers + ["systemctl"]:
        (stub / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n')
    (stub / "atedevd").write_text(f'#!/bin/sh\necho "atedevd $*" >> {log}\nexit {atedevd_rc}\n')
    for p in stub.iterdir():
        p.chmod(0o755)
    env = {"PATH": str(stub)}  # nothing else: the script must need only its shell and these commands
    if package is not None:
        env["ATEDEVD_PACKAGE"] = package
    r = subprocess.run(["/bin/sh", str(PACKER / "install-atedevd.sh")], env=env, cwd=cwd or tmp_path,
                       capture_output=True, text=True)
    return r, (log.read_text().splitlines() if log.exists() else [])


def test_packer_provisioner_installs_a_deb_with_apt_enables_and_checks(tmp_path):
    (tmp_path / "atedevd_1_all.deb").write_text("")
    r, calls = _provision(tmp_path, ["apt-get"], "atedevd_1_all.deb")  # relative: made absolute for apt
    assert r.returncode == 0, r.stderr
    assert calls == ["apt-get update",
                     f"apt-get install -y --no-install-recommends {tmp_path}/atedevd_1_all.deb",
                     "systemctl enable atedevd.service",
                     "atedevd check-config"]


def test_packer_provisioner_installs_an_rpm_with_dnf(tmp_path):
    (tmp_path / "atedevd-1-1.noarch.rpm").write_text("")
    r, calls = _provision(tmp_path, ["dnf", "yum"], str(tmp_path / "atedevd-1-1.noarch.rpm"))
    assert r.returncode == 0, r.stderr
    assert calls == [f"dnf install -y {tmp_path}/atedevd-1-1.noarch.rpm",
                     "systemctl enable atedevd.service", "atedevd check-config"]


@pytest.mark.parametrize("managers,package,message", [
    (["apt-get"], "atedevd-1-1.noarch.rpm", "needs the .deb"),
    (["dnf"], "atedevd_1_all.deb", "needs the .rpm"),
    ([], "atedevd_1_all.deb", "no apt-get, dnf or yum"),
    (["apt-get"], "missing.deb", "no such file"),
    (["apt-get"], None, "set ATEDEVD_PACKAGE"),
])
def test_packer_provisioner_refuses_clearly(tmp_path, managers, package, message):
    for f in ("atedevd-1-1.noarch.rpm", "atedevd_1_all.deb"):
        (tmp_path / f).write_text("")
    r, calls = _provision(tmp_path, managers, package)
    assert r.returncode != 0 and message in r.stderr
    assert calls == []


def test_packer_provisioner_fails_the_bake_on_a_bad_config(tmp_path):
    (tmp_path / "a.deb").write_text("")
    r, calls = _provision(tmp_path, ["apt-get"], "a.deb", atedevd_rc=78)
    assert r.returncode == 78 and calls[-1] == "atedevd check-config"


def test_packer_template_references_only_what_it_declares():
    hcl = (PACKER / "atedevd.pkr.hcl").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in hcl.splitlines())
    assert code.count("{") == code.count("}") and code.count("[") == code.count("]")
    declared = set(re.findall(r'^variable\s+"(\w+)"', code, re.M))
    used = set(re.findall(r"\bvar\.(\w+)", code))
    assert used == declared, f"used but undeclared: {used - declared}, declared but unused: {declared - used}"
    # Variables without a default are what the user must set; the README names them.
    blocks = dict(re.findall(r'^variable\s+"(\w+)"\s*\{(.*?)^\}', code, re.M | re.S))
    required = {name for name, body in blocks.items() if not re.search(r"^\s*default\s*=", body, re.M)}
    assert required == {"atedevd_package", "source_ami"}
    readme = (ROOT / "README.md").read_text()
    assert all(name in readme for name in required)
    locals_block = re.search(r"^locals\s*\{(.*?)^\}", code, re.M | re.S).group(1)
    assert set(re.findall(r"\blocal\.(\w+)", code)) <= set(re.findall(r"^\s*(\w+)\s*=", locals_block, re.M))
    sources = {f"source.{t}.{n}" for t, n in re.findall(r'^source\s+"([\w-]+)"\s+"(\w+)"', code, re.M)}
    assert set(re.findall(r'"(source\.[\w-]+\.\w+)"', code)) == sources and sources
    for script in re.findall(r'\$\{path\.root\}/([\w.-]+)', code):
        assert (PACKER / script).is_file(), script
    # The variable the template sets is the one the provisioner reads.
    assert "ATEDEVD_PACKAGE=" in code and "${ATEDEVD_PACKAGE:-}" in (PACKER / "install-atedevd.sh").read_text()


@pytest.mark.parametrize("manager,package,names", [
    ("apt-get", "atedevd_1_all.deb", "make deb-bundled PYTHON_VERSION="),
    ("dnf", "atedevd-1-1.noarch.rpm", "make rpm-bundled PYTHON_VERSION="),
])
def test_packer_provisioner_names_the_self_contained_package_when_dependencies_fail(tmp_path, manager, package, names):
    (tmp_path / package).write_text("")
    stub = tmp_path / "bin"
    stub.mkdir()
    # The package manager refuses (unresolvable dependencies); python3 reports the image's Python.
    (stub / manager).write_text('#!/bin/sh\n[ "$1" = update ] && exit 0\necho "unmet dependencies" >&2\nexit 100\n')
    (stub / "python3").write_text('#!/bin/sh\necho 3.10\n')
    (stub / "systemctl").write_text("#!/bin/sh\nexit 0\n")
    for p in stub.iterdir():
        p.chmod(0o755)
    r = subprocess.run(["/bin/sh", str(PACKER / "install-atedevd.sh")], env={"PATH": str(stub), "ATEDEVD_PACKAGE": package},
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("install-atedevd: ") and "cannot install its dependencies" in last, last
    assert names + "3.10" in last and "atedevd-bundled" in last, last


# ---------------------------------------------------------------- self-contained packages


@pytest.fixture(scope="module")
def bundled39(tmp_path_factory):
    dist = tmp_path_factory.mktemp("bundled")
    run("make", "-C", str(ROOT), "deb-bundled", "PYTHON_VERSION=3.9", env=dict(ENV, DIST_DIR=str(dist)))
    deb = next(dist.glob(f"atedevd-bundled_{VERSION}-1+py39_*.deb"))
    tree = dist / "tree"
    run("dpkg-deb", "-x", str(deb), str(tree))
    return deb, tree


def test_bundled_deb_is_small_pinned_and_licensed(bundled39):
    deb, tree = bundled39
    assert deb.stat().st_size <= 20 * 1024 * 1024, deb.stat().st_size
    fields = {k: run("dpkg-deb", "-f", str(deb), k).stdout.strip() for k in ("Package", "Depends", "Conflicts")}
    assert fields["Package"] == "atedevd-bundled" and fields["Conflicts"] == "atedevd"
    deps = [d.strip() for d in fields["Depends"].split(",")]
    assert "python3 (>= 3.9)" in deps and "python3 (<< 3.10)" in deps and "libc6 (>= 2.17)" in deps, deps
    assert not [d for d in deps if d.startswith(("python3-", "python3-grpcio", "python3-protobuf"))], deps
    site = tree / "usr/lib/atedevd/site-packages"
    lock = (ROOT / "packaging/bundled/requirements.lock").read_text()
    for name, version in re.findall(r"^([a-z-]+)==(\S+)", lock, re.M):
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        assert info.is_dir(), info
        assert (tree / "usr/share/doc/atedevd-bundled/bundled" / info.name[: -len(".dist-info")]).is_dir(), name
    assert list(site.glob("grpc/_cython/cygrpc.cpython-39-*.so")) and list(site.glob("yaml/_yaml.cpython-39-*.so"))
    assert not list(tree.rglob("*.pyc")) and not list(tree.rglob("__pycache__"))
    assert not [p.name for p in site.iterdir() if p.is_file() and p.suffix != ".py"], "a console script in site-packages"
    copyright_ = (tree / "usr/share/doc/atedevd-bundled/copyright").read_text()
    for spdx in ("Apache-2.0-grpcio", "BSD-3-Clause-protobuf", "GPL-2.0-only-inotify", "MIT-sdnotify",
                 "Apache-2.0-kubernetes", "MIT-pyyaml", "MPL-2.0-certifi", "ISC-requests-oauthlib"):
        assert f"License: {spdx}" in copyright_, spdx


def test_bundled_deb_is_closed_under_its_projects_requirements(bundled39):
    # What pip's resolver would ask for on Python 3.9: every Requires-Dist (extras aside) of every
    # bundled project is bundled too, at a version it accepts (fetch itself runs pip with --no-deps).
    # One exception: inotify 0.2.12's wheel names `build`, the PEP 517 front end it was built
    # with, as a run-time requirement; nothing of inotify imports it.
    from email.parser import Parser

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    unneeded = {("inotify", "build")}
    _, tree = bundled39
    site = tree / "usr/lib/atedevd/site-packages"
    meta = {}
    for info in site.glob("*.dist-info"):
        m = Parser().parsestr((info / "METADATA").read_text(encoding="utf-8"), headersonly=True)
        meta[canonicalize_name(m["Name"])] = (m["Version"], m.get_all("Requires-Dist") or [])
    env = {"python_version": "3.9", "python_full_version": "3.9.2", "extra": ""}
    missing = []
    for name, (_, requires) in sorted(meta.items()):
        for req in map(Requirement, requires):
            if (req.marker is not None and not req.marker.evaluate(env)) or (name, canonicalize_name(req.name)) in unneeded:
                continue
            have = meta.get(canonicalize_name(req.name))
            if have is None or not req.specifier.contains(have[0], prereleases=True):
                missing.append(f"{name} requires {req}, bundled: {have[0] if have else 'nothing'}")
    assert not missing, missing
    assert "google-auth" not in meta, "kubernetes' google-auth is an extra (GKE auth plugins): not bundled"


def test_bundled_deb_carries_the_kubernetes_client_for_dra_mode(bundled39):
    # The installed tree alone (-S: no dist-packages to fall back on), the client as pinned, and
    # atedevd's DRA module driving it against the API server stand-in: discovery of
    # resource.k8s.io/v1, a write, a list, a watch through the dynamic client. This host's python3
    # is not 3.9: PyYAML's cp39 extension is left aside there for its pure-Python loader.
    _, tree = bundled39
    lib = tree / "usr/lib/atedevd"
    site = lib / "site-packages"
    pinned = re.search(r"^kubernetes==(\S+)", (ROOT / "packaging/bundled/requirements.lock").read_text(), re.M).group(1)
    code = f"""
import sys, tempfile
sys.path[:0] = [{str(lib)!r}, {str(site)!r}]
sys.path.append({str(ROOT)!r})  # rig, for the stand-in
import kubernetes.config, kubernetes.dynamic, urllib3, yaml
from atedevd.dra.cluster import KubeApi
from rig.apiserver_standin import ApiServerStandIn
for m in (kubernetes, urllib3, yaml):
    assert m.__file__.startswith({str(site)!r}), m.__file__
assert KubeApi.__module__ == "atedevd.dra.cluster" and sys.modules["atedevd"].__file__.startswith({str(lib)!r})
api = ApiServerStandIn("node-a")
k = KubeApi(api.kubeconfig(tempfile.mkstemp()[1]))
items, version = k.slices("node-a", "ate.dev")
k.create_slice({{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {{"name": "s"}},
                "spec": {{"nodeName": "node-a", "driver": "ate.dev", "pool": {{"name": "node-a", "generation": 1,
                         "resourceSliceCount": 1}}, "devices": [{{"name": "kvm"}}]}}}})
print(kubernetes.__version__, k.whoami(), len(items), len(k.slices("node-a", "ate.dev")[0]),
      next(k.watch_slices("node-a", "ate.dev", version)))
"""
    out = run("/usr/bin/python3", "-I", "-S", "-c", code, timeout=60).stdout.split()
    assert out == [pinned, "system:node:node-a", "0", "1", "ADDED"], out


def test_bundled_package_on_another_python_exits_with_one_clear_line(bundled39):
    _, tree = bundled39
    lib = tree / "usr/lib/atedevd"
    code = (f"import sys; sys.path[:0] = [{str(lib)!r}, {str(lib / 'site-packages')!r}]; "
            "from atedevd.launch import main; sys.exit(main(['run']))")
    r = run("/usr/bin/python3", "-I", "-c", code, check=False)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("atedevd: this self-contained package was built for Python 3.9, but ") and \
        "PYTHON_VERSION=3.11" in r.stderr, r.stderr


def test_a_missing_dependency_is_one_clear_line(tmp_path):
    # A node without grpc: the launcher names the module and the package to install instead.
    shadow = tmp_path / "grpc"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named grpc (simulated)')\n")
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]; "
            "from atedevd.launch import main; sys.exit(main(['run']))")
    r = run("/usr/bin/python3", "-I", "-c", code, check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot import grpc" in r.stderr and "python3-grpcio" in r.stderr and "atedevd-bundled" in r.stderr, r.stderr


def test_journald_native_protocol_encoding():
    from atedevd.systemd import NativeJournalHandler, encode_fields

    assert encode_fields({"A": "x", "B": "two\nlines"}) == b"A=x\nB\n" + (9).to_bytes(8, "little") + b"two\nlines\n"
    import logging
    import socket

    path = "\0atedevd-test-journal-%d" % os.getpid()
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)
    h = NativeJournalHandler(path, SYSLOG_IDENTIFIER="atedevd")
    record = logging.LogRecord("atedevd", logging.WARNING, "f.py", 7, "hello %s", ("x",), None, func="fn")
    record.ATEDEVD_RESOURCE = "ate.dev/kvm"
    record.lowercase = "dropped"
    h.emit(record)
    got = dict(line.split("=", 1) for line in sink.recv(65536).decode().splitlines())
    assert got["MESSAGE"] == "hello x" and got["PRIORITY"] == "4" and got["ATEDEVD_RESOURCE"] == "ate.dev/kvm"
    assert got["SYSLOG_IDENTIFIER"] == "atedevd" and got["CODE_LINE"] == "7" and "lowercase" not in got
    h.close()
    sink.close()
