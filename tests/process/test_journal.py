"""A journal that says what needs an operator: expected events are INFO.

kubelet restarting, and atedevd registering again within a fraction of a second, is what
every node does on every kubelet upgrade or config change: `journalctl -p warning -u atedevd`
must stay empty through it, so that a real problem stands out. The daemon's stderr at the
default level is what journald stores (priority from the level), so it is read here.
"""

import re

from rig.harness import RESOURCE, wait_until

RESTARTS = 100
LINE = re.compile(r"\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)")


def levels(log: str):
    """(level, message) of every log line; lines that are not (a traceback) count as ERROR."""
    out = []
    for line in log.splitlines():
        m = LINE.match(line)
        out.append((m.group(1), m.group(2)) if m else ("ERROR", line))
    return out


def test_a_hundred_kubelet_restarts_log_no_warning(start_daemon, kubelet):
    d = start_daemon()  # --log-level info: the default
    d.wait_ready()
    assert kubelet.wait_connected(RESOURCE), d.log()
    assert wait_until(lambda: "registered with kubelet" in d.log(), 5), d.log()  # the daemon has seen it too
    for n in range(RESTARTS):
        mark = kubelet.mark()
        kubelet.restart()
        kubelet.assert_healthy(RESOURCE, 1024, since=mark, new_registrations=1)
        # kubelet has the registration; the daemon says so once it has seen the stream open
        # (else the next restart can come first, and this round's line is rightly never said).
        assert wait_until(lambda: d.log().count("registered again with kubelet") > n, 5), d.log()
    assert kubelet.wait_connected(RESOURCE, registrations=RESTARTS + 1), d.log()
    lines = levels(d.log())
    loud = [f"{level} {message}" for level, message in lines if level not in ("DEBUG", "INFO")]
    assert not loud, f"{len(loud)} lines at WARNING or above over {RESTARTS} kubelet restarts:\n" + "\n".join(loud[:20])
    # Said all the same, at INFO: one line per registration again.
    again = [m for level, m in lines if level == "INFO" and "registered again with kubelet" in m]
    assert len(again) >= RESTARTS, d.log()
