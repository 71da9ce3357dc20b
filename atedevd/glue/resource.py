"""One configured resource, owned whole by one object.

A `Resource` holds everything about one `[[device]]`: its nodes on the host and
their health (`node_table`: one shareable node, or a pattern's units; the
immutable `Snapshot` its sockets serve), its registration with kubelet (`registration.Registration`, the
decisions) and the sockets and calls that carry it out (`performer.Performer`),
its stream budget and Allocate counts; and it hands STATUS= and the metrics one
typed `Report`. `atedevd/glue/plugin_dir.py` tells it what happened.
"""

import itertools
import os
import threading
from typing import FrozenSet, Iterator, List, Optional

from atedevd.cdi import keeper as cdi_keeper
from atedevd.config import Device
from atedevd.devices import shared, snapshot
from atedevd.devices.host_mode import HostMode
from atedevd.glue.performer import Performer
from atedevd.kubelet import sockets
from atedevd.kubelet.plugin import STREAMS_PER_RESOURCE, AllocateCounts, plugin_options
from atedevd.registration import messages as m
from atedevd.registration.machine import Registration
from atedevd.registration.messages import State, Timer
from atedevd.registration.moves import SERVED
from atedevd.registration.report import Report

# A resource's nodes are looked at when events in their directories say one may have come,
# gone or changed, and at least this often all the same (a look costs ~200 us for a pattern
# of 64 nodes, 6 us for a shareable node): the loop wakes for it (Node.deadline), so that what
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
    def __init__(self, device: Device, dev_root: str, sys_root: str, host, pod_resources, run_id: str,
                 serve_failed, numbers: Optional[Iterator[int]] = None, claims=None) -> None:
        self.device = device
        self.host = host
        self.claims = claims
        self.table = node_table(device, dev_root, sys_root, claims)  # its nodes as last looked at
        self.host_mode = HostMode(device, sys_root, host.say)  # host_mode: its host nodes' mode kept
        self._looked_at: Optional[float] = None  # when, unless its directories have news
        self.advertised = False  # once served, kept served (Unhealthy while the node is missing)
        self.stream_limit = STREAMS_PER_RESOURCE
        self.stream_slots = threading.BoundedSemaphore(STREAMS_PER_RESOURCE)  # shared by its sockets
        self.cdi = cdi_keeper.keeper_for(host, device.resource)  # its CDI spec, written before a socket has a snapshot
        self.allocations = AllocateCounts(cdi=self.cdi)  # over all its sockets
        self._version = 0
        self.look_at_device(host.monotonic(), publish=False)  # (its look for now: the first wake-up's is after the watches)
        self.snapshot = self._new_snapshot()
        longest = os.path.join(host.plugin_dir, sockets.STANDBY_DIR, sockets.socket_name(device.resource, run_id, 10**6))
        self.machine = Registration(device.resource, self.snapshot.units, self.snapshot.healthy_units,
                                    standby_possible=len(os.fsencode(longest)) <= sockets.MAX_SOCKET_PATH,
                                    device_path=device.path, connections_visible=host.connections_visible())
        self.performer = Performer(self, host, pod_resources, run_id, serve_failed,
                                   lambda event: self.handle(host.monotonic(), event), numbers or itertools.count(1))

    @property
    def name(self) -> str:
        return self.device.resource

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def deadline(self) -> Optional[float]:
        return self.machine.get_timer()

    @property
    def stopped(self) -> bool:
        return self.machine.stopped

    # --- its registration: events in, actions carried out ---------------------------------------

    def handle(self, now: float, event: m.Event) -> None:
        """An event for its registration; then every action that follows is carried out,
        and each outcome known at once goes back in as an event, in turn."""
        self.machine.handle(now, event)
        self._carry_out()

    def on_timer(self, now: float) -> None:
        self.machine.handle_timer(now)
        self._carry_out()

    def _carry_out(self) -> None:
        outcomes: List[m.Event] = []
        while True:
            for action in self.machine.take():
                outcome = self.performer.perform(action)
                if outcome is not None:
                    outcomes.append(outcome)
            if not outcomes:
                return
            now = self.host.monotonic()
            for outcome in outcomes:
                self.machine.handle(now, outcome)
            outcomes.clear()

    # --- the device's nodes ------------------------------------------------------------------

    @property
    def directories(self) -> FrozenSet[str]:
        """Where events can change what it serves (its links' targets' directories included)."""
        return self.table.directories()

    @property
    def look_due(self) -> float:
        """When its nodes are looked at again, news or not (at once: news, or never looked at)."""
        return -1.0 if self._looked_at is None else self._looked_at + LOOK_EVERY_S

    def nodes_may_have_changed(self) -> None:
        """Its directories had events (or events were lost, or another resource reaches one of
        its nodes now, or no longer): look at its nodes at the next chance."""
        self._looked_at = None

    def look_at_device(self, now: float, publish: bool = True) -> None:
        """Have its nodes come, gone or changed since the last look? Said, and published."""
        if now < self.look_due:  # (the deadline's own sum: no spin)
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
            self.handle(self.host.monotonic(), m.Publish(self.snapshot.units, self.snapshot.healthy_units))

    def accept_nodes(self) -> None:
        """A reload: the nodes there now are accepted as the device's (the configuration
        check has judged them)."""
        self.table.forget()
        self._looked_at = None

    def reconfigure(self, device: Device, dev_root: str, sys_root: str, now: float) -> bool:
        """The `[[device]]` (or where nodes are looked up) changed on reload. What kubelet
        learns from the device list (the units, their health) or from Allocate (the path,
        the permissions, the companions) goes out on the open stream and in the next
        Allocate: no new registration, no moment in which kubelet would refuse a pod. Only
        what Register itself carries (the plugin's options: a pattern's preferred
        allocation) needs a new registration, and old sockets keep the old table. True when
        it registers anew."""
        anew = plugin_options(device) != plugin_options(self.device)
        self.device = device
        self.table = node_table(device, dev_root, sys_root, self.claims)  # the nodes there now, judged afresh
        self.host_mode = HostMode(device, sys_root, self.host.say)
        self.nodes_may_have_changed()  # a new table: its look is due now
        self.look_at_device(now, publish=False)
        self.snapshot = self._new_snapshot()
        units, healthy = self.snapshot.units, self.snapshot.healthy_units
        if anew:
            self.handle(now, m.Reconfigure(units, healthy))
            return True
        self.performer.retarget(self.snapshot, device)
        self.handle(now, m.Publish(units, healthy))
        return False

    def _new_snapshot(self) -> snapshot.Snapshot:
        self._version += 1
        snapshot = self.table.snapshot(self._version)
        self.cdi.publish(snapshot, self.device)  # CDI: every name it may answer is on disk first
        return snapshot

    # --- what happened: told by the node ------------------------------------------------------

    def serve(self, now: float, kubelet, on_hold: bool = False) -> None:
        self.handle(now, m.Serve(kubelet.serving, self._on_our_clock(now, kubelet.since) if kubelet.serving else None, on_hold))

    def kubelet_started(self, now: float, kubelet) -> None:
        ours = any(self.performer.is_ours(sid) for sid in self.machine.held_sockets())
        self.handle(now, m.KubeletCreated(self._on_our_clock(now, kubelet.since), ours))

    def check_sockets(self, now: float) -> None:
        """Is every socket of ours still ours (after a directory event, or any wake-up)?"""
        for sid in self.performer.newly_gone():
            self.handle(now, m.SocketDeleted(sid))

    def retry_due(self, now: float) -> bool:
        return self.machine.timer_due(Timer.RETRY, now)

    def _on_our_clock(self, now: float, wall: float) -> float:
        """A wall-clock time (kubelet.sock's ctime) on the monotonic clock."""
        return now - max(0.0, self.host.wall() - wall)

    # --- an upgrade (atedevd/upgrade/machines.py) ---------------------------------------------------------

    @property
    def ready_on_hold(self) -> bool:
        """A successor's: nothing left to do before it may register (bound, or not served at all)."""
        if self.state is State.UNSERVED:
            return not self.advertised
        return self.state is State.WAITING and self.machine.standby_ready

    @property
    def yielded(self) -> bool:
        """A predecessor's: kubelet let go of its streams (or it has none: served again after its
        directory came back, but on hold)."""
        return self.state not in (State.YIELDING, *SERVED) or (self.state is State.WAITING and self.machine.on_hold)

    # --- what it tells ----------------------------------------------------------------------

    def shown(self) -> tuple:
        """What its report shows: it changed when this did."""
        return self.machine.shown(), self.advertised, self.device, self.performer.registers_sent

    def report(self) -> Report:
        return self.machine.report(self.device.path, self.device.pattern, self.advertised, self.performer.registers_sent,
                                   self.allocations.calls, self.allocations.failures)
