"""`make bench`: start-up, re-registration, Allocate latency and throughput,
health latency, a 64-node pattern resource beside kvm (pattern), 2 and 8 patterns over the same
2,000 nodes (overlap: idle CPU, a reload), the leak soak, idle CPU, the rejection window per lifecycle
event (lifecycle) and of a package upgrade under a real systemd (upgrade: root
and a container; the row says so when it cannot run), and Register -> healthy
against the unit count (units), as one table.

    python -m bench [--quick] [--only NAME ...] [--rounds N] [--event EVENT ...] [--limit]

`--rounds` and `--event` select what the lifecycle, units, upgrade and boot benchmarks run
(`make bench-lifecycle ROUNDS=100 EVENTS="kubelet-restart stream-ended"`); `--limit` runs
the lifecycle rounds with kubelet's pod-resources rate limit in the stand-in and a node
agent polling pod-resources 80 times a second beside atedevd (`make bench-lifecycle LIMIT=1`).

The daemon runs as a process (as systemd runs it) with the default config:
one device, 1024 units. The kubelet stand-in runs in this process; Allocate
load comes from separate client processes. Figures are printed, never
asserted: this machine is shared and noisy. The exit status is 0 unless a
benchmark could not run.
"""

import argparse
import inspect
import os
import sys
import time

from bench.benches import BENCHES


def table(rows) -> str:
    head = ("benchmark", "figure", "value", "target", "result")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    out = [line(head), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    p.add_argument("--only", action="append", choices=sorted(BENCHES), metavar="NAME",
                   help=f"run only this benchmark (repeatable): {', '.join(BENCHES)}")
    p.add_argument("--rounds", type=int, metavar="N", help="rounds per row (benchmarks that take it: lifecycle, units, upgrade)")
    p.add_argument("--event", action="append", metavar="EVENT", help="lifecycle events to run (repeatable; default all)")
    p.add_argument("--limit", action="store_true",
                   help="lifecycle: kubelet's pod-resources limit (100/s, burst 10) and a node agent at 80/s beside")
    args = p.parse_args(argv)
    names = args.only or list(BENCHES)
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.event:
        from bench.lifecycle import EVENTS

        unknown = [e for e in args.event if e not in EVENTS]
        if unknown:
            p.error(f"unknown event(s) {', '.join(unknown)}; known: {', '.join(EVENTS)}")
    rows = []
    t0 = time.monotonic()
    for name in names:
        t = time.monotonic()
        print(f"running {name}...", file=sys.stderr, flush=True)
        fn = BENCHES[name]
        takes = inspect.signature(fn).parameters
        extra = {key: value for key, value in (("rounds", args.rounds), ("events", args.event),
                                               ("limit", args.limit or None))
                 if value is not None and key in takes}
        rows += fn(args.quick, **extra)
        print(f"  {name}: {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
    import grpc

    print(f"atedevd benchmarks ({'quick' if args.quick else 'full'}; {os.cpu_count()} CPUs; "
          f"python {sys.version.split()[0]}, grpcio {grpc.__version__}; {time.monotonic() - t0:.0f} s)")
    print(table(rows))
    misses = sum(1 for r in rows if r[4] == "MISS")
    print(f"{misses} of {sum(1 for r in rows if r[4] in ('PASS', 'MISS'))} targets missed" if misses else "all targets met")
    skipped = [r[0] for r in rows if r[4] == "SKIP"]
    if skipped:
        print(f"not run: {', '.join(skipped)} (see the table for why)")
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
