"""Kubelet's calls as decisions: a held claim answered at once, a new one read and checked,
the checkpoint written before any answer, calls on one claim in kubelet's order, a read that
waits for the API server as long as a prepare may."""

from atedevd.dra import preparer as p
from atedevd.dra.claims import Book, ClaimRef
from atedevd.dra.slices import DraDevice
from atedevd.glue.resource_events import TimerDue
from atedevd.registration.messages import Say

KVM = DraDevice("kvm", "ate.dev/kvm", "/dev/kvm", True, ("ate.dev/kvm=kvm",))
TTY = DraDevice("serial-ttyusb0", "ate.dev/serial", "/dev/ttyUSB0", False, ("ate.dev/serial=ttyUSB0",))
DEVICES = {"kvm": KVM, "serial-ttyusb0": TTY}
A, B = ClaimRef("ns", "a", "uid-a"), ClaimRef("ns", "b", "uid-b")


def claim(ref, device="kvm"):
    return {"metadata": {"uid": ref.uid}, "status": {"allocation": {"devices": {"results": [
        {"request": "r", "driver": "ate.dev", "pool": "node-a", "device": device}]}}}}


def ready(opened=True):
    prep = p.Preparer(Book(), opened=opened)
    prep.handle(0.0, p.Devices(DEVICES))
    prep.handle(0.0, p.Reachable("node-a"))
    return prep


def acts(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_a_new_claim_is_read_checkpointed_then_answered_and_asked_again_is_answered_from_the_book():
    prep = ready()
    assert prep.handle(0.1, p.Asked(1, p.PREPARE, (A,))) == [p.ReadClaim(1, A)]
    [write] = acts(prep.handle(0.2, p.ClaimRead(1, A.uid, claim(A))), p.WriteCheckpoint)
    assert list(write.document["claims"]) == ["uid-a"]  # (on disk before kubelet hears of it)
    [answer] = acts(prep.handle(0.3, p.CheckpointWritten(1)), p.Answer)
    assert answer.outcomes["uid-a"].error == "" and answer.outcomes["uid-a"].devices[0].cdi_ids == ("ate.dev/kvm=kvm",)
    again = prep.handle(0.4, p.Asked(2, p.PREPARE, (A,)))
    assert again == [p.Answer(2, {"uid-a": answer.outcomes["uid-a"]})] and prep.idle


def test_a_checkpoint_that_cannot_be_written_fails_the_claims_of_its_call_and_leaves_the_book_as_it_was():
    prep = ready()
    prep.handle(0.1, p.Asked(1, p.PREPARE, (A,)))
    prep.handle(0.2, p.ClaimRead(1, A.uid, claim(A)))
    [answer] = acts(prep.handle(0.3, p.CheckpointWritten(1, "No space left on device")), p.Answer)
    assert "No space left on device" in answer.outcomes["uid-a"].error and prep.book.claims == {}
    prep.book.prepare(B, [])
    prep.handle(0.4, p.Asked(2, p.UNPREPARE, (B,)))
    [answer] = acts(prep.handle(0.5, p.CheckpointWritten(2, "read-only")), p.Answer)
    assert "read-only" in answer.outcomes["uid-b"].error and "uid-b" in prep.book.claims  # (held, as on disk)


def test_a_pattern_unit_is_one_claim_s_at_a_time_even_when_two_are_read_at_once():
    prep = ready()
    prep.handle(0.1, p.Asked(1, p.PREPARE, (A,)))
    prep.handle(0.1, p.Asked(2, p.PREPARE, (B,)))
    prep.handle(0.2, p.ClaimRead(2, B.uid, claim(B, "serial-ttyusb0")))
    out = prep.handle(0.2, p.ClaimRead(1, A.uid, claim(A, "serial-ttyusb0")))
    [refused] = acts(out, p.Answer)
    assert refused.call == 1 and "prepared for claim uid-b already" in refused.outcomes["uid-a"].error
    assert [a.kind for a in out if isinstance(a, Say)] == ["dra-prepare"]


def test_calls_on_one_claim_happen_in_kubelet_s_order_and_others_do_not_wait_for_them():
    prep = ready()
    prep.handle(0.1, p.Asked(1, p.PREPARE, (A,)))
    assert prep.handle(0.1, p.Asked(2, p.UNPREPARE, (A,))) == []  # waits for the prepare of the same claim
    assert prep.handle(0.1, p.Asked(3, p.PREPARE, (B,))) == [p.ReadClaim(3, B)]  # another claim: at once
    prep.handle(0.2, p.ClaimRead(1, A.uid, claim(A)))
    out = prep.handle(0.3, p.CheckpointWritten(1))
    assert [a.call for a in acts(out, p.Answer)] == [1] and [w.call for w in acts(out, p.WriteCheckpoint)] == [2]
    [answer] = acts(prep.handle(0.4, p.CheckpointWritten(2)), p.Answer)
    assert answer.call == 2 and "uid-a" not in prep.book.claims


def test_an_unprepare_of_a_claim_never_prepared_succeeds_without_a_write():
    prep = ready()
    assert prep.handle(0.1, p.Asked(1, p.UNPREPARE, (A,))) == [p.Answer(1, {"uid-a": p.ClaimOutcome()})]


def test_a_read_without_the_api_server_is_tried_again_until_the_prepare_s_wait_is_over():
    prep = ready()
    prep.handle(0.0, p.Asked(1, p.PREPARE, (A,)))
    assert prep.handle(0.1, p.ClaimNotRead(1, A.uid, "connection refused", None)) == []
    assert prep.deadline() == 0.1 + p.READ_AGAIN_S
    assert prep.handle(prep.deadline(), TimerDue()) == [p.ReadClaim(1, A)]
    [answer] = acts(prep.handle(p.PREPARE_WAIT_S, p.ClaimNotRead(1, A.uid, "HTTP 503", 503)), p.Answer)
    assert answer.outcomes["uid-a"].error == "HTTP 503"
    prep.handle(31.0, p.Asked(2, p.PREPARE, (B,)))
    [answer] = acts(prep.handle(31.1, p.ClaimNotRead(2, B.uid, "HTTP 404 Not Found", 404)), p.Answer)
    assert answer.outcomes["uid-b"].error == "HTTP 404 Not Found"  # (no wait helps a claim that is not there)


def test_a_prepare_before_the_api_server_is_reached_waits_for_it_and_fails_when_it_never_comes():
    prep = p.Preparer(Book(), opened=True)
    prep.handle(0.0, p.Devices(DEVICES))
    assert prep.handle(0.0, p.Asked(1, p.PREPARE, (A,))) == [] and prep.deadline() == p.PREPARE_WAIT_S
    assert prep.handle(1.0, p.Reachable("node-a")) == [p.ReadClaim(1, A)]
    prep.handle(2.0, p.Asked(2, p.PREPARE, (B,)))  # (another, read at once: the server is there)
    late = p.Preparer(Book(), opened=True)
    late.handle(0.0, p.Asked(1, p.PREPARE, (A,)))
    [answer] = acts(late.handle(p.PREPARE_WAIT_S, TimerDue()), p.Answer)
    assert "has not been reached in 30 s" in answer.outcomes["uid-a"].error


def test_until_opened_nothing_is_answered_not_even_a_claim_in_the_book():
    prep = ready(opened=False)
    prep.book.prepare(A, [])
    assert prep.handle(0.1, p.Asked(1, p.PREPARE, (A,))) == []
    [answer] = acts(prep.handle(0.2, p.Open()), p.Answer)
    assert answer.call == 1 and answer.outcomes["uid-a"].error == ""
