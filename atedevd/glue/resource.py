"""One configured resource, owned whole by one object.

A `Resource` holds everything about one `[[device]]`: its nodes on the host and
their health (`node_table`: one shareable node, or a pattern's units; the
immutable `Snapshot` its sockets serve), its registration with kubelet (`registration.Registration`, the
decisions) and the sockets and calls that carry it out (`performer.Performer`),
its stream budget and Allocate counts. `atedevd/glue/plugin_dir.py` tells it what
happened through its one entry, `handle`, and reads it back through two: `view()` (a
`ResourceView`) and `report()` (the typed `Report` STATUS= and the metrics show).
"""

import itertools
import logging
import os
import threading
from functools import partial
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Union

from atedevd.cdi import keeper as cdi_keeper
from atedevd.config import Device
from atedevd.devices import shared, snapshot
from atedevd.devices.host_mode import HostMode
from atedevd.glue.performer import Performer
from atedevd.glue.resource_events import (AcceptNodes, CheckSockets, Configure, KubeletStarted, NodesMayHaveChanged,
                                          Reconcile, ResourceView, TimerDue)
from atedevd.kubelet import sockets
from atedevd.kubelet.plugin import STREAMS_PER_RESOURCE, AllocateCounts, plugin_options
from atedevd.record import Record
from atedevd.registration import messages as m
from atedevd.registration.machine import Registration
from atedevd.registration.messages import State, Timer
from atedevd.registration.moves import SERVED
from atedevd.registration.report import Report

if TYPE_CHECKING:
    from atedevd.devices.claims import Claims
    from atedevd.glue.seams import HostIO
    from atedevd.kubelet.pod_resources import PodResourcesClient

INFO = logging.INFO

# A resource's nodes are looked at when events in their directories say one may have come,
# gone or changed, and at least this often all the same (a look costs ~200 us for a pattern
# of 64 nodes, 6 us for a shareable node): the loop wakes for it (PluginDir.deadline), so that what
# no event said (a lost one, a link's node changed before its directory was watched) is seen
# without a wake-up for something else, and no wake-up for something else looks again.
LOOK_EVERY_S = 2.0


def node_table(device: Device, dev_root: str, sys_root: str, claims=None):
    """The loop's record of one resource's nodes: one shareable node (`shared.SharedTable`),
    or a pattern's units (`patterns.ExclusiveTable`); both answer look(), snapshot(version),
    forget(), recheck(rdev), directories(), served(), listing(), `healthy` and `advertised`.
    `claims` (atedevd/devices/claims.py): the other resources' reach, so that no node is two's."""
    if device.pattern:
        from atedevd.devices import patterns  # only where some device has a pattern: a start without pays nothing

        return patterns.ExclusiveTable(device, dev_root, sys_root, claims)
    return shared.SharedTable(device, dev_root, sys_root, claims)


