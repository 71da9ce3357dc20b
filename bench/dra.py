"""DRA mode beside device-plugin mode (`python3 -m bench --only dra`): NodePrepareResources as
kubelet's side times it, for a new claim (read from the API server, checked, checkpointed) and for
one already prepared (answered from the book), NodeUnprepareResources, and the time from kubelet's
wipe of the node's slices to their republication; beside them the device-plugin mode's Allocate
on the same machine, and how long a prepare sent while atedevd restarts (SIGTERM, kill -9) waits
for the next run, which systemd's store hands the sockets (nothing fails). The kubelet's DRA side
(rig/dra_kubelet.py) and the API server stand-in (rig/apiserver_standin.py) run in this
process: their share of a figure is ours to subtract,
and a real API server's GET is slower (on a real 1.37 node the upstream helper's prepares took
4-17 ms, most of it its GET: docs/dra.md)."""

import os
import shutil
import signal
import tempfile
import threading
import time
from typing import List, Tuple

from bench.rig import Rig, load, percentile
from rig.apiserver_standin import ApiServerStandIn
from rig.dra_kubelet import DraKubelet
from rig.harness import DaemonUnderTest, FdStore, fake_dev_root, wait_until, write_file

Row = Tuple[str, str, str, str, str]
HELD = 100  # claims prepared at once (the 100 pods sharing /dev/kvm): the checkpoint's size


def _ms(values: List[float]) -> str:
    return f"{percentile(values, 50) * 1000:.2f}/{percentile(values, 99) * 1000:.2f} ms"


def run(quick: bool) -> List[Row]:
    n = 100 if quick else 1000
    wipes = 5 if quick else 20
    rows: List[Row] = []
    root = tempfile.mkdtemp(prefix="atedra-", dir="/tmp")
    api = ApiServerStandIn("node-a")
    kubelet = DraKubelet(os.path.join(root, "kubelet"), api)
    d = None
    try:
        os.makedirs(os.path.join(root, "kubelet", "device-plugins"))
        os.makedirs(os.path.join(root, "cdi"), mode=0o755)
        dev = fake_dev_root(os.path.join(root, "dev"))
        cfg = write_file(os.path.join(root, "c.toml"), f'[daemon]\napi = "dra"\nkubeconfig = '
                         f'"{api.kubeconfig(os.path.join(root, "kc.json"))}"\ncdi_spec_dir = "{root}/cdi"\n')
        d = DaemonUnderTest(os.path.join(root, "run"), os.path.join(root, "kubelet", "device-plugins"), dev, config=cfg)
        d.wait_ready(30)
        kubelet.wait_registered(30)
        if not wait_until(lambda: api.node_slices(), 30):
            raise RuntimeError(f"no slice published; log:\n{d.log()}")
        claims = [("ns", f"c{i}", f"uid-{i}") for i in range(n)]
        for ns, name, uid in claims:
            api.add_claim(ns, name, uid, [{"request": "kvm", "driver": "ate.dev", "pool": "node-a", "device": "kvm"}])
        new, again, gone = [], [], []
        for start in range(0, n, HELD):  # HELD claims prepared at a time: pods sharing /dev/kvm
            batch = claims[start:start + HELD]
            for phase, out in ((kubelet.prepare, new), (kubelet.prepare, again), (kubelet.unprepare, gone)):
                for c in batch:
                    t = time.perf_counter()
                    answer = phase([c])[c[2]]
                    out.append(time.perf_counter() - t)
                    if answer.error:
                        raise RuntimeError(f"{c}: {answer.error}")
        p99 = percentile(new, 99)
        rows.append(("dra", f"NodePrepareResources, a new claim, p50/p99 over {n} ({HELD} held)", _ms(new), "p99 <= 5 ms",
                     "PASS" if p99 <= 0.005 else "MISS"))
        rows.append(("dra", "NodePrepareResources, a claim already prepared", _ms(again), "", ""))
        rows.append(("dra", "NodeUnprepareResources", _ms(gone), "", ""))
        backs = []
        for _ in range(wipes):
            writes = len(api.writes)
            t = time.monotonic()
            api.wipe()
            if not wait_until(lambda: len(api.writes) > writes, 10, 0.0005):
                raise RuntimeError("a wiped slice was not published again")
            backs.append(api.writes[writes][0] - t)
        rows.append(("dra", f"slice wiped -> published again, p50/max over {wipes}",
                     f"{percentile(backs, 50) * 1000:.1f}/{max(backs) * 1000:.1f} ms", "<= 1 s",
                     "PASS" if max(backs) <= 1.0 else "MISS"))
        d.stop()
        d = None
        for how in (signal.SIGTERM, signal.SIGKILL):
            took = _restarts(root, dev, cfg, api, kubelet, 3 if quick else 10, how)
            rows.append(("dra", f"a prepare sent as atedevd is {'stopped' if how == signal.SIGTERM else 'killed'} and "
                         f"started again (systemd's store), answered after: p50/max over {len(took)}",
                         f"{percentile(took, 50) * 1000:.0f}/{max(took) * 1000:.0f} ms", "no call fails", "PASS"))
    finally:
        if d is not None:
            d.stop()
        kubelet.close()
        api.close()
        shutil.rmtree(root, ignore_errors=True)
    with Rig() as rig:  # the device-plugin mode's answer, on the same machine, the same way
        rig.start_registered()
        seq = load(rig.socket, 1, 1, count=n)
        rows.append(("dra", f"beside it: device-plugin Allocate, p50/p99 over {n} (client process)", _ms(seq["lat"]), "", ""))
    return rows


def _restarts(root: str, dev: str, cfg: str, api, kubelet, rounds: int, how: int) -> List[float]:
    """Each round: atedevd stopped (`how`), a prepare sent while none runs, a new atedevd started at
    once with what systemd's store kept (rig/harness.FdStore): the time from the prepare's sending
    to its answer (the new start's share: its imports, its first look, its sockets)."""
    store = FdStore()
    took: List[float] = []
    begun = time.monotonic()
    d = DaemonUnderTest(os.path.join(root, "run-r"), os.path.join(root, "kubelet", "device-plugins"), dev, config=cfg,
                        fd_store=store)
    try:
        d.wait_ready(30)
        kubelet.wait_registered(30, after=begun)  # (its sockets are bound anew: a first run with the store)
        for i in range(rounds):
            api.add_claim("ns", f"r{how}-{i}", f"uid-r{how}-{i}", [{"request": "kvm", "driver": "ate.dev",
                                                                    "pool": "node-a", "device": "kvm"}])
            d.stop(how)
            answer: dict = {}
            sent = time.perf_counter()
            t = threading.Thread(target=lambda: answer.update(kubelet.prepare([("ns", f"r{how}-{i}", f"uid-r{how}-{i}")])))
            t.start()
            d = DaemonUnderTest(os.path.join(root, f"run-r{i}"), os.path.join(root, "kubelet", "device-plugins"), dev,
                                config=cfg, fd_store=store)
            t.join(60)
            took.append(time.perf_counter() - sent)
            if answer.get(f"uid-r{how}-{i}") is None or answer[f"uid-r{how}-{i}"].error:
                raise RuntimeError(f"a prepare across a restart failed: {answer}")
            d.wait_ready(30)
    finally:
        d.stop()
        store.close()
    return took
