"""Which kubelet serves kubelet.sock (atedevd/kubelet/identity.py): the listener's PID, its program
found without a race, and the Kubernetes version in that program's Go build information. The real
kubelets 1.32 to 1.37 are read by the e2e suite (tests/e2e); here, programs made to the format."""

import os
import socket
import struct

import pytest

from atedevd.kubelet import identity

_START, _END = b"0w\xaf\x0c\x92t\x08\x02A\xe1\xc1\x07\xe6\xd6\x18\xe6", b"\xf92C1\x86\x18 r\x00\x82B\x10A\x16\xd8\xf2"


def uvarint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def go_program(path, modinfo=None, inline=True):
    """A 64-bit ELF file whose sections are a name table and, unless `modinfo` is None, a
    `.go.buildinfo` holding Go's version and `modinfo` as Go 1.18 and later write them."""
    names = b"\0.shstrtab\0.go.buildinfo\0"
    sections = [(b"", b"")]
    sections.append((b".shstrtab", names))
    if modinfo is not None:
        blob = _START + modinfo.encode() + _END
        header = b"\xff Go buildinf:" + bytes([8, 2 if inline else 0]) + b"\0" * 16
        sections.append((b".go.buildinfo", header + uvarint(8) + b"go1.26.8" + uvarint(len(blob)) + blob))
    body, offsets = b"", []
    for _, data in sections:
        offsets.append(64 + len(body))
        body += data
    shoff = 64 + len(body)
    table = b""
    for (name, data), offset in zip(sections, offsets):
        at = names.find(name + b"\0") if name else 0
        table += struct.pack("<IIQQQQIIQQ", at, 1, 0, 0, offset, len(data), 0, 0, 1, 0)
    head = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64,
                                                             len(sections), 1)
    path.write_bytes(head + body + table)
    return str(path)


MODULES = "path\tk8s.io/kubernetes/cmd/kubelet\nmod\tk8s.io/kubernetes\tv1.37.2\th1:x=\ndep\tgoogle.golang.org/grpc\tv1.82.1\th1:y=\n"


@pytest.mark.parametrize("modinfo,version", [
    (MODULES, "v1.37.2"),  # built from the module (the e2e suite's kubelets)
    ("path\tgithub.com/k3s-io/k3s\nmod\tgithub.com/k3s-io/k3s\tv1.30.2+k3s1\t\n"
     "dep\tk8s.io/kubernetes\tv1.30.2\n=>\tgithub.com/k3s-io/kubernetes\tv1.30.2-k3s1\th1:z=\n", "v1.30.2"),  # replaced
    ("path\tk8s.io/kubernetes/cmd/kubelet\nmod\tk8s.io/kubernetes\t(devel)\t\n"
     "build\t-ldflags=\"all=-X 'k8s.io/component-base/version.gitVersion=v1.36.3' -X 'k8s.io/x.y=z'\"\n", "v1.36.3"),  # its tree
    ("path\tk8s.io/kubernetes/cmd/kubelet\nmod\tk8s.io/kubernetes\t(devel)\t\nbuild\t-trimpath=true\n", None),  # nothing says
    ("path\tgo.etcd.io/etcd/server/v3\nmod\tgo.etcd.io/etcd/server/v3\tv3.6.17\th1:w=\n", None),  # not Kubernetes
])
def test_the_version_is_the_one_the_build_information_names(tmp_path, modinfo, version):
    assert identity.kubernetes_version(go_program(tmp_path / "kubelet", modinfo)) == version


def test_a_program_without_build_information_names_no_version_and_a_file_that_is_no_program_is_an_error(tmp_path):
    assert identity.build_info(go_program(tmp_path / "c", None)) is None  # an ELF program, not Go's
    assert identity.build_info(go_program(tmp_path / "old", MODULES, inline=False)) is None  # before Go 1.18
    (tmp_path / "script").write_text("#!/bin/sh\n")
    with pytest.raises(OSError):
        identity.kubernetes_version(str(tmp_path / "script"))
    (tmp_path / "cut").write_bytes(open(go_program(tmp_path / "whole", MODULES), "rb").read()[:100])
    assert identity.kubernetes_version(str(tmp_path / "cut")) is None  # its section table is gone


def test_the_listener_is_the_process_that_listens_and_nobody_is_none(tmp_path):
    path = str(tmp_path / "kubelet.sock")
    assert identity.listener_pid(path) is None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    assert identity.listener_pid(path) is None  # bound, not yet listened on: it refuses
    s.listen(1)
    try:
        assert identity.listener_pid(path) == os.getpid()
    finally:
        s.close()


def fake_proc(tmp_path, pid, argv0, started_at):
    """A /proc with one process: its command line and its start time (given on the wall clock;
    /proc/PID/stat counts it from the boot). No /proc/stat: the unit's ProcSubset=pid hides it."""
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(argv0.encode() + b"\0--config\0/x\0")
    ticks = round((started_at - identity.boot_time()) * os.sysconf("SC_CLK_TCK"))
    fields = ["S"] + ["0"] * 18 + [str(ticks)] + ["0"] * 10
    (proc / str(pid) / "stat").write_text(f"{pid} (kube let) " + " ".join(fields) + "\n")
    return str(proc)


def test_the_program_at_the_path_is_trusted_only_when_it_did_not_change_since_the_process_started(tmp_path):
    program = go_program(tmp_path / "kubelet", MODULES)
    changed = os.stat(program).st_ctime
    later = fake_proc(tmp_path / "a", 4242, program, changed + 60)  # started a minute after the file was made
    assert identity.program_of(4242, later) == (program, f"{program} (PID 4242's program, unchanged since it started)")
    earlier = fake_proc(tmp_path / "b", 4242, program, changed - 60)  # the file is newer than the process
    path, why = identity.program_of(4242, earlier)
    assert path is None and "changed after PID 4242 started" in why
    relative = fake_proc(tmp_path / "c", 4242, "kubelet", changed + 60)
    assert identity.program_of(4242, relative) == (None, "PID 4242 was started as 'kubelet', not by a full path")


def test_our_own_program_is_found_by_its_link_and_names_no_kubernetes(tmp_path):
    """Where the link of a process is ours to open (no user namespace between), it is used."""
    assert identity.program_of(os.getpid()) == (f"/proc/{os.getpid()}/exe", f"the program of PID {os.getpid()}")
    path = str(tmp_path / "kubelet.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    try:
        found = identity.kubelet_behind(path)
    finally:
        s.close()
    assert found.version is None and found.how == f"the program of PID {os.getpid()} names no Kubernetes version in its build information"
    assert not found.per_socket
    assert identity.kubelet_behind(path) == identity.KubeletFound(None, f"nobody accepts connections on {path}")


def test_a_start_time_from_the_clocks_is_the_one_proc_stat_gives():
    """The boot's time from the clocks, where the unit hides /proc/stat, matches its btime (whole seconds)."""
    with open("/proc/stat", "rb") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    assert abs(identity.boot_time() - btime) <= 1.0, (identity.boot_time(), btime)
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    started = identity._started_at(os.getpid(), "/proc")
    assert isinstance(started, float) and abs(started - (btime + ticks / os.sysconf("SC_CLK_TCK"))) <= 1.0, started
