"""What the README, the manuals and docs/design.md say, held against what the daemon does."""

import enum
import os
import re
import stat
import subprocess

from rig.harness import REPO, RESOURCE
from tests.meta.test_layout import modules


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def our_sockets(plugin_dir: str):
    """The daemon's sockets, whatever they are called: every socket but kubelet's."""
    out = []
    for name in os.listdir(plugin_dir):
        path = os.path.join(plugin_dir, name)
        if name != "kubelet.sock" and stat.S_ISSOCK(os.lstat(path).st_mode):
            out.append(path)
    return out


def test_socket_mode_is_what_the_docs_say(daemon, kubelet, plugin_dir):
    [sock] = our_sockets(plugin_dir)
    st = os.stat(sock)
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, os.geteuid())
    readme, man = read("README.md"), read("man/atedevd.8")
    assert "mode 0700" in readme and "mode 0700" in man
    assert "mode 0600" not in readme and "mode 0600" not in man


def test_ready_is_sent_after_the_first_pass_even_when_nothing_is_served(start_daemon, tmp_path):
    """No device node, no plugin directory, no kubelet: READY=1 all the same, and STATUS= says why."""
    empty_dev = tmp_path / "empty-dev"
    empty_dev.mkdir()
    d = start_daemon(dev_root=str(empty_dev))
    m = d.wait_ready()
    assert m["fields"]["STATUS"] == f"{RESOURCE}: /dev/kvm missing, not advertised", m
    assert not os.path.exists(d.plugin_dir)
    man = read("man/atedevd.8")
    assert "READY=1 after its first pass over the configuration" in man
    assert "READY=1 does not mean registered, nor even serving" in man


def test_ready_without_a_plugin_directory_waits_for_it(start_daemon):
    d = start_daemon()  # the fake /dev/kvm exists; kubelet's directory does not
    m = d.wait_ready()
    assert m["fields"]["STATUS"] == f"{RESOURCE}: waiting for {d.plugin_dir}", m


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for path in files:
        if path == "tests/meta/test_docs.py" or not os.path.isfile(os.path.join(REPO, path)):
            continue
        text = read(path)
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"\.\./shared|shared/design\.md|/work/", line):
                offenders.append(f"{path}:{n}: {line.strip()}")
    assert offenders == []


def test_design_document_is_in_the_repository_and_pointed_to():
    design = read("docs/design.md")
    for heading in ("## The control loop", "## What kubelet does on the other end", "## Registration",
                    "## systemd integration", "## The sandbox", "## Configuration"):
        assert f"\n{heading}\n" in design, heading
    assert "docs/design.md" in read("README.md")
    assert "docs/design.md" in read("atedevd/api/deviceplugin.proto")


def test_man_page_unit_path_matches_the_deb_and_the_rpm():
    man = read("man/atedevd.8")
    assert ".I /lib/systemd/system/atedevd.service" in man  # the .deb on Debian 12 (test_packaging)
    assert "/usr/lib/systemd/system/atedevd.service" in man  # the .rpm's %{_unitdir}


def test_every_metric_is_documented():
    """Each family the daemon writes is in docs/metrics.md (with its type) and in atedevd(8)."""
    from atedevd.glue import metrics
    from atedevd.registration.messages import State, Why
    from atedevd.registration.report import Report

    report = Report(name=RESOURCE, device_path="/dev/kvm", pattern=False, state=State.REGISTERED, changed_at=0.0, advertised=True,
                    units=1, healthy_units=1, kubelet_count=1, registrations=1, begun={}, registers_sent=1,
                    allocate_calls=0, allocate_failures=0, refused_streams=0, last_error=None, failing_since=None,
                    serve_error=None, last_reregistration=None)
    text = metrics.render(metrics.DaemonInfo("v", "f", "g", "p", "py", 0.0), [report], polling=False,
                          reload_ok=True, wall_offset=0.0)
    families = dict(line[len("# TYPE "):].split() for line in text.splitlines() if line.startswith("# TYPE "))
    doc, man = read("docs/metrics.md"), read("man/atedevd.8").replace("\\-", "-")
    for name, kind in families.items():
        assert f"| `{name}` | {kind} |" in doc, name
        assert name in man, name
    for reason in (w.value for w in Why):
        assert f"| `{reason}` |" in doc and reason in man, reason
    for state in State:
        assert f"`{state.value}`" in doc, state
    assert "docs/metrics.md" in read("README.md")


