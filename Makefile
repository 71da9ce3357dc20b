# atedevd developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= /usr/bin/python3
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: deps demo check e2e-build e2e typecheck test test-latest bench bench-lifecycle bench-units bench-upgrade bench-boot bench-registration sim proto proto-check deb rpm deb-source rpm-source deb-bundled rpm-bundled clean

# Test files run in parallel by `make check` and `make test` (python3-pytest-xdist, one of
# `make deps`; without it they run one after the other).
JOBS ?= 2
XDIST = $$($(PYTHON) -c 'import xdist' 2>/dev/null && echo '-n $(JOBS) --dist loadfile')

# Debian 12's own packages: the runtime floor we test, and the tools the tests drive.
deps:
	@packaging/install-deps

demo: deps
	$(PYTHON) -m rig.demo

# The fast layer, for contributors: about a minute (its count and time are printed), no root, no container, no rootfs.
# By folder (tests/ mirrors the package: unit/ per module, then the layers): the unit tests, the daemon as a
# process against the kubelet stand-in, the simulation (SIM_ROUNDS rounds a cell), the tree's own checks.
# Left to `make test`: the runtimes/ and systemd/ layers (containers, packages, a real systemd) and whatever
# is marked `slow` (seconds or minutes of its own: the registration matrix, fault injection, fuzzing, the
# hostile user, user namespaces, the restart storm, the 10,000 refused Registers). pytest prints the count
# and the time taken last, and the slowest tests above them.
FAST_TESTS := tests/unit tests/process tests/simulation tests/meta tests/rig
check: typecheck
	SIM_ROUNDS=500 SIM_DRA_ROUNDS=100 $(PYTHON) -m pytest -q -p no:cacheprovider $(XDIST) --durations=10 -m "not slow" $(FAST_TESTS)

# The whole suite, JOBS test files at a time (pytest-xdist; one worker per file, so a
# module's container or kubelet is its own), the slowest first (tests/conftest.py), and
# beside it the core again on the newest grpcio/protobuf (LATEST_PYTEST: most of its minute is
# waiting, which the suite's CPU fills; its output follows the suite's). Then the boot alone:
# its margins are milliseconds, which another test's CPU and disk would take.
LATEST_PYTEST := .venv-latest/bin/python -m pytest -q -p no:cacheprovider tests/unit/api/test_service.py tests/process/test_daemon.py
test: deps typecheck
	packaging/latest-venv .venv-latest
	@log=$$(mktemp); $(LATEST_PYTEST) >$$log 2>&1 & latest=$$!; \
	echo "$(PYTHON) -m pytest ... tests  (and $(LATEST_PYTEST) beside it)"; \
	$(PYTHON) -m pytest -q -p no:cacheprovider $(XDIST) --durations=25 --ignore=tests/systemd/test_boot.py --ignore=tests/e2e tests; main=$$?; \
	wait $$latest; rc=$$?; echo "--- the core on the newest grpcio and protobuf, run beside the suite:"; cat $$log; rm -f $$log; \
	[ $$main -eq 0 ] && [ $$rc -eq 0 ]
	$(PYTHON) -m pytest -q -p no:cacheprovider -s tests/systemd/test_boot.py

# The real Kubernetes binaries the end-to-end suite runs (kubelet per minor in KUBE, the 1.37
# control plane every kubelet runs against, etcd, containerd 2 and ctr, runc, crictl), built from
# the Go module proxy into /var/cache/atedevd-e2e (ATEDEVD_E2E_CACHE) and reused there: ~22
# minutes cold, a second warm.
KUBE ?= 1.32 1.33 1.34 1.35 1.36 1.37
E2E_CONTROL_PLANE := 1.37
e2e-build:
	$(PYTHON) -m tests.e2e.build --kube $(KUBE) $(E2E_CONTROL_PLANE)

# The end-to-end suite (tests/e2e, root): for each kubelet minor in KUBE, one real cluster on this
# machine (tests/e2e/cluster.py) and atedevd from this checkout on its node; each test prints its
# figure, repeated by version at the end. Not part of `make test` (CI builds nothing from the network).
e2e: deps e2e-build
	@command -v openssl >/dev/null && command -v ip >/dev/null || { apt-get update -qq && apt-get install -y -qq openssl iproute2; }
	ATEDEVD_E2E_KUBE='$(KUBE)' $(PYTHON) -m pytest -q -p no:cacheprovider -s -rs --durations=0 tests/e2e

# mypy over the package for the oldest and the newest Python it claims (3.9, 3.13): a venv of
# pinned mypy from PyPI, made once (packaging/typecheck; settings in mypy.ini).
typecheck:
	packaging/typecheck .venv-typecheck

# The core suite again on the newest grpcio/protobuf from PyPI (the ceiling).
test-latest:
	packaging/latest-venv .venv-latest
	$(LATEST_PYTEST)

