"""The upgrade's two machines on their own, message by message and timer by timer
(atedevd/upgrade/machines.py): no process, no kubelet. The daemon runs them in tests/process/test_upgrade.py
and the simulation in its upgrade scenarios."""

import logging

import pytest

from atedevd.glue.plugin_dir import Standing
from atedevd.glue.process import Process, Ready
from atedevd.kubelet.identity import KubeletFound
from atedevd.registration.messages import RegisterAgain, Release, Say, Stop, TakeBack, Yield
from atedevd.upgrade import machines
from atedevd.upgrade.machines import (BecomeMain, Exit, MainPid, Message, Predecessor, Send, StopSuccessor, Successor,
                                      UpgradePhase)

Phase = UpgradePhase


def kinds(machine) -> list:
    return [a if isinstance(a, (Send, StopSuccessor)) else type(a) for a in machine.take() if not isinstance(a, Say)]


def errors(actions) -> list:
    return [a.text for a in actions if isinstance(a, Say) and a.level == logging.ERROR]


def test_per_resource_the_successor_registers_only_once_kubelet_let_go_of_us():
    p = Predecessor(overlap=False, now=0.0)
    p.received(0.5, Message.READY)
    assert kinds(p) == [Yield] and p.phase is Phase.YIELDING
    p.on_timer(0.6)  # nothing due: kubelet has not let go yet
    assert kinds(p) == []
    p.let_go(0.51)
    assert kinds(p) == [Send(Message.GO)] and p.phase is Phase.REGISTERING
    p.received(0.6, Message.REGISTERED)
    assert kinds(p) == [MainPid, Send(Message.MAIN), Exit] and p.over


def test_per_socket_the_successor_registers_beside_us_at_once():
    p = Predecessor(overlap=True, now=0.0)
    p.received(0.5, Message.READY)
    assert kinds(p) == [Send(Message.GO)]  # no Yield: our streams stay open
    p.received(0.6, Message.REGISTERED)
    assert kinds(p) == [MainPid, Send(Message.MAIN), Exit]


def test_a_successor_that_exits_before_it_is_ready_is_one_error_and_nothing_to_register_again():
    p = Predecessor(overlap=False, now=0.0)
    p.exited(0.2, "exited with status 78")
    actions = p.take()
    assert errors(actions) == ["upgrade: the new atedevd failed: it exited with status 78 before it was ready; "
                               "the running one serves on"]
    assert [type(a) for a in actions if not isinstance(a, Say)] == [StopSuccessor, TakeBack]
    assert p.over and p.deadline is None  # it never registered: no Register of its can be in kubelet


def test_a_successor_never_ready_is_killed_at_the_limit():
    p = Predecessor(overlap=False, now=0.0)
    p.on_timer(machines.READY_LIMIT_S - 0.1)
    assert kinds(p) == []
    p.on_timer(machines.READY_LIMIT_S)
    actions = p.take()
    assert StopSuccessor(kill=True) in actions and any(isinstance(a, TakeBack) for a in actions)
    assert "was not ready within" in errors(actions)[0] and p.over


def test_a_successor_that_dies_registering_is_taken_back_and_we_register_once_more_later():
    """Told to register, it died: a Register of its may still be inside kubelet <= 1.36 and
    land after ours, tearing ours down by name when it ends; nothing we can see tells. So the
    take-back is followed by one more registration once kubelet's dial timeout has passed
    (found by the simulation: a stopped endpoint in 4 of 10,000 rounds)."""
    p = Predecessor(overlap=False, now=0.0)
    p.received(0.5, Message.READY)
    p.let_go(0.51)
    p.take()
    p.exited(0.7, "exited")
    actions = p.take()
    assert [type(a) for a in actions if not isinstance(a, Say)] == [StopSuccessor, TakeBack]
    assert "and registers again" in errors(actions)[0]
    assert not p.over and p.deadline == pytest.approx(0.7 + machines.ORPHAN_LIMIT_S)
    p.on_timer(0.7 + machines.ORPHAN_LIMIT_S)
    assert kinds(p) == [RegisterAgain] and p.over and p.deadline is None


def test_beside_a_per_socket_kubelet_a_dead_successor_needs_no_second_registration():
    p = Predecessor(overlap=True, now=0.0)
    p.received(0.5, Message.READY)
    p.take()
    p.exited(0.7, "exited")
    assert [type(a) for a in p.take() if not isinstance(a, Say)] == [StopSuccessor, TakeBack] and p.over


def test_a_live_successor_that_cannot_register_is_asked_to_stop_and_taken_back_once_gone():
    p = Predecessor(overlap=False, now=0.0)
    p.received(0.5, Message.READY)
    p.let_go(0.5)
    p.take()
    p.on_timer(0.5 + machines.REGISTER_LIMIT_S)
    actions = p.take()
    assert StopSuccessor(kill=False) in actions and not any(isinstance(a, TakeBack) for a in actions)
    p.received(1.0, Message.REGISTERED)  # late, from one we gave up on: ignored
    assert kinds(p) == []
    p.exited(2.0, "exited")  # it let go of what it registered
    assert kinds(p) == [TakeBack] and p.over


def test_a_successor_that_does_not_stop_when_asked_is_killed_and_we_register_once_more_later():
    p = Predecessor(overlap=False, now=0.0)
    p.received(0.0, Message.READY)
    p.let_go(0.0)
    p.on_timer(machines.REGISTER_LIMIT_S)
    p.take()
    at = machines.REGISTER_LIMIT_S + machines.STOP_LIMIT_S
    p.on_timer(at)
    assert kinds(p) == [StopSuccessor(kill=True), TakeBack] and p.deadline == pytest.approx(at + machines.ORPHAN_LIMIT_S)
    p.on_timer(at + machines.ORPHAN_LIMIT_S)
    assert kinds(p) == [RegisterAgain]


