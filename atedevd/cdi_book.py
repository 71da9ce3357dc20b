"""One resource's CDI spec as decisions, without I/O: what to write, and which names may be answered.

kubelet keeps every Allocate answer in its checkpoint and hands it to the runtime again
when the container starts anew (a crash, a kubelet restart), and a runtime with CDI fails
the container when a name does not resolve. So a name, once an answer could carry it,
stays in the spec while the daemon runs: a unit that is unplugged, or dropped by a
reload, keeps its device (a kubelet that still holds its ID checks its health before
it replays). A name may be answered only once the spec on disk has it as it should be
(its nodes, the table's mode and owner): the keeper (atedevd/cdi_keeper.py) writes
what `offer` returns and says `written`, or nothing when the write failed, and the
answer then carries the DeviceSpec alone.

The invariant, checked after every event: every name in `ever_answerable` of a live
daemon (`cdi_keeper.Specs.owed()`), and of the last one killed until the next start has
written its own, resolves in the spec directory (`cdi_files.resolvable`).
"""

from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

from atedevd import cdi


class SpecBook:
    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.kind = cdi.kind(resource)
        self._nodes: Dict[str, Tuple[cdi.SpecNode, ...]] = {}  # every device granted this run
        self._settings = cdi.Settings()
        self._written: Dict[str, dict] = {}  # our devices as last written
        self.answerable: FrozenSet[str] = frozenset()  # on disk as they should be: an answer may name them
        self.ever_answerable: FrozenSet[str] = frozenset()  # every name answerable at some moment of this run

    def offer(self, grants: Mapping[str, Tuple[cdi.SpecNode, ...]], settings: cdi.Settings) -> Optional[dict]:
        """Devices seen now (healthy units and their nodes) and the table's settings: the document
        to write, or None when what is on disk is it."""
        self._nodes.update(grants)
        self._settings = settings
        desired = self._entries()
        self._update_answerable(desired)
        if desired == self._written:
            return None
        return cdi.document(self.resource, list(desired.values()))

    @property
    def pending(self) -> bool:
        """A document is due (an earlier write failed)."""
        return self._entries() != self._written

    def document(self) -> dict:
        """What the spec should hold now (to write it again)."""
        return cdi.document(self.resource, list(self._entries().values()))

    def adopt(self, on_disk: object) -> bool:
        """While two daemons serve (an upgrade's handover), each may have answered with names the
        other has not seen: the devices of the spec on disk that we lack become ours, kept as our
        own are. True when there were any."""
        if not isinstance(on_disk, dict) or on_disk.get("kind") != self.kind:
            return False
        adopted = False
        for d in on_disk.get("devices") or ():
            name = d.get("name") if isinstance(d, dict) else None
            if isinstance(name, str) and name not in self._nodes:
                nodes = _nodes_of(d)
                if nodes:
                    self._nodes[name] = nodes
                    adopted = True
        return adopted

    def written(self, doc: dict) -> None:
        """`doc` is on disk now."""
        on_disk = {d["name"]: d for d in doc["devices"]}
        self._written = {name: on_disk[name] for name in self._nodes if name in on_disk}
        self._update_answerable(self._entries())

    def _entries(self) -> Dict[str, dict]:
        return {name: cdi.device_entry(name, nodes, self._settings) for name, nodes in sorted(self._nodes.items())}

    def _update_answerable(self, desired: Dict[str, dict]) -> None:
        self.answerable = frozenset(n for n, e in desired.items() if self._written.get(n) == e)
        self.ever_answerable |= self.answerable

    def names(self) -> List[str]:
        return sorted(self._nodes)


def _nodes_of(entry: dict) -> Tuple[cdi.SpecNode, ...]:
    """The nodes of a device entry as this module writes them; () for anything else."""
    try:
        nodes = entry["containerEdits"]["deviceNodes"]
        return tuple(cdi.SpecNode(n["path"], n["major"], n["minor"]) for n in nodes
                     if n.get("type") == "c" and isinstance(n["path"], str) and isinstance(n["major"], int)
                     and isinstance(n["minor"], int))
    except (KeyError, TypeError, AttributeError):
        return ()
