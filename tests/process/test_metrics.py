"""Metrics: atedevd.prom for node_exporter's textfile collector.

The rendering and the writer on their own (fast), then the daemon as a process with
Debian's real node_exporter reading the directory, scraped over loopback, through an
Allocate, a refused Allocate and a kubelet restart.
"""

import logging
import os
import re
import signal

import google.protobuf
import grpc
import pytest

from atedevd.config_file import load as loader
from atedevd.daemon import textfile
from atedevd.glue import metrics
from atedevd.registration.messages import State, Why
from atedevd.registration.report import Report
from rig.harness import RESOURCE
from rig.metrics_scrape import NodeExporter, parse, series, value

NAME = re.compile(r"atedevd_[a-z0-9_]+\Z")
INFO = metrics.DaemonInfo("0.1.0", "source", "1.51.1", "4.21.12", "3.11.2", 0.5)  # started at monotonic 0.5


def fake_registration(state=State.REGISTERED, kubelet_count=1024, healthy=True, begun=None, name=RESOURCE):
    served = state not in (State.UNSERVED, State.STOPPED)
    units = 1024 if served else 0
    return Report(
        name=name, device_path="/dev/kvm", pattern=False, state=state, changed_at=100.25, advertised=True, units=units,
        healthy_units=units if healthy else 0, kubelet_count=kubelet_count, registrations=3,
        begun=begun or {Why.FIRST: 1, Why.KUBELET_RESTARTED: 2}, registers_sent=4, allocate_calls=2,
        allocate_failures=1, refused_streams=0, last_error=None, failing_since=None, serve_error=None,
        last_reregistration=None)


def rendered(*regs, polling=False, reload_ok=True):
    text = metrics.render(INFO, regs, polling=polling, reload_ok=reload_ok, wall_offset=1700000000.0)
    return text, parse(text)


# --- rendering ------------------------------------------------------------------------------------


def test_every_family_is_named_typed_and_documented_by_the_conventions():
    text, (samples, kinds, helps) = rendered(fake_registration())
    families = set(kinds)
    assert families == set(helps)
    for name in families:
        assert NAME.match(name), name
        assert name.endswith("_total") == (kinds[name] == "counter"), name
        assert kinds[name] in ("gauge", "counter"), name
    for name, _ in samples:
        assert name in families, name  # no sample without its HELP and TYPE
    assert text.endswith("\n")


def test_a_registered_resource():
    _, (s, _, _) = rendered(fake_registration())
    r = dict(resource=RESOURCE)
    assert value(s, "atedevd_resource_registered", **r) == 1
    assert [k for k in series(s, "atedevd_resource_state") if value(s, *k[:1], **dict(k[1])) == 1] == \
        [("atedevd_resource_state", (("resource", RESOURCE), ("state", "registered")))]
    assert {dict(k[1])["state"] for k in series(s, "atedevd_resource_state")} == {st.value for st in State}
    assert value(s, "atedevd_resource_units_advertised", **r) == 1024
    assert value(s, "atedevd_resource_units_healthy", **r) == 1024
    assert value(s, "atedevd_resource_units", health="healthy", **r) == 1024
    assert value(s, "atedevd_resource_units", health="unhealthy", **r) == 0
    assert value(s, "atedevd_resource_kubelet_allocatable_units", **r) == 1024
    assert value(s, "atedevd_resource_registrations_total", **r) == 3
    assert value(s, "atedevd_resource_register_calls_total", reason="first-registration", **r) == 1
    assert value(s, "atedevd_resource_register_calls_total", reason="kubelet-restarted", **r) == 2
    assert value(s, "atedevd_resource_register_calls_total", reason="retry", **r) == 0  # present before it happens
    assert value(s, "atedevd_resource_allocate_calls_total", **r) == 2
    assert value(s, "atedevd_resource_allocate_failures_total", **r) == 1
    assert value(s, "atedevd_resource_state_change_timestamp_seconds", **r) == 1700000100.25
    assert value(s, "atedevd_build_info", version="0.1.0", flavour="source", grpcio="1.51.1", protobuf="4.21.12", python="3.11.2") == 1
    assert value(s, "atedevd_start_time_seconds") == 1700000000.5
    assert value(s, "atedevd_watch_mode", mode="inotify") == 1 and value(s, "atedevd_watch_mode", mode="polling") == 0


