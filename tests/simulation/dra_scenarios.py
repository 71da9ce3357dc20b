"""DRA mode's scenario matrix: what happens to a node serving pods through atedevd's DRA driver,
and the end state after it (tests/simulation/dra.py holds what must hold at every moment).

Every round sends pods (most asking for the shared `kvm`, some for a pattern unit) and deletes
some, around one disturbance at a random moment in its first seconds, with every step on every
side delayed 0-`max_delay`; then the node settles (longer than kubelet's resync, so that a pod
whose prepare failed is tried again) and the end state is asked for. Rounds run `CHAIN` to a
world, as in tests/simulation/scenarios.py.

The modes are kubelet generations and units: `1.37` and `1.34` (which never tries a failed
registration again) with the listening sockets in systemd's store, as DRA mode's drop-in sets it;
`1.37-nostore`, a unit without the store: a restart removes nothing, but kubelet's calls are
refused until the next run has bound the sockets again, and its pods wait for their next sync.
"""

from typing import Callable, Dict, List, Optional, Tuple

from atedevd.dra import driver as d
from tests.simulation import dra as s
from tests.simulation.scenarios import CHAIN, Round

MODES = ("1.37", "1.34", "1.37-nostore")
FIRST_S = 30.0
SETTLE_S = 240.0  # beyond kubelet's resync (60-90 s) twice over, and its 30 s wipe


def _at(w: s.DraWorld, fn, *args, within: float = 2.0) -> None:
    w.after(w.rng.uniform(0, within), fn, *args)


def pods_only(w: s.DraWorld) -> None:
    """Pods come and go, nothing else."""


def kubelet_restart(w: s.DraWorld) -> None:
    """kubelet killed and started again, 0-200 ms apart, one to three times: it wipes the node's
    slices as it starts and registers the driver again from the socket file that stayed."""
    def restart():
        w.kubelet.kill()
        w.after(w.rng.uniform(0, 0.2), w.kubelet.start)
    for _ in range(w.rng.randint(1, 3)):
        _at(w, restart)


def daemon_sigterm(w: s.DraWorld) -> None:
    _at(w, w.restart_daemon, "sigterm")


def daemon_kill(w: s.DraWorld) -> None:
    _at(w, w.restart_daemon, "kill")


def _hangup(w: s.DraWorld) -> None:
    if w.main is not None:
        w.main.event(d.Hangup("dra"))


def reload(w: s.DraWorld) -> None:
    """A reload (a package upgrade's too): the successor is handed the sockets and takes over."""
    first = w.main
    _at(w, _hangup, w)
    w.checks.append(lambda: [] if first is None or (w.main is not first and not first.alive) else
                    [f"the reload did not hand over: daemon#{first.n} {'is alive' if first.alive else 'exited'}"])


def reload_successor_killed(w: s.DraWorld) -> None:
    """The successor is killed at a random moment: before it serves, while the predecessor
    drains, or once main (then systemd starts atedevd again)."""
    first = w.main
    _at(w, _hangup, w)

    def kill():
        child = first.child if first is not None else None
        if child is not None and child.alive:
            child.die()  # (once it is main and its predecessor gone, systemd starts atedevd again)
    _at(w, kill, within=3.0)


def unit_unplugged_and_back(w: s.DraWorld) -> None:
    """A unit's node goes (a claim may hold it: it stays listed, tainted, until that claim goes)
    and comes back 0-3 s later."""
    n = w.rng.randrange(s.UNITS)

    def out():
        if n not in w.unplugged:
            w.unplug(n)
            w.after(w.rng.uniform(0, 3.0), w.plug, n)
    _at(w, out)


def api_server_down(w: s.DraWorld) -> None:
    """The API server out of reach 0.5-40 s: new claims wait for it (a prepare waits 30 s),
    held ones are answered from the book, the slices wait."""
    def down():
        w.api.down_until = w.now + w.rng.uniform(0.5, 40.0)
    _at(w, down)


def reload_disturbed(w: s.DraWorld) -> None:
    """A reload, and around it a kubelet restart, a kill -9 of atedevd, or the API server away."""
    _at(w, _hangup, w)
    {"kubelet": kubelet_restart, "kill": daemon_kill, "api": api_server_down}[w.rng.choice(("kubelet", "kill", "api"))](w)


SCENARIOS: Dict[str, Callable[[s.DraWorld], None]] = {
    "pods-only": pods_only,
    "kubelet-restart": kubelet_restart,
    "daemon-sigterm-restart": daemon_sigterm,
    "daemon-kill-9-restart": daemon_kill,
    "reload": reload,
    "reload-successor-killed": reload_successor_killed,
    "reload-disturbed": reload_disturbed,
    "unit-unplugged-and-back": unit_unplugged_and_back,
    "api-server-down": api_server_down,
}


def pods(w: s.DraWorld) -> None:
    """The round's pods: the last round's go at random moments, new ones come (a fifth of them
    for a unit), some of them go again."""
    for pod in w.kubelet.pods:
        if not pod.deleted:
            _at(w, w.kubelet.delete, pod, within=3.0)
    for _ in range(w.rng.randint(3, 12)):
        def make():
            pod = w.create_pod("unit" if w.rng.random() < 0.2 else "kvm")
            if w.rng.random() < 0.3:
                w.after(w.rng.uniform(0, 3.0), w.kubelet.delete, pod)
        _at(w, make, within=3.0)


def run_rounds(first: int, count: int, mode: str, scenario: str, max_delay: float = 1.0, keep: bool = False,
               chain: int = CHAIN) -> Tuple[List[Round], set, List[str]]:
    """Rounds `first` .. `first + count - 1`, `chain` to a world (as scenarios.run_rounds)."""
    rounds: List[Round] = []
    history: List[str] = []
    w: Optional[s.DraWorld] = None
    world_seed = links = 0
    for seed in range(first, first + count):
        if w is None or links >= chain:
            if w is not None:
                _end(w, history)
            w = s.DraWorld(seed, mode.split("-")[0], max_delay, store="nostore" not in mode)
            w.trace, world_seed, links, events = keep, seed, 0, 0
            w.kubelet.start()
            w.after(w.rng.uniform(0, 0.5), w.start_daemon)
            w.run_until(FIRST_S, settled=lambda: not s.end_state(w) and bool(w.api.slices))
        else:
            events = w.events
        links += 1
        made = len(w.kubelet.pods)
        w.note("round", f"seed {seed}: {scenario}")
        problems = [f"before the scenario: {p}" for p in s.end_state(w)]
        if not problems:
            w.checks = []
            pods(w)
            SCENARIOS[scenario](w)
            w.run_until(w.now + SETTLE_S, settled=lambda: not s.end_state(w) and all(not c() for c in w.checks))
            problems = s.end_state(w) + [p for c in w.checks for p in c()]
        delayed = sum(1 for p in w.kubelet.pods[made:] if p.failures)
        rounds.append(Round(seed, world_seed, problems, w.events - events, delayed))
        if problems:
            _end(w, history)
            w = None
    if w is not None:
        _end(w, history)
    return rounds, set(), history


def _end(w: s.DraWorld, history: List[str]) -> None:
    w.close()
    history += [f"{t:10.4f} {lvl or '':>2} {kind}: {text}" for t, lvl, kind, text in w.said] if w.trace else []
