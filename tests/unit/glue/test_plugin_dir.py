"""kubelet's plugin directory and its resources (atedevd/glue/plugin_dir.py): what a resource
returns is handed back in, in order, until nothing is left; where the resources stand reaches
the process as news, once per change."""

from atedevd.config import Device
from atedevd.glue.plugin_dir import PluginDir, Standing
from atedevd.registration import messages as m
from atedevd.registration.messages import Outcome, State
from tests.unit.glue.fake_host import FakeHost


class ScriptedResource:
    """Answers each event with the outcomes a script gives it, and notes what it was handed."""

    def __init__(self, script, state=State.REGISTERED):
        self.script, self.handed, self.state = script, [], state

    def handle(self, now, event):
        self.handed.append(event)
        return list(self.script.get(event, ()))

    def view(self):
        return type("View", (), {"ready_on_hold": False, "yielded": False, "state": self.state, "advertised": True})()


def plugin_dir(host):
    return PluginDir(host.plugin_dir, "/dev", "/sys", host, "r1", lambda path, error: False)


def test_outcomes_are_handed_back_in_the_order_they_came_until_none_is_left():
    host = FakeHost()
    pd = plugin_dir(host)
    a, b, c, d = m.Bound(1), m.Bound(2), m.Placed(1), m.Placed(2)
    r = ScriptedResource({m.Nudge(): [a, b], a: [c], b: [d]})
    pd.resources["x"] = r  # type: ignore[assignment]
    pd.tell(host.now, r, m.Nudge())  # type: ignore[arg-type]
    assert r.handed == [m.Nudge(), a, b, c, d]  # siblings before their outcomes' outcomes


def test_where_the_resources_stand_is_news_once_per_change():
    host = FakeHost()
    pd = plugin_dir(host)
    r = ScriptedResource({})
    pd.resources["x"] = r  # type: ignore[assignment]
    pd.tell(host.now, r, m.Nudge())  # type: ignore[arg-type]
    assert pd.news() == [Standing(False, False, True)]
    pd.tell(host.now, r, m.Nudge())  # type: ignore[arg-type]
    assert pd.news() == []  # nothing changed: nothing said
    r.state = State.WAITING
    pd.tell(host.now, r, m.Nudge())  # type: ignore[arg-type]
    r.state = State.REGISTERED
    pd.tell(host.now, r, m.Nudge())  # type: ignore[arg-type]
    assert pd.news() == [Standing(False, False, False), Standing(False, False, True)]  # each change, in order


def test_a_resource_is_served_and_its_outcomes_carried_through_to_the_register_kubelet_refuses():
    host = FakeHost()
    pd = plugin_dir(host)
    pd.kubelet.refresh(created=False, events_lost=True)
    pd.apply([Device("ate.dev/kvm", "/dev/null")], "/dev", "/sys", host.now)
    assert pd.reconcile(host.now) is True  # it began to be served
    r = pd.resources["ate.dev/kvm"]
    # bound, placed, registered, refused (nobody listens): every outcome handed in, none left over
    assert r.view().state is State.WAITING and r.view().registers_sent == 0 and r.view().retry_at is not None
    host.accepting = True
    host.now = r.view().retry_at
    pd.wake(host.now)
    ((_, _, cid, done),) = host.registers
    done(m.RegisterDone(cid, Outcome.OK, ""))  # answered later, on the loop: the directory hands it in
    assert r.view().state is State.VERIFYING
    assert pd.news()[-1] == Standing(False, False, False)  # verifying is not yet registered


def test_a_successor_holds_what_its_predecessor_served():
    host = FakeHost()
    pd = plugin_dir(host)
    pd.hold(frozenset({"ate.dev/kvm"}))
    pd.kubelet.refresh(created=False, events_lost=True)
    pd.apply([Device("ate.dev/kvm", "/dev/nonexistent-node")], "/dev", "/sys", host.now)
    pd.reconcile(host.now)
    v = pd.resources["ate.dev/kvm"].view()
    assert v.advertised and v.state is not State.UNSERVED  # served (Unhealthy) though its node is missing
    assert host.registers == [] and pd.news()[-1].ready_on_hold  # bound, on hold: ready, registering nothing
