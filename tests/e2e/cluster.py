"""A one-node Kubernetes cluster the tests start and stop, apart from the host's own.

etcd, kube-apiserver (`Node,RBAC`, `NodeRestriction`), kube-scheduler and kube-controller-manager
on loopback, with certificates made at start; containerd 2 (CDI on, as shipped) with its own root,
state, sockets and runc root; the kubelet under test with a node identity (`system:node:<name>`),
its own `--root-dir` and a cgroup root of its own; pod networks only inside the pods' own network
namespaces (tests/e2e/cni.py). Everything lives in one temporary directory, every process is
stopped by its PID, and what the run changed on the host is put back: /dev/kvm's owner and mode,
the kernel tunables kubelet sets, its cgroups, its mounts. The binaries come from the builder's
cache (tests/e2e/build.py).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from tests.e2e import build, image
from tests.e2e.api import Api, wait_for
from tests.e2e.kubelet_log import Follower, KubeletLog
from tests.e2e.pki import PKI

NODE = "e2e-node"
# Every kubelet runs against this control plane: kubelet 1.32 and 1.33 are outside the supported
# skew (three minors older at most), yet register, report and run pods with it (measured).
CONTROL_PLANE = "1.37"
KVM = "/dev/kvm"
KVM_GID = 2375  # the node's group for /dev/kvm while a cluster runs (0660 root:2375); pods given it open it
CGROUP_FS = Path("/sys/fs/cgroup")
# What kubelet sets on the host when protectKernelDefaults is off (pkg/kubelet/cm: setupKernelTunables),
# read before it starts and written back after it stops.
TUNABLES = ["vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
            "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes"]
SLOW_START_S = 120  # a component's first answer; seconds on 2 cores that others share


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minor(version: str) -> Tuple[int, int]:
    """'v1.32.13' or '1.32' -> (1, 32)."""
    major, mnr = version.lstrip("v").split(".")[:2]
    return int(major), int(mnr)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


CONTAINERD_CONFIG = """version = 3
root = '{root}/containerd/root'
state = '{root}/containerd/state'
temp = '{root}/containerd/tmp'
imports = []
disabled_plugins = ['io.containerd.nri.v1.nri']

[grpc]
  address = '{root}/containerd/containerd.sock'
[ttrpc]
  address = '{root}/containerd/containerd.sock.ttrpc'

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = '{root}/containerd/opt'
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{image}'
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    cdi_spec_dirs = ['{cdi}']
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{runc}'
          Root = '{root}/containerd/runc'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{root}/cni/bin']
      conf_dir = '{root}/cni/conf'