def test_an_unserved_resource_with_a_missing_device_and_no_kubelet_count():
    _, (s, _, _) = rendered(fake_registration(state=State.UNSERVED, kubelet_count=None, healthy=False), polling=True, reload_ok=False)
    r = dict(resource=RESOURCE)
    assert value(s, "atedevd_resource_registered", **r) == 0
    assert value(s, "atedevd_resource_state", state="unserved", **r) == 1
    assert value(s, "atedevd_resource_units_advertised", **r) == 0
    assert value(s, "atedevd_resource_units_healthy", **r) == 0
    assert series(s, "atedevd_resource_kubelet_allocatable_units") == []  # absent, not 0: unknown
    assert value(s, "atedevd_watch_mode", mode="polling") == 1
    assert value(s, "atedevd_config_last_reload_successful") == 0


def test_reasons_are_a_bounded_label_set():
    """The `reason` label is the Why enum's value: every one present, nothing else, whatever
    the journal's words (a retry's error text is kept by the tally, never counted)."""
    _, (s, _, _) = rendered(fake_registration(begun={Why.RETRY: 3, Why.NOT_COUNTED: 1}))
    reasons = {dict(k[1])["reason"] for k in series(s, "atedevd_resource_register_calls_total")}
    assert reasons == {w.value for w in Why}
    assert value(s, "atedevd_resource_register_calls_total", resource=RESOURCE, reason="retry") == 3
    assert value(s, "atedevd_resource_register_calls_total", resource=RESOURCE, reason="not-counted") == 1


def test_a_pattern_resource_counts_its_units_by_health():
    r = fake_registration()._replace(pattern=True, units=4, healthy_units=3)
    _, (s, _, _) = rendered(r)
    assert value(s, "atedevd_resource_units", resource=RESOURCE, health="healthy") == 3
    assert value(s, "atedevd_resource_units", resource=RESOURCE, health="unhealthy") == 1
    assert value(s, "atedevd_resource_units_advertised", resource=RESOURCE) == 4


def test_label_values_are_escaped():
    _, (s, _, _) = rendered(fake_registration(name='x.io/a"b\\c'))
    assert value(s, "atedevd_resource_registered", resource='x.io/a"b\\c') == 1


def test_the_same_state_renders_the_same_text():
    """Else the file would be rewritten on every pass of the loop."""
    reg = fake_registration()
    assert rendered(reg)[0] == rendered(reg)[0]
    offset = textfile.WallOffset()
    assert offset.current() == offset.current()  # not taken afresh: microseconds apart would differ


def test_the_wall_clock_offset_follows_a_step_only(monkeypatch):
    offset = textfile.WallOffset()
    first = offset.value
    monkeypatch.setattr(textfile.time, "time", lambda real=textfile.time.time: real() + 0.3)
    assert offset.current() == first  # slewing, or noise: kept
    monkeypatch.setattr(textfile.time, "time", lambda real=textfile.time.time: real() + 3600)
    assert abs(offset.current() - (first + 3600)) < 1  # stepped (NTP after boot): followed


# --- the writer -----------------------------------------------------------------------------------


def text(value):
    return lambda: value


def test_written_atomically_0644_whatever_the_umask(tmp_path):
    old = os.umask(0o077)  # the daemon's
    try:
        w = textfile.TextfileWriter(str(tmp_path))
        w.update(text("a 1\n"), now=0.0)
    finally:
        os.umask(old)
    assert os.listdir(tmp_path) == ["atedevd.prom"]  # no temporary left behind
    assert (tmp_path / "atedevd.prom").read_text() == "a 1\n"
    assert os.stat(tmp_path / "atedevd.prom").st_mode & 0o777 == 0o644


def test_rewritten_when_changed_and_at_least_every_refresh(tmp_path):
    w = textfile.TextfileWriter(str(tmp_path), refresh=30.0, min_interval=1.0)
    path = tmp_path / "atedevd.prom"
    w.update(text("a 1\n"), now=0.0)
    inode = os.stat(path).st_ino
    w.update(text("a 1\n"), now=10.0)
    assert os.stat(path).st_ino == inode  # unchanged, not due: not rewritten
    assert w.deadline() == 30.0
    w.update(text("a 2\n"), now=11.0)
    assert path.read_text() == "a 2\n"
    inode = os.stat(path).st_ino
    w.update(text("a 2\n"), now=41.5)
    assert os.stat(path).st_ino != inode  # due: rewritten (node_textfile_mtime_seconds moves on)
    assert w.deadline() == 71.5


