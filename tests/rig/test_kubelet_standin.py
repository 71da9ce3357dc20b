"""The kubelet stand-in itself: kubelet.sock bound before kubelet listens on it (as Go's
net.Listen does), one creation event of kubelet.sock per kubelet start, the admission
check (would kubelet admit a pod requesting the resource right now?), the teardown after a
stream ends (the connection let go of at once), and pod-resources' rate limit.

A tiny device plugin in this process (rig/tiny_plugin.py) stands in for the daemon, so
each step is driven and waited for here, not timed.
"""

import json
import os
import socket
import stat
import threading
import time
import types

import grpc
import inotify.adapters
import inotify.constants as c
import pytest

from atedevd.api import PodResourcesStub, prpb
from atedevd.kubelet.sockets import held_connections
from rig.kubelet_standin import DOWN, KUBELET_RATE_LIMIT, KUBELET_SOCKET, MODES, RATE_LIMITED, AdmissionLog, Kubelet
from rig.node_agent import NodeAgent
from rig.tiny_plugin import Plugin
from rig.tiny_plugin import register as _register

RESOURCE = "example.com/thing"


def register(kubelet: Kubelet, plugin: Plugin) -> None:
    _register(kubelet.socket, plugin, RESOURCE)


@pytest.fixture
def plugin(plugin_dir):
    """Serve a new plugin socket (kubelet's start wipes the directory's sockets, as the
    daemon's are): plugin() after each kubelet start."""
    served = []

    def serve() -> Plugin:
        served.append(Plugin(plugin_dir, f"thing-{len(served)}.sock"))
        return served[-1]

    yield serve
    for p in served:
        p.stop()


def start_in_background(kubelet: Kubelet, **kwargs) -> threading.Thread:
    before = kubelet.serving_at
    t = threading.Thread(target=kubelet.start, kwargs=kwargs, daemon=True)
    t.start()
    assert kubelet.wait(lambda: kubelet.serving_at != before, timeout=10), "kubelet.sock never appeared"
    return t


def test_register_in_the_listen_gap_is_refused_and_after_it_is_accepted(plugin_dir, plugin):
    gate = threading.Event()  # kubelet listens once it is set
    k = Kubelet(plugin_dir, listen_gap=gate)
    try:
        t = start_in_background(k)
        p = plugin()
        assert stat.S_ISSOCK(os.lstat(k.socket).st_mode)  # the file is there ...
        assert k.listening_at is None
        with pytest.raises(grpc.RpcError) as refused:  # ... and nothing listens on it yet
            register(k, p)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Connection refused" in refused.value.details()
        assert k.register_calls == []
        gate.set()
        t.join(10)
        assert k.listening_at is not None and k.listening_at >= k.serving_at
        register(k, p)
        assert k.wait_connected(RESOURCE, timeout=10)
        assert len(k.registrations) == 1
    finally:
        gate.set()
        k.close()


def test_the_gap_applies_to_each_restart(plugin_dir, plugin):
    """restart(listen_gap=...) overrides the constructor's gap for that start only."""
    k = Kubelet(plugin_dir)
    k.start()
    try:
        register(k, plugin())
        assert k.wait_connected(RESOURCE)
        gate = threading.Event()
        k.kill()
        t = start_in_background(k, listen_gap=gate)
        p = plugin()
        with pytest.raises(grpc.RpcError) as refused:
            register(k, p)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        t.join(10)
        register(k, p)
        assert k.wait_connected(RESOURCE, registrations=2)
        k.restart()  # the constructor's gap (0) again
        register(k, plugin())
        assert k.wait_connected(RESOURCE, registrations=3)
    finally:
        k.close()


def test_one_creation_event_of_kubelet_sock_per_start(plugin_dir):
    """The daemon takes every creation of kubelet.sock for a new kubelet: a start, a restart
    (with or without a listen gap) and a re-created socket each make exactly one."""
    os.makedirs(plugin_dir)
    watch = inotify.adapters.Inotify()
    watch.add_watch(plugin_dir, c.IN_CREATE | c.IN_MOVED_TO | c.IN_DELETE)
    k = Kubelet(plugin_dir)
    try:
        k.start()
        k.restart()
        k.restart(listen_gap=0.01)
        k.restart(gap=0.01, listen_gap=lambda: 0.005)
        k.recreate_socket(listen_gap=0.002)
        k.kill()  # leaves kubelet.sock, stale
        created = []
        # every event was queued by the system calls above: read until the queue is empty
        for event in watch.event_gen(yield_nones=True, timeout_s=0):
            if event is None:
                break
            header, types, _path, name = event
            if name == KUBELET_SOCKET:
                created.append(("IN_CREATE" in types or "IN_MOVED_TO" in types, types))
        assert sum(1 for new, _ in created if new) == 5, created
        assert stat.S_ISSOCK(os.lstat(k.socket).st_mode), "a killed kubelet leaves kubelet.sock behind"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with pytest.raises(ConnectionRefusedError):
            s.connect(k.socket)
        s.close()
    finally:
        k.close()


