"""One resource's CDI spec as decisions, without I/O: what to write, and which names may be answered.

kubelet keeps every Allocate answer in its checkpoint and hands it to the runtime again
when the container starts anew (a crash, a kubelet restart), and a runtime with CDI fails
the container when a name does not resolve. So a name, once an answer could carry it,
stays in the spec: a unit that is unplugged, or dropped by a reload, keeps its device
(a kubelet that still holds its ID checks its health before it replays). A name may be answered only once the spec on disk has it as it should be
(its nodes, the table's mode and owner): the keeper (atedevd/cdi/keeper.py) writes
what `offer` returns and says `written`, or nothing when the write failed, and the
answer then carries the DeviceSpec alone.

The spec outlives the daemon: a stop, a restart, a crash leave it, and the next start
keeps (`inherit`) each device whose nodes are still the ones written. What a name makes is
only ever a node judged for its unit: a name whose node another unit is granted now leaves
the spec (`offer`), so that a container replaying it gets nothing rather than that node.

The invariants, checked after every event: every name the book keeps resolves in the spec
directory (`cdi_files.resolvable`) while a daemon runs, and across its stop until the next
start has written; and every name that resolves makes nodes the policy allowed for its
unit, and no other unit's node.
"""

from typing import AbstractSet, Callable, Dict, FrozenSet, List, Mapping, Optional, Set, Tuple

from atedevd.cdi import names as cdi
from atedevd.devices.snapshot import NodeGrant


