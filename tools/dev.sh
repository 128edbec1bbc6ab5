#!/usr/bin/env bash
# One entry point for a fresh machine: installs what libdion needs (Debian
# packages), builds, and runs the demo or every test.
#   bash tools/dev.sh demo   # set up, build, train the demo model (AdamW vs Muon vs Dion)
#   bash tools/dev.sh test   # set up, build, run every test suite that runs without a GPU
#   bash tools/dev.sh deps | build
# BUILD_DIR (default: build) selects the build tree.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}

PACKAGES=(cmake ninja-build g++ gcc gfortran pkg-config libgtest-dev libopenblas-dev liblapack-dev
          libopenmpi-dev openmpi-bin python3 python3-numpy python3-pytest python3-torch python3-mpi4py cbindgen
          clang llvm libclang-rt-dev)

deps() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "== installing: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

build() {
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
  cmake --build "$BUILD_DIR"
}

run_tests() {
  local failed=()
  echo "== C/C++ unit suites (ctest -L unit)"
  ctest --test-dir "$BUILD_DIR" -L unit --output-on-failure -j2 || failed+=("ctest")
  echo "== MPI suites (ctest -L mpi)"
  ctest --test-dir "$BUILD_DIR" -L mpi --output-on-failure || failed+=("mpi")
  echo "== install / find_package / pkg-config"
  bash tests/install/check_install.sh "$BUILD_DIR" || failed+=("install")
  for lang in python rust fortran julia; do
    if [ -f "bindings/$lang/ci.sh" ]; then
      echo "== bindings/$lang"
      bash "bindings/$lang/ci.sh" "$BUILD_DIR" || failed+=("bindings/$lang")
    fi
  done
  echo "== sanitizers: unit + MPI suites under ASan/UBSan/LSan (tools/sanitize.sh asan)"
  bash tools/sanitize.sh asan || failed+=("asan")
  echo "== threads under TSan (tools/sanitize.sh tsan)"
  bash tools/sanitize.sh tsan || failed+=("tsan")
  echo "== fuzzing the C API for 120 s (tools/sanitize.sh fuzz 120)"
  bash tools/sanitize.sh fuzz 120 || failed+=("fuzz")
  if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    return 1
  fi
  echo "all test suites passed"
}

case "${1:-}" in
  deps) deps ;;
  build) deps; build ;;
  test) deps; build; run_tests ;;
  demo) deps; build; "$BUILD_DIR/dion-demo" "${@:2}" ;;
  *) echo "usage: bash tools/dev.sh {demo|test|build|deps}" >&2; exit 2 ;;
esac
