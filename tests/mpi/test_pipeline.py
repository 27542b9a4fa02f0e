"""Pipeline and tensor parallelism over real MPI, at whatever size mpiexec gives (the Makefile
runs 1..5).

Every grid (dp, pp) with dp × pp = the world size and pp ≥ 2 (none at 1 rank), both schedules,
1 and 3 microbatches, an MLP and the GPT: the loss of every step must be the loss of a plain
one-process loop that each rank runs on its own (no strategy, no communication) on the same
model, data and seed, within 1e-5 in float32 (round-off: the gradients add up in another order;
see tests/test_pipeline.py) and 1e-10 in float64. Tensor parallelism (tp = 2, the GPT's two
heads) on every grid (dp, pp, 2) of an even world size. Each also with ZeRO-1 on the
data-parallel axis (the optimizer state sharded over dp: reduce-scatter, step, all-gather).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from oracle import adam_losses

from mpdl.autograd import functional as F
from mpdl.autograd import nn, optim
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import allreduce
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch

pytestmark = pytest.mark.mpi

P = MPI.COMM_WORLD.Get_size()
TOL = {"float32": 1e-5, "float64": 1e-10}
N, STEPS = 10, 3
LAYOUTS = [(P // pp, pp) for pp in range(2, P + 1) if P % pp == 0]
#: (dp, pp, tp) with tp = 2 (the GPT's 2 heads)
TP_LAYOUTS = [(P // (2 * pp), pp, 2) for pp in range(1, P // 2 + 1) if P % (2 * pp) == 0]


def make_model(name: str, dtype: str):
    if name == "gpt":  # 4 pieces
        return GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=6, seed=0,
                   dtype=np.dtype(dtype))
    layers: list[nn.Module] = [nn.Flatten()]  # 5 pieces
    widths = [12, 10, 9, 8, 8, 7]
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [nn.Linear(a, b, seed=i, dtype=dtype), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def data(name: str, dtype: str):
    rng = np.random.default_rng(5)
    if name == "gpt":
        return rng.integers(0, 11, (N, 6)), rng.integers(0, 11, (N, 6))
    return rng.standard_normal((N, 1, 3, 4)).astype(dtype), rng.integers(0, 7, N)


def oracle(name: str, dtype: str) -> list[float]:
    model = make_model(name, dtype)
    x, y = data(name, dtype)
    return adam_losses(model, x, y, STEPS, 1e-2)


def layouts():
    if not LAYOUTS:
        pytest.skip(f"no grid with pp >= 2 on {P} rank(s)")
    return LAYOUTS


def run(dp: int, pp: int, tp: int, m: int, schedule: str, name: str, dtype: str,
        zero: int = 0) -> list[float]:
    comm = as_communicator(MPI.COMM_WORLD)
    strategy = PipelineStrategy(comm, dp, pp, tp, microbatches=m, schedule=schedule, zero=zero)
    strategy.setup(make_model(name, dtype), lambda p: optim.Adam(p, lr=1e-2))
    x, y = data(name, dtype)
    bounds = np.linspace(0, N, dp + 1).astype(int)
    d = strategy.data_comm.rank
    losses = []
    for _ in range(STEPS):
        r = strategy.step(Batch(x[bounds[d]:bounds[d + 1]], y[bounds[d]:bounds[d + 1]], N, 1e-2))
        total = allreduce(np.array([r.loss, r.samples]), comm=strategy.data_comm)
        losses.append(total[0] / total[1])
    return losses


@pytest.mark.parametrize("name, dtype", [("mlp", "float32"), ("gpt", "float32"),
                                         ("mlp", "float64"), ("gpt", "float64")])
@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_every_grid_follows_one_process(name, dtype, schedule):
    ref = oracle(name, dtype)
    for dp, pp in layouts():
        if pp > (4 if name == "gpt" else 5):
            continue  # more stages than pieces
        for m, zero in ((1, 0), (3, 0), (3, 1)):
            losses = run(dp, pp, 1, m, schedule, name, dtype, zero)
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL[dtype],
                                       err_msg=f"dp {dp} pp {pp} m {m} zero {zero}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_tensor_parallel_grids_follow_one_process(dtype, schedule):
    if not TP_LAYOUTS:
        pytest.skip(f"tp = 2 needs an even number of ranks, not {P}")
    ref = oracle("gpt", dtype)
    for dp, pp, tp in TP_LAYOUTS:
        for zero in (0, 1):
            losses = run(dp, pp, tp, 2, schedule, "gpt", dtype, zero)
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL[dtype],
                                       err_msg=f"dp {dp} pp {pp} tp {tp} zero {zero}")


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_zero_one_on_the_data_axis_follows_one_process(schedule):
    """ZeRO-1 over dp with pp = 1 or tp = 1 too: every (dp, pp) grid with dp >= 2."""
    grids = [(P // pp, pp) for pp in range(1, P) if P % pp == 0 and P // pp >= 2]
    if not grids:
        pytest.skip(f"no grid with dp >= 2 on {P} rank(s)")
    ref = oracle("mlp", "float32")
    for dp, pp in grids:
        losses = run(dp, pp, 1, 2, schedule, "mlp", "float32", zero=1)
        np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL["float32"],
                                   err_msg=f"dp {dp} pp {pp}")


def oracle_params(dtype: str, m: int) -> np.ndarray:
    """The MLP's parameters after STEPS steps of one process that runs the m microbatches one
    after the other (each loss scaled by its share of the batch, gradients adding up in
    microbatch order, as each pipeline stage adds them)."""
    model = make_model("mlp", dtype)
    opt = optim.Adam(model.parameters(), lr=1e-2)
    x, y = data("mlp", dtype)
    for _ in range(STEPS):
        for idx in np.array_split(np.arange(N), m):
            (F.cross_entropy(model(Tensor(x[idx])), y[idx]) * (len(idx) / N)).backward()
        opt.step()
        opt.zero_grad()
    return np.concatenate([p.data.ravel() for p in model.parameters()])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_a_pipeline_over_every_rank_is_the_one_process_run_bit_for_bit(schedule, dtype):
    """pp = the world size, dp = 1: activations and gradients travel through persistent
    receives (one per microbatch and kind, kept from step to step) and arrive bit-exact, so the
    parameters after 3 steps are the bytes of the one-process run with the same microbatches."""
    if not 2 <= P <= 5:
        pytest.skip(f"the MLP's 5 pieces make 2 to 5 stages, not {P}")
    for m in (1, 3):
        strategy = PipelineStrategy(as_communicator(MPI.COMM_WORLD), 1, P, 1, microbatches=m,
                                    schedule=schedule)
        model = make_model("mlp", dtype)
        strategy.setup(model, lambda p: optim.Adam(p, lr=1e-2))
        x, y = data("mlp", dtype)
        for step in range(STEPS):
            strategy.step(Batch(x, y, N, 1e-2))
            if step == 0:
                receives = dict(strategy._receives)
        assert strategy._receives == receives  # made in the first step, then started again
        kinds = {what for what, *_ in receives}
        assert len(receives) == m * len(kinds) and kinds == (
            {"act", "grad"} if 0 < strategy.stage < P - 1 else
            {"grad"} if strategy.stage == 0 else {"act"})
        assert all(r.persistent is not None for r in receives.values())
        with strategy.gathered():
            ours = np.concatenate([p.data.ravel() for p in model.parameters()])
        assert ours.tobytes() == oracle_params(dtype, m).tobytes(), f"m {m}"
