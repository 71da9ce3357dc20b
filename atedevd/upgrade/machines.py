"""An upgrade handed to a warm successor: the two sides of it, as decisions without I/O.

When a reload finds that the atedevd installed on disk is not the one running (the
package was upgraded), the running daemon (the predecessor) starts its successor, a
fresh process of the new code, and keeps serving while the successor imports, binds
its sockets and says it is ready. Then, on a kubelet that tears endpoints down by
resource name (<= 1.36), the predecessor ends its streams and waits until kubelet has
let go of them before it tells the successor to register (kubelet would otherwise tear
the new endpoint down with the old one); on a kubelet that tracks endpoints per socket
(`kubelet_endpoints = "per-socket"`), the successor registers at once, beside it. Once
the successor is registered, the predecessor makes it systemd's main process
(MAINPID=), tells it so, and exits. If the successor fails on the way (exits, is never
ready, cannot register), the predecessor keeps (or takes back) the registration and
says why: a broken upgrade never leaves the node without the resource.

`Predecessor` and `Successor` are the two machines; they exchange `Message`s over a
channel the caller provides (a socket pair in the daemon, world events in the
simulation), and ask for what they need done as actions, which `atedevd/glue/process.py`
carries to the node and to the process.
"""

import enum
import logging
from typing import List, Optional, Union

from atedevd.record import Record
from atedevd.registration.messages import RegisterAgain, Release, Say, TakeBack, Yield

READY_LIMIT_S = 30.0  # the successor imports, reads the configuration and binds its sockets by then
LET_GO_LIMIT_S = 10.0  # kubelet lets go of our ended streams by then (the let-go wait's own limit is 5 s)
REGISTER_LIMIT_S = 30.0  # the successor is registered by then (kubelet's dial alone may take 10 s)
STOP_LIMIT_S = 20.0  # a successor told to stop has stopped by then (its own let-go wait is 5 s)
ORPHAN_LIMIT_S = 10.0  # kubelet's dial timeout: a Register of a successor that died is over by then


class Message(enum.Enum):
    """What the two processes tell each other."""

    READY = "ready"  # successor: my sockets are bound, my configuration is read
    GO = "go"  # predecessor: register now
    REGISTERED = "registered"  # successor: every resource is registered (kubelet streams from me)
    MAIN = "main"  # predecessor: you are systemd's main process now; I exit


class UpgradePhase(enum.Enum):
    STARTING = "starting"  # the successor is starting (predecessor: waiting for READY)
    YIELDING = "yielding"  # predecessor: our streams ended, kubelet lets go of them
    REGISTERING = "registering"  # the successor registers (predecessor: waiting for REGISTERED)
    DONE = "done"  # the successor is main (predecessor: exit)
    FAILED = "failed"  # the successor failed: the predecessor serves on


# --- actions ----------------------------------------------------------------------------------
# What the node does (every resource is told) is the registration's own event: `Yield` (end
# our streams, wait until kubelet let go), `TakeBack` (the successor failed: serve and register
# as before), `RegisterAgain` (a while after taking back from a successor that died
# registering: its Register may have reached kubelet <= 1.36 after ours, and torn ours down by
# name), `Release` (a successor's: register now). The rest is the process's.


class Send(Record):
    """Tell the other process `message`."""

    message: Message


class StopSuccessor(Record):
    """Predecessor: stop the successor (it failed, or took too long). `kill`: at once; else
    it is asked to (SIGTERM) and lets go of what it registered, which `exited` then says."""

    kill: bool = True


class Exit(Record):
    """Predecessor: the successor is main; stop serving (its sockets only) and exit."""


class MainPid(Record):
    """Predecessor: tell systemd the successor is the main process now."""


class BecomeMain(Record):
    """Successor: systemd's main process from now on (READY, STATUS, the watchdog, the metrics)."""


UpgradeAction = Union[Send, StopSuccessor, Exit, MainPid, BecomeMain, Yield, TakeBack, RegisterAgain, Release, Say]


