"""What other threads hand the loop: callables in a queue, and the pipe that wakes the loop's
select (the device-plugin loop's gRPC threads, DRA mode's gRPC and API threads)."""

import os
import queue
from typing import Callable, Tuple


class Inbox:
    """Callables handed to the loop by gRPC threads (or by the loop, for its next turn), and
    the pipe that wakes it."""

    def __init__(self) -> None:
        self._calls: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._r, self._w = pipe()

    def fileno(self) -> int:
        return self._r

    def post(self, call: Callable[[], None]) -> None:
        self._calls.put(call)
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # the loop is already due to wake

    def run(self) -> None:
        """On the loop: every callable handed in so far."""
        try:
            os.read(self._r, 4096)
        except BlockingIOError:
            pass  # (the pipe is read only to empty it)
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            call()


def pipe() -> Tuple[int, int]:
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    return r, w
