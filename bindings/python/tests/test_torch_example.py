# SPDX-License-Identifier: MIT
"""Smoke tests of examples/python/train_gpt.py (a tiny GPT, a handful of CPU steps per optimizer) and of
examples/python/plot_losses.py.

The several-rank tests start two CPU ranks (gloo) and compare their losses with the single-process run's: the
ranks split every global batch, so with averaged gradients the runs agree to fp32 rounding (also for Dion's
compressed sync, which averages P = B Q and R = B^T P, linear in the momentum). They start the ranks the way
torchrun does (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) rather than through torchrun itself, which
in Debian's torch 1.13 fails under Python 3.11 before starting anything (its Std.from_str("0") returns None;
``--redirects 1 --tee 1 --log_dir DIR`` works around it by hand). The meshes of libdion's host backend are MPI
communicators, so the run with the optimizer's meshes (``--ddp`` giving Dion the group as replicate_mesh and Muon as
distributed_mesh; ``--ddp-compressed``) goes under mpirun, skipped without mpirun, mpi4py or an MPI libdion.
"""
import csv
import importlib.util
import os
import shutil
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")

import libdion  # noqa: E402
from conftest import BINDING_ROOT, REPO_ROOT  # noqa: E402

EXAMPLES = os.path.join(REPO_ROOT, "examples", "python")
EXAMPLE = os.path.join(EXAMPLES, "train_gpt.py")
PLOT = os.path.join(EXAMPLES, "plot_losses.py")
RANK_TIMEOUT = 150  # seconds for a two-rank run (about 10 here)


def _load(path, name):
    if not os.path.isfile(path):
        pytest.skip("%s not found (installed tests)" % os.path.relpath(path, REPO_ROOT))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def train_gpt():
    return _load(EXAMPLE, "train_gpt")


TINY = ["--layers", "2", "--d-model", "64", "--steps", "5", "--device", "cpu", "--context", "64", "--batch-size", "4",
        "--eval-every", "5", "--val-batches", "2"]


def _rows(out):
    with open(os.path.join(out, "losses.csv")) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def single_run(train_gpt, tmp_path_factory):
    """The single-process run of every optimizer: (output directory, stdout)."""
    import contextlib
    import io
    out = str(tmp_path_factory.mktemp("single") / "out")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert train_gpt.main(TINY + ["--optimizer", "all", "--out", out]) == 0
    return out, buf.getvalue()


def test_all_optimizers_on_the_standard_library(single_run):
    out, text = single_run
    assert "standard library sources" in text and "tok/s" in text and "final validation loss: dion" in text
    assert "result: optimizer=dion mode=single ranks=1 steps=5 val_loss=" in text
    rows = _rows(out)
    assert {r["optimizer"] for r in rows} == {"dion", "muon", "adamw"} and len(rows) == 15
    for name in ("dion", "muon", "adamw"):
        curve = [r for r in rows if r["optimizer"] == name]
        assert float(curve[-1]["train_loss"]) < float(curve[0]["train_loss"])  # it learns something in 5 steps
        assert curve[-1]["val_loss"] != ""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in text
    else:
        assert os.path.getsize(os.path.join(out, "losses.png")) > 1000