def test_the_design_documents_every_move_of_the_registration_and_no_other():
    """docs/design.md's table of transitions is registration/moves.py's TRANSITIONS."""
    import re

    from atedevd.registration.moves import TRANSITIONS

    doc = read("docs/design.md")
    table = doc[doc.index("| from | to | on |"):]
    table = table[:table.index("\n\n")]
    documented = set()
    for row in table.splitlines()[2:]:
        sources, target = row.split("|")[1:3]
        for source in re.findall(r"`([a-z-]+)`", sources):
            documented.add((source, re.findall(r"`([a-z-]+)`", target)[0]))
    assert documented == {(a.value, b.value) for a, b, _ in TRANSITIONS}


# --- docs/design.md and the README's module table, held to the code (no daemon runs here) ---------

DESIGN_MAX_LINES = 900  # issue 28: the design as it is; measured history is what `make bench` prints


def section(text: str, heading: str) -> str:
    """The section under `heading` (a line of its own), up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n") + 1
    ends = [i + 1 for i in (text.find(f"\n{'#' * n} ", start + len(heading)) for n in range(1, len(level) + 1)) if i != -1]
    return text[start:min(ends, default=len(text))]


def table(text: str, header: str) -> list:
    """The rows of the markdown table whose header line starts with `header`, as lists of cells."""
    start = text.index(header)
    lines = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]


def ticked(cell: str) -> list:
    return re.findall(r"`([^`]+)`", cell)


def test_the_design_document_is_under_its_line_budget():
    lines = read("docs/design.md").count("\n")
    assert lines < DESIGN_MAX_LINES, f"docs/design.md has {lines} lines; the design as it is fits in {DESIGN_MAX_LINES}"


def test_the_readme_module_table_lists_every_module_of_the_package_and_no_other():
    """The README's "Where things are": a row's first cell names paths; a bare name is in the directory of the
    path before it (`atedevd/glue/plugin_dir.py`, `resource.py`), a name ending in / a package or directory."""
    readme = read("README.md")
    rows = section(readme, "## Where things are")
    listed = set()
    for line in rows.splitlines():
        if not line.startswith("| `"):
            continue
        base = None
        for name in ticked(line.split("|")[1]):
            if "/" in name.rstrip("/"):
                base, path = os.path.dirname(name.rstrip("/")), name
            else:
                path = os.path.join(base, name) if base else name
            listed.add(path)
    package = os.path.join(REPO, "atedevd")
    top_level = {f"atedevd/{f}" for f in os.listdir(package) if f.endswith(".py") and f != "__init__.py"}
    packages = {f"atedevd/{d}/" for d in os.listdir(package) if os.path.isfile(os.path.join(package, d, "__init__.py"))}
    assert {p for p in listed if p.startswith("atedevd/")} == top_level | packages
    assert [p for p in listed if not os.path.exists(os.path.join(REPO, p))] == []


def test_the_design_counts_and_names_every_scenario_of_the_simulation():
    from tests.simulation.scenarios import CHAIN, MODES, SCENARIOS

    how = section(read("docs/design.md"), "## How we know it works")
    stated = re.findall(r"\b(\d+) scenarios\b", how)
    assert stated and all(int(n) == len(SCENARIOS) for n in stated), (stated, len(SCENARIOS))
    named = [ticked(row[0])[0] for row in table(how, "| scenario | what happens |")]
    assert sorted(named) == sorted(SCENARIOS) and len(named) == len(SCENARIOS)
    assert set(MODES) == {"1.32", "current"} and "each on both kubelet generations" in how
    words = {10: "ten"}  # the rounds a world runs (scenarios.CHAIN), as the design says it
    assert f"Rounds run {words.get(CHAIN, CHAIN)} to a world" in how, CHAIN
    assert "Eleven scenarios" not in read("docs/design.md")


def _parts():
    """The parts `Moves` composes: (attribute, object), from a machine made as a resource makes it."""
    from atedevd.registration.machine import Registration

    reg = Registration("ate.dev/kvm", 4)
    parts = [(name, value) for name, value in vars(reg.moves).items()
             if type(value).__module__.startswith("atedevd.registration.") and not isinstance(value, enum.Enum)]
    return reg, parts


def test_the_design_parts_table_is_what_moves_composes_and_what_each_part_hears_and_asks_for():
    """docs/design.md, "Registration": one row per part of `Moves`, with its module; the events
    whose handler in machine.py calls it directly (the rest reach it through `Moves`), each an
    `Event` of messages.py; the timers whose deadline it keeps; and the actions it gives, which
    are the `Action`s its module holds."""
    import ast
    import importlib
    import inspect

    from atedevd.registration import machine, messages

    reg, parts = _parts()
    by_attr = {name: type(part) for name, part in parts}
    events = {c.__name__ for c in vars(messages).values()
              if isinstance(c, type) and issubclass(c, messages.Event) and c is not messages.Event}
    actions = {c.__name__ for c in vars(messages).values()
               if isinstance(c, type) and issubclass(c, messages.Action) and c is not messages.Action}
    # what machine.py's handler of each event calls directly, part by part
    tree = ast.parse(inspect.getsource(machine.Registration))
    methods = {n.name: n for n in tree.body[0].body if isinstance(n, ast.FunctionDef)}
    told = {cls.__name__: set() for cls in by_attr.values()}
    for event, handler in machine._HANDLERS.items():
        for node in ast.walk(methods[handler.__name__]):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) \
                    and isinstance(f.value.value, ast.Name) and f.value.value.id == "self" and f.value.attr in by_attr:
                told[by_attr[f.value.attr].__name__].add(event.__name__)
    # whose deadline each timer is: every part's own deadlines set apart, then asked through the machine
    owner = {}
    for n, (name, part) in enumerate(parts):
        for attr in ("deadline", "verify_by"):
            if hasattr(part, attr):
                setattr(part, attr, 1000.0 + 2 * n + (attr == "verify_by"))
                owner[1000.0 + 2 * n + (attr == "verify_by")] = type(part).__name__
    timers = {cls.__name__: set() for cls in by_attr.values()}
    for timer, deadline in machine._DEADLINE.items():
        if deadline(reg) in owner:
            timers[owner[deadline(reg)]].add(f"Timer.{timer.name}")

    rows = table(section(read("docs/design.md"), "## Registration"), "| part | module |")
    documented = {}
    for part, module, takes, gives in rows:
        [name], [file] = ticked(part), ticked(module)
        named = ticked(takes)
        documented[name] = (file, {t for t in named if not t.startswith("Timer.")},
                            {t for t in named if t.startswith("Timer.")}, set(ticked(gives)))
    composed = {cls.__name__: cls.__module__.rsplit(".", 1)[1] + ".py" for cls in by_attr.values()}
    assert {n: d[0] for n, d in documented.items()} == composed
    for name, (file, took, its_timers, gave) in documented.items():
        module = importlib.import_module(f"atedevd.registration.{file[:-3]}")
        holds = {c.__name__ for c in vars(module).values() if isinstance(c, type) and issubclass(c, messages.Action)
                 and c is not messages.Action}
        assert took <= events, (name, took - events)
        assert took == told[name], (name, "documented", sorted(took), "machine.py", sorted(told[name]))
        assert its_timers == timers[name], (name, its_timers, timers[name])
        assert gave <= actions and gave == holds, (name, gave, holds)


def test_each_part_but_attempts_is_tested_on_its_own_as_the_design_says():
    """The design says each part but `Attempts` is driven on its own, in the test file named after
    its module (tests/unit/registration/test_<module>.py)."""
    _, parts = _parts()
    alone, missing = set(), set()
    for _, part in parts:
        name, module = type(part).__name__, type(part).__module__.rsplit(".", 1)[1]
        path = f"tests/unit/registration/test_{module}.py"
        if os.path.exists(os.path.join(REPO, path)) and re.search(rf"\b{name}\(", read(path)):
            alone.add(name)
        else:
            missing.add(name)
    assert missing == {"Attempts"} and len(alone) >= 5, (alone, missing)
    assert "Each part but `Attempts` is driven event by event on its own" in read("docs/design.md")


def test_no_part_of_the_registration_writes_another_parts_fields():
    """A part is told through its methods: no assignment anywhere in the package reaches into one."""
    import ast

    _, parts = _parts()
    attrs = {name for name, _ in parts}
    found = []
    for path in modules().values():
        with open(path, encoding="utf-8") as src:
            tree = ast.parse(src.read(), path)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    chain = t.value if isinstance(t, (ast.Attribute, ast.Subscript)) else None
                    while isinstance(chain, (ast.Attribute, ast.Subscript)):
                        if isinstance(chain, ast.Attribute) and chain.attr in attrs:
                            found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {ast.unparse(t)}")
                            break
                        chain = chain.value
    assert found == []


def test_the_performer_never_calls_the_machine():
    """Outcomes known at once are returned (the plugin directory hands them in); later ones reach
    the loop through the host: no action's handler calls `deliver` itself, outside a callback
    (handing it on, as `partial(self.deliver, ...)`, is a callback)."""
    import ast
    import inspect

    from atedevd.glue import performer

    source = inspect.getsource(performer)
    tree = ast.parse(source)
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("machine", "handle", "handle_timer")]
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for handler in set(performer._DO.values()):
        body = methods[handler.__name__]
        outside_callbacks = [n for n in ast.walk(body) if not isinstance(n, ast.Lambda)]
        lambdas = [n for n in ast.walk(body) if isinstance(n, ast.Lambda)]
        inside = {id(x) for lam in lambdas for x in ast.walk(lam)}
        direct = [n for n in outside_callbacks if id(n) not in inside and isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Attribute) and n.func.attr == "deliver"]
        assert direct == [], handler.__name__


def test_what_grpc_threads_report_reaches_the_loop_through_the_inbox():
    """A plugin server's stream events are posted: run later, on the loop, never on the gRPC thread."""
    import threading

    from atedevd.config import Device
    from atedevd.daemon.host import Host
    from atedevd.kubelet.plugin import StreamEvent

    posted, seen = [], []
    host = Host("/nonexistent/device-plugins", None, posted.append)  # type: ignore[arg-type]
    server = host.server(Device("ate.dev/kvm", "/dev/kvm"), "/nonexistent/device-plugins/x.sock",
                         threading.BoundedSemaphore(3), None, seen.append)
    server._on_event(StreamEvent.OPENED)  # what ListAndWatch does on a gRPC thread
    assert seen == [] and len(posted) == 1
    posted[0]()  # the loop runs it
    assert seen == [StreamEvent.OPENED]


