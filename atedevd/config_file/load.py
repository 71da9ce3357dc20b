"""The configuration file -> Config, with every problem reported at once.

An operator fixing a node wants the whole list of mistakes in one run, each
naming the file, the line and the key, so nothing here stops at the first error
and no input (garbage, huge, deeply nested) may end in a traceback.

Line numbers come from the TOML parser only (atedevd/config_file/lines.py); nothing
here reads TOML syntax. A syntax error: Python 3.14+ and tomli 2.1+ give
`lineno`/`colno`/`msg` on TOMLDecodeError and we use them; older parsers give only a
message, which already names the position in the parser's own words: we keep it
whole, never pick it apart, and take FILE:LINE from the parser too.
"""

import os
import re
import time
from typing import Dict, List, Mapping, Optional, Tuple

from atedevd import trust
from atedevd.config import (APIS, DAEMON_BOOLS, DAEMON_KEYS, DEFAULT_DEVICES, DEVICE_KEYS, KUBELET_ENDPOINTS, LOG_LEVELS,
                            MAX_COMPANIONS, MAX_COUNT, MAX_DEVICE_ID, MAX_DEVICES, MAX_FILE_BYTES, MAX_ID, MIN_COUNT,
                            Config, Device, Pattern, host_path, is_pattern, read_regular)
from atedevd.config_file.lines import Lines, tomllib
from atedevd.devices import policy
from atedevd.kubelet import sockets

SETTLE_S = 0.05  # a file changed more recently than this may be half written: read again after it
SETTLE_LIMIT_S = 2.0  # a file still changing after this long is not applied


class ConfigError(Exception):
    """Every problem found in one configuration, one line each."""

    def __init__(self, errors):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def load(path: str, required: bool = False, overrides: Optional[Mapping[str, Optional[str]]] = None) -> Config:
    """Read `path` (built-in defaults when it is missing and not `required`), then apply `overrides`.

    Raises ConfigError listing every problem in the file and the overrides.
    """
    report = _Report(path)
    cfg = Config()
    lines: Optional[Lines] = None
    text = _read(path, required, report)
    if text is not None:
        lines = Lines(text)
        data = _parse(text, report, lines)
        if data is not None:
            lines.whole(data)
            cfg = _build(data, lines, report)
        cfg = cfg._replace(source=path)
    cfg = _apply_overrides(cfg, overrides or {}, report)
    if not report.errors:  # on the final values: the overrides name the directories looked in
        _check_socket_names(cfg, report)
        _check_cdi(cfg, report)
        _check_policy(cfg, lines, report)
    if report.errors:
        raise ConfigError(report.errors)
    return cfg


class _Report:
    """Collects `FILE[:LINE]: message` lines."""

    def __init__(self, path: str):
        self.path = path.replace("\0", "\\0")
        self.errors: List[str] = []

    def add(self, message: str, line: Optional[int] = None, where: Optional[str] = None) -> None:
        place = where or (f"{self.path}:{line}" if line else self.path)
        self.errors.append(f"{place}: {message}")


