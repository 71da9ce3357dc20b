"""`python -m atedevd` runs the same command as the installed `atedevd`."""

import sys

from atedevd.launch import main

sys.exit(main())
