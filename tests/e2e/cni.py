"""The cluster's CNI plugin: a network inside each pod's own network namespace and nowhere else.

containerd asks every pod sandbox that is not hostNetwork for an address (without one: "failed to
find network info for sandbox"), and `hostUsers: false` pods cannot be hostNetwork. This plugin
gives such a pod `lo` and an `eth0` that is one end of a veth pair whose other end stays in the
same namespace, with a link-local address: nothing is added to the host's namespace, no route
leads out, no packet leaves the pod. It also answers containerd's `loopback` network.

Run as a CNI plugin (CNI_COMMAND and the network configuration on stdin), through the wrapper
cluster.py writes into the cluster's CNI bin directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]


def _in_netns(netns: str, *args: str) -> None:
    subprocess.run(["nsenter", f"--net={netns}", "ip", *args], check=True, capture_output=True)


def _address(container_id: str) -> str:
    """A link-local address per sandbox (it need only be valid: nothing routes to it)."""
    h = hashlib.sha256(container_id.encode()).digest()
    return f"169.254.{1 + h[0] % 254}.{1 + h[1] % 254}"


def add(conf: dict, env: dict) -> dict:
    netns, ifname = env["CNI_NETNS"], env.get("CNI_IFNAME", "eth0")
    version = conf.get("cniVersion", "1.0.0")
    _in_netns(netns, "link", "set", "lo", "up")
    if conf.get("type") == "loopback":
        return {"cniVersion": version, "interfaces": [{"name": "lo", "sandbox": netns}],
                "ips": [{"address": "127.0.0.1/8", "interface": 0}]}
    peer = (ifname + "p")[:15]
    _in_netns(netns, "link", "add", ifname, "type", "veth", "peer", "name", peer)
    address = _address(env.get("CNI_CONTAINERID", netns))
    _in_netns(netns, "addr", "add", f"{address}/32", "dev", ifname)
    _in_netns(netns, "link", "set", peer, "up")
    _in_netns(netns, "link", "set", ifname, "up")
    mac = subprocess.run(["nsenter", f"--net={netns}", "cat", f"/sys/class/net/{ifname}/address"],
                         capture_output=True, text=True).stdout.strip()
    ip = {"address": f"{address}/32", "interface": 0}
    if version < "0.3.1":
        ip["version"] = "4"
    return {"cniVersion": version, "interfaces": [{"name": ifname, "mac": mac, "sandbox": netns}], "ips": [ip]}


def main() -> int:
    env = dict(os.environ)
    command = env.get("CNI_COMMAND", "")
    if command == "VERSION":
        print(json.dumps({"cniVersion": "1.0.0", "supportedVersions": VERSIONS}))
        return 0
    conf = json.loads(sys.stdin.read() or "{}")
    if command == "ADD":
        try:
            print(json.dumps(add(conf, env)))
        except subprocess.CalledProcessError as e:
            print(json.dumps({"cniVersion": conf.get("cniVersion", "1.0.0"), "code": 11,
                              "msg": f"{' '.join(e.cmd)}: {e.stderr.decode(errors='replace').strip()}"}))
            return 1
    # DEL: the namespace and everything in it go with the sandbox; CHECK, STATUS, GC: all is well.
    return 0


if __name__ == "__main__":
    sys.exit(main())
