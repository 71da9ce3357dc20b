"""`make demo`: the real daemon against the kubelet stand-in, in a temp dir.

Shows, in the terminal: registration, an Allocate as kubelet makes it for a
pod requesting ate.dev/kvm, a kubelet restart and the re-registration, and a
clean stop. Lines starting with `atedevd |` are the daemon's own log.
"""

import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from rig.harness import RESOURCE, DaemonUnderTest, fake_dev_root
from rig.kubelet_standin import Kubelet


def say(text: str) -> None:
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print(f"{bold}==> {text}{plain}", flush=True)


def tail(path: str, stop: threading.Event) -> None:
    """Echo the daemon's log as it is written."""
    with open(path, "rb") as f:
        while not stop.is_set():
            line = f.readline()
            if line:
                print("atedevd | " + line.decode(errors="replace").rstrip(), flush=True)
            else:
                time.sleep(0.02)


def main() -> int:
    root = tempfile.mkdtemp(prefix="atedevd-demo-")
    plugin_dir = os.path.join(root, "device-plugins")
    dev_root = fake_dev_root(os.path.join(root, "dev"))
    say(f"demo in {root}: dev root {dev_root} (kvm -> /dev/null, a character device), plugin dir {plugin_dir}")
    kubelet = Kubelet(plugin_dir)
    kubelet.start()
    say("kubelet stand-in serving kubelet.sock; starting `atedevd run`")
    daemon = DaemonUnderTest(os.path.join(root, "run"), plugin_dir, dev_root)
    stop = threading.Event()
    threading.Thread(target=tail, args=(daemon.log_path, stop), daemon=True).start()
    try:
        ready = daemon.wait_ready()
        say(f"READY=1 after {1000 * (ready['at'] - daemon.started_at):.0f} ms; STATUS={ready['fields'].get('STATUS')}")
        assert kubelet.wait_connected(RESOURCE), "not registered"
        time.sleep(0.1)
        say(f"kubelet: {RESOURCE} registered, capacity {kubelet.capacity(RESOURCE)} (devices {', '.join(sorted(kubelet.devices(RESOURCE))[:3])}, …)")

        say("kubelet: a pod requests ate.dev/kvm: 2 -> Allocate(kvm-0, kvm-1)")
        resp = kubelet.allocate(RESOURCE, ["kvm-0", "kvm-1"])
        for spec in resp.container_responses[0].devices:
            say(f"   container gets {spec.container_path} (host {spec.host_path}, permissions {spec.permissions!r}) and its cgroup allow rule; nothing else")

        say("kubelet restarts: it wipes the plugin sockets, then serves a new kubelet.sock")
        kubelet.restart(gap=0.2)
        serving = kubelet.serving_at
        assert kubelet.wait_connected(RESOURCE, registrations=2), "not re-registered"
        reg = [r for r in kubelet.registrations if r["resource"] == RESOURCE][-1]
        time.sleep(0.1)
        say(f"re-registered {1000 * (reg['at'] - serving):.1f} ms after kubelet served again; capacity {kubelet.capacity(RESOURCE)}")
        say(f"systemd STATUS: {daemon.status()}")

        say("SIGTERM (systemctl stop)")
        code = daemon.stop(signal.SIGTERM)
        time.sleep(0.1)
        left = sorted(n for n in os.listdir(plugin_dir) if n != ".standin")  # .standin: the stand-in's own
        say(f"exit status {code}; STOPPING=1 sent: {'1' in daemon.notify.values('STOPPING')}; plugin dir now holds {left}")
        return 0 if code == 0 else 1
    finally:
        stop.set()
        daemon.close()
        kubelet.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
