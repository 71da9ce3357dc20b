"""Try what atedevd's sandbox must forbid (and what it must allow); print the outcomes as one JSON line.

Run inside the test container, once under atedevd.service's own sandbox (a drop-in
swaps its ExecStart for this script) and once unconfined as the control. It only
reports: tests/systemd/test_systemd.py decides what each outcome must be.
Outcome per attempt: "ok", or the errno name (EROFS, EPERM, EAFNOSUPPORT, ...).
"""

import errno
import json
import os
import socket
import stat
import sys

PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def write(path, keep=False):
    def fn():
        with open(path, "w") as f:
            f.write("probe\n")
        if not keep:
            os.unlink(path)
    return fn


def sock(family, kind=socket.SOCK_STREAM):
    return lambda: socket.socket(family, kind).close()


def open_dev(path):
    def fn():
        os.close(os.open(path, os.O_RDWR))
    return fn


def mknod(path):
    def fn():
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        os.unlink(path)
    return fn


def own_listener_listed():
    """Bind a socket in a subdirectory of the plugin dir, rename it into place (as the standby
    is), accept a connection and find it in /proc/self/net/unix under its bind path: what the
    let-go wait reads to know that kubelet let go of an old socket."""
    sub = os.path.join(PLUGIN_DIR, ".atedevd-probe")
    os.makedirs(sub, exist_ok=True)
    bound, placed = os.path.join(sub, "p.sock"), os.path.join(PLUGIN_DIR, "atedevd-probe.sock")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(bound)
        listener.listen(1)
        os.rename(bound, placed)
        client = socket.socket(socket.AF_UNIX)
        client.connect(placed)
        conn, _ = listener.accept()
        with open("/proc/self/net/unix") as f:
            listed = sum(1 for line in f if line.rstrip("\n").split(None, 7)[7:] == [bound] and line.split()[5] == "03")
        conn.close()
        client.close()
        if listed != 1:
            raise OSError(errno.ENOENT, "accepted connection not listed")
    finally:
        listener.close()
        for path in (placed, bound):
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(sub)


def connect(path):
    def fn():
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
        finally:
            s.close()
    return fn


def status_fields():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("CapEff", "CapBnd", "NoNewPrivs", "Seccomp"):
                fields[key] = value.strip()
    return fields


def main() -> int:
    runtime = os.environ.get("RUNTIME_DIRECTORY", "/run")
    kept = "atedevd-probe-" + ("unit" if "INVOCATION_ID" in os.environ else "free")
    results = {
        "write /etc": attempt(write("/etc/atedevd-probe")),
        "write /usr": attempt(write("/usr/atedevd-probe")),
        "write /var/lib": attempt(write("/var/lib/atedevd-probe")),
        "write /var/lib/kubelet": attempt(write("/var/lib/kubelet/atedevd-probe")),
        "write /root": attempt(write("/root/atedevd-probe")),
        "write plugin dir": attempt(write(PLUGIN_DIR + "/atedevd-probe")),
        # Left behind on purpose: under PrivateTmp= nobody else may see them.
        "write /tmp": attempt(write(f"/tmp/{kept}", keep=True)),
        "write /var/tmp": attempt(write(f"/var/tmp/{kept}", keep=True)),
        "write runtime dir": attempt(write(os.path.join(runtime, "atedevd-probe"))),
        "socket AF_UNIX": attempt(sock(socket.AF_UNIX)),
        "socket AF_INET tcp": attempt(sock(socket.AF_INET)),
        "socket AF_INET6 tcp": attempt(sock(socket.AF_INET6)),
        "socket AF_INET udp": attempt(sock(socket.AF_INET, socket.SOCK_DGRAM)),
        "socket AF_NETLINK": attempt(sock(socket.AF_NETLINK, socket.SOCK_RAW)),
        "socket AF_PACKET": attempt(sock(socket.AF_PACKET, socket.SOCK_RAW)),
        "open /dev/kvm": attempt(open_dev("/dev/kvm")),
        "open /dev/net/tun": attempt(open_dev("/dev/net/tun")),
        "open /dev/null": attempt(open_dev("/dev/null")),
        "stat /dev/kvm": "chr" if stat.S_ISCHR(os.stat("/dev/kvm").st_mode) else "not a character device",
        "mknod": attempt(mknod(PLUGIN_DIR + "/atedevd-probe-node")),
        "setuid": attempt(lambda: os.setuid(65534)),
        "standby renamed in, its connection in /proc/self/net/unix": attempt(own_listener_listed),
        "connect pod-resources": attempt(connect("/var/lib/kubelet/pod-resources/kubelet.sock")),
        "status": status_fields(),
    }
    print("ATEDEVD-PROBE " + json.dumps(results, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
