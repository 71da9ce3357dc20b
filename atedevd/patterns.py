"""A pattern path (`/dev/ttyUSB*`, `/dev/vfio/[0-9]*`): the nodes it matches, and each one's ID.

Only the last part of the path may hold a pattern, so one directory holds every
match and one inotify watch sees every node come and go. Names are matched as
the shell's glob matches them: `*` and `?` do not match a leading dot unless the
pattern starts with one.

A unit's ID is the matched node's path under /dev with each "/" written "-":
`/dev/vfio/12` is `vfio-12`, `/dev/ttyUSB0` is `ttyUSB0`. kubelet keeps, in its
checkpoint, both the IDs a container holds and the Allocate answer that gave it
its nodes (the path), and after a restart either replays that answer or asks
again with the same IDs. Only an ID that always means the same path keeps the
two from disagreeing; an ID from a listing's order does not (the second node
of a directory is another node once the first is unplugged), and neither does
an ID from the hardware when the path it is answered with is the kernel's name
for whatever holds it now. Where the kernel's names are not stable enough, match
the links udev makes from the hardware (`/dev/serial/by-id/*`), whose names are.
This module is only imported when some device has a pattern.
"""

import fnmatch
import hashlib
import os
import re
from typing import List

from atedevd.config import MAX_DEVICE_ID, host_path

# Characters an ID keeps as they are; a name with any other gets a hash of itself.
_PLAIN = re.compile(r"[A-Za-z0-9._:+@-]+")
_HASH = 10  # hex digits of sha256 when an ID is shortened or its name was not plain


class Pattern:
    """The matches of one pattern path, looked up under a dev root."""

    def __init__(self, path: str, dev_root: str) -> None:
        self.path = path  # as configured, under /dev
        directory, self.glob = os.path.split(path)
        self.directory = directory  # as pods see it
        self.host_directory = os.path.normpath(host_path(directory, dev_root))
        self._match = re.compile(fnmatch.translate(self.glob)).match
        self._dots = self.glob.startswith(".")

    def names(self) -> List[str]:
        """Every entry of the directory the pattern matches, sorted; [] when the directory is not there."""
        try:
            entries = os.listdir(self.host_directory)
        except OSError:
            return []
        match, dots = self._match, self._dots
        return sorted(n for n in entries if (dots or n[0] != ".") and match(n))

    def path_of(self, name: str) -> str:
        """The path pods see for a match: `/dev/vfio/12`."""
        return self.directory + "/" + name

    def host_path_of(self, name: str) -> str:
        return os.path.join(self.host_directory, name)


def unit_id(path: str) -> str:
    """The ID of the unit at `path` (under /dev): the path below /dev, "/" as "-"; a name
    with characters IDs do not keep, or longer than kubelet's 63, is cut and ends in a hash
    of the whole path, so two paths never share an ID."""
    plain = path[len("/dev/"):].replace("/", "-")
    if len(plain) <= MAX_DEVICE_ID and _PLAIN.fullmatch(plain):
        return plain
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:_HASH]
    kept = "".join(c if _PLAIN.fullmatch(c) else "_" for c in plain)
    return kept[:MAX_DEVICE_ID - _HASH - 1] + "~" + digest
