"""The rejection window of a package upgrade, under a real systemd: the lifecycle table's
row that needs the packages and a booted node (bench.lifecycle has the others).

The .deb is built from the working tree once per revision (`make deb DEB_REVISION=N`:
1, then one newer revision per round), and installed into the CLEAN Debian 12 rootfs of
rig/container.py, booted with systemd 252. The kubelet stand-in runs as kubelet in a
unit of its own, outside atedevd's (rig/container_admission_standin.py), recording every
millisecond whether kubelet would admit a pod requesting ate.dev/kvm. Each round is
`apt-get install ./atedevd_<version>-<N+1>_all.deb` over the running, registered daemon
(rig.package_upgrade.upgrade): the time kubelet would have rejected such a pod from the
command's start until the new process is registered, healthy and counted by kubelet, the
Register calls kubelet saw, and the end state (exactly one new registration, one live
stream, allocatable = 1024, the old process and its sockets gone, no warning in the
journal). Per kubelet mode; the first round's timeline, and every round's window, go to
stderr.

Needs root, systemd-nspawn, nsenter and Debian's package build tools (`make deps`); the
rootfs cache is built on first use (rig/container.py). Without them the row says it was
not run, and why.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from bench.lifecycle import kind, stats
from bench.rig import percentile
from rig.kubelet_standin import MODES

Row = Tuple[str, str, str, str, str]
TOOLS = ("systemd-nspawn", "nsenter", "mount", "dpkg-buildpackage", "make")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def unavailable(tools=TOOLS) -> Optional[str]:
    """Why a benchmark that boots a container and needs `tools` cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (it boots a systemd container)"
    missing = [t for t in tools if shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]
    if missing:
        return f"needs {', '.join(missing)} (make deps installs them)"
    return None


def run(rounds: int, modes=MODES) -> List[Row]:
    why = unavailable()
    if why:
        print(f"  upgrade: NOT RUN: {why}", file=sys.stderr, flush=True)
        return [("upgrade", "package upgrade under systemd: not run", why, "", "SKIP")]
    from rig import package_upgrade as pu
    from rig.container import Container, cached_rootfs, clean, fake_kvm, install_test_helpers

    dist = Path(tempfile.mkdtemp(prefix="atebench-debs-", dir="/tmp"))
    try:
        print(f"  upgrade: building {1 + rounds * len(modes)} revisions of the .deb", file=sys.stderr, flush=True)
        debs = [pu.build_deb(dist, n) for n in range(1, 2 + rounds * len(modes))]
        results: Dict[str, List[dict]] = {}
        with Container(cached_rootfs(clean("bookworm"))) as node:
            install_test_helpers(node)
            fake_kvm(node)
            node.run("mkdir", "-p", pu.METRICS_DIR)
            pu.apt_install(node, debs[0])
            systemd = node.run("systemctl", "--version").stdout.split("\n")[0]
            n = 1
            for mode in modes:
                pu.start_kubelet(node, mode)
                # What the node's kubelet is: the current one tracks endpoints per socket, so the
                # new atedevd registers beside the old one (a reload reads it; nothing moves).
                endpoints = "per-socket" if mode == "current" else "per-resource"
                node.run("sed", "-i", f's/^#*kubelet_endpoints = .*/kubelet_endpoints = "{endpoints}"/', pu.CONFIG)
                node.systemctl("reload", "atedevd")
                results[mode] = []
                for i in range(rounds):
                    r = pu.upgrade(node, debs[n])
                    n += 1
                    results[mode].append(r)
                    print(f"  upgrade (kubelet {mode}) {i + 1}/{rounds} to {pu.deb_revision(debs[n - 1])}: rejecting "
                          f"{r['rejected'] * 1000:.1f} ms, {r['registers']} Register(s)"
                          + (f"; END STATE: {'; '.join(r['problems'])}" if r["problems"] else ""),
                          file=sys.stderr, flush=True)
                    if i == 0:
                        print(f"  timeline of that upgrade ({systemd}):", file=sys.stderr)
                        pu.print_timeline(r, out=sys.stderr)
    finally:
        shutil.rmtree(dist, ignore_errors=True)
    rows: List[Row] = []
    for mode, rs in results.items():
        rows += mode_rows(mode, rs)
    return rows


def _first(r: dict, prefix: str) -> Optional[float]:
    return next((at for at, what in r["timeline"] if what.startswith(prefix)), None)


def _spans(results: List[dict], start: str, end: str) -> List[float]:
    out = []
    for r in results:
        a, b = _first(r, start), _first(r, end)
        if a is not None and b is not None:
            out.append(b - a)
    return out


def mode_rows(mode: str, results: List[dict]) -> List[Row]:
    n = len(results)
    windows = [r["rejected"] for r in results]
    missed = [p for r in results for p in r["problems"]]
    registers = sorted({r["registers"] for r in results})
    on = f"package upgrade, apt install ./newer.deb (kubelet {mode})"
    out = [("upgrade", f"{on}: rejecting, p50/p99/max of {n}", stats(windows), "", "")]
    pods = [r["pods"] for r in results]
    out.append(("upgrade", "  pods rejected (one put in every 10 ms), p50/p99/max per upgrade, all",
                f"{percentile(pods, 50)}/{percentile(pods, 99)}/{max(pods)}, {sum(pods)} of "
                f"{sum(r['put_in'] for r in results)}", "", ""))
    out.append(("upgrade", "  rounds with a rejection / end state missed",
                f"{sum(1 for w in windows if w > 0)} / {sum(1 for r in results if r['problems'])} of {n}", "- / 0",
                verdict(not missed)))
    out.append(("upgrade", "  Register calls kubelet saw per upgrade", "/".join(map(str, registers)), "1",
                verdict(registers == [1])))
    found = "atedevd: the old one finds the upgrade"
    for what, a, b in (("command start -> reload (unpack, postinst up to its systemctl reload)", "apt-get install starts",
                        "systemd: reload begins"),
                       ("reload -> the old one starts the new one", "systemd: reload begins", found),
                       ("the new one started -> kubelet rejects (the old one's streams end: it is ready)", found,
                        "kubelet: rejects"),
                       ("the new one started -> its Register arrives", found, "kubelet: Register arrives"),
                       ("Register arrives -> kubelet admits", "kubelet: Register arrives", "kubelet: admits"),
                       ("Register arrives -> the old one exits", "kubelet: Register arrives", "atedevd: the old one exits"),
                       ("command start -> apt-get returns", "apt-get install starts", "apt-get install returns")):
        out.append(("upgrade", f"  {what}", stats(_spans(results, a, b)), "", ""))
    spent: Dict[str, float] = {}
    for r in results:
        for reason, seconds in r["by_reason"].items():
            spent[kind(reason)] = spent.get(kind(reason), 0.0) + seconds
    total = sum(spent.values())
    if total > 0:
        out.append(("upgrade", "  why, share of the time rejecting", ", ".join(
            f"{k} {v / total:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])), "", ""))
    gap = max(r["max_gap"] for r in results) if results else 0.0
    out.append(("upgrade", "  admission log: widest gap between samples", f"{gap * 1000:.1f} ms", "", ""))
    for p in missed[:2]:
        out.append(("upgrade", "  end state missed", p[:110], "", ""))
    return out

