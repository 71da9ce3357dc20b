"""The Tally on its own, and the Report STATUS= and the metrics read (`describe`)."""

import logging

from atedevd.registration import count_check
from atedevd.registration import messages as m
from atedevd.registration import report
from atedevd.registration.count_check import Agreement, CountCheck
from atedevd.registration.messages import Listing, State, Why
from atedevd.registration.report import Report, Tally, describe

NAME = "ate.dev/kvm"


def of(out, kind):
    return [a for a in out if isinstance(a, kind)]


# --- Tally and Report ----------------------------------------------------------------------------


def test_the_tally_counts_by_why_and_keeps_one_error():
    out = []
    t = Tally(NAME, out)
    for n in range(100):
        t.begin(Why.RETRY)
        t.failing(float(n), f"error {n}")
    assert t.begun == {Why.RETRY: 100} and t.last_error == "error 99" and t.failing_since == 0.0
    assert t.deadline is None  # never registered: no "still unregistered" warning
    t.verified(200.0, 4, "/dev/kvm")
    assert t.registrations == 1 and t.last_error is None
    assert of(out, m.Say)[-1] == m.Say(logging.INFO, "registered", f"{NAME}: registered with kubelet (4 units of /dev/kvm)")
    t.lost(300.0, logging.INFO, "stream-ended", "kubelet ended our ListAndWatch stream; registering again")
    t.failing(300.0, "kubelet restarted")
    assert t.deadline == 300.0 + report.WARN_AFTER_S
    t.on_timer(t.deadline, registered=False)
    assert of(out, m.Say)[-1].kind == "still-unregistered" and t.deadline == 320.0 + report.WARN_EVERY_S
    t.verified(321.0, 4, "/dev/kvm")
    assert t.last_reregistration == (321.0, 21.0) and t.deadline is None
    assert of(out, m.Say)[-1].text.endswith("registered again with kubelet (21000 ms after the loss)")


def test_a_new_reason_to_wait_is_worth_an_info_line_once_a_minute_before_the_first_registration():
    out = []
    t = Tally(NAME, out)

    def level(at, reason):
        t.failing(at, reason)
        return of(out, m.Say)[-1].level

    assert level(0.0, "kubelet.sock does not exist yet") == logging.INFO
    assert level(1.0, "kubelet.sock does not exist yet") == logging.DEBUG  # the same again
    assert level(2.0, "kubelet refused: INTERNAL: a") == logging.DEBUG  # new, but within the minute
    assert level(61.0, "kubelet refused: INTERNAL: b") == logging.INFO
    t.verified(70.0, 4, "/dev/kvm")
    assert level(200.0, "kubelet restarted") == logging.DEBUG  # after a registration: expected gaps


def test_a_socket_that_cannot_be_served_is_said_once():
    out = []
    t = Tally(NAME, out)
    for _ in range(3):
        t.serve_failed("on /x: Read-only file system")
    assert len(of(out, m.Say)) == 1 and t.serve_error == f"{NAME}: cannot serve on /x: Read-only file system"


def test_refused_streams_are_said_once_a_minute():
    out = []
    t = Tally(NAME, out)
    for n in range(10):
        t.stream_refused(n * 10.0, "/x.sock", 3)
    assert t.refused_streams == 10 and len(of(out, m.Say)) == 2


def test_describe_says_the_state_in_words():
    r = Report(name=NAME, device_path="/dev/kvm", pattern=False, state=State.REGISTERED, changed_at=0.0, advertised=True, units=4,
               healthy_units=4, kubelet_count=4, registrations=2, begun={}, registers_sent=2, allocate_calls=0,
               allocate_failures=0, refused_streams=1, last_error=None, failing_since=None, serve_error=None,
               last_reregistration=(10.0, 0.012))
    text = describe(r, 20.0, 1_700_000_000.0)
    assert text.startswith("registered, 4/4 healthy, kubelet counts 4, re-registered ") and text.endswith(
        " in 12 ms, 1 stream(s) refused")
    waiting = r._replace(state=State.WAITING, last_error="kubelet is not accepting connections", failing_since=15.0)
    assert "waiting for kubelet since " in describe(waiting, 20.0, 1_700_000_000.0)
    unserved = r._replace(state=State.UNSERVED, serve_error="ate.dev/kvm: cannot serve on /x: Read-only file system",
                          refused_streams=0)
    assert describe(unserved, 20.0, 0.0) == "not served: Read-only file system"


def test_kubelet_behind_our_newest_list_is_not_a_lost_registration_unless_it_stays_behind():
    """Found by the simulation: a pattern's node went and came back while kubelet was slow to
    take in our lists; pod-resources listed 4 of the 3 we then had, twice, and the check took
    that for a lost registration. Some of ours counted is kubelet behind, not kubelet without us."""
    out = []
    c = CountCheck(NAME, out)
    assert c.on_answer(0.0, Listing.LISTED, 4, 3) is False and c.agreement is Agreement.BEHIND
    assert c.on_answer(0.5, Listing.LISTED, 4, 3) is False and c.deadline == 0.5 + count_check.CONFIRM_S
    c.soon(1.0)  # another list: catching up starts again
    assert c.on_answer(count_check.BEHIND_LIMIT_S, Listing.LISTED, 2, 3) is False
    assert c.on_answer(2 * count_check.BEHIND_LIMIT_S, Listing.LISTED, 2, 3) is True  # behind for too long
    assert of(out, m.Say)[-1].kind == "not-counted"
    c2 = CountCheck(NAME, [])
    c2.on_answer(0.0, Listing.LISTED, 0, 3)
    assert c2.on_answer(0.5, Listing.LISTED, 0, 3) is True  # none of ours, twice: lost at once
