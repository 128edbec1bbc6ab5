#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs the Python binding's test suite against a libdion build directory.
#
#   bindings/python/ci.sh [BUILD_DIR] [PYTEST_ARGS...]
#
# BUILD_DIR (default: build) is taken relative to the current directory when
# it exists there, else relative to the repository root. PYTHON overrides the
# interpreter (default: /usr/bin/python3, which has Debian's python3-numpy and
# python3-pytest). Exits non-zero when the library is missing, a test fails,
# or no test ran. The libdion.torch tests (tests/test_torch_*.py) need
# PyTorch (Debian's python3-torch); without it they are skipped, with a
# message here and in pytest's summary. Those needing a GPU skip themselves;
# tests/test_torch_mpi.py (mpirun -n 2 and 4) needs mpi4py (python3-mpi4py).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="${1:-build}"
if [[ $# -gt 0 ]]; then shift; fi

if [[ -d "$build" ]]; then
  build="$(cd "$build" && pwd)"
elif [[ -d "$repo/$build" ]]; then
  build="$(cd "$repo/$build" && pwd)"
else
  echo "ci.sh: build directory '$build' not found (looked in $PWD and $repo)" >&2
  exit 2
fi
lib="$build/libdion.so"
if [[ ! -e "$lib" ]]; then
  echo "ci.sh: $lib not found: build libdion first (cmake --build $build)" >&2
  exit 2
fi

python="${PYTHON:-/usr/bin/python3}"
if [[ ! -x "$python" ]]; then python="$(command -v python3)"; fi
if ! "$python" -c 'import numpy, pytest' 2>/dev/null; then
  echo "ci.sh: $python lacks numpy or pytest (apt-get install python3-numpy python3-pytest)" >&2
  exit 2
fi

if torch_version="$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
  echo "ci.sh: torch $torch_version: running the libdion.torch tests too"
else
  echo "ci.sh: torch is not importable by $python (apt-get install python3-torch): the libdion.torch tests" \
       "(tests/test_torch_*.py) will be SKIPPED"
fi

if "$python" -c 'import mpi4py' 2>/dev/null; then
  echo "ci.sh: mpi4py found: running libdion.torch over MPI too (tests/test_torch_mpi.py: mpirun -n 2 and -n 4)"
else
  echo "ci.sh: mpi4py is not importable by $python (apt-get install python3-mpi4py): the MPI tests of" \
       "libdion.torch (tests/test_torch_mpi.py) will be SKIPPED"
fi

export LIBDION_PATH="$lib"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
cd "$repo"
echo "ci.sh: $("$python" --version 2>&1), LIBDION_PATH=$LIBDION_PATH"
# -p no:cacheprovider: leave no .pytest_cache in the source tree. pytest exits
# 5 when it collected no test, which set -e turns into a failure as wanted.
"$python" -m pytest -q -p no:cacheprovider "$here/tests" "$@"
