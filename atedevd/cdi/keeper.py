"""The daemon's CDI specs: written before a snapshot reaches a socket, answered from, watched, kept.

`Specs` is the daemon's (one per process, `Host.cdi`): whether CDI grants are on, where,
whether answers carry the DeviceSpec too, and every resource's `Keeper`. A `Keeper` is
one resource's: the resource hands it each new snapshot before any socket serves it
(`publish`), and it writes the spec that resolves every name of it (atedevd/cdi/book.py
decides what) with the numbers the table judged, never looked up again; its sockets'
Allocate asks it which names to answer (`names`, on gRPC threads: it reads one immutable
value). What it cannot write it does not answer: that answer carries the DeviceSpec
alone, and the failure is an ERROR in the journal and is tried again every second.

The spec directory is looked at when it has events and every `LOOK_EVERY_S` all the same:
a spec of ours removed, replaced or rewritten is written again; another program's spec of
one of our kinds is named by an ERROR, and a name both define (which then resolves to
nothing) is not answered; a directory someone other than root may write stops every CDI
name in answers until it is root's again (and then the specs are written anew).

The spec outlives the daemon: a stop, a restart, a crash leave it, so that every name
kubelet checkpointed resolves while atedevd is away; the next start keeps what is still
right of it (`SpecBook.inherit`). It is removed when its resource leaves the configuration
(at a reload, once kubelet let go of it; at a start, when the configuration lacks it), and
by the packages when they are purged.
"""

import json
import logging
import os
import re
import stat
import time
from typing import Callable, Dict, FrozenSet, Iterable, Optional, Set, Tuple

from atedevd import trust
from atedevd.cdi import book as cdi_book
from atedevd.cdi import files as cdi_files
from atedevd.cdi import names as cdi
from atedevd.config import Device, host_path
from atedevd.devices import policy
from atedevd.devices.judgement import trust_stamp
from atedevd.devices.snapshot import NodeGrant

RETRY_EVERY_S = 1.0
LOOK_EVERY_S = 2.0  # the spec directory, events or not (resource.LOOK_EVERY_S, for the nodes)
ALL = None  # a foreign spec whose names cannot be read (YAML): every name of its kind is in doubt


