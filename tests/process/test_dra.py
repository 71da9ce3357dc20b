"""DRA mode (`[daemon] api = "dra"`), the daemon as a process, the way systemd runs it, against
the DRA side of a kubelet stand-in (rig/dra_kubelet.py) and an API server stand-in
(rig/apiserver_standin.py): registration through plugins_registry, the node's ResourceSlice
published with the node's credentials and published again after kubelet wipes it, claims
prepared from their allocation and checked, kept across a stop and a kill -9, and answered from
the checkpoint while the API server is down."""

import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

from atedevd.cdi import files as cdi_files
from atedevd.dra import checkpoint, listeners
from atedevd.dra.slices import device_name
from rig.apiserver_standin import ApiServerStandIn
from rig.dra_kubelet import DraKubelet
from rig.harness import DaemonUnderTest, FdStore, fake_dev_root, gone, wait_until, write_file

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="CDI specs are written only to a directory root alone may write")
pytestmark = root_only

NODE = "node-a"
KVM_ID = "ate.dev/kvm=kvm"


@pytest.fixture
def tmp_path():
    """A short directory: the sockets' paths must fit a unix socket's 107 bytes."""
    import pathlib

    d = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def api():
    a = ApiServerStandIn(NODE)
    yield a
    a.close()


@pytest.fixture
def node(tmp_path, api):
    """A node's directories: kubelet's root, a dev root with /dev/kvm, the CDI spec directory."""
    root = tmp_path / "kubelet"
    os.makedirs(root / "device-plugins")
    os.makedirs(tmp_path / "cdi", mode=0o755)
    fake_dev_root(str(tmp_path / "dev"), ("kvm",))
    kubelet = DraKubelet(str(root), api)
    yield kubelet
    kubelet.close()


def dra_config(tmp_path, api, extra="", devices=""):
    kubeconfig = api.kubeconfig(str(tmp_path / "kubeconfig.json"))
    return write_file(tmp_path / "c.toml", f'[daemon]\napi = "dra"\nkubeconfig = "{kubeconfig}"\n'
                                           f'cdi_spec_dir = "{tmp_path / "cdi"}"\n{extra}{devices}')


def start(tmp_path, api, **kwargs):
    return DaemonUnderTest(str(tmp_path / "run"), str(tmp_path / "kubelet" / "device-plugins"), str(tmp_path / "dev"),
                           config=kwargs.pop("config", None) or dra_config(tmp_path, api), **kwargs)


def published(api, timeout=10.0):
    assert wait_until(lambda: api.node_slices(), timeout), "no ResourceSlice published"
    return api.node_slices()


def test_registers_publishes_the_node_slice_and_prepares_a_claim_from_its_allocation(tmp_path, api, node):
    d = start(tmp_path, api)
    try:
        d.wait_ready()
        instance = node.wait_registered()
        assert instance.chosen == "v1.DRAPlugin"
        slices = published(api)
        assert len(slices) == 1
        spec = slices[0]["spec"]
        assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == ("ate.dev", NODE, NODE)
        assert spec["pool"]["resourceSliceCount"] == 1 and isinstance(spec["pool"]["generation"], int)
        assert spec["devices"] == [{"name": "kvm", "allowMultipleAllocations": True,
                                    "attributes": {"resource": {"string": "ate.dev/kvm"}, "path": {"string": "/dev/kvm"}},
                                    "capacity": {"claims": {"value": "1024", "requestPolicy": {"default": "1",
                                                                                             "validValues": ["1"]}}}}]
        assert slices[0]["metadata"]["ownerReferences"][0]["uid"] == api.node_uid

        api.add_claim("ns", "pod-a-kvm", "uid-a", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm",
                                                   "shareID": "share-1"}])
        answer = node.prepare([("ns", "pod-a-kvm", "uid-a")])
        assert answer["uid-a"].error == ""
        [device] = answer["uid-a"].devices
        assert (list(device.request_names), device.pool_name, device.device_name, list(device.cdi_device_ids),
                device.share_id) == (["kvm"], NODE, "kvm", [KVM_ID], "share-1")
        assert KVM_ID in cdi_files.resolvable(str(tmp_path / "cdi")), "the CDI name answered is not on disk"
        gets = api.claim_gets
        again = node.prepare([("ns", "pod-a-kvm", "uid-a")])  # kubelet asks again: the same answer, from the book
        assert list(again["uid-a"].devices[0].cdi_device_ids) == [KVM_ID] and api.claim_gets == gets
        doc, why = checkpoint.read(str(tmp_path / "kubelet" / "plugins" / "ate.dev"))
        assert why == "" and list(doc["claims"]) == ["uid-a"]

        assert node.unprepare([("ns", "pod-a-kvm", "uid-a")])["uid-a"].error == ""
        assert node.unprepare([("ns", "pod-a-kvm", "uid-a")])["uid-a"].error == ""  # twice: still success
        doc, _ = checkpoint.read(str(tmp_path / "kubelet" / "plugins" / "ate.dev"))
        assert doc["claims"] == {}
        assert "registered with kubelet" in d.status() and "0 claim(s) prepared" in d.status()
    finally:
        assert d.stop() == 0
    # The sockets kubelet dials stay for the next start (under systemd, held listening in its store),
    # so kubelet keeps the driver registered; this run's own gRPC socket went with it.
    assert os.listdir(tmp_path / "kubelet" / "plugins_registry") == ["ate.dev-reg.sock"]
    assert sorted(os.listdir(tmp_path / "kubelet" / "plugins" / "ate.dev")) == ["claims.json", "dra.sock"]


