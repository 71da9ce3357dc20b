"""What the plugin directory tells one resource, beside its registration's own events.

`Resource.handle(now, event)` is a resource's one entry: an event of the registration
(atedevd/registration/messages.py) goes to its machine; one of these is the resource's own
(its nodes, its configuration, the kubelet the directory shows). `ResourceView` is what the
directory reads back: one typed value, made anew after each event.
"""

from typing import FrozenSet, Optional

from atedevd.config import Device
from atedevd.record import Record
from atedevd.registration.messages import State


class Configure(Record):
    """A reload changed its `[[device]]`, or where its nodes are looked up."""

    device: Device
    dev_root: str
    sys_root: str


class AcceptNodes(Record):
    """A reload checked the configuration: the nodes there now are the device's."""


class NodesMayHaveChanged(Record):
    """Its directories had events (or events were lost, or another resource reaches one of its
    nodes now, or no longer): its nodes are looked at at the next chance."""


class KubeletStarted(Record):
    """kubelet.sock appeared anew; `since`: its ctime (the wall clock)."""

    since: float


class CheckSockets(Record):
    """Is every socket of ours still ours (after a directory event, or any wake-up)?"""


class TimerDue(Record):
    """The loop woke at or after its registration's deadline."""


class Reconcile(Record):
    """What is served made to match what exists: its nodes looked at if due, then served,
    unserved or left as it is."""

    directory_there: bool  # kubelet's plugin directory exists
    kubelet_serving: bool
    kubelet_since: float  # kubelet.sock's ctime (the wall clock), while it serves
    on_hold: bool  # a successor's: serve, register once released
    old_self_leaving: bool  # one of its name removed by a reload is still let go of: not served yet


class ResourceView(Record):
    """One resource as the plugin directory reads it between events."""

    name: str
    device: Device
    state: State
    deadline: Optional[float]  # its registration's next timer
    retry_at: Optional[float]  # of those, the retry of a Register
    look_due: float  # its nodes are looked at then, news or not
    directories: FrozenSet[str]  # where events can change what it serves
    advertised: bool  # once served, kept served (Unhealthy while the node is missing)
    stopped: bool
    ready_on_hold: bool  # a successor's: nothing left to do before it may register
    yielded: bool  # a predecessor's: kubelet let go of its streams (or it has none)
    registers_sent: int
    idle: bool  # no timer of its registration is set but the periodic count check
    shown: tuple  # what its report shows: it changed when this did


# What `Resource.handle` dispatches to itself (the rest are its registration's: messages.Event).
EVENTS = (Configure, AcceptNodes, NodesMayHaveChanged, KubeletStarted, CheckSockets, TimerDue, Reconcile)
