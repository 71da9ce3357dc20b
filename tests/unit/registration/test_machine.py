"""The registration machine on its own, event by event: the rules that are about time,
its table of transitions, and that nothing in it grows with the number of Registers.

The parts it composes have tests of their own (tests/unit/registration/, one file per module); the
whole daemon's glue runs under simulation (tests/simulation/test_simulation.py).
"""

import gc
import tracemalloc
from logging import DEBUG
from typing import List, Tuple

import pytest

from atedevd.kubelet.calls import REGISTER_TIMEOUT_S
from atedevd.registration import machine as machine_module
from atedevd.registration import messages as m
from atedevd.registration.machine import TRANSITIONS, InvalidTransition, Registration
from atedevd.registration.messages import Listing, Outcome, State, Why
from atedevd.registration.moves import VERIFY_S
from tests.simulation.world import RESOURCE, World


def kinds(reg: Registration):
    return [type(a) for a in reg.take() if not isinstance(a, m.Say)]


def first(actions, kind):
    return next(a for a in actions if isinstance(a, kind))


def registered(now: float = 0.0, standby_bound: bool = True) -> Registration:
    """Registered, kubelet streaming; the next standby bound (or, if not `standby_bound`, its
    Bind waiting in the actions)."""
    reg = Registration(RESOURCE, 4, connections_visible=True)
    reg.handle(now, m.Serve(True, now - 60))
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(now, m.Bound(1))
    reg.handle(now, m.Listed(ask.cid, Listing.LISTED, 0))
    reg.handle(now, m.Placed(1))
    send = first(reg.take(), m.SendRegister)
    reg.handle(now, m.RegisterDone(send.cid, Outcome.OK))
    reg.handle(now, m.StreamOpened(1))
    reg.handle(now, m.ListSent(1))
    assert reg.state is State.REGISTERED
    reg.take()
    reg.handle_timer(now)  # the next standby, now that kubelet has our list
    if standby_bound:
        reg.handle(now, m.Bound(first(reg.take(), m.Bind).sid))
        reg.take()
    return reg


def test_a_register_refused_right_after_kubelet_sock_appears_is_sent_again_at_once_on_the_same_socket():
    reg = registered()
    reg.handle(10.0, m.KubeletCreated(10.0, ours_present=False))  # wiped: restarted
    acts = [a for a in reg.take() if isinstance(a, (m.Place, m.SendRegister, m.Bind))]
    assert [type(a) for a in acts] == [m.Place]  # the standby, renamed into place: nothing to bind
    reg.handle(10.0, m.Placed(acts[0].sid))
    send = first(reg.take(), m.SendRegister)
    reg.handle(10.0004, m.RegisterDone(send.cid, Outcome.REFUSED))  # kubelet.sock exists, not listening yet
    assert m.Bind not in kinds(reg)
    assert reg.get_timer() is not None and reg.get_timer() - 10.0004 <= 0.001
    reg.handle_timer(reg.get_timer())
    again = [a for a in reg.take() if not isinstance(a, m.Say)]
    assert [type(a) for a in again] == [m.SendRegister] and again[0].sid == send.sid  # same socket, nothing bound


def test_a_start_that_finds_a_kubelet_sock_left_by_a_reboot_has_a_standby_ready_for_the_next_kubelet():
    """The kubelet that left kubelet.sock is gone (a reboot): the next one wipes the socket we
    placed, so a standby is bound at once, and when kubelet comes it is renamed into place
    (a rename; binding a server then would take milliseconds of kubelet's first batch)."""
    reg = Registration(RESOURCE, 4, connections_visible=True)
    reg.handle(100.0, m.Serve(True, 40.0))  # kubelet.sock from before the reboot, a minute old
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(100.0, m.Bound(1))
    reg.handle(100.0, m.Listed(ask.cid, Listing.REFUSED))  # nobody there
    reg.handle(100.0, m.Placed(1))
    send = first(reg.take(), m.SendRegister)
    reg.handle(100.001, m.RegisterDone(send.cid, Outcome.REFUSED))
    bind = [a for a in reg.take() if isinstance(a, m.Bind)]
    assert bind == [m.Bind(2, True)]  # the standby for the kubelet to come
    reg.handle(100.001, m.Bound(2))
    reg.handle(130.0, m.KubeletCreated(130.0, ours_present=False))  # it wiped socket 1
    assert [type(a) for a in reg.take() if isinstance(a, (m.Place, m.Bind))] == [m.Place]


