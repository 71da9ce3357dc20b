"""inotify on the directories the daemon cares about, even before they exist,
and polling where inotify is not to be had.

We make the system calls through ctypes ourselves, with errno, and read the
descriptor ourselves: the `inotify` package's adapter polls every second (idle
CPU, event latency) and its `calls` module loses errno, which is how we tell a
vanished directory from an exhausted limit. A directory that does not exist
yet is watched through its nearest existing ancestor and re-armed as the path
appears.

When inotify fails for a reason other than a vanishing path (the per-user
`fs.inotify.max_user_instances` limit on `inotify_init`, `max_user_watches` on
`inotify_add_watch`, no read permission, ...), we say so once, loudly, and poll
the directories we could not watch about once a second: each scan is diffed
against the previous one and turned into events of the same shape as inotify's,
so the control loop cannot tell the difference except by their latency. The
loop learns when to call `read()` without fd activity from `poll_deadline()`.
Every RETRY_S we try inotify again; when it works again we say that too.
"""

import ctypes
import errno
import logging
import os
import stat
import struct
import time
from typing import Dict, Iterable, List, Optional, Set, Tuple

import inotify.constants as c

from atedevd.record import Record
from atedevd.systemd import event

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len

MASK = (
    c.IN_CREATE
    | c.IN_DELETE
    | c.IN_MOVED_FROM
    | c.IN_MOVED_TO
    | c.IN_ATTRIB
    | c.IN_DELETE_SELF
    | c.IN_MOVE_SELF
    | c.IN_ONLYDIR
)
# Events after which the set of existing directories may have changed.
_TOPOLOGY = c.IN_DELETE_SELF | c.IN_MOVE_SELF | c.IN_IGNORED | c.IN_Q_OVERFLOW

POLL_INTERVAL_S = 1.0  # how often unwatched directories are scanned
RETRY_S = 30.0  # how often inotify is tried again for them
OVERFLOW_SAY_EVERY_S = 60.0  # the kernel's queue overflowed: said this often at most

# The path is going or gone: watch its parent instead (not a reason to poll).
_VANISHED = (errno.ENOENT, errno.ENOTDIR)

# libc is already in the process: no lookup (ctypes.util would import half the stdlib).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


def _check(result: int) -> int:
    if result < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return result


def _init() -> int:
    return _check(_libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))  # IN_NONBLOCK, IN_CLOEXEC


def _add_watch(fd: int, path: str) -> int:
    return _check(_libc.inotify_add_watch(fd, os.fsencode(path), MASK))


def _rm_watch(fd: int, wd: int) -> None:
    _check(_libc.inotify_rm_watch(fd, wd))


class DirEvent(Record):
    directory: str  # the watched directory the event happened in
    name: str  # the entry's name, "" for events on the directory itself
    mask: int

    def is_(self, flags: int) -> bool:
        return bool(self.mask & flags)


# What a scan remembers of an entry: its inode and file type (a new one is a new
# file: IN_DELETE + IN_CREATE), and what else inotify would report as IN_ATTRIB.
_Entry = Tuple[int, int, tuple]  # inode, S_IFMT, metadata
_Scan = Optional[Tuple[_Entry, Dict[str, _Entry]]]  # None: the directory does not exist


