# SPDX-License-Identifier: MIT
"""libdion.torch on several ranks over MPI (host backend): runs torch_mpi_worker.py under
``mpirun -n N`` (N = 2, 4; oversubscribed) and checks that every case passed on every rank. The cases
(DDP with and without compressed Dion sync, FSDP-style outer shards with uneven chunks, HSDP replicate x outer,
a checkpoint round trip, Muon's distributed_mesh) and their tolerances are described in the worker.
Skipped without mpi4py (Debian: python3-mpi4py) or mpirun, or when libdion was built without MPI."""
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")
pytest.importorskip("mpi4py", reason="the MPI tests of libdion.torch need mpi4py (apt-get install python3-mpi4py)")

import libdion  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_mpi_worker.py")


def _mpirun():
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    return exe


def _has_mpi(lib_path):
    """libdion links an MPI library (its host backend can use MPI communicators)."""
    try:
        out = subprocess.run(["ldd", lib_path], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return True  # cannot tell: let the run say
    return "libmpi" in out


@pytest.mark.parametrize("ranks", [2, 4])
def test_torch_optimizers_over_mpi(ranks):
    exe = _mpirun()
    path = libdion.library_path()
    if not _has_mpi(path):
        pytest.skip("%s was built without MPI" % path)
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               LIBDION_PATH=path, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + [p for p in [env.get("PYTHONPATH")] if p]))
    cmd = [exe, "-n", str(ranks), "--oversubscribe", sys.executable, WORKER]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail("%s timed out after 600 s:\n%s" % (" ".join(cmd), (e.stdout or "")[-4000:]))
    out = r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASS ", "FAIL "))]
    assert r.returncode == 0 and lines and all(ln.startswith("PASS ") for ln in lines), \
        "%s exited %d:\n%s" % (" ".join(cmd), r.returncode, out[-12000:])
    assert len(lines) == (11 if ranks == 4 else 9), out
