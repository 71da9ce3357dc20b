"""Which sockets of one resource exist, and what each one is for: no I/O.

Every registration names a socket of its own (`atedevd/kubelet/sockets.py` says why).
One waits, already serving, in the standby directory; one is being put in place
for the next Register; one is current (named in the last Register); old ones
retire until kubelet has let go of them. A socket's record goes when the socket
is closed, so nothing here grows with the number of registrations.
"""

import enum
from typing import Dict, List, Optional

from atedevd.registration.messages import Bind, CloseSocket, EndStreams, Place


class Role(enum.Enum):
    STANDBY = "standby"  # bound (or binding) in the standby directory
    PLACING = "placing"  # renamed (or bound) into kubelet's directory for the next Register
    CURRENT = "current"  # named in the last Register
    RETIRING = "retiring"  # an old socket kubelet may still hold


class _Socket:
    __slots__ = ("role", "bound", "gone", "watched", "streaming", "list_sent", "known", "ended")

    def __init__(self, role: Role) -> None:
        self.role = role
        self.bound = False  # serving
        self.gone = False  # its file was deleted under us
        self.watched = False  # kubelet opened a stream on it at some point
        self.streaming = False  # that stream is open (current only)
        self.list_sent = False  # kubelet has its first device list (current only)
        self.known = False  # kubelet may have a client for it (a Register reached kubelet)
        self.ended = False  # we ended its streams


class SocketBook:
    """The sockets of one resource, by id; actions go to `out` (the machine's list)."""

    def __init__(self, out: list) -> None:
        self._out = out
        self._socks: Dict[int, _Socket] = {}
        self._last_sid = 0
        self.standby: Optional[int] = None
        self.placing: Optional[int] = None
        self.current: Optional[int] = None
        self.retiring: List[int] = []
        # pod-resources listed our devices since the current socket was placed: only then
        # can kubelet's teardown of it show there.
        self.listed_seen = False
        self.deadline: Optional[float] = None  # the next standby is to be bound then

    def standby_at(self, at: float) -> None:
        """Bind the next standby then (unless one is there by then)."""
        self.deadline = at

    def cancel_timer(self) -> None:
        self.deadline = None

    def on_timer(self, serving: bool) -> None:
        self.deadline = None
        if serving and self.standby is None:
            self.bind(standby=True)

    # --- what the machine asks --------------------------------------------------------

    def bind(self, standby: bool) -> int:
        """A new socket: the standby, or bound in place for the next Register."""
        self._last_sid += 1
        sid = self._last_sid
        self._socks[sid] = _Socket(Role.STANDBY if standby else Role.PLACING)
        if standby:
            self.standby = sid
        else:
            self.placing = sid
        self._out.append(Bind(sid, standby))
        return sid

    def place_standby(self) -> Optional[int]:
        """Rename the standby into place if it is serving; its id, or None."""
        sid = self.standby
        if sid is None or not self._socks[sid].bound:
            return None
        self.standby, self.placing = None, sid
        self._socks[sid].role = Role.PLACING
        self._out.append(Place(sid))
        return sid

    def make_current(self, sid: int) -> None:
        """The placed socket is the one the next Register names."""
        s = self._socks[sid]
        s.role = Role.CURRENT
        self.placing, self.current = None, sid
        s.streaming, s.list_sent = s.watched, False
        self.listed_seen = False

    def retire_current(self) -> bool:
        """The current socket retires; whether kubelet was streaming from it."""
        sid = self.current
        if sid is None:
            return False
        s = self._socks[sid]
        streaming = s.streaming
        s.role, s.streaming, s.list_sent = Role.RETIRING, False, False
        self.retiring.append(sid)
        self.current = None
        return streaming

    def end(self, sids: List[int]) -> None:
        """End the streams on these sockets, once each (a stream opened later is ended as it opens)."""
        for sid in sids:
            s = self._socks.get(sid)
            if s is not None and not s.ended:
                s.ended = True
                self._out.append(EndStreams(sid))

    def close(self, sid: Optional[int]) -> None:
        if sid is None or sid not in self._socks:
            return
        del self._socks[sid]
        if sid == self.standby:
            self.standby = None
        if sid == self.placing:
            self.placing = None
        if sid == self.current:
            self.current = None
        if sid in self.retiring:
            self.retiring.remove(sid)
        self._out.append(CloseSocket(sid))

    def close_retiring(self) -> None:
        for sid in list(self.retiring):
            self.close(sid)

    def close_all(self) -> None:
        for sid in self.held() + [self.standby, self.placing]:
            self.close(sid)

    # --- what the performer reports ---------------------------------------------------

    def has(self, sid: int) -> bool:
        return sid in self._socks

    def bound(self, sid: int) -> None:
        s = self._socks.get(sid)
        if s is not None:
            s.bound = True

    def deleted(self, sid: int) -> None:
        s = self._socks.get(sid)
        if s is not None:
            s.gone = True

    def opened(self, sid: int) -> bool:
        """kubelet opened a stream on `sid`; True when it is one we ended (end it again)."""
        s = self._socks.get(sid)
        if s is None:
            return False
        s.watched = s.known = True
        if sid == self.current:
            s.streaming = True
        return s.ended

    def stream_ended(self) -> None:
        """kubelet ended its stream on the current socket."""
        if self.current is not None:
            self._socks[self.current].streaming = False

    def saw_listing(self) -> None:
        """pod-resources listed our devices since the current socket was placed."""
        self.listed_seen = True

    def reached_kubelet(self, sid: int) -> None:
        s = self._socks.get(sid)
        if s is not None:
            s.known = True

    # --- what the machine reads -------------------------------------------------------

    def held(self) -> List[int]:
        """The sockets kubelet may hold: the current one and those retiring."""
        return ([self.current] if self.current is not None else []) + self.retiring

    def known_retiring(self) -> bool:
        """A retiring socket kubelet may have a client for: its teardown is to be waited for."""
        return any(self._socks[s].known for s in self.retiring)

    def is_bound(self, sid: Optional[int]) -> bool:
        return sid is not None and sid in self._socks and self._socks[sid].bound

    def is_gone(self, sid: int) -> bool:
        return sid not in self._socks or self._socks[sid].gone

    @property
    def streaming(self) -> bool:
        """kubelet's stream on the current socket is open."""
        return self.current is not None and self._socks[self.current].streaming

    @property
    def list_sent(self) -> bool:
        return self.current is not None and self._socks[self.current].list_sent

    def mark_list_sent(self) -> None:
        if self.current is not None:
            self._socks[self.current].list_sent = True

    def __len__(self) -> int:
        return len(self._socks)