class Watcher:
    """Watches a set of directories; `fileno()` goes into the control loop's poll,
    and `read()` is also due at `poll_deadline()` while any directory is polled."""

    def __init__(self) -> None:
        self._wanted: Set[str] = set()
        self._by_path: Dict[str, int] = {}
        self._by_wd: Dict[int, str] = {}
        self._polled: Dict[str, _Scan] = {}  # wanted directories inotify could not watch
        self._next_poll = 0.0
        self._next_retry = 0.0
        self._complained: Set[int] = set()  # errnos already logged in this episode
        self._overflow_said: Optional[float] = None
        self._spare: Optional[int] = None  # write end of the stand-in pipe, while inotify_init fails
        try:
            self._fd: int = _init()
        except OSError as e:
            self._complain(e, "inotify_init", None)
            # The loop polls fileno() from the start, so hand it a descriptor that
            # never fires; a later inotify_init is dup2'ed onto the same number.
            self._fd, self._spare = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._inotify = False
            self._next_retry = time.monotonic() + RETRY_S
        else:
            self._inotify = True

    def fileno(self) -> int:
        return self._fd

    def poll_deadline(self) -> Optional[float]:
        """Monotonic time at which `read()` is due even without fd activity; None when
        every directory is on inotify."""
        return self._next_poll if self._polled else None

    def want(self, directories: Iterable[str]) -> None:
        """Watch exactly these directories (or their nearest existing ancestors)."""
        self._wanted = {os.path.normpath(d) for d in directories}
        self.rearm()

    def rearm(self) -> None:
        """Move each watch to the deepest existing directory of its wanted path;
        poll the wanted paths inotify refuses."""
        armed: Set[str] = set()
        polled: Dict[str, _Scan] = {}
        for d in sorted(self._wanted):
            path = self._arm(d) if self._inotify else None
            if path is not None:
                armed.add(path)
            else:
                polled[d] = self._polled[d] if d in self._polled else _scan(d)
        for path in list(self._by_path):
            if path not in armed:
                self._drop(path)
        if polled and not self._polled:
            self._next_poll = time.monotonic() + POLL_INTERVAL_S
        self._polled = polled
        if not polled and self._inotify and self._complained:
            self._complained.clear()
            event(logging.INFO, "inotify-ok", "inotify works again for every watched directory; polling stopped")

    def _arm(self, wanted: str) -> Optional[str]:
        """Watch the deepest existing directory on the way to `wanted`; returns it,
        or None when inotify refused (the caller polls `wanted`).

        A directory can vanish between the check and the watch (a recursive
        delete): then its parent is watched instead, so no path goes unwatched.
        """
        path = _deepest_existing(wanted)
        while True:
            if path in self._by_path:
                return path
            try:
                wd = _add_watch(self._fd, path)
            except OSError as e:
                parent = os.path.dirname(path)
                if e.errno in _VANISHED and parent != path:
                    path = parent
                    continue
                self._complain(e, "inotify_add_watch", path)
                return None
            self._by_path[path] = wd
            self._by_wd[wd] = path
            return path

    def read(self) -> List[DirEvent]:
        """Every event queued now (never blocks), and the changes polling found if a
        scan is due; re-arms when directories come or go."""
        events: List[DirEvent] = []
        while self._inotify:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                break
            events.extend(self._parse(buf))
        now = time.monotonic()
        if self._polled and now >= self._next_poll:
            self._next_poll = now + POLL_INTERVAL_S
            for d, old in self._polled.items():
                new = _scan(d)
                events.extend(_diff(d, old, new))
                self._polled[d] = new
        retry = bool(self._polled) and now >= self._next_retry
        if retry:
            self._next_retry = now + RETRY_S
            self._retry_init()
        if retry or any(e.is_(_TOPOLOGY) or (e.is_(c.IN_ISDIR) and e.name) for e in events):
            self.rearm()
        if any(e.is_(c.IN_Q_OVERFLOW) for e in events) and (
                self._overflow_said is None or now - self._overflow_said >= OVERFLOW_SAY_EVERY_S):
            self._overflow_said = now  # a burst in a watched directory: said once a minute at most
            event(logging.WARNING, "inotify-overflow", _overflow_warning())
        return events

    def close(self) -> None:
        os.close(self._fd)
        if self._spare is not None:
            os.close(self._spare)

    def _retry_init(self) -> None:
        if self._inotify:
            return
        try:
            fd = _init()
        except OSError:
            return  # said once already
        os.dup2(fd, self._fd, inheritable=False)  # same number: the loop keeps polling it
        os.close(fd)
        if self._spare is not None:
            os.close(self._spare)
        self._spare = None
        self._inotify = True

    def _complain(self, e: OSError, call: str, path: Optional[str]) -> None:
        """Log an inotify failure loudly, once per kind until inotify works again."""
        number = e.errno or 0
        if number in self._complained:
            return
        self._complained.add(number)
        what = f"{call}({path})" if path else call
        code = errno.errorcode.get(number, str(number))
        event(logging.ERROR, "inotify-unavailable",
              f"{what} failed: {e.strerror} ({code}){_advice(number, path)}; polling "
              f"{'the directories inotify cannot watch' if path else 'every watched directory'} every {POLL_INTERVAL_S:g} s instead, "
              "so kubelet restarts and device changes are noticed up to that much later")

    def _parse(self, buf: bytes) -> Iterable[DirEvent]:
        offset = 0
        while offset + _HEADER.size <= len(buf):
            wd, mask, _cookie, length = _HEADER.unpack_from(buf, offset)
            offset += _HEADER.size
            name = buf[offset : offset + length].rstrip(b"\0").decode(errors="surrogateescape")
            offset += length
            if mask & c.IN_IGNORED:
                path = self._by_wd.pop(wd, None)
                if path is not None and self._by_path.get(path) == wd:
                    del self._by_path[path]
            yield DirEvent(self._by_wd.get(wd, ""), name, mask)

    def _drop(self, path: str) -> None:
        wd = self._by_path.pop(path)
        self._by_wd.pop(wd, None)
        try:
            _rm_watch(self._fd, wd)
        except OSError:
            pass  # already gone with its directory


