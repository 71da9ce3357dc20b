"""The simulated scenario matrix: what happens to a registered daemon, and the end state after it.

Each scenario disturbs a node whose daemon is registered, at random moments in
its first two seconds, with every step on both sides delayed 0–`max_delay`
(beyond every timeout and settle of ours), then lets the node settle and asks
for the healthy end state: kubelet running, one live stream on the daemon's
newest socket, that endpoint current and not stopped, allocatable equal to what
is configured, no Register in flight or teardown pending, no duplicate Register
in one kubelet process, and the daemon itself registered; some scenarios add checks of their
own (`World.checks`), exact where a process-level test could only wait out a window: no
Register after a reload that changes nothing Register carries, none for a unit's node going and
coming back, an upgrade that took place. Rounds run in chains of
`CHAIN` in one world (`run_rounds`): the first begins cold, the others at the healthy end of
the round before, so that most of a round's work is its disturbance, not a first start.
"""

import multiprocessing
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import inotify.constants as ic

from atedevd.daemon.watch import DirEvent
from atedevd.registration import letgo
from atedevd.registration.messages import State
from tests.simulation.world import PATTERN_RESOURCE, RESOURCE, UNITS, World, plug, unplug

MODES = ("1.32", "current")
SETTLE_S = 60.0  # simulated time after the last disturbance (kubelet's grace is 5 min)
FIRST_S = 30.0  # simulated time for the first registration
CHAIN = 10  # rounds one world runs, one after the other (`run_rounds`)


def _kubelet_restart(w: World, gap_max: float) -> None:
    def restart():
        w.kubelet.kill()
        w.after(w.rng.uniform(0, gap_max), w.kubelet.start)
    for _ in range(w.rng.randint(1, 3)):
        w.after(w.rng.uniform(0, 2.0), restart)


def kubelet_restart(w: World) -> None:
    """kubelet killed and started again, 0–200 ms apart, one to three times."""
    _kubelet_restart(w, 0.2)


def kubelet_restart_back_to_back(w: World) -> None:
    _kubelet_restart(w, 0.0)


def wipe_then_new_socket(w: World) -> None:
    """The wipe's deletions and the new kubelet.sock reach the daemon in separate batches."""
    def restart():
        w.kubelet.kill()
        w.fs.wipe()
        w.after(w.rng.uniform(0.001, 1.0), w.kubelet.start)
    w.after(w.rng.uniform(0, 2.0), restart)


def kubelet_ends_stream(w: World) -> None:
    for _ in range(w.rng.randint(1, 2)):
        w.after(w.rng.uniform(0, 2.0), w.kubelet.end_stream, RESOURCE)


def socket_deleted(w: World) -> None:
    def delete():
        name = w.daemon.current_socket() if w.daemon else None
        if name:
            w.fs.unlink(name)
    w.after(w.rng.uniform(0, 2.0), delete)


def daemon_sigterm_restart(w: World) -> None:
    w.after(w.rng.uniform(0, 2.0), w.restart_daemon, "sigterm")


def daemon_kill_restart(w: World) -> None:
    w.after(w.rng.uniform(0, 2.0), w.restart_daemon, "kill")


def _not_registered_again(w: World, *resources: str) -> None:
    """A check: the kubelet running now accepts no further Register of these resources by the
    round's end, if it is still the one running then (a kubelet restart is a reason to register
    again). Exact, where a process-level test could only wait out a window for the stray Register."""
    inc = w.kubelet.inc

    def accepted(resource: str) -> int:
        return len([a for a in inc.accepted if a[0] == resource])
    before = {r: accepted(r) for r in resources}

    def problems() -> List[str]:
        if w.kubelet.inc is not inc:
            return []
        return [f"{r} registered {accepted(r) - before[r]} more time(s) with kubelet#{inc.n}, not 0"
                for r in resources if accepted(r) != before[r]]
    w.checks.append(problems)


