"""The crash window under a real systemd (Debian 12's 252, booted in nspawn: rig/container.py).

    /usr/bin/python3 -m bench.crash_timing [--kills 10] [--loop 60]

1. kill -9 the daemon `--kills` times, each kill a first crash (the run before it
   lasted longer than restarts.STABLE_S), and time, from the kill: systemd's new
   process, Register received by the kubelet stand-in (container_timed_standin.py),
   and all 1024 units healthy in it. Also process start -> Register under the unit.
2. A crash loop for `--loop` seconds: a drop-in kills the daemon 0.2 s after every
   start (ExecStartPost=), and the CPU the unit's slice, systemd and journald used
   is read from the cgroup and /proc. Run once with the daemon's brake, once with
   it defeated (the marker removed by an ExecStartPre=) for comparison.

Figures only; the behaviour is asserted in test_systemd.py and test_restarts.py.
"""

import argparse
import json
import sys
import time
from typing import List

from atedevd.daemon import restarts
from bench.rig import percentile
from rig.container import (FULL, RESOURCE, Container, cached_rootfs, fake_kvm, install_project, standin_state,
                           start_standin, wait_until)

DROPIN = "/etc/systemd/system/atedevd.service.d"
KILL = "import os, sys, time; pid = int(sys.argv[1]); t = time.monotonic(); os.kill(pid, 9); print(repr(t))"


def timing(node) -> dict:
    return (standin_state(node) or {}).get("timing") or {}


def monotonic_usec(node, unit: str, prop: str) -> float:
    return int(node.show(unit, prop)[prop]) / 1e6


def stats(values: List[float]) -> str:
    v = sorted(x * 1000 for x in values)
    return f"min {v[0]:.0f} / p50 {percentile(v, 50):.0f} / max {v[-1]:.0f} ms (n={len(v)})"


def kills(node, n: int) -> None:
    rows = []
    for i in range(n):
        pid = node.main_pid()
        started = monotonic_usec(node, "atedevd", "ExecMainStartTimestampMonotonic")
        wait_until(lambda: time.monotonic() - started > restarts.STABLE_S + 0.5, 30, "a stable run")
        seen = len(timing(node).get("registers", []))
        t_kill = float(node.run("/usr/bin/python3", "-c", KILL, str(pid)).stdout)

        def registered():
            t = timing(node)
            regs = [r for r in t.get("registers", [])[seen:] if r["at"] > t_kill and not r["error"]]
            healthy = [h for h in t.get("healthy", []) if h[0] > t_kill and h[1] == RESOURCE and h[3] == 1024]
            return (regs[0]["at"], healthy[0][0]) if regs and healthy else None

        reg_at, healthy_at = wait_until(registered, 30, "registered again")
        new_start = monotonic_usec(node, "atedevd", "ExecMainStartTimestampMonotonic")
        rows.append({"exec": new_start - t_kill, "register": reg_at - t_kill, "healthy": healthy_at - t_kill,
                     "start_to_register": reg_at - new_start})
        print(f"  kill {i + 1}: new process +{rows[-1]['exec'] * 1000:.0f} ms, Register +{rows[-1]['register'] * 1000:.0f} ms, "
              f"1024 healthy +{rows[-1]['healthy'] * 1000:.0f} ms", flush=True)
    print(f"kill -9 -> systemd's new process:  {stats([r['exec'] for r in rows])}")
    print(f"kill -9 -> Register received:      {stats([r['register'] for r in rows])}")
    print(f"kill -9 -> 1024 healthy (stand-in): {stats([r['healthy'] for r in rows])}")
    print(f"process start -> Register (unit):   {stats([r['start_to_register'] for r in rows])}")


def cpu(node) -> dict:
    """CPU seconds so far: the loop's slice (every run of the unit), systemd (PID 1), journald."""
    usage = node.run("cat", "/sys/fs/cgroup/crashloop.slice/cpu.stat", check=False).stdout
    slice_s = next((int(line.split()[1]) / 1e6 for line in usage.splitlines() if line.startswith("usage_usec")), 0.0)

    def proc(pid: str) -> float:
        fields = node.run("cat", f"/proc/{pid}/stat").stdout.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100  # USER_HZ

    journald = node.run("pidof", "systemd-journald").stdout.split()[0]
    return {"unit": slice_s, "systemd": proc("1"), "journald": proc(journald)}


def crash_loop(node, seconds: float, brake: bool) -> None:
    node.systemctl("stop", "atedevd")
    extra = "" if brake else f"ExecStartPre=/bin/rm -f /run/atedevd/{restarts.MARKER}\n"
    node.write(f"{DROPIN}/crashloop.conf", "[Service]\nSlice=crashloop.slice\n"
               "ExecStartPost=/bin/sh -c 'sleep 0.2; kill -9 $MAINPID'\n" + extra)
    node.daemon_reload()
    node.systemctl("reset-failed", "atedevd", check=False)
    n0 = int(node.show("atedevd", "NRestarts")["NRestarts"])
    node.systemctl("start", "atedevd", check=False)
    time.sleep(2)  # past the first start
    before, t0 = cpu(node), time.monotonic()
    n1 = int(node.show("atedevd", "NRestarts")["NRestarts"])
    time.sleep(seconds)
    after, t1 = cpu(node), time.monotonic()
    n2 = int(node.show("atedevd", "NRestarts")["NRestarts"])
    wall = t1 - t0
    used = {k: after[k] - before[k] for k in after}
    total = sum(used.values())
    print(f"crash loop, {'with' if brake else 'WITHOUT'} the daemon's brake, {wall:.0f} s: {n2 - n1} restarts "
          f"({n1 - n0} before); CPU: unit {used['unit'] / wall * 100:.1f} %, systemd {used['systemd'] / wall * 100:.1f} %, "
          f"journald {used['journald'] / wall * 100:.1f} %, total {total / wall * 100:.1f} % of a core")
    node.systemctl("stop", "atedevd")
    node.run("rm", "-f", f"{DROPIN}/crashloop.conf")
    node.daemon_reload()
    node.systemctl("reset-failed", "atedevd", check=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--loop", type=float, default=60.0, help="seconds of each crash loop (0: none)")
    p.add_argument("--restart-sec", help="RestartSec= for this run (a drop-in), e.g. 0 or 100ms")
    args = p.parse_args(argv)
    with Container(cached_rootfs(FULL)) as node:
        install_project(node)
        fake_kvm(node)
        start_standin(node, script="container_timed_standin.py")
        if args.restart_sec is not None:
            node.write(f"{DROPIN}/restart-sec.conf", f"[Service]\nRestartSec={args.restart_sec}\n")
            node.daemon_reload()
        print(f"RestartSec={node.show('atedevd', 'RestartUSec')['RestartUSec']}", flush=True)
        node.systemctl("start", "atedevd")
        wait_until(lambda: any(h[3] == 1024 for h in timing(node).get("healthy", [])), 60, "first registration",
                   lambda: json.dumps(standin_state(node)))
        if args.kills:
            kills(node, args.kills)
        if args.loop:
            crash_loop(node, args.loop, brake=True)
            crash_loop(node, args.loop, brake=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
