"""The rejection window per lifecycle event: how long kubelet would have rejected a pod
requesting the resource (UnexpectedAdmissionError, which kubelet never retries), per kubelet
mode of the stand-in.

Each round: trigger the event, wait for the healthy end state (Kubelet.assert_healthy), and
sum the time the stand-in's admission log (Kubelet.record_admission: kubelet's Allocate
checks, every millisecond and at every change) said "reject" since the event; for a kubelet
restart, since kubelet.sock appeared (a kubelet that is down admits nothing, so rejects
nothing). The events:

  kubelet-restart     kubelet killed and started back to back (the other core busy)
  kubelet-listen-gap  the same, kubelet listening 0-5 ms after kubelet.sock appears, so an
                      instant Register is refused (ECONNREFUSED) and must be retried
  daemon-sigterm      `systemctl restart`: SIGTERM, the exit, a new process at once
  daemon-kill-9       SIGKILL, then a new process at once (systemd adds RestartSec=)
  reload-unchanged    SIGHUP, configuration unchanged
  reload-changed      SIGHUP with the resource's count changed (registers anew)
  socket-deleted      our current socket unlinked by someone else
  stream-ended        kubelet ends our ListAndWatch stream

socket-deleted and stream-ended rounds come after a stable registration (more than the
daemon's STABLE_AFTER_S): an early stream end backs off on purpose.
"""

import os
import random
import signal
import time
from typing import Dict, List, Optional, Tuple

from atedevd.registration import STABLE_AFTER_S
from bench.rig import BusyCore, Rig, percentile
from tests.harness import RESOURCE, current_socket
from tests.kubelet_standin import MODES

Row = Tuple[str, str, str, str, str]
EVENTS = ("kubelet-restart", "kubelet-listen-gap", "daemon-sigterm", "daemon-kill-9", "reload-unchanged",
          "reload-changed", "socket-deleted", "stream-ended")
UNITS = 1024
LISTEN_GAP_MAX = 0.005
END_STATE_TIMEOUT = 20.0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def stats(values: List[float]) -> str:
    if not values:
        return "none"
    return f"{ms(percentile(values, 50))}/{ms(percentile(values, 99))}/{ms(max(values))} ms"


def write_config(path: str, count: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f'[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\ncount = {count}\n')
    os.replace(tmp, path)


class Lifecycle:
    """One kubelet mode: a rig, a registered daemon, the admission log, and one method per event."""

    def __init__(self, mode: str, seed: int):
        self.mode = mode
        self.rng = random.Random(seed)
        self.rig = Rig(kubelet_mode=mode)
        self.k = self.rig.kubelet
        self.config = os.path.join(self.rig.root, "atedevd.toml")
        self.count = UNITS
        write_config(self.config, self.count)
        self.k.units = self.count
        self.log = self.k.record_admission(RESOURCE)
        self.start_daemon()
        self.k.assert_healthy(RESOURCE, self.count, new_registrations=1, timeout=30)

    def start_daemon(self):
        d = self.rig.start(config=self.config)
        return d

    def close(self) -> None:
        self.log.stop()
        self.rig.close()

    # --- one round -------------------------------------------------------------------------

    def round(self, event: str) -> dict:
        k = self.k
        if event in ("socket-deleted", "stream-ended"):
            self._stable()
        with k.cond:
            k.arrivals.clear()
            k.healthy_at.clear()
        mark = k.mark()
        new = 1
        started = None  # a new daemon process's start
        t0 = time.monotonic()
        if event in ("kubelet-restart", "kubelet-listen-gap"):
            gap = self.rng.uniform(0, LISTEN_GAP_MAX) if event == "kubelet-listen-gap" else 0.0
            k.restart(0.0, listen_gap=gap)
            t0 = k.serving_at  # from kubelet.sock appearing: a kubelet that is down rejects nothing
        elif event in ("daemon-sigterm", "daemon-kill-9"):
            old = self.rig.daemon
            old.send(signal.SIGTERM if event == "daemon-sigterm" else signal.SIGKILL)
            old.wait(30)
            started = self.start_daemon().started_at  # at once, as systemd does (no RestartSec= here)
            old.close()  # the harness's own teardown (its notify socket), after the new start
        elif event.startswith("reload-"):
            d = self.rig.daemon
            after = len(d.notify.messages)
            if event == "reload-changed":
                self.count = UNITS - 1 if self.count == UNITS else UNITS
                write_config(self.config, self.count)
                k.units = self.count
            else:
                new = 0
            d.send(signal.SIGHUP)
            if d.notify.wait_for("READY", "1", timeout=30, after=after) is None:
                raise RuntimeError(f"no READY=1 after SIGHUP; log:\n{d.log()[-3000:]}")
        elif event == "socket-deleted":
            os.unlink(current_socket(self.rig.plugin_dir, kubelet=k))
        elif event == "stream-ended":
            k.drop(RESOURCE)
        else:
            raise ValueError(f"unknown event {event!r}; known: {', '.join(EVENTS)}")
        failure = None
        try:
            k.assert_healthy(RESOURCE, self.count, since=mark, new_registrations=new, timeout=END_STATE_TIMEOUT)
        except AssertionError as e:
            failure = str(e).splitlines()[0]
        admitted = k.wait(lambda: self.log.state == "admit", timeout=END_STATE_TIMEOUT)
        t1 = time.monotonic()
        rejected, spells, reasons = self.log.rejected(t0, t1)
        by_reason = self.log.rejected_by_reason(t0, t1)
        with k.cond:
            arrive = next((a - t0 for a in k.arrivals if a >= t0), None)
            healthy = next((h - t0 for h in k.healthy_at if h >= t0), None)
            listen = (k.listening_at - t0) if event.startswith("kubelet-") and k.listening_at else None
            ks = k.inc.listeners[-1] if event == "kubelet-listen-gap" and k.inc.listeners else None
            # after kubelet listens: our first connection (the daemon's connect probe), and the first
            # one that carried bytes (gRPC's, with the Register): the daemon's part of the wait
            accepted = ks.accepted[0] - k.listening_at if ks is not None and getattr(ks, "accepted", None) else None
            spoke = ks.first_bytes[0] - k.listening_at if ks is not None and getattr(ks, "first_bytes", None) else None
            launch = next((a - started for a in k.arrivals if started is not None and a >= started), None)
        return {"rejected": rejected if admitted else None, "spells": spells, "reasons": reasons, "by_reason": by_reason,
                "failure": failure, "arrive": arrive, "healthy": healthy, "listen": listen, "launch": launch,
                "accepted": accepted, "spoke": spoke}

    def _stable(self) -> None:
        """Until the current registration is older than the daemon's STABLE_AFTER_S."""
        k = self.k
        with k.cond:
            accepted = [r for r in k.registrations if r["resource"] == RESOURCE]
            since = accepted[-1]["done_at"] if accepted else time.monotonic()
        left = since + STABLE_AFTER_S + 0.2 - time.monotonic()
        if left > 0:
            time.sleep(left)


