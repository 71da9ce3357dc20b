"""How the time kubelet takes to count us grows with the number of units (issue item 8).

For each count, the daemon runs with one device of that many units, and kubelet (the
stand-in, current mode) restarts back to back; per restart: kubelet.sock appears ->
Register arrives -> every unit healthy in kubelet. Besides: the size of one device list
on the wire, the stand-in's own handling of one list (its device sets and the checkpoint
JSON, written as kubelet writes it: a temp file renamed into place), and the daemon's RSS.
"""

import os
from typing import List, Tuple

from bench.lifecycle import stats, write_config
from bench.rig import Rig, TimedKubelet, percentile, rss_kib
from rig.harness import RESOURCE

Row = Tuple[str, str, str, str, str]
COUNTS = (256, 1024, 4096, 16384)


class CountingKubelet(TimedKubelet):
    """TimedKubelet, also timing each device list's handling (device sets + checkpoint)."""

    def __init__(self, plugin_dir: str, **kwargs):
        super().__init__(plugin_dir, **kwargs)
        self.handling: List[float] = []
        self.message_bytes = 0

    def message_handled(self, client, resp, seconds: float) -> None:
        self.handling.append(seconds)
        self.message_bytes = resp.ByteSize()


def measure(count: int, rounds: int) -> dict:
    with Rig(kubelet=False) as rig:
        k = CountingKubelet(rig.plugin_dir, kubelet="current")
        k.units = count
        rig.kubelet = k
        k.start()
        config = os.path.join(rig.root, "atedevd.toml")
        write_config(config, count)
        d = rig.start(config=config)
        d.wait_ready(30)
        k.assert_healthy(RESOURCE, count, new_registrations=1, timeout=60)
        rss = rss_kib(d.pid)
        arrive, healthy, lost = [], [], 0
        k.handling.clear()
        for _ in range(rounds):
            with k.cond:
                k.arrivals.clear()
                k.healthy_at.clear()
            k.restart()
            with k.cond:
                serving = k.serving_at
                if not k.cond.wait_for(lambda: any(t >= serving for t in k.healthy_at), 60):
                    lost += 1
                    continue
                a = next(t for t in k.arrivals if t >= serving)
                arrive.append(a - serving)
                healthy.append(next(t for t in k.healthy_at if t >= serving) - a)
        size = k.message_bytes
        checkpoint = os.path.getsize(os.path.join(rig.plugin_dir, "kubelet_internal_checkpoint"))
        return {"arrive": arrive, "healthy": healthy, "lost": lost, "handling": list(k.handling), "size": size,
                "checkpoint": checkpoint, "rss": rss}


def run(rounds: int) -> List[Row]:
    rows: List[Row] = []
    for count in COUNTS:
        r = measure(count, rounds)
        on = f"{count} units"
        rows += [
            ("units", f"{on}: kubelet.sock appears -> Register arrives, p50/p99/max of {rounds}", stats(r["arrive"]), "", ""),
            ("units", f"{on}: Register arrives -> all healthy in kubelet", stats(r["healthy"]), "", ""),
            ("units", f"{on}: the stand-in's handling of one list (sets + checkpoint), p50",
             f"{percentile(r['handling'], 50) * 1000:.2f} ms" if r["handling"] else "none", "", ""),
            ("units", f"{on}: one device list on the wire / the checkpoint file",
             f"{r['size'] / 1024:.1f} KiB / {r['checkpoint'] / 1024:.1f} KiB", "", ""),
            ("units", f"{on}: daemon RSS when registered", f"{r['rss'] / 1024:.1f} MiB", "", ""),
        ]
        if r["lost"]:
            rows.append(("units", f"{on}: restarts never healthy", f"{r['lost']} of {rounds}", "0", "MISS"))
    return rows
