"""The relay: kubelet's connections carried from the held listening sockets to this run's gRPC
server, byte for byte, and let go of on `drain` without losing a call (GOAWAY + PING at a frame
boundary, the PING's answer kept from the server, the connection closed once that answer has
passed and every stream the client began has been ended by the server).

The client and the inner server are raw sockets speaking frames made by relay.frame(), read back
with a parser of the test's own; one test runs a real gRPC client against the real DraServer.
"""

import fcntl
import os
import queue
import random
import select
import shutil
import socket
import struct
import tempfile
import termios
import threading

import grpc
import pytest

from atedevd.api import dra_v1_pb2 as drapb
from atedevd.api import service
from atedevd.dra import plugin, relay
from atedevd.dra.claims import Prepared
from atedevd.dra.preparer import PREPARE, ClaimOutcome
from rig.harness import wait_until

WAIT = 10.0  # for what takes milliseconds here (and well under a second on a loaded machine)
SETTINGS, END_HEADERS = 0x4, 0x4
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 3.4, written out: the test's oracle
OUR_GOAWAY = (relay.GOAWAY, 0, 0, struct.pack(">II", 0x7FFFFFFF, 0))  # last stream 2^31-1, NO_ERROR
OUR_PING = (relay.PING, 0, 0, b"atedevd!")
GOING_AWAY_LEN = 2 * 9 + 8 + 8
SETTINGS_FRAME = relay.frame(SETTINGS, 0, 0, b"")
OUR_ACK = relay.frame(relay.PING, relay.ACK, 0, b"atedevd!")


