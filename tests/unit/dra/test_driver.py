"""One DRA process as decisions: the start, a stop, a reload's handover on both sides, a device
that goes while a claim holds it, and the health kubelet is told."""

from atedevd.dra import driver as d
from atedevd.dra import preparer as prep
from atedevd.dra import publisher as pub
from atedevd.dra.claims import ClaimRef, Prepared
from atedevd.dra.slices import GONE, DraDevice
from atedevd.glue.notices import Ready, Reloading, StartSuccessor, Status
from atedevd.glue.resource_events import TimerDue
from atedevd.registration.messages import Say
from atedevd.upgrade.machines import BecomeMain, Exit, MainPid, Message, Send, StopSuccessor

KVM = DraDevice("kvm", "ate.dev/kvm", "/dev/kvm", True, ("ate.dev/kvm=kvm",))
A = ClaimRef("ns", "a", "uid-a")


def kinds(actions):
    return [type(a) for a in actions if not isinstance(a, (Say, Status))]


def running():
    """A main process, started, its devices looked at, the API server reached, its slices written."""
    drv = d.Driver(None)
    assert kinds(drv.start(0.0)) == [d.ReadCheckpoint]
    assert kinds(drv.handle(0.0, d.CheckpointRead(None))) == [Ready]
    assert kinds(drv.handle(0.0, d.Looked((KVM,)))) == [pub.Connect]
    out = drv.handle(0.1, pub.Connected("node-a", "uid-n", "system:node:node-a"))
    assert kinds(out) == [pub.ListSlices, d.Health]
    drv.handle(0.2, pub.SlicesListed(()))
    drv.handle(0.3, pub.Written())
    return drv


def test_no_call_is_answered_before_the_checkpoint_is_read_and_its_claims_are_answered_from_it():
    drv = d.Driver(None)
    drv.start(0.0)
    assert drv.handle(0.0, prep.Asked(1, prep.PREPARE, (A,))) == []
    doc = {"version": 1, "driver": "ate.dev", "claims": {"uid-a": {"namespace": "ns", "name": "a", "devices": [
        {"requestNames": ["r"], "pool": "node-a", "device": "kvm", "cdiDeviceIDs": ["ate.dev/kvm=kvm"]}]}}}
    out = drv.handle(0.1, d.CheckpointRead(doc))
    [answer] = [a for a in out if isinstance(a, prep.Answer)]
    assert answer.outcomes["uid-a"].devices == (Prepared(("r",), "node-a", "kvm", ("ate.dev/kvm=kvm",)),)
    assert "1 claim(s) prepared" in drv.status()


def test_a_stop_drains_kubelet_s_connections_keeps_the_sockets_and_exits_once_drained():
    drv = running()
    out = drv.handle(1.0, d.Terminate("SIGTERM"))
    assert d.Drain(remove=False) in out and d.Stopping() in out and drv.exit_code is None
    assert kinds(drv.handle(1.1, d.Drained())) == [Exit] and drv.exit_code == 0


def test_a_switch_to_the_device_plugin_api_removes_the_sockets_and_a_bad_file_changes_nothing():
    drv = running()
    out = drv.handle(1.0, d.Hangup(None, "line 3: color: not a key"))
    assert kinds(out) == [] and "still serving as before" in [a for a in out if isinstance(a, Say)][0].text
    assert d.Drain(remove=True) in drv.handle(2.0, d.Hangup("device-plugin"))


def test_a_reload_hands_the_sockets_over_and_exits_only_once_all_it_held_is_answered():
    drv = running()
    out = drv.handle(1.0, d.Hangup("dra"))
    assert Reloading() in out and StartSuccessor(("dra",)) in out
    drv.handle(1.1, prep.Asked(7, prep.PREPARE, (A,)))  # a call on its way when the successor is ready
    out = drv.handle(1.2, d.Heard(Message.REGISTERED))
    assert d.Drain(remove=False) in out and drv.role == d.HANDING_OVER
    drv.handle(1.3, prep.ClaimRead(7, "uid-a", {"metadata": {"uid": "uid-a"}, "status": {"allocation": {"devices": {
        "results": [{"request": "r", "driver": "ate.dev", "pool": "node-a", "device": "kvm"}]}}}}))
    out = drv.handle(1.4, prep.CheckpointWritten(7))
    assert kinds(out) == [prep.Answer]
    assert kinds(drv.handle(1.5, d.Drained())) == [MainPid, Send, Exit]


def test_a_successor_that_fails_after_we_stopped_accepting_is_replaced_by_us_serving_again():
    drv = running()
    drv.handle(1.0, d.Hangup("dra"))
    drv.handle(1.1, d.Heard(Message.REGISTERED))
    out = drv.handle(1.2, d.Heard(None))
    assert d.Resume() in out and Ready() in out and drv.role == d.MAIN
    assert kinds(drv.handle(1.3, d.Drained())) == []  # (the drain that was under way ends nothing)
    assert drv.exit_code is None


def test_a_successor_that_never_serves_is_killed_after_the_handover_limit():
    drv = running()
    drv.handle(1.0, d.Hangup("dra"))
    assert drv.deadline() == 1.0 + d.HANDOVER_LATEST_S
    out = drv.handle(1.0 + d.HANDOVER_LATEST_S, TimerDue())
    assert StopSuccessor(kill=True) in out and Ready() in out


def test_a_successor_handed_the_sockets_says_so_at_once_and_answers_after_main_from_the_checkpoint():
    drv = d.Driver(None, successor=True, inherited=True)
    assert drv.start(0.0) == [Send(Message.REGISTERED)]
    drv.handle(0.1, d.Looked((KVM,)))
    assert kinds(drv.handle(0.2, pub.Connected("node-a", "uid-n", "u"))) == [d.Health]  # (connected, nothing written)
    assert drv.handle(0.3, prep.Asked(1, prep.PREPARE, (A,))) == []  # its predecessor answers until MAIN
    assert kinds(drv.handle(0.4, d.Heard(Message.MAIN))) == [d.ReadCheckpoint]
    out = drv.handle(0.5, d.CheckpointRead(None))
    assert BecomeMain() in out and pub.ListSlices("node-a") in out and prep.ReadClaim(1, A) in out


def test_a_successor_that_bound_its_own_sockets_says_registered_once_kubelet_took_it_or_was_away():
    drv = d.Driver(None, successor=True, inherited=False)
    assert drv.start(0.0) == []
    assert drv.handle(0.1, d.RegistrationSaid(True)).count(Send(Message.REGISTERED)) == 1
    away = d.Driver(None, successor=True, inherited=False)
    away.start(0.0)
    assert Send(Message.REGISTERED) in away.handle(d.KUBELET_AWAY_S, TimerDue())


def test_a_device_that_goes_while_a_claim_holds_it_stays_listed_tainted_and_unhealthy_until_the_claim_goes():
    drv = running()
    drv.book.prepare(A, [Prepared(("r",), "node-a", "kvm", ("ate.dev/kvm=kvm",))])
    out = drv.handle(2.0, d.Looked(()))
    assert drv.publisher.wanted == (KVM._replace(taint=GONE),)
    assert d.Health("node-a", (("kvm", 2, "its device node is gone"),)) in out
    drv.handle(3.0, prep.Asked(9, prep.UNPREPARE, (A,)))
    out = drv.handle(3.1, prep.CheckpointWritten(9))
    assert drv.publisher.wanted == () and d.Health("node-a", ()) in out
