"""The rejection window per lifecycle event: how long kubelet would have rejected a pod
requesting the resource (UnexpectedAdmissionError, which kubelet never retries), per kubelet
mode of the stand-in.

Each round: trigger the event, wait for the healthy end state (Kubelet.assert_healthy), and
sum the time the stand-in's admission log (Kubelet.record_admission: kubelet's Allocate
checks, every millisecond and at every change) said "reject" since the event; for a kubelet
restart, since kubelet.sock appeared (a kubelet that is down admits nothing, so rejects
nothing). With it, the pods an admission loop putting one in every 10 ms would have seen
rejected (AdmissionLog.pods_rejected), the Register calls kubelet saw, and atedevd's calls
to pod-resources. The events:

  kubelet-restart     kubelet killed and started back to back (the other core busy)
  kubelet-listen-gap  the same, kubelet listening 0-5 ms after kubelet.sock appears, so an
                      instant Register is refused (ECONNREFUSED) and must be retried
  daemon-sigterm      `systemctl restart`: SIGTERM, the exit, a new process at once
  daemon-kill-9       SIGKILL, then a new process at once (systemd adds RestartSec=)
  reload-unchanged    SIGHUP, configuration unchanged
  reload-count        SIGHUP with the resource's count changed; done when kubelet counts
                      the new number
  reload-permissions  SIGHUP with the resource's permissions changed ("rw" <-> "rwm"); done
                      when an Allocate through kubelet answers the new ones
  reload-upgrade      the package upgraded (a file of the daemon's copy of it replaced by a
                      rename, as dpkg does), then SIGHUP: the daemon hands over to a warm
                      successor (atedevd/upgrade/machines.py); done when the successor is registered
  socket-deleted      our current socket unlinked by someone else
  stream-ended        kubelet ends our ListAndWatch stream

socket-deleted and stream-ended rounds come after a stable registration (more than the
daemon's STABLE_AFTER_S): an early stream end backs off on purpose. The stand-in limits
pod-resources as kubelet does (100 a second, burst 10, all clients together); with
`limit`, a node agent (rig/node_agent.py, a process of its own) polls it 80 times a
second beside atedevd. The rows say how many of atedevd's calls were refused.
"""

import os
import random
import shutil
import signal
import time
from typing import Dict, List, Optional, Tuple

import grpc

from atedevd.registration.machine import STABLE_AFTER_S
from bench.rig import BusyCore, Rig, percentile
from rig import node_agent
from rig.harness import REPO, RESOURCE, current_socket
from rig.kubelet_standin import MODES, POD_PERIOD_S, KubeletError

Row = Tuple[str, str, str, str, str]
EVENTS = ("kubelet-restart", "kubelet-listen-gap", "daemon-sigterm", "daemon-kill-9", "reload-unchanged",
          "reload-count", "reload-permissions", "reload-upgrade", "socket-deleted", "stream-ended")
UNITS = 1024
LISTEN_GAP_MAX = 0.005
END_STATE_TIMEOUT = 20.0
OURS = "grpc-python"  # atedevd's calls to pod-resources, as the stand-in counts them (rig.kubelet_standin._client_of)
PERMISSIONS = ("rw", "rwm")
SETTLE_S = 0.25  # a reload's end state must hold this long (Lifecycle._settled)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def stats(values: List[float]) -> str:
    if not values:
        return "none"
    return f"{ms(percentile(values, 50))}/{ms(percentile(values, 99))}/{ms(max(values))} ms"


def write_config(path: str, count: int, permissions: str = "rw", mode: str = "1.32") -> None:
    """The resource, and what the node's kubelet is: the current kubelet keeps endpoints per
    socket, so an upgrade's successor registers beside its predecessor there."""
    tmp = path + ".tmp"
    endpoints = "per-socket" if mode == "current" else "per-resource"
    with open(tmp, "w") as f:
        f.write(f'[daemon]\nkubelet_endpoints = "{endpoints}"\n'
                f'[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\ncount = {count}\npermissions = "{permissions}"\n')
    os.replace(tmp, path)


class NotYet(Exception):
    """An event the daemon cannot do yet: its row says so instead of a figure."""


