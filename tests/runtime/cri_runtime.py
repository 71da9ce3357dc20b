"""containerd 1.7 driven through the CRI, the way kubelet drives it: a pod sandbox, a container in
it with the Devices and CDI_devices an Allocate answer gave, its exit and its log.

Debian 13's containerd (1.7.24) and runc (1.1.15) run from a cached trixie rootfs (rig/container.py
builds it with debootstrap) in an overlay, in a mount and network namespace of their own: the test's
CDI spec directory is bound over the rootfs's /run/cdi and its device node over the host's /dev/kvm
(runc binds the host's node at the container path into a user namespace); pivot_root, not chroot,
since a chrooted process cannot make a user namespace. Pods in the host's user namespace use the
node's network namespace (here: the namespace made for containerd, only lo); pods in a user namespace
cannot (the kernel refuses sysfs there), so they get a network namespace of their own from a bridge
with link-local addresses, inside containerd's namespace. `restrict_oom_score_adj`: this host does
not let even root lower a process's OOM score, which CRI sandboxes ask for. No crictl is packaged in
Debian: tests/runtime/cri_api holds the part of the CRI the tests call (runtime.v1's field numbers).
"""

import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import grpc

from rig.container import Container, RootfsSpec, cached_rootfs
from rig.harness import end_process
from tests.runtime import oci_runtime
from tests.runtime.cri_api import cri_pb2 as cri

ROOTFS = RootfsSpec("containerd", ("containerd", "runc", "containernetworking-plugins"), suite="trixie")
USERNS = [cri.IDMapping(host_id=100000, container_id=0, length=65536)]  # what hostUsers: false gives a pod
HERE = Path(__file__).resolve().parent
PAUSE_SOURCE = b"#include <signal.h>\n#include <unistd.h>\nstatic void bye(int s) { (void)s; _exit(0); }\n" \
               b"int main(void) { signal(SIGTERM, bye); signal(SIGINT, bye); for (;;) pause(); }\n"

CONFIG = """version = 2
root = "/ctrwork/lib"
state = "/run/containerd"
[grpc]
  address = "/ctrwork/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  enable_cdi = {enable_cdi}
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  sandbox_image = "{image}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/ctrwork/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"""
CNI = {"cniVersion": "1.0.0", "name": "atedevd-test", "plugins": [
    {"type": "bridge", "bridge": "cni-ate0", "isGateway": False, "ipMasq": False,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "169.254.77.0/24"}]]}}]}
# In containerd's own namespaces: the test's node over /dev/kvm, the rootfs as the root.
ENTER = """set -e
R={root}
mount --bind {node} /dev/kvm
ip link set lo up
mount --bind $R $R
mount --rbind /proc $R/proc
mount --rbind /sys $R/sys
mount --rbind /dev $R/dev
mount -t tmpfs tmpfs $R/run
mkdir -p $R/run/cdi
mount --bind {spec_dir} $R/run/cdi
cd $R
mkdir -p .oldroot
pivot_root . .oldroot
cd /
umount -l /.oldroot
exec containerd --config /ctrwork/config.toml
"""


def image_tar(path: Path, name: str) -> None:
    """A docker-archive image of two static binaries: /pause (the entrypoint, for sandboxes) and
    /probe (tests/runtime/oci_probe.c)."""
    work = path.parent / "image-build"
    work.mkdir(exist_ok=True)
    (work / "pause.c").write_bytes(PAUSE_SOURCE)
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        for binary, source in (("pause", work / "pause.c"), ("probe", oci_runtime.PROBE_SOURCE)):
            subprocess.run(["gcc", "-static", "-O2", "-o", str(work / binary), str(source)], check=True,
                           capture_output=True)
            t.add(str(work / binary), arcname=binary)
    data = layer.getvalue()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Entrypoint": ["/pause"]},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(data).hexdigest()]}})
    with tarfile.open(path, "w") as t:
        for member, blob in (("layer.tar", data), ("config.json", config.encode()),
                             ("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [name],
                                                            "Layers": ["layer.tar"]}]).encode())):
            info = tarfile.TarInfo(member)
            info.size = len(blob)
            t.addfile(info, io.BytesIO(blob))


