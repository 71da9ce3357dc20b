"""kubelet's device-manager model (rig/kubelet_model.py) on its own, driven step by step here
as the stand-in and the simulation drive it: the 1.32 teardown by name, the current kubelet's
store per socket path, the checkpoint across a restart, the grace period, pod-resources' limit,
and the end-state checks both drivers assert."""

import itertools
from typing import Dict, List

import pytest

from rig.kubelet_model import DOWN, GRACE_PERIOD_S, HEALTHY, Client, Device, DeviceManager, TokenBucket

RESOURCE = "example.com/thing"
TWO: Dict[str, Device] = {"a": (HEALTHY, None), "b": (HEALTHY, [0])}


def manager(mode: str, n: int = 1, now: float = 0.0, restored=(), written: List[dict] = None, **kwargs) -> DeviceManager:
    def checkpoint(registered) -> None:
        if written is not None:
            written.append({name: set(ids) for name, ids in registered.items()})
    return DeviceManager(mode, n, now, itertools.count(1), restored, checkpoint=checkpoint, **kwargs)


def connect(m: DeviceManager, endpoint: str, now: float, devices=TWO) -> Client:
    """One Register all the way: registered, dialed, endpoint set, returned, streaming, listed."""
    c = m.register(RESOURCE, endpoint, "/plugins/" + endpoint, now)
    c.conn = object()  # the driver's connection
    assert m.set_endpoint(c, "options") is None
    assert m.returned(c) is True
    assert m.may_stream(c) is True
    m.stream_opened(c, now)
    assert m.listed(c, devices) is True
    return c


def torn_down(m: DeviceManager, c: Client, now: float) -> Client:
    """The stream of `c` ends and kubelet's teardown runs to its end; the client it let go of."""
    assert m.stream_ended(c, now) is True
    found = m.lookup(c, now)
    assert found is not None
    m.let_go(c, found)
    found.conn = None  # the driver closes it
    m.disconnected(c, found, now)
    return found


def test_kubelet_1_32_tears_down_by_name_and_knocks_out_the_newer_client():
    m = manager("1.32")
    old = connect(m, "thing-1.sock", 1.0)
    new = connect(m, "thing-2.sock", 2.0)  # stored by name before its dial: the old stream goes on
    assert m.server_clients == {RESOURCE: new} and old.streaming is True
    assert torn_down(m, old, 3.0) is new  # the old stream's late teardown finds the new client
    assert new.closed is True and new.knocked_out_by == "/plugins/thing-1.sock" and old.torn_down_at == 3.0
    e = m.endpoints[RESOURCE]
    assert e.client is new and e.stopped_at == 3.0 and e.stopped_by == "/plugins/thing-2.sock"
    assert m.capacity(3.0) == {RESOURCE: (2, 0)} and m.allocatable(3.0) == {RESOURCE: set()}
    assert m.rejection(RESOURCE) == f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"
    assert m.problems(RESOURCE, 2, 3.0) != []
    assert m.caused_by(new, {"/plugins/thing-1.sock"}) is True and m.caused_by(old, {"/plugins/thing-9.sock"}) is False


def test_the_current_kubelet_refuses_a_second_connection_on_a_path():
    m = manager("current")
    connect(m, "thing-1.sock", 1.0)
    again = m.register(RESOURCE, "thing-1.sock", "/plugins/thing-1.sock", 2.0)
    assert m.set_endpoint(again, "options") == "device plugin already connected: /plugins/thing-1.sock"
    m.failed(again)
    assert m.in_flight == 0 and len(m.server_clients[RESOURCE]) == 1 and again not in m.server_clients[RESOURCE]


def test_the_current_kubelet_lets_another_live_endpoint_take_over():
    m = manager("current")
    first = connect(m, "thing-1.sock", 1.0)
    second = connect(m, "thing-2.sock", 2.0)
    assert m.endpoints[RESOURCE].client is second
    assert torn_down(m, second, 3.0) is second  # by name and path: only its own client
    assert first.closed is False and m.endpoints[RESOURCE].client is first and m.endpoints[RESOURCE].stopped_at is None
    assert m.capacity(3.0) == {RESOURCE: (2, 2)} and m.rejection(RESOURCE) is None
    assert m.problems(RESOURCE, 2, 3.0) != []  # the newest registration is gone ...
    assert m.problems(RESOURCE, 2, 3.0, takeover=True) == []  # ... which the simulation's upgrades allow
    torn_down(m, first, 4.0)
    assert m.capacity(4.0) == {RESOURCE: (2, 0)}  # the last endpoint of the resource: unhealthy


def test_kubelet_1_32_marks_the_devices_unhealthy_when_any_client_goes():
    """The same steps as the take-over above, on kubelet 1.32: no take-over."""
    m = manager("1.32")
    connect(m, "thing-1.sock", 1.0)
    second = connect(m, "thing-2.sock", 2.0)
    torn_down(m, second, 3.0)
    assert m.capacity(3.0) == {RESOURCE: (2, 0)} and m.endpoints[RESOURCE].stopped_at == 3.0


