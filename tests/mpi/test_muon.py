"""Muon over real MPI, at whatever size mpiexec gives (2, 3, 4): 40 steps of a small GPT on every
layout must end within 1e-4 of the naive one-rank Muon (`mpdl.autograd.muon.NaiveMuon`) that each
rank runs on its own, no communication: data parallelism (replicated), ZeRO 1-3 (each matrix
orthogonalized on its owner), and on even sizes tensor parallelism (tp 2: the split matrices
gathered), pipeline stages (pp 2) and ZeRO-1 on the pipeline's data axis.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.autograd import functional as F
from mpdl.autograd import optim
from mpdl.autograd.muon import NaiveMuon
from mpdl.autograd.tensor import Tensor
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.deterministic import DeterministicStrategy
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch
from mpdl.parallel.zero import ZeroStrategy

pytestmark = pytest.mark.mpi

P = MPI.COMM_WORLD.Get_size()
STEPS, BATCH, LR, WD = 40, 12, 2e-2, 0.1
TOL = 1e-4


def make_model() -> GPT:
    # float64: in float32 the keys' biases, whose gradient is zero up to round-off, take AdamW
    # steps of noise / (noise + eps) that differ by layout; Newton-Schulz still runs in float32
    return GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8, seed=0,
               dtype=np.float64)


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)  # counting by a step of 1 or 2 from a random start
    starts, strides = rng.integers(0, 11, (STEPS, BATCH, 1)), rng.integers(1, 3, (STEPS, BATCH, 1))
    seqs = (starts + strides * np.arange(7)) % 11
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def oracle() -> tuple[np.ndarray, list[float]]:
    """The naive Muon on one process: the parameters after STEPS steps and each step's loss."""
    model = make_model()
    opt = NaiveMuon(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x, y in batches():
        loss = F.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
    return np.concatenate([p.data.ravel() for p in model.parameters()]), losses


def train(strategy, data_axis=None) -> np.ndarray:
    """The whole parameters after STEPS steps of `strategy`, each rank of its data axis (default:
    its comm) taking its contiguous slice of each batch."""
    model = make_model()
    strategy.setup(model, lambda ps: optim.Muon(ps, lr=LR, weight_decay=WD))
    axis = data_axis or strategy.comm
    bounds = np.linspace(0, BATCH, axis.size + 1).astype(int)
    lo, hi = bounds[axis.rank], bounds[axis.rank + 1]
    exact = isinstance(strategy, DeterministicStrategy)  # one sample per atom
    extra = dict(count=BATCH * 6, atoms=[1] * (hi - lo)) if exact else {}
    for x, y in batches():
        strategy.step(Batch(x[lo:hi], y[lo:hi], BATCH, LR, **extra))
    with strategy.gathered():
        return np.concatenate([p.data.ravel().copy() for p in model.parameters()])


@pytest.fixture(scope="module")
def reference():
    params, losses = oracle()
    assert losses[-1] < losses[0] - 0.3
    return params


def comm():
    return as_communicator(MPI.COMM_WORLD)


def check(params: np.ndarray, reference: np.ndarray) -> None:
    mine = MPI.COMM_WORLD.allgather(params)
    for other in mine:
        np.testing.assert_array_equal(other[:params.size], mine[0][:params.size])
    np.testing.assert_allclose(params, reference, rtol=0, atol=TOL)


def test_data_parallel_follows_one_rank(reference):
    c = comm()
    check(train(AllReduceStrategy(c)), reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_follows_one_rank(reference, stage):
    c = comm()
    strategy = ZeroStrategy(c, stage, first_bucket_mb=1e-3, bucket_mb=2e-3)
    check(train(strategy), reference)
    assert (strategy.owners.sent_bytes > 0) == (c.size > 1)  # one rank owns every matrix


def test_deterministic_is_the_one_rank_run_bit_for_bit():
    c = comm()
    many = train(DeterministicStrategy(c, atoms=BATCH))
    alone = train(DeterministicStrategy(as_communicator(MPI.COMM_SELF), atoms=BATCH))
    np.testing.assert_array_equal(many, alone)


@pytest.mark.parametrize("pp, tp, zero", [(1, 2, 0), (2, 1, 0), (2, 1, 1)])
def test_tensor_and_pipeline_layouts_follow_one_rank(reference, pp, tp, zero):
    if P % (pp * tp):
        pytest.skip(f"pp {pp} × tp {tp} does not divide {P} ranks")
    strategy = PipelineStrategy(comm(), P // (pp * tp), pp, tp, microbatches=2, zero=zero)
    check(train(strategy, strategy.data_comm), reference)
