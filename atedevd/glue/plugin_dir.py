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
from typing import Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence

import inotify.constants as ic

from atedevd.config import Device
from atedevd.devices.claims import Claims
from atedevd.glue.resource import Resource
from atedevd.kubelet import sockets
from atedevd.kubelet.calls import KUBELET_SOCKET, KubeletView
from atedevd.kubelet.pod_resources import PodResourcesClient
from atedevd.record import Record
from atedevd.registration import messages as m
from atedevd.registration.messages import State
from atedevd.registration.report import Report

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


class PluginDir:
    def __init__(self, plugin_dir: str, dev_root: str, sys_root: str, host, run_id: str, serve_failed) -> None:
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
                r.handle(now, m.Stop())
                self.leaving[name] = self.resources.pop(name)
                self.host.say(INFO, "resource-removed", f"{name}: no longer configured; stopping serving it", resource=name)
            elif wanted[name] != r.device or moved:
                d = wanted[name]
                how = "registering it anew" if r.reconfigure(d, dev_root, sys_root, now) else \
                    f"{r.snapshot.units} units of {d.path} ({d.permissions}) go to kubelet on the open stream"
                self.host.say(INFO, "resource-changed", f"{name}: configuration changed; {how}", resource=name)
        for name, device in wanted.items():
            if name not in self.resources:
                r = self.resources[name] = Resource(device, dev_root, sys_root, self.host, self.pod_resources,
                                                    self.run_id, self.serve_failed,
                                                    self._numbers.setdefault(name, itertools.count(1)), self.claims)
                r.advertised |= name in self.inherited  # its predecessor served it (Unhealthy, maybe): so do we

    def accept_nodes(self) -> None:
        """A reload checked the configuration: the nodes there now are the devices'."""
        for r in self.resources.values():
            r.accept_nodes()

    def _poke(self, name: str) -> None:
        """Another resource reaches one of `name`'s nodes now, or no longer: it looks again at once."""
        r = self.resources.get(name)
        if r is not None:
            r.nodes_may_have_changed()

    def directories_to_watch(self) -> Optional[FrozenSet[str]]:
        """kubelet's directory and every directory whose events can change what a resource
        serves (its nodes', and those its links lead through), when that changed since the
        last call (None: unchanged). A change in a directory before its watch was armed has
        no event: every resource looks once more when one is new."""
        specs = self.host.cdi.directories() if self.host.cdi is not None else frozenset()
        dirs = frozenset().union(*(r.directories for r in self.resources.values())) | {self.plugin_dir} | specs
        if dirs == self._watched:
            return None
        new, self._watched = dirs - self._watched, dirs
        if new:
            for r in self.resources.values():
                r.nodes_may_have_changed()
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
            if news.events_lost or not news.directories.isdisjoint(r.directories):
                r.nodes_may_have_changed()
            r.check_sockets(now)
            if news.from_kubelet or news.events_lost:  # any news from kubelet's side cuts a retry wait short
                r.handle(now, m.Nudge())
        return news

    def look_at_kubelet(self, now: float, created: bool, lost: bool) -> None:
        """Tell every resource when kubelet.sock appeared anew or went away."""
        if self.kubelet.refresh(created, events_lost=lost):
            for r in self.all_resources():
                r.kubelet_started(now, self.kubelet)
        elif self.kubelet.gone:
            self.kubelet.gone = False
            self.tell_all(now, m.KubeletGone())

    def wake(self, now: float) -> bool:
        """After any wake-up: what is due, then what is served made to match what exists.
        True when a resource began to be served."""
        at = self.pod_resources.deadline
        if at is not None and at <= now:
            self.pod_resources.on_timer(now)
        if not self.stopping and any(r.retry_due(now) for r in self.resources.values()):
            self.look_at_kubelet(now, created=False, lost=True)  # in case an event was lost
        for r in self.all_resources():
            at = r.deadline
            if at is not None and at <= now:
                r.on_timer(now)
        for name, r in list(self.leaving.items()):
            if r.stopped:  # kubelet let go of it: gone, and a new one of its name may be served
                r.handle(now, m.CloseAll())
                del self.leaving[name]
                if name not in self.resources and self.host.cdi is not None:
                    self.host.cdi.retire(name)  # its CDI spec goes with it
        return self.reconcile(now)

    def reconcile(self, now: float) -> bool:
        """Make what is served match what exists: devices, the plugin directory, our sockets."""
        if self.stopping:
            return False
        began = False
        dir_ok = self.host.isdir(self.plugin_dir)
        for r in self.resources.values():
            r.look_at_device(now)
            if not dir_ok:
                r.handle(now, m.Unserve("the plugin directory is gone"))
            elif r.advertised and r.name not in self.leaving:
                if r.state is State.UNSERVED:
                    r.serve(now, self.kubelet, self.on_hold)
                    began |= r.state is not State.UNSERVED
                r.check_sockets(now)
        return began

    # --- an upgrade (atedevd/upgrade/machines.py), and the end -------------------------------------------

    def tell_all(self, now: float, event: m.Event) -> None:
        """Every resource's registration is told: an upgrade's step (`Yield`, `TakeBack`,
        `RegisterAgain`), or the last word (`CloseAll`)."""
        for r in self.all_resources():
            r.handle(now, event)

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

    @property
    def ready_on_hold(self) -> bool:
        return all(r.ready_on_hold for r in self.resources.values())

    @property
    def yielded(self) -> bool:
        return all(r.yielded for r in self.resources.values())

    @property
    def registered(self) -> bool:
        """Every resource served is registered (kubelet streams our devices)."""
        return all(r.state is State.REGISTERED or (r.state is State.UNSERVED and not r.advertised)
                   for r in self.resources.values())

    # --- what the loop asks ----------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self.stopping and all(r.stopped for r in self.all_resources())

    def deadline(self) -> Optional[float]:
        """When the loop must wake next for a timer (each machine's timers read once: the loop
        asks after every wake-up)."""
        times = [at for at in (r.deadline for r in self.all_resources()) if at is not None]
        at = self.pod_resources.deadline
        if at is not None:
            times.append(at)
        if not self.stopping and self.resources:  # the look at the nodes, news or not (every 2 s)
            times.append(min(r.look_due for r in self.resources.values()))
        return min(times) if times else None

    def registers_sent(self) -> bool:
        """Every resource's first Register is on its way (or it is not waiting for one)."""
        return all(r.performer.registers_sent or r.state is not State.WAITING for r in self.resources.values())

    def reports(self) -> List[Report]:
        return [r.report() for r in self.resources.values()]

    def shown(self) -> tuple:
        """What the reports show: they changed when this did."""
        return tuple(r.shown() for r in self.resources.values())
