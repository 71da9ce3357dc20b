"""CDI grants (atedevd/cdi/names.py, cdi_book.py, cdi_files.py, cdi_keeper.py): the names, the spec
documents a CDI library of podman 4.3 / containerd 1.7 accepts, the atomic and link-proof writes,
and the daemon as a process answering Allocate with CDI names whose spec is on disk (a shareable
device, a pattern with its companions, a reload that narrows the mode, an unplugged unit, the
stop). The same grants through a real runtime: tests/test_cdi_runtime.py."""

import json
import os
import signal
import stat

import pytest

from atedevd.cdi import book as cdi_book
from atedevd.cdi import files as cdi_files
from atedevd.cdi import names as cdi
from atedevd.config import ConfigError, load
from atedevd.devices import shared
from atedevd.devices.snapshot import NodeGrant
from rig.harness import wait_until
from tests.test_patterns import mknod

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and root-owned directories need root (CI runs as root)")

KVM = "ate.dev/kvm"
SPEC = "atedevd-ate.dev_kvm.json"


def write(path, text, mode=0o644):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return str(path)


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


def test_a_handover_adopts_the_other_daemons_devices():
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


# --- the files -------------------------------------------------------------------------------------

@root_only
def test_a_spec_is_written_whole_and_never_through_a_planted_link(tmp_path):
    spec_dir = str(tmp_path / "cdi")
    target = tmp_path / "target"
    target.write_text("keep")
    with cdi_files.Locked(spec_dir) as d:
        assert stat.S_IMODE(os.stat(spec_dir).st_mode) == 0o755
        os.symlink(str(target), os.path.join(spec_dir, SPEC))  # a link where the spec goes
        inode = d.write(SPEC, {"cdiVersion": "0.3.0", "kind": KVM, "devices": []}).st_ino
    assert target.read_text() == "keep"  # replaced the link, did not write through it
    st = os.lstat(os.path.join(spec_dir, SPEC))
    assert stat.S_ISREG(st.st_mode) and st.st_ino == inode and stat.S_IMODE(st.st_mode) == 0o644
    assert [n for n in os.listdir(spec_dir) if n.endswith(".tmp")] == []
    with cdi_files.Locked(spec_dir) as d:
        assert d.remove_if(SPEC, inode + 1) is False  # another writer's file: left alone
        assert d.remove_if(SPEC, inode) is True
    assert os.listdir(spec_dir) == []


@root_only
def test_a_spec_directory_others_can_write_is_refused(tmp_path):
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    os.chmod(spec_dir, 0o777)
    with pytest.raises(cdi_files.SpecDirError) as e:
        cdi_files.Locked(str(spec_dir))
    assert f"{spec_dir} is writable by its group and others" in str(e.value)


def test_a_name_two_files_define_resolves_to_nothing(tmp_path):
    def spec(name, kind, *devices, version="0.3.0"):
        write(tmp_path / name, json.dumps({"cdiVersion": version, "kind": kind, "devices": [
            {"name": d, "containerEdits": {}} for d in devices]}))
    spec("a.json", KVM, "kvm", "x")
    spec("b.json", KVM, "x")
    spec("c.json", "ate.dev/vfio", "vfio-1", version="9.9.9")  # not a version the runtimes know
    spec("d.json.tmp", KVM, "y")
    assert cdi_files.resolvable(str(tmp_path)) == {"ate.dev/kvm=kvm"}


