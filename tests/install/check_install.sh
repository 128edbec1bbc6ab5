#!/usr/bin/env bash
# Installs the build in $1 into a temporary prefix, then builds and runs a
# consumer through find_package(dion) and another through pkg-config.
set -euo pipefail
build=${1:-build}
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
test -f "$tmp/prefix/include/dion.h"
test -f "$tmp/prefix/lib/pkgconfig/dion.pc"
test -f "$tmp/prefix/lib/cmake/dion/dionConfig.cmake"
cmake -S "$root/tests/install/consumer" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/consumer/consumer"
PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" cc -std=c99 -Wall -Werror \
  $(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags dion) \
  "$root/tests/install/consumer/main.c" -o "$tmp/pc_consumer" \
  $(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --libs dion)
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/pc_consumer"
echo "install check: find_package(dion) and pkg-config consumers built and ran"
