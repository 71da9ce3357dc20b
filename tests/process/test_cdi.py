"""CDI grants, the daemon as a process answering Allocate with CDI names whose spec is on disk (a shareable
device, a pattern with its companions, a reload that narrows the mode, an unplugged unit, the
stop). The same grants through a real runtime: tests/runtime/test_cdi_runtime.py."""

import json
import os
import signal

import pytest

from atedevd.cdi import files as cdi_files
from rig.harness import wait_until, write_file
from rig.nodes import mknod

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and root-owned directories need root (CI runs as root)")

KVM = "ate.dev/kvm"
SPEC = "atedevd-ate.dev_kvm.json"


# --- the daemon as a process -------------------------------------------------------------------------

def cdi_config(tmp_path, spec_dir, devices="", daemon=""):
    return write_file(tmp_path / "c.toml", f'[daemon]\ncdi = true\ncdi_spec_dir = "{spec_dir}"\n{daemon}{devices}')


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


@root_only
def test_cdi_turned_on_and_off_by_reload_for_an_unchanged_device(start_daemon, kubelet, tmp_path):
    dev = tmp_path / "devroot"
    mknod(dev, "kvm", 10, 232)
    spec_dir = tmp_path / "cdi"
    config = write_file(tmp_path / "c.toml", f'[daemon]\ncdi_spec_dir = "{spec_dir}"\n')
    d = start_daemon(dev_root=str(dev), config=config)
    d.wait_ready()
    assert kubelet.wait_connected(KVM), d.log()
    assert answer(kubelet, KVM, ["kvm-0"])[0] == [] and not spec_dir.exists()

    def reload(text):
        write_file(tmp_path / "c.toml", text)
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
