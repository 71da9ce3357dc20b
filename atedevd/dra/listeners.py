"""The two sockets kubelet dials in DRA mode, held so that they outlive the process.

`<kubelet root>/plugins_registry/ate.dev-reg.sock` is where kubelet's plugin watcher finds us;
`<kubelet root>/plugins/ate.dev/dra.sock` is where it calls NodePrepareResources. Kubelet
(1.34-1.37, read from its code) registers a plugin when its registration socket appears and
forgets it when the file goes; it keeps one gRPC connection to the service socket and, when
that connection drops, dials the same path again at once. So a listening socket that stays
bound across our restart keeps the driver registered, and a call made while no process
serves waits in the socket's backlog (kubelet waits up to 20 s for the server's first bytes)
instead of failing: a failed prepare is tried again only at kubelet's next pod sync, a minute
or more later. Under systemd the listening sockets are kept in the unit's file descriptor
store (`FileDescriptorStoreMax=` in the DRA drop-in; `FDSTORE=1`) and handed to the next
start (`LISTEN_FDS`); a reload's successor is handed them directly. Their names carry the
identity of the file bound (its inode and change time), so that a file someone replaced since is
not taken for ours.
"""

import os
import re
import socket
import stat
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

from atedevd.dra.slices import DRIVER
from atedevd.upgrade.peers import HANDED_FDS

REGISTRY = "plugins_registry"
PLUGINS = "plugins"
REGISTRATION, SERVICE = "dra-registration", "dra-service"
LISTEN_FDS_START = 3


def kubelet_root(device_plugin_dir: str) -> str:
    """Kubelet's root directory (`--root-dir`): the one its device-plugin directory is in."""
    return os.path.dirname(os.path.normpath(device_plugin_dir))


def plugin_dir(root: str) -> str:
    """The driver's own directory: its service socket and its checkpoint."""
    return os.path.join(root, PLUGINS, DRIVER)


def paths(root: str) -> Dict[str, str]:
    return {REGISTRATION: os.path.join(root, REGISTRY, f"{DRIVER}-reg.sock"),
            SERVICE: os.path.join(plugin_dir(root), "dra.sock")}


