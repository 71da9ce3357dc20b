"""The node's boot, for tests/systemd/test_boot.py and bench/boot.py: a real systemd boots the same
node again and again, atedevd and the kubelet stand-in (as kubelet.service) both enabled,
and kubelet's first batch of pods after each boot says whether atedevd won.

After a reboot kubelet admits the pods bound to the node again, and one whose device plugin
is not registered and healthy by then fails (UnexpectedAdmissionError, never retried;
kubernetes #125579, #128043). atedevd starts before kubelet.service (Before=, Type=notify)
so that it is waiting when kubelet first serves.

The node is rig/container.py's overlay, powered off and booted again (/run and /tmp new,
/etc and /var kept: a reboot). The stand-in is rig/container_admission_standin.py: its
checkpoint from the boot before lists the resources, so they come back with 0 healthy, and
its pod list holds pods that had units of them (and one new pod), all admitted in one batch
FIRST_ADMISSION_S after kubelet.sock appears.

FIRST_ADMISSION_S is the earliest a real kubelet was seen to do it: on kubelet 1.32 atedevd
(ordered before kubelet) had 36-80 ms to spare before kubelet's first batch in 10 of 10
boots, and it is healthy 5-15 ms after kubelet.sock, so the batch came about 40 ms after
kubelet.sock at the earliest. That time is kubelet's sync loop: it starts with kubelet and
sleeps 100 ms, then 200, 400 ... while the container runtime is not up yet; the device
manager serves kubelet.sock on the way to "up", and the pods come at the next wake-up.
"""

import json
import os
import statistics
import time
from typing import Dict, List

from rig.container import (PLUGIN_DIR, STANDIN_STATE, TEST_LIB, Container, diagnostics, install_project, standin_state,
                           wait_until)
from rig.kubelet_standin import CHECKPOINT

FIRST_ADMISSION_S = 0.040
KVM = "ate.dev/kvm"
KVM_UNITS = 1024  # the default configuration's count
PODS_FILE = "/etc/kubelet-standin/pods.json"
CONFIG = "/etc/atedevd/config.toml"
# Pods that had units before the reboot (in kubelet's checkpoint), and one scheduled while
# the node was down: it needs an Allocate, so a live stream too.
KVM_PODS = [{"name": "vm-0", "resource": KVM, "devices": ["kvm-0"]},
            {"name": "vm-1", "resource": KVM, "devices": ["kvm-1", "kvm-2"]},
            {"name": "vm-new", "resource": KVM}]
# Many resources: character devices made at boot (1:3, as /dev/null: the daemon only stats them).
MANY = 16
MANY_UNITS = 64


def kubelet_unit(mode: str) -> str:
    return f"""[Unit]
Description=kubelet stand-in ({mode}), recording admission, as kubelet.service
[Service]
ExecStartPre=/bin/mkdir -p -m 0750 /var/lib/kubelet {PLUGIN_DIR} /run/kubelet-standin
ExecStart=/usr/bin/python3 {TEST_LIB}/container_admission_standin.py serve --kubelet {mode} \\
    --plugin-dir {PLUGIN_DIR} --state {STANDIN_STATE} --pods {PODS_FILE} --first-admission {FIRST_ADMISSION_S}
KillSignal=SIGTERM
[Install]
WantedBy=multi-user.target
"""


def many() -> tuple:
    """(configuration, {resource: units}, pods) for MANY resources, one pod each."""
    config = "".join(f'[[device]]\nresource = "ate.dev/d{i}"\npath = "/dev/atedevd-boot/d{i}"\ncount = {MANY_UNITS}\n\n'
                     for i in range(MANY))
    resources = {f"ate.dev/d{i}": MANY_UNITS for i in range(MANY)}
    pods = [{"name": f"pod-{i}", "resource": name, "devices": [f"d{i}-0"]} for i, name in enumerate(resources)]
    return config, resources, pods


def make_node(node: Container) -> None:
    """On a mounted, not booted node: the project, both units enabled, /dev/kvm and the
    MANY devices made at boot (by systemd-tmpfiles, before any service, as the kernel would)."""
    install_project(node)
    node.write("/etc/tmpfiles.d/atedevd-boot.conf", "c /dev/kvm 0660 root root - 10:232\n"
               + "".join(f"c /dev/atedevd-boot/d{i} 0600 root root - 1:3\n" for i in range(MANY)))
    wants = node.path("/etc/systemd/system/multi-user.target.wants")
    wants.mkdir(parents=True, exist_ok=True)
    for unit in ("atedevd.service", "kubelet.service"):
        link = wants / unit
        if not link.is_symlink():
            link.symlink_to(f"/etc/systemd/system/{unit}")


def prepare(node: Container, mode: str, pods: List[dict], config: str = "") -> None:
    """On a powered-off node, before a series of boots: kubelet.service of that model, the
    configuration (none: the default, /dev/kvm), the pod list, and the checkpoint a boot
    before would have left (the pods' resources registered)."""
    node.write("/etc/systemd/system/kubelet.service", kubelet_unit(mode))
    if config:
        node.write(CONFIG, config)
    else:
        node.path(CONFIG).unlink(missing_ok=True)
    node.write(PODS_FILE, json.dumps(pods))
    registered = {p["resource"]: sorted(p.get("devices", [])) for p in pods}
    node.write(f"{PLUGIN_DIR}/{CHECKPOINT}", json.dumps({"RegisteredDevices": registered}))


