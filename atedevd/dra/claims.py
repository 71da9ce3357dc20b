"""Which claims this node has prepared, and what each was answered: decisions, no I/O.

Kubelet may ask again for a claim already prepared (a retry, its own restart), may ask to
unprepare a claim in another instance than the one that prepared it (an upgrade), and must get
the same answer every time: so a prepared claim's answer is kept, by UID, in a checkpoint
(atedevd/dra/checkpoint.py) written before the answer goes out, and a claim kubelet already holds
is answered from it without the API server (the file also keeps the node pool's generation, which
a new run carries on from even where kubelet has deleted the slices). A claim is prepared from its allocation as the API
server has it: the UID must be the one kubelet names (a claim deleted and made anew under the
same name is another claim), and every result of our driver must name a device of our pool
that is listed now.
"""

from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from atedevd.dra.slices import DRIVER, DraDevice
from atedevd.record import Record

CHECKPOINT_VERSION = 1


class Prepared(Record):
    """One device of a prepared claim, as kubelet was answered (`NodePrepareResourceResponse`)."""

    request_names: Tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_ids: Tuple[str, ...]
    share_id: str = ""


class ClaimRef(Record):
    namespace: str
    name: str
    uid: str


def allocated(claim: Mapping, ref: ClaimRef, pool: str, devices: Mapping[str, DraDevice]) -> Tuple[Optional[List[Prepared]], str]:
    """What a claim fetched from the API server is to be answered with: (devices, "") or
    (None, why not). `claim` is the ResourceClaim as a dict."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        return None, (f"claim {ref.namespace}/{ref.name}: its UID is {meta.get('uid')!r} on the API server, "
                      f"kubelet asked for {ref.uid!r} (deleted and made again?)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        return None, f"claim {ref.namespace}/{ref.name} is not allocated"
    results = [r for r in ((allocation.get("devices") or {}).get("results") or ()) if r.get("driver") == DRIVER]
    if not results:
        return None, f"claim {ref.namespace}/{ref.name}: no device of driver {DRIVER} is allocated to it"
    merged: Dict[Tuple[str, str], Prepared] = {}
    for r in results:
        name, rpool = r.get("device", ""), r.get("pool", "")
        if rpool != pool:
            return None, f"claim {ref.namespace}/{ref.name}: device {name!r} is of pool {rpool!r}, this node's is {pool!r}"
        d = devices.get(name)
        if d is None:
            return None, (f"claim {ref.namespace}/{ref.name}: device {name!r} is not one this node serves now "
                          "(unplugged, unhealthy or no longer configured)")
        share = r.get("shareID") or ""
        key = (name, share)
        request = r.get("request", "")
        if key in merged:
            p = merged[key]
            merged[key] = p._replace(request_names=p.request_names + ((request,) if request else ()))
        else:
            merged[key] = Prepared((request,) if request else (), pool, name, d.cdi_ids, share)
    return list(merged.values()), ""


class Book:
    """The prepared claims by UID. `prepare` and `unprepare` return what the checkpoint is to
    hold (None: unchanged); the caller writes it before answering."""

    def __init__(self) -> None:
        self.claims: Dict[str, Tuple[ClaimRef, Tuple[Prepared, ...]]] = {}
        self.generation = 0  # the node pool's, as last written: a new run never publishes a lower one

    def answer(self, uid: str) -> Optional[Tuple[Prepared, ...]]:
        """A claim already prepared: what it was answered, again."""
        held = self.claims.get(uid)
        return None if held is None else held[1]

    def prepare(self, ref: ClaimRef, devices: Sequence[Prepared]) -> dict:
        self.claims[ref.uid] = (ref, tuple(devices))
        return self.document()

    def carry(self, generation: int) -> dict:
        """The pool's generation about to be written: kept with the claims; what the checkpoint is to hold."""
        self.generation = generation
        return self.document()

    def restore(self, uid: str, held: Tuple[ClaimRef, Tuple[Prepared, ...]]) -> None:
        """A claim taken out whose checkpoint could not be written: held again, as it was."""
        self.claims[uid] = held

    def unprepare(self, uid: str) -> Optional[dict]:
        if self.claims.pop(uid, None) is None:
            return None  # never prepared here, or unprepared already: nothing to undo, and success
        return self.document()

    def held(self) -> Set[str]:
        """The names of the devices prepared claims hold."""
        return {p.device_name for _, devs in self.claims.values() for p in devs}

    def sharing(self, device_name: str) -> List[str]:
        """The UIDs of the claims that hold a device now."""
        return sorted(uid for uid, (_, devs) in self.claims.items() if any(p.device_name == device_name for p in devs))

    def document(self) -> dict:
        return {"version": CHECKPOINT_VERSION, "driver": DRIVER, "generation": self.generation, "claims": {
            uid: {"namespace": ref.namespace, "name": ref.name,
                  "devices": [{"requestNames": list(p.request_names), "pool": p.pool_name, "device": p.device_name,
                               "cdiDeviceIDs": list(p.cdi_ids), "shareID": p.share_id} for p in devs]}
            for uid, (ref, devs) in sorted(self.claims.items())}}

    def load(self, doc: object) -> str:
        """The claims a checkpoint holds (a start after a stop, a crash or an upgrade). "" or
        why the document was not read (then nothing is taken from it)."""
        if not isinstance(doc, dict) or doc.get("version") != CHECKPOINT_VERSION or doc.get("driver") != DRIVER:
            return f"not a version-{CHECKPOINT_VERSION} checkpoint of driver {DRIVER}"
        claims: Dict[str, Tuple[ClaimRef, Tuple[Prepared, ...]]] = {}
        try:
            for uid, c in (doc.get("claims") or {}).items():
                ref = ClaimRef(str(c["namespace"]), str(c["name"]), str(uid))
                devs = tuple(Prepared(tuple(str(n) for n in d.get("requestNames") or ()), str(d["pool"]), str(d["device"]),
                                      tuple(str(i) for i in d.get("cdiDeviceIDs") or ()), str(d.get("shareID") or ""))
                             for d in c["devices"])
                claims[str(uid)] = (ref, devs)
        except (KeyError, TypeError, AttributeError) as e:
            return f"a claim in it is malformed ({type(e).__name__}: {e})"
        generation = doc.get("generation", 0)  # (an earlier atedevd's has none)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            return f"its generation {generation!r} is not a count"
        self.claims, self.generation = claims, generation
        return ""
