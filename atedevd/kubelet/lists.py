"""The device lists kubelet may still allocate from: what kubelet may still Allocate, we serve.

Every ListAndWatch message replaces kubelet's device set, but only once kubelet has
processed it: a reload that lowers the count (1024 -> 512) goes out on the stream at
once, and kubelet, still on the old list for another 7-57 ms (measured on kubelet 1.32),
admits pods with IDs from it (`kvm-987`). Refusing them ("unknown device ID") rejects
those pods for good. So each plugin server remembers the lists it sent on kubelet's
stream and, for an ID its newest list lacks, asks here whether an earlier list kubelet
may not yet have replaced had it Healthy:

- a shareable unit is granted: its node is the same whatever its number;
- a pattern's unit that left the list (its node gone at a reload, its match no longer
  the resource's) is refused with that reason, never as an unknown ID.

When kubelet has the newer list cannot be seen from the stream: gRPC asking for the
next message says only that it is on its way. An earlier list is honoured until the
newer one went out, and `TAKEN_S` after: the time the pod-resources check
(registration/count_check.py) gives a kubelet that counts an older list of ours before
it registers anew, which replaces every list.
"""

import threading
from typing import List

from atedevd.registration.count_check import BEHIND_LIMIT_S

TAKEN_S = BEHIND_LIMIT_S  # after a newer list went out, kubelet has it by then (or we register anew)
KEPT = 8  # earlier lists remembered at most (a burst of hot-plug events sends many)


class SentLists:
    """The lists one server sent on kubelet's stream (gRPC threads send and ask, under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: List[list] = []  # [snapshot, until]: oldest first; until None while it is the newest sent

    def sent(self, snapshot, now: float) -> None:
        """`snapshot` went out on kubelet's stream (gRPC asked for the next message)."""
        with self._lock:
            for entry in self._sent:
                if entry[1] is None:
                    entry[1] = now + TAKEN_S
            self._sent = [e for e in self._sent if e[1] is None or e[1] > now][-(KEPT - 1):] + [[snapshot, None]]

    def earlier(self, device_id: str, now: float):
        """How a list kubelet may still hold had `device_id`: the shareable snapshot, or the
        pattern's Unit, that listed it Healthy; None when none did."""
        with self._lock:
            lists = [s for s, until in self._sent if until is None or until > now]
        for snapshot in reversed(lists):
            found = snapshot.listed_healthy(device_id)
            if found is not None:
                return found
        return None