def identity(path: str) -> Optional[str]:
    """Which socket file is at `path` ("<inode>-<ctime ns>"; an inode alone is soon reused once
    a file goes), or None where there is no socket."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return f"{st.st_ino}-{st.st_ctime_ns}" if stat.S_ISSOCK(st.st_mode) else None


class Listeners:
    """The listening sockets of one node: adopted from what this process was handed, or bound."""

    def __init__(self, root: str) -> None:
        self.paths = paths(root)
        self.sockets: Dict[str, socket.socket] = {}
        self.identities: Dict[str, str] = {}  # kind -> the identity of the file it was bound as
        self.adopted: List[str] = []  # the kinds handed to us, not bound here

    def adopt(self, handed: Mapping[str, int]) -> List[str]:
        """Take the listening sockets handed to us (`name.<identity>` -> fd) whose file is still
        the one bound; the others are closed. Returns what was not taken, and why."""
        refused = []
        for name, fd in handed.items():
            kind, _, ident = name.rpartition(".")
            try:
                s = socket.socket(fileno=fd)
            except OSError as e:  # not a socket at all (the store keeps any descriptor)
                try:
                    os.close(fd)
                except OSError:
                    pass
                refused.append(f"{name}: not a socket ({e.strerror or e})")
                continue
            path = self.paths.get(kind)
            why = ""
            if path is None or not re.fullmatch(r"\d+-\d+", ident):
                why = f"{name}: not one of ours"
            elif s.family != socket.AF_UNIX or not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                why = f"{name}: not a listening unix socket"
            elif identity(path) != ident:  # (and so one name a kind: the file has one identity)
                why = f"{name}: {path} is no longer the socket it was bound to (removed or replaced)"
            if why:
                s.close()
                refused.append(why)
                continue
            s.setblocking(False)
            self.sockets[kind], self.identities[kind] = s, ident
            self.adopted.append(kind)
        return refused

    def bind(self) -> List[str]:
        """Bind whatever was not handed to us (the service first: kubelet dials it once it has
        registered us); returns the kinds bound. Raises OSError."""
        bound = []
        for kind in (SERVICE, REGISTRATION):
            if kind in self.sockets:
                continue
            path = self.paths[kind]
            os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
            if not os.access(os.path.dirname(path), os.W_OK):  # (a read-only view: say which)
                raise OSError(30, "not writable here", os.path.dirname(path))
            if os.path.lexists(path):
                os.unlink(path)  # (ours by name: an earlier run's, no process serves it)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind(path)
                os.chmod(path, 0o600)
                s.listen(128)
            except OSError:
                s.close()
                raise
            s.setblocking(False)
            self.sockets[kind], self.identities[kind] = s, identity(path) or ""
            bound.append(kind)
        return bound

    def names(self) -> Dict[str, int]:
        """`name.<identity>` -> fd: how they are stored with systemd and handed to a successor."""
        return {f"{kind}.{self.identities[kind]}": s.fileno() for kind, s in self.sockets.items()}

    def missing(self) -> Optional[str]:
        """A socket file of ours that is gone or was replaced (kubelet forgets us when the
        registration socket goes), or None."""
        for kind, ident in self.identities.items():
            if identity(self.paths[kind]) != ident:
                return self.paths[kind]
        return None

    def remove_files(self) -> None:
        """The files go where they are still ours (the registration first: kubelet forgets the
        driver before its service goes); the sockets stay open until `close`."""
        for kind in (REGISTRATION, SERVICE):
            if kind in self.identities and identity(self.paths[kind]) == self.identities[kind]:
                try:
                    os.unlink(self.paths[kind])
                except OSError:
                    pass

    def close(self, remove: bool) -> None:
        """Our copies closed; `remove`: the files too, where they are still ours (the
        registration first: kubelet forgets the driver before its service goes)."""
        for kind in (REGISTRATION, SERVICE):
            s = self.sockets.pop(kind, None)
            if s is None:
                continue
            if remove and identity(self.paths[kind]) == self.identities.get(kind):
                try:
                    os.unlink(self.paths[kind])
                except OSError:
                    pass
            s.close()
        self.identities.clear()


def handed_to_us(environ: MutableMapping[str, str]) -> Tuple[Dict[str, int], str]:
    """The listening sockets this process was started with: from a reload's predecessor
    (HANDED), or from systemd's file descriptor store (LISTEN_FDS, for this pid); the
    variables are taken out of the environment. Returns (name -> fd, "") or ({}, why not)."""
    handed = environ.pop(HANDED_FDS, None)
    count, pid = environ.pop("LISTEN_FDS", ""), environ.pop("LISTEN_PID", "")
    names = environ.pop("LISTEN_FDNAMES", "").split(":")
    if handed is not None:  # (systemd's were for our predecessor, whose pid LISTEN_PID names)
        out = {}
        for item in handed.split(","):
            name, _, fd = item.partition("=")
            if name and fd.isdigit():
                try:
                    os.set_inheritable(int(fd), False)
                except OSError:
                    continue  # (not open: nothing handed there)
                out[name] = int(fd)
        return out, ""
    if not count:
        return {}, ""
    if pid != str(os.getpid()):
        return {}, f"LISTEN_FDS is for pid {pid}, not ours"
    if not count.isdigit():
        return {}, f"LISTEN_FDS={count!r}"
    found: Dict[str, int] = {}
    for i in range(int(count)):
        os.set_inheritable(LISTEN_FDS_START + i, False)
        found[names[i] if i < len(names) and names[i] else f"unknown{i}"] = LISTEN_FDS_START + i
    return found, ""
