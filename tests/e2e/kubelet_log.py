"""What kubelet's own log says about a device plugin resource, as timed lines.

kubelet (klog text, -v=4) stamps each line with the wall clock to the microsecond. The lines the
suite reads, as kubelet 1.32 to 1.37 write them (pkg/kubelet/cm/devicemanager):

    "Starting device plugin registration server"            kubelet serves kubelet.sock (a start)
    "Got registration request from device plugin with resource" resourceName=R      a Register arrives
    "Registered client" name=R [socketPath=...]            the client is stored (by name, or name and path)
    "Connected to new client" / "Device plugin connected"  the dial-back and options are done
    "State pushed for device plugin" resource=R            a ListAndWatch message received
    "Processed device updates for resource" resourceName=R totalCount=N healthyCount=H
    "ListAndWatch ended unexpectedly for device plugin"     our stream ended
    "Mark all resources Unhealthy for resource" resourceName=R   every unit Unhealthy: pods are rejected
    "Deregistered client", "Device plugin disconnected"     the client let go of
    "SyncLoop ADD" source="api" pods=[ns/name]             kubelet took a pod in (admission follows)

A resource is *rejecting* from "Mark all resources Unhealthy" (or a kubelet start's registration
server, when the checkpoint brings it back with no healthy unit) until the next "Processed device
updates" with healthyCount > 0.
"""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

_HEAD = re.compile(r"^([IWEF])(\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6})\s+\d+ (\S+?)\] (.*)$")
_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\[[^\]]*\]|\S+)')

SERVER = "Starting device plugin registration server"
REGISTER = "Got registration request from device plugin with resource"
REGISTERED = "Registered client"
CONNECTED = ("Connected to new client", "Device plugin connected")
PUSHED = "State pushed for device plugin"
PROCESSED = "Processed device updates for resource"
STREAM_ENDED = "ListAndWatch ended unexpectedly for device plugin"
UNHEALTHY = "Mark all resources Unhealthy for resource"
DEREGISTERED = "Deregistered client"
DISCONNECTED = "Device plugin disconnected"
SYNC_ADD = "SyncLoop ADD"


@dataclass
class Line:
    at: float  # seconds since the epoch (kubelet's wall clock, UTC)
    level: str
    source: str
    message: str
    kv: Dict[str, str] = field(default_factory=dict)

    def resource(self) -> Optional[str]:
        for k in ("resourceName", "resource", "name", "plugin"):
            if k in self.kv:
                return self.kv[k]
        return None


def _year() -> int:
    return datetime.datetime.now(datetime.timezone.utc).year


def parse(lines: Sequence[str]) -> List[Line]:
    out = []
    year = _year()
    for raw in lines:
        m = _HEAD.match(raw)
        if not m:
            continue
        level, mo, d, hh, mm, ss, us, source, rest = m.groups()
        at = datetime.datetime(year, int(mo), int(d), int(hh), int(mm), int(ss), int(us),
                               tzinfo=datetime.timezone.utc).timestamp()
        if rest.startswith('"'):
            end = rest.find('"', 1)
            while end > 0 and rest[end - 1] == "\\":
                end = rest.find('"', end + 1)
            message, tail = rest[1:end], rest[end + 1:]
        else:
            message, tail = rest, ""
        kv = {k: v.strip('"') for k, v in _KV.findall(tail)}
        out.append(Line(at, level, source, message, kv))
    return out


