"""The CountCheck on its own: does kubelet count our devices (pod-resources)?"""

import logging

from atedevd.registration import count_check
from atedevd.registration import messages as m
from atedevd.registration.count_check import Agreement, CountCheck
from atedevd.registration.messages import Listing

NAME = "ate.dev/kvm"


def of(out, kind):
    return [a for a in out if isinstance(a, kind)]


# --- CountCheck -------------------------------------------------------------------------------------


def test_the_check_agrees_doubts_then_finds_the_registration_lost():
    out = []
    c = CountCheck(NAME, out)
    c.first_list(0.0)
    assert c.deadline == count_check.FIRST_S
    assert c.on_answer(1.0, Listing.LISTED, 1024, 1024) is False
    assert c.agreement is Agreement.AGREES and c.deadline == 1.0 + count_check.EVERY_S
    assert c.on_answer(2.0, Listing.LISTED, 0, 1024) is False
    assert c.agreement is Agreement.DOUBTED and c.deadline == 2.0 + count_check.CONFIRM_S
    assert c.on_answer(2.5, Listing.LISTED, 0, 1024) is True and c.agreement is Agreement.LOST
    said = of(out, m.Say)
    assert said[-1].level == logging.WARNING and "lists 0 of 1024" in said[-1].text and c.kubelet_count == 0


def test_the_re_registrations_it_drives_back_off_and_never_stop():
    c = CountCheck(NAME, [])
    now, lost_at = 0.0, []
    for _ in range(200):
        if c.on_answer(now, Listing.LISTED, 0, 4):  # registers again, and is verified at once
            lost_at.append(now)
            c.registered()
        now = c.deadline if c.deadline is not None else now + count_check.FIRST_S
        if now > 2000:
            break
    gaps = [round(b - a) for a, b in zip(lost_at, lost_at[1:])]
    assert gaps[:4] == [30, 60, 120, 300] and set(gaps[4:]) == {300}


def test_what_the_check_cannot_read_is_not_a_verdict():
    c = CountCheck(NAME, [])
    assert c.on_answer(0.0, Listing.FAILED, 0, 4) is False and c.deadline == count_check.EVERY_S
    assert c.agreement is Agreement.UNKNOWN and c.kubelet_count is None
    assert c.on_answer(1.0, Listing.LISTED, 0, 0) is False and c.agreement is Agreement.AGREES  # nothing healthy to count


def test_a_new_device_list_clears_a_doubt():
    c = CountCheck(NAME, [])
    c.on_answer(0.0, Listing.LISTED, 0, 4)
    c.soon(0.1)
    assert c.agreement is Agreement.UNKNOWN and c.deadline == 0.1 + count_check.FIRST_S
    assert c.on_answer(0.5, Listing.LISTED, 0, 4) is False  # a first difference again, not the second
