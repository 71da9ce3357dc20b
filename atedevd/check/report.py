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

import json
import os
import shutil
import socket
import stat
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from atedevd import config
from atedevd.config import Config, Device
from atedevd.config_file import load as loader
from atedevd.config_file.load import ConfigError
from atedevd.daemon import textfile
from atedevd.kubelet import sockets
from atedevd.trust import group_name as _group
from atedevd.trust import user_name as _user

EX_READY = 0
EX_NOT_READY = 1
SOCKET_TIMEOUT_S = 0.5
UNIT = "atedevd.service"
DEFAULT_PLUGIN_DIR = Config().device_plugin_dir
DROP_IN = "/etc/systemd/system/atedevd.service.d/kubelet-root.conf"


SCHEMA = "atedevd-check/v1"  # `check --json`: bumped only on a change that breaks readers (docs/check-json.md)
OK, PROBLEM, WARNING = "ok", "problem", "warning"  # a finding's status; only problems change the exit status


@dataclass
class Finding:
    """One thing `check` looked at: its verdict in words, and the fix when there is one."""

    check: str  # what was checked: device, char-link, non-root, pod-kind, runtime, cdi-spec-dir, plugin-dir, sandbox, kubelet-socket, kubelet-count
    subject: str  # the resource, or the path checked
    status: str  # OK, PROBLEM (NOT READY) or WARNING (said, exit status unchanged)
    message: str
    fix: Optional[str] = None


@dataclass
class NodeReport:
    """Everything `check` found, before it is printed as a table or as JSON."""

    config: Optional[str]
    dev_root: str
    plugin_dir: str
    devices: List[dict] = field(default_factory=list)
    findings: List[Finding] = field(default_factory=list)
    kubelet_view: dict = field(default_factory=dict)
    drop_in: Optional[str] = None

    @property
    def problems(self) -> List[Finding]:
        return [f for f in self.findings if f.status == PROBLEM]

    @property
    def exit_code(self) -> int:
        return EX_NOT_READY if self.problems else EX_READY

    def add(self, check: str, subject: str, status: str, message: str, fix: Optional[str] = None) -> Finding:
        f = Finding(check, subject, status, message, fix)
        self.findings.append(f)
        return f


def run(cfg: Config, out: TextIO, unit: Optional[Callable[[], Optional[Dict[str, str]]]] = None, as_json: bool = False,
        runtimes: Optional[Callable[[], list]] = None) -> int:
    """Print the node's readiness (a table, or JSON) to `out`; return EX_READY or EX_NOT_READY.

    `unit` returns atedevd.service's sandbox properties (None: not loaded); by
    default they are asked of systemd. `runtimes` returns the container runtimes'
    settings (atedevd/check/runtimes.py); by default their configuration files are read.
    """
    report = collect(cfg, unit or unit_properties, runtimes)
    if as_json:
        out.write(to_json(report))
    else:
        render_text(report, out)
    return report.exit_code


