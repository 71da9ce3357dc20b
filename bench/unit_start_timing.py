"""What a start under atedevd.service pays before the daemon's first line, by systemd's own
clock, in the booted Debian 12 container (systemd 252, rig/container.py).

    /usr/bin/python3 -m bench.unit_start_timing [--runs 10] [--variant NAME ...]

The unit as shipped, with a drop-in that swaps its ExecStart for a probe (Type=oneshot,
RemainAfterExit= so that systemd keeps its timestamps until it is stopped: python3 -S
printing CLOCK_MONOTONIC at its first line), is started `--runs` times per
variant, the variants taking turns (the machine's speed drifts). Per start, by systemd's
timestamps and the probe's: the start job -> the main process forked (InactiveExit ->
ExecMainStart: ExecStartPre= and its own process), and that fork -> the probe's first line
(the sandbox's namespaces, mounts and filters, then exec and Python's start, which every
variant pays alike: see `plain`). A variant turns one thing off:

  shipped          the unit as it is
  no-pre           without ExecStartPre=
  <option>=<value> that sandbox option set so (PrivateNetwork=no, ...)
  no-mount-ns      every option that needs a mount namespace off
  only:<option>    ... but that one, as shipped (what it costs alone)
  plain            no sandbox at all (the probe's own start: the floor)

Figures only; what the unit must keep is asserted by tests/systemd/test_unit_static.py and
tests/systemd/test_systemd.py.
"""

import argparse
import statistics
import sys
import time
from typing import Dict, List

from rig.container import FULL, Container, cached_rootfs, install_project, start_standin

DROPIN_DIR = "/etc/systemd/system/atedevd.service.d"
PROBE = "import time; print('UNIT-START-PROBE', repr(time.monotonic()), flush=True)"
PROBE_DROPIN = f"""[Service]
Type=oneshot
RemainAfterExit=yes
Restart=no
WatchdogSec=0
ExecStart=
ExecStart=/usr/bin/python3 -S -c "{PROBE}"
ExecReload=
"""
# Every option that makes systemd set up a mount namespace for the unit.
MOUNT_NS = ("ReadWritePaths=", "ProtectSystem=no", "ProtectHome=no", "PrivateTmp=no", "PrivateMounts=no",
            "ProtectKernelTunables=no", "ProtectKernelModules=no", "ProtectKernelLogs=no",
            "ProtectControlGroups=no", "ProtectProc=default", "ProcSubset=all", "ProtectHostname=no",
            "PrivateIPC=no", "PrivateNetwork=no", "PrivateUsers=no")
PLAIN = MOUNT_NS + ("DevicePolicy=auto", "IPAddressDeny=", "RestrictAddressFamilies=", "RestrictNamespaces=no",
                    "SystemCallFilter=", "SystemCallArchitectures=", "MemoryDenyWriteExecute=no", "LockPersonality=no",
                    "RestrictRealtime=no", "RestrictSUIDSGID=no", "NoNewPrivileges=no", "CapabilityBoundingSet=~",
                    "KeyringMode=inherit", "ProtectClock=no", "UMask=0022")
VARIANTS: Dict[str, tuple] = {
    "shipped": (),
    "no-pre": ("ExecStartPre=",),
    "PrivateNetwork=no": ("PrivateNetwork=no",),
    "PrivateUsers=no": ("PrivateUsers=no",),
    "PrivateIPC=no": ("PrivateIPC=no",),
    "PrivateTmp=no": ("PrivateTmp=no",),
    "ProtectHostname=no": ("ProtectHostname=no",),
    "ProtectClock=no": ("ProtectClock=no",),
    "IPAddressDeny=": ("IPAddressDeny=",),
    "DevicePolicy=auto": ("DevicePolicy=auto",),
    "no-mount-ns": MOUNT_NS,
    "plain": PLAIN + ("ExecStartPre=",),
}
# only:<option>: every mount-namespace option off but that one, as shipped.
for _off in MOUNT_NS:
    _name = _off.split("=")[0]
    VARIANTS[f"only:{_name}"] = tuple(o for o in MOUNT_NS if o != _off)


def start_once(node: Container) -> dict:
    """Start the (probe) unit; systemd's timestamps and the probe's first line, seconds."""
    cursor = node.run("journalctl", "-n", "0", "--show-cursor", "--no-pager").stdout.strip().rsplit("-- cursor: ", 1)[-1]
    node.systemctl("start", "atedevd")
    props = node.show("atedevd", "InactiveExitTimestampMonotonic", "ExecMainStartTimestampMonotonic", "Result")
    line = ""
    for _ in range(100):
        out = node.journal(f"--after-cursor={cursor}", "-u", "atedevd", "-o", "cat")
        line = next((s for s in out.splitlines() if s.startswith("UNIT-START-PROBE ")), "")
        if line:
            break
        time.sleep(0.02)
    node.systemctl("stop", "atedevd")
    if not line or props["Result"] != "success":
        raise RuntimeError(f"the probe did not run: {props}\n{node.journal('-u', 'atedevd', '-n', '20')}")
    first = float(line.split()[1])
    job, fork = (int(props[k]) / 1e6 for k in ("InactiveExitTimestampMonotonic", "ExecMainStartTimestampMonotonic"))
    return {"pre": fork - job, "sandbox": first - fork, "total": first - job}


def measure(node: Container, variants: List[str], runs: int) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {v: [] for v in variants}
    for i in range(runs):
        for v in variants:
            node.write(f"{DROPIN_DIR}/variant.conf", "[Service]\n" + "".join(line + "\n" for line in VARIANTS[v]))
            node.daemon_reload()
            out[v].append(start_once(node))
        print(f"  run {i + 1}/{runs}", file=sys.stderr, flush=True)
    return out


def p50(values: List[float]) -> float:
    return statistics.median(values) * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="default: all")
    args = p.parse_args(argv)
    variants = args.variant or list(VARIANTS)
    with Container(cached_rootfs(FULL)) as node:
        install_project(node)
        start_standin(node)  # the plugin directory exists, as on a node running kubelet
        node.write(f"{DROPIN_DIR}/probe.conf", PROBE_DROPIN)
        node.daemon_reload()
        results = measure(node, variants, args.runs)
    print(f"p50 of {args.runs} starts per variant, ms (systemd 252 in nspawn; a shared 2-core machine):")
    print(f"{'variant':<22} {'job -> fork':>12} {'fork -> 1st line':>17} {'job -> 1st line':>16} {'vs shipped':>11}")
    for v in variants:
        rs = results[v]
        sandbox = p50([r["sandbox"] for r in rs])
        total = p50([r["total"] for r in rs])
        shipped_total = p50([r["total"] for r in results["shipped"]]) if "shipped" in results else None
        print(f"{v:<22} {p50([r['pre'] for r in rs]):12.1f} {sandbox:17.1f} {total:16.1f} "
              + (f"{total - shipped_total:+11.1f}" if shipped_total is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