class Lifecycle:
    """One kubelet mode: a rig, a registered daemon, the admission log, and one method per event;
    with `limit`, kubelet's pod-resources limit and a node agent beside."""

    def __init__(self, mode: str, seed: int, limit: bool = False):
        self.mode = mode
        self.rng = random.Random(seed)
        self.rig = Rig(kubelet_mode=mode)  # kubelet's pod-resources limit, as the stand-in has it
        self.k = self.rig.kubelet
        self.agent = node_agent.spawn(self.k.pod_resources_socket) if limit else None
        self.agent_counts: Optional[dict] = None
        self.config = os.path.join(self.rig.root, "atedevd.toml")
        self.count = UNITS
        self.permissions = PERMISSIONS[0]
        write_config(self.config, self.count, self.permissions, mode)
        self.k.units = self.count
        self.log = self.k.record_admission(RESOURCE)
        if self.agent is not None and not self.k.wait(
                lambda: self.k.pod_resources_counts.get(node_agent.USER_AGENT.split("/")[0]), timeout=30):
            raise RuntimeError("the node agent never called pod-resources")
        self.start_daemon()
        self.k.assert_healthy(RESOURCE, self.count, new_registrations=1, timeout=30)

    def start_daemon(self):
        """The daemon from a copy of the package, which an upgrade round replaces under it."""
        site = os.path.join(self.rig.root, "site")
        if not os.path.isdir(site):
            shutil.copytree(os.path.join(REPO, "atedevd"), os.path.join(site, "atedevd"),
                            ignore=shutil.ignore_patterns("__pycache__"))
        launcher = ("-c", f"import sys; sys.path.insert(0, {site!r})\n"
                          "from atedevd.launch import main; sys.exit(main(sys.argv[1:]))")
        return self.rig.start(config=self.config, launcher=launcher)

    def close(self) -> None:
        if self.agent is not None:
            self.agent_counts = self.agent.stop()
        self.log.stop()
        self.rig.close()

    def reload(self, count: int, permissions: str) -> None:
        """Rewrite the configuration, SIGHUP, and wait for the reload's READY=1."""
        d = self.rig.daemon
        after = len(d.notify.messages)
        self.count, self.permissions = count, permissions
        write_config(self.config, count, permissions, self.mode)
        self.k.units = count
        d.send(signal.SIGHUP)
        if d.notify.wait_for("READY", "1", timeout=30, after=after) is None:
            raise RuntimeError(f"no READY=1 after SIGHUP; log:\n{d.log()[-3000:]}")

    def allocated_permissions(self, permissions: str, timeout: float = END_STATE_TIMEOUT) -> bool:
        """Until an Allocate through kubelet answers `permissions` (the reload reached the
        plugin kubelet allocates from); False after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                resp = self.k.allocate(RESOURCE, ["kvm-0"], timeout=5)
                if resp.container_responses[0].devices[0].permissions == permissions:
                    return True
            except (KubeletError, grpc.RpcError, IndexError):
                pass
            time.sleep(0.002)
        return False

    def upgrade_reload(self) -> None:
        """The package upgraded under the running daemon, then `systemctl reload`: it hands the
        resources over to a warm successor process (MAINPID=), which the round then finds
        registered; the old one exits."""
        d = self.rig.daemon
        build = os.path.join(self.rig.root, "site", "atedevd", "_build.py")
        with open(build) as f:
            text = f.read()
        with open(build + ".dpkg-new", "w") as f:
            f.write(text + "# upgraded\n")
        os.rename(build + ".dpkg-new", build)
        after = len(d.notify.messages)
        d.send(signal.SIGHUP)
        main = d.notify.wait_for("MAINPID", timeout=30, after=after)
        if main is None or d.wait(30) != 0:
            raise RuntimeError(f"no upgrade to a successor; log:\n{d.log()[-3000:]}")
        self.successor = int(main["fields"]["MAINPID"])

    def after_upgrade(self) -> None:
        """The successor is not a child of ours: stop it, and start a daemon for the next round."""
        os.kill(self.successor, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{self.successor}") and time.monotonic() < deadline:
            time.sleep(0.01)
        self.rig.daemon.close()
        mark = self.k.mark()
        self.start_daemon()
        self.k.assert_healthy(RESOURCE, self.count, since=mark, new_registrations=1, timeout=30)

    # --- one round -------------------------------------------------------------------------

    def round(self, event: str) -> dict:
        k = self.k
        if event in ("socket-deleted", "stream-ended"):
            self._stable()
        with k.cond:
            k.arrivals.clear()
            k.healthy_at.clear()
        if event == "reload-upgrade":  # the daemon's start noted its files (its deferred work): give it the time
            time.sleep(max(0.0, self.rig.daemon.started_at + 1.0 - time.monotonic()))
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
        elif event == "reload-upgrade":
            self.upgrade_reload()
        elif event.startswith("reload-"):
            # A reload that changes the count or the permissions needs no new Register (kubelet
            # takes a new device list on the stream; permissions reach it only through Allocate):
            # the end state asks for none, and a round is over once kubelet has the change.
            new = 0
            count, permissions = self.count, self.permissions
            if event == "reload-count":
                count = UNITS - 1 if self.count == UNITS else UNITS
            elif event == "reload-permissions":
                permissions = PERMISSIONS[1] if self.permissions == PERMISSIONS[0] else PERMISSIONS[0]
            elif event != "reload-unchanged":
                raise ValueError(f"unknown event {event!r}; known: {', '.join(EVENTS)}")
            self.reload(count, permissions)
            if event == "reload-permissions" and not self.allocated_permissions(permissions):
                raise RuntimeError(f"Allocate through kubelet never answered permissions {permissions!r}\n{k.dump(RESOURCE)}")
        elif event == "socket-deleted":
            os.unlink(current_socket(self.rig.plugin_dir, kubelet=k))
        elif event == "stream-ended":
            k.drop(RESOURCE)
        else:
            raise ValueError(f"unknown event {event!r}; known: {', '.join(EVENTS)}")
        failure = None
        try:
            if event.startswith("reload-") and event != "reload-upgrade":
                self._settled(mark)
            else:
                k.assert_healthy(RESOURCE, self.count, since=mark, new_registrations=new, timeout=END_STATE_TIMEOUT)
        except AssertionError as e:
            failure = str(e).splitlines()[0]
        admitted = k.wait(lambda: self.log.state == "admit", timeout=END_STATE_TIMEOUT)
        t1 = time.monotonic()
        rejected, spells, reasons = self.log.rejected(t0, t1)
        by_reason = self.log.rejected_by_reason(t0, t1)
        pods, put_in = self.log.pods_rejected(t0, t1)
        calls = k.pod_resources_calls(since=t0)
        ours = calls.get(OURS, {"answered": 0, "refused": 0})
        with k.cond:
            registers = sum(1 for r in k.register_calls[mark:] if r["resource"] == RESOURCE)
            our_times = [at for at, client, _m, _ok in k.pod_resources_log if client == OURS and t0 <= at <= t1]
            arrive = next((a - t0 for a in k.arrivals if a >= t0), None)
            healthy = next((h - t0 for h in k.healthy_at if h >= t0), None)
            listen = (k.listening_at - t0) if event.startswith("kubelet-") and k.listening_at else None
            ks = k.inc.listeners[-1] if event == "kubelet-listen-gap" and k.inc.listeners else None
            # after kubelet listens: our first connection (the daemon's connect probe), and the first
            # one that carried bytes (gRPC's, with the Register): the daemon's part of the wait
            accepted = ks.accepted[0] - k.listening_at if ks is not None and getattr(ks, "accepted", None) else None
            spoke = ks.first_bytes[0] - k.listening_at if ks is not None and getattr(ks, "first_bytes", None) else None
            launch = next((a - started for a in k.arrivals if started is not None and a >= started), None)
        steps = {}
        if event == "reload-upgrade":
            self.after_upgrade()
            # Where an upgrade's window goes: our streams' end -> the new one's Register (ours:
            # the let-go wait, GO, its Register), then the Register -> admitted (the stand-in's
            # dial-back and stream, which a Go kubelet does faster).
            marks = list(self.log.transitions)
            reject = next((at for at, state, _ in marks if at >= t0 and state != "admit"), None)
            arrival = next((a for a in k.arrivals if a >= t0), None)
            admit = next((at for at, state, _ in marks if arrival is not None and at >= arrival and state == "admit"), None)
            if reject is not None and arrival is not None and admit is not None and reject <= arrival:
                steps = {"reject_to_arrive": arrival - reject, "arrive_to_admit": admit - arrival}
        return {**steps, "rejected": rejected if admitted else None, "spells": spells, "reasons": reasons, "by_reason": by_reason,
                "failure": failure, "arrive": arrive, "healthy": healthy, "listen": listen, "launch": launch,
                "accepted": accepted, "spoke": spoke, "pods": pods, "put_in": put_in, "registers": registers,
                "pr_answered": ours["answered"], "pr_refused": ours["refused"], "pr_peak": peak_per_second(our_times),
                "agent_refused": calls.get(node_agent.USER_AGENT.split("/")[0], {}).get("refused", 0)}

    def _settled(self, mark: int) -> None:
        """A reload's end state (Kubelet.assert_healthy with no new registration asked for),
        held SETTLE_S with no Register call since. A reload needs no new registration, so the
        end state can be met before the daemon is done: one that takes the new device list or
        permissions on the old stream and then registers anew passes through it, and may leave
        it during assert_healthy's own Allocate. Such a passage is waited out (the window
        counts it); anything else still fails after END_STATE_TIMEOUT."""
        k = self.k
        deadline = time.monotonic() + END_STATE_TIMEOUT
        while True:
            calls = len(k.register_calls)
            try:
                k.assert_healthy(RESOURCE, self.count, since=mark, timeout=max(0.0, deadline - time.monotonic()))
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise
                continue
            time.sleep(SETTLE_S)
            with k.cond:
                if len(k.register_calls) == calls and all(r["done_at"] is not None for r in k.register_calls[mark:]):
                    return
            if time.monotonic() >= deadline:
                raise AssertionError(f"{RESOURCE}: Register calls went on after the reload's end state\n{k.dump(RESOURCE)}")

    def _stable(self) -> None:
        """Until the current registration is older than the daemon's STABLE_AFTER_S."""
        k = self.k
        with k.cond:
            accepted = [r for r in k.registrations if r["resource"] == RESOURCE]
            since = accepted[-1]["done_at"] if accepted else time.monotonic()
        left = since + STABLE_AFTER_S + 0.2 - time.monotonic()
        if left > 0:
            time.sleep(left)


