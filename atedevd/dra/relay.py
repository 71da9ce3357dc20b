"""Kubelet's connections to the held listening sockets, carried to this process's gRPC server,
and let go of without losing a call.

gRPC's Python server binds its own sockets and cannot serve one it is handed; the sockets
kubelet dials must outlive the process (atedevd/dra/listeners.py). So one thread accepts on
them and carries every connection's bytes, both ways, to the gRPC server listening on a
socket of this run's own (mode 0600, in the driver's directory).

The relay reads the HTTP/2 frames' headers as they pass (never their payloads), for one
purpose: to let a connection go when this process stops serving (a stop, a reload's handover)
without failing a call kubelet has sent. Stopping the gRPC server would do that: a call that
arrives as it shuts down is cancelled, and kubelet tries a pod whose prepare failed again
only a minute or more later. Instead, `drain` first stops accepting (new connections wait in
the backlog for whoever accepts next: the successor, the next start), then tells kubelet, on
each open connection, to start no new call there (a GOAWAY naming the highest possible
stream, as a gRPC server's graceful shutdown does), followed by a PING; once kubelet's
answer to that PING has passed (everything it sent before it has too) and every call on the
connection has been answered, the connection is closed. `drained` is set when none is left.
"""

import selectors
import socket
import struct
import threading
from typing import Callable, Dict, List, Optional, Set, Tuple

CHUNK = 1 << 16
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADER = struct.Struct(">HBBBI")  # length (24 bits: 16 + 8), type, flags, stream id (31 bits)
DATA, HEADERS, RST_STREAM, PING, GOAWAY = 0x0, 0x1, 0x3, 0x6, 0x7
END_STREAM, ACK = 0x1, 0x1
OPAQUE = b"atedevd!"  # our PING's payload
LAST_STREAM = 0x7FFFFFFF


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream) + payload


GOING_AWAY = frame(GOAWAY, 0, 0, struct.pack(">II", LAST_STREAM, 0)) + frame(PING, 0, 0, OPAQUE)


class _Frames:
    """One direction's frames, read as they pass: where the next one begins, and what a
    frame header says. `swallow` (kubelet's side): our PING's answer is not passed on."""

    __slots__ = ("preface", "head", "left", "held", "ends", "frames")

    def __init__(self, preface: int) -> None:
        self.preface = preface  # bytes of the client preface still to pass
        self.head = b""  # a frame header, partly read
        self.left = 0  # payload bytes of the current frame still to pass
        self.held: Optional[bytearray] = None  # a PING answer being read whole
        self.ends = 0  # the stream the current frame ends, once its payload has passed (0: none)
        self.frames = 0  # whole frames passed

    def payload(self, data: bytes, i: int, out: bytearray) -> int:
        """Pass on what `data` has of the current frame's payload, from `i`: where it ends."""
        take = min(self.left, len(data) - i)
        out += data[i:i + take]
        self.left -= take
        return i + take

    def header(self, data: bytes, i: int) -> Tuple[int, Optional[Tuple[int, int, int, int]]]:
        """Read a frame header from `i`: where it ends, and (length, type, flags, stream) once whole."""
        take = min(9 - len(self.head), len(data) - i)
        self.head += data[i:i + take]
        if len(self.head) < 9:
            return i + take, None
        hi, lo, kind, flags, stream = _HEADER.unpack(self.head)
        return i + take, ((hi << 8) | lo, kind, flags, stream & LAST_STREAM)

    @property
    def between(self) -> bool:
        """At a frame's boundary, after the first frame (a server's SETTINGS must come first)."""
        return not self.preface and not self.head and not self.left and self.held is None and self.frames > 0


