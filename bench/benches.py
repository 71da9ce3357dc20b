"""The benchmarks. Each takes `quick` and returns rows for the table:
(benchmark, figure, value, target, verdict) with verdict PASS, MISS or "" (for information)."""

import os
import random
import signal
import time
from typing import List, Optional, Tuple

from atedevd.kubelet.plugin import PRESTARTED_WORKERS as WORKERS
from bench.rig import BusyCore, Rig, TimedKubelet, cpu_seconds, load, percentile, snapshot
from rig.harness import OUR_SOCKETS, RESOURCE, current_socket, our_files
from rig.kubelet_standin import MODES

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
            with rig.kubelet.cond:
                rig.kubelet.healthy_at.clear()
            d = rig.start()
            m = d.wait_ready(30)
            ready.append(m["at"] - d.started_at)
            if not rig.kubelet.wait_connected(RESOURCE, registrations=i + 1, timeout=30):
                raise RuntimeError(d.log())
            with rig.kubelet.cond:
                rig.kubelet.cond.wait_for(lambda: rig.kubelet.healthy_at, 30)
                registered.append(rig.kubelet.healthy_at[0] - d.started_at)
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
        ("startup", "launch -> 1024 healthy in kubelet, median (max)", f"{ms(percentile(registered, 50))} ms ({ms(max(registered))})", "", ""),
        ("startup", "SIGTERM to exit 0, median (max)", f"{ms(percentile(stop, 50))} ms ({ms(max(stop))})", "<= 1000 ms", verdict(max(stop) <= 1.0)),
    ]


# --- re-registration -----------------------------------------------------------------------


def restarts(rig: Rig, n: int, seed: int, gap_max: float = 0.0) -> dict:
    """`n` kubelet restarts, back to back like a real kubelet's unless `gap_max` (then a
    random gap up to it between the wipe and kubelet.sock); per restart, the time from
    kubelet.sock being served to our Register arriving, and to our 1024 devices being
    healthy in kubelet again."""
    k = rig.kubelet
    rng = random.Random(seed)
    arrive, healthy = [], []
    lost = 0
    for _ in range(n):
        with k.cond:
            k.arrivals.clear()
            k.healthy_at.clear()
        k.restart(gap=rng.uniform(0, gap_max) if gap_max else 0.0)
        with k.cond:
            serving = k.serving_at
            if not k.cond.wait_for(lambda: any(t >= serving for t in k.healthy_at), 30):
                lost += 1
                continue
            arrive.append(next(a for a in k.arrivals if a >= serving) - serving)
            healthy.append(next(t for t in k.healthy_at if t >= serving) - serving)
    return {"arrive": arrive, "healthy": healthy, "lost": lost}


def _p(values, target: str = "") -> str:
    return f"{ms(percentile(values, 50))}/{ms(percentile(values, 99))}/{ms(max(values))} ms" if values else "none"


def _latency_rows(bench: str, r: dict, n: int, mode: str = "") -> List[Row]:
    a, h = r["arrive"], r["healthy"]
    on = f" (kubelet {mode})" if mode else ""
    ok = bool(a) and percentile(a, 50) <= 0.005 and percentile(a, 99) <= 0.015
    return [
        (bench, f"kubelet.sock served -> Register arrives{on}, p50/p99/max of {n}", _p(a), "p50 <= 5, p99 <= 15 ms", verdict(ok)),
        (bench, f"kubelet.sock served -> 1024 healthy in kubelet{on}, p50/p99/max", _p(h), "", ""),
        (bench, f"restarts without a re-registration{on}", f"{r['lost']} of {n}", "0", verdict(r["lost"] == 0)),
    ]


def rereg(quick: bool) -> List[Row]:
    """Back-to-back kubelet restarts with the machine's other core busy, per kubelet version."""
    n = 50 if quick else 500
    rows: List[Row] = []
    for mode in MODES:
        with Rig(kubelet_mode=mode) as rig:
            rig.start_registered()
            with BusyCore():
                r = restarts(rig, n, seed=500)
        rows += _latency_rows("rereg", r, n, mode)
    return rows


def let_go(quick: bool) -> List[Row]:
    """The same kubelet stays up and ends our stream: the new Register waits until kubelet
    has let go of the old socket. Measured after a stable registration (> 2 s), per version."""
    n = 5 if quick else 20
    rows: List[Row] = []
    for mode in MODES:
        arrive, healthy = [], []
        with Rig(kubelet_mode=mode) as rig:
            rig.start_registered()
            k = rig.kubelet
            for _ in range(n):
                time.sleep(2.2)  # a stable registration: its stream end is answered at once
                with k.cond:
                    k.arrivals.clear()
                    k.healthy_at.clear()
                dropped = time.monotonic()
                k.drop(RESOURCE)
                with k.cond:
                    if not k.cond.wait_for(lambda: k.healthy_at, 30):
                        raise RuntimeError(f"no re-registration after a stream end; log:\n{rig.daemon.log()}")
                    arrive.append(k.arrivals[0] - dropped)
                    healthy.append(k.healthy_at[0] - dropped)
        rows += [
            ("let-go", f"kubelet ends our stream -> new Register arrives (kubelet {mode}), p50/p99/max of {n}", _p(arrive), "p99 <= 100 ms", verdict(percentile(arrive, 99) <= 0.1)),
            ("let-go", f"kubelet ends our stream -> 1024 healthy again (kubelet {mode})", _p(healthy), "", ""),
        ]
    return rows


