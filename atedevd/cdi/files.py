"""CDI spec files on disk: written atomically, removed only while still ours, read back as a runtime would.

The spec directory is where runtimes read what a CDI name grants, so it must be root's
alone (the same judgement as the configuration's, atedevd/trust.py) and nothing in it is
followed: a temporary file is created beside the spec with O_EXCL|O_NOFOLLOW (a link or
a file planted by that name is refused, never written through), fsynced, and renamed over
the spec (a rename replaces a planted link itself). A runtime reading the directory sees
the old spec or the new one, never a part. Two daemons (an upgrade) write one
resource's spec in turn: the directory's flock serialises each read-merge-write.
Temporary names end in `.tmp`, which the runtimes' scan skips (`*.json`, `*.yaml` only).
"""

import errno
import fcntl
import json
import os
import stat
from typing import Dict, List, Optional, Set

from atedevd import trust
from atedevd.cdi import names as cdi
from atedevd.config import read_regular

MAX_SPEC_BYTES = 4 << 20
SPEC_DIR_MODE = 0o755  # runtimes (root) read it; only root writes
SPEC_FILE_MODE = 0o644  # nothing secret: which node a name makes, with what mode
_TMP_PREFIX = "." + cdi.FILE_PREFIX


class SpecDirError(OSError):
    """The spec directory cannot be trusted or made."""


def open_dir(spec_dir: str, make: bool = True) -> int:
    """A descriptor of the spec directory, made (mode 0755) if missing and `make`; refused
    (SpecDirError) when someone other than root could replace what is in it."""
    try:
        st = os.lstat(spec_dir)
    except FileNotFoundError:
        if not make:
            raise
        problems = trust.problems(os.path.dirname(spec_dir.rstrip("/")) or "/")
        if problems:
            raise SpecDirError(errno.EPERM, "; ".join(problems)) from None
        os.mkdir(spec_dir, SPEC_DIR_MODE)
        fd = os.open(spec_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.fchmod(fd, SPEC_DIR_MODE)  # our umask is 0077
        return fd
    problems = trust.problems(spec_dir)
    if problems:
        raise SpecDirError(errno.EPERM, "; ".join(problems))
    if not stat.S_ISDIR(os.stat(spec_dir).st_mode if stat.S_ISLNK(st.st_mode) else st.st_mode):
        raise SpecDirError(errno.ENOTDIR, f"{spec_dir} is not a directory")
    return os.open(spec_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


class Locked:
    """The spec directory, open and flock()ed for one read-merge-write (or a removal)."""

    def __init__(self, spec_dir: str, make: bool = True) -> None:
        self.spec_dir = spec_dir
        self.fd = open_dir(spec_dir, make)

    def __enter__(self) -> "Locked":
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # the lock goes with it

    def read(self, name: str) -> Optional[object]:
        """The document in `name` (a regular file, not followed), None when there is none or it is not JSON."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_SPEC_BYTES + 1)
        finally:
            os.close(fd)
        try:
            return json.loads(data) if len(data) <= MAX_SPEC_BYTES else None
        except ValueError:
            return None

    def stat(self, name: str) -> Optional[os.stat_result]:
        """`name` in the directory, not followed; None when it is not there."""
        try:
            return os.lstat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return None

    def specs_of_ours(self) -> List[str]:
        """The spec files atedevd writes (`atedevd-*.json`), of any resource."""
        return sorted(e for e in os.listdir(self.fd) if e.startswith(cdi.FILE_PREFIX) and e.endswith(".json"))

    def remove(self, name: str) -> bool:
        """Remove `name` (a regular file, not followed); True when it was there."""
        st = self.stat(name)
        if st is None or not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(name, dir_fd=self.fd)
        return True

    def write(self, name: str, doc: dict) -> os.stat_result:
        """Replace `name` with `doc` atomically; the new file's fstat."""
        data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()  # (compact: the C encoder; indent is Python's)
        tmp = f"{_TMP_PREFIX}{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, SPEC_FILE_MODE,
                     dir_fd=self.fd)
        try:
            os.fchmod(fd, SPEC_FILE_MODE)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            written = os.fstat(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=self.fd)
            raise
        os.close(fd)
        try:
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            os.unlink(tmp, dir_fd=self.fd)
            raise
        os.fsync(self.fd)
        return written

    def remove_if(self, name: str, inode: int) -> bool:
        """Remove `name` when it is still the file we wrote (no other writer replaced it)."""
        try:
            st = os.lstat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(name, dir_fd=self.fd)
        return True

    def remove_leftovers(self) -> None:
        """Temporary files a writer killed mid-write left (no writer is mid-write while we hold the lock)."""
        for entry in os.listdir(self.fd):
            if entry.startswith(_TMP_PREFIX) and entry.endswith(".tmp"):
                try:
                    os.unlink(entry, dir_fd=self.fd)
                except FileNotFoundError:
                    pass


def read_spec(path: str) -> Optional[str]:
    """The text of a spec file another program may have written (a link followed, as runtimes
    follow it): a regular file, opened without blocking, at most MAX_SPEC_BYTES; None otherwise."""
    try:
        _, data, _ = read_regular(path, MAX_SPEC_BYTES)  # (as the configuration is read: a device, a FIFO is never opened)
    except (OSError, ValueError):
        return None
    return data.decode("utf-8", errors="replace") if len(data) <= MAX_SPEC_BYTES else None


def resolvable(spec_dir: str) -> Set[str]:
    """Every qualified CDI name the specs in `spec_dir` resolve, as a runtime's cache reads them."""
    return set(resolved(spec_dir))


def resolved(spec_dir: str, parsed: Optional[Dict[str, tuple]] = None) -> Dict[str, list]:
    """What every qualified CDI name the specs in `spec_dir` resolve makes: its device nodes as
    written (dicts). As a runtime's cache reads them: each `*.json` file a valid document of a
    known version; a name defined by two files of the directory is a conflict, and resolves to
    nothing. `parsed`: the documents read before, by file (a checker that looks after every event
    reads again only what changed)."""
    seen: Dict[str, int] = {}
    nodes: Dict[str, list] = {}
    try:
        entries = sorted(os.listdir(spec_dir))
    except FileNotFoundError:
        return {}
    for entry in entries:
        if not (entry.endswith(".json") or entry.endswith(".yaml")):
            continue
        path = os.path.join(spec_dir, entry)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_SPEC_BYTES)
            if parsed is not None and parsed.get(path, (None,))[0] == raw:
                doc = parsed[path][1]
            else:
                doc = json.loads(raw)
                if parsed is not None:
                    parsed[path] = (raw, doc)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("cdiVersion") not in cdi.VERSIONS \
                or not isinstance(doc.get("kind"), str):
            continue
        names = cdi.device_names(doc)
        if len(set(names)) != len(names):
            continue  # an invalid spec: none of its devices
        for d in doc["devices"]:
            if isinstance(d, dict) and isinstance(d.get("name"), str):
                q = f"{doc['kind']}={d['name']}"
                seen[q] = seen.get(q, 0) + 1
                edits = d.get("containerEdits")
                nodes[q] = list(edits.get("deviceNodes") or ()) if isinstance(edits, dict) else []
    return {q: nodes[q] for q, n in seen.items() if n == 1}
