#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# bindings/julia/ci.sh [BUILD_DIR]
#
# Julia is not available where libdion is built, so the package's checks here are static:
#   1. check_bindings.py: every function of include/dion.h has exactly one @ccall wrapper in src/LibDion.jl, in
#      header order, with the argument and return types of the C -> Julia table (README.md); structs and
#      constants match; src/Dion.jl calls C only through LibDion;
#      with BUILD_DIR/libdion.so present, --abi also builds ctypes structs and signatures from LibDion.jl's Julia
#      types and runs a create/add/step/state scenario against the library with them;
#   2. check_bindings.py --self-test: a dozen deliberate breakages of LibDion.jl are each reported;
#   3. a syntax check of src/*.jl and test/runtests.jl with tree-sitter-julia (tools/package.json, installed with
#      npm into BUILD_DIR/bindings-julia-tools); skipped with a notice when node/npm are missing or the install
#      fails (no registry), or with DION_JULIA_SYNTAX=0;
#   4. if a `julia` is on PATH (not the case in libdion's CI): Pkg.test() against BUILD_DIR/libdion.so.
# BUILD_DIR (default "build", relative to the current directory if it exists there, else to the repository
# root) is needed by --abi and steps 3 and 4; without it those are skipped.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${1:-build}"
if [[ -d "$build" ]]; then
  build="$(cd "$build" && pwd)"
elif [[ -d "$root/$build" ]]; then
  build="$(cd "$root/$build" && pwd)"
else
  build=""
fi

echo "== check_bindings.py"
if [[ -n "$build" && -e "$build/libdion.so" ]]; then
  python3 "$here/check_bindings.py" --header "$root/include/dion.h" --abi "$build/libdion.so"
else
  echo "(no BUILD_DIR/libdion.so: static check only, without --abi)"
  python3 "$here/check_bindings.py" --header "$root/include/dion.h"
fi
echo "== check_bindings.py --self-test"
python3 "$here/check_bindings.py" --header "$root/include/dion.h" --self-test

echo "== Julia syntax (tree-sitter-julia)"
if [[ "${DION_JULIA_SYNTAX:-1}" == "0" ]]; then
  echo "skipped (DION_JULIA_SYNTAX=0)"
elif ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "skipped: node/npm not found"
else
  tools="${build:-${TMPDIR:-/tmp}}/bindings-julia-tools"
  mkdir -p "$tools"
  cp "$here/tools/package.json" "$here/tools/package-lock.json" "$tools/"
  if [[ -d "$tools/node_modules/tree-sitter-julia" ]] ||
     (cd "$tools" && npm ci --no-audit --no-fund >"$tools/npm.log" 2>&1); then
    NODE_PATH="$tools/node_modules" node "$here/tools/syntax_check.js" "$here"/src/*.jl "$here/test/runtests.jl"
  else
    echo "skipped: npm ci failed (see $tools/npm.log)"
  fi
fi

echo "== Pkg.test()"
if command -v julia >/dev/null; then
  if [[ -z "$build" || ! -e "$build/libdion.so" ]]; then
    echo "ci.sh: julia found but no BUILD_DIR/libdion.so to test against" >&2
    exit 1
  fi
  LIBDION_PATH="$build/libdion.so" julia --project="$here" -e 'using Pkg; Pkg.test()'
else
  echo "skipped: julia not found (test/runtests.jl is not run here; see README.md)"
fi

echo "julia bindings: static checks OK"
