"""What a process asks of its own I/O around systemd and a successor, as values both modes'
cores return (atedevd/glue/process.py, atedevd/dra/driver.py): the status line, readiness, a
reload under way, a successor to start."""

from typing import Tuple

from atedevd.record import Record


class Status(Record):
    """`STATUS=`: the status line (it changed)."""

    text: str


class Ready(Record):
    """`READY=1`, with the status: the start, a reload, or an upgrade's take-back, is over."""


class Reloading(Record):
    """`RELOADING=1`: a SIGHUP is being acted on."""


class StartSuccessor(Record):
    """Start the installed atedevd as our successor, handing it what we serve (device-plugin mode:
    `Process.successor_started` or `successor_failed` follows)."""

    served: Tuple[str, ...]
