"""kubelet on the simulated clock: rig/kubelet_model.py's device manager, each step an event.

The bookkeeping is the model's, the same the process-level stand-in runs (both kubelet
generations). What is the simulation's own: every step that takes time in kubelet (the model's
STEPS) is a scheduled event with a random delay of its own, so a seed fixes one interleaving;
the connections are the world's plugin servers (tests/simulation/host.py); the checkpoint
outlives a kill here; and the end-state check adds what only the world knows: Registers left
orphaned by a killed daemon, the daemon's own socket, a node agent's share of pod-resources.
"""

import itertools
from typing import Dict, List, Mapping, Optional

from rig.kubelet_model import HEALTHY, MODES, Client, Device, DeviceManager

# pkg/kubelet/apis/podresources/constants.go: every client of pod-resources together.
POD_RESOURCES_RATE, POD_RESOURCES_BURST = 100.0, 10
DIAL_TIMEOUT_S = 10.0
DIAL_RETRY_S = 1.0
_LISTS: Dict[int, Mapping[str, Device]] = {}  # healthy units -> the ListAndWatch message, made once


def _listing(healthy: int) -> Mapping[str, Device]:
    if healthy not in _LISTS:
        _LISTS[healthy] = {str(i): (HEALTHY, None) for i in range(healthy)}
    return _LISTS[healthy]


