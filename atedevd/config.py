"""TOML configuration -> Config, with every problem reported at once.

An operator fixing a node wants the whole list of mistakes in one run, each
naming the file, the line and the key, so nothing here stops at the first error
and no input (garbage, huge, deeply nested) may end in a traceback.
"""

import difflib
import os
import re
import stat
import sys
from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EX_CONFIG = 78
DEFAULT_CONFIG_PATH = "/etc/atedevd/config.toml"

MAX_FILE_BYTES = 1 << 20
MIN_COUNT, MAX_COUNT = 1, 65536
MAX_DEVICE_ID = 63  # kubelet's limit on a device ID
LOG_LEVELS = ("debug", "info", "warning", "error")
DAEMON_KEYS = ("device_plugin_dir", "dev_root", "log_level")
DEVICE_KEYS = ("resource", "path", "count", "permissions")


@dataclass(frozen=True)
class Device:
    """One device node advertised as `count` shareable units of `resource`."""

    resource: str
    path: str
    count: int = 4096
    permissions: str = "rw"

    def host_path(self, dev_root: str = "/dev") -> str:
        """Where this node is looked up: `/dev/net/tun` -> `<dev_root>/net/tun`.

        `path` is what kubelet and the container see; `dev_root` lets the daemon
        (and tests) look at another tree without changing what pods get.
        """
        return os.path.join(dev_root, os.path.relpath(self.path, "/dev"))

    def unit_id(self, n: int) -> str:
        """Device ID of unit `n`: `<basename>-<n>`, e.g. `kvm-0`."""
        return f"{os.path.basename(self.path)}-{n}"


DEFAULT_DEVICES = (Device("ate.dev/kvm", "/dev/kvm"),)
# The most devices one daemon serves: each holds up to three ListAndWatch
# threads of the worker pool, sized for this many at start-up.
MAX_DEVICES = 32


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
    """Read `path` (built-in defaults when it is missing and not `required`), then apply `overrides`.

    Raises ConfigError listing every problem in the file and the overrides.
    """
    report = _Report(path)
    cfg = Config()
    text = _read(path, required, report)
    if text is not None:
        data = _parse(text, report)
        if data is not None:
            cfg = _build(data, _Lines(text, data), report)
        cfg = replace(cfg, source=path)
    cfg = _apply_overrides(cfg, overrides or {}, report)
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
    """The file's text; None when absent-and-optional or unreadable (then reported)."""
    try:
        # O_NONBLOCK: a FIFO at the path must not hang the daemon or `check-config`.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if required:
            report.add("cannot read: file not found")
        return None
    except (OSError, ValueError) as e:  # ValueError: NUL in the path
        report.add(f"cannot read: {getattr(e, 'strerror', None) or e}")
        return None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            report.add(f"cannot read: not a regular file ({file_type(mode)})")
            return None
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        report.add(f"cannot read: {e.strerror or e}")
        return None
    if len(raw) > MAX_FILE_BYTES:
        report.add(f"file is larger than {MAX_FILE_BYTES} bytes")
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        report.add(f"not valid UTF-8 (byte {e.start})", line)
        return None


def file_type(mode: int) -> str:
    """What a file is, in words (shared with `atedevd check`)."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "unknown file type"


_POS = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)$")


def _parse(text: str, report: _Report) -> Optional[dict]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(getattr(e, "msg", None) or e)
        m = _POS.search(msg)
        line = getattr(e, "lineno", None)
        if m:
            msg = msg[: m.start()]
            line = line or (int(m.group(1)) if m.group(1) else text.count("\n") + 1)
            if m.group(2):
                msg += f" (column {m.group(2)})"
        report.add(f"invalid TOML: {msg}", line)
    except (RecursionError, MemoryError):
        report.add("invalid TOML: nested too deeply")
    return None


_HEADER = re.compile(r"\[(\[)?\s*([^\[\]]*?)\s*\](\])?\s*(?:#.*)?$")
_KEYLINE = re.compile(r"""("[^"\\]*"|'[^']*'|[A-Za-z0-9_-]+)\s*=\s*(.*)$""")


