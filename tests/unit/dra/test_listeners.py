"""The two listening sockets kubelet dials in DRA mode: bound at their paths, named by the identity (inode and change time)
of the file bound, taken back when handed over (from a reload's predecessor or systemd's file
descriptor store) only while that file is still theirs."""

import errno
import os
import select
import shutil
import socket
import stat
import tempfile

import pytest

from atedevd.dra import listeners as li
from atedevd.upgrade.peers import HANDED_FDS


@pytest.fixture
def root():
    """Kubelet's root, short, under /tmp: a unix socket path has 107 bytes."""
    r = tempfile.mkdtemp(prefix="ate", dir="/tmp")
    yield r
    shutil.rmtree(r, ignore_errors=True)


@pytest.fixture
def bound(root):
    ls = li.Listeners(root)
    ls.bind()
    yield ls
    ls.close(remove=False)


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        return e.errno == errno.EBADF
    return False


def rebind(path: str) -> socket.socket:
    """Someone else's socket at `path` now (removed and bound anew)."""
    os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    return s


def handed(ls: li.Listeners):
    """ls's sockets as a successor is handed them: its own copies of the fds."""
    return {name: os.dup(fd) for name, fd in ls.names().items()}


def test_paths_are_where_kubelet_looks_for_the_driver(root):
    assert li.paths(root) == {"dra-registration": f"{root}/plugins_registry/ate.dev-reg.sock",
                              "dra-service": f"{root}/plugins/ate.dev/dra.sock"}
    assert li.kubelet_root("/var/lib/kubelet/device-plugins/") == "/var/lib/kubelet"
    assert li.plugin_dir("/var/lib/kubelet") == "/var/lib/kubelet/plugins/ate.dev"


def test_bind_makes_both_sockets_at_their_paths_mode_0600_and_listening(root):
    ls = li.Listeners(root)
    os.makedirs(os.path.dirname(ls.paths[li.SERVICE]))
    with open(ls.paths[li.SERVICE], "w"):
        pass  # (an earlier run's leftover by that name: replaced)
    try:
        assert ls.bind() == [li.SERVICE, li.REGISTRATION]
        assert ls.adopted == []
        for kind, path in li.paths(root).items():
            st = os.lstat(path)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
            s = ls.sockets[kind]
            assert (s.family, s.type, s.getsockname()) == (socket.AF_UNIX, socket.SOCK_STREAM, path)
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            assert ls.identities[kind] == f"{st.st_ino}-{st.st_ctime_ns}" and type(ls.identities[kind]) is str
            assert s.gettimeout() == 0.0  # non-blocking: the relay's select() accepts
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(path)
                assert select.select([s], [], [], 10)[0] == [s]
                s.accept()[0].close()
        assert ls.bind() == []  # both there: nothing bound again
    finally:
        ls.close(remove=True)


def test_names_carry_the_identity_of_each_file_and_its_fd(bound):
    ino = {kind: li.identity(path) for kind, path in bound.paths.items()}
    names = bound.names()
    assert names == {f"dra-registration.{ino[li.REGISTRATION]}": bound.sockets[li.REGISTRATION].fileno(),
                     f"dra-service.{ino[li.SERVICE]}": bound.sockets[li.SERVICE].fileno()}
    assert all(type(fd) is int for fd in names.values())


def test_adopt_takes_handed_sockets_whose_files_are_unchanged(root, bound):
    fds = handed(bound)
    successor = li.Listeners(root)
    try:
        assert successor.adopt(fds) == []
        assert sorted(successor.adopted) == [li.REGISTRATION, li.SERVICE]
        assert {k: s.fileno() for k, s in successor.sockets.items()} == {n.rpartition(".")[0]: fd for n, fd in fds.items()}
        assert successor.identities == bound.identities and successor.names() == dict(zip(bound.names(), fds.values()))
        assert successor.bind() == []  # nothing to bind: the files stay the ones handed over
        assert {k: li.identity(p) for k, p in successor.paths.items()} == bound.identities
        s = successor.sockets[li.SERVICE]
        assert s.gettimeout() == 0.0
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(successor.paths[li.SERVICE])  # the same listening socket: either accepts it
            assert select.select([s], [], [], 10)[0] == [s]
            s.accept()[0].close()
    finally:
        successor.close(remove=False)


