"""The parts the registration machine is composed of, each on its own, event by event:
the SocketBook, the LetGo, the CountCheck and the Tally (atedevd/registration/)."""

import itertools
import logging

from atedevd.registration import count_check, letgo, questions, report
from atedevd.registration import messages as m
from atedevd.registration.count_check import Agreement, CountCheck
from atedevd.registration.letgo import LetGo, Phase, Purpose, Verdict
from atedevd.registration.messages import Listing, State, Why
from atedevd.registration.questions import Question, Questions
from atedevd.registration.report import Report, Tally, describe
from atedevd.registration.socket_book import Role, SocketBook

NAME = "ate.dev/kvm"


def of(out, kind):
    return [a for a in out if isinstance(a, kind)]


# --- SocketBook ----------------------------------------------------------------------------------


def test_the_book_binds_places_and_retires_sockets_in_turn():
    out = []
    book = SocketBook(out)
    standby = book.bind(standby=True)
    assert out == [m.Bind(standby, True)] and book.standby == standby
    assert book.place_standby() is None  # not serving yet: it stays the standby
    book.bound(standby)
    assert book.place_standby() == standby and book.placing == standby and book.standby is None
    assert out[-1] == m.Place(standby)
    book.make_current(standby)
    assert book.current == standby and not book.streaming
    assert book.opened(standby) is False and book.streaming
    assert book.retire_current() is True  # kubelet was streaming from it
    assert book.retiring == [standby] and book.current is None and book._socks[standby].role is Role.RETIRING
    assert book.known_retiring()  # a stream opened: kubelet has a client for it


def test_streams_are_ended_once_and_a_stream_opening_on_an_ended_socket_is_named():
    out = []
    book = SocketBook(out)
    sid = book.bind(standby=False)
    book.make_current(sid)
    book.retire_current()
    book.end([sid])
    book.end([sid])
    assert of(out, m.EndStreams) == [m.EndStreams(sid)]
    assert book.opened(sid) is True  # kubelet opened a stream on a socket we retired: end it too


def test_a_closed_socket_leaves_no_record():
    out = []
    book = SocketBook(out)
    for _ in range(1000):
        sid = book.bind(standby=False)
        book.bound(sid)
        book.make_current(sid)
        book.reached_kubelet(sid)
        book.retire_current()
        book.close_retiring()
    assert len(book) == 0 and book.retiring == [] and book.held() == []
    assert len(of(out, m.CloseSocket)) == 1000
    book.bound(1)  # a closed socket's late news is not kept either
    book.deleted(1)
    assert len(book) == 0 and not book.has(1)


def test_close_all_closes_every_role():
    out = []
    book = SocketBook(out)
    a = book.bind(standby=False)
    book.make_current(a)
    book.retire_current()
    b = book.bind(standby=False)
    book.make_current(b)
    c = book.bind(standby=True)
    d = book.bind(standby=False)
    book.close_all()
    assert {x.sid for x in of(out, m.CloseSocket)} == {a, b, c, d}
    assert (book.current, book.standby, book.placing, book.retiring, len(book)) == (None, None, None, [], 0)


# --- LetGo -------------------------------------------------------------------------------------


def retiring_book(out, streaming=True, listed=True):
    book = SocketBook(out)
    sid = book.bind(standby=False)
    book.bound(sid)
    book.make_current(sid)
    if streaming:
        book.opened(sid)
    book.listed_seen = listed
    book.retire_current()
    return book, sid


