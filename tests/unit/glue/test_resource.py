"""One resource (atedevd/glue/resource.py) through its one entry: `handle` carries out what its
registration decides and returns the outcomes known at once, never feeding them in itself;
`view()` is what the plugin directory reads, made anew after each event."""

from atedevd.config import Device
from atedevd.glue.resource import Resource
from atedevd.glue.resource_events import CheckSockets, NodesMayHaveChanged, Reconcile, TimerDue
from atedevd.kubelet.pod_resources import PodResourcesClient
from atedevd.registration import messages as m
from atedevd.registration.messages import Listing, Outcome, State
from tests.unit.glue.fake_host import FakeHost

KVM = Device("ate.dev/kvm", "/dev/null")  # /dev/null: a character device every host has


def resource(host, delivered=None):
    return Resource(KVM, "/dev", "/sys", host, PodResourcesClient(host), "r1", lambda path, error: False,
                    lambda r, event: (delivered if delivered is not None else []).append(event))


def serve(host, r):
    return r.handle(host.now, Reconcile(True, True, host.wall() - 1.0, False, False))


def test_outcomes_known_at_once_are_returned_and_the_machine_has_not_seen_them():
    host = FakeHost()
    r = resource(host)
    assert r.view().advertised and r.view().state is State.UNSERVED
    outcomes = serve(host, r)
    # the socket bound, and pod-resources absent (host.exists is False): both known at once ...
    assert outcomes == [m.Listed(1, Listing.ABSENT, 0), m.Bound(1)]
    assert r.view().state is State.WAITING and host.registers == []  # ... and not yet handed in: no Register
    outcomes = [later for o in outcomes for later in r.handle(host.now, o)]
    assert outcomes == [m.Placed(1)] and r.view().state is State.REGISTERING
    # kubelet.sock is there but nobody accepts: the Register's refusal is known at once too
    (refused,) = r.handle(host.now, outcomes[0])
    assert refused == m.RegisterDone(2, Outcome.REFUSED, "kubelet is not accepting connections")
    assert r.view().state is State.REGISTERING and r.handle(host.now, refused) == []
    assert r.view().state is State.WAITING and r.view().retry_at is not None


def test_a_call_answered_later_comes_back_through_deliver_as_one_typed_event():
    host, delivered = FakeHost(), []
    host.accepting = True
    r = resource(host, delivered)
    pending = serve(host, r)
    while pending:
        pending = [later for o in pending for later in r.handle(host.now, o)]
    ((name, endpoint, cid, done),) = host.registers
    assert (name, r.view().registers_sent, r.view().state) == ("ate.dev/kvm", 1, State.REGISTERING)
    done(m.RegisterDone(cid, Outcome.OK, ""))  # the host's callback, on the loop
    assert delivered == [m.RegisterDone(cid, Outcome.OK, "")]
    assert r.view().state is State.REGISTERING  # delivered to the plugin directory, not fed in here
    r.handle(host.now, delivered[0])
    assert r.view().state is State.VERIFYING


def test_the_view_is_made_once_between_events_and_anew_after_each():
    host = FakeHost()
    r = resource(host)
    v = r.view()
    assert r.view() is v  # read as often as the loop likes: one value until the next event
    serve(host, r)
    assert r.view() is not v and r.view().state is State.WAITING and v.state is State.UNSERVED
    w = r.view()
    r.handle(host.now, NodesMayHaveChanged())
    assert r.view() is not w and r.view().look_due == -1.0 and w.look_due > host.now  # its look is due at once


def test_an_event_handled_while_another_is_carried_out_loses_none_of_its_outcomes():
    """Another resource's look may poke this one in the middle of its own work (the claims):
    the poke's handling must not take the outer event's outcomes with it."""
    host = FakeHost()
    r = resource(host)
    inner = []
    host.start_hook = lambda: inner.append(r.handle(host.now, NodesMayHaveChanged()))  # inside the Bind
    assert serve(host, r) == [m.Listed(1, Listing.ABSENT, 0), m.Bound(1)]
    assert inner == [[]]


def test_a_timer_is_run_when_told_it_is_due_and_not_before():
    host = FakeHost()
    r = resource(host)
    pending = serve(host, r)
    while pending:
        pending = [later for o in pending for later in r.handle(host.now, o)]
    at = r.view().retry_at
    assert r.view().state is State.WAITING and at is not None and r.view().deadline <= at
    r.handle(host.now, TimerDue())  # woken early: nothing is due
    assert r.view().state is State.WAITING and r.view().retry_at == at
    host.now = at
    assert r.handle(host.now, TimerDue()) == [m.RegisterDone(3, Outcome.REFUSED, "kubelet is not accepting connections")]
    assert r.view().state is State.REGISTERING


def test_a_socket_deleted_by_someone_else_is_told_to_its_registration_once():
    host = FakeHost()
    r = resource(host)
    pending = serve(host, r)
    while pending:
        pending = [later for o in pending for later in r.handle(host.now, o)]
    (server,) = host.servers
    server.deleted = True  # no longer ours (deleted, or replaced)
    assert r.handle(host.now, CheckSockets()) == []
    view = r.view()
    assert r.handle(host.now, CheckSockets()) == [] and r.view() == view  # the second look finds nothing new
    host.now = view.retry_at
    # its registration was told once: the retry binds a socket anew instead of registering the one gone
    assert r.handle(host.now, TimerDue()) == [m.Bound(2)] and len(host.servers) == 2


def test_a_resource_has_three_entries_and_the_plugin_directory_uses_no_other():
    """`handle`, `view` and `report` are its methods; everything else the directory reads of it is
    in the view (the Allocate counts, kept on gRPC threads, are read where they are counted)."""
    import ast
    import inspect

    from atedevd.glue import plugin_dir

    methods = {n for n, v in vars(Resource).items() if callable(v) and not n.startswith("_")}
    assert methods == {"handle", "view", "report"}
    tree = ast.parse(inspect.getsource(plugin_dir))
    reached = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "r"}  # (every Resource there is named r)
    assert reached == {"handle", "view", "report", "allocations"}, reached
