"""udev, as the simulation's adversary of every rule about devices.

A dev root of the round's own, with links (as udev makes them) to character devices every
machine has: `unit0`..`unit5` come and go, are made anew with other numbers or with a node
the device policy refuses; `serial/*` links (udev's by-id ones) point at them and are
retargeted, so that a node changes under a link whose own directory says nothing; a
shareable `gps` link points at one of them or elsewhere. The resources overlap: `/dev/unit*`
(the simulation's pattern resource), `/dev/unit[0-1]`, `/dev/serial/*` and the shareable
`/dev/gps` reach the same nodes. Every change reaches each daemon as inotify's events a
while later (its own delay per daemon); a reload may come in between.
"""

import os
import shutil
import tempfile
from typing import List, Optional, Set

import inotify.constants as ic

from atedevd.config import Device
from atedevd.daemon.watch import DirEvent
from atedevd.devices.invariants import observe_disk

# Character devices every Linux machine has, which the device policy allows (class mem) ...
TARGETS = ("/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
REFUSED = "/dev/kmsg"  # ... and one it refuses (the kernel log)
UNITS = 6  # unit0 .. unit5
SERIALS = 3  # serial/s0 .. s2

OVERLAP_RESOURCE = "ate.dev/unit-low"  # /dev/unit[0-1]: two of the nodes /dev/unit* has too
SERIAL_RESOURCE = "ate.dev/serial"  # /dev/serial/*: links to the unit nodes
GPS_RESOURCE = "ate.dev/gps"  # /dev/gps: a shareable link to one of them, or to /dev/null
_DEVICES = {OVERLAP_RESOURCE: Device(OVERLAP_RESOURCE, "/dev/unit[0-1]"),
            SERIAL_RESOURCE: Device(SERIAL_RESOURCE, "/dev/serial/*"),
            GPS_RESOURCE: Device(GPS_RESOURCE, "/dev/gps", 8)}
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None


class Udev:
    def __init__(self, world) -> None:
        self.w = world
        self.root = tempfile.mkdtemp(prefix="atedevd-sim-udev-", dir=_SCRATCH)
        os.mkdir(os.path.join(self.root, "serial"))
        os.symlink("/dev/null", os.path.join(self.root, "null"))
        for n, target in enumerate(TARGETS):
            os.symlink(target, os.path.join(self.root, f"unit{n}"))
        self.configured: Set[str] = set(_DEVICES)  # which of the overlapping resources the configuration has
        self.changes = 0  # changes made to the nodes so far
        self.observe = observe_disk()  # what is at a path, as the daemon judges it (for the invariants)

    def devices(self, pattern: bool) -> List[Device]:
        return [d for name, d in _DEVICES.items() if name in self.configured]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # --- what udev does --------------------------------------------------------------------

    def act(self) -> None:
        """One thing udev (or an operator) does, chosen at random."""
        rng = self.w.rng
        what = rng.randrange(6)
        if what == 0:  # a unit's node comes or goes
            self.change(f"unit{rng.randrange(UNITS)}", rng.choice((None,) + TARGETS))
        elif what == 1:  # made anew with other numbers, or as a node pods may never have
            self.change(f"unit{rng.randrange(UNITS)}", rng.choice(TARGETS + (REFUSED,)))
        elif what == 2:  # a by-id link made, retargeted or removed
            self.change(f"serial/s{rng.randrange(SERIALS)}", rng.choice((None, f"../unit{rng.randrange(UNITS)}")))
        elif what == 3:  # the shareable link moved onto a unit's node, or off
            self.change("gps", rng.choice((None, "null", f"unit{rng.randrange(UNITS)}")))
        elif what == 4:  # a reload racing an unplug: the configuration is read before the event arrives
            self.change(f"unit{rng.randrange(UNITS)}", None)
            self._reload(rng.random() < 0.5)
        else:  # a reload that adds or drops an overlapping resource
            self._reload(True)

    def change(self, name: str, target: Optional[str]) -> None:
        """The link `name` (below the dev root) made to point at `target`, or removed (None);
        inotify tells each daemon a while later."""
        path = os.path.join(self.root, name)
        existed = os.path.lexists(path)
        if existed:
            os.unlink(path)
        if target is not None:
            os.symlink(target, path)
        elif not existed:
            return
        self.changes += 1
        directory, entry = os.path.split(path)
        masks = ([ic.IN_DELETE] if existed else []) + ([ic.IN_CREATE] if target is not None else [])
        batch = [DirEvent(directory, entry, mask) for mask in masks]
        for d in list(self.w.processes):
            d.udev_pending += 1
            self.w.after(self.w.delay(), d.device_events, batch)

    def _reload(self, toggle: bool) -> None:
        d = self.w.daemon
        if d is None or not d.alive or d.plugins.stopping or d.process.upgrading is not None:
            return  # (a reload is not taken then)
        if toggle:
            name = self.w.rng.choice(sorted(_DEVICES))
            self.configured ^= {name}
        d.reload(d.count, d.pattern)
