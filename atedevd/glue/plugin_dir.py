"""kubelet's plugin directory as atedevd sees it, and every resource served there.

The daemon's loop (atedevd/daemon/loop.py) and the simulation (tests/simulation)
both drive a `PluginDir`: the directory events the watcher reports go through
`interpret`, the one reading of what the kernel told us, and become what each
`Resource` is told (kubelet started or went away, a socket of ours was deleted,
a nudge); after every wake-up, `wake` runs what is due and makes what is
served match what exists. All I/O goes through the host.
"""

import itertools
import logging
import os
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Union

import inotify.constants as ic

from atedevd.config import Device
from atedevd.devices.claims import Claims
from atedevd.glue.resource import Resource
from atedevd.glue.resource_events import (AcceptNodes, CheckSockets, Configure, KubeletStarted, NodesMayHaveChanged,
                                          Reconcile, TimerDue)
from atedevd.kubelet import sockets
from atedevd.kubelet.calls import KUBELET_SOCKET, KubeletView
from atedevd.kubelet.pod_resources import PodResourcesClient
from atedevd.record import Record
from atedevd.registration import messages as m
from atedevd.registration.messages import State
from atedevd.registration.report import Report

if TYPE_CHECKING:
    from atedevd.glue.seams import HostIO

INFO = logging.INFO
# Events after which some may be missing: look at kubelet.sock itself.
_LOST_EVENTS = ic.IN_Q_OVERFLOW | ic.IN_DELETE_SELF | ic.IN_MOVE_SELF | ic.IN_IGNORED
_MADE = ic.IN_CREATE | ic.IN_MOVED_TO


class DirectoryNews(Record):
    """What one batch of watcher events means for registration, and for the devices."""

    kubelet_created: bool  # kubelet.sock was (re)created
    events_lost: bool  # events may be missing (overflow, a watched directory came or went)
    overflowed: bool  # the kernel's queue overflowed
    from_kubelet: bool  # anything happened in kubelet's directory that is not ours
    directories: FrozenSet[str]  # where anything happened (a device's nodes may have come or gone)


def interpret(events: Iterable, plugin_dir: str, resources: Iterable[str]) -> DirectoryNews:
    """Read a batch of watch.DirEvent (inotify's, or polling's of the same shape): our own
    sockets and the standby directory are not news."""
    plugin_dir = os.path.normpath(plugin_dir)
    ours = tuple(sockets.prefix(n) + "." for n in resources) + (sockets.STANDBY_DIR,)
    created = lost = overflowed = news = False
    directories = set()
    for ev in events:
        directories.add(ev.directory)
        overflowed |= ev.is_(ic.IN_Q_OVERFLOW)
        lost |= ev.is_(_LOST_EVENTS) or (ev.is_(ic.IN_ISDIR) and ev.is_(_MADE))
        if ev.directory != plugin_dir or ev.name.startswith(ours):
            continue
        news = True
        created |= ev.name == KUBELET_SOCKET and ev.is_(_MADE)
    return DirectoryNews(created, lost, overflowed, news, frozenset(directories))


class Standing(Record):
    """Where the resources stand, as an upgrade's machines read it: handed to the process each
    time it changes (atedevd/glue/process.py), never polled."""

    ready_on_hold: bool  # a successor's: every resource bound, or not served at all
    yielded: bool  # a predecessor's: kubelet let go of every stream
    registered: bool  # every resource served is registered (kubelet streams our devices)