def race(quick: bool) -> List[Row]:
    """Rounds of a random re-registration trigger with random delays injected at every step
    of kubelet's Register and teardown, per version; after each round the end state is
    asserted (one live stream on the newest socket, endpoint not stopped, allocatable 1024,
    an Allocate through kubelet succeeds, no duplicate Register)."""
    n = 30 if quick else 1000
    rows: List[Row] = []
    for mode in MODES:
        rng = random.Random(2027)
        delay = lambda: rng.uniform(0, 0.03)  # noqa: E731
        steps = ("before_dial", "after_dial", "before_options", "before_set_endpoint", "before_return",
                 "before_stream", "teardown", "teardown_lookup")
        failures, kinds = [], {}
        t0 = time.monotonic()
        with Rig(kubelet=False) as rig:
            rig.kubelet = TimedKubelet(rig.plugin_dir, kubelet=mode, delays={s: delay for s in steps}, grace=5.0)
            rig.kubelet.start()
            rig.start_registered()
            k = rig.kubelet
            for i in range(n):
                kind = rng.choice(("restart", "restart-gap", "drop", "delete-socket", "recreate-socket"))
                kinds[kind] = kinds.get(kind, 0) + 1
                m = k.mark()
                if kind == "restart":
                    k.restart(0.0)
                elif kind == "restart-gap":
                    k.restart(rng.uniform(0, 0.2))
                elif kind == "drop":
                    k.drop(RESOURCE)
                elif kind == "delete-socket":
                    os.unlink(current_socket(rig.plugin_dir, kubelet=k))
                else:
                    k.recreate_socket()
                try:
                    k.assert_healthy(RESOURCE, 1024, since=m, new_registrations=1, timeout=20)
                except AssertionError as e:
                    failures.append(f"round {i} ({kind}): {str(e).splitlines()[0]}")
                    if len(failures) > 10:
                        break
        took = time.monotonic() - t0
        mix = ", ".join(f"{v} {k_}" for k_, v in sorted(kinds.items()))
        rows.append(("race", f"rounds ending healthy (kubelet {mode}; {mix}; {took:.0f} s)", f"{n - len(failures)} of {n}", f"{n} of {n}", verdict(not failures)))
        for f in failures[:3]:
            rows.append(("race", "  failed", f[:120], "", ""))
    return rows


# --- Allocate -------------------------------------------------------------------------------


