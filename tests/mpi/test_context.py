"""Context parallelism over real MPI, at whatever size mpiexec gives (the Makefile runs 1..5).

The GPT trained on a grid with cp ≥ 2 must give the loss trajectory of a plain one-process loop
on the same model, data and seed, within 1e-5 in float32: at cp = the world size ring attention
(zigzag), all-gather attention (contiguous) and Ulysses (where cp divides the 4 heads); at 4
ranks also cp × dp (ring), cp × tp with Megatron sequence parallelism (Ulysses) and cp × pp
(all-gather); plain cp × tp runs on the in-process world (tests/test_context.py).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI
from oracle import adam_losses

from mpdl.autograd import optim
from mpdl.collectives import allreduce
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch

pytestmark = pytest.mark.mpi

P = MPI.COMM_WORLD.Get_size()
N, STEPS = 4, 2
#: (dp, pp, tp, cp, mode, balance, sp)
LAYOUTS = [(1, 1, 1, P, mode, balance, False) for mode, balance in (
    ("ring", "zigzag"), ("allgather", "contiguous"), ("ulysses", "zigzag"))
    if mode != "ulysses" or 4 % P == 0]  # ulysses: the 4 heads over cp ranks
if P == 4:
    LAYOUTS += [(2, 1, 1, 2, "ring", "zigzag", False), (1, 1, 2, 2, "ulysses", "zigzag", True),
                (1, 2, 1, 2, "allgather", "zigzag", False)]


def gpt(length: int) -> GPT:
    return GPT(vocab_size=11, block_size=length, n_layer=2, n_head=4, n_embd=8, seed=0,
               dtype=np.float32)


def batch(length: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x, y = rng.integers(0, 11, (N, length)), rng.integers(0, 11, (N, length))
    y[:, :3] = -100  # positions without a target
    return x, y


@functools.lru_cache
def one_process(length: int) -> list[float]:
    x, y = batch(length)
    model = gpt(length)
    return adam_losses(model, x, y, STEPS, 1e-2)


@pytest.mark.skipif(P == 1, reason="context parallelism needs cp >= 2 ranks")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join(map(str, v)))
def test_context_parallel_grids_follow_one_process(layout):
    dp, pp, tp, cp, mode, balance, sp = layout
    length = 4 * cp * tp
    x, y = batch(length)
    comm = as_communicator(MPI.COMM_WORLD)
    strategy = PipelineStrategy(comm, dp, pp, tp, microbatches=2, cp=cp, cp_mode=mode,
                                cp_balance=balance, sp=sp)
    strategy.setup(gpt(length), lambda p: optim.Adam(p, lr=1e-2))
    bounds = np.linspace(0, N, dp + 1).astype(int)
    d, losses = strategy.data_comm.rank, []
    for _ in range(STEPS):
        r = strategy.step(Batch(x[bounds[d]:bounds[d + 1]], y[bounds[d]:bounds[d + 1]], N, 1e-2))
        total = allreduce(np.array([r.loss, r.samples]), comm=strategy.data_comm)
        losses.append(total[0] / total[1])
    np.testing.assert_allclose(losses, one_process(length), rtol=0, atol=1e-5)
