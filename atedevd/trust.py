"""Whether only root can change the configuration: the file and every directory and link
the kernel walks through to reach it.

The configuration decides which host devices pods can reach, so a user who can
rewrite it, or replace it through a directory they can write, can widen what is
granted. It is trusted the way sshd's StrictModes and sudo's sudoers check trust
theirs: the file and each directory on the way to it owned by root (or by the
user the daemon runs as) and writable by neither group nor others. A directory
that others may write but that has the sticky bit (`/tmp`) is safe for entries
root owns in it: only their owner can rename or delete them.

The way to the file is the kernel's: component by component from `/` (or the working
directory), each symlink met judged as an entry of its own directory and then followed
(its target's components walked the same way), `..` taken on the disk (the parent of
where the walk is, which a link may have moved), not on the string. So a link anywhere
on the way, also one that points at a root-owned file, is as trustworthy as the
directory it sits in: whoever may replace it chooses which file is read. ACLs are not
read; a directory that grants writes only through an ACL is not caught.
"""

import os
import stat
from typing import Iterator, List, Optional, Set, Tuple

_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
MAX_LINKS = 40  # the kernel's limit on symlinks followed in one lookup (ELOOP beyond)


def problems(path: str, st: Optional[os.stat_result] = None) -> List[str]:
    """Why `path` is not trusted, one line each naming the path, its owner and mode; [] when it is.

    `st`: the file's own fstat (of the descriptor that will be read), if the caller has one:
    its owner and mode are judged, and it must be the file the walk reached."""
    trusted = {0, os.geteuid()}
    found: List[str] = []
    reached: List[os.stat_result] = []
    start = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # no normalising: ".." is the disk's
    for text in _walk(start, trusted, reached):
        if text not in found:
            found.append(text)
    if st is not None:
        problem = _entry_problem(path, st, trusted, final=True)
        if problem and problem not in found:
            found.append(problem)
        if reached and (reached[0].st_dev, reached[0].st_ino) != (st.st_dev, st.st_ino):
            found.append(f"{path} was replaced while it was read: read it again")
    return found


def _walk(path: str, trusted: Set[int], reached: List[os.stat_result]) -> Iterator[str]:
    """Every entry the kernel looks up on the way to `path`, links followed as it follows them:
    its own owner, and whether its directory lets others replace it. The file reached is
    appended to `reached`."""
    here_st: os.stat_result
    try:
        here_st = os.stat("/")
    except OSError as e:
        yield f"/: cannot stat ({e.strerror})"
        return
    text = _entry_problem("/", here_st, trusted)
    if text:
        yield text
    here = "/"  # where the walk is: a directory, every link on the way to it followed
    todo = _parts(path)
    links = 0
    while todo:
        name = todo.pop(0)
        if name == "..":  # the parent of where the walk is, not of the string written
            here = os.path.dirname(here)
            parent, problem = _stat(here)
            if parent is None:
                yield problem or here
                return
            here_st = parent
            continue
        entry = os.path.join(here, name)
        try:
            st = os.lstat(entry)  # the entry in its directory: a symlink is judged as itself
        except OSError as e:
            yield f"{entry}: cannot stat ({e.strerror})"
            return
        if here_st.st_mode & _GROUP_OTHER_WRITE and not (here_st.st_mode & stat.S_ISVTX and st.st_uid in trusted):
            yield (f"{here} is writable by {_who(here_st.st_mode)} ({_describe(here_st)}), "
                   f"so {entry} can be replaced: chmod go-w {here}")
        last = not todo
        text = _entry_problem(entry, st, trusted, final=last and not stat.S_ISLNK(st.st_mode))
        if text:
            yield text
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                yield f"{entry}: more than {MAX_LINKS} symlinks on the way"
                return
            try:
                target = os.readlink(entry)
            except OSError as e:
                yield f"{entry}: cannot read the link ({e.strerror})"
                return
            todo = _parts(target) + todo
            if target.startswith("/"):
                here = "/"
                root, problem = _stat(here)
                if root is None:
                    yield problem or here
                    return
                here_st = root
            continue
        if last:
            reached.append(st)
            return
        if not stat.S_ISDIR(st.st_mode):
            yield f"{entry}: not a directory"
            return
        here, here_st = entry, st


def _parts(path: str) -> List[str]:
    return [p for p in path.split("/") if p and p != "."]


def _stat(path: str) -> Tuple[Optional[os.stat_result], Optional[str]]:
    try:
        return os.stat(path), None
    except OSError as e:
        return None, f"{path}: cannot stat ({e.strerror})"


def writable_by_others(directory: str, st: os.stat_result) -> Optional[str]:
    """Why files we write in `directory` (its fstat `st`) could be planted or swapped by
    another user: owned by someone else, or writable by its group or others (sticky or
    not: a name we write can be taken first). None when only root (or we) can."""
    trusted = {0, os.geteuid()}
    if st.st_uid not in trusted:
        return f"{directory} is owned by {user_name(st.st_uid)} ({_describe(st)}), not root: chown root {directory}"
    if st.st_mode & _GROUP_OTHER_WRITE:
        return f"{directory} is writable by {_who(st.st_mode)} ({_describe(st)}): chmod go-w {directory}"
    return None


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