def reload_changed(w: World) -> None:
    """SIGHUP with kvm's count changed (or not: the same count drawn): the new list goes out on
    the open stream; nothing registers again (only a change of what Register carries would)."""
    new = w.rng.choice((1024, 2048))
    _not_registered_again(w, RESOURCE, PATTERN_RESOURCE)
    w.count = new
    w.after(w.rng.uniform(0, 2.0), lambda: w.daemon.reload(new))


def reload_unchanged(w: World) -> None:
    """SIGHUP with nothing changed: nothing registers again."""
    _not_registered_again(w, RESOURCE, PATTERN_RESOURCE)
    w.after(w.rng.uniform(0, 2.0), lambda: w.daemon.reload(w.daemon.count))


def queue_overflow(w: World) -> None:
    """A kubelet restart whose directory events are lost: the daemon only learns it overflowed."""
    def restart():
        w.fs.dropping_until = w.now + w.rng.uniform(0.01, 1.5)
        w.kubelet.kill()
        w.after(w.rng.uniform(0, 0.2), w.kubelet.start)
    w.after(w.rng.uniform(0, 2.0), restart)


def unit_unplugged_and_back(w: World) -> None:
    """One node of the pattern resource goes, and comes back 0-1.5 s later: its unit turns
    Unhealthy and Healthy again on the open stream (the daemon learns it from the dev root's
    directory events), and the resource is not registered again."""
    n, before = w.rng.randrange(UNITS), []

    def accepted():
        return len([a for a in w.kubelet.inc.accepted if a[0] == PATTERN_RESOURCE])

    def event(mask):
        d = w.daemon
        if d is not None:
            w.after(w.delay(), d.fs_events, [DirEvent(w.dev_root, f"unit{n}", mask)])

    def out():
        before.append(accepted())
        unplug(n)
        event(ic.IN_DELETE)
        w.after(w.rng.uniform(0, 1.5), back)

    def back():
        plug(n)
        event(ic.IN_CREATE)
    w.after(w.rng.uniform(0, 2.0), out)
    w.checks.append(lambda: [f"{PATTERN_RESOURCE} registered again {accepted() - before[0]} time(s) for a unit's node"
                             for _ in before if accepted() != before[0]])


def upgrade(w: World) -> None:
    """An upgrade handed to a warm successor: it registers once kubelet let go of us (kubelet
    1.32), or beside us (the current kubelet, told kubelet_endpoints = "per-socket")."""
    first = w.daemon
    w.after(w.rng.uniform(0, 2.0), lambda: w.daemon.upgrade())
    w.checks.append(lambda: [] if w.daemon is not first and not first.alive else
                    [f"the upgrade did not take place: daemon#{w.daemon.n} is main, daemon#{first.n} "
                     f"{'is alive' if first.alive else 'exited'}"])


def upgrade_successor_killed(w: World) -> None:
    """The successor of an upgrade is killed at a random moment: before it is ready, while
    it registers, or once main (then systemd starts atedevd again)."""
    first = w.daemon
    w.after(w.rng.uniform(0, 2.0), lambda: w.daemon.upgrade())

    def kill():
        d = first.child
        if d is None or not d.alive:
            return
        d.die()
        if w.daemon is d:  # it was main already: systemd restarts the unit
            w.after(w.delay(), w.start_daemon, d.count)
    w.after(w.rng.uniform(0, 3.0), kill)


def plugin_dir_removed(w: World) -> None:
    """kubelet's directory is deleted with everything in it, and made again when kubelet is
    restarted 0.05-1.5 s later, once or twice: nothing is served meanwhile (every state of
    the registration can be the one it meets), then everything is. Half the time atedevd is
    restarted while the directory is gone; half the time kubelet ends our stream a moment
    before (the directory goes while kubelet lets go of the old socket)."""
    def remove():
        w.fs.remove_dir()
        gap = w.rng.uniform(0.05, 1.5)

        def back():
            w.kubelet.kill()
            w.kubelet.start()
        w.after(gap, back)
        if w.rng.random() < 0.5:
            w.after(w.rng.uniform(0, gap), w.restart_unit)
    for _ in range(w.rng.randint(1, 2)):
        at = w.rng.uniform(0, 3.0)
        if w.rng.random() < 0.5:
            w.after(max(0.0, at - w.rng.uniform(0, 0.05)), w.kubelet.end_stream, RESOURCE)
        w.after(at, remove)


