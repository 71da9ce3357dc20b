"""The daemon's one pod-resources client (atedevd/kubelet/pod_resources.py): one call for every
question that waits, an answer newer than the question, and a budget of atedevd's own
inside kubelet's limit (100 a second, burst 10, for every client on the node)."""

from atedevd.kubelet import pod_resources
from atedevd.kubelet.calls import Allocatable
from atedevd.kubelet.pod_resources import PodResourcesClient
from atedevd.registration.messages import Listing


class PodResourcesHost:
    pod_resources_socket = "/x/pod-resources/kubelet.sock"

    def __init__(self):
        self.now = 0.0
        self.calls = []  # the `done` of each call made, not yet answered

    def monotonic(self):
        return self.now

    def ask_allocatable(self, path, done):
        self.calls.append(done)

    def answer(self, count=4):
        self.calls.pop(0)(Allocatable(Listing.LISTED, {"ate.dev/kvm": count}))


def test_questions_that_wait_share_one_call_and_a_question_asked_meanwhile_waits_for_the_next():
    host, got = PodResourcesHost(), []
    c = PodResourcesClient(host)
    c.ask(lambda answer: got.append(("a", answer.counts)))
    c.ask(lambda answer: got.append(("b", answer.counts)))
    assert len(host.calls) == 1  # a is asked at once; b waits for the next call...
    host.answer(4)
    assert got == [("a", {"ate.dev/kvm": 4})] and len(host.calls) == 1  # ... which goes when a's comes back
    c.ask(lambda answer: got.append(("c", answer.counts)))
    c.ask(lambda answer: got.append(("d", answer.counts)))
    host.answer(0)
    assert got[1:] == [("b", {"ate.dev/kvm": 0})]
    host.answer(2)  # c and d, together
    assert got[2:] == [("c", {"ate.dev/kvm": 2}), ("d", {"ate.dev/kvm": 2})] and host.calls == []


def test_a_cancelled_question_is_not_asked_nor_answered():
    host, got = PodResourcesHost(), []
    c = PodResourcesClient(host)
    c.ask(lambda answer: got.append("a"))
    c.ask(lambda answer: got.append("b")).cancel()
    host.answer()
    assert got == ["a"] and host.calls == []


def test_the_budget_holds_under_any_number_of_questions():
    """Questions every millisecond for ten seconds: atedevd's calls stay within its budget,
    which leaves kubelet's limit to the node's other clients (an agent at 80 a second)."""
    host = PodResourcesHost()
    c = PodResourcesClient(host)
    made = []
    for ms in range(10000):
        host.now = ms / 1000
        if c.deadline is not None and c.deadline <= host.now:
            c.on_timer(host.now)
        c.ask(lambda answer: None)
        while host.calls:
            made.append(host.now)
            host.answer()
    assert len(made) <= pod_resources.BURST + pod_resources.RATE_PER_S * 10 + 1
    per_second = [sum(1 for t in made if s <= t < s + 1) for s in range(10)]
    assert max(per_second) <= pod_resources.BURST + pod_resources.RATE_PER_S
    assert pod_resources.RATE_PER_S + 80 <= 100  # with an agent at 80 a second, within kubelet's 100
    assert min(per_second) >= pod_resources.RATE_PER_S - 1  # and questions are not starved


def test_a_deadline_is_always_ahead_of_now():
    """Found by the simulation: when the budget was a rounding short of a token, the next
    call was due at `now` again, and the loop woke at the same moment for ever."""
    import random

    rng = random.Random(7)
    host = PodResourcesHost()
    c = PodResourcesClient(host)
    for _ in range(20000):
        c.ask(lambda answer: None)
        while host.calls:
            host.answer()
        if c.deadline is not None:
            assert c.deadline > host.now
            host.now = c.deadline  # the loop wakes at the deadline, exactly
            c.on_timer(host.now)
        else:
            host.now += rng.random() * 0.01