def one_boot(node: Container, resources: Dict[str, int]) -> dict:
    """Boot, wait for kubelet's first batch of pods, read what happened, power off.
    `resources`: {name: units}. Times in seconds of CLOCK_MONOTONIC (one clock for the host,
    the container, systemd and the stand-in)."""
    drop_page_cache()
    node.boot()
    try:
        def settled():  # kubelet's first batch done, and every resource healthy (or given up on)
            s = standin_state(node)
            if not (s and s.get("first_admissions")):
                return None
            counts = {name: r.get("healthy") for name, r in (s.get("resources") or {}).items()}
            return s if all(counts.get(n) == u for n, u in resources.items()) or time.monotonic() > give_up else None

        give_up = time.monotonic() + 20
        state = wait_until(settled, 30, "kubelet's first admission", lambda: f"{standin_state(node)}\n{diagnostics(node)}",
                           interval=0.02)
        t = state["timing"]
        healthy: Dict[str, float] = {}
        for at, name, _endpoint, count in t["healthy"]:
            if name in resources and count == resources[name]:
                healthy.setdefault(name, at)
        show = node.show("atedevd", "ActiveEnterTimestampMonotonic", "NRestarts")
        kubelet = node.show("kubelet", "ExecMainStartTimestampMonotonic", "After")
        return {"batch": state["first_admissions"][0], "sock": t["sock"][0], "registers": t["registers"],
                "healthy": healthy, "resources": dict(resources),
                "ready": int(show["ActiveEnterTimestampMonotonic"]) / 1e6,
                "kubelet_start": int(kubelet["ExecMainStartTimestampMonotonic"]) / 1e6,
                "restarts": show["NRestarts"], "after": kubelet["After"].split(),
                "debug": f"{json.dumps(state, indent=1)[:4000]}\n{diagnostics(node)}"}
    finally:
        node.shutdown()


def drop_page_cache() -> None:
    """Write back and drop the page cache, dentries and inodes: the boot reads everything from
    the disk, as a real reboot does (a boot after the first in a warm cache finds systemd,
    Python, grpc and atedevd in memory, and the first after a rootfs build its dirty pages
    still being written)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def problems(b: dict) -> List[str]:
    """What went wrong in one boot: the order systemd kept (kubelet after atedevd's READY, no
    restart), one accepted Register per resource after kubelet.sock appeared, every resource
    healthy, every pod admitted by kubelet's first batch."""
    out = []
    if "atedevd.service" not in b["after"]:
        out.append(f"kubelet.service is not ordered after atedevd.service: After={b['after']}")
    if not 0 < b["ready"] <= b["kubelet_start"]:
        out.append(f"atedevd READY at {b['ready']:.4f}, kubelet started at {b['kubelet_start']:.4f}")
    if b["restarts"] != "0":
        out.append(f"atedevd restarted {b['restarts']} times")
    for name in b["resources"]:
        prefix = name.replace("/", "_", 1) + "."
        registers = [r for r in b["registers"] if r["endpoint"].startswith(prefix)]
        if len(registers) != 1 or registers[0]["error"] is not None or registers[0]["at"] < b["sock"]:
            out.append(f"{name}: Register calls {registers}, kubelet.sock at {b['sock']:.4f}")
        if name not in b["healthy"]:
            out.append(f"{name}: never healthy")
    rejected = {p["name"]: p["reason"] for p in b["batch"]["pods"] if p["reason"] is not None}
    if rejected:
        out.append(f"kubelet's first batch, {(b['batch']['at'] - b['sock']) * 1000:.1f} ms after kubelet.sock, "
                   f"rejected {len(rejected)} of {len(b['batch']['pods'])} pods: {rejected}")
    return out


def rejected_pods(b: dict) -> int:
    return sum(1 for p in b["batch"]["pods"] if p["reason"] is not None)


def figures(boots: List[dict]) -> Dict[str, List[float]]:
    """Per boot, seconds: margin (the last resource healthy -> kubelet's first batch; negative:
    lost), ours (kubelet.sock -> first and last Register, -> the last resource healthy), kubelet's
    (kubelet.sock -> first batch: the stand-in's FIRST_ADMISSION_S and its own lateness),
    and how long before kubelet's start atedevd was READY."""
    out: Dict[str, List[float]] = {"margin": [], "register": [], "last_register": [], "healthy": [], "batch": [],
                                   "ready": []}
    for b in boots:
        last = max(b["healthy"].values()) if len(b["healthy"]) == len(b["resources"]) else float("inf")
        out["margin"].append(b["batch"]["at"] - last)
        out["register"].append(min(r["at"] for r in b["registers"]) - b["sock"] if b["registers"] else float("inf"))
        out["last_register"].append(max(r["at"] for r in b["registers"]) - b["sock"] if b["registers"] else float("inf"))
        out["healthy"].append(last - b["sock"])
        out["batch"].append(b["batch"]["at"] - b["sock"])
        out["ready"].append(b["kubelet_start"] - b["ready"])
    return out


def ms(values: List[float]) -> str:
    """min / p50 / max in ms."""
    v = sorted(values)
    return f"{v[0] * 1000:.1f} / {statistics.median(v) * 1000:.1f} / {v[-1] * 1000:.1f} ms"