def test_while_kubelet_is_down_nothing_is_bound_or_sent_until_kubelet_sock_appears():
    reg = registered()
    reg.handle(100.0, m.StreamEnded(1))  # kubelet died
    reg.handle(100.0, m.KubeletGone())
    assert not {m.Bind, m.SendRegister} & set(kinds(reg))
    reg.handle(100.0, m.ConnectionsCounted(0))  # the let-go wait: pod-resources refuses, kubelet is down
    ask = [a for a in reg.take() if isinstance(a, m.AskPodResources)]
    if ask:
        reg.handle(100.0, m.Listed(ask[0].cid, Listing.REFUSED))
    assert m.Bind not in kinds(reg)
    reg.handle_timer(100.5)
    assert not {m.Bind, m.SendRegister} & set(kinds(reg))
    assert reg.get_timer() is None or reg.get_timer() - 100.0 >= machine_module.SLOW_RETRY_S - 0.01
    reg.handle(101.0, m.KubeletCreated(101.0, ours_present=False))
    assert {m.Place, m.Bind} & set(kinds(reg))


def test_the_next_standby_waits_for_kubelets_first_device_list():
    reg = Registration(RESOURCE, 4)
    reg.handle(0.0, m.Serve(True, -60))
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(0.0, m.Bound(1))
    reg.handle(0.001, m.Listed(ask.cid, Listing.LISTED, 0))
    reg.handle(0.001, m.Placed(1))
    send = first(reg.take(), m.SendRegister)
    reg.handle(0.004, m.RegisterDone(send.cid, Outcome.OK))
    reg.handle(0.005, m.StreamOpened(1))
    reg.handle_timer(0.1)
    assert m.Bind not in kinds(reg)  # registered, but kubelet is still reading our list
    reg.handle(0.2, m.ListSent(1))
    reg.handle_timer(0.2)
    assert m.Bind in kinds(reg)


def test_the_check_never_gives_up():
    reg = registered()
    now, rereg = 1.0, 0
    for _ in range(40):
        reg.handle_timer(now)
        for a in reg.take():
            if isinstance(a, m.AskPodResources):
                reg.handle(now, m.Listed(a.cid, Listing.LISTED, 0))  # kubelet lists nothing, for ever
            elif isinstance(a, m.CountConnections):
                reg.handle(now, m.ConnectionsCounted(0))
            elif isinstance(a, m.Say) and a.kind == "not-counted":
                rereg += 1
                assert a.level == machine_module.WARNING
            elif isinstance(a, m.Bind):
                reg.handle(now, m.Bound(a.sid))
            elif isinstance(a, m.Place):
                reg.handle(now, m.Placed(a.sid))
            elif isinstance(a, m.SendRegister):
                reg.handle(now, m.RegisterDone(a.cid, Outcome.OK))
                reg.handle(now, m.StreamOpened(a.sid))
                reg.handle(now, m.ListSent(a.sid))
        now = reg.get_timer() or now + 1
    assert rereg >= 4 and reg.state in (State.REGISTERED, State.LETTING_GO, State.REGISTERING)
    assert rereg - 1 <= reg.tally.begun[Why.NOT_COUNTED] <= rereg  # the last one may still be handing over


def test_a_bind_that_fails_for_a_socket_closed_meanwhile_is_moot():
    """Found by driving the machine directly: the standby being bound is closed by a reload,
    and its bind then fails. The old machine took that for "cannot serve" and dropped every
    socket it had, the registered one included."""
    reg = registered()
    standby = reg.book.standby
    reg.handle(5.0, m.Reconfigure(8, 8))  # closes the standby (it serves the old table)
    reg.take()
    reg.handle(5.0, m.Bound(standby, "on /x: No such file or directory"))
    assert reg.state is not State.UNSERVED
    assert reg.tally.serve_error is None


