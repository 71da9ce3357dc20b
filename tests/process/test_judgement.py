"""A grant carries exactly the node that was judged, under a name only it has (issue: CDI specs,
device directories, the configuration file and `check`, held under udev and a hostile user).

Each case as the daemon runs, a process against the kubelet stand-in, nodes made with mknod under
a private dev root; udev's habits played by a thread that remakes nodes and retargets links as
fast as it can; the attacker's steps as `nobody`; podman with runc as the CDI consumer where the
question is what a container gets:

1. the numbers a CDI spec gives a unit are the ones its judgement saw (a node swapped for a
   refused one, a by-id link moved onto another unit's node, between the look and the write);
2. two unit IDs never share a CDI name (`ttyUSB-` and `ttyUSB.bcef8d8415` once did);
3. the spec directory is watched: another program's spec of our kind, our spec deleted, the
   directory made writable by others;
4. a stop leaves every checkpointed name resolvable;
5. a pattern's directory a user owns is refused, at start, on reload and when it appears;
6. a reload racing an in-place rewrite of the configuration applies no partial file;
7. `check` judges per runtime and reads every runtime file as the configuration is read;
8. a claimed node costs nothing while nothing changes (in-process: judgements counted);
9. UIO nodes are refused by the policy.
"""

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from atedevd.cdi import files as cdi_files
from atedevd.config_file.load import SETTLE_S
from atedevd.glue.resource import LOOK_EVERY_S
from rig.harness import REPO, wait_until, write_file
from rig.nodes import fake_sysfs, mknod
from tests.runtime import oci_runtime

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="mknod, chown and podman need root (CI runs as root)")]
needs_podman = pytest.mark.skipif(oci_runtime.missing() is not None, reason=str(oci_runtime.missing()))

NOBODY = 65534
MSR = (202, 0)  # a CPU's model-specific registers: refused by the policy
KEEP_S = 3 * 2.0  # three times the spec directory's look (cdi_keeper.LOOK_EVERY_S)


def reload(d, timeout=10.0):
    n = len(d.notify.messages)
    d.send(signal.SIGHUP)
    assert d.notify.wait_for("READY", "1", timeout=timeout, after=n), d.log()


def _beside(path):
    """A name beside `path` that no pattern matches (a leading dot), for udev's rename over it."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".udev-{name}")


def remake(path, major, minor):
    """udev's way: a new node made beside the old and renamed over it (a new inode, atomically)."""
    tmp = _beside(path)
    os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    os.rename(tmp, path)


def relink(path, target):
    tmp = _beside(path)
    os.symlink(target, tmp)
    os.rename(tmp, path)


