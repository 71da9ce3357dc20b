"""Overlapping patterns: 2 and 8 pattern resources that all match the same 2,000 nodes (made
with mknod: root), so that every node is claimed by several resources and served by none.
Nothing changes while the daemon runs: what it costs then is its idle CPU (a share of one
core, read from /proc over the window), and a reload there is timed from SIGHUP to the
READY=1 that ends it (systemd's `systemctl reload` returns then).
"""

import os
import shutil
import signal
import stat
import tempfile
import time
from typing import List, Tuple

from bench.rig import Rig, cpu_seconds

Row = Tuple[str, str, str, str, str]
NODES = 2000
# Every one matches every node ttyC0 ... ttyC1999.
PATTERNS = ("/dev/ttyC*", "/dev/ttyC[0-9]*", "/dev/ttyC?*", "/dev/tty[C]*", "/dev/tty?[0-9]*", "/dev/t*C*",
            "/dev/ttyC*[0-9]", "/dev/*C[0-9]*")


def _config(path: str, patterns) -> None:
    with open(path, "w") as f:
        for i, p in enumerate(patterns):
            f.write(f'[[device]]\nresource = "ate.dev/serial{i}"\npath = "{p}"\n')


def one(patterns, seconds: float) -> Tuple[float, float]:
    """(idle CPU as a share of one core, seconds from SIGHUP to READY=1) for one daemon."""
    cfg_dir = tempfile.mkdtemp(prefix="atebench-cfg-", dir="/tmp")
    try:
        with Rig() as rig:
            for i in range(NODES):
                os.mknod(os.path.join(rig.dev_root, f"ttyC{i}"), stat.S_IFCHR | 0o600, os.makedev(188, i))
            config = os.path.join(cfg_dir, "config.toml")
            _config(config, patterns)
            d = rig.start(config=config)
            d.wait_ready(timeout=120)
            time.sleep(3.0)  # the start's deferred work, and the first looks after the watches
            c0, t0 = cpu_seconds(d.pid), time.monotonic()
            time.sleep(seconds)
            idle = (cpu_seconds(d.pid) - c0) / (time.monotonic() - t0)
            before = len(d.notify.messages)
            sent = time.monotonic()
            d.send(signal.SIGHUP)
            ready = d.notify.wait_for("READY", "1", timeout=120, after=before)
            if ready is None or d.proc.poll() is not None:
                raise RuntimeError(f"no READY=1 after the reload; log:\n{d.log()[-3000:]}")
            return idle, ready["at"] - sent
    finally:
        shutil.rmtree(cfg_dir, ignore_errors=True)


def run(quick: bool) -> List[Row]:
    if os.geteuid() != 0:
        return [("overlap", f"{NODES} nodes, overlapping patterns", "needs root (mknod)", "", "SKIP")]
    seconds = 10.0 if quick else 30.0
    rows: List[Row] = []
    for k in (2, 8):
        idle, reload = one(PATTERNS[:k], seconds)
        rows.append(("overlap", f"{k} patterns over the same {NODES} nodes: idle CPU over {seconds:.0f} s",
                     f"{idle * 100:.2f} % of a core", "< 1 %", "PASS" if idle < 0.01 else "MISS"))
        rows.append(("overlap", f"{k} patterns over the same {NODES} nodes: SIGHUP -> READY=1", f"{reload * 1000:.0f} ms", "", ""))
    return rows