class SpecBook:
    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.kind = cdi.kind(resource)
        self._nodes: Dict[str, Tuple[NodeGrant, ...]] = {}  # every device the spec keeps
        self._settings = cdi.Settings()
        self._written: Dict[str, dict] = {}  # our devices as last written
        self.answerable: FrozenSet[str] = frozenset()  # on disk as they should be: an answer may name them
        self.ever_answerable: FrozenSet[str] = frozenset()  # every name answerable at some moment of this run
        self.dropped: FrozenSet[str] = frozenset()  # names left out since: their node is another unit's now
        self._grants: Dict[str, Tuple[NodeGrant, ...]] = {}  # granted now
        self._stale = False  # the file on disk holds devices we no longer keep

    def inherit(self, on_disk: object, still_there: Callable[[NodeGrant], bool]) -> List[str]:
        """A start: the devices an earlier run wrote stay, so that kubelet's checkpointed answers
        resolve across a restart, each while every node it makes is still the one written
        (`still_there`: a character device with those numbers at its path, which the policy
        allows). The names left out, sorted."""
        if not isinstance(on_disk, dict) or on_disk.get("kind") != self.kind:
            return []
        gone = []
        entries = {d.get("name"): d for d in on_disk.get("devices") or () if isinstance(d, dict)}
        for name, nodes in _devices(on_disk).items():
            if name in self._nodes:
                continue
            if nodes and all(still_there(n) for n in nodes):
                self._nodes[name] = nodes
                self._written[name] = entries[name]  # on disk already: answerable as it is
            else:
                gone.append(name)
        self._stale |= bool(gone)  # what is on disk holds more than we keep: the first offer writes
        return sorted(gone)

    def offer(self, grants: Mapping[str, Tuple[NodeGrant, ...]], settings: cdi.Settings,
              elsewhere: AbstractSet[Tuple[int, int]] = frozenset()) -> Optional[dict]:
        """Devices granted now (healthy units and their nodes, as judged) and the table's settings:
        the document to write, or None when what is on disk is it. A name not granted now whose
        node (its first, the unit's own) another name is granted now, here or by another resource
        (`elsewhere`), leaves the spec: a name never makes another unit's node."""
        self._nodes.update(grants)
        self._grants = dict(grants)
        self._settings = settings
        return self.recheck(elsewhere)

    def recheck(self, elsewhere: AbstractSet[Tuple[int, int]]) -> Optional[dict]:
        """What another resource is granted now changed: the document to write, if it changed."""
        taken = set(elsewhere).union((nodes[0].major, nodes[0].minor) for nodes in self._grants.values() if nodes)
        stale = [name for name, nodes in self._nodes.items()
                 if name not in self._grants and nodes and (nodes[0].major, nodes[0].minor) in taken]
        for name in stale:
            del self._nodes[name]
        self.dropped |= frozenset(stale)
        desired = self._entries()
        self._update_answerable(desired)
        if desired == self._written and not self._stale:
            return None
        return cdi.document(self.resource, list(desired.values()))

    @property
    def pending(self) -> bool:
        """A document is due (an earlier write failed)."""
        return self._stale or self._entries() != self._written

    def document(self) -> dict:
        """What the spec should hold now (to write it again)."""
        return cdi.document(self.resource, list(self._entries().values()))

    def adopt(self, on_disk: object) -> bool:
        """While two daemons serve (an upgrade), each may have answered with names the
        other has not seen: the devices of the spec on disk that we lack become ours, kept as our
        own are (and left out as ours are, when another unit is granted their node). True when
        there were any."""
        if not isinstance(on_disk, dict) or on_disk.get("kind") != self.kind:
            return False
        adopted = False
        for name, nodes in _devices(on_disk).items():
            if name not in self._nodes and name not in self.dropped and nodes:
                self._nodes[name] = nodes
                adopted = True
        return adopted

    def written(self, doc: dict) -> None:
        """`doc` is on disk now."""
        on_disk = {d["name"]: d for d in doc["devices"]}
        self._written = {name: on_disk[name] for name in self._nodes if name in on_disk}
        self._stale = False
        self._update_answerable(self._entries())

    def matches(self, on_disk: object) -> bool:
        """`on_disk` is a spec of our kind holding every device we keep as it should be."""
        if not isinstance(on_disk, dict) or on_disk.get("kind") != self.kind or \
                on_disk.get("cdiVersion") not in cdi.VERSIONS:
            return False
        there = {d.get("name"): d for d in on_disk.get("devices") or () if isinstance(d, dict)}
        return all(there.get(name) == entry for name, entry in self._entries().items())

    def lost(self) -> None:
        """What we wrote is not on disk any more (removed or replaced by someone else): nothing is
        answerable until it is written again."""
        self._written = {}
        self._update_answerable(self._entries())

    def _entries(self) -> Dict[str, dict]:
        return {name: cdi.device_entry(name, nodes, self._settings) for name, nodes in sorted(self._nodes.items())}

    def _update_answerable(self, desired: Dict[str, dict]) -> None:
        self.answerable = frozenset(n for n, e in desired.items() if self._written.get(n) == e)
        self.ever_answerable |= self.answerable

    def names(self) -> List[str]:
        return sorted(self._nodes)

    def nodes(self, name: str) -> Tuple[NodeGrant, ...]:
        return self._nodes.get(name, ())

    def granted(self) -> Set[Tuple[int, int]]:
        """The numbers of every unit's own node granted now."""
        return {(nodes[0].major, nodes[0].minor) for nodes in self._grants.values() if nodes}


def _devices(doc: dict) -> Dict[str, Tuple[NodeGrant, ...]]:
    """The devices of a spec document as this module writes them, by name (a device we could not
    have written has no nodes)."""
    out: Dict[str, Tuple[NodeGrant, ...]] = {}
    for d in doc.get("devices") or ():
        name = d.get("name") if isinstance(d, dict) else None
        if isinstance(name, str):
            out[name] = _nodes_of(d)
    return out


def _nodes_of(entry: dict) -> Tuple[NodeGrant, ...]:
    """The nodes of a device entry as this module writes them; () for anything else."""
    try:
        nodes = entry["containerEdits"]["deviceNodes"]
        found = tuple(NodeGrant(n["path"], n["major"], n["minor"]) for n in nodes
                      if n.get("type") == "c" and isinstance(n["path"], str) and isinstance(n["major"], int)
                      and isinstance(n["minor"], int))
        return found if len(found) == len(nodes) else ()
    except (KeyError, TypeError, AttributeError):
        return ()
