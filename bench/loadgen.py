"""An Allocate load generator, run as a separate process by the benchmark.

`python -m bench.loadgen SOCKET OUT --threads N --start-at T (--duration S | --count C)`

Each thread is one caller with its own channel (its own connection, as each
kubelet would be), calling Allocate with one container request back to back.
The calls start at the monotonic time T (CLOCK_MONOTONIC is system-wide, so
several of these processes start together). Every call's latency in seconds
is written to OUT as native doubles; the first line on stdout is a JSON
summary {"calls", "errors", "first", "last"}.
"""

import argparse
import json
import sys
import threading
import time
from array import array

import grpc

from atedevd.api import DevicePluginStub, pb


def _caller(socket_path, start_at, deadline, count, ids, out, errors, span, barrier):
    channel = grpc.insecure_channel("unix:" + socket_path)
    stub = DevicePluginStub(channel)
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    call = stub.Allocate
    for _ in range(20):  # warm up: connection, first-call paths
        call(req, timeout=30)
    barrier.wait()
    lat = array("d")
    delay = start_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    clock = time.perf_counter
    first = time.monotonic()
    n = 0
    bad = 0
    while True:
        if count is not None:
            if n >= count:
                break
        elif time.monotonic() >= deadline:
            break
        t0 = clock()
        try:
            call(req, timeout=30)
        except grpc.RpcError:
            bad += 1
        lat.append(clock() - t0)
        n += 1
    last = time.monotonic()
    out.append(lat)
    errors.append(bad)
    span.append((first, last))
    channel.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("out")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--duration", type=float)
    p.add_argument("--count", type=int, help="calls per thread")
    p.add_argument("--ids", default="kvm-0")
    args = p.parse_args(argv)
    ids = args.ids.split(",")
    out, errors, span = [], [], []
    barrier = threading.Barrier(args.threads)
    deadline = args.start_at + (args.duration or 0)
    threads = [
        threading.Thread(target=_caller, args=(args.socket, args.start_at, deadline, args.count, ids, out, errors, span, barrier))
        for _ in range(args.threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_lat = array("d")
    for lat in out:
        all_lat.extend(lat)
    with open(args.out, "wb") as f:
        all_lat.tofile(f)
    summary = {
        "calls": len(all_lat),
        "errors": sum(errors),
        "first": min(s[0] for s in span) if span else 0,
        "last": max(s[1] for s in span) if span else 0,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