class SpecSampler(threading.Thread):
    """Reads the spec file as fast as it can and keeps every (name, numbers of its first node) it saw."""

    def __init__(self, path):
        super().__init__(daemon=True)
        self.path, self.seen, self.stop, self.reads = path, set(), threading.Event(), 0

    def run(self):
        while not self.stop.is_set():
            time.sleep(0.0005)  # (the GIL for the churn beside it: udev is quick)
            try:
                with open(self.path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            self.reads += 1
            for d in doc["devices"]:
                node = d["containerEdits"]["deviceNodes"][0]
                self.seen.add((d["name"], node["major"], node["minor"]))

    def numbers(self, name):
        return {(ma, mi) for n, ma, mi in self.seen if n == name}


def sampled(watch: SpecSampler) -> None:
    """Two more whole reads of the spec (one begun after now), then the sampler stops."""
    reads = watch.reads
    assert wait_until(lambda: watch.reads >= reads + 2, 10), watch.reads
    watch.stop.set()
    watch.join()


def cdi_config(tmp_path, spec_dir, devices):
    return write_file(tmp_path / "c.toml", f'[daemon]\ncdi = true\ncdi_spec_dir = "{spec_dir}"\n{devices}')


def in_container(tmp_path, spec_dir, names, path, dev_root):
    """What a container made by podman + runc with these CDI names (as kubelet hands them to the runtime)
    finds at `path`: (major, minor), or the runtime's refusal."""
    node = mknod(tmp_path / "probe-dev", "kvm", 10, 232)  # what oci_runtime binds over the host's /dev/kvm
    args = [a for n in names for a in ("--device", n)]
    try:
        seen = oci_runtime.run("runc", str(spec_dir), node, args, paths=(path,))
    except AssertionError as e:
        return f"refused: {e}"
    return seen["stat"][3:] if seen["stat"] else None


# --- 1. one judgement, one set of numbers ----------------------------------------------------------


@needs_podman
def test_a_units_cdi_spec_never_names_a_node_its_judgement_did_not_see(start_daemon, kubelet, tmp_path):
    """udev remakes a pattern's nodes as fast as it can, and swaps the first unit's node for an MSR
    between looks: the spec names that unit with its own numbers only, ever; a container given its
    name after the churn gets that node or nothing."""
    dev = tmp_path / "devroot"
    for i in range(120):
        mknod(dev, f"ttyX{i:03}", 188, i)
    spec_dir = tmp_path / "cdi"
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, spec_dir,
                     '[[device]]\nresource = "ate.dev/x"\npath = "/dev/ttyX[0-9]*"\n'))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/x"), d.log()
    watch = SpecSampler(str(spec_dir / "atedevd-ate.dev_x.json"))
    watch.start()
    stop = time.monotonic() + 8.0
    swaps = 0
    while time.monotonic() < stop and watch.numbers("ttyX000") <= {(188, 0)}:  # (on until a wrong one shows)
        remake(str(dev / "ttyX000"), *(MSR if swaps % 2 else (188, 0)))
        swaps += 1
        for i in range(1, 120, 7):  # the others made anew too: each look judges many
            remake(str(dev / f"ttyX{i:03}"), 188, i)
    remake(str(dev / "ttyX000"), *MSR)  # it ends refused, as the churn left it
    assert kubelet.devices("ate.dev/x").get("ttyX119") == "Healthy", kubelet.devices("ate.dev/x")
    os.unlink(dev / "ttyX119")  # then a node the churn never touched goes: kubelet sees it go once the
    # daemon has taken in everything before it (one inotify queue, read in order), the last remake too
    assert kubelet.wait(lambda: kubelet.devices("ate.dev/x").get("ttyX119") != "Healthy", KEEP_S), d.log()
    sampled(watch)
    assert watch.reads > 100 and swaps > 100 or watch.numbers("ttyX000") - {(188, 0)}, (watch.reads, swaps)
    assert watch.numbers("ttyX000") == {(188, 0)}, watch.numbers("ttyX000")
    assert kubelet.wait(lambda: kubelet.devices("ate.dev/x").get("ttyX000") == "Unhealthy", 10), d.log()
    got = in_container(tmp_path, spec_dir, ["ate.dev/x=ttyX000"], "/dev/ttyX000", str(dev))
    assert got in ((188, 0),) or str(got).startswith("refused"), got


