"""Prometheus metrics through node_exporter's textfile collector: the file, written.

A host daemon that opens no port (the unit has PrivateNetwork=yes and AF_UNIX only)
is scraped the way host daemons are: it writes `atedevd.prom` in the text exposition
format (glue/metrics.py renders it) into the directory node_exporter's textfile collector
reads, and node_exporter serves it with the node's other metrics. The file is replaced
atomically (a temporary file in the same directory, then rename), so a scrape never sees
half of it. `TextfileWriter` writes it when it changed and at least every REFRESH_S, so that
the file's age (`node_textfile_mtime_seconds`) tells a live daemon from a dead one.
"""

import errno
import logging
import os
import stat
import time
from typing import Callable, Optional

from atedevd import trust

log = logging.getLogger(__name__)

# Debian's and Ubuntu's prometheus-node-exporter read this directory (--collector.textfile.directory).
DEFAULT_DIR = "/var/lib/prometheus/node-exporter"
FILE_NAME = "atedevd.prom"
REFRESH_S = 30.0  # at least this often, so that the file's age shows a daemon that stopped
MIN_INTERVAL_S = 1.0  # at most this often


def resolve_dir(configured: Optional[str]) -> Optional[str]:
    """Where to write, or None for no metrics: `configured` (None: not set, "" : off),
    else DEFAULT_DIR when it exists (node_exporter is installed)."""
    if configured is None:
        return DEFAULT_DIR if os.path.isdir(DEFAULT_DIR) else None
    return configured or None


class WallOffset:
    """Wall clock minus monotonic clock, for timestamps of monotonic events: taken once and
    kept (a fresh one each render would change the text every time), followed only when
    the wall clock is stepped by more than STEP_S (NTP setting the clock after boot)."""

    STEP_S = 1.0

    def __init__(self) -> None:
        self.value = time.time() - time.monotonic()

    def current(self) -> float:
        now = time.time() - time.monotonic()
        if abs(now - self.value) > self.STEP_S:
            self.value = now
        return self.value


class TextfileWriter:
    """Writes the rendered text to DIR/atedevd.prom when it changed or REFRESH_S passed.

    The loop calls `update` after every event; the text is rendered at most every
    MIN_INTERVAL_S (32 resources take most of a millisecond to render, and a kubelet
    restart wakes the loop many times in a few milliseconds: the first change is
    written at once, the ones that follow within the interval together at its end).

    Never raises: a failed write is logged once (and once more when writing works
    again), and tried again at the next refresh."""

    def __init__(self, directory: Optional[str], refresh: float = REFRESH_S, min_interval: float = MIN_INTERVAL_S):
        self.directory = directory
        self.path = os.path.join(directory, FILE_NAME) if directory else None
        self.refresh = refresh
        self.min_interval = min_interval
        self._written: Optional[str] = None
        self._written_at = -refresh
        self._rendered_at = -min_interval
        self._pending = False
        self._failing = False

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def deadline(self) -> Optional[float]:
        """When the loop must wake to render again (None: metrics are off)."""
        if not self.enabled:
            return None
        if self._pending:
            return self._rendered_at + self.min_interval
        return self._written_at + self.refresh

    def update(self, render: Callable[[], str], now: float, force: bool = False) -> None:
        """Something may have changed: write `render()` if it did, or if a refresh is due.
        `force`: now, whatever the interval (the last word before exiting)."""
        if not self.enabled:
            return
        if not force and now < self._rendered_at + self.min_interval:
            self._pending = True
            return
        self._pending = False
        self._rendered_at = now
        text = render()
        if text == self._written and now < self._written_at + self.refresh:
            return
        self._written_at = now  # failed or not: the next try is at the refresh
        if self.path is None:
            return
        try:
            write_atomically(self.path, text)
        except OSError as e:
            self._written = None
            if not self._failing:
                self._failing = True
                log.warning("cannot write metrics to %s: %s (retrying every %.0f s; said once)", self.path, e.strerror or e, self.refresh)
            return
        self._written = text
        if self._failing:
            self._failing = False
            log.info("metrics written to %s again", self.path)


def directory_refused(directory: str, st: Optional[os.stat_result] = None) -> Optional[str]:
    """Why atedevd will not write in `directory` (as `atedevd check` says it too), or None."""
    if st is None:
        try:
            st = os.lstat(directory)
        except OSError:
            return None  # said otherwise: missing, unreadable
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symbolic link: set metrics_dir to the directory it points to"
    problem = trust.writable_by_others(directory, st)
    if problem:
        return f"refused: another user could put a file of theirs where atedevd writes (a FIFO would block its loop): {problem}"
    return None


def write_atomically(path: str, text: str) -> None:
    """Replace `path` with `text`: a file of our own beside it (a name node_exporter does not
    read: not *.prom), mode 0644, then rename. No `tempfile`: it would be imported after the
    start, and after an upgrade what is on disk is another version's.

    Nothing another user can put in the directory blocks or redirects the loop: the
    directory is opened without following a link and judged as opened (owned by root or
    us, writable by neither group nor others: else OSError naming why), the temporary
    file has an unguessable name and is created anew (O_EXCL: never a FIFO, a link or a
    file someone left there; O_NONBLOCK all the same), and both steps go through the
    directory's descriptor, so a directory swapped meanwhile is not written into."""
    directory, name = os.path.split(path)
    try:
        dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # a link there: ELOOP, or ENOTDIR with O_DIRECTORY
        problem = directory_refused(directory) if e.errno in (errno.ELOOP, errno.ENOTDIR) else None
        if problem:
            raise OSError(e.errno, problem)
        raise
    try:
        problem = directory_refused(directory, os.fstat(dfd))
        if problem:
            raise OSError(errno.EPERM, problem)
        tmp = f".{name}.{os.urandom(8).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                os.fchmod(f.fileno(), 0o644)  # node_exporter runs as its own user
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
