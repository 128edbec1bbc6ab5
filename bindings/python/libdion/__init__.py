# SPDX-License-Identifier: MIT
"""libdion: ctypes binding of the libdion C ABI (Dion, Dion2, Muon, NorMuon, NorDion2, AdamW, Lion).

``libdion.Optimizer`` is the Pythonic layer (numpy arrays or raw addresses);
``libdion.lib()`` returns the loaded ctypes library with every prototype set,
for direct calls; the DION_* constants and the dion_*_t structs mirror
include/dion.h. The shared library is found lazily, at the first use (see
``libdion._lib`` for the search order; ``python -m libdion`` diagnoses it).
"""
from . import _lib
from ._lib import (DionCublasError, DionCudaError, DionCusolverError, DionError, DionInternalError,  # noqa: F401
                   DionInvalidArgument, DionInvalidUsage, DionLibraryError, DionMpiError, DionNcclError,
                   DionNotSupported, DionNumericalError, DionOutOfMemory, check, library_path, library_version)
from .core import Optimizer, TensorSpec, bf16_to_float32, float32_to_bf16  # noqa: F401

# The header's names: DION_* constants, dion_*_t types and structs, DION_VERSION().
globals().update({_n: getattr(_lib, _n) for _n in dir(_lib) if _n.startswith(("DION_", "dion_"))})

__version__ = "%d.%d.%d" % (_lib.DION_VERSION_MAJOR, _lib.DION_VERSION_MINOR, _lib.DION_VERSION_PATCH)


def lib():
    """The loaded libdion (ctypes.CDLL) with argtypes/restype set for every function."""
    return _lib.get_lib()
