"""`atedevd check` and `atedevd check-config`: can this node serve what is configured?

Read-only and quick, for a human on a node (or a provisioning script): it looks
at the device nodes and the kubelet socket the way the daemon would, without
registering anything. Exit status of `run`: 0 when every configured device is
present as a character device, the plugin directory is writable for the daemon
(in atedevd.service's sandbox, when that unit is loaded) and kubelet accepts
connections, 1 otherwise (EX_NOT_READY). An invalid configuration is the
caller's EX_CONFIG (78).

It also says, for each device, whether a container that does not run as root
could open it (the node keeps its host owner and mode inside the container),
and how to make it so; that does not change the exit status, as root pods need
nothing.
"""

import grp
import os
import pwd
import shutil
import socket
import stat
import subprocess
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from atedevd import config, metrics
from atedevd.config import Config, ConfigError, Device

EX_READY = 0
EX_NOT_READY = 1
SOCKET_TIMEOUT_S = 0.5
UNIT = "atedevd.service"
DEFAULT_PLUGIN_DIR = Config().device_plugin_dir
DROP_IN = "/etc/systemd/system/atedevd.service.d/kubelet-root.conf"


def run(cfg: Config, out: TextIO, unit: Callable[[], Optional[Dict[str, str]]] = None) -> int:
    """Print the node's readiness table to `out`; return EX_READY or EX_NOT_READY.

    `unit` returns atedevd.service's sandbox properties (None: not loaded); by
    default they are asked of systemd.
    """
    unit = unit or unit_properties
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
    _non_root(cfg, out)

    plugin_dir = cfg.device_plugin_dir
    sock = os.path.join(plugin_dir, "kubelet.sock")
    dir_text = _dir_state(plugin_dir)
    sandbox_ok, sandbox_text = sandbox_state(plugin_dir, unit())
    if not sandbox_ok:
        problems.append(f"plugin dir: {sandbox_text}")
    sock_ok, sock_text = socket_state(sock)
    if not sock_ok:
        problems.append(f"kubelet.sock: {sock_text}")
    out.write(_table([("plugin dir", plugin_dir, dir_text), ("sandbox", UNIT, sandbox_text),
                      ("kubelet.sock", sock, sock_text)]) + "\n\n")
    problems += _kubelet_view(cfg, out)

    if problems:
        n = len(problems)
        out.write(f"NOT READY: this node cannot serve every configured resource ({n} problem{'s' if n > 1 else ''}):\n")
        out.writelines(f"  - {p}\n" for p in problems)
        if not sandbox_ok and "sandbox" in sandbox_text:
            out.write(f"\nInstall this drop-in as {DROP_IN}, then: systemctl daemon-reload; "
                      f"systemctl restart {UNIT}\n\n" + drop_in(plugin_dir))
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


# --- non-root containers ---------------------------------------------------------

# The two ways to let a non-root container open a node its host mode keeps from it.
RUNTIME_FIX = """\
  - have the container runtime give the node the pod's runAsUser/runAsGroup, then restart the
    runtime (containers created afterwards get it):
      containerd 1.x: [plugins."io.containerd.grpc.v1.cri"]   device_ownership_from_security_context = true
      containerd 2.x: [plugins."io.containerd.cri.v1.runtime"] device_ownership_from_security_context = true
      CRI-O:          [crio.runtime]                           device_ownership_from_security_context = true
"""


def non_root_access(st: os.stat_result, permissions: str) -> str:
    """Whether a process that is not root could open a node with this owner and mode,
    for `permissions` ("rw" needs read and write; "m" needs neither)."""
    need = (4 if "r" in permissions else 0) | (2 if "w" in permissions else 0)
    mode = stat.S_IMODE(st.st_mode)
    if (mode & need) == need:  # "other"
        return "yes"
    ways = []
    if ((mode >> 3) & need) == need:
        ways.append(f"supplementalGroups: [{st.st_gid}]")
    if ((mode >> 6) & need) == need and st.st_uid != 0:
        ways.append(f"runAsUser: {st.st_uid}")
    return "only with " + " or ".join(ways) if ways else "no"


def _non_root(cfg: Config, out: TextIO) -> None:
    rows = [("RESOURCE", "HOST PATH", "OWNER", "MODE", "NON-ROOT CONTAINER CAN OPEN IT")]
    group_gids = set()
    for dev in cfg.devices:
        host = dev.host_path(cfg.dev_root)
        try:
            st = os.stat(host)
        except OSError:
            continue  # reported above
        if not stat.S_ISCHR(st.st_mode):
            continue
        verdict = non_root_access(st, dev.permissions)
        if verdict.startswith("only") and "supplementalGroups" in verdict:
            group_gids.add(st.st_gid)
        rows.append((dev.resource, host, f"{_user(st.st_uid)}:{_group(st.st_gid)}",
                     f"{stat.S_IMODE(st.st_mode):04o}", verdict))
    if len(rows) == 1:
        return
    out.write("Inside a container a device node keeps its host owner and mode, so a pod that runs as a\n"
              "non-root user opens it only if that mode lets it (a root pod always can):\n")
    out.write(_table(rows) + "\n\n")
    if all(r[4] == "yes" for r in rows[1:]):
        return
    gid = str(group_gids.pop()) if len(group_gids) == 1 else "<the node's gid>"
    out.write("For non-root pods, do one of:\n" + RUNTIME_FIX
              + "  - or make the host node 0660 root:kvm (e.g. a udev rule) and give the pod\n"
              f"    securityContext.supplementalGroups: [{gid}] (numeric: the image's /etc/group does not count)\n\n")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


