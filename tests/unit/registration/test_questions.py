"""The Questions on its own: one pod-resources call in flight, and whose answer it is."""

import itertools

from atedevd.registration import letgo
from atedevd.registration import messages as m
from atedevd.registration import questions
from atedevd.registration.messages import Listing
from atedevd.registration.questions import Question, Questions

NAME = "ate.dev/kvm"


def of(out, kind):
    return [a for a in out if isinstance(a, kind)]


# --- Questions ----------------------------------------------------------------------------------------


def test_one_question_in_flight_and_its_answer_goes_to_whoever_asked():
    out = []
    q = Questions(out, itertools.count(1))
    q.ask(Question.START)
    q.ask(Question.CHECK)  # asked anew: the first is cancelled
    assert out == [m.AskPodResources(1), m.CancelCall(1), m.AskPodResources(2)]
    assert q.answered(0.0, m.Listed(1, Listing.LISTED, 4)) is Question.NONE  # the cancelled one's answer
    q.cancel(unless=Question.CHECK)
    assert q.asked is Question.CHECK and len(out) == 3
    assert q.answered(0.0, m.Listed(2, Listing.LISTED, 4)) is Question.CHECK and q.asked is Question.NONE
    assert q.answered(0.0, m.Listed(2, Listing.LISTED, 4)) is Question.NONE  # answered once


def test_a_question_the_rate_limit_refused_is_asked_again_later_and_answers_nobody_meanwhile():
    out = []
    q = Questions(out, itertools.count(1))
    q.ask(Question.LET_GO)
    assert q.answered(1.0, m.Listed(1, Listing.EXHAUSTED)) is Question.NONE
    assert q.asked is Question.LET_GO and q.deadline == 1.0 + questions.AGAIN_S and q.served is None
    q.on_timer()
    assert out[-1] == m.AskPodResources(2) and q.deadline is None
    assert q.answered(1.2, m.Listed(2, Listing.LISTED, 0)) is Question.LET_GO
    q.ask(Question.CHECK)
    q.answered(2.0, m.Listed(3, Listing.EXHAUSTED))
    q.cancel()  # while waiting to ask again: nothing in flight to cancel
    assert q.deadline is None and q.asked is Question.NONE and out[-1] == m.AskPodResources(3)


def test_whether_pod_resources_is_served_is_said_once_each_way():
    out = []
    q = Questions(out, itertools.count(1))
    for listing in (Listing.LISTED, Listing.LISTED, Listing.FAILED, Listing.ABSENT, Listing.ABSENT):
        q.ask(Question.CHECK)
        q.answered(0.0, m.Listed(q._cid, listing))
    said = of(out, m.Say)
    assert [s.once for s in said] == ["pod-resources-served", "pod-resources-absent"] and q.served is False
    assert f"fixed {letgo.FIXED_WAIT_S * 1000:.0f} ms" in said[1].text