@pytest.mark.parametrize("listen_gap", [0.0, 1e-6], ids=["renamed-in-listening", "relayed"])
def test_a_kill_drops_connections_through_kubelet_sock(plugin_dir, listen_gap):
    """kubelet.sock reaches the Registration server (through the relay when there is a
    gap); a killed kubelet's connections drop, as the process's would."""
    k = Kubelet(plugin_dir, listen_gap=listen_gap)
    k.start()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(k.socket)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        assert s.recv(9)[3] == 0x4  # the gRPC server's SETTINGS frame, through the relay
        k.kill()
        try:
            while s.recv(65536):  # whatever was in flight, then the end of the connection
                pass
        except ConnectionResetError:  # the server closed with our bytes unread: an end too
            pass
        s.close()
    finally:
        k.close()


def test_listen_gap_must_be_seconds(plugin_dir):
    with pytest.raises(ValueError, match="listen_gap"):
        Kubelet(plugin_dir, listen_gap=-1)
    with pytest.raises(ValueError, match="listen_gap"):
        Kubelet(plugin_dir, listen_gap="1ms")
    k = Kubelet(plugin_dir)
    with pytest.raises(ValueError, match="listen_gap"):
        k.start(listen_gap=-0.5)


@pytest.mark.parametrize("mode", ["1.32", "current"])
def test_admission_follows_the_device_manager(plugin_dir, plugin, mode):
    """Rejected while the resource is unregistered or has no healthy device (after a restart,
    from the checkpoint), admitted once the plugin's device list is in; rejected again when the
    plugin goes away; DOWN (not rejected) while no kubelet runs; and the log saw each state."""
    k = Kubelet(plugin_dir, kubelet=mode)
    k.start()
    log = k.record_admission(RESOURCE)
    try:
        assert k.rejection(RESOURCE).startswith(f"{RESOURCE} is not registered")
        register(k, plugin())
        assert k.wait(lambda: log.state == "admit"), k.dump()
        admitted = log.transitions[-1][0]
        k.kill()
        assert k.rejection(RESOURCE) == DOWN
        assert k.wait(lambda: log.state == "down")
        k.start()  # the checkpoint brings the resource back with no healthy device
        assert k.rejection(RESOURCE).startswith("no healthy devices present")
        restarted = k.serving_at
        p = plugin()
        register(k, p)
        assert k.wait(lambda: log.state == "admit"), k.dump()
        p.stop()  # the plugin goes away: its stream ends, then kubelet tears it down
        assert k.wait(lambda: not k.admits(RESOURCE)), k.dump()
        assert k.wait(lambda: k.rejection(RESOURCE).startswith("no healthy devices present"))  # the teardown's mark
        assert k.wait(lambda: log.state == "reject")
    finally:
        log.stop()
        k.close()
    states = [s for i, (_, s, _) in enumerate(log.transitions) if i == 0 or log.transitions[i - 1][1] != s]
    assert states == ["reject", "admit", "down", "reject", "admit", "reject"], log.transitions
    gone = next(at for at, _, why in reversed(log.transitions) if why.endswith("(Allocate would fail)"))
    total, spells, reasons = log.rejected(restarted, gone)
    assert total > 0 and spells == 1 and reasons == [f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"], log.transitions
    down = next(at for at, s, _ in log.transitions if s == "down")
    assert log.rejected(admitted, down) == (0.0, 0, []) and log.samples > 0


LET_GO_BOUND_S = 0.1  # behavioural, generous: about 1 ms here, up to 0.2 s before (see the test)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ended_by", ["plugin", "kubelet"])
def test_a_stream_end_lets_go_of_the_connection_at_once(plugin_dir, plugin, mode, ended_by):
    """kubelet's teardown after a stream ends, in Go's order: deregister, close the connection
    (Close() returns once it is closed), then mark the devices unhealthy; a Go kubelet does it
    all within 0.1-2.3 ms. Whoever ended the stream, at the moment the devices go unhealthy
    (looked at under the stand-in's lock, as the change is made) the client's close has
    returned, and the plugin's server sees no connection from kubelet well within
    LET_GO_BOUND_S of the stream's end. The stream ends right after the dial, where a
    Python gRPC channel used to stay connected up to 0.2 s longer (the connectivity poller
    of grpc.channel_ready_future, whose last watch a close waits for)."""
    k = Kubelet(plugin_dir, kubelet=mode)
    k.start()
    at_unhealthy = []

    def look():  # with the lock held, at every change
        if client is not None and not at_unhealthy and not k.manager.healthy.get(RESOURCE, True):
            at_unhealthy.append((time.monotonic(), client.closed_at))

    client = None
    k.cond.on_change.append(look)
    try:
        for n in (1, 2):  # the second time on a kubelet that already tore one client down
            at_unhealthy.clear()
            p = plugin()
            register(k, p)
            assert k.wait_connected(RESOURCE, registrations=n), k.dump()
            client = k.clients[RESOURCE]
            assert held_connections([p.path]) == 1
            ended = time.monotonic()
            if ended_by == "plugin":
                p.stopping.set()
            else:
                k.drop(RESOURCE)
            while held_connections([p.path]) and time.monotonic() - ended < 5:
                time.sleep(0.0002)
            gone = time.monotonic() - ended
            assert k.wait(lambda: client.torn_down_at is not None), k.dump()
            assert len(at_unhealthy) == 1, k.dump()
            unhealthy, closed = at_unhealthy[0]
            assert closed is not None and closed <= unhealthy, (closed, unhealthy)
            assert gone < LET_GO_BOUND_S and unhealthy - ended < LET_GO_BOUND_S, \
                f"the plugin saw kubelet's connection gone {gone * 1000:.1f} ms after the stream ended, " \
                f"the devices unhealthy after {(unhealthy - ended) * 1000:.1f} ms"
            client = None
    finally:
        k.cond.on_change.remove(look)
        k.close()


def test_kubelet_sock_beyond_sun_path(tmp_path):
    """A plugin directory too long for a unix socket path (107 bytes) still gets its
    kubelet.sock, bound through /proc/self/fd."""
    plugin_dir = str(tmp_path / ("d" * 100) / "device-plugins")
    k = Kubelet(plugin_dir, pod_resources=False)
    try:
        k.start()
        assert len(os.fsencode(k.socket)) > 107
        assert stat.S_ISSOCK(os.lstat(k.socket).st_mode)
        k.restart()
        assert stat.S_ISSOCK(os.lstat(k.socket).st_mode)
    finally:
        k.close()


# --- pod-resources and kubelet's rate limit -------------------------------------------------


def ask(socket_path: str, user_agent: str = "") -> grpc.StatusCode:
    """One GetAllocatableResources on a fresh connection, as atedevd asks; its status code."""
    options = [("grpc.primary_user_agent", user_agent)] if user_agent else []
    channel = grpc.insecure_channel("unix:" + socket_path, options=options)
    try:
        PodResourcesStub(channel).GetAllocatableResources(prpb.AllocatableResourcesRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert e.details() == RATE_LIMITED
        return e.code()
    finally:
        channel.close()


def test_pod_resources_limit_is_shared_counted_per_client_and_on_by_default(plugin_dir):
    """One bucket for every client of the socket (an agent's calls leave fewer for us),
    refusals ResourceExhausted "rejected by rate limit", each call counted under its client;
    a restarted kubelet starts with a full bucket; kubelet's own limit by default, and with
    rate_limit=None nothing is refused."""
    k = Kubelet(plugin_dir, rate_limit=(0.001, 3))  # 3, then nothing for the test's duration
    try:
        k.start()
        codes = [ask(k.pod_resources_socket, "node-agent/1") for _ in range(2)]
        codes += [ask(k.pod_resources_socket) for _ in range(2)]
        assert codes == [grpc.StatusCode.OK] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED], codes
        assert k.pod_resources_calls() == {"node-agent": {"answered": 2, "refused": 0},
                                           "grpc-python": {"answered": 1, "refused": 1}}
        k.restart()
        assert ask(k.pod_resources_socket) == grpc.StatusCode.OK
        assert k.pod_resources_calls(since=k.serving_at) == {"grpc-python": {"answered": 1, "refused": 0}}
        assert k.state()["pod_resources_calls"]["grpc-python"] == {"answered": 2, "refused": 1}
    finally:
        k.close()
    assert Kubelet(plugin_dir).rate_limit == KUBELET_RATE_LIMIT
    unlimited = Kubelet(plugin_dir, rate_limit=None)
    try:
        unlimited.start()
        assert all(ask(unlimited.pod_resources_socket) == grpc.StatusCode.OK for _ in range(30))
    finally:
        unlimited.close()


def test_a_node_agent_at_80_a_second_stays_inside_the_limit_alone(plugin_dir):
    """The agent never asks faster than its rate, so kubelet's limit alone never refuses it
    (30 calls: more than the burst); a client that then asks 20 times in a row finds the
    bucket shared and is refused."""
    k = Kubelet(plugin_dir, rate_limit=KUBELET_RATE_LIMIT)
    try:
        k.start()
        agent = NodeAgent(k.pod_resources_socket, rate=80).start()
        try:
            assert k.wait(lambda: k.pod_resources_calls().get("node-agent", {}).get("answered", 0) >= 30, timeout=10)
            alone = k.pod_resources_calls()
            ours = [ask(k.pod_resources_socket) for _ in range(20)]
        finally:
            counts = agent.stop()
        assert list(alone) == ["node-agent"] and alone["node-agent"]["refused"] == 0, alone
        assert counts["failed"] == 0 and counts["answered"] >= 30, counts
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in ours, ours
        seen = k.pod_resources_calls()
        assert seen["grpc-python"]["refused"] == ours.count(grpc.StatusCode.RESOURCE_EXHAUSTED), seen
        assert seen["node-agent"] == {"answered": counts["answered"], "refused": counts["refused"]}, seen
    finally:
        k.close()


# --- the pods bound to the node, admitted again after a reboot -------------------------------


def test_pods_bound_to_the_node_are_admitted_again_in_one_batch_at_each_start(plugin_dir, plugin):
    """The first admission after a start (a reboot: no container runs) checks what kubelet's
    devicesToAllocate checks before anything else: the resource registered (the checkpoint
    counts: then 0 healthy), a healthy device, and the devices the pod had still healthy."""
    pods = [{"name": "vm-0", "resource": RESOURCE, "devices": ["d0"]},
            {"name": "vm-1", "resource": RESOURCE, "devices": ["d1", "d7"]},  # d7: the plugin no longer has it
            {"name": "new", "resource": RESOURCE},
            {"name": "other", "resource": "example.com/other", "devices": ["x"]}]
    gate = threading.Event()  # the batch waits for it (the delay is computed when it is due)
    k = Kubelet(plugin_dir, pods=pods, first_admission=lambda: gate.wait(10) and 0.0)
    os.makedirs(plugin_dir)
    with open(os.path.join(plugin_dir, "kubelet_internal_checkpoint"), "w") as f:
        json.dump({"RegisteredDevices": {RESOURCE: ["d0", "d1"]}}, f)  # the boot before
    try:
        k.start()
        gate.set()
        assert k.wait(lambda: len(k.first_admissions) == 1), k.dump()
        batch = k.first_admissions[0]
        assert batch["incarnation"] == 1 and batch["at"] >= batch["serving_at"] == k.serving_at
        none = f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"
        assert {p["name"]: p["reason"] for p in batch["pods"]} == {
            "vm-0": none, "vm-1": none, "new": none,
            "other": "cannot allocate unregistered device example.com/other"}, batch
        gate.clear()
        k.restart()
        register(k, plugin())
        assert k.wait_connected(RESOURCE, registrations=1), k.dump()
        gate.set()
        assert k.wait(lambda: len(k.first_admissions) == 2), k.dump()
        assert {p["name"]: p["reason"] for p in k.first_admissions[1]["pods"]} == {
            "vm-0": None, "new": None,
            "vm-1": f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {RESOURCE}",
            "other": "cannot allocate unregistered device example.com/other"}, k.first_admissions
        assert k.state()["first_admissions"][1]["incarnation"] == 2
    finally:
        gate.set()
        k.close()
    with pytest.raises(ValueError, match="go together"):
        Kubelet(plugin_dir, pods=pods)


def test_pods_rejected_counts_a_pod_every_period_in_the_rejecting_spells():
    """An admission loop's view, read from the transitions: one pod every 10 ms, none while
    kubelet is down (it admits nothing then: the pod waits)."""
    log = AdmissionLog(types.SimpleNamespace(cond=threading.Condition()), RESOURCE)
    log.transitions = [(0.0, "admit", None), (1.005, "reject", "x"), (1.052, "admit", None), (2.0, "down", DOWN),
                       (3.0, "reject", "y")]
    assert log.pods_rejected(0.5, 3.1, period=0.01) == (5 + 10, 150 + 10)
    assert log.pods_rejected(1.0, 1.03, period=0.01) == (2, 3)
    assert log.pods_rejected(2.0, 2.9) == (0, 0)
