"""After a crash, start again at once; in a crash loop, later and later.

systemd restarts the unit at once (`RestartSec=0`) after the daemon died, and
systemd 252 has no `RestartSteps=`, so a daemon that crashes on every start
would be started again and again, each start costing ~0.2 s of CPU.
The escalation is ours: a marker in the unit's runtime directory says that a
run began and has not ended cleanly. The unit keeps that directory across
restarts (`RuntimeDirectoryPreserve=restart`) and removes it on stop, so:

- no marker: the last run ended cleanly (or the unit was stopped): start now;
- a marker: the last run died (crash, kill -9, watchdog, exit before serving).
  If it had run for `STABLE_S` or more, this is a first crash: start now. Else
  it is one more in a row: wait 0.25 s, then 0.5, 1, 2, ... at most `MAX_DELAY_S`.

A crash loop then costs at most a start per `MAX_DELAY_S` (or per `STABLE_S`
for crashes that come later than that after a start): under 3 % of a core,
measured under systemd 252 (docs/design.md, "Where a start's time goes").
Only under systemd (`$INVOCATION_ID`, `$RUNTIME_DIRECTORY`): nothing else
restarts us on its own. Uses nothing but os and time: it runs before the
imports of a start.
"""

import os
import sys
import time
from typing import Optional, Tuple

# In $RUNTIME_DIRECTORY, while a run lasts: "<unclean ends in a row before it> <CLOCK_MONOTONIC of its start>".
MARKER = "unclean"
STABLE_S = 10.0  # a run that lasted this long ends a series: its crash counts as a first one
FIRST_DELAY_S = 0.25  # the second crash in a row waits this long, each further one twice as long ...
MAX_DELAY_S = 10.0  # ... up to this


def marker_path(environ=os.environ) -> Optional[str]:
    """Where the marker lives, or None when systemd does not run us (no automatic restarts)."""
    runtime = environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if not runtime or not environ.get("INVOCATION_ID"):
        return None
    return os.path.join(runtime, MARKER)


def delay(crashes: int) -> float:
    """How long to wait before starting, after `crashes` unclean ends in a row."""
    if crashes <= 1:
        return 0.0
    return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (crashes - 2))


def read(path: str) -> Optional[Tuple[int, float]]:
    """(crashes in a row, monotonic start of the run that left it), or None: no marker."""
    try:
        with open(path) as f:
            text = f.read(64)
    except FileNotFoundError:
        return None
    except OSError:
        return (0, 0.0)
    try:
        crashes, started = text.split()
        return (max(int(crashes), 0), float(started))
    except ValueError:  # cut short by the crash itself: an unclean end, long ago
        return (0, 0.0)


def crashes_before(previous: Optional[Tuple[int, float]], now: float) -> int:
    """This start follows how many unclean ends in a row (0: a clean start)."""
    if previous is None:
        return 0
    crashes, started = previous
    ran = now - started
    if ran >= STABLE_S or ran < 0:  # ran long enough (or a clock from elsewhere): a new series
        return 1
    return crashes + 1


def begin(path: Optional[str] = None, sleep=time.sleep, clock=time.monotonic, err=None) -> float:
    """At the start of `atedevd run`: wait as long as the crashes before call for, then
    leave the marker for this run. Returns the time waited."""
    path = marker_path() if path is None else path
    if path is None:
        return 0.0
    crashes = crashes_before(read(path), clock())
    wait = delay(crashes)
    if wait:
        print(f"atedevd: the last run ended uncleanly within {STABLE_S:.0f} s of its start ({crashes} unclean ends "
              f"in a row): waiting {wait:g} s before starting again", file=err or sys.stderr, flush=True)
        sleep(wait)
    try:
        with open(path, "w") as f:
            f.write(f"{crashes} {clock():.3f}\n")
    except OSError:
        pass  # no runtime directory to write to: no escalation, nothing else lost
    return wait


def ended_cleanly(path: Optional[str] = None) -> None:
    """The run is ending by itself (stop, or an exit it chose): the next start waits for nothing."""
    path = marker_path() if path is None else path
    if path is None:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
