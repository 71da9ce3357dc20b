"""`python -m atedevd` runs the same CLI as the installed `atedevd` script."""

import sys

from atedevd.cli import main

sys.exit(main())
