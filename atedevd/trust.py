"""Whether only root can change the configuration: the file and every directory above it.

The configuration decides which host devices pods can reach, so a user who can
rewrite it, or replace it through a directory they can write, can widen what is
granted. It is trusted the way sshd's StrictModes and sudo's sudoers check trust
theirs: the file and each directory on the way to it owned by root (or by the
user the daemon runs as) and writable by neither group nor others. A directory
that others may write but that has the sticky bit (`/tmp`) is safe for entries
root owns in it: only their owner can rename or delete them.

Both ways to the file are walked: the path as given (a symlink there can be
re-pointed by whoever may write its directory) and the path with every symlink
resolved (whoever may write those directories can swap the file). ACLs are not
read; a directory that grants writes only through an ACL is not caught.
"""

import os
import stat
from typing import Iterator, List, Optional, Set

_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def problems(path: str, st: Optional[os.stat_result] = None) -> List[str]:
    """Why `path` is not trusted, one line each naming the path, its owner and mode; [] when it is.

    `st`: the file's own fstat (of the descriptor that will be read), if the caller has one."""
    trusted = {0, os.geteuid()}
    found: List[str] = []
    seen: Set[str] = set()

    def say(text: str) -> None:
        if text not in seen:
            seen.add(text)
            found.append(text)

    given = os.path.abspath(path)
    for way in dict.fromkeys((given, os.path.realpath(given))):  # as given, then resolved
        for text in _walk(way, trusted):
            say(text)
    if st is not None:
        text = _entry_problem(path, st, trusted, final=True)
        if text:
            say(text)
    return found


def _walk(path: str, trusted: Set[int]) -> Iterator[str]:
    """Every entry on the way from / to `path`: its own owner, and whether its directory lets
    others replace it."""
    parts = [p for p in path.split("/") if p]
    try:
        parent = os.stat("/")
    except OSError as e:
        yield f"/: cannot stat ({e.strerror})"
        return
    text = _entry_problem("/", parent, trusted)
    if text:
        yield text
    here = ""
    for i, name in enumerate(parts):
        here += "/" + name
        final = i == len(parts) - 1
        try:
            entry = os.lstat(here)  # the entry in its directory: a symlink is judged as itself
        except OSError as e:
            yield f"{here}: cannot stat ({e.strerror})"
            return
        if parent.st_mode & _GROUP_OTHER_WRITE and not (parent.st_mode & stat.S_ISVTX and entry.st_uid in trusted):
            yield (f"{os.path.dirname(here)} is writable by {_who(parent.st_mode)} ({_describe(parent)}), "
                   f"so {here} can be replaced: chmod go-w {os.path.dirname(here)}")
        text = _entry_problem(here, entry, trusted, final=final and not stat.S_ISLNK(entry.st_mode))
        if text:
            yield text
        if final:
            return
        try:
            parent = os.stat(here)  # a symlinked directory: what is written into is its target
        except OSError as e:
            yield f"{here}: cannot stat ({e.strerror})"
            return


def _entry_problem(path: str, st: os.stat_result, trusted: Set[int], final: bool = False) -> Optional[str]:
    if st.st_uid not in trusted:
        return f"{path} is owned by {user_name(st.st_uid)} ({_describe(st)}), not root: chown root {path}"
    if final and st.st_mode & _GROUP_OTHER_WRITE:
        return f"{path} is writable by {_who(st.st_mode)} ({_describe(st)}): chmod go-w {path}"
    return None


def _who(mode: int) -> str:
    return " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others")) if mode & bit)


def _describe(st: os.stat_result) -> str:
    return f"owner {user_name(st.st_uid)}:{group_name(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def user_name(uid: int) -> str:
    """The user's name, or the number when it has none (shared with `atedevd check`)."""
    import pwd  # only when there is something to say

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