class Specs:
    def __init__(self, say: Callable[..., None], sharing: bool = False) -> None:
        self.say = say  # Host.say
        self.enabled = False
        self.spec_dir = "/var/run/cdi"
        self.dev_root, self.sys_root = "/dev", policy.SYS_ROOT
        self.device_specs = True
        # Another daemon writes the same specs (an upgrade under way): keep its devices.
        self.sharing = sharing
        self.keepers: Dict[str, "Keeper"] = {}  # every resource's this run, removed ones too
        self.trusted = True  # the spec directory is root's alone (else no CDI name is answered)
        self._retry_at: Optional[float] = None
        self._look_at: Optional[float] = None  # the next look at the directory
        self._foreign: Dict[str, Optional[FrozenSet[str]]] = {}  # kind -> names another file defines (ALL)
        self._read: Dict[str, Tuple[tuple, Optional[Tuple[str, Optional[FrozenSet[str]]]]]] = {}  # entry -> (stat, kind and names)
        self._devices: Dict[str, Device] = {}
        self._trust_stamp: Optional[tuple] = None
        self._problems: list = []

    def configure(self, cfg) -> None:
        """The configuration (at start, on reload): on or off, where, and how answers are made.
        Turned on (at start too) or moved: the temporary files a killed writer left go, the
        specs of resources no longer configured go, and each resource keeps what is still
        right of the spec an earlier run wrote."""
        anew = cfg.cdi and (not self.enabled or cfg.cdi_spec_dir != self.spec_dir)
        added = [d.resource for d in cfg.devices if d.resource not in self._devices or anew]
        self._devices = {d.resource: d for d in cfg.devices}
        self.enabled, self.spec_dir, self.dev_root, self.sys_root = cfg.cdi, cfg.cdi_spec_dir, cfg.dev_root, cfg.sys_root
        self.device_specs = cfg.device_specs or not cfg.cdi
        self._refresh()  # (turned off: the specs stay, and no name is answered)
        if not cfg.cdi or not added:
            return
        if anew:
            self._foreign, self._read, self._look_at = {}, {}, None
        try:
            with cdi_files.Locked(cfg.cdi_spec_dir) as d:
                d.remove_leftovers()
                for resource in added:
                    name = cdi.file_name(resource)
                    self.keeper(resource).inherit(d.read(name), d.stat(name))
                if anew and not self.sharing:  # (an upgrade's other daemon may serve them)
                    ours = {cdi.file_name(r) for r in self._devices}
                    for name in d.specs_of_ours():
                        if name not in ours and d.remove(name):
                            self.say(logging.INFO, "cdi-spec", f"removed {os.path.join(cfg.cdi_spec_dir, name)}: its "
                                     "resource is no longer configured")
        except OSError as e:
            self._failed(cfg.cdi_spec_dir, e)
        if anew:
            for k in self.keepers.values():  # turned on, or moved, on reload: what the resources serve now, written there
                k.again()

    def keeper(self, resource: str) -> "Keeper":
        k = self.keepers.get(resource)
        if k is None:
            k = self.keepers[resource] = Keeper(self, resource)
        return k

    # --- the loop's side ------------------------------------------------------------------------

    def directories(self) -> FrozenSet[str]:
        """What to watch: the spec directory, while CDI grants are on."""
        return frozenset((os.path.normpath(self.spec_dir),)) if self.enabled else frozenset()

    def changed(self, directories: Iterable[str]) -> None:
        """A batch of directory events: one in the spec directory makes its look due now."""
        if self.enabled and os.path.normpath(self.spec_dir) in directories:
            self._look_at = None

    @property
    def deadline(self) -> Optional[float]:
        if not self.enabled:
            return self._retry_at
        look = self._look_at if self._look_at is not None else -1.0
        return look if self._retry_at is None else min(look, self._retry_at)

    def wake(self, now: float) -> None:
        """What is due: a write that failed, tried again (at most every RETRY_EVERY_S); the look
        at the spec directory."""
        if self._retry_at is not None and now >= self._retry_at:
            self._retry_at = None
            for k in self.keepers.values():
                if k.failed:
                    k.write()
        if self.enabled and (self._look_at is None or now >= self._look_at):
            self._look_at = now + LOOK_EVERY_S
            self.look()

    def look(self) -> None:
        """The spec directory as it is: still root's alone, our specs still the files we wrote,
        and another program's specs of our kinds named."""
        stamp = trust_stamp((self.spec_dir,))
        if stamp != self._trust_stamp:  # (walked again only when a directory on the way changed)
            self._trust_stamp = stamp
            self._problems = trust.problems(self.spec_dir) if os.path.lexists(self.spec_dir) else []
        problems = self._problems
        if problems:
            if self.trusted:
                self.trusted = False
                self.say(logging.ERROR, "cdi-spec-dir", f"{self.spec_dir} is not trusted: {problems[0]}; Allocate "
                         "answers carry the DeviceSpec alone until it is root's alone again (pods not running as root "
                         "may not open the node)", once=f"cdi-untrusted:{self.spec_dir}:{problems[0]}")
                self._refresh()
            return
        if not self.trusted:
            self.trusted = True
            self.say(logging.INFO, "cdi-spec-dir", f"{self.spec_dir} is root's alone again: CDI specs written anew, "
                     "and answered from")
            for k in self.keepers.values():
                k.write()  # (whatever is there was in others' reach meanwhile)
        for k in self.keepers.values():
            k.check()
        self._look_for_foreign()

    def _look_for_foreign(self) -> None:
        kinds = {k.book.kind for k in self.keepers.values() if k.resource in self._devices}
        ours = {cdi.file_name(r) for r in self.keepers}
        try:
            entries = sorted(os.listdir(self.spec_dir))
        except OSError:
            entries = []
        read: Dict[str, Tuple[tuple, Optional[Tuple[str, Optional[FrozenSet[str]]]]]] = {}
        for entry in entries:
            if entry in ours or not entry.endswith((".json", ".yaml")):
                continue
            path = os.path.join(self.spec_dir, entry)
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            before = self._read.get(entry)
            read[entry] = before if before is not None and before[0] == key else (key, kind_and_names(path, kinds))
            found = read[entry][1]
            if found is not None and found[0] in kinds and (before is None or before[0] != key):
                self.say(logging.ERROR, "cdi-spec-conflict", f"{path} defines CDI kind {found[0]}, which is atedevd's "
                         "(another program wrote it): a name two specs of one directory define resolves to nothing, "
                         f"so Allocate answers name none of {'its names' if found[1] is ALL else ', '.join(sorted(found[1]))}; "
                         "remove that file, or give that program another kind", once=f"cdi-conflict:{path}:{key}")
        self._read = read
        foreign: Dict[str, Optional[FrozenSet[str]]] = {}
        for _, found in read.values():
            if found is None or found[0] not in kinds:
                continue
            kind, names = found
            if names is ALL or foreign.get(kind, frozenset()) is ALL:
                foreign[kind] = ALL
            else:
                foreign[kind] = foreign.get(kind, frozenset()) | names  # type: ignore[operator]
        if foreign != self._foreign:
            self._foreign = foreign
            self._refresh()

    def granted(self, but: "Keeper") -> Set[Tuple[int, int]]:
        """The numbers of the nodes every other resource's units are granted now, where each is
        handed to one container at a time (a pattern's)."""
        return set().union(*(k.book.granted() for k in self.keepers.values() if k is not but and k.exclusive))

    def regranted(self, keeper: "Keeper") -> None:
        """`keeper`'s grants changed: every other resource's spec is held to them."""
        for k in self.keepers.values():
            if k is not keeper and self.enabled:
                k.recheck(self.granted(but=k))

    def conflicted(self, kind: str) -> Optional[FrozenSet[str]]:
        """The names of `kind` another spec in the directory defines too (ALL: any of them)."""
        return self._foreign.get(kind, frozenset())

    def _refresh(self) -> None:
        for k in self.keepers.values():
            k.refresh()

    def owed(self) -> Set[str]:
        """Every qualified name this daemon keeps in its specs: each must resolve in the spec
        directory while it runs and after it stops (until the next start has written its own).
        The simulation checks it after every event."""
        return {cdi.qualified(k.resource, n) for k in self.keepers.values()
                for n in k.book.ever_answerable.intersection(k.book.names())}

    def retire(self, resource: str) -> None:
        """`resource` left the configuration and kubelet has let go of it: its spec goes."""
        if resource in self._devices:
            return  # configured again meanwhile: it stays
        k = self.keepers.pop(resource, None)
        if k is not None and not self.sharing:
            k.remove()

    def still_there(self, device: Optional[Device]) -> Callable[[NodeGrant], bool]:
        """Whether a node an earlier run's spec makes is still the one written: a character device
        with those numbers at its path, which the device policy lets pods have."""
        allowed = device is not None and device.allow_host_access

        def check(node: NodeGrant) -> bool:
            try:
                st = os.stat(host_path(node.path, self.dev_root))
            except OSError:
                return False
            if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(node.major, node.minor):
                return False
            found = policy.judge(policy.by_numbers(node.path, node.major, node.minor, self.sys_root))
            return not policy.refused(found, allowed)
        return check

    def _failed(self, where: str, e: OSError) -> None:
        self.say(logging.ERROR, "cdi-spec", f"cannot write CDI specs in {where}: {e.strerror or e}; Allocate "
                 "answers carry the DeviceSpec alone until they are written (pods not running as root may "
                 "not open the node)", once=f"cdi-failed:{where}:{e.strerror or e}")

    def _retry_later(self, now: float) -> None:
        if self._retry_at is None:
            self._retry_at = now + RETRY_EVERY_S


