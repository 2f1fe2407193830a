#!/bin/sh
# install-deps.sh — installs the Debian packages deltafin's build and tests
# need. Idempotent and quiet when nothing is missing. Needs root (or sudo)
# only when something is missing.
set -e
PKGS="build-essential clang libjansson-dev liburing-dev libpcre2-dev libcurl4-openssl-dev nettle-dev python3"
# make fuzz: clang's libFuzzer and sanitizer runtimes (only Recommended by
# clang, so --no-install-recommends leaves them out)
PKGS="$PKGS libclang-rt-dev"
# deltafin serve: libmicrohttpd (HTTP server library); its tests use curl and
# node (the openai npm client; npm ships with some nodejs builds, else apart)
PKGS="$PKGS libmicrohttpd-dev curl nodejs"
command -v npm >/dev/null 2>&1 || PKGS="$PKGS npm"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "install-deps: installing$missing"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