@pytest.mark.parametrize("how", ["removed", "rebound"])
def test_adopt_refuses_and_closes_a_socket_whose_file_is_gone_or_someone_else_s(root, bound, how):
    path = bound.paths[li.SERVICE]
    other = None
    if how == "removed":
        os.unlink(path)
    else:
        other = rebind(path)
        assert li.identity(path) != bound.identities[li.SERVICE]
    fds = handed(bound)
    name = f"dra-service.{bound.identities[li.SERVICE]}"
    successor = li.Listeners(root)
    try:
        refused = successor.adopt(fds)
        assert refused == [f"{name}: {path} is no longer the socket it was bound to (removed or replaced)"]
        assert closed(fds[name])
        assert successor.adopted == [li.REGISTRATION] and list(successor.sockets) == [li.REGISTRATION]
        assert successor.bind() == [li.SERVICE]  # bound anew at its path
        assert li.identity(path) == successor.identities[li.SERVICE] != bound.identities[li.SERVICE]
    finally:
        successor.close(remove=False)
        if other is not None:
            other.close()


def test_adopt_refuses_and_closes_names_not_of_ours(root, bound):
    ino = bound.identities[li.SERVICE]
    fd = bound.sockets[li.SERVICE].fileno()
    fds = {"dra-other.12": os.dup(fd), "dra-service.x12": os.dup(fd), "dra-service": os.dup(fd), f"service.{ino}": os.dup(fd)}
    successor = li.Listeners(root)
    assert successor.adopt(fds) == [f"{n}: not one of ours" for n in fds]
    assert all(closed(fd) for fd in fds.values())
    assert successor.sockets == {} and successor.adopted == []


def test_adopt_refuses_and_closes_a_socket_that_is_not_a_listening_unix_socket(root, bound):
    name = f"dra-service.{bound.identities[li.SERVICE]}"  # (a right name: the socket alone is wrong)
    connected, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    unbound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for s in (connected, datagram, tcp, unbound):
            fd = os.dup(s.fileno())
            successor = li.Listeners(root)
            assert successor.adopt({name: fd}) == [f"{name}: not a listening unix socket"], s
            assert closed(fd) and successor.sockets == {}
    finally:
        for s in (connected, peer, datagram, tcp, unbound):
            s.close()


def test_adopt_refuses_and_closes_a_fd_that_is_no_socket_at_all(root, bound):
    r, w = os.pipe()
    os.close(w)
    successor = li.Listeners(root)
    try:
        refused = successor.adopt({"other-thing.1": r, **handed(bound)})
        assert len(refused) == 1 and refused[0].startswith("other-thing.1: not a socket") and closed(r)
        assert sorted(successor.adopted) == [li.REGISTRATION, li.SERVICE]
    finally:
        successor.close(remove=False)
        if not closed(r):
            os.close(r)


def test_missing_names_a_file_removed_or_replaced(root):
    ls = li.Listeners(root)
    ls.bind()
    other = None
    try:
        assert ls.missing() is None
        os.unlink(ls.paths[li.REGISTRATION])
        assert ls.missing() == ls.paths[li.REGISTRATION]
        ls.close(remove=False)
        ls.bind()
        assert ls.missing() is None
        other = rebind(ls.paths[li.SERVICE])
        assert ls.missing() == ls.paths[li.SERVICE]
        other.close()
        os.unlink(ls.paths[li.SERVICE])
        with open(ls.paths[li.SERVICE], "w"):
            pass  # (a file, not a socket, by that name)
        assert ls.missing() == ls.paths[li.SERVICE]
    finally:
        ls.close(remove=False)
        if other is not None:
            other.close()


def test_close_with_remove_removes_only_the_files_still_ours(root):
    ls = li.Listeners(root)
    ls.bind()
    ours = dict(ls.sockets)
    other = rebind(ls.paths[li.SERVICE])
    theirs = li.identity(ls.paths[li.SERVICE])
    try:
        assert theirs != ls.identities[li.SERVICE]
        ls.close(remove=True)
        assert not os.path.lexists(ls.paths[li.REGISTRATION])
        assert li.identity(ls.paths[li.SERVICE]) == theirs  # someone else's: kept
        assert all(s.fileno() == -1 for s in ours.values())
        assert ls.sockets == {} and ls.identities == {} and ls.missing() is None
    finally:
        other.close()