def _read(path: str, required: bool, report: _Report) -> Optional[str]:
    """The file's text, read whole; None when absent-and-optional or unreadable (then reported).

    A file rewritten in place (an editor, `cat >`) is for a moment empty or half written, and
    half a TOML document is often a valid one with fewer devices (an empty one is the built-in
    /dev/kvm). So a read counts only when the file is the same before and after it (inode,
    size, times) and was last changed `SETTLE_S` ago or more, or reads the same again after
    that long (an empty file: was seen empty by this reader that long); a file that keeps
    changing for `SETTLE_LIMIT_S` is not applied."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    last: Optional[Tuple[tuple, bytes]] = None
    empty_since: Optional[Tuple[tuple, float]] = None  # an empty file, and when this reader first saw it so
    while True:
        got = _read_once(path, required, report)
        if got is None:
            return None
        st, raw, stable = got
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        age = time.time() - max(st.st_mtime, st.st_ctime)
        if stable and not raw:
            # Empty (the built-in /dev/kvm): only what this reader saw itself counts, for a truncation
            # need not renew the file's times (seen on Linux 6.18, ext4: a file emptied by O_TRUNC
            # a moment ago showed the times of its last write, 200 ms before).
            if empty_since is not None and empty_since[0] == key and time.monotonic() - empty_since[1] >= SETTLE_S:
                break
            if empty_since is None or empty_since[0] != key:
                empty_since = (key, time.monotonic())
            age = 0.0
        elif stable and (age >= SETTLE_S or last == (key, raw)):
            break
        if time.monotonic() >= deadline:
            report.add(f"the file kept changing while it was read (rewritten in place?), for {SETTLE_LIMIT_S:g} s: "
                       "not applied; replace it whole instead (write a new file beside it, then rename it over)")
            return None
        last = (key, raw) if stable else None
        time.sleep(min(SETTLE_S, max(0.001, SETTLE_S - age)))
    for problem in trust.problems(path, st):  # it decides which host devices pods reach: only root may change it
        report.add(f"not trusted: {problem}")
    if len(raw) > MAX_FILE_BYTES:
        report.add(f"file is larger than {MAX_FILE_BYTES} bytes")
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        report.add(f"not valid UTF-8 (byte {e.start})", line)
        return None


def _read_once(path: str, required: bool, report: _Report) -> Optional[Tuple[os.stat_result, bytes, bool]]:
    """One read: (the descriptor's fstat, the bytes, whether the file stayed the one at the
    path and unchanged throughout); None when it cannot be read (reported)."""
    try:
        return read_regular(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        if required:
            report.add("cannot read: file not found")
    except (OSError, ValueError) as e:  # ValueError: NUL in the path
        report.add(f"cannot read: {getattr(e, 'strerror', None) or e}")
    return None


def _parse(text: str, report: _Report, lines: "Lines") -> Optional[dict]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        lineno = getattr(e, "lineno", None)
        if lineno is not None:  # Python 3.14+, tomli 2.1+: the parser says where, in numbers
            report.add(f"invalid TOML: {getattr(e, 'msg', e)} (column {getattr(e, 'colno', '?')})", lineno)
        else:  # older parsers put the position in their message, which we keep whole
            report.add(f"invalid TOML: {e}", lines.first_invalid())
    except (RecursionError, MemoryError):
        report.add("invalid TOML: nested too deeply")
    return None


def _type_name(v) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return names.get(type(v), type(v).__name__)  # datetime, date, time


def _close_matches(word: str, choices, n: int) -> List[str]:
    """Suggestions for a misspelt name; difflib is imported only for a bad file (a start pays 1 ms)."""
    import difflib

    return difflib.get_close_matches(word, choices, n=n)


def _unknown(key: str, where: str, known) -> str:
    msg = f"unknown key {_q(key)} in {where}"
    close = _close_matches(key, known, n=1)
    return msg + (f'; did you mean "{close[0]}"?' if close else "")


def _q(s) -> str:
    """Quote a value for a message, escaping what a terminal would not show."""
    def esc(c: str) -> str:
        if c == '"':
            return '\\"'
        if c.isprintable() and c != "\\":
            return c
        return c.encode("unicode_escape").decode("ascii")
    return '"' + "".join(map(esc, str(s))) + '"'


def _build(data: dict, lines: Lines, report: _Report) -> Config:
    cfg = Config()
    for key, value in data.items():
        if key == "daemon":
            if isinstance(value, dict):
                cfg = cfg._replace(**_build_daemon(value, lines, report))
            else:
                report.add(f"daemon: must be a table ([daemon]), got {_type_name(value)}", lines.of(key))
        elif key == "device":
            devices = _build_devices(value, lines, report)
            if devices:
                cfg = cfg._replace(devices=devices)
        else:
            line = lines.of(key)
            what = f"table [{key}]" if isinstance(value, dict) else f"key {_q(key)}"
            close = _close_matches(key, ("daemon", "device"), n=1)
            hint = f'; did you mean "{close[0]}"?' if close else ""
            report.add(f"unknown {what} at the top level{hint}", line)
    return cfg


def _build_daemon(table: dict, lines: Lines, report: _Report) -> dict:
    values = {}
    for key, value in table.items():
        line = lines.of("daemon", key)
        if key not in DAEMON_KEYS:
            report.add(_unknown(key, "[daemon]", DAEMON_KEYS), line)
            continue
        problem = _check_daemon_value(key, value)
        if problem:
            report.add(f"[daemon] {key}: {problem}", line)
        else:
            values[key] = value
    return values


def _check_daemon_value(key: str, value) -> Optional[str]:
    if key in DAEMON_BOOLS:
        return _check_bool(value)
    if not isinstance(value, str):
        return f"must be a string, got {_type_name(value)}"
    if key == "log_level":
        if value in LOG_LEVELS:
            return None
        close = _close_matches(value.lower(), LOG_LEVELS, n=1)
        hint = f'; did you mean "{close[0]}"?' if close else ""
        return f"must be one of {', '.join(LOG_LEVELS)}, got {_q(value)}{hint}"
    if key == "kubelet_endpoints":
        if value in KUBELET_ENDPOINTS:
            return None
        return (f'must be "auto" (as the kubelet behind kubelet.sock says it is), "per-resource" (kubelet 1.36 '
                f'and older) or "per-socket" (kubelet with kubernetes PR #135437, 1.37), got {_q(value)}')
    if key == "api":
        if value in APIS:
            return None
        return f'must be "device-plugin" (the default) or "dra" (Dynamic Resource Allocation), got {_q(value)}'
    if key == "node_name":
        if re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value):
            return None
        return f"must be a Kubernetes node name (lower-case letters, digits, '-' and '.'), got {_q(value)}"
    if key == "metrics_dir" and value == "":
        return None  # metrics off
    if "\0" in value:
        return "must not contain a NUL character"
    if not value.startswith("/"):
        return f"must be an absolute path, got {_q(value)}"
    return None


def _build_devices(value, lines: Lines, report: _Report) -> Tuple[Device, ...]:
    if isinstance(value, dict):
        report.add("device: must be an array of tables: write [[device]], not [device]", lines.of("device"))
        return ()
    if not isinstance(value, list):
        report.add(f"device: must be an array of tables ([[device]]), got {_type_name(value)}", lines.of("device"))
        return ()
    if not value:
        report.add("device: empty array; remove it to keep the default (/dev/kvm) or add [[device]] tables",
                   lines.of("device"))
        return ()
    devices: List[Device] = []
    seen: Dict[Tuple[str, str], int] = {}
    for i, table in enumerate(value):
        where = f"[[device]] #{i + 1}"
        if not isinstance(table, dict):
            report.add(f"{where}: must be a table, got {_type_name(table)}", lines.of("device", i))
            continue
        ok = True
        for key, v in table.items():  # document order, so errors come out in line order
            line = lines.of("device", i, key)
            problem: Optional[str]
            if key not in DEVICE_KEYS:
                problem = _unknown(key, where, DEVICE_KEYS)
            else:
                problem = _DEVICE_CHECKS[key](v)
                if problem:
                    problem = f"{where} {key}: {problem}"
                elif key in ("resource", "path") and (key, v) in seen:
                    problem = f"{where} {key}: {_q(v)} is already used by [[device]] #{seen[(key, v)]}"
                elif key in ("resource", "path"):
                    seen[(key, v)] = i + 1
            if problem:
                report.add(problem, line)
                ok = False
        for key in ("resource", "path"):
            if key not in table:
                report.add(f'{where}: missing required key "{key}"', lines.of("device", i))
                ok = False
        if ok:
            dev = Device(**{**table, "companions": tuple(table.get("companions", ()))})
            longest = dev.unit_id(dev.count - 1)
            if dev.pattern and "count" in table:
                report.add(f"{where} count: a pattern path is one unit per matching node, each handed to one "
                           "container; remove count (a single path gives shareable units)", lines.of("device", i, "count"))
            elif dev.path in dev.companions:
                report.add(f"{where} companions: {_q(dev.path)} is the device's own path", lines.of("device", i, "companions"))
            elif not dev.pattern and len(longest) > MAX_DEVICE_ID:
                line = lines.of("device", i, "count") or lines.of("device", i, "path")
                report.add(f"{where}: unit ID {_q(longest)} is longer than {MAX_DEVICE_ID} characters; "
                           "use a shorter path basename or a smaller count", line)
            else:
                devices.append(dev)
    if len(value) > MAX_DEVICES:  # after the tables' own problems: all are said at once
        report.add(f"device: {len(value)} [[device]] tables; atedevd serves at most {MAX_DEVICES}", None)
        return ()
    return tuple(devices) if len(devices) == len(value) else ()


_SUBDOMAIN_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_SUBDOMAIN_LABEL}(\.{_SUBDOMAIN_LABEL})*")
_QUALIFIED = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# kubelet checks "requests." + the name as a qualified name, so the prefix loses 9 characters.
_MAX_PREFIX = 253 - len("requests.")


def _check_resource(v) -> Optional[str]:
    if not isinstance(v, str):
        return f"must be a string, got {_type_name(v)}"
    if v.count("/") != 1:
        return f'{_q(v)} must be <domain>/<name> with exactly one "/", e.g. "ate.dev/kvm"'
    prefix, name = v.split("/")
    if "kubernetes.io/" in v:
        return f"{_q(v)} is in the reserved kubernetes.io domain"
    if v.startswith("requests."):
        return f'{_q(v)} must not start with "requests."'
    if not prefix or len(prefix) > _MAX_PREFIX or not _SUBDOMAIN.fullmatch(prefix):
        return (f"domain {_q(prefix)} must be a lowercase DNS subdomain (a-z, 0-9, '-', '.') "
                f"of at most {_MAX_PREFIX} characters")
    if not name or len(name) > 63 or not _QUALIFIED.fullmatch(name):
        return (f"name {_q(name)} must be 1-63 characters of A-Z, a-z, 0-9, '-', '_', '.', "
                "starting and ending with a letter or digit")
    return None


def _check_path(v) -> Optional[str]:
    if not isinstance(v, str):
        return f"must be a string, got {_type_name(v)}"
    if "\0" in v:
        return "must not contain a NUL character"
    if not v.startswith("/dev/") or v.startswith("//"):
        return f"{_q(v)} must be an absolute path under /dev/"
    if ".." in v.split("/"):
        return f'{_q(v)} must not contain ".."'
    norm = os.path.normpath(v)
    if norm != v:
        return f"{_q(v)} is not normalised; did you mean {_q(norm)}?"
    if is_pattern(os.path.dirname(v)):
        return (f"{_q(v)}: a pattern may only be in the last part of the path (one directory is watched), "
                'e.g. "/dev/vfio/[0-9]*"')
    return None


def _check_companions(v) -> Optional[str]:
    if not isinstance(v, list):
        return f"must be an array of paths, got {_type_name(v)}"
    if len(v) > MAX_COMPANIONS:
        return f"at most {MAX_COMPANIONS} paths, got {len(v)}"
    for item in v:
        problem = _check_path(item)
        if problem:
            return problem
        if is_pattern(item):
            return f"{_q(item)}: a companion is one node, not a pattern"
    if len(set(v)) != len(v):
        return "lists a path twice"
    return None


def _check_count(v) -> Optional[str]:
    if isinstance(v, bool) or not isinstance(v, int):
        return f"must be an integer, got {_type_name(v)}"
    if not MIN_COUNT <= v <= MAX_COUNT:
        return f"must be between {MIN_COUNT} and {MAX_COUNT}, got {v}"
    return None


def _check_permissions(v) -> Optional[str]:
    if not isinstance(v, str):
        return f"must be a string, got {_type_name(v)}"
    if not v or set(v) - set("rwm") or len(set(v)) != len(v):
        return f'{_q(v)} must be a non-empty combination of "r", "w" and "m", each at most once'
    return None


def _check_bool(v) -> Optional[str]:
    if not isinstance(v, bool):
        return f"must be true or false, got {_type_name(v)}"
    return None


def _check_mode(v) -> Optional[str]:
    """A device node's mode: read and write bits only (0o666 at most), written in octal."""
    if isinstance(v, bool) or not isinstance(v, int):
        return f"must be an integer mode written in octal, e.g. 0o660, got {_type_name(v)}"
    if v < 0 or v & ~0o666:
        return (f"{v:#o} is not a device node's mode: read and write bits only (at most 0o666; "
                "no execute, setuid, setgid or sticky bit)" if v >= 0 else f"must not be negative, got {v}")
    if 0 < v < 0o10:
        return f"{v} is mode {v:#05o}: write a mode in octal, e.g. 0o660"
    return None


