#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# ci.sh [BUILD_DIR] — CI for the Rust bindings; exits non-zero on the first failure.
#
#   BUILD_DIR  the CMake build directory holding libdion.so (default: build). An absolute
#              path, or a path relative to the current directory, or else to the repository root.
#
# Runs, in order: abi_check.sh (cbindgen prototypes vs dion.h, exports of libdion.so),
# cargo fmt --check and cargo clippy -D warnings (when those components are installed),
# cargo test --offline (unit, layout, end-to-end, error-path, state and doc tests), and
# cargo run --offline --example train. Needs cargo, cbindgen and a C compiler; no crates.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
arg=${1:-build}
if [[ $arg == /* ]]; then
  build=$arg
elif [[ -d $arg ]]; then
  build=$(cd "$arg" && pwd)
else
  build=$repo/$arg
fi
if [[ ! -f $build/libdion.so ]]; then
  echo "ci.sh: no libdion.so in $build; build libdion first:" >&2
  echo "  cmake -S $repo -B $repo/build -G Ninja && cmake --build $repo/build" >&2
  exit 1
fi
build=$(cd "$build" && pwd)
export LIBDION_DIR=$build
export LIBDION_INCLUDE_DIR=${LIBDION_INCLUDE_DIR:-$repo/include}
cd "$here"

step() { echo; echo "== ci.sh: $*"; }

step "abi_check.sh $build"
./abi_check.sh "$build"

if cargo fmt --version >/dev/null 2>&1; then
  step "cargo fmt --check"
  cargo fmt --check
else
  echo "ci.sh: note: rustfmt not installed, format check skipped"
fi

if cargo clippy --version >/dev/null 2>&1; then
  step "cargo clippy --all-targets -D warnings"
  cargo clippy --offline --all-targets -- -D warnings
else
  echo "ci.sh: note: clippy not installed, lint skipped"
fi

step "cargo test --offline"
cargo test --offline

step "cargo run --offline --example train"
cargo run --offline --example train

echo
echo "ci.sh: OK (libdion from $build)"
