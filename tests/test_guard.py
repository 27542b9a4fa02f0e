"""The non-finite guard of `mpdl train`: a diverging run stops with one line and exit status 3,
and no checkpoint ever holds a NaN or inf (mpdl.training.guard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpdl.autograd import amp
from mpdl.backend import bfloat16_dtype
from mpdl.comm import as_communicator
from mpdl.training import guard
from mpdl.training.checkpoint import load_checkpoint

BIN = Path(sys.executable).parent


def train(n: int, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "5", "120", str(BIN / "mpiexec"), "-n", str(n), str(BIN / "mpdl"),
           "train", "--no-progress", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=140,
                          env={**os.environ, **(env or {})})


def all_finite(directory: Path) -> bool:
    """Every array of every .npz file in directory (and its history) is finite."""
    for path in directory.rglob("*.npz"):
        with np.load(path, allow_pickle=False) as archive:
            for name in archive.files:
                a = archive[name]
                if a.dtype.kind in "fc" and not np.isfinite(a).all():
                    return False
    return True


def test_lr_1e30_stops_with_one_line_exit_3_and_no_checkpoint_of_nan(tmp_path):
    out = train(2, "--lr", "1e30", "--checkpoint", str(tmp_path / "D"), "--checkpoint-every",
                "5", "--epochs", "2")
    assert out.returncode == 3, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpdl train: error: stopped at step "), lines
    assert "the loss is nan" in lines[0] and "--lr (now 1e+30)" in lines[0]
    assert all_finite(tmp_path)


def test_poisoned_step_keeps_the_last_good_checkpoint(tmp_path):
    """A NaN written into rank 1's weights after step 7: checkpoint of step 5 stays, the run
    stops at step 8 (patience 1) with every rank's exit status 3."""
    ck = tmp_path / "D"
    out = train(2, "--checkpoint", str(ck), "--checkpoint-every", "5", "--keep", "3",
                env={"MPDL_FAULT": "nan:1:7"})
    assert out.returncode == 3, out.stderr
    assert "stopped at step 8: the loss is nan" in out.stderr
    assert json.loads((ck / "state.json").read_text())["step"] == 5
    assert sorted(p.name for p in (ck / "history").iterdir()) == ["step-00000005"]
    assert all_finite(tmp_path)
    model, _, _ = load_checkpoint(ck)
    assert all(np.isfinite(a).all() for a in model.values())


def test_patience_counts_bad_steps_in_a_row(tmp_path):
    out = train(2, "--nan-patience", "3", env={"MPDL_FAULT": "nan:0:4"})
    assert out.returncode == 3, out.stderr
    assert "stopped at step 7: " in out.stderr and "(3 steps in a row, --nan-patience 3)" \
        in out.stderr


def test_fp16_table_shows_skipped_steps():
    out = train(2, "--precision", "fp16", "--epochs", "1", "--lr", "20")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[1:3]
    assert header.split()[-1] == "skipped" and int(row.split()[-1]) > 0


def test_check_saved_names_the_array_and_keeps_going_on_finite_values():
    comm = as_communicator(None)
    finite = [("w", np.full(4, 60000, np.float16)), ("b", np.ones(3, bfloat16_dtype())),
              ("lr", 0.5), ("meta", np.array("text"))]
    guard.check_saved(comm, finite, 3, "D")
    bad = np.ones(5, np.float32)
    bad[2] = np.inf
    with pytest.raises(guard.NonFiniteStop, match=r"step 9: .*rank 0: model/fc.weight\); not "
                                                    r"written, the last good one in D stays"):
        guard.check_saved(comm, guard.walk("model", {"fc.weight": bad, "fc.bias": np.ones(2)}),
                          9, "D")
    assert guard.nonfinite_arrays(guard.walk("", {"state": {"0": {"m": np.array([np.nan])}},
                                                  "param_groups": [{"lr": 0.1}]})) == ["state/0/m"]