def peak_per_second(times: List[float]) -> int:
    """The most calls in any one second (a sliding window over the call times)."""
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - 1.0:
            j += 1
        best = max(best, i - j + 1)
    return best


def run(events: List[str], rounds: int, modes=MODES, limit: bool = False) -> List[Row]:
    relay_rows, relay_adds = relay_cost(max(rounds, 200))
    rows: List[Row] = list(relay_rows) + standin_let_go(max(rounds, 50))
    for mode in modes:
        lc = Lifecycle(mode, seed=2026, limit=limit)
        try:
            by_event: Dict[str, List[dict]] = {}
            for event in events:
                try:
                    if event.startswith("kubelet-"):
                        with BusyCore():
                            results = [lc.round(event) for _ in range(rounds)]
                    else:
                        results = [lc.round(event) for _ in range(rounds)]
                except NotYet as e:
                    rows.append(("lifecycle", f"{event} (kubelet {mode}): not run", str(e), "", ""))
                    continue
                by_event[event] = results
                rows += event_rows(event, mode, results, rounds)
            rows += refusal_cost(mode, by_event, relay_adds)
            rows.append(("lifecycle", f"  admission log (kubelet {mode}): {lc.log.samples} samples, widest gap",
                         f"{ms(lc.log.max_gap)} ms", "", ""))
        finally:
            lc.close()
        if limit:
            rows += limit_rows(mode, lc, by_event)
    return rows


