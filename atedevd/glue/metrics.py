"""The Prometheus series: what the daemon knows, as node_exporter's text exposition format.

`render` turns each resource's report into the whole file; daemon/textfile.py writes it where
node_exporter's textfile collector reads it. The series are documented in docs/metrics.md.
The simulation renders the same text at the end of a round.
"""

import time
from typing import Dict, Iterable, List, Tuple

from atedevd.record import Record
from atedevd.registration.messages import State, Why
from atedevd.registration.report import Report


class DaemonInfo(Record):
    """What does not change while the daemon runs."""

    version: str
    flavour: str
    grpcio: str
    protobuf: str
    python: str
    started: float  # monotonic clock (rendered with the wall clock offset, as the state changes are)

    @classmethod
    def current(cls) -> "DaemonInfo":
        from atedevd.version import stack_versions

        v = stack_versions()
        return cls(v["version"], v["flavour"], v["grpcio"], v["protobuf"], v["python"], time.monotonic())


class _Family:
    def __init__(self, name: str, kind: str, help_text: str):
        self.name, self.kind, self.help = name, kind, help_text
        self.samples: List[Tuple[Dict[str, str], float]] = []

    def add(self, value: float, **labels: str) -> None:
        self.samples.append((labels, value))

    def text(self) -> str:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in self.samples:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            out.append(f"{self.name}{{{inner}}} {_number(value)}" if inner else f"{self.name} {_number(value)}")
        return "\n".join(out)


def render(info: DaemonInfo, reports: Iterable[Report], polling: bool, reload_ok: bool, wall_offset: float) -> str:
    """The whole file, from each resource's report. `wall_offset`: wall clock minus
    monotonic clock (see `WallOffset`), so that an unchanged state renders the same text."""
    f = {}

    def family(name: str, kind: str, help_text: str) -> _Family:
        f[name] = _Family(name, kind, help_text)
        return f[name]

    build = family("atedevd_build_info", "gauge", "atedevd's version, package flavour and the grpcio/protobuf/Python it runs on (always 1).")
    build.add(1, version=info.version, flavour=info.flavour, grpcio=info.grpcio, protobuf=info.protobuf, python=info.python)
    family("atedevd_start_time_seconds", "gauge", "When this atedevd process started, in seconds since the epoch.").add(round(info.started + wall_offset, 3))
    watch = family("atedevd_watch_mode", "gauge", "How atedevd watches kubelet's and the devices' directories: 1 for the mode in use (polling: inotify was refused for at least one directory).")
    watch.add(0 if polling else 1, mode="inotify")
    watch.add(1 if polling else 0, mode="polling")
    family("atedevd_config_last_reload_successful", "gauge", "0 when the last reload (SIGHUP) failed and the previous configuration is still in use, else 1.").add(1 if reload_ok else 0)

    registered = family("atedevd_resource_registered", "gauge", "1 when kubelet streams this resource's devices from atedevd (registered and verified), else 0.")
    state = family("atedevd_resource_state", "gauge", "The resource's registration state: 1 for the current state, 0 for the others.")
    advertised = family("atedevd_resource_units_advertised", "gauge", "Units of the resource atedevd lists to kubelet (0 while nothing is served).")
    healthy = family("atedevd_resource_units_healthy", "gauge", "Units of the resource atedevd lists to kubelet as Healthy.")
    by_health = family("atedevd_resource_units", "gauge", "Units of the resource atedevd lists to kubelet, by health (a pattern's units each have their own).")
    kubelet = family("atedevd_resource_kubelet_allocatable_units", "gauge", "Units of the resource kubelet's pod-resources API last listed as allocatable (absent until asked, or where kubelet has no pod-resources API).")
    changed = family("atedevd_resource_state_change_timestamp_seconds", "gauge", "When the resource's registration state last changed, in seconds since the epoch.")
    regs = family("atedevd_resource_registrations_total", "counter", "Registrations kubelet accepted and verified (the first one and every re-registration).")
    calls = family("atedevd_resource_register_calls_total", "counter", "Register calls sent to kubelet, by why they were sent.")
    allocs = family("atedevd_resource_allocate_calls_total", "counter", "Allocate calls kubelet made for the resource.")
    failures = family("atedevd_resource_allocate_failures_total", "counter", "Allocate calls refused (unknown device IDs, the device node missing).")
    for r in reports:
        name = r.name
        registered.add(1 if r.registered else 0, resource=name)
        for s in State:
            state.add(1 if s is r.state else 0, resource=name, state=s.value)
        advertised.add(r.units, resource=name)
        healthy.add(r.healthy_units, resource=name)
        by_health.add(r.healthy_units, resource=name, health="healthy")
        by_health.add(r.units - r.healthy_units, resource=name, health="unhealthy")
        if r.kubelet_count is not None:
            kubelet.add(r.kubelet_count, resource=name)
        changed.add(round(r.changed_at + wall_offset, 3), resource=name)
        regs.add(r.registrations, resource=name)
        for why in Why:
            calls.add(r.begun.get(why, 0), resource=name, reason=why.value)
        allocs.add(r.allocate_calls, resource=name)
        failures.add(r.allocate_failures, resource=name)
    return "\n".join(fam.text() for fam in f.values()) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return repr(value) if isinstance(value, float) else str(int(value))
