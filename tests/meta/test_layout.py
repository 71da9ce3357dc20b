"""The tree's layout: no import cycle among the package's modules (a package may import its own submodules), no class
over 400 lines, no class name twice in the repository, a test file for every module or a row saying where its tests are.

Every `import` and `from ... import` in the package's source counts, at module level or
inside a function (a lazy import closes a cycle all the same, only later). Importing
`atedevd.a.b` runs `atedevd/a/__init__.py` first, so it counts as importing that too.
"""

import ast
import os
import re
from typing import Dict, List, Set

from rig.harness import REPO

PACKAGE = os.path.join(REPO, "atedevd")


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


def test_the_cycle_finder_finds_one(tmp_path):
    """The test above can fail: a cycle like the old cli -> launch -> cli is found, lazily imported or not
    (the imports read from files: one at module level, the other inside a function)."""
    edges = {"atedevd.cli": {"atedevd.launch"}, "atedevd.launch": {"atedevd.metrics"},
             "atedevd.metrics": {"atedevd.launch"}}
    assert cycles(edges) == [["atedevd.launch", "atedevd.metrics", "atedevd.launch"]]
    assert cycles({"atedevd.a": set(), "atedevd.b": set()}) == []
    sources = {"a": "from atedevd import b\n", "b": "def f():\n    import atedevd.a\n", "c": "import os\n"}
    for name, text in sources.items():
        (tmp_path / f"{name}.py").write_text(text)
    found = imports({f"atedevd.{n}": str(tmp_path / f"{n}.py") for n in sources})
    assert found == {"atedevd.a": {"atedevd.b"}, "atedevd.b": {"atedevd.a"}, "atedevd.c": set()}
    assert cycles(found) == [["atedevd.a", "atedevd.b", "atedevd.a"]]


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


def repository_modules() -> Dict[str, str]:
    """Path -> path, for every Python file of the package, the rig, the tests and the benchmarks."""
    found = {}
    for top in ("atedevd", "rig", "tests", "bench"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            found.update({os.path.relpath(os.path.join(root, f), REPO): os.path.join(root, f)
                          for f in files if f.endswith(".py") and "_pb2" not in f})
    return found


def classes_defined_twice(mods: Dict[str, str]) -> Dict[str, List[str]]:
    where: Dict[str, List[str]] = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                where.setdefault(n.name, []).append(name)
    return {k: v for k, v in where.items() if len(v) > 1}


def test_no_class_name_is_defined_twice():
    """A name means one thing in the repository: `Node` in four files (kubelet's plugin directory, a
    device node, a fake) and `Daemon` in the package and the rig made a reader look twice."""
    assert classes_defined_twice(repository_modules()) == {}


def test_the_twice_finder_finds_one(tmp_path):
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("def f():\n    class Node:\n        pass\n")
    assert classes_defined_twice({n: str(tmp_path / n) for n in ("a.py", "b.py")}) == {"Node": ["a.py", "b.py"]}


def index_rows() -> Dict[str, List[str]]:
    """tests/README.md, "Where a module's tests are": module -> the test files its row names."""
    with open(os.path.join(REPO, "tests", "README.md"), encoding="utf-8") as f:
        text = f.read().split("## Where a module's tests are", 1)[1]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`atedevd/"):
            rows[cells[0].strip("`")] = re.findall(r"`([a-z_/]+(?:\.py|/))`", cells[1])
    return rows


def own_test_file(path: str) -> str:
    """atedevd/x/y.py -> tests/unit/x/test_y.py: where a module's tests are by name."""
    folder, name = os.path.split(os.path.relpath(path, PACKAGE))
    return os.path.join("tests", "unit", folder, "test_" + name)


def test_every_module_has_its_test_file_or_a_row_in_the_index():
    """A newcomer finds a module's tests by its name or in one table, and the table names nothing
    that is not there: no row for a module that has its own file, no file that does not exist."""
    rows = index_rows()
    mods = {os.path.relpath(p, REPO): p for n, p in modules().items()
            if "_pb2" not in n and not p.endswith(("__init__.py", "__main__.py"))}
    unlisted = [m for m, p in mods.items() if not os.path.exists(os.path.join(REPO, own_test_file(p))) and m not in rows]
    assert unlisted == []
    assert [m for m in rows if m not in mods] == []  # a row for a module that is gone
    assert [m for m in rows if os.path.exists(os.path.join(REPO, own_test_file(mods[m])))] == []  # has its own file
    named = {f for files in rows.values() for f in files}
    assert all(rows.values()) and [f for f in named if not os.path.exists(os.path.join(REPO, "tests", f))] == []


def test_the_slow_files_run_first_are_files_that_exist():
    """tests/conftest.py's FIRST: a path that no longer exists would silently rank nothing."""
    from tests.conftest import FIRST

    assert [f for f in FIRST if not os.path.exists(os.path.join(REPO, "tests", f))] == []
