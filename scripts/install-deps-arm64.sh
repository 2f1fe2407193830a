#!/bin/sh
# install-deps-arm64.sh — what `make test-arm64` needs on a Debian 12 x86
# machine: the arm64 architecture in dpkg (multiarch), Debian's AArch64 cross
# compiler, qemu-user, and the arm64 builds of the libraries deltafin links.
# Idempotent and quiet when nothing is missing; needs root (or sudo) only
# when something is. g++-aarch64-linux-gnu is only for `make cuda-objs` with
# the cross compiler (nvcc's host compiler).
set -e
PKGS="gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user libc6:arm64 libc6-dev:arm64"
PKGS="$PKGS libjansson-dev:arm64 liburing-dev:arm64 libpcre2-dev:arm64 libcurl4-openssl-dev:arm64"
PKGS="$PKGS nettle-dev:arm64 libmicrohttpd-dev:arm64"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "install-deps-arm64: adding the arm64 architecture to dpkg"
    $SUDO dpkg --add-architecture arm64
fi
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "install-deps-arm64: installing$missing"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