def test_a_standby_that_cannot_be_bound_leaves_the_registered_socket_serving():
    """Found by CI (tests/process/test_faults.py, the plugin directory made read-only right after the
    registration, on a busy machine): the next standby's bind came after the remount, failed
    with EROFS, and was taken for "cannot serve": every socket closed, the registered one too."""
    reg = registered(standby_bound=False)
    standby = first(reg.take(), m.Bind).sid
    said = []
    for n in range(3):  # it fails, is tried again later, fails again: said once
        reg.handle(1.0 + n, m.Bound(standby, f"on /x/{standby}.sock: Read-only file system"))
        acts = reg.take()
        assert not [a for a in acts if isinstance(a, m.CloseSocket) and a.sid == 1]
        said += [a for a in acts if isinstance(a, m.Say)]
        assert reg.state is State.REGISTERED and reg.book.current == 1 and reg.tally.serve_error is None
        at = reg.book.deadline  # the standby's timer
        assert at is not None and at - (1.0 + n) >= machine_module.STANDBY_AGAIN_S - 1e-9
        reg.handle_timer(at)
        standby = first([a for a in reg.take() if not isinstance(a, m.AskPodResources)], m.Bind).sid
    assert [(a.level, a.kind) for a in said] == [(machine_module.WARNING, "standby-failed")], said
    assert "Read-only file system" in said[0].text and "the registered one serves on" in said[0].text
    reg.handle(9.0, m.Bound(standby))  # it can be bound again: a later failure is said again
    assert reg.tally.standby_error is None


def test_a_move_not_in_the_table_is_refused():
    reg = Registration(RESOURCE, 4)
    with pytest.raises(InvalidTransition, match="unserved -> registered"):
        reg.moves.move(State.REGISTERED, 0.0)
    assert reg.state is State.UNSERVED


def test_the_table_names_only_real_states_and_every_state_is_reachable_and_left():
    pairs = {(a, b) for a, b, _ in TRANSITIONS}
    assert len(pairs) == len(TRANSITIONS)  # no move listed twice
    reached = {b for _, b in pairs} | {State.UNSERVED}
    assert reached == set(State)
    left = {a for a, _ in pairs}
    assert left == set(State) - {State.STOPPED}


@pytest.mark.slow  # 25-30 s (tracemalloc over 9,000 Registers): left out of `make check`
def test_ten_thousand_refused_registers_with_as_many_messages_grow_nothing():
    """kubelet refuses every Register with a message of its own (a failing dial names the
    socket, new at every attempt). The daemon's own Node, Resource and Performer, on the
    simulation's host: its state holds one error text, counts by a bounded enum, and its
    memory does not grow from the first thousand Registers to the ten-thousandth; the
    journal gets a line a minute at most."""
    w = World(1, "1.32")
    sent, lines = [0], []

    def refuse(resource, path, reply):  # (the simulation's pattern resource is refused alike)
        sent[0] += resource == RESOURCE
        w.after(0.001, reply, "failed", f"kubelet refused: UNKNOWN: failed to dial device plugin {path} (attempt {sent[0]})")
    w.kubelet.start()
    w.kubelet.register = refuse
    d = w.start_daemon()
    d.host.say = lambda level, kind, text, once=None, **fields: lines.append((w.now, level)) if level > DEBUG else None

    def run_to(registers: int) -> None:
        while sent[0] < registers:
            w.run_until(w.now + 60.0)

    run_to(1000)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        run_to(10000)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    r = d.resource
    tally, book = r.machine.tally, r.machine.book
    assert r.performer.registers_sent >= 10000
    assert set(tally.begun) <= set(Why) and sum(tally.begun.values()) >= 10000
    assert tally.last_error.endswith(f"(attempt {sent[0]})")  # the last one, kept once
    assert len(book) <= 3 and len(r.performer.servers) <= 3 and len(r.performer._calls) <= 2
    ours = [s for s in after.compare_to(before, "filename") if "/atedevd/" in s.traceback[0].filename]
    grown = sum(s.size_diff for s in ours)
    assert grown < 8 * 1024, [str(s) for s in ours[:5]]
    minutes = (lines[-1][0] - lines[0][0]) / 60
    assert len(lines) <= len(d.plugins.resources) * (minutes + 5), (len(lines), minutes)  # a line a minute, each