def test_the_let_go_wait_counts_connections_then_confirms_in_pod_resources():
    out = []
    book, sid = retiring_book(out)
    h = LetGo(NAME, book, out)
    assert h.begin(0.0, Purpose.REGISTER, streaming=True, healthy=True, pod_resources=True) is Verdict.WAIT
    assert h.phase is Phase.CONNECTIONS and of(out, m.EndStreams) == [m.EndStreams(sid)]
    assert of(out, m.CountConnections) == [m.CountConnections((sid,))]
    assert h.on_connections(0.001, 1, True, True) is Verdict.WAIT and h.deadline == 0.001 + letgo.FAST_POLL_S
    assert h.on_timer(0.002, True, True) is Verdict.WAIT and len(of(out, m.CountConnections)) == 2
    assert h.on_connections(0.1, 1, True, True) is Verdict.WAIT and h.deadline == 0.1 + letgo.POLL_S  # backed off
    assert h.on_timer(0.105, True, True) is Verdict.WAIT and len(of(out, m.CountConnections)) == 3
    assert h.on_connections(0.106, 0, True, True) is Verdict.ASK and h.phase is Phase.CONFIRM
    assert h.on_listing(0.107, Listing.LISTED, 4, True, True) is Verdict.WAIT  # still listed: look again
    assert h.on_timer(0.112, True, True) is Verdict.ASK
    assert h.on_listing(0.113, Listing.LISTED, 0, True, True) is Verdict.LET_GO
    assert h.phase is Phase.IDLE and h.deadline is None
    said = of(out, m.Say)
    assert [s.level for s in said] == [logging.DEBUG, logging.DEBUG] and "(confirm, 3 count(s)" in said[-1].text


def test_a_watched_count_sleeps_until_kubelet_hangs_up():
    """Where the host watches the connections it counted, the wait sets no poll: kubelet's
    hang-up wakes it to count again, and its limit is the only timer."""
    out = []
    book, sid = retiring_book(out)
    h = LetGo(NAME, book, out)
    h.begin(0.0, Purpose.REGISTER, streaming=True, healthy=True, pod_resources=True)
    assert h.on_connections(0.001, 2, True, True, watched=True) is Verdict.WAIT
    assert h.deadline == letgo.LIMIT_S and len(of(out, m.CountConnections)) == 1
    assert h.on_hangup() is Verdict.WAIT and len(of(out, m.CountConnections)) == 2
    assert h.on_connections(0.3, 0, True, True, watched=True) is Verdict.ASK and h.phase is Phase.CONFIRM
    assert h.on_hangup() is Verdict.WAIT and len(of(out, m.CountConnections)) == 2  # not counting now: moot


def test_the_let_go_wait_gives_up_on_held_connections_at_its_limit_and_says_so():
    out = []
    book, _ = retiring_book(out)
    h = LetGo(NAME, book, out)
    h.begin(0.0, Purpose.STOP, True, True, True)
    assert h.on_connections(letgo.STOP_LIMIT_S - 0.01, 1, True, True) is Verdict.WAIT
    assert h.on_connections(letgo.STOP_LIMIT_S, 1, True, True) is Verdict.LET_GO
    warning = [s for s in of(out, m.Say) if s.level == logging.WARNING]
    assert len(warning) == 1 and "exiting anyway" in warning[0].text


def test_the_let_go_wait_falls_back_to_pod_resources_when_descriptors_cannot_show_connections():
    out = []
    book, _ = retiring_book(out, listed=True)
    h = LetGo(NAME, book, out)
    h.begin(0.0, Purpose.REGISTER, True, True, True)
    assert h.on_connections(0.0, None, True, True) is Verdict.ASK
    assert h.phase is Phase.UNLISTED and not h.connections_visible  # for good
    out2 = []
    book2, _ = retiring_book(out2, listed=False)  # kubelet never listed it: its teardown cannot show
    h2 = LetGo(NAME, book2, out2)
    h2.begin(0.0, Purpose.REGISTER, True, True, True)
    assert h2.on_connections(0.0, None, True, True) is Verdict.WAIT and h2.phase is Phase.FIXED
    assert h2.on_timer(letgo.FIXED_WAIT_S - 0.001, True, True) is Verdict.WAIT
    assert h2.on_timer(letgo.FIXED_WAIT_S, True, True) is Verdict.LET_GO


def test_the_let_go_wait_makes_a_stopped_endpoint_listed_again_before_ending_its_stream():
    out = []
    book, sid = retiring_book(out)
    h = LetGo(NAME, book, out, connections_visible=False)
    assert h.begin(0.0, Purpose.REGISTER, True, True, True) is Verdict.ASK and h.phase is Phase.LISTED
    assert of(out, m.EndStreams) == []  # not before kubelet lists it
    assert h.on_listing(0.01, Listing.LISTED, 0, True, True) is Verdict.WAIT
    assert of(out, m.ResendList) == [m.ResendList(sid)]
    h.on_listing(0.02, Listing.LISTED, 0, True, True)
    assert len(of(out, m.ResendList)) == 1  # again only every RESEND_EVERY_S
    h.on_listing(0.02 + letgo.RESEND_EVERY_S, Listing.LISTED, 0, True, True)
    assert len(of(out, m.ResendList)) == 2
    assert h.on_listing(0.6, Listing.LISTED, 4, True, True) is Verdict.WAIT
    assert h.phase is Phase.UNLISTED and of(out, m.EndStreams) == [m.EndStreams(sid)]
    assert h.on_timer(0.61, True, True) is Verdict.ASK
    assert h.on_listing(0.62, Listing.LISTED, 0, True, True) is Verdict.LET_GO


