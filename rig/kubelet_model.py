"""kubelet's device manager as bookkeeping alone: the one model the stand-in and the simulation run.

What it models, read from kubernetes/kubernetes (pkg/kubelet/cm/devicemanager/{manager.go,
endpoint.go}, plugin/v1beta1/{server.go,handler.go,client.go}, apis/podresources/): one kubelet
process's plugin clients, endpoints and device sets, in two generations.

`1.32` (every kubelet before PR #135437): clients and endpoints keyed by resource name; Register
stores the new client by name BEFORE dialing (the old client is not closed: its stream goes on);
when a stream ends, the teardown looks the client up again BY NAME (possibly a newer one),
deregisters and disconnects it, then PluginDisconnected(name) marks the resource's devices
unhealthy and stops whatever endpoint is current. A late old teardown therefore knocks out the
new client, or leaves the new endpoint stopped with its stream still open.
`current` (master after PR #135437): clients per name + socket path; a second connection on a
path is refused ("device plugin already connected: <path>"); a teardown evicts what sits at its
path, and when another endpoint of the resource is still live it takes over (devices stay healthy).

Both: every ListAndWatch message replaces the resource's device sets and is checkpointed; a
resource whose endpoint stopped more than a grace period ago is dropped (GetCapacity); a new
process restores the checkpoint's resources with no devices and a stopped endpoint; pod-resources
is rate-limited per process (a token bucket, full at the start).

No I/O here: no sockets, threads, clocks or sleeps. A driver (rig/kubelet_standin.py: real
sockets, threads and gRPC; tests/simulation/kubelet.py: a simulated clock, a random delay per
step) does kubelet's I/O between these calls, at the steps named in STEPS, and passes the time
in. Where kubelet's bookkeeping decides an effect, the call returns it (a refusal to send back,
a connection to close); writing the checkpoint is the one effect called, through `Checkpoint`.
"""

from typing import (AbstractSet, Callable, Collection, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional,
                    Sequence, Set, Tuple, Union)

MODES = ("1.32", "current")
# Where a driver may take time in kubelet's Register and teardown (delays in the stand-in, events in the simulation).
STEPS = ("before_dial", "after_dial", "before_options", "before_set_endpoint", "before_return",
         "before_stream", "teardown", "teardown_lookup")
GRACE_PERIOD_S = 300.0  # endpointStopGracePeriod
HEALTHY = "Healthy"
DOWN = "kubelet is not running"  # DeviceManager.rejection(): no kubelet, so no admission (nothing rejected)

Device = Tuple[str, Optional[Sequence[int]]]  # a ListAndWatch device: (health, its NUMA nodes or None)
Checkpoint = Callable[[Mapping[str, AbstractSet[str]]], None]  # write {resource: healthy IDs}


class Client:
    """kubelet's plugin client: one connection to one plugin socket and its ListAndWatch stream.
    `conn` is the driver's (a gRPC channel, a simulated server): None until dialed, or once closed."""

    __slots__ = ("resource", "endpoint", "path", "n", "incarnation", "registered_at", "conn", "options", "devices",
                 "streaming", "connected", "closed", "closed_at", "stream_started_at", "stream_ended_at", "torn_down_at",
                 "knocked_out_by")

    def __init__(self, resource: str, endpoint: str, path: str, n: int, incarnation: int, registered_at: float):
        self.resource = resource
        self.endpoint = endpoint  # the socket's file name, as registered
        self.path = path  # where kubelet dials it (the key of the current kubelet's store)
        self.n = n  # numbered across the kubelet's processes, for the histories
        self.incarnation = incarnation  # the process that made it
        self.registered_at = registered_at  # when its Register call arrived
        self.conn: object = None
        self.options: object = None  # GetDevicePluginOptions' answer
        self.devices: Mapping[str, Device] = {}  # its last ListAndWatch message
        self.streaming = False  # the ListAndWatch call is open
        self.connected = False  # ... and its first message has arrived
        self.closed = False  # a teardown's Disconnect() closed it
        self.closed_at: Optional[float] = None  # ... and returned
        self.stream_started_at: Optional[float] = None
        self.stream_ended_at: Optional[float] = None
        self.torn_down_at: Optional[float] = None  # the teardown after its stream ended finished
        self.knocked_out_by: Optional[str] = None  # the path whose teardown, by name, disconnected this one

    def __repr__(self) -> str:
        return f"client#{self.n}({self.endpoint} streaming={self.streaming} torn_down={self.torn_down_at})"