class Resource:
    """One `[[device]]`. Its one entry is `handle(now, event)`, which returns the outcomes known at
    once (a socket bound, a Register refused because nobody listens): the plugin directory hands
    them back in, in turn. What comes later goes to `deliver(resource, event)` on the loop."""

    def __init__(self, device: Device, dev_root: str, sys_root: str, host: "HostIO", pod_resources: "PodResourcesClient",
                 run_id: str, serve_failed: Callable[[str, OSError], bool],
                 deliver: Callable[["Resource", m.Event], None], numbers: Optional[Iterator[int]] = None,
                 claims: Optional["Claims"] = None, advertised: bool = False) -> None:
        self.device = device
        self.host = host
        self.claims = claims
        self.table = node_table(device, dev_root, sys_root, claims)  # its nodes as last looked at
        self.host_mode = HostMode(device, sys_root, host.say)  # host_mode: its host nodes' mode kept
        self._looked_at: Optional[float] = None  # when, unless its directories have news
        # Once served, kept served (Unhealthy while the node is missing); from the start when an
        # upgrade's predecessor served it.
        self.advertised = advertised
        self.stream_limit = STREAMS_PER_RESOURCE
        self.stream_slots = threading.BoundedSemaphore(STREAMS_PER_RESOURCE)  # shared by its sockets
        self.cdi = cdi_keeper.keeper_for(host, device.resource)  # its CDI spec, written before a socket has a snapshot
        self.allocations = AllocateCounts(cdi=self.cdi)  # over all its sockets
        self._version = 0
        self._outcomes: List[m.Event] = []  # of the event being handled, known at once
        self._view: Optional[ResourceView] = None  # made when asked for, after an event
        self._look(host.monotonic(), publish=False)  # (its look for now: the first wake-up's is after the watches)
        self.snapshot = self._new_snapshot()
        longest = os.path.join(host.plugin_dir, sockets.STANDBY_DIR, sockets.socket_name(device.resource, run_id, 10**6))
        self.machine = Registration(device.resource, self.snapshot.units, self.snapshot.healthy_units,
                                    standby_possible=len(os.fsencode(longest)) <= sockets.MAX_SOCKET_PATH,
                                    device_path=device.path, connections_visible=host.connections_visible())
        self.performer = Performer(self, host, pod_resources, run_id, serve_failed, partial(deliver, self),
                                   numbers or itertools.count(1))

    @property
    def name(self) -> str:
        return self.device.resource

    @property
    def state(self) -> State:
        return self.machine.state

    # --- its one entry ---------------------------------------------------------------------------

    def handle(self, now: float, event: Union[m.Event, Record]) -> List[m.Event]:
        """An event for its registration (messages.Event) or for itself (resource_events); every
        action that follows is carried out. Returns the outcomes known at once, to be handed back
        in (never fed to the machine here: each event is read once, in one place)."""
        outer, self._outcomes = self._outcomes, []  # (another resource's look may poke this one meanwhile)
        try:
            if isinstance(event, m.Event):
                self._to_machine(now, event)
            else:
                _TOLD[type(event)](self, now, event)
        finally:
            outcomes, self._outcomes = self._outcomes, outer
            self._view = None
        return outcomes

    def view(self) -> ResourceView:
        """What the plugin directory reads of it: made once after each event."""
        if self._view is None:
            machine, state = self.machine, self.machine.state
            self._view = ResourceView(
                self.name, self.device, state, machine.get_timer(), machine.timer_at(Timer.RETRY), self._look_due(),
                self.table.directories(), self.advertised, machine.stopped, self._ready_on_hold(state),
                self._yielded(state), self.performer.registers_sent, machine.idle,
                (machine.shown(), self.advertised, self.device, self.performer.registers_sent))
        return self._view

    def report(self) -> Report:
        return self.machine.report(self.device.path, self.device.pattern, self.advertised, self.performer.registers_sent,
                                   self.allocations.calls, self.allocations.failures)

    def _to_machine(self, now: float, event: m.Event) -> None:
        self.machine.handle(now, event)
        self._carry_out()

    def _carry_out(self) -> None:
        for action in self.machine.take():
            outcome = self.performer.perform(action)
            if outcome is not None:
                self._outcomes.append(outcome)

    # --- what it is told --------------------------------------------------------------------------

    def _timer_due(self, now: float, e: TimerDue) -> None:
        self.machine.handle_timer(now)
        self._carry_out()

    def _nodes_may_have_changed(self, now: float, e: NodesMayHaveChanged) -> None:
        self._looked_at = None

    def _accept_nodes(self, now: float, e: AcceptNodes) -> None:
        self.table.forget()
        self._looked_at = None

    def _check_sockets(self, now: float, e: CheckSockets) -> None:
        for sid in self.performer.newly_gone():
            self._to_machine(now, m.SocketDeleted(sid))

    def _kubelet_started(self, now: float, e: KubeletStarted) -> None:
        ours = any(self.performer.is_ours(sid) for sid in self.machine.held_sockets())
        self._to_machine(now, m.KubeletCreated(self._on_our_clock(now, e.since), ours))

    def _reconcile(self, now: float, e: Reconcile) -> None:
        self._look(now)
        if not e.directory_there:
            self._to_machine(now, m.Unserve("the plugin directory is gone"))
        elif self.advertised and not e.old_self_leaving:
            if self.machine.state is State.UNSERVED:
                since = self._on_our_clock(now, e.kubelet_since) if e.kubelet_serving else None
                self._to_machine(now, m.Serve(e.kubelet_serving, since, e.on_hold))
            self._check_sockets(now, CheckSockets())

    def _configure(self, now: float, e: Configure) -> None:
        """The `[[device]]` (or where nodes are looked up) changed on reload. What kubelet
        learns from the device list (the units, their health) or from Allocate (the path,
        the permissions, the companions) goes out on the open stream and in the next
        Allocate: no new registration, no moment in which kubelet would refuse a pod. Only
        what Register itself carries (the plugin's options: a pattern's preferred
        allocation) needs a new registration, and old sockets keep the old table."""
        device = e.device
        anew = plugin_options(device) != plugin_options(self.device)
        self.device = device
        self.table = node_table(device, e.dev_root, e.sys_root, self.claims)  # the nodes there now, judged afresh
        self.host_mode = HostMode(device, e.sys_root, self.host.say)
        self._looked_at = None  # a new table: its look is due now
        self._look(now, publish=False)
        self.snapshot = self._new_snapshot()
        units, healthy = self.snapshot.units, self.snapshot.healthy_units
        if anew:
            how = "registering it anew"
            self._to_machine(now, m.Reconfigure(units, healthy))
        else:
            how = f"{units} units of {device.path} ({device.permissions}) go to kubelet on the open stream"
            self.performer.retarget(self.snapshot, device)
            self._to_machine(now, m.Publish(units, healthy))
        self.host.say(INFO, "resource-changed", f"{self.name}: configuration changed; {how}", resource=self.name)

    # --- the device's nodes ------------------------------------------------------------------

    def _look_due(self) -> float:
        """When its nodes are looked at again, news or not (at once: news, or never looked at)."""
        return -1.0 if self._looked_at is None else self._looked_at + LOOK_EVERY_S

    def _look(self, now: float, publish: bool = True) -> None:
        """Have its nodes come, gone or changed since the last look? Said, and published."""
        if now < self._look_due():  # (the deadline's own sum: no spin)
            return  # no news in its directories since
        periodic = self._looked_at is not None  # (the look's own deadline, not news: what no event says is looked for)
        self._looked_at = now
        changes, changed = self.table.look(periodic)
        self.host_mode.keep(self.table.kept())  # host_mode: the nodes judged now, again after any change
        for c in changes:
            self.host.say(c.level, c.event, f"{self.name}: {c.message}", resource=self.name, device=c.device or self.device.path)
        if not changed:
            return
        self.advertised |= self.table.advertised
        if publish:
            self.snapshot = self._new_snapshot()
            self.performer.publish(self.snapshot, self.device)
            self._to_machine(self.host.monotonic(), m.Publish(self.snapshot.units, self.snapshot.healthy_units))

    def _new_snapshot(self) -> snapshot.Snapshot:
        self._version += 1
        snapshot = self.table.snapshot(self._version)
        self.cdi.publish(snapshot, self.device)  # CDI: every name it may answer is on disk first
        return snapshot

    def _on_our_clock(self, now: float, wall: float) -> float:
        """A wall-clock time (kubelet.sock's ctime) on the monotonic clock."""
        return now - max(0.0, self.host.wall() - wall)

    # --- an upgrade (atedevd/upgrade/machines.py) ---------------------------------------------------------

    def _ready_on_hold(self, state: State) -> bool:
        """A successor's: nothing left to do before it may register (bound, or not served at all)."""
        if state is State.UNSERVED:
            return not self.advertised
        return state is State.WAITING and self.machine.standby_ready

    def _yielded(self, state: State) -> bool:
        """A predecessor's: kubelet let go of its streams (or it has none: served again after its
        directory came back, but on hold)."""
        return state not in (State.YIELDING, *SERVED) or (state is State.WAITING and self.machine.on_hold)


# (A type checker cannot tie each key to its function's parameter: tests/meta/test_dispatch.py does.)
_TOLD: Dict[type, Callable[..., None]] = {
    Configure: Resource._configure, AcceptNodes: Resource._accept_nodes,
    NodesMayHaveChanged: Resource._nodes_may_have_changed, KubeletStarted: Resource._kubelet_started,
    CheckSockets: Resource._check_sockets, TimerDue: Resource._timer_due, Reconcile: Resource._reconcile,
}