class Containerd:
    """One containerd, its CRI on a unix socket; `run` makes a pod and reads what its probe saw."""

    def __init__(self, spec_dir: str, node: str, enable_cdi: bool) -> None:
        self.overlay = Container(cached_rootfs(ROOTFS))
        root = self.overlay.mount()
        (root / "etc/hosts").write_text("127.0.0.1 localhost\n")
        self.work = root / "ctrwork"
        (self.work / "cni").mkdir(parents=True)
        (self.work / "logs").mkdir()
        key = hashlib.sha256(PAUSE_SOURCE + oci_runtime.PROBE_SOURCE.read_bytes()).hexdigest()[:12]
        self.image = f"localhost/atedevd-cri:{key}"
        image_tar(self.work / "image.tar", self.image)
        (self.work / "config.toml").write_text(CONFIG.format(enable_cdi=str(enable_cdi).lower(), image=self.image))
        (self.work / "cni" / "10-atedevd.conflist").write_text(json.dumps(CNI))
        self._log = open(self.work / "containerd.log", "wb")
        script = ENTER.format(root=root, node=node, spec_dir=spec_dir)
        self.proc = subprocess.Popen(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c", script],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.channel = grpc.insecure_channel(f"unix:{self.work}/containerd.sock")
        deadline = time.monotonic() + 30
        while True:
            try:
                self.version = self._call("Version", cri.VersionRequest(version="v1"), cri.VersionResponse, timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"containerd did not serve: {self.log()}")
                time.sleep(0.05)
        subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "-n", "--", "ctr", "--address",
                        "/ctrwork/containerd.sock", "-n", "k8s.io", "images", "import", "/ctrwork/image.tar"],
                       check=True, capture_output=True, timeout=60)

    def log(self) -> str:
        return (self.work / "containerd.log").read_text(errors="replace")[-3000:]

    def _call(self, name: str, request, response, timeout: float = 30):
        return self.channel.unary_unary(f"/runtime.v1.RuntimeService/{name}", request_serializer=request.SerializeToString,
                                        response_deserializer=response.FromString)(request, timeout=timeout)

    def run(self, answer, user: Optional[int] = None, groups: Sequence[int] = (), userns: bool = False) -> Dict[str, object]:
        """A pod with one container given `answer` (a ContainerAllocateResponse): what it saw of
        /dev/kvm (oci_runtime.parse), or {"create": the runtime's error} when it could not be made."""
        ns = cri.NamespaceOption(network=cri.POD if userns else cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
        if userns:
            ns.userns_options.CopyFrom(cri.UserNamespace(mode=cri.POD, uids=USERNS, gids=USERNS))
        logs = f"/ctrwork/logs/{time.monotonic_ns()}"
        (self.work / "logs" / os.path.basename(logs)).mkdir()
        sandbox = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="probe", uid=str(time.monotonic_ns()), namespace="atedevd-test"),
            log_directory=logs,
            linux=cri.LinuxPodSandboxConfig(security_context=cri.LinuxSandboxSecurityContext(namespace_options=ns)))
        sid = self._call("RunPodSandbox", cri.RunPodSandboxRequest(config=sandbox), cri.RunPodSandboxResponse).pod_sandbox_id
        try:
            security = cri.LinuxContainerSecurityContext(namespace_options=ns, supplemental_groups=list(groups))
            if user is not None:
                security.run_as_user.value = user
                security.run_as_group.value = user
            config = cri.ContainerConfig(
                metadata=cri.ContainerMetadata(name="probe"), image=cri.ImageSpec(image=self.image),
                command=["/probe", "/dev/kvm"], log_path="probe.log",
                devices=[cri.Device(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
                         for d in answer.devices],
                CDI_devices=[cri.CDIDevice(name=c.name) for c in answer.cdi_devices],
                linux=cri.LinuxContainerConfig(security_context=security))
            try:
                cid = self._call("CreateContainer", cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                                               sandbox_config=sandbox),
                                 cri.CreateContainerResponse).container_id
            except grpc.RpcError as e:
                return {"create": e.details()}
            self._call("StartContainer", cri.StartContainerRequest(container_id=cid), cri.StartContainerResponse)
            deadline = time.monotonic() + 30
            while self._call("ContainerStatus", cri.ContainerStatusRequest(container_id=cid),
                             cri.ContainerStatusResponse).status.state != cri.CONTAINER_EXITED:
                assert time.monotonic() < deadline, "the probe did not exit"
                time.sleep(0.01)
            text = (self.work / "logs" / os.path.basename(logs) / "probe.log").read_text()
            return oci_runtime.parse("\n".join(line.split(" ", 3)[-1] for line in text.splitlines()))
        finally:
            self._call("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=sid), cri.StopPodSandboxResponse)
            self._call("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=sid), cri.RemovePodSandboxResponse)

    def close(self) -> None:
        self.channel.close()
        end_process(self.proc)
        self._log.close()
        self.overlay.destroy()

    def runc_version(self) -> str:
        out = subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "--", "runc", "--version"],
                             capture_output=True, text=True, timeout=30).stdout
        return out.split()[2] if out else "?"