def limit_rows(mode: str, lc: Lifecycle, by_event: Dict[str, List[dict]]) -> List[Row]:
    """With kubelet's limit on: every call of atedevd's and of the node agent's, refused or not."""
    calls = lc.k.pod_resources_calls()
    ours = calls.get(OURS, {"answered": 0, "refused": 0})
    agent = lc.agent_counts or {}
    refused = ours["refused"]
    return [("lifecycle", f"pod-resources limited as kubelet does (kubelet {mode}): atedevd's calls answered / refused",
             f"{ours['answered']} / {refused}", "0 refused", verdict(refused == 0)),
            ("lifecycle", "  the node agent beside (80/s): answered / refused / failed (kubelet down)",
             f"{agent.get('answered', 0)} / {agent.get('refused', 0)} / {agent.get('failed', 0)}", "", "")]


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
    out.append(("lifecycle", "  rounds with a rejection / never admitted again / end state missed",
                f"{rejecting} / {lost} / {len(failed)} of {rounds}", "- / 0 / 0", verdict(not lost and not failed)))
    pods = [r["pods"] for r in results]
    out.append(("lifecycle", f"  pods rejected (one put in every {POD_PERIOD_S * 1000:.0f} ms), p50/p99/max per round, all",
                f"{percentile(pods, 50)}/{percentile(pods, 99)}/{max(pods)}, {sum(pods)} of {sum(r['put_in'] for r in results)}",
                "", ""))
    registers = sorted({r["registers"] for r in results})
    none = event.startswith("reload-") and event != "reload-upgrade"  # issue 21: a reload registers nothing anew
    out.append(("lifecycle", "  Register calls kubelet saw per round", "/".join(map(str, registers)),
                "0" if none else "", verdict(registers == [0]) if none else ""))
    answered = [r["pr_answered"] + r["pr_refused"] for r in results]
    refused = sum(r["pr_refused"] for r in results)
    out.append(("lifecycle", "  atedevd's pod-resources calls per round p50/max, most in one second; refused",
                f"{percentile(answered, 50)}/{max(answered)}, {max(r['pr_peak'] for r in results)}/s; {refused}", "", ""))
    launches = [r["launch"] for r in results if r["launch"] is not None]
    if launches:
        out.append(("lifecycle", "  new process start -> Register arrives", stats(launches), "p50 <= 80 ms",
                    verdict(percentile(launches, 50) <= 0.080)))
    for key, what in (("reject_to_arrive", "our streams end (kubelet rejects) -> the new one's Register arrives"),
                      ("arrive_to_admit", "the new one's Register arrives -> kubelet admits (the stand-in's part)")):
        got = [r[key] for r in results if r.get(key) is not None]
        if got:
            out.append(("lifecycle", f"  {what}", stats(got), "", ""))
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
        out.append(("lifecycle", "  kubelet.sock appears -> all units healthy", stats([r["healthy"] for r in results if r["healthy"] is not None]), "", ""))
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
    from rig.kubelet_standin import Kubelet

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