class PluginDir:
    """kubelet's plugin directory and the resources served there. A resource is told through
    `Resource.handle` alone and read through `view()` and `report()`; what it returns (the
    outcomes known at once) is handed back in here, in turn, as what comes later is."""

    def __init__(self, plugin_dir: str, dev_root: str, sys_root: str, host: "HostIO", run_id: str,
                 serve_failed: Callable[[str, OSError], bool]) -> None:
        self.plugin_dir = plugin_dir
        self.dev_root, self.sys_root = dev_root, sys_root  # where nodes are looked up, and the kernel's account of them
        self.host = host
        self.run_id = run_id
        self.serve_failed = serve_failed  # (path, OSError) -> True when the daemon stops because of it
        self.kubelet = KubeletView(plugin_dir, host.identity)
        self.pod_resources = PodResourcesClient(host)  # every resource's questions, within one budget
        self.resources: Dict[str, Resource] = {}
        # Removed by a reload, until kubelet has let go of them (bounded): one configured again
        # meanwhile is served once its old self is gone (kubelet <= 1.36 tears down by name).
        self.leaving: Dict[str, Resource] = {}
        self._numbers: Dict[str, Iterator[int]] = {}  # each resource's socket names, for the whole run
        self.stopping = False
        self.on_hold = False  # a successor's: serve, but register only once released (atedevd/upgrade/machines.py)
        self.inherited: FrozenSet[str] = frozenset()  # a successor's: the resources its predecessor served
        self.claims = Claims(self._poke)  # which resources reach which node: no node is two's (atedevd/devices/claims.py)
        self._watched: FrozenSet[str] = frozenset()  # the directories the watcher was last asked for
        self._standing: Optional[Standing] = None
        self._news: List[Standing] = []  # for the process, since it last took them

    # --- telling a resource ----------------------------------------------------------------------

    def tell(self, now: float, r: Resource, event: Union[m.Event, Record]) -> None:
        """`event` for `r`, then each outcome it returns, in turn, until none is left."""
        pending = r.handle(now, event)
        while pending:  # (in the order they came: an outcome's own outcomes after its siblings)
            now = self.host.monotonic()
            pending = [later for outcome in pending for later in r.handle(now, outcome)]
        self._stood()

    def delivered(self, r: Resource, event: m.Event) -> None:
        """What comes back later for `r` (a call's answer, a stream opened or ended), on the loop."""
        self.tell(self.host.monotonic(), r, event)

    def tell_all(self, now: float, event: m.Event) -> None:
        """Every resource's registration is told: an upgrade's step (`Yield`, `TakeBack`,
        `RegisterAgain`, `Release`), or the last word (`CloseAll`)."""
        for r in self.all_resources():
            self.tell(now, r, event)

    def _stood(self) -> None:
        """Where the resources stand changed: the process is told (an upgrade waits on it)."""
        views = [r.view() for r in self.resources.values()]
        standing = Standing(all(v.ready_on_hold for v in views), all(v.yielded for v in views),
                            all(v.state is State.REGISTERED or (v.state is State.UNSERVED and not v.advertised)
                                for v in views))
        if standing != self._standing:
            self._standing = standing
            self._news.append(standing)

    def news(self) -> List[Standing]:
        """Where the resources stood at each change since the last call, oldest first."""
        news, self._news = self._news, []
        return news

    # --- configuration -------------------------------------------------------------------------

    def apply(self, devices: Sequence[Device], dev_root: str, sys_root: str, now: float) -> None:
        """Adopt these devices: added start, removed stop (as at SIGTERM), changed are told
        (they go out on the open stream, or register anew), unchanged are not touched."""
        moved = (dev_root, sys_root) != (self.dev_root, self.sys_root)
        self.dev_root, self.sys_root = dev_root, sys_root
        self.claims.configure(devices, dev_root)
        wanted = {d.resource: d for d in devices}
        for name in list(self.resources):
            r = self.resources[name]
            if name not in wanted:  # it stops as at SIGTERM: kubelet lets go of it first (bounded)
                self.tell(now, r, m.Stop())
                self.leaving[name] = self.resources.pop(name)
                self.host.say(INFO, "resource-removed", f"{name}: no longer configured; stopping serving it", resource=name)
            elif wanted[name] != r.view().device or moved:
                self.tell(now, r, Configure(wanted[name], dev_root, sys_root))
        for name, device in wanted.items():
            if name not in self.resources:
                r = self.resources[name] = Resource(device, dev_root, sys_root, self.host, self.pod_resources,
                                                    self.run_id, self.serve_failed, self.delivered,
                                                    self._numbers.setdefault(name, itertools.count(1)), self.claims,
                                                    advertised=name in self.inherited)  # its predecessor served it: so do we
        self._stood()

    def hold(self, inherited: FrozenSet[str]) -> None:
        """An upgrade's successor, before its first configuration: serve what the predecessor
        served (`inherited`), and register only once released."""
        self.on_hold, self.inherited = True, inherited

    def accept_nodes(self, now: float) -> None:
        """A reload checked the configuration: the nodes there now are the devices'."""
        for r in self.resources.values():
            self.tell(now, r, AcceptNodes())

    def _poke(self, name: str) -> None:
        """Another resource reaches one of `name`'s nodes now, or no longer: it looks again at once."""
        r = self.resources.get(name)
        if r is not None:
            r.handle(self.host.monotonic(), NodesMayHaveChanged())  # (nothing comes of it at once)

    def directories_to_watch(self) -> Optional[FrozenSet[str]]:
        """kubelet's directory and every directory whose events can change what a resource
        serves (its nodes', and those its links lead through), when that changed since the
        last call (None: unchanged). A change in a directory before its watch was armed has
        no event: every resource looks once more when one is new."""
        specs = self.host.cdi.directories() if self.host.cdi is not None else frozenset()
        dirs = frozenset().union(*(r.view().directories for r in self.resources.values())) | {self.plugin_dir} | specs
        if dirs == self._watched:
            return None
        new, self._watched = dirs - self._watched, dirs
        if new:
            now = self.host.monotonic()
            for r in self.resources.values():
                self.tell(now, r, NodesMayHaveChanged())
        return dirs

    # --- what happened ---------------------------------------------------------------------------

    def on_directory_events(self, events: Iterable, now: float) -> DirectoryNews:
        news = interpret(events, self.plugin_dir, [*self.resources, *self.leaving])
        if self.stopping:
            return news
        if self.host.cdi is not None:  # the CDI specs' directory (atedevd/cdi/keeper.py)
            self.host.cdi.changed(news.directories if not news.events_lost else self.host.cdi.directories())
        self.look_at_kubelet(now, news.kubelet_created, news.events_lost)
        for r in self.all_resources():
            if news.events_lost or not news.directories.isdisjoint(r.view().directories):
                self.tell(now, r, NodesMayHaveChanged())
            self.tell(now, r, CheckSockets())
            if news.from_kubelet or news.events_lost:  # any news from kubelet's side cuts a retry wait short
                self.tell(now, r, m.Nudge())
        return news

    def look_at_kubelet(self, now: float, created: bool, lost: bool) -> None:
        """Tell every resource when kubelet.sock appeared anew or went away."""
        if self.kubelet.refresh(created, events_lost=lost):
            for r in self.all_resources():
                self.tell(now, r, KubeletStarted(self.kubelet.since))
        elif self.kubelet.gone:
            self.kubelet.gone = False
            self.tell_all(now, m.KubeletGone())

    def wake(self, now: float) -> bool:
        """After any wake-up: what is due, then what is served made to match what exists.
        True when a resource began to be served."""
        at = self.pod_resources.deadline
        if at is not None and at <= now:
            self.pod_resources.on_timer(now)
        if not self.stopping and any(v.retry_at is not None and v.retry_at <= now
                                     for v in (r.view() for r in self.resources.values())):
            self.look_at_kubelet(now, created=False, lost=True)  # in case an event was lost
        for r in self.all_resources():
            at = r.view().deadline
            if at is not None and at <= now:
                self.tell(now, r, TimerDue())
        for name, r in list(self.leaving.items()):
            if r.view().stopped:  # kubelet let go of it: gone, and a new one of its name may be served
                self.tell(now, r, m.CloseAll())
                del self.leaving[name]
                if name not in self.resources and self.host.cdi is not None:
                    self.host.cdi.retire(name)  # its CDI spec goes with it
        return self.reconcile(now)

    def reconcile(self, now: float) -> bool:
        """Make what is served match what exists: devices, the plugin directory, our sockets.
        True when a resource began to be served."""
        if self.stopping:
            return False
        began = False
        there = self.host.isdir(self.plugin_dir)
        for name, r in self.resources.items():
            unserved = r.view().state is State.UNSERVED
            self.tell(now, r, Reconcile(there, self.kubelet.serving, self.kubelet.since, self.on_hold, name in self.leaving))
            began |= unserved and r.view().state is not State.UNSERVED
        return began

    # --- an upgrade (atedevd/upgrade/machines.py), and the end -------------------------------------------

    def all_resources(self) -> List[Resource]:
        """Every resource, and those no longer configured that kubelet has yet to let go of."""
        return [*self.resources.values(), *self.leaving.values()]

    def release(self, now: float) -> None:
        """A successor's: register now."""
        self.on_hold = False
        self.tell_all(now, m.Release())

    def begin_stop(self, now: float, replaced: bool = False) -> None:
        """End our streams; the caller runs on until kubelet has let go of them (bounded).
        `replaced`: our successor is registered (an upgrade): no let-go to wait for."""
        self.stopping = True
        self.tell_all(now, m.Stop(replaced))

    def close(self, now: float) -> None:
        """Every socket of ours closed: the process exits."""
        self.tell_all(now, m.CloseAll())

    # --- what the loop asks ----------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self.stopping and all(r.view().stopped for r in self.all_resources())

    def deadline(self) -> Optional[float]:
        """When the loop must wake next for a timer (each machine's timers read once: the loop
        asks after every wake-up)."""
        times = [at for at in (r.view().deadline for r in self.all_resources()) if at is not None]
        at = self.pod_resources.deadline
        if at is not None:
            times.append(at)
        if not self.stopping and self.resources:  # the look at the nodes, news or not (every 2 s)
            times.append(min(r.view().look_due for r in self.resources.values()))
        return min(times) if times else None

    def registers_sent(self) -> bool:
        """Every resource's first Register is on its way (or it is not waiting for one)."""
        return all(v.registers_sent or v.state is not State.WAITING for v in (r.view() for r in self.resources.values()))

    @property
    def idle(self) -> bool:
        """No resource's registration has a timer set but the periodic ones, and no question waits."""
        return self.pod_resources.deadline is None and all(r.view().idle for r in self.all_resources())

    def served(self) -> List[str]:
        """The resources served now (an upgrade's successor serves them too, from its start)."""
        return [name for name, r in self.resources.items() if r.view().advertised]

    def allocations(self) -> tuple:
        """Each resource's Allocate calls and failures (counted on gRPC threads, read here)."""
        return tuple((r.allocations.calls, r.allocations.failures) for r in self.resources.values())

    def reports(self) -> List[Report]:
        return [r.report() for r in self.resources.values()]

    def shown(self) -> tuple:
        """What the reports show: they changed when this did."""
        return tuple(r.view().shown for r in self.resources.values())
