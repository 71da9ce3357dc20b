"""The .deb built from the working tree, installed and upgraded in a booted container, watched
from kubelet's side.

    build_deb(dist, 2)                       # make deb DEB_REVISION=2 DIST_DIR=dist
    apt_install(node, deb)                   # apt-get install ./deb in the container (no network)
    start_kubelet(node, "1.32")              # the stand-in as kubelet, a unit of its own, recording admission
    r = upgrade(node, newer_deb)             # one upgrade: the rejection window, a timeline, the end state
    assert not r["problems"], r["problems"]

Shared by the install tests (tests/systemd/test_install.py) and the upgrade benchmark (bench/upgrade.py).

The kubelet stand-in runs as its own transient unit (container_admission_standin.py),
outside atedevd's unit and sandbox, as kubelet does on a node; from its start it samples
every millisecond whether kubelet would admit a pod requesting ate.dev/kvm. An upgrade is
`apt-get install ./atedevd_<newer>.deb` over the installed, running, registered daemon,
with dpkg's --status-logger stamping dpkg's progress. Every time here is CLOCK_MONOTONIC,
one clock for the host, the container's systemd and the stand-in.
"""

import json
import re
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import List, Optional, Tuple

from rig.container import (PLUGIN_DIR, RESOURCE, TEST_LIB, Container, our_sockets, standin_state, start_standin,
                           wait_registered, wait_until)
from rig.kubelet_standin import AdmissionLog
from rig.metrics_scrape import parse, value

REPO = Path(__file__).resolve().parent.parent
DEBS = "/var/cache/atedevd-test-debs"  # inside the container
CONFIG = "/etc/atedevd/config.toml"  # the package's conffile
METRICS_DIR = "/var/lib/prometheus/node-exporter"  # where the daemon writes atedevd.prom when it exists
METRICS = METRICS_DIR + "/atedevd.prom"
STATUS_LOG = "/run/atedevd-upgrade-status.log"
UNITS = 1024  # the shipped configuration's count
VERSION = re.search(r'^__version__ = "([^"]+)"$', (REPO / "atedevd/__init__.py").read_text(), re.M).group(1)


def make(dist: Path, *args: str) -> None:
    """`make ARGS DIST_DIR=dist` in the working tree, with Debian's own tools first on PATH."""
    p = subprocess.run(["make", "-C", str(REPO), *args, f"DIST_DIR={dist}"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                                                            "HOME": "/root", "DIST_DIR": str(dist)})
    assert p.returncode == 0, f"make {' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def build_deb(dist: Path, revision: int, version: str = VERSION) -> Path:
    """atedevd_<version>-<revision>_all.deb, built as `make deb DEB_REVISION=<revision>` builds it."""
    make(dist, "deb", f"DEB_REVISION={revision}")
    deb = dist / f"atedevd_{version}-{revision}_all.deb"
    assert deb.is_file(), f"not built: {deb.name}; {dist} has {sorted(p.name for p in dist.iterdir())}"
    return deb


def apt_install(node: Container, deb: Path, *options: str) -> str:
    """apt-get install the .deb (copied into the container first): its dependencies come from
    apt's cache in the CLEAN rootfs, as the container has no network."""
    if not node.path(f"{DEBS}/{deb.name}").is_file():
        node.copy_in(deb, f"{DEBS}/{deb.name}")
    # Not --no-download: apt 2.6 then fails on a local .deb with "Pathname to install is not absolute".
    p = node.run("apt-get", "install", "-y", "--no-install-recommends", *options, f"{DEBS}/{deb.name}",
                 check=False, timeout=300)
    assert p.returncode == 0, f"apt-get install {deb.name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def deb_version(node: Container, package: str) -> str:
    p = node.run("dpkg-query", "-W", "-f=${Status} ${Version}", package, check=False)
    return p.stdout if p.returncode == 0 else ""


def deb_revision(deb: Path) -> str:
    """The version in a .deb's file name: atedevd_0.1.0-2_all.deb -> 0.1.0-2."""
    return deb.name.split("_")[1]


# --- kubelet, outside the unit --------------------------------------------------------------


def start_kubelet(node: Container, mode: str, units: int = UNITS) -> dict:
    """(Re)start the stand-in as kubelet `mode` in a unit of its own, recording admission, and
    wait until atedevd (running) has registered with it. Also makes node_exporter's textfile
    directory, so the daemon writes its metrics (kubelet's own count, read back by upgrade())."""
    node.run("mkdir", "-p", METRICS_DIR)
    start_standin(node, "--kubelet", mode, script="container_admission_standin.py")
    return wait_registered(node, 1, healthy=units)


def metrics(node: Container) -> dict:
    p = node.run("cat", METRICS, check=False)
    if p.returncode != 0:
        return {}
    return parse(p.stdout)[0]