def test_the_loop_and_the_simulation_run_the_same_glue(tmp_path):
    """The daemon's loop and the simulated process each build the glue's own `Process` (not a copy
    nor a subclass) over the glue's own `PluginDir`, and drive it by `wake`: what the simulation
    finds is about the daemon. (Comparing the name each module imports with itself could not fail.)"""
    from atedevd.config_file.load import load
    from atedevd.daemon import loop as daemon
    from atedevd.glue import process
    from atedevd.glue.plugin_dir import PluginDir
    from tests.simulation import world

    cfg = load(str(tmp_path / "none.toml"))._replace(device_plugin_dir=str(tmp_path / "dp"),
                                                           dev_root=str(tmp_path / "dev"), metrics_dir="")
    ours = daemon.Daemon(cfg, str(tmp_path / "none.toml"), False, {})  # (builds, starts nothing)
    w = world.World(1, "current")
    try:
        simulated = world.AtedevdProcess(w, 1, 1024)
    finally:
        w.close()
    for built in (ours, simulated):
        assert (type(built.process), type(built.plugins)) == (process.Process, PluginDir), built
        assert built.process.plugins is built.plugins
    assert "self.process.wake(" in read("atedevd/daemon/loop.py") and "self.process.wake(" in read("tests/simulation/world.py")