def run(events: List[str], rounds: int, modes=MODES) -> List[Row]:
    relay_rows, relay_adds = relay_cost(max(rounds, 200))
    rows: List[Row] = list(relay_rows)
    for mode in modes:
        lc = Lifecycle(mode, seed=2026)
        try:
            by_event: Dict[str, List[dict]] = {}
            for event in events:
                results = []
                if event.startswith("kubelet-"):
                    with BusyCore():
                        results = [lc.round(event) for _ in range(rounds)]
                else:
                    results = [lc.round(event) for _ in range(rounds)]
                by_event[event] = results
                rows += event_rows(event, mode, results, rounds)
            rows += refusal_cost(mode, by_event, relay_adds)
            rows.append(("lifecycle", f"  admission log (kubelet {mode}): {lc.log.samples} samples, widest gap",
                         f"{ms(lc.log.max_gap)} ms", "", ""))
        finally:
            lc.close()
    return rows


KINDS = (("is not registered", "unregistered"), ("no healthy devices present", "0 healthy"),
         ("unknown Device Plugin", "no endpoint"), ("has been stopped", "endpoint stopped"),
         ("client connection is closing", "connection closed"), ("stream ended", "plugin gone"))


def kind(reason: str) -> str:
    """A short name for the reason kubelet would give (Kubelet.rejection)."""
    return next((short for text, short in KINDS if text in reason), reason)


