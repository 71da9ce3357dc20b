"""systemd glue: sd_notify messages and logging to journald or stderr.

Both degrade to nothing special outside systemd: no NOTIFY_SOCKET means no
notifications, no journal stream (or no systemd-python) means plain lines.
"""

import logging
import os
import sys
import time
from typing import Optional

import sdnotify

try:  # optional: a plain venv still runs, logging plain lines
    from systemd.journal import JournalHandler
except ImportError:  # pragma: no cover - depends on the host
    JournalHandler = None

LOGGER = "atedevd"


class Notifier:
    """sd_notify, deduplicating STATUS= and pacing WATCHDOG=1 at half the interval."""

    def __init__(self) -> None:
        self._enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self._enabled else None
        self._status: Optional[str] = None
        self.watchdog_interval = _watchdog_interval()

    def send(self, message: str) -> None:
        if self._sd is not None:
            self._sd.notify(message)

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

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=stopping")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")


def _watchdog_interval() -> Optional[float]:
    """Half of systemd's WatchdogSec, or None when no watchdog is set for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec), 0) / 2e6 or None
    except ValueError:
        return None


def _journal_is_stderr() -> bool:
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
    journal = _journal_is_stderr()
    if journal and JournalHandler is not None:
        handler: logging.Handler = JournalHandler(SYSLOG_IDENTIFIER="atedevd")
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
