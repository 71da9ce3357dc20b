"""CDI names and spec documents (atedevd/cdi/names.py), and one resource's spec as decisions without
I/O (atedevd/cdi/book.py): what is written, what may be answered, what an upgrade's successor adopts."""

from atedevd.cdi import book as cdi_book
from atedevd.cdi import names as cdi
from atedevd.devices.snapshot import NodeGrant

KVM = "ate.dev/kvm"


# --- names and documents ---------------------------------------------------------------------

def test_a_resource_is_a_kind_and_its_units_are_device_names():
    assert cdi.kind("ate.dev/kvm") == "ate.dev/kvm"
    assert cdi.kind("ate.dev/kvm.v2") == "ate.dev/kvm_v2"  # no dots in a class before spec 0.6.0
    assert cdi.kind_problem("ate.dev/kvm") is None
    assert "must start with a letter" in cdi.kind_problem("3com.example/kvm")
    assert "must start with a letter" in cdi.kind_problem("ate.dev/3d")
    assert cdi.file_name("ate.dev/kvm") == "atedevd-ate.dev_kvm.json"
    assert cdi.shared_name("ate.dev/kvm") == "kvm"
    assert cdi.unit_name("vfio-12") == "vfio-12"
    assert cdi.unit_name("ttyUSB0") == "ttyUSB0"
    odd = cdi.unit_name("serial-by-id-usb-FTDI+x@y")  # "+" and "@" are kept in IDs, not in CDI names
    assert odd.startswith("serial-by-id-usb-FTDI-x-y.") and len(odd) > 63 and cdi.unit_of(odd) == "serial-by-id-usb-FTDI+x@y"
    assert cdi.unit_name("a~b") != cdi.unit_name("a@b")
    # The pair that shared a name under the 10-hex-digit hash: one not a valid name, the other its image.
    assert cdi.unit_name("ttyUSB-") != cdi.unit_name("ttyUSB.bcef8d8415") == "ttyUSB.bcef8d8415"
    assert cdi.qualified("ate.dev/vfio", "vfio-12") == "ate.dev/vfio=vfio-12"


def test_the_spec_version_is_the_lowest_that_allows_its_names():
    node = NodeGrant("/dev/kvm", 10, 232)
    doc = cdi.document(KVM, [cdi.device_entry("kvm", [node], cdi.Settings())])
    assert doc == {"cdiVersion": "0.3.0", "kind": "ate.dev/kvm", "devices": [{"name": "kvm", "containerEdits": {
        "deviceNodes": [{"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232, "fileMode": 0o666,
                         "permissions": "rw"}]}}]}
    owned = cdi.device_entry("0a", [node], cdi.Settings(0o660, 0, 107, "rwm"))
    assert cdi.document(KVM, [owned])["cdiVersion"] == "0.5.0"  # a name starting with a digit: 0.5.0
    assert owned["containerEdits"]["deviceNodes"][0] == {"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232,
                                                         "fileMode": 0o660, "permissions": "rwm", "uid": 0, "gid": 107}


def test_a_name_stays_in_the_spec_and_is_answerable_only_as_written():
    book = cdi_book.SpecBook("ate.dev/serial")
    a, b = NodeGrant("/dev/ttyUSB0", 188, 0), NodeGrant("/dev/ttyUSB1", 188, 1)
    doc = book.offer({"ttyUSB0": (a,), "ttyUSB1": (b,)}, cdi.Settings())
    assert cdi.device_names(doc) == ("ttyUSB0", "ttyUSB1") and book.answerable == frozenset()
    book.written(doc)
    assert book.answerable == {"ttyUSB0", "ttyUSB1"}
    assert book.offer({"ttyUSB0": (a,)}, cdi.Settings()) is None  # ttyUSB1 unplugged: nothing to write, still there
    doc = book.offer({}, cdi.Settings(mode=0o600))  # narrowed: not answerable until the narrower spec is written
    assert book.answerable == frozenset() and book.pending
    assert [d["containerEdits"]["deviceNodes"][0]["fileMode"] for d in doc["devices"]] == [0o600, 0o600]
    book.written(doc)
    assert book.answerable == {"ttyUSB0", "ttyUSB1"} and not book.pending
    assert book.ever_answerable == {"ttyUSB0", "ttyUSB1"}


def test_an_upgrades_successor_adopts_the_other_daemons_devices():
    book = cdi_book.SpecBook(KVM)
    book.offer({"kvm": (NodeGrant("/dev/kvm", 10, 232),)}, cdi.Settings())
    theirs = {"cdiVersion": "0.3.0", "kind": KVM, "devices": [
        {"name": "old", "containerEdits": {"deviceNodes": [{"path": "/dev/old", "type": "c", "major": 1, "minor": 2}]}},
        {"name": "kvm", "containerEdits": {"deviceNodes": []}},
        {"name": "odd", "containerEdits": {"deviceNodes": [{"path": "/dev/odd", "type": "b", "major": 8, "minor": 0}]}}]}
    assert book.adopt({"kind": "other/kind", "devices": theirs["devices"]}) is False
    assert book.adopt(None) is False
    assert book.adopt(theirs) is True
    doc = book.document()
    assert cdi.device_names(doc) == ("kvm", "old")  # ours kept for a name both have; not a char device: not ours
    assert doc["devices"][1]["containerEdits"]["deviceNodes"][0] == {
        "path": "/dev/old", "type": "c", "major": 1, "minor": 2, "fileMode": 0o666, "permissions": "rw"}
    assert book.adopt(theirs) is False  # kept as our own from now on
    book.written(doc)
    assert book.answerable == {"kvm", "old"}