@root_only
def test_the_keeper_owes_every_name_it_could_answer_and_writes_before_it_answers(tmp_path):
    """What the simulation checks after every event: Specs.owed() resolves in the spec directory."""
    from atedevd.cdi import keeper as cdi_keeper
    from atedevd.config import Config, Device

    dev = tmp_path / "dev"
    mknod(dev, "kvm", 10, 232)
    said = []
    specs = cdi_keeper.Specs(lambda *a, **kw: said.append(a))
    specs.configure(Config(cdi=True, cdi_spec_dir=str(tmp_path / "cdi"), dev_root=str(dev)))
    keeper = specs.keeper(KVM)
    assert specs.keeper(KVM) is keeper and keeper.wrote is False and specs.owed() == set()
    table = shared.SharedTable(Device(KVM, "/dev/kvm"), str(dev))
    table.look()
    keeper.publish(table.snapshot(1), Device(KVM, "/dev/kvm"))
    assert keeper.wrote is True and specs.owed() == {"ate.dev/kvm=kvm"}
    assert specs.owed() <= cdi_files.resolvable(str(tmp_path / "cdi"))
    assert keeper.names(["kvm-0", "kvm-1"]) == ("ate.dev/kvm=kvm",) and said == []
    specs.retire(KVM)  # still configured: it stays
    assert cdi_files.resolvable(str(tmp_path / "cdi")) == {"ate.dev/kvm=kvm"}
    specs.configure(Config(cdi=True, cdi_spec_dir=str(tmp_path / "cdi"), dev_root=str(dev), devices=()))
    specs.retire(KVM)  # no longer configured, and kubelet let go of it: gone
    assert cdi_files.resolvable(str(tmp_path / "cdi")) == set() and specs.owed() == set()


# --- the configuration ---------------------------------------------------------------------------------

def test_cdi_keys_are_checked_all_at_once(tmp_path):
    path = write(tmp_path / "c.toml", "\n".join([
        "[daemon]", 'cdi = "yes"', "device_specs = false",
        "[[device]]", 'resource = "ate.dev/3d"', 'path = "/dev/kvm"', "container_mode = 0o777",
        "container_uid = -1", 'container_gid = "kvm"', "host_mode = 0o4666", ""]))
    with pytest.raises(ConfigError) as e:
        load(path)
    text = str(e.value)
    assert f"{path}:2: [daemon] cdi: must be true or false, got string" in text
    assert f"{path}:7: [[device]] #1 container_mode: 0o777 is not a device node's mode" in text
    assert f"{path}:8: [[device]] #1 container_uid: must be between 0 and 4294967294, got -1" in text
    assert f"{path}:9: [[device]] #1 container_gid: must be an integer" in text
    assert f"{path}:10: [[device]] #1 host_mode: 0o4666 is not a device node's mode" in text
    path = write(tmp_path / "d.toml", "[daemon]\ndevice_specs = false\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert "device_specs = false needs cdi = true" in str(e.value)
    path = write(tmp_path / "e.toml", '[daemon]\ncdi = true\n[[device]]\nresource = "ate.dev/3d"\npath = "/dev/kvm"\n'
                 '[[device]]\nresource = "ate.dev/a.b"\npath = "/dev/a"\n[[device]]\nresource = "ate.dev/a_b"\npath = "/dev/b"\n')
    with pytest.raises(ConfigError) as e:
        load(path)
    assert '[[device]] #1 resource: "ate.dev/3d" cannot name a CDI kind' in str(e.value)
    assert '[[device]] #3 resource: "ate.dev/a_b" and "ate.dev/a.b" are one CDI kind, "ate.dev/a_b"' in str(e.value)
    cfg = load(write(tmp_path / "f.toml", '[daemon]\ncdi = true\ncdi_spec_dir = "/run/x"\n[[device]]\n'
                     'resource = "ate.dev/kvm"\npath = "/dev/kvm"\ncontainer_mode = 0o660\ncontainer_gid = 107\n'))
    assert (cfg.cdi, cfg.cdi_spec_dir, cfg.device_specs) == (True, "/run/x", True)
    assert (cfg.devices[0].container_mode, cfg.devices[0].container_uid, cfg.devices[0].container_gid) == (0o660, None, 107)


@root_only
def test_host_mode_is_refused_for_a_node_the_policy_refuses(tmp_path):
    dev = tmp_path / "dev"
    mknod(dev, "mem", 1, 1)  # /dev/mem: the host's memory
    path = write(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/mem"\npath = "/dev/mem"\n'
                 'allow_host_access = true\nhost_mode = 0o666\n')
    with pytest.raises(ConfigError) as e:
        load(path, overrides={"dev_root": str(dev)})
    assert '[[device]] #1 host_mode: "/dev/mem" (ate.dev/mem): refused: ' in str(e.value)
    assert '(char 1:1, not in sysfs) is physical memory (/dev/mem)' in str(e.value)
    assert "atedevd never widens the host's mode of such a node" in str(e.value)


# --- the daemon as a process -------------------------------------------------------------------------

def cdi_config(tmp_path, spec_dir, devices="", daemon=""):
    return write(tmp_path / "c.toml", f'[daemon]\ncdi = true\ncdi_spec_dir = "{spec_dir}"\n{daemon}{devices}')


def spec_doc(spec_dir, name=SPEC):
    with open(os.path.join(spec_dir, name)) as f:
        return json.load(f)


def answer(kubelet, resource, ids):
    r = kubelet.allocate(resource, ids).container_responses[0]
    return [d.name for d in r.cdi_devices], [(s.container_path, s.host_path, s.permissions) for s in r.devices]


@root_only
def test_a_shareable_device_is_answered_with_its_cdi_name_and_its_devicespec(start_daemon, kubelet, tmp_path):
    dev = tmp_path / "devroot"
    mknod(dev, "kvm", 10, 232)
    spec_dir = str(tmp_path / "cdi")
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, spec_dir))
    d.wait_ready()
    assert os.path.exists(os.path.join(spec_dir, SPEC))  # before READY=1: before kubelet could have our list
    assert kubelet.wait_connected(KVM), d.log()
    assert answer(kubelet, KVM, ["kvm-0", "kvm-5"]) == (["ate.dev/kvm=kvm"], [("/dev/kvm", "/dev/kvm", "rw")])
    assert spec_doc(spec_dir) == {"cdiVersion": "0.3.0", "kind": KVM, "devices": [{"name": "kvm", "containerEdits": {
        "deviceNodes": [{"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232, "fileMode": 0o666,
                         "permissions": "rw"}]}}]}
    assert cdi_files.resolvable(spec_dir) == {"ate.dev/kvm=kvm"}
    assert d.stop() == 0
    assert cdi_files.resolvable(spec_dir) == {"ate.dev/kvm=kvm"}  # stays: kubelet's checkpointed answers name it


