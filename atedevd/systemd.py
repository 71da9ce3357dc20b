"""systemd glue: sd_notify messages and logging to journald or stderr.

Both degrade to nothing special outside systemd: no NOTIFY_SOCKET means no
notifications, no journal stream means plain lines. Structured fields
(ATEDEVD_RESOURCE= ...) go through systemd-python's JournalHandler where the
distribution has it, else through NativeJournalHandler below, which speaks
journald's native protocol itself (the self-contained packages: systemd-python
has no wheels; see docs/packaging.md).
"""

import array
import errno
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from typing import Dict, Optional

import sdnotify

LOGGER = "atedevd"


class Notifier:
    """sd_notify, deduplicating STATUS= and pacing WATCHDOG=1 at half the interval."""

    def __init__(self, quiet: bool = False) -> None:
        self._enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self._enabled else None
        self._status: Optional[str] = None
        self._quiet = quiet  # not the main process (yet): systemd would not listen
        self.watchdog_interval = None if quiet else _watchdog_interval()

    def send(self, message: str) -> None:
        if self._sd is not None and not self._quiet:
            self._sd.notify(message)

    def main_pid(self, pid: int) -> None:
        """`pid` is systemd's main process from now on (our successor): its READY, STATUS and
        watchdog are the unit's; we say nothing more."""
        self.send(f"MAINPID={pid}")
        self._quiet, self.watchdog_interval = True, None

    def become_main(self) -> None:
        """We are systemd's main process now (our predecessor said MAINPID=): the watchdog
        (set up for the first main process) is ours to keep fed."""
        self._quiet = False
        self._status = None
        self.watchdog_interval = _watchdog_interval(any_pid=True)

    def ready(self, status: str) -> None:
        self._status = status
        self.send(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        if status != self._status:
            self._status = status
            self.send(f"STATUS={status}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def store_fds(self, fds: Dict[str, int]) -> None:
        """Hand systemd these descriptors to keep for our next start (`FDSTORE=1`, each under its
        name; the unit's FileDescriptorStoreMax= must allow them, else systemd drops them).
        Sent with SCM_RIGHTS, which sdnotify does not speak; without systemd, nothing happens."""
        for name, fd in fds.items():
            self._send_fds(f"FDSTORE=1\nFDNAME={name}", [fd])

    def drop_fds(self, names) -> None:
        """Let systemd close what it keeps under these names (`FDSTOREREMOVE=1`)."""
        for name in names:
            self._send_fds(f"FDSTOREREMOVE=1\nFDNAME={name}", [])

    def _send_fds(self, message: str, fds) -> None:
        path = os.environ.get("NOTIFY_SOCKET", "")
        if not path or self._quiet:
            return
        address = "\0" + path[1:] if path.startswith("@") else path
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            s.sendmsg([message.encode()], ancillary, 0, address)
        except OSError:
            pass  # (systemd gone: nothing to keep them)
        finally:
            s.close()

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=stopping")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")


def _watchdog_interval(any_pid: bool = False) -> Optional[float]:
    """Half of systemd's WatchdogSec, or None when no watchdog is set for us (`any_pid`: for
    the main process, whichever WATCHDOG_PID its predecessor was started with)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid()) and not any_pid):
        return None
    try:
        return max(int(usec), 0) / 2e6 or None
    except ValueError:
        return None


JOURNAL_SOCKET = "/run/systemd/journal/socket"
_FIELD = re.compile(r"[A-Z0-9][A-Z0-9_]*\Z")
# logging level -> syslog priority, as systemd-python maps them
_PRIORITY = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


def _priority(levelno: int) -> int:
    return next((p for level, p in _PRIORITY if levelno >= level), 7)


def encode_fields(fields: Dict[str, object]) -> bytes:
    """journald's native format: NAME=value lines; a value with a newline as NAME, a
    little-endian 64-bit length, the bytes, a newline."""
    out = bytearray()
    for name, value in fields.items():
        data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        key = name.encode("ascii")
        if b"\n" in data:
            out += key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key + b"=" + data + b"\n"
    return bytes(out)


class NativeJournalHandler(logging.Handler):
    """A logging handler that sends each record as one datagram to journald's native socket,
    with the fields systemd-python's JournalHandler sends (MESSAGE, PRIORITY, LOGGER,
    THREAD_NAME, CODE_*) plus the record's extra fields whose names journald accepts.
    A record too large for a datagram goes in a sealed memfd passed with SCM_RIGHTS, as
    sd_journal_sendv() does. If journald cannot be reached, the line goes to stderr."""

    def __init__(self, path: str = JOURNAL_SOCKET, **defaults: str) -> None:
        super().__init__()
        self.path = path
        self.defaults = {k: v for k, v in defaults.items() if _FIELD.match(k)}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._send_lock = threading.Lock()

    def fields(self, record: logging.LogRecord) -> Dict[str, object]:
        fields: Dict[str, object] = {"MESSAGE": self.format(record), "PRIORITY": _priority(record.levelno)}
        fields.update(self.defaults)
        fields.update(LOGGER=record.name, THREAD_NAME=record.threadName, CODE_FILE=record.pathname,
                      CODE_LINE=record.lineno, CODE_FUNC=record.funcName)
        for name, value in record.__dict__.items():
            if _FIELD.match(name) and not name.startswith("_") and value is not None:
                fields[name] = value
        return fields

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.send(encode_fields(self.fields(record)))
        except Exception:  # never lose the line, never raise into the daemon
            try:
                sys.stderr.write(f"{record.levelname} {record.getMessage()}\n")
                sys.stderr.flush()
            except Exception:
                pass

    def send(self, payload: bytes) -> None:
        with self._send_lock:
            try:
                self._sock.sendto(payload, self.path)
                return
            except OSError as e:
                if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS):  # too large for a datagram
                    raise
            fd = os.memfd_create("atedevd-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.write(fd, payload)
                import fcntl

                seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
                self._sock.sendmsg([b""], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))], 0, self.path)
            finally:
                os.close(fd)

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            super().close()


def _journal_handler() -> Optional[logging.Handler]:
    try:  # optional (a plain venv still runs), and imported only when logging to the journal: 4 ms
        from systemd.journal import JournalHandler
    except ImportError:  # pragma: no cover - depends on the host
        pass
    else:
        return JournalHandler(SYSLOG_IDENTIFIER="atedevd")
    if os.path.exists(JOURNAL_SOCKET):
        return NativeJournalHandler(SYSLOG_IDENTIFIER="atedevd")
    return None


def journal_is_stderr() -> bool:
    """True when systemd connected our stderr to journald (JOURNAL_STREAM=dev:inode)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class _PlainFormatter(logging.Formatter):
    """`level: message`, with no timestamp when journald adds its own."""

    def __init__(self, timestamps: bool):
        fmt = "%(asctime)s.%(msecs)03d %(levelname)s %(message)s" if timestamps else "%(levelname)s %(message)s"
        super().__init__(fmt, datefmt="%H:%M:%S")


def setup_logging(level: str) -> None:
    root = logging.getLogger(LOGGER)
    root.handlers.clear()
    root.propagate = False
    journal = journal_is_stderr()
    native = _journal_handler() if journal else None
    if native is not None:
        handler: logging.Handler = native
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PlainFormatter(timestamps=not journal))
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    logging.getLogger(LOGGER).setLevel(level.upper())


def event(level: int, name: str, message: str, *, resource: str = "", device: str = "", socket: str = "") -> None:
    """Log one state change with journald fields, so one resource's story can be filtered."""
    fields = {"ATEDEVD_EVENT": name}
    if resource:
        fields["ATEDEVD_RESOURCE"] = resource
    if device:
        fields["ATEDEVD_DEVICE"] = device
    if socket:
        fields["ATEDEVD_SOCKET"] = socket
    logging.getLogger(LOGGER).log(level, message, extra=fields)
