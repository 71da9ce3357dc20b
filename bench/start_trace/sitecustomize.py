"""Loaded by Python at start when this directory is first on PYTHONPATH (bench/start_timing.py
--trace): prints `TRACE <ms> <step>` to stderr as the start path reaches each step, in
milliseconds since START_TRACE_T0 (CLOCK_MONOTONIC seconds, taken before the fork).

Modules are patched as they are imported (a meta path hook), so the import order and
cost of the daemon stay its own."""

import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import time

T0 = float(os.environ.get("START_TRACE_T0", "0"))


def say(what: str) -> None:
    sys.stderr.write(f"TRACE {(time.monotonic() - T0) * 1000:8.2f} {what}\n")


say("python up (site)")

# module -> [(attribute path, label)]: a step begins when the function is entered
STEPS = {
    "atedevd.launch": [("main", "launch.main"), ("problem", "launch.problem")],
    "atedevd.cli": [("main", "cli.main"), ("_load", "cli._load (config)"), ("_run", "cli._run")],
    "atedevd.daemon.instance": [("acquire", "instance.acquire")],
    "atedevd.daemon.loop": [("Daemon.__init__", "Daemon.__init__"), ("Daemon.run", "Daemon.run"),
                       ("Daemon._loop", "Daemon._loop")],
    "atedevd.glue.process": [("Process.start", "Process.start (the first pass)")],
    "atedevd.glue.plugin_dir": [("PluginDir.on_directory_events", "PluginDir.on_directory_events")],
    "atedevd.kubelet.sockets": [("remove_leftovers", "remove_leftovers")],
    "atedevd.daemon.watch": [("Watcher.__init__", "Watcher()"), ("Watcher.want", "Watcher.want")],
    "atedevd.kubelet.plugin": [("Workers.__init__", "Workers()"), ("PluginServer.start", "PluginServer.start")],
    "atedevd.daemon.host": [("Host.server", "bind"), ("Host.ask_allocatable", "ask pod-resources"),
                            ("Host.register", "register (Register sent)")],
    "atedevd.devices.snapshot": [("Snapshot._made", "Snapshot: device list made")],
    "atedevd.devices.shared": [("NodeWatch.look", "NodeWatch.look")],
    "atedevd.daemon.textfile": [("TextfileWriter.__init__", "TextfileWriter()")],
    "atedevd.glue.metrics": [("DaemonInfo.current", "DaemonInfo.current")],
    "atedevd.kubelet.calls": [("KubeletView.refresh", "KubeletView.refresh"),
                              ("AllocatableCall._answer", "pod-resources answered")],
    "atedevd.systemd": [("setup_logging", "setup_logging"), ("Notifier.ready", "Notifier.ready"), ("event", "event")],
}
IMPORTS = {"grpc", "google.protobuf", "atedevd.cli", "atedevd.daemon.loop", "atedevd.config", "atedevd.config_file.load", "atedevd.api",
           "atedevd.registration", "atedevd.glue.process", "atedevd.glue.plugin_dir", "atedevd.glue.resource", "atedevd.glue.performer", "atedevd.daemon.host", "atedevd.kubelet.plugin", "atedevd.kubelet.calls", "atedevd.daemon.watch", "atedevd.systemd",
           "systemd.journal", "inotify.constants", "sdnotify", "tomllib",
           "atedevd.devices.policy", "atedevd.kubelet.sockets", "atedevd.devices.judgement", "atedevd.devices.snapshot", "atedevd.devices.shared", "atedevd.glue.metrics", "atedevd.daemon.textfile", "atedevd.daemon.instance",
           "dataclasses", "datetime", "tempfile", "ctypes", "argparse", "concurrent.futures"}
_seen = set()


def _wrap(fn, label):
    def traced(*a, **kw):
        say(f"> {label}")
        try:
            return fn(*a, **kw)
        finally:
            say(f"< {label}")
    return traced


def _patch(module) -> None:
    for path, label in STEPS.get(module.__name__, ()):
        owner = module
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        traced = _wrap(getattr(owner, attr), label)
        if isinstance(inspect.getattr_static(owner, attr), staticmethod):
            traced = staticmethod(traced)
        setattr(owner, attr, traced)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        traced = self.name in IMPORTS
        if traced:
            say(f"> import {self.name}")
        self.inner.exec_module(module)
        if traced:
            say(f"< import {self.name}")
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if (name not in STEPS and name not in IMPORTS) or name in _seen:
            return None
        _seen.add(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, name)
        return spec


sys.meta_path.insert(0, _Finder())