def collect(cfg: Config, unit: Callable[[], Optional[Dict[str, str]]], runtimes: Optional[Callable[[], list]] = None) -> NodeReport:
    """Look at the node: every finding as data."""
    from atedevd.check import pods as pod_checks
    from atedevd.check import runtimes as runtime_files  # only for `check`

    report = NodeReport(cfg.source, cfg.dev_root, cfg.device_plugin_dir)
    if cfg.api == "dra":
        cfg = cfg._replace(cdi=True, device_specs=False)  # DRA grants through CDI alone
    found = (runtimes or runtime_files.read)()
    for r in found:
        for problem in r.problems:  # what the verdicts below could not take into account
            report.add("runtime", r.name, WARNING, problem, f"mend {problem.split(':', 1)[0]}; until then the pod "
                       "kinds below take that runtime's defaults")
    for dev in cfg.devices:
        _check_device(cfg, dev, report)
        pod_checks.add(cfg, dev, report, found)
    for resource, status, line in host_access_findings(cfg) + pattern_findings(cfg):
        report.add("device-policy", resource, status, line)
    plugin_dir = cfg.device_plugin_dir
    if cfg.api == "dra":  # kubelet's device-plugin side is not ours in this mode
        from atedevd.check import dra

        props = unit()
        dra.add(cfg, report, props, sandbox_state)
        pod_checks.spec_dir(cfg, props, report)
        return report
    report.add("plugin-dir", plugin_dir, OK, _dir_state(plugin_dir))  # missing: the daemon waits for it
    props = unit()
    sandbox_ok, sandbox_text = sandbox_state(plugin_dir, props)
    if not sandbox_ok and "sandbox" in sandbox_text:
        report.drop_in = drop_in(plugin_dir)
    report.add("sandbox", UNIT, OK if sandbox_ok else PROBLEM, sandbox_text,
               fix=f"install the drop-in as {DROP_IN}, then: systemctl daemon-reload; systemctl restart {UNIT}"
               if report.drop_in else None)
    if cfg.cdi:
        pod_checks.spec_dir(cfg, props, report)
    metrics_dir = textfile.resolve_dir(cfg.metrics_dir)
    status, text = metrics_state(cfg.metrics_dir, props)
    report.add("metrics", metrics_dir or "", status, text,
               fix=f"set metrics_dir in {cfg.source or config.DEFAULT_CONFIG_PATH} to a directory node_exporter reads "
               f"(--collector.textfile.directory) and {UNIT} may write (ReadWritePaths=)" if status != OK else None)
    sock = os.path.join(plugin_dir, "kubelet.sock")
    sock_ok, sock_text = socket_state(sock)
    report.add("kubelet-socket", sock, OK if sock_ok else PROBLEM, sock_text)
    if sock_ok:
        _kubelet_version(cfg, sock, report)
    _kubelet_view(cfg, report)
    return report


def _check_device(cfg: Config, dev: Device, report: NodeReport) -> None:
    if dev.pattern:
        _check_pattern(cfg, dev, report)
        return
    host = dev.host_path(cfg.dev_root)
    present, what, ok = device_state(host)
    row: Dict[str, Any] = {"resource": dev.resource, "path": dev.path, "host_path": host, "present": present == "yes",
           "type": what, "units": dev.count, "unit_ids": _units(dev), "device_number": None,
           "uid": None, "gid": None, "owner": None, "mode": None, "non_root": None, "char_link": None,
           "nodes": node_rows(cfg, dev)}
    for n in row["nodes"]:
        if n["role"] == "companion" and n["state"] != "ok":  # no unit is Healthy without it
            report.add("device", dev.resource, PROBLEM, f"companion {n['host_path']}: {n['state']}")
        elif n["role"] == "node" and n["state"].startswith("claimed"):  # a pattern of another resource has it
            report.add("device", dev.resource, PROBLEM, f"{host}: {n['state']}")
    report.devices.append(row)
    report.add("device", dev.resource, OK if ok else PROBLEM, f"{host}: {what}")
    if not ok:
        return
    st = os.stat(host)
    number = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    row.update(device_number=number, uid=st.st_uid, gid=st.st_gid, owner=f"{_user(st.st_uid)}:{_group(st.st_gid)}",
               mode=f"{stat.S_IMODE(st.st_mode):04o}", non_root=non_root_access(st, dev.permissions))
    link_ok, link_text, link_fix = char_link_state(cfg.dev_root, host, st)
    row["char_link"] = os.path.join(cfg.dev_root, "char", number)
    report.add("char-link", dev.resource, OK if link_ok else WARNING, link_text, link_fix)
    report.add("non-root", dev.resource, OK if row["non_root"] == "yes" else WARNING,
               f"a non-root container can open {host}: {row['non_root']}",
               None if row["non_root"] == "yes" else
               "device_ownership_from_security_context = true in the container runtime (containerd, CRI-O), "
               "or make the node 0660 root:kvm and give the pod supplementalGroups: [<its gid>]")


