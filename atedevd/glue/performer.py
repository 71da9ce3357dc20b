"""Carries out what one resource's registration machine decides, by the action's type.

It turns the machine's actions into binds, renames, Register and pod-resources
calls, stream endings and journal lines. It never calls the machine: an outcome
known at once (a socket bound, a Register refused because nobody listens) is
returned, and goes back to the plugin directory, which hands it in; one that comes
later (a call's answer, kubelet's stream opening or ending, a hang-up) goes to
`deliver`, on the loop, typed: each call has one callback. All of it goes through a `Host` (atedevd/daemon/host.py: sockets,
gRPC calls, the clock, the journal); the simulation (tests/simulation) runs this
same performer on a host of its own, so only the I/O beneath it is ever faked.
It decides nothing: `atedevd/registration/` does.
"""

import logging
import os
from functools import partial
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Set

from atedevd.kubelet import sockets
from atedevd.kubelet.plugin import StreamEvent
from atedevd.registration import messages as m
from atedevd.registration.messages import Listing, Outcome

if TYPE_CHECKING:
    from atedevd.glue.seams import HostIO, PendingCall, Server
    from atedevd.kubelet.calls import Allocatable
    from atedevd.kubelet.pod_resources import PodResourcesClient

# What a plugin server reports, as machine events.
_STREAM_EVENTS = {StreamEvent.OPENED: m.StreamOpened, StreamEvent.LIST_SENT: m.ListSent, StreamEvent.ENDED: m.StreamEnded}


