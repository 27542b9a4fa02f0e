"""NaiveDataParallel (an all-reduce per gradient after backward) on the in-process world: the
trajectory of one rank on the whole batch, and DDP's to the bit on 2 ranks."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.parallel import DistributedDataParallel, DistributedSampler
from mpdl.parallel.naive import NaiveDataParallel
from mpdl.threadworld import run_world

RNG = np.random.default_rng(1)
X = RNG.standard_normal((23, 5))  # 23 samples: a short last batch, unequal slices
Y = RNG.integers(0, 3, 23)


def train(comm, wrapper) -> np.ndarray:
    """Two epochs of SGD with momentum, batches of 7; comm=None: one rank on the whole batch."""
    rank, p = (comm.rank, comm.size) if comm is not None else (0, 1)
    model = nn.Sequential(nn.Linear(5, 6, seed=3 + 10 * rank, dtype=np.float64), nn.ReLU(),
                          nn.Linear(6, 3, seed=4 + 10 * rank, dtype=np.float64))  # unlike per rank
    wrapped = wrapper(model, comm) if comm is not None else None
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(len(X), 7, rank=rank, num_replicas=p, seed=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for idx, global_batch in sampler:
            if wrapped is not None:
                wrapped.set_local_batch(len(idx), global_batch)
            if len(idx):
                F.cross_entropy(model(Tensor(X[idx])), Y[idx]).backward()
            if isinstance(wrapped, NaiveDataParallel):
                wrapped.sync_gradients()
            elif wrapped is not None:
                wrapped.finish()
            opt.step()
            opt.zero_grad()
    return np.concatenate([q.data.ravel() for q in model.parameters()])


def naive(model, comm):
    return NaiveDataParallel(model, comm=comm, algorithm="ring")


def ddp(model, comm):
    return DistributedDataParallel(model, comm=comm, algorithm="ring", overlap=False,
                                   first_bucket_mb=1e-4, bucket_mb=4e-4)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_naive_data_parallel_follows_one_rank_on_the_whole_batch(p):
    reference = train(None, None)
    ranks = run_world(p, lambda c: train(c, naive))
    for got in ranks:
        assert got.tobytes() == ranks[0].tobytes(), "the replicas stay equal"
        np.testing.assert_allclose(got, reference, rtol=1e-10, atol=1e-12)


def test_naive_data_parallel_matches_ddp_bit_for_bit_on_two_ranks():
    # two ranks: each sum has two terms, so the buckets' order of addition cannot differ
    got = run_world(2, lambda c: train(c, naive))
    expected = run_world(2, lambda c: train(c, ddp))
    assert got[0].tobytes() == expected[0].tobytes()
