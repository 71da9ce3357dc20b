"""atedevd on the cluster's node, run from the checkout as systemd runs it (rig/harness.py's
DaemonUnderTest: a process, NOTIFY_SOCKET, signals), serving the kubelet's custom root.

The package is run from a copy in the cluster's directory, as a node runs it from its installed
files, so that an upgrade can replace a file of it by a rename (the package manager's way) and a
reload then hands over to the successor (docs/design.md, *Upgrades*).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from rig.harness import REPO, DaemonUnderTest, FdStore, gone, wait_until
from tests.e2e import build

KVM_TABLE = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'


class Atedevd:
    """One node's atedevd across its processes: started, restarted, reloaded, upgraded."""

    def __init__(self, cluster, devices: str = KVM_TABLE, cdi: bool = False, endpoints: Optional[str] = None,
                 log_level: str = "info", daemon: str = "", store: bool = False):
        """`store`: systemd's file descriptor store kept for its processes (FileDescriptorStoreMax=, as
        DRA mode's drop-in sets it; rig/harness.FdStore)."""
        self.cluster = cluster
        self.fd_store = FdStore() if store else None
        self.work = cluster.root / "atedevd"
        self.work.mkdir(exist_ok=True)
        self.site = self.work / "site"
        if not self.site.exists():
            shutil.copytree(Path(REPO) / "atedevd", self.site / "atedevd", ignore=shutil.ignore_patterns("__pycache__"))
        self.config = self.work / "config.toml"
        self.log_level = log_level
        self.generations: List[DaemonUnderTest] = []
        self.successor: Optional[int] = None  # an upgrade's successor: systemd's main process, not our child
        self.daemon_extra = daemon  # more [daemon] keys, e.g. "device_specs = false"
        self.write_config(devices, cdi=cdi, endpoints=endpoints)
        cluster.on_stop(self.close)

    def write_config(self, devices: str, cdi: bool = False, endpoints: Optional[str] = None) -> None:
        """The configuration, replaced whole (written beside, renamed over: as the docs ask);
        `kubelet_endpoints` left to its default ("auto") unless `endpoints` names it."""
        chosen = f'kubelet_endpoints = "{endpoints}"\n' if endpoints else ""
        text = (f'[daemon]\ndevice_plugin_dir = "{self.cluster.plugin_dir}"\n{chosen}'
                f'metrics_dir = ""\ncdi = {str(cdi).lower()}\ncdi_spec_dir = "{self.cluster.cdi_dir}"\n'
                f'{self.daemon_extra}\n\n{devices}')
        tmp = self.config.with_name("config.toml.new")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.rename(tmp, self.config)

    @property
    def current(self) -> DaemonUnderTest:
        """The process we started last; after an upgrade its notify socket and log file are the
        successor's too (it inherits them), but its process is gone."""
        return self.generations[-1]

    @property
    def main_pid(self) -> int:
        return self.successor if self.successor is not None else self.current.pid

    def start(self, wait: bool = True) -> DaemonUnderTest:
        """A new process (systemd's ExecStart=); with `wait`, until it said READY=1."""
        run = self.work / f"run-{len(self.generations)}"
        d = DaemonUnderTest(str(run), plugin_dir=str(self.cluster.plugin_dir), dev_root="/dev", config=str(self.config),
                            log_level=self.log_level, launcher=self.launcher(), fd_store=self.fd_store)
        self.generations.append(d)
        self.successor = None
        if wait:
            d.wait_ready(30)
        return d

    def launcher(self) -> tuple:
        site = str(self.site)
        return ("-c", f"import sys; sys.path.insert(0, {site!r})\nfrom atedevd.launch import main; sys.exit(main(sys.argv[1:]))")

    def _wait_gone(self, pid: int, timeout: float = 30) -> None:
        if pid == self.current.pid:
            self.current.proc.wait(timeout)
        else:
            assert wait_until(lambda: gone(pid), timeout), f"atedevd {pid} did not exit"

    def stop(self, sig: int = signal.SIGTERM) -> Optional[int]:
        """Stop the main process (ours, or an upgrade's successor); our process's exit status."""
        pid = self.main_pid
        if not gone(pid):
            os.kill(pid, sig)
        self._wait_gone(pid)
        return self.current.proc.returncode if pid == self.current.pid else None

    def restart(self, sig: int = signal.SIGTERM) -> DaemonUnderTest:
        """As systemd does it: `systemctl restart` (SIGTERM, then a new process once it exited)
        or Restart=always with RestartSec=0 after a kill -9 (a new process once it is reaped)."""
        self.stop(sig)
        return self.start(wait=False)

    def reload(self, devices: str, cdi: bool = False, endpoints: Optional[str] = None) -> None:
        """`systemctl reload`: the file replaced, SIGHUP, RELOADING=1 then READY=1."""
        self.write_config(devices, cdi=cdi, endpoints=endpoints)
        time.sleep(0.06)  # a reload takes a file last changed 50 ms before
        notify = self.current.notify
        n = len(notify.messages)
        os.kill(self.main_pid, signal.SIGHUP)
        assert notify.wait_for("RELOADING", "1", timeout=10, after=n), self.log()
        assert notify.wait_for("READY", "1", timeout=10, after=n), self.log()
        handed = notify.wait_for("MAINPID", timeout=0, after=n)  # (DRA mode: a successor applies it)
        if handed is not None:
            self.successor = int(handed["fields"]["MAINPID"])
    def wait_startup_done(self, times: int = 1) -> None:
        """The start's deferred work done `times` times in this log (a DEBUG line): the installed
        files are noted, which a reload compares to tell an upgrade."""
        assert wait_until(lambda: self.current.log().count("start-up done") >= times, 15), self.current.log()

    def upgrade(self) -> int:
        """The package manager's upgrade and postinst: a file of the installed package replaced by
        a rename, then a reload; returns the successor's pid once the old process has exited."""
        build = self.site / "atedevd" / "_build.py"
        tmp = build.with_name("_build.py.dpkg-new")
        tmp.write_text(build.read_text() + "# upgraded\n")
        os.rename(tmp, build)
        notify = self.current.notify
        n, old = len(notify.messages), self.main_pid
        os.kill(old, signal.SIGHUP)
        main = notify.wait_for("MAINPID", timeout=30, after=n)
        assert main, self.log()
        self._wait_gone(old)
        if old == self.current.pid:
            assert self.current.proc.returncode == 0, self.log()
        self.successor = int(main["fields"]["MAINPID"])
        return self.successor

    def check(self) -> dict:
        """`atedevd check --json` on the node, as an operator runs it: it reads containerd's
        configuration where containerd keeps it, /etc/containerd/config.toml, so it runs in a mount
        namespace of its own where /etc is an overlay holding the cluster's file there (the host's
        /etc is not touched), with the cluster's containerd first in PATH (its version decides
        the defaults)."""
        etc = self.work / "check-etc"
        (etc / "upper" / "containerd").mkdir(parents=True, exist_ok=True)
        (etc / "work").mkdir(exist_ok=True)
        shutil.copy(self.cluster.containerd_config, etc / "upper" / "containerd" / "config.toml")
        containerd_dir = build.binary("containerd").parent
        script = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={etc / 'upper'},workdir={etc / 'work'} /etc && "
                  f"PATH={containerd_dir}:$PATH PYTHONPATH={self.site} exec {sys.executable} -m atedevd check --json "
                  f"--config {self.config}")
        run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                             capture_output=True, text=True, timeout=60)
        try:
            return json.loads(run.stdout)
        except ValueError:
            raise AssertionError(f"check said no JSON (exit {run.returncode}): {run.stdout}{run.stderr}") from None

    def log(self) -> str:
        return "\n".join(d.log() for d in self.generations)

    def close(self) -> None:
        if self.successor is not None and not gone(self.successor):
            os.kill(self.successor, signal.SIGKILL)
            wait_until(lambda: gone(self.successor), 10)
        self.successor = None
        for d in self.generations:
            d.close()
        if self.fd_store is not None:
            self.fd_store.close()
