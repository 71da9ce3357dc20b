"""Command line: `atedevd run | check | check-config`, and the exit codes systemd sees.

Exit codes: 0 ok, 1 runtime failure (another instance holds the lock, or a crash),
2 usage, 78 (EX_CONFIG) bad configuration, which the unit does not restart on.
"""

import argparse
import logging
import os
import sys
import traceback
from typing import List, Optional

from atedevd import config, instance, launch, restarts
from atedevd.systemd import setup_logging

EX_RUNTIME = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="atedevd",
        description="Grant host device nodes (e.g. /dev/kvm) to Kubernetes pods via the kubelet device plugin API.",
    )
    p.add_argument("--version", action=launch.VersionAction)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="serve the configured devices to kubelet (what systemd runs)")
    check = sub.add_parser("check", help="can this node serve every configured device? (a table and an exit status)")
    check_config = sub.add_parser("check-config", help="validate the configuration file and exit")
    for s in (run, check, check_config):
        s.add_argument("--config", metavar="FILE", help=f"configuration file (default {config.DEFAULT_CONFIG_PATH})")
    for s in (run, check):
        s.add_argument("--device-plugin-dir", metavar="DIR", help="kubelet's device plugin directory")
        s.add_argument("--dev-root", metavar="DIR", help="where the node's device nodes are looked up")
    run.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
    return p


def _load(args) -> config.Config:
    overrides = {
        "device_plugin_dir": getattr(args, "device_plugin_dir", None),
        "dev_root": getattr(args, "dev_root", None),
        "log_level": getattr(args, "log_level", None),
    }
    return config.load(args.config or config.DEFAULT_CONFIG_PATH, required=args.config is not None, overrides=overrides)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        from atedevd import check

        return check.check_config(args.config or config.DEFAULT_CONFIG_PATH, sys.stdout, required=args.config is not None, err=sys.stderr)
    try:
        cfg = _load(args)
    except config.ConfigError as e:
        if args.command == "run":  # to the journal, where `systemctl status` shows it
            setup_logging("info")
            logging.getLogger("atedevd").error("configuration error, not starting:\n%s", e)
        else:
            print(f"atedevd: configuration error:\n{e}", file=sys.stderr)
        return config.EX_CONFIG
    if args.command == "check":
        from atedevd import check

        return check.run(cfg, sys.stdout)
    return _run(args, cfg)


def _run(args, cfg: config.Config) -> int:
    setup_logging(cfg.log_level)
    from atedevd.daemon import Daemon  # imports grpc: only when serving

    try:
        instance.acquire(cfg.device_plugin_dir)
    except (instance.AlreadyRunning, OSError) as e:
        logging.getLogger("atedevd").error("not starting: %s", e)
        return EX_RUNTIME
    overrides = {k: v for k, v in (("device_plugin_dir", args.device_plugin_dir), ("dev_root", args.dev_root), ("log_level", args.log_level)) if v}
    code = EX_RUNTIME
    try:
        code = Daemon(cfg, args.config or config.DEFAULT_CONFIG_PATH, args.config is not None, overrides).run()
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
    """One ERROR line naming the exception; the traceback at DEBUG and as a journald field."""
    trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    reason = " ".join(str(e).split()) or "(no message)"
    log = logging.getLogger("atedevd")
    try:
        log.error("crashed, exiting with status %d: %s: %s", EX_RUNTIME, type(e).__name__, reason,
                  extra={"ATEDEVD_EVENT": "crashed", "ATEDEVD_TRACEBACK": trace})
        log.debug("crash traceback:\n%s", trace)
    except Exception:  # logging itself broken: stderr is still the journal under systemd
        print(f"atedevd: crashed: {type(e).__name__}: {reason}", file=sys.stderr)