class Performer:
    """The sockets and calls of one resource; `owner` gives its device, snapshot,
    stream budget and Allocate counts (atedevd/glue/resource.py); `deliver(event)` takes
    what comes back later, on the loop."""

    def __init__(self, owner, host: "HostIO", pod_resources: "PodResourcesClient", run_id: str,
                 serve_failed: Callable[[str, OSError], bool], deliver: Callable[[m.Event], None],
                 numbers: Iterator[int]) -> None:
        self.owner = owner
        self.deliver = deliver
        self.host = host
        self.pod_resources = pod_resources  # the daemon's one client (atedevd/kubelet/pod_resources.py)
        self.plugin_dir = host.plugin_dir
        self.run_id = run_id
        self.serve_failed = serve_failed  # (path, OSError) -> True when the daemon stops because of it
        self.servers: Dict[int, "Server"] = {}  # by socket id
        self._calls: Dict[int, "PendingCall"] = {}  # by call id, for cancelling
        self._told_gone: Set[int] = set()  # sockets the machine was told are deleted
        self._numbers = numbers  # of the socket names: the run's for this resource (one removed and added again goes on)
        self.registers_sent = 0

    @property
    def name(self) -> str:
        return self.owner.device.resource

    def perform(self, action: m.Action) -> Optional[m.Event]:
        """Carry out one action; its outcome when it is known at once."""
        return _DO[type(action)](self, action)

    # --- the actions -------------------------------------------------------------------------

    def _bind(self, a: m.Bind) -> Optional[m.Event]:
        directory = os.path.join(self.plugin_dir, sockets.STANDBY_DIR) if a.standby else self.plugin_dir
        path = os.path.join(directory, sockets.socket_name(self.name, self.run_id, next(self._numbers)))
        server = self.host.server(self.owner.device, path, self.owner.stream_slots, self.owner.allocations,
                                  partial(self._stream_event, sid=a.sid))
        server.publish(self.owner.snapshot)
        try:
            if a.standby:  # never the plugin directory itself: that is kubelet's to make
                self.host.make_dir(directory)
            server.start()
        except OSError as e:
            server.stop()
            if self.serve_failed(path, e):
                return None  # the daemon stops (a Stop follows, through the loop)
            return m.Bound(a.sid, f"on {path}: {e.strerror or e}")
        self.servers[a.sid] = server
        return m.Bound(a.sid)

    def _place(self, a: m.Place) -> m.Event:
        server = self.servers.get(a.sid)
        error = None
        try:
            if server is None:
                raise OSError("the socket is gone")
            server.move_to(os.path.join(self.plugin_dir, os.path.basename(server.bind_path)))
        except OSError as e:
            error = f"on {self.plugin_dir}: {e.strerror or e}"
        return m.Placed(a.sid, error)

    def _register(self, a: m.SendRegister) -> Optional[m.Event]:
        server = self.servers[a.sid]
        if not self.host.listening(self.host.kubelet_socket):  # kubelet.sock made, not yet listened on
            return m.RegisterDone(a.cid, Outcome.REFUSED, "kubelet is not accepting connections")
        self.registers_sent += 1
        self._calls[a.cid] = self.host.register(self.name, os.path.basename(server.socket_path), a.cid, self._registered)
        device = self.owner.device  # (said once the Register is on its way: a journal line costs ~1 ms cold)
        self.host.say(logging.INFO if self.registers_sent == 1 else logging.DEBUG, "serving",
                      f"{self.name}: serving {self.owner.snapshot.units} units of {device.path} on {server.socket_path}",
                      resource=self.name, device=device.path, socket=server.socket_path)
        return None

    def _ask(self, a: m.AskPodResources) -> Optional[m.Event]:
        path = self.host.pod_resources_socket
        if not self.host.exists(path):
            return m.Listed(a.cid, Listing.ABSENT)
        self._calls[a.cid] = self.pod_resources.ask(partial(self._listed, a.cid))
        return None

    def _count(self, a: m.CountConnections) -> m.Event:
        """kubelet's connections to these sockets; the host wakes us (`HungUp`) when it
        hangs one of them up, where it can watch them."""
        paths = [self.servers[s].bind_path for s in a.sids if s in self.servers]
        if not paths:
            return m.ConnectionsCounted(0)
        held, watched = self.host.count_connections(self, paths, partial(self.deliver, m.HungUp()))
        return m.ConnectionsCounted(held, watched)

    def _cancel(self, a: m.CancelCall) -> None:
        call = self._calls.get(a.cid)
        if call is not None:
            call.cancel()  # its outcome still comes back (and releases the channel); the machine ignores it
        return None

    def _end_streams(self, a: m.EndStreams) -> None:
        server = self.servers.get(a.sid)
        if server is not None:
            server.end_streams()
        return None

    def _resend(self, a: m.ResendList) -> None:
        server = self.servers.get(a.sid)
        if server is not None:
            server.resend()
        return None

    def _close(self, a: m.CloseSocket) -> None:
        server = self.servers.pop(a.sid, None)
        self._told_gone.discard(a.sid)
        if server is not None:
            self.host.unwatch(self)  # a watched connection must not outlive its server (kubelet would never see it close)
            server.stop()
        return None

    def _say(self, a: m.Say) -> None:
        self.host.say(a.level, a.kind, a.text, once=a.once, resource=self.name)
        return None

    # --- outcomes, on the loop -------------------------------------------------------------------

    def _stream_event(self, kind: StreamEvent, sid: int) -> None:
        if kind is StreamEvent.REFUSED:
            server = self.servers.get(sid)
            self.deliver(m.StreamRefused(sid, self.owner.stream_limit, server.socket_path if server else ""))
        else:
            self.deliver(_STREAM_EVENTS[kind](sid))

    def _registered(self, done: m.RegisterDone) -> None:
        self._calls.pop(done.cid, None)
        self.deliver(done)

    def _listed(self, cid: int, answer: "Allocatable") -> None:
        self._calls.pop(cid, None)
        if answer.listing is Listing.FAILED:
            self.host.say(logging.DEBUG, "pod-resources", f"{self.name}: pod-resources did not answer: {answer.error}")
        self.deliver(m.Listed(cid, answer.listing, answer.counts.get(self.name, 0)))

    # --- for the owner -----------------------------------------------------------------------------

    def newly_gone(self) -> List[int]:
        """The sockets whose file stopped being ours (deleted, or replaced) since the last look."""
        gone = [sid for sid, server in self.servers.items()
                if sid not in self._told_gone and server.inode is not None and not server.socket_is_ours()]
        self._told_gone.update(gone)
        return gone

    def socket_name(self, sid: int) -> Optional[str]:
        """The file name socket `sid` serves at, while it serves."""
        server = self.servers.get(sid)
        return os.path.basename(server.socket_path) if server is not None else None

    def is_ours(self, sid: int) -> bool:
        server = self.servers.get(sid)
        return server is not None and server.socket_is_ours()

    def publish(self, snapshot, device) -> None:
        """A new device table to every socket serving `device` (old sockets keep the old one)."""
        for server in self.servers.values():
            if server.device == device:
                server.publish(snapshot)

    def retarget(self, snapshot, device) -> None:
        """The device changed in what kubelet learns from the list or Allocate: every socket
        serves the new one, the current registration's included."""
        for server in self.servers.values():
            server.retarget(device)
            server.publish(snapshot)


# (A type checker cannot tie each key to its function's parameter: the completeness test does.)
_DO: Dict[type, Callable[..., Optional[m.Event]]] = {
    m.Bind: Performer._bind, m.Place: Performer._place, m.SendRegister: Performer._register,
    m.AskPodResources: Performer._ask, m.CountConnections: Performer._count, m.CancelCall: Performer._cancel,
    m.EndStreams: Performer._end_streams, m.ResendList: Performer._resend, m.CloseSocket: Performer._close,
    m.Say: Performer._say,
}
