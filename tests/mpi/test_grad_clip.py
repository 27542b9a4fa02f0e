"""--grad-clip over real MPI, at whatever size mpiexec gives (1 to 4): on every layout that fits
the world size, each step's global gradient norm is one rank's (the same on every rank) and the
parameters after clipped SGD steps, whose update is the clipped gradient itself, are one rank's.
The one-rank run is the in-process world's, on each rank."""

from __future__ import annotations

import io

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.comm import as_communicator
from mpdl.threadworld import ThreadWorld
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

pytestmark = pytest.mark.mpi

P = MPI.COMM_WORLD.Get_size()
#: a 2-layer GPT on 2-digit addition (8 positions: cp 2 splits them in 4 zigzag chunks), SGD
#: at a clip that binds on every step
BASE = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 2, "model.n_layer": 2,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12,
        "optim.max_steps": 4, "optim.optimizer": "sgd", "optim.lr": 0.5, "optim.grad_clip": 0.05,
        "optim.lr_schedule": "constant", "model.dtype": "float64", "output.progress": False}
EVEN = P % 2 == 0
LAYOUTS = {
    "dp": {},
    "zero1": {"parallel.zero": 1},
    "zero2": {"parallel.zero": 2},
    "zero3": {"parallel.zero": 3},
    "adamw-zero3": {"parallel.zero": 3, "optim.optimizer": "adamw", "optim.lr": 0.01,
                    "optim.weight_decay": 0.1},
    **({"tp2": {"parallel.tp": 2}, "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
        "pp2": {"parallel.pp": 2, "parallel.microbatches": 2},
        "pp2-zero1": {"parallel.pp": 2, "parallel.zero": 1},
        "cp2": {"parallel.cp": 2},
        "ep2": {"model.moe_experts": 2, "model.moe_top_k": 1, "parallel.ep": 2},
        "ep2-zero1": {"model.moe_experts": 2, "model.moe_top_k": 1, "parallel.ep": 2,
                      "parallel.zero": 1}} if EVEN else {}),
    # a stage per rank: n_layer + 2 pieces to cut (the embedding and the head are pieces too)
    **({f"pp{P}": {"parallel.pp": P, "model.n_layer": max(2, P - 2)}} if P > 2 else {}),
    **({"pp2-tp2": {"parallel.pp": 2, "parallel.tp": 2}} if P == 4 else {}),
}


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
        params = np.concatenate([p.data.ravel()
                                 for _, p in sorted(trainer.model.named_parameters())])
    return params, norms


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_clipped_gradient_is_one_ranks(name):
    options = LAYOUTS[name]
    own = {k: v for k, v in options.items() if k.startswith(("optim.", "model."))}
    reference, reference_norms = train(TrainConfig.from_keys({**BASE, **own}),
                                       ThreadWorld(1).comm(0))
    assert all(n > BASE["optim.grad_clip"] for n in reference_norms), "the clip does not bind"
    params, norms = train(TrainConfig.from_keys({**BASE, **options}),
                          as_communicator(MPI.COMM_WORLD))
    everyone = MPI.COMM_WORLD.allgather(norms)
    assert all(n == everyone[0] for n in everyone), "the ranks' norms differ"
    np.testing.assert_allclose(norms, reference_norms, rtol=1e-10)
    np.testing.assert_allclose(params, reference, rtol=0, atol=1e-12)
