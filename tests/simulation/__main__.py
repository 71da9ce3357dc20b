"""Run the registration simulation: `python3 -m tests.simulation [--rounds N] [--seed S] ...`
(`--api dra`: DRA mode's, tests/simulation/dra_scenarios.py).

Every round is one seed: one scenario disturbs a node whose atedevd is registered,
then the end state is asserted. Rounds run ten to a world: the first begins cold
(kubelet started, atedevd started and registered), each other at the healthy end
of the one before. A failure prints the seed, the seed its world began at,
scenario and kubelet mode; `--replay SEED --from WORLD_SEED` runs that world up
to that round and prints its whole history.
"""

import argparse
import sys
import time

from atedevd.registration.moves import TRANSITIONS
from tests.simulation import dra_scenarios
from tests.simulation.scenarios import MODES, SCENARIOS, run_matrix, run_round


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.simulation")
    p.add_argument("--rounds", type=int, default=10000, help="rounds per scenario and kubelet mode")
    p.add_argument("--seed", type=int, default=1, help="the first round's seed")
    p.add_argument("--api", choices=("device-plugin", "dra"), default="device-plugin",
                   help="which of atedevd's modes: the device plugin's registration, or DRA mode")
    p.add_argument("--scenario", action="append", choices=sorted(set(SCENARIOS) | set(dra_scenarios.SCENARIOS)),
                   help="only these (repeatable)")
    p.add_argument("--kubelet", action="append", choices=sorted(set(MODES) | set(dra_scenarios.MODES)),
                   help="only these modes (repeatable)")
    p.add_argument("--max-delay", type=float, default=1.0, help="the longest delay of one step, seconds")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--blind", action="store_true", help="the daemon cannot see kubelet's connections (pod-resources only)")
    p.add_argument("--no-pod-resources", action="store_true", help="kubelet serves no pod-resources API")
    p.add_argument("--agent", type=float, default=80.0, metavar="RPS",
                   help="a node agent's pod-resources calls a second beside us, out of kubelet's 100 (default 80)")
    p.add_argument("--fixed-wait", type=float, help="override the fixed let-go wait (seconds) where nothing shows kubelet's teardown")
    p.add_argument("--replay", type=int, metavar="SEED", help="run one round and print its history")
    p.add_argument("--from", dest="world_seed", type=int, metavar="SEED",
                   help="with --replay: the seed its world began at (default: the round's own, from cold)")
    a = p.parse_args(argv)
    if a.api == "dra":
        return dra(a)
    variant = {"connections_visible": not a.blind, "pod_resources": not a.no_pod_resources, "fixed_wait": a.fixed_wait,
               "agent_rps": a.agent}
    scenarios = a.scenario or sorted(SCENARIOS)
    modes = a.kubelet or list(MODES)
    if a.replay is not None:
        for mode in modes:
            for name in scenarios:
                problems, history, events, _ = run_round(a.replay, mode, name, a.max_delay, keep=True,
                                                         world_seed=a.world_seed, **variant)
                print(f"--- {name} on kubelet {mode}, seed {a.replay}: {'; '.join(problems) or 'end state healthy'}")
                print("\n".join(history + [f"{events} events"]))
        return 0
    t0 = time.monotonic()
    results = run_matrix(scenarios, modes, a.rounds, a.seed, a.max_delay, a.jobs, variant)
    took = time.monotonic() - t0
    failed = 0
    print(f"{'scenario':<28}{'kubelet':<10}{'rounds':>8}{'failed':>8}{'events/round':>14}")
    for (name, mode), r in sorted(results.items()):
        failed += len(r["failures"])
        print(f"{name:<28}{mode:<10}{r['rounds']:>8}{len(r['failures']):>8}{r['events'] / max(r['rounds'], 1):>14.0f}")
        for seed, world_seed, problems in r["failures"][:3]:
            print(f"    seed {seed}: {'; '.join(problems)}\n    replay: python3 -m tests.simulation --replay {seed} "
                  f"--from {world_seed} --scenario {name} --kubelet {mode}")
    taken = set().union(*(r["taken"] for r in results.values()))
    never = [f"{a.value} -> {b.value}" for a, b, _ in TRANSITIONS if (a, b) not in taken]
    if never:
        print(f"moves in TRANSITIONS never taken: {', '.join(never)}")
    total = sum(r["rounds"] for r in results.values())
    print(f"{total} rounds in {took:.1f} s ({total / took:.0f} rounds/s)")
    print(f"sim: {total - failed} passed, {failed} failed")
    return 1 if failed else 0


def dra(a) -> int:
    """DRA mode's matrix; its table adds the pods kubelet had to prepare again (their prepare
    failed: the pod waited for its next sync)."""
    scenarios = a.scenario or sorted(dra_scenarios.SCENARIOS)
    modes = a.kubelet or list(dra_scenarios.MODES)
    if a.replay is not None:
        for mode in modes:
            for name in scenarios:
                start = a.replay if a.world_seed is None else a.world_seed
                n = a.replay - start + 1
                rounds, _, history = dra_scenarios.run_rounds(start, n, mode, name, a.max_delay, keep=True, chain=n)
                print(f"--- {name} on kubelet {mode}, seed {a.replay}: {'; '.join(rounds[-1].problems) or 'end state healthy'}")
                print("\n".join(history + [f"{rounds[-1].events} events"]))
        return 0
    t0 = time.monotonic()
    results = run_matrix(scenarios, modes, a.rounds, a.seed, a.max_delay, a.jobs, {"api": "dra"})
    took = time.monotonic() - t0
    failed = 0
    print(f"{'scenario':<28}{'mode':<14}{'rounds':>8}{'failed':>8}{'events/round':>14}{'pods prepared again':>21}")
    for (name, mode), r in sorted(results.items()):
        failed += len(r["failures"])
        print(f"{name:<28}{mode:<14}{r['rounds']:>8}{len(r['failures']):>8}{r['events'] / max(r['rounds'], 1):>14.0f}"
              f"{r['delayed']:>21}")
        for seed, world_seed, problems in r["failures"][:3]:
            print(f"    seed {seed}: {'; '.join(problems)}\n    replay: python3 -m tests.simulation --api dra --replay "
                  f"{seed} --from {world_seed} --scenario {name} --kubelet {mode}")
    total = sum(r["rounds"] for r in results.values())
    print(f"{total} rounds in {took:.1f} s ({total / took:.0f} rounds/s)")
    print(f"sim (DRA): {total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