def _check_pattern(cfg: Config, dev: Device, report: NodeReport) -> None:
    """A pattern's units, one per matching node: ready when at least one can be served."""
    nodes = node_rows(cfg, dev)
    units = [n for n in nodes if n["role"] == "unit"]
    companions = [n for n in nodes if n["role"] == "companion" and n["state"] != "ok"]  # no unit is Healthy without them
    healthy = [n for n in units if n["state"] == "ok" and not companions]
    matched = sum(1 for n in nodes if n["role"] != "companion")
    ids = ", ".join(n["id"] for n in healthy[:4]) + (f", ... ({len(healthy)})" if len(healthy) > 4 else "")
    row = {"resource": dev.resource, "path": dev.path, "host_path": dev.host_path(cfg.dev_root), "present": bool(units),
           "type": f"pattern: {_n(matched, 'node')} match{'es' if matched == 1 else ''}, {_n(len(units), 'unit')}",
           "units": len(healthy),
           "unit_ids": f"{len(healthy)} ({ids})" if healthy else "0", "device_number": None, "uid": None, "gid": None,
           "owner": None, "mode": None, "non_root": None, "char_link": None, "nodes": nodes}
    report.devices.append(row)
    for n in companions:
        report.add("device", dev.resource, PROBLEM, f"companion {n['host_path']}: {n['state']}")
    if healthy:
        report.add("device", dev.resource, OK, f"{row['host_path']}: {_n(len(healthy), 'unit')}")
    elif not units:
        report.add("device", dev.resource, PROBLEM,
                   f"{row['host_path']}: no node can be served (none matches, or every match is refused)")
    elif not companions:
        report.add("device", dev.resource, PROBLEM, f"{row['host_path']}: no unit can be served")


def node_rows(cfg: Config, dev: Device) -> List[dict]:
    """Every node the device reaches (a pattern's matches, its node, its companions), judged
    as the daemon judges them at its start: ID, major:minor, NUMA node, present, allowed,
    and whether another configured resource reaches it too (atedevd/devices/claims.py)."""
    from atedevd.devices.claims import Claims
    from atedevd.glue.resource import node_table

    claims = Claims()
    claims.configure(cfg.devices, cfg.dev_root)
    table = node_table(dev, cfg.dev_root, cfg.sys_root, claims)
    table.look()  # what it would log is what these rows say
    return [dict(row._asdict(), numa=list(row.numa), pci=list(row.pci)) for row in table.listing()]


def pattern_findings(cfg: Config) -> List[Tuple[str, str, str]]:
    """(resource, status, line) per node a pattern matches but will not serve: refused by the
    device policy, the same node as another unit, or a node another resource reaches too.
    Said, never a problem: the others are served."""
    out = []
    for dev in cfg.devices:
        if not dev.pattern:
            continue
        for n in node_rows(cfg, dev):
            if n["role"] == "match" and n["present"]:
                out.append((dev.resource, WARNING, f"WARNING: {dev.resource}: {dev.path} matches {n['host_path']} "
                            f"({n['device_number']}), not advertised: {n['state']}"))
    return out


