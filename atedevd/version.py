"""What this atedevd is and what it runs on: `atedevd --version` and the metrics' build info."""

import sys

from atedevd import _build


def stack_versions() -> dict:
    """Our version, the package flavour and the versions of the stack (grpcio, protobuf,
    Python) this process runs on: `atedevd --version` and the metrics' build info."""
    from atedevd import __version__

    out = {"version": __version__, "flavour": _build.FLAVOUR}
    for module, dist in (("grpc", "grpcio"), ("google.protobuf", "protobuf")):
        try:
            out[dist] = __import__(module, fromlist=["__version__"]).__version__
        except ImportError:
            out[dist] = "missing"
    out["python"] = "%d.%d.%d" % sys.version_info[:3]
    return out


def version_text() -> str:
    """`atedevd --version`: our version, the package flavour, and the stack it runs on."""
    v = stack_versions()
    stack = ", ".join(f"{dist} {v[dist]}" for dist in ("grpcio", "protobuf"))
    return f"atedevd {v['version']}\npackage: {v['flavour']}\nruns on: {stack}, Python {v['python']}"


def version_action():
    """The argparse action of --version: print version_text() (imports grpc, so only when
    asked) and exit 0. Made when the parser is: argparse is not imported on a start's path."""
    import argparse

    class VersionAction(argparse.Action):
        def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
            super().__init__(option_strings, dest=dest, default=default, nargs=0,
                             help=help or "show the version, the package flavour and the grpcio/protobuf in use")

        def __call__(self, parser, namespace, values, option_string=None):
            print(version_text())
            parser.exit()

    return VersionAction
