"""The timed kubelet stand-in (container_timed_standin.py), also recording admission.

For the systemd container, where the stand-in runs as kubelet in a unit of its own,
outside atedevd's: from its start, Kubelet.record_admission() samples every millisecond
(and at every change) whether kubelet would admit a pod requesting ate.dev/kvm, and the
state file gains "admission": the log's transitions, [time, "admit"|"reject"|"down",
reason], in CLOCK_MONOTONIC seconds (one clock for the host and the container), with the
number of samples and the widest gap between two. Same arguments as
`kubelet_standin.py serve`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import container_timed_standin  # noqa: E402
import kubelet_standin  # noqa: E402

RESOURCE = "ate.dev/kvm"


class AdmissionKubelet(container_timed_standin.ContainerTimedKubelet):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.admission = None

    def start(self, *args, **kwargs) -> None:
        super().start(*args, **kwargs)
        if self.admission is None:  # from the first kubelet.sock on, across restarts
            self.admission = self.record_admission(RESOURCE)

    def state(self) -> dict:
        out = super().state()
        log = self.admission
        if log is not None:
            with self.cond:
                out["admission"] = {"resource": RESOURCE, "transitions": [list(t) for t in log.transitions],
                                    "samples": log.samples, "max_gap": log.max_gap}
        return out


if __name__ == "__main__":
    kubelet_standin.os = container_timed_standin._OS
    kubelet_standin.Kubelet = AdmissionKubelet  # what `serve` builds
    sys.exit(kubelet_standin.main())