def _check_id(v) -> Optional[str]:
    if isinstance(v, bool) or not isinstance(v, int):
        return f"must be an integer (a numeric id, as the runtime sets it), got {_type_name(v)}"
    if not 0 <= v <= MAX_ID:
        return f"must be between 0 and {MAX_ID}, got {v}"
    return None


_DEVICE_CHECKS = {"resource": _check_resource, "path": _check_path,
                  "count": _check_count, "permissions": _check_permissions,
                  "allow_host_access": _check_bool, "companions": _check_companions,
                  "container_mode": _check_mode, "container_uid": _check_id, "container_gid": _check_id,
                  "host_mode": _check_mode}


def _check_cdi(cfg: Config, report: _Report) -> None:
    """CDI grants (atedevd/cdi/names.py): each resource names a CDI kind of its own, and an answer
    grants the node one way or the other."""
    if not cfg.device_specs and not cfg.cdi:
        report.add("[daemon] device_specs = false needs cdi = true: an Allocate answer must grant the node "
                   "one way or the other")
    if not cfg.cdi:
        return
    from atedevd.cdi import names as cdi  # only where CDI grants are on

    kinds: Dict[str, str] = {}
    for i, dev in enumerate(cfg.devices):
        problem = cdi.kind_problem(dev.resource)
        if problem:
            report.add(f"[[device]] #{i + 1} resource: {_q(dev.resource)} {problem}")
            continue
        kind = cdi.kind(dev.resource)
        if kind in kinds:
            report.add(f"[[device]] #{i + 1} resource: {_q(dev.resource)} and {_q(kinds[kind])} are one CDI kind, "
                       f"{_q(kind)}; rename one")
        kinds[kind] = dev.resource


