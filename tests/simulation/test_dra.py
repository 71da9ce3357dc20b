"""DRA mode under simulation (tests/simulation/dra.py): the daemon's own driver against kubelet's DRA
side, the API server and systemd, every step delayed 0-1 s, the invariants held after every event
and the end state asserted each round.

SIM_DRA_ROUNDS (environment; default 300, as `make test` runs it, where `make sim` runs 2000) sets
the rounds per scenario and mode; a failure names its seed and its world's, and
`python3 -m tests.simulation --api dra --replay SEED --from WORLD_SEED ...` prints its history.
"""

import os

import pytest

from atedevd.dra import driver as d
from atedevd.dra import preparer as prep
from tests.simulation import dra as s
from tests.simulation.dra_scenarios import MODES, SCENARIOS, run_rounds
from tests.simulation.scenarios import run_matrix

ROUNDS = int(os.environ.get("SIM_DRA_ROUNDS", "300"))


def test_every_scenario_ends_healthy_in_every_mode_and_no_claim_is_ever_lost():
    results = run_matrix(sorted(SCENARIOS), list(MODES), ROUNDS, first_seed=1, max_delay=1.0,
                         jobs=os.cpu_count() or 1, variant={"api": "dra"})
    failed = {k: r["failures"] for k, r in results.items() if r["failures"]}
    lines = [f"{sc} on {m}: seed {seed}: {'; '.join(p)} (replay: python3 -m tests.simulation --api dra --replay {seed} "
             f"--from {world} --scenario {sc} --kubelet {m})" for (sc, m), f in sorted(failed.items()) for seed, world, p in f[:3]]
    assert not failed, "\n".join(lines)
    assert all(r["rounds"] == ROUNDS for r in results.values())
    # With the sockets held, a restart or a reload makes no pod wait for its next sync; without, a kill does.
    assert results[("daemon-sigterm-restart", "1.37")]["delayed"] == 0
    assert results[("reload", "1.37")]["delayed"] == 0
    assert results[("daemon-kill-9-restart", "1.37-nostore")]["delayed"] > results[("daemon-kill-9-restart", "1.37")]["delayed"]


def test_a_round_replays_from_its_seed():
    a = run_rounds(77, 3, "1.37", "reload-disturbed", keep=True)
    b = run_rounds(77, 3, "1.37", "reload-disturbed", keep=True)
    assert [r.events for r in a[0]] == [r.events for r in b[0]] and a[2] == b[2] and len(a[2]) > 50


def test_the_simulation_finds_an_answer_sent_before_the_checkpoint_is_written(monkeypatch):
    """The check after every event sees a claim kubelet holds that a crash would lose."""
    def finish(self, c):  # the answer first, then the write: the order the preparer must not take
        self._out.append(prep.Answer(c.n, {r.uid: c.outcomes.get(r.uid, prep.ClaimOutcome()) for r in c.refs}))
        if c.made or c.undo:
            self._out.append(prep.WriteCheckpoint(c.n, self.book.document()))
        del self.calls[c.n]
    monkeypatch.setattr(prep.Preparer, "_finish", finish)
    rounds, _, _ = run_rounds(1, 40, "1.37", "pods-only")
    assert any("not in the checkpoint" in p for r in rounds for p in r.problems)


def test_the_simulation_finds_a_run_that_does_not_carry_the_generation_on(monkeypatch):
    from atedevd.dra import claims

    load = claims.Book.load

    def forgetful(self, doc):
        why = load(self, doc)
        self.generation = 0
        return why
    monkeypatch.setattr(claims.Book, "load", forgetful)
    rounds, _, _ = run_rounds(1, 60, "1.37", "reload-disturbed")
    assert any("generation went back" in p for r in rounds for p in r.problems)


def test_the_simulation_finds_slices_that_miss_a_change_of_the_devices(monkeypatch):
    looked = d.Driver._looked

    def once(self, now, devices):
        if not self.devices:
            looked(self, now, devices)
    monkeypatch.setattr(d.Driver, "_looked", once)
    rounds, _, _ = run_rounds(1, 20, "1.37", "unit-unplugged-and-back")
    assert any("the slices list" in p for r in rounds for p in r.problems)


@pytest.mark.parametrize("store", [True, False])
def test_a_kill_with_the_store_makes_no_call_fail_for_want_of_a_listener(store):
    """The model's own check: with systemd's store the listening socket outlives a kill, so
    kubelet's connection is never refused; without it, it is until the next run binds."""
    w = s.DraWorld(5, "1.37", store=store)
    refused = []
    real = w.sockets.connect

    def connect(then):
        ok = real(then)
        refused.append(not ok)
        return ok
    w.sockets.connect = connect
    w.kubelet.start()
    w.start_daemon()
    w.run_until(5.0)
    w.restart_daemon("kill")
    w.kubelet._lost()
    w.run_until(10.0)
    w.close()
    assert any(refused) is (not store)
