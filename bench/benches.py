"""The benchmarks. Each takes `quick` and returns rows for the table:
(benchmark, figure, value, target, verdict) with verdict PASS, MISS or "" (for information)."""

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from typing import List, Tuple

import grpc

from atedevd.api import DevicePluginStub, pb
from atedevd.plugin import WORKERS
from bench.rig import Rig, cpu_seconds, percentile, snapshot
from tests.harness import REPO, RESOURCE, our_files

Row = Tuple[str, str, str, str, str]
MiB = 1024


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}" if seconds < 0.01 else f"{seconds * 1000:.1f}"


# --- start-up --------------------------------------------------------------------------


def startup(quick: bool) -> List[Row]:
    n = 3 if quick else 9
    ready, registered, stop = [], [], []
    with Rig() as rig:
        for i in range(n):
            d = rig.start()
            m = d.wait_ready(30)
            ready.append(m["at"] - d.started_at)
            if not rig.kubelet.wait_connected(RESOURCE, registrations=i + 1, timeout=30):
                raise RuntimeError(d.log())
            with rig.kubelet.cond:
                registered.append(rig.kubelet.registrations[-1]["at"] - d.started_at)
            t0 = time.monotonic()
            d.send(signal.SIGTERM)
            code = d.wait(30)
            stop.append(time.monotonic() - t0)  # to the exit; not the harness's own teardown
            d.close()
            if code != 0:
                raise RuntimeError(f"exit {code}: {d.log()}")
            rig.daemon = None
    med = percentile(ready, 50)
    return [
        ("startup", f"start to READY=1, median of {n} (max)", f"{ms(med)} ms ({ms(max(ready))})", "<= 400 ms", verdict(med <= 0.4)),
        ("startup", "start to registered, median", f"{ms(percentile(registered, 50))} ms", "", ""),
        ("startup", "SIGTERM to exit 0, median (max)", f"{ms(percentile(stop, 50))} ms ({ms(max(stop))})", "<= 1000 ms", verdict(max(stop) <= 1.0)),
    ]


# --- re-registration -----------------------------------------------------------------------


def restarts(rig: Rig, n: int, seed: int, gap_max: float = 0.2) -> dict:
    """`n` kubelet restarts with random gaps; per restart, the time from kubelet
    serving again to the Register call arriving, to registered, to the stream connected."""
    k = rig.kubelet
    rng = random.Random(seed)
    arrive, registered, connected = [], [], []
    lost = 0
    base = k.registration_count(RESOURCE)
    for i in range(1, n + 1):
        k.restart(gap=rng.uniform(0, gap_max))
        if not k.wait_connected(RESOURCE, registrations=base + i, timeout=30):
            lost += 1
            base -= 1  # this restart's registration never came
            continue
        with k.cond:
            # the newest client's first message (if the daemon registered twice, the second)
            k.cond.wait_for(lambda: RESOURCE in k.clients and id(k.clients[RESOURCE]) in k.first_message, 30)
            serving = k.serving_at
            first = next(a for a in k.arrivals if a >= serving)
            k.arrivals.clear()
            reg = k.registrations[-1]["at"]
            conn = k.first_message.get(id(k.clients.get(RESOURCE)), reg)
            k.first_message.clear()
        arrive.append(first - serving)
        registered.append(reg - serving)
        connected.append(conn - serving)
    return {"arrive": arrive, "registered": registered, "connected": connected, "lost": lost}


def _latency_rows(bench: str, r: dict, n: int) -> List[Row]:
    a, c = r["arrive"], r["connected"]
    rows = [
        (bench, f"kubelet serving -> Register arrives, p50/p99/max over {n}",
         f"{ms(percentile(a, 50))}/{ms(percentile(a, 99))}/{ms(max(a))} ms", "p99 <= 50 ms", verdict(percentile(a, 99) <= 0.05)),
        (bench, "kubelet serving -> registered (after dial-back), p50/p99/max",
         f"{ms(percentile(r['registered'], 50))}/{ms(percentile(r['registered'], 99))}/{ms(max(r['registered']))} ms", "", ""),
        (bench, "kubelet serving -> ListAndWatch connected, p50/p99/max",
         f"{ms(percentile(c, 50))}/{ms(percentile(c, 99))}/{ms(max(c))} ms", "", ""),
        (bench, "restarts without a re-registration", f"{r['lost']} of {n}", "0", verdict(r["lost"] == 0)),
    ]
    return rows


