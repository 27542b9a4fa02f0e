"""`mpdl train --precision` and `--grad-accum`: the loss scaler's record in the JSON, checkpoints of an
overflowing fp16 run, accumulation against the large batch, and bad input under mpiexec."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpdl.backend import bfloat16
from mpdl.threadworld import ThreadWorld, run_world
from mpdl.training.config import ConfigError, TrainConfig, validate
from mpdl.training.loop import Trainer

BIN = Path(sys.executable).parent
#: a tiny GPT on 1-digit addition: 90 training problems, 8 steps an epoch of 12
TINY = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 1,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12, "optim.epochs": 1,
        "optim.optimizer": "adam", "output.progress": False}


def config(**keys) -> TrainConfig:
    return TrainConfig.from_keys({**TINY, **keys})


def run(config: TrainConfig, comm=None) -> tuple[np.ndarray, list[dict]]:
    trainer = Trainer(config, comm=comm or ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    rows = trainer.run()
    return np.concatenate([p.data.astype(np.float64).ravel()
                           for p in trainer.model.parameters()]), rows


def test_grad_accum_follows_the_large_batch():
    p = 2
    reference = run(config())[0]
    for params, rows in run_world(p, lambda c: run(config(**{"optim.grad_accum": 4}), c)):
        np.testing.assert_allclose(params, reference, rtol=0, atol=1e-5)
        assert rows[-1]["grad_accum"] == 4


def test_fp16_from_an_overflowing_scale_skips_steps_and_backs_off(tmp_path):
    path = tmp_path / "run.jsonl"
    params, rows = run(config(**{"optim.precision": "fp16", "optim.loss_scale_init": 2.0**20,
                                 "output.json": str(path)}))
    summary = [json.loads(line) for line in path.read_text().splitlines()][-1]
    assert summary["precision"] == "fp16"
    assert summary["skipped_steps"] >= 1 and summary["scale_backoffs"] >= 1
    assert summary["loss_scale"] == 2.0**20 * 0.5 ** summary["scale_backoffs"]
    assert summary["skipped_steps"] < 8, "no step was taken"
    assert np.isfinite(params).all()


def test_an_overflowing_fp16_run_never_checkpoints_nan(tmp_path):
    """Every step overflows (the scale stays astronomically high for the whole run): every step
    is skipped, and the checkpoints hold the finite initial weights."""
    ckpt = tmp_path / "ckpt"
    overflowing = config(**{"optim.epochs": 2, "optim.precision": "fp16",
                            "optim.loss_scale_init": 3e38, "checkpoint.dir": str(ckpt),
                            "checkpoint.every": 3})
    initial, _ = run(config(**{"optim.epochs": 2, "optim.lr": 1e-30}))
    params, rows = run(overflowing)
    assert rows[-1]["skipped_steps"] == 2 * 8
    saved = dict(np.load(ckpt / "model.npz"))
    for name, value in saved.items():
        value = value.view(bfloat16) if value.dtype == np.dtype("V2") else value
        assert np.isfinite(value.astype(np.float64)).all(), name
    np.testing.assert_allclose(params, initial, rtol=0, atol=1e-3)


def test_bf16_training_learns_and_records_its_precision():
    params, rows = run(config(**{"optim.epochs": 3, "optim.precision": "bf16"}))
    assert rows[-1]["precision"] == "bf16" and "loss_scale" not in rows[-1]
    assert rows[2]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("keys,message", [
    ({"optim.precision": "fp16", "communication.compression": "topk"},
     "the optimizer of {communication.compression} (its error"),
    ({"optim.precision": "fp16", "communication.sync_every": 4},
     "the optimizer of {communication.sync_every} > 1"),
    ({"optim.grad_accum": 2, "parallel.zero": 2},
     "{optim.grad_accum} > 1 cannot be combined with {parallel.zero}"),
    ({"optim.precision": "bf16", "model.dtype": "float64"}, "needs {model.dtype} float32"),
    ({"optim.precision": "bf16", "model.moe_experts": 4, "model.name": "gpt",
      "data.dataset": "addition", "parallel.zero": 1},
     "{optim.precision} bf16 with {model.moe_experts} cannot be combined with {parallel.zero} 1"),
    ({"optim.grad_accum": 2, "model.moe_experts": 4, "model.name": "gpt",
      "data.dataset": "addition", "parallel.pp": 2},
     "{optim.grad_accum} > 1 cannot be combined with {parallel.pp}"),
    ({"optim.precision": "fp16", "optim.loss_scale_init": 0.0},
     "{optim.loss_scale_init}: expected a finite loss scale > 0"),
])
def test_combinations_that_cannot_work_are_config_errors(keys, message):
    with pytest.raises(ConfigError) as error:
        validate(TrainConfig.from_keys(keys), 4)
    assert message in error.value.template


@pytest.mark.parametrize("keys", [
    {"parallel.pp": 2}, {"parallel.tp": 2, "model.name": "gpt", "data.dataset": "addition"},
    {"parallel.cp": 2, "model.name": "gpt", "data.dataset": "addition", "data.digits": 2},
    {"parallel.pp": 2, "parallel.zero": 1}])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_runs_with_pipeline_tensor_and_context_parallelism(keys, name):
    validate(TrainConfig.from_keys({**keys, "optim.precision": name}), 4)


@pytest.mark.parametrize("flags,message", [
    (["--precision", "fp8"], "--precision: expected one of fp32, bf16, fp16, got 'fp8'"),
    (["--precision", "fp16", "--mode", "ps"], "--precision fp16 skips the optimizer step"),
    (["--grad-accum", "0"], "--grad-accum: expected a positive number, got 0"),
])
def test_bad_precision_flags_exit_2_with_one_line_on_every_rank(flags, message):
    cmd = ["timeout", "-k", "5", "60", str(BIN / "mpiexec"), "-n", "2", str(BIN / "mpdl"),
           "train", "--no-progress", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=75,
                         env={**os.environ, "MPDL_NO_CUPY": "1"})
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("mpdl train: error: "), out.stderr
    assert message in errors[0]


@pytest.mark.parametrize("ranks,layout", [(1, {}), (2, {"parallel.pp": 2})])
def test_bf16_resume_restores_the_master_weights(tmp_path, ranks, layout):
    """A pipeline's checkpoint keeps the float32 master weights and moments of its 16-bit
    parameters in float32 (each rank's parameters compared: the last stage's here)."""
    ckpt = str(tmp_path / "ckpt")
    common = {"optim.epochs": 2, "optim.precision": "bf16", "optim.lr_schedule": "constant",
              **layout}

    def last_rank(config: TrainConfig) -> tuple[np.ndarray, list[dict]]:
        return run_world(ranks, lambda comm: run(config, comm))[-1]

    straight, before = last_rank(config(**common))
    last_rank(config(**{**common, "optim.epochs": 1, "checkpoint.dir": ckpt}))
    resumed, rows = last_rank(config(**common, **{"checkpoint.dir": ckpt,
                                                  "checkpoint.resume": True}))
    np.testing.assert_array_equal(resumed, straight)
    assert rows[-1]["loss"] == before[-1]["loss"]