"""


class Cluster:
    """One node's control plane, runtime and kubelet. `start()` brings it up and waits for the
    Node to be Ready; `stop()` takes everything down and puts the host back, whatever failed."""

    def __init__(self, kubelet_version: str, control_plane: Optional[str] = None, verbosity: int = 4):
        self.kubelet_bin = build.binary("kubelet", kubelet_version)
        self.kubelet_version = self.kubelet_bin.parent.name  # e.g. v1.36.3
        self.control_plane = build.binary("kube-apiserver", control_plane or CONTROL_PLANE).parent.name
        self.verbosity = verbosity
        self.root = Path(tempfile.mkdtemp(prefix="ae2e-", dir="/tmp"))  # short: socket paths have 107 bytes
        # Searchable by all: runc prepares a `hostUsers: false` pod's rootfs (under containerd's
        # state) as the pod's root, which is nobody on the host (0700 is EACCES).
        self.root.chmod(0o711)
        self.id = self.root.name.split("-", 1)[1]
        self.cgroup_root = f"/atedevd-e2e-{self.id}"
        self.kubelet_root = self.root / "kubelet"
        self.plugin_dir = self.kubelet_root / "device-plugins"
        self.pod_logs = self.root / "pod-logs"
        self.cdi_dir = self.root / "cdi"
        self.logs = self.root / "logs"
        self.logs.mkdir()
        self.procs: Dict[str, Proc] = {}
        self.ports = {n: free_port() for n in ("etcd", "etcd-peer", "apiserver", "kubelet", "healthz",
                                               "scheduler", "controller-manager")}
        self.api: Optional[Api] = None
        self.kubelet_log: Optional[Path] = None
        self._kubelet_starts = 0
        self._follower = Follower(lambda: [self.logs / f"kubelet-{i}.log" for i in range(1, self._kubelet_starts + 1)])
        self._host: Dict[str, object] = {}
        self._extra_cleanup: List = []

    # ---- the whole ------------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.monotonic()
        self._save_host()
        self._certificates()
        self._etcd()
        self._apiserver()
        self._controllers()
        self._node_namespace()
        self._containerd()
        self.start_kubelet()
        self.wait_node_ready()
        self.started_in = time.monotonic() - t0

    def stop(self) -> None:
        """Pods first (kubelet unmounts their volumes), then kubelet, the runtime's pods and
        containerd, the control plane; then whatever is still ours is killed by PID and the host
        put back."""
        errors: List[str] = []
        for step in (self._delete_pods, self.stop_kubelet, self._remove_sandboxes, self._stop_all,
                     self._kill_leftovers, self._unmount, self._remove_cgroups, *self._extra_cleanup,
                     self._restore_host):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - every step is tried; all are reported
                errors.append(f"{getattr(step, '__name__', step)}: {e}")
        keep = os.environ.get("ATEDEVD_E2E_KEEP")
        if keep:
            shutil.copytree(self.logs, Path(keep) / f"{self.kubelet_version}-{self.id}", dirs_exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            print("cluster stop: " + "; ".join(errors), file=sys.stderr)

    def on_stop(self, fn) -> None:
        """Run fn (no arguments) at stop, before the host is put back."""
        self._extra_cleanup.insert(0, fn)

    # ---- processes ------------------------------------------------------------------------------

    def spawn(self, name: str, args: List[str], env: Optional[dict] = None) -> Proc:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def end(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> Optional[int]:
        proc = self.procs.pop(name, None)
        if proc is None:
            return None
        if proc.popen.poll() is None:
            proc.popen.send_signal(sig)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        return proc.popen.returncode

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.popen.poll() is None

    def _wait_serving(self, name: str, probe, timeout: float = SLOW_START_S) -> None:
        def check():
            if not self.alive(name):
                raise AssertionError(f"{name} exited:\n{self.tail(name)}")
            return probe()
        try:
            wait_for(f"{name} to serve", check, timeout, 0.1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.tail(name)}") from None

    def tail(self, name: str, n: int = 4000) -> str:
        path = self.logs / f"{name}.log"
        try:
            return path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ---- the control plane ------------------------------------------------------------------------

    def _certificates(self) -> None:
        pki = self.pki = PKI(self.root / "pki")
        server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self.certs = {
            "apiserver": pki.issue("apiserver", "kube-apiserver", sans=[
                "IP:127.0.0.1", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
                "DNS:kubernetes.default.svc", "IP:10.0.0.1"]),
            "apiserver-kubelet": pki.issue("apiserver-kubelet", "kube-apiserver-kubelet-client", ("system:masters",)),
            "admin": pki.issue("admin", "e2e-admin", ("system:masters",)),
            "kubelet": pki.issue("kubelet", f"system:node:{NODE}", ("system:nodes",)),
            "scheduler": pki.issue("scheduler", "system:kube-scheduler"),
            "controller-manager": pki.issue("controller-manager", "system:kube-controller-manager"),
        }
        self.kubeconfigs = {who: pki.kubeconfig(self.root / "pki" / f"{who}.kubeconfig", server, self.certs[who])
                            for who in ("admin", "kubelet", "scheduler", "controller-manager")}
        admin = self.certs["admin"]
        self.api = Api("127.0.0.1", self.ports["apiserver"], str(pki.ca), str(admin["cert"]), str(admin["key"]))

    def _etcd(self) -> None:
        c, p = self.ports["etcd"], self.ports["etcd-peer"]
        self.spawn("etcd", [build.binary("etcd"), "--name", "e2e", "--data-dir", self.root / "etcd",
                            "--listen-client-urls", f"http://127.0.0.1:{c}", "--advertise-client-urls", f"http://127.0.0.1:{c}",
                            "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                            "--initial-cluster", f"e2e=http://127.0.0.1:{p}", "--unsafe-no-fsync", "--log-level", "warn"])

    def _apiserver(self) -> None:
        pki, cert = self.pki, self.certs
        self.spawn("kube-apiserver", [
            build.binary("kube-apiserver", self.control_plane),
            "--etcd-servers", f"http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", self.ports["apiserver"], "--endpoint-reconciler-type", "none",
            "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
            "--client-ca-file", pki.ca, "--tls-cert-file", cert["apiserver"]["cert"],
            "--tls-private-key-file", cert["apiserver"]["key"],
            "--kubelet-client-certificate", cert["apiserver-kubelet"]["cert"],
            "--kubelet-client-key", cert["apiserver-kubelet"]["key"],
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", pki.sa_pub, "--service-account-signing-key-file", pki.sa_key,
            "--service-cluster-ip-range", "10.0.0.0/24", "--cert-dir", self.root / "apiserver-certs",
            "--profiling=false", "--v=1"])
        self._wait_serving("kube-apiserver", self.api.ready)
        # RBAC's bootstrap roles are written by a post-start hook shortly after /readyz.
        wait_for("the bootstrap cluster roles", lambda: self.api.get(
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/system:kube-scheduler"), 60)

    def _controllers(self) -> None:
        self.spawn("kube-scheduler", [
            build.binary("kube-scheduler", self.control_plane), "--kubeconfig", self.kubeconfigs["scheduler"],
            "--authentication-kubeconfig", self.kubeconfigs["scheduler"],
            "--authorization-kubeconfig", self.kubeconfigs["scheduler"],
            "--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", self.ports["scheduler"],
            "--cert-dir", self.root / "scheduler-certs", "--v=1"])
        self.spawn("kube-controller-manager", [
            build.binary("kube-controller-manager", self.control_plane),
            "--kubeconfig", self.kubeconfigs["controller-manager"],
            "--authentication-kubeconfig", self.kubeconfigs["controller-manager"],
            "--authorization-kubeconfig", self.kubeconfigs["controller-manager"],
            "--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", self.ports["controller-manager"],
            "--cert-dir", self.root / "controller-manager-certs", "--use-service-account-credentials",
            "--service-account-private-key-file", self.pki.sa_key, "--root-ca-file", self.pki.ca,
            "--controllers", "*,-bootstrapsigner,-tokencleaner,-nodeipam",
            "--v=1"])

    # ---- the node's mount namespace ----------------------------------------------------------------

    def _node_namespace(self) -> None:
        """kubelet serves its device plugin registration at /var/lib/kubelet/device-plugins
        whatever its --root-dir (the path is a constant of the v1beta1 API package; kubelet's
        own log says so), and links container logs in /var/log/containers. So kubelet and the
        runtime, which must see kubelet's volume mounts, run in a mount namespace of their own in
        which /var/lib and /var/log are overlays whose writes land in the cluster's directory,
        and /var/lib/kubelet/device-plugins is the custom root's. atedevd, on the host, serves
        <root-dir>/device-plugins: the same directory. The namespace ends with its processes."""
        ns = self.root / "ns"
        self.plugin_dir.mkdir(parents=True, mode=0o750)
        lines = ["set -e"]
        for d in ("/var/lib", "/var/log"):
            upper, work = ns / d.strip("/").replace("/", "-") / "upper", ns / d.strip("/").replace("/", "-") / "work"
            upper.mkdir(parents=True)
            work.mkdir(parents=True)
            lines.append(f"mount -t overlay overlay -o lowerdir={d},upperdir={upper},workdir={work} {d}")
        lines += ["mkdir -p /var/lib/kubelet/device-plugins",
                  f"mount --bind {self.plugin_dir} /var/lib/kubelet/device-plugins",
                  "echo namespace-ready", "exec sleep infinity"]
        holder = self.spawn("node-namespace", ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                               "\n".join(lines)])
        self._wait_serving("node-namespace", lambda: "namespace-ready" in self.tail("node-namespace"), 30)
        self.node_ns = f"/proc/{holder.popen.pid}/ns/mnt"

    def in_node(self, args: List) -> List:
        """A command line run in the node's mount namespace (nsenter execs it: the PID is its own)."""
        return ["nsenter", f"--mount={self.node_ns}", "--", *args]

    # ---- the runtime ------------------------------------------------------------------------------

    def _containerd(self) -> None:
        (self.root / "containerd").mkdir()
        self.cdi_dir.mkdir(mode=0o755)
        bins, conf = self.root / "cni" / "bin", self.root / "cni" / "conf"
        bins.mkdir(parents=True)
        conf.mkdir(parents=True)
        wrapper = bins / "atedevd-e2e-net"
        wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={build.CHECKOUT} exec {sys.executable} -m tests.e2e.cni\n")
        wrapper.chmod(0o755)
        (bins / "loopback").symlink_to(wrapper.name)
        (conf / "10-e2e.conflist").write_text(json.dumps(
            {"cniVersion": "1.0.0", "name": "e2e", "plugins": [{"type": "atedevd-e2e-net"}]}))
        self.containerd_config = self.root / "containerd" / "config.toml"
        self.image = image.name()
        self.containerd_config.write_text(CONTAINERD_CONFIG.format(
            root=self.root, image=self.image, runc=build.binary("runc"), cdi=self.cdi_dir))
        self.containerd_socket = self.root / "containerd" / "containerd.sock"
        shim_dir = build.binary("containerd-shim-runc-v2").parent
        self.spawn("containerd", self.in_node([build.binary("containerd"), "--config", self.containerd_config]),
                   env={"PATH": f"{shim_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"})
        self._wait_serving("containerd", lambda: self.crictl("info", check=False).returncode == 0, 60)
        archive = image.build(self.root / "image")
        subprocess.run([build.binary("ctr"), "--address", self.containerd_socket, "-n", "k8s.io",
                        "images", "import", "--snapshotter", "overlayfs", archive],
                       check=True, capture_output=True, timeout=120)

    def crictl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(build.binary("crictl")), "--runtime-endpoint", f"unix://{self.containerd_socket}",
                               "--image-endpoint", f"unix://{self.containerd_socket}", "--timeout", "20s", *args],
                              capture_output=True, text=True, check=check, timeout=timeout)

    # ---- kubelet ----------------------------------------------------------------------------------

    def kubelet_config(self) -> Path:
        """KubeletConfiguration for this node: loopback only, cgroupfs under the cluster's own
        cgroup root, the pods' logs in the cluster's directory, nothing evicted or collected."""
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "port": self.ports["kubelet"], "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.ports["healthz"],
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.pki.ca)}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root, "cgroupsPerQOS": True,
            "failCgroupV1": False, "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "podLogsDir": str(self.pod_logs),
            "volumePluginDir": str(self.root / "volume-plugins"),
            "resolvConf": str(self.root / "resolv.conf"),
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "rotateCertificates": False, "serializeImagePulls": False,
            "maxPods": 250, "registerNode": True,
        }
        gates = {}
        if minor(self.kubelet_version) < (1, 34):  # beta and off by default before 1.33, GA in 1.36
            gates["UserNamespacesSupport"] = True
        if (1, 34) <= minor(self.kubelet_version) < (1, 36):  # alpha in 1.34 and 1.35, beta and on from 1.36
            gates.update(DRAExtendedResource=True, DRAConsumableCapacity=True)  # (DRA mode: tests/e2e/test_dra.py)
        if gates:
            cfg["featureGates"] = gates
        (self.root / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        path = self.root / "kubelet-config.json"
        path.write_text(json.dumps(cfg, indent=1))
        return path

    def start_kubelet(self) -> Proc:
        self._kubelet_starts += 1
        name = f"kubelet-{self._kubelet_starts}"
        self.kubelet_log = self.logs / f"{name}.log"
        self.kubelet_root.mkdir(exist_ok=True)
        proc = self.spawn(name, self.in_node([
                                 self.kubelet_bin, "--config", self.kubelet_config(),
                                 "--kubeconfig", self.kubeconfigs["kubelet"], "--root-dir", self.kubelet_root,
                                 "--cert-dir", self.kubelet_root / "pki",
                                 "--hostname-override", NODE, "--node-ip", "127.0.0.1", f"--v={self.verbosity}"]))
        self.procs["kubelet"] = proc
        return proc

    def stop_kubelet(self, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop("kubelet", None)
        if proc is not None:
            self.procs[proc.name] = proc
            self.end(proc.name, sig)

    def klog(self, resource: str = "ate.dev/kvm") -> KubeletLog:
        """kubelet's device manager lines so far, across its restarts."""
        return KubeletLog(self._follower.lines(), resource)

    def node(self) -> dict:
        return self.api.get(f"/api/v1/nodes/{NODE}")

    def wait_node_ready(self, timeout: float = SLOW_START_S) -> None:
        def ready():
            if not self.alive("kubelet"):
                raise AssertionError(f"kubelet exited:\n{self.kubelet_log.read_text(errors='replace')[-4000:]}")
            conds = {c["type"]: c["status"] for c in self.node().get("status", {}).get("conditions", [])}
            return conds.get("Ready") == "True"
        try:
            wait_for("the Node to be Ready", ready, timeout, 0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.kubelet_log.read_text(errors='replace')[-6000:]}") from None
        # Pods need their namespace's service account and the CA bundle the controllers publish.
        wait_for("the default service account", lambda: self.api.get("/api/v1/namespaces/default/serviceaccounts/default"), 60)
        wait_for("kube-root-ca.crt", lambda: self.api.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt"), 60)

    def allocatable(self, resource: str) -> str:
        return self.node().get("status", {}).get("allocatable", {}).get(resource, "0")

    # ---- taking it down -----------------------------------------------------------------------------

    def _delete_pods(self) -> None:
        if self.api is None or not self.alive("kube-apiserver"):
            return
        for kind in ("apis/apps/v1/namespaces/default/deployments", "apis/batch/v1/namespaces/default/jobs"):
            for obj in self.api.items(f"/{kind}"):
                self.api.delete(f"/{kind}/{obj['metadata']['name']}")
        for pod in self.api.items("/api/v1/namespaces/default/pods"):
            self.api.delete(f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}", grace=0)
        if self.alive("kubelet"):
            # kubelet stops the containers and unmounts the volumes; what is left is done below
            try:
                wait_for("the pods to go", lambda: not self.api.items("/api/v1/namespaces/default/pods"), 60, 0.5)
            except AssertionError:
                pass

    def _remove_sandboxes(self) -> None:
        if self.alive("containerd"):
            self.crictl("rmp", "--all", "--force", check=False, timeout=120)

    def _stop_all(self) -> None:
        for name in ["containerd", "node-namespace", "kube-controller-manager", "kube-scheduler", "kube-apiserver",
                     "etcd"] + list(self.procs):
            self.end(name)

    def _ours(self) -> List[int]:
        """Processes of this cluster that outlive their parents: containerd's shims (their
        command line names our socket) and whatever runs in the cluster's cgroups."""
        pids = set()
        needle = str(self.root).encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if needle in f.read():
                        pids.add(int(entry))
            except OSError:
                continue
        for procs in (CGROUP_FS / "pids").glob(self.cgroup_root.lstrip("/") + "/**/cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                continue
        pids.discard(os.getpid())
        return sorted(pids)

    def _kill_leftovers(self) -> None:
        for pid in self._ours():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for("our leftover processes to go", lambda: not self._ours(), 10, 0.1)

    def _unmount(self) -> None:
        """Every mount under the cluster's directory (kubelet's own bind of its root, pod volumes,
        network namespaces, snapshots), deepest first."""
        prefix = str(self.root) + "/"
        for _ in range(5):
            with open("/proc/self/mountinfo") as f:
                points = [line.split()[4] for line in f]
            ours = sorted({p for p in points if p.startswith(prefix) or p == str(self.root)}, key=len, reverse=True)
            if not ours:
                return
            for p in ours:
                subprocess.run(["umount", "-l", p], capture_output=True)

    def _remove_cgroups(self) -> None:
        for hierarchy in CGROUP_FS.iterdir():
            top = hierarchy / self.cgroup_root.lstrip("/")
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [top]:
                for _ in range(50):
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.1)

    # ---- the host -----------------------------------------------------------------------------------

    def _save_host(self) -> None:
        """What a run changes on the host, read first: /dev/kvm's owner and mode, the tunables."""
        st = os.stat(KVM)
        self._host["kvm"] = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        self._host["tunables"] = {t: Path("/proc/sys", t).read_text().strip() for t in TUNABLES
                                  if Path("/proc/sys", t).exists()}
        # A node's kvm group: root pods need nothing, a pod given the group opens it, others do not.
        os.chown(KVM, 0, KVM_GID)
        os.chmod(KVM, 0o660)
        # kubelet insists that its cgroup root exists; a new cpuset must be given cpus and mems.
        for hierarchy in CGROUP_FS.iterdir():
            if (hierarchy / "cgroup.procs").exists() and hierarchy.name != "unified":
                top = hierarchy / self.cgroup_root.lstrip("/")
                top.mkdir(exist_ok=True)
                if hierarchy.name == "cpuset":
                    for f in ("cpuset.cpus", "cpuset.mems"):
                        (top / f).write_text((hierarchy / f).read_text())

    def _restore_host(self) -> None:
        if "kvm" in self._host:
            mode, uid, gid = self._host["kvm"]
            os.chown(KVM, uid, gid)
            os.chmod(KVM, mode)
        for t, value in self._host.get("tunables", {}).items():
            path = Path("/proc/sys", t)
            if path.read_text().strip() != value:
                path.write_text(value + "\n")

    def host_changes(self) -> List[str]:
        """What is not as it was before start (for a test that a run leaves nothing behind)."""
        found = []
        if "kvm" in self._host:
            st = os.stat(KVM)
            if (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) != self._host["kvm"]:
                found.append(f"{KVM} is {oct(stat.S_IMODE(st.st_mode))} {st.st_uid}:{st.st_gid}")
        for t, value in self._host.get("tunables", {}).items():
            if Path("/proc/sys", t).read_text().strip() != value:
                found.append(f"{t} changed")
        found += [f"pid {p} left" for p in self._ours()]
        found += [str(h / self.cgroup_root.lstrip("/")) for h in CGROUP_FS.iterdir()
                  if (h / self.cgroup_root.lstrip("/")).exists()]
        with open("/proc/self/mountinfo") as f:
            found += [line.split()[4] for line in f if line.split()[4].startswith(str(self.root))]
        if self.root.exists():
            found.append(str(self.root))
        return found