def test_a_claim_is_refused_with_a_reason_when_its_allocation_is_not_this_node_s(tmp_path, api, node):
    d = start(tmp_path, api)
    try:
        d.wait_ready()
        node.wait_registered()
        published(api)
        api.add_claim("ns", "remade", "uid-new", [{"request": "r", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
        api.add_claim("ns", "elsewhere", "uid-e", [{"request": "r", "driver": "ate.dev", "pool": "node-b", "device": "kvm"}])
        api.add_claim("ns", "unknown", "uid-u", [{"request": "r", "driver": "ate.dev", "pool": NODE, "device": "tun"}])
        answer = node.prepare([("ns", "remade", "uid-old"), ("ns", "elsewhere", "uid-e"), ("ns", "unknown", "uid-u"),
                               ("ns", "missing", "uid-m")])
        assert "its UID is 'uid-new'" in answer["uid-old"].error and not answer["uid-old"].devices
        assert "of pool 'node-b'" in answer["uid-e"].error
        assert "'tun' is not one this node serves" in answer["uid-u"].error
        assert "404" in answer["uid-m"].error
        doc, _ = checkpoint.read(str(tmp_path / "kubelet" / "plugins" / "ate.dev"))
        assert doc["claims"] == {}, "a refused claim was checkpointed"  # (the file holds the pool's generation)
    finally:
        d.stop()


def test_a_wiped_slice_is_published_again_with_a_higher_generation_and_nothing_churns_meanwhile(tmp_path, api, node):
    d = start(tmp_path, api)
    try:
        d.wait_ready()
        node.wait_registered()
        first = published(api)[0]["spec"]["pool"]["generation"]
        time.sleep(1.0)
        writes = len(api.writes)
        assert writes == 1, f"slices written while nothing changed: {api.writes}"
        backs = []
        for _ in range(3):
            wiped_at = time.monotonic()
            assert node.start_anew() == 1
            assert wait_until(lambda: api.node_slices(), 10.0), "the wiped slice was not published again"
            backs.append((api.writes[-1][0] - wiped_at) * 1000)
            node.wait_registered(after=wiped_at)
        generation = api.node_slices()[0]["spec"]["pool"]["generation"]
        assert generation > first
        print(f"\nslice wiped -> published again: {', '.join(f'{b:.1f}' for b in backs)} ms")
    finally:
        d.stop()
    # A new run finds the slice as it wants it (nothing written) and carries its generation on:
    # after the next wipe the pool's generation is higher than any before, never back at 1.
    writes = len(api.writes)
    d = start(tmp_path, api)
    try:
        d.wait_ready()
        assert wait_until(lambda: "device(s) published" in (d.status() or ""), 10), d.status()
        assert len(api.writes) == writes, api.writes[writes:]
        node.start_anew()
        assert wait_until(lambda: api.node_slices(), 10)
        assert api.node_slices()[0]["spec"]["pool"]["generation"] == generation + 1
    finally:
        d.stop()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_prepared_claim_is_answered_after_a_stop_or_a_kill_while_the_api_server_is_down(tmp_path, api, node, how):
    d = start(tmp_path, api)
    d.wait_ready()
    node.wait_registered()
    published(api)
    api.add_claim("ns", "c", "uid-c", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
    assert list(node.prepare([("ns", "c", "uid-c")])["uid-c"].devices[0].cdi_device_ids) == [KVM_ID]
    rc = d.stop(how)
    assert rc == (0 if how == signal.SIGTERM else -signal.SIGKILL)
    assert KVM_ID in cdi_files.resolvable(str(tmp_path / "cdi")), "the CDI spec went with the daemon"
    api.down = True
    stopped_at = time.monotonic()
    d2 = start(tmp_path, api)
    try:
        d2.wait_ready()
        node.wait_registered(after=stopped_at)
        answer = node.prepare([("ns", "c", "uid-c")])
        assert answer["uid-c"].error == "" and list(answer["uid-c"].devices[0].cdi_device_ids) == [KVM_ID]
        assert wait_until(lambda: "slices not published" in (d2.status() or ""), 10.0), d2.status()
        # A new claim needs the API server: its prepare waits for it (kubelet tries a failed prepare
        # again only a minute or more later), and is answered once the server is back.
        api.add_claim("ns", "other", "uid-o", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
        answers = {}
        asked = threading.Thread(target=lambda: answers.update(node.prepare([("ns", "other", "uid-o")])))
        asked.start()
        time.sleep(1.0)
        assert asked.is_alive(), f"answered while the API server was down: {answers}"
        api.down = False
        asked.join(40)
        assert answers["uid-o"].error == "" and list(answers["uid-o"].devices[0].cdi_device_ids) == [KVM_ID]
        assert wait_until(lambda: "device(s) published" in (d2.status() or ""), 30.0), d2.status()
        assert len(node.instances) == 1, "the killed run's instance is still registered"
    finally:
        d2.stop()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_restart_with_systemd_s_store_keeps_the_driver_registered_and_a_call_made_meanwhile_waits_for_it(
        tmp_path, api, node, how):
    """The sockets kubelet dials go to systemd's store (FDSTORE=1) and come back to the next
    start (LISTEN_FDS): kubelet never sees the driver go, and a prepare it sends while no process
    runs waits in the socket's backlog and is answered by the next one, where it would otherwise
    fail and be tried again only at the pod's next sync, a minute or more later."""
    store = FdStore()
    d = start(tmp_path, api, fd_store=store)
    try:
        d.wait_ready()
        old = node.wait_registered()
        published(api)
        inodes = {k: listeners.identity(p) for k, p in listeners.paths(str(tmp_path / "kubelet")).items()}
        assert store.names() == sorted(f"{k}.{i}" for k, i in inodes.items())
        api.add_claim("ns", "c", "uid-c", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
        api.add_claim("ns", "late", "uid-l", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
        assert node.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""
        assert d.stop(how) == (0 if how == signal.SIGTERM else -signal.SIGKILL)
        answers = {}
        asked = threading.Thread(target=lambda: answers.update(node.prepare([("ns", "late", "uid-l")])))
        asked.start()
        time.sleep(1.0)
        assert asked.is_alive(), f"answered, or failed, with no atedevd running: {answers}"
        d = start(tmp_path, api, fd_store=store)
        d.wait_ready()
        asked.join(20)
        assert answers["uid-l"].error == "" and list(answers["uid-l"].devices[0].cdi_device_ids) == [KVM_ID]
        assert node.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""
        assert node.instances == [old] and node.model.refused == [], "kubelet saw the driver go"
        assert {k: listeners.identity(p) for k, p in listeners.paths(str(tmp_path / "kubelet")).items()} == inodes
        assert "kept from the last run" in d.log()
        assert wait_until(lambda: "registered with kubelet" in (d.status() or ""), 10), d.status()  # (no new NotifyRegistrationStatus)
    finally:
        d.close()
        store.close()


def test_a_socket_someone_removed_is_bound_anew_stored_instead_and_kubelet_registers_the_driver_again(
        tmp_path, api, node):
    store = FdStore()
    d = start(tmp_path, api, fd_store=store)
    try:
        d.wait_ready()
        old = node.wait_registered()
        first = store.names()
        removed = time.monotonic()
        os.unlink(listeners.paths(str(tmp_path / "kubelet"))[listeners.REGISTRATION])
        new = node.wait_registered(after=removed)
        assert new is not old
        assert wait_until(lambda: store.names() != first and len(store.names()) == 2, 10), store.names()
        assert not set(first) & set(store.names()), "systemd still keeps the sockets that were replaced"
        api.add_claim("ns", "c", "uid-c", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
        assert node.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""
        assert "was removed or replaced by someone else; serving on new sockets" in d.log()
    finally:
        d.close()
        store.close()


def test_a_bad_api_value_is_a_configuration_error_and_no_restart_loop(tmp_path, api):
    os.makedirs(tmp_path / "kubelet" / "device-plugins")
    fake_dev_root(str(tmp_path / "dev"), ("kvm",))
    cfg = write_file(tmp_path / "bad.toml", '[daemon]\napi = "DRA"\n')
    d = start(tmp_path, api, config=cfg)
    assert d.wait(20) == 78
    assert 'api: must be "device-plugin" (the default) or "dra"' in d.log()
    d.close()


def test_a_sighup_with_a_bad_file_changes_nothing_and_a_switch_to_the_device_plugin_api_exits_for_a_restart(
        tmp_path, api, node):
    cfg = dra_config(tmp_path, api)
    d = start(tmp_path, api, config=cfg)
    try:
        d.wait_ready()
        node.wait_registered()
        with open(cfg) as f:
            good = f.read()
        write_file(cfg, good + "color = 1\n")
        d.send(signal.SIGHUP)
        assert wait_until(lambda: "configuration not applied, still serving as before" in d.log(), 10), d.log()
        assert d.proc.poll() is None and len(node.instances) == 1
        write_file(cfg, good.replace('api = "dra"', 'api = "device-plugin"'))
        d.send(signal.SIGHUP)
        assert d.wait(10) == 0  # Restart=always starts it again, serving the device plugin API
        assert "restarting to apply the configuration" in d.log() and "successor" not in d.log()
    finally:
        d.close()


def test_an_unplugged_device_leaves_the_slice_and_comes_back_when_plugged_with_the_generation_raised(tmp_path, api, node):
    d = start(tmp_path, api)
    try:
        d.wait_ready()
        node.wait_registered()
        first = published(api)[0]["spec"]["pool"]["generation"]
        os.unlink(tmp_path / "dev" / "kvm")
        assert wait_until(lambda: api.node_slices() and api.node_slices()[0]["spec"]["devices"] == [], 10), \
            api.node_slices()
        unplugged = api.node_slices()[0]["spec"]["pool"]["generation"]
        api.add_claim("ns", "late", "uid-l", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
        assert "is not one this node serves now" in node.prepare([("ns", "late", "uid-l")])["uid-l"].error
        os.symlink("/dev/null", tmp_path / "dev" / "kvm")
        assert wait_until(lambda: [x["name"] for x in api.node_slices()[0]["spec"]["devices"]] == ["kvm"], 10)
        back = api.node_slices()[0]["spec"]["pool"]["generation"]
        assert first < unplugged < back
        assert node.prepare([("ns", "late", "uid-l")])["uid-l"].error == ""
    finally:
        d.stop()


def test_pattern_units_are_devices_of_their_own_and_each_one_claim_s_at_a_time(tmp_path, api, node):
    from rig.nodes import mknod

    for i in range(2):
        mknod(tmp_path / "dev", f"ttyUSB{i}", 188, i)
    cfg = dra_config(tmp_path, api, devices='[[device]]\nresource = "ate.dev/serial"\npath = "/dev/ttyUSB*"\n')
    d = start(tmp_path, api, config=cfg)
    try:
        d.wait_ready()
        node.wait_registered()
        devices = {x["name"]: x for x in published(api)[0]["spec"]["devices"]}
        names = [device_name("ate.dev/serial", f"ttyUSB{i}") for i in range(2)]  # (not labels: hashed apart)
        assert sorted(devices) == sorted(names), devices
        assert not any(x.get("allowMultipleAllocations") for x in devices.values())
        first = names[0]
        assert devices[first]["attributes"]["path"] == {"string": "/dev/ttyUSB0"}
        for uid in ("uid-1", "uid-2"):
            api.add_claim("ns", uid, uid, [{"request": "tty", "driver": "ate.dev", "pool": NODE, "device": first}])
        one = node.prepare([("ns", "uid-1", "uid-1")])["uid-1"]
        assert one.error == "" and len(one.devices[0].cdi_device_ids) == 1
        two = node.prepare([("ns", "uid-2", "uid-2")])["uid-2"]
        assert "prepared for claim uid-1 already" in two.error and not two.devices
        node.unprepare([("ns", "uid-1", "uid-1")])
        assert node.prepare([("ns", "uid-2", "uid-2")])["uid-2"].error == ""
    finally:
        d.stop()


def test_a_reload_hands_the_sockets_to_a_successor_and_no_prepare_finds_the_driver_away(tmp_path, api, node):
    """SIGHUP: the successor is handed the sockets kubelet dials and serves them beside us; we stop
    accepting, answer what we hold, make it main (MAINPID=) and exit. Kubelet sees nothing: no new
    registration, its calls go on throughout and none fails, and the successor knows every claim
    prepared before and during the handover without reading it again."""
    d = start(tmp_path, api)
    successor = None
    try:
        d.wait_ready()
        old = node.wait_registered()
        published(api)
        for i in range(3000):
            api.add_claim("ns", f"c{i}", f"uid-{i}", [{"request": "kvm", "driver": "ate.dev", "pool": NODE, "device": "kvm"}])
        assert node.prepare([("ns", "c0", "uid-0")])["uid-0"].error == ""
        sent = time.monotonic()
        d.send(signal.SIGHUP)
        answers, i, after, slowest = {}, 1, 0, 0.0
        while time.monotonic() - sent < 30 and after < 20 and i < 3000:  # kubelet's calls go on throughout
            after += d.proc.poll() is not None
            asked = time.monotonic()
            answers[f"uid-{i}"] = node.prepare([("ns", f"c{i}", f"uid-{i}")])[f"uid-{i}"]
            slowest = max(slowest, time.monotonic() - asked)
            i += 1
            time.sleep(0.005)
        assert d.wait(20) == 0, d.log()
        assert after >= 20, "the predecessor did not exit while kubelet's calls went on"
        m = d.notify.wait_for("MAINPID", timeout=10)
        assert m is not None, d.log()
        successor = int(m["fields"]["MAINPID"])
        assert successor != d.pid
        assert wait_until(lambda: len(d.notify.values("READY")) >= 2, 10), "the successor never said READY=1"
        assert {a.error for a in answers.values()} == {""}, {u: a.error for u, a in answers.items() if a.error}
        assert node.instances == [old] and node.newest() is old and node.model.refused == [], \
            "kubelet saw the driver change"
        gets = api.claim_gets
        for uid in ["uid-0"] + list(answers):  # prepared by either, before and during: the successor knows them
            again = node.prepare([("ns", "c" + uid.split("-")[1], uid)])[uid]
            assert again.error == "" and list(again.devices[0].cdi_device_ids) == [KVM_ID]
        assert api.claim_gets == gets, "the successor read claims its predecessor had prepared"
        assert "handed over by the predecessor" in d.log()
        print(f"\nreload: {i - 1} prepares across the handover, none failed, the slowest {slowest * 1000:.1f} ms")
    finally:
        d.close()
        if successor is not None:
            os.kill(successor, signal.SIGTERM)
            assert wait_until(lambda: gone(successor), 10)