bench: deps
	$(PYTHON) -m bench

# The rejection window per lifecycle event and kubelet mode: ROUNDS rounds per row (default
# 100; QUICK=1: 10), EVENTS a subset (bench/lifecycle.py lists them); then, under a real
# systemd (root), a package upgrade (bench-upgrade) and the boot: kubelet's first batch of
# pods after a boot, 1 and 16 resources (20 boots per row; QUICK=1: 5); given EVENTS, only
# the lifecycle rows. The stand-in limits pod-resources as kubelet does; LIMIT=1 adds a node
# agent polling it 80 times a second beside atedevd.
bench-lifecycle: deps
	$(PYTHON) -m bench --only lifecycle $(if $(EVENTS),,--only upgrade --only boot) $(if $(QUICK),--quick) $(if $(filter command line environment,$(origin ROUNDS)),--rounds $(ROUNDS)) $(foreach e,$(EVENTS),--event $(e)) $(if $(LIMIT),--limit)

# Register -> all units healthy in kubelet against the configured count.
bench-units: deps
	$(PYTHON) -m bench --only units $(if $(QUICK),--quick) $(if $(filter command line environment,$(origin ROUNDS)),--rounds $(ROUNDS))

# The rejection window of a package upgrade (apt install of a newer .deb over the running,
# registered daemon) in a booted Debian 12 container, the kubelet stand-in outside the unit:
# ROUNDS upgrades per kubelet mode (default 10; QUICK=1: 3). Needs root.
bench-upgrade: deps
	$(PYTHON) -m bench --only upgrade $(if $(QUICK),--quick) $(if $(filter command line environment,$(origin ROUNDS)),--rounds $(ROUNDS))

# kubelet's first batch of pods after a real boot (a booted Debian 12 container, the stand-in as
# kubelet.service), won or lost: ROUNDS boots per kubelet model and row (default 20; QUICK=1: 5). Root.
bench-boot: deps
	$(PYTHON) -m bench --only boot $(if $(QUICK),--quick) $(if $(filter command line environment,$(origin ROUNDS)),--rounds $(ROUNDS))

# The registration scenario matrix, ROUNDS rounds per scenario and kubelet mode (CI runs 3).
ROUNDS ?= 1000
bench-registration: deps
	ROUNDS=$(ROUNDS) $(PYTHON) -m pytest -q -p no:cacheprovider tests/process/test_registration.py

# The registration simulation: SIM_ROUNDS seeded rounds per scenario and kubelet generation (`make test`
# and CI run 2000), DRA mode's SIM_DRA_ROUNDS per scenario and mode (CI: 300), then the registration's
# with less to see kubelet by (pod-resources only; nothing but a fixed wait): what each fallback costs.
# A failure prints its seed; --replay SEED prints that round.
SIM_ROUNDS ?= 10000
SIM_DRA_ROUNDS ?= 2000
sim:
	$(PYTHON) -m tests.simulation --rounds $(SIM_ROUNDS)
	$(PYTHON) -m tests.simulation --api dra --rounds $(SIM_DRA_ROUNDS)
	-$(PYTHON) -m tests.simulation --rounds 1000 --blind
	-$(PYTHON) -m tests.simulation --rounds 1000 --blind --no-pod-resources

# Regenerate the v1beta1, pod-resources v1, DRA v1/v1beta1, DRA health v1/v1alpha1 and plugin registration bindings with protoc 3.21 (Debian's protobuf-compiler or grpcio-tools==1.51.3).
PROTOS := deviceplugin.proto podresources.proto dra_v1.proto dra_v1beta1.proto pluginregistration.proto dra_health_v1.proto dra_health_v1alpha1.proto
proto:
	cd atedevd/api && protoc --python_out=. $(PROTOS)

deb:
	DEB_REVISION='$(DEB_REVISION)' packaging/build-deb

rpm:
	packaging/build-rpm

# Source packages: the .dsc (+ generated .orig.tar.gz) and the .src.rpm (rpmbuild -ts).
deb-source:
	DEB_SOURCE=1 DEB_REVISION='$(DEB_REVISION)' packaging/build-deb

rpm-source:
	RPM_SOURCE=1 packaging/build-rpm

# Self-contained packages (pinned PyPI wheels, packaging/bundled/requirements.lock) for nodes
# whose distribution lacks grpcio/protobuf. PYTHON_VERSION: the node's python3 (3.9 ... 3.13).
PYTHON_VERSION ?= 3.11
deb-bundled:
	PYTHON_VERSION='$(PYTHON_VERSION)' DEB_REVISION='$(DEB_REVISION)' packaging/build-bundled deb

rpm-bundled:
	PYTHON_VERSION='$(PYTHON_VERSION)' packaging/build-bundled rpm

clean:
	rm -rf build dist .venv-latest *.egg-info .pytest_cache
