"""The daemon's CDI specs: written before a snapshot reaches a socket, answered from, removed at the end.

`Specs` is the daemon's (one per process, `Host.cdi`): whether CDI grants are on, where,
whether answers carry the DeviceSpec too, and every resource's `Keeper`. A `Keeper` is
one resource's: the resource hands it each new snapshot before any socket serves it
(`publish`), and it writes the spec that resolves every name of it (atedevd/cdi_book.py
decides what); its sockets' Allocate asks it which names to answer (`names`, on gRPC
threads: it reads one immutable value). What it cannot write it does not answer: that
answer carries the DeviceSpec alone, and the failure is an ERROR in the journal and is
tried again every second.

The spec outlives nothing of ours it need not: at a stop it is removed, unless another
daemon serves it (an upgrade's successor, or a predecessor that serves on) or someone else
wrote it since; a daemon killed leaves it, valid, for the next start to replace.
"""

import logging
import os
import stat
import time
from typing import Callable, Dict, FrozenSet, Optional, Set, Tuple

from atedevd import cdi, cdi_book, cdi_files
from atedevd.config import Device, host_path

RETRY_EVERY_S = 1.0


class Specs:
    def __init__(self, say: Callable[..., None], sharing: bool = False) -> None:
        self.say = say  # Host.say
        self.enabled = False
        self.spec_dir = "/var/run/cdi"
        self.dev_root = "/dev"
        self.device_specs = True
        # Another daemon writes the same specs (an upgrade under way): keep its devices.
        self.sharing = sharing
        self.keepers: Dict[str, "Keeper"] = {}  # every resource's this run, removed ones too
        self._retry_at: Optional[float] = None

    def configure(self, cfg) -> None:
        """The configuration (at start, on reload): on or off, where, and how answers are made.
        A spec once written stays while the daemon runs (its names may be in kubelet's checkpoint)."""
        if cfg.cdi and (not self.enabled or cfg.cdi_spec_dir != self.spec_dir):
            try:
                with cdi_files.Locked(cfg.cdi_spec_dir) as d:
                    d.remove_leftovers()
            except OSError as e:
                self._failed(cfg.cdi_spec_dir, e)
        anew = cfg.cdi and (not self.enabled or cfg.cdi_spec_dir != self.spec_dir)
        self.enabled, self.spec_dir, self.dev_root = cfg.cdi, cfg.cdi_spec_dir, cfg.dev_root
        self.device_specs = cfg.device_specs or not cfg.cdi
        if anew:  # turned on, or moved, on reload: what the resources serve now, written there
            for k in self.keepers.values():
                k.again()

    def keeper(self, resource: str) -> "Keeper":
        k = self.keepers.get(resource)
        if k is None:
            k = self.keepers[resource] = Keeper(self, resource)
        return k

    @property
    def deadline(self) -> Optional[float]:
        return self._retry_at

    def retry(self, now: float) -> None:
        """Write again what could not be written (at most every RETRY_EVERY_S)."""
        if self._retry_at is None or now < self._retry_at:
            return
        self._retry_at = None
        for k in self.keepers.values():
            if k.failed:
                k.write()

    def owed(self) -> Set[str]:
        """Every qualified name this daemon could have answered Allocate with: each must resolve in
        the spec directory while it runs (and after a kill, until the next start has written its
        own). The simulation checks it after every event."""
        return {cdi.qualified(k.resource, n) for k in self.keepers.values() for n in k.book.ever_answerable}

    def close(self, handed_over: bool) -> None:
        """The daemon stops: remove the specs nothing else will serve (kubelet has let go of us)."""
        if handed_over or self.sharing:
            return
        for k in self.keepers.values():
            k.remove()

    def _failed(self, where: str, e: OSError) -> None:
        self.say(logging.ERROR, "cdi-spec", f"cannot write CDI specs in {where}: {e.strerror or e}; Allocate "
                 "answers carry the DeviceSpec alone until they are written (pods not running as root may "
                 "not open the node)", once=f"cdi-failed:{where}:{e.strerror or e}")

    def _retry_later(self, now: float) -> None:
        if self._retry_at is None:
            self._retry_at = now + RETRY_EVERY_S


def keeper_for(host, resource: str) -> "Keeper":
    """A resource's keeper: the daemon's (`host.cdi`), or one that answers nothing where the host has
    no specs (the simulation's host)."""
    specs = getattr(host, "cdi", None)
    return specs.keeper(resource) if specs is not None else Keeper(None, resource)


