"""How long a start takes: process start -> Register received by the kubelet stand-in.

    /usr/bin/python3 -m bench.start_timing [--runs 20] [--kill] [--trace | --compare TREE]

Each run starts `atedevd run` as a process (rig/harness.py, the unit's
Environment=, the shipped etc/config.toml) with the stand-in up, stamps the moment Register arrives in the
stand-in, reads its resident set 0.7 s later (--compare prints it), then stops the daemon: SIGTERM, or SIGKILL with --kill (the next start
then finds the dead run's sockets). `start` is the moment before the fork.

Between runs it times the floor: a process that only imports grpc and our
generated protobuf messages, start to exit. --trace runs the daemon with
bench/start_trace/ first on PYTHONPATH, whose sitecustomize.py prints when each
step of the start path begins and ends (ms since the fork), for the breakdown in
docs/design.md ("Where a start's time goes"). Figures only: nothing here asserts
a timing. The machine should be as idle as it can be: the figures are medians of
noisy samples.
"""

import argparse
import compileall
import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List

from bench.rig import Rig, percentile, rss_kib
from rig.harness import RESOURCE

# What no start can avoid: the interpreter, grpc and protobuf (with our generated messages).
FLOOR = "import grpc; from atedevd.api import deviceplugin_pb2; import os; os._exit(0)"
HERE = os.path.dirname(os.path.abspath(__file__))
# The configuration a package installs (the rig's paths are command-line overrides): a start
# reads and parses it, as on a node.
SHIPPED_CONFIG = os.path.join(os.path.dirname(HERE), "etc", "config.toml")
TRACE_DIR = os.path.join(HERE, "start_trace")  # its sitecustomize.py prints the steps
RSS_AFTER_S = 0.7  # the resident set is read this long after the registration: the start is done


def one_run(rig: Rig, n: int, kill: bool, trace: bool, env: Dict[str, str]) -> dict:
    k = rig.kubelet
    with k.cond:
        k.arrivals.clear()
    if trace:
        env = {**env, "PYTHONPATH": f"{TRACE_DIR}:{os.path.dirname(HERE)}", "START_TRACE_T0": repr(time.monotonic())}
    d = rig.start(env=env, config=SHIPPED_CONFIG)
    with k.cond:
        if not k.cond.wait_for(lambda: k.arrivals, 30):
            raise RuntimeError(f"no Register within 30 s; log:\n{d.log()}")
        register = k.arrivals[0] - d.started_at
    if not k.wait_connected(RESOURCE, registrations=n, timeout=30):
        raise RuntimeError(f"not connected; log:\n{d.log()}")
    time.sleep(RSS_AFTER_S)  # the start's deferred work done (0.5 s at most)
    rss = rss_kib(d.pid)
    d.send(signal.SIGKILL if kill else signal.SIGTERM)
    d.wait(30)
    d.close()
    rig.daemon = None
    steps = []
    for line in d.log().splitlines():
        m = re.match(r"TRACE +([0-9.]+) (.*)", line)
        if m:
            steps.append((m.group(2), float(m.group(1))))
    return {"register": register, "steps": steps, "rss": rss}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--kill", action="store_true", help="end each run with SIGKILL instead of SIGTERM")
    p.add_argument("--trace", action="store_true", help="print the start path's steps (bench/start_trace/)")
    p.add_argument("--compare", metavar="TREE", help="alternate runs with the atedevd package of another checkout "
                   "(e.g. `git archive` of an older commit), same stand-in, same moments: before/after under one load")
    args = p.parse_args(argv)
    # As a package runs it: byte-compiled (py3compile at install). Without this, a
    # PYTHONDONTWRITEBYTECODE environment compiles every module on every start (+10 ms).
    trees = [os.path.dirname(HERE)] + ([os.path.abspath(args.compare)] if args.compare else [])
    for tree in trees:
        compileall.compile_dir(os.path.join(tree, "atedevd"), quiet=1)
    if args.compare:
        return compare(trees, args)
    runs = []
    with Rig() as rig:
        for i in range(args.runs + 1):  # the first run warms the page cache; not counted
            r = one_run(rig, i + 1, args.kill, args.trace, {})
            t0 = time.monotonic()  # the floor, interleaved: the same interpreter and imports, nothing of ours run
            subprocess.run([sys.executable, "-c", FLOOR], cwd=os.path.dirname(HERE), check=True)
            r["floor"] = time.monotonic() - t0
            if i:
                runs.append(r)
    regs = sorted(r["register"] * 1000 for r in runs)
    print(f"start -> Register received, {len(regs)} runs ({'SIGKILL' if args.kill else 'SIGTERM'} between): "
          f"min {regs[0]:.1f} / p50 {percentile(regs, 50):.1f} / p90 {percentile(regs, 90):.1f} / max {regs[-1]:.1f} ms")
    print("all (ms):", " ".join(f"{x:.0f}" for x in regs))
    floor = sorted(r["floor"] * 1000 for r in runs)
    print(f"floor ({FLOOR!r}, start -> exit), interleaved: min {floor[0]:.1f} / p50 {percentile(floor, 50):.1f} / max {floor[-1]:.1f} ms")
    # The machine's speed drifts from one second to the next; each run less the floor timed
    # right after it is steadier than either: what of the start is ours.
    ours = sorted((r["register"] - r["floor"]) * 1000 for r in runs)
    print(f"ours above the floor (each run less the floor beside it): p50 {percentile(ours, 50):.1f} / p90 {percentile(ours, 90):.1f} ms")
    if args.trace:
        print("steps, median ms since start (each run's steps in order; first occurrence):")
        order: List[str] = []
        at: Dict[str, List[float]] = {}
        for r in runs:
            seen = set()
            for what, t in r["steps"]:
                if what in seen:
                    continue
                seen.add(what)
                if what not in at:
                    order.append(what)
                at.setdefault(what, []).append(t)
        for what in sorted(order, key=lambda w: percentile(at[w], 50)):
            print(f"  {percentile(at[what], 50):7.1f}  {what}")
        print(f"  {percentile(regs, 50):7.1f}  Register received (stand-in)")
    return 0


def compare(trees: List[str], args) -> int:
    """Runs alternate between the trees (this one first), so both see the same machine."""
    got: Dict[str, List[float]] = {t: [] for t in trees}
    rss: Dict[str, List[float]] = {t: [] for t in trees}
    with Rig() as rig:
        for i in range(2 * args.runs + 2):
            tree = trees[i % 2]
            env = {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}  # that tree's package, not the cwd's
            r = one_run(rig, i + 1, args.kill, False, env)
            if i >= 2:  # the first of each warms the page cache
                got[tree].append(r["register"] * 1000)
                rss[tree].append(r["rss"] / 1024)
    for tree, regs in got.items():
        regs.sort()
        print(f"{tree}: start -> Register, {len(regs)} runs ({'SIGKILL' if args.kill else 'SIGTERM'} between): "
              f"min {regs[0]:.1f} / p50 {percentile(regs, 50):.1f} / p90 {percentile(regs, 90):.1f} / max {regs[-1]:.1f} ms; "
              f"RSS {RSS_AFTER_S} s after, p50 {percentile(sorted(rss[tree]), 50):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
