"""`mpdl train --model gpt` on the in-process world: p ranks follow one rank (p-invariance) on the
addition and text tasks, the rows carry tokens/s, MFU, validation loss and exact match or bits per
character, and the shape checks."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from mpdl.collectives import algorithms
from mpdl.models.zoo import GPT, build_model
from mpdl.threadworld import ThreadWorld, run_world
from mpdl.training import throughput
from mpdl.training.config import ConfigError, TrainConfig, model_defaults, validate
from mpdl.training.loop import Trainer
from mpdl.tuning import costmodel

TOL = {"float32": 1e-5, "float64": 1e-10}
#: a tiny GPT on 1-digit addition: 90 training problems, 10 held out, 8 steps an epoch of 12
TINY = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 1,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12, "optim.epochs": 1,
        "optim.optimizer": "adam", "output.progress": False}
TEXT = "the cat sat on the mat; the dog sat on the log.\n" * 40


def run(config: TrainConfig, comm=None) -> tuple[np.ndarray, list[dict]]:
    trainer = Trainer(config, comm=comm or ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    rows = trainer.run()
    return np.concatenate([p.data.ravel() for p in trainer.model.parameters()]), rows


def p_ranks(config: TrainConfig, p: int) -> list[np.ndarray]:
    return [params for params, _ in run_world(p, lambda c: run(config, c))]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", [2, 3])
def test_p_ranks_follow_one_rank_on_addition(dtype, p):
    config = TrainConfig.from_keys({**TINY, "model.dtype": dtype})
    reference = p_ranks(config, 1)[0]
    results = p_ranks(config, p)
    for r in results:
        np.testing.assert_allclose(r, reference, rtol=0, atol=TOL[dtype])
    assert all(np.array_equal(r, results[0]) for r in results), "replicas drifted apart"
    assert not np.allclose(reference, build_params(dtype), atol=TOL[dtype]), "nothing trained"


def build_params(dtype: str) -> np.ndarray:
    model = build_model("gpt", (5,), 12, seed=0, dtype=np.dtype(dtype), n_layer=1, n_head=2,
                        n_embd=8)
    return np.concatenate([p.data.ravel() for p in model.parameters()])


# the MPI library's own all-reduce needs real MPI: tests/mpi/test_ddp.py covers it
@pytest.mark.parametrize("algorithm", [a for a in algorithms("allreduce") if a != "mpi"])
def test_every_algorithm_follows_one_rank(algorithm):
    config = TrainConfig.from_keys({**TINY, "optim.global_batch_size": 30,
                                    "model.dtype": "float64", "communication.algorithm": algorithm})
    reference = p_ranks(config, 1)[0]
    for r in p_ranks(config, 3):
        np.testing.assert_allclose(r, reference, rtol=0, atol=TOL["float64"])


def text_file(tmp_path: Path) -> str:
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def test_p_ranks_follow_one_rank_on_text(tmp_path):
    config = TrainConfig.from_keys({**TINY, "data.dataset": "text", "data.path": text_file(tmp_path),
                                    "model.block_size": 16, "model.dtype": "float64"})
    reference = p_ranks(config, 1)[0]
    for r in p_ranks(config, 2):
        np.testing.assert_allclose(r, reference, rtol=0, atol=TOL["float64"])


def test_rows_carry_throughput_and_task_metrics(tmp_path):
    _, rows = run(TrainConfig.from_keys({**TINY, "optim.epochs": 2}))
    for row in rows[:-1]:
        assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 5)
        assert row["flops_per_token"] == GPT(12, 5, 1, 2, 8).flops_per_token(5)
        assert 0 < row["mfu"] < 1 and row["flops_per_s"] > 0
        assert row["val_loss"] > 0 and 0 <= row["exact_match"] <= 1 and 0 <= row["test_acc"] <= 1
    assert rows[-1]["summary"] and rows[-1]["exact_match"] == rows[-2]["exact_match"]
    config = TrainConfig.from_keys({**TINY, "data.dataset": "text", "optim.epochs": 8,
                                    "optim.lr": 1e-2, "model.n_embd": 16,
                                    "data.path": text_file(tmp_path), "model.block_size": 16})
    _, rows = run(config)
    last = rows[-1]
    assert last["bits_per_char"] == pytest.approx(last["val_loss"] / np.log(2))
    assert last["bits_per_char"] < 0.8 * last["unigram_bits_per_char"], last


def test_the_table_adds_the_gpt_columns_only():
    out = io.StringIO()
    trainer = Trainer(TrainConfig.from_keys(TINY), comm=ThreadWorld(1).comm(0), out=out)
    trainer.setup()
    trainer.run()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("# mpdl train: gpt (1 layers, 2 heads, width 8, block 5")
    assert any("model FLOPs per token" in line and "GFLOP/s per core" in line for line in lines)
    columns = next(line for line in lines if line.startswith("epoch")).split()
    assert columns[-4:] == ["tok/s", "MFU", "val_loss", "exact"]
    assert "exact match" in lines[-1]


@pytest.mark.parametrize("changes,message", [
    ({"model.n_head": 3}, r"model\.n_embd 8 must be divisible by model\.n_head 3"),
    ({"model.n_layer": 0}, r"model\.n_layer: expected a positive number, got 0"),
    ({"model.block_size": 4},
     r"model\.block_size 4 is shorter than the sequences of data\.dataset addition"),
    ({"data.digits": 10}, r"data\.digits: expected 1 to 9 digits"),
    ({"data.dataset": "digits"},
     r"model\.name gpt trains on data\.dataset addition, text or shakespeare, not digits"),
    ({"data.dataset": "text"}, r"data\.dataset text needs data\.path FILE"),
    ({"model.name": "mlp"},
     r"data\.dataset addition is a token sequence task: it needs model\.name gpt"),
])
def test_bad_shapes_and_datasets_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig.from_keys({**TINY, **changes}), 1)


def test_the_peak_is_the_calibrated_one_or_measured(tmp_path):
    comm = ThreadWorld(1).comm(0)
    path = str(tmp_path / "model.json")
    measured = throughput.peak_flops(comm, path)
    assert measured.per_rank > 1e8 and "measured at the start of this run" in measured.source
    costmodel.save(path, costmodel.Params(gemm_flops=5e10, ranks=1, source="here"))
    peak = throughput.peak_flops(comm, path)
    assert peak == throughput.Peak(5e10, "calibrated: here")
    assert "peak 50.0 GFLOP/s per core x 2 = 100.0 GFLOP/s" in peak.describe(2)
    fields = throughput.fields(100.0, 11, 1000, peak, 2)
    assert fields == {"tokens_per_s": 1100.0, "flops_per_token": 1000, "flops_per_s": 1.1e6,
                      "mfu": 1.1e6 / 1e11}


def test_gpt_defaults():
    assert model_defaults("gpt") == {"data.dataset": "addition", "optim.optimizer": "adam",
                                     "optim.epochs": 8, "optim.global_batch_size": 128,
                                     "optim.warmup_epochs": 0.25}
    assert model_defaults("mlp") == {"data.dataset": "digits", "optim.optimizer": "sgd",
                                     "optim.epochs": 15, "optim.global_batch_size": 64,
                                     "optim.warmup_epochs": 0.0}
    assert TrainConfig.from_keys({"model.name": "gpt", "data.dataset": "addition",
                                  "optim.optimizer": "adam"}).base_lr() == 3e-3
