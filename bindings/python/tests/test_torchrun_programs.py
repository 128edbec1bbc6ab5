# SPDX-License-Identifier: MIT
"""The GPU programs of tests/torchrun (FSDP2, TP, FSDP2 x TP, DCP, DDP under torchrun; run by
tests/torchrun/run_all.sh on a GPU machine) import and build their models here: each with --dry-run, on the CPU,
without a process group."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torchrun programs need PyTorch (apt-get install python3-torch)")

from conftest import BINDING_ROOT, REPO_ROOT  # noqa: E402

TORCHRUN = os.path.join(REPO_ROOT, "tests", "torchrun")
CASES = ["fsdp", "tp", "fsdp_tp", "dcp", "ddp"]


@pytest.mark.parametrize("case", CASES)
def test_dry_run(case):
    script = os.path.join(TORCHRUN, "case_%s.py" % case)
    if not os.path.isfile(script):
        pytest.skip("tests/torchrun not found (installed tests)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([BINDING_ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                        if p]), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, script, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "dry run: MLP" in r.stdout, r.stdout + r.stderr
    h = subprocess.run([sys.executable, script, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "--ckpt-dir" in h.stdout, h.stdout + h.stderr


def test_run_all_is_valid_bash_and_needs_an_outdir():
    script = os.path.join(TORCHRUN, "run_all.sh")
    if not os.path.isfile(script):
        pytest.skip("tests/torchrun not found (installed tests)")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    r = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "usage: run_all.sh OUTDIR" in r.stderr
