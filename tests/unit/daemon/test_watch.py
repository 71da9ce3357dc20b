"""The watcher: inotify when it can, polling (loudly) when the kernel refuses.

In-process tests make inotify fail by replacing the module's system-call
wrappers; test_inotify_limits.py makes the kernel itself refuse, for the
daemon as a process.
"""

import errno
import logging
import os
import select
import time

import inotify.constants as c
import pytest

from atedevd.daemon import watch
from atedevd.daemon.watch import DirEvent, Watcher


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(watch, "POLL_INTERVAL_S", 0.02)


def refuse(code):
    def fail(*_args):
        raise OSError(code, os.strerror(code))
    return fail


def due_read(w: Watcher):
    """read() at (or after) the watcher's poll deadline, as the control loop does."""
    due = w.poll_deadline()
    assert due is not None
    time.sleep(max(0.0, due - time.monotonic()))
    return w.read()


def errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_inotify_available_means_no_poll_deadline(tmp_path):
    w = Watcher()
    try:
        w.want([str(tmp_path)])
        assert w.poll_deadline() is None
        (tmp_path / "f").touch()
        assert select.select([w.fileno()], [], [], 2)[0]
        assert DirEvent(str(tmp_path), "f", c.IN_CREATE) in w.read()
    finally:
        w.close()


def test_watch_limit_polls_with_inotify_shaped_events_and_says_so_once(tmp_path, monkeypatch, fast, caplog):
    monkeypatch.setattr(watch, "_add_watch", refuse(errno.ENOSPC))
    d = str(tmp_path / "plugins")
    os.mkdir(d)
    w = Watcher()
    try:
        w.want([d])
        assert w.poll_deadline() is not None
        assert due_read(w) == []

        open(os.path.join(d, "kubelet.sock"), "w").close()
        assert due_read(w) == [DirEvent(d, "kubelet.sock", c.IN_CREATE)]

        os.utime(os.path.join(d, "kubelet.sock"), ns=(1, 10**18))
        assert due_read(w) == [DirEvent(d, "kubelet.sock", c.IN_ATTRIB)]

        open(os.path.join(d, "new"), "w").close()
        os.rename(os.path.join(d, "new"), os.path.join(d, "kubelet.sock"))  # another inode, same name
        assert due_read(w) == [DirEvent(d, "kubelet.sock", c.IN_DELETE), DirEvent(d, "kubelet.sock", c.IN_CREATE)]

        os.mkdir(os.path.join(d, "sub"))
        assert due_read(w) == [DirEvent(d, "sub", c.IN_CREATE | c.IN_ISDIR)]
        os.rmdir(os.path.join(d, "sub"))
        os.unlink(os.path.join(d, "kubelet.sock"))
        assert due_read(w) == [DirEvent(d, "kubelet.sock", c.IN_DELETE), DirEvent(d, "sub", c.IN_DELETE | c.IN_ISDIR)]

        open(os.path.join(d, "x"), "w").close()
        os.unlink(os.path.join(d, "x"))
        os.rmdir(d)
        assert due_read(w) == [DirEvent(d, "", c.IN_DELETE_SELF)]  # x came and went between two scans
        assert due_read(w) == []
        os.mkdir(d)
        open(os.path.join(d, "kubelet.sock"), "w").close()
        assert due_read(w) == [DirEvent(str(tmp_path), "plugins", c.IN_CREATE | c.IN_ISDIR),
                               DirEvent(d, "kubelet.sock", c.IN_CREATE)]
    finally:
        w.close()
    logged = errors(caplog)
    assert len(logged) == 1, logged  # once, though every directory event re-tried inotify
    assert "ENOSPC" in logged[0] and "fs.inotify.max_user_watches" in logged[0] and "polling" in logged[0]


def test_reused_inode_number_is_a_new_socket(tmp_path, monkeypatch, fast):
    """A restarted kubelet's socket can get the old one's inode number: its ctime tells them apart."""
    monkeypatch.setattr(watch, "_add_watch", refuse(errno.ENOSPC))
    w = Watcher()
    try:
        w.want([str(tmp_path)])
        old = (42, 0o140000, (1,))
        new = (42, 0o140000, (2,))
        assert watch._diff("/d", (old, {"kubelet.sock": old}), (old, {"kubelet.sock": new})) == [
            DirEvent("/d", "kubelet.sock", c.IN_DELETE), DirEvent("/d", "kubelet.sock", c.IN_CREATE)]
    finally:
        w.close()


def test_only_the_refused_directory_is_polled(tmp_path, monkeypatch, fast):
    real = watch._add_watch
    refused = str(tmp_path / "refused")
    os.mkdir(refused)
    monkeypatch.setattr(watch, "_add_watch", lambda fd, path: refuse(errno.EACCES)() if path == refused else real(fd, path))
    w = Watcher()
    try:
        w.want([str(tmp_path), refused])
        assert w.poll_deadline() is not None
        (tmp_path / "watched").touch()
        assert select.select([w.fileno()], [], [], 2)[0]  # inotify still works for the other one
        assert DirEvent(str(tmp_path), "watched", c.IN_CREATE) in w.read()
        open(os.path.join(refused, "f"), "w").close()
        assert DirEvent(refused, "f", c.IN_CREATE) in due_read(w)
    finally:
        w.close()


def test_instance_limit_polls_then_inotify_comes_back_on_the_same_descriptor(tmp_path, monkeypatch, fast, caplog):
    caplog.set_level(logging.INFO, logger="atedevd")
    real = watch._init
    monkeypatch.setattr(watch, "_init", refuse(errno.EMFILE))
    w = Watcher()
    try:
        fd = w.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        w.want([str(tmp_path)])
        assert poller.poll(50) == []  # the stand-in descriptor never fires
        (tmp_path / "kubelet.sock").touch()
        assert due_read(w) == [DirEvent(str(tmp_path), "kubelet.sock", c.IN_CREATE)]
        logged = errors(caplog)
        assert len(logged) == 1 and "EMFILE" in logged[0] and "fs.inotify.max_user_instances" in logged[0], logged

        monkeypatch.setattr(watch, "_init", real)  # the limit was raised
        w._next_retry = 0.0
        due_read(w)
        assert w.poll_deadline() is None and w.fileno() == fd
        (tmp_path / "after").touch()
        assert poller.poll(2000)  # the loop's registration of the old number now hears inotify
        assert DirEvent(str(tmp_path), "after", c.IN_CREATE) in w.read()
        assert any("works again" in r.getMessage() for r in caplog.records)
    finally:
        w.close()
