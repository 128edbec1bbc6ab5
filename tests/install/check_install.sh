#!/usr/bin/env bash
# Installs the build in $1 (default: build) into a temporary prefix, then builds and runs a
# C consumer through find_package(dion) and another through pkg-config. When
# gfortran (or $FC) is available, also a Fortran program (fortran_consumer/):
# through find_package(dion COMPONENTS fortran) when the build has the Fortran
# module (DION_WITH_FORTRAN), and compiled with the installed dion.f90 in any case.
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
# Fortran: the installed source always; the module target when the build exported dion::fortran.
test -f "$tmp/prefix/share/dion/fortran/dion.f90"
fc=${FC:-gfortran}
if ! command -v "$fc" >/dev/null; then
  fortran="skipped ($fc not found)"
else
  fortran=""
  if grep -q 'dion::fortran' "$tmp/prefix/lib/cmake/dion/dionTargets.cmake"; then
    FC="$fc" cmake -S "$root/tests/install/fortran_consumer" -B "$tmp/fortran_consumer" -G Ninja \
      -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
    cmake --build "$tmp/fortran_consumer" >/dev/null
    LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/fortran_consumer/fortran_consumer"
    fortran="find_package(dion COMPONENTS fortran) and "
  fi
  # Without the CMake module: compile the installed dion.f90 with the program, link -ldion.
  mkdir -p "$tmp/fortran_src"
  "$fc" -J "$tmp/fortran_src" -I "$tmp/fortran_src" "$tmp/prefix/share/dion/fortran/dion.f90" \
    "$root/tests/install/fortran_consumer/main.f90" -L"$tmp/prefix/lib" -ldion -o "$tmp/fortran_src/consumer"
  LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/fortran_src/consumer"
  fortran="${fortran}installed dion.f90 consumers built and ran"
fi
echo "install check: find_package(dion) and pkg-config C consumers built and ran; Fortran: $fortran"
