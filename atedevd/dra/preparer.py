"""Kubelet's prepare and unprepare calls, as decisions: which claim to read, when the
checkpoint is written, and what each call is answered. No I/O.

Calls may overlap (kubelet prepares the claims of many pods at once); a call waits only for an
earlier one that names a claim it names too, so that a claim's prepare and unprepare happen in
kubelet's order. A claim already prepared is answered from the book (atedevd/dra/claims.py), at
once and without the API server; a new one is read (`ReadClaim`) and checked against its
allocation and against the claims holding its devices (a pattern unit is one claim's at a time).
The book as it is after a call goes to the checkpoint (`WriteCheckpoint`) before the call is
answered (`Answer`): a claim kubelet was told is prepared is on disk. A read that fails for want
of the API server is tried again every READ_AGAIN_S until the call's PREPARE_WAIT_S are over:
kubelet gives a prepare 45 s, but tries a pod whose prepare failed again only after its pod
sync's back-off, a minute or more (measured on 1.37). Until `open` (a successor, while its
predecessor still answers), calls wait.
"""

import logging
from typing import Dict, List, Mapping, Optional, Set, Tuple, Union

from atedevd.dra.claims import Book, ClaimRef, Prepared, allocated
from atedevd.dra.slices import DraDevice
from atedevd.glue.resource_events import TimerDue
from atedevd.record import Record
from atedevd.registration.messages import Say

PREPARE_WAIT_S = 30.0
READ_AGAIN_S = 0.2
INFO, WARNING = logging.INFO, logging.WARNING
PREPARE, UNPREPARE = "prepare", "unprepare"


class ClaimOutcome(Record):
    """One claim's answer: its devices, or why it was not prepared (or not unprepared)."""

    devices: Tuple[Prepared, ...] = ()
    error: str = ""


# --- what it is told ---------------------------------------------------------------------------

class Asked(Record):
    """Kubelet called: NodePrepareResources or NodeUnprepareResources, with these claims."""

    call: int
    kind: str  # PREPARE or UNPREPARE
    claims: Tuple[ClaimRef, ...]


class ClaimRead(Record):
    """A claim as the API server has it (a ResourceClaim, as a dict)."""

    call: int
    uid: str
    claim: Mapping


class ClaimNotRead(Record):
    """The API server did not give the claim: why, and the HTTP status of a refusal (None: no answer)."""

    call: int
    uid: str
    why: str
    status: Optional[int]


class CheckpointWritten(Record):
    """The checkpoint `WriteCheckpoint` asked for is on disk ("": it is; else why not)."""

    call: int
    error: str = ""


class Devices(Record):
    """The devices listed now, by name (a claim's allocation must name one of them)."""

    devices: Mapping[str, DraDevice]


class Reachable(Record):
    """The API server answers, and the node's pool is this."""

    pool: str


class Open(Record):
    """The calls may be answered now (the checkpoint's claims are in the book)."""


PreparerEvent = Union[Asked, ClaimRead, ClaimNotRead, CheckpointWritten, Devices, Reachable, Open, TimerDue]


# --- what it asks for ---------------------------------------------------------------------------

class ReadClaim(Record):
    """Get the ResourceClaim: `ClaimRead` or `ClaimNotRead`."""

    call: int
    ref: ClaimRef


class WriteCheckpoint(Record):
    """Replace the checkpoint with this document: `CheckpointWritten`."""

    call: int
    document: dict


class Answer(Record):
    """The call's answer, by claim UID."""

    call: int
    outcomes: Dict[str, ClaimOutcome]


PreparerAction = Union[ReadClaim, WriteCheckpoint, Answer, Say]


class _PendingCall:
    __slots__ = ("n", "kind", "refs", "deadline", "outcomes", "reading", "again_at", "made", "undo", "writing", "started")

    def __init__(self, n: int, kind: str, refs: Tuple[ClaimRef, ...], deadline: float) -> None:
        self.n, self.kind, self.refs, self.deadline = n, kind, refs, deadline
        self.outcomes: Dict[str, ClaimOutcome] = {}
        self.reading: Set[str] = set()  # UIDs whose read is out
        self.again_at: Dict[str, float] = {}  # UIDs to read again, and when
        self.made: List[str] = []  # UIDs this call put into the book (a failed write takes them out)
        self.undo: Dict[str, tuple] = {}  # UIDs this call took out of the book, and what they held
        self.writing = False
        self.started = False

    @property
    def uids(self) -> Set[str]:
        return {r.uid for r in self.refs}