def rereg(quick: bool) -> List[Row]:
    n = 50 if quick else 500
    with Rig() as rig:
        rig.start_registered()
        r = restarts(rig, n, seed=500)
    return _latency_rows("rereg", r, n)


# --- Allocate -------------------------------------------------------------------------------


def _sequential(socket_path: str, n: int) -> List[float]:
    channel = grpc.insecure_channel("unix:" + socket_path)
    call = DevicePluginStub(channel).Allocate
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["kvm-0"])])
    for _ in range(100):
        call(req, timeout=30)
    lat = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        call(req, timeout=30)
        lat.append(clock() - t0)
    channel.close()
    return lat


def load(socket_path: str, callers: int, procs: int, duration: float = None, count: int = None) -> dict:
    """`callers` threads spread over `procs` client processes (bench.loadgen)."""
    per = [callers // procs + (1 if i < callers % procs else 0) for i in range(procs)]
    start_at = time.monotonic() + 1.0 + 0.3 * procs  # after every process has connected and warmed up
    outs, children = [], []
    env = dict(os.environ, PYTHONPATH=REPO)
    for threads in per:
        fd, out = tempfile.mkstemp(prefix="atebench-lat-")
        os.close(fd)
        outs.append(out)
        args = [sys.executable, "-m", "bench.loadgen", socket_path, out, "--threads", str(threads), "--start-at", str(start_at)]
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


def allocate(quick: bool) -> List[Row]:
    n = 500 if quick else 5000
    duration = 1.5 if quick else 5.0
    rows: List[Row] = []
    with Rig() as rig:
        d = rig.start_registered()
        lat = _sequential(rig.socket, n)
        p99 = percentile(lat, 99)
        rows.append(("allocate", f"sequential, p50/p99 over {n} (bench process)", f"{ms(percentile(lat, 50))}/{ms(p99)} ms", "p99 <= 2 ms", verdict(p99 <= 0.002)))
        rows.append(("allocate", "sequential, throughput", f"{len(lat) / sum(lat):.0f}/s", "", ""))
        for callers in (1, 16, 64):
            procs = min(callers, 4)
            r = load(rig.socket, callers, procs, duration=duration)
            name = f"{callers} caller{'s' if callers > 1 else ''} ({procs} client proc{'s' if procs > 1 else ''})"
            rows.append(("allocate", f"{name}, p50/p99 latency", f"{ms(percentile(r['lat'], 50))}/{ms(percentile(r['lat'], 99))} ms", "", ""))
            target, ok = ("", "")
            if callers == 16:
                target, ok = ">= 3000/s", verdict(r["rate"] >= 3000 and r["errors"] == 0)
            rows.append(("allocate", f"{name}, throughput ({r['errors']} errors)", f"{r['rate']:.0f}/s", target, ok))
        if d.proc.poll() is not None:
            raise RuntimeError("the daemon died under load")
    return rows


# --- health ---------------------------------------------------------------------------------


def health(quick: bool) -> List[Row]:
    n = 10 if quick else 50
    down, up = [], []
    with Rig() as rig:
        rig.start_registered()
        k = rig.kubelet
        k.track_health = True
        node = os.path.join(rig.dev_root, "kvm")
        for _ in range(n):
            for removing in (True, False):
                t0 = time.monotonic()
                if removing:
                    os.unlink(node)
                else:
                    os.symlink("/dev/null", node)
                want = 0 if removing else 4096
                if not k.wait(lambda: k.health is not None and k.health[0] >= t0 and k.health[1] == want, timeout=30):
                    raise RuntimeError(f"health did not follow the node; log:\n{rig.daemon.log()[-2000:]}")
                (down if removing else up).append(k.health[0] - t0)
                time.sleep(0.02)
    return [
        ("health", f"node removed -> all 4096 Unhealthy at kubelet, p50/p99 over {n}", f"{ms(percentile(down, 50))}/{ms(percentile(down, 99))} ms", "", ""),
        ("health", "node back -> all 4096 Healthy at kubelet, p50/p99", f"{ms(percentile(up, 50))}/{ms(percentile(up, 99))} ms", "", ""),
    ]


# --- soak: memory, fds, threads ------------------------------------------------------------


def soak(quick: bool) -> List[Row]:
    """The leak check: readings at start, after the Allocates, after the restarts, with
    readings after the first tenth of each too, so a warm-up (a pool growing to its
    cap, an allocator's first high-water mark) can be told from a leak."""
    allocs = 10_000 if quick else 100_000
    n = 100 if quick else 1000
    marks = []
    with Rig() as rig:
        d = rig.start_registered()

        def mark(label):
            time.sleep(2.0)  # let closing connections and exiting threads finish
            marks.append((label, snapshot(d.pid)))

        mark("start")
        callers, procs = 16, 4
        calls = errors = 0
        for part in (allocs // 10, allocs - allocs // 10):
            r = load(rig.socket, callers, procs, count=part // callers)
            calls, errors = calls + r["calls"], errors + r["errors"]
            mark(f"{calls} Allocates")
        rr = {"arrive": [], "registered": [], "connected": [], "lost": 0}
        done = 0
        for part in (n // 10, n * 4 // 10, n // 2):
            chunk = restarts(rig, part, seed=1000 + done)
            for key in ("arrive", "registered", "connected"):
                rr[key] += chunk[key]
            rr["lost"] += chunk["lost"]
            done += part
            mark(f"{done} restarts")
        left = our_files(rig.plugin_dir)
        alive = d.proc.poll() is None
    expected = ["ate.dev-kvm.*.sock", "kubelet.sock", "kubelet_internal_checkpoint"]
    start, warm, end = marks[0][1], marks[1][1], marks[-1][1]
    after_warmup = [m for label, m in marks[1:]]  # from the first tenth of the Allocates on

    def mib(kib):
        return f"{kib / MiB:.1f}"

    rows = [("soak", "RSS at start (4096 devices advertised)", f"{mib(start['rss'])} MiB", "<= 40 MiB", verdict(start["rss"] <= 40 * MiB))]
    rows.append(("soak", "RSS MiB: " + ", ".join(label for label, _ in marks), " / ".join(mib(m["rss"]) for _, m in marks), "", ""))
    rows.append(("soak", "  of which anonymous (heap, stacks)", " / ".join(mib(m["anon"]) for _, m in marks), "", ""))
    rows.append(("soak", "  of which file-backed (code pages touched)", " / ".join(mib(m["file"]) for _, m in marks), "", ""))
    growth = end["rss"] - start["rss"]
    steady = end["rss"] - warm["rss"]
    rows += [
        ("soak", f"RSS growth, start -> after {allocs} Allocates + {n} restarts", f"{growth / MiB:+.2f} MiB", "< 2 MiB", verdict(growth < 2 * MiB)),
        ("soak", f"RSS growth after warm-up ({marks[1][0]} -> end)", f"{steady / MiB:+.2f} MiB", "< 2 MiB", verdict(steady < 2 * MiB)),
        ("soak", "open fds at each reading", "/".join(str(m["fds"]) for _, m in marks), "flat", verdict(len({m["fds"] for _, m in marks}) == 1)),
        ("soak", "threads at each reading (every worker started at start-up)", "/".join(str(m["threads"]) for _, m in marks), f"<= {WORKERS}+10", verdict(max(m["threads"] for _, m in marks) <= WORKERS + 10)),
        ("soak", "threads after warm-up (spread: short-lived gRPC threads)", "/".join(str(m["threads"]) for m in after_warmup), "flat, spread <= 1", verdict(max(m["threads"] for m in after_warmup) - min(m["threads"] for m in after_warmup) <= 1)),
        ("soak", f"Allocate errors (of {calls})", str(errors), "0", verdict(errors == 0)),
        ("soak", f"restarts without a re-registration (of {n})", str(rr["lost"]), "0", verdict(rr["lost"] == 0 and alive)),
        ("soak", "plugin dir after the soak", " ".join(left), "no leftovers", verdict(left == expected)),
    ]
    rows += _latency_rows("soak", rr, n)[:1]
    return rows


# --- idle CPU -----------------------------------------------------------------------------------


def idle(quick: bool) -> List[Row]:
    seconds = 10.0 if quick else 60.0
    with Rig() as rig:
        d = rig.start_registered(env={"WATCHDOG_USEC": "10000000"})
        time.sleep(2.0)
        pings0 = len(d.notify.values("WATCHDOG"))
        c0 = cpu_seconds(d.pid)
        time.sleep(seconds)
        used = cpu_seconds(d.pid) - c0
        pings = len(d.notify.values("WATCHDOG")) - pings0
    budget = 0.1 * seconds / 60
    return [
        ("idle", f"CPU over {seconds:.0f} s idle, registered, WatchdogSec=10s ({pings} pings)", f"{used:.3f} s", f"< {budget:.3f} s", verdict(used < budget and pings > 0)),
    ]


BENCHES = {
    "startup": startup,
    "rereg": rereg,
    "allocate": allocate,
    "health": health,
    "soak": soak,
    "idle": idle,
}