def test_changes_in_quick_succession_are_rendered_once_at_the_end_of_the_interval(tmp_path):
    """A kubelet restart wakes the loop many times in a few milliseconds: the first change is
    written at once, the rest together a second later, not one render per wake-up."""
    w = textfile.TextfileWriter(str(tmp_path), refresh=30.0, min_interval=1.0)
    path = tmp_path / "atedevd.prom"
    renders = []

    def state(value):
        def render():
            renders.append(value)
            return value
        return render

    w.update(state("waiting\n"), now=100.0)
    assert path.read_text() == "waiting\n"
    for n, text in enumerate(("registering\n", "verifying\n", "registered\n")):
        w.update(state(text), now=100.01 + n * 0.01)
    assert renders == ["waiting\n"] and path.read_text() == "waiting\n"
    assert w.deadline() == 101.0  # the loop wakes for it
    w.update(state("registered\n"), now=101.0)
    assert renders == ["waiting\n", "registered\n"] and path.read_text() == "registered\n"
    assert w.deadline() == 131.0
    w.update(state("stopped\n"), now=101.2, force=True)  # the last word before exiting
    assert path.read_text() == "stopped\n"


def test_a_write_error_is_logged_once_and_its_end_once(tmp_path, caplog):
    target = tmp_path / "gone"
    w = textfile.TextfileWriter(str(target), refresh=30.0)
    with caplog.at_level(logging.INFO, logger="atedevd"):
        for n in range(4):
            w.update(text(f"a {n}\n"), now=n * 31.0)  # never raises
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "cannot write metrics" in warnings[0].getMessage(), caplog.text
        target.mkdir()
        w.update(text("a 9\n"), now=200.0)
    assert (target / "atedevd.prom").read_text() == "a 9\n"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [f"metrics written to {target}/atedevd.prom again"]


def test_off_writes_nothing_and_sets_no_deadline(tmp_path):
    w = textfile.TextfileWriter(None)
    w.update(text("a 1\n"), now=0.0)
    assert not w.enabled and w.deadline() is None


def test_the_directory_default_and_off(tmp_path, monkeypatch):
    monkeypatch.setattr(textfile, "DEFAULT_DIR", str(tmp_path / "node-exporter"))
    assert textfile.resolve_dir(None) is None  # node_exporter not installed: off
    (tmp_path / "node-exporter").mkdir()
    assert textfile.resolve_dir(None) == str(tmp_path / "node-exporter")
    assert textfile.resolve_dir("") is None  # explicitly off
    assert textfile.resolve_dir("/srv/m") == "/srv/m"


