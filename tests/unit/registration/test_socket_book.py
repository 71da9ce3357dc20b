"""The SocketBook on its own, event by event: which sockets exist and what each is for."""


from atedevd.registration import messages as m
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
