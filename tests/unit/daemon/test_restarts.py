"""The crash-loop brake (atedevd/daemon/restarts.py): no wait after a clean end or a first crash,
an escalating one for quick crashes in a row. Under a real systemd: test_systemd.py."""

import os
import signal

import pytest

from atedevd.daemon import restarts
from rig.harness import DaemonUnderTest, fake_dev_root
from rig.kubelet_standin import Kubelet


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now
        self.slept = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def start(path, clock, err=None) -> float:
    return restarts.begin(path, sleep=clock.sleep, clock=clock, err=err or open(os.devnull, "w"))


def test_only_under_systemd():
    assert restarts.marker_path({}) is None
    assert restarts.marker_path({"RUNTIME_DIRECTORY": "/run/atedevd"}) is None  # not started by systemd
    assert restarts.marker_path({"RUNTIME_DIRECTORY": "/run/atedevd:/run/x", "INVOCATION_ID": "ab"}) == "/run/atedevd/unclean"


def test_delays_escalate_and_are_capped():
    assert [restarts.delay(n) for n in range(9)] == [0, 0, 0.25, 0.5, 1, 2, 4, 8, 10]
    assert restarts.delay(1000) == restarts.MAX_DELAY_S


def test_clean_ends_never_wait(tmp_path):
    path, clock = str(tmp_path / "unclean"), Clock()
    for _ in range(5):
        assert start(path, clock) == 0
        assert os.path.exists(path)  # while the run lasts
        clock.now += 0.1
        restarts.ended_cleanly(path)
        assert not os.path.exists(path)


def test_quick_crashes_in_a_row_wait_longer_and_longer(tmp_path):
    path, clock = str(tmp_path / "unclean"), Clock()
    waits = []
    for _ in range(8):
        waits.append(start(path, clock))
        clock.now += 0.3  # the run dies 0.3 s after its start, without ending cleanly
    assert waits == [0, 0, 0.25, 0.5, 1, 2, 4, 8]  # the first start is clean, the first crash free


def test_a_run_that_lasted_starts_a_new_series(tmp_path):
    path, clock = str(tmp_path / "unclean"), Clock()
    for _ in range(5):
        start(path, clock)
        clock.now += 0.3
    assert start(path, clock) == 2  # in a loop
    clock.now += restarts.STABLE_S + 0.1  # this run lasted: its crash is a first one again
    assert start(path, clock) == 0
    clock.now += 0.3
    assert start(path, clock) == 0.25


@pytest.mark.parametrize("text", ["", "garbage", "3", "1 2 3"])
def test_a_damaged_marker_counts_as_one_crash_long_ago(tmp_path, text):
    path, clock = tmp_path / "unclean", Clock()
    path.write_text(text)
    assert start(str(path), clock) == 0
    clock.now += 0.3
    assert start(str(path), clock) == 0.25  # and the series goes on from there


def test_a_marker_from_a_later_clock_starts_a_new_series(tmp_path):
    path = tmp_path / "unclean"
    path.write_text("6 99999.0\n")  # not this boot's CLOCK_MONOTONIC
    assert start(str(path), Clock(now=5.0)) == 0


def test_no_runtime_directory_costs_nothing(tmp_path):
    assert start(str(tmp_path / "missing" / "unclean"), Clock()) == 0
    restarts.ended_cleanly(str(tmp_path / "missing" / "unclean"))


def test_the_wait_is_said(tmp_path):
    path, clock = str(tmp_path / "unclean"), Clock()
    start(path, clock)
    clock.now += 0.3
    start(path, clock)
    clock.now += 0.3
    err = open(tmp_path / "err", "w")
    start(path, clock, err=err)
    err.close()
    text = (tmp_path / "err").read_text()
    assert "waiting 0.25 s before starting again" in text and "2 unclean ends in a row" in text, text


def test_the_daemon_keeps_and_clears_the_marker(tmp_path):
    """As systemd runs it: kill -9 leaves the marker, so three quick kills make the fourth
    start wait (and say so); a SIGTERM stop clears it, so the next start waits for nothing."""
    dev, plugin_dir = fake_dev_root(str(tmp_path / "dev")), str(tmp_path / "dp")
    os.makedirs(plugin_dir)
    workdir = str(tmp_path / "run")
    env = {"INVOCATION_ID": "0123456789abcdef0123456789abcdef"}
    marker = os.path.join(workdir, restarts.MARKER)
    kubelet = Kubelet(plugin_dir)
    kubelet.start()
    try:
        logs = []
        for n in range(4):
            d = DaemonUnderTest(workdir, plugin_dir, dev, env=env)
            d.wait_ready(30)
            assert os.path.exists(marker), d.log()
            d.stop(signal.SIGKILL)
            logs.append(d.log())
        assert not any("before starting again" in text for text in logs[:2]), logs
        assert "waiting 0.25 s before starting again" in logs[2], logs[2]
        assert "waiting 0.5 s before starting again" in logs[3], logs[3]
        d = DaemonUnderTest(workdir, plugin_dir, dev, env=env)
        d.wait_ready(30)
        assert d.stop(signal.SIGTERM) == 0
        assert not os.path.exists(marker), d.log()
        d = DaemonUnderTest(workdir, plugin_dir, dev, env=env)
        d.wait_ready(30)
        assert "before starting again" not in d.log()
        d.stop(signal.SIGTERM)
    finally:
        kubelet.close()
