"""Build the real Kubernetes binaries the end-to-end suite runs, into a cache outside the checkout.

    python3 -m tests.e2e.build [--kube 1.37 ...] [--list]

Each program is built by `go build` from a small wrapper Go module written to a temporary
directory at build time (some upstream modules refuse `go install`, and nothing may be written
into the checkout), using the default Go module and build caches. The result goes to
$ATEDEVD_E2E_CACHE (default /var/cache/atedevd-e2e), one directory per component and version:

    kubernetes/v1.37.2/{kubelet,kube-apiserver,...}   etcd/v3.6.17/etcd   ...   manifest.json

A binary that is present and recorded complete in its version's manifest.json is never rebuilt,
so a second run only asks the Go module proxy which patch is newest. The suite finds its
programs with binary() and kubelet_versions(), which read the cache alone.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = "/var/cache/atedevd-e2e"
KUBE_MINORS = ["1.32", "1.33", "1.34", "1.35", "1.36", "1.37"]
CONTROL_PLANE = ["kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl"]


@dataclass(frozen=True)
class Program:
    """One binary: its package in the upstream module and how it is built."""
    name: str
    package: str
    cgo: bool = False
    tags: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Component:
    """An upstream Go module, its release series and the programs built from it.

    series is the version prefix whose newest release is built; known is used when the proxy
    does not answer the version list (the newest seen on it when this file was written)."""
    name: str
    module: str
    series: str
    known: str
    programs: Tuple[Program, ...]
    ldflags: Callable[[str], List[str]] = lambda version: []
    main_go: str = ""  # a wrapper main package, for a module that has no usable cmd/ package
    staging: bool = False  # k8s.io/kubernetes: its v0.0.0 staging requirements are pinned


def _kube_ldflags(version: str) -> List[str]:
    """What Kubernetes' hack/lib/version.sh stamps, so --version and the node's reported
    kubelet version are the release's rather than v0.0.0-master."""
    major, minor = version[1:].split(".")[:2]
    stamp = {"gitVersion": version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean",
             "buildDate": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    return [f"-X {pkg}.{k}={v}" for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
            for k, v in stamp.items()]


KUBERNETES = Component(
    "kubernetes", "k8s.io/kubernetes", "1.37", "v1.37.2",
    tuple(Program(n, f"k8s.io/kubernetes/cmd/{n}") for n in ["kubelet"] + CONTROL_PLANE),
    _kube_ldflags, staging=True)
ETCD = Component(
    "etcd", "go.etcd.io/etcd/server/v3", "3.6", "v3.6.17", (Program("etcd", "."),),
    main_go='package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
            'func main() { etcdmain.Main(os.Args) }\n')
CONTAINERD = Component(
    "containerd", "github.com/containerd/containerd/v2", "2", "v2.4.2",
    tuple(Program(n, f"github.com/containerd/containerd/v2/cmd/{n}", tags=("no_btrfs",))
          for n in ("containerd", "containerd-shim-runc-v2", "ctr")),
    lambda v: [f"-X github.com/containerd/containerd/v2/version.Version={v}"])
# runc needs cgo (nsenter, libseccomp-dev). Its Makefile's libpathrs tag would link a Rust
# library Debian 12 does not have; without it runc uses its Go pathrs-lite.
RUNC = Component(
    "runc", "github.com/opencontainers/runc", "1", "v1.5.3",
    (Program("runc", "github.com/opencontainers/runc", cgo=True, tags=("seccomp", "urfave_cli_no_docs")),))
CRI_TOOLS = Component(
    "cri-tools", "sigs.k8s.io/cri-tools", "1.37", "v1.37.0",
    (Program("crictl", "sigs.k8s.io/cri-tools/cmd/crictl"),),
    lambda v: [f"-X sigs.k8s.io/cri-tools/pkg/version.Version={v}"])
COMPONENTS = (KUBERNETES, ETCD, CONTAINERD, RUNC, CRI_TOOLS)
KNOWN_KUBE = {"1.32": "v1.32.13", "1.33": "v1.33.13", "1.34": "v1.34.4",
              "1.35": "v1.35.4", "1.36": "v1.36.3", "1.37": "v1.37.2"}


# ---- the cache, read by the suite ------------------------------------------------------------

def cache_root() -> Path:
    """Where the binaries live: $ATEDEVD_E2E_CACHE, else /var/cache/atedevd-e2e."""
    return Path(os.environ.get("ATEDEVD_E2E_CACHE") or DEFAULT_CACHE)


def _vkey(version: str) -> Tuple[int, ...]:
    """v1.37.2 -> (1, 37, 2), for sorting; anything else sorts first."""
    return tuple(int(p) if p.isdigit() else -1 for p in version.lstrip("v").split("-")[0].split("."))


def _load(vdir: Path) -> dict:
    try:
        return json.loads((vdir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _complete(vdir: Path, name: str) -> bool:
    """Recorded in the manifest, and the file is the one recorded (not lost or truncated)."""
    entry = _load(vdir).get("binaries", {}).get(name)
    path = vdir / name
    return bool(entry) and path.is_file() and path.stat().st_size == entry.get("bytes")


def _owner(name: str) -> Component:
    for c in COMPONENTS:
        if any(p.name == name for p in c.programs):
            return c
    raise KeyError(f"no component builds {name!r}")


def _cached_versions(component: Component, name: str) -> List[str]:
    base = cache_root() / component.name
    found = [d.name for d in base.iterdir() if _complete(d, name)] if base.is_dir() else []
    return sorted(found, key=_vkey)


def binary(name: str, version: Optional[str] = None) -> Path:
    """The cached program `name` (e.g. "kubelet", "etcd"): of `version`, exact ("v1.36.3") or a
    series ("1.36", newest patch cached), else the newest cached. FileNotFoundError says how
    to build it."""
    want = (version or "").lstrip("v")
    have = [v for v in _cached_versions(_owner(name), name)
            if not want or v.lstrip("v") == want or v.lstrip("v").startswith(want + ".")]
    if not have:
        raise FileNotFoundError(f"{name} {version or ''} is not built in {cache_root()}: "
                                f"run `make e2e-build` (python3 -m tests.e2e.build)")
    return cache_root() / _owner(name).name / have[-1] / name


def kubelet_versions() -> List[str]:
    """The kubelet versions cached, oldest first, e.g. ["v1.32.13", ..., "v1.37.2"]."""
    return _cached_versions(KUBERNETES, "kubelet")


def manifests() -> List[dict]:
    """Every version directory's manifest, for --list and for a suite that reports versions."""
    root = cache_root()
    return [m for c in COMPONENTS if (root / c.name).is_dir()
            for d in sorted((root / c.name).iterdir(), key=lambda d: _vkey(d.name)) if (m := _load(d))]


# ---- building -----------------------------------------------------------------------------------

def _nice() -> List[str]:
    """Builds yield the 2 cores to whatever else runs (the other tests on the machine)."""
    return ["nice", "-n", "19"] + (["ionice", "-c3"] if shutil.which("ionice") else [])


def _go(args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> str:
    """Run go niced in cwd and return its output; a failure raises with the end of go's words."""
    full = {**os.environ, "GOWORK": "off", "GOFLAGS": "-buildvcs=false", **(env or {})}
    run = subprocess.run(_nice() + ["go"] + args, cwd=cwd, env=full, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"go {' '.join(args)}: exit {run.returncode}\n{run.stderr[-3000:]}")
    return run.stdout


def _inside_checkout(path: Path) -> bool:
    path = path.resolve()
    return path == CHECKOUT or CHECKOUT in path.parents


def _guard(work: Path) -> None:
    """Nothing built, downloaded or cached may land in the repository."""
    env = json.loads(_go(["env", "-json", "GOMODCACHE", "GOCACHE"], work))
    for what, path in [("cache", cache_root()), ("TMPDIR", work), *env.items()]:
        if _inside_checkout(Path(path)):
            sys.exit(f"refusing: {what} {path} is inside the checkout {CHECKOUT}")


@functools.lru_cache(maxsize=None)
def _listed(module: str, work: Path) -> Tuple[str, ...]:
    """The releases of module on the proxy (asked once a run), or () if it does not answer."""
    try:
        answer = json.loads(_go(["list", "-m", "-versions", "-json", module], work))
        return tuple(answer.get("Versions") or ())
    except (RuntimeError, ValueError) as e:
        print(f"{module}: the proxy did not list its versions: {str(e).strip()[-300:]}", flush=True)
        return ()


def newest(component: Component, series: str, work: Path) -> str:
    """The newest release of series (e.g. "1.36") on the proxy; if it does not answer, the
    newest already cached, else the version known when this file was written."""
    def of_series(versions):
        return [v for v in versions if "-" not in v and (v[1:] == series or v[1:].startswith(series + "."))]
    listed = _listed(component.module, work)
    if of_series(listed):
        return max(of_series(listed), key=_vkey)
    base = cache_root() / component.name
    cached = of_series(d.name for d in base.iterdir()) if base.is_dir() and not listed else []
    known = KNOWN_KUBE.get(series) if component is KUBERNETES else component.known
    if cached:
        return max(cached, key=_vkey)
    if known and not listed:
        return known
    raise SystemExit(f"{component.module}: no release of {series} "
                     f"(the proxy lists: {' '.join(listed) or 'nothing'})")


def _wrapper(component: Component, version: str, work: Path) -> dict:
    """Write the wrapper module: it requires the upstream release and repeats what the release's
    own go.mod decides for its main module (non-local replaces, excludes, and for Kubernetes
    its staging modules, required there at v0.0.0, pinned to v0.Y.Z). Returns what it pinned."""
    gomod = json.loads(_go(["list", "-m", "-json", f"{component.module}@{version}"], work))["GoMod"]
    up = json.loads(_go(["mod", "edit", "-json", gomod], work))
    replace = {r["Old"]["Path"]: f'{r["New"]["Path"]} {r["New"]["Version"]}'
               for r in up.get("Replace") or [] if r["New"].get("Version") and not r["Old"].get("Version")}
    if component.staging:
        staged = "v0." + version.split(".", 1)[1]
        replace.update({r["Path"]: f'{r["Path"]} {staged}' for r in up["Require"]
                        if r["Version"] == "v0.0.0" and r["Path"].startswith("k8s.io/")})
    lines = [f"module atedevd-e2e/{component.name}", "", f"go {up.get('Go') or '1.21'}", "",
             f"require {component.module} {version}", ""]
    lines += [f"exclude {e['Path']} {e['Version']}" for e in up.get("Exclude") or []]
    lines += [f"replace {old} => {new}" for old, new in sorted(replace.items())]
    (work / "go.mod").write_text("\n".join(lines) + "\n")
    if component.main_go:
        (work / "main.go").write_text(component.main_go)
    return {"require": f"{component.module} {version}", "replace": replace}


def _seccomp() -> None:
    """runc links libseccomp through cgo and pkg-config: install Debian's packages if missing."""
    if shutil.which("pkg-config") and subprocess.run(["pkg-config", "--exists", "libseccomp"]).returncode == 0:
        return
    install = ["apt-get", "install", "-y", "-q", "libseccomp-dev", "pkg-config"]
    print(f"runc needs libseccomp-dev: {' '.join(install)}", flush=True)
    for cmd in (install, ["apt-get", "update", "-q"], install):
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode == 0 and cmd[1] == "install":
            return


def _save(vdir: Path, manifest: dict) -> None:
    tmp = vdir / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, vdir / "manifest.json")


@dataclass
class Result:
    built: List[str] = field(default_factory=list)
    reused: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)


def build(component: Component, version: str, names: List[str], result: Result) -> None:
    """Build the named programs of component@version that the cache does not hold complete."""
    vdir = cache_root() / component.name / version
    todo = [p for p in component.programs if p.name in names]
    for p in todo:
        if _complete(vdir, p.name):
            print(f"{p.name} {version}: reused", flush=True)
            result.reused.append(f"{p.name} {version}")
    todo = [p for p in todo if not _complete(vdir, p.name)]
    if not todo:
        return
    vdir.mkdir(parents=True, exist_ok=True)
    if any(p.cgo for p in todo):
        _seccomp()
    with tempfile.TemporaryDirectory(prefix=f"atedevd-e2e-{component.name}-") as tmp:
        work = Path(tmp)
        try:
            pinned = _wrapper(component, version, work)
        except RuntimeError as e:
            print(f"{component.name} {version}: FAILED preparing the wrapper module\n{e}", flush=True)
            result.failed += [f"{p.name} {version}" for p in todo]
            return
        go_version = _go(["env", "GOVERSION"], work).strip()
        for p in todo:
            print(f"{p.name} {version}: building", flush=True)
            start, out = time.monotonic(), vdir / f".{p.name}.partial"
            ldflags = " ".join(["-s", "-w"] + component.ldflags(version))
            args = ["build", "-trimpath", "-o", str(out), "-ldflags", ldflags]
            args += ["-tags", ",".join(p.tags)] if p.tags else []
            # -mod=mod: go fills the wrapper's go.mod and go.sum from the release's requirements.
            env = {"CGO_ENABLED": "1" if p.cgo else "0", "GOFLAGS": "-mod=mod -buildvcs=false"}
            try:
                _go(args + [p.package], work, env)
            except RuntimeError as e:
                print(f"{p.name} {version}: FAILED after {time.monotonic() - start:.0f} s\n{e}", flush=True)
                result.failed.append(f"{p.name} {version}")
                out.unlink(missing_ok=True)
                continue
            os.replace(out, vdir / p.name)
            seconds = round(time.monotonic() - start, 1)
            manifest = _load(vdir) or {"component": component.name, "module": component.module, "version": version}
            manifest.update(pinned, go=go_version)
            manifest.setdefault("binaries", {})[p.name] = {
                "package": p.package, "cgo": p.cgo, "tags": list(p.tags), "seconds": seconds,
                "bytes": (vdir / p.name).stat().st_size,
                "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            _save(vdir, manifest)
            print(f"{p.name} {version}: built in {seconds:.0f} s", flush=True)
            result.built.append(f"{p.name} {version}")


def plan(minors: List[str], work: Path) -> List[Tuple[Component, str, List[str]]]:
    """What to build, most wanted first: the newest selected Kubernetes (kubelet and the control
    plane), etcd, containerd and its shim, runc, crictl; then the older kubelets, newest first."""
    minors = sorted(set(minors), key=_vkey, reverse=True)
    steps = [(KUBERNETES, newest(KUBERNETES, minors[0], work), ["kubelet"] + CONTROL_PLANE)]
    steps += [(c, newest(c, c.series, work), [p.name for p in c.programs]) for c in COMPONENTS[1:]]
    return steps + [(KUBERNETES, newest(KUBERNETES, m, work), ["kubelet"]) for m in minors[1:]]


def list_cache() -> None:
    """Print what the cache holds, one line per binary."""
    print(f"cache {cache_root()}")
    for m in manifests():
        for name, b in sorted(m.get("binaries", {}).items()):
            ok = "" if _complete(cache_root() / m["component"] / m["version"], name) else "  (INCOMPLETE)"
            print(f"  {m['component']:<11} {m['version']:<9} {name:<24} {b['bytes'] / 2**20:6.1f} MiB  "
                  f"built {b['built_at']} in {b['seconds']:.0f} s with {m.get('go', '?')}{ok}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.e2e.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kube", nargs="+", metavar="MINOR", default=KUBE_MINORS,
                    help="Kubernetes minors whose kubelet is built (newest patch of each); the control plane "
                         "is the newest of them (default: %(default)s)")
    ap.add_argument("--list", action="store_true", help="print what the cache holds, build nothing")
    args = ap.parse_args(argv)
    if args.list:
        list_cache()
        return 0
    minors = [m for arg in args.kube for m in arg.replace(",", " ").split()]
    with tempfile.TemporaryDirectory(prefix="atedevd-e2e-") as tmp:
        _guard(Path(tmp))
        cache_root().mkdir(parents=True, exist_ok=True)
        lock = open(cache_root() / ".lock", "w")  # held until we exit
        try:  # one builder at a time writes the cache
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for the other builder holding {lock.name}", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        start, result = time.monotonic(), Result()
        for component, version, names in plan(minors, Path(tmp)):
            build(component, version, names, result)
    print(f"{len(result.built)} built, {len(result.reused)} reused, {len(result.failed)} failed "
          f"in {time.monotonic() - start:.0f} s; cache {cache_root()}", flush=True)
    if result.failed:
        print("failed: " + ", ".join(result.failed), file=sys.stderr)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
