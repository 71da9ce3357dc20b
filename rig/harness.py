"""Run atedevd as systemd would: a separate process, NOTIFY_SOCKET, signals, logs.

Shared by the tests, the benchmarks and the demo.
"""

import array
import fcntl
import glob
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESOURCE = "ate.dev/kvm"
SOCKET_NAME = "ate.dev-kvm.sock"  # the oldest fixed name; now ate.dev_kvm.<instance>-<n>.sock
OUR_SOCKETS = "ate.dev_kvm.*.sock"  # how `our_files` lists the daemon's sockets for RESOURCE


def socket_prefix(resource: str) -> str:
    """The resource's part of its socket names: `ate.dev/kvm` -> `ate.dev_kvm` (a domain has
    no "_", so no two resources share it). Written out here, not imported: the tests' oracle."""
    return resource.replace("/", "_", 1)


def plugin_sockets(plugin_dir: str, resource: str = RESOURCE) -> List[str]:
    """The daemon's socket files for `resource`, newest first: `<prefix>.<instance>-<n>.sock`
    (one per registration), or the oldest fixed `<domain>-<name>.sock`."""
    base = socket_prefix(resource)
    paths = glob.glob(os.path.join(glob.escape(plugin_dir), glob.escape(base) + ".*.sock"))
    paths.append(os.path.join(plugin_dir, resource.replace("/", "-") + ".sock"))
    found = []
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            found.append((st.st_mtime_ns, p))
    return [p for _, p in sorted(found, reverse=True)]


def current_socket(plugin_dir: str, resource: str = RESOURCE, kubelet=None) -> Optional[str]:
    """The path of the resource's current socket: the one kubelet's current endpoint names if a
    kubelet stand-in is given and has one, else the newest matching socket file (None if none)."""
    if kubelet is not None:
        name = kubelet.current_endpoint(resource)
        if name:
            return os.path.join(plugin_dir, name)
    found = plugin_sockets(plugin_dir, resource)
    return found[0] if found else None


def our_files(plugin_dir: str) -> List[str]:
    """The plugin directory's entries with our sockets' names normalised to `<prefix>.*.sock`
    (`ate.dev_kvm.*.sock`); the stand-in's private `.standin` directory (not kubelet's) is left out."""
    out = []
    for name in sorted(os.listdir(plugin_dir)):
        if name == ".standin":
            continue
        m = re.fullmatch(r"(ate\.dev_[^.]+(?:\.[^.]+)*?)\.[a-z0-9]+-[0-9]+\.sock", name)
        if m:
            name = m.group(1) + ".*.sock"
        out.append(name)
    return sorted(out)


def write_file(path, text: str, mode: int = 0o644) -> str:
    """A file the test plants (a configuration, a spec, a runtime's settings), with the mode
    given: the daemon's trust checks read the mode, so it is never left to the umask."""
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return str(path)


def fake_dev_root(path: str, names=("kvm",)) -> str:
    """A dev root whose nodes are symlinks to /dev/null: character devices, no root needed."""
    os.makedirs(path, exist_ok=True)
    for name in names:
        node = os.path.join(path, name)
        os.makedirs(os.path.dirname(node), exist_ok=True)
        os.symlink("/dev/null", node)
    return path


# The kernel's receive stamp of a datagram (SO_TIMESTAMPNS, SCM_TIMESTAMPNS: a struct timespec of
# the wall clock), which Python's socket module does not name.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@ll")


