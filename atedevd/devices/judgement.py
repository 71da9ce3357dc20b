"""A device node's judgement: what one stat() of a path shows, judged once, in the words both tables use.

udev replaces nodes, retargets links and removes them between any two looks, so a path looked
up twice is a race. A look stats each path once (`see`); a path whose stat shows another type,
number or identity than before is judged from that very stat (`judge`): trust (every directory
and link on the way root's alone, atedevd/trust.py), the node's numbers and sysfs class, the
device policy (atedevd/devices/policy.py). What was judged is carried (`Judgement`), never
looked up again by path. A directory's owner or mode says nothing at the node, so a table stamps
the directories on the way (`trust_stamp`) and judges all again when that changed.
"""

import enum
import errno
import functools
import os
import stat
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

from atedevd import trust
from atedevd.config import Device, file_type, host_path
from atedevd.devices import policy
from atedevd.record import Record


class NodeState(enum.Enum):
    """What a table judged a path to be: served only when PRESENT (both tables, one word each)."""

    PRESENT = "present"  # a character device pods may have, this resource's
    MISSING = "missing"  # nothing at the path (a dangling link too)
    NOT_A_NODE = "not a node"  # a file, a directory, a FIFO ...
    UNREADABLE = "unreadable"  # stat() failed otherwise
    REFUSED = "refused"  # the device policy keeps it from pods (a block device too)
    UNTRUSTED = "untrusted"  # a directory or link on the way that someone other than root can change
    CHANGED = "changed"  # a node with other numbers than those first served at the path
    CLAIMED = "claimed"  # another resource reaches it, and one of the two hands it to one container
    HELD = "held"  # (patterns) the numbers another unit was first served with
    COMPANION = "a companion"  # (patterns) a companion's node, never a unit
    ID_TAKEN = "id-taken"  # (patterns) its ID meant another path this run


class Seen(Record):
    """What one stat() of a path (every link followed) showed: its type, numbers and identity
    (a node made anew under the same name, or a link led elsewhere, is another key), or the
    error. A judgement is made of this very stat, never of a second look."""

    key: tuple
    st: Optional[os.stat_result] = None


def see(path: str) -> Seen:
    try:
        st = os.stat(path)
    except OSError as e:
        return Seen(("error", e.errno))
    return Seen((stat.S_IFMT(st.st_mode), st.st_rdev, st.st_dev, st.st_ino), st)


class Judgement(Record):
    """A path as judged from one `Seen`: its state, the node (its type and numbers, from that
    stat), the policy rule it matched (granted anyway when opted in), and the words for a
    state that needs them (what is there instead, the rule, the untrusted directory)."""

    state: NodeState
    node: Optional[policy.DeviceNode] = None
    refusal: Optional[policy.Refusal] = None
    why: str = ""

    @property
    def numbers(self) -> Optional[Tuple[int, int]]:
        return (self.node.major, self.node.minor) if self.node is not None else None

    def text(self) -> str:
        """The state in words, as the journal and `check` say it."""
        return self.why or self.state.value


Memo = Dict[str, List[str]]  # the directories' trust, walked once per look (atedevd/trust.py)


def judge(seen: Seen, host: str, allow_host_access: bool, sys_root: str = policy.SYS_ROOT,
          memo: Optional[Memo] = None) -> Judgement:
    """A path's judgement from what one stat() of it showed (`seen`): present (a character
    device the policy lets pods have), or why not. Every directory and link the kernel walks
    to reach the node must be root's alone, or whoever may write one chooses the node."""
    if seen.st is None:
        code = seen.key[1]
        if code in (errno.ENOENT, errno.ENOTDIR):
            return Judgement(NodeState.MISSING)
        return Judgement(NodeState.UNREADABLE, why=f"unreadable ({os.strerror(code)})")
    problems = trust.device_problems(host, memo)
    node = policy.look(host, sys_root, seen.st)  # the numbers of this stat: one judgement, one set of numbers
    if problems:
        return Judgement(NodeState.UNTRUSTED, node, why=f"not trusted: {problems[0]}")
    if node is None:
        return Judgement(NodeState.NOT_A_NODE, why=f"a {file_type(seen.st.st_mode)}, not a character device")
    found = policy.judge(node)  # a block device is refused whatever the configuration says
    if found is not None and policy.refused(found, allow_host_access):
        return Judgement(NodeState.REFUSED, node, found, policy.refusal_text(found))
    return Judgement(NodeState.PRESENT, node, found)


def judge_path(device: Device, dev_root: str, sys_root: str = policy.SYS_ROOT) -> Judgement:
    """A device's path judged now, on its own (a configuration check, `check`)."""
    host = device.host_path(dev_root)
    return judge(see(host), host, device.allow_host_access, sys_root)


class Change(Record):
    """A device's presence changed: what to tell the journal, and whether it is served Healthy."""

    present: bool
    level: int
    event: str
    message: str
    device: Optional[str] = None  # the node it is about (ATEDEVD_DEVICE); None: the device's path


def link_directories(path: str) -> Tuple[str, ...]:
    """The directories a chain of symlinks at `path` leads through, the one its node sits in
    last: a node replaced there (udev's by-id link stays, its target is made anew) changes
    what the path reaches without an event in the link's own directory."""
    found: List[str] = []
    for _ in range(40):  # the kernel's limit on links in one lookup
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                break
            target = os.readlink(path)
        except OSError:
            break
        path = os.path.join(os.path.realpath(os.path.dirname(path)), target)
        found.append(os.path.realpath(os.path.dirname(path)))
    return tuple(dict.fromkeys(found))


def directories(device: Device, dev_root: str) -> List[str]:
    """The directories whose events can change what the resource serves (its nodes come and go there)."""
    return list(dict.fromkeys(os.path.dirname(host_path(p, dev_root)) for p in (device.path, *device.companions)))


def _ancestors(directory: str) -> List[str]:
    out = []
    while True:
        out.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            return out
        directory = parent


@functools.lru_cache(maxsize=256)  # (a table asks at every look, for the same few directories)
def _walked(dirs: FrozenSet[str]) -> Tuple[str, ...]:
    return tuple(sorted({a for d in dirs for a in _ancestors(d)}))


def trust_stamp(dirs: Iterable[str]) -> tuple:
    """One lstat of every directory on the way to each of `dirs`: their identity, owner and mode,
    which is all their trust depends on. A table judges its nodes again in full when this
    changed (a `chmod o+w` of a directory on the way says nothing at the node itself)."""
    seen: List[tuple] = []
    for d in _walked(frozenset(dirs)):
        try:
            st = os.lstat(d)
        except OSError as e:
            seen.append((d, e.errno))
            continue
        seen.append((d, st.st_ino, st.st_mode, st.st_uid, st.st_gid))
    return tuple(seen)


def trust_changed(last: Optional[tuple], dirs: FrozenSet[str], stamp: tuple) -> bool:
    """Whether the directories judged last (`last`: (dirs, trust_stamp)) changed owner or mode
    since; `stamp`: the trust_stamp of `dirs` now."""
    if last is None:
        return True
    return (stamp if last[0] == dirs else trust_stamp(last[0])) != last[1]


def _numbers(numbers: Optional[Tuple[int, int]]) -> str:
    return f"{numbers[0]}:{numbers[1]}" if numbers else "?"