def _check_socket_names(cfg: Config, report: _Report) -> None:
    """Every resource's socket file is its own and fits a unix socket path."""
    for problem in sockets.check_names(cfg.device_plugin_dir, [d.resource for d in cfg.devices]):
        report.add(problem)


def _check_policy(cfg: Config, lines: Optional[Lines], report: _Report) -> None:
    """Refuse a device whose node (or a companion) gives a container the host (policy.py),
    unless its table opts in. A node absent now cannot be judged: the daemon judges it
    when it appears. What a pattern matches is judged node by node and a refused match
    is left out (the daemon and `check` name it), not an error; so is a node two
    resources reach (atedevd/devices/claims.py: served by neither, at start as later)."""
    for i, dev in enumerate(cfg.devices):
        keys = ([] if dev.pattern else [("path", dev.path)]) + [("companions", c) for c in dev.companions]
        _check_way(cfg, i, dev, lines, report)
        for key, path in keys:
            try:
                found = policy.refusal(host_path(path, cfg.dev_root), cfg.sys_root)
            except OSError:
                continue  # absent or unreadable: judged when the daemon finds it
            if found is not None and policy.refused(found, dev.allow_host_access):
                if cfg.devices is DEFAULT_DEVICES:
                    where, line = "the built-in device", None
                else:
                    where, line = f"[[device]] #{i + 1} {key}", lines.of("device", i, key) if lines else None
                report.add(f"{where}: {_q(path)} ({dev.resource}): {policy.refusal_text(found)}", line)
            elif found is not None and dev.host_mode is not None:  # opted in to the node, never to widening it
                line = lines.of("device", i, "host_mode") if lines else None
                report.add(f"[[device]] #{i + 1} host_mode: {_q(path)} ({dev.resource}): refused: {found}; "
                           "atedevd never widens the host's mode of such a node", line)