@root_only
def test_cdi_alone_a_narrowed_mode_on_reload_and_a_kill_leaves_the_spec(start_daemon, kubelet, tmp_path):
    dev = tmp_path / "devroot"
    mknod(dev, "kvm", 10, 232)
    spec_dir = str(tmp_path / "cdi")
    cfg = cdi_config(tmp_path, spec_dir, daemon="device_specs = false\n")
    d = start_daemon(dev_root=str(dev), config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected(KVM), d.log()
    assert answer(kubelet, KVM, ["kvm-0"]) == (["ate.dev/kvm=kvm"], [])
    cdi_config(tmp_path, spec_dir, daemon="device_specs = false\n",
               devices='[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncontainer_mode = 0o660\ncontainer_gid = 107\n')
    n = len(d.notify.messages)
    d.send(signal.SIGHUP)
    assert d.notify.wait_for("READY", "1", timeout=5, after=n)
    node = spec_doc(spec_dir)["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert (node["fileMode"], node["gid"], "uid" in node) == (0o660, 107, False)
    assert answer(kubelet, KVM, ["kvm-0"]) == (["ate.dev/kvm=kvm"], [])
    d.send(signal.SIGKILL)
    d.wait()
    assert cdi_files.resolvable(spec_dir) == {"ate.dev/kvm=kvm"}  # valid for the next start to replace
    before = os.stat(os.path.join(spec_dir, SPEC)).st_ino
    d2 = start_daemon(dev_root=str(dev), config=cfg)
    d2.wait_ready()
    assert os.stat(os.path.join(spec_dir, SPEC)).st_ino == before  # kept: it is as it should be
    assert cdi_files.resolvable(spec_dir) == {"ate.dev/kvm=kvm"}
    assert kubelet.wait_connected(KVM), d2.log()
    assert answer(kubelet, KVM, ["kvm-0"]) == (["ate.dev/kvm=kvm"], [])


@root_only
def test_pattern_units_are_a_device_each_with_their_companions(start_daemon, kubelet, tmp_path):
    dev = tmp_path / "devroot"
    mknod(dev, "vfio/vfio", 10, 196)
    for i in (12, 13):
        mknod(dev, f"vfio/{i}", 243, i - 12)
    spec_dir = str(tmp_path / "cdi")
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, spec_dir, devices=(
        '[[device]]\nresource = "ate.dev/vfio"\npath = "/dev/vfio/[0-9]*"\ncompanions = ["/dev/vfio/vfio"]\n')))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/vfio"), d.log()
    assert kubelet.wait(lambda: len(kubelet.devices("ate.dev/vfio")) == 2, 5)
    names, specs = answer(kubelet, "ate.dev/vfio", ["vfio-13", "vfio-12", "vfio-13"])
    assert names == ["ate.dev/vfio=vfio-13", "ate.dev/vfio=vfio-12"]
    assert specs == [("/dev/vfio/13", "/dev/vfio/13", "rw"), ("/dev/vfio/12", "/dev/vfio/12", "rw"),
                     ("/dev/vfio/vfio", "/dev/vfio/vfio", "rw")]
    doc = spec_doc(spec_dir, "atedevd-ate.dev_vfio.json")
    assert [(e["name"], [(n["path"], n["major"], n["minor"]) for n in e["containerEdits"]["deviceNodes"]])
            for e in doc["devices"]] == [("vfio-12", [("/dev/vfio/12", 243, 0), ("/dev/vfio/vfio", 10, 196)]),
                                         ("vfio-13", [("/dev/vfio/13", 243, 1), ("/dev/vfio/vfio", 10, 196)])]
    os.unlink(dev / "vfio" / "13")  # unplugged: Unhealthy, and its name still resolves
    assert kubelet.wait(lambda: kubelet.devices("ate.dev/vfio").get("vfio-13") == "Unhealthy", 5), d.log()
    assert cdi_files.resolvable(spec_dir) == {"ate.dev/vfio=vfio-12", "ate.dev/vfio=vfio-13"}
    mknod(dev, "vfio/14", 243, 2)
    assert kubelet.wait(lambda: kubelet.devices("ate.dev/vfio").get("vfio-14") == "Healthy", 5), d.log()
    assert "ate.dev/vfio=vfio-14" in cdi_files.resolvable(spec_dir)  # on disk before kubelet had the ID
    assert answer(kubelet, "ate.dev/vfio", ["vfio-14"])[0] == ["ate.dev/vfio=vfio-14"]


