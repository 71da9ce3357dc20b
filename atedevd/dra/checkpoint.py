"""The prepared claims on disk: one JSON file beside the plugin's socket, replaced whole (written
beside it, renamed over it) before kubelet is answered, so that a restart, a crash or an upgrade
knows every claim that was prepared (atedevd/dra/claims.py decides what it holds).

It is not synced: a process that dies leaves the page cache, so a restart and a kill -9 read every
claim; only a node that loses power can lose the last writes, and its pods start anew after the
boot, each prepare of a claim the file no longer holds read from the API server again (a sync cost
10 ms of every prepare on this machine's disk: make bench, dra).
"""

import json
import os
from typing import Optional, Tuple

FILE = "claims.json"


def read(directory: str) -> Tuple[Optional[object], str]:
    """(the document, "") or (None, why it could not be read); (None, "") when there is none."""
    path = os.path.join(directory, FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(16 << 20)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"{path}: {e.strerror or e}"
    try:
        return json.loads(raw.decode()), ""
    except (UnicodeDecodeError, ValueError) as e:
        return None, f"{path}: not JSON ({e})"


def write(directory: str, doc: dict) -> None:
    """Replace the checkpoint with `doc`: a temporary file renamed over it, so that a reader
    finds the old document or the new one, never a part. Raises OSError."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = os.path.join(directory, f".{FILE}.{os.getpid()}.tmp")
    data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode() + b"\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(directory, FILE))
