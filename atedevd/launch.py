"""The `atedevd` command: check that this Python can run the package, then the CLI.

Every package's /usr/bin/atedevd comes here first, so a package built for another Python,
or a dependency that is missing, ends in one line naming the problem and exit status 1
(which the unit restarts on, with the line in `systemctl status`), never a traceback.
"""

import gc
import os
import sys
from typing import List, Optional

from atedevd import _build
from atedevd.daemon import restarts

EX_RUNTIME = 1
# module -> what provides it, per flavour of package
NEEDED = {
    "grpc": "grpcio (Debian: python3-grpcio; Fedora/EL: python3-grpcio)",
    "google.protobuf": "protobuf (Debian: python3-protobuf; Fedora/EL: python3-protobuf)",
    # what watch.py and daemon.py import (inotify.calls would load ctypes.util: 6 ms)
    "inotify.constants": "inotify (Debian: python3-inotify)",
    "sdnotify": "sdnotify (Debian: python3-sdnotify)",
}
SELF_CONTAINED = "atedevd-bundled (make deb-bundled / rpm-bundled PYTHON_VERSION=X.Y)"


def problem() -> Optional[str]:
    """Why this interpreter cannot run atedevd, in one line, or None."""
    running = "%d.%d" % sys.version_info[:2]
    if sys.version_info < (3, 9):
        return f"atedevd needs Python >= 3.9, {sys.executable} is {running}"
    if _build.PYTHON and _build.PYTHON != running:
        return (f"this {_build.FLAVOUR} package was built for Python {_build.PYTHON}, but {sys.executable} is "
                f"Python {running}: install the package built for {running} (PYTHON_VERSION={running})")
    if sys.version_info < (3, 11):
        NEEDED.setdefault("tomli", "tomli (Debian: python3-tomli)")
    for module, provider in NEEDED.items():
        try:
            __import__(module)
        except ImportError as e:
            hint = "" if _build.FLAVOUR == "self-contained" else f", or use the self-contained package {SELF_CONTAINED}"
            return f"cannot import {module} ({e}): install {provider}{hint}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["run"]:
        if "ATEDEVD_HANDOFF_FD" not in os.environ:  # (a successor of an upgrade is no restart)
            restarts.begin()  # first: a start that fails below is a crash loop's too
        # The imports of a start make ~50 passes of the cycle collector over objects that
        # live as long as the process (4 ms of 85). The daemon turns it back on once its
        # first Registers are sent, with what exists by then frozen (Daemon._start_work).
        gc.disable()
    why = problem()
    if why:
        print(f"atedevd: {why}", file=sys.stderr)
        return EX_RUNTIME
    from atedevd.cli import main as cli_main

    return cli_main(argv)
