"""The registration of a resource with kubelet, as decisions only: no I/O.

    messages.py     the typed events, actions and enums that go in and come out
    machine.py      `Registration`: what each event and timer means for one resource
    moves.py        `Moves`: its State and every move between them (TRANSITIONS), over the parts:
    socket_book.py    which sockets exist and what each one is for
    attempts.py       the Register in flight, what came meanwhile, and when to try again
    letgo.py          the wait for kubelet to let go of an old socket
    questions.py      the pod-resources call in flight, and whose answer it is
    count_check.py    does kubelet count our devices? (pod-resources)
    report.py         the tally it keeps, and the typed report STATUS= and the metrics read

`atedevd/glue/performer.py` carries the actions out; the simulation (tests/simulation)
runs the same performer with only the I/O beneath it faked.
"""
