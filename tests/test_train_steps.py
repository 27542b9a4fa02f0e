"""`mpdl train --max-steps`, fractional --epochs, the step-based schedule (--warmup-steps,
--lr-decay-steps, --min-lr), --optimizer adamw with --beta1/--beta2/--eps and --grad-clip: the
steps taken, the learning rate of each step, the checks of bad input, and a resumed run."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpdl.autograd import nn, optim
from mpdl.cli.train import flag
from mpdl.threadworld import ThreadWorld
from mpdl.training.config import ConfigError, TrainConfig, validate
from mpdl.training.config_file import config_toml, read_config_file
from mpdl.training.factory import make_optimizer
from mpdl.training.loop import Trainer

#: a tiny GPT on 1-digit addition: 90 training problems, 8 steps an epoch of 12
TINY = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 1,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12, "optim.epochs": 1,
        "optim.optimizer": "adamw", "output.progress": False, "model.dtype": "float64"}
MPDL = str(Path(sys.executable).parent / "mpdl")


def run(changes: dict) -> tuple[Trainer, list[dict], list[tuple[float, float | None]]]:
    """The trainer, its rows and each step's (learning rate, gradient norm)."""
    trainer = Trainer(TrainConfig.from_keys({**TINY, **changes}), comm=ThreadWorld(1).comm(0),
                      out=io.StringIO())
    trainer.setup()
    steps = []
    step = trainer.strategy.step

    def recorded(batch):
        result = step(batch)
        steps.append((batch.lr, result.grad_norm))
        return result

    trainer.strategy.step = recorded
    return trainer, trainer.run(), steps


def test_max_steps_ends_within_an_epoch_on_nanogpts_schedule():
    trainer, rows, steps = run({"optim.max_steps": 11, "optim.warmup_steps": 2,
                                "optim.lr_decay_steps": 9, "optim.min_lr": 1e-4,
                                "optim.lr": 1e-3})
    assert trainer.step == len(steps) == 11
    assert [r["epoch"] for r in rows[:-1]] == [1, 2]
    expected = [1e-3 / 3, 2e-3 / 3] + [
        1e-4 + 0.5 * (1 + math.cos(math.pi * (s - 2) / 7)) * 9e-4 for s in range(2, 9)] + [1e-4] * 2
    np.testing.assert_allclose([lr for lr, _ in steps], expected, rtol=1e-12)
    assert all(norm is None for _, norm in steps)  # no clipping, no norm


def test_fractional_epochs_and_max_steps_over_epochs():
    _, rows, steps = run({"optim.epochs": 1.5, "optim.lr_schedule": "constant"})
    assert len(steps) == 12 and [r["epoch"] for r in rows[:-1]] == [1, 2]
    _, _, steps = run({"optim.epochs": 5, "optim.max_steps": 3})
    assert len(steps) == 3


def test_grad_clip_reports_the_norm_before_clipping():
    _, _, clipped = run({"optim.max_steps": 4, "optim.grad_clip": 0.05})
    _, _, loose = run({"optim.max_steps": 1, "optim.grad_clip": 1e6})
    norms = [norm for _, norm in clipped]
    assert all(n is not None and n > 0.05 for n in norms)  # it binds
    assert norms[0] == loose[0][1]  # the first step's norm: the same start, clipped or not


