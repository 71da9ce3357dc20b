"""The CDI spec's lifetime, the daemon as a process: every CDI name atedevd has answered
Allocate with resolves in the spec directory at every moment (until the next start has written
its own), through hot-plug, reloads (a narrowed mode, a unit dropped), an upgrade handed to a
successor, a kill -9 and the start after it, and the stop.

A watcher thread sees every change of the spec directory as inotify reports it, takes the
directory's lock as the daemon's writer does (so it reads between two writes, never in one),
and checks that each name answered so far resolves as a runtime's CDI cache would read the
directory (atedevd/cdi_files.resolvable); our spec file deleted or renamed away while a name is
owed is a failure on its own, even where the next state restores it."""

import fcntl
import os
import select
import signal
import threading

import inotify.constants as ic
import pytest

from atedevd.cdi import files as cdi_files
from atedevd.daemon.watch import Watcher
from rig.harness import wait_until
from rig.nodes import mknod
from tests.process.test_upgrade import hup, launcher, upgrade

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (CI runs as root)")]

SERIAL = "ate.dev/serial"
FILE = "atedevd-ate.dev_serial.json"


class SpecWatch:
    def __init__(self, spec_dir: str) -> None:
        self.spec_dir = spec_dir
        self.owed: set = set()  # qualified names answered since the last start wrote its own
        self._replaced = None  # the killed daemon's spec file, until the next start replaces it
        self.violations: list = []
        self.checks = 0
        self._lock = threading.Lock()
        self._watcher = Watcher()
        self._watcher.want([spec_dir])
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def answered(self, names) -> None:
        with self._lock:
            self.owed |= set(names)
        self.check("answered")

    def next_start(self, inode: int) -> None:
        """A new daemon (not a successor) starts after a kill: once it has written its own spec (the
        file is no longer `inode`), what the killed one answered is no longer owed."""
        with self._lock:
            self._replaced = inode

    def check(self, why: str) -> None:
        fd = os.open(self.spec_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # between two of the daemon's writes
            names = cdi_files.resolvable(self.spec_dir)
            try:
                inode = os.stat(os.path.join(self.spec_dir, FILE)).st_ino
            except FileNotFoundError:
                inode = None
        finally:
            os.close(fd)
        with self._lock:
            if self._replaced is not None and inode not in (None, self._replaced):
                self.owed, self._replaced = set(), None  # the next start has written its own
            self.checks += 1
            missing = self.owed - names
            if missing:
                self.violations.append(f"{why}: {sorted(missing)} do not resolve (there: {sorted(names)})")

    def _run(self) -> None:
        while not self._stop:
            ready, _, _ = select.select([self._watcher.fileno()], [], [], 0.05)
            if not ready:
                continue
            for ev in self._watcher.read():
                if ev.name == FILE and ev.is_(ic.IN_DELETE | ic.IN_MOVED_FROM):
                    with self._lock:
                        if self.owed:
                            self.violations.append(f"{FILE} removed while {sorted(self.owed)} were owed")
            self.check("a change in the directory")

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self._watcher.close()


def write(path, text):
    path.write_text(text)
    return str(path)


def answer(kubelet, ids):
    return [d.name for d in kubelet.allocate(SERIAL, ids).container_responses[0].cdi_devices]


def test_every_name_answered_resolves_through_hot_plug_reloads_an_upgrade_and_a_kill(start_daemon, kubelet, installed,
                                                                                     tmp_path):
    dev = tmp_path / "devroot"
    for i in range(3):
        mknod(dev, f"ttyUSB{i}", 188, i)
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir(mode=0o755)
    table = f'[[device]]\nresource = "{SERIAL}"\npath = "/dev/ttyUSB*"\n'
    cfg = write(tmp_path / "c.toml", f'[daemon]\ncdi = true\ncdi_spec_dir = "{spec_dir}"\n'
                                     f'kubelet_endpoints = "per-socket"\n{table}')
    watch = SpecWatch(str(spec_dir))
    try:
        d = start_daemon(dev_root=str(dev), config=cfg, launcher=launcher(installed), log_level="debug")
        d.wait_ready()
        assert kubelet.wait_connected(SERIAL), d.log()

        def healthy(*ids):
            return kubelet.wait(lambda: all(kubelet.devices(SERIAL).get(i) == "Healthy" for i in ids), 5)

        assert healthy("ttyUSB0", "ttyUSB1", "ttyUSB2")
        watch.answered(answer(kubelet, ["ttyUSB0", "ttyUSB1"]))
        mknod(dev, "ttyUSB3", 188, 3)  # hot-plug: on disk before kubelet has the ID
        assert healthy("ttyUSB3"), d.log()
        watch.answered(answer(kubelet, ["ttyUSB3"]))
        os.unlink(dev / "ttyUSB1")  # unplugged: kubelet may still hold it; its name stays
        assert kubelet.wait(lambda: kubelet.devices(SERIAL).get("ttyUSB1") == "Unhealthy", 5), d.log()
        write(tmp_path / "c.toml", open(cfg).read() + "container_mode = 0o660\n")  # reload: narrowed, ttyUSB1 dropped
        n = len(d.notify.messages)
        d.send(signal.SIGHUP)
        assert d.notify.wait_for("READY", "1", timeout=5, after=n), d.log()
        assert kubelet.wait(lambda: "ttyUSB1" not in kubelet.devices(SERIAL), 5), d.log()
        watch.answered(answer(kubelet, ["ttyUSB2"]))
        watch.check("after the reload")

        assert wait_until(lambda: "start-up done" in d.log(), 5), d.log()
        upgrade(installed)  # the upgrade: two daemons write the spec in turn
        n = hup(d)
        main = d.notify.wait_for("MAINPID", timeout=15, after=n)
        assert main, d.log()
        assert d.wait(15) == 0, d.log()
        successor = int(main["fields"]["MAINPID"])
        assert kubelet.wait_connected(SERIAL, registrations=2), d.log()
        assert healthy("ttyUSB0", "ttyUSB2", "ttyUSB3")
        watch.answered(answer(kubelet, ["ttyUSB0", "ttyUSB3"]))
        mknod(dev, "ttyUSB4", 188, 4)  # hot-plug in the successor
        assert healthy("ttyUSB4"), d.log()
        watch.answered(answer(kubelet, ["ttyUSB4"]))

        before = os.stat(spec_dir / FILE).st_ino
        os.kill(successor, signal.SIGKILL)  # its spec stays, valid, for the next start
        assert wait_until(lambda: not os.path.exists(f"/proc/{successor}"), 5)
        watch.check("after kill -9")
        os.unlink(dev / "ttyUSB0")  # gone while no daemon runs: the next start need not resolve it
        watch.next_start(before)
        d2 = start_daemon(dev_root=str(dev), config=cfg)
        d2.wait_ready()
        assert os.stat(spec_dir / FILE).st_ino != before  # the next start has written its own
        assert kubelet.wait_connected(SERIAL, registrations=3), d2.log()
        assert healthy("ttyUSB2", "ttyUSB3", "ttyUSB4")
        watch.answered(answer(kubelet, ["ttyUSB2", "ttyUSB3", "ttyUSB4"]))
        assert cdi_files.resolvable(str(spec_dir)) == {f"{SERIAL}={u}" for u in ("ttyUSB2", "ttyUSB3", "ttyUSB4")}

        assert d2.stop() == 0  # the spec stays, every name resolvable: kubelet replays checkpointed answers
        assert cdi_files.resolvable(str(spec_dir)) == {f"{SERIAL}={u}" for u in ("ttyUSB2", "ttyUSB3", "ttyUSB4")}
        assert wait_until(lambda: watch.checks >= 10, 10)  # the events are in; our watcher thread, starved, may lag
    finally:
        watch.close()
    assert watch.violations == []
    assert watch.checks >= 10, watch.checks  # it looked at every change, not once