def test_loss_scale_stops_at_its_floor():
    s = amp.LossScaler(4.0)
    for _ in range(4):
        s.update(False)
    assert s.scale == 1.0 and s.at_floor and s.skipped_steps == 4
    low = amp.LossScaler(0.25)
    low.update(False)
    assert low.scale == 0.25 and low.at_floor
    assert not amp.LossScaler().at_floor


@pytest.mark.parametrize("flags, expected", [
    (["--lr", "inf"], "--lr: expected a finite learning rate > 0, got inf"),
    (["--lr", "nan"], "--lr: expected a finite learning rate > 0, got nan"),
    (["--momentum", "1.5"], "--momentum: expected a momentum in [0, 1), got 1.5"),
    (["--weight-decay", "inf"], "--weight-decay: expected a number >= 0, got inf"),
    (["--nan-patience", "0"], "--nan-patience: expected a positive number, got 0"),
])
def test_non_finite_or_out_of_range_options_are_refused(flags, expected, capsys):
    from mpdl.cli import main  # noqa: PLC0415

    assert main(["train", *flags]) == 2
    assert capsys.readouterr().err == f"mpdl train: error: {expected}\n"


class Param:
    def __init__(self, value: float) -> None:
        self.data = np.full(3, value, np.float32)
        self.grad = np.ones(3, np.float32)


def test_guard_counts_bad_steps_in_a_row_and_a_finite_step_resets_them():
    g = guard.Guard(as_communicator(None), 2, "fp32")
    g.after_step(1, float("nan"), 4, [Param(1.0)], None, 0.1)
    assert g.bad_steps == 1
    g.after_step(2, 2.0, 4, [Param(1.0)], None, 0.1)
    assert g.bad_steps == 0
    g.after_step(3, 2.0, 4, [Param(np.inf)], None, 0.1)
    with pytest.raises(guard.NonFiniteStop, match=r"^stopped at step 4: the parameters hold nan "
                                                  r"after the update \(loss 0.5\) \(2 steps"):
        g.after_step(4, 2.0, 4, [Param(np.nan)], None, 0.1)


def test_a_nan_in_the_batch_is_named_as_the_data_not_the_learning_rate():
    g = guard.Guard(as_communicator(None), 1, "fp32")
    inputs = np.ones((2, 3), np.float32)
    with pytest.raises(guard.NonFiniteStop, match=r"try a lower --lr \(now 0.1\)"):
        g.after_step(1, float("nan"), 4, [Param(1.0)], None, 0.1, inputs)
    inputs[1, 2] = np.nan
    with pytest.raises(guard.NonFiniteStop) as caught:
        g.after_step(2, float("nan"), 4, [Param(1.0)], None, 0.1, inputs)
    assert str(caught.value).endswith("the batch's inputs hold NaN or inf: check the data "
                                      "first, no --lr fixes that")


def test_fp16_counts_a_nan_loss_only_at_the_scale_floor():
    g = guard.Guard(as_communicator(None), 1, "fp16")
    scaler = amp.LossScaler(2.0)
    g.after_step(1, float("nan"), 4, [Param(1.0)], scaler, 0.1)  # the scaler skips, backs off
    scaler.update(False)
    assert g.bad_steps == 0 and scaler.at_floor
    with pytest.raises(guard.NonFiniteStop, match=r"step 2: the loss is nan, loss scale 1 \(its "
                                                  r"floor\) \(1 step in a row"):
        g.after_step(2, float("nan"), 4, [Param(1.0)], scaler, 0.1)


def test_a_parameter_servers_run_stops_too():
    """The workers stop; the server, which waits for their pushes, is ended with them."""
    out = train(3, "--mode", "ps", "--servers", "1", "--lr", "1e30", "--epochs", "1")
    assert out.returncode == 3, out.stderr
    assert "mpdl train: error: stopped at step 2: the loss is nan" in out.stderr