def test_a_link_moved_onto_another_units_node_never_puts_that_node_under_its_name(start_daemon, kubelet, tmp_path):
    """udev's own move: a by-id link retargeted from its adapter to another's, and back, as fast as
    it can: unit a's spec entry names a's node only, never b's (one exclusive node, two containers)."""
    dev = tmp_path / "devroot"
    mknod(dev, "ttyA", 188, 1)
    mknod(dev, "ttyB", 188, 2)
    by_id = dev / "serial" / "by-id"
    by_id.mkdir(parents=True)
    for i in range(60):
        mknod(dev, f"ttyZ{i}", 189, i)
        os.symlink(f"../../ttyZ{i}", by_id / f"usb-z{i}")
    os.symlink("../../ttyA", by_id / "usb-a")
    os.symlink("../../ttyB", by_id / "usb-b")
    spec_dir = tmp_path / "cdi"
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, spec_dir,  # (host_mode: each look does more)
                     '[[device]]\nresource = "ate.dev/serial"\npath = "/dev/serial/by-id/*"\nhost_mode = 0o666\n'))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/serial"), d.log()
    watch = SpecSampler(str(spec_dir / "atedevd-ate.dev_serial.json"))
    watch.start()
    stop, moves = time.monotonic() + 12.0, 0
    while time.monotonic() < stop and watch.numbers("serial-by-id-usb-a") <= {(188, 1)}:  # (on until a wrong one shows)
        relink(str(by_id / "usb-a"), "../../ttyB" if moves % 2 else "../../ttyA")
        moves += 1
        for i in range(moves % 3, 60, 3):
            remake(str(dev / f"ttyZ{i}"), 189, i)  # the other adapters' nodes made anew: each look judges many
    relink(str(by_id / "usb-a"), "../../ttyA")
    assert kubelet.devices("ate.dev/serial").get("serial-by-id-usb-z0") == "Healthy", kubelet.devices("ate.dev/serial")
    os.unlink(by_id / "usb-z0")  # then a link the churn never touched goes: kubelet sees it go once the
    # daemon has taken in everything before it (one inotify queue, read in order), the last move too
    assert kubelet.wait(lambda: kubelet.devices("ate.dev/serial").get("serial-by-id-usb-z0") != "Healthy", KEEP_S), \
        d.log()
    sampled(watch)
    assert watch.reads > 100 and moves > 100 or watch.numbers("serial-by-id-usb-a") - {(188, 1)}, (watch.reads, moves)
    assert watch.numbers("serial-by-id-usb-a") == {(188, 1)}, watch.numbers("serial-by-id-usb-a")
    assert watch.numbers("serial-by-id-usb-b") == {(188, 2)}, watch.numbers("serial-by-id-usb-b")


# --- 2. a name only it has -------------------------------------------------------------------------


@needs_podman
def test_two_units_whose_ids_once_shared_a_cdi_name_each_get_their_own_node(start_daemon, kubelet, tmp_path):
    """`ttyUSB-` is no valid CDI name and was written `ttyUSB.` + 10 hex digits of its hash, which is
    `ttyUSB.bcef8d8415`, a valid ID of its own: one device in the spec for both units."""
    dev = tmp_path / "devroot"
    mknod(dev, "ttyUSB-", 188, 1)
    mknod(dev, "ttyUSB.bcef8d8415", 188, 2)
    spec_dir = tmp_path / "cdi"
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, spec_dir,
                     '[[device]]\nresource = "ate.dev/serial"\npath = "/dev/ttyUSB*"\n'))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/serial"), d.log()
    assert kubelet.wait(lambda: len(kubelet.devices("ate.dev/serial")) == 2, 10), d.log()
    for unit, numbers in (("ttyUSB-", (188, 1)), ("ttyUSB.bcef8d8415", (188, 2))):
        answer = kubelet.allocate("ate.dev/serial", [unit]).container_responses[0]
        names = [c.name for c in answer.cdi_devices]
        assert len(names) == 1, names
        assert in_container(tmp_path, spec_dir, names, f"/dev/{unit}", str(dev)) == numbers, (unit, names)
    doc = json.load(open(spec_dir / "atedevd-ate.dev_serial.json"))
    assert len(doc["devices"]) == 2


# --- 3. the spec directory is watched --------------------------------------------------------------


def _kvm(tmp_path):
    dev = tmp_path / "devroot"
    mknod(dev, "kvm", 10, 232)
    return dev