class Preparer:
    """Kubelet's calls of one DRA run. `handle(now, event)` is its one entry."""

    def __init__(self, book: Book, opened: bool) -> None:
        self.book = book
        self.opened = opened
        self.pool: Optional[str] = None  # the node's pool, once the API server answered
        self.devices: Mapping[str, DraDevice] = {}
        self.calls: Dict[int, _PendingCall] = {}  # unanswered, in the order they came
        self._out: List[PreparerAction] = []

    @property
    def idle(self) -> bool:
        return not self.calls

    def deadline(self) -> Optional[float]:
        times = [t for c in self.calls.values() if c.started for t in c.again_at.values()]
        times += [c.deadline for c in self.calls.values() if c.started and self.pool is None and c.kind == PREPARE]
        return min(times) if times else None

    def handle(self, now: float, event: PreparerEvent) -> List[PreparerAction]:
        if isinstance(event, Asked):
            self.calls[event.call] = _PendingCall(event.call, event.kind, event.claims, now + PREPARE_WAIT_S)
        elif isinstance(event, Devices):
            self.devices = event.devices
        elif isinstance(event, Reachable):
            self.pool = event.pool
        elif isinstance(event, Open):
            self.opened = True
        elif isinstance(event, ClaimRead):
            c = self.calls.get(event.call)
            if c is not None and event.uid in c.reading:
                c.reading.discard(event.uid)
                self._decide(c, next(r for r in c.refs if r.uid == event.uid), event.claim)
        elif isinstance(event, ClaimNotRead):
            c = self.calls.get(event.call)
            if c is not None and event.uid in c.reading:
                c.reading.discard(event.uid)
                s = event.status
                refused = s is not None and 400 <= s < 500 and s not in (401, 429)  # (not there, not ours: no wait helps)
                if refused or now + READ_AGAIN_S >= c.deadline:
                    c.outcomes[event.uid] = ClaimOutcome(error=event.why)
                else:
                    c.again_at[event.uid] = now + READ_AGAIN_S
        elif isinstance(event, CheckpointWritten):
            c = self.calls.get(event.call)
            if c is not None and c.writing:
                self._written(c, event.error)
        self._work(now)
        out, self._out = self._out, []
        return out

    def _work(self, now: float) -> None:
        if not self.opened:
            return
        busy: Set[str] = set()
        for c in list(self.calls.values()):
            if not c.started:
                if c.uids & busy:
                    busy |= c.uids
                    continue
                c.started = True
                self._begin(c)
            if c.kind == PREPARE and not c.writing:
                self._read(c, now)
                if not c.reading and not c.again_at and len(c.outcomes) == len(c.uids):
                    self._finish(c)
            if c.n in self.calls:
                busy |= c.uids

    def _begin(self, c: _PendingCall) -> None:
        if c.kind == UNPREPARE:
            for r in c.refs:
                held = self.book.claims.get(r.uid)
                if held is not None and self.book.unprepare(r.uid) is not None:
                    c.undo[r.uid] = held
                c.outcomes[r.uid] = ClaimOutcome()
            self._finish(c)
            return
        for r in c.refs:
            answered = self.book.answer(r.uid)
            if answered is not None:
                c.outcomes[r.uid] = ClaimOutcome(answered)

    def _read(self, c: _PendingCall, now: float) -> None:
        """Read what is still to be read, once the API server is there (or say it is not, in time)."""
        for r in c.refs:
            if r.uid in c.outcomes or r.uid in c.reading:
                continue
            if self.pool is None:
                if now >= c.deadline:
                    c.outcomes[r.uid] = ClaimOutcome(error=f"claim {r.namespace}/{r.name}: the API server has not been "
                                                      f"reached in {PREPARE_WAIT_S:.0f} s")
                continue
            at = c.again_at.get(r.uid)
            if at is not None and now < at:
                continue
            c.again_at.pop(r.uid, None)
            c.reading.add(r.uid)
            self._out.append(ReadClaim(c.n, r))

    def _decide(self, c: _PendingCall, ref: ClaimRef, claim: Mapping) -> None:
        assert self.pool is not None
        devices, why = allocated(claim, ref, self.pool, self.devices)
        for p in devices or ():
            holders = [u for u in self.book.sharing(p.device_name) if u != ref.uid]
            if holders and not self.devices[p.device_name].shared:  # the scheduler never allocates it twice, nor do we
                devices, why = None, (f"claim {ref.namespace}/{ref.name}: device {p.device_name} is prepared for "
                                      f"claim {holders[0]} already, and is one claim's at a time")
                break
        if devices is None:
            self._out.append(Say(WARNING, "dra-prepare", f"not prepared: {why}"))
            c.outcomes[ref.uid] = ClaimOutcome(error=why)
            return
        self.book.prepare(ref, devices)
        c.made.append(ref.uid)
        c.outcomes[ref.uid] = ClaimOutcome(tuple(devices))

    def _finish(self, c: _PendingCall) -> None:
        if c.made or c.undo:
            c.writing = True
            self._out.append(WriteCheckpoint(c.n, self.book.document()))
            return
        self._answer(c)

    def _written(self, c: _PendingCall, error: str) -> None:
        c.writing = False
        if error:
            for uid in c.made:
                self.book.unprepare(uid)
                c.outcomes[uid] = ClaimOutcome(error=f"the checkpoint could not be written: {error}")
            for uid, held in c.undo.items():
                self.book.restore(uid, held)
                c.outcomes[uid] = ClaimOutcome(error=f"the checkpoint could not be written: {error}")
        else:
            for uid in c.made:
                ref, devices = self.book.claims[uid]
                self._out.append(Say(INFO, "dra-prepared", f"prepared claim {ref.namespace}/{ref.name} ({uid}): " +
                                     ", ".join(f"{p.device_name} ({', '.join(p.cdi_ids)})" for p in devices)))
            for uid, (ref, _) in c.undo.items():
                self._out.append(Say(INFO, "dra-unprepared", f"unprepared claim {ref.namespace}/{ref.name} ({uid})"))
        self._answer(c)

    def _answer(self, c: _PendingCall) -> None:
        del self.calls[c.n]
        self._out.append(Answer(c.n, {r.uid: c.outcomes.get(r.uid, ClaimOutcome()) for r in c.refs}))
