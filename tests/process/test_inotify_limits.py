"""The daemon as a process with the kernel's inotify limits at 0, for it alone.

`max_inotify_instances` and `max_inotify_watches` under /proc/sys/user/ are
per user namespace: the daemon runs in a new one (`unshare --user
--map-root-user`) with one limit lowered to 0 there, so `inotify_init` fails
with EMFILE or every `inotify_add_watch` with ENOSPC, as on a node where
other software has used them up. It must say so once, poll instead, and still
register with a kubelet that starts later, follow a kubelet restart and see a
device node go and come back.
"""

import os
import subprocess
import sys

import pytest

from rig.harness import REPO, RESOURCE, NotifySocket, end_process, wait_until
from rig.kubelet_standin import Kubelet


def _userns_works() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _userns_works(), reason="needs unshare --user (user namespaces)")]


class LimitedDaemon:
    """`atedevd run` in a new user namespace whose inotify `limit` is 0."""

    def __init__(self, tmp_path, plugin_dir: str, dev_root: str, limit: str):
        config = tmp_path / "empty.toml"
        config.write_text("")
        self.notify = NotifySocket(str(tmp_path / "notify"))
        self.log_path = tmp_path / "daemon.log"
        env = dict(os.environ, NOTIFY_SOCKET=self.notify.path, RUNTIME_DIRECTORY=str(tmp_path),
                   PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
        env.pop("JOURNAL_STREAM", None)
        env.pop("WATCHDOG_USEC", None)
        script = f'echo 0 > /proc/sys/user/{limit} && exec "$@"'
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh",
                 sys.executable, "-m", "atedevd", "run", "--config", str(config),
                 "--device-plugin-dir", plugin_dir, "--dev-root", dev_root, "--log-level", "info"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        end_process(self.proc)
        self.notify.close()


@pytest.mark.parametrize("limit, says", [
    ("max_inotify_instances", ["inotify_init failed", "EMFILE", "fs.inotify.max_user_instances"]),
    ("max_inotify_watches", ["inotify_add_watch(", "ENOSPC", "fs.inotify.max_user_watches"]),
])
def test_inotify_limit_is_loud_and_polling_recovers_everything(tmp_path, plugin_dir, dev_root, limit, says):
    kvm = os.path.join(dev_root, "kvm")
    d = LimitedDaemon(tmp_path, plugin_dir, dev_root, limit)
    kubelet = Kubelet(plugin_dir)
    try:
        assert d.notify.wait_for("READY", "1"), d.log()
        assert not os.path.exists(plugin_dir)  # kubelet comes later

        kubelet.start()
        assert kubelet.wait_connected(RESOURCE, timeout=10), d.log()

        healthy = lambda: kubelet.devices(RESOURCE) and set(kubelet.devices(RESOURCE).values()) == {"Healthy"}  # noqa: E731
        unhealthy = lambda: kubelet.devices(RESOURCE) and set(kubelet.devices(RESOURCE).values()) == {"Unhealthy"}  # noqa: E731
        assert wait_until(healthy), d.log()
        os.unlink(kvm)  # the kvm module unloaded
        assert wait_until(unhealthy, timeout=10), d.log()
        os.symlink("/dev/null", kvm)  # and loaded again
        assert wait_until(healthy, timeout=10), d.log()

        kubelet.restart()
        assert kubelet.wait_connected(RESOURCE, registrations=2, timeout=10), d.log()
        assert d.proc.poll() is None, d.log()
    finally:
        kubelet.close()
        d.close()
    text = d.log()
    loud = [line for line in text.splitlines() if "ERROR" in line or "WARNING" in line]
    inotify = [line for line in loud if "inotify_init" in line or "inotify_add_watch" in line]
    assert len(inotify) == 1, text  # once, not per retry
    assert all(s in inotify[0] for s in says) and "polling" in inotify[0], inotify