class Keeper:
    """One resource's CDI spec and answers."""

    def __init__(self, specs: Optional[Specs], resource: str) -> None:
        self.specs = specs
        self.resource = resource
        self.book = cdi_book.SpecBook(resource)
        self.failed = False
        self.wrote = False  # a spec of this daemon's is (or was) on disk
        self._shared: Optional[str] = None  # the one name of a shareable resource
        self._by_id: Dict[str, str] = {}  # a pattern's unit ID -> its name
        self._answers: Tuple[FrozenSet[str], Optional[str], Dict[str, str]] = (frozenset(), None, {})
        self._written: Optional[Tuple[str, int]] = None  # (spec dir, inode) of our last write
        self._last: Optional[Tuple[object, Device]] = None  # (snapshot, device) last published

    @property
    def enabled(self) -> bool:
        return self.specs is not None and self.specs.enabled

    @property
    def device_specs(self) -> bool:
        """Answers carry the DeviceSpec beside the CDI names (runtimes without CDI ignore the names)."""
        return self.specs is None or self.specs.device_specs

    # --- the loop's side ----------------------------------------------------------------------

    def publish(self, snapshot, device: Device) -> None:
        """A new snapshot, before any socket serves it: its healthy units' devices on disk."""
        self._last = (snapshot, device)
        specs = self.specs
        if specs is None or not specs.enabled:
            self._answers = (frozenset(), None, {})
            return
        grants: Dict[str, Tuple[cdi.SpecNode, ...]] = {}
        companions = _nodes(device.companions, specs.dev_root)
        if snapshot.by_id is None:
            self._shared = cdi.shared_name(device.resource)
            nodes = _nodes((device.path,), specs.dev_root)
            if snapshot.healthy and nodes is not None and companions is not None:
                grants[self._shared] = nodes + companions
        else:
            self._shared = None
            for u in snapshot.by_id.values():
                name = self._by_id.setdefault(u.id, cdi.unit_name(u.id))
                nodes = _nodes((u.path,), specs.dev_root)
                if u.healthy and nodes is not None and companions is not None:
                    grants[name] = nodes + companions
        settings = cdi.Settings(device.container_mode, device.container_uid, device.container_gid, device.permissions)
        doc = self.book.offer(grants, settings)
        if doc is not None:
            self._write(doc)
        self._refresh()

    def again(self) -> None:
        """Publish the last snapshot again (CDI turned on, or its directory moved, on reload)."""
        if self._last is not None:
            self.publish(*self._last)
            if self.specs is not None and self.specs.enabled and (
                    self._written is None or self._written[0] != self.specs.spec_dir):
                self.write()  # the same content, not there yet

    def write(self) -> None:
        """Write what the spec should hold now (again)."""
        self._write(self.book.document())
        self._refresh()

    def _write(self, doc: dict) -> None:
        specs = self.specs
        if specs is None:
            return
        name = cdi.file_name(self.resource)
        try:
            with cdi_files.Locked(specs.spec_dir) as d:
                if specs.sharing and self.book.adopt(d.read(name)):  # the other daemon's names stay too
                    doc = self.book.document()
                inode = d.write(name, doc)
        except OSError as e:
            self.failed = True
            specs._failed(specs.spec_dir, e)
            specs._retry_later(time.monotonic())
            return
        if self.failed:
            specs.say(logging.INFO, "cdi-spec", f"{self.resource}: CDI spec written to {specs.spec_dir}", resource=self.resource)
        self.failed, self.wrote = False, True
        before, self._written = self._written, (specs.spec_dir, inode)
        if before is not None and before[0] != specs.spec_dir:  # moved: the old file goes once the new one is there
            self._remove(before)
        self.book.written(doc)

    def _refresh(self) -> None:
        self._answers = (self.book.answerable, self._shared, dict(self._by_id))

    def remove(self) -> None:
        """Remove our spec file, if it is still the one we wrote last."""
        if self._written is not None:
            self._remove(self._written)
        self._written = None

    def _remove(self, written: Tuple[str, int]) -> None:
        spec_dir, inode = written
        try:
            with cdi_files.Locked(spec_dir, make=False) as d:
                d.remove_if(cdi.file_name(self.resource), inode)
        except OSError:
            pass

    # --- gRPC threads ----------------------------------------------------------------------------

    def names(self, ids) -> Tuple[str, ...]:
        """The qualified CDI names for a container's unit IDs (already known to be ours), or () when
        any of them is not on disk as it should be (the answer then carries the DeviceSpec alone)."""
        answerable, shared, by_id = self._answers
        if not answerable or not self.enabled:  # (turned off on reload: the specs stay, unnamed)
            return ()
        if shared is not None:
            return (cdi.qualified(self.resource, shared),) if shared in answerable else ()
        names = [by_id.get(i) for i in dict.fromkeys(ids)]
        known = [n for n in names if n is not None and n in answerable]
        if len(known) != len(names):
            return ()
        return tuple(cdi.qualified(self.resource, n) for n in known)


def _nodes(paths, dev_root: str) -> Optional[Tuple[cdi.SpecNode, ...]]:
    """Each path's node as the container will have it (its numbers, every symlink followed);
    None when one is not a character device now."""
    found = []
    for path in paths:
        try:
            st = os.stat(host_path(path, dev_root))
        except OSError:
            return None
        if not stat.S_ISCHR(st.st_mode):
            return None
        found.append(cdi.SpecNode(path, os.major(st.st_rdev), os.minor(st.st_rdev)))
    return tuple(found)