def test_status_and_metrics_are_said_only_when_what_they_show_changed():
    from atedevd.glue.process import Process, Status, WriteMetrics

    class ShownPluginDir:
        plugin_dir, resources, showing, counts = "/nonexistent", {}, ("registered",), ((0, 0),)
        host = type("Host", (), {"cdi": None, "isdir": staticmethod(lambda p: True),
                                 "monotonic": staticmethod(lambda: 0.0), "wall": staticmethod(lambda: 0.0)})()

        def shown(self):
            return self.showing

        def reports(self):
            return []

        def allocations(self):
            return self.counts

    node = ShownPluginDir()
    proc = Process(node)  # type: ignore[arg-type]

    def said():
        proc._changed()
        out, proc._out = proc._out, []
        return [type(a) for a in out]

    assert said() == [Status, WriteMetrics]
    assert said() == [] and said() == []
    node.showing = ("waiting",)
    assert said() == [Status, WriteMetrics]
    proc.reload_error = "bad file"
    assert said() == [Status, WriteMetrics]
    assert said() == []
    node.counts = ((1, 0),)  # an Allocate: the metrics count it, the status line does not show it
    assert said() == [WriteMetrics]


def test_one_register_in_flight_per_resource_and_a_trigger_meanwhile_waits_for_its_end():
    from atedevd.registration import messages as m
    from atedevd.registration.machine import Registration
    from atedevd.registration.messages import Listing, Outcome, State

    reg = Registration("ate.dev/kvm", 4)
    reg.handle(0.0, m.Serve(True, -60.0))
    ask = next(a for a in reg.take() if isinstance(a, m.AskPodResources))
    reg.handle(0.0, m.Bound(1))
    reg.handle(0.0, m.Listed(ask.cid, Listing.LISTED, 0))
    reg.handle(0.0, m.Placed(1))
    sends = [a for a in reg.take() if isinstance(a, m.SendRegister)]
    assert len(sends) == 1 and reg.state is State.REGISTERING
    for at, trigger in ((0.1, m.SocketDeleted(1)), (0.2, m.StreamEnded(1)), (0.3, m.Nudge())):
        reg.handle(at, trigger)
        reg.handle_timer(at)
        assert not [a for a in reg.take() if isinstance(a, (m.SendRegister, m.Bind, m.Place))], trigger
    reg.handle(0.4, m.RegisterDone(sends[0].cid, Outcome.OK))
    assert reg.state is State.LETTING_GO  # the trigger is acted on now: the socket kubelet knew is let go of first