def replayed(transitions) -> AdmissionLog:
    """The stand-in's admission log, read back from its state: rejected() over its transitions."""
    log = AdmissionLog(types.SimpleNamespace(cond=threading.Condition()), RESOURCE)
    log.transitions = [tuple(t) for t in transitions]
    return log


def _cursor(node: Container) -> str:
    out = node.journal("-u", "atedevd", "-n", "0", "--show-cursor")
    return next(line.split("cursor: ", 1)[1] for line in out.splitlines() if "cursor: " in line)


def _unit_times(node: Container) -> dict:
    props = ("ActiveExitTimestampMonotonic", "InactiveEnterTimestampMonotonic", "ExecMainStartTimestampMonotonic",
             "ActiveEnterTimestampMonotonic")
    return {k: int(v) / 1e6 for k, v in node.show("atedevd", *props).items()}


# atedevd's and systemd's journal lines that mark an upgrade's steps: (start of the message, label)
JOURNAL_STEPS = (("Reloading atedevd", "systemd: reload begins (the postinst's systemctl reload)"),
                 ("upgrade: the installed atedevd", "atedevd: the old one finds the upgrade, starts the new one"),
                 ("took over as systemd's main process", "atedevd: the new one is main (MAINPID=)"),
                 ("handed over to the new atedevd", "atedevd: the old one exits"),
                 ("Reloaded atedevd", "systemd: reload done (the new one's READY=1)"),
                 ("Stopping atedevd", "systemd: stop of the old process begins (SIGTERM sent)"))


def _journal_steps(node: Container, cursor: str) -> List[Tuple[float, str]]:
    """The upgrade's (or a restart's) steps from the journal, on the monotonic clock: the
    container's clock is the host's."""
    out = node.run("journalctl", "--no-pager", "-u", "atedevd", f"--after-cursor={cursor}", "-o", "json",
                   "--output-fields=MESSAGE,__MONOTONIC_TIMESTAMP", check=False).stdout
    steps = []
    for line in out.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        message = entry.get("MESSAGE")
        if not isinstance(message, str):
            continue
        for start, label in JOURNAL_STEPS:
            if message.startswith(start) and all(label != seen for _, seen in steps):
                steps.append((int(entry["__MONOTONIC_TIMESTAMP"]) / 1e6, label))
    return steps


def _dpkg_lines(node: Container) -> List[Tuple[float, str]]:
    """dpkg's status lines about atedevd, stamped; one per distinct line (the first)."""
    out = node.run("cat", STATUS_LOG, check=False).stdout
    seen, lines = set(), []
    for raw in out.splitlines():
        at, _, text = raw.partition(" ")
        if "atedevd" in text and text not in seen:
            seen.add(text)
            lines.append((float(at), "dpkg " + text.replace(" atedevd:all:", "").replace(" atedevd:", "")))
    return lines


