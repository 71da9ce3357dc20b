"""A crash exits promptly with status 1, one ERROR line saying why, and the traceback
on stderr whatever the log level.

The daemon has no test hook for this: each test owns a wrapper that imports
the daemon, replaces one of its methods with one that raises, and runs the
real CLI (`atedevd.cli.main`), as a separate process.
"""

import os
import subprocess
import sys
import time

import pytest

from rig.harness import REPO, RESOURCE, NotifySocket, crash_when_file_appears

# Raises on the loop's thread when the test drops a file named "crash-now" into
# the plugin directory, while the gRPC server holds kubelet's ListAndWatch stream.
IN_THE_LOOP = crash_when_file_appears("injected by the test\nsecond line of the message")

# Raises after the first pass, before the loop (outside its try/finally), once
# kubelet's ListAndWatch stream is open (it writes its checkpoint on the first
# message): a gRPC worker thread is then busy with a stream nobody will end, and
# interpreter shutdown would wait for it for ever.
BEFORE_THE_LOOP = """
import os, sys, time
import atedevd.daemon.loop

plugin_dir = sys.argv[sys.argv.index("--device-plugin-dir") + 1]

perform = atedevd.daemon.loop.Daemon._perform
performed = []

def first_pass_then_crash(self, actions):
    perform(self, actions)
    performed.append(actions)
    if len(performed) > 1:  # the first is the start's: the first pass over the configuration
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not os.path.exists(os.path.join(plugin_dir, "kubelet_internal_checkpoint")):
        self.inbox.run()  # the first Register waits for pod-resources' answer, which the loop takes
        time.sleep(0.01)
    raise RuntimeError("injected by the test\\nsecond line of the message")

atedevd.daemon.loop.Daemon._perform = first_pass_then_crash
from atedevd import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("level", ["info", "error", "debug"])
@pytest.mark.parametrize("where", ["in-the-loop", "before-the-loop"])
def test_crash_exits_1_promptly_with_one_line_and_the_traceback(tmp_path, plugin_dir, dev_root, kubelet, where, level):
    config = tmp_path / "empty.toml"
    config.write_text("")
    notify = NotifySocket(str(tmp_path / "notify"))
    log_path = tmp_path / "daemon.log"
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, RUNTIME_DIRECTORY=str(tmp_path),
               PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    env.pop("JOURNAL_STREAM", None)
    env.pop("WATCHDOG_USEC", None)
    wrapper = IN_THE_LOOP if where == "in-the-loop" else BEFORE_THE_LOOP
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", wrapper, "run", "--config", str(config), "--device-plugin-dir", plugin_dir,
             "--dev-root", dev_root, "--log-level", level, "--metrics-dir", ""],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        assert kubelet.wait_connected(RESOURCE), log_path.read_text()  # a live stream on a gRPC thread
        crashed_at = time.monotonic()
        if where == "in-the-loop":
            assert notify.wait_for("READY", "1"), log_path.read_text()
            open(os.path.join(plugin_dir, "crash-now"), "w").close()
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 5 s after the crash; log:\n{log_path.read_text()}")
        took = time.monotonic() - crashed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
    text = log_path.read_text()  # stderr only
    assert code == 1, text
    assert took < 2.0, (took, text)
    errors = [line.split(" ", 1)[1] for line in text.splitlines() if " ERROR " in f" {line}"]  # past the timestamp
    assert errors == ["ERROR crashed, exiting with status 1: RuntimeError: injected by the test second line of the message"], text
    # The traceback once, after the ERROR line, at every level: where it broke and why.
    assert text.count("Traceback (most recent call last):") == 1, text
    trace = text[text.index("Traceback (most recent call last):"):]
    assert text.index(" ERROR crashed") < text.index("Traceback"), text
    frame = "in on_directory_events" if where == "in-the-loop" else "in first_pass_then_crash"
    assert frame in trace and "RuntimeError: injected by the test\nsecond line of the message" in trace, text


def test_under_journald_the_traceback_lines_carry_the_err_priority(monkeypatch, capsys):
    """journald reads a leading <3> on a stderr line as priority err (SyslogLevelPrefix=,
    on by default): `journalctl -p err -u atedevd` shows the traceback with the line."""
    from atedevd import cli

    monkeypatch.setattr(cli, "journal_is_stderr", lambda: True)
    try:
        raise ValueError("boom")
    except ValueError as e:
        cli._log_crash(e)
    lines = capsys.readouterr().err.splitlines()
    lines = lines[lines.index("<3>Traceback (most recent call last):"):]  # after the ERROR line, if logging printed it
    assert lines[0] == "<3>Traceback (most recent call last):" and lines[-1] == "<3>ValueError: boom", lines
    assert all(line.startswith("<3>") for line in lines), lines
