"""`atedevd check` and `atedevd check-config`: can this node serve what is configured?

Read-only and quick, for a human on a node (or a provisioning script): it looks
at the device nodes and the kubelet socket the way the daemon would, without
registering anything. Exit status of `run`: 0 when every configured device is
present as a character device and kubelet accepts connections, 1 otherwise
(EX_NOT_READY). An invalid configuration is the caller's EX_CONFIG (78).
"""

import os
import socket
import stat
from typing import List, Optional, Sequence, TextIO, Tuple

from atedevd import config
from atedevd.config import Config, ConfigError, Device

EX_READY = 0
EX_NOT_READY = 1
SOCKET_TIMEOUT_S = 0.5


def run(cfg: Config, out: TextIO) -> int:
    """Print the node's readiness table to `out`; return EX_READY or EX_NOT_READY."""
    problems: List[str] = []
    source = cfg.source or "built-in defaults"
    out.write(f"config: {source}\ndev root: {cfg.dev_root}\n\n")

    rows = [("RESOURCE", "PATH", "HOST PATH", "PRESENT", "TYPE", "UNITS")]
    for dev in cfg.devices:
        host = dev.host_path(cfg.dev_root)
        present, what, ok = device_state(host)
        rows.append((dev.resource, dev.path, host, present, what, _units(dev)))
        if not ok:
            problems.append(f"{dev.resource}: {host}: {what}")
    out.write(_table(rows) + "\n\n")

    plugin_dir = cfg.device_plugin_dir
    sock = os.path.join(plugin_dir, "kubelet.sock")
    dir_text = _dir_state(plugin_dir)
    sock_ok, sock_text = socket_state(sock)
    if not sock_ok:
        problems.append(f"kubelet.sock: {sock_text}")
    out.write(_table([("plugin dir", plugin_dir, dir_text), ("kubelet.sock", sock, sock_text)]) + "\n\n")

    if problems:
        n = len(problems)
        out.write(f"NOT READY: this node cannot serve every configured resource ({n} problem{'s' if n > 1 else ''}):\n")
        out.writelines(f"  - {p}\n" for p in problems)
        return EX_NOT_READY
    names = ", ".join(d.resource for d in cfg.devices)
    out.write(f"READY: this node can serve {names}\n")
    return EX_READY


def check_config(path: str, out: TextIO, required: bool = False, err: Optional[TextIO] = None) -> int:
    """`atedevd check-config`: validate without running; 0, or EX_CONFIG with every error on `err`."""
    try:
        cfg = config.load(path, required=required)
    except ConfigError as e:
        (err or out).write(f"{e}\nconfig INVALID: {len(e.errors)} error{'s' if len(e.errors) != 1 else ''}\n")
        return config.EX_CONFIG
    n = len(cfg.devices)
    what = cfg.source or f"built-in defaults ({path} not found)"
    out.write(f"config OK: {what}, {n} device{'s' if n != 1 else ''}\n")
    return 0


def device_state(host_path: str) -> Tuple[str, str, bool]:
    """(present, type in words, usable). Follows symlinks, as opening the node would."""
    try:
        st = os.stat(host_path)
    except FileNotFoundError:
        return "no", "missing", False
    except OSError as e:  # EACCES, ENOTDIR, ELOOP, ...
        return "?", f"cannot stat: {e.strerror or e}", False
    if stat.S_ISCHR(st.st_mode):
        return "yes", f"char device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}", True
    return "yes", f"{config.file_type(st.st_mode)}, not a char device", False


def socket_state(path: str, timeout: float = SOCKET_TIMEOUT_S) -> Tuple[bool, str]:
    """(reachable, words): is something accepting connections on this unix socket?

    A plain connect tells a live kubelet from the stale socket a killed one leaves.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False, "missing (kubelet not running, or another device plugin directory)"
    except OSError as e:
        return False, f"cannot stat: {e.strerror or e}"
    if not stat.S_ISSOCK(st.st_mode):
        return False, f"not a socket ({config.file_type(st.st_mode)})"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True, "accepting connections"
    except ConnectionRefusedError:
        return False, "stale: refusing connections (kubelet not running)"
    except socket.timeout:
        return False, f"not answering (no connection within {timeout:g} s)"
    except OSError as e:
        return False, f"cannot connect: {e.strerror or e}"
    finally:
        s.close()


def _dir_state(path: str) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot stat: {e.strerror or e}"
    return "present" if stat.S_ISDIR(st.st_mode) else f"not a directory ({config.file_type(st.st_mode)})"


def _units(dev: Device) -> str:
    return f"{dev.count} ({dev.unit_id(0)}..{dev.unit_id(dev.count - 1)})" if dev.count > 1 else f"1 ({dev.unit_id(0)})"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