def kubelet_gone_a_while(w: World) -> None:
    """kubelet is stopped and its socket deleted; it is back 1-25 s later (the daemon waits,
    looking again every 10 s in case an event was lost)."""
    def stop():
        w.kubelet.kill()
        w.fs.unlink("kubelet.sock")
        w.after(w.rng.uniform(1.0, 25.0), w.kubelet.start)
    w.after(w.rng.uniform(0, 2.0), stop)


def upgrade_disturbed(w: World) -> None:
    """An upgrade, and around it one of: a kubelet restart, kubelet's directory deleted (and
    made again by a kubelet restart), or `systemctl restart` of the unit (SIGTERM to both
    processes, a new start once both have exited)."""
    w.after(w.rng.uniform(0, 2.0), lambda: w.daemon and w.daemon.upgrade())
    what = w.rng.choice(("kubelet-restart", "plugin-dir-removed", "unit-restart"))
    if what == "kubelet-restart":
        _kubelet_restart(w, 0.2)
    elif what == "plugin-dir-removed":
        def remove():
            w.fs.remove_dir()

            def back():
                w.kubelet.kill()
                w.kubelet.start()
            w.after(w.rng.uniform(0.05, 1.5), back)
        w.after(w.rng.uniform(0, 3.0), remove)
    else:
        w.after(w.rng.uniform(0, 3.0), w.restart_unit)


def sighup_resource_removed_and_back(w: World) -> None:
    """A reload drops the pattern resource (every socket of it closes, whatever its
    registration was doing), a second puts it back 0-2 s later; a kubelet restart may
    come around them. kvm, unchanged by both, never registers again unless kubelet restarted."""
    _not_registered_again(w, RESOURCE)

    def drop():
        if w.daemon is not None:
            w.daemon.reload(w.daemon.count, pattern=False)
            w.after(w.rng.uniform(0, 2.0), lambda: w.daemon and w.daemon.reload(w.daemon.count, pattern=True))
    w.after(w.rng.uniform(0, 2.0), drop)
    if w.rng.random() < 0.5:
        _kubelet_restart(w, 0.2)


def udev_storm(w: World) -> None:
    """udev at work (tests/simulation/udev.py) while resources overlap: nodes plugged,
    unplugged and made anew (other numbers, or refused), by-id links made, retargeted and
    removed, the shareable link moved onto a unit's node and off, reloads racing an unplug
    and reloads that add or drop an overlapping resource; three to eight of them in 3 s.
    After every event a daemon takes, no node is Healthy in two resources, no Healthy unit
    lacks its node as first served, and no ID means two paths."""
    for _ in range(w.rng.randint(3, 8)):
        w.after(w.rng.uniform(0, 3.0), w.udev.act)


def kubelet_restart_during_daemon_restart(w: World) -> None:
    w.after(w.rng.uniform(0, 1.0), w.restart_daemon, w.rng.choice(("sigterm", "kill")))
    _kubelet_restart(w, 0.2)