def test_every_register_kubelet_takes_names_a_socket_no_register_named_before(monkeypatch):
    """A new socket file per registration, over restarts of kubelet and of atedevd, upgrades and
    reloads, on both kubelet generations (simulated rounds, ~10 ms each)."""
    from tests.simulation import scenarios
    from tests.simulation.kubelet import KubeletModel

    named = []
    register = KubeletModel.register

    def noting(self, resource, path, reply):
        if self.inc is not None and self.inc.listening:  # a refused one (nobody listens yet) is sent again as it was
            named.append((resource, path))
        return register(self, resource, path, reply)

    monkeypatch.setattr(KubeletModel, "register", noting)
    for scenario in ("kubelet-restart-back-to-back", "our-socket-deleted", "kubelet-ends-our-stream",
                     "daemon-kill-9-restart", "upgrade", "sighup-resource-removed-and-back"):
        for mode in scenarios.MODES:
            for seed in range(1, 4):
                named.clear()
                problems, *_ = scenarios.run_round(seed, mode, scenario)
                assert problems == [], (scenario, mode, seed, problems)
                assert len(named) == len(set(named)) and len(named) >= 2, (scenario, mode, seed, named)


def _code_index():
    """Every module of the package and of the simulation by its short name, and every class they define."""
    import importlib
    import pkgutil

    import atedevd
    import tests.simulation

    index: dict = {}
    for pkg in (atedevd, tests.simulation):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith("__main__") or ".api." in info.name:
                continue
            module = importlib.import_module(info.name)
            index.setdefault(info.name.rsplit(".", 1)[1], []).append(module)
            for value in vars(module).values():
                if isinstance(value, type) and value.__module__ == module.__name__:
                    index.setdefault(value.__name__, []).append(value)
    return index


def _resolves(obj, names) -> bool:
    import inspect

    for i, name in enumerate(names):
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        if inspect.isclass(obj) and i == len(names) - 1:  # an attribute its instances get in a method
            return re.search(rf"\bself\.{re.escape(name)}\b", inspect.getsource(obj)) is not None
        return False
    return True


