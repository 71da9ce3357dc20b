"""Faults: a kubelet that hangs, errs, hangs up, never watches or floods; a stale
kubelet.sock; the plugin directory deleted, moved, read-only or too deep; the
daemon stopped, killed mid-registration; kubelet crash-looping.

Every test asserts that the daemon keeps serving (alive, Allocate answers on
its socket) and recovers by itself: registered and connected with a real
kubelet stand-in afterwards. Waits have generous timeouts; nothing is timed.
"""

import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

import grpc
import pytest

from atedevd.api import DevicePluginStub, pb
from atedevd.kubelet.plugin import STREAMS_PER_RESOURCE
from rig.harness import OUR_SOCKETS, RESOURCE, current_socket, our_files, plugin_sockets, wait_until
from rig.kubelet_standin import Kubelet
from rig.metrics_scrape import parse
from tests.process.hostile_kubelet import HostileKubelet, RawKubelet

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make check`


def allocates(socket_path: str) -> bool:
    """The daemon's socket answers an Allocate with /dev/kvm."""
    channel = grpc.insecure_channel("unix:" + socket_path)
    try:
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["kvm-1"])])
        resp = DevicePluginStub(channel).Allocate(req, timeout=10)
        return [d.host_path for d in resp.container_responses[0].devices] == ["/dev/kvm"]
    finally:
        channel.close()


def assert_serving(d, plugin_dir: str) -> None:
    """Alive and answering: on the socket in place, or, before any kubelet took one, on the
    socket that waits in the standby directory."""
    assert d.proc.poll() is None, d.log()
    path = current_socket(plugin_dir) or current_socket(os.path.join(plugin_dir, ".atedevd"))
    assert path and allocates(path), f"{path}\n{d.log()}"


def metric_samples(metrics_dir) -> dict:
    """The samples of the daemon's atedevd.prom in `metrics_dir` (none before it is written)."""
    try:
        return parse((metrics_dir / "atedevd.prom").read_text())[0]
    except FileNotFoundError:
        return {}


def assert_recovered(k: Kubelet, d, plugin_dir: str, registrations: int = 1) -> None:
    assert k.wait_connected(RESOURCE, registrations=registrations, timeout=15), d.log()
    assert k.wait(lambda: k.capacity(RESOURCE) == 1024, timeout=10), d.log()
    assert_serving(d, plugin_dir)
    assert "Traceback" not in d.log()


@pytest.fixture
def hostile(plugin_dir):
    made = []

    def make(behaviour, **kwargs):
        k = HostileKubelet(plugin_dir, behaviour, **kwargs)
        k.start()
        made.append(k)
        return k

    yield make
    for k in made:
        k.close()


# --- kubelet misbehaves on the Registration call -----------------------------------------


def test_register_never_answered_kubelet_back_cancels_the_hung_call(hostile, start_daemon, plugin_dir):
    """Register's own deadline is 20 s; a kubelet coming back must not wait for it. That nothing
    else gives up on the call before its deadline is the machine's, in simulated time
    (tests/unit/registration/test_machine.py); here, the deadline kubelet gets, and what ends the call."""
    hung = hostile("hang")
    d = start_daemon()
    d.wait_ready()
    assert hung.wait(lambda: hung.calls.get("hang", 0) == 1), d.log()
    # the call's own deadline (20 s) as it arrived: its grpc-timeout header is rounded up, by 0.1 s seen
    assert 15.0 < hung.deadlines[0] <= 21.0, hung.deadlines
    assert_serving(d, plugin_dir)  # serving while its Register hangs
    assert hung.cancelled == 0  # still hung: nothing has given up on it
    # A new kubelet takes over the directory: wipes it, serves a new kubelet.sock.
    # The old, hung one keeps its connection open and never answers.
    back_at = time.monotonic()
    os.unlink(hung.socket)
    k = Kubelet(plugin_dir)
    k.start()
    try:
        assert k.wait_connected(RESOURCE, timeout=15), d.log()
        # the daemon itself abandoned the hung call (well before its 20 s deadline), once kubelet came back
        assert hung.wait(lambda: hung.cancelled == 1, timeout=10)
        assert back_at < hung.cancelled_at[0] < back_at + 15.0, (back_at, hung.cancelled_at)
        assert hung.calls == {"hang": 1}
        assert_recovered(k, d, plugin_dir)
    finally:
        k.close()


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT])
def test_register_answered_with_errors_retried_until_accepted(hostile, start_daemon, plugin_dir, code):
    """No event comes to help: the backoff timer alone retries, and the log stays short."""
    k = hostile("error", error=code)
    d = start_daemon()
    d.wait_ready()
    assert k.wait(lambda: k.calls.get("error", 0) >= 6, timeout=15), d.log()  # 10 ms, 20, 40, ... capped
    assert_serving(d, plugin_dir)
    k.behaviour = "normal"  # kubelet starts accepting, on the same socket
    assert_recovered(k, d, plugin_dir)
    assert k.registration_count(RESOURCE) == 1
    log = d.log()
    assert log.count("waiting for kubelet") == 1, log  # said once, not once per retry


def test_register_connection_closed_mid_call(start_daemon, plugin_dir):
    os.makedirs(plugin_dir)
    raw = RawKubelet(os.path.join(plugin_dir, "kubelet.sock"))
    try:
        d = start_daemon()
        d.wait_ready()
        assert wait_until(lambda: raw.closed_mid_call >= 3, timeout=15), d.log()  # retried each time
        assert_serving(d, plugin_dir)
    finally:
        raw.close()
    k = Kubelet(plugin_dir)
    k.start()
    try:
        assert_recovered(k, d, plugin_dir)
    finally:
        k.close()


def test_dials_back_and_never_opens_listandwatch(hostile, start_daemon, plugin_dir, tmp_path):
    """Serving and alive once it has taken in Register's OK and waits for the stream that does
    not come (when it gives up on it, VERIFY_S later, is the machine's: test_machine.py)."""
    k = hostile("no-watch")
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    d = start_daemon(metrics_dir=str(metrics))
    d.wait_ready()
    assert k.wait(lambda: k.calls.get("no-watch", 0) == 1), d.log()
    state = ("atedevd_resource_state", (("resource", RESOURCE), ("state", "verifying")))
    assert wait_until(lambda: metric_samples(metrics).get(state) == 1, 10), d.log()  # (the file: once a second at most)
    assert_serving(d, plugin_dir)
    assert d.proc.poll() is None
    # the same kubelet, restarted and behaving: registered and streaming
    k.behaviour = "normal"
    k.restart(0.05)
    assert_recovered(k, d, plugin_dir)


def test_ten_listandwatch_streams_opened_at_once_and_dropped(hostile, start_daemon, plugin_dir):
    """Each round kubelet opens ten streams at once on the new socket and drops them: the budget's
    worth are served the full device list, the rest refused; the Register fails, the daemon registers
    again (backing off), and holds nothing of the round after (a stream kept per round would use up
    the budget within it: more rounds than that are waited for)."""
    k = hostile("ten-streams")
    d = start_daemon()
    d.wait_ready()
    rounds = STREAMS_PER_RESOURCE + 2
    for i in range(1, rounds + 1):  # each round, waited for as it comes: 0.4 s at most here, idle or loaded
        assert k.wait(lambda: len(k.rounds) >= i, timeout=10), (k.rounds, d.log())
    served = 0
    for seen in k.rounds[:rounds]:
        lists = [n for what, n in seen if what == "devices"]
        refused = [code for what, code in seen if what == "refused"]
        assert all(n == 1024 for n in lists) and len(lists) <= STREAMS_PER_RESOURCE, seen
        assert refused and set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, seen
        served += len(lists)
    assert served >= rounds, k.rounds  # (a round's streams race the last one's going: not every one gets three)
    assert_serving(d, plugin_dir)
    k.behaviour = "normal"
    assert_recovered(k, d, plugin_dir)
    # the daemon holds no leftover streams: the one kubelet's stream is all that is open
    k.assert_healthy(RESOURCE, 1024)


# --- kubelet.sock and the plugin directory -------------------------------------------------


def test_stale_kubelet_sock_at_start_then_a_real_kubelet_behind_it(start_daemon, plugin_dir):
    os.makedirs(plugin_dir)
    path = os.path.join(plugin_dir, "kubelet.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # bound, never listening: connections are refused
    s.close()
    d = start_daemon(log_level="debug")  # each refused try is a DEBUG line
    d.wait_ready()
    # The backoff reaches its cap (2 s) against the stale socket: 10 ms, 20, ... 1.28 s, 8 tries.
    refused = "DEBUG ate.dev/kvm: waiting for kubelet: kubelet is not accepting connections"
    assert wait_until(lambda: d.log().count(refused) >= 8, 10), d.log()
    assert_serving(d, plugin_dir)
    log = d.log()
    assert log.count("INFO ate.dev/kvm: waiting for kubelet") == 1 and "Traceback" not in log, log
    k = Kubelet(plugin_dir)
    k.start()
    try:
        assert_recovered(k, d, plugin_dir)
    finally:
        k.close()


@pytest.mark.parametrize("how", ["rmtree", "rename", "rmtree-5-times"])
def test_plugin_dir_deleted_and_recreated(daemon, kubelet, plugin_dir, how):
    rounds = 5 if how == "rmtree-5-times" else 1
    for n in range(rounds):
        kubelet.kill()
        if how == "rename":
            os.rename(plugin_dir, plugin_dir + ".old")
        else:
            shutil.rmtree(plugin_dir)
        assert wait_until(lambda: f"waiting for {plugin_dir}" in (daemon.status() or ""), 10), daemon.status()
        assert daemon.proc.poll() is None
        kubelet.start()  # re-creates the directory, then serves
        assert_recovered(kubelet, daemon, plugin_dir, registrations=n + 2)
    assert our_files(plugin_dir) == [".atedevd", OUR_SOCKETS, "kubelet.sock", "kubelet_internal_checkpoint"]


def _mount(*args) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def test_plugin_dir_made_read_only(start_daemon, plugin_dir, tmp_path):
    """The daemon sees the directory through a read-only bind mount (as a unit with
    ProtectSystem=strict and no ReadWritePaths would); kubelet writes to it as usual.
    As root, chmod 0555 stops nothing; a read-only mount does (EROFS)."""
    view = str(tmp_path / "ro")
    os.makedirs(plugin_dir)
    os.makedirs(view)
    _mount("--bind", plugin_dir, view)
    try:
        k = Kubelet(plugin_dir)
        k.start()
        try:
            d = start_daemon(plugin_dir=view, env={"WATCHDOG_USEC": "200000"})  # (its pings show its loop's turns)
            d.wait_ready()
            assert k.wait_connected(RESOURCE), d.log()
            _mount("-o", "remount,bind,ro", view)
            with pytest.raises(OSError):
                open(os.path.join(view, "probe"), "w")
            assert_serving(d, view)  # an existing socket keeps working on a read-only mount
            # kubelet restarts: our socket is wiped; binding it again fails with EROFS
            k.restart(0.05)
            assert wait_until(lambda: "cannot serve" in d.log(), 10), d.log()
            # Every turn of the loop tries to serve again; four whole turns after the line was read,
            # a line said per try would be there.
            assert d.notify.wait_turns(4, since=time.monotonic()), d.log()
            assert d.proc.poll() is None
            log = d.log()
            assert log.count("cannot serve") == 1, log  # said once, not per retry
            messages = [line.split(" ", 1)[-1] for line in log.splitlines()]
            assert len(messages) == len(set(messages)), log  # and nothing else repeated either
            # writable again; no event in the directory tells the daemon so
            _mount("-o", "remount,bind,rw", view)
            assert_recovered(k, d, view, registrations=2)
            assert d.stop() == 0
        finally:
            k.close()
    finally:
        # lazily: a daemon left running by a failure holds its socket in the mount
        subprocess.run(["umount", "--lazy", view], check=True)


def test_socket_path_too_long(start_daemon, tmp_path):
    """Our socket path would be 108+ bytes (kubelet's own still fits): refused as a bad
    configuration, naming the resource and the length, before anything is served."""
    root = tempfile.mkdtemp(prefix="atelong", dir="/tmp")
    plugin_dir = os.path.join(root, "d" * (92 - len(root) - 1))
    assert len(plugin_dir) == 92  # kubelet.sock: 105 bytes; ate.dev_kvm.<run>-<n>.sock: 118 and more
    k = Kubelet(plugin_dir)
    k.start()
    try:
        d = start_daemon(plugin_dir=plugin_dir)
        assert d.wait(10) == 78  # EX_CONFIG: the unit does not restart on it
        log = d.log()
        assert re.search(r"resource 'ate.dev/kvm': its socket path '.*' is 12\d bytes, more than the 107 a unix "
                         r"socket allows; device_plugin_dir is too long", log), log
        assert "Traceback" not in log
        assert k.registration_count(RESOURCE) == 0
        assert plugin_sockets(plugin_dir) == []
    finally:
        k.close()
        shutil.rmtree(root)


# --- the daemon stopped and killed ---------------------------------------------------------


def process_state(pid: int) -> str:
    """The one-letter state of /proc/PID/stat: "T" once SIGSTOP has stopped it."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_sigstop_while_kubelet_restarts_then_sigcont(start_daemon, kubelet, plugin_dir):
    """kubelet restarts while the daemon is stopped: one registration for it after SIGCONT, by
    kubelet's count and the daemon's own STATUS= two loop turns on; and a stop with nothing
    happening re-registers nothing. (The watchdog's pings, stamped by the kernel, show the turns.)"""
    daemon = start_daemon(env={"WATCHDOG_USEC": "200000"})  # (its pings show its loop's turns)
    daemon.wait_ready()
    assert kubelet.wait_connected(RESOURCE), daemon.log()
    assert wait_until(lambda: ": registered, " in (daemon.status() or ""), 10), (daemon.status(), daemon.log())
    daemon.send(signal.SIGSTOP)
    try:
        assert wait_until(lambda: process_state(daemon.pid) == "T", 10)
        kubelet.restart(0.05)  # returns once the new kubelet listens: the whole restart while stopped
        assert process_state(daemon.pid) == "T"
        assert kubelet.registration_count(RESOURCE) == 1  # a stopped daemon cannot answer
        assert kubelet.capacity(RESOURCE) == 0
    finally:
        daemon.send(signal.SIGCONT)
    assert_recovered(kubelet, daemon, plugin_dir, registrations=2)
    # One restart, one registration: the daemon says it is registered again, and two whole turns
    # on still is (a second Register, for an event of the same restart taken in late, is decided
    # in the turn the first one ends, or from inputs read by then, and says "registering").
    assert wait_until(lambda: ", re-registered " in (daemon.status() or ""), 10), (daemon.status(), daemon.log())
    shown = next(m for m in daemon.notify.messages if ", re-registered " in m["fields"].get("STATUS", ""))
    assert daemon.notify.wait_turns(2, since=shown["at"]), daemon.log()
    assert_still_registered(daemon, shown)
    assert kubelet.registration_count(RESOURCE) == 2, daemon.log()
    # and stopped with nothing happening: still registered after, with no new registration
    shown = [m for m in daemon.notify.messages if "STATUS" in m["fields"]][-1]
    daemon.send(signal.SIGSTOP)
    assert wait_until(lambda: process_state(daemon.pid) == "T", 10)
    time.sleep(0.3)  # stopped this long (its pings and timers come due meanwhile): the test
    resumed = time.monotonic()
    daemon.send(signal.SIGCONT)
    assert_serving(daemon, plugin_dir)
    # What it makes of the stop it decides in its first turns after it: two whole turns on.
    assert daemon.notify.wait_turns(2, since=resumed), daemon.log()
    assert_still_registered(daemon, shown)
    assert kubelet.registration_count(RESOURCE) == 2 and kubelet.capacity(RESOURCE) == 1024, daemon.log()


def assert_still_registered(d, shown: dict) -> None:
    """Every STATUS= the daemon said after `shown` (a "registered" one) says registered, and by the
    same re-registration: a new one would have said "registering with kubelet" in the turn that
    decided it (STATUS= is said whenever it changes, before the next ping)."""
    since = shown["fields"]["STATUS"].partition(", re-registered ")[2]  # (the count it shows may be news)
    said = [m["fields"]["STATUS"] for m in d.notify.messages if m["at"] > shown["at"] and "STATUS" in m["fields"]]
    assert [t for t in said if not t.startswith(f"{RESOURCE}: registered, ") or t.partition(", re-registered ")[2] != since] \
        == [], (shown, said)


def test_kill_9_mid_registration_then_restart(hostile, start_daemon, plugin_dir):
    k = hostile("hang")
    d = start_daemon()
    d.wait_ready()
    assert k.wait(lambda: k.calls.get("hang", 0) == 1), d.log()  # inside Register
    path = current_socket(plugin_dir)
    before = os.lstat(path)
    d.send(signal.SIGKILL)
    assert d.wait(10) == -signal.SIGKILL
    assert stat.S_ISSOCK(os.lstat(path).st_mode)  # left behind, stale
    assert k.wait(lambda: k.cancelled == 1)  # the hung call's caller is gone
    k.behaviour = "normal"
    d2 = start_daemon()
    d2.wait_ready()
    assert d2.proc.poll() is None  # the lock died with the killed process
    assert_recovered(k, d2, plugin_dir)
    new = current_socket(plugin_dir, kubelet=k)
    after = os.lstat(new)  # a new socket (the inode number itself may be reused)
    assert (new, after.st_ino, after.st_ctime_ns) != (path, before.st_ino, before.st_ctime_ns)


# --- kubelet crash-looping ----------------------------------------------------------------------


def test_kubelet_132_wiping_files_restarts_with_zero_gap_bursts(start_daemon, plugin_dir):
    """Unlike the core storm: kubelet 1.32 (one client per resource), wiping every file
    but the checkpoint, gaps of exactly 0, under 5 ms, or up to 200 ms."""
    k = Kubelet(plugin_dir, kubelet="1.32", wipe="files")
    k.start()
    try:
        d = start_daemon()
        d.wait_ready()
        assert k.wait_connected(RESOURCE), d.log()
        rng = random.Random(132)
        restarts = 240
        for i in range(1, restarts + 1):
            gap = rng.choice([0.0, rng.uniform(0, 0.005), rng.uniform(0, 0.2)])
            k.restart(gap)
            assert k.wait_connected(RESOURCE, registrations=i + 1, timeout=15), f"restart {i}:\n{d.log()[-3000:]}"
        assert {r["restart"] for r in k.registrations} == set(range(restarts + 1))
        assert_recovered(k, d, plugin_dir, registrations=restarts + 1)
        # every old stream torn down, one live stream on the newest socket, nothing stopped
        k.assert_healthy(RESOURCE, 1024)
        assert our_files(plugin_dir) == [".atedevd", OUR_SOCKETS, "kubelet.sock", "kubelet_internal_checkpoint"]
    finally:
        k.close()


def test_kubelet_crash_loop_bursts_without_waiting(daemon, kubelet, plugin_dir):
    """kubelet restarts again before the daemon could register: every burst ends registered."""
    rng = random.Random(7)
    for burst in range(1, 16):
        for _ in range(10):
            kubelet.restart(rng.choice([0.0, 0.002]))
        assert kubelet.wait(lambda: any(r["restart"] == kubelet.restarts for r in kubelet.registrations), 15), daemon.log()[-3000:]
        assert_recovered(kubelet, daemon, plugin_dir)
    assert our_files(plugin_dir) == [".atedevd", OUR_SOCKETS, "kubelet.sock", "kubelet_internal_checkpoint"]
