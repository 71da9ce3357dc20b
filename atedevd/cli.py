"""Command line: `atedevd run | check | check-config`, and the exit codes systemd sees.

Exit codes: 0 ok, 1 runtime failure (another instance holds the lock, or a crash),
2 usage, 78 (EX_CONFIG) bad configuration, which the unit does not restart on.
"""

import logging
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Dict, List, Optional

from atedevd import config, version
from atedevd.config_file import load as loader
from atedevd.daemon import instance, restarts
from atedevd.systemd import journal_is_stderr, setup_logging
from atedevd.upgrade import peers as upgrade

EX_RUNTIME = 1


# What `run` takes, each option with one value (_run_args reads exactly these).
RUN_OPTIONS = ("--config", "--device-plugin-dir", "--dev-root", "--sys-root", "--log-level", "--metrics-dir")


def _parser():
    import argparse  # not on the path of `run` as the unit starts it (_run_args)

    p = argparse.ArgumentParser(
        prog="atedevd",
        description="Grant host device nodes (e.g. /dev/kvm) to Kubernetes pods via the kubelet device plugin API.",
    )
    p.add_argument("--version", action=version.version_action())
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="serve the configured devices to kubelet (what systemd runs)")
    check = sub.add_parser("check", help="can this node serve every configured device? (a table and an exit status)")
    check_config = sub.add_parser("check-config", help="validate the configuration file and exit")
    classes = sub.add_parser("device-classes", help="print the DRA DeviceClass of each configured resource "
                                                    "(JSON, for kubectl apply -f -; docs/dra.md)")
    for s in (run, check, check_config, classes):
        s.add_argument("--config", metavar="FILE", help=f"configuration file (default {config.DEFAULT_CONFIG_PATH})")
    for s in (run, check):
        s.add_argument("--device-plugin-dir", metavar="DIR", help="kubelet's device plugin directory")
        s.add_argument("--dev-root", metavar="DIR", help="where the node's device nodes are looked up")
        s.add_argument("--sys-root", metavar="DIR", help="where the kernel's sysfs is read (the device policy, NUMA nodes)")
    check.add_argument("--json", action="store_true", help="the findings as a JSON document (schema atedevd-check/v1)")
    run.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
    run.add_argument("--metrics-dir", metavar="DIR",
                     help="node_exporter's textfile directory for atedevd.prom (default /var/lib/prometheus/node-exporter "
                          "when it exists; an empty value turns metrics off)")
    return p


def _run_args(argv: List[str]) -> Optional[SimpleNamespace]:
    """`run` followed by RUN_OPTIONS, each given once as `--opt VALUE` or `--opt=VALUE`:
    what the unit and the tests start. Read here because argparse costs about 4 ms of
    every start (its import, the shutil it pulls in, building the parser), 5 % of the
    time to the first Register. Anything else, help, an abbreviation, a repeated or
    unknown option, a value that looks like an option, is None: argparse's to parse,
    so its messages and exit status 2 are the only ones (tests/unit/test_cli.py holds
    both parsers to the same answers)."""
    if argv[:1] != ["run"]:
        return None
    values: Dict[str, Optional[str]] = {name[2:].replace("-", "_"): None for name in RUN_OPTIONS}
    rest = argv[1:]
    while rest:
        option, *given = rest[0].split("=", 1)
        if given:
            value, rest = given[0], rest[1:]
        elif len(rest) > 1 and not rest[1].startswith("-"):
            value, rest = rest[1], rest[2:]
        else:
            return None
        dest = option[2:].replace("-", "_")
        if option not in RUN_OPTIONS or values[dest] is not None:
            return None
        values[dest] = value
    return SimpleNamespace(command="run", **values)


