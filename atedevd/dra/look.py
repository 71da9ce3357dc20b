"""The configured devices as DRA lists them: each `[[device]]` judged by the tables of the
device-plugin mode (atedevd/devices: the same policy, invariants and trust rules), its CDI spec
written (atedevd/cdi) before a device naming it is listed. The daemon's loop and the
simulation both look through a `Look`.
"""

import logging
from typing import Callable, Dict, List, Optional, Tuple

from atedevd.cdi import keeper as cdi_keeper
from atedevd.config import Config
from atedevd.devices.claims import Claims
from atedevd.dra.slices import DraDevice, device_name
from atedevd.glue.resource import node_table

ERROR = logging.ERROR


class Look:
    def __init__(self, cfg: Config, say: Callable[..., None]) -> None:
        self.cfg = cfg
        self.say = say
        self.claims = Claims()
        self.claims.configure(cfg.devices, cfg.dev_root)
        self.tables = {d.resource: node_table(d, cfg.dev_root, cfg.sys_root, self.claims) for d in cfg.devices}
        self.specs = cdi_keeper.Specs(say)
        self.specs.configure(cfg._replace(cdi=True, device_specs=False))
        self.keepers = {d.resource: self.specs.keeper(d.resource) for d in cfg.devices}
        self._version = 0
        self._named: Dict[str, str] = {}  # a device name -> the resource that has it (said once)

    def directories(self) -> List[str]:
        """Where the nodes are: a change there may change the devices."""
        return sorted({p for t in self.tables.values() for p in t.directories()})

    def look(self, first: bool = False) -> Optional[Tuple[DraDevice, ...]]:
        """The devices now, or None when nothing changed since the last look."""
        changed = first
        for d in self.cfg.devices:
            changes, news = self.tables[d.resource].look(True)
            for ch in changes:
                self.say(ch.level, ch.event, f"{d.resource}: {ch.message}", resource=d.resource,
                         device=ch.device or d.path)
            changed |= news
        if not changed:
            return None
        self._version += 1
        return tuple(self._judged())

    def _judged(self) -> List[DraDevice]:
        """Every device that may be listed now: healthy as its table judged it, and its CDI names on
        disk (a device whose spec could not be written is not listed: no claim could use it)."""
        out: List[DraDevice] = []
        seen: Dict[str, str] = {}
        for d in self.cfg.devices:
            snap = self.tables[d.resource].snapshot(self._version)
            keeper = self.keepers[d.resource]
            keeper.publish(snap, d)
            for key, nodes in snap.grants().items():
                ids = keeper.names(() if key is None else (key,))
                if not ids or not nodes:
                    continue
                name = device_name(d.resource, key)
                if name in seen:
                    if self._named.get(name) != d.resource:
                        self._named[name] = d.resource
                        self.say(ERROR, "dra-device-name", f"{d.resource}: device name {name} is {seen[name]}'s "
                                                           "already; not listed", resource=d.resource)
                    continue
                seen[name] = d.resource
                out.append(DraDevice(name, d.resource, nodes[0].path, key is None, tuple(ids),
                                     tuple(snap.numa(key)) if key is not None else (),
                                     capacity=d.count if key is None else 0))
        return out

    def wake(self, now: float) -> None:
        """The CDI specs' own timers (a spec someone removed is written again)."""
        self.specs.wake(now)
