"""Every pipeline schedule over real MPI, at whatever size mpiexec gives (the Makefile runs
1..5): on every grid dp × pp = the world size with pp ≥ 2, interleaved (2 chunks per rank),
zb-h1, zb-v and dualpipev give the loss of every step of a plain one-process loop, within 1e-5 in
float32 and 1e-10 in float64 (as tests/mpi/test_pipeline.py), with ZeRO-1 where dp ≥ 2."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from oracle import adam_losses

from mpdl.autograd import nn, optim
from mpdl.collectives import allreduce
from mpdl.comm import as_communicator
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch

pytestmark = pytest.mark.mpi

P = MPI.COMM_WORLD.Get_size()
TOL = {"float32": 1e-5, "float64": 1e-10}
N, STEPS = 10, 3
#: (schedule, chunks per rank, microbatches as a function of pp)
RUNS = [("interleaved", 2, lambda pp: pp), ("zb-h1", 1, lambda pp: 3),
        ("zb-v", 2, lambda pp: 3), ("dualpipev", 2, lambda pp: 2 * pp)]


def make_model(dtype: str):
    """An MLP of 10 pieces: up to 5 stages of 2 chunks."""
    layers: list[nn.Module] = [nn.Flatten()]
    widths = [12, 10, 9, 9, 8, 8, 8, 8, 7, 7, 7]
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [nn.Linear(a, b, seed=i, dtype=dtype), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def data(dtype: str):
    rng = np.random.default_rng(5)
    return rng.standard_normal((N, 1, 3, 4)).astype(dtype), rng.integers(0, 7, N)


@pytest.mark.parametrize("schedule, v, m", RUNS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_grid_follows_one_process(schedule, v, m, dtype):
    grids = [(P // pp, pp) for pp in range(2, P + 1) if P % pp == 0]
    if not grids:
        pytest.skip(f"no grid with pp >= 2 on {P} rank(s)")
    x, y = data(dtype)
    ref = adam_losses(make_model(dtype), x, y, STEPS, 1e-2)
    for dp, pp in grids:
        strategy = PipelineStrategy(as_communicator(MPI.COMM_WORLD), dp, pp, microbatches=m(pp),
                                    schedule=schedule, virtual_stages=v, zero=int(dp > 1))
        strategy.setup(make_model(dtype), lambda p: optim.Adam(p, lr=1e-2))
        bounds = np.linspace(0, N, dp + 1).astype(int)
        d = strategy.data_comm.rank
        losses = []
        for _ in range(STEPS):
            r = strategy.step(Batch(x[bounds[d]:bounds[d + 1]], y[bounds[d]:bounds[d + 1]], N,
                                    1e-2))
            total = allreduce(np.array([r.loss, r.samples]), comm=strategy.data_comm)
            losses.append(total[0] / total[1])
        np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL[dtype],
                                   err_msg=f"dp {dp} pp {pp}")