def upgrade(node: Container, deb: Path, units: int = UNITS, timeout: float = 60.0) -> dict:
    """One package upgrade over the running, registered daemon: `apt-get install ./deb`, then
    wait until the new process is registered and kubelet counts it (the stand-in: a new
    registration connected with `units` healthy and admitting; the daemon's own metrics:
    kubelet's pod-resources count read back as `units`). Returns
      rejected: seconds kubelet would have rejected a pod, from the command's start to that end;
      spells, reasons: rejecting spells and kubelet's reasons;
      pods, put_in: of the pods an admission loop put in every 10 ms meanwhile, rejected and all;
      registers: Register calls kubelet received; accepted: registrations it accepted;
      timeline: [(seconds from the command's start, what)], sorted;
      problems: what is wrong with the end state (empty when it is right).
    """
    before = standin_state(node)
    res0 = before["resources"][RESOURCE]
    calls0 = len(before["timing"]["registers"])
    old_pid = node.main_pid()
    old_sockets = our_sockets(node)
    old_start = value(metrics(node), "atedevd_start_time_seconds")
    restarts = node.show("atedevd", "NRestarts")["NRestarts"]
    cursor = _cursor(node)
    node.run("rm", "-f", STATUS_LOG)
    logger = f"DPkg::Options::=--status-logger=/usr/bin/python3 {TEST_LIB}/container_stamp.py {STATUS_LOG}"
    t0 = time.monotonic()
    apt_install(node, deb, "-o", logger)
    returned = time.monotonic()

    def counted() -> Optional[dict]:
        s = standin_state(node) or {}
        r = (s.get("resources") or {}).get(RESOURCE) or {}
        adm = (s.get("admission") or {}).get("transitions") or []
        if not (r.get("registrations", 0) > res0["registrations"] and r.get("connected") and r.get("healthy") == units
                and adm and adm[-1][1] == "admit"):
            return None
        m = metrics(node)
        if value(m, "atedevd_start_time_seconds") == old_start or \
                value(m, "atedevd_resource_kubelet_allocatable_units", resource=RESOURCE) != units:
            return None
        return {"state": s, "metrics": m}

    end = wait_until(counted, timeout, "the new process registered, healthy and counted by kubelet",
                     lambda: f"stand-in: {standin_state(node)}\n" + node.journal("-u", "atedevd", "-n", "30"),
                     interval=0.05)
    t1 = time.monotonic()
    s, m = end["state"], end["metrics"]
    r = s["resources"][RESOURCE]
    log = replayed(s["admission"]["transitions"])
    rejected, spells, reasons = log.rejected(t0, t1)
    registers = s["timing"]["registers"][calls0:]
    accepted = r["registrations"] - res0["registrations"]

    timeline = [(0.0, "apt-get install starts"), (returned - t0, "apt-get install returns")]
    timeline += [(at - t0, text) for at, text in _dpkg_lines(node) if at >= t0]
    timeline += [(at - t0, what) for at, what in _journal_steps(node, cursor) if at >= t0]
    unit = _unit_times(node)
    for key, what in (("InactiveEnterTimestampMonotonic", "systemd: old process gone, unit inactive"),
                      ("ExecMainStartTimestampMonotonic", "systemd: new main process forked"),
                      ("ActiveEnterTimestampMonotonic", "systemd: new process READY=1")):
        if unit.get(key, 0) >= t0:
            timeline.append((unit[key] - t0, what))
    for c in registers:
        timeline.append((c["at"] - t0, f"kubelet: Register arrives ({'refused: ' + c['error'] if c['error'] else 'accepted'})"))
    healthy = [h for h in s["timing"]["healthy"] if h[0] >= t0 and h[1] == RESOURCE]
    if healthy:
        timeline.append((healthy[0][0] - t0, f"kubelet: first device list, {healthy[0][3]} healthy"))
    for at, state, reason in log.transitions:
        if at >= t0:
            timeline.append((at - t0, f"kubelet: {'admits' if state == 'admit' else state + 's'}"
                             + (f" ({reason})" if reason else "")))
    timeline.sort()

    problems = []
    if accepted != 1:
        problems.append(f"{accepted} registrations accepted by kubelet, expected exactly 1")
    if len(registers) != 1:
        problems.append(f"{len(registers)} Register calls reached kubelet, expected 1: {registers}")
    if not (r["connected"] and not r["stopped"] and r["live_streams"] == 1):
        problems.append(f"kubelet's view is not one live, connected, current endpoint: {r}")
    if r["healthy"] != units or r["allocatable"] != units:
        problems.append(f"healthy {r['healthy']}, allocatable {r['allocatable']}, expected {units}")
    calls = {k[1]: v for k, v in m.items() if k[0] == "atedevd_resource_register_calls_total"}
    if sum(calls.values()) != 1:
        problems.append(f"the new process sent {sum(calls.values()):.0f} Register calls: {calls}")
    new_pid = node.main_pid()
    if new_pid in (0, old_pid):
        problems.append(f"main PID {new_pid} after the upgrade (old {old_pid})")
    if node.run("test", "-d", f"/proc/{old_pid}", check=False).returncode == 0:
        problems.append(f"the old process {old_pid} is still running")
    sockets = our_sockets(node)
    if sockets != [f"{PLUGIN_DIR}/{r['endpoint']}"]:
        problems.append(f"our sockets {sockets}, expected only the new endpoint {r['endpoint']}")
    left = sorted(set(old_sockets) & set(sockets))
    if left:
        problems.append(f"old sockets still there: {left}")
    want = f"install ok installed {deb_revision(deb)}"
    if deb_version(node, "atedevd") != want:
        problems.append(f"dpkg says {deb_version(node, 'atedevd')!r}, expected {want!r}")
    state = node.show("atedevd", "ActiveState", "NRestarts")
    if state != {"ActiveState": "active", "NRestarts": restarts}:
        problems.append(f"unit {state}, expected active with no automatic restart")
    warnings = node.run("journalctl", "--no-pager", "-u", "atedevd", f"--after-cursor={cursor}", "-p", "warning",
                        "-o", "cat").stdout.strip()
    if warnings and warnings != "-- No entries --":
        problems.append(f"warnings in atedevd's journal during the upgrade:\n{warnings}")
    pods, put_in = log.pods_rejected(t0, t1)
    return {"rejected": rejected, "spells": spells, "reasons": reasons, "pods": pods, "put_in": put_in,
            "by_reason": log.rejected_by_reason(t0, t1), "registers": len(registers),
            "accepted": accepted, "timeline": timeline, "problems": problems, "end": t1 - t0,
            "max_gap": s["admission"]["max_gap"], "samples": s["admission"]["samples"]}


def print_timeline(r: dict, out=None) -> None:
    for at, what in r["timeline"]:
        print(f"  {at * 1000:9.1f} ms  {what}", file=out)