@pytest.mark.parametrize("changes,library,flags", [
    ({"optim.max_steps": 0}, "optim.max_steps: expected a positive number, got 0",
     "--max-steps: expected a positive number, got 0"),
    ({"optim.lr_decay_steps": -5}, "optim.lr_decay_steps: expected a positive number, got -5",
     "--lr-decay-steps: expected a positive number, got -5"),
    ({"optim.warmup_steps": -1}, "optim.warmup_steps: expected a number >= 0, got -1",
     "--warmup-steps: expected a number >= 0, got -1"),
    ({"optim.min_lr": 0.01, "optim.lr": 0.001},
     "optim.min_lr 0.01 must not exceed the learning rate 0.001",
     "--min-lr 0.01 must not exceed the learning rate 0.001"),
    ({"optim.warmup_steps": 100, "optim.lr_decay_steps": 50},
     "optim.warmup_steps 100 is longer than the decay: optim.lr_decay_steps 50",
     "--warmup-steps 100 is longer than the decay: --lr-decay-steps 50"),
    ({"optim.warmup_steps": 100, "optim.max_steps": 60},
     "optim.warmup_steps 100 is longer than the decay: optim.max_steps 60",
     "--warmup-steps 100 is longer than the decay: --max-steps 60"),
    ({"optim.grad_clip": 0.0}, "optim.grad_clip: expected a positive number, got 0.0",
     "--grad-clip: expected a positive number, got 0.0"),
    ({"optim.grad_clip": -1.0}, "optim.grad_clip: expected a positive number, got -1.0",
     "--grad-clip: expected a positive number, got -1.0"),
    ({"optim.epochs": 0.0}, "optim.epochs: expected a positive number, got 0",
     "--epochs: expected a positive number, got 0"),
    ({"optim.beta2": 1.0}, "optim.beta2: expected a number in [0, 1), got 1.0",
     "--beta2: expected a number in [0, 1), got 1.0"),
    ({"optim.optimizer": "sgd", "optim.beta2": 0.99},
     "optim.beta2 is an option of optim.optimizer adam, adamw or muon (its AdamW part), not sgd",
     "--beta2 is an option of --optimizer adam, adamw or muon (its AdamW part), not sgd"),
    ({"optim.lr_schedule": "constant", "optim.lr_decay_steps": 10},
     "optim.lr_decay_steps needs optim.lr_schedule cosine, not constant",
     "--lr-decay-steps needs --lr-schedule cosine, not constant"),
    ({"optim.deterministic": True, "optim.grad_clip": 1.0},
     "optim.grad_clip cannot be combined with optim.deterministic",
     "--grad-clip cannot be combined with --deterministic"),
    ({"optim.deterministic": True, "parallel.zero": 1, "optim.weight_decay": 0.1,
      "model.dtype": "float32"},
     "optim.deterministic cannot be combined with optim.optimizer: with parallel.zero, lars, "
     "lamb and muon need whole tensors and adamw decays whole matrices",
     "--deterministic cannot be combined with --optimizer: with --zero, lars, lamb and muon need "
     "whole tensors and adamw decays whole matrices"),
])
def test_bad_steps_and_clipping_are_refused(changes, library, flags):
    with pytest.raises(ConfigError) as caught:
        validate(TrainConfig.from_keys({**TINY, **changes}), 2)
    assert str(caught.value).startswith(library)
    assert caught.value.message(flag).startswith(flags)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", "-k", "5", "120", MPDL, "train", "--no-progress", *args],
                          capture_output=True, text=True, timeout=135,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,line", [
    (["--max-steps", "0"], "mpdl train: error: --max-steps: expected a positive number, got 0"),
    (["--grad-clip", "0"], "mpdl train: error: --grad-clip: expected a positive number, got 0.0"),
    (["--model", "gpt", "--min-lr", "1"],
     "mpdl train: error: --min-lr 1 must not exceed the learning rate 0.003"),
])
def test_the_cli_says_one_line_and_exits_2(args, line):
    out = cli(*args)
    assert out.returncode == 2 and out.stderr.splitlines() == [line], out.stderr


def test_the_new_options_round_trip_through_toml(tmp_path):
    config = TrainConfig.from_keys({**TINY, "optim.max_steps": 2000, "optim.warmup_steps": 100,
                                    "optim.lr_decay_steps": 2000, "optim.min_lr": 1e-4,
                                    "optim.beta2": 0.99, "optim.grad_clip": 1.0,
                                    "optim.epochs": 2.5})
    path = tmp_path / "run.toml"
    path.write_text(config_toml(config))
    assert TrainConfig.from_keys(read_config_file(path)) == config
    assert "max_steps = 2000" in path.read_text() and "epochs = 2.5" in path.read_text()
    whole = TrainConfig.from_keys({"optim.epochs": 3.0})
    assert whole.optim.epochs == 3 and isinstance(whole.optim.epochs, int)


def test_a_killed_run_resumes_to_the_same_step_count(tmp_path):
    """Killed after step 6 (a checkpoint every 4 steps), resumed: the same 11 steps and the same
    parameters as a run never stopped."""
    flags = ["--model", "gpt", "--digits", "1", "--n-layer", "1", "--n-head", "2", "--n-embd",
             "8", "--global-batch-size", "12", "--dtype", "float64", "--optimizer", "adamw",
             "--weight-decay", "0.1", "--max-steps", "11", "--warmup-steps", "2",
             "--min-lr", "1e-4", "--grad-clip", "0.5"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert cli(*flags, "--checkpoint", str(whole)).returncode == 0
    killed = cli(*flags, "--checkpoint", str(part), "--checkpoint-every", "4",
                 env={"MPDL_FAULT": "kill:0:6"})
    assert killed.returncode != 0
    resumed = cli(*flags, "--checkpoint", str(part), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    with np.load(whole / "model.npz") as a, np.load(part / "model.npz") as b:
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-12, err_msg=name)
    other = cli(*flags[:-6], "--max-steps", "12", "--warmup-steps", "2", "--min-lr", "1e-4",
                "--checkpoint", str(part), "--resume")
    assert other.returncode == 2
    assert "written with --max-steps=11, this run has 12" in other.stderr


def test_the_configured_adamw_decays_matrices_with_the_given_betas():
    config = TrainConfig.from_keys({**TINY, "optim.weight_decay": 0.1, "optim.beta1": 0.8,
                                    "optim.beta2": 0.99, "optim.eps": 1e-6, "optim.lr": 0.5,
                                    "optim.grad_clip": 2.0})
    matrix, vector = nn.Parameter(np.ones((2, 2))), nn.Parameter(np.ones(2))
    opt = make_optimizer(config)([matrix, vector])
    assert isinstance(opt, optim.AdamW) and opt.max_grad_norm == 2.0
    assert opt.param_groups[0]["betas"] == (0.8, 0.99) and opt.param_groups[0]["eps"] == 1e-6
    matrix.grad, vector.grad = np.zeros((2, 2)), np.zeros(2)
    opt.step()  # a zero gradient: only the decay moves a parameter
    np.testing.assert_allclose(matrix.data, 1 - 0.5 * 0.1)
    np.testing.assert_allclose(vector.data, 1.0)