class _Conn:
    """One kubelet connection and its way to the server."""

    __slots__ = ("outer", "inner", "up", "down", "to_inner", "to_outer", "open", "going_away", "acked", "ended_up",
                 "ended_down")

    def __init__(self, outer: socket.socket, inner: socket.socket) -> None:
        self.outer, self.inner = outer, inner
        self.up = _Frames(len(PREFACE))  # kubelet -> server
        self.down = _Frames(0)  # server -> kubelet
        self.to_inner = bytearray()
        self.to_outer = bytearray()
        self.open: Set[int] = set()  # streams kubelet began that the server has not ended
        self.going_away = False  # our GOAWAY is in `to_outer` (or sent)
        self.acked = False  # ... and kubelet's answer to the PING after it has passed
        self.ended_up = self.ended_down = False


class Relay:
    def __init__(self, listeners: Dict[str, socket.socket], inner_path: str,
                 accepted: Optional[Callable[[str], None]] = None) -> None:
        """`accepted(kind)`: told of each connection accepted, by the kind of socket it came to."""
        self.listeners = dict(listeners)  # (its own: the caller's may change while the thread reads this)
        self._accepted = accepted
        self.inner_path = inner_path
        self.drained = threading.Event()
        self.connections = 0  # accepted since the start
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._accepting = False
        self._want_accepting = True
        self._draining = False
        self._stop = False
        self._conns: Dict[socket.socket, _Conn] = {}  # by each of its two sockets
        self._thread = threading.Thread(target=self._run, name="dra-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Stop accepting, and let every open connection go once kubelet can send nothing more
        on it and all it sent is answered: `drained` is set then."""
        with self._lock:
            self._want_accepting, self._draining = False, True
            self.drained.clear()
        self._poke()

    def resume(self, inner_path: Optional[str] = None) -> None:
        """Accept again (to `inner_path`: a new server's socket)."""
        with self._lock:
            if inner_path is not None:
                self.inner_path = inner_path
            self._want_accepting, self._draining = True, False
        self._poke()

    def stop(self) -> None:
        """Every connection closed, the thread gone (the listening sockets are the caller's)."""
        with self._lock:
            self._stop = True
        self._poke()
        self._thread.join(5)

    def open_connections(self) -> int:
        return len({id(c) for c in self._conns.values()})

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # --- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    stop, want, draining = self._stop, self._want_accepting, self._draining
                if stop:
                    return
                if want != self._accepting:
                    for s in self.listeners.values():
                        if want:
                            self._sel.register(s, selectors.EVENT_READ, "listen")
                        else:
                            self._sel.unregister(s)
                    self._accepting = want
                if draining:
                    for c in set(self._conns.values()):
                        self._go_away(c)
                    if not self._conns:
                        self.drained.set()
                for key, events in self._sel.select():
                    if key.data is None:
                        try:
                            self._wake_r.recv(512)
                        except BlockingIOError:
                            pass
                    elif key.data == "listen":
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    else:
                        self._move(key.data, key.fileobj, events)  # type: ignore[arg-type]
        finally:
            for c in set(self._conns.values()):
                self._close(c)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            outer, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            inner.connect(self.inner_path)
        except OSError:
            inner.close()
            outer.close()  # (our server is gone: kubelet dials again)
            return
        self.connections += 1
        if self._accepted is not None:
            self._accepted(next(k for k, s in self.listeners.items() if s is listener))
        c = _Conn(outer, inner)
        for s in (outer, inner):
            s.setblocking(False)
            self._conns[s] = c
            self._sel.register(s, selectors.EVENT_READ, c)

    def _go_away(self, c: _Conn) -> None:
        if not c.going_away and c.down.between:
            c.going_away = True
            c.to_outer += GOING_AWAY
            self._rearm(c)

    def _move(self, c: _Conn, s: socket.socket, events: int) -> None:
        if events & selectors.EVENT_READ:
            try:
                data = s.recv(CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                if s is c.outer:
                    c.ended_up = True
                    self._shut(c.inner)
                else:
                    c.ended_down = True
                    self._shut(c.outer)
            elif data:
                if s is c.outer:
                    c.to_inner += self._up(c, data)
                else:
                    c.to_outer += self._down(c, data)
        if c.to_outer and not self._send(c.outer, c.to_outer) or c.to_inner and not self._send(c.inner, c.to_inner):
            self._close(c)
            return
        if (c.ended_up and c.ended_down) or (c.acked and not c.open and not c.to_outer and not c.to_inner):
            self._close(c)  # (both ends said their end; or let go: kubelet can send nothing more, all is answered)
            return
        self._rearm(c)

    def _up(self, c: _Conn, data: bytes) -> bytes:
        """kubelet's bytes: streams it begins, and our PING's answer taken out."""
        f, out, i, n = c.up, bytearray(), 0, len(data)
        while i < n:
            if f.preface:
                take = min(f.preface, n - i)
                out += data[i:i + take]
                f.preface -= take
                i += take
            elif f.held is not None:
                take = min(17 - len(f.held), n - i)
                f.held += data[i:i + take]
                i += take
                if len(f.held) == 17:
                    if bytes(f.held[9:]) == OPAQUE and c.going_away:
                        c.acked = True
                    else:
                        out += f.held
                    f.held = None
            elif f.left:
                i = f.payload(data, i, out)
            else:
                i, whole = f.header(data, i)
                if whole is None:
                    continue
                length, kind, flags, stream = whole
                if kind == PING and flags & ACK and length == 8:
                    f.held, f.head = bytearray(f.head), b""
                    continue
                if kind == HEADERS and stream:
                    c.open.add(stream)
                elif kind == RST_STREAM:
                    c.open.discard(stream)
                out += f.head
                f.head, f.left = b"", length
        return bytes(out)

    def _down(self, c: _Conn, data: bytes) -> bytes:
        """The server's bytes: streams it ends (once the frame that ends one has passed whole);
        our GOAWAY put in between two frames when due."""
        f, out, i, n = c.down, bytearray(), 0, len(data)
        while i < n:
            if f.left:
                i = f.payload(data, i, out)
            else:
                i, whole = f.header(data, i)
                if whole is None:
                    continue
                length, kind, flags, stream = whole
                ends = (kind in (DATA, HEADERS) and flags & END_STREAM) or kind == RST_STREAM
                out += f.head
                f.head, f.left, f.ends = b"", length, stream if ends else 0
            if not f.left and not f.head:
                f.frames += 1
                if f.ends:
                    c.open.discard(f.ends)
                    f.ends = 0
            if f.between and self._draining and not c.going_away:
                c.going_away = True
                out += GOING_AWAY
        return bytes(out)

    def _send(self, s: socket.socket, pending: bytearray) -> bool:
        """Write what waits, as far as the other side takes it; False: that side is gone."""
        try:
            n = s.send(pending)
            del pending[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return False
        return True

    @staticmethod
    def _shut(s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _rearm(self, c: _Conn) -> None:
        """Each socket is read while nothing read from it waits to be written (so that a slow
        reader slows the writer), and watched for writing while something waits for it."""
        for s, mine, theirs, ended in ((c.outer, c.to_inner, c.to_outer, c.ended_up),
                                       (c.inner, c.to_outer, c.to_inner, c.ended_down)):
            mask = (selectors.EVENT_READ if not mine and not ended else 0) | (selectors.EVENT_WRITE if theirs else 0)
            try:
                if mask:
                    self._sel.modify(s, mask, c)
                else:
                    self._sel.unregister(s)
            except KeyError:
                if mask:
                    self._sel.register(s, mask, c)

    def _close(self, c: _Conn) -> None:
        for s in (c.outer, c.inner):
            self._conns.pop(s, None)
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        with self._lock:
            if self._draining and not self._conns:
                self.drained.set()


def kinds(data: bytes) -> List[int]:
    """The frame types in a run of whole frames (the tests read what the relay sent)."""
    out, i = [], 0
    while i + 9 <= len(data):
        hi, lo, kind, _, _ = _HEADER.unpack(data[i:i + 9])
        out.append(kind)
        i += 9 + ((hi << 8) | lo)
    return out