# --- an upgrade: the successor held, the predecessor handing off (atedevd/upgrade/machines.py) ---------


def test_a_successor_binds_but_registers_only_once_released_and_asks_nothing_at_start():
    reg = Registration(RESOURCE, 4)
    reg.handle(0.0, m.Serve(True, -60.0, on_hold=True))
    acts = reg.take()
    assert [type(a) for a in acts if not isinstance(a, m.Say)] == [m.Bind]  # no START question
    reg.handle(0.001, m.Bound(acts[0].sid))
    assert kinds(reg) == [] and reg.state is State.WAITING and reg.moves.on_hold
    reg.handle(0.002, m.Release())
    place = first(reg.take(), m.Place)
    reg.handle(0.002, m.Placed(place.sid))
    assert m.SendRegister in kinds(reg) and reg.tally.begun == {Why.UPGRADE: 1}


def test_a_predecessor_hands_off_keeps_its_standby_and_takes_the_registration_back_if_told():
    reg = registered()
    current, standby = reg.book.current, reg.book.standby
    reg.handle(1.0, m.Yield())
    acts = reg.take()
    assert reg.state is State.YIELDING
    assert m.EndStreams(current) in acts and m.CountConnections((current,)) in acts
    reg.handle(1.001, m.ConnectionsCounted(0))
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(1.002, m.Listed(ask.cid, Listing.LISTED, 0))
    acts = reg.take()
    assert reg.state is State.YIELDED and m.CloseSocket(current) in acts
    assert reg.book.standby == standby and m.CloseSocket(standby) not in acts  # kept for a take-back
    reg.handle(2.0, m.KubeletCreated(2.0, ours_present=False))  # the successor's business now
    assert reg.state is State.YIELDED and kinds(reg) == []
    reg.handle(3.0, m.TakeBack())  # first: does kubelet still list a successor that registered?
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(3.0, m.Listed(ask.cid, Listing.LISTED, 4))  # it does: its teardown is pending
    assert reg.state is State.LETTING_GO and kinds(reg) == []
    reg.handle_timer(reg.get_timer())
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(3.1, m.Listed(ask.cid, Listing.LISTED, 0))  # kubelet let go of it
    assert [type(a) for a in reg.take() if not isinstance(a, m.Say)] == [m.Place]  # the kept standby
    assert reg.state is State.REGISTERING and reg.tally.begun.get(Why.TAKEN_BACK) == 1


def test_a_predecessor_handed_off_stops_at_once():
    reg = registered()
    reg.handle(1.0, m.Yield())
    reg.handle(1.0, m.ConnectionsCounted(0))
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(1.0, m.Listed(ask.cid, Listing.LISTED, 0))
    reg.handle(2.0, m.Stop())
    assert reg.state is State.STOPPED and reg.book.standby is None


def test_a_predecessor_still_streaming_exits_after_the_upgrade_without_a_let_go_wait():
    """kubelet tracks endpoints per socket: the successor registered beside us, and what
    kubelet lists is its; a let-go wait would only poll pod-resources for its limit."""
    reg = registered()
    current = reg.book.current
    reg.handle(2.0, m.Stop(replaced=True))
    acts = reg.take()
    assert reg.state is State.STOPPED and m.CloseSocket(current) in acts  # its streams end with it
    assert not [a for a in acts if isinstance(a, (m.AskPodResources, m.CountConnections))]
    assert reg.get_timer() is None
    plain = registered()
    streaming = plain.book.current
    plain.handle(2.0, m.Stop())  # a plain stop waits for kubelet to let go
    assert plain.state is State.STOPPING and m.CountConnections((streaming,)) in plain.take()


