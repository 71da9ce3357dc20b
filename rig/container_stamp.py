"""Copy stdin to the file named by argv[1], each line prefixed with CLOCK_MONOTONIC seconds.

For dpkg's --status-logger in the systemd container: when each status line (processing:
upgrade, unpacked, half-configured, installed ...) was read, on the host's clock. dpkg
starts the logger when it starts, so the first lines may be read (and stamped) as late as
this interpreter's start-up after they were written; later ones within a millisecond.
"""

import sys
import time

with open(sys.argv[1], "a") as out:
    for line in sys.stdin:
        out.write(f"{time.monotonic():.6f} {line}")
        out.flush()