def test_close_without_remove_leaves_the_files(bound):
    ino = dict(bound.identities)
    socks = dict(bound.sockets)
    bound.close(remove=False)
    assert {k: li.identity(p) for k, p in bound.paths.items()} == ino
    assert all(s.fileno() == -1 for s in socks.values())


# --- what this process was handed -------------------------------------------------------------------


def test_handed_by_a_predecessor_parses_name_fd_pairs_and_pops_the_variable():
    a, b = os.pipe()
    try:
        os.set_inheritable(a, True)
        os.set_inheritable(b, True)
        env = {HANDED_FDS: f"dra-service.11={a},dra-registration.22={b},junk,dra-x.1=abc,={a}", "PATH": "/bin"}
        assert li.handed_to_us(env) == ({"dra-service.11": a, "dra-registration.22": b}, "")
        assert env == {"PATH": "/bin"}
        assert (os.get_inheritable(a), os.get_inheritable(b)) == (False, False)  # (not passed on to what we start)
    finally:
        os.close(a)
        os.close(b)
    assert HANDED_FDS == "ATEDEVD_DRA_FDS"


def test_nothing_handed_is_nothing_and_leaves_the_mapping():
    env = {"PATH": "/bin"}
    assert li.handed_to_us(env) == ({}, "")
    assert env == {"PATH": "/bin"}


def test_listen_fds_for_another_pid_is_refused_with_the_reason_and_popped():
    env = {"LISTEN_FDS": "2", "LISTEN_PID": "1", "LISTEN_FDNAMES": "dra-service.5:dra-registration.6", "PATH": "/bin"}
    before = {fd: os.get_inheritable(fd) for fd in (3, 4) if not closed(fd)}
    assert li.handed_to_us(env) == ({}, "LISTEN_FDS is for pid 1, not ours")
    assert env == {"PATH": "/bin"}
    assert {fd: os.get_inheritable(fd) for fd in before} == before  # (fds 3 and 4 not touched)


@pytest.mark.parametrize("count, why", [("0", ""), ("two", "LISTEN_FDS='two'")])
def test_listen_fds_of_no_fd_or_not_a_number_gives_none(count, why):
    env = {"LISTEN_FDS": count, "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": ""}
    assert li.handed_to_us(env) == ({}, why)
    assert env == {}


def test_listen_fds_from_systemd_are_named_and_adopted(root, bound):
    """As systemd hands the stored sockets: fds 3 and 4, LISTEN_PID ours, the names in
    LISTEN_FDNAMES (one left empty: named by its place). Whatever pytest holds at 3 and 4 is
    kept aside and put back exactly (same file, same inheritable flag); nothing else in this
    process runs Python meanwhile, and no other thread knows fds 3 and 4."""
    names = list(bound.names())
    service = next(n for n in names if n.startswith("dra-service."))
    registration = next(n for n in names if n.startswith("dra-registration."))
    saved, was = {}, {}
    for fd in (3, 4):
        if not closed(fd):
            saved[fd], was[fd] = (os.dup(fd), os.get_inheritable(fd)), os.fstat(fd)
    successor = li.Listeners(root)
    try:
        os.dup2(bound.sockets[li.SERVICE].fileno(), 3)
        os.dup2(bound.sockets[li.REGISTRATION].fileno(), 4)
        env = {"LISTEN_FDS": "2", "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": f"{service}:", "PATH": "/bin"}
        got, why = li.handed_to_us(env)
        assert (got, why) == ({service: 3, "unknown1": 4}, "") and env == {"PATH": "/bin"}
        assert (os.get_inheritable(3), os.get_inheritable(4)) == (False, False)
        got[registration] = got.pop("unknown1")  # (as if the name had been given)
        assert successor.adopt(got) == []
        assert {k: s.fileno() for k, s in successor.sockets.items()} == {li.SERVICE: 3, li.REGISTRATION: 4}
    finally:
        for s in successor.sockets.values():
            s.detach()  # (fds 3 and 4 are put back below, not closed by these objects)
        for fd in (3, 4):
            if fd in saved:
                copy, inheritable = saved[fd]
                os.dup2(copy, fd, inheritable=inheritable)
                os.close(copy)
            elif not closed(fd):
                os.close(fd)
    assert all(os.path.samestat(os.fstat(fd), st) and os.get_inheritable(fd) == saved[fd][1] for fd, st in was.items())
    assert all(closed(fd) for fd in (3, 4) if fd not in was)
