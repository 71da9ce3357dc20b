"""A real container runtime for the tests: podman (root) with runc or crun, given what an
Allocate answer says, as the CRI runtime kubelet calls would be given it.

The image is one static binary, `probe` (tests/runtime/oci_probe.c), imported with `podman import`
(no registry is reachable): it stats each path, opens it read-write and asks KVM its API
version, and prints what happened. Each run is in a mount namespace of its own, so that what
the test lays out is what the runtime sees and nothing else on the host changes:

- the test's spec directory is bound over /run/cdi (podman 4.3 reads /etc/cdi and /var/run/cdi
  and has no setting for another);
- the test's device node is bound over the host's /dev/kvm: a runtime in a user namespace
  cannot mknod, and runc then bind-mounts the host's node at the container path;
- the container's stdin is a pipe (`-i`), never /dev/null: crun 1.8 in a user namespace chowns
  its stdio to the container's user, and a /dev/null stdin is the host's own /dev/null (seen
  here: it became 101000:101000); `run` fails if any host node it could touch changed owner
  or mode, after putting it back;
- for crun, this host's cgroup v2 hierarchy (mounted beside the v1 controllers, with hugetlb
  in it) is unmounted: crun 1.8 refuses such a hybrid setup ("cgroups in hybrid mode not
  supported"); the v1 devices controller stays, and with it the device cgroup.
"""

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
PROBE_SOURCE = HERE / "oci_probe.c"
CACHE_DIR = Path(os.environ.get("ATEDEVD_TEST_CACHE", "/var/cache/atedevd-tests"))
# podman's defaults exceed this sandbox's limits
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
USERNS = ("--uidmap", "0:100000:65536", "--gidmap", "0:100000:65536")  # what hostUsers: false gives a pod


def missing() -> Optional[str]:
    """Why the runtimes cannot be driven here, or None."""
    for tool in ("podman", "runc", "crun", "gcc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make deps installs it)"
    if os.geteuid() != 0:
        return "podman runs as root here"
    if not os.path.exists("/dev/kvm"):
        return "no /dev/kvm on this host to bind the test's node over"
    return None


def versions() -> Dict[str, str]:
    """The runtimes' versions, as the record of what was measured."""
    out = {}
    for tool, args in (("podman", ["--version"]), ("runc", ["--version"]), ("crun", ["--version"])):
        text = subprocess.run([tool, *args], capture_output=True, text=True).stdout
        out[tool] = text.splitlines()[0].split()[-1] if text else "?"
    return out


def image() -> str:
    """The probe image's name, built and imported once per source."""
    key = hashlib.sha256(PROBE_SOURCE.read_bytes()).hexdigest()[:12]
    name = f"localhost/atedevd-probe:{key}"
    if subprocess.run(["podman", "image", "exists", name]).returncode == 0:
        return name
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".probe-", dir=CACHE_DIR))
    try:
        (work / "root").mkdir()
        subprocess.run(["gcc", "-static", "-O2", "-o", str(work / "root" / "probe"), str(PROBE_SOURCE)], check=True,
                       capture_output=True)
        subprocess.run(["tar", "-C", str(work / "root"), "-cf", str(work / "image.tar"), "."], check=True)
        subprocess.run(["podman", "import", str(work / "image.tar"), name], check=True, capture_output=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return name


def _hybrid() -> bool:
    try:
        with open("/sys/fs/cgroup/unified/cgroup.controllers") as f:
            return bool(f.read().split())
    except OSError:
        return False


def run(runtime: str, spec_dir: str, node: str, device_args: Sequence[str], user_args: Sequence[str] = (),
        paths: Sequence[str] = ("/dev/kvm",)) -> Dict[str, object]:
    """Run the probe in a container made by `runtime` ("runc", "crun") and read what it saw:
    {"stat": (mode, uid, gid, major, minor) or None, "open": "ok" or the errno's name,
    "ioctl": KVM's API version or None, "uid": the process's uid}."""
    os.makedirs("/run/cdi", exist_ok=True)  # a mount point for the test's spec directory
    setup = [f"mount --bind {_q(spec_dir)} /run/cdi", f"mount --bind {_q(node)} /dev/kvm"]
    if runtime == "crun" and _hybrid():
        setup.insert(0, "umount /sys/fs/cgroup/unified")
    command = ["podman", "run", "--rm", "-i", "--runtime", runtime, "--network", "none", *LIMITS, *device_args,
               *user_args, image(), "/probe", *paths]
    script = " && ".join(setup) + " && exec " + " ".join(map(_q, command))
    before = _host_nodes()
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          input="", capture_output=True, text=True, timeout=60)
    after = _host_nodes()
    changed = {path: (was, after.get(path)) for path, was in before.items() if after.get(path) != was}
    for path, (was, now) in changed.items():
        if now is None:
            continue
        os.chown(path, was[1], was[2])
        os.chmod(path, was[0])
    if changed:
        raise AssertionError(f"{runtime} changed host nodes (put back): {changed}")
    if done.returncode != 0:
        raise AssertionError(f"{runtime} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return parse(done.stdout)


def _host_nodes() -> Dict[str, tuple]:
    """(mode, uid, gid) of the host's nodes a container's stdio or default devices could reach."""
    out = {}
    for path in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/kvm"):
        try:
            st = os.stat(path)
        except OSError:
            continue
        out[path] = (st.st_mode & 0o7777, st.st_uid, st.st_gid)
    return out


def parse(text: str) -> Dict[str, object]:
    seen: Dict[str, object] = {"stat": None, "open": None, "ioctl": None, "uid": None}
    for line in text.splitlines():
        m = re.fullmatch(r"stat \S+ mode=([0-7]+) uid=(\d+) gid=(\d+) rdev=(\d+):(\d+)", line)
        if m:
            seen["stat"] = (int(m.group(1), 8), *map(int, m.group(2, 3, 4, 5)))
        m = re.fullmatch(r"open \S+ (?:ok ioctl=(-?\d+)|errno=(\w+))", line)
        if m:
            seen["open"] = "ok" if m.group(1) is not None else m.group(2)
            seen["ioctl"] = int(m.group(1)) if m.group(1) is not None else None
        m = re.fullmatch(r"uid=(\d+) gid=\d+", line)
        if m:
            seen["uid"] = int(m.group(1))
    return seen


def device_args(answer, dev_root: str) -> List[str]:
    """podman's --device arguments for one container's Allocate answer: a DeviceSpec's host path
    (looked up under the daemon's dev root, as the daemon does) and each CDI name."""
    args = []
    for spec in answer.devices:
        host = os.path.join(dev_root, os.path.relpath(spec.host_path, "/dev"))
        args += ["--device", f"{host}:{spec.container_path}:{spec.permissions}"]
    for name in answer.cdi_devices:
        args += ["--device", name.name]
    return args


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
