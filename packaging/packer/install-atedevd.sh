#!/bin/sh
# Packer shell provisioner: install atedevd into a node image being baked.
#
#   ATEDEVD_PACKAGE=/tmp/atedevd_0.1.0-1_all.deb install-atedevd.sh   (as root)
#
# Installs the package with the image's own package manager (apt on Debian/Ubuntu,
# dnf or yum on Fedora/EL), so that its dependencies come from the distribution;
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

if command -v apt-get >/dev/null 2>&1; then
    case $pkg in *.deb) ;; *) die "$pkg: this image uses apt, it needs the .deb" ;; esac
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "$pkg"
elif command -v dnf >/dev/null 2>&1; then
    case $pkg in *.rpm) ;; *) die "$pkg: this image uses dnf, it needs the .rpm" ;; esac
    dnf install -y "$pkg"
elif command -v yum >/dev/null 2>&1; then
    case $pkg in *.rpm) ;; *) die "$pkg: this image uses yum, it needs the .rpm" ;; esac
    yum install -y "$pkg"
else
    die "no apt-get, dnf or yum on this image"
fi

# The .deb enables the unit itself; on Fedora/EL the preset policy usually leaves it off.
systemctl enable atedevd.service
atedevd check-config
echo "install-atedevd: atedevd installed, enabled, configuration valid"