SCENARIOS: Dict[str, Callable[[World], None]] = {
    "kubelet-restart-gap-0-200ms": kubelet_restart,
    "kubelet-restart-back-to-back": kubelet_restart_back_to_back,
    "wipe-then-kubelet-sock": wipe_then_new_socket,
    "kubelet-ends-our-stream": kubelet_ends_stream,
    "our-socket-deleted": socket_deleted,
    "daemon-sigterm-restart": daemon_sigterm_restart,
    "daemon-kill-9-restart": daemon_kill_restart,
    "sighup-changed": reload_changed,
    "sighup-unchanged": reload_unchanged,
    "inotify-queue-overflow": queue_overflow,
    "kubelet-and-daemon-restart": kubelet_restart_during_daemon_restart,
    "unit-unplugged-and-back": unit_unplugged_and_back,
    "upgrade": upgrade,
    "upgrade-successor-killed": upgrade_successor_killed,
    "upgrade-disturbed": upgrade_disturbed,
    "plugin-dir-removed": plugin_dir_removed,
    "kubelet-gone-a-while": kubelet_gone_a_while,
    "sighup-resource-removed-and-back": sighup_resource_removed_and_back,
    "udev-storm": udev_storm,
}
UDEV = {"udev-storm"}  # scenarios whose world has udev's dev root and the overlapping resources
# Scenarios whose daemons keep CDI specs (`[daemon] cdi = true`): where a spec's lifetime is at
# stake (reloads, hot-plug, upgrades, a daemon stopped or killed). The others run the default
# configuration, CDI off, which the simulation covers so too.
CDI = {"sighup-changed", "sighup-unchanged", "sighup-resource-removed-and-back", "unit-unplugged-and-back", "udev-storm",
       "upgrade", "upgrade-successor-killed", "upgrade-disturbed", "daemon-kill-9-restart",
       "daemon-sigterm-restart", "kubelet-and-daemon-restart"}


def end_state(w: World) -> List[str]:
    d = w.daemon
    problems = []
    if d is None or not d.alive:
        return ["the daemon is not running"]
    if w.udev is None:
        expected = {RESOURCE: w.count, PATTERN_RESOURCE: UNITS}
    else:  # what the daemon serves now (its nodes change): kubelet must count all it has Healthy
        expected = {n: r.snapshot.healthy_units for n, r in d.plugins.resources.items() if r.advertised}
    for resource, count in expected.items():
        if d.state(resource) is not State.REGISTERED:
            problems.append(f"{resource}: the daemon is {d.state(resource).value}, not registered")
        problems += [f"{resource}: {p}" for p in w.kubelet.problems(resource, count, d.current_socket(resource))]
    return problems + [p for check in w.checks for p in check()] + w.cdi_problems + w.invariant_problems


class Round(NamedTuple):
    """One round's outcome: its seed, the seed of the world it ran in (its own when it began
    cold), the problems with its end state (none: healthy), how many events it took, and (DRA
    mode) how many of its pods kubelet had to prepare again."""

    seed: int
    world_seed: int
    problems: List[str]
    events: int
    delayed: int = 0


def run_rounds(first: int, count: int, mode: str, scenario: str, max_delay: float = 1.0, keep: bool = False,
               connections_visible: bool = True, pod_resources: bool = True, fixed_wait: Optional[float] = None,
               agent_rps: float = 80.0, chain: int = CHAIN) -> Tuple[List[Round], set, List[str]]:
    """Rounds `first` .. `first + count - 1`, `chain` of them in one world: the first from
    cold (kubelet started, the daemon started and registered), each other from the healthy
    end of the one before, as a node's daemon lives through one disturbance after another. A
    world ends after a round that failed, or whose end an orphaned Register decided (counted,
    not failed on: the next begins cold). Returns the rounds, every (from, to) move a
    registration machine made, and with `keep` the history of every world."""
    if fixed_wait is not None:
        letgo.FIXED_WAIT_S = fixed_wait
    rounds: List[Round] = []
    taken: set = set()
    history: List[str] = []
    w: Optional[World] = None
    world_seed = links = 0
    for seed in range(first, first + count):
        if w is not None and links < chain:
            events = w.events
        else:
            if w is not None:
                taken |= _end(w, history)
            events = 0  # a world's first round counts its start too
            w = World(seed, mode, max_delay=max_delay, pod_resources=pod_resources,
                      connections_visible=connections_visible, agent_rps=agent_rps, udev=scenario in UDEV,
                      cdi=scenario in CDI)
            w.trace, world_seed, links = keep, seed, 0
            w.kubelet.start()
            w.after(w.rng.uniform(0, 0.5), w.start_daemon)
            w.run_until(FIRST_S, settled=lambda: not end_state(w))
        orphans, links = w.kubelet.orphans_won, links + 1
        w.note("round", f"seed {seed}: {scenario}")
        problems = [f"before the scenario: {p}" for p in end_state(w)]
        if not problems:
            w.checks = []  # the round's own scenario's checks only
            SCENARIOS[scenario](w)
            w.run_until(w.now + SETTLE_S, settled=lambda: not end_state(w))
            problems = end_state(w)
        rounds.append(Round(seed, world_seed, problems, w.events - events))
        if problems or w.kubelet.orphans_won != orphans:
            taken |= _end(w, history)
            w = None
    if w is not None:
        taken |= _end(w, history)
    return rounds, taken, history