def test_register_again_hands_over_from_our_own_socket_and_is_ignored_while_handed_off():
    reg = registered()
    current = reg.book.current
    reg.handle(1.0, m.RegisterAgain())
    acts = reg.take()
    assert m.EndStreams(current) in acts and m.CountConnections((current,)) in acts
    reg.handle(1.001, m.ConnectionsCounted(0))
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(1.002, m.Listed(ask.cid, Listing.LISTED, 0))  # kubelet let go of it
    place = first(reg.take(), m.Place)
    reg.handle(1.002, m.Placed(place.sid))
    assert first(reg.take(), m.SendRegister).sid == place.sid
    assert reg.tally.begun.get(Why.TAKEN_BACK) == 1
    off = registered()
    off.handle(1.0, m.Yield())
    off.take()
    off.handle(1.5, m.RegisterAgain())  # the successor's business now
    assert kinds(off) == [] and off.tally.begun.get(Why.TAKEN_BACK) is None


def sent_register(now: float = 0.0) -> Tuple[Registration, m.SendRegister]:
    """A first registration's Register just sent, kubelet up since a minute."""
    reg = Registration(RESOURCE, 4, connections_visible=True)
    reg.handle(now, m.Serve(True, now - 60))
    ask = first(reg.take(), m.AskPodResources)
    reg.handle(now, m.Bound(1))
    reg.handle(now, m.Listed(ask.cid, Listing.LISTED, 0))
    reg.handle(now, m.Placed(1))
    return reg, first(reg.take(), m.SendRegister)


def run_timers(reg: Registration, until: float) -> List[m.Action]:
    """Every timer of the machine due before `until`, in order, with nothing else happening."""
    acts: List[m.Action] = []
    at = reg.get_timer()
    while at is not None and at < until:
        reg.handle_timer(at)
        acts += reg.take()
        at = reg.get_timer()
    reg.handle_timer(until)
    return acts + reg.take()


def test_a_hung_register_is_left_to_its_own_deadline_and_cancelled_only_by_a_new_kubelet():
    """kubelet holds our Register and never answers: no timer of the machine gives up on the call
    before its own deadline (REGISTER_TIMEOUT_S, which the process-level test sees kubelet get),
    however long nothing happens; a new kubelet.sock cancels it, and a new Register follows."""
    reg, send = sent_register()
    quiet = run_timers(reg, REGISTER_TIMEOUT_S - 0.001)
    assert [a for a in quiet if isinstance(a, (m.CancelCall, m.SendRegister, m.Bind, m.Place))] == []
    assert reg.state is State.REGISTERING
    reg.handle(REGISTER_TIMEOUT_S - 0.001, m.KubeletCreated(REGISTER_TIMEOUT_S - 0.002, ours_present=False))
    acts = reg.take()
    assert m.CancelCall(send.cid) in acts, acts


def test_a_register_answered_but_never_streamed_is_sent_again_exactly_after_verify_s():
    """kubelet answers OK and never opens ListAndWatch: nothing is closed or sent again before
    VERIFY_S, and at VERIFY_S the registration is given up on, said, and begun again (the
    process-level test sees the daemon serve while it waits, not how long it waits)."""
    reg, send = sent_register()
    reg.handle(0.002, m.RegisterDone(send.cid, Outcome.OK))
    assert reg.state is State.VERIFYING
    reg.take()
    quiet = run_timers(reg, 0.002 + VERIFY_S - 0.001)
    assert [a for a in quiet if not isinstance(a, (m.Say, m.Bind))] == [] and reg.state is State.VERIFYING, quiet
    again = run_timers(reg, 0.002 + VERIFY_S + 0.5)
    assert reg.state is State.LETTING_GO and [a.kind for a in again if isinstance(a, m.Say)] == ["not-watched"], again
