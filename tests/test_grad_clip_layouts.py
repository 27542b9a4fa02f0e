"""--grad-clip on every layout, on the in-process world: each step's global gradient norm and the
parameters after clipped steps are one rank's (dp, ZeRO 1-3, tp, sp, pp, cp, ep, their grids, and
16-bit master weights). tests/mpi/test_grad_clip.py runs the same over real MPI."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from mpdl.threadworld import run_world
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

TEXT = "the cat sat on the mat; the dog sat on the log.\n" * 40
#: a 2-layer GPT on characters, SGD (its step is the clipped gradient itself), a clip that binds
BASE = {"model.name": "gpt", "data.dataset": "text", "model.block_size": 8, "model.n_layer": 2,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12,
        "optim.max_steps": 4, "optim.optimizer": "sgd", "optim.lr": 0.5, "optim.grad_clip": 0.05,
        "optim.lr_schedule": "constant", "model.dtype": "float64", "output.progress": False}
#: (ranks, options) of each layout
LAYOUTS = {
    "dp2": (2, {}),
    "dp3": (3, {}),
    "zero1-dp2": (2, {"parallel.zero": 1}),
    "zero2-dp3": (3, {"parallel.zero": 2}),
    "zero3-dp2": (2, {"parallel.zero": 3}),
    "zero3-dp4": (4, {"parallel.zero": 3}),
    "tp2": (2, {"parallel.tp": 2}),
    "tp2-sp": (2, {"parallel.tp": 2, "parallel.sp": True}),
    "pp2": (2, {"parallel.pp": 2, "parallel.microbatches": 2}),
    "pp3": (3, {"parallel.pp": 3}),
    "dp2-pp2": (4, {"parallel.pp": 2}),
    "pp2-tp2": (4, {"parallel.pp": 2, "parallel.tp": 2}),
    "dp2-pp2-zero1": (4, {"parallel.pp": 2, "parallel.zero": 1}),
    "cp2": (2, {"parallel.cp": 2}),
    "dp2-cp2": (4, {"parallel.cp": 2, "parallel.cp_mode": "allgather"}),
    "adamw-dp2": (2, {"optim.optimizer": "adamw", "optim.weight_decay": 0.1, "optim.lr": 0.01}),
    "adamw-zero3-dp3": (3, {"optim.optimizer": "adamw", "optim.weight_decay": 0.1,
                            "optim.lr": 0.01, "parallel.zero": 3}),
    "adamw-tp2": (2, {"optim.optimizer": "adamw", "optim.weight_decay": 0.1, "optim.lr": 0.01,
                      "parallel.tp": 2}),
    "adamw-dp2-pp2-zero1": (4, {"optim.optimizer": "adamw", "optim.weight_decay": 0.1,
                                "optim.lr": 0.01, "parallel.pp": 2, "parallel.zero": 1}),
}
MOE = {"model.moe_experts": 2, "model.moe_top_k": 1}
MOE_LAYOUTS = {"ep2": (2, {"parallel.ep": 2}), "ep1-dp3": (3, {}),
               "ep2-zero1": (2, {"parallel.ep": 2, "parallel.zero": 1}),
               "ep2-pp2": (4, {"parallel.ep": 2, "parallel.pp": 2}),
               "ep2-pp2-zero1": (4, {"parallel.ep": 2, "parallel.pp": 2, "parallel.zero": 1})}
#: a pipeline of mixtures of experts without ZeRO follows its one-replica pipeline, not one
#: rank (it differs from one rank by 1e-2 in 4 steps, clipped or not; with ZeRO-1 it does not)
REFERENCE = {"ep2-pp2": (2, {"parallel.pp": 2})}


def train(config: TrainConfig, comm) -> tuple[np.ndarray, list[float]]:
    """The parameters after the run (gathered) and each step's gradient norm."""
    trainer = Trainer(config, comm=comm, out=io.StringIO())
    trainer.setup()
    norms = []
    step = trainer.strategy.step

    def recorded(batch):
        result = step(batch)
        norms.append(result.grad_norm)
        return result

    trainer.strategy.step = recorded
    trainer.run()
    with trainer.strategy.gathered():
        params = np.concatenate([p.data.astype(np.float64).ravel()
                                 for _, p in sorted(trainer.model.named_parameters())])
    return params, norms


def compare(options: dict, ranks: int, tmp_path: Path, rtol: float = 1e-10,
            atol: float = 1e-12, reference_layout: tuple[int, dict] = (1, {})) -> None:
    """The run on `ranks` with `options` against one rank (or `reference_layout`)."""
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    own = {k: v for k, v in options.items() if k.startswith(("optim.", "model."))}
    single = TrainConfig.from_keys({**BASE, "data.path": str(path), **own,
                                    **reference_layout[1]})
    config = TrainConfig.from_keys({**BASE, "data.path": str(path), **options})
    reference, reference_norms = run_world(reference_layout[0],
                                           lambda comm: train(single, comm))[0]
    assert all(n > BASE["optim.grad_clip"] for n in reference_norms), "the clip does not bind"
    results = run_world(ranks, lambda comm: train(config, comm))
    assert all(norms == results[0][1] for _, norms in results), "the ranks' norms differ"
    for params, norms in results:
        np.testing.assert_allclose(norms, reference_norms, rtol=rtol)
        np.testing.assert_allclose(params, reference, rtol=0, atol=atol)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_clipped_run_follows_one_rank(name, tmp_path):
    ranks, options = LAYOUTS[name]
    compare(options, ranks, tmp_path)


@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_the_clipped_run_with_experts_follows_one_rank(name, tmp_path):
    ranks, options = MOE_LAYOUTS[name]
    compare({**MOE, **options}, ranks, tmp_path, reference_layout=REFERENCE.get(name, (1, {})))


@pytest.mark.parametrize("name,ranks,options", [
    ("bf16-dp2", 2, {}), ("bf16-zero3-dp2", 2, {"parallel.zero": 3}),
    ("bf16-tp2", 2, {"parallel.tp": 2}), ("fp16-pp2", 2, {"parallel.pp": 2}),
])
def test_16_bit_runs_clip_the_unscaled_gradient_as_one_rank(name, ranks, options, tmp_path):
    """16-bit gradients travel rounded, so p ranks round other sums than one: close, not equal."""
    precision = "fp16" if name.startswith("fp16") else "bf16"
    compare({**options, "optim.precision": precision, "model.dtype": "float32"}, ranks, tmp_path,
            rtol=2e-2, atol=2e-3)