def _load(args) -> config.Config:
    overrides: Dict[str, Optional[str]] = {
        "device_plugin_dir": getattr(args, "device_plugin_dir", None),
        "dev_root": getattr(args, "dev_root", None),
        "sys_root": getattr(args, "sys_root", None),
        "log_level": getattr(args, "log_level", None),
        "metrics_dir": getattr(args, "metrics_dir", None),
    }
    return loader.load(args.config or config.DEFAULT_CONFIG_PATH, required=args.config is not None, overrides=overrides)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _run_args(argv) or _parser().parse_args(argv)
    if args.command == "check-config":
        from atedevd.check import report as check

        return check.check_config(args.config or config.DEFAULT_CONFIG_PATH, sys.stdout, required=args.config is not None, err=sys.stderr)
    try:
        cfg = _load(args)
    except loader.ConfigError as e:
        if args.command == "run":  # to the journal, where `systemctl status` shows it
            setup_logging("info")
            logging.getLogger("atedevd").error("configuration error, not starting:\n%s", e)
        else:
            if getattr(args, "json", False):
                from atedevd.check import report as check

                sys.stdout.write(check.config_error_json(e))
            print(f"atedevd: configuration error:\n{e}", file=sys.stderr)
        return config.EX_CONFIG
    if args.command == "check":
        from atedevd.check import report as check

        return check.run(cfg, sys.stdout, as_json=args.json)
    if args.command == "device-classes":
        import json

        from atedevd.dra.slices import device_class

        items = [device_class(r) for r in dict.fromkeys(d.resource for d in cfg.devices)]
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
        return 0
    return _run(args, cfg)


def _run(args, cfg: config.Config) -> int:
    parent = None
    try:
        if upgrade.Parent.asked(os.environ):  # started by the daemon we take over from: its lock is ours too
            parent = upgrade.Parent(os.environ)
            parent.detach()  # before gRPC's threads: systemd's child from here on
            lock_fd = parent.lock_fd
        else:
            lock_fd = instance.acquire(cfg.device_plugin_dir)
    except (instance.AlreadyRunning, OSError, ValueError) as e:
        setup_logging(cfg.log_level)
        logging.getLogger("atedevd").error("not starting: %s", e)
        return EX_RUNTIME
    setup_logging(cfg.log_level)
    from atedevd.daemon.loop import Daemon  # imports grpc: only when serving

    overrides: Dict[str, Optional[str]] = {k: v for k, v in (("device_plugin_dir", args.device_plugin_dir), ("dev_root", args.dev_root),
                                   ("sys_root", args.sys_root), ("log_level", args.log_level),
                                   ("metrics_dir", args.metrics_dir)) if v is not None}
    code = EX_RUNTIME
    if cfg.api == "dra" and parent is not None and parent.inherited != frozenset(("dra",)):
        # the daemon that started us serves the device plugin API
        logging.getLogger("atedevd").error('not taking over: [daemon] api = "dra" takes a restart, not an upgrade '
                                           '(docs/dra.md); the running atedevd keeps serving')
        logging.shutdown()
        os._exit(EX_RUNTIME)
    if cfg.api == "dra":  # (DRA mode: docs/dra.md)
        try:
            from atedevd.dra import node as dra_node

            code = dra_node.run(cfg, lock_fd, parent)
            restarts.ended_cleanly()
        except BaseException as e:
            _log_crash(e)
        finally:
            logging.shutdown()
            os._exit(code)
    try:
        code = Daemon(cfg, args.config or config.DEFAULT_CONFIG_PATH, args.config is not None, overrides,
                      lock_fd, parent).run()
        restarts.ended_cleanly()  # stopped, or exiting on purpose: no crash-loop delay next time
    except BaseException as e:  # a bug: say so in one line and exit, whatever it was
        _log_crash(e)
    finally:
        # Exit now, crash or not. Interpreter shutdown would join gRPC worker
        # threads, one of which may be stuck sending to a client that stopped
        # reading (or, after a crash, serving a stream nobody will end).
        logging.shutdown()
        os._exit(code)


def _log_crash(e: BaseException) -> None:
    """One ERROR line naming the exception (the traceback as a journald field), and the
    traceback itself on stderr whatever the log level: under systemd stderr is the
    journal too, so `journalctl -u atedevd` and a terminal both show where it broke."""
    trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    reason = " ".join(str(e).split()) or "(no message)"
    log = logging.getLogger("atedevd")
    try:
        log.error("crashed, exiting with status %d: %s: %s", EX_RUNTIME, type(e).__name__, reason,
                  extra={"ATEDEVD_EVENT": "crashed", "ATEDEVD_TRACEBACK": trace})
    except Exception:  # logging itself broken: stderr is still the journal under systemd
        _stderr(f"atedevd: crashed: {type(e).__name__}: {reason}\n")
    if journal_is_stderr():  # journald reads a <3> prefix as the line's priority: err, like the line above
        trace = "".join(f"<3>{line}\n" for line in trace.splitlines())
    _stderr(trace)


def _stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # nowhere left to say it
        pass
