"""Models of kubelet's device manager, one per generation, on a simulated clock.

The same bookkeeping as the process-level stand-in (rig/kubelet_standin.py,
read from kubelet's pkg/kubelet/cm/devicemanager), without sockets or threads:
every step that takes time in kubelet is a scheduled event, with a random delay
of its own, so a seed fixes one interleaving.

`1.32` (every kubelet before kubernetes PR #135437): clients and endpoints keyed
by resource name; Register stores the client by name before dialing; a stream's
teardown looks the client up again by name, deregisters and disconnects it,
then PluginDisconnected(name) marks the devices unhealthy and stops whatever
endpoint is current. `current`: clients kept per name + socket path, a second
connection on the same path refused, a teardown evicts what sits at its path,
and another live endpoint of the resource takes over.
"""

from typing import Dict, List, Optional

# pkg/kubelet/apis/podresources/constants.go: every client of pod-resources together.
POD_RESOURCES_RATE, POD_RESOURCES_BURST = 100.0, 10.0
STEPS = ("before_dial", "after_dial", "before_options", "before_set_endpoint", "before_return",
         "before_stream", "teardown", "teardown_lookup")
DIAL_TIMEOUT_S = 10.0
DIAL_RETRY_S = 1.0


class SimulatedClient:
    __slots__ = ("resource", "path", "conn", "streaming", "ended_at", "torn_down", "closed", "n", "knocked_out_by")

    def __init__(self, resource: str, path: str, n: int):
        self.resource = resource
        self.path = path  # the socket file name, as registered
        self.conn = None  # the plugin-side server it dialled
        self.streaming = False
        self.ended_at: Optional[float] = None
        self.torn_down: Optional[float] = None  # when the teardown after its stream ended finished
        self.closed = False
        self.n = n
        self.knocked_out_by: Optional[str] = None  # the socket whose teardown, by name, disconnected this one

    def __repr__(self) -> str:
        return f"client#{self.n}({self.path} streaming={self.streaming} torn_down={self.torn_down})"


class SimulatedEndpoint:
    __slots__ = ("client", "path", "stopped_at", "stopped_by")

    def __init__(self, client: Optional[SimulatedClient], path: Optional[str], stopped_at: Optional[float] = None):
        self.client = client
        self.path = path
        self.stopped_at = stopped_at
        self.stopped_by: Optional[str] = None  # the socket whose teardown stopped it


class Incarnation:
    """One kubelet process."""

    def __init__(self, n: int):
        self.n = n
        self.alive = True
        self.listening = False
        self.clients: Dict[str, object] = {}  # 1.32: name -> SimulatedClient; current: name -> [SimulatedClient]
        self.all_clients: List[SimulatedClient] = []
        self.endpoints: Dict[str, SimulatedEndpoint] = {}
        self.store: Dict[str, Dict[str, SimulatedEndpoint]] = {}  # current: name -> path -> endpoint
        self.healthy: Dict[str, int] = {}  # name -> healthy device count
        self.accepted: List[tuple] = []  # (resource, path, arrived_at, client) of Registers that returned OK
        self.in_flight = 0
        self.tokens, self.filled_at = POD_RESOURCES_BURST, None  # pod-resources' rate limiter


