"""TOML configuration -> Config. (Interface stub: full validation lands with the config issue.)"""

import os
import sys
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EX_CONFIG = 78
DEFAULT_CONFIG_PATH = "/etc/atedevd/config.toml"


@dataclass(frozen=True)
class Device:
    """One device node advertised as `count` shareable units of `resource`."""

    resource: str
    path: str
    count: int = 4096
    permissions: str = "rw"


DEFAULT_DEVICES = (Device("ate.dev/kvm", "/dev/kvm"),)


@dataclass(frozen=True)
class Config:
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    dev_root: str = "/dev"
    log_level: str = "info"
    devices: Tuple[Device, ...] = field(default=DEFAULT_DEVICES)
    source: Optional[str] = None  # the file read; None for the built-in defaults


class ConfigError(Exception):
    """Every problem found in one configuration, one line each."""

    def __init__(self, errors):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def load(path: str, required: bool = False, overrides: Optional[Mapping[str, str]] = None) -> Config:
    """Read `path` (built-in defaults when it is missing and not `required`), then apply `overrides`."""
    cfg = Config()
    if os.path.exists(path) or required:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError([f"{path}: {e}"]) from None
        daemon = data.get("daemon", {})
        devices = tuple(Device(**d) for d in data.get("device", [])) or DEFAULT_DEVICES
        cfg = replace(cfg, **daemon, devices=devices, source=path)
    return replace(cfg, **{k: v for k, v in (overrides or {}).items() if v is not None})
