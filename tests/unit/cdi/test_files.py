"""CDI spec files on disk (atedevd/cdi/files.py) and the daemon's keeper over them
(atedevd/cdi/keeper.py): written whole, never through a planted link, read back as a runtime would."""

import json
import os
import stat

import pytest

from atedevd.cdi import files as cdi_files
from atedevd.devices import shared
from rig.harness import write_file
from rig.nodes import mknod

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and root-owned directories need root (CI runs as root)")

KVM = "ate.dev/kvm"
SPEC = "atedevd-ate.dev_kvm.json"


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
        write_file(tmp_path / name, json.dumps({"cdiVersion": version, "kind": kind, "devices": [
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
