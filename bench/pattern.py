"""A pattern resource of 64 nodes beside the shareable kvm, in one daemon: Allocate latency
of each, and how long a node's removal and return take to reach kubelet as its unit's
health (the other units untouched), against kvm's node doing the same.

The 64 nodes are made with mknod (root; `make bench` runs as root), so each is a node
of its own, as USB serial adapters or VFIO groups are.
"""

import os
import shutil
import stat
import tempfile
import time
from typing import List, Tuple

from bench.rig import Rig, TimedKubelet, percentile
from rig.harness import RESOURCE, current_socket

Row = Tuple[str, str, str, str, str]
PATTERN = "ate.dev/serial"
NODES = 64


class HealthKubelet(TimedKubelet):
    """The stand-in, noting when each device list changes the set of Unhealthy IDs of a resource."""

    def __init__(self, plugin_dir: str, **kwargs):
        super().__init__(plugin_dir, **kwargs)
        self.unhealthy_at = {RESOURCE: [], PATTERN: []}  # resource -> [(monotonic time, frozenset of Unhealthy IDs)]

    def write_checkpoint(self) -> None:  # with the lock held, after every message
        now = time.monotonic()
        for resource, seen in self.unhealthy_at.items():
            if resource in self.manager.unhealthy:
                ids = frozenset(self.manager.unhealthy[resource])
                if not seen or seen[-1][1] != ids:
                    seen.append((now, ids))
        super().write_checkpoint()


def _node(dev_root: str, i: int) -> str:
    return os.path.join(dev_root, f"ttyB{i}")


def _mknod(dev_root: str, i: int) -> None:
    os.mknod(_node(dev_root, i), stat.S_IFCHR | 0o600, os.makedev(188, i))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}" if seconds < 0.01 else f"{seconds * 1000:.1f}"


def _p(values) -> str:
    return f"{_ms(percentile(values, 50))}/{_ms(percentile(values, 99))} ms" if values else "none"


def _health(k: HealthKubelet, resource: str, flip, unit: str, n: int, timeout: float = 30.0):
    """n rounds of `flip(False)` (the node goes) then `flip(True)` (it is back): the time until
    kubelet holds `unit` Unhealthy, and Healthy again."""
    down, up = [], []
    for _ in range(n):
        for back in (False, True):
            t0 = time.monotonic()
            flip(back)

            def seen():
                return any(t >= t0 and ((unit in ids) != back) for t, ids in k.unhealthy_at[resource])
            with k.cond:
                if not k.cond.wait_for(seen, timeout):
                    raise RuntimeError(f"{resource}: kubelet did not see {unit} {'back' if back else 'go'}")
                at = next(t for t, ids in k.unhealthy_at[resource] if t >= t0 and ((unit in ids) != back))
            (up if back else down).append(at - t0)
            time.sleep(0.02)
    return down, up


def run(quick: bool) -> List[Row]:
    if os.geteuid() != 0:
        return [("pattern", f"{NODES}-node pattern resource", "needs root (mknod)", "", "SKIP")]
    from bench.rig import load  # the Allocate load generator, in client processes

    calls = 500 if quick else 5000
    rounds = 10 if quick else 50
    cfg_dir = tempfile.mkdtemp(prefix="atebench-cfg-", dir="/tmp")
    rows: List[Row] = []
    with Rig(kubelet=False) as rig:
        rig.kubelet = k = HealthKubelet(rig.plugin_dir)
        k.start()
        for i in range(NODES):
            _mknod(rig.dev_root, i)
        config = os.path.join(cfg_dir, "config.toml")
        with open(config, "w") as f:
            f.write(f'[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\n'
                    f'[[device]]\nresource = "{PATTERN}"\npath = "/dev/ttyB*"\n')
        d = rig.start(config=config)
        d.wait_ready()
        for resource in (RESOURCE, PATTERN):
            if not k.wait_connected(resource, timeout=30):
                raise RuntimeError(f"{resource} did not register; log:\n{d.log()}")
        if not k.wait(lambda: len(k.manager.healthy.get(PATTERN, ())) == NODES, 30):
            raise RuntimeError(f"not {NODES} healthy units; log:\n{d.log()}")
        for resource, unit in ((PATTERN, "ttyB7"), (RESOURCE, "kvm-0")):
            r = load(current_socket(rig.plugin_dir, resource, kubelet=k), 1, 1, count=calls, ids=unit)
            p99 = percentile(r["lat"], 99)
            rows.append(("pattern", f"Allocate {resource} ({unit}{', one of 64 exclusive units' if resource == PATTERN else ', shareable'}), "
                         f"sequential p50/p99 over {calls}", _p(r["lat"]), "p99 <= 2 ms",
                         "PASS" if p99 <= 0.002 and r["errors"] == 0 else "MISS"))

        def flip_unit(back: bool) -> None:
            if back:
                _mknod(rig.dev_root, 7)
            else:
                os.unlink(_node(rig.dev_root, 7))

        def flip_kvm(back: bool) -> None:
            kvm = os.path.join(rig.dev_root, "kvm")
            if back:
                os.symlink("/dev/null", kvm)
            else:
                os.unlink(kvm)

        down, up = _health(k, PATTERN, flip_unit, "ttyB7", rounds)
        rows.append(("pattern", f"one of {NODES} nodes removed -> its unit Unhealthy at kubelet, p50/p99 over {rounds}", _p(down), "", ""))
        rows.append(("pattern", "the node back -> Healthy at kubelet, p50/p99", _p(up), "", ""))
        with k.cond:
            others = {u for _, ids in k.unhealthy_at[PATTERN] for u in ids} - {"ttyB7"}
        rows.append(("pattern", "other units ever Unhealthy meanwhile", str(len(others)), "0", "PASS" if not others else "MISS"))
        down, up = _health(k, RESOURCE, flip_kvm, "kvm-0", rounds)
        rows.append(("pattern", f"beside it: kvm's node removed -> 1024 Unhealthy, p50/p99 over {rounds}", _p(down), "", ""))
        rows.append(("pattern", "kvm's node back -> Healthy, p50/p99", _p(up), "", ""))
        if d.proc.poll() is not None:
            raise RuntimeError("the daemon died")
    shutil.rmtree(cfg_dir, ignore_errors=True)
    return rows
