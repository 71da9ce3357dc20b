"""The node's ResourceSlices kept true, as decisions: what to ask the API server next, and
what its answers mean. No I/O.

One question at a time: who the node is (`Connect`), what its slices are now (`ListSlices`),
and where they differ from what the devices say, the slices written with the pool's
generation one higher (`WriteSlices`). A change of the devices or a word from the watch (a
wipe by kubelet, someone's edit) while a question is out makes the publisher look again once
it is answered; a failure is tried again after a back-off that doubles up to RETRY_MOST_S.
Nothing is written while the server lists what is wanted, and the generation never goes back:
an earlier run's, or the server's, is where it stands.
"""

import logging
from typing import List, Mapping, Optional, Sequence, Tuple, Union

from atedevd.dra.slices import DraDevice, same_content, slices
from atedevd.glue.resource_events import TimerDue
from atedevd.record import Record
from atedevd.registration.messages import Say

RETRY_FIRST_S, RETRY_MOST_S = 0.5, 10.0
INFO, WARNING = logging.INFO, logging.WARNING


# --- what it is told ---------------------------------------------------------------------------

class Want(Record):
    """The devices to list now (the look at the nodes changed them)."""

    devices: Tuple[DraDevice, ...]


class Connected(Record):
    """The credentials work: the node they name (or the configured one), and its UID."""

    node: str
    node_uid: str
    user: str


class SlicesListed(Record):
    """The node's slices of our driver on the server now."""

    items: Tuple[Mapping, ...]


class Written(Record):
    """The slices are what `WriteSlices` asked for."""


class ApiFailed(Record):
    """The last question failed: why (the status line says it)."""

    why: str


class SlicesChanged(Record):
    """The watch saw a change to the node's slices (or began anew, and so may have missed one)."""


PublisherEvent = Union[Want, Connected, SlicesListed, Written, ApiFailed, SlicesChanged, TimerDue]


# --- what it asks for -----------------------------------------------------------------------------

class Connect(Record):
    """Find the credentials and ask who they are and the Node's UID: `Connected` or `ApiFailed`."""


class ListSlices(Record):
    """List the node's slices of our driver: `SlicesListed` or `ApiFailed`."""

    node: str


class WriteSlices(Record):
    """Create, replace (at their resourceVersion) and delete slices: `Written` or `ApiFailed`."""

    creates: Tuple[dict, ...]
    replaces: Tuple[Tuple[dict, str], ...]
    deletes: Tuple[str, ...]


PublisherAction = Union[Connect, ListSlices, WriteSlices, Say]