def standin_let_go(n: int) -> List[Row]:
    """The stand-in's own part of a let-go: a plugin in this process (rig/tiny_plugin.py)
    registers and ends its stream; from that end, when its server no longer holds kubelet's
    connection (atedevd.sockets.held_connections: what the daemon's let-go wait reads), and
    when the stand-in has marked the devices unhealthy (its teardown done). A real kubelet
    1.32 does both within 0.1-2.3 ms; a Python gRPC channel closed within 0.2 s of its dial
    used to stay connected up to 0.2 s longer (see rig/kubelet_standin.py's _dial)."""
    import shutil
    import tempfile

    from atedevd.kubelet.sockets import held_connections
    from rig.kubelet_standin import Kubelet
    from rig.tiny_plugin import Plugin, register

    root = tempfile.mkdtemp(prefix="atebench-", dir="/tmp")
    plugin_dir = os.path.join(root, "device-plugins")
    k = Kubelet(plugin_dir, pod_resources=False)
    k.start()
    gone, unhealthy = [], []
    try:
        for i in range(n):
            p = Plugin(plugin_dir, f"p{i}.sock")
            try:
                register(k.socket, p, "example.com/thing")
                if not k.wait_connected("example.com/thing", registrations=i + 1):
                    raise RuntimeError(f"the plugin did not connect\n{k.dump()}")
                client = k.clients["example.com/thing"]
                ended = time.monotonic()
                p.stopping.set()
                while held_connections([p.path]) and time.monotonic() - ended < 5:
                    time.sleep(0.0001)
                gone.append(time.monotonic() - ended)
                k.wait(lambda: client.torn_down_at is not None, 5)
                unhealthy.append((client.torn_down_at or float("inf")) - ended)
            finally:
                p.stop()
    finally:
        k.close()
        shutil.rmtree(root, ignore_errors=True)
    return [("lifecycle", f"stand-in: stream ended by the plugin -> kubelet's connection gone / devices unhealthy, of {n}",
             f"{stats(gone)} / {stats(unhealthy)}", "kubelet 1.32: 0.1-2.3 ms", "")]
