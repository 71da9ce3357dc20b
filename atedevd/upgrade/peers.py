"""The I/O of an upgrade handed to a successor (the decisions are atedevd/upgrade/machines.py's).

Is the atedevd installed on disk the one running? The package manager replaces our files
while we run (each by a rename: a new inode), so the files' identities taken once the
start is done tell. The successor is a fresh exec of our interpreter, isolated, in `/`,
running exactly the package we fingerprinted with our options (gRPC objects do not survive
a fork; `_command_line` says why not our command line as it was), in our own cgroup, so
that systemd can make it the main process. It inherits the instance lock and one end of a socket pair, the
channel the two talk over; their numbers, and the resources we serve, are in its
environment. Its first act is a fork, the parent half exiting at once, the other telling
us its pid: the successor is then systemd's child, not ours, as a main process
must be for systemd to see it exit and to stop it (one that is not its child systemd
supervises with a warning, and in a container kills at once on stop). Nothing here imports anything: after an upgrade, what is on disk is the
new code, and the running daemon must not load a module of it.
"""

import os
import signal
import socket
import sys
import time
from typing import Iterable, List, Mapping, MutableMapping, Optional, Tuple

from atedevd.upgrade.machines import Message

CHANNEL_FD = "ATEDEVD_HANDOFF_FD"  # the successor's end of the channel
LOCK_FD = "ATEDEVD_LOCK_FD"  # the instance lock, held by both
INHERITED = "ATEDEVD_INHERITED"  # the resources the predecessor serves, comma-separated
HANDED_FDS = "ATEDEVD_DRA_FDS"  # DRA mode: the listening sockets handed over, "name=fd,..."
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # atedevd/, every subpackage in it


