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
from typing import Dict, Iterator, List, Optional, Set, Tuple

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


def device_problems(path: str, memo: Optional[Dict[str, List[str]]] = None) -> List[str]:
    """Why a device node's path could be redirected by someone other than root: every directory
    and link the kernel walks to reach the node, but not the node itself (its owner and mode are
    the device's, and nobody replaces it without the right to write its directory). [] when only
    root can. `memo`: the verdicts of directories already walked in this look (a pattern's two
    thousand matches share one directory)."""
    trusted = {0, os.geteuid()}
    directory, name = os.path.split(path if os.path.isabs(path) else os.path.join(os.getcwd(), path))
    found = _directory(directory, trusted, memo)
    if found or not name:
        return list(found)
    try:
        dir_st = os.stat(directory)
        st = os.lstat(path)
    except OSError:
        return []  # nothing there (yet): judged when it appears
    if dir_st.st_mode & _GROUP_OTHER_WRITE and not (dir_st.st_mode & stat.S_ISVTX and st.st_uid in trusted):
        return [f"{directory} is writable by {_who(dir_st.st_mode)} ({_describe(dir_st)}), "
                f"so {path} can be replaced: chmod go-w {directory}"]
    if not stat.S_ISLNK(st.st_mode):
        return []
    out: List[str] = []  # a link: as trusted as its owner, then the way it leads, node excepted
    for text in _walk(path, trusted, [], final="node", missing_ok=True):
        if text not in out:
            out.append(text)
    return out


def directory_problems(path: str, memo: Optional[Dict[str, List[str]]] = None) -> List[str]:
    """Why someone other than root could add, replace or remove entries in directory `path`, or
    replace it: every entry on the way judged as `problems` judges them, and the directory
    writable by neither group nor others, sticky or not (anyone may add a name to a sticky
    one). What a pattern's directory must be."""
    return list(_directory(path, {0, os.geteuid()}, memo, whole=True))


def _directory(path: str, trusted: Set[int], memo: Optional[Dict[str, List[str]]], whole: bool = False) -> List[str]:
    key = ("=" if whole else "") + path
    if memo is not None and key in memo:
        return memo[key]
    found: List[str] = []
    reached: List[os.stat_result] = []
    for text in _walk(path, trusted, reached, final="dir", missing_ok=True):  # one not there yet: judged when it appears
        if text not in found:
            found.append(text)
    if whole and reached and not found and reached[0].st_mode & _GROUP_OTHER_WRITE:
        st = reached[0]
        found.append(f"{path} is writable by {_who(st.st_mode)} ({_describe(st)}), so anyone may add a node or a "
                     f"link to it: chmod go-w {path}")
    if memo is not None:
        memo[key] = found
    return found


def _walk(path: str, trusted: Set[int], reached: List[os.stat_result], final: str = "file",
          missing_ok: bool = False) -> Iterator[str]:
    """Every entry the kernel looks up on the way to `path`, links followed as it follows them:
    its own owner, and whether its directory lets others replace it. The file reached is
    appended to `reached`. What is judged of the entry reached itself: `final` "file", its
    owner and mode (the configuration's); "dir", its owner (its mode is its entries'
    business); "node", nothing (a device node's owner and mode are the device's). With
    `missing_ok`, a name not there ends the walk with nothing said (a device's way is judged
    again when it appears)."""
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
        except FileNotFoundError as e:
            if not missing_ok:
                yield f"{entry}: cannot stat ({e.strerror})"
            return
        except OSError as e:
            yield f"{entry}: cannot stat ({e.strerror})"
            return
        if here_st.st_mode & _GROUP_OTHER_WRITE and not (here_st.st_mode & stat.S_ISVTX and st.st_uid in trusted):
            yield (f"{here} is writable by {_who(here_st.st_mode)} ({_describe(here_st)}), "
                   f"so {entry} can be replaced: chmod go-w {here}")
        last = not todo
        reached_here = last and not stat.S_ISLNK(st.st_mode)
        text = None if reached_here and final == "node" else \
            _entry_problem(entry, st, trusted, final=reached_here and final == "file")
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
