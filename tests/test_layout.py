"""The package's layout: no import cycle among its modules (a package may import its own submodules), no class over 400 lines.

Every `import` and `from ... import` in the package's source counts, at module level or
inside a function (a lazy import closes a cycle all the same, only later). Importing
`atedevd.a.b` runs `atedevd/a/__init__.py` first, so it counts as importing that too.
"""

import ast
import os
from typing import Dict, List, Set

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "atedevd")


def modules() -> Dict[str, str]:
    """Dotted name -> path, for every module of the package."""
    found = {}
    top = os.path.dirname(PACKAGE)
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def imports(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (and the packages those sit in)."""
    edges: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        closed = set()
        for t in targets:
            while t:  # the module, and every package above it
                if t in mods:
                    closed.add(t)
                t = t.rpartition(".")[0]
        own = name + "." if path.endswith("__init__.py") else None
        edges[name] = {t for t in closed if t != name and not (own and t.startswith(own))
                       and not name.startswith(t + ".")}  # a module's own packages are imported before it
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Each cycle found by a depth-first walk, as the path around it."""
    found, state, stack = [], {}, []

    def walk(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == "open":
                found.append(stack[stack.index(t):] + [t])
            elif t not in state:
                walk(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            walk(m)
    return found


def test_the_package_has_no_import_cycle():
    mods = modules()
    assert "atedevd.registration.machine" in mods and "atedevd.cli" in mods
    assert cycles(imports(mods)) == []


def test_the_cycle_finder_finds_one():
    """The test above can fail: a cycle like the old cli -> launch -> cli is found, lazily imported or not."""
    edges = {"atedevd.cli": {"atedevd.launch"}, "atedevd.launch": {"atedevd.metrics"},
             "atedevd.metrics": {"atedevd.launch"}}
    assert cycles(edges) == [["atedevd.launch", "atedevd.metrics", "atedevd.launch"]]
    mods = {"atedevd.a": "/x/a.py", "atedevd.b": "/x/b.py"}
    assert cycles({"atedevd.a": set(), "atedevd.b": set()}) == [] and set(mods) == {"atedevd.a", "atedevd.b"}


def test_no_class_is_over_400_lines():
    """A class a newcomer can hold in their head (the registration machine was one of 835)."""
    long = []
    for name, path in modules().items():
        if "_pb2" in name:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        long += [f"{name}.{n.name}: {n.end_lineno - n.lineno + 1}" for n in ast.walk(tree)
                 if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > 400]
    assert long == []


def test_the_daemon_keeps_only_its_process():
    """`Daemon` is the loop, its descriptors and the actions' I/O, at most 250 lines: what the
    process decides after a wake-up is `Process` (atedevd/glue/process.py), which the simulation runs too."""
    with open(modules()["atedevd.daemon.loop"], encoding="utf-8") as f:
        tree = ast.parse(f.read())
    (daemon,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Daemon"]
    assert daemon.end_lineno - daemon.lineno + 1 <= 250


def test_no_class_name_is_defined_twice():
    """A name means one thing in the package: `Stop`, `Node` or `Event` in two modules made a
    reader look twice (and a wrong import still ran)."""
    where: Dict[str, List[str]] = {}
    for name, path in modules().items():
        if "_pb2" in name:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                where.setdefault(n.name, []).append(name)
    assert {k: v for k, v in where.items() if len(v) > 1} == {}