def test_every_code_name_the_design_gives_exists():
    """`module.name`, `Class.attr` (with or without a call's arguments): each resolves in the
    package or the simulation. Names of files (`kubelet.sock`, `atedevd.prom`) are not code."""
    import importlib

    index = _code_index()
    design = read("docs/design.md")
    files = (".sock", ".json", ".toml", ".prom", ".md", ".py", ".proto", ".service", ".conf", ".example", ".d")
    missing = []
    for token in sorted(set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`", design))):
        if token.endswith(files):
            continue
        first, *rest = token.split(".")
        candidates = index.get(first, [])
        if first == "atedevd":
            candidates = [importlib.import_module(".".join(token.split(".")[:2]))]
            rest = rest[1:]
        if candidates and not any(_resolves(c, rest) for c in candidates):
            missing.append(token)
    assert missing == []


def test_every_path_the_design_names_exists():
    design = read("docs/design.md")
    paths = set(re.findall(r"(?<![\w/.-])((?:atedevd|tests|rig|bench|docs|man|systemd|packaging|etc|debian|rpm)/[\w./-]*[\w/])",
                           design))
    assert paths and [p for p in sorted(paths) if not os.path.exists(os.path.join(REPO, p))] == []


def test_every_section_of_the_design_the_code_cites_is_there():
    """`docs/design.md, "Title"` (or `("Title"`) in any file of the repository names a heading or a
    bold lead-in of docs/design.md."""
    design = read("docs/design.md")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    cited = set()
    for path in files:
        if path in ("docs/design.md", "tests/meta/test_docs.py") or not os.path.isfile(os.path.join(REPO, path)):
            continue
        try:
            text = read(path)
        except UnicodeDecodeError:
            continue
        flat = re.sub(r"\s*\n\s*(?:#|//|\*)?\s*", " ", text)  # a citation wrapped over comment lines
        cited |= {(path, title) for title in re.findall(r'docs/design\.md[,\s(]*"([^"]+)"', flat)}
    assert cited
    missing = [(path, title) for path, title in sorted(cited)
               if not re.search(rf"^#+ {re.escape(title)}$|\*\*{re.escape(title)}", design, re.M)]
    assert missing == []


def test_every_bench_row_the_design_quotes_is_one_make_bench_prints():
    design = read("docs/design.md")
    bench = "".join(read(os.path.join("bench", f)) for f in sorted(os.listdir(os.path.join(REPO, "bench"))) if f.endswith(".py"))
    quoted = [" ".join(q.split()) for q in re.findall(r'\b(?:rows?|and) "([^"]+)"', design)]
    assert len(quoted) >= 5
    assert [q for q in quoted if q not in bench] == []


def test_a_register_nobody_listens_for_is_sent_again_on_its_socket_as_the_design_says():
    """docs/design.md, "A Register refused because nobody listens yet": 0.25 ms, then half the
    socket's age (about 11 tries in the first 20 ms), then backing off to 2 s, until 5 s after
    kubelet.sock appeared; past that, only the 10 s look."""
    from atedevd.registration import messages as m
    from atedevd.registration.machine import Registration
    from atedevd.registration.messages import Listing, Outcome

    reg = Registration("ate.dev/kvm", 4)
    reg.handle(0.0, m.Serve(True, 0.0))  # kubelet.sock appeared at 0, not yet listened on
    ask = next(a for a in reg.take() if isinstance(a, m.AskPodResources))
    reg.handle(0.0, m.Bound(1))
    reg.handle(0.0, m.Listed(ask.cid, Listing.REFUSED))
    reg.handle(0.0, m.Placed(1))
    now, sent = 0.0, []
    while now < 30.0:
        sends = [a for a in reg.take() if isinstance(a, m.SendRegister)]
        assert len(sends) == 1 and sends[0].sid == 1, sends  # always the same socket, nothing bound anew
        sent.append(now)
        reg.handle(now, m.RegisterDone(sends[0].cid, Outcome.REFUSED))
        now = reg.get_timer()
        reg.handle_timer(now)
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert gaps[0] == 0.00025
    assert 9 <= sum(1 for t in sent if t < 0.02) <= 13
    late = [g for t, g in zip(sent, gaps) if 0.02 <= t < 5.0]
    assert late and max(late) <= 2.0
    assert [g for t, g in zip(sent, gaps) if t >= 5.0] and all(g == 10.0 for t, g in zip(sent, gaps) if t >= 5.0)


def test_what_the_design_says_the_simulation_runs_and_fakes_are_classes_of_the_daemon_and_the_simulation():
    """The section "How we know it works" names the daemon's own classes the simulation runs and the ones
    that stand in for I/O: each a class of atedevd/ or tests/simulation/ (as the code names it)."""
    index = _code_index()
    how = section(read("docs/design.md"), "## How we know it works")
    how = how[:how.index("| scenario |")]
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", how))
    assert {"Process", "PluginDir", "Resource", "Performer", "SimHost", "SimServer", "KubeletModel", "Directory", "World",
            "Udev", "AtedevdProcess"} <= named
    assert [n for n in sorted(named) if not any(isinstance(c, type) for c in index.get(n, []))] == []