def frames(data: bytes):
    """(type, flags, stream, payload) of each frame of `data`, which must be whole frames."""
    out, i = [], 0
    while i < len(data):
        assert i + 9 <= len(data), f"a frame header cut short at byte {i} of {len(data)}"
        hi, lo, kind, flags, stream = struct.unpack(">HBBBI", data[i:i + 9])
        n = (hi << 8) | lo
        assert i + 9 + n <= len(data), f"a frame of {n} bytes cut short at byte {i} of {len(data)}"
        out.append((kind, flags, stream & 0x7FFFFFFF, data[i + 9:i + 9 + n]))
        i += 9 + n
    return out


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock`, or fewer if it ends first (each read waits up to WAIT)."""
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            break
        out += got
    return bytes(out)


def recv_to_end(sock: socket.socket) -> bytes:
    out = bytearray()
    while True:
        got = sock.recv(1 << 16)
        if not got:
            return bytes(out)
        out += got


def unread(sock: socket.socket) -> int:
    """Bytes `sock` sent that its peer has not read yet (SIOCOUTQ of a unix stream socket)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def read_by_relay(sock: socket.socket) -> None:
    """Wait until the relay has read all `sock` sent to it."""
    assert wait_until(lambda: unread(sock) == 0, WAIT), f"{unread(sock)} bytes still unread by the relay"


def listening(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(16)
    return s


class RelayRig:
    """A relay from a listening socket (as Listeners hands it: non-blocking) to a fake server
    the test plays, each connection's two ends in the test's hands."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "dra.sock")
        self.inner_path = os.path.join(directory, "inner.sock")
        self.listener = listening(self.path)
        self.listener.setblocking(False)
        self.inner = listening(self.inner_path)
        self.inner.settimeout(WAIT)
        self.relay = relay.Relay({"dra-service": self.listener}, self.inner_path)
        self.mine = [self.listener, self.inner]

    def dial(self) -> socket.socket:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.mine.append(client)
        client.settimeout(WAIT)
        client.connect(self.path)
        return client

    def connect(self):
        """A client through the relay, and the fake server's end of its connection."""
        client = self.dial()
        server, _ = self.inner.accept()
        self.mine.append(server)
        server.settimeout(WAIT)
        return client, server

    def open_connection(self, streams=()):
        """Past both prefaces; the client has begun `streams` (HEADERS)."""
        client, server = self.connect()
        hello = PREFACE + SETTINGS_FRAME + b"".join(relay.frame(relay.HEADERS, END_HEADERS, s, b"req") for s in streams)
        client.sendall(hello)
        assert recv_exactly(server, len(hello)) == hello
        server.sendall(SETTINGS_FRAME)
        assert recv_exactly(client, 9) == SETTINGS_FRAME
        return client, server

    def close(self) -> None:
        self.relay.stop()
        for s in self.mine:
            s.close()


@pytest.fixture
def sock_dir():
    """Short, under /tmp: a unix socket path has 107 bytes, which pytest's tmp_path may not leave."""
    root = tempfile.mkdtemp(prefix="ate", dir="/tmp")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def rig(sock_dir):
    r = RelayRig(sock_dir)
    r.relay.start()
    yield r
    r.close()


def take_going_away(client: socket.socket) -> None:
    got = recv_exactly(client, GOING_AWAY_LEN)
    assert frames(got) == [OUR_GOAWAY, OUR_PING]


def still_carried(client: socket.socket, server: socket.socket) -> None:
    """A frame from the server reaches the client whole: the relay has not let the connection go."""
    probe = relay.frame(relay.PING, 0, 0, b"probe!!!")
    server.sendall(probe)
    assert recv_exactly(client, len(probe)) == probe


def let_go(client: socket.socket, server: socket.socket) -> None:
    """The relay has closed the connection: both ends read their end."""
    assert client.recv(1) == b""
    assert server.recv(1) == b""


def test_the_frame_helpers_make_and_read_http2_frames():
    """relay.frame and relay.kinds, against the layout of RFC 9113 4.1 (the other tests rely on them)."""
    f = relay.frame(relay.DATA, relay.END_STREAM, 5, b"x" * 300)
    assert f[:9] == bytes([0, 1, 44, 0, 1, 0, 0, 0, 5]) and len(f) == 309
    assert relay.GOING_AWAY == relay.frame(7, 0, 0, b"\x7f\xff\xff\xff\x00\x00\x00\x00") + relay.frame(6, 0, 0, b"atedevd!")
    assert relay.kinds(f + SETTINGS_FRAME + relay.GOING_AWAY) == [0, 4, 7, 6]
    assert relay.PREFACE == PREFACE and relay.OPAQUE == b"atedevd!"


def test_bytes_pass_both_ways_unchanged_across_reads_and_each_side_s_end_is_passed_on(rig):
    """Frames larger than CHUNK each way at once reach the other side unchanged; the client's
    end (SHUT_WR) reaches the server while the way back stays open; the server's end then
    reaches the client, and the relay lets the connection go."""
    rnd = random.Random(20240607)
    client, server = rig.connect()
    up = (PREFACE + SETTINGS_FRAME + relay.frame(relay.HEADERS, END_HEADERS, 1, b"req")
          + relay.frame(relay.DATA, 0, 1, rnd.randbytes(3 * relay.CHUNK + 123)) + relay.frame(relay.DATA, relay.END_STREAM, 1, b""))
    down = (SETTINGS_FRAME + relay.frame(relay.HEADERS, END_HEADERS, 1, b"resp")
            + relay.frame(relay.DATA, 0, 1, rnd.randbytes(2 * relay.CHUNK + 7)))
    tail = relay.frame(relay.HEADERS, END_HEADERS | relay.END_STREAM, 1, b"trailers")
    got_up, got_down = [], []
    readers = [threading.Thread(target=lambda: got_up.append(recv_to_end(server))),
               threading.Thread(target=lambda: got_down.append(recv_to_end(client)))]
    for t in readers:
        t.start()

    def client_sends():
        client.sendall(up)
        client.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=client_sends)
    sender.start()
    server.sendall(down)
    sender.join(WAIT)
    readers[0].join(WAIT)
    assert got_up == [up], "the server did not read the client's bytes, then their end"
    assert rig.relay.connections == 1 and type(rig.relay.connections) is int
    server.sendall(tail)  # the way back is still open after the client's end
    server.shutdown(socket.SHUT_WR)
    readers[1].join(WAIT)
    assert got_down == [down + tail]
    assert wait_until(lambda: rig.relay.open_connections() == 0, WAIT)


def test_drain_with_no_connection_is_drained_at_once_and_resume_accepts_again(rig):
    rig.relay.drain()
    assert rig.relay.drained.wait(WAIT)
    rig.relay.resume()
    client, server = rig.open_connection()  # (carried: the relay accepted it)
    still_carried(client, server)
    assert rig.relay.connections == 1


def test_after_drain_a_new_connection_waits_in_the_backlog_for_whoever_accepts_next(rig):
    """drain(): the open connection is let go of once the client answers the PING; the relay then
    accepts nothing more: a client that dials waits in the listening socket's backlog, where
    the test's own accept() finds it (as the successor's would); resume() accepts again."""
    client, server = rig.open_connection()
    rig.relay.drain()
    take_going_away(client)
    assert not rig.relay.drained.is_set()
    client.sendall(OUR_ACK)
    let_go(client, server)
    assert rig.relay.drained.wait(WAIT)

    late = rig.dial()  # succeeds: the backlog
    assert select.select([rig.listener], [], [], WAIT)[0] == [rig.listener], "the connection was not left in the backlog"
    taken, _ = rig.listener.accept()
    rig.mine.append(taken)
    taken.settimeout(WAIT)
    late.sendall(b"hello")
    assert recv_exactly(taken, 5) == b"hello"  # the same connection, not carried anywhere
    assert rig.relay.connections == 1 and rig.relay.open_connections() == 0
    rig.inner.setblocking(False)
    with pytest.raises(BlockingIOError):
        rig.inner.accept()  # the relay dialled the server for nothing new
    rig.inner.settimeout(WAIT)

    rig.relay.resume()
    client, server = rig.open_connection()
    still_carried(client, server)
    assert rig.relay.connections == 2


def test_a_connection_the_relay_accepts_as_drain_is_called_is_let_go_of_before_drained(sock_dir):
    """drain() only tells the relay's thread: a client that dials before the thread wakes up is
    accepted (here made certain: the thread is held before its select() while drain() is called
    and the client dials). That connection is drained like the others: `drained` waits for it."""
    rig = RelayRig(sock_dir)
    real_select = rig.relay._sel.select
    hold, held, release = threading.Event(), threading.Event(), threading.Event()

    def select_held(timeout=None):
        if hold.is_set():
            held.set()
            release.wait(WAIT)
        return real_select(timeout)

    rig.relay._sel.select = select_held
    rig.relay.start()
    try:
        hold.set()
        rig.relay.resume()  # (wakes the thread: its next select() is held)
        assert held.wait(WAIT)
        rig.relay.drain()
        client = rig.dial()
        hold.clear()
        release.set()
        server, _ = rig.inner.accept()
        rig.mine.append(server)
        server.settimeout(WAIT)
        assert wait_until(lambda: rig.relay.connections == 1, WAIT)  # (counted once the server is dialled)
        server.sendall(SETTINGS_FRAME)  # (GOAWAY comes after the server's first frame)
        assert recv_exactly(client, 9) == SETTINGS_FRAME
        take_going_away(client)
        assert not rig.relay.drained.is_set()
        client.sendall(PREFACE + SETTINGS_FRAME + OUR_ACK)
        assert recv_exactly(server, len(PREFACE) + 9) == PREFACE + SETTINGS_FRAME
        let_go(client, server)
        assert rig.relay.drained.wait(WAIT)
    finally:
        release.set()
        rig.close()


@pytest.mark.parametrize("cut", ["payload", "header"])
def test_drain_while_the_server_is_inside_a_frame_puts_goaway_after_that_frame(rig, cut):
    """The server has sent part of a frame (a header and part of a payload larger than CHUNK, or
    part of the header) when drain() is called: the client gets that frame whole, then GOAWAY
    and PING, then what the server sent next, every frame intact."""
    rnd = random.Random(7)
    client, server = rig.open_connection(streams=(1,))
    payload = rnd.randbytes(2 * relay.CHUNK + 5)
    big = relay.frame(relay.DATA, 0, 1, payload)
    at = 9 + relay.CHUNK + 100 if cut == "payload" else 5
    server.sendall(big[:at])
    if cut == "payload":
        assert recv_exactly(client, at) == big[:at]  # the relay passed it on: it is inside the frame
    else:
        read_by_relay(server)  # (a header is passed on only once whole: nothing reaches the client)
    rig.relay.drain()
    after = relay.frame(relay.HEADERS, END_HEADERS, 1, b"more")
    server.sendall(big[at:] + after)
    want = len(big) + GOING_AWAY_LEN + len(after)
    got = (big[:at] if cut == "payload" else b"") + recv_exactly(client, want - (at if cut == "payload" else 0))
    assert relay.kinds(got) == [relay.DATA, relay.GOAWAY, relay.PING, relay.HEADERS]
    assert frames(got) == [(relay.DATA, 0, 1, payload), OUR_GOAWAY, OUR_PING, (relay.HEADERS, END_HEADERS, 1, b"more")]


def test_the_answer_to_our_ping_is_kept_from_the_server_and_any_other_passes_whole(rig):
    """Before drain an ACK carrying our opaque is no answer of ours (we sent no PING) and passes;
    after it, the client's ACK of another PING passes whole and ours does not, each sent in
    pieces the relay reads one by one; what follows ours passes."""
    client, server = rig.open_connection(streams=(1,))  # (an open stream keeps the connection)
    client.sendall(OUR_ACK)
    assert recv_exactly(server, len(OUR_ACK)) == OUR_ACK
    rig.relay.drain()
    take_going_away(client)
    other = relay.frame(relay.PING, relay.ACK, 0, b"kubelet!")
    for piece in (other[:4], other[4:12], other[12:]):
        client.sendall(piece)
        read_by_relay(client)
    for piece in (OUR_ACK[:9], OUR_ACK[9:13], OUR_ACK[13:]):
        client.sendall(piece)
        read_by_relay(client)
    ping_with_our_opaque = relay.frame(relay.PING, 0, 0, b"atedevd!")  # a PING, not an answer: passes
    client.sendall(ping_with_our_opaque)
    assert recv_exactly(server, len(other) + len(ping_with_our_opaque)) == other + ping_with_our_opaque
    still_carried(client, server)
    end = relay.frame(relay.HEADERS, END_HEADERS | relay.END_STREAM, 1, b"trailers")
    server.sendall(end)
    assert recv_exactly(client, len(end)) == end
    let_go(client, server)  # (nothing else came to the server: our ACK was not passed)
    assert rig.relay.drained.wait(WAIT)


def test_a_stream_the_server_has_not_ended_keeps_the_connection_after_the_answer(rig):
    """Streams 1 and 3 open, our PING answered: the connection stays while either is open;
    the server's DATA with END_STREAM ends 1 and its RST_STREAM ends 3, and then (not before)
    the connection is closed after that frame and `drained` is set."""
    client, server = rig.open_connection(streams=(1, 3))
    rig.relay.drain()
    take_going_away(client)
    client.sendall(OUR_ACK)
    still_carried(client, server)  # (the ACK has been read: a frame sent after it came back through)
    assert not rig.relay.drained.is_set() and rig.relay.open_connections() == 1
    end_1 = relay.frame(relay.DATA, relay.END_STREAM, 1, b"answer")
    server.sendall(end_1)
    assert recv_exactly(client, len(end_1)) == end_1
    still_carried(client, server)
    assert not rig.relay.drained.is_set() and rig.relay.open_connections() == 1
    reset_3 = relay.frame(relay.RST_STREAM, 0, 3, struct.pack(">I", 8))
    server.sendall(reset_3)
    assert recv_exactly(client, len(reset_3)) == reset_3
    let_go(client, server)
    assert rig.relay.drained.wait(WAIT) and rig.relay.open_connections() == 0


def test_with_every_stream_ended_the_connection_waits_for_the_answer_to_our_ping(rig):
    """Stream 1 ended by the server (HEADERS with END_STREAM), stream 3 reset by the client:
    nothing is open, yet the connection stays until the client's answer to our PING (until
    then it may still be sending a call), and is closed right after it."""
    client, server = rig.open_connection(streams=(1, 3))
    end_1 = relay.frame(relay.HEADERS, END_HEADERS | relay.END_STREAM, 1, b"trailers")
    server.sendall(end_1)
    assert recv_exactly(client, len(end_1)) == end_1
    reset_3 = relay.frame(relay.RST_STREAM, 0, 3, struct.pack(">I", 8))
    client.sendall(reset_3)
    assert recv_exactly(server, len(reset_3)) == reset_3
    rig.relay.drain()
    take_going_away(client)
    still_carried(client, server)
    assert not rig.relay.drained.is_set() and rig.relay.open_connections() == 1
    client.sendall(OUR_ACK)
    let_go(client, server)
    assert rig.relay.drained.wait(WAIT)


def test_the_connection_is_not_closed_inside_the_frame_that_ends_the_last_stream(rig):
    """Our PING answered, stream 1 open; the server's trailers (HEADERS with END_STREAM) reach
    the relay in two parts: the client must get the whole frame before the connection closes."""
    client, server = rig.open_connection(streams=(1,))
    rig.relay.drain()
    take_going_away(client)
    client.sendall(OUR_ACK)
    still_carried(client, server)
    trailers = relay.frame(relay.HEADERS, END_HEADERS | relay.END_STREAM, 1, b"t" * 64)
    server.sendall(trailers[:9 + 32])
    read_by_relay(server)
    try:
        server.sendall(trailers[9 + 32:])
    except OSError:
        pass  # (the relay has closed its end already)
    got = recv_to_end(client)
    assert got == trailers, f"the client got {len(got)} of the frame's {len(trailers)} bytes, then the end"


def test_goaway_never_comes_before_the_server_s_settings(rig):
    """Connection B is accepted and dialled through, but its server has not sent its SETTINGS
    when drain() is called: the client must still read SETTINGS first (RFC 9113 3.4)."""
    a_client, a_server = rig.open_connection()
    b_client, b_server = rig.connect()
    b_client.sendall(PREFACE + SETTINGS_FRAME)
    assert recv_exactly(b_server, len(PREFACE) + 9) == PREFACE + SETTINGS_FRAME
    rig.relay.drain()
    take_going_away(a_client)  # (the relay has looked at every connection, B too)
    b_server.sendall(SETTINGS_FRAME)
    got = recv_exactly(b_client, 9 + GOING_AWAY_LEN)
    assert relay.kinds(got) == [SETTINGS, relay.GOAWAY, relay.PING]


# --- a real gRPC client and server ------------------------------------------------------------------


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            data = a.recv(1 << 16)
            if not data:
                b.shutdown(socket.SHUT_WR)
                return
            b.sendall(data)
    except OSError:
        return


def test_a_call_under_way_is_answered_through_drain_and_the_client_moves_to_a_new_connection(sock_dir):
    """DraServer behind the relay, a gRPC client (grpcio) dialling the listening socket: a call is
    answered; a second is held by the loop when drain() is called: it is still answered, and
    `drained` is set only after it; a third call on the same channel, made once the client has
    answered our PING, is not failed: it comes on a new connection, which the relay leaves in
    the backlog and the test accepts itself (and carries to the server: it is answered)."""
    listen_path, inner_path = os.path.join(sock_dir, "dra.sock"), os.path.join(sock_dir, "inner.sock")
    listener = listening(listen_path)
    listener.setblocking(False)
    asked: "queue.Queue" = queue.Queue()
    held: "queue.Queue" = queue.Queue()
    calls = plugin.Calls(asked.put)

    def device(uid):
        return {uid: ClaimOutcome(devices=(Prepared(("kvm",), "node-a", "kvm", ("ate.dev/kvm=kvm",)),))}

    def loop():
        while True:
            a = asked.get()
            if a is None:
                return
            if a.claims[0].name == "held":
                held.put(a)
            else:
                calls.answer(a.call, device(a.claims[0].uid))

    looper = threading.Thread(target=loop, daemon=True)
    looper.start()
    server = plugin.DraServer(inner_path, listen_path, calls, lambda ok, error: None)
    server.start()
    r = relay.Relay({"dra-service": listener}, inner_path)
    r.start()
    channel = grpc.insecure_channel("unix:" + listen_path)
    dra = service.stub(service.DRA_PLUGIN, channel)
    mine = [listener]

    def ask(name, uid):
        return drapb.NodePrepareResourcesRequest(claims=[drapb.Claim(namespace="ns", name=name, uid=uid)])

    try:
        first = dra.NodePrepareResources(ask("pod-a", "uid-1"), timeout=WAIT)
        assert type(first) is drapb.NodePrepareResourcesResponse
        assert list(first.claims["uid-1"].devices[0].cdi_device_ids) == ["ate.dev/kvm=kvm"]
        second = dra.NodePrepareResources.future(ask("held", "uid-2"), timeout=3 * WAIT)
        was_held = held.get(timeout=WAIT)
        assert (was_held.kind, was_held.claims[0].uid) == (PREPARE, "uid-2")
        assert r.connections == 1 and r.open_connections() == 1

        r.drain()
        # The client's answer to our PING has passed (read in the relay: nothing outside shows
        # it), so the client has read our GOAWAY: its next call must not go on this connection.
        assert wait_until(lambda: any(c.acked for c in list(r._conns.values())), WAIT)
        third = dra.NodePrepareResources.future(ask("pod-c", "uid-3"), timeout=3 * WAIT)
        assert select.select([listener], [], [], WAIT)[0] == [listener], "the client did not dial again"
        outer, _ = listener.accept()
        outer.setblocking(True)
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        inner.connect(inner_path)
        mine += [outer, inner]
        for a, b in ((outer, inner), (inner, outer)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()
        assert r.connections == 1, "the relay accepted after drain"
        got = third.result(timeout=WAIT)
        assert list(got.claims["uid-3"].devices[0].cdi_device_ids) == ["ate.dev/kvm=kvm"]

        assert not r.drained.is_set() and r.open_connections() == 1 and not second.done()
        calls.answer(was_held.call, device("uid-2"))
        answered = second.result(timeout=WAIT)  # (no error)
        assert type(answered) is drapb.NodePrepareResourcesResponse
        assert [(d.pool_name, d.device_name) for d in answered.claims["uid-2"].devices] == [("node-a", "kvm")]
        assert r.drained.wait(WAIT) and r.open_connections() == 0
    finally:
        channel.close()
        server.stop(None)
        r.stop()
        asked.put(None)
        looper.join(WAIT)
        for s in mine:
            s.close()
