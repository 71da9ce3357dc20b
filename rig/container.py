"""A real systemd for the tests: a cached Debian rootfs (bookworm by default) booted with systemd-nspawn.

    rootfs = cached_rootfs(FULL)           # mmdebstrap once, reused while the package list is unchanged
    with Container(rootfs) as node:        # a throw-away overlayfs copy, booted, torn down on exit
        install_project(node)              # the working tree's atedevd, unit and kubelet stand-in
        node.systemctl("enable", "--now", "atedevd")

Caches live outside the repository, in $ATEDEVD_TEST_CACHE (default
/var/cache/atedevd-tests), one directory per suite and package list. Other Debian
suites (bullseye, trixie) stand in for other distributions' Python stacks in the
install tests: RootfsSpec(..., suite="trixie"). All come from the one mirror
(deb.debian.org serves bullseye, bookworm and trixie alike). A cache is built
into a temporary directory and renamed into place, so an interrupted build never
leaves a half rootfs behind. A failed build raises: without network the tests
fail, they are not skipped.

Each Container mounts an overlayfs (the cache read-only below, a scratch upper
layer above), so writes never reach the cache and a copy costs nothing. It is
booted with

    SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 systemd-nspawn --register=no --keep-unit \
        --system-call-filter=bpf --private-network -b -D ROOT

The container has its own network namespace (only lo; nothing in the tests needs
the network once the rootfs is cached), which also gives its systemd the
CAP_NET_ADMIN it needs to bring up lo in a unit's PrivateNetwork=. The other two
extras matter for the hardening tests: with the host's hybrid cgroup
layout the container's systemd gets read-only v1 controllers and cannot apply
DevicePolicy= at all, and nspawn's default seccomp filter denies bpf(), without
which systemd reports "BPF device control is not supported" and silently skips
DevicePolicy= and IPAddressDeny=. On cgroup v2 with bpf() allowed both are
enforced for real. Commands run in the container with
`nsenter -t <container init> -a`.

Needs root, mmdebstrap, systemd-container (systemd-nspawn), util-linux (nsenter,
mount) and a kernel with overlayfs.
"""

import atexit
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

RIG = Path(__file__).resolve().parent
REPO = RIG.parent
SUITE = "bookworm"  # the default suite: Debian 12, the runtime floor
SUITES = ("bullseye", "bookworm", "trixie")
MIRROR = os.environ.get("ATEDEVD_TEST_MIRROR", "http://deb.debian.org/debian")
CACHE_DIR = Path(os.environ.get("ATEDEVD_TEST_CACHE", "/var/cache/atedevd-tests"))
SCRATCH_DIR = Path(os.environ.get("ATEDEVD_TEST_SCRATCH", "/var/tmp"))
# Bump when bootstrap_argv() or _prepare() changes what a cached rootfs contains.
LAYOUT = 2  # 2: mmdebstrap

# procps: /bin/kill for the unit's ExecReload=, as on every real node.
BASE_PACKAGES = ("systemd", "systemd-sysv", "dbus", "procps")
# Debian's own runtime stack, the one the .deb depends on.
RUNTIME_PACKAGES = (
    "python3",
    "python3-grpcio",
    "python3-protobuf",
    "python3-systemd",
    "python3-sdnotify",
    "python3-inotify",
)

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
SOCKET = PLUGIN_DIR + "/ate.dev-kvm.sock"  # the oldest fixed name; now one name per registration
SOCKET_GLOB = PLUGIN_DIR + "/ate.dev_kvm.*.sock"
RESOURCE = "ate.dev/kvm"
TEST_LIB = "/usr/local/lib/atedevd-tests"  # the kubelet stand-in and probes, inside the container
STANDIN_UNIT = "kubelet-standin"
STANDIN_STATE = "/run/kubelet-standin/state.json"


@dataclass(frozen=True)
class RootfsSpec:
    """What a cached rootfs holds: packages installed, and packages only downloaded into apt's cache."""

    name: str
    include: Tuple[str, ...]
    download: Tuple[str, ...] = ()
    suite: str = SUITE

    def __post_init__(self):
        if self.suite not in SUITES:
            raise ValueError(f"suite {self.suite!r} is not one of {SUITES}")

    def key(self) -> str:
        blob = json.dumps([LAYOUT, self.suite, "minbase", sorted(self.include), sorted(self.download)])
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# For the service tests: the runtime installed, the project copied in from the working tree.
# DRA mode's client, which the .deb recommends: the unit's DRA drop-in is tested with it.
DRA_PACKAGES = ("python3-kubernetes",)
FULL = RootfsSpec("full", BASE_PACKAGES + RUNTIME_PACKAGES + DRA_PACKAGES)
# For the install tests: a node without atedevd's dependencies; apt resolves them from its
# cache (downloaded when the rootfs was built), so installing the .deb proves its Depends.
CLEAN = RootfsSpec("clean", BASE_PACKAGES, download=RUNTIME_PACKAGES)


