"""What every benchmark stands on: a temp node (fake dev root, plugin dir), the
kubelet stand-in in this process with timestamps, atedevd as a process, and
readings of that process from /proc."""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from typing import Optional

from rig.harness import REPO, RESOURCE, DaemonUnderTest, current_socket, fake_dev_root
from rig.kubelet_standin import Kubelet

CLK_TCK = os.sysconf("SC_CLK_TCK")


class TimedKubelet(Kubelet):
    """The stand-in, noting when Register calls arrive and when each client's
    ListAndWatch delivers its first message (the stream is connected)."""

    def __init__(self, plugin_dir: str, **kwargs):
        super().__init__(plugin_dir, **kwargs)
        self.arrivals = []  # monotonic times Register calls arrived
        self.first_message = {}  # id(client) -> monotonic time of its first ListAndWatch message
        self.track_health = False
        self.health = None  # (monotonic time, healthy units) of the newest message
        self.units = 1024  # the daemon's configured count
        self.healthy_at = []  # monotonic times a message left all `units` healthy in kubelet

    def Register(self, request, context):
        now = time.monotonic()
        with self.cond:
            self.arrivals.append(now)
        return super().Register(request, context)

    def write_checkpoint(self) -> None:  # called with the lock held, after every message
        now = time.monotonic()
        for c in self.clients.values():
            if c.connected and id(c) not in self.first_message:
                self.first_message[id(c)] = now
        if self.track_health:
            c = self.clients.get(RESOURCE)
            if c is not None:
                self.health = (now, sum(1 for h, _ in c.devices.values() if h == "Healthy"))
        if len(self.manager.healthy.get(RESOURCE, ())) == self.units:
            self.healthy_at.append(now)
        super().write_checkpoint()


class BusyCore:
    """Keeps one other core busy (a spinning process) while measuring: a node is never idle."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def unit_environment() -> dict:
    """The Environment= settings of systemd/atedevd.service."""
    env = {}
    with open(os.path.join(REPO, "systemd", "atedevd.service")) as f:
        for line in f:
            if line.startswith("Environment="):
                for item in line.split("=", 1)[1].split():
                    key, _, value = item.partition("=")
                    env[key] = value
    return env


class Rig:
    """A temp node with the kubelet stand-in serving (`kubelet_options`: more of its
    constructor's, e.g. rate_limit); `start()` runs the daemon."""

    def __init__(self, kubelet: bool = True, kubelet_mode: str = "current", **kubelet_options):
        self.root = tempfile.mkdtemp(prefix="atebench-", dir="/tmp")  # short: sun_path
        self.dev_root = fake_dev_root(os.path.join(self.root, "dev"))
        self.plugin_dir = os.path.join(self.root, "device-plugins")
        os.makedirs(self.plugin_dir)
        self.kubelet: Optional[TimedKubelet] = None
        self.daemon: Optional[DaemonUnderTest] = None
        if kubelet:
            self.kubelet = TimedKubelet(self.plugin_dir, kubelet=kubelet_mode, **kubelet_options)
            self.kubelet.start()

    @property
    def socket(self) -> str:
        """The daemon's current socket (a new file per registration)."""
        return current_socket(self.plugin_dir, kubelet=self.kubelet)

    def start(self, env=None, log_level: str = "info", config: Optional[str] = None, launcher=None) -> DaemonUnderTest:
        env = {**unit_environment(), **(env or {})}  # measured as the unit runs it
        more = {"launcher": launcher} if launcher is not None else {}
        self.daemon = DaemonUnderTest(os.path.join(self.root, "run"), self.plugin_dir, self.dev_root, config=config, env=env,
                             log_level=log_level, **more)
        return self.daemon

    def start_registered(self, env=None) -> DaemonUnderTest:
        d = self.start(env=env)
        d.wait_ready()
        if not self.kubelet.wait_connected(RESOURCE, timeout=30):
            raise RuntimeError(f"the daemon did not register; log:\n{d.log()}")
        return d

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        if self.kubelet is not None:
            self.kubelet.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- readings of a process ------------------------------------------------------------


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """VmRSS, or RssAnon (heap, stacks) / RssFile (mapped code and files), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def python_threads(pid: int) -> int:
    """Threads that kept the process's name: Python's (ours, and grpc's Python-level ones).
    gRPC's C core names its own (default-executor, event_engine, timer_manager ...), and
    its executor grows with concurrent calls, which is not ours to keep flat."""
    with open(f"/proc/{pid}/comm") as f:
        main = f.read()
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                count += f.read() == main
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return count


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the command: state(3) ... utime is field 14, stime 15 (1-based) -> 11, 12 here
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def snapshot(pid: int) -> dict:
    return {"rss": rss_kib(pid), "anon": rss_kib(pid, "RssAnon"), "file": rss_kib(pid, "RssFile"), "fds": fds(pid), "threads": threads(pid),
            "py_threads": python_threads(pid)}


def percentile(values, p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sequence."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))  # the ceil(p% of n)-th smallest
    return s[k]


def load(socket_path: str, callers: int, procs: int, duration: float = None, count: int = None, ids: str = "kvm-0") -> dict:
    """`callers` threads spread over `procs` client processes (bench.loadgen), each asking for `ids`."""
    per = [callers // procs + (1 if i < callers % procs else 0) for i in range(procs)]
    start_at = time.monotonic() + 1.0 + 0.3 * procs  # after every process has connected and warmed up
    outs, children = [], []
    env = dict(os.environ, PYTHONPATH=REPO)
    for threads in per:
        fd, out = tempfile.mkstemp(prefix="atebench-lat-")
        os.close(fd)
        outs.append(out)
        args = [sys.executable, "-m", "bench.loadgen", socket_path, out, "--threads", str(threads), "--start-at", str(start_at),
                "--ids", ids]
        args += ["--duration", str(duration)] if duration is not None else ["--count", str(count)]
        children.append(subprocess.Popen(args, stdout=subprocess.PIPE, cwd=REPO, env=env))
    lat = array("d")
    calls = errors = 0
    first, last = float("inf"), 0.0
    for child, out in zip(children, outs):
        summary = json.loads(child.communicate(timeout=600)[0].decode().splitlines()[0])
        if child.returncode != 0:
            raise RuntimeError(f"loadgen exited {child.returncode}")
        calls += summary["calls"]
        errors += summary["errors"]
        first, last = min(first, summary["first"]), max(last, summary["last"])
        with open(out, "rb") as f:
            lat.frombytes(f.read())
        os.unlink(out)
    if first > start_at + 0.5:
        print(f"  note: a client process started {first - start_at:.2f} s late", file=sys.stderr)
    return {"lat": lat, "calls": calls, "errors": errors, "rate": calls / (last - first) if last > first else 0.0}
