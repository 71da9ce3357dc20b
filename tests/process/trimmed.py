"""Memory measurements that machine noise cannot move: the daemon's heap after malloc_trim(3).

glibc keeps memory a program freed (per-thread arenas, at their high-water mark) and returns
it only when asked; how much it keeps depends on which threads ran what, i.e. on timing, and
so on how busy the machine is. `malloc_trim(0)` hands every free page back, so what remains
(RssAnon) is what the daemon still holds: a leak stays, noise goes.

The daemon has no test hook: `LAUNCHER` runs the real CLI with a SIGUSR2 handler that
trims and then says so in a file; `trimmed_rss_kib` sends the signal, waits for that, and
reads /proc.
"""

import os
import signal

from rig.harness import wait_until

ACK_ENV = "ATEDEVD_TEST_TRIM_ACK"

LAUNCHER = ("-c", """
import ctypes, os, signal, sys
libc = ctypes.CDLL("libc.so.6")
ack = os.environ["%s"]
count = 0

def trim(signum, frame):  # on the main thread, between the loop's polls
    global count
    libc.malloc_trim(0)
    count += 1
    with open(ack + ".tmp", "w") as f:
        f.write(str(count))
    os.rename(ack + ".tmp", ack)

signal.signal(signal.SIGUSR2, trim)
from atedevd import cli
sys.exit(cli.main(sys.argv[1:]))
""" % ACK_ENV)


def env(workdir: str) -> dict:
    return {ACK_ENV: os.path.join(workdir, "trimmed")}


def _acks(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def trimmed_rss_kib(pid: int, ack_path: str) -> int:
    """The daemon's anonymous resident memory (heap, stacks) right after malloc_trim(0), in KiB."""
    before = _acks(ack_path)
    os.kill(pid, signal.SIGUSR2)
    if not wait_until(lambda: _acks(ack_path) > before, timeout=10):
        raise AssertionError(f"the daemon did not trim within 10 s ({ack_path})")
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