def test_a_relisted_socket_is_waited_on_in_pod_resources_even_after_an_earlier_wait_had_no_signal():
    """Found by driving the LetGo directly: the old machine kept "no signal" from an earlier
    wait, so a socket kubelet had just listed again was given the fixed wait, not watched."""
    out = []
    book, _ = retiring_book(out, streaming=False, listed=False)
    h = LetGo(NAME, book, out, connections_visible=False)
    assert h.begin(0.0, Purpose.REGISTER, False, True, True) is Verdict.WAIT and h.phase is Phase.FIXED
    h.on_timer(1.0, True, True)
    book.close_retiring()
    sid = book.bind(standby=False)
    book.make_current(sid)
    book.opened(sid)
    book.retire_current()
    assert h.begin(2.0, Purpose.REGISTER, True, True, True) is Verdict.ASK
    h.on_listing(2.01, Listing.LISTED, 4, True, True)  # listed: its stream is ended now
    assert h.on_timer(2.02, True, True) is Verdict.ASK and h.phase is Phase.UNLISTED


def test_refused_pod_resources_means_kubelet_is_down_unless_stopping():
    for purpose, verdict in ((Purpose.REGISTER, Verdict.KUBELET_DOWN), (Purpose.STOP, Verdict.LET_GO)):
        out = []
        book, _ = retiring_book(out)
        h = LetGo(NAME, book, out)
        h.begin(0.0, purpose, True, True, True)
        h.on_connections(0.0, 0, True, True)
        assert h.on_listing(0.001, Listing.REFUSED, 0, True, True) is verdict
        assert h.phase is Phase.IDLE


def test_answers_nobody_asked_for_change_nothing():
    out = []
    book, _ = retiring_book(out)
    h = LetGo(NAME, book, out)
    assert h.on_listing(0.0, Listing.LISTED, 0, True, True) is Verdict.WAIT and h.phase is Phase.IDLE
    h.begin(0.0, Purpose.REGISTER, True, True, True)
    assert h.on_listing(0.0, Listing.LISTED, 0, True, True) is Verdict.WAIT and h.phase is Phase.CONNECTIONS
    assert h.on_connections(0.0, 0, True, True) is Verdict.ASK
    assert h.on_connections(0.0, 0, True, True) is Verdict.WAIT  # counted again in CONFIRM: ignored


def test_stopping_with_a_register_in_flight_waits_for_it_until_the_limit():
    out = []
    book, _ = retiring_book(out)
    h = LetGo(NAME, book, out)
    h.begin(0.0, Purpose.STOP, True, True, True)
    h.on_connections(0.0, 0, True, True)
    assert h.on_listing(0.01, Listing.LISTED, 0, True, True) is Verdict.LET_GO
    assert h.await_call(0.01) and h.phase is Phase.AWAIT_CALL and h.deadline == letgo.STOP_LIMIT_S
    assert h.on_timer(letgo.STOP_LIMIT_S, True, True) is Verdict.LET_GO
    assert not h.await_call(letgo.STOP_LIMIT_S)


def test_an_earlier_instance_is_waited_on_in_pod_resources():
    out = []
    h = LetGo(NAME, SocketBook(out), out)
    h.begin_earlier_instance(0.0, 4)
    assert h.phase is Phase.UNLISTED and h.deadline == letgo.POLL_S
    assert of(out, m.Say)[0].kind == "earlier-instance" and "lists 4 devices" in of(out, m.Say)[0].text
    assert h.on_timer(letgo.POLL_S, True, True) is Verdict.ASK
    assert h.on_listing(0.01, Listing.LISTED, 0, True, True) is Verdict.LET_GO


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
