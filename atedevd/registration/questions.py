"""Our questions to kubelet's pod-resources API, one in flight, and what its answers
show of the API itself (served or not): no I/O.

Three parts of the registration ask the same question, how many of our devices
kubelet lists, for three reasons: at start (is an earlier instance's teardown
pending?), the count check, and the let-go wait. One call is in flight at a time;
its answer goes to whoever asked, and a question asked anew cancels the last. A
question kubelet's rate limit refused is no answer: it is asked again AGAIN_S later.
"""

import enum
import logging
from typing import Iterator, Optional

from atedevd.registration import letgo
from atedevd.registration.messages import AskPodResources, CancelCall, Listed, Listing, Say

AGAIN_S = 0.1  # kubelet's rate limit refused the question: ask it again this much later


class Question(enum.Enum):
    NONE = "none"  # nothing asked
    START = "start"  # at start: is an earlier instance's teardown pending?
    CHECK = "check"  # the CountCheck's: does kubelet count our devices?
    LET_GO = "let-go"  # the LetGo's: has kubelet let go of our old socket?


class Questions:
    def __init__(self, out: list, cids: Iterator[int]) -> None:
        self._out = out
        self._cids = cids  # shared with the machine's other calls
        self.asked = Question.NONE
        self._cid = 0
        self.deadline: Optional[float] = None  # a refused question is asked again then
        self.served: Optional[bool] = None  # kubelet serves pod-resources, as last seen (None: not asked yet)

    def ask(self, question: Question) -> None:
        self.cancel()
        self.asked = question
        self._send()

    def on_timer(self) -> None:
        self.deadline = None
        if self.asked is not Question.NONE:
            self._send()

    def _send(self) -> None:
        self._cid = next(self._cids)
        self._out.append(AskPodResources(self._cid))

    def cancel(self, unless: Question = Question.NONE) -> None:
        """Cancel the question in flight, unless it is `unless`."""
        if self.asked is not Question.NONE and self.asked is not unless:
            if self.deadline is None:
                self._out.append(CancelCall(self._cid))
            self.asked, self.deadline = Question.NONE, None

    def answered(self, now: float, e: Listed) -> Question:
        """Whose answer `e` is (NONE: a cancelled question's, or a refused one's, which is
        asked again); whether the API is served is noted."""
        if self.asked is Question.NONE or e.cid != self._cid:
            return Question.NONE
        if e.listing is Listing.EXHAUSTED:
            self.deadline = now + AGAIN_S
            return Question.NONE
        question, self.asked = self.asked, Question.NONE
        self._seen(e.listing)
        return question

    def _seen(self, listing: Listing) -> None:
        """Whether pod-resources is served, from any answer; said once each way."""
        if listing not in (Listing.LISTED, Listing.ABSENT):
            return
        served = listing is Listing.LISTED
        if served == self.served:
            return
        self.served = served
        if served:
            self._out.append(Say(logging.INFO, "pod-resources", "kubelet's pod-resources API is served: it cross-checks that kubelet counts our devices, and shows when kubelet has let go of an old socket", "pod-resources-served"))
        else:
            self._out.append(Say(logging.INFO, "pod-resources", f"kubelet's pod-resources API is not served: nothing cross-checks that kubelet counts our devices, and kubelet is given a fixed {letgo.FIXED_WAIT_S * 1000:.0f} ms to let go of an old socket", "pod-resources-absent"))
