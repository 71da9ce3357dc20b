"""The kubelet stand-in (kubelet_standin.py serve ...) with timestamps in its state file.

For the systemd container: the state gains "timing", CLOCK_MONOTONIC seconds (one
clock for the host, the container and every unit in it):
  "sock": when each kubelet.sock appeared, already accepting (after the rename into place),
  "registers": every Register call's arrival, endpoint and error,
  "healthy": [time, resource, endpoint, healthy units in kubelet] at each client's first
             ListAndWatch message (kubelet has the new registration's devices).
Same arguments as `kubelet_standin.py serve`.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kubelet_standin  # noqa: E402


class _StampingOs:
    """kubelet_standin's `os`, noting the moment a socket is renamed into place as kubelet.sock
    (that is when it appears; the stand-in's own thread may get back to it milliseconds later)."""

    def __init__(self):
        self.renamed_at = None

    def __getattr__(self, name):
        return getattr(os, name)

    def rename(self, src, dst):
        os.rename(src, dst)
        if os.path.basename(dst) == kubelet_standin.KUBELET_SOCKET:
            self.renamed_at = time.monotonic()


class ContainerTimedKubelet(kubelet_standin.Kubelet):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sock_at = []
        self.healthy_at = []
        self._first = set()  # clients whose first ListAndWatch message arrived

    def _listen(self, inc, *args):
        _OS.renamed_at = None
        server = super()._listen(inc, *args)
        now = time.monotonic()
        with self.cond:
            self.sock_at.append(_OS.renamed_at or now)  # bound in place: when _listen returned
        return server

    def write_checkpoint(self) -> None:  # with the lock held, after every ListAndWatch message
        now = time.monotonic()
        for c in self.manager.all_clients:
            if c.connected and id(c) not in self._first:
                self._first.add(id(c))
                self.healthy_at.append([now, c.resource, c.endpoint, len(self.manager.healthy.get(c.resource, ()))])
        super().write_checkpoint()

    def state(self) -> dict:
        out = super().state()
        with self.cond:
            out["timing"] = {
                "sock": list(self.sock_at),
                "registers": [{"at": c["at"], "endpoint": c["endpoint"], "error": c["error"]} for c in self.register_calls],
                "healthy": [list(h) for h in self.healthy_at],
            }
        return out


_OS = _StampingOs()

if __name__ == "__main__":
    kubelet_standin.os = _OS
    kubelet_standin.Kubelet = ContainerTimedKubelet  # what `serve` builds
    sys.exit(kubelet_standin.main())
