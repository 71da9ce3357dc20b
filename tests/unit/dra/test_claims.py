"""Prepared claims: checked against the allocation, kept by UID, read back from a checkpoint."""

from atedevd.dra import claims as c
from atedevd.dra.slices import DraDevice

KVM = DraDevice("kvm", "ate.dev/kvm", "/dev/kvm", True, ("ate.dev/kvm=kvm",))
DEVICES = {"kvm": KVM}
REF = c.ClaimRef("ns", "pod-kvm", "uid-1")


def claim(uid="uid-1", results=None, allocated=True):
    results = [{"request": "kvm", "driver": "ate.dev", "pool": "node-a", "device": "kvm"}] if results is None else results
    status = {"allocation": {"devices": {"results": results}}} if allocated else {}
    return {"metadata": {"uid": uid}, "status": status}


def test_an_allocated_claim_is_answered_with_the_cdi_names_of_its_devices():
    devices, why = c.allocated(claim(), REF, "node-a", DEVICES)
    assert why == "" and devices == [c.Prepared(("kvm",), "node-a", "kvm", ("ate.dev/kvm=kvm",), "")]


def test_two_requests_on_one_device_are_one_entry_and_two_shares_are_two():
    same = [{"request": r, "driver": "ate.dev", "pool": "node-a", "device": "kvm"} for r in ("a", "b")]
    devices, _ = c.allocated(claim(results=same), REF, "node-a", DEVICES)
    assert [d.request_names for d in devices] == [("a", "b")]
    shared = [dict(r, shareID=s) for r, s in zip(same, ("s1", "s2"))]
    devices, _ = c.allocated(claim(results=shared), REF, "node-a", DEVICES)
    assert sorted(d.share_id for d in devices) == ["s1", "s2"]


def test_what_is_not_this_node_s_to_prepare_is_refused_with_its_reason():
    cases = [
        (claim(uid="uid-2"), "its UID is 'uid-2'"),
        (claim(allocated=False), "is not allocated"),
        (claim(results=[{"driver": "gpu.example.com", "pool": "node-a", "device": "g0"}]), "no device of driver ate.dev"),
        (claim(results=[{"driver": "ate.dev", "pool": "node-b", "device": "kvm"}]), "of pool 'node-b'"),
        (claim(results=[{"driver": "ate.dev", "pool": "node-a", "device": "tun"}]), "'tun' is not one this node serves"),
    ]
    for doc, reason in cases:
        devices, why = c.allocated(doc, REF, "node-a", DEVICES)
        assert devices is None and reason in why, (reason, why)


def test_the_book_answers_again_unprepares_once_and_comes_back_whole_from_its_document():
    book = c.Book()
    devices, _ = c.allocated(claim(), REF, "node-a", DEVICES)
    doc = book.prepare(REF, devices)
    assert book.answer("uid-1") == tuple(devices) and book.sharing("kvm") == ["uid-1"]
    again = c.Book()
    assert again.load(doc) == "" and again.answer("uid-1") == tuple(devices)
    assert book.unprepare("uid-1") is not None
    assert book.unprepare("uid-1") is None  # already gone: nothing to write, and success
    assert book.answer("uid-1") is None


def test_a_checkpoint_of_another_version_or_malformed_is_not_taken_and_says_why():
    book = c.Book()
    book.prepare(REF, [c.Prepared(("kvm",), "node-a", "kvm", ("ate.dev/kvm=kvm",))])
    assert "version-1 checkpoint" in book.load({"version": 2, "driver": "ate.dev", "claims": {}})
    assert "malformed" in book.load({"version": 1, "driver": "ate.dev", "claims": {"u": {"namespace": "ns"}}})
    assert book.answer("uid-1") is not None, "a refused document replaced what the book held"