def test_a_data_file_and_a_list_of_optimizers(train_gpt, tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = str(tmp_path / "out")
    assert train_gpt.main(TINY + ["--optimizer", "muon,adamw", "--data", str(data), "--out", out, "--no-plot"]) == 0
    assert str(data) in capsys.readouterr().out
    assert [r["optimizer"] for r in _rows(out)][::5] == ["muon", "adamw"]
    assert not os.path.exists(os.path.join(out, "losses.png"))


def test_defaults_and_arguments(train_gpt):
    args = train_gpt.parse_args([])
    assert args.rank_fraction == 0.25 and args.batch_size == 16 and args.steps == 1000
    assert args.optimizers == ("dion", "muon", "adamw") and args.mode == "single"
    assert train_gpt.parse_args(["--fsdp"]).mode == "fsdp"
    assert train_gpt.parse_args(["--ddp-compressed"]).mode == "ddp-compressed"
    for bad in (["--optimizer", "sgd"], ["--optimizer", "dion,dion"], ["--ddp", "--fsdp"]):
        with pytest.raises(SystemExit):
            train_gpt.parse_args(bad)


@pytest.mark.parametrize("mode", ["ddp", "ddp-compressed", "fsdp"])
def test_several_ranks_need_a_launcher(train_gpt, mode, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert train_gpt.main(TINY + ["--" + mode]) == 2
    assert "launch the ranks with torchrun" in capsys.readouterr().err


def test_plot_losses(single_run, tmp_path, capsys):
    plot_losses = _load(PLOT, "plot_losses")
    out, _ = single_run
    curves = plot_losses.read_curves(out)
    assert list(curves) == ["dion", "muon", "adamw"] and len(curves["dion"]) == 5 and curves["dion"][-1][2] > 0
    png = tmp_path / "cmp.png"
    rc = plot_losses.main([out, os.path.join(out, "losses.csv"), "-o", str(png)])
    text = capsys.readouterr().out
    assert "out:dion " in text and "out:dion #3 " in text and "final val" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 1 and "no plot" in text
    else:
        assert rc == 0 and png.stat().st_size > 1000


# --------------------------------------------------------------------------
# Several ranks on the CPU
# --------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    # A launcher's per-rank variables would make the child think it is a rank already; the
    # OMPI_MCA_* settings are the machine's Open MPI configuration (e.g. which rsh agent) and stay.
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("OMPI_", "PMI_", "PMIX_")) and not k.startswith("OMPI_MCA_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(LIBDION_PATH=libdion.library_path(), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([BINDING_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
    env.update(extra)
    return env


def _same_curves(out, ref, tol=1e-4):
    got = _rows(out)
    names = {r["optimizer"] for r in got}
    want = [r for r in _rows(ref) if r["optimizer"] in names]
    assert [(r["optimizer"], r["step"]) for r in got] == [(r["optimizer"], r["step"]) for r in want]
    for g, w in zip(got, want):
        for key in ("train_loss", "val_loss"):
            assert (g[key] == "") == (w[key] == ""), (g, w)
            if w[key]:
                assert abs(float(g[key]) - float(w[key])) < tol, (key, g, w)


def _gloo():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no torch.distributed with gloo")


def test_ddp_two_ranks_gloo(single_run, tmp_path):
    """torchrun's contract: every rank gets RANK, LOCAL_RANK, WORLD_SIZE and the rendezvous address."""
    _gloo()
    out = str(tmp_path / "ddp2")
    env = _env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    cmd = [sys.executable, EXAMPLE] + TINY + ["--ddp", "--optimizer", "all", "--out", out, "--no-plot"]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=RANK_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("two gloo ranks of train_gpt.py --ddp did not finish in %d s" % RANK_TIMEOUT)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-8000:]
    assert "ranks: 2 (ddp, gloo on cpu" in outs[0] and "DistributedDataParallel" in outs[0], outs[0]
    assert "result: optimizer=adamw mode=ddp ranks=2" in outs[0] and outs[1].strip() == "", outs
    _same_curves(out, single_run[0])


def _mpirun():
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    pytest.importorskip("mpi4py", reason="libdion's CPU meshes need mpi4py (apt-get install python3-mpi4py)")
    try:
        deps = subprocess.run(["ldd", libdion.library_path()], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        deps = "libmpi"
    if "libmpi" not in deps:
        pytest.skip("%s was built without MPI" % libdion.library_path())
    return exe


@pytest.mark.parametrize("mode", ["ddp", "ddp-compressed"])
def test_two_ranks_with_libdion_meshes_under_mpirun(single_run, tmp_path, mode):
    _gloo()
    exe = _mpirun()
    out = str(tmp_path / mode)
    env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [exe, "-n", "2", "--oversubscribe", sys.executable, EXAMPLE] + TINY + [
        "--" + mode, "--optimizer", "dion,muon", "--out", out, "--no-plot"]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail("%s timed out:\n%s" % (" ".join(cmd), (e.stdout or "")[-4000:]))
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-8000:]
    assert "launched by mpirun" in text and "libdion meshes: replicate=replicate_mesh" in text, text
    assert "libdion meshes: replicate=distributed_mesh" in text, text  # Muon splits its work over the group
    if mode == "ddp-compressed":
        assert "no DDP wrapper: libdion averages (compressed sync)" in text, text
    _same_curves(out, single_run[0])
