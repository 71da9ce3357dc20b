"""What a fleet sees of a node, under a real systemd: atedevd.service in its sandbox writes
atedevd.prom into node_exporter's directory (the unit's ReadWritePaths= exception), and
Debian's node_exporter on the host, reading that directory of the container's root, serves
it; `atedevd check --json` on the node.

A booted Debian bookworm container (rig/container.py), as in test_systemd.py.
"""

import json
import os
import stat

import pytest

from rig.container import (FULL, RESOURCE, STANDIN_UNIT, TEST_LIB, Container, cached_rootfs, diagnostics, fake_kvm,
                           install_project, standin_state, start_standin, wait_registered, wait_until)
from rig.harness import crash_when_file_appears
from rig.metrics_scrape import NodeExporter, value

ROOTFS = (FULL,)  # built in the background from the session's start (conftest.py)
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"  # what prometheus-node-exporter's package creates


@pytest.fixture(scope="module")
def node():
    with Container(cached_rootfs(FULL)) as n:
        install_project(n)
        fake_kvm(n)
        n.run("mkdir", "-p", "-m", "0755", TEXTFILE_DIR)
        start_standin(n)
        yield n


@pytest.fixture
def exporter(node, tmp_path):
    ne = NodeExporter(str(node.path(TEXTFILE_DIR)), str(tmp_path / "node_exporter.log"))
    yield ne
    ne.close()


def test_the_sandboxed_service_writes_metrics_node_exporter_serves(node, exporter):
    node.systemctl("start", "atedevd")
    wait_registered(node, 1)
    r = dict(resource=RESOURCE)

    def registered(n):
        return lambda s: value(s, "atedevd_resource_registered", **r) == 1 \
            and value(s, "atedevd_resource_registrations_total", **r) == n \
            and value(s, "atedevd_resource_kubelet_allocatable_units", **r) == 1024

    s, text = exporter.wait_for(registered(1))
    assert registered(1)(s), text + diagnostics(node)
    assert value(s, "node_textfile_scrape_error") == 0, text
    assert value(s, "atedevd_resource_units_healthy", **r) == 1024, text
    # By default, with no config: the directory exists, so it is used; the sandbox lets it be written.
    st = os.stat(node.path(f"{TEXTFILE_DIR}/atedevd.prom"))
    assert stat.S_IMODE(st.st_mode) == 0o644 and st.st_uid == 0
    assert sorted(os.listdir(node.path(TEXTFILE_DIR))) == ["atedevd.prom"]
    journal = node.journal("-u", "atedevd", "-p", "warning")
    assert "cannot write metrics" not in journal, journal

    restarts = standin_state(node)["restarts"]
    node.systemctl("kill", "--signal=SIGHUP", STANDIN_UNIT)  # a kubelet restart: sockets wiped, kubelet.sock anew
    wait_until(lambda: standin_state(node)["restarts"] > restarts, 20, "stand-in restart")
    wait_registered(node, 2)
    s, text = exporter.wait_for(registered(2))
    assert registered(2)(s), text + diagnostics(node)
    assert value(s, "atedevd_resource_register_calls_total", reason="kubelet-restarted", **r) == 1, text

    node.systemctl("stop", "atedevd")
    s, text = exporter.wait_for(lambda s: value(s, "atedevd_resource_state", state="stopped", **r) == 1)
    assert value(s, "atedevd_resource_registered", **r) == 0, text


def test_check_json_on_the_node_and_the_char_link_fix(node):
    """The container's /dev/kvm is made with mknod, not by udev: no /dev/char/10:232. node_exporter's
    textfile directory exists and the shipped unit's sandbox lets the daemon write there."""
    node.run("mkdir", "-p", "/var/lib/prometheus/node-exporter")
    node.systemctl("start", "atedevd")
    wait_registered(node, 1)
    node.run("rm", "-f", "/dev/char/10:232")
    p = node.run("atedevd", "check", "--json", check=False)
    doc = json.loads(p.stdout)
    assert p.returncode == doc["exit_code"] == 0 and doc["ready"] is True, p.stdout
    assert doc["config"] is None and doc["devices"][0]["device_number"] == "10:232"
    by = {f["check"]: f for f in doc["findings"]}
    assert by["sandbox"]["status"] == "ok" and "ReadWritePaths=" in by["sandbox"]["message"], by["sandbox"]
    assert by["kubelet-count"] == {"check": "kubelet-count", "subject": RESOURCE, "status": "ok",
                                   "message": "kubelet counts 1024 allocatable, as we advertise", "fix": None}
    assert by["metrics"] == {"check": "metrics", "subject": "/var/lib/prometheus/node-exporter", "status": "ok",
                             "message": "atedevd.prom is written to /var/lib/prometheus/node-exporter", "fix": None}
    link = by["char-link"]
    assert link["status"] == "warning" and link["message"] == "/dev/char/10:232 is missing", link
    node.sh(link["fix"].split(" or: ", 1)[1])  # the fix as printed: the link
    doc = json.loads(node.run("atedevd", "check", "--json").stdout)
    assert {f["check"]: f for f in doc["findings"]}["char-link"]["status"] == "ok", doc
    node.systemctl("stop", "atedevd")


CRASHY = crash_when_file_appears("injected by the test")  # the real CLI, made to crash on cue
CRASHY_DROPIN = "/etc/systemd/system/atedevd.service.d/crashy.conf"


def test_a_crash_shows_its_traceback_at_priority_err(node):
    """`journalctl -p err -u atedevd` (and so `systemctl status`) shows the traceback."""
    node.write(f"{TEST_LIB}/crashy.py", CRASHY)
    node.write(CRASHY_DROPIN, f"[Service]\nExecStart=\nExecStart=/usr/bin/python3 {TEST_LIB}/crashy.py run\n")
    node.daemon_reload()
    try:
        node.systemctl("start", "atedevd")
        wait_registered(node, 1)
        pid = node.main_pid()
        node.run("touch", "/var/lib/kubelet/device-plugins/crash-now")
        wait_until(lambda: node.main_pid() not in (0, pid), 30, "the crash and the restart", lambda: diagnostics(node))

        def err_lines():  # the only crash in this container; no --after-cursor: journalctl placed the
            # native entry before a cursor taken earlier, in some runs here
            return node.journal("-u", "atedevd", "-p", "err", "-o", "cat").splitlines()

        # Two ways in, stored in the order journald reads them: the error line (native
        # protocol, with its fields) and the traceback (stderr, each line with a <3> prefix).
        crashed = "crashed, exiting with status 1: RuntimeError: injected by the test"
        wait_until(lambda: {crashed, "RuntimeError: injected by the test"} <= set(err_lines()), 15,
                   "the error line and the traceback at priority err", lambda: repr(err_lines()))
        fields = node.journal("-u", "atedevd", "ATEDEVD_EVENT=crashed", "-o", "json")
        assert "RuntimeError: injected by the test" in json.loads(fields.splitlines()[0])["ATEDEVD_TRACEBACK"], fields
        lines = err_lines()
        trace = lines[lines.index("Traceback (most recent call last):"):]
        assert any("in on_directory_events" in line for line in trace), lines
        assert trace.index("RuntimeError: injected by the test") > 0, lines
    finally:
        node.systemctl("stop", "atedevd", check=False)  # first: deleting crash-now would crash it again
        node.run("rm", "-f", CRASHY_DROPIN, "/var/lib/kubelet/device-plugins/crash-now")
        node.daemon_reload()
        node.systemctl("reset-failed", "atedevd", check=False)
