"""The command line: `run` as the unit starts it is read without argparse (cli._run_args),
and must mean exactly what argparse would make of it; everything else is argparse's."""

import itertools
import os
import random
import subprocess
import sys

import pytest

from atedevd import cli
from rig.harness import REPO

VALUES = ["/etc/atedevd/config.toml", "", "debug", "a=b", "-x", "-", "--config", "x y"]
WORDS = list(cli.RUN_OPTIONS) + ["--conf", "--json", "--help", "-h", "--", "run", "check", "extra", "--version"]


def argparse_says(argv):
    """vars() of argparse's Namespace, or the exit status it ends with."""
    try:
        return vars(cli._parser().parse_args(argv))
    except SystemExit as e:
        return e.code


def candidates():
    """Every option with every value in both spellings, pairs of them, and random word soup."""
    yield ["run"]
    for option, value in itertools.product(cli.RUN_OPTIONS, VALUES):
        yield ["run", option, value]
        yield ["run", f"{option}={value}"]
    for a, b in itertools.product(cli.RUN_OPTIONS, repeat=2):
        yield ["run", a, "1", b, "2"]
    rng = random.Random(16)
    for _ in range(400):
        yield ["run"] + [rng.choice(WORDS + VALUES) for _ in range(rng.randrange(1, 6))]
    yield ["check", "--config", "x"]
    yield ["check-config"]


def test_run_args_agree_with_argparse_or_leave_it_to_argparse(capsys):
    read = 0
    wrong = []
    for argv in candidates():
        fast = cli._run_args(argv)
        if fast is None:
            continue  # argparse parses it, whatever it makes of it
        read += 1
        if vars(fast) != argparse_says(argv):
            wrong.append((argv, vars(fast), argparse_says(argv)))
    assert not wrong, "\n".join(f"{a}: ours {o}, argparse {p}" for a, o, p in wrong[:10])
    assert read > 50  # the fast path was taken, not only declined


def test_run_as_the_unit_starts_it_is_read_without_argparse():
    """The exact command lines of the unit and the test harness take the fast path."""
    unit = ["run"]
    harness = ["run", "--device-plugin-dir", "/p", "--dev-root", "/d", "--log-level", "info",
               "--config", "/c.toml", "--metrics-dir", ""]
    for argv in (unit, harness):
        assert cli._run_args(argv) is not None
        assert vars(cli._run_args(argv)) == argparse_says(argv)


def test_a_start_imports_nothing_it_can_do_without():
    """The start path (the CLI up to a config error, then the daemon's imports) leaves out
    argparse, the shutil it pulls in, tempfile and dataclasses: together about 8 ms of
    every start (docs/design.md, "Where a start's time goes")."""
    code = ("import sys; sys.argv = ['atedevd', 'run', '--config', '/nonexistent/atedevd.toml']; "
            "from atedevd.launch import main; assert main() == 78; import atedevd.daemon; "
            "print(' '.join(m for m in ('argparse', 'shutil', 'tempfile', 'dataclasses') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported on a start's path: {out.stdout.strip()}"


def test_help_and_bad_usage_are_still_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--bogus", "x"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--help"])
    assert e.value.code == 0
    assert "--metrics-dir" in capsys.readouterr().out


def test_the_shipped_device_class_is_the_default_configuration_s(tmp_path, capsys):
    """manifests/deviceclasses.json, in every package's docs: what `atedevd device-classes` prints
    for the default configuration (regenerate it with that command when the class changes)."""
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    assert cli.main(["device-classes", "--config", str(cfg)]) == 0
    with open(os.path.join(REPO, "manifests", "deviceclasses.json")) as f:
        assert f.read() == capsys.readouterr().out


def test_device_classes_prints_one_class_per_configured_resource(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
                   '[[device]]\nresource = "example.com/tun"\npath = "/dev/net/tun"\n')
    assert cli.main(["device-classes", "--config", str(cfg)]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert [(c["metadata"]["name"], c["spec"]["extendedResourceName"]) for c in doc["items"]] == [
        ("kvm.ate.dev", "ate.dev/kvm"), ("tun.example.com", "example.com/tun")]