class Publisher:
    """The publisher of one DRA run. `handle(now, event)` is its one entry; it returns what to
    ask next. `deadline()` is when it wants `TimerDue` (a back-off), or None."""

    def __init__(self, node: Optional[str], publishing: bool = True) -> None:
        """`publishing` False: connect, and write nothing until it is set (a reload's successor,
        while its predecessor still publishes)."""
        self.publishing = publishing
        self.node = node  # the configured `[daemon] node_name`, or what the credentials say once connected
        self.node_uid: Optional[str] = None
        self.connected = False
        self.generation = 0
        self.published: Optional[Tuple[DraDevice, ...]] = None  # what the server lists, as far as we know
        self.problem = ""  # why the slices are not published, while they are not
        self.wanted: Tuple[DraDevice, ...] = ()
        self.taints_kept: Optional[bool] = None  # False: the server drops device taints (their gate is off)
        self._asked: Optional[PublisherAction] = None  # the question out
        self._look = False  # look again once it is answered
        self._writing: Tuple[DraDevice, ...] = ()
        self._asked_write = WriteSlices((), (), ())
        self._retry_at: Optional[float] = None
        self._delay = RETRY_FIRST_S
        self._out: List[PublisherAction] = []

    def deadline(self) -> Optional[float]:
        return self._retry_at

    @property
    def busy(self) -> bool:
        """A question is out, or one is to be asked: what the server lists may change."""
        return self._asked is not None or self._retry_at is not None or \
            (self._look and (self.publishing or not self.connected))

    def handle(self, now: float, event: PublisherEvent) -> List[PublisherAction]:
        if isinstance(event, Want):
            self.wanted = event.devices
            self._look = True
        elif isinstance(event, SlicesChanged):
            self._look = self.published is not None or self._look
        elif isinstance(event, TimerDue):
            if self._retry_at is not None and now >= self._retry_at:
                self._retry_at = None
                self._look = True
        elif isinstance(event, ApiFailed):
            self._asked = None
            if event.why != self.problem:
                self._out.append(Say(WARNING, "dra-api", f"ResourceSlices not published: {event.why}; trying again"))
                self.problem = event.why
            self._retry_at = now + self._delay
            self._delay = min(RETRY_MOST_S, self._delay * 2)
            self._look = False
        elif isinstance(event, Connected):
            self._asked = None
            if self.node is None or self.node != event.node:
                self._out.append(Say(INFO, "dra-node", f"node {event.node}: the credentials are {event.user}"))
            self.node, self.node_uid, self.connected = event.node, event.node_uid, True
            self._look = True
        elif isinstance(event, SlicesListed):
            self._asked = None
            self._compare(event.items)
        elif isinstance(event, Written):
            assert isinstance(self._asked, WriteSlices)
            self._asked_write, self._asked = self._asked, None
            self._succeeded()
            w = self._asked_write
            gone = " (an earlier run's replaced)" if self.published is None and (w.replaces or w.deletes) else ""
            self._out.append(Say(INFO, "dra-slices", f"published {len(self._writing)} device(s) of node {self.node} in "
                                                     f"{len(w.creates) + len(w.replaces)} ResourceSlice(s), pool "
                                                     f"generation {self.generation}{gone}"))
            self.published = self._writing
        self._next()
        out, self._out = self._out, []
        return out

    def _next(self) -> None:
        if self._asked is not None or self._retry_at is not None or not self._look:
            return
        if not self.connected:
            self._look = False
            self._asked = Connect()
        elif not self.publishing:
            return  # (looked at once it publishes)
        else:
            self._look = False
            assert self.node is not None
            self._asked = ListSlices(self.node)
        self._out.append(self._asked)

    def _succeeded(self) -> None:
        self._delay = RETRY_FIRST_S
        if self.problem:
            self._out.append(Say(INFO, "dra-api", "ResourceSlices published again"))
            self.problem = ""

    def _compare(self, existing: Sequence[Mapping]) -> None:
        """The server's slices against the wanted ones: nothing to write, or the writes."""
        assert self.node is not None
        wanted = self.wanted
        on_server = {str((s.get("metadata") or {}).get("name")): s for s in existing}
        generations = [int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0) for s in existing]
        self.generation = max([self.generation] + generations)
        docs = slices(self.node, self.node_uid, wanted, self.generation)

        def same(taints: bool) -> bool:
            return len(on_server) == len(docs) and all(
                d["metadata"]["name"] in on_server and same_content(on_server[d["metadata"]["name"]], d, taints)
                for d in docs)
        kept = self.taints_kept is not False
        if kept and not same(True) and self.published == wanted and same(False):
            self.taints_kept = kept = False  # (what we wrote came back without them)
            self._out.append(Say(WARNING, "dra-taints", "the API server drops device taints (DRADeviceTaints is off): "
                                                        "a device whose node went is listed untainted while a claim "
                                                        "holds it", once="dra-taints"))
        if same(kept):
            self._succeeded()
            self.published = wanted
            return
        self.generation += 1
        creates, replaces = [], []
        for d in slices(self.node, self.node_uid, wanted, self.generation):
            name = d["metadata"]["name"]
            if name in on_server:
                replaces.append((d, str((on_server[name].get("metadata") or {}).get("resourceVersion", ""))))
            else:
                creates.append(d)
        names = {d["metadata"]["name"] for d in docs}
        self._writing = wanted
        self._asked = WriteSlices(tuple(creates), tuple(replaces), tuple(n for n in on_server if n not in names))
        self._out.append(self._asked)
