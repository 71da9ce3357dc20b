"""The node's boot: kubelet's first batch of pods after a real boot, won or lost, per kubelet
model, with the default resource and with 16 (rig/node_boot.py: one overlay of the FULL
Debian 12 rootfs, powered off and booted again; atedevd and the kubelet stand-in as
kubelet.service enabled; kubelet's first batch FIRST_ADMISSION_S after kubelet.sock).
tests/systemd/test_boot.py asserts the default resource's 20 of 20; here the margins are printed,
and 16 resources, which is where the margin runs out, are measured.

Needs root and systemd-nspawn; without them the row says it was not run, and why.
"""

import sys
from typing import List, Tuple

from bench.upgrade import unavailable, verdict
from rig.kubelet_standin import MODES

Row = Tuple[str, str, str, str, str]
TOOLS = ("systemd-nspawn", "nsenter", "mount")


def run(boots: int, modes=MODES) -> List[Row]:
    why = unavailable(TOOLS)
    if why:
        print(f"  boot: NOT RUN: {why}", file=sys.stderr, flush=True)
        return [("boot", "kubelet's first batch after a boot: not run", why, "", "SKIP")]
    from rig import node_boot as nb
    from rig.container import FULL, Container, cached_rootfs

    rows: List[Row] = []
    config, many, many_pods = nb.many()
    node = Container(cached_rootfs(FULL))
    try:
        node.mount()
        nb.make_node(node)
        for mode in modes:
            for what, resources, pods, cfg in (("1 resource", {nb.KVM: nb.KVM_UNITS}, nb.KVM_PODS, ""),
                                               (f"{nb.MANY} resources", many, many_pods, config)):
                nb.prepare(node, mode, pods, cfg)
                results = []
                for i in range(boots):
                    b = nb.one_boot(node, resources)
                    results.append(b)
                    print(f"  boot (kubelet {mode}, {what}) {i + 1}/{boots}: {nb.rejected_pods(b)} of "
                          f"{len(b['batch']['pods'])} pods rejected by the first batch", file=sys.stderr, flush=True)
                rows += boot_rows(mode, what, results)
    finally:
        node.destroy()
    return rows


def boot_rows(mode: str, what: str, results: List[dict]) -> List[Row]:
    from rig import node_boot as nb

    n = len(results)
    lost = [b for b in results if nb.rejected_pods(b)]
    other = [p for b in results for p in nb.problems(b) if not p.startswith("kubelet's first batch")]
    f = nb.figures(results)
    healthy = [b for b, h in zip(results, f["healthy"]) if h != float("inf")]
    pods = sum(len(b["batch"]["pods"]) for b in results)
    on = f"boot (kubelet {mode}, {what})"
    out = [("boot", f"{on}: boots whose first batch admitted every pod", f"{n - len(lost)} of {n}", f"{n} of {n}",
            verdict(not lost)),
           ("boot", "  pods rejected by kubelet's first batch", f"{sum(nb.rejected_pods(b) for b in results)} of {pods}",
            "0", verdict(not lost))]
    if healthy:
        out.append(("boot", "  margin, all healthy -> first batch, min/p50/max",
                    nb.ms([m for m in f["margin"] if m != float("-inf")]), "", ""))
    out += [("boot", "  ours: kubelet.sock -> first Register, min/p50/max", nb.ms(f["register"]), "", ""),
            ("boot", "  ours: kubelet.sock -> last Register arrives, min/p50/max", nb.ms(f["last_register"]), "", ""),
            ("boot", "  ours: kubelet.sock -> every resource healthy, min/p50/max",
             nb.ms(f["healthy"]) if len(healthy) == n else f"{n - len(healthy)} boots never all healthy", "", ""),
            ("boot", "  kubelet's: kubelet.sock -> first batch (the stand-in), min/p50/max", nb.ms(f["batch"]), "", ""),
            ("boot", "  atedevd READY before kubelet's start, min/p50/max", nb.ms(f["ready"]), "", "")]
    for p in other[:2]:
        out.append(("boot", "  other problem", p[:110], "", "MISS"))
    return out
