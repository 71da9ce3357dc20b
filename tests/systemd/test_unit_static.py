"""systemd/atedevd.service without a running systemd: verify, the exposure score, the keys it must carry.

The behaviour of the unit under a real systemd is in test_systemd.py.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rig.harness import REPO as HARNESS_REPO

REPO = Path(HARNESS_REPO)
UNIT = REPO / "systemd/atedevd.service"
MAN = REPO / "man/atedevd.8"
MAX_EXPOSURE = 1.0


def parse_unit(text: str):
    """{section: [(key, value), ...]} with continuation lines joined; keys may repeat, as in systemd."""
    sections, current, pending = {}, None, ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def values(unit, section, key):
    """Effective values of a key: an empty assignment resets the list, as systemd does."""
    out = []
    for k, v in unit.get(section, []):
        if k == key:
            out = [] if v == "" else out + [v]
    return out


def one(unit, section, key):
    v = values(unit, section, key)
    assert v, f"[{section}] {key}= is missing"
    return v[-1]


def seconds(span: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|sec|min)?", span)
    assert m, f"unexpected time span {span!r}"
    return float(m.group(1)) * {"ms": 0.001, "min": 60}.get(m.group(2), 1)


@pytest.fixture(scope="module")
def unit():
    return parse_unit(UNIT.read_text())


def fake_root(tmp_path: Path, unit_text: str) -> Path:
    """A root for `systemd-analyze --root`: the host's units, stub binaries for the unit's commands."""
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/lib/systemd").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    for name in ("atedevd", "mkdir", "kill"):
        stub = root / "usr/bin" / name
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/atedevd.service").write_text(unit_text)
    return root


def verify(tmp_path: Path, unit_text: str) -> str:
    root = fake_root(tmp_path, unit_text)
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", "atedevd.service"],
                       capture_output=True, text=True)
    return (p.stdout + p.stderr).strip() + ("" if p.returncode == 0 else f"\n(exit {p.returncode})")


def test_verify_prints_nothing(tmp_path):
    assert verify(tmp_path, UNIT.read_text()) == ""


def test_verify_check_catches_a_typo(tmp_path):
    """The check above can fail: verify exits 0 on an unknown key but says so, and that output is what counts."""
    out = verify(tmp_path, UNIT.read_text().replace("[Service]\n", "[Service]\nWatchDogSec=5\n", 1))
    assert "Unknown key" in out and "WatchDogSec" in out


def exposure(unit_path: Path) -> float:
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit_path)],
                       capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", p.stdout)
    assert m, f"no exposure level in:\n{p.stdout}\n{p.stderr}"
    return float(m.group(1))


def test_exposure_at_most_1(tmp_path):
    score = exposure(UNIT)
    assert score <= MAX_EXPOSURE, f"exposure {score} > {MAX_EXPOSURE}"


def test_exposure_check_can_fail(tmp_path):
    """Without its sandbox the same unit scores far above the limit (a plain Type=notify unit: 9.6)."""
    text = UNIT.read_text()
    plain = text[: text.index("# Sandbox")] + text[text.index("[Install]"):]
    path = tmp_path / "atedevd.service"
    path.write_text(plain)
    assert exposure(path) > 9


def test_service_contract(unit):
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert values(unit, "Service", "ExecStart") == ["/usr/bin/atedevd run"]
    assert re.fullmatch(r"/(usr/)?bin/kill -(s )?HUP \$MAINPID", one(unit, "Service", "ExecReload"))
    assert one(unit, "Service", "RuntimeDirectory") == "atedevd"


def test_restart_policy(unit):
    assert one(unit, "Service", "Restart") in ("always", "on-failure")
    # Back within 400 ms of a crash: systemd's part is RestartSec=; a crash loop is slowed by
    # the daemon (atedevd/daemon/restarts.py), whose marker must outlive a restart and not a stop.
    assert seconds(one(unit, "Service", "RestartSec")) <= 0.1
    assert one(unit, "Service", "RuntimeDirectoryPreserve") == "restart"
    # Before=kubelet.service: a start that hangs holds kubelet back at boot this long at most,
    # which leaves room for the longest crash-loop wait (restarts.MAX_DELAY_S) and a start.
    assert 10 < seconds(one(unit, "Service", "TimeoutStartSec")) <= 30
    assert "78" in one(unit, "Service", "RestartPreventExitStatus").split()
    watchdog = seconds(one(unit, "Service", "WatchdogSec"))
    # Long enough for kubelet's 10 s dial-back inside Register, short enough to matter.
    assert 10 < watchdog <= 60


def test_ordered_before_kubelet_without_depending_on_it(unit):
    """At boot atedevd is up before kubelet first serves; a failed atedevd never holds kubelet back."""
    assert "kubelet.service" in " ".join(values(unit, "Unit", "Before")).split()
    for key in ("Requires", "Requisite", "Wants", "BindsTo", "PartOf", "Upholds", "After", "RequiredBy", "WantedBy"):
        for section in ("Unit", "Install"):
            assert "kubelet.service" not in " ".join(values(unit, section, key)).split(), (section, key)


def test_documentation(unit):
    docs = " ".join(values(unit, "Unit", "Documentation")).split()
    assert "man:atedevd(8)" in docs
    assert any("README" in d for d in docs)


def test_sandbox_keeps_what_the_daemon_needs(unit):
    # The host's /dev stays visible (stat /dev/kvm, inotify on /dev) but no device node can be opened.
    assert values(unit, "Service", "PrivateDevices") in ([], ["no"])
    assert one(unit, "Service", "DevicePolicy") == "closed"
    assert values(unit, "Service", "DeviceAllow") == []
    assert one(unit, "Service", "ProtectSystem") == "strict"
    # "-": systemd binds ReadWritePaths= even for the "+" mkdir that creates it (see below).
    # The second: node_exporter's textfile directory (atedevd.prom), only where it exists.
    # The third: the runtimes' dynamic CDI spec directory (cdi = true), which the same mkdir makes.
    assert values(unit, "Service", "ReadWritePaths") == ["-/var/lib/kubelet/device-plugins", "-/var/lib/prometheus/node-exporter",
                                                         "-/run/cdi"]
    assert one(unit, "Service", "RestrictAddressFamilies") == "AF_UNIX"
    # Set and empty: no capabilities at all (an unset key would mean all of them).
    assert ("CapabilityBoundingSet", "") in unit["Service"] and values(unit, "Service", "CapabilityBoundingSet") == []


def test_missing_plugin_dir_is_created_before_the_sandbox(unit):
    """ReadWritePaths= on a missing directory fails with 226/NAMESPACE: an unsandboxed mkdir -p runs first.

    test_systemd.py proves it under systemd, with the directory missing and present."""
    pre = values(unit, "Service", "ExecStartPre")
    assert any(p.startswith("-+") and "mkdir -p" in p and p.endswith("/var/lib/kubelet/device-plugins") for p in pre), pre
    assert any(p.startswith("-+") and "mkdir -p" in p and " /run/cdi " in p for p in pre), pre


def test_installed_for_multi_user(unit):
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_man_page_renders_without_warnings():
    """Documentation=man:atedevd(8) points at man/atedevd.8: it must render cleanly."""
    p = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", str(MAN)],
                       capture_output=True, text=True, env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    assert p.returncode == 0 and p.stderr == "", p.stderr
    p = subprocess.run(["lexgrog", str(MAN)], capture_output=True, text=True)
    assert p.returncode == 0 and "atedevd - " in p.stdout, p.stdout + p.stderr


def test_man_page_covers_the_cli_and_exit_codes():
    p = subprocess.run(["groff", "-man", "-Tascii", "-P-cbou", str(MAN)], capture_output=True, text=True, check=True)
    text = " ".join(p.stdout.split())
    for word in ("check-config", "--config", "--device-plugin-dir", "--dev-root", "--log-level", "78",
                 "SIGHUP", "ATEDEVD_RESOURCE", "atedevd.toml", "systemctl status atedevd"):
        assert word in text, word