def test_another_programs_spec_of_our_kind_is_named_and_its_names_never_answered(start_daemon, kubelet, tmp_path,
                                                                                    plugin_dir):
    dev, spec_dir = _kvm(tmp_path), tmp_path / "cdi"
    cfg = cdi_config(tmp_path, spec_dir, "")
    d = start_daemon(dev_root=str(dev), config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    names = lambda: [c.name for c in kubelet.allocate("ate.dev/kvm", ["kvm-0"]).container_responses[0].cdi_devices]  # noqa: E731
    assert names() == ["ate.dev/kvm=kvm"]
    theirs = write_file(spec_dir / "vendor.json", json.dumps({"cdiVersion": "0.5.0", "kind": "ate.dev/kvm", "devices": [
        {"name": "kvm", "containerEdits": {"deviceNodes": [{"path": "/dev/kvm", "type": "c", "major": 1, "minor": 1}]}}]}))
    assert "ate.dev/kvm=kvm" not in cdi_files.resolvable(str(spec_dir))  # defined twice: the runtime resolves nothing
    assert wait_until(lambda: names() == [], KEEP_S), d.log()  # never answered while it does not resolve
    assert f"{theirs} defines CDI kind ate.dev/kvm" in d.log()
    out = subprocess.run([sys.executable, "-m", "atedevd", "check", "--json", "--config", cfg, "--dev-root", str(dev),
                          "--device-plugin-dir", plugin_dir], cwd=REPO, capture_output=True, text=True, timeout=60)
    found = [f for f in json.loads(out.stdout)["findings"] if f["subject"] == theirs]
    assert found and found[0]["status"] == "problem" and "defines CDI kind ate.dev/kvm" in found[0]["message"], out.stdout
    os.unlink(theirs)
    assert wait_until(lambda: names() == ["ate.dev/kvm=kvm"], KEEP_S), d.log()


def test_our_spec_removed_or_rewritten_by_someone_else_is_written_again(start_daemon, kubelet, tmp_path):
    dev, spec_dir = _kvm(tmp_path), tmp_path / "cdi"
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, spec_dir, ""))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    spec = spec_dir / "atedevd-ate.dev_kvm.json"
    os.unlink(spec)
    assert wait_until(lambda: cdi_files.resolvable(str(spec_dir)) == {"ate.dev/kvm=kvm"}, KEEP_S), d.log()
    spec.write_text('{"cdiVersion": "0.3.0", "kind": "ate.dev/kvm", "devices": []}')  # rewritten in place
    assert wait_until(lambda: cdi_files.resolvable(str(spec_dir)) == {"ate.dev/kvm=kvm"}, KEEP_S), d.log()
    assert "was removed by someone else; writing it again" in d.log()
    assert "was replaced or rewritten by someone else; writing it again" in d.log()


def test_a_spec_directory_made_writable_by_others_stops_the_cdi_names(start_daemon, kubelet, tmp_path):
    dev, spec_dir = _kvm(tmp_path), tmp_path / "cdi"
    d = start_daemon(dev_root=str(dev), config=cdi_config(tmp_path, spec_dir, ""))
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    answer = lambda: kubelet.allocate("ate.dev/kvm", ["kvm-0"]).container_responses[0]  # noqa: E731
    assert [c.name for c in answer().cdi_devices] == ["ate.dev/kvm=kvm"]
    os.chmod(spec_dir, 0o777)
    assert wait_until(lambda: list(answer().cdi_devices) == [], KEEP_S), d.log()
    assert [s.host_path for s in answer().devices] == ["/dev/kvm"]  # the DeviceSpec alone, as the ERROR says
    assert f"{spec_dir} is not trusted: {spec_dir} is writable by its group and others" in d.log()
    os.chmod(spec_dir, 0o755)
    assert wait_until(lambda: [c.name for c in answer().cdi_devices] == ["ate.dev/kvm=kvm"], KEEP_S), d.log()


# --- 4. specs survive a stop -----------------------------------------------------------------------


