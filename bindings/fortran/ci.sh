#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# bindings/fortran/ci.sh [BUILD_DIR]
#
# Checks the Fortran bindings against a built libdion (BUILD_DIR holds libdion.so; default "build", taken
# relative to the current directory if it exists there, else to the repository root):
#   1. check_interfaces.py: every function of include/dion.h has exactly one bind(C) interface in dion.f90, in
#      header order, whose dummies follow the C -> Fortran table of README.md;
#   2. compiles dion.f90, tests/test_dion.f90 and examples/train_demo.f90 with $FC (default gfortran)
#      -std=f2008 -Wall against libdion, into BUILD_DIR/bindings-fortran/;
#   3. runs the test (layouts, error paths, column-major == row-major) and the example with Muon and with Dion
#      (each exits non-zero on failure).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${1:-build}"
if [[ -d "$build" ]]; then
  build="$(cd "$build" && pwd)"
elif [[ -d "$root/$build" ]]; then
  build="$(cd "$root/$build" && pwd)"
else
  echo "ci.sh: build directory '$build' not found (build libdion first: cmake -S . -B build -G Ninja && cmake --build build)" >&2
  exit 1
fi
if [[ ! -e "$build/libdion.so" ]]; then
  echo "ci.sh: $build/libdion.so not found" >&2
  exit 1
fi

FC="${FC:-gfortran}"
out="$build/bindings-fortran"
mkdir -p "$out"
flags=(-std=f2008 -Wall -J "$out" -I "$out")
link=(-L"$build" -ldion -Wl,-rpath,"$build")

echo "== check_interfaces.py"
python3 "$here/check_interfaces.py" --header "$root/include/dion.h" --module "$here/dion.f90"

echo "== compile ($("$FC" --version | head -n 1))"
"$FC" "${flags[@]}" -c "$here/dion.f90" -o "$out/dion.o"
"$FC" "${flags[@]}" -g -fcheck=all "$out/dion.o" "$here/tests/test_dion.f90" "${link[@]}" -o "$out/test_dion"
"$FC" "${flags[@]}" -O2 "$out/dion.o" "$here/examples/train_demo.f90" "${link[@]}" -o "$out/train_demo"

echo "== test_dion"
"$out/test_dion"

echo "== train_demo muon"
"$out/train_demo" muon
echo "== train_demo dion"
"$out/train_demo" dion

echo "fortran bindings: OK"
