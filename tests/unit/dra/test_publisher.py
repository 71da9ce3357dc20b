"""The slices' publisher as decisions: one question at a time, nothing written while the server
lists what is wanted, a generation that never goes back, a back-off on failure."""

from atedevd.dra import publisher as p
from atedevd.dra.slices import GONE, DraDevice, slices
from atedevd.glue.resource_events import TimerDue
from atedevd.registration.messages import Say

KVM = DraDevice("kvm", "ate.dev/kvm", "/dev/kvm", True, ("ate.dev/kvm=kvm",))
TUN = DraDevice("vhost-net", "ate.dev/vhost-net", "/dev/vhost-net", True, ("ate.dev/vhost-net=vhost-net",))


def asked(actions):
    return [a for a in actions if not isinstance(a, Say)]


def connected(devices=(KVM,)):
    pub = p.Publisher(None)
    assert asked(pub.handle(0.0, p.Want(devices))) == [p.Connect()]
    assert asked(pub.handle(0.1, p.Connected("node-a", "uid-n", "system:node:node-a"))) == [p.ListSlices("node-a")]
    return pub


def server_copy(doc, version="7"):
    """A slice as the API server lists it: its resourceVersion, and defaults it adds."""
    out = {**doc, "metadata": {**doc["metadata"], "resourceVersion": version}}
    out["spec"] = {**doc["spec"], "perDeviceNodeSelection": False}
    return out


def test_an_empty_server_gets_the_slice_with_generation_one_and_a_list_that_matches_writes_nothing():
    pub = connected()
    [write] = asked(pub.handle(0.2, p.SlicesListed(())))
    assert isinstance(write, p.WriteSlices) and write.replaces == () and write.deletes == ()
    [doc] = write.creates
    assert doc["spec"]["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 1}
    assert doc["metadata"]["ownerReferences"][0]["uid"] == "uid-n"
    assert asked(pub.handle(0.3, p.Written())) == [] and pub.published == (KVM,)
    assert asked(pub.handle(0.4, p.SlicesChanged())) == [p.ListSlices("node-a")]
    assert asked(pub.handle(0.5, p.SlicesListed((server_copy(doc),)))) == []  # (what the server added aside)
    assert pub.generation == 1 and not pub.busy


def test_a_wipe_is_written_again_one_generation_higher_and_a_new_run_carries_the_server_s_generation_on():
    pub = connected()
    [doc] = slices("node-a", "uid-n", (KVM,), 41)
    assert asked(pub.handle(0.2, p.SlicesListed((server_copy(doc),)))) == []  # an earlier run's, as wanted
    assert pub.generation == 41 and pub.published == (KVM,)
    pub.handle(0.3, p.SlicesChanged())
    [write] = asked(pub.handle(0.4, p.SlicesListed(())))  # kubelet wiped them
    assert write.creates[0]["spec"]["pool"]["generation"] == 42


def test_a_change_of_the_devices_while_a_question_is_out_is_looked_at_once_it_is_answered():
    pub = connected()
    assert asked(pub.handle(0.2, p.Want((KVM, TUN)))) == []  # one question at a time
    [write] = asked(pub.handle(0.3, p.SlicesListed(())))
    assert asked(pub.handle(0.4, p.Written())) == [p.ListSlices("node-a")]
    assert [d["name"] for d in write.creates[0]["spec"]["devices"]] == ["kvm", "vhost-net"]


def test_a_failure_is_said_once_and_tried_again_after_a_back_off_that_doubles():
    pub = p.Publisher(None)
    pub.handle(0.0, p.Want((KVM,)))
    said = pub.handle(0.0, p.ApiFailed("connection refused"))
    assert [a.kind for a in said if isinstance(a, Say)] == ["dra-api"] and pub.problem == "connection refused"
    assert pub.deadline() == p.RETRY_FIRST_S
    assert asked(pub.handle(0.1, TimerDue())) == []  # not due yet
    assert asked(pub.handle(p.RETRY_FIRST_S, TimerDue())) == [p.Connect()]
    assert [a for a in pub.handle(1.0, p.ApiFailed("connection refused")) if isinstance(a, Say)] == []  # said once
    assert pub.deadline() == 1.0 + 2 * p.RETRY_FIRST_S
    pub.handle(2.0, TimerDue())
    pub.handle(2.1, p.Connected("node-a", "uid-n", "system:node:node-a"))
    pub.handle(2.2, p.SlicesListed(()))
    said = pub.handle(2.3, p.Written())
    assert "dra-api" in [a.kind for a in said if isinstance(a, Say)] and pub.problem == ""


def test_the_slices_are_chunked_and_the_extra_ones_deleted():
    many = tuple(DraDevice(f"u{i:03}", "ate.dev/u", f"/dev/u{i}", False, (f"ate.dev/u=u{i}",)) for i in range(130))
    pub = connected(many)
    [write] = asked(pub.handle(0.2, p.SlicesListed(())))
    assert [len(d["spec"]["devices"]) for d in write.creates] == [128, 2]
    pub.handle(0.3, p.Written())
    pub.handle(0.4, p.Want(many[:3]))
    on_server = tuple(server_copy(d) for d in write.creates)
    [write] = asked(pub.handle(0.5, p.SlicesListed(on_server)))
    assert len(write.replaces) == 1 and write.deletes == ("node-a-ate.dev-1",)
    assert write.replaces[0][1] == "7" and write.replaces[0][0]["spec"]["pool"]["resourceSliceCount"] == 1


def test_a_tainted_device_s_slice_holds_64_and_a_server_that_drops_taints_is_not_written_to_again_and_again():
    gone = KVM._replace(taint=GONE)
    pub = connected((gone,))
    [write] = asked(pub.handle(0.2, p.SlicesListed(())))
    assert write.creates[0]["spec"]["devices"][0]["taints"] == [{"key": GONE, "effect": "NoSchedule"}]
    pub.handle(0.3, p.Written())
    pub.handle(0.4, p.SlicesChanged())
    dropped = server_copy(write.creates[0])
    dropped["spec"]["devices"] = [{k: v for k, v in d.items() if k != "taints"} for d in dropped["spec"]["devices"]]
    said = pub.handle(0.5, p.SlicesListed((dropped,)))
    assert asked(said) == [] and pub.taints_kept is False  # (DRADeviceTaints off: no write loop)
    assert [a.kind for a in said if isinstance(a, Say)] == ["dra-taints"]
    many = tuple(DraDevice(f"u{i:03}", "ate.dev/u", f"/dev/u{i}", False, ("x",), taint=GONE if i == 0 else "")
                 for i in range(100))
    assert [len(d["spec"]["devices"]) for d in slices("n", None, many, 1)] == [64, 36]


def test_a_successor_connects_but_writes_nothing_until_it_publishes():
    pub = p.Publisher(None, publishing=False)
    assert asked(pub.handle(0.0, p.Want((KVM,)))) == [p.Connect()]
    assert asked(pub.handle(0.1, p.Connected("node-a", "uid-n", "u"))) == [] and pub.connected and not pub.busy
    pub.publishing = True
    assert asked(pub.handle(0.2, p.Want((KVM,)))) == [p.ListSlices("node-a")]