def test_the_config_key_and_the_flag(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[daemon]\nmetrics_dir = ""\n')
    assert loader.load(str(f)).metrics_dir == ""
    f.write_text('[daemon]\nmetrics_dir = "/srv/metrics"\n')
    assert loader.load(str(f)).metrics_dir == "/srv/metrics"
    assert loader.load(str(f), overrides={"metrics_dir": ""}).metrics_dir == ""
    f.write_text('[daemon]\nmetrics_dir = "relative/dir"\n')
    with pytest.raises(loader.ConfigError) as e:
        loader.load(str(f))
    assert 'c.toml:2: [daemon] metrics_dir: must be an absolute path, got "relative/dir"' in str(e.value)
    with pytest.raises(loader.ConfigError, match="--metrics-dir: must be a"):
        loader.load(str(f), overrides={"metrics_dir": "x"})


# --- for real: the daemon, node_exporter, a scrape over loopback ---------------------------------


@pytest.fixture
def node_exporter(tmp_path):
    d = tmp_path / "textfile"
    d.mkdir()
    ne = NodeExporter(str(d), str(tmp_path / "node_exporter.log"))
    ne.dir = str(d)
    yield ne
    ne.close()


def test_node_exporter_serves_our_series_through_a_kubelet_restart(node_exporter, start_daemon, kubelet):
    d = start_daemon(metrics_dir=node_exporter.dir)
    d.wait_ready()
    assert kubelet.wait_connected(RESOURCE), d.log()
    r = dict(resource=RESOURCE)

    def settled(registrations):
        def ok(s):
            return value(s, "atedevd_resource_registered", **r) == 1 \
                and value(s, "atedevd_resource_registrations_total", **r) == registrations \
                and value(s, "atedevd_resource_kubelet_allocatable_units", **r) == 1024
        return ok

    s, text = node_exporter.wait_for(settled(1))
    assert settled(1)(s), text + d.log()
    assert value(s, "node_textfile_scrape_error") == 0, text  # node_exporter parsed our file
    assert value(s, "atedevd_resource_state", state="registered", **r) == 1
    assert sum(value(s, *k[:1], **dict(k[1])) for k in series(s, "atedevd_resource_state")) == 1
    assert value(s, "atedevd_resource_units_advertised", **r) == 1024
    assert value(s, "atedevd_resource_units_healthy", **r) == 1024
    assert value(s, "atedevd_resource_register_calls_total", reason="first-registration", **r) == 1
    assert value(s, "atedevd_watch_mode", mode="inotify") == 1
    build = [dict(k[1]) for k in series(s, "atedevd_build_info")]
    assert build == [dict(version="0.1.0", flavour="source", grpcio=grpc.__version__,
                          protobuf=google.protobuf.__version__, python=build[0]["python"])], build
    first_change = value(s, "atedevd_resource_state_change_timestamp_seconds", **r)
    assert 0 < value(s, "atedevd_start_time_seconds") <= first_change

    kubelet.allocate(RESOURCE, ["kvm-7"])
    with pytest.raises(grpc.RpcError):
        kubelet.allocate(RESOURCE, ["no-such-unit"])
    # Counters alone do not wake the loop (the file is at most 30 s old); any event does.
    d.send(signal.SIGHUP)
    s, text = node_exporter.wait_for(lambda s: value(s, "atedevd_resource_allocate_failures_total", **r) == 1)
    assert value(s, "atedevd_resource_allocate_calls_total", **r) == 2, text
    assert value(s, "atedevd_resource_allocate_failures_total", **r) == 1, text

    mark = kubelet.mark()
    kubelet.restart()
    kubelet.assert_healthy(RESOURCE, 1024, since=mark, new_registrations=1)
    s, text = node_exporter.wait_for(settled(2))
    assert settled(2)(s), text + d.log()
    # Why depends on the order the restart reaches us in: kubelet.sock new and our socket gone
    # ("kubelet-restarted"), or our next socket bound after the wipe before the new kubelet.sock
    # was seen ("kubelet-socket-recreated", as on a loaded machine in CI): one Register either way.
    again = [value(s, "atedevd_resource_register_calls_total", reason=why, **r)
             for why in ("kubelet-restarted", "kubelet-socket-recreated")]
    assert sorted(again) == [0, 1], text
    assert value(s, "atedevd_resource_state_change_timestamp_seconds", **r) > first_change
    assert value(s, "atedevd_resource_allocate_calls_total", **r) >= 2
    assert value(s, "node_textfile_scrape_error") == 0, text

    d.stop()
    s, text = node_exporter.wait_for(lambda s: value(s, "atedevd_resource_state", state="stopped", **r) == 1)
    assert value(s, "atedevd_resource_registered", **r) == 0, text  # the last word of a clean stop


def test_a_missing_device_shows_as_unhealthy_units(node_exporter, start_daemon, kubelet, dev_root):
    d = start_daemon(metrics_dir=node_exporter.dir)
    d.wait_ready()
    assert kubelet.wait_connected(RESOURCE), d.log()
    os.unlink(os.path.join(dev_root, "kvm"))
    r = dict(resource=RESOURCE)
    s, text = node_exporter.wait_for(lambda s: value(s, "atedevd_resource_units_healthy", **r) == 0)
    assert value(s, "atedevd_resource_units_healthy", **r) == 0, text
    assert value(s, "atedevd_resource_units_advertised", **r) == 1024, text  # still listed, as Unhealthy
    assert value(s, "atedevd_resource_registered", **r) == 1, text