def allocate(quick: bool) -> List[Row]:
    n = 500 if quick else 5000
    duration = 1.5 if quick else 5.0
    rows: List[Row] = []
    with Rig() as rig:
        d = rig.start_registered()
        # A client process of its own: the in-process kubelet stand-in would share its GIL.
        seq = load(rig.socket, 1, 1, count=n)
        lat, p99 = seq["lat"], percentile(seq["lat"], 99)
        rows.append(("allocate", f"sequential, p50/p99 over {n} (client process)", f"{ms(percentile(lat, 50))}/{ms(p99)} ms", "p99 <= 2 ms", verdict(p99 <= 0.002 and seq["errors"] == 0)))
        rows.append(("allocate", "sequential, throughput", f"{seq['rate']:.0f}/s", "", ""))
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
                want = 0 if removing else 1024
                if not k.wait(lambda: k.health is not None and k.health[0] >= t0 and k.health[1] == want, timeout=30):
                    raise RuntimeError(f"health did not follow the node; log:\n{rig.daemon.log()[-2000:]}")
                (down if removing else up).append(k.health[0] - t0)
                time.sleep(0.02)
    return [
        ("health", f"node removed -> all 1024 Unhealthy at kubelet, p50/p99 over {n}", f"{ms(percentile(down, 50))}/{ms(percentile(down, 99))} ms", "", ""),
        ("health", "node back -> all 1024 Healthy at kubelet, p50/p99", f"{ms(percentile(up, 50))}/{ms(percentile(up, 99))} ms", "", ""),
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
        rr = {"arrive": [], "healthy": [], "lost": 0}
        done = 0
        for part in (n // 10, n * 4 // 10, n // 2):
            chunk = restarts(rig, part, seed=1000 + done)
            for key in ("arrive", "healthy"):
                rr[key] += chunk[key]
            rr["lost"] += chunk["lost"]
            done += part
            mark(f"{done} restarts")
        left = our_files(rig.plugin_dir)
        alive = d.proc.poll() is None
    expected = [".atedevd", OUR_SOCKETS, "kubelet.sock", "kubelet_internal_checkpoint"]
    start, warm, end = marks[0][1], marks[1][1], marks[-1][1]
    after_warmup = [m for label, m in marks[1:]]  # from the first tenth of the Allocates on

    def mib(kib):
        return f"{kib / MiB:.1f}"

    rows = [("soak", "RSS at start (1024 devices advertised)", f"{mib(start['rss'])} MiB", "<= 40 MiB", verdict(start["rss"] <= 40 * MiB))]
    rows.append(("soak", "RSS MiB: " + ", ".join(label for label, _ in marks), " / ".join(mib(m["rss"]) for _, m in marks), "", ""))
    rows.append(("soak", "  of which anonymous (heap, stacks)", " / ".join(mib(m["anon"]) for _, m in marks), "", ""))
    rows.append(("soak", "  of which file-backed (code pages touched)", " / ".join(mib(m["file"]) for _, m in marks), "", ""))
    growth = end["rss"] - start["rss"]
    steady = end["rss"] - warm["rss"]
    rows += [
        ("soak", f"RSS growth, start -> after {allocs} Allocates + {n} restarts", f"{growth / MiB:+.2f} MiB", "< 2 MiB", verdict(growth < 2 * MiB)),
        ("soak", f"RSS growth after warm-up ({marks[1][0]} -> end)", f"{steady / MiB:+.2f} MiB", "< 2 MiB", verdict(steady < 2 * MiB)),
        ("soak", "open fds at each reading", "/".join(str(m["fds"]) for _, m in marks), "flat", verdict(len({m["fds"] for _, m in marks}) == 1)),
        # Ours: the workers, the loop, a serving thread per gRPC server (current, standby, one handing over).
        ("soak", "Python threads at each reading (every worker started at start-up)", "/".join(str(m["py_threads"]) for _, m in marks), f"<= {WORKERS}+4", verdict(max(m["py_threads"] for _, m in marks) <= WORKERS + 4)),
        ("soak", "Python threads after warm-up", "/".join(str(m["py_threads"]) for m in after_warmup), "flat, spread <= 1", verdict(max(m["py_threads"] for m in after_warmup) - min(m["py_threads"] for m in after_warmup) <= 1)),
        ("soak", "  all threads, gRPC core's included (its executor grows with concurrent calls)", "/".join(str(m["threads"]) for _, m in marks), "", ""),
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


def lifecycle(quick: bool, rounds: Optional[int] = None, events: Optional[List[str]] = None,
              limit: bool = False) -> List[Row]:
    """The rejection window per lifecycle event and kubelet mode (bench.lifecycle)."""
    from bench import lifecycle as lc

    return lc.run(events or list(lc.EVENTS), rounds or (10 if quick else 100), limit=limit)


def units(quick: bool, rounds: Optional[int] = None) -> List[Row]:
    """Register -> all units healthy in kubelet for 256 ... 16384 units (bench.units)."""
    from bench import units as u

    return u.run(rounds or (5 if quick else 30))


def pattern(quick: bool) -> List[Row]:
    """A 64-node pattern resource beside kvm: Allocate and per-unit health latency (bench.pattern)."""
    from bench import pattern as pt

    return pt.run(quick)


def overlap(quick: bool) -> List[Row]:
    """Idle CPU and a reload's answer with 2 and 8 patterns over the same 2,000 nodes (bench.overlap)."""
    from bench import overlap as ov

    return ov.run(quick)


def upgrade(quick: bool, rounds: Optional[int] = None) -> List[Row]:
    """The rejection window of a package upgrade in a booted Debian 12 container (bench.upgrade)."""
    from bench import upgrade as up

    return up.run(rounds or (3 if quick else 10))


def boot(quick: bool, rounds: Optional[int] = None) -> List[Row]:
    """kubelet's first batch of pods after a real boot, won or lost, per kubelet model, with 1 and
    16 resources (bench.boot)."""
    from bench import boot as b

    return b.run(rounds or (5 if quick else 20))


def dra(quick: bool) -> List[Row]:
    """DRA mode's prepare, unprepare and slice republication, beside device-plugin Allocate (bench.dra)."""
    from bench import dra as d

    return d.run(quick)


BENCHES = {
    "startup": startup,
    "rereg": rereg,
    "let-go": let_go,
    "race": race,
    "allocate": allocate,
    "dra": dra,
    "health": health,
    "pattern": pattern,
    "overlap": overlap,
    "soak": soak,
    "idle": idle,
    "lifecycle": lifecycle,
    "units": units,
    "upgrade": upgrade,
    "boot": boot,
}