# --- the plugin directory in atedevd.service's sandbox ------------------------------

def unit_properties() -> Optional[Dict[str, str]]:
    """atedevd.service's sandbox settings from systemd; None when there is no systemd or no such unit."""
    if shutil.which("systemctl") is None:
        return None
    try:
        p = subprocess.run(["systemctl", "show", UNIT, "-p", "LoadState", "-p", "ProtectSystem", "-p", "ReadWritePaths"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    props = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
    if p.returncode != 0 or props.get("LoadState") != "loaded":
        return None
    return props


def sandbox_state(plugin_dir: str, props: Optional[Dict[str, str]]) -> Tuple[bool, str]:
    """(ok, words): may the daemon create its sockets in `plugin_dir`, as the unit runs it?"""
    if os.path.isdir(plugin_dir) and not os.access(plugin_dir, os.W_OK):
        return False, f"{plugin_dir} is not writable (a read-only mount?)"
    if props is None:
        return True, f"unknown ({UNIT} is not loaded here)"
    if props.get("ProtectSystem") != "strict":
        return True, f"{plugin_dir} writable (ProtectSystem={props.get('ProtectSystem') or 'no'})"
    rw = [p.lstrip("-+") for p in props.get("ReadWritePaths", "").split()]
    target = os.path.normpath(plugin_dir)
    if any(target == p or target.startswith(p.rstrip("/") + "/") for p in rw if p):
        return True, f"{plugin_dir} writable (ReadWritePaths=)"
    listed = " ".join(rw) or "nothing"
    return False, (f"{plugin_dir} is read-only in {UNIT}'s sandbox (ProtectSystem=strict; "
                   f"ReadWritePaths= has {listed}): atedevd could not create its sockets there")


def drop_in(plugin_dir: str) -> str:
    """The drop-in that lets atedevd.service serve in a kubelet plugin directory other than the default."""
    return (f"# {DROP_IN}\n"
            "# kubelet's device plugin directory is not /var/lib/kubelet/device-plugins on this node\n"
            "# (k0s: /var/lib/k0s/kubelet/device-plugins; microk8s:\n"
            "# /var/snap/microk8s/common/var/lib/kubelet/device-plugins; kubelet --root-dir=R: R/device-plugins).\n"
            "# Set the same directory as device_plugin_dir in /etc/atedevd/config.toml.\n"
            "[Service]\n"
            "# Replace the default directory's mkdir and sandbox exception with this one's.\n"
            "ExecStartPre=\n"
            f"ExecStartPre=+/bin/mkdir -p -m 0750 {plugin_dir}\n"
            "ReadWritePaths=\n"
            f"ReadWritePaths=-{plugin_dir}\n"
            "# The unit's other exception, kept: node_exporter's textfile directory (atedevd.prom).\n"
            f"ReadWritePaths=-{metrics.DEFAULT_DIR}\n")


def kubelet_counts(socket_path: str, timeout: float = 2.0) -> Dict[str, int]:
    """{resource: device IDs kubelet holds allocatable}, from its pod-resources API.
    Raises OSError when there is no answer."""
    import grpc  # only here: the rest of `check` needs no gRPC

    from atedevd.api import PodResourcesStub, prpb
    from atedevd.kubelet import allocatable_ids

    channel = grpc.insecure_channel("unix:" + socket_path, options=[("grpc.default_authority", "localhost")])
    try:
        resp = PodResourcesStub(channel).GetAllocatableResources(prpb.AllocatableResourcesRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise OSError(f"{e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    return {name: len(found) for name, found in allocatable_ids(resp).items()}


def _kubelet_view(cfg: Config, out: TextIO) -> List[str]:
    """What kubelet itself counts, next to what we advertise: the one place a
    registration that kubelet silently stopped honouring shows."""
    from atedevd.kubelet import pod_resources_socket  # imports grpc: only when `check` gets here

    path = pod_resources_socket(cfg.device_plugin_dir)
    if not os.path.exists(path):
        out.write(f"kubelet's view: no pod-resources API at {path}; not shown\n\n")
        return []
    try:
        counts = kubelet_counts(path)
    except OSError as e:
        out.write(f"kubelet's view: {path} did not answer ({e}); not shown\n\n")
        return []
    rows = [("RESOURCE", "WE ADVERTISE", "KUBELET ALLOCATABLE", "")]
    problems = []
    for dev in cfg.devices:
        ours = dev.count if device_state(dev.host_path(cfg.dev_root))[2] else 0
        theirs = counts.get(dev.resource, 0)
        if theirs == ours:
            verdict = "match"
        else:
            verdict = "MISMATCH"
            why = "is atedevd running and registered?" if theirs == 0 else "kubelet's list is out of date"
            problems.append(f"{dev.resource}: kubelet counts {theirs} allocatable, we advertise {ours} healthy ({why})")
        rows.append((dev.resource, str(ours), str(theirs), verdict))
    out.write(f"kubelet's view (pod-resources {path}):\n{_table(rows)}\n\n")
    return problems


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