class _Lines:
    """Best-effort map from (table, key) to a line number, by a line scan.

    tomllib gives no positions. The scan understands headers, `key =` lines and
    multi-line strings; when its count of [[device]] headers does not match the
    parsed data, it gives up on device lines rather than point at the wrong one.
    """

    def __init__(self, text: str, data: dict):
        self.keys: Dict[Tuple[str, int], Dict[str, int]] = {}
        self.headers: Dict[Tuple[str, int], int] = {}
        table, closer, devices = ("", 0), None, 0
        for n, raw in enumerate(text.split("\n"), 1):  # TOML lines end at \n only
            s = raw.strip()
            if closer:
                if s.count(closer) % 2:
                    closer = None
                continue
            h = _HEADER.match(s)
            if h and bool(h.group(1)) == bool(h.group(3)):
                name = h.group(2).strip("\"'")
                if h.group(1) and name == "device":
                    table = ("[[device]]", devices)
                    devices += 1
                else:
                    table = (name, 0)
                self.headers.setdefault(table, n)
                continue
            k = _KEYLINE.match(s)
            if k:
                self.keys.setdefault(table, {}).setdefault(k.group(1).strip("\"'"), n)
            for q in ('"""', "'''"):
                if s.count(q) % 2:
                    closer = q
                    break
        parsed = data.get("device")
        if not (isinstance(parsed, list) and len(parsed) == devices):
            self.keys = {t: v for t, v in self.keys.items() if t[0] != "[[device]]"}
            self.headers = {t: v for t, v in self.headers.items() if t[0] != "[[device]]"}

    def of(self, table: str, index: int = 0, key: Optional[str] = None) -> Optional[int]:
        if key is not None and key in self.keys.get((table, index), {}):
            return self.keys[(table, index)][key]
        return self.headers.get((table, index))


def _type_name(v) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return names.get(type(v), type(v).__name__)  # datetime, date, time


def _unknown(key: str, where: str, known) -> str:
    msg = f"unknown key {_q(key)} in {where}"
    close = difflib.get_close_matches(key, known, n=1)
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


def _build(data: dict, lines: _Lines, report: _Report) -> Config:
    cfg = Config()
    for key, value in data.items():
        if key == "daemon":
            if isinstance(value, dict):
                cfg = replace(cfg, **_build_daemon(value, lines, report))
            else:
                report.add(f"daemon: must be a table ([daemon]), got {_type_name(value)}", lines.of("", 0, key))
        elif key == "device":
            devices = _build_devices(value, lines, report)
            if devices:
                cfg = replace(cfg, devices=devices)
        else:
            line = lines.of("", 0, key) or lines.of(key)
            what = f"table [{key}]" if isinstance(value, dict) else f"key {_q(key)}"
            close = difflib.get_close_matches(key, ("daemon", "device"), n=1)
            hint = f'; did you mean "{close[0]}"?' if close else ""
            report.add(f"unknown {what} at the top level{hint}", line)
    return cfg


def _build_daemon(table: dict, lines: _Lines, report: _Report) -> dict:
    values = {}
    for key, value in table.items():
        line = lines.of("daemon", 0, key) or lines.of(f"daemon.{key}") or lines.of("daemon")
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
    if not isinstance(value, str):
        return f"must be a string, got {_type_name(value)}"
    if key == "log_level":
        if value in LOG_LEVELS:
            return None
        close = difflib.get_close_matches(value.lower(), LOG_LEVELS, n=1)
        hint = f'; did you mean "{close[0]}"?' if close else ""
        return f"must be one of {', '.join(LOG_LEVELS)}, got {_q(value)}{hint}"
    if "\0" in value:
        return "must not contain a NUL character"
    if not value.startswith("/"):
        return f"must be an absolute path, got {_q(value)}"
    return None


def _build_devices(value, lines: _Lines, report: _Report) -> Tuple[Device, ...]:
    if isinstance(value, dict):
        report.add("device: must be an array of tables: write [[device]], not [device]", lines.of("device"))
        return ()
    if not isinstance(value, list):
        report.add(f"device: must be an array of tables ([[device]]), got {_type_name(value)}", lines.of("", 0, "device"))
        return ()
    if not value:
        report.add("device: empty array; remove it to keep the default (/dev/kvm) or add [[device]] tables",
                   lines.of("", 0, "device"))
        return ()
    if len(value) > MAX_DEVICES:
        report.add(f"device: {len(value)} [[device]] tables; atedevd serves at most {MAX_DEVICES}",
                   lines.of("", 0, "device"))
        return ()
    devices: List[Device] = []
    seen: Dict[Tuple[str, str], int] = {}
    for i, table in enumerate(value):
        where = f"[[device]] #{i + 1}"
        if not isinstance(table, dict):
            report.add(f"{where}: must be a table, got {_type_name(table)}", lines.of("", 0, "device"))
            continue
        ok = True
        for key, v in table.items():  # document order, so errors come out in line order
            line = lines.of("[[device]]", i, key)
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
                report.add(f'{where}: missing required key "{key}"', lines.of("[[device]]", i))
                ok = False
        if ok:
            dev = Device(**table)
            longest = dev.unit_id(dev.count - 1)
            if len(longest) > MAX_DEVICE_ID:
                line = lines.of("[[device]]", i, "count") or lines.of("[[device]]", i, "path")
                report.add(f"{where}: unit ID {_q(longest)} is longer than {MAX_DEVICE_ID} characters; "
                           "use a shorter path basename or a smaller count", line)
            else:
                devices.append(dev)
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


_DEVICE_CHECKS = {"resource": _check_resource, "path": _check_path,
                  "count": _check_count, "permissions": _check_permissions}


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
    return replace(cfg, **values)
