"""What the README, the manuals and docs/design.md say, held against what the daemon does."""

import os
import re
import stat
import subprocess

from rig.harness import REPO, RESOURCE


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
        if path == "tests/test_docs.py" or not os.path.isfile(os.path.join(REPO, path)):
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
    from atedevd import metrics
    from atedevd.registration import State, Why
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