def render_text(report: NodeReport, out: TextIO) -> None:
    """The table a person reads."""
    out.write(f"config: {report.config or 'built-in defaults'}\ndev root: {report.dev_root}\n\n")
    rows = [("RESOURCE", "PATH", "HOST PATH", "PRESENT", "TYPE", "UNITS")]
    for d in report.devices:
        present = "yes" if d["present"] else ("no" if d["type"] == "missing" or d["type"].startswith("pattern") else "?")
        rows.append((d["resource"], d["path"], d["host_path"], present, d["type"], d["unit_ids"]))
    out.write(_table(rows) + "\n\n")
    _render_nodes(report, out)
    _render_non_root(report, out)
    _render_pods(report, out)
    _render_host_access([f.message for f in report.findings if f.check == "device-policy"], out)
    by_check = {f.check: f for f in report.findings if f.check in ("plugin-dir", "sandbox", "kubelet-socket")}
    out.write(_table([("plugin dir", report.plugin_dir, by_check["plugin-dir"].message),
                      ("sandbox", UNIT, by_check["sandbox"].message),
                      ("kubelet.sock", by_check["kubelet-socket"].subject, by_check["kubelet-socket"].message)]) + "\n\n")
    view = report.kubelet_view
    if view.get("counts") is None:
        out.write(f"kubelet's view: {view['note']}; not shown\n\n")
    else:
        counts = [("RESOURCE", "WE ADVERTISE", "KUBELET ALLOCATABLE", "")]
        counts += [(r, str(c["ours"]), str(c["kubelet"]), "match" if c["ours"] == c["kubelet"] else "MISMATCH")
                   for r, c in view["counts"].items()]
        out.write(f"kubelet's view (pod-resources {view['socket']}):\n{_table(counts)}\n\n")
    for f in report.findings:
        if f.check == "metrics" and f.status != OK:
            out.write(f"WARNING: metrics: {f.message}\n  fix: {f.fix}\n\n")
    links = [f for f in report.findings if f.check == "char-link" and f.status != OK]
    if links:
        out.write("WARNING: under the systemd cgroup driver, runc hands a container's device rules to systemd as\n"
                  "DeviceAllow=/dev/char/MAJOR:MINOR, applied again on every systemctl daemon-reload; where the\n"
                  "link is missing, running containers can lose the device:\n")
        out.writelines(f"  - {f.subject}: {f.message}\n    fix: {f.fix}\n" for f in links)
        out.write("\n")
    problems = report.problems
    if problems:
        n = len(problems)
        out.write(f"NOT READY: this node cannot serve every configured resource ({n} problem{'s' if n > 1 else ''}):\n")
        out.writelines(f"  - {_problem_text(f)}\n" for f in problems)
        if report.drop_in:
            out.write(f"\nInstall this drop-in as {DROP_IN}, then: systemctl daemon-reload; "
                      f"systemctl restart {UNIT}\n\n" + report.drop_in)
        return
    names = ", ".join(d["resource"] for d in report.devices)
    out.write(f"READY: this node can serve {names}\n")


def _render_nodes(report: NodeReport, out: TextIO) -> None:
    """Per pattern resource (or a device with companions): every node it reaches."""
    for d in report.devices:
        nodes = d["nodes"]
        if not any(n["role"] in ("unit", "match", "companion") for n in nodes):
            continue
        rows = [("ID", "PATH", "MAJ:MIN", "NUMA", "PCI", "PRESENT", "ALLOWED", "STATE")]
        for n in nodes:
            rows.append((n["id"] or ("(companion)" if n["role"] == "companion" else "-"), n["path"],
                         n["device_number"] or "-", ",".join(map(str, n["numa"])) or "-", ",".join(n["pci"]) or "-",
                         "yes" if n["present"] else "no", "yes" if n["allowed"] else "no", n["state"]))
        if len(rows) == 1:
            rows.append(("-", "(no node matches)", "-", "-", "-", "-", "-", "-"))
        out.write(f"{d['resource']} ({d['path']}):\n{_table(rows)}\n\n")


def _render_pods(report: NodeReport, out: TextIO) -> None:
    """Per device, every pod kind: does it open the node, why, and the fix (atedevd/check/pod_kinds.py)."""
    from atedevd.check.pod_kinds import TITLES

    for d in report.devices:
        if not d.get("pods"):
            continue
        rows = [("POD KIND", "OPENS IT", "WHY")]
        rows += [(TITLES[p["kind"]], p["opens"], p["why"]) for p in d["pods"]]
        out.write(f"Which pods can open {d['resource']} ({d['path']}):\n{_table(rows)}\n")
        out.writelines(f"  fix for {TITLES[p['kind']]}: {p['fix']}\n" for p in d["pods"] if p["opens"] != "yes" and p["fix"])
        out.write("\n")


