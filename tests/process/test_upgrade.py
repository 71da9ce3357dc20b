"""An upgrade handed to a warm successor: the daemon as a process, the package replaced under it.

The daemon runs from a copy of the package; "upgrading" replaces a file of the copy by a
rename, as the package manager does. SIGHUP then finds the installed atedevd is not the
one running: the successor (a fresh exec of the same command line, the new code) binds,
is ready, registers once kubelet let go of us (kubelet 1.32) or beside us (the current
kubelet, `kubelet_endpoints = "per-socket"`), becomes the main process (MAINPID=) and we
exit. A successor that fails at any step leaves us serving, registered, with one ERROR.
"""

import os
import signal
import socket
import sys
import time

import pytest

from rig.harness import REPO, RESOURCE, wait_until
from rig.kubelet_standin import AdmissionLog

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make check`

LINE = "ERROR upgrade: the new atedevd failed"


def launcher(site, before: str = "") -> tuple:
    """`python3 -c`: the CLI from `site` (the successor is started the same way)."""
    return ("-c", f"import sys; sys.path.insert(0, {str(site)!r}); {before}\n"
                  "from atedevd.launch import main; sys.exit(main(sys.argv[1:]))")


def replace(site, relpath: str, text: str) -> None:
    """The package manager's way: the new file written beside, then renamed over the old."""
    path = site / "atedevd" / relpath
    tmp = path.with_name(path.name + ".dpkg-new")
    tmp.write_text(text)
    os.rename(tmp, path)


def upgrade(site) -> None:
    replace(site, "_build.py", (site / "atedevd" / "_build.py").read_text() + "# upgraded\n")


def config(tmp_path, endpoints: str = "per-resource") -> str:
    path = tmp_path / "c.toml"
    path.write_text(f'[daemon]\nkubelet_endpoints = "{endpoints}"\n[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\n')
    return str(path)


def registered(d, kubelet) -> None:
    """Registered, and the start's deferred work done: it notes the installed files, which a
    reload compares to tell an upgrade (its DEBUG line: `d` logs at debug)."""
    d.wait_ready()
    assert kubelet.wait_connected(RESOURCE), d.log()
    assert wait_until(lambda: ": registered, " in (d.status() or ""), 10), (d.status(), d.log())
    assert wait_until(lambda: "start-up done" in d.log(), 5), d.log()


def hup(d) -> int:
    n = len(d.notify.messages)
    d.send(signal.SIGHUP)
    assert d.notify.wait_for("RELOADING", "1", timeout=5, after=n), d.log()
    return n


@pytest.mark.parametrize("kubelet_mode, endpoints", [("1.32", "per-resource"), ("current", "per-resource"),
                                                    ("current", "per-socket")])
def test_an_upgrade_is_handed_to_the_new_atedevd(start_daemon, kubelet, installed, tmp_path, kubelet_mode, endpoints):
    d = start_daemon(config=config(tmp_path, endpoints), launcher=launcher(installed), log_level="debug")
    registered(d, kubelet)
    stream, mark = kubelet.live_streams(RESOURCE), kubelet.mark()
    admission = AdmissionLog(kubelet, RESOURCE).start()
    upgrade(installed)
    t0 = time.monotonic()
    n = hup(d)
    main = d.notify.wait_for("MAINPID", timeout=15, after=n)
    assert main, d.log()
    successor = int(main["fields"]["MAINPID"])
    with open(f"/proc/{successor}/stat") as f:  # not our child: a main process must be systemd's to watch
        assert int(f.read().rsplit(")", 1)[1].split()[1]) != d.pid
    assert d.wait(15) == 0, d.log()  # the old one exits, cleanly
    assert d.notify.wait_for("READY", "1", timeout=5, after=n), d.log()  # from the new main process
    kubelet.assert_healthy(RESOURCE, 1024, since=mark, new_registrations=1)
    t1 = time.monotonic()
    assert kubelet.live_streams(RESOURCE) != stream  # the new one's
    log = d.log()
    assert f"handed over to the new atedevd (pid {successor})" in log
    assert "took over as systemd's main process" in log and LINE not in log
    assert not [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line], log
    # The successor is ready as soon as its sockets are bound (not at its start's deferred
    # work, 0.5 s later), and neither side polls pod-resources through the upgrade (the old
    # one's exit waits for no listing: what kubelet lists is the new one's).
    new = log[log.index("upgrade: the installed atedevd"):]
    assert new.index("registering (an upgrade") < new.index("start-up done"), new
    calls = sum(c["answered"] + c["refused"] for c in kubelet.pod_resources_calls(since=t0).values())
    assert calls <= 4, (calls, log)
    seconds, spells, _ = admission.rejected(t0, t1)
    if endpoints == "per-socket":
        assert seconds == 0, f"rejected pods for {seconds * 1000:.1f} ms in {spells} spell(s)"
    print(f"upgrade ({kubelet_mode}, {endpoints}): kubelet would have rejected pods for {seconds * 1000:.1f} ms")
    os.kill(successor, signal.SIGTERM)
    assert wait_until(lambda: not os.path.exists(f"/proc/{successor}"), 10)


@pytest.mark.parametrize("broken, why", [
    ("raise SystemExit(3)", "it exited with status 3 before it was ready"),
    ("import time; time.sleep(60)", "was not ready within 2 s"),
])
def test_a_successor_that_fails_leaves_us_serving_with_one_error(start_daemon, kubelet, installed, tmp_path,
                                                                  broken, why):
    d = start_daemon(config=config(tmp_path), launcher=launcher(installed, "import atedevd.upgrade.machines as h; h.READY_LIMIT_S = 2"),
                     log_level="debug")
    registered(d, kubelet)
    stream, mark = kubelet.live_streams(RESOURCE), kubelet.mark()
    replace(installed, "launch.py", broken + "\n")  # the new atedevd cannot start (or hangs)
    n = hup(d)
    assert d.notify.wait_for("READY", "1", timeout=15, after=n), d.log()  # the reload is over: we serve on
    assert wait_until(lambda: LINE in d.log(), 5), d.log()
    log = d.log()
    assert f"{LINE}: {why}; the running one serves on" in log and log.count(" ERROR ") == 1, log
    assert d.proc.poll() is None
    assert kubelet.live_streams(RESOURCE) == stream and kubelet.register_calls[mark:] == []  # nothing moved
    kubelet.assert_healthy(RESOURCE, 1024, since=mark)


def test_a_successor_kubelet_refuses_is_stopped_and_we_register_again(start_daemon, kubelet, installed, tmp_path):
    """kubelet refuses the new one's Register: it is stopped after the limit, and we, who had
    handed off, take the registration back."""
    d = start_daemon(config=config(tmp_path),
                     launcher=launcher(installed, "import atedevd.upgrade.machines as h; h.REGISTER_LIMIT_S = 3"), log_level="debug")
    registered(d, kubelet)
    mark = kubelet.mark()
    ours = os.path.basename(kubelet.live_streams(RESOURCE)[0].endpoint).split(".")[2].split("-")[0]
    kubelet.refuse_registers(lambda endpoint: ours not in endpoint)  # only the new run's
    upgrade(installed)
    n = hup(d)
    assert d.notify.wait_for("READY", "1", timeout=20, after=n), d.log()
    assert wait_until(lambda: LINE in d.log(), 5), d.log()
    log = d.log()
    assert "was not registered within 3 s; the running one serves on and registers again" in log, log
    assert log.count(" ERROR ") == 1 and d.proc.poll() is None
    kubelet.refuse_registers(None)
    kubelet.assert_healthy(RESOURCE, 1024, since=mark, new_registrations=1)
    assert ours in kubelet.live_streams(RESOURCE)[0].endpoint  # ours again, on a new socket of our run


def test_the_running_daemon_imports_nothing_from_disk_once_started(start_daemon, kubelet, installed, tmp_path):
    """The package manager replaces our files while we run: a module imported after that is
    the new version's. Every import after the start's deferred work is reported (an audit
    hook) through a kubelet restart, a reload, an upgraded reload and the exit."""
    hook = ("import sys\n"
            "def _audit(event, args):\n"
            "    if event == 'import' and getattr(sys, 'atedevd_started', False):\n"
            "        import os; sys.stderr.write(f'IMPORTED AFTER START by {os.getpid()}: {args[0]}\\n')\n"
            "sys.addaudithook(_audit)\n"
            "import atedevd.daemon.loop as _d, atedevd.glue.process as _p\n"
            "_real = _d._DO[_p.StartWork]\n"
            "def _start_work(self, a):\n"
            "    _real(self, a)\n"
            "    sys.atedevd_started = True\n"
            "    sys.stderr.write('AUDIT ARMED\\n')\n"
            "_d._DO[_p.StartWork] = _start_work\n")
    d = start_daemon(config=config(tmp_path), launcher=launcher(installed, hook), metrics_dir=str(tmp_path),
                     log_level="debug")
    registered(d, kubelet)
    assert wait_until(lambda: "AUDIT ARMED" in d.log(), 5), d.log()  # the start's deferred work is done
    assert wait_until(lambda: os.path.exists(tmp_path / "atedevd.prom"), 5), d.log()  # metrics written: no tempfile
    kubelet.restart()
    assert kubelet.wait_connected(RESOURCE, registrations=2), d.log()
    hup(d)  # a plain reload
    assert d.notify.wait_for("READY", "1", timeout=5, after=len(d.notify.messages) - 1), d.log()
    upgrade(installed)
    hup(d)  # the upgraded one: the successor is started by an exec, not an import
    main = d.notify.wait_for("MAINPID", timeout=15)
    assert main and d.wait(15) == 0, d.log()
    os.kill(int(main["fields"]["MAINPID"]), signal.SIGTERM)
    old = [line for line in d.log().splitlines() if f"IMPORTED AFTER START by {d.pid}:" in line]
    assert not old, "\n".join(old)  # (the successor's own imports, of the new code, are its business)


def test_a_successor_that_hung_up_before_it_forked_is_named_by_its_exit_status():
    """Found by CI: a successor that exits at start closes the channel a moment before its
    status can be read (the kernel closes a process's descriptors first); the failure was
    then "closed its end of the channel" instead of "exited with status 3"."""
    from atedevd.upgrade import peers as upgrade

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # the successor before its fork: hangs up, then takes a while to exit
        ours.close()
        theirs.close()
        time.sleep(0.3)  # the window under test: hung up, not yet exited
        os._exit(3)
    theirs.close()
    child = upgrade.Child.__new__(upgrade.Child)  # its process and channel, made by hand
    child.spawned, child.pid, child.status, child.channel = pid, None, None, ours
    ours.settimeout(5)
    assert ours.recv(64) == b""  # hung up
    assert child.ended() is None  # still exiting: its status is not there yet
    assert child.ended(wait_s=2.0) == "exited with status 3" and child.spawned is None
    ours.close()


def test_the_successors_search_path_and_arguments_depend_on_nothing_where_we_were_started(tmp_path, monkeypatch):
    """The working directory (what `python3 -m` puts first), the script's directory, "" and
    relative entries are left out; a relative --config is made absolute (the successor runs in /)."""
    from atedevd.upgrade import peers as upgrade

    script = tmp_path / "bin" / "atedevd"
    script.parent.mkdir()
    script.write_text("")
    work = tmp_path / "work"
    work.mkdir()
    path = [str(work), "", "relative", str(tmp_path / "bin"), "/usr/lib/python3/dist-packages", REPO]
    assert upgrade.search_path(path, cwd=str(work), script=str(script)) == ["/usr/lib/python3/dist-packages", REPO]
    monkeypatch.chdir(work)
    assert upgrade._absolute_config(["run", "--config", "c.toml", "--log-level", "debug"]) == [
        "run", "--config", f"{work}/c.toml", "--log-level", "debug"]
    assert upgrade._absolute_config(["run", "--config=c.toml", "--dev-root", "/dev"]) == [
        "run", f"--config={work}/c.toml", "--dev-root", "/dev"]
    assert upgrade._absolute_config(["run", "--config", "/etc/atedevd/config.toml"]) == [
        "run", "--config", "/etc/atedevd/config.toml"]
    argv = upgrade._command_line()
    assert argv[:3] == [sys.executable, "-I", "-c"] and f"{upgrade.PACKAGE_DIR}/__init__.py" in argv[3]
    assert "os.chdir('/')" in argv[3]
