"""A node agent beside atedevd: another client of kubelet's pod-resources API.

Monitoring and topology agents poll the same API, whose rate limit (100 requests a
second, burst 10) kubelet applies to all clients together; what they take is not left
for atedevd. This one asks `List` and `GetAllocatableResources` in turn, `rate` times a
second (default 80), on one connection kept open, as such agents keep theirs. It never
asks faster than that: after a stall it goes on from now instead of catching up, so on
its own it never exceeds kubelet's limit. Its calls carry the user-agent `node-agent`,
by which the kubelet stand-in counts them apart from atedevd's (`pod_resources_calls`).

    agent = NodeAgent(socket_path).start(); ...; counts = agent.stop()   # in this process
    agent = spawn(socket_path); ...; counts = agent.stop()               # a process of its own
    python3 node_agent.py --socket PATH [--rate 80]   # SIGTERM: prints its counts as JSON

Counts: answered, refused (ResourceExhausted: the rate limit), failed (anything else:
kubelet down or restarting).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Optional

import grpc

from atedevd.api import PodResourcesStub, prpb

USER_AGENT = "node-agent/1"
DEFAULT_RATE = 80.0
CALL_TIMEOUT_S = 2.0


class NodeAgent:
    """Polls pod-resources from a thread until stop()."""

    def __init__(self, socket_path: str, rate: float = DEFAULT_RATE):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests a second, not {rate!r}")
        self.socket_path = socket_path
        self.rate = rate
        self.counts: Dict[str, int] = {"answered": 0, "refused": 0, "failed": 0}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "NodeAgent":
        self._thread = threading.Thread(target=self._run, daemon=True, name="node-agent")
        self._thread.start()
        return self

    def stop(self) -> Dict[str, int]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CALL_TIMEOUT_S + 5)
        return dict(self.counts)

    def _run(self) -> None:
        channel = grpc.insecure_channel("unix:" + self.socket_path, options=[("grpc.primary_user_agent", USER_AGENT)])
        stub = PodResourcesStub(channel)
        calls = ((stub.List, prpb.ListPodResourcesRequest()),
                 (stub.GetAllocatableResources, prpb.AllocatableResourcesRequest()))
        period = 1.0 / self.rate
        n = 0
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                method, request = calls[n % 2]
                n += 1
                try:
                    method(request, timeout=CALL_TIMEOUT_S)
                    self.counts["answered"] += 1
                except grpc.RpcError as e:
                    self.counts["refused" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"] += 1
                self._stop.wait(max(0.0, began + period - time.monotonic()))
        finally:
            channel.close()


class AgentProcess:
    """The agent as a process of its own (`spawn`); stop() returns its counts."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def stop(self) -> Dict[str, int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=CALL_TIMEOUT_S + 10)
        lines = out.strip().splitlines()
        return json.loads(lines[-1]) if lines else {}


def spawn(socket_path: str, rate: float = DEFAULT_RATE) -> AgentProcess:
    """Start the agent as a separate process (the repository's rig.node_agent)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    proc = subprocess.Popen([sys.executable, "-m", "rig.node_agent", "--socket", socket_path, "--rate", str(rate)],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=repo)
    return AgentProcess(proc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True, help="kubelet's pod-resources socket")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests a second (default 80)")
    args = p.parse_args(argv)
    agent = NodeAgent(args.socket, args.rate)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    agent.start()
    done.wait()
    print(json.dumps(agent.stop()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
