# SPDX-License-Identifier: MIT
"""Smoke test of examples/python/train_gpt.py: a tiny GPT, a handful of CPU steps per optimizer."""
import csv
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")

from conftest import REPO_ROOT  # noqa: E402

EXAMPLE = os.path.join(REPO_ROOT, "examples", "python", "train_gpt.py")


@pytest.fixture(scope="module")
def train_gpt():
    if not os.path.isfile(EXAMPLE):
        pytest.skip("examples/python/train_gpt.py not found (installed tests)")
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TINY = ["--layers", "2", "--d-model", "64", "--steps", "5", "--device", "cpu", "--context", "64", "--batch-size", "4",
        "--eval-every", "5", "--val-batches", "2"]


def _rows(out):
    with open(os.path.join(out, "losses.csv")) as f:
        return list(csv.DictReader(f))


def test_all_optimizers_on_the_standard_library(train_gpt, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert train_gpt.main(TINY + ["--optimizer", "all", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "standard library sources" in text and "tok/s" in text and "final validation loss: dion" in text
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


def test_a_data_file_and_one_optimizer(train_gpt, tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = str(tmp_path / "out")
    assert train_gpt.main(TINY + ["--optimizer", "muon", "--data", str(data), "--out", out]) == 0
    assert str(data) in capsys.readouterr().out
    assert {r["optimizer"] for r in _rows(out)} == {"muon"}


def test_distributed_flags_say_not_yet_supported(train_gpt, capsys):
    assert train_gpt.main(TINY + ["--ddp"]) == 2
    assert "--ddp is not yet supported" in capsys.readouterr().err