class KubeletModel:
    """kubelet's side of the wire, as events on the world's clock."""

    def __init__(self, world, mode: str, pod_resources: bool = True, agent_rps: float = 80.0):
        if mode not in MODES:
            raise ValueError(mode)
        self.w = world
        self.mode = mode
        self.pod_resources = pod_resources
        # A node agent polling pod-resources at this rate beside us, in its steady state: what
        # kubelet's limit refills for everyone else is what it leaves.
        self.agent_rps = agent_rps
        self.exhausted = 0  # our questions kubelet's limit refused
        self.orphans_won = 0  # end states an orphaned Register took over (see problems)
        self.inc: Optional[DeviceManager] = None
        self.incarnations = 0
        self.checkpoint: List[str] = []  # the resources in kubelet's checkpoint file
        self._numbers = itertools.count(1)

    # --- the process ---------------------------------------------------------------

    def start(self) -> None:
        """A new kubelet process: checkpoint, wipe the sockets, kubelet.sock (bind, then listen)."""
        self.incarnations += 1
        inc = self.inc = DeviceManager(self.mode, self.incarnations, self.w.now, self._numbers, self.checkpoint,
                                       checkpoint=self._checkpointed,
                                       rate_limit=(POD_RESOURCES_RATE - self.agent_rps, POD_RESOURCES_BURST))
        self.w.note("kubelet", f"#{inc.n} starts")
        self.w.fs.make_dir()  # (kubelet makes its directory, if it is gone)
        self.w.fs.wipe()
        self.w.fs.create_kubelet_sock(inc)
        self.w.after(self.w.delay(), self._listen, inc)

    def _checkpointed(self, registered) -> None:
        self.checkpoint = list(registered)

    def _listen(self, inc: DeviceManager) -> None:
        if inc.alive:
            inc.listening = True
            self.w.note("kubelet", f"#{inc.n} listens")

    def kill(self) -> None:
        """The process dies: every connection drops; kubelet.sock stays behind, refusing."""
        inc = self.inc
        if inc is None or not inc.alive:
            return
        inc.killed()
        self.w.note("kubelet", f"#{inc.n} killed")
        for c in inc.all_clients:
            if c.conn is not None:
                conn, c.conn = c.conn, None
                conn.kubelet_closed(c)

    # --- Register ------------------------------------------------------------------------

    def register(self, resource: str, path: str, reply) -> None:
        """A Register call arriving now; `reply(outcome)` gets "ok", "refused" or "failed"."""
        inc = self.inc
        self.w.note("kubelet", f"Register {path} arrives at #{inc.n if inc else None}")
        if inc is None or not inc.listening:
            self.w.after(self.w.delay(), reply, "refused")
            return
        c = inc.register(resource, path, path, self.w.now)  # (the world's directory names its sockets by file name)
        call = {"inc": inc, "c": c, "reply": reply, "dial_until": None}
        self._step("before_dial", self._dial, call)

    def _step(self, name: str, fn, *args) -> None:
        self.w.after(self.w.delay(), fn, *args)

    def _fail(self, call: dict, why: str) -> None:
        inc, c = call["inc"], call["c"]
        inc.failed(c)
        self.w.note("kubelet", f"Register {c.path} fails: {why}")
        outcome = "refused" if not inc.alive else "failed"  # a dead server: UNAVAILABLE
        self.w.after(self.w.delay(), call["reply"], outcome)

    def _dial(self, call: dict) -> None:
        inc, c = call["inc"], call["c"]
        if not inc.alive:
            return self._fail(call, "kubelet died")
        server = self.w.fs.dial(c.path)
        if server is None:
            if call["dial_until"] is None:
                call["dial_until"] = self.w.now + DIAL_TIMEOUT_S
            if self.w.now + DIAL_RETRY_S > call["dial_until"]:
                return self._fail(call, "failed to dial device plugin: context deadline exceeded")
            self.w.after(DIAL_RETRY_S, self._dial, call)
            return
        c.conn = server
        server.connected(c)
        self._step("after_dial", self._options, call)

    def _options(self, call: dict) -> None:
        self._step("before_options", self._options_answered, call)

    def _options_answered(self, call: dict) -> None:
        inc, c = call["inc"], call["c"]
        if not inc.alive or c.conn is None or not c.conn.serving:
            if inc.options_failed(c):
                self._close(c)
            return self._fail(call, "failed to get device plugin options")
        self._step("before_set_endpoint", self._set_endpoint, call)

    def _set_endpoint(self, call: dict) -> None:
        inc, c = call["inc"], call["c"]
        if not inc.alive:
            return self._fail(call, "kubelet died")
        refused = inc.set_endpoint(c, None)
        if refused:
            self._close(c)
            return self._fail(call, refused)
        self._step("before_stream", self._run_client, inc, c)
        self._step("before_return", self._return, call)

    def _return(self, call: dict) -> None:
        inc, c = call["inc"], call["c"]
        if not inc.returned(c):
            self.w.after(self.w.delay(), call["reply"], "refused")
            return
        self.w.note("kubelet", f"Register {c.path} returns OK")
        self.w.after(self.w.delay(), call["reply"], "ok")

    # --- ListAndWatch ----------------------------------------------------------------------

    def _run_client(self, inc: DeviceManager, c: Client) -> None:
        """c.Run(): ListAndWatch; when it cannot open (the connection closed or gone), the teardown runs all the same."""
        if not inc.alive:
            return
        if not inc.may_stream(c) or not c.conn.open_stream(c):
            self._stream_ended(inc, c)
            return
        inc.stream_opened(c, self.w.now)

    def devices_sent(self, c: Client, healthy: int) -> None:
        """A ListAndWatch message arrives: it replaces the resource's device set."""
        if self.inc is not None:
            self.inc.listed(c, _listing(healthy))

    def stream_closed(self, c: Client) -> None:
        """The plugin ended the stream, or its connection dropped: Recv returns."""
        inc = self.inc
        if inc is None or c.incarnation != inc.n or not c.streaming:
            return
        self._stream_ended(inc, c)

    def _stream_ended(self, inc: DeviceManager, c: Client) -> None:
        if inc.stream_ended(c, self.w.now):
            self._step("teardown", self._teardown_lookup, inc, c)

    def _teardown_lookup(self, inc: DeviceManager, c: Client) -> None:
        if not inc.alive:
            return
        found = inc.lookup(c, self.w.now)
        if found is not None:
            self._step("teardown_lookup", self._teardown, inc, c, found)

    def _teardown(self, inc: DeviceManager, c: Client, found: Client) -> None:
        if not inc.alive:
            return
        self.w.note("kubelet", f"teardown of {c} disconnects {found}")
        inc.let_go(c, found)
        self._close(found)
        inc.disconnected(c, found, self.w.now)

    def _close(self, c: Client) -> None:
        """kubelet closes the client's connection: its stream, if open, ends (and that teardown runs too)."""
        if c.conn is not None:
            conn, c.conn = c.conn, None
            conn.kubelet_closed(c)
        if c.streaming:
            self._stream_ended(self.inc, c)

    def end_stream(self, resource: str) -> bool:
        """kubelet itself ends the resource's live stream (as on a stream error)."""
        inc = self.inc
        live = [c for c in inc.all_clients if c.resource == resource and c.streaming]
        for c in live:
            if c.conn is not None:
                c.conn.kubelet_ended_stream(c)
            self._stream_ended(inc, c)
        return bool(live)

    # --- pod-resources ------------------------------------------------------------------

    def allocatable(self, resources):
        """GetAllocatableResources: {resource: count} for these resources, or why there is none."""
        if not self.pod_resources:
            return "absent"
        inc = self.inc
        if inc is None or not inc.alive:
            return "refused"
        if not inc.limiter.allow(self.w.now):
            self.exhausted += 1
            return "exhausted"
        listed = inc.allocatable(self.w.now)
        return {r: len(listed.get(r, ())) for r in resources}

    # --- what the checks ask -----------------------------------------------------------

    def problems(self, resource: str, expected: int, socket: Optional[str]) -> List[str]:
        """The healthy end state: the model's (newest() with takeover), with what the world knows."""
        inc = self.inc
        if inc is None or not inc.alive:
            return ["kubelet is not running"]
        if self.mode == "1.32" and self._orphan_won(inc, resource):
            # A Register in flight when its process was killed went on in kubelet after the next
            # registration and took the resource's name from it: nothing the next daemon can see
            # tells (docs/design.md, "What it cannot fix"), or its late teardown stopped the current
            # endpoint by name. Counted, not failed on.
            self.orphans_won += 1
            return inc.unsettled()
        # kubelet 1.32 keeps one client per resource: the live one must be the newest Register's.
        # The current kubelet keeps one per socket, and when one goes another live one takes
        # over (an upgrade's successor that failed after registering beside its predecessor):
        # the live one is the current endpoint's.
        out = inc.problems(resource, expected, self.w.now, takeover=True)
        newest = inc.newest(resource, takeover=True)
        if socket is not None and (newest is None or newest.path != socket):
            out.append(f"kubelet's current registration {newest} is not the daemon's socket {socket}")
        if self.exhausted:
            out.append(f"kubelet's pod-resources limit refused {self.exhausted} of our questions "
                       f"(a node agent polling at {self.agent_rps:g}/s beside us)")
        # A Register in flight when its daemon was killed goes on in kubelet; nothing the next
        # daemon can see tells it apart, so a duplicate it makes is counted, not failed on.
        # That is: the orphan came after the daemon's Register, or the daemon's was one that such an
        # orphan's late teardown knocked out (it never streams: the daemon registers again once
        # its verification runs out, or once its predecessor's take-back registers once more).
        # (kubelet with endpoints per socket keeps two of a resource apart: an upgrade's
        # successor registers beside its predecessor there on purpose.)
        orphaned = self.w.orphaned
        dup = [(a.endpoint, b.endpoint) for a, b in inc.duplicates(resource) if self.mode == "1.32"
               and not (inc.caused_by(a.client, orphaned) or inc.caused_by(b.client, orphaned))]
        if dup:
            out.append(f"duplicate Registers in one kubelet process: {dup}")
        return out

    def _orphan_won(self, inc: DeviceManager, resource: str) -> bool:
        newest = inc.newest(resource)
        e = inc.endpoints.get(resource)
        return newest is not None and (newest.path in self.w.orphaned or (
            e is not None and e.stopped_at is not None and e.stopped_by in self.w.orphaned))