def _check_way(cfg: Config, i: int, dev: Device, lines: Optional[Lines], report: _Report) -> None:
    """Refuse a device whose way to its nodes someone other than root can change: a directory
    or link on the way to its path (a pattern's directory whole: anyone who may add a name
    chooses a node) or to a companion. What is not there yet is judged when it appears."""
    ways = [("path", dev.path, trust.directory_problems(Pattern(dev.path, cfg.dev_root).host_directory) if dev.pattern
             else trust.device_problems(host_path(dev.path, cfg.dev_root)))]
    ways += [("companions", c, trust.device_problems(host_path(c, cfg.dev_root))) for c in dev.companions]
    for key, path, problems in ways:
        if not problems:
            continue
        if cfg.devices is DEFAULT_DEVICES:
            where, line = "the built-in device", None
        else:
            where, line = f"[[device]] #{i + 1} {key}", lines.of("device", i, key) if lines else None
        report.add(f"{where}: {_q(path)} ({dev.resource}): not trusted: {problems[0]}", line)


def _apply_overrides(cfg: Config, overrides: Mapping[str, Optional[str]], report: _Report) -> Config:
    """Command-line values for [daemon] keys; they win over the file and are checked the same way."""
    values = {}
    for key, value in overrides.items():
        if value is None:
            continue
        flag = "--" + str(key).replace("_", "-")
        if key not in DAEMON_KEYS:
            report.add(f"unknown option {flag}", where="command line")
            continue
        problem = _check_daemon_value(key, value)
        if problem:
            report.add(f"{flag}: {problem}", where="command line")
        else:
            values[key] = value
    return cfg._replace(**values)