def event_rows(event: str, mode: str, results: List[dict], rounds: int) -> List[Row]:
    on = f"{event} (kubelet {mode})"
    windows = [r["rejected"] for r in results if r["rejected"] is not None]
    rejecting = sum(1 for w in windows if w > 0)
    lost = sum(1 for r in results if r["rejected"] is None)
    failed = [r["failure"] for r in results if r["failure"]]
    spent: Dict[str, float] = {}
    for r in results:
        for why, seconds in r["by_reason"].items():
            spent[kind(why)] = spent.get(kind(why), 0.0) + seconds
    total = sum(spent.values())
    target, ok = "", ""
    if event == "kubelet-restart" and windows:  # issue 16's targets, from kubelet.sock
        target = "p50 <= 20, p99 <= 50 ms"
        ok = verdict(percentile(windows, 50) <= 0.020 and percentile(windows, 99) <= 0.050)
    out = [("lifecycle", f"{on}: rejecting, p50/p99/max of {len(windows)}", stats(windows), target, ok)]
    out.append(("lifecycle", f"  rounds with a rejection / never admitted again / end state missed",
                f"{rejecting} / {lost} / {len(failed)} of {rounds}", "- / 0 / 0", verdict(not lost and not failed)))
    launches = [r["launch"] for r in results if r["launch"] is not None]
    if launches:
        out.append(("lifecycle", "  new process start -> Register arrives", stats(launches), "p50 <= 80 ms",
                    verdict(percentile(launches, 50) <= 0.080)))
    if not event.startswith("kubelet-") and any(r["arrive"] is not None for r in results):
        out.append(("lifecycle", "  event -> Register arrives", stats([r["arrive"] for r in results if r["arrive"] is not None]), "", ""))
    if event.startswith("kubelet-"):
        out.append(("lifecycle", "  kubelet.sock appears -> Register arrives", stats([r["arrive"] for r in results if r["arrive"] is not None]), "", ""))
        if event == "kubelet-listen-gap":
            late = [r["arrive"] - r["listen"] for r in results if r["arrive"] is not None and r["listen"] is not None]
            out.append(("lifecycle", "  kubelet listens -> Register arrives (relay included)", stats(late), "", ""))
            for key, what in (("accepted", "a first connection is accepted (the daemon's probe)"),
                              ("spoke", "the first bytes of gRPC's connection")):
                got = [r[key] for r in results if r[key] is not None]
                out.append(("lifecycle", f"  kubelet listens -> {what}", stats(got), "", ""))
        out.append(("lifecycle", f"  kubelet.sock appears -> all units healthy", stats([r["healthy"] for r in results if r["healthy"] is not None]), "", ""))
    if total > 0:
        out.append(("lifecycle", "  why, share of the time rejecting", ", ".join(
            f"{k} {v / total:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])), "", ""))
    for f in failed[:2]:
        out.append(("lifecycle", "  end state missed", f[:110], "", ""))
    return out


def refusal_cost(mode: str, by_event: Dict[str, List[dict]], relay_adds: float) -> List[Row]:
    """What a Register refused because kubelet did not listen yet costs: how much later it
    arrives after kubelet listens than it does after a kubelet.sock that appears listening
    (the kubelet-restart rounds of the same run), the stand-in's relay (which only the
    listen-gap rounds go through) taken off. p50s."""
    gap, restart = by_event.get("kubelet-listen-gap"), by_event.get("kubelet-restart")
    if not gap or not restart:
        return []
    late = [r["arrive"] - r["listen"] for r in gap if r["arrive"] is not None and r["listen"] is not None]
    direct = [r["arrive"] for r in restart if r["arrive"] is not None]
    if not late or not direct:
        return []
    cost = percentile(late, 50) - percentile(direct, 50) - relay_adds
    return [("lifecycle", f"a refused Register's cost (kubelet {mode}): listens -> Register {ms(percentile(late, 50))} "
             f"- appears listening -> Register {ms(percentile(direct, 50))} - relay {ms(relay_adds)}",
             f"{ms(cost)} ms", "<= 2 ms", verdict(cost <= 0.002))]


def relay_cost(n: int) -> Tuple[List[Row], float]:
    """What the stand-in's kubelet.sock relay adds to a Register: the same call (one kubelet
    refuses at once: a wrong API version, so no dial-back) on a fresh connection, as the
    daemon makes one per Register, through kubelet.sock and straight to the Registration
    server's private address, interleaved."""
    import shutil
    import tempfile

    import grpc

    from atedevd.api import RegistrationStub, pb
    from tests.kubelet_standin import Kubelet

    root = tempfile.mkdtemp(prefix="atebench-", dir="/tmp")
    k = Kubelet(os.path.join(root, "device-plugins"), pod_resources=False, listen_gap=1e-6)  # a gap: the relay
    k.start()
    direct = "unix-abstract:" + k.inc.listeners[0].upstream[1:]
    times: Dict[str, List[float]] = {"relay": [], "direct": []}
    request = pb.RegisterRequest(version="v0", endpoint="x.sock", resource_name=RESOURCE)
    try:
        for i in range(2 * n):
            which = ("relay", "direct")[i % 2]
            target = "unix:" + k.socket if which == "relay" else direct
            t = time.perf_counter()
            channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            try:
                RegistrationStub(channel).Register(request, timeout=5)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNKNOWN:
                    raise
            times[which].append(time.perf_counter() - t)
            channel.close()
    finally:
        k.close()
        shutil.rmtree(root, ignore_errors=True)
    r, d = percentile(times["relay"], 50), percentile(times["direct"], 50)
    return [("lifecycle", f"stand-in: fresh connection + Register via kubelet.sock relay / direct, p50 of {n}",
             f"{r * 1000:.2f} / {d * 1000:.2f} ms (relay adds {(r - d) * 1000:+.2f})", "", "")], r - d