def test_a_restart_restores_the_checkpoint_at_capacity_0_until_the_plugin_registers_again():
    written: List[dict] = []
    before = manager("current", written=written)
    connect(before, "thing-1.sock", 1.0)
    assert written == [{RESOURCE: {"a", "b"}}]  # after the message
    before.killed()
    after = manager("current", n=2, now=5.0, restored=list(written[-1]), written=written)
    assert after.capacity(5.0) == {RESOURCE: (0, 0)} and after.endpoints[RESOURCE].stopped_at == 5.0
    assert after.readmission(RESOURCE, ["a"]) == f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"
    assert after.allocate_refusal(RESOURCE) == f"endpoint &{{{RESOURCE} None}} has been stopped"
    connect(after, "thing-2.sock", 6.0)
    assert after.capacity(6.0) == {RESOURCE: (2, 2)} and after.readmission(RESOURCE, ["a"]) is None


def test_a_stopped_endpoints_resource_is_dropped_after_the_grace_period_and_the_checkpoint_follows():
    written: List[dict] = []
    m = manager("current", restored=[RESOURCE], written=written)
    assert m.capacity(GRACE_PERIOD_S) == {RESOURCE: (0, 0)} and written == []
    assert m.capacity(GRACE_PERIOD_S + 0.1) == {} and written == [{}]
    assert RESOURCE not in m.endpoints and m.rejection(RESOURCE).startswith(f"{RESOURCE} is not registered")


def test_a_message_is_taken_only_from_a_streaming_client_of_the_living_process():
    m = manager("current")
    c = m.register(RESOURCE, "thing-1.sock", "/plugins/thing-1.sock", 1.0)
    assert m.listed(c, TWO) is False  # no stream yet
    m.stream_opened(c, 1.0)
    other = manager("current", n=2)
    assert other.listed(c, TWO) is False and RESOURCE not in other.healthy  # not its own
    m.killed()
    assert m.listed(c, TWO) is False and m.stream_ended(c, 2.0) is False  # dead: no teardown follows


def test_a_closed_client_does_not_stream_and_is_torn_down_all_the_same():
    m = manager("1.32")
    old = connect(m, "thing-1.sock", 1.0)
    new = m.register(RESOURCE, "thing-2.sock", "/plugins/thing-2.sock", 2.0)  # not dialed yet
    m.stream_ended(old, 2.5)
    assert m.lookup(old, 2.5) is new
    m.let_go(old, new)
    m.disconnected(old, new, 2.5)
    new.conn = object()  # its dial returns after the teardown's Disconnect found nothing to close
    assert m.may_stream(new) is False
    assert m.stream_ended(new, 3.0) is True and m.lookup(new, 3.0) is None and new.torn_down_at == 3.0


def test_duplicates_are_registrations_accepted_before_the_one_before_was_torn_down():
    m = manager("1.32")
    first = connect(m, "thing-1.sock", 1.0)
    second = connect(m, "thing-2.sock", 2.0)
    assert [(a.client, b.client) for a, b in m.duplicates(RESOURCE)] == [(first, second)]
    assert m.duplicates(RESOURCE, among={second}) == []
    first.torn_down_at = 1.5
    assert m.duplicates(RESOURCE) == []


def test_the_healthy_end_state_and_what_spoils_it():
    m = manager("current")
    c = connect(m, "thing-1.sock", 1.0)
    assert m.problems(RESOURCE, 2, 1.0) == [] and m.unsettled() == []
    assert m.problems(RESOURCE, 3, 1.0) == ["node allocatable 2 != 3", "pod-resources allocatable 2 != 3"]
    m.register(RESOURCE, "thing-2.sock", "/plugins/thing-2.sock", 2.0)
    assert m.unsettled() == ["1 Register call(s) in flight"]
    m.stream_ended(c, 3.0)
    assert m.unsettled()[1] == f"teardowns pending: [{c!r}]"
    m.killed()
    assert m.problems(RESOURCE, 2, 3.0) == [DOWN] and m.rejection(RESOURCE) == DOWN


def test_options_failing_closes_the_connection_only_in_the_current_kubelet():
    """kubernetes#124716: kubelet 1.32 left the connection open."""
    assert manager("1.32").options_failed(None) is False and manager("current").options_failed(None) is True


def test_a_mode_that_is_not_modelled_is_refused():
    with pytest.raises(ValueError):
        manager("1.31")


def test_token_bucket_is_kubelets_limiter():
    """x/time/rate's Allow with kubelet's 100/s, burst 10: ten at once, then one per 10 ms;
    an idle spell refills up to the burst, never beyond."""
    bucket = TokenBucket(100.0, 10, now=0.0)
    assert [bucket.allow(0.0) for _ in range(11)] == [True] * 10 + [False]
    assert bucket.allow(0.0099) is False
    assert bucket.allow(0.0101) is True and bucket.allow(0.0101) is False  # 10.1 ms after the burst: one token
    assert sum(bucket.allow(60.0) for _ in range(50)) == 10


def test_each_process_starts_with_a_full_bucket():
    m = manager("current", rate_limit=(100.0, 10))
    assert sum(m.limiter.allow(0.0) for _ in range(20)) == 10
    again = manager("current", n=2, rate_limit=(100.0, 10))
    assert sum(again.limiter.allow(0.0) for _ in range(20)) == 10