@needs_podman
def test_a_stop_and_a_restart_leave_every_checkpointed_name_resolvable(start_daemon, kubelet, tmp_path):
    """kubelet replays a container's checkpointed answer whenever it starts it again, atedevd there
    or not: the name resolves while atedevd is stopped, restarts, and after."""
    dev, spec_dir = _kvm(tmp_path), tmp_path / "cdi"
    cfg = cdi_config(tmp_path, spec_dir, "")
    d = start_daemon(dev_root=str(dev), config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    names = [c.name for c in kubelet.allocate("ate.dev/kvm", ["kvm-0"]).container_responses[0].cdi_devices]
    assert names == ["ate.dev/kvm=kvm"]
    assert d.stop() == 0  # systemctl stop: SIGTERM
    assert cdi_files.resolvable(str(spec_dir)) == {"ate.dev/kvm=kvm"}
    assert in_container(tmp_path, spec_dir, names, "/dev/kvm", str(dev)) == (10, 232)  # replayed while stopped
    seen, gone = threading.Event(), []

    def look():
        while not seen.is_set():
            if "ate.dev/kvm=kvm" not in cdi_files.resolvable(str(spec_dir)):
                gone.append(time.monotonic())
            time.sleep(0.001)
    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    d2 = start_daemon(dev_root=str(dev), config=cfg)
    d2.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d2.log()
    d2.send(signal.SIGKILL)  # and a crash
    d2.wait()
    d3 = start_daemon(dev_root=str(dev), config=cfg)
    d3.wait_ready()
    seen.set()
    looker.join()
    assert gone == []  # not for a moment
    assert in_container(tmp_path, spec_dir, names, "/dev/kvm", str(dev)) == (10, 232)


def test_a_spec_goes_when_its_resource_leaves_the_configuration(start_daemon, kubelet, tmp_path):
    dev, spec_dir = _kvm(tmp_path), tmp_path / "cdi"
    mknod(dev, "ttyUSB0", 188, 0)
    serial = '[[device]]\nresource = "ate.dev/serial"\npath = "/dev/ttyUSB*"\n'
    kvm = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
    cfg = cdi_config(tmp_path, spec_dir, kvm + serial)
    d = start_daemon(dev_root=str(dev), config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/serial"), d.log()
    assert (spec_dir / "atedevd-ate.dev_serial.json").exists()
    cdi_config(tmp_path, spec_dir, kvm)
    reload(d)
    assert wait_until(lambda: not (spec_dir / "atedevd-ate.dev_serial.json").exists(), 15), d.log()  # once kubelet let go
    assert d.stop() == 0
    cdi_config(tmp_path, spec_dir, serial)  # and at a start whose configuration lacks it
    d = start_daemon(dev_root=str(dev), config=cfg)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/serial"), d.log()
    assert wait_until(lambda: not (spec_dir / "atedevd-ate.dev_kvm.json").exists(), 5), d.log()


# --- 5. device directories judged like the configuration's -------------------------------------------


def _nobodys(path):
    os.makedirs(path, mode=0o755)
    os.chown(path, NOBODY, NOBODY)
    return str(path)


def as_nobody(code):
    subprocess.run([sys.executable, "-c", code], user=NOBODY, group=NOBODY, check=True, cwd="/")


@pytest.fixture
def place():
    """A directory every user can reach (pytest's tmp_path is root's alone), root's, 0755."""
    root = tempfile.mkdtemp(prefix="atedevd-judged-", dir="/tmp")
    os.chmod(root, 0o755)
    yield root
    subprocess.run(["rm", "-rf", root])


def test_a_pattern_directory_a_user_owns_is_refused_at_start_on_reload_and_when_it_appears(start_daemon, kubelet,
                                                                                          tmp_path, place):
    """With host_mode, the user's links would choose which allowed host nodes become 0666 and are
    served: a keyboard's event node here."""
    dev = os.path.join(place, "dev")
    os.makedirs(dev, mode=0o755)
    mknod(dev, "kvm", 10, 232)
    event = mknod(dev, "input/event0", 13, 64)  # a keyboard: keystrokes
    mine = _nobodys(os.path.join(dev, "mine"))
    as_nobody(f"import os; os.symlink('../input/event0', {mine + '/kbd'!r})")
    table = '[[device]]\nresource = "ate.dev/mine"\npath = "/dev/mine/*"\nhost_mode = 0o666\n'
    cfg = write_file(tmp_path / "c.toml", table)
    d = start_daemon(dev_root=dev, config=cfg)
    assert d.wait(10) == 78, d.log()  # at start: the configuration is refused, with the path, the owner and the fix
    assert f"not trusted: {mine} is owned by nobody (owner nobody:nogroup, mode 0755), not root: chown root {mine}" in d.log()
    assert stat.S_IMODE(os.stat(event).st_mode) == 0o600
    write_file(cfg, "")
    d = start_daemon(dev_root=dev, config=cfg, env={"WATCHDOG_USEC": "200000"})  # (its pings show its loop's turns)
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/kvm"), d.log()
    write_file(cfg, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n' + table)
    reload(d)  # on reload: refused whole, the running configuration kept
    assert "reload failed" in (d.status() or "") and f"chown root {mine}" in d.log(), d.log()
    os.chown(mine, 0, 0)
    os.lchown(os.path.join(mine, "kbd"), 0, 0)  # the directory and its link root's now (a link is as trusted as its owner)
    reload(d)  # accepted, and host_mode keeps the node it judged
    assert kubelet.wait_connected("ate.dev/mine"), d.log()
    assert kubelet.wait(lambda: kubelet.devices("ate.dev/mine") == {"mine-kbd": "Healthy"}, KEEP_S), d.log()
    assert wait_until(lambda: stat.S_IMODE(os.stat(event).st_mode) == 0o666, KEEP_S), d.log()
    os.chown(mine, NOBODY, NOBODY)  # then given to a user while atedevd runs: nothing at the node says so
    assert kubelet.wait(lambda: kubelet.devices("ate.dev/mine") == {"mine-kbd": "Unhealthy"}, KEEP_S), d.log()
    assert "device-untrusted" in d.log() or f"/dev/mine/kbd: not trusted: {mine} is owned by nobody" in d.log(), d.log()
    as_nobody(f"import os; os.symlink('../input/event0', {mine + '/kbd2'!r})")
    os.chmod(event, 0o600)  # udev puts the mode back: host_mode no longer widens a node it did not judge present
    # Both are events (mine/ and input/ are watched), taken in at the next turns; and a periodic
    # look (every LOOK_EVERY_S) due after them has been taken once two whole turns begun after it are.
    look_due = time.monotonic() + LOOK_EVERY_S
    time.sleep(LOOK_EVERY_S)
    assert d.notify.wait_turns(2, since=look_due), d.log()
    assert stat.S_IMODE(os.stat(event).st_mode) == 0o600, d.log()
    assert "mine-kbd2" not in kubelet.devices("ate.dev/mine"), kubelet.devices("ate.dev/mine")


# --- 6. the configuration read whole -----------------------------------------------------------------


def test_a_reload_racing_an_in_place_rewrite_applies_no_partial_file(start_daemon, kubelet, tmp_path):
    """A writer rewrites the configuration in place (truncated, then written in two parts 5 ms apart),
    over and over, while reloads come: no reload ever drops a configured resource or serves the
    built-in /dev/kvm (what an empty read is). A file left partial for SETTLE_S or more is, by the
    reader's rule, one a user wrote: where a starved writer did that (a busy machine), only the
    end state is held, each window's length printed."""
    dev = str(tmp_path / "devroot")
    for n in ("a", "b", "c"):
        mknod(dev, n, 1, {"a": 3, "b": 5, "c": 7}[n])
    text = "".join(f'[[device]]\nresource = "ate.dev/{n}"\npath = "/dev/{n}"\n' for n in ("a", "b", "c"))
    cfg = write_file(tmp_path / "c.toml", text)
    d = start_daemon(dev_root=dev, config=cfg)
    d.wait_ready()
    for n in ("a", "b", "c"):
        assert kubelet.wait_connected(f"ate.dev/{n}"), d.log()
    stop = threading.Event()
    partial = []  # how long each rewrite left the file partial, as the writer saw it (an upper bound)

    def writer():
        n = 0
        while not stop.is_set():
            began = time.monotonic()
            with open(cfg, "w") as f:  # truncated: empty for a moment
                f.write(text[:len(text) * 2 // 3])
                f.flush()
                time.sleep(0.005)
                f.write(text[len(text) * 2 // 3:])
            partial.append(time.monotonic() - began)
            n += 1
            time.sleep(0.2 if n % 4 == 0 else 0.02)  # now and then a pause in which a reload can read it whole
    w = threading.Thread(target=writer, daemon=True)
    w.start()
    try:
        for _ in range(25):
            reload(d, timeout=15)
    finally:
        stop.set()
        w.join()
    starved = [round(p * 1000, 1) for p in partial if p >= SETTLE_S]
    print(f"\n{len(partial)} rewrites, each partial for at most {max(partial) * 1000:.1f} ms; "
          f"{len(starved)} for SETTLE_S ({SETTLE_S * 1000:g} ms) or more: {starved}")
    log = d.log()
    if not starved:
        assert "resource-removed" not in log and "no longer configured" not in log, log
        assert kubelet.registration_count("ate.dev/kvm") == 0, log
    reload(d, timeout=15)  # the file whole: what is served is what it says, however the race went
    assert d.log().rsplit("configuration reloaded: ", 1)[1].split("\n", 1)[0] == \
        "ate.dev/a (/dev/a), ate.dev/b (/dev/b), ate.dev/c (/dev/c)", d.log()
    for n in ("a", "b", "c"):
        assert kubelet.wait_connected(f"ate.dev/{n}"), d.log()


# --- 7. check judges per runtime, and reads every runtime file safely ----------------------------------


def check_with_containerd(tmp_path, config_toml=None, fifo=False, link=None, version=None):
    """`atedevd check --json` as a process, in a mount namespace where /etc/containerd is the test's."""
    etc = tmp_path / "etc-containerd"
    etc.mkdir(exist_ok=True)
    conf = etc / "config.toml"
    if fifo:
        os.mkfifo(conf)
    elif link:
        os.symlink(link, conf)
    else:
        conf.write_text(config_toml)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if version:
        write_file(bin_dir / "containerd", f"#!/bin/sh\necho 'containerd github.com/containerd/containerd v{version} x'\n", 0o755)
    node = mknod(tmp_path / "devroot", "kvm", 10, 232)
    os.chmod(node, 0o660)
    (tmp_path / "dp").mkdir(exist_ok=True)
    cfg = write_file(tmp_path / "c.toml", '[daemon]\ncdi = true\n')
    made = not os.path.exists("/etc/containerd")
    os.makedirs("/etc/containerd", exist_ok=True)
    try:
        script = (f"mount --bind {etc} /etc/containerd && exec {sys.executable} -m atedevd check --json --config {cfg} "
                  f"--dev-root {tmp_path / 'devroot'} --device-plugin-dir {tmp_path / 'dp'}")
        env = dict(os.environ, PATH=f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", PYTHONPATH=REPO)
        done = subprocess.run(["prlimit", "--as=1000000000", "unshare", "--mount", "--propagation", "private", "sh",
                               "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30, env=env)
    finally:
        if made:
            os.rmdir("/etc/containerd")
    assert "Traceback" not in done.stderr, done.stderr
    doc = json.loads(done.stdout)
    return {p["kind"]: p for p in doc["devices"][0]["pods"]}, doc


def test_check_says_no_for_cdi_on_containerd_1_7_as_shipped(tmp_path):
    kinds, _ = check_with_containerd(tmp_path, 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n', version="1.7.24")
    cdi = kinds["non-root-cdi"]
    assert cdi["opens"] == "no" and "containerd 1.7.24 does not honour CDI names unless enable_cdi = true" in cdi["why"]
    kinds, _ = check_with_containerd(tmp_path, 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n', version="2.2.9")
    assert kinds["non-root-cdi"]["opens"] == "yes"  # 2.x honours them unless told not to


def test_check_follows_crun_named_by_binary_and_never_asks_for_a_0666_host_node_it_does_not_need(tmp_path):
    conf = ('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = true\n'
            '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\nBinaryName = "/usr/bin/crun"\n')
    kinds, _ = check_with_containerd(tmp_path, conf, version="1.7.24")
    userns = kinds["user-namespace"]
    assert userns["opens"] == "yes" and "runs crun, which makes the node in the user namespace itself" in userns["why"]
    assert userns["fix"] is None  # no host_mode = 0o666 recommended


@pytest.mark.parametrize("how", ["fifo", "link to /dev/zero", "wrong types"])
def test_a_runtime_file_that_cannot_be_read_is_a_finding_never_a_hang_or_a_traceback(tmp_path, how):
    kw = {"fifo": {"fifo": True}, "link to /dev/zero": {"link": "/dev/zero"},
          "wrong types": {"config_toml": 'version = 2\nplugins = 3\n'}}[how]
    kinds, doc = check_with_containerd(tmp_path, **kw)
    found = [f for f in doc["findings"] if f["check"] == "runtime"]
    assert found and found[0]["status"] == "warning", doc["findings"]
    assert ("not a regular file" if how != "wrong types" else "plugins is a int, not a table") in found[0]["message"]


# --- 8. a claimed node costs nothing while nothing changes ---------------------------------------------


def test_claimed_nodes_are_not_judged_again_while_nothing_changes(tmp_path, monkeypatch):
    """Two patterns over the same 300 nodes: after the first judgements, looks with nothing changed
    judge nothing (make bench's `overlap` prints the idle CPU it means: under 1 % of a core)."""
    from atedevd.config import Device
    from atedevd.devices import policy
    from atedevd.devices.claims import Claims
    from atedevd.glue.resource import node_table

    dev = tmp_path / "dev"
    for i in range(300):
        mknod(dev, f"ttyC{i}", 188, i)
    devs = [Device("a.dev/one", "/dev/ttyC*"), Device("a.dev/two", "/dev/ttyC[0-9]*")]
    poked = set()
    claims = Claims(poked.add)
    claims.configure(devs, str(dev))
    tables = {d.resource: node_table(d, str(dev), str(tmp_path / "sys"), claims) for d in devs}
    for _ in range(3):
        for t in tables.values():
            t.look()
    judged = []  # every node judged in full looks at it through the policy
    real = policy.look
    monkeypatch.setattr(policy, "look", lambda *a, **kw: judged.append(a) or real(*a, **kw))
    time.sleep(0.1)  # (beyond the racy window of the directories' mtimes)
    for _ in range(20):
        for t in tables.values():
            t.look()
    assert judged == [] and not any(t.healthy for t in tables.values())  # claimed by both, served by neither
    os.unlink(dev / "ttyC7")  # a change: the node it concerns is judged, in both, and nothing else
    for t in tables.values():
        t.look()
    assert len(judged) <= 4, len(judged)


# --- 9. UIO ---------------------------------------------------------------------------------------------


def test_a_uio_node_is_refused_and_never_a_unit(start_daemon, kubelet, tmp_path):
    dev = str(tmp_path / "devroot")
    mknod(dev, "uio0", 240, 0)
    mknod(dev, "ttyS4", 4, 68)
    sys_root = fake_sysfs(str(tmp_path / "sys"), "char", 240, 0, "uio", "uio0")
    cfg = write_file(tmp_path / "c.toml", '[[device]]\nresource = "ate.dev/all"\npath = "/dev/[tu]*"\n')
    d = start_daemon(dev_root=dev, config=cfg, extra_args=["--sys-root", sys_root])
    d.wait_ready()
    assert kubelet.wait_connected("ate.dev/all"), d.log()
    assert kubelet.wait(lambda: set(kubelet.devices("ate.dev/all")) == {"ttyS4"}, 10), (kubelet.devices("ate.dev/all"), d.log())
    assert "/dev/uio0: refused: " in d.log() and "a userspace I/O device" in d.log()
