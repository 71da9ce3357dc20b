"""Reading Prometheus' text format, and Debian's node_exporter run on loopback for a test.

Shared by tests/process/test_metrics.py and the real-systemd test.
"""

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from typing import Dict, List, Optional, Tuple

from rig.harness import end_process

NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"  # Debian's prometheus-node-exporter

_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)\Z')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|\Z)')

Key = Tuple[str, Tuple[Tuple[str, str], ...]]


def parse(text: str) -> Tuple[Dict[Key, float], Dict[str, str], Dict[str, str]]:
    """(samples by (name, sorted labels), TYPE by family, HELP by family). Raises
    ValueError on any line that is not a comment or a valid sample."""
    samples: Dict[Key, float] = {}
    types: Dict[str, str] = {}
    helps: Dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line[7:].split(" ", 1)
            types[name] = kind
        elif line.startswith("# HELP "):
            name, text_ = line[7:].split(" ", 1)
            helps[name] = text_
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            if not m:
                raise ValueError(f"not a sample: {line!r}")
            labels = []
            rest = m.group(2) or ""
            while rest:
                lm = _LABEL.match(rest)
                if not lm:
                    raise ValueError(f"bad labels in {line!r}")
                labels.append((lm.group(1), re.sub(r"\\(.)", lambda x: {"n": "\n"}.get(x.group(1), x.group(1)), lm.group(2))))
                rest = rest[lm.end():]
            key = (m.group(1), tuple(sorted(labels)))
            if key in samples:
                raise ValueError(f"duplicate series {key}")
            samples[key] = float(m.group(3))
    return samples, types, helps


def value(samples: Dict[Key, float], name: str, **labels: str) -> Optional[float]:
    return samples.get((name, tuple(sorted(labels.items()))))


def series(samples: Dict[Key, float], name: str) -> List[Key]:
    """Every series of the family `name`."""
    return sorted(k for k in samples if k[0] == name)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeExporter:
    """node_exporter with only its textfile collector, on 127.0.0.1 at a free port."""

    def __init__(self, textfile_dir: str, log_path: str):
        if not os.path.exists(NODE_EXPORTER) and shutil.which("prometheus-node-exporter") is None:
            raise RuntimeError("prometheus-node-exporter is not installed (packaging/install-deps installs it)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{self.port}", "--collector.disable-defaults",
             "--collector.textfile", f"--collector.textfile.directory={textfile_dir}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node_exporter did not listen: {self.log()}")
                time.sleep(0.02)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url, timeout=5) as r:
            return r.read().decode()

    def wait_for(self, predicate, timeout: float = 15.0):
        """Scrape until `predicate(samples)` holds; the last samples (and text) either way."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.scrape()
            samples = parse(text)[0]
            if predicate(samples) or time.monotonic() > deadline:
                return samples, text
            time.sleep(0.1)

    def close(self) -> None:
        end_process(self.proc, 5)
        self._log.close()