def fingerprint(package_dir: str = PACKAGE_DIR) -> Tuple[Tuple[str, int, int, int], ...]:
    """The identity of every file of the package: (path, inode, size, mtime)."""
    found: List[Tuple[str, int, int, int]] = []
    for directory, dirs, files in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                try:
                    st = os.stat(path)
                except OSError:  # gone meanwhile: a file less is a change too
                    continue
                found.append((os.path.relpath(path, package_dir), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(sorted(found))


_PID = "pid "  # the successor's first message on the channel: "pid <its pid>"


class Child:
    """The successor, from its predecessor's side: its process and our end of the channel.

    `spawned` is the process we start; it forks the successor and exits 0 (`detach`), and
    the successor tells us its pid (`pid`, None until then). Until then the spawned process
    is the one to stop, and an exit of it other than 0 is the successor's: it failed before
    it forked."""

    def __init__(self, lock_fd: int, inherited: Iterable[str], fds: Optional[Mapping[str, int]] = None) -> None:
        """`fds`: descriptors it is handed too, by name (DRA mode's listening sockets)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env.update({CHANNEL_FD: str(theirs.fileno()), LOCK_FD: str(lock_fd), INHERITED: ",".join(inherited)})
        handed = dict(fds or {})
        if handed:
            env[HANDED_FDS] = ",".join(f"{name}={fd}" for name, fd in handed.items())
        argv = _command_line()
        kept = {fd: os.get_inheritable(fd) for fd in [lock_fd, *handed.values()]}
        try:
            for fd in (theirs.fileno(), lock_fd, *handed.values()):
                os.set_inheritable(fd, True)
            self.spawned: Optional[int] = os.posix_spawn(argv[0], argv, env)
        finally:
            for fd, was in kept.items():
                os.set_inheritable(fd, was)
            theirs.close()
        ours.setblocking(False)
        self.channel = ours
        self.pid: Optional[int] = None  # the successor's, once it said
        self.status: Optional[str] = None  # how it ended, once it has

    def fileno(self) -> int:
        return self.channel.fileno()

    @property
    def talking(self) -> bool:
        """Our end of the channel is open (until it hung up, or was stopped)."""
        return self.channel.fileno() >= 0

    def hang_up(self) -> None:
        self.channel.close()

    def send(self, message: Message) -> None:
        try:
            self.channel.send(message.value.encode())
        except OSError:
            pass  # it is gone: its end of the channel says so

    def receive(self) -> List[Optional[Message]]:
        """What it said; None at the end: it closed its end (it exited: nothing else closes it)."""
        said = _receive(self.channel, self._told_pid)
        if said and said[-1] is None and self.pid is not None:
            self.status = self.status or "exited"  # not our child: its status is systemd's to see
        return said

    def _told_pid(self, pid: int) -> None:
        self.pid = pid

    def ended(self, wait_s: float = 0.0) -> Optional[str]:
        """How it ended, in words, once we know (None while it runs); reaps the spawned process.
        `wait_s`: how long to wait for it to be reaped, once it closed its end of the channel
        (it is exiting: the kernel closes a process's descriptors before its status can be read)."""
        give_up = time.monotonic() + wait_s
        while self.spawned is not None:
            try:
                pid, status = os.waitpid(self.spawned, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.spawned, 0
            if pid:
                self.spawned = None
                if self.pid is None and self.status is None and status != 0:  # it never forked the successor
                    self.status = _said(status)
            elif time.monotonic() < give_up:
                time.sleep(0.001)
            else:
                break
        return self.status

    def terminate(self) -> None:
        """Ask it to stop (we stop too)."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """Stop it now (it failed): SIGKILL, and reap what is ours to reap."""
        self._signal(signal.SIGKILL)
        if self.spawned is not None:
            try:
                os.waitpid(self.spawned, 0)
            except ChildProcessError:
                pass
            self.spawned = None
        self.status = self.status or "was stopped"
        self.channel.close()

    def _signal(self, signo: int) -> None:
        for pid in (self.pid, self.spawned):  # the spawned one, while it is there, has not forked yet, or is about to exit
            if pid is not None:
                try:
                    os.kill(pid, signo)
                except ProcessLookupError:
                    pass


class Parent:
    """The predecessor, from its successor's side: our end of the channel, from the environment."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        self.channel = socket.socket(fileno=int(environ.pop(CHANNEL_FD)))
        self.lock_fd = int(environ.pop(LOCK_FD))
        self.inherited = frozenset(n for n in environ.pop(INHERITED, "").split(",") if n)
        for fd in (self.channel.fileno(), self.lock_fd):  # a successor of ours gets its own
            os.set_inheritable(fd, False)

    def detach(self) -> None:
        """Leave the process the predecessor started: fork, tell it the new pid, and let the
        parent half exit, so that the successor is systemd's child (the init process's, or
        the nearest subreaper's). Called first thing, while this process has one thread."""
        if os.fork():
            os._exit(0)
        self.channel.send(f"{_PID}{os.getpid()}".encode())  # before anything else we say
        self.channel.setblocking(False)

    @staticmethod
    def asked(environ: Mapping[str, str]) -> bool:
        """This process was started as a successor."""
        return CHANNEL_FD in environ

    def fileno(self) -> int:
        return self.channel.fileno()

    def send(self, message: Message) -> None:
        try:
            self.channel.send(message.value.encode())
        except OSError:
            pass

    def receive(self) -> List[Optional[Message]]:
        return _receive(self.channel)

    def close(self) -> None:
        self.channel.close()


def _receive(channel: socket.socket, told_pid=None) -> List[Optional[Message]]:
    out: List[Optional[Message]] = []
    while True:
        try:
            data = channel.recv(64)
        except BlockingIOError:
            return out
        except OSError:
            data = b""
        if not data:
            out.append(None)
            return out
        if told_pid is not None and data.startswith(_PID.encode()) and data[len(_PID):].isdigit():
            told_pid(int(data[len(_PID):]))
            continue
        try:
            out.append(Message(data.decode()))
        except ValueError:  # not ours: a version that speaks otherwise; end of talk
            out.append(None)
            return out


def _command_line() -> List[str]:
    """How the successor is started: this interpreter, isolated (-I: neither PYTHONPATH, the
    user's site nor the working directory on its path), in `/`, with atedevd imported from
    the package directory we fingerprinted (whatever else is on the path) and our search
    path without the entries a start from some directory put there; then `run` and our
    options (a relative --config made absolute). Started as `python3 -m atedevd` from a
    directory a user can write, the successor would otherwise import that user's
    `atedevd/` as root."""
    boot = ("import os, sys; os.chdir('/'); sys.path[:] = {path!r}; sys.dont_write_bytecode = {nobytes!r}\n"
            "import importlib.util\n"
            "spec = importlib.util.spec_from_file_location('atedevd', {init!r}, submodule_search_locations=[{pkg!r}])\n"
            "package = importlib.util.module_from_spec(spec); sys.modules['atedevd'] = package; spec.loader.exec_module(package)\n"
            "from atedevd.launch import main\n"
            "sys.exit(main(sys.argv[1:]))\n").format(
        path=search_path(), nobytes=sys.dont_write_bytecode, init=os.path.join(PACKAGE_DIR, "__init__.py"), pkg=PACKAGE_DIR)
    return [sys.executable, "-I", "-c", boot, *_absolute_config(sys.argv[1:])]


def search_path(path: Optional[List[str]] = None, cwd: Optional[str] = None, script: Optional[str] = None) -> List[str]:
    """Our module search path without what depends on where we were started: "" and
    relative entries, the working directory (`python3 -m` puts it first) and the script's
    own directory."""
    path = sys.path if path is None else path
    cwd = os.getcwd() if cwd is None else cwd
    script = sys.argv[0] if script is None else script
    unsafe = {os.path.realpath(cwd)}
    if script and os.path.isfile(script):
        unsafe.add(os.path.dirname(os.path.realpath(script)))
    return [p for p in path if os.path.isabs(p) and os.path.realpath(p) not in unsafe]


def _absolute_config(args: List[str]) -> List[str]:
    """`run`'s arguments with a relative --config made absolute (the successor runs in `/`);
    every other path option must be absolute already (the configuration's check)."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            value = arg[len("--config="):]
            if value and not os.path.isabs(value):
                out[i] = "--config=" + os.path.join(os.getcwd(), value)
        elif arg == "--config" and i + 1 < len(out) and out[i + 1] and not os.path.isabs(out[i + 1]):
            out[i + 1] = os.path.join(os.getcwd(), out[i + 1])
    return out


def _said(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by signal {os.WTERMSIG(status)}"
    return f"exited with status {os.WEXITSTATUS(status)}"


EXIT_STATUS_WAIT_S = 0.1  # a successor that hung up before it forked: its exit status is read within this (it names the failure)


class Peers:
    """The other process of an upgrade, from this one's side: the successor we started
    (`child`), or the predecessor that started us (`parent`); the channel is whichever's is open."""

    def __init__(self, parent: Optional[Parent]) -> None:
        self.parent = parent
        self.child: Optional[Child] = None

    def talking(self):
        """The one whose channel is open, if any (its descriptor is the loop's to watch)."""
        if self.child is not None and self.child.talking:
            return self.child
        return self.parent

    def start_successor(self, lock_fd: int, served: Iterable[str]) -> None:
        self.child = Child(lock_fd, served)

    def heard(self) -> List[Tuple[Optional[Message], Optional[str]]]:
        """What the other side said: (message, None), or at the end (None, how a successor
        ended, once known). A successor may die right after it spoke; once it hung up, its
        exit status is a moment away."""
        other = self.talking()
        out: List[Tuple[Optional[Message], Optional[str]]] = []
        for message in other.receive() if other is not None else ():
            if other is self.child and self.child is not None:
                gone = self.child.ended(EXIT_STATUS_WAIT_S if message is None else 0.0)
                if message is None or gone:
                    self.child.hang_up()
                    return out + [(None, gone)]
            elif message is None and self.parent is not None:  # the predecessor exited (or died)
                self.parent.close()
                self.parent = None
                return out + [(None, None)]
            out.append((message, None))
        return out

    @property
    def successor_pid(self) -> int:
        """The successor's pid: it tells it first thing, before it can say anything else."""
        pid = self.child.pid if self.child is not None else None
        if pid is None:
            raise RuntimeError("the successor has not said its pid")
        return pid

    def send(self, message: Message) -> None:
        other = self.talking()
        if other is not None:
            other.send(message)

    def stop_successor(self, kill: bool) -> None:
        if self.child is not None:
            if kill:
                self.child.kill()
            else:
                self.child.terminate()  # it lets go of what it registered; its exit ends the talk

    def reap(self) -> None:
        """A successor that has exited is reaped at once."""
        if self.child is not None:
            self.child.ended()