def kind_and_names(path: str, kinds: Set[str]) -> Optional[Tuple[str, Optional[FrozenSet[str]]]]:
    """(kind, device names) of a spec file; names ALL for YAML of one of `kinds` (no parser here:
    its kind is read off its `kind:` line); None when it is not a spec we can tell."""
    text = cdi_files.read_spec(path)
    if text is None:
        return None
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
            return None
        return doc["kind"], frozenset(cdi.device_names(doc))
    for kind in kinds:
        if re.search(r"^\s*kind\s*:\s*[\"']?" + re.escape(kind) + r"[\"']?\s*$", text, re.M):
            return kind, ALL
    return None


def keeper_for(host, resource: str) -> "Keeper":
    """A resource's keeper: the daemon's (`host.cdi`), or one that answers nothing where the host has
    no specs."""
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
        self._answers: Tuple[FrozenSet[str], bool] = (frozenset(), False)  # (names to answer, shareable)
        self._written: Optional[Tuple[str, int, int, int]] = None  # (spec dir, inode, size, mtime) of our last write
        self._last: Optional[object] = None  # the snapshot last published
        self._device: Optional[Device] = None

    @property
    def enabled(self) -> bool:
        return self.specs is not None and self.specs.enabled

    @property
    def exclusive(self) -> bool:
        """Its units are handed to one container at a time (a pattern's)."""
        return self._device is not None and self._device.pattern

    @property
    def device_specs(self) -> bool:
        """Answers carry the DeviceSpec beside the CDI names (runtimes without CDI ignore the names)."""
        return self.specs is None or self.specs.device_specs

    # --- the loop's side ----------------------------------------------------------------------

    def inherit(self, on_disk: object, st: Optional[os.stat_result] = None) -> None:
        """A start (or CDI turned on): what an earlier run of ours wrote, where it is still right;
        the file is ours from now on (watched as if we had written it)."""
        if self.specs is None:
            return
        gone = self.book.inherit(on_disk, self.specs.still_there(self.specs._devices.get(self.resource)))
        if st is not None and self.book.names():
            self._written = (self.specs.spec_dir, st.st_ino, st.st_size, st.st_mtime_ns)
        if gone:
            self.specs.say(logging.INFO, "cdi-spec", f"{self.resource}: CDI names of an earlier run left out, their "
                           f"nodes are no longer the ones written: {', '.join(gone[:8])}", resource=self.resource)

    def publish(self, snapshot, device: Device) -> None:
        """A new snapshot, before any socket serves it: its healthy units' devices on disk, with
        the numbers its table judged."""
        self._last, self._device = snapshot, device
        specs = self.specs
        if specs is None or not specs.enabled:
            self._answers = (frozenset(), False)
            return
        shared = cdi.shared_name(device.resource)
        grants = {shared if key is None else cdi.unit_name(key): nodes for key, nodes in snapshot.grants().items()}
        settings = cdi.Settings(device.container_mode, device.container_uid, device.container_gid, device.permissions)
        before = self.book.granted()
        doc = self.book.offer(grants, settings, specs.granted(but=self))
        if doc is not None:
            self._write(doc)
        self.refresh()
        if self.book.granted() != before:  # the other resources' names never make what this one grants now
            specs.regranted(self)

    def recheck(self, elsewhere) -> None:
        """Another resource's grants changed: a name of ours that makes its node now goes."""
        doc = self.book.recheck(elsewhere)
        if doc is not None:
            self._write(doc)
            self.refresh()

    def again(self) -> None:
        """Publish the last snapshot again (CDI turned on, or its directory moved, on reload)."""
        if self._last is not None and self._device is not None:
            self.publish(self._last, self._device)
            if self.specs is not None and self.specs.enabled and (
                    self._written is None or self._written[0] != self.specs.spec_dir):
                self.write()  # the same content, not there yet

    def write(self) -> None:
        """Write what the spec should hold now (again)."""
        if self.wrote or self.book.names():
            self._write(self.book.document())
        self.refresh()

    def check(self) -> None:
        """Our spec is still the file we wrote last (a look at the directory): else written again."""
        if self.specs is None or self._written is None or self.failed:
            return
        spec_dir, inode, size, mtime = self._written
        path = os.path.join(spec_dir, cdi.file_name(self.resource))
        try:
            st = os.lstat(path)
            same = stat.S_ISREG(st.st_mode) and (st.st_ino, st.st_size, st.st_mtime_ns) == (inode, size, mtime)
        except FileNotFoundError:
            same, st = False, None
        except OSError:
            return
        if same:
            return
        try:
            with cdi_files.Locked(spec_dir, make=False) as d:
                doc, now = d.read(cdi.file_name(self.resource)), d.stat(cdi.file_name(self.resource))
        except OSError:
            doc = now = None
        if self.specs.sharing and doc is not None:
            self.book.adopt(doc)  # an upgrade's other daemon wrote it: its names are kept too
        if isinstance(doc, dict) and now is not None and self.book.matches(doc):  # (everything of ours is there as it should be)
            self._written = (spec_dir, now.st_ino, now.st_size, now.st_mtime_ns)
            self.book.written(doc)
            self.refresh()
            return
        if not self.specs.sharing:
            what = "removed" if st is None else "replaced or rewritten"
            self.specs.say(logging.WARNING, "cdi-spec", f"{self.resource}: {path} was {what} by someone else; "
                           "writing it again", resource=self.resource)
        self.book.lost()
        self.refresh()
        self.write()

    def _write(self, doc: dict) -> None:
        specs = self.specs
        if specs is None:
            return
        name = cdi.file_name(self.resource)
        try:
            with cdi_files.Locked(specs.spec_dir) as d:
                if specs.sharing and self.book.adopt(d.read(name)):  # the other daemon's names stay too
                    doc = self.book.document()
                st = d.write(name, doc)
        except OSError as e:
            self.failed = True
            specs._failed(specs.spec_dir, e)
            specs._retry_later(time.monotonic())
            return
        if self.failed:
            specs.say(logging.INFO, "cdi-spec", f"{self.resource}: CDI spec written to {specs.spec_dir}", resource=self.resource)
        self.failed, self.wrote = False, True
        before, self._written = self._written, (specs.spec_dir, st.st_ino, st.st_size, st.st_mtime_ns)
        if before is not None and before[0] != specs.spec_dir:  # moved: the old file goes once the new one is there
            self._remove(before)
        self.book.written(doc)

    def refresh(self) -> None:
        """What gRPC threads answer from: what is on disk as it should be, in a directory root
        alone can write, and defined by no other spec there."""
        specs = self.specs
        if specs is None or not specs.enabled or not specs.trusted:
            self._answers = (frozenset(), False)
            return
        names = self.book.answerable
        doubt = specs.conflicted(self.book.kind)
        names = frozenset() if doubt is None else names - doubt  # (None: ALL, every name in doubt)
        self._answers = (names, self._device is not None and not self.exclusive)

    def remove(self) -> None:
        """Remove our spec file, if it is still the one we wrote last."""
        if self._written is not None:
            self._remove(self._written)
        self._written = None

    def _remove(self, written: Tuple[str, int, int, int]) -> None:
        spec_dir, inode = written[0], written[1]
        try:
            with cdi_files.Locked(spec_dir, make=False) as d:
                d.remove_if(cdi.file_name(self.resource), inode)
        except OSError:
            pass

    # --- gRPC threads ----------------------------------------------------------------------------

    def names(self, ids) -> Tuple[str, ...]:
        """The qualified CDI names for a container's unit IDs (already known to be ours), or () when
        any of them is not answerable (the answer then carries the DeviceSpec alone)."""
        answerable, shared = self._answers
        if not answerable:
            return ()
        if shared:
            name = cdi.shared_name(self.resource)
            return (cdi.qualified(self.resource, name),) if name in answerable else ()
        names = [cdi.unit_name(i) for i in dict.fromkeys(ids)]
        if not all(n in answerable for n in names):
            return ()
        return tuple(cdi.qualified(self.resource, n) for n in names)