def test_the_successor_serves_held_registers_on_go_and_becomes_main_when_told():
    s = Successor()
    s.received(Message.GO)  # before it is ready: not yet
    assert kinds(s) == []
    s.ready()
    assert kinds(s) == [Send(Message.READY)]
    s.received(Message.GO)
    assert kinds(s) == [Release]
    s.registered()
    assert kinds(s) == [Send(Message.REGISTERED)]
    s.received(Message.MAIN)
    assert kinds(s) == [BecomeMain]


@pytest.mark.parametrize("ready", [False, True])
def test_a_successor_whose_predecessor_is_gone_registers_and_serves_on(ready):
    s = Successor()
    if ready:
        s.ready()
        s.take()
    s.predecessor_gone()
    assert kinds(s) == [Release, BecomeMain]


class FakePluginDir:
    """What the glue hears from the node (where the resources stand, as it changes), and what it tells it."""

    def __init__(self):
        self.told, self.stopping, self.held = [], False, None
        self._news = []
        self.host = type("Host", (), {"cdi": None})()

    def stands(self, ready_on_hold=False, yielded=False, registered=False):
        self._news.append(Standing(ready_on_hold, yielded, registered))

    def news(self):
        news, self._news = self._news, []
        return news

    def hold(self, inherited):
        self.held = inherited

    def tell_all(self, now, event):
        self.told.append(event)

    def release(self, now):
        self.told.append(Release())

    def begin_stop(self, now, replaced=False):
        self.told.append(Stop(replaced))


def test_the_glue_shows_the_machines_the_node_and_carries_each_action_to_the_node_or_the_process():
    node = FakePluginDir()
    proc = Process(node)  # type: ignore[arg-type]
    proc.successor_started(0.0, KubeletFound(None, "unknown"))
    proc.heard(0.0, Message.READY)
    proc.upgrade_steps(0.0)
    assert node.told == [Yield()] and proc.predecessor.phase is Phase.YIELDING
    proc.upgrade_steps(0.1)  # kubelet has not let go
    assert proc.predecessor.phase is Phase.YIELDING and proc._out == []
    node.stands(yielded=True)
    proc.upgrade_steps(0.2)
    assert proc.predecessor.phase is Phase.REGISTERING and proc._out == [Send(Message.GO)]
    proc.heard(0.3, Message.REGISTERED)
    proc.upgrade_steps(0.3)
    assert proc._out[1:] == [MainPid(), Send(Message.MAIN), Exit()] and node.told[-1] == Stop(replaced=True)


def test_a_take_back_is_the_node_s_and_ready_again_the_process_s():
    node = FakePluginDir()
    proc = Process(node)  # type: ignore[arg-type]
    proc.successor_started(0.0, KubeletFound(None, "unknown"))
    proc.heard(0.5, None, "exited with status 3")
    proc.upgrade_steps(0.5)
    assert node.told == [TakeBack()] and [type(a) for a in proc._out if not isinstance(a, Say)] == [StopSuccessor, Ready]
    assert proc.predecessor is None and proc.upgrading is None  # it failed and is gone: we serve on


def test_a_successor_is_released_and_becomes_main_through_the_glue():
    node = FakePluginDir()
    proc = Process(node, inherited=frozenset({"ate.dev/kvm"}))  # type: ignore[arg-type]
    assert proc.upgrading == "successor" and node.held == {"ate.dev/kvm"}
    node.stands(ready_on_hold=True)
    proc.upgrade_steps(0.0)
    proc.heard(0.1, Message.GO)
    proc.upgrade_steps(0.1)
    assert node.told == [Release()] and proc._out == [Send(Message.READY)]
    node.stands(registered=True)
    proc.upgrade_steps(0.2)
    proc.heard(0.3, Message.MAIN)
    proc.upgrade_steps(0.3)
    assert proc._out[1:] == [Send(Message.REGISTERED), BecomeMain()] and proc.upgrading is None


@pytest.mark.parametrize("setting,kubelet,beside", [
    ("auto", KubeletFound("v1.37.2", "the program of PID 1"), True),  # kubernetes PR #135437: per socket
    ("auto", KubeletFound("v1.38.0-rc.1", "the program of PID 1"), True),
    ("auto", KubeletFound("v1.36.3", "the program of PID 1"), False),  # by name: beside us it would be torn down
    ("auto", KubeletFound("v1.30.2+k3s1", "/usr/local/bin/k3s (PID 1's program, unchanged since it started)"), False),
    ("auto", KubeletFound(None, "the process behind kubelet.sock is in another PID namespace"), False),  # not known: the safe way
    ("per-socket", KubeletFound(None, "unknown"), True),  # the operator's word over the kubelet's silence
    ("per-resource", KubeletFound("v1.37.2", "the program of PID 1"), False),  # ... and over its version
])
def test_the_upgrade_goes_beside_us_only_where_kubelet_keys_endpoints_by_socket(setting, kubelet, beside):
    from atedevd.config import Config

    proc = Process(FakePluginDir())  # type: ignore[arg-type]
    proc.cfg = Config(kubelet_endpoints=setting)
    (said,) = proc.successor_started(0.0, kubelet)
    assert proc.predecessor is not None and proc.predecessor.overlap is beside
    why = (kubelet.version or kubelet.how) if setting == "auto" else setting  # the journal says what decided
    assert ("beside us" in said.text) is beside and why in said.text
