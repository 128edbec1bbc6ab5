# SPDX-License-Identifier: MIT
"""Shared fixtures. Run from the repository root:

    PYTHONPATH=bindings/python LIBDION_PATH=build/libdion.so python3 -m pytest -q bindings/python/tests
"""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BINDING_ROOT = os.path.dirname(HERE)
REPO_ROOT = os.path.dirname(os.path.dirname(BINDING_ROOT))
HEADER = os.path.join(REPO_ROOT, "include", "dion.h")
MPI_HEADER = os.path.join(REPO_ROOT, "include", "dion_mpi.h")

if BINDING_ROOT not in sys.path:  # usable without PYTHONPATH too
    sys.path.insert(0, BINDING_ROOT)

import libdion  # noqa: E402


def pytest_report_header(config):
    try:
        return "libdion: %s (version %s)" % (libdion.library_path(),
                                             libdion._lib.version_string(libdion.library_version()))
    except libdion.DionLibraryError as e:
        return "libdion: NOT LOADED\n%s" % e


@pytest.fixture(scope="session")
def lib():
    return libdion.lib()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def header_text():
    if not os.path.isfile(HEADER):
        pytest.skip("include/dion.h not found next to the binding (installed tests)")
    with open(HEADER) as f:
        return f.read()


def f32(rng, *shape, scale=1.0):
    return np.asarray(scale * rng.standard_normal(shape), dtype=np.float32)