@root_only
def test_a_spec_directory_it_cannot_write_leaves_answers_to_the_devicespec(start_daemon, kubelet, tmp_path):
    dev = tmp_path / "devroot"
    mknod(dev, "kvm", 10, 232)
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    os.chmod(spec_dir, 0o777)  # others could plant a spec: refused
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, str(spec_dir)))
    d.wait_ready()
    assert kubelet.wait_connected(KVM), d.log()
    assert answer(kubelet, KVM, ["kvm-0"]) == ([], [("/dev/kvm", "/dev/kvm", "rw")])
    assert f"cannot write CDI specs in {spec_dir}: {spec_dir} is writable by its group and others" in d.log()
    os.chmod(spec_dir, 0o755)  # fixed: written at the next try, answered from then on
    assert wait_until(lambda: os.path.exists(spec_dir / SPEC), 5), d.log()
    # answered from once the loop has taken the write in (a moment after the rename: never before it)
    assert wait_until(lambda: answer(kubelet, KVM, ["kvm-0"])[0] == ["ate.dev/kvm=kvm"], 5), d.log()
    assert f"{KVM}: CDI spec written to {spec_dir}" in d.log()


# --- host_mode -------------------------------------------------------------------------------------------

@root_only
def test_host_mode_widens_a_pattern_match_but_never_one_the_policy_refuses(tmp_path):
    from atedevd.config import Device
    from atedevd.devices.host_mode import HostMode
    from atedevd.glue.resource import node_table

    dev = tmp_path / "dev"
    good = mknod(dev, "x0", 188, 0)
    bad = mknod(dev, "x1", 1, 1)  # /dev/mem's numbers under another name
    said = []
    device = Device("ate.dev/x", "/dev/x*", allow_host_access=True, host_mode=0o666)
    table = node_table(device, str(dev), str(tmp_path / "nosys"))
    table.look()
    keeper = HostMode(device, "/sys", lambda level, kind, text, **kw: said.append((kind, text)))
    keeper.keep(table.kept())  # what the table judged: the opted-in /dev/mem is served, never widened
    assert (os.stat(good).st_mode & 0o7777, os.stat(bad).st_mode & 0o7777) == (0o666, 0o600)
    assert [k for k, _ in said] == ["host-mode"] and f"{good} was 0600; keeping it at 0666 (host_mode)" in said[0][1]
    said.clear()
    keeper.keep(table.kept())  # as it should be: nothing done
    assert said == []
    os.chmod(good, 0o600)
    os.unlink(good)
    replaced = mknod(dev, "x0", 202, 0)  # udev made another node there since the table judged it: an MSR's numbers
    keeper.keep(table.kept())
    assert stat.S_IMODE(os.stat(replaced).st_mode) == 0o600 and said == []  # not the node judged: left alone


