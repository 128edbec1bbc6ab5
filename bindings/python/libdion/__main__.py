# SPDX-License-Identifier: MIT
"""``python -m libdion``: where libdion was found, its versions and build features.

Exit status 0 when the library loads and passes the binding's checks, 1
otherwise (the loader's full diagnosis is printed).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

from . import _lib as L


def _mapped_libraries():
    """Paths of the shared objects mapped into this process (Linux)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/") and ".so" in parts[5] and parts[5] not in out:
                    out.append(parts[5])
    except OSError:
        pass
    return out


def _find(mapped, stem):
    for p in mapped:
        if os.path.basename(p).startswith(stem):
            return p
    return None


def _int_query(path, symbol):
    """Calls `int symbol(int*)` (cudaRuntimeGetVersion, ncclGetVersion) of an already mapped library."""
    try:
        fn = getattr(ctypes.CDLL(path), symbol)
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        v = ctypes.c_int(0)
        if fn(ctypes.byref(v)) == 0:
            return v.value
    except (OSError, AttributeError):
        pass
    return None


def _probe_backend(lib, backend):
    """(ok, text) from dion_create with `backend` (destroyed at once when it succeeds)."""
    opts = L.dion_options_t()
    lib.dion_options_init(ctypes.byref(opts))
    opts.backend = backend
    h = L.dion_optimizer_t()
    st = lib.dion_create(ctypes.byref(h), ctypes.byref(opts))
    if st == L.DION_SUCCESS:
        lib.dion_destroy(h)
        return True, "available"
    msg = (lib.dion_last_error(None) or b"").decode("utf-8", "replace")
    return False, "%s: %s" % (L.STATUS_NAMES.get(st, st), msg)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    probe = "--no-probe" not in argv
    if "-h" in argv or "--help" in argv:
        print("usage: python -m libdion [--no-probe]\n  prints where libdion was found, its versions and build "
              "features;\n  --no-probe skips creating a CUDA-backend optimizer to test that backend")
        return 0
    print("libdion Python binding %s (header %s, ABI %d)" %
          (L.version_string(L.DION_VERSION_CODE), L.version_string(L.DION_VERSION_CODE), L.DION_ABI_VERSION))
    print("package: %s" % L.PACKAGE_DIR)
    print("python: %s (%s)" % (sys.version.split()[0], sys.executable))
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DION_") or k in ("LIBDION_PATH",
                                                                                          "LD_LIBRARY_PATH")}
    print("environment:" if env else "environment: (no LIBDION_PATH, LD_LIBRARY_PATH or DION_* set)")
    for k, v in env.items():
        print("  %s=%s" % (k, v))
    try:
        lib = L.get_lib()
    except L.DionLibraryError as e:
        print("\nERROR: %s" % e)
        return 1
    print("\nsearch:")
    for cand, outcome in L.search_log():
        print("  %s -> %s" % (cand, outcome))
    print("library: %s" % L.library_path())
    code = L.library_version()
    print("library version: %s (dion_version() = %d)" % (L.version_string(code), code))
    for sname, (fname, cls) in L.SIZEOF_FUNCTIONS.items():
        print("  sizeof(%s) = %d (binding %d)" % (sname, getattr(lib, fname)(), ctypes.sizeof(cls)))

    mapped = _mapped_libraries()
    cudart = _find(mapped, "libcudart")
    nccl = _find(mapped, "libnccl")
    mpi = _find(mapped, "libmpi")
    blas = _find(mapped, "libopenblas") or _find(mapped, "libblas") or _find(mapped, "libmkl")
    print("\nbuild features:")
    if cudart:
        v = _int_query(cudart, "cudaRuntimeGetVersion")
        ver = "" if v is None else " (version %d.%d)" % (v // 1000, (v % 1000) // 10)
        print("  CUDA runtime: %s%s" % (cudart, ver))
    else:
        print("  CUDA runtime: not linked")
    if nccl:
        v = _int_query(nccl, "ncclGetVersion")  # NCCL >= 2.9 encodes X*10000 + Y*100 + Z
        ver = "" if v is None else " (version %d.%d.%d)" % (v // 10000, (v // 100) % 100, v % 100)
        print("  NCCL: %s%s" % (nccl, ver))
    else:
        print("  NCCL: not linked")
    print("  MPI: %s%s" % (mpi or "not linked",
                           " (dion_comm_from_mpi exported)" if getattr(lib, "dion_comm_from_mpi", None) else ""))
    print("  BLAS: %s" % (blas or "not found among the mapped libraries"))
    print("  host backend: %s" % _probe_backend(lib, L.DION_BACKEND_HOST)[1])
    if probe:
        print("  CUDA backend: %s" % _probe_backend(lib, L.DION_BACKEND_CUDA)[1])
    else:
        print("  CUDA backend: not probed (--no-probe)")

    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            gpus = [ln for ln in r.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.SubprocessError):
            gpus = []
        print("\nGPUs: %s" % ("none listed by nvidia-smi" if not gpus else ""))
        for g in gpus:
            print("  " + g)
    else:
        print("\nGPUs: nvidia-smi not found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