def kernel_stamp(ancillary) -> float:
    """The SCM_TIMESTAMPNS of a recvmsg's ancillary data, moved to the monotonic clock (the
    offset between the two clocks taken now: the same as at the stamp unless the wall clock
    was stepped meanwhile)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = _TIMESPEC.unpack(data[:_TIMESPEC.size])
            return (sec * 1_000_000_000 + nsec - (time.time_ns() - time.monotonic_ns())) / 1e9
    raise AssertionError(f"a datagram without its kernel timestamp: {ancillary}")


class FdStore:
    """systemd's file descriptor store (`FileDescriptorStoreMax=`, as DRA mode's drop-in sets it),
    as the tests stand in for it: what a daemon sent with `FDSTORE=1`, by `FDNAME=`, kept here and
    handed to the next daemon started with this store as `LISTEN_FDS` (`launch`)."""

    def __init__(self) -> None:
        self.fds: Dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, name: str, fd: int) -> None:
        with self._lock:
            old = self.fds.pop(name, None)
            self.fds[name] = fd
        if old is not None:
            os.close(old)

    def remove(self, name: str) -> None:
        with self._lock:
            fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def names(self) -> List[str]:
        with self._lock:
            return sorted(self.fds)

    def launch(self, args: List[str]) -> Tuple[List[str], Dict[str, str], Callable[[], None], Tuple[int, ...]]:
        """How to start a process as systemd does with a store: its argv (a shell sets
        LISTEN_PID to the pid it then execs), environment, a preexec_fn placing the fds at 3..,
        and the fds to keep open."""
        with self._lock:
            items = sorted(self.fds.items())
        kept = tuple(range(3, 3 + len(items)))

        def place() -> None:
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for _, fd in items]
            for i, fd in enumerate(high):
                os.dup2(fd, 3 + i)
                os.close(fd)
        env = {"LISTEN_FDS": str(len(items)), "LISTEN_FDNAMES": ":".join(n for n, _ in items)} if items else {}
        argv = ["/bin/sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", *args] if items else list(args)
        return argv, env, place, kept

    def close(self) -> None:
        for name in self.names():
            self.remove(name)


class NotifySocket:
    """The systemd end of sd_notify: a datagram socket collecting messages (and, with `store`,
    the descriptors sent with FDSTORE=1, as systemd keeps them).

    Each message's "at" is when the kernel queued the datagram (SO_TIMESTAMPNS), on the
    monotonic clock, not when this thread read it: a reader starved by a loaded machine
    reads several at once, and stamping them then would bunch what the daemon spaced."""

    def __init__(self, path: str, store: Optional[FdStore] = None):
        self.path = path
        self.store = store
        self.messages: List[dict] = []  # {"at": monotonic, "fields": {...}}
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self._sock.bind(path)
        self._sock.settimeout(0.2)
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(
                    65536, socket.CMSG_SPACE(_TIMESPEC.size) + socket.CMSG_SPACE(16 * 4))
            except socket.timeout:
                continue
            except OSError:
                return
            at = kernel_stamp(ancillary)
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            fds = [fd for level, kind, raw in ancillary if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                   for fd in array.array("i", raw[:len(raw) - len(raw) % 4])]
            if self.store is not None and fields.get("FDSTORE") == "1" and len(fds) == 1:
                self.store.put(fields.get("FDNAME", "stored"), fds.pop())
            elif self.store is not None and fields.get("FDSTOREREMOVE") == "1":
                self.store.remove(fields.get("FDNAME", "stored"))
            for fd in fds:
                os.close(fd)
            with self._cond:
                self.messages.append({"at": at, "fields": fields})
                self._cond.notify_all()

    def wait_for(self, key: str, value: Optional[str] = None, timeout: float = 10.0, after: int = 0) -> Optional[dict]:
        """The first message (from index `after`) carrying key (=value); None on timeout."""

        def find():
            for m in self.messages[after:]:
                if key in m["fields"] and (value is None or m["fields"][key] == value):
                    return m
            return None

        with self._cond:
            self._cond.wait_for(lambda: find() is not None, timeout)
            return find()

    def wait_turns(self, turns: int, since: float, timeout: float = 10.0) -> bool:
        """Until the daemon's loop has done `turns` whole turns begun after `since` (monotonic):
        `turns + 1` watchdog pings sent after it, by the kernel's stamps. A ping is the top of a
        turn, and what a turn decides (its STATUS=, its log lines) is out before the next ping:
        a barrier that comes after whatever the daemon made of its inputs up to `since`. Needs a
        daemon started with WATCHDOG_USEC."""

        def pinged() -> bool:
            return sum(1 for m in self.messages if m["at"] > since and m["fields"].get("WATCHDOG") == "1") > turns

        with self._cond:
            return self._cond.wait_for(pinged, timeout)

    def values(self, key: str) -> List[str]:
        with self._cond:
            return [m["fields"][key] for m in self.messages if key in m["fields"]]

    def close(self) -> None:
        self._stop = True
        self._sock.close()
        self._thread.join(1)


class DaemonUnderTest:
    """One `atedevd run` process with its own notify socket, runtime dir and log file."""

    def __init__(self, workdir: str, plugin_dir: str, dev_root: str, config: Optional[str] = None,
                 extra_args=(), env=None, log_level: str = "info", metrics_dir: str = "", launcher=("-m", "atedevd"),
                 cwd: str = REPO, fd_store: Optional[FdStore] = None):
        """`fd_store`: systemd's descriptor store, kept across the daemons started with it."""
        self.workdir = workdir
        self.plugin_dir = plugin_dir
        os.makedirs(workdir, exist_ok=True)
        self.notify = NotifySocket(os.path.join(workdir, f"notify-{time.monotonic_ns()}"), fd_store)
        self.log_path = os.path.join(workdir, f"daemon-{time.monotonic_ns()}.log")
        # `launcher`: how python3 is told to run the CLI (a test may wrap it: `-c CODE`).
        args = [sys.executable, *launcher, "run", "--device-plugin-dir", plugin_dir,
                "--dev-root", dev_root, "--log-level", log_level]
        if config is None:  # hermetic: never the host's /etc/atedevd/config.toml
            config = os.path.join(workdir, "empty.toml")
            open(config, "a").close()
        args += ["--config", config, "--metrics-dir", metrics_dir]  # hermetic: off unless asked, never the host's
        args += list(extra_args)
        full_env = dict(os.environ)
        full_env.pop("JOURNAL_STREAM", None)
        full_env.pop("WATCHDOG_USEC", None)
        full_env.pop("INVOCATION_ID", None)  # a test runner under systemd: no crash-loop brake (restarts.py) unless asked
        full_env.update(
            NOTIFY_SOCKET=self.notify.path,
            RUNTIME_DIRECTORY=workdir,
            PYTHONPATH=REPO,
            PYTHONUNBUFFERED="1",
        )
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        if fd_store is not None:
            args, listen, place, kept = fd_store.launch(args)
            full_env.update(listen)
            self.proc = subprocess.Popen(args, cwd=cwd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                         preexec_fn=place, pass_fds=kept)
        else:
            self.proc = subprocess.Popen(args, cwd=cwd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    @property
    def socket_path(self) -> Optional[str]:
        """The newest socket file of the default resource (the daemon makes a new one per registration)."""
        return current_socket(self.plugin_dir)

    def wait_ready(self, timeout: float = 10.0) -> dict:
        m = self.notify.wait_for("READY", "1", timeout)
        if m is None:
            raise AssertionError(f"no READY=1 within {timeout} s; log:\n{self.log()}")
        return m

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def status(self) -> Optional[str]:
        values = self.notify.values("STATUS")
        return values[-1] if values else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()
        self.notify.close()


def end_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gone(pid: int) -> bool:
    """The process is no more, or a zombie nobody reaped yet (an upgrade's successor is not our child)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def inotify_watched(pid: int) -> set:
    """The inodes process `pid` watches with inotify, read from /proc/PID/fdinfo (each watch a
    line `inotify wd:.. ino:<hex> sdev:..`): what a daemon is watching now, seen from outside."""
    found = set()
    fd_dir = f"/proc/{pid}/fdinfo"
    for fd in os.listdir(fd_dir):
        try:
            with open(os.path.join(fd_dir, fd)) as f:
                text = f.read()
        except OSError:
            continue
        found.update(int(m, 16) for m in re.findall(r"^inotify wd:\S+ ino:([0-9a-f]+)", text, re.M))
    return found


def crash_when_file_appears(message: str, name: str = "crash-now") -> str:
    """A launcher for `python3 -c` (or a file): the real CLI, with the loop made to raise
    RuntimeError(message) when a file called `name` appears in the plugin directory (the
    daemon has no test hook), while the gRPC server holds kubelet's stream."""
    return f"""
import sys
import atedevd.glue.plugin_dir

real = atedevd.glue.plugin_dir.PluginDir.on_directory_events

def on_directory_events(self, events, now):
    events = list(events)
    if any(e.name == {name!r} for e in events):
        raise RuntimeError({message!r})
    return real(self, events, now)

atedevd.glue.plugin_dir.PluginDir.on_directory_events = on_directory_events
from atedevd import cli
sys.exit(cli.main(sys.argv[1:]))
"""