class KubeletModel:
    """kubelet's side of the wire, as events on the world's clock."""

    def __init__(self, world, mode: str, pod_resources: bool = True, agent_rps: float = 80.0):
        if mode not in ("1.32", "current"):
            raise ValueError(mode)
        self.w = world
        self.mode = mode
        self.pod_resources = pod_resources
        # A node agent polling pod-resources at this rate beside us, in its steady state: what
        # kubelet's limit refills for everyone else is what it leaves.
        self.agent_rps = agent_rps
        self.exhausted = 0  # our questions kubelet's limit refused
        self.orphans_won = 0  # end states an orphaned Register took over (see problems)
        self.inc: Optional[Incarnation] = None
        self.incarnations = 0
        self.checkpoint: Dict[str, int] = {}
        self._clients = 0

    # --- the process ---------------------------------------------------------------

    def start(self) -> None:
        """A new kubelet process: checkpoint, wipe the sockets, kubelet.sock (bind, then listen)."""
        self.incarnations += 1
        inc = self.inc = Incarnation(self.incarnations)
        self.w.note("kubelet", f"#{inc.n} starts")
        for name in self.checkpoint:  # known resources come back at capacity 0, endpoint stopped
            inc.endpoints[name] = SimulatedEndpoint(None, None, stopped_at=self.w.now)
            inc.healthy[name] = 0
        self.w.fs.make_dir()  # (kubelet makes its directory, if it is gone)
        self.w.fs.wipe()
        self.w.fs.create_kubelet_sock(inc)
        self.w.after(self.w.delay(), self._listen, inc)

    def _listen(self, inc: Incarnation) -> None:
        if inc.alive:
            inc.listening = True
            self.w.note("kubelet", f"#{inc.n} listens")

    def kill(self) -> None:
        """The process dies: every connection drops; kubelet.sock stays behind, refusing."""
        inc = self.inc
        if inc is None or not inc.alive:
            return
        inc.alive = inc.listening = False
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
        inc.in_flight += 1
        self._clients += 1
        c = SimulatedClient(resource, path, self._clients)
        inc.all_clients.append(c)
        if self.mode == "1.32":
            inc.clients[resource] = c  # replaces; the old client is not closed
        else:
            inc.clients.setdefault(resource, []).append(c)
        call = {"inc": inc, "c": c, "reply": reply, "at": self.w.now, "dial_until": None}
        self._step("before_dial", self._dial, call)

    def _step(self, name: str, fn, *args) -> None:
        self.w.after(self.w.delay(), fn, *args)

    def _fail(self, call: dict, why: str) -> None:
        inc, c = call["inc"], call["c"]
        inc.in_flight -= 1
        self.w.note("kubelet", f"Register {c.path} fails: {why}")
        self._deregister(inc, c)
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
            return self._fail(call, "failed to get device plugin options")
        self._step("before_set_endpoint", self._set_endpoint, call)

    def _set_endpoint(self, call: dict) -> None:
        inc, c = call["inc"], call["c"]
        if not inc.alive:
            return self._fail(call, "kubelet died")
        if self.mode == "current":
            if c.path in inc.store.get(c.resource, {}):
                self._disconnect(c)
                return self._fail(call, f"device plugin already connected: {c.path}")
            e = SimulatedEndpoint(c, c.path)
            inc.store.setdefault(c.resource, {})[c.path] = e
        else:
            e = SimulatedEndpoint(c, c.path)
        inc.endpoints[c.resource] = e
        self.checkpoint[c.resource] = 1
        self._step("before_stream", self._run_client, inc, c)
        self._step("before_return", self._return, call)

    def _return(self, call: dict) -> None:
        inc, c = call["inc"], call["c"]
        inc.in_flight -= 1
        if not inc.alive:
            self.w.after(self.w.delay(), call["reply"], "refused")
            return
        inc.accepted.append((c.resource, c.path, call["at"], c))
        self.w.note("kubelet", f"Register {c.path} returns OK")
        self.w.after(self.w.delay(), call["reply"], "ok")

    # --- ListAndWatch ----------------------------------------------------------------------

    def _run_client(self, inc: Incarnation, c: SimulatedClient) -> None:
        """c.Run(): ListAndWatch; when it cannot open (connection gone), the teardown runs all the same."""
        if not inc.alive or c.closed:
            return
        if c.conn is None or not c.conn.open_stream(c):
            self._stream_ended(inc, c)
            return
        c.streaming = True

    def devices_sent(self, c: SimulatedClient, healthy: int) -> None:
        """A ListAndWatch message arrives: it replaces the resource's device set."""
        inc = self.inc
        if inc is None or not inc.alive or c not in inc.all_clients or not c.streaming:
            return
        inc.healthy[c.resource] = healthy

    def stream_closed(self, c: SimulatedClient) -> None:
        """The plugin ended the stream, or its connection dropped: Recv returns."""
        inc = self.inc
        if inc is None or c not in inc.all_clients or not c.streaming:
            return
        self._stream_ended(inc, c)

    def _stream_ended(self, inc: Incarnation, c: SimulatedClient) -> None:
        c.streaming = False
        c.ended_at = self.w.now
        if not inc.alive:
            return
        self._step("teardown", self._teardown_lookup, inc, c)

    def _teardown_lookup(self, inc: Incarnation, c: SimulatedClient) -> None:
        if not inc.alive:
            return
        if self.mode == "1.32":
            found = inc.clients.get(c.resource)  # BY NAME: maybe a newer client
        else:
            found = next((x for x in inc.clients.get(c.resource, []) if x.path == c.path), None)
        if found is None:
            c.torn_down = self.w.now
            return
        self._step("teardown_lookup", self._teardown, inc, c, found)

    def _teardown(self, inc: Incarnation, c: SimulatedClient, found: SimulatedClient) -> None:
        if not inc.alive:
            return
        self.w.note("kubelet", f"teardown of {c} disconnects {found}")
        if found is not c:
            found.knocked_out_by = c.path
        self._deregister(inc, found)
        self._disconnect(found)
        self._plugin_disconnected(inc, c.resource, found.path)
        c.torn_down = self.w.now

    def _deregister(self, inc: Incarnation, c: SimulatedClient) -> None:
        if self.mode == "1.32":
            inc.clients.pop(c.resource, None)  # whatever is there now
        else:
            lst = inc.clients.get(c.resource, [])
            if c in lst:
                lst.remove(c)
            if not lst:
                inc.clients.pop(c.resource, None)

    def _disconnect(self, c: SimulatedClient) -> None:
        c.closed = True
        if c.conn is not None:
            conn, c.conn = c.conn, None
            conn.kubelet_closed(c)
        if c.streaming:  # closing the connection ends its stream: that teardown runs too
            self._stream_ended(self.inc, c)

    def _plugin_disconnected(self, inc: Incarnation, name: str, path: str) -> None:
        if self.mode == "1.32":
            e = inc.endpoints.get(name)
            if e is not None:
                inc.healthy[name] = 0
                e.stopped_at, e.stopped_by = self.w.now, path  # whatever endpoint is current
        else:
            store = inc.store.get(name, {})
            e = store.pop(path, None)
            if e is not None:
                e.stopped_at = self.w.now
                if store:
                    if inc.endpoints.get(name) is e:
                        inc.endpoints[name] = list(store.values())[-1]
                else:
                    inc.store.pop(name, None)
                    inc.healthy[name] = 0

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
        now = self.w.now
        if inc.filled_at is not None:
            inc.tokens = min(POD_RESOURCES_BURST, inc.tokens + (now - inc.filled_at) * (POD_RESOURCES_RATE - self.agent_rps))
        inc.filled_at = now
        if inc.tokens < 1.0:
            self.exhausted += 1
            return "exhausted"
        inc.tokens -= 1.0
        return {r: inc.healthy.get(r, 0) if r in inc.endpoints else 0 for r in resources}

    # --- what the checks ask -----------------------------------------------------------

    def problems(self, resource: str, expected: int, socket: Optional[str]) -> List[str]:
        """The healthy end state, as the process-level stand-in's assert_healthy defines it."""
        inc = self.inc
        if inc is None or not inc.alive:
            return ["kubelet is not running"]
        out = []
        if inc.in_flight:
            out.append(f"{inc.in_flight} Register call(s) in flight")
        pending = [c for c in inc.all_clients if c.ended_at is not None and c.torn_down is None]
        if pending:
            out.append(f"teardowns pending: {pending}")
        live = [c for c in inc.all_clients if c.resource == resource and c.streaming]
        accepted = [a for a in inc.accepted if a[0] == resource]
        if not accepted:
            return out + ["no registration accepted by this kubelet"]
        # kubelet 1.32 keeps one client per resource: the live one must be the newest Register's.
        # The current kubelet keeps one per socket, and when one goes another live one takes
        # over (an upgrade's successor that failed after registering beside its predecessor):
        # the live one is the current endpoint's.
        e = inc.endpoints.get(resource)
        newest = accepted[-1][3] if self.mode == "1.32" else (e.client if e is not None else None)
        if self.mode == "1.32" and (newest.path in self.w.orphaned or (
                e is not None and e.stopped_at is not None and e.stopped_by in self.w.orphaned)):
            # A Register in flight when its process was killed went on in kubelet after the next
            # registration and took the resource's name from it: nothing the next daemon can see
            # tells (docs/design.md, "What it cannot fix"), or its late teardown stopped the current
            # endpoint by name. Counted, not failed on.
            self.orphans_won += 1
            return out
        if len(live) != 1:
            out.append(f"{len(live)} live streams, not 1: {live}")
        elif live[0] is not newest:
            out.append(f"the live stream {live[0]} is not the current registration's ({newest})")
        if socket is not None and (newest is None or newest.path != socket):
            out.append(f"kubelet's current registration {newest} is not the daemon's socket {socket}")
        if e is None:
            out.append("no endpoint")
        else:
            if e.stopped_at is not None:
                out.append(f"endpoint {e.path} is stopped")
            if e.client is not newest:
                out.append(f"current endpoint {e.path} is not the newest registration's ({newest})")
        if inc.healthy.get(resource, 0) != expected:
            out.append(f"allocatable {inc.healthy.get(resource, 0)} != {expected}")
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
        dup = [(a.path, b.path) for a, b in self.duplicates(resource)
               if self.mode == "1.32" and not (self._orphan_caused(a) or self._orphan_caused(b))]
        if dup:
            out.append(f"duplicate Registers in one kubelet process: {dup}")
        return out

    def _orphan_caused(self, c: SimulatedClient) -> bool:
        """`c` is an orphan, or was knocked out by one, or by one that was (a teardown by name
        of a client an orphan's teardown knocked out lands on the next: the same cause)."""
        by_path = {x.path: x for x in self.inc.all_clients}
        seen = set()
        while c is not None and c.path not in seen:
            if c.path in self.w.orphaned:
                return True
            seen.add(c.path)
            c = by_path.get(c.knocked_out_by) if c.knocked_out_by else None
        return False

    def duplicates(self, resource: str) -> List[tuple]:
        """Accepted Registers of one process, the second arriving before the first's client was torn down."""
        acc = [a for a in self.inc.accepted if a[0] == resource]
        return [(a[3], b[3]) for a, b in zip(acc, acc[1:]) if a[3].torn_down is None or a[3].torn_down > b[2]]
