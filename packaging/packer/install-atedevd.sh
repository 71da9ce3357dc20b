#!/bin/sh
# Packer shell provisioner: install atedevd into a node image being baked.
#
#   ATEDEVD_PACKAGE=/tmp/atedevd_0.1.0-1_all.deb install-atedevd.sh   (as root)
#
# Installs the package with the image's own package manager (apt on Debian/Ubuntu,
# dnf or yum on Fedora/EL/Amazon Linux), so that its dependencies come from the distribution;
# either flavour: atedevd (distribution's grpcio/protobuf) or atedevd-bundled (self-contained);
# enables atedevd.service for the next boot; and validates /etc/atedevd/config.toml.
set -eu

die() {
    echo "install-atedevd: $*" >&2
    exit 1
}

pkg=${ATEDEVD_PACKAGE:-}
[ -n "$pkg" ] || die "set ATEDEVD_PACKAGE to the uploaded .deb or .rpm"
[ -f "$pkg" ] || die "$pkg: no such file"
case $pkg in
    /*) ;;
    *) pkg=$(pwd)/$pkg ;; # apt treats a bare name as a package name, not a file
esac

# A distribution-dependency package (atedevd) whose dependencies the image cannot meet fails
# the bake here, naming the self-contained package (atedevd-bundled) that needs only python3.
selfcontained() {
    py=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "X.Y")
    echo "build the self-contained package for this image's Python $py instead:" \
        "make $1-bundled PYTHON_VERSION=$py (atedevd-bundled)"
}

case $(basename "$pkg") in
    atedevd-bundled*) flavour=self-contained ;;
    *) flavour=distribution ;;
esac

if command -v apt-get >/dev/null 2>&1; then
    case $pkg in *.deb) ;; *) die "$pkg: this image uses apt, it needs the .deb" ;; esac
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    if ! apt-get install -y --no-install-recommends "$pkg"; then
        [ "$flavour" = distribution ] &&
            die "$pkg: apt cannot install its dependencies (this distribution's python3-grpcio/-protobuf are missing or too old); $(selfcontained deb)"
        die "$pkg: apt-get install failed (a self-contained package needs the python3 it was built for)"
    fi
elif command -v dnf >/dev/null 2>&1 || command -v yum >/dev/null 2>&1; then
    case $pkg in *.rpm) ;; *) die "$pkg: this image uses dnf/yum, it needs the .rpm" ;; esac
    dnf=dnf
    command -v dnf >/dev/null 2>&1 || dnf=yum
    if ! $dnf install -y "$pkg"; then
        [ "$flavour" = distribution ] &&
            die "$pkg: $dnf cannot install its dependencies (no python3dist(grpcio)/(protobuf) here, e.g. Amazon Linux 2023 or EL without EPEL); $(selfcontained rpm)"
        die "$pkg: $dnf install failed (a self-contained package needs the python3 it was built for)"
    fi
else
    die "no apt-get, dnf or yum on this image"
fi

# The .deb enables the unit itself; on Fedora/EL the preset policy usually leaves it off.
systemctl enable atedevd.service
atedevd check-config
echo "install-atedevd: atedevd installed, enabled, configuration valid"