@root_only
def test_cdi_turned_on_and_off_by_reload_for_an_unchanged_device(start_daemon, kubelet, tmp_path):
    dev = tmp_path / "devroot"
    mknod(dev, "kvm", 10, 232)
    spec_dir = tmp_path / "cdi"
    config = write(tmp_path / "c.toml", f'[daemon]\ncdi_spec_dir = "{spec_dir}"\n')
    d = start_daemon(dev_root=str(dev), config=config)
    d.wait_ready()
    assert kubelet.wait_connected(KVM), d.log()
    assert answer(kubelet, KVM, ["kvm-0"])[0] == [] and not spec_dir.exists()

    def reload(text):
        write(tmp_path / "c.toml", text)
        n = len(d.notify.messages)
        d.send(signal.SIGHUP)
        assert d.notify.wait_for("READY", "1", timeout=5, after=n), d.log()

    reload(f'[daemon]\ncdi = true\ncdi_spec_dir = "{spec_dir}"\n')
    assert answer(kubelet, KVM, ["kvm-0"])[0] == ["ate.dev/kvm=kvm"]  # the device did not change: written all the same
    assert cdi_files.resolvable(str(spec_dir)) == {"ate.dev/kvm=kvm"}
    moved = tmp_path / "cdi2"
    reload(f'[daemon]\ncdi = true\ncdi_spec_dir = "{moved}"\n')
    assert cdi_files.resolvable(str(moved)) == {"ate.dev/kvm=kvm"} and os.listdir(spec_dir) == []
    reload(f'[daemon]\ncdi_spec_dir = "{moved}"\n')  # off: no more names; the spec stays
    assert answer(kubelet, KVM, ["kvm-0"]) == ([], [("/dev/kvm", "/dev/kvm", "rw")])
    assert cdi_files.resolvable(str(moved)) == {"ate.dev/kvm=kvm"}
    assert d.stop() == 0
    assert cdi_files.resolvable(str(moved)) == {"ate.dev/kvm=kvm"}  # and after the stop