def _problem_text(f: Finding) -> str:
    prefix = {"sandbox": "plugin dir", "kubelet-socket": "kubelet.sock"}.get(f.check, f.subject)
    return f"{prefix}: {f.message}"


def to_json(report: NodeReport) -> str:
    """`check --json`: a stable document for fleet tools (docs/check-json.md)."""
    doc = {
        "schema": SCHEMA,
        "ready": not report.problems,
        "exit_code": report.exit_code,
        "config": report.config,
        "dev_root": report.dev_root,
        "plugin_dir": report.plugin_dir,
        "devices": [{k: v for k, v in d.items() if k != "unit_ids"} for d in report.devices],
        "kubelet_view": report.kubelet_view,
        "findings": [{"check": f.check, "subject": f.subject, "status": f.status, "message": f.message, "fix": f.fix}
                     for f in report.findings],
        "drop_in": report.drop_in,
    }
    return json.dumps(doc, indent=2) + "\n"


def config_error_json(e: ConfigError) -> str:
    """`check --json` when the configuration is invalid (exit status EX_CONFIG)."""
    return json.dumps({"schema": SCHEMA, "ready": False, "exit_code": config.EX_CONFIG, "config_errors": e.errors},
                      indent=2) + "\n"


def check_config(path: str, out: TextIO, required: bool = False, err: Optional[TextIO] = None) -> int:
    """`atedevd check-config`: validate without running; 0, or EX_CONFIG with every error on `err`."""
    try:
        cfg = loader.load(path, required=required)
    except ConfigError as e:
        (err or out).write(f"{e}\nconfig INVALID: {len(e.errors)} error{'s' if len(e.errors) != 1 else ''}\n")
        return config.EX_CONFIG
    n = len(cfg.devices)
    what = cfg.source or f"built-in defaults ({path} not found)"
    out.write(f"config OK: {what}, {n} device{'s' if n != 1 else ''}\n")
    _host_access(cfg, out)
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
    error = sockets.connect_error(path, timeout)
    if error is None:
        return True, "accepting connections"
    if isinstance(error, ConnectionRefusedError):
        return False, "stale: refusing connections (kubelet not running)"
    if isinstance(error, socket.timeout):
        return False, f"not answering (no connection within {timeout:g} s)"
    return False, f"cannot connect: {error.strerror or error}"


# --- the device policy: nodes that give a pod the host -------------------------------

def host_access_findings(cfg: Config) -> List[Tuple[str, str, str]]:
    """(resource, status, line) per device whose table sets allow_host_access: what it lets through."""
    from atedevd.devices import policy

    out = []
    for dev in cfg.devices:
        if not dev.allow_host_access:
            continue
        if dev.pattern:
            out.append((dev.resource, WARNING, f"WARNING: {dev.resource}: allow_host_access = true: every node {dev.path} "
                        "matches is granted, even one that gives pods the host"))
            continue
        try:
            found = policy.refusal(dev.host_path(cfg.dev_root), cfg.sys_root)
        except OSError:
            out.append((dev.resource, WARNING, f"WARNING: {dev.resource}: allow_host_access = true and {dev.path} is not there: "
                        "whatever node appears there is granted, even one that gives pods the host"))
            continue
        if found is None:
            out.append((dev.resource, OK, f"note: {dev.resource}: allow_host_access = true has no effect: "
                        f"{dev.path} is not a node the device policy refuses"))
        elif not found.rule.opt_in:
            out.append((dev.resource, PROBLEM, f"{dev.resource}: {found} (allow_host_access cannot grant it)"))
        else:
            out.append((dev.resource, WARNING, f"WARNING: {dev.resource}: granted because allow_host_access = true: {found}"))
    return out


def _host_access(cfg: Config, out: TextIO) -> None:
    _render_host_access([line for _, _, line in host_access_findings(cfg) + pattern_findings(cfg)], out)


