"""`atedevd check`'s part for pod kinds: each device's verdicts (atedevd/check/pod_kinds.py) as
findings and as `devices[].pods`, and whether the unit's sandbox lets the daemon write its
CDI specs."""

import os
import stat
from typing import Dict, List, Optional, Tuple

from atedevd import trust
from atedevd.check import pod_kinds
from atedevd.config import Config, Device

OK, WARNING, PROBLEM = "ok", "warning", "problem"  # check.py's statuses


def add(cfg: Config, dev: Device, report, runtimes: list) -> None:
    """The verdicts for `dev`, whose row `check` has just added (judged on every node it grants
    now: its node or its units, and its companions)."""
    row = report.devices[-1]
    nodes = [n for n in (_host_node(n) for n in row["nodes"] if _granted(n)) if n is not None]
    if not nodes:
        row["pods"] = None  # nothing to open: reported above
        return
    verdicts = pod_kinds.combine([pod_kinds.judge(n, dev, cfg.cdi, cfg.cdi_spec_dir, runtimes) for n in nodes])
    row["pods"] = [v._asdict() for v in verdicts]
    for v in verdicts:
        report.add("pod-kind", dev.resource, OK if v.opens == pod_kinds.YES else WARNING,
                   f"{pod_kinds.TITLES[v.kind]}: {v.opens}: {v.why}", v.fix)


def _granted(n: dict) -> bool:
    return n["role"] in ("node", "unit", "companion") and n["present"] and n["allowed"]


def _host_node(n: dict) -> Optional[pod_kinds.HostNode]:
    try:
        st = os.stat(n["host_path"])
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    try:
        there = os.stat(n["path"])  # what runc binds into a user namespace: the host's node at the container path
        at_path = there.st_rdev if stat.S_ISCHR(there.st_mode) else None
    except OSError:
        at_path = None
    return pod_kinds.HostNode(n["path"], n["host_path"], stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_rdev,
                              at_path, f"{trust.user_name(st.st_uid)}:{trust.group_name(st.st_gid)}")


def spec_dir(cfg: Config, props: Optional[Dict[str, str]], report) -> None:
    """With CDI grants on: may atedevd.service write in cdi_spec_dir, and is it root's alone?"""
    path = cfg.cdi_spec_dir
    problems: List[str] = trust.problems(path) if os.path.exists(path) else []
    if problems:
        report.add("cdi-spec-dir", path, PROBLEM, f"not trusted: {problems[0]}")
        return
    rw = [os.path.realpath(p.lstrip("-+")) for p in (props or {}).get("ReadWritePaths", "").split()]
    real = os.path.realpath(path)
    if props is not None and props.get("ProtectSystem") == "strict" and not any(
            real == p or real.startswith(p.rstrip("/") + "/") for p in rw):
        report.add("cdi-spec-dir", path, PROBLEM,
                   f"{path} is read-only in atedevd.service's sandbox (ProtectSystem=strict; ReadWritePaths= has "
                   f"{' '.join(rw) or 'nothing'}): atedevd cannot write its CDI specs there",
                   f"a drop-in with ExecStartPre=-+/bin/mkdir -p -m 0755 {path} and ReadWritePaths=-{path}")
        return
    report.add("cdi-spec-dir", path, OK, f"CDI specs are written to {path}")
    for entry, kind in foreign_specs(cfg):
        report.add("cdi-spec-dir", entry, PROBLEM, f"{entry} defines CDI kind {kind}, atedevd's: a name both specs "
                   "define resolves to nothing, and atedevd answers none of them",
                   "remove that file, or give the program that wrote it another kind")


def foreign_specs(cfg: Config) -> List[Tuple[str, str]]:
    """(path, kind) of every spec in cdi_spec_dir that another program wrote with one of our kinds."""
    from atedevd.cdi import keeper as cdi_keeper
    from atedevd.cdi import names as cdi

    kinds = {cdi.kind(d.resource) for d in cfg.devices}
    ours = {cdi.file_name(d.resource) for d in cfg.devices}
    try:
        entries = sorted(os.listdir(cfg.cdi_spec_dir))
    except OSError:
        return []
    out = []
    for entry in entries:
        if entry in ours or not entry.endswith((".json", ".yaml")):
            continue
        path = os.path.join(cfg.cdi_spec_dir, entry)
        found = cdi_keeper.kind_and_names(path, kinds)
        if found is not None and found[0] in kinds:
            out.append((path, found[0]))
    return out
