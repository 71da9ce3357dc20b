"""Registration under simulation (tests/simulation): the real machine, models of both kubelet
generations, every step delayed 0–1 s on both sides, the end state asserted each round.

SIM_ROUNDS (environment; default 2000, as `make test` runs it, where `make sim` runs 10000)
sets the rounds per scenario and kubelet mode, ten to a world (tests/simulation/scenarios.py, `run_rounds`); a failure names its seed and its
world's, and `python3 -m tests.simulation --replay SEED --from WORLD_SEED ...` prints its history.
The machine and its parts, event by event, are tested on their own in tests/unit/registration/.
"""

import glob
import os
import tempfile

from atedevd.registration import letgo
from atedevd.registration.moves import TRANSITIONS
from tests.simulation.scenarios import CHAIN, MODES, SCENARIOS, run_matrix, run_round, run_rounds

ROUNDS = int(os.environ.get("SIM_ROUNDS", "2000"))
TABLE_ROUNDS = 500  # from this many rounds a cell, every row of TRANSITIONS is taken


def test_every_scenario_ends_healthy_on_both_kubelet_generations_and_every_move_is_taken():
    """And every row of TRANSITIONS is a move some round made: the table lists what the
    machine does, no more (a row no round takes is a scenario missing, or a dead row)."""
    results = run_matrix(sorted(SCENARIOS), list(MODES), ROUNDS, first_seed=1, max_delay=1.0, jobs=os.cpu_count() or 1)
    failed = {k: r["failures"] for k, r in results.items() if r["failures"]}
    lines = [f"{s} on kubelet {m}: seed {seed}: {'; '.join(p)} (replay: python3 -m tests.simulation --replay {seed} "
             f"--from {world} --scenario {s} --kubelet {m})" for (s, m), f in sorted(failed.items()) for seed, world, p in f[:3]]
    assert not failed, "\n".join(lines)
    assert all(r["rounds"] == ROUNDS for r in results.values())
    taken = set().union(*(r["taken"] for r in results.values()))
    never = [f"{a.value} -> {b.value}" for a, b, _ in TRANSITIONS if (a, b) not in taken]
    assert never == [] or ROUNDS < TABLE_ROUNDS, never  # (the rarest, verifying -> handing-off, needs a few hundred)


def test_a_round_replays_from_its_seed():
    a = run_round(4242, "1.32", "kubelet-and-daemon-restart", keep=True)
    b = run_round(4242, "1.32", "kubelet-and-daemon-restart", keep=True)
    assert a == b and len(a[1]) > 20


def test_rounds_run_ten_to_a_world_and_each_replays_from_its_world_seed():
    """A world's rounds after its first begin where the one before ended (no new start), and
    round 7 replayed from the world's seed is the round that ran: the same end, the same events."""
    rounds, taken, _ = run_rounds(1, 2 * CHAIN, "current", "kubelet-ends-our-stream")
    assert [r.world_seed for r in rounds] == [1] * CHAIN + [1 + CHAIN] * CHAIN
    assert all(r.problems == [] for r in rounds) and taken
    cold = rounds[0].events  # the first round of a world pays for the start and the first registration
    assert all(r.events < cold for r in rounds[1:CHAIN]), [r.events for r in rounds]
    again = run_round(7, "current", "kubelet-ends-our-stream", world_seed=1)
    assert (again[0], again[2]) == (rounds[6].problems, rounds[6].events)


def test_the_simulation_finds_the_race_a_fixed_settle_leaves(monkeypatch):
    """With nothing to show kubelet's teardown (no descriptors, no pod-resources) and a 50 ms
    settle, as before, kubelet 1.32's late teardown by name lands on the new registration."""
    results = run_matrix(["kubelet-ends-our-stream"], ["1.32"], 300, 1, 1.0, 1,
                         {"connections_visible": False, "pod_resources": False, "fixed_wait": 0.05})
    failures = results[("kubelet-ends-our-stream", "1.32")]["failures"]
    monkeypatch.setattr(letgo, "FIXED_WAIT_S", 0.5)  # run_round set it for this process
    assert len(failures) > 10
    assert any("stopped" in p or "duplicate" in p for _, _, problems in failures for p in problems)


def test_the_workers_remove_their_dev_roots():
    """Each worker process makes a dev root of its own; a pool's workers exit, not killed, and
    remove theirs (a run left two behind in /tmp every time)."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "atedevd-sim-dev-*")))
    results = run_matrix(["sighup-unchanged"], ["1.32"], 4, first_seed=1, max_delay=1.0, jobs=2)
    assert results[("sighup-unchanged", "1.32")]["rounds"] == 4
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "atedevd-sim-dev-*"))) - before == set()


def test_a_reload_that_registers_again_is_found(monkeypatch):
    """The reload scenarios hold the registrations exactly: a daemon whose every reconfigured
    resource registers anew (its options taken as changed) fails them, where a process-level
    test could only have waited out a window for the stray Register."""
    from atedevd.glue import resource

    monkeypatch.setattr(resource, "plugin_options", lambda device: object())  # never equal: always "changed"
    failures = run_matrix(["sighup-changed"], ["current"], 40, 1, 1.0, 1)[("sighup-changed", "current")]["failures"]
    assert failures and all("ate.dev/kvm registered 1 more time(s) with kubelet#" in p
                            for _, _, problems in failures for p in problems if "registered" in p), failures
