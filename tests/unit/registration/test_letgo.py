"""The let-go wait on its own (`LetGo`): kubelet's connections to an old socket counted, then its
teardown confirmed in pod-resources; where neither shows, a fixed wait."""

import logging

from atedevd.registration import letgo
from atedevd.registration import messages as m
from atedevd.registration.letgo import LetGo, Phase, Purpose, Verdict
from atedevd.registration.messages import Listing
from atedevd.registration.socket_book import SocketBook

NAME = "ate.dev/kvm"


def of(out, kind):
    return [a for a in out if isinstance(a, kind)]


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
