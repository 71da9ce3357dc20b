"""A table's nodes as others read them: `atedevd check`'s rows, and what the invariants compare."""

from typing import Optional, Tuple

from atedevd.devices.judgement import Judgement, NodeState
from atedevd.devices.placement import placement
from atedevd.record import Record


class NodeRow(Record):
    """One node of a resource as `atedevd check` lists it."""

    id: Optional[str]  # the unit's ID; None for a node that is no unit (refused, held, a companion)
    path: str  # as pods see it
    host_path: str
    role: str  # "unit", "match" (matched, not a unit), "node" (a shareable device's), "companion"
    device_number: Optional[str]  # MAJOR:MINOR
    numa: Tuple[int, ...]
    pci: Tuple[str, ...]
    present: bool
    allowed: bool  # the device policy lets pods have it
    state: str  # "ok", or why it is not served


class Served(Record):
    """A node as a table serves it: what the invariants' check compares with the node there."""

    id: Optional[str]  # the unit's ID (a pattern's); None: a shareable device's node, a companion
    path: str
    host_path: str
    first: Optional[Tuple[int, int]]  # the numbers first served; None: not served yet
    role: str  # "unit", "node", "companion"


def state_text(judged: Optional[Judgement]) -> str:
    """A judgement as `check` lists it: "ok", or why the node is not served."""
    if judged is None:
        return NodeState.MISSING.value
    return "ok" if judged.state is NodeState.PRESENT else judged.text()


def row(watch, sys_root: str, role: str) -> NodeRow:
    """A node judged on its own (a shareable device's, a companion), as its NodeWatch last judged it."""
    judged = watch.judged or Judgement(NodeState.MISSING)
    numa, pci = placement(judged.node, sys_root) if judged.node is not None else ((), ())
    return NodeRow(None, watch.device.path, watch.host, role, judged.node.numbers if judged.node else None, numa, pci,
                   judged.state is not NodeState.MISSING, judged.state is not NodeState.REFUSED, state_text(judged))