def clean(suite: str) -> RootfsSpec:
    """CLEAN for another suite: trixie's stack is Python 3.13, python3-grpcio 1.51, python3-protobuf 3.21."""
    return RootfsSpec("clean", BASE_PACKAGES, download=RUNTIME_PACKAGES, suite=suite)


def bare(suite: str) -> RootfsSpec:
    """A node with python3 and systemd and none of atedevd's Python dependencies: for the
    self-contained packages (bullseye: Python 3.9, whose python3-grpcio 1.30 is too old)."""
    return RootfsSpec("bare", BASE_PACKAGES + ("python3",), suite=suite)


class HarnessError(RuntimeError):
    """The harness itself failed (build, boot, teardown): the test errors out, it is never skipped."""


def _run(argv: Sequence[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HarnessError(f"{shlex.join(argv)}: {e}") from None
    if p.returncode != 0:
        raise HarnessError(f"{shlex.join(argv)} exited {p.returncode}:\n{p.stdout[-4000:]}")
    return p


# --- the cached rootfs -------------------------------------------------------------


def cached_rootfs(spec: RootfsSpec = FULL) -> Path:
    """The rootfs for `spec`, built with mmdebstrap on first use (about half a minute)."""
    dest = CACHE_DIR / f"{spec.suite}-{spec.name}-{spec.key()}"
    if dest.is_dir():
        return dest
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # One builder at a time; the others then find it built. A POSIX lock (lockf), not flock:
    # a process forked meanwhile (the simulation's workers) would hold a flock for as long as
    # it lives, and a POSIX lock is the process's own, so the threads (prefetch) take turns
    # on _BUILDING first.
    with _BUILDING, open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        if dest.is_dir():
            return dest
        for stale in CACHE_DIR.glob(".build-*"):  # an interrupted build, never renamed into place
            _remove_build(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{dest.name}-", dir=CACHE_DIR))
        try:
            os.chmod(tmp, 0o755)
            _run(bootstrap_argv(spec, tmp), timeout=1200)
            _prepare(tmp, spec)
            os.rename(tmp, dest)
        except BaseException:
            _remove_build(tmp)
            raise
    return dest


_BUILDING = threading.Lock()


def _remove_build(path: Path) -> None:
    """A build's directory, with what mmdebstrap had mounted in it (/proc, /sys, /dev/pts
    of a build that was killed) unmounted first."""
    inside = str(path) + "/"
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for point in sorted((m for m in mounts if m.startswith(inside)), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def bootstrap_argv(spec: RootfsSpec, dest: Path) -> list:
    """mmdebstrap (apt does the work: 25 s for FULL here, where debootstrap's shell took 54):
    minbase (Essential and apt) and `spec.include`, apt's lists and cache cleaned. With
    `spec.download`, apt's lists are kept (so `apt install ./x.deb` resolves) and its cache
    holds only those packages' .debs (so it resolves them without the network); nothing of
    them is installed."""
    argv = ["mmdebstrap", "--quiet", "--variant=minbase", "--include=" + ",".join(spec.include)]
    if spec.download:
        argv += ["--skip=cleanup/apt/lists,cleanup/apt/cache", '--customize-hook=chroot "$1" apt-get clean',
                 '--customize-hook=chroot "$1" apt-get install -y -qq --download-only --no-install-recommends '
                 + " ".join(spec.download)]
    return argv + [spec.suite, str(dest), MIRROR]


_prefetch: Optional[threading.Thread] = None
_prefetch_stop = threading.Event()


def prefetch(specs: Sequence[RootfsSpec]) -> None:
    """Build the rootfs of `specs` that are not cached yet, one after the other, in a thread
    of this process, while the tests that need none run (a build is half waiting: the mirror
    and the disk). A test that needs one waits for it in cached_rootfs (the lock); a build
    that fails here fails again there, in that test. Needs root and mmdebstrap; else a no-op."""
    global _prefetch
    wanted = [s for s in dict.fromkeys(specs) if not (CACHE_DIR / f"{s.suite}-{s.name}-{s.key()}").is_dir()]
    if not wanted or _prefetch is not None or os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        return

    def build() -> None:
        for spec in wanted:
            if _prefetch_stop.is_set():
                return
            try:
                cached_rootfs(spec)
            except Exception:  # noqa: BLE001 - the test that needs it meets it again
                pass

    _prefetch = threading.Thread(target=build, name="rootfs-prefetch", daemon=True)
    _prefetch.start()


def prefetch_done(stop: bool = False) -> None:
    """Wait until the builds `prefetch` began are over: before a test whose timing another
    build's CPU and disk would disturb (the boot); `stop`: only the one under way (the
    session ends: a build left running would outlive it, holding no lock)."""
    if stop:
        _prefetch_stop.set()
    if _prefetch is not None:
        _prefetch.join()


def _prepare(root: Path, spec: RootfsSpec) -> None:
    (root / "etc/hostname").write_text("atedevd-test\n")


def run_in_rootfs(root: Path, *argv: str) -> None:
    """Run one command in `root`, not booted (as an image build does), with /proc, /dev and resolv.conf set up."""
    _run(["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", f"--machine=atedevd-build-{os.getpid()}",
          "-D", str(root), "--setenv=DEBIAN_FRONTEND=noninteractive", *argv], timeout=900)


# --- one booted container --------------------------------------------------------------


@dataclass
class Container:
    """A throw-away overlay of a cached rootfs, booted with systemd-nspawn."""

    base: Path
    name: str = field(default_factory=lambda: f"atedevd-test-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}")
    boot_timeout: float = 120.0

    def __post_init__(self):
        self.workdir: Optional[Path] = None
        self.root: Optional[Path] = None
        self.proc: Optional[subprocess.Popen] = None
        self.pid: Optional[int] = None  # the container's init, as the host sees it
        self._log = None

    # -- life cycle

    def __enter__(self) -> "Container":
        try:
            self.mount()
            self.boot()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def mount(self) -> Path:
        """Mount the overlay; files can be put in place (under self.root) before booting."""
        reap_stale()
        _teardown_on_sigterm()
        SCRATCH_DIR.mkdir(parents=True, exist_ok=True)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"atedevd-nspawn-{os.getpid()}-", dir=SCRATCH_DIR))
        atexit.register(self.destroy)
        for d in ("upper", "work", "root"):
            (self.workdir / d).mkdir()
        opts = f"lowerdir={self.base},upperdir={self.workdir}/upper,workdir={self.workdir}/work"
        _run(["mount", "-t", "overlay", "overlay", "-o", opts, str(self.workdir / "root")])
        self.root = self.workdir / "root"
        return self.root

    def boot(self) -> None:
        assert self.root is not None, "mount() first"
        self._log = open(self.workdir / "console.log", "a")
        env = {"PATH": CONTAINER_PATH, "LANG": "C.UTF-8", "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "--register=no", "--keep-unit", "--system-call-filter=bpf", "--private-network",
             f"--machine={self.name}", "-b", "-D", str(self.root)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
        (self.workdir / "nspawn.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + self.boot_timeout
        while self.pid is None:
            self._check_alive()
            self.pid = _child_named(self.proc.pid, "systemd")
            if time.monotonic() > deadline:
                raise HarnessError(f"container init never started\n{self.console()}")
            time.sleep(0.05)
        # systemctl fails until the manager listens on its private socket: poll, then wait for boot.
        state = ""
        while time.monotonic() < deadline:
            self._check_alive()
            p = self.run("systemctl", "is-system-running", "--wait", check=False,
                         timeout=max(1.0, deadline - time.monotonic()))
            state = p.stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.1)
        else:
            raise HarnessError(f"container did not finish booting (state {state!r})\n{self.console()}")
        if state == "degraded":
            failed = self.run("systemctl", "--failed", "--no-legend", check=False).stdout
            raise HarnessError(f"container booted degraded:\n{failed}\n{self.console()}")

    def shutdown(self) -> None:
        """Power off (or kill) the container; the overlay stays mounted. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn: ask init for a clean poweroff
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                if self.pid is not None:
                    _kill(self.pid)  # killing the pid namespace's init kills everything in it
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)
        self.pid = None

    def destroy(self) -> None:
        """Shut down, unmount, delete the scratch layer. Idempotent."""
        self.shutdown()
        if self.workdir is not None:
            _teardown_dir(self.workdir)
            self.workdir = None
        self.root = None

    def console(self, lines: int = 60) -> str:
        try:
            return "\n".join((self.workdir / "console.log").read_text(errors="replace").splitlines()[-lines:])
        except (OSError, TypeError):
            return ""

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise HarnessError(f"systemd-nspawn exited {self.proc.returncode}\n{self.console()}")

    # -- running things inside

    def run(self, *argv: str, check: bool = True, timeout: float = 60, input: Optional[str] = None,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        """Run argv inside the container (all its namespaces); stdout and stderr separate, text."""
        assert self.pid is not None, "container not booted"
        e = {"PATH": CONTAINER_PATH, "LANG": "C.UTF-8", "TERM": "dumb", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0",
             "DEBIAN_FRONTEND": "noninteractive"}
        e.update(env or {})
        cmd = ["nsenter", "-t", str(self.pid), "-a", "--", *argv]
        p = subprocess.run(cmd, input=input, stdin=None if input is not None else subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout, env=e)
        if check and p.returncode != 0:
            raise AssertionError(f"in container: {shlex.join(argv)} exited {p.returncode}\n"
                                 f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
        return p

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run("/bin/sh", "-ec", script, **kw)

    def systemctl(self, *args: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess:
        return self.run("systemctl", "--no-pager", *args, check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> Dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self, unit: str = "atedevd") -> int:
        return int(self.show(unit, "MainPID")["MainPID"])

    def journal(self, *args: str) -> str:
        return self.run("journalctl", "--no-pager", *args).stdout

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    # -- files (host side; only for paths on the rootfs, not on the container's tmpfs mounts)

    def path(self, container_path: str) -> Path:
        assert self.root is not None
        return self.root / container_path.lstrip("/")

    def write(self, container_path: str, text: str, mode: int = 0o644) -> None:
        p = self.path(container_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        os.chmod(p, mode)

    def copy_in(self, src: Path, container_path: str) -> None:
        dst = self.path(container_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)


def _child_named(ppid: int, comm: str) -> Optional[int]:
    try:
        children = Path(f"/proc/{ppid}/task/{ppid}/children").read_text().split()
    except OSError:
        return None
    for c in children:
        try:
            if Path(f"/proc/{c}/comm").read_text().strip() == comm:
                return int(c)
        except OSError:
            continue
    return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _teardown_dir(workdir: Path) -> None:
    root = workdir / "root"
    if os.path.ismount(root):
        for _ in range(20):
            if subprocess.run(["umount", str(root)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)
        else:
            subprocess.run(["umount", "--lazy", str(root)], capture_output=True)
    shutil.rmtree(workdir, ignore_errors=True)


def _teardown_on_sigterm() -> None:
    """A CI timeout sends SIGTERM, which would kill Python without teardown: make it an interrupt instead,
    so pytest stops and the fixtures power off and unmount (reap_stale() is the net for SIGKILL)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        pass


def reap_stale() -> None:
    """Tear down what a killed test session left behind: its container, overlay mount and scratch dir."""
    for d in SCRATCH_DIR.glob("atedevd-nspawn-*-*"):
        try:
            owner = int(d.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if owner == os.getpid() or _alive(owner):
            continue
        try:
            nspawn = int((d / "nspawn.pid").read_text())
            if str(d / "root").encode() in Path(f"/proc/{nspawn}/cmdline").read_bytes():
                init = _child_named(nspawn, "systemd")
                if init:
                    _kill(init)
                _kill(nspawn)
                deadline = time.monotonic() + 5
                while _alive(nspawn) and time.monotonic() < deadline:  # gone, and its mounts with it
                    time.sleep(0.05)
        except (OSError, ValueError):
            pass
        _teardown_dir(d)
    for d in Path("/run/systemd/nspawn/propagate").glob("atedevd-test-*-*"):
        try:
            if not _alive(int(d.name.split("-")[2])):
                shutil.rmtree(d, ignore_errors=True)
        except (IndexError, ValueError):
            pass


# --- the project and the kubelet stand-in, inside -----------------------------------------

ATEDEVD_SCRIPT = """#!/usr/bin/python3
# Test install from the working tree; the packages' console script does the same (atedevd.launch:main).
import sys
from atedevd.launch import main
sys.exit(main())
"""


def install_project(node: Container) -> None:
    """The working tree's package, /usr/bin/atedevd, the unit and the test helpers, as a package would."""
    node.copy_in(REPO / "atedevd", "/usr/lib/python3/dist-packages/atedevd")
    node.write("/usr/bin/atedevd", ATEDEVD_SCRIPT, 0o755)
    node.copy_in(REPO / "systemd/atedevd.service", "/etc/systemd/system/atedevd.service")
    install_test_helpers(node)
    # Byte-compiled, as the packages' py3compile/brp scripts leave it: the sandbox cannot
    # write __pycache__, so without it every start compiles every module (~10 ms).
    compile_argv = ("/usr/bin/python3", "-m", "compileall", "-q", "/usr/lib/python3/dist-packages/atedevd")
    if node.pid is not None:
        node.run(*compile_argv)
        node.daemon_reload()
    else:
        run_in_rootfs(node.root, *compile_argv)


def install_test_helpers(node: Container) -> None:
    for helper in ("kubelet_standin.py", "kubelet_model.py", "node_agent.py", "apiserver_standin.py", "dra_kubelet.py",
                   "dra_kubelet_model.py"):
        node.copy_in(RIG / helper, f"{TEST_LIB}/{helper}")
    for helper in RIG.glob("container_*.py"):
        node.copy_in(helper, f"{TEST_LIB}/{helper.name}")


def fake_kvm(node: Container, present: bool = True) -> None:
    """A character device at /dev/kvm (10:232, as the real one): the daemon only stats and watches it."""
    if present:
        node.sh("[ -c /dev/kvm ] || mknod -m 0660 /dev/kvm c 10 232")
    else:
        node.run("rm", "-f", "/dev/kvm")


def start_standin(node: Container, *extra: str, pythonpath: str = "", script: str = "kubelet_standin.py") -> None:
    """kubelet stand-in as a transient unit; creates the plugin directory as kubelet does.
    `pythonpath`: where it finds grpc and atedevd.api on a node without Debian's python3-grpcio
    (a self-contained package's /usr/lib/atedevd/site-packages:/usr/lib/atedevd).
    `script`: container_timed_standin.py adds timestamps to the state (same arguments)."""
    stop_standin(node)
    node.run("mkdir", "-p", "-m", "0750", "/var/lib/kubelet", PLUGIN_DIR, "/run/kubelet-standin")
    node.run("rm", "-f", STANDIN_STATE)
    env = [f"--setenv=PYTHONPATH={pythonpath}"] if pythonpath else []
    node.run("systemd-run", f"--unit={STANDIN_UNIT}", "--property=KillSignal=SIGTERM", *env, "--",
             "/usr/bin/python3", f"{TEST_LIB}/{script}", "serve",
             "--plugin-dir", PLUGIN_DIR, "--state", STANDIN_STATE, *extra)
    wait_until(lambda: standin_state(node) is not None, 30, "kubelet stand-in to write its state",
               lambda: node.journal("-u", STANDIN_UNIT, "-n", "30"))


def our_sockets(node: "Container") -> list:
    """The daemon's socket files for ate.dev/kvm (`ate.dev_kvm.<instance>-<n>.sock`)."""
    out = node.run("find", PLUGIN_DIR, "-maxdepth", "1", "-type", "s", "-name", "ate.dev_kvm.*.sock", check=False).stdout
    return sorted(line for line in out.splitlines() if line.strip())


def stop_standin(node: Container) -> None:
    node.systemctl("stop", STANDIN_UNIT, check=False)
    node.systemctl("reset-failed", STANDIN_UNIT, check=False)


def standin_state(node: Container) -> Optional[dict]:
    p = node.run("cat", STANDIN_STATE, check=False)
    if p.returncode != 0 or not p.stdout.strip():
        return None
    return json.loads(p.stdout)


def resource_state(node: Container, resource: str = RESOURCE) -> dict:
    """The stand-in's view of one resource ({} before it was ever registered)."""
    return ((standin_state(node) or {}).get("resources") or {}).get(resource) or {}


def wait_registered(node: Container, registrations: int = 1, healthy: int = 1024, timeout: float = 60) -> dict:
    """Until the stand-in has seen `registrations` registrations and holds an open stream with `healthy` units."""

    def ok():
        r = resource_state(node)
        return r.get("registrations", 0) >= registrations and r.get("connected") and r.get("healthy") == healthy

    wait_until(ok, timeout, f"{RESOURCE}: >= {registrations} registrations, connected, {healthy} healthy",
               lambda: f"stand-in: {resource_state(node)}\n{diagnostics(node)}")
    return resource_state(node)


def diagnostics(node: Container) -> str:
    """What a person would look at first when a service test fails."""
    parts = []
    for argv in (("systemctl", "--no-pager", "status", "atedevd"),
                 ("journalctl", "--no-pager", "-u", "atedevd", "-n", "40"),
                 ("journalctl", "--no-pager", "-u", STANDIN_UNIT, "-n", "15")):
        p = node.run(*argv, check=False)
        parts.append(f"$ {shlex.join(argv)}\n{p.stdout}{p.stderr}")
    return "\n".join(parts)


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               explain: Optional[Callable[[], str]] = None, interval: float = 0.1):
    """Poll `predicate` until it is truthy; fail with `what` (and `explain()`) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n" + (explain() if explain else ""))
        time.sleep(interval)