class KubeletLog:
    """The device manager's story of one resource, from parsed lines."""

    def __init__(self, lines: List[Line], resource: str = "ate.dev/kvm"):
        self.lines = lines
        self.resource = resource

    def of(self, message, since: float = 0.0, until: float = float("inf"), resource: bool = True) -> List[Line]:
        messages = (message,) if isinstance(message, str) else tuple(message)
        return [ln for ln in self.lines if ln.message in messages and since <= ln.at <= until
                and (not resource or ln.resource() == self.resource)]

    def healthy_lists(self, since: float = 0.0, until: float = float("inf")) -> List[Line]:
        return [ln for ln in self.of(PROCESSED, since, until) if int(ln.kv.get("healthyCount", "0")) > 0]

    def windows(self, since: float = 0.0, until: float = float("inf")) -> List[Tuple[float, float, float]]:
        """Each span in which kubelet could not allocate the resource: (start, healthy, settled).

        It opens when our stream ends and kubelet then marks every unit Unhealthy (a pod taken in
        between is rejected too: its Allocate goes to the closing connection), when kubelet starts
        (its checkpoint brings the resource back with no healthy unit), or with a list of no
        healthy unit. It closes when kubelet receives a list with healthy units ("State pushed":
        a pod taken in from then on is allocated from it) and is settled once kubelet says it
        processed that list; between the two a pod may fall either way. Only a list from a
        registration that came after the window opened closes it: on kubelet 1.32-1.36 an older
        stream's teardown, by name, takes a newer client down and stops its endpoint, and a list
        that client had sent is then logged as processed, healthy, while every pod is rejected ("no
        healthy devices", or "endpoint ... has been stopped") until the plugin registers again."""
        ended = [ln.at for ln in self.of(STREAM_ENDED, since, until)]
        marks = []
        for ln in self.of(UNHEALTHY, since, until):
            before = [t for t in ended if ln.at - 1.0 <= t <= ln.at]
            marks.append((before[-1] if before else ln.at, "down"))
        marks += [(ln.at, "down") for ln in self.of(SERVER, since, until, resource=False)]
        pushed = [ln.at for ln in self.of(PUSHED, since, until)]
        registered = [ln.at for ln in self.of(REGISTER, since, until)]
        for ln in self.of(PROCESSED, since, until):
            if int(ln.kv.get("healthyCount", "0")) > 0:
                before = [t for t in pushed if ln.at - 1.0 <= t <= ln.at]
                marks.append((ln.at, "up", before[-1] if before else ln.at))
            else:
                marks.append((ln.at, "down"))
        spans, opened = [], None
        for mark in sorted(marks, key=lambda m: (m[0], m[1] != "down")):
            if mark[1] == "down" and opened is None:
                opened = mark[0]
            elif mark[1] == "up" and opened is not None and any(opened <= r <= mark[2] for r in registered):
                spans.append((opened, mark[2], mark[0]))
                opened = None
        if opened is not None:
            spans.append((opened, float("inf"), float("inf")))
        return spans

    def registers(self, since: float = 0.0, until: float = float("inf")) -> int:
        return len(self.of(REGISTER, since, until))

    def admitted_at(self, pod: str, since: float = 0.0) -> Optional[float]:
        """When kubelet first took pod `pod` (name) in from the API after `since`."""
        for ln in self.lines:
            if ln.message == SYNC_ADD and ln.at >= since and ln.kv.get("source") == "api" \
                    and re.search(rf'/{re.escape(pod)}(?=["\],\s]|$)', ln.kv.get("pods", "")):
                return ln.at
        return None


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def spread(values: Sequence[float]) -> str:
    """'min / median / max' of values in ms, or 'none'."""
    if not values:
        return "none"
    v = sorted(values)
    mid = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    return f"{ms(v[0])} / {ms(mid)} / {ms(v[-1])} ms"


WANTED = (SERVER, REGISTER, REGISTERED, *CONNECTED, PUSHED, PROCESSED, STREAM_ENDED, UNHEALTHY, DEREGISTERED,
          DISCONNECTED, SYNC_ADD, "Endpoint became unhealthy", "Last device plugin for this resource disconnected")


class Follower:
    """kubelet's log files read as they grow: only the lines this module knows are parsed, so
    that a test can look every millisecond without re-reading megabytes of -v=4."""

    def __init__(self, paths):
        self._paths = paths  # () -> the log files, oldest first
        self._state: Dict[str, Tuple[int, str]] = {}
        self._lines: List[Line] = []

    def lines(self) -> List[Line]:
        for path in self._paths():
            offset, partial = self._state.get(str(path), (0, ""))
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            text = partial + data.decode(errors="replace")
            complete, _, rest = text.rpartition("\n")
            self._state[str(path)] = (offset + len(data), rest)
            if complete:
                self._lines += parse([ln for ln in complete.split("\n") if any(w in ln for w in WANTED)])
        return self._lines