def _render_host_access(lines: List[str], out: TextIO) -> None:
    if lines:
        out.write("Device policy (see atedevd.toml(5)):\n" + "".join(f"  {line}\n" for line in lines) + "\n")


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


def _render_non_root(report: NodeReport, out: TextIO) -> None:
    rows = [("RESOURCE", "HOST PATH", "OWNER", "MODE", "NON-ROOT CONTAINER CAN OPEN IT")]
    group_gids = set()
    for d in report.devices:
        if d["non_root"] is None:
            continue  # missing or not a char device: reported above
        if d["non_root"].startswith("only") and "supplementalGroups" in d["non_root"]:
            group_gids.add(d["gid"])
        rows.append((d["resource"], d["host_path"], d["owner"], d["mode"], d["non_root"]))
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


# --- /dev/char links ---------------------------------------------------------------

def char_link_state(dev_root: str, host_path: str, st: os.stat_result) -> Tuple[bool, str, Optional[str]]:
    """(ok, words, fix): does DEV_ROOT/char/MAJOR:MINOR lead to this device node?

    runc, under the systemd cgroup driver, hands a container's device rules to systemd
    as DeviceAllow=/dev/char/MAJOR:MINOR, and systemd applies them again on every
    daemon-reload; some runc versions (1.1.3 to 1.1.6) leave out a rule whose link is
    missing, and a reload then takes the device from running containers. udev makes
    these links; a node made without udev (mknod, some images) has none."""
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    link = os.path.join(dev_root, "char", f"{major}:{minor}")
    target = os.path.relpath(host_path, os.path.dirname(link))
    fix = f"udevadm trigger --action=add {host_path} (udev makes the link), or: ln -s {target} {link}"
    try:
        lst = os.stat(link)
    except FileNotFoundError:
        return False, f"{link} is missing", fix
    except OSError as e:
        return False, f"{link}: cannot stat: {e.strerror or e}", fix
    if not stat.S_ISCHR(lst.st_mode) or lst.st_rdev != st.st_rdev:
        return False, f"{link} does not lead to {host_path}", f"ln -sfn {target} {link}"
    return True, f"{link} present", None


# --- the plugin directory in atedevd.service's sandbox ------------------------------

def unit_properties() -> Optional[Dict[str, str]]:
    """atedevd.service's sandbox settings from systemd; None when there is no systemd or no such unit."""
    if shutil.which("systemctl") is None:
        return None
    try:
        p = subprocess.run(["systemctl", "show", UNIT, "-p", "LoadState", "-p", "ProtectSystem", "-p", "ReadWritePaths",
                            "-p", "PrivateNetwork", "-p", "RestrictAddressFamilies", "-p", "FileDescriptorStoreMax"],
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
    listed = _sandbox_keeps_read_only(plugin_dir, props)
    if listed is None:
        return True, f"{plugin_dir} writable (ReadWritePaths=)"
    return False, (f"{plugin_dir} is read-only in {UNIT}'s sandbox (ProtectSystem=strict; "
                   f"ReadWritePaths= has {listed}): atedevd could not create its sockets there")


def _sandbox_keeps_read_only(path: str, props: Dict[str, str]) -> Optional[str]:
    """What ReadWritePaths= lists, when atedevd.service's ProtectSystem=strict keeps `path`
    read-only; None when the unit may write there."""
    if props.get("ProtectSystem") != "strict":
        return None
    rw = [p.lstrip("-+") for p in props.get("ReadWritePaths", "").split()]
    target = os.path.normpath(path)
    if any(target == p or target.startswith(p.rstrip("/") + "/") for p in rw if p):
        return None
    return " ".join(rw) or "nothing"


def metrics_state(configured: Optional[str], props: Optional[Dict[str, str]]) -> Tuple[str, str]:
    """(status, words): can the daemon, as the unit runs it, write atedevd.prom? A warning
    at most: metrics are not needed to serve, but a fleet that counts on them sees nothing."""
    directory = textfile.resolve_dir(configured)
    if directory is None:
        return OK, ("off (metrics_dir is empty)" if configured == "" else
                    f"off ({textfile.DEFAULT_DIR}, node_exporter's textfile directory, does not exist)")
    state = _dir_state(directory)
    if state != "present":
        return WARNING, f"{directory} is {state}: atedevd.prom is not written"
    if not os.access(directory, os.W_OK):
        return WARNING, f"{directory} is not writable (a read-only mount?): atedevd.prom is not written"
    refused = textfile.directory_refused(directory)
    if refused:
        return WARNING, f"{refused}: atedevd.prom is not written"
    listed = None if props is None else _sandbox_keeps_read_only(directory, props)
    if listed is not None:
        return WARNING, (f"{directory} is read-only in {UNIT}'s sandbox (ProtectSystem=strict; ReadWritePaths= "
                         f"has {listed}): atedevd.prom is not written")
    return OK, f"atedevd.prom is written to {directory}"


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
            f"ExecStartPre=-+/bin/mkdir -p -m 0750 /run/cdi {plugin_dir}\n"
            "ReadWritePaths=\n"
            f"ReadWritePaths=-{plugin_dir}\n"
            "# The unit's other exceptions, kept: node_exporter's textfile directory (atedevd.prom), CDI specs.\n"
            f"ReadWritePaths=-{textfile.DEFAULT_DIR}\n"
            "ReadWritePaths=-/run/cdi\n")


