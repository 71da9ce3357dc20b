"""Registration under simulation (tests/simulation): the real machine, models of both kubelet
generations, every step delayed 0–1 s on both sides, the end state asserted each round.

SIM_ROUNDS (environment, default 10000) sets the rounds per scenario and kubelet mode; a
failure names its seed, and `python3 -m tests.simulation --replay SEED ...` prints its history.
And the machine on its own, event by event, for the rules that are about time.
"""

import os

from atedevd import registration as rm
from atedevd.registration import Registration, State
from tests.simulation.scenarios import MODES, SCENARIOS, run_matrix, run_round

ROUNDS = int(os.environ.get("SIM_ROUNDS", "10000"))


def test_every_scenario_ends_healthy_on_both_kubelet_generations():
    results = run_matrix(sorted(SCENARIOS), list(MODES), ROUNDS, first_seed=1, max_delay=1.0, jobs=os.cpu_count() or 1)
    failed = {k: r["failures"] for k, r in results.items() if r["failures"]}
    lines = [f"{s} on kubelet {m}: seed {seed}: {'; '.join(p)} (replay: python3 -m tests.simulation --replay {seed} "
             f"--scenario {s} --kubelet {m})" for (s, m), f in sorted(failed.items()) for seed, p in f[:3]]
    assert not failed, "\n".join(lines)
    assert all(r["rounds"] == ROUNDS for r in results.values())


def test_a_round_replays_from_its_seed():
    a = run_round(4242, "1.32", "kubelet-and-daemon-restart", keep=True)
    b = run_round(4242, "1.32", "kubelet-and-daemon-restart", keep=True)
    assert a == b and len(a[1]) > 20


def test_the_simulation_finds_the_race_a_fixed_settle_leaves(monkeypatch):
    """With nothing to show kubelet's teardown (no descriptors, no pod-resources) and a 50 ms
    settle, as before, kubelet 1.32's late teardown by name lands on the new registration."""
    results = run_matrix(["kubelet-ends-our-stream"], ["1.32"], 300, 1, 1.0, 1,
                         {"connections_visible": False, "pod_resources": False, "fixed_wait": 0.05})
    failures = results[("kubelet-ends-our-stream", "1.32")]["failures"]
    monkeypatch.setattr(rm, "FIXED_WAIT_S", 0.5)  # run_round set it for this process
    assert len(failures) > 10
    assert any("stopped" in p or "duplicate" in p for _, problems in failures for p in problems)


# --- the machine alone --------------------------------------------------------------------


def _kinds(m: Registration):
    return [a[0] for a in m.take() if a[0] != "say"]


def _registered(now: float = 0.0) -> Registration:
    m = Registration("ate.dev/kvm", 4, connections_visible=True)
    m.serve(now, kubelet_up=True, kubelet_at=now - 60)
    acts = m.take()
    ask = next(a[1] for a in acts if a[0] == "ask")
    m.bound(now, 1, None)
    m.allocatable_done(now, ask, 0)
    m.placed(now, 1, None)
    reg = next(a for a in m.take() if a[0] == "register")
    m.register_done(now, reg[1], rm.OK)
    m.stream_opened(now, 1)
    m.list_sent(now, 1)
    assert m.state is State.REGISTERED
    m.take()
    m.tick(now)  # the next standby, now that kubelet has our list
    bind = next(a for a in m.take() if a[0] == "bind")
    m.bound(now, bind[1], None)
    m.take()
    return m


def test_a_register_refused_right_after_kubelet_sock_appears_is_sent_again_at_once_on_the_same_socket():
    m = _registered()
    m.kubelet_created(10.0, at=10.0, ours_present=False)  # wiped: restarted
    acts = [a for a in m.take() if a[0] in ("place", "register", "bind")]
    assert [a[0] for a in acts] == ["place"]  # the standby, renamed into place: nothing to bind
    m.placed(10.0, acts[0][1], None)
    reg = next(a for a in m.take() if a[0] == "register")
    m.register_done(10.0004, reg[1], rm.REFUSED)  # kubelet.sock exists, not listening yet
    assert "bind" not in _kinds(m)
    assert m.deadline is not None and m.deadline - 10.0004 <= 0.001
    m.tick(m.deadline)
    again = [a for a in m.take() if a[0] != "say"]
    assert [a[0] for a in again] == ["register"] and again[0][2] == reg[2]  # same socket, nothing bound


def test_while_kubelet_is_down_nothing_is_bound_or_sent_until_kubelet_sock_appears():
    m = _registered()
    m.stream_ended(100.0, 1)  # kubelet died
    m.kubelet_gone(100.0)
    acts = _kinds(m)
    assert "bind" not in acts and "register" not in acts
    # The let-go wait: pod-resources refuses, kubelet is down.
    m.probed(100.0, 0)
    ask = [a for a in m.take() if a[0] == "ask"]
    if ask:
        m.allocatable_done(100.0, ask[0][1], rm.PR_REFUSED)
    assert "bind" not in _kinds(m)
    m.tick(100.5)
    assert "register" not in _kinds(m) and "bind" not in _kinds(m)
    assert m.deadline is None or m.deadline - 100.0 >= rm.SLOW_RETRY_S - 0.01
    m.kubelet_created(101.0, at=101.0, ours_present=False)
    assert {"place", "bind"} & set(_kinds(m))


def test_the_next_standby_waits_for_kubelets_first_device_list():
    m = Registration("ate.dev/kvm", 4)
    m.serve(0.0, kubelet_up=True, kubelet_at=-60)
    ask = next(a[1] for a in m.take() if a[0] == "ask")
    m.bound(0.0, 1, None)
    m.allocatable_done(0.001, ask, 0)
    m.placed(0.001, 1, None)
    reg = next(a for a in m.take() if a[0] == "register")
    m.register_done(0.004, reg[1], rm.OK)
    m.stream_opened(0.005, 1)
    m.tick(0.1)
    assert "bind" not in _kinds(m)  # registered, but kubelet is still reading our list
    m.list_sent(0.2, 1)
    m.tick(0.2)
    assert "bind" in _kinds(m)


def test_the_check_never_gives_up():
    m = _registered()
    now, rereg = 1.0, 0
    for _ in range(40):
        m.tick(now)
        for a in m.take():
            if a[0] == "ask":
                m.allocatable_done(now, a[1], 0)  # kubelet lists nothing, for ever
            elif a[0] == "probe":
                m.probed(now, 0)
            elif a[0] == "say" and a[2] == "not-counted":
                rereg += 1
                assert a[1] == rm.WARNING
            elif a[0] == "bind":
                m.bound(now, a[1], None)
            elif a[0] == "place":
                m.placed(now, a[1], None)
            elif a[0] == "register":
                m.register_done(now, a[1], rm.OK)
                m.stream_opened(now, a[2])
                m.list_sent(now, a[2])
        now = m.deadline or now + 1
    assert rereg >= 4 and m.state in (State.REGISTERED, State.LETTING_GO, State.REGISTERING)
    assert "kubelet counts 0" in m.describe(now, 0.0) or m.state is not State.REGISTERED