class Endpoint:
    """kubelet's endpointImpl: the client a resource's Allocate goes to, and a stop time."""

    __slots__ = ("resource", "client", "stopped_at", "stopped_by")

    def __init__(self, resource: str, client: Optional[Client], stopped_at: Optional[float] = None):
        self.resource = resource
        self.client = client  # None: restored from the checkpoint
        self.stopped_at = stopped_at  # None: not stopped
        self.stopped_by: Optional[str] = None  # the path whose teardown stopped it

    @property
    def path(self) -> Optional[str]:
        return self.client.path if self.client is not None else None

    @property
    def name(self) -> Optional[str]:
        return self.client.endpoint if self.client is not None else None

    def __repr__(self) -> str:
        return f"&{{{self.resource} {self.name}}}"


class Accepted(NamedTuple):
    """A Register call that returned OK."""

    resource: str
    endpoint: str
    arrived_at: float
    client: Client


class TokenBucket:
    """golang.org/x/time/rate's Limiter as kubelet's pod-resources uses it (Allow): `burst` tokens
    at first, refilled at `rate` a second up to `burst`; a call takes one or is refused."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate = float(rate)
        self.burst = int(burst)
        self._tokens: float = float(burst)
        self._at = now

    def allow(self, now: float) -> bool:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


class DeviceManager:
    """One kubelet process's device manager, plugin server and pod-resources limiter: all of it
    dies with the process (the checkpoint outlives it, in the driver's keeping)."""

    def __init__(self, mode: str, n: int, now: float, numbers: Iterator[int], restored: Iterable[str] = (),
                 checkpoint: Optional[Checkpoint] = None, grace: float = GRACE_PERIOD_S,
                 rate_limit: Optional[Tuple[float, int]] = None):
        if mode not in MODES:
            raise ValueError(f"kubelet must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.n = n
        self.alive = True
        self.listening = False  # the driver serves Registration (kubelet.sock accepts)
        self.grace = grace
        self._numbers = numbers  # the kubelet's client numbers, shared by its processes
        self._checkpoint = checkpoint
        # The plugin server's clients: 1.32 name -> Client; current: name -> [Client].
        self.server_clients: Dict[str, Union[Client, List[Client]]] = {}
        self.all_clients: List[Client] = []  # every client this process made
        self.endpoints: Dict[str, Endpoint] = {}
        self.store: Dict[str, Dict[str, Endpoint]] = {}  # current: name -> path -> endpoint
        self.healthy: Dict[str, Set[str]] = {}
        self.unhealthy: Dict[str, Set[str]] = {}
        self.all_devices: Dict[str, Mapping[str, Device]] = {}
        self.accepted: List[Accepted] = []  # in the order they returned
        self.in_flight = 0  # Register calls between their arrival and their answer
        self.limiter = TokenBucket(rate_limit[0], rate_limit[1], now) if rate_limit is not None else None
        for name in restored:  # readCheckpoint: known resources, no devices, a stopped endpoint
            self.healthy[name] = set()
            self.unhealthy[name] = set()
            self.endpoints[name] = Endpoint(name, None, stopped_at=now)

    def killed(self) -> None:
        self.alive = self.listening = False

    # --- Register (plugin/v1beta1/server.go, handler.go; manager.go PluginConnected) ----------

    def register(self, resource: str, endpoint: str, path: str, now: float) -> Client:
        """A valid Register call arrives: registerClient, before the dial (1.32 replaces the
        resource's client without closing the old one)."""
        c = Client(resource, endpoint, path, next(self._numbers), self.n, now)
        self.in_flight += 1
        self.all_clients.append(c)
        if self.mode == "1.32":
            self.server_clients[resource] = c
        else:
            self.server_clients.setdefault(resource, []).append(c)
        return c

    def options_failed(self, c: Client) -> bool:
        """GetDevicePluginOptions failed: whether kubelet closes the connection (1.32 leaves it
        open, kubernetes#124716). The Register then fails."""
        return self.mode != "1.32"

    def set_endpoint(self, c: Client, options: object) -> Optional[str]:
        """The rest of PluginConnected: the client's endpoint becomes the resource's. The current
        kubelet refuses a second connection on a path: the refusal is returned, and the driver
        closes the connection and fails the Register with it."""
        c.options = options
        if self.mode == "current":
            if c.path in self.store.get(c.resource, {}):
                return f"device plugin already connected: {c.path}"
            e = Endpoint(c.resource, c)
            self.store.setdefault(c.resource, {})[c.path] = e
        else:
            e = Endpoint(c.resource, c)
        self.endpoints[c.resource] = e
        return None

    def failed(self, c: Client) -> None:
        """The Register fails after its client was registered: deregisterClient(name), which in
        1.32 removes whatever client holds the name now."""
        self.in_flight -= 1
        self._deregister(c)

    def returned(self, c: Client) -> bool:
        """The Register returns; False: the process died meanwhile (the call's connection dropped)."""
        self.in_flight -= 1
        if not self.alive:
            return False
        self.accepted.append(Accepted(c.resource, c.endpoint, c.registered_at, c))
        return True

    # --- ListAndWatch and the teardown after it (client.go Run, handler.go runClient) --------

    def may_stream(self, c: Client) -> bool:
        """Whether Run() can open ListAndWatch on `c`: dialed, and not disconnected by a teardown
        (in Go the call on a closed connection fails at once). If not, the driver ends the stream
        at once (stream_ended), and the teardown runs all the same."""
        return not c.closed and c.conn is not None

    def stream_opened(self, c: Client, now: float) -> None:
        c.streaming = True
        c.stream_started_at = now

    def listed(self, c: Client, devices: Mapping[str, Device]) -> bool:
        """A ListAndWatch message (the mapping is kept as given, never changed): it replaces the
        resource's device sets (genericDeviceUpdateCallback) and is checkpointed. False: not
        taken (the process is gone, or the client is not its own or not streaming)."""
        if not self.alive or c.incarnation != self.n or not c.streaming:
            return False
        c.devices = devices
        c.connected = True
        healthy: Set[str] = set()
        unhealthy: Set[str] = set()
        for i, d in devices.items():
            (healthy if d[0] == HEALTHY else unhealthy).add(i)
        self.healthy[c.resource], self.unhealthy[c.resource] = healthy, unhealthy
        self.all_devices[c.resource] = devices
        self._write_checkpoint()
        return True

    def stream_ended(self, c: Client, now: float) -> bool:
        """Run() returned: the stream ended, or never opened (a closed or gone connection). True:
        the teardown follows (the process lives)."""
        c.streaming = c.connected = False
        c.stream_ended_at = now
        return self.alive

    def lookup(self, c: Client, now: float) -> Optional[Client]:
        """The teardown's getClient: by name in 1.32 (maybe a newer client), by name and path now.
        None: nothing to let go of, and `c` is torn down."""
        if self.mode == "1.32":
            found = self.server_clients.get(c.resource)
        else:
            found = next((x for x in self.server_clients.get(c.resource, []) if x.path == c.path), None)
        if found is None:
            c.torn_down_at = now
        return found

    def let_go(self, c: Client, found: Client) -> None:
        """disconnectClient up to the close: deregister `found`, then Disconnect() closes its
        connection (the driver closes `found.conn`, which ends its stream) and comes back to
        disconnected()."""
        if found is not c:
            found.knocked_out_by = c.path
        self._deregister(found)
        found.closed = True

    def disconnected(self, c: Client, found: Client, now: float) -> None:
        """Disconnect() returned: PluginDisconnected for `found`'s path; `c`'s teardown is done."""
        found.closed_at = now
        if self.alive:
            self._plugin_disconnected(c.resource, found.path, now)
        c.torn_down_at = now

    def _plugin_disconnected(self, name: str, path: str, now: float) -> None:
        """1.32: the resource's devices unhealthy, whatever endpoint is current stopped. Current:
        the endpoint at `path` stopped; another live one takes over, or the devices go unhealthy."""
        if self.mode == "1.32":
            e = self.endpoints.get(name)
            if e is not None:
                self._mark_unhealthy(name)
                e.stopped_at, e.stopped_by = now, path
            return
        store = self.store.get(name, {})
        e = store.pop(path, None)
        if e is None:
            return
        e.stopped_at, e.stopped_by = now, path
        if store:
            if self.endpoints.get(name) is e:
                self.endpoints[name] = list(store.values())[-1]
        else:
            self.store.pop(name, None)
            self._mark_unhealthy(name)

    def _deregister(self, c: Client) -> None:
        if self.mode == "1.32":
            self.server_clients.pop(c.resource, None)  # delete(s.clients, name): whatever is there now
            return
        lst = self.server_clients.get(c.resource, [])
        if c in lst:
            lst.remove(c)
        if not lst:
            self.server_clients.pop(c.resource, None)

    def _mark_unhealthy(self, name: str) -> None:
        self.unhealthy[name] = self.unhealthy.get(name, set()) | self.healthy.get(name, set())
        self.healthy[name] = set()

    def _write_checkpoint(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint(self.healthy)

    # --- what the node and pod-resources are told -----------------------------------------

    def capacity(self, now: float) -> Dict[str, Tuple[int, int]]:
        """GetCapacity: (capacity, allocatable) per resource; drops a resource whose endpoint is
        gone or stopped more than the grace period ago (kubelet, on its node status sync), and
        checkpoints then."""
        out: Dict[str, Tuple[int, int]] = {}
        changed = False
        for name in sorted(set(self.healthy) | set(self.unhealthy)):
            e = self.endpoints.get(name)
            if e is None or (e.stopped_at is not None and now - e.stopped_at > self.grace):
                self.endpoints.pop(name, None)
                self.healthy.pop(name, None)
                self.unhealthy.pop(name, None)
                changed = True
                continue
            h, u = len(self.healthy.get(name, ())), len(self.unhealthy.get(name, ()))
            out[name] = (h + u, h)
        if changed:
            self._write_checkpoint()
        return out

    def allocatable(self, now: float) -> Dict[str, AbstractSet[str]]:
        """pod-resources' GetAllocatableResources: the IDs of each resource's healthy devices (in
        all_devices), whatever its endpoint's stop time. The sets are the manager's own: read them."""
        self.capacity(now)
        return {name: ids for name, ids in self.healthy.items() if name in self.all_devices}

    # --- admission: the device manager's part of admitting a pod -----------------------------

    def rejection(self, resource: str) -> Optional[str]:
        """Why kubelet would reject a pod requesting one unit of `resource` now
        (UnexpectedAdmissionError; None: admitted; DOWN: no kubelet, nothing rejected). A
        resource absent from the healthy sets is not the device manager's and the node has none;
        otherwise Allocate checks, in order: a healthy device (devicesToAllocate), the endpoint
        (known, not stopped), then the RPC on its connection, which fails if kubelet closed it or
        the plugin is gone (an ended stream stands in for the latter)."""
        if not self.alive:
            return DOWN
        if resource not in self.healthy:
            return f"{resource} is not registered: the node has none (Node didn't have enough resource: {resource})"
        if not self.healthy[resource]:
            return f"no healthy devices present; cannot allocate unhealthy devices {resource}"
        e = self.endpoints.get(resource)
        if e is None:
            return f"unknown Device Plugin {resource}"
        if e.stopped_at is not None:
            return f"endpoint {e!r} has been stopped"
        c = e.client
        if c is None or c.closed or c.conn is None:
            return f"endpoint {e!r}: grpc: the client connection is closing"
        if c.stream_ended_at is not None:
            return f"endpoint {e!r}: the plugin's stream ended (Allocate would fail)"
        return None

    def readmission(self, resource: str, before: Collection[str]) -> Optional[str]:
        """Why kubelet would reject a pod bound to the node before (a reboot) that had `before`
        of `resource`, at admission now. devicesToAllocate checks first: the resource registered
        (from the checkpoint too), a healthy device, every device from before still healthy;
        with all of them it asks the plugin nothing. No devices from before: a new pod."""
        if not before:
            return self.rejection(resource)
        if not self.alive:
            return DOWN
        if resource not in self.healthy:
            return f"cannot allocate unregistered device {resource}"
        if not self.healthy[resource]:
            return f"no healthy devices present; cannot allocate unhealthy devices {resource}"
        if not set(before) <= self.healthy[resource]:
            return f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {resource}"
        return None

    def allocate_refusal(self, resource: str, check_health: bool = False) -> Optional[str]:
        """What kubelet says before it sends an Allocate for `resource` (None: it sends it to the
        current endpoint); `check_health` adds devicesToAllocate's checks."""
        e = self.endpoints.get(resource)
        if e is None:
            return f"unknown Device Plugin {resource}"
        if check_health:
            if resource not in self.healthy:
                return f"cannot allocate unregistered device {resource}"
            if not self.healthy[resource]:
                return f"no healthy devices present; cannot allocate unhealthy devices {resource}"
        if e.stopped_at is not None:
            return f"endpoint {e!r} has been stopped"
        return None

    # --- the healthy end state, as both drivers' checks define it ----------------------------

    def newest(self, resource: str, takeover: bool = False) -> Optional[Client]:
        """The client of the resource's current registration: the newest accepted Register's; with
        `takeover`, in the current kubelet, the current endpoint's (when one endpoint goes, another
        live one takes over: an upgrade's successor that failed after registering beside us)."""
        accepted = [a for a in self.accepted if a.resource == resource]
        if not accepted:
            return None
        if takeover and self.mode == "current":
            e = self.endpoints.get(resource)
            return e.client if e is not None else None
        return accepted[-1].client

    def unsettled(self) -> List[str]:
        """Register calls in flight and teardowns pending: kubelet is not quiet yet."""
        out = []
        if self.in_flight:
            out.append(f"{self.in_flight} Register call(s) in flight")
        pending = [c for c in self.all_clients if c.stream_ended_at is not None and c.torn_down_at is None]
        if pending:
            out.append(f"teardowns pending: {pending}")
        return out

    def problems(self, resource: str, expected: int, now: float, takeover: bool = False) -> List[str]:
        """How this process is not in the healthy end state for `resource` (none: it is): quiet
        (unsettled()), exactly one live stream, the newest registration's (see newest()), its
        endpoint current and not stopped, `expected` units allocatable to the node and in
        pod-resources. Duplicates are the driver's to judge (duplicates())."""
        if not self.alive:
            return [DOWN]
        out = self.unsettled()
        newest = self.newest(resource, takeover)
        if not any(a.resource == resource for a in self.accepted):
            return out + [f"no registration of {resource} accepted by kubelet#{self.n}"]
        live = [c for c in self.all_clients if c.resource == resource and c.streaming]
        if len(live) != 1:
            out.append(f"{len(live)} live ListAndWatch streams, not 1: {live}")
        elif live[0] is not newest or not live[0].connected:
            out.append(f"the live stream {live[0]} is not the current registration's ({newest})")
        e = self.endpoints.get(resource)
        if e is None:
            out.append("no endpoint")
        else:
            if e.stopped_at is not None:
                out.append(f"endpoint {e!r} is stopped")
            if e.client is not newest:
                out.append(f"current endpoint {e!r} is not the newest registration's ({newest})")
        cap = self.capacity(now).get(resource, (0, 0))[1]
        if cap != expected:
            out.append(f"node allocatable {cap} != {expected}")
        listed = len(self.allocatable(now).get(resource, ()))
        if listed != expected:
            out.append(f"pod-resources allocatable {listed} != {expected}")
        return out

    def duplicates(self, resource: str, among: Optional[Collection[Client]] = None) -> List[Tuple[Accepted, Accepted]]:
        """Consecutive accepted Registers of `resource` (of the clients `among`, if given), the
        second arriving before the first's client had been torn down."""
        acc = [a for a in self.accepted if a.resource == resource and (among is None or a.client in among)]
        return [(a, b) for a, b in zip(acc, acc[1:])
                if a.client.torn_down_at is None or a.client.torn_down_at > b.arrived_at]

    def caused_by(self, c: Client, paths: AbstractSet[str]) -> bool:
        """`c` is at one of `paths`, or was knocked out by a teardown of one, or by one that was
        (a teardown by name of a client knocked out so lands on the next: the same cause)."""
        by_path = {x.path: x for x in self.all_clients}
        seen: Set[str] = set()
        at: Optional[Client] = c
        while at is not None and at.path not in seen:
            if at.path in paths:
                return True
            seen.add(at.path)
            at = by_path.get(at.knocked_out_by) if at.knocked_out_by else None
        return False