def _kubelet_version(cfg: Config, sock: str, report: NodeReport) -> None:
    """Which kubelet serves the socket, and so how an upgrade of atedevd would register its successor."""
    from atedevd.kubelet.identity import kubelet_behind, upgrade_beside

    found = kubelet_behind(sock)
    beside, why = upgrade_beside(cfg.kubelet_endpoints, found)
    way = "registers beside the running atedevd" if beside else "registers once kubelet has let go of the running atedevd"
    if found.version is None and cfg.kubelet_endpoints == "auto":
        report.add("kubelet-version", sock, WARNING, f"an upgrade {way} ({why})",
                   fix=f'where every kubelet is 1.37 or newer, set kubelet_endpoints = "per-socket" in '
                       f'{cfg.source or config.DEFAULT_CONFIG_PATH}: no moment without the resource')
    else:
        report.add("kubelet-version", sock, OK, f"an upgrade {way} ({why})")


def _kubelet_view(cfg: Config, report: NodeReport) -> None:
    """What kubelet itself counts, next to what we advertise: the one place a
    registration that kubelet silently stopped honouring shows."""
    from atedevd.kubelet.calls import allocatable_counts  # imports grpc: only when `check` gets here
    from atedevd.kubelet.calls import pod_resources_socket

    path = pod_resources_socket(cfg.device_plugin_dir)
    report.kubelet_view = {"socket": path, "counts": None, "note": None}
    if not os.path.exists(path):
        report.kubelet_view["note"] = f"no pod-resources API at {path}"
        return
    try:
        counts = allocatable_counts(path, timeout=2.0)
    except OSError as e:
        report.kubelet_view["note"] = f"{path} did not answer ({e})"
        return
    view = report.kubelet_view["counts"] = {}
    for dev, row in zip(cfg.devices, report.devices):
        ours = row["units"] if dev.pattern else dev.count if row["present"] and row["device_number"] is not None else 0
        theirs = counts.get(dev.resource, 0)
        view[dev.resource] = {"ours": ours, "kubelet": theirs}
        if theirs == ours:
            report.add("kubelet-count", dev.resource, OK, f"kubelet counts {theirs} allocatable, as we advertise")
        else:
            why = "is atedevd running and registered?" if theirs == 0 else "kubelet's list is out of date"
            report.add("kubelet-count", dev.resource, PROBLEM,
                       f"kubelet counts {theirs} allocatable, we advertise {ours} healthy ({why})")


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


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
