"""kubelet's DRA side as bookkeeping alone: the one model the stand-in (rig/dra_kubelet.py) and
the simulation (tests/simulation/dra.py) run.

Read from kubernetes 1.34.4, 1.36.3 and 1.37.2 (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go,
dra_plugin.go, cm/dra/manager.go, pluginmanager/, kuberuntime, pod_workers.go):

- Registration: the plugin watcher sees a socket appear in plugins_registry (fsnotify Create;
  the sockets there at its start count as created), dials it, asks GetInfo and registers the
  plugin; a Remove event deregisters it. A file removed and made again is a deregistration and a
  new registration; a file that stays is never asked again, whatever process listens behind it.
  A driver may have several instances (an upgrade) under distinct endpoints ("endpoint ... already
  registered"); calls go to the newest connected one, else the newest. The service is the first of
  the plugin's list kubelet speaks (`v1.DRAPlugin`, then `v1beta1.DRAPlugin`).
- The connection: one gRPC client per instance, made at registration and connected at once;
  "connected" is a connect() that succeeded (before the server said a word). When it drops,
  kubelet dials the same path again at once, then on gRPC's back-off (1 s, x1.6, up to 120 s).
  A call on a connection still waiting for the server's first bytes waits (up to PREFACE_WAIT_S);
  one on a connection that failed fails at once.
- Slices: when no instance of a driver is connected, its ResourceSlices are deleted WIPE_DELAY_S
  later, unless one connects meanwhile; a starting kubelet deletes all its node's slices.
- A failed prepare (no driver registered, the call failed, an error for the claim) is no error of
  the pod's sync: the pod is tried again at its next resync, RESYNC_S later (jittered).
- Health: 1.37 opens `v1.DRAResourceHealth` for a plugin that lists it; 1.36 opens
  `v1alpha1.DRAResourceHealth` for every plugin; 1.34 none (its gate is off).

No I/O here: no sockets, threads or clocks. The driver of the model (the stand-in, the
simulation) does kubelet's I/O and passes the time in.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

WIPE_DELAY_S = 30.0
CALL_TIMEOUT_S = 45.0
PREFACE_WAIT_S = 20.0
RESYNC_S = (60.0, 90.0)
SPOKEN = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # what kubelet >= 1.34 speaks, in its order of preference
VERSIONS = ("1.34", "1.36", "1.37")


class Info(NamedTuple):
    """A plugin's GetInfo answer."""

    type: str
    name: str
    endpoint: str
    versions: Tuple[str, ...]


class Instance:
    """One registered plugin instance."""

    __slots__ = ("path", "driver", "endpoint", "service", "health", "added_at", "connected", "n")

    def __init__(self, path: str, driver: str, endpoint: str, service: str, health: Optional[str], added_at: float,
                 n: int) -> None:
        self.path, self.driver, self.endpoint, self.service, self.health = path, driver, endpoint, service, health
        self.added_at, self.n = added_at, n
        self.connected = False

    def __repr__(self) -> str:
        return f"instance#{self.n}({self.endpoint} {self.service} connected={self.connected})"


class PluginManager:
    """One kubelet process's DRA plugins."""

    def __init__(self, version: str = "1.37") -> None:
        if version not in VERSIONS:
            raise ValueError(version)
        self.version = version
        self.instances: Dict[str, List[Instance]] = {}  # by driver, in the order they were added
        self.wipe_at: Dict[str, float] = {}  # driver -> when its slices are deleted
        self.refused: List[Tuple[str, str]] = []  # (registration socket, why)
        self._n = 0

    def register(self, now: float, path: str, info: Info) -> Tuple[Optional[Instance], str]:
        """A GetInfo answer from the socket at `path`: the instance added, or why not (what
        NotifyRegistrationStatus then says)."""
        service = next((v for v in info.versions if v in SPOKEN), None)
        why = ""
        if info.type != "DRAPlugin":
            why = f"type {info.type!r}"
        elif service is None:
            why = (f"none of the services supported by the plugin ({list(info.versions)}) are supported by the "
                   "kubelet")
        elif any(i.endpoint == info.endpoint for i in self.instances.get(info.name, ())):
            why = f"endpoint {info.endpoint} already registered for DRA driver plugin {info.name}"
        if why:
            self.refused.append((path, why))
            return None, why
        self._n += 1
        i = Instance(path, info.name, info.endpoint, service or "", self._health(info.versions), now, self._n)
        self.instances.setdefault(info.name, []).append(i)
        self._sync(now, info.name)
        return i, ""

    def _health(self, versions: Sequence[str]) -> Optional[str]:
        if self.version == "1.37":
            return next((v for v in ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth") if v in versions), None)
        if self.version == "1.36":
            return "v1alpha1.DRAResourceHealth"  # (opened for every plugin; Unimplemented is tried again)
        return None

    def deregister(self, now: float, path: str) -> List[Instance]:
        """The registration socket at `path` went: the instances it registered."""
        gone = []
        for driver, found in self.instances.items():
            gone += [i for i in found if i.path == path]
            self.instances[driver] = [i for i in found if i.path != path]
            if len(self.instances[driver]) != len(found):
                self._sync(now, driver)
        return gone

    def connection(self, now: float, instance: Instance, connected: bool) -> None:
        instance.connected = connected
        self._sync(now, instance.driver)

    def chosen(self, driver: str) -> Optional[Instance]:
        """Where a call goes: the newest connected instance, else the newest."""
        found = self.instances.get(driver) or []
        connected = [i for i in found if i.connected]
        return (connected or found or [None])[-1]

    def _sync(self, now: float, driver: str) -> None:
        if any(i.connected for i in self.instances.get(driver, ())):
            self.wipe_at.pop(driver, None)
        elif driver not in self.wipe_at:
            self.wipe_at[driver] = now + WIPE_DELAY_S  # (a wipe already due keeps its time)

    def wipes_due(self, now: float) -> List[str]:
        """The drivers whose slices are to be deleted now (each once)."""
        due = [driver for driver, at in self.wipe_at.items() if now >= at]
        for driver in due:
            del self.wipe_at[driver]
        return due
