"""The one container image the cluster's pods run, built at the cluster's start (no registry is
reachable): static binaries compiled with gcc and packed as a docker archive for `ctr import`.

    /pause       the pod sandbox's process (the image's entrypoint)
    /probe PATH  what a container sees of each PATH (tests/runtime/oci_probe.c: mode, owner,
                 numbers, a read-write open or its errno, KVM_GET_API_VERSION), then exits
    /probe-hold  the same, then waits for SIGTERM: a Deployment's container must keep running
"""
from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from tests.runtime import oci_runtime

PAUSE_C = b"""#include <signal.h>
#include <unistd.h>
static void bye(int s) { (void)s; _exit(0); }
int main(void) { signal(SIGTERM, bye); signal(SIGINT, bye); for (;;) pause(); }
"""
# The probe's own main is compiled as probe_main; this main runs it, then holds.
HOLD_C = b"""#include <signal.h>
#include <stdio.h>
#include <unistd.h>
int probe_main(int argc, char **argv);
static void bye(int s) { (void)s; _exit(0); }
int main(int argc, char **argv) {
    signal(SIGTERM, bye);
    signal(SIGINT, bye);
    probe_main(argc, argv);
    fflush(stdout);
    for (;;) pause();
}
"""


def name() -> str:
    """The image's reference, by the hash of what it is built from."""
    key = hashlib.sha256(PAUSE_C + HOLD_C + oci_runtime.PROBE_SOURCE.read_bytes()).hexdigest()[:12]
    return f"localhost/atedevd-e2e:{key}"


def _gcc(*args: str) -> None:
    subprocess.run(["gcc", "-O2", *args], check=True, capture_output=True)


def build(work: Path) -> Path:
    """Compile the binaries in `work` and write the archive there; its path."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "pause.c").write_bytes(PAUSE_C)
    (work / "hold.c").write_bytes(HOLD_C)
    _gcc("-static", "-o", str(work / "pause"), str(work / "pause.c"))
    _gcc("-static", "-o", str(work / "probe"), str(oci_runtime.PROBE_SOURCE))
    _gcc("-c", "-Dmain=probe_main", "-o", str(work / "probe.o"), str(oci_runtime.PROBE_SOURCE))
    _gcc("-static", "-o", str(work / "probe-hold"), str(work / "hold.c"), str(work / "probe.o"))
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        for binary in ("pause", "probe", "probe-hold"):
            t.add(str(work / binary), arcname=binary)
    data = layer.getvalue()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Entrypoint": ["/pause"]},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(data).hexdigest()]}})
    archive = work / "image.tar"
    with tarfile.open(archive, "w") as t:
        for member, blob in (("layer.tar", data), ("config.json", config.encode()),
                             ("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [name()],
                                                            "Layers": ["layer.tar"]}]).encode())):
            info = tarfile.TarInfo(member)
            info.size = len(blob)
            t.addfile(info, io.BytesIO(blob))
    return archive
