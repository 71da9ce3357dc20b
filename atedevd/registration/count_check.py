"""Does kubelet count our devices? The pod-resources check of one registered resource: no I/O.

kubelet lists in pod-resources only the device IDs it holds healthy: all of them
while all is well; none after the plugin was disconnected, while an endpoint is
stopped, after the grace period, and after a kubelet restart until the plugin
registers. So "we send healthy units, kubelet lists none", seen twice 0.5 s
apart, is a lost registration. Another number than ours, not none, is a kubelet
that has not yet taken our newest list in (a pattern's node came or went): that
is lost only if it lasts BEHIND_LIMIT_S. It never gives up: the re-registrations
it drives back off (30 s, 60 s, 120 s, then every 5 minutes).
"""

import enum
import logging
from typing import Optional

from atedevd.registration.messages import Listing, Say

FIRST_S = 0.25  # kubelet has our first list (or a new one): ask this soon ...
CONFIRM_S = 0.5  # ... again this soon when kubelet's count differs from ours ...
EVERY_S = 60.0  # ... and otherwise this often (kubelet's grace for a lost plugin is 5 min)
BEHIND_LIMIT_S = 10.0  # kubelet counts some of ours, not all: behind our newest list, for this long at most
BACKOFF_S = (0.0, 30.0, 60.0, 120.0, 300.0)  # between re-registrations the check drives


class Agreement(enum.Enum):
    UNKNOWN = "unknown"  # not asked yet, or not answered
    AGREES = "agrees"  # kubelet counts what we send
    BEHIND = "behind"  # kubelet counts some of ours, not our newest list's: asked again soon
    DOUBTED = "doubted"  # kubelet counted none of ours once: asked again soon
    LOST = "lost"  # none twice, or behind too long: the machine registers again


class CountCheck:
    """When to ask pod-resources next, and what its answers mean."""

    def __init__(self, name: str, out: list) -> None:
        self.name = name
        self._out = out
        self.agreement = Agreement.UNKNOWN
        self.deadline: Optional[float] = None  # the next question is due then
        self.kubelet_count: Optional[int] = None  # what it listed last
        self._reregistered = 0  # re-registrations it drove, in a row
        self._reregistered_at: Optional[float] = None
        self._behind_since: Optional[float] = None

    def soon(self, now: float) -> None:
        """kubelet has a new device list of ours: its count follows; look again soon."""
        if self.agreement is Agreement.DOUBTED:
            self.agreement = Agreement.UNKNOWN
        self._behind_since = None  # the new list is the one to catch up with
        self.deadline = now + FIRST_S

    def first_list(self, now: float) -> None:
        """kubelet has the new registration's first device list: ask soon."""
        self.deadline = now + FIRST_S

    def stop(self) -> None:
        """Not registered any more (or the question is being asked): nothing due."""
        self.deadline = None

    def registered(self) -> None:
        if self.agreement is Agreement.DOUBTED:
            self.agreement = Agreement.UNKNOWN
        self._behind_since = None

    def on_answer(self, now: float, listing: Listing, count: int, expected: int) -> bool:
        """The answer to the check's question; True when the registration is lost (register again)."""
        if listing is not Listing.LISTED:
            self.deadline = now + EVERY_S
            return False
        self.kubelet_count = count
        if count == expected or expected == 0:
            self.agreement, self._reregistered, self._behind_since = Agreement.AGREES, 0, None
            self.deadline = now + EVERY_S
            return False
        if count > 0:  # kubelet counts us, from an older list than our newest
            if self._behind_since is None:
                self._behind_since = now
            if now - self._behind_since < BEHIND_LIMIT_S:
                self.agreement, self.deadline = Agreement.BEHIND, now + CONFIRM_S
                return False
        elif self.agreement is not Agreement.DOUBTED:
            self.agreement = Agreement.DOUBTED
            self.deadline = now + CONFIRM_S
            return False
        wait = BACKOFF_S[min(self._reregistered, len(BACKOFF_S) - 1)]
        if self._reregistered_at is not None and now < self._reregistered_at + wait:
            self.deadline = min(self._reregistered_at + wait, now + EVERY_S)
            return False
        self._reregistered += 1
        self._reregistered_at = now
        self.agreement = Agreement.LOST
        self.deadline = None
        self._out.append(Say(logging.WARNING, "not-counted", f"{self.name}: kubelet does not count our devices (pod-resources lists {count} of {expected} as allocatable) although we are registered; registering again (time {self._reregistered} in a row)"))
        return True