def _overflow_warning() -> str:
    """What to say when the kernel's event queue overflowed, with its limit where it can be read."""
    try:
        with open("/proc/sys/fs/inotify/max_queued_events") as f:
            limit = f" (fs.inotify.max_queued_events is {f.read().strip()})"
    except OSError:
        limit = ""
    return f"the inotify queue overflowed{limit}: events were lost; re-checking kubelet.sock, our sockets and the devices"


def _advice(code: int, path: Optional[str]) -> str:
    if code == errno.EMFILE and path is None:
        return (": this user has reached fs.inotify.max_user_instances (per user namespace: "
                "/proc/sys/user/max_inotify_instances); raise it, e.g. "
                "sysctl fs.inotify.max_user_instances=1024 in /etc/sysctl.d/, or stop what holds the instances")
    if code == errno.ENOSPC:
        return (": this user has reached fs.inotify.max_user_watches (per user namespace: "
                "/proc/sys/user/max_inotify_watches); raise it, e.g. "
                "sysctl fs.inotify.max_user_watches=1048576 in /etc/sysctl.d/")
    if code in (errno.EMFILE, errno.ENFILE):
        return ": out of file descriptors (the process's or the system's fs.file-max)"
    if code == errno.EACCES:
        return ": atedevd may not read that directory; give it read access"
    if code == errno.ENOMEM:
        return ": the kernel is out of memory for inotify"
    return ""


def _entry(st: os.stat_result) -> _Entry:
    fmt = stat.S_IFMT(st.st_mode)
    if fmt == stat.S_IFDIR:  # its timestamps move with its contents, which inotify would not report here
        return (st.st_ino, fmt, (st.st_mode, st.st_uid, st.st_gid))
    if fmt == stat.S_IFSOCK:  # only its making sets a socket's ctime: a new ctime is a new socket on a reused inode
        return (st.st_ino, fmt, (st.st_ctime_ns,))
    return (st.st_ino, fmt, (st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_rdev))


def _scan(directory: str) -> _Scan:
    """The directory and its entries as lstat sees them; None when it is not a directory."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    try:
        names = os.listdir(directory)
    except OSError:  # EACCES: only its own coming and going is seen
        return (_entry(st), {})
    entries: Dict[str, _Entry] = {}
    for name in names:
        try:
            entries[name] = _entry(os.lstat(os.path.join(directory, name)))
        except OSError:
            pass  # gone since listdir: as if never there
    return (_entry(st), entries)


def _diff(directory: str, old: _Scan, new: _Scan) -> List[DirEvent]:
    """What inotify would have said about the change from `old` to `new` (in this order)."""
    events: List[DirEvent] = []
    if old is not None and (new is None or new[0][:2] != old[0][:2]):  # the directory went (or was replaced)
        events += [DirEvent(directory, n, c.IN_DELETE | _isdir(e)) for n, e in sorted(old[1].items())]
        events.append(DirEvent(directory, "", c.IN_DELETE_SELF))
        old = None
    if new is None:
        return events
    if old is None:  # the directory appeared, seen from its parent
        parent, base = os.path.split(directory)
        events.append(DirEvent(parent, base, c.IN_CREATE | c.IN_ISDIR))
        old = (new[0], {})
    before, after = old[1], new[1]
    for name in sorted(before.keys() | after.keys()):
        b, a = before.get(name), after.get(name)
        if a is None:
            events.append(DirEvent(directory, name, c.IN_DELETE | _isdir(before[name])))
        elif b is None:
            events.append(DirEvent(directory, name, c.IN_CREATE | _isdir(a)))
        elif a[:2] != b[:2] or (a[1] == stat.S_IFSOCK and a != b):  # a new file under the old name
            events.append(DirEvent(directory, name, c.IN_DELETE | _isdir(b)))
            events.append(DirEvent(directory, name, c.IN_CREATE | _isdir(a)))
        elif a != b:
            events.append(DirEvent(directory, name, c.IN_ATTRIB | _isdir(a)))
    return events


def _isdir(e: _Entry) -> int:
    return c.IN_ISDIR if e[1] == stat.S_IFDIR else 0


def _deepest_existing(path: str) -> str:
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path