def _end(w: World, history: List[str]) -> set:
    w.close()
    history += [f"{t:10.4f} {lvl or '':>2} {kind}: {text}" for t, lvl, kind, text in w.said] if w.trace else []
    return w.moves_taken()


def run_round(seed: int, mode: str, scenario: str, max_delay: float = 1.0, keep: bool = False,
              world_seed: Optional[int] = None, **variant) -> Tuple[List[str], List[str], int, set]:
    """Round `seed` again, in its world from `world_seed` (by default its own: from cold):
    its problems, with `keep` its world's history up to it, its events, the world's moves."""
    start = seed if world_seed is None else world_seed
    n = seed - start + 1
    rounds, taken, history = run_rounds(start, n, mode, scenario, max_delay, keep, chain=n, **variant)
    return rounds[-1].problems, history, rounds[-1].events, taken


def _chunk(args) -> Tuple[str, str, int, List, int, set, int]:
    scenario, mode, first, rounds, max_delay, variant = args
    variant = dict(variant)
    if variant.pop("api", None) == "dra":
        from tests.simulation.dra_scenarios import run_rounds as runner
    else:
        runner = run_rounds
    done, taken, _ = runner(first, rounds, mode, scenario, max_delay, **variant)
    failures = [(r.seed, r.world_seed, r.problems) for r in done if r.problems]
    return scenario, mode, rounds, failures, sum(r.events for r in done), taken, sum(r.delayed for r in done)


def run_matrix(scenarios, modes, rounds: int, first_seed: int, max_delay: float, jobs: int,
               variant: Optional[dict] = None) -> Dict:
    """Every scenario x mode, `rounds` seeds each, spread over `jobs` processes (`variant`'s "api":
    "dra" runs DRA mode's, tests/simulation/dra_scenarios.py)."""
    per = max(1, min(500, rounds // max(jobs, 1)))
    work = []
    for s in scenarios:
        for m in modes:
            for start in range(0, rounds, per):
                work.append((s, m, first_seed + start, min(per, rounds - start), max_delay, variant or {}))
    results: Dict = {(s, m): {"rounds": 0, "failures": [], "events": 0, "taken": set(), "delayed": 0}
                     for s in scenarios for m in modes}
    if jobs > 1:
        pool = multiprocessing.get_context("fork").Pool(jobs)
        try:
            chunks = pool.map(_chunk, work, chunksize=1)
        except BaseException:
            pool.terminate()
            raise
        pool.close()  # the workers exit, and remove their dev roots, rather than being terminated
        pool.join()
    else:
        chunks = [_chunk(w) for w in work]
    for s, m, n, failures, events, taken, delayed in chunks:
        r = results[(s, m)]
        r["delayed"] += delayed
        r["rounds"] += n
        r["failures"] += failures
        r["events"] += events
        r["taken"] |= taken
    return results
