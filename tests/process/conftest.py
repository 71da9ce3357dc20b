"""The `installed` fixture the upgrade tests replace files of."""

import os
import shutil

import pytest

from rig.harness import REPO


@pytest.fixture
def installed(tmp_path):
    """A copy of the package, where the daemon imports from: what a node has installed."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(REPO, "atedevd"), site / "atedevd", ignore=shutil.ignore_patterns("__pycache__"))
    return site