class Predecessor:
    """The running daemon's side: what it does with its successor, and when."""

    def __init__(self, overlap: bool, now: float) -> None:
        self.overlap = overlap  # kubelet tracks endpoints per socket: the successor registers beside us
        self.phase = UpgradePhase.STARTING
        self.deadline: Optional[float] = now + READY_LIMIT_S
        self.actions: List[UpgradeAction] = []
        self._yielded = False  # our streams are ended (kubelet is letting go, or has)
        self._stopping = False  # the successor was asked to stop: we take back once it is gone
        self._again_at: Optional[float] = None  # register once more then (it died registering)

    def take(self) -> List[UpgradeAction]:
        actions, self.actions = self.actions, []
        return actions

    @property
    def over(self) -> bool:
        """Nothing more to do with this successor (it is main, or it failed and is gone)."""
        return self.phase in (UpgradePhase.DONE, UpgradePhase.FAILED) and not self._stopping and self._again_at is None

    def received(self, now: float, message: Message) -> None:
        if self.phase is UpgradePhase.FAILED:
            return  # a successor we gave up on, stopping: its exit is what counts
        if self.phase is UpgradePhase.STARTING and message is Message.READY:
            if self.overlap:  # kubelet keeps our endpoint until the new one is there: no window
                self._go(now)
            else:
                self.phase, self.deadline = UpgradePhase.YIELDING, now + LET_GO_LIMIT_S
                self._yielded = True
                self.actions.append(Yield())
        elif self.phase is UpgradePhase.REGISTERING and message is Message.REGISTERED:
            self.phase, self.deadline = UpgradePhase.DONE, None
            self.actions += [MainPid(), Send(Message.MAIN), Exit()]
        else:
            self._fail(now, f"it said {message.value!r} while {self.phase.value}")

    def let_go(self, now: float) -> None:
        """kubelet has let go of every stream we ended (or the let-go wait's own limit passed)."""
        if self.phase is UpgradePhase.YIELDING:
            self._go(now)

    def exited(self, now: float, how: str) -> None:
        """The successor's process ended (`how`: its exit status in words), or its channel closed."""
        if self._stopping:
            self._take_back()
        elif self.phase not in (UpgradePhase.DONE, UpgradePhase.FAILED):
            self._fail(now, f"it {how} before it was {'ready' if self.phase is UpgradePhase.STARTING else 'registered'}",
                       alive=False)

    def on_timer(self, now: float) -> None:
        if self.deadline is None or now < self.deadline:
            return
        if self._again_at is not None:
            self._again_at = self.deadline = None
            self.actions += [Say(logging.INFO, "upgrade", "upgrade: registering once more: a Register of the new atedevd that "
                                 "failed may have reached kubelet after ours"), RegisterAgain()]
            return
        if self._stopping:  # it did not stop when asked: now it is killed
            self.actions.append(StopSuccessor(kill=True))
            self._take_back()
            if not self.overlap:  # (with a Register of its in kubelet, perhaps)
                self._again_at = self.deadline = now + ORPHAN_LIMIT_S
            return
        waiting = {UpgradePhase.STARTING: f"was not ready within {READY_LIMIT_S:.0f} s",
                   UpgradePhase.YIELDING: f"kubelet did not let go of our streams within {LET_GO_LIMIT_S:.0f} s",
                   UpgradePhase.REGISTERING: f"was not registered within {REGISTER_LIMIT_S:.0f} s"}[self.phase]
        self._fail(now, waiting)

    def _go(self, now: float) -> None:
        self.phase, self.deadline = UpgradePhase.REGISTERING, now + REGISTER_LIMIT_S
        self.actions.append(Send(Message.GO))

    def _fail(self, now: float, why: str, alive: bool = True) -> None:
        self.actions.append(Say(logging.ERROR, "upgrade", f"upgrade: the new atedevd failed: {why}; the running one serves on"
                                + (" and registers again" if self._yielded else "")))
        if self.phase is UpgradePhase.REGISTERING and alive:
            # Told to register, and alive: a Register of its may be inside kubelet, which a kill
            # would leave there, unseen (kubelet <= 1.36 would tear ours down with it). Asked to
            # stop, it waits for that Register and lets go; we take back once it is gone.
            self.phase, self._stopping, self.deadline = UpgradePhase.FAILED, True, now + STOP_LIMIT_S
            self.actions.append(StopSuccessor(kill=False))
            return
        registering = self.phase is UpgradePhase.REGISTERING
        self.phase = UpgradePhase.FAILED
        self.actions.append(StopSuccessor())
        self._take_back()
        if registering and not self.overlap:  # dead, told to register: a Register of its may be in kubelet
            self._again_at = self.deadline = now + ORPHAN_LIMIT_S

    def _take_back(self) -> None:
        self._stopping, self.deadline = False, None
        self.actions.append(TakeBack())


class Successor:
    """The new daemon's side: serve but hold registration until told, then take over."""

    def __init__(self) -> None:
        self.phase = UpgradePhase.STARTING
        self.actions: List[UpgradeAction] = []

    def take(self) -> List[UpgradeAction]:
        actions, self.actions = self.actions, []
        return actions

    def ready(self) -> None:
        """Every resource's socket is bound, held back from registering."""
        if self.phase is UpgradePhase.STARTING:
            self.phase = UpgradePhase.YIELDING
            self.actions.append(Send(Message.READY))

    def registered(self) -> None:
        """Every resource is registered (kubelet streams our devices)."""
        if self.phase is UpgradePhase.REGISTERING:
            self.phase = UpgradePhase.DONE
            self.actions.append(Send(Message.REGISTERED))

    def received(self, message: Message) -> None:
        if message is Message.GO and self.phase is UpgradePhase.YIELDING:
            self.phase = UpgradePhase.REGISTERING
            self.actions.append(Release())
        elif message is Message.MAIN and self.phase is UpgradePhase.DONE:
            self.actions.append(BecomeMain())

    def predecessor_gone(self) -> None:
        """The predecessor's channel closed before it made us main: it is gone (killed, or it
        exited); nobody else serves the resource, so register, and serve on."""
        if self.phase in (UpgradePhase.STARTING, UpgradePhase.YIELDING):
            self.phase = UpgradePhase.REGISTERING
            self.actions.append(Release())
        if self.phase is not UpgradePhase.FAILED:
            self.actions.append(BecomeMain())
