"""How this copy of atedevd was packaged. The package builds rewrite these lines in what
they install (never in the source tree): see packaging/ and docs/packaging.md.

FLAVOUR  source | deb | rpm | self-contained
PYTHON   "X.Y" when the package carries compiled modules for that Python only (the
         self-contained packages), "" when any Python 3 >= 3.9 will do
"""

FLAVOUR = "source"
PYTHON = ""
